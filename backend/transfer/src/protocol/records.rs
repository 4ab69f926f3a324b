//! A node's per-request records: each request's live state machine, then its
//! tombstone, and when it may be forgotten.

use super::messages::ReqId;
use std::collections::BTreeMap;

/// A node's per-request records: the live state machine of each request, then its
/// tombstone once terminal (what stops a late `Prealloc`, `Prefill` or `Commit` from
/// acting again).
///
/// Each terminal record remembers when (on the driver's clock, [`Records::expire`])
/// it became terminal, so the node can forget it once no copy of a message for it can
/// still arrive. Under the model checker the clock never moves.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Records<S> {
    reqs: BTreeMap<ReqId, S>,
    /// Terminal records and the clock reading when each became terminal.
    ended: BTreeMap<ReqId, u64>,
    /// The driver's clock as of the last [`Records::expire`] (milliseconds).
    now: u64,
}

impl<S> Default for Records<S> {
    fn default() -> Self {
        Self {
            reqs: BTreeMap::new(),
            ended: BTreeMap::new(),
            now: 0,
        }
    }
}

/// A per-request state that can end.
pub trait RequestState {
    /// Whether the request is over on this node (nothing held, nothing to do).
    fn is_terminal(&self) -> bool;
}

impl<S: RequestState> Records<S> {
    /// The state of `req`, if the node has a record of it.
    pub fn state(&self, req: ReqId) -> Option<&S> {
        self.reqs.get(&req)
    }

    /// Every request with a record, and its state.
    pub fn states(&self) -> impl Iterator<Item = (ReqId, &S)> {
        self.reqs.iter().map(|(r, s)| (*r, s))
    }

    /// Drops the record of a terminal request. Call only once no copy of a message for
    /// it can still arrive: the record is what stops a late `Prealloc` or `Commit`.
    /// Returns false (and keeps it) if the request is not terminal.
    pub fn forget(&mut self, req: ReqId) -> bool {
        match self.reqs.get(&req) {
            Some(s) if s.is_terminal() => {
                self.reqs.remove(&req);
                self.ended.remove(&req);
                true
            }
            _ => false,
        }
    }

    /// Advances the clock to `now` (milliseconds, monotonic, the driver's) and forgets
    /// every record that has been terminal for at least `ttl` milliseconds: the
    /// longest a copy of a message for a request can still be on its way (a lost
    /// reply's retransmission included). Returns how many were forgotten. Costs one
    /// pass over the terminal records.
    pub fn expire(&mut self, now: u64, ttl: u64) -> usize {
        self.now = self.now.max(now);
        let old: Vec<ReqId> = self
            .ended
            .iter()
            .filter(|(_, &t)| t.saturating_add(ttl) <= self.now)
            .map(|(r, _)| *r)
            .collect();
        old.into_iter().filter(|r| self.forget(*r)).count()
    }

    /// Number of records (live and terminal).
    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    /// Whether there is no record.
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    /// The driver's clock as of the last [`Records::expire`] (milliseconds).
    pub(super) fn now(&self) -> u64 {
        self.now
    }

    pub(super) fn get(&self, req: &ReqId) -> Option<&S> {
        self.reqs.get(req)
    }

    pub(super) fn insert(&mut self, req: ReqId, state: S) {
        if state.is_terminal() {
            self.ended.entry(req).or_insert(self.now);
        } else {
            self.ended.remove(&req);
        }
        self.reqs.insert(req, state);
    }

    pub(super) fn remove(&mut self, req: &ReqId) {
        self.reqs.remove(req);
        self.ended.remove(req);
    }
}
