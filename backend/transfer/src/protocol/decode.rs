//! The decode node's state machine, for every request on one decode node: admission
//! and reservation (waiting for pages in FIFO order), the commit check (I4), the
//! decode, aborts, and quarantined reservations.

use super::flaws::flaw;
#[cfg(any(test, feature = "test-util"))]
use super::flaws::Flaws;
use super::messages::{
    send, CommitError, DecodeOutcome, FailReason, Msg, Output, PageCommit, Refusal, ReqId, Role,
};
use super::records::{Records, RequestIo, RequestState};
use crate::transport::DestPage;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// Why the decode node could not reserve pages for a request now.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DecodeReserveError {
    /// Refused for good (terminal, S3).
    Refused(Refusal),
    /// The request fits the pool but not right now: it waits (FIFO) until pages are
    /// freed ([`DecodeNode::on_capacity`]).
    NoRoomYet,
}

impl From<Refusal> for DecodeReserveError {
    fn from(r: Refusal) -> Self {
        Self::Refused(r)
    }
}

/// The decode node's pool and engine as the protocol sees them.
pub trait DecodeEnv {
    /// What the node's driver keeps with each request's record ([`Records`]): `()`
    /// under the model checker.
    type Attached: RequestIo;

    /// Admission (I1) of a new request, before any page is touched: whether it can
    /// ever be served by this node. `attached` is what came with its `Prealloc`. The
    /// default admits everything (then [`reserve`](Self::reserve) refuses).
    fn admit(
        &mut self,
        _req: ReqId,
        _attached: Option<&mut Self::Attached>,
        _tenant: u64,
        _prompt_tokens: u32,
        _max_tokens: u32,
    ) -> Result<(), Refusal> {
        Ok(())
    }

    /// Reservation, all or nothing: pages for `prompt_tokens + max_tokens`. Returns the
    /// transfer pages (those the prompt's KV fills, in logical block order, with the
    /// tags written at reservation).
    fn reserve(
        &mut self,
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
    ) -> Result<Vec<DestPage>, DecodeReserveError>;

    /// Checksum of the bytes now in `dest.page`, or `None` unless the page is held by
    /// `req` and carries exactly `dest.tag` (I3).
    fn landed_checksum(&self, req: ReqId, dest: DestPage) -> Option<u32>;

    /// Adds the verified sequence to the running batch: `tokens` prompt tokens of KV in
    /// `pages` (the reservation's transfer pages, exactly as the descriptor named
    /// them), next input `first_token`. Report its end with
    /// [`DecodeNode::on_decode_finished`]. `attached` is the request's attachment. An
    /// error fails the request (its pages are then released).
    fn start_decode(
        &mut self,
        req: ReqId,
        attached: Option<&mut Self::Attached>,
        tokens: u32,
        first_token: u32,
        pages: &[DestPage],
    ) -> Result<(), FailReason>;

    /// Stops the sequence if it runs and frees every page of `req` (bumping epochs, I5).
    fn release(&mut self, req: ReqId);

    /// Whether the node that writes `req`'s pages is known gone (its link closed): then
    /// nothing it issued can still land. `attached` is the request's attachment. The
    /// default knows nothing.
    fn writer_gone(&self, _req: ReqId, _attached: Option<&Self::Attached>) -> bool {
        false
    }
}

/// What a `Prealloc` asks the decode node to hold for a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ReservationAsk {
    /// Owning tenant.
    pub tenant: u64,
    /// Prompt tokens the prefill will transfer.
    pub prompt_tokens: u32,
    /// Tokens the decode may generate.
    pub max_tokens: u32,
}

