//! The report: [`Report`] (serialized as `report.json`, stable snake_case field
//! names, `schema_version` bumped on any incompatible change), a self-contained
//! `report.html` with inline SVG plots, `requests.jsonl` (one [`Outcome`] per
//! line) and the text summary printed at the end of a run.

use crate::checks::{CanaryReport, EqualityReport, OverlongReport, UsageReport};
use crate::client::{End, Outcome};
use crate::error::LoadtestError;
use crate::fairness::{FairnessReport, PrefixCacheReport};
use crate::fault::{FaultReport, NodeLoss};
use crate::metrics::{Bucket, Latency, Throughput};
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

/// A small grouped bar chart as an SVG string: one group per category, one bar
/// per `(name, values)` series (values in category order).
fn bar_chart(
    title: &str,
    y_desc: &str,
    categories: &[String],
    series: &[(String, Vec<f64>)],
) -> String {
    let mut svg = String::new();
    let n = categories.len().max(1);
    let y_max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(0.0f64, f64::max)
        .max(1e-3)
        // Room above the tallest bar for the legend.
        * 1.45;
    let drawn = (|| -> Result<(), Box<dyn std::error::Error + '_>> {
        let root = SVGBackend::with_string(&mut svg, (420, 260)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(30)
            .y_label_area_size(50)
            .build_cartesian_2d(-0.5f64..n as f64 - 0.5, 0f64..y_max)?;
        chart
            .configure_mesh()
            .y_desc(y_desc)
            .x_labels(n)
            .x_label_formatter(&|x| {
                let i = x.round();
                if (x - i).abs() < 1e-6 && i >= 0.0 {
                    categories.get(i as usize).cloned().unwrap_or_default()
                } else {
                    String::new()
                }
            })
            .disable_x_mesh()
            .light_line_style(WHITE.mix(0.0))
            .draw()?;
        let k = series.len().max(1) as f64;
        let width = 0.8 / k;
        for (j, (name, values)) in series.iter().enumerate() {
            let color = Palette99::pick(j).to_rgba();
            chart
                .draw_series(values.iter().enumerate().map(|(i, v)| {
                    let x0 = i as f64 - 0.4 + j as f64 * width;
                    Rectangle::new([(x0, 0.0), (x0 + width * 0.9, *v)], color.filled())
                }))?
                .label(name.as_str())
                .legend(move |(x, y)| {
                    Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled())
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
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

fn opt3(x: Option<f64>) -> String {
    x.map(|x| format!("{x:.3}")).unwrap_or_else(|| "-".into())
}

fn pct(x: Option<f64>) -> String {
    x.map(|x| format!("{:.1}%", x * 100.0))
        .unwrap_or_else(|| "-".into())
}

/// The fairness section of one target: a table per tenant, Jain's indices and
/// a bar chart of service vs demand shares.
fn fairness_html(h: &mut String, f: &FairnessReport) {
    let _ = write!(
        h,
        "<h3>Fairness</h3><p>Jain's index <b>{}</b> over output tokens received / output tokens asked for (1 = every tenant got the same fraction of its demand); {} over output tokens received (1 = every tenant got the same number). Jain, Chiu, Hawe 1984: J = (Σx)² / (n·Σx²).</p>",
        opt3(f.jain_index),
        opt3(f.jain_index_equal_split)
    );
    h.push_str("<table><tr><th>tenant</th><th>requests</th><th>completed</th><th>input tokens</th><th>cached tokens</th><th>output tokens</th><th>asked for</th><th>service share</th><th>demand share</th><th>TTFT p50 ms</th><th>TTFT p99 ms</th><th>e2e p50 ms</th></tr>");
    for t in &f.tenants {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.1}%</td><td>{:.1}%</td><td>{:.1}</td><td>{:.1}</td><td>{:.1}</td></tr>",
            esc(&t.label),
            t.requests_sent,
            t.requests_completed,
            t.input_tokens,
            t.cached_tokens,
            t.output_tokens,
            t.demand_output_tokens,
            t.service_share * 100.0,
            t.demand_share * 100.0,
            t.ttft_ms.p50,
            t.ttft_ms.p99,
            t.e2e_ms.p50
        );
    }
    h.push_str("</table>");
    let cats: Vec<String> = f.tenants.iter().map(|t| t.label.clone()).collect();
    let share = |g: fn(&crate::fairness::TenantService) -> f64| -> Vec<f64> {
        f.tenants.iter().map(|t| g(t) * 100.0).collect()
    };
    h.push_str("<div class=plots>");
    h.push_str(&bar_chart(
        "Share of service vs demand",
        "%",
        &cats,
        &[
            ("service".into(), share(|t| t.service_share)),
            ("demand".into(), share(|t| t.demand_share)),
        ],
    ));
    h.push_str(&bar_chart(
        "TTFT per tenant",
        "ms",
        &cats,
        &[
            (
                "p50".into(),
                f.tenants.iter().map(|t| t.ttft_ms.p50).collect(),
            ),
            (
                "p99".into(),
                f.tenants.iter().map(|t| t.ttft_ms.p99).collect(),
            ),
        ],
    ));
    h.push_str("</div>");
}

/// The prefix-cache section of one target: cached prompt tokens and hit rate per
/// tenant (and the ledger's cached tokens when the usage check read them).
fn prefix_html(h: &mut String, p: &PrefixCacheReport, ledger: Option<&[u64]>) {
    let _ = write!(
        h,
        "<h3>Prefix cache</h3><p>{}; {} of {} prompt tokens served from the cache (<b>{}</b>), {} of {} answers with a hit.</p>",
        match p.shared_prefix_tokens {
            Some(n) => format!("shared prefix of {n} words per tenant"),
            None => "no shared prefix".into(),
        },
        p.cached_tokens,
        p.prompt_tokens,
        pct(p.hit_rate),
        p.requests_with_hit,
        p.requests_with_usage
    );
    h.push_str("<table><tr><th>tenant</th><th>answers with usage</th><th>with a hit</th><th>prompt tokens</th><th>cached tokens</th><th>hit rate</th>");
    if ledger.is_some() {
        h.push_str("<th>ledger cached tokens (solo + load)</th>");
    }
    h.push_str("</tr>");
    for (i, t) in p.tenants.iter().enumerate() {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>",
            esc(&t.label),
            t.requests_with_usage,
            t.requests_with_hit,
            t.prompt_tokens,
            t.cached_tokens,
            pct(t.hit_rate)
        );
        if let Some(l) = ledger {
            let _ = write!(
                h,
                "<td>{}</td>",
                l.get(i).map(u64::to_string).unwrap_or_default()
            );
        }
        h.push_str("</tr>");
    }
    h.push_str("</table>");
    if p.prompt_tokens > 0 {
        let cats: Vec<String> = p.tenants.iter().map(|t| t.label.clone()).collect();
        h.push_str(&bar_chart(
            "Prompt tokens: cached vs computed",
            "tokens",
            &cats,
            &[
                (
                    "cached".into(),
                    p.tenants.iter().map(|t| t.cached_tokens as f64).collect(),
                ),
                (
                    "computed".into(),
                    p.tenants
                        .iter()
                        .map(|t| t.prompt_tokens.saturating_sub(t.cached_tokens) as f64)
                        .collect(),
                ),
            ],
        ));
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
stream {:.0}%, over-long {:.0}%, disconnects {:.0}%, context window {} tokens{}</p>",
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
        w.context_window,
        w.shared_prefix_tokens
            .map(|n| format!(", shared prefix of {n} words per tenant"))
            .unwrap_or_default()
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
        if t.completed_by_model.len() > 1 {
            let per: Vec<String> = t
                .completed_by_model
                .iter()
                .map(|(m, n)| format!("<code>{}</code> {n}", esc(m)))
                .collect();
            let _ = write!(h, "<p>completed per model: {}</p>", per.join(", "));
        }
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
                "<p>Fault: kill <code>{}</code> at {:.1} s (exit {:?}), restart at {} (exit {:?}), healthy at {}{}; outage {:.1} s, \
{} requests during it, {} errors during it, {} errors outside it.</p>",
                esc(&f.kill_cmd),
                f.times.kill_at_s,
                f.times.kill_exit_code,
                f.times.restart_at_s.map(|s| format!("{s:.1} s")).unwrap_or_else(|| "-".into()),
                f.times.restart_exit_code,
                f.times.ready_at_s.map(|s| format!("{s:.1} s")).unwrap_or_else(|| "never".into()),
                if f.kills > 1 {
                    format!(
                        "; {} kills{} at {} s",
                        f.kills,
                        f.every_s.map(|e| format!(" every {e} s")).unwrap_or_default(),
                        f.cycles.iter().map(|c| format!("{:.1}", c.kill_at_s)).collect::<Vec<_>>().join(", ")
                    )
                } else {
                    String::new()
                },
                f.outage_s,
                f.requests_during_outage,
                f.errors_during_outage,
                f.errors_outside_outage
            );
        }
        node_loss_html(&mut h, &t.node_loss);
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
            h.push_str("<table><tr><th>tenant</th><th>requests</th><th>input tokens</th><th>output tokens</th><th>errors</th><th>cached tokens</th><th>match</th></tr>");
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
                    "<tr><td>{}</td>{}{}{}{}{}<td class={}>{}</td></tr>",
                    esc(&tu.label),
                    cell(tu.expected.requests, tu.observed.requests),
                    cell(tu.expected.input_tokens, tu.observed.input_tokens),
                    cell(tu.expected.output_tokens, tu.observed.output_tokens),
                    cell(tu.expected.errors, tu.observed.errors),
                    cell(tu.expected.cached_tokens, tu.observed.cached_tokens),
                    if tu.matched { "ok" } else { "bad" },
                    if tu.matched { "yes" } else { "NO" }
                );
            }
            h.push_str("</table>");
        }
        fairness_html(&mut h, &t.fairness);
        let ledger: Option<Vec<u64>> = t
            .checks
            .usage
            .as_ref()
            .map(|u| u.tenants.iter().map(|x| x.observed.cached_tokens).collect());
        prefix_html(&mut h, &t.prefix_cache, ledger.as_deref());
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

