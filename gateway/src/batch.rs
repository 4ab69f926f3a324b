//! Workers AI async batch: `POST .../ai/run/{model}?queueRequest=true`.
//!
//! Shapes (Cloudflare's Batch API, developers.cloudflare.com/workers-ai/features/batch-api/):
//! - submit `{"requests": [{prompt | messages, ..., "external_reference"?}, ...]}`
//!   → `{"result": {"status": "queued", "request_id", "model"}, "success": true, ...}`;
//! - poll `{"request_id": "..."}` → `{"status": "queued" | "running", ...}` until
//!   done, then `{"responses": [{"id", "success", "result" | "errors",
//!   "external_reference"}], "usage": {...}}` (ids are the items' indices).
//!
//! A submission takes the tenant's allowances before any item is validated, as a
//! request does before its body is: one concurrency slot, held while the batch's
//! items run, and one request per item from requests/minute, all or nothing (more
//! items than the per-minute limit: 429, not retryable). Its items are then
//! validated (chat template, tokenizer, grammar compile, the context window) on the
//! CPU pool's batch lane ([`crate::cpu`]), never on the async workers, and their
//! tokens (prompt, `max_tokens`) are reserved together against the token limits and
//! the daily quota. A refused submission gets the 429 any request gets, and writes
//! no usage row. Each item then runs as its own request, entering the typed stages
//! of [`crate::pipeline`] at `Reserved` (the submitting key checked again, one usage
//! row, its own request id),
//! in the `batch` priority class, at most [`ITEM_PARALLELISM`] at a time per batch,
//! on the batch's reservation, which is settled with the items' real tokens once
//! the last one ends. An item refused by a busy engine (503 that says a retry can
//! succeed) waits and retries; any other failure is that item's result.
//!
//! Batches live in the gateway's memory: a poll must reach the gateway that took
//! the batch, and a restart loses unfinished batches (their finished items keep
//! their usage rows). Only the submitting tenant can see a batch; any other
//! caller gets the same 404 as for an unknown id.

use crate::cpu::Lane;
use crate::driver::{BatchCharge, Charge};
use crate::error::{ApiError, ErrorKind, Flavor};
use crate::http::{envelope, limit_error, read_body_in_time, Shape};
use crate::model_check::{self, ValidRequest};
use crate::pipeline::{self, Authenticated, Reserved, Stop};
use crate::state::{AppState, Ctx, Job, Progress, ServedModel};
use crate::validation::{self, ParsedRequest};
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::{IntoResponse, Response};
use futures_util::StreamExt;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_tenancy::Principal;
use tracing::Instrument;

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
/// How long one item keeps retrying refusals that say a retry can succeed (a busy
/// engine, the batch queue's wait) before the refusal becomes its result.
pub const MAX_LIMIT_WAIT: Duration = Duration::from_secs(600);
/// Default time a finished batch's results are kept.
pub const DEFAULT_RETENTION: Duration = crate::state::DEFAULT_BATCH_RETENTION;

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
    let principal =
        match pipeline::authenticate(&state, &mut ctx, &parts.headers, Some(&account)).await {
            Ok(Authenticated { principal }) => principal,
            Err(stop) => return stop.into_error().into_response_as(ctx.flavor, &ctx.rid),
        };
    let tenant_id = principal.tenant.id.clone();
    // A large body is a submission (a poll is a few dozen bytes): when the tenant
    // could not be admitted now, refuse it without parsing it, so that a flood of
    // megabyte batches past the allowance costs little. The body is still read
    // (bounded, and cheap beside parsing): answering first closes the connection
    // under a client still sending, which then sees a reset instead of the 429.
    if declared_len(&parts.headers).is_some_and(|n| n > PRECHECK_BYTES) {
        if let Err(l) = state.limiter.precheck(&tenant_id, principal.tenant.limits) {
            let _ = read_body_in_time(&state, &parts.headers, body).await;
            return ctx.refuse(&state, l.kind.label(), limit_error(&l));
        }
    }
    let parsed = match read_body_in_time(&state, &parts.headers, body).await {
        // A body of up to the size limit: parsed on the CPU pool.
        Ok(b) => pipeline::parse_body(&state, Lane::Batch, &tenant_id, b).await,
        Err(e) => Err(e),
    };
    let mut o = match parsed {
        Ok(o) => o,
        Err(e) => return ctx.refuse(&state, "batch_invalid", e),
    };
    // The model in the path, resolved (aliases too), open to this tenant, served.
    let served = match pipeline::route(&state, &tenant_id, &model).await {
        Ok(s) => s,
        Err(e) => return ctx.refuse(&state, "batch_invalid", e),
    };
    let model_id = served.entry.id.clone();
    let result = match (o.remove("requests"), o.get("request_id")) {
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
            match submit(&state, &ctx, principal, &account, served, items, auth).await {
                Ok(v) => Ok(v),
                // Counted (or its row written) by the stage that stopped it.
                Err(stop) => return stop.into_error().into_response_as(ctx.flavor, &ctx.rid),
            }
        }
    };
    match result {
        Ok(v) => ctx.header((axum::http::StatusCode::OK, axum::Json(envelope(v))).into_response()),
        Err(e) => {
            let reason = reason_of(&e);
            ctx.refuse(&state, reason, e)
        }
    }
}

