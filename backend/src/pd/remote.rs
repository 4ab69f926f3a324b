//! Prefill and decode nodes as separate processes (`tessera node`), and the
//! gateway's side of them: the same protocol loops and coordinator as
//! [`super::cluster`], with messages over TCP.
//!
//! Connections (all TCP, one per pair, opened by the caller):
//! - gateway -> every node: protocol messages both ways; a decode node also streams
//!   each request's events (tokens, then `Done` or `Error`) on it, always before the
//!   `Finished` that follows them;
//! - prefill node -> every decode node: `Commit`s, and page writes for the `tcp`
//!   transport (a `Land` frame per page, a `Flush` answered by `FlushAck` once the
//!   decode node applied every earlier write).
//!
//! Frame: `u32` big-endian header length, the header as JSON ([`Frame`]), `u32`
//! big-endian payload length, the payload (page bytes for `Land`, else empty).
//! A closed connection is how a dead node is detected; the gateway reconnects in the
//! background, so a restarted node serves new requests.

use super::cluster::{
    coordinate, first_req_id, CoordCmd, CoordLinks, DecodeCmd, DecodeLoop, Extra, NodeLinks,
    PdAdmission, PdCounters, PrefillCmd, PrefillLoop, TransferFault,
};
use super::inproc::PageLanding;
use super::protocol::{Msg, Refusal, ReqId, Role};
use super::transport::{DestPage, KvTransport, TransportError};
use super::ucx::{UcxContext, UcxRegionDescriptor, UcxSink, UcxSource, UcxSourceConfig};
use crate::engine::{
    AdmissionLimits, Engine, EngineConfig, EngineError, Event, FinishReason, GenerateRequest,
    Rejection, Usage,
};
use crate::handle::{run_node, EngineStats, Shared};
use crate::runtime::LoadedModel;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// Largest frame header or payload accepted (a page of a large model is a few MB).
const MAX_FRAME: u32 = 256 << 20;
/// How long a flush waits for the decode node's acknowledgement.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);
/// How often the gateway retries nodes it lost.
const RECONNECT_INTERVAL: Duration = Duration::from_secs(1);

/// One frame's header. Externally tagged: serde's internally tagged enums buffer
/// their content, which cannot hold the `u128` sampler position.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Frame {
    /// First frame on a connection: the caller's role.
    Hello { from: Role },
    /// A protocol message, with what the protocol leaves out: the request body
    /// (`Prealloc`, `Prefill`), the decode node chosen (`Prefill`), the sampler
    /// position (`Commit`).
    Control {
        msg: Msg,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        body: Option<GenerateRequest>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        decode: Option<usize>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        rng_pos: Option<u128>,
    },
    /// One page write; the payload is the page.
    Land { req: u64, dest: DestPage },
    /// Answer `FlushAck { id }` once every earlier frame was applied.
    Flush { id: u64 },
    /// See `Flush`.
    FlushAck { id: u64 },
    /// Decode node -> gateway: one event of a request's stream.
    Event { req: ReqId, event: WireEvent },
    /// Decode node -> prefill node, answering its `Hello`: where UCX puts go, when
    /// the decode node registered its pool with UCX (`None`: TCP frames only).
    Region { ucx: Option<UcxRegionDescriptor> },
}

/// [`Event`] on the wire.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum WireEvent {
    Token {
        id: u32,
        text: String,
    },
    Done {
        stop: bool,
        prompt_tokens: usize,
        completion_tokens: usize,
        ttft_us: u64,
        tpot_us: u64,
    },
    Error {
        message: String,
        refusal: Option<Refusal>,
    },
}

impl WireEvent {
    fn from_event(e: Event) -> Self {
        match e {
            Event::Token { id, text } => Self::Token { id, text },
            Event::Done { reason, usage } => Self::Done {
                stop: reason == FinishReason::Stop,
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
                ttft_us: usage.ttft.as_micros() as u64,
                tpot_us: usage.tpot.as_micros() as u64,
            },
            Event::Error(EngineError::Refused(r)) => Self::Error {
                message: r.message.clone(),
                refusal: Some(r),
            },
            Event::Error(e) => Self::Error {
                message: e.to_string(),
                refusal: None,
            },
        }
    }

