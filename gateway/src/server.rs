//! The HTTP server: state, routers, the request phases shared by every generation
//! endpoint, and the listeners (public, and optionally admin; plain HTTP on
//! loopback, or TLS by rustls; connection limits in [`crate::listener`]).

use crate::catalog::Catalog;
use crate::driver::{self, Msg};
use crate::error::{ApiError, ErrorKind, Flavor};
use crate::listener::ConnLimits;
use crate::live::Live;
use crate::tls::TlsMode;
use crate::validation::{self, ParsedRequest, Validated};
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::StreamExt;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_model::LoadedModel;
use tessera_serving::EngineHandle;
use tessera_tenancy::{
    now_ms, AuthError, LimitError, LimitKind, Limiter, Limits, Principal, Scope, Store, UsageRecord,
};
use tokio::net::TcpListener;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::{watch, Notify};
use tracing::Instrument;

/// The target of the request's trace spans.
const TRACE: &str = tessera_serving::telemetry::TARGET;

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

/// Server settings.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
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
    /// Bearer token of the admin API (at least [`crate::admin::MIN_TOKEN_BYTES`]
    /// bytes, else [`Server::bind`] refuses); `None` disables the admin API.
    pub admin_token: Option<String>,
    /// Bearer token that reads `/metrics` and nothing else (same length rule).
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
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8787)),
            admin_listen: None,
            tls: TlsMode::Off,
            allow_insecure_http: false,
            max_body_bytes: 1 << 20,
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
        }
    }
}

/// Everything a request needs; one per process, shared by `Arc`.
pub struct AppState {
    /// Tenancy store.
    pub store: Store,
    /// The engine.
    pub engine: EngineHandle,
    /// The model (tokenizer, chat template).
    pub model: LoadedModel,
    /// Served models.
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
    /// Request deadlines.
    pub deadlines: Deadlines,
    /// Usage API limits and retention.
    pub usage: UsageConfig,
    /// Drain deadline on shutdown.
    pub drain_timeout: Duration,
    /// Whether request log lines carry the prompt and output text.
    pub log_request_text: bool,
    /// Prometheus metrics.
    pub metrics: crate::metrics::Metrics,
    /// Requests in flight by key (revocation and suspension abort them).
    pub(crate) live: Arc<Live>,
    revocation_poll: Duration,
    /// Set to true to abort every running request (shutdown after the drain deadline).
    abort_all: watch::Sender<bool>,
    /// Requests whose driver has not yet written the usage row.
    inflight: AtomicUsize,
    idle: Notify,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState").finish_non_exhaustive()
    }
}

impl AppState {
    /// State for one model served by `engine`.
    pub fn new(
        store: Store,
        model: LoadedModel,
        engine: EngineHandle,
        cfg: &GatewayConfig,
    ) -> Arc<Self> {
        let context = engine.limits().context;
        Arc::new(Self {
            store,
            engine,
            model,
            catalog: Catalog::single(tessera_model::gguf::DEFAULT_MODEL_ID, context),
            limiter: Limiter::new(),
            admin_token: cfg.admin_token.clone(),
            metrics_token: cfg.metrics_token.clone(),
            default_limits: cfg.default_limits,
            max_body_bytes: cfg.max_body_bytes,
            deadlines: cfg.deadlines,
            usage: cfg.usage,
            drain_timeout: cfg.drain_timeout,
            log_request_text: cfg.log_request_text,
            metrics: crate::metrics::Metrics::new(
                &[tessera_model::gguf::DEFAULT_MODEL_ID],
                cfg.metrics_top_tenants,
            ),
            live: Arc::new(Live::default()),
            revocation_poll: cfg.revocation_poll,
            abort_all: watch::channel(false).0,
            inflight: AtomicUsize::new(0),
            idle: Notify::new(),
        })
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
            ttft_us,
            duration_us: self.started.elapsed().as_micros() as i64,
            created_ms: self.created_ms,
        }
    }

    /// Records the error's usage row (nothing was computed: 0 tokens) and renders it.
    pub(crate) async fn fail(&self, state: &AppState, e: ApiError) -> Response {
        let row = self.usage(
            e.kind.status().as_u16(),
            e.kind.workers_code(),
            "error",
            0,
            0,
            0,
        );
        state.record(&row).await;
        e.into_response_as(self.flavor, &self.rid)
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

fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get("authorization")?.to_str().ok()?.trim();
    let (scheme, token) = v.split_once(' ')?;
    scheme.eq_ignore_ascii_case("bearer").then(|| token.trim())
}

