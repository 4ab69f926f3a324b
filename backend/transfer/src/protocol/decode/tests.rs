//! The decode node's tests: commit checks (I4), the FIFO of requests waiting for
//! pages, draining, quarantines, tombstones. (A file of their own: with them
//! decode.rs would pass 1,200 lines.)

use super::*;
use crate::protocol::testkit::{good, tag, R};
use crate::protocol::{FailKind, RefusalKind};
use std::collections::HashMap;
use tessera_kernels::PageTag;

/// A decode pool with 4 pages: page bytes are modelled by their checksum.
#[derive(Default)]
struct FakeDecode {
    /// page -> (tag it carries, owner, checksum of its bytes)
    pages: HashMap<u32, (PageTag, Option<ReqId>, u32)>,
    running: Vec<(ReqId, u32, Vec<DestPage>)>,
    released: Vec<ReqId>,
    free: u32,
    /// A full pool makes a request wait instead of refusing it.
    wait_when_full: bool,
    /// `start_decode` fails (an engine that will not run a verified sequence).
    fail_start: bool,
}

impl FakeDecode {
    fn new() -> Self {
        Self {
            free: 4,
            ..Default::default()
        }
    }
    fn land(&mut self, page: u32, checksum: u32) {
        self.pages.get_mut(&page).unwrap().2 = checksum;
    }
}

impl DecodeEnv for FakeDecode {
    type Attached = ();

    fn reserve(
        &mut self,
        req: ReqId,
        _tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
    ) -> Result<Vec<DestPage>, DecodeReserveError> {
        let pages = (prompt_tokens + max_tokens).div_ceil(16);
        if pages > self.free {
            if self.wait_when_full {
                return Err(DecodeReserveError::NoRoomYet);
            }
            return Err(DecodeReserveError::Refused(Refusal {
                kind: RefusalKind::Busy,
                message: "no pages".into(),
            }));
        }
        self.free -= pages;
        let transfer = prompt_tokens.div_ceil(16);
        let first = 10 + self.pages.len() as u32;
        Ok((0..transfer)
            .map(|b| {
                let d = DestPage {
                    page: first + b,
                    tag: tag(1, b),
                };
                self.pages.insert(d.page, (d.tag, Some(req), 0xdead));
                d
            })
            .collect())
    }
    fn landed_checksum(&self, req: ReqId, dest: DestPage) -> Option<u32> {
        let (t, owner, sum) = self.pages.get(&dest.page)?;
        (*t == dest.tag && *owner == Some(req)).then_some(*sum)
    }
    fn start_decode(
        &mut self,
        req: ReqId,
        _attached: Option<&mut ()>,
        tokens: u32,
        first: u32,
        pages: &[DestPage],
    ) -> Result<(), FailReason> {
        assert_eq!(first, 42);
        if self.fail_start {
            return Err(FailReason::new(FailKind::Internal, "engine refused"));
        }
        self.running.push((req, tokens, pages.to_vec()));
        Ok(())
    }
    fn release(&mut self, req: ReqId) {
        self.released.push(req);
        self.running.retain(|r| r.0 != req);
        for (t, owner, _) in self.pages.values_mut() {
            if *owner == Some(req) {
                *owner = None;
                t.epoch += 1;
            }
        }
    }
}

fn ask(tenant: u64, prompt_tokens: u32, max_tokens: u32) -> ReservationAsk {
    ReservationAsk {
        tenant,
        prompt_tokens,
        max_tokens,
    }
}

/// A decode node with `R` reserved for 20 prompt tokens (2 pages), both landed.
fn reserved() -> (DecodeNode, FakeDecode, Vec<DestPage>) {
    let mut node = DecodeNode::new();
    let mut env = FakeDecode::new();
    let mut out = Vec::new();
    node.on_prealloc(R, ask(3, 20, 4), None, &mut env, &mut out);
    let [Output::Send {
        to: Role::Coordinator,
        msg: Msg::Descriptor { pages, .. },
    }] = out.as_slice()
    else {
        panic!("expected a descriptor, got {out:?}");
    };
    assert_eq!(pages.len(), 2);
    let pages = pages.clone();
    env.land(10, 100);
    env.land(11, 101);
    (node, env, pages)
}

