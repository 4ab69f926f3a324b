//! Frames forged by holders of valid identities of the cluster CA, with real
//! `tessera node` and `tessera serve --config` processes on loopback. Raw clients
//! (`common/links.rs`) drive the protocol themselves: as the gateway identity they
//! reserve pages for requests of their own (ids they choose), and as a prefill
//! identity they write and commit those pages; so their page writes and commits can
//! be aimed at live reservations whose pages and state they know. A rogue node with a
//! listed decode identity, dialed by the gateway, injects stream events and control
//! messages for requests routed to another node. The tenant's own requests (ids and
//! pages only its gateway knows) are what must stay correct throughout: its answers
//! must equal the solo answer.
//!
//! Every wait is bounded by a deadline; nothing asserts how fast anything runs.

mod common;

use common::links::*;
use common::metrics::*;
use common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Page writes and commits from raw clients holding valid identities of the cluster
/// CA, aimed at live reservations of a real decode node while a tenant is served:
/// a `Prealloc` whose counts disagree with its body is refused (no panic); a
/// full-page write from a listed prefill identity, or a listed decode identity (a
/// decode node writes when it moves a drained request's KV), that is not the
/// request's writer is refused before it touches anything (the request later commits its own bytes,
/// and keeps decoding when the same stranger writes after the commit); a full-page
/// write from the writer after its commit was verified is refused and ends that
/// request; a write aimed at another reservation's page is refused and that page
/// keeps its bytes (its commit verifies; the aimer's commit fails); a commit whose
/// first token is outside the vocabulary fails its request with an integrity error.
/// Each refused write cuts its link and counts in `tessera_node_link_violations_total`;
/// the node never exits, the tenant's answers equal its solo answer, and the decode
/// pool is whole at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_writes_and_commits_at_live_reservations_are_refused_while_a_tenant_is_served() {
    let (page_bytes, vocab) = model_shape();
    let dir = tempfile::tempdir().unwrap();
    let (p, stranger, d, other) = (free_port(), free_port(), free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
    // A second prefill node and a second decode node in the file (never started):
    // identities the decode node accepts as writers (a decode node writes when it
    // moves a drained request's KV), but no request's writer.
    let text = std::fs::read_to_string(&config)
        .unwrap()
        .replace(
            &format!("nodes = [\"127.0.0.1:{p}\"]"),
            &format!("nodes = [\"127.0.0.1:{p}\", \"127.0.0.1:{stranger}\"]"),
        )
        .replace(
            &format!("nodes = [\"127.0.0.1:{d}\"]"),
            &format!("nodes = [\"127.0.0.1:{d}\", \"127.0.0.1:{other}\"]"),
        );
    std::fs::write(&config, text).unwrap();
    let certs = dir.path().join("certs");
    issue_certs(&config, &certs);
    let (mut dep, metrics) = Deployment::start_metered(dir, config, p, d).await;
    let body = greedy(12);
    let solo = dep.gateway.run_when_up(&body).await["result"].clone();
    let (stop, tenant) = serve_tenant(&dep.gateway, body, solo);

    let ca = certs.join("ca.pem");
    let as_gateway = client(&ca, Some(&identity(&certs, "gateway")));
    let as_writer = client(
        &ca,
        Some(&identity(&certs, &format!("prefill-127.0.0.1-{p}"))),
    );
    let as_stranger = client(
        &ca,
        Some(&identity(&certs, &format!("prefill-127.0.0.1-{stranger}"))),
    );
    let decode_name = node_name("decode", d);
    let writer = format!("127.0.0.1:{p}");
    // Summed over reasons (a series per reason).
    let violations =
        format!(r#"tessera_node_link_violations_total{{node="127.0.0.1:{d}",role="decode","#);
    let mut counted = metric_sum(&metrics, &violations).await;
    // Asserts one more violation was counted (it is, before the link is cut).
    let mut one_more = |now: f64, what: &str| {
        assert_eq!(now, counted + 1.0, "{what}: not counted once");
        counted = now;
    };
    let mut gw = Raw::open(d, &decode_name, &as_gateway, "Coordinator").await;
    let zeros = vec![0u8; page_bytes];
    let forged = vec![0x11u8; page_bytes];

    // A Prealloc whose counts disagree with its body (prompt, then max_tokens): refused
    // as invalid, nothing reserved, the link and the node unharmed.
    for (i, counts) in [(20, 4), (30, 5)].into_iter().enumerate() {
        let req = raw_req(i as u64);
        gw.send(&raw_prealloc(req, 30, 4, counts, &writer)).await;
        let r = gw.reply(req).await;
        assert_eq!(r["type"], "rejected", "{r}");
        assert_eq!(r["reason"]["kind"], "Invalid", "{r}");
    }

    // R1: 20 prompt tokens (two pages), a long decode.
    let r1 = raw_req(10);
    gw.send(&raw_prealloc(r1, 20, 4000, (20, 4000), &writer))
        .await;
    let pages1 = descriptor(&gw.reply(r1).await);
    assert_eq!(pages1.len(), 2);
    // A full page from a listed prefill identity that is not R1's writer: refused.
    let mut s = Raw::open(d, &decode_name, &as_stranger, "Prefill").await;
    s.send(&land(r1, &pages1[0], &forged)).await;
    s.assert_cut("a page from a prefill identity that is not the writer")
        .await;
    one_more(metric_sum(&metrics, &violations).await, "stranger's page");
    // The same from a listed decode identity: refused, it is not R1's writer either.
    let as_decode = client(
        &ca,
        Some(&identity(&certs, &format!("decode-127.0.0.1-{other}"))),
    );
    let mut s = Raw::open(d, &decode_name, &as_decode, "Prefill").await;
    s.send(&land(r1, &pages1[0], &forged)).await;
    s.assert_cut("a page from a decode identity that is not the writer")
        .await;
    one_more(
        metric_sum(&metrics, &violations).await,
        "decode identity's page",
    );
    // The writer writes and commits R1's pages: the commit verifies, so the
    // stranger's page never landed.
    let mut w = Raw::open(d, &decode_name, &as_writer, "Prefill").await;
    for dest in &pages1 {
        w.send(&land(r1, dest, &zeros)).await;
    }
    w.send(&raw_commit(r1, 20, &pages1, &zeros, 100)).await;
    let r = gw.reply(r1).await;
    assert_eq!(r["type"], "committed", "{r}\n{}", dep.logs());
    // The stranger again, now that R1 decodes: refused, and R1 keeps decoding (a
    // stranger's refused frame ends nothing but its own link).
    let mut s = Raw::open(d, &decode_name, &as_stranger, "Prefill").await;
    s.send(&land(r1, &pages1[1], &forged)).await;
    s.assert_cut("a stranger's page after the commit").await;
    one_more(
        metric_sum(&metrics, &violations).await,
        "stranger's late page",
    );
    // The writer itself after its commit was verified: refused, and R1 ends with an
    // integrity failure that names the writer's late page (not the stranger's).
    w.send(&land(r1, &pages1[1], &forged)).await;
    w.assert_cut("the writer's page after its commit").await;
    one_more(
        metric_sum(&metrics, &violations).await,
        "writer's late page",
    );
    let r = gw.reply(r1).await;
    assert_eq!(r["type"], "finished", "{r}");
    let reason = &r["outcome"]["Failed"]["reason"];
    assert_eq!(reason["kind"], "integrity", "{r}");
    assert!(
        reason["message"].as_str().unwrap().contains("not awaiting"),
        "R1 was ended by another frame than its writer's late page: {r}"
    );
    assert!(gw.events(r1) >= 1, "R1 never decoded");

    // R3 aims a page at R4's page, which R4's writer already wrote: refused, and R4's
    // page keeps its bytes (R4's commit verifies) while R3's commit fails.
    let (r3, r4) = (raw_req(11), raw_req(12));
    gw.send(&raw_prealloc(r3, 20, 4, (20, 4), &writer)).await;
    let pages3 = descriptor(&gw.reply(r3).await);
    gw.send(&raw_prealloc(r4, 20, 4, (20, 4), &writer)).await;
    let pages4 = descriptor(&gw.reply(r4).await);
    let mut w = Raw::open(d, &decode_name, &as_writer, "Prefill").await;
    for dest in &pages4 {
        w.send(&land(r4, dest, &zeros)).await;
    }
    w.send(&land(r3, &pages4[0], &forged)).await;
    w.assert_cut("a page aimed at another reservation").await;
    one_more(metric_sum(&metrics, &violations).await, "page aimed at R4");
    let mut w = Raw::open(d, &decode_name, &as_writer, "Prefill").await;
    w.send(&raw_commit(r4, 20, &pages4, &zeros, 100)).await;
    let r = gw.reply(r4).await;
    assert_eq!(r["type"], "committed", "R4's page was touched: {r}");
    for dest in &pages3 {
        w.send(&land(r3, dest, &zeros)).await;
    }
    w.send(&raw_commit(r3, 20, &pages3, &zeros, 100)).await;
    let r = gw.reply(r3).await;
    assert_eq!(r["type"], "commit_failed", "{r}");
    assert!(!r["reason"]["ForeignWrite"].is_null(), "{r}");
    let r = gw.reply(r4).await;
    assert_eq!(r["type"], "finished", "{r}");
    assert_eq!(r["outcome"], "Completed", "{r}");

    // R5's commit names a first token outside the vocabulary: it verifies (the pages
    // are right), and the request fails with an integrity error; the node lives on.
    let r5 = raw_req(13);
    gw.send(&raw_prealloc(r5, 20, 4, (20, 4), &writer)).await;
    let pages5 = descriptor(&gw.reply(r5).await);
    for dest in &pages5 {
        w.send(&land(r5, dest, &zeros)).await;
    }
    w.send(&raw_commit(r5, 20, &pages5, &zeros, vocab)).await;
    let r = gw.reply(r5).await;
    assert_eq!(r["type"], "finished", "{r}");
    let reason = &r["outcome"]["Failed"]["reason"];
    assert_eq!(reason["kind"], "integrity", "{r}");
    assert!(
        reason["message"].as_str().unwrap().contains("vocabulary"),
        "{r}"
    );
    assert_eq!(
        metric_sum(&metrics, &violations).await,
        counted,
        "a valid frame counted"
    );

    // The tenant was served correctly throughout, the node never exited, and the
    // decode pool is whole.
    stop.store(true, Ordering::Release);
    let served = tenant
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}\n{}", dep.logs()));
    assert!(served >= 1, "the tenant got no answer during the attacks");
    let decode = dep.decode.as_mut().unwrap();
    assert!(decode.try_wait().unwrap().is_none(), "{}", dep.logs());
    drop((gw, w));
    dep.pool_is_free().await;
}

