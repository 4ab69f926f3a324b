//! Gateway edge hardening (issue 9) over real sockets with the real model: admin
//! access, anonymous traffic, and keys (scopes, expiry, revocation in flight).
//! Limits that cannot be overdrawn, deadlines, the usage API's limits and the
//! ledger retention are in `limits.rs`, connection timeouts in `connections.rs`,
//! body fuzzing in `bodies.rs`.

mod common;

use common::*;
use futures_util::StreamExt;
use reqwest::Method;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tessera_gateway::GatewayOptions;
use tessera_tenancy::{Limits, NewKey, Scopes, TenantStatus};

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
                scopes: Scopes::DEFAULT,
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
