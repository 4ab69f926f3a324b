//! Elementwise and normalization ops of the transformer forward pass (llama,
//! and the NEOX RoPE and GeGLU of qwen2 and gemma).

/// RMSNorm (Zhang & Sennrich 2019): `out = x / sqrt(mean(x^2) + eps) * w`, per row.
/// `x` and `out` are `[n, w.len()]`.
///
/// Each row's sum of squares is one left-to-right `f32` chain (`((x0^2 + x1^2) +
/// x2^2) + ...`), as [`rms_norm_row`] computes it. That chain is latency-bound, so
/// rows are taken [`NORM_ROWS`] at a time with one chain each (the same operations
/// per row, interleaved), and many rows are split over the pool: the result of
/// every row is [`rms_norm_row`]'s, bit for bit, whatever `n`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    assert_eq!(x.len(), out.len(), "rms_norm shapes");
    if d == 0 {
        return;
    }
    let n = x.len() / d;
    let pool = crate::pool::global();
    // Pool regions cost microseconds: only batches of rows are split.
    let per = n.div_ceil(pool.threads()).max(32);
    let base = RowsPtr(out.as_mut_ptr());
    let rows = |c: usize| {
        let (r0, r1) = (c * per, ((c + 1) * per).min(n));
        // SAFETY: rows r0..r1 of `out` are in bounds and written by this task only.
        let o = unsafe { std::slice::from_raw_parts_mut(base.at(r0 * d), (r1 - r0) * d) };
        rms_norm_rows(&x[r0 * d..r1 * d], w, eps, o);
    };
    match n.div_ceil(per) {
        0 => {}
        1 => rows(0),
        chunks => pool.parallel_for(chunks, rows),
    }
}

/// Rows whose sums of squares run as interleaved chains in [`rms_norm`].
const NORM_ROWS: usize = 8;

/// [`rms_norm`] of rows `[n, w.len()]` on this thread.
fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    let mut xg = x.chunks_exact(NORM_ROWS * d);
    let mut og = out.chunks_exact_mut(NORM_ROWS * d);
    for (xs, os) in (&mut xg).zip(&mut og) {
        let rows: [&[f32]; NORM_ROWS] = std::array::from_fn(|j| &xs[j * d..(j + 1) * d]);
        // `Sum` for `f32` folds from -0.0; with squares (>= +0) the first addition
        // gives the same value as from +0.0, so this is `rms_norm_row`'s chain.
        let mut ss = [-0.0f32; NORM_ROWS];
        // Column k of all rows at once: each row's own chain, interleaved.
        #[allow(clippy::needless_range_loop)]
        for k in 0..d {
            for j in 0..NORM_ROWS {
                ss[j] += rows[j][k] * rows[j][k];
            }
        }
        for (j, or) in os.chunks_exact_mut(d).enumerate() {
            scale_row(rows[j], ss[j], w, eps, or);
        }
    }
    for (xr, or) in xg
        .remainder()
        .chunks_exact(d)
        .zip(og.into_remainder().chunks_exact_mut(d))
    {
        rms_norm_row(xr, w, eps, or);
    }
}

/// RMSNorm of one row: the reference arithmetic of [`rms_norm`].
fn rms_norm_row(xr: &[f32], w: &[f32], eps: f32, or: &mut [f32]) {
    let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>();
    scale_row(xr, ss, w, eps, or);
}

/// `or = xr / sqrt(ss / d + eps) * w` given the row's sum of squares `ss`.
#[inline]
fn scale_row(xr: &[f32], ss: f32, w: &[f32], eps: f32, or: &mut [f32]) {
    let ss = ss / w.len() as f32;
    let inv = 1.0 / (ss + eps).sqrt();
    for ((o, &xv), &wv) in or.iter_mut().zip(xr).zip(w) {
        *o = xv * inv * wv;
    }
}

/// Rotary position embedding tables (RoFormer, Su et al. 2021) for one head size.
#[derive(Debug, Clone)]
pub struct Rope {
    head_dim: usize,
    inv_freq: Vec<f32>,
}

