//! Quantized block formats, their repacked (interleaved) form, and activation
//! quantization.
//!
//! Weight formats follow GGML's on-disk layouts (llama.cpp `ggml/src/ggml-common.h`):
//! - `Q4_0`: 32 weights per block, `w = d * (q - 8)` with `q` in `0..16`; 18 bytes:
//!   `d: f16, qs: [u8; 16]` where `qs[j] & 0x0F` is weight `j` and `qs[j] >> 4` is
//!   weight `j + 16`.
//! - `Q4_1`: `w = d * q + m`; 20 bytes: `d: f16, m: f16, qs: [u8; 16]` (nibbles as `Q4_0`).
//! - `Q8_0`: `w = d * q` with `q: i8`; 34 bytes: `d: f16, qs: [i8; 32]`.
//!
//! At load, matrices are repacked into tiles of [`TILE`] rows ([`repack`]): for
//! each tile and block, one record holding the 16 rows' values interleaved in
//! groups of 4 (so one 64-byte register holds 4 consecutive weights of each of 16
//! rows: one `vpdpbusd` lane per output row), then their scales. For `Q4_x` the
//! record's values are the rows' `qs` bytes regrouped: register `p` (0..4) holds
//! bytes `4p..4p+4` of every row, whose low nibbles are weights `4p..4p+4` and high
//! nibbles weights `16+4p..16+4p+4`. `Q8_0` values are stored offset-binary
//! (`q ^ 0x80`, i.e. `q + 128` as `u8`). Record bytes:
//! - `Q4_0`: 256 value bytes, 16 `d` (`f16`): 288 = 16 x 18;
//! - `Q4_1`: 256, 16 `d`, 16 `m`: 320 = 16 x 20;
//! - `Q8_0`: 512, 16 `d`: 544 = 16 x 34.
//!
//! Activations are quantized per row: 32 values per block, `x ~= d * q` with
//! `q: i8`, plus the block's integer sum `sum(q)` and `s = d * sum(q)` (for the
//! `Q4_x` offset terms). Unlike GGML's `Q8_1` we keep `d` and `s` in `f32`.

use half::f16;

/// Values per quantization block (all formats here).
pub const QK: usize = 32;

/// Weight rows per repacked tile (one AVX-512 register of outputs).
pub const TILE: usize = 16;

/// A quantized weight format with a native kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QFormat {
    /// GGML `Q4_0`.
    Q4_0,
    /// GGML `Q4_1`.
    Q4_1,
    /// GGML `Q8_0`.
    Q8_0,
}

impl QFormat {
    /// GGML's name of the format.
    pub fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
        }
    }

    /// Bytes of one block in a GGUF file.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
        }
    }

    /// Value bytes of one repacked record (16 rows x one block).
    pub fn value_bytes(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 => 256,
            Self::Q8_0 => 512,
        }
    }

    /// Bytes of one repacked record: values, then 16 `d`, then (`Q4_1`) 16 `m`.
    pub fn record_bytes(self) -> usize {
        TILE * self.block_bytes()
    }

    /// What the stored unsigned values must be lowered by to give the signed
    /// quant: 8 for `Q4_0`, 128 for `Q8_0` (offset-binary), 0 for `Q4_1`.
    pub fn int_offset(self) -> i32 {
        match self {
            Self::Q4_0 => 8,
            Self::Q4_1 => 0,
            Self::Q8_0 => 128,
        }
    }
}

/// Dequantizes one GGUF block of `format` (`format.block_bytes()` bytes) into 32 floats.
pub fn dequantize_block(format: QFormat, b: &[u8], out: &mut [f32]) {
    let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
    match format {
        QFormat::Q4_0 | QFormat::Q4_1 => {
            let (m, qs) = match format {
                QFormat::Q4_1 => (f16::from_le_bytes([b[2], b[3]]).to_f32(), &b[4..20]),
                _ => (-8.0 * d, &b[2..18]),
            };
            for j in 0..QK / 2 {
                out[j] = (qs[j] & 0x0F) as f32 * d + m;
                out[j + QK / 2] = (qs[j] >> 4) as f32 * d + m;
            }
        }
        QFormat::Q8_0 => {
            for (o, &q) in out.iter_mut().zip(&b[2..34]) {
                *o = q as i8 as f32 * d;
            }
        }
    }
}

