//! Starting a request again on other nodes when a node fails (issue 36): from the
//! beginning before its first token, as a continuation after it.
//!
//! Two pure machines decide it; the coordinator's driver only carries out the answer:
//! - [`StreamFence`], one per client stream: which attempt may write to the client
//!   and whether a token already reached it. Deciding a restart and admitting a
//!   token are one step each on the same fence, so a token of a failed attempt can
//!   never follow the decision to start again (the driver holds the fence under one
//!   lock), and a continuation starts from exactly the tokens the client has;
//! - [`Attempts`], one per request: whether the outcome of a released attempt is one
//!   another pair may cure (the node failed, not the request), within a bounded
//!   number of attempts and a deadline, and which nodes the next pair must avoid.
//!
//! A request is started again only when every node let go of the failed attempt
//! (`Released`: nothing is held for it anywhere). Without tokens it starts from the
//! beginning; after tokens, when the driver can continue it (the engine's
//! `Resume`: the prompt plus the tokens the client has, the sampler's RNG position),
//! it continues where the client's stream stands, so the client sees one answer with
//! no duplicate and no gap. Usage is billed from the answer that reached the client
//! (its `Done`, which counts the whole request); the compute an attempt lost to a
//! node's failure used is not billed (docs/transfer-protocol.md, "Retry and
//! continuation").
//!
//! `backend/transfer/tests/retry_model.rs` model-checks both with stateright: tokens
//! from one attempt only, in order, at most one end, bounded attempts, and every
//! request answered.

use super::messages::{FailKind, Failure, Outcome, Role};
use std::time::Duration;

/// What a client stream receives, as the fence sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StreamItem {
    /// A generated token.
    Token,
    /// The stream's one end (`Done` or an error).
    End,
}

/// Which attempt of a request may write to its client stream, and what the client
/// received so far. Attempt numbers start at 0.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct StreamFence {
    attempt: u32,
    streamed: bool,
    ended: bool,
}

impl StreamFence {
    /// The attempt whose events the client receives.
    pub fn attempt(&self) -> u32 {
        self.attempt
    }

    /// Whether a token reached the client.
    pub fn streamed(&self) -> bool {
        self.streamed
    }

    /// Whether an item of `attempt` goes to the client: only the current attempt's,
    /// and nothing after the stream's end. An admitted token marks the stream as
    /// streamed (no restart from then on).
    pub fn admit(&mut self, attempt: u32, item: StreamItem) -> bool {
        if attempt != self.attempt || self.ended {
            return false;
        }
        match item {
            StreamItem::Token => self.streamed = true,
            StreamItem::End => self.ended = true,
        }
        true
    }

    /// Fences off the current attempt so that another may start: the new attempt's
    /// number, or `None` once the stream ended, or once a token reached the client
    /// unless the request can be continued (`continuable`: the next attempt resumes
    /// after the tokens the client has).
    pub fn restart(&mut self, continuable: bool) -> Option<u32> {
        if self.ended || (self.streamed && !continuable) {
            return None;
        }
        self.attempt += 1;
        Some(self.attempt)
    }
}

/// How far a request may be retried before its first token.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct RetryPolicy {
    /// Attempts that may fail on a node's failure before the request fails with the
    /// last attempt's error (so at most `max_failed + 1` attempts compute anything).
    /// Refusals by draining nodes do not count: they computed nothing, and each
    /// draining node refuses a request at most once (it is avoided afterwards).
    pub max_failed: u32,
    /// No restart when the client has waited this long without progress: since the
    /// failed attempt started or since its last token, whichever is later.
    pub deadline: Duration,
}

impl Default for RetryPolicy {
    /// Two restarts after failures, each within 30 s of the last progress.
    fn default() -> Self {
        Self {
            max_failed: 2,
            deadline: Duration::from_secs(30),
        }
    }
}

/// Why a released attempt may be started again elsewhere: the node to avoid, and
/// whether it counts against [`RetryPolicy::max_failed`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cause {
    /// The role of the node that failed or refused.
    pub role: Role,
    /// Whether it counts as a failed attempt (a drain refusal does not).
    pub counts: bool,
    /// Whether the node ended the request for a drain and keeps its computed
    /// pages for the next attempt to move ([`Retry::Restart::move_from`]).
    pub moves: bool,
}

/// The node that writes an attempt's prompt KV into its decode node: a prefill
/// node, or a draining decode node that moves a request's KV (its pages are in
/// that node's prefix cache).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Writer {
    /// [`Role::Prefill`] or [`Role::Decode`].
    pub role: Role,
    /// The node's index among the nodes of its role.
    pub index: usize,
}

