//! Admin API (`/admin/v1/...`), behind `Authorization: Bearer <admin token>`
//! compared in constant time. Disabled (404) when no admin token is configured.
//!
//! - `GET  /admin/v1/tenants`, `POST /admin/v1/tenants` `{name, limits?, create_key?}`
//! - `GET  /admin/v1/tenants/{id}`
//! - `POST /admin/v1/tenants/{id}/suspend`, `POST /admin/v1/tenants/{id}/activate`
//! - `PUT  /admin/v1/tenants/{id}/limits` (a [`Limits`] object)
//! - `GET  /admin/v1/tenants/{id}/keys`, `POST /admin/v1/tenants/{id}/keys` `{name}`
//! - `POST /admin/v1/keys/{key_id}/revoke`
//! - `GET  /admin/v1/tenants/{id}/usage?since=&until=&group_by=`
//! - `GET  /metrics` (Prometheus text format)

use crate::error::{ApiError, ErrorKind, Flavor};
use crate::server::{read_body, AppState};
use crate::workers_ai::envelope;
use axum::extract::{Path, Query, Request, State};
use axum::http::HeaderMap;
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::Router;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
use subtle::ConstantTimeEq;
use tessera_tenancy::{Limits, StoreError, TenantStatus};

/// The admin routes; every one requires the admin token (checked by
/// [`require_admin`] before the handler runs).
pub(crate) fn routes(state: Arc<AppState>) -> Router<Arc<AppState>> {
    Router::new()
        .route("/admin/v1/tenants", get(list_tenants).post(create_tenant))
        .route("/admin/v1/tenants/{id}", get(get_tenant))
        .route("/admin/v1/tenants/{id}/suspend", post(suspend))
        .route("/admin/v1/tenants/{id}/activate", post(activate))
        .route("/admin/v1/tenants/{id}/limits", put(set_limits))
        .route(
            "/admin/v1/tenants/{id}/keys",
            get(list_keys).post(create_key),
        )
        .route("/admin/v1/tenants/{id}/usage", get(usage))
        .route("/admin/v1/keys/{key_id}/revoke", post(revoke))
        .route("/metrics", get(metrics))
        .route_layer(middleware::from_fn_with_state(state, require_admin))
}

async fn require_admin(State(s): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    match check(&s, req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response_as(Flavor::WorkersAi, ""),
    }
}

fn check(state: &AppState, headers: &HeaderMap) -> Result<(), ApiError> {
    let Some(expected) = &state.admin_token else {
        return Err(ApiError::new(
            ErrorKind::NotFound,
            "admin API is disabled (no admin token configured)",
        ));
    };
    let given = headers
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .unwrap_or("");
    if given.len() == expected.len() && bool::from(given.as_bytes().ct_eq(expected.as_bytes())) {
        Ok(())
    } else {
        Err(ApiError::new(
            ErrorKind::Unauthenticated,
            "admin token required",
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
            e => ApiError::new(ErrorKind::Unavailable, e.to_string()),
        })
    }
}

async fn json_body(state: &AppState, req: Request) -> Result<Value, ApiError> {
    let (parts, body) = req.into_parts();
    let bytes = read_body(&parts.headers, body, state.max_body_bytes).await?;
    if bytes.is_empty() {
        return Ok(json!({}));
    }
    Ok(Value::Object(crate::validation::parse_object(&bytes)?))
}

async fn metrics(State(s): State<Arc<AppState>>) -> Response {
    let body = s.metrics.render(s.engine.stats(), s.inflight());
    (
        [("content-type", "text/plain; version=0.0.4; charset=utf-8")],
        body,
    )
        .into_response()
}

async fn list_tenants(State(s): State<Arc<AppState>>) -> Reply {
    Ok(Done(json!(s.store.list_tenants().await?)))
}

async fn create_tenant(State(s): State<Arc<AppState>>, req: Request) -> Reply {
    let body = json_body(&s, req).await?;
    let name = body
        .get("name")
        .and_then(Value::as_str)
        .ok_or_else(|| ApiError::field("name", "`name` must be a string"))?;
    let limits: Limits = match body.get("limits") {
        None | Some(Value::Null) => Limits::default(),
        Some(l) => serde_json::from_value(l.clone())
            .map_err(|e| ApiError::field("limits", format!("`limits`: {e}")))?,
    };
    let t = s.store.create_tenant(name, limits).await?;
    let mut out = json!({"tenant": t});
    if body
        .get("create_key")
        .and_then(Value::as_bool)
        .unwrap_or(false)
    {
        let (info, key) = s.store.create_key(&t.id, "default").await?;
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

async fn set_status(s: Arc<AppState>, id: String, st: TenantStatus) -> Reply {
    s.store.set_status(&id, st).await?;
    Ok(Done(json!({"id": id, "status": st})))
}

async fn suspend(State(s): State<Arc<AppState>>, Path(id): Path<String>) -> Reply {
    set_status(s, id, TenantStatus::Suspended).await
}

async fn activate(State(s): State<Arc<AppState>>, Path(id): Path<String>) -> Reply {
    set_status(s, id, TenantStatus::Active).await
}

async fn set_limits(State(s): State<Arc<AppState>>, Path(id): Path<String>, req: Request) -> Reply {
    let body = json_body(&s, req).await?;
    let l: Limits = serde_json::from_value(body)
        .map_err(|e| ApiError::field("limits", format!("limits: {e}")))?;
    s.store.set_limits(&id, l).await?;
    Ok(Done(json!({"id": id, "limits": l})))
}

async fn list_keys(State(s): State<Arc<AppState>>, Path(id): Path<String>) -> Reply {
    Ok(Done(json!(s.store.list_keys(Some(&id)).await?)))
}

async fn create_key(State(s): State<Arc<AppState>>, Path(id): Path<String>, req: Request) -> Reply {
    let body = json_body(&s, req).await?;
    let name = body
        .get("name")
        .and_then(Value::as_str)
        .unwrap_or("default");
    let (info, key) = s.store.create_key(&id, name).await?;
    Ok(Done(json!({"info": info, "secret": key})))
}

async fn revoke(State(s): State<Arc<AppState>>, Path(key_id): Path<String>) -> Reply {
    if !s.store.revoke_key(&key_id).await? {
        return Err(ApiError::new(
            ErrorKind::NotFound,
            format!("no active key with id {key_id}"),
        )
        .into());
    }
    Ok(Done(json!({"key_id": key_id, "revoked": true})))
}

async fn usage(
    State(s): State<Arc<AppState>>,
    Path(id): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Reply {
    let (since, until, g) = crate::usage_api::parse_query(&q)?;
    Ok(Done(
        crate::usage_api::report(&s.store, &id, since, until, g).await?,
    ))
}
