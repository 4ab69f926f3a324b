//! The prefill node's state machine, for every request on one prefill node:
//! admission and allocation, computing and writing the prompt's KV, draining the
//! transport before anything is released or committed (I5), aborts, and answering a
//! decode node that asks whether it is quiet.

use super::flaws::flaw;
#[cfg(any(test, feature = "test-util"))]
use super::flaws::Flaws;
use super::messages::{send, FailKind, FailReason, Msg, Output, PageCommit, Refusal, ReqId, Role};
use super::records::{Records, RequestState};
use crate::transport::DestPage;

/// The prefill node's pool, engine and transport as the protocol sees them.
pub trait PrefillEnv {
    /// Pages needed to hold `tokens` tokens (the descriptor must name that many).
    fn pages_for(&self, tokens: u32) -> usize;

    /// Admission (I1) and allocation of source pages, all or nothing.
    fn admit_and_alloc(
        &mut self,
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
    ) -> Result<(), Refusal>;

    /// Starts computing the prompt's KV (`tokens` tokens); page `i` is put into
    /// `dest[i]` through the transport once computed. Report the end with
    /// [`PrefillNode::on_computed`] or [`PrefillNode::on_compute_failed`].
    fn start_prefill(&mut self, req: ReqId, tokens: u32, dest: &[DestPage]);

    /// Stops computing `req`: once this returns no further put for it is issued
    /// (puts already issued may still be in flight).
    fn stop_prefill(&mut self, req: ReqId);

    /// Asks the transport to drain every put issued so far; report completion with
    /// [`PrefillNode::on_drained`].
    fn flush(&mut self, req: ReqId);

    /// Frees `req`'s source pages. Called only once its writes are drained (I5).
    fn release(&mut self, req: ReqId);
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

/// The prefill side of the protocol for every request on one prefill node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PrefillNode {
    reqs: Records<PrefillState>,
    /// The node drains ([`PrefillNode::begin_drain`]): new requests are refused.
    draining: bool,
    #[cfg(any(test, feature = "test-util"))]
    flaws: Flaws,
}

impl PrefillNode {
    /// An empty node.
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
    pub fn records(&self) -> &Records<PrefillState> {
        &self.reqs
    }

    /// Mutable records, to [`Records::forget`] tombstones.
    pub fn records_mut(&mut self) -> &mut Records<PrefillState> {
        &mut self.reqs
    }