/// Authentication, the account check and the scope check; fills `ctx` with the
/// tenant and key. A failure is a refusal: `(reason label, error)`, no usage row.
pub(crate) async fn authenticate(
    state: &AppState,
    ctx: &mut Ctx,
    headers: &HeaderMap,
    account: Option<&str>,
    scope: Scope,
) -> Result<Principal, (&'static str, ApiError)> {
    let missing = AuthError::Missing;
    let token = bearer(headers).filter(|t| !t.is_empty()).ok_or_else(|| {
        (
            missing.label(),
            ApiError::new(ErrorKind::Unauthenticated, missing.to_string()),
        )
    })?;
    let res = state.store.authenticate(token).await.map_err(|e| {
        tracing::error!(error = %e, "store failure during authentication");
        (
            "store_unavailable",
            ApiError::new(ErrorKind::Unavailable, "authentication store unavailable"),
        )
    })?;
    let p = match res {
        Ok(p) => p,
        Err(e @ AuthError::Suspended(_)) => {
            return Err((
                e.label(),
                ApiError::new(ErrorKind::Forbidden, e.to_string()),
            ))
        }
        Err(e) => {
            return Err((
                e.label(),
                ApiError::new(ErrorKind::Unauthenticated, e.to_string()),
            ))
        }
    };
    ctx.tenant_id = p.tenant.id.clone();
    ctx.key_id = p.key_id.clone();
    if let Some(a) = account {
        if a != p.tenant.id {
            return Err((
                "wrong_account",
                ApiError::new(
                    ErrorKind::Forbidden,
                    format!("this API key is not valid for account {a}"),
                ),
            ));
        }
    }
    if !p.scopes.contains(scope) {
        return Err((
            "scope",
            ApiError::new(
                ErrorKind::Forbidden,
                format!(
                    "this API key lacks the `{}` scope (it has: {})",
                    scope.as_str(),
                    p.scopes
                ),
            ),
        ));
    }
    Ok(p)
}

/// The client error for a limit refusal (429 with `retry-after`).
pub(crate) fn limit_error(l: &LimitError) -> ApiError {
    let kind = if l.kind == LimitKind::DailyQuota {
        ErrorKind::QuotaExceeded
    } else {
        ErrorKind::RateLimited
    };
    let mut e = ApiError::new(kind, l.to_string());
    e.retry_after = Some(l.retry_after);
    e.retryable = l.retryable;
    e
}

/// Hard cap of bytes read (and discarded) from an oversized body before answering
/// 413, so that a client still sending its body reads the answer.
const DRAIN_LIMIT: usize = 64 << 20;

/// Reads the body up to `limit` bytes.
pub(crate) async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Bytes, ApiError> {
    let too_large = || {
        ApiError::new(
            ErrorKind::TooLarge,
            format!("request body exceeds the limit of {limit} bytes"),
        )
    };
    let declared = headers
        .get("content-length")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<usize>().ok());
    if declared.is_some_and(|n| n > DRAIN_LIMIT) {
        return Err(too_large());
    }
    let mut stream = body.into_data_stream();
    let mut buf = Vec::new();
    let mut seen = 0usize;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            ApiError::new(
                ErrorKind::BadRequest,
                format!("cannot read the request body: {e}"),
            )
        })?;
        seen += chunk.len();
        if seen > DRAIN_LIMIT {
            return Err(too_large());
        }
        if seen <= limit {
            buf.extend_from_slice(&chunk);
        }
    }
    if seen > limit {
        return Err(too_large());
    }
    Ok(Bytes::from(buf))
}

/// Which response shape a generation endpoint uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shape {
    /// Workers AI `ai/run`.
    WorkersAi,
    /// OpenAI chat completions.
    Chat,
    /// OpenAI text completions.
    Completion,
}

