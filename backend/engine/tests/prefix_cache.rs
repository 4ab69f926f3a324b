//! The tenant-scoped prefix cache with the real model (DESIGN.md I3, I7): a repeated
//! 1,000-token prompt reuses its pages within a namespace only, gives the same
//! output, computes fewer tokens and answers sooner; another namespace computes
//! exactly what a cold miss computes and answers in a cold miss's time; a planted
//! tag mismatch on a cached page fails that request and evicts the page.

use std::time::Duration;
use tessera_engine::testing::*;
use tessera_engine::{CacheNamespace, Engine, EngineConfig, EngineError, Event};
use tessera_model::kv::spill::SpillConfig;
use tessera_model::kv::TierPages;
use tessera_model::LoadedModel;

const PAGE: usize = 16;

/// A chat prompt of about 1,000 tokens (a long system-style preamble and a short
/// question).
fn long_prompt(m: &LoadedModel) -> Vec<u32> {
    prompt_of(m, 1000)
}

/// A chat prompt of at least `n` tokens.
fn prompt_of(m: &LoadedModel, n: usize) -> Vec<u32> {
    let mut text =
        String::from("You are a careful assistant. Read the notes below, then answer.\n");
    let mut i = 0;
    loop {
        text.push_str(&format!(
            "Note {i}: the warehouse in district {} ships {} crates of pears every {} days.\n",
            i % 7,
            i * 3 + 1,
            i % 5 + 2
        ));
        let p = chat_prompt(
            m,
            &format!("{text}\nQuestion: which district ships the most?"),
        );
        if p.len() >= n {
            return p;
        }
        i += 1;
    }
}

