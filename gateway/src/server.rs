//! The HTTP server: routers, the handlers and the request phases shared by every
//! generation endpoint, and the listeners (public, and optionally admin; plain HTTP
//! on loopback, or TLS by rustls; connection limits in [`crate::listener`]). The
//! state and settings are in `state`, the shared HTTP pieces in `http`.

pub use crate::state::{AppState, Deadlines, GatewayOptions, UsageConfig, MAX_ID_BYTES};

use crate::catalog::{now_secs, Lookup};
use crate::cpu::Lane;
use crate::driver::{Charge, ResponseEvent};
use crate::error::{ApiError, ErrorKind, Flavor};
use crate::http::{authenticate, read_body_in_time, Shape};
use crate::model_check::{self, Validated};
use crate::models_api::with_lifecycle;
use crate::openai::Formatter;
use crate::request;
use crate::state::{ConnLimits, Ctx};
use crate::validation;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tessera_serving::Priority;
use tessera_tenancy::limits::FailMode;
use tessera_tenancy::{now_ms, Scope};
use tokio::net::TcpListener;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::watch;
use tracing::Instrument;

/// The target of the request's trace spans.
const TRACE: &str = tessera_serving::telemetry::TARGET;

/// The phases shared by every generation endpoint, in order. Phases 1-3 refuse
/// without a usage row (counted in the metrics); from phase 4 on every outcome
/// writes exactly one row.
///
/// 1. model id length (path), 2. authentication, account and scope,
/// 3. concurrency and requests/minute ([`tessera_tenancy::Limiter::admit`]),
/// 4. body (size limit, read deadline), 5. validation (fields, model, chat
///    template, tokenizer, I1; parsing and validation on the CPU pool, see
///    [`crate::cpu`]), 6. token limits and the daily quota reserved
///    ([`tessera_tenancy::Admission::reserve`]), 7. engine submit, 8. the driver.
///    Phases 3 and 5-8 are the typed stages of `request`, which the async batch
///    runner calls too.
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
    let admission = match request::admit(&state, tenant, 1).await {
        Ok(a) => a,
        Err(stop) => return render(&ctx, stop),
    };
    let bytes = match read_body_in_time(&state, &parts.headers, body).await {
        Ok(b) => b,
        Err(e) => return ctx.fail(&state, e).await,
    };
    // Parsing (a body of up to the size limit) runs on the CPU pool.
    let in_path = path_model.clone();
    let (body_model, parsed) = state
        .cpu
        .run(Lane::Request, &tenant.id, move || {
            let mut body_model = None;
            let parsed = validation::parse_object(&bytes).and_then(|o| {
                if let Some(m) = o.get("model").and_then(|m| m.as_str()) {
                    if in_path.is_none() && m.len() <= MAX_ID_BYTES {
                        body_model = Some(m.to_string());
                    }
                }
                match shape {
                    Shape::WorkersAi => {
                        validation::workers_ai(in_path.as_deref().unwrap_or_default(), &o)
                    }
                    Shape::Chat => validation::openai_chat(&o),
                    Shape::Completion => validation::openai_completion(&o),
                }
            });
            (body_model, parsed)
        })
        .instrument(tracing::info_span!(target: TRACE, "validation"))
        .await;
    if let Some(m) = body_model {
        ctx.model = m;
    }
    let parsed = parsed.and_then(|mut p| {
        // The body's `priority` wins over the header; either is capped below.
        if p.priority.is_none() {
            p.priority = priority_header(&parts.headers)?;
        }
        Ok(p)
    });
    // Routing: the model id (or an alias) names the one set of engines that serves
    // it; its own tokenizer, chat template and limits validate the request. A model
    // past its sunset is gone (404, as an unknown one).
    let routed = parsed.and_then(|p| match state.catalog.lookup(&p.model, now_secs()) {
        Lookup::Served(e) => Ok((p, e)),
        Lookup::Removed(e) => Err(crate::models_api::removed(e)),
        Lookup::Unknown => Err(model_check::no_such_model(&p.model)),
    });
    let (parsed, entry) = match routed {
        Ok(x) => x,
        Err(e) => return ctx.fail(&state, e).await,
    };
    // Per-tenant access: a private model serves only the accounts it lists (checked
    // before the body's values are, so a refusal looks the same whatever the body).
    let access = crate::models_api::check_access(&state, &tenant.id, entry, &parsed.model)
        .instrument(tracing::info_span!(target: TRACE, "admission", step = "model_access"))
        .await;
    if let Err(e) = access {
        return ctx.fail(&state, e).await;
    }
    let Some(served) = state.served(&entry.id) else {
        return ctx
            .fail(&state, model_check::no_such_model(&parsed.model))
            .await;
    };
    let tc = request::tenant_context(tenant);
    let v: Validated =
        match request::validate(&state, Lane::Request, parsed, &entry.id, &tenant.id, tc).await {
            Ok(v) => v,
            Err(e) => return ctx.fail(&state, e).await,
        };
    ctx.model = v.model.id.clone();
    span.record("model", ctx.model.as_str());
    if state.log_request_text {
        let (tok, prompt) = (served.model.tokenizer.clone(), v.request.prompt.clone());
        let text = state
            .cpu
            .run(Lane::Request, &tenant.id, move || {
                tok.decode(&prompt, false)
            })
            .await;
        ctx.prompt_text = Some(text);
    }
    let max_tokens = u32::try_from(v.request.max_tokens).unwrap_or(u32::MAX);
    let input = u32::try_from(v.request.prompt.len()).unwrap_or(u32::MAX);
    let reservation =
        match request::reserve(&state, &ctx, tenant, admission, input, max_tokens).await {
            Ok(r) => r,
            Err(stop) => return render(&ctx, stop),
        };
    let affinity = session_affinity(&parts.headers, &tenant.id);
    let started = match request::start(
        &state,
        &ctx,
        shape,
        served,
        &v,
        Charge::Own(reservation),
        affinity,
        &principal.key_id,
    )
    .await
    {
        Ok(s) => s,
        Err(stop) => return render(&ctx, stop),
    };
    let entry = &served.entry;
    if !v.stream {
        let r = match request::collect(started).await {
            Ok(body) => ctx.header((StatusCode::OK, axum::Json(body)).into_response()),
            // The driver already wrote the usage row.
            Err(e) => e.into_response_as(ctx.flavor, &ctx.rid),
        };
        return with_lifecycle(r, entry);
    }
    let request::Started { fmt, mut out } = started;
    // A batch request may wait in a queue and expire there (503): its stream's
    // status is decided by its first message, so such a failure is a status, not an
    // error frame after a 200.
    let first = if v.request.priority == Priority::Batch {
        match out.recv().await {
            Some(ResponseEvent::Error(e)) => {
                return with_lifecycle(e.into_response_as(ctx.flavor, &ctx.rid), entry)
            }
            m => m,
        }
    } else {
        None
    };
    with_lifecycle(stream_response(&ctx, fmt, first, out), entry)
}

