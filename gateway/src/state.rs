//! The gateway's state and settings: [`AppState`] (one per process) with its
//! in-flight count and guard, the per-request context [`Ctx`], the configuration
//! ([`GatewayOptions`], [`Deadlines`], [`UsageConfig`], [`ConnLimits`]), the store of
//! async batches ([`Batches`], run by `batch`) and the length limit on ids. Every
//! other module takes these from here; this one imports neither the server nor the
//! batch module (no import circle).

use crate::catalog::{Catalog, CatalogEntry};
use crate::error::{ApiError, Flavor};
use crate::live::Live;
use crate::tls::TlsMode;
use axum::http::HeaderValue;
use axum::response::Response;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_model::LoadedModel;
use tessera_serving::EngineHandle;
use tessera_tenancy::{now_ms, Limiter, Limits, Store, UsageRecord};
use tokio::sync::{watch, Notify};

/// Re-reads the deployment file of `tessera serve --config` and applies what can
/// change without a restart (node membership): `POST /admin/v1/reload`, SIGHUP.
/// Implemented by the binary, which owns the file; the gateway counts and logs.
pub trait Reload: Send + Sync {
    /// Re-reads the file and applies it, or refuses it as a whole (the old
    /// membership keeps serving). Blocks while new nodes are connected and checked.
    ///
    /// Ok: what changed (JSON for the caller). Err: why the file was refused.
    fn reload(&self) -> Result<serde_json::Value, String>;

    /// Every node of the deployment now, with its state (`GET /admin/v1/nodes`).
    fn nodes(&self) -> serde_json::Value;
}

/// Longest accepted path segment, and longest model id, in bytes (longer ones are
/// refused before any store access).
pub const MAX_ID_BYTES: usize = 256;

/// Request deadlines (see the README's table of timeouts).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadlines {
    /// Time allowed to receive the whole request body (408, 3007).
    pub body_read: Duration,
    /// Time from arrival to the first generated token (then abort: 408, 3007).
    pub first_token: Duration,
    /// Time from arrival to the end of the answer (then abort: 408, 3007).
    pub total: Duration,
}

impl Default for Deadlines {
    fn default() -> Self {
        Self {
            body_read: Duration::from_secs(30),
            first_token: Duration::from_secs(120),
            total: Duration::from_secs(600),
        }
    }
}

/// The usage API's own limits and the ledger's retention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct UsageConfig {
    /// Usage-API queries per tenant per minute (0: unlimited).
    pub queries_per_minute: u32,
    /// Longest `since..until` range one query may cover; an absent `since` is
    /// `until` minus this.
    pub max_range: Duration,
    /// Ledger rows older than this are deleted (`None`: kept forever).
    pub retention: Option<Duration>,
    /// How often the retention prune runs.
    pub prune_interval: Duration,
}

impl Default for UsageConfig {
    fn default() -> Self {
        Self {
            queries_per_minute: 60,
            max_range: Duration::from_secs(31 * 86_400),
            retention: Some(Duration::from_secs(90 * 86_400)),
            prune_interval: Duration::from_secs(3600),
        }
    }
}

/// Connection-level limits (see the [`listener`](crate::listener) module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimits {
    /// Time allowed for a request head (request line and headers).
    pub header_read: Duration,
    /// Time allowed for the TLS handshake.
    pub tls_handshake: Duration,
    /// Idle time (no request in flight, no bytes either way) before a kept-alive
    /// connection is closed.
    pub keepalive_idle: Duration,
    /// Most connections open at once, per listener.
    pub max_connections: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        Self {
            header_read: Duration::from_secs(10),
            tls_handshake: Duration::from_secs(10),
            keepalive_idle: Duration::from_secs(5),
            max_connections: 1024,
        }
    }
}