/// One line of node-loss figures: failed requests by kind, the gateways'
/// restart decisions, and the largest gap per stream.
fn node_loss_line(n: &NodeLoss) -> String {
    let restarts = match (&n.restarts, &n.restarts_unavailable) {
        (Some(r), _) => format!(
            "retried {}, continued {}, not restarted {}",
            r.restarted, r.continued, r.not_restarted
        ),
        (None, Some(why)) => format!("restarts not read ({why})"),
        (None, None) => "restarts not read".into(),
    };
    format!(
        "failed {} of {} ({:.2}%): {} with an error event, {} truncated, {} transport; {} during faults, {} excused; {}; \
largest gap per stream p50/p99 ms: all {:.0}/{:.0} (n {}), during faults {:.0}/{:.0} (n {}), outside {:.0}/{:.0}",
        n.failed,
        n.requests,
        n.failed_share * 100.0,
        n.failed_with_error_event,
        n.truncated,
        n.transport,
        n.failed_during_faults,
        n.excused,
        restarts,
        n.max_gap_ms.p50,
        n.max_gap_ms.p99,
        n.max_gap_ms.count,
        n.max_gap_during_faults_ms.p50,
        n.max_gap_during_faults_ms.p99,
        n.max_gap_during_faults_ms.count,
        n.max_gap_outside_faults_ms.p50,
        n.max_gap_outside_faults_ms.p99,
    )
}

