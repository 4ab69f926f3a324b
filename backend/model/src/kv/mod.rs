//! KV cache memory in two layers (STYLE.md habit 3): [`pool`] owns pages, tags and
//! the free list; [`KvManager`] owns per-sequence block tables and the
//! [`prefix`] cache's index, and reserves or refuses. The scheduler only talks to the
//! manager.

pub mod pool;
pub mod prefix;

pub use pool::{PagePool, PoolError};
use prefix::{cache_seq, ChainHash, PrefixIndex};
use std::collections::HashMap;
use tessera_kernels::{BlockRef, IntegrityError, KvLayout, PageTag};

/// Why a reservation through the prefix cache failed. Nothing stays reserved.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReserveError {
    /// Too few free and evictable pages, or a duplicate sequence id.
    #[error(transparent)]
    Pool(#[from] PoolError),
    /// A cached page's tag is not the one its key implies (I3): the entry was
    /// evicted and the request must fail.
    #[error("KV integrity check failed on a prefix-cache hit: {0}")]
    Integrity(IntegrityError),
}

/// A sequence's identity on this node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SeqId(pub u64);

/// What [`KvManager::purge_tenant_cache`] did: pages freed at once, and pages still
/// read by a running sequence, poisoned and freed when it ends.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CachePurge {
    /// Cached pages returned to the free list.
    pub freed: usize,
    /// Cached pages a running sequence reads: never hit again, freed at its end.
    pub poisoned: usize,
}

/// Per-sequence block tables and the prefix cache over a [`PagePool`].
#[derive(Debug)]
pub struct KvManager {
    pool: PagePool,
    tables: HashMap<SeqId, Vec<BlockRef>>,
    owners: HashMap<SeqId, u64>,
    cache: PrefixIndex,
    /// Keys of the cached pages each sequence reuses (its table's first entries).
    pinned: HashMap<SeqId, Vec<ChainHash>>,
    /// Most pages one tenant's cache entries may hold.
    tenant_cache_pages: usize,
}

impl KvManager {
    /// Wraps a pool; one tenant's cache entries may fill all of it (see
    /// [`Self::set_tenant_cache_share`]).
    pub fn new(pool: PagePool) -> Self {
        let tenant_cache_pages = pool.capacity();
        Self {
            pool,
            tables: HashMap::new(),
            owners: HashMap::new(),
            cache: PrefixIndex::default(),
            pinned: HashMap::new(),
            tenant_cache_pages,
        }
    }

    /// One tenant's cache entries hold at most `percent`% of the pool's pages
    /// (clamped to 0..=100; 0 keeps nothing).
    pub fn set_tenant_cache_share(&mut self, percent: u32) {
        self.tenant_cache_pages = self.pool.capacity() * percent.min(100) as usize / 100;
    }

    /// Pages a new reservation can get now: free pages plus cached pages no
    /// sequence uses (evicted on demand). Cached pages are never free.
    pub fn available_pages(&self) -> usize {
        self.pool.free_pages() + self.cache.evictable()
    }

    /// Pages the prefix cache holds (pinned or not).
    pub fn cached_pages(&self) -> usize {
        self.cache.len()
    }

    /// Cached pages no sequence uses (evictable).
    pub fn evictable_pages(&self) -> usize {
        self.cache.evictable()
    }

    /// How many leading pages of `chain` are cached for `tenant` (at most
    /// `max_pages`), by the index alone; [`Self::reserve_cached`] verifies their
    /// tags before any is used.
    pub fn cached_prefix(&self, tenant: u64, chain: &[ChainHash], max_pages: usize) -> usize {
        chain
            .iter()
            .take(max_pages)
            .take_while(|h| self.cache.get(h).is_some_and(|e| e.tenant == tenant))
            .count()
    }

    /// Of the first `hits` keys of `chain` (cached, see [`Self::cached_prefix`]),
    /// how many no sequence uses now (a reservation that reuses them takes them out
    /// of the evictable pages).
    pub fn unpinned_hits(&self, chain: &[ChainHash], hits: usize) -> usize {
        chain[..hits]
            .iter()
            .filter(|h| self.cache.get(h).is_some_and(|e| e.refs == 0))
            .count()
    }

