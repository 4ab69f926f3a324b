//! Batch-invariant matrix multiplication `Y = X W^T` with quantized weights.
//!
//! `W` is `[rows = out_features, cols = in_features]`, stored row-major in GGML
//! blocks along `cols`. `X` is `[n, cols]` of `f32`, quantized once per call site
//! into [`Activations`] and shared by every weight that reads the same input
//! (e.g. Q, K and V). Work is split across threads by output feature, never along
//! the reduction, so each `Y[i, j]` is computed by the same instructions in the
//! same order whatever `n` is and whoever else is in the batch.

use crate::dot::{dot_f32, panel_q4_1, panel_q8_0, Q4_1Matrix, Q8_0Matrix};
use crate::quant::{quantize_row_q8_split, ActRow, BlockQ4_1, BlockQ8_0, QK};
use half::f16;

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
    #[error("{cols} input features is not a multiple of the block size {QK}")]
    Cols {
        /// Input features.
        cols: usize,
    },
}

/// Weight storage formats with a native kernel. Quantized formats are kept as
/// structure-of-arrays (the GGUF bytes regrouped, not re-quantized), row-major.
#[derive(Debug)]
pub enum Weights {
    /// GGML `Q4_1`: 16 nibble bytes, one `d` and one `m` per 32 weights.
    Q4_1 {
        /// Packed nibbles, `rows * cols / 2` bytes.
        qs: Vec<u8>,
        /// Scales, `rows * cols / 32`.
        d: Vec<f16>,
        /// Offsets, `rows * cols / 32`.
        m: Vec<f16>,
    },
    /// GGML `Q8_0`: 32 `i8` and one `d` per 32 weights.
    Q8_0 {
        /// Values, `rows * cols`.
        qs: Vec<i8>,
        /// Scales, `rows * cols / 32`.
        d: Vec<f16>,
    },
    /// Plain `f32` (any other GGUF type, dequantized at load).
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
        self.f32.clear();
        self.f32.extend_from_slice(x);
        let bpr = cols / QK;
        self.qs.resize(n * cols, 0);
        self.d.resize(n * bpr, 0.0);
        self.s.resize(n * bpr, 0.0);
        self.qs
            .chunks_mut(cols)
            .zip(self.d.chunks_mut(bpr))
            .zip(self.s.chunks_mut(bpr))
            .zip(x.chunks(cols))
            .for_each(|(((q, d), s), row)| quantize_row_q8_split(row, q, d, s));
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
        }
    }

    fn f32_row(&self, r: usize) -> &[f32] {
        &self.f32[r * self.cols..(r + 1) * self.cols]
    }
}

/// Raw output pointer shared by the workers; each writes disjoint columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: workers write disjoint (row, column) cells of a buffer that outlives them.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Pointer to element `idx` (a method, so closures capture the whole wrapper).
    fn at(self, idx: usize) -> *mut f32 {
        // SAFETY: callers pass in-bounds indices.
        unsafe { self.0.add(idx) }
    }
}

impl QMatrix {
    /// Builds a matrix from GGUF bytes of a `Q4_1` tensor.
    pub fn from_q4_1_bytes(bytes: &[u8], rows: usize, cols: usize) -> Result<Self, MatrixError> {
        let blocks = Self::check(bytes.len(), rows, cols, BlockQ4_1::BYTES, "Q4_1")?;
        let (mut qs, mut d, mut m) = (
            Vec::with_capacity(blocks * 16),
            Vec::with_capacity(blocks),
            Vec::with_capacity(blocks),
        );
        for b in bytes
            .chunks_exact(BlockQ4_1::BYTES)
            .take(blocks)
            .map(BlockQ4_1::from_bytes)
        {
            qs.extend_from_slice(&b.qs);
            d.push(b.d);
            m.push(b.m);
        }
        Ok(Self {
            rows,
            cols,
            weights: Weights::Q4_1 { qs, d, m },
        })
    }

    /// Builds a matrix from GGUF bytes of a `Q8_0` tensor.
    pub fn from_q8_0_bytes(bytes: &[u8], rows: usize, cols: usize) -> Result<Self, MatrixError> {
        let blocks = Self::check(bytes.len(), rows, cols, BlockQ8_0::BYTES, "Q8_0")?;
        let (mut qs, mut d) = (Vec::with_capacity(blocks * QK), Vec::with_capacity(blocks));
        for b in bytes
            .chunks_exact(BlockQ8_0::BYTES)
            .take(blocks)
            .map(BlockQ8_0::from_bytes)
        {
            qs.extend_from_slice(&b.qs);
            d.push(b.d);
        }
        Ok(Self {
            rows,
            cols,
            weights: Weights::Q8_0 { qs, d },
        })
    }

