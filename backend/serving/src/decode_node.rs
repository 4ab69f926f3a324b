//! A decode node's loop: its engine and its protocol machine ([`DecodeNode`]) on one
//! thread. Every decision about a request (admit, wait for pages, reserve, verify the
//! commit, start, fail, abort, forget) is the protocol's; this file turns commands
//! into protocol calls, gives the protocol the engine as its [`DecodeEnv`], and sends
//! what the protocol emits to the request's coordinator.
//!
//! Per request the node keeps one record, the protocol's ([`Records`]): its
//! lifecycle state, with a [`DecodeRecord`] attached (its reply link and, until it
//! is adopted, its body and event sink). The body, the admission proof and the trace
//! span go when the state turns terminal ([`RequestIo::on_end`]); the reply link and
//! the writer's name stay with the tombstone until the protocol forgets it.
//!
//! [`Records`]: tessera_transfer::protocol::Records

use crate::error::refusal;
use crate::link_security::short_fingerprint;
use crate::links::{CommitExtra, ExpiryClock, PdCounters, ReplyTo, WriterLink};
use crate::metrics::NodeHandles;
use crate::node_loop::NodeLoop;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_engine::kv_transfer::Import;
use tessera_engine::sink::EventSink;
use tessera_engine::{Admitted, Engine, EngineError, GenerateRequest, SeqEnd};
use tessera_model::kv::SeqId;
use tessera_transfer::inproc::PageLanding;
use tessera_transfer::protocol::{
    CommitError, DecodeEnv, DecodeNode, DecodeOutcome, DecodeReserveError, DecodeState, FailKind,
    FailReason, Msg, Output, Refusal, RefusalKind, ReqId, RequestIo, RequestState, Role,
};
use tessera_transfer::transport::DestPage;

/// A request's body as the decode node receives it with `Prealloc`: what it admits,
/// later decodes, and where the tokens go.
pub(crate) struct RequestBody {
    /// Taken when the node admits it (the proof is kept in the record instead).
    pub(crate) req: Option<GenerateRequest>,
    pub(crate) sink: Box<dyn EventSink>,
    pub(crate) submitted: Instant,
    /// The prefill node the coordinator assigned (its writer), when known: pages and
    /// the commit are accepted from it alone.
    pub(crate) writer: Option<String>,
    /// The request's W3C `traceparent` (traces on).
    pub(crate) trace: Option<String>,
}

/// How long a reservation waits for its commit or a renewal before its lease runs out.
pub(crate) const LEASE: Duration = Duration::from_secs(30);

/// How often the node asks the writer of a reservation quarantined for a lost
/// coordinator again whether it is quiet (the first `QuietQuery` goes out with the
/// quarantine, and when the writer's link opens).
const ASK_EVERY: Duration = Duration::from_secs(1);

/// How long an idle node loop waits for a command while it holds requests, before it
/// runs its timers (leases, quiet queries).
const TIMER: Duration = Duration::from_secs(1);

