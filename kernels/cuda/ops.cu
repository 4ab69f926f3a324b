// Elementwise and normalization kernels of the llama forward pass on the device,
// the counterparts of kernels/src/ops.rs (same formulas, f32 arithmetic), plus the
// conversions around the bf16 GEMMs and the greedy argmax.
#include "tessera_common.cuh"

// Sum over a block of `blockDim.x` threads (a multiple of 32, at most 1024).
__device__ float block_sum(float v) {
    __shared__ float partial[32];
    const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    const u32 warps = blockDim.x >> 5;
    v = lane < warps ? partial[lane] : 0.f;
    return warp_sum(v);
}

// x[r, :] = table[tokens[r], :] (bf16 embedding rows to f32); a token id outside
// the vocabulary gives a zero row (the engine validates ids before any step).
// Grid rows; block 256.
extern "C" __global__ void embed_rows(const u16* __restrict__ table, const u32* __restrict__ tokens,
                                      u32 d, u32 vocab, float* __restrict__ x) {
    const u32 r = blockIdx.x;
    const u32 tok = tokens[r];
    for (u32 i = threadIdx.x; i < d; i += blockDim.x) {
        x[(u64)r * d + i] = tok < vocab ? bf16_to_f32(table[(u64)tok * d + i]) : 0.f;
    }
}

// RMSNorm (Zhang & Sennrich 2019): out[i] = x[src] / sqrt(mean(x[src]^2) + eps) * w,
// src = rows ? rows[i] : i, as ops::rms_norm (inv = 1 / sqrt(ss + eps), then
// x * inv * w). Writes out_f32 and/or out_bf16 (either may be null), [n, d].
// Grid n; block 256.
extern "C" __global__ void rms_norm(const float* __restrict__ x, const float* __restrict__ w,
                                    float eps, u32 d, const u32* __restrict__ rows,
                                    float* __restrict__ out_f32, u16* __restrict__ out_bf16) {
    const u32 i = blockIdx.x;
    const u32 src = rows ? rows[i] : i;
    const float* xr = x + (u64)src * d;
    float ss = 0.f;
    for (u32 j = threadIdx.x; j < d; j += blockDim.x) ss += xr[j] * xr[j];
    ss = block_sum(ss) / (float)d;
    const float inv = 1.f / sqrtf(ss + eps);
    for (u32 j = threadIdx.x; j < d; j += blockDim.x) {
        const float o = __fmul_rn(__fmul_rn(xr[j], inv), w[j]);
        if (out_f32) out_f32[(u64)i * d + j] = o;
        if (out_bf16) out_bf16[(u64)i * d + j] = f32_to_bf16(o);
    }
}

// RoPE (RoFormer, Su et al. 2021), GGML's normal mode as ops::Rope::apply: for each
// of `heads` heads starting at column col0 of row r, rotate pairs (2i, 2i+1) by
// pos[r] * inv_freq[i]. x is [rows, stride] f32, rotated in place.
// Grid rows; block 256 (threads over heads * head_dim / 2 pairs).
extern "C" __global__ void rope(float* __restrict__ x, u32 stride, u32 col0, u32 heads, u32 hd,
                                const u32* __restrict__ pos, const float* __restrict__ inv_freq) {
    const u32 r = blockIdx.x;
    const u32 half = hd / 2;
    const float p = (float)pos[r];
    for (u32 k = threadIdx.x; k < heads * half; k += blockDim.x) {
        const u32 head = k / half, i = k - head * half;
        float s, c;
        sincosf(p * inv_freq[i], &s, &c);
        float* xh = x + (u64)r * stride + col0 + head * hd;
        const float a = xh[2 * i], b = xh[2 * i + 1];
        xh[2 * i] = __fsub_rn(__fmul_rn(a, c), __fmul_rn(b, s));
        xh[2 * i + 1] = __fadd_rn(__fmul_rn(a, s), __fmul_rn(b, c));
    }
}

// SwiGLU over a stacked gate/up projection, as ops::swiglu_rows:
// out[r, i] = g / (1 + exp(-g)) * u with g = gate_up[r, i], u = gate_up[r, ffn + i].
// gate_up is [n, 2 * ffn] f32; writes out_f32 and/or out_bf16 ([n, ffn]).
// Grid n; block 256.
extern "C" __global__ void swiglu(const float* __restrict__ gate_up, u32 ffn,
                                  float* __restrict__ out_f32, u16* __restrict__ out_bf16) {
    const u32 r = blockIdx.x;
    const float* gu = gate_up + (u64)r * 2 * ffn;
    for (u32 i = threadIdx.x; i < ffn; i += blockDim.x) {
        const float g = gu[i], u = gu[ffn + i];
        const float o = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.f, expf(-g))), u);
        if (out_f32) out_f32[(u64)r * ffn + i] = o;
        if (out_bf16) out_bf16[(u64)r * ffn + i] = f32_to_bf16(o);
    }
}

// out[i] = bf16(x[i]) for i < n (round to nearest even). Grid ceil(n / 256); block 256.
extern "C" __global__ void to_bf16(const float* __restrict__ x, u64 n, u16* __restrict__ out) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16(x[i]);
}

// Greedy choice per row of logits [rows, vocab]: the index of the largest value,
// the lowest index on ties, NaN skipped (sampling::argmax); vocab if all are NaN.
// Grid rows; block 256.
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, u32 vocab,
                                       u32* __restrict__ out) {
    __shared__ float best_v[256];
    __shared__ u32 best_i[256];
    const u32 r = blockIdx.x;
    const float* lr = logits + (u64)r * vocab;
    float bv = NEG_INF;
    u32 bi = vocab;
    for (u32 j = threadIdx.x; j < vocab; j += blockDim.x) {
        const float v = lr[j];
        if (!isnan(v) && (bi == vocab || v > bv)) {
            bv = v;
            bi = j;
        }
    }
    best_v[threadIdx.x] = bv;
    best_i[threadIdx.x] = bi;
    __syncthreads();
    for (u32 s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            const float ov = best_v[threadIdx.x + s];
            const u32 oi = best_i[threadIdx.x + s];
            const float mv = best_v[threadIdx.x];
            const u32 mi = best_i[threadIdx.x];
            if (oi != vocab && (mi == vocab || ov > mv || (ov == mv && oi < mi))) {
                best_v[threadIdx.x] = ov;
                best_i[threadIdx.x] = oi;
            }
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) out[r] = best_i[0];
}