/// A request's state on the decode node.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DecodeState {
    /// Admission refused; nothing held (terminal).
    Refused(Refusal),
    /// Admitted, waiting (FIFO) for pages; nothing held.
    Waiting {
        /// Owning tenant.
        tenant: u64,
        /// Prompt tokens the prefill will transfer.
        prompt_tokens: u32,
        /// Tokens the decode may generate.
        max_tokens: u32,
    },
    /// Pages reserved; waiting for the commit.
    Reserved {
        /// Reserved prompt tokens.
        tokens: u32,
        /// Reserved transfer pages.
        dest: Vec<DestPage>,
    },
    /// Commit verified; decoding.
    Running,
    /// Pages still held but never to be read: a write into them may still be on its
    /// way (the coordinator was lost or the lease ran out before a commit). Freed once
    /// the prefill side is known quiet: an `Abort` from the coordinator (sent only
    /// after the prefill acknowledged), `WriterQuiet` from the prefill node (on its
    /// own when its coordinator is gone, or answering the `QuietQuery` this node
    /// sends its writer while the coordinator is gone), a commit (sent only after its
    /// writes drained), or the writer's last link closed. Never freed on a timer.
    Quarantined(Quarantine),
    /// Decode ended; pages freed (terminal).
    Finished(DecodeOutcome),
    /// Commit refused; pages freed (terminal).
    CommitFailed(CommitError),
    /// Aborted; pages freed (terminal tombstone).
    Aborted,
}

/// Why a reservation is quarantined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Quarantine {
    /// Its coordinator's link closed.
    CoordinatorLost,
    /// Its lease ran out before a commit.
    LeaseExpired,
}

impl RequestState for DecodeState {
    fn is_terminal(&self) -> bool {
        !matches!(
            self,
            DecodeState::Waiting { .. }
                | DecodeState::Reserved { .. }
                | DecodeState::Running
                | DecodeState::Quarantined(_)
        )
    }
}

/// What a decode node does with one page write that arrived for a request (the
/// writer's identity is checked by the driver before this is asked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageWrite {
    /// Apply it: the request is reserved and `dest` is one of its transfer pages.
    Apply,
    /// Drop it without applying: a late write into a reservation that ended or is
    /// quarantined (S2: its pages are never read again before they are freed).
    DropLate,
    /// A protocol violation: the request is not awaiting writes (unknown, committed
    /// or running), or `dest` is not one of the pages reserved for it (a write aimed
    /// at another request's pages, I3/I4).
    Refuse(&'static str),
}

/// The decode side of the protocol for every request on one decode node; `A` is what
/// the node's driver keeps with each request's record (`()` under the model checker).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct DecodeNode<A = ()> {
    reqs: Records<DecodeState, A>,
    /// Admitted requests waiting for pages, oldest first (FIFO: none overtakes).
    waiting: VecDeque<ReqId>,
    /// Requests whose prefill side already said it is quiet (before they were
    /// quarantined, or even before their `Prealloc` arrived: the two come on different
    /// links), and the driver's clock when it said so.
    quiet: BTreeMap<ReqId, u64>,
    /// Reserved requests whose writer aimed a page write outside the reservation,
    /// and the page it aimed at: their commit fails.
    foreign_writes: BTreeMap<ReqId, u32>,
    /// The node drains ([`DecodeNode::begin_drain`]): new requests are refused.
    draining: bool,
    #[cfg(any(test, feature = "test-util"))]
    flaws: Flaws,
}

impl<A> Default for DecodeNode<A> {
    fn default() -> Self {
        Self {
            reqs: Records::default(),
            waiting: VecDeque::new(),
            quiet: BTreeMap::new(),
            foreign_writes: BTreeMap::new(),
            draining: false,
            #[cfg(any(test, feature = "test-util"))]
            flaws: Flaws::default(),
        }
    }
}

impl DecodeNode {
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

impl<A: RequestIo> DecodeNode<A> {
    /// An empty node whose requests carry an attachment of type `A`.
    pub fn with_attachments() -> Self {
        Self::default()
    }

    /// Requests admitted and waiting for pages, oldest first.
    pub fn waiting(&self) -> impl Iterator<Item = ReqId> + '_ {
        self.waiting.iter().copied()
    }

    /// Every request's record (state machine, then tombstone).
    pub fn records(&self) -> &Records<DecodeState, A> {
        &self.reqs
    }

    /// Mutable records, to [`Records::forget`] tombstones and reach attachments.
    pub fn records_mut(&mut self) -> &mut Records<DecodeState, A> {
        &mut self.reqs
    }

