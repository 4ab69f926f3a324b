//! A generation request as a chain of typed stages (TGI's `Validation -> Queue ->
//! Infer`, Pingora's `ProxyHttp` phases):
//!
//! ```text
//! Authenticated -> Limited -> Parsed -> Routed -> Validated -> Reserved -> Submitted
//! ```
//!
//! [`run`] calls the phases of a [`Phases`] in that order, each taking the previous
//! one's output, and ends at the first [`Stop`]. [`HttpPhases`] is the chain of the
//! HTTP endpoints (`server`). The async batch runner (`batch`) validates a batch's
//! items as a whole and sends each one in at [`Reserved`], on the batch's charge,
//! through [`submit`]; no caller builds an HTTP request or reads a response back.
//!
//! Refusals up to [`Limited`] and limit refusals at [`Reserved`] ([`Stop::Refused`])
//! write no usage row; failures after admission ([`Stop::Failed`]) wrote theirs.
//! Parsing and validation run on the CPU pool of [`crate::cpu`], never on the async
//! workers. The catalog is read once, at [`Routed`]. This module imports neither
//! `server` nor `batch`.

use crate::catalog::{now_secs, Lookup};
use crate::cpu::Lane;
use crate::driver::{self, Charge, RequestHoldings, ResponseEvent};
use crate::error::{ApiError, ErrorKind};
use crate::http::{limit_error, read_body_in_time, Shape};
use crate::model_check::{self, TenantContext, ValidRequest};
use crate::openai::{Collected, Formatter, LogprobsView};
use crate::state::{AppState, Ctx, ServedModel, MAX_ID_BYTES};
use crate::validation::{self, ParsedRequest};
use axum::body::Body;
use axum::http::HeaderMap;
use serde_json::Value;
use std::sync::Arc;
use tessera_serving::Priority;
use tessera_tenancy::{Admission, Principal, PriorityCeiling, Reservation, Scope, Tenant};
use tokio::sync::mpsc::UnboundedReceiver;
use tracing::Instrument;

/// The target of the request's trace spans.
const TRACE: &str = tessera_serving::telemetry::TARGET;

/// Why a request stopped before it produced an answer.
#[derive(Debug)]
pub(crate) enum Stop {
    /// Refused before admission, or by a limit: no usage row (counted in the
    /// metrics by reason).
    Refused(ApiError),
    /// Failed after admission: its usage row (0 tokens) is written.
    Failed(ApiError),
}

impl Stop {
    /// The client error.
    pub(crate) fn into_error(self) -> ApiError {
        match self {
            Self::Refused(e) | Self::Failed(e) => e,
        }
    }

    /// A refusal: counted as `reason`, no row.
    pub(crate) fn refused(state: &AppState, reason: &'static str, e: ApiError) -> Self {
        state.metrics.refused(reason);
        Self::Refused(e)
    }

    /// A failure after admission: its row written.
    pub(crate) async fn failed(state: &AppState, ctx: &Ctx, e: ApiError) -> Self {
        ctx.record_failure(state, &e).await;
        Self::Failed(e)
    }
}

/// The phases of a generation request. [`run`] calls them in declaration order;
/// each takes the previous phase's output, so no phase can run early or twice.
pub(crate) trait Phases {
    /// Who asks: key, account and scope checked.
    type Authenticated;
    /// Concurrency and requests/minute held.
    type Limited;
    /// The body parsed in the endpoint's API shape.
    type Parsed;
    /// The model resolved, open to the tenant and served here.
    type Routed;
    /// Tokenized and checked against the model's limits (I1).
    type Validated;
    /// Tokens reserved against the token limits and the daily quota.
    type Reserved;
    /// In the engine, its answer streaming back.
    type Submitted;

