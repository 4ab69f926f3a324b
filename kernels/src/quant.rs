//! Quantized block formats, their repacked (interleaved) form, and activation
//! quantization.
//!
//! Weight formats follow GGML's on-disk layouts (llama.cpp `ggml/src/ggml-common.h`,
//! dequantized as in `ggml/src/ggml-quants.c` `dequantize_row_*`):
//! - `Q4_0`: 32 weights per block, `w = d * (q - 8)` with `q` in `0..16`; 18 bytes:
//!   `d: f16, qs: [u8; 16]` where `qs[j] & 0x0F` is weight `j` and `qs[j] >> 4` is
//!   weight `j + 16`; 4.5 bits per weight.
//! - `Q4_1`: `w = d * q + m`; 20 bytes: `d: f16, m: f16, qs: [u8; 16]` (nibbles as
//!   `Q4_0`); 5 bits per weight.
//! - `Q8_0`: `w = d * q` with `q: i8`; 34 bytes: `d: f16, qs: [i8; 32]`; 8.5 bits.
//! - `Q5_0`: `w = d * (q - 16)` with `q` in `0..32`; 22 bytes: `d: f16, qh: [u8; 4],
//!   qs: [u8; 16]`: the low 4 bits as `Q4_0`, bit 4 of weight `j` is bit `j` of the
//!   little-endian `qh`; 5.5 bits per weight.
//! - `Q4_K`: 256 weights per super-block, 8 sub-blocks of 32; 144 bytes: `d: f16,
//!   dmin: f16, scales: [u8; 12], qs: [u8; 128]`. Sub-block `j` has 6-bit `sc_j`, `m_j`
//!   (packed as `get_scale_min_k4`: see [`k4_scale_min`]) and `w = d * sc_j * q -
//!   dmin * m_j` with `q` in `0..16`; sub-blocks `2i` and `2i + 1` are the low and
//!   high nibbles of `qs[32i..32i + 32]`; 4.5 bits per weight.
//! - `Q5_K` (`block_q5_K` in `ggml-common.h`, `dequantize_row_q5_K`): 256 weights;
//!   176 bytes: `d: f16, dmin: f16, scales: [u8; 12], qh: [u8; 32], qs: [u8; 128]`.
//!   Scales, mins and the low 4 bits as `Q4_K`, and bit 4 of weight `l` of
//!   sub-block `j` is bit `j` of `qh[l]`: `w = d * sc_j * q - dmin * m_j` with `q`
//!   in `0..32`; 5.5 bits per weight.
//! - `Q6_K`: 256 weights; 210 bytes: `ql: [u8; 128], qh: [u8; 64], scales: [i8; 16],
//!   d: f16`; `w = d * scales[k / 16] * (q - 32)` for weight `k`, `q` in `0..64`
//!   spread over `ql` (low 4 bits) and `qh` (high 2) as `dequantize_row_q6_K` reads
//!   them; 6.5625 bits per weight.
//!
//! At load, matrices are repacked into tiles of [`TILE`] rows ([`repack`]): for
//! each tile and block (super-block for the K formats), one record holding the 16
//! rows' values interleaved in groups of 4 (so one 64-byte register holds 4
//! consecutive weights of each of 16 rows: one `vpdpbusd` lane per output row),
//! then their scales. A record is exactly as large as the rows' GGUF blocks except
//! for `Q4_K` and `Q5_K`, whose 6-bit scales and mins are stored as bytes (4.625
//! and 5.625 bits per weight instead of 4.5 and 5.5), so every kernel reads them
//! with one widening load.
//!
//! For `Q4_x` and `Q5_0` the record's values are the rows' `qs` bytes regrouped:
//! register `p` (0..4) holds bytes `4p..4p+4` of every row, whose low nibbles are
//! weights `4p..4p+4` and high nibbles weights `16+4p..16+4p+4` (group `g` of 8 is
//! the low nibbles of register `g` for `g < 4`, the high nibbles of register `g - 4`
//! otherwise). `Q8_0` values are stored offset-binary (`q ^ 0x80`, i.e. `q + 128`
//! as `u8`), one register per group. Record bytes (offsets in the record):
//! - `Q4_0`: 256 value bytes, 16 `d` (`f16`): 288 = 16 x 18;
//! - `Q4_1`: 256, 16 `d`, 16 `m`: 320 = 16 x 20;
//! - `Q8_0`: 512, 16 `d`: 544 = 16 x 34;
//! - `Q5_0`: 256 nibble bytes as `Q4_0`; a 64-byte high-bit plane whose byte `4 *
//!   lane + e` holds in bit `g` the high bit of weight `4g + e` of that row; 16 `d`:
//!   352 = 16 x 22;
//! - `Q4_K` (per super-block): 2048 nibble bytes, register `8i + g` (`i` in 0..4)
//!   holding bytes `32i + 4g..32i + 4g + 4` of every row's `qs` (low nibbles: group
//!   `g` of sub-block `2i`, high nibbles: of sub-block `2i + 1`); `sc` as 8 x 16 bytes
//!   (`[j][lane]`) at 2048; `m` likewise at 2176; 16 `d` at 2304; 16 `dmin` at 2336:
//!   2368 = 16 x 148;
//! - `Q5_K` (per super-block): the low 4 bits of `q` as `Q4_K`'s nibbles (2048
//!   bytes, the rows' `qs` bytes regrouped); at 2048 one 64-byte high-bit plane per
//!   sub-block `j`, laid out as `Q5_0`'s (byte `4 * lane + e` holds in bit `g` the
//!   high bit of weight `4g + e` of the sub-block); then `sc`, `m`, `d`, `dmin` as
//!   `Q4_K`'s at 2560, 2688, 2816, 2848: 2880 = 16 x 180;
//! - `Q6_K` (per super-block): the low 4 bits of `q` as `Q4_K`'s nibbles (2048
//!   bytes); at 2048 two 64-byte planes per sub-block `j` (`[j][p][lane][e]`) whose
//!   byte holds in bits `2h..2h + 2` the high 2 bits of weight `4 (4p + h) + e` of the
//!   sub-block; the 16 `i8` scales as 16 x 16 bytes (`[k][lane]`) at 3072; 16 `d` at
//!   3328: 3360 = 16 x 210.
//!
//! Activations are quantized per row: 32 values per block, `x ~= d * q` with
//! `q: i8`, plus the block's integer sum `sum(q)`, the sums of its two halves of 16
//! (for `Q6_K`'s offset, which has a scale per 16 weights) and `s = d * sum(q)` (for
//! the offset terms). Unlike GGML's `Q8_1` we keep `d` and `s` in `f32`.

