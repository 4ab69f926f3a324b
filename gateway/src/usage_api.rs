//! `GET /client/v4/accounts/{account_id}/ai/usage?since=&until=&group_by=`: the
//! caller's own usage. The key needs the `usage:read` scope, the account in the
//! path must be the key's tenant, and the query reads only that tenant's rows.
//! Queries have their own per-tenant rate limit and a bounded time range, so the
//! usage API cannot be used to load the store.

use crate::error::{ApiError, ErrorKind, Flavor};
use crate::http::{authenticate, envelope, limit_error};
use crate::state::{AppState, Ctx};
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tessera_tenancy::store::{parse_time, rfc3339};
use tessera_tenancy::{GroupBy, Principal, Scope, Store, UsageGroup};

/// Parses `since`, `until` (Unix seconds, `YYYY-MM-DD` or RFC 3339 `...Z`; default:
/// `until` is now, `since` is `until - max_range`) and `group_by` (default `model`).
/// A range longer than `max_range`, or one that ends before it starts, is a 400
/// naming `since`.
/// Query parameter `k` as a time (Unix seconds, `YYYY-MM-DD` or
/// `YYYY-MM-DDTHH:MM:SSZ`) in Unix ms, or `default` when absent; a 400 naming `k`
/// when malformed.
pub(crate) fn query_time(
    q: &HashMap<String, String>,
    k: &str,
    default: i64,
) -> Result<i64, ApiError> {
    match q.get(k) {
        None => Ok(default),
        Some(s) => parse_time(s).ok_or_else(|| {
            ApiError::field(
                k,
                format!(
                    "`{k}` must be Unix seconds, YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ. Given: {s}"
                ),
            )
        }),
    }
}

pub(crate) fn parse_query(
    q: &HashMap<String, String>,
    max_range: Duration,
) -> Result<(i64, i64, GroupBy), ApiError> {
    let time = |k: &str, default: i64| query_time(q, k, default);
    let until = time("until", tessera_tenancy::now_ms() + 1)?;
    let range_ms = max_range.as_millis().min(i64::MAX as u128) as i64;
    let since = time("since", until.saturating_sub(range_ms))?;
    if since > until {
        return Err(ApiError::field(
            "since",
            format!(
                "`since` must not be after `until`. Given: {} > {}",
                rfc3339(since),
                rfc3339(until)
            ),
        ));
    }
    if until.saturating_sub(since) > range_ms {
        return Err(ApiError::field(
            "since",
            format!(
                "the range `since`..`until` must be at most {} days. Given: {} days",
                range_ms / 86_400_000,
                until.saturating_sub(since) / 86_400_000
            ),
        ));
    }
    let group_by = match q.get("group_by") {
        None => GroupBy::Model,
        Some(g) => g
            .parse()
            .map_err(|m: String| ApiError::field("group_by", m))?,
    };
    Ok((since, until, group_by))
}

fn label(g: GroupBy) -> &'static str {
    match g {
        GroupBy::Model => "model",
        GroupBy::Key => "key",
        GroupBy::Hour => "hour",
        GroupBy::Day => "day",
    }
}

/// The usage report body.
pub(crate) async fn report(
    store: &Store,
    tenant: &str,
    since: i64,
    until: i64,
    group_by: GroupBy,
) -> Result<serde_json::Value, ApiError> {
    let groups = store
        .usage_summary(tenant, since, until, group_by)
        .await
        .map_err(|e| ApiError::new(ErrorKind::Unavailable, format!("usage store: {e}")))?;
    let mut totals = UsageGroup {
        key: "total".into(),
        ..UsageGroup::default()
    };
    for g in &groups {
        totals.add(g);
    }
    Ok(json!({
        "account_id": tenant,
        "since": rfc3339(since),
        "until": rfc3339(until),
        "group_by": label(group_by),
        "groups": groups,
        "totals": totals,
    }))
}

/// Authenticates a query about the key's own account (`account` in the path, a key
/// with `scope`) and takes one of the account's usage-API queries a minute (the
/// usage report, the cache report and purge share that rate). Returns the caller, or
/// the refusal already answered (401, 403, 429).
pub(crate) async fn account_query(
    state: &AppState,
    ctx: &mut Ctx,
    headers: &HeaderMap,
    account: &str,
    scope: Scope,
) -> Result<Principal, Response> {
    let p = match authenticate(state, ctx, headers, Some(account), scope).await {
        Ok(p) => p,
        Err((reason, e)) => return Err(ctx.refuse(state, reason, e)),
    };
    let t = &p.tenant;
    if let Err(l) = state
        .limiter
        .usage_query(&t.id, t.limits, state.usage.queries_per_minute)
    {
        return Err(ctx.refuse(state, l.kind.label(), limit_error(&l)));
    }
    Ok(p)
}

/// Handler.
pub(crate) async fn usage(
    State(state): State<Arc<AppState>>,
    Path(account): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let mut ctx = Ctx::new("usage", Flavor::WorkersAi);
    let p = match account_query(&state, &mut ctx, &headers, &account, Scope::UsageRead).await {
        Ok(p) => p,
        Err(refused) => return refused,
    };
    let t = &p.tenant;
    let res = match parse_query(&q, state.usage.max_range) {
        Ok((since, until, g)) => report(&state.store, &t.id, since, until, g).await,
        Err(e) => Err(e),
    };
    match res {
        Ok(v) => ctx.header(axum::Json(envelope(v)).into_response()),
        Err(e) => e.into_response_as(Flavor::WorkersAi, &ctx.rid),
    }
}
