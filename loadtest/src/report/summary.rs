//! The text summary printed at the end of a run.

use super::{opt3, pct, Report, TargetReport};
use crate::fault::NodeLoss;
use std::fmt::Write as _;

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

/// One line of node-loss figures: failed requests by kind, the gateways'
/// restart decisions, and the largest gap per stream.
fn node_loss_line(n: &NodeLoss) -> String {
    let restarts = match (&n.restarts, &n.restarts_unavailable) {
        (Some(r), _) => format!(
            "retried {}, continued {}, moved {}, not restarted {}",
            r.restarted, r.continued, r.moved, r.not_restarted
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