impl Rope {
    /// `inv_freq[i] = base^(-2i / head_dim)`.
    pub fn new(head_dim: usize, base: f32) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| base.powf(-2.0 * i as f32 / head_dim as f32))
            .collect();
        Self { head_dim, inv_freq }
    }

    /// The rotation frequencies, `[head_dim / 2]` (the device RoPE reads them).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Rotates adjacent pairs `(x[2i], x[2i+1])` of every head in `x`
    /// (`[n_heads * head_dim]`) by `pos * inv_freq[i]`: GGML's "normal" RoPE mode,
    /// which llama GGUF files expect (their Q/K weights are permuted for it).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        // The angles depend on the position only: once for all heads.
        let sc: Vec<(f32, f32)> = self
            .inv_freq
            .iter()
            .map(|&f| (pos as f32 * f).sin_cos())
            .collect();
        for head in x.chunks_exact_mut(self.head_dim) {
            for (i, &(s, c)) in sc.iter().enumerate() {
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * c - b * s;
                head[2 * i + 1] = a * s + b * c;
            }
        }
    }

    /// Rotates the pairs `(x[i], x[i + head_dim / 2])` of every head in `x`
    /// (`[n_heads * head_dim]`) by `pos * inv_freq[i]`: GGML's NEOX RoPE mode
    /// (`GGML_ROPE_TYPE_NEOX`, the rotate-half form of Hugging Face's models),
    /// which qwen2 and gemma3 GGUF files expect (their Q/K rows are not permuted).
    pub fn apply_neox(&self, x: &mut [f32], pos: usize) {
        let half = self.head_dim / 2;
        let sc: Vec<(f32, f32)> = self
            .inv_freq
            .iter()
            .map(|&f| (pos as f32 * f).sin_cos())
            .collect();
        for head in x.chunks_exact_mut(self.head_dim) {
            let (lo, hi) = head.split_at_mut(half);
            for ((a, b), &(s, c)) in lo.iter_mut().zip(hi.iter_mut()).zip(&sc) {
                let (x0, x1) = (*a, *b);
                *a = x0 * c - x1 * s;
                *b = x0 * s + x1 * c;
            }
        }
    }
}

/// GeGLU over rows of a stacked gate/up projection: for each row `r` of
/// `gate_up` (`[n, 2 * ffn]`: gate then up), `out[r] = gelu_tanh(gate) * up`
/// (`out`: `[n, ffn]`), the MLP of Gemma (Shazeer 2020, "GLU Variants Improve
/// Transformer"; llama.cpp's `LLM_FFN_GELU` with `LLM_FFN_PAR`). Rows run in
/// parallel on the global pool; each row's values are exactly those of
/// [`geglu`].
pub fn gelu_tanh_rows(gate_up: &[f32], ffn: usize, out: &mut [f32]) {
    glu_rows(gate_up, ffn, out, geglu);
}

/// SwiGLU over rows of a stacked gate/up projection: for each row `r` of
/// `gate_up` (`[n, 2 * ffn]`: gate then up), `out[r] = silu(gate) * up`
/// (`out`: `[n, ffn]`). Rows run in parallel on the global pool; each row's
/// values are exactly those of [`swiglu`].
pub fn swiglu_rows(gate_up: &[f32], ffn: usize, out: &mut [f32]) {
    glu_rows(gate_up, ffn, out, swiglu);
}

/// `out[r] = gate(r)`, then `gate_fn(out[r], up(r))`, for each row `r` of a
/// stacked gate/up projection (`gate_up` `[n, 2 * ffn]`, `out` `[n, ffn]`), in
/// parallel on the global pool.
fn glu_rows<F: Fn(&mut [f32], &[f32]) + Sync>(
    gate_up: &[f32],
    ffn: usize,
    out: &mut [f32],
    gate_fn: F,
) {
    let n = out.len() / ffn.max(1);
    assert_eq!(gate_up.len(), 2 * n * ffn, "gate/up shape");
    assert_eq!(out.len(), n * ffn, "output shape");
    let pool = crate::pool::global();
    let per = n.div_ceil(pool.threads()).max(8);
    let base = RowsPtr(out.as_mut_ptr());
    let rows = |c: usize| {
        for r in c * per..((c + 1) * per).min(n) {
            // SAFETY: row r of `out` is in bounds and written by this task only.
            let g = unsafe { std::slice::from_raw_parts_mut(base.at(r * ffn), ffn) };
            let gu = &gate_up[2 * r * ffn..2 * (r + 1) * ffn];
            g.copy_from_slice(&gu[..ffn]);
            gate_fn(g, &gu[ffn..]);
        }
    };
    match n.div_ceil(per) {
        0 => {}
        1 => rows(0),
        chunks => pool.parallel_for(chunks, rows),
    }
}

