//! The coordinator thread: one protocol [`Coordinator`] per request, driven by node
//! replies, a watch for cancelled clients and dead nodes, and a retransmission timer.
//! Everything it decides comes from the protocol machine; this file only moves
//! messages, maps the outcome to the client's stream and holds the request's release
//! guard until the protocol says `Released` (I6). Whether a released request starts
//! again on other nodes (a draining node refused it, or a node failed before the
//! client had a token: issue 36) is decided by the pure [`Attempts`] and
//! [`StreamFence`] machines; this file picks the new pair.

use crate::error::ServeError;
use crate::links::PdCounters;
use crate::routing::{Reach, Router};
use crate::stream::{request_channel, ClientSink, Continue, RequestStream};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};
use tessera_engine::{Admitted, EngineError, GenerateRequest, PdAdmission, Rejection, Resume};
use tessera_transfer::protocol::{
    Attempts, Cause, Coordinator, Msg, Outcome, Output, ReqId, Retry, RetryPolicy, Role, Writer,
};

/// What travels with a protocol message besides the message: the request body
/// (prompt ids, sampling) that the protocol leaves out, where its events go, and the
/// decode node chosen for the prefill.
pub(crate) enum Attachment {
    None,
    /// With `Prealloc`: the request, its stream (without the release guard) and the
    /// node assigned to write its pages.
    Decode {
        body: GenerateRequest,
        client: ClientSink,
        submitted: Instant,
        writer: Writer,
        /// The request's W3C `traceparent` (traces on).
        trace: Option<String>,
    },
    /// With `Prefill`: the request and the decode node that reserved the pages.
    Prefill {
        body: GenerateRequest,
        decode: usize,
        /// A move: the request, by its id on the draining decode node, whose KV
        /// the writer moves.
        moves: Option<ReqId>,
        /// The request's W3C `traceparent` (traces on).
        trace: Option<String>,
    },
}

/// The coordinator thread's commands.
// `Start` carries the request body (with its output options); it is moved once per
// request, so boxing it would only add an allocation.
#[allow(clippy::large_enum_variant)]
pub(crate) enum CoordCmd {
    /// A request that passed the gateway's admission, with its chosen pair.
    Start {
        req: ReqId,
        body: GenerateRequest,
        client: ClientSink,
        prefill: usize,
        decode: usize,
        /// The submitter's span as a W3C `traceparent` (traces on).
        trace: Option<String>,
        /// The request's session key (routing affinity), for a restart elsewhere.
        affinity: Option<u64>,
    },
    /// A node's reply.
    FromNode(Msg),
    /// Stop the thread (the deployment is going away).
    Stop,
}

/// How the coordinator reaches the nodes. Sends must not block: a node that cannot
/// take a message now is one the failure detector reports.
pub(crate) trait CoordLinks: Send + Sync {
    /// Sends to decode node `index`; `false` when unreachable.
    fn to_decode(&self, index: usize, msg: Msg, extra: Attachment) -> bool;
    /// Sends to `writer` (a prefill node, or the writer of a draining decode node
    /// that moves a request's KV); `false` when unreachable.
    fn to_writer(&self, writer: Writer, msg: Msg, extra: Attachment) -> bool;
    /// Whether the node is known dead (its thread exited, its connection closed).
    fn is_down(&self, role: Role, index: usize) -> bool;
    /// The node's current link epoch: it changes whenever the link is replaced (a
    /// reconnect, a restarted node), `None` while the node is down. A request lives on
    /// the epoch it started on; any other value means the node lost it.
    fn epoch(&self, role: Role, index: usize) -> Option<u64> {
        (!self.is_down(role, index)).then_some(0)
    }
    /// Whether new requests may be routed to the node (up and not draining).
    fn accepts_new(&self, role: Role, index: usize) -> bool {
        !self.is_down(role, index)
    }
    /// How the pair choice sees the node: [`accepts_new`](Self::accepts_new), and
    /// for linked nodes whether the link missed a heartbeat ([`Reach::Quiet`]).
    fn reach(&self, role: Role, index: usize) -> Reach {
        Reach::from_up(self.accepts_new(role, index))
    }
    /// The pair choice's load counts.
    fn router(&self) -> &Router;
    /// The request is over everywhere (every node acknowledged or is down).
    fn released(&self, _req: ReqId) {}
    /// Tells decode node `index` that the KV it keeps for attempt `req` will not
    /// be moved (its drain stops waiting for it). Best effort.
    fn unkeep(&self, _index: usize, _req: ReqId) {}
    /// Where restarts, continuations and the failures they could not cure are
    /// counted.
    fn counters(&self) -> &PdCounters;
}

