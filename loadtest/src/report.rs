//! The report: [`Report`] (serialized as `report.json`, stable snake_case field
//! names, `schema_version` bumped on any incompatible change), a self-contained
//! `report.html` with inline SVG plots, `requests.jsonl` (one [`Outcome`] per
//! line) and the text summary printed at the end of a run.

use crate::checks::{CanaryReport, EqualityReport, OverlongReport, UsageReport};
use crate::client::{End, Outcome};
use crate::fault::FaultReport;
use crate::metrics::{Bucket, Latency, Throughput};
use anyhow::{Context, Result};
use plotters::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

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
    /// Base URL.
    pub base_url: String,
    /// `workers_ai` or `openai`.
    pub api: String,
    /// Model id.
    pub model: String,
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

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A line chart as an SVG string: one series per `(name, points)`.
fn line_chart(
    title: &str,
    x_desc: &str,
    y_desc: &str,
    series: &[(String, Vec<(f64, f64)>)],
) -> String {
    let mut svg = String::new();
    let x_max = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.0))
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.05;
    let y_max = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|q| q.1))
        .fold(0.0f64, f64::max)
        .max(1e-3)
        * 1.1;
    let drawn = (|| -> Result<(), Box<dyn std::error::Error + '_>> {
        let root = SVGBackend::with_string(&mut svg, (640, 360)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..x_max, 0f64..y_max)?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .light_line_style(WHITE.mix(0.0))
            .draw()?;
        for (i, (name, pts)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE.mix(0.9))
            .border_style(BLACK)
            .draw()?;
        root.present()?;
        Ok(())
    })();
    match drawn {
        Ok(()) => svg,
        Err(e) => format!("<p>plot failed: {}</p>", esc(&e.to_string())),
    }
}

/// CDF points of samples (seconds) in milliseconds.
fn cdf(samples_s: impl Iterator<Item = f64>) -> Vec<(f64, f64)> {
    let mut v: Vec<f64> = samples_s.map(|s| s * 1e3).collect();
    v.sort_by(f64::total_cmp);
    let n = v.len() as f64;
    v.iter()
        .enumerate()
        .map(|(i, x)| (*x, (i + 1) as f64 / n))
        .collect()
}

fn dist_row(name: &str, d: &crate::metrics::Dist) -> String {
    format!(
        "<tr><td>{name}</td><td>{}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td></tr>",
        d.count, d.p50, d.p90, d.p99, d.max, d.mean
    )
}

fn check_cell(n: usize, ran: bool) -> String {
    if !ran {
        "<td>not run</td>".into()
    } else if n == 0 {
        "<td class=ok>0</td>".into()
    } else {
        format!("<td class=bad>{n}</td>")
    }
}