    /// Phase 1: the caller's credentials.
    async fn authenticate(&mut self) -> Result<Self::Authenticated, Stop>;
    /// Phase 2: the request limits, before the body is read.
    async fn limit(&mut self, a: Self::Authenticated) -> Result<Self::Limited, Stop>;
    /// Phase 3: read and parse the body.
    async fn parse(&mut self, l: Self::Limited) -> Result<Self::Parsed, Stop>;
    /// Phase 4: the catalog lookup and the model's access list.
    async fn route(&mut self, p: Self::Parsed) -> Result<Self::Routed, Stop>;
    /// Phase 5: template, tokenizer, grammar and I1.
    async fn validate(&mut self, r: Self::Routed) -> Result<Self::Validated, Stop>;
    /// Phase 6: the token limits and the daily quota.
    async fn reserve(&mut self, v: Self::Validated) -> Result<Self::Reserved, Stop>;
    /// Phase 7: the engine submit and the response driver.
    async fn submit(&mut self, r: Self::Reserved) -> Result<Self::Submitted, Stop>;
}

/// Runs `p`'s phases in order, to the first [`Stop`].
pub(crate) async fn run<P: Phases>(p: &mut P) -> Result<P::Submitted, Stop> {
    let authenticated = p.authenticate().await?;
    let limited = p.limit(authenticated).await?;
    let parsed = p.parse(limited).await?;
    let routed = p.route(parsed).await?;
    let validated = p.validate(routed).await?;
    let reserved = p.reserve(validated).await?;
    p.submit(reserved).await
}

/// Stage 1: the caller's key, its account and its `inference` scope.
pub(crate) struct Authenticated {
    /// The key's tenant, key id and scopes.
    pub(crate) principal: Principal,
}

/// Stage 2: a concurrency slot and the request(s) of the requests/minute taken.
pub(crate) struct Limited {
    /// The caller.
    pub(crate) principal: Principal,
    /// Gives the slot back when dropped; [`reserve`] consumes it.
    pub(crate) admission: Admission,
}

/// Stage 3: the body read and parsed in its API shape (nothing tokenized).
pub(crate) struct Parsed {
    /// The caller and its allowances.
    pub(crate) limited: Limited,
    /// The request's fields, types and ranges checked.
    pub(crate) request: ParsedRequest,
}

/// Stage 4: the model resolved in the catalog (the one lookup of the request),
/// open to the tenant and served by this gateway.
pub(crate) struct Routed<'s> {
    /// The caller and its allowances.
    pub(crate) limited: Limited,
    /// The request's fields.
    pub(crate) request: ParsedRequest,
    /// The model and the engines that serve it.
    pub(crate) served: &'s ServedModel,
}

/// Stage 5: the prompt rendered and tokenized, checked against the model's limits.
pub(crate) struct Validated<'s> {
    /// The caller and its allowances.
    pub(crate) limited: Limited,
    /// The model and the engines that serve it.
    pub(crate) served: &'s ServedModel,
    /// The engine request and how to answer it.
    pub(crate) request: ValidRequest,
}

/// Stage 6: the request's tokens reserved; what the engine and the driver take.
pub(crate) struct Reserved<'s> {
    /// The key the request counts against among the requests in flight.
    pub(crate) key_id: String,
    /// The model and the engines that serve it.
    pub(crate) served: &'s ServedModel,
    /// The engine request and how to answer it.
    pub(crate) request: ValidRequest,
    /// The allowances the driver settles when the request ends.
    pub(crate) charge: Charge,
    /// The session's routing key (`x-session-affinity`), if any.
    pub(crate) affinity: Option<u64>,
}

/// Stage 7: in the engine, its driver running.
pub(crate) struct Submitted<'s> {
    /// The driver's messages: text, then one `Done` or `Error`.
    pub(crate) out: UnboundedReceiver<ResponseEvent>,
    /// Renders the answer in the endpoint's shape.
    pub(crate) fmt: Formatter,
    /// The model (its lifecycle headers go on the response).
    pub(crate) served: &'s ServedModel,
    /// Answer as server-sent events.
    pub(crate) stream: bool,
    /// The class the request runs in.
    pub(crate) priority: Priority,
}