/// The phases shared by every generation endpoint, in order. Phases 1-3 refuse
/// without a usage row (counted in the metrics); from phase 4 on every outcome
/// writes exactly one row.
///
/// 1. model id length (path), 2. authentication, account and scope,
/// 3. concurrency and requests/minute ([`Limiter::admit`]),
/// 4. body (size limit, read deadline), 5. validation (fields, model, chat
///    template, tokenizer, I1), 6. token limits and the daily quota reserved
///    ([`tessera_tenancy::Admission::reserve`]), 7. engine submit, 8. the driver.
///
/// Runs in the request's trace span (`request`: request id, API, then tenant and
/// model once known), with child spans `validation`, `admission` and, in the
/// driver, `stream`; the nodes add `queue`, `prefill`, `transfer` and `decode`.
pub(crate) async fn generate(
    state: Arc<AppState>,
    shape: Shape,
    endpoint: &'static str,
    account: Option<String>,
    path_model: Option<String>,
    req: Request,
) -> Response {
    let flavor = if shape == Shape::WorkersAi {
        Flavor::WorkersAi
    } else {
        Flavor::OpenAi
    };
    let ctx = Ctx::new(endpoint, flavor);
    let span = tracing::info_span!(
        target: tessera_serving::telemetry::TARGET,
        "request",
        request_id = %ctx.rid,
        api = endpoint,
        tenant = tracing::field::Empty,
        model = tracing::field::Empty,
    );
    generate_in_span(state, shape, ctx, account, path_model, req)
        .instrument(span)
        .await
}

async fn generate_in_span(
    state: Arc<AppState>,
    shape: Shape,
    mut ctx: Ctx,
    account: Option<String>,
    path_model: Option<String>,
    req: Request,
) -> Response {
    let span = tracing::Span::current();
    if let Some(m) = &path_model {
        if let Err(e) = validation::check_len("model", m) {
            return ctx.refuse(&state, "path_too_long", e);
        }
        ctx.model = m.clone();
    }
    let (parts, body) = req.into_parts();
    let principal = match authenticate(
        &state,
        &mut ctx,
        &parts.headers,
        account.as_deref(),
        Scope::Inference,
    )
    .await
    {
        Ok(p) => p,
        Err((reason, e)) => return ctx.refuse(&state, reason, e),
    };
    let tenant = &principal.tenant;
    span.record("tenant", tenant.id.as_str());
    let admitted = tracing::info_span!(target: TRACE, "admission", step = "limits")
        .in_scope(|| state.limiter.admit(&tenant.id, tenant.limits));
    let admission = match admitted {
        Ok(a) => a,
        Err(l) => return ctx.refuse(&state, l.kind.label(), limit_error(&l)),
    };
    let read = read_body(&parts.headers, body, state.max_body_bytes);
    let bytes = match tokio::time::timeout(state.deadlines.body_read, read).await {
        Ok(Ok(b)) => b,
        Ok(Err(e)) => return ctx.fail(&state, e).await,
        Err(_) => {
            let e = ApiError::new(
                ErrorKind::Timeout,
                format!(
                    "the request body was not received within {} s",
                    state.deadlines.body_read.as_secs_f64()
                ),
            );
            return ctx.fail(&state, e).await;
        }
    };
    let validation = tracing::info_span!(target: TRACE, "validation").entered();
    let parsed: Result<ParsedRequest, ApiError> = validation::parse_object(&bytes).and_then(|o| {
        if let Some(m) = o.get("model").and_then(|m| m.as_str()) {
            if path_model.is_none() && m.len() <= MAX_ID_BYTES {
                ctx.model = m.into();
            }
        }
        match shape {
            Shape::WorkersAi => {
                validation::workers_ai(path_model.as_deref().unwrap_or_default(), &o)
            }
            Shape::Chat => validation::openai_chat(&o),
            Shape::Completion => validation::openai_completion(&o),
        }
    });
    let parsed = match parsed {
        Ok(p) => p,
        Err(e) => {
            drop(validation);
            return ctx.fail(&state, e).await;
        }
    };
    let v: Validated = match validation::validate(
        parsed,
        &state.catalog,
        &state.model,
        state.engine.limits(),
        tenant.engine_id(),
    ) {
        Ok(v) => v,
        Err(e) => {
            drop(validation);
            return ctx.fail(&state, e).await;
        }
    };
    drop(validation);
    ctx.model = v.model.id.clone();
    span.record("model", ctx.model.as_str());
    if state.log_request_text {
        ctx.prompt_text = Some(state.model.tokenizer.decode(&v.request.prompt, false));
    }
    let prompt_tokens = v.request.prompt.len();
    if state.limiter.needs_daily(&tenant.id, tenant.limits) {
        let day_start = tessera_tenancy::limits::utc_day(now_ms()) * 86_400_000;
        match state.store.tokens_since(&tenant.id, day_start).await {
            Ok(used) => state
                .limiter
                .set_daily_used(&tenant.id, tenant.limits, used),
            Err(e) => {
                tracing::error!(error = %e, "cannot read daily usage");
                let err = ApiError::new(ErrorKind::Unavailable, "usage store unavailable");
                return ctx.fail(&state, err).await;
            }
        }
    }
    let max_tokens = u32::try_from(v.request.max_tokens).unwrap_or(u32::MAX);
    let input = u32::try_from(prompt_tokens).unwrap_or(u32::MAX);
    let reserved = tracing::info_span!(target: TRACE, "admission", step = "tokens")
        .in_scope(|| admission.reserve(input, max_tokens));
    let reservation = match reserved {
        Ok(r) => r,
        Err(l) => return ctx.refuse(&state, l.kind.label(), limit_error(&l)),
    };
    // The backend re-checks I1 against its own pool.
    let events = match state.engine.submit(v.request.clone()) {
        Ok(rx) => rx,
        Err(e) => {
            reservation.cancel();
            state.metrics.serve_error(e.kind().label());
            return ctx.fail(&state, ApiError::serving(&e)).await;
        }
    };
    let live = state.live.register(&principal.key_id);
    let out = driver::spawn(
        state.clone(),
        ctx.clone(),
        events,
        driver::Held { reservation, live },
        prompt_tokens,
    );
    let fmt = Formatter {
        shape,
        rid: ctx.rid.clone(),
        model: v.model.id.clone(),
        created: ctx.created_ms / 1000,
        include_usage: v.include_usage,
        started: false,
    };
    if v.stream {
        stream_response(&ctx, fmt, out)
    } else {
        collect_response(&ctx, fmt, out).await
    }
}

