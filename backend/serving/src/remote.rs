//! The gateway's side of `tessera node` processes: the same coordinator as in one
//! process, with protocol messages and event streams over node links (mutual TLS,
//! heartbeats: [`NodeLinks`]). A closed or silent link is how a dead or stalled node
//! is detected; every (re)connection is a new link epoch, so requests of an earlier
//! link (or of a node's earlier incarnation) fail at once instead of waiting on a
//! node that no longer knows them. The gateway reconnects in the background, so a
//! restarted node serves new requests; a draining node gets none.
//!
//! A node link is believed only about the requests routed to it ([`RouteBook`]):
//! link epochs are unique across every node of the cluster, so the epoch names the
//! node and its link incarnation, and a message or stream event from a link about
//! any other request (another node's, or one never routed) is a violation that is
//! counted (`tessera_node_link_violations_total{reason}`) and cuts that link.

use crate::adapters::LinkAdapters;
use crate::cache_query::{CacheAnswer, CacheQuery};
use crate::coordinator::{coordinate, Attachment, CoordCmd, CoordLinks, Submitter};
use crate::error::ServeError;
use crate::link_security::node_name;
use crate::links::{PdCounters, TOMBSTONE_TTL_MS};
use crate::metrics::{NodeMetrics, GATEWAY_VIOLATIONS};
use crate::net::{self, block_on, open_link, Conn, Control, Frame, LinkEnd};
use crate::node_loop::EngineStats;
use crate::routing::{Reach, Router};
use crate::stream::{ClientSink, RequestStream};
use prometheus_client::metrics::counter::Counter;
use std::collections::{HashMap, HashSet};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::{Duration, Instant};
use tessera_engine::{AdmissionLimits, Admitted, PdAdmission};
use tessera_model::LoadedModel;
use tessera_transfer::protocol::{LinkViolation, Msg, ReqId, Role, RouteBook, Routed, Writer};

pub use crate::link_security::{LinkSettings, LinkSetupError, NodeLinks, DEFAULT_MAX_HEADER};
pub use crate::node_process::{
    drain_node, pool_engine_config, run_node_process, NodeOptions, TestPanic, TransportKind,
};

/// How often the gateway retries nodes it lost.
const RECONNECT_INTERVAL: Duration = Duration::from_secs(1);

/// A node's current link.
struct Live {
    conn: Arc<Conn>,
    /// Unique across every node of the cluster: names the node and the link.
    epoch: u64,
}

/// One remote node as the gateway sees it.
struct NodeLink {
    addr: String,
    live: Mutex<Option<Live>>,
    /// The incarnation of the last link (to log restarts).
    last_incarnation: Mutex<Option<u64>>,
    /// The node said it is draining (on its current link).
    draining: AtomicBool,
    /// A reload removed the node from the deployment: it gets no new requests, and
    /// once nothing assigned to it is outstanding its link is closed for good.
    removed: AtomicBool,
    /// Sweeps in a row that found the removed node with nothing outstanding.
    idle_sweeps: AtomicUsize,
    /// The removed node's link was closed: it is gone from this gateway.
    dropped: AtomicBool,
}

impl NodeLink {
    fn new(addr: &str) -> Self {
        Self {
            addr: addr.to_string(),
            live: Mutex::new(None),
            last_incarnation: Mutex::new(None),
            draining: AtomicBool::new(false),
            removed: AtomicBool::new(false),
            idle_sweeps: AtomicUsize::new(0),
            dropped: AtomicBool::new(false),
        }
    }

    /// Closes the current link, if any.
    fn close(&self) {
        if let Some(l) = self.live.lock().unwrap().take() {
            l.conn.close();
        }
    }

    /// The current link and its epoch, while it is open.
    fn current(&self) -> Option<(Arc<Conn>, u64)> {
        let live = self.live.lock().unwrap();
        live.as_ref()
            .filter(|l| l.conn.is_alive())
            .map(|l| (l.conn.clone(), l.epoch))
    }
}

