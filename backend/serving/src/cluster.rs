//! Prefill and decode engines in one process, driven by the KV transfer protocol over
//! the in-process transport: the embedded default of `tessera serve`, so every request
//! runs the same protocol as a multi-node deployment.
//!
//! Threads: one engine thread per node (it owns the node's pool and its protocol
//! machine), one transfer worker per (prefill, decode) pair that moves pages, and the
//! coordinator thread. Messages between them go over FIFO channels.

use crate::coordinator::{coordinate, Attachment, CoordCmd, CoordLinks, Submitter};
use crate::decode_node::{DecodeCmd, DecodeLoop, RequestBody};
use crate::error::{ServeError, ServeErrorKind};
use crate::links::{CommitExtra, PdCounters, Reply, ReplyTo, TransferFault, WriterLink};
use crate::metrics::{NodeHandles, NodeMetrics};
use crate::node_loop::{run_node, EngineStats, NodeLoop, Shared};
use crate::prefill_node::{PrefillCmd, PrefillLinks, PrefillLoop};
use crate::routing::Router;
use crate::stream::RequestStream;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use tessera_engine::{AdmissionLimits, Admitted, Engine, EngineConfig, PdAdmission};
use tessera_model::LoadedModel;
use tessera_transfer::inproc::{InprocTransport, PageLanding};
use tessera_transfer::protocol::{Msg, ReqId, Role, Writer};
use tessera_transfer::transport::{DestPage, KvTransport, TransportError};

/// A node's command queue, thread and counters.
struct NodeSlot<C> {
    tx: mpsc::Sender<C>,
    thread: Mutex<Option<JoinHandle<()>>>,
    shared: Arc<Shared>,
    limits: AdmissionLimits,
}

impl<C> NodeSlot<C> {
    /// The slot of a node about to run `e`, fed by `tx`, publishing into `metrics`.
    fn new(e: &Engine, tx: mpsc::Sender<C>, metrics: NodeHandles) -> Self {
        let shared = Arc::new(Shared::with_metrics(metrics));
        shared.publish(e, 0);
        Self {
            tx,
            thread: Mutex::new(None),
            shared,
            limits: e.limits(),
        }
    }

    fn send(&self, c: C) -> bool {
        self.tx.send(c).is_ok()
    }

    fn is_down(&self) -> bool {
        self.thread
            .lock()
            .unwrap()
            .as_ref()
            .is_none_or(|t| t.is_finished())
    }
}

/// A fault the next transfer suffers, and the write tap (tests only).
#[derive(Debug, Default)]
struct Faults {
    next: Mutex<Option<TransferFault>>,
    /// Copies of every landing, when tapping (for late-write replays).
    tap: Mutex<Option<Vec<PageLanding>>>,
}

struct Nodes {
    prefill: Vec<NodeSlot<PrefillCmd>>,
    decode: Vec<NodeSlot<DecodeCmd>>,
    coord: mpsc::Sender<CoordCmd>,
    counters: Arc<PdCounters>,
    faults: Faults,
    router: Router,
    /// Every node's series (`prefill-N`, `decode-N`).
    metrics: Arc<NodeMetrics>,
    /// Each node's handles, by role and index.
    prefill_metrics: Vec<NodeHandles>,
    decode_metrics: Vec<NodeHandles>,
}

/// The in-process coordinator as a node's reply link.
struct CoordReply(mpsc::Sender<CoordCmd>);

impl Reply for CoordReply {
    fn send(&self, msg: Msg) -> bool {
        self.0.send(CoordCmd::FromNode(msg)).is_ok()
    }
}

impl Nodes {
    fn reply(&self) -> ReplyTo {
        Arc::new(CoordReply(self.coord.clone()))
    }
}

/// The in-process name of prefill node `index` (what a decode node checks pages and
/// commits against).
fn prefill_name(index: usize) -> String {
    format!("prefill-{index}")
}

/// One in-process prefill node's view of the decode nodes.
struct InprocPrefill {
    nodes: Arc<Nodes>,
    index: usize,
}

impl InprocPrefill {
    fn from(&self) -> WriterLink {
        WriterLink {
            name: prefill_name(self.index),
            link: None,
        }
    }
}

