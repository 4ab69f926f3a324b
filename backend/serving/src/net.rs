//! Node links: the frame format, its size caps, and connections whose reads and
//! writes run as tasks on a small tokio runtime of their own, so no engine or
//! coordinator thread ever blocks on a socket.
//!
//! Frame: `u32` big-endian header length, the header as JSON ([`Frame`]), `u32`
//! big-endian payload length, the payload (page bytes for `Land`, a chunk of a LoRA
//! adapter's file for `Adapter`, else empty). Both lengths are checked before
//! anything is allocated: a header over [`LinkSettings::max_header`], a `Land`
//! payload that is not exactly one page of the receiving node's layout, an `Adapter`
//! payload that is empty or over [`ADAPTER_CHUNK`] (or on a link that takes none), or
//! any other frame with a payload closes the connection (and counts in
//! [`PdCounters::frames_rejected`]).
//!
//! Every link (TLS or, on loopback only, plain TCP; see [`crate::link_security`])
//! starts with `Hello` from the dialer, answered by `Welcome` (the node's incarnation,
//! and for a prefill node at a decode node its UCX region). Both ends send `Ping`
//! after [`LinkSettings::heartbeat`] without a frame; a link that reads nothing for
//! [`LinkSettings::dead_after`], or whose write does not complete within it, is closed
//! as dead.
//!
//! Connections (one per pair, opened by the caller):
//! - gateway -> every node: protocol messages both ways; a decode node also streams
//!   each request's events (tokens, then `Done` or `Error`) on it, always before the
//!   `Finished` that follows them (one writer queue per connection keeps the order);
//!   a node says `Status { draining }` on it; `tessera node drain` sends `Drain`;
//! - prefill node -> every decode node: `Commit`s, and page writes for the `tcp`
//!   transport (a `Land` frame per page, a `Flush` answered by `FlushAck` once the
//!   decode node applied every earlier write); the decode node asks `QuietQuery` on
//!   it (about a reservation it quarantined when the coordinator was lost), and the
//!   prefill node answers `WriterQuiet` on the same link.

use crate::cache_query::{CacheAnswer, CacheQuery};
use crate::error::{ServeError, ServeErrorKind};
use crate::link_security::{LinkSettings, NodeLinks, ReadHalf, WriteHalf, HANDSHAKE_TIMEOUT};
use crate::links::PdCounters;
use crate::stream::StreamEvent;
use serde::{Deserialize, Serialize};
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tessera_engine::{Event, FinishReason, GenerateRequest, Usage};
use tessera_model::sampling::Logprobs;
use tessera_transfer::protocol::{Msg, ReqId, Role};
use tessera_transfer::transport::DestPage;
use tessera_transfer::ucx::UcxRegionDescriptor;
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{mpsc, watch};

/// Frames a connection queues for its writer before it counts as stalled: a sender
/// that finds the queue full closes the connection (the peer is not reading).
pub(crate) const WRITE_QUEUE: usize = 4096;

/// The node links' runtime: sockets only (two worker threads), started on first use
/// and kept for the life of the process.
fn runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tessera-links")
            .enable_all()
            .build()
            .expect("cannot start the node links' runtime")
    })
}

/// Runs `f` on the links' runtime.
pub(crate) fn spawn(f: impl Future<Output = ()> + Send + 'static) {
    runtime().spawn(f);
}

/// Enters the links' runtime (to register signal handlers or listeners on it).
pub(crate) fn enter() -> tokio::runtime::EnterGuard<'static> {
    runtime().enter()
}

/// Runs `f` on the links' runtime and waits for it on this thread (any thread, also
/// one of another runtime: it blocks only this thread).
///
/// Errors: `f`'s, or its task panicked.
pub(crate) fn block_on<T: Send + 'static>(
    f: impl Future<Output = io::Result<T>> + Send + 'static,
) -> io::Result<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    runtime().spawn(async move {
        let _ = tx.send(f.await);
    });
    rx.recv()
        .unwrap_or_else(|_| Err(io::Error::other("node link task ended")))
}