/// The front of a coordinator: pair choice and request ids, then the request goes to
/// the coordinator thread. It admits nothing itself: requests arrive [`Admitted`]
/// against [`Submitter::admission`], and each node checks I1 against its own pool.
pub(crate) struct Submitter {
    tx: mpsc::Sender<CoordCmd>,
    admission: PdAdmission,
}

impl Submitter {
    /// Submits to the coordinator thread behind `tx`; callers admit against
    /// `admission`.
    pub(crate) fn new(tx: mpsc::Sender<CoordCmd>, admission: PdAdmission) -> Self {
        Self { tx, admission }
    }

    /// What requests are admitted against.
    pub(crate) fn admission(&self) -> PdAdmission {
        self.admission
    }

    /// Picks a (prefill, decode) pair for `req` (admitted against
    /// [`Self::admission`]: the decode pools for prompt + `max_tokens`, the prefill
    /// pools for the prompt) among the nodes `links` reports up (`affinity`: a
    /// session's routing key), and starts the transfer protocol.
    ///
    /// Errors: `Unavailable` when no node of a role is up.
    pub(crate) fn submit(
        &self,
        links: &dyn CoordLinks,
        req: Admitted,
        affinity: Option<u64>,
    ) -> Result<RequestStream, ServeError> {
        let body = req.into_request();
        let (prefill, decode) = links
            .router()
            .assign_by(|role, i| links.reach(role, i), affinity)
            .ok_or_else(|| {
                ServeError::from(Rejection::Unavailable(
                    "no prefill or decode node is reachable; retry later".into(),
                ))
            })?;
        let (client, stream) = request_channel();
        let req = new_req_id();
        let start = CoordCmd::Start {
            req,
            body,
            client,
            prefill,
            decode,
            trace: crate::telemetry::traceparent(),
            affinity,
        };
        if let Err(mpsc::SendError(CoordCmd::Start { client, .. })) = self.tx.send(start) {
            links.router().release(prefill, decode);
            client.fail(ServeError::from(EngineError::Shutdown));
        }
        Ok(stream)
    }

    /// Stops the coordinator thread.
    pub(crate) fn stop(&self) {
        let _ = self.tx.send(CoordCmd::Stop);
    }
}

/// A new request id: 64 random bits, drawn for each request (and again for a
/// restart). Ids from two gateways (or one gateway before and after a restart) do
/// not meet on a node, where a reused id would address another request's records
/// and pages; and one id says nothing about any other, so a node that sees some
/// requests cannot name its neighbours' (it could with a counter: a forged
/// `QuietQuery` for a future id would fail that request's prefill). Links do not
/// rely on secrecy either: a node link is believed only about the requests routed
/// to it (`RouteBook`).
fn new_req_id() -> ReqId {
    ReqId(rand::random::<u64>().max(1))
}

