//! Batch-invariant matrix multiplication `Y = X W^T` with quantized weights.
//!
//! `W` is `[rows = out_features, cols = in_features]`, stored row-major in GGML
//! blocks along `cols`. `X` is `[n, cols]` of `f32`, quantized once per call site
//! into [`Activations`] and shared by every weight that reads the same input
//! (e.g. Q, K and V). Work is split across threads by output feature, never along
//! the reduction, so each `Y[i, j]` is computed by the same instructions in the
//! same order whatever `n` is and whoever else is in the batch.

use crate::dot::{dot_f32, dot_q4_1, dot_q8_0};
use crate::quant::{quantize_row_q8, BlockQ4_1, BlockQ8, BlockQ8_0, QK};
use rayon::prelude::*;

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

/// Weight storage formats with a native kernel.
#[derive(Debug)]
pub enum Weights {
    /// GGML `Q4_1` blocks, `rows * cols / 32` of them.
    Q4_1(Vec<BlockQ4_1>),
    /// GGML `Q8_0` blocks.
    Q8_0(Vec<BlockQ8_0>),
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
    q8: Vec<BlockQ8>,
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
        self.q8.resize(n * bpr, BlockQ8::default());
        self.q8
            .par_chunks_mut(bpr)
            .zip(x.par_chunks(cols))
            .for_each(|(q, row)| quantize_row_q8(row, q));
    }

    /// Number of rows.
    pub fn n(&self) -> usize {
        self.n
    }

    fn q8_row(&self, r: usize) -> &[BlockQ8] {
        let bpr = self.cols / QK;
        &self.q8[r * bpr..(r + 1) * bpr]
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

impl QMatrix {
    /// Builds a matrix from GGUF bytes of a `Q4_1` tensor.
    pub fn from_q4_1_bytes(bytes: &[u8], rows: usize, cols: usize) -> Result<Self, MatrixError> {
        let blocks = Self::check(bytes.len(), rows, cols, BlockQ4_1::BYTES, "Q4_1")?;
        let v = bytes
            .chunks_exact(BlockQ4_1::BYTES)
            .take(blocks)
            .map(BlockQ4_1::from_bytes)
            .collect();
        Ok(Self {
            rows,
            cols,
            weights: Weights::Q4_1(v),
        })
    }

    /// Builds a matrix from GGUF bytes of a `Q8_0` tensor.
    pub fn from_q8_0_bytes(bytes: &[u8], rows: usize, cols: usize) -> Result<Self, MatrixError> {
        let blocks = Self::check(bytes.len(), rows, cols, BlockQ8_0::BYTES, "Q8_0")?;
        let v = bytes
            .chunks_exact(BlockQ8_0::BYTES)
            .take(blocks)
            .map(BlockQ8_0::from_bytes)
            .collect();
        Ok(Self {
            rows,
            cols,
            weights: Weights::Q8_0(v),
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
        if cols % QK != 0 {
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
        if cols % QK != 0 {
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
        let weights = if same(|w| matches!(w, Weights::Q4_1(_))) {
            Weights::Q4_1(
                parts
                    .into_iter()
                    .flat_map(|p| match p.weights {
                        Weights::Q4_1(v) => v,
                        _ => unreachable!(),
                    })
                    .collect(),
            )
        } else if same(|w| matches!(w, Weights::Q8_0(_))) {
            Weights::Q8_0(
                parts
                    .into_iter()
                    .flat_map(|p| match p.weights {
                        Weights::Q8_0(v) => v,
                        _ => unreachable!(),
                    })
                    .collect(),
            )
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
            Weights::Q4_1(_) => blocks * BlockQ4_1::BYTES,
            Weights::Q8_0(_) => blocks * BlockQ8_0::BYTES,
            Weights::F32(_) => self.rows * self.cols * 4,
        }
    }

    /// Dequantizes weight row `r` (length `cols`) into `out`.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let bpr = self.cols / QK;
        match &self.weights {
            Weights::Q4_1(b) => {
                for (blk, o) in b[r * bpr..(r + 1) * bpr]
                    .iter()
                    .zip(out.chunks_exact_mut(QK))
                {
                    blk.dequantize(o)
                }
            }
            Weights::Q8_0(b) => {
                for (blk, o) in b[r * bpr..(r + 1) * bpr]
                    .iter()
                    .zip(out.chunks_exact_mut(QK))
                {
                    blk.dequantize(o)
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
        let threads = rayon::current_num_threads().max(1);
        let chunk = (rows / (threads * 8)).clamp(4, 256);
        let ptr = OutPtr(out.as_mut_ptr());
        let n_chunks = rows.div_ceil(chunk);
        (0..n_chunks).into_par_iter().for_each(|c| {
            let ptr = ptr;
            let (j0, j1) = (c * chunk, ((c + 1) * chunk).min(rows));
            let mut i = 0;
            while i < x.n {
                let take = (x.n - i).min(4);
                for j in j0..j1 {
                    let vals = self.dot_rows(j, x, i, take);
                    for (r, v) in vals.iter().take(take).enumerate() {
                        // SAFETY: (i + r, j) is in bounds and owned by this chunk.
                        unsafe { *ptr.0.add((i + r) * rows + j) = *v };
                    }
                }
                i += take;
            }
        });
    }

    /// Dots weight row `j` with activation rows `i..i+take` (`take <= 4`).
    #[inline]
    fn dot_rows(&self, j: usize, x: &Activations, i: usize, take: usize) -> [f32; 4] {
        let bpr = self.cols / QK;
        let mut out = [0f32; 4];
        macro_rules! go {
            ($f:ident, $w:expr, $row:ident) => {
                match take {
                    4 => {
                        out = $f::<4>($w, [x.$row(i), x.$row(i + 1), x.$row(i + 2), x.$row(i + 3)])
                    }
                    3 => {
                        let v = $f::<3>($w, [x.$row(i), x.$row(i + 1), x.$row(i + 2)]);
                        out[..3].copy_from_slice(&v);
                    }
                    2 => {
                        let v = $f::<2>($w, [x.$row(i), x.$row(i + 1)]);
                        out[..2].copy_from_slice(&v);
                    }
                    _ => out[0] = $f::<1>($w, [x.$row(i)])[0],
                }
            };
        }
        match &self.weights {
            Weights::Q4_1(b) => go!(dot_q4_1, &b[j * bpr..(j + 1) * bpr], q8_row),
            Weights::Q8_0(b) => go!(dot_q8_0, &b[j * bpr..(j + 1) * bpr], q8_row),
            Weights::F32(v) => go!(dot_f32, &v[j * self.cols..(j + 1) * self.cols], f32_row),
        }
        out
    }
}

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
