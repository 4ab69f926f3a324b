//! The batch flood of issue 32 item 1, as a measurement (not a test).
//!
//! ```sh
//! cargo run --release -p tessera-gateway --example batch_flood -- --loops 6 --seconds 20
//! ```
//!
//! A gateway with the real model, in this process but on its own tokio runtime (the
//! flood's clients run on another, so their JSON encoding does not count as the
//! gateway's). A "flood" tenant limited to `--flood-rpm` requests/minute (default
//! 1; 0: unlimited) runs `--loops` parallel loops of async batch submissions
//! (`?queueRequest=true`) of about 1 MB: `--items` items (default 256) whose last
//! one is invalid. Meanwhile a "victim" tenant streams short answers one after
//! another and a prober GETs `/healthz` every 20 ms. The same victim and prober run
//! first alone for `--seconds`, then under the flood for `--seconds`.
//!
//! Output: one JSON line: `/healthz` p50/p99/max (ms) alone and under the flood, the
//! victim's time to first token p50/max alone and under the flood and their ratio,
//! the flood's submissions by status, and the usage rows the flood tenant wrote.
//! Issue 32 asks for `/healthz` p99 under 50 ms and the TTFT ratio under 2.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tessera_gateway::{AppState, GatewayOptions, Server};
use tessera_model::LoadedModel;
use tessera_serving::{EngineConfig, EngineHandle};
use tessera_tenancy::{Limits, Store};

mod support;
use support::{arg, pct};

const MODEL: &str = "@cf/huggingfacetb/smollm2-135m-instruct";