    /// Dispatches a message addressed to the decode node; `attached` is what the
    /// driver attaches to the request's record if this message creates it (a
    /// `Prealloc` for a request the node has no record of; dropped otherwise; `None`
    /// under the model checker).
    pub fn on_msg(
        &mut self,
        msg: Msg,
        attached: Option<A>,
        env: &mut impl DecodeEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) {
        match msg {
            Msg::Prealloc {
                req,
                tenant,
                prompt_tokens,
                max_tokens,
            } => self.on_prealloc(
                req,
                ReservationAsk {
                    tenant,
                    prompt_tokens,
                    max_tokens,
                },
                attached,
                env,
                out,
            ),
            Msg::Commit {
                req,
                tokens,
                pages,
                first_token,
            } => {
                let _ = self.on_commit(req, tokens, &pages, first_token, env, out);
            }
            Msg::Abort { req } => self.on_abort(req, env, out),
            Msg::Poll { req } => self.resend(req, out),
            Msg::WriterQuiet { req } => self.on_writer_quiet(req, env, out),
            _ => {}
        }
    }

    /// The node starts draining: from now on every new request is refused with
    /// [`Refusal::draining`] (a duplicate `Prealloc` of a request it already has is
    /// answered from its record, as always). Requests waiting for pages hold nothing
    /// and have not started: they are refused now, so their coordinators start them
    /// elsewhere instead of waiting for pages here. Reserved and running requests are
    /// untouched (the driver ends what is left at its drain deadline).
    pub fn begin_drain(&mut self, out: &mut Vec<Output>) {
        self.draining = true;
        for req in std::mem::take(&mut self.waiting) {
            if matches!(self.reqs.get(&req), Some(DecodeState::Waiting { .. })) {
                self.set(req, DecodeState::Refused(Refusal::draining(Role::Decode)));
                self.resend(req, out);
            }
        }
    }

    /// Whether the node drains ([`DecodeNode::begin_drain`]).
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Whether page writes for `req` may be applied now: only while its pages are
    /// reserved and waiting for the commit (never into a running sequence's pages,
    /// never after the reservation ended or was quarantined).
    pub fn accepts_writes(&self, req: ReqId) -> bool {
        matches!(self.reqs.get(&req), Some(DecodeState::Reserved { .. }))
    }

    /// Records `state` for `req` (and forgets a quiet note once it left `Reserved`).
    fn set(&mut self, req: ReqId, state: DecodeState) {
        self.set_first(req, state, None);
    }

    /// The transition function: `req` is now in `state` (a request's first state takes
    /// the driver's attachment).
    fn set_first(&mut self, req: ReqId, state: DecodeState, attached: Option<A>) {
        if state.is_terminal() {
            self.quiet.remove(&req);
            self.foreign_writes.remove(&req);
        }
        self.reqs.insert(req, state, attached);
    }

    /// Advances the driver's clock to `now` (milliseconds) and forgets what is older
    /// than `ttl`: terminal records ([`Records::expire`]) and quiet notes of requests
    /// that never arrived. Returns how many records were forgotten.
    pub fn expire(&mut self, now: u64, ttl: u64) -> usize {
        let forgotten = self.reqs.expire(now, ttl);
        let reqs = &self.reqs;
        self.quiet
            .retain(|r, t| reqs.state(*r).is_some() || t.saturating_add(ttl) > now);
        forgotten
    }

    /// The reply the coordinator last got for `req`, re-sent for a duplicate or a poll.
    fn resend(&self, req: ReqId, out: &mut Vec<Output>) {
        let Some(state) = self.reqs.get(&req) else {
            return;
        };
        let msg = match state {
            DecodeState::Refused(reason) => Msg::Rejected {
                req,
                by: Role::Decode,
                reason: reason.clone(),
            },
            // Nothing decided yet; the coordinator's retransmissions find it here.
            DecodeState::Waiting { .. } => return,
            DecodeState::Reserved { dest, .. } => Msg::Descriptor {
                req,
                pages: dest.clone(),
            },
            DecodeState::Running => Msg::Committed { req },
            DecodeState::Quarantined(Quarantine::LeaseExpired) => Msg::LeaseExpired { req },
            DecodeState::Quarantined(Quarantine::CoordinatorLost) => return,
            DecodeState::Finished(outcome) => Msg::Finished {
                req,
                outcome: outcome.clone(),
            },
            DecodeState::CommitFailed(reason) => Msg::CommitFailed {
                req,
                reason: reason.clone(),
            },
            DecodeState::Aborted => Msg::AbortAck {
                req,
                from: Role::Decode,
            },
        };
        send(out, Role::Coordinator, msg);
    }

