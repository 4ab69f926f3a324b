//! Test support (feature `test-util`): engines over the real model and what a
//! request's stream received, shared by every crate's integration tests.

use crate::{Engine, EngineConfig, Event, GenerateRequest};
use tessera_model::LoadedModel;
use tokio::sync::mpsc::UnboundedReceiver;

pub use tessera_model::testing::{
    chat_prompt, family_prompts, greedy_with_logits, load, load_family, model_path, raw_prompt,
    FAMILY_MODEL_FILES,
};

/// An engine over `m` with `cfg`.
pub fn engine(m: &LoadedModel, cfg: EngineConfig) -> Engine {
    Engine::new(m.transformer.clone(), m.tokenizer.clone(), cfg)
}

/// An engine whose steps hold at most `max_batch_tokens` tokens (small budgets make
/// prefill chunks share passes with other requests' decode tokens).
pub fn engine_with_batch(m: &LoadedModel, max_batch_tokens: usize) -> Engine {
    engine(
        m,
        EngineConfig {
            max_batch_tokens,
            ..EngineConfig::default()
        },
    )
}

/// Admits and enqueues every request (all must pass admission); their event
/// receivers, in order.
pub fn enqueue_all<'a>(
    e: &mut Engine,
    reqs: impl IntoIterator<Item = &'a GenerateRequest>,
) -> Vec<UnboundedReceiver<Event>> {
    reqs.into_iter()
        .map(|r| e.enqueue(e.admit(r.clone()).unwrap()))
        .collect()
}

/// A greedy request of tenant 1.
pub fn greedy(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest::new(1, prompt, max_tokens)
}

/// Everything a request's stream received: token ids, text, final event.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Token ids, in order.
    pub ids: Vec<u32>,
    /// Concatenated text.
    pub text: String,
    /// The final event (`Done` with timings zeroed, or `Error`).
    pub last: Option<Event>,
}

/// What `rx` holds now, as an [`Outcome`]. Panics on a token after the final event.
pub fn drain(rx: &mut UnboundedReceiver<Event>) -> Outcome {
    let mut o = Outcome {
        ids: vec![],
        text: String::new(),
        last: None,
    };
    while let Ok(ev) = rx.try_recv() {
        match ev {
            Event::Token { id, text, .. } => {
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

/// Runs one request alone on a fresh engine; checks every page came back.
pub fn solo(m: &LoadedModel, req: GenerateRequest) -> Outcome {
    let mut e = engine(m, EngineConfig::default());
    let mut rx = e.enqueue(e.admit(req).unwrap());
    e.run_to_completion();
    assert_eq!(e.kv().pool().free_pages(), e.kv().pool().capacity());
    drain(&mut rx)
}
