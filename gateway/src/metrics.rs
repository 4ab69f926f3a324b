//! Prometheus metrics (OpenMetrics text through `prometheus-client`) at `GET /metrics`
//! (behind the admin token or the metrics token).
//!
//! Every admitted inference request ends in exactly one usage row, and every row
//! passes through [`Metrics::observe`], so request, token and latency metrics agree
//! with the ledger. Requests refused before admission (authentication, account,
//! scope, limits, over-long paths) write no row; they are counted by reason
//! ([`Metrics::refused`]), and also as `tessera_auth_failures_total{reason}` or
//! `tessera_rate_limited_total{limit}`. Serving failures are counted by their
//! [`ServeErrorKind`](tessera_serving::ServeErrorKind) label
//! (`tessera_serve_errors_total{kind}`: `integrity` is a KV tag or checksum mismatch).
//!
//! Labels are bounded: the model label is a catalog id (anything else is
//! `unknown`), the tenant label names only the top N tenants by requests (the rest
//! are `other`, see [`TopTenants`]), every other label is a fixed name. With an
//! in-process engine the nodes' metrics ([`tessera_serving::NodeMetrics`]) follow the
//! gateway's in the same exposition, with `node` and `role` labels.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;
use tessera_serving::{EngineStats, NodeMetrics};
use tessera_tenancy::UsageRecord;

/// Latency buckets, seconds.
const BUCKETS_S: [f64; 12] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];
/// Time-per-output-token buckets, seconds.
const TPOT_BUCKETS_S: [f64; 12] = [
    0.001, 0.002, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
];
/// Abort-acknowledgement buckets, seconds.
const ACK_BUCKETS_S: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0, 30.0,
];

