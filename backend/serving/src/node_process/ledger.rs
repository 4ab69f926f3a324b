//! A node's bookkeeping of its links: which coordinator link carries each request,
//! which links are open, and the budget for messages about requests a link never carried.

use crate::links::Reply;
use crate::net::Conn;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::Instant;
use tessera_transfer::protocol::{Msg, ReqId};
/// Messages about requests a link never carried (`Abort`, `Poll`) that a link may
/// send at once: a coordinator aborts a request at a prefill node that never saw it
/// only when the client left before the prefill started; a flood of them would
/// otherwise leave a tombstone per message.
pub(super) const UNKNOWN_BURST: f64 = 1024.0;
/// ... and per second after the burst.
pub(super) const UNKNOWN_PER_SEC: f64 = 256.0;

/// Which coordinator link carries each request the node was handed: messages about
/// a request are taken only from the link that carried it, and when a link closes
/// its requests are aborted. An entry goes when the node sent the request's last
/// message (`Finished`, `Rejected`, `CommitFailed`, `PrefillFailed`, `AbortAck`, or a
/// prefill node's `Commit`).
#[derive(Default)]
pub(super) struct Carried(Mutex<HashMap<ReqId, u64>>);

impl Carried {
    /// Records that link `conn` carries `req`; false when another link does.
    pub(super) fn claim(&self, req: ReqId, conn: u64) -> bool {
        *self.0.lock().unwrap().entry(req).or_insert(conn) == conn
    }

    pub(super) fn carrier(&self, req: ReqId) -> Option<u64> {
        self.0.lock().unwrap().get(&req).copied()
    }

    pub(super) fn done(&self, req: ReqId) {
        self.0.lock().unwrap().remove(&req);
    }

    /// Forgets and returns the requests link `conn` carried.
    pub(super) fn take(&self, conn: u64) -> Vec<ReqId> {
        let mut m = self.0.lock().unwrap();
        let reqs: Vec<ReqId> = m
            .iter()
            .filter(|(_, c)| **c == conn)
            .map(|(r, _)| *r)
            .collect();
        for r in &reqs {
            m.remove(r);
        }
        reqs
    }

    pub(super) fn is_empty(&self) -> bool {
        self.0.lock().unwrap().is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
}

/// Whether a node's message to a coordinator is the last it sends for the request.
fn is_last(msg: &Msg) -> bool {
    matches!(
        msg,
        Msg::Finished { .. }
            | Msg::Rejected { .. }
            | Msg::CommitFailed { .. }
            | Msg::PrefillFailed { .. }
            | Msg::AbortAck { .. }
    )
}

/// A coordinator link as a request's reply target.
pub(super) struct CoordReply {
    pub(super) conn: Arc<Conn>,
    pub(super) carried: Arc<Carried>,
}

impl Reply for CoordReply {
    fn send(&self, msg: Msg) -> bool {
        if is_last(&msg) {
            self.carried.done(msg.req());
        }
        self.conn.control(msg)
    }
}

/// Every open link of the process (to let queued frames out before a drained node
/// exits).
#[derive(Default)]
pub(super) struct Registry(Mutex<Vec<Weak<Conn>>>);

impl Registry {
    pub(super) fn add(&self, c: &Arc<Conn>) {
        let mut v = self.0.lock().unwrap();
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(c));
    }

    pub(super) fn open(&self) -> Vec<Arc<Conn>> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|c| c.is_alive())
            .collect()
    }
}

/// A budget of messages for requests a link never carried: a burst, refilled at a
/// fixed rate.
pub(super) struct Budget {
    tokens: f64,
    at: Instant,
}

impl Budget {
    pub(super) fn new() -> Self {
        Self {
            tokens: UNKNOWN_BURST,
            at: Instant::now(),
        }
    }

    /// Spends one; false when none is left.
    pub(super) fn spend(&mut self) -> bool {
        self.spend_at(Instant::now())
    }

    /// [`Self::spend`] at time `now`.
    fn spend_at(&mut self, now: Instant) -> bool {
        let refill = now.duration_since(self.at).as_secs_f64() * UNKNOWN_PER_SEC;
        self.tokens = (self.tokens + refill).min(UNKNOWN_BURST);
        self.at = now;
        if self.tokens < 1.0 {
            return false;
        }
        self.tokens -= 1.0;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tessera_transfer::protocol::Role;

    #[test]
    fn carried_requests_belong_to_one_link_until_their_last_message() {
        let c = Carried::default();
        assert!(c.claim(ReqId(1), 7));
        assert!(c.claim(ReqId(1), 7), "a re-sent Prealloc on the same link");
        assert!(!c.claim(ReqId(1), 8), "another link may not take it over");
        assert!(c.claim(ReqId(2), 8));
        assert_eq!(c.carrier(ReqId(1)), Some(7));
        c.done(ReqId(1));
        assert_eq!(c.carrier(ReqId(1)), None);
        assert_eq!(c.take(8), vec![ReqId(2)]);
        assert!(c.is_empty());
        assert!(is_last(&Msg::AbortAck {
            req: ReqId(1),
            from: Role::Decode
        }));
        assert!(!is_last(&Msg::Committed { req: ReqId(1) }));
    }

    #[test]
    fn the_unknown_request_budget_is_a_burst_then_a_rate() {
        let mut b = Budget::new();
        let t0 = b.at;
        let spent = (0..5000).take_while(|_| b.spend_at(t0)).count();
        assert_eq!(spent, UNKNOWN_BURST as usize);
        // A second later, one second's worth more, and no more.
        let t1 = t0 + Duration::from_secs(1);
        let spent = (0..5000).take_while(|_| b.spend_at(t1)).count();
        assert_eq!(spent, UNKNOWN_PER_SEC as usize);
        // Idle for long, the budget refills to the burst only.
        let t2 = t1 + Duration::from_secs(3600);
        let spent = (0..5000).take_while(|_| b.spend_at(t2)).count();
        assert_eq!(spent, UNKNOWN_BURST as usize);
    }
}