    fn into_event(self) -> Event {
        match self {
            Self::Token { id, text } => Event::Token { id, text },
            Self::Done {
                stop,
                prompt_tokens,
                completion_tokens,
                ttft_us,
                tpot_us,
            } => Event::Done {
                reason: if stop {
                    FinishReason::Stop
                } else {
                    FinishReason::Length
                },
                usage: Usage {
                    prompt_tokens,
                    completion_tokens,
                    ttft: Duration::from_micros(ttft_us),
                    tpot: Duration::from_micros(tpot_us),
                },
            },
            Self::Error {
                refusal: Some(r), ..
            } => Event::Error(EngineError::Refused(r)),
            Self::Error { message, .. } => Event::Error(EngineError::Node(message)),
        }
    }

    fn is_final(&self) -> bool {
        !matches!(self, Self::Token { .. })
    }
}

fn write_frame(w: &mut impl Write, f: &Frame, payload: &[u8]) -> io::Result<()> {
    let header = serde_json::to_vec(f).map_err(io::Error::other)?;
    w.write_all(&(header.len() as u32).to_be_bytes())?;
    w.write_all(&header)?;
    w.write_all(&(payload.len() as u32).to_be_bytes())?;
    w.write_all(payload)?;
    w.flush()
}

fn read_len(r: &mut impl Read) -> io::Result<usize> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    let n = u32::from_be_bytes(b);
    if n > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {n} bytes exceeds the {MAX_FRAME} byte limit"),
        ));
    }
    Ok(n as usize)
}

fn read_frame(r: &mut impl Read) -> io::Result<(Frame, Vec<u8>)> {
    let mut header = vec![0u8; read_len(r)?];
    r.read_exact(&mut header)?;
    let f: Frame = serde_json::from_slice(&header)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let mut payload = vec![0u8; read_len(r)?];
    r.read_exact(&mut payload)?;
    Ok((f, payload))
}

/// The writing half of a connection, shared by every thread that sends on it.
struct Conn {
    w: Mutex<BufWriter<TcpStream>>,
    stream: TcpStream,
    alive: AtomicBool,
}

impl Conn {
    fn new(stream: TcpStream) -> io::Result<Arc<Self>> {
        stream.set_nodelay(true)?;
        Ok(Arc::new(Self {
            w: Mutex::new(BufWriter::new(stream.try_clone()?)),
            stream,
            alive: AtomicBool::new(true),
        }))
    }

    fn send(&self, f: &Frame, payload: &[u8]) -> bool {
        if !self.alive.load(Ordering::Acquire) {
            return false;
        }
        let ok = write_frame(&mut *self.w.lock().unwrap(), f, payload).is_ok();
        if !ok {
            self.close();
        }
        ok
    }

    fn close(&self) {
        self.alive.store(false, Ordering::Release);
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    fn control(&self, msg: Msg) -> bool {
        self.send(
            &Frame::Control {
                msg,
                body: None,
                decode: None,
                rng_pos: None,
            },
            &[],
        )
    }
}

fn connect(addr: &str) -> io::Result<(Arc<Conn>, BufReader<TcpStream>)> {
    let sa = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no address for {addr}")))?;
    let stream = TcpStream::connect_timeout(&sa, Duration::from_secs(2))?;
    let conn = Conn::new(stream.try_clone()?)?;
    Ok((conn, BufReader::new(stream)))
}

// ---------------------------------------------------------------------------
// Node process
// ---------------------------------------------------------------------------

/// A node process's role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NodeRole {
    /// Computes prompts and writes their KV into decode nodes.
    Prefill,
    /// Reserves pages, verifies commits and generates.
    Decode,
}

/// How page bytes move from prefill to decode nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// `Land` frames on the TCP control connection, flush acknowledged.
    Tcp,
    /// UCX one-sided puts into the decode pool, registered with UCX (UCX picks
    /// shared memory, TCP or RDMA verbs; `UCX_TLS` narrows the choice).
    Ucx,
}

/// What `tessera node` runs.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    /// Page transport: a decode node registers its pool for UCX when `Ucx`; a
    /// prefill node uses UCX puts when `Ucx` and the decode node offers a region.
    pub transport: TransportKind,
    /// This node's role.
    pub role: NodeRole,
    /// Control address to listen on.
    pub listen: String,
    /// Every decode node's control address, in deployment-file order (a prefill
    /// node writes into them; the gateway names them by index).
    pub decode_peers: Vec<String>,
    /// Pool and batch sizes.
    pub engine: EngineConfig,
}

