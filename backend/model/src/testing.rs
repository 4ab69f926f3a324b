//! Test support (feature `test-util`): the real model file, shared by every crate's
//! integration tests.

use crate::chat::ChatMessage;
use crate::kv::{KvManager, PagePool, SeqId};
use crate::sampling::argmax;
use crate::transformer::BatchRow;
use crate::LoadedModel;
use std::path::PathBuf;

/// The real model: `$TESSERA_MODEL`, else `models/` in the workspace (filled by
/// `tessera model fetch`, which `scripts/test` and `.ci/run` run first).
///
/// Panics when the file is missing: model tests fail, they never skip.
pub fn model_path() -> PathBuf {
    if let Ok(p) = std::env::var("TESSERA_MODEL") {
        return p.into();
    }
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "model file {} missing: run `cargo run --release -- model fetch` (or set TESSERA_MODEL)",
        p.display()
    );
    p
}

/// File names in `models/` of the other families' models (`tessera model fetch
/// --model gemma-3-270m --model qwen2.5-coder-0.5b-instruct`, which `scripts/test`
/// runs).
pub const FAMILY_MODEL_FILES: [&str; 2] = [
    "gemma-3-270m-q4_k_m.gguf",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
];

/// Draft-model speculation's pair in `models/` (`tessera model fetch --model
/// qwen2.5-coder-1.5b-instruct --model qwen2.5-coder-0.5b-instruct`): the served
/// model and the model that drafts for it (same tokenizer).
pub const DRAFT_PAIR: (&str, &str) = (
    "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
);

/// Path of model file `file` in `models/` (see [`FAMILY_MODEL_FILES`]).
///
/// Panics when the file is missing: model tests fail, they never skip.
pub fn family_model_path(file: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(file);
    assert!(
        p.exists(),
        "model file {} missing: run `cargo run --release -- model fetch --model gemma-3-270m \
         --model qwen2.5-coder-0.5b-instruct --model qwen2.5-coder-1.5b-instruct`",
        p.display()
    );
    p
}

/// Loads model file `file` from `models/` (see [`family_model_path`]).
pub fn load_family(file: &str) -> LoadedModel {
    LoadedModel::load(&family_model_path(file)).expect("load model")
}

/// Loads the real model.
pub fn load() -> LoadedModel {
    LoadedModel::load(&model_path()).expect("load model")
}

/// Token ids of `user` as one chat-templated user turn, ready for the assistant.
pub fn chat_prompt(m: &LoadedModel, user: &str) -> Vec<u32> {
    let text = m
        .chat
        .render(&[ChatMessage::new("user", user)], true)
        .unwrap();
    m.tokenizer.encode(&text, true).unwrap()
}

/// A KV manager holding one reserved sequence (`SeqId(1)`, tenant 1) of `tokens`
/// tokens for direct forward passes (no engine), and the prefill rows of `prompt`
/// (logits for the last one only).
pub fn direct_kv(m: &LoadedModel, prompt: &[u32], tokens: usize) -> (KvManager, Vec<BatchRow>) {
    let mut kv = KvManager::new(PagePool::new(
        m.config().kv_layout(16),
        tokens.div_ceil(16),
        false,
    ));
    let seq = SeqId(1);
    kv.reserve(seq, 1, tokens).unwrap();
    let rows = prompt
        .iter()
        .enumerate()
        .map(|(pos, &token)| BatchRow {
            seq,
            token,
            pos,
            want_logits: pos + 1 == prompt.len(),
        })
        .collect();
    (kv, rows)
}

/// Greedy decoding of `n` tokens straight through the forward pass (one sequence,
/// its own pool, no engine): the token ids and the logits each was chosen from.
pub fn greedy_with_logits(m: &LoadedModel, prompt: &[u32], n: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    greedy_with_logits_lora(m, None, prompt, n)
}

