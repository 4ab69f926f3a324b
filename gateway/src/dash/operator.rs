//! The operator view: tenants and their usage, nodes and their pools, integrity
//! counters and the audit log, each linking to the runbook that covers it. Signed
//! in with the admin token (exchanged for a session cookie on `/dash/admin`); with
//! no admin token configured the view does not exist (404).

use super::web::{
    cookies, message, over_tls, page, same_origin, see_other, set_cookie, tokens_match, utc_minute,
    Form, SignIn, OPERATOR_COOKIE, SESSION_TTL_MS,
};
use crate::integrity_log::{metric_sum, INTEGRITY};
use crate::state::AppState;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use std::collections::HashMap;
use std::sync::Arc;
use tessera_tenancy::{now_ms, DashSession};

const CSS: &str = "/dash/admin/static/dash.css";

/// The runbooks the view links to, served from the binary.
const RUNBOOKS: &[(&str, &str)] = &[
    (
        "kv-transfer-integrity",
        include_str!("../../../ops/runbooks/kv-transfer-integrity.md"),
    ),
    (
        "suspected-cross-tenant-leak",
        include_str!("../../../ops/runbooks/suspected-cross-tenant-leak.md"),
    ),
    (
        "node-down",
        include_str!("../../../ops/runbooks/node-down.md"),
    ),
    (
        "draining-a-node",
        include_str!("../../../ops/runbooks/draining-a-node.md"),
    ),
    (
        "kv-pool-sizing",
        include_str!("../../../ops/runbooks/kv-pool-sizing.md"),
    ),
    (
        "key-rotation",
        include_str!("../../../ops/runbooks/key-rotation.md"),
    ),
    (
        "tenant-cache-purge",
        include_str!("../../../ops/runbooks/tenant-cache-purge.md"),
    ),
    (
        "pd-deployment",
        include_str!("../../../ops/runbooks/pd-deployment.md"),
    ),
    (
        "error-rate",
        include_str!("../../../ops/runbooks/error-rate.md"),
    ),
    (
        "dashboard",
        include_str!("../../../ops/runbooks/dashboard.md"),
    ),
];

pub(super) fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/dash/admin", get(|| async { see_other("/dash/admin/") }))
        .route("/dash/admin/", get(overview))
        .route("/dash/admin/login", get(login_form).post(login))
        .route("/dash/admin/logout", post(logout))
        .route("/dash/admin/runbooks/{name}", get(runbook))
}

fn disabled() -> Response {
    message(
        StatusCode::NOT_FOUND,
        CSS,
        "Not found",
        "The operator view is disabled: no admin token is configured.",
        "/dash/",
    )
}

const SIGN_IN: SignIn = SignIn {
    css: CSS,
    action: "/dash/admin/login",
    cookie_path: "/dash/admin",
    heading: "Operator sign-in",
    field: "token",
    label: "Admin token",
    note: "The admin token is exchanged for a session cookie that lasts an hour.",
};

fn unavailable(e: impl std::fmt::Display) -> Response {
    super::web::unavailable(CSS, "/dash/admin/", e)
}

fn login_page(status: StatusCode, error: Option<&str>, secure: bool) -> Response {
    super::web::login_page(&SIGN_IN, status, error, secure)
}

async fn login_form(State(s): State<Arc<AppState>>, req: Request) -> Response {
    if s.admin_token.is_none() {
        return disabled();
    }
    super::web::sign_in_form(&SIGN_IN, &req)
}

async fn login(State(s): State<Arc<AppState>>, req: Request) -> Response {
    let Some(expected) = s.admin_token.clone() else {
        return disabled();
    };
    let (form, secure) = match super::web::read_sign_in(&SIGN_IN, req).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    if !tokens_match(&expected, form.get("token").unwrap_or("")) {
        s.metrics.refused("admin_auth");
        return login_page(StatusCode::UNAUTHORIZED, Some("Wrong admin token."), secure);
    }
    let id = DashSession::operator_id(&expected);
    match s.store.create_dash_session("", &id, SESSION_TTL_MS).await {
        Ok((value, _)) => {
            super::web::signed_in_to(&SIGN_IN, "/dash/admin/", OPERATOR_COOKIE, &value, secure)
        }
        Err(e) => unavailable(e),
    }
}

/// The request's operator session, or the answer (404 when the view is disabled,
/// a 303 to the sign-in page, a 503).
async fn operator(s: &AppState, headers: &HeaderMap) -> Result<(String, DashSession), Response> {
    if s.admin_token.is_none() {
        return Err(disabled());
    }
    // Only sessions signed in with the current token (a rotated token ends the
    // old one's sessions).
    let current = s.admin_token.as_deref().map(DashSession::operator_id);
    let presented = cookies(headers, OPERATOR_COOKIE);
    for c in presented.iter().cloned() {
        match s.store.dash_session(&c).await {
            Err(e) => return Err(unavailable(e)),
            Ok(Some(sess)) if sess.is_operator() && current.as_ref() == Some(&sess.key_id) => {
                return Ok((c, sess))
            }
            Ok(_) => {}
        }
    }
    Err(see_other(if presented.is_empty() {
        "/dash/admin/login"
    } else {
        "/dash/admin/login?ended"
    }))
}

