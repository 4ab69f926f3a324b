//! Gateway edge hardening (issue 9) over real sockets with the real model: admin
//! access, anonymous traffic, limits that cannot be overdrawn, keys (scopes,
//! expiry, revocation in flight), the usage API's limits and the ledger retention.
//! Connection timeouts are in `connections.rs`, body fuzzing in `bodies.rs`.

mod common;

use common::*;
use futures_util::StreamExt;
use reqwest::Method;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tessera_gateway::{Deadlines, GatewayOptions, UsageConfig};
use tessera_tenancy::{Limits, NewKey, Scopes, TenantStatus, UsageRecord};

fn db_bytes(s: &TestServer) -> u64 {
    ["tessera.db", "tessera.db-wal"]
        .iter()
        .map(|f| {
            std::fs::metadata(s.dir.path().join(f))
                .map(|m| m.len())
                .unwrap_or(0)
        })
        .sum()
}

const METRICS_TOKEN: &str = "metrics-only-token-0123456789abcdef";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn short_or_empty_tokens_are_refused_and_empty_authorization_never_matches() {
    let cfg = GatewayOptions {
        metrics_token: Some(METRICS_TOKEN.into()),
        ..GatewayOptions::default()
    };
    let s = start_with(cfg).await;
    // Binding with an empty or short token fails, naming the token.
    for (admin, metrics) in [
        (Some(""), None),
        (Some("   "), None),
        (Some("short-admin-token"), None),
        (Some(ADMIN), Some("short")),
    ] {
        let cfg = GatewayOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            admin_token: admin.map(String::from),
            metrics_token: metrics.map(String::from),
            ..GatewayOptions::default()
        };
        let err = tessera_gateway::Server::bind(&cfg, s.state.clone())
            .await
            .unwrap_err()
            .to_string();
        let what = if metrics.is_some() {
            "metrics token"
        } else {
            "admin token"
        };
        assert!(
            err.contains(what) && err.contains("at least 32"),
            "{admin:?}: {err}"
        );
    }
    // Missing, empty or malformed Authorization never matches.
    let url = format!("{}/admin/v1/tenants", s.base);
    for auth in [
        None,
        Some(""),
        Some("Bearer"),
        Some("Bearer "),
        Some("Basic dGVzdA=="),
        Some(METRICS_TOKEN),
    ] {
        let mut r = s.client.get(&url);
        if let Some(a) = auth {
            r = r.header("authorization", a);
        }
        let (st, rid, v) = split(r.send().await.unwrap()).await;
        assert_eq!(
            (st, v["errors"][0]["code"].as_i64()),
            (401, Some(10000)),
            "{auth:?}"
        );
        assert_eq!(rid.len(), 32);
    }
    // The metrics token reads /metrics and nothing else.
    let metrics = |tok: &str| {
        s.client
            .get(format!("{}/metrics", s.base))
            .bearer_auth(tok)
            .send()
    };
    assert_eq!(metrics(METRICS_TOKEN).await.unwrap().status(), 200);
    assert_eq!(metrics(ADMIN).await.unwrap().status(), 200);
    assert_eq!(metrics(&s.key).await.unwrap().status(), 401);
    for (method, path) in [
        (Method::GET, "/admin/v1/tenants".to_string()),
        (Method::POST, "/admin/v1/tenants".to_string()),
        (Method::GET, "/admin/v1/audit".to_string()),
        (
            Method::POST,
            format!("/admin/v1/tenants/{}/suspend", s.tenant.id),
        ),
    ] {
        let st = s
            .client
            .request(method.clone(), format!("{}{path}", s.base))
            .bearer_auth(METRICS_TOKEN)
            .json(&json!({"name": "x"}))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(st, 401, "{method} {path} with the metrics token");
    }
    // The scheme is case-insensitive; the admin token works.
    let st = s
        .client
        .get(&url)
        .header("authorization", format!("bearer {ADMIN}"))
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(st, 200);
    // None of the refused attempts wrote anything.
    assert_eq!(s.state.metrics.refused_count("admin_auth"), 11);
    let audit = s.store().audit_rows(0, i64::MAX, 1000).await.unwrap();
    assert!(audit.is_empty(), "{audit:?}");
    let t = s.store().tenant(&s.tenant.id).await.unwrap().unwrap();
    assert_eq!(t.status, TenantStatus::Active);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_listener_takes_the_admin_api_and_metrics_off_the_public_port() {
    let cfg = GatewayOptions {
        admin_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..GatewayOptions::default()
    };
    let s = start_with(cfg).await;
    let admin_base = s.admin_base.clone().expect("admin listener");
    assert_ne!(admin_base, s.base);
    for path in ["/admin/v1/tenants", "/metrics", "/admin/v1/audit"] {
        let (st, _, v) = split(
            s.client
                .get(format!("{}{path}", s.base))
                .bearer_auth(ADMIN)
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(
            (st, v["errors"][0]["code"].as_i64()),
            (404, Some(7000)),
            "public {path}"
        );
    }
    let (st, _, v) = s.admin_get("/admin/v1/tenants").await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["result"][0]["id"], s.tenant.id);
    assert_eq!(
        s.admin(Method::GET, "/metrics")
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    // The admin listener serves no inference, and still wants the token.
    let (st, _, _) = split(
        s.client
            .post(format!(
                "{admin_base}/client/v4/accounts/{}/ai/run/{MODEL}",
                s.tenant.id
            ))
            .bearer_auth(&s.key)
            .json(&json!({"prompt": "Hi", "max_tokens": 2}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(st, 404);
    let st = s
        .client
        .get(format!("{admin_base}/admin/v1/tenants"))
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(st, 401);
    // The public port still serves inference.
    let (st, _, v) = s
        .post(
            &s.run_url(&s.tenant.id),
            Some(&s.key),
            &json!({"prompt": "Hi", "max_tokens": 2}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_admin_action_appends_one_audit_row_and_new_tenants_get_default_limits() {
    let defaults = Limits {
        requests_per_minute: 77,
        input_tokens_per_minute: 7_000,
        output_tokens_per_minute: 700,
        max_concurrent: 7,
        daily_tokens: 70_000,
    };
    let cfg = GatewayOptions {
        default_limits: defaults,
        ..GatewayOptions::default()
    };
    let s = start_with(cfg).await;
    let mut want: Vec<(String, String, String)> = Vec::new(); // (action, target, request id)
    let call = |m: Method, path: String, body: Value| {
        let r = s.admin(m, &path).json(&body);
        async move { split(r.send().await.unwrap()).await }
    };
    // Create with a key: two rows under one request id.
    let (st, rid, v) = call(
        Method::POST,
        "/admin/v1/tenants".into(),
        json!({"name": "gamma", "create_key": true}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let id = v["result"]["tenant"]["id"].as_str().unwrap().to_string();
    let key_id = v["result"]["key"]["info"]["key_id"]
        .as_str()
        .unwrap()
        .to_string();
    // No limits given: the configured defaults, not "unlimited".
    assert_eq!(v["result"]["tenant"]["limits"], json!(defaults));
    want.push(("tenant.create".into(), id.clone(), rid.clone()));
    want.push(("key.create".into(), key_id.clone(), rid));
    // Partial limits: the rest from the defaults.
    let (_, rid, v) = call(
        Method::POST,
        "/admin/v1/tenants".into(),
        json!({"name": "delta", "limits": {"max_concurrent": 3}}),
    )
    .await;
    let delta = v["result"]["tenant"]["id"].as_str().unwrap().to_string();
    assert_eq!(
        v["result"]["tenant"]["limits"],
        json!(Limits {
            max_concurrent: 3,
            ..defaults
        })
    );
    want.push(("tenant.create".into(), delta, rid));
    for action in ["suspend", "activate"] {
        let (st, rid, _) = call(
            Method::POST,
            format!("/admin/v1/tenants/{id}/{action}"),
            json!({}),
        )
        .await;
        assert_eq!(st, 200);
        want.push((format!("tenant.{action}"), id.clone(), rid));
    }
    // Limits: a patch over the tenant's current limits.
    let (st, rid, v) = call(
        Method::PUT,
        format!("/admin/v1/tenants/{id}/limits"),
        json!({"daily_tokens": 5}),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["result"]["limits"],
        json!(Limits {
            daily_tokens: 5,
            ..defaults
        })
    );
    want.push(("tenant.limits".into(), id.clone(), rid));
    let (_, rid, v) = call(
        Method::POST,
        format!("/admin/v1/tenants/{id}/keys"),
        json!({"name": "ci", "scopes": ["usage:read"], "expires_in_secs": 3600}),
    )
    .await;
    let key2 = v["result"]["info"]["key_id"].as_str().unwrap().to_string();
    assert_eq!(v["result"]["info"]["scopes"], json!(["usage:read"]));
    want.push(("key.create".into(), key2, rid));
    let (st, rid, _) = call(
        Method::POST,
        format!("/admin/v1/keys/{key_id}/revoke"),
        json!({}),
    )
    .await;
    assert_eq!(st, 200);
    want.push(("key.revoke".into(), key_id.clone(), rid));
    // Failed and read-only actions write nothing.
    for (m, path, body) in [
        (
            Method::POST,
            "/admin/v1/tenants/nope/suspend".to_string(),
            json!({}),
        ),
        (
            Method::POST,
            format!("/admin/v1/keys/{key_id}/revoke"),
            json!({}),
        ),
        (
            Method::PUT,
            format!("/admin/v1/tenants/{id}/limits"),
            json!({"rpm": 1}),
        ),
        (Method::POST, "/admin/v1/tenants".into(), json!({"name": 5})),
        (Method::GET, "/admin/v1/tenants".into(), json!({})),
        (
            Method::GET,
            format!("/admin/v1/tenants/{id}/keys"),
            json!({}),
        ),
    ] {
        let (st, _, v) = call(m.clone(), path.clone(), body).await;
        assert!(st == 200 || st == 400 || st == 404, "{m} {path}: {st} {v}");
    }
    // The unknown field was refused, naming it.
    let (st, _, v) = call(
        Method::PUT,
        format!("/admin/v1/tenants/{id}/limits"),
        json!({"rpm": 1}),
    )
    .await;
    assert_eq!(st, 400);
    assert!(
        v["errors"][0]["message"].as_str().unwrap().contains("rpm"),
        "{v}"
    );
    // The log: exactly the successful changes, in order, with who made them.
    let (st, _, v) = s.admin_get("/admin/v1/audit").await;
    assert_eq!(st, 200, "{v}");
    let rows = v["result"].as_array().unwrap();
    let got: Vec<(String, String, String)> = rows
        .iter()
        .map(|r| {
            (
                r["action"].as_str().unwrap().into(),
                r["target"].as_str().unwrap().into(),
                r["request_id"].as_str().unwrap().into(),
            )
        })
        .collect();
    assert_eq!(got, want);
    for r in rows {
        let src = r["source"].as_str().unwrap();
        assert!(src.starts_with("127.0.0.1:"), "{src}");
        assert!(r["at_ms"].as_i64().unwrap() > 0);
        assert!(!r.to_string().contains("tsk_"), "no key in the log: {r}");
    }
    let (_, _, v) = s.admin_get("/admin/v1/audit?limit=2").await;
    assert_eq!(v["result"].as_array().unwrap().len(), 2);
    let (st, _, _) = s.admin_get("/admin/v1/audit?limit=0").await;
    assert_eq!(st, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_thousand_anonymous_requests_write_nothing_and_tenants_are_still_served() {
    let s = start().await;
    let ok_body = json!({"prompt": "Hi", "max_tokens": 2});
    // Warm up and measure an authenticated request alone.
    let mut alone = Vec::new();
    for _ in 0..3 {
        let t = Instant::now();
        let (st, _, _) = s
            .post(&s.run_url(&s.tenant.id), Some(&s.key), &ok_body)
            .await;
        assert_eq!(st, 200);
        alone.push(t.elapsed());
    }
    s.settle().await;
    let rows = s.row_count().await;
    let bytes = db_bytes(&s);
    let long_model = "a".repeat(30_000);
    let long_account = "b".repeat(5_000);
    let unknown_key = format!("tsk_{}_{}", "0".repeat(16), "1".repeat(64));
    let wrong_secret = format!("{}{}", &s.key[..s.key.len() - 4], "0000");
    let client = reqwest::Client::new();
    let flood = |n: usize| {
        let s = &s;
        let client = client.clone();
        let (long_model, long_account) = (long_model.clone(), long_account.clone());
        let (unknown_key, wrong_secret) = (unknown_key.clone(), wrong_secret.clone());
        futures_util::stream::iter(0..n)
            .map(move |i| {
                let r = match i % 6 {
                    0 => client.post(format!(
                        "{}/client/v4/accounts/x/ai/run/{long_model}",
                        s.base
                    )),
                    1 => client
                        .post(format!(
                            "{}/client/v4/accounts/{long_account}/ai/run/{MODEL}",
                            s.base
                        ))
                        .bearer_auth(&s.key),
                    2 => client.post(s.run_url(&s.tenant.id)),
                    3 => client.post(s.run_url(&s.tenant.id)).bearer_auth("sk-nope"),
                    4 => client
                        .post(s.run_url(&s.tenant.id))
                        .bearer_auth(&unknown_key),
                    _ => client
                        .post(format!("{}/v1/chat/completions", s.base))
                        .bearer_auth(&wrong_secret),
                };
                async move {
                    let st = r.body("{\"prompt\": \"x\"}").send().await.unwrap().status();
                    assert!(st == 400 || st == 401, "{st}");
                }
            })
            .buffer_unordered(32)
            .collect::<Vec<()>>()
    };
    flood(5_000).await;
    s.settle().await;
    assert_eq!(
        s.row_count().await,
        rows,
        "anonymous requests wrote ledger rows"
    );
    assert_eq!(db_bytes(&s), bytes, "the database grew");
    let m = &s.state.metrics;
    let refused: u64 = [
        "path_too_long",
        "missing_key",
        "malformed_key",
        "invalid_key",
    ]
    .iter()
    .map(|r| m.refused_count(r))
    .sum();
    assert_eq!(refused, 5_000);
    let long_paths = (0..5_000).filter(|i| i % 6 < 2).count() as u64;
    assert_eq!(m.refused_count("path_too_long"), long_paths);
    // Flood again while the tenant works: every one of its requests is served and
    // recorded, nothing else is.
    let tenant = async {
        let mut during = Vec::new();
        for _ in 0..5 {
            let t = Instant::now();
            let (st, _, v) = s
                .post(&s.run_url(&s.tenant.id), Some(&s.key), &ok_body)
                .await;
            assert_eq!(st, 200, "{v}");
            during.push(t.elapsed());
        }
        during
    };
    let (during, _) = tokio::join!(tenant, flood(5_000));
    s.settle().await;
    assert_eq!(s.row_count().await, rows + 5);
    eprintln!("authenticated latency alone: {alone:?}; during the flood: {during:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn twenty_parallel_requests_at_the_quota_edge_never_exceed_it() {
    let s = start().await;
    let body = json!({"prompt": "Hi", "max_tokens": 16});
    let (_, _, v) = s.post(&s.run_url(&s.tenant.id), Some(&s.key), &body).await;
    let p = v["result"]["usage"]["prompt_tokens"].as_i64().unwrap();
    // Room for three reservations of prompt + max_tokens, and change.
    let quota = 3 * (p + 16) + 5;
    let (t, key) = s
        .tenant_with_key(
            "edge",
            Limits {
                daily_tokens: quota as u64,
                ..Limits::UNLIMITED
            },
        )
        .await;
    let url = s.run_url(&t.id);
    let answers =
        futures_util::future::join_all((0..20).map(|_| s.post(&url, Some(&key), &body))).await;
    s.settle().await;
    let ok = answers.iter().filter(|a| a.0 == 200).count();
    let quota_refusals = answers
        .iter()
        .filter(|a| a.0 == 429 && a.2["errors"][0]["code"] == 3036)
        .count();
    assert_eq!(ok + quota_refusals, 20, "{answers:?}");
    assert!((3..20).contains(&ok), "{ok} served");
    let rows = s.store().usage_rows(Some(&t.id)).await.unwrap();
    assert_eq!(rows.len(), ok, "refusals write no row");
    let used: i64 = rows.iter().map(|r| r.input_tokens + r.output_tokens).sum();
    assert!(used <= quota, "used {used} of a quota of {quota}");
    // The counter agrees with the ledger, and nothing stays reserved.
    let d = s.state.limiter.daily(&t.id).unwrap();
    assert_eq!((d.used, d.reserved), (used, 0));
    assert_eq!(s.state.limiter.inflight(&t.id), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changing_limits_keeps_counting_running_requests() {
    let s = start().await;
    let one = Limits {
        max_concurrent: 1,
        ..Limits::UNLIMITED
    };
    let (t, key) = s.tenant_with_key("serial", one).await;
    let first = s.open_stream(&t.id, &key, 400).await;
    let small = json!({"prompt": "Hi", "max_tokens": 2});
    let changed = Limits {
        requests_per_minute: 1000,
        ..one
    };
    s.store().set_limits(&t.id, changed).await.unwrap();
    let (st, _, v) = s.post(&s.run_url(&t.id), Some(&key), &small).await;
    assert_eq!(st, 429, "the running request must still count: {v}");
    assert_eq!(s.state.limiter.inflight(&t.id), 1);
    // Raised to two: exactly one more runs beside it.
    s.store()
        .set_limits(
            &t.id,
            Limits {
                max_concurrent: 2,
                ..changed
            },
        )
        .await
        .unwrap();
    let second = s.open_stream(&t.id, &key, 400).await;
    let (st, _, _) = s.post(&s.run_url(&t.id), Some(&key), &small).await;
    assert_eq!(st, 429);
    assert_eq!(s.state.limiter.inflight(&t.id), 2);
    drop((first, second));
    s.settle().await;
    assert_eq!(s.state.limiter.inflight(&t.id), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_by_a_later_limit_returns_the_earlier_allowances() {
    let s = start().await;
    let lim = Limits {
        requests_per_minute: 1,
        input_tokens_per_minute: 5,
        max_concurrent: 1,
        ..Limits::UNLIMITED
    };
    let (t, key) = s.tenant_with_key("tight", lim).await;
    let body = json!({"prompt": "Hello there, how are you?", "max_tokens": 2});
    let resp = s
        .client
        .post(s.run_url(&t.id))
        .bearer_auth(&key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-should-retry"], "false");
    let (st, _, v) = split(resp).await;
    assert_eq!(st, 429);
    assert!(
        v["errors"][0]["message"]
            .as_str()
            .unwrap()
            .contains("input_tokens_per_minute"),
        "{v}"
    );
    // The request allowance and the slot came back: with the token limit lifted,
    // the one request of this minute still runs.
    assert_eq!(s.state.limiter.inflight(&t.id), 0);
    s.store()
        .set_limits(
            &t.id,
            Limits {
                input_tokens_per_minute: 0,
                ..lim
            },
        )
        .await
        .unwrap();
    let (st, _, v) = s.post(&s.run_url(&t.id), Some(&key), &body).await;
    assert_eq!(st, 200, "{v}");
    let (st, _, v) = s.post(&s.run_url(&t.id), Some(&key), &body).await;
    assert_eq!(st, 429, "{v}");
    assert!(v["errors"][0]["message"]
        .as_str()
        .unwrap()
        .contains("requests_per_minute"));
}

/// Co-located engine running one sequence at a time: a request whose client goes
/// away while it waits for the engine is dropped without being computed, charges
/// nothing, and keeps its slot until the engine has let go of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_abandoned_before_its_prefill_is_dropped_uncomputed_and_free() {
    let engine = tessera_serving::EngineConfig {
        max_running: 1,
        ..tessera_serving::EngineConfig::default()
    };
    let s = start_with_engine(GatewayOptions::default(), engine).await;
    let lim = Limits {
        max_concurrent: 4,
        daily_tokens: 1_000_000,
        ..Limits::UNLIMITED
    };
    let (t, key) = s.tenant_with_key("queue", lim).await;
    let a = s.open_stream(&t.id, &key, 2000).await;
    let b = s
        .client
        .post(s.run_url(&t.id))
        .bearer_auth(&key)
        .json(
            &json!({"prompt": "What is the capital of France?", "max_tokens": 50, "stream": true}),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(b.status(), 200);
    let b_rid = b.headers()["x-request-id"].to_str().unwrap().to_string();
    // B is queued behind A (the engine publishes its counters after each step).
    let mut queued = false;
    for _ in 0..200 {
        let st = s.state.engine.stats();
        if (st.running, st.waiting) == (1, 1) {
            queued = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(queued, "{:?}", s.state.engine.stats());
    assert_eq!(s.state.limiter.inflight(&t.id), 2);
    let reserved_both = s.state.limiter.daily(&t.id).unwrap().reserved;
    drop(b);
    // B leaves the queue while A still runs (it is not waiting for A to finish
    // and then prefilled for nobody).
    let mut left = false;
    for _ in 0..200 {
        let st = s.state.engine.stats();
        if st.waiting == 0 {
            assert_eq!(st.running, 1, "A still runs");
            left = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        left,
        "abandoned request still queued: {:?}",
        s.state.engine.stats()
    );
    let row = s.row(&b_rid).await;
    // The row comes after the engine let go (the slot was held until then).
    assert_eq!(s.state.engine.stats().waiting, 0);
    assert_eq!(
        (row.status, row.error_code, row.finish.as_str()),
        (499, 3008, "aborted")
    );
    assert_eq!(
        (row.input_tokens, row.output_tokens),
        (0, 0),
        "charged nothing"
    );
    assert_eq!(s.state.limiter.inflight(&t.id), 1);
    let d = s.state.limiter.daily(&t.id).unwrap();
    assert!(
        d.reserved < reserved_both,
        "B's reservation was returned: {d:?}"
    );
    assert_eq!(d.used, 0);
    drop(a);
    s.settle().await;
    s.wait_idle().await;
    assert_eq!(s.state.limiter.inflight(&t.id), 0);
}

/// A server whose request deadlines are `d`.
async fn with_deadlines(d: Deadlines) -> TestServer {
    start_with(GatewayOptions {
        deadlines: d,
        ..GatewayOptions::default()
    })
    .await
}

/// Waits until nothing runs, then stops the server.
async fn finish(s: TestServer) {
    s.settle().await;
    s.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deadlines_end_requests_as_timeouts_3007() {
    // No first token within 1 ms: nothing computed is charged.
    let s = with_deadlines(Deadlines {
        first_token: Duration::from_millis(1),
        ..Deadlines::default()
    })
    .await;
    let prompt = "Write a long story about a tessellation. ".repeat(40);
    let (st, rid, v) = s
        .post(
            &s.run_url(&s.tenant.id),
            Some(&s.key),
            &json!({"prompt": prompt, "max_tokens": 8}),
        )
        .await;
    assert_eq!(
        (st, v["errors"][0]["code"].as_i64()),
        (408, Some(3007)),
        "{v}"
    );
    assert!(v["errors"][0]["message"]
        .as_str()
        .unwrap()
        .contains("first token"));
    let row = s.row(&rid).await;
    assert_eq!(
        (row.status, row.error_code, row.finish.as_str()),
        (408, 3007, "aborted")
    );
    // Charged only what was computed: nothing if the abort stopped the prefill, the
    // prompt (and the first token) if the prefill had already finished.
    assert!(
        (row.input_tokens, row.output_tokens) == (0, 0)
            || (row.input_tokens > 0 && row.output_tokens >= 1),
        "{row:?}"
    );
    let (st, _, v) = s
        .post(
            &format!("{}/v1/chat/completions", s.base),
            Some(&s.key),
            &json!({"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 8}),
        )
        .await;
    assert_eq!(
        (st, v["error"]["type"].as_str()),
        (408, Some("timeout_error")),
        "{v}"
    );
    finish(s).await;

    // A total deadline of 1 s on a long stream: an error frame, no [DONE].
    let s = with_deadlines(Deadlines {
        total: Duration::from_secs(1),
        ..Deadlines::default()
    })
    .await;
    let (resp, first) = s.open_stream_with_first(&s.tenant.id, &s.key, 2000).await;
    let rid = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let body = first + &rest_of(resp).await;
    assert!(!body.contains("[DONE]"), "{body}");
    assert_eq!(last_frame(&body)["error"]["code"], 3007, "{body}");
    let row = s.row(&rid).await;
    assert_eq!((row.status, row.error_code), (408, 3007));
    assert!(row.output_tokens >= 1 && row.input_tokens > 0, "{row:?}");
    finish(s).await;

    // A body that stops arriving: 408 after the body deadline, with a row.
    let s = with_deadlines(Deadlines {
        body_read: Duration::from_millis(500),
        ..Deadlines::default()
    })
    .await;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut c = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let head = format!(
        "POST /client/v4/accounts/{}/ai/run/{MODEL} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"prompt\":",
        s.tenant.id, s.key
    );
    c.write_all(head.as_bytes()).await.unwrap();
    let mut resp = vec![0u8; 4096];
    let n = tokio::time::timeout(Duration::from_secs(10), c.read(&mut resp))
        .await
        .expect("answered before the client finished")
        .unwrap();
    let text = String::from_utf8_lossy(&resp[..n]);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("3007"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revoking_a_key_or_suspending_a_tenant_ends_its_streams_within_a_second() {
    let s = start().await;
    // Revoked through the admin API.
    let (t, key) = s.tenant_with_key("victim", Limits::UNLIMITED).await;
    let (_, other_key) = s.store().create_key(&t.id, "other").await.unwrap();
    let stream = s.open_stream(&t.id, &key, 2000).await;
    let untouched = s.open_stream(&t.id, &other_key, 2000).await;
    let rid = stream.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    let reader = tokio::spawn(async move {
        let body = rest_of(stream).await;
        (Instant::now(), body)
    });
    let revoked_at = Instant::now();
    let st = s
        .admin(
            Method::POST,
            &format!("/admin/v1/keys/{}/revoke", &key[4..20]),
        )
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(st, 200);
    let (ended, body) = reader.await.unwrap();
    let took = ended.duration_since(revoked_at);
    assert!(
        took < Duration::from_secs(1),
        "stream ended {took:?} after the revoke"
    );
    assert!(!body.contains("[DONE]"), "{body}");
    assert_eq!(last_frame(&body)["error"]["code"], 10000, "{body}");
    let row = s.row(&rid).await;
    assert_eq!(
        (row.status, row.error_code, row.finish.as_str()),
        (401, 10000, "aborted")
    );
    // Another key of the same tenant keeps streaming.
    let mut untouched = untouched;
    assert!(untouched.chunk().await.unwrap().is_some());
    drop(untouched);

    // Suspended in the store directly (the CLI's way; the watcher polls).
    let (t2, key2) = s.tenant_with_key("suspended", Limits::UNLIMITED).await;
    let stream = s.open_stream(&t2.id, &key2, 2000).await;
    let rid = stream.headers()["x-request-id"]
        .to_str()
        .unwrap()
        .to_string();
    let reader = tokio::spawn(async move {
        let body = rest_of(stream).await;
        (Instant::now(), body)
    });
    let at = Instant::now();
    s.store()
        .set_status(&t2.id, TenantStatus::Suspended)
        .await
        .unwrap();
    let (ended, body) = reader.await.unwrap();
    let took = ended.duration_since(at);
    assert!(
        took < Duration::from_secs(1),
        "stream ended {took:?} after the suspension"
    );
    assert_eq!(last_frame(&body)["error"]["code"], 10000, "{body}");
    assert_eq!(s.row(&rid).await.status, 403);

    // A key that expires mid-stream ends it too.
    let (t3, _) = s.tenant_with_key("expiring", Limits::UNLIMITED).await;
    let expires_ms = tessera_tenancy::now_ms() + 1500;
    let (_, key3) = s
        .store()
        .create_key_with(
            &t3.id,
            &NewKey {
                name: "short".into(),
                scopes: Scopes::ALL,
                expires_ms: Some(expires_ms),
            },
        )
        .await
        .unwrap();
    let stream = s.open_stream(&t3.id, &key3, 4000).await;
    let body = rest_of(stream).await;
    let late = tessera_tenancy::now_ms() - expires_ms;
    assert!(late < 1000, "ended {late} ms after the expiry");
    assert_eq!(last_frame(&body)["error"]["code"], 10000, "{body}");
    s.settle().await;
    s.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn key_scopes_and_expiry_are_enforced() {
    let s = start().await;
    let create = |body: Value| {
        let r = s
            .admin(
                Method::POST,
                &format!("/admin/v1/tenants/{}/keys", s.tenant.id),
            )
            .json(&body);
        async move { split(r.send().await.unwrap()).await }
    };
    let (_, _, v) = create(json!({"name": "reader", "scopes": ["usage:read"]})).await;
    let reader = v["result"]["secret"].as_str().unwrap().to_string();
    let (_, _, v) = create(json!({"name": "runner", "scopes": "inference"})).await;
    let runner = v["result"]["secret"].as_str().unwrap().to_string();
    let body = json!({"prompt": "Hi", "max_tokens": 2});
    let (st, _, v) = s.post(&s.run_url(&s.tenant.id), Some(&reader), &body).await;
    assert_eq!(
        (st, v["errors"][0]["code"].as_i64()),
        (403, Some(10000)),
        "{v}"
    );
    assert!(v["errors"][0]["message"]
        .as_str()
        .unwrap()
        .contains("`inference` scope"));
    let (st, _, v) = s
        .post(
            &format!("{}/v1/chat/completions", s.base),
            Some(&reader),
            &json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}),
        )
        .await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (403, Some("permission_denied"))
    );
    assert_eq!(
        s.get(&format!("{}/v1/models", s.base), Some(&reader))
            .await
            .0,
        403
    );
    assert_eq!(s.get(&s.account_url("usage"), Some(&reader)).await.0, 200);
    let (st, _, v) = s.get(&s.account_url("usage"), Some(&runner)).await;
    assert_eq!((st, v["errors"][0]["code"].as_i64()), (403, Some(10000)));
    assert_eq!(
        s.post(&s.run_url(&s.tenant.id), Some(&runner), &body)
            .await
            .0,
        200
    );
    assert_eq!(s.state.metrics.refused_count("scope"), 4);
    // Bad scopes and expiries are 400s naming the field.
    for (b, field) in [
        (json!({"scopes": ["admin"]}), "scopes"),
        (json!({"scopes": []}), "scopes"),
        (json!({"scopes": 5}), "scopes"),
        (json!({"expires_at": "2001-01-01"}), "expires_at"),
        (json!({"expires_at": "soon"}), "expires_at"),
        (json!({"expires_in_secs": 0}), "expires_in_secs"),
    ] {
        let (st, _, v) = create(b.clone()).await;
        assert_eq!(st, 400, "{b}");
        assert!(
            v["errors"][0]["message"].as_str().unwrap().contains(field),
            "{b}: {v}"
        );
    }
    // Expiry.
    let (_, _, v) = create(json!({"name": "brief", "expires_in_secs": 1})).await;
    let brief = v["result"]["secret"].as_str().unwrap().to_string();
    assert_eq!(
        s.post(&s.run_url(&s.tenant.id), Some(&brief), &body)
            .await
            .0,
        200
    );
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let (st, _, v) = s.post(&s.run_url(&s.tenant.id), Some(&brief), &body).await;
    assert_eq!(st, 401, "{v}");
    assert!(v["errors"][0]["message"]
        .as_str()
        .unwrap()
        .contains("expired"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_api_has_its_own_rate_limit_and_a_bounded_range() {
    let cfg = GatewayOptions {
        usage: UsageConfig {
            queries_per_minute: 3,
            ..UsageConfig::default()
        },
        ..GatewayOptions::default()
    };
    let s = start_with(cfg).await;
    let url = |q: &str| s.account_url(&format!("usage{q}"));
    assert_eq!(s.get(&url(""), Some(&s.key)).await.0, 200);
    // Over 31 days, and backwards: 400 naming `since` (these count as queries).
    let (st, _, v) = s.get(&url("?since=2000-01-01"), Some(&s.key)).await;
    assert_eq!(st, 400, "{v}");
    assert!(
        v["errors"][0]["message"]
            .as_str()
            .unwrap()
            .contains("`since`"),
        "{v}"
    );
    let (st, _, _) = s
        .get(&url("?since=2026-02-01&until=2026-01-01"), Some(&s.key))
        .await;
    assert_eq!(st, 400);
    let (st, _, v) = s.get(&url(""), Some(&s.key)).await;
    assert_eq!(
        (st, v["errors"][0]["code"].as_i64()),
        (429, Some(3040)),
        "{v}"
    );
    // Inference is limited apart.
    let (st, _, _) = s
        .post(
            &s.run_url(&s.tenant.id),
            Some(&s.key),
            &json!({"prompt": "Hi", "max_tokens": 2}),
        )
        .await;
    assert_eq!(st, 200);
    // Another tenant has its own allowance.
    let (b, key_b) = s.tenant_with_key("beta", Limits::UNLIMITED).await;
    let b_url = format!("{}/client/v4/accounts/{}/ai/usage", s.base, b.id);
    assert_eq!(s.get(&b_url, Some(&key_b)).await.0, 200);
    assert_eq!(s.state.metrics.refused_count("usage_queries_per_minute"), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ledger_rows_past_the_retention_are_pruned() {
    let cfg = GatewayOptions {
        usage: UsageConfig {
            retention: Some(Duration::from_secs(86_400)),
            prune_interval: Duration::from_millis(100),
            ..UsageConfig::default()
        },
        ..GatewayOptions::default()
    };
    let s = start_with(cfg).await;
    let now = tessera_tenancy::now_ms();
    for (id, age_ms) in [("old", 2 * 86_400_000), ("fresh", 3_600_000)] {
        let r = UsageRecord {
            request_id: id.into(),
            tenant_id: s.tenant.id.clone(),
            model: MODEL.into(),
            endpoint: "test".into(),
            status: 200,
            finish: "stop".into(),
            created_ms: now - age_ms,
            ..UsageRecord::default()
        };
        assert!(s.store().record_usage(&r).await.unwrap());
    }
    let mut gone = false;
    for _ in 0..100 {
        if s.store().usage_row("old").await.unwrap().is_none() {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(gone, "the old row was not pruned");
    assert!(s.store().usage_row("fresh").await.unwrap().is_some());
    let m = s.metrics_text().await;
    assert!(m.contains("tessera_usage_rows_pruned_total 1"), "{m}");
}

/// Issue 9, item 4: auth and the request-rate and concurrency limits are checked
/// before the body is read. A tenant over its request rate that sends headers and
/// withholds the body gets its 429 at once; were the body read first, the server
/// would wait for it until the body deadline (30 s) and answer 408.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limits_refuse_before_the_body_is_read() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let s = start().await;
    let lim = Limits {
        requests_per_minute: 1,
        ..Limits::UNLIMITED
    };
    let (t, key) = s.tenant_with_key("one-a-minute", lim).await;
    let body = json!({"prompt": "Hi", "max_tokens": 2});
    let (st, _, v) = s.post(&s.run_url(&t.id), Some(&key), &body).await;
    assert_eq!(st, 200, "{v}");
    let mut sock = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let head = format!(
        "POST /client/v4/accounts/{}/ai/run/{MODEL} HTTP/1.1\r\nhost: x\r\n\
         authorization: Bearer {key}\r\ncontent-type: application/json\r\n\
         content-length: 100000\r\n\r\n",
        t.id
    );
    sock.write_all(head.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = sock.read(&mut buf).await.unwrap();
            assert!(n > 0, "closed without an answer");
            got.extend_from_slice(&buf[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(20), read)
        .await
        .expect("no answer before the body was sent");
    let text = String::from_utf8_lossy(&got);
    assert!(text.starts_with("HTTP/1.1 429"), "{text}");
    assert_eq!(s.state.limiter.inflight(&t.id), 0);
}
