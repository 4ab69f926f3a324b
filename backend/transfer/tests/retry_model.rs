//! Model checking of the retry before the first token (issue 36) with stateright.
//!
//! The model runs the production machines of `tessera_transfer::protocol::retry`
//! ([`Attempts`], [`StreamFence`]) unchanged, with the rest of one request modelled:
//!
//! - pairs: four (prefill, decode) pairs; an attempt runs on one pair and streams
//!   the request's output up to `TOKENS` tokens, then `Done`, through its own sink,
//!   which asks the fence before every item (as `ClientSink::send_event` does, under
//!   the fence's lock); an attempt started after tokens reached the client continues
//!   from the first token the client does not have (the engine's `Resume`);
//! - failures: any running attempt's node may go silent at any point (up to
//!   `FAILURES` times): it stops without a word, its pair stays down; the failure
//!   detector reports it later (`Detect`), and the coordinator, once the attempt is
//!   released, asks [`Attempts::after_release`] on the fence whether to start again on
//!   a pair the attempts do not avoid, or to end the stream with the error;
//! - zombies: a node declared down may wake up (a stopped process resumed, a link
//!   that was only slow) and go on streaming its old attempt's tokens;
//! - time: the retry deadline may pass at any point (once);
//! - drains with moves (issue 36 item 3): a running attempt's decode node may
//!   drain (up to `DRAINS` times): it ends the attempt as drained and keeps its KV;
//!   [`Attempts::after_release`] answers with `move_from`, and the next attempt
//!   waits for the draining node to write its pages (`Write`) before it streams. A
//!   draining node may exit at any point (its deadline): a move it has not written
//!   fails as its writer's loss, which does not count against the bound, and the
//!   attempt after it is a continuation computed by a prefill node.
//!
//! Properties, in every reachable state:
//! - IN_ORDER: the client's tokens are the output in order, with no gap and no
//!   repeat, whichever attempts computed them (a zombie's late token never gets in);
//! - ONE_END: at most one end, and nothing after it;
//! - BOUNDED: at most `max_failed + 1` attempts started (3 of the 4 pairs) besides
//!   those a drain started (a move, or the continuation after a move whose writer
//!   exited);
//! - DRAINS_FAIL_NOTHING: the client gets an error only after a node failed or the
//!   deadline passed: drains and their moves alone never fail a request;
//! - ANSWERED (eventually): every run ends with the client holding an end (`Done` or
//!   the error), never a silent stream;
//! - USAGE_ONCE: at most one usage row per request, and (eventually) exactly one:
//!   the gateway writes it from the end that reached the client (the fence admits
//!   one), never per attempt, so a failed attempt, a continuation and a zombie's late
//!   `Done` are not billed again.
//!
//! `sometimes` properties show that restarts, continuations, zombie tokens, moves
//! and moves whose writer exited are reached, and the failing variants (a fence
//! that is not asked, a policy without a bound, usage written per released
//! attempt, a driver that reports a move's writer as a prefill node) that IN_ORDER,
//! BOUNDED, USAGE_ONCE and DRAINS_FAIL_NOTHING bite.

use stateright::{Checker, HasDiscoveries, Model, Property};
use std::collections::BTreeSet;
use std::time::Duration;
use tessera_transfer::protocol::{
    Attempts, FailKind, FailReason, Failure, Outcome, Retry, RetryPolicy, Role, StreamFence,
    StreamItem, Writer,
};

const PAIRS: usize = 4;
const MAX_FAILED: u32 = 2;
const TOKENS: u8 = 2;
const FAILURES: u8 = 3;
const DRAINS: u8 = 3;

