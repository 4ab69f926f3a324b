//! Workers AI async batch (`?queueRequest=true`) over real HTTP with the real model:
//! results equal the same requests run one by one, each item is billed once (one
//! usage row, its tokens in the batch's usage), only the submitting tenant sees a
//! batch, a submission takes the tenant's allowances (a request per item, one
//! concurrency slot while its items run, every item's daily reservation) before
//! its items are validated and is refused 429 as a request is, and every malformed
//! body is a 400 naming its field.

mod common;

use common::{start, start_with, TestServer, MODEL};
use serde_json::{json, Value};
use std::time::Duration;
use tessera_gateway::GatewayOptions;
use tessera_tenancy::Limits;

fn batch_url(s: &TestServer, account: &str) -> String {
    format!("{}?queueRequest=true", s.run_url(account))
}

/// Polls until the batch is done; returns its `result`.
async fn wait_done(s: &TestServer, account: &str, key: &str, id: &str) -> Value {
    for _ in 0..1200 {
        let (st, _, v) = s
            .post(
                &batch_url(s, account),
                Some(key),
                &json!({"request_id": id}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
        let r = &v["result"];
        if r.get("responses").is_some() {
            return r.clone();
        }
        let status = r["status"].as_str().unwrap();
        assert!(status == "queued" || status == "running", "{v}");
        assert_eq!(r["request_id"], id);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("batch {id} did not finish");
}

async fn submit(s: &TestServer, account: &str, key: &str, requests: Value) -> String {
    let (st, _, v) = s
        .post(
            &batch_url(s, account),
            Some(key),
            &json!({"requests": requests}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["success"], true);
    assert_eq!(v["result"]["status"], "queued", "{v}");
    assert_eq!(v["result"]["model"], MODEL);
    v["result"]["request_id"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answers_as_its_items_alone_and_bills_each_once() {
    let s = start().await;
    let items = json!([
        {"prompt": "Name three colors.", "max_tokens": 12, "external_reference": "colors"},
        {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 10},
        {"prompt": "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n", "raw": true,
         "max_tokens": 8, "external_reference": "raw-hi"},
    ]);
    // Each item alone, synchronously: the reference answers (greedy).
    let mut solo = vec![];
    for it in items.as_array().unwrap() {
        let mut body = it.clone();
        body.as_object_mut().unwrap().remove("external_reference");
        let (st, _, v) = s.post(&s.run_url(&s.tenant.id), Some(&s.key), &body).await;
        assert_eq!(st, 200, "{v}");
        solo.push(v["result"].clone());
    }
    let rows_before = s.row_count().await;

    let id = submit(&s, &s.tenant.id, &s.key, items.clone()).await;
    assert_eq!(id.len(), 36);
    // Another tenant, with a valid key, cannot see it: the same 404 as an unknown id.
    let (other, other_key) = s.tenant_with_key("beta", Limits::default()).await;
    let (st, _, v) = s
        .post(
            &batch_url(&s, &other.id),
            Some(&other_key),
            &json!({"request_id": id}),
        )
        .await;
    assert_eq!(st, 404, "{v}");
    let (st2, _, v2) = s
        .post(
            &batch_url(&s, &other.id),
            Some(&other_key),
            &json!({"request_id": "00000000-0000-0000-0000-000000000000"}),
        )
        .await;
    assert_eq!(st2, 404);
    assert_eq!(
        v["errors"][0]["code"], v2["errors"][0]["code"],
        "a foreign id answers as an unknown one"
    );

    let done = wait_done(&s, &s.tenant.id, &s.key, &id).await;
    let responses = done["responses"].as_array().unwrap();
    assert_eq!(responses.len(), 3);
    let (mut prompt, mut completion) = (0, 0);
    for (i, r) in responses.iter().enumerate() {
        assert_eq!(r["id"], i, "{r}");
        assert_eq!(r["success"], true, "{r}");
        assert_eq!(
            r["result"]["response"], solo[i]["response"],
            "item {i} answers as it does alone"
        );
        for k in ["prompt_tokens", "completion_tokens"] {
            assert_eq!(r["result"]["usage"][k], solo[i]["usage"][k], "item {i}");
        }
        prompt += r["result"]["usage"]["prompt_tokens"].as_u64().unwrap();
        completion += r["result"]["usage"]["completion_tokens"].as_u64().unwrap();
    }
    assert_eq!(responses[0]["external_reference"], "colors");
    assert_eq!(responses[1]["external_reference"], Value::Null);
    assert_eq!(responses[2]["external_reference"], "raw-hi");
    assert_eq!(done["usage"]["prompt_tokens"], prompt);
    assert_eq!(done["usage"]["completion_tokens"], completion);

    // One usage row per item, under the batch endpoint, with the item's tokens.
    assert_eq!(s.row_count().await, rows_before + 3);
    let rows: Vec<_> = s
        .store()
        .usage_rows(Some(&s.tenant.id))
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.endpoint == "workers_ai.batch")
        .collect();
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|r| r.status == 200 && r.model == MODEL));
    assert_eq!(
        rows.iter().map(|r| r.input_tokens as u64).sum::<u64>(),
        prompt
    );
    assert_eq!(
        rows.iter().map(|r| r.output_tokens as u64).sum::<u64>(),
        completion
    );
    // Results stay for re-polling.
    assert_eq!(wait_done(&s, &s.tenant.id, &s.key, &id).await, done);
}

/// A POST with `key`; returns status, `retry-after`, `x-should-retry` and the body.
/// A tenant allowed 1 request a minute.
const ONE_A_MINUTE: Limits = Limits {
    requests_per_minute: 1,
    ..Limits::UNLIMITED
};

/// One small Workers AI request of tenant `tenant` with `key`: (status, body).
async fn run_hi(s: &TestServer, tenant: &str, key: &str) -> (u16, Value) {
    let (st, _, v) = s
        .post(
            &s.run_url(tenant),
            Some(key),
            &json!({"prompt": "Hi", "max_tokens": 2}),
        )
        .await;
    (st, v)
}

async fn post_with_headers(
    s: &TestServer,
    url: &str,
    key: &str,
    body: &Value,
) -> (u16, Option<String>, Option<String>, Value) {
    let resp = s
        .client
        .post(url)
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap();
    let h = |n: &str| {
        resp.headers()
            .get(n)
            .map(|v| v.to_str().unwrap().to_string())
    };
    let (retry_after, should_retry) = (h("retry-after"), h("x-should-retry"));
    let status = resp.status().as_u16();
    (
        status,
        retry_after,
        should_retry,
        resp.json().await.unwrap(),
    )
}

/// A batch holds one of its tenant's concurrency slots while its items run: the
/// tenant's own requests get the concurrency 429 meanwhile, the items all run (no
/// item is refused by its own batch), and the slot comes back at the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_holds_one_concurrency_slot_while_its_items_run() {
    let s = start().await;
    let limits = Limits {
        max_concurrent: 1,
        ..Limits::default()
    };
    let (t, key) = s.tenant_with_key("one-at-a-time", limits).await;
    let items: Vec<Value> = (0..4)
        .map(|i| json!({"prompt": format!("Count from {} to 500.", i + 3), "max_tokens": 64}))
        .collect();
    let id = submit(&s, &t.id, &key, Value::Array(items)).await;
    assert_eq!(s.state.limiter.inflight(&t.id), 1, "one slot for the batch");
    let (st, v) = run_hi(&s, &t.id, &key).await;
    assert_eq!(st, 429, "the batch holds the only slot: {v}");
    assert!(s.state.metrics.refused_count("max_concurrent") > 0);
    let done = wait_done(&s, &t.id, &key, &id).await;
    let responses = done["responses"].as_array().unwrap();
    assert!(
        responses.iter().all(|r| r["success"] == true),
        "every item ran on the batch's slot: {done}"
    );
    s.settle().await;
    assert_eq!(s.state.limiter.inflight(&t.id), 0, "the slot came back");
    let rows = s.store().usage_rows(Some(&t.id)).await.unwrap();
    assert_eq!(rows.len(), 4, "one row per item, none for the refusal");
    let (st, v) = run_hi(&s, &t.id, &key).await;
    assert_eq!(st, 200, "{v}");
}

/// The attack of issue 32 item 1: a tenant limited to 1 request/minute submitted
/// batches that were validated (their last item invalid) and run without touching
/// any limit. Now a submission takes a request per item before any item is
/// validated (a 429, not the 400 its invalid item would get), all or nothing, in
/// the same shape as any request's 429, and writes no usage row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_takes_a_request_per_item_before_its_items_are_validated() {
    let s = start().await;
    let limits = ONE_A_MINUTE;
    let (t, key) = s.tenant_with_key("one-a-minute", limits).await;
    let url = batch_url(&s, &t.id);
    let bad_last = json!({"requests": [
        {"prompt": "Hi", "max_tokens": 2},
        {"prompt": "Hi", "temperature": 9},
    ]});
    let (st, retry_after, should_retry, v) = post_with_headers(&s, &url, &key, &bad_last).await;
    assert_eq!(st, 429, "refused before its invalid item is looked at: {v}");
    assert_eq!(v["success"], false);
    assert_eq!(v["errors"][0]["code"], 3040, "{v}");
    let msg = v["errors"][0]["message"].as_str().unwrap();
    assert!(msg.contains("requests_per_minute"), "{msg}");
    assert!(retry_after.is_some());
    assert_eq!(
        should_retry.as_deref(),
        Some("false"),
        "2 requests never fit 1/minute"
    );
    assert_eq!(s.state.metrics.refused_count("requests_per_minute"), 1);
    // All or nothing: the refused batch took nothing, so the minute's one request
    // is still there for a request...
    let (st, v) = run_hi(&s, &t.id, &key).await;
    assert_eq!(st, 200, "{v}");
    // ...which spent it: a batch of one item now waits for the next minute, and is
    // refused exactly as a request is.
    let one = json!({"requests": [{"prompt": "Hi", "max_tokens": 2}]});
    let (st, retry_after, should_retry, batch_429) = post_with_headers(&s, &url, &key, &one).await;
    assert_eq!(st, 429, "{batch_429}");
    assert_eq!(should_retry.as_deref(), Some("true"));
    assert!(retry_after.is_some());
    let (st, _, _, request_429) = post_with_headers(
        &s,
        &s.run_url(&t.id),
        &key,
        &json!({"prompt": "Hi", "max_tokens": 2}),
    )
    .await;
    assert_eq!(st, 429);
    assert_eq!(
        batch_429["errors"][0]["code"],
        request_429["errors"][0]["code"]
    );
    assert_eq!(s.state.metrics.refused_count("requests_per_minute"), 3);
    s.settle().await;
    let rows = s.store().usage_rows(Some(&t.id)).await.unwrap();
    assert_eq!(rows.len(), 1, "the one request's row; none for refusals");
    assert_eq!(rows[0].endpoint, "workers_ai.run");
    assert_eq!(s.state.limiter.inflight(&t.id), 0);
    // An accepted batch spends its requests: after a batch of one item, the
    // minute's one request is gone.
    let (t2, key2) = s.tenant_with_key("one-a-minute-too", limits).await;
    let id = submit(
        &s,
        &t2.id,
        &key2,
        json!([{"prompt": "Hi", "max_tokens": 2}]),
    )
    .await;
    let (st, v) = run_hi(&s, &t2.id, &key2).await;
    assert_eq!(st, 429, "the batch took the minute's request: {v}");
    let done = wait_done(&s, &t2.id, &key2, &id).await;
    assert_eq!(done["responses"][0]["success"], true, "{done}");
}

/// Issue 32 review: a tenant past its allowance still had each 1 MB batch read and
/// parsed before the 429 (a flood cost the gateway a core). A large submission is
/// now refused from the limiter's state before its body is parsed: a malformed 200 KB
/// body gets the 429, not the 400 parsing it would give; a small body (a poll, or
/// anything under the threshold) is still read and answered on its merits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spent_tenants_large_submission_is_refused_before_its_body_is_parsed() {
    let s = start().await;
    let limits = ONE_A_MINUTE;
    let (t, key) = s.tenant_with_key("spent", limits).await;
    let url = batch_url(&s, &t.id);
    let (st, v) = run_hi(&s, &t.id, &key).await;
    assert_eq!(st, 200, "{v}");
    let send = |body: String| {
        s.client
            .post(&url)
            .bearer_auth(&key)
            .header("content-type", "application/json")
            .body(body)
            .send()
    };
    let junk = format!("{{\"requests\": [{}", "x".repeat(200 << 10));
    let resp = send(junk).await.unwrap();
    assert_eq!(resp.status(), 429);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["errors"][0]["code"], 3040, "{v}");
    let resp = send("{\"requests\": [".into()).await.unwrap();
    assert_eq!(resp.status(), 400, "a small body is parsed");
    // A tenant with its minute left is not refused by the check: its large
    // malformed body is read and gets the 400.
    let (t2, key2) = s.tenant_with_key("fresh", limits).await;
    let resp = s
        .client
        .post(batch_url(&s, &t2.id))
        .bearer_auth(&key2)
        .header("content-type", "application/json")
        .body(format!("{{\"requests\": [{}", "x".repeat(200 << 10)))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 400);
    assert_eq!(s.state.metrics.refused_count("requests_per_minute"), 1);
}

