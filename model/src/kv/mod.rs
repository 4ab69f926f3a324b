//! KV cache memory in two layers (STYLE.md habit 3): [`pool`] owns pages, tags and
//! the free list; [`KvManager`] owns per-sequence block tables and reserves or
//! refuses. The scheduler only talks to the manager.

pub mod pool;

pub use pool::{PagePool, PoolError};
use std::collections::HashMap;
use tessera_kernels::{BlockRef, KvLayout};

/// A sequence's identity on this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// Per-sequence block tables over a [`PagePool`].
#[derive(Debug)]
pub struct KvManager {
    pool: PagePool,
    tables: HashMap<SeqId, Vec<BlockRef>>,
    owners: HashMap<SeqId, u64>,
}

impl KvManager {
    /// Wraps a pool.
    pub fn new(pool: PagePool) -> Self {
        Self {
            pool,
            tables: HashMap::new(),
            owners: HashMap::new(),
        }
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.pool.layout().page_size)
    }

    /// Whether `tokens` tokens could fit right now.
    pub fn can_reserve(&self, tokens: usize) -> bool {
        self.pages_for(tokens) <= self.pool.free_pages()
    }

    /// Reserves pages for `tokens` tokens of a new sequence, all or nothing.
    ///
    /// Errors: [`PoolError::Exhausted`] when the pool has too few free pages,
    /// [`PoolError::SeqInUse`] when `seq` already holds pages.
    pub fn reserve(&mut self, seq: SeqId, tenant: u64, tokens: usize) -> Result<(), PoolError> {
        if self.tables.contains_key(&seq) {
            return Err(PoolError::SeqInUse { seq: seq.0 });
        }
        let refs = self.pool.alloc(tenant, seq.0, 0, self.pages_for(tokens))?;
        self.tables.insert(seq, refs);
        self.owners.insert(seq, tenant);
        Ok(())
    }

    /// Frees every page of `seq` (no-op for an unknown sequence). Returns pages freed.
    ///
    /// Pages are found by their owner tag, not by the block table: a corrupted table
    /// entry can neither free another sequence's page nor leak this one's.
    pub fn release(&mut self, seq: SeqId) -> usize {
        let (Some(refs), Some(tenant)) = (self.tables.remove(&seq), self.owners.remove(&seq))
        else {
            return 0;
        };
        let freed = self.pool.free_owned_by(tenant, seq.0);
        if freed != refs.len() {
            tracing::error!(
                ?seq,
                freed,
                table = refs.len(),
                "block table disagreed with page tags"
            );
        }
        freed
    }

    /// The block table of `seq`.
    pub fn table(&self, seq: SeqId) -> Option<&[BlockRef]> {
        self.tables.get(&seq).map(|v| v.as_slice())
    }

    /// Mutable block table access, for fault-injection tests only.
    #[doc(hidden)]
    pub fn table_mut_for_test(&mut self, seq: SeqId) -> Option<&mut Vec<BlockRef>> {
        self.tables.get_mut(&seq)
    }

    /// The pool.
    pub fn pool(&self) -> &PagePool {
        &self.pool
    }

    /// Page data, tags and all block tables at once (the forward pass writes K/V
    /// through tables while holding the data mutably).
    pub fn split_mut(&mut self) -> (&mut PagePool, &HashMap<SeqId, Vec<BlockRef>>) {
        (&mut self.pool, &self.tables)
    }

    /// Page shape.
    pub fn layout(&self) -> &KvLayout {
        self.pool.layout()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_and_release_round_trip_free_count() {
        let layout = KvLayout {
            layers: 1,
            page_size: 16,
            kv_heads: 1,
            head_dim: 32,
        };
        let mut m = KvManager::new(PagePool::new(layout, 4, false));
        m.reserve(SeqId(1), 3, 17).unwrap();
        assert_eq!(m.pool().free_pages(), 2);
        assert!(m.reserve(SeqId(2), 3, 100).is_err());
        assert_eq!(m.pool().free_pages(), 2);
        assert_eq!(m.release(SeqId(1)), 2);
        assert_eq!(m.pool().free_pages(), 4);
    }
}