struct RemoteCoordLinks {
    /// Nodes by index (the index requests and the router use). A reload appends
    /// added nodes and marks removed ones; an index never changes its node.
    prefill: RwLock<Vec<Arc<NodeLink>>>,
    decode: RwLock<Vec<Arc<NodeLink>>>,
    /// Where each request's events from its decode node go.
    streams: Mutex<HashMap<ReqId, ClientSink>>,
    /// Which link (epoch) carries each request, per role: what a node link may
    /// speak about.
    routes: Mutex<RouteBook<u64>>,
    /// Link epochs, across every node (so an epoch names one link of one node).
    next_epoch: AtomicU64,
    /// The clock of `routes`' expiry.
    started: Instant,
    router: Router,
    coord: mpsc::Sender<CoordCmd>,
    links: NodeLinks,
    counters: Arc<PdCounters>,
    /// `tessera_node_link_violations_total{reason}` by [`GATEWAY_VIOLATIONS`] index.
    violations: Vec<Counter>,
    metrics: Arc<NodeMetrics>,
    /// Cache questions awaiting a node's answer: by question id, the link epoch
    /// it was sent on (only that link may answer) and where the answer goes.
    cache_asks: Mutex<HashMap<u64, (u64, mpsc::Sender<CacheAnswer>)>>,
    next_cache_ask: AtomicU64,
    /// The LoRA adapters (fine-tune id, file SHA-256) each link epoch's node holds,
    /// as the node keeps them ([`LinkAdapters`]: sends and requests in link order).
    adapters_sent: Mutex<HashMap<u64, LinkAdapters<()>>>,
}

/// The `reason` label (one of [`GATEWAY_VIOLATIONS`]) of a frame a node may not
/// send at all.
const FRAME_KIND: &str = "frame_kind";

impl RemoteCoordLinks {
    fn list(&self, role: Role) -> &RwLock<Vec<Arc<NodeLink>>> {
        match role {
            Role::Prefill => &self.prefill,
            _ => &self.decode,
        }
    }

    fn node(&self, role: Role, index: usize) -> Option<Arc<NodeLink>> {
        self.list(role).read().unwrap().get(index).cloned()
    }

    /// Every node of `role` this gateway knows, removed ones included.
    fn nodes(&self, role: Role) -> Vec<Arc<NodeLink>> {
        self.list(role).read().unwrap().clone()
    }

    /// Queues a frame about `req` for a node without blocking; the link it goes on
    /// is recorded as the request's (for `role`) first, so the node's answers are
    /// believed.
    fn send(&self, role: Role, index: usize, req: ReqId, f: &Frame) -> bool {
        self.send_routed(role, index, role, req, f)
    }

    /// [`Self::send`] to node `index` of `role`, routing the link as the request's
    /// `as_role` side.
    fn send_routed(&self, role: Role, index: usize, as_role: Role, req: ReqId, f: &Frame) -> bool {
        let Some((c, epoch)) = self.node(role, index).and_then(|n| n.current()) else {
            return false;
        };
        self.routes.lock().unwrap().route(req, as_role, epoch);
        if let Frame::Control(Control {
            body: Some(body), ..
        }) = f
        {
            if let Some(l) = &body.lora {
                if !self.adapter_on(&c, epoch, l) {
                    return false;
                }
            }
        }
        c.try_send(f, &[])
    }

