//! Single-stream time to first token (TTFT) of `tessera serve`, phase by phase
//! (issue 13 item 3).
//!
//! Starts `tessera serve` (the all-in-one, disaggregated default: gateway, one
//! prefill and one decode engine joined by the in-process KV transfer) with a fresh
//! store in a temporary directory, on a loopback port, exporting its OpenTelemetry
//! spans to an OTLP/HTTP receiver inside this process (`tests/common/otlp.rs`). Then
//! sends `--warmup` and `--requests` streaming chat completions one at a time (about
//! 49 prompt tokens after the chat template, each request's own question number
//! first, so only the template's 16-token system prefix comes from the prefix cache;
//! `--same-prompt`: 44 tokens, 32 cached; greedy, `--max-tokens`), takes
//! each one's client TTFT (request sent -> first SSE chunk with non-empty content),
//! stops the server with SIGTERM (which flushes the last spans), joins every measured
//! request to its trace by `x-request-id` and cuts its TTFT into consecutive
//! segments of one timeline. The segments add up to the client TTFT exactly
//! (span times and client times are both unix wall-clock times on this machine):
//!
//! | segment | from -> to | what runs there |
//! |---|---|---|
//! | `client->gateway` | request sent -> `request` span start | connect/reuse, HTTP parse, routing (gap) |
//! | `validation` | sum of the two `validation` spans | body parse, model lookup; chat template, tokenizer, I1 |
//! | `admission` | sum of the three `admission` spans | limits, model access, token reservation |
//! | `gateway other` | rest of `request` start -> `queue` start | auth, body read, daily usage, submit, coordinator hop (gap) |
//! | `queue` | decode `queue` span | decode node: I1 re-check, reserve pages (Prealloc -> Descriptor); not a wait to decode |
//! | `queue->prefill` | `queue` end -> `prefill` start | Descriptor to coordinator, Prefill to the prefill node (gap) |
//! | `prefill` | prefill node `prefill` span | admission, engine queue, prompt forward pass, first token sampled, pages exported |
//! | `prefill->transfer` | `prefill` end -> `transfer` start | (gap; the span is replaced, ~0) |
//! | `transfer` | prefill node `transfer` span | page puts, drain, commit sent |
//! | `transfer->decode` | `transfer` end -> `decode` start | commit delivery, I4 checks, re-admission (gap) |
//! | `decode->client` | `decode` start -> first chunk at the client | the first token (sampled by prefill, sent at adoption, before any decode step) through the driver, SSE, socket (gap) |
//!
//! A segment is negative if the spans overlap there. `stream` (the driver, from
//! submit to the end of the response) spans the whole tail and is not a segment.
//! With `--serve-arg=--colocated` the node spans are absent and their rows stay empty.
//!
//! Run on an idle machine, after `cargo build --release` (the server is `--bin`) and
//! `tessera model fetch`:
//!
//! ```sh
//! cargo run --release --example ttft_phases -- [--requests 20] [--max-tokens 8] \
//!     [--same-prompt] [--no-trace] [--serve-arg=ARG ...]
//! ```
//!
//! Prints a table (p50, p90 and mean per segment in ms, its share of the mean TTFT)
//! and the same numbers as JSON lines (`"metric": "ttft_phase"` / `"ttft_client"`),
//! like `tessera bench`. Tracing is on while it measures (that is how the phases are
//! seen); `--no-trace` measures the client TTFT alone, without it.

#[path = "../tests/common/otlp.rs"]
mod otlp;

use clap::Parser;
use otlp::{Otlp, Span};
use serde_json::json;
use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::Command;

const MODEL_ID: &str = "@cf/huggingfacetb/smollm2-135m-instruct";
/// The user message (after `Question N. ` unless `--same-prompt`).
const PROMPT: &str = "In two sentences, explain why the sky looks blue during the day.";
#[rustfmt::skip]
const SEGMENTS: [&str; 11] = ["client->gateway", "validation", "admission", "gateway other",
    "queue", "queue->prefill", "prefill", "prefill->transfer", "transfer", "transfer->decode",
    "decode->client"];

#[derive(Parser)]
struct Args {
    /// The `tessera` binary to serve with.
    #[arg(long, default_value = "target/release/tessera")]
    bin: PathBuf,
    /// Measured requests (sent one at a time).
    #[arg(long, default_value_t = 20)]
    requests: usize,
    /// Unmeasured requests first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    #[arg(long, default_value_t = 8)]
    max_tokens: usize,
    /// Idle time between requests (ms), so each one meets an idle server.
    #[arg(long, default_value_t = 100)]
    pause_ms: u64,
    /// `OTEL_BSP_SCHEDULE_DELAY` of the server (ms).
    #[arg(long, default_value_t = 500)]
    otel_delay_ms: u64,
    /// Do not export spans (only the client TTFT is measured): the cost of tracing.
    #[arg(long)]
    no_trace: bool,
    /// The same prompt every time: all but its last partial KV page (16 tokens) come
    /// from the prefix cache (by default only the template's system prefix does).
    #[arg(long)]
    same_prompt: bool,
    /// Extra `tessera serve` arguments (repeatable), e.g. `--serve-arg=--colocated`.
    #[arg(long, allow_hyphen_values = true)]
    serve_arg: Vec<String>,
}

fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64
}

/// One measured request: its id, when it was sent and when its first content came
/// (unix ns), its prompt tokens and how many of them the prefix cache served.
struct Sample {
    rid: String,
    sent: u64,
    first: u64,
    prompt: f64,
    cached: f64,
}

/// Sends one streaming chat completion; returns its sample once the stream ended.
async fn one(client: &reqwest::Client, base: &str, key: &str, text: &str, max: usize) -> Sample {
    let body = json!({
        "model": MODEL_ID, "messages": [{"role": "user", "content": text}],
        "max_tokens": max, "temperature": 0, "stream": true,
        "stream_options": {"include_usage": true},
    });
    let sent = now_ns();
    let mut resp = client
        .post(format!("{base}/v1/chat/completions"))
        .bearer_auth(key)
        .json(&body)
        .send()
        .await
        .expect("request");
    assert!(resp.status().is_success(), "status {}", resp.status());
    let rid = resp.headers()["x-request-id"].to_str().unwrap().to_string();
    let (mut buf, mut first, mut usage) = (String::new(), None, json!(null));
    while let Some(bytes) = resp.chunk().await.expect("stream") {
        let at = now_ns();
        buf.push_str(&String::from_utf8_lossy(&bytes));
        while let Some(i) = buf.find("\n\n") {
            let frame: String = buf.drain(..i + 2).collect();
            for data in frame.lines().filter_map(|l| l.strip_prefix("data: ")) {
                let Ok(mut ev) = serde_json::from_str::<serde_json::Value>(data) else {
                    continue; // [DONE]
                };
                let content = &ev["choices"][0]["delta"]["content"];
                if content.as_str().is_some_and(|c| !c.is_empty()) {
                    first.get_or_insert(at);
                }
                if ev["usage"].is_object() {
                    usage = ev["usage"].take();
                }
            }
        }
    }
    let tokens = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    Sample {
        rid,
        sent,
        first: first.expect("no content chunk"),
        prompt: tokens(&usage["prompt_tokens"]),
        cached: tokens(&usage["prompt_tokens_details"]["cached_tokens"]),
    }
}

/// The TTFT segments (ms, in [`SEGMENTS`] order; `None` where a span is missing) of
/// `s`, whose trace is `trace`.
fn segments(s: &Sample, trace: &[&Span]) -> Vec<Option<f64>> {
    let named = |name: &'static str| trace.iter().filter(move |x| x.name == name);
    let first = |name: &'static str| named(name).min_by_key(|x| x.start_unix_nano);
    let total = |name: &'static str| -> u64 {
        named(name)
            .map(|x| x.end_unix_nano - x.start_unix_nano)
            .sum()
    };
    let ms = |a: u64, b: u64| (b as f64 - a as f64) / 1e6;
    let start = |n: &'static str| first(n).map(|x| x.start_unix_nano);
    let end = |n: &'static str| first(n).map(|x| x.end_unix_nano);
    let req = start("request").expect("request span");
    let (val, adm) = (total("validation"), total("admission"));
    let gap = |a: Option<u64>, b: Option<u64>| Some(ms(a?, b?));
    vec![
        Some(ms(s.sent, req)),
        Some(val as f64 / 1e6),
        Some(adm as f64 / 1e6),
        start("queue").map(|q| ms(req + val + adm, q)),
        gap(start("queue"), end("queue")),
        gap(end("queue"), start("prefill")),
        gap(start("prefill"), end("prefill")),
        gap(end("prefill"), start("transfer")),
        gap(start("transfer"), end("transfer")),
        gap(end("transfer"), start("decode")),
        gap(start("decode"), Some(s.first)),
    ]
}

