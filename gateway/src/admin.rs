//! Admin API (`/admin/v1/...`), behind `Authorization: Bearer <admin token>`
//! compared in constant time. Disabled (404) when no admin token is configured.
//! Tokens shorter than [`MIN_TOKEN_BYTES`] or with fewer than
//! [`MIN_TOKEN_DISTINCT_BYTES`] distinct bytes are refused at start ([`check_token`]);
//! tokens are compared without surrounding whitespace, and a missing or empty
//! `Authorization` header never matches anything.
//!
//! - `GET  /admin/v1/tenants`, `POST /admin/v1/tenants` `{name, limits?, create_key?}`
//!   (missing limit fields take the configured default limits)
//! - `GET  /admin/v1/tenants/{id}`
//! - `POST /admin/v1/tenants/{id}/suspend`, `POST /admin/v1/tenants/{id}/activate`
//! - `PUT  /admin/v1/tenants/{id}/limits` (a partial [`Limits`] object: the fields
//!   given replace the tenant's, unknown fields are an error)
//! - `PUT  /admin/v1/tenants/{id}/scheduling` `{weight?, max_priority?}` (fair-share
//!   weight 1..=1000; highest class `interactive` | `batch`; fields not given keep
//!   their value, unknown fields are an error)
//! - `PUT  /admin/v1/tenants/{id}/cache-limits` `{max_cached_tokens?, idle_ttl_secs?}`
//!   (the tenant's own bounds on its cached KV per engine; 0: none)
//! - `POST /admin/v1/tenants/{id}/rotate-cache-salt` (a fresh prefix-cache salt:
//!   nothing the tenant cached before is found again; its old pages are purged on
//!   every engine, spilled ones made unreadable)
//! - `POST /admin/v1/tenants/{id}/purge-cache` (every prefix-cache page of the
//!   tenant dropped on every engine; answers once each engine confirmed)
//! - `GET  /admin/v1/tenants/{id}/keys`,
//!   `POST /admin/v1/tenants/{id}/keys` `{name?, scopes?, expires_at? | expires_in_secs?}`
//! - `POST /admin/v1/keys/{key_id}/revoke`
//! - `GET  /admin/v1/tenants/{id}/usage?since=&until=&group_by=`
//! - `GET  /admin/v1/audit?since=&until=&limit=` (the audit log, oldest first)
//! - `GET  /admin/v1/models` (every model of this gateway's catalog with its access)
//! - `GET  /admin/v1/model-access/{model}`, `PUT /admin/v1/model-access/{model}`
//!   `{visibility: "public" | "private", tenants?: [tenant id, ...]}` (who may use
//!   a model, by id or alias: everyone, or only the tenants listed; replaces what
//!   was set; unknown fields, a bad visibility, tenants that are not strings or not
//!   tenants, or tenants on a public model are errors naming the field)
//! - `POST /admin/v1/reload` (`tessera serve --config FILE`: re-read FILE and apply
//!   its node membership, as SIGHUP does; 400 with the reason when the file is
//!   refused, then nothing changed; logged with the caller's address, not audited:
//!   the audit log records tenant, key and model-access changes),
//!   `GET /admin/v1/nodes` (the nodes this gateway routes to, with their state)
//! - `GET  /metrics` (Prometheus text format; the admin token or the metrics token)
//!
//! Every successful change (tenant create, suspend, activate, limits, scheduling,
//! cache salt, cache purge; key create, revoke; model access) writes one audit row in the change's transaction: time, action, target,
//! the admin request's id (its `x-request-id`) and the peer address. Revoking a key
//! or suspending a tenant also aborts its requests in flight.