fn commit(
    node: &mut DecodeNode,
    env: &mut FakeDecode,
    tokens: u32,
    pages: &[PageCommit],
) -> (Result<(), CommitError>, Vec<Output>) {
    let mut out = Vec::new();
    let r = node.on_commit(R, tokens, pages, 42, env, &mut out);
    (r, out)
}

fn reply(out: &[Output]) -> &Msg {
    match out {
        [Output::Send {
            to: Role::Coordinator,
            msg,
        }] => msg,
        _ => panic!("expected one reply, got {out:?}"),
    }
}

#[test]
fn full_correct_commit_admits_once() {
    let (mut node, mut env, pages) = reserved();
    let (r, out) = commit(&mut node, &mut env, 20, &good(&pages));
    assert_eq!(r, Ok(()));
    assert_eq!(reply(&out), &Msg::Committed { req: R });
    assert_eq!(env.running, vec![(R, 20, pages.clone())]);
    assert_eq!(node.records().state(R), Some(&DecodeState::Running));

    // A duplicate is not admitted again; the reply is re-sent.
    let (r, out) = commit(&mut node, &mut env, 20, &good(&pages));
    assert_eq!(r, Err(CommitError::NotAwaitingCommit));
    assert_eq!(reply(&out), &Msg::Committed { req: R });
    assert_eq!(env.running.len(), 1);

    // After the decode ends, a duplicate commit still admits nothing.
    let mut out = Vec::new();
    node.on_decode_finished(R, DecodeOutcome::Completed, &mut env, &mut out);
    assert_eq!(
        reply(&out),
        &Msg::Finished {
            req: R,
            outcome: DecodeOutcome::Completed
        }
    );
    assert_eq!(env.released, vec![R]);
    let (r, _) = commit(&mut node, &mut env, 20, &good(&pages));
    assert_eq!(r, Err(CommitError::NotAwaitingCommit));
    assert!(env.running.is_empty());
}

fn assert_fails(
    tokens: u32,
    pages: Vec<PageCommit>,
    env_edit: impl Fn(&mut FakeDecode),
    want: CommitError,
) {
    let (mut node, mut env, _) = reserved();
    env_edit(&mut env);
    let (r, out) = commit(&mut node, &mut env, tokens, &pages);
    assert_eq!(r, Err(want.clone()));
    assert_eq!(
        reply(&out),
        &Msg::CommitFailed {
            req: R,
            reason: want.clone()
        }
    );
    assert!(env.running.is_empty(), "nothing admitted");
    assert_eq!(env.released, vec![R], "reserved pages freed");
    assert_eq!(
        node.records().state(R),
        Some(&DecodeState::CommitFailed(want))
    );
}

#[test]
fn short_commits_fail() {
    let (_, _, pages) = reserved();
    // The incident: a one-token placeholder, one page.
    assert_fails(
        1,
        good(&pages[..1]),
        |_| {},
        CommitError::TokenCount {
            expected: 20,
            got: 1,
        },
    );
    assert_fails(
        20,
        good(&pages[..1]),
        |_| {},
        CommitError::PageCount {
            expected: 2,
            got: 1,
        },
    );
}

#[test]
fn corrupt_commit_fails() {
    let (_, _, pages) = reserved();
    assert_fails(
        20,
        good(&pages),
        |env| env.land(11, 999),
        CommitError::ChecksumMismatch {
            page: 11,
            expected: 101,
            got: 999,
        },
    );
}

#[test]
fn duplicate_and_foreign_pages_fail() {
    let (_, _, pages) = reserved();
    let twice = vec![good(&pages)[0], good(&pages)[0]];
    assert_fails(20, twice, |_| {}, CommitError::DuplicatePage { page: 10 });
    let mut foreign = good(&pages);
    foreign[1].dest.page = 3;
    assert_fails(20, foreign, |_| {}, CommitError::UnexpectedPage { page: 3 });
}

