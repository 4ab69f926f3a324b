//! Quantized dot products: one weight row against `R` activation rows.
//!
//! The same weight blocks are unpacked once and multiplied into `R` activation rows,
//! which is what makes batched decode cheaper than `R` single-row calls. Each row
//! has its own accumulators and the block order is fixed, so a row's result never
//! depends on `R` or on its batch mates (batch invariance, DESIGN.md §7).
//!
//! Math (llama.cpp `ggml_vec_dot_q4_1_q8_1`, `ggml_vec_dot_q8_0_q8_0`):
//! - `Q4_1 . Q8`: `sum_b d_w d_x sum_i(q_w q_x) + m_w s_x`
//! - `Q8_0 . Q8`: `sum_b d_w d_x sum_i(q_w q_x)`
//!
//! Paths, chosen once per process by [`isa`]: AVX-512 VNNI (two blocks per 512-bit
//! `vpdpbusd`), AVX2 (`vpmaddubsw` + `vpmaddwd`, one block per 256-bit register),
//! and portable Rust. The integer block sums are exact in every path.

use crate::quant::{ActRow, Q4_1Row, Q8_0Row, QK};
use half::f16;

/// Which instruction set the quantized kernels use on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Portable Rust.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C.
    Avx2,
    /// x86-64 AVX-512 (F, BW, VL) with VNNI, plus the AVX2 set.
    Avx512Vnni,
}

/// Detects the best supported instruction set once per process.
/// `TESSERA_ISA=scalar|avx2` caps it (for tests and comparisons).
pub fn isa() -> Isa {
    use std::sync::OnceLock;
    static ISA: OnceLock<Isa> = OnceLock::new();
    *ISA.get_or_init(|| {
        let cap = std::env::var("TESSERA_ISA").unwrap_or_default();
        if cap == "scalar" {
            return Isa::Scalar;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            let avx512 = avx2
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni");
            if avx512 && cap != "avx2" {
                return Isa::Avx512Vnni;
            }
            if avx2 {
                return Isa::Avx2;
            }
        }
        Isa::Scalar
    })
}

fn check_q4_1<const R: usize>(w: &Q4_1Row, xs: &[ActRow; R]) {
    let nb = w.blocks();
    assert!(
        w.m.len() == nb && w.qs.len() == nb * QK / 2,
        "weight row shape"
    );
    for x in xs {
        assert!(
            x.d.len() == nb && x.s.len() == nb && x.qs.len() == nb * QK,
            "activation row shape"
        );
    }
}

fn check_q8_0<const R: usize>(w: &Q8_0Row, xs: &[ActRow; R]) {
    let nb = w.blocks();
    assert!(w.qs.len() == nb * QK, "weight row shape");
    for x in xs {
        assert!(
            x.d.len() == nb && x.qs.len() == nb * QK,
            "activation row shape"
        );
    }
}

/// `out[r] = dot(w, xs[r])` for a `Q4_1` weight row and `R` quantized activation rows.
#[inline]
pub fn dot_q4_1<const R: usize>(w: Q4_1Row, xs: [ActRow; R]) -> [f32; R] {
    check_q4_1(&w, &xs);
    match isa() {
        // SAFETY: `isa()` verified the features; shapes checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { avx512::dot_q4_1::<R>(w, xs) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dot_q4_1::<R>(w, xs) },
        _ => scalar_dot_q4_1(w, xs),
    }
}

/// `out[r] = dot(w, xs[r])` for a `Q8_0` weight row and `R` quantized activation rows.
#[inline]
pub fn dot_q8_0<const R: usize>(w: Q8_0Row, xs: [ActRow; R]) -> [f32; R] {
    check_q8_0(&w, &xs);
    match isa() {
        // SAFETY: `isa()` verified the features; shapes checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { avx512::dot_q8_0::<R>(w, xs) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { avx2::dot_q8_0::<R>(w, xs) },
        _ => scalar_dot_q8_0(w, xs),
    }
}

/// A weight matrix in `Q4_1` structure-of-arrays form, `bpr` blocks per row.
#[derive(Clone, Copy, Debug)]
pub struct Q4_1Matrix<'a> {
    /// Packed nibbles, 16 bytes per block.
    pub qs: &'a [u8],
    /// Scales.
    pub d: &'a [f16],
    /// Offsets.
    pub m: &'a [f16],
    /// Blocks per row.
    pub bpr: usize,
}

/// A weight matrix in `Q8_0` structure-of-arrays form, `bpr` blocks per row.
#[derive(Clone, Copy, Debug)]
pub struct Q8_0Matrix<'a> {
    /// Values, 32 per block.
    pub qs: &'a [i8],
    /// Scales.
    pub d: &'a [f16],
    /// Blocks per row.
    pub bpr: usize,
}