use crate::error::{ApiError, ErrorKind, Flavor};
use crate::http::{envelope, read_body_in_time};
use crate::state::AppState;
use axum::extract::{ConnectInfo, Extension, Path, Query, Request, State};
use axum::http::{HeaderMap, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::Router;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use subtle::ConstantTimeEq;
use tessera_tenancy::store::parse_time;
use tessera_tenancy::{
    AuditCtx, CacheLimits, Limits, LimitsPatch, NewKey, PriorityCeiling, Scheduling, Scopes,
    StoreError, TenantStatus,
};

/// Shortest accepted admin or metrics token, in bytes.
pub const MIN_TOKEN_BYTES: usize = 32;

/// Fewest distinct bytes an admin or metrics token may have (issue 32): a token of
/// one repeated character (or a short pattern) is guessable whatever its length.
/// Generate tokens with `openssl rand -base64 32` (44 characters of a 65-letter
/// alphabet: under 16 distinct practically never happens). Hex is a poor fit:
/// all 16 digits appear in a 64-digit `openssl rand -hex 32` only about three
/// times in four, so about one such token in four is refused.
pub const MIN_TOKEN_DISTINCT_BYTES: usize = 16;

/// An admin or metrics token that cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TokenError {
    /// Shorter than [`MIN_TOKEN_BYTES`] (after trimming whitespace).
    #[error(
        "refusing to start: the {what} is {len} bytes; it must be at least {MIN_TOKEN_BYTES} \
         (an empty or short token would let anyone in; generate one with `openssl rand -base64 32`)"
    )]
    Short {
        /// Which token (`admin token`, or where it came from).
        what: String,
        /// Its length in bytes (after trimming whitespace).
        len: usize,
    },
    /// Fewer than [`MIN_TOKEN_DISTINCT_BYTES`] distinct bytes.
    #[error(
        "refusing to start: the {what} has {distinct} distinct bytes; it must have at least \
         {MIN_TOKEN_DISTINCT_BYTES} (a repeated or patterned token is guessable; generate one \
         with `openssl rand -base64 32`: a hex token has only 16 letters to draw from)"
    )]
    Repetitive {
        /// Which token (`admin token`, or where it came from).
        what: String,
        /// How many distinct bytes it has (after trimming whitespace).
        distinct: usize,
    },
}

/// Checks that token `t` (named `what` in the error), without surrounding
/// whitespace, is at least [`MIN_TOKEN_BYTES`] bytes with at least
/// [`MIN_TOKEN_DISTINCT_BYTES`] distinct ones.
pub fn check_token(what: &str, t: &str) -> Result<(), TokenError> {
    let t = t.trim();
    if t.len() < MIN_TOKEN_BYTES {
        return Err(TokenError::Short {
            what: what.into(),
            len: t.len(),
        });
    }
    let mut seen = [false; 256];
    for b in t.bytes() {
        seen[usize::from(b)] = true;
    }
    let distinct = seen.iter().filter(|s| **s).count();
    if distinct < MIN_TOKEN_DISTINCT_BYTES {
        return Err(TokenError::Repetitive {
            what: what.into(),
            distinct,
        });
    }
    Ok(())
}

/// Who made an admin request: its id and peer address (for the audit row).
#[derive(Clone, Debug)]
struct AdminReq {
    rid: String,
    source: String,
}

impl AdminReq {
    fn audit(&self) -> AuditCtx {
        AuditCtx {
            request_id: self.rid.clone(),
            source: self.source.clone(),
        }
    }
}