/// Renders driver messages in one API's shape.
pub(crate) struct Formatter {
    pub(crate) shape: Shape,
    pub(crate) rid: String,
    pub(crate) model: String,
    pub(crate) created: i64,
    pub(crate) include_usage: bool,
    pub(crate) started: bool,
}

async fn collect_response(ctx: &Ctx, fmt: Formatter, mut out: UnboundedReceiver<Msg>) -> Response {
    let mut text = String::new();
    while let Some(m) = out.recv().await {
        match m {
            Msg::Text(t) => text.push_str(&t),
            Msg::Done {
                reason,
                prompt_tokens,
                completion_tokens,
            } => {
                let body = fmt.complete(&text, reason, prompt_tokens, completion_tokens);
                return ctx.header((StatusCode::OK, axum::Json(body)).into_response());
            }
            // The driver already wrote the usage row.
            Msg::Error(e) => return e.into_response_as(ctx.flavor, &ctx.rid),
        }
    }
    ApiError::new(ErrorKind::Internal, "generation ended without a result")
        .into_response_as(ctx.flavor, &ctx.rid)
}

fn stream_response(ctx: &Ctx, fmt: Formatter, out: UnboundedReceiver<Msg>) -> Response {
    let s = futures_util::stream::unfold(Some((fmt, out)), |st| async move {
        let (mut fmt, mut out) = st?;
        let m = out.recv().await?;
        let last = !matches!(m, Msg::Text(_));
        let bytes = fmt.frame(m);
        Some((
            Ok::<Bytes, std::convert::Infallible>(Bytes::from(bytes)),
            (!last).then_some((fmt, out)),
        ))
    });
    let mut r = Response::new(Body::from_stream(s));
    let h = r.headers_mut();
    h.insert(
        "content-type",
        HeaderValue::from_static("text/event-stream"),
    );
    h.insert("cache-control", HeaderValue::from_static("no-cache"));
    ctx.header(r)
}

pub(crate) fn sse(v: &serde_json::Value) -> String {
    format!("data: {v}\n\n")
}

async fn run_handler(
    State(state): State<Arc<AppState>>,
    Path((account, model)): Path<(String, String)>,
    req: Request,
) -> Response {
    generate(
        state,
        Shape::WorkersAi,
        "workers_ai.run",
        Some(account),
        Some(model),
        req,
    )
    .await
}

