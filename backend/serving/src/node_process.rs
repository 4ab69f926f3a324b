//! `tessera node`: a prefill or decode node as its own process, serving node links
//! from gateways and (for a decode node) prefill nodes.
//!
//! The engine thread runs the same node loop as in one process
//! ([`crate::decode_node`], [`crate::prefill_node`]); connection tasks (on the node
//! links' runtime, [`crate::net`]) authenticate the peer, parse frames into the engine
//! thread's commands and check that each frame is one the peer may send; replies go
//! out through each connection's writer queue, so no socket ever blocks the engine.
//!
//! Supervision: any panic (engine thread, connection task, anywhere) logs and ends
//! the process with status 101, and an engine thread that stops ends it with status
//! 1: its connections close, so gateways fail its requests at once, and a supervisor
//! restarts it as a new incarnation. Drain (SIGTERM, or `Drain` from a gateway
//! identity): the node tells its gateways it is draining, lets running requests
//! finish until the drain deadline, ends the rest with an error, and exits 0.

use crate::conn_gate::{HeadGate, Ticket};
use crate::decode_node::{DecodeCmd, DecodeLoop, RequestBody};
use crate::link_security::{fingerprint_hex, node_name, parse_fingerprint, NodeLinks};
use crate::links::{CommitExtra, PdCounters, Reply, ReplyTo, TransferFault, WriterLink};
use crate::metrics::{serve_metrics, NodeMetrics};
use crate::net::{
    self, block_on, open_link, Conn, Control, Frame, FrameLimits, FrameReader, LinkEnd, WireEvent,
};
use crate::node_loop::{run_node, NodeLoop, Shared};
use crate::prefill_node::{PrefillCmd, PrefillLinks, PrefillLoop};
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock, Weak};
use std::time::{Duration, Instant};
use tessera_engine::sink::{EventSink, Gone};
use tessera_engine::{Engine, EngineConfig, Event};
use tessera_model::LoadedModel;
use tessera_transfer::inproc::PageLanding;
use tessera_transfer::protocol::{FailKind, FailReason, Msg, ReqId, Role};
use tessera_transfer::transport::{DestPage, KvTransport, TransportError};
use tessera_transfer::ucx::{UcxContext, UcxRegionDescriptor, UcxSink, UcxSource, UcxSourceConfig};

/// How long a flush waits for the decode node's acknowledgement (a dead link ends
/// the wait sooner).
const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);
/// After a drain's deadline, how long the node waits for the requests it ended to
/// be reported before it exits anyway.
const DRAIN_GRACE: Duration = Duration::from_secs(10);
/// Messages about requests a link never carried (`Abort`, `Poll`) that a link may
/// send at once: a coordinator aborts a request at a prefill node that never saw it
/// only when the client left before the prefill started; a flood of them would
/// otherwise leave a tombstone per message.
const UNKNOWN_BURST: f64 = 1024.0;
/// ... and per second after the burst.
const UNKNOWN_PER_SEC: f64 = 256.0;

/// How long a control connection may take from accept to its hello (TLS handshake
/// included), however it trickles its bytes or pings.
pub(crate) const CONTROL_HEAD_DEADLINE: Duration = Duration::from_secs(10);
/// Most control connections at once (gateways and prefill peers, one link each).
pub(crate) const MAX_CONTROL_CONNECTIONS: usize = 1024;
/// Most control connections before their hello; a new one past the cap cuts the one
/// that has been in its head the longest ([`crate::conn_gate`]).
pub(crate) const MAX_CONTROL_HEADS: usize = 64;

/// How page bytes move from prefill to decode nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// `Land` frames on the control connection, flush acknowledged.
    Tcp,
    /// UCX one-sided puts into the decode pool, registered with UCX (UCX picks
    /// shared memory, TCP or RDMA verbs; `UCX_TLS` narrows the choice).
    Ucx,
}

/// A deliberate panic for the supervision tests (`TESSERA_TEST_NODE_PANIC`, read
/// once at start by `tessera node`; test-only, never set it in a deployment).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestPanic {
    /// `engine`: the engine thread panics after its first step with a running
    /// request (a decode node: mid-stream).
    Engine,
    /// `connection`: a connection task panics on its first control frame.
    Connection,
}

impl TestPanic {
    /// `engine` or `connection`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "engine" => Some(Self::Engine),
            "connection" => Some(Self::Connection),
            _ => None,
        }
    }
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
    /// Authentication and timings of the node links.
    pub links: NodeLinks,
    /// How long a drain lets running requests finish before it ends them.
    pub drain_timeout: Duration,
    /// Test-only fault ([`TestPanic`]).
    #[doc(hidden)]
    pub test_panic: Option<TestPanic>,
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

impl NodeCmds {
    fn coordinator_lost(&self, req: ReqId) {
        let _ = match self {
            NodeCmds::Decode(tx) => tx.send(DecodeCmd::CoordinatorLost(req)).is_ok(),
            NodeCmds::Prefill(tx) => tx.send(PrefillCmd::CoordinatorLost(req)).is_ok(),
        };
    }