/// A stage's stop as the response (its metric or row is already recorded).
fn render(ctx: &Ctx, stop: request::Stop) -> Response {
    stop.into_error().into_response_as(ctx.flavor, &ctx.rid)
}

/// The class a request asks for in the `x-tessera-priority` header (`interactive`
/// or `batch`), if any.
fn priority_header(headers: &HeaderMap) -> Result<Option<Priority>, ApiError> {
    let Some(v) = headers.get(PRIORITY_HEADER) else {
        return Ok(None);
    };
    let v = v.to_str().map_err(|_| {
        ApiError::field(
            PRIORITY_HEADER,
            format!("`{PRIORITY_HEADER}` must be ASCII"),
        )
    })?;
    validation::priority_name(PRIORITY_HEADER, v.trim()).map(Some)
}

/// The header in which a request may ask for a priority class.
pub const PRIORITY_HEADER: &str = "x-tessera-priority";

/// The header naming a client's session (Workers AI); requests of one session go
/// to the same prefill node, where its prompt prefix is cached.
pub const SESSION_AFFINITY_HEADER: &str = "x-session-affinity";

/// The routing key of a request's session: a hash of the tenant and the
/// `x-session-affinity` value (so two tenants' session names never pick for each
/// other), or `None` without the header.
fn session_affinity(headers: &HeaderMap, tenant_id: &str) -> Option<u64> {
    use sha2::{Digest, Sha256};
    let v = headers.get(SESSION_AFFINITY_HEADER)?.as_bytes();
    if v.is_empty() {
        return None;
    }
    let mut h = Sha256::new();
    h.update(tenant_id.as_bytes());
    h.update(b"\0");
    h.update(v);
    let d = h.finalize();
    Some(u64::from_le_bytes(d[..8].try_into().expect("8 bytes")))
}

