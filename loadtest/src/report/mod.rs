//! The report: [`Report`] (serialized as `report.json`, stable snake_case field
//! names, `schema_version` bumped on any incompatible change), a self-contained
//! `report.html` with inline SVG plots, `requests.jsonl` (one [`Outcome`] per
//! line) and the text summary printed at the end of a run.
//!
//! This module holds the JSON model and writes the files; [`html()`] renders the
//! page and [`summary()`] the text.

use crate::checks::{CanaryReport, EqualityReport, OverlongReport, UsageReport};
use crate::client::{End, Outcome};
use crate::error::LoadtestError;
use crate::fairness::{FairnessReport, PrefixCacheReport};
use crate::fault::{FaultReport, NodeLoss};
use crate::metrics::{Bucket, Latency, Throughput};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::Path;

mod html;
mod summary;

pub use html::html;
pub use summary::summary;

/// Version of the JSON layout.
pub const SCHEMA_VERSION: u32 = 1;

/// The whole run.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Report {
    /// Layout version ([`SCHEMA_VERSION`]).
    pub schema_version: u32,
    /// When the run started (Unix seconds).
    pub created_unix_s: u64,
    /// The workload, as configured.
    pub workload: WorkloadInfo,
    /// The main target first, then the `--compare` target if any.
    pub targets: Vec<TargetReport>,
    /// Side-by-side figures when there are two targets.
    pub comparison: Option<Comparison>,
    /// Every check of the main target passed and no phase failed.
    pub passed: bool,
    /// Why not, one line each.
    pub failures: Vec<String>,
}

/// The workload parameters.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WorkloadInfo {
    /// Seed.
    pub seed: u64,
    /// Tenants.
    pub tenants: usize,
    /// Distinct prompts per tenant (plus one over-long each).
    pub prompts_per_tenant: usize,
    /// `--shared-prefix-tokens`: words of the prefix every prompt of a tenant
    /// starts with (per tenant different); `None`: no shared prefix.
    #[serde(default)]
    pub shared_prefix_tokens: Option<usize>,
    /// `closed_loop` or `open_loop`.
    pub arrival: String,
    /// Closed loop: clients.
    pub concurrency: Option<usize>,
    /// Open loop: requests per second.
    pub rate_per_s: Option<f64>,
    /// Run length in requests.
    pub requests: Option<usize>,
    /// Run length in seconds.
    pub duration_s: Option<f64>,
    /// Prompt length distribution (words).
    pub prompt_len: String,
    /// Output length distribution (`max_tokens`).
    pub output_len: String,
    /// Prompts file, if any.
    pub prompts_file: Option<String>,
    /// `chat` or `raw`.
    pub mode: String,
    /// Share streamed.
    pub stream_share: f64,
    /// Share over-long.
    pub overlong_share: f64,
    /// Share disconnected.
    pub disconnect_share: f64,
    /// Context window used to size over-long prompts (tokens).
    pub context_window: usize,
}

/// Counts of requests by how they ended.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct RequestCounts {
    /// Requests sent in the load phase.
    pub sent: usize,
    /// Complete answers.
    pub completed: usize,
    /// Deliberate client disconnects.
    pub disconnected: usize,
    /// Non-2xx answers.
    pub http_errors: usize,
    /// Error events after a 200.
    pub stream_errors: usize,
    /// Streams cut before their end.
    pub cut: usize,
    /// No HTTP status.
    pub transport_errors: usize,
    /// Over-long requests (any outcome).
    pub over_long: usize,
}

impl RequestCounts {
    /// Counts `outs`; `over_long(o)` tells the over-long ones.
    pub fn of(outs: &[Outcome], over_long: impl Fn(&Outcome) -> bool) -> Self {
        let mut c = Self {
            sent: outs.len(),
            ..Self::default()
        };
        for o in outs {
            match o.end {
                End::Complete => c.completed += 1,
                End::Disconnected => c.disconnected += 1,
                End::HttpError => c.http_errors += 1,
                End::StreamError => c.stream_errors += 1,
                End::Cut => c.cut += 1,
                End::Transport => c.transport_errors += 1,
            }
            if over_long(o) {
                c.over_long += 1;
            }
        }
        c
    }
}

/// The solo phase (each distinct prompt alone, greedy).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct SoloReport {
    /// Prompts run.
    pub prompts: usize,
    /// Prompts without a complete answer (each makes the run fail).
    pub failed: usize,
    /// Wall time (s).
    pub duration_s: f64,
}

