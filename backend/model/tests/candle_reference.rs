//! Our quantized matmul against candle-core's `QMatMul` (the reference CPU path)
//! on real tensors of the shipped GGUF, and against exact dequantized math. `Q4_0`
//! tensors are the shipped ones requantized by candle (GGML's reference
//! quantizer), so the test needs no second model file.

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{Device, Module, Tensor};
use tessera_kernels::{Activations, QMatrix};

/// Tensor `name` of the shipped GGUF, requantized to `to` when given.
fn tensor(name: &str, to: Option<GgmlDType>) -> QTensor {
    let path = tessera_model::testing::model_path();
    let mut f = std::fs::File::open(&path).unwrap();
    let content = Content::read(&mut f).unwrap();
    let qt = content.tensor(&mut f, name, &Device::Cpu).unwrap();
    match to {
        Some(dtype) => QTensor::quantize(&qt.dequantize(&Device::Cpu).unwrap(), dtype).unwrap(),
        None => qt,
    }
}

fn check(name: &str, n: usize) {
    check_tensor(name, tensor(name, None), n)
}

fn check_tensor(name: &str, qt: QTensor, n: usize) {
    let (rows, cols) = qt.shape().dims2().unwrap();
    let dtype = qt.dtype();
    let ours = match dtype {
        GgmlDType::Q4_0 => QMatrix::from_q4_0_bytes(&qt.data().unwrap(), rows, cols).unwrap(),
        GgmlDType::Q4_1 => QMatrix::from_q4_1_bytes(&qt.data().unwrap(), rows, cols).unwrap(),
        GgmlDType::Q8_0 => QMatrix::from_q8_0_bytes(&qt.data().unwrap(), rows, cols).unwrap(),
        other => panic!("{name}: unexpected {other:?}"),
    };
    let dense = qt
        .dequantize(&Device::Cpu)
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let x: Vec<f32> = (0..n * cols)
        .map(|i| ((i * 7919) % 201) as f32 / 100.0 - 1.0)
        .collect();

    let mut got = vec![0f32; n * rows];
    ours.matmul(&Activations::new(&x, n, cols), &mut got);
    let xt = Tensor::from_vec(x.clone(), (n, cols), &Device::Cpu).unwrap();
    let want = QMatMul::from_qtensor(qt)
        .unwrap()
        .forward(&xt)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();

    let mut worst = 0f32;
    for i in 0..n {
        for j in (0..rows).step_by(7) {
            let xr = &x[i * cols..(i + 1) * cols];
            let exact: f32 = dense[j].iter().zip(xr).map(|(a, b)| a * b).sum();
            let mag: f32 = dense[j].iter().zip(xr).map(|(a, b)| (a * b).abs()).sum();
            let (g, c) = (got[i * rows + j], want[i * rows + j]);
            // Both quantize activations to 8 bits the same way (measured: they agree
            // to ~5e-5 of the magnitude); each is within 1% of exact math.
            assert!(
                (g - exact).abs() <= 0.01 * mag,
                "{name}[{i},{j}] ours {g} exact {exact}"
            );
            assert!(
                (g - c).abs() <= 1e-3 * mag,
                "{name}[{i},{j}] ours {g} candle {c}"
            );
            worst = worst.max((g - c).abs() / mag.max(1e-6));
        }
    }
    eprintln!("{name} ({dtype:?}): worst |ours - candle| / magnitude = {worst:.5}");
}

#[test]
fn q4_1_ffn_gate_matches_candle_qmatmul() {
    check("blk.0.ffn_gate.weight", 3);
}

#[test]
fn q4_1_attn_output_matches_candle_qmatmul() {
    check("blk.7.attn_output.weight", 5);
}

#[test]
fn q8_0_embedding_as_lm_head_matches_candle_qmatmul() {
    check("token_embd.weight", 2);
}

#[test]
fn q4_0_ffn_down_matches_candle_qmatmul() {
    let name = "blk.3.ffn_down.weight";
    let qt = tensor(name, Some(GgmlDType::Q4_0));
    assert_eq!(qt.dtype(), GgmlDType::Q4_0);
    check_tensor(name, qt, 4);
}

#[test]
fn q4_0_attn_q_matches_candle_qmatmul_for_a_prefill_sized_batch() {
    // 19 rows: two full groups of 8 activation rows and a partial one.
    let name = "blk.11.attn_q.weight";
    check_tensor(name, tensor(name, Some(GgmlDType::Q4_0)), 19);
}
