//! The tenant's dashboard: sign-in with an API key, usage over the last hour, day
//! or 30 days (by model, by key, over time), limits and what is used of them now,
//! keys (create, shown once; revoke) and batch jobs.

use super::chart::{tokens_chart, Point};
use super::web::{
    cookies, message, page, same_origin, see_other, set_cookie, tokens_match, utc_minute, Form,
    SignIn, SESSION_TTL_MS, TENANT_COOKIE,
};
use crate::state::AppState;
use axum::extract::{ConnectInfo, Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use std::net::SocketAddr;
use std::sync::Arc;
use tessera_tenancy::{
    now_ms, AuditCtx, AuthError, DashSession, GroupBy, KeyInfo, NewKey, Scope, Scopes, Tenant,
    UsageGroup,
};

const CSS: &str = "/dash/static/dash.css";
/// Most active keys an account may have for the dashboard to make another (the
/// admin API and CLI are not bound by it).
const MAX_ACTIVE_KEYS: usize = 100;
const HOUR_MS: i64 = 3_600_000;

pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/dash", get(|| async { see_other("/dash/") }))
        .route("/dash/", get(overview))
        .route("/dash/login", get(login_form).post(login))
        .route(
            "/dash/logout",
            get(|| async { see_other("/dash/") }).post(logout),
        )
        .route(
            "/dash/keys",
            get(|| async { see_other("/dash/") }).post(create_key),
        )
        .route("/dash/keys/{key_id}/revoke", post(revoke_key))
}

const SIGN_IN: SignIn = SignIn {
    css: CSS,
    action: "/dash/login",
    cookie_path: "/dash",
    heading: "Sign in to your usage dashboard",
    field: "key",
    label: "API key",
    note: "Use a key with the usage:read scope. The key is exchanged for a session cookie \
           that lasts an hour; the key itself is not kept in your browser.",
};

fn unavailable(e: impl std::fmt::Display) -> Response {
    super::web::unavailable(CSS, "/dash/", e)
}

fn login_page(status: StatusCode, error: Option<&str>, secure: bool) -> Response {
    super::web::login_page(&SIGN_IN, status, error, secure)
}

async fn login_form(req: Request) -> Response {
    super::web::sign_in_form(&SIGN_IN, &req)
}

async fn login(State(s): State<Arc<AppState>>, req: Request) -> Response {
    let (form, secure) = match super::web::read_sign_in(&SIGN_IN, req).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let key = form.get("key").unwrap_or("").trim();
    let principal = match s.store.authenticate(key).await {
        Err(e) => return unavailable(e),
        Ok(Ok(p)) => p,
        // Refused sign-ins count as the API's refusals do (`tessera_refused_total`
        // and `tessera_auth_failures_total`, by the same reasons).
        Ok(Err(e @ AuthError::Suspended(_))) => {
            s.metrics.refused(e.label());
            return login_page(StatusCode::FORBIDDEN, Some(&e.to_string()), secure);
        }
        Ok(Err(e)) => {
            s.metrics.refused(e.label());
            tracing::info!(reason = e.label(), "dashboard sign-in refused");
            return login_page(
                StatusCode::UNAUTHORIZED,
                Some("That key is not valid (unknown, revoked or expired)."),
                secure,
            );
        }
    };
    if !principal.scopes.contains(Scope::UsageRead) {
        s.metrics.refused("scope");
        return login_page(
            StatusCode::FORBIDDEN,
            Some("That key lacks the usage:read scope, which the dashboard needs."),
            secure,
        );
    }
    // A sign-in writes a session row: it takes one of the tenant's usage-API
    // queries, so a key cannot flood the store with sessions.
    let t = &principal.tenant;
    if let Err(e) = s
        .limiter
        .usage_query(&t.id, t.limits, s.usage.queries_per_minute)
    {
        let why = format!(
            "Too many sign-ins and usage reads ({}); try again in {} s.",
            e.detail,
            e.retry_after.as_secs().max(1)
        );
        return login_page(StatusCode::TOO_MANY_REQUESTS, Some(&why), secure);
    }
    let created = s
        .store
        .create_dash_session(&t.id, &principal.key_id, SESSION_TTL_MS)
        .await;
    match created {
        Ok((value, _)) => {
            super::web::signed_in_to(&SIGN_IN, "/dash/", TENANT_COOKIE, &value, secure)
        }
        Err(e) => unavailable(e),
    }
}

