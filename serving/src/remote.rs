//! The gateway's side of `tessera node` processes: the same coordinator as in one
//! process, with protocol messages and event streams over node links (mutual TLS,
//! heartbeats: [`NodeLinks`]). A closed or silent link is how a dead or stalled node
//! is detected; every (re)connection is a new link epoch, so requests of an earlier
//! link (or of a node's earlier incarnation) fail at once instead of waiting on a
//! node that no longer knows them. The gateway reconnects in the background, so a
//! restarted node serves new requests; a draining node gets none.

use crate::coordinator::{coordinate, CoordCmd, CoordLinks, Extra, Submitter};
use crate::error::ServeError;
use crate::link_security::node_name;
use crate::links::PdCounters;
use crate::net::{self, block_on, open_link, Conn, Control, Frame, LinkEnd};
use crate::node_loop::EngineStats;
use crate::routing::Router;
use crate::stream::{ClientSink, RequestStream};
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use tessera_engine::{AdmissionLimits, GenerateRequest, PdAdmission};
use tessera_model::LoadedModel;
use tessera_transfer::protocol::{Msg, ReqId, Role};

pub use crate::link_security::{LinkSettings, LinkSetupError, NodeLinks, DEFAULT_MAX_HEADER};
pub use crate::node_process::{
    drain_node, pool_engine_config, run_node_process, NodeOptions, TestPanic, TransportKind,
};
/// A node's role in the transfer protocol.
pub use tessera_transfer::protocol::Role as ProtocolRole;

/// How often the gateway retries nodes it lost.
const RECONNECT_INTERVAL: Duration = Duration::from_secs(1);

/// A node's current link.
struct Live {
    conn: Arc<Conn>,
    epoch: u64,
}

/// One remote node as the gateway sees it.
struct NodeLink {
    addr: String,
    live: Mutex<Option<Live>>,
    /// The incarnation of the last link (to log restarts).
    last_incarnation: Mutex<Option<u64>>,
    epochs: AtomicU64,
    /// The node said it is draining (on its current link).
    draining: AtomicBool,
}

impl NodeLink {
    /// The current link and its epoch, while it is open.
    fn current(&self) -> Option<(Arc<Conn>, u64)> {
        let live = self.live.lock().unwrap();
        live.as_ref()
            .filter(|l| l.conn.is_alive())
            .map(|l| (l.conn.clone(), l.epoch))
    }
}

struct RemoteCoordLinks {
    prefill: Vec<NodeLink>,
    decode: Vec<NodeLink>,
    /// Where each request's events from its decode node go.
    streams: Mutex<HashMap<ReqId, ClientSink>>,
    router: Router,
    coord: mpsc::Sender<CoordCmd>,
    links: NodeLinks,
    counters: Arc<PdCounters>,
}

impl RemoteCoordLinks {
    fn node(&self, role: Role, index: usize) -> &NodeLink {
        match role {
            Role::Prefill => &self.prefill[index],
            _ => &self.decode[index],
        }
    }

    /// Queues a frame for a node without blocking.
    fn send(&self, role: Role, index: usize, f: &Frame) -> bool {
        self.node(role, index)
            .current()
            .is_some_and(|(c, _)| c.try_send(f, &[]))
    }

    /// Connects to a node (TLS to its identity, hello, welcome) and starts its
    /// reader; the node is up on a new link epoch.
    fn open(self: &Arc<Self>, role: Role, index: usize) -> io::Result<()> {
        let node = self.node(role, index);
        let name = node_name(role, &node.addr)?;
        let (conn, welcome, mut reader) = block_on(open_link(
            self.links.clone(),
            node.addr.clone(),
            name,
            Role::Coordinator,
            None,
            None,
        ))?;
        let epoch = node.epochs.fetch_add(1, Ordering::AcqRel) + 1;
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
        net::spawn(async move {
            let end = loop {
                match reader.next_on(&conn).await {
                    Ok((Frame::Control(Control { msg, .. }), _)) => {
                        let _ = links.coord.send(CoordCmd::FromNode(msg));
                    }
                    Ok((Frame::Event { req, event }, _)) if role == Role::Decode => {
                        let last = event.is_final();
                        let mut streams = links.streams.lock().unwrap();
                        if let Some(s) = streams.get(&req) {
                            s.send_event(event.into_stream_event());
                        }
                        if last {
                            streams.remove(&req);
                        }
                    }
                    Ok((Frame::Status { draining }, _)) => {
                        let node = links.node(role, index);
                        if draining {
                            tracing::warn!(addr = %node.addr, ?role, "the node is draining; routing no new requests to it");
                        }
                        node.draining.store(draining, Ordering::Release);
                    }
                    Ok((f, _)) => {
                        break LinkEnd::Violation(format!(
                            "a {} frame from a {role:?} node",
                            f.kind()
                        ))
                    }
                    Err(end) => break end,
                }
            };
            end.note(conn.peer(), &links.counters);
            conn.close();
            let node = links.node(role, index);
            tracing::warn!(addr = %node.addr, ?role, "lost the node ({end}); retrying in the background");
        });
        Ok(())
    }