/// The tenant label of requests outside the top N.
pub const OTHER_TENANT: &str = "other";
/// The model label of a model id not in the catalog.
pub const UNKNOWN_MODEL: &str = "unknown";
/// Tenants with their own label by default.
pub const DEFAULT_TOP_TENANTS: usize = 20;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    model: String,
    api: String,
    status: u16,
    code: u32,
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TokenLabels {
    model: String,
    direction: &'static str,
    tenant: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModelLabels {
    model: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct AbortLabels {
    phase: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LimitLabels {
    limit: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PhaseLabels {
    phase: &'static str,
}

type Histograms<S> = Family<S, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    Histogram::new(BUCKETS_S)
}

fn tpot_histogram() -> Histogram {
    Histogram::new(TPOT_BUCKETS_S)
}

/// Which tenants get their own label: the `n` with the most requests so far. A tenant
/// enters when it has more requests than the smallest of the current top N, which
/// then counts as `other` from its next request on (its own series stop growing;
/// every series stays monotonic and the sum over tenants stays exact). Bounded: at
/// most `n` labelled tenants at a time.
#[derive(Debug)]
pub struct TopTenants {
    n: usize,
    state: Mutex<TopState>,
}

#[derive(Debug, Default)]
struct TopState {
    requests: HashMap<String, u64>,
    top: Vec<String>,
}

impl TopTenants {
    /// The top `n` tenants get their own label (0: every tenant is `other`).
    pub fn new(n: usize) -> Self {
        Self {
            n,
            state: Mutex::new(TopState::default()),
        }
    }

    /// Counts one request of `tenant` and returns its label: the tenant id when it is
    /// among the top N now, else [`OTHER_TENANT`].
    pub fn label(&self, tenant: &str) -> String {
        if self.n == 0 || tenant.is_empty() {
            return OTHER_TENANT.into();
        }
        let mut s = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let count = {
            let c = s.requests.entry(tenant.to_string()).or_default();
            *c += 1;
            *c
        };
        if s.top.iter().any(|t| t == tenant) {
            return tenant.into();
        }
        if s.top.len() < self.n {
            s.top.push(tenant.into());
            return tenant.into();
        }
        let (i, min) = s
            .top
            .iter()
            .enumerate()
            .map(|(i, t)| (i, s.requests.get(t).copied().unwrap_or(0)))
            .min_by_key(|&(_, c)| c)
            .expect("n > 0 tenants in the top");
        if count > min {
            s.top[i] = tenant.into();
            tenant.into()
        } else {
            OTHER_TENANT.into()
        }
    }
}

/// Why an abort happened (the `reason` label of `tessera_aborts_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortReason {
    /// The client went away.
    ClientGone,
    /// Shutdown after the drain deadline.
    Shutdown,
    /// A first-token or total deadline passed.
    Timeout,
    /// The key was revoked or expired, or the tenant suspended.
    KeyInvalid,
}

impl AbortReason {
    /// Every reason, for the series created at 0.
    const ALL: [Self; 4] = [
        Self::ClientGone,
        Self::Shutdown,
        Self::Timeout,
        Self::KeyInvalid,
    ];

    fn label(self) -> &'static str {
        match self {
            Self::ClientGone => "client_gone",
            Self::Shutdown => "shutdown",
            Self::Timeout => "timeout",
            Self::KeyInvalid => "key_invalid",
        }
    }
}

/// Every `reason` [`Metrics::refused`] is called with. Each one's
/// `tessera_refused_total` series, and its `tessera_rate_limited_total` or
/// `tessera_auth_failures_total` twin, exists at 0 from the start, so an alert on
/// it reads 0 rather than "no data" before the first refusal.
pub const REFUSAL_REASONS: &[&str] = &[
    // Authentication and authorization (tessera_tenancy::AuthError labels first).
    "missing_key",
    "malformed_key",
    "invalid_key",
    "revoked_key",
    "expired_key",
    "tenant_suspended",
    "wrong_account",
    "scope",
    "admin_auth",
    "store_unavailable",
    // Limits and quotas (tessera_tenancy::LimitKind labels).
    "requests_per_minute",
    "input_tokens_per_minute",
    "output_tokens_per_minute",
    "max_concurrent",
    "daily_tokens",
    "usage_queries_per_minute",
    "limits_unavailable",
    // Request shape.
    "path_too_long",
    "batch_invalid",
    // Async batch status and result reads (gateway/src/batch.rs `reason_of`).
    "batch_limit",
    "batch_not_found",
    "batch_unavailable",
];

/// The `phase` label of `tessera_aborts_total`.
const ABORT_PHASES: [&str; 2] = ["prefill", "decode"];

/// How a refusal's reason label is also counted.
fn refusal_class(reason: &str) -> Option<bool> {
    match reason {
        // true: a rate limit or quota.
        "requests_per_minute"
        | "input_tokens_per_minute"
        | "output_tokens_per_minute"
        | "max_concurrent"
        | "daily_tokens"
        | "usage_queries_per_minute" => Some(true),
        // false: an authentication or authorization failure.
        "missing_key" | "malformed_key" | "invalid_key" | "revoked_key" | "expired_key"
        | "tenant_suspended" | "wrong_account" | "scope" | "admin_auth" => Some(false),
        _ => None,
    }
}

/// Process-wide gateway metrics and their registry.
pub struct Metrics {
    registry: Registry,
    models: Vec<String>,
    tenants: TopTenants,
    requests: Family<RequestLabels, Counter>,
    tokens: Family<TokenLabels, Counter>,
    duration: Histograms<ModelLabels>,
    ttft: Histograms<ModelLabels>,
    tpot: Family<ModelLabels, Histogram, fn() -> Histogram>,
    aborts: Family<AbortLabels, Counter>,
    abort_ack: Histogram,
    refused: Family<ReasonLabels, Counter>,
    rate_limited: Family<LimitLabels, Counter>,
    auth_failures: Family<ReasonLabels, Counter>,
    serve_errors: Family<KindLabels, Counter>,
    conn_timeouts: Family<PhaseLabels, Counter>,
    connections_open: Gauge,
    connections_total: Counter,
    accept_errors: Counter,
    pruned_rows: Counter,
    release_timeouts: Counter,
    lora_loads: Family<OutcomeLabels, Counter>,
    lora_evictions: Counter,
    lora_loaded: Gauge,
    lora_loaded_bytes: Gauge,
    batch_items: Family<OutcomeLabels, Counter>,
    config_reloads: Family<OutcomeLabels, Counter>,
    limits_up: Gauge,
    limits_errors: Counter,
    limits_fallbacks: Counter,
    inflight: Gauge,
    kv_free_pages: Gauge,
    kv_capacity_pages: Gauge,
    engine_running: Gauge,
    engine_waiting: Gauge,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new(&[], DEFAULT_TOP_TENANTS)
    }
}

