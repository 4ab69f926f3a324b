//! Gateway latency benchmark (a measurement, not a test).
//!
//! ```sh
//! cargo run --release -p tessera-gateway --example latency -- --tenants 10000 --seconds 5
//! ```
//!
//! 1. Auth + limit checks: `Store::authenticate` (SQLite lookup, SHA-256, constant-time
//!    compare) plus `Limiter::admit` and `Admission::reserve`, per request, with `--tenants` tenants in the store.
//! 2. Added latency, closed loop: `--requests` short requests (`max_tokens` 1), one
//!    in flight, alternating straight into the engine (`EngineHandle::submit` with a
//!    pre-tokenized prompt) and through the gateway over HTTP (auth, validation,
//!    chat template, tokenizer, limits, usage row), over all tenants. With one
//!    request in flight the engine never queues, so the difference is the gateway.
//!    `overhead_*` is per request: client latency minus the engine's own
//!    submit-to-first-token time from the request's ledger row, which removes the
//!    engine's run-to-run variance from the comparison.
//! 3. Added latency, open loop at `--rates` requests/s (default `100,500`) for
//!    `--seconds` each, direct and through the gateway. On a CPU engine that cannot
//!    sustain the rate, queueing dominates both (see `achieved_rps`), and the
//!    difference is noise; pass `--rates ''` to skip.
//!
//! Output: JSON lines with p50/p99 of each and their difference.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_gateway::{AppState, GatewayOptions, Server};
use tessera_model::chat::ChatMessage;
use tessera_model::LoadedModel;
use tessera_serving::{EngineConfig, EngineHandle, GenerateRequest, StreamEvent};
use tessera_tenancy::{Limits, Store};

mod support;
use support::{arg, pct};

const MODEL: &str = "@cf/huggingfacetb/smollm2-135m-instruct";
const PROMPT: &str = "Hi";