#[test]
fn wrong_tag_fails() {
    let (_, _, pages) = reserved();
    let mut wrong = good(&pages);
    wrong[0].dest.tag.tenant = 4;
    assert_fails(20, wrong, |_| {}, CommitError::TagMismatch { page: 10 });
    // The page was freed and reused meanwhile (epoch bumped): the tag no longer validates.
    assert_fails(
        20,
        good(&pages),
        |env| env.pages.get_mut(&11).unwrap().0.epoch += 1,
        CommitError::TagMismatch { page: 11 },
    );
}

#[test]
fn unknown_commit_changes_nothing() {
    let mut node = DecodeNode::new();
    let mut env = FakeDecode::new();
    let (r, out) = commit(&mut node, &mut env, 20, &[]);
    assert_eq!(r, Err(CommitError::UnknownRequest));
    assert_eq!(
        reply(&out),
        &Msg::CommitFailed {
            req: R,
            reason: CommitError::UnknownRequest
        }
    );
    assert_eq!(node.records().state(R), None);
    assert!(env.released.is_empty() && env.running.is_empty());
}

#[test]
fn late_commit_after_abort_is_ignored() {
    let (mut node, mut env, pages) = reserved();
    let mut out = Vec::new();
    node.on_abort(R, &mut env, &mut out);
    assert_eq!(
        reply(&out),
        &Msg::AbortAck {
            req: R,
            from: Role::Decode
        }
    );
    assert_eq!(env.released, vec![R]);
    let (r, _) = commit(&mut node, &mut env, 20, &good(&pages));
    assert_eq!(r, Err(CommitError::NotAwaitingCommit));
    assert!(env.running.is_empty());
    // Even a verifying path would refuse: the freed pages' epochs moved on.
    assert_eq!(env.landed_checksum(R, pages[0]), None);
    // A late Prealloc after the abort reserves nothing.
    let mut out = Vec::new();
    node.on_prealloc(R, ask(3, 20, 4), None, &mut env, &mut out);
    assert!(out.is_empty());
    assert_eq!(env.free, 2, "one reservation only");
}

#[test]
fn refused_prealloc_is_terminal() {
    let mut node = DecodeNode::new();
    let mut env = FakeDecode::new();
    let mut out = Vec::new();
    node.on_prealloc(R, ask(3, 200, 4), None, &mut env, &mut out);
    assert!(matches!(
        reply(&out),
        Msg::Rejected {
            by: Role::Decode,
            reason: Refusal {
                kind: RefusalKind::Busy,
                ..
            },
            ..
        }
    ));
    // Even once pages would fit, a duplicate is answered with the same refusal.
    env.free = 100;
    let mut again = Vec::new();
    node.on_prealloc(R, ask(3, 200, 4), None, &mut env, &mut again);
    assert_eq!(again, out);
    assert_eq!(env.free, 100);
}

fn prealloc(node: &mut DecodeNode, env: &mut FakeDecode, req: u64, prompt: u32) -> Vec<Output> {
    let mut out = Vec::new();
    node.on_prealloc(ReqId(req), ask(3, prompt, 4), None, env, &mut out);
    out
}

