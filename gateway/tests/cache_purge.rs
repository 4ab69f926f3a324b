//! A tenant erases what the platform cached of it: `DELETE
//! /client/v4/accounts/{account}/ai/cache` with the real model, co-located and with
//! a prefill and a decode engine. Checked by content, not status: the tenant's
//! repeated prompt reports `cached_tokens: 0` afterwards and its pages are gone from
//! the engines' pools (their cached-page gauge drops by exactly what the purge
//! freed), another tenant's cache answers as before, and the purge is audited. Then
//! the route attacked: no key, an empty key, another account's key, a key without
//! the `inference` scope, the wrong method. `GET` on the same path reports each
//! account's cached pages (key scope `usage:read`).

mod common;

use common::*;
use reqwest::Method;
use serde_json::{json, Value};
use std::time::Duration;
use tessera_gateway::GatewayOptions;
use tessera_model::kv::spill::SpillConfig;
use tessera_serving::EngineConfig;
use tessera_tenancy::{Limits, NewKey, Scopes};

/// A user message long enough to fill several 16-token pages.
fn long_question(topic: &str) -> String {
    let mut s = format!("Notes on {topic}.\n");
    for i in 0..24 {
        s.push_str(&format!(
            "Item {i}: crate {} holds {} red balls.\n",
            i % 3,
            i + 5
        ));
    }
    s.push_str("Question: which crate holds the most balls?");
    s
}