impl<'a> Q4_1Matrix<'a> {
    #[inline]
    fn row(&self, j: usize) -> Q4_1Row<'a> {
        let b = self.bpr;
        Q4_1Row {
            qs: &self.qs[j * b * 16..(j + 1) * b * 16],
            d: &self.d[j * b..(j + 1) * b],
            m: &self.m[j * b..(j + 1) * b],
        }
    }
}

impl<'a> Q8_0Matrix<'a> {
    #[inline]
    fn row(&self, j: usize) -> Q8_0Row<'a> {
        let b = self.bpr;
        Q8_0Row {
            qs: &self.qs[j * b * QK..(j + 1) * b * QK],
            d: &self.d[j * b..(j + 1) * b],
        }
    }
}

macro_rules! panel {
    ($name:ident, $mat:ident, $check:ident, $dot:ident, $doc:literal) => {
        #[doc = $doc]
        ///
        /// Calls `out(j, values)` for every weight row `j` in `rows`; the instruction
        /// set is chosen once for the whole panel so the per-row work inlines.
        #[inline]
        pub fn $name<const R: usize>(
            w: $mat,
            rows: std::ops::Range<usize>,
            xs: [ActRow; R],
            mut out: impl FnMut(usize, [f32; R]),
        ) {
            if rows.is_empty() {
                return;
            }
            $check(&w.row(rows.start), &xs);
            assert!(rows.end * w.bpr <= w.d.len(), "rows out of range");
            match isa() {
                // SAFETY: `isa()` verified the features; shapes checked above (all rows
                // have `bpr` blocks).
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Vnni => unsafe {
                    avx512::panel(|| {
                        rows.clone()
                            .for_each(|j| out(j, avx512::$dot::<R>(w.row(j), xs)))
                    })
                },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe {
                    avx2::panel(|| {
                        rows.clone()
                            .for_each(|j| out(j, avx2::$dot::<R>(w.row(j), xs)))
                    })
                },
                _ => rows.for_each(|j| out(j, scalar::$dot::<R>(w.row(j), xs))),
            }
        }
    };
}

panel!(
    panel_q4_1,
    Q4_1Matrix,
    check_q4_1,
    dot_q4_1,
    "`Q4_1` weight rows against `R` activation rows."
);
panel!(
    panel_q8_0,
    Q8_0Matrix,
    check_q8_0,
    dot_q8_0,
    "`Q8_0` weight rows against `R` activation rows."
);

