//! Metrics over real HTTP scrapes of a gateway in front of a prefill and a decode
//! engine in this process (the `tessera serve` default): known requests, a
//! corrupted transfer, a duplicated commit, a planted block-table bug, replayed
//! late writes, a client abort, refusals; every counter must move by exactly what
//! those requests explain.

mod common;

use common::*;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::{Duration, Instant};
use tessera_gateway::GatewayOptions;
use tessera_serving::TransferFault;
use tessera_tenancy::Limits;

/// One scrape: `name{labels}` -> value.
type Scrape = HashMap<String, f64>;

async fn scrape(s: &TestServer) -> Scrape {
    let resp = s
        .admin(reqwest::Method::GET, "/metrics")
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let ctype = resp.headers()["content-type"].to_str().unwrap().to_string();
    assert!(ctype.starts_with("application/openmetrics-text"), "{ctype}");
    let text = resp.text().await.unwrap();
    assert!(text.ends_with("# EOF\n"), "{text}");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse::<f64>().unwrap())
        })
        .collect()
}

fn get(m: &Scrape, key: &str) -> f64 {
    m.get(key).copied().unwrap_or(0.0)
}

/// How much `key` moved between two scrapes.
fn moved(a: &Scrape, b: &Scrape, key: &str) -> f64 {
    get(b, key) - get(a, key)
}

/// A raw prompt the model keeps continuing (counting), same for every request.
fn counting(max_tokens: u32, stream: bool) -> Value {
    let numbers: Vec<String> = (1..=20).map(|i| i.to_string()).collect();
    json!({"prompt": numbers.join(", ") + ",", "raw": true, "max_tokens": max_tokens,
           "temperature": 0, "stream": stream})
}

/// Reads SSE frames until one satisfies `stop` or the body ends; returns them.
async fn read_frames(resp: &mut reqwest::Response, stop: impl Fn(&str) -> bool) -> Vec<String> {
    let mut frames = Vec::new();
    let mut buf = String::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline {
        let Ok(Some(chunk)) = resp.chunk().await else {
            break;
        };
        buf.push_str(&String::from_utf8_lossy(&chunk));
        while let Some(i) = buf.find("\n\n") {
            let f: String = buf.drain(..i + 2).collect();
            let done = stop(&f);
            frames.push(f);
            if done {
                return frames;
            }
        }
    }
    frames
}