/// A decode node's commands.
pub(crate) enum DecodeCmd {
    /// From a coordinator: `Prealloc` (with the body), `Abort`, `Poll`.
    FromCoordinator {
        msg: Msg,
        reply: ReplyTo,
        /// Boxed: a body is much larger than the other commands.
        body: Option<Box<RequestBody>>,
    },
    /// From a prefill node: `Commit` (with the sampler position after the first
    /// token and the prompt tokens the prefill node took from its cache), `Renew`,
    /// `WriterQuiet`.
    FromPrefill {
        msg: Msg,
        extra: CommitExtra,
        from: WriterLink,
    },
    /// A page write (in-process or TCP transport).
    Land {
        landing: PageLanding,
        from: WriterLink,
    },
    /// Link `id` of prefill node `name` opened (`to`: where the node asks that writer
    /// whether it is quiet for a quarantined reservation) or closed (`None`). The
    /// writer is gone (nothing it issued can land any more) only once every link of
    /// it closed: across a reconnect its new link may be up before the old one is
    /// noticed closed.
    WriterLink {
        name: String,
        id: u64,
        to: Option<ReplyTo>,
    },
    /// Runs once every earlier command was applied (a TCP flush acknowledgement).
    AfterEarlier(Box<dyn FnOnce() + Send>),
    /// The coordinator of this request is gone (its connection closed).
    CoordinatorLost(ReqId),
    /// The node began draining: the protocol refuses new requests from now on, and
    /// those waiting for pages at once (their coordinators start them elsewhere).
    Drain,
    /// A drain's deadline passed: running sequences end with `reason` (their
    /// coordinators hear `Finished` with the failure); requests not decoding yet are
    /// aborted as if their coordinator were gone.
    EndAll(FailReason),
    /// A drain that moves KV (issue 36): every decoding sequence ends now, and each
    /// one that commits later as soon as it decodes, with its computed pages kept in
    /// the prefix cache for its next attempt to move (failure `Moving`; `Drained`
    /// when nothing could be kept); requests still waiting for their commit are left
    /// to commit first. The message is the failure's.
    MoveAll(String),
    /// Stop at once, as a crash would (tests).
    Crash,
    /// Run on the engine between steps (fault-injection tests: a planted block-table
    /// bug).
    WithEngine(Box<dyn FnOnce(&mut Engine) + Send>),
}

/// The requests a draining decode node ended and keeps the KV of until their moves
/// start (by their ids before the move).
pub(crate) type KeptForMoves = Arc<std::sync::Mutex<HashSet<ReqId>>>;

/// What the driver keeps per request beside the protocol's record.
struct DecodeRecord {
    reply: ReplyTo,
    /// Until adopted.
    body: Option<RequestBody>,
    /// The body's request once this node admitted it (I1 against its own pool),
    /// until adopted: the one admission of the request on this node.
    admitted: Option<Admitted>,
    /// The assigned prefill node, if the coordinator named one.
    writer: Option<String>,
    /// When the reservation's lease was last granted or renewed.
    lease_from: Instant,
    /// The request's trace parent, and the span of its current phase (`queue` until
    /// the pages are reserved, `decode` from adoption to the end); dropping ends it.
    trace: Option<String>,
    span: Option<tracing::Span>,
}

/// The sequence id a request's pages carry on this node: the request id, unique
/// across coordinators.
fn seq_of(req: ReqId) -> SeqId {
    SeqId(req.0)
}

impl RequestIo for DecodeRecord {
    fn on_end(&mut self) {
        self.body = None;
        self.admitted = None;
        self.span = None;
    }
}

/// The decode node's [`DecodeEnv`] over its engine.
struct DecodeEngineEnv<'a> {
    engine: &'a mut Engine,
    commit: CommitExtra,
    gone_writers: &'a HashSet<String>,
}

