//! Prometheus metrics in text format at `GET /metrics` (behind the admin token or
//! the metrics token).
//!
//! Every admitted inference request ends in exactly one usage row, and every row
//! passes through [`Metrics::observe`], so request, token, abort and latency metrics
//! agree with the ledger. Requests refused before admission (authentication,
//! account, scope, limits, over-long paths) write no row; they are counted here by
//! reason ([`Metrics::refused`]). Labels are bounded: endpoint, status, and fixed
//! reason and phase names (no tenant or model labels: both come from clients).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use tessera_serving::EngineStats;
use tessera_tenancy::UsageRecord;

const BUCKETS_S: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

#[derive(Default)]
struct Histogram {
    counts: [AtomicU64; 12],
    count: AtomicU64,
    sum_us: AtomicU64,
}

impl Histogram {
    fn observe(&self, us: i64) {
        let us = us.max(0) as u64;
        let s = us as f64 / 1e6;
        for (i, b) in BUCKETS_S.iter().enumerate() {
            if s <= *b {
                self.counts[i].fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_us.fetch_add(us, Ordering::Relaxed);
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in BUCKETS_S.iter().enumerate() {
            let _ = writeln!(
                out,
                "{name}_bucket{{le=\"{b}\"}} {}",
                self.counts[i].load(Ordering::Relaxed)
            );
        }
        let n = self.count.load(Ordering::Relaxed);
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {n}");
        let _ = writeln!(
            out,
            "{name}_sum {}",
            self.sum_us.load(Ordering::Relaxed) as f64 / 1e6
        );
        let _ = writeln!(out, "{name}_count {n}");
    }
}

/// Process-wide gateway metrics.
#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    input_tokens: AtomicU64,
    output_tokens: AtomicU64,
    aborts: AtomicU64,
    release_timeouts: AtomicU64,
    duration: Histogram,
    ttft: Histogram,
    refused: Mutex<BTreeMap<&'static str, u64>>,
    conn_timeouts: Mutex<BTreeMap<&'static str, u64>>,
    connections_open: AtomicU64,
    connections_total: AtomicU64,
    accept_errors: AtomicU64,
    pruned_rows: AtomicU64,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    /// Counts one finished request (its usage row).
    pub fn observe(&self, r: &UsageRecord) {
        *self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((r.endpoint.clone(), r.status))
            .or_default() += 1;
        self.input_tokens
            .fetch_add(r.input_tokens.max(0) as u64, Ordering::Relaxed);
        self.output_tokens
            .fetch_add(r.output_tokens.max(0) as u64, Ordering::Relaxed);
        if r.finish == "aborted" {
            self.aborts.fetch_add(1, Ordering::Relaxed);
        }
        self.duration.observe(r.duration_us);
        if r.output_tokens > 0 {
            self.ttft.observe(r.ttft_us);
        }
    }

    /// Counts a request whose nodes did not confirm its release within the bound (its
    /// permits and usage row went ahead without the confirmation).
    pub fn release_timeout(&self) {
        self.release_timeouts.fetch_add(1, Ordering::Relaxed);
    }

    /// Counts a request refused before admission; `reason` is a fixed label
    /// (`missing_key`, `wrong_account`, `scope`, `path_too_long`, a limit's label, ...).
    pub fn refused(&self, reason: &'static str) {
        *self
            .refused
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(reason)
            .or_default() += 1;
    }

    /// Refusals so far for `reason`.
    pub fn refused_count(&self, reason: &str) -> u64 {
        let m = self.refused.lock().unwrap_or_else(|e| e.into_inner());
        m.get(reason).copied().unwrap_or(0)
    }

    /// Counts a connection closed by a timeout in `phase` (`header`, `tls`, `idle`).
    pub fn connection_timeout(&self, phase: &'static str) {
        *self
            .conn_timeouts
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(phase)
            .or_default() += 1;
    }

    /// A connection was accepted (`open`) or closed.
    pub fn connection(&self, open: bool) {
        if open {
            self.connections_open.fetch_add(1, Ordering::Relaxed);
            self.connections_total.fetch_add(1, Ordering::Relaxed);
        } else {
            self.connections_open.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Connections open now.
    pub fn connections_open(&self) -> u64 {
        self.connections_open.load(Ordering::Relaxed)
    }

    /// `accept` failed (e.g. out of file descriptors).
    pub fn accept_error(&self) {
        self.accept_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Ledger rows deleted by the retention prune.
    pub fn pruned(&self, rows: u64) {
        self.pruned_rows.fetch_add(rows, Ordering::Relaxed);
    }

    /// Prometheus text exposition.
    pub fn render(&self, engine: EngineStats, inflight: usize) -> String {
        let mut out = String::new();
        out.push_str(
            "# HELP tessera_requests_total Inference requests by endpoint and HTTP status.\n",
        );
        out.push_str("# TYPE tessera_requests_total counter\n");
        for ((ep, st), n) in self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "tessera_requests_total{{endpoint=\"{ep}\",status=\"{st}\"}} {n}"
            );
        }
        out.push_str("# HELP tessera_tokens_total Prompt (input) and generated (output) tokens.\n");
        out.push_str("# TYPE tessera_tokens_total counter\n");
        let _ = writeln!(
            out,
            "tessera_tokens_total{{direction=\"input\"}} {}",
            self.input_tokens.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "tessera_tokens_total{{direction=\"output\"}} {}",
            self.output_tokens.load(Ordering::Relaxed)
        );
        out.push_str("# HELP tessera_aborts_total Requests aborted (client gone or shutdown).\n");
        out.push_str("# TYPE tessera_aborts_total counter\n");
        let _ = writeln!(
            out,
            "tessera_aborts_total {}",
            self.aborts.load(Ordering::Relaxed)
        );
        for (name, help, map, label) in [
            (
                "tessera_refused_total",
                "Requests refused before admission (no usage row), by reason.",
                &self.refused,
                "reason",
            ),
            (
                "tessera_connection_timeouts_total",
                "Connections closed by a timeout, by phase (header, tls, idle).",
                &self.conn_timeouts,
                "phase",
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} counter");
            for (k, n) in map.lock().unwrap_or_else(|e| e.into_inner()).iter() {
                let _ = writeln!(out, "{name}{{{label}=\"{k}\"}} {n}");
            }
        }
        for (name, help, v) in [
            (
                "tessera_connections_total",
                "Connections accepted.",
                &self.connections_total,
            ),
            (
                "tessera_accept_errors_total",
                "Failed accepts (the accept loop backs off on resource errors).",
                &self.accept_errors,
            ),
            (
                "tessera_usage_rows_pruned_total",
                "Ledger rows deleted by the retention prune.",
                &self.pruned_rows,
            ),
            (
                "tessera_release_wait_timeouts_total",
                "Requests whose nodes did not confirm release (abort or end acknowledged by every node) within the bound.",
                &self.release_timeouts,
            ),
        ] {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                v.load(Ordering::Relaxed)
            );
        }
        self.duration.render(
            &mut out,
            "tessera_request_duration_seconds",
            "Request duration in the gateway.",
        );
        self.ttft.render(
            &mut out,
            "tessera_ttft_seconds",
            "Time to first token (engine).",
        );
        for (name, help, v) in [
            (
                "tessera_inflight_requests",
                "Admitted requests not yet finished.",
                inflight,
            ),
            (
                "tessera_connections_open",
                "Client connections open now.",
                self.connections_open.load(Ordering::Relaxed) as usize,
            ),
            ("tessera_kv_free_pages", "Free KV pages.", engine.free_pages),
            (
                "tessera_kv_capacity_pages",
                "KV pool size in pages.",
                engine.capacity_pages,
            ),
            (
                "tessera_engine_running",
                "Sequences in the running batch.",
                engine.running,
            ),
            (
                "tessera_engine_waiting",
                "Sequences waiting for pages or a batch slot.",
                engine.waiting,
            ),
        ] {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        }
        out
    }
}
