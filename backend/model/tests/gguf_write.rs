//! Writing GGUF files: requantized copies of the default model and random-weight
//! llama models load, have the shape and formats asked for, and answer.

use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::GgmlDType;
use std::path::Path;
use tessera_model::gguf_write::{requantize, write_random_llama, RandomLlama, VARIANTS};
use tessera_model::testing::{chat_prompt, greedy_with_logits, load, model_path};
use tessera_model::LoadedModel;

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(std::path::PathBuf);

impl TempDir {
    fn new() -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "tessera-gguf-write-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn matrix_types(path: &Path) -> Vec<(String, GgmlDType)> {
    let mut f = std::fs::File::open(path).unwrap();
    let c = Content::read(&mut f).unwrap();
    let mut v: Vec<_> = c
        .tensor_infos
        .iter()
        .filter(|(_, t)| t.shape.dims().len() == 2)
        .map(|(n, t)| (n.clone(), t.ggml_dtype))
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum();
    let n = |v: &[f32]| v.iter().map(|x| (*x as f64).powi(2)).sum::<f64>().sqrt();
    dot / (n(a) * n(b))
}

#[test]
fn requantized_variants_are_deterministic_and_answer() {
    let dir = TempDir::new();
    let base = load();
    let prompt = chat_prompt(&base, "What is the capital of France?");
    let (_, want_logits) = greedy_with_logits(&base, &prompt, 1);
    for v in VARIANTS {
        let dst = dir.path().join(v.file);
        let w = requantize(&model_path(), &dst, v.format).unwrap();
        assert_eq!(w.path, dst);
        assert_eq!(w.sha256, v.sha256, "{}: the recorded sha256", v.name);
        let want = match v.name {
            "q8_0" => GgmlDType::Q8_0,
            _ => GgmlDType::Q4_0,
        };
        let types = matrix_types(&dst);
        assert!(!types.is_empty());
        for (name, t) in &types {
            assert_eq!(*t, want, "{}: {name}", v.name);
        }
        // Deterministic: a second run writes the same bytes.
        let again = requantize(&model_path(), &dir.path().join("again.gguf"), v.format).unwrap();
        assert_eq!(again.sha256, w.sha256);
        let m = LoadedModel::load(&dst).unwrap();
        assert_eq!(m.config(), base.config(), "same hyperparameters");
        // Catalog metadata: the same weights, in the new format.
        assert_eq!(m.info.parameters, base.info.parameters);
        assert_eq!(m.info.quantization, format!("{want:?}"));
        assert!(m.info.chat_template && m.info.context == 8192);
        assert_ne!(
            m.transformer.fingerprint(),
            base.transformer.fingerprint(),
            "another file of the same shape has another fingerprint"
        );
        // The same model, slightly rounded: the first step's logits point the same
        // way as the source's (a wrong block layout would give noise, cosine ~0).
        let (_, got) = greedy_with_logits(&m, &prompt, 1);
        let cos = cosine(&got[0], &want_logits[0]);
        match v.name {
            "q8_0" => assert!(cos > 0.99, "{}: cosine {cos}", v.name),
            // 4 bits without an offset lose more of a Q4_1 source; it still answers.
            _ => {
                let (out, _) = greedy_with_logits(&m, &prompt, 8);
                let text = m.tokenizer.decode(&out, true);
                assert!(text.contains("Paris"), "{}: {text:?}", v.name);
            }
        }
    }
}

#[test]
fn a_random_llama_has_the_shape_asked_for() {
    let dir = TempDir::new();
    let dst = dir.path().join("random.gguf");
    let shape = RandomLlama::SMALL;
    let w = write_random_llama(&model_path(), &dst, &shape).unwrap();
    let m = LoadedModel::load(&dst).unwrap();
    let c = m.config();
    assert_eq!(
        (c.vocab, c.layers, c.hidden, c.heads, c.kv_heads, c.ffn, c.context),
        (2048, 4, 128, 2, 1, 384, 4096)
    );
    let base = load();
    assert_ne!(m.transformer.fingerprint(), base.transformer.fingerprint());
    // 2048 x 128 embeddings, 4 blocks of (2 x 128 x 128 + 2 x 64 x 128 + 3 x 384 x
    // 128 + 2 x 128), the output norm.
    assert_eq!(m.info.parameters, 1_049_728);
    assert_eq!(
        (
            m.info.quantization.as_str(),
            m.info.chat_template,
            m.info.context
        ),
        ("Q8_0", true, 4096)
    );
    assert_eq!(base.info.quantization, "Q4_1");
    assert!(
        base.info.parameters > 130_000_000,
        "{}",
        base.info.parameters
    );
    // Same tokenizer rules on a smaller vocabulary: every id fits, the chat
    // template's special tokens survive.
    let prompt = chat_prompt(&m, "What is the capital of France?");
    assert!(prompt.iter().all(|&t| (t as usize) < 2048), "{prompt:?}");
    assert!(prompt.contains(&1) && prompt.contains(&2), "{prompt:?}");
    let (a, _) = greedy_with_logits(&m, &prompt, 6);
    let (b, _) = greedy_with_logits(&m, &prompt, 6);
    assert_eq!(a, b);
    // The same seed writes the same file; another seed another one.
    let again = write_random_llama(&model_path(), &dir.path().join("again.gguf"), &shape).unwrap();
    assert_eq!(again.sha256, w.sha256);
    let other = RandomLlama { seed: 19, ..shape };
    let o = write_random_llama(&model_path(), &dir.path().join("other.gguf"), &other).unwrap();
    assert_ne!(o.sha256, w.sha256);
    // Shapes the kernels cannot run are refused, naming the numbers.
    let bad = RandomLlama {
        hidden: 100,
        ..shape
    };
    let e = write_random_llama(&model_path(), &dir.path().join("bad.gguf"), &bad).unwrap_err();
    assert!(e.to_string().contains("100"), "{e}");
}

/// Our block quantizers write the bytes GGML's reference quantizers write (candle's
/// ports of `quantize_row_q8_0_ref` / `quantize_row_q4_0_ref`), on real weights.
#[test]
fn block_quantizers_match_ggml() {
    use candle_core::quantized::QTensor;
    use candle_core::{Device, Tensor};
    use tessera_kernels::quant::{quantize_blocks, QFormat};
    let mut f = std::fs::File::open(model_path()).unwrap();
    let c = Content::read(&mut f).unwrap();
    let t = c
        .tensor(&mut f, "blk.0.ffn_down.weight", &Device::Cpu)
        .unwrap();
    let x: Vec<f32> = t
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let x = &x[..64 * 1536];
    for (format, dtype) in [
        (QFormat::Q8_0, GgmlDType::Q8_0),
        (QFormat::Q4_0, GgmlDType::Q4_0),
    ] {
        let dense = Tensor::from_slice(x, (64, 1536), &Device::Cpu).unwrap();
        let theirs = QTensor::quantize(&dense, dtype).unwrap();
        assert_eq!(
            quantize_blocks(format, x),
            theirs.data().unwrap().as_ref(),
            "{format:?}"
        );
    }
}
