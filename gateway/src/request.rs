//! The typed request path: the stages of a generation request that the HTTP
//! handlers (`server`) and the async batch runner (`batch`) both call, each
//! returning a typed outcome instead of an HTTP response, so that no caller builds
//! a request or parses a response to act on one.
//!
//! Stages, in order: [`admit`] (concurrency and requests/minute, before the body is
//! parsed), [`validate`] (templates, tokenizer, grammar compile, I1: on the CPU pool
//! of [`crate::cpu`], never on the async workers), [`reserve`] (token limits and the
//! daily quota, loaded from the ledger when needed), [`start`] (engine submit and
//! the driver) and [`collect`] (a non-streamed answer). Refusals before admission
//! ([`Stop::Refused`]) write no usage row; failures after it ([`Stop::Failed`])
//! wrote theirs. This module imports neither `server` nor `batch`.

use crate::cpu::Lane;
use crate::driver::{self, Charge, RequestHoldings, ResponseEvent};
use crate::error::{ApiError, ErrorKind};
use crate::http::{limit_error, Shape};
use crate::model_check::{self, TenantContext, Validated};
use crate::openai::{Collected, Formatter, LogprobsView};
use crate::state::{AppState, Ctx, ServedModel};
use crate::validation::{self, ParsedRequest};
use serde_json::Value;
use std::sync::Arc;
use tessera_serving::Priority;
use tessera_tenancy::{now_ms, Admission, PriorityCeiling, Reservation, Tenant};
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

/// What the engine takes from a tenant's record: engine id, weight, ceiling and the
/// prefix-cache namespace (derived from the account and its salt, never from the
/// request).
pub(crate) fn tenant_context(t: &Tenant) -> TenantContext {
    TenantContext {
        engine_id: t.engine_id(),
        weight: t.scheduling.weight,
        max_priority: match t.scheduling.max_priority {
            PriorityCeiling::Interactive => Priority::Interactive,
            PriorityCeiling::Batch => Priority::Batch,
        },
        cache_namespace: Some(t.cache_namespace()),
    }
}

/// Stage 1: concurrency, then `requests` requests/minute (1 for a request, the item
/// count for a batch), all or nothing.
///
/// Errors: the limit that refused (429 with `retry-after`; 503 when the shared
/// limits store is down and fails closed), as [`Stop::Refused`].
pub(crate) async fn admit(
    state: &AppState,
    tenant: &Tenant,
    requests: u32,
) -> Result<Admission, Stop> {
    state
        .limiter
        .admit_many(&tenant.id, tenant.limits, requests)
        .instrument(tracing::info_span!(target: TRACE, "admission", step = "limits"))
        .await
        .map_err(|l| Stop::refused(state, l.kind.label(), limit_error(&l)))
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

/// Stage 2: [`model_check::validate`] of `parsed` against the served model
/// `model_id` (catalog id), on the CPU pool's `lane`, in `tenant_id`'s share.
///
/// Errors: as [`model_check::validate`] (400 naming the field, 404 for a model not
/// served here).
pub(crate) async fn validate(
    state: &Arc<AppState>,
    lane: Lane,
    parsed: ParsedRequest,
    model_id: &str,
    tenant_id: &str,
    tenant: TenantContext,
) -> Result<Validated, ApiError> {
    let st = state.clone();
    let id = model_id.to_string();
    state
        .cpu
        .run(lane, tenant_id, move || {
            let served = st
                .served(&id)
                .ok_or_else(|| model_check::no_such_model(&id))?;
            model_check::validate(
                parsed,
                &st.catalog,
                &served.model,
                served.engine.limits(),
                &tenant,
            )
        })
        .instrument(tracing::info_span!(target: TRACE, "validation"))
        .await
}

/// Stage 3: `input` prompt tokens and `output` (`max_tokens`) against the token
/// limits and the daily quota (today's usage read from the ledger first when the
/// limiter needs it), all or nothing. `ctx.model` names the model in a refusal.
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
    if state.limiter.needs_daily(&tenant.id, tenant.limits).await {
        let day_start = tessera_tenancy::limits::utc_day(now_ms()) * 86_400_000;
        match state.store.tokens_since(&tenant.id, day_start).await {
            Ok(used) => {
                state
                    .limiter
                    .set_daily_used(&tenant.id, tenant.limits, used)
                    .await
            }
            Err(e) => {
                tracing::error!(error = %e, "cannot read daily usage");
                let err = ApiError::new(ErrorKind::Unavailable, "usage store unavailable");
                return Err(Stop::failed(state, ctx, err).await);
            }
        }
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

/// A started request: the driver's messages and the formatter of its answer.
pub(crate) struct Started {
    /// The driver's messages: text, then one `Done` or `Error`.
    pub(crate) out: UnboundedReceiver<ResponseEvent>,
    /// Renders the answer in the endpoint's shape.
    pub(crate) fmt: Formatter,
}

/// Stage 4: submits `v` to `served`'s engines (`affinity`: the session's routing
/// key) and starts its driver, which holds `charge` and the key's registration
/// among the requests in flight until it writes the usage row.
///
/// Errors: the engine refused the request (busy: 503 with `retry-after`; I1 on
/// its own pool: 400), as [`Stop::Failed`] (row written, `charge` cancelled).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn start(
    state: &Arc<AppState>,
    ctx: &Ctx,
    shape: Shape,
    served: &ServedModel,
    v: &Validated,
    charge: Charge,
    affinity: Option<u64>,
    key_id: &str,
) -> Result<Started, Stop> {
    let prompt_tokens = v.request.prompt.len();
    // The backend re-checks I1 against its own pool.
    let events = match served
        .engine
        .submit_with_affinity(v.request.clone(), affinity)
    {
        Ok(rx) => rx,
        Err(e) => {
            charge.cancel();
            state.metrics.serve_error(e.kind().label());
            return Err(Stop::failed(state, ctx, ApiError::serving(&e)).await);
        }
    };
    let live = state.live.register(key_id);
    let out = driver::spawn(
        state.clone(),
        ctx.clone(),
        events,
        RequestHoldings { charge, live },
        prompt_tokens,
    );
    let echo_logprobs = v.echo.is_some() && v.request.output.prompt_logprobs.is_some();
    let fmt = Formatter {
        shape,
        rid: ctx.rid.clone(),
        model: v.model.id.clone(),
        created: ctx.created_ms / 1000,
        include_usage: v.include_usage,
        started: false,
        logprobs: v.request.output.logprobs.map(|_| LogprobsView {
            tokenizer: served.model.tokenizer.clone(),
            prompt: echo_logprobs.then(|| v.request.prompt.clone()),
            offset: 0,
        }),
        echo: v.echo.clone(),
        tools: v.tools.as_ref().map(|t| t.scanner()),
    };
    Ok(Started { out, fmt })
}

/// Stage 5 of a non-streamed request: the whole answer (the endpoint's response
/// body), or the error the driver ended it with (its row already written).
pub(crate) async fn collect(started: Started) -> Result<Value, ApiError> {
    let Started { mut out, mut fmt } = started;
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
