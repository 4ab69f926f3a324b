//! Model checking of the KV transfer protocol (DESIGN.md §6, issue 4) with stateright.
//!
//! The model runs the production state machines of `tessera_transfer::protocol`
//! (`Coordinator`, `PrefillNode`, `DecodeNode`) unchanged; only their environments
//! (page pools, engine, transport) and the network are modelled here:
//!
//! - requests: two, each with its own coordinator and tenant; one may be aborted by
//!   its client at any point;
//! - pools: small decode and prefill pools of pages that carry a tag (decode) and a
//!   content; content is `Kv { req, block }` once written, `Stale` (another tenant's
//!   old data: pages are never scrubbed) or `Corrupt`; checksums are computed from the
//!   content, so a short, mixed or corrupt transfer is detectable;
//! - network: control messages are a multiset (any delivery order) that can also lose
//!   and duplicate messages (bounded budgets; a duplicated message is delivered once
//!   and stays in flight for a second delivery at any later time); coordinators
//!   retransmit on timeout (enabled when nothing for the request is in flight and no
//!   node can make progress on it);
//! - page writes: in-flight items, one per page put (chunked prefill: one page per
//!   step, so an abort can stop a prefill between pages), landing in any order; they
//!   read the source page when they land (zero-copy) and land unconditionally
//!   (one-sided: the destination CPU cannot refuse them). A write may fail (the drain
//!   reports the failure) or land corrupted (undetected by the transport);
//! - crashes: the prefill or the decode node may crash once at any point: it loses its
//!   state and pages, messages to it are dropped, its transport connection is torn
//!   down (writes from a dead prefill vanish; writes to a dead decode fail at the
//!   source), and each coordinator's failure detector tells it on its own schedule;
//! - a gateway crash: every coordinator vanishes at any point (also between the
//!   decode node's reservation and the prefill node hearing of the request); each
//!   node's driver then tells its machine, per request its link carried (the prefill
//!   node: only requests it holds a live record of), that the coordinator is gone;
//!   the decode node quarantines reservations awaiting a commit and asks their
//!   writer `QuietQuery`, again on a retry timer while no query or answer is in
//!   flight;
//! - drains: a node may begin draining at any point (`begin_drain`): it refuses every
//!   new request from then on, and the decode node also those waiting for pages (the
//!   real coordinator starts such a request again on other nodes; with one node per
//!   role here, the refusal is its outcome).
//!
//! Properties, checked in every reachable state (S1-S5 of DESIGN.md §6):
//! - S1: every sequence decode admitted reads only pages held for it, carrying its
//!   tags and its own KV (decode reads its reservation, not what the commit lists);
//! - S2: no page is freed (or reassigned) while a write from it or into it is in flight;
//! - S3: a request refused by decode's admission never gets a `Prefill`; a request
//!   refused by any role's admission never gets a page write or a `Commit` (refusals
//!   are what the pools decided, whatever the protocol does next);
//! - S4: at most one outcome per request; `Succeeded` only after decode admitted a
//!   full, correct commit and completed it; once every coordinator is done, every
//!   request has exactly one outcome;
//! - S5: at quiescence (network empty, no write in flight, every coordinator done, or
//!   the coordinators crashed and the prefill node idle, and no quarantine whose
//!   retry timer still runs) every page on every live node is free.
//!
//! Besides, `every_request_can_finish` checks that from every reachable state (faults
//! included) a state where every coordinator is done is reachable by progress steps
//! alone: no deadlock and no retransmission livelock (it found two real ones while the
//! protocol was written: a lost `Committed` and a put to a dead decode node), and
//! `every_quarantine_ends` that a state without quarantined pages is (it found a
//! reservation quarantined forever when the gateway crashed before the prefill node
//! heard of the request; the decode node's `QuietQuery` fixed it).
//!
//! Configurations (page size 4 tokens, decode pool 3 pages, prefill pool 2 pages; two
//! requests of 5+2 and 3+1 tokens, the first abortable by its client): no fault;
//! one loss + one duplication + one crash of either node (the issue's configuration);
//! one corrupted + one failed page write; the incident's shape, a request whose
//! prompt is over the prefill pool but fits the decode pool, with every fault; a
//! request waiting for decode pages; a gateway crash (with a prefill crash, or with a
//! lost message and a lease expiry); a lease expiry; draining nodes.
//!
//! Each property is shown to bite by a failing variant: a deliberately broken protocol
//! (`Flaws`) for which the checker must find a counterexample.

use stateright::{Checker, HasDiscoveries, Model, Property};
use std::collections::{BTreeMap, BTreeSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Instant;
use tessera_kernels::PageTag;
use tessera_transfer::protocol::{
    Coordinator, DecodeEnv, DecodeNode, DecodeOutcome, DecodeReserveError, DecodeState, FailKind,
    FailReason, Flaws, Msg, Outcome, Output, PrefillEnv, PrefillNode, Quarantine, Refusal,
    RefusalKind, ReqId, RequestState, Role,
};
use tessera_transfer::transport::DestPage;

const S1: &str = "S1 decode reads only its sequence's pages";
const S2: &str = "S2 no page freed while a write can land";
const S3: &str = "S3 a rejected request never reaches transfer";
const S4: &str = "S4 exactly one terminal outcome, success only when verified";
const S5: &str = "S5 every page free at quiescence";
const LINKS: &str = "every message passes its receiver's sender check";

const FIRST_TOKEN: u32 = 7;

/// `Detect` target meaning "every coordinator at once" (one shared failure detector).
const EVERY_COORDINATOR: usize = usize::MAX;

/// What a page holds. Pages are not scrubbed between requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Content {
    /// Another tenant's old KV.
    Stale,
    /// Logical block `block` of request `req`.
    Kv { req: u64, block: u32 },
    /// Bytes damaged in transit.
    Corrupt,
}

fn checksum(c: Content) -> u32 {
    match c {
        Content::Stale => 0xdead,
        Content::Corrupt => 0xbad,
        Content::Kv { req, block } => ((req as u32) << 8) | block,
    }
}

/// A page of the decode pool: who holds it, the tag it carries, what it contains.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct DPage {
    held: Option<ReqId>,
    tag: PageTag,
    content: Content,
}

/// The decode node's pool and engine.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct DPool {
    page_size: u32,
    pages: Vec<DPage>,
    /// Sequences in the running batch and the pages they read.
    running: BTreeMap<ReqId, Vec<DestPage>>,
    /// Admissions since the model last looked (moved into the ghost state).
    admitted: Vec<(ReqId, u32, Vec<DestPage>)>,
    /// Requests refused at admission since the model last looked.
    refused: Vec<ReqId>,
    /// A request that fits the pool but not now waits for pages instead of being
    /// refused as busy (the decode node's FIFO).
    queue_when_busy: bool,
    /// The decode node's driver saw the prefill node's link close.
    writer_gone: bool,
}

/// A model pool's admission (I1): refuses a request that can never fit its pool
/// (`TooLarge`) or does not fit now (`Busy`); else returns the free pages' indices
/// (`held[i]`: page `i` is taken).
fn claim(held: &[bool], need: usize, pool: &str) -> Result<Vec<usize>, Refusal> {
    if need > held.len() {
        return Err(Refusal {
            kind: RefusalKind::TooLarge,
            message: format!("over the {pool} pool"),
        });
    }
    let free: Vec<usize> = (0..held.len()).filter(|&i| !held[i]).collect();
    if need > free.len() {
        return Err(Refusal {
            kind: RefusalKind::Busy,
            message: format!("{pool} pool full"),
        });
    }
    Ok(free)
}

