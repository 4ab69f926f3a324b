//! Which (prefill, decode) pair serves a new request: the one policy every
//! deployment shape uses.
//!
//! Policy: among the nodes of each role that are up, the one with the fewest
//! requests this coordinator assigned to it and has not seen released yet; ties go to
//! the lower index (deployment-file order). A node whose link has been silent past
//! its heartbeat ([`Reach::Quiet`]: stopped, stalled, or about to be declared dead)
//! is chosen only when no node of its role is [`Reach::Up`], so a frozen node stops
//! getting new requests a heartbeat after it froze, not only once its link is
//! declared dead. Outstanding counts are the coordinator's
//! own knowledge, so the choice needs no round trip to the nodes.
//!
//! Session affinity: a request with a session key (Workers AI `x-session-affinity`,
//! hashed with the tenant) goes to the prefill node that rendezvous hashing ranks
//! first for that key among the prefill nodes up, so every request of a session finds
//! the prompt prefix its earlier requests left in that node's prefix cache; the same
//! key keeps its node while the node is up, and only the keys of a node that goes
//! down move. Affinity yields to load: when that node has more than
//! [`AFFINITY_SLACK`] requests outstanding beyond the least-loaded one, the request
//! goes to the least-loaded node instead (a cold prefix costs one prefill; a hot
//! node would cost every queued request). The decode node is chosen by load alone
//! (decode nodes keep no prefix cache).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{RwLock, RwLockReadGuard};
use tessera_transfer::protocol::Role;

/// How many more outstanding requests than the least-loaded prefill node a
/// session's own node may have before a request of the session goes elsewhere.
pub(crate) const AFFINITY_SLACK: usize = 4;

/// Rendezvous score of node `index` for session `key` (splitmix64 of both).
fn score(key: u64, index: usize) -> u64 {
    let mut z = key ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// How a node can take a new request, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Reach {
    /// Connected, accepting, and heard from within its heartbeat.
    Up,
    /// Connected and accepting, but its link has been silent past its heartbeat:
    /// chosen only when no node of its role is [`Reach::Up`].
    Quiet,
    /// Down, draining or removed: never chosen.
    Down,
}

impl Reach {
    /// `Up` or `Down`.
    pub(crate) fn from_up(up: bool) -> Self {
        if up {
            Self::Up
        } else {
            Self::Down
        }
    }
}

/// One node's counts.
#[derive(Debug, Default)]
struct Slot {
    /// Requests assigned and not yet released.
    outstanding: AtomicUsize,
    /// Requests ever assigned.
    assigned: AtomicU64,
}

/// Per-node outstanding-request counts for both roles. Indices are stable: a
/// deployment that gains nodes grows the lists ([`Router::grow`]); a removed node
/// keeps its index (its owner stops reporting it up).
#[derive(Debug)]
pub(crate) struct Router {
    prefill: RwLock<Vec<Slot>>,
    decode: RwLock<Vec<Slot>>,
}

impl Router {
    /// A router over `prefill` prefill nodes and `decode` decode nodes.
    pub(crate) fn new(prefill: usize, decode: usize) -> Self {
        let zeros = |n| RwLock::new((0..n).map(|_| Slot::default()).collect());
        Self {
            prefill: zeros(prefill),
            decode: zeros(decode),
        }
    }