impl Writer {
    /// Prefill node `index`.
    pub fn prefill(index: usize) -> Self {
        Self {
            role: Role::Prefill,
            index,
        }
    }
}

impl Cause {
    /// The cause of `outcome` when another pair may cure it: a drain refusal, a node
    /// that died or went silent past the failure detector's limit, a decode
    /// reservation whose lease ran out before the prefill node committed (a stalled
    /// or overloaded prefill node), a transfer into the decode node that failed, or
    /// a drained decode node's deadline. `None` for everything else: success, aborts,
    /// admission refusals (another node would refuse as well), integrity failures
    /// (a refused commit must surface, not be hidden by a retry) and failures the
    /// node reported itself.
    pub fn of(outcome: &Outcome) -> Option<Self> {
        match outcome {
            Outcome::Rejected(r) => r.drained_by().map(|role| Self {
                role,
                counts: false,
                moves: false,
            }),
            Outcome::Failed(Failure::NodeDown(role)) if *role != Role::Coordinator => Some(Self {
                role: *role,
                counts: true,
                moves: false,
            }),
            Outcome::Failed(Failure::LeaseExpired) => Some(Self {
                role: Role::Prefill,
                counts: true,
                moves: false,
            }),
            // The prefill node's page writes or flush into the decode node failed
            // (most often: that decode node died while its transfer ran, before the
            // failure detector said so). Another decode node is tried.
            Outcome::Failed(Failure::Prefill(r)) if r.kind == FailKind::Transport => Some(Self {
                role: Role::Decode,
                counts: true,
                moves: false,
            }),
            // A draining decode node ended a running request: planned, so it does
            // not count (the node is avoided afterwards); when it keeps the
            // request's computed pages, the next attempt moves them.
            Outcome::Failed(Failure::Decode(r))
                if matches!(r.kind, FailKind::Drained | FailKind::Moving) =>
            {
                Some(Self {
                    role: Role::Decode,
                    counts: false,
                    moves: r.kind == FailKind::Moving,
                })
            }
            _ => None,
        }
    }
}

/// What to do with a released attempt whose outcome has a [`Cause`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Retry {
    /// Start attempt `attempt` on a pair avoiding [`Attempts::avoids`].
    Restart {
        /// The new attempt's number (its events pass the fence).
        attempt: u32,
        /// The draining decode node (its index) whose prefix cache holds the
        /// request's computed pages: the new attempt's writer when its link is up
        /// (the KV moves instead of being computed again); `None`: a prefill node
        /// writes.
        move_from: Option<usize>,
    },
    /// End the client's stream with the outcome's error.
    Fail,
}

/// One request's attempts: how many failed, and the nodes a next pair must avoid.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Attempts {
    policy: RetryPolicy,
    failed: u32,
    avoid: Vec<(Role, usize)>,
}

impl Attempts {
    /// A request's first attempt.
    pub fn new(policy: RetryPolicy) -> Self {
        Self {
            policy,
            failed: 0,
            avoid: Vec::new(),
        }
    }

    /// Attempts that failed on a node's failure so far.
    pub fn failed(&self) -> u32 {
        self.failed
    }

    /// Whether a next pair must not use node `index` of `role`.
    pub fn avoids(&self, role: Role, index: usize) -> bool {
        self.avoid.contains(&(role, index))
    }