impl Metrics {
    /// Metrics for a gateway serving `models` (the catalog ids the model label may
    /// take), labelling the top `top_tenants` tenants.
    pub fn new(models: &[&str], top_tenants: usize) -> Self {
        let m = Self {
            registry: Registry::default(),
            models: models.iter().map(|s| s.to_string()).collect(),
            tenants: TopTenants::new(top_tenants),
            requests: Family::default(),
            tokens: Family::default(),
            duration: Family::new_with_constructor(latency_histogram),
            ttft: Family::new_with_constructor(latency_histogram),
            tpot: Family::new_with_constructor(tpot_histogram),
            aborts: Family::default(),
            abort_ack: Histogram::new(ACK_BUCKETS_S),
            refused: Family::default(),
            rate_limited: Family::default(),
            auth_failures: Family::default(),
            serve_errors: Family::default(),
            conn_timeouts: Family::default(),
            connections_open: Gauge::default(),
            connections_total: Counter::default(),
            accept_errors: Counter::default(),
            pruned_rows: Counter::default(),
            release_timeouts: Counter::default(),
            lora_loads: Family::default(),
            lora_evictions: Counter::default(),
            lora_loaded: Gauge::default(),
            lora_loaded_bytes: Gauge::default(),
            batch_items: Family::default(),
            config_reloads: Family::default(),
            limits_up: Gauge::default(),
            limits_errors: Counter::default(),
            limits_fallbacks: Counter::default(),
            inflight: Gauge::default(),
            kv_free_pages: Gauge::default(),
            kv_capacity_pages: Gauge::default(),
            engine_running: Gauge::default(),
            engine_waiting: Gauge::default(),
        };
        m.zero_known_labels();
        m.register()
    }

    /// Creates at 0 every series of a labelled family whose label values are known
    /// in advance (aborts, refusals, rate limits, auth failures).
    fn zero_known_labels(&self) {
        for phase in ABORT_PHASES {
            for r in AbortReason::ALL {
                let _ = self.aborts.get_or_create(&AbortLabels {
                    phase,
                    reason: r.label(),
                });
            }
        }
        for &reason in REFUSAL_REASONS {
            let _ = self.refused.get_or_create(&ReasonLabels {
                reason: reason.into(),
            });
            match refusal_class(reason) {
                Some(true) => {
                    let _ = self.rate_limited.get_or_create(&LimitLabels {
                        limit: reason.into(),
                    });
                }
                Some(false) => {
                    let _ = self.auth_failures.get_or_create(&ReasonLabels {
                        reason: reason.into(),
                    });
                }
                None => {}
            }
        }
    }