/// Runs one greedy request of `tenant` in namespace `ns` alone on `e`; returns what
/// it received, its cached tokens, its TTFT and the prompt tokens it computed.
fn run(
    e: &mut Engine,
    tenant: u64,
    ns: Option<CacheNamespace>,
    prompt: &[u32],
) -> (Outcome, usize, Duration, u64) {
    let mut req = greedy(prompt.to_vec(), 8);
    req.tenant = tenant;
    req.cache_namespace = ns;
    e.reset_served();
    let mut rx = e.enqueue(e.admit(req).unwrap());
    let mut ttft = None;
    let mut cached = None;
    let mut o = Outcome {
        ids: vec![],
        text: String::new(),
        last: None,
    };
    e.run_to_completion();
    while let Ok(ev) = rx.try_recv() {
        match ev {
            Event::Token { id, text, .. } => {
                o.ids.push(id);
                o.text.push_str(&text);
            }
            Event::Done { reason, mut usage } => {
                ttft = Some(usage.ttft);
                cached = Some(usage.cached_tokens);
                usage.ttft = Duration::ZERO;
                usage.tpot = Duration::ZERO;
                usage.cached_tokens = 0;
                usage.cached_tiers = Default::default();
                o.last = Some(Event::Done { reason, usage });
            }
            ev => o.last = Some(ev),
        }
    }
    let computed = e.served().get(&tenant).map_or(0, |s| s.prefill);
    (
        o,
        cached.unwrap_or(0),
        ttft.unwrap_or(Duration::MAX),
        computed,
    )
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

/// Mann-Whitney U statistic of `a` against `b`, as a z-score (normal approximation,
/// no ties correction): |z| > 3.3 is a difference at p < 0.001.
fn mann_whitney_z(a: &[Duration], b: &[Duration]) -> f64 {
    let (n1, n2) = (a.len() as f64, b.len() as f64);
    let u: f64 = a
        .iter()
        .map(|x| {
            b.iter()
                .map(|y| match x.cmp(y) {
                    std::cmp::Ordering::Greater => 1.0,
                    std::cmp::Ordering::Equal => 0.5,
                    std::cmp::Ordering::Less => 0.0,
                })
                .sum::<f64>()
        })
        .sum();
    let mean = n1 * n2 / 2.0;
    let sd = (n1 * n2 * (n1 + n2 + 1.0) / 12.0).sqrt();
    (u - mean) / sd
}

#[test]
fn a_repeated_prompt_reuses_its_pages_within_its_namespace_only() {
    let m = load();
    let prompt = long_prompt(&m);
    let n = prompt.len();
    let reusable = (n - 1) / PAGE * PAGE;
    let mut e = engine(&m, EngineConfig::default());
    let (a, b) = ([0xA1; 32], [0xB2; 32]);

    let (cold, cached0, _, computed0) = run(&mut e, 1, Some(a), &prompt);
    assert_eq!(
        (cached0, computed0),
        (0, n as u64),
        "first request is a miss"
    );
    assert!(e.kv().cached_pages() >= reusable / PAGE);

    let (warm, cached1, _, computed1) = run(&mut e, 1, Some(a), &prompt);
    assert_eq!(cached1, reusable, "every full page before the last token");
    assert_eq!(
        computed1,
        (n - reusable) as u64,
        "only the tail is computed"
    );
    assert_eq!(warm, cold, "same tokens, text and finish");
    assert!(!cold.ids.is_empty());

    // Another tenant with its own namespace, and the same tenant with no
    // namespace: misses that compute every prompt token, same answer.
    let (other, cached2, _, computed2) = run(&mut e, 2, Some(b), &prompt);
    assert_eq!((cached2, computed2), (0, n as u64));
    assert_eq!(other, cold);
    let (plain, cached3, _, computed3) = run(&mut e, 1, None, &prompt);
    assert_eq!((cached3, computed3, plain), (0, n as u64, cold));
    // A rotated salt is a new namespace: nothing is found.
    let (_, cached4, _, computed4) = run(&mut e, 1, Some([0xA3; 32]), &prompt);
    assert_eq!((cached4, computed4), (0, n as u64));

    // Cached pages are held, never free; dropping them gives the whole pool back.
    let pool = e.kv().pool();
    assert_eq!(
        pool.free_pages() + pool.cached_pages(),
        pool.capacity(),
        "nothing but the cache holds pages at rest"
    );
    e.kv_mut_for_test().clear_cache();
    assert_eq!(e.kv().pool().free_pages(), e.kv().pool().capacity());
}

#[test]
fn a_hit_answers_sooner_and_another_tenant_sees_a_cold_miss_time() {
    // Over 20 tries each, interleaved so that machine load hits every group alike:
    // (hit) tenant 1 repeating its prompt; (other) tenant 2 sending the same prompt
    // in a fresh namespace of its own while tenant 1's pages are cached; (cold) the
    // same prompt on an engine with the prefix cache off, its memory warmed by one
    // run first. "other" and "cold" must be one distribution (no timing channel
    // across tenants); "hit" must be faster. A 300-token prompt keeps the 40 cold
    // prefills affordable on a loaded machine.
    let m = load();
    let prompt = prompt_of(&m, 300);
    let n = prompt.len() as u64;
    let mut e = engine(&m, EngineConfig::default());
    let mut e_cold = engine(
        &m,
        EngineConfig {
            prefix_cache: false,
            ..EngineConfig::default()
        },
    );
    let a = [0xA1; 32];
    run(&mut e, 1, Some(a), &prompt);
    run(&mut e_cold, 3, Some(a), &prompt);
    let (mut hit, mut other, mut cold) = (vec![], vec![], vec![]);
    for i in 0..20u8 {
        let (_, c, t, _) = run(&mut e, 1, Some(a), &prompt);
        assert!(c > 0);
        hit.push(t);
        // Tenant 2's namespace is fresh every try, so its own earlier tries cannot
        // warm it either: each is a cross-tenant probe of tenant 1's prefix.
        let (_, c, t, computed) = run(&mut e, 2, Some([i; 32]), &prompt);
        assert_eq!((c, computed), (0, n), "a probe computes the whole prompt");
        other.push(t);
        let (_, c, t, computed) = run(&mut e_cold, 3, Some(a), &prompt);
        assert_eq!((c, computed), (0, n));
        cold.push(t);
    }
    let z_probe = mann_whitney_z(&other, &cold);
    let z_hit = mann_whitney_z(&hit, &cold);
    eprintln!(
        "TTFT medians over 20: hit {:?}, other tenant {:?}, cold {:?}; \
         Mann-Whitney z: other vs cold {z_probe:.2}, hit vs cold {z_hit:.2}",
        median(hit.clone()),
        median(other.clone()),
        median(cold.clone())
    );
    // The control: the test can tell distributions apart when they differ.
    assert!(
        z_hit < -3.3,
        "a hit must be faster than a cold miss (z {z_hit:.2})"
    );
    assert!(
        z_probe.abs() < 3.3,
        "another tenant's TTFT must not differ from a cold miss (z {z_probe:.2})"
    );
}

#[test]
fn a_planted_tag_mismatch_on_a_cached_page_fails_that_request_and_evicts_the_page() {
    let m = load();
    let prompt = long_prompt(&m);
    let mut e = engine(&m, EngineConfig::default());
    let a = [0xA1; 32];
    let (cold, _, _, _) = run(&mut e, 1, Some(a), &prompt);
    // The cached page of logical block 0: give its tag another tenant.
    let (page, tag) = {
        let pool = e.kv().pool();
        (0..pool.capacity() as u32)
            .filter(|&p| pool.is_cached(p))
            .map(|p| (p, pool.tags()[p as usize]))
            .find(|(_, t)| t.logical_block == 0 && t.tenant == 1)
            .expect("block 0 is cached")
    };
    let mut forged = tag;
    forged.tenant = 2;
    e.kv_mut_for_test()
        .split_mut()
        .0
        .set_tag_for_test(page, forged);
    let (failed, _, _, computed) = run(&mut e, 1, Some(a), &prompt);
    assert!(failed.ids.is_empty(), "no token from a failed tag check");
    assert!(
        matches!(&failed.last, Some(Event::Error(EngineError::Integrity(ie))) if ie.page == page),
        "{:?}",
        failed.last
    );
    assert_eq!(computed, 0, "nothing was computed");
    assert!(!e.kv().pool().is_cached(page), "the page left the cache");
    // The next request misses at block 0, computes everything and is right.
    let (again, cached, _, _) = run(&mut e, 1, Some(a), &prompt);
    assert_eq!((cached, again), (0, cold));
    e.kv_mut_for_test().clear_cache();
    assert_eq!(e.kv().pool().free_pages(), e.kv().pool().capacity());
}

/// An engine whose 1,024-token pool one tenant may fill with cached pages, over a
/// host tier of 8 pages and a disk tier of 256 in `spill_dir`: a ~950-token prompt
/// of another tenant spills most of a ~600-token one through both tiers.
fn tiered_engine(m: &LoadedModel, spill_dir: &std::path::Path) -> Engine {
    engine(
        m,
        EngineConfig {
            kv_pool_tokens: 1024,
            prefix_cache_tenant_share: 100,
            spill: SpillConfig {
                host_pages: 8,
                disk_pages: 256,
                dir: Some(spill_dir.to_path_buf()),
            },
            ..EngineConfig::default()
        },
    )
}

/// Issue 39's lower tiers with the real model: a tenant's prompt pages, evicted for
/// room, spill to host memory and sealed disk files and come back on its next
/// request (same answer, only the tail computed); another tenant sending the same
/// prompt gets none of them; after a purge nothing comes back, even with the files
/// put back.
#[test]
fn evicted_prompt_pages_come_back_from_the_lower_tiers_for_their_tenant_only() {
    let m = load();
    let prompt = prompt_of(&m, 600);
    let flood = prompt_of(&m, 950);
    let n = prompt.len();
    let reusable = (n - 1) / PAGE * PAGE;
    let dir = tempfile::tempdir().unwrap();
    let spill_dir = dir.path().join("spill");
    let mut e = tiered_engine(&m, &spill_dir);
    let (a, b) = ([0xA1; 32], [0xB2; 32]);
    let (cold, _, _, computed) = run(&mut e, 1, Some(a), &prompt);
    assert_eq!(computed, n as u64);
    assert_eq!(e.kv().tenant_cache_pages(1).pool, reusable / PAGE);

    // Tenant 2's long request needs nearly the whole pool: tenant 1's pages spill.
    run(&mut e, 2, None, &flood);
    let t1 = e.kv().tenant_cache_pages(1);
    assert_eq!(t1.pool + t1.host + t1.disk, reusable / PAGE, "{t1:?}");
    assert!(t1.host == 8 && t1.disk > 0, "{t1:?}");
    assert_eq!(std::fs::read_dir(&spill_dir).unwrap().count(), t1.disk);

    // The same prompt from tenant 2 in its own namespace: a cold miss.
    let (other, cached, _, computed) = run(&mut e, 2, Some(b), &prompt);
    assert_eq!((cached, computed, &other), (0, n as u64, &cold));

    // Tenant 1 again: its pages come back from both tiers.
    let before = e.kv().spill_stats();
    let (warm, cached, _, computed) = run(&mut e, 1, Some(a), &prompt);
    let after = e.kv().spill_stats();
    assert_eq!(cached, reusable, "every full page before the last token");
    assert_eq!(computed, (n - reusable) as u64, "only the tail is computed");
    assert_eq!(warm, cold, "same tokens, text and finish");
    assert!(after.restored_host > before.restored_host, "{after:?}");
    assert!(after.restored_disk > before.restored_disk, "{after:?}");
    assert_eq!(after.open_failures, 0);

    // Spilled again, then purged; the files copied aside and put back find nothing.
    run(&mut e, 3, None, &flood);
    let aside = dir.path().join("aside");
    std::fs::create_dir(&aside).unwrap();
    for f in std::fs::read_dir(&spill_dir).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, aside.join(f.file_name().unwrap())).unwrap();
    }
    let purge = e.purge_tenant_cache(1);
    assert!(purge.host + purge.disk > 0, "{purge:?}");
    assert_eq!(e.kv().tenant_cache_pages(1), TierPages::default());
    for f in std::fs::read_dir(&aside).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, spill_dir.join(f.file_name().unwrap())).unwrap();
    }
    let (again, cached, _, computed) = run(&mut e, 1, Some(a), &prompt);
    assert_eq!((cached, computed, &again), (0, n as u64, &cold));
}