/// One frame's header. Externally tagged: serde's internally tagged enums buffer
/// their content, which cannot hold the `u128` sampler position. New variants and
/// fields are additive (serde defaults), so mixed versions fail only on what they
/// do not know.
// A frame lives only between a socket read and its dispatch; boxing the control
// variant would cost an allocation per message for no memory saved.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Frame {
    /// First frame on a connection: the caller's role (checked against its
    /// certificate on TLS links) and, for a node, its name (its listen address in the
    /// deployment file; on TLS links the certificate's address is used instead).
    Hello {
        from: Role,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
        /// The fingerprint (hex) of the model the caller serves; a node serving
        /// another model refuses the link (absent: not checked).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        model: Option<String>,
    },
    /// A node's answer to an accepted `Hello`.
    Welcome {
        /// Random per node process start: a restarted node is a new node.
        incarnation: u64,
        /// For a prefill node at a decode node: where UCX puts go, when the decode
        /// node registered its pool with UCX (`None`: TCP frames only).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ucx: Option<UcxRegionDescriptor>,
        /// The node is draining: route no new requests to it.
        #[serde(default)]
        draining: bool,
        /// The fingerprint (hex) of the model the node serves; a dialer serving
        /// another model drops the link.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        model: Option<String>,
    },
    /// A protocol message, with what the protocol leaves out.
    Control(Control),
    /// One page write; the payload is the page.
    Land { req: u64, dest: DestPage },
    /// Answer `FlushAck { id }` once every earlier frame was applied.
    Flush { id: u64 },
    /// See `Flush`.
    FlushAck { id: u64 },
    /// Decode node -> gateway: one event of a request's stream.
    Event { req: ReqId, event: WireEvent },
    /// Heartbeat (either direction), sent when a link was idle.
    Ping,
    /// Node -> gateway: the node's readiness changed (`draining`: route nothing new).
    Status { draining: bool },
    /// Gateway identity -> node: start draining (`tessera node drain`).
    Drain,
    /// Gateway -> node: a question about its engine's prefix cache, answered with
    /// a `CacheAnswer` of the same `id`.
    Cache { id: u64, query: CacheQuery },
    /// Node -> gateway: the answer to `Cache` `id`.
    CacheAnswer { id: u64, answer: CacheAnswer },
    /// Gateway -> draining decode node: request `req`'s KV, kept for a move, will
    /// not be moved (the client left, the request could not go on, or its move
    /// failed before its `Prefill`): the drain stops waiting for it.
    Unkeep { req: ReqId },
    /// Gateway identity -> node: bytes `offset..offset + payload` of fine-tune
    /// `id`'s LoRA adapter file (`total` bytes, SHA-256 `sha256`, lowercase hex),
    /// in order, before the first request that runs under it on this link
    /// ([`crate::adapters`]).
    Adapter {
        id: String,
        sha256: String,
        offset: u64,
        total: u64,
    },
}

/// Largest `Adapter` payload: an adapter's file goes in chunks of at most this.
pub(crate) const ADAPTER_CHUNK: usize = 1 << 20;

/// A protocol message on the wire, with what the protocol leaves out: the request body
/// (`Prealloc`, `Prefill`), the decode node chosen (`Prefill`), the prefill node
/// assigned to write (`Prealloc`), the sampler position and the prompt tokens taken
/// from the prefill node's cache (`Commit`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Control {
    pub(crate) msg: Msg,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) body: Option<GenerateRequest>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) decode: Option<usize>,
    /// The decode node chosen (`Prefill`), by its address in the deployment file:
    /// a prefill node uses it over `decode` (an index into its own file's list,
    /// which a gateway that reloaded its membership may no longer share).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) decode_node: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) rng_pos: Option<u128>,
    /// Prompt tokens the prefill node took from its prefix cache (`Commit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cached_tokens: Option<usize>,
    /// Of `cached_tokens`, those the prefill node restored from its lower tiers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cached_tiers: Option<tessera_engine::CachedTiers>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) prefill: Option<String>,
    /// The request's W3C `traceparent` (with `Prealloc` and `Prefill`, when the
    /// gateway exports traces), so the node's spans join the request's trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) trace: Option<String>,
    /// The fingerprint (hex) of the model that computed the committed KV (`Commit`);
    /// a decode node serving another model fails the commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) model: Option<String>,
    /// The first token's and the prompt's log probabilities (`Commit`, when the
    /// request asked for them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) logprobs: Option<Box<Logprobs>>,
    /// Gateway -> decode node: the message is for the node's writer (`Prefill`,
    /// `Abort`), which moves a drained request's KV to another decode node, not for
    /// its decode side.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub(crate) to_writer: bool,
    /// With a move's `Prefill` (`to_writer`): the request, by its id on the
    /// draining node, whose KV it moves (the node stops waiting for it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) moves: Option<ReqId>,
}

