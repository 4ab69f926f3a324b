//! Prefill/decode disaggregation end to end with the real model: a prefill engine
//! and a decode engine in one process, joined by the KV transfer protocol over the
//! in-process transport. Each test reproduces a bug class of PD serving engines and
//! checks the client-visible result (an error, never tokens presented as success)
//! and that every pool returns to its start free-page count.

use std::time::{Duration, Instant};
use tessera_engine::testing::*;
use tessera_engine::{EngineConfig, GenerateRequest};
use tessera_model::LoadedModel;
use tessera_serving::{
    EngineHandle, RequestStream, ServeError, ServeErrorKind, StreamEvent, TransferFault,
};
use tessera_transfer::protocol::{Msg, PageCommit, ReqId, Role};
use tessera_transfer::transport::DestPage;

fn cfg(tokens: usize) -> EngineConfig {
    EngineConfig {
        kv_pool_tokens: tokens,
        ..EngineConfig::default()
    }
}

/// Small pools keep the test's memory low; startup validation (I2) is bypassed on
/// purpose: these tests exercise the per-request checks behind it.
fn cluster(m: &LoadedModel, prefill_tokens: usize, decode_tokens: usize) -> EngineHandle {
    EngineHandle::spawn_disaggregated(m, &[cfg(prefill_tokens)], &[cfg(decode_tokens)])
}

/// What a request's stream delivered: token ids, text, final event.
#[derive(Debug, Clone, PartialEq)]
struct Streamed {
    ids: Vec<u32>,
    text: String,
    last: Option<StreamEvent>,
}

/// A stream equals a solo run when its tokens, text and final `Done` are the same.
impl PartialEq<Outcome> for Streamed {
    fn eq(&self, o: &Outcome) -> bool {
        self.ids == o.ids
            && self.text == o.text
            && self.last == o.last.clone().map(|e| e.map_error(ServeError::from))
    }
}

/// Every event of one request, up to its final event (bounded wait).
fn collect(rx: &mut RequestStream) -> Streamed {
    let mut o = Streamed {
        ids: vec![],
        text: String::new(),
        last: None,
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    while o.last.is_none() {
        assert!(Instant::now() < deadline, "request did not finish");
        match rx.try_recv() {
            Some(StreamEvent::Token { id, text, .. }) => {
                o.ids.push(id);
                o.text.push_str(&text);
            }
            Some(StreamEvent::Done { reason, mut usage }) => {
                usage.ttft = Default::default();
                usage.tpot = Default::default();
                o.last = Some(StreamEvent::Done { reason, usage });
            }
            Some(e) => o.last = Some(e),
            None if rx.is_released() && rx.try_recv().is_none() => {
                panic!("stream closed without a final event: {o:?}")
            }
            None => std::thread::sleep(Duration::from_millis(2)),
        }
    }
    o
}

/// Waits until every node's pool is full again and every request was released.
fn assert_pools_full(h: &EngineHandle) {
    let c = h.cluster().unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let p = c.node_stats(Role::Prefill, 0);
        let d = c.node_stats(Role::Decode, 0);
        if p.free_pages == p.capacity_pages
            && d.free_pages == d.capacity_pages
            && p.running + p.waiting + d.running + d.waiting == 0
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "pools not back to full: prefill {p:?}, decode {d:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The message of the serving error that ended the stream, which must be of `kind`.
fn serve_error(o: &Streamed, kind: ServeErrorKind) -> String {
    match &o.last {
        Some(StreamEvent::Error(e)) if e.kind() == kind => e.message().to_string(),
        other => panic!("expected a {kind:?} error, got {other:?} after {:?}", o.ids),
    }
}

#[test]
fn concurrent_requests_through_prefill_and_decode_equal_their_solo_outputs() {
    let m = load();
    let h = cluster(&m, 4096, 8192);
    let prompts = [
        "Hi",
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain photosynthesis to a ten year old in two sentences.",
        "List three primary colors.",
    ];
    let reqs: Vec<GenerateRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = greedy(chat_prompt(&m, p), 16);
            r.tenant = 1 + i as u64 % 2;
            r
        })
        .collect();
    let alone: Vec<Outcome> = reqs.iter().map(|r| solo(&m, r.clone())).collect();
    let mut rxs: Vec<_> = reqs
        .iter()
        .map(|r| h.admit_and_submit(r.clone()).unwrap())
        .collect();
    for (i, rx) in rxs.iter_mut().enumerate() {
        assert_eq!(collect(rx), alone[i], "prompt {:?}", prompts[i]);
    }
    assert_pools_full(&h);
    let c = h.cluster().unwrap();
    assert_eq!(
        c.counters()
            .commits_rejected
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
}

/// PD invariance per model family: every request (one longer than Gemma 3's
/// sliding window) streams the same tokens through prefill and decode nodes as
/// alone on one engine; whole-context pages move for sliding-window models too.
fn family_requests_through_prefill_and_decode_equal_their_solo_outputs(file: &str) {
    let m = load_family(file);
    let h = cluster(&m, 4096, 8192);
    let reqs: Vec<GenerateRequest> = family_prompts()
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = greedy(raw_prompt(&m, p), 8);
            r.tenant = 1 + i as u64 % 2;
            r
        })
        .collect();
    let alone: Vec<Outcome> = reqs.iter().map(|r| solo(&m, r.clone())).collect();
    let mut rxs: Vec<_> = reqs
        .iter()
        .map(|r| h.admit_and_submit(r.clone()).unwrap())
        .collect();
    for (i, rx) in rxs.iter_mut().enumerate() {
        assert_eq!(collect(rx), alone[i], "{file}: request {i}");
    }
    assert_pools_full(&h);
}