/// Runs one node until the process is killed: binds `opts.listen`, then serves
/// protocol connections. Calls `ready` with the bound address once listening.
///
/// Errors: the address cannot be bound.
pub fn run_node_process(
    model: &LoadedModel,
    opts: NodeOptions,
    ready: impl FnOnce(std::net::SocketAddr),
) -> io::Result<()> {
    let listener = TcpListener::bind(&opts.listen)?;
    let engine = Engine::new(
        model.llama.clone(),
        model.tokenizer.clone(),
        opts.engine.clone(),
    );
    let ucx = match opts.transport {
        TransportKind::Ucx => Some(
            UcxContext::new()
                .map_err(|e| io::Error::other(format!("UCX transport unavailable: {e}")))?,
        ),
        TransportKind::Tcp => None,
    };
    let region = match (&ucx, opts.role) {
        (Some(ctx), NodeRole::Decode) => Some(register_pool(ctx, &engine)?),
        _ => None,
    };
    let links = Arc::new(RemoteNodeLinks {
        counters: PdCounters::default(),
        owners: Mutex::new(HashMap::new()),
        streams: Mutex::new(HashMap::new()),
        peers: opts.decode_peers.clone(),
        peer_conns: Mutex::new(HashMap::new()),
        ucx,
        region,
    });
    let shared = Arc::new(Shared::default());
    let cmds: NodeCmds = match opts.role {
        NodeRole::Decode => {
            let (tx, rx) = mpsc::channel();
            let l = links.clone();
            let sh = shared.clone();
            let mut engine = engine;
            engine.track_ended();
            std::thread::Builder::new()
                .name("tessera-decode".into())
                .spawn(move || run_node(engine, DecodeLoop::new(l), rx, &sh))?;
            NodeCmds::Decode(Mutex::new(tx))
        }
        NodeRole::Prefill => {
            let (tx, rx) = mpsc::channel();
            let l = links.clone();
            let sh = shared.clone();
            let self_tx = tx.clone();
            std::thread::Builder::new()
                .name("tessera-prefill".into())
                .spawn(move || run_node(engine, PrefillLoop::new(l, self_tx), rx, &sh))?;
            NodeCmds::Prefill(Mutex::new(tx))
        }
    };
    let cmds = Arc::new(cmds);
    ready(listener.local_addr()?);
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let (cmds, links) = (cmds.clone(), links.clone());
        std::thread::spawn(move || {
            if let Err(e) = serve_connection(stream, &cmds, &links) {
                tracing::debug!(error = %e, "node connection ended");
            }
        });
    }
    Ok(())
}

