//! `ai/finetunes`: a tenant's LoRA fine-tunes (issue 38).
//!
//! - `POST /client/v4/accounts/{account_id}/ai/finetunes?model=<base>&name=<name>
//!   [&description=<text>]`, the adapter file as the raw body (GGUF, the form
//!   llama.cpp's `convert_lora_to_gguf.py` writes): checked against the base model
//!   ([`tessera_model::lora::validate`]: architecture, every pair's shapes, rank <=
//!   [`MAX_RANK`], tensor types, data within the file; a 400 names what does not
//!   fit), then stored with its SHA-256 in the store's `finetune_blobs` and audited
//!   (`finetune.create`). Key scope `finetunes:write`.
//! - `GET .../ai/finetunes`: the account's own fine-tunes; `GET .../ai/finetunes/public`:
//!   the public ones; `GET .../ai/finetunes/{id or name}`: one (its own by id or
//!   name, a public one by id). Key scope `inference`.
//! - `DELETE .../ai/finetunes/{id or name}`: deletes one of its own (audited,
//!   `finetune.delete`). Key scope `finetunes:write`.
//!
//! Another account's fine-tune does not exist for the caller: the same 404 as an
//! unknown id, for reads and deletes, so ids and names cannot be probed. Another
//! account's key gets the 403 every account-scoped route gives. Every call counts
//! against the account's rate of usage-API queries; uploads are read up to
//! `max_finetune_bytes` (413 past it), one at a time per account (429 with
//! `retry-after`), after the checks that need no file (name, description, count,
//! base model); then at most [`MAX_UPLOADS`](crate::lora_cache::MAX_UPLOADS) files are decoded at once per gateway,
//! on the CPU pool, in full (so a stored fine-tune always loads).

use crate::cpu::Lane;
use crate::error::{ApiError, ErrorKind, Flavor};
use crate::finetune_resolve::{bad, not_found, store_error};
use crate::http::{envelope, read_body};
use crate::lora_cache::UploadSlot;
use crate::state::{AppState, Ctx};
use crate::usage_api::account_query;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;
use tessera_model::lora::{self, LoraWeights, MAX_RANK};
use tessera_tenancy::store::valid_finetune_name;
use tessera_tenancy::{AuditCtx, Finetune, NewFinetune, Scope, MAX_FINETUNES_PER_TENANT};

/// Longest description, in bytes (as the store's).
const MAX_DESCRIPTION_BYTES: usize = 1024;

/// How long an upload's body may take, as a multiple of the body-read deadline
/// (an adapter is up to hundreds of MB, a request body a few kB).
const UPLOAD_DEADLINE_FACTOR: u32 = 10;

/// Handler: `POST .../ai/finetunes`.
pub(crate) async fn create(
    State(state): State<Arc<AppState>>,
    Path(account): Path<String>,
    Query(q): Query<HashMap<String, String>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let mut ctx = Ctx::new("finetune_create", Flavor::WorkersAi);
    let p = match account_query(&state, &mut ctx, &headers, &account, Scope::FinetunesWrite).await {
        Ok(p) => p,
        Err(refused) => return refused,
    };
    match upload(&state, &ctx, &p, &q, &headers, body).await {
        Ok(f) => ctx.header(axum::Json(envelope(f.api_json(true))).into_response()),
        Err(e) => e.into_response_as(Flavor::WorkersAi, &ctx.rid),
    }
}

async fn upload(
    state: &AppState,
    ctx: &Ctx,
    p: &tessera_tenancy::Principal,
    q: &HashMap<String, String>,
    headers: &HeaderMap,
    body: Body,
) -> Result<Finetune, ApiError> {
    let t = &p.tenant;
    let model = q.get("model").filter(|m| !m.is_empty()).ok_or_else(|| {
        bad(
            "model",
            "model is required: the id of the base model the adapter is for".into(),
        )
    })?;
    let name = q
        .get("name")
        .ok_or_else(|| bad("name", "name is required".into()))?;
    let description = q.get("description").map(String::as_str).unwrap_or("");
    let content_type = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if content_type.starts_with("multipart/") || content_type.starts_with("application/json") {
        return Err(bad(
            "file",
            format!(
                "send the adapter file (GGUF) as the raw request body \
                 (content-type: application/octet-stream), not {content_type}"
            ),
        ));
    }
    // What can be refused without the file, before it is read.
    if !valid_finetune_name(name) {
        return Err(bad(
            "name",
            format!(
                "name must be 1 to 64 characters of A-Z, a-z, 0-9, '.', '_' and '-', not \
                 starting with '.', not `public` and not shaped like an id. Given: {:?}",
                name.chars().take(80).collect::<String>()
            ),
        ));
    }
    if description.len() > MAX_DESCRIPTION_BYTES {
        return Err(bad(
            "description",
            format!("description must be at most {MAX_DESCRIPTION_BYTES} bytes"),
        ));
    }
    let held = state.store.finetunes_of(&t.id).await.map_err(store_error)?;
    if held.iter().any(|f| f.name == *name) {
        return Err(ApiError::new(
            ErrorKind::Conflict,
            format!("this account already has a fine-tune named {name:?}"),
        ));
    }
    if held.len() as i64 >= MAX_FINETUNES_PER_TENANT {
        return Err(ApiError::new(
            ErrorKind::Conflict,
            format!(
                "this account already has {MAX_FINETUNES_PER_TENANT} fine-tunes; delete one first"
            ),
        ));
    }
    // The base model as a run would find it: unknown, removed or private to other
    // accounts answer as they do there.
    let served = crate::pipeline::route(state, &t.id, model).await?;
    // One upload per account at a time (a slow one holds only its own account's).
    let Some(_own) = UploadSlot::take(&state.finetune_uploading, &t.id) else {
        let mut e = ApiError::new(
            ErrorKind::RateLimited,
            "an upload of this account is still in progress; one at a time",
        );
        e.retry_after = Some(Duration::from_secs(5));
        e.retryable = true;
        return Err(e);
    };
    let deadline = state.deadlines.body_read * UPLOAD_DEADLINE_FACTOR;
    let bytes = tokio::time::timeout(deadline, read_body(headers, body, state.max_finetune_bytes))
        .await
        .map_err(|_| {
            ApiError::new(
                ErrorKind::Timeout,
                format!(
                    "the adapter file was not received within {} s",
                    deadline.as_secs()
                ),
            )
        })??;
    // At most MAX_UPLOADS files decoded at once (each as f32 besides its bytes).
    let _checking = state
        .finetune_uploads
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| ApiError::new(ErrorKind::Unavailable, "the gateway is shutting down"))?;
    let base = served.model.lora_base.clone();
    let (base_id, layers) = (served.entry.id.clone(), served.model.config().layers);
    let data = bytes.clone();
    let summary = state
        .cpu
        .run(Lane::Request, &t.id, move || {
            // Decoded in full, as a request will load it: a file that passes here
            // runs (finite values, readable blocks).
            let summary = lora::validate(&data, &base, &base_id, MAX_RANK)?;
            LoraWeights::load(&data, &base, &base_id, layers)?;
            Ok::<_, lora::LoraError>(summary)
        })
        .await
        .map_err(|e| {
            bad(
                "file",
                format!("the adapter does not fit model {}: {e}", served.entry.id),
            )
        })?;
    let by = AuditCtx {
        request_id: ctx.rid.clone(),
        source: format!("key:{}", p.key_id),
    };
    let f = state
        .store
        .audited(&by)
        .create_finetune(&NewFinetune {
            tenant_id: &t.id,
            name,
            base_model: &served.entry.id,
            description,
            rank: summary.rank as u32,
            alpha: f64::from(summary.alpha),
            targets: summary.targets.len() as u32,
            data: &bytes,
        })
        .await
        .map_err(store_error)?;
    tracing::info!(
        tenant = %t.id, id = %f.id, model = %f.base_model, size = f.size_bytes, rank = f.rank,
        "fine-tune stored"
    );
    Ok(f)
}