/// The isolation checks of one target (`None`: not run).
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Checks {
    /// Foreign canaries.
    pub canary: Option<CanaryReport>,
    /// Solo-equality.
    pub solo_equality: Option<EqualityReport>,
    /// Over-long prompts.
    pub over_long: Option<OverlongReport>,
    /// Usage against the usage API.
    pub usage: Option<UsageReport>,
    /// Responses with another tenant's canary.
    pub leaks: usize,
    /// Responses that differ from their solo answer.
    pub mismatches: usize,
    /// Over-long requests not answered with a 4xx.
    pub over_long_not_rejected: usize,
    /// Tenants whose usage does not match.
    pub usage_mismatches: usize,
}

/// Everything about one target.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TargetReport {
    /// Label.
    pub label: String,
    /// Base URL (a fleet: every gateway's, joined with `,`).
    pub base_url: String,
    /// `workers_ai` or `openai`.
    pub api: String,
    /// Model id (several: joined with `,`).
    pub model: String,
    /// Completed load-phase requests per model id.
    pub completed_by_model: BTreeMap<String, usize>,
    /// Solo phase (when solo-equality runs).
    pub solo: Option<SoloReport>,
    /// Request counts of the load phase.
    pub requests: RequestCounts,
    /// Latency of the load phase.
    pub latency: Latency,
    /// Throughput of the load phase.
    pub throughput: Throughput,
    /// Failed requests by label.
    pub errors_by_code: BTreeMap<String, usize>,
    /// Width of a timeline bucket (s).
    pub timeline_bucket_s: f64,
    /// The load phase over time.
    pub timeline: Vec<Bucket>,
    /// Isolation checks.
    pub checks: Checks,
    /// Fault mix, if one ran.
    pub fault: Option<FaultReport>,
    /// What node failures cost the clients (issue 36): failed requests by how
    /// they ended, the gateways' restart decisions, the longest pause inside
    /// each stream, with and without a fault.
    #[serde(default)]
    pub node_loss: NodeLoss,
    /// Per-tenant service, demand and TTFT of the load phase, and Jain's
    /// fairness index ([`crate::fairness`]).
    #[serde(default)]
    pub fairness: FairnessReport,
    /// Prompt tokens served from the server's prefix cache per tenant in the
    /// load phase, as the answers' usage reported them.
    #[serde(default)]
    pub prefix_cache: PrefixCacheReport,
}

/// One compared figure.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CompareRow {
    /// Metric name (`output_tokens_per_s`, `ttft_p50_ms`, ...).
    pub metric: String,
    /// Main target's value.
    pub main: f64,
    /// Baseline's value.
    pub baseline: f64,
    /// `main / baseline` (`None` when the baseline is 0).
    pub ratio: Option<f64>,
    /// `higher` or `lower`: which direction is better.
    pub better: String,
}

/// Main target vs baseline.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Comparison {
    /// Main target's label.
    pub main: String,
    /// Baseline's label.
    pub baseline: String,
    /// Figures.
    pub rows: Vec<CompareRow>,
}

impl Comparison {
    /// Compares throughput and latency of two targets.
    pub fn of(a: &TargetReport, b: &TargetReport) -> Self {
        let row = |m: &str, x: f64, y: f64, better: &str| CompareRow {
            metric: m.into(),
            main: x,
            baseline: y,
            ratio: (y != 0.0).then(|| x / y),
            better: better.into(),
        };
        let (la, lb) = (&a.latency, &b.latency);
        Self {
            main: a.label.clone(),
            baseline: b.label.clone(),
            rows: vec![
                row(
                    "output_tokens_per_s",
                    a.throughput.output_tokens_per_s,
                    b.throughput.output_tokens_per_s,
                    "higher",
                ),
                row(
                    "requests_per_s",
                    a.throughput.requests_per_s,
                    b.throughput.requests_per_s,
                    "higher",
                ),
                row("ttft_p50_ms", la.ttft_ms.p50, lb.ttft_ms.p50, "lower"),
                row("ttft_p99_ms", la.ttft_ms.p99, lb.ttft_ms.p99, "lower"),
                row("tpot_p50_ms", la.tpot_ms.p50, lb.tpot_ms.p50, "lower"),
                row("itl_p50_ms", la.itl_ms.p50, lb.itl_ms.p50, "lower"),
                row("e2e_p50_ms", la.e2e_ms.p50, lb.e2e_ms.p50, "lower"),
                row("e2e_p99_ms", la.e2e_ms.p99, lb.e2e_ms.p99, "lower"),
            ],
        }
    }
}

