//! A raw node-link client, as whoever can reach a node port: TLS clients with or
//! without a certificate, frames written by hand from the documented format (`u32`
//! header length, JSON header, `u32` payload length, payload), identities named by the
//! documented rule (`<role>-<port>.<host>.tessera`, files `<role>-<host>-<port>.pem`),
//! and the protocol messages a raw gateway or prefill identity sends (`raw_*`).
//!
//! Used by the node-link tests (`node_links.rs`, `node_link_frames.rs`,
//! `node_drain.rs`, `node_quarantine.rs`); a module of `common`, so its dead-code
//! allowance covers the test crates that use none of it.

use super::{model_path, REQUEST};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_engine::{GenerateRequest, Priority};
use tessera_model::sampling::SamplingParams;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadHalf, WriteHalf};
use tokio::net::TcpStream;

/// How long a node may take to close a link it refused (its handshake timeout is 10 s).
pub const REFUSAL: Duration = Duration::from_secs(15);

/// One frame: `u32` BE header length, the JSON header, `u32` BE payload length, payload.
pub fn frame(header: &Value, payload: &[u8]) -> Vec<u8> {
    let h = serde_json::to_vec(header).unwrap();
    let mut b = (h.len() as u32).to_be_bytes().to_vec();
    b.extend(&h);
    b.extend((payload.len() as u32).to_be_bytes());
    b.extend(payload);
    b
}

pub fn hello(from: &str) -> Vec<u8> {
    frame(&json!({"hello": {"from": from}}), &[])
}

/// Reads one frame; its header as JSON (`null` when it is not JSON).
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> std::io::Result<Value> {
    let n = r.read_u32().await? as usize;
    let mut h = vec![0u8; n];
    r.read_exact(&mut h).await?;
    let p = r.read_u32().await? as usize;
    let mut payload = vec![0u8; p];
    r.read_exact(&mut payload).await?;
    Ok(serde_json::from_slice(&h).unwrap_or(Value::Null))
}

