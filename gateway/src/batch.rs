//! Workers AI async batch: `POST .../ai/run/{model}?queueRequest=true`.
//!
//! Shapes (Cloudflare's Batch API, developers.cloudflare.com/workers-ai/features/batch-api/):
//! - submit `{"requests": [{prompt | messages, ..., "external_reference"?}, ...]}`
//!   → `{"result": {"status": "queued", "request_id", "model"}, "success": true, ...}`;
//! - poll `{"request_id": "..."}` → `{"status": "queued" | "running", ...}` until
//!   done, then `{"responses": [{"id", "success", "result" | "errors",
//!   "external_reference"}], "usage": {...}}` (ids are the items' indices).
//!
//! Each item runs as its own request through every phase of
//! [`crate::server::generate`] (authentication with the submitting key, limits,
//! validation, the daily quota, one usage row), in the `batch` priority class,
//! at most [`ITEM_PARALLELISM`] at a time per batch. An item refused by a rate or
//! concurrency limit before admission (no usage row) waits and retries, so a batch
//! never bills an item twice; any other failure is that item's result.
//!
//! Batches live in the gateway's memory: a poll must reach the gateway that took
//! the batch, and a restart loses unfinished batches (their finished items keep
//! their usage rows). Only the submitting tenant can see a batch; any other
//! caller gets the same 404 as for an unknown id.

use crate::error::{ApiError, ErrorKind, Flavor};
use crate::http::{authenticate, envelope, read_body_in_time, Shape};
use crate::state::{AppState, Ctx};
use crate::validation::{self, ParsedRequest};
use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{json, Map, Value};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_tenancy::Scope;

/// Most items in one batch.
pub const MAX_BATCH_ITEMS: usize = 256;
/// Batches one tenant may have queued or running at once (more: 429).
pub const MAX_OPEN_BATCHES_PER_TENANT: usize = 4;
/// Batches one tenant may have stored, finished ones included (more: 429 until some
/// expire), so that no tenant can fill the gateway's store for the others.
pub const MAX_STORED_BATCHES_PER_TENANT: usize = 32;
/// Batches a gateway keeps, finished ones included (more: 503 until some expire).
pub const MAX_STORED_BATCHES: usize = 1024;
/// Longest `request_id` a poll may give, in bytes (ids are 36).
pub const MAX_REQUEST_ID_BYTES: usize = 64;
/// Longest `external_reference`, in bytes.
pub const MAX_EXTERNAL_REFERENCE_BYTES: usize = 256;
/// Items of one batch running at once.
pub const ITEM_PARALLELISM: usize = 2;
/// How long one item keeps retrying refusals that say a retry can succeed (rate
/// and concurrency limits, a busy engine, an unreachable limits store) before the
/// refusal becomes its result.
pub const MAX_LIMIT_WAIT: Duration = Duration::from_secs(600);
/// Default time a finished batch's results are kept.
pub const DEFAULT_RETENTION: Duration = Duration::from_secs(3600);

/// The gateway's batches, by request id.
pub(crate) struct Batches {
    jobs: Mutex<HashMap<String, Arc<Job>>>,
    retention: Duration,
    /// Set when the server drains: items not yet started end as 503.
    closing: AtomicBool,
}

struct Job {
    id: String,
    tenant_id: String,
    /// The catalog id of the model (aliases resolved).
    model: String,
    progress: Mutex<Progress>,
}

#[derive(Default)]
struct Progress {
    started: usize,
    results: Vec<Option<Value>>,
    prompt_tokens: u64,
    completion_tokens: u64,
    finished: Option<Instant>,
}

impl Batches {
    pub(crate) fn new(retention: Duration) -> Self {
        Self {
            jobs: Mutex::new(HashMap::new()),
            retention,
            closing: AtomicBool::new(false),
        }
    }

    /// Stops starting items (shutdown); items not yet started end as 503.
    pub(crate) fn close(&self) {
        self.closing.store(true, Ordering::Release);
    }

    fn closing(&self) -> bool {
        self.closing.load(Ordering::Acquire)
    }

    /// Drops finished batches older than the retention.
    fn sweep(&self, jobs: &mut HashMap<String, Arc<Job>>) {
        let keep = self.retention;
        jobs.retain(|_, j| {
            let p = j.progress.lock().expect("batch progress lock");
            p.finished.is_none_or(|t| t.elapsed() < keep)
        });
    }
}

