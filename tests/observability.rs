//! Observability of real processes (issue 11): OpenTelemetry traces from a gateway
//! (`tessera serve --config`) and its prefill and decode nodes (`tessera node`)
//! received by an OTLP/HTTP receiver inside the test; the one JSON log line per
//! finished request of `tessera serve --log-format json`; a node's own Prometheus
//! endpoint (`tessera node --metrics-listen`), quarantined KV pages included.
//!
//! Every process starts with `RUST_LOG` and every `OTEL_*` variable of the test's
//! environment removed, so only what a test sets applies. Every wait is bounded by a
//! deadline; nothing asserts how fast anything runs.

mod common;
#[path = "common/otlp.rs"]
mod otlp;

use axum::http::header::CONTENT_TYPE;
use common::*;
use otlp::{Otlp, Span};
use serde_json::{json, Value};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

/// Spawns `tessera ARGS` with `RUST_LOG` and every `OTEL_*` variable removed and
/// `env` set (stdout piped, stderr to `log`); reads stdout until a line satisfies
/// `done`. Returns the child and the stdout lines read (stdout keeps being drained).
async fn spawn(
    args: &[&str],
    env: &[(&str, &str)],
    log: &Path,
    done: impl Fn(&str) -> bool,
) -> (Child, Vec<String>) {
    let mut cmd = Command::new(BIN);
    cmd.args(args);
    for (k, _) in std::env::vars_os() {
        if k.to_str().is_some_and(|k| k.starts_with("OTEL_")) {
            cmd.env_remove(k);
        }
    }
    for k in [
        "RUST_LOG",
        "TESSERA_TEST_NODE_PANIC",
        "TESSERA_STORE",
        "TESSERA_ADMIN_TOKEN",
        "TESSERA_MODEL",
        "TESSERA_DATA_DIR",
    ] {
        cmd.env_remove(k);
    }
    let mut child = cmd
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut out = Vec::new();
    let read = async {
        while let Some(l) = lines.next_line().await.unwrap() {
            let d = done(&l);
            out.push(l);
            if d {
                return true;
            }
        }
        false
    };
    if !matches!(tokio::time::timeout(START, read).await, Ok(true)) {
        let _ = child.start_kill();
        panic!(
            "tessera {args:?} did not start; stdout: {out:?}; stderr: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, out)
}

/// `tessera node --role ROLE` of `config` on `127.0.0.1:PORT` with `extra` arguments
/// and `env` (log `dir/ROLE.log`); returns the child and its stdout lines up to its
/// ready line.
async fn node(
    dir: &Path,
    config: &Path,
    role: &str,
    port: u16,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (Child, Vec<String>) {
    let listen = format!("127.0.0.1:{port}");
    let transport = transport();
    let mut args = vec![
        "node",
        "--role",
        role,
        "--config",
        config.to_str().unwrap(),
        "--listen",
        &listen,
        "--transport",
        &transport,
    ];
    args.extend_from_slice(extra);
    spawn(&args, env, &dir.join(format!("{role}.log")), |l| {
        l.contains("listening on")
    })
    .await
}

/// A `tessera serve` process and what its first-start banner says.
struct Serve {
    child: Child,
    base: String,
    account: String,
    key: String,
}

impl Serve {
    /// `tessera serve ARGS` with `env` (log `dir/gateway.log`, store in `dir/data`).
    async fn start(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> Self {
        let data = dir.join("data");
        let mut all = vec![
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data.to_str().unwrap(),
        ];
        all.extend_from_slice(args);
        let (child, banner) = spawn(&all, env, &dir.join("gateway.log"), |l| {
            l.trim_start().starts_with("-d ")
        })
        .await;
        let find = |prefix: &str| {
            banner
                .iter()
                .find_map(|l| {
                    l.trim_start()
                        .strip_prefix(prefix)
                        .map(|s| s.trim().to_string())
                })
                .unwrap_or_else(|| panic!("no `{prefix}` in banner {banner:?}"))
        };
        Self {
            child,
            base: find("tessera: listening on "),
            account: find("account id:"),
            key: find("API key:"),
        }
    }

    fn url(&self) -> String {
        format!(
            "{}/client/v4/accounts/{}/ai/run/{MODEL_ID}",
            self.base, self.account
        )
    }

    /// POSTs `body` with bearer `key`: (status, `x-request-id`, the body as text).
    async fn post(&self, key: &str, body: &Value) -> (u16, String, String) {
        let resp = reqwest::Client::new()
            .post(self.url())
            .bearer_auth(key)
            .json(body)
            .timeout(REQUEST)
            .send()
            .await
            .unwrap_or_else(|e| panic!("request {body} failed: {e}"));
        let status = resp.status().as_u16();
        let rid = resp
            .headers()
            .get("x-request-id")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        (status, rid, resp.text().await.unwrap())
    }
}

/// Sends SIGTERM (a graceful stop: a node drains, a gateway finishes and closes) and
/// waits until `child` exited; panics unless it exits successfully in time.
async fn terminate(child: &mut Child, what: &str, dir: &Path) {
    let pid = child.id().expect("running").to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let status = tokio::time::timeout(START, child.wait())
        .await
        .unwrap_or_else(|_| panic!("{what} did not exit after SIGTERM\n{}", logs(dir)))
        .unwrap();
    assert!(
        status.success(),
        "{what} exited with {status}\n{}",
        logs(dir)
    );
}

/// The OTel environment of a traced process: export to `endpoint`, and a batch delay
/// of an hour, so the spans can only arrive through the flush at shutdown.
fn otel_env(endpoint: &str) -> [(&str, &str); 2] {
    [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint),
        ("OTEL_BSP_SCHEDULE_DELAY", "3600000"),
    ]
}

/// One request through a gateway and a prefill and a decode node, each its own
/// process exporting to the receiver, is one trace: the gateway's `request` span
/// (with its request id) is the root, the nodes' phase spans are its children under
/// the same trace id (W3C `traceparent` on the node links), and the phases named in
/// issue 11 all appear: validation, admission and stream on the gateway, queue and
/// decode on the decode node, prefill and transfer on the prefill node. The spans
/// arrive through each process's flush at a graceful stop (SIGTERM).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_request_is_one_trace_across_the_gateway_and_both_nodes() {
    let otlp = Otlp::start().await;
    let endpoint = otlp.endpoint();
    let env = otel_env(&endpoint);
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = (free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
    let (mut decode, _) = node(dir.path(), &config, "decode", d, &[], &env).await;
    let (mut prefill, _) = node(dir.path(), &config, "prefill", p, &[], &env).await;
    let config_arg = config.to_str().unwrap().to_string();
    let mut gw = Serve::start(dir.path(), &["--config", &config_arg], &env).await;

    let (status, rid, body) = gw.post(&gw.key.clone(), &greedy(8)).await;
    assert_eq!(status, 200, "{body}\n{}", logs(dir.path()));
    assert!(!rid.is_empty(), "no x-request-id");

    terminate(&mut gw.child, "the gateway", dir.path()).await;
    terminate(&mut prefill, "the prefill node", dir.path()).await;
    terminate(&mut decode, "the decode node", dir.path()).await;

    let bad = otlp.bad();
    assert!(bad.is_empty(), "undecodable export requests: {bad:?}");
    let spans = otlp.spans();
    let roots: Vec<&Span> = spans.iter().filter(|s| s.name == "request").collect();
    assert_eq!(
        roots.len(),
        1,
        "one request, one `request` span: {spans:#?}\n{}",
        logs(dir.path())
    );
    let root = roots[0];
    assert_eq!(root.service, "tessera-gateway");
    assert_eq!(root.attrs.get("request_id"), Some(&rid), "{root:?}");
    assert_eq!(root.attrs.get("model").map(String::as_str), Some(MODEL_ID));
    assert!(
        root.parent_span_id.is_empty(),
        "the request span is the root"
    );
    assert_eq!(root.trace_id.len(), 16);
    // Nothing but this request was traced, so every span belongs to its trace.
    let other: Vec<&Span> = spans
        .iter()
        .filter(|s| s.trace_id != root.trace_id)
        .collect();
    assert!(
        other.is_empty(),
        "spans outside the request's trace: {other:#?}"
    );

    let names = |service: &str| -> BTreeSet<&str> {
        spans
            .iter()
            .filter(|s| s.service == service)
            .map(|s| s.name.as_str())
            .collect()
    };
    for (service, want) in [
        (
            "tessera-gateway",
            &["request", "validation", "admission", "stream"][..],
        ),
        ("tessera-prefill", &["prefill", "transfer"][..]),
        ("tessera-decode", &["queue", "decode"][..]),
    ] {
        let got = names(service);
        for w in want {
            assert!(
                got.contains(w),
                "no `{w}` span from {service} (got {got:?}); all: {spans:#?}"
            );
        }
    }
    // The nodes' spans hang off the gateway's request span: the parent travelled
    // with the request over the node links.
    for s in spans.iter().filter(|s| s.service != "tessera-gateway") {
        assert_eq!(
            s.parent_span_id, root.span_id,
            "{} span `{}` is not a child of the request span",
            s.service, s.name
        );
    }
}

/// The request lines of a JSON log: every stderr line whose `target` is
/// `tessera::request`, as JSON.
fn request_lines(log: &str) -> Vec<Value> {
    log.lines()
        .filter(|l| l.contains("tessera::request"))
        .map(|l| serde_json::from_str::<Value>(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .filter(|v| v["target"] == "tessera::request")
        .collect()
}

/// `tessera serve --log-format json` writes exactly one JSON line per finished
/// request (successes, streamed or not, and a request that failed validation after
/// authentication), carrying its request id and its usage, and never the prompt
/// (a canary in it), the output text or an API key (neither the tenant's key nor a
/// wrong one a client sent). A refusal before authentication writes no line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_log_format_json_writes_one_line_per_request_without_text_or_keys() {
    const CANARY: &str = "ZQX7CANARY41";
    const WRONG_KEY: &str = "tsk_WRONGKEYCANARY_5f3a9b2c7d1e4f60a8b9c0d1e2f3a4b5";
    let dir = tempfile::tempdir().unwrap();
    let model = model_path();
    let mut s = Serve::start(
        dir.path(),
        &[
            "--log-format",
            "json",
            "--model",
            model.to_str().unwrap(),
            "--kv-pool-tokens",
            "8192",
            "--prefill-kv-pool-tokens",
            "8192",
        ],
        &[],
    )
    .await;
    let prompt = format!("My code word is {CANARY}. Say hello to me in one short sentence.");
    let key = s.key.clone();

    let (status, plain_rid, body) = s
        .post(
            &key,
            &json!({"prompt": prompt, "max_tokens": 16, "temperature": 0}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let plain: Value = serde_json::from_str(&body).unwrap();
    let plain_text = plain["result"]["response"].as_str().unwrap().to_string();

    let (status, stream_rid, body) = s
        .post(
            &key,
            &json!({"prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": true}),
        )
        .await;
    assert_eq!(status, 200, "{body}");
    let mut stream_text = String::new();
    let mut stream_usage = Value::Null;
    for data in body.lines().filter_map(|l| l.strip_prefix("data: ")) {
        match parse_event(data) {
            Ev::Text(t) => stream_text.push_str(&t),
            Ev::Usage(u) => stream_usage = u,
            Ev::Error(e) => panic!("stream error {e}"),
            Ev::Done => {}
        }
    }
    assert!(!stream_usage.is_null(), "no usage in the stream: {body}");

    let (status, bad_rid, body) = s
        .post(&key, &json!({"prompt": prompt, "temperature": 9.0}))
        .await;
    assert_eq!(status, 400, "{body}");
    let (status, refused_rid, body) = s
        .post(WRONG_KEY, &json!({"prompt": prompt, "max_tokens": 4}))
        .await;
    assert_eq!(status, 401, "{body}");

    // Stop the server so the log is complete (no line can come later).
    terminate(&mut s.child, "tessera serve", dir.path()).await;
    let log = std::fs::read_to_string(dir.path().join("gateway.log")).unwrap();

    for (secret, what) in [
        (CANARY, "the prompt"),
        (key.as_str(), "the tenant's API key"),
        (WRONG_KEY, "the key the client sent"),
        (plain_text.trim(), "the output text"),
        (stream_text.trim(), "the streamed output text"),
    ] {
        assert!(
            secret.len() >= 8,
            "{what} is too short to search for: {secret:?}"
        );
        assert!(!log.contains(secret), "the log contains {what}:\n{log}");
    }

    let lines = request_lines(&log);
    let rids: Vec<&str> = lines
        .iter()
        .map(|l| l["fields"]["request_id"].as_str().unwrap_or_default())
        .collect();
    assert_eq!(
        rids,
        [plain_rid.as_str(), stream_rid.as_str(), bad_rid.as_str()],
        "one line per finished request, in order; none for the refusal {refused_rid}:\n{log}"
    );
    let usage_of = |v: &Value| -> (u64, u64) {
        (
            v["prompt_tokens"].as_u64().unwrap(),
            v["completion_tokens"].as_u64().unwrap(),
        )
    };
    for (line, status, usage) in [
        (&lines[0], 200, Some(usage_of(&plain["result"]["usage"]))),
        (&lines[1], 200, Some(usage_of(&stream_usage))),
        (&lines[2], 400, None),
    ] {
        let f = &line["fields"];
        assert_eq!(line["level"], "INFO", "{line}");
        assert_eq!(f["status"], status, "{line}");
        assert_eq!(f["model"], MODEL_ID, "{line}");
        for field in [
            "tenant_id",
            "key_id",
            "endpoint",
            "finish",
            "error_code",
            "cached_tokens",
            "ttft_us",
            "duration_us",
        ] {
            assert!(!f[field].is_null(), "no `{field}` in {line}");
        }
        match usage {
            Some((input, output)) => {
                assert!(input > 0 && output > 0, "{line}");
                assert_eq!(
                    (f["input_tokens"].as_u64(), f["output_tokens"].as_u64()),
                    (Some(input), Some(output)),
                    "{line}"
                );
            }
            None => assert_eq!(
                (f["input_tokens"].as_u64(), f["output_tokens"].as_u64()),
                (Some(0), Some(0)),
                "{line}"
            ),
        }
        // The text fields exist only with the debug flag.
        assert!(f["prompt"].is_null() && f["output"].is_null(), "{line}");
    }
}

/// One scrape of a node's `/metrics`: `name{labels}` -> value, and the raw text.
async fn scrape(url: &str) -> (HashMap<String, f64>, String) {
    let resp = reqwest::Client::new()
        .get(url)
        .timeout(REQUEST)
        .send()
        .await
        .unwrap_or_else(|e| panic!("scraping {url}: {e}"));
    assert_eq!(resp.status(), 200, "{url}");
    let ctype = resp.headers()[CONTENT_TYPE.as_str()]
        .to_str()
        .unwrap()
        .to_string();
    assert!(ctype.starts_with("application/openmetrics-text"), "{ctype}");
    let text = resp.text().await.unwrap();
    assert!(text.ends_with("# EOF\n"), "{text}");
    let values = text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (k, v) = l.rsplit_once(' ').unwrap();
            (k.to_string(), v.parse::<f64>().unwrap())
        })
        .collect();
    (values, text)
}

/// A node's `--metrics-listen` URL, from its stdout lines.
fn metrics_url(lines: &[String]) -> String {
    lines
        .iter()
        .find_map(|l| l.strip_prefix("tessera node: metrics on "))
        .unwrap_or_else(|| panic!("no metrics line in {lines:?}"))
        .trim()
        .to_string()
}

/// A node's series and their names.
struct NodeSeries {
    url: String,
    node: String,
    role: &'static str,
}

impl NodeSeries {
    fn key(&self, name: &str, extra: &str) -> String {
        let extra = if extra.is_empty() {
            String::new()
        } else {
            format!(",{extra}")
        };
        format!(
            r#"{name}{{node="{}",role="{}"{extra}}}"#,
            self.node, self.role
        )
    }

    /// The node's `tessera_kv_pages` by state (every state must be exported).
    fn pages(&self, m: &HashMap<String, f64>) -> HashMap<&'static str, f64> {
        ["free", "reserved", "in_use", "cached", "quarantined"]
            .into_iter()
            .map(|state| {
                let k = self.key("tessera_kv_pages", &format!(r#"state="{state}""#));
                let v = *m.get(&k).unwrap_or_else(|| panic!("{k} is not exported"));
                (state, v)
            })
            .collect()
    }

    /// Scrapes until `ok` holds for the page states (panics with them at the deadline).
    async fn wait_pages(
        &self,
        what: &str,
        dir: &Path,
        ok: impl Fn(&HashMap<&'static str, f64>) -> bool,
    ) -> HashMap<&'static str, f64> {
        let deadline = Instant::now() + REQUEST;
        loop {
            let pages = self.pages(&scrape(&self.url).await.0);
            if ok(&pages) {
                return pages;
            }
            assert!(
                Instant::now() < deadline,
                "{}: {what} never held: {pages:?}\n{}",
                self.node,
                logs(dir)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// The whole pool, in pages (both pools hold one context window of 16-token pages).
const POOL_PAGES: f64 = (CONTEXT / 16) as f64;

/// Real `tessera node` processes serve their own metrics on `--metrics-listen`: KV
/// pages by state (the five states sum to the pool), queue depth, and the integrity
/// and transfer families, each labelled with the node's address and role; a request
/// moves the prefill node's transfer counters. When the gateway dies (SIGKILL) while
/// a decode reservation waits for a prefill node that is stopped (SIGSTOP), the
/// reservation's pages are counted as `quarantined`, no longer as `reserved`, until
/// the prefill node's link closes and they are free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_metrics_endpoint_exports_node_families_and_quarantined_pages() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = (free_port(), free_port());
    // Liveness long enough that the stopped prefill node's links stay up: only its
    // death (SIGKILL) ends the quarantine.
    let config = write_config_with(
        dir.path(),
        free_port(),
        p,
        &[d],
        (CONTEXT, CONTEXT),
        Some("heartbeat_ms = 1000\ndead_after_ms = 600000\nmax_dead_after_ms = 600000\n"),
    );
    let metrics = ["--metrics-listen", "127.0.0.1:0"];
    let (_decode, lines) = node(dir.path(), &config, "decode", d, &metrics, &[]).await;
    let dec = NodeSeries {
        url: metrics_url(&lines),
        node: format!("127.0.0.1:{d}"),
        role: "decode",
    };
    let (mut prefill, lines) = node(dir.path(), &config, "prefill", p, &metrics, &[]).await;
    let pre = NodeSeries {
        url: metrics_url(&lines),
        node: format!("127.0.0.1:{p}"),
        role: "prefill",
    };

    // Before any request: every family with this node's labels, the pool all free.
    for n in [&dec, &pre] {
        let (m, text) = scrape(&n.url).await;
        let pages = n.pages(&m);
        assert_eq!(pages["free"], POOL_PAGES, "{}: {pages:?}", n.node);
        assert_eq!(pages.values().sum::<f64>(), POOL_PAGES, "{pages:?}");
        let mut want = vec![
            n.key("tessera_queue_depth", ""),
            n.key("tessera_node_frames_rejected_total", ""),
            n.key("tessera_node_peers_refused_total", ""),
            n.key("tessera_kv_tag_mismatches_total", r#"reader="attention""#),
            n.key(
                "tessera_kv_tag_mismatches_total",
                r#"reader="transfer_source""#,
            ),
        ];
        if n.role == "decode" {
            want.extend([
                n.key(
                    "tessera_kv_tag_mismatches_total",
                    r#"reader="transfer_sink""#,
                ),
                n.key(
                    "tessera_kv_commits_rejected_total",
                    r#"reason="tag_mismatch""#,
                ),
                n.key(
                    "tessera_kv_commits_rejected_total",
                    r#"reason="checksum_mismatch""#,
                ),
                n.key("tessera_kv_late_writes_dropped_total", ""),
            ]);
            for reason in [
                "not_routed",
                "wrong_sender",
                "refused_write",
                "malformed_page",
            ] {
                let reason = format!(r#"reason="{reason}""#);
                want.push(n.key("tessera_node_link_violations_total", &reason));
            }
        } else {
            want.extend([
                n.key("tessera_kv_transfer_bytes_total", ""),
                n.key("tessera_kv_transfer_seconds_count", ""),
            ]);
        }
        for k in want {
            assert_eq!(m.get(&k), Some(&0.0), "{k} not exported at 0:\n{text}");
        }
    }

    let config_arg = config.to_str().unwrap().to_string();
    let mut gw = Serve::start(dir.path(), &["--config", &config_arg], &[]).await;
    let (status, _, body) = gw.post(&gw.key.clone(), &greedy(8)).await;
    assert_eq!(status, 200, "{body}\n{}", logs(dir.path()));
    let m = scrape(&pre.url).await.0;
    assert_eq!(m[&pre.key("tessera_kv_transfer_seconds_count", "")], 1.0);
    assert!(m[&pre.key("tessera_kv_transfer_bytes_total", "")] > 0.0);
    dec.wait_pages("all pages free after the request", dir.path(), |p| {
        p["free"] == POOL_PAGES
    })
    .await;

    // A reservation that waits for a prefill node that does not run.
    let pid = prefill.id().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-STOP", &pid])
        .status()
        .unwrap()
        .success());
    let (url, key) = (gw.url(), gw.key.clone());
    let _waiting = tokio::spawn(async move {
        reqwest::Client::new()
            .post(url)
            .bearer_auth(key)
            .json(&greedy(200))
            .send()
            .await
    });
    let held = dec
        .wait_pages("a reservation", dir.path(), |p| p["reserved"] > 0.0)
        .await;
    assert_eq!(
        held["quarantined"], 0.0,
        "a live reservation is not quarantined: {held:?}"
    );
    let reserved = held["reserved"];

    // Its coordinator dies: the pages are quarantined (a write may still come).
    gw.child.start_kill().unwrap();
    gw.child.wait().await.unwrap();
    let q = dec
        .wait_pages("quarantine", dir.path(), |p| p["quarantined"] > 0.0)
        .await;
    assert_eq!(
        (q["quarantined"], q["reserved"]),
        (reserved, 0.0),
        "the reservation's pages move from reserved to quarantined: {q:?}"
    );
    assert_eq!(q.values().sum::<f64>(), POOL_PAGES, "{q:?}");

    // Its writer is gone for good: the pages are free again.
    prefill.start_kill().unwrap();
    prefill.wait().await.unwrap();
    dec.wait_pages("all pages free after the writer died", dir.path(), |p| {
        p["free"] == POOL_PAGES && p["quarantined"] == 0.0
    })
    .await;
}