impl DecodeEnv for DPool {
    fn reserve(
        &mut self,
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
    ) -> Result<Vec<DestPage>, DecodeReserveError> {
        let need = (prompt_tokens + max_tokens).div_ceil(self.page_size) as usize;
        let held: Vec<bool> = self.pages.iter().map(|p| p.held.is_some()).collect();
        let free = match claim(&held, need, "decode") {
            Ok(free) => free,
            Err(r) if r.kind == RefusalKind::Busy && self.queue_when_busy => {
                return Err(DecodeReserveError::NoRoomYet)
            }
            Err(r) => {
                self.refused.push(req);
                return Err(DecodeReserveError::Refused(r));
            }
        };
        let transfer = prompt_tokens.div_ceil(self.page_size) as usize;
        let mut dest = Vec::new();
        for (block, &i) in free[..need].iter().enumerate() {
            let p = &mut self.pages[i];
            p.held = Some(req);
            p.tag = PageTag {
                tenant,
                seq: req.0,
                epoch: p.tag.epoch,
                logical_block: block as u32,
            };
            if block < transfer {
                dest.push(DestPage {
                    page: i as u32,
                    tag: p.tag,
                });
            }
        }
        Ok(dest)
    }

    fn landed_checksum(&self, req: ReqId, dest: DestPage) -> Option<u32> {
        let p = self.pages.get(dest.page as usize)?;
        (p.held == Some(req) && p.tag == dest.tag).then(|| checksum(p.content))
    }

    fn start_decode(
        &mut self,
        req: ReqId,
        tokens: u32,
        first_token: u32,
        pages: &[DestPage],
    ) -> Result<(), FailReason> {
        assert_eq!(first_token, FIRST_TOKEN);
        self.running.insert(req, pages.to_vec());
        self.admitted.push((req, tokens, pages.to_vec()));
        Ok(())
    }

    fn writer_gone(&self, _req: ReqId) -> bool {
        self.writer_gone
    }

    fn release(&mut self, req: ReqId) {
        self.running.remove(&req);
        for p in &mut self.pages {
            if p.held == Some(req) {
                p.held = None;
                p.tag.epoch += 1;
            }
        }
    }
}

/// A page of the prefill pool.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PPage {
    held: Option<ReqId>,
    content: Content,
}

/// The prefill node's pool, engine and transport.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PPool {
    page_size: u32,
    pages: Vec<PPage>,
    /// Requests being computed: next block, destination pages.
    computing: BTreeMap<ReqId, (usize, Vec<DestPage>)>,
    /// Requests whose drain was asked for.
    flushing: BTreeSet<ReqId>,
    /// Requests with a failed write since their last drain.
    failed: BTreeSet<ReqId>,
    /// Requests refused at admission since the model last looked.
    refused: Vec<ReqId>,
}

impl PrefillEnv for PPool {
    fn pages_for(&self, tokens: u32) -> usize {
        tokens.div_ceil(self.page_size) as usize
    }

    fn admit_and_alloc(
        &mut self,
        req: ReqId,
        _tenant: u64,
        prompt_tokens: u32,
        _max_tokens: u32,
    ) -> Result<(), Refusal> {
        let need = self.pages_for(prompt_tokens);
        let held: Vec<bool> = self.pages.iter().map(|p| p.held.is_some()).collect();
        let free = claim(&held, need, "prefill").inspect_err(|_| self.refused.push(req))?;
        for &i in &free[..need] {
            self.pages[i].held = Some(req);
        }
        Ok(())
    }

    fn start_prefill(&mut self, req: ReqId, _tokens: u32, dest: &[DestPage]) {
        self.computing.insert(req, (0, dest.to_vec()));
    }

    fn stop_prefill(&mut self, req: ReqId) {
        self.computing.remove(&req);
    }

    fn flush(&mut self, req: ReqId) {
        self.flushing.insert(req);
    }

    fn release(&mut self, req: ReqId) {
        for p in &mut self.pages {
            if p.held == Some(req) {
                p.held = None;
            }
        }
    }
}

/// A one-sided page write in flight from a prefill page into a decode page.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Write {
    req: ReqId,
    src: u32,
    dest: DestPage,
}

/// History the properties need (never read by the protocol).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
struct Ghost {
    outcomes: Vec<Outcome>,
    refused_by_decode: bool,
    refused_by_prefill: bool,
    prefill_sent: bool,
    wrote: bool,
    commit_sent: bool,
    /// Decode admitted the sequence on a full, correct transfer.
    admitted_ok: bool,
    /// Decode admitted the sequence on anything else.
    admitted_bad: bool,
    finished_ok: bool,
    /// A drain refused the request while it waited for decode pages.
    drained_while_waiting: bool,
    /// The prefill node was asked whether it is quiet for the request before it had
    /// heard of it (its `Prefill` lost with the coordinator, or still on its way).
    asked_unheard: bool,
    /// A machine sent a message that its role does not send to that destination
    /// (`Msg::may_send`): a link receiver would cut an honest peer for it.
    unsendable: bool,
}

/// Faults and client behaviour still available.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct Budget {
    losses: u8,
    dups: u8,
    corrupt_writes: u8,
    failed_writes: u8,
    aborts: u8,
    crashes: u8,
    /// The coordinator (the gateway process) may crash: every request's coordinator
    /// vanishes and each node learns, per request, that its coordinator is gone.
    coord_crashes: u8,
    /// A decode reservation's lease may run out before its commit.
    lease_expiries: u8,
    /// Nodes may begin draining (each once).
    drains: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct PdState {
    coords: Vec<Coordinator>,
    prefill: Option<(PrefillNode, PPool)>,
    decode: Option<(DecodeNode, DPool)>,
    /// Control messages in flight, as a canonically ordered multiset.
    net: Vec<(Role, Msg)>,
    /// Page writes in flight, canonically ordered.
    writes: Vec<Write>,
    left: Budget,
    /// Per coordinator: has it learned that the prefill / decode node is dead?
    told_down: Vec<(bool, bool)>,
    /// Whether the coordinators' process is alive.
    coord_alive: bool,
    /// Notices a node's driver has yet to deliver to its machine (canonically ordered):
    /// the coordinator of a request is gone, or (decode) the writer of a request is.
    notices: Vec<(Notice, ReqId)>,
    ghost: Vec<Ghost>,
}

/// What a node's driver learns from its links.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Notice {
    /// `role`'s link to the request's coordinator closed.
    CoordinatorLost(Role),
    /// The decode node's link to the prefill node (the writer) closed.
    WriterLost,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Action {
    Deliver(usize),
    Lose(usize),
    Duplicate(usize),
    Land(usize),
    CorruptWrite(usize),
    FailWrite(usize),
    Compute(ReqId),
    Drain(ReqId),
    FinishDecode(ReqId),
    ClientGone(usize),
    Timeout(usize),
    Crash(Role),
    Detect(usize, Role),
    CoordinatorCrash,
    Notify(usize),
    LeaseExpire(ReqId),
    BeginDrain(Role),
    /// The decode node's retry timer asks the writer of a reservation quarantined for
    /// a lost coordinator again (`DecodeNode::ask_writer`).
    AskWriter(ReqId),
}

impl Action {
    /// Steps that only inject faults or client behaviour (the system never needs them).
    fn is_fault(&self) -> bool {
        matches!(
            self,
            Action::Lose(_)
                | Action::Duplicate(_)
                | Action::CorruptWrite(_)
                | Action::FailWrite(_)
                | Action::ClientGone(_)
                | Action::Crash(_)
                | Action::CoordinatorCrash
                | Action::LeaseExpire(_)
                | Action::BeginDrain(_)
        )
    }
}

#[derive(Clone, Debug)]
struct ReqSpec {
    tenant: u64,
    prompt: u32,
    max: u32,
    abortable: bool,
}

/// One model configuration.
#[derive(Clone, Debug)]
struct Cfg {
    page_size: u32,
    decode_pages: usize,
    prefill_pages: usize,
    reqs: Vec<ReqSpec>,
    budget: Budget,
    crash_roles: Vec<Role>,
    /// Coordinators learn of a crash together (one failure detector per gateway)
    /// instead of each on its own schedule.
    joint_detection: bool,
    /// The decode node queues a request that does not fit now ([`DPool::queue_when_busy`]).
    queue_when_busy: bool,
    /// The decode node's driver reports a dead prefill node as the writer being gone
    /// (what frees pages quarantined for its requests).
    writer_lost_notices: bool,
    flaws: Flaws,
    /// Outcomes and events the configuration must be able to reach.
    expect_all_succeed: bool,
    expect_rejection: bool,
    expect_commit_failure: bool,
}

