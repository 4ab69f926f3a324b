//! A decode node's loop: its engine and its protocol machine ([`DecodeNode`]) on one
//! thread. Every decision about a request (admit, wait for pages, reserve, verify the
//! commit, start, fail, abort, forget) is the protocol's; this file turns commands
//! into protocol calls, gives the protocol the engine as its [`DecodeEnv`], and sends
//! what the protocol emits to the request's coordinator.
//!
//! Per request the node keeps one [`DecodeRecord`] (its reply link and, until it is
//! adopted, its body and event sink) next to the protocol's own record, and drops it
//! as soon as the protocol's record is terminal.

use crate::error::refusal;
use crate::links::{settle, ExpiryClock, PdCounters, ReplyTo};
use crate::node_loop::NodeLoop;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;
use tessera_engine::kv_transfer::Import;
use tessera_engine::sink::EventSink;
use tessera_engine::{Engine, EngineError, GenerateRequest, SeqEnd};
use tessera_model::kv::SeqId;
use tessera_transfer::inproc::PageLanding;
use tessera_transfer::protocol::{
    DecodeEnv, DecodeNode, DecodeOutcome, FailKind, FailReason, Msg, Output, Refusal, RefusalKind,
    ReqId, ReserveError,
};
use tessera_transfer::transport::DestPage;

/// A request's body as the decode node receives it with `Prealloc`: what it admits,
/// later decodes, and where the tokens go.
pub(crate) struct RequestBody {
    pub(crate) req: GenerateRequest,
    pub(crate) sink: Box<dyn EventSink>,
    pub(crate) submitted: Instant,
}

/// A decode node's commands.
pub(crate) enum DecodeCmd {
    /// From a coordinator: `Prealloc` (with the body), `Abort`, `Poll`.
    FromCoordinator {
        msg: Msg,
        reply: ReplyTo,
        body: Option<RequestBody>,
    },
    /// From a prefill node: `Commit`, with the sampler position after the first token.
    FromPrefill { msg: Msg, rng_pos: u128 },
    /// A page write (in-process or TCP transport).
    Land(PageLanding),
    /// Runs once every earlier command was applied (a TCP flush acknowledgement).
    AfterEarlier(Box<dyn FnOnce() + Send>),
    /// The coordinator of this request is gone (its connection closed).
    CoordinatorLost(ReqId),
    /// A drain's deadline passed: running sequences end with `reason` (their
    /// coordinators hear `Finished` with the failure); requests not decoding yet are
    /// aborted as if their coordinator were gone.
    EndAll(FailReason),
    /// Stop at once, as a crash would (tests).
    Crash,
}

/// What the driver keeps per request beside the protocol's record.
struct DecodeRecord {
    reply: ReplyTo,
    /// Until adopted.
    body: Option<RequestBody>,
}

/// The sequence id a request's pages carry on this node: the request id, unique
/// across coordinators.
fn seq_of(req: ReqId) -> SeqId {
    SeqId(req.0)
}

/// The decode node's [`DecodeEnv`] over its engine.
struct EngineEnv<'a> {
    engine: &'a mut Engine,
    records: &'a mut HashMap<ReqId, DecodeRecord>,
    rng_pos: u128,
}

