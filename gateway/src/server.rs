//! The HTTP server: state, router, the request phases shared by every generation
//! endpoint, and the listener (plain HTTP on loopback, or TLS by rustls).

use crate::catalog::Catalog;
use crate::driver::{self, Msg};
use crate::error::{ApiError, ErrorKind, Flavor};
use crate::tls::TlsMode;
use crate::validation::{self, ParsedRequest, Validated};
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures_util::StreamExt;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_model::LoadedModel;
use tessera_serving::EngineHandle;
use tessera_tenancy::{now_ms, AuthError, Limiter, Principal, Store, UsageRecord};
use tokio::net::TcpListener;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::{watch, Notify};

/// Server settings.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    /// Address to listen on (port 0 picks a free port).
    pub listen: SocketAddr,
    /// TLS mode.
    pub tls: TlsMode,
    /// Serve plain HTTP on a non-loopback address (off: refuse to start).
    pub allow_insecure_http: bool,
    /// Largest accepted request body in bytes.
    pub max_body_bytes: usize,
    /// Bearer token of the admin API; `None` disables it.
    pub admin_token: Option<String>,
    /// On shutdown, how long running requests may finish before they are aborted
    /// (their usage rows are still written).
    pub drain_timeout: Duration,
}

impl Default for GatewayConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8787)),
            tls: TlsMode::Off,
            allow_insecure_http: false,
            max_body_bytes: 1 << 20,
            admin_token: None,
            drain_timeout: Duration::from_secs(30),
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
    /// Body size limit.
    pub max_body_bytes: usize,
    /// Drain deadline on shutdown.
    pub drain_timeout: Duration,
    /// Prometheus metrics.
    pub metrics: crate::metrics::Metrics,
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
            max_body_bytes: cfg.max_body_bytes,
            drain_timeout: cfg.drain_timeout,
            metrics: crate::metrics::Metrics::default(),
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

    /// Writes a usage row (logged, not surfaced, if the store fails).
    pub(crate) async fn record(&self, r: &UsageRecord) {
        self.metrics.observe(r);
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

/// Authentication and the account check; fills `ctx` with the tenant and key.
pub(crate) async fn authenticate(
    state: &AppState,
    ctx: &mut Ctx,
    headers: &HeaderMap,
    account: Option<&str>,
) -> Result<Principal, ApiError> {
    let token = bearer(headers)
        .ok_or_else(|| ApiError::new(ErrorKind::Unauthenticated, AuthError::Missing.to_string()))?;
    let res = state.store.authenticate(token).await.map_err(|e| {
        tracing::error!(error = %e, "store failure during authentication");
        ApiError::new(ErrorKind::Unavailable, "authentication store unavailable")
    })?;
    let p = match res {
        Ok(p) => p,
        Err(AuthError::Suspended(tenant)) => {
            ctx.tenant_id = tenant.clone();
            if let Ok(k) = tessera_tenancy::ApiKey::parse(token) {
                ctx.key_id = k.key_id().into();
            }
            return Err(ApiError::new(
                ErrorKind::Forbidden,
                AuthError::Suspended(tenant).to_string(),
            ));
        }
        Err(e) => return Err(ApiError::new(ErrorKind::Unauthenticated, e.to_string())),
    };
    ctx.tenant_id = p.tenant.id.clone();
    ctx.key_id = p.key_id.clone();
    if let Some(a) = account {
        if a != p.tenant.id {
            return Err(ApiError::new(
                ErrorKind::Forbidden,
                format!("this API key is not valid for account {a}"),
            ));
        }
    }
    Ok(p)
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

/// The phases shared by every generation endpoint.
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
    let mut ctx = Ctx::new(endpoint, flavor);
    if let Some(m) = &path_model {
        ctx.model = m.clone();
    }
    let (parts, body) = req.into_parts();
    let principal = match authenticate(&state, &mut ctx, &parts.headers, account.as_deref()).await {
        Ok(p) => p,
        Err(e) => return ctx.fail(&state, e).await,
    };
    let bytes = match read_body(&parts.headers, body, state.max_body_bytes).await {
        Ok(b) => b,
        Err(e) => return ctx.fail(&state, e).await,
    };
    let parsed: Result<ParsedRequest, ApiError> = validation::parse_object(&bytes).and_then(|o| {
        if let Some(m) = o.get("model").and_then(|m| m.as_str()) {
            if path_model.is_none() {
                ctx.model = m.chars().take(200).collect();
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
        Err(e) => return ctx.fail(&state, e).await,
    };
    let tenant = &principal.tenant;
    let v: Validated = match validation::validate(
        parsed,
        &state.catalog,
        &state.model,
        state.engine.limits(),
        tenant.engine_id(),
    ) {
        Ok(v) => v,
        Err(e) => return ctx.fail(&state, e).await,
    };
    ctx.model = v.model.id.clone();
    let prompt_tokens = v.request.prompt.len();
    // Per-tenant limits.
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
    let permit = match state.limiter.check(
        &tenant.id,
        tenant.limits,
        u32::try_from(prompt_tokens).unwrap_or(u32::MAX),
        max_tokens,
    ) {
        Ok(p) => p,
        Err(l) => {
            let kind = if l.kind == tessera_tenancy::LimitKind::DailyQuota {
                ErrorKind::QuotaExceeded
            } else {
                ErrorKind::RateLimited
            };
            let mut e = ApiError::new(kind, l.to_string());
            e.retry_after = Some(l.retry_after);
            e.retryable = l.retryable;
            return ctx.fail(&state, e).await;
        }
    };
    // The backend re-checks I1 against its own pool.
    let events = match state.engine.submit(v.request.clone()) {
        Ok(rx) => rx,
        Err(e) => return ctx.fail(&state, ApiError::serving(&e)).await,
    };
    let out = driver::spawn(state.clone(), ctx.clone(), events, permit, prompt_tokens);
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

/// The router with every endpoint.
pub fn router(state: Arc<AppState>) -> Router {
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
        .merge(crate::admin::routes(state.clone()))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .fallback(fallback)
        // Bodies are read by the handlers with their own limit (and a 413 in the
        // API's shape); axum's default 2 MB cap would answer first.
        .layer(axum::extract::DefaultBodyLimit::disable())
        .with_state(state)
}

/// A bound, not yet running server.
pub struct Server {
    listener: TcpListener,
    router: Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    state: Arc<AppState>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server")
            .field("addr", &self.listener.local_addr().ok())
            .finish()
    }
}

impl Server {
    /// Binds the listener (and loads or makes the TLS certificate).
    pub async fn bind(cfg: &GatewayConfig, state: Arc<AppState>) -> anyhow::Result<Self> {
        let tls = crate::tls::acceptor(&cfg.tls)?;
        if tls.is_none() && !cfg.listen.ip().is_loopback() && !cfg.allow_insecure_http {
            anyhow::bail!(
                "refusing to serve plain HTTP on non-loopback address {} (use --tls or --allow-insecure-http)",
                cfg.listen
            );
        }
        let listener = TcpListener::bind(cfg.listen).await?;
        Ok(Self {
            listener,
            router: router(state.clone()),
            tls,
            state,
        })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("bound listener has an address")
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
    /// written for what was computed) and returns.
    pub async fn run_until(
        self,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let state = self.state.clone();
        let fired = Arc::new(Notify::new());
        let signal = {
            let fired = fired.clone();
            async move {
                shutdown.await;
                fired.notify_one();
            }
        };
        match self.tls {
            None => {
                let serve = axum::serve(self.listener, self.router)
                    .with_graceful_shutdown(signal)
                    .into_future();
                tokio::pin!(serve);
                let drained = async {
                    fired.notified().await;
                    state.drain().await;
                };
                tokio::select! {
                    r = &mut serve => r?,
                    _ = drained => {
                        // Let the last responses flush.
                        let _ = tokio::time::timeout(Duration::from_secs(2), &mut serve).await;
                    }
                }
            }
            Some(acceptor) => {
                tokio::pin!(signal);
                loop {
                    let (tcp, peer) = tokio::select! {
                        _ = &mut signal => break,
                        r = self.listener.accept() => match r {
                            Ok(x) => x,
                            Err(e) => { tracing::warn!(error = %e, "accept failed"); continue; }
                        },
                    };
                    let acceptor = acceptor.clone();
                    let svc = hyper_util::service::TowerToHyperService::new(self.router.clone());
                    tokio::spawn(async move {
                        let tls = match acceptor.accept(tcp).await {
                            Ok(s) => s,
                            Err(e) => {
                                tracing::debug!(%peer, error = %e, "TLS handshake failed");
                                return;
                            }
                        };
                        let io = hyper_util::rt::TokioIo::new(tls);
                        if let Err(e) = hyper::server::conn::http1::Builder::new()
                            .serve_connection(io, svc)
                            .await
                        {
                            tracing::debug!(%peer, error = %e, "connection error");
                        }
                    });
                }
                state.drain().await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
        // Requests aborted by their clients during shutdown still write their rows.
        state.wait_idle(Duration::from_secs(10)).await;
        Ok(())
    }

    /// Serves forever.
    pub async fn run(self) -> anyhow::Result<()> {
        self.run_until(std::future::pending()).await
    }
}
