//! Prefill and decode engines in one process, driven by the KV transfer protocol
//! ([`super::protocol`]) over the in-process transport: the embedded default of
//! `tessera serve`, so every request runs the same protocol as a multi-node
//! deployment.
//!
//! Threads: one engine thread per node (it owns the node's pool, its protocol state
//! machine and applies page landings), and one coordinator thread that runs a
//! [`Coordinator`] per request, watches for clients that went away and for nodes
//! that died, and turns outcomes into the request's events. Messages between them go
//! over FIFO channels; the protocol's outputs are executed in order.

use crate::handle::{publish, run_node, EngineStats, NodeLoop, Shared};
use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use tessera_engine::engine::{
    AdmissionLimits, Engine, EngineConfig, EngineError, Event, ExportError, ExportJob, Exported,
    GenerateRequest, Import, Rejection,
};
use tessera_model::gguf::LoadedModel;
use tessera_model::kv::SeqId;
use tessera_transfer::inproc::{InprocTransport, PageLanding};
use tessera_transfer::protocol::{
    Coordinator, DecodeEnv, DecodeNode, DecodeOutcome, Failure, Msg, Outcome, Output, PrefillEnv,
    PrefillNode, Refusal, RefusalKind, ReqId, Role,
};
use tessera_transfer::transport::{DestPage, KvTransport};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// What travels with a protocol message inside this process: the request body
/// (prompt ids, sampling) that the protocol itself leaves out, the client's event
/// sink, and the sampler position that continues on the decode node.
pub(crate) enum Extra {
    None,
    /// With `Prealloc`: the request and where its events go.
    Decode {
        req: GenerateRequest,
        sink: UnboundedSender<Event>,
        submitted: Instant,
    },
    /// With `Prefill`: the request and the decode node that reserved the pages.
    Prefill {
        req: GenerateRequest,
        decode: usize,
    },
    /// With `Commit`: the sampler's RNG position after the first token.
    RngPos(u128),
}

pub(crate) enum DecodeCmd {
    Control(Msg, Extra),
    Land(PageLanding),
    /// Runs once every earlier command was applied (remote flush acknowledgements).
    AfterEarlier(Box<dyn FnOnce() + Send>),
    Crash,
}

pub(crate) enum PrefillCmd {
    Control(Msg, Extra),
    Exported(ReqId, Result<Exported, ExportError>),
    Crash,
}

pub(crate) enum CoordCmd {
    Start {
        req: ReqId,
        body: GenerateRequest,
        sink: UnboundedSender<Event>,
        prefill: usize,
        decode: usize,
    },
    FromNode(Msg),
    Stop,
}

/// A node's command queue, thread and counters.
struct NodeSlot<C> {
    tx: Mutex<mpsc::Sender<C>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    shared: Arc<Shared>,
    limits: AdmissionLimits,
}

impl<C> NodeSlot<C> {
    fn send(&self, c: C) -> bool {
        self.tx.lock().unwrap().send(c).is_ok()
    }

    fn is_down(&self) -> bool {
        self.thread
            .lock()
            .unwrap()
            .as_ref()
            .is_none_or(|t| t.is_finished())
    }

    fn stats(&self) -> EngineStats {
        self.shared.snapshot()
    }
}

struct Nodes {
    prefill: Vec<NodeSlot<PrefillCmd>>,
    decode: Vec<NodeSlot<DecodeCmd>>,
    coord: Mutex<mpsc::Sender<CoordCmd>>,
    counters: PdCounters,
    faults: Faults,
    /// The `Arc` this lives in (transports outlive the call that made them).
    self_ref: Mutex<std::sync::Weak<Nodes>>,
}

/// Protocol-level error counters (all nodes of the cluster).
#[derive(Debug, Default)]
pub struct PdCounters {
    /// Commits the decode side refused (I4), including duplicates and unknown ids.
    pub commits_rejected: AtomicU64,
    /// Page writes dropped because their page no longer held the named tag.
    pub writes_dropped: AtomicU64,
    /// Requests that reached `Released` (every node acknowledged or was down).
    pub released: AtomicU64,
}

/// A fault the next transfer suffers (tests only): each reproduces a bug class of
/// PD serving engines that the protocol must turn into an error.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferFault {
    /// The transport silently loses the last page write.
    DropLastWrite,
    /// One byte of the first page is flipped in flight.
    CorruptByte,
    /// The prefill node sends its `Commit` twice.
    DuplicateCommit,
}

#[derive(Debug, Default)]
struct Faults {
    next: Mutex<Option<TransferFault>>,
    /// Copies of every landing, when tapping (for late-write replays).
    tap: Mutex<Option<Vec<PageLanding>>>,
}

impl Faults {
    fn take(&self) -> Option<TransferFault> {
        self.next.lock().unwrap().take()
    }
}

