//! Draining nodes, with real `tessera node` and `tessera serve --config` processes
//! on loopback: a draining decode node or prefill node refuses new work (from the
//! gateway, and from a raw gateway-identity client: `common/links.rs`) and ends or
//! finishes what it holds, and `tessera node drain` lets a running prefill finish;
//! each node exits 0. SIGTERM's drain with two decode nodes: `node_loss.rs`.
//!
//! Every wait is bounded by a deadline; nothing asserts how fast anything runs.

mod common;

use common::links::*;
use common::metrics::*;
use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// `r` is a node's refusal of new work because it drains: rejected by `by`
/// (`Decode`, `Prefill`) as busy (retryable), its message saying so.
#[track_caller]
fn assert_refused_as_draining(r: &Value, by: &str) {
    assert_eq!(r["type"], "rejected", "{r}");
    assert_eq!(r["by"], by, "{r}");
    assert_eq!(r["reason"]["kind"], "Busy", "{r}");
    assert!(
        r["reason"]["message"]
            .as_str()
            .unwrap()
            .contains("draining"),
        "{r}"
    );
}

/// A decode node refuses new work once its drain began, and the gateway serves what
/// it refused on the other decode node. Decode 0's pool is full (one request holds
/// a whole context window) when a request is routed to it and waits there for pages;
/// SIGTERM: the waiting request is refused by the node (it held nothing) and gets its
/// solo answer from decode 1; a `Prealloc` a raw gateway-identity client sends after
/// the node said it drains is refused as draining (busy, retryable). The running
/// request is ended at once for a move of its KV (issue 36), which cannot start before
/// decode 0's 10 s deadline (decode 1 has no room for its whole context window): the
/// node keeps the KV until then and exits 0, and the request is continued by a
/// prefill node on decode 1 (its stream goes on, no error event). New requests get
/// their solo answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_decode_node_refuses_new_work_and_the_other_serves_it() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d0, d1) = (free_port(), free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d0, d1], (CONTEXT, CONTEXT));
    let (mut decode0, metrics0) = start_node_with_metrics(
        dir.path(),
        &config,
        "decode",
        d0,
        &["--drain-timeout-secs", "10"],
    )
    .await;
    let _decode1 = start_node(dir.path(), &config, "decode", d1).await;
    let _prefill = start_node(dir.path(), &config, "prefill", p).await;
    let gw = start_config_gateway(dir.path(), &config, "data", "gateway.log", &[]).await;
    let short = greedy(12);
    let solo = gw.run_when_up(&short).await["result"].clone();
    let prompt = gw.run_when_up(&endless(1)).await["result"]["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap() as usize;
    // Routing: fewest outstanding, ties to the lower index. `a` fills decode 0's pool
    // (prompt + max_tokens = the whole pool), `b` goes to decode 1, `c` to decode 0,
    // where it waits for pages.
    let mut a = gw.stream(&endless(CONTEXT - prompt)).await;
    a.read_texts(2).await;
    let mut b = gw.stream(&endless(4000)).await;
    b.read_texts(2).await;
    assert!(a.tokens() >= 2 && b.tokens() >= 2, "{}", logs(dir.path()));
    let c = gw.spawn_run(&short);
    let queue = format!(r#"tessera_queue_depth{{node="127.0.0.1:{d0}",role="decode"}}"#);
    let deadline = Instant::now() + REQUEST;
    while metric(&metrics0, &queue).await < 1.0 {
        assert!(
            Instant::now() < deadline,
            "the third request never waited at decode 0\n{}",
            logs(dir.path())
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let certs = dir.path().join("certs");
    let as_gateway = client(&certs.join("ca.pem"), Some(&identity(&certs, "gateway")));
    let mut raw = Raw::open(d0, &node_name("decode", d0), &as_gateway, "Coordinator").await;

    signal(&decode0, "-TERM");
    // The waiting request: refused at decode 0, served by decode 1.
    let (status, v) = tokio::time::timeout(REQUEST, c).await.unwrap().unwrap();
    assert_eq!(status, 200, "{v}\n{}", logs(dir.path()));
    assert_eq!(answer(&v["result"]), answer(&solo));
    // A Prealloc after the node said it drains: refused as draining.
    let status = raw.until(|h| !h["status"].is_null()).await;
    assert_eq!(status, Some(json!({"status": {"draining": true}})));
    let req = raw_req(1);
    raw.send(&raw_prealloc(
        req,
        20,
        4,
        (20, 4),
        &format!("127.0.0.1:{p}"),
    ))
    .await;
    let r = raw.reply(req).await;
    assert_refused_as_draining(&r, "Decode");
    drop(raw);
    // The running request: ended at once for a move of its KV, which cannot start
    // (decode 1 has no room for its whole context window while `b` runs): decode 0
    // keeps its KV until its deadline, exits 0, and the request is continued by a
    // prefill node instead.
    let status = tokio::time::timeout(START, decode0.wait())
        .await
        .expect("the drained node exits")
        .unwrap();
    assert!(status.success(), "{status:?}\n{}", logs(dir.path()));
    let moved = "moving the request's KV from the draining decode node to another";
    let continued = "continuing the request on other nodes after the tokens its client has";
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let log = std::fs::read_to_string(dir.path().join("gateway.log")).unwrap();
        if log.contains(moved) && log.contains(continued) {
            break;
        }
        assert!(Instant::now() < deadline, "{}", logs(dir.path()));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // `b` leaves: decode 1 takes the continuation (it fills a whole context window:
    // read 20 more tokens, not all of them), then serves new requests once it ends.
    drop(b);
    let texts = |s: &Sse| s.events.iter().filter(|e| matches!(e, Ev::Text(_))).count();
    let before = texts(&a);
    a.read_texts(before + 20).await;
    assert!(
        texts(&a) >= before + 20 && !a.has_error(),
        "{:?}\n{}",
        a.events.last(),
        logs(dir.path())
    );
    drop(a);
    for _ in 0..3 {
        let (status, v) = gw.run(&short).await;
        assert_eq!(status, 200, "{v}\n{}", logs(dir.path()));
        assert_eq!(answer(&v["result"]), answer(&solo));
    }
}

/// A drain that moves KV lets a request whose pages are reserved commit first, then
/// moves it (issue 36; the first cut ended such requests at once, and their commits
/// were refused as late: 5 of 1,000 requests failed in a drain storm). A raw
/// gateway-identity client reserves pages on decode 0 for two requests written by a
/// raw prefill identity, one in a prefix-cache namespace and one without; SIGTERM;
/// the writer lands and commits both: each commit is verified, the request decodes
/// and is ended at once, the first as `moving` (its KV kept for its move), the other
/// as `drained` (nothing to keep). The node waits for the kept request's move while
/// the gateway is linked, and exits 0 once the gateway says it will not move it
/// (`Unkeep`), long before its 600 s deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_moving_drain_lets_reserved_requests_commit_then_ends_them_for_their_moves() {
    let (page_bytes, _) = model_shape();
    let dir = tempfile::tempdir().unwrap();
    let (p, d0, d1) = (free_port(), free_port(), free_port());
    // Decode 1 is in the file (decode 0 can move to it) but never started.
    let config = write_config(dir.path(), free_port(), p, &[d0, d1], (CONTEXT, CONTEXT));
    let mut decode0 = start_node_with(
        dir.path(),
        &config,
        "decode",
        d0,
        &["--drain-timeout-secs", "600"],
        &[],
    )
    .await;
    let (as_gateway, as_writer) = gateway_and_writer(dir.path(), p);
    let name = node_name("decode", d0);
    let writer = format!("127.0.0.1:{p}");
    let mut gw = Raw::open(d0, &name, &as_gateway, "Coordinator").await;
    let (kept, plain) = (raw_req(1), raw_req(2));
    let mut pages = Vec::new();
    for (req, namespace) in [(kept, Some([9; 32])), (plain, None)] {
        gw.send(&raw_prealloc_in(
            req,
            20,
            4000,
            (20, 4000),
            &writer,
            namespace,
        ))
        .await;
        pages.push(descriptor(&gw.reply(req).await));
    }
    signal(&decode0, "-TERM");
    let status = gw.until(|h| !h["status"].is_null()).await;
    assert_eq!(status, Some(json!({"status": {"draining": true}})));
    let zeros = vec![0u8; page_bytes];
    let mut w = Raw::open(d0, &name, &as_writer, "Prefill").await;
    for ((req, kind), pages) in [(kept, "moving"), (plain, "drained")]
        .into_iter()
        .zip(&pages)
    {
        for dest in pages {
            w.send(&land(req, dest, &zeros)).await;
        }
        w.send(&raw_commit(req, 20, pages, &zeros, 100)).await;
        let r = gw.reply(req).await;
        assert_eq!(r["type"], "committed", "{r}\n{}", logs(dir.path()));
        let r = gw.reply(req).await;
        assert_eq!(r["type"], "finished", "{r}");
        assert_eq!(r["outcome"]["Failed"]["reason"]["kind"], kind, "{r}");
    }
    // The kept request's move may still come while this gateway is linked ...
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        decode0.try_wait().unwrap().is_none(),
        "the node exited before the kept request's move was settled\n{}",
        logs(dir.path())
    );
    // ... until the gateway says it will not move it.
    gw.send(&frame(&json!({"unkeep": {"req": kept}}), &[]))
        .await;
    let status = tokio::time::timeout(START, decode0.wait())
        .await
        .expect("the drained node exits")
        .unwrap();
    assert!(status.success(), "{status:?}\n{}", logs(dir.path()));
}

/// A prefill node refuses new work once its drain began and finishes what it holds.
/// A raw gateway-identity client hands it a request whose transfer cannot complete
/// yet (its decode node's port accepts connections but never answers the TLS
/// handshake), then asks it to drain on the same link: the node says it drains, a
/// second `Prefill` is refused as draining (busy, retryable) before anything is
/// computed, the held request fails once its transfer does, and the node exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_prefill_node_refuses_new_work_and_finishes_what_it_holds() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = (free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
    // The decode node's port: connections queue in the backlog, nothing answers.
    let _silent = std::net::TcpListener::bind(("127.0.0.1", d)).unwrap();
    let mut prefill = start_node(dir.path(), &config, "prefill", p).await;
    let certs = dir.path().join("certs");
    let as_gateway = client(&certs.join("ca.pem"), Some(&identity(&certs, "gateway")));
    let mut raw = Raw::open(p, &node_name("prefill", p), &as_gateway, "Coordinator").await;
    // Held: the node carries it until its transfer fails (in order on this link, so
    // before the drain below).
    let (held, late) = (raw_req(1), raw_req(2));
    raw.send(&raw_prefill(held)).await;
    raw.send(&frame(&json!("drain"), &[])).await;
    let status = raw.until(|h| !h["status"].is_null()).await;
    assert_eq!(
        status,
        Some(json!({"status": {"draining": true}})),
        "{}",
        logs(dir.path())
    );
    raw.send(&raw_prefill(late)).await;
    let r = raw.reply(late).await;
    assert_refused_as_draining(&r, "Prefill");
    let r = raw
        .until(|h| h["control"]["msg"]["req"] == held)
        .await
        .unwrap_or_else(|| panic!("no reply about the held request\n{}", logs(dir.path())));
    let r = &r["control"]["msg"];
    assert_eq!(r["type"], "prefill_failed", "{r}\n{}", logs(dir.path()));
    let status = tokio::time::timeout(START, prefill.wait())
        .await
        .expect("the drained node exits")
        .unwrap();
    assert!(status.success(), "{status:?}\n{}", logs(dir.path()));
}

