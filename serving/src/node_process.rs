//! `tessera node`: a prefill or decode node as its own process, serving protocol
//! connections from gateways and (for a decode node) prefill nodes over TCP.
//!
//! The engine thread runs the same node loop as in one process
//! ([`crate::decode_node`], [`crate::prefill_node`]); connection threads only parse
//! frames into its commands, and replies go out through each connection's writer
//! queue, so no socket write ever blocks the engine.

use crate::decode_node::{DecodeCmd, DecodeLoop, RequestBody};
use crate::links::{CommitExtra, PdCounters, ReplyTo, TransferFault, WriterLink};
use crate::metrics::{serve_metrics, NodeMetrics};
use crate::net::{connect, read_frame, Conn, Control, Frame, WireEvent};
use crate::node_loop::{run_node, Shared};
use crate::prefill_node::{PrefillCmd, PrefillLinks, PrefillLoop};
use std::collections::HashMap;
use std::io::{self, BufReader};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_engine::sink::{EventSink, Gone};
use tessera_engine::{Engine, EngineConfig, Event};
use tessera_model::LoadedModel;
use tessera_transfer::inproc::PageLanding;
use tessera_transfer::protocol::{Msg, ReqId, Role};
use tessera_transfer::transport::{DestPage, KvTransport, TransportError};
use tessera_transfer::ucx::{UcxContext, UcxRegionDescriptor, UcxSink, UcxSource, UcxSourceConfig};

/// How long a flush waits for the decode node's acknowledgement.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);
/// How long a prefill node waits for a decode node to answer its hello.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
    /// This node's role: [`Role::Prefill`] or [`Role::Decode`].
    pub role: Role,
    /// Control address to listen on.
    pub listen: String,
    /// Every decode node's control address, in deployment-file order (a prefill
    /// node writes into them; the gateway names them by index).
    pub decode_peers: Vec<String>,
    /// Pool and batch sizes.
    pub engine: EngineConfig,
    /// Serve `GET /metrics` (plain HTTP, read-only) on this address; `None`: no
    /// metrics listener.
    pub metrics_listen: Option<String>,
}

/// The engine configuration of one of `pool`'s nodes: the pool's page size and pool
/// size, the engine's defaults for everything else.
pub fn pool_engine_config(pool: &tessera_config::PoolConfig) -> EngineConfig {
    EngineConfig {
        page_size: pool.page_size,
        kv_pool_tokens: pool.kv_pool_tokens,
        ..EngineConfig::default()
    }
}

/// The engine thread's command queue.
enum NodeCmds {
    Decode(mpsc::Sender<DecodeCmd>),
    Prefill(mpsc::Sender<PrefillCmd>),
}