/// The id of the newest request the node that logs to `log` took from a gateway
/// (its debug line `a new request from a gateway`, `req=ReqId(N)`).
fn newest_req(log: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(log).ok()?;
    let line = text
        .lines()
        .rev()
        .find(|l| l.contains("a new request from a gateway"))?;
    let (_, rest) = line.split_once("ReqId(")?;
    rest.split(')').next()?.parse().ok()
}

/// A decode identity is believed only about the requests routed to its own link. A
/// rogue node holding a valid decode certificate of the cluster CA (a listed node's
/// identity: what a stolen node key or a reload adding a hostile node gives) is
/// dialed by the gateway, welcomed as draining (so nothing is routed to it), and
/// then injects, one per link, stream events and control messages for the live
/// requests of a tenant served by the honest decode node (ids read from that node's
/// debug log: an attacker who knows them, the strongest case), for a neighbour id,
/// messages its role never sends, and an answer to a cache question never asked.
/// Each is dropped, counted in
/// `tessera_node_link_violations_total{reason}` (exported at 0 before the first) and
/// `tessera_node_frames_rejected_total`, and cuts the rogue's link; the tenant's
/// answers stay byte-identical to its solo answer throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rogue_decode_identity_cannot_write_into_another_nodes_requests() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d, f) = (free_port(), free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d, f], (CONTEXT, CONTEXT));
    let certs = dir.path().join("certs");
    let (cert, key) = identity(&certs, &format!("decode-127.0.0.1-{f}"));
    let acceptor = tls_server(&cert, &key);
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", f))
        .await
        .unwrap();
    // The rogue: welcomes each link the gateway opens (as draining, with the model
    // the gateway names), keeps it alive, writes one injection on it when told, and
    // reports whether the gateway then cut the link.
    // An injection is built from the newest victim id at the moment it is written.
    type Attack = Box<dyn Fn(u64) -> Vec<u8> + Send>;
    type Injection = (Attack, tokio::sync::oneshot::Sender<bool>);
    let log = dir.path().join("decode.log");
    let victims = log.clone();
    let (inject, mut injections) = tokio::sync::mpsc::channel::<Injection>(1);
    let rogue = tokio::spawn(async move {
        let ping = frame(&json!("ping"), &[]);
        let mut links = 0;
        'links: loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return links;
            };
            let Ok(mut s) = acceptor.accept(tcp).await else {
                continue;
            };
            let Some(h) = first_frame(&mut s).await else {
                continue;
            };
            if h["hello"].is_null() {
                continue;
            }
            let welcome = json!({"welcome": {"incarnation": 7, "draining": true,
                                             "model": h["hello"]["model"]}});
            if s.write_all(&frame(&welcome, &[])).await.is_err() {
                continue;
            }
            links += 1;
            let (attack, done) = loop {
                tokio::select! {
                    m = injections.recv() => match m {
                        Some(m) => break m,
                        None => return links,
                    },
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {
                        if s.write_all(&ping).await.is_err() {
                            continue 'links;
                        }
                    }
                }
            };
            // A live victim id: the newest request the honest decode node took.
            let req = newest_req(&victims).unwrap_or(1);
            let _ = s.write_all(&attack(req)).await;
            // Still pinging (a silent link would be cut as dead, not for this).
            let deadline = Instant::now() + REFUSAL;
            let ended = loop {
                if Instant::now() > deadline {
                    break false;
                }
                let mut first = [0u8; 1];
                let wait = Duration::from_millis(500);
                match tokio::time::timeout(wait, s.read_exact(&mut first)).await {
                    Err(_) => {
                        if s.write_all(&ping).await.is_err() {
                            break true;
                        }
                    }
                    Ok(Err(_)) => break true,
                    Ok(Ok(_)) => {
                        if read_frame_after(first[0], &mut s).await.is_err() {
                            break true;
                        }
                    }
                }
            };
            let _ = done.send(ended);
        }
    });
    let debug = [("RUST_LOG", "warn,tessera_serving=debug")];
    let _decode = start_node_with(dir.path(), &config, "decode", d, &[], &debug).await;
    let _prefill = start_node(dir.path(), &config, "prefill", p).await;
    let token = "metrics-7Qx2kP9vL4nR8sT1wZ6yHcJ3mB5dF0gA";
    let gw = start_config_gateway(
        dir.path(),
        &config,
        "data",
        "gateway.log",
        &["--metrics-token", token],
    )
    .await;
    let series = |reason: &str| {
        format!(
            r#"tessera_node_link_violations_total{{node="gateway",role="coordinator",reason="{reason}"}}"#
        )
    };
    let rejected = r#"tessera_node_frames_rejected_total{node="gateway",role="coordinator"}"#;
    for reason in ["not_routed", "wrong_sender", "frame_kind"] {
        assert_eq!(
            gateway_metric(&gw, token, &series(reason)).await,
            (0.0, true),
            "{reason} is exported at 0 before any violation"
        );
    }
    assert_eq!(gateway_metric(&gw, token, rejected).await, (0.0, true));

    let body = endless(64);
    let solo = gw.run_when_up(&body).await["result"].clone();
    let (stop, tenant) = serve_tenant(&gw, body, solo);
    let token_event = |req: u64, text: &str| {
        frame(
            &json!({"event": {"req": req,
                              "event": {"type": "token", "id": 13, "text": text}}}),
            &[],
        )
    };
    let control = |msg: Value| frame(&json!({"control": {"msg": msg}}), &[]);
    // (what, the violation's reason, the frame for a victim's id).
    let attacks: Vec<(&str, &str, Attack)> = vec![
        (
            "an injected token in a victim's stream",
            "not_routed",
            Box::new(move |req| token_event(req, "<<INJECTED>>")),
        ),
        (
            "an early end of a victim's stream",
            "not_routed",
            Box::new(move |req| {
                frame(
                    &json!({"event": {"req": req, "event": {"type": "done", "stop": true,
                        "prompt_tokens": 1, "completion_tokens": 1, "ttft_us": 1, "tpot_us": 1}}}),
                    &[],
                )
            }),
        ),
        (
            "a victim's Finished",
            "not_routed",
            Box::new(move |req| {
                control(json!({"type": "finished", "req": req, "outcome": "Completed"}))
            }),
        ),
        (
            "a victim's CommitFailed",
            "not_routed",
            Box::new(move |req| {
                control(json!({"type": "commit_failed", "req": req, "reason": "UnknownRequest"}))
            }),
        ),
        (
            "an injected token for a neighbour id",
            "not_routed",
            Box::new(move |req| token_event(req.wrapping_add(1), "<<INJECTED>>")),
        ),
        (
            // A decode node also writes, as a draining node moving KV: believed
            // only about requests whose writer side is routed to its link.
            "a writer's message from a decode identity about a request it does not write",
            "not_routed",
            Box::new(move |req| {
                control(json!({"type": "abort_ack", "req": req, "from": "Prefill"}))
            }),
        ),
        (
            "a coordinator's message from a decode identity",
            "wrong_sender",
            Box::new(move |req| control(json!({"type": "abort", "req": req}))),
        ),
        (
            "an answer to a cache question never asked (a forged purge confirmation)",
            "not_routed",
            Box::new(move |_| {
                frame(
                    &json!({"cache_answer": {"id": 1u64 << 60,
                                             "answer": {"op": "purged", "freed": 1, "poisoned": 0,
                                                        "host": 0, "disk": 0}}}),
                    &[],
                )
            }),
        ),
    ];
    assert!(newest_req(&log).is_some(), "no request id in {log:?}");
    let injected = attacks.len();
    for (what, reason, attack) in attacks {
        let before = gateway_metric(&gw, token, &series(reason)).await.0;
        let (done, cut) = tokio::sync::oneshot::channel();
        inject.send((attack, done)).await.unwrap();
        let cut = tokio::time::timeout(REQUEST, cut).await;
        assert!(
            matches!(cut, Ok(Ok(true))),
            "{what}: the gateway kept the rogue's link open"
        );
        let after = gateway_metric(&gw, token, &series(reason)).await.0;
        assert_eq!(after, before + 1.0, "{what}: not counted once as {reason}");
    }
    stop.store(true, Ordering::Release);
    let served = tenant.await.unwrap();
    assert!(
        matches!(served, Ok(n) if n >= 1),
        "the tenant's answers changed: {served:?}\n{}",
        logs(dir.path())
    );
    let (rejected, _) = gateway_metric(&gw, token, rejected).await;
    assert!(rejected >= injected as f64, "frames_rejected: {rejected}");
    drop(inject);
    rogue.abort();
}