impl PrefillLinks for InprocPrefill {
    fn transport(
        &self,
        decode: usize,
        fault: Option<TransferFault>,
        dest: &[DestPage],
    ) -> Result<Box<dyn KvTransport>, TransportError> {
        let nodes = self.nodes.clone();
        let from = self.from();
        let last_page = dest.last().map(|d| d.page);
        Ok(Box::new(InprocTransport::new(Box::new(move |mut l| {
            match fault {
                Some(TransferFault::DropLastWrite) if Some(l.dest.page) == last_page => {
                    return true;
                }
                Some(TransferFault::CorruptByte) if l.bytes.len() > 100 => {
                    l.bytes[100] ^= 0x01;
                }
                _ => {}
            }
            if let Some(tap) = nodes.faults.tap.lock().unwrap().as_mut() {
                tap.push(PageLanding {
                    req: l.req,
                    dest: l.dest,
                    bytes: l.bytes.clone(),
                });
            }
            nodes.decode.get(decode).is_some_and(|d| {
                !d.is_down()
                    && d.send(DecodeCmd::Land {
                        landing: l,
                        from: from.clone(),
                    })
            })
        }))))
    }

    fn to_decode(&self, decode: usize, msg: Msg, extra: CommitExtra) -> bool {
        self.nodes.decode.get(decode).is_some_and(|d| {
            d.send(DecodeCmd::FromPrefill {
                msg,
                extra,
                from: self.from(),
            })
        })
    }

    fn take_fault(&self) -> Option<TransferFault> {
        self.nodes.faults.next.lock().unwrap().take()
    }
}

impl CoordLinks for Nodes {
    fn to_decode(&self, index: usize, msg: Msg, extra: Attachment) -> bool {
        let body = match extra {
            Attachment::Decode {
                body,
                client,
                submitted,
                writer,
                trace,
            } => Some(Box::new(RequestBody {
                req: Some(body),
                sink: Box::new(client),
                submitted,
                writer: Some(prefill_name(writer.index)),
                trace,
            })),
            _ => None,
        };
        self.decode[index].send(DecodeCmd::FromCoordinator {
            msg,
            reply: self.reply(),
            body,
        })
    }

    /// In one process every writer is a prefill engine (decode engines never move
    /// KV here: nothing drains them).
    fn to_writer(&self, writer: Writer, msg: Msg, extra: Attachment) -> bool {
        if writer.role != Role::Prefill {
            return false;
        }
        let index = writer.index;
        let body = match extra {
            Attachment::Prefill {
                body,
                decode,
                trace,
                ..
            } => Some((body, decode, trace)),
            _ => None,
        };
        self.prefill[index].send(PrefillCmd::FromCoordinator {
            msg,
            reply: self.reply(),
            body,
        })
    }

    fn is_down(&self, role: Role, index: usize) -> bool {
        match role {
            Role::Prefill => self.prefill[index].is_down(),
            _ => self.decode[index].is_down(),
        }
    }

    fn router(&self) -> &Router {
        &self.router
    }

    fn released(&self, _req: ReqId) {
        self.counters.released.fetch_add(1, Ordering::Relaxed);
    }

    fn counters(&self) -> &PdCounters {
        &self.counters
    }
}

/// One prefill pool and one decode pool in this process, each with one or more
/// engines, behind the same `submit` as a co-located engine.
pub struct PdCluster {
    nodes: Arc<Nodes>,
    submitter: Submitter,
}

fn spawn_node<N: NodeLoop + Send + 'static>(
    name: String,
    engine: Engine,
    node: N,
    rx: mpsc::Receiver<N::Cmd>,
    shared: Arc<Shared>,
) -> JoinHandle<()>
where
    N::Cmd: 'static,
{
    std::thread::Builder::new()
        .name(name)
        .spawn(move || run_node(engine, node, rx, &shared))
        .expect("spawn engine thread")
}

impl PdCluster {
    /// Starts `prefill.len()` prefill engines and `decode.len()` decode engines on
    /// `model` (each with its own KV pool of its config's size) and the coordinator.
    ///
    /// Panics if either list is empty.
    pub fn spawn(model: &LoadedModel, prefill: &[EngineConfig], decode: &[EngineConfig]) -> Self {
        Self::spawn_in(model, prefill, decode, Arc::new(NodeMetrics::new()), "")
    }