    /// Sends fine-tune `l`'s adapter file on link `epoch` (`c`), in order, unless
    /// the node still holds it from an earlier send on this link (it keeps the
    /// [`MAX_ADAPTERS_PER_LINK`](crate::adapters::MAX_ADAPTERS_PER_LINK) most
    /// recently used; so does this list); the request's frame follows on the same
    /// link, so the node has the adapter when the request arrives. Returns whether
    /// the link took every chunk (a request without the file is left to the node,
    /// which refuses it).
    fn adapter_on(&self, c: &Conn, epoch: u64, l: &tessera_engine::LoraRef) -> bool {
        let Some(file) = &l.file else {
            return true;
        };
        let key = (l.id.clone(), file.sha256.clone());
        let mut sent = self.adapters_sent.lock().unwrap();
        if sent
            .get_mut(&epoch)
            .is_some_and(|s| s.touch(&key).is_some())
        {
            return true;
        }
        let total = file.bytes.len() as u64;
        for (i, chunk) in file.bytes.chunks(net::ADAPTER_CHUNK).enumerate() {
            let frame = Frame::Adapter {
                id: l.id.clone(),
                sha256: file.sha256.clone(),
                offset: (i * net::ADAPTER_CHUNK) as u64,
                total,
            };
            if !c.try_send(&frame, chunk) {
                return false;
            }
        }
        // Links that closed forget what they were sent.
        let live: HashSet<u64> = [Role::Prefill, Role::Decode]
            .into_iter()
            .flat_map(|r| self.nodes(r))
            .filter_map(|n| n.current().map(|(_, e)| e))
            .collect();
        sent.retain(|e, _| live.contains(e));
        sent.entry(epoch).or_default().insert(key, ());
        true
    }

    /// Counts a node link's violation (`reason`: one of [`GATEWAY_VIOLATIONS`]).
    fn violation(&self, reason: &str) {
        self.counters
            .link_violations
            .fetch_add(1, Ordering::Relaxed);
        if let Some(i) = GATEWAY_VIOLATIONS.iter().position(|r| *r == reason) {
            self.violations[i].inc();
        }
    }

    /// Connects to a node (TLS to its identity, hello, welcome: a node serving
    /// another model is refused here) and starts its reader; the node is up on a new
    /// link epoch.
    fn open(self: &Arc<Self>, role: Role, node: &Arc<NodeLink>) -> io::Result<()> {
        let name = node_name(role, &node.addr)?;
        let opened = block_on(open_link(
            self.links.clone(),
            node.addr.clone(),
            name,
            Role::Coordinator,
            None,
            None,
        ));
        let (conn, welcome, mut reader) = match opened {
            Ok(o) => o,
            Err(e) => {
                // It answered and was refused (its identity, its model, its TLS), as
                // opposed to not being reachable.
                if matches!(
                    e.kind(),
                    io::ErrorKind::PermissionDenied | io::ErrorKind::InvalidData
                ) {
                    self.counters.peers_refused.fetch_add(1, Ordering::Relaxed);
                }
                return Err(e);
            }
        };
        let epoch = self.next_epoch.fetch_add(1, Ordering::AcqRel) + 1;
        let last = node
            .last_incarnation
            .lock()
            .unwrap()
            .replace(welcome.incarnation);
        if last.is_some_and(|i| i != welcome.incarnation) {
            tracing::warn!(addr = %node.addr, ?role, "the node restarted (a new incarnation)");
        }
        node.draining.store(welcome.draining, Ordering::Release);
        *node.live.lock().unwrap() = Some(Live {
            conn: conn.clone(),
            epoch,
        });
        let links = self.clone();
        let node = node.clone();
        net::spawn(async move {
            // A message or event about a request this link does not carry.
            let refuse = |v: LinkViolation, what: String| {
                links.violation(v.label());
                LinkEnd::Violation(format!("{what} ({})", v.label()))
            };
            let end = loop {
                match reader.next_on(&conn).await {
                    Ok((Frame::Control(Control { msg, .. }), _)) => {
                        // A decode node also speaks as a writer (moving a drained
                        // request's KV): believed only about requests whose writer
                        // side was routed to this very link.
                        let from = match (role, msg.sender()) {
                            (Role::Decode, Role::Prefill) => Role::Prefill,
                            _ => role,
                        };
                        let verdict = links.routes.lock().unwrap().check(epoch, from, &msg);
                        match verdict {
                            Ok(Routed::Live) => {
                                let _ = links.coord.send(CoordCmd::FromNode(msg));
                            }
                            Ok(Routed::Ended) => {} // a late duplicate
                            Err(v) => {
                                let what = format!("a {role:?} node sent {msg:?}");
                                break refuse(v, what);
                            }
                        }
                    }
                    Ok((Frame::Event { req, event }, _)) if role == Role::Decode => {
                        let verdict = links.routes.lock().unwrap().check_event(epoch, req);
                        match verdict {
                            Ok(Routed::Live) => {}
                            Ok(Routed::Ended) => continue,
                            Err(v) => {
                                let what = format!("a stream event for {req:?}");
                                break refuse(v, what);
                            }
                        }
                        let last = event.is_final();
                        let mut streams = links.streams.lock().unwrap();
                        if let Some(s) = streams.get(&req) {
                            s.send_event(event.into_stream_event());
                        }
                        if last {
                            streams.remove(&req);
                        }
                    }
                    Ok((Frame::CacheAnswer { id, answer }, _)) => {
                        let mut asks = links.cache_asks.lock().unwrap();
                        let forged = match asks.get(&id) {
                            Some((asked_on, _)) if *asked_on == epoch => {
                                let (_, tx) = asks.remove(&id).expect("just found");
                                let _ = tx.send(answer);
                                false
                            }
                            // Another node's question: a node confirming for another.
                            Some(_) => true,
                            // Never asked of anyone.
                            None => id >= links.next_cache_ask.load(Ordering::Relaxed),
                            // (Otherwise an answer that came after its ask gave up.)
                        };
                        drop(asks);
                        if forged {
                            links.violation("not_routed");
                            break LinkEnd::Violation(format!(
                                "a {role:?} node answered cache question {id}, not asked of it"
                            ));
                        }
                    }
                    Ok((Frame::Status { draining }, _)) => {
                        if draining {
                            tracing::warn!(addr = %node.addr, ?role, "the node is draining; routing no new requests to it");
                        }
                        node.draining.store(draining, Ordering::Release);
                    }
                    Ok((f, _)) => {
                        links.violation(FRAME_KIND);
                        break LinkEnd::Violation(format!(
                            "a {} frame from a {role:?} node",
                            f.kind()
                        ));
                    }
                    Err(end) => break end,
                }
            };
            end.note(conn.peer(), &links.counters);
            conn.close();
            if node.dropped.load(Ordering::Acquire) {
                tracing::info!(addr = %node.addr, ?role, "closed the link of a node removed from the deployment");
            } else {
                tracing::warn!(addr = %node.addr, ?role, "lost the node ({end}); retrying in the background");
            }
        });
        Ok(())
    }

