//! Batch-invariant matrix multiplication `Y = X W^T` with quantized weights.
//!
//! `W` is `[rows = out_features, cols = in_features]`, stored row-major in GGML
//! blocks along `cols`. `X` is `[n, cols]` of `f32`, quantized once per call site
//! into [`Activations`] and shared by every weight that reads the same input
//! (e.g. Q, K and V). Work is split across threads by output feature, never along
//! the reduction, so each `Y[i, j]` is computed by the same instructions in the
//! same order whatever `n` is and whoever else is in the batch.

use crate::dot::{dot_f32, panel, Tiles};
use crate::quant::{
    as_q8_0_exactly, dequantize_block, quantize_block_q8_0, quantize_row_q8_split, repack,
    unpack_block, ActRow, ActRowMut, QFormat, QK, TILE,
};

/// Errors building a weight matrix.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum MatrixError {
    /// The byte length does not match `rows * cols` in the given format.
    #[error(
        "weight data has {got} bytes, expected {expected} for a {rows}x{cols} {format} matrix"
    )]
    Size {
        /// Bytes given.
        got: usize,
        /// Bytes expected.
        expected: usize,
        /// Output features.
        rows: usize,
        /// Input features.
        cols: usize,
        /// Format name.
        format: &'static str,
    },
    /// Quantized formats need `cols` to be a multiple of the block size.
    #[error("{cols} input features is not a multiple of the block size {block}")]
    Cols {
        /// Input features.
        cols: usize,
        /// Values per block of the format (32, or 256 for K formats).
        block: usize,
    },
}

/// Weight storage formats with a native kernel.
#[derive(Debug)]
pub enum Weights {
    /// A GGML block format, repacked at load into tiles of 16 interleaved rows
    /// ([`crate::quant::repack`]; the GGUF file's bytes per weight, `Q4_K` and
    /// `Q5_K` 4.625 and 5.625 bits instead of 4.5 and 5.5).
    Quant {
        /// Block format.
        format: QFormat,
        /// `ceil(rows / 16) * cols / format.block_values()` records, tile-major.
        tiles: Vec<u8>,
    },
    /// Plain `f32` (unquantized GGUF types, dequantized at load).
    F32(Vec<f32>),
}

/// A weight matrix `[rows, cols]` (out features x in features).
#[derive(Debug)]
pub struct QMatrix {
    rows: usize,
    cols: usize,
    weights: Weights,
}

/// A batch of input rows `[n, cols]`, kept both as `f32` and quantized to 8 bits.
#[derive(Debug, Default)]
pub struct Activations {
    n: usize,
    cols: usize,
    f32: Vec<f32>,
    qs: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
    sum: Vec<i32>,
    sum16: Vec<i32>,
}

impl Activations {
    /// Quantizes `x` (`[n, cols]`, row-major). `cols` must be a multiple of 32.
    pub fn new(x: &[f32], n: usize, cols: usize) -> Self {
        let mut a = Self::default();
        a.set(x, n, cols);
        a
    }

