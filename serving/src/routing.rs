//! Which (prefill, decode) pair serves a new request: the one policy every
//! deployment shape uses.
//!
//! Policy: among the nodes of each role that are up, the one with the fewest
//! requests this coordinator assigned to it and has not seen released yet; ties go to
//! the lower index (deployment-file order). Outstanding counts are the coordinator's
//! own knowledge, so the choice needs no round trip to the nodes.

use std::sync::atomic::{AtomicUsize, Ordering};
use tessera_transfer::protocol::Role;

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

    /// Picks a pair and counts the request against both; `None` when no node of a
    /// role is up.
    pub(crate) fn assign(&self, is_up: impl Fn(Role, usize) -> bool) -> Option<(usize, usize)> {
        let p = self.pick_one(Role::Prefill, &is_up)?;
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
        assert_eq!(r.assign(all_up), Some((0, 0)));
        assert_eq!(r.assign(all_up), Some((1, 1)));
        assert_eq!(r.assign(all_up), Some((0, 2)));
        r.release(0, 0);
        assert_eq!(r.outstanding(Role::Decode, 0), 0);
        // Decode node 0 is down: never chosen, however idle.
        let up = |role: Role, i: usize| !(role == Role::Decode && i == 0);
        assert_eq!(r.assign(up), Some((0, 1)));
        assert_eq!(r.assign(|role, _| role == Role::Prefill), None);
        assert_eq!(r.outstanding(Role::Prefill, 1), 1);
    }
}