    fn is_up(&self, role: Role, index: usize) -> bool {
        self.node(role, index)
            .is_some_and(|n| !n.dropped.load(Ordering::Acquire) && n.current().is_some())
    }

    /// One pass of the background thread: reconnects lost nodes of the deployment,
    /// and drops removed nodes whose requests all ended. A removed node is dropped
    /// on the second pass in a row that finds nothing outstanding on it (a request
    /// routed in the instant before the removal was seen has been counted by then).
    fn sweep(self: &Arc<Self>) {
        let now = self.started.elapsed().as_millis() as u64;
        self.routes.lock().unwrap().expire(now, TOMBSTONE_TTL_MS);
        for role in [Role::Prefill, Role::Decode] {
            for (i, node) in self.nodes(role).iter().enumerate() {
                if node.dropped.load(Ordering::Acquire) {
                    continue;
                }
                if node.removed.load(Ordering::Acquire) {
                    if self.router.outstanding(role, i) > 0 {
                        node.idle_sweeps.store(0, Ordering::Relaxed);
                    } else if node.idle_sweeps.fetch_add(1, Ordering::Relaxed) >= 1 {
                        node.dropped.store(true, Ordering::Release);
                        node.close();
                        tracing::warn!(addr = %node.addr, ?role, "dropped a node removed from the deployment (its requests ended)");
                    }
                    continue;
                }
                if !self.is_up(role, i) && self.open(role, node).is_ok() {
                    tracing::warn!(addr = %node.addr, ?role, "node reachable");
                }
            }
        }
    }
}