    /// Pages needed to hold `tokens` tokens.
    pub fn pages_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.pool.layout().page_size)
    }

    /// Whether `tokens` tokens could fit right now (free pages plus evictable
    /// cached pages).
    pub fn can_reserve(&self, tokens: usize) -> bool {
        self.pages_for(tokens) <= self.available_pages()
    }

    /// Reserves pages for `tokens` tokens of a new sequence, all or nothing,
    /// evicting unused cached pages (least recently used first) if the free list is
    /// short.
    ///
    /// Errors: [`PoolError::Exhausted`] when free plus evictable pages are too few,
    /// [`PoolError::SeqInUse`] when `seq` already holds pages.
    pub fn reserve(&mut self, seq: SeqId, tenant: u64, tokens: usize) -> Result<(), PoolError> {
        match self.reserve_cached(seq, tenant, tokens, &[], 0) {
            Ok(_) => Ok(()),
            Err(ReserveError::Pool(e)) => Err(e),
            Err(ReserveError::Integrity(_)) => unreachable!("no cached pages were asked for"),
        }
    }

    /// Reserves pages for `tokens` tokens of a new sequence of `tenant`, reusing the
    /// cached pages of the longest cached prefix of `chain` (at most `max_hit`
    /// pages) as its first logical blocks and allocating the rest, all or nothing.
    /// Returns the number of cached pages reused.
    ///
    /// Every reused page's tag must be `(tenant, cache_seq(key), the epoch the
    /// cache recorded, its logical block)` and the page must be held by the cache
    /// (I3); a mismatch poisons the entry (it is never hit again and its page is
    /// freed once unused) and fails the reservation.
    ///
    /// Errors: [`ReserveError::Integrity`] for a failed tag check,
    /// [`ReserveError::Pool`] when pages are short or `seq` is in use.
    pub fn reserve_cached(
        &mut self,
        seq: SeqId,
        tenant: u64,
        tokens: usize,
        chain: &[ChainHash],
        max_hit: usize,
    ) -> Result<usize, ReserveError> {
        if self.tables.contains_key(&seq) {
            return Err(PoolError::SeqInUse { seq: seq.0 }.into());
        }
        let total = self.pages_for(tokens);
        let hits = self.cached_prefix(tenant, chain, max_hit.min(total));
        let mut refs = Vec::with_capacity(total);
        for (i, h) in chain[..hits].iter().enumerate() {
            let e = *self.cache.get(h).expect("counted as a hit");
            let expected = PageTag {
                tenant,
                seq: cache_seq(h),
                epoch: e.r.tag.epoch,
                logical_block: i as u32,
            };
            let found = self.pool.tags()[e.r.page as usize];
            if found != expected || e.r.tag != expected || !self.pool.is_cached(e.r.page) {
                self.poison(h);
                return Err(ReserveError::Integrity(IntegrityError {
                    page: e.r.page,
                    logical_block: i as u32,
                    expected,
                    found,
                }));
            }
            refs.push(e.r);
        }
        // Pin the hits first so that the eviction below cannot take them.
        for h in &chain[..hits] {
            self.cache.pin(h);
        }
        let need = total - hits;
        if need > self.available_pages() {
            for h in &chain[..hits] {
                self.unpin(h);
            }
            return Err(PoolError::Exhausted {
                free: self.available_pages(),
                wanted: need,
            }
            .into());
        }
        while self.pool.free_pages() < need {
            let Some(victim) = self.cache.victim(None) else {
                break;
            };
            self.evict(&victim);
        }
        let fresh = match self.pool.alloc(tenant, seq.0, hits as u32, need) {
            Ok(f) => f,
            Err(e) => {
                for h in &chain[..hits] {
                    self.unpin(h);
                }
                return Err(e.into());
            }
        };
        refs.extend(fresh);
        self.tables.insert(seq, refs);
        self.owners.insert(seq, tenant);
        if hits > 0 {
            self.pinned.insert(seq, chain[..hits].to_vec());
        }
        Ok(hits)
    }

    /// Frees every page of `seq` (no-op for an unknown sequence) and unpins the
    /// cached pages it reused. Returns the pages freed (cached pages stay cached).
    ///
    /// Pages are found by their owner tag, not by the block table: a corrupted table
    /// entry can neither free another sequence's page nor leak this one's.
    pub fn release(&mut self, seq: SeqId) -> usize {
        self.release_caching(seq, &[], 0)
    }

    /// [`Self::release`], but first hands `seq`'s own pages for logical blocks
    /// `0..computed_pages` (whose K/V is completely computed) to the prefix cache,
    /// keyed by `chain` (the sequence's keys, one per full prompt page), as long as
    /// the chain stays unbroken and the owner stays within its share of the pool
    /// (making room by evicting its own unused entries, oldest first). A page
    /// whose key is already cached is freed as usual. Returns the pages freed.
    pub fn release_caching(
        &mut self,
        seq: SeqId,
        chain: &[ChainHash],
        computed_pages: usize,
    ) -> usize {
        let (Some(refs), Some(tenant)) = (self.tables.remove(&seq), self.owners.remove(&seq))
        else {
            return 0;
        };
        let pinned = self.pinned.remove(&seq).unwrap_or_default();
        let mut keep = computed_pages.min(chain.len()).min(refs.len());
        // A reused page poisoned meanwhile (its tenant's cache was purged): the chain
        // is broken there, so nothing after it is cached (it could never be hit).
        if pinned.iter().any(|h| self.cache.get(h).is_none()) {
            keep = keep.min(pinned.len());
        }
        let mut cached_now = 0;
        for i in pinned.len()..keep {
            let h = &chain[i];
            if self.cache.contains(h) {
                continue; // cached meanwhile (by a request with the same prefix)
            }
            while self.cache.tenant_pages(tenant) >= self.tenant_cache_pages {
                match self.cache.victim(Some(tenant)) {
                    Some(v) => self.evict(&v),
                    None => break,
                }
            }
            if self.cache.tenant_pages(tenant) >= self.tenant_cache_pages {
                break;
            }
            match self
                .pool
                .move_to_cache(refs[i], tenant, cache_seq(h), i as u32)
            {
                Ok(r) => {
                    self.cache.insert(*h, r, tenant);
                    cached_now += 1;
                }
                Err(e) => {
                    tracing::error!(?seq, error = %e, "page left its block table before caching");
                    break;
                }
            }
        }
        // Deeper pages are older in the LRU order than the prefix they extend, so a
        // chain is evicted from its end.
        for h in chain[..keep].iter().rev() {
            self.cache.touch(h);
        }
        for h in pinned.iter().rev() {
            self.unpin(h);
        }
        let freed = self.pool.free_owned_by(tenant, seq.0);
        if freed + cached_now + pinned.len() != refs.len() {
            tracing::error!(
                ?seq,
                freed,
                cached_now,
                reused = pinned.len(),
                table = refs.len(),
                "block table disagreed with page tags"
            );
        }
        freed
    }

    fn unpin(&mut self, h: &ChainHash) {
        if let Some(e) = self.cache.unpin(h) {
            self.free_cached_page(e.r.page);
        }
    }

    fn poison(&mut self, h: &ChainHash) {
        if let Some(e) = self.cache.poison(h) {
            self.free_cached_page(e.r.page);
        }
    }

    fn evict(&mut self, h: &ChainHash) {
        if let Some(e) = self.cache.remove(h) {
            self.free_cached_page(e.r.page);
        }
    }

    /// Frees a page the cache owns, with the tag the pool has for it (an entry
    /// whose tag failed its check still frees the page it owned).
    fn free_cached_page(&mut self, page: u32) {
        if !self.pool.is_cached(page) {
            tracing::error!(page, "a cache entry named a page the cache does not hold");
            return;
        }
        let tag = self.pool.tags()[page as usize];
        self.pool
            .free(BlockRef { page, tag })
            .expect("a held page with the pool's own tag");
    }

    /// Drops every unused cached page of the cache (pinned ones stay until their
    /// sequences end). Returns the pages freed.
    pub fn clear_cache(&mut self) -> usize {
        let mut n = 0;
        while let Some(v) = self.cache.victim(None) {
            self.evict(&v);
            n += 1;
        }
        n
    }

    /// Drops every cached page of `tenant` (its "erase what you cached of mine"):
    /// unused pages go back to the free list now, their epoch bumped by the free
    /// (I5: a stale reference to one fails its tag check); pages a running sequence
    /// still reads are poisoned, never hit again, and freed when their last reader
    /// ends. Other tenants' pages are untouched. Returns the counts.
    pub fn purge_tenant_cache(&mut self, tenant: u64) -> CachePurge {
        let mut purge = CachePurge::default();
        while let Some(v) = self.cache.victim(Some(tenant)) {
            self.evict(&v);
            purge.freed += 1;
        }
        for h in self.cache.live_keys_of(tenant) {
            // Pinned (every unpinned one was evicted above): freed at its last unpin.
            self.poison(&h);
            purge.poisoned += 1;
        }
        purge
    }

    /// Cached pages `tenant`'s entries hold now (poisoned ones still read by a
    /// running sequence included).
    pub fn tenant_cached_pages(&self, tenant: u64) -> usize {
        self.cache.tenant_pages(tenant)
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

    fn manager(pages: usize) -> KvManager {
        let layout = KvLayout {
            layers: 1,
            page_size: 4,
            kv_heads: 1,
            head_dim: 8,
        };
        KvManager::new(PagePool::new(layout, pages, false))
    }

    fn keys(ns: u8, toks: &[u32]) -> Vec<ChainHash> {
        prefix::chain(&prefix::chain_root(&[ns; 32], &[0; 32], 4), toks, 4)
    }

    #[test]
    fn a_released_prompt_is_reused_by_the_same_tenant_only() {
        let mut m = manager(8);
        let toks: Vec<u32> = (0..10).collect();
        let chain = keys(1, &toks);
        assert_eq!(chain.len(), 2);
        assert_eq!(m.reserve_cached(SeqId(1), 7, 12, &chain, 2).unwrap(), 0);
        assert_eq!(m.release_caching(SeqId(1), &chain, 2), 1);
        assert_eq!((m.cached_pages(), m.pool().free_pages()), (2, 6));
        assert_eq!(m.available_pages(), 8, "unused cached pages are evictable");
        // Same tenant, same namespace: both pages reused as logical blocks 0 and 1.
        assert_eq!(m.reserve_cached(SeqId(2), 7, 12, &chain, 2).unwrap(), 2);
        let t = m.table(SeqId(2)).unwrap().to_vec();
        assert_eq!(t[0].tag.seq, prefix::cache_seq(&chain[0]));
        tessera_kernels::attention::verify_tags(m.pool().tags(), &t).unwrap();
        assert_eq!(m.available_pages(), 5, "pinned pages are not evictable");
        // Another tenant with the same keys (impossible with server-derived
        // namespaces, but the tenant check holds regardless) and another namespace
        // both miss.
        assert_eq!(m.cached_prefix(8, &chain, 2), 0);
        assert_eq!(m.cached_prefix(7, &keys(2, &toks), 2), 0);
        assert_eq!(m.release(SeqId(2)), 1);
        assert_eq!(m.cached_pages(), 2);
        assert_eq!(m.clear_cache(), 2);
        assert_eq!(m.pool().free_pages(), 8);
    }

    #[test]
    fn a_full_pool_of_cached_pages_still_admits_a_pool_sized_request() {
        let mut m = manager(4);
        let toks: Vec<u32> = (0..16).collect();
        let chain = keys(1, &toks);
        m.reserve_cached(SeqId(1), 7, 16, &chain, 4).unwrap();
        m.release_caching(SeqId(1), &chain, 4);
        assert_eq!((m.cached_pages(), m.pool().free_pages()), (4, 0));
        // Another tenant needs the whole pool: every cached page is evicted.
        assert_eq!(m.reserve_cached(SeqId(2), 8, 16, &[], 0).unwrap(), 0);
        assert_eq!(m.cached_pages(), 0);
        m.release(SeqId(2));
        assert_eq!(m.pool().free_pages(), 4);
    }

    #[test]
    fn eviction_takes_the_end_of_a_chain_first_and_never_a_pinned_page() {
        let mut m = manager(6);
        let toks: Vec<u32> = (0..12).collect();
        let chain = keys(1, &toks);
        m.reserve_cached(SeqId(1), 7, 12, &chain, 3).unwrap();
        m.release_caching(SeqId(1), &chain, 3);
        // Reuse the first page only; then a request of 4 pages needs one eviction.
        assert_eq!(m.reserve_cached(SeqId(2), 7, 4, &chain, 1).unwrap(), 1);
        m.reserve(SeqId(3), 8, 16).unwrap();
        assert_eq!(
            m.cached_prefix(7, &chain, 3),
            2,
            "page 2 (the end) went first"
        );
        assert!(m.reserve(SeqId(4), 8, 8).is_err(), "page 0 is pinned");
        assert_eq!(
            m.cached_prefix(7, &chain, 3),
            2,
            "a reservation that cannot succeed evicts nothing"
        );
        m.release(SeqId(2));
        m.release(SeqId(3));
    }

    #[test]
    fn a_tenant_keeps_at_most_its_share_replacing_its_own_oldest_entries() {
        let mut m = manager(8);
        m.set_tenant_cache_share(25); // 2 pages
        let a = keys(1, &(0..8).collect::<Vec<u32>>());
        let b = keys(1, &(100..108).collect::<Vec<u32>>());
        m.reserve_cached(SeqId(1), 7, 8, &a, 2).unwrap();
        m.release_caching(SeqId(1), &a, 2);
        m.reserve_cached(SeqId(2), 7, 8, &b, 2).unwrap();
        m.release_caching(SeqId(2), &b, 2);
        assert_eq!(m.cached_pages(), 2);
        assert_eq!(m.cached_prefix(7, &b, 2), 2);
        assert_eq!(m.cached_prefix(7, &a, 2), 0);
    }

    #[test]
    fn a_planted_tag_mismatch_fails_the_hit_and_evicts_the_page() {
        let mut m = manager(4);
        let toks: Vec<u32> = (0..8).collect();
        let chain = keys(1, &toks);
        m.reserve_cached(SeqId(1), 7, 8, &chain, 2).unwrap();
        m.release_caching(SeqId(1), &chain, 2);
        let page = m.cache.get(&chain[0]).unwrap().r.page;
        let mut forged = m.pool().tags()[page as usize];
        forged.tenant = 8;
        m.pool.set_tag_for_test(page, forged);
        let e = m.reserve_cached(SeqId(2), 7, 8, &chain, 2).unwrap_err();
        assert!(
            matches!(e, ReserveError::Integrity(ie) if ie.page == page && ie.found.tenant == 8)
        );
        assert!(m.table(SeqId(2)).is_none(), "nothing reserved");
        assert_eq!(m.cached_prefix(7, &chain, 2), 0, "the entry is gone");
        assert!(!m.pool().is_cached(page));
        assert_eq!(m.pool().free_pages(), 3);
        m.clear_cache();
        assert_eq!(m.pool().free_pages(), 4);
    }

    #[test]
    fn a_tenant_purge_frees_its_cached_pages_poisons_the_read_ones_and_spares_others() {
        let mut m = manager(8);
        let (a, b) = (
            keys(1, &(0..8).collect::<Vec<u32>>()),
            keys(2, &(0..8).collect::<Vec<u32>>()),
        );
        for (seq, tenant, chain) in [(1, 7, &a), (2, 8, &b)] {
            m.reserve_cached(SeqId(seq), tenant, 8, chain, 2).unwrap();
            m.release_caching(SeqId(seq), chain, 2);
        }
        // Tenant 7 reads its first page again (pinned while the sequence runs) and
        // computes a second one.
        assert_eq!(m.reserve_cached(SeqId(3), 7, 8, &a, 1).unwrap(), 1);
        let pinned = m.table(SeqId(3)).unwrap()[0];
        let freed_page = m.cache.get(&a[1]).unwrap().r;
        assert_eq!((m.tenant_cached_pages(7), m.tenant_cached_pages(8)), (2, 2));
        let free_before = m.pool().free_pages();

        let purge = m.purge_tenant_cache(7);
        assert_eq!(
            purge,
            CachePurge {
                freed: 1,
                poisoned: 1
            }
        );
        assert_eq!(m.pool().free_pages(), free_before + 1);
        // The freed page left the cache with a new epoch; the pinned one is never hit.
        assert!(!m.pool().is_cached(freed_page.page));
        assert_ne!(
            m.pool().tags()[freed_page.page as usize].epoch,
            freed_page.tag.epoch
        );
        assert_eq!(m.cached_prefix(7, &a, 2), 0);
        assert_eq!(
            m.tenant_cached_pages(7),
            1,
            "read by sequence 3 until it ends"
        );
        assert_eq!(
            m.cached_prefix(8, &b, 2),
            2,
            "the other tenant keeps its cache"
        );
        // Its own second page is not cached at its end: the page before it in the
        // chain is poisoned, so no lookup could reach it.
        assert_eq!(m.release_caching(SeqId(3), &a, 2), 1);
        assert_eq!(m.tenant_cached_pages(7), 0);
        assert!(!m.pool().is_cached(pinned.page));
        assert_eq!(m.purge_tenant_cache(7), CachePurge::default());
        assert_eq!(m.tenant_cached_pages(8), 2);
    }

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