/// A signed-in tenant: its session, tenant record and keys (the session's own
/// among them).
struct Signed {
    cookie: String,
    session: DashSession,
    tenant: Tenant,
    keys: Vec<KeyInfo>,
    /// The session's own key (among `keys`).
    own: KeyInfo,
}

impl Signed {
    /// Whether the session may create and revoke keys (its key holds `keys:write`).
    fn manages_keys(&self) -> bool {
        self.own.scopes.contains(Scope::KeysWrite)
    }
}

/// The request's tenant session, checked against its key; otherwise the answer:
/// a 303 to the sign-in page (no session, or one whose key can no longer sign in:
/// that session is ended), or a 503. Every `tessera_dash` cookie the browser sent
/// is tried (a planted one must not hide the real one).
async fn signed_in(s: &AppState, headers: &HeaderMap) -> Result<Signed, Response> {
    let mut found = None;
    let presented = cookies(headers, TENANT_COOKIE);
    // A cookie that opens no session: say so on the sign-in page.
    let ended = || {
        see_other(if presented.is_empty() {
            "/dash/login"
        } else {
            "/dash/login?ended"
        })
    };
    for c in presented.iter().cloned() {
        match s.store.dash_session(&c).await {
            Err(e) => return Err(unavailable(e)),
            Ok(Some(sess)) if !sess.is_operator() => {
                found = Some((c, sess));
                break;
            }
            Ok(_) => {}
        }
    }
    let Some((c, session)) = found else {
        return Err(ended());
    };
    let invalid = match s
        .store
        .invalid_keys(std::slice::from_ref(&session.key_id))
        .await
    {
        Ok(v) => v,
        Err(e) => return Err(unavailable(e)),
    };
    let tenant = match s.store.tenant(&session.tenant_id).await {
        Ok(t) => t,
        Err(e) => return Err(unavailable(e)),
    };
    let keys = match s.store.list_keys(Some(&session.tenant_id)).await {
        Ok(k) => k,
        Err(e) => return Err(unavailable(e)),
    };
    let own = keys.iter().find(|k| k.key_id == session.key_id).cloned();
    match (invalid.is_empty(), tenant, own) {
        (true, Some(tenant), Some(own)) => Ok(Signed {
            cookie: c,
            session,
            tenant,
            keys,
            own,
        }),
        _ => {
            if let Err(e) = s.store.end_dash_session(&c).await {
                return Err(unavailable(e));
            }
            Err(ended())
        }
    }
}

/// A form post of a signed-in tenant: same origin, the session's token, a form of
/// bounded size. Otherwise the answer (403, 413, or as [`signed_in`]).
async fn signed_post(s: &AppState, req: Request) -> Result<(Signed, Form, Request<()>), Response> {
    let (parts, body) = req.into_parts();
    let signed = signed_in(s, &parts.headers).await?;
    let Some(form) = Form::read(body).await else {
        return Err(message(
            StatusCode::PAYLOAD_TOO_LARGE,
            CSS,
            "Form too large",
            "The form is larger than the dashboard accepts.",
            "/dash/",
        ));
    };
    if !same_origin(&parts.headers)
        || !tokens_match(&signed.session.csrf, form.get("csrf").unwrap_or(""))
    {
        tracing::warn!(tenant = %signed.tenant.id, "dashboard: a form post without this session's token or origin was refused");
        return Err(message(
            StatusCode::FORBIDDEN,
            CSS,
            "Refused",
            "This form did not come from your dashboard session (missing or wrong form token).",
            "/dash/",
        ));
    }
    Ok((signed, form, axum::http::Request::from_parts(parts, ())))
}