const IN_ORDER: &str = "the client's tokens are the output in order, no gap, no repeat";
const ONE_END: &str = "at most one end, nothing after it";
const BOUNDED: &str = "attempts are bounded";
const ANSWERED: &str = "every request is answered";
const USAGE_ONCE: &str = "usage is recorded at most once";
const BILLED: &str = "usage is recorded";
const DRAINS_FAIL_NOTHING: &str = "drains alone never fail a request";

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Item {
    Token { attempt: u32, index: u8 },
    Done { attempt: u32 },
    Error,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum RunState {
    /// Streaming.
    Running,
    /// Its node went silent; the failure detector has not said so yet.
    Silent,
    /// Declared down (and released); its node may still wake up and stream.
    Zombie,
    /// Sent its `Done` (admitted or not).
    Finished,
    /// A move: waits for the draining node `from` to write its pages.
    Moving { from: usize },
    /// Its decode node drained and ended it (keeping its KV for the next attempt).
    Drained,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Run {
    pair: usize,
    sent: u8,
    state: RunState,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct St {
    fence: StreamFence,
    attempts: Attempts,
    /// Attempt `k` is `runs[k]`.
    runs: Vec<Run>,
    client: Vec<Item>,
    pair_up: [bool; PAIRS],
    failures_left: u8,
    past_deadline: bool,
    /// The coordinator ended the stream itself (the error) or saw `Done`.
    over: bool,
    /// Usage rows written for the request.
    billed: u8,
    /// Per pair: its decode node drains (ended its attempt and keeps its KV) ...
    draining: [bool; PAIRS],
    /// ... and exited.
    exited: [bool; PAIRS],
    drains_left: u8,
    /// Attempts started by drains (a move, or the continuation after a move whose
    /// writer exited): not bounded by `max_failed`.
    planned: u8,
    /// Moves whose pages were written, and moves whose writer exited first.
    moved: u8,
    moves_lost: u8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Action {
    /// Run `k`'s node sends its next token, or its `Done` after `TOKENS`.
    Send(usize),
    /// Run `k`'s node goes silent.
    Fail(usize),
    /// The failure detector reports run `k`'s node down.
    Detect(usize),
    DeadlinePasses,
    /// Run `k`'s decode node drains.
    Drain(usize),
    /// The draining node writes the pages of move `k`.
    Write(usize),
    /// Pair `p`'s draining node exits.
    Exit(usize),
}

#[derive(Clone, Copy, Debug, Default)]
struct Variant {
    /// Sinks do not ask the fence, and the retry decision sees a fresh one.
    no_fence: bool,
    /// No bound on failed attempts.
    unbounded: bool,
    /// Usage written when each attempt ends (its `Done`, or its release after a
    /// failure) instead of from the end the client got.
    bill_per_attempt: bool,
    /// The driver reports a move's writer as prefill node `from`, not as the
    /// draining decode node (its exit then counts as a failed attempt).
    forget_move_writer: bool,
}

struct RetryModel {
    variant: Variant,
}

impl RetryModel {
    fn policy(&self) -> RetryPolicy {
        RetryPolicy {
            max_failed: if self.variant.unbounded {
                u32::MAX
            } else {
                MAX_FAILED
            },
            deadline: Duration::from_secs(30),
        }
    }

    /// The coordinator, once attempt `k` (written by `writer`, decoded on its pair)
    /// is released with `outcome`: [`Attempts::after_release`] decides on the fence;
    /// a restart runs on the first pair up that no attempt avoids (a move when the
    /// decision names a draining node still there), else the client gets the error.
    fn after_release(&self, st: &mut St, k: usize, outcome: Outcome, writer: Writer) {
        if self.variant.bill_per_attempt {
            st.billed += 1; // the released attempt's usage
        }
        if st.over {
            return; // an old attempt: the request already moved on
        }
        let pair = st.runs[k].pair;
        let elapsed = if st.past_deadline {
            self.policy().deadline
        } else {
            Duration::ZERO
        };
        let mut fresh = StreamFence::default();
        let fence = if self.variant.no_fence {
            &mut fresh
        } else {
            &mut st.fence
        };
        let decision =
            st.attempts
                .after_release(&outcome, (writer, pair), false, elapsed, true, fence);
        let usable = |p: usize| {
            st.pair_up[p]
                && !st.draining[p]
                && !st.attempts.avoids(Role::Decode, p)
                && !st.attempts.avoids(Role::Prefill, p)
        };
        let next = (0..PAIRS).find(|&p| usable(p));
        // Drains and a move's writer leaving are planned: not bounded by the policy.
        let planned = matches!(
            outcome,
            Outcome::Failed(Failure::Decode(_)) | Outcome::Failed(Failure::NodeDown(Role::Prefill))
        );
        match (decision, next) {
            // A continuation starts after the tokens the client has.
            (Retry::Restart { move_from, .. }, Some(p)) => {
                st.planned += u8::from(planned);
                let state = match move_from {
                    Some(from) if !st.exited[from] => RunState::Moving { from },
                    _ => RunState::Running,
                };
                st.runs.push(Run {
                    pair: p,
                    sent: st.client.len() as u8,
                    state,
                });
            }
            _ => {
                // The coordinator's own sink: the fence's current attempt.
                let owner = st.fence.attempt();
                self.deliver(st, owner, StreamItem::End, Item::Error);
                st.over = true;
            }
        }
    }

    /// A sink of attempt `attempt` delivers `item` to the client if the fence lets it.
    fn deliver(&self, st: &mut St, attempt: u32, item: StreamItem, what: Item) {
        if self.variant.no_fence || st.fence.admit(attempt, item) {
            st.client.push(what);
            // The driver writes the usage row when the client's stream ends.
            if item == StreamItem::End && !self.variant.bill_per_attempt {
                st.billed += 1;
            }
        }
    }
}

impl Model for RetryModel {
    type State = St;
    type Action = Action;

    fn init_states(&self) -> Vec<St> {
        vec![St {
            fence: StreamFence::default(),
            attempts: Attempts::new(self.policy()),
            runs: vec![Run {
                pair: 0,
                sent: 0,
                state: RunState::Running,
            }],
            client: Vec::new(),
            pair_up: [true; PAIRS],
            failures_left: FAILURES,
            past_deadline: false,
            over: false,
            billed: 0,
            draining: [false; PAIRS],
            exited: [false; PAIRS],
            drains_left: DRAINS,
            planned: 0,
            moved: 0,
            moves_lost: 0,
        }]
    }

    fn actions(&self, st: &St, acts: &mut Vec<Action>) {
        for (k, run) in st.runs.iter().enumerate() {
            match run.state {
                RunState::Running | RunState::Zombie => acts.push(Action::Send(k)),
                RunState::Silent => acts.push(Action::Detect(k)),
                RunState::Moving { from } if st.draining[from] && !st.exited[from] => {
                    acts.push(Action::Write(k))
                }
                RunState::Finished | RunState::Drained | RunState::Moving { .. } => {}
            }
            let live = matches!(run.state, RunState::Running | RunState::Moving { .. });
            if live && st.failures_left > 0 {
                acts.push(Action::Fail(k));
            }
            if run.state == RunState::Running && st.drains_left > 0 && !st.draining[run.pair] {
                acts.push(Action::Drain(k));
            }
        }
        for p in 0..PAIRS {
            if st.draining[p] && !st.exited[p] {
                acts.push(Action::Exit(p));
            }
        }
        if !st.past_deadline && !st.over {
            acts.push(Action::DeadlinePasses);
        }
    }

    fn next_state(&self, last: &St, action: Action) -> Option<St> {
        let mut st = last.clone();
        match action {
            Action::Send(k) => {
                let attempt = k as u32;
                let run = &mut st.runs[k];
                if run.sent < TOKENS {
                    let index = run.sent;
                    run.sent += 1;
                    self.deliver(
                        &mut st,
                        attempt,
                        StreamItem::Token,
                        Item::Token { attempt, index },
                    );
                } else {
                    let was_running = run.state == RunState::Running;
                    run.state = RunState::Finished;
                    if self.variant.bill_per_attempt {
                        st.billed += 1;
                    }
                    self.deliver(&mut st, attempt, StreamItem::End, Item::Done { attempt });
                    // A live attempt's `Finished` ends the request at the coordinator.
                    st.over |= was_running;
                }
            }
            Action::Fail(k) => {
                st.failures_left -= 1;
                st.runs[k].state = RunState::Silent;
                st.pair_up[st.runs[k].pair] = false;
            }
            Action::Detect(k) => {
                st.runs[k].state = RunState::Zombie;
                let outcome = Outcome::Failed(Failure::NodeDown(Role::Decode));
                let writer = Writer::prefill(st.runs[k].pair);
                self.after_release(&mut st, k, outcome, writer);
            }
            Action::Drain(k) => {
                st.drains_left -= 1;
                st.runs[k].state = RunState::Drained;
                st.draining[st.runs[k].pair] = true;
                let drained = FailReason::new(FailKind::Moving, "drained, KV kept");
                let outcome = Outcome::Failed(Failure::Decode(drained));
                let writer = Writer::prefill(st.runs[k].pair);
                self.after_release(&mut st, k, outcome, writer);
            }
            Action::Write(k) => {
                st.runs[k].state = RunState::Running;
                st.moved += 1;
            }
            Action::Exit(p) => {
                st.exited[p] = true;
                st.pair_up[p] = false;
                // A move it has not written loses its writer.
                let lost: Vec<usize> = (0..st.runs.len())
                    .filter(|&k| st.runs[k].state == RunState::Moving { from: p })
                    .collect();
                for k in lost {
                    st.moves_lost += 1;
                    st.runs[k].state = RunState::Finished;
                    let writer = if self.variant.forget_move_writer {
                        Writer::prefill(p)
                    } else {
                        Writer {
                            role: Role::Decode,
                            index: p,
                        }
                    };
                    let outcome = Outcome::Failed(Failure::NodeDown(Role::Prefill));
                    self.after_release(&mut st, k, outcome, writer);
                }
            }
            Action::DeadlinePasses => st.past_deadline = true,
        }
        Some(st)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(IN_ORDER, |_, st: &St| {
                st.client
                    .iter()
                    .filter_map(|i| match i {
                        Item::Token { index, .. } => Some(usize::from(*index)),
                        _ => None,
                    })
                    .enumerate()
                    .all(|(n, i)| i == n)
            }),
            Property::always(ONE_END, |_, st: &St| {
                let end = st
                    .client
                    .iter()
                    .position(|i| !matches!(i, Item::Token { .. }));
                end.is_none_or(|e| e + 1 == st.client.len())
            }),
            Property::always(BOUNDED, |_, st: &St| {
                st.runs.len() <= MAX_FAILED as usize + 1 + usize::from(st.planned)
            }),
            Property::always(DRAINS_FAIL_NOTHING, |_, st: &St| {
                !st.client.contains(&Item::Error) || st.failures_left < FAILURES || st.past_deadline
            }),
            Property::eventually(ANSWERED, |_, st: &St| {
                st.client.iter().any(|i| !matches!(i, Item::Token { .. }))
            }),
            Property::always(USAGE_ONCE, |_, st: &St| st.billed <= 1),
            Property::eventually(BILLED, |_, st: &St| st.billed == 1),
            Property::sometimes("answered after a restart", |_, st: &St| {
                st.client
                    .iter()
                    .any(|i| matches!(i, Item::Done { attempt } if *attempt > 0))
            }),
            Property::sometimes("a continuation completes a stream", |_, st: &St| {
                st.client.first()
                    == Some(&Item::Token {
                        attempt: 0,
                        index: 0,
                    })
                    && st
                        .client
                        .iter()
                        .any(|i| matches!(i, Item::Done { attempt } if *attempt > 0))
            }),
            Property::sometimes("an error after a token", |_, st: &St| {
                st.client.len() > 1 && st.client.last() == Some(&Item::Error)
            }),
            Property::sometimes("a moved request completes", |_, st: &St| {
                st.moved > 0 && st.client.iter().any(|i| matches!(i, Item::Done { .. }))
            }),
            Property::sometimes(
                "a request whose move lost its writer completes",
                |_, st: &St| {
                    st.moves_lost > 0 && st.client.iter().any(|i| matches!(i, Item::Done { .. }))
                },
            ),
            Property::sometimes(
                "a zombie streams past the fence's decision",
                |_, st: &St| {
                    st.runs.len() > 1 && st.runs[0].state == RunState::Zombie && st.runs[0].sent > 0
                },
            ),
        ]
    }
}

fn run(variant: Variant, stop_at: Option<&'static str>) -> impl Checker<RetryModel> {
    let mut b = RetryModel { variant }.checker().threads(2);
    if let Some(name) = stop_at {
        b = b.finish_when(HasDiscoveries::AnyOf(BTreeSet::from([name])));
    }
    b.spawn_bfs().join()
}

#[test]
fn retries_and_continuations_are_safe_and_answer() {
    let checker = run(Variant::default(), None);
    println!(
        "retry: {} unique states, depth {}",
        checker.unique_state_count(),
        checker.max_depth()
    );
    checker.assert_properties();
    // Pinned: a change means the machines or the model changed behaviour; re-pin
    // only after reading why.
    assert_eq!(checker.unique_state_count(), 66562);
}

/// Runs a broken variant and requires a counterexample to `property`.
fn caught(variant: Variant, property: &'static str) {
    let checker = run(variant, Some(property));
    let path = checker.discovery(property).expect("a counterexample");
    println!("{property}: broken by {:?}", path.into_actions());
}

#[test]
fn without_the_fence_a_zombies_tokens_reach_the_client() {
    let no_fence = Variant {
        no_fence: true,
        ..Variant::default()
    };
    caught(no_fence, IN_ORDER);
}

#[test]
fn usage_written_per_attempt_bills_a_continued_request_twice() {
    let per_attempt = Variant {
        bill_per_attempt: true,
        ..Variant::default()
    };
    caught(per_attempt, USAGE_ONCE);
}

#[test]
fn a_driver_that_reports_a_moves_writer_as_a_prefill_node_fails_requests_on_drains() {
    let forgetful = Variant {
        forget_move_writer: true,
        ..Variant::default()
    };
    caught(forgetful, DRAINS_FAIL_NOTHING);
}

#[test]
fn without_a_bound_a_request_runs_on_every_pair() {
    let unbounded = Variant {
        unbounded: true,
        ..Variant::default()
    };
    caught(unbounded, BOUNDED);
}
