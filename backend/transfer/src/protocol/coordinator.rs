//! The coordinator: the gateway-side state machine of one request.

use super::flaws::flaw;
#[cfg(any(test, feature = "test-util"))]
use super::flaws::Flaws;
use super::messages::{send, DecodeOutcome, FailKind, Failure, Msg, Outcome, Output, ReqId, Role};
use crate::transport::DestPage;

/// Where a request stands at its coordinator.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CoordPhase {
    /// `Prealloc` sent; waiting for `Descriptor` or `Rejected`.
    Reserving,
    /// `Prefill` sent; waiting for `Committed`, `CommitFailed`, `PrefillFailed` or `Rejected`.
    Transferring {
        /// Destination pages from the descriptor.
        dest: Vec<DestPage>,
    },
    /// `Committed` received; waiting for `Finished`.
    Decoding,
    /// `Abort` sent to the prefill node; waiting for its `AbortAck`.
    AbortingPrefill,
    /// `Abort` sent to the decode node; waiting for its `AbortAck`.
    AbortingDecode,
    /// Nothing held anywhere; [`Output::Released`] was emitted.
    Done,
}

/// The gateway-side driver of one request (DESIGN.md §4 steps 3-7, §6).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Coordinator {
    req: ReqId,
    tenant: u64,
    prompt_tokens: u32,
    max_tokens: u32,
    phase: CoordPhase,
    outcome: Option<Outcome>,
    prefill_down: bool,
    decode_down: bool,
    #[cfg(any(test, feature = "test-util"))]
    flaws: Flaws,
}

impl Coordinator {
    /// Starts a request that passed the gateway's admission (I1): sends `Prealloc` to
    /// the decode node.
    pub fn start(
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
        out: &mut Vec<Output>,
    ) -> Self {
        let c = Self::new(req, tenant, prompt_tokens, max_tokens);
        send(out, Role::Decode, c.prealloc());
        c
    }

    /// [`start`](Self::start) with deliberate flaws (model checker tests only).
    #[cfg(any(test, feature = "test-util"))]
    #[doc(hidden)]
    pub fn start_with_flaws(
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
        flaws: Flaws,
        out: &mut Vec<Output>,
    ) -> Self {
        let c = Self {
            flaws,
            ..Self::new(req, tenant, prompt_tokens, max_tokens)
        };
        send(out, Role::Decode, c.prealloc());
        c
    }

    /// A request about to send its `Prealloc`.
    fn new(req: ReqId, tenant: u64, prompt_tokens: u32, max_tokens: u32) -> Self {
        Self {
            req,
            tenant,
            prompt_tokens,
            max_tokens,
            phase: CoordPhase::Reserving,
            outcome: None,
            prefill_down: false,
            decode_down: false,
            #[cfg(any(test, feature = "test-util"))]
            flaws: Flaws::default(),
        }
    }

    /// The request.
    pub fn req(&self) -> ReqId {
        self.req
    }

    /// Current phase.
    pub fn phase(&self) -> &CoordPhase {
        &self.phase
    }

    /// The outcome, once decided.
    pub fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    /// Whether every node released the request.
    pub fn is_done(&self) -> bool {
        self.phase == CoordPhase::Done
    }

    fn prealloc(&self) -> Msg {
        Msg::Prealloc {
            req: self.req,
            tenant: self.tenant,
            prompt_tokens: self.prompt_tokens,
            max_tokens: self.max_tokens,
        }
    }

    fn prefill(&self, dest: &[DestPage]) -> Msg {
        Msg::Prefill {
            req: self.req,
            tenant: self.tenant,
            prompt_tokens: self.prompt_tokens,
            max_tokens: self.max_tokens,
            dest: dest.to_vec(),
        }
    }

    /// Decides the outcome (first decision wins: S4).
    fn decide(&mut self, outcome: Outcome, out: &mut Vec<Output>) {
        if self.outcome.is_none() {
            self.outcome = Some(outcome.clone());
            out.push(Output::Outcome(outcome));
        }
    }

    fn finish(&mut self, out: &mut Vec<Output>) {
        self.phase = CoordPhase::Done;
        out.push(Output::Released);
    }

    /// Aborts the decode side (after the prefill side is quiet): its pages are freed.
    fn abort_decode(&mut self, out: &mut Vec<Output>) {
        if self.decode_down {
            self.finish(out);
        } else {
            self.phase = CoordPhase::AbortingDecode;
            send(out, Role::Decode, Msg::Abort { req: self.req });
        }
    }

