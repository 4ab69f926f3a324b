//! `GET /client/v4/accounts/{account_id}/ai/cache`: what the engines hold cached of
//! the caller's account, per model and tier (`engine_pool`, `host_memory`, `disk`;
//! key scope `usage:read`).
//!
//! `DELETE /client/v4/accounts/{account_id}/ai/cache`: the caller erases what the
//! platform cached of its account. Every engine of every served model drops the
//! account's prefix-cache pages (unused ones back to the free list with a new epoch,
//! I5; ones a running request of the account still reads poisoned, never hit again,
//! freed when it ends; spilled ones dropped from host memory and disk, the disk's
//! unreadable first: their key is forgotten), and the call answers only once each
//! engine confirmed.
//!
//! Who may call: a key of that account with the `inference` scope (the scope that
//! fills the cache); another account's key gets the 403 every account-scoped route
//! gives. Each purge writes one audit row (`tenant.cache_purge`, by the key id) and
//! counts against the per-account rate of usage-API queries, so it cannot be used to
//! keep the engines busy.

use crate::error::{ApiError, ErrorKind, Flavor};
use crate::http::envelope;
use crate::state::{AppState, Ctx};
use crate::usage_api::account_query;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::sync::Arc;
use tessera_tenancy::{AuditCtx, Scope};

/// Handler: purges the account's cached KV on every engine; 200 with the pages
/// freed and poisoned per model, or 503 naming the models whose engines did not
/// confirm (nothing is claimed for them).
pub(crate) async fn purge(
    State(state): State<Arc<AppState>>,
    Path(account): Path<String>,
    headers: HeaderMap,
) -> Response {
    let mut ctx = Ctx::new("cache_purge", Flavor::WorkersAi);
    let p = match account_query(&state, &mut ctx, &headers, &account, Scope::Inference).await {
        Ok(p) => p,
        Err(refused) => return refused,
    };
    let t = &p.tenant;
    let (models, failed) = purge_engines(&state, t.engine_id()).await;
    let by = AuditCtx {
        request_id: ctx.rid.clone(),
        source: format!("key:{}", p.key_id),
    };
    let detail = json!({ "models": models, "failed": failed });
    if let Err(e) = state
        .store
        .audited(&by)
        .record("tenant.cache_purge", &t.id, detail)
        .await
    {
        tracing::error!(error = %e, tenant = %t.id, "cache purge not audited");
    }
    if let Some(e) = unconfirmed(&failed) {
        return e.into_response_as(Flavor::WorkersAi, &ctx.rid);
    }
    ctx.header(
        axum::Json(envelope(json!({ "account_id": t.id, "models": models }))).into_response(),
    )
}

/// Drops the prefix-cache pages of the tenant with engine id `tenant` on every engine
/// of every served model, waiting off the async runtime for each engine's answer.
/// Returns, per model that confirmed, `{model, freed_pages, poisoned_pages}`, and a
/// line per model that did not.
pub(crate) async fn purge_engines(state: &AppState, tenant: u64) -> (Vec<Value>, Vec<String>) {
    let engines: Vec<_> = state
        .models
        .iter()
        .map(|m| (m.entry.id.clone(), m.engine.clone()))
        .collect();
    // Each engine answers between two of its steps: wait off the async runtime.
    let purged = tokio::task::spawn_blocking(move || {
        engines
            .into_iter()
            .map(|(id, e)| (id, e.purge_tenant_cache(tenant)))
            .collect::<Vec<_>>()
    })
    .await
    .unwrap_or_default();
    if purged.is_empty() && !state.models.is_empty() {
        return (Vec::new(), vec!["the cache purge did not complete".into()]);
    }
    let mut models = Vec::new();
    let mut failed = Vec::new();
    for (id, r) in purged {
        match r {
            Ok(n) => models.push(json!({
                "model": id,
                "freed_pages": n.freed,
                "poisoned_pages": n.poisoned,
                "host_memory_pages": n.host,
                "disk_pages": n.disk,
            })),
            Err(e) => failed.push(format!("{id}: {e}")),
        }
    }
    (models, failed)
}

/// The 503 for a purge some models' engines did not confirm (none when all did).
pub(crate) fn unconfirmed(failed: &[String]) -> Option<ApiError> {
    (!failed.is_empty()).then(|| {
        ApiError::new(
            ErrorKind::Unavailable,
            format!(
                "the cache purge was not confirmed for every model: {}",
                failed.join("; ")
            ),
        )
    })
}

/// Handler: the account's cached pages and tokens per model, counted on every
/// engine; 503 naming the models whose engines did not answer.
pub(crate) async fn report(
    State(state): State<Arc<AppState>>,
    Path(account): Path<String>,
    headers: HeaderMap,
) -> Response {
    let mut ctx = Ctx::new("cache_report", Flavor::WorkersAi);
    let p = match account_query(&state, &mut ctx, &headers, &account, Scope::UsageRead).await {
        Ok(p) => p,
        Err(refused) => return refused,
    };
    let t = &p.tenant;
    let tenant = t.engine_id();
    let engines: Vec<_> = state
        .models
        .iter()
        .map(|m| (m.entry.id.clone(), m.engine.clone()))
        .collect();
    let counted = tokio::task::spawn_blocking(move || {
        engines
            .into_iter()
            .map(|(id, e)| {
                let page = e.limits().page_size;
                (id, e.tenant_cache_pages(tenant).map(|n| (n, page)))
            })
            .collect::<Vec<_>>()
    })
    .await;
    let Ok(counted) = counted else {
        let e = ApiError::new(ErrorKind::Internal, "the cache report did not complete");
        return e.into_response_as(Flavor::WorkersAi, &ctx.rid);
    };
    let mut models = Vec::new();
    let mut failed = Vec::new();
    for (id, r) in counted {
        match r {
            Ok((n, page)) => {
                for (tier, pages) in [
                    ("engine_pool", n.pool),
                    ("host_memory", n.host),
                    ("disk", n.disk),
                ] {
                    models.push(json!({
                        "model": id,
                        "tier": tier,
                        "cached_pages": pages,
                        "cached_tokens": pages * page,
                    }));
                }
            }
            Err(e) => failed.push(format!("{id}: {e}")),
        }
    }
    if !failed.is_empty() {
        let e = ApiError::new(
            ErrorKind::Unavailable,
            format!(
                "the engines of some models did not answer: {}",
                failed.join("; ")
            ),
        );
        return e.into_response_as(Flavor::WorkersAi, &ctx.rid);
    }
    ctx.header(
        axum::Json(envelope(json!({ "account_id": t.id, "models": models }))).into_response(),
    )
}