    fn register(mut self) -> Self {
        let r = &mut self.registry;
        r.register(
            "tessera_requests",
            "Inference requests that wrote a usage row, by model, API, HTTP status, Workers AI code and tenant (top N, else other)",
            self.requests.clone(),
        );
        r.register(
            "tessera_tokens",
            "Prompt (input) and generated (output) tokens charged, by model and tenant (top N, else other)",
            self.tokens.clone(),
        );
        r.register(
            "tessera_request_duration_seconds",
            "Request duration in the gateway, arrival to usage row",
            self.duration.clone(),
        );
        r.register(
            "tessera_ttft_seconds",
            "Time to first token (arrival to first token)",
            self.ttft.clone(),
        );
        r.register(
            "tessera_tpot_seconds",
            "Mean time per output token after the first (engine)",
            self.tpot.clone(),
        );
        r.register(
            "tessera_aborts",
            "Requests aborted, by phase (prefill: before the first token, decode: after) and reason",
            self.aborts.clone(),
        );
        r.register(
            "tessera_abort_ack_seconds",
            "Time from an abort to the release confirmed by every node (I6)",
            self.abort_ack.clone(),
        );
        r.register(
            "tessera_refused",
            "Requests refused before admission (no usage row), by reason",
            self.refused.clone(),
        );
        r.register(
            "tessera_rate_limited",
            "Requests refused by a per-tenant limit or quota, by limit",
            self.rate_limited.clone(),
        );
        r.register(
            "tessera_auth_failures",
            "Requests refused by authentication or authorization, by reason",
            self.auth_failures.clone(),
        );
        r.register(
            "tessera_serve_errors",
            "Admitted requests that serving failed, by error kind (integrity: a KV tag or checksum mismatch; any is an incident)",
            self.serve_errors.clone(),
        );
        r.register(
            "tessera_connection_timeouts",
            "Connections closed by a timeout, by phase (header, tls, idle)",
            self.conn_timeouts.clone(),
        );
        r.register(
            "tessera_connections",
            "Connections accepted",
            self.connections_total.clone(),
        );
        r.register(
            "tessera_accept_errors",
            "Failed accepts (the accept loop backs off on resource errors)",
            self.accept_errors.clone(),
        );
        r.register(
            "tessera_usage_rows_pruned",
            "Ledger rows deleted by the retention prune",
            self.pruned_rows.clone(),
        );
        r.register(
            "tessera_release_wait_timeouts",
            "Requests whose nodes did not confirm release (abort or end acknowledged by every node) within the bound",
            self.release_timeouts.clone(),
        );
        r.register(
            "tessera_lora_loads",
            "Fine-tune adapters loaded from the store for serving, by outcome: loaded, failed (a stored file that does not load)",
            self.lora_loads.clone(),
        );
        r.register(
            "tessera_lora_evictions",
            "Loaded adapters dropped for another (the least recently used, past 16)",
            self.lora_evictions.clone(),
        );
        r.register(
            "tessera_lora_loaded",
            "Adapters loaded for serving on this gateway",
            self.lora_loaded.clone(),
        );
        r.register(
            "tessera_lora_loaded_bytes",
            "Bytes the loaded adapters hold (f16 weights and the files kept for node links)",
            self.lora_loaded_bytes.clone(),
        );
        r.register(
            "tessera_batch_items",
            "Async batch items (queueRequest=true) by outcome: queued, succeeded, failed",
            self.batch_items.clone(),
        );
        r.register(
            "tessera_config_reloads",
            "Re-reads of the deployment file (SIGHUP, POST /admin/v1/reload) by outcome: applied, refused (the old membership kept serving)",
            self.config_reloads.clone(),
        );
        r.register(
            "tessera_limits_backend_up",
            "1 when the limits store answers (always with in-memory limits; with --limits redis://..., a PING at scrape time), else 0",
            self.limits_up.clone(),
        );
        r.register(
            "tessera_limits_backend_errors",
            "Calls to the shared limits store (Redis) that failed or timed out",
            self.limits_errors.clone(),
        );
        r.register(
            "tessera_limits_fallbacks",
            "Requests admitted under this gateway's own limits because the shared store failed (--limits-on-failure open)",
            self.limits_fallbacks.clone(),
        );
        r.register(
            "tessera_inflight_requests",
            "Admitted requests not yet finished",
            self.inflight.clone(),
        );
        r.register(
            "tessera_connections_open",
            "Client connections open now",
            self.connections_open.clone(),
        );
        r.register(
            "tessera_kv_free_pages",
            "Free KV pages (every engine of this process, or none for remote nodes)",
            self.kv_free_pages.clone(),
        );
        r.register(
            "tessera_kv_capacity_pages",
            "KV pool size in pages (every engine of this process)",
            self.kv_capacity_pages.clone(),
        );
        r.register(
            "tessera_engine_running",
            "Sequences in the running batch (remote nodes: requests outstanding on decode nodes)",
            self.engine_running.clone(),
        );
        r.register(
            "tessera_engine_waiting",
            "Sequences waiting for pages or a batch slot",
            self.engine_waiting.clone(),
        );
        self
    }