    /// Tells the engine thread's protocol machine that the node drains: it refuses
    /// new requests from now on (a refusal the coordinator retries elsewhere).
    fn begin_drain(&self) {
        let _ = match self {
            NodeCmds::Decode(tx) => tx.send(DecodeCmd::Drain).is_ok(),
            NodeCmds::Prefill(tx) => tx.send(PrefillCmd::Drain).is_ok(),
        };
    }

    fn end_all(&self) {
        let reason = FailReason::new(
            FailKind::Transport,
            "the node is shutting down: its drain deadline passed before the request finished",
        );
        let _ = match self {
            NodeCmds::Decode(tx) => tx.send(DecodeCmd::EndAll(reason)).is_ok(),
            NodeCmds::Prefill(tx) => tx.send(PrefillCmd::EndAll).is_ok(),
        };
    }
}

/// Which coordinator link carries each request the node was handed: messages about
/// a request are taken only from the link that carried it, and when a link closes
/// its requests are aborted. An entry goes when the node sent the request's last
/// message (`Finished`, `Rejected`, `CommitFailed`, `PrefillFailed`, `AbortAck`, or a
/// prefill node's `Commit`).
#[derive(Default)]
struct Carried(Mutex<HashMap<ReqId, u64>>);

impl Carried {
    /// Records that link `conn` carries `req`; false when another link does.
    fn claim(&self, req: ReqId, conn: u64) -> bool {
        *self.0.lock().unwrap().entry(req).or_insert(conn) == conn
    }

    fn carrier(&self, req: ReqId) -> Option<u64> {
        self.0.lock().unwrap().get(&req).copied()
    }

    fn done(&self, req: ReqId) {
        self.0.lock().unwrap().remove(&req);
    }

    /// Forgets and returns the requests link `conn` carried.
    fn take(&self, conn: u64) -> Vec<ReqId> {
        let mut m = self.0.lock().unwrap();
        let reqs: Vec<ReqId> = m
            .iter()
            .filter(|(_, c)| **c == conn)
            .map(|(r, _)| *r)
            .collect();
        for r in &reqs {
            m.remove(r);
        }
        reqs
    }

    fn is_empty(&self) -> bool {
        self.0.lock().unwrap().is_empty()
    }

    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// Whether a node's message to a coordinator is the last it sends for the request.
fn is_last(msg: &Msg) -> bool {
    matches!(
        msg,
        Msg::Finished { .. }
            | Msg::Rejected { .. }
            | Msg::CommitFailed { .. }
            | Msg::PrefillFailed { .. }
            | Msg::AbortAck { .. }
    )
}

/// A coordinator link as a request's reply target.
struct CoordReply {
    conn: Arc<Conn>,
    carried: Arc<Carried>,
}

impl Reply for CoordReply {
    fn send(&self, msg: Msg) -> bool {
        if is_last(&msg) {
            self.carried.done(msg.req());
        }
        self.conn.control(msg)
    }
}

/// Every open link of the process (to let queued frames out before a drained node
/// exits).
#[derive(Default)]
struct Registry(Mutex<Vec<Weak<Conn>>>);

impl Registry {
    fn add(&self, c: &Arc<Conn>) {
        let mut v = self.0.lock().unwrap();
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(c));
    }

    fn open(&self) -> Vec<Arc<Conn>> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|c| c.is_alive())
            .collect()
    }
}

/// Everything a node's connection tasks share.
struct NodeState {
    role: Role,
    links: NodeLinks,
    cmds: NodeCmds,
    region: Option<UcxRegionDescriptor>,
    incarnation: u64,
    counters: Arc<PdCounters>,
    shared: Arc<Shared>,
    page_bytes: usize,
    decode_peers: usize,
    /// A prefill node's decode peers (to look up a decode node a gateway names by
    /// address).
    peer_links: Option<Arc<PeerLinks>>,
    carried: Arc<Carried>,
    registry: Arc<Registry>,
    /// Coordinator links (they hear `Status`).
    gateways: Registry,
    next_conn: AtomicU64,
    draining: AtomicBool,
    drain_timeout: Duration,
    exit: Mutex<Option<mpsc::Sender<()>>>,
    test_panic: Option<TestPanic>,
}

/// Logs any panic and ends the process with status 101 (a node never limps on with
/// a dead engine or connection thread).
fn exit_on_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        tracing::error!(%info, "panic in a node process; exiting");
        std::process::exit(101);
    }));
}

/// A node loop that panics after its first step with a running request
/// ([`TestPanic::Engine`]).
struct PanicOnWork<N>(N);

impl<N: NodeLoop> NodeLoop for PanicOnWork<N> {
    type Cmd = N::Cmd;

    fn on_cmd(&mut self, engine: &mut Engine, cmd: N::Cmd) {
        self.0.on_cmd(engine, cmd)
    }

    fn busy(&self) -> bool {
        self.0.busy()
    }

    fn after_step(&mut self, engine: &mut Engine) {
        self.0.after_step(engine);
        if engine.running_len() > 0 {
            panic!("TESSERA_TEST_NODE_PANIC=engine: a test-only panic on the engine thread");
        }
    }

    fn queued(&self) -> usize {
        self.0.queued()
    }