/// The node-loss section of one target's HTML.
fn node_loss_html(h: &mut String, n: &NodeLoss) {
    let _ = write!(
        h,
        "<h3>Node loss</h3><table><tr><th>requests</th><th>failed</th><th>with an error event</th><th>truncated</th><th>transport</th><th>during faults</th><th>excused</th><th>not excused</th><th>completed during faults</th></tr>\
<tr><td>{}</td><td>{} ({:.2}%)</td><td>{}</td>{}<td>{}</td><td>{}</td><td>{}</td>{}<td>{}</td></tr></table>",
        n.requests,
        n.failed,
        n.failed_share * 100.0,
        n.failed_with_error_event,
        check_cell(n.truncated, true),
        n.transport,
        n.failed_during_faults,
        n.excused,
        check_cell(n.unexcused, true),
        n.completed_during_faults,
    );
    match (&n.restarts, &n.restarts_unavailable) {
        (Some(r), _) => {
            let _ = write!(
                h,
                "<p>Gateway <code>tessera_request_restarts_total</code> over the load phase: retried (restarted) <b>{}</b>, continued <b>{}</b>, not restarted <b>{}</b>.</p>",
                r.restarted, r.continued, r.not_restarted
            );
        }
        (None, why) => {
            let _ = write!(
                h,
                "<p>Restart counters not read{}.</p>",
                why.as_deref()
                    .map(|w| format!(": {}", esc(w)))
                    .unwrap_or_default()
            );
        }
    }
    h.push_str("<table><tr><th>ms</th><th>n</th><th>p50</th><th>p90</th><th>p99</th><th>max</th><th>mean</th></tr>");
    h.push_str(&dist_row("largest gap per stream", &n.max_gap_ms));
    h.push_str(&dist_row("… during faults", &n.max_gap_during_faults_ms));
    h.push_str(&dist_row("… outside faults", &n.max_gap_outside_faults_ms));
    h.push_str(&dist_row("TTFT during faults", &n.ttft_during_faults_ms));
    h.push_str("</table>");
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
        let f = &t.fairness;
        let _ = writeln!(
            s,
            "{}: Jain's index {} (equal split {}); per tenant output tokens/asked for, TTFT p50/p99 ms: {}",
            t.label,
            opt3(f.jain_index),
            opt3(f.jain_index_equal_split),
            f.tenants
                .iter()
                .map(|x| format!(
                    "{} {}/{} {:.0}/{:.0}",
                    x.label, x.output_tokens, x.demand_output_tokens, x.ttft_ms.p50, x.ttft_ms.p99
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
        let p = &t.prefix_cache;
        let _ = writeln!(
            s,
            "{}: prefix cache {} of {} prompt tokens cached ({}); per tenant: {}",
            t.label,
            p.cached_tokens,
            p.prompt_tokens,
            pct(p.hit_rate),
            p.tenants
                .iter()
                .map(|x| format!("{} {}", x.label, pct(x.hit_rate)))
                .collect::<Vec<_>>()
                .join(", ")
        );
        if let Some(f) = &t.fault {
            let _ = writeln!(
                s,
                "{}: fault: {} kill(s){}, outage {:.1} s, {} requests during it ({} errors), {} errors outside it",
                t.label,
                f.kills,
                f.every_s.map(|e| format!(" every {e} s")).unwrap_or_default(),
                f.outage_s,
                f.requests_during_outage,
                f.errors_during_outage,
                f.errors_outside_outage
            );
        }
        let _ = writeln!(s, "{}: {}", t.label, node_loss_line(&t.node_loss));
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
    use crate::args::LoadtestArgs;
    use crate::fairness::{fairness, prefix_cache};
    use crate::workload::Workload;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: LoadtestArgs,
    }

    /// A report of one target with two tenants' answers, as the runner builds it.
    fn report() -> (Report, Vec<Outcome>) {
        let a = Cli::parse_from(["x", "--prompts-per-tenant", "1", "--output-len", "8"]).a;
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
            h.contains("retried (restarted) <b>3</b>, continued <b>5</b>, not restarted <b>1</b>")
        );
        let s = summary(&r);
        assert!(
            s.contains("failed 2 of 4 (0.00%): 1 with an error event, 1 truncated, 0 transport"),
            "{s}"
        );
        assert!(s.contains("retried 3, continued 5, not restarted 1"), "{s}");
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