/// Bodies declared longer than this (`content-length`, bytes) are submissions whose
/// tenant is checked ([`tessera_tenancy::Limiter::precheck`]) before the body is
/// parsed.
const PRECHECK_BYTES: u64 = 64 << 10;

/// The body length a request declares in `content-length`, if any.
fn declared_len(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// The refusal reason (metrics label) of a batch error.
fn reason_of(e: &ApiError) -> &'static str {
    match e.kind {
        ErrorKind::RateLimited => "batch_limit",
        ErrorKind::Unavailable => "batch_unavailable",
        ErrorKind::NotFound => "batch_not_found",
        _ => "batch_invalid",
    }
}

/// One item as it will run (validated), and its `external_reference`.
#[derive(Debug)]
struct Item<T = ValidRequest> {
    v: T,
    external_reference: Value,
}

/// The item count of `requests`: an array of 1 to [`MAX_BATCH_ITEMS`] (checked
/// before the allowances are taken; the items themselves after).
fn count(v: &Value) -> Result<usize, ApiError> {
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
    Ok(list.len())
}

/// Checks every item before anything runs: its shape, then `check` (the full
/// validation a request gets: model, chat template, tokenization, context window)
/// of the item as it will run (`priority: batch`, not streamed). Errors name
/// `requests[i].field`. CPU-heavy: call it on the CPU pool.
fn items<T>(
    model: &str,
    v: &Value,
    check: &dyn Fn(ParsedRequest) -> Result<T, ApiError>,
) -> Result<Vec<Item<T>>, ApiError> {
    count(v)?;
    let list = v.as_array().expect("counted: an array");
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
        // Queued work runs in the lowest class, whatever the item asked for.
        body.insert("priority".into(), Value::String("batch".into()));
        body.insert("stream".into(), Value::Bool(false));
        match crate::workers_ai::parse_run(model, &body).and_then(check) {
            Ok(v) => out.push(Item {
                v,
                external_reference,
            }),
            Err(mut e) => {
                e.param = Some(match e.param.as_deref() {
                    Some(f) => name(f),
                    None => format!("requests[{i}]"),
                });
                e.message = format!("requests[{i}]: {}", e.message);
                return Err(e);
            }
        }
    }
    Ok(out)
}

/// Whether `tenant_id` may store one more batch now: the gateway is not closing,
/// the tenant is under its stored and open caps, the gateway under its own.
/// Errors: 503 (closing, gateway full) or 429 (the tenant's caps), with
/// `retry-after`.
fn room(
    batches: &crate::state::Batches,
    jobs: &std::collections::HashMap<String, Arc<Job>>,
    tenant_id: &str,
) -> Result<(), ApiError> {
    if batches.closing() {
        return Err(ApiError::new(
            ErrorKind::Unavailable,
            "the server is shutting down and takes no new batches",
        ));
    }
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
    Ok(())
}

/// [`room`] under the store's lock (finished batches past their retention swept).
fn check_room(state: &AppState, tenant_id: &str) -> Result<(), ApiError> {
    let batches = &state.batches;
    let mut jobs = batches.jobs.lock().expect("batches lock");
    batches.sweep(&mut jobs);
    room(batches, &jobs, tenant_id)
}

/// Most distinct fine-tunes one batch's items may name.
const MAX_BATCH_LORAS: usize = 8;