async fn chat_scoped(
    State(state): State<Arc<AppState>>,
    Path(account): Path<String>,
    req: Request,
) -> Response {
    generate(state, Shape::Chat, "openai.chat", Some(account), None, req).await
}

async fn chat(State(state): State<Arc<AppState>>, req: Request) -> Response {
    generate(state, Shape::Chat, "openai.chat", None, None, req).await
}

async fn completion_scoped(
    State(state): State<Arc<AppState>>,
    Path(account): Path<String>,
    req: Request,
) -> Response {
    generate(
        state,
        Shape::Completion,
        "openai.completions",
        Some(account),
        None,
        req,
    )
    .await
}

async fn completion(State(state): State<Arc<AppState>>, req: Request) -> Response {
    generate(
        state,
        Shape::Completion,
        "openai.completions",
        None,
        None,
        req,
    )
    .await
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(state): State<Arc<AppState>>) -> Response {
    if !state.store.ping().await {
        (StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n").into_response()
    } else if !state.engine.ready() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "no prefill or decode node reachable\n",
        )
            .into_response()
    } else {
        (StatusCode::OK, "ready\n").into_response()
    }
}

async fn fallback(req: Request) -> Response {
    let flavor = if req.uri().path().starts_with("/v1/") {
        Flavor::OpenAi
    } else {
        Flavor::WorkersAi
    };
    ApiError::new(
        ErrorKind::NotFound,
        format!("No route for {} {}", req.method(), req.uri().path()),
    )
    .into_response_as(flavor, "")
}

/// Refuses any request with a path segment over [`MAX_ID_BYTES`] before routing,
/// authentication or any store access (no usage row; counted as `path_too_long`).
async fn path_guard(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if let Some(seg) = path.split('/').find(|s| s.len() > MAX_ID_BYTES) {
        let flavor = if path.starts_with("/v1/") {
            Flavor::OpenAi
        } else {
            Flavor::WorkersAi
        };
        let e = ApiError::new(
            ErrorKind::BadRequest,
            format!(
                "a path segment (account id or model id) must be at most {MAX_ID_BYTES} bytes. \
                 Given: {} bytes",
                seg.len()
            ),
        );
        state.metrics.refused("path_too_long");
        return e.into_response_as(flavor, "");
    }
    next.run(req).await
}

/// The public API's routes (no admin routes).
fn public_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route(
            "/client/v4/accounts/{account_id}/ai/run/{*model}",
            post(run_handler),
        )
        .route(
            "/client/v4/accounts/{account_id}/ai/v1/chat/completions",
            post(chat_scoped),
        )
        .route(
            "/client/v4/accounts/{account_id}/ai/v1/completions",
            post(completion_scoped),
        )
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completion))
        .route(
            "/client/v4/accounts/{account_id}/ai/models/search",
            get(crate::openai::models_search),
        )
        .route(
            "/client/v4/accounts/{account_id}/ai/v1/models",
            get(crate::openai::models_scoped),
        )
        .route("/v1/models", get(crate::openai::models))
        .route(
            "/client/v4/accounts/{account_id}/ai/usage",
            get(crate::usage_api::usage),
        )
}

fn finish(routes: Router<Arc<AppState>>, state: Arc<AppState>) -> Router {
    routes
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(fallback)
        // Bodies are read by the handlers with their own limit (and a 413 in the
        // API's shape); axum's default 2 MB cap would answer first.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .layer(middleware::from_fn_with_state(state.clone(), path_guard))
        .with_state(state)
}

/// The router with every endpoint: the public API, the admin API and `/metrics`
/// (one listener).
pub fn router(state: Arc<AppState>) -> Router {
    finish(
        public_routes().merge(crate::admin::routes(state.clone())),
        state,
    )
}

/// The public API alone (with `--admin-listen`: admin paths answer 404 here).
pub fn public_router(state: Arc<AppState>) -> Router {
    finish(public_routes(), state)
}

/// The admin API and `/metrics` alone (the admin listener), plus health.
pub fn admin_router(state: Arc<AppState>) -> Router {
    finish(crate::admin::routes(state.clone()), state)
}