    /// [`Self::spawn`] publishing into `metrics` (shared by every model's engines of
    /// a process) under node names `{prefix}prefill-N` and `{prefix}decode-N`.
    pub fn spawn_in(
        model: &LoadedModel,
        prefill: &[EngineConfig],
        decode: &[EngineConfig],
        metrics: Arc<NodeMetrics>,
        prefix: &str,
    ) -> Self {
        let with = |cfgs: &[EngineConfig]| -> Vec<(LoadedModel, EngineConfig)> {
            cfgs.iter().map(|c| (model.clone(), c.clone())).collect()
        };
        Self::spawn_nodes(&with(prefill), &with(decode), metrics, prefix)
    }

    /// [`Self::spawn`] with each engine's own model. A deployment never mixes models
    /// in one cluster (one cluster per model behind the gateway); tests use this to
    /// plant a transfer between engines of different models, which the decode node
    /// must refuse at the commit (the model fingerprints differ).
    ///
    /// Panics if either list is empty.
    #[doc(hidden)]
    pub fn spawn_models(
        prefill: &[(LoadedModel, EngineConfig)],
        decode: &[(LoadedModel, EngineConfig)],
    ) -> Self {
        Self::spawn_nodes(prefill, decode, Arc::new(NodeMetrics::new()), "")
    }

    fn spawn_nodes(
        prefill: &[(LoadedModel, EngineConfig)],
        decode: &[(LoadedModel, EngineConfig)],
        metrics: Arc<NodeMetrics>,
        prefix: &str,
    ) -> Self {
        assert!(!prefill.is_empty() && !decode.is_empty());
        let (coord_tx, coord_rx) = mpsc::channel();
        let engine = |(model, cfg): &(LoadedModel, EngineConfig)| {
            Engine::new(
                model.transformer.clone(),
                model.tokenizer.clone(),
                cfg.clone(),
            )
        };
        let mut decode_parts = Vec::new();
        let mut prefill_parts = Vec::new();
        let decode_metrics: Vec<NodeHandles> = (0..decode.len())
            .map(|i| metrics.node(&format!("{prefix}decode-{i}"), "decode"))
            .collect();
        let prefill_metrics: Vec<NodeHandles> = (0..prefill.len())
            .map(|i| metrics.node(&format!("{prefix}prefill-{i}"), "prefill"))
            .collect();
        let nodes = Arc::new({
            let decode_slots = decode
                .iter()
                .zip(&decode_metrics)
                .map(|(cfg, m)| {
                    let mut e = engine(cfg);
                    e.track_ended();
                    e.set_metrics(m.engine_metrics());
                    let (tx, rx) = mpsc::channel();
                    let s = NodeSlot::new(&e, tx, m.clone());
                    decode_parts.push((e, rx));
                    s
                })
                .collect();
            let prefill_slots = prefill
                .iter()
                .zip(&prefill_metrics)
                .map(|(cfg, m)| {
                    let mut e = engine(cfg);
                    e.set_metrics(m.engine_metrics());
                    let (tx, rx) = mpsc::channel();
                    let s = NodeSlot::new(&e, tx.clone(), m.clone());
                    prefill_parts.push((e, rx, tx));
                    s
                })
                .collect();
            Nodes {
                prefill: prefill_slots,
                decode: decode_slots,
                coord: coord_tx,
                counters: Arc::new(PdCounters::default()),
                faults: Faults::default(),
                router: Router::new(prefill.len(), decode.len()),
                metrics,
                prefill_metrics,
                decode_metrics,
            }
        });
        for (i, (e, rx)) in decode_parts.into_iter().enumerate() {
            let node = DecodeLoop::new(nodes.counters.clone(), nodes.decode_metrics[i].clone());
            let t = spawn_node(
                format!("tessera-decode-{i}"),
                e,
                node,
                rx,
                nodes.decode[i].shared.clone(),
            );
            *nodes.decode[i].thread.lock().unwrap() = Some(t);
        }
        for (i, (e, rx, self_tx)) in prefill_parts.into_iter().enumerate() {
            let links: Arc<dyn PrefillLinks> = Arc::new(InprocPrefill {
                nodes: nodes.clone(),
                index: i,
            });
            let fp = e.model_fingerprint();
            let node = PrefillLoop::new(links, self_tx, nodes.prefill_metrics[i].clone(), fp);
            let t = spawn_node(
                format!("tessera-prefill-{i}"),
                e,
                node,
                rx,
                nodes.prefill[i].shared.clone(),
            );
            *nodes.prefill[i].thread.lock().unwrap() = Some(t);
        }
        let links: Arc<dyn CoordLinks> = nodes.clone();
        std::thread::Builder::new()
            .name("tessera-pd-coordinator".into())
            .spawn(move || coordinate(links, coord_rx))
            .expect("spawn coordinator thread");
        let smallest = |limits: &mut dyn Iterator<Item = AdmissionLimits>| {
            limits.map(|l| l.pool_tokens).min().unwrap()
        };
        let limits = AdmissionLimits {
            pool_tokens: smallest(&mut nodes.decode.iter().map(|d| d.limits)),
            ..nodes.decode[0].limits
        };
        let prefill_pool_tokens = smallest(&mut nodes.prefill.iter().map(|p| p.limits));
        let submitter = Submitter::new(
            nodes.coord.clone(),
            PdAdmission {
                limits,
                prefill_pool_tokens,
            },
        );
        Self { nodes, submitter }
    }

