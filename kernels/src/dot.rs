//! Quantized tile kernels: [`TILE`] repacked weight rows (see [`crate::quant`])
//! against `R` activation rows.
//!
//! One tile's blocks are unpacked once and multiplied into `R` activation rows,
//! which is what makes batched decode and prefill cheaper than `R` single-row
//! calls. The lanes of a register are 16 output rows, so no horizontal sums are
//! needed and every output is computed by the same sequence of operations:
//!
//! `acc = 0; for each block b: acc = fma(isum_b, d_w * d_x[b], acc)`, then for
//! `Q4_1` also `acc = fma(m_w, s_x[b], acc)`, where `isum_b` is the block's exact
//! integer dot product `sum(q_w * q_x)` (for `Q4_0` with `q_w - 8`, for `Q8_0` the
//! signed values). The integer sums are exact in every path and the float steps
//! are the same single-rounding operations, so the scalar, AVX2 and AVX-512
//! kernels agree bit for bit, and a row's result never depends on `R`, on its
//! batch mates or on the instruction set (batch invariance, DESIGN.md §7).
//!
//! Paths, chosen once per process by [`isa`]: AVX-512 VNNI (`vpdpbusd`: 4 weights
//! of each of 16 rows per instruction), AVX2 (`vpmaddubsw` + `vpmaddwd`, 8 rows per
//! register), and portable Rust.

pub use crate::isa::{isa, Isa};
use crate::quant::{ActRow, QFormat, QK, TILE};
use half::f16;

/// A weight matrix in repacked tiles: `tiles * bpr` records of `format`, tile-major.
#[derive(Clone, Copy, Debug)]
pub struct Tiles<'a> {
    /// Block format.
    pub format: QFormat,
    /// Records (see [`crate::quant::repack`]).
    pub data: &'a [u8],
    /// Blocks per row (`cols / 32`).
    pub bpr: usize,
}

impl<'a> Tiles<'a> {
    /// Number of tiles.
    pub fn tiles(&self) -> usize {
        self.data.len() / (self.bpr * self.format.record_bytes()).max(1)
    }

    /// Record `b` of tile `t`.
    #[inline(always)]
    fn record(&self, t: usize, b: usize) -> &'a [u8] {
        let rec = self.format.record_bytes();
        &self.data[(t * self.bpr + b) * rec..(t * self.bpr + b + 1) * rec]
    }
}

/// Outputs of one tile for `R` activation rows: `[r][lane]` is row `r` times
/// weight row `tile * 16 + lane`.
pub type TileOut<const R: usize> = [[f32; TILE]; R];

fn check<const R: usize>(w: &Tiles, tiles: &std::ops::Range<usize>, xs: &[ActRow; R]) {
    let nb = w.bpr;
    assert!(tiles.end <= w.tiles(), "tiles out of range");
    assert_eq!(
        w.data.len(),
        w.tiles() * nb * w.format.record_bytes(),
        "tile data"
    );
    for x in xs {
        assert!(
            x.d.len() == nb && x.s.len() == nb && x.sum.len() == nb && x.qs.len() == nb * QK,
            "activation row shape"
        );
    }
}

/// Format codes for the const-generic kernels.
const F_Q4_0: u8 = 0;
const F_Q4_1: u8 = 1;
const F_Q8_0: u8 = 2;

/// Tile `t` of `w` against `R` activation rows.
pub fn tile_dot<const R: usize>(w: Tiles, t: usize, xs: [ActRow; R]) -> TileOut<R> {
    let mut out = [[0f32; TILE]; R];
    panel(w, t..t + 1, xs, |_, v| out = *v);
    out
}

