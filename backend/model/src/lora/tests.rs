//! Tests of the format checks, the header walk and the pairs' product.

use super::check::*;
use super::weights::*;
use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use std::io::Cursor;

/// A base of two blocks: attn_q 8 -> 8, ffn_down 16 -> 8.
fn base() -> LoraBase {
    LoraBase {
        architecture: "llama".into(),
        matrices: [
            ("blk.0.attn_q.weight".to_string(), [8, 8]),
            ("blk.1.ffn_down.weight".to_string(), [16, 8]),
        ]
        .into_iter()
        .collect(),
    }
}

/// A GGUF file with `meta` and f32 tensors of the given GGUF shapes `[ne0, ne1]`.
fn file(meta: &[(&str, Value)], tensors: &[(&str, [usize; 2])]) -> Vec<u8> {
    let qt: Vec<(String, QTensor)> = tensors
        .iter()
        .map(|(n, [ne0, ne1])| {
            let t = Tensor::zeros((*ne1, *ne0), candle_core::DType::F32, &Device::Cpu).unwrap();
            (
                n.to_string(),
                QTensor::quantize(&t, GgmlDType::F32).unwrap(),
            )
        })
        .collect();
    let meta: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let tensors: Vec<(&str, &QTensor)> = qt.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut out = Cursor::new(Vec::new());
    gguf_file::write(&mut out, &meta, &tensors).unwrap();
    out.into_inner()
}

fn lora_meta(arch: &str) -> Vec<(&'static str, Value)> {
    vec![
        ("general.type", Value::String("adapter".into())),
        ("adapter.type", Value::String("lora".into())),
        ("general.architecture", Value::String(arch.into())),
        ("adapter.lora.alpha", Value::F32(16.0)),
    ]
}

fn check(bytes: &[u8]) -> Result<LoraSummary, LoraError> {
    validate(bytes, &base(), "@cf/test", MAX_RANK)
}

#[test]
fn a_well_formed_adapter_is_summarised() {
    let f = file(
        &lora_meta("llama"),
        &[
            ("blk.0.attn_q.weight.lora_a", [8, 4]),
            ("blk.0.attn_q.weight.lora_b", [4, 8]),
            ("blk.1.ffn_down.weight.lora_a", [16, 2]),
            ("blk.1.ffn_down.weight.lora_b", [2, 8]),
        ],
    );
    let s = check(&f).unwrap();
    assert_eq!(s.rank, 4);
    assert_eq!(s.alpha, 16.0);
    assert_eq!(s.targets, ["blk.0.attn_q.weight", "blk.1.ffn_down.weight"]);
    assert_eq!(s.weight_bytes, 4 * (32 + 32 + 32 + 16));
}

#[test]
fn each_mismatch_is_refused_by_name() {
    let pair = |a: [usize; 2], b: [usize; 2]| {
        vec![
            ("blk.0.attn_q.weight.lora_a", a),
            ("blk.0.attn_q.weight.lora_b", b),
        ]
    };
    let ok = pair([8, 4], [4, 8]);
    let err = |meta: &[(&str, Value)], t: &[(&str, [usize; 2])]| check(&file(meta, t)).unwrap_err();

    assert!(
        matches!(err(&lora_meta("qwen2"), &ok), LoraError::Architecture { adapter, .. } if adapter == "qwen2")
    );
    let mut model = lora_meta("llama");
    model[0].1 = Value::String("model".into());
    assert!(matches!(err(&model, &ok), LoraError::NotAnAdapter(t) if t.contains("model")));
    let mut cvec = lora_meta("llama");
    cvec[1].1 = Value::String("control_vector".into());
    assert!(matches!(err(&cvec, &ok), LoraError::NotLora(_)));
    let mut alpha = lora_meta("llama");
    alpha[3].1 = Value::F32(f32::NAN);
    assert!(matches!(err(&alpha, &ok), LoraError::Alpha(_)));

    let m = lora_meta("llama");
    assert!(matches!(
        err(&m, &pair([6, 4], [4, 8])),
        LoraError::Shape {
            got: [6, 4],
            expected: [8, 4],
            ..
        }
    ));
    assert!(matches!(
        err(&m, &pair([8, 4], [4, 9])),
        LoraError::Shape { .. }
    ));
    // A stored untransposed: [rank, in] instead of [in, rank].
    assert!(matches!(
        err(&m, &pair([4, 8], [4, 8])),
        LoraError::Untransposed { got: [4, 8], .. }
    ));
    assert!(matches!(
        err(&m, &pair([8, 4], [8, 8])),
        LoraError::RankMismatch { a: 4, b: 8, .. }
    ));
    assert!(matches!(
        err(&m, &pair([8, 65], [65, 8])),
        LoraError::Rank { rank: 65, .. }
    ));
    assert!(matches!(
        err(&m, &[("blk.0.attn_q.weight.lora_a", [8, 4])]),
        LoraError::MissingHalf {
            missing: "lora_b",
            ..
        }
    ));
    assert!(matches!(
        err(&m, &[("token_embd.weight.lora_a", [8, 4]), ("token_embd.weight.lora_b", [4, 8])]),
        LoraError::NotAdaptable { target, .. } if target == "token_embd.weight"
    ));
    assert!(matches!(
        err(&m, &[("blk.0.attn_norm.weight", [8, 1])]),
        LoraError::UnexpectedTensor(_)
    ));
    assert!(matches!(err(&m, &[]), LoraError::Empty));
}

