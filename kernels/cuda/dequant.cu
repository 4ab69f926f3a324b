// GGUF block formats dequantized to bf16 at load (the weights the cuBLAS GEMMs
// read), exactly as quant::dequantize_block computes them in f32 (q * d + m, no
// fused multiply-add), then rounded to bf16 (nearest even).
//
// Blocks of 32 values, little-endian (GGML's ggml-common.h):
// - Q4_0: f16 d, 16 bytes; value j < 16 is (lo nibble of byte j - 8) * d,
//   value j + 16 is (hi nibble - 8) * d. 18 bytes.
// - Q4_1: f16 d, f16 m, 16 bytes; values nibble * d + m. 20 bytes.
// - Q8_0: f16 d, 32 signed bytes; values q * d. 34 bytes.
// Every block size is even, so the f16 fields are 2-byte aligned.
#include "tessera_common.cuh"

// One thread per byte pair (block b, byte j < 16): values j and j + 16 of block b.
// Grid ceil(n_blocks * 16 / 256); block 256. out: [n_blocks * 32] bf16.
extern "C" __global__ void dequant_q4_0(const u8* __restrict__ blocks, u64 n_blocks,
                                        u16* __restrict__ out) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_blocks * 16) return;
    const u64 b = i / 16;
    const u32 j = (u32)(i - b * 16);
    const u8* blk = blocks + b * 18;
    const float d = f16_to_f32(*reinterpret_cast<const u16*>(blk));
    const float m = __fmul_rn(-8.f, d);
    const u8 q = blk[2 + j];
    out[b * 32 + j] = f32_to_bf16(__fadd_rn(__fmul_rn((float)(q & 0x0f), d), m));
    out[b * 32 + j + 16] = f32_to_bf16(__fadd_rn(__fmul_rn((float)(q >> 4), d), m));
}

// As dequant_q4_0 for Q4_1 (20-byte blocks with an explicit minimum m).
extern "C" __global__ void dequant_q4_1(const u8* __restrict__ blocks, u64 n_blocks,
                                        u16* __restrict__ out) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_blocks * 16) return;
    const u64 b = i / 16;
    const u32 j = (u32)(i - b * 16);
    const u8* blk = blocks + b * 20;
    const float d = f16_to_f32(*reinterpret_cast<const u16*>(blk));
    const float m = f16_to_f32(*reinterpret_cast<const u16*>(blk + 2));
    const u8 q = blk[4 + j];
    out[b * 32 + j] = f32_to_bf16(__fadd_rn(__fmul_rn((float)(q & 0x0f), d), m));
    out[b * 32 + j + 16] = f32_to_bf16(__fadd_rn(__fmul_rn((float)(q >> 4), d), m));
}

// One thread per value. Grid ceil(n_blocks * 32 / 256); block 256.
extern "C" __global__ void dequant_q8_0(const u8* __restrict__ blocks, u64 n_blocks,
                                        u16* __restrict__ out) {
    const u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_blocks * 32) return;
    const u64 b = i / 32;
    const u32 j = (u32)(i - b * 32);
    const u8* blk = blocks + b * 34;
    const float d = f16_to_f32(*reinterpret_cast<const u16*>(blk));
    out[i] = f32_to_bf16(__fmul_rn((float)(i8)blk[2 + j], d));
}