    /// Re-fills this buffer from `x` (`[n, cols]`), reusing its allocation.
    pub fn set(&mut self, x: &[f32], n: usize, cols: usize) {
        assert_eq!(x.len(), n * cols, "activation shape");
        assert_eq!(cols % QK, 0, "cols must be a multiple of {QK}");
        self.n = n;
        self.cols = cols;
        let bpr = cols / QK;
        // The buffers only grow (rows are read by their own ranges): one forward
        // pass alternates widths (hidden, attention, FFN), and shrinking then
        // growing zero-filled the difference on every call. The f32 copy (read
        // by f32 weights only) is filled row by row in the parallel loop below,
        // while each row is in cache for its quantization.
        fn grow<T: Copy>(v: &mut Vec<T>, len: usize, zero: T) {
            if v.len() < len {
                v.resize(len, zero);
            }
        }
        grow(&mut self.f32, n * cols, 0.0);
        grow(&mut self.qs, n * cols, 0);
        grow(&mut self.d, n * bpr, 0.0);
        grow(&mut self.s, n * bpr, 0.0);
        grow(&mut self.sum, n * bpr, 0);
        grow(&mut self.sum16, n * bpr * 2, 0);
        // Rows are independent: split them over the pool when there are many.
        let pool = crate::pool::global();
        let per = n.div_ceil(pool.threads()).max(16);
        let (f, qs, d, s, sum, sum16) = (
            SyncPtr(self.f32.as_mut_ptr()),
            SyncPtr(self.qs.as_mut_ptr()),
            SyncPtr(self.d.as_mut_ptr()),
            SyncPtr(self.s.as_mut_ptr()),
            SyncPtr(self.sum.as_mut_ptr()),
            SyncPtr(self.sum16.as_mut_ptr()),
        );
        let rows = |c: usize| {
            for r in c * per..((c + 1) * per).min(n) {
                // SAFETY: row r's ranges lie inside the buffers sized above, and no
                // other task touches row r.
                let out = unsafe {
                    ActRowMut {
                        qs: std::slice::from_raw_parts_mut(qs.at(r * cols), cols),
                        d: std::slice::from_raw_parts_mut(d.at(r * bpr), bpr),
                        s: std::slice::from_raw_parts_mut(s.at(r * bpr), bpr),
                        sum: std::slice::from_raw_parts_mut(sum.at(r * bpr), bpr),
                        sum16: std::slice::from_raw_parts_mut(sum16.at(2 * r * bpr), 2 * bpr),
                    }
                };
                let xr = &x[r * cols..(r + 1) * cols];
                // SAFETY: as above, row r of the f32 copy.
                unsafe { std::slice::from_raw_parts_mut(f.at(r * cols), cols) }.copy_from_slice(xr);
                quantize_row_q8_split(xr, out);
            }
        };
        let chunks = n.div_ceil(per);
        if chunks > 1 {
            pool.parallel_for(chunks, rows);
        } else {
            rows(0);
        }
    }

    /// Number of rows.
    pub fn n(&self) -> usize {
        self.n
    }

    fn q8_row(&self, r: usize) -> ActRow<'_> {
        let bpr = self.cols / QK;
        ActRow {
            qs: &self.qs[r * self.cols..(r + 1) * self.cols],
            d: &self.d[r * bpr..(r + 1) * bpr],
            s: &self.s[r * bpr..(r + 1) * bpr],
            sum: &self.sum[r * bpr..(r + 1) * bpr],
            sum16: &self.sum16[2 * r * bpr..2 * (r + 1) * bpr],
        }
    }

    fn f32_row(&self, r: usize) -> &[f32] {
        &self.f32[r * self.cols..(r + 1) * self.cols]
    }
}

/// Raw pointer into a buffer shared by pool tasks that write disjoint parts.
#[derive(Clone, Copy)]
struct SyncPtr<T>(*mut T);
// SAFETY: tasks write disjoint ranges of a buffer that outlives the region.
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    /// Pointer to element `idx` (a method, so closures capture the whole wrapper).
    fn at(self, idx: usize) -> *mut T {
        // SAFETY: callers pass in-bounds indices.
        unsafe { self.0.add(idx) }
    }
}

impl QMatrix {
    /// Builds a matrix from the GGUF bytes of a tensor in `format` (row-major,
    /// `rows * cols / format.block_values()` blocks), repacking it into tiles.
    pub fn from_gguf_bytes(
        format: QFormat,
        bytes: &[u8],
        rows: usize,
        cols: usize,
    ) -> Result<Self, MatrixError> {
        let block = format.block_values();
        if !cols.is_multiple_of(block) {
            return Err(MatrixError::Cols { cols, block });
        }
        let expected = rows * cols / block * format.block_bytes();
        if bytes.len() != expected {
            return Err(MatrixError::Size {
                got: bytes.len(),
                expected,
                rows,
                cols,
                format: format.name(),
            });
        }
        Ok(Self {
            rows,
            cols,
            weights: Weights::Quant {
                format,
                tiles: repack(format, bytes, rows, cols),
            },
        })
    }

    /// Builds a matrix from GGUF bytes of a `Q4_0` tensor.
    pub fn from_q4_0_bytes(bytes: &[u8], rows: usize, cols: usize) -> Result<Self, MatrixError> {
        Self::from_gguf_bytes(QFormat::Q4_0, bytes, rows, cols)
    }

