//! Quantized dot products: one weight row against `R` activation rows.
//!
//! The same weight blocks are unpacked once and multiplied into `R` activation rows,
//! which is what makes batched decode cheaper than `R` single-row calls. Each row's
//! accumulation order is identical for every `R`, so a row's result never depends on
//! its batch mates (batch invariance, DESIGN.md §7).
//!
//! Math (llama.cpp `ggml_vec_dot_q4_1_q8_1`, `ggml_vec_dot_q8_0_q8_0`):
//! - `Q4_1 . Q8`: `sum_b d_w d_x sum_i(q_w q_x) + m_w s_x`
//! - `Q8_0 . Q8`: `sum_b d_w d_x sum_i(q_w q_x)`

use crate::quant::{BlockQ4_1, BlockQ8, BlockQ8_0, QK};

/// Which instruction set the quantized kernels use on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
}

/// Detects the best supported instruction set once per process.
pub fn isa() -> Isa {
    use std::sync::OnceLock;
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        if std::env::var("TESSERA_FORCE_SCALAR").is_ok_and(|v| v == "1") {
            return Isa::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    })
}

/// `out[r] = dot(w, xs[r])` for a `Q4_1` weight row and `R` quantized activation rows.
/// All slices hold the same number of blocks.
#[inline]
pub fn dot_q4_1<const R: usize>(w: &[BlockQ4_1], xs: [&[BlockQ8]; R]) -> [f32; R] {
    for x in &xs {
        assert_eq!(x.len(), w.len());
    }
    match isa() {
        // SAFETY: `isa()` verified avx2, fma and f16c; lengths checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dot_q4_1::<R>(w, xs) },
        _ => scalar_dot_q4_1(w, xs),
    }
}

/// `out[r] = dot(w, xs[r])` for a `Q8_0` weight row and `R` quantized activation rows.
#[inline]
pub fn dot_q8_0<const R: usize>(w: &[BlockQ8_0], xs: [&[BlockQ8]; R]) -> [f32; R] {
    for x in &xs {
        assert_eq!(x.len(), w.len());
    }
    match isa() {
        // SAFETY: `isa()` verified avx2, fma and f16c; lengths checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dot_q8_0::<R>(w, xs) },
        _ => scalar_dot_q8_0(w, xs),
    }
}

/// `out[r] = dot(w, xs[r])` in plain `f32` (fallback for weight types without a
/// quantized kernel, dequantized at load).
#[inline]
pub fn dot_f32<const R: usize>(w: &[f32], xs: [&[f32]; R]) -> [f32; R] {
    let mut out = [0f32; R];
    for (o, x) in out.iter_mut().zip(xs) {
        assert_eq!(x.len(), w.len());
        // Eight partial sums keep the loop vectorizable with a fixed order.
        let mut acc = [0f32; 8];
        let (wc, xc) = (w.chunks_exact(8), x.chunks_exact(8));
        let (wr, xr) = (wc.remainder(), xc.remainder());
        for (a, b) in wc.zip(xc) {
            for i in 0..8 {
                acc[i] += a[i] * b[i];
            }
        }
        let mut s: f32 = acc.iter().sum();
        for (a, b) in wr.iter().zip(xr) {
            s += a * b;
        }
        *o = s;
    }
    out
}

/// Reference `Q4_1 . Q8` in portable Rust.
pub fn scalar_dot_q4_1<const R: usize>(w: &[BlockQ4_1], xs: [&[BlockQ8]; R]) -> [f32; R] {
    let mut out = [0f32; R];
    for (o, x) in out.iter_mut().zip(xs) {
        let mut acc = 0f32;
        for (wb, xb) in w.iter().zip(x) {
            let mut isum = 0i32;
            for j in 0..QK / 2 {
                isum += (wb.qs[j] & 0x0F) as i32 * xb.qs[j] as i32;
                isum += (wb.qs[j] >> 4) as i32 * xb.qs[j + QK / 2] as i32;
            }
            acc += wb.d.to_f32() * xb.d * isum as f32 + wb.m.to_f32() * xb.s;
        }
        *o = acc;
    }
    out
}

