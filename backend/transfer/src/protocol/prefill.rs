//! The prefill node's state machine, for every request on one prefill node:
//! admission and allocation, computing and writing the prompt's KV, draining the
//! transport before anything is released or committed (I5), aborts, and answering a
//! decode node that asks whether it is quiet.

use super::flaws::flaw;
#[cfg(any(test, feature = "test-util"))]
use super::flaws::Flaws;
use super::messages::{send, FailKind, FailReason, Msg, Output, PageCommit, Refusal, ReqId, Role};
use super::records::{Records, RequestIo, RequestState};
use crate::transport::DestPage;

/// The prefill node's pool, engine and transport as the protocol sees them.
pub trait PrefillEnv {
    /// What the node's driver keeps with each request's record ([`Records`]): `()`
    /// under the model checker.
    type Attached: RequestIo;

    /// Pages needed to hold `tokens` tokens (the descriptor must name that many).
    fn pages_for(&self, tokens: u32) -> usize;

    /// Admission (I1) and allocation of source pages, all or nothing. `attached` is
    /// what came with the request's `Prefill`.
    fn admit_and_alloc(
        &mut self,
        req: ReqId,
        attached: Option<&mut Self::Attached>,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
    ) -> Result<(), Refusal>;

    /// Starts computing the prompt's KV (`tokens` tokens); page `i` is put into
    /// `dest[i]` through the transport once computed. Report the end with
    /// [`PrefillNode::on_computed`] or [`PrefillNode::on_compute_failed`].
    /// `attached` is the request's attachment.
    fn start_prefill(
        &mut self,
        req: ReqId,
        attached: Option<&mut Self::Attached>,
        tokens: u32,
        dest: &[DestPage],
    );

    /// Stops computing `req`: once this returns no further put for it is issued
    /// (puts already issued may still be in flight).
    fn stop_prefill(&mut self, req: ReqId, attached: Option<&mut Self::Attached>);

    /// Asks the transport to drain every put issued so far; report completion with
    /// [`PrefillNode::on_drained`].
    fn flush(&mut self, req: ReqId, attached: Option<&mut Self::Attached>);

    /// Frees `req`'s source pages. Called only once its writes are drained (I5).
    fn release(&mut self, req: ReqId);
}

/// What a `Prefill` asks the prefill node to compute and write.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PrefillAsk {
    /// Owning tenant.
    pub tenant: u64,
    /// Prompt tokens to prefill.
    pub prompt_tokens: u32,
    /// The request's output budget (admission counts the first token here).
    pub max_tokens: u32,
    /// The decode node's reserved pages, in logical block order.
    pub dest: Vec<DestPage>,
}

/// What the prefill node does once the drain it waits for completes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum AfterDrain {
    /// Release and send this `Commit`.
    Commit(Msg),
    /// Release and send `PrefillFailed`.
    Fail(FailReason),
    /// Release and send `AbortAck`.
    AbortAck,
    /// Release and tell the decode node `WriterQuiet` (the coordinator is gone).
    Quiet,
}

/// A request's state on the prefill node.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PrefillState {
    /// Admission refused; nothing held (terminal).
    Refused(Refusal),
    /// Admitted, source pages allocated, computing and writing.
    Computing {
        /// Tokens being prefilled.
        tokens: u32,
        /// Destination pages.
        dest: Vec<DestPage>,
    },
    /// Waiting for the transport to drain; source pages still held (I5).
    Draining(AfterDrain),
    /// Commit sent, source pages released; kept to re-send the commit.
    Committed(Msg),
    /// Failed after draining; pages released (terminal).
    Failed(FailReason),
    /// Aborted; nothing held (terminal tombstone).
    Aborted,
}

impl RequestState for PrefillState {
    fn is_terminal(&self) -> bool {
        !matches!(
            self,
            PrefillState::Computing { .. } | PrefillState::Draining(_)
        )
    }
}