    /// `Prealloc`: admission (I1) and reservation for a new request, or a place in
    /// the FIFO of requests waiting for pages; a duplicate re-sends the latest reply; a
    /// tombstone ignores it. A draining node refuses every new request
    /// ([`Refusal::draining`]). `attached` goes into the request's new record.
    pub fn on_prealloc(
        &mut self,
        req: ReqId,
        asked: ReservationAsk,
        attached: Option<A>,
        env: &mut impl DecodeEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) {
        match self.reqs.get(&req) {
            None => {}
            Some(DecodeState::Aborted) => return,
            Some(_) => return self.resend(req, out),
        }
        let mut attached = attached;
        if self.draining {
            // Before admission: nothing is looked at or held for it here.
            let refused = DecodeState::Refused(Refusal::draining(Role::Decode));
            self.set_first(req, refused, attached);
            return self.resend(req, out);
        }
        let ReservationAsk {
            tenant,
            prompt_tokens,
            max_tokens,
        } = asked;
        if let Err(refusal) = env.admit(req, attached.as_mut(), tenant, prompt_tokens, max_tokens) {
            self.set_first(req, DecodeState::Refused(refusal), attached);
            return self.resend(req, out);
        }
        let waiting = DecodeState::Waiting {
            tenant,
            prompt_tokens,
            max_tokens,
        };
        // Behind older requests: no overtaking.
        if self.waiting.is_empty() {
            match env.reserve(req, tenant, prompt_tokens, max_tokens) {
                Err(DecodeReserveError::NoRoomYet) => {}
                reserved => {
                    self.set_first(req, Self::reserved(prompt_tokens, reserved), attached);
                    return self.resend(req, out);
                }
            }
        }
        self.set_first(req, waiting, attached);
        self.waiting.push_back(req);
    }

    /// The state a reservation attempt that did not say "no room yet" leads to.
    fn reserved(
        prompt_tokens: u32,
        reserved: Result<Vec<DestPage>, DecodeReserveError>,
    ) -> DecodeState {
        match reserved {
            Ok(dest) => DecodeState::Reserved {
                tokens: prompt_tokens,
                dest,
            },
            Err(DecodeReserveError::Refused(refusal)) => DecodeState::Refused(refusal),
            Err(DecodeReserveError::NoRoomYet) => unreachable!("waits instead"),
        }
    }

    /// Reserves for `req` and answers, or returns false (nothing changed) when the pool
    /// has no room yet.
    fn try_reserve(
        &mut self,
        req: ReqId,
        asked: ReservationAsk,
        env: &mut impl DecodeEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) -> bool {
        let reserved = env.reserve(req, asked.tenant, asked.prompt_tokens, asked.max_tokens);
        if reserved == Err(DecodeReserveError::NoRoomYet) {
            return false;
        }
        self.set(req, Self::reserved(asked.prompt_tokens, reserved));
        self.resend(req, out);
        true
    }

    /// Pages were freed: reserves for waiting requests in arrival order until one does
    /// not fit (it stays first in line).
    pub fn on_capacity(&mut self, env: &mut impl DecodeEnv<Attached = A>, out: &mut Vec<Output>) {
        while let Some(&req) = self.waiting.front() {
            let Some(&DecodeState::Waiting {
                tenant,
                prompt_tokens,
                max_tokens,
            }) = self.reqs.get(&req)
            else {
                self.waiting.pop_front(); // aborted meanwhile
                continue;
            };
            let asked = ReservationAsk {
                tenant,
                prompt_tokens,
                max_tokens,
            };
            if !self.try_reserve(req, asked, env, out) {
                return;
            }
            self.waiting.pop_front();
        }
    }

