//! Engine behaviour with the real model: batch invariance, tag checks (I3),
//! admission (I1), sampling determinism, stops and aborts. Every test ends with the
//! pool back at its start free count.

use tessera_engine::testing::*;
use tessera_engine::{EngineConfig, Event, FinishReason};
use tessera_engine::{EngineError, Rejection};
use tessera_model::kv::SeqId;
use tessera_model::sampling::SamplingParams;

const PROMPTS: [&str; 8] = [
    "Hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten year old in two sentences.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish, French and German, and say which is longest.",
    "What is 12 times 7?",
    "Give me a short, friendly greeting for a birthday card for my grandmother who loves gardening and baking.",
];

#[test]
fn greedy_output_alone_equals_output_with_seven_other_requests() {
    let m = load();
    let reqs: Vec<_> = PROMPTS
        .iter()
        .map(|p| greedy(chat_prompt(&m, p), 24))
        .collect();
    let lens: Vec<usize> = reqs.iter().map(|r| r.prompt.len()).collect();
    assert!(
        lens.windows(2).any(|w| w[0] != w[1]),
        "prompt lengths must differ: {lens:?}"
    );
    let alone: Vec<_> = reqs.iter().map(|r| solo(&m, r.clone())).collect();

    // Small token budget: prefill chunks of later requests share passes with
    // decode tokens of earlier ones.
    let mut e = engine_with_batch(&m, 40);
    let mut rxs = enqueue_all(&mut e, &reqs);
    let mut max_batch = 0;
    while e.has_work() {
        max_batch = max_batch.max(e.running_ids().len());
        e.step();
    }
    assert_eq!(max_batch, 8, "all eight requests must run together");
    for (i, rx) in rxs.iter_mut().enumerate() {
        let together = drain(rx);
        assert!(!alone[i].ids.is_empty());
        assert_eq!(together, alone[i], "prompt {i} ({:?})", PROMPTS[i]);
    }
    assert_eq!(e.kv().pool().free_pages(), e.kv().pool().capacity());
}

#[test]
fn block_table_pointing_at_another_sequence_fails_only_that_request() {
    let m = load();
    let victim_req = greedy(chat_prompt(&m, "What is the capital of France?"), 20);
    let other_req = greedy(chat_prompt(&m, "Write a haiku about the sea."), 20);
    let other_alone = solo(&m, other_req.clone());

    let mut e = engine(&m, EngineConfig::default());
    let start_free = e.kv().pool().free_pages();
    let mut victim = e.enqueue(e.admit(victim_req).unwrap());
    let mut other = e.enqueue(e.admit(other_req).unwrap());
    // Run until both have produced a first token (both prompts prefilled).
    e.step();
    let ids = e.running_ids();
    assert_eq!(ids.len(), 2);
    let before = drain(&mut victim);
    assert_eq!(before.ids.len(), 1);
    // Corrupt: the victim's logical block 0 now points at the other sequence's page 0,
    // keeping the victim's expected tag.
    let other_page = e.kv().table(ids[1]).unwrap()[0].page;
    e.kv_mut_for_test().table_mut_for_test(ids[0]).unwrap()[0].page = other_page;
    e.run_to_completion();

    let after = drain(&mut victim);
    assert!(
        after.ids.is_empty(),
        "no token may follow an integrity failure"
    );
    match after.last {
        Some(Event::Error(EngineError::Integrity(err))) => {
            assert_eq!(err.page, other_page);
            assert_eq!(err.found.seq, ids[1].0);
            assert_eq!(err.expected.seq, ids[0].0);
        }
        other => panic!("expected an integrity error, got {other:?}"),
    }
    let mut other_out = drain(&mut other);
    other_out.text = other_out.text.clone();
    assert_eq!(
        other_out, other_alone,
        "the other request's output must not change"
    );
    assert_eq!(
        e.kv().pool().free_pages(),
        start_free,
        "victim's real pages must not leak"
    );
    assert_eq!(e.kv().table(SeqId(ids[0].0)), None);
}

#[test]
fn admission_rejections_leave_the_pool_untouched() {
    let m = load();
    let ctx = m.config().context;
    let e = engine(&m, EngineConfig::default());
    let free = e.kv().pool().free_pages();

    let over = greedy(vec![42; ctx - 10], 11);
    assert_eq!(
        e.admit(over).unwrap_err(),
        Rejection::ContextOverflow {
            prompt: ctx - 10,
            max_tokens: 11,
            context: ctx
        }
    );
    assert_eq!(
        e.admit(greedy(vec![], 5)).unwrap_err(),
        Rejection::EmptyPrompt
    );
    assert_eq!(
        e.admit(greedy(vec![1], 0)).unwrap_err(),
        Rejection::ZeroMaxTokens
    );
    assert!(matches!(
        e.admit(greedy(vec![1, 999_999], 5)).unwrap_err(),
        Rejection::BadToken { id: 999_999, .. }
    ));
    let mut bad = greedy(vec![1], 5);
    bad.sampling.top_p = 0.0;
    assert!(matches!(e.admit(bad).unwrap_err(), Rejection::Sampling(_)));
    // Stops past the bounds (a node checks them too, not only the gateway).
    let mut many = greedy(vec![1], 5);
    many.stop = vec!["x".into(); 5];
    assert!(matches!(e.admit(many).unwrap_err(), Rejection::Stop(_)));
    let mut long = greedy(vec![1], 5);
    long.stop = vec!["y".repeat(257)];
    assert!(matches!(e.admit(long).unwrap_err(), Rejection::Stop(_)));
    assert_eq!(e.kv().pool().free_pages(), free);
    assert!(!e.has_work());

    // A pool smaller than the context window: a prompt that fits the window but not
    // the pool is refused up front, not truncated or queued forever.
    let small = engine(
        &m,
        EngineConfig {
            kv_pool_tokens: 64,
            ..EngineConfig::default()
        },
    );
    let err = small.admit(greedy(vec![42; 100], 4)).unwrap_err();
    assert_eq!(
        err,
        Rejection::PoolTooSmall {
            needed: 112,
            capacity: 64
        }
    );
    assert!(err.to_string().contains("112") && err.to_string().contains("64"));
    assert_eq!(small.kv().pool().free_pages(), 4);
}