/// How a node's protocol loop reaches the rest of the deployment: the coordinator
/// of each request, the decode nodes (commits) and their memory (page writes).
pub(crate) trait NodeLinks: Send + Sync {
    /// Sends `msg` to the coordinator of `msg.req()`.
    fn to_coordinator(&self, msg: Msg);
    /// Sends a control message (a `Commit`, with the sampler position) to decode
    /// node `decode`. Returns `false` when it is unreachable.
    fn to_decode(&self, decode: usize, msg: Msg, rng_pos: u128) -> bool;
    /// A transport that writes pages into decode node `decode`'s reserved pages.
    fn transport(
        &self,
        decode: usize,
        fault: Option<TransferFault>,
        dest: &[DestPage],
    ) -> Box<dyn KvTransport>;
    /// Error counters.
    fn counters(&self) -> &PdCounters;
    /// The fault the next transfer suffers (fault-injection tests only).
    fn take_fault(&self) -> Option<TransferFault> {
        None
    }
    /// Forwards what the engine streamed since the last call (remote decode nodes);
    /// called after every step, before the protocol hears which decodes ended.
    fn pump(&self) {}
}

/// How the coordinator reaches the nodes.
pub(crate) trait CoordLinks: Send + Sync {
    /// Sends to decode node `index`; `false` when unreachable.
    fn to_decode(&self, index: usize, msg: Msg, extra: Extra) -> bool;
    /// Sends to prefill node `index`; `false` when unreachable.
    fn to_prefill(&self, index: usize, msg: Msg, extra: Extra) -> bool;
    /// Whether the node is known dead (its thread exited, its connection closed).
    fn is_down(&self, role: Role, index: usize) -> bool;
    /// Error counters.
    fn counters(&self) -> &PdCounters;
    /// The request is over everywhere (every node acknowledged or is down).
    fn released(&self, _req: ReqId) {}
}

impl NodeLinks for Nodes {
    fn to_coordinator(&self, msg: Msg) {
        let _ = self.coord.lock().unwrap().send(CoordCmd::FromNode(msg));
    }

    fn to_decode(&self, decode: usize, msg: Msg, rng_pos: u128) -> bool {
        self.decode
            .get(decode)
            .is_some_and(|d| d.send(DecodeCmd::Control(msg, Extra::RngPos(rng_pos))))
    }

    fn transport(
        &self,
        decode: usize,
        fault: Option<TransferFault>,
        dest: &[DestPage],
    ) -> Box<dyn KvTransport> {
        let nodes = self
            .self_ref
            .lock()
            .unwrap()
            .upgrade()
            .expect("cluster alive");
        let last_page = dest.last().map(|d| d.page);
        Box::new(InprocTransport::new(Box::new(move |mut l| {
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
            nodes
                .decode
                .get(decode)
                .is_some_and(|d| !d.is_down() && d.send(DecodeCmd::Land(l)))
        })))
    }

    fn counters(&self) -> &PdCounters {
        &self.counters
    }

    fn take_fault(&self) -> Option<TransferFault> {
        self.faults.take()
    }
}

impl CoordLinks for Nodes {
    fn to_decode(&self, index: usize, msg: Msg, extra: Extra) -> bool {
        self.decode[index].send(DecodeCmd::Control(msg, extra))
    }

    fn to_prefill(&self, index: usize, msg: Msg, extra: Extra) -> bool {
        self.prefill[index].send(PrefillCmd::Control(msg, extra))
    }

    fn is_down(&self, role: Role, index: usize) -> bool {
        match role {
            Role::Prefill => self.prefill[index].is_down(),
            _ => self.decode[index].is_down(),
        }
    }

    fn counters(&self) -> &PdCounters {
        &self.counters
    }
}

/// Admission (I1) for a disaggregated deployment, run before any node is asked for
/// anything: prompt + `max_tokens` against the context window and the decode pools,
/// the prompt against the prefill pools (whole pages; smallest node of each role).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PdAdmission {
    /// Context window, decode pool capacity (tokens), page size, vocabulary.
    pub limits: AdmissionLimits,
    /// Prefill pool capacity in tokens.
    pub prefill_pool_tokens: usize,
}

impl PdAdmission {
    /// The I1 checks: pure, no allocation. Returns the validated request body.
    ///
    /// Errors: every [`Rejection`] of [`AdmissionLimits::admit`], and
    /// [`Rejection::PoolTooSmall`] with the prefill pool's capacity when the prompt
    /// alone does not fit it.
    pub fn admit(&self, req: GenerateRequest) -> Result<GenerateRequest, Rejection> {
        let body = self.limits.admit(req)?.request().clone();
        let page = self.limits.page_size;
        let needed = body.prompt.len().div_ceil(page) * page;
        if needed > self.prefill_pool_tokens {
            return Err(Rejection::PoolTooSmall {
                needed,
                capacity: self.prefill_pool_tokens,
            });
        }
        Ok(body)
    }
}

/// One prefill pool and one decode pool in this process, each with one or more
/// engines, behind the same `submit` as a co-located engine.
pub struct PdCluster {
    nodes: Arc<Nodes>,
    next_req: AtomicU64,
    admission: PdAdmission,
}