/// The prefill side of the protocol for every request on one prefill node; `A` is
/// what the node's driver keeps with each request's record (`()` under the model
/// checker).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PrefillNode<A = ()> {
    reqs: Records<PrefillState, A>,
    /// The node drains ([`PrefillNode::begin_drain`]): new requests are refused.
    draining: bool,
    #[cfg(any(test, feature = "test-util"))]
    flaws: Flaws,
}

impl<A> Default for PrefillNode<A> {
    fn default() -> Self {
        Self {
            reqs: Records::default(),
            draining: false,
            #[cfg(any(test, feature = "test-util"))]
            flaws: Flaws::default(),
        }
    }
}

impl PrefillNode {
    /// An empty node whose requests carry no attachment (the model checker's).
    pub fn new() -> Self {
        Self::default()
    }

    /// A node with deliberate flaws (model checker tests only).
    #[cfg(any(test, feature = "test-util"))]
    #[doc(hidden)]
    pub fn with_flaws(flaws: Flaws) -> Self {
        Self {
            flaws,
            ..Self::default()
        }
    }
}

impl<A: RequestIo> PrefillNode<A> {
    /// An empty node whose requests carry an attachment of type `A`.
    pub fn with_attachments() -> Self {
        Self::default()
    }

    /// The node starts draining: from now on every new request is refused with
    /// [`Refusal::draining`] (a duplicate `Prefill` of a request it already has is
    /// answered from its record, as always); requests it computes or drains are
    /// untouched.
    pub fn begin_drain(&mut self) {
        self.draining = true;
    }

    /// Whether the node drains ([`PrefillNode::begin_drain`]).
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Every request's record (state machine, then tombstone).
    pub fn records(&self) -> &Records<PrefillState, A> {
        &self.reqs
    }

    /// Mutable records, to [`Records::forget`] tombstones and reach attachments.
    pub fn records_mut(&mut self) -> &mut Records<PrefillState, A> {
        &mut self.reqs
    }

    /// Dispatches a message addressed to the prefill node; `attached` is what the
    /// driver attaches to the request's record if this message creates it (a
    /// `Prefill` for a request the node has no record of; dropped otherwise; `None`
    /// under the model checker).
    pub fn on_msg(
        &mut self,
        msg: Msg,
        attached: Option<A>,
        env: &mut impl PrefillEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) {
        match msg {
            Msg::Prefill {
                req,
                tenant,
                prompt_tokens,
                max_tokens,
                dest,
            } => {
                let ask = PrefillAsk {
                    tenant,
                    prompt_tokens,
                    max_tokens,
                    dest,
                };
                self.on_prefill(req, ask, attached, env, out)
            }
            Msg::Abort { req } => self.on_abort(req, env, out),
            Msg::QuietQuery { req } => self.on_quiet_query(req, out),
            _ => {}
        }
    }

    /// `QuietQuery` from the decode node that holds `req`'s pages quarantined (its
    /// coordinator is gone): `WriterQuiet` at once when nothing is in flight and
    /// nothing will be. A request it never heard of gets a failed record first, so a
    /// `Prefill` still on its way from the coordinator computes and writes nothing
    /// (its coordinator, if alive after all, hears `PrefillFailed`); a request that
    /// ended (committed, failed, refused, aborted) writes nothing more. A request it
    /// still computes or drains gets no answer now: its coordinator ends it (commit,
    /// failure, abort), or, if the coordinator is gone too,
    /// [`on_coordinator_lost`](Self::on_coordinator_lost) sends `WriterQuiet` once its
    /// writes drained; the decode node asks again meanwhile.
    pub fn on_quiet_query(&mut self, req: ReqId, out: &mut Vec<Output>) {
        match self.reqs.get(&req) {
            Some(PrefillState::Computing { .. } | PrefillState::Draining(_))
                if !flaw!(self, prefill_quiet_while_writing) =>
            {
                return;
            }
            None if !flaw!(self, prefill_quiet_without_record) => {
                let reason = FailReason::new(
                    FailKind::Transport,
                    "the decode node gave up the reservation (its coordinator link closed) \
                     before this prefill node heard of the request",
                );
                self.set(req, PrefillState::Failed(reason));
            }
            _ => {}
        }
        send(out, Role::Decode, Msg::WriterQuiet { req });
    }

