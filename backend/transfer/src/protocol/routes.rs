//! The coordinator side's check of who may say what about which request: a node
//! link is believed only for the messages its role sends, and only about the
//! requests routed to that very link.

use super::messages::{Msg, ReqId, Role};
use std::collections::BTreeMap;

/// Why a receiver refused a message (or a stream event) from a node link. Each is a
/// protocol violation by that link's peer: the receiver drops it, counts it and
/// cuts the link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkViolation {
    /// About a request that was never routed to this link: another node's request
    /// (whose id the peer guessed or learnt), or none at all.
    NotRouted,
    /// A message the link's peer never sends to this receiver in the protocol
    /// ([`Msg::may_send`]): a decode node speaking for a prefill node, a node sending
    /// a coordinator's message.
    WrongSender,
}

impl LinkViolation {
    /// Every violation, in declaration order.
    pub const ALL: [LinkViolation; 2] = [LinkViolation::NotRouted, LinkViolation::WrongSender];

    /// The stable metric label.
    pub fn label(self) -> &'static str {
        match self {
            LinkViolation::NotRouted => "not_routed",
            LinkViolation::WrongSender => "wrong_sender",
        }
    }
}

/// What a receiver does with a message that passed [`RouteBook::check`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routed {
    /// The request is live and was routed to this link: act on it.
    Live,
    /// The request ended (it was routed to this link): a late duplicate, dropped
    /// without acting and without cutting the link.
    Ended,
}

/// The coordinator side's record of which node link carries each request, by role:
/// a message or stream event from a link is accepted only for requests routed to
/// that very link (the node's identity and its link incarnation, `L`), never for
/// another node's (S1 across nodes: one node's certificate reaches only the
/// requests routed to it). An ended request's route is kept for as long as a late
/// copy of a message for it can arrive ([`RouteBook::expire`]), so a late duplicate
/// from its own link is dropped quietly while one from any other link is still a
/// violation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RouteBook<L> {
    /// Live requests' routes.
    live: BTreeMap<ReqId, Route<L>>,
    /// Ended requests' routes and the clock reading when each ended.
    ended: BTreeMap<ReqId, (Route<L>, u64)>,
    /// The driver's clock as of the last [`RouteBook::expire`] (milliseconds).
    now: u64,
}

/// A request's (prefill link, decode link), each once routed.
type Route<L> = (Option<L>, Option<L>);

impl<L> Default for RouteBook<L> {
    fn default() -> Self {
        Self {
            live: BTreeMap::new(),
            ended: BTreeMap::new(),
            now: 0,
        }
    }
}

impl<L: Copy + Eq> RouteBook<L> {
    /// Records that `link` carries `req` for `role` (call before the first message
    /// for `req` goes onto it). The first link routed for a role stays the
    /// request's: a request never moves to another link (a new link of the node does
    /// not know it). Ignored for an ended request and for the coordinator role.
    pub fn route(&mut self, req: ReqId, role: Role, link: L) {
        if self.ended.contains_key(&req) {
            return;
        }
        let r = self.live.entry(req).or_insert((None, None));
        match role {
            Role::Prefill => {
                r.0.get_or_insert(link);
            }
            Role::Decode => {
                r.1.get_or_insert(link);
            }
            Role::Coordinator => {}
        }
    }

    /// The request ended (released everywhere): later messages from its links are
    /// [`Routed::Ended`] until [`RouteBook::expire`] forgets it.
    pub fn end(&mut self, req: ReqId) {
        if let Some(r) = self.live.remove(&req) {
            self.ended.insert(req, (r, self.now));
        }
    }

    /// Whether `msg`, read from `link` whose peer has role `from`, may be acted on by
    /// the coordinator: the peer's role sends it to the coordinator
    /// ([`Msg::may_send`]) and the request was routed to that very link.
    ///
    /// Errors: the violation (drop the message, count it, cut the link).
    pub fn check(&self, link: L, from: Role, msg: &Msg) -> Result<Routed, LinkViolation> {
        if !msg.may_send(from, Role::Coordinator) {
            return Err(LinkViolation::WrongSender);
        }
        self.check_req(link, from, msg.req())
    }

    /// Whether a stream event (decode node to coordinator) for `req` from decode
    /// link `link` may be delivered: only for a request routed to that link.
    ///
    /// Errors: [`LinkViolation::NotRouted`].
    pub fn check_event(&self, link: L, req: ReqId) -> Result<Routed, LinkViolation> {
        self.check_req(link, Role::Decode, req)
    }