/// Quantizes 32 floats into one GGUF `Q8_0` block (34 bytes), as GGML does:
/// `d = max|x| / 127`, `q = round(x / d)`.
pub fn quantize_block_q8_0(x: &[f32], out: &mut [u8]) {
    let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    out[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for (o, &v) in out[2..34].iter_mut().zip(x) {
        *o = (v * id).round() as i8 as u8;
    }
}

/// Quantizes 32 floats into one GGUF `Q4_0` block (18 bytes), as GGML's reference
/// `quantize_row_q4_0_ref` (`ggml/src/ggml-quants.c`) does: `d = m / -8` where `m` is
/// the value of largest magnitude (sign kept), `q = min(15, trunc(x / d + 8.5))`,
/// weight `j` in the low nibble of byte `j` and weight `j + 16` in its high nibble.
pub fn quantize_block_q4_0(x: &[f32], out: &mut [u8]) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in &x[..QK] {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[0..2].copy_from_slice(&f16::from_f32(d).to_le_bytes());
    for j in 0..QK / 2 {
        // `as i8` truncates toward zero, as C's `(int8_t)` does for these values.
        let lo = ((x[j] * id + 8.5) as i8).min(15) as u8;
        let hi = ((x[j + QK / 2] * id + 8.5) as i8).min(15) as u8;
        out[2 + j] = lo | (hi << 4);
    }
}

/// Bytes of one GGML `Q5_0` block: `d: f16, qh: [u8; 4], qs: [u8; 16]`.
pub const Q5_0_BLOCK_BYTES: usize = 22;

/// Rewrites GGML `Q5_0` blocks as `Q8_0` blocks holding the same weights exactly.
///
/// `Q5_0` (llama.cpp `ggml-common.h` `block_q5_0`, dequantized as in
/// `ggml-quants.c` `dequantize_row_q5_0`): `w = d * (q - 16)` with the 5-bit `q`
/// of weight `j < 16` being `qs[j] & 0xF` plus bit `j` of the little-endian `qh`
/// as bit 4, and of weight `j + 16` `qs[j] >> 4` plus bit `j + 16`. `q - 16` is in
/// `-16..16`, an `i8`, and `d` is kept, so the `Q8_0` block (`d`, `q - 16`) has
/// the same value for every weight: no requantization error.
///
/// Panics unless `bytes` is whole blocks.
pub fn q5_0_as_q8_0(bytes: &[u8]) -> Vec<u8> {
    assert!(
        bytes.len().is_multiple_of(Q5_0_BLOCK_BYTES),
        "Q5_0 data is not whole blocks"
    );
    let mut out = Vec::with_capacity(bytes.len() / Q5_0_BLOCK_BYTES * 34);
    for b in bytes.chunks_exact(Q5_0_BLOCK_BYTES) {
        out.extend_from_slice(&b[..2]);
        let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
        let qs = &b[6..];
        for j in 0..QK {
            let low = if j < 16 {
                qs[j] & 0x0F
            } else {
                qs[j - 16] >> 4
            };
            let q = low | ((((qh >> j) & 1) as u8) << 4);
            out.push((q as i8 - 16) as u8);
        }
    }
    out
}

/// Quantizes a row-major `f32` matrix (`x.len()` a multiple of 32; blocks run along
/// each row) into GGUF blocks of `format` (`Q8_0` or `Q4_0`): `x.len() / 32 *
/// format.block_bytes()` bytes, the layout a GGUF tensor of that type stores.
///
/// Panics for `Q4_1` (no writer here) or a length that is not whole blocks.
pub fn quantize_blocks(format: QFormat, x: &[f32]) -> Vec<u8> {
    assert!(
        x.len().is_multiple_of(QK),
        "{} values: not whole blocks",
        x.len()
    );
    let bb = format.block_bytes();
    let mut out = vec![0u8; x.len() / QK * bb];
    for (blk, o) in x.chunks_exact(QK).zip(out.chunks_exact_mut(bb)) {
        match format {
            QFormat::Q8_0 => quantize_block_q8_0(blk, o),
            QFormat::Q4_0 => quantize_block_q4_0(blk, o),
            QFormat::Q4_1 => panic!("no Q4_1 quantizer"),
        }
    }
    out
}

/// Repacks a row-major GGUF matrix (`rows x cols`, `cols / 32` blocks per row) of
/// `format` into tiles (see the module docs); rows past `rows` in the last tile are
/// zero (scale 0). `bytes.len()` must be `rows * cols / 32 * format.block_bytes()`.
pub fn repack(format: QFormat, bytes: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let (bb, bpr) = (format.block_bytes(), cols / QK);
    assert_eq!(bytes.len(), rows * bpr * bb, "GGUF matrix bytes");
    let (vb, rec) = (format.value_bytes(), format.record_bytes());
    let tiles = rows.div_ceil(TILE);
    let mut out = vec![0u8; tiles * bpr * rec];
    for row in 0..rows {
        let (t, lane) = (row / TILE, row % TILE);
        for b in 0..bpr {
            let src = &bytes[(row * bpr + b) * bb..][..bb];
            let dst = &mut out[(t * bpr + b) * rec..][..rec];
            dst[vb + lane * 2..vb + lane * 2 + 2].copy_from_slice(&src[0..2]);
            let qs = match format {
                QFormat::Q4_0 => &src[2..18],
                QFormat::Q4_1 => {
                    dst[vb + 32 + lane * 2..vb + 34 + lane * 2].copy_from_slice(&src[2..4]);
                    &src[4..20]
                }
                QFormat::Q8_0 => &src[2..34],
            };
            for (g, q4) in qs.chunks_exact(4).enumerate() {
                let at = (g * TILE + lane) * 4;
                for (e, &q) in q4.iter().enumerate() {
                    dst[at + e] = if format == QFormat::Q8_0 { q ^ 0x80 } else { q };
                }
            }
        }
    }
    out
}

/// The GGUF bytes of block `b` of row `row` of a repacked matrix (`bpr` blocks per
/// row) into `out` (`format.block_bytes()` long): the inverse of [`repack`].
pub fn unpack_block(
    format: QFormat,
    tiles: &[u8],
    bpr: usize,
    row: usize,
    b: usize,
    out: &mut [u8],
) {
    let (vb, rec) = (format.value_bytes(), format.record_bytes());
    let (t, lane) = (row / TILE, row % TILE);
    let src = &tiles[(t * bpr + b) * rec..][..rec];
    out[0..2].copy_from_slice(&src[vb + lane * 2..vb + lane * 2 + 2]);
    let qs = match format {
        QFormat::Q4_0 => &mut out[2..18],
        QFormat::Q4_1 => {
            out[2..4].copy_from_slice(&src[vb + 32 + lane * 2..vb + 34 + lane * 2]);
            &mut out[4..20]
        }
        QFormat::Q8_0 => &mut out[2..34],
    };
    for (g, q4) in qs.chunks_exact_mut(4).enumerate() {
        let at = (g * TILE + lane) * 4;
        for (e, q) in q4.iter_mut().enumerate() {
            let v = src[at + e];
            *q = if format == QFormat::Q8_0 { v ^ 0x80 } else { v };
        }
    }
}

/// One quantized activation row in structure-of-arrays form.
#[derive(Clone, Copy, Debug)]
pub struct ActRow<'a> {
    /// Values, 32 per block.
    pub qs: &'a [i8],
    /// Block scales.
    pub d: &'a [f32],
    /// `d * sum(qs)` per block.
    pub s: &'a [f32],
    /// `sum(qs)` per block.
    pub sum: &'a [i32],
}