mod scalar {
    pub(super) use super::scalar_dot_q4_1 as dot_q4_1;
    pub(super) use super::scalar_dot_q8_0 as dot_q8_0;
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
pub fn scalar_dot_q4_1<const R: usize>(w: Q4_1Row, xs: [ActRow; R]) -> [f32; R] {
    let mut out = [0f32; R];
    for (o, x) in out.iter_mut().zip(xs) {
        let mut acc = 0f32;
        for b in 0..w.blocks() {
            let (wq, xq) = (&w.qs[b * 16..(b + 1) * 16], &x.qs[b * QK..(b + 1) * QK]);
            let mut isum = 0i32;
            for j in 0..QK / 2 {
                isum += (wq[j] & 0x0F) as i32 * xq[j] as i32;
                isum += (wq[j] >> 4) as i32 * xq[j + QK / 2] as i32;
            }
            acc += w.d[b].to_f32() * x.d[b] * isum as f32 + w.m[b].to_f32() * x.s[b];
        }
        *o = acc;
    }
    out
}

/// Reference `Q8_0 . Q8` in portable Rust.
pub fn scalar_dot_q8_0<const R: usize>(w: Q8_0Row, xs: [ActRow; R]) -> [f32; R] {
    let mut out = [0f32; R];
    for (o, x) in out.iter_mut().zip(xs) {
        let mut acc = 0f32;
        for b in 0..w.blocks() {
            let isum: i32 = w.qs[b * QK..(b + 1) * QK]
                .iter()
                .zip(&x.qs[b * QK..(b + 1) * QK])
                .map(|(&a, &c)| a as i32 * c as i32)
                .sum();
            acc += w.d[b].to_f32() * x.d[b] * isum as f32;
        }
        *o = acc;
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Runs `f` in a function compiled for AVX2, so kernels called inside inline.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn panel(f: impl FnOnce()) {
        f()
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Sum of `u8 * i8` products in groups of 4 adjacent bytes -> 8 x i32, exact
    /// for our ranges (u8 <= 15 or |i8| <= 127 against |i8| <= 127).
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn mul_sum_u8_i8(u: __m256i, s: __m256i) -> __m256i {
        let p16 = _mm256_maddubs_epi16(u, s);
        _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_1<const R: usize>(w: Q4_1Row, xs: [ActRow; R]) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        let mut offset = [0f32; R];
        let mask = _mm256_set1_epi8(0x0F);
        for b in 0..w.blocks() {
            // SAFETY: shapes checked by the caller; unaligned loads within the rows.
            let packed = unsafe { _mm_loadu_si128(w.qs.as_ptr().add(b * 16) as *const __m128i) };
            let both = _mm256_set_m128i(_mm_srli_epi16::<4>(packed), packed);
            let qw = _mm256_and_si256(both, mask);
            let (dw, mw) = (w.d[b].to_f32(), w.m[b].to_f32());
            for r in 0..R {
                let x = &xs[r];
                // SAFETY: as above.
                let qx = unsafe { _mm256_loadu_si256(x.qs.as_ptr().add(b * QK) as *const __m256i) };
                let isum = _mm256_cvtepi32_ps(mul_sum_u8_i8(qw, qx));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d[b]), isum, acc[r]);
                offset[r] += mw * x.s[b];
            }
        }
        let mut out = [0f32; R];
        for r in 0..R {
            out[r] = hsum(acc[r]) + offset[r];
        }
        out
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0<const R: usize>(w: Q8_0Row, xs: [ActRow; R]) -> [f32; R] {
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..w.blocks() {
            // SAFETY: shapes checked by the caller.
            let qw = unsafe { _mm256_loadu_si256(w.qs.as_ptr().add(b * QK) as *const __m256i) };
            let aw = _mm256_sign_epi8(qw, qw);
            let dw = w.d[b].to_f32();
            for r in 0..R {
                let x = &xs[r];
                // SAFETY: as above.
                let qx = unsafe { _mm256_loadu_si256(x.qs.as_ptr().add(b * QK) as *const __m256i) };
                // |w| * (x * sign(w)) == w * x, with the unsigned operand first.
                let sx = _mm256_sign_epi8(qx, qw);
                let isum = _mm256_cvtepi32_ps(mul_sum_u8_i8(aw, sx));
                acc[r] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d[b]), isum, acc[r]);
            }
        }
        let mut out = [0f32; R];
        for r in 0..R {
            out[r] = hsum(acc[r]);
        }
        out
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// Runs `f` in a function compiled for AVX-512, so kernels called inside inline.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn panel(f: impl FnOnce()) {
        f()
    }