/// Nearest-rank percentile `p` (0-100) of `v` (sorted in place).
fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((p / 100.0 * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let a = Args::parse();
    let otlp = Otlp::start().await;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("serve.log");
    let data = dir.path().join("data");
    let mut cmd = Command::new(&a.bin);
    cmd.args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(&data)
        .args(&a.serve_arg);
    for (k, _) in std::env::vars() {
        if k.starts_with("OTEL_") || k.starts_with("TESSERA_") || k == "RUST_LOG" {
            cmd.env_remove(k);
        }
    }
    if !a.no_trace {
        cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.endpoint())
            .env("OTEL_BSP_SCHEDULE_DELAY", a.otel_delay_ms.to_string());
    }
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", a.bin.display()));
    // The first-start banner: account id, API key, then the address.
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut key, mut base) = (None, None);
    let banner = async {
        while let Ok(Some(l)) = lines.next_line().await {
            let l = l.trim();
            if let Some(k) = l.strip_prefix("API key:") {
                key = Some(k.trim().to_string());
            } else if let Some(b) = l.strip_prefix("tessera: listening on ") {
                base = Some(b.trim().to_string());
                break;
            }
        }
    };
    let started = tokio::time::timeout(Duration::from_secs(120), banner).await;
    let (Ok(()), Some(key), Some(base)) = (started, key, base) else {
        panic!(
            "serve did not start:\n{}",
            std::fs::read_to_string(&log).unwrap()
        );
    };
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });

    let client = reqwest::Client::new();
    let mut samples = Vec::new();
    for i in 0..a.warmup + a.requests {
        let text = match a.same_prompt {
            true => PROMPT.to_string(),
            false => format!("Question {i}. {PROMPT}"),
        };
        let s = one(&client, &base, &key, &text, a.max_tokens).await;
        if i >= a.warmup {
            samples.push(s);
        }
        tokio::time::sleep(Duration::from_millis(a.pause_ms)).await;
    }

    // A graceful stop flushes the spans not exported yet.
    let pid = child.id().expect("running").to_string();
    let term = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status();
    assert!(term.is_ok_and(|s| s.success()), "kill -TERM {pid}");
    let status = tokio::time::timeout(Duration::from_secs(60), child.wait()).await;
    assert!(
        matches!(status, Ok(Ok(s)) if s.success()),
        "serve did not stop cleanly: {status:?}\n{}",
        std::fs::read_to_string(&log).unwrap()
    );
    assert!(otlp.bad().is_empty(), "bad exports: {:?}", otlp.bad());

    let spans = otlp.spans();
    let mut traces: HashMap<&[u8], Vec<&Span>> = HashMap::new();
    for s in &spans {
        traces.entry(s.trace_id.as_slice()).or_default().push(s);
    }
    let mut cols: Vec<Vec<f64>> = vec![Vec::new(); SEGMENTS.len()];
    let mut traced = 0;
    for s in &samples {
        let rid = Some(&s.rid);
        let root = spans
            .iter()
            .find(|x| x.name == "request" && x.attrs.get("request_id") == rid);
        if let Some(root) = root {
            let seg = segments(s, &traces[root.trace_id.as_slice()]);
            cols.iter_mut().zip(seg).for_each(|(c, v)| c.extend(v));
            traced += 1;
        }
    }

    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let column = |f: fn(&Sample) -> f64| samples.iter().map(f).collect::<Vec<f64>>();
    let mut ttft = column(|s| (s.first - s.sent) as f64 / 1e6);
    let ttft_mean = mean(&ttft);
    let prompt = pct(&mut column(|s| s.prompt), 50.0);
    let cached = pct(&mut column(|s| s.cached), 50.0);
    // Every JSON line: `system`, its own fields, then the run's.
    let run = json!({"n": samples.len(), "traced": traced, "prompt_tokens": prompt,
        "cached_tokens": cached, "max_tokens": a.max_tokens, "same_prompt": a.same_prompt});
    let line = |o: serde_json::Value| {
        let mut l = json!({"system": "tessera"});
        let m = l.as_object_mut().unwrap();
        m.extend(o.as_object().unwrap().clone());
        m.extend(run.as_object().unwrap().clone());
        l
    };
    println!(
        "single-stream TTFT by phase: {} requests ({traced} traced), prompt {prompt} tokens \
         ({cached} from the prefix cache; p50), max_tokens {}",
        samples.len(),
        a.max_tokens
    );
    println!(
        "{:<20} {:>9} {:>9} {:>9} {:>7}",
        "segment", "p50 ms", "p90 ms", "mean ms", "share"
    );
    let (mut top, mut jsons) = (("-", f64::MIN), Vec::new());
    for (name, c) in SEGMENTS.iter().zip(&mut cols) {
        if c.is_empty() {
            println!("{name:<20} {:>9}", "-");
            continue;
        }
        let (p50, p90, m) = (pct(c, 50.0), pct(c, 90.0), mean(c));
        let share = m / ttft_mean;
        if m > top.1 {
            top = (name, m);
        }
        println!(
            "{name:<20} {p50:>9.3} {p90:>9.3} {m:>9.3} {:>6.1}%",
            share * 100.0
        );
        jsons.push(line(
            json!({"metric": "ttft_phase", "phase": name, "p50_ms": p50,
            "p90_ms": p90, "mean_ms": m, "share": share}),
        ));
    }
    let (p50, p90) = (pct(&mut ttft, 50.0), pct(&mut ttft, 90.0));
    println!(
        "{:<20} {p50:>9.3} {p90:>9.3} {ttft_mean:>9.3}",
        "client TTFT"
    );
    if traced > 0 {
        let share = top.1 / ttft_mean * 100.0;
        println!("dominant: {} ({share:.0}% of the mean TTFT)", top.0);
    }
    jsons.push(line(
        json!({"metric": "ttft_client", "p50_ms": p50, "p90_ms": p90,
        "mean_ms": ttft_mean, "dominant": top.0}),
    ));
    for o in jsons {
        println!("{o}");
    }
}