impl DecodeEnv for DecodeEngineEnv<'_> {
    type Attached = DecodeRecord;

    fn admit(
        &mut self,
        _req: ReqId,
        record: Option<&mut DecodeRecord>,
        _tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
    ) -> Result<(), Refusal> {
        let no_body = || Refusal {
            kind: RefusalKind::Invalid,
            message: "prealloc without a request body".into(),
        };
        let Some(record) = record else {
            return Err(no_body());
        };
        if record.admitted.is_some() {
            return Ok(());
        }
        let Some(body) = record.body.as_mut().and_then(|b| b.req.take()) else {
            return Err(no_body());
        };
        // The counts the protocol carries must be the body's (a frame cannot claim a
        // small reservation for a large request).
        if body.prompt.len() != prompt_tokens as usize || body.max_tokens != max_tokens as usize {
            return Err(Refusal {
                kind: RefusalKind::Invalid,
                message: format!(
                    "prealloc for {prompt_tokens} prompt + {max_tokens} output tokens carries a body of {} + {}",
                    body.prompt.len(),
                    body.max_tokens
                ),
            });
        }
        // I1 on this node, against its own pool; the proof is kept for adoption.
        let admitted = self.engine.admit(body).map_err(|r| refusal(&r))?;
        record.admitted = Some(admitted);
        Ok(())
    }

    fn reserve(
        &mut self,
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
    ) -> Result<Vec<DestPage>, DecodeReserveError> {
        let tokens = prompt_tokens as usize + max_tokens as usize;
        if !self.engine.kv().can_reserve(tokens) {
            return Err(DecodeReserveError::NoRoomYet);
        }
        self.engine
            .reserve_import(
                seq_of(req),
                tenant,
                prompt_tokens as usize,
                max_tokens as usize,
            )
            .map_err(|e| {
                DecodeReserveError::Refused(Refusal {
                    kind: RefusalKind::Busy,
                    message: e.to_string(),
                })
            })
    }

    fn landed_checksum(&self, _req: ReqId, dest: DestPage) -> Option<u32> {
        self.engine.landed_checksum(dest)
    }

    fn start_decode(
        &mut self,
        req: ReqId,
        record: Option<&mut DecodeRecord>,
        _tokens: u32,
        first_token: u32,
        _pages: &[DestPage],
    ) -> Result<(), FailReason> {
        let internal = |m: String| FailReason::new(FailKind::Internal, m);
        if let Some(theirs) = self.commit.model {
            let mine = self.engine.model_fingerprint();
            if theirs != mine {
                return Err(FailReason::new(
                    FailKind::Integrity,
                    format!(
                        "the commit's KV was computed by another model (fingerprint {}) than this node serves ({})",
                        short_fingerprint(&theirs),
                        short_fingerprint(&mine)
                    ),
                ));
            }
        }
        let vocab = self.engine.limits().vocab;
        if first_token as usize >= vocab {
            return Err(FailReason::new(
                FailKind::Integrity,
                format!(
                    "the commit's first token {first_token} is outside the vocabulary of {vocab}"
                ),
            ));
        }
        let record = record.ok_or_else(|| internal("no record of the request".into()))?;
        let (body, admitted) = record
            .body
            .take()
            .zip(record.admitted.take())
            .ok_or_else(|| internal("no admitted request body to decode".into()))?;
        record.span = crate::telemetry::child_span("decode", req.0, record.trace.as_deref());
        self.engine.adopt(
            seq_of(req),
            Import {
                req: admitted,
                first_token,
                seed_fallback: req.0,
                rng_word_pos: self.commit.rng_pos,
                logprobs: self.commit.logprobs.take(),
                cached_tokens: self.commit.cached_tokens,
                cached_tiers: self.commit.cached_tiers,
                sink: body.sink,
                submitted: body.submitted,
            },
        );
        Ok(())
    }

    fn release(&mut self, req: ReqId) {
        self.engine.release_seq(seq_of(req));
    }

    fn writer_gone(&self, _req: ReqId, record: Option<&DecodeRecord>) -> bool {
        record
            .and_then(|r| r.writer.as_ref())
            .is_some_and(|w| self.gone_writers.contains(w))
    }
}

/// A decode node's protocol loop.
pub(crate) struct DecodeLoop {
    proto: DecodeNode<DecodeRecord>,
    counters: Arc<PdCounters>,
    metrics: NodeHandles,
    crashed: bool,
    clock: ExpiryClock,
    /// The open links of each prefill node, by link id (the newest last).
    writer_links: HashMap<String, BTreeMap<u64, ReplyTo>>,
    /// Prefill nodes that had a link and have none open now.
    gone_writers: HashSet<String>,
    last_lease_check: Instant,
    last_ask: Instant,
    /// Requests a drain ended whose KV this node keeps for a move
    /// ([`Self::keeping_moves`]); `None`: the node does not move KV.
    kept: Option<KeptForMoves>,
    /// Set by [`DecodeCmd::MoveAll`]: the drain's message for the sequences it ends.
    moving: Option<String>,
}