/// Handler: `GET .../ai/finetunes` (the caller's own).
pub(crate) async fn list(
    State(state): State<Arc<AppState>>,
    Path(account): Path<String>,
    headers: HeaderMap,
) -> Response {
    list_where(&state, &account, &headers, false).await
}

/// Handler: `GET .../ai/finetunes/public`.
pub(crate) async fn list_public(
    State(state): State<Arc<AppState>>,
    Path(account): Path<String>,
    headers: HeaderMap,
) -> Response {
    list_where(&state, &account, &headers, true).await
}

/// The caller's own fine-tunes, or (`public`) every public one.
async fn list_where(
    state: &AppState,
    account: &str,
    headers: &HeaderMap,
    public: bool,
) -> Response {
    let mut ctx = Ctx::new("finetune_list", Flavor::WorkersAi);
    let p = match account_query(state, &mut ctx, headers, account, Scope::Inference).await {
        Ok(p) => p,
        Err(refused) => return refused,
    };
    let me = &p.tenant.id;
    let all = if public {
        state.store.public_finetunes().await
    } else {
        state.store.finetunes_of(me).await
    };
    match all {
        Ok(all) => {
            let v: Vec<Value> = all.iter().map(|f| f.api_json(&f.tenant_id == me)).collect();
            ctx.header(axum::Json(envelope(json!(v))).into_response())
        }
        Err(e) => store_error(e).into_response_as(Flavor::WorkersAi, &ctx.rid),
    }
}

/// Handler: `GET .../ai/finetunes/{id or name}`.
pub(crate) async fn show(
    State(state): State<Arc<AppState>>,
    Path((account, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let mut ctx = Ctx::new("finetune_show", Flavor::WorkersAi);
    let p = match account_query(&state, &mut ctx, &headers, &account, Scope::Inference).await {
        Ok(p) => p,
        Err(refused) => return refused,
    };
    let t = &p.tenant;
    match state.store.finetune_for(&t.id, &id).await {
        Ok(Some(f)) => {
            let own = f.tenant_id == t.id;
            ctx.header(axum::Json(envelope(f.api_json(own))).into_response())
        }
        Ok(None) => not_found(&id).into_response_as(Flavor::WorkersAi, &ctx.rid),
        Err(e) => store_error(e).into_response_as(Flavor::WorkersAi, &ctx.rid),
    }
}

/// Handler: `DELETE .../ai/finetunes/{id or name}` (the caller's own only).
pub(crate) async fn delete(
    State(state): State<Arc<AppState>>,
    Path((account, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    let mut ctx = Ctx::new("finetune_delete", Flavor::WorkersAi);
    let p = match account_query(&state, &mut ctx, &headers, &account, Scope::FinetunesWrite).await {
        Ok(p) => p,
        Err(refused) => return refused,
    };
    let by = AuditCtx {
        request_id: ctx.rid.clone(),
        source: format!("key:{}", p.key_id),
    };
    match state
        .store
        .audited(&by)
        .delete_finetune(&p.tenant.id, &id)
        .await
    {
        Ok(Some(f)) => {
            ctx.header(axum::Json(envelope(json!({ "id": f.id, "deleted": true }))).into_response())
        }
        Ok(None) => not_found(&id).into_response_as(Flavor::WorkersAi, &ctx.rid),
        Err(e) => store_error(e).into_response_as(Flavor::WorkersAi, &ctx.rid),
    }
}