/// The gateway server's runtime options (`tessera serve` builds them from its
/// command line; the deployment file's `[gateway]` section is
/// `tessera_config::GatewaySection`).
#[derive(Clone, Debug)]
pub struct GatewayOptions {
    /// Address to listen on (port 0 picks a free port).
    pub listen: SocketAddr,
    /// Serve the admin API and `/metrics` on this address instead (then the public
    /// listener answers 404 there). Same TLS mode and plain-HTTP rule as `listen`.
    pub admin_listen: Option<SocketAddr>,
    /// TLS mode.
    pub tls: TlsMode,
    /// Serve plain HTTP on a non-loopback address (off: refuse to start).
    pub allow_insecure_http: bool,
    /// Largest accepted request body in bytes.
    pub max_body_bytes: usize,
    /// Largest accepted LoRA adapter file (`ai/finetunes` uploads), in bytes.
    pub max_finetune_bytes: usize,
    /// Bearer token of the admin API (at least [`crate::admin::MIN_TOKEN_BYTES`]
    /// bytes, else [`Server::bind`](crate::Server::bind) refuses); `None` disables the admin API.
    pub admin_token: Option<String>,
    /// Bearer token that reads `/metrics` and nothing else (same rules). Both tokens
    /// are used without surrounding whitespace.
    pub metrics_token: Option<String>,
    /// Limits of tenants created through the admin API without (all) limits.
    pub default_limits: Limits,
    /// Connection limits (header, TLS and idle timeouts, connection cap).
    pub conn: ConnLimits,
    /// Request deadlines.
    pub deadlines: Deadlines,
    /// Usage API limits and ledger retention.
    pub usage: UsageConfig,
    /// How often the keys of requests in flight are checked for revocation,
    /// expiry and suspension made elsewhere (the admin API's own changes act at once).
    pub revocation_poll: Duration,
    /// On shutdown, how long running requests may finish before they are aborted
    /// (their usage rows are still written).
    pub drain_timeout: Duration,
    /// Tenants with their own `tenant` label in the metrics (the top N by requests;
    /// the rest are `other`).
    pub metrics_top_tenants: usize,
    /// Put the prompt and the output text in each request's log line (debugging
    /// only: off by default, the line carries counts and ids, never text or keys).
    pub log_request_text: bool,
    /// A tenant asking for a private model it may not use gets the same 404 (Workers
    /// AI 5007) as for an unknown model, so private ids cannot be probed; off: 403
    /// with Workers AI code 5018 naming the model.
    pub private_models_as_404: bool,
    /// How long a finished async batch's results (`queueRequest=true`) are kept.
    pub batch_retention: Duration,
    /// Keep rate limits, concurrency and the daily quota in Redis, shared with every
    /// gateway on the same server (`None`: in this process's memory).
    pub shared_limits: Option<tessera_tenancy::limits::SharedLimits>,
}

impl Default for GatewayOptions {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8787)),
            admin_listen: None,
            tls: TlsMode::Off,
            allow_insecure_http: false,
            max_body_bytes: 1 << 20,
            max_finetune_bytes: DEFAULT_MAX_FINETUNE_BYTES,
            admin_token: None,
            metrics_token: None,
            default_limits: Limits::NEW_TENANT,
            conn: ConnLimits::default(),
            deadlines: Deadlines::default(),
            usage: UsageConfig::default(),
            revocation_poll: Duration::from_millis(250),
            drain_timeout: Duration::from_secs(30),
            metrics_top_tenants: crate::metrics::DEFAULT_TOP_TENANTS,
            log_request_text: false,
            batch_retention: DEFAULT_BATCH_RETENTION,
            shared_limits: None,
            private_models_as_404: false,
        }
    }
}

/// One model this gateway serves: its catalog entry, the loaded file (tokenizer,
/// chat template, limits) and the engines (a cluster of prefill and decode nodes, or
/// one co-located engine) that serve it and no other model.
#[derive(Clone)]
pub struct ServedModel {
    /// Catalog entry (id, metadata).
    pub entry: CatalogEntry,
    /// The model file as loaded (tokenizer, chat template, hyperparameters).
    pub model: LoadedModel,
    /// The engines serving it: requests for this model go here and nowhere else.
    pub engine: EngineHandle,
}