/// The admin routes (every one requires the admin token, checked by
/// [`require_admin`] before the handler runs) and `/metrics` (admin or metrics
/// token, [`require_metrics`]).
pub(crate) fn routes(state: Arc<AppState>) -> Router<Arc<AppState>> {
    let metrics_route =
        Router::new()
            .route("/metrics", get(metrics))
            .route_layer(middleware::from_fn_with_state(
                state.clone(),
                require_metrics,
            ));
    Router::new()
        .route("/admin/v1/tenants", get(list_tenants).post(create_tenant))
        .route("/admin/v1/tenants/{id}", get(get_tenant))
        .route("/admin/v1/tenants/{id}/suspend", post(suspend))
        .route("/admin/v1/tenants/{id}/activate", post(activate))
        .route("/admin/v1/tenants/{id}/limits", put(set_limits))
        .route("/admin/v1/tenants/{id}/scheduling", put(set_scheduling))
        .route("/admin/v1/tenants/{id}/cache-limits", put(set_cache_limits))
        .route(
            "/admin/v1/tenants/{id}/rotate-cache-salt",
            post(rotate_cache_salt),
        )
        .route("/admin/v1/tenants/{id}/purge-cache", post(purge_cache))
        .route(
            "/admin/v1/tenants/{id}/keys",
            get(list_keys).post(create_key),
        )
        .route("/admin/v1/tenants/{id}/usage", get(usage))
        .route("/admin/v1/keys/{key_id}/revoke", post(revoke))
        .route("/admin/v1/models", get(list_models))
        .route(
            "/admin/v1/model-access/{*model}",
            get(get_model_access).put(set_model_access),
        )
        .route("/admin/v1/audit", get(audit))
        .route("/admin/v1/reload", post(reload))
        .route("/admin/v1/nodes", get(nodes))
        .route_layer(middleware::from_fn_with_state(state, require_admin))
        .merge(metrics_route)
}

async fn require_admin(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    guarded(s, req, next, false).await
}

async fn require_metrics(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    guarded(s, req, next, true).await
}

/// Checks the token, then runs the handler with an [`AdminReq`] and answers with
/// its `x-request-id`. A failure is counted (`admin_auth`) and writes nothing.
async fn guarded(s: Arc<AppState>, mut req: Request, next: Next, metrics_ok: bool) -> Response {
    let rid = tessera_tenancy::random_hex(16);
    if let Err(e) = check(&s, req.headers(), metrics_ok) {
        s.metrics.refused("admin_auth");
        return e.into_response_as(Flavor::WorkersAi, &rid);
    }
    let source = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.to_string())
        .unwrap_or_else(|| "unknown".into());
    req.extensions_mut().insert(AdminReq {
        rid: rid.clone(),
        source,
    });
    let mut resp = next.run(req).await;
    if let Ok(v) = HeaderValue::from_str(&rid) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// Whether `given` equals the configured `expected` token (constant time in the
/// token's bytes). An empty side never matches.
fn token_matches(expected: Option<&str>, given: &str) -> bool {
    match expected {
        Some(e) if !e.is_empty() && !given.is_empty() => {
            given.len() == e.len() && bool::from(given.as_bytes().ct_eq(e.as_bytes()))
        }
        _ => false,
    }
}

fn check(state: &AppState, headers: &HeaderMap, metrics_ok: bool) -> Result<(), ApiError> {
    let metrics_token = state.metrics_token.as_deref().filter(|_| metrics_ok);
    if state.admin_token.is_none() && metrics_token.is_none() {
        return Err(ApiError::new(
            ErrorKind::NotFound,
            "admin API is disabled (no admin token configured)",
        ));
    }
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim())
        .unwrap_or("");
    if token_matches(state.admin_token.as_deref(), given) || token_matches(metrics_token, given) {
        Ok(())
    } else {
        Err(ApiError::new(
            ErrorKind::Unauthenticated,
            if metrics_ok {
                "admin or metrics token required"
            } else {
                "admin token required"
            },
        ))
    }
}

/// A successful admin answer: the Workers AI envelope around a JSON value.
struct Done(Value);

/// A failed admin answer, in the Workers AI error shape.
struct Fail(ApiError);

type Reply = Result<Done, Fail>;

impl IntoResponse for Done {
    fn into_response(self) -> Response {
        axum::Json(envelope(self.0)).into_response()
    }
}

impl IntoResponse for Fail {
    fn into_response(self) -> Response {
        self.0.into_response_as(Flavor::WorkersAi, "")
    }
}

impl From<ApiError> for Fail {
    fn from(e: ApiError) -> Self {
        Self(e)
    }
}

impl From<StoreError> for Fail {
    fn from(e: StoreError) -> Self {
        Self(match e {
            StoreError::NoTenant(t) => {
                ApiError::new(ErrorKind::NotFound, format!("no tenant with id {t}"))
            }
            StoreError::Invalid(m) => ApiError::new(ErrorKind::BadRequest, m),
            e => ApiError::new(ErrorKind::Unavailable, e.to_string()),
        })
    }
}