#[test]
fn requests_wait_for_pages_instead_of_failing() {
    let m = load();
    // Room for one request at a time: the second waits, then runs with the freed pages.
    let mut e = engine(
        &m,
        EngineConfig {
            kv_pool_tokens: 64,
            ..EngineConfig::default()
        },
    );
    let a = greedy(chat_prompt(&m, "Hi"), 8);
    assert!(a.prompt.len() + 8 <= 64 && 2 * (a.prompt.len() + 8).div_ceil(16) > 4);
    let mut ra = e.enqueue(e.admit(a.clone()).unwrap());
    let mut rb = e.enqueue(e.admit(a.clone()).unwrap());
    e.step();
    assert_eq!(e.running_ids().len(), 1);
    e.run_to_completion();
    let (oa, ob) = (drain(&mut ra), drain(&mut rb));
    assert_eq!(oa, ob, "the request that reused freed pages must match");
    assert_eq!(oa, solo(&m, a));
    assert_eq!(e.kv().pool().free_pages(), 4);
}

#[test]
fn same_seed_same_output_and_different_seed_differs() {
    let m = load();
    let mk = |seed| {
        let mut r = greedy(chat_prompt(&m, "Tell me a story about a dragon."), 24);
        r.sampling = SamplingParams {
            temperature: 1.0,
            top_p: 0.95,
            seed: Some(seed),
            ..SamplingParams::default()
        };
        r
    };
    let a = solo(&m, mk(7));
    let b = solo(&m, mk(7));
    let c = solo(&m, mk(8));
    assert_eq!(a, b);
    assert_ne!(a.ids, c.ids);
}

#[test]
fn stop_string_ends_generation_before_it() {
    let m = load();
    let mut r = greedy(chat_prompt(&m, "What is the capital of France?"), 32);
    let full = solo(&m, r.clone());
    let word = full
        .text
        .split_whitespace()
        .nth(2)
        .expect("a few words")
        .to_string();
    r.stop = vec![word.clone()];
    let cut = solo(&m, r);
    assert!(matches!(
        cut.last,
        Some(Event::Done {
            reason: FinishReason::Stop,
            ..
        })
    ));
    assert!(
        !cut.text.contains(&word),
        "{:?} still contains {word:?}",
        cut.text
    );
    assert!(full.text.starts_with(&cut.text));
}

#[test]
fn max_tokens_gives_length_and_eos_gives_stop() {
    let m = load();
    let short = solo(&m, greedy(chat_prompt(&m, "Hi"), 3));
    assert_eq!(short.ids.len(), 3);
    match short.last {
        Some(Event::Done { reason, usage }) => {
            assert_eq!(reason, FinishReason::Length);
            assert_eq!(usage.completion_tokens, 3);
        }
        other => panic!("{other:?}"),
    }
    let long = solo(&m, greedy(chat_prompt(&m, "Hi"), 200));
    assert!(matches!(
        long.last,
        Some(Event::Done {
            reason: FinishReason::Stop,
            ..
        })
    ));
    assert_eq!(
        *long.ids.last().unwrap(),
        m.tokenizer.token_id("<|im_end|>").unwrap()
    );
    assert!(!long.text.contains("<|im_end|>"));
}

#[test]
fn dropped_receiver_aborts_and_frees_pages() {
    let m = load();
    let mut e = engine(&m, EngineConfig::default());
    let free = e.kv().pool().free_pages();
    let rx = e.enqueue(e.admit(greedy(chat_prompt(&m, "Hi"), 100)).unwrap());
    e.step();
    assert!(e.kv().pool().free_pages() < free);
    drop(rx);
    e.step();
    assert!(!e.has_work());
    assert_eq!(e.kv().pool().free_pages(), free);
}

#[test]
fn a_length_cut_never_emits_half_a_character() {
    let m = load();
    let prompt = chat_prompt(&m, "Répète exactement: 日本語 🎉👨‍👩‍👧‍👦 🇫🇷 ✨✨✨");
    let full = solo(&m, greedy(prompt.clone(), 24));
    // Cut after every possible token count: some cuts fall inside a character.
    let mut cut_inside = 0;
    for n in 1..=full.ids.len() {
        let out = solo(&m, greedy(prompt.clone(), n));
        assert!(
            !out.text.contains('\u{FFFD}'),
            "max_tokens {n}: {:?}",
            out.text
        );
        assert!(
            full.text.starts_with(&out.text),
            "max_tokens {n}: {:?}",
            out.text
        );
        let bytes: Vec<u8> = out
            .ids
            .iter()
            .flat_map(|&i| m.tokenizer.token_bytes(i))
            .collect();
        if std::str::from_utf8(&bytes).is_err() {
            cut_inside += 1;
        }
    }
    assert!(
        cut_inside > 0,
        "the prompt must produce a cut inside a character: {:?}",
        full.text
    );
}

#[test]
fn engine_greedy_equals_the_direct_forward_pass() {
    let m = load();
    for user in [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "2+2=",
    ] {
        let prompt = chat_prompt(&m, user);
        let (direct, _) = greedy_with_logits(&m, &prompt, 16);
        let mut req = greedy(prompt, 16);
        req.ignore_eos = true;
        assert_eq!(solo(&m, req).ids, direct);
    }
}
