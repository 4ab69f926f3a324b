//! The catalog's endpoints (authenticated with an inference key):
//!
//! - `GET /v1/models` and `GET /client/v4/accounts/{account_id}/ai/v1/models`
//!   (OpenAI list: `{"object": "list", "data": [model, ...]}`; the caller's own
//!   fine-tunes follow the catalog's models as `<base>:<name>`),
//! - `GET /v1/models/{id}` and `.../ai/v1/models/{id}` (one model; an alias resolves
//!   to its model, whose `id` is the catalog id; `<base>:<fine-tune>` is the caller's
//!   fine-tune as listed, or a public one by id),
//! - `GET /client/v4/accounts/{account_id}/ai/models/search` (Workers AI:
//!   `{"result": [...], "result_info": {"page", "per_page", "count",
//!   "total_count"}, "success": true, ...}`) with the public API's filters `task`
//!   (task name or id, e.g. `Text Generation` or `text-generation`), `search`
//!   (substring of id, alias, description or tag), `author` (e.g. `huggingfacetb`),
//!   `page` (from 1) and `per_page` (1 to [`MAX_PER_PAGE`], default
//!   [`DEFAULT_PER_PAGE`]); other parameters of the public API are accepted and
//!   ignored. A malformed `page`/`per_page` is a 400 naming it.
//!
//! Every model object carries the GGUF's metadata (`context_window`, `parameters`,
//! `quantization`, `chat_template`) and the deployment file's (`description`,
//! `tags`, `aliases`, `deprecated`, `sunset` dates or null). Models past their
//! sunset are not listed, and asking for one is a 404 with Workers AI code 5007,
//! as for an unknown id. Answers about a deprecated model carry `Deprecation` and
//! `Sunset` headers.

use crate::catalog::{now_secs, CatalogEntry, Lookup};
use crate::error::{ApiError, ErrorKind, Flavor};
use crate::http::{authenticate, envelope};
use crate::state::{AppState, Ctx};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use tessera_tenancy::Principal;

/// `per_page` when a search gives none.
pub(crate) const DEFAULT_PER_PAGE: usize = 20;
/// Largest `per_page`.
pub(crate) const MAX_PER_PAGE: usize = 100;

/// The metadata every model object carries, both shapes.
fn metadata(e: &CatalogEntry) -> Value {
    json!({
        "description": e.description,
        "task": e.task,
        "author": e.author,
        "context_window": e.context_window,
        "parameters": e.parameters,
        "quantization": e.quantization,
        "chat_template": e.chat_template,
        "tags": e.tags,
        "aliases": e.aliases,
        "deprecated": e.deprecated.as_ref().map(|d| &d.date),
        "sunset": e.sunset.as_ref().map(|d| &d.date),
    })
}

/// An OpenAI model object: `id`, `object`, `created`, `owned_by`, then the metadata.
fn openai_object(e: &CatalogEntry) -> Value {
    let mut v = json!({"id": e.id, "object": "model", "created": 0, "owned_by": e.author});
    if let (Some(o), Value::Object(m)) = (v.as_object_mut(), metadata(e)) {
        o.extend(m);
    }
    v
}

/// A tenant's fine-tune of `base` as an OpenAI model object: `id` is
/// `<base>:<name>`, `owned_by` the account, `parent`/`root` the base model, with the
/// base's metadata and a `finetune` object (`id`, `name`).
fn finetune_object(base: &CatalogEntry, f: &tessera_tenancy::Finetune) -> Value {
    let mut v = openai_object(base);
    v["id"] = json!(format!("{}:{}", base.id, f.name));
    v["created"] = json!(f.created_ms / 1000);
    v["owned_by"] = json!(f.tenant_id);
    v["parent"] = json!(base.id);
    v["root"] = json!(base.id);
    v["finetune"] = json!({"id": f.id, "name": f.name});
    v
}

/// A Workers AI search result: `id`/`name` (the catalog id), `task` as an object,
/// `properties` (`context_window`, `parameters`, `quantization`), then the metadata.
fn workers_object(e: &CatalogEntry) -> Value {
    let mut v = json!({
        "id": e.id,
        "name": e.id,
        "task": {"id": "text-generation", "name": e.task, "description": "Generation of text from a prompt or a conversation"},
        "properties": [
            {"property_id": "context_window", "value": e.context_window.to_string()},
            {"property_id": "parameters", "value": e.parameters.to_string()},
            {"property_id": "quantization", "value": e.quantization},
        ],
    });
    if let (Some(o), Value::Object(mut m)) = (v.as_object_mut(), metadata(e)) {
        m.remove("task");
        o.extend(m);
    }
    v
}

/// Authenticates the caller (inference scope) or renders the refusal.
async fn caller(
    state: &AppState,
    ctx: &mut Ctx,
    headers: &HeaderMap,
    account: Option<&str>,
) -> Result<Principal, Response> {
    let scope = tessera_tenancy::Scope::Inference;
    authenticate(state, ctx, headers, account, scope)
        .await
        .map_err(|(reason, e)| ctx.refuse(state, reason, e))
}

