//! Several gateways as one fleet: three `Server`s on one PostgreSQL store and one
//! Redis (`shared_limits`), in front of the same engine, over real HTTP with the
//! real model. A tenant's limits hold fleet-wide (not once per gateway), a key
//! revoked through one gateway is refused by all, and a gateway whose Redis is gone
//! fails closed (503, /readyz 503) or open (its own limits) as configured.

mod common;

use common::{model_path, MODEL};
use serde_json::json;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_gateway::{AppState, GatewayOptions, ServedModel, Server};
use tessera_model::LoadedModel;
use tessera_serving::{EngineConfig, EngineHandle};
use tessera_tenancy::limits::{FailMode, SharedLimits};
use tessera_tenancy::testing::{PgServer, RedisServer};
use tessera_tenancy::{Limits, Store};

struct Gateway {
    base: String,
    state: Arc<AppState>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn gateway(
    store: &Store,
    model: &LoadedModel,
    engine: &EngineHandle,
    limits: Option<SharedLimits>,
) -> Gateway {
    let cfg = GatewayOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        admin_token: Some(common::ADMIN.into()),
        shared_limits: limits,
        ..GatewayOptions::default()
    };
    let served = vec![ServedModel::new(MODEL, model.clone(), engine.clone())];
    let state = AppState::with_models(store.clone(), served, &cfg).unwrap();
    let server = Server::bind(&cfg, state.clone()).await.unwrap();
    let base = format!("http://{}", server.local_addr());
    let (stop, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(server.run_until(async move {
        let _ = rx.await;
    }));
    Gateway {
        base,
        state,
        _stop: stop,
    }
}

fn run_url(g: &Gateway, account: &str) -> String {
    format!("{}/client/v4/accounts/{account}/ai/run/{MODEL}", g.base)
}

async fn post(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    body: &serde_json::Value,
) -> (u16, serde_json::Value) {
    let r = client.post(url).bearer_auth(key).json(body).send().await;
    let (st, _, v) = common::split(r.unwrap()).await;
    (st, v)
}

struct Fleet {
    _pg: Option<PgServer>,
    _redis: Option<RedisServer>,
    store: Store,
    gateways: Vec<Gateway>,
    client: reqwest::Client,
}

async fn fleet(n: usize) -> Fleet {
    let (pg, pg_url) = PgServer::from_env_or_start();
    let (redis, redis_url) = RedisServer::from_env_or_start();
    let store = Store::connect(&pg_url).await.unwrap();
    let model = LoadedModel::load(&model_path()).unwrap();
    let engine = EngineHandle::spawn(&model, EngineConfig::default());
    let mut gateways = vec![];
    for _ in 0..n {
        let shared = SharedLimits::new(redis_url.clone());
        gateways.push(gateway(&store, &model, &engine, Some(shared)).await);
    }
    Fleet {
        _pg: pg,
        _redis: redis,
        store,
        gateways,
        client: reqwest::Client::new(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_hold_one_set_of_limits_and_revocations() {
    let f = fleet(3).await;
    // Requests per minute, fleet-wide: 12 requests round-robin over 3 gateways.
    let rpm = Limits {
        requests_per_minute: 6,
        ..Limits::default()
    };
    let t = f.store.create_tenant("rpm", rpm).await.unwrap();
    let (_, key) = f.store.create_key(&t.id, "k").await.unwrap();
    let body = json!({"prompt": "Hi", "max_tokens": 1});
    let mut ok = 0;
    for i in 0..12 {
        let g = &f.gateways[i % 3];
        let (st, v) = post(&f.client, &run_url(g, &t.id), &key, &body).await;
        match st {
            200 => ok += 1,
            429 => assert!(v["errors"][0]["message"]
                .as_str()
                .unwrap()
                .contains("requests_per_minute")),
            s => panic!("unexpected {s}: {v}"),
        }
    }
    assert_eq!(ok, 6, "the limit holds across the fleet, not per gateway");
    for g in &f.gateways {
        assert!(g.state.wait_idle(Duration::from_secs(10)).await);
    }
    let rows = f.store.usage_rows(Some(&t.id)).await.unwrap();
    assert_eq!(rows.len(), 6, "one usage row per admitted request");

    // Concurrency, fleet-wide: two streams on two gateways fill max_concurrent 2.
    let conc = Limits {
        max_concurrent: 2,
        ..Limits::default()
    };
    let t = f.store.create_tenant("conc", conc).await.unwrap();
    let (info, key) = f.store.create_key(&t.id, "k").await.unwrap();
    let long = json!({"prompt": "Count from 1 to 1000.", "max_tokens": 400, "stream": true});
    let mut streams = vec![];
    for g in &f.gateways[..2] {
        let (r, _) = common::open_stream_at(&f.client, &run_url(g, &t.id), &key, &long).await;
        streams.push(r);
    }
    let (st, v) = post(&f.client, &run_url(&f.gateways[2], &t.id), &key, &body).await;
    assert_eq!(st, 429, "{v}");
    assert!(v["errors"][0]["message"]
        .as_str()
        .unwrap()
        .contains("max_concurrent"));
    drop(streams);
    // Released once the engine confirms the aborts: the third gateway admits again.
    let start = Instant::now();
    loop {
        let (st, _) = post(&f.client, &run_url(&f.gateways[2], &t.id), &key, &body).await;
        if st == 200 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "slots never freed"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A key revoked through one gateway's admin API is refused by every gateway.
    let resp = f
        .client
        .post(format!(
            "{}/admin/v1/keys/{}/revoke",
            f.gateways[0].base, info.key_id
        ))
        .bearer_auth(common::ADMIN)
        .send()
        .await
        .unwrap();
    assert!(resp.status().is_success(), "{}", resp.status());
    let revoked = Instant::now();
    for g in &f.gateways {
        loop {
            let (st, _) = post(&f.client, &run_url(g, &t.id), &key, &body).await;
            if st == 401 {
                break;
            }
            assert!(
                revoked.elapsed() < Duration::from_secs(1),
                "revocation took over 1 s"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_without_its_redis_fails_closed_or_open_as_configured() {
    let (_pg, pg_url) = PgServer::from_env_or_start();
    let store = Store::connect(&pg_url).await.unwrap();
    let model = LoadedModel::load(&model_path()).unwrap();
    let engine = EngineHandle::spawn(&model, EngineConfig::default());
    let dir = tempfile::tempdir().unwrap();
    let nowhere = format!("redis+unix://{}", dir.path().join("none.sock").display());
    let closed = gateway(
        &store,
        &model,
        &engine,
        Some(SharedLimits::new(nowhere.clone())),
    )
    .await;
    let open = gateway(
        &store,
        &model,
        &engine,
        Some(SharedLimits {
            on_failure: FailMode::Open,
            ..SharedLimits::new(nowhere)
        }),
    )
    .await;
    let limits = Limits {
        requests_per_minute: 2,
        ..Limits::default()
    };
    let t = store.create_tenant("t", limits).await.unwrap();
    let (_, key) = store.create_key(&t.id, "k").await.unwrap();
    let client = reqwest::Client::new();
    let body = json!({"prompt": "Hi", "max_tokens": 1});

    let (st, v) = post(&client, &run_url(&closed, &t.id), &key, &body).await;
    assert_eq!(st, 503, "{v}");
    let r = client
        .get(format!("{}/readyz", closed.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 503);
    assert!(r.text().await.unwrap().contains("failing closed"));

    // Open: this gateway's own limits decide (2 a minute), and it says so.
    let codes: Vec<u16> = {
        let mut v = vec![];
        for _ in 0..3 {
            v.push(post(&client, &run_url(&open, &t.id), &key, &body).await.0);
        }
        v
    };
    assert_eq!(codes, [200, 200, 429]);
    let r = client
        .get(format!("{}/readyz", open.base))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert!(r.text().await.unwrap().contains("failing open"));
    let m = common::metrics_text(&client, &open.base).await;
    assert!(m.contains("tessera_limits_backend_up 0"), "{m}");
    assert!(
        !m.contains("tessera_limits_fallbacks_total 0\n"),
        "fallbacks counted"
    );
}
