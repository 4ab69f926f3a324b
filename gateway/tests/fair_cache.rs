//! Fair scheduling and the prefix cache over HTTP with the real model: cached_tokens
//! in both API shapes, the ledger and the usage API; per-tenant namespaces and salt
//! rotation through the admin API; priority ceilings a tenant cannot lift itself
//! above; a batch request past its queue deadline gets 503 with retry-after; the new
//! admin endpoints attacked without the admin token and with bad bodies.

mod common;

use common::*;
use reqwest::Method;
use serde_json::{json, Value};
use std::time::Duration;
use tessera_gateway::GatewayOptions;
use tessera_serving::EngineConfig;
use tessera_tenancy::Limits;

/// A user message long enough to fill several 16-token pages.
fn long_question() -> String {
    let mut s = String::from("Context for the question below.\n");
    for i in 0..30 {
        s.push_str(&format!(
            "Fact {i}: shelf {} holds {} blue jars.\n",
            i % 4,
            i + 2
        ));
    }
    s.push_str("Question: which shelf holds the most jars?");
    s
}

fn cached_of(usage: &Value) -> i64 {
    usage["prompt_tokens_details"]["cached_tokens"]
        .as_i64()
        .unwrap_or_else(|| panic!("no cached_tokens in {usage}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cached_tokens_are_reported_per_tenant_and_a_rotated_salt_misses() {
    let s = start().await;
    let (b, key_b) = s.tenant_with_key("beta", Limits::default()).await;
    let a = s.tenant.id.clone();
    let body = json!({"messages": [{"role": "user", "content": long_question()}], "max_tokens": 6});

    // Workers AI shape: a miss, then a hit with the same answer.
    let (st, rid1, v1) = s.post(&s.run_url(&a), Some(&s.key), &body).await;
    assert_eq!(st, 200, "{v1}");
    let u1 = &v1["result"]["usage"];
    let prompt = u1["prompt_tokens"].as_i64().unwrap();
    assert!(prompt > 200, "{u1}");
    assert_eq!(cached_of(u1), 0);
    let (st, rid2, v2) = s.post(&s.run_url(&a), Some(&s.key), &body).await;
    assert_eq!(st, 200, "{v2}");
    let u2 = &v2["result"]["usage"];
    assert_eq!(cached_of(u2), (prompt - 1) / 16 * 16, "{u2}");
    assert_eq!(v2["result"]["response"], v1["result"]["response"]);
    assert_eq!(u2["prompt_tokens"], u1["prompt_tokens"]);
    // The ledger carries it.
    assert_eq!(s.row(&rid1).await.cached_tokens, 0);
    assert_eq!(s.row(&rid2).await.cached_tokens, (prompt - 1) / 16 * 16);

    // OpenAI shape of the same conversation: same rendered prompt, a hit.
    let (st, rid3, v3) = s
        .post(
            &format!("{}/v1/chat/completions", s.base),
            Some(&s.key),
            &json!({"model": MODEL, "messages": body["messages"], "max_tokens": 6}),
        )
        .await;
    assert_eq!(st, 200, "{v3}");
    assert_eq!(cached_of(&v3["usage"]), (prompt - 1) / 16 * 16);
    assert_eq!(
        v3["choices"][0]["message"]["content"],
        v1["result"]["response"]
    );
    let cached3 = s.row(&rid3).await.cached_tokens;

    // Another tenant sending the same prompt: its own namespace, a miss.
    let (st, _, vb) = s.post(&s.run_url(&b.id), Some(&key_b), &body).await;
    assert_eq!(st, 200);
    assert_eq!(cached_of(&vb["result"]["usage"]), 0);
    assert_eq!(vb["result"]["response"], v1["result"]["response"]);
    // A client cannot choose its namespace: a third tenant naming the first's
    // account as a body `cache_salt` (the field vLLM takes from requests) still misses.
    let (c, key_c) = s.tenant_with_key("gamma", Limits::default()).await;
    let mut probe = body.clone();
    probe["cache_salt"] = json!(a);
    let (st, _, vc) = s.post(&s.run_url(&c.id), Some(&key_c), &probe).await;
    assert_eq!(st, 200, "{vc}");
    assert_eq!(cached_of(&vc["result"]["usage"]), 0, "{vc}");

    // The usage API sums it, per tenant.
    s.settle().await;
    let (st, _, uv) = s
        .get(
            &format!("{}/client/v4/accounts/{a}/ai/usage", s.base),
            Some(&s.key),
        )
        .await;
    assert_eq!(st, 200, "{uv}");
    assert_eq!(
        uv["result"]["totals"]["cached_tokens"].as_i64().unwrap(),
        (prompt - 1) / 16 * 16 + cached3
    );
    let (_, _, ub) = s
        .get(
            &format!("{}/client/v4/accounts/{}/ai/usage", s.base, b.id),
            Some(&key_b),
        )
        .await;
    assert_eq!(ub["result"]["totals"]["cached_tokens"], 0);

    // Rotating the salt through the admin API invalidates the tenant's entries.
    let (st, _, rv) = split(
        s.admin(
            Method::POST,
            &format!("/admin/v1/tenants/{a}/rotate-cache-salt"),
        )
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(st, 200, "{rv}");
    let (st, _, v4) = s.post(&s.run_url(&a), Some(&s.key), &body).await;
    assert_eq!(st, 200);
    assert_eq!(cached_of(&v4["result"]["usage"]), 0, "rotated: a miss");
    assert_eq!(v4["result"]["response"], v1["result"]["response"]);
    let (_, _, v5) = s.post(&s.run_url(&a), Some(&s.key), &body).await;
    assert!(
        cached_of(&v5["result"]["usage"]) > 0,
        "the new namespace fills"
    );
    let audit = s.store().audit_rows(0, i64::MAX, 1000).await.unwrap();
    assert!(audit
        .iter()
        .any(|r| r.action == "tenant.rotate_cache_salt" && r.target == a));
    s.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_lift_itself_above_its_class_and_expired_batch_work_gets_503() {
    // Every batch-class request expires at once in the queue: whether a request
    // ran as batch is visible as its 503.
    let engine = EngineConfig {
        batch_max_wait: Some(Duration::ZERO),
        ..EngineConfig::default()
    };
    let s = start_with_engine(GatewayOptions::default(), engine).await;
    let a = s.tenant.id.clone();
    let url = s.run_url(&a);
    let ask = |p: Option<&str>| {
        let mut b = json!({"prompt": "Hi", "max_tokens": 2});
        if let Some(p) = p {
            b["priority"] = json!(p);
        }
        b
    };
    assert_eq!(s.post(&url, Some(&s.key), &ask(None)).await.0, 200);
    assert_eq!(
        s.post(&url, Some(&s.key), &ask(Some("interactive")))
            .await
            .0,
        200
    );
    // Asking for batch: the request expires in the queue, a retryable 503.
    let resp = s
        .client
        .post(&url)
        .bearer_auth(&s.key)
        .json(&ask(Some("batch")))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    assert!(
        resp.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse::<u64>()
            .unwrap()
            >= 1
    );
    assert_eq!(resp.headers()["x-should-retry"], "true");
    let rid = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let row = s.row(&rid).await;
    assert_eq!((row.status, row.output_tokens), (503, 0));
    // Streaming: the status says it, not an error frame after a 200.
    let mut sb = ask(Some("batch"));
    sb["stream"] = json!(true);
    let resp = s
        .client
        .post(&url)
        .bearer_auth(&s.key)
        .json(&sb)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    // The header works too; OpenAI's service_tier=flex is batch.
    let resp = s
        .client
        .post(&url)
        .bearer_auth(&s.key)
        .header("x-tessera-priority", "batch")
        .json(&ask(None))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    let (st, _, v) = s
        .post(
            &format!("{}/v1/chat/completions", s.base),
            Some(&s.key),
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                    "max_tokens": 2, "service_tier": "flex"}),
        )
        .await;
    assert_eq!(st, 503, "{v}");
    let resp = s
        .client
        .post(&url)
        .bearer_auth(&s.key)
        .header("x-tessera-priority", "urgent")
        .json(&ask(None))
        .send()
        .await
        .unwrap();
    let (st, _, v) = split(resp).await;
    assert_eq!(st, 400, "{v}");

    // The admin caps the tenant at batch: asking for interactive (body or header)
    // no longer lifts it.
    let (st, _, v) = split(
        s.admin(Method::PUT, &format!("/admin/v1/tenants/{a}/scheduling"))
            .json(&json!({"max_priority": "batch", "weight": 3}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["result"]["scheduling"],
        json!({"weight": 3, "max_priority": "batch"})
    );
    let (_, _, t) = s.admin_get(&format!("/admin/v1/tenants/{a}")).await;
    assert_eq!(t["result"]["scheduling"]["max_priority"], "batch");
    assert!(
        t["result"].get("cache_salt").is_none(),
        "the salt is never shown"
    );
    assert_eq!(s.post(&url, Some(&s.key), &ask(None)).await.0, 503);
    assert_eq!(
        s.post(&url, Some(&s.key), &ask(Some("interactive")))
            .await
            .0,
        503
    );
    let resp = s
        .client
        .post(&url)
        .bearer_auth(&s.key)
        .header("x-tessera-priority", "interactive")
        .json(&ask(None))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    // A partial update keeps the other field.
    let (st, _, v) = split(
        s.admin(Method::PUT, &format!("/admin/v1/tenants/{a}/scheduling"))
            .json(&json!({"max_priority": "interactive"}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((st, &v["result"]["scheduling"]["weight"]), (200, &json!(3)));
    assert_eq!(s.post(&url, Some(&s.key), &ask(None)).await.0, 200);
    s.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_scheduling_and_salt_endpoints_refuse_tenants_and_bad_bodies() {
    let s = start().await;
    let a = s.tenant.id.clone();
    let before = s.store().tenant(&a).await.unwrap().unwrap();
    let sched = format!("/admin/v1/tenants/{a}/scheduling");
    let rotate = format!("/admin/v1/tenants/{a}/rotate-cache-salt");
    // A tenant's own key, no token, a wrong token: 401, nothing changes.
    for auth in [
        Some(s.key.as_str()),
        None,
        Some("not-the-admin-token-at-all-0123456789"),
    ] {
        for (m, path) in [(Method::PUT, &sched), (Method::POST, &rotate)] {
            let mut r = s
                .client
                .request(m.clone(), format!("{}{path}", s.base))
                .json(&json!({"weight": 1000, "max_priority": "interactive"}));
            if let Some(k) = auth {
                r = r.bearer_auth(k);
            }
            let st = r.send().await.unwrap().status();
            assert_eq!(st, 401, "{m} {path} with {auth:?}");
        }
    }
    // Bad bodies: 400 naming the problem; unknown tenants: 404.
    for bad in [
        json!({"weight": 0}),
        json!({"weight": 1001}),
        json!({"weight": -1}),
        json!({"weight": "2"}),
        json!({"max_priority": "urgent"}),
        json!({"cache_salt": "x"}),
        json!({"weight": 2, "namespace": "victim"}),
    ] {
        let (st, _, v) = split(
            s.admin(Method::PUT, &sched)
                .json(&bad)
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(st, 400, "{bad}: {v}");
    }
    let (st, _, _) = split(
        s.admin(Method::PUT, "/admin/v1/tenants/nope/scheduling")
            .json(&json!({"weight": 2}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(st, 404);
    let (st, _, _) = split(
        s.admin(Method::POST, "/admin/v1/tenants/nope/rotate-cache-salt")
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(st, 404);
    let after = s.store().tenant(&a).await.unwrap().unwrap();
    assert_eq!(
        (after.scheduling, after.cache_namespace()),
        (before.scheduling, before.cache_namespace()),
        "nothing changed"
    );
    assert!(s
        .store()
        .audit_rows(0, i64::MAX, 1000)
        .await
        .unwrap()
        .is_empty());
}

/// Issue 9, item 4: a 503 from a busy backend (here a batch request that expired
/// in the queue before any compute) charges nothing: no daily tokens used or left
/// reserved, no tokens in its ledger row, its slot given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_503_charges_nothing() {
    let engine = EngineConfig {
        batch_max_wait: Some(Duration::ZERO),
        ..EngineConfig::default()
    };
    let s = start_with_engine(GatewayOptions::default(), engine).await;
    let lim = Limits {
        daily_tokens: 100_000,
        ..Limits::UNLIMITED
    };
    let (t, key) = s.tenant_with_key("busy", lim).await;
    let resp = s
        .client
        .post(s.run_url(&t.id))
        .bearer_auth(&key)
        .json(&json!({"prompt": "Tell me about the sea.", "max_tokens": 64, "priority": "batch"}))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 503);
    let rid = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let row = s.row(&rid).await;
    assert_eq!(
        (
            row.status,
            row.input_tokens,
            row.output_tokens,
            row.cached_tokens
        ),
        (503, 0, 0, 0),
        "{row:?}"
    );
    assert_eq!(s.state.limiter.inflight(&t.id), 0);
    let daily = s.state.limiter.daily(&t.id).expect("a daily counter");
    assert_eq!((daily.used, daily.reserved), (0, 0), "{daily:?}");
    s.wait_idle().await;
}