fn cached_of(v: &Value) -> i64 {
    v["result"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_i64()
        .unwrap_or_else(|| panic!("no cached_tokens in {v}"))
}

fn cache_url(s: &TestServer, account: &str) -> String {
    format!("{}/client/v4/accounts/{account}/ai/cache", s.base)
}

/// `GET .../ai/cache`: the account's cached pages on the one served model (and
/// its tokens, a page's worth each).
async fn report(s: &TestServer, account: &str, key: &str) -> usize {
    let (st, _, v) = s.get(&cache_url(s, account), Some(key)).await;
    assert_eq!(st, 200, "{v}");
    let m = &v["result"]["models"][0];
    assert_eq!(
        (&m["model"], &m["tier"]),
        (&json!(MODEL), &json!("engine_pool")),
        "{v}"
    );
    let pages = m["cached_pages"].as_u64().unwrap() as usize;
    assert_eq!(
        m["cached_tokens"].as_u64().unwrap() as usize,
        pages * 16,
        "{v}"
    );
    pages
}

async fn delete(s: &TestServer, account: &str, key: Option<&str>) -> (u16, String, Value) {
    let mut r = s.client.request(Method::DELETE, cache_url(s, account));
    if let Some(k) = key {
        r = r.bearer_auth(k);
    }
    split(r.send().await.unwrap()).await
}

/// The engines' cached pages once the gauge reads `want` (it is published after the
/// engine's next step), or the last reading after 10 s.
async fn cached_pages_reach(s: &TestServer, want: usize) -> usize {
    let mut now = s.state.engine.stats().cached_pages;
    for _ in 0..1000 {
        if now == want {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        now = s.state.engine.stats().cached_pages;
    }
    now
}

async fn purge_erases_only_the_callers_cache(s: TestServer) {
    let (b, key_b) = s.tenant_with_key("beta", Limits::default()).await;
    let a = s.tenant.id.clone();
    let body = |topic: &str| json!({"messages": [{"role": "user", "content": long_question(topic)}], "max_tokens": 4});
    let (body_a, body_b) = (body("the alpha store"), body("the beta store"));

    // Both tenants fill their caches; the repeat of each is a hit.
    for (account, key, body) in [(&a, &s.key, &body_a), (&b.id, &key_b, &body_b)] {
        let (st, _, first) = s.post(&s.run_url(account), Some(key), body).await;
        assert_eq!(st, 200, "{first}");
        assert_eq!(cached_of(&first), 0);
        let (st, _, again) = s.post(&s.run_url(account), Some(key), body).await;
        assert_eq!(st, 200, "{again}");
        assert!(cached_of(&again) > 0, "{again}");
        assert_eq!(again["result"]["response"], first["result"]["response"]);
    }
    s.wait_idle().await;
    let before = s.state.engine.stats().cached_pages;
    assert!(before > 0);
    // Each tenant's report counts its own pages only; together they are the pool's.
    let (pages_a, pages_b) = (
        report(&s, &a, &s.key).await,
        report(&s, &b.id, &key_b).await,
    );
    assert!(pages_a > 0 && pages_b > 0);
    assert_eq!(pages_a + pages_b, before);

    let (st, _, v) = delete(&s, &a, Some(&s.key)).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["result"]["account_id"], json!(a));
    let m = &v["result"]["models"][0];
    assert_eq!(m["model"], json!(MODEL), "{v}");
    let freed = m["freed_pages"].as_u64().unwrap() as usize;
    assert_eq!(m["poisoned_pages"], 0, "nothing of alpha was running: {v}");
    assert!(freed > 0 && freed < before, "alpha's pages only: {v}");
    assert_eq!(freed, pages_a, "every page alpha had cached");
    // The pools hold exactly what the purge did not free (beta's pages).
    assert_eq!(cached_pages_reach(&s, before - freed).await, before - freed);
    assert_eq!(report(&s, &a, &s.key).await, 0);
    assert_eq!(report(&s, &b.id, &key_b).await, pages_b);

    // Alpha's repeated prompt misses now, with the same answer; beta still hits.
    let (st, _, after) = s.post(&s.run_url(&a), Some(&s.key), &body_a).await;
    assert_eq!(st, 200, "{after}");
    assert_eq!(cached_of(&after), 0, "purged: {after}");
    let (st, _, b_after) = s.post(&s.run_url(&b.id), Some(&key_b), &body_b).await;
    assert_eq!(st, 200, "{b_after}");
    assert!(
        cached_of(&b_after) > 0,
        "beta's cache is untouched: {b_after}"
    );
    // Alpha's cache fills again (the purge erased entries, it did not break caching).
    let (_, _, refill) = s.post(&s.run_url(&a), Some(&s.key), &body_a).await;
    assert!(cached_of(&refill) > 0, "{refill}");

    // A second purge frees what alpha cached since, and beta's purge frees beta's.
    s.wait_idle().await;
    let (st, _, v2) = delete(&s, &b.id, Some(&key_b)).await;
    assert_eq!(st, 200, "{v2}");
    assert!(v2["result"]["models"][0]["freed_pages"].as_u64().unwrap() > 0);

    let audit = s.store().audit_rows(0, i64::MAX, 1000).await.unwrap();
    let purges: Vec<_> = audit
        .iter()
        .filter(|r| r.action == "tenant.cache_purge")
        .collect();
    assert_eq!(purges.len(), 2, "{purges:?}");
    assert_eq!(
        (purges[0].target.as_str(), purges[1].target.as_str()),
        (a.as_str(), b.id.as_str())
    );
    assert!(purges[0].source.starts_with("key:"), "{:?}", purges[0]);
    // Counted per engine in the node metrics.
    let mut text = String::new();
    s.state
        .engine
        .node_metrics()
        .unwrap()
        .encode(&mut text)
        .unwrap();
    let purged: f64 = text
        .lines()
        .filter(|l| l.starts_with("tessera_kv_cache_purged_pages_total{"))
        .map(|l| l.rsplit(' ').next().unwrap().parse::<f64>().unwrap())
        .sum();
    let both = freed as u64 + v2["result"]["models"][0]["freed_pages"].as_u64().unwrap();
    assert_eq!(purged as u64, both, "{text}");
    assert_eq!(purges[0].detail["models"][0]["freed_pages"], json!(freed));
    s.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_erases_the_callers_cached_pages_on_a_colocated_engine() {
    purge_erases_only_the_callers_cache(start().await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_erases_the_callers_cached_pages_on_prefill_and_decode_engines() {
    purge_erases_only_the_callers_cache(start_pd(GatewayOptions::default()).await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_purge_route_refuses_strangers_other_accounts_and_narrow_keys() {
    let s = start().await;
    let (b, key_b) = s.tenant_with_key("beta", Limits::default()).await;
    let a = s.tenant.id.clone();
    let (st, _, v) = delete(&s, &a, None).await;
    assert_eq!(st, 401, "{v}");
    let (st, _, v) = delete(&s, &a, Some("")).await;
    assert_eq!(st, 401, "{v}");
    let (st, _, v) = delete(&s, &a, Some("tsk_not_a_key")).await;
    assert_eq!(st, 401, "{v}");
    // Beta's key on alpha's account, and on an account that does not exist.
    let (st, _, v) = delete(&s, &a, Some(&key_b)).await;
    assert_eq!(st, 403, "{v}");
    let (st, _, v) = delete(&s, "no-such-account", Some(&key_b)).await;
    assert_eq!(st, 403, "{v}");
    // A key that may read usage but not run inference may not erase the cache.
    let (_, reader) = s
        .store()
        .create_key_with(
            &b.id,
            &NewKey {
                name: "reader".into(),
                scopes: Scopes::parse("usage:read").unwrap(),
                expires_ms: None,
            },
        )
        .await
        .unwrap();
    let (st, _, v) = delete(&s, &b.id, Some(&reader)).await;
    assert_eq!(st, 403, "{v}");
    // It may read the report; nobody may read another account's.
    assert_eq!(report(&s, &b.id, &reader).await, 0);
    let (st, _, v) = s.get(&cache_url(&s, &a), Some(&key_b)).await;
    assert_eq!(st, 403, "{v}");
    let (st, _, v) = s.get(&cache_url(&s, &a), None).await;
    assert_eq!(st, 401, "{v}");
    let r = s
        .client
        .post(cache_url(&s, &a))
        .bearer_auth(&s.key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 405);
    // Nothing was purged or audited by any of these.
    let audit = s.store().audit_rows(0, i64::MAX, 1000).await.unwrap();
    assert!(audit.iter().all(|r| r.action != "tenant.cache_purge"));
}

/// A tenant's own cache limits (`PUT /admin/v1/tenants/{id}/cache-limits`, audited)
/// reach the engines at once and with its requests: with `max_cached_tokens: 32` its
/// repeated prompt reuses exactly two pages and its report shows two; set to
/// `idle_ttl_secs: 1` while the tenant sends nothing, its pages are dropped once idle
/// that long (the report reaches 0 with no request in between) and the prompt then
/// misses with the same answer. Values over their maximum and unknown fields are
/// 400s naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_cache_limits_bound_and_expire_its_cached_pages() {
    let s = start().await;
    let a = s.tenant.id.clone();
    let body = json!({"messages": [{"role": "user", "content": long_question("limits")}], "max_tokens": 4});
    let path = format!("/admin/v1/tenants/{a}/cache-limits");
    let put = |b: Value| s.admin(Method::PUT, &path).json(&b).send();

    let r = put(json!({"max_cached_tokens": 32})).await.unwrap();
    assert_eq!(r.status(), 200);
    let v: Value = r.json().await.unwrap();
    assert_eq!(v["result"]["applied_on"], json!([MODEL]), "{v}");
    let (_, _, first) = s.post(&s.run_url(&a), Some(&s.key), &body).await;
    assert_eq!(cached_of(&first), 0, "{first}");
    let (_, _, again) = s.post(&s.run_url(&a), Some(&s.key), &body).await;
    assert_eq!(cached_of(&again), 32, "two pages kept: {again}");
    s.wait_idle().await;
    assert_eq!(report(&s, &a, &s.key).await, 2);

    let r = put(json!({"max_cached_tokens": 0, "idle_ttl_secs": 1}))
        .await
        .unwrap();
    // Pushed to the engine: no request of the tenant carries them.
    assert_eq!(r.status(), 200);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut pages = report(&s, &a, &s.key).await;
    while pages > 0 && std::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
        pages = report(&s, &a, &s.key).await;
    }
    assert_eq!(pages, 0, "idle pages dropped");
    let (_, _, after) = s.post(&s.run_url(&a), Some(&s.key), &body).await;
    assert_eq!(cached_of(&after), 0, "{after}");
    assert_eq!(after["result"]["response"], first["result"]["response"]);

    for bad in [
        json!({"idle_ttl_secs": 31 * 86_400}),
        json!({"max_cached_tokens": 1u64 << 50}),
        json!({"ttl": 5}),
    ] {
        let r = put(bad.clone()).await.unwrap();
        assert_eq!(r.status(), 400, "{bad}");
        let text = r.text().await.unwrap();
        let field = bad.as_object().unwrap().keys().next().unwrap().clone();
        assert!(text.contains(&field), "{bad}: {text}");
    }
    let audit = s.store().audit_rows(0, i64::MAX, 1000).await.unwrap();
    let set: Vec<_> = audit
        .iter()
        .filter(|r| r.action == "tenant.cache_limits")
        .collect();
    assert_eq!(set.len(), 2, "{set:?}");
    s.wait_idle().await;
}

/// Cached prompt tokens per tier reach the usage ledger and the usage API (issue 39,
/// item 3): the tenant's prompt pages, evicted by another tenant's long prompt, come
/// back from host memory on its next request, whose ledger row counts them as
/// `cached_host_tokens` (a part of `cached_tokens`), and the usage API sums them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_tokens_per_tier_reach_the_ledger_and_the_usage_api() {
    let engine = EngineConfig {
        kv_pool_tokens: 1024,
        prefix_cache_tenant_share: 100,
        spill: SpillConfig {
            host_pages: 256,
            ..SpillConfig::default()
        },
        ..EngineConfig::default()
    };
    let s = start_with_engine(GatewayOptions::default(), engine).await;
    let (b, key_b) = s.tenant_with_key("beta", Limits::default()).await;
    let a = s.tenant.id.clone();
    let body =
        json!({"messages": [{"role": "user", "content": long_question("tiers")}], "max_tokens": 4});
    let (st, _, first) = s.post(&s.run_url(&a), Some(&s.key), &body).await;
    assert_eq!((st, cached_of(&first)), (200, 0), "{first}");
    // Beta's prompt needs most of the 64-page pool: alpha's pages spill.
    let flood = json!({"prompt": "sea ".repeat(850), "max_tokens": 4});
    let (st, _, v) = s.post(&s.run_url(&b.id), Some(&key_b), &flood).await;
    assert_eq!(st, 200, "{v}");
    let (st, rid, again) = s.post(&s.run_url(&a), Some(&s.key), &body).await;
    assert_eq!(st, 200, "{again}");
    assert_eq!(again["result"]["response"], first["result"]["response"]);
    let row = s.row(&rid).await;
    assert!(row.cached_host_tokens > 0, "{row:?}");
    assert_eq!(row.cached_disk_tokens, 0, "{row:?}");
    assert!(row.cached_host_tokens <= row.cached_tokens, "{row:?}");
    assert_eq!(row.cached_tokens, cached_of(&again), "{row:?}");
    s.settle().await;
    let (st, _, usage) = s.get(&s.account_url("usage"), Some(&s.key)).await;
    assert_eq!(st, 200, "{usage}");
    let totals = &usage["result"]["totals"];
    assert_eq!(
        totals["cached_host_tokens"],
        json!(row.cached_host_tokens),
        "{usage}"
    );
    assert_eq!(totals["cached_tokens"], json!(row.cached_tokens), "{usage}");
    s.wait_idle().await;
}