impl ServedModel {
    /// Model `id` served by `engine`; the catalog entry's context window is the
    /// engine's, its parameters, quantization and chat template the file's.
    pub fn new(id: &str, model: LoadedModel, engine: EngineHandle) -> Self {
        let entry = CatalogEntry::new(id, engine.limits().context).with_file(&model.info);
        Self::with_entry(entry, model, engine)
    }

    /// A model with a catalog entry of its own (deployment-file metadata).
    pub fn with_entry(entry: CatalogEntry, model: LoadedModel, engine: EngineHandle) -> Self {
        Self {
            entry,
            model,
            engine,
        }
    }
}

/// Everything a request needs; one per process, shared by `Arc`.
pub struct AppState {
    /// Tenancy store.
    pub store: Store,
    /// The first served model's engines (see [`AppState::models`] for every model).
    pub engine: EngineHandle,
    /// The first served model's file (see [`AppState::models`]).
    pub model: LoadedModel,
    /// Served models, each with its own engines, in catalog order.
    pub models: Vec<ServedModel>,
    /// Served models' catalog (ids, aliases, metadata).
    pub catalog: Catalog,
    /// Per-tenant limits.
    pub limiter: Limiter,
    /// Admin API token.
    pub admin_token: Option<String>,
    /// Metrics-only token.
    pub metrics_token: Option<String>,
    /// Limits of new tenants.
    pub default_limits: Limits,
    /// Body size limit.
    pub max_body_bytes: usize,
    /// Largest accepted LoRA adapter file, in bytes.
    pub max_finetune_bytes: usize,
    /// Fine-tune uploads being read and checked (each holds its file in memory).
    pub(crate) finetune_uploads: Arc<tokio::sync::Semaphore>,
    /// Adapters loaded for serving.
    pub(crate) loras: crate::lora_cache::LoadedLoras,
    /// Accounts with a fine-tune upload in progress (one each).
    pub(crate) finetune_uploading: crate::lora_cache::Uploading,
    /// Request deadlines.
    pub deadlines: Deadlines,
    /// Usage API limits and retention.
    pub usage: UsageConfig,
    /// Drain deadline on shutdown.
    pub drain_timeout: Duration,
    /// Whether request log lines carry the prompt and output text.
    pub log_request_text: bool,
    /// Private models a tenant may not use answer 404 as unknown ones (else 403).
    pub private_models_as_404: bool,
    /// Prometheus metrics.
    pub metrics: crate::metrics::Metrics,
    /// Requests in flight by key (revocation and suspension abort them).
    pub(crate) live: Arc<Live>,
    pub(crate) revocation_poll: Duration,
    /// Async batches (`queueRequest=true`), by request id.
    pub(crate) batches: Batches,
    /// Recent integrity events (the operator view), sampled from the counters.
    pub(crate) integrity: crate::integrity_log::IntegrityLog,
    /// The bounded pool on which CPU-heavy request steps run (parsing, templates,
    /// tokenizing, grammar compiles), off the async workers.
    pub(crate) cpu: crate::cpu::CpuPool,
    /// Set to true to abort every running request (shutdown after the drain deadline).
    abort_all: watch::Sender<bool>,
    /// Requests whose driver has not yet written the usage row.
    inflight: AtomicUsize,
    idle: Notify,
    /// The deployment file's reloader (`tessera serve --config`), once set.
    reloader: std::sync::OnceLock<Arc<dyn Reload>>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState").finish_non_exhaustive()
    }
}

impl AppState {
    /// State for one model (the default model's id) served by `engine`.
    pub fn new(
        store: Store,
        model: LoadedModel,
        engine: EngineHandle,
        cfg: &GatewayOptions,
    ) -> Arc<Self> {
        let served = ServedModel::new(tessera_model::gguf::DEFAULT_MODEL_ID, model, engine);
        Self::with_models(store, vec![served], cfg).expect("one model is a valid catalog")
    }