/// Quantizes one activation row (length a multiple of [`QK`]) into split arrays:
/// `qs` (`x.len()` values), and per block (`x.len() / QK` each) the scale `d`, the
/// integer sum `sum` and `s = d * sum`. Symmetric 8-bit, round half away from
/// zero; deterministic and row-local, which keeps matmuls batch-invariant.
pub fn quantize_row_q8_split(
    x: &[f32],
    qs: &mut [i8],
    d: &mut [f32],
    s: &mut [f32],
    sum: &mut [i32],
) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::isa() != crate::isa::Isa::Scalar {
        // SAFETY: `isa()` verified avx2 and fma. Same results: rounding is exact.
        return unsafe { quantize_avx2(x, qs, d, s, sum) };
    }
    quantize(x, qs, d, s, sum)
}

/// [`quantize`] compiled for AVX2, so its loops vectorize.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_avx2(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32], sum: &mut [i32]) {
    quantize(x, qs, d, s, sum)
}

#[inline(always)]
fn quantize(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32], sum: &mut [i32]) {
    for (b, xs) in x.chunks_exact(QK).enumerate() {
        // Eight running maxima (the maximum does not depend on the order), so the
        // loop vectorizes.
        let mut m8 = [0f32; 8];
        for c in xs.chunks_exact(8) {
            for (m, &v) in m8.iter_mut().zip(c) {
                *m = m.max(v.abs());
            }
        }
        let amax = m8.iter().fold(0f32, |a, &v| a.max(v));
        let db = amax / 127.0;
        let id = if db > 0.0 { 1.0 / db } else { 0.0 };
        let mut total = 0i32;
        for (q, &v) in qs[b * QK..(b + 1) * QK].iter_mut().zip(xs) {
            // |v * id| <= 127 by construction; max/min (unlike `clamp`) also map
            // NaN (to -127) and make the conversion branch-free, so the loop
            // vectorizes.
            #[allow(clippy::manual_clamp)]
            let r = (v * id).round().max(-127.0).min(127.0);
            // SAFETY: `r` is finite and within i32.
            let qi = unsafe { r.to_int_unchecked::<i32>() };
            *q = qi as i8;
            total = total.wrapping_add(qi);
        }
        d[b] = db;
        s[b] = db * total as f32;
        sum[b] = total;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn q8_round_trip_error_is_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.13)
            .collect();
        let (mut qs, mut d, mut s, mut sum) = (vec![0i8; 64], [0f32; 2], [0f32; 2], [0i32; 2]);
        quantize_row_q8_split(&x, &mut qs, &mut d, &mut s, &mut sum);
        for b in 0..2 {
            let q = &qs[b * 32..(b + 1) * 32];
            assert_eq!(sum[b], q.iter().map(|&v| v as i32).sum::<i32>());
            assert_eq!(s[b], d[b] * sum[b] as f32);
            for (&qv, &xv) in q.iter().zip(&x[b * 32..]) {
                assert!((qv as f32 * d[b] - xv).abs() <= d[b] * 0.5 + 1e-6);
            }
        }
    }

    #[test]
    fn zero_row_quantizes_to_zero_scale() {
        let (mut qs, mut d, mut s, mut sum) = ([1i8; 32], [1f32], [1f32], [1i32]);
        quantize_row_q8_split(&[0.0; 32], &mut qs, &mut d, &mut s, &mut sum);
        assert_eq!((d[0], s[0], sum[0]), (0.0, 0.0, 0));
        assert!(qs.iter().all(|&v| v == 0));
    }

    #[test]
    fn nibbles_dequantize_in_ggml_order() {
        let mut q41 = [0u8; 20];
        q41[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        q41[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        q41[4] = 0x3A; // weight 0 = 0xA, weight 16 = 0x3
        let mut out = [0f32; QK];
        dequantize_block(QFormat::Q4_1, &q41, &mut out);
        assert_eq!(
            (out[0], out[16], out[1]),
            (10.0 * 0.5 - 1.0, 3.0 * 0.5 - 1.0, -1.0)
        );
        let mut q40 = [0u8; 18];
        q40[0..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        q40[2] = 0x3A;
        dequantize_block(QFormat::Q4_0, &q40, &mut out);
        assert_eq!(
            (out[0], out[16], out[1]),
            (2.0 * 0.25, -5.0 * 0.25, -8.0 * 0.25)
        );
    }

    #[test]
    fn q4_0_and_q8_0_quantizers_follow_ggml() {
        // Largest magnitude -4 (negative): d = -4 / -8 = 0.5; q = trunc(x / 0.5 + 8.5).
        let mut x = [0f32; QK];
        x[0] = -4.0;
        x[1] = 1.0;
        x[16] = 3.75; // 7.5 + 8.5 = 16 -> capped at 15
        x[17] = -0.3; // -0.6 + 8.5 = 7.9 -> 7
        let mut b = [0u8; 18];
        quantize_block_q4_0(&x, &mut b);
        assert_eq!(f16::from_le_bytes([b[0], b[1]]).to_f32(), 0.5);
        assert_eq!(b[2], (15 << 4), "x[0] = -4 -> q 0; x[16] -> q 15");
        assert_eq!(b[3], 10 | (7 << 4), "x[1] = 1 -> q 10; x[17] -> q 7");
        let mut back = [0f32; QK];
        dequantize_block(QFormat::Q4_0, &b, &mut back);
        assert_eq!((back[0], back[1], back[16]), (-4.0, 1.0, 3.5));
        // All zeros: scale 0, every q 8 (weight 0).
        quantize_block_q4_0(&[0.0; QK], &mut b);
        assert!(b[2..].iter().all(|&q| q == 0x88));
        // Rows of both formats round-trip within half a step.
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let xs: Vec<f32> = (0..4 * QK).map(|_| rng.random_range(-2.0..2.0)).collect();
        for format in [QFormat::Q8_0, QFormat::Q4_0] {
            let bytes = quantize_blocks(format, &xs);
            assert_eq!(bytes.len(), 4 * format.block_bytes());
            for (blk, x) in bytes.chunks_exact(format.block_bytes()).zip(xs.chunks(QK)) {
                dequantize_block(format, blk, &mut back);
                let d = f16::from_le_bytes([blk[0], blk[1]]).to_f32().abs();
                for (a, b) in back.iter().zip(x) {
                    assert!((a - b).abs() <= d * 1.01 + 1e-6, "{format:?}: {a} vs {b}");
                }
            }
        }
    }

    #[test]
    fn repack_and_unpack_round_trip_every_block() {
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        for format in [QFormat::Q4_0, QFormat::Q4_1, QFormat::Q8_0] {
            // 37 rows: two full tiles and a partial one.
            let (rows, cols) = (37, 96);
            let bytes: Vec<u8> = (0..rows * 3 * format.block_bytes())
                .map(|_| rng.random())
                .collect();
            let tiles = repack(format, &bytes, rows, cols);
            assert_eq!(tiles.len(), 3 * 3 * format.record_bytes());
            let mut back = vec![0u8; format.block_bytes()];
            for row in 0..rows {
                for b in 0..3 {
                    unpack_block(format, &tiles, 3, row, b, &mut back);
                    let at = (row * 3 + b) * format.block_bytes();
                    assert_eq!(
                        back,
                        &bytes[at..at + format.block_bytes()],
                        "{format:?} {row} {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn q5_0_as_q8_0_keeps_every_weight_exactly() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let blocks = 64;
        let mut q5 = Vec::new();
        let mut want = Vec::new();
        for _ in 0..blocks {
            let d = f16::from_f32(rng.random_range(-0.05..0.05));
            let q: Vec<u8> = (0..QK).map(|_| rng.random_range(0..32u8)).collect();
            let mut qh = 0u32;
            let mut qs = [0u8; 16];
            for j in 0..16 {
                qs[j] = (q[j] & 0xF) | ((q[j + 16] & 0xF) << 4);
            }
            for (j, &v) in q.iter().enumerate() {
                qh |= u32::from(v >> 4) << j;
            }
            q5.extend_from_slice(&d.to_le_bytes());
            q5.extend_from_slice(&qh.to_le_bytes());
            q5.extend_from_slice(&qs);
            want.extend(q.iter().map(|&v| d.to_f32() * (f32::from(v) - 16.0)));
        }
        let q8 = q5_0_as_q8_0(&q5);
        assert_eq!(q8.len(), blocks * QFormat::Q8_0.block_bytes());
        let mut got = vec![0f32; QK];
        for (b, w) in q8.chunks_exact(34).zip(want.chunks_exact(QK)) {
            dequantize_block(QFormat::Q8_0, b, &mut got);
            assert_eq!(got, w);
        }
    }
}