    /// Builds a matrix from GGUF bytes of a `Q4_1` tensor.
    pub fn from_q4_1_bytes(bytes: &[u8], rows: usize, cols: usize) -> Result<Self, MatrixError> {
        Self::from_gguf_bytes(QFormat::Q4_1, bytes, rows, cols)
    }

    /// Builds a matrix from GGUF bytes of a `Q8_0` tensor.
    pub fn from_q8_0_bytes(bytes: &[u8], rows: usize, cols: usize) -> Result<Self, MatrixError> {
        Self::from_gguf_bytes(QFormat::Q8_0, bytes, rows, cols)
    }

    /// Builds a matrix from `f32` values (`[rows, cols]`, row-major).
    pub fn from_f32(data: Vec<f32>, rows: usize, cols: usize) -> Result<Self, MatrixError> {
        Self::check_f32(&data, rows, cols)?;
        Ok(Self {
            rows,
            cols,
            weights: Weights::F32(data),
        })
    }

    /// Quantizes `f32` values (`[rows, cols]`, row-major) to `Q8_0` as GGML does:
    /// for weights of a lossy GGUF type without a kernel here (`Q5_1`, `Q2_K`,
    /// `Q3_K`, ...), so they run on the 8-bit kernels instead of `f32` loops.
    pub fn requantize_q8_0(data: &[f32], rows: usize, cols: usize) -> Result<Self, MatrixError> {
        Self::check_f32(data, rows, cols)?;
        let bb = QFormat::Q8_0.block_bytes();
        let mut bytes = vec![0u8; rows * cols / QK * bb];
        for (x, out) in data.chunks_exact(QK).zip(bytes.chunks_exact_mut(bb)) {
            quantize_block_q8_0(x, out);
        }
        Self::from_gguf_bytes(QFormat::Q8_0, &bytes, rows, cols)
    }

    fn check_f32(data: &[f32], rows: usize, cols: usize) -> Result<(), MatrixError> {
        if data.len() != rows * cols {
            return Err(MatrixError::Size {
                got: data.len() * 4,
                expected: rows * cols * 4,
                rows,
                cols,
                format: "F32",
            });
        }
        if !cols.is_multiple_of(QK) {
            return Err(MatrixError::Cols { cols, block: QK });
        }
        Ok(())
    }

    /// The GGUF bytes of the whole matrix, row-major (quantized formats only).
    fn gguf_bytes(&self, format: QFormat, tiles: &[u8]) -> Vec<u8> {
        let (bpr, bb) = (self.cols / format.block_values(), format.block_bytes());
        let mut out = vec![0u8; self.rows * bpr * bb];
        for (i, blk) in out.chunks_exact_mut(bb).enumerate() {
            unpack_block(format, tiles, bpr, i / bpr, i % bpr, blk);
        }
        out
    }