    /// State for `models`, each served by its own engines; a request is routed by
    /// its model id (or an alias) to that model's engines only.
    ///
    /// Errors: no models, two entries sharing an id or alias (the message names it),
    /// or an unusable `shared_limits` (a URL that does not parse).
    pub fn with_models(
        store: Store,
        models: Vec<ServedModel>,
        cfg: &GatewayOptions,
    ) -> Result<Arc<Self>, String> {
        let catalog = Catalog::new(models.iter().map(|m| m.entry.clone()).collect())?;
        let first = models.first().ok_or("a gateway needs at least one model")?;
        let ids: Vec<&str> = models.iter().map(|m| m.entry.id.as_str()).collect();
        let limiter = match &cfg.shared_limits {
            Some(c) => Limiter::shared(c.clone()).map_err(|e| e.to_string())?,
            None => Limiter::new(),
        };
        Ok(Arc::new(Self {
            store,
            engine: first.engine.clone(),
            model: first.model.clone(),
            catalog,
            limiter,
            // Compared without surrounding whitespace, as `check_token` measured them
            // (a token with a trailing newline or spaces must still match).
            admin_token: cfg.admin_token.as_deref().map(|t| t.trim().to_string()),
            metrics_token: cfg.metrics_token.as_deref().map(|t| t.trim().to_string()),
            default_limits: cfg.default_limits,
            max_body_bytes: cfg.max_body_bytes,
            max_finetune_bytes: cfg.max_finetune_bytes,
            finetune_uploads: Arc::new(tokio::sync::Semaphore::new(crate::lora_cache::MAX_UPLOADS)),
            loras: Default::default(),
            finetune_uploading: Default::default(),
            deadlines: cfg.deadlines,
            usage: cfg.usage,
            drain_timeout: cfg.drain_timeout,
            log_request_text: cfg.log_request_text,
            private_models_as_404: cfg.private_models_as_404,
            metrics: crate::metrics::Metrics::new(&ids, cfg.metrics_top_tenants),
            live: Arc::new(Live::default()),
            revocation_poll: cfg.revocation_poll,
            batches: Batches::new(cfg.batch_retention),
            integrity: crate::integrity_log::IntegrityLog::default(),
            cpu: crate::cpu::CpuPool::from_cores(),
            abort_all: watch::channel(false).0,
            inflight: AtomicUsize::new(0),
            idle: Notify::new(),
            reloader: std::sync::OnceLock::new(),
            models,
        }))
    }

    /// Makes `r` this gateway's deployment-file reloader (once; later calls are
    /// ignored).
    pub fn set_reloader(&self, r: Arc<dyn Reload>) {
        let _ = self.reloader.set(r);
    }

    /// The reloader, if this gateway serves a deployment file.
    pub fn reloader(&self) -> Option<Arc<dyn Reload>> {
        self.reloader.get().cloned()
    }

    /// Re-reads the deployment file and applies it ([`Reload::reload`]), counting
    /// the outcome in `tessera_config_reloads_total{outcome}` (`applied`,
    /// `refused`) and logging it; `why` names the trigger (`SIGHUP`, `admin API`).
    /// Blocks: call it off the async workers (`spawn_blocking`).
    ///
    /// Errors: no deployment file, or why the file was refused (nothing changed).
    pub fn reload_deployment(&self, why: &str) -> Result<serde_json::Value, String> {
        let Some(r) = self.reloader() else {
            return Err(
                "this gateway serves no deployment file (start it with --config FILE)".into(),
            );
        };
        match r.reload() {
            Ok(v) => {
                self.metrics.config_reload("applied");
                tracing::warn!(trigger = why, changes = %v, "reloaded the deployment file");
                Ok(v)
            }
            Err(e) => {
                self.metrics.config_reload("refused");
                tracing::error!(trigger = why, error = %e, "refused the reloaded deployment file; serving on with the old membership");
                Err(e)
            }
        }
    }

    /// The served model a request for `id` (a catalog id or alias, any case) goes to.
    pub fn served(&self, id: &str) -> Option<&ServedModel> {
        self.served_entry(self.catalog.get(id)?)
    }