/// The fine-tunes a batch's items name (`lora`), each resolved and loaded for the
/// tenant once, before any item is validated; malformed `lora` values are left to
/// the items' own validation.
///
/// Errors: more than [`MAX_BATCH_LORAS`] distinct ones (400), or a fine-tune the
/// tenant cannot reach (404) or of another base model (400), naming the item.
async fn batch_loras(
    state: &AppState,
    tenant_id: &str,
    served: &ServedModel,
    requests: &Value,
) -> Result<std::collections::HashMap<String, tessera_serving::LoraRef>, ApiError> {
    let mut out = std::collections::HashMap::new();
    for (i, item) in requests.as_array().into_iter().flatten().enumerate() {
        let Some(Value::String(name)) = item.get("lora") else {
            continue;
        };
        if name.is_empty() || name.len() > crate::MAX_ID_BYTES || out.contains_key(name) {
            continue;
        }
        let field = format!("requests[{i}].lora");
        if out.len() == MAX_BATCH_LORAS {
            return Err(ApiError::field(
                &field,
                format!("a batch's items may name at most {MAX_BATCH_LORAS} fine-tunes"),
            ));
        }
        let l = crate::finetune_resolve::resolve(state, tenant_id, served, name)
            .await
            .map_err(|mut e| {
                e.message = format!("{field}: {}", e.message);
                e.param = Some(field);
                e
            })?;
        out.insert(name.clone(), l);
    }
    Ok(out)
}