    /// A page write into `dest` arrived for `req` from its writer (the driver checked
    /// the writer's identity). Only a reserved request's own transfer pages, with the
    /// tags its descriptor named, may be written. A write aimed anywhere else is
    /// refused and the request's commit will fail ([`CommitError::ForeignWrite`]):
    /// its writer is not trusted with it. Late writes into a reservation that ended
    /// or is quarantined are dropped (S2: those pages are never read before they are
    /// freed).
    pub fn on_page_write(&mut self, req: ReqId, dest: &DestPage) -> PageWrite {
        match self.reqs.get(&req) {
            Some(DecodeState::Reserved { dest: pages, .. }) => {
                if pages.iter().any(|p| p == dest) {
                    PageWrite::Apply
                } else {
                    self.foreign_writes.entry(req).or_insert(dest.page);
                    PageWrite::Refuse("a page write outside the request's reservation")
                }
            }
            Some(
                DecodeState::Quarantined(_) | DecodeState::Aborted | DecodeState::CommitFailed(_),
            ) => PageWrite::DropLate,
            _ => PageWrite::Refuse(
                "a page write for pages not awaiting one (unknown, committed or finished)",
            ),
        }
    }

    /// `Commit`: verifies it (I4) and admits the sequence, or fails the request and
    /// frees its pages. Anything but a first commit for a reserved request changes
    /// nothing: the latest reply is re-sent (an unknown request gets `CommitFailed`).
    /// Returns the verdict, for logs and metrics.
    pub fn on_commit(
        &mut self,
        req: ReqId,
        tokens: u32,
        pages: &[PageCommit],
        first_token: u32,
        env: &mut impl DecodeEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) -> Result<(), CommitError> {
        let Some(state) = self.reqs.get(&req) else {
            send(
                out,
                Role::Coordinator,
                Msg::CommitFailed {
                    req,
                    reason: CommitError::UnknownRequest,
                },
            );
            return Err(CommitError::UnknownRequest);
        };
        // The block table decode will read: its own reservation, never the commit's list.
        let (verdict, table, table_tokens) = match state {
            DecodeState::Reserved {
                tokens: reserved,
                dest,
            } => {
                let verdict = if flaw!(self, decode_skips_commit_checks) {
                    Ok(())
                } else if let Some(&page) = self.foreign_writes.get(&req) {
                    Err(CommitError::ForeignWrite { page })
                } else {
                    verify_commit(req, *reserved, dest, tokens, pages, env)
                };
                (verdict, dest.clone(), *reserved)
            }
            DecodeState::Running | DecodeState::Finished(_)
                if flaw!(self, decode_accepts_duplicate_commit) =>
            {
                (Ok(()), pages.iter().map(|p| p.dest).collect(), tokens)
            }
            DecodeState::Quarantined(_) => {
                // A commit is sent only after its writes drained: nothing can land now.
                env.release(req);
                self.set(req, DecodeState::Aborted);
                send(
                    out,
                    Role::Coordinator,
                    Msg::CommitFailed {
                        req,
                        reason: CommitError::NotAwaitingCommit,
                    },
                );
                return Err(CommitError::NotAwaitingCommit);
            }
            _ => {
                self.resend(req, out);
                return Err(CommitError::NotAwaitingCommit);
            }
        };
        match &verdict {
            Ok(()) => match env.start_decode(
                req,
                self.reqs.attached_mut(req),
                table_tokens,
                first_token,
                &table,
            ) {
                Ok(()) => self.set(req, DecodeState::Running),
                Err(reason) => {
                    // Verified, but the engine would not run it: fail it, free its pages.
                    env.release(req);
                    let outcome = DecodeOutcome::Failed { reason };
                    self.set(req, DecodeState::Finished(outcome));
                }
            },
            Err(e) => {
                // The prefill drained before committing: nothing can still land (S2).
                if !flaw!(self, decode_leaks_on_commit_failed) {
                    env.release(req);
                }
                self.set(req, DecodeState::CommitFailed(e.clone()));
            }
        }
        self.resend(req, out);
        verdict
    }

