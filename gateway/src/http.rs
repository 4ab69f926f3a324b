//! HTTP pieces shared by the endpoints: the bearer token and authentication
//! ([`authenticate`]), the limit refusal ([`limit_error`]), the bounded body read
//! ([`read_body`]), the response [`Shape`] of a generation endpoint, and the
//! response envelope and SSE frame helpers.

use crate::error::{ApiError, ErrorKind};
use crate::state::{AppState, Ctx};
use axum::body::{Body, Bytes};
use axum::http::HeaderMap;
use futures_util::StreamExt;
use serde_json::{json, Value};
use tessera_tenancy::{AuthError, LimitError, LimitKind, Principal, Scope};

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

/// The client error for a limit refusal (429 with `retry-after`), or 503 when the
/// shared limits store could not be reached (the limiter fails closed).
pub(crate) fn limit_error(l: &LimitError) -> ApiError {
    let kind = match l.kind {
        LimitKind::DailyQuota => ErrorKind::QuotaExceeded,
        LimitKind::Unavailable => ErrorKind::Unavailable,
        _ => ErrorKind::RateLimited,
    };
    let mut e = ApiError::new(kind, l.to_string());
    e.retry_after = Some(l.retry_after);
    e.retryable = l.retryable;
    e
}

/// Hard cap of bytes read (and discarded) from an oversized body before answering
/// 413, so that a client still sending its body reads the answer (or the limit
/// itself, when larger).
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
    let drain_limit = DRAIN_LIMIT.max(limit);
    if declared.is_some_and(|n| n > drain_limit) {
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
        if seen > drain_limit {
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

/// [`read_body`] within the state's body-read deadline (408 when it passes).
pub(crate) async fn read_body_in_time(
    state: &crate::AppState,
    headers: &HeaderMap,
    body: Body,
) -> Result<Bytes, ApiError> {
    let read = read_body(headers, body, state.max_body_bytes);
    match tokio::time::timeout(state.deadlines.body_read, read).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::new(
            ErrorKind::Timeout,
            format!(
                "the request body was not received within {} s",
                state.deadlines.body_read.as_secs_f64()
            ),
        )),
    }
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

/// Successful envelope around `result`.
pub(crate) fn envelope(result: Value) -> Value {
    json!({"result": result, "success": true, "errors": [], "messages": []})
}

/// One SSE event carrying `v`.
pub(crate) fn sse(v: &serde_json::Value) -> String {
    format!("data: {v}\n\n")
}