impl Control {
    /// The message with nothing beside it.
    pub(crate) fn new(msg: Msg) -> Self {
        Self {
            msg,
            body: None,
            decode: None,
            decode_node: None,
            rng_pos: None,
            cached_tokens: None,
            cached_tiers: None,
            prefill: None,
            trace: None,
            model: None,
            logprobs: None,
            to_writer: false,
            moves: None,
        }
    }
}

impl Frame {
    /// A control frame with nothing beside the message.
    pub(crate) fn control(msg: Msg) -> Self {
        Self::Control(Control::new(msg))
    }

    /// The variant's name (logs, violation messages).
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            Frame::Hello { .. } => "hello",
            Frame::Welcome { .. } => "welcome",
            Frame::Control { .. } => "control",
            Frame::Land { .. } => "land",
            Frame::Flush { .. } => "flush",
            Frame::FlushAck { .. } => "flush_ack",
            Frame::Event { .. } => "event",
            Frame::Ping => "ping",
            Frame::Status { .. } => "status",
            Frame::Drain => "drain",
            Frame::Cache { .. } => "cache",
            Frame::CacheAnswer { .. } => "cache_answer",
            Frame::Unkeep { .. } => "unkeep",
            Frame::Adapter { .. } => "adapter",
        }
    }
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A stream event on the wire.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum WireEvent {
    Token {
        id: u32,
        text: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        logprobs: Option<Box<Logprobs>>,
        /// The sampler's RNG word position after the token (0 for greedy).
        #[serde(default, skip_serializing_if = "is_zero")]
        rng: u64,
    },
    Done {
        stop: bool,
        prompt_tokens: usize,
        completion_tokens: usize,
        #[serde(default)]
        cached_tokens: usize,
        #[serde(default)]
        cached_tiers: tessera_engine::CachedTiers,
        ttft_us: u64,
        tpot_us: u64,
    },
    Error {
        kind: ServeErrorKind,
        message: String,
    },
}

impl WireEvent {
    /// An engine event as the decode node sends it.
    pub(crate) fn from_event(e: Event) -> Self {
        match e.map_error(ServeError::from) {
            StreamEvent::Token {
                id,
                text,
                logprobs,
                rng_word_pos,
            } => Self::Token {
                id,
                text,
                logprobs,
                rng: rng_word_pos,
            },
            StreamEvent::Done { reason, usage } => Self::Done {
                stop: reason == FinishReason::Stop,
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
                cached_tokens: usage.cached_tokens,
                cached_tiers: usage.cached_tiers,
                ttft_us: usage.ttft.as_micros() as u64,
                tpot_us: usage.tpot.as_micros() as u64,
            },
            StreamEvent::Error(e) => Self::Error {
                kind: e.kind(),
                message: e.message().to_string(),
            },
        }
    }

    /// The event as the gateway's stream receives it.
    pub(crate) fn into_stream_event(self) -> StreamEvent {
        match self {
            Self::Token {
                id,
                text,
                logprobs,
                rng,
            } => StreamEvent::Token {
                id,
                text,
                logprobs,
                rng_word_pos: rng,
            },
            Self::Done {
                stop,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                cached_tiers,
                ttft_us,
                tpot_us,
            } => StreamEvent::Done {
                reason: if stop {
                    FinishReason::Stop
                } else {
                    FinishReason::Length
                },
                usage: Usage {
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                    cached_tiers,
                    ttft: Duration::from_micros(ttft_us),
                    tpot: Duration::from_micros(tpot_us),
                },
            },
            Self::Error { kind, message } => StreamEvent::Error(ServeError::new(kind, message)),
        }
    }