/// The SSE response: `first` (a message already taken from `out`), then the rest.
fn stream_response(
    ctx: &Ctx,
    fmt: Formatter,
    first: Option<ResponseEvent>,
    out: UnboundedReceiver<ResponseEvent>,
) -> Response {
    let s = futures_util::stream::unfold(Some((fmt, first, out)), |st| async move {
        let (mut fmt, first, mut out) = st?;
        let m = match first {
            Some(m) => m,
            None => out.recv().await?,
        };
        let last = !matches!(m, ResponseEvent::Text { .. });
        let bytes = fmt.frame(m);
        Some((
            Ok::<Bytes, std::convert::Infallible>(Bytes::from(bytes)),
            (!last).then_some((fmt, None, out)),
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

async fn run_handler(
    State(state): State<Arc<AppState>>,
    Path((account, model)): Path<(String, String)>,
    req: Request,
) -> Response {
    match crate::batch::queued(req.uri()) {
        Ok(true) => return crate::batch::handle(state, account, model, req).await,
        Ok(false) => {}
        Err(e) => {
            state.metrics.refused("batch_invalid");
            return e.into_response_as(Flavor::WorkersAi, "");
        }
    }
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
    let limits = state.limiter.health().await;
    let limits_down = !limits.up;
    if !state.store.ping().await {
        (StatusCode::SERVICE_UNAVAILABLE, "store unavailable\n").into_response()
    } else if limits_down && limits.fail_mode == Some(FailMode::Closed) {
        let msg = "limits store (redis) unreachable: failing closed, requests get 503\n";
        (StatusCode::SERVICE_UNAVAILABLE, msg).into_response()
    } else if let Some(m) = state.models.iter().find(|m| !m.engine.ready()) {
        let msg = format!("no prefill or decode node of {} reachable\n", m.entry.id);
        (StatusCode::SERVICE_UNAVAILABLE, msg).into_response()
    } else if !state.engine.ready() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            "no prefill or decode node reachable\n",
        )
            .into_response()
    } else if limits_down {
        let msg =
            "ready (limits store (redis) unreachable: failing open to this gateway's own limits)\n";
        (StatusCode::OK, msg).into_response()
    } else {
        (StatusCode::OK, "ready\n").into_response()
    }
}

async fn fallback(req: Request) -> Response {
    route_error(ErrorKind::NotFound, "No route for", &req)
}

/// A known path asked with another method: 405 with an error body in the path's
/// API shape (axum adds the `allow` header listing the path's methods).
async fn method_not_allowed(req: Request) -> Response {
    route_error(ErrorKind::MethodNotAllowed, "Method not allowed:", &req)
}

fn route_error(kind: ErrorKind, what: &str, req: &Request) -> Response {
    let flavor = if req.uri().path().starts_with("/v1/") {
        Flavor::OpenAi
    } else {
        Flavor::WorkersAi
    };
    let msg = format!("{what} {} {}", req.method(), req.uri().path());
    ApiError::new(kind, msg).into_response_as(flavor, "")
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
            get(crate::models_api::models_search),
        )
        .route(
            "/client/v4/accounts/{account_id}/ai/v1/models",
            get(crate::models_api::models_scoped),
        )
        .route(
            "/client/v4/accounts/{account_id}/ai/v1/models/{*id}",
            get(crate::models_api::model_scoped),
        )
        .route("/v1/models", get(crate::models_api::models))
        .route("/v1/models/{*id}", get(crate::models_api::model))
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
        .method_not_allowed_fallback(method_not_allowed)
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

/// Why [`Server::bind`] could not start serving.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// An admin or metrics token that cannot be used.
    #[error(transparent)]
    Token(#[from] crate::admin::TokenError),
    /// The TLS certificate or key.
    #[error(transparent)]
    Tls(#[from] crate::tls::TlsError),
    /// Plain HTTP on a non-loopback address without `allow_insecure_http`.
    #[error(
        "refusing to serve plain HTTP on non-loopback address {0} (use --tls or --allow-insecure-http)"
    )]
    PlainHttp(SocketAddr),
    /// A listener could not be bound.
    #[error("binding {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        source: std::io::Error,
    },
}

impl Server {
    /// Checks the tokens (at least [`crate::admin::MIN_TOKEN_BYTES`] bytes each),
    /// binds the listeners (and loads or makes the TLS certificate).
    ///
    /// # Errors
    /// A short or empty admin or metrics token, plain HTTP on a non-loopback
    /// address without `allow_insecure_http`, a bind or TLS failure.
    pub async fn bind(cfg: &GatewayOptions, state: Arc<AppState>) -> Result<Self, StartError> {
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
                return Err(StartError::PlainHttp(addr));
            }
        }
        let bind = |addr: SocketAddr| async move {
            TcpListener::bind(addr)
                .await
                .map_err(|source| StartError::Bind { addr, source })
        };
        let listener = bind(cfg.listen).await?;
        let (router, admin) = match cfg.admin_listen {
            None => (router(state.clone()), None),
            Some(a) => (
                public_router(state.clone()),
                Some((bind(a).await?, admin_router(state.clone()))),
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
    ) -> Result<(), StartError> {
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
    pub async fn run(self) -> Result<(), StartError> {
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