    /// `Prefill`: descriptor check, admission (I1) and allocation, then compute. A
    /// duplicate re-sends the latest reply (`Commit`, `PrefillFailed`, `Rejected`); a
    /// tombstone ignores it. A draining node refuses every new request
    /// ([`Refusal::draining`]). `attached` goes into the request's new record.
    pub fn on_prefill(
        &mut self,
        req: ReqId,
        ask: PrefillAsk,
        attached: Option<A>,
        env: &mut impl PrefillEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) {
        match self.reqs.get(&req) {
            None => {}
            Some(PrefillState::Committed(commit)) => {
                return send(out, Role::Decode, commit.clone());
            }
            Some(PrefillState::Failed(reason)) => {
                let reason = reason.clone();
                return send(out, Role::Coordinator, Msg::PrefillFailed { req, reason });
            }
            Some(PrefillState::Refused(refusal)) => {
                let reason = refusal.clone();
                let msg = Msg::Rejected {
                    req,
                    by: Role::Prefill,
                    reason,
                };
                return send(out, Role::Coordinator, msg);
            }
            Some(_) => return, // working on it, or aborted (tombstone)
        }
        let PrefillAsk {
            tenant,
            prompt_tokens,
            max_tokens,
            dest,
        } = ask;
        let mut attached = attached;
        if self.draining {
            let refusal = Refusal::draining(Role::Prefill);
            self.set_first(req, PrefillState::Refused(refusal.clone()), attached);
            let msg = Msg::Rejected {
                req,
                by: Role::Prefill,
                reason: refusal,
            };
            return send(out, Role::Coordinator, msg);
        }
        let needed = env.pages_for(prompt_tokens);
        if dest.len() != needed {
            let reason = FailReason::new(
                FailKind::Internal,
                format!(
                    "descriptor names {} pages but {prompt_tokens} prompt tokens need {needed}",
                    dest.len()
                ),
            );
            self.set_first(req, PrefillState::Failed(reason.clone()), attached);
            return send(out, Role::Coordinator, Msg::PrefillFailed { req, reason });
        }
        match env.admit_and_alloc(req, attached.as_mut(), tenant, prompt_tokens, max_tokens) {
            Ok(()) => {
                env.start_prefill(req, attached.as_mut(), prompt_tokens, &dest);
                let computing = PrefillState::Computing {
                    tokens: prompt_tokens,
                    dest,
                };
                self.set_first(req, computing, attached);
            }
            Err(refusal) => {
                if flaw!(self, prefill_placeholder_on_refusal)
                    && !dest.is_empty()
                    && env
                        .admit_and_alloc(req, attached.as_mut(), tenant, 1, 1)
                        .is_ok()
                {
                    // The incident: a one-token placeholder rides through the batch.
                    env.start_prefill(req, attached.as_mut(), 1, &dest[..1]);
                    let dest = dest[..1].to_vec();
                    let computing = PrefillState::Computing { tokens: 1, dest };
                    self.set_first(req, computing, attached);
                    return;
                }
                self.set_first(req, PrefillState::Refused(refusal.clone()), attached);
                let msg = Msg::Rejected {
                    req,
                    by: Role::Prefill,
                    reason: refusal,
                };
                send(out, Role::Coordinator, msg);
            }
        }
    }