use half::f16;

/// Values per quantization block of the 32-value formats, and per activation block.
pub const QK: usize = 32;

/// Values per super-block of the K formats (`Q4_K`, `Q5_K`, `Q6_K`): 8 blocks of
/// [`QK`].
pub const QK_K: usize = 256;

/// Weight rows per repacked tile (one AVX-512 register of outputs).
pub const TILE: usize = 16;

/// A quantized weight format with a native kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QFormat {
    /// GGML `Q4_0` (4.5 bits per weight).
    Q4_0,
    /// GGML `Q4_1` (5 bits per weight).
    Q4_1,
    /// GGML `Q8_0` (8.5 bits per weight).
    Q8_0,
    /// GGML `Q5_0` (5.5 bits per weight).
    Q5_0,
    /// GGML `Q4_K` (4.5 bits per weight in the file, 4.625 repacked).
    Q4K,
    /// GGML `Q5_K` (5.5 bits per weight in the file, 5.625 repacked).
    Q5K,
    /// GGML `Q6_K` (6.5625 bits per weight).
    Q6K,
}

impl QFormat {
    /// GGML's name of the format.
    pub fn name(self) -> &'static str {
        match self {
            Self::Q4_0 => "Q4_0",
            Self::Q4_1 => "Q4_1",
            Self::Q8_0 => "Q8_0",
            Self::Q5_0 => "Q5_0",
            Self::Q4K => "Q4_K",
            Self::Q5K => "Q5_K",
            Self::Q6K => "Q6_K",
        }
    }

    /// Weights per GGUF block: [`QK`], or [`QK_K`] for the K formats.
    pub fn block_values(self) -> usize {
        match self {
            Self::Q4K | Self::Q5K | Self::Q6K => QK_K,
            _ => QK,
        }
    }

    /// Activation blocks ([`QK`] values) per weight block: 1, or 8 for K formats.
    pub fn sub_blocks(self) -> usize {
        self.block_values() / QK
    }

    /// Bytes of one block in a GGUF file.
    pub fn block_bytes(self) -> usize {
        match self {
            Self::Q4_0 => 18,
            Self::Q4_1 => 20,
            Self::Q8_0 => 34,
            Self::Q5_0 => 22,
            Self::Q4K => 144,
            Self::Q5K => 176,
            Self::Q6K => 210,
        }
    }

    /// Bytes per row of one repacked record: [`QFormat::block_bytes`] except
    /// for `Q4_K` and `Q5_K` (148 and 180: their 12 bytes of packed 6-bit scales and
    /// mins stored as 16 bytes).
    pub fn row_record_bytes(self) -> usize {
        match self {
            Self::Q4K | Self::Q5K => self.block_bytes() + 4,
            f => f.block_bytes(),
        }
    }

    /// Bytes of one repacked record (16 rows x one block).
    pub fn record_bytes(self) -> usize {
        TILE * self.row_record_bytes()
    }

    /// Offset in a record of the 16 `f16` scales `d` (all bytes before it are
    /// values, high-bit planes and the K formats' sub-block scales and mins).
    pub fn value_bytes(self) -> usize {
        match self {
            Self::Q4_0 | Self::Q4_1 => 256,
            Self::Q8_0 => 512,
            Self::Q5_0 => 320,
            Self::Q4K => 2304,
            Self::Q5K => 2816,
            Self::Q6K => 3328,
        }
    }

    /// What the stored unsigned values must be lowered by to give the signed
    /// quant: 8 for `Q4_0`, 16 for `Q5_0`, 32 for `Q6_K`, 128 for `Q8_0`
    /// (offset-binary), 0 for `Q4_1`, `Q4_K` and `Q5_K` (they have a separate
    /// offset, the min).
    pub fn int_offset(self) -> i32 {
        match self {
            Self::Q4_0 => 8,
            Self::Q5_0 => 16,
            Self::Q6K => 32,
            Self::Q8_0 => 128,
            Self::Q4_1 | Self::Q4K | Self::Q5K => 0,
        }
    }

    /// Offset in a K format's record of its sub-block scales as `[j][lane]`
    /// bytes: `Q4_K`'s and `Q5_K`'s 8 `sc` (`u8`), followed by their 8 `m` (`8 *
    /// TILE` bytes later); `Q6_K`'s 16 `i8` scales. Panics for other formats.
    pub(crate) const fn scales_at(self) -> usize {
        match self {
            Self::Q4K => 2048,
            Self::Q5K => 2560,
            Self::Q6K => 3072,
            _ => panic!("only the K formats have sub-block scales"),
        }
    }

    /// Which 64-byte value register of a record holds the low 4 bits of group `g`
    /// (`0..8`: weights `4g..4g + 4`) of activation block `j`, and whether as its
    /// high nibbles (see the module docs; not for `Q8_0`, whose group `g` is
    /// register `g`, whole bytes).
    #[inline(always)]
    pub(crate) const fn nibble_source(self, j: usize, g: usize) -> (usize, bool) {
        match self {
            Self::Q4K | Self::Q5K | Self::Q6K => (8 * (j / 2) + g, j % 2 == 1),
            _ if g < 4 => (g, false),
            _ => (g - 4, true),
        }
    }

    /// For the formats with values above 4 bits (`Q5_0`, `Q5_K`, `Q6_K`): the byte
    /// offset in a record of the 64-byte plane holding the high bits of group `g`
    /// of activation block `j` (byte `4 * lane + e` for weight `4g + e`), the bit of
    /// the plane's bytes where they start, and their mask once moved to bit 4
    /// (`0x10` for one bit, `0x30` for two). `None` for the other formats.
    #[inline(always)]
    pub(crate) const fn high_bits(self, j: usize, g: usize) -> Option<(usize, u32, u8)> {
        match self {
            Self::Q5_0 => Some((256, g as u32, 0x10)),
            Self::Q5K => Some((2048 + 64 * j, g as u32, 0x10)),
            Self::Q6K => Some((2048 + (2 * j + g / 4) * 64, 2 * (g % 4) as u32, 0x30)),
            _ => None,
        }
    }
}

