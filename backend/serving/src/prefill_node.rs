//! A prefill node's loop: its engine and its protocol machine ([`PrefillNode`]) on one
//! thread, with the network off that thread.
//!
//! The engine computes a prompt; the loop copies its pages out (tag-checked, I3) and
//! tells the protocol `on_computed`; the protocol asks for a drain (`flush`), which
//! hands the pages to the [`TransferWorker`] of the destination decode node. The worker
//! puts them and flushes the transport (blocking on the network as long as it must),
//! then reports back with `Drained`; only then does the protocol release the source
//! pages and emit the `Commit` (I5, S2), which the same worker sends, after the puts. A
//! slow or stalled decode node therefore delays only the requests bound for it; the
//! engine keeps serving everyone else.

use crate::error::refusal;
use crate::links::{CommitExtra, ExpiryClock, ReplyTo, TransferFault};
use crate::metrics::NodeHandles;
use crate::node_loop::NodeLoop;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use tessera_engine::admission::prompt_fits;
use tessera_engine::kv_transfer::{ExportError, ExportedPage};
use tessera_engine::{Admitted, Engine, EngineError, FirstToken, GenerateRequest};
use tessera_model::kv::SeqId;
use tessera_transfer::protocol::{
    FailKind, FailReason, Msg, Output, PrefillEnv, PrefillNode, Refusal, RefusalKind, ReqId,
    RequestIo, Role,
};
use tessera_transfer::transport::{DestPage, KvTransport, TransportError};

/// How a prefill node reaches decode nodes. Called from transfer workers, never from
/// the engine thread, so these may block on the network.
pub(crate) trait PrefillLinks: Send + Sync {
    /// A transport that writes pages into decode node `decode`'s reserved pages
    /// `dest` (the request's destination pages), suffering `fault` (tests only).
    fn transport(
        &self,
        decode: usize,
        fault: Option<TransferFault>,
        dest: &[DestPage],
    ) -> Result<Box<dyn KvTransport>, TransportError>;
    /// Sends a control message (a `Commit`, with the sampler position and the cached
    /// prompt tokens) to decode node `decode`. Returns `false` when it is unreachable.
    fn to_decode(&self, decode: usize, msg: Msg, extra: CommitExtra) -> bool;
    /// The fault the next transfer suffers (fault-injection tests only).
    fn take_fault(&self) -> Option<TransferFault> {
        None
    }
}

/// A prefill node's commands.
// Commands are moved through a channel one at a time; the request body (with its
// scheduling and cache fields) is the large variant and the common one.
#[allow(clippy::large_enum_variant)]
pub(crate) enum PrefillCmd {
    /// From a coordinator: `Prefill` (with the body and the decode node chosen), `Abort`.
    FromCoordinator {
        msg: Msg,
        reply: ReplyTo,
        /// The body, the decode node chosen, the W3C `traceparent` (traces on).
        body: Option<(GenerateRequest, usize, Option<String>)>,
    },
    /// A transfer worker drained (or failed) every put of a request.
    Drained(ReqId, Result<(), FailReason>),
    /// The coordinator of this request is gone (its connection closed).
    CoordinatorLost(ReqId),
    /// Decode node `decode` holds the request's pages quarantined (its coordinator is
    /// gone) and asks whether this node is quiet for it (`QuietQuery`); the answer,
    /// if any, goes to that decode node.
    QuietQuery { req: ReqId, decode: usize },
    /// The node began draining: the protocol refuses new requests from now on.
    Drain,
    /// A drain's deadline passed: every request still held is aborted as if its
    /// coordinator were gone (stop, drain the writes, release).
    EndAll,
    /// Stop at once, as a crash would (tests).
    Crash,
    /// Runs on the engine between two steps (a tenant's cache purge).
    WithEngine(Box<dyn FnOnce(&mut Engine) + Send>),
}