#[test]
fn gemma3_requests_through_prefill_and_decode_equal_their_solo_outputs() {
    family_requests_through_prefill_and_decode_equal_their_solo_outputs(FAMILY_MODEL_FILES[0]);
}

#[test]
fn qwen2_requests_through_prefill_and_decode_equal_their_solo_outputs() {
    family_requests_through_prefill_and_decode_equal_their_solo_outputs(FAMILY_MODEL_FILES[1]);
}

#[test]
fn prompt_over_the_prefill_pool_but_under_the_context_window_is_refused_before_any_transfer() {
    let m = load();
    // Decode pool larger than the prefill pool; the prompt lies between them.
    let h = cluster(&m, 256, 4096);
    let before = h.stats();
    let words = "tell me about the sea and the sky ".repeat(60);
    let prompt = m.tokenizer.encode(&words, false).unwrap();
    assert!(
        prompt.len() > 256 && prompt.len() + 8 < 4096,
        "{}",
        prompt.len()
    );
    let err = h.admit_and_submit(greedy(prompt, 8)).unwrap_err();
    assert_eq!(err.kind(), ServeErrorKind::TooLarge, "{err:?}");
    assert!(err.message().contains("holds 256"), "{err:?}");
    assert_eq!(h.stats(), before, "nothing allocated, nothing queued");
    let c = h.cluster().unwrap();
    assert_eq!(
        c.counters()
            .released
            .load(std::sync::atomic::Ordering::Relaxed),
        0,
        "no transfer started"
    );
}

#[test]
fn prompt_plus_output_over_the_decode_pool_is_refused_before_any_transfer() {
    let m = load();
    let h = cluster(&m, 4096, 512);
    let prompt = chat_prompt(&m, "What is the capital of France?");
    let err = h.admit_and_submit(greedy(prompt, 600)).unwrap_err();
    assert_eq!(err.kind(), ServeErrorKind::TooLarge, "{err:?}");
    assert!(err.message().contains("holds 512"), "{err:?}");
    assert_pools_full(&h);
}