/// One request at its coordinator.
struct CoordReq {
    proto: Coordinator,
    body: GenerateRequest,
    /// The client's stream; owns the release guard, dropped at `Released`.
    client: ClientSink,
    submitted: Instant,
    /// The pair the router counts the request against.
    prefill: usize,
    decode: usize,
    /// The node that writes the attempt's prompt KV: prefill node `prefill`, or a
    /// draining decode node moving the request's KV ...
    writer: Writer,
    /// ... that of its attempt `moves` (its id there).
    moves: Option<ReqId>,
    /// A draining decode node (its index) that keeps this request's KV under its
    /// attempt's id, until the move's `Prefill` is sent or the gateway tells it
    /// the KV will not be moved ([`CoordLinks::unkeep`]).
    kept: Option<(usize, ReqId)>,
    prefill_down: bool,
    decode_down: bool,
    /// The link epochs of both nodes when the request started (see
    /// [`CoordLinks::epoch`]); `None`: the node was already down.
    prefill_epoch: Option<u64>,
    decode_epoch: Option<u64>,
    /// Last message from a node about this request (or its start).
    last_heard: Instant,
    /// The request's W3C `traceparent`, sent to both nodes.
    trace: Option<String>,
    /// The session key the pair was chosen with.
    affinity: Option<u64>,
    /// An outcome another pair may cure ([`Cause::of`]), held back from the client
    /// until the attempt is released and [`Attempts`] decided.
    held: Option<Outcome>,
    /// The request's attempts: failures so far, nodes to avoid.
    attempts: Attempts,
    /// What the current attempt runs when it continues tokens a client already has
    /// ([`continuation`]); `None`: `body` itself.
    attempt_body: Option<GenerateRequest>,
}

/// The protocol machine of `body` as request `req`, and what it emits first (the
/// `Prealloc`).
fn protocol_for(req: ReqId, body: &GenerateRequest) -> (Coordinator, Vec<Output>) {
    let mut out = Vec::new();
    let proto = Coordinator::start(
        req,
        body.tenant,
        body.prompt.len() as u32,
        body.max_tokens as u32,
        &mut out,
    );
    (proto, out)
}

/// The client's error for an outcome that ends the request.
fn client_error(outcome: &Outcome) -> ServeError {
    match outcome {
        Outcome::Rejected(refusal) => ServeError::refused(refusal),
        Outcome::Failed(f) => ServeError::from_failure(f),
        Outcome::Succeeded | Outcome::Aborted => ServeError::from(EngineError::Shutdown),
    }
}

/// A released attempt whose outcome has a [`Cause`]: [`Attempts::after_release`]
/// decides on the stream's fence whether it starts again. A restart is a new request
/// (new id, fresh protocol machine) on a pair that avoids every node that failed or
/// refused it; the client's error is the outcome's when the decision is to fail or
/// no such pair is up. Nothing was held for the old attempt anywhere (it was
/// released) and the client had no token from it (the fence).
fn after_release(
    nodes: &dyn CoordLinks,
    reqs: &mut HashMap<ReqId, CoordReq>,
    old: ReqId,
    mut r: CoordReq,
    outcome: Outcome,
) {
    let gone = r.client.is_cancelled();
    let pair = (r.writer, r.decode);
    // A move not sent yet is not coming: that node stops keeping the KV.
    release_kept(nodes, &mut r);
    if Cause::of(&outcome).is_some_and(|c| c.moves) {
        r.kept = Some((r.decode, old));
    }
    let attempts = &mut r.attempts;
    let max_tokens = r.body.max_tokens;
    let mut attempt = 0;
    let mut move_from = None;
    let resumed = r.client.decide_restart(|fence, tokens, waited| {
        // A stream with every token but its end cannot be continued (nothing is
        // left to generate): it ends with the error.
        let continuable = tokens.len() < max_tokens;
        match attempts.after_release(&outcome, pair, gone, waited, continuable, fence) {
            Retry::Restart {
                attempt: a,
                move_from: m,
            } => {
                attempt = a;
                move_from = m;
                Some(a)
            }
            Retry::Fail => None,
        }
    });
    let counters = nodes.counters();
    let Some(resumed) = resumed else {
        release_kept(nodes, &mut r);
        if !gone {
            counters.not_restarted.fetch_add(1, Ordering::Relaxed);
            r.client.fail(client_error(&outcome));
        }
        return; // dropping it ends the stream and signals release
    };
    let pair = nodes.router().assign_by(
        |role, i| {
            if r.attempts.avoids(role, i) {
                Reach::Down
            } else {
                nodes.reach(role, i)
            }
        },
        r.affinity,
    );
    let Some((prefill, decode)) = pair else {
        release_kept(nodes, &mut r);
        counters.not_restarted.fetch_add(1, Ordering::Relaxed);
        r.client.fail(client_error(&outcome));
        return;
    };
    let req = new_req_id();
    // The draining node writes the pages it kept, while its link is up (it is
    // draining: no new requests, but moves).
    let writer = match move_from {
        Some(d) if nodes.epoch(Role::Decode, d).is_some() => Writer {
            role: Role::Decode,
            index: d,
        },
        _ => Writer::prefill(prefill),
    };
    // A warning: operators see what a node's loss or drain cost (the lines beside it
    // name the node).
    let what = if writer.role == Role::Decode {
        counters.moved.fetch_add(1, Ordering::Relaxed);
        "moving the request's KV from the draining decode node to another"
    } else if resumed.tokens.is_empty() {
        counters.restarted.fetch_add(1, Ordering::Relaxed);
        "starting the request again on other nodes before its first token"
    } else {
        counters.continued.fetch_add(1, Ordering::Relaxed);
        "continuing the request on other nodes after the tokens its client has"
    };
    tracing::warn!(
        ?old,
        new = ?req,
        attempt,
        ?outcome,
        ?writer,
        decode,
        streamed = resumed.tokens.len(),
        "{what}"
    );
    (r.prefill, r.decode, r.writer) = (prefill, decode, writer);
    r.moves = r
        .kept
        .filter(|_| writer.role == Role::Decode)
        .map(|(_, id)| id);
    if r.moves.is_none() {
        release_kept(nodes, &mut r);
    }
    (r.prefill_down, r.decode_down) = (false, false);
    r.prefill_epoch = nodes.epoch(writer.role, writer.index);
    r.decode_epoch = nodes.epoch(Role::Decode, decode);
    r.attempt_body = continuation(&r.body, resumed);
    let (proto, out) = protocol_for(req, r.attempt_body.as_ref().unwrap_or(&r.body));
    r.proto = proto;
    r.last_heard = Instant::now();
    reqs.insert(req, r);
    execute(nodes, reqs, req, out);
}