    fn model_label(&self, model: &str) -> String {
        if self.models.iter().any(|m| m == model) {
            model.to_string()
        } else {
            UNKNOWN_MODEL.to_string()
        }
    }

    /// Counts one finished request (its usage row): requests, tokens, duration and
    /// time to first token.
    pub fn observe(&self, r: &UsageRecord) {
        let model = self.model_label(&r.model);
        let tenant = self.tenants.label(&r.tenant_id);
        self.requests
            .get_or_create(&RequestLabels {
                model: model.clone(),
                api: r.endpoint.clone(),
                status: r.status,
                code: r.error_code,
                tenant: tenant.clone(),
            })
            .inc();
        for (direction, n) in [("input", r.input_tokens), ("output", r.output_tokens)] {
            self.tokens
                .get_or_create(&TokenLabels {
                    model: model.clone(),
                    direction,
                    tenant: tenant.clone(),
                })
                .inc_by(n.max(0) as u64);
        }
        let labels = ModelLabels { model };
        self.duration
            .get_or_create(&labels)
            .observe(r.duration_us.max(0) as f64 / 1e6);
        if r.output_tokens > 0 {
            self.ttft
                .get_or_create(&labels)
                .observe(r.ttft_us.max(0) as f64 / 1e6);
        }
    }

    /// A completed request's mean time per output token (only with at least two).
    pub fn tpot(&self, model: &str, tpot: Duration) {
        self.tpot
            .get_or_create(&ModelLabels {
                model: self.model_label(model),
            })
            .observe(tpot.as_secs_f64());
    }

    /// An abort: `decoding` when a token had been generated, the reason, and how long
    /// the nodes took to confirm the release (`None`: not within the bound).
    pub fn abort(&self, decoding: bool, reason: AbortReason, ack: Option<Duration>) {
        let phase = ABORT_PHASES[usize::from(decoding)];
        self.aborts
            .get_or_create(&AbortLabels {
                phase,
                reason: reason.label(),
            })
            .inc();
        if let Some(d) = ack {
            self.abort_ack.observe(d.as_secs_f64());
        }
    }

    /// A serving failure of kind `kind` ([`tessera_serving::ServeErrorKind::label`]).
    pub fn serve_error(&self, kind: &'static str) {
        self.serve_errors.get_or_create(&KindLabels { kind }).inc();
    }

    /// The limits store's state at scrape time: whether it answers, and the
    /// limiter's running totals of store errors and fail-open fallbacks.
    pub fn set_limits(&self, up: bool, errors: u64, fallbacks: u64) {
        self.limits_up.set(i64::from(up));
        for (c, total) in [
            (&self.limits_errors, errors),
            (&self.limits_fallbacks, fallbacks),
        ] {
            let seen = c.get();
            if total > seen {
                c.inc_by(total - seen);
            }
        }
    }

