//! Which (prefill, decode) pair serves a new request: the one policy every
//! deployment shape uses.
//!
//! Policy: among the nodes of each role that are up, the one with the fewest
//! requests this coordinator assigned to it and has not seen released yet; ties go to
//! the lower index (deployment-file order). Outstanding counts are the coordinator's
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

use std::sync::atomic::{AtomicUsize, Ordering};
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

/// Per-node outstanding-request counts for both roles.
#[derive(Debug)]
pub(crate) struct Router {
    prefill: Vec<AtomicUsize>,
    decode: Vec<AtomicUsize>,
}

impl Router {
    /// A router over `prefill` prefill nodes and `decode` decode nodes.
    pub(crate) fn new(prefill: usize, decode: usize) -> Self {
        let zeros = |n| (0..n).map(|_| AtomicUsize::new(0)).collect();
        Self {
            prefill: zeros(prefill),
            decode: zeros(decode),
        }
    }

    fn nodes(&self, role: Role) -> &[AtomicUsize] {
        match role {
            Role::Prefill => &self.prefill,
            _ => &self.decode,
        }
    }

    fn pick_one(&self, role: Role, is_up: &impl Fn(Role, usize) -> bool) -> Option<usize> {
        let nodes = self.nodes(role);
        (0..nodes.len())
            .filter(|&i| is_up(role, i))
            .min_by_key(|&i| nodes[i].load(Ordering::Relaxed))
    }

    /// The prefill node for a request of session `key`: its rendezvous node unless
    /// that one is [`AFFINITY_SLACK`] requests busier than the least-loaded node.
    fn pick_prefill(&self, is_up: &impl Fn(Role, usize) -> bool, key: u64) -> Option<usize> {
        let least = self.pick_one(Role::Prefill, is_up)?;
        let home = (0..self.prefill.len())
            .filter(|&i| is_up(Role::Prefill, i))
            .max_by_key(|&i| score(key, i))?;
        let load = |i: usize| self.prefill[i].load(Ordering::Relaxed);
        Some(if load(home) > load(least) + AFFINITY_SLACK {
            least
        } else {
            home
        })
    }

    /// Picks a pair (`affinity`: the request's session key, if any) and counts the
    /// request against both; `None` when no node of a role is up.
    pub(crate) fn assign(
        &self,
        is_up: impl Fn(Role, usize) -> bool,
        affinity: Option<u64>,
    ) -> Option<(usize, usize)> {
        let p = match affinity {
            Some(key) => self.pick_prefill(&is_up, key)?,
            None => self.pick_one(Role::Prefill, &is_up)?,
        };
        let d = self.pick_one(Role::Decode, &is_up)?;
        self.prefill[p].fetch_add(1, Ordering::Relaxed);
        self.decode[d].fetch_add(1, Ordering::Relaxed);
        Some((p, d))
    }

    /// The request assigned to `(prefill, decode)` is released everywhere.
    pub(crate) fn release(&self, prefill: usize, decode: usize) {
        self.prefill[prefill].fetch_sub(1, Ordering::Relaxed);
        self.decode[decode].fetch_sub(1, Ordering::Relaxed);
    }

    /// Requests assigned to node `index` of `role` and not yet released.
    pub(crate) fn outstanding(&self, role: Role, index: usize) -> usize {
        self.nodes(role)[index].load(Ordering::Relaxed)
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
            r.prefill[home].fetch_add(1, Ordering::Relaxed);
        }
        let (p, _) = r.assign(all_up, Some(key)).unwrap();
        assert_eq!(p, home);
        r.release(p, 0);
        r.prefill[home].fetch_add(1, Ordering::Relaxed);
        let (p, _) = r.assign(all_up, Some(key)).unwrap();
        assert_ne!(p, home, "one more and it yields to load");
        r.release(p, 0);
    }
}