/// Tells the node that keeps `r`'s KV for a move that no move will come.
fn release_kept(nodes: &dyn CoordLinks, r: &mut CoordReq) {
    if let Some((decode, id)) = r.kept.take() {
        nodes.unkeep(decode, id);
    }
}

/// The request an attempt after `resumed.tokens` runs: `None` (the request as
/// submitted) without tokens; otherwise the prompt followed by those tokens, marked
/// as output the client has ([`Resume`]), for what is left of `max_tokens`, without
/// prompt log probabilities (the client has them).
fn continuation(body: &GenerateRequest, resumed: Continue) -> Option<GenerateRequest> {
    if resumed.tokens.is_empty() {
        return None;
    }
    let mut c = body.clone();
    c.max_tokens -= resumed.tokens.len();
    c.resume = Some(Resume {
        output_tokens: resumed.tokens.len(),
        rng_word_pos: resumed.rng_word_pos,
    });
    c.prompt.extend(resumed.tokens);
    c.output.prompt_logprobs = None;
    Some(c)
}

/// How often the coordinator looks for clients that went away and dead nodes.
const WATCH_INTERVAL: Duration = Duration::from_millis(5);
/// Silence after which the coordinator re-sends what its phase waits on (a lost
/// message; nodes answer duplicates from their records, never by acting twice).
pub(crate) const RETRANSMIT_AFTER: Duration = Duration::from_secs(5);

