//! The gateway's side of `tessera node` processes: the same coordinator as in one
//! process, with protocol messages and event streams over TCP. A closed connection
//! is how a dead node is detected; the gateway reconnects in the background, so a
//! restarted node serves new requests.

use crate::coordinator::{coordinate, CoordCmd, CoordLinks, Extra, Submitter};
use crate::error::ServeError;
use crate::net::{connect, read_frame, Conn, Control, Frame};
use crate::node_loop::EngineStats;
use crate::routing::Router;
use crate::stream::{ClientSink, RequestStream};
use std::collections::HashMap;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use tessera_engine::{AdmissionLimits, GenerateRequest, PdAdmission};
use tessera_model::LoadedModel;
use tessera_transfer::protocol::{Msg, ReqId, Role};

pub use crate::node_process::{pool_engine_config, run_node_process, NodeOptions, TransportKind};
/// A node's role in the transfer protocol.
pub use tessera_transfer::protocol::Role as ProtocolRole;

/// How often the gateway retries nodes it lost.
const RECONNECT_INTERVAL: Duration = Duration::from_secs(1);

/// One remote node as the gateway sees it.
struct NodeLink {
    addr: String,
    conn: Mutex<Option<Arc<Conn>>>,
    down: AtomicBool,
}

struct RemoteCoordLinks {
    prefill: Vec<NodeLink>,
    decode: Vec<NodeLink>,
    /// Where each request's events from its decode node go.
    streams: Mutex<HashMap<ReqId, ClientSink>>,
    router: Router,
    coord: mpsc::Sender<CoordCmd>,
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
        let conn = self.node(role, index).conn.lock().unwrap().clone();
        conn.is_some_and(|c| c.try_send(f, &[]))
    }

    /// Connects to a node and starts its reader; marks it up.
    fn open(self: &Arc<Self>, role: Role, index: usize) -> io::Result<()> {
        let node = self.node(role, index);
        let (conn, mut r) = connect(&node.addr)?;
        if !conn.try_send(
            &Frame::Hello {
                from: Role::Coordinator,
                name: None,
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
                    Ok((Frame::Control(Control { msg, .. }), _)) => {
                        let _ = links.coord.send(CoordCmd::FromNode(msg));
                    }
                    Ok((Frame::Event { req, event }, _)) => {
                        let last = event.is_final();
                        let mut streams = links.streams.lock().unwrap();
                        if let Some(s) = streams.get(&req) {
                            s.send_event(event.into_stream_event());
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
        self.node(role, index).down.load(Ordering::Acquire)
    }

    fn router(&self) -> &Router {
        &self.router
    }

    fn released(&self, req: ReqId) {
        self.streams.lock().unwrap().remove(&req);
    }
}

/// The gateway's view of remote prefill and decode nodes: admission against the
/// deployment's pools, pair choice by load, and the coordinator.
pub struct RemoteCluster {
    links: Arc<RemoteCoordLinks>,
    submitter: Submitter,
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
        let submitter_tx = tx.clone();
        let link = |addr: &String| NodeLink {
            addr: addr.clone(),
            conn: Mutex::new(None),
            down: AtomicBool::new(true),
        };
        let links = Arc::new(RemoteCoordLinks {
            prefill: nodes.prefill.iter().map(link).collect(),
            decode: nodes.decode.iter().map(link).collect(),
            streams: Mutex::new(HashMap::new()),
            router: Router::new(nodes.prefill.len(), nodes.decode.len()),
            coord: tx,
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
    /// (retryable, 503) when no node of a role is reachable.
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

    /// Whether at least one prefill and one decode node are connected.
    pub fn ready(&self) -> bool {
        let up = |nodes: &[NodeLink]| nodes.iter().any(|n| !n.down.load(Ordering::Acquire));
        up(&self.links.prefill) && up(&self.links.decode)
    }

    /// Whether the node at `index` of `role` is connected.
    pub fn node_up(&self, role: Role, index: usize) -> bool {
        !self.links.is_down(role, index)
    }
}

impl Drop for RemoteCluster {
    fn drop(&mut self) {
        self.submitter.stop();
        for n in self.links.prefill.iter().chain(&self.links.decode) {
            if let Some(c) = n.conn.lock().unwrap().take() {
                c.close();
            }
        }
    }
}
