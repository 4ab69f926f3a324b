//! Refusals over real sockets with the real model and a real SQLite store: who is
//! refused (missing, malformed and revoked keys, other accounts), which bodies
//! (types, bounds, stops, sampling ranges, prompts over the context window) and
//! which rates, each with the right status and code, and exactly the usage rows
//! each should write.

mod common;

use common::*;
use serde_json::{json, Value};
use std::time::Duration;
use tessera_tenancy::{Limits, TenantStatus};

/// (name, account in the path, key, body, HTTP status, Workers AI code, tenant of
/// the row, or `None` when the request is refused before admission and writes none)
type Case<'a> = (
    &'a str,
    String,
    Option<&'a str>,
    Value,
    u16,
    i64,
    Option<&'a str>,
);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auth_errors_write_no_row_and_validation_errors_exactly_one() {
    let s = start().await;
    let (b, key_b) = s.tenant_with_key("beta", Limits::default()).await;
    let (susp, key_s) = s.tenant_with_key("suspended", Limits::default()).await;
    s.store()
        .set_status(&susp.id, TenantStatus::Suspended)
        .await
        .unwrap();
    let (_, revoked) = s.store().create_key(&s.tenant.id, "old").await.unwrap();
    let revoked_id = revoked[4..20].to_string();
    assert!(s.store().revoke_key(&revoked_id).await.unwrap());
    let wrong = format!("{}{}", &s.key[..s.key.len() - 4], "0000");
    let a = s.tenant.id.clone();
    let ok = json!({"prompt": "hi", "max_tokens": 4});
    let free_before = s.state.engine.stats();
    assert_eq!(free_before.free_pages, free_before.capacity_pages);
    // (account, key, body, status, Workers AI code, tenant of the row)
    let mut cases: Vec<Case> = vec![
        ("no key", a.clone(), None, ok.clone(), 401, 10000, None),
        (
            "wrong key",
            a.clone(),
            Some(&wrong),
            ok.clone(),
            401,
            10000,
            None,
        ),
        (
            "malformed key",
            a.clone(),
            Some("sk-not-a-tessera-key"),
            ok.clone(),
            401,
            10000,
            None,
        ),
        (
            "revoked key",
            a.clone(),
            Some(&revoked),
            ok.clone(),
            401,
            10000,
            None,
        ),
        (
            "A's key on B's path",
            b.id.clone(),
            Some(&s.key),
            ok.clone(),
            403,
            10000,
            None,
        ),
        (
            "suspended tenant",
            susp.id.clone(),
            Some(&key_s),
            ok.clone(),
            403,
            10000,
            None,
        ),
    ];
    // Bad bodies on the caller's own account: 400 with a Workers AI code.
    let invalid: Vec<(&str, Value, i64)> = vec![
        ("wrong type", json!({"prompt": 42}), 3003),
        (
            "negative max_tokens",
            json!({"prompt": "hi", "max_tokens": -3}),
            3003,
        ),
        (
            "string max_tokens",
            json!({"prompt": "hi", "max_tokens": "3"}),
            3003,
        ),
        (
            "huge max_tokens",
            json!({"prompt": "hi", "max_tokens": 1_000_000_000u64}),
            3006,
        ),
        // Once panicked on `prompt + max_tokens` overflow (found by QA).
        (
            "max_tokens at u64::MAX",
            json!({"prompt": "hi", "max_tokens": u64::MAX}),
            3006,
        ),
        (
            "max_tokens as a float beyond u64",
            json!({"prompt": "hi", "max_tokens": 1e20}),
            3006,
        ),
        ("empty prompt", json!({"prompt": ""}), 3003),
        ("no prompt", json!({}), 3003),
        (
            "bad temperature",
            json!({"prompt": "hi", "temperature": -1}),
            3003,
        ),
    ];
    cases.extend(invalid.into_iter().map(|(name, body, code)| {
        (
            name,
            a.clone(),
            Some(s.key.as_str()),
            body,
            400,
            code,
            Some(a.as_str()),
        )
    }));
    let mut rows = s.row_count().await;
    for (name, account, key, body, status, code, row_tenant) in cases {
        let (st, rid, v) = s.post(&s.run_url(&account), key, &body).await;
        assert_eq!(st, status, "{name}: {v}");
        assert_eq!(v["success"], false, "{name}");
        assert_eq!(
            v["errors"][0]["code"].as_i64().unwrap(),
            code,
            "{name}: {v}"
        );
        let Some(row_tenant) = row_tenant else {
            assert_eq!(s.row_count().await, rows, "{name}: refused, no row");
            assert!(s.store().usage_row(&rid).await.unwrap().is_none(), "{name}");
            continue;
        };
        rows += 1;
        assert_eq!(s.row_count().await, rows, "{name}: exactly one row");
        let row = s.row(&rid).await;
        assert_eq!(
            (row.status, row.error_code as i64, row.finish.as_str()),
            (status, code, "error"),
            "{name}"
        );
        assert_eq!((row.input_tokens, row.output_tokens), (0, 0), "{name}");
        assert_eq!(row.tenant_id, row_tenant, "{name}");
    }
    // The refusals are counted by reason instead.
    let m = &s.state.metrics;
    for (reason, n) in [
        ("missing_key", 1),
        ("invalid_key", 1),
        ("malformed_key", 1),
        ("revoked_key", 1),
        ("wrong_account", 1),
        ("tenant_suspended", 1),
    ] {
        assert_eq!(m.refused_count(reason), n, "{reason}");
    }
    // Bodies that never parse: malformed JSON (400) and 10 MB (413).
    let big = format!("{{\"prompt\": \"{}\"}}", "a".repeat(10 << 20));
    for (name, body, status, code) in [
        ("malformed JSON", "{\"prompt\": ".to_string(), 400, 3003),
        ("10 MB body", big, 413, 3006),
    ] {
        let resp = s
            .client
            .post(s.run_url(&a))
            .bearer_auth(&s.key)
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        let (st, rid, v) = split(resp).await;
        assert_eq!(
            (st, v["errors"][0]["code"].as_i64()),
            (status, Some(code)),
            "{name}: {v}"
        );
        assert_eq!(s.row(&rid).await.status, status, "{name}");
        rows += 1;
        assert_eq!(s.row_count().await, rows, "{name}: exactly one row");
    }
    // Unknown model.
    let url = format!(
        "{}/client/v4/accounts/{a}/ai/run/@cf/meta/llama-9-999b",
        s.base
    );
    let (st, rid, v) = s.post(&url, Some(&s.key), &ok).await;
    assert_eq!(
        (st, v["errors"][0]["code"].as_i64()),
        (404, Some(5007)),
        "{v}"
    );
    assert_eq!(s.row(&rid).await.model, "@cf/meta/llama-9-999b");
    rows += 1;
    assert_eq!(s.row_count().await, rows);
    let (st, _, v) = s
        .post(
            &format!("{}/v1/chat/completions", s.base),
            Some(&s.key),
            &json!({"model": "gpt-7", "messages": [{"role": "user", "content": "x"}]}),
        )
        .await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
    rows += 1;
    assert_eq!(s.row_count().await, rows);
    // OpenAI error objects.
    let (st, _, v) = s
        .post(&format!("{}/v1/chat/completions", s.base), Some(&s.key), &json!({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}))
        .await;
    assert_eq!(st, 400);
    assert_eq!(v["error"]["type"], "invalid_request_error");
    assert_eq!(v["error"]["param"], "max_tokens");
    let (st, _, v) = s
        .post(
            &format!("{}/v1/chat/completions", s.base),
            Some(&key_b),
            &json!({"model": MODEL}),
        )
        .await;
    assert_eq!((st, v["error"]["param"].as_str()), (400, Some("messages")));
    // Nothing reached the engine.
    let after = s.state.engine.stats();
    assert_eq!(after.free_pages, after.capacity_pages);
    assert_eq!((after.running, after.waiting), (0, 0));
    // Revoking the working key takes effect on the next request.
    let key_id = &s.key[4..20];
    let (st, _, _) = s.post(&s.run_url(&a), Some(&s.key), &ok).await;
    assert_eq!(st, 200);
    s.store().revoke_key(key_id).await.unwrap();
    let (st, _, _) = s.post(&s.run_url(&a), Some(&s.key), &ok).await;
    assert_eq!(st, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_long_prompt_is_rejected_before_the_engine() {
    let s = start().await;
    let limits = s.state.engine.limits();
    let before = s.state.engine.stats();
    assert_eq!(before.free_pages, before.capacity_pages);
    let long = "hello ".repeat(9000);
    let (st, rid, v) = s
        .post(
            &s.run_url(&s.tenant.id),
            Some(&s.key),
            &json!({"prompt": long, "raw": true, "max_tokens": 10}),
        )
        .await;
    assert_eq!(st, 400, "{v}");
    let msg = v["errors"][0]["message"].as_str().unwrap();
    let row = s.row(&rid).await;
    assert_eq!(row.status, 400);
    assert!(
        msg.contains("max_tokens (10)") && msg.contains(&limits.context.to_string()),
        "{msg}"
    );
    assert!(msg.contains(" tokens)"), "{msg}");
    // Issue 32 review: a prompt of ~900 KB was tokenized to the end (seconds of CPU)
    // before this refusal. Now it is refused from its length, on both API shapes,
    // with a lower bound on its tokens.
    let huge = "lorem ipsum dolor sit amet, ".repeat(32_000);
    for (url, body) in [
        (
            s.run_url(&s.tenant.id),
            json!({"prompt": huge, "raw": true, "max_tokens": 10}),
        ),
        (
            format!("{}/v1/chat/completions", s.base),
            json!({"model": MODEL, "messages": [{"role": "user", "content": huge}], "max_tokens": 10}),
        ),
    ] {
        let (st, _, v) = s.post(&url, Some(&s.key), &body).await;
        assert_eq!(st, 400, "{v}");
        let msg = v["errors"][0]["message"]
            .as_str()
            .or(v["error"]["message"].as_str())
            .unwrap();
        assert!(
            msg.starts_with("prompt (at least ") && msg.contains("context window of 8192 tokens"),
            "{msg}"
        );
    }
    // Short prompt, max_tokens at the context window.
    let (st, _, v) = s
        .post(&format!("{}/v1/chat/completions", s.base), Some(&s.key), &json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8192}))
        .await;
    assert_eq!(st, 400);
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    let msg = v["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("max_tokens (8192)") && msg.contains("8192 tokens"),
        "{msg}"
    );
    let after = s.state.engine.stats();
    assert_eq!(after, before, "the pool was not touched");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_return_429_and_spare_other_tenants() {
    let s = start().await;
    let (c, key_c) = s
        .tenant_with_key(
            "limited",
            Limits {
                requests_per_minute: 2,
                ..Limits::default()
            },
        )
        .await;
    let body = json!({"prompt": "Hi", "max_tokens": 2});
    for _ in 0..2 {
        assert_eq!(s.post(&s.run_url(&c.id), Some(&key_c), &body).await.0, 200);
    }
    let resp = s
        .client
        .post(s.run_url(&c.id))
        .bearer_auth(&key_c)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    let retry: u64 = resp.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&retry), "{retry}");
    assert_eq!(resp.headers()["x-should-retry"], "true");
    let (_, rid, v) = split(resp).await;
    assert_eq!(v["errors"][0]["code"], 3040);
    // Refused by a limit before admission: no row, a count by limit.
    s.settle().await;
    assert!(s.store().usage_row(&rid).await.unwrap().is_none());
    assert_eq!(s.state.metrics.refused_count("requests_per_minute"), 1);
    // The unlimited tenant is unaffected.
    for _ in 0..4 {
        assert_eq!(
            s.post(&s.run_url(&s.tenant.id), Some(&s.key), &body)
                .await
                .0,
            200
        );
    }
    // A request larger than the per-minute token limit can never succeed.
    let (d, key_d) = s
        .tenant_with_key(
            "tiny",
            Limits {
                input_tokens_per_minute: 5,
                ..Limits::default()
            },
        )
        .await;
    let resp = s
        .client
        .post(s.run_url(&d.id))
        .bearer_auth(&key_d)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["x-should-retry"], "false");
    // Concurrency: a second request while one streams gets 429; the slot comes
    // back when the first client goes away (the permit is released on drop).
    let (f, key_f) = s
        .tenant_with_key(
            "serial",
            Limits {
                max_concurrent: 1,
                ..Limits::default()
            },
        )
        .await;
    let long = json!({"prompt": "Count from 1 to 1000, separated by commas.", "max_tokens": 300, "stream": true});
    let (first, _) = open_stream_at(&s.client, &s.run_url(&f.id), &key_f, &long).await;
    let resp = s
        .client
        .post(s.run_url(&f.id))
        .bearer_auth(&key_f)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 429);
    assert_eq!(resp.headers()["x-should-retry"], "true");
    drop(first);
    let mut ok = false;
    for _ in 0..200 {
        if s.post(&s.run_url(&f.id), Some(&key_f), &body).await.0 == 200 {
            ok = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(ok, "concurrency slot not released after disconnect");
    // Daily quota (OpenAI shape).
    let (e, key_e) = s
        .tenant_with_key(
            "daily",
            Limits {
                daily_tokens: 1,
                ..Limits::default()
            },
        )
        .await;
    let url = format!(
        "{}/client/v4/accounts/{}/ai/v1/chat/completions",
        s.base, e.id
    );
    let chat =
        json!({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2});
    // prompt + max_tokens is reserved at admission: more than the whole quota, so
    // refused before it runs, and waiting does not help today.
    let resp = s
        .client
        .post(&url)
        .bearer_auth(&key_e)
        .json(&chat)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers()["x-should-retry"], "false");
    let (st, _, v) = split(resp).await;
    assert_eq!(
        (st, v["error"]["code"].as_str()),
        (429, Some("insufficient_quota")),
        "{v}"
    );
    assert_eq!(s.state.limiter.daily(&e.id).unwrap().used, 0);
}