struct PdModel {
    cfg: Cfg,
}

/// Orders a multiset canonically so equal multisets are equal states.
fn canon<T: Hash>(v: &mut [T]) {
    v.sort_by_cached_key(|x| {
        let mut h = DefaultHasher::new();
        x.hash(&mut h);
        h.finish()
    });
}

impl PdModel {
    /// Applies the outputs of a state machine step: sends (dropped if the peer is
    /// dead), outcomes; and records what the properties need.
    /// `from`: the role of the machine that stepped.
    fn emit(&self, st: &mut PdState, coord: Option<usize>, from: Role, outs: Vec<Output>) {
        for o in outs {
            match o {
                Output::Send { to, msg } => {
                    let g = &mut st.ghost[msg.req().0 as usize];
                    if !msg.may_send(from, to) {
                        g.unsendable = true;
                    }
                    match &msg {
                        Msg::Rejected {
                            by: Role::Decode, ..
                        } => g.refused_by_decode = true,
                        Msg::Rejected { .. } => g.refused_by_prefill = true,
                        Msg::Prefill { .. } => g.prefill_sent = true,
                        Msg::Commit { .. } => g.commit_sent = true,
                        Msg::Finished {
                            outcome: DecodeOutcome::Completed,
                            ..
                        } => g.finished_ok = true,
                        _ => {}
                    }
                    let alive = match to {
                        Role::Coordinator => st.coord_alive,
                        Role::Prefill => st.prefill.is_some(),
                        Role::Decode => st.decode.is_some(),
                    };
                    if alive {
                        st.net.push((to, msg));
                    }
                }
                Output::Outcome(o) => {
                    let i = coord.expect("only coordinators decide outcomes");
                    st.ghost[i].outcomes.push(o);
                }
                Output::Released => {}
            }
        }
        canon(&mut st.net);
    }

    /// Moves fresh admission refusals and decode admissions into the ghost state,
    /// judging each admission against the request's real prompt and the pages' real
    /// content. Refusals are what the pools decided, whatever the protocol says next.
    fn note_admissions(&self, st: &mut PdState) {
        if let Some((_, pool)) = st.prefill.as_mut() {
            for req in std::mem::take(&mut pool.refused) {
                st.ghost[req.0 as usize].refused_by_prefill = true;
            }
        }
        let Some((_, pool)) = st.decode.as_mut() else {
            return;
        };
        for req in std::mem::take(&mut pool.refused) {
            st.ghost[req.0 as usize].refused_by_decode = true;
        }
        for (req, tokens, pages) in std::mem::take(&mut pool.admitted) {
            let spec = &self.cfg.reqs[req.0 as usize];
            let ok = tokens == spec.prompt
                && pages.len() == spec.prompt.div_ceil(self.cfg.page_size) as usize
                && reads_own_pages(pool, req, &pages)
                && pages
                    .iter()
                    .enumerate()
                    .all(|(b, p)| p.tag.logical_block == b as u32);
            let g = &mut st.ghost[req.0 as usize];
            g.admitted_ok |= ok;
            g.admitted_bad |= !ok;
        }
    }

    fn req_busy(&self, st: &PdState, req: ReqId) -> bool {
        st.net.iter().any(|(_, m)| m.req() == req)
            || st.writes.iter().any(|w| w.req == req)
            || st
                .prefill
                .as_ref()
                .is_some_and(|(_, p)| p.computing.contains_key(&req) || p.flushing.contains(&req))
            || st
                .decode
                .as_ref()
                .is_some_and(|(_, d)| d.running.contains_key(&req))
    }
}

/// After the coordinators are gone: nothing in flight and no page held on any node.
fn nothing_held(st: &PdState) -> bool {
    st.net.is_empty()
        && st.writes.is_empty()
        && st.notices.is_empty()
        && st.prefill.as_ref().is_none_or(|(_, p)| {
            p.pages.iter().all(|pg| pg.held.is_none())
                && p.computing.is_empty()
                && p.flushing.is_empty()
        })
        && st
            .decode
            .as_ref()
            .is_none_or(|(_, d)| d.pages.iter().all(|pg| pg.held.is_none()) && d.running.is_empty())
}

/// Every page `req` reads is held for it, carries the tag it expects, the tag is the
/// request's, and the page holds the request's own KV for that block.
fn reads_own_pages(pool: &DPool, req: ReqId, pages: &[DestPage]) -> bool {
    pages.iter().all(|d| {
        let p = &pool.pages[d.page as usize];
        p.held == Some(req)
            && p.tag == d.tag
            && d.tag.seq == req.0
            && p.content
                == Content::Kv {
                    req: req.0,
                    block: d.tag.logical_block,
                }
    })
}

impl Model for PdModel {
    type State = PdState;
    type Action = Action;

    fn init_states(&self) -> Vec<PdState> {
        let cfg = &self.cfg;
        let mut st = PdState {
            coords: Vec::new(),
            prefill: Some((
                PrefillNode::with_flaws(cfg.flaws),
                PPool {
                    page_size: cfg.page_size,
                    pages: vec![
                        PPage {
                            held: None,
                            content: Content::Stale,
                        };
                        cfg.prefill_pages
                    ],
                    computing: BTreeMap::new(),
                    flushing: BTreeSet::new(),
                    failed: BTreeSet::new(),
                    refused: Vec::new(),
                },
            )),
            decode: Some((
                DecodeNode::with_flaws(cfg.flaws),
                DPool {
                    page_size: cfg.page_size,
                    pages: vec![
                        DPage {
                            held: None,
                            tag: PageTag::default(),
                            content: Content::Stale,
                        };
                        cfg.decode_pages
                    ],
                    running: BTreeMap::new(),
                    admitted: Vec::new(),
                    refused: Vec::new(),
                    queue_when_busy: cfg.queue_when_busy,
                    writer_gone: false,
                },
            )),
            net: Vec::new(),
            writes: Vec::new(),
            left: cfg.budget,
            told_down: vec![(false, false); cfg.reqs.len()],
            coord_alive: true,
            notices: Vec::new(),
            ghost: vec![Ghost::default(); cfg.reqs.len()],
        };
        for (i, r) in cfg.reqs.iter().enumerate() {
            let mut out = Vec::new();
            let c = Coordinator::start_with_flaws(
                ReqId(i as u64),
                r.tenant,
                r.prompt,
                r.max,
                cfg.flaws,
                &mut out,
            );
            st.coords.push(c);
            self.emit(&mut st, Some(i), Role::Coordinator, out);
        }
        vec![st]
    }

