//! Shared helpers for integration tests with the real model.

#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;
use tessera_backend::sampling::SamplingParams;
use tessera_backend::{Engine, EngineConfig, Event, GenerateRequest, LoadedModel};
use tokio::sync::mpsc::UnboundedReceiver;

/// The real model: `$TESSERA_MODEL`, else `models/` in the workspace (filled by
/// `tessera model fetch`, which `.ci/run` runs first).
pub fn model_path() -> PathBuf {
    if let Ok(p) = std::env::var("TESSERA_MODEL") {
        return p.into();
    }
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "model file {} missing: run `cargo run --release -- model fetch` (or set TESSERA_MODEL)",
        p.display()
    );
    p
}

pub fn load() -> LoadedModel {
    LoadedModel::load(&model_path()).expect("load model")
}

pub fn engine(m: &LoadedModel, cfg: EngineConfig) -> Engine {
    Engine::new(m.llama.clone(), m.tokenizer.clone(), cfg)
}

pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        tenant: 1,
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        stop: vec![],
        ignore_eos: false,
    }
}

/// Everything a request's stream received: token ids, text, final event.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    pub ids: Vec<u32>,
    pub text: String,
    pub last: Option<Event>,
}

pub fn drain(rx: &mut UnboundedReceiver<Event>) -> Outcome {
    let mut o = Outcome {
        ids: vec![],
        text: String::new(),
        last: None,
    };
    while let Ok(ev) = rx.try_recv() {
        match ev {
            Event::Token { id, text } => {
                assert!(o.last.is_none(), "token after the final event");
                o.ids.push(id);
                o.text.push_str(&text);
            }
            // Timings differ run to run; compare everything else.
            Event::Done { reason, mut usage } => {
                usage.ttft = Default::default();
                usage.tpot = Default::default();
                o.last = Some(Event::Done { reason, usage });
            }
            e => o.last = Some(e),
        }
    }
    o
}

/// Runs one request alone on a fresh engine.
pub fn solo(m: &LoadedModel, req: GenerateRequest) -> Outcome {
    let mut e = engine(m, EngineConfig::default());
    let mut rx = e.enqueue(e.admit(req).unwrap());
    e.run_to_completion();
    assert_eq!(e.kv().pool().free_pages(), e.kv().pool().capacity());
    drain(&mut rx)
}

pub fn chat_prompt(m: &LoadedModel, user: &str) -> Vec<u32> {
    let text = m
        .chat
        .render(
            &[tessera_backend::chat::ChatMessage::new("user", user)],
            true,
        )
        .unwrap();
    m.tokenizer.encode(&text, true).unwrap()
}

/// A KV manager holding one reserved sequence (`SeqId(1)`, tenant 1) of `tokens`
/// tokens for direct forward passes, and the prefill rows of `prompt` (logits for
/// the last one only).
pub fn direct_kv(
    m: &LoadedModel,
    prompt: &[u32],
    tokens: usize,
) -> (
    tessera_backend::kv::KvManager,
    Vec<tessera_backend::model::BatchRow>,
) {
    use tessera_backend::kv::{KvManager, PagePool, SeqId};
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
        .map(|(pos, &token)| tessera_backend::model::BatchRow {
            seq,
            token,
            pos,
            want_logits: pos + 1 == prompt.len(),
        })
        .collect();
    (kv, rows)
}
