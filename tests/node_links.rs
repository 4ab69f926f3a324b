//! Node links as whoever can reach a node port, with real `tessera node` and
//! `tessera serve --config` processes on loopback: raw clients with no certificate,
//! with another CA's, with another identity's, plaintext, oversized and malformed
//! frames, floods; a rogue node the gateway dials; plain links off loopback;
//! draining nodes (stopped, silent and panicking nodes: `node_loss.rs`). Where a deployment
//! serves a tenant during the attacks, its answers must equal the solo answer.
//!
//! The raw clients write frames by hand from the documented format (`u32` header
//! length, JSON header, `u32` payload length, payload) and name identities by the
//! documented rule (`<role>-<port>.<host>.tessera`, files `<role>-<host>-<port>.pem`).
//! Raw clients with valid identities of the cluster CA also drive the protocol
//! themselves: as the gateway identity they reserve pages for requests of their own
//! (ids they choose), and as a prefill identity they write and commit those pages; so
//! their page writes and commits can be aimed at live reservations whose pages and
//! state they know. The tenant's own requests (ids and pages only its gateway
//! knows) are what must stay correct throughout.
//!
//! Every wait is bounded by a deadline; nothing asserts how fast anything runs.

mod common;

use common::*;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_engine::{GenerateRequest, Priority};
use tessera_model::sampling::SamplingParams;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;
use tokio::process::Child;

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

/// [`read_frame`] whose first byte was read already.
async fn read_frame_after<R: AsyncRead + Unpin>(first: u8, r: &mut R) -> std::io::Result<Value> {
    let mut len = [first, 0, 0, 0];
    r.read_exact(&mut len[1..]).await?;
    let mut h = vec![0u8; u32::from_be_bytes(len) as usize];
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

/// A raw node link with a valid identity: frames written by hand, frames read with
/// deadlines. Frames read while waiting for another are kept, in order, for later.
struct Raw {
    r: ReadHalf<Tls>,
    w: WriteHalf<Tls>,
    kept: Vec<Value>,
    /// When this side last wrote (it pings after a second without a write).
    sent: Instant,
}

impl Raw {
    /// TLS to `port` (identity `name`) as `c`, `Hello { from }`, and its welcome.
    async fn open(port: u16, name: &str, c: &tokio_rustls::TlsConnector, from: &str) -> Self {
        let mut s = tls(port, name, c).await.unwrap();
        s.write_all(&hello(from)).await.unwrap();
        let w = first_frame(&mut s).await;
        assert!(
            w.as_ref().is_some_and(is_welcome),
            "{from} not welcomed: {w:?}"
        );
        let (r, w) = tokio::io::split(s);
        Self {
            r,
            w,
            kept: Vec::new(),
            sent: Instant::now(),
        }
    }

    async fn send(&mut self, bytes: &[u8]) {
        self.w.write_all(bytes).await.unwrap();
        self.sent = Instant::now();
    }

    /// The first frame (kept or new) that `want` accepts; the others stay kept (pings
    /// are dropped). While it waits it pings after every second without a write, as
    /// a node does (the node closes a link it reads nothing from as dead). `None`
    /// when the link ends first or the deadline passes.
    async fn until(&mut self, want: impl Fn(&Value) -> bool) -> Option<Value> {
        if let Some(i) = self.kept.iter().position(&want) {
            return Some(self.kept.remove(i));
        }
        let deadline = Instant::now() + REQUEST;
        let ping = frame(&json!("ping"), &[]);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            let beat = Duration::from_secs(1);
            if self.sent.elapsed() >= beat {
                self.w.write_all(&ping).await.ok()?;
                self.sent = Instant::now();
            }
            let wait = left.min(beat.saturating_sub(self.sent.elapsed()));
            // The read is cancel-safe only between frames: a partly read frame is
            // lost on timeout, so wait for the first byte, then read the frame.
            let mut first = [0u8; 1];
            match tokio::time::timeout(wait, self.r.read_exact(&mut first)).await {
                Err(_) => continue,
                Ok(Err(_)) => return None,
                Ok(Ok(_)) => {}
            }
            let rest = tokio::time::timeout(left, read_frame_after(first[0], &mut self.r));
            match rest.await {
                Ok(Ok(h)) if want(&h) => return Some(h),
                Ok(Ok(h)) if h == json!("ping") => {}
                Ok(Ok(h)) => self.kept.push(h),
                _ => return None,
            }
        }
    }

    /// The next protocol message about `req` (its events are kept).
    async fn reply(&mut self, req: u64) -> Value {
        let h = self.until(|h| h["control"]["msg"]["req"] == req).await;
        h.unwrap_or_else(|| panic!("no reply about request {req}"))["control"]["msg"].clone()
    }

    /// How many stream events about `req` were kept.
    fn events(&self, req: u64) -> usize {
        self.kept
            .iter()
            .filter(|h| h["event"]["req"] == req)
            .count()
    }

    /// Asserts that the node closes the link (whatever it sends first).
    async fn assert_cut(mut self, what: &str) {
        let (_, ended) = read_frames(&mut self.r, REFUSAL).await;
        assert!(ended, "{what}: the node kept the link open");
    }
}