impl DecodeLoop {
    /// A decode node's loop, counting into `counters` (the deployment's) and
    /// `metrics` (this node's series).
    pub(crate) fn new(counters: Arc<PdCounters>, metrics: NodeHandles) -> Self {
        Self {
            proto: DecodeNode::with_attachments(),
            counters,
            metrics,
            crashed: false,
            clock: ExpiryClock::new(),
            writer_links: HashMap::new(),
            gone_writers: HashSet::new(),
            last_lease_check: Instant::now(),
            last_ask: Instant::now(),
            kept: None,
            moving: None,
        }
    }

    /// Whether the node holds a record (live or a tombstone) of `req`.
    pub(crate) fn knows(&self, req: ReqId) -> bool {
        self.proto.records().state(req).is_some()
    }

    /// A drain records in `kept` each request it ends whose pages stay cached for a
    /// move; whoever takes the move's `Prefill` removes it.
    pub(crate) fn keeping_moves(mut self, kept: KeptForMoves) -> Self {
        self.kept = Some(kept);
        self
    }

    /// Runs `f` on the protocol with the engine as its environment, then sends what it
    /// emitted (to `reply`, else to the request's recorded coordinator) and offers
    /// freed pages to waiting requests.
    fn with_proto<R>(
        &mut self,
        engine: &mut Engine,
        req: ReqId,
        reply: Option<&ReplyTo>,
        commit: CommitExtra,
        f: impl FnOnce(&mut DecodeNode<DecodeRecord>, &mut DecodeEngineEnv<'_>, &mut Vec<Output>) -> R,
    ) -> R {
        let mut out = Vec::new();
        let r = {
            let mut env = DecodeEngineEnv {
                engine: &mut *engine,
                commit,
                gone_writers: &self.gone_writers,
            };
            f(&mut self.proto, &mut env, &mut out)
        };
        let reply = reply
            .cloned()
            .or_else(|| self.proto.records().attached(req).map(|r| r.reply.clone()));
        self.emit(reply.as_ref(), out);
        self.offer_capacity(engine);
        r
    }

    /// Ends a request's `queue` span once its pages are reserved.
    fn reserved(&mut self, msg: &Msg) {
        if let Msg::Descriptor { req, .. } = msg {
            if let Some(r) = self.proto.records_mut().attached_mut(*req) {
                r.span = None;
            }
        }
    }

    fn emit(&mut self, reply: Option<&ReplyTo>, out: Vec<Output>) {
        for o in out {
            if let Output::Send { to, msg } = o {
                if to == Role::Prefill {
                    self.to_writer(msg);
                    continue;
                }
                self.reserved(&msg);
                match reply {
                    Some(r) => {
                        r.send(msg);
                    }
                    None => {
                        tracing::debug!(req = ?msg.req(), "reply for a request without a coordinator link")
                    }
                }
            }
        }
    }

    /// Reservations for requests waiting for pages, oldest first.
    fn offer_capacity(&mut self, engine: &mut Engine) {
        if self.proto.waiting().next().is_none() {
            return;
        }
        let mut out = Vec::new();
        {
            let mut env = DecodeEngineEnv {
                engine,
                commit: CommitExtra::default(),
                gone_writers: &self.gone_writers,
            };
            self.proto.on_capacity(&mut env, &mut out);
        }
        self.reply_each(out);
    }

    /// Sends each message to its own request's coordinator (outputs about several
    /// requests).
    fn reply_each(&mut self, out: Vec<Output>) {
        for o in out {
            if let Output::Send { to, msg } = o {
                let req = msg.req();
                if to == Role::Prefill {
                    self.to_writer(msg);
                } else {
                    self.reserved(&msg);
                    if let Some(r) = self.proto.records().attached(req) {
                        r.reply.send(msg);
                    }
                }
            }
        }
    }

    /// Sends `msg` (a `QuietQuery`) to the writer of its request, on the writer's
    /// newest open link; when it has none, the node asks again once one opens.
    fn to_writer(&self, msg: Msg) {
        let req = msg.req();
        let writer = self.live_record(req).and_then(|r| r.writer.as_ref());
        let link = writer
            .and_then(|w| self.writer_links.get(w))
            .and_then(|links| links.values().next_back());
        match link {
            Some(l) => {
                l.send(msg);
            }
            None => tracing::debug!(?req, ?writer, "no open link to the request's writer"),
        }
    }

    /// The live requests whose assigned writer is `name`.
    fn written_by(&self, name: &str) -> Vec<ReqId> {
        self.proto
            .records()
            .live()
            .filter(|(_, _, r)| r.writer.as_deref() == Some(name))
            .map(|(req, _, _)| req)
            .collect()
    }

    /// While a drain moves KV ([`DecodeCmd::MoveAll`]): ends every decoding sequence,
    /// caching its computed pages ([`Engine::end_caching_output`]) and recording it
    /// as kept when any were (`Moving`), else as plainly `Drained`.
    fn move_decoding(&mut self, engine: &mut Engine) {
        let Some(why) = self.moving.clone() else {
            return;
        };
        let decoding: Vec<ReqId> = self
            .proto
            .records()
            .states()
            .filter(|(_, s)| matches!(s, DecodeState::Running))
            .map(|(req, _)| req)
            .collect();
        for req in decoding {
            let pages = engine.end_caching_output(seq_of(req));
            let kind = match (&self.kept, pages) {
                (Some(kept), 1..) => {
                    kept.lock().unwrap().insert(req);
                    tracing::info!(?req, pages, "a drained request's KV is cached for its move");
                    FailKind::Moving
                }
                _ => FailKind::Drained,
            };
            let outcome = DecodeOutcome::Failed {
                reason: FailReason::new(kind, why.clone()),
            };
            self.with_proto(engine, req, None, CommitExtra::default(), |p, env, out| {
                p.on_decode_finished(req, outcome, env, out)
            });
        }
    }

    /// The requests whose state is not terminal.
    fn live_reqs(&self) -> impl Iterator<Item = ReqId> + '_ {
        self.proto
            .records()
            .states()
            .filter(|(_, s)| !s.is_terminal())
            .map(|(req, _)| req)
    }