    fn actions(&self, st: &PdState, acts: &mut Vec<Action>) {
        let left = st.left;
        for i in 0..st.net.len() {
            acts.push(Action::Deliver(i));
            if left.losses > 0 {
                acts.push(Action::Lose(i));
            }
            if left.dups > 0 {
                acts.push(Action::Duplicate(i));
            }
        }
        for i in 0..st.writes.len() {
            acts.push(Action::Land(i));
            if left.corrupt_writes > 0 {
                acts.push(Action::CorruptWrite(i));
            }
            if left.failed_writes > 0 {
                acts.push(Action::FailWrite(i));
            }
        }
        if let Some((_, pool)) = &st.prefill {
            for req in pool.computing.keys() {
                acts.push(Action::Compute(*req));
            }
            for req in &pool.flushing {
                if !st.writes.iter().any(|w| w.req == *req) {
                    acts.push(Action::Drain(*req));
                }
            }
        }
        if let Some((_, pool)) = &st.decode {
            for req in pool.running.keys() {
                acts.push(Action::FinishDecode(*req));
            }
        }
        if left.crashes > 0 {
            for role in &self.cfg.crash_roles {
                let alive = match role {
                    Role::Prefill => st.prefill.is_some(),
                    Role::Decode => st.decode.is_some(),
                    Role::Coordinator => false,
                };
                if alive {
                    acts.push(Action::Crash(*role));
                }
            }
        }
        for (i, (notice, _)) in st.notices.iter().enumerate() {
            // A link delivers what was sent on it before its close is noticed: a node
            // hears its coordinator is gone only once nothing from it is in flight.
            let from_coordinator_in_flight = |role: Role| {
                st.net.iter().any(|(to, m)| {
                    *to == role
                        && matches!(
                            m,
                            Msg::Prealloc { .. }
                                | Msg::Prefill { .. }
                                | Msg::Abort { .. }
                                | Msg::Poll { .. }
                        )
                })
            };
            match notice {
                Notice::CoordinatorLost(role) if from_coordinator_in_flight(*role) => {}
                _ => acts.push(Action::Notify(i)),
            }
        }
        if left.coord_crashes > 0 && st.coord_alive {
            acts.push(Action::CoordinatorCrash);
        }
        if left.lease_expiries > 0 {
            if let Some((d, _)) = &st.decode {
                for (req, s) in d.records().states() {
                    if matches!(s, DecodeState::Reserved { .. }) {
                        acts.push(Action::LeaseExpire(req));
                    }
                }
            }
        }
        if let Some((d, _)) = &st.decode {
            // The decode node's retry timer, for each reservation quarantined for a lost
            // coordinator whose query and answer are not in flight (the real timer
            // fires regardless; a copy in flight is the same question).
            for (req, s) in d.records().states() {
                let in_flight = st.net.iter().any(|(_, m)| {
                    matches!(m, Msg::QuietQuery { req: r } | Msg::WriterQuiet { req: r } if *r == req)
                });
                if *s == DecodeState::Quarantined(Quarantine::CoordinatorLost) && !in_flight {
                    acts.push(Action::AskWriter(req));
                }
            }
        }
        if left.drains > 0 {
            if st.prefill.as_ref().is_some_and(|(p, _)| !p.is_draining()) {
                acts.push(Action::BeginDrain(Role::Prefill));
            }
            if st.decode.as_ref().is_some_and(|(d, _)| !d.is_draining()) {
                acts.push(Action::BeginDrain(Role::Decode));
            }
        }
        if !st.coord_alive {
            return; // nothing drives the coordinators any more
        }
        for (i, c) in st.coords.iter().enumerate() {
            if self.cfg.reqs[i].abortable && left.aborts > 0 && c.outcome().is_none() {
                acts.push(Action::ClientGone(i));
            }
            if !c.is_done() && !self.req_busy(st, c.req()) {
                acts.push(Action::Timeout(i));
            }
        }
        let mut joint = BTreeSet::new();
        for (i, c) in st.coords.iter().enumerate() {
            if c.is_done() {
                continue;
            }
            for (role, dead, told) in [
                (Role::Prefill, st.prefill.is_none(), st.told_down[i].0),
                (Role::Decode, st.decode.is_none(), st.told_down[i].1),
            ] {
                if dead && !told {
                    if self.cfg.joint_detection {
                        joint.insert(role);
                    } else {
                        // Each coordinator's failure detector fires on its own schedule.
                        acts.push(Action::Detect(i, role));
                    }
                }
            }
        }
        for role in joint {
            acts.push(Action::Detect(EVERY_COORDINATOR, role));
        }
    }

