//! The tenant-scoped prefix cache's index (DESIGN.md I7): full prompt pages kept after
//! their request ended, found again by a hash chain.
//!
//! Keys: page `i` of a prompt is keyed by `h_i = SHA-256(h_{i-1} || tokens of page i)`
//! with `h_{-1} = SHA-256(domain || namespace || model || page size)`. The namespace is
//! derived by the server from the account and a per-tenant salt (never from the
//! request), so two tenants never share a key and rotating the salt orphans every
//! old entry. A key names a whole prefix: page `i` is found only if pages `0..i` are.
//!
//! Pages: a cached page is held by the cache ([`PagePool::move_to_cache`]) with the
//! tag `(tenant, cache_seq(h_i), epoch, i)`. A hit is used only after the page's tag
//! equals what the reader derives itself from its own tenant and key (I3, in
//! [`KvManager::reserve_cached`](super::KvManager::reserve_cached)); attention checks
//! the same tag on every read. Sequences that reuse a page pin it (a reference count);
//! an unpinned page is evictable, least recently used first, and never counted as
//! free. One tenant's entries hold at most a configured share of the pool.
//!
//! [`PagePool::move_to_cache`]: super::PagePool::move_to_cache

use sha2::{Digest, Sha256};
use std::collections::{BTreeMap, HashMap};
use std::time::Instant;
use tessera_kernels::BlockRef;

/// A prefix key: the hash chain value of one full page of a prompt.
pub type ChainHash = [u8; 32];

/// Where a prompt's chain starts: the cache namespace (32 bytes, derived by the
/// server), the model's fingerprint and the page size.
pub fn chain_root(namespace: &[u8; 32], model: &[u8; 32], page_size: usize) -> ChainHash {
    let mut h = Sha256::new();
    h.update(b"tessera.prefix-cache.v1\0");
    h.update(namespace);
    h.update(model);
    h.update((page_size as u64).to_le_bytes());
    h.finalize().into()
}

/// The root of a chain computed under LoRA fine-tune `id` from the base `root`: KV
/// computed under an adapter is not the base model's, so its pages get keys (and
/// cache tags, [`cache_seq`]) of their own; the base, another adapter or another
/// tenant never hit them.
pub fn lora_root(root: &ChainHash, id: &str) -> ChainHash {
    let mut h = Sha256::new();
    h.update(b"tessera.prefix-cache.lora.v1\0");
    h.update(root);
    h.update((id.len() as u64).to_le_bytes());
    h.update(id.as_bytes());
    h.finalize().into()
}

/// The chain of `tokens`' full pages of `page_size` tokens from `root`: one key per
/// full page, in order (a partial last page has none).
pub fn chain(root: &ChainHash, tokens: &[u32], page_size: usize) -> Vec<ChainHash> {
    let mut prev = *root;
    tokens
        .chunks_exact(page_size)
        .map(|page| {
            let mut h = Sha256::new();
            h.update(prev);
            for t in page {
                h.update(t.to_le_bytes());
            }
            prev = h.finalize().into();
            prev
        })
        .collect()
}

/// The `seq` field of a cached page's tag: the first 8 bytes of its key.
pub fn cache_seq(h: &ChainHash) -> u64 {
    u64::from_le_bytes(h[..8].try_into().expect("8 bytes"))
}

/// One cached page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Entry {
    /// The page and the tag the cache gave it.
    pub(crate) r: BlockRef,
    /// Owner (the tenant whose namespace the key is in).
    pub(crate) tenant: u64,
    /// Sequences using the page now.
    pub(crate) refs: u32,
    /// Last use (position in the LRU order while unpinned).
    tick: u64,
    /// When it was last used (cached, reused or let go of): its idle time counts
    /// from here.
    pub(crate) used: Instant,
    /// Failed a tag check: never hit again, freed once unpinned.
    pub(crate) poisoned: bool,
}