impl CoordLinks for RemoteCoordLinks {
    fn to_decode(&self, index: usize, msg: Msg, extra: Attachment) -> bool {
        let (body, prefill, trace) = match extra {
            Attachment::Decode {
                body,
                client,
                writer,
                trace,
                ..
            } => {
                self.streams.lock().unwrap().insert(msg.req(), client);
                (
                    Some(body),
                    self.node(writer.role, writer.index).map(|n| n.addr.clone()),
                    trace,
                )
            }
            _ => (None, None, None),
        };
        self.send(
            Role::Decode,
            index,
            msg.req(),
            &Frame::Control(Control {
                body,
                prefill,
                trace,
                ..Control::new(msg)
            }),
        )
    }

    fn to_writer(&self, writer: Writer, msg: Msg, extra: Attachment) -> bool {
        let (body, decode, decode_node, trace, moves) = match extra {
            Attachment::Prefill {
                body,
                decode,
                trace,
                moves,
            } => (
                Some(body),
                Some(decode),
                // By address too: the prefill node's own list of decode nodes need
                // not be in this gateway's order (or know a node a reload added).
                self.node(Role::Decode, decode).map(|n| n.addr.clone()),
                trace,
                moves,
            ),
            _ => (None, None, None, None, None),
        };
        // A decode node's writer is routed as the request's prefill side: its
        // answers are believed on that link only as the writer's.
        self.send_routed(
            writer.role,
            writer.index,
            Role::Prefill,
            msg.req(),
            &Frame::Control(Control {
                body,
                decode,
                decode_node,
                trace,
                to_writer: writer.role == Role::Decode,
                moves,
                ..Control::new(msg)
            }),
        )
    }

    fn is_down(&self, role: Role, index: usize) -> bool {
        !self.is_up(role, index)
    }

    fn epoch(&self, role: Role, index: usize) -> Option<u64> {
        self.node(role, index)
            .filter(|n| !n.dropped.load(Ordering::Acquire))
            .and_then(|n| n.current())
            .map(|(_, e)| e)
    }

    fn accepts_new(&self, role: Role, index: usize) -> bool {
        self.is_up(role, index)
            && self.node(role, index).is_some_and(|n| {
                !n.draining.load(Ordering::Acquire) && !n.removed.load(Ordering::Acquire)
            })
    }

    /// Quiet: nothing heard on the link for two heartbeats (the node pings after a
    /// heartbeat of silence, so it missed one), long before `dead_after` closes it.
    fn reach(&self, role: Role, index: usize) -> Reach {
        if !self.accepts_new(role, index) {
            return Reach::Down;
        }
        let heartbeat = self.links.settings().heartbeat;
        let quiet = self
            .node(role, index)
            .and_then(|n| n.current())
            .is_some_and(|(conn, _)| conn.silent_for() > 2 * heartbeat);
        if quiet {
            Reach::Quiet
        } else {
            Reach::Up
        }
    }

    fn router(&self) -> &Router {
        &self.router
    }

    fn unkeep(&self, index: usize, req: ReqId) {
        if let Some((c, _)) = self.node(Role::Decode, index).and_then(|n| n.current()) {
            c.try_send(&Frame::Unkeep { req }, &[]);
        }
    }

    fn released(&self, req: ReqId) {
        self.streams.lock().unwrap().remove(&req);
        self.routes.lock().unwrap().end(req);
        self.counters.released.fetch_add(1, Ordering::Relaxed);
    }

    fn counters(&self) -> &PdCounters {
        &self.counters
    }
}

/// The gateway's view of remote prefill and decode nodes: admission against the
/// deployment's pools, pair choice by load, and the coordinator.
pub struct RemoteCluster {
    links: Arc<RemoteCoordLinks>,
    submitter: Submitter,
}

/// Where the gateway finds its nodes, what their pools hold, and how it reaches them.
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
    /// Whether the decode nodes have a draft model (the model's `draft` in the
    /// deployment file): requests may then ask for draft-model speculation.
    pub draft: bool,
    /// The gateway's node links (its identity, the CA, timings).
    pub links: NodeLinks,
}

impl RemoteCluster {
    /// Starts the coordinator and connects to every node (nodes that are not up
    /// yet are retried in the background). Every node must serve `model`: links
    /// carry its fingerprint, and a node of another model is never connected.
    pub fn connect(model: &LoadedModel, nodes: RemoteNodes) -> Self {
        Self::connect_in(model, nodes, Arc::new(NodeMetrics::new()))
    }