#[test]
fn truncated_and_garbage_files_are_unreadable_not_panics() {
    let f = file(
        &lora_meta("llama"),
        &[
            ("blk.0.attn_q.weight.lora_a", [8, 4]),
            ("blk.0.attn_q.weight.lora_b", [4, 8]),
        ],
    );
    assert!(matches!(
        check(&f[..f.len() - 8]),
        Err(LoraError::Truncated(_))
    ));
    for n in [0, 3, 10, 40, 100] {
        assert!(check(&f[..n.min(f.len())]).is_err());
    }
    assert!(matches!(
        check(b"not a gguf file at all"),
        Err(LoraError::Unreadable(_))
    ));
    // general.alignment = 0 makes the header reader divide by zero.
    let mut meta = lora_meta("llama");
    meta.push(("general.alignment", Value::U32(0)));
    let f = file(&meta, &[("blk.0.attn_q.weight.lora_a", [8, 4])]);
    assert!(matches!(check(&f), Err(LoraError::Unreadable(_))));
}

/// `apply_row` is `y += scale * B (A x)` (checked in f64 over the f16 values held).
#[test]
fn a_pair_adds_its_scaled_low_rank_product() {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
    let (rank, inputs, outputs) = (5, 37, 23);
    let mut draw = |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
    let (a, b) = (draw(rank * inputs), draw(outputs * rank));
    let p = LoraPair::new(rank, inputs, outputs, &a, &b, 0.75);
    // Rows applied together equal each row applied alone, bit for bit.
    let xs = draw(7 * inputs);
    let mut together = draw(7 * outputs);
    let mut alone = together.clone();
    p.apply_rows(&[0, 2, 3, 4, 5, 6], &xs, &mut together, outputs, 0);
    for i in [0, 2, 3, 4, 5, 6] {
        let y = &mut alone[i * outputs..(i + 1) * outputs];
        p.apply_row(&xs[i * inputs..(i + 1) * inputs], y);
    }
    assert_eq!(together, alone);
    let x = draw(inputs);
    let y0 = draw(outputs);
    let mut y = y0.clone();
    p.apply_row(&x, &mut y);
    for o in 0..outputs {
        let mut u = 0f64;
        for r in 0..rank {
            let t: f64 = (0..inputs)
                .map(|j| f64::from(p.factors.a_at(r, j)) * f64::from(x[j]))
                .sum();
            u += f64::from(p.factors.b_at(o, r)) * t;
        }
        let want = f64::from(y0[o]) + 0.75 * u;
        assert!(
            (f64::from(y[o]) - want).abs() < 1e-4,
            "{o}: {} vs {want}",
            y[o]
        );
    }
}

/// A llama adapter file of one pair on blk.0.attn_q.
fn pair_file(a: &QTensor, b: &QTensor) -> Vec<u8> {
    let meta = lora_meta("llama");
    let meta: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let tensors = [
        ("blk.0.attn_q.weight.lora_a", a),
        ("blk.0.attn_q.weight.lora_b", b),
    ];
    let mut out = Cursor::new(Vec::new());
    gguf_file::write(&mut out, &meta, &tensors).unwrap();
    out.into_inner()
}