    /// `Abort`: frees whatever the request holds, leaves a tombstone, acknowledges.
    /// The coordinator sends it only once the prefill side is quiet (S2).
    pub fn on_abort(
        &mut self,
        req: ReqId,
        env: &mut impl DecodeEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) {
        match self.reqs.get(&req) {
            // A quarantined reservation too: the coordinator aborts the decode side only
            // once the prefill side acknowledged (or is dead), so nothing can land.
            Some(
                DecodeState::Reserved { .. } | DecodeState::Running | DecodeState::Quarantined(_),
            ) => {
                env.release(req);
                self.set(req, DecodeState::Aborted);
            }
            Some(DecodeState::Waiting { .. }) => {
                self.waiting.retain(|r| *r != req);
                self.set(req, DecodeState::Aborted);
            }
            None => {
                self.set(req, DecodeState::Aborted);
            }
            Some(_) => {} // terminal: nothing held
        }
        send(
            out,
            Role::Coordinator,
            Msg::AbortAck {
                req,
                from: Role::Decode,
            },
        );
    }

    /// The coordinator of `req` is gone (its link closed): nobody will finish or abort
    /// the request, so the node ends it itself, without an acknowledgement. A running
    /// sequence's pages are freed at once (its commit proved the prefill drained); a
    /// reservation still waiting for its commit is quarantined (S2: the prefill may
    /// still be writing into it) until the prefill side is quiet, unless it already
    /// said so. Nobody else will quiet the prefill side now (the prefill node may
    /// never have heard of the request: its `Prefill` may have died with the
    /// coordinator), so the node asks the writer itself (`QuietQuery`), and again on
    /// every [`ask_writers`](Self::ask_writers) until it answers. A reservation whose
    /// lease ran out is asked about too: its coordinator would have quieted the
    /// prefill side.
    pub fn on_coordinator_lost(
        &mut self,
        req: ReqId,
        env: &mut impl DecodeEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) {
        match self.reqs.get(&req) {
            Some(DecodeState::Reserved { .. })
                if !self.quiet.contains_key(&req)
                    && !env.writer_gone(req, self.reqs.attached(req))
                    && !flaw!(self, decode_frees_on_coordinator_lost) =>
            {
                self.set(req, DecodeState::Quarantined(Quarantine::CoordinatorLost));
                send(out, Role::Prefill, Msg::QuietQuery { req });
            }
            Some(DecodeState::Quarantined(Quarantine::LeaseExpired)) => {
                self.set(req, DecodeState::Quarantined(Quarantine::CoordinatorLost));
                send(out, Role::Prefill, Msg::QuietQuery { req });
            }
            Some(DecodeState::Reserved { .. } | DecodeState::Running) => {
                env.release(req);
                self.set(req, DecodeState::Aborted);
            }
            Some(DecodeState::Waiting { .. }) => {
                self.waiting.retain(|r| *r != req);
                self.set(req, DecodeState::Aborted);
            }
            None => self.set(req, DecodeState::Aborted),
            Some(_) => {} // quarantined already, or terminal
        }
    }

    /// The retry timer of the quarantine of `req` fired: if its pages are quarantined
    /// because its coordinator is gone, asks its writer again whether it is quiet
    /// (`QuietQuery`; the first one went out with the quarantine, and any may be
    /// lost). The pages stay quarantined until the answer: a timer alone never frees
    /// them (S2). Ignored otherwise.
    pub fn ask_writer(
        &mut self,
        req: ReqId,
        env: &mut impl DecodeEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) {
        if self.reqs.get(&req) != Some(&DecodeState::Quarantined(Quarantine::CoordinatorLost)) {
            return;
        }
        if flaw!(self, decode_frees_quarantine_unasked) {
            env.release(req);
            self.set(req, DecodeState::Aborted);
            return;
        }
        send(out, Role::Prefill, Msg::QuietQuery { req });
    }