impl PdCluster {
    /// Starts `prefill.len()` prefill engines and `decode.len()` decode engines on
    /// `model` (each with its own KV pool of its config's size) and the coordinator.
    ///
    /// Panics if either list is empty.
    pub fn spawn(model: &LoadedModel, prefill: &[EngineConfig], decode: &[EngineConfig]) -> Self {
        assert!(!prefill.is_empty() && !decode.is_empty());
        let (coord_tx, coord_rx) = mpsc::channel();
        let mut decode_rxs = Vec::new();
        let decode_slots: Vec<NodeSlot<DecodeCmd>> = decode
            .iter()
            .map(|cfg| {
                let engine = Engine::new(model.llama.clone(), model.tokenizer.clone(), cfg.clone());
                let (tx, rx) = mpsc::channel();
                decode_rxs.push((engine, rx));
                NodeSlot {
                    tx: Mutex::new(tx),
                    thread: Mutex::new(None),
                    shared: Arc::new(Shared::default()),
                    limits: AdmissionLimits::default(),
                }
            })
            .collect();
        let mut prefill_rxs = Vec::new();
        let prefill_slots: Vec<NodeSlot<PrefillCmd>> = prefill
            .iter()
            .map(|cfg| {
                let engine = Engine::new(model.llama.clone(), model.tokenizer.clone(), cfg.clone());
                let (tx, rx) = mpsc::channel();
                prefill_rxs.push((engine, rx, tx.clone()));
                NodeSlot {
                    tx: Mutex::new(tx),
                    thread: Mutex::new(None),
                    shared: Arc::new(Shared::default()),
                    limits: AdmissionLimits::default(),
                }
            })
            .collect();
        let mut nodes = Nodes {
            prefill: prefill_slots,
            decode: decode_slots,
            coord: Mutex::new(coord_tx),
            counters: PdCounters::default(),
            faults: Faults::default(),
            self_ref: Mutex::new(std::sync::Weak::new()),
        };
        for (slot, (e, _)) in nodes.decode.iter_mut().zip(&decode_rxs) {
            slot.limits = e.limits();
            publish(e, &slot.shared);
        }
        for (slot, (e, _, _)) in nodes.prefill.iter_mut().zip(&prefill_rxs) {
            slot.limits = e.limits();
            publish(e, &slot.shared);
        }
        let nodes = Arc::new(nodes);
        *nodes.self_ref.lock().unwrap() = Arc::downgrade(&nodes);
        for (i, (mut engine, rx)) in decode_rxs.into_iter().enumerate() {
            engine.track_ended();
            let n = nodes.clone();
            let t = std::thread::Builder::new()
                .name(format!("tessera-decode-{i}"))
                .spawn(move || {
                    let node = DecodeLoop::new(n.clone());
                    run_node(engine, node, rx, &n.decode[i].shared);
                })
                .expect("spawn decode engine thread");
            *nodes.decode[i].thread.lock().unwrap() = Some(t);
        }
        for (i, (engine, rx, self_tx)) in prefill_rxs.into_iter().enumerate() {
            let n = nodes.clone();
            let t = std::thread::Builder::new()
                .name(format!("tessera-prefill-{i}"))
                .spawn(move || {
                    let node = PrefillLoop::new(n.clone(), self_tx);
                    run_node(engine, node, rx, &n.prefill[i].shared);
                })
                .expect("spawn prefill engine thread");
            *nodes.prefill[i].thread.lock().unwrap() = Some(t);
        }
        let n = nodes.clone();
        std::thread::Builder::new()
            .name("tessera-pd-coordinator".into())
            .spawn(move || coordinate(n, coord_rx))
            .expect("spawn coordinator thread");
        let limits = AdmissionLimits {
            pool_tokens: nodes
                .decode
                .iter()
                .map(|d| d.limits.pool_tokens)
                .min()
                .unwrap(),
            ..nodes.decode[0].limits
        };
        let prefill_pool_tokens = nodes
            .prefill
            .iter()
            .map(|p| p.limits.pool_tokens)
            .min()
            .unwrap();
        Self {
            nodes,
            next_req: AtomicU64::new(first_req_id()),
            admission: PdAdmission {
                limits,
                prefill_pool_tokens,
            },
        }
    }

    /// Admits `req` (I1, against the decode pools for prompt + `max_tokens` and the
    /// prefill pools for the prompt), picks the least-loaded (prefill, decode) pair and
    /// starts the transfer protocol. Events arrive on the returned receiver; drop it
    /// to abort (the abort reaches both nodes and is acknowledged before any page is
    /// freed, I6).
    pub fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Event>, Rejection> {
        let body = self.admission.admit(req)?;
        let prefill = least_loaded(&self.nodes.prefill);
        let decode = least_loaded(&self.nodes.decode);
        let (sink, rx) = unbounded_channel();
        let req = ReqId(self.next_req.fetch_add(1, Ordering::Relaxed));
        let start = CoordCmd::Start {
            req,
            body,
            sink,
            prefill,
            decode,
        };
        if let Err(mpsc::SendError(CoordCmd::Start { sink, .. })) =
            self.nodes.coord.lock().unwrap().send(start)
        {
            let _ = sink.send(Event::Error(EngineError::Shutdown));
        }
        Ok(rx)
    }

    /// What [`Self::submit`] admits against.
    pub fn admission(&self) -> PdAdmission {
        self.admission
    }

    /// Counters summed over every node.
    pub fn stats(&self) -> EngineStats {
        let all = self
            .nodes
            .prefill
            .iter()
            .map(NodeSlot::stats)
            .chain(self.nodes.decode.iter().map(NodeSlot::stats));
        all.fold(EngineStats::default(), |a, s| EngineStats {
            free_pages: a.free_pages + s.free_pages,
            capacity_pages: a.capacity_pages + s.capacity_pages,
            running: a.running + s.running,
            waiting: a.waiting + s.waiting,
        })
    }

