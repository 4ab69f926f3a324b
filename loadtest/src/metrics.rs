//! Latency and throughput figures from the outcomes of a phase: distributions
//! (nearest-rank percentiles, exact over every sample), error counts by code, and
//! a timeline in fixed buckets.

use crate::client::{End, Outcome};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Summary of a sample, in milliseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Dist {
    /// Samples.
    pub count: usize,
    /// Mean (ms).
    pub mean: f64,
    /// Median (ms).
    pub p50: f64,
    /// 90th percentile (ms).
    pub p90: f64,
    /// 99th percentile (ms).
    pub p99: f64,
    /// Largest (ms).
    pub max: f64,
}

/// Nearest-rank percentile `q` (0..=1) of sorted `v`; 0 when empty.
pub fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = (q * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// Summarizes samples given in seconds as milliseconds.
pub fn dist(samples_s: &[f64]) -> Dist {
    let mut v: Vec<f64> = samples_s.iter().map(|s| s * 1e3).collect();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return Dist::default();
    }
    Dist {
        count: v.len(),
        mean: v.iter().sum::<f64>() / v.len() as f64,
        p50: percentile(&v, 0.50),
        p90: percentile(&v, 0.90),
        p99: percentile(&v, 0.99),
        max: v[v.len() - 1],
    }
}

/// Latency distributions of completed requests.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Latency {
    /// Time to first token (streamed requests).
    pub ttft_ms: Dist,
    /// Time per output token after the first, one sample per streamed request.
    pub tpot_ms: Dist,
    /// Inter-token latency: every gap between consecutive text events.
    pub itl_ms: Dist,
    /// End-to-end latency (all completed requests).
    pub e2e_ms: Dist,
}

/// Throughput over the phase.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Throughput {
    /// Phase wall time (s): first request start to last request end.
    pub duration_s: f64,
    /// Completed requests.
    pub requests_completed: usize,
    /// Completed requests per second.
    pub requests_per_s: f64,
    /// Output tokens of completed requests.
    pub output_tokens: u64,
    /// Output tokens of completed requests per second.
    pub output_tokens_per_s: f64,
}

/// One bucket of the timeline.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Bucket {
    /// Bucket start (s from the phase start).
    pub start_s: f64,
    /// Requests that completed in the bucket.
    pub requests_completed: usize,
    /// Output tokens received in the bucket (streams: one per text event when it
    /// arrived; the rest at the end).
    pub output_tokens: u64,
    /// `output_tokens` per second.
    pub output_tokens_per_s: f64,
    /// Requests that ended in an error in the bucket.
    pub errors: usize,
    /// Requests in flight at the bucket's start.
    pub in_flight: usize,
    /// Median TTFT of requests whose first token arrived in the bucket (ms).
    pub ttft_p50_ms: Option<f64>,
}

/// Latency distributions over `outs`.
pub fn latency(outs: &[Outcome]) -> Latency {
    let done: Vec<&Outcome> = outs.iter().filter(|o| o.end == End::Complete).collect();
    let ttft: Vec<f64> = done.iter().filter_map(|o| o.ttft_s).collect();
    let tpot: Vec<f64> = done.iter().filter_map(|o| o.tpot_s()).collect();
    let itl: Vec<f64> = done
        .iter()
        .flat_map(|o| o.event_times_s.windows(2).map(|w| w[1] - w[0]))
        .collect();
    let e2e: Vec<f64> = done.iter().map(|o| o.e2e_s).collect();
    Latency {
        ttft_ms: dist(&ttft),
        tpot_ms: dist(&tpot),
        itl_ms: dist(&itl),
        e2e_ms: dist(&e2e),
    }
}

/// Phase duration: first start to last end (s).
pub fn span(outs: &[Outcome]) -> f64 {
    let start = outs.iter().map(|o| o.start_s).fold(f64::INFINITY, f64::min);
    let end = outs
        .iter()
        .map(|o| o.start_s + o.e2e_s)
        .fold(0.0f64, f64::max);
    if start.is_finite() {
        (end - start).max(0.0)
    } else {
        0.0
    }
}