    /// Picks a (prefill, decode) pair for `req` (admitted against
    /// [`Self::admission`]) and starts the transfer protocol. Cancel or drop the stream to abort (the abort reaches both
    /// nodes and is acknowledged before any page is freed, I6).
    ///
    /// `affinity` (a session's routing key) prefers the prefill node that served
    /// the session before (see the routing policy).
    ///
    /// Errors: [`ServeErrorKind::NodeDown`](crate::ServeErrorKind) when every node of
    /// a role is down.
    pub fn submit(
        &self,
        req: Admitted,
        affinity: Option<u64>,
    ) -> Result<RequestStream, ServeError> {
        self.submitter.submit(&*self.nodes, req, affinity)
    }

    /// What [`Self::submit`] admits against.
    pub fn admission(&self) -> PdAdmission {
        self.submitter.admission()
    }

    /// Counters summed over every node.
    pub fn stats(&self) -> EngineStats {
        let n = &self.nodes;
        n.prefill
            .iter()
            .map(|s| s.shared.snapshot())
            .chain(n.decode.iter().map(|s| s.shared.snapshot()))
            .fold(EngineStats::default(), EngineStats::sum)
    }

    /// One node's counters.
    pub fn node_stats(&self, role: Role, index: usize) -> EngineStats {
        match role {
            Role::Prefill => self.nodes.prefill[index].shared.snapshot(),
            _ => self.nodes.decode[index].shared.snapshot(),
        }
    }

    /// Protocol error counters.
    pub fn counters(&self) -> &PdCounters {
        &self.nodes.counters
    }

    /// Every node's metrics (`node` labels `prefill-N`, `decode-N`).
    pub fn metrics(&self) -> &NodeMetrics {
        &self.nodes.metrics
    }