/// What the engine takes from a tenant's record: engine id, weight, ceiling, the
/// prefix-cache namespace (derived from the account and its salt, never from the
/// request) and the tenant's bounds on its cached pages.
pub(crate) fn tenant_context(t: &Tenant) -> TenantContext {
    TenantContext {
        engine_id: t.engine_id(),
        weight: t.scheduling.weight,
        max_priority: match t.scheduling.max_priority {
            PriorityCeiling::Interactive => Priority::Interactive,
            PriorityCeiling::Batch => Priority::Batch,
        },
        cache_namespace: Some(t.cache_namespace()),
        cache_policy: tessera_serving::CachePolicy {
            max_tokens: t.cache_limits.max_cached_tokens,
            idle_ttl_secs: t.cache_limits.idle_ttl_secs,
            version: t.cache_limits.set_ms.max(0) as u64,
        },
        lora: None,
    }
}

/// Stage 1: the bearer key of `headers`, valid, of `account` (when the path names
/// one) and with the `inference` scope; fills `ctx` with the tenant and key.
///
/// Errors: missing, unknown, expired or revoked key (401), suspended tenant, wrong
/// account or scope (403), store down (503), as [`Stop::Refused`].
pub(crate) async fn authenticate(
    state: &AppState,
    ctx: &mut Ctx,
    headers: &HeaderMap,
    account: Option<&str>,
) -> Result<Authenticated, Stop> {
    crate::http::authenticate(state, ctx, headers, account, Scope::Inference)
        .await
        .map(|principal| Authenticated { principal })
        .map_err(|(reason, e)| Stop::refused(state, reason, e))
}

/// Stage 2: concurrency, then `requests` requests/minute (1 for a request, the item
/// count for a batch), all or nothing.
///
/// Errors: the limit that refused (429 with `retry-after`; 503 when the shared
/// limits store is down and fails closed), as [`Stop::Refused`].
pub(crate) async fn limit(
    state: &AppState,
    a: Authenticated,
    requests: u32,
) -> Result<Limited, Stop> {
    let tenant = &a.principal.tenant;
    let admission = state
        .limiter
        .admit_many(&tenant.id, tenant.limits, requests)
        .instrument(tracing::info_span!(target: TRACE, "admission", step = "limits"))
        .await
        .map_err(|l| Stop::refused(state, l.kind.label(), limit_error(&l)))?;
    Ok(Limited {
        principal: a.principal,
        admission,
    })
}

/// Parses a JSON object body on the CPU pool's `lane`, in `tenant_id`'s share.
///
/// Errors: not JSON, or not an object (400).
pub(crate) async fn parse_body(
    state: &AppState,
    lane: Lane,
    tenant_id: &str,
    body: axum::body::Bytes,
) -> Result<serde_json::Map<String, Value>, ApiError> {
    state
        .cpu
        .run(lane, tenant_id, move || validation::parse_object(&body))
        .await
}

/// Stage 4: resolves `model` (a catalog id or alias) once, checks that the tenant
/// may use it, and finds the engines serving it.
///
/// Errors: unknown (404), past its sunset (404, as unknown), private to other
/// accounts (403, or 404 with `private_models_as_404`), access list unreadable (503).
pub(crate) async fn route<'s>(
    state: &'s AppState,
    tenant_id: &str,
    model: &str,
) -> Result<&'s ServedModel, ApiError> {
    let entry = match state.catalog.lookup(model, now_secs()) {
        Lookup::Served(e) => e,
        Lookup::Removed(e) => return Err(crate::models_api::removed(e)),
        Lookup::Unknown => return Err(model_check::no_such_model(model)),
    };
    // Checked before the body's values are, so a refusal looks the same whatever
    // the body.
    crate::models_api::check_access(state, tenant_id, entry, model)
        .instrument(tracing::info_span!(target: TRACE, "admission", step = "model_access"))
        .await?;
    state
        .served_entry(entry)
        .ok_or_else(|| model_check::no_such_model(model))
}