/// A deployment with the tenant's solo answer to `greedy(4)`, and raw-client
/// connectors holding the gateway's and the prefill node's identities.
struct Identities {
    dep: Deployment,
    p: u16,
    d: u16,
    solo: Value,
    as_gateway: tokio_rustls::TlsConnector,
    as_prefill: tokio_rustls::TlsConnector,
}

impl Identities {
    async fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (p, d) = (free_port(), free_port());
        let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
        let certs = dir.path().join("certs");
        let (dep, _metrics) = Deployment::start_metered(dir, config, p, d).await;
        let solo = dep.gateway.run_when_up(&greedy(4)).await["result"].clone();
        let ca = certs.join("ca.pem");
        let as_gateway = client(&ca, Some(&identity(&certs, "gateway")));
        let as_prefill = client(
            &ca,
            Some(&identity(&certs, &format!("prefill-127.0.0.1-{p}"))),
        );
        Self {
            dep,
            p,
            d,
            solo,
            as_gateway,
            as_prefill,
        }
    }
}

/// Cache questions on node links (`cache` frames: the purge and report of the cache
/// API): a gateway identity's question is answered by the node, a prefill identity's
/// is refused at a decode node and cuts its link, and the tenant is served as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_gateway_identity_may_ask_a_node_about_its_cache() {
    let ids = Identities::start().await;
    let (dep, p, d, body, solo) = (&ids.dep, ids.p, ids.d, greedy(4), ids.solo.clone());
    let (as_gateway, as_prefill) = (&ids.as_gateway, &ids.as_prefill);
    let ask = |id: u64, op: &str| {
        frame(
            &json!({"cache": {"id": id, "query": {"op": op, "tenant": 1}}}),
            &[],
        )
    };

    let mut gw = Raw::open(p, &node_name("prefill", p), as_gateway, "Coordinator").await;
    gw.send(&ask(9, "report")).await;
    let a = gw.until(|h| h["cache_answer"]["id"] == 9).await;
    let a = a.unwrap_or_else(|| panic!("no answer\n{}", dep.logs()));
    assert_eq!(a["cache_answer"]["answer"]["op"], "report", "{a}");
    assert!(a["cache_answer"]["answer"]["pool"].is_u64(), "{a}");

    let mut s = Raw::open(d, &node_name("decode", d), as_prefill, "Prefill").await;
    s.send(&ask(1, "purge")).await;
    s.assert_cut("a cache question from a prefill identity")
        .await;

    let (st, again) = dep.gateway.run(&body).await;
    let answer = (st, &again["result"]["response"]);
    assert_eq!(answer, (200, &solo["response"]), "{}", dep.logs());
}

