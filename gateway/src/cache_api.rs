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
use tessera_serving::{CachePolicy, EngineHandle, ServeError};
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

/// Asks `ask` of every served model's engines, off the async runtime (each engine
/// answers between two of its steps): per model, its id and the answer, or a line
/// naming the model and why it did not answer.
async fn ask_engines<T: Send + 'static>(
    state: &AppState,
    what: &str,
    ask: impl Fn(&EngineHandle) -> Result<T, ServeError> + Send + 'static,
) -> Vec<(String, Result<T, String>)> {
    let engines: Vec<_> = state
        .models
        .iter()
        .map(|m| (m.entry.id.clone(), m.engine.clone()))
        .collect();
    let ids: Vec<String> = engines.iter().map(|(id, _)| id.clone()).collect();
    let answers = tokio::task::spawn_blocking(move || {
        engines
            .into_iter()
            .map(|(id, e)| (id, ask(&e).map_err(|e| e.to_string())))
            .collect::<Vec<_>>()
    })
    .await;
    answers.unwrap_or_else(|_| {
        ids.into_iter()
            .map(|id| (id, Err(format!("the {what} did not complete"))))
            .collect()
    })
}

/// Splits [`ask_engines`]' answers into JSON per model that answered (`to_json`)
/// and a line per model that did not.
fn answered<T>(
    answers: Vec<(String, Result<T, String>)>,
    to_json: impl Fn(&str, T) -> Vec<Value>,
) -> (Vec<Value>, Vec<String>) {
    let mut models = Vec::new();
    let mut failed = Vec::new();
    for (id, r) in answers {
        match r {
            Ok(n) => models.extend(to_json(&id, n)),
            Err(e) => failed.push(format!("{id}: {e}")),
        }
    }
    (models, failed)
}

/// Drops the prefix-cache pages of the tenant with engine id `tenant` on every engine
/// of every served model. Returns, per model that confirmed, `{model, freed_pages,
/// poisoned_pages, host_memory_pages, disk_pages}`, and a line per model that did not.
pub(crate) async fn purge_engines(state: &AppState, tenant: u64) -> (Vec<Value>, Vec<String>) {
    let answers = ask_engines(state, "cache purge", move |e| e.purge_tenant_cache(tenant)).await;
    answered(answers, |id, n| {
        vec![json!({
            "model": id,
            "freed_pages": n.freed,
            "poisoned_pages": n.poisoned,
            "host_memory_pages": n.host,
            "disk_pages": n.disk,
        })]
    })
}

/// Sets the tenant with engine id `tenant`'s own cache bounds on every engine of
/// every served model now (its requests carry them too, but an idle tenant sends
/// none). Returns the models that applied them and a line per model that did not.
pub(crate) async fn push_cache_policy(
    state: &AppState,
    tenant: u64,
    policy: CachePolicy,
) -> (Vec<Value>, Vec<String>) {
    let answers = ask_engines(state, "cache limits", move |e| {
        e.set_cache_policy(tenant, policy)
    })
    .await;
    answered(answers, |id, ()| vec![json!(id)])
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
    let answers = ask_engines(&state, "cache report", move |e| {
        let page = e.limits().page_size;
        e.tenant_cache_pages(tenant).map(|n| (n, page))
    })
    .await;
    let (models, failed) = answered(answers, |id, (n, page)| {
        [
            ("engine_pool", n.pool),
            ("host_memory", n.host),
            ("disk", n.disk),
        ]
        .into_iter()
        .map(|(tier, pages)| {
            json!({
                "model": id,
                "tier": tier,
                "cached_pages": pages,
                "cached_tokens": pages.saturating_mul(page),
            })
        })
        .collect()
    });
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