    /// Counts one reload of the deployment file by `outcome` (`applied`, `refused`).
    pub fn config_reload(&self, outcome: &'static str) {
        self.config_reloads
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// Reloads of the deployment file so far with `outcome`.
    pub fn config_reload_count(&self, outcome: &'static str) -> u64 {
        self.config_reloads
            .get(&OutcomeLabels { outcome })
            .map_or(0, |c| c.get())
    }

    /// Counts `n` async batch items that reached `outcome` (`queued` when the batch
    /// was taken, then `succeeded` or `failed` each).
    pub fn batch_items(&self, outcome: &'static str, n: usize) {
        self.batch_items
            .get_or_create(&OutcomeLabels { outcome })
            .inc_by(n as u64);
    }

    /// Counts an adapter load from the store (`outcome`: `loaded` or `failed`).
    /// Fine-tunes are never a label: their ids and names are their tenants'.
    pub fn lora_load(&self, outcome: &'static str) {
        self.lora_loads
            .get_or_create(&OutcomeLabels { outcome })
            .inc();
    }

    /// The loaded adapters after a load: how many, the bytes they hold, and how many
    /// went to make room.
    pub fn lora_cache(&self, loaded: usize, bytes: usize, evicted: usize) {
        self.lora_loaded.set(loaded as i64);
        self.lora_loaded_bytes.set(bytes as i64);
        self.lora_evictions.inc_by(evicted as u64);
    }

    /// Counts a request whose nodes did not confirm its release within the bound (its
    /// permits and usage row went ahead without the confirmation).
    pub fn release_timeout(&self) {
        self.release_timeouts.inc();
    }

    /// Counts a request refused before admission; `reason` is a fixed label
    /// (`missing_key`, `wrong_account`, `scope`, `path_too_long`, a limit's label, ...).
    /// Limits and quotas also count in `tessera_rate_limited_total{limit}`,
    /// authentication and authorization failures in `tessera_auth_failures_total`.
    pub fn refused(&self, reason: &'static str) {
        self.refused
            .get_or_create(&ReasonLabels {
                reason: reason.into(),
            })
            .inc();
        match refusal_class(reason) {
            Some(true) => self
                .rate_limited
                .get_or_create(&LimitLabels {
                    limit: reason.into(),
                })
                .inc(),
            Some(false) => self
                .auth_failures
                .get_or_create(&ReasonLabels {
                    reason: reason.into(),
                })
                .inc(),
            None => 0,
        };
    }

    /// Refusals so far for `reason`.
    pub fn refused_count(&self, reason: &str) -> u64 {
        self.refused
            .get(&ReasonLabels {
                reason: reason.into(),
            })
            .map_or(0, |c| c.get())
    }

    /// Counts a connection closed by a timeout in `phase` (`header`, `tls`, `idle`).
    pub fn connection_timeout(&self, phase: &'static str) {
        self.conn_timeouts
            .get_or_create(&PhaseLabels { phase })
            .inc();
    }

    /// A connection was accepted (`open`) or closed.
    pub fn connection(&self, open: bool) {
        if open {
            self.connections_open.inc();
            self.connections_total.inc();
        } else {
            self.connections_open.dec();
        }
    }

    /// Connections open now.
    pub fn connections_open(&self) -> u64 {
        self.connections_open.get().max(0) as u64
    }

    /// `accept` failed (e.g. out of file descriptors).
    pub fn accept_error(&self) {
        self.accept_errors.inc();
    }

    /// Ledger rows deleted by the retention prune.
    pub fn pruned(&self, rows: u64) {
        self.pruned_rows.inc_by(rows);
    }

    /// The OpenMetrics text exposition: the gateway's metrics with `engine`'s counters
    /// and `inflight`, then `nodes` (in-process engines), then `# EOF`.
    pub fn render_with(
        &self,
        engine: EngineStats,
        inflight: usize,
        nodes: Option<&NodeMetrics>,
    ) -> String {
        self.inflight.set(inflight as i64);
        self.kv_free_pages.set(engine.free_pages as i64);
        self.kv_capacity_pages.set(engine.capacity_pages as i64);
        self.engine_running.set(engine.running as i64);
        self.engine_waiting.set(engine.waiting as i64);
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode_registry(&mut out, &self.registry);
        if let Some(n) = nodes {
            let _ = n.encode(&mut out);
        }
        let _ = prometheus_client::encoding::text::encode_eof(&mut out);
        out
    }

    /// [`Self::render_with`] without node metrics.
    pub fn render(&self, engine: EngineStats, inflight: usize) -> String {
        self.render_with(engine, inflight, None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_tenancy::{AuthError, LimitKind};

    /// prometheus-client appends a period to every help text: one of ours that ends
    /// in a period read `..` in every scrape (issue 32 review).
    #[test]
    fn help_lines_end_in_one_period() {
        let m = Metrics::new(&["m"], 20);
        let text = m.render_with(
            EngineStats::default(),
            0,
            Some(&tessera_serving::NodeMetrics::new()),
        );
        let help: Vec<&str> = text.lines().filter(|l| l.starts_with("# HELP")).collect();
        assert!(help.len() > 10, "{text}");
        for l in help {
            assert!(l.ends_with('.') && !l.ends_with(".."), "{l}");
        }
    }

    #[test]
    fn the_top_n_tenants_get_labels_and_the_rest_are_other() {
        let t = TopTenants::new(2);
        assert_eq!(t.label("a"), "a");
        assert_eq!(t.label("b"), "b");
        // A third tenant with as many requests as the smallest stays `other`.
        assert_eq!(t.label("c"), OTHER_TENANT);
        // a: 2, b: 1, c: 2 -> c overtakes b.
        assert_eq!(t.label("a"), "a");
        assert_eq!(t.label("c"), "c");
        assert_eq!(t.label("b"), OTHER_TENANT);
        assert_eq!(TopTenants::new(0).label("a"), OTHER_TENANT);
    }

    #[test]
    fn every_limit_counts_as_rate_limited_and_auth_reasons_as_auth_failures() {
        for k in [
            LimitKind::Requests,
            LimitKind::InputTokens,
            LimitKind::OutputTokens,
            LimitKind::Concurrency,
            LimitKind::DailyQuota,
            LimitKind::UsageQueries,
            LimitKind::Unavailable,
        ] {
            assert!(REFUSAL_REASONS.contains(&k.label()), "{k:?}");
            if k != LimitKind::Unavailable {
                assert_eq!(refusal_class(k.label()), Some(true), "{k:?}");
            }
        }
        for e in [
            AuthError::Missing,
            AuthError::Malformed,
            AuthError::Invalid,
            AuthError::Revoked,
            AuthError::Expired,
            AuthError::Suspended("t".into()),
        ] {
            assert!(REFUSAL_REASONS.contains(&e.label()), "{e:?}");
            assert_eq!(refusal_class(e.label()), Some(false), "{e:?}");
        }
        let m = Metrics::new(&["m"], 20);
        m.refused("invalid_key");
        m.refused("requests_per_minute");
        m.refused("path_too_long");
        let text = m.render(EngineStats::default(), 0);
        for line in [
            r#"tessera_auth_failures_total{reason="invalid_key"} 1"#,
            r#"tessera_rate_limited_total{limit="requests_per_minute"} 1"#,
            r#"tessera_refused_total{reason="path_too_long"} 1"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
        }
        assert!(!text.contains(r#"tessera_auth_failures_total{reason="path_too_long"}"#));
        assert!(!text.contains(r#"tessera_rate_limited_total{limit="invalid_key"}"#));
    }

    #[test]
    fn a_model_outside_the_catalog_is_unknown() {
        let m = Metrics::new(&["@cf/x"], 20);
        let row = |model: &str| UsageRecord {
            model: model.into(),
            endpoint: "workers_ai.run".into(),
            status: 200,
            tenant_id: "t1".into(),
            input_tokens: 3,
            output_tokens: 2,
            ..UsageRecord::default()
        };
        m.observe(&row("@cf/x"));
        m.observe(&row("@cf/attacker-chosen-string"));
        let text = m.render(EngineStats::default(), 0);
        assert!(text.contains(r#"tessera_requests_total{model="@cf/x",api="workers_ai.run",status="200",code="0",tenant="t1"} 1"#), "{text}");
        assert!(text.contains(r#"tessera_requests_total{model="unknown",api="workers_ai.run",status="200",code="0",tenant="t1"} 1"#), "{text}");
        assert!(!text.contains("attacker"), "{text}");
    }
}