#[test]
fn client_abort_during_the_transfer_frees_both_pools_and_the_next_request_is_clean() {
    let m = load();
    let h = cluster(&m, 4096, 4096);
    // A prompt over one step's token budget (512) keeps the prefill busy for
    // several steps while the client goes away.
    let long = m
        .tokenizer
        .encode(
            &"a story about a lighthouse keeper and the sea. ".repeat(100),
            false,
        )
        .unwrap();
    assert!(long.len() > 900, "{}", long.len());
    let rx = h.admit_and_submit(greedy(long, 32)).unwrap();
    let c = h.cluster().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.node_stats(Role::Prefill, 0).running == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(rx);
    // The next request (another tenant) gets the just-freed pages.
    let mut next = greedy(chat_prompt(&m, "What is 12 times 7?"), 16);
    next.tenant = 9;
    let alone = solo(&m, next.clone());
    let mut rx = h.admit_and_submit(next).unwrap();
    assert_eq!(collect(&mut rx), alone);
    assert_pools_full(&h);
}

#[test]
fn abort_right_after_submit_then_a_new_request_equals_its_solo_output() {
    let m = load();
    let h = cluster(&m, 4096, 4096);
    for _ in 0..3 {
        drop(
            h.admit_and_submit(greedy(chat_prompt(&m, "Write a haiku about the sea."), 32))
                .unwrap(),
        );
    }
    let mut next = greedy(chat_prompt(&m, "List three primary colors."), 16);
    next.tenant = 5;
    let alone = solo(&m, next.clone());
    let mut rx = h.admit_and_submit(next).unwrap();
    assert_eq!(collect(&mut rx), alone);
    assert_pools_full(&h);
}

#[test]
fn transfer_missing_a_page_write_fails_the_request_with_an_error() {
    let m = load();
    let h = cluster(&m, 4096, 4096);
    h.cluster()
        .unwrap()
        .inject_fault(TransferFault::DropLastWrite);
    let mut rx = h
        .admit_and_submit(greedy(chat_prompt(&m, "What is the capital of France?"), 8))
        .unwrap();
    let o = collect(&mut rx);
    assert!(o.ids.is_empty(), "no token may reach the client: {o:?}");
    let e = serve_error(&o, ServeErrorKind::Integrity);
    assert!(e.contains("checksum"), "{e}");
    assert_pools_full(&h);
}

#[test]
fn corrupted_byte_in_a_page_fails_the_request_with_an_error() {
    let m = load();
    let h = cluster(&m, 4096, 4096);
    h.cluster()
        .unwrap()
        .inject_fault(TransferFault::CorruptByte);
    let mut rx = h
        .admit_and_submit(greedy(chat_prompt(&m, "Write a haiku about the sea."), 8))
        .unwrap();
    let o = collect(&mut rx);
    assert!(o.ids.is_empty(), "{o:?}");
    assert!(serve_error(&o, ServeErrorKind::Integrity).contains("checksum"));
    assert_pools_full(&h);
}

#[test]
fn duplicated_commit_is_refused_and_the_request_decodes_once() {
    let m = load();
    let h = cluster(&m, 4096, 4096);
    let c = h.cluster().unwrap();
    c.inject_fault(TransferFault::DuplicateCommit);
    let req = greedy(chat_prompt(&m, "List three primary colors."), 12);
    let alone = solo(&m, req.clone());
    let mut rx = h.admit_and_submit(req).unwrap();
    assert_eq!(collect(&mut rx), alone);
    assert_pools_full(&h);
    assert_eq!(
        c.counters()
            .commits_rejected
            .load(std::sync::atomic::Ordering::Relaxed),
        1
    );
}