    /// What the node keeps for `req` while it is live (not for a tombstone).
    fn live_record(&self, req: ReqId) -> Option<&DecodeRecord> {
        let live = self.proto.records().state(req)?;
        (!live.is_terminal())
            .then(|| self.proto.records().attached(req))
            .flatten()
    }

    /// Once every [`ASK_EVERY`]: asks the writer of every reservation quarantined for a
    /// lost coordinator whether it is quiet (the protocol decides which).
    fn ask_writers(&mut self, engine: &mut Engine) {
        if self.last_ask.elapsed() < ASK_EVERY {
            return;
        }
        self.last_ask = Instant::now();
        let mut out = Vec::new();
        {
            let mut env = DecodeEngineEnv {
                engine,
                commit: CommitExtra::default(),
                gone_writers: &self.gone_writers,
            };
            self.proto.ask_writers(&mut env, &mut out);
        }
        self.reply_each(out);
    }

    fn expire_tombstones(&mut self) {
        let proto = &mut self.proto;
        self.clock.tick(|now, ttl| {
            proto.expire(now, ttl);
        });
    }

    /// Once a second: reservations whose lease ran out (no commit, no renewal).
    fn check_leases(&mut self, engine: &mut Engine) {
        if self.last_lease_check.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.last_lease_check = Instant::now();
        let expired: Vec<ReqId> = self
            .proto
            .records()
            .live()
            .filter(|(req, _, r)| self.proto.accepts_writes(*req) && r.lease_from.elapsed() > LEASE)
            .map(|(req, _, _)| req)
            .collect();
        for req in expired {
            self.counters.leases_expired.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(?req, "decode reservation lease ran out before its commit");
            self.with_proto(engine, req, None, CommitExtra::default(), |p, env, out| {
                p.on_lease_expired(req, env, out)
            });
        }
    }