#[test]
fn a_request_that_does_not_fit_now_waits_in_fifo_order_for_pages() {
    let mut node = DecodeNode::new();
    let mut env = FakeDecode::new();
    env.wait_when_full = true;
    // 3 of the 4 pages.
    assert!(matches!(
        reply(&prealloc(&mut node, &mut env, 1, 40)),
        Msg::Descriptor { .. }
    ));
    // 2 pages needed: waits, answers nothing yet.
    assert!(prealloc(&mut node, &mut env, 2, 20).is_empty());
    // 1 page would fit, but it may not overtake request 2.
    assert!(prealloc(&mut node, &mut env, 3, 1).is_empty());
    assert_eq!(node.waiting().collect::<Vec<_>>(), [ReqId(2), ReqId(3)]);
    // A duplicate Prealloc of a waiting request changes nothing.
    assert!(prealloc(&mut node, &mut env, 2, 20).is_empty());
    assert_eq!(node.waiting().count(), 2);
    // Nothing freed: capacity offers change nothing.
    let mut out = Vec::new();
    node.on_capacity(&mut env, &mut out);
    assert!(out.is_empty());
    // Request 1 is aborted: its pages go back, both waiting requests get theirs,
    // oldest first.
    node.on_abort(ReqId(1), &mut env, &mut Vec::new());
    env.free += 3;
    node.on_capacity(&mut env, &mut out);
    let descs: Vec<ReqId> = out
        .iter()
        .map(|o| match o {
            Output::Send {
                msg: Msg::Descriptor { req, .. },
                ..
            } => *req,
            o => panic!("expected descriptors, got {o:?}"),
        })
        .collect();
    assert_eq!(descs, [ReqId(2), ReqId(3)]);
    assert_eq!(node.waiting().count(), 0);
}

#[test]
fn an_aborted_waiting_request_leaves_the_queue_and_holds_nothing() {
    let mut node = DecodeNode::new();
    let mut env = FakeDecode::new();
    env.wait_when_full = true;
    prealloc(&mut node, &mut env, 1, 60);
    assert!(prealloc(&mut node, &mut env, 2, 20).is_empty());
    let mut out = Vec::new();
    node.on_abort(ReqId(2), &mut env, &mut out);
    assert!(matches!(
        reply(&out),
        Msg::AbortAck {
            from: Role::Decode,
            ..
        }
    ));
    assert_eq!(node.waiting().count(), 0);
    assert_eq!(node.records().state(ReqId(2)), Some(&DecodeState::Aborted));
    // A late Prealloc for it is ignored (tombstone).
    env.free = 100;
    assert!(prealloc(&mut node, &mut env, 2, 20).is_empty());
    assert!(!env.released.contains(&ReqId(2)), "it never held a page");
}

#[test]
fn a_verified_commit_the_engine_will_not_run_fails_and_frees_its_pages() {
    let (mut node, mut env, pages) = reserved();
    env.fail_start = true;
    let (r, out) = commit(&mut node, &mut env, 20, &good(&pages));
    assert_eq!(r, Ok(()));
    assert!(matches!(
        reply(&out),
        Msg::Finished {
            outcome: DecodeOutcome::Failed {
                reason: FailReason {
                    kind: FailKind::Internal,
                    ..
                }
            },
            ..
        }
    ));
    assert_eq!(env.released, [R]);
    assert!(env.running.is_empty());
}

#[test]
fn terminal_records_expire_after_their_ttl_and_live_ones_never() {
    let (mut node, mut env, _) = reserved();
    prealloc(&mut node, &mut env, 9, 200); // refused: terminal at t = 0
    assert_eq!(node.records_mut().expire(0, 1000), 0);
    // R becomes terminal at t = 500.
    assert_eq!(node.records_mut().expire(500, 1000), 0);
    node.on_abort(R, &mut env, &mut Vec::new());
    assert_eq!(node.records_mut().expire(1000, 1000), 1); // request 9
    assert!(node.records().state(ReqId(9)).is_none());
    assert_eq!(node.records_mut().expire(1499, 1000), 0);
    assert_eq!(node.records_mut().expire(1500, 1000), 1); // R
    assert!(node.records().is_empty());
    // A live record never expires.
    prealloc(&mut node, &mut env, 10, 1);
    assert_eq!(node.records_mut().expire(1_000_000, 1000), 0);
    assert_eq!(node.records().len(), 1);
}