/// The windows the overview offers: name, label, and `since` for `now` (Unix
/// ms): the last 60 minutes; the last 24 (or 30 x 24) whole UTC hours and the
/// current one, so the store reads its hourly sums.
const WINDOWS: [(&str, &str); 3] = [
    ("hour", "Last hour"),
    ("day", "Last 24 hours"),
    ("month", "Last 30 days"),
];

fn window_since(name: &str, until_ms: i64) -> Option<(i64, GroupBy, i64)> {
    let hour_start = until_ms.div_euclid(HOUR_MS) * HOUR_MS;
    match name {
        "hour" => Some((until_ms - HOUR_MS, GroupBy::Hour, HOUR_MS)),
        "day" => Some((hour_start - 24 * HOUR_MS, GroupBy::Hour, HOUR_MS)),
        "month" => Some((hour_start - 30 * 24 * HOUR_MS, GroupBy::Day, 24 * HOUR_MS)),
        _ => None,
    }
}

fn groups_ctx(groups: &[UsageGroup], label: impl Fn(&str) -> String) -> Vec<minijinja::Value> {
    groups
        .iter()
        .map(|g| {
            minijinja::context! {
                key => g.key, label => label(&g.key), requests => g.requests, errors => g.errors,
                input_tokens => g.input_tokens, output_tokens => g.output_tokens,
                cached_tokens => g.cached_tokens,
            }
        })
        .collect()
}

fn key_state(k: &KeyInfo, now: i64) -> &'static str {
    if k.revoked_ms.is_some() {
        "revoked"
    } else if k.expires_ms.is_some_and(|e| e <= now) {
        "expired"
    } else {
        "active"
    }
}

/// Whether keys of `scopes` are within the signed-in key's `own` (a session may
/// create and revoke only keys that can do no more than its own).
fn within(scopes: Scopes, own: Scopes) -> bool {
    Scope::ALL
        .into_iter()
        .all(|sc| !scopes.contains(sc) || own.contains(sc))
}

async fn overview(State(s): State<Arc<AppState>>, req: Request) -> Response {
    let signed = match signed_in(&s, req.headers()).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let q: std::collections::HashMap<String, String> = req
        .uri()
        .query()
        .map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect())
        .unwrap_or_default();
    let window = q.get("window").map_or("day", |w| w.as_str());
    // Whole seconds, so the range the page states is the one it read.
    let until = (now_ms() / 1000 + 1) * 1000;
    let Some((since, bucket_by, bucket_ms)) = window_since(window, until) else {
        return message(
            StatusCode::BAD_REQUEST,
            CSS,
            "Unknown window",
            "`window` must be hour, day or month.",
            "/dash/",
        );
    };
    let t = &signed.tenant;
    if let Err(e) = s
        .limiter
        .usage_query(&t.id, t.limits, s.usage.queries_per_minute)
    {
        return message(
            StatusCode::TOO_MANY_REQUESTS,
            CSS,
            "Slow down",
            &format!(
                "Too many usage reads ({}); try again in {} s.",
                e.detail,
                e.retry_after.as_secs().max(1)
            ),
            "/dash/",
        );
    }
    match render_overview(&s, &signed, window, since, until, bucket_by, bucket_ms).await {
        Ok(r) => r,
        Err(e) => unavailable(e),
    }
}

