//! Node links as whoever can reach a node port, with real `tessera node` and
//! `tessera serve --config` processes on loopback: raw clients (`common/links.rs`)
//! with no certificate, with another CA's, with another identity's, plaintext,
//! oversized and malformed frames, floods, slow clients; a server with another
//! identity where the gateway dials a node; plain links off loopback. Where a
//! deployment serves a tenant during the attacks, its answers must equal the solo
//! answer. Frames forged by valid identities: `node_link_frames.rs`; draining nodes:
//! `node_drain.rs`; quarantined reservations: `node_quarantine.rs`; stopped, silent
//! and panicking nodes: `node_loss.rs`.
//!
//! Every wait is bounded by a deadline; nothing asserts how fast anything runs.

mod common;

use common::links::*;
use common::metrics::*;
use common::*;
use serde_json::{json, Value};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Every attack on the node ports of a running deployment is refused (the link is
/// closed; nothing is welcomed, no UCX region leaves the node, nothing is allocated
/// from a forged length) while a tenant's requests keep getting the solo answer; at
/// the end no page is leaked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attacks_on_node_ports_are_refused_while_a_tenant_is_served() {
    let dep = Deployment::start().await;
    let certs = dep.dir.path().join("certs");
    let ca = certs.join("ca.pem");
    let (p, d) = (
        Deployment::port(&dep.prefill_addr),
        Deployment::port(&dep.decode_addr),
    );
    let body = greedy(12);
    let solo = dep.gateway.run_when_up(&body).await["result"].clone();
    let (stop, tenant) = serve_tenant(&dep.gateway, body, solo);
    let gateway_id = identity(&certs, "gateway");
    let prefill_id = identity(&certs, &format!("prefill-127.0.0.1-{p}"));
    let as_gateway = client(&ca, Some(&gateway_id));
    let as_prefill = client(&ca, Some(&prefill_id));
    let (decode_name, prefill_name) = (node_name("decode", d), node_name("prefill", p));

    // Plaintext hello to a TLS port.
    for port in [d, p] {
        let tcp = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
        assert_refused(tcp, &hello("Coordinator"), "plaintext hello").await;
    }
    // No client certificate.
    let anonymous = client(&ca, None);
    assert_tls_refused(
        d,
        &decode_name,
        &anonymous,
        &hello("Coordinator"),
        "no client certificate",
    )
    .await;
    // A client certificate from another CA (same identity names).
    let other = dep.dir.path().join("other-ca");
    init_ca(&other);
    issue_certs(&dep.config, &other);
    let foreign = client(&ca, Some(&identity(&other, "gateway")));
    assert_tls_refused(
        d,
        &decode_name,
        &foreign,
        &hello("Coordinator"),
        "another CA's gateway certificate",
    )
    .await;
    // A prefill identity saying it is a coordinator, at both nodes.
    for (port, name) in [(d, &decode_name), (p, &prefill_name)] {
        let s = tls(port, name, &as_prefill).await.unwrap();
        assert_refused(
            s,
            &hello("Coordinator"),
            "a prefill identity as coordinator",
        )
        .await;
    }
    // The gateway identity saying it is a prefill node (it would get the UCX region).
    let s = tls(d, &decode_name, &as_gateway).await.unwrap();
    assert_refused(
        s,
        &hello("Prefill"),
        "the gateway identity as a prefill node",
    )
    .await;

    // The real prefill identity is welcomed (so the refusals above are refusals)...
    let mut s = tls(d, &decode_name, &as_prefill).await.unwrap();
    s.write_all(&hello("Prefill")).await.unwrap();
    let w = first_frame(&mut s)
        .await
        .expect("the prefill identity is welcomed");
    assert!(is_welcome(&w), "{w}");
    // ... but may not drain the node: the link is closed, the node keeps serving.
    s.write_all(&frame(&json!("drain"), &[])).await.unwrap();
    let (_, ended) = read_frames(&mut s, REFUSAL).await;
    assert!(ended, "a drain from a prefill identity was not refused");
    // A page write whose payload is not one page.
    let mut s = tls(d, &decode_name, &as_prefill).await.unwrap();
    s.write_all(&hello("Prefill")).await.unwrap();
    assert!(first_frame(&mut s).await.is_some_and(|w| is_welcome(&w)));
    let tag = json!({"tenant": 1, "seq": 1, "epoch": 0, "logical_block": 0});
    let land = frame(
        &json!({"land": {"req": 1, "dest": {"page": 0, "tag": tag}}}),
        &[0u8; 100],
    );
    s.write_all(&land).await.unwrap();
    let (_, ended) = read_frames(&mut s, REFUSAL).await;
    assert!(ended, "a short page write was not refused");

    // A 256 MiB header announced by the gateway identity: refused from the prefix
    // (the node does not wait for 256 MiB to arrive).
    for (port, name) in [(d, &decode_name), (p, &prefill_name)] {
        let mut s = tls(port, name, &as_gateway).await.unwrap();
        s.write_all(&hello("Coordinator")).await.unwrap();
        assert!(first_frame(&mut s).await.is_some_and(|w| is_welcome(&w)));
        s.write_all(&(256u32 << 20).to_be_bytes()).await.unwrap();
        s.write_all(b"{\"ping\"").await.unwrap();
        let (_, ended) = read_frames(&mut s, REFUSAL).await;
        assert!(ended, "an oversized header was not refused at {name}");
    }

    // Aborts for requests the node never saw: answered within a budget, then the
    // link is closed (each would otherwise leave a tombstone).
    let mut s = tls(d, &decode_name, &as_gateway).await.unwrap();
    s.write_all(&hello("Coordinator")).await.unwrap();
    assert!(first_frame(&mut s).await.is_some_and(|w| is_welcome(&w)));
    let abort = |i: u64| {
        frame(
            &json!({"control": {"msg": {"type": "abort", "req": 0xdead_0000_0000u64 + i}}}),
            &[],
        )
    };
    let (mut r, mut w) = tokio::io::split(s);
    for i in 0..10 {
        w.write_all(&abort(i)).await.unwrap();
    }
    let (frames, _) = read_frames(&mut r, Duration::from_secs(3)).await;
    let acks = |f: &[Value]| {
        f.iter()
            .filter(|h| h["control"]["msg"]["type"] == "abort_ack")
            .count()
    };
    assert_eq!(
        acks(&frames),
        10,
        "the first aborts are answered: {frames:?}"
    );
    const FLOOD: u64 = 20_000;
    let writer = tokio::spawn(async move {
        for i in 10..FLOOD {
            if w.write_all(&abort(i)).await.is_err() {
                return i;
            }
        }
        FLOOD
    });
    let (frames, ended) = read_frames(&mut r, REQUEST).await;
    assert!(ended, "an abort flood did not get the link closed");
    assert!(
        acks(&frames) < FLOOD as usize - 10,
        "every flooded abort was answered"
    );
    let _ = writer.await;

    // The tenant was served correctly throughout, and nothing leaked.
    stop.store(true, Ordering::Release);
    let served = tenant
        .await
        .unwrap()
        .unwrap_or_else(|e| panic!("{e}\n{}", dep.logs()));
    assert!(served >= 1, "the tenant got no answer during the attacks");
    dep.pool_is_free().await;
}