/// Runs one node until the process is killed: binds `opts.listen` (and
/// `opts.metrics_listen`), then serves protocol connections. Calls `ready` with the
/// bound control address and the metrics address once listening.
///
/// Errors: the role is not prefill or decode, an address cannot be bound, UCX is
/// asked for and unavailable.
pub fn run_node_process(
    model: &LoadedModel,
    opts: NodeOptions,
    ready: impl FnOnce(std::net::SocketAddr, Option<std::net::SocketAddr>),
) -> io::Result<()> {
    if opts.role == Role::Coordinator {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a node is a prefill or a decode node",
        ));
    }
    let listener = TcpListener::bind(&opts.listen)?;
    let metrics_listener = match &opts.metrics_listen {
        Some(a) => Some(TcpListener::bind(a)?),
        None => None,
    };
    let mut engine = Engine::new(
        model.llama.clone(),
        model.tokenizer.clone(),
        opts.engine.clone(),
    );
    let metrics = Arc::new(NodeMetrics::new());
    let role_label = if opts.role == Role::Decode {
        "decode"
    } else {
        "prefill"
    };
    let handles = metrics.node(&opts.listen, role_label);
    engine.set_metrics(handles.engine_metrics());
    let ucx = match opts.transport {
        TransportKind::Ucx => Some(
            UcxContext::new()
                .map_err(|e| io::Error::other(format!("UCX transport unavailable: {e}")))?,
        ),
        TransportKind::Tcp => None,
    };
    let region = match (&ucx, opts.role) {
        (Some(ctx), Role::Decode) => Some(register_pool(ctx, &engine)?),
        _ => None,
    };
    let counters = Arc::new(PdCounters::default());
    let shared = Arc::new(Shared::with_metrics(handles.clone()));
    let cmds = match opts.role {
        Role::Decode => {
            let (tx, rx) = mpsc::channel();
            let node = DecodeLoop::new(counters.clone(), handles.clone());
            let sh = shared.clone();
            engine.track_ended();
            std::thread::Builder::new()
                .name("tessera-decode".into())
                .spawn(move || run_node(engine, node, rx, &sh))?;
            NodeCmds::Decode(tx)
        }
        _ => {
            let (tx, rx) = mpsc::channel();
            let links: Arc<dyn PrefillLinks> = Arc::new(PeerLinks {
                name: opts.listen.clone(),
                peers: opts.decode_peers.clone(),
                conns: opts.decode_peers.iter().map(|_| Mutex::new(None)).collect(),
                ucx,
            });
            let node = PrefillLoop::new(links, tx.clone(), handles.clone());
            let sh = shared.clone();
            std::thread::Builder::new()
                .name("tessera-prefill".into())
                .spawn(move || run_node(engine, node, rx, &sh))?;
            NodeCmds::Prefill(tx)
        }
    };
    let cmds = Arc::new(cmds);
    let region = Arc::new(region);
    let metrics_addr = match metrics_listener {
        Some(l) => {
            let addr = l.local_addr()?;
            std::thread::Builder::new()
                .name("tessera-metrics".into())
                .spawn(move || serve_metrics(l, metrics))?;
            Some(addr)
        }
        None => None,
    };
    ready(listener.local_addr()?, metrics_addr);
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let (cmds, region) = (cmds.clone(), region.clone());
        std::thread::spawn(move || {
            if let Err(e) = serve_connection(stream, &cmds, &region) {
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

/// A decode node's stream of one request's events into the gateway connection the
/// request came on. Never blocks: a gateway that stopped reading loses its link.
struct ConnSink {
    conn: Arc<Conn>,
    req: ReqId,
}

impl EventSink for ConnSink {
    fn send(&mut self, event: Event) -> Result<(), Gone> {
        let event = WireEvent::from_event(event);
        if self.conn.try_send(
            &Frame::Event {
                req: self.req,
                event,
            },
            &[],
        ) {
            Ok(())
        } else {
            Err(Gone)
        }
    }
}

/// Serves one connection: reads frames and turns each into the engine thread's
/// command. When a gateway's connection ends, the node aborts the requests it
/// carried (their coordinator is gone).
fn serve_connection(
    stream: TcpStream,
    cmds: &NodeCmds,
    region: &Option<UcxRegionDescriptor>,
) -> io::Result<()> {
    let conn = Conn::new(stream.try_clone()?)?;
    let mut r = BufReader::new(stream);
    let (Frame::Hello { from, name }, _) = read_frame(&mut r)? else {
        return Err(io::Error::new(io::ErrorKind::InvalidData, "expected hello"));
    };
    // A prefill peer's name: what decode records name as a request's writer.
    let peer_name = name
        .clone()
        .or_else(|| r.get_ref().peer_addr().ok().map(|a| a.to_string()))
        .unwrap_or_default();
    let writer = WriterLink {
        name: peer_name.clone(),
        link: Some(conn.clone()),
    };
    if let (Role::Prefill, NodeCmds::Decode(tx)) = (from, cmds) {
        let _ = tx.send(DecodeCmd::WriterLink {
            name: peer_name.clone(),
            lost: false,
        });
    }
    if from == Role::Prefill && matches!(cmds, NodeCmds::Decode(_)) {
        conn.try_send(
            &Frame::Region {
                ucx: region.clone(),
            },
            &[],
        );
    }
    let reply: ReplyTo = conn.clone();
    let mut carried: Vec<ReqId> = Vec::new();
    let result = loop {
        let (frame, payload) = match read_frame(&mut r) {
            Ok(f) => f,
            Err(e) => break Err(e),
        };
        let sent = match (frame, cmds, from) {
            (
                Frame::Control(Control {
                    msg,
                    body,
                    prefill,
                    trace,
                    ..
                }),
                NodeCmds::Decode(tx),
                Role::Coordinator,
            ) => {
                let req = msg.req();
                if !carried.contains(&req) {
                    carried.push(req);
                }
                let body = match (&msg, body) {
                    (Msg::Prealloc { .. }, Some(body)) => Some(RequestBody {
                        req: body,
                        sink: Box::new(ConnSink {
                            conn: conn.clone(),
                            req,
                        }),
                        submitted: Instant::now(),
                        writer: prefill,
                        trace: valid_traceparent(trace),
                    }),
                    _ => None,
                };
                tx.send(DecodeCmd::FromCoordinator {
                    msg,
                    reply: reply.clone(),
                    body,
                })
                .is_ok()
            }
            (
                Frame::Control(Control {
                    msg,
                    rng_pos,
                    cached_tokens,
                    ..
                }),
                NodeCmds::Decode(tx),
                Role::Prefill,
            ) => tx
                .send(DecodeCmd::FromPrefill {
                    msg,
                    extra: CommitExtra {
                        rng_pos: rng_pos.unwrap_or(0),
                        cached_tokens: cached_tokens.unwrap_or(0),
                    },
                    from: writer.clone(),
                })
                .is_ok(),
            (
                Frame::Control(Control {
                    msg,
                    body,
                    decode,
                    trace,
                    ..
                }),
                NodeCmds::Prefill(tx),
                Role::Coordinator,
            ) => {
                let req = msg.req();
                if !carried.contains(&req) {
                    carried.push(req);
                }
                tx.send(PrefillCmd::FromCoordinator {
                    msg,
                    reply: reply.clone(),
                    body: body
                        .zip(decode)
                        .map(|(b, d)| (b, d, valid_traceparent(trace))),
                })
                .is_ok()
            }
            (Frame::Land { req, dest }, NodeCmds::Decode(tx), Role::Prefill) => tx
                .send(DecodeCmd::Land {
                    landing: PageLanding {
                        req,
                        dest,
                        bytes: payload,
                    },
                    from: writer.clone(),
                })
                .is_ok(),
            (Frame::Flush { id }, NodeCmds::Decode(tx), Role::Prefill) => {
                let c = conn.clone();
                let ack = Box::new(move || {
                    c.try_send(&Frame::FlushAck { id }, &[]);
                });
                tx.send(DecodeCmd::AfterEarlier(ack)).is_ok()
            }
            (f, _, from) => {
                break Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("unexpected frame from a {from:?} peer: {f:?}"),
                ))
            }
        };
        if !sent {
            break Err(io::Error::other("the engine thread is gone"));
        }
    };
    conn.close();
    if let (Role::Prefill, NodeCmds::Decode(tx)) = (from, cmds) {
        // Nothing it issued on this link can land any more.
        let _ = tx.send(DecodeCmd::WriterLink {
            name: peer_name,
            lost: true,
        });
    }
    // The coordinator is gone: nobody will finish or abort its requests, so the
    // protocol aborts them (answers into the closed connection are dropped).
    if from == Role::Coordinator {
        for req in carried {
            let _ = match cmds {
                NodeCmds::Decode(tx) => tx.send(DecodeCmd::CoordinatorLost(req)).is_ok(),
                NodeCmds::Prefill(tx) => tx.send(PrefillCmd::CoordinatorLost(req)).is_ok(),
            };
        }
    }
    result
}

/// A peer's `traceparent`, kept only when it is one: `00-<32 hex>-<16 hex>-<2 hex>`
/// (55 bytes). Anything else is dropped, so a peer cannot make the node log or
/// export arbitrary text.
fn valid_traceparent(t: Option<String>) -> Option<String> {
    let t = t?;
    let b = t.as_bytes();
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(|c| c.is_ascii_hexdigit());
    let ok = b.len() == 55
        && b[2] == b'-'
        && b[35] == b'-'
        && b[52] == b'-'
        && hex(0..2)
        && hex(3..35)
        && hex(36..52)
        && hex(53..55);
    ok.then_some(t)
}

/// A prefill node's connection to one decode node.
struct Peer {
    conn: Arc<Conn>,
    acks: Mutex<HashMap<u64, mpsc::Sender<()>>>,
    next_flush: AtomicU64,
    /// UCX endpoint into the decode node's registered pool, when both use UCX.
    ucx: Option<Mutex<UcxSource>>,
}

/// How a prefill node process reaches the decode nodes of its deployment.
struct PeerLinks {
    /// This prefill node's name (its listen address).
    name: String,
    peers: Vec<String>,
    /// One slot per decode node, each with its own lock: connecting to one node never
    /// waits on another.
    conns: Vec<Mutex<Option<Arc<Peer>>>>,
    /// This node's UCX context (`--transport ucx`).
    ucx: Option<UcxContext>,
}

impl PeerLinks {
    /// The connection to decode node `index`, opened (again) if needed.
    fn peer(&self, index: usize) -> Result<Arc<Peer>, TransportError> {
        let gone = |m: String| TransportError::PeerGone(m);
        let (Some(addr), Some(slot)) = (self.peers.get(index), self.conns.get(index)) else {
            return Err(gone(format!("no decode node {index} in the deployment")));
        };
        let mut slot = slot.lock().unwrap();
        if let Some(p) = slot.as_ref() {
            if p.conn.is_alive() {
                return Ok(p.clone());
            }
        }
        let (conn, mut r) =
            connect(addr).map_err(|e| gone(format!("cannot reach decode node {addr}: {e}")))?;
        // A node that accepts but never answers (stopped, overloaded) must not hold
        // this worker forever.
        let _ = r.get_ref().set_read_timeout(Some(HANDSHAKE_TIMEOUT));
        if !conn.try_send(
            &Frame::Hello {
                from: Role::Prefill,
                name: Some(self.name.clone()),
            },
            &[],
        ) {
            return Err(gone(format!("decode node {addr} closed the connection")));
        }
        let region = match read_frame(&mut r) {
            Ok((Frame::Region { ucx }, _)) => ucx,
            _ => {
                conn.close();
                return Err(gone(format!("decode node {addr} did not answer hello")));
            }
        };
        let _ = r.get_ref().set_read_timeout(None);
        let ucx = match (&self.ucx, region) {
            (Some(ctx), Some(desc)) => {
                match UcxSource::connect(ctx, &desc, UcxSourceConfig::default()) {
                    Ok(src) => Some(Mutex::new(src)),
                    Err(e) => {
                        conn.close();
                        return Err(gone(format!("UCX connect to {addr} failed: {e}")));
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
        *slot = Some(peer.clone());
        Ok(peer)
    }
}

impl PrefillLinks for PeerLinks {
    fn transport(
        &self,
        decode: usize,
        _fault: Option<TransferFault>,
        _dest: &[DestPage],
    ) -> Result<Box<dyn KvTransport>, TransportError> {
        Ok(Box::new(PeerTransport {
            peer: self.peer(decode)?,
        }))
    }

    fn to_decode(&self, decode: usize, msg: Msg, extra: CommitExtra) -> bool {
        self.peer(decode).is_ok_and(|p| {
            p.conn.send(
                &Frame::Control(Control {
                    rng_pos: Some(extra.rng_pos),
                    cached_tokens: Some(extra.cached_tokens),
                    ..Control::new(msg)
                }),
                &[],
            )
        })
    }
}

/// [`KvTransport`] from a prefill node into one decode node: UCX one-sided puts
/// and a UCX flush (remote completion) when both nodes run `--transport ucx`;
/// otherwise each put is a `Land` frame on the TCP connection and `flush` waits for
/// the decode node's `FlushAck`, which it sends after applying every earlier frame
/// (so the writes have landed). Runs on a transfer worker: it may block.
struct PeerTransport {
    peer: Arc<Peer>,
}

impl PeerTransport {
    /// A failed UCX endpoint is unusable: drop the connection so the next transfer
    /// opens a fresh one.
    fn fail(&self, e: TransportError) -> TransportError {
        self.peer.conn.close();
        e
    }
}

impl KvTransport for PeerTransport {
    fn put(&mut self, req: u64, dest: DestPage, bytes: &[u8]) -> Result<(), TransportError> {
        if let Some(ucx) = &self.peer.ucx {
            let r = ucx.lock().unwrap().put(req, dest, bytes);
            return r.map_err(|e| self.fail(e));
        }
        if self.peer.conn.send(&Frame::Land { req, dest }, bytes) {
            Ok(())
        } else {
            Err(TransportError::PeerGone(
                "decode node connection closed".into(),
            ))
        }
    }

    fn flush(&mut self) -> Result<(), TransportError> {
        if let Some(ucx) = &self.peer.ucx {
            let r = ucx.lock().unwrap().flush();
            return r.map_err(|e| self.fail(e));
        }
        let p = &self.peer;
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pools_default_page_size_is_the_engines() {
        assert_eq!(
            tessera_config::DEFAULT_PAGE_SIZE,
            EngineConfig::default().page_size
        );
        let pool: tessera_config::PoolConfig = toml::from_str(
            r#"name = "p"
               role = "decode"
               kv_pool_tokens = 4096
               nodes = ["h:1"]"#,
        )
        .unwrap();
        let e = pool_engine_config(&pool);
        assert_eq!((e.page_size, e.kv_pool_tokens), (16, 4096));
    }
}