    fn live(&self) -> usize {
        self.0.live()
    }

    fn stop(&self) -> bool {
        self.0.stop()
    }

    fn timer(&self) -> Option<Duration> {
        self.0.timer()
    }
}

/// Starts the engine thread; the process exits if it ever stops.
fn spawn_engine<N: NodeLoop + Send + 'static>(
    engine: Engine,
    node: N,
    rx: mpsc::Receiver<N::Cmd>,
    shared: Arc<Shared>,
    name: &str,
    panic: bool,
) -> io::Result<()> {
    let t = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            if panic {
                run_node(engine, PanicOnWork(node), rx, &shared)
            } else {
                run_node(engine, node, rx, &shared)
            }
        })?;
    std::thread::Builder::new()
        .name("tessera-supervisor".into())
        .spawn(move || {
            let _ = t.join();
            tracing::error!("the engine thread stopped; exiting");
            std::process::exit(1);
        })?;
    Ok(())
}

/// Runs one node until it is drained (then returns `Ok`) or the process is killed:
/// binds `opts.listen` (and `opts.metrics_listen`), then serves node links. Calls
/// `ready` with the bound control address and the metrics address once listening.
/// Installs a panic hook that ends the process (see the module docs).
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
    exit_on_panic();
    let listener = std::net::TcpListener::bind(&opts.listen)?;
    listener.set_nonblocking(true)?;
    let metrics_listener = match &opts.metrics_listen {
        Some(a) => Some(std::net::TcpListener::bind(a)?),
        None => None,
    };
    let mut engine = Engine::new(
        model.transformer.clone(),
        model.tokenizer.clone(),
        opts.engine.clone(),
    );
    let page_bytes = engine.kv().layout().page_bytes();
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
    let links = opts
        .links
        .clone()
        .with_context(model.transformer.config().context);
    let counters = Arc::new(PdCounters::default());
    metrics.watch_links(&opts.listen, role_label, counters.clone());
    let shared = Arc::new(Shared::with_metrics(handles.clone()));
    let carried = Arc::new(Carried::default());
    let registry = Arc::new(Registry::default());
    let panic_engine = opts.test_panic == Some(TestPanic::Engine);
    let mut peer_links_of_prefill = None;
    let cmds = match opts.role {
        Role::Decode => {
            let (tx, rx) = mpsc::channel();
            engine.track_ended();
            let node = DecodeLoop::new(counters.clone(), handles.clone());
            spawn_engine(
                engine,
                node,
                rx,
                shared.clone(),
                "tessera-decode",
                panic_engine,
            )?;
            NodeCmds::Decode(tx)
        }
        _ => {
            let (tx, rx) = mpsc::channel();
            let peer_links = Arc::new(PeerLinks {
                name: opts.listen.clone(),
                peers: RwLock::new(
                    opts.decode_peers
                        .iter()
                        .map(|a| Arc::new(PeerSlot::new(a)))
                        .collect(),
                ),
                ucx,
                links: links.clone(),
                carried: carried.clone(),
                registry: registry.clone(),
                counters: counters.clone(),
                cmds: tx.clone(),
            });
            peer_links_of_prefill = Some(peer_links.clone());
            let peer_links: Arc<dyn PrefillLinks> = peer_links;
            let fp = engine.model_fingerprint();
            let node = PrefillLoop::new(peer_links, tx.clone(), handles.clone(), fp);
            spawn_engine(
                engine,
                node,
                rx,
                shared.clone(),
                "tessera-prefill",
                panic_engine,
            )?;
            NodeCmds::Prefill(tx)
        }
    };
    let (exit_tx, exit_rx) = mpsc::channel();
    let node = Arc::new(NodeState {
        role: opts.role,
        links,
        cmds,
        region,
        incarnation: rand::random(),
        counters,
        shared,
        page_bytes,
        decode_peers: opts.decode_peers.len(),
        peer_links: peer_links_of_prefill,
        carried,
        registry,
        gateways: Registry::default(),
        next_conn: AtomicU64::new(1),
        draining: AtomicBool::new(false),
        drain_timeout: opts.drain_timeout,
        exit: Mutex::new(Some(exit_tx)),
        test_panic: opts.test_panic,
    });
    let addr = listener.local_addr()?;
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
    {
        let _rt = net::enter();
        let listener = tokio::net::TcpListener::from_std(listener)?;
        #[cfg(unix)]
        {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            let n = node.clone();
            net::spawn(async move {
                if term.recv().await.is_some() {
                    n.begin_drain("SIGTERM");
                }
            });
        }
        net::spawn(accept_loop(node.clone(), listener));
    }
    ready(addr, metrics_addr);
    // Returns once a drain finished (or never).
    let _ = exit_rx.recv();
    Ok(())
}