    /// Stacks matrices with equal `cols` along the output dimension (e.g. Q, K and
    /// V into one QKV matrix, so one pass reads one input once). Parts of one
    /// format keep it (exactly); parts of `Q4_0`, `Q5_0` and `Q8_0` together become
    /// `Q8_0` exactly (their quants fit an `i8` under the same `d`); other mixes of
    /// quantized formats are requantized to `Q8_0`; any `f32` part makes the
    /// result `f32`.
    pub fn concat_rows(parts: Vec<QMatrix>) -> Result<Self, MatrixError> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if let Some(p) = parts.iter().find(|p| p.cols != cols) {
            return Err(MatrixError::Cols {
                cols: p.cols,
                block: QK,
            });
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let formats: Vec<Option<QFormat>> = parts
            .iter()
            .map(|p| match &p.weights {
                Weights::Quant { format, .. } => Some(*format),
                Weights::F32(_) => None,
            })
            .collect();
        let dense = |parts: &[QMatrix]| {
            let mut v = vec![0f32; rows * cols];
            for (r, out) in parts
                .iter()
                .flat_map(|p| (0..p.rows).map(move |r| (p, r)))
                .zip(v.chunks_exact_mut(cols))
            {
                r.0.dequantize_row(r.1, out);
            }
            v
        };
        match formats[..] {
            [Some(f), ..] if formats.iter().all(|g| *g == Some(f)) => {
                let mut bytes = Vec::new();
                for p in &parts {
                    if let Weights::Quant { tiles, .. } = &p.weights {
                        bytes.extend(p.gguf_bytes(f, tiles));
                    }
                }
                Self::from_gguf_bytes(f, &bytes, rows, cols)
            }
            _ if formats
                .iter()
                .all(|g| matches!(g, Some(QFormat::Q4_0 | QFormat::Q5_0 | QFormat::Q8_0))) =>
            {
                let mut bytes = Vec::new();
                for p in &parts {
                    if let Weights::Quant { format, tiles } = &p.weights {
                        for b in p
                            .gguf_bytes(*format, tiles)
                            .chunks_exact(format.block_bytes())
                        {
                            bytes.extend(as_q8_0_exactly(*format, b).expect("Q4_0, Q5_0, Q8_0"));
                        }
                    }
                }
                Self::from_gguf_bytes(QFormat::Q8_0, &bytes, rows, cols)
            }
            _ if formats.iter().all(|g| g.is_some()) => {
                Self::requantize_q8_0(&dense(&parts), rows, cols)
            }
            _ => Self::from_f32(dense(&parts), rows, cols),
        }
    }

    /// Output features.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Input features.
    pub fn cols(&self) -> usize {
        self.cols
    }

    /// The storage format.
    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// Bytes of weight data read per full pass: the repacked records' bytes of
    /// the `rows` rows (not counting the zero rows padding the last tile).
    pub fn weight_bytes(&self) -> usize {
        match &self.weights {
            Weights::Quant { format, .. } => {
                self.rows * self.cols / format.block_values() * format.row_record_bytes()
            }
            Weights::F32(_) => self.rows * self.cols * 4,
        }
    }

    /// Dequantizes weight row `r` (length `cols`) into `out`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        match &self.weights {
            Weights::Quant { format, tiles } => {
                let (bv, bpr) = (format.block_values(), self.cols / format.block_values());
                let mut blk = [0u8; 256];
                let blk = &mut blk[..format.block_bytes()];
                for (b, o) in out.chunks_exact_mut(bv).enumerate().take(bpr) {
                    unpack_block(*format, tiles, bpr, r, b, blk);
                    dequantize_block(*format, blk, o);
                }
            }
            Weights::F32(v) => out.copy_from_slice(&v[r * self.cols..(r + 1) * self.cols]),
        }
    }

    /// `out[i, j] = sum_k x[i, k] * W[j, k]` for all `n` rows of `x`; `out` is `[n, rows]`.
    pub fn matmul(&self, x: &Activations, out: &mut [f32]) {
        assert_eq!(x.cols, self.cols, "input features");
        assert_eq!(out.len(), x.n * self.rows, "output shape");
        let rows = self.rows;
        let pool = crate::pool::global();
        // Work units of whole tiles (16 rows), a few per thread.
        let tiles = rows.div_ceil(TILE);
        let chunk = (tiles / (pool.threads() * 8)).clamp(1, 16);
        let ptr = SyncPtr(out.as_mut_ptr());
        pool.parallel_for(tiles.div_ceil(chunk), |c| {
            let (t0, t1) = (c * chunk, ((c + 1) * chunk).min(tiles));
            let (mut i, group) = (0, group());
            while i < x.n {
                let take = (x.n - i).min(group);
                self.panel(t0..t1, x, i, take, |r, j0, v| {
                    let at = ptr.at((i + r) * rows + j0);
                    // A whole tile as one fixed-size copy (a slice copy of a
                    // run-time length was a `memcpy` call per tile and row).
                    if let Ok(full) = <&[f32; TILE]>::try_from(v) {
                        // SAFETY: row i + r, columns j0..j0 + TILE are in bounds and
                        // owned by this chunk (its tiles).
                        unsafe { at.cast::<[f32; TILE]>().write_unaligned(*full) };
                        return;
                    }
                    // SAFETY: as above, for the last tile's v.len() columns.
                    let o = unsafe { std::slice::from_raw_parts_mut(at, v.len()) };
                    o.copy_from_slice(v);
                });
                i += take;
            }
        });
    }

    /// Dots weight tiles `ts` with activation rows `i..i+take` (`take <= 16`),
    /// calling `out(r, j0, values)` with the outputs of rows `j0..j0 + values.len()`
    /// (within `0..rows`) for activation row `i + r`.
    #[inline]
    fn panel(
        &self,
        ts: std::ops::Range<usize>,
        x: &Activations,
        i: usize,
        take: usize,
        mut out: impl FnMut(usize, usize, &[f32]),
    ) {
        let rows = self.rows;
        let bpr = self.cols / QK;
        match &self.weights {
            Weights::Quant { format, tiles } => {
                let w = Tiles {
                    format: *format,
                    data: tiles,
                    bpr,
                };
                macro_rules! group {
                    ($($n:literal)+) => {
                        match take {
                            $($n => {
                                let xs: [ActRow; $n] = std::array::from_fn(|k| x.q8_row(i + k));
                                panel::<$n>(w, ts, xs, |t, v| {
                                    let j0 = t * TILE;
                                    let n = (rows - j0).min(TILE);
                                    for (r, vr) in v.iter().enumerate() {
                                        out(r, j0, &vr[..n]);
                                    }
                                });
                            })+
                            _ => unreachable!("group size {take}"),
                        }
                    };
                }
                group!(1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16)
            }
            Weights::F32(v) => {
                for j in ts.start * TILE..(ts.end * TILE).min(rows) {
                    let w = &v[j * self.cols..(j + 1) * self.cols];
                    for r in 0..take {
                        out(r, j, &dot_f32::<1>(w, [x.f32_row(i + r)]));
                    }
                }
            }
        }
    }
}