    /// Dispatches a message addressed to the prefill node.
    pub fn on_msg(&mut self, msg: Msg, env: &mut impl PrefillEnv, out: &mut Vec<Output>) {
        match msg {
            Msg::Prefill {
                req,
                tenant,
                prompt_tokens,
                max_tokens,
                dest,
            } => self.on_prefill(req, tenant, prompt_tokens, max_tokens, dest, env, out),
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
                self.reqs.insert(req, PrefillState::Failed(reason));
            }
            _ => {}
        }
        send(out, Role::Decode, Msg::WriterQuiet { req });
    }

    /// `Prefill`: descriptor check, admission (I1) and allocation, then compute. A
    /// duplicate re-sends the latest reply (`Commit`, `PrefillFailed`, `Rejected`); a
    /// tombstone ignores it. A draining node refuses every new request
    /// ([`Refusal::draining`]).
    #[allow(clippy::too_many_arguments)]
    pub fn on_prefill(
        &mut self,
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
        dest: Vec<DestPage>,
        env: &mut impl PrefillEnv,
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
        if self.draining {
            let refusal = Refusal::draining(Role::Prefill);
            self.reqs
                .insert(req, PrefillState::Refused(refusal.clone()));
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
            self.reqs.insert(req, PrefillState::Failed(reason.clone()));
            return send(out, Role::Coordinator, Msg::PrefillFailed { req, reason });
        }
        match env.admit_and_alloc(req, tenant, prompt_tokens, max_tokens) {
            Ok(()) => {
                env.start_prefill(req, prompt_tokens, &dest);
                self.reqs.insert(
                    req,
                    PrefillState::Computing {
                        tokens: prompt_tokens,
                        dest,
                    },
                );
            }
            Err(refusal) => {
                if flaw!(self, prefill_placeholder_on_refusal)
                    && !dest.is_empty()
                    && env.admit_and_alloc(req, tenant, 1, 1).is_ok()
                {
                    // The incident: a one-token placeholder rides through the batch.
                    env.start_prefill(req, 1, &dest[..1]);
                    let dest = dest[..1].to_vec();
                    self.reqs
                        .insert(req, PrefillState::Computing { tokens: 1, dest });
                    return;
                }
                self.reqs
                    .insert(req, PrefillState::Refused(refusal.clone()));
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
        env: &mut impl PrefillEnv,
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
            env.flush(req);
            self.reqs
                .insert(req, PrefillState::Draining(AfterDrain::Fail(reason)));
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
            self.reqs.insert(req, PrefillState::Committed(commit));
            return;
        }
        env.flush(req);
        self.reqs
            .insert(req, PrefillState::Draining(AfterDrain::Commit(commit)));
    }

    /// The engine failed computing `req` (it issues no further put): drain, then fail.
    pub fn on_compute_failed(
        &mut self,
        req: ReqId,
        reason: FailReason,
        env: &mut impl PrefillEnv,
        _out: &mut Vec<Output>,
    ) {
        if let Some(PrefillState::Computing { .. }) = self.reqs.get(&req) {
            env.flush(req);
            self.reqs
                .insert(req, PrefillState::Draining(AfterDrain::Fail(reason)));
        }
    }

    /// The transport drained (or failed) every put issued for `req` before the flush:
    /// nothing can land any more, so the source pages are released, then the commit,
    /// failure or abort ack goes out.
    pub fn on_drained(
        &mut self,
        req: ReqId,
        result: Result<(), FailReason>,
        env: &mut impl PrefillEnv,
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
                self.reqs.insert(req, PrefillState::Committed(commit));
            }
            (AfterDrain::Commit(_), Err(reason)) | (AfterDrain::Fail(reason), _) => {
                self.reqs.insert(req, PrefillState::Failed(reason.clone()));
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

    fn tombstone(&mut self, req: ReqId) {
        if flaw!(self, prefill_forgets_aborts) {
            self.reqs.remove(&req);
        } else {
            self.reqs.insert(req, PrefillState::Aborted);
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
        env: &mut impl PrefillEnv,
        out: &mut Vec<Output>,
    ) {
        match self.reqs.get(&req) {
            Some(PrefillState::Computing { .. }) => {
                env.stop_prefill(req);
                env.flush(req);
                self.reqs
                    .insert(req, PrefillState::Draining(AfterDrain::Quiet));
            }
            Some(PrefillState::Draining(_)) => {
                self.reqs
                    .insert(req, PrefillState::Draining(AfterDrain::Quiet));
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
    pub fn on_abort(&mut self, req: ReqId, env: &mut impl PrefillEnv, out: &mut Vec<Output>) {
        match self.reqs.get(&req) {
            Some(PrefillState::Computing { .. }) => {
                env.stop_prefill(req);
                env.flush(req);
                self.reqs
                    .insert(req, PrefillState::Draining(AfterDrain::AbortAck));
                return;
            }
            Some(PrefillState::Draining(_)) => {
                // Drop the pending commit or failure; ack once drained.
                self.reqs
                    .insert(req, PrefillState::Draining(AfterDrain::AbortAck));
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
        node.on_msg(Msg::QuietQuery { req: R }, &mut env, &mut out);
        assert!(quiet(&out), "{out:?}");
        let mut late = Vec::new();
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut late);
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
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut Vec::new());
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

    impl PrefillEnv for FakePrefill {
        fn pages_for(&self, tokens: u32) -> usize {
            tokens.div_ceil(16) as usize
        }
        fn admit_and_alloc(&mut self, _: ReqId, _: u64, p: u32, _: u32) -> Result<(), Refusal> {
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
        fn start_prefill(&mut self, _: ReqId, tokens: u32, dest: &[DestPage]) {
            self.calls.push(format!("start {tokens} {}", dest.len()));
        }
        fn stop_prefill(&mut self, _: ReqId) {
            self.calls.push("stop".into());
        }
        fn flush(&mut self, _: ReqId) {
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
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut out);
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
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut again);
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
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut out);
        node.begin_drain();
        assert!(node.is_draining());
        // A new request is refused before admission: nothing allocated.
        let other = ReqId(8);
        node.on_prefill(other, 3, 20, 4, dests(2), &mut env, &mut out);
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
        node.on_prefill(other, 3, 20, 4, dests(2), &mut env, &mut again);
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
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut out);
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
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut late);
        assert!(late.is_empty());
        assert_eq!(env.calls.len(), 5);
        // Abort of an unknown request: acked at once, tombstone against a late Prefill.
        let other = ReqId(8);
        node.on_abort(other, &mut env, &mut late);
        assert_eq!(late.len(), 1);
        node.on_prefill(other, 3, 20, 4, dests(2), &mut env, &mut late);
        assert_eq!(env.calls.len(), 5);
    }

    #[test]
    fn prefill_refusal_is_terminal_and_bad_descriptor_fails() {
        let mut node = PrefillNode::new();
        let mut env = FakePrefill::default();
        let mut out = Vec::new();
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut out);
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
        node.on_prefill(ReqId(9), 3, 20, 4, dests(1), &mut env, &mut out);
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