/// Registers the decode engine's page memory with UCX and keeps a thread
/// progressing the worker (over TCP, and while endpoints connect, bytes land only
/// while it is progressed). Returns what prefill nodes need to put into it.
fn register_pool(ctx: &UcxContext, engine: &Engine) -> io::Result<UcxRegionDescriptor> {
    let pool = engine.kv().pool();
    let data = pool.data();
    let page_bytes = pool.layout().page_bytes();
    let base = std::ptr::NonNull::new(data.as_ptr() as *mut u8)
        .ok_or_else(|| io::Error::other("empty KV pool"))?;
    // SAFETY: the pool's page memory is allocated once and never moves or shrinks
    // (PagePool::new); the engine owns it until the process exits, and the sink
    // lives in a thread that runs until then too. Remote puts land only in pages
    // the decode node reserved for the writer, and the node reads them only after
    // the writer's flush and a verified commit (the protocol's S2 and I4): the same
    // contract as any DMA into host memory.
    let sink = unsafe { UcxSink::register(ctx, base, std::mem::size_of_val(data), page_bytes) }
        .map_err(|e| io::Error::other(format!("registering the KV pool with UCX: {e}")))?;
    let desc = sink.descriptor().clone();
    std::thread::Builder::new()
        .name("tessera-ucx-progress".into())
        .spawn(move || loop {
            if let Err(e) = sink.progress_wait(Duration::from_millis(100)) {
                tracing::warn!(error = %e, "UCX progress failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        })?;
    Ok(desc)
}

enum NodeCmds {
    Decode(Mutex<mpsc::Sender<DecodeCmd>>),
    Prefill(Mutex<mpsc::Sender<PrefillCmd>>),
}

fn serve_connection(stream: TcpStream, cmds: &NodeCmds, links: &RemoteNodeLinks) -> io::Result<()> {
    let conn = Conn::new(stream.try_clone()?)?;
    let mut r = BufReader::new(stream);
    let (Frame::Hello { from }, _) = read_frame(&mut r)? else {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "expected hello"));
    };
    if from == Role::Prefill && matches!(cmds, NodeCmds::Decode(_)) {
        conn.send(
            &Frame::Region {
                ucx: links.region.clone(),
            },
            &[],
        );
    }
    let mut owned: Vec<ReqId> = Vec::new();
    let result = loop {
        let (frame, payload) = match read_frame(&mut r) {
            Ok(f) => f,
            Err(e) => break Err(e),
        };
        match (frame, cmds) {
            (
                Frame::Control {
                    msg,
                    body,
                    decode: _,
                    rng_pos,
                },
                NodeCmds::Decode(tx),
            ) => {
                let req = msg.req();
                let extra = match (&msg, body) {
                    (Msg::Prealloc { .. }, Some(body)) => {
                        let (sink, rx) = unbounded_channel();
                        links
                            .streams
                            .lock()
                            .unwrap()
                            .insert(req, (rx, conn.clone()));
                        Extra::Decode {
                            req: body,
                            sink,
                            submitted: Instant::now(),
                        }
                    }
                    (Msg::Commit { .. }, _) => Extra::RngPos(rng_pos.unwrap_or(0)),
                    _ => Extra::None,
                };
                if from == Role::Coordinator {
                    links.own(req, &conn);
                    owned.push(req);
                }
                let _ = tx.lock().unwrap().send(DecodeCmd::Control(msg, extra));
            }
            (
                Frame::Control {
                    msg, body, decode, ..
                },
                NodeCmds::Prefill(tx),
            ) => {
                let req = msg.req();
                let extra = match (body, decode) {
                    (Some(body), Some(decode)) => Extra::Prefill { req: body, decode },
                    _ => Extra::None,
                };
                links.own(req, &conn);
                owned.push(req);
                let _ = tx.lock().unwrap().send(PrefillCmd::Control(msg, extra));
            }
            (Frame::Land { req, dest }, NodeCmds::Decode(tx)) => {
                let landing = PageLanding {
                    req,
                    dest,
                    bytes: payload,
                };
                let _ = tx.lock().unwrap().send(DecodeCmd::Land(landing));
            }
            (Frame::Flush { id }, NodeCmds::Decode(tx)) => {
                let c = conn.clone();
                let ack = Box::new(move || {
                    c.send(&Frame::FlushAck { id }, &[]);
                });
                let _ = tx.lock().unwrap().send(DecodeCmd::AfterEarlier(ack));
            }
            (f, _) => {
                break Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unexpected frame {f:?}"),
                ))
            }
        }
    };
    conn.close();
    // The coordinator is gone: nobody will finish or abort its requests, so abort
    // them here (nodes answer into the closed connection, which is fine). Late page
    // writes into freed pages are dropped by the tag check on landing.
    if from == Role::Coordinator {
        for req in owned {
            let abort = Msg::Abort { req };
            match cmds {
                NodeCmds::Decode(tx) => {
                    let _ = tx
                        .lock()
                        .unwrap()
                        .send(DecodeCmd::Control(abort, Extra::None));
                }
                NodeCmds::Prefill(tx) => {
                    let _ = tx
                        .lock()
                        .unwrap()
                        .send(PrefillCmd::Control(abort, Extra::None));
                }
            }
        }
    }
    result
}

/// A request's events on the decode node and the gateway connection they go to.
type EventStream = (UnboundedReceiver<Event>, Arc<Conn>);

/// A prefill node's connection to one decode node.
struct Peer {
    conn: Arc<Conn>,
    acks: Mutex<HashMap<u64, mpsc::Sender<()>>>,
    next_flush: AtomicU64,
    /// UCX endpoint into the decode node's registered pool, when both use UCX.
    ucx: Option<Mutex<UcxSource>>,
}

