//! Prompt-lookup speculation (issue 37) with the real model: the output with drafts
//! is token for token (ids, text, RNG positions, log probabilities) the output
//! without them, for greedy decoding, seeded sampling with every penalty, stop
//! strings and a JSON format, alone and in batches of 2 and 16; drafts are accepted
//! where the output copies the prompt.

use tessera_engine::testing::*;
use tessera_engine::{Engine, EngineConfig, Event, GenerateRequest};
use tessera_model::LoadedModel;

fn engine_with(m: &LoadedModel, speculate: usize) -> Engine {
    engine(
        m,
        EngineConfig {
            speculate,
            ..EngineConfig::default()
        },
    )
}

fn requests(m: &LoadedModel) -> Vec<(&'static str, GenerateRequest)> {
    let text = "The quick brown fox jumps over the lazy dog. A journey of a thousand \
                miles begins with a single step. To be or not to be, that is the question.";
    let copy = chat_prompt(m, &format!("Repeat this text exactly, twice:\n{text}"));
    let poem = chat_prompt(m, "Write a short poem about the sea, then explain it.");
    let mut out = speculation_requests(m, copy, 80, "single step. To", 40);
    out.insert(1, ("poem, greedy", greedy(poem, 48)));
    out
}

#[test]
fn drafts_change_nothing_alone_and_are_accepted_on_copies() {
    let m = load();
    for (what, req) in requests(&m) {
        let plain = run_all(&mut engine_with(&m, 0), std::slice::from_ref(&req));
        let mut e = engine_with(&m, 4);
        let spec = run_all(&mut e, std::slice::from_ref(&req));
        assert_eq!(spec, plain, "{what}");
        let s = e.speculation();
        assert!(s.accepted <= s.drafted, "{what}: {s:?}");
        if what == "greedy" {
            assert!(s.accepted >= 10, "{what}: the copy accepts drafts: {s:?}");
        }
        println!("{what}: {s:?}");
    }
}

#[test]
fn drafts_change_nothing_in_batches() {
    let m = load();
    let reqs: Vec<GenerateRequest> = requests(&m).into_iter().map(|(_, r)| r).collect();
    let solo: Vec<Vec<Event>> = reqs
        .iter()
        .map(|r| run_all(&mut engine_with(&m, 0), std::slice::from_ref(r)).remove(0))
        .collect();
    // Two at a time (drafts for both), and 16 at once (drafts for all of them).
    for pair in reqs.chunks(2).zip(solo.chunks(2)) {
        assert_eq!(run_all(&mut engine_with(&m, 4), pair.0), pair.1);
    }
    let many: Vec<GenerateRequest> = reqs.iter().cycle().take(16).cloned().collect();
    let want: Vec<Vec<Event>> = solo.iter().cycle().take(16).cloned().collect();
    // Drafts for all 16 (the default stands down above 2 decoding sequences).
    let mut e = engine(
        &m,
        EngineConfig {
            speculate: 4,
            speculate_max_decodes: 16,
            ..EngineConfig::default()
        },
    );
    assert_eq!(run_all(&mut e, &many), want);
    assert!(e.speculation().drafted > 0, "{:?}", e.speculation());
}

/// Drafts come from the request's own tokens only: tenant B's prompt ends with the
/// start of a phrase that only tenant A's prompt continues; B drafts exactly as
/// many tokens batched with A as alone (a draft table shared across requests would
/// propose A's continuation to B), and each output is its solo output.
#[test]
fn a_tenants_drafts_never_come_from_another_tenants_text() {
    let m = load();
    let secret = "the vault code is seven four one nine two eight";
    let mut a = greedy(
        chat_prompt(&m, &format!("Repeat after me: {secret}. Again: {secret}.")),
        48,
    );
    a.tenant = 1;
    let mut b = greedy(
        chat_prompt(&m, "Say: the vault code is. Then: the vault code is"),
        48,
    );
    b.tenant = 2;
    let alone = |r: &GenerateRequest| {
        let mut e = engine_with(&m, 4);
        let out = run_all(&mut e, std::slice::from_ref(r)).remove(0);
        (out, e.speculation().drafted)
    };
    let (out_a, drafted_a) = alone(&a);
    let (out_b, drafted_b) = alone(&b);
    let mut e = engine_with(&m, 4);
    let both = run_all(&mut e, &[a, b]);
    assert_eq!(both, [out_a, out_b]);
    assert_eq!(e.speculation().drafted, drafted_a + drafted_b);
}

/// A request's own `speculate` overrides the engine's: on with the engine's off, off
/// with the engine's on; the output is the same.
#[test]
fn a_request_turns_drafts_on_or_off_for_itself() {
    let m = load();
    let (_, copy) = requests(&m).remove(0);
    let plain = run_all(&mut engine_with(&m, 0), std::slice::from_ref(&copy));
    for (engine_k, request_k, drafts) in [(0, Some(4), true), (4, Some(0), false)] {
        let mut r = copy.clone();
        r.speculate = request_k;
        let mut e = engine_with(&m, engine_k);
        assert_eq!(run_all(&mut e, std::slice::from_ref(&r)), plain);
        assert_eq!(e.speculation().drafted > 0, drafts, "{request_k:?}");
    }
}