/// LoRA adapter files on node links (`adapter` frames, issue 38): from a prefill
/// identity, empty, or not matching the SHA-256 they announce, each cuts its link;
/// the node keeps serving the tenant as before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_gateway_identity_may_send_adapters_and_a_bad_one_cuts_its_link() {
    let ids = Identities::start().await;
    let (dep, p, d, body, solo) = (&ids.dep, ids.p, ids.d, greedy(4), ids.solo.clone());
    let (as_gateway, as_prefill) = (&ids.as_gateway, &ids.as_prefill);
    let adapter = |sha: &str, payload: &[u8]| {
        frame(
            &json!({"adapter": {"id": "ft-x", "sha256": sha, "offset": 0, "total": 4}}),
            payload,
        )
    };
    // SHA-256 of "abcd".
    let sha = "88d4266fd4e6338d13b845fcf289579d209c897823b9217da3e161936f031589";

    let mut s = Raw::open(d, &node_name("decode", d), as_prefill, "Prefill").await;
    s.send(&adapter(sha, b"abcd")).await;
    s.assert_cut("an adapter from a prefill identity").await;
    let mut gw = Raw::open(p, &node_name("prefill", p), as_gateway, "Coordinator").await;
    gw.send(&adapter(&"0".repeat(64), b"abcd")).await;
    gw.assert_cut("an adapter whose SHA-256 is not the one announced")
        .await;
    let mut gw = Raw::open(d, &node_name("decode", d), as_gateway, "Coordinator").await;
    gw.send(&adapter(sha, b"")).await;
    gw.assert_cut("an empty adapter frame").await;
    let mut gw = Raw::open(d, &node_name("decode", d), as_gateway, "Coordinator").await;
    gw.send(&adapter(sha, b"abcd")).await;
    gw.assert_cut("a file that is no adapter of the node's model")
        .await;

    let (st, again) = dep.gateway.run(&body).await;
    let answer = (st, &again["result"]["response"]);
    assert_eq!(answer, (200, &solo["response"]), "{}", dep.logs());
}