    /// Aborts the prefill side first; the decode side follows on its `AbortAck` (S2).
    fn abort_prefill(&mut self, out: &mut Vec<Output>) {
        if self.prefill_down {
            self.abort_decode(out);
        } else {
            self.phase = CoordPhase::AbortingPrefill;
            send(out, Role::Prefill, Msg::Abort { req: self.req });
            if flaw!(self, abort_decode_with_prefill) && !self.decode_down {
                send(out, Role::Decode, Msg::Abort { req: self.req });
            }
        }
    }

    /// Handles a message from a node about this request (others are ignored).
    pub fn on_msg(&mut self, msg: Msg, out: &mut Vec<Output>) {
        if msg.req() != self.req {
            return;
        }
        match (&self.phase, msg) {
            (CoordPhase::Reserving, Msg::Descriptor { pages, .. }) => {
                self.on_descriptor(pages, out)
            }
            (CoordPhase::Reserving, Msg::Rejected { reason, .. }) => {
                if flaw!(self, coordinator_proceeds_on_rejected) {
                    // The incident's shape: a refused request treated as ready.
                    self.on_descriptor(Vec::new(), out);
                    return;
                }
                // The decode node refused: nothing is held anywhere.
                self.decide(Outcome::Rejected(reason), out);
                self.finish(out);
            }
            (CoordPhase::Transferring { .. }, Msg::Committed { .. }) => {
                self.phase = CoordPhase::Decoding;
            }
            (CoordPhase::Transferring { .. }, Msg::CommitFailed { reason, .. }) => {
                // The decode node freed its pages; the prefill drained before committing.
                self.decide(Outcome::Failed(Failure::Commit(reason)), out);
                self.finish(out);
            }
            (CoordPhase::Transferring { .. }, Msg::PrefillFailed { reason, .. }) => {
                // The prefill drained and released; free the decode reservation.
                self.decide(Outcome::Failed(Failure::Prefill(reason)), out);
                self.abort_decode(out);
            }
            (CoordPhase::Transferring { .. }, Msg::Rejected { reason, .. }) => {
                // The prefill node refused (nothing written); free the decode reservation.
                self.decide(Outcome::Rejected(reason), out);
                self.abort_decode(out);
            }
            (CoordPhase::Reserving | CoordPhase::Transferring { .. }, Msg::LeaseExpired { .. }) => {
                // The decode node quarantined the pages; the prefill side may still be
                // writing: quiet it first, then abort the decode side (which frees them).
                self.decide(Outcome::Failed(Failure::LeaseExpired), out);
                self.abort_prefill(out);
            }
            // Decode sends `Finished` only for a sequence it admitted on a verified
            // commit, so it also stands for a `Committed` that was lost.
            (
                CoordPhase::Transferring { .. } | CoordPhase::Decoding,
                Msg::Finished { outcome, .. },
            ) => {
                let o = match outcome {
                    DecodeOutcome::Completed => Outcome::Succeeded,
                    // The decode node saw the client leave before this coordinator did.
                    DecodeOutcome::Failed { reason } if reason.kind == FailKind::ClientGone => {
                        Outcome::Aborted
                    }
                    DecodeOutcome::Failed { reason } => Outcome::Failed(Failure::Decode(reason)),
                };
                self.decide(o, out);
                self.finish(out);
            }
            (
                CoordPhase::AbortingPrefill,
                Msg::AbortAck {
                    from: Role::Prefill,
                    ..
                },
            ) => {
                self.abort_decode(out);
            }
            (
                CoordPhase::AbortingDecode,
                Msg::AbortAck {
                    from: Role::Decode, ..
                },
            ) => {
                self.finish(out);
            }
            _ => {} // duplicates, late replies: nothing to do
        }
    }

    fn on_descriptor(&mut self, pages: Vec<DestPage>, out: &mut Vec<Output>) {
        if self.prefill_down {
            self.decide(Outcome::Failed(Failure::NodeDown(Role::Prefill)), out);
            self.abort_decode(out);
            return;
        }
        send(out, Role::Prefill, self.prefill(&pages));
        self.phase = CoordPhase::Transferring { dest: pages };
    }

    /// The client went away (disconnect, timeout, shutdown): abort with acks (I6).
    /// No-op once the outcome is decided.
    pub fn on_client_gone(&mut self, out: &mut Vec<Output>) {
        if self.outcome.is_some() {
            return;
        }
        self.decide(Outcome::Aborted, out);
        match self.phase {
            CoordPhase::Reserving | CoordPhase::Decoding => self.abort_decode(out),
            CoordPhase::Transferring { .. } => self.abort_prefill(out),
            _ => {}
        }
    }