/// Every item's tokens (prompt + `max_tokens`) are reserved against the daily quota
/// at submission: a batch whose items together exceed it is refused 429 (the
/// quota's code) with no row and nothing left reserved, even when each item alone
/// would fit; a batch that fits is charged exactly its items' real tokens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_reserves_every_items_daily_tokens_at_submission() {
    let s = start().await;
    let limits = Limits {
        daily_tokens: 150,
        ..Limits::default()
    };
    let (t, key) = s.tenant_with_key("daily", limits).await;
    let url = batch_url(&s, &t.id);
    let item = json!({"prompt": "Hi", "max_tokens": 40});
    let three = json!({"requests": [item, item, item]});
    let (st, retry_after, _, v) = post_with_headers(&s, &url, &key, &three).await;
    assert_eq!(st, 429, "3 x (prompt + 40) > 150: {v}");
    assert_eq!(v["errors"][0]["code"], 3036, "the daily quota's code: {v}");
    assert!(retry_after.is_some());
    assert!(s.state.metrics.refused_count("daily_tokens") >= 1);
    let d = s.state.limiter.daily(&t.id).expect("loaded");
    assert_eq!((d.used, d.reserved), (0, 0), "a refusal keeps nothing");
    assert_eq!(s.state.limiter.inflight(&t.id), 0);
    assert_eq!(s.row_count().await, 0, "no row for a refused batch");
    // One item alone fits.
    let id = submit(&s, &t.id, &key, json!([item])).await;
    let done = wait_done(&s, &t.id, &key, &id).await;
    assert_eq!(done["responses"][0]["success"], true, "{done}");
    s.settle().await;
    let rows = s.store().usage_rows(Some(&t.id)).await.unwrap();
    assert_eq!(rows.len(), 1);
    let d = s.state.limiter.daily(&t.id).unwrap();
    assert_eq!(d.reserved, 0, "settled");
    assert_eq!(
        d.used,
        rows[0].input_tokens + rows[0].output_tokens,
        "charged the item's real tokens"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_batches_are_refused_naming_the_field_and_run_nothing() {
    let s = start().await;
    let url = batch_url(&s, &s.tenant.id);
    let cases = [
        (json!({"requests": []}), "requests"),
        (json!({"requests": "x"}), "requests"),
        (
            json!({"requests": [{"prompt": "a"}, {"prompt": "b", "stream": true}]}),
            "requests[1].stream",
        ),
        (
            json!({"requests": [{"prompt": "a", "temperature": 9}]}),
            "requests[0].temperature",
        ),
        (json!({"requests": [{"max_tokens": 4}]}), "requests[0]"),
        (
            json!({"requests": [{"prompt": "a", "external_reference": {"a": 1}}]}),
            "requests[0].external_reference",
        ),
        (
            json!({"requests": [{"prompt": "a"}], "request_id": "x"}),
            "not both",
        ),
        (json!({}), "`requests`"),
        (json!({"request_id": 5}), "request_id"),
        (json!({"request_id": "x".repeat(100)}), "request_id"),
        // Checked as a request is, before anything runs: the context window.
        (
            json!({"requests": [{"prompt": "a", "max_tokens": 5}, {"prompt": "b", "max_tokens": 99999999}]}),
            "requests[1]",
        ),
    ];
    for (body, needle) in cases {
        let (st, _, v) = s.post(&url, Some(&s.key), &body).await;
        assert_eq!(st, 400, "{body}: {v}");
        assert_eq!(v["success"], false);
        let msg = v["errors"][0]["message"].as_str().unwrap();
        // `requests[i]` and the field, as in `requests[1]: `stream` must be false`.
        for part in needle.split('.') {
            assert!(msg.contains(part), "{body}: {msg} should name {needle}");
        }
    }
    let too_many = Value::Array(vec![json!({"prompt": "a"}); 257]);
    let (st, _, _) = s
        .post(&url, Some(&s.key), &json!({"requests": too_many}))
        .await;
    assert_eq!(st, 400);
    let (st, _, v) = s
        .post(
            &format!("{}?queueRequest=yes", s.run_url(&s.tenant.id)),
            Some(&s.key),
            &json!({"requests": [{"prompt": "a"}]}),
        )
        .await;
    assert_eq!(st, 400, "{v}");
    // Credentials: none, empty, wrong account.
    let one = json!({"requests": [{"prompt": "a"}]});
    assert_eq!(s.post(&url, None, &one).await.0, 401);
    assert_eq!(s.post(&url, Some(""), &one).await.0, 401);
    let (other, other_key) = s.tenant_with_key("beta", Limits::default()).await;
    assert_eq!(s.post(&url, Some(&other_key), &one).await.0, 403);
    let unknown_model = format!(
        "{}/client/v4/accounts/{}/ai/run/@cf/nope?queueRequest=true",
        s.base, other.id
    );
    assert_eq!(s.post(&unknown_model, Some(&other_key), &one).await.0, 404);
    // Nothing ran.
    assert_eq!(s.row_count().await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_batches_per_tenant_are_bounded_and_results_expire() {
    let s = start_with(GatewayOptions {
        batch_retention: Duration::from_secs(3),
        ..GatewayOptions::default()
    })
    .await;
    let long = json!([{"prompt": "Count from 1 to 500.", "max_tokens": 160},
                      {"prompt": "Count from 1 to 600.", "max_tokens": 160}]);
    let mut ids = vec![];
    for _ in 0..tessera_gateway::batch::MAX_OPEN_BATCHES_PER_TENANT {
        ids.push(submit(&s, &s.tenant.id, &s.key, long.clone()).await);
    }
    let (st, _, v) = s
        .post(
            &batch_url(&s, &s.tenant.id),
            Some(&s.key),
            &json!({"requests": long}),
        )
        .await;
    assert_eq!(st, 429, "{v}");
    // Another tenant is not held back by this one's batches.
    let (other, other_key) = s.tenant_with_key("beta", Limits::default()).await;
    let theirs = submit(
        &s,
        &other.id,
        &other_key,
        json!([{"prompt": "Hi", "max_tokens": 2}]),
    )
    .await;
    // Poll every open batch in turn (a finished one is kept for the retention only).
    let mut pending: Vec<(String, String, String)> = ids
        .iter()
        .map(|id| (s.tenant.id.clone(), s.key.clone(), id.clone()))
        .chain([(other.id.clone(), other_key.clone(), theirs)])
        .collect();
    for _ in 0..1200 {
        let mut still = vec![];
        for (account, key, id) in pending {
            let (st, _, v) = s
                .post(
                    &batch_url(&s, &account),
                    Some(&key),
                    &json!({"request_id": id}),
                )
                .await;
            assert_eq!(st, 200, "{v}");
            if v["result"].get("responses").is_none() {
                still.push((account, key, id));
            }
        }
        pending = still;
        if pending.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(pending.is_empty(), "batches did not finish");
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let (st, _, v) = s
        .post(
            &batch_url(&s, &s.tenant.id),
            Some(&s.key),
            &json!({"request_id": ids[0]}),
        )
        .await;
    assert_eq!(st, 404, "results are gone after the retention: {v}");
}

/// Finished batches count against their tenant until they expire, so one tenant
/// cannot fill the gateway's store for the others (here with batches of one
/// one-token item, which finish at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_cannot_fill_the_gateways_batch_store() {
    use tessera_gateway::batch::MAX_STORED_BATCHES_PER_TENANT;
    let s = start().await;
    let (t, key) = s.tenant_with_key("busy", Limits::default()).await;
    let one = json!([{"prompt": "x", "max_tokens": 1}]);
    let mut stored = 0;
    while stored < MAX_STORED_BATCHES_PER_TENANT {
        let (st, _, v) = s
            .post(&batch_url(&s, &t.id), Some(&key), &json!({"requests": one}))
            .await;
        match st {
            200 => stored += 1,
            // At most 4 open at once: wait for them to finish.
            429 => tokio::time::sleep(Duration::from_millis(50)).await,
            _ => panic!("{st}: {v}"),
        }
    }
    let (st, _, v) = s
        .post(&batch_url(&s, &t.id), Some(&key), &json!({"requests": one}))
        .await;
    assert_eq!(st, 429, "{v}");
    assert!(
        v["errors"][0]["message"]
            .as_str()
            .unwrap()
            .contains("stored"),
        "{v}"
    );
    // Everyone else still gets batches.
    submit(
        &s,
        &s.tenant.id,
        &s.key,
        json!([{"prompt": "Hi", "max_tokens": 2}]),
    )
    .await;
}
