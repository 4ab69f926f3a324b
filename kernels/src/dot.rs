//! Quantized tile kernels: [`TILE`] repacked weight rows (see [`crate::quant`])
//! against `R` activation rows.
//!
//! One tile's blocks are unpacked once and multiplied into `R` activation rows,
//! which is what makes batched decode and prefill cheaper than `R` single-row
//! calls. The lanes of a register are 16 output rows, so no horizontal sums are
//! needed and every output is computed by the same sequence of operations, per
//! activation block `b` (32 values; a K format's super-block is 8 of them):
//!
//! - `Q4_0`, `Q5_0`, `Q8_0`: `acc = fma(isum_b, d_w * d_x[b], acc)`, where `isum_b`
//!   is the block's exact integer dot product `sum((u - off) * q_x)` of the stored
//!   unsigned values `u` (offset 8, 16, 128: see [`QFormat::int_offset`]);
//! - `Q4_1`: the same with `off = 0`, then `acc = fma(m_w, s_x[b], acc)`;
//! - `Q4_K`, `Q5_K`: as `Q4_1` with the sub-block's `d_w = d * sc_j` and `m_w =
//!   -(dmin * m_j)` (products of an `f16` and a 6-bit integer: exact in `f32`), the
//!   second step written `acc = fnmadd(dmin * m_j, s_x[b], acc)` (the stored values
//!   are `0..16` or `0..32`);
//! - `Q6_K`: `isum_b = sc_a * isum_a + sc_b * isum_b'` over the two halves of 16
//!   (each with its own `i8` scale and offset `32 * sum16_x`), all exact in `i32`,
//!   then `acc = fma(isum_b, d * d_x[b], acc)`.
//!
//! The integer sums are exact in every path and the float steps are the same
//! single-rounding operations in the same order, so the scalar, AVX2 and AVX-512
//! kernels agree bit for bit, and a row's result never depends on `R`, on its
//! batch mates or on the instruction set (batch invariance, DESIGN.md §7).
//!
//! Paths, chosen once per process by [`isa`]: AVX-512 VNNI (`vpdpbusd`: 4 weights
//! of each of 16 rows per instruction), AVX2 (`vpmaddubsw` + `vpmaddwd`, 8 rows per
//! register), and portable Rust.

pub use crate::isa::{isa, Isa};
use crate::quant::{lane_values, ActRow, QFormat, QK, TILE};
use half::f16;

/// A weight matrix in repacked tiles: `tiles * bpr / format.sub_blocks()`
/// records of `format`, tile-major.
#[derive(Clone, Copy, Debug)]
pub struct Tiles<'a> {
    /// Block format.
    pub format: QFormat,
    /// Records (see [`crate::quant::repack`]).
    pub data: &'a [u8],
    /// Activation blocks per row (`cols / 32`).
    pub bpr: usize,
}

impl<'a> Tiles<'a> {
    /// Records per tile (`cols / format.block_values()`).
    fn records(&self) -> usize {
        self.bpr / self.format.sub_blocks()
    }

    /// Number of tiles.
    pub fn tiles(&self) -> usize {
        self.data.len() / (self.records() * self.format.record_bytes()).max(1)
    }

    /// Record `b` (`0..records()`) of tile `t`.
    #[inline(always)]
    fn record(&self, t: usize, b: usize) -> &'a [u8] {
        let (rec, n) = (self.format.record_bytes(), self.records());
        &self.data[(t * n + b) * rec..(t * n + b + 1) * rec]
    }
}

/// Outputs of one tile for `R` activation rows: `[r][lane]` is row `r` times
/// weight row `tile * 16 + lane`.
pub type TileOut<const R: usize> = [[f32; TILE]; R];

