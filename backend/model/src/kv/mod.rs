//! KV cache memory in two layers (STYLE.md habit 3): [`pool`] owns pages, tags and
//! the free list; [`KvManager`] owns per-sequence block tables and the
//! [`prefix`] cache's index, and reserves or refuses. The scheduler only talks to the
//! manager.

pub mod pool;
pub mod prefix;
pub mod spill;

pub use pool::{PagePool, PoolError};
use prefix::{cache_seq, ChainHash, PrefixIndex};
use spill::{SpillConfig, SpillDirError, SpillStats, SpillTiers, Tier};
use std::collections::HashMap;
use std::time::{Duration, Instant};
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

/// What [`KvManager::purge_tenant_cache`] did: pages freed at once, pages still
/// read by a running sequence, poisoned and freed when it ends, and spilled pages
/// dropped from the lower tiers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CachePurge {
    /// Cached pages returned to the free list.
    pub freed: usize,
    /// Cached pages a running sequence reads: never hit again, freed at its end.
    pub poisoned: usize,
    /// Spilled pages dropped from host memory.
    pub host: usize,
    /// Spilled pages dropped from disk (unreadable from the purge on: their key
    /// generation is forgotten before the files are deleted).
    pub disk: usize,
}

impl CachePurge {
    /// The sum of two purges' counts (a purge over several engines).
    pub fn plus(self, o: CachePurge) -> CachePurge {
        CachePurge {
            freed: self.freed.saturating_add(o.freed),
            poisoned: self.poisoned.saturating_add(o.poisoned),
            host: self.host.saturating_add(o.host),
            disk: self.disk.saturating_add(o.disk),
        }
    }
}

/// A tenant's own bounds on what one engine keeps cached of it (its cache policy,
/// carried by its requests): `None` for no bound of its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheBounds {
    /// Most pool pages its cache entries hold (past it its least recently used are
    /// dropped, not spilled).
    pub max_pages: Option<usize>,
    /// Longest a cached page of it may go unused before it is dropped, in the pool
    /// and in the lower tiers ([`KvManager::expire_idle`]).
    pub idle_ttl: Option<Duration>,
}

/// A tenant's cached pages per tier ([`KvManager::tenant_cache_pages`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TierPages {
    /// In the pool's prefix cache (poisoned pages still read included).
    pub pool: usize,
    /// Spilled to host memory.
    pub host: usize,
    /// Spilled to disk, sealed.
    pub disk: usize,
}

impl TierPages {
    /// The sum of two counts (several engines).
    pub fn plus(self, o: TierPages) -> TierPages {
        TierPages {
            pool: self.pool.saturating_add(o.pool),
            host: self.host.saturating_add(o.host),
            disk: self.disk.saturating_add(o.disk),
        }
    }
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
    /// Where evicted cache pages go instead of away (`None`: no lower tiers).
    spill: Option<SpillTiers>,
    /// Tenants' own bounds and the version they were set at (tenants without any
    /// are absent).
    policies: HashMap<u64, (u64, CacheBounds)>,
    /// Purges per tenant so far, and the count each live sequence was reserved
    /// at: a sequence that outlived its tenant's purge caches nothing at its end.
    purges: HashMap<u64, u64>,
    reserved_at: HashMap<SeqId, u64>,
}