/// Stage 5: [`model_check::validate`] of `parsed` against `served`, on the CPU
/// pool's `lane`, in `tenant_id`'s share.
///
/// Errors: as [`model_check::validate`] (400 naming the field).
pub(crate) async fn validate(
    state: &AppState,
    lane: Lane,
    served: &ServedModel,
    parsed: ParsedRequest,
    tenant_id: &str,
    tenant: TenantContext,
) -> Result<ValidRequest, ApiError> {
    let (entry, model, admission) = (
        served.entry.clone(),
        served.model.clone(),
        served.engine.admission(),
    );
    state
        .cpu
        .run(lane, tenant_id, move || {
            model_check::validate(parsed, &entry, &model, admission, &tenant)
        })
        .instrument(tracing::info_span!(target: TRACE, "validation"))
        .await
}

/// Stage 6: `input` prompt tokens and `output` (`max_tokens`) against the token
/// limits and the daily quota (the limiter loads today's usage from the ledger
/// when it needs it), all or nothing. `ctx.model` names the model in a refusal.
///
/// Errors: a limit ([`Stop::Refused`], 429; the admission's requests given back);
/// the usage store unreadable ([`Stop::Failed`], 503).
pub(crate) async fn reserve(
    state: &AppState,
    ctx: &Ctx,
    tenant: &Tenant,
    admission: Admission,
    input: u32,
    output: u32,
) -> Result<Reservation, Stop> {
    let loaded = state
        .limiter
        .load_daily(&tenant.id, tenant.limits, &state.store)
        .await;
    if let Err(e) = loaded {
        tracing::error!(error = %e, "cannot read daily usage");
        let err = ApiError::new(ErrorKind::Unavailable, "usage store unavailable");
        return Err(Stop::failed(state, ctx, err).await);
    }
    admission
        .reserve(input, output)
        .instrument(tracing::info_span!(target: TRACE, "admission", step = "tokens"))
        .await
        .map_err(|l| {
            // Token limits are the account's, over every model; the refusal names
            // the model the request asked for.
            let mut e = limit_error(&l);
            e.message = format!("{} (request for model {})", e.message, ctx.model);
            Stop::refused(state, l.kind.label(), e)
        })
}

/// Stage 7: submits `r` to its model's engines and starts its driver, which holds
/// the charge and the key's registration among the requests in flight until it
/// writes the usage row.
///
/// Errors: the engine refused the request (busy: 503 with `retry-after`; I1 on
/// its own pool: 400), as [`Stop::Failed`] (row written, charge cancelled).
pub(crate) async fn submit<'s>(
    state: &Arc<AppState>,
    ctx: &Ctx,
    shape: Shape,
    r: Reserved<'s>,
) -> Result<Submitted<'s>, Stop> {
    let Reserved {
        key_id,
        served,
        request: v,
        charge,
        affinity,
    } = r;
    let prompt_tokens = v.request.prompt.len();
    let echo_logprobs = v.echo.is_some() && v.request.output.prompt_logprobs.is_some();
    let logprobs = v.request.output.logprobs.map(|_| LogprobsView {
        tokenizer: served.model.tokenizer.clone(),
        prompt: echo_logprobs.then(|| v.request.prompt.clone()),
        offset: 0,
    });
    let priority = v.request.priority;
    // Admitted once, at validation; each node checks I1 against its own pool.
    let events = match served.engine.submit(v.request, affinity) {
        Ok(rx) => rx,
        Err(e) => {
            charge.cancel();
            state.metrics.serve_error(e.kind().label());
            return Err(Stop::failed(state, ctx, ApiError::serving(&e)).await);
        }
    };
    let live = state.live.register(&key_id);
    let out = driver::spawn(
        state.clone(),
        ctx.clone(),
        events,
        RequestHoldings { charge, live },
        prompt_tokens,
    );
    let fmt = Formatter {
        shape,
        rid: ctx.rid.clone(),
        model: match &v.finetune {
            Some(f) => format!("{}:{f}", v.model.id),
            None => v.model.id.clone(),
        },
        created: ctx.created_ms / 1000,
        include_usage: v.include_usage,
        started: false,
        logprobs,
        echo: v.echo,
        tools: v.tools.as_ref().map(|t| t.scanner()),
    };
    Ok(Submitted {
        out,
        fmt,
        served,
        stream: v.stream,
        priority,
    })
}