/// The self-contained HTML page (inline CSS and SVG, no scripts, nothing fetched).
pub fn html(report: &Report, outcomes: &[&[Outcome]]) -> String {
    let mut h = String::new();
    let verdict = if report.passed { "PASSED" } else { "FAILED" };
    let _ = write!(
        h,
        "<!doctype html><html><head><meta charset=utf-8><title>Tessera load test: {verdict}</title><style>\
body{{font-family:sans-serif;margin:2em;max-width:1400px}}table{{border-collapse:collapse;margin:1em 0}}\
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}th{{background:#f3f3f3}}td:first-child{{text-align:left}}\
.ok{{color:#070}}.bad{{color:#b00;font-weight:bold}}.plots{{display:flex;flex-wrap:wrap;gap:1em}}\
code{{background:#f3f3f3;padding:1px 3px}}</style></head><body>"
    );
    let _ = write!(
        h,
        "<h1>Tessera load test: <span class={}>{verdict}</span></h1>",
        if report.passed { "ok" } else { "bad" }
    );
    for f in &report.failures {
        let _ = write!(h, "<p class=bad>{}</p>", esc(f));
    }
    let w = &report.workload;
    let _ = write!(
        h,
        "<h2>Workload</h2><p>seed {}, {} tenants × {} prompts, {}, {} requests{}, prompt {} words, output {} tokens, mode {}, \
stream {:.0}%, over-long {:.0}%, disconnects {:.0}%, context window {} tokens</p>",
        w.seed,
        w.tenants,
        w.prompts_per_tenant,
        match (w.concurrency, w.rate_per_s) {
            (_, Some(r)) => format!("open loop at {r} req/s"),
            (Some(c), None) => format!("closed loop, {c} clients"),
            _ => "?".into(),
        },
        w.requests.map(|r| r.to_string()).unwrap_or_else(|| "∞".into()),
        w.duration_s.map(|d| format!(" for {d} s")).unwrap_or_default(),
        esc(&w.prompt_len),
        esc(&w.output_len),
        esc(&w.mode),
        w.stream_share * 100.0,
        w.overlong_share * 100.0,
        w.disconnect_share * 100.0,
        w.context_window
    );
    // Checks.
    h.push_str("<h2>Isolation checks</h2><table><tr><th>target</th><th>foreign canaries</th><th>solo mismatches</th><th>over-long not 4xx</th><th>usage mismatches</th><th>canaries echoed</th><th>compared with solo</th></tr>");
    for t in &report.targets {
        let c = &t.checks;
        let _ = write!(
            h,
            "<tr><td>{}</td>{}{}{}{}<td>{}</td><td>{}</td></tr>",
            esc(&t.label),
            check_cell(c.leaks, c.canary.is_some()),
            check_cell(c.mismatches, c.solo_equality.is_some()),
            check_cell(
                c.over_long_not_rejected,
                c.over_long.as_ref().is_some_and(|o| o.sent > 0)
            ),
            check_cell(c.usage_mismatches, c.usage.is_some()),
            c.canary
                .as_ref()
                .map(|c| format!("{} / {}", c.own_canary_echoed, c.responses_checked))
                .unwrap_or_default(),
            c.solo_equality
                .as_ref()
                .map(|e| e.compared.to_string())
                .unwrap_or_default(),
        );
    }
    h.push_str("</table>");
    // Latency and throughput.
    for t in &report.targets {
        let _ = write!(
            h,
            "<h2>{} <small><code>{}</code> ({}, {})</small></h2>",
            esc(&t.label),
            esc(&t.base_url),
            esc(&t.api),
            esc(&t.model)
        );
        let tp = &t.throughput;
        let rc = &t.requests;
        let _ = write!(
            h,
            "<p>{} sent, {} completed, {} disconnected, {} HTTP errors, {} stream errors, {} cut, {} transport errors; \
{:.1} s, <b>{:.1} output tokens/s</b>, {:.2} requests/s</p>",
            rc.sent, rc.completed, rc.disconnected, rc.http_errors, rc.stream_errors, rc.cut, rc.transport_errors,
            tp.duration_s, tp.output_tokens_per_s, tp.requests_per_s
        );
        h.push_str("<table><tr><th>ms</th><th>n</th><th>p50</th><th>p90</th><th>p99</th><th>max</th><th>mean</th></tr>");
        h.push_str(&dist_row("TTFT", &t.latency.ttft_ms));
        h.push_str(&dist_row("TPOT", &t.latency.tpot_ms));
        h.push_str(&dist_row("ITL", &t.latency.itl_ms));
        h.push_str(&dist_row("end-to-end", &t.latency.e2e_ms));
        h.push_str("</table>");
        if !t.errors_by_code.is_empty() {
            h.push_str("<table><tr><th>error</th><th>count</th></tr>");
            for (k, v) in &t.errors_by_code {
                let _ = write!(h, "<tr><td>{}</td><td>{v}</td></tr>", esc(k));
            }
            h.push_str("</table>");
        }
        if let Some(f) = &t.fault {
            let _ = write!(
                h,
                "<p>Fault: kill <code>{}</code> at {:.1} s (exit {:?}), restart at {} (exit {:?}), healthy at {}; outage {:.1} s, \
{} requests during it, {} errors during it, {} errors outside it.</p>",
                esc(&f.kill_cmd),
                f.times.kill_at_s,
                f.times.kill_exit_code,
                f.times.restart_at_s.map(|s| format!("{s:.1} s")).unwrap_or_else(|| "-".into()),
                f.times.restart_exit_code,
                f.times.ready_at_s.map(|s| format!("{s:.1} s")).unwrap_or_else(|| "never".into()),
                f.outage_s,
                f.requests_during_outage,
                f.errors_during_outage,
                f.errors_outside_outage
            );
        }
        let details = t
            .checks
            .canary
            .iter()
            .flat_map(|c| &c.details)
            .map(|l| format!("leak: request {} ({}) of tenant {} carries tenant {}'s canary {}", l.request_index, l.request_id.as_deref().unwrap_or("-"), l.tenant, l.foreign_tenant, l.canary))
            .chain(t.checks.solo_equality.iter().flat_map(|e| &e.details).map(|m| {
                format!(
                    "mismatch: request {} ({}) prompt {} at char {:?}: solo “{}” vs load “{}” (tokens {:?} vs {:?})",
                    m.request_index, m.request_id.as_deref().unwrap_or("-"), m.prompt, m.first_difference_at, m.expected, m.got, m.expected_tokens, m.got_tokens
                )
            }))
            .collect::<Vec<_>>();
        if !details.is_empty() {
            h.push_str("<ul>");
            for d in details {
                let _ = write!(h, "<li class=bad>{}</li>", esc(&d));
            }
            h.push_str("</ul>");
        }
        if let Some(u) = &t.checks.usage {
            h.push_str("<table><tr><th>tenant</th><th>requests</th><th>input tokens</th><th>output tokens</th><th>errors</th><th>match</th></tr>");
            for tu in &u.tenants {
                let cell = |r: crate::checks::Range, v: u64| {
                    if r.lo == r.hi {
                        format!("<td>{v} (expected {})</td>", r.lo)
                    } else {
                        format!("<td>{v} (expected {}..={})</td>", r.lo, r.hi)
                    }
                };
                let _ = write!(
                    h,
                    "<tr><td>{}</td>{}{}{}{}<td class={}>{}</td></tr>",
                    esc(&tu.label),
                    cell(tu.expected.requests, tu.observed.requests),
                    cell(tu.expected.input_tokens, tu.observed.input_tokens),
                    cell(tu.expected.output_tokens, tu.observed.output_tokens),
                    cell(tu.expected.errors, tu.observed.errors),
                    if tu.matched { "ok" } else { "bad" },
                    if tu.matched { "yes" } else { "NO" }
                );
            }
            h.push_str("</table>");
        }
    }
    if let Some(c) = &report.comparison {
        let _ = write!(
            h,
            "<h2>Comparison</h2><table><tr><th>metric</th><th>{}</th><th>{}</th><th>ratio</th><th>better</th></tr>",
            esc(&c.main),
            esc(&c.baseline)
        );
        for r in &c.rows {
            let _ = write!(
                h,
                "<tr><td>{}</td><td>{:.2}</td><td>{:.2}</td><td>{}</td><td>{}</td></tr>",
                r.metric,
                r.main,
                r.baseline,
                r.ratio
                    .map(|x| format!("{x:.2}x"))
                    .unwrap_or_else(|| "-".into()),
                r.better
            );
        }
        h.push_str("</table>");
    }
    // Plots.
    let labels: Vec<String> = report.targets.iter().map(|t| t.label.clone()).collect();
    let done = |i: usize| outcomes[i].iter().filter(|o| o.end == End::Complete);
    let series = |f: &dyn Fn(&Outcome) -> Option<f64>| -> Vec<(String, Vec<(f64, f64)>)> {
        (0..outcomes.len().min(labels.len()))
            .map(|i| (labels[i].clone(), cdf(done(i).filter_map(f))))
            .collect()
    };
    h.push_str("<h2>Plots</h2><div class=plots>");
    h.push_str(&line_chart(
        "TTFT (CDF)",
        "ms",
        "fraction",
        &series(&|o| o.ttft_s),
    ));
    h.push_str(&line_chart(
        "TPOT (CDF)",
        "ms",
        "fraction",
        &series(&|o| o.tpot_s()),
    ));
    h.push_str(&line_chart(
        "End-to-end latency (CDF)",
        "ms",
        "fraction",
        &series(&|o| Some(o.e2e_s)),
    ));
    let tput: Vec<(String, Vec<(f64, f64)>)> = report
        .targets
        .iter()
        .map(|t| {
            (
                t.label.clone(),
                t.timeline
                    .iter()
                    .map(|b| (b.start_s + t.timeline_bucket_s / 2.0, b.output_tokens_per_s))
                    .collect(),
            )
        })
        .collect();
    h.push_str(&line_chart(
        "Output tokens/s over time",
        "s",
        "tokens/s",
        &tput,
    ));
    h.push_str("</div></body></html>\n");
    h
}