    /// One node's counters.
    pub fn node_stats(&self, role: Role, index: usize) -> EngineStats {
        match role {
            Role::Prefill => self.nodes.prefill[index].stats(),
            _ => self.nodes.decode[index].stats(),
        }
    }

    /// Protocol error counters.
    pub fn counters(&self) -> &PdCounters {
        &self.nodes.counters
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
        self.nodes.decode[index].send(DecodeCmd::Land(write));
    }

    /// Delivers a raw protocol message to decode node `index` (a forged or stale
    /// commit; fault-injection tests only).
    #[doc(hidden)]
    pub fn deliver_to_decode(&self, index: usize, msg: Msg) {
        self.nodes.decode[index].send(DecodeCmd::Control(msg, Extra::None));
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
        let _ = self.nodes.coord.lock().unwrap().send(CoordCmd::Stop);
        for p in &self.nodes.prefill {
            p.send(PrefillCmd::Crash);
        }
        for d in &self.nodes.decode {
            d.send(DecodeCmd::Crash);
        }
    }
}

/// The first request id of a coordinator: a random 32-bit coordinator id in the
/// high bits, a counter in the low bits, so ids from two gateways (or one gateway
/// before and after a restart) never meet on a node, where a reused id would
/// address another request's records and pages.
pub(crate) fn first_req_id() -> u64 {
    (u64::from(rand::random::<u32>()) << 32) | 1
}

fn least_loaded<C>(slots: &[NodeSlot<C>]) -> usize {
    (0..slots.len())
        .filter(|&i| !slots[i].is_down())
        .max_by_key(|&i| {
            let s = slots[i].stats();
            (s.free_pages, usize::MAX - s.waiting - s.running)
        })
        .unwrap_or(0)
}

fn refusal(r: &Rejection) -> Refusal {
    let kind = match r {
        Rejection::ContextOverflow { .. } | Rejection::PoolTooSmall { .. } => RefusalKind::TooLarge,
        _ => RefusalKind::Invalid,
    };
    Refusal {
        kind,
        message: r.to_string(),
    }
}

// ---------------------------------------------------------------------------
// Decode node
// ---------------------------------------------------------------------------

struct DecodeSeq {
    seq: SeqId,
    body: Option<(GenerateRequest, UnboundedSender<Event>, Instant)>,
    /// The client's stream, to tell a finished decode from a client that left.
    watch: UnboundedSender<Event>,
}

pub(crate) struct DecodeLoop {
    proto: DecodeNode,
    links: Arc<dyn NodeLinks>,
    seqs: HashMap<ReqId, DecodeSeq>,
    by_seq: HashMap<SeqId, ReqId>,
    /// `Prealloc`s that passed admission but wait for free pages (FIFO).
    deferred: VecDeque<(Msg, Extra)>,
    crashed: bool,
    tombstones: Tombstones,
}

impl DecodeLoop {
    /// A decode node's protocol loop reaching the deployment through `links`.
    pub(crate) fn new(links: Arc<dyn NodeLinks>) -> Self {
        Self {
            proto: DecodeNode::new(),
            links,
            seqs: HashMap::new(),
            by_seq: HashMap::new(),
            deferred: VecDeque::new(),
            crashed: false,
            tombstones: Tombstones::default(),
        }
    }
}

/// The decode node's [`DecodeEnv`] over its engine.
struct DecodeEngineEnv<'a> {
    engine: &'a mut Engine,
    seqs: &'a mut HashMap<ReqId, DecodeSeq>,
    by_seq: &'a mut HashMap<SeqId, ReqId>,
    pending_body: Option<(GenerateRequest, UnboundedSender<Event>, Instant)>,
    rng_pos: u128,
}

impl DecodeEnv for DecodeEngineEnv<'_> {
    fn reserve(
        &mut self,
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
    ) -> Result<Vec<DestPage>, Refusal> {
        let Some((body, sink, submitted)) = self.pending_body.take() else {
            return Err(Refusal {
                kind: RefusalKind::Invalid,
                message: "prealloc without a request body".into(),
            });
        };
        // I1 on this node, against its own pool.
        self.engine.admit(body.clone()).map_err(|r| refusal(&r))?;
        let (seq, dest) = self
            .engine
            .reserve_import(tenant, prompt_tokens as usize, max_tokens as usize)
            .map_err(|e| Refusal {
                kind: RefusalKind::Busy,
                message: e.to_string(),
            })?;
        self.seqs.insert(
            req,
            DecodeSeq {
                seq,
                watch: sink.clone(),
                body: Some((body, sink, submitted)),
            },
        );
        self.by_seq.insert(seq, req);
        Ok(dest)
    }

    fn landed_checksum(&self, _req: ReqId, dest: DestPage) -> Option<u32> {
        self.engine.landed_checksum(dest)
    }

    fn start_decode(&mut self, req: ReqId, _tokens: u32, first_token: u32, _pages: &[DestPage]) {
        let Some(s) = self.seqs.get_mut(&req) else {
            return;
        };
        let Some((body, sink, submitted)) = s.body.take() else {
            return;
        };
        let admitted = match self.engine.admit(body) {
            Ok(a) => a,
            Err(_) => return, // checked at reserve; the request cannot change
        };
        self.engine.adopt(
            s.seq,
            Import {
                req: admitted,
                first_token,
                seed_fallback: req.0,
                rng_word_pos: self.rng_pos,
                sink,
                submitted,
            },
        );
    }

    fn release(&mut self, req: ReqId) {
        if let Some(s) = self.seqs.remove(&req) {
            self.by_seq.remove(&s.seq);
            self.engine.release_seq(s.seq);
        }
    }
}