async fn json_body(state: &AppState, req: Request) -> Result<Value, ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = read_body_in_time(state, &parts.headers, body).await?;
    if bytes.is_empty() {
        return Ok(json!({}));
    }
    Ok(Value::Object(crate::validation::parse_object(&bytes)?))
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let limits = s.limiter.health().await;
    s.metrics
        .set_limits(limits.up, s.limiter.backend_errors(), s.limiter.fallbacks());
    let body = s
        .metrics
        .render_with(s.engine_stats(), s.inflight(), s.engine.node_metrics());
    (
        [(
            "content-type",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        body,
    )
        .into_response()
}

async fn list_tenants(State(s): State<Arc<AppState>>) -> Reply {
    Ok(Done(json!(s.store.list_tenants().await?)))
}

fn name_field(body: &Value, default: Option<&str>) -> Result<String, ApiError> {
    let name = match body.get("name") {
        None | Some(Value::Null) => default
            .map(String::from)
            .ok_or_else(|| ApiError::field("name", "`name` must be a string"))?,
        Some(Value::String(n)) => n.clone(),
        Some(_) => return Err(ApiError::field("name", "`name` must be a string")),
    };
    crate::validation::check_len("name", &name)?;
    Ok(name)
}

fn limits_patch(v: &Value) -> Result<LimitsPatch, ApiError> {
    serde_json::from_value(v.clone())
        .map_err(|e| ApiError::field("limits", format!("`limits`: {e}")))
}

async fn create_tenant(
    State(s): State<Arc<AppState>>,
    Extension(by): Extension<AdminReq>,
    req: Request,
) -> Reply {
    let body = json_body(&s, req).await?;
    let name = name_field(&body, None)?;
    let limits: Limits = match body.get("limits") {
        None | Some(Value::Null) => s.default_limits,
        Some(l) => limits_patch(l)?.apply(s.default_limits),
    };
    let by = by.audit();
    let admin = s.store.audited(&by);
    let t = admin.create_tenant(&name, limits).await?;
    let mut out = json!({"tenant": t});
    if body
        .get("create_key")
        .and_then(Value::as_bool)
        .unwrap_or(false)
    {
        let (info, key) = admin.create_key(&t.id, &NewKey::named("default")).await?;
        out["key"] = json!({"info": info, "secret": key});
    }
    Ok(Done(out))
}

async fn get_tenant(State(s): State<Arc<AppState>>, Path(id): Path<String>) -> Reply {
    match s.store.tenant(&id).await? {
        Some(t) => Ok(Done(json!(t))),
        None => Err(StoreError::NoTenant(id).into()),
    }
}

async fn set_status(s: Arc<AppState>, by: AdminReq, id: String, st: TenantStatus) -> Reply {
    s.store.audited(&by.audit()).set_status(&id, st).await?;
    if st == TenantStatus::Suspended {
        s.live.kick();
    }
    Ok(Done(json!({"id": id, "status": st})))
}

async fn suspend(
    State(s): State<Arc<AppState>>,
    Extension(by): Extension<AdminReq>,
    Path(id): Path<String>,
) -> Reply {
    set_status(s, by, id, TenantStatus::Suspended).await
}

async fn activate(
    State(s): State<Arc<AppState>>,
    Extension(by): Extension<AdminReq>,
    Path(id): Path<String>,
) -> Reply {
    set_status(s, by, id, TenantStatus::Active).await
}

async fn set_limits(
    State(s): State<Arc<AppState>>,
    Extension(by): Extension<AdminReq>,
    Path(id): Path<String>,
    req: Request,
) -> Reply {
    let body = json_body(&s, req).await?;
    let patch = limits_patch(&body)?;
    let Some(t) = s.store.tenant(&id).await? else {
        return Err(StoreError::NoTenant(id).into());
    };
    let l = patch.apply(t.limits);
    s.store.audited(&by.audit()).set_limits(&id, l).await?;
    Ok(Done(json!({"id": id, "limits": l})))
}

/// The JSON body of `req` as a patch of `field` (a 400 naming it when it does not
/// parse), then tenant `id` (a 404 when there is none): what a `PUT` of one part
/// of a tenant's record starts from.
async fn tenant_patch<P: serde::de::DeserializeOwned>(
    s: &AppState,
    id: &str,
    req: Request,
    field: &str,
) -> Result<(tessera_tenancy::Tenant, P), Fail> {
    let body = json_body(s, req).await?;
    let patch: P = serde_json::from_value(body)
        .map_err(|e| ApiError::field(field, format!("`{field}`: {e}")))?;
    let Some(t) = s.store.tenant(id).await? else {
        return Err(StoreError::NoTenant(id.to_string()).into());
    };
    Ok((t, patch))
}

/// The body of `PUT .../cache-limits`: the fields given replace the tenant's.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct CacheLimitsPatch {
    max_cached_tokens: Option<u64>,
    idle_ttl_secs: Option<u64>,
}