    /// A frame from `from` that breaks the protocol for `req`: counted, `from`'s link
    /// cut, and, when `from` is the request's own writer, a running request fails
    /// rather than decode from pages its writer touched after the commit. A frame
    /// from any other peer fails nothing but that peer's link: it was refused before
    /// it touched anything, and the request (maybe another tenant's) is not its to
    /// end.
    /// `reason`: its label, one of [`crate::metrics::NODE_VIOLATIONS`].
    fn violation(
        &mut self,
        engine: &mut Engine,
        req: ReqId,
        from: &WriterLink,
        reason: &'static str,
        what: &str,
    ) {
        self.counters
            .link_violations
            .fetch_add(1, Ordering::Relaxed);
        self.metrics.link_violation(reason);
        if what.contains("page write") {
            self.counters.writes_dropped.fetch_add(1, Ordering::Relaxed);
            self.metrics.late_write_dropped();
        }
        tracing::warn!(?req, peer = %from.name, "{what}; cutting the link");
        from.cut();
        if self.is_writer(req, from)
            && matches!(
                self.proto.records().state(req),
                Some(tessera_transfer::protocol::DecodeState::Running)
            )
        {
            engine.release_seq(seq_of(req));
            let reason = FailReason::new(FailKind::Integrity, what.to_string());
            self.with_proto(engine, req, None, CommitExtra::default(), |p, env, out| {
                p.on_decode_finished(req, DecodeOutcome::Failed { reason }, env, out)
            });
        }
    }

    /// Applies, drops or refuses one page write from the request's writer, as the
    /// protocol's `on_page_write` decides.
    fn land(&mut self, engine: &mut Engine, landing: &PageLanding, from: &WriterLink) {
        use tessera_transfer::protocol::PageWrite;
        let req = ReqId(landing.req);
        match self.proto.on_page_write(req, &landing.dest) {
            PageWrite::Apply => {
                if let Err(e) = engine.land(landing) {
                    let what = format!("a malformed page write: {e}");
                    self.violation(engine, req, from, "malformed_page", &what);
                }
            }
            // Late writes after the reservation ended or was quarantined (its
            // coordinator gone): dropped, never applied.
            PageWrite::DropLate => {
                self.counters.writes_dropped.fetch_add(1, Ordering::Relaxed);
                self.metrics.late_write_dropped();
                tracing::debug!(?req, "dropped a late KV page write");
            }
            PageWrite::Refuse(what) => self.violation(engine, req, from, "refused_write", what),
        }
    }

    /// Whether `from` may write for `req`: the assigned writer, or any when the
    /// coordinator named none.
    fn is_writer(&self, req: ReqId, from: &WriterLink) -> bool {
        self.live_record(req)
            .and_then(|r| r.writer.as_ref())
            .is_none_or(|w| *w == from.name)
    }
}

impl NodeLoop for DecodeLoop {
    type Cmd = DecodeCmd;