/// Sub-block `j`'s 6-bit scale and min from a `Q4_K` or `Q5_K` block's 12 packed
/// bytes (llama.cpp `get_scale_min_k4`).
pub fn k4_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The inverse of [`k4_scale_min`]: 8 scales and mins (6-bit each) packed as
/// `Q4_K` and `Q5_K` store them (every bit of the 12 bytes is used, so this is a
/// bijection).
pub fn k4_pack_scale_min(sc: &[u8; 8], m: &[u8; 8]) -> [u8; 12] {
    let mut q = [0u8; 12];
    for j in 0..4 {
        q[j] = (sc[j] & 63) | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = (m[j] & 63) | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0xF) | ((m[j + 4] & 0xF) << 4);
    }
    q
}

/// The 256 values of a `Q4_K` (`0..16`) or `Q5_K` (`0..32`) block `b`, in weight
/// order: sub-blocks `2i` and `2i + 1` are the low and high nibbles of `qs[32i..32i
/// + 32]`, and for `Q5_K` bit 4 of weight `l` of sub-block `j` is bit `j` of
/// `qh[l]` (as `dequantize_row_q4_K` and `dequantize_row_q5_K` read them).
fn k_values(format: QFormat, b: &[u8]) -> [u8; QK_K] {
    let qs = &b[format.block_bytes() - QK_K / 2..format.block_bytes()];
    let mut q = [0u8; QK_K];
    for (j, qj) in q.chunks_exact_mut(QK).enumerate() {
        for (l, v) in qj.iter_mut().enumerate() {
            *v = (qs[32 * (j / 2) + l] >> (4 * (j % 2))) & 0xF;
            if format == QFormat::Q5K {
                *v |= ((b[16 + l] >> j) & 1) << 4;
            }
        }
    }
    q
}