/// The models listed to `p` now: served (not past sunset) and public or private to
/// its account, in catalog order.
async fn listed<'a>(state: &'a AppState, p: &Principal) -> Result<Vec<&'a CatalogEntry>, ApiError> {
    let access = state.store.list_model_access().await.map_err(store_down)?;
    let now = now_secs();
    Ok(state
        .catalog
        .entries()
        .iter()
        .filter(|e| !e.removed_at(now))
        .filter(|e| {
            access
                .iter()
                .find(|a| a.model == e.id)
                .is_none_or(|a| a.allows(&p.tenant.id))
        })
        .collect())
}

fn store_down(e: tessera_tenancy::StoreError) -> ApiError {
    tracing::error!(error = %e, "cannot read model access");
    ApiError::new(ErrorKind::Unavailable, "model access store unavailable")
}

/// Whether account `tenant_id` may use model `e` (asked for as `asked`): public, or
/// private with the account listed. A refusal is a 403 with Workers AI code 5018
/// naming the model, or, with `private_models_as_404`, exactly the 404 of an
/// unknown model (so private ids cannot be probed).
///
/// Errors: the refusal; 503 when the store cannot be read.
pub(crate) async fn check_access(
    state: &AppState,
    tenant_id: &str,
    e: &CatalogEntry,
    asked: &str,
) -> Result<(), ApiError> {
    let access = state.store.model_access(&e.id).await.map_err(store_down)?;
    if access.allows(tenant_id) {
        return Ok(());
    }
    if state.private_models_as_404 {
        return Err(crate::model_check::no_such_model(asked));
    }
    let mut err = ApiError::new(
        ErrorKind::ModelNotAllowed,
        format!("model {} is private; this account may not use it", e.id),
    );
    err.param = Some("model".into());
    Err(err)
}

/// Adds a model's `Deprecation`/`Sunset` headers to `r`.
pub(crate) fn with_lifecycle(mut r: Response, e: &CatalogEntry) -> Response {
    for (name, value) in e.lifecycle_headers() {
        if let Ok(v) = HeaderValue::from_str(&value) {
            r.headers_mut().insert(name, v);
        }
    }
    r
}

/// The 404 for a model past its sunset (Workers AI code 5007, as an unknown id).
pub(crate) fn removed(e: &CatalogEntry) -> ApiError {
    let date = e.sunset.as_ref().map_or("", |d| d.date.as_str());
    let mut err = ApiError::new(
        ErrorKind::NoSuchModel,
        format!("model {} was removed on {date}", e.id),
    );
    err.param = Some("model".into());
    err
}

async fn list(state: Arc<AppState>, headers: HeaderMap, account: Option<String>) -> Response {
    let mut ctx = Ctx::new("models", Flavor::OpenAi);
    let p = match caller(&state, &mut ctx, &headers, account.as_deref()).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let listed = match listed(&state, &p).await {
        Ok(l) => l,
        Err(e) => return e.into_response_as(Flavor::OpenAi, &ctx.rid),
    };
    let mut data: Vec<Value> = listed.iter().map(|e| openai_object(e)).collect();
    // The caller's own fine-tunes of the listed models, as `base:name` (what
    // `model` takes): where to find them without the fine-tunes API.
    match state.store.finetunes_of(&p.tenant.id).await {
        Ok(fts) => data.extend(fts.iter().filter_map(|f| {
            let base = listed.iter().find(|e| e.id == f.base_model)?;
            Some(finetune_object(base, f))
        })),
        Err(e) => return store_down(e).into_response_as(Flavor::OpenAi, &ctx.rid),
    }
    ctx.header(axum::Json(json!({"object": "list", "data": data})).into_response())
}

async fn one(
    state: Arc<AppState>,
    headers: HeaderMap,
    account: Option<String>,
    id: String,
) -> Response {
    let mut ctx = Ctx::new("models", Flavor::OpenAi);
    let p = match caller(&state, &mut ctx, &headers, account.as_deref()).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let id = id.trim_start_matches('/');
    match state.catalog.lookup(id, now_secs()) {
        Lookup::Served(e) => match check_access(&state, &p.tenant.id, e, id).await {
            Ok(()) => with_lifecycle(ctx.header(axum::Json(openai_object(e)).into_response()), e),
            Err(err) => err.into_response_as(Flavor::OpenAi, &ctx.rid),
        },
        Lookup::Removed(e) => removed(e).into_response_as(Flavor::OpenAi, &ctx.rid),
        Lookup::Unknown => match one_finetune(&state, &p, id).await {
            Ok(v) => ctx.header(axum::Json(v).into_response()),
            Err(err) => err.into_response_as(Flavor::OpenAi, &ctx.rid),
        },
    }
}