fn check<const R: usize>(w: &Tiles, tiles: &std::ops::Range<usize>, xs: &[ActRow; R]) {
    let nb = w.bpr;
    assert!(
        nb.is_multiple_of(w.format.sub_blocks()),
        "{} rows need whole super-blocks",
        w.format.name()
    );
    assert!(tiles.end <= w.tiles(), "tiles out of range");
    assert_eq!(
        w.data.len(),
        w.tiles() * w.records() * w.format.record_bytes(),
        "tile data"
    );
    for x in xs {
        assert!(
            x.d.len() == nb
                && x.s.len() == nb
                && x.sum.len() == nb
                && x.sum16.len() == 2 * nb
                && x.qs.len() == nb * QK,
            "activation row shape"
        );
    }
}

/// Format codes for the const-generic kernels.
const F_Q4_0: u8 = 0;
const F_Q4_1: u8 = 1;
const F_Q8_0: u8 = 2;
const F_Q5_0: u8 = 3;
const F_Q4K: u8 = 4;
const F_Q5K: u8 = 5;
const F_Q6K: u8 = 6;

/// The format of a kernel's code.
const fn format_of(f: u8) -> QFormat {
    match f {
        F_Q4_0 => QFormat::Q4_0,
        F_Q4_1 => QFormat::Q4_1,
        F_Q8_0 => QFormat::Q8_0,
        F_Q5_0 => QFormat::Q5_0,
        F_Q4K => QFormat::Q4K,
        F_Q5K => QFormat::Q5K,
        _ => QFormat::Q6K,
    }
}

/// Whether format code `f` has a second `f16` per row after `d` (`m` or `dmin`).
#[cfg(target_arch = "x86_64")]
const fn has_d2(f: u8) -> bool {
    f == F_Q4_1 || f == F_Q4K || f == F_Q5K
}

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
            const F: u8 = $f;
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
        QFormat::Q4_0 => run!(F_Q4_0),
        QFormat::Q4_1 => run!(F_Q4_1),
        QFormat::Q8_0 => run!(F_Q8_0),
        QFormat::Q5_0 => run!(F_Q5_0),
        QFormat::Q4K => run!(F_Q4K),
        QFormat::Q5K => run!(F_Q5K),
        QFormat::Q6K => run!(F_Q6K),
    }
}

/// `f16` scale of `lane` at byte `at` of a record.
#[inline(always)]
fn f16_at(rec: &[u8], at: usize, lane: usize) -> f32 {
    f16::from_le_bytes([rec[at + 2 * lane], rec[at + 2 * lane + 1]]).to_f32()
}