/// `/healthz` every 20 ms until `stop`; latencies in ms.
async fn probe(client: reqwest::Client, base: String, stop: Arc<AtomicBool>) -> Vec<f64> {
    let mut out = vec![];
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        let r = client.get(format!("{base}/healthz")).send().await;
        if let Ok(r) = r {
            let _ = r.bytes().await;
            out.push(t.elapsed().as_secs_f64() * 1e3);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    out
}

/// Streams short answers one after another until `stop`; times to first token (the
/// first SSE chunk) in ms.
async fn victim(
    client: reqwest::Client,
    url: String,
    key: String,
    stop: Arc<AtomicBool>,
) -> Vec<f64> {
    let body = serde_json::json!({"prompt": "Name three colors.", "max_tokens": 8, "stream": true});
    let mut out = vec![];
    while !stop.load(Ordering::Relaxed) {
        let t = Instant::now();
        let Ok(mut r) = client.post(&url).bearer_auth(&key).json(&body).send().await else {
            continue;
        };
        if r.status() != 200 {
            eprintln!("victim: status {}", r.status());
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        if let Ok(Some(_)) = r.chunk().await {
            out.push(t.elapsed().as_secs_f64() * 1e3);
        }
        while let Ok(Some(_)) = r.chunk().await {}
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    out
}

/// Runs the victim and the prober for `secs`; returns (healthz ms, ttft ms).
async fn measure(
    client: &reqwest::Client,
    base: &str,
    url: &str,
    key: &str,
    secs: u64,
) -> (Vec<f64>, Vec<f64>) {
    let stop = Arc::new(AtomicBool::new(false));
    let p = tokio::spawn(probe(client.clone(), base.into(), stop.clone()));
    let v = tokio::spawn(victim(client.clone(), url.into(), key.into(), stop.clone()));
    tokio::time::sleep(Duration::from_secs(secs)).await;
    stop.store(true, Ordering::Relaxed);
    (p.await.expect("prober"), v.await.expect("victim"))
}

fn main() -> anyhow::Result<()> {
    let loops = arg("--loops", 6);
    let secs = arg("--seconds", 20);
    let n_items = arg("--items", 256).max(2) as usize;
    let flood_rpm = arg("--flood-rpm", 1) as u32;

    // The gateway's runtime: as `tessera serve` builds it (a worker per core).
    let server_rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let client_rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    let dir = tempfile::tempdir()?;
    let url = format!("sqlite://{}", dir.path().join("flood.db").display());
    let (store, state, base) = server_rt.block_on(async {
        let store = Store::connect(&url).await?;
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
        let state = AppState::new(store.clone(), model, engine, &cfg);
        let server = Server::bind(&cfg, state.clone()).await?;
        let base = format!("http://{}", server.local_addr());
        tokio::spawn(server.run());
        anyhow::Ok((store, state, base))
    })?;

    client_rt.block_on(async move {
        let flood_limits = Limits {
            requests_per_minute: flood_rpm,
            ..Limits::default()
        };
        let flood = store.create_tenant("flood", flood_limits).await?;
        let (_, flood_key) = store.create_key(&flood.id, "flood").await?;
        let victim_t = store.create_tenant("victim", Limits::default()).await?;
        let (_, victim_key) = store.create_key(&victim_t.id, "victim").await?;
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(64)
            .build()?;
        let victim_url = format!("{base}/client/v4/accounts/{}/ai/run/{MODEL}", victim_t.id);
        let flood_url = format!(
            "{base}/client/v4/accounts/{}/ai/run/{MODEL}?queueRequest=true",
            flood.id
        );

        // About 1 MB: items of chat messages, the last one invalid.
        let per_item = (1_000_000 / n_items).saturating_sub(120);
        let text: String = "lorem ipsum dolor sit amet "
            .chars()
            .cycle()
            .take(per_item)
            .collect();
        let mut items: Vec<serde_json::Value> = (0..n_items - 1)
            .map(|_| serde_json::json!({"messages": [{"role": "user", "content": text}], "max_tokens": 1}))
            .collect();
        items.push(serde_json::json!({"prompt": "x", "temperature": 9}));
        let body = serde_json::to_vec(&serde_json::json!({"requests": items}))?;
        eprintln!("flood body: {} bytes, {n_items} items", body.len());

        let (mut h_solo, mut t_solo) =
            measure(&client, &base, &victim_url, &victim_key, secs).await;

        let stop = Arc::new(AtomicBool::new(false));
        let mut floods = vec![];
        for _ in 0..loops {
            let (c, u, k, b, stop) = (
                client.clone(),
                flood_url.clone(),
                flood_key.clone(),
                body.clone(),
                stop.clone(),
            );
            floods.push(tokio::spawn(async move {
                let mut statuses: BTreeMap<u16, u64> = BTreeMap::new();
                while !stop.load(Ordering::Relaxed) {
                    let r = c
                        .post(&u)
                        .bearer_auth(&k)
                        .header("content-type", "application/json")
                        .body(b.clone())
                        .send()
                        .await;
                    if let Ok(r) = r {
                        *statuses.entry(r.status().as_u16()).or_default() += 1;
                        let _ = r.bytes().await;
                    }
                }
                statuses
            }));
        }
        let (mut h_flood, mut t_flood) =
            measure(&client, &base, &victim_url, &victim_key, secs).await;
        stop.store(true, Ordering::Relaxed);
        let mut statuses: BTreeMap<u16, u64> = BTreeMap::new();
        for f in floods {
            for (s, n) in f.await? {
                *statuses.entry(s).or_default() += n;
            }
        }
        state.wait_idle(Duration::from_secs(10)).await;
        let flood_rows = store.usage_rows(Some(&flood.id)).await?.len();
        let ttft_solo = pct(&mut t_solo, 0.5);
        let ttft_flood = pct(&mut t_flood, 0.5);
        println!(
            "{}",
            serde_json::json!({
                "bench": "batch_flood", "loops": loops, "seconds": secs, "items": n_items,
                "flood_rpm": flood_rpm, "body_bytes": body.len(),
                "healthz_solo_p50_ms": pct(&mut h_solo, 0.5),
                "healthz_solo_p99_ms": pct(&mut h_solo, 0.99),
                "healthz_flood_p50_ms": pct(&mut h_flood, 0.5),
                "healthz_flood_p99_ms": pct(&mut h_flood, 0.99),
                "healthz_flood_max_ms": pct(&mut h_flood, 1.0),
                "healthz_flood_samples": h_flood.len(),
                "ttft_solo_p50_ms": ttft_solo, "ttft_solo_max_ms": pct(&mut t_solo, 1.0),
                "ttft_flood_p50_ms": ttft_flood, "ttft_flood_max_ms": pct(&mut t_flood, 1.0),
                "ttft_flood_samples": t_flood.len(),
                "ttft_ratio_p50": ttft_flood / ttft_solo,
                "flood_submissions_by_status": statuses,
                "flood_usage_rows": flood_rows,
            })
        );
        anyhow::Ok(())
    })?;
    // The server's runtime lives until here.
    drop(server_rt);
    Ok(())
}