    /// Nothing arrived for a while: re-send the message this phase waits on.
    pub fn on_timeout(&mut self, out: &mut Vec<Output>) {
        let req = self.req;
        match &self.phase {
            CoordPhase::Reserving => send(out, Role::Decode, self.prealloc()),
            CoordPhase::Transferring { dest } => send(out, Role::Prefill, self.prefill(dest)),
            CoordPhase::Decoding => send(out, Role::Decode, Msg::Poll { req }),
            CoordPhase::AbortingPrefill => send(out, Role::Prefill, Msg::Abort { req }),
            CoordPhase::AbortingDecode => send(out, Role::Decode, Msg::Abort { req }),
            CoordPhase::Done => {}
        }
    }

    /// The failure detector declared `role`'s node dead. A dead node holds nothing and
    /// writes nothing (its transport connection is gone), so it counts as having
    /// acknowledged every abort.
    pub fn on_node_down(&mut self, role: Role, out: &mut Vec<Output>) {
        match role {
            Role::Prefill => self.prefill_down = true,
            Role::Decode => self.decode_down = true,
            Role::Coordinator => return,
        }
        match (&self.phase, role) {
            // The writer is gone before it was sent anything: nothing of it can land.
            // The reservation is freed now, not once pages come (a request queued at
            // a full decode node would wait that long to go on elsewhere).
            (CoordPhase::Reserving, Role::Prefill) => {
                self.decide(Outcome::Failed(Failure::NodeDown(Role::Prefill)), out);
                self.abort_decode(out);
            }
            (CoordPhase::Reserving, Role::Decode) => {
                self.decide(Outcome::Failed(Failure::NodeDown(Role::Decode)), out);
                self.finish(out);
            }
            (CoordPhase::Transferring { .. }, Role::Prefill) => {
                self.decide(Outcome::Failed(Failure::NodeDown(Role::Prefill)), out);
                self.abort_decode(out);
            }
            (CoordPhase::Transferring { .. }, Role::Decode) => {
                // The prefill may still be writing: stop it before anything else.
                self.decide(Outcome::Failed(Failure::NodeDown(Role::Decode)), out);
                self.abort_prefill(out);
            }
            (CoordPhase::Decoding, Role::Decode) => {
                let o = if flaw!(self, coordinator_success_on_decode_crash) {
                    Outcome::Succeeded
                } else {
                    Outcome::Failed(Failure::NodeDown(Role::Decode))
                };
                self.decide(o, out);
                self.finish(out);
            }
            (CoordPhase::AbortingPrefill, Role::Prefill) => self.abort_decode(out),
            (CoordPhase::AbortingDecode, Role::Decode) => self.finish(out),
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::testkit::{dests, R};
    use crate::protocol::{Refusal, RefusalKind};

    /// A coordinator that has its descriptor (two pages) and sent `Prefill`.
    fn transferring() -> (Coordinator, Vec<Output>) {
        let mut out = Vec::new();
        let mut c = Coordinator::start(R, 3, 20, 4, &mut out);
        c.on_msg(
            Msg::Descriptor {
                req: R,
                pages: dests(2),
            },
            &mut out,
        );
        (c, out)
    }

    /// `role`'s node is declared down: the outcome says so, and `next` is sent an
    /// `Abort` (`out` is cleared before and after).
    fn down_then_abort(c: &mut Coordinator, role: Role, next: Role, out: &mut Vec<Output>) {
        out.clear();
        c.on_node_down(role, out);
        assert_eq!(
            out[0],
            Output::Outcome(Outcome::Failed(Failure::NodeDown(role)))
        );
        assert_eq!(sends(out), [(next, Msg::Abort { req: R })]);
        out.clear();
    }

    /// `role`'s `AbortAck` for [`R`].
    fn ack(c: &mut Coordinator, role: Role, out: &mut Vec<Output>) {
        c.on_msg(Msg::AbortAck { req: R, from: role }, out);
    }

    fn sends(out: &[Output]) -> Vec<(Role, Msg)> {
        out.iter()
            .filter_map(|o| match o {
                Output::Send { to, msg } => Some((*to, msg.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn coordinator_happy_path() {
        let mut out = Vec::new();
        let mut c = Coordinator::start(R, 3, 20, 4, &mut out);
        assert!(matches!(
            sends(&out)[..],
            [(Role::Decode, Msg::Prealloc { .. })]
        ));
        out.clear();
        c.on_msg(
            Msg::Descriptor {
                req: R,
                pages: dests(2),
            },
            &mut out,
        );
        assert!(matches!(
            sends(&out)[..],
            [(Role::Prefill, Msg::Prefill { .. })]
        ));
        c.on_msg(Msg::Committed { req: R }, &mut out);
        assert_eq!(c.phase(), &CoordPhase::Decoding);
        out.clear();
        c.on_msg(
            Msg::Finished {
                req: R,
                outcome: DecodeOutcome::Completed,
            },
            &mut out,
        );
        assert_eq!(out, [Output::Outcome(Outcome::Succeeded), Output::Released]);
        c.on_client_gone(&mut out);
        assert_eq!(out.len(), 2, "a decided outcome never changes");
    }

    #[test]
    fn coordinator_aborts_prefill_before_decode() {
        let (mut c, mut out) = transferring();
        out.clear();
        c.on_client_gone(&mut out);
        assert_eq!(out[0], Output::Outcome(Outcome::Aborted));
        assert_eq!(sends(&out), [(Role::Prefill, Msg::Abort { req: R })]);
        out.clear();
        ack(&mut c, Role::Decode, &mut out);
        assert!(out.is_empty(), "only the prefill ack moves on");
        ack(&mut c, Role::Prefill, &mut out);
        assert_eq!(sends(&out), [(Role::Decode, Msg::Abort { req: R })]);
        out.clear();
        ack(&mut c, Role::Decode, &mut out);
        assert_eq!(out, [Output::Released]);
    }

    #[test]
    fn coordinator_recovers_lost_replies() {
        let (mut c, mut out) = transferring();
        // `Committed` was lost: the timeout re-sends `Prefill` (prefill re-sends its
        // commit, decode its latest reply), and `Finished` alone completes the request.
        out.clear();
        c.on_timeout(&mut out);
        assert!(matches!(
            sends(&out)[..],
            [(Role::Prefill, Msg::Prefill { .. })]
        ));
        out.clear();
        c.on_msg(
            Msg::Finished {
                req: R,
                outcome: DecodeOutcome::Completed,
            },
            &mut out,
        );
        assert_eq!(out, [Output::Outcome(Outcome::Succeeded), Output::Released]);
    }

    #[test]
    fn a_writer_lost_while_decode_reserves_frees_the_reservation_at_once() {
        let mut out = Vec::new();
        let mut c = Coordinator::start(R, 3, 20, 4, &mut out);
        down_then_abort(&mut c, Role::Prefill, Role::Decode, &mut out);
        // A descriptor that crossed the abort: the writer is never sent anything.
        c.on_msg(
            Msg::Descriptor {
                req: R,
                pages: dests(2),
            },
            &mut out,
        );
        assert!(sends(&out).is_empty(), "{out:?}");
        ack(&mut c, Role::Decode, &mut out);
        assert_eq!(out, [Output::Released]);
    }

    #[test]
    fn coordinator_treats_a_dead_node_as_acked() {
        let (mut c, mut out) = transferring();
        // Decode died mid-transfer: stop the prefill first, then nothing is left.
        down_then_abort(&mut c, Role::Decode, Role::Prefill, &mut out);
        ack(&mut c, Role::Prefill, &mut out);
        assert_eq!(out, [Output::Released]);

        // Prefill died mid-transfer: free the decode reservation at once.
        let (mut c, mut out) = transferring();
        out.clear();
        c.on_node_down(Role::Prefill, &mut out);
        assert_eq!(sends(&out), [(Role::Decode, Msg::Abort { req: R })]);
    }

    #[test]
    fn coordinator_rejection_is_terminal() {
        let mut out = Vec::new();
        let mut c = Coordinator::start(R, 3, 20, 4, &mut out);
        out.clear();
        let reason = Refusal {
            kind: RefusalKind::TooLarge,
            message: "prompt over pool".into(),
        };
        c.on_msg(
            Msg::Rejected {
                req: R,
                by: Role::Decode,
                reason: reason.clone(),
            },
            &mut out,
        );
        assert_eq!(
            out,
            [Output::Outcome(Outcome::Rejected(reason)), Output::Released]
        );
        out.clear();
        c.on_msg(
            Msg::Descriptor {
                req: R,
                pages: dests(2),
            },
            &mut out,
        );
        c.on_timeout(&mut out);
        assert!(out.is_empty(), "nothing is sent for a rejected request");
    }
}