/// What a raw client needs to know of the model: one KV page's size on the wire
/// (the deployment's 16-token pages) and the vocabulary size.
fn model_shape() -> (usize, usize) {
    let m = tessera_model::LoadedModel::load(&model_path()).unwrap();
    let c = m.transformer.config();
    (c.kv_layout(16).page_bytes(), c.vocab)
}

/// A raw request's id (a gateway draws 64 random bits per request: they do not meet).
fn raw_req(i: u64) -> u64 {
    0x7a57_0000_0000_0000 + i
}

/// `Prealloc` for raw request `req` with a body of `prompt` tokens and `max_tokens`,
/// claiming `counts` (prompt, max) in the message, written by the prefill node
/// `writer` (its address in the deployment file). Greedy; it ignores end-of-sequence,
/// so it decodes until `max_tokens` or until it is ended.
fn raw_prealloc(
    req: u64,
    prompt: usize,
    max_tokens: usize,
    counts: (usize, usize),
    writer: &str,
) -> Vec<u8> {
    let body = GenerateRequest {
        tenant: 77,
        priority: Priority::default(),
        weight: 1,
        cache_namespace: None,
        prompt: (0..prompt as u32).map(|i| 100 + i).collect(),
        max_tokens,
        sampling: SamplingParams::default(),
        stop: Vec::new(),
        ignore_eos: true,
        output: Default::default(),
    };
    frame(
        &json!({"control": {
            "msg": {"type": "prealloc", "req": req, "tenant": 77,
                    "prompt_tokens": counts.0, "max_tokens": counts.1},
            "body": body,
            "prefill": writer,
        }}),
        &[],
    )
}

/// A raw reservation's destination pages, from its `Descriptor`.
fn descriptor(reply: &Value) -> Vec<Value> {
    assert_eq!(reply["type"], "descriptor", "{reply}");
    reply["pages"].as_array().unwrap().clone()
}

/// A page write of `bytes` for `req` into `dest`.
fn land(req: u64, dest: &Value, bytes: &[u8]) -> Vec<u8> {
    frame(&json!({"land": {"req": req, "dest": dest}}), bytes)
}

/// The commit of `req`'s `pages`, each holding `bytes` (`tokens` prompt tokens).
fn raw_commit(
    req: u64,
    tokens: usize,
    pages: &[Value],
    bytes: &[u8],
    first_token: usize,
) -> Vec<u8> {
    let sum = tessera_transfer::checksum::page_checksum(bytes);
    let pages: Vec<Value> = pages
        .iter()
        .map(|d| json!({"dest": d, "checksum": sum}))
        .collect();
    frame(
        &json!({"control": {"msg": {"type": "commit", "req": req, "tokens": tokens,
                                    "pages": pages, "first_token": first_token}}}),
        &[],
    )
}

/// Starts a node like [`start_node_with`], with its metrics on a port of its own;
/// returns the metrics URL too.
async fn start_node_with_metrics(
    dir: &Path,
    config: &Path,
    role: &str,
    port: u16,
    extra: &[&str],
) -> (Child, String) {
    let listen = format!("127.0.0.1:{port}");
    let transport = transport();
    let mut args = vec![
        "node",
        "--role",
        role,
        "--config",
        config.to_str().unwrap(),
        "--listen",
        &listen,
        "--transport",
        &transport,
        "--metrics-listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    let log = dir.join(format!("{role}-{port}.log"));
    let (child, lines) = spawn_until(&args, &log, |l| l.contains("listening on")).await;
    let url = lines
        .iter()
        .find_map(|l| l.strip_prefix("tessera node: metrics on "))
        .unwrap_or_else(|| panic!("no metrics line in {lines:?}"))
        .trim()
        .to_string();
    (child, url)
}

/// One series of a node's `/metrics` (`name{labels}`), 0 when it is not exported.
async fn metric(url: &str, series: &str) -> f64 {
    let text = reqwest::get(url).await.unwrap().text().await.unwrap();
    let m: HashMap<&str, f64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k, v.parse().ok()?))
        })
        .collect();
    m.get(series).copied().unwrap_or(0.0)
}