struct RemoteNodeLinks {
    counters: PdCounters,
    /// The gateway connection each request came from.
    owners: Mutex<HashMap<ReqId, Arc<Conn>>>,
    /// Decode node: each request's event stream and where it goes.
    streams: Mutex<HashMap<ReqId, EventStream>>,
    peers: Vec<String>,
    peer_conns: Mutex<HashMap<usize, Arc<Peer>>>,
    /// This node's UCX context (`--transport ucx`).
    ucx: Option<UcxContext>,
    /// Decode node: its pool's UCX region, offered to prefill nodes.
    region: Option<UcxRegionDescriptor>,
}

impl RemoteNodeLinks {
    fn own(&self, req: ReqId, conn: &Arc<Conn>) {
        self.owners.lock().unwrap().insert(req, conn.clone());
    }

    /// The connection to decode node `index`, opened (again) if needed.
    fn peer(&self, index: usize) -> Option<Arc<Peer>> {
        let mut peers = self.peer_conns.lock().unwrap();
        if let Some(p) = peers.get(&index) {
            if p.conn.alive.load(Ordering::Acquire) {
                return Some(p.clone());
            }
        }
        let addr = self.peers.get(index)?;
        let (conn, mut r) = match connect(addr) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(addr, error = %e, "cannot reach decode node");
                return None;
            }
        };
        if !conn.send(
            &Frame::Hello {
                from: Role::Prefill,
            },
            &[],
        ) {
            return None;
        }
        let region = match read_frame(&mut r) {
            Ok((Frame::Region { ucx }, _)) => ucx,
            _ => {
                tracing::warn!(addr, "decode node did not answer hello");
                conn.close();
                return None;
            }
        };
        let ucx = match (&self.ucx, region) {
            (Some(ctx), Some(desc)) => {
                match UcxSource::connect(ctx, &desc, UcxSourceConfig::default()) {
                    Ok(src) => Some(Mutex::new(src)),
                    Err(e) => {
                        tracing::warn!(addr, error = %e, "UCX connect failed");
                        conn.close();
                        return None;
                    }
                }
            }
            (Some(_), None) => {
                tracing::warn!(addr, "decode node offers no UCX region; using TCP frames");
                None
            }
            _ => None,
        };
        let peer = Arc::new(Peer {
            conn,
            acks: Mutex::new(HashMap::new()),
            next_flush: AtomicU64::new(1),
            ucx,
        });
        let p = peer.clone();
        std::thread::spawn(move || {
            while let Ok((Frame::FlushAck { id }, _)) = read_frame(&mut r) {
                if let Some(tx) = p.acks.lock().unwrap().remove(&id) {
                    let _ = tx.send(());
                }
            }
            p.conn.close();
            // Waiting flushes fail: their senders drop.
            p.acks.lock().unwrap().clear();
        });
        peers.insert(index, peer.clone());
        Some(peer)
    }

    fn forward(&self, req: ReqId) {
        let mut streams = self.streams.lock().unwrap();
        let Some((rx, conn)) = streams.get_mut(&req) else {
            return;
        };
        let mut done = false;
        loop {
            match rx.try_recv() {
                Ok(ev) => {
                    let event = WireEvent::from_event(ev);
                    done |= event.is_final();
                    if !conn.send(&Frame::Event { req, event }, &[]) {
                        done = true; // the gateway is gone: dropping rx aborts
                        break;
                    }
                }
                Err(tokio::sync::mpsc::error::TryRecvError::Empty) => break,
                Err(tokio::sync::mpsc::error::TryRecvError::Disconnected) => {
                    done = true;
                    break;
                }
            }
        }
        if done {
            streams.remove(&req);
        }
    }
}

impl NodeLinks for RemoteNodeLinks {
    fn to_coordinator(&self, msg: Msg) {
        let req = msg.req();
        // Events the engine already produced go first (S4: `Finished` after `Done`).
        self.forward(req);
        // The last message a node sends for a request ends its ownership (a later
        // abort or poll from the gateway re-establishes it).
        let last = matches!(
            msg,
            Msg::Finished { .. }
                | Msg::CommitFailed { .. }
                | Msg::Rejected { .. }
                | Msg::AbortAck { .. }
                | Msg::PrefillFailed { .. }
        );
        let conn = {
            let mut owners = self.owners.lock().unwrap();
            if last {
                owners.remove(&req)
            } else {
                owners.get(&req).cloned()
            }
        };
        if let Some(c) = conn {
            c.control(msg);
        }
    }