/// The dialer checks it reached the node it meant: a gateway whose decode node's
/// port is held by a TLS server with the prefill node's certificate (same CA), or
/// with the decode node's name from another CA, never says hello to it, stays not
/// ready and counts the refused peer (`tessera_node_peers_refused_total`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_refuses_a_node_with_another_identity_or_from_another_ca() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = (free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
    let certs = dir.path().join("certs");
    let other = dir.path().join("other-ca");
    init_ca(&other);
    issue_certs(&config, &other);
    for (what, (cert, key)) in [
        (
            "the prefill node's certificate",
            identity(&certs, &format!("prefill-127.0.0.1-{p}")),
        ),
        (
            "another CA's decode certificate",
            identity(&other, &format!("decode-127.0.0.1-{d}")),
        ),
    ] {
        let acceptor = tls_server(&cert, &key);
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", d))
            .await
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let halt = stop.clone();
        let rogue = tokio::spawn(async move {
            let (mut attempts, mut hellos) = (0, 0);
            while !halt.load(Ordering::Acquire) {
                let Ok(Ok((tcp, _))) =
                    tokio::time::timeout(Duration::from_millis(100), listener.accept()).await
                else {
                    continue;
                };
                attempts += 1;
                if let Ok(mut s) = acceptor.accept(tcp).await {
                    if let Some(h) = first_frame(&mut s).await {
                        if !h["hello"].is_null() {
                            hellos += 1;
                        }
                    }
                }
            }
            (attempts, hellos)
        });
        let data = format!("data-{}", what.len());
        let token = "metrics-7Qx2kP9vL4nR8sT1wZ6yHcJ3mB5dF0gA";
        let args = ["--metrics-token", token];
        let gw = start_config_gateway(dir.path(), &config, &data, "gateway.log", &args).await;
        // It dialed before it was up; give it a retry or two as well.
        tokio::time::sleep(Duration::from_millis(2500)).await;
        stop.store(true, Ordering::Release);
        let (attempts, hellos) = rogue.await.unwrap();
        assert!(attempts >= 1, "{what}: the gateway never dialed the node");
        assert_eq!(
            hellos, 0,
            "{what}: the gateway said hello to a node that is not the one it meant"
        );
        let ready = reqwest::get(format!("{}/readyz", gw.base))
            .await
            .unwrap()
            .status();
        assert_eq!(ready, 503, "{what}");
        // Each refused dial is counted on the gateway.
        let refused = r#"tessera_node_peers_refused_total{node="gateway",role="coordinator"}"#;
        let (n, _) = gateway_metric(&gw, token, refused).await;
        assert!(n >= 1.0, "{what}: {n} refused peers counted");
    }
}