// Number formats shared by the HTML page and the text summary.

fn opt3(x: Option<f64>) -> String {
    x.map(|x| format!("{x:.3}")).unwrap_or_else(|| "-".into())
}

fn pct(x: Option<f64>) -> String {
    x.map(|x| format!("{:.1}%", x * 100.0))
        .unwrap_or_else(|| "-".into())
}

/// Writes `report.json`, `report.html` and `requests.jsonl` (every outcome of
/// every phase, tagged with its target and phase) into `dir` (created).
///
/// # Errors
/// The folder or a file cannot be written.
pub fn write(
    dir: &Path,
    report: &Report,
    phases: &[(&str, &str, &[Outcome])],
    load: &[&[Outcome]],
) -> Result<(), LoadtestError> {
    std::fs::create_dir_all(dir).map_err(|source| LoadtestError::CreateDir {
        path: dir.into(),
        source,
    })?;
    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).map_err(|source| LoadtestError::WriteFile { path, source })
    };
    let json = serde_json::to_string_pretty(report)?;
    write("report.json", json + "\n")?;
    write("report.html", html(report, load))?;
    let mut lines = String::new();
    for (target, phase, outs) in phases {
        for o in outs.iter() {
            let mut v = serde_json::to_value(o)?;
            v["target"] = serde_json::json!(target);
            v["phase"] = serde_json::json!(phase);
            lines.push_str(&v.to_string());
            lines.push('\n');
        }
    }
    write("requests.jsonl", lines)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_args;
    use crate::fairness::{fairness, prefix_cache};
    use crate::workload::Workload;

    /// A report of one target with two tenants' answers, as the runner builds it.
    fn report() -> (Report, Vec<Outcome>) {
        let a = parse_args(["x", "--prompts-per-tenant", "1", "--output-len", "8"]);
        let w = Workload::new(&a, 2, 64).unwrap();
        let outs: Vec<Outcome> = (0..4)
            .map(|i| Outcome {
                end: End::Complete,
                status: Some(200),
                prompt_tokens: Some(100),
                completion_tokens: Some(8),
                cached_tokens: Some(if i < 2 { 0 } else { 96 }),
                text_events: 8,
                ttft_s: Some(0.05 * (i + 1) as f64),
                e2e_s: 0.5,
                event_times_s: vec![0.05 * (i + 1) as f64],
                ..Outcome::pending(i, i % 2, i % 2, true, 0.1 * i as f64)
            })
            .collect();
        let labels = vec!["t0".to_string(), "t1".to_string()];
        let t = TargetReport {
            label: "tessera".into(),
            base_url: "http://127.0.0.1:1".into(),
            api: "openai".into(),
            model: "m".into(),
            completed_by_model: BTreeMap::new(),
            solo: None,
            requests: RequestCounts::of(&outs, |_| false),
            latency: crate::metrics::latency(&outs),
            throughput: crate::metrics::throughput(&outs),
            errors_by_code: BTreeMap::new(),
            timeline_bucket_s: 0.5,
            timeline: crate::metrics::timeline(&outs, 1.0, 0.5),
            checks: Checks::default(),
            fault: None,
            node_loss: crate::fault::node_loss(&outs, |_| false, &[]),
            fairness: fairness(&w, &[], &outs, &labels),
            prefix_cache: prefix_cache(2, &outs, &labels, Some(64)),
        };
        let r = Report {
            schema_version: SCHEMA_VERSION,
            created_unix_s: 0,
            workload: WorkloadInfo {
                seed: 0,
                tenants: 2,
                prompts_per_tenant: 1,
                shared_prefix_tokens: Some(64),
                arrival: "closed_loop".into(),
                concurrency: Some(2),
                rate_per_s: None,
                requests: Some(4),
                duration_s: None,
                prompt_len: "fixed:8".into(),
                output_len: "fixed:8".into(),
                prompts_file: None,
                mode: "chat".into(),
                stream_share: 1.0,
                overlong_share: 0.0,
                disconnect_share: 0.0,
                context_window: 64,
            },
            targets: vec![t],
            comparison: None,
            passed: true,
            failures: vec![],
        };
        (r, outs)
    }

    /// The node-loss section: counts, restart deltas and gaps in the JSON, the
    /// HTML and the summary.
    #[test]
    fn node_loss_section_in_json_html_and_summary() {
        let (mut r, outs) = report();
        let t = &mut r.targets[0];
        t.node_loss.failed = 2;
        t.node_loss.truncated = 1;
        t.node_loss.unexcused = 1;
        t.node_loss.failed_with_error_event = 1;
        t.node_loss.restarts = Some(crate::fault::RestartCounts {
            restarted: 3,
            continued: 5,
            moved: 0,
            not_restarted: 1,
        });
        let v = serde_json::to_value(&r).unwrap();
        let n = &v["targets"][0]["node_loss"];
        assert_eq!(n["requests"], 4);
        assert_eq!(n["truncated"], 1);
        assert_eq!(n["restarts"]["continued"], 5);
        assert_eq!(n["max_gap_ms"]["count"], 0, "one event per stream: no gap");
        let h = html(&r, &[&outs]);
        assert!(h.contains("<h3>Node loss</h3>"));
        assert!(
            h.contains("retried (restarted) <b>3</b>, continued <b>5</b>, moved (drained, with their KV) <b>0</b>, not restarted <b>1</b>")
        );
        let s = summary(&r);
        assert!(
            s.contains("failed 2 of 4 (0.00%): 1 with an error event, 1 truncated, 0 transport"),
            "{s}"
        );
        assert!(
            s.contains("retried 3, continued 5, moved 0, not restarted 1"),
            "{s}"
        );
        r.targets[0].node_loss.restarts = None;
        r.targets[0].node_loss.restarts_unavailable = Some("no token".into());
        assert!(summary(&r).contains("restarts not read (no token)"));
    }

    #[test]
    fn fairness_and_prefix_sections_in_json_html_and_summary() {
        let (r, outs) = report();
        // JSON: stable names under each target and in the workload.
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["workload"]["shared_prefix_tokens"], 64);
        let t = &v["targets"][0];
        assert_eq!(t["fairness"]["jain_index"], 1.0);
        assert_eq!(t["fairness"]["jain_index_equal_split"], 1.0);
        assert_eq!(t["fairness"]["tenants"][1]["output_tokens"], 16);
        assert_eq!(t["fairness"]["tenants"][1]["service_share"], 0.5);
        assert_eq!(t["prefix_cache"]["cached_tokens"], 192);
        assert_eq!(t["prefix_cache"]["hit_rate"], 0.48);
        assert_eq!(t["prefix_cache"]["tenants"][0]["requests_with_hit"], 1);
        // A report written before these sections existed still reads.
        let mut old = v.clone();
        for k in ["fairness", "prefix_cache", "node_loss"] {
            old["targets"][0].as_object_mut().unwrap().remove(k);
        }
        old["workload"]
            .as_object_mut()
            .unwrap()
            .remove("shared_prefix_tokens");
        let back: Report = serde_json::from_value(old).unwrap();
        assert_eq!(back.targets[0].fairness, FairnessReport::default());
        assert_eq!(back.workload.shared_prefix_tokens, None);
        assert_eq!(back.targets[0].node_loss, NodeLoss::default());

        // HTML: the tables, both indices, and three bar charts beside the four plots.
        let h = html(&r, &[&outs]);
        assert!(h.contains("<h3>Fairness</h3>") && h.contains("<h3>Prefix cache</h3>"));
        assert!(h.contains("Jain's index <b>1.000</b>"));
        assert!(h.contains("<td>t1</td><td>2</td><td>2</td><td>200</td><td>96</td><td>16</td><td>16</td><td>50.0%</td><td>50.0%</td>"));
        assert!(h.contains("shared prefix of 64 words per tenant"));
        assert!(h.contains("<td>48.0%</td>"));
        assert_eq!(h.matches("<svg").count(), 4 + 3);
        assert!(h.contains("Share of service vs demand") && h.contains("cached vs computed"));
        assert!(!h.contains("plot failed"));
        // Summary lines.
        let s = summary(&r);
        assert!(s.contains("Jain's index 1.000 (equal split 1.000)"), "{s}");
        assert!(
            s.contains("prefix cache 192 of 400 prompt tokens cached (48.0%)"),
            "{s}"
        );
    }
}
