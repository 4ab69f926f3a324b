//! `GET /client/v4/accounts/{account_id}/ai/usage?since=&until=&group_by=`: the
//! caller's own usage. The account in the path must be the key's tenant, and the
//! query reads only that tenant's rows.

use crate::error::{ApiError, ErrorKind, Flavor};
use crate::server::{authenticate, AppState, Ctx};
use crate::workers_ai::envelope;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;
use tessera_tenancy::store::{parse_time, rfc3339};
use tessera_tenancy::{GroupBy, Store, UsageGroup};

/// Parses `since`, `until` (Unix seconds, `YYYY-MM-DD` or RFC 3339 `...Z`; default:
/// everything up to now) and `group_by` (default `model`).
pub(crate) fn parse_query(q: &HashMap<String, String>) -> Result<(i64, i64, GroupBy), ApiError> {
    let time = |k: &str, default: i64| match q.get(k) {
        None => Ok(default),
        Some(s) => parse_time(s).ok_or_else(|| {
            ApiError::field(
                k,
                format!(
                    "`{k}` must be Unix seconds, YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ. Given: {s}"
                ),
            )
        }),
    };
    let since = time("since", 0)?;
    let until = time("until", tessera_tenancy::now_ms() + 1)?;
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
        totals.requests += g.requests;
        totals.input_tokens += g.input_tokens;
        totals.output_tokens += g.output_tokens;
        totals.cached_tokens += g.cached_tokens;
        totals.errors += g.errors;
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

/// Handler.
pub(crate) async fn usage(
    State(state): State<Arc<AppState>>,
    Path(account): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let mut ctx = Ctx::new("usage", Flavor::WorkersAi);
    let res = async {
        let p = authenticate(&state, &mut ctx, &headers, Some(&account)).await?;
        let (since, until, g) = parse_query(&q)?;
        report(&state.store, &p.tenant.id, since, until, g).await
    }
    .await;
    match res {
        Ok(v) => ctx.header(axum::Json(envelope(v)).into_response()),
        Err(e) => e.into_response_as(Flavor::WorkersAi, &ctx.rid),
    }
}