/// Without `[node_links]` TLS files a node and a gateway start only with
/// `--insecure-node-links`, and only when every node (and the listen address) is on
/// loopback; each refusal names what is wrong. On loopback with the flag, it serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_links_need_the_flag_and_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = (free_port(), free_port());
    let config = write_config_with(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT), None);
    let run = |args: Vec<String>| async move {
        let out = tokio::time::timeout(
            START,
            tokio::process::Command::new(BIN)
                .args(&args)
                .env_remove("TESSERA_DATA_DIR")
                .kill_on_drop(true)
                .output(),
        )
        .await
        .expect("exits")
        .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let node = |cfg: &Path, extra: &[&str]| {
        let mut a: Vec<String> = [
            "node",
            "--role",
            "decode",
            "--config",
            cfg.to_str().unwrap(),
            "--listen",
            &format!("127.0.0.1:{d}"),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let (ok, err) = run(node(&config, &[])).await;
    assert!(
        !ok && err.contains("[node_links]") && err.contains("--insecure-node-links"),
        "{err}"
    );
    // One node of the file off loopback.
    let text = std::fs::read_to_string(&config).unwrap().replace(
        &format!("nodes = [\"127.0.0.1:{d}\"]"),
        &format!("nodes = [\"127.0.0.1:{d}\", \"10.1.2.3:{d}\"]"),
    );
    let wide = dir.path().join("wide.toml");
    std::fs::write(&wide, text).unwrap();
    let (ok, err) = run(node(&wide, &["--insecure-node-links"])).await;
    assert!(
        !ok && err.contains(&format!("10.1.2.3:{d}")) && err.contains("loopback"),
        "{err}"
    );
    let data = dir.path().join("data-wide");
    let serve = |cfg: &Path| {
        vec![
            "serve".to_string(),
            "--config".into(),
            cfg.display().to_string(),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--data-dir".into(),
            data.display().to_string(),
            "--insecure-node-links".into(),
        ]
    };
    let (ok, err) = run(serve(&wide)).await;
    assert!(!ok && err.contains("10.1.2.3"), "{err}");
    // `tessera ops check-config` says the same.
    let out = std::process::Command::new(BIN)
        .args(["ops", "check-config"])
        .arg(&wide)
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(
        !out.status.success() && report.contains("[insecure_node_links]"),
        "{report}"
    );
    // All on loopback, with the flag: it serves.
    let insecure = ["--insecure-node-links"];
    let _decode = start_node_with(dir.path(), &config, "decode", d, &insecure, &[]).await;
    let _prefill = start_node_with(dir.path(), &config, "prefill", p, &insecure, &[]).await;
    let gw = start_config_gateway(
        dir.path(),
        &config,
        "data",
        "gateway.log",
        &["--insecure-node-links"],
    )
    .await;
    let v = gw.run_when_up(&greedy(8)).await;
    assert!(!v["result"]["response"].as_str().unwrap().is_empty(), "{v}");
}

/// Refused node links and rejected frames are exported: 20 links without a client
/// certificate move a node's `tessera_node_peers_refused_total` by 20, a malformed
/// frame from a valid gateway identity moves `tessera_node_frames_rejected_total`;
/// both exist at 0 before.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_node_links_and_rejected_frames_move_a_metric() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = (free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
    let certs = dir.path().join("certs");
    let ca = certs.join("ca.pem");
    let (_decode, url) = start_node_with_metrics(dir.path(), &config, "decode", d, &[]).await;
    let labels = format!(r#"{{node="127.0.0.1:{d}",role="decode"}}"#);
    let refused = format!("tessera_node_peers_refused_total{labels}");
    let rejected = format!("tessera_node_frames_rejected_total{labels}");
    let text = reqwest::get(&url).await.unwrap().text().await.unwrap();
    for s in [&refused, &rejected] {
        assert!(
            text.lines().any(|l| l == format!("{s} 0")),
            "{s} is not exported at 0:\n{text}"
        );
    }
    let decode_name = node_name("decode", d);
    let anonymous = client(&ca, None);
    for _ in 0..20 {
        assert_tls_refused(
            d,
            &decode_name,
            &anonymous,
            &hello("Coordinator"),
            "no cert",
        )
        .await;
    }
    let deadline = Instant::now() + REFUSAL;
    while metric(&url, &refused).await < 20.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(metric(&url, &refused).await, 20.0, "20 refused links");
    assert_eq!(metric(&url, &rejected).await, 0.0);
    let as_gateway = client(&ca, Some(&identity(&certs, "gateway")));
    let mut gw = Raw::open(d, &decode_name, &as_gateway, "Coordinator").await;
    gw.send(&frame(&json!({"no_such_frame": {}}), &[])).await;
    gw.assert_cut("a malformed frame").await;
    assert_eq!(metric(&url, &rejected).await, 1.0, "the malformed frame");
}

/// Issue 32: 200 slow clients (one byte every 2 s, so no per-read timeout ever
/// fires) against a node's metrics listener and then its control port. Each is cut
/// by the whole-head deadline (5 s for metrics, 10 s for the control port) at the
/// latest; those past the cap of connections still in their head are cut sooner to
/// make room. Meanwhile a scrape and a gateway link (TLS handshake, hello, welcome)
/// get in, and the metrics listener never runs more than its 64 connection threads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_clients_on_the_metrics_and_control_ports_are_cut_at_the_head_deadline() {
    const SLOW: usize = 200;
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = (free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
    let (decode, metrics_url) =
        start_node_with_metrics(dir.path(), &config, "decode", d, &[]).await;
    let pid = decode.id().unwrap();
    let threads = || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .count()
    };
    let metrics_port: u16 = metrics_url
        .trim_end_matches("/metrics")
        .rsplit(':')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    let certs = dir.path().join("certs");
    let as_gateway = client(&certs.join("ca.pem"), Some(&identity(&certs, "gateway")));
    let idle_threads = threads();

    // What each slow client trickles: an HTTP request line, or the start of a TLS
    // ClientHello record (valid so far, so the handshake keeps waiting for it).
    let http = b"GET /metrics HTTP/1.1\r\nhost: x\r\n".to_vec();
    let mut hello_record = vec![
        0x16, 0x03, 0x01, 0x02, 0x00, 0x01, 0x00, 0x01, 0xfc, 0x03, 0x03,
    ];
    hello_record.resize(64, 0);
    for (what, port, deadline, bytes) in [
        ("metrics", metrics_port, Duration::from_secs(5), http),
        ("control", d, Duration::from_secs(10), hello_record),
    ] {
        let started = Instant::now();
        let mut slow = Vec::new();
        for _ in 0..SLOW {
            let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
            let bytes = bytes.clone();
            slow.push(tokio::spawn(async move {
                let mut buf = [0u8; 256];
                for b in bytes.iter().cycle() {
                    if s.write_all(&[*b]).await.is_err() {
                        break;
                    }
                    match tokio::time::timeout(Duration::from_secs(2), s.read(&mut buf)).await {
                        Ok(Ok(0)) | Ok(Err(_)) => break,
                        _ if started.elapsed() > Duration::from_secs(60) => break,
                        _ => {}
                    }
                }
                started.elapsed()
            }));
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        if what == "metrics" {
            let threads_now = threads();
            assert!(
                threads_now <= idle_threads + 64 + 2,
                "{threads_now} threads with {SLOW} slow metrics clients ({idle_threads} idle)"
            );
            let resp = reqwest::Client::new()
                .get(&metrics_url)
                .timeout(Duration::from_secs(3))
                .send()
                .await
                .expect("a scrape gets in among the slow clients");
            assert_eq!(resp.status(), 200);
            assert!(resp.text().await.unwrap().contains("tessera_kv_pages"));
        } else {
            let mut s = tls(d, &node_name("decode", d), &as_gateway)
                .await
                .expect("a gateway's handshake gets in among the slow clients");
            s.write_all(&hello("Coordinator")).await.unwrap();
            let first = first_frame(&mut s).await;
            assert!(
                first.as_ref().is_some_and(is_welcome),
                "the gateway was not welcomed: {first:?}"
            );
        }
        assert!(
            started.elapsed() < deadline,
            "{what}: the checks above took past the deadline"
        );
        let mut longest = Duration::ZERO;
        for t in slow {
            let took = t.await.unwrap();
            assert!(
                took < deadline + Duration::from_secs(5),
                "{what}: a slow client was held {took:?} (head deadline {deadline:?})"
            );
            longest = longest.max(took);
        }
        // The last ones in were cut by the deadline, not by a per-read timeout.
        assert!(
            longest + Duration::from_secs(2) >= deadline,
            "{what}: {longest:?}"
        );
    }
    // The node still serves after both storms.
    let resp = reqwest::get(&metrics_url).await.unwrap();
    assert_eq!(resp.status(), 200);
}