    /// Decides on a released attempt that ran on `(writer, decode)` and ended with
    /// `outcome`: [`Retry::Restart`] when the outcome has a [`Cause`], the client is
    /// still there, its stream can go on (`fence`, which is then moved to the new
    /// attempt: no token yet, or `continuable`), the failed attempts stay within the
    /// policy and `waited` (since the attempt started or the client's last token,
    /// whichever is later) is before the deadline; [`Retry::Fail`] otherwise. The
    /// failed node is avoided from then on either way.
    pub fn after_release(
        &mut self,
        outcome: &Outcome,
        (writer, decode): (Writer, usize),
        client_gone: bool,
        waited: Duration,
        continuable: bool,
        fence: &mut StreamFence,
    ) -> Retry {
        let Some(cause) = Cause::of(outcome) else {
            return Retry::Fail;
        };
        // A writer's failure avoids that node in its own role (a decode node that
        // moved KV is avoided as a decode node).
        let node = if cause.role == Role::Prefill {
            (writer.role, writer.index)
        } else {
            (Role::Decode, decode)
        };
        if !self.avoid.contains(&node) {
            self.avoid.push(node);
        }
        // A move's writer is a draining node, which may exit (its drain deadline)
        // before the move could start: planned, like the drain itself.
        let moving_writer = cause.role == Role::Prefill && writer.role == Role::Decode;
        if cause.counts && !moving_writer {
            self.failed += 1;
        }
        if client_gone || self.failed > self.policy.max_failed || waited >= self.policy.deadline {
            return Retry::Fail;
        }
        match fence.restart(continuable) {
            Some(attempt) => Retry::Restart {
                attempt,
                move_from: cause.moves.then_some(decode),
            },
            None => Retry::Fail,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{FailKind, FailReason, Refusal, RefusalKind};

    const NOW: Duration = Duration::ZERO;

    /// [`Attempts::after_release`] with the client there and no time waited.
    fn after(
        a: &mut Attempts,
        outcome: &Outcome,
        on: (Writer, usize),
        continuable: bool,
        fence: &mut StreamFence,
    ) -> Retry {
        a.after_release(outcome, on, false, NOW, continuable, fence)
    }

    /// [`after`] for an attempt on prefill node `p` and decode node `d` whose
    /// `role` node went down.
    fn down_on(
        a: &mut Attempts,
        role: Role,
        (p, d): (usize, usize),
        continuable: bool,
        fence: &mut StreamFence,
    ) -> Retry {
        after(a, &down(role), (Writer::prefill(p), d), continuable, fence)
    }

    fn restart(attempt: u32) -> Retry {
        Retry::Restart {
            attempt,
            move_from: None,
        }
    }

    fn down(role: Role) -> Outcome {
        Outcome::Failed(Failure::NodeDown(role))
    }

    #[test]
    fn the_fence_passes_only_the_current_attempt_and_one_end() {
        let mut f = StreamFence::default();
        assert_eq!(
            f.restart(false),
            Some(1),
            "nothing streamed: attempt 0 is fenced off"
        );
        assert!(!f.admit(0, StreamItem::Token), "a late token of attempt 0");
        assert!(!f.admit(0, StreamItem::End));
        assert!(f.admit(1, StreamItem::Token));
        assert!(f.streamed());
        assert_eq!(f.restart(false), None, "a token reached the client");
        assert!(f.admit(1, StreamItem::End));
        assert!(!f.admit(1, StreamItem::Token), "nothing after the end");
        assert!(!f.admit(1, StreamItem::End));
        let mut f = StreamFence::default();
        assert!(f.admit(0, StreamItem::End));
        assert_eq!(f.restart(false), None, "an ended stream is not restarted");
    }

    #[test]
    fn causes_are_node_failures_and_drains_only() {
        let drained = Outcome::Rejected(Refusal::draining(Role::Decode));
        assert_eq!(
            Cause::of(&drained),
            Some(Cause {
                role: Role::Decode,
                counts: false,
                moves: false,
            })
        );
        assert_eq!(Cause::of(&down(Role::Prefill)).unwrap().role, Role::Prefill);
        let lost = FailReason::new(FailKind::Transport, "page write failed");
        assert_eq!(
            Cause::of(&Outcome::Failed(Failure::Prefill(lost))),
            Some(Cause {
                role: Role::Decode,
                counts: true,
                moves: false,
            })
        );
        for (kind, moves) in [(FailKind::Drained, false), (FailKind::Moving, true)] {
            let drained = FailReason::new(kind, "drained");
            assert_eq!(
                Cause::of(&Outcome::Failed(Failure::Decode(drained))),
                Some(Cause {
                    role: Role::Decode,
                    counts: false,
                    moves,
                }),
                "{kind:?}"
            );
        }
        assert_eq!(
            Cause::of(&Outcome::Failed(Failure::LeaseExpired)),
            Some(Cause {
                role: Role::Prefill,
                counts: true,
                moves: false,
            })
        );
        let busy = Refusal {
            kind: RefusalKind::Busy,
            message: "pool full".into(),
        };
        let reason = FailReason::new(FailKind::Integrity, "checksum");
        for o in [
            Outcome::Succeeded,
            Outcome::Aborted,
            Outcome::Rejected(busy),
            Outcome::Failed(Failure::Decode(reason.clone())),
            Outcome::Failed(Failure::Prefill(reason)),
            down(Role::Coordinator),
        ] {
            assert_eq!(Cause::of(&o), None, "{o:?}");
        }
    }

    #[test]
    fn failed_attempts_are_bounded_and_avoided() {
        let mut a = Attempts::new(RetryPolicy::default());
        let mut f = StreamFence::default();
        let r = down_on(&mut a, Role::Decode, (0, 1), false, &mut f);
        assert_eq!(r, restart(1));
        assert!(a.avoids(Role::Decode, 1) && !a.avoids(Role::Prefill, 0));
        let r = down_on(&mut a, Role::Prefill, (0, 2), false, &mut f);
        assert_eq!(r, restart(2));
        let r = down_on(&mut a, Role::Decode, (1, 2), false, &mut f);
        assert_eq!(r, Retry::Fail, "a third failed attempt ends the request");
        assert_eq!(a.failed(), 3);
        assert_eq!(f.attempt(), 2, "the fence moves only on a restart");
    }

    #[test]
    fn drain_refusals_do_not_count() {
        let mut a = Attempts::new(RetryPolicy {
            max_failed: 0,
            ..RetryPolicy::default()
        });
        let mut f = StreamFence::default();
        for i in 0..4 {
            let drained = Outcome::Rejected(Refusal::draining(Role::Decode));
            let r = after(&mut a, &drained, (Writer::prefill(0), i), false, &mut f);
            assert!(matches!(r, Retry::Restart { .. }), "{i}");
        }
        let r = down_on(&mut a, Role::Decode, (0, 9), false, &mut f);
        assert_eq!(r, Retry::Fail);
    }

    #[test]
    fn no_restart_after_a_token_past_the_deadline_or_for_a_gone_client() {
        let policy = RetryPolicy::default();
        let mut f = StreamFence::default();
        assert!(f.admit(0, StreamItem::Token));
        let mut a = Attempts::new(policy);
        let r = down_on(&mut a, Role::Decode, (0, 0), false, &mut f);
        assert_eq!(r, Retry::Fail, "a token reached the client");
        let mut f = StreamFence::default();
        let r = a.after_release(
            &down(Role::Decode),
            (Writer::prefill(0), 1),
            false,
            policy.deadline,
            false,
            &mut f,
        );
        assert_eq!(r, Retry::Fail, "past the deadline");
        let mut a = Attempts::new(policy);
        let r = a.after_release(
            &down(Role::Decode),
            (Writer::prefill(0), 1),
            true,
            NOW,
            false,
            &mut f,
        );
        assert_eq!(r, Retry::Fail, "nobody waits");
        assert_eq!(f.attempt(), 0, "no fence moved");
        let r = after(
            &mut a,
            &Outcome::Succeeded,
            (Writer::prefill(0), 1),
            false,
            &mut f,
        );
        assert_eq!(r, Retry::Fail);
    }

    #[test]
    fn a_drained_decode_end_moves_from_that_node_and_a_failed_move_avoids_it() {
        let mut a = Attempts::new(RetryPolicy::default());
        let mut f = StreamFence::default();
        assert!(f.admit(0, StreamItem::Token));
        let drained = Outcome::Failed(Failure::Decode(FailReason::new(FailKind::Moving, "d")));
        let r = after(&mut a, &drained, (Writer::prefill(0), 3), true, &mut f);
        assert_eq!(
            r,
            Retry::Restart {
                attempt: 1,
                move_from: Some(3)
            }
        );
        assert_eq!(a.failed(), 0, "a drain is planned");
        // The move's writer (decode node 3) dies: it is avoided as a decode node,
        // never prefill node 3, and the next attempt computes (no move).
        let moved = Writer {
            role: Role::Decode,
            index: 3,
        };
        let r = after(&mut a, &down(Role::Prefill), (moved, 1), true, &mut f);
        assert_eq!(r, restart(2));
        assert_eq!(a.failed(), 0, "a draining writer's exit is planned too");
        assert!(a.avoids(Role::Decode, 3) && !a.avoids(Role::Prefill, 3));
        let refused = Outcome::Rejected(Refusal::draining(Role::Decode));
        let r = after(&mut a, &refused, (Writer::prefill(0), 1), true, &mut f);
        assert_eq!(r, restart(3), "a refusal computed nothing: nothing to move");
    }

    #[test]
    fn after_a_token_only_a_continuation_restarts() {
        let mut a = Attempts::new(RetryPolicy::default());
        let mut f = StreamFence::default();
        assert!(f.admit(0, StreamItem::Token));
        let r = down_on(&mut a, Role::Decode, (0, 0), true, &mut f);
        assert_eq!(r, restart(1));
        assert!(
            !f.admit(0, StreamItem::Token),
            "the failed attempt is fenced off"
        );
        assert!(f.admit(1, StreamItem::Token), "the continuation streams on");
        assert!(f.admit(1, StreamItem::End));
        let r = down_on(&mut a, Role::Decode, (0, 1), true, &mut f);
        assert_eq!(r, Retry::Fail, "an ended stream is never continued");
    }
}
