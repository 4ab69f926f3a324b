//! KvManager's unit tests: reservations, the prefix cache, purges (the lower
//! tiers' tests are in `spill.rs`).

use super::*;

/// A manager over `pages` pages of 4 tokens (one layer, one head of 8).
pub(super) fn manager(pages: usize) -> KvManager {
    let layout = KvLayout {
        layers: 1,
        page_size: 4,
        kv_heads: 1,
        head_dim: 8,
    };
    KvManager::new(PagePool::new(layout, pages, false))
}

/// The chain of `toks` in namespace `[ns; 32]` (4-token pages).
pub(super) fn keys(ns: u8, toks: &[u32]) -> Vec<ChainHash> {
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
    assert!(matches!(e, ReserveError::Integrity(ie) if ie.page == page && ie.found.tenant == 8));
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
    assert_eq!(
        (m.tenant_cache_pages(7).pool, m.tenant_cache_pages(8).pool),
        (2, 2)
    );
    let free_before = m.pool().free_pages();

    let purge = m.purge_tenant_cache(7);
    assert_eq!(
        purge,
        CachePurge {
            freed: 1,
            poisoned: 1,
            ..CachePurge::default()
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
        m.tenant_cache_pages(7).pool,
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
    assert_eq!(m.tenant_cache_pages(7).pool, 0);
    assert!(!m.pool().is_cached(pinned.page));
    assert_eq!(m.purge_tenant_cache(7), CachePurge::default());
    assert_eq!(m.tenant_cache_pages(8).pool, 2);
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