/// Sets a tenant's own bounds on its cached KV (audited as `tenant.cache_limits`)
/// and pushes them to every engine (the reply names the models that applied them and
/// any that did not confirm; its requests carry them too).
async fn set_cache_limits(
    State(s): State<Arc<AppState>>,
    Extension(by): Extension<AdminReq>,
    Path(id): Path<String>,
    req: Request,
) -> Reply {
    let (t, patch): (_, CacheLimitsPatch) = tenant_patch(&s, &id, req, "cache_limits").await?;
    let c = CacheLimits {
        max_cached_tokens: patch
            .max_cached_tokens
            .unwrap_or(t.cache_limits.max_cached_tokens),
        idle_ttl_secs: patch.idle_ttl_secs.unwrap_or(t.cache_limits.idle_ttl_secs),
        set_ms: 0,
    };
    s.store
        .audited(&by.audit())
        .set_cache_limits(&id, c)
        .await?;
    // Applied on every engine now, not only with the tenant's next request (an
    // idle tenant's pages would otherwise keep the old bounds).
    let Some(t) = s.store.tenant(&id).await? else {
        return Err(StoreError::NoTenant(id).into());
    };
    let policy = crate::pipeline::tenant_context(&t).cache_policy;
    let (applied, failed) = crate::cache_api::push_cache_policy(&s, t.engine_id(), policy).await;
    Ok(Done(
        json!({"id": id, "cache_limits": c, "applied_on": applied, "not_confirmed": failed}),
    ))
}

/// The body of `PUT .../scheduling`: the fields given replace the tenant's.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct SchedulingPatch {
    weight: Option<u32>,
    max_priority: Option<PriorityCeiling>,
}

async fn set_scheduling(
    State(s): State<Arc<AppState>>,
    Extension(by): Extension<AdminReq>,
    Path(id): Path<String>,
    req: Request,
) -> Reply {
    let (t, patch): (_, SchedulingPatch) = tenant_patch(&s, &id, req, "scheduling").await?;
    let sch = Scheduling {
        weight: patch.weight.unwrap_or(t.scheduling.weight),
        max_priority: patch.max_priority.unwrap_or(t.scheduling.max_priority),
    };
    s.store
        .audited(&by.audit())
        .set_scheduling(&id, sch)
        .await?;
    Ok(Done(json!({"id": id, "scheduling": sch})))
}

async fn rotate_cache_salt(
    State(s): State<Arc<AppState>>,
    Extension(by): Extension<AdminReq>,
    Path(id): Path<String>,
) -> Reply {
    s.store.audited(&by.audit()).rotate_cache_salt(&id).await?;
    // The old salt's pages can never be hit again; dropping them now also forgets
    // the key of the tenant's sealed pages on disk (unreadable from here on).
    let Some(t) = s.store.tenant(&id).await? else {
        return Err(StoreError::NoTenant(id).into());
    };
    // The rotation stands either way; engines that did not confirm are named.
    let (models, failed) = crate::cache_api::purge_engines(&s, t.engine_id()).await;
    Ok(Done(
        json!({"id": id, "cache_salt": "rotated", "purged": models, "purge_not_confirmed": failed}),
    ))
}

