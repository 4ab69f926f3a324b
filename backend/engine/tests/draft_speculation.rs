//! Draft-model speculation (issue 37) with real models: Qwen2.5-Coder-0.5B drafts
//! for Qwen2.5-Coder-1.5B (same tokenizer). The output with drafts is token for
//! token (ids, text, RNG positions, log probabilities) the output without them,
//! for greedy decoding, seeded sampling with penalties, stop strings and a JSON
//! format, alone and 16 at once; the draft pool's pages are the tenant's, checked
//! at every read and freed with the sequence.

use std::sync::Arc;
use tessera_engine::testing::*;
use tessera_engine::{
    DraftModel, Engine, EngineConfig, Event, GenerateRequest, PdAdmission, Rejection, SpecMode,
};
use tessera_model::LoadedModel;

struct Pair {
    target: LoadedModel,
    draft: DraftModel,
}

fn pair() -> Pair {
    let target = load_family(DRAFT_PAIR.0);
    let small = load_family(DRAFT_PAIR.1);
    let draft = DraftModel::new(
        small.transformer.clone(),
        &small.tokenizer,
        &target.tokenizer,
    )
    .expect("the pair shares a tokenizer");
    Pair { target, draft }
}

/// `p`'s served model with `k` draft tokens a step from its draft model (`k` 0: no
/// speculation, no draft model), drafting for up to `max_decodes` sequences.
fn engine_with(p: &Pair, k: usize, max_decodes: usize) -> Engine {
    engine(
        &p.target,
        EngineConfig {
            speculate: k,
            speculate_max_decodes: max_decodes,
            draft: (k > 0).then(|| p.draft.clone()),
            kv_pool_tokens: 8192,
            ..EngineConfig::default()
        },
    )
}

fn requests(m: &LoadedModel) -> Vec<(&'static str, GenerateRequest)> {
    let code = "def area(w, h):\n    result = w * h\n    return result\n\n\
                def perimeter(w, h):\n    result = 2 * (w + h)\n    return result\n";
    let edit = chat_prompt(
        m,
        &format!(
            "Rename the variable `result` to `value` in this code and return all of it:\n{code}"
        ),
    );
    let story = chat_prompt(m, "Tell a short story about a lighthouse keeper.");
    let mut out = speculation_requests(m, edit, 48, "return value", 24);
    out.insert(1, ("story, greedy", greedy(story, 24)));
    out
}

#[test]
fn a_draft_model_changes_no_output_alone_or_sixteen_at_once() {
    let p = pair();
    let reqs = requests(&p.target);
    let mut solo = Vec::new();
    for (what, req) in &reqs {
        let plain = run_all(&mut engine_with(&p, 0, 2), std::slice::from_ref(req)).remove(0);
        let mut e = engine_with(&p, 4, 2);
        let spec = run_all(&mut e, std::slice::from_ref(req)).remove(0);
        assert_eq!(spec, plain, "{what}");
        let s = e.speculation();
        assert!(s.drafted > 0 && s.accepted <= s.drafted, "{what}: {s:?}");
        if *what == "greedy" {
            assert!(
                s.accepted * 2 >= s.drafted,
                "{what}: the draft model predicts most of a code edit: {s:?}"
            );
        }
        assert_eq!(e.draft_pages_in_use(), 0, "{what}: draft pages freed");
        println!("{what}: {s:?}");
        solo.push(plain);
    }
    // Sixteen at once, every one drafting: each output is its solo output.
    let many: Vec<GenerateRequest> = reqs
        .iter()
        .map(|(_, r)| r.clone())
        .cycle()
        .take(16)
        .collect();
    let want: Vec<Vec<Event>> = solo.iter().cycle().take(16).cloned().collect();
    let mut e = engine_with(&p, 4, 16);
    assert_eq!(run_all(&mut e, &many), want);
    assert!(e.speculation().accepted > 0, "{:?}", e.speculation());
    assert_eq!(e.draft_pages_in_use(), 0);
}

/// A request chooses its mode: `ngram` on an engine with a draft model drafts by
/// prompt lookup, and `draft` is refused at admission where no draft model is.
#[test]
fn a_request_chooses_prompt_lookup_or_is_refused_a_missing_draft_model() {
    let p = pair();
    let (_, edit) = requests(&p.target).remove(0);
    let mut ngram = edit.clone();
    ngram.speculate_mode = Some(SpecMode::Ngram);
    let mut e = engine_with(&p, 4, 2);
    let plain = run_all(&mut engine_with(&p, 0, 2), std::slice::from_ref(&edit));
    assert_eq!(run_all(&mut e, std::slice::from_ref(&ngram)), plain);
    assert_eq!(e.draft_pages_in_use(), 0);
    assert!(e.limits().draft);

    let mut draft = edit;
    draft.speculate_mode = Some(SpecMode::Draft);
    let e = engine_with(&p, 0, 2);
    assert!(!e.limits().draft);
    let admission = PdAdmission {
        limits: e.limits(),
        prefill_pool_tokens: e.limits().pool_tokens,
    };
    assert!(matches!(
        admission.admit(draft.clone()),
        Err(Rejection::NoDraftModel)
    ));
    // An engine itself takes it (a prefill engine never drafts; a decoding one
    // without a draft model drafts by prompt lookup).
    assert!(e.admit(draft).is_ok());
}

/// I3 in the draft pool: a draft block table pointed at another tenant's draft page
/// fails its tag check (counted); the sequence stops drafting from it and its output
/// is still its solo output; the other tenant's too.
#[test]
fn a_forged_draft_page_is_refused_and_changes_no_output() {
    let p = pair();
    let reqs = requests(&p.target);
    let mut a = reqs[0].1.clone();
    a.tenant = 1;
    let mut b = reqs[1].1.clone();
    b.tenant = 2;
    let want = vec![
        run_all(&mut engine_with(&p, 0, 2), std::slice::from_ref(&a)).remove(0),
        run_all(&mut engine_with(&p, 0, 2), std::slice::from_ref(&b)).remove(0),
    ];
    let mut e = engine_with(&p, 4, 2);
    let mut rxs = enqueue_all(&mut e, [&a, &b]);
    // Both prompts computed and a few tokens drafted for each.
    for _ in 0..4 {
        e.step();
    }
    let ids = e.running_ids();
    assert_eq!(ids.len(), 2);
    let kv = e.draft_kv_mut_for_test().expect("a draft pool");
    let theirs = kv.table(ids[1]).expect("B drafts")[0];
    kv.table_mut_for_test(ids[0]).expect("A drafts")[0] = theirs;
    e.run_to_completion();
    let got: Vec<Vec<Event>> = rxs.iter_mut().map(events).collect();
    assert_eq!(got, want);
    assert!(e.metrics().attention_tag_mismatches.get() >= 1);
    assert_eq!(e.draft_pages_in_use(), 0);
}

/// A draft model must share the served model's tokenizer.
#[test]
fn a_draft_model_of_another_tokenizer_is_refused() {
    let target = load_family(DRAFT_PAIR.1);
    let other = load();
    let err = DraftModel::new(
        other.transformer.clone(),
        &other.tokenizer,
        &target.tokenizer,
    )
    .unwrap_err();
    assert!(err.contains("tokenizer"), "{err}");
    let same = DraftModel::new(
        Arc::clone(&target.transformer),
        &target.tokenizer,
        &target.tokenizer,
    );
    assert!(same.is_ok());
}