/// Runs `f` at `rate` per second for `secs` seconds (open loop); returns latencies in ms.
async fn open_loop<F, Fut>(rate: u64, secs: u64, f: F) -> Vec<f64>
where
    F: Fn(usize) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let n = (rate * secs) as usize;
    let period = Duration::from_secs_f64(1.0 / rate as f64);
    let start = tokio::time::Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        tokio::time::sleep_until(start + period * i as u32).await;
        let fut = f(i);
        tasks.push(tokio::spawn(async move {
            let t = Instant::now();
            fut.await;
            t.elapsed().as_secs_f64() * 1e3
        }));
    }
    let mut out = Vec::with_capacity(n);
    for t in tasks {
        out.push(t.await.expect("task"));
    }
    out
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> anyhow::Result<()> {
    let tenants = arg("--tenants", 10_000) as usize;
    let secs = arg("--seconds", 5);
    let dir = tempfile::tempdir()?;
    let store = Store::connect(&format!(
        "sqlite://{}",
        dir.path().join("bench.db").display()
    ))
    .await?;
    let model_path = std::env::var("TESSERA_MODEL").unwrap_or_else(|_| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../models/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
        .into()
    });
    let model = LoadedModel::load(model_path.as_ref())?;
    let engine = EngineHandle::spawn(&model, EngineConfig::default());
    let cfg = GatewayOptions {
        listen: "127.0.0.1:0".parse()?,
        ..GatewayOptions::default()
    };
    let state = AppState::new(store.clone(), model.clone(), engine.clone(), &cfg);
    let server = Server::bind(&cfg, state.clone()).await?;
    let base = format!("http://{}", server.local_addr());
    tokio::spawn(server.run());

    let t0 = Instant::now();
    let mut keys = Vec::with_capacity(tenants);
    for i in 0..tenants {
        let t = store
            .create_tenant(
                &format!("t{i}"),
                Limits {
                    requests_per_minute: 100_000,
                    ..Limits::default()
                },
            )
            .await?;
        let (_, k) = store.create_key(&t.id, "bench").await?;
        keys.push((t.id, k));
    }
    eprintln!(
        "created {tenants} tenants in {:.1} s",
        t0.elapsed().as_secs_f64()
    );
    let keys = Arc::new(keys);

    // 1. Auth + limits per request.
    let mut us = Vec::new();
    for i in 0..20_000usize {
        let (_, k) = &keys[(i * 7919) % keys.len()];
        let t = Instant::now();
        let p = store.authenticate(k).await?.map_err(anyhow::Error::msg)?;
        let admission = state
            .limiter
            .admit(&p.tenant.id, p.tenant.limits)
            .await
            .map_err(anyhow::Error::msg)?;
        let reservation = admission.reserve(10, 1).await.map_err(anyhow::Error::msg)?;
        us.push(t.elapsed().as_secs_f64() * 1e6);
        reservation.settle(10, 1);
    }
    let mean = us.iter().sum::<f64>() / us.len() as f64;
    println!(
        "{}",
        serde_json::json!({"bench": "auth_and_limits", "tenants": tenants, "n": us.len(),
            "mean_us": mean, "p50_us": pct(&mut us, 0.5), "p99_us": pct(&mut us, 0.99)})
    );

    let text = model
        .chat
        .render(&[ChatMessage::new("user", PROMPT)], true)?;
    let prompt = model.tokenizer.encode(&text, true)?;
    let client = reqwest::Client::builder()
        .pool_max_idle_per_host(1024)
        .build()?;

    // 2. Closed loop, one request in flight.
    let n = arg("--requests", 300) as usize;
    let (mut direct, mut gw) = (Vec::with_capacity(n), Vec::with_capacity(n));
    let mut rids = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        let req = GenerateRequest::new(i as u64, prompt.clone(), 1);
        let mut rx = engine.admit_and_submit(req).map_err(anyhow::Error::msg)?;
        while let Some(ev) = rx.recv().await {
            if matches!(ev, StreamEvent::Done { .. } | StreamEvent::Error(_)) {
                break;
            }
        }
        direct.push(t.elapsed().as_secs_f64() * 1e3);
        let (acct, key) = &keys[(i * 7919) % keys.len()];
        let t = Instant::now();
        let r = client
            .post(format!("{base}/client/v4/accounts/{acct}/ai/run/{MODEL}"))
            .bearer_auth(key)
            .json(&serde_json::json!({"prompt": PROMPT, "max_tokens": 1}))
            .send()
            .await?;
        anyhow::ensure!(r.status() == 200, "status {}", r.status());
        let rid = r.headers()["x-request-id"].to_str()?.to_string();
        let _ = r.bytes().await?;
        gw.push(t.elapsed().as_secs_f64() * 1e3);
        rids.push(rid);
    }
    // Per request: client latency minus the engine's own submit-to-first-token time
    // (the ledger's ttft_us; with max_tokens 1 the first token is the last).
    state.wait_idle(Duration::from_secs(10)).await;
    let mut overhead = Vec::with_capacity(n);
    for (rid, ms) in rids.iter().zip(&gw) {
        let row = store
            .usage_row(rid)
            .await?
            .ok_or_else(|| anyhow::anyhow!("no row {rid}"))?;
        overhead.push(ms - row.ttft_us as f64 / 1e3);
    }
    let (d50, d99) = (pct(&mut direct, 0.5), pct(&mut direct, 0.99));
    let (g50, g99) = (pct(&mut gw, 0.5), pct(&mut gw, 0.99));
    println!(
        "{}",
        serde_json::json!({"bench": "added_latency_closed_loop", "requests": n, "tenants": tenants,
            "direct_p50_ms": d50, "direct_p99_ms": d99, "gateway_p50_ms": g50, "gateway_p99_ms": g99,
            "added_p50_ms": g50 - d50, "added_p99_ms": g99 - d99,
            "overhead_p50_ms": pct(&mut overhead, 0.5), "overhead_p99_ms": pct(&mut overhead, 0.99)})
    );

    // 3. Open loop at fixed rates.
    let rates: Vec<u64> = std::env::args()
        .collect::<Vec<_>>()
        .windows(2)
        .find(|w| w[0] == "--rates")
        .map(|w| {
            w[1].split(',')
                .filter_map(|r| r.trim().parse().ok())
                .collect()
        })
        .unwrap_or_else(|| vec![100, 500]);
    for rate in rates {
        let e = engine.clone();
        let p = prompt.clone();
        let t_rate = Instant::now();
        let mut direct = open_loop(rate, secs, move |i| {
            let e = e.clone();
            let req = GenerateRequest::new(i as u64 % tenants as u64, p.clone(), 1);
            async move {
                let mut rx = e.admit_and_submit(req).expect("admitted");
                while let Some(ev) = rx.recv().await {
                    if matches!(ev, StreamEvent::Done { .. } | StreamEvent::Error(_)) {
                        break;
                    }
                }
            }
        })
        .await;
        let direct_wall = t_rate.elapsed().as_secs_f64();
        let (c, k, b) = (client.clone(), keys.clone(), base.clone());
        let t_rate = Instant::now();
        let mut gw = open_loop(rate, secs, move |i| {
            let (acct, key) = k[(i * 7919) % k.len()].clone();
            let req = c
                .post(format!("{b}/client/v4/accounts/{acct}/ai/run/{MODEL}"))
                .bearer_auth(key)
                .json(&serde_json::json!({"prompt": PROMPT, "max_tokens": 1}));
            async move {
                let r = req.send().await.expect("send");
                assert_eq!(r.status(), 200);
                let _ = r.bytes().await;
            }
        })
        .await;
        let gw_wall = t_rate.elapsed().as_secs_f64();
        let (d50, d99) = (pct(&mut direct, 0.5), pct(&mut direct, 0.99));
        let (g50, g99) = (pct(&mut gw, 0.5), pct(&mut gw, 0.99));
        println!(
            "{}",
            serde_json::json!({"bench": "added_latency_open_loop", "rate_rps": rate, "seconds": secs, "tenants": tenants,
                "direct_achieved_rps": direct.len() as f64 / direct_wall, "gateway_achieved_rps": gw.len() as f64 / gw_wall,
                "direct_p50_ms": d50, "direct_p99_ms": d99, "gateway_p50_ms": g50, "gateway_p99_ms": g99,
                "added_p50_ms": g50 - d50, "added_p99_ms": g99 - d99})
        );
    }
    Ok(())
}