/// Crafted files from an attack review: a metadata array that the reader would
/// blow up 32-fold in memory, non-finite and huge values, Q8_0 rows that are
/// not whole blocks, an absurd alpha; every refusal one line (no backtrace).
#[test]
fn crafted_adapters_are_refused_before_they_cost_memory_or_run() {
    let pair = [
        ("blk.0.attn_q.weight.lora_a", [8, 4]),
        ("blk.0.attn_q.weight.lora_b", [4, 8]),
    ];
    let mut junk = lora_meta("llama");
    junk.push(("general.junk", Value::Array(vec![Value::U8(1); 100_000])));
    let e = check(&file(&junk, &pair)).unwrap_err();
    assert!(
        matches!(&e, LoraError::Unreadable(m) if m.contains("100000 elements")),
        "{e}"
    );
    let mut alpha = lora_meta("llama");
    alpha[3].1 = Value::F32(3e38);
    assert!(matches!(
        check(&file(&alpha, &pair)),
        Err(LoraError::Alpha(_))
    ));
    for garbage in [&b"GGUF\x09\0\0\0"[..], b"GGUF", b"\0\0\0\0\0\0\0\0"] {
        let e = check(garbage).unwrap_err().to_string();
        assert!(!e.contains('\n'), "{e}");
    }

    // Values: written as F32 tensors holding NaN, then 1e30.
    let m = LoraBase {
        architecture: "llama".into(),
        matrices: [("blk.0.attn_q.weight".to_string(), [8, 8])]
            .into_iter()
            .collect(),
    };
    for bad in [f32::NAN, 1e30] {
        let t = |rows, cols, v: f32| {
            let d = vec![v; rows * cols];
            let t = Tensor::from_vec(d, (rows, cols), &Device::Cpu).unwrap();
            QTensor::quantize(&t, GgmlDType::F32).unwrap()
        };
        let bytes = pair_file(&t(4, 8, bad), &t(8, 4, 0.1));
        assert!(
            validate(&bytes, &m, "m", MAX_RANK).is_ok(),
            "the header is fine"
        );
        assert!(matches!(
            LoraWeights::load(&bytes, &m, "m", 1),
            Err(LoraError::Values(_))
        ));
    }

    // Q8_0 rows of 8 values: not whole 32-value blocks.
    let q8 = LoraBase {
        architecture: "llama".into(),
        matrices: [("blk.0.attn_q.weight".to_string(), [64, 64])]
            .into_iter()
            .collect(),
    };
    let a = QTensor::quantize(
        &Tensor::zeros((8, 64), candle_core::DType::F32, &Device::Cpu).unwrap(),
        GgmlDType::Q8_0,
    )
    .unwrap();
    // B's rows are rank (8) long; build its bytes as if it were Q8_0.
    let b = QTensor::quantize(
        &Tensor::zeros((8, 64), candle_core::DType::F32, &Device::Cpu).unwrap(),
        GgmlDType::Q8_0,
    )
    .unwrap();
    let mut bytes = pair_file(&a, &b);
    // Rewrite lora_b's dims from [64, 8] (ne) to [8, 64]: rank 8, out 64.
    let name = b"blk.0.attn_q.weight.lora_b";
    let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
    let dims = at + 4;
    bytes[dims..dims + 8].copy_from_slice(&8u64.to_le_bytes());
    bytes[dims + 8..dims + 16].copy_from_slice(&64u64.to_le_bytes());
    let e = validate(&bytes, &q8, "m", MAX_RANK).unwrap_err();
    assert!(
        matches!(&e, LoraError::TensorType { dtype, .. } if dtype.contains("whole blocks")),
        "{e}"
    );
}

#[test]
fn only_block_projections_are_adaptable() {
    assert!(adaptable("blk.12.attn_v.weight"));
    assert!(adaptable("blk.0.ffn_gate.weight"));
    assert!(!adaptable("blk..attn_v.weight"));
    assert!(!adaptable("blk.x.attn_v.weight"));
    assert!(!adaptable("blk.0.attn_norm.weight"));
    assert!(!adaptable("output.weight"));
    assert!(!adaptable("token_embd.weight"));
}