/// Drops every prefix-cache page of tenant `id` on every engine of every served
/// model (`tessera tenant purge-cache`); 404 for an unknown tenant, 503 naming the
/// models whose engines did not confirm. Audited as `tenant.cache_purge`.
async fn purge_cache(
    State(s): State<Arc<AppState>>,
    Extension(by): Extension<AdminReq>,
    Path(id): Path<String>,
) -> Reply {
    let Some(t) = s.store.tenant(&id).await? else {
        return Err(StoreError::NoTenant(id).into());
    };
    let (models, failed) = crate::cache_api::purge_engines(&s, t.engine_id()).await;
    let detail = json!({ "models": models, "failed": failed });
    s.store
        .audited(&by.audit())
        .record("tenant.cache_purge", &id, detail)
        .await?;
    if let Some(e) = crate::cache_api::unconfirmed(&failed) {
        return Err(e.into());
    }
    Ok(Done(json!({"id": id, "models": models})))
}

/// The catalog entry `name` (id or alias) names, or a 404 (Workers AI 5007).
fn catalog_model<'a>(
    s: &'a AppState,
    name: &str,
) -> Result<&'a crate::catalog::CatalogEntry, ApiError> {
    s.catalog
        .get(name.trim_start_matches('/'))
        .ok_or_else(|| crate::model_check::no_such_model(name.trim_start_matches('/')))
}

async fn list_models(State(s): State<Arc<AppState>>) -> Reply {
    let mut out = Vec::new();
    for e in s.catalog.entries() {
        let access = s.store.model_access(&e.id).await?;
        out.push(json!({"id": e.id, "aliases": e.aliases, "access": access}));
    }
    Ok(Done(json!(out)))
}

async fn get_model_access(State(s): State<Arc<AppState>>, Path(model): Path<String>) -> Reply {
    let e = catalog_model(&s, &model)?;
    Ok(Done(json!(s.store.model_access(&e.id).await?)))
}

/// The body of `PUT /admin/v1/model-access/{model}`: `visibility` (required:
/// `public` | `private`) and `tenants` (an array of tenant ids; only with
/// `private`).
fn access_body(body: &Value) -> Result<(bool, Vec<String>), ApiError> {
    let Value::Object(o) = body else {
        return Err(ApiError::new(
            ErrorKind::BadRequest,
            "body must be an object",
        ));
    };
    if let Some(k) = o
        .keys()
        .find(|k| !["visibility", "tenants"].contains(&k.as_str()))
    {
        return Err(ApiError::field(
            k,
            format!("unknown field `{k}`; expected `visibility`, `tenants`"),
        ));
    }
    let private = match o.get("visibility") {
        Some(Value::String(v)) if v == "public" => false,
        Some(Value::String(v)) if v == "private" => true,
        other => {
            return Err(ApiError::field(
                "visibility",
                format!(
                    "`visibility` must be \"public\" or \"private\". Given: {}",
                    other.map_or("nothing".to_string(), Value::to_string)
                ),
            ))
        }
    };
    let tenants = match o.get("tenants") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|t| t.as_str().map(String::from))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| {
                ApiError::field(
                    "tenants",
                    "`tenants` must be an array of tenant ids (strings)",
                )
            })?,
        Some(v) => {
            return Err(ApiError::field(
                "tenants",
                format!("`tenants` must be an array of tenant ids. Given: {v}"),
            ))
        }
    };
    if !private && !tenants.is_empty() {
        return Err(ApiError::field(
            "tenants",
            "`tenants` lists who may use a private model; a public model takes none",
        ));
    }
    Ok((private, tenants))
}

