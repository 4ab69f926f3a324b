//! The GGML block formats read as candle's dequantizers read them
//! (`candle_core::quantized`, an independent implementation of llama.cpp's
//! `dequantize_row_*`), and a matrix built from them multiplies as those weights do.

use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType};
use candle_core::Device;
use half::f16;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tessera_kernels::quant::{dequantize_block, QFormat};
use tessera_kernels::{Activations, QMatrix};

const FORMATS: [(QFormat, GgmlDType); 7] = [
    (QFormat::Q4_0, GgmlDType::Q4_0),
    (QFormat::Q4_1, GgmlDType::Q4_1),
    (QFormat::Q8_0, GgmlDType::Q8_0),
    (QFormat::Q5_0, GgmlDType::Q5_0),
    (QFormat::Q4K, GgmlDType::Q4K),
    (QFormat::Q5K, GgmlDType::Q5K),
    (QFormat::Q6K, GgmlDType::Q6K),
];

/// `rows x cols` random GGUF bytes of `format`: every bit random except the `f16`
/// scales, which are random values of a sane range.
fn random_matrix(rng: &mut ChaCha8Rng, format: QFormat, rows: usize, cols: usize) -> Vec<u8> {
    let (bb, blocks) = (format.block_bytes(), rows * cols / format.block_values());
    let mut out: Vec<u8> = (0..blocks * bb).map(|_| rng.random()).collect();
    // Byte offsets of the f16 fields of a block.
    let halves: &[usize] = match format {
        QFormat::Q4_1 | QFormat::Q4K | QFormat::Q5K => &[0, 2],
        QFormat::Q6K => &[208],
        _ => &[0],
    };
    for blk in out.chunks_exact_mut(bb) {
        for &at in halves {
            let v = f16::from_f32(rng.random_range(-0.01..0.01));
            blk[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
        if format == QFormat::Q8_0 {
            // GGML's quantizer never writes -128.
            for q in &mut blk[2..] {
                *q = (*q as i8).max(-127) as u8;
            }
        }
    }
    out
}

#[test]
fn every_format_dequantizes_as_candle_does() {
    let mut rng = ChaCha8Rng::seed_from_u64(21);
    for (format, dtype) in FORMATS {
        let (rows, cols) = (5, 512);
        let bytes = random_matrix(&mut rng, format, rows, cols);
        let candle: Vec<f32> = qtensor_from_ggml(dtype, &bytes, vec![rows, cols], &Device::Cpu)
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut ours = vec![0f32; rows * cols];
        let (bb, bv) = (format.block_bytes(), format.block_values());
        for (b, o) in bytes.chunks_exact(bb).zip(ours.chunks_exact_mut(bv)) {
            dequantize_block(format, b, o);
        }
        assert_eq!(ours, candle, "{format:?}");
        // The repacked matrix gives the same weights back.
        let m = QMatrix::from_gguf_bytes(format, &bytes, rows, cols).unwrap();
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            m.dequantize_row(r, &mut row);
            assert_eq!(row, candle[r * cols..(r + 1) * cols], "{format:?} row {r}");
        }
    }
}

#[test]
fn every_format_multiplies_as_its_candle_weights_in_f64() {
    let mut rng = ChaCha8Rng::seed_from_u64(22);
    for (format, dtype) in FORMATS {
        let (rows, cols, n) = (33, 768, 4);
        let bytes = random_matrix(&mut rng, format, rows, cols);
        let w: Vec<f32> = qtensor_from_ggml(dtype, &bytes, vec![rows, cols], &Device::Cpu)
            .unwrap()
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let m = QMatrix::from_gguf_bytes(format, &bytes, rows, cols).unwrap();
        let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut out = vec![0f32; n * rows];
        m.matmul(&Activations::new(&x, n, cols), &mut out);
        for i in 0..n {
            for j in 0..rows {
                let (wr, xr) = (&w[j * cols..(j + 1) * cols], &x[i * cols..(i + 1) * cols]);
                let exact: f64 = wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mag: f64 = wr
                    .iter()
                    .zip(xr)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                let got = out[i * rows + j] as f64;
                // 8-bit activations: the error is a small fraction of the magnitude.
                assert!(
                    (got - exact).abs() <= 0.01 * mag,
                    "{format:?} [{i}, {j}]: {got} vs {exact} (magnitude {mag})"
                );
            }
        }
    }
}

/// One `block_q5_K` (176 bytes) decoded as `dequantize_row_q5_K` walks it, written
/// out here independently of the crate: 64 weights at a time, two sub-blocks whose
/// 6-bit scale and min are unpacked as `get_scale_min_k4` does, the low then the
/// high nibbles of 32 bytes of `qs`, and bit 4 from `qh[l]` under two masks that
/// move up two bits per 64 weights.
fn q5_k_reference(b: &[u8]) -> Vec<f32> {
    let half = |at: usize| f16::from_le_bytes([b[at], b[at + 1]]).to_f32();
    let (d, min) = (half(0), half(2));
    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
    let scale_min = |j: usize| {
        if j < 4 {
            (scales[j] & 63, scales[j + 4] & 63)
        } else {
            (
                (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4),
                (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4),
            )
        }
    };
    let mut y = Vec::with_capacity(256);
    let (mut u1, mut u2) = (1u8, 2u8);
    for (i, ql) in qs.chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min(2 * i);
        let (sc2, m2) = scale_min(2 * i + 1);
        let (d1, m1) = (d * sc1 as f32, min * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, min * m2 as f32);
        let high = |l: usize, u: u8| if qh[l] & u != 0 { 16 } else { 0 };
        for (l, &q) in ql.iter().enumerate() {
            y.push(d1 * ((q & 0xF) + high(l, u1)) as f32 - m1);
        }
        for (l, &q) in ql.iter().enumerate() {
            y.push(d2 * ((q >> 4) + high(l, u2)) as f32 - m2);
        }
        u1 <<= 2;
        u2 <<= 2;
    }
    y
}

