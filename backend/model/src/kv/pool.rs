//! The KV page pool: fixed pages allocated once, a free list, per-page tags and
//! epochs (DESIGN.md §5). Only this module touches the free list.
//!
//! A held page is owned either by a sequence (its tag names the sequence) or by the
//! prefix cache ([`PagePool::move_to_cache`]: its tag names the cache entry, and a
//! per-page flag says the cache owns it). Cached pages are never on the free list and
//! never counted as free; sequence frees ([`PagePool::free_owned_by`]) skip them.

use tessera_kernels::{BlockRef, KvLayout, PageTag};

/// Errors from the page pool.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolError {
    /// Not enough free pages for an allocation (nothing was allocated).
    #[error("KV pool has {free} free pages, {wanted} needed")]
    Exhausted {
        /// Free pages now.
        free: usize,
        /// Pages requested.
        wanted: usize,
    },
    /// The sequence already holds pages (a duplicate id; nothing was allocated).
    #[error("sequence {seq} already holds pages")]
    SeqInUse {
        /// The sequence id.
        seq: u64,
    },
    /// A free named a page whose tag is not the caller's (double or stale free).
    #[error("page {page} is not held with tag {expected:?} (found {found:?})")]
    NotHeld {
        /// Physical page.
        page: u32,
        /// Tag the caller claimed.
        expected: PageTag,
        /// Tag in the pool.
        found: PageTag,
    },
}

/// Fixed-size pool of KV pages with owner tags.
///
/// Memory: `pages * layout.page_bytes()` bytes (16-bit K and 8-bit V with per-token scales,
/// see [`KvLayout`]), allocated once at start.
/// Allocation writes the owner's tag into the page; free bumps the page's epoch and
/// clears the tag, so any block-table entry made before the free stops validating.
#[derive(Debug)]
pub struct PagePool {
    layout: KvLayout,
    data: Vec<u8>,
    tags: Vec<PageTag>,
    epochs: Vec<u32>,
    free: Vec<u32>,
    held: Vec<bool>,
    /// Held by the prefix cache rather than by a sequence.
    cached: Vec<bool>,
    cached_count: usize,
    scrub_on_free: bool,
}

impl PagePool {
    /// A pool of `pages` pages of `layout`; `scrub_on_free` zeroes freed pages
    /// (off by default: tags make it unnecessary for correctness).
    pub fn new(layout: KvLayout, pages: usize, scrub_on_free: bool) -> Self {
        Self {
            layout,
            data: vec![0; pages * layout.page_bytes()],
            tags: vec![PageTag::default(); pages],
            epochs: vec![0; pages],
            // Reversed so that page 0 is handed out first.
            free: (0..pages as u32).rev().collect(),
            held: vec![false; pages],
            cached: vec![false; pages],
            cached_count: 0,
            scrub_on_free,
        }
    }

    /// Page shape.
    pub fn layout(&self) -> &KvLayout {
        &self.layout
    }

    /// Total pages.
    pub fn capacity(&self) -> usize {
        self.tags.len()
    }

    /// Total token slots (`capacity * page_size`).
    pub fn capacity_tokens(&self) -> usize {
        self.capacity() * self.layout.page_size
    }

    /// Pages on the free list.
    pub fn free_pages(&self) -> usize {
        self.free.len()
    }