/// The end of a non-streamed request: the whole answer (the endpoint's response
/// body), or the error the driver ended it with (its row already written).
pub(crate) async fn collect(s: Submitted<'_>) -> Result<Value, ApiError> {
    let Submitted {
        mut out, mut fmt, ..
    } = s;
    let mut text = String::new();
    let mut lp = Collected::default();
    while let Some(m) = out.recv().await {
        match m {
            ResponseEvent::Text { text: t, logprobs } => {
                text.push_str(&t);
                if let Some(l) = logprobs {
                    lp.push(*l);
                }
            }
            ResponseEvent::Done { reason, tokens } => {
                return Ok(fmt.complete(&text, reason, tokens, &lp))
            }
            ResponseEvent::Error(e) => return Err(e),
        }
    }
    Err(ApiError::new(
        ErrorKind::Internal,
        "generation ended without a result",
    ))
}

/// The phases of a request to one of the HTTP generation endpoints (Workers AI
/// run, OpenAI chat and completions). Runs in the request's trace span, which it
/// fills with the tenant and model once known.
pub(crate) struct HttpPhases<'s> {
    state: &'s Arc<AppState>,
    /// Who, what, since when: filled as the phases learn it.
    pub(crate) ctx: Ctx,
    shape: Shape,
    /// The account the path names (Workers AI and scoped OpenAI paths).
    account: Option<String>,
    /// The model the path names (Workers AI).
    path_model: Option<String>,
    headers: HeaderMap,
    /// Taken by [`Phases::parse`].
    body: Option<Body>,
    span: tracing::Span,
}

impl<'s> HttpPhases<'s> {
    /// The phases of one request (`headers`, `body`) in the current trace span.
    pub(crate) fn new(
        state: &'s Arc<AppState>,
        ctx: Ctx,
        shape: Shape,
        account: Option<String>,
        path_model: Option<String>,
        headers: HeaderMap,
        body: Body,
    ) -> Self {
        Self {
            state,
            ctx,
            shape,
            account,
            path_model,
            headers,
            body: Some(body),
            span: tracing::Span::current(),
        }
    }
}

impl<'s> Phases for HttpPhases<'s> {
    type Authenticated = Authenticated;
    type Limited = Limited;
    type Parsed = Parsed;
    type Routed = Routed<'s>;
    type Validated = Validated<'s>;
    type Reserved = Reserved<'s>;
    type Submitted = Submitted<'s>;

    async fn authenticate(&mut self) -> Result<Authenticated, Stop> {
        if let Some(m) = &self.path_model {
            if let Err(e) = validation::check_len("model", m) {
                return Err(Stop::refused(self.state, "path_too_long", e));
            }
            self.ctx.model = m.clone();
        }
        let a = authenticate(
            self.state,
            &mut self.ctx,
            &self.headers,
            self.account.as_deref(),
        )
        .await?;
        self.span.record("tenant", a.principal.tenant.id.as_str());
        Ok(a)
    }

    async fn limit(&mut self, a: Authenticated) -> Result<Limited, Stop> {
        limit(self.state, a, 1).await
    }