    fn next_state(&self, last: &PdState, action: Action) -> Option<PdState> {
        let mut st = last.clone();
        let mut out = Vec::new();
        let mut coord = None;
        // The machine whose step this is (the sender of what it emits).
        let from = match &action {
            Action::Deliver(i) | Action::Duplicate(i) => st.net[*i].0,
            Action::Compute(_) | Action::Drain(_) => Role::Prefill,
            Action::Notify(i) => match st.notices[*i].0 {
                Notice::CoordinatorLost(Role::Prefill) => Role::Prefill,
                _ => Role::Decode,
            },
            Action::BeginDrain(role) => *role,
            Action::ClientGone(_) | Action::Timeout(_) | Action::Detect(..) => Role::Coordinator,
            // The rest are decode-node steps or emit nothing.
            _ => Role::Decode,
        };
        match action {
            Action::Deliver(i) | Action::Duplicate(i) => {
                // A duplicated message is delivered once and stays in flight for a
                // later second delivery (equivalent to copying it first).
                let (to, msg) = if matches!(action, Action::Duplicate(_)) {
                    st.left.dups -= 1;
                    st.net[i].clone()
                } else {
                    st.net.remove(i)
                };
                match to {
                    Role::Coordinator if !st.coord_alive => {}
                    Role::Coordinator => {
                        let i = msg.req().0 as usize;
                        st.coords[i].on_msg(msg, &mut out);
                        coord = Some(i);
                    }
                    Role::Prefill => {
                        let (node, pool) = st.prefill.as_mut()?;
                        if let Msg::QuietQuery { req } = msg {
                            if node.records().state(req).is_none() {
                                st.ghost[req.0 as usize].asked_unheard = true;
                            }
                        }
                        node.on_msg(msg, pool, &mut out);
                    }
                    Role::Decode => {
                        let (node, pool) = st.decode.as_mut()?;
                        node.on_msg(msg, pool, &mut out);
                        // The driver offers freed pages to waiting requests after
                        // every call (a no-op when none waits).
                        node.on_capacity(pool, &mut out);
                    }
                }
            }
            Action::Lose(i) => {
                st.net.remove(i);
                st.left.losses -= 1;
            }
            Action::Land(i) | Action::CorruptWrite(i) => {
                let w = st.writes.remove(i);
                let content = if matches!(action, Action::CorruptWrite(_)) {
                    st.left.corrupt_writes -= 1;
                    Content::Corrupt
                } else {
                    // One-sided and zero-copy: the source page is read as it lands.
                    st.prefill.as_ref()?.1.pages[w.src as usize].content
                };
                let (_, dpool) = st.decode.as_mut()?;
                dpool.pages[w.dest.page as usize].content = content;
            }
            Action::FailWrite(i) => {
                let w = st.writes.remove(i);
                st.left.failed_writes -= 1;
                st.prefill.as_mut()?.1.failed.insert(w.req);
            }
            Action::Compute(req) => {
                let (node, pool) = st.prefill.as_mut()?;
                let (block, dest) = pool.computing.get(&req)?.clone();
                let src = (0..pool.pages.len())
                    .filter(|&i| pool.pages[i].held == Some(req))
                    .nth(block)
                    .expect("a source page per block");
                pool.pages[src].content = Content::Kv {
                    req: req.0,
                    block: block as u32,
                };
                if st.decode.is_some() {
                    st.writes.push(Write {
                        req,
                        src: src as u32,
                        dest: dest[block],
                    });
                } else {
                    // The peer is gone: the put fails at once.
                    pool.failed.insert(req);
                }
                st.ghost[req.0 as usize].wrote = true;
                if block + 1 == dest.len() {
                    pool.computing.remove(&req);
                    let sums: Vec<u32> = (0..dest.len())
                        .map(|b| {
                            checksum(Content::Kv {
                                req: req.0,
                                block: b as u32,
                            })
                        })
                        .collect();
                    node.on_computed(req, FIRST_TOKEN, &sums, pool, &mut out);
                } else {
                    pool.computing.get_mut(&req)?.0 += 1;
                }
                canon(&mut st.writes);
            }
            Action::Drain(req) => {
                let (node, pool) = st.prefill.as_mut()?;
                pool.flushing.remove(&req);
                let result = if pool.failed.remove(&req) {
                    Err(FailReason::new(FailKind::Transport, "a page write failed"))
                } else {
                    Ok(())
                };
                node.on_drained(req, result, pool, &mut out);
            }
            Action::FinishDecode(req) => {
                let (node, pool) = st.decode.as_mut()?;
                node.on_decode_finished(req, DecodeOutcome::Completed, pool, &mut out);
                node.on_capacity(pool, &mut out);
            }
            Action::ClientGone(i) => {
                st.left.aborts -= 1;
                st.coords[i].on_client_gone(&mut out);
                coord = Some(i);
            }
            Action::Timeout(i) => {
                st.coords[i].on_timeout(&mut out);
                coord = Some(i);
            }
            Action::Crash(role) => {
                st.left.crashes -= 1;
                match role {
                    Role::Prefill => {
                        st.prefill = None;
                        if self.cfg.writer_lost_notices && st.decode.is_some() {
                            st.decode.as_mut()?.1.writer_gone = true;
                            for r in 0..st.coords.len() {
                                st.notices.push((Notice::WriterLost, ReqId(r as u64)));
                            }
                            canon(&mut st.notices);
                        }
                    }
                    Role::Decode => {
                        st.decode = None;
                        // Writes into the dead node fail at the source.
                        if let Some((_, pool)) = st.prefill.as_mut() {
                            for w in &st.writes {
                                pool.failed.insert(w.req);
                            }
                        }
                    }
                    Role::Coordinator => unreachable!(),
                }
                st.writes.clear();
                st.net.retain(|(to, _)| *to != role);
                // A crashed node's pending notices die with it.
                st.notices.retain(|(n, _)| {
                    let about_it = matches!(n, Notice::CoordinatorLost(r) if *r == role)
                        || (role == Role::Decode && *n == Notice::WriterLost);
                    !about_it
                });
            }
            Action::CoordinatorCrash => {
                st.left.coord_crashes -= 1;
                st.coord_alive = false;
                st.net.retain(|(to, _)| *to != Role::Coordinator);
                for (role, alive) in [
                    (Role::Prefill, st.prefill.is_some()),
                    (Role::Decode, st.decode.is_some()),
                ] {
                    if alive {
                        for r in 0..st.coords.len() {
                            st.notices
                                .push((Notice::CoordinatorLost(role), ReqId(r as u64)));
                        }
                    }
                }
                canon(&mut st.notices);
            }
            Action::Notify(i) => {
                let (notice, req) = st.notices.remove(i);
                match notice {
                    Notice::CoordinatorLost(Role::Prefill) => {
                        // The prefill node's driver hears of the link's close only for
                        // the requests that link carries: those it holds a live record
                        // of. A request it never heard of (its `Prefill` was lost with
                        // the coordinator) or already ended is not among them.
                        let (node, pool) = st.prefill.as_mut()?;
                        if node.records().state(req).is_some_and(|s| !s.is_terminal()) {
                            node.on_coordinator_lost(req, pool, &mut out);
                        }
                    }
                    Notice::CoordinatorLost(_) => {
                        let (node, pool) = st.decode.as_mut()?;
                        node.on_coordinator_lost(req, pool, &mut out);
                        node.on_capacity(pool, &mut out);
                    }
                    Notice::WriterLost => {
                        let (node, pool) = st.decode.as_mut()?;
                        node.on_writer_quiet(req, pool, &mut out);
                        node.on_capacity(pool, &mut out);
                    }
                }
            }
            Action::AskWriter(req) => {
                let (node, pool) = st.decode.as_mut()?;
                node.ask_writer(req, pool, &mut out);
                node.on_capacity(pool, &mut out);
            }
            Action::LeaseExpire(req) => {
                st.left.lease_expiries -= 1;
                let (node, pool) = st.decode.as_mut()?;
                node.on_lease_expired(req, pool, &mut out);
            }
            Action::BeginDrain(role) => {
                st.left.drains -= 1;
                match role {
                    Role::Prefill => st.prefill.as_mut()?.0.begin_drain(),
                    _ => {
                        st.decode.as_mut()?.0.begin_drain(&mut out);
                        for o in &out {
                            if let Output::Send {
                                msg: Msg::Rejected { req, .. },
                                ..
                            } = o
                            {
                                st.ghost[req.0 as usize].drained_while_waiting = true;
                            }
                        }
                    }
                }
            }
            Action::Detect(which, role) => {
                let all = 0..st.coords.len();
                for i in all.filter(|&i| which == EVERY_COORDINATOR || which == i) {
                    let told = match role {
                        Role::Prefill => &mut st.told_down[i].0,
                        _ => &mut st.told_down[i].1,
                    };
                    if *told || st.coords[i].is_done() {
                        continue;
                    }
                    *told = true;
                    let mut out = Vec::new();
                    st.coords[i].on_node_down(role, &mut out);
                    self.emit(&mut st, Some(i), Role::Coordinator, out);
                }
            }
        }
        self.emit(&mut st, coord, from, out);
        self.note_admissions(&mut st);
        Some(st)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut p = vec![
            Property::always(S1, |_, st: &PdState| {
                st.decode.as_ref().is_none_or(|(_, pool)| {
                    pool.running
                        .iter()
                        .all(|(req, pages)| reads_own_pages(pool, *req, pages))
                })
            }),
            Property::always(S2, |_, st: &PdState| {
                st.writes.iter().all(|w| {
                    let src_held = st
                        .prefill
                        .as_ref()
                        .is_none_or(|(_, p)| p.pages[w.src as usize].held == Some(w.req));
                    let dest_held = st.decode.as_ref().is_none_or(|(_, d)| {
                        let page = &d.pages[w.dest.page as usize];
                        page.held == Some(w.req) && page.tag == w.dest.tag
                    });
                    src_held && dest_held
                })
            }),
            Property::always(S3, |_, st: &PdState| {
                st.ghost.iter().all(|g| {
                    let transferred = g.wrote || g.commit_sent;
                    !(g.refused_by_decode && (g.prefill_sent || transferred))
                        && !(g.refused_by_prefill && transferred)
                })
            }),
            Property::always(S4, |_, st: &PdState| {
                let each = st.ghost.iter().all(|g| {
                    g.outcomes.len() <= 1
                        && (!g.outcomes.contains(&Outcome::Succeeded)
                            || (g.admitted_ok && !g.admitted_bad && g.finished_ok))
                });
                let all_done = st.coords.iter().all(Coordinator::is_done);
                each && (!all_done || st.ghost.iter().all(|g| g.outcomes.len() == 1))
            }),
            Property::always(S5, |_, st: &PdState| {
                let idle_prefill = st
                    .prefill
                    .as_ref()
                    .is_none_or(|(_, p)| p.computing.is_empty() && p.flushing.is_empty());
                // A reservation quarantined for a lost coordinator keeps its decode
                // node's retry timer going (it asks the writer until it answers):
                // not quiescent. `every_quarantine_ends` shows that each one ends.
                let asking = st.decode.as_ref().is_some_and(|(d, _)| {
                    d.records()
                        .states()
                        .any(|(_, s)| *s == DecodeState::Quarantined(Quarantine::CoordinatorLost))
                });
                let quiescent = st.net.is_empty()
                    && st.writes.is_empty()
                    && st.notices.is_empty()
                    && !asking
                    && (st.coords.iter().all(Coordinator::is_done)
                        || (!st.coord_alive && idle_prefill));
                let prefill_free = st.prefill.as_ref().is_none_or(|(_, p)| {
                    p.pages.iter().all(|pg| pg.held.is_none())
                        && p.computing.is_empty()
                        && p.flushing.is_empty()
                });
                let decode_free = st.decode.as_ref().is_none_or(|(_, d)| {
                    d.pages.iter().all(|pg| pg.held.is_none()) && d.running.is_empty()
                });
                !quiescent || (prefill_free && decode_free)
            }),
            Property::always(LINKS, |_, st: &PdState| {
                st.ghost.iter().all(|g| !g.unsendable)
            }),
            Property::sometimes("a request succeeds", |_, st: &PdState| {
                st.ghost
                    .iter()
                    .any(|g| g.outcomes.contains(&Outcome::Succeeded))
            }),
        ];
        if self.cfg.expect_all_succeed {
            p.push(Property::sometimes(
                "both requests succeed",
                |_, st: &PdState| {
                    st.ghost
                        .iter()
                        .all(|g| g.outcomes.contains(&Outcome::Succeeded))
                },
            ));
        }
        if self.cfg.budget.aborts > 0 {
            p.push(Property::sometimes(
                "the client aborts mid-transfer",
                |_, st: &PdState| {
                    st.ghost.iter().any(|g| {
                        g.outcomes.contains(&Outcome::Aborted) && g.wrote && !g.commit_sent
                    })
                },
            ));
        }
        if self.cfg.expect_rejection {
            p.push(Property::sometimes(
                "a request is rejected",
                |_, st: &PdState| {
                    st.ghost
                        .iter()
                        .any(|g| matches!(g.outcomes.first(), Some(Outcome::Rejected(_))))
                },
            ));
        }
        if self.cfg.queue_when_busy {
            p.push(Property::sometimes(
                "a request waits for decode pages, then is reserved",
                |_, st: &PdState| {
                    st.decode.as_ref().is_some_and(|(d, _)| {
                        d.waiting().count() == 1
                            && d.records()
                                .states()
                                .any(|(_, s)| matches!(s, DecodeState::Reserved { .. }))
                    })
                },
            ));
        }
        if self.cfg.budget.coord_crashes + self.cfg.budget.lease_expiries > 0 {
            p.push(Property::sometimes(
                "a reservation is quarantined while a write is in flight",
                |_, st: &PdState| {
                    st.decode.as_ref().is_some_and(|(d, _)| {
                        d.records().states().any(|(req, s)| {
                            matches!(s, DecodeState::Quarantined(_))
                                && st.writes.iter().any(|w| w.req == req)
                        })
                    })
                },
            ));
        }
        if self.cfg.budget.coord_crashes > 0 {
            p.push(Property::sometimes(
                "a reservation whose writer never heard of it is freed on the writer's answer",
                |_, st: &PdState| {
                    !st.coord_alive
                        && st.ghost.iter().any(|g| g.asked_unheard && !g.prefill_sent)
                        && nothing_held(st)
                },
            ));
        }
        if self.cfg.budget.drains > 0 {
            p.push(Property::sometimes(
                "a draining decode node refuses a request that waited for pages",
                |_, st: &PdState| {
                    st.ghost.iter().any(|g| {
                        g.drained_while_waiting
                            && matches!(g.outcomes.first(), Some(Outcome::Rejected(r))
                                if r.drained_by() == Some(Role::Decode))
                    })
                },
            ));
            p.push(Property::sometimes(
                "a draining prefill node refuses a request",
                |_, st: &PdState| {
                    st.prefill.as_ref().is_some_and(|(p, _)| {
                        p.records().states().any(|(_, s)| {
                            matches!(s, tessera_transfer::protocol::PrefillState::Refused(r)
                                if r.drained_by() == Some(Role::Prefill))
                        })
                    })
                },
            ));
        }
        if self.cfg.expect_commit_failure {
            p.push(Property::sometimes(
                "a commit fails verification",
                |_, st: &PdState| {
                    st.decode.as_ref().is_some_and(|(d, _)| {
                        d.records()
                            .states()
                            .any(|(_, s)| matches!(s, DecodeState::CommitFailed(_)))
                    })
                },
            ));
        }
        if !self.cfg.crash_roles.is_empty() {
            p.push(Property::sometimes(
                "a crash is survived",
                |_, st: &PdState| {
                    (st.prefill.is_none() || st.decode.is_none())
                        && st.coords.iter().all(Coordinator::is_done)
                        && st.net.is_empty()
                },
            ));
        }
        p
    }
}

