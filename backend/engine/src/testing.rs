//! Test support (feature `test-util`): engines over the real model and what a
//! request's stream received, shared by every crate's integration tests.

use crate::{Engine, EngineConfig, Event, GenerateRequest};
use tessera_model::LoadedModel;
use tokio::sync::mpsc::UnboundedReceiver;

pub use tessera_model::testing::{
    chat_prompt, family_prompts, greedy_with_logits, load, load_family, model_path, raw_prompt,
    DRAFT_PAIR, FAMILY_MODEL_FILES,
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

/// The requests speculation is checked on (the output must not change): `repeat`
/// (a prompt whose answer repeats it) greedy, with seeded sampling and every
/// penalty, and with the stop string `stop`, `max_tokens` each; then a JSON object
/// with log probabilities (`json_tokens`). Labelled `greedy`, `seeded with
/// penalties`, `stop string`, `JSON object with logprobs`.
pub fn speculation_requests(
    m: &LoadedModel,
    repeat: Vec<u32>,
    max_tokens: usize,
    stop: &str,
    json_tokens: usize,
) -> Vec<(&'static str, GenerateRequest)> {
    let mut seeded = greedy(repeat.clone(), max_tokens);
    seeded.sampling = tessera_model::sampling::SamplingParams {
        temperature: 0.7,
        top_p: 0.95,
        top_k: 40,
        seed: Some(11),
        repetition_penalty: 1.05,
        frequency_penalty: 0.2,
        presence_penalty: 0.1,
    };
    let mut stops = greedy(repeat.clone(), max_tokens);
    stops.stop = vec![stop.into()];
    let mut json = greedy(
        chat_prompt(m, "Describe a cat as a JSON object with a name and an age."),
        json_tokens,
    );
    json.output.format = Some(tessera_model::grammar::ResponseFormat::JsonObject);
    json.output.logprobs = Some(3);
    vec![
        ("greedy", greedy(repeat, max_tokens)),
        ("seeded with penalties", seeded),
        ("stop string", stops),
        ("JSON object with logprobs", json),
    ]
}

/// Every event `rx` holds now, in order, with `Done`'s timings zeroed (they differ
/// run to run; everything else must not).
pub fn events(rx: &mut UnboundedReceiver<Event>) -> Vec<Event> {
    let mut evs = Vec::new();
    while let Ok(mut ev) = rx.try_recv() {
        if let Event::Done { usage, .. } = &mut ev {
            usage.ttft = Default::default();
            usage.tpot = Default::default();
        }
        evs.push(ev);
    }
    evs
}

/// Every event of each request ([`events`]), run together on `e` to completion.
pub fn run_all(e: &mut Engine, reqs: &[GenerateRequest]) -> Vec<Vec<Event>> {
    let mut rxs = enqueue_all(e, reqs);
    e.run_to_completion();
    rxs.iter_mut().map(events).collect()
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