    /// Whether it ends the stream.
    pub(crate) fn is_final(&self) -> bool {
        !matches!(self, Self::Token { .. })
    }
}

/// Encodes one frame.
fn encode(f: &Frame, payload: &[u8]) -> io::Result<Vec<u8>> {
    let header = serde_json::to_vec(f).map_err(io::Error::other)?;
    let mut buf = Vec::with_capacity(8 + header.len() + payload.len());
    buf.extend_from_slice(&(header.len() as u32).to_be_bytes());
    buf.extend_from_slice(&header);
    buf.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    buf.extend_from_slice(payload);
    Ok(buf)
}

/// Why a link ended.
#[derive(Debug)]
pub(crate) enum LinkEnd {
    /// Closed by either side, or an I/O error.
    Closed(String),
    /// Nothing read for [`LinkSettings::dead_after`].
    Silent,
    /// The peer broke the frame rules (a size cap, a malformed header, a frame it may
    /// not send, a budget): the link is closed and the violation counted.
    Violation(String),
}

impl std::fmt::Display for LinkEnd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkEnd::Closed(why) => write!(f, "closed: {why}"),
            LinkEnd::Silent => f.write_str("dead: no frame within the liveness deadline"),
            LinkEnd::Violation(why) => write!(f, "closed for a violation: {why}"),
        }
    }
}

impl LinkEnd {
    /// Logs the end of the link to `peer` and counts a violation in `counters`.
    pub(crate) fn note(&self, peer: &str, counters: &PdCounters) {
        match self {
            LinkEnd::Violation(_) => {
                counters.frames_rejected.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(peer, "node link {self}");
            }
            LinkEnd::Silent => tracing::warn!(peer, "node link {self}"),
            LinkEnd::Closed(_) => tracing::debug!(peer, "node link {self}"),
        }
    }
}

/// What a reader accepts.
#[derive(Clone, Copy, Debug)]
pub(crate) struct FrameLimits {
    /// Largest header, bytes.
    pub(crate) max_header: usize,
    /// The exact payload of a `Land` frame (one page of the receiving node's layout);
    /// `None`: the link takes no page writes.
    pub(crate) page_bytes: Option<usize>,
    /// Whether `Adapter` frames (1 to [`ADAPTER_CHUNK`] payload bytes) may come
    /// (a node's inbound links; only a gateway identity may then send them).
    pub(crate) adapters: bool,
}

/// The reading half of a link: whole frames, pings skipped, each within the
/// liveness deadline.
pub(crate) struct FrameReader {
    r: BufReader<ReadHalf>,
    limits: FrameLimits,
    dead_after: Duration,
    /// The connection whose last-heard time every frame read (pings too) renews.
    heard: Option<Arc<State>>,
}

/// Milliseconds since the first call in this process (the clock of
/// [`State::heard_ms`]).
fn now_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

async fn read_len(r: &mut BufReader<ReadHalf>) -> Result<usize, LinkEnd> {
    r.read_u32()
        .await
        .map(|n| n as usize)
        .map_err(|e| LinkEnd::Closed(e.to_string()))
}