    /// The served model of the catalog entry `entry` (already resolved).
    pub fn served_entry(&self, entry: &CatalogEntry) -> Option<&ServedModel> {
        self.models.iter().find(|m| m.entry.id == entry.id)
    }

    /// Counters summed over every model's engines.
    pub fn engine_stats(&self) -> tessera_serving::EngineStats {
        self.models
            .iter()
            .map(|m| m.engine.stats())
            .fold(Default::default(), tessera_serving::EngineStats::sum)
    }

    /// Requests in flight (admitted, usage row not yet written).
    pub fn inflight(&self) -> usize {
        self.inflight.load(Ordering::Acquire)
    }

    /// A receiver that turns true when running requests must abort.
    pub(crate) fn abort_signal(&self) -> watch::Receiver<bool> {
        self.abort_all.subscribe()
    }

    /// Counts a request in flight until the guard drops.
    pub(crate) fn inflight_guard(self: &Arc<Self>) -> InflightGuard {
        self.inflight.fetch_add(1, Ordering::AcqRel);
        InflightGuard(self.clone())
    }

    /// Waits until no request is in flight, or `timeout` passes; returns whether idle.
    pub async fn wait_idle(&self, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.idle.notified();
            if self.inflight() == 0 {
                return true;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.inflight() == 0;
            }
        }
    }

    /// Shutdown after the accept loop stopped: lets running requests finish for
    /// the drain timeout, then aborts the rest (each driver drops its engine
    /// receiver, so the engine frees the pages, and writes its usage row) and waits
    /// for their rows.
    pub async fn drain(&self) {
        self.batches.close();
        self.drain_requests().await;
        // The fleet's shared counters get every settle and release now rather than
        // when this gateway's leases lapse.
        self.limiter.flush().await;
    }

    async fn drain_requests(&self) {
        if self.wait_idle(self.drain_timeout).await {
            return;
        }
        tracing::warn!(
            inflight = self.inflight(),
            "drain deadline passed: aborting running requests"
        );
        let _ = self.abort_all.send(true);
        if !self.wait_idle(Duration::from_secs(10)).await {
            tracing::error!(
                inflight = self.inflight(),
                "requests still running after abort"
            );
        }
    }

    /// Writes a usage row (logged, not surfaced, if the store fails), counts it in
    /// the metrics and logs the request's line.
    pub(crate) async fn record(&self, r: &UsageRecord) {
        self.record_with_text(r, None).await
    }

    /// [`Self::record`]; `text` is the (prompt, output) the request's log line
    /// carries when `log_request_text` is on.
    pub(crate) async fn record_with_text(&self, r: &UsageRecord, text: Option<(&str, &str)>) {
        self.metrics.observe(r);
        crate::request_log::finished(r, text.filter(|_| self.log_request_text));
        match self.store.record_usage(r).await {
            Ok(true) => {}
            Ok(false) => tracing::error!(request_id = %r.request_id, "usage row already exists"),
            Err(e) => {
                tracing::error!(request_id = %r.request_id, error = %e, "cannot write usage row")
            }
        }
    }
}

/// Decrements the in-flight count on drop.
pub(crate) struct InflightGuard(Arc<AppState>);