/// The reference kernel in portable Rust: the module's arithmetic, lane by lane.
fn scalar_tile<const R: usize, const F: u8>(w: Tiles, t: usize, xs: &[ActRow; R]) -> TileOut<R> {
    let format = format_of(F);
    let (vb, sub) = (format.value_bytes(), format.sub_blocks());
    let mut out = [[0f32; TILE]; R];
    for (x, o) in xs.iter().zip(out.iter_mut()) {
        for (lane, acc) in o.iter_mut().enumerate() {
            for b in 0..w.bpr {
                let (rec, j) = (w.record(t, b / sub), b % sub);
                let u = lane_values(format, rec, lane, j);
                let q = &x.qs[b * QK..(b + 1) * QK];
                let dot = |r: std::ops::Range<usize>| -> i32 {
                    r.map(|k| u[k] as i32 * q[k] as i32).sum()
                };
                let d = f16_at(rec, vb, lane);
                match F {
                    F_Q6K => {
                        let sc = |k: usize| rec[format.scales_at() + k * TILE + lane] as i8 as i32;
                        let lo = dot(0..16) - 32 * x.sum16[2 * b];
                        let hi = dot(16..32) - 32 * x.sum16[2 * b + 1];
                        let isum = lo * sc(2 * j) + hi * sc(2 * j + 1);
                        *acc = (isum as f32).mul_add(d * x.d[b], *acc);
                    }
                    F_Q4K | F_Q5K => {
                        let at = format.scales_at() + j * TILE + lane;
                        let (sc, m) = (rec[at] as f32, rec[at + 8 * TILE] as f32);
                        let dmin = f16_at(rec, vb + 32, lane);
                        *acc = (dot(0..32) as f32).mul_add(d * sc * x.d[b], *acc);
                        *acc = (-(dmin * m)).mul_add(x.s[b], *acc);
                    }
                    _ => {
                        let isum = dot(0..32) - format.int_offset() * x.sum[b];
                        *acc = (isum as f32).mul_add(d * x.d[b], *acc);
                        if F == F_Q4_1 {
                            *acc = f16_at(rec, vb + 32, lane).mul_add(x.s[b], *acc);
                        }
                    }
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

/// Asks the cache for the record that follows `rec` (`len` bytes, the record
/// size) plus [`PREFETCH_LEAD`] bytes: a tile's records, and a chunk's tiles, lie
/// one after another, so this is the stream the kernel reads next. Without it a
/// panel of several activation rows reads a large matrix (the output matrix at
/// batch 16, Gemma 3's 178 MB) at a fraction of the memory bandwidth: each record's
/// many instructions fill the out-of-order window, so few of its cache misses are
/// in flight at once. A hint: it never faults and may point past the data; the
/// arithmetic is untouched.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_next(rec: *const u8, len: usize) {
    use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
    let ahead = rec.wrapping_add(len + PREFETCH_LEAD);
    let mut at = 0;
    while at < len {
        // SAFETY: a prefetch does not access memory architecturally (no fault,
        // whatever the address).
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(at).cast()) };
        at += 64;
    }
}

/// Bytes beyond the next record that [`prefetch_next`] starts at. Measured on
/// Gemma 3's output matrix (`Q8_0`, 544-byte records; `examples/matmul_speed`,
/// best of 30, shared 2-core VM): prefetching 1,024-2,048 bytes ahead of the
/// record being read took 16 rows from 42-53 to 20-27 ms and 1 row from 15.7 to
/// 9-11 ms; 512 bytes ahead was as good at 1 row and slower at 16 (29-30 ms).
#[cfg(target_arch = "x86_64")]
const PREFETCH_LEAD: usize = 512;

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

    /// Each 16-bit lane of `v` shifted so that bit `from` lands on bit 4.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn to_bit4(v: __m256i, from: u32) -> __m256i {
        if from <= 4 {
            _mm256_sll_epi16(v, _mm_cvtsi32_si128((4 - from) as i32))
        } else {
            _mm256_srl_epi16(v, _mm_cvtsi32_si128((from - 4) as i32))
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
        let format = format_of(F);
        let (vb, sub) = (format.value_bytes(), format.sub_blocks());
        // Q8_0 values are made signed here, so it keeps no offset.
        let off = if F == F_Q8_0 { 0 } else { format.int_offset() };
        let mask = _mm256_set1_epi8(0x0F);
        let ones = _mm256_set1_epi16(1);
        let mut out = [[0f32; TILE]; R];
        for h in 0..2 {
            let mut acc = [_mm256_setzero_ps(); R];
            for rb in 0..w.bpr / sub {
                let rec = w.record(t, rb).as_ptr();
                if h == 0 {
                    prefetch_next(rec, format.record_bytes());
                }
                // SAFETY: every record holds 16 `f16` d at vb, those of Q4_1 and the
                // K formats with mins 16 `f16` m or dmin after them.
                let d = unsafe { _mm256_cvtph_ps(_mm_loadu_si128(rec.add(vb + 16 * h).cast())) };
                let d2 = if has_d2(F) {
                    // SAFETY: as above.
                    unsafe { _mm256_cvtph_ps(_mm_loadu_si128(rec.add(vb + 32 + 16 * h).cast())) }
                } else {
                    _mm256_setzero_ps()
                };
                for j in 0..sub {
                    let b = rb * sub + j;
                    // Register `i`'s 32 bytes of this half.
                    // SAFETY: registers lie inside the record (module docs of quant).
                    let load = |at: usize| unsafe {
                        _mm256_loadu_si256(rec.add(at + 32 * h).cast::<__m256i>())
                    };
                    // 8-bit lanes of the (4 or) 8 scales of this half at byte `at`.
                    // SAFETY: as above.
                    let lanes8 = |at: usize| unsafe {
                        _mm_loadl_epi64(rec.add(at + 8 * h).cast::<__m128i>())
                    };
                    // Unrolled by a macro, so each group's shifts are immediates
                    // (`from_fn` left an out-of-line call per group).
                    macro_rules! group {
                        ($g:literal) => {{
                            let g: usize = $g;
                            let (reg, high) = format.nibble_source(j, g);
                            let z = load(64 * reg);
                            let nib = if high {
                                _mm256_and_si256(_mm256_srli_epi16::<4>(z), mask)
                            } else {
                                _mm256_and_si256(z, mask)
                            };
                            if F == F_Q8_0 {
                                _mm256_xor_si256(load(64 * g), _mm256_set1_epi8(-128))
                            } else if let Some((plane, from, m)) = format.high_bits(j, g) {
                                let hb = to_bit4(load(plane), from);
                                let m = _mm256_set1_epi8(m as i8);
                                _mm256_or_si256(nib, _mm256_and_si256(hb, m))
                            } else {
                                nib
                            }
                        }};
                    }
                    let wv: [__m256i; 8] = [
                        group!(0),
                        group!(1),
                        group!(2),
                        group!(3),
                        group!(4),
                        group!(5),
                        group!(6),
                        group!(7),
                    ];
                    // Scales: Q4_K, Q5_K: d * sc_j and dmin * m_j; Q6_K: the halves' i8.
                    let (dw, mw, sca, scb) = match F {
                        F_Q4K | F_Q5K => {
                            let f = |at| _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lanes8(at)));
                            let at = format.scales_at() + j * TILE;
                            let (sc, m) = (f(at), f(at + 8 * TILE));
                            let z = _mm256_setzero_si256();
                            (_mm256_mul_ps(d, sc), _mm256_mul_ps(d2, m), z, z)
                        }
                        F_Q6K => {
                            let f = |k| _mm256_cvtepi8_epi32(lanes8(format.scales_at() + k * TILE));
                            (d, d2, f(2 * j), f(2 * j + 1))
                        }
                        _ => (d, d2, _mm256_setzero_si256(), _mm256_setzero_si256()),
                    };
                    for r in 0..R {
                        let x = &xs[r];
                        let xq = x.qs[b * QK..].as_ptr().cast::<i32>();
                        // SAFETY: 32 activation bytes per block.
                        let x4 = |g: usize| {
                            _mm256_set1_epi32(unsafe { std::ptr::read_unaligned(xq.add(g)) })
                        };
                        let madd = |acc: __m256i, g: usize| {
                            let p16 = if F == F_Q8_0 {
                                // |w| * (x * sign(w)) == w * x, unsigned operand first.
                                _mm256_maddubs_epi16(
                                    _mm256_abs_epi8(wv[g]),
                                    _mm256_sign_epi8(x4(g), wv[g]),
                                )
                            } else {
                                _mm256_maddubs_epi16(wv[g], x4(g))
                            };
                            _mm256_add_epi32(acc, _mm256_madd_epi16(p16, ones))
                        };
                        let scale = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[b]));
                        if F == F_Q6K {
                            let mut lo = _mm256_set1_epi32(-32 * x.sum16[2 * b]);
                            let mut hi = _mm256_set1_epi32(-32 * x.sum16[2 * b + 1]);
                            for g in 0..4 {
                                lo = madd(lo, g);
                                hi = madd(hi, g + 4);
                            }
                            let isum = _mm256_add_epi32(
                                _mm256_mullo_epi32(lo, sca),
                                _mm256_mullo_epi32(hi, scb),
                            );
                            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);
                            continue;
                        }
                        let mut isum = _mm256_set1_epi32(-off * x.sum[b]);
                        for g in 0..8 {
                            isum = madd(isum, g);
                        }
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scale, acc[r]);
                        if F == F_Q4_1 {
                            acc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.s[b]), acc[r]);
                        } else if F == F_Q4K || F == F_Q5K {
                            acc[r] = _mm256_fnmadd_ps(mw, _mm256_set1_ps(x.s[b]), acc[r]);
                        }
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

    /// Each 16-bit lane of `v` shifted so that bit `from` lands on bit 4.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    fn to_bit4(v: __m512i, from: u32) -> __m512i {
        if from <= 4 {
            _mm512_sll_epi16(v, _mm_cvtsi32_si128((4 - from) as i32))
        } else {
            _mm512_srl_epi16(v, _mm_cvtsi32_si128((from - 4) as i32))
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
        let format = format_of(F);
        let (vb, sub) = (format.value_bytes(), format.sub_blocks());
        let off = format.int_offset();
        let mask = _mm512_set1_epi8(0x0F);
        let mut acc = [_mm512_setzero_ps(); R];
        for rb in 0..w.bpr / sub {
            let rec = w.record(t, rb).as_ptr();
            prefetch_next(rec, format.record_bytes());
            // SAFETY: every record holds 16 `f16` d at vb, those of Q4_1 and the K
            // formats with mins 16 `f16` m or dmin after them.
            let d = unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(vb).cast())) };
            let d2 = if has_d2(F) {
                // SAFETY: as above.
                unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(vb + 32).cast())) }
            } else {
                _mm512_setzero_ps()
            };
            for j in 0..sub {
                let b = rb * sub + j;
                // SAFETY: registers lie inside the record (module docs of quant).
                let load = |at: usize| unsafe { _mm512_loadu_si512(rec.add(at).cast()) };
                // 16 8-bit scales at byte `at`.
                // SAFETY: as above.
                let lanes8 = |at: usize| unsafe { _mm_loadu_si128(rec.add(at).cast()) };
                // Unrolled by a macro, so each group's shifts are immediates
                // (`from_fn` left an out-of-line call per group).
                macro_rules! group {
                    ($g:literal) => {{
                        let g: usize = $g;
                        let (reg, high) = format.nibble_source(j, g);
                        let z = load(64 * reg);
                        let nib = if high {
                            _mm512_and_si512(_mm512_srli_epi16::<4>(z), mask)
                        } else {
                            _mm512_and_si512(z, mask)
                        };
                        if F == F_Q8_0 {
                            load(64 * g)
                        } else if let Some((plane, from, m)) = format.high_bits(j, g) {
                            let hb = to_bit4(load(plane), from);
                            _mm512_or_si512(nib, _mm512_and_si512(hb, _mm512_set1_epi8(m as i8)))
                        } else {
                            nib
                        }
                    }};
                }
                let wv: [__m512i; 8] = [
                    group!(0),
                    group!(1),
                    group!(2),
                    group!(3),
                    group!(4),
                    group!(5),
                    group!(6),
                    group!(7),
                ];
                // Scales: Q4_K, Q5_K: d * sc_j and dmin * m_j; Q6_K: the halves' i8.
                let (dw, mw, sca, scb) = match F {
                    F_Q4K | F_Q5K => {
                        let f = |at| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lanes8(at)));
                        let at = format.scales_at() + j * TILE;
                        let (sc, m) = (f(at), f(at + 8 * TILE));
                        let z = _mm512_setzero_si512();
                        (_mm512_mul_ps(d, sc), _mm512_mul_ps(d2, m), z, z)
                    }
                    F_Q6K => {
                        let f = |k| _mm512_cvtepi8_epi32(lanes8(format.scales_at() + k * TILE));
                        (d, d2, f(2 * j), f(2 * j + 1))
                    }
                    _ => (d, d2, _mm512_setzero_si512(), _mm512_setzero_si512()),
                };
                for r in 0..R {
                    let x = &xs[r];
                    let xq = x.qs[b * QK..].as_ptr().cast::<i32>();
                    // SAFETY: 32 activation bytes per block.
                    let x4 = |g: usize| {
                        _mm512_set1_epi32(unsafe { std::ptr::read_unaligned(xq.add(g)) })
                    };
                    let scale = _mm512_mul_ps(dw, _mm512_set1_ps(x.d[b]));
                    if F == F_Q6K {
                        // Two chains (the halves, each with its own scale).
                        let mut lo = _mm512_set1_epi32(-32 * x.sum16[2 * b]);
                        let mut hi = _mm512_set1_epi32(-32 * x.sum16[2 * b + 1]);
                        for g in 0..4 {
                            lo = _mm512_dpbusd_epi32(lo, wv[g], x4(g));
                            hi = _mm512_dpbusd_epi32(hi, wv[g + 4], x4(g + 4));
                        }
                        let isum = _mm512_add_epi32(
                            _mm512_mullo_epi32(lo, sca),
                            _mm512_mullo_epi32(hi, scb),
                        );
                        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
                        continue;
                    }
                    // Two chains (even and odd groups) halve the dependent `vpdpbusd`
                    // latency per row; integer sums, so the result is the same.
                    let mut even = _mm512_set1_epi32(-off * x.sum[b]);
                    let mut odd = _mm512_setzero_si512();
                    for g in (0..8).step_by(2) {
                        even = _mm512_dpbusd_epi32(even, wv[g], x4(g));
                        odd = _mm512_dpbusd_epi32(odd, wv[g + 1], x4(g + 1));
                    }
                    let isum = _mm512_add_epi32(even, odd);
                    acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
                    if F == F_Q4_1 {
                        acc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(x.s[b]), acc[r]);
                    } else if F == F_Q4K || F == F_Q5K {
                        acc[r] = _mm512_fnmadd_ps(mw, _mm512_set1_ps(x.s[b]), acc[r]);
                    }
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
pub(crate) mod tests {
    use super::*;
    use crate::quant::{dequantize_block, quantize_row_q8_split, repack, ActRowMut};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    const FORMATS: [QFormat; 7] = [
        QFormat::Q4_0,
        QFormat::Q4_1,
        QFormat::Q8_0,
        QFormat::Q5_0,
        QFormat::Q4K,
        QFormat::Q5K,
        QFormat::Q6K,
    ];