/// Throughput over `outs`.
pub fn throughput(outs: &[Outcome]) -> Throughput {
    let duration_s = span(outs);
    let done: Vec<&Outcome> = outs.iter().filter(|o| o.end == End::Complete).collect();
    let tokens: u64 = done.iter().map(|o| o.output_tokens()).sum();
    let per = |x: f64| {
        if duration_s > 0.0 {
            x / duration_s
        } else {
            0.0
        }
    };
    Throughput {
        duration_s,
        requests_completed: done.len(),
        requests_per_s: per(done.len() as f64),
        output_tokens: tokens,
        output_tokens_per_s: per(tokens as f64),
    }
}

/// Label of a failed outcome for [`errors_by_code`]; `None` for completed and
/// deliberately disconnected requests.
pub fn error_label(o: &Outcome) -> Option<String> {
    let code = o.error.as_deref().unwrap_or("none");
    match o.end {
        End::Complete | End::Disconnected => None,
        End::HttpError => Some(format!("http_{}:{code}", o.status.unwrap_or(0))),
        End::StreamError => Some(format!("stream_error:{code}")),
        End::Cut => Some(format!("cut:{code}")),
        End::Transport => Some(format!("transport:{code}")),
    }
}

/// Failed requests by label (`http_400:3006`, `stream_error:3043`, `cut:incomplete_stream`,
/// `transport:connect`, ...).
pub fn errors_by_code(outs: &[Outcome]) -> BTreeMap<String, usize> {
    let mut m = BTreeMap::new();
    for l in outs.iter().filter_map(error_label) {
        *m.entry(l).or_default() += 1;
    }
    m
}

/// The timeline in buckets of `bucket_s` seconds over `[0, duration_s]`.
pub fn timeline(outs: &[Outcome], duration_s: f64, bucket_s: f64) -> Vec<Bucket> {
    let n = ((duration_s / bucket_s).ceil() as usize).max(1);
    let mut b: Vec<Bucket> = (0..n)
        .map(|i| Bucket {
            start_s: i as f64 * bucket_s,
            ..Bucket::default()
        })
        .collect();
    let idx = |t: f64| ((t / bucket_s).floor().max(0.0) as usize).min(n - 1);
    let mut ttfts: Vec<Vec<f64>> = vec![Vec::new(); n];
    for o in outs {
        let end = o.start_s + o.e2e_s;
        for (i, bk) in b.iter_mut().enumerate() {
            let t = i as f64 * bucket_s;
            if o.start_s <= t && end > t {
                bk.in_flight += 1;
            }
        }
        match o.end {
            End::Complete => {
                b[idx(end)].requests_completed += 1;
                for t in &o.event_times_s {
                    b[idx(o.start_s + t)].output_tokens += 1;
                }
                let rest = o
                    .output_tokens()
                    .saturating_sub(o.event_times_s.len() as u64);
                b[idx(end)].output_tokens += rest;
                if let Some(t) = o.ttft_s {
                    ttfts[idx(o.start_s + t)].push(t);
                }
            }
            End::Disconnected => {}
            _ => b[idx(end)].errors += 1,
        }
    }
    for (bk, t) in b.iter_mut().zip(ttfts) {
        bk.output_tokens_per_s = bk.output_tokens as f64 / bucket_s;
        if !t.is_empty() {
            bk.ttft_p50_ms = Some(dist(&t).p50);
        }
    }
    b
}

/// A bucket width giving about 60 buckets, at least 0.5 s.
pub fn bucket_width(duration_s: f64) -> f64 {
    let raw = (duration_s / 60.0).max(0.5);
    // Round to 0.5 s, 1 s, 2 s, 5 s, 10 s, ...
    for w in [0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0] {
        if raw <= w {
            return w;
        }
    }
    600.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=100).map(|i| i as f64 / 1e3).collect();
        let d = dist(&v);
        assert_eq!(d.count, 100);
        assert!((d.p50 - 50.0).abs() < 1e-9);
        assert!((d.p90 - 90.0).abs() < 1e-9);
        assert!((d.p99 - 99.0).abs() < 1e-9);
        assert!((d.max - 100.0).abs() < 1e-9);
        assert!((d.mean - 50.5).abs() < 1e-9);
        assert_eq!(dist(&[]), Dist::default());
        assert_eq!(percentile(&[7.0], 0.99), 7.0);
    }

    #[test]
    fn bucket_widths() {
        assert_eq!(bucket_width(10.0), 0.5);
        assert_eq!(bucket_width(100.0), 2.0);
        assert_eq!(bucket_width(3600.0), 60.0);
    }
}
