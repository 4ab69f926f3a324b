//! A node's per-request records: each request's live state machine and what the
//! node's driver keeps beside it, then its tombstone, and when it may be forgotten.

use super::messages::ReqId;
use std::collections::BTreeMap;

/// A node's per-request records, one per request: the protocol state of each request
/// (its lifecycle), with what the node's driver attached to it (I/O handles, the
/// request body, trace spans), then its tombstone once terminal (what stops a late
/// `Prealloc`, `Prefill` or `Commit` from acting again).
///
/// The state changes only through the protocol's transition function (each node's
/// `set`); the attachment is handed in with the request's first message, told once
/// when the request ends ([`RequestIo::on_end`]: it drops what only a live request
/// needs) and dropped with the record when it is forgotten. So no driver keeps a
/// second map of its own in step with this one.
///
/// Each terminal record remembers when (on the driver's clock, [`Records::expire`])
/// it became terminal, so the node can forget it once no copy of a message for it can
/// still arrive. Under the model checker the clock never moves and nothing is
/// attached (`A = ()`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Records<S, A = ()> {
    reqs: BTreeMap<ReqId, Record<S, A>>,
    /// Terminal records and the clock reading when each became terminal.
    ended: BTreeMap<ReqId, u64>,
    /// The driver's clock as of the last [`Records::expire`] (milliseconds).
    now: u64,
}

/// One request's record: its protocol state and the driver's attachment (none for a
/// request whose first message came without one, and always none under the model
/// checker).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
struct Record<S, A> {
    state: S,
    attached: Option<A>,
}

impl<S, A> Default for Records<S, A> {
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

/// What a node's driver keeps with a request's record (its reply link, the request
/// body until the engine takes it, trace spans, transfer buffers).
pub trait RequestIo {
    /// The request's state just became terminal: drop what only a live request needs
    /// (the body, buffers, spans), keep what answering its late messages needs, until
    /// the record is forgotten. Called once per record.
    fn on_end(&mut self);
}

impl RequestIo for () {
    fn on_end(&mut self) {}
}

impl<S: RequestState, A: RequestIo> Records<S, A> {
    /// The state of `req`, if the node has a record of it.
    pub fn state(&self, req: ReqId) -> Option<&S> {
        self.reqs.get(&req).map(|r| &r.state)
    }

    /// Every request with a record, and its state.
    pub fn states(&self) -> impl Iterator<Item = (ReqId, &S)> {
        self.reqs.iter().map(|(r, rec)| (*r, &rec.state))
    }

    /// What the driver attached to `req`'s record, if it has one.
    pub fn attached(&self, req: ReqId) -> Option<&A> {
        self.reqs.get(&req).and_then(|r| r.attached.as_ref())
    }

    /// What the driver attached to `req`'s record, mutably.
    pub fn attached_mut(&mut self, req: ReqId) -> Option<&mut A> {
        self.reqs.get_mut(&req).and_then(|r| r.attached.as_mut())
    }

    /// Every live (non-terminal) request with an attachment, and its state and
    /// attachment.
    pub fn live(&self) -> impl Iterator<Item = (ReqId, &S, &A)> {
        self.reqs.iter().filter_map(|(req, r)| {
            let a = r.attached.as_ref()?;
            (!r.state.is_terminal()).then_some((*req, &r.state, a))
        })
    }

    /// Number of live (non-terminal) records. Costs nothing: every terminal record is
    /// also in the clock's list.
    pub fn live_len(&self) -> usize {
        self.reqs.len() - self.ended.len()
    }

    /// Drops the record of a terminal request. Call only once no copy of a message for
    /// it can still arrive: the record is what stops a late `Prealloc` or `Commit`.
    /// Returns false (and keeps it) if the request is not terminal.
    pub fn forget(&mut self, req: ReqId) -> bool {
        match self.reqs.get(&req) {
            Some(r) if r.state.is_terminal() => {
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
        self.state(*req)
    }

    /// The one transition of a request's record: `req` is now in `state`. A first
    /// state takes `attached` (ignored for a request that has a record); on the
    /// change to a terminal state the attachment hears [`RequestIo::on_end`].
    pub(super) fn insert(&mut self, req: ReqId, state: S, attached: Option<A>) {
        let terminal = state.is_terminal();
        match self.reqs.get_mut(&req) {
            Some(r) => {
                let ends = terminal && !r.state.is_terminal();
                r.state = state;
                if ends {
                    if let Some(a) = r.attached.as_mut() {
                        a.on_end();
                    }
                }
            }
            None => {
                let mut attached = attached;
                if terminal {
                    if let Some(a) = attached.as_mut() {
                        a.on_end();
                    }
                }
                self.reqs.insert(req, Record { state, attached });
            }
        }
        if terminal {
            self.ended.entry(req).or_insert(self.now);
        } else {
            self.ended.remove(&req);
        }
    }

    pub(super) fn remove(&mut self, req: &ReqId) {
        self.reqs.remove(req);
        self.ended.remove(req);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    enum Phase {
        Live,
        Done,
    }

    impl RequestState for Phase {
        fn is_terminal(&self) -> bool {
            *self == Phase::Done
        }
    }

    /// Counts its own `on_end` calls; `body` stands for what only a live request needs.
    #[derive(Debug, Default)]
    struct Io {
        ends: u32,
        body: Option<Vec<u32>>,
    }

    impl RequestIo for Io {
        fn on_end(&mut self) {
            self.ends += 1;
            self.body = None;
        }
    }

    #[test]
    fn an_attachment_lives_in_the_record_hears_its_end_once_and_goes_with_it() {
        let mut records: Records<Phase, Io> = Records::default();
        let io = Io {
            ends: 0,
            body: Some(vec![1, 2, 3]),
        };
        records.insert(ReqId(1), Phase::Live, Some(io));
        assert_eq!(records.live_len(), 1);
        assert_eq!(records.live().count(), 1);
        // A later transition keeps the attachment (a second one is ignored).
        records.insert(ReqId(1), Phase::Live, Some(Io::default()));
        assert_eq!(
            records.attached(ReqId(1)).unwrap().body,
            Some(vec![1, 2, 3])
        );
        records.insert(ReqId(1), Phase::Done, None);
        records.insert(ReqId(1), Phase::Done, None);
        let io = records.attached(ReqId(1)).unwrap();
        assert_eq!((io.ends, io.body.is_none()), (1, true));
        assert_eq!((records.live_len(), records.live().count()), (0, 0));
        // Forgotten with its tombstone, attachment included.
        assert_eq!(records.expire(10, 10), 1);
        assert!(records.attached(ReqId(1)).is_none() && records.is_empty());

        // A request whose first state is terminal ends its attachment at once.
        records.insert(ReqId(2), Phase::Done, Some(Io::default()));
        assert_eq!(records.attached(ReqId(2)).unwrap().ends, 1);
    }
}