#[allow(clippy::too_many_arguments)]
async fn render_overview(
    s: &AppState,
    signed: &Signed,
    window: &str,
    since: i64,
    until: i64,
    bucket_by: GroupBy,
    bucket_ms: i64,
) -> Result<Response, tessera_tenancy::StoreError> {
    let t = &signed.tenant;
    let store = &s.store;
    let by_model = store
        .usage_summary(&t.id, since, until, GroupBy::Model)
        .await?;
    let by_key = store
        .usage_summary(&t.id, since, until, GroupBy::Key)
        .await?;
    let series = store.usage_summary(&t.id, since, until, bucket_by).await?;
    let now = now_ms();
    let minute = store
        .usage_summary(&t.id, now - 60_000, now + 1, GroupBy::Model)
        .await?;
    let day_start = now.div_euclid(24 * HOUR_MS) * 24 * HOUR_MS;
    // From the hourly sums (what `tokens_since` counts, without reading a day of
    // ledger rows).
    let today: i64 = store
        .usage_summary(&t.id, day_start, now + 1, GroupBy::Model)
        .await?
        .iter()
        .map(|g| g.input_tokens + g.output_tokens)
        .sum();

    let sum = |f: fn(&UsageGroup) -> i64, gs: &[UsageGroup]| gs.iter().map(f).sum::<i64>();
    let totals = minijinja::context! {
        requests => sum(|g| g.requests, &by_model), errors => sum(|g| g.errors, &by_model),
        input_tokens => sum(|g| g.input_tokens, &by_model),
        output_tokens => sum(|g| g.output_tokens, &by_model),
        cached_tokens => sum(|g| g.cached_tokens, &by_model),
    };
    let key_names: std::collections::HashMap<&str, &str> = signed
        .keys
        .iter()
        .map(|k| (k.key_id.as_str(), k.name.as_str()))
        .collect();
    let by_key_ctx = groups_ctx(&by_key, |id| match key_names.get(id) {
        Some(n) => format!("{n} ({id})"),
        None => id.to_string(),
    });
    let points: Vec<Point> = series
        .iter()
        .filter_map(|g| {
            Some(Point {
                at_ms: tessera_tenancy::store::parse_time(&g.key)?,
                input: g.input_tokens,
                output: g.output_tokens,
            })
        })
        .collect();
    let chart = tokens_chart(&points, since, until, bucket_ms);
    let series_ctx: Vec<_> = series
        .iter()
        .map(|g| {
            minijinja::context! {
                key => g.key, requests => g.requests, input_tokens => g.input_tokens,
                output_tokens => g.output_tokens,
                label => tessera_tenancy::store::parse_time(&g.key).map_or(g.key.clone(), utc_minute),
            }
        })
        .collect();

    let l = t.limits;
    let limit_text = |v: u64| {
        if v == 0 {
            "unlimited".to_string()
        } else {
            v.to_string()
        }
    };
    let limits = vec![
        minijinja::context! { name => "requests_per_minute", label => "Requests per minute",
        used => sum(|g| g.requests, &minute), limit => limit_text(l.requests_per_minute.into()) },
        minijinja::context! { name => "input_tokens_per_minute", label => "Tokens in per minute",
        used => sum(|g| g.input_tokens, &minute), limit => limit_text(l.input_tokens_per_minute.into()) },
        minijinja::context! { name => "output_tokens_per_minute", label => "Tokens out per minute",
        used => sum(|g| g.output_tokens, &minute), limit => limit_text(l.output_tokens_per_minute.into()) },
        minijinja::context! { name => "max_concurrent", label => "Requests at once",
        used => s.limiter.inflight(&t.id), limit => limit_text(l.max_concurrent.into()) },
        minijinja::context! { name => "daily_tokens", label => "Tokens today (UTC)",
        used => today, limit => limit_text(l.daily_tokens) },
    ];
    let keys: Vec<_> = signed
        .keys
        .iter()
        .map(|k| {
            let state = key_state(k, now);
            minijinja::context! {
                key_id => k.key_id, name => k.name, scopes => k.scopes.names().join(", "),
                created => utc_minute(k.created_ms),
                expires => k.expires_ms.map_or("never".to_string(), utc_minute),
                state,
                revocable => signed.manages_keys() && state == "active" && within(k.scopes, signed.own.scopes)
                    && k.key_id != signed.session.key_id,
            }
        })
        .collect();
    let batches = batches_of(s, &t.id);
    let windows: Vec<_> = WINDOWS
        .iter()
        .map(|(name, label)| minijinja::context! { name, label, current => *name == window })
        .collect();
    let window_label = WINDOWS
        .iter()
        .find(|(n, _)| *n == window)
        .map_or("", |(_, l)| l);
    Ok(page(
        StatusCode::OK,
        "tenant.html",
        minijinja::context! {
            css => CSS, csrf => signed.session.csrf, tenant => minijinja::context! { id => t.id, name => t.name },
            key_id => signed.session.key_id, windows, window_label,
            since => since / 1000, until => until / 1000,
            since_text => utc_minute(since), until_text => utc_minute(until),
            totals, chart, series => series_ctx,
            bucket => if bucket_ms == HOUR_MS { "hour" } else { "day" },
            by_model => groups_ctx(&by_model, |m| m.to_string()), by_key => by_key_ctx,
            limits, keys, batches,
            manages_keys => signed.manages_keys(),
            grantable => signed.own.scopes.names(),
        },
    ))
}