    /// Builds a matrix from `f32` values (`[rows, cols]`, row-major).
    pub fn from_f32(data: Vec<f32>, rows: usize, cols: usize) -> Result<Self, MatrixError> {
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
            return Err(MatrixError::Cols { cols });
        }
        Ok(Self {
            rows,
            cols,
            weights: Weights::F32(data),
        })
    }

    fn check(
        got: usize,
        rows: usize,
        cols: usize,
        block_bytes: usize,
        format: &'static str,
    ) -> Result<usize, MatrixError> {
        if !cols.is_multiple_of(QK) {
            return Err(MatrixError::Cols { cols });
        }
        let blocks = rows * cols / QK;
        let expected = blocks * block_bytes;
        if got != expected {
            return Err(MatrixError::Size {
                got,
                expected,
                rows,
                cols,
                format,
            });
        }
        Ok(blocks)
    }

    /// Stacks matrices with equal `cols` and format along the output dimension
    /// (e.g. Q, K and V into one QKV matrix, so one pass reads one input once).
    /// Falls back to `f32` when formats differ.
    pub fn concat_rows(parts: Vec<QMatrix>) -> Result<Self, MatrixError> {
        let cols = parts.first().map_or(0, |p| p.cols);
        if let Some(p) = parts.iter().find(|p| p.cols != cols) {
            return Err(MatrixError::Cols { cols: p.cols });
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let same = |f: fn(&Weights) -> bool| parts.iter().all(|p| f(&p.weights));
        let weights = if same(|w| matches!(w, Weights::Q4_1 { .. })) {
            let (mut qs, mut d, mut m) = (Vec::new(), Vec::new(), Vec::new());
            for p in parts {
                if let Weights::Q4_1 { qs: a, d: b, m: c } = p.weights {
                    qs.extend(a);
                    d.extend(b);
                    m.extend(c);
                }
            }
            Weights::Q4_1 { qs, d, m }
        } else if same(|w| matches!(w, Weights::Q8_0 { .. })) {
            let (mut qs, mut d) = (Vec::new(), Vec::new());
            for p in parts {
                if let Weights::Q8_0 { qs: a, d: b } = p.weights {
                    qs.extend(a);
                    d.extend(b);
                }
            }
            Weights::Q8_0 { qs, d }
        } else {
            let mut v = vec![0f32; rows * cols];
            let mut at = 0;
            for p in &parts {
                for r in 0..p.rows {
                    p.dequantize_row(r, &mut v[at * cols..(at + 1) * cols]);
                    at += 1;
                }
            }
            Weights::F32(v)
        };
        Ok(Self {
            rows,
            cols,
            weights,
        })
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

    /// Bytes of weight data read per full pass.
    pub fn weight_bytes(&self) -> usize {
        let blocks = self.rows * self.cols / QK;
        match &self.weights {
            Weights::Q4_1 { .. } => blocks * BlockQ4_1::BYTES,
            Weights::Q8_0 { .. } => blocks * BlockQ8_0::BYTES,
            Weights::F32(_) => self.rows * self.cols * 4,
        }
    }

    /// Dequantizes weight row `r` (length `cols`) into `out`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let bpr = self.cols / QK;
        match &self.weights {
            Weights::Q4_1 { qs, d, m } => {
                for (b, o) in (r * bpr..(r + 1) * bpr).zip(out.chunks_exact_mut(QK)) {
                    let (d, m) = (d[b].to_f32(), m[b].to_f32());
                    for j in 0..QK / 2 {
                        o[j] = (qs[b * 16 + j] & 0x0F) as f32 * d + m;
                        o[j + QK / 2] = (qs[b * 16 + j] >> 4) as f32 * d + m;
                    }
                }
            }
            Weights::Q8_0 { qs, d } => {
                for (b, o) in (r * bpr..(r + 1) * bpr).zip(out.chunks_exact_mut(QK)) {
                    let d = d[b].to_f32();
                    for (oj, &q) in o.iter_mut().zip(&qs[b * QK..(b + 1) * QK]) {
                        *oj = q as f32 * d;
                    }
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
        let chunk = (rows / (pool.threads() * 8)).clamp(4, 256);
        let ptr = OutPtr(out.as_mut_ptr());
        let n_chunks = rows.div_ceil(chunk);
        pool.parallel_for(n_chunks, |c| {
            let (j0, j1) = (c * chunk, ((c + 1) * chunk).min(rows));
            let mut i = 0;
            while i < x.n {
                let take = (x.n - i).min(GROUP);
                self.panel(j0..j1, x, i, take, |j, r, v| {
                    // SAFETY: (i + r, j) is in bounds and owned by this chunk.
                    unsafe { *ptr.at((i + r) * rows + j) = v };
                });
                i += take;
            }
        });
    }

    /// Dots weight rows `js` with activation rows `i..i+take` (`take <= GROUP`),
    /// calling `out(j, r, value)` for each.
    #[inline]
    fn panel(
        &self,
        js: std::ops::Range<usize>,
        x: &Activations,
        i: usize,
        take: usize,
        mut out: impl FnMut(usize, usize, f32),
    ) {
        let bpr = self.cols / QK;
        macro_rules! group {
            ($panel:ident, $w:expr, $($n:literal)+) => {
                match take {
                    $($n => {
                        let rows: [_; $n] = std::array::from_fn(|k| x.q8_row(i + k));
                        $panel::<$n>($w, js, rows, |j, v| v.iter().enumerate().for_each(|(r, &v)| out(j, r, v)));
                    })+
                    _ => unreachable!("group size {take}"),
                }
            };
        }
        match &self.weights {
            Weights::Q4_1 { qs, d, m } => {
                group!(panel_q4_1, Q4_1Matrix { qs, d, m, bpr }, 1 2 3 4 5 6 7 8)
            }
            Weights::Q8_0 { qs, d } => {
                group!(panel_q8_0, Q8_0Matrix { qs, d, bpr }, 1 2 3 4 5 6 7 8)
            }
            Weights::F32(v) => {
                for j in js {
                    let w = &v[j * self.cols..(j + 1) * self.cols];
                    for r in 0..take {
                        out(j, r, dot_f32::<1>(w, [x.f32_row(i + r)])[0]);
                    }
                }
            }
        }
    }
}

/// Activation rows multiplied per weight-row load.
const GROUP: usize = 8;

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn q4_1_matrix(rng: &mut ChaCha8Rng, rows: usize, cols: usize) -> QMatrix {
        let mut bytes = Vec::new();
        for _ in 0..rows * cols / QK {
            bytes.extend_from_slice(&f16::from_f32(rng.random_range(0.001..0.05)).to_le_bytes());
            bytes.extend_from_slice(&f16::from_f32(rng.random_range(-0.3..0.0)).to_le_bytes());
            for _ in 0..16 {
                bytes.push(rng.random());
            }
        }
        QMatrix::from_q4_1_bytes(&bytes, rows, cols).unwrap()
    }

    #[test]
    fn matmul_rows_match_solo_rows_bitwise_for_any_batch() {
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        let (rows, cols) = (40, 96);
        let w = q4_1_matrix(&mut rng, rows, cols);
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
            let got: Vec<u32> = batched[i * rows..(i + 1) * rows]
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let want: Vec<u32> = solo.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "row {i}");
        }
    }

    #[test]
    fn matmul_matches_dequantized_f32_reference() {
        let mut rng = ChaCha8Rng::seed_from_u64(8);
        let (rows, cols) = (17, 64);
        let w = q4_1_matrix(&mut rng, rows, cols);
        let x: Vec<f32> = (0..3 * cols).map(|_| rng.random_range(-2.0..2.0)).collect();
        let mut out = vec![0f32; 3 * rows];
        w.matmul(&Activations::new(&x, 3, cols), &mut out);
        let mut wrow = vec![0f32; cols];
        for j in 0..rows {
            w.dequantize_row(j, &mut wrow);
            for i in 0..3 {
                let xr = &x[i * cols..(i + 1) * cols];
                let want: f32 = wrow.iter().zip(xr).map(|(a, b)| a * b).sum();
                let mag: f32 = wrow.iter().zip(xr).map(|(a, b)| (a * b).abs()).sum();
                assert!((out[i * rows + j] - want).abs() < 0.01 * mag + 1e-4);
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
            MatrixError::Cols { cols: 30 }
        );
    }
}