fn run(cfg: Cfg, stop_at: Option<&'static str>) -> impl Checker<PdModel> {
    let mut b = PdModel { cfg }.checker().threads(2);
    if let Some(name) = stop_at {
        b = b.finish_when(HasDiscoveries::AnyOf(BTreeSet::from([name])));
    }
    b.spawn_bfs().join()
}

/// Two requests whose pools overlap: page size 4 tokens; decode pool 3 pages
/// (request 0: 5 + 2 tokens, 2 pages; request 1: 3 + 1 tokens, 1 page), prefill pool
/// 2 pages (request 0 needs 2, request 1 needs 1: whichever comes second is refused
/// while the other holds its pages, and freed pages are reused). Request 0 may be
/// aborted by its client at any point. No fault is enabled.
fn two_requests() -> Cfg {
    Cfg {
        page_size: 4,
        decode_pages: 3,
        prefill_pages: 2,
        reqs: vec![
            ReqSpec {
                tenant: 100,
                prompt: 5,
                max: 2,
                abortable: true,
            },
            ReqSpec {
                tenant: 200,
                prompt: 3,
                max: 1,
                abortable: false,
            },
        ],
        budget: Budget {
            losses: 0,
            dups: 0,
            corrupt_writes: 0,
            failed_writes: 0,
            aborts: 1,
            crashes: 0,
            coord_crashes: 0,
            lease_expiries: 0,
            drains: 0,
        },
        crash_roles: vec![],
        joint_detection: false,
        queue_when_busy: false,
        writer_lost_notices: false,
        flaws: Flaws::default(),
        expect_all_succeed: true,
        expect_rejection: true,
        expect_commit_failure: false,
    }
}

/// [`two_requests`] where one control message may be lost and one duplicated.
fn lossy() -> Cfg {
    let mut c = two_requests();
    c.budget.losses = 1;
    c.budget.dups = 1;
    c
}

/// [`two_requests`] where the prefill or the decode node may crash once.
fn crashing() -> Cfg {
    let mut c = two_requests();
    c.budget.crashes = 1;
    c.crash_roles = vec![Role::Prefill, Role::Decode];
    c
}

/// The issue's configuration: two requests, one client abort, reordering, one lost
/// and one duplicated control message, and a crash of either node at any point.
fn everything() -> Cfg {
    let mut c = lossy();
    c.budget.crashes = 1;
    c.crash_roles = vec![Role::Prefill, Role::Decode];
    c
}

/// [`two_requests`] where one page write may land corrupted and one may fail.
fn faulty_writes() -> Cfg {
    let mut c = two_requests();
    c.budget.corrupt_writes = 1;
    c.budget.failed_writes = 1;
    c.expect_commit_failure = true;
    c
}

/// The incident's shape: request 1's prompt (9 tokens, 3 pages) is over the prefill
/// pool (2 pages) but fits the decode pool (3 pages), so decode reserves and prefill
/// refuses it for size; request 0 (1 page) competes with it for decode pages, so
/// decode may refuse one of them (pool busy).
fn oversized() -> Cfg {
    let mut c = two_requests();
    c.reqs[0].prompt = 3;
    c.reqs[0].max = 1;
    c.reqs[1].prompt = 9;
    c.reqs[1].max = 2;
    c.expect_all_succeed = false;
    c
}

/// [`two_requests`] with a decode pool of 2 pages, which holds either request but not
/// both: the second waits in the decode node's FIFO (no busy refusal) until the first
/// one's pages are freed, and both must still complete. With one lost and one
/// duplicated message and a crash of either node.
fn queued() -> Cfg {
    let mut c = two_requests();
    c.decode_pages = 2;
    c.queue_when_busy = true;
    // Nothing is refused: the decode node waits instead of answering busy.
    c.expect_rejection = false;
    c.budget.losses = 1;
    c.budget.dups = 1;
    c
}

/// [`two_requests`] where the gateway process may crash at any point (every
/// coordinator gone, each node told per request, in any order, while page writes may
/// still be in flight and land late) and the prefill node may crash too (the decode
/// node then hears that the writer is gone).
fn coordinator_crash() -> Cfg {
    let mut c = two_requests();
    c.budget.aborts = 0;
    c.budget.coord_crashes = 1;
    c.budget.crashes = 1;
    c.crash_roles = vec![Role::Prefill];
    c.writer_lost_notices = true;
    c.expect_all_succeed = false;
    c
}

/// [`coordinator_crash`] where one control message may be lost (the decode node's
/// `QuietQuery` or the writer's `WriterQuiet` among them) and a
/// reservation's lease may run out before its commit; the prefill node does not
/// crash, so only its answers end quarantines.
fn coordinator_crash_lossy() -> Cfg {
    let mut c = coordinator_crash();
    c.budget.crashes = 0;
    c.crash_roles = vec![];
    c.budget.losses = 1;
    c.budget.lease_expiries = 1;
    c
}

/// [`two_requests`] where a decode reservation's lease may run out before its commit
/// (a slow or stuck prefill), and a client may abort.
fn lease_expiry() -> Cfg {
    let mut c = two_requests();
    c.budget.lease_expiries = 1;
    c
}

