//! What shared limits cost per request (a measurement, not a test).
//!
//! ```sh
//! cargo run --release -p tessera-tenancy --example limits_latency -- --rounds 6 --requests 2000
//! ```
//!
//! One request's limit work: `Limiter::admit`, `Admission::reserve` and
//! `Reservation::settle` (the settle's Redis call runs in the background, as in the
//! gateway; `flush` waits for it after each block so blocks do not overlap), over
//! 100 tenants with every limit set, on the in-memory limiter and on a Redis one (a
//! private `redis-server` on a unix socket, or `TESSERA_TEST_REDIS_URL`; use a TCP
//! URL for a networked Redis). Blocks alternate memory, redis, redis, memory, ...
//! so drift hits both alike. Output: one JSON line per block and a summary with the
//! per-request p50/p99 in microseconds and the redis/memory ratio of the medians.

use std::time::Instant;
use tessera_tenancy::limits::SharedLimits;
use tessera_tenancy::testing::RedisServer;
use tessera_tenancy::{Limiter, Limits};

fn arg(name: &str, default: usize) -> usize {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// Per-request latencies (µs) of `n` admit + reserve + settle cycles.
async fn block(l: &Limiter, n: usize, limits: Limits) -> Vec<f64> {
    let mut us = Vec::with_capacity(n);
    for i in 0..n {
        let tenant = format!("bench-tenant-{}", i % 100);
        let t = Instant::now();
        let r = l
            .admit(&tenant, limits)
            .await
            .expect("admitted")
            .reserve(20, 10)
            .await
            .expect("reserved");
        r.settle(20, 5);
        us.push(t.elapsed().as_secs_f64() * 1e6);
    }
    l.flush().await;
    us
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let rounds = arg("--rounds", 6);
    let n = arg("--requests", 2000);
    let (_server, url) = RedisServer::from_env_or_start();
    let memory = Limiter::new();
    let redis = Limiter::shared(SharedLimits::new(url)).expect("redis url");
    // High enough never to refuse: the cost measured is the bookkeeping.
    let limits = Limits {
        requests_per_minute: 10_000_000,
        input_tokens_per_minute: 1_000_000_000,
        output_tokens_per_minute: 1_000_000_000,
        max_concurrent: 1000,
        daily_tokens: 1 << 50,
    };
    // Warm-up: connections, script loading.
    block(&redis, 200, limits).await;
    block(&memory, 200, limits).await;
    let (mut mem, mut red) = (vec![], vec![]);
    for r in 0..rounds {
        let order: [(&str, &Limiter); 2] = if r % 2 == 0 {
            [("memory", &memory), ("redis", &redis)]
        } else {
            [("redis", &redis), ("memory", &memory)]
        };
        for (name, l) in order {
            let mut us = block(l, n, limits).await;
            let (p50, p99) = (pct(&mut us, 0.5), pct(&mut us, 0.99));
            println!(
                r#"{{"round":{r},"backend":"{name}","requests":{n},"p50_us":{p50:.1},"p99_us":{p99:.1}}}"#
            );
            if name == "memory" { &mut mem } else { &mut red }.extend(us);
        }
    }
    let (m50, m99) = (pct(&mut mem, 0.5), pct(&mut mem, 0.99));
    let (r50, r99) = (pct(&mut red, 0.5), pct(&mut red, 0.99));
    println!(
        r#"{{"summary":true,"memory_p50_us":{m50:.1},"memory_p99_us":{m99:.1},"redis_p50_us":{r50:.1},"redis_p99_us":{r99:.1},"redis_over_memory_p50":{:.1}}}"#,
        r50 / m50
    );
}