/// The coordinator thread's body; returns on `Stop` or when every sender is gone.
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
                client,
                prefill,
                decode,
                trace,
                affinity,
            }) => {
                let (proto, out) = protocol_for(req, &body);
                reqs.insert(
                    req,
                    CoordReq {
                        proto,
                        body,
                        client,
                        submitted: Instant::now(),
                        prefill,
                        decode,
                        writer: Writer::prefill(prefill),
                        moves: None,
                        kept: None,
                        prefill_down: false,
                        decode_down: false,
                        prefill_epoch: nodes.epoch(Role::Prefill, prefill),
                        decode_epoch: nodes.epoch(Role::Decode, decode),
                        last_heard: Instant::now(),
                        trace,
                        affinity,
                        held: None,
                        attempts: Attempts::new(RetryPolicy::default()),
                        attempt_body: None,
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
        if last_watch.elapsed() < WATCH_INTERVAL {
            continue;
        }
        last_watch = Instant::now();
        watch(&*nodes, &mut reqs);
    }
}

/// Clients that went away, nodes that died, messages lost: each becomes the protocol
/// event it is.
fn watch(nodes: &dyn CoordLinks, reqs: &mut HashMap<ReqId, CoordReq>) {
    let ids: Vec<ReqId> = reqs.keys().copied().collect();
    for req in ids {
        let Some(r) = reqs.get_mut(&req) else {
            continue;
        };
        let mut out = Vec::new();
        // A node whose link changed since the request started (down, reconnected,
        // restarted as a new incarnation) no longer holds it.
        if !r.prefill_down && lost(nodes, r.writer.role, r.writer.index, r.prefill_epoch) {
            r.prefill_down = true;
            r.proto.on_node_down(Role::Prefill, &mut out);
        }
        if !r.decode_down && lost(nodes, Role::Decode, r.decode, r.decode_epoch) {
            r.decode_down = true;
            r.proto.on_node_down(Role::Decode, &mut out);
        }
        if r.client.is_cancelled() && r.proto.outcome().is_none() {
            r.proto.on_client_gone(&mut out);
        }
        if out.is_empty() && r.last_heard.elapsed() > RETRANSMIT_AFTER {
            r.last_heard = Instant::now();
            r.proto.on_timeout(&mut out);
        }
        if !out.is_empty() {
            execute(nodes, reqs, req, out);
        }
    }
}

/// Whether node `index` of `role` lost the requests of link epoch `started` (or the
/// request started while it was down).
fn lost(nodes: &dyn CoordLinks, role: Role, index: usize, started: Option<u64>) -> bool {
    started.is_none() || nodes.epoch(role, index) != started
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
                    Msg::Prealloc { .. } => Attachment::Decode {
                        body: r.attempt_body.as_ref().unwrap_or(&r.body).clone(),
                        client: r.client.detached(),
                        submitted: r.submitted,
                        writer: r.writer,
                        trace: r.trace.clone(),
                    },
                    _ => Attachment::None,
                };
                // Never onto a later link of the node: it does not know the request.
                if lost(nodes, Role::Decode, r.decode, r.decode_epoch) {
                    continue;
                }
                if !nodes.to_decode(r.decode, msg, extra) {
                    tracing::debug!(?req, "decode node unreachable; the watcher reports it");
                }
            }
            Output::Send {
                to: Role::Prefill,
                msg,
            } => {
                let extra = match msg {
                    Msg::Prefill { .. } => Attachment::Prefill {
                        body: r.attempt_body.as_ref().unwrap_or(&r.body).clone(),
                        decode: r.decode,
                        moves: r.moves,
                        trace: r.trace.clone(),
                    },
                    _ => Attachment::None,
                };
                if lost(nodes, r.writer.role, r.writer.index, r.prefill_epoch) {
                    continue;
                }
                let prefill = matches!(msg, Msg::Prefill { .. });
                if !nodes.to_writer(r.writer, msg, extra) {
                    tracing::debug!(?req, "prefill node unreachable; the watcher reports it");
                } else if prefill && r.moves.is_some() {
                    // The node stops keeping the KV when the move's `Prefill` arrives.
                    r.kept = None;
                }
            }
            Output::Send { .. } => {}
            Output::Outcome(outcome) => {
                // Success and client aborts need no event here: the decode node
                // streamed the tokens and `Done`, or nobody is listening.
                match outcome {
                    Outcome::Succeeded | Outcome::Aborted => {}
                    // Maybe started again elsewhere once released (`after_release`).
                    o if Cause::of(&o).is_some() => r.held = Some(o),
                    o => r.client.fail(client_error(&o)),
                }
            }
            Output::Released => {
                nodes.router().release(r.prefill, r.decode);
                nodes.released(req);
                // Dropping the request drops its release guard: the client's stream
                // learns that nothing is held for it anywhere (unless it starts
                // again elsewhere, keeping the guard).
                if let Some(mut r) = reqs.remove(&req) {
                    match r.held.take() {
                        Some(outcome) => after_release(nodes, reqs, req, r, outcome),
                        None => release_kept(nodes, &mut r),
                    }
                }
            }
        }
    }
}