    fn is_up(&self, role: Role, index: usize) -> bool {
        self.node(role, index).current().is_some()
    }
}

impl CoordLinks for RemoteCoordLinks {
    fn to_decode(&self, index: usize, msg: Msg, extra: Extra) -> bool {
        let (body, prefill, trace) = match extra {
            Extra::Decode {
                body,
                client,
                prefill,
                trace,
                ..
            } => {
                self.streams.lock().unwrap().insert(msg.req(), client);
                (
                    Some(body),
                    self.prefill.get(prefill).map(|n| n.addr.clone()),
                    trace,
                )
            }
            _ => (None, None, None),
        };
        self.send(
            Role::Decode,
            index,
            &Frame::Control(Control {
                body,
                prefill,
                trace,
                ..Control::new(msg)
            }),
        )
    }

    fn to_prefill(&self, index: usize, msg: Msg, extra: Extra) -> bool {
        let (body, decode, trace) = match extra {
            Extra::Prefill {
                body,
                decode,
                trace,
            } => (Some(body), Some(decode), trace),
            _ => (None, None, None),
        };
        self.send(
            Role::Prefill,
            index,
            &Frame::Control(Control {
                body,
                decode,
                trace,
                ..Control::new(msg)
            }),
        )
    }

    fn is_down(&self, role: Role, index: usize) -> bool {
        !self.is_up(role, index)
    }

    fn epoch(&self, role: Role, index: usize) -> Option<u64> {
        self.node(role, index).current().map(|(_, e)| e)
    }

    fn accepts_new(&self, role: Role, index: usize) -> bool {
        self.is_up(role, index) && !self.node(role, index).draining.load(Ordering::Acquire)
    }

    fn router(&self) -> &Router {
        &self.router
    }

    fn released(&self, req: ReqId) {
        self.streams.lock().unwrap().remove(&req);
        self.counters.released.fetch_add(1, Ordering::Relaxed);
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
    /// The gateway's node links (its identity, the CA, timings).
    pub links: NodeLinks,
}

impl RemoteCluster {
    /// Starts the coordinator and connects to every node (nodes that are not up
    /// yet are retried in the background). Every node must serve `model`: links
    /// carry its fingerprint, and a node of another model is never connected.
    pub fn connect(model: &LoadedModel, nodes: RemoteNodes) -> Self {
        let cfg = model.llama.config();
        let (tx, rx) = mpsc::channel();
        let submitter_tx = tx.clone();
        let link = |addr: &String| NodeLink {
            addr: addr.clone(),
            live: Mutex::new(None),
            last_incarnation: Mutex::new(None),
            epochs: AtomicU64::new(0),
            draining: AtomicBool::new(false),
        };
        let links = Arc::new(RemoteCoordLinks {
            prefill: nodes.prefill.iter().map(link).collect(),
            decode: nodes.decode.iter().map(link).collect(),
            streams: Mutex::new(HashMap::new()),
            router: Router::new(nodes.prefill.len(), nodes.decode.len()),
            coord: tx,
            // Links that name this model: a node serving another one refuses them
            // (and the gateway drops a node that welcomes it as another model).
            links: nodes
                .links
                .clone()
                .with_context(cfg.context)
                .for_model(model.llama.fingerprint()),
            counters: Arc::new(PdCounters::default()),
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
                    if !l.is_up(role, i) && l.open(role, i).is_ok() {
                        tracing::warn!(addr = %l.node(role, i).addr, ?role, "node reachable");
                    }
                }
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
                },
                prefill_pool_tokens: nodes.prefill_pool_tokens,
            },
        );
        Self { links, submitter }
    }

    /// Like [`crate::cluster::PdCluster::submit`], over the network.
    ///
    /// Errors: the admission rejection; [`ServeErrorKind::NodeDown`](crate::ServeErrorKind)
    /// (retryable, 503) when no node of a role is reachable and not draining.
    pub fn submit(
        &self,
        req: GenerateRequest,
        affinity: Option<u64>,
    ) -> Result<RequestStream, ServeError> {
        self.submitter.submit(&*self.links, req, affinity)
    }

    /// What [`Self::submit`] admits against (from the deployment file's pools).
    pub fn admission(&self) -> PdAdmission {
        self.submitter.admission()
    }

    /// Requests in flight across the nodes (pool counters live on the nodes).
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            running: (0..self.links.decode.len())
                .map(|i| self.links.router.outstanding(Role::Decode, i))
                .sum(),
            ..EngineStats::default()
        }
    }

    /// Whether at least one prefill and one decode node are connected and not
    /// draining.
    pub fn ready(&self) -> bool {
        let up = |role: Role, n: usize| (0..n).any(|i| self.links.accepts_new(role, i));
        up(Role::Prefill, self.links.prefill.len()) && up(Role::Decode, self.links.decode.len())
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
}

impl Drop for RemoteCluster {
    fn drop(&mut self) {
        self.submitter.stop();
        for n in self.links.prefill.iter().chain(&self.links.decode) {
            if let Some(l) = n.live.lock().unwrap().take() {
                l.conn.close();
            }
        }
    }
}
