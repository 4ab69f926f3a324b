//! The HTTP server: routers, the handlers and the request phases shared by every
//! generation endpoint, and the listeners (public, and optionally admin; plain HTTP
//! on loopback, or TLS by rustls; connection limits in [`crate::listener`]). The
//! state and settings are in `state`, the shared HTTP pieces in `http`.

pub use crate::state::{AppState, Deadlines, GatewayOptions, UsageConfig, MAX_ID_BYTES};

pub use crate::pipeline::{PRIORITY_HEADER, SESSION_AFFINITY_HEADER};

use crate::driver::ResponseEvent;
use crate::error::{ApiError, ErrorKind, Flavor};
use crate::http::Shape;
use crate::models_api::with_lifecycle;
use crate::openai::Formatter;
use crate::pipeline;
use crate::state::{ConnLimits, Ctx};
use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tessera_serving::Priority;
use tessera_tenancy::limits::FailMode;
use tessera_tenancy::now_ms;
use tokio::net::TcpListener;
use tokio::sync::mpsc::UnboundedReceiver;
use tokio::sync::watch;
use tracing::Instrument;

/// The target of the request's trace spans.
const TRACE: &str = tessera_serving::telemetry::TARGET;

/// A generation request (any endpoint) through the typed stages of
/// [`pipeline`]: path model length and credentials, limits, body, route, validate,
/// reserve, submit; then the answer, whole or streamed. Refusals up to the limits
/// write no usage row (counted in the metrics); from the body on every outcome
/// writes exactly one row.
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
        target: TRACE,
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
    ctx: Ctx,
    account: Option<String>,
    path_model: Option<String>,
    req: Request,
) -> Response {
    let (parts, body) = req.into_parts();
    let mut phases =
        pipeline::HttpPhases::new(&state, ctx, shape, account, path_model, parts.headers, body);
    let submitted = pipeline::run(&mut phases).await;
    let ctx = phases.ctx;
    match submitted {
        Ok(s) => respond(&ctx, s).await,
        // Counted, or its row written, by the phase that stopped it.
        Err(stop) => stop.into_error().into_response_as(ctx.flavor, &ctx.rid),
    }
}

/// The answer of a submitted request: one JSON body, or a stream of events.
async fn respond(ctx: &Ctx, s: pipeline::Submitted<'_>) -> Response {
    let entry = &s.served.entry;
    if !s.stream {
        let r = match pipeline::collect(s).await {
            Ok(body) => ctx.header((StatusCode::OK, axum::Json(body)).into_response()),
            // The driver already wrote the usage row.
            Err(e) => e.into_response_as(ctx.flavor, &ctx.rid),
        };
        return with_lifecycle(r, entry);
    }
    let pipeline::Submitted {
        fmt,
        mut out,
        priority,
        ..
    } = s;
    // A batch request may wait in a queue and expire there (503): its stream's
    // status is decided by its first message, so such a failure is a status, not an
    // error frame after a 200.
    let first = if priority == Priority::Batch {
        match out.recv().await {
            Some(ResponseEvent::Error(e)) => {
                return with_lifecycle(e.into_response_as(ctx.flavor, &ctx.rid), entry)
            }
            m => m,
        }
    } else {
        None
    };
    with_lifecycle(stream_response(ctx, fmt, first, out), entry)
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
        .route(
            "/client/v4/accounts/{account_id}/ai/finetunes",
            get(crate::finetunes_api::list).post(crate::finetunes_api::create),
        )
        .route(
            "/client/v4/accounts/{account_id}/ai/finetunes/public",
            get(crate::finetunes_api::list_public),
        )
        .route(
            "/client/v4/accounts/{account_id}/ai/finetunes/{id}",
            get(crate::finetunes_api::show).delete(crate::finetunes_api::delete),
        )
        .route(
            "/client/v4/accounts/{account_id}/ai/cache",
            get(crate::cache_api::report).delete(crate::cache_api::purge),
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

/// The router with every endpoint: the public API, the admin API, `/metrics` and the
/// dashboard (one listener).
pub fn router(state: Arc<AppState>) -> Router {
    finish(
        public_routes()
            .merge(crate::dash::tenant_routes())
            .merge(crate::admin::routes(state.clone()))
            .merge(crate::dash::operator_routes()),
        state,
    )
}

/// The public API and the tenant dashboard (with `--admin-listen`: admin paths and
/// the operator view answer 404 here).
pub fn public_router(state: Arc<AppState>) -> Router {
    finish(public_routes().merge(crate::dash::tenant_routes()), state)
}

/// The admin API, `/metrics` and the operator view (the admin listener), plus health.
pub fn admin_router(state: Arc<AppState>) -> Router {
    finish(
        crate::admin::routes(state.clone()).merge(crate::dash::operator_routes()),
        state,
    )
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
    /// watcher that aborts requests whose key stopped being valid, the ledger's
    /// retention prune and the sampler of the operator view's integrity events.
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
        tasks.push(tokio::spawn(crate::dash::watch_integrity(state.clone())));
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
