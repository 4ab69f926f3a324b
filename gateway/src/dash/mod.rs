//! The browser dashboard: `/dash/` for a tenant (signed in with an API key that
//! holds `usage:read`), `/dash/admin/` for the operator (signed in with the admin
//! token, on the admin listener when one is configured).
//!
//! Server-rendered HTML (minijinja templates, autoescaped) with inline SVG charts
//! (plotters), everything served from the binary. No page carries a script: the
//! Content-Security-Policy allows none, and the pages work without JavaScript.
//!
//! Who can reach what:
//! - anyone: the sign-in pages and the stylesheet;
//! - a browser with a session cookie (`tessera_dash`, HttpOnly, SameSite=Strict,
//!   `Secure` over TLS): its own tenant's pages; the key is exchanged for the
//!   session at sign-in and never stored in the browser. The session is checked
//!   against its key on every page (a revoked or expired key, or a suspended
//!   tenant, ends it);
//! - every form post carries the session's CSRF token and must come from the
//!   dashboard's own origin (`Origin`, `Sec-Fetch-Site`); the sign-in forms carry a
//!   double-submit token tied to a short-lived pre-session cookie.
//!
//! Sessions live in the store (`dash_sessions`, only a digest of the cookie), so
//! every gateway replica accepts them.

mod chart;
mod operator;
mod tenant;
mod web;

use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use std::sync::Arc;

use crate::state::AppState;

/// The Content-Security-Policy of every dashboard response: no scripts, no
/// framing, styles and images from the dashboard itself only, forms post only to it.
pub(crate) const CSP: &str = "default-src 'none'; style-src 'self'; img-src 'self'; \
     form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// The tenant dashboard's routes (the public listener).
pub(crate) fn tenant_routes() -> Router<Arc<AppState>> {
    tenant::routes()
        .route("/dash/static/dash.css", get(stylesheet))
        .layer(middleware::from_fn(security_headers))
}

/// The operator view's routes (the admin listener, or the one listener).
pub(crate) fn operator_routes() -> Router<Arc<AppState>> {
    operator::routes()
        .route("/dash/admin/static/dash.css", get(stylesheet))
        .layer(middleware::from_fn(security_headers))
}

async fn stylesheet() -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/css; charset=utf-8"),
            (header::CACHE_CONTROL, "public, max-age=3600"),
        ],
        include_str!("dash.css"),
    )
        .into_response()
}

/// Adds the dashboard's security headers to every response.
async fn security_headers(req: Request, next: Next) -> Response {
    let mut resp = next.run(req).await;
    let h = resp.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    // `same-origin`, not `no-referrer`: under `no-referrer` browsers send
    // `Origin: null` on the dashboard's own form posts, which `same_origin` refuses.
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("same-origin"),
    );
    h.entry(header::CACHE_CONTROL)
        .or_insert(HeaderValue::from_static("no-store"));
    resp
}

/// Samples the integrity counters into `state.integrity` every [`SAMPLE_EVERY`](crate::integrity_log::SAMPLE_EVERY),
/// for as long as the gateway serves.
pub(crate) async fn watch_integrity(state: Arc<AppState>) {
    loop {
        let text = state.metrics.render_with(
            state.engine_stats(),
            state.inflight(),
            state.engine.node_metrics(),
        );
        state.integrity.observe(
            crate::integrity_log::totals(&text),
            tessera_tenancy::now_ms(),
        );
        tokio::time::sleep(crate::integrity_log::SAMPLE_EVERY).await;
    }
}