/// Base pointer of a row-major buffer whose rows pool tasks write disjointly.
#[derive(Clone, Copy)]
struct RowsPtr(*mut f32);
// SAFETY: tasks write disjoint rows of a buffer that outlives the region.
unsafe impl Send for RowsPtr {}
unsafe impl Sync for RowsPtr {}
impl RowsPtr {
    fn at(self, i: usize) -> *mut f32 {
        // SAFETY: callers pass in-bounds indices.
        unsafe { self.0.add(i) }
    }
}

/// SwiGLU gate: `gate[i] = silu(gate[i]) * up[i]`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

/// GeGLU gate: `gate[i] = gelu_tanh(gate[i]) * up[i]` ([`gelu_tanh`]).
pub fn geglu(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::isa() == crate::isa::Isa::Avx512Vnni {
        // SAFETY: `isa()` verified avx512f (and avx2, fma).
        return unsafe { expf_avx512::geglu(gate, up) };
    }
    geglu_scalar(gate, up);
}

/// [`geglu`] one value at a time, with the C library's `expf`.
fn geglu_scalar(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = gelu_tanh(*g) * u;
    }
}

/// [`geglu`] 8 values at a time with an `expf` that gives glibc's bits: the
/// algorithm of glibc's `expf` (sysdeps/ieee754/flt-32/e_expf.c, from Arm's
/// optimized-routines; glibc 2.27 and later) with the operations, fused
/// multiply-adds included, of its `__expf_fma` build, which `f32::exp` calls on
/// x86-64 with FMA, and its table and constants (`__exp2f_data`). Arguments
/// outside its main path (`|x| >= 88`, infinities, NaN) take the scalar path for
/// their 8 values. `geglu_matches_the_scalar_loop_bitwise` checks the two paths
/// agree; `vector_expf_equals_libm_expf_across_the_f32_range` checks a sweep of the
/// whole `f32` range and the path's edges against `f32::exp`.
#[cfg(target_arch = "x86_64")]
mod expf_avx512 {
    use std::arch::x86_64::*;

    /// `__exp2f_data.tab`: `2^(i/32)`'s bits less `i << 47`.
    const TAB: [u64; 32] = [
        0x3ff0000000000000,
        0x3fefd9b0d3158574,
        0x3fefb5586cf9890f,
        0x3fef9301d0125b51,
        0x3fef72b83c7d517b,
        0x3fef54873168b9aa,
        0x3fef387a6e756238,
        0x3fef1e9df51fdee1,
        0x3fef06fe0a31b715,
        0x3feef1a7373aa9cb,
        0x3feedea64c123422,
        0x3feece086061892d,
        0x3feebfdad5362a27,
        0x3feeb42b569d4f82,
        0x3feeab07dd485429,
        0x3feea47eb03a5585,
        0x3feea09e667f3bcd,
        0x3fee9f75e8ec5f74,
        0x3feea11473eb0187,
        0x3feea589994cce13,
        0x3feeace5422aa0db,
        0x3feeb737b0cdc5e5,
        0x3feec49182a3f090,
        0x3feed503b23e255d,
        0x3feee89f995ad3ad,
        0x3feeff76f2fb5e47,
        0x3fef199bdd85529c,
        0x3fef3720dcef9069,
        0x3fef5818dcfba487,
        0x3fef7c97337b9b5f,
        0x3fefa4afa2a490da,
        0x3fefd0765b6e4540,
    ];
    /// `__exp2f_data.invln2_scaled` (32 / ln 2), `.shift` (1.5 * 2^52) and
    /// `.poly_scaled`.
    const INV_LN2_N: u64 = 0x40471547652b82fe;
    const SHIFT: u64 = 0x4338000000000000;
    const C: [u64; 3] = [0x3ebc6af84b912394, 0x3f2ebfce50fac4f3, 0x3f962e42ff0c52d6];