/// [`queued`] (the second request waits for decode pages; one lost and one
/// duplicated message) where either node may begin draining at any point: a drain
/// refuses new requests and, at the decode node, the waiting one.
fn draining() -> Cfg {
    let mut c = queued();
    c.budget.drains = 2;
    // Drain refusals are rejections.
    c.expect_rejection = true;
    c
}

/// Checks every property in every reachable state (BFS) and returns the number of
/// unique states.
fn check_safe(name: &str, cfg: Cfg) -> usize {
    let t = Instant::now();
    let checker = run(cfg, None);
    let states = checker.unique_state_count();
    println!(
        "{name}: {states} unique states, {} total, depth {}, {:.1?}",
        checker.state_count(),
        checker.max_depth(),
        t.elapsed()
    );
    checker.assert_properties();
    states
}

// Pinned unique state counts: a change means the protocol or the model changed
// behaviour; re-pin only after reading why.
const ABORT_REORDER_STATES: usize = 5332;
const EVERYTHING_STATES: usize = 2806727;
const WRITE_FAULT_STATES: usize = 18939;
const OVERSIZED_STATES: usize = 389987;
const QUEUED_STATES: usize = 150082;
const COORDINATOR_CRASH_STATES: usize = 152869;
const LEASE_STATES: usize = 37812;
const DRAINING_STATES: usize = 757469;
const COORDINATOR_CRASH_LOSSY_STATES: usize = 503861;

#[test]
fn safe_with_abort_and_reordering() {
    assert_eq!(
        check_safe("abort+reorder", two_requests()),
        ABORT_REORDER_STATES
    );
    // Depth-first search reaches the same states.
    let dfs = PdModel {
        cfg: two_requests(),
    }
    .checker()
    .threads(2)
    .spawn_dfs()
    .join();
    dfs.assert_properties();
    assert_eq!(dfs.unique_state_count(), ABORT_REORDER_STATES);
}

/// The issue's configuration: two requests, one client abort, reordering, one lost
/// and one duplicated control message, and a crash of either node at any point.
#[test]
fn safe_with_loss_duplication_and_crash() {
    assert_eq!(
        check_safe("abort+loss+dup+crash", everything()),
        EVERYTHING_STATES
    );
}

#[test]
fn safe_with_corrupt_and_failed_writes() {
    assert_eq!(
        check_safe("write faults", faulty_writes()),
        WRITE_FAULT_STATES
    );
}

#[test]
fn safe_with_a_request_waiting_for_decode_pages() {
    assert_eq!(check_safe("queued", queued()), QUEUED_STATES);
}

#[test]
fn safe_when_the_coordinator_crashes_with_writes_in_flight() {
    assert_eq!(
        check_safe("coordinator crash", coordinator_crash()),
        COORDINATOR_CRASH_STATES
    );
}

#[test]
fn safe_when_a_reservation_lease_expires() {
    assert_eq!(check_safe("lease expiry", lease_expiry()), LEASE_STATES);
}

#[test]
fn safe_when_nodes_drain() {
    assert_eq!(check_safe("draining", draining()), DRAINING_STATES);
}

#[test]
fn s2_catches_freeing_at_once_when_the_coordinator_is_lost() {
    caught(
        coordinator_crash(),
        flaw(|f| f.decode_frees_on_coordinator_lost = true),
        S2,
    );
}

#[test]
fn s2_catches_freeing_at_once_when_the_lease_expires() {
    caught(
        lease_expiry(),
        flaw(|f| f.decode_frees_on_lease_expiry = true),
        S2,
    );
}

#[test]
fn safe_with_an_oversized_request() {
    let mut c = oversized();
    c.budget.losses = 1;
    c.budget.dups = 1;
    c.budget.corrupt_writes = 1;
    c.budget.crashes = 1;
    c.crash_roles = vec![Role::Prefill, Role::Decode];
    c.expect_commit_failure = true;
    assert_eq!(check_safe("oversized", c), OVERSIZED_STATES);
}

/// The goal of [`every_request_can_finish`]: every coordinator is done, or, once the
/// coordinators are gone (their process crashed), nothing is held or in flight
/// anywhere.
const FINISHED: Goal = ("a request can never finish", |st| {
    st.coords.iter().all(Coordinator::is_done) || (!st.coord_alive && nothing_held(st))
});

/// The goal of [`every_quarantine_ends`]: the decode node (if alive) holds no
/// quarantined reservation.
const NO_QUARANTINE: Goal = ("a quarantine never ends", |st| {
    st.decode.as_ref().is_none_or(|(d, _)| {
        !d.records()
            .states()
            .any(|(_, s)| matches!(s, DecodeState::Quarantined(_)))
    })
});