/// The index: key -> page, reference counts, LRU order of unpinned entries, and
/// per-tenant page counts.
#[derive(Debug, Default)]
pub(crate) struct PrefixIndex {
    entries: HashMap<ChainHash, Entry>,
    /// Unpinned entries by last use, oldest first.
    lru: BTreeMap<u64, ChainHash>,
    per_tenant: HashMap<u64, usize>,
    tick: u64,
}

impl PrefixIndex {
    fn next_tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    /// The entry for `h`, unless poisoned.
    pub(crate) fn get(&self, h: &ChainHash) -> Option<&Entry> {
        self.entries.get(h).filter(|e| !e.poisoned)
    }

    /// Whether any entry (poisoned or not) holds key `h`.
    pub(crate) fn contains(&self, h: &ChainHash) -> bool {
        self.entries.contains_key(h)
    }

    /// Pages `tenant`'s entries hold.
    pub(crate) fn tenant_pages(&self, tenant: u64) -> usize {
        self.per_tenant.get(&tenant).copied().unwrap_or(0)
    }

    /// Unpinned entries (evictable pages).
    pub(crate) fn evictable(&self) -> usize {
        self.lru.len()
    }

    /// Entries (cached pages).
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// Adds an unpinned entry for `h` (the caller checked `h` is absent).
    pub(crate) fn insert(&mut self, h: ChainHash, r: BlockRef, tenant: u64) {
        let tick = self.next_tick();
        self.entries.insert(
            h,
            Entry {
                r,
                tenant,
                refs: 0,
                tick,
                used: Instant::now(),
                poisoned: false,
            },
        );
        self.lru.insert(tick, h);
        *self.per_tenant.entry(tenant).or_default() += 1;
    }

    /// Removes `h`'s entry, pinned or not; returns it.
    pub(crate) fn remove(&mut self, h: &ChainHash) -> Option<Entry> {
        let e = self.entries.remove(h)?;
        if e.refs == 0 {
            self.lru.remove(&e.tick);
        }
        if let Some(n) = self.per_tenant.get_mut(&e.tenant) {
            *n -= 1;
            if *n == 0 {
                self.per_tenant.remove(&e.tenant);
            }
        }
        Some(e)
    }

    /// One more sequence uses `h`'s page (it leaves the LRU order).
    pub(crate) fn pin(&mut self, h: &ChainHash) {
        if let Some(e) = self.entries.get_mut(h) {
            if e.refs == 0 {
                self.lru.remove(&e.tick);
            }
            e.refs += 1;
        }
    }

    /// One sequence less uses `h`'s page. Returns the entry when that was the last
    /// user of a poisoned entry (removed now: the caller frees its page).
    pub(crate) fn unpin(&mut self, h: &ChainHash) -> Option<Entry> {
        let e = self.entries.get_mut(h)?;
        e.refs = e.refs.saturating_sub(1);
        if e.refs > 0 {
            return None;
        }
        if e.poisoned {
            return self.remove(h);
        }
        self.tick += 1;
        e.tick = self.tick;
        e.used = Instant::now();
        self.lru.insert(self.tick, *h);
        None
    }

    /// Marks `h` used now (unpinned entries move to the young end of the LRU order).
    pub(crate) fn touch(&mut self, h: &ChainHash) {
        let tick = self.next_tick();
        if let Some(e) = self.entries.get_mut(h) {
            if e.refs == 0 {
                self.lru.remove(&e.tick);
                self.lru.insert(tick, *h);
            }
            e.tick = tick;
            e.used = Instant::now();
        }
    }

    /// Never hit `h` again. Returns the entry if nobody uses it (removed now: the
    /// caller frees its page); a pinned one is removed at its last unpin.
    pub(crate) fn poison(&mut self, h: &ChainHash) -> Option<Entry> {
        let e = self.entries.get_mut(h)?;
        e.poisoned = true;
        if e.refs == 0 {
            return self.remove(h);
        }
        None
    }

    /// The keys of `tenant`'s entries that are not poisoned.
    pub(crate) fn live_keys_of(&self, tenant: u64) -> Vec<ChainHash> {
        self.entries
            .iter()
            .filter(|(_, e)| e.tenant == tenant && !e.poisoned)
            .map(|(h, _)| *h)
            .collect()
    }