/// Issue 32: stops and sampling parameters have bounds on both API shapes, and a
/// request outside them is a 400 naming the field before anything runs (four
/// stops of 240 KB each once cost other tenants 2x time per output token;
/// `repetition_penalty: 1e-40` answered 200 with degenerate text). At the bounds a
/// request is served, and a Workers AI `stop` cuts the answer as OpenAI's does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_and_sampling_bounds_are_400s_naming_the_field_on_both_apis() {
    let s = start().await;
    let run = s.run_url(&s.tenant.id);
    let chat = format!("{}/v1/chat/completions", s.base);
    let completions = format!(
        "{}/client/v4/accounts/{}/ai/v1/completions",
        s.base, s.tenant.id
    );
    let long = "x".repeat(257);
    let bad: Vec<(&str, Value)> = vec![
        ("stop", json!({"stop": ["a", "b", "c", "d", "e"]})),
        ("stop", json!({"stop": long})),
        ("stop", json!({"stop": ["a", long]})),
        ("repetition_penalty", json!({"repetition_penalty": 1e-40})),
        ("repetition_penalty", json!({"repetition_penalty": 0.05})),
        ("repetition_penalty", json!({"repetition_penalty": 2.5})),
        ("temperature", json!({"temperature": 5.5})),
        ("temperature", json!({"temperature": -0.1})),
        ("top_p", json!({"top_p": 0})),
        ("top_p", json!({"top_p": 1.5})),
        ("top_k", json!({"top_k": 1001})),
        ("top_k", json!({"top_k": 1e30})),
        ("frequency_penalty", json!({"frequency_penalty": 2.5})),
        ("presence_penalty", json!({"presence_penalty": -3})),
        ("seed", json!({"seed": -1})),
        ("seed", json!({"seed": 1e30})),
    ];
    let rows = s.row_count().await;
    for (url, openai) in [(&run, false), (&chat, true), (&completions, true)] {
        for (field, extra) in &bad {
            let mut body = if url == &chat {
                json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            } else if openai {
                json!({"model": MODEL, "prompt": "hi", "max_tokens": 4})
            } else {
                json!({"prompt": "hi", "max_tokens": 4})
            };
            for (k, v) in extra.as_object().unwrap() {
                body[k] = v.clone();
            }
            let (st, _, v) = s.post(url, Some(&s.key), &body).await;
            assert_eq!(st, 400, "{url} {extra}: {v}");
            let (msg, named) = if openai {
                (
                    v["error"]["message"].as_str().unwrap().to_string(),
                    v["error"]["param"] == json!(field),
                )
            } else {
                let m = v["errors"][0]["message"].as_str().unwrap().to_string();
                let named = m.contains(&format!("`{field}`"));
                (m, named)
            };
            assert!(named, "{url} {extra}: the 400 does not name `{field}`: {v}");
            assert!(msg.contains(field), "{url} {extra}: {msg}");
        }
    }
    // Validation errors write one usage row each, never more, and nothing ran.
    s.settle().await;
    assert_eq!(s.row_count().await, rows + 3 * bad.len());
    let stats = s.state.engine.stats();
    assert_eq!(stats.free_pages, stats.capacity_pages);

    // At the bounds: served. Greedy, so a stop taken from the unstopped answer (it
    // spans several tokens) cuts it right before, on both shapes.
    let prompt = "Count: 1, 2, 3, 4, 5,";
    let base = json!({"prompt": prompt, "raw": true, "max_tokens": 24, "temperature": 0});
    let (st, _, v) = s.post(&run, Some(&s.key), &base).await;
    assert_eq!(st, 200, "{v}");
    let full = v["result"]["response"].as_str().unwrap().to_string();
    assert!(full.len() > 12, "{full:?}");
    let cut = full
        .char_indices()
        .map(|(i, _)| i)
        .find(|&i| i >= full.len() / 2)
        .unwrap();
    let stop = full[cut..].chars().take(6).collect::<String>();
    let first = full.find(&stop).unwrap();
    let at_bounds = json!([
        stop,
        "y".repeat(256),
        "z".repeat(256),
        "\u{1F44B}".repeat(64)
    ]);
    let mut body = base.clone();
    body["stop"] = at_bounds.clone();
    body["repetition_penalty"] = json!(1.0);
    body["top_k"] = json!(1000);
    body["seed"] = json!(u64::MAX);
    let (st, _, v) = s.post(&run, Some(&s.key), &body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["result"]["response"],
        json!(&full[..first]),
        "stop {stop:?}"
    );
    let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                      "stop": at_bounds, "top_k": 0, "seed": 0});
    let (st, _, v) = s.post(&completions, Some(&s.key), &body).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    assert_eq!(v["choices"][0]["text"], json!(&full[..first]), "{v}");
}