/// Reads one frame, checking both lengths against `limits` before allocating.
async fn read_frame(
    r: &mut BufReader<ReadHalf>,
    limits: FrameLimits,
) -> Result<(Frame, Vec<u8>), LinkEnd> {
    let closed = |e: io::Error| LinkEnd::Closed(e.to_string());
    let n = read_len(r).await?;
    if n > limits.max_header {
        return Err(LinkEnd::Violation(format!(
            "a frame header of {n} bytes (at most {})",
            limits.max_header
        )));
    }
    let mut header = vec![0u8; n];
    r.read_exact(&mut header).await.map_err(closed)?;
    let f: Frame = serde_json::from_slice(&header)
        .map_err(|e| LinkEnd::Violation(format!("a malformed frame header: {e}")))?;
    let p = read_len(r).await?;
    let expected = match &f {
        Frame::Land { .. } => limits
            .page_bytes
            .ok_or_else(|| LinkEnd::Violation("a page write on a link that takes none".into()))?,
        Frame::Adapter { .. } if limits.adapters && (1..=ADAPTER_CHUNK).contains(&p) => p,
        Frame::Adapter { .. } => {
            return Err(LinkEnd::Violation(format!(
                "an adapter frame with a {p}-byte payload (1 to {ADAPTER_CHUNK}, on a node's link)"
            )))
        }
        _ => 0,
    };
    if p != expected {
        return Err(LinkEnd::Violation(format!(
            "a {} frame with a {p}-byte payload (expected {expected})",
            f.kind()
        )));
    }
    let mut payload = vec![0u8; p];
    r.read_exact(&mut payload).await.map_err(closed)?;
    Ok((f, payload))
}

impl FrameReader {
    /// Reads frames from `r` under `limits`; a link silent for `dead_after` is dead.
    pub(crate) fn new(r: ReadHalf, limits: FrameLimits, dead_after: Duration) -> Self {
        Self {
            r: BufReader::new(r),
            limits,
            dead_after,
            heard: None,
        }
    }

    /// Renews `conn`'s last-heard time ([`Conn::silent_for`]) at every frame read
    /// from now on, pings included.
    pub(crate) fn hear_for(&mut self, conn: &Conn) {
        self.heard = Some(conn.state.clone());
    }

    /// Accepts page writes of `bytes` from now on (a prefill node's link).
    pub(crate) fn take_pages(&mut self, bytes: usize) {
        self.limits.page_bytes = Some(bytes);
    }

    /// The next frame that is not a `Ping`.
    pub(crate) async fn next(&mut self) -> Result<(Frame, Vec<u8>), LinkEnd> {
        loop {
            let f = tokio::time::timeout(self.dead_after, read_frame(&mut self.r, self.limits))
                .await
                .map_err(|_| LinkEnd::Silent)??;
            if let Some(h) = &self.heard {
                h.heard_ms.store(now_ms(), Ordering::Relaxed);
            }
            if !matches!(f.0, Frame::Ping) {
                return Ok(f);
            }
        }
    }

    /// The next frame, or how the link ended; also ends when `conn` is closed.
    pub(crate) async fn next_on(&mut self, conn: &Conn) -> Result<(Frame, Vec<u8>), LinkEnd> {
        tokio::select! {
            _ = conn.closed() => Err(LinkEnd::Closed("closed by this side".into())),
            f = self.next() => f,
        }
    }
}

/// What a connection's writer task takes.
enum Out {
    Frame(Vec<u8>),
    /// Close once everything queued before is written.
    Finish,
}

/// A connection's liveness, shared with its writer task.
struct State {
    alive: AtomicBool,
    closed: watch::Sender<bool>,
    /// When the link's reader last read a frame ([`now_ms`]; the start, before any).
    heard_ms: AtomicU64,
}

impl State {
    fn close(&self) {
        self.alive.store(false, Ordering::Release);
        self.closed.send_replace(true);
    }
}

/// The writing half of a connection: frames are queued and written by the
/// connection's writer task, in order.
pub(crate) struct Conn {
    tx: mpsc::Sender<Out>,
    state: Arc<State>,
    peer: String,
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn")
            .field("peer", &self.peer)
            .field("alive", &self.is_alive())
            .finish()
    }
}