/// The 256 6-bit values (`0..64`) of a `Q6_K` block's `ql` and `qh`, in weight
/// order (as `dequantize_row_q6_K` reads them).
fn q6k_values(ql: &[u8], qh: &[u8]) -> [u8; QK_K] {
    let mut q = [0u8; QK_K];
    for n in 0..2 {
        let (ql, qh, y) = (&ql[64 * n..], &qh[32 * n..], &mut q[128 * n..]);
        for l in 0..32 {
            y[l] = (ql[l] & 0xF) | ((qh[l] & 3) << 4);
            y[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
            y[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
            y[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
        }
    }
    q
}

/// The inverse of [`q6k_values`]: writes `ql` (128 bytes) and `qh` (64 bytes).
fn q6k_encode(q: &[u8; QK_K], ql: &mut [u8], qh: &mut [u8]) {
    for n in 0..2 {
        let y = &q[128 * n..];
        for l in 0..32 {
            ql[64 * n + l] = (y[l] & 0xF) | ((y[l + 64] & 0xF) << 4);
            ql[64 * n + l + 32] = (y[l + 32] & 0xF) | ((y[l + 96] & 0xF) << 4);
            qh[32 * n + l] = (y[l] >> 4)
                | ((y[l + 32] >> 4) << 2)
                | ((y[l + 64] >> 4) << 4)
                | ((y[l + 96] >> 4) << 6);
        }
    }
}

/// Dequantizes one GGUF block of `format` (`format.block_bytes()` bytes) into
/// `format.block_values()` floats, as llama.cpp's `dequantize_row_*` does.
pub fn dequantize_block(format: QFormat, b: &[u8], out: &mut [f32]) {
    let f16_at = |at: usize| f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    match format {
        QFormat::Q4_0 | QFormat::Q4_1 => {
            let d = f16_at(0);
            let (m, qs) = match format {
                QFormat::Q4_1 => (f16_at(2), &b[4..20]),
                _ => (-8.0 * d, &b[2..18]),
            };
            for j in 0..QK / 2 {
                out[j] = (qs[j] & 0x0F) as f32 * d + m;
                out[j + QK / 2] = (qs[j] >> 4) as f32 * d + m;
            }
        }
        QFormat::Q8_0 => {
            let d = f16_at(0);
            for (o, &q) in out[..QK].iter_mut().zip(&b[2..34]) {
                *o = q as i8 as f32 * d;
            }
        }
        QFormat::Q5_0 => {
            let d = f16_at(0);
            let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
            for j in 0..QK / 2 {
                let lo = (b[6 + j] & 0x0F) | ((((qh >> j) & 1) as u8) << 4);
                let hi = (b[6 + j] >> 4) | ((((qh >> (j + 16)) & 1) as u8) << 4);
                out[j] = (lo as i32 - 16) as f32 * d;
                out[j + QK / 2] = (hi as i32 - 16) as f32 * d;
            }
        }
        QFormat::Q4K | QFormat::Q5K => {
            let (d, dmin) = (f16_at(0), f16_at(2));
            let q = k_values(format, b);
            let subs = out[..QK_K].chunks_exact_mut(QK).zip(q.chunks_exact(QK));
            for (j, (o, q)) in subs.enumerate() {
                let (sc, m) = k4_scale_min(j, &b[4..16]);
                let (dj, mj) = (d * sc as f32, dmin * m as f32);
                for (o, &v) in o.iter_mut().zip(q) {
                    *o = dj * v as f32 - mj;
                }
            }
        }
        QFormat::Q6K => {
            let d = f16_at(208);
            let q = q6k_values(&b[0..128], &b[128..192]);
            for (k, o) in out[..QK_K].iter_mut().enumerate() {
                let sc = b[192 + k / 16] as i8;
                *o = d * sc as f32 * (q[k] as i32 - 32) as f32;
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
/// Panics for other formats (no writer here) or a length that is not whole blocks.
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
            f => panic!("no {} quantizer", f.name()),
        }
    }
    out
}

/// Repacks a row-major GGUF matrix (`rows x cols`, `cols / format.block_values()`
/// blocks per row) of `format` into tiles (see the module docs); rows past `rows`
/// in the last tile are zero (scale 0). `bytes.len()` must be `rows * cols /
/// format.block_values() * format.block_bytes()`.
pub fn repack(format: QFormat, bytes: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let (bb, bpr) = (format.block_bytes(), cols / format.block_values());
    assert_eq!(bytes.len(), rows * bpr * bb, "GGUF matrix bytes");
    let rec = format.record_bytes();
    let tiles = rows.div_ceil(TILE);
    let mut out = vec![0u8; tiles * bpr * rec];
    for row in 0..rows {
        let (t, lane) = (row / TILE, row % TILE);
        for b in 0..bpr {
            let src = &bytes[(row * bpr + b) * bb..][..bb];
            let dst = &mut out[(t * bpr + b) * rec..][..rec];
            repack_block(format, src, lane, dst);
        }
    }
    out
}

/// Byte `e` of group `g` of `lane` in a run of 4-byte-per-lane registers.
#[inline(always)]
fn at(g: usize, lane: usize, e: usize) -> usize {
    (g * TILE + lane) * 4 + e
}

/// Writes one GGUF block `src` as row `lane` of record `dst`.
fn repack_block(format: QFormat, src: &[u8], lane: usize, dst: &mut [u8]) {
    let vb = format.value_bytes();
    match format {
        QFormat::Q4_0 | QFormat::Q4_1 | QFormat::Q8_0 | QFormat::Q5_0 => {
            dst[vb + lane * 2..vb + lane * 2 + 2].copy_from_slice(&src[0..2]);
            let qs = match format {
                QFormat::Q4_0 => &src[2..18],
                QFormat::Q4_1 => {
                    dst[vb + 32 + lane * 2..vb + 34 + lane * 2].copy_from_slice(&src[2..4]);
                    &src[4..20]
                }
                QFormat::Q5_0 => {
                    // The high bits (nibbles 0: they are copied below).
                    let qh = u32::from_le_bytes([src[2], src[3], src[4], src[5]]);
                    for k in 0..QK {
                        put_value(format, dst, lane, 0, k, (((qh >> k) & 1) as u8) << 4);
                    }
                    &src[6..22]
                }
                _ => &src[2..34],
            };
            for (g, q4) in qs.chunks_exact(4).enumerate() {
                for (e, &q) in q4.iter().enumerate() {
                    dst[at(g, lane, e)] = if format == QFormat::Q8_0 { q ^ 0x80 } else { q };
                }
            }
        }
        QFormat::Q4K | QFormat::Q5K => {
            dst[vb + lane * 2..vb + lane * 2 + 2].copy_from_slice(&src[0..2]);
            dst[vb + 32 + lane * 2..vb + 34 + lane * 2].copy_from_slice(&src[2..4]);
            let sa = format.scales_at();
            for j in 0..8 {
                let (sc, m) = k4_scale_min(j, &src[4..16]);
                dst[sa + j * TILE + lane] = sc;
                dst[sa + 8 * TILE + j * TILE + lane] = m;
            }
            // Register 8i + g holds bytes 32i + 4g.. of qs: the same bytes in order.
            let qs = &src[format.block_bytes() - QK_K / 2..format.block_bytes()];
            for (g, q4) in qs.chunks_exact(4).enumerate() {
                dst[at(g, lane, 0)..at(g, lane, 4)].copy_from_slice(q4);
            }
            if format == QFormat::Q5K {
                // The high bits (nibbles 0: copied above); `qh` is `src[16..48]`.
                for (j, l) in (0..8).flat_map(|j| (0..QK).map(move |l| (j, l))) {
                    put_value(format, dst, lane, j, l, ((src[16 + l] >> j) & 1) << 4);
                }
            }
        }
        QFormat::Q6K => {
            dst[vb + lane * 2..vb + lane * 2 + 2].copy_from_slice(&src[208..210]);
            for k in 0..16 {
                dst[format.scales_at() + k * TILE + lane] = src[192 + k];
            }
            let q = q6k_values(&src[0..128], &src[128..192]);
            for (j, qj) in q.chunks_exact(QK).enumerate() {
                for (k, &v) in qj.iter().enumerate() {
                    put_value(format, dst, lane, j, k, v);
                }
            }
        }
    }
}

/// ORs the stored value `v` of weight `k` of activation block `j` of row `lane`
/// into a record `dst` that was zero there: its low 4 bits into their nibble, the
/// bits above into their high-bit plane. The inverse of [`lane_values`] (not for
/// `Q8_0`).
fn put_value(format: QFormat, dst: &mut [u8], lane: usize, j: usize, k: usize, v: u8) {
    let (g, e) = (k / 4, k % 4);
    let (reg, high) = format.nibble_source(j, g);
    dst[at(reg, lane, e)] |= (v & 0xF) << (4 * high as u32);
    if let Some((plane, from, _)) = format.high_bits(j, g) {
        dst[plane + at(0, lane, e)] |= (v >> 4) << from;
    }
}

/// The stored unsigned values of activation block `j` (`0..format.sub_blocks()`)
/// of row `lane` in record `rec`, in weight order: the signed quant is the value
/// minus [`QFormat::int_offset`]. The portable kernel's (and [`unpack_block`]'s)
/// reading of the record layout.
pub(crate) fn lane_values(format: QFormat, rec: &[u8], lane: usize, j: usize) -> [u8; QK] {
    let mut u = [0u8; QK];
    for (k, v) in u.iter_mut().enumerate() {
        let (g, e) = (k / 4, k % 4);
        if format == QFormat::Q8_0 {
            *v = rec[at(g, lane, e)];
            continue;
        }
        let (reg, high) = format.nibble_source(j, g);
        *v = (rec[at(reg, lane, e)] >> (4 * high as u32)) & 0x0F;
        if let Some((plane, from, mask)) = format.high_bits(j, g) {
            *v |= ((rec[plane + at(0, lane, e)] >> from) << 4) & mask;
        }
    }
    u
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
    let d = &src[vb + lane * 2..vb + lane * 2 + 2];
    match format {
        QFormat::Q4_0 | QFormat::Q4_1 | QFormat::Q8_0 => {
            out[0..2].copy_from_slice(d);
            let qs = match format {
                QFormat::Q4_0 => &mut out[2..18],
                QFormat::Q4_1 => {
                    out[2..4].copy_from_slice(&src[vb + 32 + lane * 2..vb + 34 + lane * 2]);
                    &mut out[4..20]
                }
                _ => &mut out[2..34],
            };
            for (g, q4) in qs.chunks_exact_mut(4).enumerate() {
                for (e, q) in q4.iter_mut().enumerate() {
                    let v = src[at(g, lane, e)];
                    *q = if format == QFormat::Q8_0 { v ^ 0x80 } else { v };
                }
            }
        }
        QFormat::Q5_0 => {
            out[0..2].copy_from_slice(d);
            let u = lane_values(format, src, lane, 0);
            let qh = u
                .iter()
                .enumerate()
                .fold(0u32, |h, (k, &v)| h | u32::from(v >> 4) << k);
            out[2..6].copy_from_slice(&qh.to_le_bytes());
            for j in 0..QK / 2 {
                out[6 + j] = (u[j] & 0xF) | ((u[j + 16] & 0xF) << 4);
            }
        }
        QFormat::Q4K | QFormat::Q5K => {
            out[0..2].copy_from_slice(d);
            out[2..4].copy_from_slice(&src[vb + 32 + lane * 2..vb + 34 + lane * 2]);
            let sa = format.scales_at();
            let sc: [u8; 8] = std::array::from_fn(|j| src[sa + j * TILE + lane]);
            let m: [u8; 8] = std::array::from_fn(|j| src[sa + 8 * TILE + j * TILE + lane]);
            out[4..16].copy_from_slice(&k4_pack_scale_min(&sc, &m));
            let qs_at = format.block_bytes() - QK_K / 2;
            for (g, q4) in out[qs_at..qs_at + QK_K / 2].chunks_exact_mut(4).enumerate() {
                q4.copy_from_slice(&src[at(g, lane, 0)..at(g, lane, 4)]);
            }
            if format == QFormat::Q5K {
                let mut qh = [0u8; QK];
                for j in 0..8 {
                    for (h, v) in qh.iter_mut().zip(lane_values(format, src, lane, j)) {
                        *h |= (v >> 4) << j;
                    }
                }
                out[16..48].copy_from_slice(&qh);
            }
        }
        QFormat::Q6K => {
            let mut q = [0u8; QK_K];
            for (j, qj) in q.chunks_exact_mut(QK).enumerate() {
                qj.copy_from_slice(&lane_values(format, src, lane, j));
            }
            let (ql, rest) = out.split_at_mut(128);
            q6k_encode(&q, ql, &mut rest[..64]);
            for k in 0..16 {
                out[192 + k] = src[format.scales_at() + k * TILE + lane];
            }
            out[208..210].copy_from_slice(d);
        }
    }
}

/// A `Q4_0` or `Q5_0` block as the `Q8_0` block of the same weights (`d` kept,
/// `q - 8` or `q - 16` as `i8`), or `None` for other formats; `Q8_0` is copied.
/// For stacking matrices of those formats without requantization.
pub fn as_q8_0_exactly(format: QFormat, b: &[u8]) -> Option<[u8; 34]> {
    let mut out = [0u8; 34];
    out[0..2].copy_from_slice(&b[0..2]);
    let (qh, qs) = match format {
        QFormat::Q8_0 => {
            out.copy_from_slice(&b[..34]);
            return Some(out);
        }
        QFormat::Q4_0 => (0, &b[2..18]),
        QFormat::Q5_0 => (u32::from_le_bytes([b[2], b[3], b[4], b[5]]), &b[6..22]),
        _ => return None,
    };
    let off = format.int_offset() as i8;
    for j in 0..QK {
        let nib = if j < 16 {
            qs[j] & 0x0F
        } else {
            qs[j - 16] >> 4
        };
        let q = nib | ((((qh >> j) & 1) as u8) << 4);
        out[2 + j] = (q as i8 - off) as u8;
    }
    Some(out)
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
    /// `sum(qs)` per half block (16 values; two per block).
    pub sum16: &'a [i32],
}

/// The output arrays of [`quantize_row_q8_split`] for one row of `n` values:
/// `qs` (`n` values), per block (`n / QK` each) `d`, `s` and `sum`, and `sum16`
/// (`n / 16`).
#[derive(Debug)]
pub struct ActRowMut<'a> {
    /// Values.
    pub qs: &'a mut [i8],
    /// Block scales.
    pub d: &'a mut [f32],
    /// `d * sum(qs)` per block.
    pub s: &'a mut [f32],
    /// `sum(qs)` per block.
    pub sum: &'a mut [i32],
    /// `sum(qs)` per half block.
    pub sum16: &'a mut [i32],
}

/// Quantizes one activation row (length a multiple of [`QK`]) into split arrays
/// (see [`ActRowMut`]). Symmetric 8-bit, round half away from zero; deterministic
/// and row-local, which keeps matmuls batch-invariant.
pub fn quantize_row_q8_split(x: &[f32], out: ActRowMut) {
    #[cfg(target_arch = "x86_64")]
    if crate::isa::isa() != crate::isa::Isa::Scalar {
        // SAFETY: `isa()` verified avx2 and fma. Same results: rounding is exact.
        return unsafe { quantize_avx2(x, out) };
    }
    quantize(x, out)
}

/// [`quantize`] in AVX2 intrinsics, the same operations on 8 values at a time
/// (the compiler left `quantize`'s rounding loop scalar even with AVX2 enabled: a
/// sixth of Gemma 3's batched prefill step went there):
/// - the block maximum of `|v|` skips NaNs as `f32::max` does (`vmaxps` returns its
///   second operand when either is NaN, so `|v|` goes first);
/// - `round` (half away from zero) is `trunc(p + copysign(0.49999997, p))`, the
///   sequence the compiler emits for `f32::round` with SSE4.1, exact for every `p`;
/// - `max(-127)` then `min(127)` map NaN to -127 as `f32::max`/`min` do (the
///   constant is the second operand);
/// - the quants fit an `i8`, so the saturating packs are exact, and the sums are
///   exact integer sums.
///
/// The scale `d`, its inverse and the per-block float products are the scalar
/// code's own. `quantize_row_q8_split_matches_the_portable_quantizer_bitwise`
/// checks all of it against [`quantize`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn quantize_avx2(x: &[f32], out: ActRowMut) {
    use std::arch::x86_64::*;
    let ActRowMut {
        qs,
        d,
        s,
        sum,
        sum16,
    } = out;
    assert!(
        x.len().is_multiple_of(QK)
            && qs.len() >= x.len()
            && d.len() * QK >= x.len()
            && s.len() * QK >= x.len()
            && sum.len() * QK >= x.len()
            && sum16.len() * QK >= 2 * x.len(),
        "activation row shape"
    );
    let sign = _mm256_set1_ps(-0.0);
    let half = _mm256_set1_ps(0.499_999_97);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    // Dword order after the two in-lane packs below: [0, 4, 1, 5, 2, 6, 3, 7].
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let hsum = |v: __m256i| -> i32 {
        let v = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b01_00_11_10>(v));
        let v = _mm_add_epi32(v, _mm_shuffle_epi32::<0b10_11_00_01>(v));
        _mm_cvtsi128_si32(v)
    };
    for (b, xs) in x.chunks_exact(QK).enumerate() {
        // SAFETY: 32 values per block.
        let v: [__m256; 4] =
            std::array::from_fn(|i| unsafe { _mm256_loadu_ps(xs.as_ptr().add(8 * i)) });
        let mut m = _mm256_setzero_ps();
        for &vi in &v {
            m = _mm256_max_ps(_mm256_andnot_ps(sign, vi), m);
        }
        let mut m8 = [0f32; 8];
        // SAFETY: 8 floats.
        unsafe { _mm256_storeu_ps(m8.as_mut_ptr(), m) };
        let amax = m8.iter().fold(0f32, |a, &v| a.max(v));
        let db = amax / 127.0;
        let id = if db > 0.0 { 1.0 / db } else { 0.0 };
        let idv = _mm256_set1_ps(id);
        let q: [__m256i; 4] = std::array::from_fn(|i| {
            let p = _mm256_mul_ps(v[i], idv);
            let bias = _mm256_or_ps(_mm256_and_ps(p, sign), half);
            let r = _mm256_round_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(_mm256_add_ps(
                p, bias,
            ));
            _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        });
        let bytes = _mm256_packs_epi16(
            _mm256_packs_epi32(q[0], q[1]),
            _mm256_packs_epi32(q[2], q[3]),
        );
        let bytes = _mm256_permutevar8x32_epi32(bytes, order);
        // SAFETY: 32 quants of block b, inside `qs` (asserted).
        unsafe { _mm256_storeu_si256(qs.as_mut_ptr().add(b * QK).cast(), bytes) };
        sum16[2 * b] = hsum(_mm256_add_epi32(q[0], q[1]));
        sum16[2 * b + 1] = hsum(_mm256_add_epi32(q[2], q[3]));
        let total = sum16[2 * b] + sum16[2 * b + 1];
        d[b] = db;
        s[b] = db * total as f32;
        sum[b] = total;
    }
}

#[inline(always)]
fn quantize(x: &[f32], out: ActRowMut) {
    let ActRowMut {
        qs,
        d,
        s,
        sum,
        sum16,
    } = out;
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
        for h in 0..2 {
            let mut total = 0i32;
            let at = b * QK + h * QK / 2;
            for (q, &v) in qs[at..at + QK / 2].iter_mut().zip(&xs[h * QK / 2..]) {
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
            sum16[2 * b + h] = total;
        }
        let total = sum16[2 * b] + sum16[2 * b + 1];
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

    /// The AVX2 quantizer against the portable one, bit for bit, on rows with
    /// half-integer products, zeros, tiny and huge values, infinities and NaNs.
    #[test]
    fn quantize_row_q8_split_matches_the_portable_quantizer_bitwise() {
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            let mut rng = ChaCha8Rng::seed_from_u64(21);
            let specials = [
                0.0,
                -0.0,
                0.5,
                -0.5,
                1.5,
                -2.5,
                126.5,
                -126.5,
                127.0,
                1e-40,
                -1e-38,
                3e38,
                f32::INFINITY,
                f32::NEG_INFINITY,
                f32::NAN,
                f32::MIN_POSITIVE,
            ];
            for row in 0..400 {
                let n = 32 * (1 + row % 5);
                let x: Vec<f32> = (0..n)
                    .map(|_| match rng.random_range(0..10) {
                        0 => specials[rng.random_range(0..specials.len())],
                        // Multiples of 0.5 against a round maximum (127): exact
                        // half-way products.
                        1 => rng.random_range(-254i32..=254) as f32 * 0.5,
                        2 => rng.random_range(-1e-3..1e-3),
                        _ => rng.random_range(-8.0..8.0),
                    })
                    .collect();
                let nb = n / 32;
                let run = |avx2: bool| {
                    let (mut qs, mut d, mut s) = (vec![0i8; n], vec![0f32; nb], vec![0f32; nb]);
                    let (mut sum, mut sum16) = (vec![0i32; nb], vec![0i32; 2 * nb]);
                    let out = ActRowMut {
                        qs: &mut qs,
                        d: &mut d,
                        s: &mut s,
                        sum: &mut sum,
                        sum16: &mut sum16,
                    };
                    if avx2 {
                        // SAFETY: avx2 and fma detected above.
                        unsafe { quantize_avx2(&x, out) };
                    } else {
                        quantize(&x, out);
                    }
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    (qs, bits(&d), bits(&s), sum, sum16)
                };
                assert_eq!(run(true), run(false), "row {row}: {x:?}");
            }
        }
    }

    #[test]
    fn q8_round_trip_error_is_within_half_a_step() {
        let x: Vec<f32> = (0..64)
            .map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.13)
            .collect();
        let (mut qs, mut d, mut s, mut sum) = (vec![0i8; 64], [0f32; 2], [0f32; 2], [0i32; 2]);
        let mut sum16 = [0i32; 4];
        quantize_row_q8_split(
            &x,
            ActRowMut {
                qs: &mut qs,
                d: &mut d,
                s: &mut s,
                sum: &mut sum,
                sum16: &mut sum16,
            },
        );
        for b in 0..2 {
            let q = &qs[b * 32..(b + 1) * 32];
            assert_eq!(sum[b], q.iter().map(|&v| v as i32).sum::<i32>());
            let half = |h: usize| {
                q[16 * h..16 * h + 16]
                    .iter()
                    .map(|&v| v as i32)
                    .sum::<i32>()
            };
            assert_eq!([sum16[2 * b], sum16[2 * b + 1]], [half(0), half(1)]);
            assert_eq!(s[b], d[b] * sum[b] as f32);
            for (&qv, &xv) in q.iter().zip(&x[b * 32..]) {
                assert!((qv as f32 * d[b] - xv).abs() <= d[b] * 0.5 + 1e-6);
            }
        }
    }

    #[test]
    fn zero_row_quantizes_to_zero_scale() {
        let (mut qs, mut d, mut s, mut sum) = ([1i8; 32], [1f32], [1f32], [1i32]);
        let mut sum16 = [1i32; 2];
        quantize_row_q8_split(
            &[0.0; 32],
            ActRowMut {
                qs: &mut qs,
                d: &mut d,
                s: &mut s,
                sum: &mut sum,
                sum16: &mut sum16,
            },
        );
        assert_eq!((d[0], s[0], sum[0], sum16), (0.0, 0.0, 0, [0, 0]));
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
        for format in ALL {
            // 37 rows: two full tiles and a partial one; 3 blocks per row.
            let (rows, cols) = (37, 3 * format.block_values());
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

    const ALL: [QFormat; 7] = [
        QFormat::Q4_0,
        QFormat::Q4_1,
        QFormat::Q8_0,
        QFormat::Q5_0,
        QFormat::Q4K,
        QFormat::Q5K,
        QFormat::Q6K,
    ];

    #[test]
    fn record_sizes_are_the_documented_bits_per_weight() {
        let bpw = |f: QFormat| (f.row_record_bytes() * 8) as f64 / f.block_values() as f64;
        let file = |f: QFormat| (f.block_bytes() * 8) as f64 / f.block_values() as f64;
        let want = [
            (QFormat::Q4_0, 4.5, 4.5),
            (QFormat::Q4_1, 5.0, 5.0),
            (QFormat::Q8_0, 8.5, 8.5),
            (QFormat::Q5_0, 5.5, 5.5),
            (QFormat::Q4K, 4.5, 4.625),
            (QFormat::Q5K, 5.5, 5.625),
            (QFormat::Q6K, 6.5625, 6.5625),
        ];
        for (f, in_file, repacked) in want {
            assert_eq!((file(f), bpw(f)), (in_file, repacked), "{f:?}");
            // The record: values (and planes, sub-block scales), 16 `d`, then the
            // second `f16` array of Q4_1, Q4_K and Q5_K.
            let extra = if matches!(f, QFormat::Q4_1 | QFormat::Q4K | QFormat::Q5K) {
                64
            } else {
                32
            };
            assert_eq!(f.value_bytes() + extra, f.record_bytes(), "{f:?}");
        }
    }

    #[test]
    fn q5_0_block_dequantizes_as_ggml() {
        // d = 0.5; weight 0: low nibble 3 + high bit (qh bit 0) -> 19 - 16 = 3;
        // weight 16: high nibble 0xA, qh bit 16 clear -> 10 - 16 = -6;
        // weight 31: high nibble of qs[15] 0xF + qh bit 31 -> 31 - 16 = 15.
        let mut b = [0u8; 22];
        b[0..2].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[2..6].copy_from_slice(&(1u32 | 1 << 31).to_le_bytes());
        b[6] = 0xA3;
        b[21] = 0xF0;
        let mut out = [0f32; QK];
        dequantize_block(QFormat::Q5_0, &b, &mut out);
        assert_eq!((out[0], out[16], out[31], out[1]), (1.5, -3.0, 7.5, -8.0));
        let q8 = as_q8_0_exactly(QFormat::Q5_0, &b).unwrap();
        assert_eq!(
            [q8[2], q8[2 + 16], q8[2 + 31], q8[3]],
            [3, -6i8 as u8, 15, -16i8 as u8]
        );
    }

    #[test]
    fn q4_k_block_dequantizes_as_ggml() {
        // Scales and mins of all 8 sub-blocks, using every 6-bit range.
        let sc = [1u8, 2, 63, 4, 33, 17, 48, 63];
        let m = [0u8, 5, 6, 63, 40, 1, 62, 31];
        let packed = k4_pack_scale_min(&sc, &m);
        for j in 0..8 {
            assert_eq!(k4_scale_min(j, &packed), (sc[j], m[j]), "sub-block {j}");
        }
        // llama.cpp's packing by hand for sub-block 4: scale low 4 bits in
        // q[8] low nibble, its top 2 bits in q[0] bits 6-7; min in q[8] high nibble
        // and q[4] bits 6-7.
        assert_eq!(packed[8], (33 & 0xF) | ((40 & 0xF) << 4));
        assert_eq!((packed[0] >> 6, packed[4] >> 6), (33 >> 4, 40 >> 4));
        let mut b = [0u8; 144];
        b[0..2].copy_from_slice(&f16::from_f32(0.25).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(0.5).to_le_bytes());
        b[4..16].copy_from_slice(&packed);
        b[16] = 0x7C; // sub-block 0 weight 0 = 0xC, sub-block 1 weight 0 = 0x7
        b[16 + 32 + 5] = 0x2F; // sub-block 2 weight 5 = 0xF, sub-block 3 weight 5 = 0x2
        let mut out = [0f32; QK_K];
        dequantize_block(QFormat::Q4K, &b, &mut out);
        let w = |j: usize, q: f32| 0.25 * sc[j] as f32 * q - 0.5 * m[j] as f32;
        assert_eq!(out[0], w(0, 12.0));
        assert_eq!(out[32], w(1, 7.0));
        assert_eq!(out[64 + 5], w(2, 15.0));
        assert_eq!(out[96 + 5], w(3, 2.0));
        assert_eq!(out[255], w(7, 0.0));
    }

    #[test]
    fn q5_k_block_dequantizes_as_ggml() {
        let sc = [3u8, 63, 1, 20, 45, 7, 63, 30];
        let m = [9u8, 0, 63, 2, 17, 50, 1, 33];
        let mut b = [0u8; 176];
        b[0..2].copy_from_slice(&f16::from_f32(0.125).to_le_bytes());
        b[2..4].copy_from_slice(&f16::from_f32(0.75).to_le_bytes());
        b[4..16].copy_from_slice(&k4_pack_scale_min(&sc, &m));
        let (qh, qs) = (16, 48);
        // Sub-blocks 0 and 1, weight 0: nibbles 0xC and 0x7 of qs[0]; qh[0] bit 0
        // set (0xC + 16 = 28), bit 1 clear (7).
        b[qs] = 0x7C;
        b[qh] = 0b0000_0001;
        // Sub-blocks 4 and 5, weight 9: qs[64 + 9] = 0x3F; qh[9] bits 4 and 5 set
        // (15 + 16 = 31, 3 + 16 = 19).
        b[qs + 64 + 9] = 0x3F;
        b[qh + 9] = 0b0011_0000;
        // Sub-block 7, weight 31: high nibble of qs[96 + 31] 0 with qh[31] bit 7
        // (16); sub-block 6 there: low nibble 5 with bit 6 clear.
        b[qs + 96 + 31] = 0x05;
        b[qh + 31] = 0b1000_0000;
        let mut out = [0f32; QK_K];
        dequantize_block(QFormat::Q5K, &b, &mut out);
        let w = |j: usize, q: f32| 0.125 * sc[j] as f32 * q - 0.75 * m[j] as f32;
        assert_eq!((out[0], out[32]), (w(0, 28.0), w(1, 7.0)));
        assert_eq!((out[128 + 9], out[160 + 9]), (w(4, 31.0), w(5, 19.0)));
        assert_eq!((out[224 + 31], out[192 + 31]), (w(7, 16.0), w(6, 5.0)));
        assert_eq!(out[1], w(0, 0.0));
        assert_eq!(out[32 + 9], w(1, 0.0), "qh[9] bit 1 is clear");
        // A record holds exactly the block: repacked and unpacked, the same bytes.
        let tiles = repack(QFormat::Q5K, &b, 1, QK_K);
        let mut back = [0u8; 176];
        unpack_block(QFormat::Q5K, &tiles, 1, 0, 0, &mut back);
        assert_eq!(back, b);
    }

    #[test]
    fn q6_k_block_dequantizes_as_ggml() {
        let mut b = [0u8; 210];
        for (k, s) in b[192..208].iter_mut().enumerate() {
            *s = (k as i32 * 17 - 128) as i8 as u8;
        }
        b[208..210].copy_from_slice(&f16::from_f32(0.125).to_le_bytes());
        // Weight 0: ql[0] low nibble 5, qh[0] bits 0-1 = 2 -> q = 37.
        // Weight 64: ql[0] high nibble 0xE, qh[0] bits 4-5 = 3 -> q = 62.
        // Weight 32 + 17: ql[32 + 17] low nibble 1, qh[17] bits 2-3 = 1 -> q = 17.
        // Weight 128 + 96 + 3: ql[64 + 32 + 3] high nibble 9, qh[32 + 3] bits 6-7 = 0.
        b[0] = 0xE5;
        b[128] = 2 | (3 << 4);
        b[32 + 17] = 0x01;
        b[128 + 17] = 1 << 2;
        b[64 + 32 + 3] = 0x90;
        let mut out = [0f32; QK_K];
        dequantize_block(QFormat::Q6K, &b, &mut out);
        let w = |k: usize, q: i32| 0.125 * b[192 + k / 16] as i8 as f32 * (q - 32) as f32;
        assert_eq!(out[0], w(0, 37));
        assert_eq!(out[64], w(64, 62));
        assert_eq!(out[49], w(49, 17));
        assert_eq!(out[227], w(227, 9));
        assert_eq!(out[1], w(1, 0));
        // Decoding the 6-bit values and encoding them back gives the same bytes.
        let q = q6k_values(&b[0..128], &b[128..192]);
        let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
        q6k_encode(&q, &mut ql, &mut qh);
        assert_eq!((&ql[..], &qh[..]), (&b[0..128], &b[128..192]));
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