impl DecodeLoop {
    fn env<'a>(
        engine: &'a mut Engine,
        seqs: &'a mut HashMap<ReqId, DecodeSeq>,
        by_seq: &'a mut HashMap<SeqId, ReqId>,
    ) -> DecodeEngineEnv<'a> {
        DecodeEngineEnv {
            engine,
            seqs,
            by_seq,
            pending_body: None,
            rng_pos: 0,
        }
    }

    fn emit(&self, out: Vec<Output>) {
        for o in out {
            if let Output::Send { to, msg } = o {
                debug_assert_eq!(to, Role::Coordinator);
                self.links.to_coordinator(msg);
            }
        }
    }

    fn control(&mut self, engine: &mut Engine, msg: Msg, extra: Extra) {
        let mut out = Vec::new();
        match msg {
            Msg::Prealloc {
                prompt_tokens,
                max_tokens,
                ..
            } => {
                // Wait (FIFO) for pages rather than refusing a request that fits the
                // pool but not right now; admission failures go through at once.
                let tokens = prompt_tokens as usize + max_tokens as usize;
                let fits_now = self.deferred.is_empty() && engine.kv().can_reserve(tokens);
                let admissible = match &extra {
                    Extra::Decode { req, .. } => engine.admit(req.clone()).is_ok(),
                    _ => false,
                };
                if admissible && !fits_now && self.proto.records().state(msg.req()).is_none() {
                    if !self.deferred.iter().any(|(m, _)| m.req() == msg.req()) {
                        self.deferred.push_back((msg, extra));
                    }
                    return;
                }
                out = self.prealloc(engine, msg, extra);
            }
            Msg::Abort { req } => {
                // A deferred prealloc never reserved anything.
                self.deferred.retain(|(m, _)| m.req() != req);
                let mut env = Self::env(engine, &mut self.seqs, &mut self.by_seq);
                self.proto.on_msg(msg, &mut env, &mut out);
            }
            Msg::Commit {
                req,
                tokens,
                pages,
                first_token,
            } => {
                let mut env = Self::env(engine, &mut self.seqs, &mut self.by_seq);
                if let Extra::RngPos(p) = extra {
                    env.rng_pos = p;
                }
                if let Err(e) =
                    self.proto
                        .on_commit(req, tokens, &pages, first_token, &mut env, &mut out)
                {
                    self.links
                        .counters()
                        .commits_rejected
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(?req, error = %e, "refused a KV transfer commit");
                }
            }
            other => {
                let mut env = Self::env(engine, &mut self.seqs, &mut self.by_seq);
                self.proto.on_msg(other, &mut env, &mut out);
            }
        }
        self.emit(out);
    }

    /// Runs a `Prealloc` through the protocol with its request body (the body is
    /// what the decode node admits and later decodes).
    fn prealloc(&mut self, engine: &mut Engine, msg: Msg, extra: Extra) -> Vec<Output> {
        let mut out = Vec::new();
        let mut env = Self::env(engine, &mut self.seqs, &mut self.by_seq);
        if let Extra::Decode {
            req,
            sink,
            submitted,
        } = extra
        {
            env.pending_body = Some((req, sink, submitted));
        }
        self.proto.on_msg(msg, &mut env, &mut out);
        out
    }

    fn admit_deferred(&mut self, engine: &mut Engine) {
        while let Some((
            Msg::Prealloc {
                prompt_tokens,
                max_tokens,
                ..
            },
            _,
        )) = self.deferred.front()
        {
            let tokens = *prompt_tokens as usize + *max_tokens as usize;
            if !engine.kv().can_reserve(tokens) {
                break;
            }
            let (msg, extra) = self.deferred.pop_front().unwrap();
            let out = self.prealloc(engine, msg, extra);
            self.emit(out);
        }
    }
}

impl NodeLoop for DecodeLoop {
    type Cmd = DecodeCmd;

    // After `Crash`, `stop()` ends the loop before another command is applied.
    fn on_cmd(&mut self, engine: &mut Engine, cmd: DecodeCmd) {
        match cmd {
            DecodeCmd::Control(msg, extra) => self.control(engine, msg, extra),
            DecodeCmd::Land(l) => {
                if let Err(e) = engine.land(&l) {
                    self.links
                        .counters()
                        .writes_dropped
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(req = l.req, error = %e, "dropped a KV page write");
                }
            }
            DecodeCmd::AfterEarlier(f) => f(),
            DecodeCmd::Crash => self.crashed = true,
        }
    }

    fn stop(&self) -> bool {
        self.crashed
    }