    /// `expf` of 8 values, each with `|x| < 88` (the main path: bits 20..31 of
    /// `|x|` at most 0x42a).
    #[inline]
    #[target_feature(enable = "avx512f,avx2,fma")]
    fn expf8(x: __m256) -> __m256 {
        let f = |b: u64| _mm512_set1_pd(f64::from_bits(b));
        let (inv_ln2_n, shift) = (f(INV_LN2_N), f(SHIFT));
        // SAFETY: 32 u64, four registers of 8.
        let tab: [__m512i; 4] =
            std::array::from_fn(|i| unsafe { _mm512_loadu_si512(TAB[8 * i..].as_ptr().cast()) });
        let xd = _mm512_cvtps_pd(x);
        // kd = round(x * N / ln 2) through the shift; r = x * N / ln 2 - kd, fused.
        let kd = _mm512_fmadd_pd(inv_ln2_n, xd, shift);
        let ki = _mm512_castpd_si512(kd);
        let kd = _mm512_sub_pd(kd, shift);
        let r = _mm512_fmsub_pd(inv_ln2_n, xd, kd);
        // t = tab[ki % 32] + (ki << 47): entries 0..16 and 16..32, chosen by bit 4.
        let lo = _mm512_permutex2var_epi64(tab[0], ki, tab[1]);
        let hi = _mm512_permutex2var_epi64(tab[2], ki, tab[3]);
        let upper = _mm512_test_epi64_mask(ki, _mm512_set1_epi64(16));
        let t = _mm512_mask_blend_epi64(upper, lo, hi);
        let s = _mm512_castsi512_pd(_mm512_add_epi64(t, _mm512_slli_epi64::<47>(ki)));
        // s * (C0 r^3 + C1 r^2 + C2 r + 1), as glibc's FMA build orders it.
        let z = _mm512_fmadd_pd(r, f(C[0]), f(C[1]));
        let r2 = _mm512_mul_pd(r, r);
        let y = _mm512_fmadd_pd(r, f(C[2]), _mm512_set1_pd(1.0));
        let y = _mm512_fmadd_pd(z, r2, y);
        _mm512_cvtpd_ps(_mm512_mul_pd(y, s))
    }

    /// Whether every lane of `x` is on [`expf8`]'s main path.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn main_path(x: __m256) -> bool {
        let top = _mm256_and_si256(
            _mm256_srli_epi32::<20>(_mm256_castps_si256(x)),
            _mm256_set1_epi32(0x7ff),
        );
        _mm256_movemask_epi8(_mm256_cmpgt_epi32(top, _mm256_set1_epi32(0x42a))) == 0
    }

    /// `expf` of 8 values, glibc's bits for every input.
    #[cfg(test)]
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) fn expf8_checked(x: [f32; 8]) -> [f32; 8] {
        // SAFETY: 8 floats.
        let v = unsafe { _mm256_loadu_ps(x.as_ptr()) };
        if !main_path(v) {
            return x.map(f32::exp);
        }
        let mut out = [0f32; 8];
        // SAFETY: 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), expf8(v)) };
        out
    }

    /// [`super::geglu`]: per value [`super::gelu_tanh`]'s operations in its order.
    #[target_feature(enable = "avx512f,avx2,fma")]
    pub(super) fn geglu(gate: &mut [f32], up: &[f32]) {
        let n = gate.len().min(up.len());
        let (a, c) = (
            _mm256_set1_ps(0.044_715),
            _mm256_set1_ps(-super::TWO_SQRT_2_OVER_PI),
        );
        let one = _mm256_set1_ps(1.0);
        let mut i = 0;
        while i + 8 <= n {
            // SAFETY: i + 8 <= n <= both lengths.
            let x = unsafe { _mm256_loadu_ps(gate.as_ptr().add(i)) };
            let u = unsafe { _mm256_loadu_ps(up.as_ptr().add(i)) };
            // -C * (x + ((0.044715 * x) * x) * x)
            let x3 = _mm256_mul_ps(_mm256_mul_ps(_mm256_mul_ps(a, x), x), x);
            let arg = _mm256_mul_ps(c, _mm256_add_ps(x, x3));
            if main_path(arg) {
                let g = _mm256_div_ps(x, _mm256_add_ps(one, expf8(arg)));
                // SAFETY: as above.
                unsafe { _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(g, u)) };
            } else {
                super::geglu_scalar(&mut gate[i..i + 8], &up[i..i + 8]);
            }
            i += 8;
        }
        super::geglu_scalar(&mut gate[i..n], &up[i..n]);
    }
}

