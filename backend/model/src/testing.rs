//! Test support (feature `test-util`): the real model file, shared by every crate's
//! integration tests.

use crate::chat::ChatMessage;
use crate::kv::{KvManager, PagePool, SeqId};
use crate::llama::BatchRow;
use crate::sampling::argmax;
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
    let (mut kv, mut rows) = direct_kv(m, prompt, prompt.len() + n);
    let seq = SeqId(1);
    let (mut out, mut all) = (Vec::new(), Vec::new());
    for step in 0..n {
        let fwd = m.llama.forward(&rows, &mut kv);
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