    fn after_step(&mut self, engine: &mut Engine) {
        self.links.pump();
        for (seq, error) in engine.take_ended() {
            let Some(req) = self.by_seq.get(&seq).copied() else {
                continue;
            };
            let client_left = self.seqs.get(&req).is_some_and(|s| s.watch.is_closed());
            let outcome = match error {
                None if client_left => DecodeOutcome::Failed {
                    reason: "the client went away".into(),
                },
                None => DecodeOutcome::Completed,
                Some(reason) => DecodeOutcome::Failed { reason },
            };
            let mut out = Vec::new();
            let mut env = Self::env(engine, &mut self.seqs, &mut self.by_seq);
            self.proto
                .on_decode_finished(req, outcome, &mut env, &mut out);
            self.emit(out);
        }
        self.admit_deferred(engine);
        let proto = &mut self.proto;
        self.tombstones
            .sweep(proto.records().states().map(|(r, _)| r).collect(), |r| {
                proto.records_mut().forget(r)
            });
    }
}

// ---------------------------------------------------------------------------
// Prefill node
// ---------------------------------------------------------------------------

struct PrefillReq {
    body: GenerateRequest,
    decode: usize,
    rng_pos: u128,
}

pub(crate) struct PrefillLoop {
    proto: PrefillNode,
    links: Arc<dyn NodeLinks>,
    self_tx: mpsc::Sender<PrefillCmd>,
    reqs: HashMap<ReqId, PrefillReq>,
    /// Requests whose writes the engine already flushed (it flushes inside the step
    /// that exports), waiting for `on_drained`.
    drained: Vec<(ReqId, Result<(), String>)>,
    crashed: bool,
    tombstones: Tombstones,
    /// Fault injection: the request whose commit goes out twice.
    duplicate_commit: Option<ReqId>,
}

impl PrefillLoop {
    /// A prefill node's protocol loop; `self_tx` is its own command queue (export
    /// results come back through it).
    pub(crate) fn new(links: Arc<dyn NodeLinks>, self_tx: mpsc::Sender<PrefillCmd>) -> Self {
        Self {
            proto: PrefillNode::new(),
            links,
            self_tx,
            reqs: HashMap::new(),
            drained: Vec::new(),
            crashed: false,
            tombstones: Tombstones::default(),
            duplicate_commit: None,
        }
    }
}

struct PrefillEngineEnv<'a> {
    engine: &'a mut Engine,
    links: &'a Arc<dyn NodeLinks>,
    self_tx: &'a mpsc::Sender<PrefillCmd>,
    reqs: &'a HashMap<ReqId, PrefillReq>,
    drained: &'a mut Vec<(ReqId, Result<(), String>)>,
    flush_result: Result<(), String>,
    duplicate_commit: &'a mut Option<ReqId>,
}

impl PrefillEnv for PrefillEngineEnv<'_> {
    fn pages_for(&self, tokens: u32) -> usize {
        self.engine.kv().pages_for(tokens as usize)
    }

    fn admit_and_alloc(
        &mut self,
        req: ReqId,
        _tenant: u64,
        prompt_tokens: u32,
        _max_tokens: u32,
    ) -> Result<(), Refusal> {
        let Some(r) = self.reqs.get(&req) else {
            return Err(Refusal {
                kind: RefusalKind::Invalid,
                message: "prefill without a request body".into(),
            });
        };
        // I1 on this node: the prompt must fit this pool (output pages live on the
        // decode node). Pages are taken in FIFO order by the engine.
        let limits = AdmissionLimits {
            context: self.engine.limits().context,
            ..self.engine.limits()
        };
        let mut probe = r.body.clone();
        probe.max_tokens = 1;
        limits.admit(probe).map_err(|e| refusal(&e))?;
        let needed = (prompt_tokens as usize).div_ceil(limits.page_size) * limits.page_size;
        if needed > limits.pool_tokens {
            return Err(refusal(&Rejection::PoolTooSmall {
                needed,
                capacity: limits.pool_tokens,
            }));
        }
        Ok(())
    }

    fn start_prefill(&mut self, req: ReqId, _tokens: u32, dest: &[DestPage]) {
        let Some(r) = self.reqs.get(&req) else {
            return;
        };
        let mut body = r.body.clone();
        body.max_tokens = 1;
        let Ok(admitted) = self.engine.limits().admit(body) else {
            return; // admit_and_alloc ran the same check
        };
        let to = r.decode;
        let fault = self.links.take_fault();
        if fault == Some(TransferFault::DuplicateCommit) {
            *self.duplicate_commit = Some(req);
        }
        let transport = self.links.transport(to, fault, dest);
        let tx = self.self_tx.clone();
        self.engine.enqueue_export(
            admitted,
            ExportJob {
                req: req.0,
                dest: dest.to_vec(),
                transport,
                done: Box::new(move |r| {
                    let _ = tx.send(PrefillCmd::Exported(req, r));
                }),
            },
        );
    }

    fn stop_prefill(&mut self, req: ReqId) {
        self.engine.abort_export(req.0);
    }

    fn flush(&mut self, req: ReqId) {
        // Exports flush inside the engine step; a stopped export has nothing queued.
        self.drained.push((req, self.flush_result.clone()));
    }

    fn release(&mut self, req: ReqId) {
        self.engine.abort_export(req.0);
    }
}

impl PrefillLoop {
    fn emit(&mut self, out: Vec<Output>) {
        for o in out {
            let Output::Send { to, msg } = o else {
                continue;
            };
            match to {
                Role::Decode => {
                    let req = msg.req();
                    let Some(r) = self.reqs.get(&req) else {
                        continue;
                    };
                    if self.duplicate_commit == Some(req) && matches!(msg, Msg::Commit { .. }) {
                        self.duplicate_commit = None;
                        self.links.to_decode(r.decode, msg.clone(), r.rng_pos);
                    }
                    self.links.to_decode(r.decode, msg, r.rng_pos);
                }
                _ => self.links.to_coordinator(msg),
            }
        }
    }