/// What the driver keeps per request, attached to the protocol's record
/// ([`tessera_transfer::protocol::Records`]) until the protocol forgets it: to the
/// end the decode node's index (a late `WriterQuiet` needs it) and the commit's
/// extras.
struct PrefillRecord {
    reply: ReplyTo,
    /// The request as the coordinator sent it, until this node admits it.
    body: Option<GenerateRequest>,
    /// The request once admitted here (I1 against this node's pool, for the prompt
    /// and its first token), until its prefill is queued: the one admission of the
    /// request on this node.
    admitted: Option<Admitted>,
    /// The decode node that reserved the destination pages.
    decode: usize,
    dest: Vec<DestPage>,
    /// The sampler position after the first token (travels with the commit).
    first: Option<FirstToken>,
    /// Prompt tokens taken from this node's prefix cache (travels with the commit).
    cached_tokens: usize,
    /// Of `cached_tokens`, those restored from its lower tiers.
    cached_tiers: tessera_engine::CachedTiers,
    /// The copied-out pages, from `on_computed` until the drain takes them.
    export: Option<Vec<ExportedPage>>,
    /// Set on abort: the worker skips the puts it has not issued yet.
    cancel: Arc<AtomicBool>,
    fault: Option<TransferFault>,
    /// The request's trace parent, and the span of its current phase (`prefill`
    /// until computed, `transfer` until drained); dropping ends it.
    trace: Option<String>,
    span: Option<tracing::Span>,
}

fn seq_of(req: ReqId) -> SeqId {
    SeqId(req.0)
}

/// Jobs for a decode node's transfer worker, executed in order.
enum Job {
    /// Put these pages, flush, report `Drained`.
    Transfer {
        req: ReqId,
        pages: Vec<ExportedPage>,
        cancel: Arc<AtomicBool>,
        fault: Option<TransferFault>,
        done: mpsc::Sender<PrefillCmd>,
    },
    /// Send a control message (after the puts queued before it).
    Send { msg: Msg, extra: CommitExtra },
}

/// How often a prefill node renews the decode reservations of the requests it works
/// on (well inside the decode node's lease).
const RENEW_EVERY: std::time::Duration = std::time::Duration::from_secs(5);

/// Jobs a worker queues before the node fails new transfers to that decode node.
const WORKER_QUEUE: usize = 256;

/// The thread that moves one decode node's pages and commits, in order.
struct TransferWorker {
    tx: mpsc::SyncSender<Job>,
}

