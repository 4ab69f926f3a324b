//! Node links as whoever can reach a node port, with real `tessera node` and
//! `tessera serve --config` processes on loopback: raw clients with no certificate,
//! with another CA's, with another identity's, plaintext, oversized and malformed
//! frames, floods; a rogue node the gateway dials; plain links off loopback; a
//! stopped (SIGSTOP) node, a panicking node, draining nodes. Where a deployment
//! serves a tenant during the attacks, its answers must equal the solo answer.
//!
//! The raw clients write frames by hand from the documented format (`u32` header
//! length, JSON header, `u32` payload length, payload) and name identities by the
//! documented rule (`<role>-<port>.<host>.tessera`, files `<role>-<host>-<port>.pem`).
//!
//! Every wait is bounded by a deadline; nothing asserts how fast anything runs.

mod common;

use common::*;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::TcpStream;

/// How long a node may take to close a link it refused (its handshake timeout is 10 s).
const REFUSAL: Duration = Duration::from_secs(15);

/// One frame: `u32` BE header length, the JSON header, `u32` BE payload length, payload.
fn frame(header: &Value, payload: &[u8]) -> Vec<u8> {
    let h = serde_json::to_vec(header).unwrap();
    let mut b = (h.len() as u32).to_be_bytes().to_vec();
    b.extend(&h);
    b.extend((payload.len() as u32).to_be_bytes());
    b.extend(payload);
    b
}

fn hello(from: &str) -> Vec<u8> {
    frame(&json!({"hello": {"from": from}}), &[])
}

/// Reads one frame; its header as JSON (`null` when it is not JSON).
async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Value> {
    let n = r.read_u32().await? as usize;
    let mut h = vec![0u8; n];
    r.read_exact(&mut h).await?;
    let p = r.read_u32().await? as usize;
    let mut payload = vec![0u8; p];
    r.read_exact(&mut payload).await?;
    Ok(serde_json::from_slice(&h).unwrap_or(Value::Null))
}

/// Reads frames until the link ends or `wait` passes: (headers, whether it ended).
async fn read_frames<R: AsyncRead + Unpin>(r: &mut R, wait: Duration) -> (Vec<Value>, bool) {
    let mut out = Vec::new();
    let deadline = Instant::now() + wait;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, read_frame(r)).await {
            Ok(Ok(h)) => out.push(h),
            Ok(Err(_)) => return (out, true),
            Err(_) => return (out, false),
        }
    }
}

fn is_welcome(h: &Value) -> bool {
    !h["welcome"].is_null()
}

/// Reads the first frame that is not a ping (the node's answer to hello).
async fn first_frame<R: AsyncRead + Unpin>(r: &mut R) -> Option<Value> {
    let deadline = Instant::now() + REFUSAL;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, read_frame(r)).await {
            Ok(Ok(h)) if h == json!("ping") => continue,
            Ok(Ok(h)) => return Some(h),
            _ => return None,
        }
    }
}

/// Asserts that the peer closes the link after `hello` without welcoming it.
async fn assert_refused<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, hello: &[u8], what: &str) {
    let _ = s.write_all(hello).await;
    let (frames, ended) = read_frames(&mut s, REFUSAL).await;
    assert!(ended, "{what}: the node kept the link open");
    assert!(
        !frames.iter().any(is_welcome),
        "{what}: the node welcomed the peer: {frames:?}"
    );
}

/// A node's identity name by the documented rule.
fn node_name(role: &str, port: u16) -> String {
    format!("{role}-{port}.127.0.0.1.tessera")
}

/// (certificate, key) files of an identity stem in `certs`.
fn identity(certs: &Path, stem: &str) -> (PathBuf, PathBuf) {
    (
        certs.join(format!("{stem}.pem")),
        certs.join(format!("{stem}.key")),
    )
}

/// A TLS client trusting `ca`, presenting `me` (certificate, key) if given.
fn client(ca: &Path, me: Option<&(PathBuf, PathBuf)>) -> tokio_rustls::TlsConnector {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let b = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let cfg = match me {
        Some((cert, key)) => b
            .with_client_auth_cert(
                CertificateDer::pem_file_iter(cert)
                    .unwrap()
                    .map(|c| c.unwrap())
                    .collect(),
                PrivateKeyDer::from_pem_file(key).unwrap(),
            )
            .unwrap(),
        None => b.with_no_client_auth(),
    };
    tokio_rustls::TlsConnector::from(Arc::new(cfg))
}

type Tls = tokio_rustls::client::TlsStream<TcpStream>;

/// Connects with TLS to `port`, asking for identity `name`.
async fn tls(port: u16, name: &str, c: &tokio_rustls::TlsConnector) -> std::io::Result<Tls> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
    let name = ServerName::try_from(name.to_string()).unwrap();
    tokio::time::timeout(REFUSAL, c.connect(name, tcp))
        .await
        .map_err(|_| std::io::Error::other("handshake timed out"))?
}

