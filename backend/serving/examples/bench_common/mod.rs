//! What the serving benchmarks share (a module, not an example: no `main.rs`).

use std::time::Instant;
use tessera_engine::EngineConfig;
use tessera_engine::GenerateRequest;
use tessera_model::chat::ChatMessage;
use tessera_model::LoadedModel;
use tessera_serving::{EngineHandle, StreamEvent};

/// The default model (`tessera model fetch`), loaded.
pub(crate) fn load_model() -> LoadedModel {
    let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    LoadedModel::load(&path).expect("load the model (tessera model fetch)")
}

/// The `tessera serve` default: one prefill engine (8,192 KV tokens) and one decode
/// engine (16,384) in this process.
pub(crate) fn spawn_pd(model: &LoadedModel) -> EngineHandle {
    let cfg = |tokens| EngineConfig {
        kv_pool_tokens: tokens,
        ..EngineConfig::default()
    };
    EngineHandle::spawn_disaggregated(model, &[cfg(8192)], &[cfg(16384)])
}

/// Submits every request at once and returns output tokens per second.
pub(crate) fn run(h: &EngineHandle, reqs: &[GenerateRequest]) -> f64 {
    let start = Instant::now();
    let mut rxs: Vec<_> = reqs
        .iter()
        .map(|r| h.admit_and_submit(r.clone()).unwrap())
        .collect();
    let mut tokens = 0usize;
    for rx in &mut rxs {
        loop {
            match rx.blocking_recv() {
                Some(StreamEvent::Token { .. }) => tokens += 1,
                Some(StreamEvent::Done { .. }) => break,
                other => panic!("request failed: {other:?}"),
            }
        }
    }
    tokens as f64 / start.elapsed().as_secs_f64()
}

/// `prompt` as one user message in the model's chat template, tokenized.
pub(crate) fn chat_ids(model: &LoadedModel, prompt: &str) -> Vec<u32> {
    let text = model
        .chat
        .render(&[ChatMessage::new("user", prompt)], true)
        .unwrap();
    model.tokenizer.encode(&text, true).unwrap()
}