#[test]
fn q5_k_dequantizes_and_multiplies_as_a_direct_reading_of_block_q5_k() {
    let mut rng = ChaCha8Rng::seed_from_u64(24);
    let (rows, cols, n) = (37, 1024, 3);
    let bytes = random_matrix(&mut rng, QFormat::Q5K, rows, cols);
    let want: Vec<f32> = bytes.chunks_exact(176).flat_map(q5_k_reference).collect();
    let mut ours = vec![0f32; rows * cols];
    for (b, o) in bytes.chunks_exact(176).zip(ours.chunks_exact_mut(256)) {
        dequantize_block(QFormat::Q5K, b, o);
    }
    assert_eq!(ours, want, "dequantize_block");
    let m = QMatrix::from_gguf_bytes(QFormat::Q5K, &bytes, rows, cols).unwrap();
    let mut row = vec![0f32; cols];
    for r in 0..rows {
        m.dequantize_row(r, &mut row);
        assert_eq!(row, want[r * cols..(r + 1) * cols], "repacked row {r}");
    }
    let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0..1.0)).collect();
    let mut out = vec![0f32; n * rows];
    m.matmul(&Activations::new(&x, n, cols), &mut out);
    for i in 0..n {
        for j in 0..rows {
            let (wr, xr) = (
                &want[j * cols..(j + 1) * cols],
                &x[i * cols..(i + 1) * cols],
            );
            let exact: f64 = wr.iter().zip(xr).map(|(a, b)| *a as f64 * *b as f64).sum();
            let mag: f64 = wr
                .iter()
                .zip(xr)
                .map(|(a, b)| (*a as f64 * *b as f64).abs())
                .sum();
            let got = out[i * rows + j] as f64;
            assert!(
                (got - exact).abs() <= 0.01 * mag,
                "[{i}, {j}]: {got} vs {exact} (magnitude {mag})"
            );
        }
    }
}

/// Every matrix of a native format in the model files (where present) reads back
/// as candle dequantizes it, and its first rows multiply as those weights do.
#[test]
fn model_file_matrices_match_candle() {
    use candle_core::quantized::gguf_file::Content;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models");
    for file in [
        "gemma-3-270m-q4_k_m.gguf",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    ] {
        let Ok(mut f) = std::fs::File::open(dir.join(file)) else {
            eprintln!("{file} absent: skipped");
            continue;
        };
        let content = Content::read(&mut f).unwrap();
        let mut names: Vec<_> = content.tensor_infos.keys().cloned().collect();
        names.sort();
        for name in names {
            let t = content.tensor(&mut f, &name, &Device::Cpu).unwrap();
            let Some(&(format, _)) = FORMATS.iter().find(|(_, d)| *d == t.dtype()) else {
                continue;
            };
            let dims = t.shape().dims().to_vec();
            if dims.len() != 2 {
                continue;
            }
            let (rows, cols) = (dims[0], dims[1]);
            let m = QMatrix::from_gguf_bytes(format, &t.data().unwrap(), rows, cols).unwrap();
            let want: Vec<f32> = t
                .dequantize(&Device::Cpu)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            let mut row = vec![0f32; cols];
            let check_rows: Vec<usize> = (0..rows).step_by((rows / 64).max(1)).collect();
            for &r in &check_rows {
                m.dequantize_row(r, &mut row);
                assert_eq!(row, want[r * cols..(r + 1) * cols], "{file} {name} row {r}");
            }
            let mut rng = ChaCha8Rng::seed_from_u64(23);
            let x: Vec<f32> = (0..cols).map(|_| rng.random_range(-1.0..1.0)).collect();
            let mut out = vec![0f32; rows];
            m.matmul(&Activations::new(&x, 1, cols), &mut out);
            for &r in &check_rows {
                let wr = &want[r * cols..(r + 1) * cols];
                let exact: f64 = wr.iter().zip(&x).map(|(a, b)| *a as f64 * *b as f64).sum();
                let mag: f64 = wr
                    .iter()
                    .zip(&x)
                    .map(|(a, b)| (*a as f64 * *b as f64).abs())
                    .sum();
                assert!(
                    (out[r] as f64 - exact).abs() <= 0.01 * mag + 1e-6,
                    "{file} {name} [{r}]: {} vs {exact} (magnitude {mag})",
                    out[r]
                );
            }
            eprintln!("{file} {name} {format:?} {rows}x{cols}: ok");
        }
    }
}