/// The sum of every series of a `/metrics` whose `name{labels` starts with `prefix`.
async fn metric_sum(url: &str, prefix: &str) -> f64 {
    let text = reqwest::get(url).await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
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

/// Page writes and commits from raw clients holding valid identities of the cluster
/// CA, aimed at live reservations of a real decode node while a tenant is served:
/// a `Prealloc` whose counts disagree with its body is refused (no panic); a
/// full-page write from a listed prefill identity that is not the request's writer
/// is refused before it touches anything (the request later commits its own bytes,
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
    let (p, stranger, d) = (free_port(), free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
    // A second prefill node in the file (never started): an identity the decode node
    // accepts as a prefill peer, but no request's writer.
    let text = std::fs::read_to_string(&config).unwrap().replace(
        &format!("nodes = [\"127.0.0.1:{p}\"]"),
        &format!("nodes = [\"127.0.0.1:{p}\", \"127.0.0.1:{stranger}\"]"),
    );
    std::fs::write(&config, text).unwrap();
    let certs = dir.path().join("certs");
    issue_certs(&config, &certs);
    let (decode, metrics) = start_node_with_metrics(dir.path(), &config, "decode", d, &[]).await;
    let prefill = start_node(dir.path(), &config, "prefill", p).await;
    let gateway = start_config_gateway(dir.path(), &config, "data", "gateway.log", &[]).await;
    let mut dep = Deployment {
        prefill_addr: format!("127.0.0.1:{p}"),
        decode_addr: format!("127.0.0.1:{d}"),
        dir,
        config,
        prefill: Some(prefill),
        decode: Some(decode),
        gateway,
    };
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

/// A decode node refuses new work once its drain began, and the gateway serves what
/// it refused on the other decode node. Decode 0's pool is full (one request holds
/// a whole context window) when a request is routed to it and waits there for pages;
/// SIGTERM: the waiting request is refused by the node (it held nothing) and gets its
/// solo answer from decode 1; a `Prealloc` a raw gateway-identity client sends after
/// the node said it drains is refused as draining (busy, retryable); requests sent
/// during the drain all get their solo answers; the running request ends at the
/// deadline with an error, and the node exits 0.
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

    let pid = decode0.id().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
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
    assert_eq!(r["type"], "rejected", "{r}");
    assert_eq!(r["by"], "Decode", "{r}");
    assert_eq!(r["reason"]["kind"], "Busy", "{r}");
    assert!(
        r["reason"]["message"]
            .as_str()
            .unwrap()
            .contains("draining"),
        "{r}"
    );
    // Requests sent during the drain.
    for _ in 0..3 {
        let (status, v) = gw.run(&short).await;
        assert_eq!(status, 200, "{v}\n{}", logs(dir.path()));
        assert_eq!(answer(&v["result"]), answer(&solo));
    }
    drop(raw);
    a.read_to_end().await;
    a.assert_cut(&logs(dir.path()));
    let status = tokio::time::timeout(START, decode0.wait())
        .await
        .expect("the drained node exits")
        .unwrap();
    assert!(status.success(), "{status:?}\n{}", logs(dir.path()));
    b.read_until(Duration::from_secs(1), |_| false).await;
    assert!(!b.has_error(), "{:?}", b.events.last());
}

/// A `Prefill` for raw request `req` (20 prompt tokens, two destination pages that
/// need not exist) to be written into decode node 0.
fn raw_prefill(req: u64) -> Vec<u8> {
    let tag = |b: u32| json!({"tenant": 77, "seq": req, "epoch": 1, "logical_block": b});
    frame(
        &json!({"control": {
            "msg": {"type": "prefill", "req": req, "tenant": 77, "prompt_tokens": 20,
                    "max_tokens": 4,
                    "dest": [{"page": 0, "tag": tag(0)}, {"page": 1, "tag": tag(1)}]},
            "body": {"tenant": 77, "prompt": vec![100; 20], "max_tokens": 4,
                     "sampling": {}, "stop": [], "ignore_eos": false},
            "decode": 0,
        }}),
        &[],
    )
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
    assert_eq!(r["type"], "rejected", "{r}");
    assert_eq!(r["by"], "Prefill", "{r}");
    assert_eq!(r["reason"]["kind"], "Busy", "{r}");
    assert!(
        r["reason"]["message"]
            .as_str()
            .unwrap()
            .contains("draining"),
        "{r}"
    );
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

/// The decode pool's pages, in pages (one context window of 16-token pages).
const POOL_PAGES: f64 = (CONTEXT / 16) as f64;

/// Scrapes decode node `d`'s `tessera_kv_pages` (free, quarantined) from `url` until
/// `ok` holds for them; panics with the logs of `dir` at the deadline.
async fn wait_pages(
    url: &str,
    d: u16,
    dir: &Path,
    what: &str,
    ok: impl Fn(f64, f64) -> bool,
) -> (f64, f64) {
    let series = |state: &str| {
        format!(r#"tessera_kv_pages{{node="127.0.0.1:{d}",role="decode",state="{state}"}}"#)
    };
    let deadline = Instant::now() + REQUEST;
    loop {
        let pages = (
            metric(url, &series("free")).await,
            metric(url, &series("quarantined")).await,
        );
        if ok(pages.0, pages.1) {
            return pages;
        }
        assert!(
            Instant::now() < deadline,
            "{what} never held: (free, quarantined) = {pages:?}\n{}",
            logs(dir)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A reservation whose coordinator dies before its writer heard of the request (a raw
/// gateway identity reserves it, naming the deployment's running prefill node as its
/// writer, and closes its link without ever sending `Prefill`) is quarantined (a
/// write could still come) and then freed while the prefill node stays up and keeps
/// its link: the decode node asks the writer whether it is quiet for the request,
/// and the writer, which holds no record of it, says so (and keeps a record that
/// would fail a late `Prefill`). The deployment then serves a request that needs the
/// whole decode pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_its_writer_never_heard_of_is_freed_while_the_writer_runs() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = (free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
    let (decode, metrics) = start_node_with_metrics(dir.path(), &config, "decode", d, &[]).await;
    let prefill = start_node(dir.path(), &config, "prefill", p).await;
    let gateway = start_config_gateway(dir.path(), &config, "data", "gateway.log", &[]).await;
    let mut dep = Deployment {
        prefill_addr: format!("127.0.0.1:{p}"),
        decode_addr: format!("127.0.0.1:{d}"),
        dir,
        config,
        prefill: Some(prefill),
        decode: Some(decode),
        gateway,
    };
    // One request: the prefill node's link to the decode node is up.
    dep.gateway.run_when_up(&greedy(4)).await;
    wait_pages(&metrics, d, dep.dir.path(), "a free pool", |free, _| {
        free == POOL_PAGES
    })
    .await;

    let certs = dep.dir.path().join("certs");
    let as_gateway = client(&certs.join("ca.pem"), Some(&identity(&certs, "gateway")));
    let mut gw = Raw::open(d, &node_name("decode", d), &as_gateway, "Coordinator").await;
    let r = raw_req(1);
    gw.send(&raw_prealloc(r, 20, 4, (20, 4), &dep.prefill_addr))
        .await;
    let pages = descriptor(&gw.reply(r).await);
    assert_eq!(pages.len(), 2);
    let (free, _) = wait_pages(&metrics, d, dep.dir.path(), "a reservation", |free, _| {
        free < POOL_PAGES
    })
    .await;
    // The coordinator dies; the prefill node never heard of the request.
    drop(gw);
    wait_pages(
        &metrics,
        d,
        dep.dir.path(),
        "the quarantined pages freed while the writer runs",
        |free, quarantined| free == POOL_PAGES && quarantined == 0.0,
    )
    .await;
    assert!(free < POOL_PAGES);
    let logs = dep.logs();
    for (role, node) in [("prefill", &mut dep.prefill), ("decode", &mut dep.decode)] {
        let node = node.as_mut().unwrap();
        assert!(
            node.try_wait().unwrap().is_none(),
            "the {role} node exited\n{logs}"
        );
    }
    dep.pool_is_free().await;
}

/// Two links from one writer identity (as across a reconnect, when the new link is up
/// before the old one is noticed closed): when one closes, the writer is not gone.
/// A raw gateway identity reserves a request naming the writer; the writer opens two
/// links; the decode node cuts the first (it sends a frame a prefill node may not
/// send), and a flush acknowledged on the second shows the cut was applied; then the
/// coordinator dies. The reservation is quarantined, not freed (writes from the open
/// link could still land), and the decode node asks the writer on its open link
/// whether it is quiet; once that last link closes too, the pages are free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_two_writer_links_closing_does_not_free_a_quarantine() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = (free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
    // The prefill node in the file never runs: only the raw links carry its name.
    let (mut decode, metrics) =
        start_node_with_metrics(dir.path(), &config, "decode", d, &[]).await;
    let certs = dir.path().join("certs");
    let ca = certs.join("ca.pem");
    let as_gateway = client(&ca, Some(&identity(&certs, "gateway")));
    let as_writer = client(
        &ca,
        Some(&identity(&certs, &format!("prefill-127.0.0.1-{p}"))),
    );
    let decode_name = node_name("decode", d);
    let mut gw = Raw::open(d, &decode_name, &as_gateway, "Coordinator").await;
    let r = raw_req(1);
    gw.send(&raw_prealloc(r, 20, 4, (20, 4), &format!("127.0.0.1:{p}")))
        .await;
    let pages = descriptor(&gw.reply(r).await);
    assert_eq!(pages.len(), 2);

    let old = Raw::open(d, &decode_name, &as_writer, "Prefill").await;
    let mut new = Raw::open(d, &decode_name, &as_writer, "Prefill").await;
    let mut old = old;
    old.send(&frame(&json!("drain"), &[])).await;
    old.assert_cut("a drain frame from a prefill identity")
        .await;
    new.send(&frame(&json!({"flush": {"id": 1}}), &[])).await;
    let ack = new.until(|h| !h["flush_ack"].is_null()).await;
    assert_eq!(
        ack,
        Some(json!({"flush_ack": {"id": 1}})),
        "{}",
        logs(dir.path())
    );

    // The coordinator dies: quarantined, and the writer is asked on its open link.
    drop(gw);
    let (_, quarantined) = wait_pages(
        &metrics,
        d,
        dir.path(),
        "a quarantine while a writer link is open",
        |_, quarantined| quarantined > 0.0,
    )
    .await;
    assert_eq!(quarantined, 2.0);
    let query = new
        .until(|h| h["control"]["msg"]["type"] == "quiet_query")
        .await;
    assert_eq!(
        query.map(|h| h["control"]["msg"].clone()),
        Some(json!({"type": "quiet_query", "req": r})),
        "{}",
        logs(dir.path())
    );
    // A page the open link writes now is dropped, never applied.
    let (page_bytes, _) = model_shape();
    new.send(&land(r, &pages[0], &vec![0x11u8; page_bytes]))
        .await;

    // The writer's last link closes: nothing it issued can land any more.
    drop(new);
    wait_pages(
        &metrics,
        d,
        dir.path(),
        "the pages freed once the writer's last link closed",
        |free, quarantined| free == POOL_PAGES && quarantined == 0.0,
    )
    .await;
    assert!(decode.try_wait().unwrap().is_none(), "{}", logs(dir.path()));
}

/// One series of the gateway's `/metrics` (read with `token`), 0 when absent; and
/// whether it is exported at all.
async fn gateway_metric(gw: &Gateway, token: &str, series: &str) -> (f64, bool) {
    let text = reqwest::Client::new()
        .get(format!("{}/metrics", gw.base))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let v = text
        .lines()
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(k, _)| *k == series)
        .and_then(|(_, v)| v.parse().ok());
    (v.unwrap_or(0.0), v.is_some())
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
/// and messages its role never sends. Each is dropped, counted in
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
            "a prefill node's message from a decode identity",
            "wrong_sender",
            Box::new(move |req| {
                control(json!({"type": "abort_ack", "req": req, "from": "Prefill"}))
            }),
        ),
        (
            "a coordinator's message from a decode identity",
            "wrong_sender",
            Box::new(move |req| control(json!({"type": "abort", "req": req}))),
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