/// Scrapes until `key` reaches `want` (bounded; nodes apply commands between steps).
async fn until(s: &TestServer, key: &str, want: f64) -> Scrape {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = scrape(s).await;
        if get(&m, key) >= want || Instant::now() > deadline {
            return m;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_counter_moves_by_exactly_what_the_requests_explain() {
    let s = start_pd(GatewayOptions {
        metrics_top_tenants: 1,
        ..GatewayOptions::default()
    })
    .await;
    let cluster = s.state.engine.cluster().expect("in-process PD");
    let alpha = s.tenant.id.clone();
    let url = s.run_url(&alpha);
    let (beta, beta_key) = s.tenant_with_key("beta", Limits::default()).await;
    let (gamma, gamma_key) = s
        .tenant_with_key(
            "gamma",
            Limits {
                requests_per_minute: 1,
                ..Limits::default()
            },
        )
        .await;
    let page_bytes = s
        .state
        .model
        .transformer
        .config()
        .kv_layout(16)
        .page_bytes() as f64;

    let before = scrape(&s).await;
    // Two successful requests of alpha, one of beta (beyond the top 1: `other`).
    let mut alpha_tokens = (0.0, 0.0);
    for _ in 0..2 {
        let (st, _, v) = s.post(&url, Some(&s.key), &counting(6, false)).await;
        assert_eq!(st, 200, "{v}");
        alpha_tokens.0 += v["result"]["usage"]["prompt_tokens"].as_f64().unwrap();
        alpha_tokens.1 += v["result"]["usage"]["completion_tokens"].as_f64().unwrap();
    }
    let prompt = alpha_tokens.0 / 2.0;
    let pages = (prompt / 16.0).ceil();
    let (st, _, v) = s
        .post(&s.run_url(&beta.id), Some(&beta_key), &counting(6, false))
        .await;
    assert_eq!(st, 200, "{v}");
    // A corrupted transfer: the decode node refuses the commit (checksum), 500.
    cluster.inject_fault(TransferFault::CorruptByte);
    let (st, _, v) = s.post(&url, Some(&s.key), &counting(6, false)).await;
    assert_eq!(st, 500, "{v}");
    // A duplicated commit: the second is refused, the request succeeds.
    cluster.inject_fault(TransferFault::DuplicateCommit);
    let (st, _, v) = s.post(&url, Some(&s.key), &counting(6, false)).await;
    assert_eq!(st, 200, "{v}");
    // Replayed writes of a finished request: refused and dropped (no reservation
    // awaits them; in one process there is no link to cut).
    cluster.tap_writes();
    let (st, _, v) = s.post(&url, Some(&s.key), &counting(6, false)).await;
    assert_eq!(st, 200, "{v}");
    let writes = cluster.tapped_writes();
    assert_eq!(writes.len() as f64, pages);
    for w in writes {
        cluster.deliver_write(0, w);
    }
    // A planted block-table bug on the decode node: the running request's first
    // block points at a page it does not own; attention's tag check fails it.
    let mut resp = s
        .client
        .post(&url)
        .bearer_auth(&s.key)
        .json(&counting(400, true))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    read_frames(&mut resp, |f| f.contains("\"response\"")).await;
    cluster.with_decode_engine(0, |e| {
        let ids = e.running_ids();
        assert_eq!(ids.len(), 1, "one request decoding");
        let own: Vec<u32> = e
            .kv()
            .table(ids[0])
            .unwrap()
            .iter()
            .map(|r| r.page)
            .collect();
        let foreign = (0..e.kv().pool().capacity() as u32)
            .find(|p| !own.contains(p))
            .unwrap();
        e.kv_mut_for_test().table_mut_for_test(ids[0]).unwrap()[0].page = foreign;
    });
    let frames = read_frames(&mut resp, |f| f.contains("error")).await;
    assert!(
        frames.last().is_some_and(|f| f.contains("integrity")),
        "{frames:?}"
    );
    // A client that goes away after its first token (decode phase).
    let mut resp = s
        .client
        .post(&url)
        .bearer_auth(&s.key)
        .json(&counting(400, true))
        .send()
        .await
        .unwrap();
    read_frames(&mut resp, |f| f.contains("\"response\"")).await;
    drop(resp);
    // Refusals: no key; gamma over its requests/minute.
    let (st, _, _) = s.post(&url, None, &counting(6, false)).await;
    assert_eq!(st, 401);
    let gamma_url = s.run_url(&gamma.id);
    let (st, _, _) = s
        .post(&gamma_url, Some(&gamma_key), &counting(6, false))
        .await;
    assert_eq!(st, 200);
    let (st, _, _) = s
        .post(&gamma_url, Some(&gamma_key), &counting(6, false))
        .await;
    assert_eq!(st, 429);
    s.settle().await;
    let late = r#"tessera_kv_late_writes_dropped_total{node="decode-0",role="decode"}"#;
    let after = until(&s, late, get(&before, late) + pages).await;

    let m = tessera_model::gguf::DEFAULT_MODEL_ID;
    let d = |k: &str| moved(&before, &after, k);
    let req = |tenant: &str, status: u16, code: u32| {
        format!(
            r#"tessera_requests_total{{model="{m}",api="workers_ai.run",status="{status}",code="{code}",tenant="{tenant}"}}"#
        )
    };
    // alpha: 2 + duplicate + tapped = 4 successes; corrupt + planted = 2 failures.
    assert_eq!(d(&req(&alpha, 200, 0)), 4.0);
    assert_eq!(d(&req(&alpha, 500, 3043)), 2.0);
    assert_eq!(d(&req(&alpha, 499, 3008)), 1.0);
    assert_eq!(
        d(&req("other", 200, 0)),
        2.0,
        "beta and gamma are not top 1"
    );
    assert_eq!(d(&req(&beta.id, 200, 0)), 0.0);
    assert_eq!(
        d(&format!(
            r#"tessera_request_duration_seconds_count{{model="{m}"}}"#
        )),
        9.0
    );
    let tokens = |dir: &str, tenant: &str| {
        d(&format!(
            r#"tessera_tokens_total{{model="{m}",direction="{dir}",tenant="{tenant}"}}"#
        ))
    };
    // alpha's prompts are charged once a token exists: all but the corrupted one.
    assert_eq!(tokens("input", &alpha), 6.0 * prompt);
    assert_eq!(tokens("input", "other"), 2.0 * prompt);
    assert_eq!(tokens("output", "other"), 12.0);
    assert!(tokens("output", &alpha) >= alpha_tokens.1 + 12.0);
    // Integrity, where the checks happened.
    assert_eq!(d(r#"tessera_serve_errors_total{kind="integrity"}"#), 2.0);
    let node = |name: &str, labels: &str| {
        d(&format!(
            r#"{name}{{node="decode-0",role="decode",{labels}}}"#
        ))
    };
    assert_eq!(
        node(
            "tessera_kv_commits_rejected_total",
            r#"reason="checksum_mismatch""#
        ),
        1.0
    );
    assert_eq!(
        node(
            "tessera_kv_commits_rejected_total",
            r#"reason="not_awaiting_commit""#
        ),
        1.0
    );
    assert_eq!(
        node("tessera_kv_tag_mismatches_total", r#"reader="attention""#),
        1.0
    );
    assert_eq!(
        node(
            "tessera_kv_tag_mismatches_total",
            r#"reader="transfer_sink""#
        ),
        0.0
    );
    assert_eq!(d(late), pages);
    // Each replayed write is a protocol violation by the writer.
    assert_eq!(
        d(
            r#"tessera_node_link_violations_total{node="decode-0",role="decode",reason="refused_write"}"#
        ),
        pages
    );
    for reader in ["attention", "transfer_source"] {
        let k = format!(
            r#"tessera_kv_tag_mismatches_total{{node="prefill-0",role="prefill",reader="{reader}"}}"#
        );
        assert!(after.contains_key(&k), "{k} is exported at 0");
        assert_eq!(d(&k), 0.0, "{k}");
    }
    // Transfers: 9 requests reached the transfer, each moved `pages` pages.
    let p = |name: &str| d(&format!(r#"{name}{{node="prefill-0",role="prefill"}}"#));
    assert_eq!(p("tessera_kv_transfer_seconds_count"), 9.0);
    assert_eq!(
        p("tessera_kv_transfer_bytes_total"),
        9.0 * pages * page_bytes
    );
    // The abort, its acknowledgement; the refusals.
    assert_eq!(
        d(r#"tessera_aborts_total{phase="decode",reason="client_gone"}"#),
        1.0
    );
    assert_eq!(d("tessera_abort_ack_seconds_count"), 1.0);
    assert_eq!(
        d(r#"tessera_auth_failures_total{reason="missing_key"}"#),
        1.0
    );
    assert_eq!(
        d(r#"tessera_rate_limited_total{limit="requests_per_minute"}"#),
        1.0
    );
    // Every page is back on both nodes; nothing is queued.
    s.wait_idle().await;
    let idle = scrape(&s).await;
    for n in ["prefill-0", "decode-0"] {
        let role = &n[..n.len() - 2];
        let k = |state: &str| {
            get(
                &idle,
                &format!(r#"tessera_kv_pages{{node="{n}",role="{role}",state="{state}"}}"#),
            )
        };
        // Pages the prefill node's prefix cache kept are held, never free.
        assert_eq!(k("free") + k("cached"), 8192.0 / 16.0, "{n}");
        assert_eq!((k("reserved"), k("in_use")), (0.0, 0.0), "{n}");
        assert_eq!(
            get(
                &idle,
                &format!(r#"tessera_queue_depth{{node="{n}",role="{role}"}}"#)
            ),
            0.0
        );
    }
}

/// Every metric a dashboard panel or an alert rule queries is one this deployment
/// exports (by the `# TYPE` line of its family, so families still without series
/// count), and every alert links a runbook that exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_alert_queries_name_exported_metrics_and_runbooks_exist() {
    let s = start_pd(GatewayOptions::default()).await;
    let text = s.metrics_text().await;
    // Families with series show in the scrape; labelled families stay silent until
    // their first series, so the names registered in the metrics modules count too.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut families: std::collections::HashSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split(' ').next())
        .map(str::to_string)
        .collect();
    assert!(families.contains("tessera_kv_capacity_pages"), "{text}");
    for src in ["gateway/src/metrics.rs", "backend/serving/src/metrics.rs"] {
        let code = std::fs::read_to_string(root.join(src)).unwrap();
        let mut lines = code.lines();
        while let Some(l) = lines.next() {
            if l.trim_end().ends_with(".register(") {
                let name = lines.next().unwrap().trim().trim_end_matches(',');
                families.insert(name.trim_matches('"').to_string());
            }
        }
    }
    assert!(families.contains("tessera_requests"), "{families:?}");
    let dashboard: Value = serde_json::from_str(
        &std::fs::read_to_string(root.join("ops/dashboards/tessera.json")).unwrap(),
    )
    .expect("the dashboard is valid JSON");
    let mut exprs = Vec::new();
    fn walk(v: &Value, out: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                for (k, v) in m {
                    match (k.as_str(), v) {
                        ("expr", Value::String(e)) => out.push(e.clone()),
                        _ => walk(v, out),
                    }
                }
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    walk(&dashboard, &mut exprs);
    assert!(exprs.len() >= 10, "{exprs:?}");
    let rules = std::fs::read_to_string(root.join("ops/alerts/tessera.rules.yml")).unwrap();
    let mut alert_exprs = 0;
    let all: Vec<&str> = rules.lines().collect();
    for (i, raw) in all.iter().enumerate() {
        let line = raw.trim();
        if let Some(e) = line.strip_prefix("expr:") {
            let mut e = e.trim().to_string();
            if e == "|" || e == ">" {
                // A block scalar: the more indented lines below.
                let indent = raw.len() - raw.trim_start().len();
                e = all[i + 1..]
                    .iter()
                    .take_while(|l| l.len() - l.trim_start().len() > indent || l.trim().is_empty())
                    .map(|l| l.trim())
                    .collect::<Vec<_>>()
                    .join(" ");
            }
            exprs.push(e);
            alert_exprs += 1;
        }
        if let Some(rb) = line.strip_prefix("runbook:") {
            let path = root.join(rb.trim());
            assert!(path.exists(), "alert runbook {} is missing", path.display());
        }
    }
    assert!(alert_exprs >= 5);
    for e in &exprs {
        let mut checked = 0;
        let mut rest = e.as_str();
        while let Some(at) = rest.find("tessera_") {
            let name: String = rest[at..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            rest = &rest[at + name.len()..];
            let family = ["_total", "_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .unwrap_or(&name);
            assert!(
                families.contains(family),
                "`{e}` queries {name}, which no family exports"
            );
            checked += 1;
        }
        // Only a scrape-target check (`up`, node down) names no metric of ours.
        assert!(
            checked > 0 || e.contains("up{"),
            "`{e}` names no Tessera metric"
        );
    }
}

/// Labelled families whose label values are known in advance are in the very
/// first scrape, every series at 0 (an alert on `tessera_rate_limited_total` or
/// `tessera_aborts_total` reads 0 before the first event, not "no data"); the first
/// refusal then moves exactly its own series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn known_label_sets_are_exported_at_zero_before_their_first_event() {
    let s = start().await;
    let first = scrape(&s).await;
    let mut want = Vec::new();
    for phase in ["prefill", "decode"] {
        for reason in ["client_gone", "shutdown", "timeout", "key_invalid"] {
            want.push(format!(
                r#"tessera_aborts_total{{phase="{phase}",reason="{reason}"}}"#
            ));
        }
    }
    for reason in tessera_gateway::metrics::REFUSAL_REASONS {
        want.push(format!(r#"tessera_refused_total{{reason="{reason}"}}"#));
    }
    for limit in [
        "requests_per_minute",
        "input_tokens_per_minute",
        "output_tokens_per_minute",
        "max_concurrent",
        "daily_tokens",
        "usage_queries_per_minute",
    ] {
        want.push(format!(r#"tessera_rate_limited_total{{limit="{limit}"}}"#));
    }
    for reason in ["missing_key", "invalid_key", "scope", "admin_auth"] {
        want.push(format!(
            r#"tessera_auth_failures_total{{reason="{reason}"}}"#
        ));
    }
    for k in &want {
        assert_eq!(first.get(k), Some(&0.0), "{k} is not exported at 0");
    }

    // One anonymous request: only its own series move.
    let (st, _, v) = s
        .post(&s.run_url(&s.tenant.id), None, &counting(2, false))
        .await;
    assert_eq!(st, 401, "{v}");
    let after = scrape(&s).await;
    for k in &want {
        let by = if k.contains(r#""missing_key""#) {
            1.0
        } else {
            0.0
        };
        assert_eq!(moved(&first, &after, k), by, "{k}");
    }
}