    // After `Crash`, `stop()` ends the loop before another command is applied.
    fn on_cmd(&mut self, engine: &mut Engine, cmd: DecodeCmd) {
        match cmd {
            DecodeCmd::FromCoordinator { msg, reply, body } => {
                let req = msg.req();
                if !matches!(
                    msg,
                    Msg::Prealloc { .. } | Msg::Abort { .. } | Msg::Poll { .. }
                ) {
                    tracing::warn!(?req, "a coordinator may only send Prealloc, Abort or Poll");
                    return;
                }
                let mut attached = None;
                let known = self.proto.records().state(req).is_some();
                match self.proto.records_mut().attached_mut(req) {
                    // The latest link to the coordinator; a re-sent Prealloc never
                    // replaces the body and stream the request already has.
                    Some(r) => r.reply = reply.clone(),
                    None if !known && matches!(msg, Msg::Prealloc { .. }) => {
                        let writer = body.as_ref().and_then(|b| b.writer.clone());
                        let trace = body.as_ref().and_then(|b| b.trace.clone());
                        attached = Some(DecodeRecord {
                            reply: reply.clone(),
                            body: body.map(|b| *b),
                            admitted: None,
                            writer,
                            lease_from: Instant::now(),
                            span: crate::telemetry::child_span("queue", req.0, trace.as_deref()),
                            trace,
                        });
                    }
                    None => {} // a tombstone answers from the protocol's record
                }
                self.with_proto(
                    engine,
                    req,
                    Some(&reply),
                    CommitExtra::default(),
                    |p, env, out| p.on_msg(msg, attached, env, out),
                );
            }
            DecodeCmd::FromPrefill { msg, extra, from } => {
                let req = msg.req();
                if !msg.may_send(Role::Prefill, Role::Decode) {
                    let what = format!("a prefill node sent {msg:?}");
                    self.violation(engine, req, &from, "wrong_sender", &what);
                    return;
                }
                if !self.is_writer(req, &from) {
                    self.violation(
                        engine,
                        req,
                        &from,
                        "not_routed",
                        "a writer frame from a node that is not the request's writer",
                    );
                    return;
                }
                match msg {
                    Msg::Commit {
                        req,
                        tokens,
                        pages,
                        first_token,
                    } => {
                        let verdict = self.with_proto(engine, req, None, extra, |p, env, out| {
                            p.on_commit(req, tokens, &pages, first_token, env, out)
                        });
                        if let Err(e) = verdict {
                            self.counters
                                .commits_rejected
                                .fetch_add(1, Ordering::Relaxed);
                            self.metrics.commit_rejected(&e);
                            if e == CommitError::NotAwaitingCommit {
                                // A commit that crossed its request's abort, or a
                                // duplicate: the protocol answered it; still counted.
                                tracing::info!(?req, error = %e, "refused a late or duplicate KV transfer commit");
                            } else {
                                tracing::warn!(?req, error = %e, "refused a KV transfer commit");
                            }
                        }
                    }
                    Msg::Renew { req } => {
                        if let Some(r) = self.proto.records_mut().attached_mut(req) {
                            r.lease_from = Instant::now();
                        }
                    }
                    Msg::WriterQuiet { req } => {
                        self.with_proto(
                            engine,
                            req,
                            None,
                            CommitExtra::default(),
                            |p, env, out| p.on_writer_quiet(req, env, out),
                        );
                    }
                    other => {
                        let what = format!("a prefill node sent {other:?}");
                        self.violation(engine, req, &from, "wrong_sender", &what);
                    }
                }
            }
            DecodeCmd::Land { landing, from } => {
                let req = ReqId(landing.req);
                if !self.is_writer(req, &from) {
                    self.violation(
                        engine,
                        req,
                        &from,
                        "not_routed",
                        "a page write from a node that is not the request's writer",
                    );
                } else {
                    self.land(engine, &landing, &from);
                }
            }
            DecodeCmd::WriterLink {
                name,
                id,
                to: Some(to),
            } => {
                self.gone_writers.remove(&name);
                self.writer_links
                    .entry(name.clone())
                    .or_default()
                    .insert(id, to);
                // Reservations quarantined while the writer had no open link: ask now.
                for req in self.written_by(&name) {
                    self.with_proto(engine, req, None, CommitExtra::default(), |p, env, out| {
                        p.ask_writer(req, env, out)
                    });
                }
            }
            DecodeCmd::WriterLink { name, id, to: None } => {
                let open = self.writer_links.get_mut(&name).is_some_and(|links| {
                    links.remove(&id);
                    !links.is_empty()
                });
                // Writes on another open link of the writer can still land: not gone.
                if !open {
                    self.writer_links.remove(&name);
                    let reqs = self.written_by(&name);
                    self.gone_writers.insert(name);
                    for req in reqs {
                        self.with_proto(
                            engine,
                            req,
                            None,
                            CommitExtra::default(),
                            |p, env, out| p.on_writer_quiet(req, env, out),
                        );
                    }
                }
            }
            DecodeCmd::AfterEarlier(f) => f(),
            DecodeCmd::CoordinatorLost(req) => {
                self.with_proto(engine, req, None, CommitExtra::default(), |p, env, out| {
                    p.on_coordinator_lost(req, env, out)
                });
            }
            DecodeCmd::Drain => {
                let mut out = Vec::new();
                self.proto.begin_drain(&mut out);
                self.reply_each(out);
            }
            DecodeCmd::EndAll(reason) => {
                let live: Vec<ReqId> = self.live_reqs().collect();
                for req in live {
                    // Ignored unless running; then the record is gone.
                    let outcome = DecodeOutcome::Failed {
                        reason: reason.clone(),
                    };
                    self.with_proto(engine, req, None, CommitExtra::default(), |p, env, out| {
                        p.on_decode_finished(req, outcome, env, out)
                    });
                    if self.live_record(req).is_some() {
                        self.with_proto(
                            engine,
                            req,
                            None,
                            CommitExtra::default(),
                            |p, env, out| p.on_coordinator_lost(req, env, out),
                        );
                    }
                }
            }
            DecodeCmd::MoveAll(why) => self.moving = Some(why),
            DecodeCmd::Crash => self.crashed = true,
            DecodeCmd::WithEngine(f) => f(engine),
        }
        self.move_decoding(engine);
        self.expire_tombstones();
        self.check_leases(engine);
        self.ask_writers(engine);
    }