/// Whether a query string asks for the batch API (`queueRequest=true`), its
/// pairs percent-decoded.
///
/// Errors: a `queueRequest` value other than `true` or `false`, or given twice with
/// different values (400 naming it).
pub(crate) fn queued(uri: &axum::http::Uri) -> Result<bool, ApiError> {
    let bad = || {
        ApiError::field(
            "queueRequest",
            "`queueRequest` must be `true` or `false`, once",
        )
    };
    if uri.query().is_none() {
        return Ok(false);
    }
    let axum::extract::Query(pairs) =
        axum::extract::Query::<Vec<(String, String)>>::try_from_uri(uri).map_err(|_| bad())?;
    let mut on: Option<bool> = None;
    for (k, v) in pairs {
        if k != "queueRequest" {
            continue;
        }
        let this = match v.as_str() {
            "true" => true,
            "false" => false,
            _ => return Err(bad()),
        };
        if on.is_some_and(|o| o != this) {
            return Err(bad());
        }
        on = Some(this);
    }
    Ok(on.unwrap_or(false))
}

/// The handler of `POST .../ai/run/{model}?queueRequest=true`: a submission
/// (`requests`) or a poll (`request_id`). Refusals write no usage row (no
/// generation ran); each item writes its own when it runs.
pub(crate) async fn handle(
    state: Arc<AppState>,
    account: String,
    model: String,
    req: Request,
) -> Response {
    let mut ctx = Ctx::new("workers_ai.batch", Flavor::WorkersAi);
    if let Err(e) = validation::check_len("model", &model) {
        return ctx.refuse(&state, "path_too_long", e);
    }
    ctx.model = model.clone();
    let (parts, body) = req.into_parts();
    let principal = match authenticate(
        &state,
        &mut ctx,
        &parts.headers,
        Some(&account),
        Scope::Inference,
    )
    .await
    {
        Ok(p) => p,
        Err((reason, e)) => return ctx.refuse(&state, reason, e),
    };
    let tenant_id = principal.tenant.id.clone();
    let parsed = match read_body_in_time(&state, &parts.headers, body).await {
        Ok(b) => validation::parse_object(&b),
        Err(e) => Err(e),
    };
    let o = match parsed {
        Ok(o) => o,
        Err(e) => return ctx.refuse(&state, "batch_invalid", e),
    };
    // The model in the path, resolved (aliases too) and open to this tenant.
    let entry = match state.catalog.lookup(&model, crate::catalog::now_secs()) {
        crate::catalog::Lookup::Served(e) => e,
        crate::catalog::Lookup::Removed(e) => {
            return ctx.refuse(&state, "batch_invalid", crate::models_api::removed(e))
        }
        crate::catalog::Lookup::Unknown => {
            return ctx.refuse(&state, "batch_invalid", validation::no_such_model(&model))
        }
    };
    if let Err(e) = crate::models_api::check_access(&state, &tenant_id, entry, &model).await {
        return ctx.refuse(&state, "batch_invalid", e);
    }
    let model_id = entry.id.clone();
    let result = match (o.get("requests"), o.get("request_id")) {
        (Some(_), Some(_)) => Err(ApiError::new(
            ErrorKind::BadRequest,
            "give either `requests` (a new batch) or `request_id` (a poll), not both",
        )),
        (None, None) => Err(ApiError::new(
            ErrorKind::BadRequest,
            "with `queueRequest=true` the body needs `requests` (a new batch) or \
             `request_id` (a poll)",
        )),
        (None, Some(id)) => poll(&state, &tenant_id, &model_id, id),
        (Some(items), None) => {
            let auth = parts.headers.get(header::AUTHORIZATION).cloned();
            let tenant = crate::server::tenant_context(&principal.tenant);
            let check = |p: ParsedRequest| {
                let served = state
                    .served(&model_id)
                    .ok_or_else(|| validation::no_such_model(&model_id))?;
                let limits = served.engine.limits();
                validation::validate(p, &state.catalog, &served.model, limits, &tenant).map(|_| ())
            };
            submit(&state, &account, &tenant_id, &model_id, items, auth, &check)
        }
    };
    match result {
        Ok(v) => ctx.header((axum::http::StatusCode::OK, axum::Json(envelope(v))).into_response()),
        Err(e) => {
            let reason = match e.kind {
                ErrorKind::RateLimited => "batch_limit",
                ErrorKind::Unavailable => "batch_unavailable",
                ErrorKind::NotFound => "batch_not_found",
                _ => "batch_invalid",
            };
            ctx.refuse(&state, reason, e)
        }
    }
}

/// One item's body as it will run, and its `external_reference`.
#[derive(Debug)]
struct Item {
    body: Map<String, Value>,
    external_reference: Value,
}