#[test]
fn a_draining_decode_node_refuses_new_and_waiting_requests_and_keeps_the_rest() {
    let mut node = DecodeNode::new();
    let mut env = FakeDecode::new();
    env.wait_when_full = true;
    // 1 holds 3 of the 4 pages; 2 waits for pages.
    assert!(matches!(
        reply(&prealloc(&mut node, &mut env, 1, 40)),
        Msg::Descriptor { .. }
    ));
    assert!(prealloc(&mut node, &mut env, 2, 20).is_empty());
    let mut out = Vec::new();
    node.begin_drain(&mut out);
    assert!(node.is_draining());
    // The waiting request holds nothing: refused now, so it starts elsewhere.
    let drained = Msg::Rejected {
        req: ReqId(2),
        by: Role::Decode,
        reason: Refusal::draining(Role::Decode),
    };
    assert_eq!(reply(&out), &drained);
    assert_eq!(node.waiting().count(), 0);
    // A new request, even one that would fit, is refused before admission.
    let out = prealloc(&mut node, &mut env, 3, 1);
    let Msg::Rejected { by, reason, .. } = reply(&out) else {
        panic!("{out:?}");
    };
    assert_eq!((*by, reason.kind), (Role::Decode, RefusalKind::Busy));
    assert_eq!(reason.drained_by(), Some(Role::Decode));
    assert_eq!(env.free, 1, "nothing reserved for a refused request");
    // The reserved request is untouched: its duplicate gets its descriptor again,
    // and freed pages are offered to nobody.
    assert!(matches!(
        reply(&prealloc(&mut node, &mut env, 1, 40)),
        Msg::Descriptor { .. }
    ));
    node.on_abort(ReqId(1), &mut env, &mut Vec::new());
    env.free += 3;
    let mut out = Vec::new();
    node.on_capacity(&mut env, &mut out);
    assert!(out.is_empty(), "{out:?}");
    // Only a drain refusal says it is one.
    let busy = Refusal {
        kind: RefusalKind::Busy,
        message: "no pages".into(),
    };
    assert_eq!(busy.drained_by(), None);
    assert_eq!(
        Refusal::draining(Role::Prefill).drained_by(),
        Some(Role::Prefill)
    );
}

#[test]
fn a_quarantine_for_a_lost_coordinator_asks_the_writer_until_it_answers() {
    let (mut node, mut env, _) = reserved();
    let mut out = Vec::new();
    node.on_coordinator_lost(R, &mut env, &mut out);
    let query = [Output::Send {
        to: Role::Prefill,
        msg: Msg::QuietQuery { req: R },
    }];
    assert_eq!(out, query);
    assert_eq!(
        node.records().state(R),
        Some(&DecodeState::Quarantined(Quarantine::CoordinatorLost))
    );
    // The retry timer asks again, and frees nothing: only the answer does.
    for _ in 0..3 {
        let mut again = Vec::new();
        node.ask_writers(&mut env, &mut again);
        assert_eq!(again, query);
    }
    assert!(env.released.is_empty());
    node.on_writer_quiet(R, &mut env, &mut Vec::new());
    assert_eq!(env.released, [R]);
    assert_eq!(node.records().state(R), Some(&DecodeState::Aborted));
    let mut none = Vec::new();
    node.ask_writers(&mut env, &mut none);
    node.ask_writer(R, &mut env, &mut none);
    assert!(none.is_empty(), "{none:?}");
}

#[test]
fn a_lease_quarantine_whose_coordinator_is_lost_asks_the_writer() {
    let (mut node, mut env, _) = reserved();
    let mut out = Vec::new();
    node.on_lease_expired(R, &mut env, &mut out);
    assert_eq!(reply(&out), &Msg::LeaseExpired { req: R });
    // The coordinator would have quieted the prefill side; it is gone now.
    let mut out = Vec::new();
    node.on_coordinator_lost(R, &mut env, &mut out);
    assert_eq!(
        out,
        [Output::Send {
            to: Role::Prefill,
            msg: Msg::QuietQuery { req: R },
        }]
    );
    assert!(env.released.is_empty());
    // Only a reservation quarantined for a lost coordinator is asked about.
    let (mut live, mut env2, _) = reserved();
    let mut none = Vec::new();
    live.ask_writers(&mut env2, &mut none);
    assert!(none.is_empty());
}