    /// [`Self::connect`] publishing this gateway's node-link counters into `metrics`
    /// (shared by every model of a process; series `node="gateway"`,
    /// `role="coordinator"`).
    pub fn connect_in(model: &LoadedModel, nodes: RemoteNodes, metrics: Arc<NodeMetrics>) -> Self {
        let cfg = model.transformer.config();
        let (tx, rx) = mpsc::channel();
        let submitter_tx = tx.clone();
        let link = |addr: &String| Arc::new(NodeLink::new(addr));
        let counters = Arc::new(PdCounters::default());
        metrics.watch_links("gateway", "coordinator", counters.clone());
        let links = Arc::new(RemoteCoordLinks {
            prefill: RwLock::new(nodes.prefill.iter().map(link).collect()),
            decode: RwLock::new(nodes.decode.iter().map(link).collect()),
            streams: Mutex::new(HashMap::new()),
            routes: Mutex::new(RouteBook::default()),
            next_epoch: AtomicU64::new(0),
            started: Instant::now(),
            router: Router::new(nodes.prefill.len(), nodes.decode.len()),
            coord: tx,
            // Links that name this model: a node serving another one refuses them
            // (and the gateway drops a node that welcomes it as another model).
            links: nodes
                .links
                .clone()
                .with_context(cfg.context)
                .for_model(model.transformer.fingerprint()),
            counters: counters.clone(),
            violations: metrics.gateway_violations(),
            metrics,
            cache_asks: Mutex::new(HashMap::new()),
            next_cache_ask: AtomicU64::new(1),
            adapters_sent: Mutex::new(HashMap::new()),
        });
        for role in [Role::Prefill, Role::Decode] {
            for node in links.nodes(role) {
                if let Err(e) = links.open(role, &node) {
                    tracing::warn!(addr = %node.addr, error = %e, "node not reachable yet");
                }
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
                l.sweep();
            })
            .expect("spawn reconnect thread");
        let l: Arc<dyn CoordLinks> = links.clone();
        std::thread::Builder::new()
            .name("tessera-pd-coordinator".into())
            .spawn(move || coordinate(l, rx))
            .expect("spawn coordinator thread");
        let submitter = Submitter::new(
            submitter_tx,
            PdAdmission {
                limits: AdmissionLimits {
                    context: cfg.context,
                    pool_tokens: nodes.decode_pool_tokens,
                    page_size: nodes.page_size,
                    vocab: cfg.vocab,
                    draft: nodes.draft,
                },
                prefill_pool_tokens: nodes.prefill_pool_tokens,
            },
        );
        Self { links, submitter }
    }

    /// Like [`crate::cluster::PdCluster::submit`], over the network.
    ///
    /// Errors: [`ServeErrorKind::NodeDown`](crate::ServeErrorKind) (retryable, 503)
    /// when no node of a role is reachable and not draining.
    pub fn submit(
        &self,
        req: Admitted,
        affinity: Option<u64>,
    ) -> Result<RequestStream, ServeError> {
        self.submitter.submit(&*self.links, req, affinity)
    }

    /// Asks every node of the deployment (removed ones that still hold a link
    /// included) `query` on its current link and waits for all the answers (up to
    /// [`ENGINE_ANSWER_WAIT`](crate::cluster::ENGINE_ANSWER_WAIT) each).
    ///
    /// Errors: a node with no live link ([`ServeErrorKind::NodeDown`](crate::ServeErrorKind):
    /// nothing can be claimed for it), or one that did not answer in time
    /// ([`ServeErrorKind::Timeout`](crate::ServeErrorKind)).
    pub(crate) fn ask_cache(&self, query: CacheQuery) -> Result<Vec<CacheAnswer>, ServeError> {
        let (tx, rx) = mpsc::channel();
        let mut asked = Vec::new();
        let forget = |asked: &[u64]| {
            let mut asks = self.links.cache_asks.lock().unwrap();
            for id in asked {
                asks.remove(id);
            }
        };
        for role in [Role::Prefill, Role::Decode] {
            for node in self.links.nodes(role) {
                if node.dropped.load(Ordering::Acquire) {
                    continue;
                }
                let id = self.links.next_cache_ask.fetch_add(1, Ordering::Relaxed);
                let sent = node.current().is_some_and(|(conn, epoch)| {
                    self.links
                        .cache_asks
                        .lock()
                        .unwrap()
                        .insert(id, (epoch, tx.clone()));
                    conn.try_send(&Frame::Cache { id, query }, &[])
                });
                asked.push(id);
                if !sent {
                    forget(&asked);
                    return Err(ServeError::new(
                        crate::ServeErrorKind::NodeDown,
                        format!(
                            "{} node {} is not connected: nothing is claimed for it",
                            role_name(role),
                            node.addr
                        ),
                    ));
                }
            }
        }
        let answers = crate::cluster::collect_answers(&rx, asked.len());
        forget(&asked);
        answers
    }