#[test]
fn commit_for_an_unknown_request_is_refused_and_changes_nothing() {
    let m = load();
    let h = cluster(&m, 4096, 4096);
    let c = h.cluster().unwrap();
    let before = h.stats();
    c.deliver_to_decode(
        0,
        Msg::Commit {
            req: ReqId(987_654),
            tokens: 16,
            pages: vec![PageCommit {
                dest: DestPage {
                    page: 0,
                    tag: Default::default(),
                },
                checksum: 0,
            }],
            first_token: 1,
        },
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while c
        .counters()
        .commits_rejected
        .load(std::sync::atomic::Ordering::Relaxed)
        == 0
    {
        assert!(Instant::now() < deadline, "forged commit not refused");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(h.stats(), before);
    // The node still serves.
    let req = greedy(chat_prompt(&m, "Hi"), 8);
    let alone = solo(&m, req.clone());
    assert_eq!(collect(&mut h.admit_and_submit(req).unwrap()), alone);
}

#[test]
fn late_write_after_the_request_ended_is_dropped_and_the_new_owner_is_untouched() {
    let m = load();
    let h = cluster(&m, 4096, 4096);
    let c = h.cluster().unwrap();
    c.tap_writes();
    let mut first = h
        .admit_and_submit(greedy(chat_prompt(&m, "What is the capital of France?"), 4))
        .unwrap();
    collect(&mut first);
    assert_pools_full(&h);
    let late = c.tapped_writes();
    assert!(!late.is_empty());
    // A new tenant's request takes the same pages (LIFO free list) while the old
    // writes "arrive late".
    let mut next = greedy(chat_prompt(&m, "Write a haiku about the sea."), 24);
    next.tenant = 77;
    let alone = solo(&m, next.clone());
    let mut rx = h.admit_and_submit(next).unwrap();
    // Wait until it decodes (its prompt pages are in place), then replay.
    while c.node_stats(Role::Decode, 0).running == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let n = late.len() as u64;
    for w in late {
        c.deliver_write(0, w);
    }
    assert_eq!(collect(&mut rx), alone);
    assert!(
        c.counters()
            .writes_dropped
            .load(std::sync::atomic::Ordering::Relaxed)
            >= n
    );
    assert_pools_full(&h);
}

#[test]
fn prefill_node_killed_mid_transfer_fails_the_request_and_frees_the_decode_pool() {
    let m = load();
    let h = cluster(&m, 4096, 4096);
    let c = h.cluster().unwrap();
    let long = m
        .tokenizer
        .encode(
            &"the quick brown fox jumps over the lazy dog. ".repeat(60),
            false,
        )
        .unwrap();
    let mut rx = h.admit_and_submit(greedy(long, 16)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while c.node_stats(Role::Prefill, 0).running == 0 {
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    c.kill_node(Role::Prefill, 0);
    let o = collect(&mut rx);
    assert!(o.ids.is_empty());
    assert!(
        serve_error(&o, ServeErrorKind::NodeDown).contains("prefill node"),
        "{o:?}"
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let d = c.node_stats(Role::Decode, 0);
        if d.free_pages == d.capacity_pages {
            break;
        }
        assert!(Instant::now() < deadline, "decode pool not freed: {d:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn decode_node_killed_mid_stream_ends_the_stream_with_an_error_and_prefill_is_full() {
    let m = load();
    let h = cluster(&m, 4096, 4096);
    let c = h.cluster().unwrap();
    let mut req = greedy(chat_prompt(&m, "Write a long story about the sea."), 400);
    req.ignore_eos = true;
    let mut rx = h.admit_and_submit(req).unwrap();
    // Wait for a few streamed tokens.
    let mut got = 0;
    while got < 3 {
        match rx.blocking_recv() {
            Some(StreamEvent::Token { .. }) => got += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    c.kill_node(Role::Decode, 0);
    let o = collect(&mut rx);
    assert!(
        serve_error(&o, ServeErrorKind::NodeDown).contains("decode node"),
        "{o:?}"
    );
    let p = c.node_stats(Role::Prefill, 0);
    assert_eq!(p.free_pages, p.capacity_pages);
}

/// A request that must wait for decode pages longer than the coordinator's
/// retransmission interval (5 s) is not disturbed by the re-sent `Prealloc`: it keeps
/// its place and its stream, and once the first request's pages are freed it runs to
/// its solo answer. (The decode node's FIFO of waiting requests is protocol state, so
/// a duplicate `Prealloc` is answered from the record, never acted on twice.)
#[test]
fn a_request_waiting_for_decode_pages_past_the_retransmit_interval_completes() {
    let m = load();
    // The decode pool holds one of these requests at a time.
    let h = cluster(&m, 4096, 1024);
    let mut first = greedy(chat_prompt(&m, "Count from one to one thousand."), 900);
    first.ignore_eos = true;
    let second = greedy(chat_prompt(&m, "What is the capital of France?"), 16);
    let alone = solo(&m, second.clone());
    let started = Instant::now();
    let mut a = h.admit_and_submit(first).unwrap();
    std::thread::sleep(Duration::from_millis(200));
    let mut b = h.admit_and_submit(second).unwrap();
    let out_a = collect(&mut a);
    assert!(
        matches!(out_a.last, Some(StreamEvent::Done { .. })),
        "{out_a:?}"
    );
    let out_b = collect(&mut b);
    assert!(
        started.elapsed() > Duration::from_secs(5),
        "the first request was too short to make the second one wait past a retransmission ({:?})",
        started.elapsed()
    );
    assert_eq!(out_b, alone);
    assert_pools_full(&h);
}

/// I6: a cancelled request's stream reports `released` only once every node let go
/// (the prefill side acknowledged first, then the decode side freed its pages), and
/// the tokens computed before the abort took effect are still readable.
#[test]
fn a_cancelled_request_is_released_only_after_both_nodes_acknowledged() {
    let m = load();
    let h = cluster(&m, 4096, 4096);
    let c = h.cluster().unwrap();
    let mut req = greedy(chat_prompt(&m, "Write a long story about the sea."), 400);
    req.ignore_eos = true;
    let mut rx = h.admit_and_submit(req).unwrap();
    let mut got = 0;
    while got < 3 {
        match rx.blocking_recv() {
            Some(StreamEvent::Token { .. }) => got += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert!(!rx.is_released(), "released while decoding");
    rx.cancel();
    let deadline = Instant::now() + Duration::from_secs(30);
    while !rx.is_released() {
        assert!(Instant::now() < deadline, "never released");
        std::thread::sleep(Duration::from_millis(2));
    }
    assert_eq!(
        c.counters()
            .released
            .load(std::sync::atomic::Ordering::Relaxed),
        1,
        "the protocol reached Released"
    );
    // Tokens that were already on their way stay readable; then the stream closes
    // without a final event (nobody asked for one).
    while let Some(ev) = rx.try_recv() {
        assert!(matches!(ev, StreamEvent::Token { .. }), "{ev:?}");
    }
    assert_pools_full(&h);
}

#[test]
fn the_prefill_node_caches_prompt_pages_and_a_session_returns_to_its_node() {
    // Two prefill nodes, one decode node. Each session (x-session-affinity key)
    // sends the same prompt twice: the second request reuses the prompt pages the
    // first left in its prefill node's cache, which needs the routing to send it to
    // that node again (an idle cluster would otherwise always pick node 0).
    let m = load();
    let h = EngineHandle::spawn_disaggregated(&m, &[cfg(4096), cfg(4096)], &[cfg(8192)]);
    let c = h.cluster().unwrap();
    let text = "Please remember these facts. ".repeat(30) + "Which fact came first?";
    let mut req = greedy(chat_prompt(&m, &text), 4);
    req.cache_namespace = Some([7; 32]);
    let n = req.prompt.len();
    let alone = solo(&m, greedy(req.prompt.clone(), 4));
    for key in 0..6u64 {
        let mut first = h.submit(h.admit(req.clone()).unwrap(), Some(key)).unwrap();
        let first = collect(&mut first);
        let mut again = h.submit(h.admit(req.clone()).unwrap(), Some(key)).unwrap();
        let again = collect(&mut again);
        for o in [&first, &again] {
            assert_eq!(
                (&o.ids, &o.text),
                (&alone.ids, &alone.text),
                "session {key}"
            );
        }
        let Some(StreamEvent::Done { usage, .. }) = &again.last else {
            panic!("session {key}: {:?}", again.last)
        };
        assert_eq!(usage.cached_tokens, (n - 1) / 16 * 16, "session {key}");
        assert_eq!(usage.prompt_tokens, n);
    }
    // Sessions live on both prefill nodes; decode nodes keep no cache; at rest every
    // page is free or cached, nothing is running.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let p: Vec<_> = (0..2).map(|i| c.node_stats(Role::Prefill, i)).collect();
        let d = c.node_stats(Role::Decode, 0);
        let at_rest = p.iter().all(|s| {
            s.free_pages + s.cached_pages == s.capacity_pages && s.running + s.waiting == 0
        }) && d.free_pages == d.capacity_pages
            && d.running + d.waiting == 0;
        if at_rest {
            assert!(p.iter().all(|s| s.cached_pages > 0), "{p:?}");
            assert_eq!(d.cached_pages, 0);
            break;
        }
        assert!(Instant::now() < deadline, "not at rest: {p:?} {d:?}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A commit whose first token is outside the vocabulary (a broken or hostile prefill
/// node) fails that request with an integrity error; the decode node does not panic,
/// frees the pages and keeps serving.
#[test]
fn a_commit_with_a_first_token_outside_the_vocabulary_fails_only_that_request() {
    let m = load();
    let h = cluster(&m, 4096, 4096);
    let c = h.cluster().unwrap();
    c.inject_fault(TransferFault::FirstTokenOutOfVocab);
    let mut rx = h
        .admit_and_submit(greedy(chat_prompt(&m, "What is the capital of France?"), 8))
        .unwrap();
    let o = collect(&mut rx);
    assert!(o.ids.is_empty(), "{o:?}");
    let e = serve_error(&o, ServeErrorKind::Integrity);
    assert!(e.contains("outside the vocabulary"), "{e}");
    assert_pools_full(&h);
    let req = greedy(chat_prompt(&m, "Hi"), 8);
    let alone = solo(&m, req.clone());
    assert_eq!(collect(&mut h.admit_and_submit(req).unwrap()), alone);
}

/// KV never moves between models: a cluster whose prefill engine runs one model and
/// whose decode engine runs another of the same shape (so the pages have the same
/// layout and bytes would fit; no deployment builds one, the test plants it) has the
/// decode node refuse the commit (the model fingerprints differ): no token is decoded
/// from the foreign KV, the request ends with an integrity error and both pools are
/// full again. The same pair with one model on both sides serves its solo answer.
#[test]
fn a_commit_of_kv_computed_by_another_model_is_refused() {
    use tessera_model::gguf_write::{requantize, Variant};
    use tessera_serving::cluster::PdCluster;
    let a = load();
    let path = std::env::temp_dir().join(format!("tessera-q4_0-{}.gguf", std::process::id()));
    let q4_0 = Variant::named("q4_0").unwrap().format;
    requantize(&model_path(), &path, q4_0).unwrap();
    let b = LoadedModel::load(&path).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(a.config().kv_layout(16), b.config().kv_layout(16));
    let mixed = EngineHandle::from_cluster(PdCluster::spawn_models(
        &[(a.clone(), cfg(4096))],
        &[(b.clone(), cfg(4096))],
    ));
    let req = greedy(chat_prompt(&a, "What is the capital of France?"), 8);
    let o = collect(&mut mixed.admit_and_submit(req.clone()).unwrap());
    assert!(o.ids.is_empty(), "{o:?}");
    let e = serve_error(&o, ServeErrorKind::Integrity);
    assert!(e.contains("another model"), "{e}");
    assert_pools_full(&mixed);
    let same = EngineHandle::from_cluster(PdCluster::spawn_models(
        &[(b.clone(), cfg(4096))],
        &[(b.clone(), cfg(4096))],
    ));
    assert_eq!(
        collect(&mut same.admit_and_submit(req.clone()).unwrap()),
        solo(&b, req)
    );
}

/// Page writes replayed into a request that is already decoding (its commit was
/// verified) are a protocol violation: they are never applied, and the request fails
/// with an integrity error rather than decode from pages its writer touched after
/// the commit. Other requests are not affected.
#[test]
fn a_write_into_pages_already_committed_fails_that_request_and_is_not_applied() {
    let m = load();
    let h = cluster(&m, 4096, 4096);
    let c = h.cluster().unwrap();
    c.tap_writes();
    let mut req = greedy(chat_prompt(&m, "Write a long story about the sea."), 400);
    req.ignore_eos = true;
    let mut rx = h.admit_and_submit(req).unwrap();
    let mut got = 0;
    while got < 3 {
        match rx.blocking_recv() {
            Some(StreamEvent::Token { .. }) => got += 1,
            other => panic!("unexpected {other:?}"),
        }
    }
    let writes = c.tapped_writes();
    assert!(!writes.is_empty());
    let before = c
        .counters()
        .link_violations
        .load(std::sync::atomic::Ordering::Relaxed);
    for w in writes {
        c.deliver_write(0, w);
    }
    let o = collect(&mut rx);
    let e = serve_error(&o, ServeErrorKind::Integrity);
    assert!(e.contains("page write"), "{e}");
    assert!(
        c.counters()
            .link_violations
            .load(std::sync::atomic::Ordering::Relaxed)
            > before
    );
    assert_pools_full(&h);
    let other = greedy(chat_prompt(&m, "Hi"), 8);
    let alone = solo(&m, other.clone());
    assert_eq!(collect(&mut h.admit_and_submit(other).unwrap()), alone);
}

/// Issue 10: the assigned writer of a reserved request aims a page write at a page
/// of another, running request whose tag it knows (it transferred that request).
/// The protocol allows writes only into the request's own reservation: the write
/// is refused as a violation (failing the writing request), never applied, and
/// the running request's output equals its solo run.
#[test]
fn a_write_aimed_at_another_requests_pages_is_refused_and_the_victim_is_untouched() {
    let m = load();
    let h = cluster(&m, 8192, 8192);
    let c = h.cluster().unwrap();
    c.tap_writes();
    let mut victim = greedy(chat_prompt(&m, "Write a long story about the sea."), 200);
    victim.ignore_eos = true;
    let alone = solo(&m, victim.clone());
    let mut victim_rx = h.admit_and_submit(victim).unwrap();
    let mut first = match victim_rx.blocking_recv() {
        Some(StreamEvent::Token { id, text, .. }) => (vec![id], text),
        other => panic!("unexpected {other:?}"),
    };
    let victim_pages = c.tapped_writes();
    let target = victim_pages.first().expect("the victim's page writes").dest;
    let victim_req = victim_pages[0].req;
    // A long prompt keeps the writing request reserved while its chunks are computed.
    let long = m
        .tokenizer
        .encode(
            &"the quick brown fox jumps over the lazy dog. ".repeat(150),
            false,
        )
        .unwrap();
    let mut writer_rx = h.admit_and_submit(greedy(long, 4)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let writer_req = loop {
        if let Some(w) = c.tapped_writes().into_iter().find(|w| w.req != victim_req) {
            break w.req;
        }
        assert!(
            Instant::now() < deadline,
            "no page write of the second request"
        );
        std::thread::sleep(Duration::from_millis(1));
    };
    let before = c
        .counters()
        .link_violations
        .load(std::sync::atomic::Ordering::Relaxed);
    let page_bytes = m.transformer.config().kv_layout(16).page_bytes();
    c.deliver_write(
        0,
        tessera_transfer::inproc::PageLanding {
            req: writer_req,
            dest: target,
            bytes: vec![0x5A; page_bytes],
        },
    );
    let w = collect(&mut writer_rx);
    let e = serve_error(&w, ServeErrorKind::Integrity);
    assert!(e.contains("outside the reservation"), "{e}");
    assert!(
        c.counters()
            .link_violations
            .load(std::sync::atomic::Ordering::Relaxed)
            > before
    );
    let rest = collect(&mut victim_rx);
    first.0.extend(rest.ids);
    first.1.push_str(&rest.text);
    let got = Streamed {
        ids: first.0,
        text: first.1,
        last: rest.last,
    };
    assert_eq!(got, alone);
    assert_pools_full(&h);
}

/// One forged writer-side input to a decode node.
#[derive(Debug, Clone)]
enum Forged {
    /// A protocol message, as if from the named prefill node.
    Msg { from: &'static str, msg: Msg },
    /// A page write from prefill node 0 with any page, tag and size (bytes).
    Write {
        req: u64,
        dest: DestPage,
        len: usize,
    },
}

fn forged(page_bytes: usize) -> impl proptest::strategy::Strategy<Value = Forged> {
    use proptest::prelude::*;
    let tag = (0u64..4, 0u64..64, 0u32..4, 0u32..8).prop_map(|(tenant, seq, epoch, b)| {
        tessera_kernels::PageTag {
            tenant,
            seq,
            epoch,
            logical_block: b,
        }
    });
    let dest = (0u32..300, tag).prop_map(|(page, tag)| DestPage { page, tag });
    // Requests that exist or existed (small ids) and ones that never did.
    let req = prop_oneof![0u64..64, any::<u64>()].prop_map(ReqId);
    let from = prop_oneof![Just("prefill-0"), Just("prefill-7")];
    let msg = prop_oneof![
        (
            req.clone(),
            any::<u32>(),
            proptest::collection::vec(
                (dest.clone(), any::<u32>())
                    .prop_map(|(dest, checksum)| PageCommit { dest, checksum }),
                0..6
            ),
            prop_oneof![0u32..49_152, any::<u32>()],
        )
            .prop_map(|(req, tokens, pages, first_token)| Msg::Commit {
                req,
                tokens,
                pages,
                first_token,
            }),
        req.clone().prop_map(|req| Msg::Renew { req }),
        req.clone().prop_map(|req| Msg::WriterQuiet { req }),
        // Messages a prefill node may never send to a decode node.
        req.clone().prop_map(|req| Msg::Committed { req }),
        req.clone().prop_map(|req| Msg::Abort { req }),
    ];
    prop_oneof![
        (from, msg).prop_map(|(from, msg)| Forged::Msg { from, msg }),
        (req, dest, prop_oneof![Just(true), Just(false)], 0usize..512).prop_map(
            move |(req, dest, whole, short)| Forged::Write {
                req: req.0,
                dest,
                // A whole page of the node's layout, or a wrong size.
                len: if whole { page_bytes } else { short },
            }
        ),
    ]
}

/// Issue 10, item 2: arbitrary writer-side traffic (messages a prefill node may and
/// may not send, for requests that exist and ones that never did, from the assigned
/// writer and from another node; page writes of any page, tag and size) never
/// panics the decode node: its pool comes back to full and the next request equals
/// its solo run.
#[test]
fn forged_writer_traffic_never_panics_the_decode_node_and_its_pool_recovers() {
    use proptest::test_runner::{Config, TestRunner};
    let m = load();
    let h = cluster(&m, 4096, 4096);
    let c = h.cluster().unwrap();
    let req = greedy(chat_prompt(&m, "Hi"), 6);
    let alone = solo(&m, req.clone());
    let page_bytes = m.transformer.config().kv_layout(16).page_bytes();
    let mut runner = TestRunner::new(Config {
        cases: 24,
        ..Config::default()
    });
    runner
        .run(
            &proptest::collection::vec(forged(page_bytes), 1..24),
            |inputs| {
                for f in inputs {
                    match f {
                        Forged::Msg { from, msg } => c.deliver_to_decode_from(0, msg, from),
                        Forged::Write { req, dest, len } => c.deliver_write(
                            0,
                            tessera_transfer::inproc::PageLanding {
                                req,
                                dest,
                                bytes: vec![0xA5; len],
                            },
                        ),
                    }
                }
                assert_pools_full(&h);
                let got = collect(&mut h.admit_and_submit(req.clone()).unwrap());
                proptest::prop_assert!(got == alone, "{got:?}");
                assert_pools_full(&h);
                Ok(())
            },
        )
        .unwrap();
}