/// A tenant's request in a new namespace (its salt rotated, through the admin API or
/// the store directly) purges what it cached under the old one on this engine, the
/// spilled pages included: nothing of the old namespace stays in any tier.
#[test]
fn a_new_namespace_for_a_tenant_purges_the_old_ones_pages_in_every_tier() {
    let m = load();
    let prompt = prompt_of(&m, 600);
    let flood = prompt_of(&m, 950);
    let dir = tempfile::tempdir().unwrap();
    let mut e = tiered_engine(&m, &dir.path().join("spill"));
    let (old, rotated) = ([0xA1; 32], [0xA4; 32]);
    run(&mut e, 1, Some(old), &prompt);
    run(&mut e, 2, None, &flood);
    let t1 = e.kv().tenant_cache_pages(1);
    assert!(t1.pool > 0 && t1.host > 0 && t1.disk > 0, "{t1:?}");
    let (_, cached, _, _) = run(&mut e, 1, Some(rotated), &prompt);
    assert_eq!(cached, 0);
    let after = e.kv().tenant_cache_pages(1);
    let s = e.kv().spill_stats();
    assert_eq!((after.host, after.disk), (0, 0), "{after:?}");
    assert_eq!(
        (s.purged_host, s.purged_disk),
        (t1.host as u64, t1.disk as u64),
        "{s:?}"
    );
    // What is cached now is the new namespace's, and the old one finds nothing.
    let (_, cached, _, _) = run(&mut e, 1, Some(old), &prompt);
    assert_eq!(cached, 0);
}
