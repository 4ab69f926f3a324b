//! The prefix cache's lower tiers (issue 39), same run with and without: a
//! shared-system-prompt workload whose working set exceeds the KV pool. `TENANTS`
//! tenants each send requests made of their own ~`SYSTEM`-token system prompt and a
//! fresh question, round-robin, one at a time; the pool holds about half of the
//! system prompts. Reports TTFT p50/p99 and the prompt tokens computed per
//! configuration (pool only, + host memory, + disk only), and the cost per page of
//! spilling (sealing and writing) and restoring (reading and opening) on disk.
//! Prints one JSON line per measurement.
//!
//! `cargo run --release -p tessera-engine --example spill_tier [-- ROUNDS]`
//! (model: `TESSERA_MODEL` or the default model; `TESSERA_THREADS` threads).

use std::time::{Duration, Instant};
use tessera_engine::testing::*;
use tessera_engine::{Engine, EngineConfig, Event};
use tessera_model::kv::spill::SpillConfig;
use tessera_model::LoadedModel;

const TENANTS: u64 = 8;
const SYSTEM: usize = 800;
const POOL_TOKENS: usize = 4096;

/// Tenant `t`'s system prompt followed by question `q`.
fn prompt(m: &LoadedModel, t: u64, q: usize) -> Vec<u32> {
    let mut system = format!("You are the support assistant of shop number {t}. Policies:\n");
    let mut i = 0;
    while m.tokenizer.encode(&system, false).unwrap().len() < SYSTEM {
        system.push_str(&format!(
            "Rule {i} of shop {t}: orders of {} items ship within {} days from depot {}.\n",
            i * 7 + t as usize,
            i % 5 + 1,
            (i + t as usize) % 9
        ));
        i += 1;
    }
    chat_prompt(
        m,
        &format!("{system}\nQuestion {q}: when does order {q} arrive?"),
    )
}

/// Runs `rounds` rounds of one request per tenant on `e`; TTFTs and the prompt
/// tokens computed in all.
fn workload(m: &LoadedModel, e: &mut Engine, rounds: usize) -> (Vec<Duration>, u64) {
    e.reset_served();
    let mut ttfts = Vec::new();
    for r in 0..rounds {
        for t in 1..=TENANTS {
            let mut req = greedy(prompt(m, t, r), 2);
            req.tenant = t;
            req.cache_namespace = Some([t as u8; 32]);
            let mut rx = e.enqueue(e.admit(req).unwrap());
            e.run_to_completion();
            while let Ok(ev) = rx.try_recv() {
                if let Event::Done { usage, .. } = ev {
                    ttfts.push(usage.ttft);
                }
            }
        }
    }
    let computed = e.served().values().map(|s| s.prefill).sum();
    (ttfts, computed)
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    v[((v.len() - 1) as f64 * p).round() as usize].as_secs_f64() * 1e3
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(4, |s| s.parse().expect("ROUNDS"));
    let m = load();
    let page_bytes = m
        .transformer
        .config()
        .kv_layout(EngineConfig::default().page_size)
        .page_bytes();
    let dir = tempfile_dir();
    let pool_pages = POOL_TOKENS / EngineConfig::default().page_size;
    let configs = [
        ("pool only", SpillConfig::default()),
        (
            "pool + host",
            SpillConfig {
                host_pages: pool_pages * 2,
                ..SpillConfig::default()
            },
        ),
        (
            "pool + disk",
            SpillConfig {
                disk_pages: pool_pages * 2,
                dir: Some(dir.join("disk")),
                ..SpillConfig::default()
            },
        ),
    ];
    let mut base = None;
    for (name, spill) in configs {
        let mut e = engine(
            &m,
            EngineConfig {
                kv_pool_tokens: POOL_TOKENS,
                prefix_cache_tenant_share: 100,
                spill,
                ..EngineConfig::default()
            },
        );
        // One round to warm the caches, then the measured rounds.
        workload(&m, &mut e, 1);
        let t0 = Instant::now();
        let (mut ttft, computed) = workload(&m, &mut e, rounds);
        let wall = t0.elapsed().as_secs_f64();
        let s = e.kv().spill_stats();
        let p50 = pct(&mut ttft, 0.5);
        let (b50, bcomp) = *base.get_or_insert((p50, computed));
        println!(
            "{{\"config\":\"{name}\",\"requests\":{},\"ttft_p50_ms\":{p50:.1},\"ttft_p99_ms\":{:.1},\"prompt_tokens_computed\":{computed},\"ttft_p50_vs_pool_only\":{:.3},\"computed_vs_pool_only\":{:.3},\"restored_host\":{},\"restored_disk\":{},\"spilled_disk\":{},\"wall_s\":{wall:.2}}}",
            ttft.len(),
            pct(&mut ttft, 0.99),
            p50 / b50,
            computed as f64 / bcomp as f64,
            s.restored_host,
            s.restored_disk,
            s.spilled_disk,
        );
    }
    disk_page_costs(&m, page_bytes, &dir);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Spill and restore cost per disk page: tenant 1's system prompt cached, evicted
/// by a pool-sized request (every page sealed and written), then reused (every page
/// read and opened), timed around the reservations alone.
fn disk_page_costs(m: &LoadedModel, page_bytes: usize, dir: &std::path::Path) {
    use tessera_model::kv::prefix::{chain, chain_root};
    use tessera_model::kv::{KvManager, PagePool, SeqId};
    let page = EngineConfig::default().page_size;
    let layout = m.transformer.config().kv_layout(page);
    let pages = 128;
    let mut kv = KvManager::new(PagePool::new(layout, pages, false));
    kv.set_spill(SpillConfig {
        disk_pages: pages * 2,
        dir: Some(dir.join("costs")),
        ..SpillConfig::default()
    })
    .unwrap();
    let tokens: Vec<u32> = (0..(pages * page) as u32).collect();
    let keys = chain(&chain_root(&[1; 32], &[0; 32], page), &tokens, page);
    kv.reserve_cached(SeqId(1), 1, tokens.len(), &keys, pages)
        .unwrap();
    kv.release_caching(SeqId(1), &keys, pages);
    let t0 = Instant::now();
    kv.reserve(SeqId(2), 2, tokens.len()).unwrap();
    let spill = t0.elapsed();
    kv.release(SeqId(2));
    let t0 = Instant::now();
    let back = kv
        .reserve_cached(SeqId(3), 1, tokens.len(), &keys, pages)
        .unwrap();
    let restore = t0.elapsed();
    assert_eq!(back, pages, "every page came back");
    println!(
        "{{\"measure\":\"disk page\",\"page_bytes\":{page_bytes},\"pages\":{pages},\"spill_us_per_page\":{:.1},\"restore_us_per_page\":{:.1}}}",
        spill.as_secs_f64() * 1e6 / pages as f64,
        restore.as_secs_f64() * 1e6 / pages as f64,
    );
}

/// A fresh directory under the system's temporary directory.
fn tempfile_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("tessera-spill-bench-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
