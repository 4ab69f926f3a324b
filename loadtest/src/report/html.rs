//! `report.html`: one self-contained page (inline CSS and SVG plots drawn with
//! plotters, no scripts) of a [`Report`] and its load-phase outcomes.

use super::{opt3, pct, Report};
use crate::client::{End, Outcome};
use crate::fairness::{FairnessReport, PrefixCacheReport};
use crate::fault::NodeLoss;
use plotters::prelude::*;
use std::fmt::Write as _;

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// Draws the series' legend at `at` (white, framed).
fn legend<'a, DB: DrawingBackend + 'a, CT: CoordTranslate>(
    chart: &mut ChartContext<'a, DB, CT>,
    at: SeriesLabelPosition,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    chart
        .configure_series_labels()
        .position(at)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
}

/// The chart's SVG, or a line saying why it could not be drawn.
fn svg_or_failure(svg: String, drawn: Result<(), Box<dyn std::error::Error + '_>>) -> String {
    match drawn {
        Ok(()) => svg,
        Err(e) => format!("<p>plot failed: {}</p>", esc(&e.to_string())),
    }
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
        legend(&mut chart, SeriesLabelPosition::LowerRight)?;
        root.present()?;
        Ok(())
    })();
    svg_or_failure(svg, drawn)
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
        legend(&mut chart, SeriesLabelPosition::UpperRight)?;
        root.present()?;
        Ok(())
    })();
    svg_or_failure(svg, drawn)
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
                "<p>Gateway <code>tessera_request_restarts_total</code> over the load phase: retried (restarted) <b>{}</b>, continued <b>{}</b>, moved (drained, with their KV) <b>{}</b>, not restarted <b>{}</b>.</p>",
                r.restarted, r.continued, r.moved, r.not_restarted
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