    fn check_req(&self, link: L, from: Role, req: ReqId) -> Result<Routed, LinkViolation> {
        let pick = |r: &Route<L>| match from {
            Role::Prefill => r.0,
            Role::Decode => r.1,
            Role::Coordinator => None,
        };
        if let Some(r) = self.live.get(&req) {
            if pick(r) == Some(link) {
                return Ok(Routed::Live);
            }
        } else if let Some((r, _)) = self.ended.get(&req) {
            if pick(r) == Some(link) {
                return Ok(Routed::Ended);
            }
        }
        Err(LinkViolation::NotRouted)
    }

    /// Advances the clock to `now` (milliseconds, monotonic) and forgets ended
    /// requests that ended at least `ttl` milliseconds ago (the longest a late copy
    /// of a message can still arrive). Returns how many were forgotten.
    pub fn expire(&mut self, now: u64, ttl: u64) -> usize {
        self.now = self.now.max(now);
        let before = self.ended.len();
        let now = self.now;
        self.ended.retain(|_, (_, t)| t.saturating_add(ttl) > now);
        before - self.ended.len()
    }

    /// Live requests routed.
    pub fn live(&self) -> usize {
        self.live.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{FailKind, FailReason};

    /// A node link is believed only for what its role sends, and only about the
    /// requests routed to that very link: another link's request (even of a node of
    /// the same role) is `NotRouted`, a late duplicate from the request's own link
    /// after it ended is `Ended` until the route expires.
    #[test]
    fn a_route_book_believes_a_link_only_about_its_own_requests() {
        let mut b: RouteBook<u64> = RouteBook::default();
        let (a, other) = (ReqId(1), ReqId(2));
        b.route(a, Role::Decode, 10);
        b.route(a, Role::Prefill, 20);
        b.route(other, Role::Decode, 11);
        // A later link of the same role never takes a request over.
        b.route(a, Role::Decode, 12);
        let committed = |req| Msg::Committed { req };
        assert_eq!(b.check(10, Role::Decode, &committed(a)), Ok(Routed::Live));
        assert_eq!(b.check_event(10, a), Ok(Routed::Live));
        for (link, req) in [(11, a), (12, a), (10, other), (10, ReqId(3))] {
            assert_eq!(
                b.check(link, Role::Decode, &committed(req)),
                Err(LinkViolation::NotRouted),
                "link {link}, {req:?}"
            );
            assert_eq!(b.check_event(link, req), Err(LinkViolation::NotRouted));
        }
        // The prefill link of `a` is believed for what a prefill node sends only.
        let failed = Msg::PrefillFailed {
            req: a,
            reason: FailReason::new(FailKind::Internal, "x"),
        };
        assert_eq!(b.check(20, Role::Prefill, &failed), Ok(Routed::Live));
        assert_eq!(
            b.check(20, Role::Prefill, &committed(a)),
            Err(LinkViolation::WrongSender)
        );
        assert_eq!(
            b.check(20, Role::Prefill, &failed.clone()),
            Ok(Routed::Live)
        );
        assert_eq!(b.check_event(20, a), Err(LinkViolation::NotRouted));
        // A decode link cannot speak for the prefill node, nor as a coordinator.
        let ack = |from| Msg::AbortAck { req: a, from };
        assert_eq!(
            b.check(10, Role::Decode, &ack(Role::Prefill)),
            Err(LinkViolation::WrongSender)
        );
        assert_eq!(
            b.check(10, Role::Decode, &ack(Role::Decode)),
            Ok(Routed::Live)
        );
        for m in [
            Msg::Abort { req: a },
            Msg::Poll { req: a },
            Msg::Renew { req: a },
        ] {
            assert_eq!(
                b.check(10, Role::Decode, &m),
                Err(LinkViolation::WrongSender),
                "{m:?}"
            );
        }
        // Ended: its own link's late duplicates are dropped quietly until expiry.
        b.expire(1_000, 60_000);
        b.end(a);
        assert_eq!(b.check(10, Role::Decode, &committed(a)), Ok(Routed::Ended));
        assert_eq!(
            b.check(11, Role::Decode, &committed(a)),
            Err(LinkViolation::NotRouted)
        );
        b.route(a, Role::Decode, 11);
        assert_eq!(b.check_event(11, a), Err(LinkViolation::NotRouted));
        assert_eq!(b.expire(60_999, 60_000), 0);
        assert_eq!(b.expire(61_000, 60_000), 1);
        assert_eq!(
            b.check(10, Role::Decode, &committed(a)),
            Err(LinkViolation::NotRouted)
        );
        assert_eq!(b.live(), 1);
    }
}