impl DecodeEnv for EngineEnv<'_> {
    fn admit(
        &mut self,
        req: ReqId,
        _tenant: u64,
        _prompt_tokens: u32,
        _max_tokens: u32,
    ) -> Result<(), Refusal> {
        let Some(body) = self.records.get(&req).and_then(|r| r.body.as_ref()) else {
            return Err(Refusal {
                kind: RefusalKind::Invalid,
                message: "prealloc without a request body".into(),
            });
        };
        // I1 on this node, against its own pool.
        self.engine
            .admit(body.req.clone())
            .map(|_| ())
            .map_err(|r| refusal(&r))
    }

    fn reserve(
        &mut self,
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
    ) -> Result<Vec<DestPage>, ReserveError> {
        let tokens = prompt_tokens as usize + max_tokens as usize;
        if !self.engine.kv().can_reserve(tokens) {
            return Err(ReserveError::NoRoomYet);
        }
        self.engine
            .reserve_import(
                seq_of(req),
                tenant,
                prompt_tokens as usize,
                max_tokens as usize,
            )
            .map_err(|e| {
                ReserveError::Refused(Refusal {
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
        _tokens: u32,
        first_token: u32,
        _pages: &[DestPage],
    ) -> Result<(), FailReason> {
        let internal = |m: String| FailReason::new(FailKind::Internal, m);
        let body = self
            .records
            .get_mut(&req)
            .and_then(|r| r.body.take())
            .ok_or_else(|| internal("no request body to decode".into()))?;
        let admitted = self
            .engine
            .admit(body.req)
            .map_err(|e| internal(format!("re-admission failed: {e}")))?;
        self.engine.adopt(
            seq_of(req),
            Import {
                req: admitted,
                first_token,
                seed_fallback: req.0,
                rng_word_pos: self.rng_pos,
                sink: body.sink,
                submitted: body.submitted,
            },
        );
        Ok(())
    }

    fn release(&mut self, req: ReqId) {
        self.engine.release_seq(seq_of(req));
    }
}

/// A decode node's protocol loop.
pub(crate) struct DecodeLoop {
    proto: DecodeNode,
    records: HashMap<ReqId, DecodeRecord>,
    counters: Arc<PdCounters>,
    crashed: bool,
    clock: ExpiryClock,
}

impl DecodeLoop {
    /// A decode node's loop, counting into `counters`.
    pub(crate) fn new(counters: Arc<PdCounters>) -> Self {
        Self {
            proto: DecodeNode::new(),
            records: HashMap::new(),
            counters,
            crashed: false,
            clock: ExpiryClock::new(),
        }
    }

    /// Runs `f` on the protocol with the engine as its environment, then sends what it
    /// emitted (to `reply`, else to the request's recorded coordinator), offers freed
    /// pages to waiting requests and drops the driver record of an ended request.
    fn with_proto<R>(
        &mut self,
        engine: &mut Engine,
        req: ReqId,
        reply: Option<&ReplyTo>,
        rng_pos: u128,
        f: impl FnOnce(&mut DecodeNode, &mut EngineEnv<'_>, &mut Vec<Output>) -> R,
    ) -> R {
        let mut out = Vec::new();
        let r = {
            let mut env = EngineEnv {
                engine: &mut *engine,
                records: &mut self.records,
                rng_pos,
            };
            f(&mut self.proto, &mut env, &mut out)
        };
        let reply = reply
            .cloned()
            .or_else(|| self.records.get(&req).map(|r| r.reply.clone()));
        self.emit(reply.as_ref(), out);
        self.settle(req);
        self.offer_capacity(engine);
        r
    }

    fn emit(&self, reply: Option<&ReplyTo>, out: Vec<Output>) {
        for o in out {
            if let Output::Send { msg, .. } = o {
                // A decode node only ever answers coordinators.
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
            let mut env = EngineEnv {
                engine,
                records: &mut self.records,
                rng_pos: 0,
            };
            self.proto.on_capacity(&mut env, &mut out);
        }
        for o in out {
            if let Output::Send { msg, .. } = o {
                let req = msg.req();
                if let Some(r) = self.records.get(&req) {
                    r.reply.send(msg);
                }
                self.settle(req);
            }
        }
    }

    fn settle(&mut self, req: ReqId) {
        settle(self.proto.records(), &mut self.records, req);
    }

    fn expire_tombstones(&mut self) {
        self.clock.expire(self.proto.records_mut());
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
                match self.records.get_mut(&req) {
                    // The latest link to the coordinator; a re-sent Prealloc never
                    // replaces the body and stream the request already has.
                    Some(r) => r.reply = reply.clone(),
                    None if self.proto.records().state(req).is_none() => {
                        self.records.insert(
                            req,
                            DecodeRecord {
                                reply: reply.clone(),
                                body,
                            },
                        );
                    }
                    None => {} // a tombstone answers from the protocol's record
                }
                self.with_proto(engine, req, Some(&reply), 0, |p, env, out| {
                    p.on_msg(msg, env, out)
                });
            }
            DecodeCmd::FromPrefill { msg, rng_pos } => {
                let Msg::Commit {
                    req,
                    tokens,
                    pages,
                    first_token,
                } = msg
                else {
                    tracing::warn!(req = ?msg.req(), "a prefill node may only send Commit");
                    return;
                };
                let verdict = self.with_proto(engine, req, None, rng_pos, |p, env, out| {
                    p.on_commit(req, tokens, &pages, first_token, env, out)
                });
                if let Err(e) = verdict {
                    self.counters
                        .commits_rejected
                        .fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(?req, error = %e, "refused a KV transfer commit");
                }
            }
            DecodeCmd::Land(l) => {
                if let Err(e) = engine.land(&l) {
                    self.counters.writes_dropped.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(req = l.req, error = %e, "dropped a KV page write");
                }
            }
            DecodeCmd::AfterEarlier(f) => f(),
            DecodeCmd::CoordinatorLost(req) => {
                self.with_proto(engine, req, None, 0, |p, env, out| {
                    p.on_coordinator_lost(req, env, out)
                });
            }
            DecodeCmd::EndAll(reason) => {
                let live: Vec<ReqId> = self.records.keys().copied().collect();
                for req in live {
                    // Ignored unless running; then the record is gone.
                    let outcome = DecodeOutcome::Failed {
                        reason: reason.clone(),
                    };
                    self.with_proto(engine, req, None, 0, |p, env, out| {
                        p.on_decode_finished(req, outcome, env, out)
                    });
                    if self.records.contains_key(&req) {
                        self.with_proto(engine, req, None, 0, |p, env, out| {
                            p.on_coordinator_lost(req, env, out)
                        });
                    }
                }
            }
            DecodeCmd::Crash => self.crashed = true,
        }
        self.expire_tombstones();
    }

    fn stop(&self) -> bool {
        self.crashed
    }

    fn live(&self) -> usize {
        self.records.len()
    }

    fn queued(&self) -> usize {
        self.proto.waiting().count()
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
                            EngineError::Shutdown => FailKind::Internal,
                        },
                        e.to_string(),
                    ),
                },
            };
            self.with_proto(engine, req, None, 0, |p, env, out| {
                p.on_decode_finished(req, outcome, env, out)
            });
        }
        self.offer_capacity(engine);
        self.expire_tombstones();
    }
}