    /// The engine computed every page of `req` and issued every put; `checksums[i]` is
    /// the checksum of the bytes put into `dest[i]`. Drains the transport before
    /// anything is released or committed (I5, S2).
    pub fn on_computed(
        &mut self,
        req: ReqId,
        first_token: u32,
        checksums: &[u32],
        env: &mut impl PrefillEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) {
        let Some(PrefillState::Computing { tokens, dest }) = self.reqs.get(&req) else {
            return;
        };
        if checksums.len() != dest.len() {
            let reason = FailReason::new(
                FailKind::Internal,
                format!(
                    "prefill produced {} page checksums for {} pages",
                    checksums.len(),
                    dest.len()
                ),
            );
            env.flush(req, self.reqs.attached_mut(req));
            self.set(req, PrefillState::Draining(AfterDrain::Fail(reason)));
            return;
        }
        let commit = Msg::Commit {
            req,
            tokens: *tokens,
            pages: dest
                .iter()
                .zip(checksums)
                .map(|(d, c)| PageCommit {
                    dest: *d,
                    checksum: *c,
                })
                .collect(),
            first_token,
        };
        if flaw!(self, prefill_commits_before_drain) {
            env.release(req);
            send(out, Role::Decode, commit.clone());
            self.set(req, PrefillState::Committed(commit));
            return;
        }
        env.flush(req, self.reqs.attached_mut(req));
        self.set(req, PrefillState::Draining(AfterDrain::Commit(commit)));
    }

    /// The engine failed computing `req` (it issues no further put): drain, then fail.
    pub fn on_compute_failed(
        &mut self,
        req: ReqId,
        reason: FailReason,
        env: &mut impl PrefillEnv<Attached = A>,
        _out: &mut Vec<Output>,
    ) {
        if let Some(PrefillState::Computing { .. }) = self.reqs.get(&req) {
            env.flush(req, self.reqs.attached_mut(req));
            self.set(req, PrefillState::Draining(AfterDrain::Fail(reason)));
        }
    }

    /// The transport drained (or failed) every put issued for `req` before the flush:
    /// nothing can land any more, so the source pages are released, then the commit,
    /// failure or abort ack goes out.
    pub fn on_drained(
        &mut self,
        req: ReqId,
        result: Result<(), FailReason>,
        env: &mut impl PrefillEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) {
        let Some(PrefillState::Draining(after)) = self.reqs.get(&req) else {
            return;
        };
        let after = after.clone();
        env.release(req);
        match (after, result) {
            (AfterDrain::Commit(commit), Ok(())) => {
                send(out, Role::Decode, commit.clone());
                self.set(req, PrefillState::Committed(commit));
            }
            (AfterDrain::Commit(_), Err(reason)) | (AfterDrain::Fail(reason), _) => {
                self.set(req, PrefillState::Failed(reason.clone()));
                send(out, Role::Coordinator, Msg::PrefillFailed { req, reason });
            }
            (AfterDrain::AbortAck, _) => {
                self.tombstone(req);
                let ack = Msg::AbortAck {
                    req,
                    from: Role::Prefill,
                };
                send(out, Role::Coordinator, ack);
            }
            (AfterDrain::Quiet, _) => {
                self.tombstone(req);
                send(out, Role::Decode, Msg::WriterQuiet { req });
            }
        }
    }

    /// The transition function: `req` is now in `state`.
    fn set(&mut self, req: ReqId, state: PrefillState) {
        self.set_first(req, state, None);
    }

    /// [`set`](Self::set) for a request's first state, which takes the driver's
    /// attachment.
    fn set_first(&mut self, req: ReqId, state: PrefillState, attached: Option<A>) {
        self.reqs.insert(req, state, attached);
    }

    fn tombstone(&mut self, req: ReqId) {
        if flaw!(self, prefill_forgets_aborts) {
            self.reqs.remove(&req);
        } else {
            self.set(req, PrefillState::Aborted);
        }
    }