/// A bound, not yet running server.
pub struct Server {
    listener: TcpListener,
    router: Router,
    admin: Option<(TcpListener, Router)>,
    tls: Option<tokio_rustls::TlsAcceptor>,
    conn: ConnLimits,
    state: Arc<AppState>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.listener.local_addr().ok())
            .field("admin_addr", &self.admin_addr())
            .finish()
    }
}

impl Server {
    /// Checks the tokens (at least [`crate::admin::MIN_TOKEN_BYTES`] bytes each),
    /// binds the listeners (and loads or makes the TLS certificate).
    ///
    /// # Errors
    /// A short or empty admin or metrics token, plain HTTP on a non-loopback
    /// address without `allow_insecure_http`, a bind or TLS failure.
    pub async fn bind(cfg: &GatewayConfig, state: Arc<AppState>) -> anyhow::Result<Self> {
        for (what, t) in [
            ("admin token", &cfg.admin_token),
            ("metrics token", &cfg.metrics_token),
        ] {
            if let Some(t) = t {
                crate::admin::check_token(what, t)?;
            }
        }
        let tls = crate::tls::acceptor(&cfg.tls)?;
        for addr in std::iter::once(cfg.listen).chain(cfg.admin_listen) {
            if tls.is_none() && !addr.ip().is_loopback() && !cfg.allow_insecure_http {
                anyhow::bail!(
                    "refusing to serve plain HTTP on non-loopback address {addr} (use --tls or --allow-insecure-http)"
                );
            }
        }
        let listener = TcpListener::bind(cfg.listen).await?;
        let (router, admin) = match cfg.admin_listen {
            None => (router(state.clone()), None),
            Some(a) => (
                public_router(state.clone()),
                Some((TcpListener::bind(a).await?, admin_router(state.clone()))),
            ),
        };
        Ok(Self {
            listener,
            router,
            admin,
            tls,
            conn: cfg.conn,
            state,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("bound listener has an address")
    }

    /// The admin listener's address, when the admin API has its own listener.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin.as_ref().and_then(|(l, _)| l.local_addr().ok())
    }

    /// `https` with TLS, else `http`.
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// Serves until `shutdown` completes, then stops accepting, lets running
    /// requests finish for the drain timeout, aborts the rest (usage rows are
    /// written for what was computed) and returns. Also runs, while serving, the
    /// watcher that aborts requests whose key stopped being valid and the ledger's
    /// retention prune.
    pub async fn run_until(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let state = self.state.clone();
        let (stop, stopped) = watch::channel(false);
        let mut tasks = vec![tokio::spawn(crate::live::watch(
            state.live.clone(),
            state.store.clone(),
            state.revocation_poll,
        ))];
        if let Some(keep) = state.usage.retention {
            tasks.push(tokio::spawn(prune(state.clone(), keep)));
        }
        let mut loops = vec![tokio::spawn(crate::listener::serve(
            self.listener,
            self.router,
            self.tls.clone(),
            self.conn,
            state.clone(),
            stopped.clone(),
        ))];
        if let Some((l, r)) = self.admin {
            loops.push(tokio::spawn(crate::listener::serve(
                l,
                r,
                self.tls,
                self.conn,
                state.clone(),
                stopped,
            )));
        }
        shutdown.await;
        let _ = stop.send(true);
        for l in loops {
            let _ = l.await;
        }
        state.drain().await;
        // Let the last responses flush and their connections close.
        for _ in 0..40 {
            if state.metrics.connections_open() == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Requests aborted by their clients during shutdown still write their rows.
        state.wait_idle(Duration::from_secs(10)).await;
        for t in tasks {
            t.abort();
        }
        Ok(())
    }

    /// Serves forever.
    pub async fn run(self) -> anyhow::Result<()> {
        self.run_until(std::future::pending()).await
    }
}

/// The retention prune: deletes ledger rows older than `keep`, at start and every
/// prune interval.
async fn prune(state: Arc<AppState>, keep: Duration) {
    loop {
        let before = now_ms() - keep.as_millis() as i64;
        match state.store.prune_usage(before).await {
            Ok(n) => {
                state.metrics.pruned(n);
                if n > 0 {
                    tracing::info!(rows = n, "pruned usage rows past the retention");
                }
            }
            Err(e) => tracing::error!(error = %e, "usage retention prune failed"),
        }
        tokio::time::sleep(state.usage.prune_interval).await;
    }
}