/// Reference `Q8_0 . Q8` in portable Rust.
pub fn scalar_dot_q8_0<const R: usize>(w: &[BlockQ8_0], xs: [&[BlockQ8]; R]) -> [f32; R] {
    let mut out = [0f32; R];
    for (o, x) in out.iter_mut().zip(xs) {
        let mut acc = 0f32;
        for (wb, xb) in w.iter().zip(x) {
            let isum: i32 = wb
                .qs
                .iter()
                .zip(&xb.qs)
                .map(|(&a, &b)| a as i32 * b as i32)
                .sum();
            acc += wb.d.to_f32() * xb.d * isum as f32;
        }
        *o = acc;
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Sum of `u8 * i8` products in groups of 4 adjacent bytes -> 8 x i32, exact
    /// (products are at most 255*127, pair sums fit i16 for our operand ranges).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn mul_sum_u8_i8(u: __m256i, s: __m256i) -> __m256i {
        let p16 = _mm256_maddubs_epi16(u, s);
        _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
    }

    /// Converts the two leading `f16` fields of a block (`d`, `m`) to `f32` with F16C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn two_f16(p: *const u8) -> (f32, f32) {
        // SAFETY: caller passes a pointer to at least 4 readable bytes.
        let raw = unsafe { std::ptr::read_unaligned(p as *const i32) };
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128(raw));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }

    /// Two interleaved accumulators (even and odd blocks) hide the FMA latency; the
    /// order is fixed, so results are the same for every `R`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_1<const R: usize>(
        w: &[BlockQ4_1],
        xs: [&[BlockQ8]; R],
    ) -> [f32; R] {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut offset = [[0f32; 2]; R];
        let mask = _mm256_set1_epi8(0x0F);
        for (b, wb) in w.iter().enumerate() {
            let lane = b & 1;
            // SAFETY: `qs` is 16 bytes; unaligned load.
            let packed = unsafe { _mm_loadu_si128(wb.qs.as_ptr() as *const __m128i) };
            let both = _mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed);
            let qw = _mm256_and_si256(both, mask);
            let (dw, mw) = two_f16(wb as *const BlockQ4_1 as *const u8);
            for r in 0..R {
                // SAFETY: every `xs[r]` has `w.len()` blocks (checked by the caller).
                let xb = unsafe { xs[r].get_unchecked(b) };
                let qx = unsafe { _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i) };
                let isum = _mm256_cvtepi32_ps(mul_sum_u8_i8(qw, qx));
                acc[r][lane] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xb.d), isum, acc[r][lane]);
                offset[r][lane] += mw * xb.s;
            }
        }
        let mut out = [0f32; R];
        for r in 0..R {
            out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1])) + (offset[r][0] + offset[r][1]);
        }
        out
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0<const R: usize>(
        w: &[BlockQ8_0],
        xs: [&[BlockQ8]; R],
    ) -> [f32; R] {
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        for (b, wb) in w.iter().enumerate() {
            let lane = b & 1;
            // SAFETY: `qs` is 32 bytes; unaligned load.
            let qw = unsafe { _mm256_loadu_si256(wb.qs.as_ptr() as *const __m256i) };
            let aw = _mm256_sign_epi8(qw, qw);
            let (dw, _) = two_f16(wb as *const BlockQ8_0 as *const u8);
            for r in 0..R {
                // SAFETY: every `xs[r]` has `w.len()` blocks (checked by the caller).
                let xb = unsafe { xs[r].get_unchecked(b) };
                let qx = unsafe { _mm256_loadu_si256(xb.qs.as_ptr() as *const __m256i) };
                // |w| * (x * sign(w)) == w * x, with the unsigned operand first.
                let sx = _mm256_sign_epi8(qx, qw);
                let isum = _mm256_cvtepi32_ps(mul_sum_u8_i8(aw, sx));
                acc[r][lane] = _mm256_fmadd_ps(_mm256_set1_ps(dw * xb.d), isum, acc[r][lane]);
            }
        }
        let mut out = [0f32; R];
        for r in 0..R {
            out[r] = hsum(_mm256_add_ps(acc[r][0], acc[r][1]));
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row_q8;
    use half::f16;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn random_q4_1(rng: &mut ChaCha8Rng, n: usize) -> Vec<BlockQ4_1> {
        (0..n)
            .map(|_| BlockQ4_1 {
                d: f16::from_f32(rng.random_range(0.001..0.1)),
                m: f16::from_f32(rng.random_range(-0.5..0.0)),
                qs: std::array::from_fn(|_| rng.random()),
            })
            .collect()
    }

    fn random_q8_0(rng: &mut ChaCha8Rng, n: usize) -> Vec<BlockQ8_0> {
        (0..n)
            .map(|_| BlockQ8_0 {
                d: f16::from_f32(rng.random_range(0.001..0.1)),
                qs: std::array::from_fn(|_| rng.random_range(-127..=127)),
            })
            .collect()
    }

    fn random_act(rng: &mut ChaCha8Rng, n: usize) -> (Vec<f32>, Vec<BlockQ8>) {
        let x: Vec<f32> = (0..n * QK).map(|_| rng.random_range(-3.0..3.0)).collect();
        let mut q = vec![BlockQ8::default(); n];
        quantize_row_q8(&x, &mut q);
        (x, q)
    }

    #[test]
    fn q4_1_dispatch_matches_scalar_and_f32_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let w = random_q4_1(&mut rng, 18);
        let (x, q) = random_act(&mut rng, 18);
        let fast = dot_q4_1::<1>(&w, [&q])[0];
        let slow = scalar_dot_q4_1::<1>(&w, [&q])[0];
        let mut wf = vec![0f32; 18 * QK];
        for (b, o) in w.iter().zip(wf.chunks_exact_mut(QK)) {
            b.dequantize(o);
        }
        let exact: f32 = wf.iter().zip(&x).map(|(a, b)| a * b).sum();
        assert!(
            (fast - slow).abs() <= 1e-3 * slow.abs().max(1.0),
            "{fast} {slow}"
        );
        // Activation quantization error bound: well under 1% of the magnitude.
        let mag: f32 = wf.iter().zip(&x).map(|(a, b)| (a * b).abs()).sum();
        assert!((fast - exact).abs() <= 0.01 * mag, "{fast} {exact} {mag}");
    }

    #[test]
    fn q8_0_dispatch_matches_scalar() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let w = random_q8_0(&mut rng, 18);
        let (_, q) = random_act(&mut rng, 18);
        let fast = dot_q8_0::<1>(&w, [&q])[0];
        let slow = scalar_dot_q8_0::<1>(&w, [&q])[0];
        assert!(
            (fast - slow).abs() <= 1e-3 * slow.abs().max(1.0),
            "{fast} {slow}"
        );
    }

    #[test]
    fn rows_are_bitwise_independent_of_batch_mates() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let w4 = random_q4_1(&mut rng, 48);
        let w8 = random_q8_0(&mut rng, 48);
        let acts: Vec<Vec<BlockQ8>> = (0..4).map(|_| random_act(&mut rng, 48).1).collect();
        let x = [&acts[0][..], &acts[1][..], &acts[2][..], &acts[3][..]];
        let batched4 = dot_q4_1::<4>(&w4, x);
        let batched8 = dot_q8_0::<4>(&w8, x);
        for r in 0..4 {
            assert_eq!(
                batched4[r].to_bits(),
                dot_q4_1::<1>(&w4, [x[r]])[0].to_bits()
            );
            assert_eq!(
                batched8[r].to_bits(),
                dot_q8_0::<1>(&w8, [x[r]])[0].to_bits()
            );
        }
    }

    #[test]
    fn extreme_values_do_not_saturate() {
        // Max nibble (15) times max activation (127) in every lane.
        let w = vec![BlockQ4_1 {
            d: f16::from_f32(1.0),
            m: f16::from_f32(0.0),
            qs: [0xFF; 16],
        }];
        let x = vec![BlockQ8 {
            d: 1.0,
            s: 127.0 * 32.0,
            qs: [127; 32],
        }];
        assert_eq!(dot_q4_1::<1>(&w, [&x])[0], 15.0 * 127.0 * 32.0);
        let w8 = vec![BlockQ8_0 {
            d: f16::from_f32(1.0),
            qs: [-127; 32],
        }];
        let xn = vec![BlockQ8 {
            d: 1.0,
            s: 0.0,
            qs: [-127; 32],
        }];
        assert_eq!(dot_q8_0::<1>(&w8, [&xn])[0], 127.0 * 127.0 * 32.0);
    }
}