impl TransferWorker {
    fn spawn(links: Arc<dyn PrefillLinks>, decode: usize, metrics: NodeHandles) -> Self {
        let (tx, rx) = mpsc::sync_channel::<Job>(WORKER_QUEUE);
        let spawned = std::thread::Builder::new()
            .name(format!("tessera-transfer-{decode}"))
            .spawn(move || {
                for job in rx {
                    match job {
                        Job::Transfer {
                            req,
                            pages,
                            cancel,
                            fault,
                            done,
                        } => {
                            let started = std::time::Instant::now();
                            let result = transfer(&*links, decode, req, &pages, &cancel, fault)
                                .map_err(|e| FailReason::new(FailKind::Transport, e.to_string()));
                            if let Ok(bytes) = result {
                                metrics.transferred(bytes, started.elapsed());
                            }
                            let result = result.map(|_| ());
                            let _ = done.send(PrefillCmd::Drained(req, result));
                        }
                        Job::Send { msg, extra } => {
                            if !links.to_decode(decode, msg, extra) {
                                tracing::warn!(decode, "decode node unreachable for a commit");
                            }
                        }
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start a transfer worker");
        }
        Self { tx }
    }
}

/// Puts every page (until cancelled) and flushes: on return nothing issued can still
/// land. Returns the bytes put.
fn transfer(
    links: &dyn PrefillLinks,
    decode: usize,
    req: ReqId,
    pages: &[ExportedPage],
    cancel: &AtomicBool,
    fault: Option<TransferFault>,
) -> Result<u64, TransportError> {
    let dest: Vec<DestPage> = pages.iter().map(|p| p.dest).collect();
    let mut t = links.transport(decode, fault, &dest)?;
    let mut bytes = 0u64;
    for p in pages {
        if cancel.load(Ordering::Acquire) {
            break;
        }
        t.put(req.0, p.dest, &p.bytes)?;
        bytes += p.bytes.len() as u64;
    }
    t.flush()?;
    Ok(bytes)
}

/// Why a computed prefill cannot be committed: the engine's compute failed (or the
/// request expired in its queue), or the export's tag check did.
#[derive(Debug, thiserror::Error)]
enum Computed {
    #[error(transparent)]
    Engine(EngineError),
    #[error(transparent)]
    Export(ExportError),
}

/// The prefill node's [`PrefillEnv`] over its engine and transfer workers.
struct PrefillEngineEnv<'a> {
    engine: &'a mut Engine,
    node: &'a mut NodeIo,
}

impl RequestIo for PrefillRecord {
    fn on_end(&mut self) {
        self.export = None;
        self.dest = Vec::new();
        self.body = None;
        self.admitted = None;
        self.span = None;
    }
}

/// The node's I/O handles (workers, its own command queue, drains done at once).
struct NodeIo {
    links: Arc<dyn PrefillLinks>,
    workers: HashMap<usize, TransferWorker>,
    self_tx: mpsc::Sender<PrefillCmd>,
    /// Drains with nothing in flight, reported right after the protocol call.
    drained_now: Vec<(ReqId, Result<(), FailReason>)>,
    /// This node's series (transfer workers count bytes and time).
    metrics: NodeHandles,
}

impl NodeIo {
    fn worker(&mut self, decode: usize) -> &TransferWorker {
        let links = self.links.clone();
        let metrics = self.metrics.clone();
        self.workers
            .entry(decode)
            .or_insert_with(|| TransferWorker::spawn(links, decode, metrics))
    }

    /// Queues `job` for decode node `decode`'s worker; false when its queue is full
    /// or the worker is gone.
    fn submit(&mut self, decode: usize, job: Job) -> bool {
        match self.worker(decode).tx.try_send(job) {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(decode, error = %e, "transfer worker cannot take the job");
                if matches!(e, mpsc::TrySendError::Disconnected(_)) {
                    self.workers.remove(&decode);
                }
                false
            }
        }
    }
}

impl PrefillEnv for PrefillEngineEnv<'_> {
    type Attached = PrefillRecord;

    fn pages_for(&self, tokens: u32) -> usize {
        self.engine.kv().pages_for(tokens as usize)
    }

    fn admit_and_alloc(
        &mut self,
        _req: ReqId,
        record: Option<&mut PrefillRecord>,
        _tenant: u64,
        _prompt_tokens: u32,
        _max_tokens: u32,
    ) -> Result<(), Refusal> {
        let no_body = || Refusal {
            kind: RefusalKind::Invalid,
            message: "prefill without a request body".into(),
        };
        let Some(r) = record else {
            return Err(no_body());
        };
        if r.admitted.is_some() {
            return Ok(());
        }
        let Some(mut body) = r.body.take() else {
            return Err(no_body());
        };
        // I1 on this node: the prompt and the first token must fit this pool (the
        // output's pages live on the decode node). Pages are taken in FIFO order by
        // the engine.
        let limits = self.engine.limits();
        body.max_tokens = 1;
        let admitted = limits.admit(body).map_err(|e| refusal(&e))?;
        prompt_fits(&admitted, limits.page_size, limits.pool_tokens).map_err(|e| refusal(&e))?;
        r.admitted = Some(admitted);
        Ok(())
    }

    fn start_prefill(
        &mut self,
        req: ReqId,
        record: Option<&mut PrefillRecord>,
        _tokens: u32,
        dest: &[DestPage],
    ) {
        let fault = self.node.links.take_fault();
        let Some(r) = record else {
            return;
        };
        let Some(admitted) = r.admitted.take() else {
            return; // refused by admit_and_alloc: the protocol never starts it
        };
        r.dest = dest.to_vec();
        r.fault = fault;
        self.engine.enqueue_prefill(admitted, seq_of(req));
    }

