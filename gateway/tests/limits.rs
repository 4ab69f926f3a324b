//! Gateway edge hardening (issue 9), limits over real sockets with the real model:
//! a daily quota and concurrency that cannot be overdrawn (parallel requests at the
//! edge, limits changed in flight, allowances returned on a later refusal, a client
//! that leaves while queued), limits checked before the body is read, request
//! deadlines, the usage API's own limits and the ledger retention. Admin access,
//! anonymous traffic and keys are in `edge.rs`.

mod common;

use common::*;
use serde_json::json;
use std::time::Duration;
use tessera_gateway::{Deadlines, GatewayOptions, UsageConfig};
use tessera_tenancy::{Limits, UsageRecord};

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