    /// Random GGUF bytes of `blocks` blocks of `format` with sane scales (every
    /// quant and packed-scale bit random).
    pub(crate) fn random_blocks(rng: &mut ChaCha8Rng, format: QFormat, blocks: usize) -> Vec<u8> {
        let mut out = Vec::new();
        let f16 = |rng: &mut ChaCha8Rng, lo: f32, hi: f32| {
            f16::from_f32(rng.random_range(lo..hi)).to_le_bytes()
        };
        for _ in 0..blocks {
            match format {
                QFormat::Q8_0 => {
                    out.extend(f16(rng, 0.001, 0.1));
                    out.extend((0..32).map(|_| rng.random_range(-127i8..=127) as u8));
                }
                QFormat::Q4K | QFormat::Q5K => {
                    out.extend(f16(rng, 0.0005, 0.005));
                    out.extend(f16(rng, 0.0005, 0.005));
                    out.extend((4..format.block_bytes()).map(|_| rng.random::<u8>()));
                }
                QFormat::Q6K => {
                    out.extend((0..208).map(|_| rng.random::<u8>()));
                    out.extend(f16(rng, 0.0001, 0.002));
                }
                _ => {
                    out.extend(f16(rng, 0.001, 0.1));
                    if format == QFormat::Q4_1 {
                        out.extend(f16(rng, -0.5, 0.0));
                    }
                    let n = format.block_bytes() - out.len() % format.block_bytes();
                    out.extend((0..n).map(|_| rng.random::<u8>()));
                }
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
        sum16: Vec<i32>,
    }

    impl Act {
        fn new(rng: &mut ChaCha8Rng, nb: usize, amp: f32) -> Self {
            let x: Vec<f32> = (0..nb * QK).map(|_| rng.random_range(-amp..amp)).collect();
            let mut a = Act {
                qs: vec![0; nb * QK],
                d: vec![0.0; nb],
                s: vec![0.0; nb],
                sum: vec![0; nb],
                sum16: vec![0; 2 * nb],
                x,
            };
            quantize_row_q8_split(
                &a.x,
                ActRowMut {
                    qs: &mut a.qs,
                    d: &mut a.d,
                    s: &mut a.s,
                    sum: &mut a.sum,
                    sum16: &mut a.sum16,
                },
            );
            a
        }
        fn row(&self) -> ActRow<'_> {
            ActRow {
                qs: &self.qs,
                d: &self.d,
                s: &self.s,
                sum: &self.sum,
                sum16: &self.sum16,
            }
        }
    }

    fn bits<const R: usize>(o: &TileOut<R>) -> Vec<u32> {
        o.iter().flatten().map(|v| v.to_bits()).collect()
    }

    fn scalar<const R: usize>(w: Tiles, t: usize, xs: &[ActRow; R]) -> TileOut<R> {
        match w.format {
            QFormat::Q4_0 => scalar_tile::<R, F_Q4_0>(w, t, xs),
            QFormat::Q4_1 => scalar_tile::<R, F_Q4_1>(w, t, xs),
            QFormat::Q8_0 => scalar_tile::<R, F_Q8_0>(w, t, xs),
            QFormat::Q5_0 => scalar_tile::<R, F_Q5_0>(w, t, xs),
            QFormat::Q4K => scalar_tile::<R, F_Q4K>(w, t, xs),
            QFormat::Q5K => scalar_tile::<R, F_Q5K>(w, t, xs),
            QFormat::Q6K => scalar_tile::<R, F_Q6K>(w, t, xs),
        }
    }

    #[test]
    fn every_path_equals_the_scalar_kernel_bitwise_and_exact_math_closely() {
        // Runs on the path this process dispatches to (CI runs it with
        // TESSERA_ISA=avx2 and =scalar too).
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for format in FORMATS {
            let sub = format.sub_blocks();
            let nbs: &[usize] = if sub > 1 {
                &[8, 16, 24]
            } else {
                &[1, 2, 3, 18, 19]
            };
            for &nb in nbs {
                let rows = 20;
                let bytes = random_blocks(&mut rng, format, rows * nb / sub);
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
                    let slow = scalar::<3>(w, t, &xs);
                    assert_eq!(bits(&fast), bits(&slow), "{format:?} nb {nb} tile {t}");
                    #[allow(clippy::needless_range_loop)] // lane indexes three arrays
                    for lane in 0..TILE.min(rows - t * TILE) {
                        let row = t * TILE + lane;
                        let mut wf = vec![0f32; nb * QK];
                        let (bb, bv) = (format.block_bytes(), format.block_values());
                        for b in 0..nb / sub {
                            let at = (row * nb / sub + b) * bb;
                            dequantize_block(format, &bytes[at..at + bb], &mut wf[b * bv..]);
                        }
                        for (r, a) in acts.iter().enumerate() {
                            let exact: f64 = wf
                                .iter()
                                .zip(&a.x)
                                .map(|(p, q)| *p as f64 * *q as f64)
                                .sum();
                            let mag: f64 = wf
                                .iter()
                                .zip(&a.x)
                                .map(|(p, q)| (*p as f64 * *q as f64).abs())
                                .sum();
                            // 8-bit activations: well under 1% of the magnitude.
                            let got = fast[r][lane] as f64;
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
            let nb = 24;
            let bytes = random_blocks(&mut rng, format, 16 * nb / format.sub_blocks());
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

    /// One GGUF block of `format` whose every weight is the format's largest
    /// positive quant (scale 1; the K formats' sub-block scales at their largest
    /// too), and that weight's value.
    fn extreme_block(format: QFormat) -> (Vec<u8>, f32) {
        let mut blk = vec![0u8; format.block_bytes()];
        let one = f16::ONE.to_le_bytes();
        match format {
            QFormat::Q4_0 => {
                blk[0..2].copy_from_slice(&one);
                blk[2..].fill(0xFF);
                (blk, 7.0)
            }
            QFormat::Q4_1 => {
                blk[0..2].copy_from_slice(&one);
                blk[4..].fill(0xFF);
                (blk, 15.0)
            }
            QFormat::Q8_0 => {
                blk[0..2].copy_from_slice(&one);
                blk[2..].fill(127);
                (blk, 127.0)
            }
            QFormat::Q5_0 => {
                blk[0..2].copy_from_slice(&one);
                blk[2..].fill(0xFF);
                (blk, 15.0)
            }
            QFormat::Q4K | QFormat::Q5K => {
                // sc = 63 and m = 0 for every sub-block, q = 15 (Q5_K: 31, every
                // high bit set): w = 63 * 15 or 63 * 31.
                blk[0..2].copy_from_slice(&one);
                let packed = crate::quant::k4_pack_scale_min(&[63; 8], &[0; 8]);
                blk[4..16].copy_from_slice(&packed);
                blk[16..].fill(0xFF);
                let q = if format == QFormat::Q5K { 31.0 } else { 15.0 };
                (blk, 63.0 * q)
            }
            QFormat::Q6K => {
                // q = 63 (w = q - 32 = 31) with scale -128: w = -128 * 31; the
                // largest magnitude is q = 0 (-32), checked by the negation below.
                blk[0..192].fill(0xFF);
                blk[192..208].fill(0x80);
                blk[208..210].copy_from_slice(&one);
                (blk, -128.0 * 31.0)
            }
        }
    }

    #[test]
    fn extreme_values_do_not_saturate() {
        // Largest stored values against the largest activations, every format.
        for format in FORMATS {
            let (blk, w1) = extreme_block(format);
            let bytes: Vec<u8> = blk.iter().copied().cycle().take(16 * blk.len()).collect();
            let cols = format.block_values();
            let data = repack(format, &bytes, 16, cols);
            let nb = cols / QK;
            let w = Tiles {
                format,
                data: &data,
                bpr: nb,
            };
            // The activations are all +127 (or all -127).
            for sign in [1i8, -1] {
                let a = Act {
                    x: vec![],
                    qs: vec![127 * sign; cols],
                    d: vec![1.0; nb],
                    s: vec![(127 * 32 * sign as i32) as f32; nb],
                    sum: vec![127 * 32 * sign as i32; nb],
                    sum16: vec![127 * 16 * sign as i32; 2 * nb],
                };
                let out = tile_dot::<1>(w, 0, [a.row()]);
                let want = w1 * 127.0 * cols as f32 * sign as f32;
                assert!(
                    out[0].iter().all(|&o| o == want),
                    "{format:?}: {} vs {want}",
                    out[0][0]
                );
            }
        }
        // Q6_K's most negative quant (q = 0: -32) under scale -128.
        let (mut blk, _) = extreme_block(QFormat::Q6K);
        blk[0..192].fill(0);
        let bytes: Vec<u8> = blk.iter().copied().cycle().take(16 * blk.len()).collect();
        let data = repack(QFormat::Q6K, &bytes, 16, 256);
        let w = Tiles {
            format: QFormat::Q6K,
            data: &data,
            bpr: 8,
        };
        let a = Act {
            x: vec![],
            qs: vec![-127; 256],
            d: vec![1.0; 8],
            s: vec![-127.0 * 32.0; 8],
            sum: vec![-127 * 32; 8],
            sum16: vec![-127 * 16; 16],
        };
        let out = tile_dot::<1>(w, 0, [a.row()]);
        let want = -128.0 * -32.0 * -127.0 * 256.0;
        assert!(out[0].iter().all(|&o| o == want), "{} vs {want}", out[0][0]);
    }
}
