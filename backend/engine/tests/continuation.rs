//! Continuations (issue 36) with the real model: a request whose first `k` output
//! tokens reached the client, continued elsewhere as the prompt plus those tokens
//! with [`Resume`], produces exactly the tokens and text the uninterrupted run did
//! after them, for greedy decoding and for seeded sampling with every penalty, with
//! stop strings and with a JSON format; its usage counts the whole request.

use tessera_engine::testing::*;
use tessera_engine::{Event, GenerateRequest, Resume, Usage};
use tessera_model::grammar::ResponseFormat;
use tessera_model::sampling::SamplingParams;
use tessera_model::LoadedModel;

/// What one request's stream received: per token its id, text and RNG position;
/// then the usage of its `Done`.
struct Run {
    ids: Vec<u32>,
    texts: Vec<String>,
    rng: Vec<u64>,
    usage: Usage,
}

fn run(m: &LoadedModel, req: GenerateRequest) -> Run {
    let mut e = engine(m, Default::default());
    let mut rx = e.enqueue(e.admit(req).unwrap());
    e.run_to_completion();
    let mut r = Run {
        ids: vec![],
        texts: vec![],
        rng: vec![],
        usage: Usage::default(),
    };
    while let Ok(ev) = rx.try_recv() {
        match ev {
            Event::Token {
                id,
                text,
                rng_word_pos,
                ..
            } => {
                r.ids.push(id);
                r.texts.push(text);
                r.rng.push(rng_word_pos);
            }
            Event::Done { usage, .. } => r.usage = usage,
            Event::Error(e) => panic!("{e}"),
        }
    }
    r
}

/// Continues `req` after `k` tokens of its uninterrupted run `full`, as the
/// coordinator does after a node failure.
fn continuation(req: &GenerateRequest, full: &Run, k: usize) -> GenerateRequest {
    let mut c = req.clone();
    c.prompt.extend(&full.ids[..k]);
    c.max_tokens -= k;
    c.resume = Some(Resume {
        output_tokens: k,
        rng_word_pos: full.rng[k - 1],
    });
    c
}

fn check(m: &LoadedModel, what: &str, req: GenerateRequest, ks: &[usize]) {
    let full = run(m, req.clone());
    assert!(
        full.ids.len() > *ks.last().unwrap(),
        "{what}: {} tokens",
        full.ids.len()
    );
    for &k in ks {
        let cont = run(m, continuation(&req, &full, k));
        assert_eq!(cont.ids, full.ids[k..], "{what}, k = {k}: tokens");
        assert_eq!(
            full.texts[..k].concat() + &cont.texts.concat(),
            full.texts.concat(),
            "{what}, k = {k}: text"
        );
        assert_eq!(cont.rng, full.rng[k..], "{what}, k = {k}: RNG positions");
        assert_eq!(cont.usage.prompt_tokens, full.usage.prompt_tokens, "{what}");
        assert_eq!(
            cont.usage.completion_tokens, full.usage.completion_tokens,
            "{what}"
        );
    }
}

#[test]
fn a_continuation_produces_what_the_uninterrupted_run_did() {
    let m = load();
    let prompt = chat_prompt(&m, "Write a short poem about the sea, then explain it.");
    let ks = [1, 2, 7, 20, 33];
    check(&m, "greedy", greedy(prompt.clone(), 48), &ks);

    let mut seeded = greedy(prompt.clone(), 48);
    seeded.sampling = SamplingParams {
        temperature: 0.9,
        top_p: 0.95,
        top_k: 40,
        seed: Some(7),
        repetition_penalty: 1.1,
        frequency_penalty: 0.5,
        presence_penalty: 0.3,
    };
    check(&m, "seeded, penalties", seeded, &ks);

    // Stop strings that the output keeps starting (held back, then released).
    let mut stops = greedy(prompt.clone(), 48);
    stops.stop = vec!["the sea's end".into(), "\n\n\n".into(), "waves of".into()];
    check(&m, "stop strings", stops, &ks);

    let mut json = greedy(
        chat_prompt(
            &m,
            "Describe a cat as a JSON object with a name and an age.",
        ),
        40,
    );
    json.output.format = Some(ResponseFormat::JsonObject);
    check(&m, "JSON object", json, &[1, 5, 12]);
}

#[test]
fn a_continuation_must_leave_a_prompt_token() {
    let m = load();
    let e = engine(&m, Default::default());
    let mut r = greedy(vec![1, 2, 3], 4);
    r.resume = Some(Resume {
        output_tokens: 3,
        rng_word_pos: 0,
    });
    assert!(e.admit(r).is_err());
}

/// A drain's move (issue 36): a sequence ended by [`Engine::end_caching_output`]
/// after `k` tokens leaves every page whose K/V was computed, output pages
/// included, in the prefix cache, and its continuation on the same engine reuses
/// all of them and computes only the last partial page: it produces exactly what
/// the uninterrupted run did. Another namespace's identical continuation finds
/// none of them.
#[test]
fn a_drained_sequences_continuation_reuses_its_output_pages() {
    let m = load();
    let prompt = chat_prompt(&m, "Write a short poem about the sea, then explain it.");
    let mut req = greedy(prompt.clone(), 64);
    req.cache_namespace = Some([7; 32]);
    let full = run(&m, req.clone());
    let page = tessera_engine::EngineConfig::default().page_size;
    let mut e = engine(&m, Default::default());
    let mut rx = e.enqueue(e.admit(req.clone()).unwrap());
    let k = 37;
    let mut got = 0;
    while got < k {
        e.step();
        while let Ok(ev) = rx.try_recv() {
            assert!(matches!(ev, Event::Token { .. }), "{ev:?}");
            got += 1;
        }
    }
    assert_eq!(got, k, "one token a step without speculation");
    let seq = e.running_ids()[0];
    let computed = prompt.len() + k - 1;
    assert_eq!(e.end_caching_output(seq), computed / page);
    assert!(!e.has_work());
    assert!(
        rx.try_recv().is_err(),
        "the end is the protocol's to report, not an event"
    );

    // What a continuation computes of its prompt (the prompt and the tokens its
    // client has), and the tokens it produces.
    let continue_on = |e: &mut tessera_engine::Engine, c: GenerateRequest| {
        e.reset_served();
        let mut rx = e.enqueue(e.admit(c).unwrap());
        e.run_to_completion();
        let mut ids = vec![];
        while let Ok(ev) = rx.try_recv() {
            match ev {
                Event::Token { id, .. } => ids.push(id),
                Event::Done { .. } => {}
                Event::Error(e) => panic!("{e}"),
            }
        }
        let computed: u64 = e.served().values().map(|s| s.prefill).sum();
        (ids, computed as usize)
    };
    let cont = continuation(&req, &full, k);
    let (ids, prefilled) = continue_on(&mut e, cont.clone());
    assert_eq!(ids, full.ids[k..]);
    assert_eq!(prefilled, cont.prompt.len() - computed / page * page);
    assert!(prefilled <= page, "only the last partial page is computed");

    let mut other = cont.clone();
    other.cache_namespace = Some([8; 32]);
    let (ids, prefilled) = continue_on(&mut e, other);
    assert_eq!(ids, full.ids[k..]);
    assert_eq!(
        prefilled,
        cont.prompt.len(),
        "another namespace hits nothing"
    );
}
