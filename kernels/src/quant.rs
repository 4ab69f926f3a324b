//! Quantized block formats and activation quantization.
//!
//! Weight formats follow GGML's on-disk layouts (llama.cpp `ggml/src/ggml-common.h`):
//! - `Q4_1`: 32 weights per block, `w = d * q + m` with `q` in `0..16`; 20 bytes:
//!   `d: f16, m: f16, qs: [u8; 16]` where `qs[j] & 0x0F` is weight `j` and
//!   `qs[j] >> 4` is weight `j + 16`.
//! - `Q8_0`: 32 weights per block, `w = d * q` with `q: i8`; 34 bytes: `d: f16, qs: [i8; 32]`.
//!
//! Activations are quantized per row to [`BlockQ8`]: 32 values per block,
//! `x ~= d * q` with `q: i8`, plus `s = d * sum(q)` (needed by `Q4_1`'s offset term).
//! Unlike GGML's `Q8_1` we keep `d` and `s` in `f32`.

use half::f16;

/// Values per quantization block (all formats here).
pub const QK: usize = 32;

/// One `Q4_1` weight block (GGML layout, 20 bytes).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ4_1 {
    /// Scale.
    pub d: f16,
    /// Offset (minimum).
    pub m: f16,
    /// Packed 4-bit values: low nibbles are weights 0..16, high nibbles 16..32.
    pub qs: [u8; QK / 2],
}

/// One `Q8_0` weight block (GGML layout, 34 bytes).
#[derive(Clone, Copy, Debug)]
#[repr(C)]
pub struct BlockQ8_0 {
    /// Scale.
    pub d: f16,
    /// Signed 8-bit values.
    pub qs: [i8; QK],
}

/// One block of a quantized activation row (our format, 40 bytes).
#[derive(Clone, Copy, Debug, Default)]
#[repr(C)]
pub struct BlockQ8 {
    /// Scale: `x ~= d * q`.
    pub d: f32,
    /// `d * sum(qs)`, used by the `Q4_1` offset term.
    pub s: f32,
    /// Signed 8-bit values in `-127..=127`.
    pub qs: [i8; QK],
}

/// One weight row of `Q4_1` blocks in structure-of-arrays form (same bytes as
/// GGUF, regrouped so SIMD loads are contiguous): `qs` holds 16 bytes per block.
#[derive(Clone, Copy, Debug)]
pub struct Q4_1Row<'a> {
    /// Packed nibbles, 16 bytes per block (GGML order within a block).
    pub qs: &'a [u8],
    /// Block scales.
    pub d: &'a [f16],
    /// Block offsets.
    pub m: &'a [f16],
}

/// One weight row of `Q8_0` blocks in structure-of-arrays form.
#[derive(Clone, Copy, Debug)]
pub struct Q8_0Row<'a> {
    /// Values, 32 per block.
    pub qs: &'a [i8],
    /// Block scales.
    pub d: &'a [f16],
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
}

impl<'a> Q4_1Row<'a> {
    /// Blocks in the row.
    pub fn blocks(&self) -> usize {
        self.d.len()
    }

    /// The row from block `b` on.
    pub fn from_block(&self, b: usize) -> Self {
        Self {
            qs: &self.qs[b * QK / 2..],
            d: &self.d[b..],
            m: &self.m[b..],
        }
    }
}

impl<'a> Q8_0Row<'a> {
    /// Blocks in the row.
    pub fn blocks(&self) -> usize {
        self.d.len()
    }

    /// The row from block `b` on.
    pub fn from_block(&self, b: usize) -> Self {
        Self {
            qs: &self.qs[b * QK..],
            d: &self.d[b..],
        }
    }
}

impl<'a> ActRow<'a> {
    /// The row from block `b` on.
    pub fn from_block(&self, b: usize) -> Self {
        Self {
            qs: &self.qs[b * QK..],
            d: &self.d[b..],
            s: &self.s[b..],
        }
    }
}

/// Quantizes one activation row (length a multiple of [`QK`]) into split arrays:
/// `qs` (`x.len()` values), `d` and `s` (`x.len() / QK` each). Same rounding as
/// [`quantize_row_q8`].
pub fn quantize_row_q8_split(x: &[f32], qs: &mut [i8], d: &mut [f32], s: &mut [f32]) {
    for (b, xs) in x.chunks_exact(QK).enumerate() {
        let amax = xs.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let db = amax / 127.0;
        let id = if db > 0.0 { 1.0 / db } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in qs[b * QK..(b + 1) * QK].iter_mut().zip(xs) {
            let qi = (v * id).round() as i32;
            *q = qi as i8;
            sum += qi;
        }
        d[b] = db;
        s[b] = db * sum as f32;
    }
}