    fn nodes(&self, role: Role) -> RwLockReadGuard<'_, Vec<Slot>> {
        match role {
            Role::Prefill => self.prefill.read().unwrap(),
            _ => self.decode.read().unwrap(),
        }
    }

    /// Makes room for nodes of `role` up to index `len - 1` (new nodes start idle).
    pub(crate) fn grow(&self, role: Role, len: usize) {
        let mut nodes = match role {
            Role::Prefill => self.prefill.write().unwrap(),
            _ => self.decode.write().unwrap(),
        };
        while nodes.len() < len {
            nodes.push(Slot::default());
        }
    }

    fn pick_one(&self, role: Role, reach: &impl Fn(Role, usize) -> Reach) -> Option<usize> {
        let nodes = self.nodes(role);
        (0..nodes.len())
            .map(|i| (reach(role, i), i))
            .filter(|&(r, _)| r != Reach::Down)
            .min_by_key(|&(r, i)| (r, nodes[i].outstanding.load(Ordering::Relaxed)))
            .map(|(_, i)| i)
    }

    /// The prefill node for a request of session `key`: its rendezvous node (among
    /// the nodes of the best [`Reach`] there is) unless that one is
    /// [`AFFINITY_SLACK`] requests busier than the least-loaded node.
    fn pick_prefill(&self, reach: &impl Fn(Role, usize) -> Reach, key: u64) -> Option<usize> {
        let least = self.pick_one(Role::Prefill, reach)?;
        let best = reach(Role::Prefill, least);
        let prefill = self.nodes(Role::Prefill);
        let home = (0..prefill.len())
            .filter(|&i| reach(Role::Prefill, i) == best)
            .max_by_key(|&i| score(key, i))?;
        let load = |i: usize| prefill[i].outstanding.load(Ordering::Relaxed);
        Some(if load(home) > load(least) + AFFINITY_SLACK {
            least
        } else {
            home
        })
    }

    /// Picks a pair (`affinity`: the request's session key, if any) among the nodes
    /// `is_up` reports, and counts the request against both; `None` when no node of
    /// a role is up.
    #[cfg(test)]
    pub(crate) fn assign(
        &self,
        is_up: impl Fn(Role, usize) -> bool,
        affinity: Option<u64>,
    ) -> Option<(usize, usize)> {
        self.assign_by(|role, i| Reach::from_up(is_up(role, i)), affinity)
    }

    /// [`Self::assign`] by each node's [`Reach`]: a [`Reach::Quiet`] node only when
    /// no node of its role is [`Reach::Up`].
    pub(crate) fn assign_by(
        &self,
        reach: impl Fn(Role, usize) -> Reach,
        affinity: Option<u64>,
    ) -> Option<(usize, usize)> {
        let p = match affinity {
            Some(key) => self.pick_prefill(&reach, key)?,
            None => self.pick_one(Role::Prefill, &reach)?,
        };
        let d = self.pick_one(Role::Decode, &reach)?;
        for (role, i) in [(Role::Prefill, p), (Role::Decode, d)] {
            let nodes = self.nodes(role);
            nodes[i].outstanding.fetch_add(1, Ordering::Relaxed);
            nodes[i].assigned.fetch_add(1, Ordering::Relaxed);
        }
        Some((p, d))
    }

    /// The request assigned to `(prefill, decode)` is released everywhere.
    pub(crate) fn release(&self, prefill: usize, decode: usize) {
        self.nodes(Role::Prefill)[prefill]
            .outstanding
            .fetch_sub(1, Ordering::Relaxed);
        self.nodes(Role::Decode)[decode]
            .outstanding
            .fetch_sub(1, Ordering::Relaxed);
    }

    /// Requests assigned to node `index` of `role` and not yet released (0 for an
    /// index the router does not have).
    pub(crate) fn outstanding(&self, role: Role, index: usize) -> usize {
        self.nodes(role)
            .get(index)
            .map_or(0, |n| n.outstanding.load(Ordering::Relaxed))
    }

    /// Requests ever assigned to node `index` of `role` (0 for an index the router
    /// does not have).
    pub(crate) fn assigned(&self, role: Role, index: usize) -> u64 {
        self.nodes(role)
            .get(index)
            .map_or(0, |n| n.assigned.load(Ordering::Relaxed))
    }

    /// How many nodes of `role` the router counts (removed ones included).
    pub(crate) fn len(&self, role: Role) -> usize {
        self.nodes(role).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn assigns_the_least_loaded_up_pair_and_counts_releases() {
        let r = Router::new(2, 3);
        let all_up = |_: Role, _: usize| true;
        assert_eq!(r.assign(all_up, None), Some((0, 0)));
        assert_eq!(r.assign(all_up, None), Some((1, 1)));
        assert_eq!(r.assign(all_up, None), Some((0, 2)));
        r.release(0, 0);
        assert_eq!(r.outstanding(Role::Decode, 0), 0);
        // Decode node 0 is down: never chosen, however idle.
        let up = |role: Role, i: usize| !(role == Role::Decode && i == 0);
        assert_eq!(r.assign(up, None), Some((0, 1)));
        assert_eq!(r.assign(|role, _| role == Role::Prefill, None), None);
        assert_eq!(r.outstanding(Role::Prefill, 1), 1);
    }

    #[test]
    fn a_session_keeps_its_prefill_node_until_it_is_down_or_too_busy() {
        let r = Router::new(4, 1);
        let all_up = |_: Role, _: usize| true;
        // Many sessions spread over the nodes; each one always lands on its own.
        let mut homes = [0usize; 4];
        for key in 0..64u64 {
            let (p, _) = r.assign(all_up, Some(key)).unwrap();
            r.release(p, 0);
            assert_eq!(r.assign(all_up, Some(key)).unwrap().0, p, "session {key}");
            r.release(p, 0);
            homes[p] += 1;
        }
        assert!(homes.iter().all(|&n| n > 0), "{homes:?}");
        let key = 7;
        let home = r.assign(all_up, Some(key)).unwrap().0;
        r.release(home, 0);
        // Its node goes down: the session moves; back up: it returns.
        let without = |role: Role, i: usize| !(role == Role::Prefill && i == home);
        let moved = r.assign(without, Some(key)).unwrap().0;
        assert_ne!(moved, home);
        r.release(moved, 0);
        assert_eq!(r.assign(all_up, Some(key)).unwrap().0, home);
        r.release(home, 0);
        // Load: up to AFFINITY_SLACK more than the least-loaded node, it stays.
        for _ in 0..AFFINITY_SLACK {
            r.nodes(Role::Prefill)[home]
                .outstanding
                .fetch_add(1, Ordering::Relaxed);
        }
        let (p, _) = r.assign(all_up, Some(key)).unwrap();
        assert_eq!(p, home);
        r.release(p, 0);
        r.nodes(Role::Prefill)[home]
            .outstanding
            .fetch_add(1, Ordering::Relaxed);
        let (p, _) = r.assign(all_up, Some(key)).unwrap();
        assert_ne!(p, home, "one more and it yields to load");
        r.release(p, 0);
    }

    #[test]
    fn a_quiet_node_is_chosen_only_when_no_node_of_its_role_is_up() {
        let r = Router::new(2, 2);
        // Decode node 0 is idle but quiet: decode 1 takes the requests, however busy.
        let reach = |role: Role, i: usize| match (role, i) {
            (Role::Decode, 0) => Reach::Quiet,
            _ => Reach::Up,
        };
        for _ in 0..3 {
            assert_eq!(r.assign_by(reach, None).map(|(_, d)| d), Some(1));
        }
        // Every decode node quiet: the least loaded of them.
        let quiet = |role: Role, _: usize| {
            if role == Role::Decode {
                Reach::Quiet
            } else {
                Reach::Up
            }
        };
        assert_eq!(r.assign_by(quiet, None).map(|(_, d)| d), Some(0));
        // A session's prefill node goes quiet: the session moves while it is.
        let key = 11;
        let (home, d) = r.assign_by(reach, Some(key)).unwrap();
        r.release(home, d);
        let home_quiet = |role: Role, i: usize| {
            if role == Role::Prefill && i == home {
                Reach::Quiet
            } else {
                Reach::Up
            }
        };
        let (moved, d) = r.assign_by(home_quiet, Some(key)).unwrap();
        assert_ne!(moved, home);
        r.release(moved, d);
        let down = |role: Role, _: usize| {
            if role == Role::Decode {
                Reach::Down
            } else {
                Reach::Up
            }
        };
        assert_eq!(r.assign_by(down, None), None);
    }

    #[test]
    fn a_grown_router_routes_to_the_new_node() {
        let r = Router::new(1, 1);
        let all_up = |_: Role, _: usize| true;
        assert_eq!(r.assign(all_up, None), Some((0, 0)));
        r.grow(Role::Decode, 2);
        assert_eq!(r.len(Role::Decode), 2);
        assert_eq!(r.assign(all_up, None), Some((0, 1)), "the idle new node");
        assert_eq!(r.outstanding(Role::Decode, 1), 1);
        assert_eq!(r.outstanding(Role::Decode, 7), 0);
        r.release(0, 1);
        assert_eq!(r.outstanding(Role::Decode, 1), 0);
        assert_eq!(
            r.assigned(Role::Decode, 1),
            1,
            "assigned counts never go down"
        );
    }
}