/// GELU in its tanh approximation (Hendrycks & Gimpel 2016):
/// `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`, Hugging Face's
/// `gelu_pytorch_tanh` (Gemma's `hidden_activation`) and GGML's `ggml_gelu`
/// formula (`GELU_COEF_A`, `SQRT_2_OVER_PI`), in `f32`. Computed as
/// `x / (1 + exp(-2z))` with `z = sqrt(2/pi) (x + 0.044715 x^3)`, the same value
/// (`(1 + tanh z) / 2 = sigmoid(2z)`): one `exp` is about half the cost of `tanh`
/// (whose libm form calls `expm1`), and GeGLU was a tenth of Gemma's prefill.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    x / (1.0 + (-TWO_SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).exp())
}

/// `2 sqrt(2 / pi)` of [`gelu_tanh`].
const TWO_SQRT_2_OVER_PI: f32 = 2.0 * 0.797_884_6;

#[cfg(test)]
mod tests {
    use super::*;

    /// The interleaved, pooled `rms_norm` against the original one-row loop, bit
    /// for bit, for row counts around the interleave and the pool split.
    #[test]
    fn rms_norm_equals_the_one_row_loop_bitwise() {
        let reference = |x: &[f32], w: &[f32], eps: f32, out: &mut [f32]| {
            let d = w.len();
            for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
                let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
                let inv = 1.0 / (ss + eps).sqrt();
                for ((o, &xv), &wv) in or.iter_mut().zip(xr).zip(w) {
                    *o = xv * inv * wv;
                }
            }
        };
        let mut state = 0x9e37_79b9u32;
        let mut rnd = move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state % 20_001) as f32 / 1000.0 - 10.0
        };
        for d in [1, 7, 64, 256, 640] {
            let w: Vec<f32> = (0..d).map(|_| rnd()).collect();
            for n in [0, 1, 7, 8, 9, 31, 33, 64, 100] {
                let mut x: Vec<f32> = (0..n * d).map(|_| rnd() * rnd()).collect();
                if n > 2 {
                    x[d..2 * d].fill(0.0);
                    x[2 * d] = -0.0;
                }
                let (mut got, mut want) = (vec![0f32; n * d], vec![0f32; n * d]);
                rms_norm(&x, &w, 1e-6, &mut got);
                reference(&x, &w, 1e-6, &mut want);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "d {d}, n {n}");
            }
        }
    }

    #[test]
    fn geglu_matches_the_scalar_loop_bitwise() {
        let mut state = 0x2545_f491u32;
        let mut rnd = move || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            state
        };
        let specials = [
            0.0,
            -0.0,
            1e-30,
            -1e-30,
            30.0,
            -30.0,
            1e30,
            -1e30,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
        ];
        for len in [0, 1, 7, 8, 9, 64, 1000, 2048] {
            for round in 0..20 {
                let gate: Vec<f32> = (0..len)
                    .map(|_| match rnd() % 16 {
                        0 => specials[rnd() as usize % specials.len()],
                        1 => f32::from_bits(rnd()),
                        k => (rnd() % 200_001) as f32 / 1e4 * (k as f32 - 7.5),
                    })
                    .collect();
                let up: Vec<f32> = (0..len)
                    .map(|_| (rnd() % 20_001) as f32 / 1e3 - 10.0)
                    .collect();
                let (mut got, mut want) = (gate.clone(), gate.clone());
                geglu(&mut got, &up);
                geglu_scalar(&mut want, &up);
                let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "len {len}, round {round}");
            }
        }
    }

    /// A sweep over the whole `f32` range: every 257th bit pattern (16.7 million
    /// values, every exponent and sign), the infinities, NaNs and extremes, and every
    /// float within 2^16 ulps of the main path's edges (`|x|` near 88) and of 0 and
    /// of 1. A run over all 2^32 patterns once (about two minutes in a release
    /// build) found no difference either.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_expf_equals_libm_expf_across_the_f32_range() {
        if !is_x86_feature_detected!("avx512f") || !is_x86_feature_detected!("fma") {
            return;
        }
        let sweep = (0..(1u64 << 32) / 257).map(|i| (i * 257) as u32);
        let near = |x: f32| {
            let b = x.to_bits();
            (b.saturating_sub(1 << 16)..b.saturating_add(1 << 16)).chain(
                ((-x).to_bits().saturating_sub(1 << 16))..(-x).to_bits().saturating_add(1 << 16),
            )
        };
        let edges = [88.0f32, 88.72284, 87.33655, 1e-30, 1.0]
            .into_iter()
            .flat_map(near);
        let specials = [
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::MAX,
        ]
        .into_iter()
        .chain([f32::MIN, f32::MIN_POSITIVE, -f32::MIN_POSITIVE, 0.0, -0.0])
        .map(f32::to_bits);
        let mut bits: Vec<u32> = sweep.chain(edges).chain(specials).collect();
        // Whole groups of 8 (the padding repeats a value already checked).
        bits.resize(bits.len().div_ceil(8) * 8, 0);
        let mut bad = 0u64;
        for chunk in bits.chunks_exact(8) {
            let xs: [f32; 8] = std::array::from_fn(|k| f32::from_bits(chunk[k]));
            // SAFETY: features detected above.
            let got = unsafe { expf_avx512::expf8_checked(xs) };
            for (x, g) in xs.iter().zip(got) {
                let w = x.exp();
                if g.to_bits() != w.to_bits() && !(g.is_nan() && w.is_nan()) {
                    bad += 1;
                    assert!(bad < 10, "expf({x:e}): {g:e} vs {w:e}");
                }
            }
        }
        assert_eq!(bad, 0);
    }

    #[test]
    fn rms_norm_of_constant_row_is_weight() {
        let mut out = [0f32; 4];
        rms_norm(&[2.0; 4], &[1.0, 2.0, 3.0, 4.0], 0.0, &mut out);
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn rope_at_zero_is_identity_and_preserves_norm() {
        let r = Rope::new(8, 10000.0);
        let x0: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
        let mut x = x0.clone();
        r.apply(&mut x, 0);
        assert_eq!(x, x0);
        r.apply(&mut x, 17);
        let n0: f32 = x0.iter().map(|v| v * v).sum();
        let n1: f32 = x.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
        // Pair 0 rotates by exactly 17 radians.
        let (s, c) = 17f32.sin_cos();
        assert!((x[0] - (x0[0] * c - x0[1] * s)).abs() < 1e-5);
    }

    #[test]
    fn swiglu_rows_equal_row_by_row_swiglu() {
        let (n, ffn) = (37, 24);
        let gu: Vec<f32> = (0..2 * n * ffn)
            .map(|i| (i % 17) as f32 * 0.3 - 2.0)
            .collect();
        let mut out = vec![0f32; n * ffn];
        swiglu_rows(&gu, ffn, &mut out);
        for r in 0..n {
            let mut g = gu[2 * r * ffn..(2 * r + 1) * ffn].to_vec();
            swiglu(&mut g, &gu[(2 * r + 1) * ffn..2 * (r + 1) * ffn]);
            assert_eq!(&out[r * ffn..(r + 1) * ffn], &g[..]);
        }
    }

    #[test]
    fn neox_rope_rotates_half_pairs() {
        let r = Rope::new(8, 10000.0);
        let x0: Vec<f32> = (0..16).map(|i| i as f32 * 0.25 - 2.0).collect();
        let mut x = x0.clone();
        r.apply_neox(&mut x, 0);
        assert_eq!(x, x0);
        r.apply_neox(&mut x, 5);
        for head in 0..2 {
            for i in 0..4 {
                let (a, b) = (x0[head * 8 + i], x0[head * 8 + i + 4]);
                let (s, c) = (5.0 * r.inv_freq()[i]).sin_cos();
                assert!((x[head * 8 + i] - (a * c - b * s)).abs() < 1e-5);
                assert!((x[head * 8 + i + 4] - (a * s + b * c)).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn neox_rope_is_normal_rope_on_the_interleaved_head() {
        // NEOX pair (i, i + half) is normal-mode pair (2i, 2i + 1) after the
        // interleave llama's GGUF conversion applies to Q/K: same angles.
        let (hd, half) = (16, 8);
        let r = Rope::new(hd, 1e6);
        let x0: Vec<f32> = (0..2 * hd).map(|i| (i as f32 * 0.37).sin()).collect();
        let inter = |x: &[f32]| -> Vec<f32> {
            x.chunks_exact(hd)
                .flat_map(|h| (0..half).flat_map(move |i| [h[i], h[i + half]]))
                .collect()
        };
        for pos in [0, 1, 7, 4095] {
            let mut neox = x0.clone();
            r.apply_neox(&mut neox, pos);
            let mut normal = inter(&x0);
            r.apply(&mut normal, pos);
            assert_eq!(inter(&neox), normal, "pos {pos}");
        }
    }

    #[test]
    fn gelu_tanh_matches_the_formula_and_known_values() {
        let f = |x: f64| {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
        };
        for i in -400..=400 {
            let x = i as f32 * 0.025;
            let (got, want) = (gelu_tanh(x) as f64, f(x as f64));
            assert!(
                (got - want).abs() <= 1e-6 * want.abs().max(1.0),
                "{x}: {got} vs {want}"
            );
        }
        // GELU(1) is 0.841345 in the erf form; the tanh form gives 0.841192.
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-6);
        assert!((gelu_tanh(-1.0) + 0.158_808).abs() < 1e-6);
        assert_eq!(gelu_tanh(0.0), 0.0);
        // Saturation: x for large x, -0 for very negative x, no NaN.
        assert_eq!(gelu_tanh(30.0), 30.0);
        assert_eq!(gelu_tanh(-30.0), 0.0);
    }

    #[test]
    fn gelu_tanh_rows_equal_row_by_row_geglu() {
        let (n, ffn) = (37, 24);
        let gu: Vec<f32> = (0..2 * n * ffn)
            .map(|i| (i % 23) as f32 * 0.3 - 3.0)
            .collect();
        let mut out = vec![0f32; n * ffn];
        gelu_tanh_rows(&gu, ffn, &mut out);
        for r in 0..n {
            let mut g = gu[2 * r * ffn..(2 * r + 1) * ffn].to_vec();
            geglu(&mut g, &gu[(2 * r + 1) * ffn..2 * (r + 1) * ffn]);
            assert_eq!(&out[r * ffn..(r + 1) * ffn], &g[..]);
        }
    }

    #[test]
    fn gelu_tanh_rows_match_the_formula() {
        let gu = [-3.0f32, 0.0, 1.0, 2.0, 0.5, 1.0, -1.0, 3.0];
        let mut out = [0f32; 4];
        gelu_tanh_rows(&gu, 2, &mut out);
        let gelu = |x: f64| {
            0.5 * x
                * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x.powi(3))).tanh())
        };
        let want = [
            gelu(-3.0) * 1.0,
            gelu(0.0) * 2.0,
            -gelu(0.5),
            gelu(1.0) * 3.0,
        ];
        for (o, w) in out.iter().zip(want) {
            assert!((*o as f64 - w).abs() < 1e-6, "{o} vs {w}");
        }
    }

    #[test]
    fn swiglu_matches_formula() {
        let mut g = [0.0, 1.0];
        swiglu(&mut g, &[3.0, 2.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }
}