    /// [`ask_writer`](Self::ask_writer) for every reservation quarantined because its
    /// coordinator is gone (the driver's retry timer). Each `Send` goes to the writer
    /// of its `msg.req()`.
    pub fn ask_writers(&mut self, env: &mut impl DecodeEnv<Attached = A>, out: &mut Vec<Output>) {
        let asked: Vec<ReqId> = self
            .reqs
            .states()
            .filter(|(_, s)| **s == DecodeState::Quarantined(Quarantine::CoordinatorLost))
            .map(|(r, _)| r)
            .collect();
        for req in asked {
            self.ask_writer(req, env, out);
        }
    }

    /// The reservation's lease ran out (the prefill neither committed nor renewed):
    /// the pages are quarantined, never read, and the coordinator hears
    /// `LeaseExpired`; it quiets the prefill side and then aborts this side, which
    /// frees them. Ignored unless `req` is reserved.
    pub fn on_lease_expired(
        &mut self,
        req: ReqId,
        env: &mut impl DecodeEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) {
        if !matches!(self.reqs.get(&req), Some(DecodeState::Reserved { .. })) {
            return;
        }
        if flaw!(self, decode_frees_on_lease_expiry) {
            env.release(req);
            self.set(req, DecodeState::Aborted);
        } else {
            self.set(req, DecodeState::Quarantined(Quarantine::LeaseExpired));
        }
        send(out, Role::Coordinator, Msg::LeaseExpired { req });
    }

    /// `WriterQuiet` (or the driver saw the writer's link close): the prefill side
    /// will write nothing more for `req`. Frees a quarantined reservation; remembered
    /// for one that is not quarantined (yet) or not even reserved yet.
    pub fn on_writer_quiet(
        &mut self,
        req: ReqId,
        env: &mut impl DecodeEnv<Attached = A>,
        _out: &mut Vec<Output>,
    ) {
        match self.reqs.get(&req) {
            Some(DecodeState::Quarantined(_)) => {
                env.release(req);
                self.set(req, DecodeState::Aborted);
            }
            Some(DecodeState::Reserved { .. } | DecodeState::Waiting { .. }) | None => {
                self.quiet.insert(req, self.reqs.now());
            }
            Some(_) => {}
        }
    }

    /// The engine reports that the sequence ended: frees its pages and tells the
    /// coordinator. Ignored unless the request is running.
    pub fn on_decode_finished(
        &mut self,
        req: ReqId,
        outcome: DecodeOutcome,
        env: &mut impl DecodeEnv<Attached = A>,
        out: &mut Vec<Output>,
    ) {
        if self.reqs.get(&req) != Some(&DecodeState::Running) {
            return;
        }
        env.release(req);
        self.set(req, DecodeState::Finished(outcome));
        self.resend(req, out);
    }
}

/// The I4 check of a commit against a reservation: tokens covered == reserved, the
/// committed pages are exactly the reserved pages (each once, each with its reserved
/// tag), and the bytes that landed in each page match the committed checksum.
pub fn verify_commit<A: RequestIo>(
    req: ReqId,
    reserved_tokens: u32,
    reserved: &[DestPage],
    tokens: u32,
    pages: &[PageCommit],
    env: &impl DecodeEnv<Attached = A>,
) -> Result<(), CommitError> {
    if tokens != reserved_tokens {
        return Err(CommitError::TokenCount {
            expected: reserved_tokens,
            got: tokens,
        });
    }
    if pages.len() != reserved.len() {
        return Err(CommitError::PageCount {
            expected: reserved.len() as u32,
            got: pages.len() as u32,
        });
    }
    let mut seen = BTreeSet::new();
    for pc in pages {
        let page = pc.dest.page;
        let Some(r) = reserved.iter().find(|r| r.page == page) else {
            return Err(CommitError::UnexpectedPage { page });
        };
        if !seen.insert(page) {
            return Err(CommitError::DuplicatePage { page });
        }
        if r.tag != pc.dest.tag {
            return Err(CommitError::TagMismatch { page });
        }
        match env.landed_checksum(req, *r) {
            None => return Err(CommitError::TagMismatch { page }),
            Some(got) if got != pc.checksum => {
                return Err(CommitError::ChecksumMismatch {
                    page,
                    expected: pc.checksum,
                    got,
                })
            }
            Some(_) => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