async fn accept_loop(node: Arc<NodeState>, listener: tokio::net::TcpListener) {
    let gate = HeadGate::new(MAX_CONTROL_CONNECTIONS, MAX_CONTROL_HEADS);
    loop {
        match listener.accept().await {
            Ok((tcp, peer)) => {
                let (cut_tx, cut) = tokio::sync::oneshot::channel::<()>();
                let Some(ticket) = gate.admit(Box::new(move || {
                    let _ = cut_tx.send(());
                })) else {
                    tracing::warn!(%peer, "refused a node link: every connection slot is taken");
                    continue;
                };
                let n = node.clone();
                tokio::spawn(async move { n.serve(tcp, peer.to_string(), ticket, cut).await });
            }
            Err(e) => {
                // Out of file descriptors or memory: back off instead of spinning.
                tracing::warn!(error = %e, "accepting a node link failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// A budget of messages for requests a link never carried: a burst, refilled at a
/// fixed rate.
struct Budget {
    tokens: f64,
    at: Instant,
}

impl Budget {
    fn new() -> Self {
        Self {
            tokens: UNKNOWN_BURST,
            at: Instant::now(),
        }
    }

    /// Spends one; false when none is left.
    fn spend(&mut self) -> bool {
        self.spend_at(Instant::now())
    }

    /// [`Self::spend`] at time `now`.
    fn spend_at(&mut self, now: Instant) -> bool {
        let refill = now.duration_since(self.at).as_secs_f64() * UNKNOWN_PER_SEC;
        self.tokens = (self.tokens + refill).min(UNKNOWN_BURST);
        self.at = now;
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        true
    }
}

/// One accepted link, after its hello.
struct Link {
    id: u64,
    from: Role,
    conn: Arc<Conn>,
    reply: ReplyTo,
    unknown: Budget,
    control_frames: u64,
    /// A prefill peer as a request's writer (its name and this connection).
    writer: WriterLink,
}

impl NodeState {
    fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Serves one accepted connection: handshake, hello, then frames until it ends.
    /// The head (handshake and hello) must be done by [`CONTROL_HEAD_DEADLINE`] and
    /// ends early when `cut` fires (the slot is given to a newer connection).
    async fn serve(
        self: Arc<Self>,
        tcp: tokio::net::TcpStream,
        peer: String,
        mut ticket: Ticket,
        mut cut: tokio::sync::oneshot::Receiver<()>,
    ) {
        let s = self.links.settings();
        let deadline = tokio::time::Instant::now() + CONTROL_HEAD_DEADLINE;
        let late = || {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no hello within {CONTROL_HEAD_DEADLINE:?} of connecting"),
            )
        };
        let accepted = tokio::select! {
            r = tokio::time::timeout_at(deadline, self.links.accept(tcp)) => r.unwrap_or_else(|_| Err(late())),
            _ = &mut cut => Err(io::Error::other("cut to make room for another connection")),
        };
        let (r, w, cert) = match accepted {
            Ok(x) => x,
            Err(e) => {
                self.counters.peers_refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%peer, error = %e, "refused a node link: TLS handshake failed");
                return;
            }
        };
        let conn = Conn::start(w, peer.clone(), s);
        let limits = FrameLimits {
            max_header: s.max_header,
            page_bytes: None,
        };
        let mut reader = FrameReader::new(r, limits, s.dead_after);
        let hello = tokio::select! {
            r = tokio::time::timeout_at(deadline, reader.next_on(&conn)) => {
                r.unwrap_or_else(|_| Err(LinkEnd::Closed(late().to_string())))
            }
            _ = &mut cut => Err(LinkEnd::Closed("cut to make room for another connection".into())),
        };
        let hello = if ticket.head_done() {
            hello
        } else {
            Err(LinkEnd::Closed(
                "cut to make room for another connection".into(),
            ))
        };
        let (from, hello_name, hello_model) = match hello {
            Ok((Frame::Hello { from, name, model }, _)) => (from, name, model),
            Ok((f, _)) => {
                let end = LinkEnd::Violation(format!("a {} frame before hello", f.kind()));
                end.note(&peer, &self.counters);
                conn.close();
                return;
            }
            Err(end) => {
                end.note(&peer, &self.counters);
                conn.close();
                return;
            }
        };
        let proven = match self
            .links
            .authorize(&cert, from, self.role, hello_model.as_deref())
        {
            Ok(address) => address,
            Err(why) => {
                self.counters.peers_refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%peer, ?from, "refused a node link: {why}");
                conn.close();
                return;
            }
        };
        // A prefill peer's name, what decode records name as a request's writer: the
        // address its certificate proves (TLS), else what it says (loopback only).
        let writer = WriterLink {
            name: proven.or(hello_name).unwrap_or_else(|| peer.clone()),
            link: Some(conn.clone()),
        };
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        if from == Role::Prefill {
            reader.take_pages(self.page_bytes);
            if let NodeCmds::Decode(tx) = &self.cmds {
                // Also where the decode node asks this writer whether it is quiet.
                let _ = tx.send(DecodeCmd::WriterLink {
                    name: writer.name.clone(),
                    id,
                    to: Some(conn.clone()),
                });
            }
        }
        conn.try_send(
            &Frame::Welcome {
                incarnation: self.incarnation,
                ucx: (from == Role::Prefill)
                    .then(|| self.region.clone())
                    .flatten(),
                draining: self.draining(),
                model: self.links.model(),
            },
            &[],
        );
        self.registry.add(&conn);
        if from == Role::Coordinator {
            self.gateways.add(&conn);
        }
        let mut link = Link {
            id,
            from,
            reply: Arc::new(CoordReply {
                conn: conn.clone(),
                carried: self.carried.clone(),
            }),
            conn,
            unknown: Budget::new(),
            control_frames: 0,
            writer,
        };
        let end = loop {
            match reader.next_on(&link.conn).await {
                Ok((frame, payload)) => {
                    if let Err(why) = self.on_frame(&mut link, frame, payload) {
                        break LinkEnd::Violation(why);
                    }
                }
                Err(end) => break end,
            }
        };
        end.note(&peer, &self.counters);
        if let (Role::Prefill, NodeCmds::Decode(tx)) = (from, &self.cmds) {
            // Nothing it issued on this link can land any more (no frame of it is
            // read after this). Told before the link is closed, so whoever sees it
            // closed knows the engine thread hears of it before any later command.
            let _ = tx.send(DecodeCmd::WriterLink {
                name: link.writer.name.clone(),
                id: link.id,
                to: None,
            });
        }
        link.conn.close();
        // The coordinator is gone: nobody will finish or abort its requests, so the
        // protocol aborts them (answers into the closed connection are dropped).
        if from == Role::Coordinator {
            for req in self.carried.take(link.id) {
                self.cmds.coordinator_lost(req);
            }
        }
    }

    /// A message about `req` from a coordinator link that did not bring it: only
    /// within the link's budget, and never one about another link's request.
    /// Returns whether to pass it on.
    fn about_unknown(&self, link: &mut Link, req: ReqId) -> Result<bool, String> {
        match self.carried.carrier(req) {
            Some(c) if c == link.id => return Ok(true),
            Some(_) => {
                tracing::warn!(?req, "dropped a message about another link's request");
            }
            None => {}
        }
        if !link.unknown.spend() {
            return Err(format!(
                "more than {UNKNOWN_BURST} messages (then {UNKNOWN_PER_SEC}/s) about requests this link never carried"
            ));
        }
        Ok(self.carried.carrier(req).is_none())
    }

    /// Turns one frame into the engine thread's command, or says why the peer may not
    /// send it (the link is then closed). Never blocks.
    fn on_frame(
        self: &Arc<Self>,
        link: &mut Link,
        frame: Frame,
        payload: Vec<u8>,
    ) -> Result<(), String> {
        if matches!(frame, Frame::Control { .. }) {
            link.control_frames += 1;
            if link.control_frames == 1 && self.test_panic == Some(TestPanic::Connection) {
                panic!(
                    "TESSERA_TEST_NODE_PANIC=connection: a test-only panic on a connection task"
                );
            }
        }
        let gone = || "the engine thread is gone".to_string();
        match (frame, &self.cmds, link.from) {
            (Frame::Drain, _, Role::Coordinator) => {
                self.begin_drain("a drain request from a gateway identity");
                Ok(())
            }
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
                let body = match (&msg, body) {
                    (Msg::Prealloc { .. }, Some(body)) => {
                        if !self.carried.claim(req, link.id) {
                            return Err(format!(
                                "Prealloc for {req:?}, which another link carries"
                            ));
                        }
                        tracing::debug!(?req, "a new request from a gateway");
                        Some(Box::new(RequestBody {
                            req: body,
                            sink: Box::new(ConnSink {
                                conn: link.conn.clone(),
                                req,
                            }),
                            submitted: Instant::now(),
                            writer: prefill,
                            trace: valid_traceparent(trace),
                        }))
                    }
                    (Msg::Prealloc { .. }, None) => {
                        return Err("a Prealloc without its request body".into())
                    }
                    (Msg::Abort { .. } | Msg::Poll { .. }, _) => {
                        if !self.about_unknown(link, req)? {
                            return Ok(());
                        }
                        None
                    }
                    (m, _) => {
                        return Err(format!(
                            "a coordinator may not send {} to a decode node",
                            msg_name(m)
                        ))
                    }
                };
                tx.send(DecodeCmd::FromCoordinator {
                    msg,
                    reply: link.reply.clone(),
                    body,
                })
                .map_err(|_| gone())
            }
            (
                Frame::Control(Control {
                    msg,
                    rng_pos,
                    cached_tokens,
                    model,
                    logprobs,
                    ..
                }),
                NodeCmds::Decode(tx),
                Role::Prefill,
            ) => {
                if !matches!(
                    msg,
                    Msg::Commit { .. } | Msg::Renew { .. } | Msg::WriterQuiet { .. }
                ) {
                    return Err(format!(
                        "a prefill node may not send {} to a decode node",
                        msg_name(&msg)
                    ));
                }
                tx.send(DecodeCmd::FromPrefill {
                    msg,
                    extra: CommitExtra {
                        rng_pos: rng_pos.unwrap_or(0),
                        cached_tokens: cached_tokens.unwrap_or(0),
                        model: model.as_deref().map(parse_fingerprint),
                        logprobs,
                    },
                    from: link.writer.clone(),
                })
                .map_err(|_| gone())
            }
            (
                Frame::Control(Control {
                    msg,
                    body,
                    decode,
                    decode_node,
                    trace,
                    ..
                }),
                NodeCmds::Prefill(tx),
                Role::Coordinator,
            ) => {
                let req = msg.req();
                let body = match (&msg, body.zip(decode)) {
                    (Msg::Prefill { .. }, Some((body, decode))) => {
                        // By address when the gateway names one (its index may
                        // follow another order than this node's file), else by
                        // index into this node's file (an older gateway).
                        let decode = match (decode_node, &self.peer_links) {
                            (Some(addr), Some(peers)) => peers.index_of(&addr)?,
                            _ if decode >= self.decode_peers => {
                                return Err(format!("a Prefill for decode node {decode}, which the deployment does not have"));
                            }
                            _ => decode,
                        };
                        if !self.carried.claim(req, link.id) {
                            return Err(format!("Prefill for {req:?}, which another link carries"));
                        }
                        Some((body, decode, valid_traceparent(trace)))
                    }
                    (Msg::Prefill { .. }, None) => {
                        return Err("a Prefill without its request body and decode node".into())
                    }
                    (Msg::Abort { .. }, _) => {
                        if !self.about_unknown(link, req)? {
                            return Ok(());
                        }
                        None
                    }
                    (m, _) => {
                        return Err(format!(
                            "a coordinator may not send {} to a prefill node",
                            msg_name(m)
                        ))
                    }
                };
                tx.send(PrefillCmd::FromCoordinator {
                    msg,
                    reply: link.reply.clone(),
                    body,
                })
                .map_err(|_| gone())
            }
            (Frame::Land { req, dest }, NodeCmds::Decode(tx), Role::Prefill) => tx
                .send(DecodeCmd::Land {
                    landing: PageLanding {
                        req,
                        dest,
                        bytes: payload,
                    },
                    from: link.writer.clone(),
                })
                .map_err(|_| gone()),
            (Frame::Flush { id }, NodeCmds::Decode(tx), Role::Prefill) => {
                let c = link.conn.clone();
                let ack = Box::new(move || {
                    c.try_send(&Frame::FlushAck { id }, &[]);
                });
                tx.send(DecodeCmd::AfterEarlier(ack)).map_err(|_| gone())
            }
            (f, _, from) => Err(format!("a {} frame from a {from:?} peer", f.kind())),
        }
    }

    /// Starts a drain (once): tells the gateways, then waits on a thread of its own.
    fn begin_drain(self: &Arc<Self>, why: &str) {
        if self.draining.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::warn!(
            timeout = ?self.drain_timeout,
            "draining ({why}): no new requests; running requests may finish until the deadline"
        );
        // The protocol refuses new requests from here on (the coordinator retries
        // them on another node); told before the gateways, so whatever a gateway
        // sends after it read the status below is refused, never accepted.
        self.cmds.begin_drain();
        for g in self.gateways.open() {
            g.try_send(&Frame::Status { draining: true }, &[]);
        }
        let node = self.clone();
        let spawned = std::thread::Builder::new()
            .name("tessera-drain".into())
            .spawn(move || node.drain());
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the drain; exiting");
            std::process::exit(1);
        }
    }

    /// Whether the node holds no request any more.
    fn idle(&self) -> bool {
        self.carried.is_empty() && self.shared.live() == 0
    }

    /// Waits until `deadline` for the node to be idle; returns whether it is.
    fn wait_idle(&self, deadline: Instant) -> bool {
        let mut said = Instant::now();
        while !self.idle() {
            if Instant::now() >= deadline {
                return false;
            }
            if said.elapsed() >= Duration::from_secs(5) {
                said = Instant::now();
                tracing::warn!(
                    carried = self.carried.len(),
                    held = self.shared.live(),
                    "draining: requests still held"
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    /// The drain: running requests finish until the deadline, the rest end with an
    /// error; queued frames go out; then `run_node_process` returns.
    fn drain(&self) {
        if !self.wait_idle(Instant::now() + self.drain_timeout) {
            tracing::warn!(
                "drain deadline passed; ending the requests still running with an error"
            );
            self.cmds.end_all();
            if !self.wait_idle(Instant::now() + DRAIN_GRACE) {
                tracing::warn!("requests still held after the drain grace period; exiting anyway");
            }
        }
        let conns = self.registry.open();
        for c in &conns {
            c.finish();
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while conns.iter().any(|c| c.is_alive()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        tracing::warn!("drained; exiting");
        if let Some(tx) = self.exit.lock().unwrap().take() {
            let _ = tx.send(());
        }
    }
}

/// `tessera node drain`: asks node `addr` (of `role`) to drain, over a link with the
/// gateway identity, and returns once it said so; with `wait`, also waits (that long
/// at most) until the node finished draining and closed the link.
///
/// Errors: the node cannot be reached or refused the link (not a gateway identity),
/// it did not confirm, or it still runs after `wait`.
pub fn drain_node(
    links: &NodeLinks,
    addr: &str,
    role: Role,
    wait: Option<Duration>,
) -> io::Result<()> {
    let name = node_name(role, addr)?;
    let (links, addr) = (links.clone(), addr.to_string());
    block_on(async move {
        let (conn, welcome, mut reader) =
            open_link(links, addr.clone(), name, Role::Coordinator, None, None).await?;
        let timeout = |m: String| io::Error::new(io::ErrorKind::TimedOut, m);
        if !welcome.draining {
            conn.try_send(&Frame::Drain, &[]);
            let confirmed = async {
                loop {
                    match reader.next_on(&conn).await {
                        Ok((Frame::Status { draining: true }, _)) => return Ok(()),
                        Ok(_) => continue,
                        Err(e) => return Err(io::Error::other(format!("{addr}: {e}"))),
                    }
                }
            };
            tokio::time::timeout(crate::link_security::HANDSHAKE_TIMEOUT, confirmed)
                .await
                .map_err(|_| timeout(format!("{addr} did not confirm the drain")))??;
        }
        if let Some(wait) = wait {
            let ended = async { while reader.next_on(&conn).await.is_ok() {} };
            tokio::time::timeout(wait, ended)
                .await
                .map_err(|_| timeout(format!("{addr} still runs after {wait:?}")))?;
        }
        conn.finish();
        Ok(())
    })
}

fn msg_name(m: &Msg) -> &'static str {
    match m {
        Msg::Prealloc { .. } => "Prealloc",
        Msg::Descriptor { .. } => "Descriptor",
        Msg::Rejected { .. } => "Rejected",
        Msg::Prefill { .. } => "Prefill",
        Msg::Commit { .. } => "Commit",
        Msg::Committed { .. } => "Committed",
        Msg::CommitFailed { .. } => "CommitFailed",
        Msg::Finished { .. } => "Finished",
        Msg::PrefillFailed { .. } => "PrefillFailed",
        Msg::Abort { .. } => "Abort",
        Msg::AbortAck { .. } => "AbortAck",
        Msg::Poll { .. } => "Poll",
        Msg::LeaseExpired { .. } => "LeaseExpired",
        Msg::Renew { .. } => "Renew",
        Msg::WriterQuiet { .. } => "WriterQuiet",
        Msg::QuietQuery { .. } => "QuietQuery",
    }
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

/// Most decode nodes a prefill node keeps a place for (its file's, and those
/// gateways named since).
const MAX_DECODE_PEERS: usize = 4096;

/// One decode node a prefill node writes to, with its own lock: connecting to one
/// node never waits on another.
struct PeerSlot {
    addr: String,
    conn: Mutex<Option<Arc<Peer>>>,
}

impl PeerSlot {
    fn new(addr: &str) -> Self {
        Self {
            addr: addr.to_string(),
            conn: Mutex::new(None),
        }
    }
}

/// How a prefill node process reaches the decode nodes of its deployment.
struct PeerLinks {
    /// This prefill node's name (its listen address).
    name: String,
    /// Decode nodes by this node's index: its deployment file's, in file order,
    /// then any a gateway named by address since (a node added by a reload of the
    /// gateways). Only grows, so an index always names the same node.
    peers: RwLock<Vec<Arc<PeerSlot>>>,
    /// This node's UCX context (`--transport ucx`).
    ucx: Option<UcxContext>,
    links: NodeLinks,
    carried: Arc<Carried>,
    registry: Arc<Registry>,
    counters: Arc<PdCounters>,
    /// This node's engine thread (a decode node's `QuietQuery` goes there).
    cmds: mpsc::Sender<PrefillCmd>,
}

impl PeerLinks {
    /// This node's index of the decode node at `addr`, which a gateway named: a node
    /// of its file, or one a reload of the gateways added (then kept from now on).
    /// The link to it is still authenticated as to any decode node: its certificate
    /// must name `decode` at `addr` under the cluster CA (and, on plain links, which
    /// only loopback deployments may use, the address must be on loopback).
    ///
    /// Errors: the address is no node address, not on loopback on plain links, or
    /// too many decode nodes were named.
    fn index_of(&self, addr: &str) -> Result<usize, String> {
        if let Some(i) = self
            .peers
            .read()
            .unwrap()
            .iter()
            .position(|p| p.addr == addr)
        {
            return Ok(i);
        }
        node_name(Role::Decode, addr)
            .map_err(|e| format!("a Prefill for decode node {addr:?}: {e}"))?;
        if !self.links.is_tls() && !tessera_config::is_loopback_address(addr) {
            return Err(format!(
                "a Prefill for decode node {addr}, not on loopback, over plain node links"
            ));
        }
        let mut peers = self.peers.write().unwrap();
        if let Some(i) = peers.iter().position(|p| p.addr == addr) {
            return Ok(i);
        }
        if peers.len() >= MAX_DECODE_PEERS {
            return Err(format!(
                "a Prefill for decode node {addr}: this node already knows {MAX_DECODE_PEERS} decode nodes"
            ));
        }
        tracing::warn!(
            addr,
            "a gateway named a decode node this node's file does not list; writing to it"
        );
        peers.push(Arc::new(PeerSlot::new(addr)));
        Ok(peers.len() - 1)
    }

    /// The connection to decode node `index`, opened (again) if needed: TLS to that
    /// node's identity, `Hello { from: Prefill }`, its welcome (and UCX region).
    fn peer(&self, index: usize) -> Result<Arc<Peer>, TransportError> {
        let gone = |m: String| TransportError::PeerGone(m);
        let Some(slot) = self.peers.read().unwrap().get(index).cloned() else {
            return Err(gone(format!("no decode node {index} in the deployment")));
        };
        let addr = &slot.addr;
        let mut slot = slot.conn.lock().unwrap();
        if let Some(p) = slot.as_ref() {
            if p.conn.is_alive() {
                return Ok(p.clone());
            }
        }
        let name = node_name(Role::Decode, addr).map_err(|e| gone(e.to_string()))?;
        let (conn, welcome, mut reader) = block_on(open_link(
            self.links.clone(),
            addr.clone(),
            name,
            Role::Prefill,
            Some(self.name.clone()),
            None,
        ))
        .map_err(|e| gone(format!("cannot reach decode node {addr}: {e}")))?;
        let ucx = match (&self.ucx, welcome.ucx) {
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
        self.registry.add(&conn);
        let peer = Arc::new(Peer {
            conn,
            acks: Mutex::new(HashMap::new()),
            next_flush: AtomicU64::new(1),
            ucx,
        });
        let (p, counters, cmds) = (peer.clone(), self.counters.clone(), self.cmds.clone());
        net::spawn(async move {
            // Queries beyond this budget are dropped (the decode node asks again).
            let mut queries = Budget::new();
            let end = loop {
                match reader.next_on(&p.conn).await {
                    Ok((Frame::FlushAck { id }, _)) => {
                        if let Some(tx) = p.acks.lock().unwrap().remove(&id) {
                            let _ = tx.send(());
                        }
                    }
                    Ok((Frame::Control(c), _)) if matches!(c.msg, Msg::QuietQuery { .. }) => {
                        let req = c.msg.req();
                        if !queries.spend() {
                            tracing::debug!(?req, "dropped a quiet query over the budget");
                        } else if cmds
                            .send(PrefillCmd::QuietQuery { req, decode: index })
                            .is_err()
                        {
                            break LinkEnd::Closed("the engine thread is gone".into());
                        }
                    }
                    Ok((f, _)) => {
                        break LinkEnd::Violation(format!(
                            "a {} frame from a decode node",
                            f.kind()
                        ))
                    }
                    Err(end) => break end,
                }
            };
            end.note(p.conn.peer(), &counters);
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
        let req = msg.req();
        let commit = matches!(msg, Msg::Commit { .. });
        let sent = self.peer(decode).is_ok_and(|p| {
            p.conn.send(
                &Frame::Control(Control {
                    rng_pos: Some(extra.rng_pos),
                    cached_tokens: Some(extra.cached_tokens),
                    model: extra.model.map(|m| fingerprint_hex(&m)),
                    logprobs: extra.logprobs,
                    ..Control::new(msg)
                }),
                &[],
            )
        });
        if commit {
            // The prefill side's last message for the request.
            self.carried.done(req);
        }
        sent
    }
}

/// [`KvTransport`] from a prefill node into one decode node: UCX one-sided puts
/// and a UCX flush (remote completion) when both nodes run `--transport ucx`;
/// otherwise each put is a `Land` frame on the link and `flush` waits for the decode
/// node's `FlushAck`, which it sends after applying every earlier frame (so the
/// writes have landed). Runs on a transfer worker: it may block.
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

    #[test]
    fn carried_requests_belong_to_one_link_until_their_last_message() {
        let c = Carried::default();
        assert!(c.claim(ReqId(1), 7));
        assert!(c.claim(ReqId(1), 7), "a re-sent Prealloc on the same link");
        assert!(!c.claim(ReqId(1), 8), "another link may not take it over");
        assert!(c.claim(ReqId(2), 8));
        assert_eq!(c.carrier(ReqId(1)), Some(7));
        c.done(ReqId(1));
        assert_eq!(c.carrier(ReqId(1)), None);
        assert_eq!(c.take(8), vec![ReqId(2)]);
        assert!(c.is_empty());
        assert!(is_last(&Msg::AbortAck {
            req: ReqId(1),
            from: Role::Decode
        }));
        assert!(!is_last(&Msg::Committed { req: ReqId(1) }));
    }

    #[test]
    fn the_unknown_request_budget_is_a_burst_then_a_rate() {
        let mut b = Budget::new();
        let t0 = b.at;
        let spent = (0..5000).take_while(|_| b.spend_at(t0)).count();
        assert_eq!(spent, UNKNOWN_BURST as usize);
        // A second later, one second's worth more, and no more.
        let t1 = t0 + Duration::from_secs(1);
        let spent = (0..5000).take_while(|_| b.spend_at(t1)).count();
        assert_eq!(spent, UNKNOWN_PER_SEC as usize);
        // Idle for long, the budget refills to the burst only.
        let t2 = t1 + Duration::from_secs(3600);
        let spent = (0..5000).take_while(|_| b.spend_at(t2)).count();
        assert_eq!(spent, UNKNOWN_BURST as usize);
    }
}