/// [`read_frame`] whose first byte was read already.
pub async fn read_frame_after<R: AsyncRead + Unpin>(
    first: u8,
    r: &mut R,
) -> std::io::Result<Value> {
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
pub async fn read_frames<R: AsyncRead + Unpin>(r: &mut R, wait: Duration) -> (Vec<Value>, bool) {
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

pub fn is_welcome(h: &Value) -> bool {
    !h["welcome"].is_null()
}

/// Reads the first frame that is not a ping (the node's answer to hello).
pub async fn first_frame<R: AsyncRead + Unpin>(r: &mut R) -> Option<Value> {
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
pub async fn assert_refused<S: AsyncRead + AsyncWrite + Unpin>(mut s: S, hello: &[u8], what: &str) {
    let _ = s.write_all(hello).await;
    let (frames, ended) = read_frames(&mut s, REFUSAL).await;
    assert!(ended, "{what}: the node kept the link open");
    assert!(
        !frames.iter().any(is_welcome),
        "{what}: the node welcomed the peer: {frames:?}"
    );
}

/// A node's identity name by the documented rule.
pub fn node_name(role: &str, port: u16) -> String {
    format!("{role}-{port}.127.0.0.1.tessera")
}

/// (certificate, key) files of an identity stem in `certs`.
pub fn identity(certs: &Path, stem: &str) -> (PathBuf, PathBuf) {
    (
        certs.join(format!("{stem}.pem")),
        certs.join(format!("{stem}.key")),
    )
}

/// A TLS client trusting `ca`, presenting `me` (certificate, key) if given.
pub fn client(ca: &Path, me: Option<&(PathBuf, PathBuf)>) -> tokio_rustls::TlsConnector {
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

/// A TLS server presenting `cert` and `key` (files), asking no client certificate: a
/// rogue node on an address a gateway dials.
pub fn tls_server(cert: &Path, key: &Path) -> tokio_rustls::TlsAcceptor {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let server = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            CertificateDer::pem_file_iter(cert)
                .unwrap()
                .map(|c| c.unwrap())
                .collect(),
            PrivateKeyDer::from_pem_file(key).unwrap(),
        )
        .unwrap();
    tokio_rustls::TlsAcceptor::from(Arc::new(server))
}

pub type Tls = tokio_rustls::client::TlsStream<TcpStream>;

/// Connects with TLS to `port`, asking for identity `name`.
pub async fn tls(port: u16, name: &str, c: &tokio_rustls::TlsConnector) -> std::io::Result<Tls> {
    let tcp = TcpStream::connect(("127.0.0.1", port)).await?;
    let name = ServerName::try_from(name.to_string()).unwrap();
    tokio::time::timeout(REFUSAL, c.connect(name, tcp))
        .await
        .map_err(|_| std::io::Error::other("handshake timed out"))?
}

/// Asserts the link is refused: at the handshake, or by closing it after `hello`.
pub async fn assert_tls_refused(
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

/// A raw node link with a valid identity: frames written by hand, frames read with
/// deadlines. Frames read while waiting for another are kept, in order, for later.
pub struct Raw {
    r: ReadHalf<Tls>,
    w: WriteHalf<Tls>,
    kept: Vec<Value>,
    /// When this side last wrote (it pings after a second without a write).
    sent: Instant,
}

impl Raw {
    /// TLS to `port` (identity `name`) as `c`, `Hello { from }`, and its welcome.
    pub async fn open(port: u16, name: &str, c: &tokio_rustls::TlsConnector, from: &str) -> Self {
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

    pub async fn send(&mut self, bytes: &[u8]) {
        self.w.write_all(bytes).await.unwrap();
        self.sent = Instant::now();
    }

    /// The first frame (kept or new) that `want` accepts; the others stay kept (pings
    /// are dropped). While it waits it pings after every second without a write, as
    /// a node does (the node closes a link it reads nothing from as dead). `None`
    /// when the link ends first or the deadline passes.
    pub async fn until(&mut self, want: impl Fn(&Value) -> bool) -> Option<Value> {
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
    pub async fn reply(&mut self, req: u64) -> Value {
        let h = self.until(|h| h["control"]["msg"]["req"] == req).await;
        h.unwrap_or_else(|| panic!("no reply about request {req}"))["control"]["msg"].clone()
    }

    /// How many stream events about `req` were kept.
    pub fn events(&self, req: u64) -> usize {
        self.kept
            .iter()
            .filter(|h| h["event"]["req"] == req)
            .count()
    }

    /// Asserts that the node closes the link (whatever it sends first).
    pub async fn assert_cut(mut self, what: &str) {
        let (_, ended) = read_frames(&mut self.r, REFUSAL).await;
        assert!(ended, "{what}: the node kept the link open");
    }
}

/// What a raw client needs to know of the model: one KV page's size on the wire
/// (the deployment's 16-token pages) and the vocabulary size.
pub fn model_shape() -> (usize, usize) {
    let m = tessera_model::LoadedModel::load(&model_path()).unwrap();
    let c = m.transformer.config();
    (c.kv_layout(16).page_bytes(), c.vocab)
}

/// TLS connectors for raw clients of the deployment in `dir`: as the gateway
/// identity, and as prefill node `127.0.0.1:{prefill}` (a writer).
pub fn gateway_and_writer(
    dir: &Path,
    prefill: u16,
) -> (tokio_rustls::TlsConnector, tokio_rustls::TlsConnector) {
    let certs = dir.join("certs");
    let ca = certs.join("ca.pem");
    let as_gateway = client(&ca, Some(&identity(&certs, "gateway")));
    let as_writer = client(
        &ca,
        Some(&identity(&certs, &format!("prefill-127.0.0.1-{prefill}"))),
    );
    (as_gateway, as_writer)
}

/// A raw request's id (a gateway draws 64 random bits per request: they do not meet).
pub fn raw_req(i: u64) -> u64 {
    0x7a57_0000_0000_0000 + i
}

/// `Prealloc` for raw request `req` with a body of `prompt` tokens and `max_tokens`,
/// claiming `counts` (prompt, max) in the message, written by the prefill node
/// `writer` (its address in the deployment file). Greedy; it ignores end-of-sequence,
/// so it decodes until `max_tokens` or until it is ended.
pub fn raw_prealloc(
    req: u64,
    prompt: usize,
    max_tokens: usize,
    counts: (usize, usize),
    writer: &str,
) -> Vec<u8> {
    raw_prealloc_in(req, prompt, max_tokens, counts, writer, None)
}

/// [`raw_prealloc`] of a request in prefix-cache namespace `namespace` (`None`: its
/// pages are never cached).
pub fn raw_prealloc_in(
    req: u64,
    prompt: usize,
    max_tokens: usize,
    counts: (usize, usize),
    writer: &str,
    namespace: Option<[u8; 32]>,
) -> Vec<u8> {
    let body = GenerateRequest {
        priority: Priority::default(),
        sampling: SamplingParams::default(),
        ignore_eos: true,
        cache_namespace: namespace,
        ..GenerateRequest::new(
            77,
            (0..prompt as u32).map(|i| 100 + i).collect(),
            max_tokens,
        )
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
pub fn descriptor(reply: &Value) -> Vec<Value> {
    assert_eq!(reply["type"], "descriptor", "{reply}");
    reply["pages"].as_array().unwrap().clone()
}

/// A page write of `bytes` for `req` into `dest`.
pub fn land(req: u64, dest: &Value, bytes: &[u8]) -> Vec<u8> {
    frame(&json!({"land": {"req": req, "dest": dest}}), bytes)
}

/// The commit of `req`'s `pages`, each holding `bytes` (`tokens` prompt tokens).
pub fn raw_commit(
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

/// A `Prefill` for raw request `req` (20 prompt tokens, two destination pages that
/// need not exist) to be written into decode node 0.
pub fn raw_prefill(req: u64) -> Vec<u8> {
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