    fn to_decode(&self, decode: usize, msg: Msg, rng_pos: u128) -> bool {
        // A commit is the prefill node's last word on a request.
        self.owners.lock().unwrap().remove(&msg.req());
        self.peer(decode).is_some_and(|p| {
            p.conn.send(
                &Frame::Control {
                    msg,
                    body: None,
                    decode: None,
                    rng_pos: Some(rng_pos),
                },
                &[],
            )
        })
    }

    fn transport(
        &self,
        decode: usize,
        _fault: Option<TransferFault>,
        _dest: &[DestPage],
    ) -> Box<dyn KvTransport> {
        Box::new(TcpTransport {
            peer: self.peer(decode),
        })
    }

    fn counters(&self) -> &PdCounters {
        &self.counters
    }

    fn pump(&self) {
        let reqs: Vec<ReqId> = self.streams.lock().unwrap().keys().copied().collect();
        for r in reqs {
            self.forward(r);
        }
    }
}

/// [`KvTransport`] from a prefill node into one decode node: UCX one-sided puts
/// and a UCX flush (remote completion) when both nodes run `--transport ucx`;
/// otherwise each put is a `Land` frame on the TCP connection and `flush` waits for
/// the decode node's `FlushAck`, which it sends after applying every earlier frame
/// (so the writes have landed).
struct TcpTransport {
    peer: Option<Arc<Peer>>,
}

impl TcpTransport {
    /// A failed UCX endpoint is unusable: drop the connection so the next transfer
    /// opens a fresh one.
    fn fail(p: &Peer, e: TransportError) -> TransportError {
        p.conn.close();
        e
    }
}

impl KvTransport for TcpTransport {
    fn put(&mut self, req: u64, dest: DestPage, bytes: &[u8]) -> Result<(), TransportError> {
        let p = self
            .peer
            .as_ref()
            .ok_or_else(|| TransportError::PeerGone("decode node unreachable".into()))?;
        if let Some(ucx) = &p.ucx {
            return ucx
                .lock()
                .unwrap()
                .put(req, dest, bytes)
                .map_err(|e| Self::fail(p, e));
        }
        if p.conn.send(&Frame::Land { req, dest }, bytes) {
            Ok(())
        } else {
            Err(TransportError::PeerGone(
                "decode node connection closed".into(),
            ))
        }
    }

    fn flush(&mut self) -> Result<(), TransportError> {
        let p = self
            .peer
            .as_ref()
            .ok_or_else(|| TransportError::PeerGone("decode node unreachable".into()))?;
        if let Some(ucx) = &p.ucx {
            return ucx.lock().unwrap().flush().map_err(|e| Self::fail(p, e));
        }
        let id = p.next_flush.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        p.acks.lock().unwrap().insert(id, tx);
        if !p.conn.send(&Frame::Flush { id }, &[]) {
            return Err(TransportError::PeerGone(
                "decode node connection closed".into(),
            ));
        }
        rx.recv_timeout(FLUSH_TIMEOUT).map_err(|_| {
            TransportError::PeerGone("decode node did not acknowledge the writes".into())
        })
    }
}

// ---------------------------------------------------------------------------
// Gateway side
// ---------------------------------------------------------------------------

/// One remote node as the gateway sees it.
struct NodeLink {
    addr: String,
    conn: Mutex<Option<Arc<Conn>>>,
    down: AtomicBool,
    /// Requests assigned and not yet released (the load the pair choice uses).
    outstanding: AtomicUsize,
}

struct RemoteCoordLinks {
    prefill: Vec<NodeLink>,
    decode: Vec<NodeLink>,
    streams: Mutex<HashMap<ReqId, UnboundedSender<Event>>>,
    assigned: Mutex<HashMap<ReqId, (usize, usize)>>,
    counters: PdCounters,
    coord: Mutex<mpsc::Sender<CoordCmd>>,
}

impl RemoteCoordLinks {
    fn node(&self, role: Role, index: usize) -> &NodeLink {
        match role {
            Role::Prefill => &self.prefill[index],
            _ => &self.decode[index],
        }
    }

    fn send(&self, role: Role, index: usize, f: &Frame) -> bool {
        let conn = self.node(role, index).conn.lock().unwrap().clone();
        conn.is_some_and(|c| c.send(f, &[]))
    }

