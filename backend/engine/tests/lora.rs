//! LoRA fine-tunes in the engine (issue 38 items 2 and 3) with the real model:
//! an adapter whose B is zero changes nothing; one that is not changes the output;
//! one batch mixes requests of two adapters and of none, and each request's tokens
//! and text are its solo run's (batch-invariance per adapter); and the prefix cache
//! keeps an adapter's pages to that adapter: the base and another adapter of the
//! same tenant and namespace never hit them (and answer as they do alone), the same
//! adapter does.

use std::sync::Arc;
use tessera_engine::testing::*;
use tessera_engine::{Engine, EngineConfig, Event, GenerateRequest, LoraRef, Rejection};
use tessera_model::lora::LoraWeights;
use tessera_model::testing::lora_file;
use tessera_model::LoadedModel;

fn adapter(m: &LoadedModel, id: &str, targets: &[&str], scale: f32, seed: u64) -> LoraRef {
    let bytes = lora_file(m, targets, 8, 16.0, scale, seed);
    let w = LoraWeights::load(&bytes, &m.lora_base, "test", m.config().layers).unwrap();
    LoraRef {
        id: id.into(),
        weights: Some(Arc::new(w)),
        file: None,
    }
}

fn with(mut r: GenerateRequest, lora: Option<&LoraRef>) -> GenerateRequest {
    r.lora = lora.cloned();
    r
}

fn cached_tokens(o: &Outcome) -> usize {
    match &o.last {
        Some(Event::Done { usage, .. }) => usage.cached_tokens,
        other => panic!("not done: {other:?}"),
    }
}

#[test]
fn a_zero_adapter_changes_nothing_and_a_real_one_changes_the_output() {
    let m = load();
    let p = chat_prompt(&m, "Name three colours of the rainbow.");
    let base = solo(&m, greedy(p.clone(), 24));
    let zero = adapter(&m, "zero", &["attn_q", "attn_v", "ffn_down"], 0.0, 1);
    assert_eq!(solo(&m, with(greedy(p.clone(), 24), Some(&zero))), base);
    let strong = adapter(
        &m,
        "strong",
        &["attn_q", "attn_v", "ffn_up", "ffn_down"],
        0.5,
        2,
    );
    let out = solo(&m, with(greedy(p, 24), Some(&strong)));
    assert_ne!(
        out.ids, base.ids,
        "a strong adapter leaves the output unchanged"
    );
}

#[test]
fn one_batch_mixes_adapters_and_each_request_answers_as_alone() {
    let m = load();
    let x = adapter(
        &m,
        "x",
        &["attn_q", "attn_k", "attn_v", "attn_output"],
        0.3,
        3,
    );
    let y = adapter(&m, "y", &["ffn_gate", "ffn_up", "ffn_down"], 0.3, 4);
    let prompts = [
        "Write one sentence about the moon.",
        "What is two plus two?",
        "List four animals.",
    ];
    let mut reqs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let p = chat_prompt(&m, p);
        for l in [None, Some(&x), Some(&y)] {
            reqs.push(with(greedy(p.clone(), 16 + i), l));
        }
    }
    let alone: Vec<Outcome> = reqs.iter().map(|r| solo(&m, r.clone())).collect();
    assert_ne!(alone[0].ids, alone[1].ids, "adapter x changes nothing here");
    assert_ne!(alone[0].ids, alone[2].ids, "adapter y changes nothing here");
    let mut e = engine(&m, EngineConfig::default());
    let mut rxs = enqueue_all(&mut e, &reqs);
    e.run_to_completion();
    for (i, rx) in rxs.iter_mut().enumerate() {
        assert_eq!(
            drain(rx),
            alone[i],
            "request {i} differs in the mixed batch"
        );
    }
    assert_eq!(e.kv().pool().free_pages(), e.kv().pool().capacity());
}

#[test]
fn an_adapters_cached_pages_are_hit_by_that_adapter_alone() {
    let m = load();
    let x = adapter(&m, "x", &["attn_q", "attn_v"], 0.3, 5);
    let y = adapter(&m, "y", &["attn_q", "attn_v"], 0.3, 6);
    let text = "Tell me about tessellations in art and mathematics. ".repeat(6);
    let p = chat_prompt(&m, &text);
    let req = |l: Option<&LoraRef>| {
        let mut r = with(greedy(p.clone(), 12), l);
        r.cache_namespace = Some([7; 32]);
        r
    };
    let mut e = engine(&m, EngineConfig::default());
    let run = |e: &mut Engine, r: GenerateRequest| {
        let mut rx = e.enqueue(e.admit(r).unwrap());
        e.run_to_completion();
        drain(&mut rx)
    };
    let first = run(&mut e, req(Some(&x)));
    assert_eq!(cached_tokens(&first), 0);
    // The base and adapter y, same tenant and namespace: cold, and as alone.
    for (what, l) in [("base", None), ("adapter y", Some(&y))] {
        let o = run(&mut e, req(l));
        assert_eq!(cached_tokens(&o), 0, "{what} hit adapter x's pages");
        let mut cold = req(l);
        cold.cache_namespace = None;
        assert_eq!(o.ids, solo(&m, cold).ids, "{what}");
    }
    // Adapter x again: its own pages, the same answer.
    let again = run(&mut e, req(Some(&x)));
    assert!(cached_tokens(&again) > 0, "adapter x missed its own pages");
    assert_eq!(again.ids, first.ids);
}

#[test]
fn a_request_naming_an_adapter_the_engine_lacks_is_refused() {
    let m = load();
    let e = engine(&m, EngineConfig::default());
    let mut r = greedy(chat_prompt(&m, "hi"), 4);
    r.lora = Some(LoraRef {
        id: "ft-1".into(),
        weights: None,
        file: None,
    });
    assert!(matches!(e.admit(r), Err(Rejection::Lora(id)) if id == "ft-1"));
    // What a node link carries: the id alone, never the weights.
    let with_weights = adapter(&m, "ft-2", &["attn_q"], 0.1, 7);
    let mut r = greedy(vec![1, 2, 3], 2);
    r.lora = Some(with_weights);
    let wire = serde_json::to_string(&r).unwrap();
    assert!(
        wire.contains("\"lora\":\"ft-2\"") && wire.len() < 4096,
        "{wire}"
    );
    let back: GenerateRequest = serde_json::from_str(&wire).unwrap();
    assert!(back
        .lora
        .is_some_and(|l| l.id == "ft-2" && l.weights.is_none()));
}