    /// `[a, b]` from two adjacent `f16` values, as `f32` in lanes 0 and 1.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn pair_f16(p: *const half::f16) -> __m128 {
        // SAFETY: caller guarantees two readable values.
        let raw = unsafe { std::ptr::read_unaligned(p as *const i32) };
        _mm_cvtph_ps(_mm_cvtsi32_si128(raw))
    }

    /// `[a, b]` from two adjacent `f32` values in lanes 0 and 1.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pair_f32(p: *const f32) -> __m128 {
        // SAFETY: caller guarantees two readable values.
        unsafe { _mm_castpd_ps(_mm_load_sd(p as *const f64)) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn hsum128(v: __m128) -> f32 {
        let s = _mm_add_ps(v, _mm_movehl_ps(v, v));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn dot_q4_1<const R: usize>(w: Q4_1Row, xs: [ActRow; R]) -> [f32; R] {
        let nb = w.blocks();
        let mut acc = [_mm512_setzero_ps(); R];
        let mut offs = [_mm_setzero_ps(); R];
        let mask = _mm512_set1_epi8(0x0F);
        // Lanes 0-7 take block b's scale, lanes 8-15 block b+1's.
        let spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        // Shift the high nibbles down in 128-bit lanes 1 and 3.
        let shifts = _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0);
        let mut b = 0;
        while b + 2 <= nb {
            // SAFETY: shapes checked by the caller; two blocks = 32 bytes of nibbles.
            let q = unsafe { _mm256_loadu_si256(w.qs.as_ptr().add(b * 16) as *const __m256i) };
            // [qs_b, qs_b, qs_b+1, qs_b+1] -> [lo_b, hi_b, lo_b+1, hi_b+1]: GGML order.
            let z =
                _mm512_shuffle_i64x2::<0x50>(_mm512_castsi256_si512(q), _mm512_castsi256_si512(q));
            let qw = _mm512_and_si512(_mm512_srlv_epi64(z, shifts), mask);
            // SAFETY: b + 1 < nb.
            let (dw, mw) =
                unsafe { (pair_f16(w.d.as_ptr().add(b)), pair_f16(w.m.as_ptr().add(b))) };
            for r in 0..R {
                let x = &xs[r];
                // SAFETY: as above; 64 activation bytes and two scales per row.
                let (qx, dx, sx) = unsafe {
                    (
                        _mm512_loadu_si512(x.qs.as_ptr().add(b * QK) as *const _),
                        pair_f32(x.d.as_ptr().add(b)),
                        pair_f32(x.s.as_ptr().add(b)),
                    )
                };
                let isum = _mm512_dpbusd_epi32(_mm512_setzero_si512(), qw, qx);
                let scale =
                    _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(dw, dx)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
                offs[r] = _mm_fmadd_ps(mw, sx, offs[r]);
            }
            b += 2;
        }
        // An odd last block goes through the AVX2 kernel (same exact block sum).
        let tail = if b < nb {
            let xt: [ActRow; R] = std::array::from_fn(|r| xs[r].from_block(b));
            // SAFETY: avx2, fma and f16c are part of this function's features.
            unsafe { avx2::dot_q4_1::<R>(w.from_block(b), xt) }
        } else {
            [0f32; R]
        };
        let mut out = [0f32; R];
        for r in 0..R {
            out[r] = _mm512_reduce_add_ps(acc[r]) + hsum128(offs[r]) + tail[r];
        }
        out
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn dot_q8_0<const R: usize>(w: Q8_0Row, xs: [ActRow; R]) -> [f32; R] {
        let nb = w.blocks();
        let mut acc = [_mm512_setzero_ps(); R];
        let spread = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        let zero = _mm512_setzero_si512();
        let mut b = 0;
        while b + 2 <= nb {
            // SAFETY: shapes checked by the caller; two blocks = 64 bytes.
            let qw = unsafe { _mm512_loadu_si512(w.qs.as_ptr().add(b * QK) as *const _) };
            let aw = _mm512_abs_epi8(qw);
            let neg = _mm512_movepi8_mask(qw);
            // SAFETY: b + 1 < nb.
            let dw = unsafe { pair_f16(w.d.as_ptr().add(b)) };
            for r in 0..R {
                let x = &xs[r];
                // SAFETY: as above.
                let (qx, dx) = unsafe {
                    (
                        _mm512_loadu_si512(x.qs.as_ptr().add(b * QK) as *const _),
                        pair_f32(x.d.as_ptr().add(b)),
                    )
                };
                // |w| * (x negated where w < 0) == w * x, unsigned operand first.
                let sx = _mm512_mask_sub_epi8(qx, neg, zero, qx);
                let isum = _mm512_dpbusd_epi32(zero, aw, sx);
                let scale =
                    _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_mul_ps(dw, dx)));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
            }
            b += 2;
        }
        let tail = if b < nb {
            let xt: [ActRow; R] = std::array::from_fn(|r| xs[r].from_block(b));
            // SAFETY: avx2, fma and f16c are part of this function's features.
            unsafe { avx2::dot_q8_0::<R>(w.from_block(b), xt) }
        } else {
            [0f32; R]
        };
        let mut out = [0f32; R];
        for r in 0..R {
            out[r] = _mm512_reduce_add_ps(acc[r]) + tail[r];
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::quantize_row_q8_split;
    use half::f16;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    struct W4 {
        qs: Vec<u8>,
        d: Vec<f16>,
        m: Vec<f16>,
    }
    struct W8 {
        qs: Vec<i8>,
        d: Vec<f16>,
    }
    struct Act {
        x: Vec<f32>,
        qs: Vec<i8>,
        d: Vec<f32>,
        s: Vec<f32>,
    }

    impl W4 {
        fn row(&self) -> Q4_1Row<'_> {
            Q4_1Row {
                qs: &self.qs,
                d: &self.d,
                m: &self.m,
            }
        }
        fn dequant(&self) -> Vec<f32> {
            let mut out = Vec::new();
            for b in 0..self.d.len() {
                let (d, m) = (self.d[b].to_f32(), self.m[b].to_f32());
                let q = &self.qs[b * 16..(b + 1) * 16];
                out.extend(q.iter().map(|v| (v & 0x0F) as f32 * d + m));
                out.extend(q.iter().map(|v| (v >> 4) as f32 * d + m));
            }
            out
        }
    }
    impl W8 {
        fn row(&self) -> Q8_0Row<'_> {
            Q8_0Row {
                qs: &self.qs,
                d: &self.d,
            }
        }
    }
    impl Act {
        fn row(&self) -> ActRow<'_> {
            ActRow {
                qs: &self.qs,
                d: &self.d,
                s: &self.s,
            }
        }
    }

    fn w4(rng: &mut ChaCha8Rng, nb: usize) -> W4 {
        W4 {
            qs: (0..nb * 16).map(|_| rng.random()).collect(),
            d: (0..nb)
                .map(|_| f16::from_f32(rng.random_range(0.001..0.1)))
                .collect(),
            m: (0..nb)
                .map(|_| f16::from_f32(rng.random_range(-0.5..0.0)))
                .collect(),
        }
    }

    fn w8(rng: &mut ChaCha8Rng, nb: usize) -> W8 {
        W8 {
            qs: (0..nb * QK).map(|_| rng.random_range(-127..=127)).collect(),
            d: (0..nb)
                .map(|_| f16::from_f32(rng.random_range(0.001..0.1)))
                .collect(),
        }
    }

    fn act(rng: &mut ChaCha8Rng, nb: usize) -> Act {
        let x: Vec<f32> = (0..nb * QK).map(|_| rng.random_range(-3.0..3.0)).collect();
        let (mut qs, mut d, mut s) = (vec![0i8; nb * QK], vec![0f32; nb], vec![0f32; nb]);
        quantize_row_q8_split(&x, &mut qs, &mut d, &mut s);
        Act { x, qs, d, s }
    }

    #[test]
    fn q4_1_dispatch_matches_scalar_and_f32_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for nb in [1, 2, 3, 18, 19] {
            let w = w4(&mut rng, nb);
            let a = act(&mut rng, nb);
            let fast = dot_q4_1::<1>(w.row(), [a.row()])[0];
            let slow = scalar_dot_q4_1::<1>(w.row(), [a.row()])[0];
            let wf = w.dequant();
            let exact: f32 = wf.iter().zip(&a.x).map(|(p, q)| p * q).sum();
            let mag: f32 = wf.iter().zip(&a.x).map(|(p, q)| (p * q).abs()).sum();
            assert!(
                (fast - slow).abs() <= 1e-4 * mag,
                "nb {nb}: {fast} vs {slow}"
            );
            // Activation quantization error: well under 1% of the magnitude.
            assert!(
                (fast - exact).abs() <= 0.01 * mag,
                "nb {nb}: {fast} vs {exact}"
            );
        }
    }

    #[test]
    fn q8_0_dispatch_matches_scalar() {
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        for nb in [1, 2, 3, 18, 19] {
            let w = w8(&mut rng, nb);
            let a = act(&mut rng, nb);
            let fast = dot_q8_0::<1>(w.row(), [a.row()])[0];
            let slow = scalar_dot_q8_0::<1>(w.row(), [a.row()])[0];
            assert!(
                (fast - slow).abs() <= 1e-4 * slow.abs().max(1.0),
                "nb {nb}: {fast} vs {slow}"
            );
        }
    }

    #[test]
    fn rows_are_bitwise_independent_of_batch_mates() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for nb in [18, 19] {
            let w4 = w4(&mut rng, nb);
            let w8 = w8(&mut rng, nb);
            let acts: Vec<Act> = (0..8).map(|_| act(&mut rng, nb)).collect();
            let x: [ActRow; 8] = std::array::from_fn(|i| acts[i].row());
            let b4 = dot_q4_1::<8>(w4.row(), x);
            let b8 = dot_q8_0::<8>(w8.row(), x);
            for r in 0..8 {
                assert_eq!(
                    b4[r].to_bits(),
                    dot_q4_1::<1>(w4.row(), [x[r]])[0].to_bits()
                );
                assert_eq!(
                    b8[r].to_bits(),
                    dot_q8_0::<1>(w8.row(), [x[r]])[0].to_bits()
                );
            }
        }
    }

    #[test]
    fn extreme_values_do_not_saturate() {
        // Max nibble (15) times max activation (127) in every lane.
        let w = W4 {
            qs: vec![0xFF; 32],
            d: vec![f16::ONE; 2],
            m: vec![f16::ZERO; 2],
        };
        let a = Act {
            x: vec![],
            qs: vec![127; 64],
            d: vec![1.0; 2],
            s: vec![127.0 * 32.0; 2],
        };
        assert_eq!(dot_q4_1::<1>(w.row(), [a.row()])[0], 15.0 * 127.0 * 64.0);
        let w8 = W8 {
            qs: vec![-127; 64],
            d: vec![f16::ONE; 2],
        };
        let n = Act {
            x: vec![],
            qs: vec![-127; 64],
            d: vec![1.0; 2],
            s: vec![0.0; 2],
        };
        assert_eq!(dot_q8_0::<1>(w8.row(), [n.row()])[0], 127.0 * 127.0 * 64.0);
    }
}