/// Activation rows multiplied per weight-row load: 16 where AVX-512 has the 32
/// registers for their accumulators beside a block's 8 weight registers (Gemma
/// 3's output matrix at 16 rows took 21-22 ms in two passes of 8, 15 ms in one of
/// 16: `examples/matmul_speed`), 8 on AVX2's 16 registers and the portable path.
/// Each row's result does not depend on it (module docs).
fn group() -> usize {
    if crate::dot::isa() == crate::dot::Isa::Avx512Vnni {
        16
    } else {
        8
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dot::tests::random_blocks;
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

    /// Random GGUF bytes of a `rows x cols` matrix in `format` (sane scales).
    fn gguf(rng: &mut ChaCha8Rng, format: QFormat, rows: usize, cols: usize) -> Vec<u8> {
        random_blocks(rng, format, rows * cols / format.block_values())
    }

    fn matrix(rng: &mut ChaCha8Rng, format: QFormat, rows: usize, cols: usize) -> QMatrix {
        QMatrix::from_gguf_bytes(format, &gguf(rng, format, rows, cols), rows, cols).unwrap()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn matmul_rows_match_solo_rows_bitwise_for_any_batch() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        for format in FORMATS {
            let (rows, cols) = (40, 512);
            let w = matrix(&mut rng, format, rows, cols);
            let x: Vec<f32> = (0..11 * cols)
                .map(|_| rng.random_range(-2.0..2.0))
                .collect();
            let mut batched = vec![0f32; 11 * rows];
            w.matmul(&Activations::new(&x, 11, cols), &mut batched);
            for i in 0..11 {
                let mut solo = vec![0f32; rows];
                w.matmul(
                    &Activations::new(&x[i * cols..(i + 1) * cols], 1, cols),
                    &mut solo,
                );
                let got = bits(&batched[i * rows..(i + 1) * rows]);
                assert_eq!(got, bits(&solo), "{format:?} row {i}");
            }
        }
    }

    /// 35 rows: two whole groups of 16 on AVX-512 (four of 8 elsewhere) and a
    /// remainder, each row equal to its solo run.
    #[test]
    fn matmul_rows_match_solo_rows_bitwise_across_groups() {
        let mut rng = ChaCha8Rng::seed_from_u64(13);
        let (n, rows, cols) = (35, 24, 256);
        for format in FORMATS {
            let w = matrix(&mut rng, format, rows, cols);
            let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let all = run(&w, &x, n);
            for i in 0..n {
                let solo = run(&w, &x[i * cols..(i + 1) * cols], 1);
                assert_eq!(
                    bits(&all[i * rows..(i + 1) * rows]),
                    bits(&solo),
                    "{format:?} row {i}"
                );
            }
        }
    }

    #[test]
    fn matmul_matches_dequantized_f64_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        for format in FORMATS {
            let (rows, cols) = (17, 512);
            let bytes = gguf(&mut rng, format, rows, cols);
            let w = QMatrix::from_gguf_bytes(format, &bytes, rows, cols).unwrap();
            let x: Vec<f32> = (0..3 * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
            let mut out = vec![0f32; 3 * rows];
            w.matmul(&Activations::new(&x, 3, cols), &mut out);
            let (bb, bv) = (format.block_bytes(), format.block_values());
            let (mut wrow, mut wrow2) = (vec![0f32; cols], vec![0f32; cols]);
            for j in 0..rows {
                // The reference weights: the GGUF blocks dequantized directly.
                for (b, o) in wrow.chunks_exact_mut(bv).enumerate() {
                    let at = (j * cols / bv + b) * bb;
                    dequantize_block(format, &bytes[at..at + bb], o);
                }
                w.dequantize_row(j, &mut wrow2);
                assert_eq!(bits(&wrow), bits(&wrow2), "{format:?} dequantize_row {j}");
                for i in 0..3 {
                    let xr = &x[i * cols..(i + 1) * cols];
                    let want: f64 = wrow
                        .iter()
                        .zip(xr)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum();
                    let mag: f64 = wrow
                        .iter()
                        .zip(xr)
                        .map(|(a, b)| (*a as f64 * *b as f64).abs())
                        .sum();
                    let got = out[i * rows + j] as f64;
                    assert!(
                        (got - want).abs() < 0.01 * mag + 1e-4,
                        "{format:?} {got} vs {want}"
                    );
                }
            }
        }
    }

    fn run(w: &QMatrix, x: &[f32], n: usize) -> Vec<f32> {
        let mut out = vec![0f32; n * w.rows()];
        w.matmul(&Activations::new(x, n, w.cols()), &mut out);
        out
    }

    #[test]
    fn stacked_matrices_equal_their_parts_bitwise() {
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let cols = 256;
        let x: Vec<f32> = (0..5 * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
        for format in FORMATS {
            // 20 and 7 rows: the parts' tiles do not line up with the stack's.
            let parts: Vec<Vec<u8>> = [20, 7]
                .iter()
                .map(|&r| gguf(&mut rng, format, r, cols))
                .collect();
            let mk = |b: &[u8], r| QMatrix::from_gguf_bytes(format, b, r, cols).unwrap();
            let stacked = QMatrix::concat_rows(vec![mk(&parts[0], 20), mk(&parts[1], 7)]).unwrap();
            assert!(matches!(stacked.weights(), Weights::Quant { format: f, .. } if *f == format));
            let (a, b, both) = (
                run(&mk(&parts[0], 20), &x, 5),
                run(&mk(&parts[1], 7), &x, 5),
                run(&stacked, &x, 5),
            );
            for i in 0..5 {
                let want: Vec<f32> = a[i * 20..(i + 1) * 20]
                    .iter()
                    .chain(&b[i * 7..(i + 1) * 7])
                    .copied()
                    .collect();
                let got = bits(&both[i * 27..(i + 1) * 27]);
                assert_eq!(got, bits(&want), "{format:?} row {i}");
            }
            let (mut r1, mut r2) = (vec![0f32; cols], vec![0f32; cols]);
            stacked.dequantize_row(22, &mut r1);
            mk(&parts[1], 7).dequantize_row(2, &mut r2);
            assert_eq!(r1, r2);
        }
    }

    #[test]
    fn q4_0_q5_0_and_q8_0_parts_stack_as_q8_0_exactly() {
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let cols = 96;
        let formats = [QFormat::Q5_0, QFormat::Q5_0, QFormat::Q8_0, QFormat::Q4_0];
        let parts: Vec<QMatrix> = formats
            .iter()
            .map(|&f| matrix(&mut rng, f, 9, cols))
            .collect();
        let mut want = vec![0f32; 36 * cols];
        for (p, w) in parts.iter().zip(want.chunks_exact_mut(9 * cols)) {
            for (r, o) in w.chunks_exact_mut(cols).enumerate() {
                p.dequantize_row(r, o);
            }
        }
        let s = QMatrix::concat_rows(parts).unwrap();
        assert!(matches!(
            s.weights(),
            Weights::Quant {
                format: QFormat::Q8_0,
                ..
            }
        ));
        let mut got = vec![0f32; 36 * cols];
        for (r, o) in got.chunks_exact_mut(cols).enumerate() {
            s.dequantize_row(r, o);
        }
        assert_eq!(bits(&got), bits(&want));
    }

    #[test]
    fn mixed_formats_stack_as_q8_0_close_to_the_parts() {
        let mut rng = ChaCha8Rng::seed_from_u64(10);
        let cols = 256;
        for (fa, fb) in [
            (QFormat::Q4_1, QFormat::Q8_0),
            (QFormat::Q4K, QFormat::Q6K),
            (QFormat::Q5_0, QFormat::Q4K),
            (QFormat::Q5K, QFormat::Q4K),
        ] {
            let (a, b) = (
                matrix(&mut rng, fa, 16, cols),
                matrix(&mut rng, fb, 5, cols),
            );
            let (mut wa, mut wb) = (vec![0f32; cols], vec![0f32; cols]);
            a.dequantize_row(3, &mut wa);
            b.dequantize_row(4, &mut wb);
            let s = QMatrix::concat_rows(vec![a, b]).unwrap();
            assert!(matches!(
                s.weights(),
                Weights::Quant {
                    format: QFormat::Q8_0,
                    ..
                }
            ));
            let mut w = vec![0f32; cols];
            for (row, want) in [(3, &wa), (20, &wb)] {
                s.dequantize_row(row, &mut w);
                for (blk, (g, e)) in w.chunks(QK).zip(want.chunks(QK)).enumerate() {
                    let amax = e.iter().fold(0f32, |m, v| m.max(v.abs()));
                    for (g, e) in g.iter().zip(e) {
                        // Half a Q8_0 step of the block's range, plus 127 times the
                        // f16 rounding of d (GGML rounds with the unrounded d).
                        assert!(
                            (g - e).abs() <= amax / 127.0 * 0.6 + 1e-6,
                            "{fa:?}+{fb:?} block {blk}: {g} vs {e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn weight_bytes_are_the_repacked_bytes_per_row() {
        let mut rng = ChaCha8Rng::seed_from_u64(12);
        for (format, bytes_per_256) in [
            (QFormat::Q4_0, 144),
            (QFormat::Q4_1, 160),
            (QFormat::Q8_0, 272),
            (QFormat::Q5_0, 176),
            (QFormat::Q4K, 148),
            (QFormat::Q5K, 180),
            (QFormat::Q6K, 210),
        ] {
            let w = matrix(&mut rng, format, 32, 512);
            assert_eq!(w.weight_bytes(), 32 * 2 * bytes_per_256, "{format:?}");
            if let Weights::Quant { tiles, .. } = w.weights() {
                assert_eq!(tiles.len(), w.weight_bytes(), "{format:?}: whole tiles");
            }
        }
    }

    #[test]
    fn wrong_sizes_are_rejected() {
        assert!(matches!(
            QMatrix::from_q4_1_bytes(&[0u8; 19], 1, 32),
            Err(MatrixError::Size {
                got: 19,
                expected: 20,
                ..
            })
        ));
        assert_eq!(
            QMatrix::from_f32(vec![0.0; 30], 1, 30).unwrap_err(),
            MatrixError::Cols {
                cols: 30,
                block: 32
            }
        );
        assert_eq!(
            QMatrix::from_gguf_bytes(QFormat::Q4K, &[0u8; 144], 8, 32).unwrap_err(),
            MatrixError::Cols {
                cols: 32,
                block: 256
            }
        );
    }
}