    /// The coordinator of `req` is gone (its link closed): the node stops the request
    /// as for an `Abort` (stop, drain, release), and then tells the decode node
    /// `WriterQuiet` instead of acknowledging to nobody, so the decode node can free
    /// the pages it quarantined. A request with nothing in flight (committed, failed,
    /// refused, aborted, or never seen: a tombstone stops a late `Prefill`) is quiet at
    /// once.
    pub fn on_coordinator_lost(
        &mut self,
        req: ReqId,
        env: &mut impl PrefillEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) {
        match self.reqs.get(&req) {
            Some(PrefillState::Computing { .. }) => {
                env.stop_prefill(req, self.reqs.attached_mut(req));
                env.flush(req, self.reqs.attached_mut(req));
                self.set(req, PrefillState::Draining(AfterDrain::Quiet));
            }
            Some(PrefillState::Draining(_)) => {
                self.set(req, PrefillState::Draining(AfterDrain::Quiet));
            }
            // Nothing in flight: its writes drained, or it never wrote and (with a
            // tombstone) never will.
            Some(PrefillState::Refused(_)) => send(out, Role::Decode, Msg::WriterQuiet { req }),
            _ => {
                self.tombstone(req);
                send(out, Role::Decode, Msg::WriterQuiet { req });
            }
        }
    }