    /// The unpinned keys, least recently used first, with their entries.
    pub(crate) fn unpinned(&self) -> impl Iterator<Item = (&ChainHash, &Entry)> {
        self.lru.values().map(|h| (h, &self.entries[h]))
    }

    /// The least recently used unpinned key, of `tenant` if given.
    pub(crate) fn victim(&self, tenant: Option<u64>) -> Option<ChainHash> {
        self.lru
            .values()
            .find(|h| tenant.is_none_or(|t| self.entries[*h].tenant == t))
            .copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_kernels::PageTag;

    fn r(page: u32) -> BlockRef {
        BlockRef {
            page,
            tag: PageTag::default(),
        }
    }

    #[test]
    fn keys_depend_on_namespace_model_and_every_earlier_token() {
        let (ns_a, ns_b, model) = ([1u8; 32], [2u8; 32], [9u8; 32]);
        let toks: Vec<u32> = (0..40).collect();
        let a = chain(&chain_root(&ns_a, &model, 16), &toks, 16);
        assert_eq!(a.len(), 2, "two full pages of 16, the rest has no key");
        let b = chain(&chain_root(&ns_b, &model, 16), &toks, 16);
        assert!(
            a.iter().zip(&b).all(|(x, y)| x != y),
            "namespaces never meet"
        );
        let other_model = chain(&chain_root(&ns_a, &[8u8; 32], 16), &toks, 16);
        assert_ne!(a[0], other_model[0]);
        let mut changed = toks.clone();
        changed[3] = 999;
        let c = chain(&chain_root(&ns_a, &model, 16), &changed, 16);
        assert_ne!(a[0], c[0]);
        assert_ne!(a[1], c[1], "a change in page 0 changes every later key");
        let mut late = toks.clone();
        late[20] = 999;
        let d = chain(&chain_root(&ns_a, &model, 16), &late, 16);
        assert_eq!((a[0], a[1] != d[1]), (d[0], true));
    }

    #[test]
    fn unpinned_entries_are_evicted_oldest_first_and_pinned_ones_never() {
        let mut ix = PrefixIndex::default();
        let (h1, h2, h3) = ([1u8; 32], [2u8; 32], [3u8; 32]);
        ix.insert(h1, r(1), 7);
        ix.insert(h2, r(2), 7);
        ix.insert(h3, r(3), 8);
        assert_eq!((ix.evictable(), ix.tenant_pages(7)), (3, 2));
        assert_eq!(ix.victim(None), Some(h1));
        ix.pin(&h1);
        assert_eq!(ix.victim(None), Some(h2));
        assert_eq!(ix.victim(Some(8)), Some(h3));
        ix.touch(&h2);
        assert_eq!(ix.victim(None), Some(h3));
        assert_eq!(ix.unpin(&h1), None);
        // h1 was used last: h3 then h2 then h1.
        assert_eq!(ix.victim(None), Some(h3));
        ix.remove(&h3);
        assert_eq!(ix.victim(None), Some(h2));
        assert_eq!((ix.len(), ix.tenant_pages(8)), (2, 0));
    }

    #[test]
    fn a_poisoned_entry_is_never_hit_and_goes_when_its_last_user_does() {
        let mut ix = PrefixIndex::default();
        let h = [5u8; 32];
        ix.insert(h, r(4), 1);
        ix.pin(&h);
        ix.pin(&h);
        assert_eq!(ix.poison(&h), None, "pinned: stays until unpinned");
        assert!(ix.get(&h).is_none() && ix.contains(&h));
        assert_eq!(ix.evictable(), 0);
        assert_eq!(ix.unpin(&h), None);
        assert_eq!(ix.unpin(&h).map(|e| e.r.page), Some(4));
        assert!(!ix.contains(&h));
        let h2 = [6u8; 32];
        ix.insert(h2, r(5), 1);
        assert_eq!(ix.poison(&h2).map(|e| e.r.page), Some(5));
        assert_eq!(ix.len(), 0);
    }
}