async fn set_model_access(
    State(s): State<Arc<AppState>>,
    Extension(by): Extension<AdminReq>,
    Path(model): Path<String>,
    req: Request,
) -> Reply {
    let id = catalog_model(&s, &model)?.id.clone();
    let body = json_body(&s, req).await?;
    let (private, tenants) = access_body(&body)?;
    let access = s
        .store
        .audited(&by.audit())
        .set_model_access(&id, private, &tenants)
        .await
        .map_err(|e| match e {
            StoreError::NoTenant(t) => Fail(ApiError::field(
                "tenants",
                format!("`tenants`: no tenant with id {t}"),
            )),
            e => Fail::from(e),
        })?;
    Ok(Done(json!(access)))
}

async fn list_keys(State(s): State<Arc<AppState>>, Path(id): Path<String>) -> Reply {
    Ok(Done(json!(s.store.list_keys(Some(&id)).await?)))
}

/// `scopes` (an array of names, or one space-separated string; default: `inference`
/// and `usage:read`, never `keys:write` or `finetunes:write` unless named) and
/// the expiry (`expires_at`: Unix seconds, YYYY-MM-DD or RFC 3339; or
/// `expires_in_secs`), which must lie in the future.
fn new_key(body: &Value) -> Result<NewKey, ApiError> {
    let name = name_field(body, Some("default"))?;
    let scopes = match body.get("scopes") {
        None | Some(Value::Null) => Scopes::DEFAULT,
        Some(Value::String(s)) => Scopes::parse(s).map_err(|m| ApiError::field("scopes", m))?,
        Some(Value::Array(a)) => {
            let names: Option<Vec<&str>> = a.iter().map(Value::as_str).collect();
            let names = names
                .ok_or_else(|| ApiError::field("scopes", "`scopes` must be an array of strings"))?;
            Scopes::from_names(names)
                .map_err(|m| ApiError::field("scopes", format!("`scopes`: {m}")))?
        }
        Some(_) => {
            return Err(ApiError::field(
                "scopes",
                "`scopes` must be an array of strings",
            ))
        }
    };
    let now = tessera_tenancy::now_ms();
    let expires_ms = match (body.get("expires_at"), body.get("expires_in_secs")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::field(
                "expires_at",
                "give `expires_at` or `expires_in_secs`, not both",
            ))
        }
        (Some(Value::String(t)), None) => Some(parse_time(t).ok_or_else(|| {
            ApiError::field(
                "expires_at",
                format!(
                    "`expires_at` must be Unix seconds, YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ. Given: {t}"
                ),
            )
        })?),
        (Some(Value::Number(n)), None) => Some(
            n.as_i64()
                .and_then(|s| s.checked_mul(1000))
                .ok_or_else(|| ApiError::field("expires_at", "`expires_at` is out of range"))?,
        ),
        (Some(_), None) => {
            return Err(ApiError::field(
                "expires_at",
                "`expires_at` must be a string or Unix seconds",
            ))
        }
        (None, Some(v)) => {
            let secs = v.as_u64().filter(|s| *s > 0).ok_or_else(|| {
                ApiError::field("expires_in_secs", "`expires_in_secs` must be an integer >= 1")
            })?;
            Some(now.saturating_add(secs.saturating_mul(1000).min(i64::MAX as u64) as i64))
        }
        (None, None) => None,
    };
    if let Some(e) = expires_ms {
        if e <= now {
            return Err(ApiError::field(
                "expires_at",
                "`expires_at` must lie in the future",
            ));
        }
    }
    Ok(NewKey {
        name,
        scopes,
        expires_ms,
    })
}

async fn create_key(
    State(s): State<Arc<AppState>>,
    Extension(by): Extension<AdminReq>,
    Path(id): Path<String>,
    req: Request,
) -> Reply {
    let body = json_body(&s, req).await?;
    let key = new_key(&body)?;
    let (info, secret) = s.store.audited(&by.audit()).create_key(&id, &key).await?;
    Ok(Done(json!({"info": info, "secret": secret})))
}