    /// `Abort`: stops computing, drains, releases, then acknowledges (from
    /// [`on_drained`](Self::on_drained) if writes may be in flight, at once otherwise).
    /// An unknown request gets a tombstone so a late `Prefill` is ignored.
    pub fn on_abort(
        &mut self,
        req: ReqId,
        env: &mut impl PrefillEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) {
        match self.reqs.get(&req) {
            Some(PrefillState::Computing { .. }) => {
                env.stop_prefill(req, self.reqs.attached_mut(req));
                env.flush(req, self.reqs.attached_mut(req));
                self.set(req, PrefillState::Draining(AfterDrain::AbortAck));
                return;
            }
            Some(PrefillState::Draining(_)) => {
                // Drop the pending commit or failure; ack once drained.
                self.set(req, PrefillState::Draining(AfterDrain::AbortAck));
                return;
            }
            Some(PrefillState::Refused(_)) => {} // keep the refusal: nothing held
            None | Some(PrefillState::Committed(_) | PrefillState::Failed(_)) => {
                self.tombstone(req)
            }
            Some(PrefillState::Aborted) => {}
        }
        let ack = Msg::AbortAck {
            req,
            from: Role::Prefill,
        };
        send(out, Role::Coordinator, ack);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::testkit::{dests, good, R};
    use crate::protocol::RefusalKind;

    #[test]
    fn the_writer_answers_a_quiet_query_once_it_will_write_nothing() {
        let quiet = |out: &[Output]| {
            out == [Output::Send {
                to: Role::Decode,
                msg: Msg::WriterQuiet { req: R },
            }]
        };
        // Never heard of the request: quiet at once, and a late Prefill is failed,
        // never computed.
        let mut node = PrefillNode::new();
        let mut env = FakePrefill {
            room: true,
            ..Default::default()
        };
        let mut out = Vec::new();
        node.on_msg(Msg::QuietQuery { req: R }, None, &mut env, &mut out);
        assert!(quiet(&out), "{out:?}");
        let mut late = Vec::new();
        node.on_prefill(R, ask(3, 20, 4, dests(2)), None, &mut env, &mut late);
        assert!(
            matches!(
                late.as_slice(),
                [Output::Send {
                    to: Role::Coordinator,
                    msg: Msg::PrefillFailed { .. }
                }]
            ),
            "{late:?}"
        );
        assert!(env.calls.is_empty(), "{:?}", env.calls);

        // Computing: no answer while its coordinator drives it; once the coordinator
        // is gone, quiet after the drain, and at once when asked again.
        let mut node = PrefillNode::new();
        let mut env = FakePrefill {
            room: true,
            ..Default::default()
        };
        node.on_prefill(R, ask(3, 20, 4, dests(2)), None, &mut env, &mut Vec::new());
        let mut out = Vec::new();
        node.on_quiet_query(R, &mut out);
        assert!(out.is_empty(), "{out:?}");
        node.on_coordinator_lost(R, &mut env, &mut out);
        node.on_quiet_query(R, &mut out);
        assert!(out.is_empty(), "no answer before the drain: {out:?}");
        node.on_drained(R, Ok(()), &mut env, &mut out);
        assert!(quiet(&out), "{out:?}");
        let mut again = Vec::new();
        node.on_quiet_query(R, &mut again);
        assert!(quiet(&again), "{again:?}");
    }

    /// A prefill environment that records the calls the protocol makes.
    #[derive(Default)]
    struct FakePrefill {
        calls: Vec<String>,
        room: bool,
    }

    fn ask(tenant: u64, prompt_tokens: u32, max_tokens: u32, dest: Vec<DestPage>) -> PrefillAsk {
        PrefillAsk {
            tenant,
            prompt_tokens,
            max_tokens,
            dest,
        }
    }

    impl PrefillEnv for FakePrefill {
        type Attached = ();

        fn pages_for(&self, tokens: u32) -> usize {
            tokens.div_ceil(16) as usize
        }
        fn admit_and_alloc(
            &mut self,
            _: ReqId,
            _: Option<&mut ()>,
            _: u64,
            p: u32,
            _: u32,
        ) -> Result<(), Refusal> {
            self.calls.push(format!("admit {p}"));
            if self.room {
                Ok(())
            } else {
                Err(Refusal {
                    kind: RefusalKind::TooLarge,
                    message: "prompt over pool".into(),
                })
            }
        }
        fn start_prefill(&mut self, _: ReqId, _: Option<&mut ()>, tokens: u32, dest: &[DestPage]) {
            self.calls.push(format!("start {tokens} {}", dest.len()));
        }
        fn stop_prefill(&mut self, _: ReqId, _: Option<&mut ()>) {
            self.calls.push("stop".into());
        }
        fn flush(&mut self, _: ReqId, _: Option<&mut ()>) {
            self.calls.push("flush".into());
        }
        fn release(&mut self, _: ReqId) {
            self.calls.push("release".into());
        }
    }

    #[test]
    fn prefill_commits_only_after_drain_and_release() {
        let mut node = PrefillNode::new();
        let mut env = FakePrefill {
            room: true,
            ..Default::default()
        };
        let mut out = Vec::new();
        node.on_prefill(R, ask(3, 20, 4, dests(2)), None, &mut env, &mut out);
        node.on_computed(R, 42, &[100, 101], &mut env, &mut out);
        assert!(out.is_empty(), "no commit before the drain");
        assert_eq!(env.calls, ["admit 20", "start 20 2", "flush"]);
        node.on_drained(R, Ok(()), &mut env, &mut out);
        assert_eq!(env.calls.last().unwrap(), "release");
        let [Output::Send {
            to: Role::Decode,
            msg:
                Msg::Commit {
                    tokens: 20,
                    pages,
                    first_token: 42,
                    ..
                },
        }] = out.as_slice()
        else {
            panic!("expected a commit, got {out:?}");
        };
        assert_eq!(pages, &good(&dests(2)));
        // A duplicated Prefill re-sends the commit and computes nothing.
        let mut again = Vec::new();
        node.on_prefill(R, ask(3, 20, 4, dests(2)), None, &mut env, &mut again);
        assert_eq!(again, out);
        assert_eq!(env.calls.len(), 4);
    }

    #[test]
    fn a_draining_prefill_node_refuses_new_requests_and_finishes_its_own() {
        let mut node = PrefillNode::new();
        let mut env = FakePrefill {
            room: true,
            ..Default::default()
        };
        let mut out = Vec::new();
        node.on_prefill(R, ask(3, 20, 4, dests(2)), None, &mut env, &mut out);
        node.begin_drain();
        assert!(node.is_draining());
        // A new request is refused before admission: nothing allocated.
        let other = ReqId(8);
        node.on_prefill(other, ask(3, 20, 4, dests(2)), None, &mut env, &mut out);
        let refused = [Output::Send {
            to: Role::Coordinator,
            msg: Msg::Rejected {
                req: other,
                by: Role::Prefill,
                reason: Refusal::draining(Role::Prefill),
            },
        }];
        assert_eq!(out, refused);
        assert_eq!(env.calls, ["admit 20", "start 20 2"]);
        // Its duplicate gets the same refusal.
        let mut again = Vec::new();
        node.on_prefill(other, ask(3, 20, 4, dests(2)), None, &mut env, &mut again);
        assert_eq!(again, refused);
        // The request it computes still commits.
        let mut out = Vec::new();
        node.on_computed(R, 42, &[100, 101], &mut env, &mut out);
        node.on_drained(R, Ok(()), &mut env, &mut out);
        assert!(
            matches!(
                out.as_slice(),
                [Output::Send {
                    to: Role::Decode,
                    msg: Msg::Commit { .. }
                }]
            ),
            "{out:?}"
        );
    }

    #[test]
    fn prefill_abort_acks_after_drain_and_leaves_tombstone() {
        let mut node = PrefillNode::new();
        let mut env = FakePrefill {
            room: true,
            ..Default::default()
        };
        let mut out = Vec::new();
        node.on_prefill(R, ask(3, 20, 4, dests(2)), None, &mut env, &mut out);
        node.on_abort(R, &mut env, &mut out);
        assert!(out.is_empty(), "no ack while writes may be in flight");
        node.on_computed(R, 42, &[1, 2], &mut env, &mut out); // late: ignored
        node.on_drained(R, Ok(()), &mut env, &mut out);
        assert_eq!(
            env.calls,
            ["admit 20", "start 20 2", "stop", "flush", "release"]
        );
        assert_eq!(
            out,
            [Output::Send {
                to: Role::Coordinator,
                msg: Msg::AbortAck {
                    req: R,
                    from: Role::Prefill
                }
            }]
        );
        // A late Prefill after the abort allocates nothing.
        let mut late = Vec::new();
        node.on_prefill(R, ask(3, 20, 4, dests(2)), None, &mut env, &mut late);
        assert!(late.is_empty());
        assert_eq!(env.calls.len(), 5);
        // Abort of an unknown request: acked at once, tombstone against a late Prefill.
        let other = ReqId(8);
        node.on_abort(other, &mut env, &mut late);
        assert_eq!(late.len(), 1);
        node.on_prefill(other, ask(3, 20, 4, dests(2)), None, &mut env, &mut late);
        assert_eq!(env.calls.len(), 5);
    }

    #[test]
    fn prefill_refusal_is_terminal_and_bad_descriptor_fails() {
        let mut node = PrefillNode::new();
        let mut env = FakePrefill::default();
        let mut out = Vec::new();
        node.on_prefill(R, ask(3, 20, 4, dests(2)), None, &mut env, &mut out);
        assert!(matches!(
            out.as_slice(),
            [Output::Send {
                to: Role::Coordinator,
                msg: Msg::Rejected {
                    by: Role::Prefill,
                    ..
                }
            }]
        ));
        assert_eq!(
            env.calls,
            ["admit 20"],
            "nothing started for a refused request"
        );
        let mut out = Vec::new();
        node.on_prefill(ReqId(9), ask(3, 20, 4, dests(1)), None, &mut env, &mut out);
        assert!(matches!(
            out.as_slice(),
            [Output::Send {
                msg: Msg::PrefillFailed { .. },
                ..
            }]
        ));
        assert_eq!(
            env.calls.len(),
            1,
            "no admission for a malformed descriptor"
        );
    }
}
