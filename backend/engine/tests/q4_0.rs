//! A `Q4_0` GGUF loads and runs: the shipped model's `Q4_1` matrices requantized to
//! `Q4_0` by candle (GGML's reference quantizer, what `llama-quantize` does) and
//! written as a GGUF file, then loaded and run by the engine like any model.

use candle_core::quantized::gguf_file::{self, Content};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;
use tessera_engine::testing::*;
use tessera_model::testing::direct_kv;
use tessera_model::LoadedModel;

/// Writes the shipped model with every `Q4_1` tensor requantized to `Q4_0` (the
/// `Q8_0` embedding and `f32` norms as they are) into `dir`, returning its path.
fn q4_0_copy(dir: &std::path::Path) -> std::path::PathBuf {
    let mut f = std::fs::File::open(model_path()).unwrap();
    let content = Content::read(&mut f).unwrap();
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let tensors: Vec<(String, QTensor)> = names
        .iter()
        .map(|&name| {
            let t = content.tensor(&mut f, name, &Device::Cpu).unwrap();
            let t = if t.dtype() == GgmlDType::Q4_1 {
                QTensor::quantize(&t.dequantize(&Device::Cpu).unwrap(), GgmlDType::Q4_0).unwrap()
            } else {
                t
            };
            (name.clone(), t)
        })
        .collect();
    let meta: Vec<(&str, &gguf_file::Value)> = content
        .metadata
        .iter()
        .map(|(k, v)| (k.as_str(), v))
        .collect();
    let refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let path = dir.join("SmolLM2-135M-Instruct.Q4_0.gguf");
    let mut out = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut out, &meta, &refs).unwrap();
    path
}

/// Next-token logits after `prompt`.
fn logits(m: &LoadedModel, prompt: &[u32]) -> Vec<f32> {
    let (mut kv, rows) = direct_kv(m, prompt, prompt.len());
    let out = m.transformer.forward(&rows, &mut kv);
    out.logits.into_iter().next().unwrap().1
}

fn top(l: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..l.len()).collect();
    idx.sort_by(|&a, &b| l[b].total_cmp(&l[a]));
    idx.truncate(k);
    idx
}

#[test]
fn a_q4_0_model_loads_runs_batch_invariant_and_agrees_with_its_q4_1_source() {
    let dir = tempfile::tempdir().unwrap();
    let q40 = LoadedModel::load(&q4_0_copy(dir.path())).unwrap();
    let q41 = load();

    // Every layer matrix is Q4_0 (18 bytes per block instead of 20); the Q8_0
    // embedding (the LM head) is the same.
    let cfg = q41.config();
    let head = cfg.vocab * cfg.hidden / 32 * 34;
    let layer_blocks = (q41.transformer.weight_bytes() - head) / 20;
    assert_eq!(q40.transformer.weight_bytes(), head + layer_blocks * 18);

    // The same weights up to requantization: the source's greedy choice stays
    // among the copy's top 3 for every prompt.
    let prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "List three primary colors.",
        "What is 12 times 7?",
    ];
    for p in prompts {
        let (a, b) = (
            logits(&q41, &chat_prompt(&q41, p)),
            logits(&q40, &chat_prompt(&q40, p)),
        );
        assert!(b.iter().all(|v| v.is_finite()));
        assert!(
            top(&b, 3).contains(&top(&a, 1)[0]),
            "{p}: {:?} vs {:?}",
            top(&a, 3),
            top(&b, 3)
        );
    }

    // Batch invariance on Q4_0: each request alone equals it among the others.
    let reqs: Vec<_> = prompts
        .iter()
        .map(|p| greedy(chat_prompt(&q40, p), 12))
        .collect();
    let alone: Vec<_> = reqs.iter().map(|r| solo(&q40, r.clone())).collect();
    let mut e = engine_with_batch(&q40, 24);
    let mut rxs = enqueue_all(&mut e, &reqs);
    e.run_to_completion();
    for (i, rx) in rxs.iter_mut().enumerate() {
        assert!(!alone[i].ids.is_empty());
        assert_eq!(drain(rx), alone[i], "prompt {i}");
    }
}