async fn revoke(
    State(s): State<Arc<AppState>>,
    Extension(by): Extension<AdminReq>,
    Path(key_id): Path<String>,
) -> Reply {
    if !s.store.audited(&by.audit()).revoke_key(&key_id).await? {
        return Err(ApiError::new(
            ErrorKind::NotFound,
            format!("no active key with id {key_id}"),
        )
        .into());
    }
    s.live.kick();
    Ok(Done(json!({"key_id": key_id, "revoked": true})))
}

/// `POST /admin/v1/reload`: re-reads the deployment file (`tessera serve --config`)
/// and applies its node membership (the same as SIGHUP). 200 with what changed, or
/// 400 with why the file was refused (then nothing changed).
async fn reload(State(s): State<Arc<AppState>>, Extension(by): Extension<AdminReq>) -> Reply {
    tracing::info!(source = %by.source, request_id = %by.rid, "deployment reload asked for through the admin API");
    let st = s.clone();
    let out = tokio::task::spawn_blocking(move || st.reload_deployment("admin API"))
        .await
        .map_err(|e| ApiError::new(ErrorKind::Internal, format!("the reload task failed: {e}")))?;
    match out {
        Ok(v) => Ok(Done(v)),
        Err(e) => Err(ApiError::new(ErrorKind::BadRequest, format!("reload refused: {e}")).into()),
    }
}

/// `GET /admin/v1/nodes`: the deployment's nodes as this gateway sees them (per
/// model: role, address, state, requests outstanding).
async fn nodes(State(s): State<Arc<AppState>>) -> Reply {
    match s.reloader() {
        Some(r) => Ok(Done(r.nodes())),
        None => Err(ApiError::new(
            ErrorKind::NotFound,
            "this gateway serves no deployment file (start it with --config FILE)",
        )
        .into()),
    }
}

/// `GET /admin/v1/audit?since=&until=&limit=`: audit rows in the range (default:
/// all time), oldest first, at most `limit` (default 100, at most 1000).
async fn audit(State(s): State<Arc<AppState>>, Query(q): Query<HashMap<String, String>>) -> Reply {
    let time = |k: &str, default: i64| crate::usage_api::query_time(&q, k, default);
    let since = time("since", 0)?;
    let until = time("until", tessera_tenancy::now_ms() + 1)?;
    let limit = match q.get("limit") {
        None => 100,
        Some(v) => v
            .parse::<u32>()
            .ok()
            .filter(|n| (1..=1000).contains(n))
            .ok_or_else(|| {
                ApiError::field("limit", format!("`limit` must be 1..=1000. Given: {v}"))
            })?,
    };
    Ok(Done(json!(s.store.audit_rows(since, until, limit).await?)))
}

async fn usage(
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Reply {
    let (since, until, g) = crate::usage_api::parse_query(&q, s.usage.max_range)?;
    Ok(Done(
        crate::usage_api::report(&s.store, &id, since, until, g).await?,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 32: one repeated character or a short pattern is refused whatever its
    /// length; a base64 token (what the runbooks generate) passes; the refusal of a
    /// hex token that lacks some digits names the fix.
    #[test]
    fn repetitive_tokens_are_refused_and_the_fix_is_named() {
        let b64 = "Zq3+u9Xv0bR/aK7sW1mT5yE8cN2hJ4pL6dF0gQ=";
        assert_eq!(check_token("t", b64), Ok(()));
        let all_hex: String = (0..64)
            .map(|i| b"0123456789abcdef"[i * 7 % 16] as char)
            .collect();
        assert_eq!(check_token("t", &all_hex), Ok(()));
        let ten = "0123456789".repeat(7)[..64].to_string();
        let e = check_token("t", &ten).unwrap_err();
        assert_eq!(
            e,
            TokenError::Repetitive {
                what: "t".into(),
                distinct: 10
            }
        );
        assert!(e.to_string().contains("openssl rand -base64 32"), "{e}");
        assert!(matches!(
            check_token("t", &"x".repeat(64)),
            Err(TokenError::Repetitive { distinct: 1, .. })
        ));
        assert!(matches!(
            check_token("t", &format!("  {}  ", &all_hex[..31])),
            Err(TokenError::Short { len: 31, .. })
        ));
    }
}
