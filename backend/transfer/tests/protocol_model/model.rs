//! The model: the production state machines (`Coordinator`, `PrefillNode`,
//! `DecodeNode`) in one state with their environments ([`crate::env`]), the network
//! and the faults; the steps ([`Action`]) that move it, and the configuration
//! ([`Cfg`]) that bounds them. What is checked is in [`crate::properties`].

use crate::env::{checksum, reads_own_pages, Content, DPage, DPool, PPage, PPool, FIRST_TOKEN};
use stateright::{Model, Property};
use std::collections::{BTreeMap, BTreeSet};
use std::hash::{DefaultHasher, Hash, Hasher};
use tessera_kernels::PageTag;
use tessera_transfer::protocol::{
    Coordinator, DecodeNode, DecodeOutcome, DecodeState, FailKind, FailReason, Flaws, Msg, Outcome,
    Output, PrefillNode, Quarantine, ReqId, RequestState, Role,
};
use tessera_transfer::transport::DestPage;

/// `Detect` target meaning "every coordinator at once" (one shared failure detector).
pub(crate) const EVERY_COORDINATOR: usize = usize::MAX;

/// A one-sided page write in flight from a prefill page into a decode page.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Write {
    pub(crate) req: ReqId,
    pub(crate) src: u32,
    pub(crate) dest: DestPage,
}

/// History the properties need (never read by the protocol).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub(crate) struct Ghost {
    pub(crate) outcomes: Vec<Outcome>,
    pub(crate) refused_by_decode: bool,
    pub(crate) refused_by_prefill: bool,
    pub(crate) prefill_sent: bool,
    pub(crate) wrote: bool,
    pub(crate) commit_sent: bool,
    /// Decode admitted the sequence on a full, correct transfer.
    pub(crate) admitted_ok: bool,
    /// Decode admitted the sequence on anything else.
    pub(crate) admitted_bad: bool,
    pub(crate) finished_ok: bool,
    /// A drain refused the request while it waited for decode pages.
    pub(crate) drained_while_waiting: bool,
    /// The prefill node was asked whether it is quiet for the request before it had
    /// heard of it (its `Prefill` lost with the coordinator, or still on its way).
    pub(crate) asked_unheard: bool,
    /// A machine sent a message that its role does not send to that destination
    /// (`Msg::may_send`): a link receiver would cut an honest peer for it.
    pub(crate) unsendable: bool,
}

/// Faults and client behaviour still available.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct Budget {
    pub(crate) losses: u8,
    pub(crate) dups: u8,
    pub(crate) corrupt_writes: u8,
    pub(crate) failed_writes: u8,
    pub(crate) aborts: u8,
    pub(crate) crashes: u8,
    /// The coordinator (the gateway process) may crash: every request's coordinator
    /// vanishes and each node learns, per request, that its coordinator is gone.
    pub(crate) coord_crashes: u8,
    /// A decode reservation's lease may run out before its commit.
    pub(crate) lease_expiries: u8,
    /// Nodes may begin draining (each once).
    pub(crate) drains: u8,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PdState {
    pub(crate) coords: Vec<Coordinator>,
    pub(crate) prefill: Option<(PrefillNode, PPool)>,
    pub(crate) decode: Option<(DecodeNode, DPool)>,
    /// Control messages in flight, as a canonically ordered multiset.
    pub(crate) net: Vec<(Role, Msg)>,
    /// Page writes in flight, canonically ordered.
    pub(crate) writes: Vec<Write>,
    pub(crate) left: Budget,
    /// Per coordinator: has it learned that the prefill / decode node is dead?
    pub(crate) told_down: Vec<(bool, bool)>,
    /// Whether the coordinators' process is alive.
    pub(crate) coord_alive: bool,
    /// Notices a node's driver has yet to deliver to its machine (canonically ordered):
    /// the coordinator of a request is gone, or (decode) the writer of a request is.
    pub(crate) notices: Vec<(Notice, ReqId)>,
    pub(crate) ghost: Vec<Ghost>,
}

/// What a node's driver learns from its links.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Notice {
    /// `role`'s link to the request's coordinator closed.
    CoordinatorLost(Role),
    /// The decode node's link to the prefill node (the writer) closed.
    WriterLost,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Action {
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
    pub(crate) fn is_fault(&self) -> bool {
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
pub(crate) struct ReqSpec {
    pub(crate) tenant: u64,
    pub(crate) prompt: u32,
    pub(crate) max: u32,
    pub(crate) abortable: bool,
}

/// One model configuration.
#[derive(Clone, Debug)]
pub(crate) struct Cfg {
    pub(crate) page_size: u32,
    pub(crate) decode_pages: usize,
    pub(crate) prefill_pages: usize,
    pub(crate) reqs: Vec<ReqSpec>,
    pub(crate) budget: Budget,
    pub(crate) crash_roles: Vec<Role>,
    /// Coordinators learn of a crash together (one failure detector per gateway)
    /// instead of each on its own schedule.
    pub(crate) joint_detection: bool,
    /// The decode node queues a request that does not fit now ([`DPool::queue_when_busy`]).
    pub(crate) queue_when_busy: bool,
    /// The decode node's driver reports a dead prefill node as the writer being gone
    /// (what frees pages quarantined for its requests).
    pub(crate) writer_lost_notices: bool,
    pub(crate) flaws: Flaws,
    /// Outcomes and events the configuration must be able to reach.
    pub(crate) expect_all_succeed: bool,
    pub(crate) expect_rejection: bool,
    pub(crate) expect_commit_failure: bool,
}

pub(crate) struct PdModel {
    pub(crate) cfg: Cfg,
}

/// Orders a multiset canonically so equal multisets are equal states.
pub(crate) fn canon<T: Hash>(v: &mut [T]) {
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
pub(crate) fn nothing_held(st: &PdState) -> bool {
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
                        node.on_msg(msg, None, pool, &mut out);
                    }
                    Role::Decode => {
                        let (node, pool) = st.decode.as_mut()?;
                        node.on_msg(msg, None, pool, &mut out);
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
        crate::properties::of(&self.cfg)
    }
}
