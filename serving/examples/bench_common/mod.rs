//! What the serving benchmarks share (a module, not an example: no `main.rs`).

use std::time::Instant;
use tessera_engine::GenerateRequest;
use tessera_model::chat::ChatMessage;
use tessera_model::LoadedModel;
use tessera_serving::{EngineHandle, StreamEvent};

/// Submits every request at once and returns output tokens per second.
pub(crate) fn run(h: &EngineHandle, reqs: &[GenerateRequest]) -> f64 {
    let start = Instant::now();
    let mut rxs: Vec<_> = reqs.iter().map(|r| h.submit(r.clone()).unwrap()).collect();
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