/// What a liveness check wants reachable, and how its failure reads.
type Goal = (&'static str, fn(&PdState) -> bool);

/// Liveness under fair scheduling: from every reachable state (faults included), a
/// state where every coordinator is done is reachable by progress steps alone (no
/// further fault, abort or crash). With finitely many states this rules out a request
/// stuck forever (a deadlock or a retransmission livelock).
fn every_request_can_finish(name: &str, cfg: Cfg) {
    always_reachable(name, cfg, &[FINISHED]);
}

/// Every quarantine ends: from every reachable state, a state where the decode node
/// holds no quarantined reservation is reachable by progress steps alone. A
/// quarantine never ends on a timer (S2 forbids it while a write can land): this
/// shows that the writer's answer, a commit, the coordinator's abort or the writer's
/// link closing always comes, also when the writer never heard of the request.
/// Checked with [`every_request_can_finish`]'s goal in the same pass.
fn every_quarantine_ends(name: &str, cfg: Cfg) {
    always_reachable(name, cfg, &[NO_QUARANTINE, FINISHED]);
}

/// For each goal: from every reachable state (faults included) a state where it
/// holds is reachable by progress steps alone (no further fault, abort or crash);
/// otherwise prints the shortest path to the first state that cannot reach it and
/// fails. One exploration for all goals.
fn always_reachable(name: &str, cfg: Cfg, goals: &[Goal]) {
    use std::collections::{HashMap, VecDeque};
    let t = Instant::now();
    let model = PdModel { cfg };
    let fp = |st: &PdState| {
        let mut h = DefaultHasher::new();
        st.hash(&mut h);
        h.finish()
    };
    let mut ids: HashMap<u64, u32> = HashMap::new();
    let mut preds: Vec<Vec<u32>> = Vec::new();
    // Per state, a bit per goal that holds there.
    let mut holds: Vec<u8> = Vec::new();
    let mut parent: Vec<Option<(u32, Action)>> = Vec::new();
    let mut queue = VecDeque::new();
    assert!(goals.len() <= 8);
    for st in model.init_states() {
        ids.insert(fp(&st), 0);
        preds.push(Vec::new());
        holds.push(0);
        parent.push(None);
        queue.push_back((0u32, st));
    }
    let mut acts = Vec::new();
    while let Some((id, st)) = queue.pop_front() {
        holds[id as usize] = goals
            .iter()
            .enumerate()
            .filter(|(_, (_, g))| g(&st))
            .fold(0, |bits, (i, _)| bits | 1 << i);
        acts.clear();
        model.actions(&st, &mut acts);
        for a in acts.drain(..) {
            let progress = !a.is_fault();
            let Some(next) = model.next_state(&st, a.clone()) else {
                continue;
            };
            let n = ids.len() as u32;
            let nid = *ids.entry(fp(&next)).or_insert_with(|| {
                preds.push(Vec::new());
                holds.push(0);
                parent.push(Some((id, a.clone())));
                queue.push_back((n, next));
                n
            });
            if progress {
                preds[nid as usize].push(id);
            }
        }
    }
    let mut failed = Vec::new();
    for (i, (what, _)) in goals.iter().enumerate() {
        let mut can: Vec<bool> = holds.iter().map(|h| h & 1 << i != 0).collect();
        let mut stack: Vec<u32> = (0..can.len() as u32).filter(|&i| can[i as usize]).collect();
        while let Some(n) = stack.pop() {
            for &p in &preds[n as usize] {
                if !can[p as usize] {
                    can[p as usize] = true;
                    stack.push(p);
                }
            }
        }
        let stuck = can.iter().filter(|c| !**c).count();
        if let Some(bad) = can.iter().position(|c| !*c) {
            // Replay the shortest path to the first such state, for the failure message.
            let mut path = Vec::new();
            let mut at = bad as u32;
            while let Some((p, a)) = &parent[at as usize] {
                path.push(a.clone());
                at = *p;
            }
            path.reverse();
            let mut st = model.init_states().remove(0);
            for a in &path {
                st = model.next_state(&st, a.clone()).expect("replay");
            }
            println!("{name}: stuck after {path:?}\n{st:#?}");
            failed.push(format!("{stuck} states from which {what}"));
        }
        println!(
            "{name}: {} states, {stuck} from which {what}, {:.1?}",
            can.len(),
            t.elapsed()
        );
    }
    assert!(failed.is_empty(), "{name}: {}", failed.join("; "));
}

#[test]
fn every_request_can_finish_despite_faults() {
    every_request_can_finish("abort+reorder", two_requests());
    every_request_can_finish("loss+dup", lossy());
    every_request_can_finish("crash", crashing());
    every_request_can_finish("write faults", faulty_writes());
    every_request_can_finish("oversized", oversized());
    every_request_can_finish("queued", queued());
    every_request_can_finish("coordinator crash", coordinator_crash());
    every_request_can_finish("lease expiry", lease_expiry());
    every_request_can_finish("draining", draining());
}

/// The issue's configuration, with coordinators learning of the crash together (the
/// per-coordinator schedules are covered by `crashing()` above; together they would
/// take too long for the test suite).
#[test]
fn every_request_can_finish_in_the_issue_configuration() {
    let mut c = everything();
    c.joint_detection = true;
    every_request_can_finish("abort+loss+dup+crash, joint detection", c);
}

/// Runs a deliberately broken variant and requires the checker to find a
/// counterexample to `property`; prints the shortest prefix that breaks it.
fn caught(cfg: Cfg, flaws: Flaws, property: &'static str) {
    let t = Instant::now();
    let checker = run(Cfg { flaws, ..cfg }, Some(property));
    let path = checker.discovery(property).unwrap_or_else(|| {
        panic!(
            "{flaws:?}: no counterexample to {property:?} in {} states",
            checker.unique_state_count()
        )
    });
    let model = checker.model();
    let prop = model
        .properties()
        .into_iter()
        .find(|p| p.name == property)
        .expect("property exists");
    let steps = path.into_vec();
    let first_bad = steps
        .iter()
        .position(|(st, _)| !(prop.condition)(model, st))
        .expect("the counterexample's last state violates the property");
    let actions: Vec<&Action> = steps[..first_bad]
        .iter()
        .filter_map(|(_, a)| a.as_ref())
        .collect();
    println!(
        "{property}: caught in {:.1?} after {} states, {} steps: {actions:?}",
        t.elapsed(),
        checker.unique_state_count(),
        actions.len()
    );
}

fn flaw(f: fn(&mut Flaws)) -> Flaws {
    let mut flaws = Flaws::default();
    f(&mut flaws);
    flaws
}

/// Decode trusts the commit without the I4 checks: a corrupted page is decoded (S1)
/// and the client gets a 200 (S4).
#[test]
fn s1_s4_catch_decode_skipping_commit_checks() {
    let mut c = two_requests();
    c.budget.corrupt_writes = 1;
    let f = flaw(|f| f.decode_skips_commit_checks = true);
    caught(c.clone(), f, S1);
    caught(c, f, S4);
}

/// Incident shape: prefill turns a refused request into a one-token placeholder and
/// decode trusts the (short) commit: decode reads stale pages of another tenant (S1).
#[test]
fn s1_s3_catch_placeholder_with_trusting_decode() {
    let f = flaw(|f| {
        f.prefill_placeholder_on_refusal = true;
        f.decode_skips_commit_checks = true;
    });
    caught(two_requests(), f, S3);
    caught(two_requests(), f, S1);
}

/// Decode admits a duplicated commit again, after the pages were freed (S1).
#[test]
fn s1_catches_duplicate_commit_admission() {
    let mut c = two_requests();
    c.budget.dups = 1;
    caught(c, flaw(|f| f.decode_accepts_duplicate_commit = true), S1);
}

/// The coordinator aborts both sides at once: decode frees pages a write still targets.
#[test]
fn s2_catches_abort_without_waiting_for_prefill_ack() {
    caught(
        two_requests(),
        flaw(|f| f.abort_decode_with_prefill = true),
        S2,
    );
}

/// Prefill releases its source pages and commits before the transport drained.
#[test]
fn s2_catches_commit_before_drain() {
    caught(
        two_requests(),
        flaw(|f| f.prefill_commits_before_drain = true),
        S2,
    );
}

/// Without an abort tombstone a late `Prefill` starts writing into freed pages.
#[test]
fn s2_catches_missing_abort_tombstone() {
    caught(
        two_requests(),
        flaw(|f| f.prefill_forgets_aborts = true),
        S2,
    );
}

/// The coordinator treats decode's refusal as "go on" (finished-vs-rejected).
#[test]
fn s3_catches_coordinator_proceeding_after_rejection() {
    caught(
        oversized(),
        flaw(|f| f.coordinator_proceeds_on_rejected = true),
        S3,
    );
}

/// The incident: a refused prompt rides on as a one-token placeholder and is transferred.
#[test]
fn s3_catches_placeholder_transfer() {
    caught(
        oversized(),
        flaw(|f| f.prefill_placeholder_on_refusal = true),
        S3,
    );
}

/// The coordinator reports success when the decode node dies mid-decode (200 on a
/// truncated answer).
#[test]
fn s4_catches_success_on_decode_crash() {
    let mut c = two_requests();
    c.budget.crashes = 1;
    c.crash_roles = vec![Role::Decode];
    caught(
        c,
        flaw(|f| f.coordinator_success_on_decode_crash = true),
        S4,
    );
}

/// Decode keeps the reserved pages after a failed commit.
#[test]
fn s5_catches_leak_on_commit_failure() {
    let mut c = two_requests();
    c.budget.corrupt_writes = 1;
    caught(c, flaw(|f| f.decode_leaks_on_commit_failed = true), S5);
}

/// The gateway crashes, with a lost message and a lease that runs out:
/// every property holds, including for reservations whose writer never heard of the
/// request (its `Prefill` died with the coordinator).
#[test]
fn safe_when_the_coordinator_crashes_with_a_loss_and_a_lease_expiry() {
    assert_eq!(
        check_safe("coordinator crash, lossy", coordinator_crash_lossy()),
        COORDINATOR_CRASH_LOSSY_STATES
    );
}

/// Every quarantine ends, by progress alone: after a gateway crash (also before the
/// prefill node heard of the request, also with a lost query or answer, also when
/// the lease ran out first) and after a lease expiry.
#[test]
fn every_quarantine_ends_despite_faults() {
    every_quarantine_ends("coordinator crash", coordinator_crash());
    every_quarantine_ends("coordinator crash, lossy", coordinator_crash_lossy());
    every_quarantine_ends("lease expiry", lease_expiry());
}

/// A bounded quarantine: the decode node frees a reservation quarantined for a lost
/// coordinator when its retry timer fires, without the writer's answer, while the
/// writer's pages are still on their way (S2).
#[test]
fn s2_catches_a_quarantine_freed_on_a_timer() {
    caught(
        coordinator_crash(),
        flaw(|f| f.decode_frees_quarantine_unasked = true),
        S2,
    );
}

/// The writer answers `QuietQuery` while it still computes or drains the request.
#[test]
fn s2_catches_a_writer_answering_quiet_while_writing() {
    caught(
        coordinator_crash(),
        flaw(|f| f.prefill_quiet_while_writing = true),
        S2,
    );
}

/// The writer answers `QuietQuery` for a request it never heard of without keeping a
/// record: the coordinator's `Prefill`, still on its way, starts writing into pages
/// the decode node freed on that answer.
#[test]
fn s2_catches_a_writer_answering_quiet_without_a_record() {
    caught(
        coordinator_crash(),
        flaw(|f| f.prefill_quiet_without_record = true),
        S2,
    );
}