/// Calls `out(t, values)` for every tile `t` in `tiles` against `R` activation
/// rows; the instruction set and format are chosen once for the whole panel so the
/// per-tile work inlines. Panics on inconsistent shapes.
#[inline]
pub fn panel<const R: usize>(
    w: Tiles,
    tiles: std::ops::Range<usize>,
    xs: [ActRow; R],
    mut out: impl FnMut(usize, &TileOut<R>),
) {
    if tiles.is_empty() {
        return;
    }
    check(&w, &tiles, &xs);
    macro_rules! run {
        ($f:ident) => {{
            const F: u8 = match QFormat::$f {
                QFormat::Q4_0 => F_Q4_0,
                QFormat::Q4_1 => F_Q4_1,
                QFormat::Q8_0 => F_Q8_0,
            };
            match isa() {
                // SAFETY: `isa()` verified the features; shapes checked above.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx512Vnni => unsafe { avx512::panel::<R, F>(w, tiles, &xs, &mut out) },
                // SAFETY: as above.
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { avx2::panel::<R, F>(w, tiles, &xs, &mut out) },
                _ => tiles.for_each(|t| out(t, &scalar_tile::<R, F>(w, t, &xs))),
            }
        }};
    }
    match w.format {
        QFormat::Q4_0 => run!(Q4_0),
        QFormat::Q4_1 => run!(Q4_1),
        QFormat::Q8_0 => run!(Q8_0),
    }
}

/// `f16` scale of `lane` at byte `at` of a record.
#[inline(always)]
fn f16_at(rec: &[u8], at: usize, lane: usize) -> f32 {
    f16::from_le_bytes([rec[at + 2 * lane], rec[at + 2 * lane + 1]]).to_f32()
}