    async fn parse(&mut self, l: Limited) -> Result<Parsed, Stop> {
        let body = self.body.take().expect("the body is parsed once");
        let bytes = match read_body_in_time(self.state, &self.headers, body).await {
            Ok(b) => b,
            Err(e) => return Err(Stop::failed(self.state, &self.ctx, e).await),
        };
        // Parsing (a body of up to the size limit) runs on the CPU pool.
        let (shape, in_path) = (self.shape, self.path_model.clone());
        let (body_model, parsed) = self
            .state
            .cpu
            .run(Lane::Request, &l.principal.tenant.id, move || {
                let mut body_model = None;
                let parsed = validation::parse_object(&bytes).and_then(|o| {
                    if let Some(m) = o.get("model").and_then(|m| m.as_str()) {
                        if in_path.is_none() && m.len() <= MAX_ID_BYTES {
                            body_model = Some(m.to_string());
                        }
                    }
                    match shape {
                        Shape::WorkersAi => {
                            crate::workers_ai::parse_run(in_path.as_deref().unwrap_or_default(), &o)
                        }
                        Shape::Chat => crate::openai::parse_chat(&o),
                        Shape::Completion => crate::openai::parse_completion(&o),
                    }
                });
                (body_model, parsed)
            })
            .instrument(tracing::info_span!(target: TRACE, "validation"))
            .await;
        if let Some(m) = body_model {
            self.ctx.model = m;
        }
        // The body's `priority` wins over the header; either is capped later.
        let parsed = parsed.and_then(|mut p| {
            if p.priority.is_none() {
                p.priority = priority_header(&self.headers)?;
            }
            Ok(p)
        });
        match parsed {
            Ok(request) => Ok(Parsed {
                limited: l,
                request,
            }),
            Err(e) => Err(Stop::failed(self.state, &self.ctx, e).await),
        }
    }