    /// What [`Self::submit`] admits against (from the deployment file's pools).
    pub fn admission(&self) -> PdAdmission {
        self.submitter.admission()
    }

    /// Requests in flight across the nodes (pool counters live on the nodes).
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: (0..self.links.router.len(Role::Decode))
                .map(|i| self.links.router.outstanding(Role::Decode, i))
                .sum(),
            ..EngineStats::default()
        }
    }

    /// Whether at least one prefill and one decode node are connected and not
    /// draining.
    pub fn ready(&self) -> bool {
        let up = |role: Role, n: usize| (0..n).any(|i| self.links.accepts_new(role, i));
        let len = |role: Role| self.links.nodes(role).len();
        up(Role::Prefill, len(Role::Prefill)) && up(Role::Decode, len(Role::Decode))
    }

    /// Whether the node at `index` of `role` is connected.
    pub fn node_up(&self, role: Role, index: usize) -> bool {
        self.links.is_up(role, index)
    }

    /// Link-level counters of this gateway's node links (frames refused from nodes,
    /// requests released).
    pub fn counters(&self) -> &PdCounters {
        &self.links.counters
    }

    /// The metrics this cluster publishes into (the gateway's node-link counters).
    pub fn metrics(&self) -> &NodeMetrics {
        &self.links.metrics
    }
}

impl Drop for RemoteCluster {
    fn drop(&mut self) {
        self.submitter.stop();
        for role in [Role::Prefill, Role::Decode] {
            for n in self.links.nodes(role) {
                n.close();
            }
        }
    }
}

/// Where one node of a [`RemoteCluster`] stands (`GET /admin/v1/nodes`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MemberStatus {
    /// `prefill` or `decode`.
    pub role: &'static str,
    /// Its address as the deployment file lists it.
    pub addr: String,
    /// `up` (takes new requests), `draining` (the node drains itself), `removing`
    /// (a reload removed it: no new requests, its running ones finish, then it is
    /// dropped) or `unreachable` (retried every second).
    pub state: &'static str,
    /// Requests this gateway assigned to it that are not released yet.
    pub outstanding: usize,
    /// Requests this gateway ever assigned to it.
    pub assigned: u64,
}

/// A membership change of a [`RemoteCluster`], checked and ready to apply
/// ([`RemoteCluster::prepare_members`]): every added node is already connected and
/// passed the link checks (its certificate names it, it serves this cluster's model).
/// Dropping it without [`Self::apply`] closes those links and changes nothing.
pub struct MembershipChange {
    links: Arc<RemoteCoordLinks>,
    added: Vec<(Role, Arc<NodeLink>)>,
    removed: Vec<(Role, Arc<NodeLink>)>,
}

fn role_name(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        _ => "decode",
    }
}