    fn stop_prefill(&mut self, req: ReqId, record: Option<&mut PrefillRecord>) {
        if let Some(r) = record {
            r.cancel.store(true, Ordering::Release);
        }
        // Nothing was put yet while computing: its pages can go at once.
        self.engine.release_prefill(seq_of(req));
    }

    fn flush(&mut self, req: ReqId, record: Option<&mut PrefillRecord>) {
        let job = record.and_then(|r| {
            let pages = r.export.take()?;
            Some((
                r.decode,
                Job::Transfer {
                    req,
                    pages,
                    cancel: r.cancel.clone(),
                    fault: r.fault,
                    done: self.node.self_tx.clone(),
                },
            ))
        });
        match job {
            Some((decode, job)) => {
                if !self.node.submit(decode, job) {
                    let e = FailReason::new(FailKind::Transport, "the transfer queue is full");
                    self.node.drained_now.push((req, Err(e)));
                }
            }
            // Nothing was handed to a worker: nothing can be in flight.
            None => self.node.drained_now.push((req, Ok(()))),
        }
    }

    fn release(&mut self, req: ReqId) {
        self.engine.release_prefill(seq_of(req));
    }
}

/// A prefill node's protocol loop.
pub(crate) struct PrefillLoop {
    proto: PrefillNode<PrefillRecord>,
    io: NodeIo,
    crashed: bool,
    last_renew: std::time::Instant,
    clock: ExpiryClock,
    /// The fingerprint of the model this node computes with (sent with each commit).
    model: [u8; 32],
    /// A draining decode node's writer: each request is a move (logged as one).
    mover: bool,
}

impl PrefillLoop {
    /// A prefill node's loop; `self_tx` is its own command queue (transfer workers
    /// report through it); transfers count into `metrics`; `model` is its engine's
    /// model fingerprint.
    pub(crate) fn new(
        links: Arc<dyn PrefillLinks>,
        self_tx: mpsc::Sender<PrefillCmd>,
        metrics: NodeHandles,
        model: [u8; 32],
    ) -> Self {
        Self {
            model,
            proto: PrefillNode::with_attachments(),
            io: NodeIo {
                links,
                workers: HashMap::new(),
                self_tx,
                drained_now: Vec::new(),
                metrics,
            },
            crashed: false,
            last_renew: std::time::Instant::now(),
            clock: ExpiryClock::new(),
            mover: false,
        }
    }

    /// Whether the node holds a record (live or a tombstone) of `req`.
    pub(crate) fn knows(&self, req: ReqId) -> bool {
        self.proto.records().state(req).is_some()
    }

    /// This loop is a decode node's writer: it moves drained requests' KV.
    pub(crate) fn moving(mut self) -> Self {
        self.mover = true;
        self
    }