/// Asserts the link is refused: at the handshake, or by closing it after `hello`.
async fn assert_tls_refused(
    port: u16,
    name: &str,
    c: &tokio_rustls::TlsConnector,
    hello: &[u8],
    what: &str,
) {
    match tls(port, name, c).await {
        Err(_) => {} // refused during the handshake
        Ok(s) => assert_refused(s, hello, what).await,
    }
}

/// A tenant sending `body` in a loop until stopped; every answer must be 200 and
/// equal `solo`. The task returns how many it got, or the first bad answer.
fn serve_tenant(
    gw: &Gateway,
    body: Value,
    solo: Value,
) -> (
    Arc<AtomicBool>,
    tokio::task::JoinHandle<Result<usize, String>>,
) {
    let (url, key) = (gw.url(), gw.key.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let task = tokio::spawn(async move {
        let client = reqwest::Client::new();
        let mut n = 0;
        while !s.load(Ordering::Acquire) {
            let r = client
                .post(&url)
                .bearer_auth(&key)
                .json(&body)
                .timeout(REQUEST)
                .send()
                .await
                .map_err(|e| format!("request {n}: {e}"))?;
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or(Value::Null);
            if status != 200 || answer(&v["result"]) != answer(&solo) {
                return Err(format!("request {n}: {status} {v} (solo: {solo})"));
            }
            n += 1;
        }
        Ok(n)
    });
    (stop, task)
}

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
    ops(&["certs", "init", "--dir", other.to_str().unwrap()]);
    ops(&[
        "certs",
        "issue",
        "--config",
        dep.config.to_str().unwrap(),
        "--dir",
        other.to_str().unwrap(),
    ]);
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
/// with the decode node's name from another CA, never says hello to it and stays
/// not ready.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_refuses_a_node_with_another_identity_or_from_another_ca() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = (free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
    let certs = dir.path().join("certs");
    let other = dir.path().join("other-ca");
    ops(&["certs", "init", "--dir", other.to_str().unwrap()]);
    ops(&[
        "certs",
        "issue",
        "--config",
        config.to_str().unwrap(),
        "--dir",
        other.to_str().unwrap(),
    ]);
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
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(
                CertificateDer::pem_file_iter(&cert)
                    .unwrap()
                    .map(|c| c.unwrap())
                    .collect(),
                PrivateKeyDer::from_pem_file(&key).unwrap(),
            )
            .unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
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
        let gw = start_config_gateway(dir.path(), &config, &data, "gateway.log", &[]).await;
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

/// Two decode nodes; one is stopped (SIGSTOP) while it streams one request and holds
/// another: both end with an error while it is still stopped (a stream with an
/// error event and no `[DONE]`, the other with a non-200), a stream on the other node
/// completes with its solo answer, and new requests are served by the other node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_decode_node_fails_its_requests_while_the_other_serves() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d0, d1) = (free_port(), free_port(), free_port());
    let config = write_config_with(
        dir.path(),
        free_port(),
        p,
        &[d0, d1],
        (CONTEXT, CONTEXT),
        Some(FAST_LIVENESS),
    );
    let decode0 = start_node(dir.path(), &config, "decode", d0).await;
    let _decode1 = start_node(dir.path(), &config, "decode", d1).await;
    let _prefill = start_node(dir.path(), &config, "prefill", p).await;
    let gw = start_config_gateway(dir.path(), &config, "data", "gateway.log", &[]).await;
    let short = greedy(16);
    let solo = gw.run_when_up(&short).await["result"].clone();
    let (mid, mid_solo) = (
        endless(60),
        gw.run_when_up(&endless(60)).await["result"].clone(),
    );
    // Routing: fewest outstanding, ties to the lower index. `a` goes to decode 0,
    // `c` to decode 1, `b` (a tie) to decode 0.
    let mut a = gw.stream(&endless(2000)).await;
    assert_eq!(a.status, 200);
    a.read_texts(3).await;
    assert!(
        a.tokens() >= 3 && !a.has_error(),
        "{:?}\n{}",
        a.events,
        logs(dir.path())
    );
    let mut c = gw.stream(&mid).await;
    assert_eq!(c.status, 200);
    let (url, key) = (gw.url(), gw.key.clone());
    let b = tokio::spawn(async move {
        let r = reqwest::Client::new()
            .post(url)
            .bearer_auth(key)
            .json(&endless(2000))
            .timeout(REQUEST)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        (status, r.json::<Value>().await.unwrap_or(Value::Null))
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let pid = decode0.id().unwrap().to_string();
    let signal = |sig: &str| {
        assert!(std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success())
    };
    signal("-STOP");
    // While it is stopped: its requests end with an error...
    a.read_to_end().await;
    a.assert_cut(&logs(dir.path()));
    let (status, v) = tokio::time::timeout(REQUEST, b)
        .await
        .expect("b ends while the node is stopped")
        .unwrap();
    assert_ne!(status, 200, "a request on a stopped node got 200: {v}");
    // ... the other node's stream completes unchanged, and new requests are served.
    c.read_to_end().await;
    assert!(
        c.has_done() && !c.has_error(),
        "{:?}\n{}",
        c.events,
        logs(dir.path())
    );
    assert_eq!(c.text(), mid_solo["response"].as_str().unwrap());
    for _ in 0..3 {
        let (status, v) = gw.run(&short).await;
        assert_eq!(status, 200, "{v}\n{}", logs(dir.path()));
        assert_eq!(answer(&v["result"]), answer(&solo));
    }
    signal("-CONT");
}

/// A node whose engine thread (decode) or connection task (prefill) panics exits
/// with status 101; the request it held ends with an error, and once the node is
/// restarted the gateway serves again (and no decode page leaked).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panicking_node_exits_its_requests_fail_and_a_restart_serves() {
    let mut dep = Deployment::start().await;
    let panic_env = [("TESSERA_TEST_NODE_PANIC", "engine")];
    for (role, mode) in [("decode", "engine"), ("prefill", "connection")] {
        dep.kill(role).await;
        let addr = if role == "decode" {
            &dep.decode_addr
        } else {
            &dep.prefill_addr
        };
        let port = Deployment::port(addr);
        let env = [(panic_env[0].0, mode)];
        let mut node = start_node_with(dep.dir.path(), &dep.config, role, port, &[], &env).await;
        let mut s = loop {
            // Until the gateway reconnected to the new node.
            let s = dep.gateway.stream(&endless(200)).await;
            if s.status != 503 {
                break s;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        if s.status == 200 {
            s.read_to_end().await;
            assert!(
                s.has_error() && !s.has_done(),
                "{role}: {:?}\n{}",
                s.events,
                dep.logs()
            );
        } else {
            assert!(s.status >= 500, "{role}: status {}", s.status);
        }
        let status = tokio::time::timeout(START, node.wait())
            .await
            .expect("the node exits")
            .unwrap();
        assert_eq!(
            status.code(),
            Some(101),
            "{role}: {status:?}\n{}",
            dep.logs()
        );
        let log = std::fs::read_to_string(dep.dir.path().join(format!("{role}-{port}.log")))
            .unwrap_or_default();
        assert!(log.contains("test-only panic"), "{role}: {log}");
        match role {
            "decode" => dep.decode = None,
            _ => dep.prefill = None,
        }
        dep.restart(role).await;
        let v = dep.gateway.run_when_up(&greedy(8)).await;
        assert!(!v["result"]["response"].as_str().unwrap().is_empty(), "{v}");
    }
    dep.pool_is_free().await;
}

/// SIGTERM drains a decode node: it tells the gateway, which routes new requests
/// to the other decode node (a request that would have gone to the draining node
/// by load gets its solo answer from the other); the request it still runs at the
/// drain deadline ends with an error (no `[DONE]`), and the node exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_a_decode_node_and_ends_the_rest_at_the_deadline() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d0, d1) = (free_port(), free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d0, d1], (CONTEXT, CONTEXT));
    let mut decode0 = start_node_with(
        dir.path(),
        &config,
        "decode",
        d0,
        &["--drain-timeout-secs", "3"],
        &[],
    )
    .await;
    let _decode1 = start_node(dir.path(), &config, "decode", d1).await;
    let _prefill = start_node(dir.path(), &config, "prefill", p).await;
    let gw = start_config_gateway(dir.path(), &config, "data", "gateway.log", &[]).await;
    let late = endless(400);
    let solo = gw.run_when_up(&late).await["result"].clone();
    // One long stream on each decode node (fewest outstanding, ties to decode 0).
    let mut a = gw.stream(&endless(4000)).await;
    a.read_texts(2).await;
    let mut b = gw.stream(&endless(4000)).await;
    b.read_texts(2).await;
    assert!(a.tokens() >= 2 && b.tokens() >= 2, "{}", logs(dir.path()));
    let pid = decode0.id().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    tokio::time::sleep(Duration::from_millis(500)).await;
    // A tie by load: it would go to decode 0, which is draining, and which would cut
    // it at its 3 s deadline.
    let (status, v) = gw.run(&late).await;
    assert_eq!(status, 200, "{v}\n{}", logs(dir.path()));
    assert_eq!(
        answer(&v["result"]),
        answer(&solo),
        "the late request was not served by the other node"
    );
    a.read_to_end().await;
    a.assert_cut(&logs(dir.path()));
    let status = tokio::time::timeout(START, decode0.wait())
        .await
        .expect("the drained node exits")
        .unwrap();
    assert!(status.success(), "{status:?}\n{}", logs(dir.path()));
    // The other node's stream is untouched.
    b.read_until(Duration::from_secs(1), |_| false).await;
    assert!(!b.has_error(), "{:?}", b.events.last());
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
    let (url, key) = (dep.gateway.url(), dep.gateway.key.clone());
    let running = tokio::spawn({
        let body = body.clone();
        async move {
            let r = reqwest::Client::new()
                .post(url)
                .bearer_auth(key)
                .json(&body)
                .timeout(REQUEST)
                .send()
                .await
                .unwrap();
            (
                r.status().as_u16(),
                r.json::<Value>().await.unwrap_or(Value::Null),
            )
        }
    });
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