    /// Connects to a node and starts its reader; marks it up.
    fn open(self: &Arc<Self>, role: Role, index: usize) -> io::Result<()> {
        let node = self.node(role, index);
        let (conn, mut r) = connect(&node.addr)?;
        if !conn.send(
            &Frame::Hello {
                from: Role::Coordinator,
            },
            &[],
        ) {
            return Err(io::Error::other("hello failed"));
        }
        *node.conn.lock().unwrap() = Some(conn.clone());
        node.down.store(false, Ordering::Release);
        let links = self.clone();
        std::thread::spawn(move || {
            loop {
                match read_frame(&mut r) {
                    Ok((Frame::Control { msg, .. }, _)) => {
                        let _ = links.coord.lock().unwrap().send(CoordCmd::FromNode(msg));
                    }
                    Ok((Frame::Event { req, event }, _)) => {
                        let last = event.is_final();
                        let mut streams = links.streams.lock().unwrap();
                        if let Some(s) = streams.get(&req) {
                            let _ = s.send(event.into_event());
                        }
                        if last {
                            streams.remove(&req);
                        }
                    }
                    Ok(_) | Err(_) => break,
                }
            }
            conn.close();
            let node = links.node(role, index);
            tracing::warn!(addr = %node.addr, ?role, "lost the node; retrying in the background");
            node.down.store(true, Ordering::Release);
        });
        Ok(())
    }
}

impl CoordLinks for RemoteCoordLinks {
    fn to_decode(&self, index: usize, msg: Msg, extra: Extra) -> bool {
        let body = match extra {
            Extra::Decode { req, sink, .. } => {
                self.streams.lock().unwrap().insert(msg.req(), sink);
                Some(req)
            }
            _ => None,
        };
        self.send(
            Role::Decode,
            index,
            &Frame::Control {
                msg,
                body,
                decode: None,
                rng_pos: None,
            },
        )
    }

    fn to_prefill(&self, index: usize, msg: Msg, extra: Extra) -> bool {
        let (body, decode) = match extra {
            Extra::Prefill { req, decode } => (Some(req), Some(decode)),
            _ => (None, None),
        };
        self.send(
            Role::Prefill,
            index,
            &Frame::Control {
                msg,
                body,
                decode,
                rng_pos: None,
            },
        )
    }

    fn is_down(&self, role: Role, index: usize) -> bool {
        self.node(role, index).down.load(Ordering::Acquire)
    }

    fn counters(&self) -> &PdCounters {
        &self.counters
    }