/// Checks every item before anything runs: its shape, then `check` (the full
/// validation a request gets: model, tokenization, context window), and that it
/// fits `max_body` bytes as it will run. Errors name `requests[i].field`.
fn items(
    model: &str,
    v: &Value,
    max_body: usize,
    check: &dyn Fn(ParsedRequest) -> Result<(), ApiError>,
) -> Result<Vec<Item>, ApiError> {
    let Some(list) = v.as_array() else {
        return Err(ApiError::field("requests", "`requests` must be an array"));
    };
    if list.is_empty() || list.len() > MAX_BATCH_ITEMS {
        return Err(ApiError::field(
            "requests",
            format!(
                "`requests` must hold 1 to {MAX_BATCH_ITEMS} items. Given: {}",
                list.len()
            ),
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, item) in list.iter().enumerate() {
        let name = |f: &str| format!("requests[{i}].{f}");
        let Some(o) = item.as_object() else {
            return Err(ApiError::field(
                &format!("requests[{i}]"),
                format!("`requests[{i}]` must be an object"),
            ));
        };
        let mut body = o.clone();
        let external_reference = match body.remove("external_reference") {
            None | Some(Value::Null) => Value::Null,
            Some(Value::String(s)) if s.len() <= MAX_EXTERNAL_REFERENCE_BYTES => Value::String(s),
            Some(_) => {
                let f = name("external_reference");
                return Err(ApiError::field(
                    &f,
                    format!(
                        "`{f}` must be a string of at most {MAX_EXTERNAL_REFERENCE_BYTES} bytes"
                    ),
                ));
            }
        };
        if body.get("stream").and_then(Value::as_bool) == Some(true) {
            let f = name("stream");
            return Err(ApiError::field(
                &f,
                format!("`{f}` must be false: batch results are collected, not streamed"),
            ));
        }
        if let Err(mut e) = validation::workers_ai(model, &body).and_then(check) {
            e.param = Some(match e.param.as_deref() {
                Some(f) => name(f),
                None => format!("requests[{i}]"),
            });
            e.message = format!("requests[{i}]: {}", e.message);
            return Err(e);
        }
        // Queued work runs in the lowest class, whatever the item asked for.
        body.insert("priority".into(), Value::String("batch".into()));
        body.insert("stream".into(), Value::Bool(false));
        let size = Value::Object(body.clone()).to_string().len();
        if size > max_body {
            return Err(ApiError::field(
                &format!("requests[{i}]"),
                format!("`requests[{i}]` is {size} bytes as it runs; at most {max_body}"),
            ));
        }
        out.push(Item {
            body,
            external_reference,
        });
    }
    Ok(out)
}

fn submit(
    state: &Arc<AppState>,
    account: &str,
    tenant_id: &str,
    model: &str,
    requests: &Value,
    auth: Option<HeaderValue>,
    check: &dyn Fn(ParsedRequest) -> Result<(), ApiError>,
) -> Result<Value, ApiError> {
    let items = items(model, requests, state.max_body_bytes, check)?;
    let auth = auth.ok_or_else(|| ApiError::new(ErrorKind::Unauthenticated, "missing API key"))?;
    let batches = &state.batches;
    if batches.closing() {
        return Err(ApiError::new(
            ErrorKind::Unavailable,
            "the server is shutting down and takes no new batches",
        ));
    }
    let job = {
        let mut jobs = batches.jobs.lock().expect("batches lock");
        batches.sweep(&mut jobs);
        let theirs: Vec<&Arc<Job>> = jobs.values().filter(|j| j.tenant_id == tenant_id).collect();
        if theirs.len() >= MAX_STORED_BATCHES_PER_TENANT {
            let mut e = ApiError::new(
                ErrorKind::RateLimited,
                format!(
                    "this account has {} batches stored; at most {MAX_STORED_BATCHES_PER_TENANT} \
                     (finished ones are kept for their retention, then dropped)",
                    theirs.len()
                ),
            );
            e.retry_after = Some(Duration::from_secs(60));
            return Err(e);
        }
        let open = theirs
            .iter()
            .filter(|j| {
                j.progress
                    .lock()
                    .expect("batch progress lock")
                    .finished
                    .is_none()
            })
            .count();
        if open >= MAX_OPEN_BATCHES_PER_TENANT {
            let mut e = ApiError::new(
                ErrorKind::RateLimited,
                format!(
                    "this account has {open} batches queued or running; at most \
                     {MAX_OPEN_BATCHES_PER_TENANT} at once"
                ),
            );
            e.retry_after = Some(Duration::from_secs(5));
            return Err(e);
        }
        if jobs.len() >= MAX_STORED_BATCHES {
            let mut e = ApiError::new(
                ErrorKind::Unavailable,
                "this gateway holds as many batches as it keeps; retry later",
            );
            e.retry_after = Some(Duration::from_secs(60));
            return Err(e);
        }
        let id = uuid_like();
        let job = Arc::new(Job {
            id: id.clone(),
            tenant_id: tenant_id.into(),
            model: model.into(),
            progress: Mutex::new(Progress {
                results: vec![None; items.len()],
                ..Progress::default()
            }),
        });
        jobs.insert(id, job.clone());
        job
    };
    state.metrics.batch_items("queued", items.len());
    tokio::spawn(run(state.clone(), job.clone(), account.into(), items, auth));
    Ok(json!({"status": "queued", "request_id": job.id, "model": job.model}))
}

fn poll(state: &AppState, tenant_id: &str, model: &str, id: &Value) -> Result<Value, ApiError> {
    let Some(id) = id.as_str().filter(|id| id.len() <= MAX_REQUEST_ID_BYTES) else {
        return Err(ApiError::field(
            "request_id",
            format!("`request_id` must be a string of at most {MAX_REQUEST_ID_BYTES} bytes"),
        ));
    };
    let not_found = || {
        ApiError::new(
            ErrorKind::NotFound,
            format!("no batch request with id {id} for this account and model"),
        )
    };
    let job = {
        let mut jobs = state.batches.jobs.lock().expect("batches lock");
        state.batches.sweep(&mut jobs);
        jobs.get(id).cloned().ok_or_else(not_found)?
    };
    if job.tenant_id != tenant_id || job.model != model {
        return Err(not_found());
    }
    let p = job.progress.lock().expect("batch progress lock");
    if p.finished.is_none() {
        let done = p.results.iter().filter(|r| r.is_some()).count();
        let status = if p.started == 0 { "queued" } else { "running" };
        return Ok(json!({
            "status": status, "request_id": job.id, "model": job.model,
            "completed": done, "total": p.results.len(),
        }));
    }
    let responses: Vec<Value> = p.results.iter().flatten().cloned().collect();
    Ok(json!({
        "responses": responses,
        "usage": {
            "prompt_tokens": p.prompt_tokens,
            "completion_tokens": p.completion_tokens,
            "total_tokens": p.prompt_tokens + p.completion_tokens,
        },
    }))
}

/// A request id in the UUID text form (random, 128 bits).
fn uuid_like() -> String {
    let h = tessera_tenancy::random_hex(16);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Runs a batch's items, [`ITEM_PARALLELISM`] at a time, and marks it finished.
async fn run(
    state: Arc<AppState>,
    job: Arc<Job>,
    account: String,
    items: Vec<Item>,
    auth: HeaderValue,
) {
    let model = job.model.clone();
    futures_util::stream::iter(items.into_iter().enumerate())
        .for_each_concurrent(ITEM_PARALLELISM, |(i, item)| {
            let (state, job, account, model, auth) = (
                state.clone(),
                job.clone(),
                account.clone(),
                model.clone(),
                auth.clone(),
            );
            async move {
                let out = run_item(&state, &job, &account, &model, item.body, &auth).await;
                let outcome = if out.is_ok() { "succeeded" } else { "failed" };
                state.metrics.batch_items(outcome, 1);
                let mut p = job.progress.lock().expect("batch progress lock");
                let entry = match out {
                    Ok(result) => {
                        let usage = &result["usage"];
                        p.prompt_tokens += usage["prompt_tokens"].as_u64().unwrap_or(0);
                        p.completion_tokens += usage["completion_tokens"].as_u64().unwrap_or(0);
                        json!({"id": i, "success": true, "result": result,
                               "external_reference": item.external_reference})
                    }
                    Err(errors) => json!({"id": i, "success": false, "errors": errors,
                                          "external_reference": item.external_reference}),
                };
                p.results[i] = Some(entry);
            }
        })
        .await;
    job.progress.lock().expect("batch progress lock").finished = Some(Instant::now());
}

/// One item through [`crate::server::generate`]; `Ok(result)` or `Err(errors)` in
/// the Workers AI shapes.
async fn run_item(
    state: &Arc<AppState>,
    job: &Job,
    account: &str,
    model: &str,
    body: Map<String, Value>,
    auth: &HeaderValue,
) -> Result<Value, Value> {
    let bytes = Value::Object(body).to_string();
    let began = Instant::now();
    job.progress.lock().expect("batch progress lock").started += 1;
    loop {
        if state.batches.closing() {
            let e = ApiError::new(
                ErrorKind::Unavailable,
                "the server shut down before this batch item ran",
            );
            return Err(json!([{"code": e.kind.workers_code(), "message": e.message}]));
        }
        let req = Request::builder()
            .method("POST")
            .uri("/")
            .header(header::AUTHORIZATION, auth.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::CONTENT_LENGTH, bytes.len())
            .body(Body::from(bytes.clone()))
            .expect("a valid request");
        let resp = crate::server::generate(
            state.clone(),
            Shape::WorkersAi,
            "workers_ai.batch",
            Some(account.into()),
            Some(model.into()),
            req,
        )
        .await;
        let status = resp.status();
        let retry = resp
            .headers()
            .get("x-should-retry")
            .is_some_and(|v| v == "true");
        let wait = resp
            .headers()
            .get(header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
            .map_or(Duration::from_secs(1), Duration::from_secs)
            .clamp(Duration::from_millis(250), Duration::from_secs(5));
        let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
            .await
            .unwrap_or_default();
        let v: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        if status.is_success() {
            return Ok(v["result"].clone());
        }
        // A limit (429) or a busy or unreachable backend (503: the limits store, the
        // batch queue's wait) refused the item and said a retry can succeed: wait.
        // Limit refusals write no usage row; a busy engine's writes one with no
        // tokens, so the item is still billed once.
        if (status == axum::http::StatusCode::TOO_MANY_REQUESTS
            || status == axum::http::StatusCode::SERVICE_UNAVAILABLE)
            && retry
            && began.elapsed() + wait < MAX_LIMIT_WAIT
        {
            tokio::time::sleep(wait).await;
            continue;
        }
        return Err(v["errors"].clone());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(m: &str, v: &Value) -> Result<Vec<Item>, ApiError> {
        items(m, v, 1 << 20, &|_| Ok(()))
    }

    fn queued_in(q: &str) -> Result<bool, ApiError> {
        queued(&format!("/x?{q}").parse().unwrap())
    }

    #[test]
    fn queue_request_values() {
        assert!(!queued(&"/x".parse().unwrap()).unwrap());
        assert!(queued_in("queueRequest=true").unwrap());
        assert!(
            queued_in("queue%52equest=%74rue").unwrap(),
            "percent-decoded"
        );
        assert!(!queued_in("a=1&queueRequest=false").unwrap());
        assert!(!queued_in("queuerequest=true").unwrap());
        assert!(queued_in("queueRequest=true&queueRequest=true").unwrap());
        for q in [
            "queueRequest=yes",
            "queueRequest",
            "queueRequest=true&queueRequest=false",
        ] {
            let e = queued_in(q).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("queueRequest"), "{q}");
        }
    }

    #[test]
    fn items_are_checked_before_anything_runs() {
        let m = "@cf/x";
        let e = shape(m, &json!([])).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("requests"));
        let too_many = Value::Array(vec![json!({"prompt": "a"}); MAX_BATCH_ITEMS + 1]);
        assert_eq!(
            shape(m, &too_many).unwrap_err().param.as_deref(),
            Some("requests")
        );
        let e = shape(
            m,
            &json!([{"prompt": "a"}, {"prompt": "b", "stream": true}]),
        )
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("requests[1].stream"));
        let e = shape(m, &json!([{"prompt": "a", "max_tokens": -1}])).unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("requests[0].max_tokens"),
            "{}",
            e.message
        );
        let e = shape(m, &json!([{"prompt": "a", "external_reference": 7}])).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("requests[0].external_reference"));
        let e = shape(m, &json!(["a"])).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("requests[0]"));
        let ok = shape(
            m,
            &json!([{"prompt": "a", "priority": "interactive", "external_reference": "r"}]),
        )
        .unwrap();
        assert_eq!(ok[0].body["priority"], "batch");
        assert_eq!(ok[0].external_reference, "r");
        assert!(!ok[0].body.contains_key("external_reference"));
        // As it will run (with `priority` and `stream` added), an item must fit the
        // body limit: else a 400 now rather than a 413 when it runs.
        let big = json!([{"prompt": "a".repeat(100)}]);
        let e = items(m, &big, 110, &|_| Ok(())).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("requests[0]"));
        // The full validation's verdict names the item.
        let refuse = |_| Err(ApiError::field("max_tokens", "too many"));
        let e = items(m, &json!([{"prompt": "a"}]), 1 << 20, &refuse).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("requests[0].max_tokens"));
    }

    #[test]
    fn ids_look_like_uuids() {
        let id = uuid_like();
        assert_eq!(id.len(), 36);
        assert_eq!(id.matches('-').count(), 4);
        assert_ne!(id, uuid_like());
    }
}