    /// Runs `f` on the protocol with the engine as its environment, sends what it
    /// emitted, then reports drains that completed at once, in order.
    fn with_proto(
        &mut self,
        engine: &mut Engine,
        reply: Option<&ReplyTo>,
        f: impl FnOnce(&mut PrefillNode<PrefillRecord>, &mut PrefillEngineEnv<'_>, &mut Vec<Output>),
    ) {
        let mut out = Vec::new();
        {
            let mut env = PrefillEngineEnv {
                engine: &mut *engine,
                node: &mut self.io,
            };
            f(&mut self.proto, &mut env, &mut out);
        }
        self.emit(reply, out);
        while !self.io.drained_now.is_empty() {
            for (req, result) in std::mem::take(&mut self.io.drained_now) {
                let mut out = Vec::new();
                {
                    let mut env = PrefillEngineEnv {
                        engine: &mut *engine,
                        node: &mut self.io,
                    };
                    self.proto.on_drained(req, result, &mut env, &mut out);
                }
                self.emit(None, out);
            }
        }
    }

    fn emit(&mut self, reply: Option<&ReplyTo>, out: Vec<Output>) {
        for o in out {
            let Output::Send { to, msg } = o else {
                continue;
            };
            match to {
                Role::Decode => {
                    let Some(r) = self.proto.records().attached(msg.req()) else {
                        continue;
                    };
                    let decode = r.decode;
                    let extra = CommitExtra {
                        rng_pos: r.first.as_ref().map_or(0, |f| f.rng_word_pos),
                        logprobs: r.first.as_ref().and_then(|f| f.logprobs.clone()),
                        cached_tokens: r.cached_tokens,
                        cached_tiers: r.cached_tiers,
                        model: Some(self.model),
                    };
                    let duplicate = r.fault == Some(TransferFault::DuplicateCommit)
                        && matches!(msg, Msg::Commit { .. });
                    let mut msg = msg;
                    if let (
                        Some(TransferFault::FirstTokenOutOfVocab),
                        Msg::Commit { first_token, .. },
                    ) = (r.fault, &mut msg)
                    {
                        *first_token = u32::MAX;
                    }
                    let copies = if duplicate { 2 } else { 1 };
                    for _ in 0..copies {
                        let job = Job::Send {
                            msg: msg.clone(),
                            extra: extra.clone(),
                        };
                        if !self.io.submit(decode, job) {
                            tracing::warn!(req = ?msg.req(), "commit not queued");
                        }
                    }
                }
                _ => {
                    let link = reply.cloned().or_else(|| {
                        let r = self.proto.records().attached(msg.req());
                        r.map(|r| r.reply.clone())
                    });
                    if let Some(l) = link {
                        l.send(msg);
                    }
                }
            }
        }
    }

    /// Every few seconds: a renewal of the decode reservation of every request still
    /// being computed or drained here, so its lease does not run out while it waits
    /// for this node.
    fn renew_leases(&mut self) {
        if self.last_renew.elapsed() < RENEW_EVERY {
            return;
        }
        self.last_renew = std::time::Instant::now();
        let working: Vec<(ReqId, usize)> = self
            .proto
            .records()
            .live()
            .map(|(req, _, r)| (req, r.decode))
            .collect();
        for (req, decode) in working {
            let job = Job::Send {
                msg: Msg::Renew { req },
                extra: CommitExtra::default(),
            };
            let _ = self.io.submit(decode, job);
        }
    }

    /// Prefills the engine finished: their pages are copied out and the protocol
    /// hears `on_computed` (or `on_compute_failed`).
    fn computed(&mut self, engine: &mut Engine) {
        for done in engine.take_prefilled() {
            let req = ReqId(done.seq.0);
            let Some(r) = self.proto.records_mut().attached_mut(req) else {
                engine.release_prefill(done.seq);
                continue;
            };
            r.cached_tokens = done.cached_tokens;
            r.cached_tiers = done.cached_tiers;
            let exported = done.result.map_err(Computed::Engine).and_then(|first| {
                let token = first.token;
                r.first = Some(first);
                engine
                    .export_pages(done.seq, &r.dest)
                    .map(|p| (token, p))
                    .map_err(Computed::Export)
            });
            match exported {
                Ok((first_token, pages)) => {
                    if self.mover {
                        // Like the gateway's restarts: operators see what a drain moved.
                        tracing::warn!(
                            ?req,
                            pages = pages.len(),
                            cached_tokens = done.cached_tokens,
                            "moving a drained request's KV to another decode node"
                        );
                    }
                    let sums: Vec<u32> = pages.iter().map(|p| p.checksum).collect();
                    r.export = Some(pages);
                    r.span = crate::telemetry::child_span("transfer", req.0, r.trace.as_deref());
                    self.with_proto(engine, None, |p, env, out| {
                        p.on_computed(req, first_token, &sums, env, out)
                    });
                }
                Err(e) => {
                    let kind = match &e {
                        Computed::Engine(EngineError::Integrity(_))
                        | Computed::Export(ExportError::Integrity(_)) => FailKind::Integrity,
                        Computed::Engine(EngineError::BatchQueueTimeout { .. }) => FailKind::Busy,
                        _ => FailKind::Internal,
                    };
                    let reason = FailReason::new(kind, e.to_string());
                    self.with_proto(engine, None, |p, env, out| {
                        p.on_compute_failed(req, reason, env, out)
                    });
                }
            }
        }
    }

    fn expire_tombstones(&mut self) {
        let records = self.proto.records_mut();
        self.clock.tick(|now, ttl| {
            records.expire(now, ttl);
        });
    }
}

impl NodeLoop for PrefillLoop {
    type Cmd = PrefillCmd;