    fn run_proto(
        &mut self,
        engine: &mut Engine,
        flush_result: Result<(), String>,
        f: impl FnOnce(&mut PrefillNode, &mut PrefillEngineEnv<'_>, &mut Vec<Output>),
    ) {
        let mut out = Vec::new();
        let mut env = PrefillEngineEnv {
            engine,
            links: &self.links,
            self_tx: &self.self_tx,
            reqs: &self.reqs,
            drained: &mut self.drained,
            flush_result,
            duplicate_commit: &mut self.duplicate_commit,
        };
        f(&mut self.proto, &mut env, &mut out);
        self.emit(out);
        // Drains the engine already completed are reported in order.
        while !self.drained.is_empty() {
            let batch = std::mem::take(&mut self.drained);
            for (req, result) in batch {
                let mut out = Vec::new();
                let mut env = PrefillEngineEnv {
                    engine,
                    links: &self.links,
                    self_tx: &self.self_tx,
                    reqs: &self.reqs,
                    drained: &mut self.drained,
                    flush_result: Ok(()),
                    duplicate_commit: &mut self.duplicate_commit,
                };
                self.proto.on_drained(req, result, &mut env, &mut out);
                self.emit(out);
            }
        }
    }
}

impl NodeLoop for PrefillLoop {
    type Cmd = PrefillCmd;

    // After `Crash`, `stop()` ends the loop before another command is applied.
    fn on_cmd(&mut self, engine: &mut Engine, cmd: PrefillCmd) {
        match cmd {
            PrefillCmd::Control(msg, extra) => {
                if let (Msg::Prefill { req, .. }, Extra::Prefill { req: body, decode }) =
                    (&msg, extra)
                {
                    self.reqs.entry(*req).or_insert(PrefillReq {
                        body,
                        decode,
                        rng_pos: 0,
                    });
                }
                self.run_proto(engine, Ok(()), |p, env, out| p.on_msg(msg, env, out));
            }
            PrefillCmd::Exported(req, Ok(e)) => {
                if let Some(r) = self.reqs.get_mut(&req) {
                    r.rng_pos = e.rng_word_pos;
                }
                let checksums: Vec<u32> = e.pages.iter().map(|(_, c)| *c).collect();
                self.run_proto(engine, Ok(()), |p, env, out| {
                    p.on_computed(req, e.first_token, &checksums, env, out)
                });
            }
            PrefillCmd::Exported(req, Err(e)) => {
                let reason = e.to_string();
                self.run_proto(engine, Err(reason.clone()), |p, env, out| {
                    p.on_compute_failed(req, reason, env, out)
                });
            }
            PrefillCmd::Crash => self.crashed = true,
        }
    }

    fn stop(&self) -> bool {
        self.crashed
    }