async fn logout(State(s): State<Arc<AppState>>, req: Request) -> Response {
    let secure = over_tls(&req);
    let (parts, body) = req.into_parts();
    let (c, sess) = match operator(&s, &parts.headers).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let form = Form::read(body).await;
    let genuine = form
        .as_ref()
        .is_some_and(|f| tokens_match(&sess.csrf, f.get("csrf").unwrap_or("")));
    if !genuine || !same_origin(&parts.headers) {
        return message(
            StatusCode::FORBIDDEN,
            CSS,
            "Refused",
            "This form did not come from your operator session.",
            "/dash/admin/",
        );
    }
    if let Err(e) = s.store.end_dash_session(&c).await {
        return unavailable(e);
    }
    let mut resp = see_other("/dash/admin/login");
    resp.headers_mut().append(
        header::SET_COOKIE,
        set_cookie(OPERATOR_COOKIE, "", "/dash/admin", 0, secure),
    );
    resp
}

async fn runbook(
    State(s): State<Arc<AppState>>,
    Path(name): Path<String>,
    headers: HeaderMap,
) -> Response {
    if let Err(r) = operator(&s, &headers).await {
        return r;
    }
    match RUNBOOKS.iter().find(|(n, _)| *n == name) {
        Some((name, text)) => page(
            StatusCode::OK,
            "runbook.html",
            minijinja::context! { css => CSS, name, text },
        ),
        None => message(
            StatusCode::NOT_FOUND,
            CSS,
            "No such runbook",
            "The operator view serves the runbooks it links to.",
            "/dash/admin/",
        ),
    }
}

async fn overview(State(s): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    let (_, sess) = match operator(&s, &headers).await {
        Ok(x) => x,
        Err(r) => return r,
    };
    let until = (now_ms() / 1000 + 1) * 1000;
    let since = until - 24 * 3_600_000;
    let store = &s.store;
    let (tenants, usage, audit) = match tokio::try_join!(
        store.list_tenants(),
        store.usage_by_tenant(since, until),
        store.audit_latest(50),
    ) {
        Ok(x) => x,
        Err(e) => return unavailable(e),
    };
    let usage: HashMap<&str, &tessera_tenancy::UsageGroup> =
        usage.iter().map(|g| (g.key.as_str(), g)).collect();
    let suspended = tenants
        .iter()
        .filter(|t| t.status != tessera_tenancy::TenantStatus::Active)
        .count();
    let tenant_rows: Vec<_> = tenants
        .iter()
        .map(|t| {
            let u = usage.get(t.id.as_str());
            minijinja::context! {
                id => t.id, name => t.name, status => t.status.as_str(),
                requests => u.map_or(0, |g| g.requests), errors => u.map_or(0, |g| g.errors),
                input_tokens => u.map_or(0, |g| g.input_tokens),
                output_tokens => u.map_or(0, |g| g.output_tokens),
            }
        })
        .collect();

    let metrics_text =
        s.metrics
            .render_with(s.engine_stats(), s.inflight(), s.engine.node_metrics());
    let mut nodes = Vec::new();
    for m in &s.models {
        let st = m.engine.stats();
        let used = st
            .capacity_pages
            .saturating_sub(st.free_pages + st.cached_pages);
        nodes.push(minijinja::context! {
            model => m.entry.id, key => format!("{}#in-process", m.entry.id),
            name => "in-process engines", role => "engine", state => "up", free => st.free_pages, used, cached => st.cached_pages,
            quarantined => metric_sum(&metrics_text, "tessera_kv_pages", Some("state=\"quarantined\"")),
            running => st.running, waiting => st.waiting,
        });
    }
    if let Some(r) = s.reloader() {
        let members = r.nodes();
        for model in members.as_array().into_iter().flatten() {
            for n in model["nodes"].as_array().into_iter().flatten() {
                nodes.push(minijinja::context! {
                    model => model["model"].as_str().unwrap_or(""),
                    key => format!("{}#{}", model["model"].as_str().unwrap_or(""), n["addr"].as_str().unwrap_or("")),
                    name => n["addr"].as_str().unwrap_or(""),
                    role => n["role"].as_str().unwrap_or(""),
                    state => n["state"].as_str().unwrap_or(""),
                    free => "see its /metrics", used => "", cached => "", quarantined => "",
                    running => n["outstanding"].as_u64().unwrap_or(0), waiting => "",
                });
            }
        }
    }
    let events: Vec<_> = s
        .integrity
        .recent()
        .iter()
        .filter_map(|e| {
            let (name, _, label, runbook) = INTEGRITY.get(e.counter)?;
            Some(minijinja::context! {
                at => tessera_tenancy::store::rfc3339(e.at_ms), name, label, runbook, count => e.count,
            })
        })
        .collect();
    let integrity: Vec<_> = INTEGRITY
        .iter()
        .map(|(name, filter, label, runbook)| {
            minijinja::context! {
                name, label, runbook, count => metric_sum(&metrics_text, name, *filter),
            }
        })
        .collect();
    let audit: Vec<_> = audit
        .iter()
        .map(|a| {
            minijinja::context! {
                id => a.id, at => utc_minute(a.at_ms), action => a.action, target => a.target,
                source => a.source, detail => a.detail.to_string(),
            }
        })
        .collect();
    page(
        StatusCode::OK,
        "operator.html",
        minijinja::context! {
            css => CSS, csrf => sess.csrf, since => since / 1000, until => until / 1000,
            since_text => utc_minute(since), until_text => utc_minute(until),
            tenants => tenant_rows, suspended, nodes, integrity, events, audit,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_linked_runbook_is_served() {
        for (_, _, _, rb) in INTEGRITY {
            assert!(RUNBOOKS.iter().any(|(n, _)| n == rb), "{rb}");
        }
        let page = include_str!("templates/operator.html");
        for link in page.split("/dash/admin/runbooks/").skip(1) {
            let name = link.split('"').next().unwrap();
            if name.starts_with("{{") {
                continue;
            }
            assert!(RUNBOOKS.iter().any(|(n, _)| *n == name), "{name}");
        }
    }
}