    fn stop(&self) -> bool {
        self.crashed
    }

    fn timer(&self) -> Option<Duration> {
        (self.proto.records().live_len() > 0).then_some(TIMER)
    }

    fn live(&self) -> usize {
        self.proto.records().live_len()
    }

    fn queued(&self) -> usize {
        self.proto.waiting().count()
    }

    fn quarantined_pages(&self, engine: &Engine) -> usize {
        use tessera_transfer::protocol::DecodeState;
        let kv = engine.kv();
        // One pass over the records (tombstones included: a few thousand at most,
        // microseconds per step).
        self.proto
            .records()
            .states()
            .filter(|(_, s)| matches!(s, DecodeState::Quarantined(_)))
            .filter_map(|(req, _)| kv.table(seq_of(req)))
            .map(|t| t.iter().filter(|r| !kv.pool().is_cached(r.page)).count())
            .sum()
    }

    fn after_step(&mut self, engine: &mut Engine) {
        for (seq, end) in engine.take_ended() {
            let req = ReqId(seq.0);
            let outcome = match end {
                SeqEnd::Completed => DecodeOutcome::Completed,
                SeqEnd::ClientGone => DecodeOutcome::Failed {
                    reason: FailReason::new(FailKind::ClientGone, "the client went away"),
                },
                SeqEnd::Failed(e) => DecodeOutcome::Failed {
                    reason: FailReason::new(
                        match e {
                            EngineError::Integrity(_) => FailKind::Integrity,
                            EngineError::Shutdown | EngineError::Format(_) => FailKind::Internal,
                            EngineError::BatchQueueTimeout { .. } => FailKind::Busy,
                        },
                        e.to_string(),
                    ),
                },
            };
            self.with_proto(engine, req, None, CommitExtra::default(), |p, env, out| {
                p.on_decode_finished(req, outcome, env, out)
            });
        }
        self.offer_capacity(engine);
        self.move_decoding(engine);
        self.expire_tombstones();
        self.check_leases(engine);
        self.ask_writers(engine);
    }
}