    fn after_step(&mut self, _engine: &mut Engine) {
        let (proto, reqs) = (&mut self.proto, &mut self.reqs);
        self.tombstones
            .sweep(proto.records().states().map(|(r, _)| r).collect(), |r| {
                let gone = proto.records_mut().forget(r);
                if gone {
                    reqs.remove(&r);
                }
                gone
            });
    }
}

/// Forgets a node's terminal request records once no copy of a message for them
/// can still arrive. In this process every queue is FIFO and nothing is duplicated,
/// so a record only has to outlive the messages already queued; a minute is ample.
struct Tombstones {
    first_seen: HashMap<ReqId, Instant>,
    last_sweep: Instant,
}

/// How long a terminal record is kept.
const TOMBSTONE_TTL: Duration = Duration::from_secs(60);

impl Default for Tombstones {
    fn default() -> Self {
        Self {
            first_seen: HashMap::new(),
            last_sweep: Instant::now(),
        }
    }
}

impl Tombstones {
    /// Once a second: tries to forget (`forget` refuses non-terminal records) every
    /// record first seen over [`TOMBSTONE_TTL`] ago.
    fn sweep(&mut self, live: Vec<ReqId>, mut forget: impl FnMut(ReqId) -> bool) {
        let now = Instant::now();
        if now - self.last_sweep < Duration::from_secs(1) {
            return;
        }
        self.last_sweep = now;
        for r in &live {
            self.first_seen.entry(*r).or_insert(now);
        }
        self.first_seen
            .retain(|r, seen| !(now - *seen > TOMBSTONE_TTL && forget(*r)));
        self.first_seen.retain(|r, _| live.contains(r));
    }
}

// ---------------------------------------------------------------------------
// Coordinator
// ---------------------------------------------------------------------------

struct CoordReq {
    proto: Coordinator,
    body: GenerateRequest,
    sink: UnboundedSender<Event>,
    submitted: Instant,
    prefill: usize,
    decode: usize,
    prefill_down: bool,
    decode_down: bool,
    /// Last message from a node about this request (or its start).
    last_heard: Instant,
}

/// How often the coordinator looks for clients that went away and dead nodes.
const WATCH_INTERVAL: Duration = Duration::from_millis(5);
/// Silence after which the coordinator re-sends what its phase waits on (a lost
/// message; nodes answer duplicates from their records, never by acting twice).
const RETRANSMIT_AFTER: Duration = Duration::from_secs(5);

pub(crate) fn coordinate(nodes: Arc<dyn CoordLinks>, rx: mpsc::Receiver<CoordCmd>) {
    let mut reqs: HashMap<ReqId, CoordReq> = HashMap::new();
    let mut last_watch = Instant::now();
    loop {
        let cmd = if reqs.is_empty() {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        } else {
            match rx.recv_timeout(WATCH_INTERVAL) {
                Ok(c) => Some(c),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => return,
            }
        };
        match cmd {
            Some(CoordCmd::Start {
                req,
                body,
                sink,
                prefill,
                decode,
            }) => {
                let mut out = Vec::new();
                let proto = Coordinator::start(
                    req,
                    body.tenant,
                    body.prompt.len() as u32,
                    body.max_tokens as u32,
                    &mut out,
                );
                reqs.insert(
                    req,
                    CoordReq {
                        proto,
                        body,
                        sink,
                        submitted: Instant::now(),
                        prefill,
                        decode,
                        prefill_down: false,
                        decode_down: false,
                        last_heard: Instant::now(),
                    },
                );
                execute(&*nodes, &mut reqs, req, out);
            }
            Some(CoordCmd::FromNode(msg)) => {
                let req = msg.req();
                let Some(r) = reqs.get_mut(&req) else {
                    continue; // late duplicate for a request that is gone
                };
                r.last_heard = Instant::now();
                let mut out = Vec::new();
                r.proto.on_msg(msg, &mut out);
                execute(&*nodes, &mut reqs, req, out);
            }
            Some(CoordCmd::Stop) => return,
            None => {}
        }
        // Watch: clients that went away, nodes that died, messages lost.
        if last_watch.elapsed() < WATCH_INTERVAL {
            continue;
        }
        last_watch = Instant::now();
        let ids: Vec<ReqId> = reqs.keys().copied().collect();
        for req in ids {
            let Some(r) = reqs.get_mut(&req) else {
                continue;
            };
            let mut out = Vec::new();
            if !r.prefill_down && nodes.is_down(Role::Prefill, r.prefill) {
                r.prefill_down = true;
                r.proto.on_node_down(Role::Prefill, &mut out);
            }
            if !r.decode_down && nodes.is_down(Role::Decode, r.decode) {
                r.decode_down = true;
                r.proto.on_node_down(Role::Decode, &mut out);
            }
            if r.sink.is_closed() && r.proto.outcome().is_none() {
                r.proto.on_client_gone(&mut out);
            }
            if out.is_empty() && r.last_heard.elapsed() > RETRANSMIT_AFTER {
                r.last_heard = Instant::now();
                r.proto.on_timeout(&mut out);
            }
            if !out.is_empty() {
                execute(&*nodes, &mut reqs, req, out);
            }
        }
    }
}

/// Carries out a coordinator's outputs for `req`, in order.
fn execute(
    nodes: &dyn CoordLinks,
    reqs: &mut HashMap<ReqId, CoordReq>,
    req: ReqId,
    out: Vec<Output>,
) {
    for o in out {
        let Some(r) = reqs.get_mut(&req) else {
            return;
        };
        match o {
            Output::Send {
                to: Role::Decode,
                msg,
            } => {
                let extra = match msg {
                    Msg::Prealloc { .. } => Extra::Decode {
                        req: r.body.clone(),
                        sink: r.sink.clone(),
                        submitted: r.submitted,
                    },
                    _ => Extra::None,
                };
                if !nodes.to_decode(r.decode, msg, extra) {
                    tracing::debug!(?req, "decode node gone; the watcher reports it");
                }
            }
            Output::Send {
                to: Role::Prefill,
                msg,
            } => {
                let extra = match msg {
                    Msg::Prefill { .. } => Extra::Prefill {
                        req: r.body.clone(),
                        decode: r.decode,
                    },
                    _ => Extra::None,
                };
                if !nodes.to_prefill(r.prefill, msg, extra) {
                    tracing::debug!(?req, "prefill node gone; the watcher reports it");
                }
            }
            Output::Send { .. } => {}
            Output::Outcome(outcome) => {
                // Success and client aborts need no event here: the decode node
                // streamed the tokens and `Done`, or nobody is listening.
                let err = match outcome {
                    Outcome::Succeeded | Outcome::Aborted => None,
                    Outcome::Rejected(refusal) => Some(EngineError::Refused(refusal)),
                    Outcome::Failed(Failure::Decode(reason)) => {
                        Some(EngineError::Transfer(format!("decode failed: {reason}")))
                    }
                    Outcome::Failed(f) => Some(EngineError::Transfer(failure_text(&f))),
                };
                if let Some(e) = err {
                    let _ = r.sink.send(Event::Error(e));
                }
            }
            Output::Released => {
                nodes.counters().released.fetch_add(1, Ordering::Relaxed);
                nodes.released(req);
                reqs.remove(&req);
            }
        }
    }
}

fn failure_text(f: &Failure) -> String {
    match f {
        Failure::Commit(e) => format!("the decode node refused the commit: {e}"),
        Failure::Prefill(reason) => format!("prefill failed: {reason}"),
        Failure::Decode(reason) => format!("decode failed: {reason}"),
        Failure::NodeDown(role) => format!("the {role:?} node holding the request went down"),
    }
}