/// The writer task: queued frames (batched into one flush), a `Ping` after
/// `heartbeat` of silence, every write within `dead_after`; ends (closing the
/// connection) on a failed or stuck write, on `close`, on `Finish`, or when every
/// [`Conn`] handle is gone.
async fn write_loop(state: Arc<State>, w: WriteHalf, mut rx: mpsc::Receiver<Out>, s: LinkSettings) {
    let mut w = BufWriter::new(w);
    let mut closed = state.closed.subscribe();
    let ping = encode(&Frame::Ping, &[]).unwrap_or_default();
    loop {
        let first = tokio::select! {
            biased;
            _ = closed.wait_for(|c| *c) => break,
            m = rx.recv() => match m {
                Some(m) => m,
                None => break,
            },
            _ = tokio::time::sleep(s.heartbeat) => Out::Frame(ping.clone()),
        };
        let mut finish = false;
        let write = async {
            let mut next = Some(first);
            while let Some(m) = next.take() {
                match m {
                    Out::Frame(b) => w.write_all(&b).await?,
                    Out::Finish => {
                        finish = true;
                        break;
                    }
                }
                next = rx.try_recv().ok();
            }
            w.flush().await
        };
        let ok = tokio::select! {
            biased;
            _ = closed.wait_for(|c| *c) => false,
            r = tokio::time::timeout(s.dead_after, write) => matches!(r, Ok(Ok(()))),
        };
        if !ok || finish {
            break;
        }
    }
    state.close();
    let _ = tokio::time::timeout(Duration::from_secs(1), w.shutdown()).await;
}

impl Conn {
    /// Starts the writer task of `w`; `peer` names the other end in logs.
    pub(crate) fn start(w: WriteHalf, peer: String, s: LinkSettings) -> Arc<Self> {
        let (tx, rx) = mpsc::channel(WRITE_QUEUE);
        let state = Arc::new(State {
            alive: AtomicBool::new(true),
            closed: watch::channel(false).0,
            heard_ms: AtomicU64::new(now_ms()),
        });
        spawn(write_loop(state.clone(), w, rx, s));
        Arc::new(Self { tx, state, peer })
    }

    /// The other end, for logs.
    pub(crate) fn peer(&self) -> &str {
        &self.peer
    }

    /// Queues a frame without blocking. A full queue means the peer stopped reading:
    /// the connection is closed. Returns whether the frame was queued.
    pub(crate) fn try_send(&self, f: &Frame, payload: &[u8]) -> bool {
        if !self.is_alive() {
            return false;
        }
        let Ok(buf) = encode(f, payload) else {
            return false;
        };
        match self.tx.try_send(Out::Frame(buf)) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Full(_)) => {
                tracing::warn!(peer = %self.peer, "peer stopped reading; closing the connection");
                self.close();
                false
            }
            Err(mpsc::error::TrySendError::Closed(_)) => {
                self.close();
                false
            }
        }
    }

    /// Queues a frame, waiting for room (transfer workers only: they may block; never
    /// call it from an async task). A writer that cannot write within the liveness
    /// deadline closes the connection, which ends the wait.
    pub(crate) fn send(&self, f: &Frame, payload: &[u8]) -> bool {
        if !self.is_alive() {
            return false;
        }
        let Ok(buf) = encode(f, payload) else {
            return false;
        };
        self.tx.blocking_send(Out::Frame(buf)).is_ok()
    }

    /// Queues a protocol message.
    pub(crate) fn control(&self, msg: Msg) -> bool {
        self.try_send(&Frame::control(msg), &[])
    }

    /// Closes the connection once every frame queued so far is written.
    pub(crate) fn finish(&self) {
        if self.tx.try_send(Out::Finish).is_err() {
            self.close();
        }
    }

    /// Closes both directions at once (readers see the end).
    pub(crate) fn close(&self) {
        self.state.close();
    }

    /// Time since the link's reader last read a frame (pings included; since the
    /// connection started when no reader was joined by [`FrameReader::hear_for`]).
    /// The peer pings after a heartbeat of silence, so more than a heartbeat here
    /// means it missed one.
    pub(crate) fn silent_for(&self) -> Duration {
        let heard = self.state.heard_ms.load(Ordering::Relaxed);
        Duration::from_millis(now_ms().saturating_sub(heard))
    }

    /// Whether the connection is still usable.
    pub(crate) fn is_alive(&self) -> bool {
        self.state.alive.load(Ordering::Acquire)
    }

    /// Resolves once the connection is closed.
    pub(crate) async fn closed(&self) {
        let mut rx = self.state.closed.subscribe();
        let _ = rx.wait_for(|c| *c).await;
    }
}