    /// Runs `f` on every node's engine between two of its steps and returns the
    /// answers (prefill nodes first) once each node answered.
    ///
    /// Errors: [`ServeErrorKind::NodeDown`](crate::ServeErrorKind) for a node that is
    /// down, [`ServeErrorKind::Timeout`](crate::ServeErrorKind) for one that did not
    /// answer within [`ENGINE_ANSWER_WAIT`] (it may still run `f`).
    pub(crate) fn ask_every_engine<T: Send + 'static>(
        &self,
        f: EngineQuery<T>,
    ) -> Result<Vec<T>, ServeError> {
        let (tx, rx) = mpsc::channel();
        let job = |tx: mpsc::Sender<T>| {
            let f = f.clone();
            Box::new(move |e: &mut Engine| {
                let _ = tx.send(f(e));
            })
        };
        let mut asked = 0;
        for (i, node) in self.nodes.prefill.iter().enumerate() {
            if !node.send(PrefillCmd::WithEngine(job(tx.clone()))) {
                return Err(node_down("prefill", i));
            }
            asked += 1;
        }
        for (i, node) in self.nodes.decode.iter().enumerate() {
            if !node.send(DecodeCmd::WithEngine(job(tx.clone()))) {
                return Err(node_down("decode", i));
            }
            asked += 1;
        }
        collect_answers(&rx, asked)
    }

    /// Runs `f` on decode node `index`'s engine between two of its steps (fault
    /// injection: a planted block-table bug; tests only).
    #[doc(hidden)]
    pub fn with_decode_engine(&self, index: usize, f: impl FnOnce(&mut Engine) + Send + 'static) {
        self.nodes.decode[index].send(DecodeCmd::WithEngine(Box::new(f)));
    }

    /// Makes the next transfer suffer `fault` (fault-injection tests only).
    #[doc(hidden)]
    pub fn inject_fault(&self, fault: TransferFault) {
        *self.nodes.faults.next.lock().unwrap() = Some(fault);
    }

    /// Starts keeping a copy of every page write (fault-injection tests only).
    #[doc(hidden)]
    pub fn tap_writes(&self) {
        *self.nodes.faults.tap.lock().unwrap() = Some(Vec::new());
    }

    /// The page writes copied since [`Self::tap_writes`].
    #[doc(hidden)]
    pub fn tapped_writes(&self) -> Vec<PageLanding> {
        self.nodes
            .faults
            .tap
            .lock()
            .unwrap()
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Delivers a page write to decode node `index` as the network would (a late or
    /// stray write; fault-injection tests only).
    #[doc(hidden)]
    pub fn deliver_write(&self, index: usize, write: PageLanding) {
        self.nodes.decode[index].send(DecodeCmd::Land {
            landing: write,
            from: WriterLink {
                name: prefill_name(0),
                link: None,
            },
        });
    }

    /// Delivers a raw protocol message to decode node `index` as prefill node 0 would
    /// (a forged or stale commit; fault-injection tests only).
    #[doc(hidden)]
    pub fn deliver_to_decode(&self, index: usize, msg: Msg) {
        self.deliver_to_decode_from(index, msg, &prefill_name(0));
    }

    /// [`Self::deliver_to_decode`] as if it came from the node named `from`
    /// (`prefill-N` in one process).
    #[doc(hidden)]
    pub fn deliver_to_decode_from(&self, index: usize, msg: Msg, from: &str) {
        self.nodes.decode[index].send(DecodeCmd::FromPrefill {
            msg,
            extra: CommitExtra::default(),
            from: WriterLink {
                name: from.to_string(),
                link: None,
            },
        });
    }

    /// Kills a node as a crash would (fault injection): its thread stops at once and
    /// drops its pool and every request it held, without telling anyone. Blocks
    /// until the thread is gone.
    pub fn kill_node(&self, role: Role, index: usize) {
        let thread = match role {
            Role::Prefill => {
                self.nodes.prefill[index].send(PrefillCmd::Crash);
                self.nodes.prefill[index].thread.lock().unwrap().take()
            }
            _ => {
                self.nodes.decode[index].send(DecodeCmd::Crash);
                self.nodes.decode[index].thread.lock().unwrap().take()
            }
        };
        if let Some(t) = thread {
            let _ = t.join();
        }
    }
}

impl Drop for PdCluster {
    /// Stops the coordinator and every node; requests still running end with their
    /// streams closed (the gateway reports an error).
    fn drop(&mut self) {
        self.submitter.stop();
        for p in &self.nodes.prefill {
            p.send(PrefillCmd::Crash);
        }
        for d in &self.nodes.decode {
            d.send(DecodeCmd::Crash);
        }
    }
}

/// A question for engines ([`PdCluster::ask_every_engine`]).
pub(crate) type EngineQuery<T> = Arc<dyn Fn(&mut Engine) -> T + Send + Sync>;

/// How long a question to the engines waits for each engine's answer.
pub const ENGINE_ANSWER_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

fn node_down(role: &str, index: usize) -> ServeError {
    ServeError::new(
        ServeErrorKind::NodeDown,
        format!("{role} node {index} is down and did not answer"),
    )
}

/// `asked` engines' answers from `rx`, waiting [`ENGINE_ANSWER_WAIT`] for each.
pub(crate) fn collect_answers<T>(
    rx: &mpsc::Receiver<T>,
    asked: usize,
) -> Result<Vec<T>, ServeError> {
    (0..asked)
        .map(|answered| {
            rx.recv_timeout(ENGINE_ANSWER_WAIT).map_err(|_| {
                ServeError::new(
                    ServeErrorKind::Timeout,
                    format!("{answered} of {asked} engines answered in time"),
                )
            })
        })
        .collect()
}