    /// Allocates `n` pages for logical blocks `first_block..first_block + n` of
    /// `(tenant, seq)`, all or nothing. Returns their block-table entries.
    pub fn alloc(
        &mut self,
        tenant: u64,
        seq: u64,
        first_block: u32,
        n: usize,
    ) -> Result<Vec<BlockRef>, PoolError> {
        if n > self.free.len() {
            return Err(PoolError::Exhausted {
                free: self.free.len(),
                wanted: n,
            });
        }
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let page = self.free.pop().expect("checked above");
            let tag = PageTag {
                tenant,
                seq,
                epoch: self.epochs[page as usize],
                logical_block: first_block + i as u32,
            };
            self.tags[page as usize] = tag;
            self.held[page as usize] = true;
            out.push(BlockRef { page, tag });
        }
        Ok(out)
    }

    /// Returns a page to the free list. The caller's tag must match the page's.
    pub fn free(&mut self, r: BlockRef) -> Result<(), PoolError> {
        let p = r.page as usize;
        let found = self.tags.get(p).copied().unwrap_or_default();
        if p >= self.tags.len() || found != r.tag || !self.held[p] {
            return Err(PoolError::NotHeld {
                page: r.page,
                expected: r.tag,
                found,
            });
        }
        self.epochs[p] = self.epochs[p].wrapping_add(1);
        self.tags[p] = PageTag {
            epoch: self.epochs[p],
            ..PageTag::default()
        };
        if self.scrub_on_free {
            let n = self.layout.page_bytes();
            self.data[p * n..(p + 1) * n].fill(0);
        }
        self.held[p] = false;
        if std::mem::take(&mut self.cached[p]) {
            self.cached_count -= 1;
        }
        self.free.push(r.page);
        Ok(())
    }

    /// Hands held page `r` (tag `r.tag`, owned by a sequence) to the prefix cache:
    /// bumps its epoch (every reference the sequence held stops validating), tags it
    /// `(tenant, cache_seq, new epoch, logical_block)` and marks it cached. Returns
    /// the cache's reference to it. The page's data is unchanged.
    ///
    /// Errors: [`PoolError::NotHeld`] when the page is not held with `r.tag` or is
    /// already cached.
    pub fn move_to_cache(
        &mut self,
        r: BlockRef,
        tenant: u64,
        cache_seq: u64,
        logical_block: u32,
    ) -> Result<BlockRef, PoolError> {
        let p = r.page as usize;
        if !self.holds(r) || self.cached[p] {
            return Err(PoolError::NotHeld {
                page: r.page,
                expected: r.tag,
                found: self.tags.get(p).copied().unwrap_or_default(),
            });
        }
        self.epochs[p] = self.epochs[p].wrapping_add(1);
        let tag = PageTag {
            tenant,
            seq: cache_seq,
            epoch: self.epochs[p],
            logical_block,
        };
        self.tags[p] = tag;
        self.cached[p] = true;
        self.cached_count += 1;
        Ok(BlockRef { page: r.page, tag })
    }

    /// Whether the prefix cache owns `page`.
    pub fn is_cached(&self, page: u32) -> bool {
        self.cached.get(page as usize).copied().unwrap_or(false)
    }

    /// Pages the prefix cache owns (held, not free).
    pub fn cached_pages(&self) -> usize {
        self.cached_count
    }

    /// Overwrites a page's tag in place, for fault-injection tests only (a planted
    /// tag mismatch).
    #[doc(hidden)]
    pub fn set_tag_for_test(&mut self, page: u32, tag: PageTag) {
        self.tags[page as usize] = tag;
    }

    /// Frees every page tagged as owned by sequence `(tenant, seq)`, whatever any
    /// block table says (pages the prefix cache owns are never a sequence's). Returns
    /// the number freed. `O(capacity)`.
    pub fn free_owned_by(&mut self, tenant: u64, seq: u64) -> usize {
        let owned: Vec<BlockRef> = self
            .tags
            .iter()
            .enumerate()
            .filter(|(p, t)| {
                self.held[*p] && !self.cached[*p] && t.tenant == tenant && t.seq == seq
            })
            .map(|(p, t)| BlockRef {
                page: p as u32,
                tag: *t,
            })
            .collect();
        for r in &owned {
            self.free(*r).expect("tag read from the pool itself");
        }
        owned.len()
    }

    /// The tag array, indexed by physical page.
    pub fn tags(&self) -> &[PageTag] {
        &self.tags
    }

    /// All page data (read side of the attention kernel).
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// Mutable page data and the tags, for writers that must check tags first.
    pub fn data_and_tags_mut(&mut self) -> (&mut [u8], &[PageTag]) {
        (&mut self.data, &self.tags)
    }

    /// Whether page `r.page` is allocated and carries exactly `r.tag` (a reference
    /// taken before a free never does: the epoch moved on).
    pub fn holds(&self, r: BlockRef) -> bool {
        let p = r.page as usize;
        p < self.tags.len() && self.held[p] && self.tags[p] == r.tag
    }

    /// The `layout.page_bytes()` bytes of `page`, if it holds `r`'s tag.
    pub fn page_data(&self, r: BlockRef) -> Option<&[u8]> {
        let n = self.layout.page_bytes();
        let p = r.page as usize;
        self.holds(r).then(|| &self.data[p * n..(p + 1) * n])
    }

    /// Mutable bytes of `page`, if it holds `r`'s tag.
    pub fn page_data_mut(&mut self, r: BlockRef) -> Option<&mut [u8]> {
        let n = self.layout.page_bytes();
        let p = r.page as usize;
        if !self.holds(r) {
            return None;
        }
        Some(&mut self.data[p * n..(p + 1) * n])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn layout() -> KvLayout {
        KvLayout {
            layers: 1,
            page_size: 4,
            kv_heads: 1,
            head_dim: 32,
        }
    }

    #[test]
    fn exhaustion_allocates_nothing() {
        let mut p = PagePool::new(layout(), 3, false);
        let _held = p.alloc(1, 1, 0, 2).unwrap();
        assert_eq!(
            p.alloc(1, 2, 0, 2).unwrap_err(),
            PoolError::Exhausted { free: 1, wanted: 2 }
        );
        assert_eq!(p.free_pages(), 1);
    }

    #[test]
    fn double_free_and_stale_free_are_rejected() {
        let mut p = PagePool::new(layout(), 2, false);
        let r = p.alloc(1, 1, 0, 1).unwrap()[0];
        p.free(r).unwrap();
        assert!(matches!(p.free(r), Err(PoolError::NotHeld { .. })));
        // Reallocated page: the old ref is stale by epoch.
        let r2 = p.alloc(1, 1, 0, 2).unwrap();
        assert!(r2
            .iter()
            .any(|x| x.page == r.page && x.tag.epoch != r.tag.epoch));
        assert!(p.free(r).is_err());
        assert_eq!(p.free_pages(), 0);
    }

    #[test]
    fn a_page_moved_to_the_cache_leaves_its_sequence_and_is_never_free() {
        let mut p = PagePool::new(layout(), 3, false);
        let refs = p.alloc(7, 1, 0, 2).unwrap();
        let c = p.move_to_cache(refs[0], 7, 99, 0).unwrap();
        // The sequence's reference is stale (new epoch), the cache's holds.
        assert!(!p.holds(refs[0]));
        assert!(p.holds(c));
        assert_eq!((c.tag.tenant, c.tag.seq, c.tag.logical_block), (7, 99, 0));
        assert!(p.is_cached(c.page));
        assert_eq!((p.cached_pages(), p.free_pages()), (1, 1));
        // Moving twice, or with a stale tag, is refused.
        assert!(p.move_to_cache(refs[0], 7, 99, 0).is_err());
        assert!(p.move_to_cache(c, 7, 99, 0).is_err());
        // The sequence's free takes its own page only, even if a cache tag named it.
        let imposter = p.move_to_cache(refs[1], 7, 1, 1).unwrap();
        assert_eq!(p.free_owned_by(7, 1), 0);
        p.free(imposter).unwrap();
        p.free(c).unwrap();
        assert_eq!((p.cached_pages(), p.free_pages()), (0, 3));
        assert!(!p.is_cached(c.page));
    }

    #[test]
    fn scrub_zeroes_freed_pages() {
        let mut p = PagePool::new(layout(), 1, true);
        let r = p.alloc(1, 1, 0, 1).unwrap()[0];
        p.data_and_tags_mut().0.fill(1);
        p.free(r).unwrap();
        assert!(p.data().iter().all(|v| *v == 0));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Alloc { seq: u64, n: usize },
        Free { pick: usize },
        Stale { pick: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            (0u64..6, 1usize..4).prop_map(|(seq, n)| Op::Alloc { seq, n }),
            (0usize..64).prop_map(|pick| Op::Free { pick }),
            (0usize..64).prop_map(|pick| Op::Stale { pick }),
        ]
    }

    proptest! {
        /// Random alloc/free/reuse never hands out a held page twice and never
        /// validates a stale tag; the free count is always capacity - held.
        #[test]
        fn pool_never_double_allocates_or_validates_stale_tags(ops in prop::collection::vec(op(), 1..200)) {
            let cap = 8;
            let mut p = PagePool::new(layout(), cap, false);
            let mut held: HashMap<u32, BlockRef> = HashMap::new();
            let mut freed: Vec<BlockRef> = Vec::new();
            for op in ops {
                match op {
                    Op::Alloc { seq, n } => match p.alloc(7, seq, 0, n) {
                        Ok(refs) => {
                            for r in refs {
                                prop_assert!(held.insert(r.page, r).is_none(), "page {} handed out twice", r.page);
                                prop_assert_eq!(p.tags()[r.page as usize], r.tag);
                            }
                        }
                        Err(PoolError::Exhausted { free, wanted }) => {
                            prop_assert_eq!(free, cap - held.len());
                            prop_assert!(wanted > free);
                        }
                        Err(e) => prop_assert!(false, "{e}"),
                    },
                    Op::Free { pick } => {
                        if let Some(&page) = held.keys().nth(pick % held.len().max(1)) {
                            let r = held.remove(&page).unwrap();
                            p.free(r).unwrap();
                            freed.push(r);
                        }
                    }
                    Op::Stale { pick } => {
                        if !freed.is_empty() {
                            let r = freed[pick % freed.len()];
                            // A tag from before a free never matches the pool again.
                            prop_assert_ne!(p.tags()[r.page as usize], r.tag);
                            prop_assert!(p.free(r).is_err());
                        }
                    }
                }
                prop_assert_eq!(p.free_pages(), cap - held.len());
                for r in held.values() {
                    prop_assert_eq!(p.tags()[r.page as usize], r.tag);
                }
            }
        }
    }
}