    // After `Crash`, `stop()` ends the loop before another command is applied.
    fn on_cmd(&mut self, engine: &mut Engine, cmd: PrefillCmd) {
        match cmd {
            PrefillCmd::FromCoordinator { msg, reply, body } => {
                let req = msg.req();
                if !matches!(msg, Msg::Prefill { .. } | Msg::Abort { .. }) {
                    tracing::warn!(?req, "a coordinator may only send Prefill or Abort");
                    return;
                }
                let mut attached = None;
                let known = self.proto.records().state(req).is_some();
                match (self.proto.records_mut().attached_mut(req), body) {
                    (Some(r), _) => r.reply = reply.clone(),
                    (None, Some((body, decode, trace)))
                        if !known && matches!(msg, Msg::Prefill { .. }) =>
                    {
                        attached = Some(PrefillRecord {
                            reply: reply.clone(),
                            body: Some(body),
                            admitted: None,
                            decode,
                            dest: Vec::new(),
                            first: None,
                            cached_tokens: 0,
                            cached_tiers: Default::default(),
                            export: None,
                            cancel: Arc::new(AtomicBool::new(false)),
                            fault: None,
                            span: crate::telemetry::child_span("prefill", req.0, trace.as_deref()),
                            trace,
                        });
                    }
                    _ => {}
                }
                self.with_proto(engine, Some(&reply), |p, env, out| {
                    p.on_msg(msg, attached, env, out)
                });
            }
            PrefillCmd::Drained(req, result) => {
                if let Some(r) = self.proto.records_mut().attached_mut(req) {
                    r.span = None;
                }
                self.with_proto(engine, None, |p, env, out| {
                    p.on_drained(req, result, env, out)
                });
            }
            PrefillCmd::CoordinatorLost(req) => {
                self.with_proto(engine, None, |p, env, out| {
                    p.on_coordinator_lost(req, env, out)
                });
            }
            PrefillCmd::QuietQuery { req, decode } => {
                let mut out = Vec::new();
                self.proto.on_quiet_query(req, &mut out);
                for o in out {
                    if let Output::Send { msg, .. } = o {
                        // Through the asker's worker: after every put queued to it.
                        let job = Job::Send {
                            msg,
                            extra: CommitExtra::default(),
                        };
                        if !self.io.submit(decode, job) {
                            tracing::warn!(?req, decode, "quiet answer not queued");
                        }
                    }
                }
            }
            PrefillCmd::Drain => self.proto.begin_drain(),
            PrefillCmd::EndAll => {
                // Every request that came with a body, tombstones included (each is
                // told to its decode node as quiet again).
                let records = self.proto.records();
                let held: Vec<ReqId> = records
                    .states()
                    .filter(|(req, _)| records.attached(*req).is_some())
                    .map(|(req, _)| req)
                    .collect();
                for req in held {
                    self.with_proto(engine, None, |p, env, out| {
                        p.on_coordinator_lost(req, env, out)
                    });
                }
            }
            PrefillCmd::Crash => self.crashed = true,
            PrefillCmd::WithEngine(f) => f(engine),
        }
        self.expire_tombstones();
    }

    fn stop(&self) -> bool {
        self.crashed
    }

    fn live(&self) -> usize {
        // A record whose protocol state is terminal holds nothing.
        self.proto.records().live_len()
    }

    fn after_step(&mut self, engine: &mut Engine) {
        self.computed(engine);
        self.expire_tombstones();
        self.renew_leases();
    }

    /// While it holds requests (some may only wait for their transfer to drain, with
    /// the engine idle), the loop wakes to renew their decode leases.
    fn timer(&self) -> Option<std::time::Duration> {
        (self.live() > 0).then_some(std::time::Duration::from_secs(1))
    }
}