/// A new batch: room, allowances (one slot, a request per item), items validated
/// on the CPU pool, their tokens reserved, then stored and started.
///
/// Errors: as [`Stop`]: a limit or a cap (429), an invalid item (400 naming
/// `requests[i].field`), closing or full (503); none writes a usage row except an
/// unreadable usage store (503).
async fn submit(
    state: &Arc<AppState>,
    ctx: &Ctx,
    principal: Principal,
    account: &str,
    served: &ServedModel,
    requests: Value,
    auth: Option<HeaderValue>,
) -> Result<Value, Stop> {
    let refused = |e: ApiError| Stop::refused(state, reason_of(&e), e);
    let auth =
        auth.ok_or_else(|| refused(ApiError::new(ErrorKind::Unauthenticated, "missing API key")))?;
    let n = count(&requests).map_err(refused)?;
    // Cheap caps first, so that a batch that cannot be stored spends nothing.
    check_room(state, &principal.tenant.id).map_err(refused)?;
    let requests_n = u32::try_from(n).unwrap_or(u32::MAX);
    let limited = pipeline::limit(state, Authenticated { principal }, requests_n).await?;
    let tenant = &limited.principal.tenant;
    let model = served.entry.id.as_str();
    let (entry, loaded, admission, tc) = (
        served.entry.clone(),
        served.model.clone(),
        served.engine.admission(),
        pipeline::tenant_context(tenant),
    );
    let loras = batch_loras(state, &tenant.id, served, &requests)
        .await
        .map_err(refused)?;
    let m = model.to_string();
    let checked = state
        .cpu
        .run(Lane::Batch, &tenant.id, move || {
            items(&m, &requests, &|p| {
                let lora = p.lora.as_ref().and_then(|n| loras.get(n).cloned());
                let tc = model_check::TenantContext { lora, ..tc.clone() };
                model_check::validate(p, &entry, &loaded, admission, &tc)
            })
        })
        .instrument(tracing::info_span!(target: tessera_serving::telemetry::TARGET, "validation"))
        .await;
    // Invalid: the admission drops here (its slot back, its requests spent).
    let items = checked.map_err(refused)?;
    let (mut input, mut output) = (0u32, 0u32);
    for it in &items {
        let prompt = u32::try_from(it.v.request.prompt.len()).unwrap_or(u32::MAX);
        let max = u32::try_from(it.v.request.max_tokens).unwrap_or(u32::MAX);
        input = input.saturating_add(prompt);
        output = output.saturating_add(max);
    }
    let reservation =
        pipeline::reserve(state, ctx, tenant, limited.admission, input, output).await?;
    let job = {
        let batches = &state.batches;
        let mut jobs = batches.jobs.lock().expect("batches lock");
        batches.sweep(&mut jobs);
        if let Err(e) = room(batches, &jobs, &tenant.id) {
            drop(jobs);
            reservation.cancel();
            return Err(refused(e));
        }
        let id = uuid_like();
        let job = Arc::new(Job {
            id: id.clone(),
            tenant_id: tenant.id.clone(),
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
    let charge = BatchCharge::new(reservation);
    tokio::spawn(run(
        state.clone(),
        job.clone(),
        account.into(),
        items,
        auth,
        charge,
    ));
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
    tessera_tenancy::random_uuid()
}

/// Runs a batch's items, [`ITEM_PARALLELISM`] at a time, and marks it finished;
/// `charge` (the batch's reservation) is settled once the last item ended.
async fn run(
    state: Arc<AppState>,
    job: Arc<Job>,
    account: String,
    items: Vec<Item>,
    auth: HeaderValue,
    charge: Arc<BatchCharge>,
) {
    let model = job.model.clone();
    futures_util::stream::iter(items.into_iter().enumerate())
        .for_each_concurrent(ITEM_PARALLELISM, |(i, item)| {
            let (state, job, account, model, auth, charge) = (
                state.clone(),
                job.clone(),
                account.clone(),
                model.clone(),
                auth.clone(),
                charge.clone(),
            );
            async move {
                let out = run_item(&state, &job, &account, &model, &item.v, &auth, &charge).await;
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
    // Every item's driver has added its tokens (each settles before its last
    // message); this was the last holder: the reservation settles now.
    drop(charge);
    job.progress.lock().expect("batch progress lock").finished = Some(Instant::now());
}

/// An error as an item's `errors` (the Workers AI shape).
fn errors(e: &ApiError) -> Value {
    json!([{"code": e.kind.workers_code(), "message": e.message}])
}

/// One item through the typed stages of [`crate::pipeline`], from `Reserved` on
/// the batch's `charge`:
/// `Ok(result)` or `Err(errors)` in the Workers AI shapes.
async fn run_item(
    state: &Arc<AppState>,
    job: &Job,
    account: &str,
    model: &str,
    v: &ValidRequest,
    auth: &HeaderValue,
    charge: &Arc<BatchCharge>,
) -> Result<Value, Value> {
    let began = Instant::now();
    job.progress.lock().expect("batch progress lock").started += 1;
    let mut headers = HeaderMap::new();
    headers.insert(header::AUTHORIZATION, auth.clone());
    loop {
        if state.batches.closing() {
            let e = ApiError::new(
                ErrorKind::Unavailable,
                "the server shut down before this batch item ran",
            );
            return Err(errors(&e));
        }
        let mut ctx = Ctx::new("workers_ai.batch", Flavor::WorkersAi);
        ctx.model = model.into();
        let span = tracing::info_span!(
            target: tessera_serving::telemetry::TARGET,
            "request",
            request_id = %ctx.rid,
            api = ctx.endpoint,
            tenant = %job.tenant_id,
            model = model,
        );
        let out = async {
            // The submitting key, checked again as each item starts (revoked,
            // expired, suspended: the item's result, no row).
            let Authenticated { principal } =
                pipeline::authenticate(state, &mut ctx, &headers, Some(account)).await?;
            let Some(served) = state.served(model) else {
                let e = model_check::no_such_model(model);
                return Err(Stop::failed(state, &ctx, e).await);
            };
            let reserved = Reserved {
                key_id: principal.key_id,
                served,
                request: v.clone(),
                charge: Charge::Batch(charge.clone()),
                affinity: None,
            };
            let submitted = pipeline::submit(state, &ctx, Shape::WorkersAi, reserved).await?;
            pipeline::collect(submitted).await.map_err(Stop::Failed)
        }
        .instrument(span)
        .await;
        let e = match out {
            Ok(body) => return Ok(body["result"].clone()),
            Err(stop) => stop.into_error(),
        };
        // A busy engine or the batch queue's wait (503 with a retry hint) refused
        // the item and said a retry can succeed: wait. Its row has no tokens, so
        // the item is still billed once.
        let wait = e
            .retry_after
            .unwrap_or(Duration::from_secs(1))
            .clamp(Duration::from_millis(250), Duration::from_secs(5));
        if e.kind == ErrorKind::Unavailable
            && e.retry_after.is_some()
            && e.retryable
            && began.elapsed() + wait < MAX_LIMIT_WAIT
        {
            tokio::time::sleep(wait).await;
            continue;
        }
        return Err(errors(&e));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(m: &str, v: &Value) -> Result<Vec<Item<ParsedRequest>>, ApiError> {
        items(m, v, &Ok)
    }

    fn queued_in(q: &str) -> Result<bool, ApiError> {
        queued(&format!("/x?{q}").parse().unwrap())
    }

    #[test]
    fn every_batch_refusal_reason_exists_at_zero() {
        for kind in [
            ErrorKind::RateLimited,
            ErrorKind::Unavailable,
            ErrorKind::NotFound,
            ErrorKind::BadRequest,
        ] {
            let reason = reason_of(&ApiError::new(kind, "x"));
            assert!(
                crate::metrics::REFUSAL_REASONS.contains(&reason),
                "{reason} is missing from REFUSAL_REASONS"
            );
        }
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
        // Checked as it will run: in the batch class, not streamed.
        assert_eq!(ok[0].v.priority, Some(tessera_serving::Priority::Batch));
        assert!(!ok[0].v.stream);
        assert_eq!(ok[0].external_reference, "r");
        // The full validation's verdict names the item.
        let refuse = |_| -> Result<(), ApiError> { Err(ApiError::field("max_tokens", "too many")) };
        let e = items(m, &json!([{"prompt": "a"}]), &refuse).unwrap_err();
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