impl MembershipChange {
    /// Whether it changes nothing.
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty()
    }

    /// `(role, address)` of the nodes it adds.
    pub fn added(&self) -> Vec<(&'static str, String)> {
        self.added
            .iter()
            .map(|(r, n)| (role_name(*r), n.addr.clone()))
            .collect()
    }

    /// `(role, address)` of the nodes it removes.
    pub fn removed(&self) -> Vec<(&'static str, String)> {
        self.removed
            .iter()
            .map(|(r, n)| (role_name(*r), n.addr.clone()))
            .collect()
    }

    /// Applies it: added nodes take new requests from now on; removed nodes take
    /// none, keep their running requests until they end, and are then dropped (their
    /// link closed, never reconnected).
    pub fn apply(mut self) {
        for (role, node) in std::mem::take(&mut self.added) {
            let mut list = self.links.list(role).write().unwrap();
            // The router first: an index the router counts but the list does not
            // have yet is simply not up.
            self.links.router.grow(role, list.len() + 1);
            tracing::warn!(addr = %node.addr, ?role, "added a node to the deployment");
            list.push(node);
        }
        for (role, node) in std::mem::take(&mut self.removed) {
            node.removed.store(true, Ordering::Release);
            tracing::warn!(addr = %node.addr, ?role, "removed a node from the deployment: routing no new requests to it; dropping it once its requests end");
        }
    }
}

impl Drop for MembershipChange {
    fn drop(&mut self) {
        for (_, n) in &self.added {
            n.dropped.store(true, Ordering::Release);
            n.close();
        }
    }
}

impl RemoteCluster {
    /// The addresses of the nodes of `role` in the deployment now (removed ones
    /// left out), in the order they were added.
    pub fn members(&self, role: Role) -> Vec<String> {
        self.links
            .nodes(role)
            .iter()
            .filter(|n| !n.removed.load(Ordering::Acquire))
            .map(|n| n.addr.clone())
            .collect()
    }

    /// Every node this gateway still holds a place for (removed nodes until they
    /// are dropped), with its state.
    pub fn member_status(&self) -> Vec<MemberStatus> {
        let mut out = Vec::new();
        for role in [Role::Prefill, Role::Decode] {
            for (i, n) in self.links.nodes(role).iter().enumerate() {
                if n.dropped.load(Ordering::Acquire) {
                    continue;
                }
                let state = if n.removed.load(Ordering::Acquire) {
                    "removing"
                } else if !self.links.is_up(role, i) {
                    "unreachable"
                } else if n.draining.load(Ordering::Acquire) {
                    "draining"
                } else {
                    "up"
                };
                out.push(MemberStatus {
                    role: role_name(role),
                    addr: n.addr.clone(),
                    state,
                    outstanding: self.links.router.outstanding(role, i),
                    assigned: self.links.router.assigned(role, i),
                });
            }
        }
        out
    }

    /// Checks a new node list (`prefill`, `decode`: every node of each role the
    /// deployment file lists now) against the current one: each added node is
    /// connected now and must pass the link checks (TLS identity, the model's
    /// fingerprint: a node of another model is refused) before the change can be
    /// applied; removed nodes are only listed. Blocks while it connects (a few
    /// seconds at most per unreachable node).
    ///
    /// Errors: every added node that failed, with why (nothing changed).
    pub fn prepare_members(
        &self,
        prefill: &[String],
        decode: &[String],
    ) -> Result<MembershipChange, Vec<String>> {
        let mut change = MembershipChange {
            links: self.links.clone(),
            added: Vec::new(),
            removed: Vec::new(),
        };
        let mut errors = Vec::new();
        for (role, wanted) in [(Role::Prefill, prefill), (Role::Decode, decode)] {
            let current = self.members(role);
            for n in self.links.nodes(role) {
                if !n.removed.load(Ordering::Acquire) && !wanted.contains(&n.addr) {
                    change.removed.push((role, n));
                }
            }
            for addr in wanted.iter().filter(|a| !current.contains(*a)) {
                let node = Arc::new(NodeLink::new(addr));
                match self.links.open(role, &node) {
                    Ok(()) => change.added.push((role, node)),
                    Err(e) => {
                        node.dropped.store(true, Ordering::Release);
                        errors.push(format!(
                            "new {} node {addr} failed its check: {e}",
                            role_name(role)
                        ));
                    }
                }
            }
        }
        if errors.is_empty() {
            Ok(change)
        } else {
            Err(errors)
        }
    }
}
