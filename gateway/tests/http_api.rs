//! The gateway over real sockets with the real model and a real SQLite store: both
//! API shapes, streaming, disconnects, the usage and admin APIs, PostgreSQL,
//! shutdown. Refusals (auth, validation, bounds, rate limits) are in `refusals.rs`.

mod common;

use common::*;
use serde_json::{json, Value};
use std::time::Duration;
use tessera_tenancy::Limits;

fn usage_of(v: &Value) -> (i64, i64) {
    (
        v["prompt_tokens"].as_i64().unwrap(),
        v["completion_tokens"].as_i64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_ai_envelope_stream_and_ledger() {
    let s = start().await;
    let url = s.run_url(&s.tenant.id);
    let body = json!({"prompt": "What is the capital of France?", "max_tokens": 12});
    let (st, rid, v) = s.post(&url, Some(&s.key), &body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(rid.len(), 32);
    assert_eq!(v["success"], true);
    assert_eq!(v["errors"], json!([]));
    assert_eq!(v["messages"], json!([]));
    let text = v["result"]["response"].as_str().unwrap().to_string();
    assert!(!text.is_empty());
    let (p, c) = usage_of(&v["result"]["usage"]);
    assert!(p > 5 && (1..=12).contains(&c), "{v}");
    assert_eq!(
        v["result"]["usage"]["total_tokens"].as_i64().unwrap(),
        p + c
    );
    let row = s.row(&rid).await;
    assert_eq!(
        (
            row.input_tokens,
            row.output_tokens,
            row.status,
            row.error_code
        ),
        (p, c, 200, 0)
    );
    assert_eq!(
        (row.tenant_id.as_str(), row.model.as_str()),
        (s.tenant.id.as_str(), MODEL)
    );
    assert!(row.finish == "stop" || row.finish == "length");

    // Streaming: the same greedy text, a final usage frame, then [DONE].
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let resp = s
        .client
        .post(&url)
        .bearer_auth(&s.key)
        .json(&sbody)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let srid = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let events = sse_events(resp).await;
    assert_eq!(events.last().unwrap(), "[DONE]");
    let frames: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let last = frames.last().unwrap();
    assert_eq!(usage_of(&last["usage"]), (p, c));
    let streamed: String = frames
        .iter()
        .map(|f| f["response"].as_str().unwrap())
        .collect();
    assert_eq!(streamed, text);
    assert!(frames.len() >= 2);
    let srow = s.row(&srid).await;
    assert_eq!(
        (srow.input_tokens, srow.output_tokens, srow.status),
        (p, c, 200)
    );

    // Messages form equals the chat-templated prompt form.
    let (st, _, mv) = s
        .post(&url, Some(&s.key), &json!({"messages": [{"role": "user", "content": "What is the capital of France?"}], "max_tokens": 12}))
        .await;
    assert_eq!(st, 200);
    assert_eq!(mv["result"]["response"].as_str().unwrap(), text);
    // raw: no chat template, so fewer prompt tokens.
    let (st, _, rv) = s
        .post(
            &url,
            Some(&s.key),
            &json!({"prompt": "The capital of France is", "raw": true, "max_tokens": 4}),
        )
        .await;
    assert_eq!(st, 200);
    assert!(usage_of(&rv["result"]["usage"]).0 < 8, "{rv}");
    s.wait_idle().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_shapes_over_http() {
    let s = start().await;
    let msgs = json!([{"role": "user", "content": "Name a color."}]);
    for url in [
        format!("{}/v1/chat/completions", s.base),
        format!(
            "{}/client/v4/accounts/{}/ai/v1/chat/completions",
            s.base, s.tenant.id
        ),
    ] {
        let (st, rid, v) = s
            .post(
                &url,
                Some(&s.key),
                &json!({"model": MODEL, "messages": msgs, "max_tokens": 8}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["id"], format!("chatcmpl-{rid}"));
        assert_eq!(v["model"], MODEL);
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        let fr = v["choices"][0]["finish_reason"].as_str().unwrap();
        assert!(fr == "stop" || fr == "length");
        let row = s.row(&rid).await;
        assert_eq!(usage_of(&v["usage"]), (row.input_tokens, row.output_tokens));
        assert_eq!(row.endpoint, "openai.chat");
    }
    // Streaming with include_usage.
    let resp = s
        .client
        .post(format!("{}/v1/chat/completions", s.base))
        .bearer_auth(&s.key)
        .json(&json!({"model": MODEL, "messages": msgs, "max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}}))
        .send()
        .await
        .unwrap();
    let rid = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let chunks = sse_json(resp).await;
    assert!(chunks
        .iter()
        .all(|c| c["object"] == "chat.completion.chunk" && c["id"] == format!("chatcmpl-{rid}")));
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage_chunk = chunks.last().unwrap();
    assert_eq!(usage_chunk["choices"], json!([]));
    let row = s.row(&rid).await;
    assert_eq!(
        usage_of(&usage_chunk["usage"]),
        (row.input_tokens, row.output_tokens)
    );
    assert!(chunks[..chunks.len() - 1]
        .iter()
        .all(|c| c["usage"].is_null()));
    assert!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"].is_string());
    // Completions (raw prompt).
    let (st, rid, v) = s
        .post(
            &format!("{}/v1/completions", s.base),
            Some(&s.key),
            // A whole number written as a float is taken at its value.
            &json!({"model": MODEL, "prompt": "1, 2, 3,", "max_tokens": 5.0}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert!(usage_of(&v["usage"]).1 <= 5);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["id"], format!("cmpl-{rid}"));
    assert!(v["choices"][0]["text"].is_string());
    assert_eq!(usage_of(&v["usage"]).1, s.row(&rid).await.output_tokens);
    // Models.
    let (st, _, v) = s.get(&format!("{}/v1/models", s.base), Some(&s.key)).await;
    assert_eq!(st, 200);
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], MODEL);
    assert_eq!(v["data"][0]["context_window"], 8192);
    let (st, _, v) = s
        .get(
            &format!(
                "{}/client/v4/accounts/{}/ai/models/search",
                s.base, s.tenant.id
            ),
            Some(&s.key),
        )
        .await;
    assert_eq!(st, 200);
    assert_eq!(v["success"], true);
    assert_eq!(v["result"][0]["name"], MODEL);
    assert_eq!(v["result"][0]["task"]["name"], "Text Generation");
    let search = |q: &str| {
        format!(
            "{}/client/v4/accounts/{}/ai/models/search?{q}",
            s.base, s.tenant.id
        )
    };
    let (_, _, v) = s
        .get(
            &search("search=SmolLM2&task=Text%20Generation"),
            Some(&s.key),
        )
        .await;
    assert_eq!(v["result"].as_array().unwrap().len(), 1);
    // The search reads the description too, which names the architecture.
    let (_, _, v) = s.get(&search("search=llama"), Some(&s.key)).await;
    assert_eq!(v["result"].as_array().unwrap().len(), 1);
    let (_, _, v) = s.get(&search("search=mistral"), Some(&s.key)).await;
    assert_eq!(v["result"], json!([]));
    let (_, _, v) = s
        .get(&search("task=image-classification"), Some(&s.key))
        .await;
    assert_eq!(v["result"], json!([]));
    // Another tenant's account path: 403.
    let (other, _) = s.tenant_with_key("other", Limits::default()).await;
    let url = format!(
        "{}/client/v4/accounts/{}/ai/models/search",
        s.base, other.id
    );
    assert_eq!(s.get(&url, Some(&s.key)).await.0, 403);
    let (st, _, v) = s.get(&format!("{}/v1/models", s.base), None).await;
    assert_eq!(st, 401);
    assert_eq!(v["error"]["code"], "invalid_api_key");
    // Health.
    assert_eq!(
        s.client
            .get(format!("{}/healthz", s.base))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    assert_eq!(
        s.client
            .get(format!("{}/readyz", s.base))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let (st, _, v) = s.get(&format!("{}/nope", s.base), None).await;
    assert_eq!((st, v["errors"][0]["code"].as_i64()), (404, Some(7000)));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnect_mid_stream_aborts_and_records_once() {
    let s = start().await;
    let body = json!({"prompt": "Count from 1 to 1000, separated by commas.", "max_tokens": 400, "stream": true});
    let mut resp = s
        .client
        .post(s.run_url(&s.tenant.id))
        .bearer_auth(&s.key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let rid = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let mut got = 0;
    while got < 3 {
        let chunk = resp.chunk().await.unwrap().expect("stream ended early");
        got += String::from_utf8_lossy(&chunk).matches("data: ").count();
    }
    drop(resp);
    let mut row = None;
    for _ in 0..400 {
        if let Some(r) = s.store().usage_row(&rid).await.unwrap() {
            row = Some(r);
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    let row = row.expect("usage row after disconnect");
    assert_eq!(
        (row.status, row.error_code, row.finish.as_str()),
        (499, 3008, "aborted")
    );
    assert!(row.output_tokens >= 3 && row.output_tokens < 400, "{row:?}");
    assert!(row.input_tokens > 0);
    s.wait_idle().await;
    // Exactly once.
    let rows = s.store().usage_rows(Some(&s.tenant.id)).await.unwrap();
    assert_eq!(rows.iter().filter(|r| r.request_id == rid).count(), 1);
    assert_eq!(rows.len(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn usage_api_matches_ledger_and_is_tenant_scoped() {
    let s = start().await;
    let (b, key_b) = s.tenant_with_key("beta", Limits::default()).await;
    let a = s.tenant.id.clone();
    let (_, key_a2) = s.store().create_key(&a, "second").await.unwrap();
    for (key, body) in [
        (&s.key, json!({"prompt": "One", "max_tokens": 3})),
        (&key_a2, json!({"prompt": "Two", "max_tokens": 4})),
        (&s.key, json!({"prompt": 5})),
    ] {
        s.post(&s.run_url(&a), Some(key), &body).await;
    }
    s.post(
        &s.run_url(&b.id),
        Some(&key_b),
        &json!({"prompt": "Beta", "max_tokens": 5}),
    )
    .await;
    s.settle().await;
    let rows = s.store().usage_rows(Some(&a)).await.unwrap();
    assert_eq!(rows.len(), 3);
    let sum = |f: fn(&tessera_tenancy::UsageRecord) -> i64| rows.iter().map(f).sum::<i64>();
    for g in ["model", "key", "hour", "day"] {
        let (st, _, v) = s
            .get(
                &format!("{}/client/v4/accounts/{a}/ai/usage?group_by={g}", s.base),
                Some(&s.key),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        let t = &v["result"]["totals"];
        assert_eq!(t["requests"], 3);
        assert_eq!(t["input_tokens"].as_i64().unwrap(), sum(|r| r.input_tokens));
        assert_eq!(
            t["output_tokens"].as_i64().unwrap(),
            sum(|r| r.output_tokens)
        );
        assert_eq!(t["errors"], 1);
        let groups = v["result"]["groups"].as_array().unwrap();
        let gsum: i64 = groups
            .iter()
            .map(|g| g["input_tokens"].as_i64().unwrap())
            .sum();
        assert_eq!(gsum, sum(|r| r.input_tokens));
        if g == "key" {
            assert_eq!(groups.len(), 2);
            let k2 = groups.iter().find(|x| x["key"] == key_a2[4..20]).unwrap();
            let r2 = rows.iter().find(|r| r.key_id == key_a2[4..20]).unwrap();
            assert_eq!(
                (k2["input_tokens"].as_i64(), k2["output_tokens"].as_i64()),
                (Some(r2.input_tokens), Some(r2.output_tokens))
            );
        }
        if g == "model" {
            assert!(groups.iter().all(|x| x["key"] == MODEL || x["key"] == ""));
        }
    }
    // Time range: nothing before 2000.
    let (_, _, v) = s
        .get(
            &format!(
                "{}/client/v4/accounts/{a}/ai/usage?until=2000-01-01",
                s.base
            ),
            Some(&s.key),
        )
        .await;
    assert_eq!(v["result"]["totals"]["requests"], 0);
    let (st, _, _) = s
        .get(
            &format!("{}/client/v4/accounts/{a}/ai/usage?group_by=week", s.base),
            Some(&s.key),
        )
        .await;
    assert_eq!(st, 400);
    // Isolation: A cannot read B's usage; B sees only its own.
    let (st, _, _) = s
        .get(
            &format!("{}/client/v4/accounts/{}/ai/usage", s.base, b.id),
            Some(&s.key),
        )
        .await;
    assert_eq!(st, 403);
    let (st, _, v) = s
        .get(
            &format!("{}/client/v4/accounts/{}/ai/usage", s.base, b.id),
            Some(&key_b),
        )
        .await;
    assert_eq!(st, 200);
    assert_eq!(v["result"]["totals"]["requests"], 1);
    let b_rows = s.store().usage_rows(Some(&b.id)).await.unwrap();
    assert_eq!(
        v["result"]["totals"]["output_tokens"].as_i64().unwrap(),
        b_rows[0].output_tokens
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_api_manages_tenants_keys_and_limits() {
    let s = start().await;
    let admin = |r: reqwest::RequestBuilder| r.bearer_auth(ADMIN);
    let resp = s
        .client
        .get(format!("{}/admin/v1/tenants", s.base))
        .bearer_auth(&s.key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 401);
    let (st, _, v) = split(
        admin(s.client.post(format!("{}/admin/v1/tenants", s.base)))
            .json(&json!({"name": "gamma", "create_key": true}))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(st, 200, "{v}");
    let id = v["result"]["tenant"]["id"].as_str().unwrap().to_string();
    let key = v["result"]["key"]["secret"].as_str().unwrap().to_string();
    let body = json!({"prompt": "Hi", "max_tokens": 2});
    assert_eq!(s.post(&s.run_url(&id), Some(&key), &body).await.0, 200);
    let (st, _, v) = split(
        admin(s.client.get(format!("{}/admin/v1/tenants", s.base)))
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!(st, 200);
    assert_eq!(v["result"].as_array().unwrap().len(), 2);
    // Suspend / activate.
    let st = admin(
        s.client
            .post(format!("{}/admin/v1/tenants/{id}/suspend", s.base)),
    )
    .send()
    .await
    .unwrap()
    .status();
    assert_eq!(st, 200);
    assert_eq!(s.post(&s.run_url(&id), Some(&key), &body).await.0, 403);
    admin(
        s.client
            .post(format!("{}/admin/v1/tenants/{id}/activate", s.base)),
    )
    .send()
    .await
    .unwrap();
    assert_eq!(s.post(&s.run_url(&id), Some(&key), &body).await.0, 200);
    // Limits.
    let st = admin(
        s.client
            .put(format!("{}/admin/v1/tenants/{id}/limits", s.base)),
    )
    .json(&json!({"requests_per_minute": 1}))
    .send()
    .await
    .unwrap()
    .status();
    assert_eq!(st, 200);
    assert_eq!(s.post(&s.run_url(&id), Some(&key), &body).await.0, 200);
    assert_eq!(s.post(&s.run_url(&id), Some(&key), &body).await.0, 429);
    // Keys: create a second, revoke the first.
    let (_, _, v) = split(
        admin(
            s.client
                .post(format!("{}/admin/v1/tenants/{id}/keys", s.base)),
        )
        .json(&json!({"name": "ci"}))
        .send()
        .await
        .unwrap(),
    )
    .await;
    let key2 = v["result"]["secret"].as_str().unwrap().to_string();
    let key_id = &key[4..20];
    let st = admin(
        s.client
            .post(format!("{}/admin/v1/keys/{key_id}/revoke", s.base)),
    )
    .send()
    .await
    .unwrap()
    .status();
    assert_eq!(st, 200);
    let (st, _, _) = s
        .get(
            &format!("{}/client/v4/accounts/{id}/ai/usage", s.base),
            Some(&key),
        )
        .await;
    assert_eq!(st, 401);
    s.settle().await;
    let (st, _, v) = s
        .get(
            &format!("{}/client/v4/accounts/{id}/ai/usage", s.base),
            Some(&key2),
        )
        .await;
    assert_eq!(st, 200);
    // 3 served; the 403 while suspended and the 429 wrote no row.
    assert_eq!(v["result"]["totals"]["requests"], 3);
    let (_, _, v) = split(
        admin(
            s.client
                .get(format!("{}/admin/v1/tenants/{id}/keys", s.base)),
        )
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(v["result"].as_array().unwrap().len(), 2);
    let (_, _, v) = split(
        admin(s.client.get(format!(
            "{}/admin/v1/tenants/{id}/usage?group_by=key",
            s.base
        )))
        .send()
        .await
        .unwrap(),
    )
    .await;
    assert_eq!(v["result"]["totals"]["requests"], 3);
    // Prometheus metrics agree with the ledger.
    assert_eq!(
        s.client
            .get(format!("{}/metrics", s.base))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );
    s.settle().await;
    let m = s.metrics_text().await;
    let rows = s.store().usage_rows(Some(&id)).await.unwrap();
    let ok = rows.iter().filter(|r| r.status == 200).count();
    assert!(
        m.contains(&format!(
            "tessera_requests_total{{model=\"{MODEL}\",api=\"workers_ai.run\",status=\"200\",code=\"0\",tenant=\"{id}\"}} {ok}"
        )),
        "{m}"
    );
    assert!(
        m.contains("tessera_refused_total{reason=\"requests_per_minute\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("tessera_refused_total{reason=\"tenant_suspended\"} 1"),
        "{m}"
    );
    assert!(!m.contains("status=\"429\""), "{m}");
    let out: i64 = rows.iter().map(|r| r.output_tokens).sum();
    assert!(
        m.contains(&format!(
            "tessera_tokens_total{{model=\"{MODEL}\",direction=\"output\",tenant=\"{id}\"}} {out}"
        )),
        "{m}"
    );
    let cap = s.state.engine.stats().capacity_pages;
    assert!(
        m.contains(&format!("tessera_kv_capacity_pages {cap}")),
        "{m}"
    );
    assert!(
        m.contains(&format!(
            "tessera_request_duration_seconds_count{{model=\"{MODEL}\"}} {}",
            rows.len()
        )),
        "{m}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_end_to_end() {
    let (_pg, url) = tessera_tenancy::testing::PgServer::from_env_or_start();
    let s = start_with_store(tessera_gateway::GatewayOptions::default(), Some(url)).await;
    assert_eq!(s.store().backend(), "postgres");
    let (st, rid, v) = s
        .post(
            &s.run_url(&s.tenant.id),
            Some(&s.key),
            &json!({"prompt": "Hi", "max_tokens": 3}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let row = s.row(&rid).await;
    assert_eq!(
        usage_of(&v["result"]["usage"]),
        (row.input_tokens, row.output_tokens)
    );
    let (st, rid, _) = s
        .post(
            &s.run_url(&s.tenant.id),
            Some(&s.key),
            &json!({"prompt": ""}),
        )
        .await;
    assert_eq!(st, 400);
    assert_eq!(s.row(&rid).await.status, 400);
    s.settle().await;
    let (st, _, v) = s
        .get(&s.account_url("usage?group_by=day"), Some(&s.key))
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["result"]["totals"]["requests"], 2);
    assert_eq!(v["result"]["totals"]["errors"], 1);
    assert_eq!(
        v["result"]["totals"]["output_tokens"].as_i64().unwrap(),
        row.output_tokens
    );
    s.store().revoke_key(&s.key[4..20]).await.unwrap();
    let (st, _, _) = s.get(&s.account_url("usage"), Some(&s.key)).await;
    assert_eq!(st, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_drains_then_aborts_with_usage_rows() {
    let cfg = tessera_gateway::GatewayOptions {
        drain_timeout: Duration::from_millis(100),
        ..tessera_gateway::GatewayOptions::default()
    };
    let mut s = start_with(cfg).await;
    let long = json!({"prompt": "Count from 1 to 1000, separated by commas.", "max_tokens": 2000, "stream": true});
    let mut resp = s
        .client
        .post(s.run_url(&s.tenant.id))
        .bearer_auth(&s.key)
        .json(&long)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let rid = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let mut body = String::from_utf8_lossy(&resp.chunk().await.unwrap().unwrap()).to_string();
    s.shutdown.take().unwrap().send(()).unwrap();
    while let Some(c) = resp.chunk().await.unwrap() {
        body.push_str(&String::from_utf8_lossy(&c));
    }
    // The stream ends with an error frame, never `[DONE]` (I8).
    assert!(!body.contains("[DONE]"), "{body}");
    let last = body.trim_end().rsplit("\n\n").next().unwrap().to_string();
    let v: Value = serde_json::from_str(last.strip_prefix("data: ").unwrap()).unwrap();
    assert_eq!(v["error"]["code"], 3040, "{v}");
    let row = s.row(&rid).await;
    assert_eq!(
        (row.status, row.error_code, row.finish.as_str()),
        (503, 3040, "aborted")
    );
    assert!(
        row.output_tokens >= 1 && row.output_tokens < 2000,
        "{row:?}"
    );
    tokio::time::timeout(Duration::from_secs(30), &mut s.task)
        .await
        .expect("server stopped")
        .unwrap()
        .unwrap();
    assert_eq!(s.state.inflight(), 0);
    s.wait_idle().await;
    // No longer accepting.
    assert!(s
        .client
        .get(format!("{}/healthz", s.base))
        .send()
        .await
        .is_err());
}

/// `speculative` (issue 37) on both API shapes: with drafts the answer is the same
/// as without (a prompt whose answer repeats it, greedy); malformed values are 400s
/// naming the field, and the draft-model mode is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn speculative_changes_nothing_but_speed_and_is_validated() {
    let s = start().await;
    let text = "red green blue red green blue red green blue";
    let msgs = json!([{"role": "user", "content": format!("Repeat exactly: {text}")}]);
    let chat = format!("{}/v1/chat/completions", s.base);
    let run = s.run_url(&s.tenant.id);
    let answer = |v: &Value| v["choices"][0]["message"]["content"].clone();
    let body = |extra: Value| {
        let mut b = json!({"model": MODEL, "messages": msgs, "max_tokens": 40, "temperature": 0});
        if !extra.is_null() {
            b["speculative"] = extra;
        }
        b
    };
    let (st, _, plain) = s.post(&chat, Some(&s.key), &body(Value::Null)).await;
    assert_eq!(st, 200, "{plain}");
    for sp in [
        json!({"mode": "ngram", "k": 4}),
        json!({}),
        json!({"k": 0}),
        json!({"k": 8}),
    ] {
        let (st, _, v) = s.post(&chat, Some(&s.key), &body(sp.clone())).await;
        assert_eq!(st, 200, "{sp}: {v}");
        assert_eq!(answer(&v), answer(&plain), "{sp}");
    }
    let wai = |extra: Value| json!({"messages": msgs, "max_tokens": 40, "speculative": extra});
    let (st, _, a) = s.post(&run, Some(&s.key), &wai(json!({"k": 4}))).await;
    assert_eq!(st, 200, "{a}");
    assert_eq!(a["result"]["response"], answer(&plain));
    for (sp, says) in [
        (json!({"mode": "draft"}), "has no draft model"),
        (json!({"mode": "eagle"}), "must be \"ngram\" or \"draft\""),
        (json!({"k": 9}), "from 0 to 8"),
        (json!({"k": -1}), "from 0 to 8"),
        (json!({"k": "4"}), "from 0 to 8"),
        (json!({"depth": 2}), "unknown key `depth`"),
        (json!(4), "must be an object"),
    ] {
        for (url, b) in [(&chat, body(sp.clone())), (&run, wai(sp.clone()))] {
            let (st, _, v) = s.post(url, Some(&s.key), &b).await;
            assert_eq!(st, 400, "{sp}: {v}");
            let text = v.to_string().replace("\\\"", "\"");
            assert!(text.contains(says), "{sp}: {v}");
            assert!(text.contains("speculative"), "{sp}: {v}");
        }
    }
}