/// The tenant's batch jobs on this gateway (batches live in its memory).
fn batches_of(s: &AppState, tenant_id: &str) -> Vec<minijinja::Value> {
    let jobs = s.batches.jobs.lock().unwrap();
    let mut out: Vec<_> = jobs
        .values()
        .filter(|j| j.tenant_id == tenant_id)
        .map(|j| {
            let p = j.progress.lock().unwrap();
            let done = p.results.iter().filter(|r| r.is_some()).count();
            let state = if p.finished.is_some() {
                "finished"
            } else if p.started > 0 {
                "running"
            } else {
                "queued"
            };
            (
                j.id.clone(),
                minijinja::context! {
                    id => j.id, model => j.model, items => p.results.len(), done, state,
                },
            )
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out.into_iter().map(|(_, v)| v).collect()
}

fn audit_ctx(req: &Request<()>, signed: &Signed) -> AuditCtx {
    let peer = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map_or("unknown".to_string(), |c| c.0.to_string());
    AuditCtx {
        request_id: tessera_tenancy::random_hex(16),
        source: format!("dash:{}:{}@{peer}", signed.tenant.id, signed.session.key_id),
    }
}

async fn create_key(State(s): State<Arc<AppState>>, req: Request) -> Response {
    let (signed, form, req) = match signed_post(&s, req).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    if !signed.manages_keys() {
        return needs_keys_write("Key not created");
    }
    let now = now_ms();
    let active = signed
        .keys
        .iter()
        .filter(|k| key_state(k, now) == "active")
        .count();
    if active >= MAX_ACTIVE_KEYS {
        let why = format!(
            "The account has {active} active keys, the most the dashboard makes; revoke one first."
        );
        return message(StatusCode::CONFLICT, CSS, "Key not created", &why, "/dash/");
    }
    let bad = |why: &str| {
        message(
            StatusCode::BAD_REQUEST,
            CSS,
            "Key not created",
            why,
            "/dash/",
        )
    };
    let name = form.get("name").unwrap_or("").trim();
    if name.is_empty() || name.chars().count() > 200 {
        return bad("A key needs a name of 1 to 200 characters.");
    }
    let scopes = match Scopes::from_names(form.all("scope")) {
        Ok(sc) => sc,
        Err(e) => return bad(&e),
    };
    if !within(scopes, signed.own.scopes) {
        return message(
            StatusCode::FORBIDDEN,
            CSS,
            "Key not created",
            "A new key may hold only scopes the key you signed in with holds.",
            "/dash/",
        );
    }
    let asked = match form.get("expires_days").map(str::trim) {
        None | Some("") => None,
        Some(d) => match d.parse::<i64>() {
            Ok(days @ 1..=3650) => Some(now + days * 24 * HOUR_MS),
            _ => return bad("`expires_days` must be a whole number of days from 1 to 3650."),
        },
    };
    // A key made by a key does not outlive it.
    let expires_ms = match (asked, signed.own.expires_ms) {
        (Some(a), Some(own)) => Some(a.min(own)),
        (a, own) => a.or(own),
    };
    let capped = expires_ms != asked;
    let new = NewKey {
        name: name.to_string(),
        scopes,
        expires_ms,
    };
    let ctx = audit_ctx(&req, &signed);
    let (info, secret) = match s
        .store
        .audited(&ctx)
        .create_key(&signed.tenant.id, &new)
        .await
    {
        Ok(x) => x,
        Err(e) => return unavailable(e),
    };
    page(
        StatusCode::OK,
        "key_created.html",
        minijinja::context! {
            css => CSS, secret, key_id => info.key_id, name => info.name,
            scopes => info.scopes.names().join(", "),
            expires => info.expires_ms.map_or("never".to_string(), utc_minute),
            capped,
        },
    )
}

async fn revoke_key(
    State(s): State<Arc<AppState>>,
    Path(key_id): Path<String>,
    req: Request,
) -> Response {
    let (signed, _, req) = match signed_post(&s, req).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    if !signed.manages_keys() {
        return needs_keys_write("Not revoked");
    }
    // One click must not lock the owner out: the session's own key is revoked with
    // another key, the CLI or the admin API.
    if key_id == signed.session.key_id {
        return message(
            StatusCode::CONFLICT,
            CSS,
            "Not revoked",
            "This is the key you signed in with; revoke it from another key's session, \
             `tessera key revoke`, or the admin API.",
            "/dash/",
        );
    }
    // Another tenant's key, or none: the same 404.
    let Some(k) = signed.keys.iter().find(|k| k.key_id == key_id) else {
        return message(
            StatusCode::NOT_FOUND,
            CSS,
            "No such key",
            "Your account has no key with that id.",
            "/dash/",
        );
    };
    if !within(k.scopes, signed.own.scopes) {
        return message(
            StatusCode::FORBIDDEN,
            CSS,
            "Not revoked",
            "The key you signed in with may revoke only keys that hold no scope it lacks.",
            "/dash/",
        );
    }
    let ctx = audit_ctx(&req, &signed);
    match s.store.audited(&ctx).revoke_key(&key_id).await {
        Err(e) => return unavailable(e),
        Ok(false) => {
            return message(
                StatusCode::CONFLICT,
                CSS,
                "Not revoked",
                "That key was already revoked.",
                "/dash/",
            )
        }
        Ok(true) => {}
    }
    s.live.kick();
    if let Err(e) = s.store.end_key_dash_sessions(&key_id).await {
        return unavailable(e);
    }
    see_other("/dash/")
}

/// The 403 of a key action by a session whose key lacks `keys:write`.
fn needs_keys_write(heading: &str) -> Response {
    message(
        StatusCode::FORBIDDEN,
        CSS,
        heading,
        "Creating and revoking keys needs a key with the keys:write scope.",
        "/dash/",
    )
}

fn over_tls_of(req: &Request<()>) -> bool {
    req.extensions().get::<crate::listener::OverTls>().is_some()
}

async fn logout(State(s): State<Arc<AppState>>, req: Request) -> Response {
    let (signed, _, req) = match signed_post(&s, req).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    if let Err(e) = s.store.end_dash_session(&signed.cookie).await {
        return unavailable(e);
    }
    let mut resp = see_other("/dash/login");
    resp.headers_mut().append(
        header::SET_COOKIE,
        set_cookie(TENANT_COOKIE, "", "/dash", 0, over_tls_of(&req)),
    );
    resp.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_cover_whole_hours_except_the_last_hour() {
        let until = 1_765_000_000_000 + 1234;
        let (since, _, _) = window_since("day", until).unwrap();
        assert_eq!(since % HOUR_MS, 0);
        assert!(until - since > 24 * HOUR_MS && until - since <= 25 * HOUR_MS);
        let (since, by, _) = window_since("month", until).unwrap();
        assert_eq!((since % HOUR_MS, by), (0, GroupBy::Day));
        assert!(until - since > 30 * 24 * HOUR_MS && until - since <= (30 * 24 + 1) * HOUR_MS);
        assert_eq!(window_since("hour", until).unwrap().0, until - HOUR_MS);
        assert!(window_since("year", until).is_none());
    }

    #[test]
    fn a_session_manages_only_keys_within_its_scopes() {
        let read = Scopes::from_names(["usage:read"]).unwrap();
        let inf = Scopes::from_names(["inference"]).unwrap();
        assert!(within(read, Scopes::ALL));
        assert!(within(read, read));
        assert!(!within(Scopes::ALL, read));
        assert!(within(Scopes::DEFAULT, Scopes::ALL));
        assert!(!within(Scopes::ALL, Scopes::DEFAULT));
        assert!(!within(inf, read));
    }
}