impl Drop for InflightGuard {
    fn drop(&mut self) {
        if self.0.inflight.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// Per-request context: who, what, since when.
#[derive(Clone, Debug)]
pub(crate) struct Ctx {
    pub(crate) rid: String,
    pub(crate) started: Instant,
    pub(crate) created_ms: i64,
    pub(crate) endpoint: &'static str,
    pub(crate) flavor: Flavor,
    pub(crate) tenant_id: String,
    pub(crate) key_id: String,
    pub(crate) model: String,
    /// The prompt as text, only with `log_request_text` (the debug log line).
    pub(crate) prompt_text: Option<String>,
}

impl Ctx {
    pub(crate) fn new(endpoint: &'static str, flavor: Flavor) -> Self {
        Self {
            rid: tessera_tenancy::random_hex(16),
            started: Instant::now(),
            created_ms: now_ms(),
            endpoint,
            flavor,
            tenant_id: String::new(),
            key_id: String::new(),
            model: String::new(),
            prompt_text: None,
        }
    }

    pub(crate) fn usage(
        &self,
        status: u16,
        error_code: u32,
        finish: &str,
        input: usize,
        output: usize,
        ttft_us: i64,
    ) -> UsageRecord {
        UsageRecord {
            request_id: self.rid.clone(),
            tenant_id: self.tenant_id.clone(),
            key_id: self.key_id.clone(),
            model: self.model.clone(),
            endpoint: self.endpoint.into(),
            status,
            error_code,
            finish: finish.into(),
            input_tokens: input as i64,
            output_tokens: output as i64,
            cached_tokens: 0,
            cached_host_tokens: 0,
            cached_disk_tokens: 0,
            ttft_us,
            duration_us: self.started.elapsed().as_micros() as i64,
            created_ms: self.created_ms,
        }
    }

    /// Records the usage row of a request that failed with `e` after admission
    /// (nothing was computed: 0 tokens).
    pub(crate) async fn record_failure(&self, state: &AppState, e: &ApiError) {
        let row = self.usage(
            e.kind.status().as_u16(),
            e.kind.workers_code(),
            "error",
            0,
            0,
            0,
        );
        state.record(&row).await;
    }

    /// A refusal before admission: counted in the metrics by `reason`, rendered,
    /// and no usage row (anonymous and over-limit traffic writes nothing).
    pub(crate) fn refuse(&self, state: &AppState, reason: &'static str, e: ApiError) -> Response {
        state.metrics.refused(reason);
        e.into_response_as(self.flavor, &self.rid)
    }

    pub(crate) fn header(&self, mut r: Response) -> Response {
        if let Ok(v) = HeaderValue::from_str(&self.rid) {
            r.headers_mut().insert("x-request-id", v);
        }
        r
    }
}

/// Default cap on a LoRA adapter upload: 300 MB (Workers AI's).
pub const DEFAULT_MAX_FINETUNE_BYTES: usize = 300 << 20;

/// Default time a finished async batch's results are kept.
pub(crate) const DEFAULT_BATCH_RETENTION: Duration = Duration::from_secs(3600);

/// The gateway's async batches (`queueRequest=true`), by request id; `batch` runs
/// them and answers polls.
pub(crate) struct Batches {
    pub(crate) jobs: Mutex<HashMap<String, Arc<Job>>>,
    retention: Duration,
    /// Set when the server drains: items not yet started end as 503.
    closing: AtomicBool,
}

/// One batch.
pub(crate) struct Job {
    pub(crate) id: String,
    pub(crate) tenant_id: String,
    /// The catalog id of the model (aliases resolved).
    pub(crate) model: String,
    pub(crate) progress: Mutex<Progress>,
}

/// A batch's items so far.
#[derive(Default)]
pub(crate) struct Progress {
    pub(crate) started: usize,
    pub(crate) results: Vec<Option<serde_json::Value>>,
    pub(crate) prompt_tokens: u64,
    pub(crate) completion_tokens: u64,
    pub(crate) finished: Option<Instant>,
}

impl Batches {
    pub(crate) fn new(retention: Duration) -> Self {
        Self {
            jobs: Mutex::new(HashMap::new()),
            retention,
            closing: AtomicBool::new(false),
        }
    }

    /// Stops starting items (shutdown); items not yet started end as 503.
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::Release);
    }

    pub(crate) fn closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Drops finished batches older than the retention.
    pub(crate) fn sweep(&self, jobs: &mut HashMap<String, Arc<Job>>) {
        let keep = self.retention;
        jobs.retain(|_, j| {
            let p = j.progress.lock().expect("batch progress lock");
            p.finished.is_none_or(|t| t.elapsed() < keep)
        });
    }
}