/// The summary printed after a run.
pub fn summary(report: &Report) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<22}{}",
        "",
        report
            .targets
            .iter()
            .map(|t| format!("{:>14}", t.label))
            .collect::<String>()
            + if report.comparison.is_some() {
                "         ratio"
            } else {
                ""
            }
    );
    let line = |s: &mut String, name: &str, f: &dyn Fn(&TargetReport) -> f64, ratio: bool| {
        let _ = write!(s, "{name:<22}");
        for t in &report.targets {
            let _ = write!(s, "{:>14.2}", f(t));
        }
        if ratio && report.targets.len() == 2 {
            let (a, b) = (f(&report.targets[0]), f(&report.targets[1]));
            if b != 0.0 {
                let _ = write!(s, "{:>13.2}x", a / b);
            }
        }
        s.push('\n');
    };
    line(&mut s, "requests sent", &|t| t.requests.sent as f64, false);
    line(&mut s, "completed", &|t| t.requests.completed as f64, false);
    line(
        &mut s,
        "output tokens/s",
        &|t| t.throughput.output_tokens_per_s,
        true,
    );
    line(&mut s, "requests/s", &|t| t.throughput.requests_per_s, true);
    line(&mut s, "TTFT p50 (ms)", &|t| t.latency.ttft_ms.p50, true);
    line(&mut s, "TTFT p99 (ms)", &|t| t.latency.ttft_ms.p99, true);
    line(&mut s, "TPOT p50 (ms)", &|t| t.latency.tpot_ms.p50, true);
    line(&mut s, "ITL p50 (ms)", &|t| t.latency.itl_ms.p50, true);
    line(&mut s, "e2e p50 (ms)", &|t| t.latency.e2e_ms.p50, true);
    line(&mut s, "e2e p99 (ms)", &|t| t.latency.e2e_ms.p99, true);
    for t in &report.targets {
        let c = &t.checks;
        let show = |ran: bool, n: usize| if ran { n.to_string() } else { "not run".into() };
        let _ = writeln!(
            s,
            "{}: foreign canaries {}, solo mismatches {}, over-long not 4xx {}, usage mismatches {}; errors {:?}",
            t.label,
            show(c.canary.is_some(), c.leaks),
            show(c.solo_equality.is_some(), c.mismatches),
            show(c.over_long.as_ref().is_some_and(|o| o.sent > 0), c.over_long_not_rejected),
            show(c.usage.is_some(), c.usage_mismatches),
            t.errors_by_code
        );
        if let Some(f) = &t.fault {
            let _ = writeln!(
                s,
                "{}: fault outage {:.1} s, {} requests during it ({} errors), {} errors outside it",
                t.label,
                f.outage_s,
                f.requests_during_outage,
                f.errors_during_outage,
                f.errors_outside_outage
            );
        }
    }
    let _ = writeln!(s, "{}", if report.passed { "PASSED" } else { "FAILED" });
    for f in &report.failures {
        let _ = writeln!(s, "  {f}");
    }
    s
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
) -> Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let json = serde_json::to_string_pretty(report)?;
    std::fs::write(dir.join("report.json"), json + "\n")
        .with_context(|| format!("writing {}", dir.join("report.json").display()))?;
    std::fs::write(dir.join("report.html"), html(report, load))
        .with_context(|| format!("writing {}", dir.join("report.html").display()))?;
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
    std::fs::write(dir.join("requests.jsonl"), lines)
        .with_context(|| format!("writing {}", dir.join("requests.jsonl").display()))?;
    Ok(())
}