    fn released(&self, req: ReqId) {
        self.streams.lock().unwrap().remove(&req);
        if let Some((p, d)) = self.assigned.lock().unwrap().remove(&req) {
            self.prefill[p].outstanding.fetch_sub(1, Ordering::Relaxed);
            self.decode[d].outstanding.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

/// The gateway's view of remote prefill and decode nodes: admission against the
/// deployment's pools, pair choice by load, and the coordinator.
pub struct RemoteCluster {
    links: Arc<RemoteCoordLinks>,
    admission: PdAdmission,
    next_req: AtomicU64,
}

/// Where the gateway finds its nodes and what their pools hold.
#[derive(Clone, Debug)]
pub struct RemoteNodes {
    /// Prefill node control addresses.
    pub prefill: Vec<String>,
    /// Decode node control addresses (the order prefill nodes index them by).
    pub decode: Vec<String>,
    /// Smallest prefill pool, usable tokens.
    pub prefill_pool_tokens: usize,
    /// Smallest decode pool, usable tokens.
    pub decode_pool_tokens: usize,
    /// Tokens per page.
    pub page_size: usize,
}

impl RemoteCluster {
    /// Starts the coordinator and connects to every node (nodes that are not up
    /// yet are retried in the background).
    pub fn connect(model: &LoadedModel, nodes: RemoteNodes) -> Self {
        let (tx, rx) = mpsc::channel();
        let link = |addr: &String| NodeLink {
            addr: addr.clone(),
            conn: Mutex::new(None),
            down: AtomicBool::new(true),
            outstanding: AtomicUsize::new(0),
        };
        let links = Arc::new(RemoteCoordLinks {
            prefill: nodes.prefill.iter().map(link).collect(),
            decode: nodes.decode.iter().map(link).collect(),
            streams: Mutex::new(HashMap::new()),
            assigned: Mutex::new(HashMap::new()),
            counters: PdCounters::default(),
            coord: Mutex::new(tx),
        });
        let all: Vec<(Role, usize)> = (0..links.prefill.len())
            .map(|i| (Role::Prefill, i))
            .chain((0..links.decode.len()).map(|i| (Role::Decode, i)))
            .collect();
        for &(role, i) in &all {
            if let Err(e) = links.open(role, i) {
                tracing::warn!(addr = %links.node(role, i).addr, error = %e, "node not reachable yet");
            }
        }
        let l = links.clone();
        std::thread::Builder::new()
            .name("tessera-pd-reconnect".into())
            .spawn(move || loop {
                std::thread::sleep(RECONNECT_INTERVAL);
                if Arc::strong_count(&l) == 1 {
                    return;
                }
                for &(role, i) in &all {
                    let node = l.node(role, i);
                    if node.down.load(Ordering::Acquire) && l.open(role, i).is_ok() {
                        tracing::warn!(addr = %node.addr, ?role, "node reachable");
                    }
                }
            })
            .expect("spawn reconnect thread");
        let l: Arc<dyn CoordLinks> = links.clone();
        std::thread::Builder::new()
            .name("tessera-pd-coordinator".into())
            .spawn(move || coordinate(l, rx))
            .expect("spawn coordinator thread");
        let cfg = model.llama.config();
        Self {
            links,
            admission: PdAdmission {
                limits: AdmissionLimits {
                    context: cfg.context,
                    pool_tokens: nodes.decode_pool_tokens,
                    page_size: nodes.page_size,
                    vocab: cfg.vocab,
                },
                prefill_pool_tokens: nodes.prefill_pool_tokens,
            },
            next_req: AtomicU64::new(first_req_id()),
        }
    }

    /// Like [`super::cluster::PdCluster::submit`], over the network. When no node of
    /// a role is reachable the request ends at once with a retryable refusal (503).
    pub fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Event>, Rejection> {
        let body = self.admission.admit(req)?;
        let (sink, rx) = unbounded_channel();
        let pick = |nodes: &[NodeLink]| {
            (0..nodes.len())
                .filter(|&i| !nodes[i].down.load(Ordering::Acquire))
                .min_by_key(|&i| nodes[i].outstanding.load(Ordering::Relaxed))
        };
        let (Some(prefill), Some(decode)) = (pick(&self.links.prefill), pick(&self.links.decode))
        else {
            return Err(Rejection::Unavailable(
                "no prefill or decode node is reachable; retry later".into(),
            ));
        };
        let req = ReqId(self.next_req.fetch_add(1, Ordering::Relaxed));
        self.links.prefill[prefill]
            .outstanding
            .fetch_add(1, Ordering::Relaxed);
        self.links.decode[decode]
            .outstanding
            .fetch_add(1, Ordering::Relaxed);
        self.links
            .assigned
            .lock()
            .unwrap()
            .insert(req, (prefill, decode));
        let _ = self.links.coord.lock().unwrap().send(CoordCmd::Start {
            req,
            body,
            sink,
            prefill,
            decode,
        });
        Ok(rx)
    }

    /// What [`Self::submit`] admits against (from the deployment file's pools).
    pub fn admission(&self) -> PdAdmission {
        self.admission
    }

    /// Requests in flight across the nodes (pool counters live on the nodes).
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: self
                .links
                .decode
                .iter()
                .map(|n| n.outstanding.load(Ordering::Relaxed))
                .sum(),
            ..EngineStats::default()
        }
    }

    /// Whether at least one prefill and one decode node are connected.
    pub fn ready(&self) -> bool {
        let up = |nodes: &[NodeLink]| nodes.iter().any(|n| !n.down.load(Ordering::Acquire));
        up(&self.links.prefill) && up(&self.links.decode)
    }

    /// Whether the node at `index` of `role` is connected.
    pub fn node_up(&self, role: Role, index: usize) -> bool {
        !self.links.is_down(role, index)
    }

    /// Protocol error counters seen by the coordinator.
    pub fn counters(&self) -> &PdCounters {
        &self.links.counters
    }
}

impl Drop for RemoteCluster {
    fn drop(&mut self) {
        let _ = self.links.coord.lock().unwrap().send(CoordCmd::Stop);
        for n in self.links.prefill.iter().chain(&self.links.decode) {
            if let Some(c) = n.conn.lock().unwrap().take() {
                c.close();
            }
        }
    }
}