/// Most disk pages one reservation or release writes or reads: past it evicted
/// pages are dropped and spilled ones left for the sequence to compute, so one
/// request's disk work stays bounded (about 64 x 0.3-0.5 ms) on the engine thread.
pub const MAX_DISK_PAGES_PER_CALL: usize = 64;

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
            spill: None,
            policies: HashMap::new(),
            purges: HashMap::new(),
            reserved_at: HashMap::new(),
        }
    }

    /// Sets `tenant`'s own bounds on its cached pages here, unless bounds of a
    /// later `version` were set (requests in flight carry older ones). A lower
    /// page cap applies from the tenant's next cached page on; an idle time from
    /// the next [`Self::expire_idle`].
    pub fn set_tenant_policy(&mut self, tenant: u64, policy: CacheBounds, version: u64) {
        if self
            .policies
            .get(&tenant)
            .is_some_and(|(v, _)| *v > version)
        {
            return;
        }
        if policy == CacheBounds::default() && version == 0 {
            self.policies.remove(&tenant);
        } else {
            self.policies.insert(tenant, (version, policy));
        }
    }

    fn bounds(&self, tenant: u64) -> Option<&CacheBounds> {
        self.policies.get(&tenant).map(|(_, b)| b)
    }

    /// Whether [`Self::expire_idle`] may have work: pages are cached and a tenant
    /// here has an idle time.
    pub fn has_idle_bounds(&self) -> bool {
        let (host, disk) = self.spilled_pages();
        (self.cache.len() + host + disk > 0)
            && self.policies.values().any(|(_, p)| p.idle_ttl.is_some())
    }

    /// Drops every cached page (pool and lower tiers) whose tenant has an idle time
    /// and that went unused for longer than it at `now`; pages a running sequence
    /// reads are in use, never idle. Returns the pages dropped.
    pub fn expire_idle(&mut self, now: Instant) -> usize {
        if !self.has_idle_bounds() {
            return 0;
        }
        let ttl = |policies: &HashMap<u64, (u64, CacheBounds)>, tenant: u64| {
            policies.get(&tenant).and_then(|(_, p)| p.idle_ttl)
        };
        let idle: Vec<ChainHash> = self
            .cache
            .unpinned()
            .filter(|(_, e)| {
                ttl(&self.policies, e.tenant)
                    .is_some_and(|t| now.saturating_duration_since(e.used) > t)
            })
            .map(|(h, _)| *h)
            .collect();
        for h in &idle {
            self.evict(h);
        }
        let spilled = match &mut self.spill {
            Some(spill) => spill.expire(now, |tenant| ttl(&self.policies, tenant)),
            None => 0,
        };
        idle.len() + spilled
    }

    /// Gives the prefix cache lower tiers of `cfg`'s sizes (none when both are 0):
    /// pages evicted for room spill there and come back on a hit ([`spill`]).
    ///
    /// Errors: the disk tier's directory cannot be created or emptied.
    pub fn set_spill(&mut self, cfg: SpillConfig) -> Result<(), SpillDirError> {
        self.spill = if cfg.host_pages > 0 || (cfg.disk_pages > 0 && cfg.dir.is_some()) {
            Some(SpillTiers::new(cfg)?)
        } else {
            None
        };
        Ok(())
    }

    /// The lower tiers' counts since start (zeros without them).
    pub fn spill_stats(&self) -> SpillStats {
        self.spill.as_ref().map(|s| s.stats).unwrap_or_default()
    }

    /// Pages in the lower tiers now: (host, disk).
    pub fn spilled_pages(&self) -> (usize, usize) {
        self.spill.as_ref().map_or((0, 0), |s| s.pages())
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

    /// How many keys of `chain` from `from` on (up to `max_pages` in all) are
    /// spilled to a lower tier for `tenant`, consecutively: the pages a reservation
    /// would bring back after the `from` pages the pool's cache holds.
    pub fn spilled_prefix(
        &self,
        tenant: u64,
        chain: &[ChainHash],
        from: usize,
        max_pages: usize,
    ) -> usize {
        let Some(spill) = &self.spill else {
            return 0;
        };
        chain
            .iter()
            .take(max_pages)
            .skip(from)
            .take_while(|h| spill.holds(h, tenant))
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
    /// pages) as its first logical blocks and allocating the rest, all or nothing;
    /// the pages after the pool's hits that a lower tier holds are brought back
    /// into the sequence's own fresh pages (a page that no longer opens ends the
    /// restore: the sequence computes it and the rest). Returns the number of
    /// leading pages whose K/V is there (reused plus restored).
    ///
    /// A restored page's tag must be the one the reader derives, as for a hit in
    /// the pool; a mismatch fails the reservation ([`ReserveError::Integrity`]).
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
        self.reserve_cached_by_tier(seq, tenant, tokens, chain, max_hit)
            .map(|t| t.pool + t.host + t.disk)
    }

    /// [`Self::reserve_cached`], counting the leading pages whose K/V is there by
    /// the tier they came from: reused in the pool, restored from host memory or
    /// from disk.
    ///
    /// Errors: as [`Self::reserve_cached`].
    pub fn reserve_cached_by_tier(
        &mut self,
        seq: SeqId,
        tenant: u64,
        tokens: usize,
        chain: &[ChainHash],
        max_hit: usize,
    ) -> Result<TierPages, ReserveError> {
        if self.tables.contains_key(&seq) {
            return Err(PoolError::SeqInUse { seq: seq.0 }.into());
        }
        let total = self.pages_for(tokens);
        let hits = self.cached_prefix(tenant, chain, max_hit.min(total));
        let spilled = self.spilled_prefix(tenant, chain, hits, max_hit.min(total));
        if let Some(spill) = &mut self.spill {
            spill.set_disk_budget(MAX_DISK_PAGES_PER_CALL);
        }
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
        // Out of their tiers before the eviction below spills other pages there.
        let taken = self.take_spilled(tenant, &chain[hits..hits + spilled]);
        while self.pool.free_pages() < need {
            let Some(victim) = self.cache.victim(None) else {
                break;
            };
            self.evict_spilling(&victim);
        }
        let fresh = match self.pool.alloc(tenant, seq.0, hits as u32, need) {
            Ok(f) => f,
            Err(e) => {
                for h in &chain[..hits] {
                    self.unpin(h);
                }
                if let Some(spill) = &mut self.spill {
                    for (h, (tag, bytes, _)) in chain[hits..].iter().zip(taken) {
                        spill.spill(*h, tenant, tag, Instant::now(), &bytes);
                    }
                }
                return Err(e.into());
            }
        };
        let tiers: Vec<Tier> = taken.iter().map(|t| t.2).collect();
        let restored = match self.restore(tenant, &chain[hits..], taken, hits, &fresh) {
            Ok(n) => n,
            Err(e) => {
                for r in fresh {
                    self.pool.free(r).expect("just allocated");
                }
                for h in &chain[..hits] {
                    self.unpin(h);
                }
                return Err(e);
            }
        };
        refs.extend(fresh);
        self.tables.insert(seq, refs);
        self.owners.insert(seq, tenant);
        let purges = self.purges.get(&tenant).copied().unwrap_or(0);
        self.reserved_at.insert(seq, purges);
        if hits > 0 {
            self.pinned.insert(seq, chain[..hits].to_vec());
        }
        let host = tiers[..restored]
            .iter()
            .filter(|t| **t == Tier::Host)
            .count();
        Ok(TierPages {
            pool: hits,
            host,
            disk: restored - host,
        })
    }

    /// Takes the spilled pages of `keys` out of their tiers, in order, up to the
    /// first that is gone or does not open: each page's spilled tag and bytes.
    fn take_spilled(&mut self, tenant: u64, keys: &[ChainHash]) -> Vec<(PageTag, Vec<u8>, Tier)> {
        let Some(spill) = &mut self.spill else {
            return Vec::new();
        };
        let mut disk_reads = 0;
        let mut taken = Vec::new();
        for h in keys {
            if spill.tier_of(h) == Some(Tier::Disk) {
                if disk_reads == MAX_DISK_PAGES_PER_CALL {
                    break; // the rest is computed: this call's disk work is bounded
                }
                disk_reads += 1;
            }
            match spill.take(h, tenant) {
                Some(t) => taken.push(t),
                None => break,
            }
        }
        taken
    }

    /// Copies `taken` (the spilled pages of `keys`, logical blocks `first..`) into
    /// the sequence's fresh pages `into`, in order, after checking each page's
    /// spilled tag against `(tenant, cache_seq(key), its epoch, block)`. Returns how
    /// many came back.
    fn restore(
        &mut self,
        tenant: u64,
        keys: &[ChainHash],
        taken: Vec<(PageTag, Vec<u8>, Tier)>,
        first: usize,
        into: &[BlockRef],
    ) -> Result<usize, ReserveError> {
        let n = taken.len();
        for (j, ((h, r), (tag, bytes, _))) in keys.iter().zip(into).zip(taken).enumerate() {
            let block = (first + j) as u32;
            let expected = PageTag {
                tenant,
                seq: cache_seq(h),
                epoch: tag.epoch,
                logical_block: block,
            };
            if tag != expected {
                return Err(ReserveError::Integrity(IntegrityError {
                    page: r.page,
                    logical_block: block,
                    expected,
                    found: tag,
                }));
            }
            let page = self.pool.page_data_mut(*r).expect("a page just allocated");
            if bytes.len() != page.len() {
                tracing::error!(
                    len = bytes.len(),
                    "a spilled page has the wrong size; dropped"
                );
                return Ok(j);
            }
            page.copy_from_slice(&bytes);
        }
        Ok(n)
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
        if let Some(spill) = &mut self.spill {
            spill.set_disk_budget(MAX_DISK_PAGES_PER_CALL);
        }
        // Its tenant's cache was purged while it ran: nothing it holds is cached
        // again (pages it restored or computed from before the purge included).
        let reserved_at = self.reserved_at.remove(&seq).unwrap_or(0);
        if self.purges.get(&tenant).copied().unwrap_or(0) != reserved_at {
            keep = 0;
        }
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
            // Over the engine's share its oldest spill (room for others); over its
            // own cap they are dropped (it asked for no more).
            let own = self
                .bounds(tenant)
                .and_then(|p| p.max_pages)
                .unwrap_or(usize::MAX);
            let cap = self.tenant_cache_pages.min(own);
            while self.cache.tenant_pages(tenant) >= cap {
                match self.cache.victim(Some(tenant)) {
                    // Its pages of this chain, cached just now: the chain ends here
                    // (a deeper page is useless without them).
                    Some(v) if chain[..i].contains(&v) => break,
                    Some(v) if self.cache.tenant_pages(tenant) >= own => self.evict(&v),
                    Some(v) => self.evict_spilling(&v),
                    None => break,
                }
            }
            if self.cache.tenant_pages(tenant) >= cap {
                break;
            }
            match self
                .pool
                .move_to_cache(refs[i], tenant, cache_seq(h), i as u32)
            {
                Ok(r) => {
                    self.cache.insert(*h, r, tenant);
                    if let Some(spill) = &mut self.spill {
                        spill.forget(h); // one copy per key, in the highest tier
                    }
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

    /// Evicts `h` for room: its page spills to a lower tier (when there is one)
    /// with the tag the cache gave it, then is freed.
    fn evict_spilling(&mut self, h: &ChainHash) {
        let Some(e) = self.cache.remove(h) else {
            return;
        };
        // A tenant with its own cap asked to keep no more than that: dropped.
        let capped = self.bounds(e.tenant).is_some_and(|b| b.max_pages.is_some());
        if let (Some(spill), Some(bytes), false) =
            (&mut self.spill, self.pool.page_data(e.r), capped)
        {
            spill.spill(*h, e.tenant, e.r.tag, e.used, bytes);
        }
        self.free_cached_page(e.r.page);
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
    /// sequences end) and every spilled page. Returns the pool pages freed.
    pub fn clear_cache(&mut self) -> usize {
        if let Some(spill) = &mut self.spill {
            spill.clear();
        }
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
    /// ends. Its spilled pages go too, the disk tier's unreadable from the start
    /// of the purge (their key is forgotten first). Other tenants' pages are
    /// untouched. Returns the counts.
    pub fn purge_tenant_cache(&mut self, tenant: u64) -> CachePurge {
        *self.purges.entry(tenant).or_default() += 1;
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
        if let Some(spill) = &mut self.spill {
            (purge.host, purge.disk) = spill.purge_tenant(tenant);
        }
        purge
    }

    /// Cached pages `tenant` has now, per tier (in the pool, poisoned ones still
    /// read by a running sequence included).
    pub fn tenant_cache_pages(&self, tenant: u64) -> TierPages {
        let (host, disk) = self
            .spill
            .as_ref()
            .map_or((0, 0), |s| s.tenant_pages(tenant));
        TierPages {
            pool: self.cache.tenant_pages(tenant),
            host,
            disk,
        }
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
mod tests;