impl BlockQ4_1 {
    /// Bytes per block in a GGUF file.
    pub const BYTES: usize = 20;

    /// Parses one block from its 20 GGUF bytes.
    pub fn from_bytes(b: &[u8]) -> Self {
        let mut qs = [0u8; QK / 2];
        qs.copy_from_slice(&b[4..20]);
        Self {
            d: f16::from_le_bytes([b[0], b[1]]),
            m: f16::from_le_bytes([b[2], b[3]]),
            qs,
        }
    }

    /// Dequantizes the block into 32 floats.
    pub fn dequantize(&self, out: &mut [f32]) {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        for j in 0..QK / 2 {
            out[j] = (self.qs[j] & 0x0F) as f32 * d + m;
            out[j + QK / 2] = (self.qs[j] >> 4) as f32 * d + m;
        }
    }
}

impl BlockQ8_0 {
    /// Bytes per block in a GGUF file.
    pub const BYTES: usize = 34;

    /// Parses one block from its 34 GGUF bytes.
    pub fn from_bytes(b: &[u8]) -> Self {
        let mut qs = [0i8; QK];
        for (q, &byte) in qs.iter_mut().zip(&b[2..34]) {
            *q = byte as i8;
        }
        Self {
            d: f16::from_le_bytes([b[0], b[1]]),
            qs,
        }
    }

    /// Dequantizes the block into 32 floats.
    pub fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (o, &q) in out.iter_mut().zip(&self.qs) {
            *o = q as f32 * d;
        }
    }
}

/// Quantizes one activation row (length a multiple of [`QK`]) into `out`
/// (`x.len() / QK` blocks), symmetric 8-bit with round-to-nearest.
///
/// Deterministic and row-local: the result depends on `x` only, which keeps
/// matmuls batch-invariant.
pub fn quantize_row_q8(x: &[f32], out: &mut [BlockQ8]) {
    debug_assert_eq!(x.len() % QK, 0);
    debug_assert_eq!(out.len(), x.len() / QK);
    for (block, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let amax = xs.iter().fold(0f32, |a, &v| a.max(v.abs()));
        let d = amax / 127.0;
        let id = if d > 0.0 { 1.0 / d } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in block.qs.iter_mut().zip(xs) {
            let qi = (v * id).round() as i32;
            *q = qi as i8;
            sum += qi;
        }
        block.d = d;
        block.s = d * sum as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_round_trip_error_is_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.13)
            .collect();
        let mut q = vec![BlockQ8::default(); 2];
        quantize_row_q8(&x, &mut q);
        for (b, xs) in q.iter().zip(x.chunks_exact(QK)) {
            let sum: i32 = b.qs.iter().map(|&v| v as i32).sum();
            assert_eq!(b.s, b.d * sum as f32);
            for (&qv, &xv) in b.qs.iter().zip(xs) {
                assert!((qv as f32 * b.d - xv).abs() <= b.d * 0.5 + 1e-6);
            }
        }
    }

    #[test]
    fn zero_row_quantizes_to_zero_scale() {
        let mut q = vec![BlockQ8::default(); 1];
        quantize_row_q8(&[0.0; QK], &mut q);
        assert_eq!(q[0].d, 0.0);
        assert!(q[0].qs.iter().all(|&v| v == 0));
    }

    #[test]
    fn q4_1_dequantizes_nibbles_in_ggml_order() {
        let mut bytes = [0u8; 20];
        bytes[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        bytes[2..4].copy_from_slice(&f16::from_f32(-1.0).to_le_bytes());
        bytes[4] = 0x3A; // weight 0 = 0xA, weight 16 = 0x3
        let b = BlockQ4_1::from_bytes(&bytes);
        let mut out = [0f32; QK];
        b.dequantize(&mut out);
        assert_eq!(out[0], 10.0 * 0.5 - 1.0);
        assert_eq!(out[16], 3.0 * 0.5 - 1.0);
        assert_eq!(out[1], -1.0);
    }
}