/// [`greedy_with_logits`] with every row under LoRA adapter `lora`.
pub fn greedy_with_logits_lora(
    m: &LoadedModel,
    lora: Option<&crate::lora::LoraWeights>,
    prompt: &[u32],
    n: usize,
) -> (Vec<u32>, Vec<Vec<f32>>) {
    let (mut kv, mut rows) = direct_kv(m, prompt, prompt.len() + n);
    let seq = SeqId(1);
    let (mut out, mut all) = (Vec::new(), Vec::new());
    for step in 0..n {
        let per_row = vec![lora; rows.len()];
        let per_row = if lora.is_some() { &per_row[..] } else { &[] };
        let fwd = m.transformer.forward_lora(&rows, per_row, &mut kv);
        assert!(fwd.failed.is_empty());
        let logits = fwd.logits.into_iter().next().unwrap().1;
        let tok = argmax(&logits);
        out.push(tok);
        all.push(logits);
        rows = vec![BatchRow {
            seq,
            token: tok,
            pos: prompt.len() + step,
            want_logits: true,
        }];
    }
    kv.release(seq);
    assert_eq!(kv.pool().free_pages(), kv.pool().capacity());
    (out, all)
}

/// Token ids of a raw (un-templated) prompt: the tokenizer's own BOS rule, no
/// special-token parsing.
pub fn raw_prompt(m: &LoadedModel, text: &str) -> Vec<u32> {
    m.tokenizer.encode_with_bos_eos(text, false).unwrap()
}

/// Raw prompts for the per-family invariance tests: short ones of different
/// lengths and one of about 700 tokens, past Gemma 3's 512-token sliding window,
/// so local layers read only part of its pages.
pub fn family_prompts() -> Vec<String> {
    let mut prompts: Vec<String> = [
        "The capital of France is",
        "def fibonacci(n):",
        "Once upon a time, in a small village",
        "Photosynthesis is the process by which",
    ]
    .map(String::from)
    .to_vec();
    let paragraph = "The river ran past the mill, under the stone bridge and into the \
                     wide green valley where the farmers kept their sheep. ";
    prompts.push(format!(
        "{}In one word, the river ran",
        paragraph.repeat(28)
    ));
    prompts
}

/// A LoRA adapter file (GGUF, llama.cpp's form) for `m`: pairs of rank `rank` on
/// `targets` (e.g. `attn_q`, `ffn_down`) of every block, with A and B drawn
/// uniformly from `[-scale, scale]` by a generator seeded with `seed`, and
/// `adapter.lora.alpha = alpha`. `scale = 0` gives B = 0 (an adapter that changes
/// nothing).
pub fn lora_file(
    m: &LoadedModel,
    targets: &[&str],
    rank: usize,
    alpha: f32,
    scale: f32,
    seed: u64,
) -> Vec<u8> {
    use candle_core::quantized::gguf_file::{self, Value};
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut tensors: Vec<(String, QTensor)> = Vec::new();
    let mut draw = |rows: usize, cols: usize, s: f32| {
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| {
                if s == 0.0 {
                    0.0
                } else {
                    rng.random_range(-s..s)
                }
            })
            .collect();
        let t = Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap();
        QTensor::quantize(&t, GgmlDType::F32).unwrap()
    };
    for layer in 0..m.config().layers {
        for t in targets {
            let name = format!("blk.{layer}.{t}.weight");
            let [inputs, outputs] = m.lora_base.matrices[&name];
            // candle shapes are [ne1, ne0]: A is ne [in, rank], B ne [rank, out].
            tensors.push((format!("{name}.lora_a"), draw(rank, inputs, 0.05)));
            tensors.push((format!("{name}.lora_b"), draw(outputs, rank, scale)));
        }
    }
    let meta = [
        ("general.type", Value::String("adapter".into())),
        ("adapter.type", Value::String("lora".into())),
        (
            "general.architecture",
            Value::String(m.lora_base.architecture.clone()),
        ),
        ("adapter.lora.alpha", Value::F32(alpha)),
    ];
    let meta: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
    let tensors: Vec<(&str, &QTensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut out, &meta, &tensors).unwrap();
    out.into_inner()
}