impl crate::links::Link for Conn {
    fn close(&self) {
        Conn::close(self);
    }
}

impl crate::links::Reply for Conn {
    fn send(&self, msg: Msg) -> bool {
        self.control(msg)
    }
}

/// What a node said in answer to `Hello`.
#[derive(Debug)]
pub(crate) struct Welcome {
    /// Its incarnation (random per process start).
    pub(crate) incarnation: u64,
    /// Its UCX region (decode node, to a prefill node).
    pub(crate) ucx: Option<UcxRegionDescriptor>,
    /// Whether it is draining.
    pub(crate) draining: bool,
}

/// Dials `addr` (expecting identity `peer_name`), says `Hello { from, name }` and reads
/// the `Welcome`. Returns the connection, the welcome, and the reader for the rest
/// of the link (which takes page writes of `page_bytes`, if any).
///
/// Errors: no connection, a failed handshake (another identity, another CA), no
/// welcome within the handshake timeout (a node that refused us closes the link).
pub(crate) async fn open_link(
    links: NodeLinks,
    addr: String,
    peer_name: String,
    from: Role,
    name: Option<String>,
    page_bytes: Option<usize>,
) -> io::Result<(Arc<Conn>, Welcome, FrameReader)> {
    let s = links.settings();
    let (r, w) = links.dial(&addr, &peer_name).await?;
    let conn = Conn::start(w, addr.clone(), s);
    let mut reader = FrameReader::new(
        r,
        FrameLimits {
            max_header: s.max_header,
            page_bytes,
            adapters: false,
        },
        s.dead_after,
    );
    reader.hear_for(&conn);
    let model = links.model();
    if !conn.try_send(&Frame::Hello { from, name, model }, &[]) {
        return Err(io::Error::other("the connection closed before hello"));
    }
    let answer = tokio::time::timeout(HANDSHAKE_TIMEOUT, reader.next()).await;
    let fail = |m: String| {
        conn.close();
        // Not `ConnectionRefused`: the peer answered, and was refused (counted).
        Err(io::Error::new(io::ErrorKind::PermissionDenied, m))
    };
    match answer {
        Ok(Ok((
            Frame::Welcome {
                incarnation,
                ucx,
                draining,
                model,
            },
            _,
        ))) => match links.check_model(model.as_deref()) {
            Err(why) => fail(format!("{addr}: {why}")),
            Ok(()) => Ok((
                conn.clone(),
                Welcome {
                    incarnation,
                    ucx,
                    draining,
                },
                reader,
            )),
        },
        Ok(Ok((f, _))) => fail(format!("{addr} answered hello with a {} frame", f.kind())),
        Ok(Err(e)) => fail(format!("{addr} did not welcome us ({e})")),
        Err(_) => fail(format!("{addr} did not answer hello in time")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(page_bytes: Option<usize>) -> FrameLimits {
        FrameLimits {
            max_header: 1024,
            page_bytes,
            adapters: false,
        }
    }

    /// Reads one frame from `bytes` as a link would.
    fn read(bytes: Vec<u8>, l: FrameLimits) -> Result<(Frame, Vec<u8>), LinkEnd> {
        block_on(async move {
            let r: ReadHalf = Box::new(std::io::Cursor::new(bytes));
            let mut reader = FrameReader::new(r, l, Duration::from_secs(5));
            Ok(reader.next().await)
        })
        .unwrap()
    }

    fn dest() -> DestPage {
        DestPage {
            page: 3,
            tag: tessera_kernels::PageTag {
                tenant: 1,
                seq: 2,
                epoch: 3,
                logical_block: 0,
            },
        }
    }

    fn violation(r: Result<(Frame, Vec<u8>), LinkEnd>) -> String {
        match r {
            Err(LinkEnd::Violation(m)) => m,
            other => panic!("expected a violation, got {other:?}"),
        }
    }

    #[test]
    fn frames_round_trip_and_pings_are_skipped() {
        let mut bytes = encode(&Frame::Ping, &[]).unwrap();
        bytes.extend(encode(&Frame::Flush { id: 7 }, &[]).unwrap());
        let (f, p) = read(bytes, limits(None)).unwrap();
        assert!(matches!(f, Frame::Flush { id: 7 }), "{f:?}");
        assert!(p.is_empty());
        let bytes = encode(
            &Frame::Land {
                req: 1,
                dest: dest(),
            },
            &[9; 64],
        )
        .unwrap();
        let (f, p) = read(bytes, limits(Some(64))).unwrap();
        assert!(matches!(f, Frame::Land { req: 1, .. }));
        assert_eq!(p, vec![9; 64]);
    }

    #[test]
    fn size_caps_are_checked_from_the_length_prefix() {
        // A 256 MiB header is refused from its prefix alone (nothing follows it).
        let m = violation(read((256u32 << 20).to_be_bytes().to_vec(), limits(None)));
        assert!(m.contains("268435456 bytes (at most 1024)"), "{m}");
        // A payload on a frame that has none, announced as 256 MiB.
        let mut bytes = encode(&Frame::Flush { id: 1 }, &[]).unwrap();
        let n = bytes.len();
        bytes[n - 4..].copy_from_slice(&(256u32 << 20).to_be_bytes());
        let m = violation(read(bytes, limits(Some(64))));
        assert!(
            m.contains("flush frame with a 268435456-byte payload (expected 0)"),
            "{m}"
        );
        let dest = dest();
        // A page of the wrong size, and a page where none are taken.
        let m = violation(read(
            encode(&Frame::Land { req: 1, dest }, &[0; 63]).unwrap(),
            limits(Some(64)),
        ));
        assert!(m.contains("63-byte payload (expected 64)"), "{m}");
        let m = violation(read(
            encode(&Frame::Land { req: 1, dest }, &[0; 64]).unwrap(),
            limits(None),
        ));
        assert!(m.contains("takes none"), "{m}");
        // Not JSON, or not a frame.
        let mut bytes = 5u32.to_be_bytes().to_vec();
        bytes.extend(b"hello");
        assert!(violation(read(bytes, limits(None))).contains("malformed"));
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Whatever a peer sends, the reader returns a frame, a violation or a closed
        /// link: it never panics and never takes a payload beyond the caps. Inputs are
        /// raw bytes and real frames with bytes flipped, cut or appended.
        #[test]
        fn arbitrary_bytes_never_panic_the_frame_reader(
            raw in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..256),
            flips in proptest::collection::vec((0usize..4096, proptest::prelude::any::<u8>()), 0..8),
            cut in 0usize..4096,
            which in 0u8..4,
            page in proptest::prelude::any::<bool>(),
        ) {
            let mut bytes = match which {
                0 => raw.clone(),
                1 => encode(&Frame::Land { req: 1, dest: dest() }, &[7; 64]).unwrap(),
                2 => encode(&Frame::control(Msg::Renew { req: ReqId(5) }), &[]).unwrap(),
                _ => encode(&Frame::Flush { id: 9 }, &[]).unwrap(),
            };
            for (at, x) in &flips {
                if !bytes.is_empty() {
                    let n = bytes.len();
                    bytes[at % n] ^= x;
                }
            }
            bytes.truncate(cut.max(1));
            if which != 0 {
                bytes.extend(&raw);
            }
            match read(bytes, limits(page.then_some(64))) {
                Ok((Frame::Land { .. }, p)) => proptest::prop_assert_eq!(p.len(), 64),
                Ok((_, p)) => proptest::prop_assert!(p.is_empty()),
                Err(LinkEnd::Violation(_) | LinkEnd::Closed(_)) => {}
                Err(other) => proptest::prop_assert!(false, "unexpected end {:?}", other),
            }
        }
    }

    #[test]
    fn a_truncated_frame_is_a_closed_link_not_a_violation() {
        let bytes = encode(&Frame::Flush { id: 1 }, &[]).unwrap();
        let r = read(bytes[..bytes.len() - 2].to_vec(), limits(None));
        assert!(matches!(r, Err(LinkEnd::Closed(_))), "{r:?}");
    }
}