/// `tessera node drain ADDR --config FILE --wait-secs N` on the prefill node while it
/// computes a long prompt (its drain deadline is far): the gateway is not ready (no other prefill node) and
/// refuses new requests with 503, the running request completes with its solo
/// answer, the node exits 0 and the command reports it; a restarted node serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_drain_lets_a_running_prefill_finish_then_the_node_exits() {
    // A drain deadline no prefill here reaches: the running request must finish.
    let mut dep = Deployment::start_with(&["--drain-timeout-secs", "240"]).await;
    let body = prompt_of_words(1000, 4);
    let solo = dep.gateway.run_when_up(&body).await["result"].clone();
    let running = dep.gateway.spawn_run(&body);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let drain = tokio::process::Command::new(BIN)
        .args([
            "node",
            "drain",
            &dep.prefill_addr,
            "--config",
            dep.config.to_str().unwrap(),
            "--wait-secs",
            "240",
        ])
        .kill_on_drop(true)
        .output();
    let drain = tokio::spawn(drain);
    // While it drains: not ready, and a new request is refused.
    let deadline = Instant::now() + START;
    loop {
        let r = reqwest::get(format!("{}/readyz", dep.gateway.base))
            .await
            .unwrap()
            .status();
        if r == 503 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the gateway stayed ready while its only prefill node drained"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, v) = dep.gateway.run(&greedy(4)).await;
    assert_eq!(status, 503, "{v}");
    let (status, v) = tokio::time::timeout(REQUEST, running)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(status, 200, "{v}\n{}", dep.logs());
    assert_eq!(answer(&v["result"]), answer(&solo));
    let out = tokio::time::timeout(REQUEST, drain)
        .await
        .unwrap_or_else(|_| panic!("the drain did not end\n{}", dep.logs()))
        .unwrap()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("drained and exited"), "{stdout}");
    let node = dep.prefill.as_mut().unwrap();
    let status = tokio::time::timeout(START, node.wait())
        .await
        .unwrap()
        .unwrap();
    assert!(status.success(), "{status:?}");
    dep.prefill = None;
    dep.restart("prefill").await;
    let v = dep.gateway.run_when_up(&greedy(4)).await;
    assert!(!v["result"]["response"].as_str().unwrap().is_empty(), "{v}");
    dep.pool_is_free().await;
}