/// The reference kernel in portable Rust: the module's arithmetic, lane by lane.
fn scalar_tile<const R: usize, const F: u8>(w: Tiles, t: usize, xs: &[ActRow; R]) -> TileOut<R> {
    let format = match F {
        F_Q4_0 => QFormat::Q4_0,
        F_Q4_1 => QFormat::Q4_1,
        _ => QFormat::Q8_0,
    };
    let vb = format.value_bytes();
    let mut out = [[0f32; TILE]; R];
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        for (lane, acc) in o.iter_mut().enumerate() {
            for b in 0..w.bpr {
                let rec = w.record(t, b);
                let q = &x.qs[b * QK..(b + 1) * QK];
                let mut isum = -format.int_offset() * x.sum[b];
                for (k, &qx) in q.iter().enumerate() {
                    let (g, e) = (k / 4, k % 4);
                    let u = match format {
                        QFormat::Q8_0 => rec[(g * TILE + lane) * 4 + e],
                        _ if g < 4 => rec[(g * TILE + lane) * 4 + e] & 0x0F,
                        _ => rec[((g - 4) * TILE + lane) * 4 + e] >> 4,
                    };
                    isum += u as i32 * qx as i32;
                }
                *acc = (isum as f32).mul_add(f16_at(rec, vb, lane) * x.d[b], *acc);
                if format == QFormat::Q4_1 {
                    *acc = f16_at(rec, vb + 32, lane).mul_add(x.s[b], *acc);
                }
            }
        }
    }
    out
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Tiles `tiles` against `xs`, compiled for AVX2 so the tile kernel inlines.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn panel<const R: usize, const F: u8>(
        w: Tiles,
        tiles: std::ops::Range<usize>,
        xs: &[ActRow; R],
        out: &mut impl FnMut(usize, &TileOut<R>),
    ) {
        for t in tiles {
            // SAFETY: features enabled by this function; shapes checked by the caller.
            out(t, &unsafe { tile::<R, F>(w, t, xs) });
        }
    }

    /// One tile as two halves of 8 rows; per lane the arithmetic of `scalar_tile`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const F: u8>(
        w: Tiles,
        t: usize,
        xs: &[ActRow; R],
    ) -> TileOut<R> {
        let vb = if F == F_Q8_0 { 512 } else { 256 };
        // Q8_0 values are made signed here, so only Q4_0 keeps an offset.
        let off = if F == F_Q4_0 { 8 } else { 0 };
        let mask = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut out = [[0f32; TILE]; R];
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); R];
            for b in 0..w.bpr {
                let rec = w.record(t, b).as_ptr();
                // SAFETY: a record holds vb value bytes and 16 (or 32) scales.
                let wv: [__m256i; 8] = unsafe {
                    if F == F_Q8_0 {
                        std::array::from_fn(|g| {
                            let v = _mm256_loadu_si256(rec.add(64 * g + 32 * h).cast());
                            _mm256_xor_si256(v, _mm256_set1_epi8(-128))
                        })
                    } else {
                        let z: [__m256i; 4] = std::array::from_fn(|p| {
                            _mm256_loadu_si256(rec.add(64 * p + 32 * h).cast())
                        });
                        std::array::from_fn(|g| {
                            if g < 4 {
                                _mm256_and_si256(z[g], mask)
                            } else {
                                _mm256_and_si256(_mm256_srli_epi16::<4>(z[g - 4]), mask)
                            }
                        })
                    }
                };
                // SAFETY: as above.
                let dw = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(rec.add(vb + 16 * h).cast())) };
                let mw = if F == F_Q4_1 {
                    // SAFETY: Q4_1 records hold 16 offsets after the scales.
                    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(rec.add(vb + 32 + 16 * h).cast())) }
                } else {
                    _mm256_setzero_ps()
                };
                for r in 0..R {
                    let x = &xs[r];
                    let xq = x.qs[b * QK..].as_ptr().cast::<i32>();
                    let mut isum = _mm256_set1_epi32(-off * x.sum[b]);
                    for (g, &wg) in wv.iter().enumerate() {
                        // SAFETY: 32 activation bytes per block.
                        let x4 = _mm256_set1_epi32(unsafe { std::ptr::read_unaligned(xq.add(g)) });
                        let p16 = if F == F_Q8_0 {
                            // |w| * (x * sign(w)) == w * x, unsigned operand first.
                            _mm256_maddubs_epi16(_mm256_abs_epi8(wg), _mm256_sign_epi8(x4, wg))
                        } else {
                            _mm256_maddubs_epi16(wg, x4)
                        };
                        isum = _mm256_add_epi32(isum, _mm256_madd_epi16(p16, ones));
                    }
                    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[b]));
                    acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);
                    if F == F_Q4_1 {
                        acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[b]), acc[r]);
                    }
                }
            }
            for r in 0..R {
                // SAFETY: 8 floats into lanes 8h..8h+8 of a 16-float row.
                unsafe { _mm256_storeu_ps(out[r][8 * h..].as_mut_ptr(), acc[r]) };
            }
        }
        out
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// Tiles `tiles` against `xs`, compiled for AVX-512 so the tile kernel inlines.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    pub(super) unsafe fn panel<const R: usize, const F: u8>(
        w: Tiles,
        tiles: std::ops::Range<usize>,
        xs: &[ActRow; R],
        out: &mut impl FnMut(usize, &TileOut<R>),
    ) {
        for t in tiles {
            // SAFETY: features enabled by this function; shapes checked by the caller.
            out(t, &unsafe { tile::<R, F>(w, t, xs) });
        }
    }

    /// One tile, 16 rows per register; per lane the arithmetic of `scalar_tile`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    unsafe fn tile<const R: usize, const F: u8>(
        w: Tiles,
        t: usize,
        xs: &[ActRow; R],
    ) -> TileOut<R> {
        let vb = if F == F_Q8_0 { 512 } else { 256 };
        let off = match F {
            F_Q4_0 => 8,
            F_Q8_0 => 128,
            _ => 0,
        };
        let mask = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..w.bpr {
            let rec = w.record(t, b).as_ptr();
            // SAFETY: a record holds vb value bytes and 16 (or 32) scales.
            let wv: [__m512i; 8] = unsafe {
                if F == F_Q8_0 {
                    std::array::from_fn(|g| _mm512_loadu_si512(rec.add(64 * g).cast()))
                } else {
                    let z: [__m512i; 4] =
                        std::array::from_fn(|p| _mm512_loadu_si512(rec.add(64 * p).cast()));
                    std::array::from_fn(|g| {
                        if g < 4 {
                            _mm512_and_si512(z[g], mask)
                        } else {
                            _mm512_and_si512(_mm512_srli_epi16::<4>(z[g - 4]), mask)
                        }
                    })
                }
            };
            // SAFETY: as above.
            let dw = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(vb).cast())) };
            let mw = if F == F_Q4_1 {
                // SAFETY: Q4_1 records hold 16 offsets after the scales.
                unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(vb + 32).cast())) }
            } else {
                _mm512_setzero_ps()
            };
            for r in 0..R {
                let x = &xs[r];
                let xq = x.qs[b * QK..].as_ptr().cast::<i32>();
                // SAFETY: 32 activation bytes per block.
                let x4 =
                    |g: usize| _mm512_set1_epi32(unsafe { std::ptr::read_unaligned(xq.add(g)) });
                // Two chains (even and odd groups) halve the dependent `vpdpbusd`
                // latency per row; integer sums, so the result is the same.
                let mut even = _mm512_set1_epi32(-off * x.sum[b]);
                let mut odd = _mm512_setzero_si512();
                for g in (0..8).step_by(2) {
                    even = _mm512_dpbusd_epi32(even, wv[g], x4(g));
                    odd = _mm512_dpbusd_epi32(odd, wv[g + 1], x4(g + 1));
                }
                let isum = _mm512_add_epi32(even, odd);
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[b]));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
                if F == F_Q4_1 {
                    acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[b]), acc[r]);
                }
            }
        }
        let mut out = [[0f32; TILE]; R];
        for r in 0..R {
            // SAFETY: 16 floats into a 16-float row.
            unsafe { _mm512_storeu_ps(out[r].as_mut_ptr(), acc[r]) };
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::{dequantize_block, quantize_row_q8_split, repack};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    const FORMATS: [QFormat; 3] = [QFormat::Q4_0, QFormat::Q4_1, QFormat::Q8_0];

    /// Random GGUF bytes of a `rows x nb*32` matrix with sane scales.
    fn gguf(rng: &mut ChaCha8Rng, format: QFormat, rows: usize, nb: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for _ in 0..rows * nb {
            out.extend_from_slice(&f16::from_f32(rng.random_range(0.001..0.1)).to_le_bytes());
            if format == QFormat::Q4_1 {
                out.extend_from_slice(&f16::from_f32(rng.random_range(-0.5..0.0)).to_le_bytes());
            }
            let n = if format == QFormat::Q8_0 { 32 } else { 16 };
            for _ in 0..n {
                out.push(if format == QFormat::Q8_0 {
                    rng.random_range(-127i8..=127) as u8
                } else {
                    rng.random()
                });
            }
        }
        out
    }

    struct Act {
        x: Vec<f32>,
        qs: Vec<i8>,
        d: Vec<f32>,
        s: Vec<f32>,
        sum: Vec<i32>,
    }

    impl Act {
        fn new(rng: &mut ChaCha8Rng, nb: usize, amp: f32) -> Self {
            let x: Vec<f32> = (0..nb * QK).map(|_| rng.random_range(-amp..amp)).collect();
            let mut a = Act {
                qs: vec![0; nb * QK],
                d: vec![0.0; nb],
                s: vec![0.0; nb],
                sum: vec![0; nb],
                x,
            };
            quantize_row_q8_split(&a.x, &mut a.qs, &mut a.d, &mut a.s, &mut a.sum);
            a
        }
        fn row(&self) -> ActRow<'_> {
            ActRow {
                qs: &self.qs,
                d: &self.d,
                s: &self.s,
                sum: &self.sum,
            }
        }
    }

    fn bits<const R: usize>(o: &TileOut<R>) -> Vec<u32> {
        o.iter().flatten().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn every_path_equals_the_scalar_kernel_bitwise_and_exact_math_closely() {
        // Runs on the path this process dispatches to (CI runs it with
        // TESSERA_ISA=avx2 and =scalar too).
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for format in FORMATS {
            for nb in [1, 2, 3, 18, 19] {
                let rows = 20;
                let bytes = gguf(&mut rng, format, rows, nb);
                let data = repack(format, &bytes, rows, nb * QK);
                let w = Tiles {
                    format,
                    data: &data,
                    bpr: nb,
                };
                let acts: Vec<Act> = (0..3).map(|_| Act::new(&mut rng, nb, 3.0)).collect();
                let xs: [ActRow; 3] = std::array::from_fn(|i| acts[i].row());
                for t in 0..2 {
                    let fast = tile_dot::<3>(w, t, xs);
                    let slow = match format {
                        QFormat::Q4_0 => scalar_tile::<3, F_Q4_0>(w, t, &xs),
                        QFormat::Q4_1 => scalar_tile::<3, F_Q4_1>(w, t, &xs),
                        QFormat::Q8_0 => scalar_tile::<3, F_Q8_0>(w, t, &xs),
                    };
                    assert_eq!(bits(&fast), bits(&slow), "{format:?} nb {nb} tile {t}");
                    #[allow(clippy::needless_range_loop)] // lane indexes three arrays
                    for lane in 0..TILE.min(rows - t * TILE) {
                        let row = t * TILE + lane;
                        let mut wf = vec![0f32; nb * QK];
                        for b in 0..nb {
                            let at = (row * nb + b) * format.block_bytes();
                            let blk = &bytes[at..at + format.block_bytes()];
                            dequantize_block(format, blk, &mut wf[b * QK..(b + 1) * QK]);
                        }
                        for (r, a) in acts.iter().enumerate() {
                            let exact: f32 = wf.iter().zip(&a.x).map(|(p, q)| p * q).sum();
                            let mag: f32 = wf.iter().zip(&a.x).map(|(p, q)| (p * q).abs()).sum();
                            // 8-bit activations: well under 1% of the magnitude.
                            let got = fast[r][lane];
                            assert!(
                                (got - exact).abs() <= 0.01 * mag,
                                "{format:?} {got} vs {exact}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn rows_are_bitwise_independent_of_batch_mates() {
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        for format in FORMATS {
            let nb = 19;
            let bytes = gguf(&mut rng, format, 16, nb);
            let data = repack(format, &bytes, 16, nb * QK);
            let w = Tiles {
                format,
                data: &data,
                bpr: nb,
            };
            let acts: Vec<Act> = (0..8).map(|_| Act::new(&mut rng, nb, 2.0)).collect();
            let x: [ActRow; 8] = std::array::from_fn(|i| acts[i].row());
            let all = tile_dot::<8>(w, 0, x);
            for r in 0..8 {
                let one = tile_dot::<1>(w, 0, [x[r]]);
                assert_eq!(bits(&[all[r]]), bits(&one), "{format:?} row {r}");
            }
        }
    }

    #[test]
    fn extreme_values_do_not_saturate() {
        // Largest stored values against the largest activations, every format.
        for format in FORMATS {
            let mut blk = vec![0u8; format.block_bytes()];
            blk[0..2].copy_from_slice(&f16::ONE.to_le_bytes());
            let (qs, want) = match format {
                QFormat::Q4_0 => (2, 7.0 * 127.0 * 32.0),
                QFormat::Q4_1 => (4, 15.0 * 127.0 * 32.0),
                QFormat::Q8_0 => (2, 127.0 * 127.0 * 32.0),
            };
            let v = if format == QFormat::Q8_0 { 127 } else { 0xFF };
            blk[qs..].fill(v);
            let bytes: Vec<u8> = blk.iter().copied().cycle().take(16 * blk.len()).collect();
            let data = repack(format, &bytes, 16, 32);
            let w = Tiles {
                format,
                data: &data,
                bpr: 1,
            };
            // Q4_0 stores 15 for +7; the activations are all +127 (or all -127).
            for sign in [1i8, -1] {
                let a = Act {
                    x: vec![],
                    qs: vec![127 * sign; 32],
                    d: vec![1.0],
                    s: vec![(127 * 32 * sign as i32) as f32],
                    sum: vec![127 * 32 * sign as i32],
                };
                let out = tile_dot::<1>(w, 0, [a.row()]);
                let want = want * sign as f32;
                assert!(
                    out[0].iter().all(|&o| o == want),
                    "{format:?}: {} vs {want}",
                    out[0][0]
                );
            }
        }
    }
}