/// `<base>:<fine-tune>` as `GET /v1/models/{id}` answers it: the caller's own
/// fine-tune by name or id (the object `/v1/models` lists), or a public one by id
/// (named by id, its owner not shown). Anything else, another account's fine-tune
/// included, is the 404 of an unknown model; a base model the caller may not use
/// is refused as when asked for alone.
async fn one_finetune(state: &AppState, p: &Principal, id: &str) -> Result<Value, ApiError> {
    let unknown = || crate::model_check::no_such_model(id);
    let (base_id, name) = id.split_once(':').ok_or_else(unknown)?;
    let Lookup::Served(base) = state.catalog.lookup(base_id, now_secs()) else {
        return Err(unknown());
    };
    check_access(state, &p.tenant.id, base, base_id).await?;
    let f = state
        .store
        .finetune_for(&p.tenant.id, name)
        .await
        .map_err(crate::finetune_resolve::store_error)?
        .filter(|f| f.base_model == base.id)
        .ok_or_else(unknown)?;
    let mut v = finetune_object(base, &f);
    if f.tenant_id != p.tenant.id {
        v["id"] = json!(format!("{}:{}", base.id, f.id));
        v["owned_by"] = json!("public");
        v["finetune"] = json!({"id": f.id});
    }
    Ok(v)
}

/// A `page`/`per_page` query value: an integer in `min..=max`, or the 400 naming it.
fn page_param(
    q: &HashMap<String, String>,
    name: &str,
    default: usize,
    max: usize,
) -> Result<usize, ApiError> {
    let Some(v) = q.get(name) else {
        return Ok(default);
    };
    match v.trim().parse::<usize>() {
        Ok(n) if (1..=max).contains(&n) => Ok(n),
        _ => Err(ApiError::field(
            name,
            format!("`{name}` must be an integer from 1 to {max}. Given: {v}"),
        )),
    }
}

/// The `models/search` filters: `search` (in id, alias, description or tag),
/// `task` (name or `text-generation`), `author`; all case-insensitive.
fn matches(e: &CatalogEntry, q: &HashMap<String, String>) -> bool {
    let has = |hay: &str, needle: &str| hay.to_lowercase().contains(&needle.to_lowercase());
    let search = q.get("search").is_none_or(|s| {
        has(&e.id, s)
            || has(&e.description, s)
            || e.aliases.iter().chain(&e.tags).any(|t| has(t, s))
    });
    let task = q.get("task").is_none_or(|t| {
        t.eq_ignore_ascii_case(&e.task) || t.eq_ignore_ascii_case("text-generation")
    });
    let author = q
        .get("author")
        .is_none_or(|a| a.eq_ignore_ascii_case(&e.author));
    search && task && author
}

/// `GET /v1/models`.
pub(crate) async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    list(state, headers, None).await
}

/// `GET /client/v4/accounts/{account_id}/ai/v1/models`.
pub(crate) async fn models_scoped(
    State(state): State<Arc<AppState>>,
    Path(account): Path<String>,
    headers: HeaderMap,
) -> Response {
    list(state, headers, Some(account)).await
}

/// `GET /v1/models/{id}`.
pub(crate) async fn model(
    State(state): State<Arc<AppState>>,
    Path(id): Path<String>,
    headers: HeaderMap,
) -> Response {
    one(state, headers, None, id).await
}

/// `GET /client/v4/accounts/{account_id}/ai/v1/models/{id}`.
pub(crate) async fn model_scoped(
    State(state): State<Arc<AppState>>,
    Path((account, id)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    one(state, headers, Some(account), id).await
}

/// `GET /client/v4/accounts/{account_id}/ai/models/search`.
pub(crate) async fn models_search(
    State(state): State<Arc<AppState>>,
    Path(account): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    let mut ctx = Ctx::new("models", Flavor::WorkersAi);
    let p = match caller(&state, &mut ctx, &headers, Some(&account)).await {
        Ok(p) => p,
        Err(r) => return r,
    };
    let paging = page_param(&query, "page", 1, usize::MAX).and_then(|page| {
        page_param(&query, "per_page", DEFAULT_PER_PAGE, MAX_PER_PAGE).map(|pp| (page, pp))
    });
    let (page, per_page) = match paging {
        Ok(x) => x,
        Err(e) => return e.into_response_as(Flavor::WorkersAi, &ctx.rid),
    };
    let found: Vec<&CatalogEntry> = match listed(&state, &p).await {
        Ok(l) => l.into_iter().filter(|e| matches(e, &query)).collect(),
        Err(e) => return e.into_response_as(Flavor::WorkersAi, &ctx.rid),
    };
    let skip = (page - 1).saturating_mul(per_page);
    let result: Vec<Value> = found
        .iter()
        .skip(skip)
        .take(per_page)
        .map(|e| workers_object(e))
        .collect();
    let mut body = envelope(Value::Array(result.clone()));
    body["result_info"] = json!({
        "page": page, "per_page": per_page, "count": result.len(), "total_count": found.len(),
    });
    ctx.header(axum::Json(body).into_response())
}