    async fn route(&mut self, p: Parsed) -> Result<Routed<'s>, Stop> {
        let state: &'s AppState = self.state;
        let tenant_id = &p.limited.principal.tenant.id;
        match route(state, tenant_id, &p.request.model).await {
            Ok(served) => Ok(Routed {
                limited: p.limited,
                request: p.request,
                served,
            }),
            Err(e) => Err(Stop::failed(self.state, &self.ctx, e).await),
        }
    }

    async fn validate(&mut self, r: Routed<'s>) -> Result<Validated<'s>, Stop> {
        let tenant = &r.limited.principal.tenant;
        let lora = match &r.request.lora {
            None => None,
            Some(name) => {
                match crate::finetune_resolve::resolve(self.state, &tenant.id, r.served, name).await
                {
                    Ok(l) => Some(l),
                    Err(e) => return Err(Stop::failed(self.state, &self.ctx, e).await),
                }
            }
        };
        let checked = validate(
            self.state,
            Lane::Request,
            r.served,
            r.request,
            &tenant.id,
            TenantContext {
                lora,
                ..tenant_context(tenant)
            },
        )
        .await;
        let v = match checked {
            Ok(v) => v,
            Err(e) => return Err(Stop::failed(self.state, &self.ctx, e).await),
        };
        self.ctx.model = v.model.id.clone();
        self.span.record("model", self.ctx.model.as_str());
        if self.state.log_request_text {
            let (tok, prompt) = (r.served.model.tokenizer.clone(), v.request.prompt.clone());
            let text = self
                .state
                .cpu
                .run(Lane::Request, &tenant.id, move || {
                    tok.decode(&prompt, false)
                })
                .await;
            self.ctx.prompt_text = Some(text);
        }
        Ok(Validated {
            limited: r.limited,
            served: r.served,
            request: v,
        })
    }

    async fn reserve(&mut self, v: Validated<'s>) -> Result<Reserved<'s>, Stop> {
        let Limited {
            principal,
            admission,
        } = v.limited;
        let max_tokens = u32::try_from(v.request.request.max_tokens).unwrap_or(u32::MAX);
        let input = u32::try_from(v.request.request.prompt.len()).unwrap_or(u32::MAX);
        let tenant = &principal.tenant;
        let reservation =
            reserve(self.state, &self.ctx, tenant, admission, input, max_tokens).await?;
        Ok(Reserved {
            affinity: session_affinity(&self.headers, &tenant.id),
            key_id: principal.key_id,
            served: v.served,
            request: v.request,
            charge: Charge::Own(reservation),
        })
    }

    async fn submit(&mut self, r: Reserved<'s>) -> Result<Submitted<'s>, Stop> {
        submit(self.state, &self.ctx, self.shape, r).await
    }
}

/// The header in which a request may ask for a priority class.
pub const PRIORITY_HEADER: &str = "x-tessera-priority";

/// The header naming a client's session (Workers AI); requests of one session go
/// to the same prefill node, where its prompt prefix is cached.
pub const SESSION_AFFINITY_HEADER: &str = "x-session-affinity";

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

#[cfg(test)]
mod tests {
    use super::*;

    /// Phases that record their calls and stop at `stop_at`, with no model, store
    /// or engine behind them.
    struct Recorder {
        calls: Vec<&'static str>,
        stop_at: Option<&'static str>,
    }

    impl Recorder {
        fn step(&mut self, phase: &'static str, from: usize) -> Result<usize, Stop> {
            // Each phase gets the output of the one before it.
            assert_eq!(from, self.calls.len(), "{phase} got another phase's output");
            self.calls.push(phase);
            if self.stop_at == Some(phase) {
                return Err(Stop::Refused(ApiError::new(ErrorKind::BadRequest, phase)));
            }
            Ok(from + 1)
        }
    }

    impl Phases for Recorder {
        type Authenticated = usize;
        type Limited = usize;
        type Parsed = usize;
        type Routed = usize;
        type Validated = usize;
        type Reserved = usize;
        type Submitted = usize;

        async fn authenticate(&mut self) -> Result<usize, Stop> {
            self.step("authenticate", 0)
        }
        async fn limit(&mut self, a: usize) -> Result<usize, Stop> {
            self.step("limit", a)
        }
        async fn parse(&mut self, l: usize) -> Result<usize, Stop> {
            self.step("parse", l)
        }
        async fn route(&mut self, p: usize) -> Result<usize, Stop> {
            self.step("route", p)
        }
        async fn validate(&mut self, r: usize) -> Result<usize, Stop> {
            self.step("validate", r)
        }
        async fn reserve(&mut self, v: usize) -> Result<usize, Stop> {
            self.step("reserve", v)
        }
        async fn submit(&mut self, r: usize) -> Result<usize, Stop> {
            self.step("submit", r)
        }
    }

    const ORDER: [&str; 7] = [
        "authenticate",
        "limit",
        "parse",
        "route",
        "validate",
        "reserve",
        "submit",
    ];

    #[tokio::test]
    async fn phases_run_in_order_each_once() {
        let mut r = Recorder {
            calls: vec![],
            stop_at: None,
        };
        assert_eq!(run(&mut r).await.ok(), Some(7));
        assert_eq!(r.calls, ORDER);
    }

    #[tokio::test]
    async fn a_stop_ends_the_chain_at_its_phase() {
        for (i, phase) in ORDER.iter().enumerate() {
            let mut r = Recorder {
                calls: vec![],
                stop_at: Some(phase),
            };
            let stop = run(&mut r).await.expect_err("stopped");
            assert_eq!(stop.into_error().message, *phase);
            assert_eq!(r.calls, ORDER[..=i], "phases after {phase} ran");
        }
    }

    #[test]
    fn session_affinity_is_per_tenant() {
        let mut h = HeaderMap::new();
        assert_eq!(session_affinity(&h, "a"), None);
        h.insert(SESSION_AFFINITY_HEADER, "s1".parse().unwrap());
        let a = session_affinity(&h, "a");
        assert!(a.is_some());
        assert_ne!(a, session_affinity(&h, "b"));
        assert_eq!(a, session_affinity(&h, "a"));
    }
}
