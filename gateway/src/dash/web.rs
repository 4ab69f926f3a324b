//! What the dashboard's pages share: templates, cookies, sessions' sign-in forms,
//! the origin and token checks of form posts, form bodies.

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use std::sync::OnceLock;
use subtle::ConstantTimeEq;

/// How long a dashboard session lasts (a tenant's or the operator's).
pub(super) const SESSION_TTL_MS: i64 = 60 * 60 * 1000;
/// How long a sign-in form stays valid.
pub(super) const PRE_SESSION_SECS: u64 = 600;
/// Largest form body accepted.
pub(super) const MAX_FORM_BYTES: usize = 16 * 1024;

pub(super) const TENANT_COOKIE: &str = "tessera_dash";
pub(super) const OPERATOR_COOKIE: &str = "tessera_dash_admin";
pub(super) const PRE_COOKIE: &str = "tessera_dash_pre";

fn templates() -> &'static minijinja::Environment<'static> {
    static ENV: OnceLock<minijinja::Environment<'static>> = OnceLock::new();
    ENV.get_or_init(|| {
        let mut env = minijinja::Environment::new();
        // `.html` names turn HTML autoescaping on (minijinja's default callback).
        for (name, src) in [
            ("base.html", include_str!("templates/base.html")),
            ("login.html", include_str!("templates/login.html")),
            ("message.html", include_str!("templates/message.html")),
            ("usage_rows.html", include_str!("templates/usage_rows.html")),
            ("tenant.html", include_str!("templates/tenant.html")),
            (
                "key_created.html",
                include_str!("templates/key_created.html"),
            ),
            ("operator.html", include_str!("templates/operator.html")),
            ("runbook.html", include_str!("templates/runbook.html")),
        ] {
            env.add_template(name, src)
                .expect("the dashboard's templates parse");
        }
        env
    })
}

/// Renders template `name` with `ctx` as an HTML response with `status`.
pub(super) fn page(status: StatusCode, name: &str, ctx: minijinja::Value) -> Response {
    match templates().get_template(name).and_then(|t| t.render(ctx)) {
        Ok(html) => (
            status,
            [(header::CONTENT_TYPE, "text/html; charset=utf-8")],
            html,
        )
            .into_response(),
        Err(e) => {
            tracing::error!(template = name, error = %e, "dashboard template failed");
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
                "the dashboard could not render this page",
            )
                .into_response()
        }
    }
}

/// An error page: `error` said in `#error`, with a link `back`.
pub(super) fn message(
    status: StatusCode,
    css: &str,
    heading: &str,
    error: &str,
    back: &str,
) -> Response {
    page(
        status,
        "message.html",
        minijinja::context! { css, heading, error, back },
    )
}

/// A store failure as a 503 page linking `back`.
pub(super) fn unavailable(css: &str, back: &str, e: impl std::fmt::Display) -> Response {
    tracing::error!(error = %e, "dashboard: store failure");
    message(
        StatusCode::SERVICE_UNAVAILABLE,
        css,
        "Unavailable",
        "The store is unavailable; try again shortly.",
        back,
    )
}

/// A sign-in form's fixed parts (the tenant's, the operator's).
pub(super) struct SignIn {
    pub(super) css: &'static str,
    /// Where the form posts, and the path its pre-session cookie is set on.
    pub(super) action: &'static str,
    pub(super) cookie_path: &'static str,
    pub(super) heading: &'static str,
    /// The secret's field name and label.
    pub(super) field: &'static str,
    pub(super) label: &'static str,
    pub(super) note: &'static str,
}

/// The sign-in page with a fresh double-submit token, `error` said in `#error`.
pub(super) fn login_page(
    f: &SignIn,
    status: StatusCode,
    error: Option<&str>,
    secure: bool,
) -> Response {
    render_login(f, status, error, None, secure)
}

/// The query a redirect to the sign-in page carries when the browser held a
/// session cookie that no longer opens a session.
pub(super) const ENDED: &str = "ended";

/// `GET` of a sign-in page: the form, saying why when a session just ended
/// (`?ended`, see [`ENDED`]).
pub(super) fn sign_in_form(f: &SignIn, req: &Request) -> Response {
    let notice = (req.uri().query() == Some(ENDED)).then_some(
        "Your session ended: you signed out, it expired, or its key was revoked or its \
         account suspended. Sign in again.",
    );
    render_login(f, StatusCode::OK, None, notice, over_tls(req))
}

fn render_login(
    f: &SignIn,
    status: StatusCode,
    error: Option<&str>,
    notice: Option<&str>,
    secure: bool,
) -> Response {
    let (csrf, pre) = pre_session(f.cookie_path, secure);
    let mut resp = page(
        status,
        "login.html",
        minijinja::context! {
            css => f.css, heading => f.heading, error, notice, action => f.action, csrf,
            field => f.field, label => f.label, note => f.note,
        },
    );
    resp.headers_mut().append(header::SET_COOKIE, pre);
    resp
}

/// Reads a sign-in post: its form and whether it came over TLS, or the sign-in page
/// again (413 for a form too large, 403 for one without the form's token or from
/// another origin).
pub(super) async fn read_sign_in(f: &SignIn, req: Request) -> Result<(Form, bool), Response> {
    let secure = over_tls(&req);
    let (parts, body) = req.into_parts();
    let Some(form) = Form::read(body).await else {
        let why = Some("The form is too large.");
        return Err(login_page(f, StatusCode::PAYLOAD_TOO_LARGE, why, secure));
    };
    if !sign_in_allowed(&parts.headers, &form) {
        let why = Some("The sign-in form expired or did not come from this site; try again.");
        return Err(login_page(f, StatusCode::FORBIDDEN, why, secure));
    }
    Ok((form, secure))
}

/// The answer to a sign-in that started a session: a 303 to `to` setting cookie
/// `name` (on the form's cookie path) and spending the sign-in token.
pub(super) fn signed_in_to(
    f: &SignIn,
    to: &'static str,
    name: &str,
    value: &str,
    secure: bool,
) -> Response {
    let mut resp = see_other(to);
    let ttl = (SESSION_TTL_MS / 1000) as u64;
    let h = resp.headers_mut();
    h.append(
        header::SET_COOKIE,
        set_cookie(name, value, f.cookie_path, ttl, secure),
    );
    h.append(
        header::SET_COOKIE,
        set_cookie(PRE_COOKIE, "", f.cookie_path, 0, secure),
    );
    resp
}

/// A 303 to `to` (after a form post, and to the sign-in page).
pub(super) fn see_other(to: &'static str) -> Response {
    (StatusCode::SEE_OTHER, [(header::LOCATION, to)]).into_response()
}

/// Most values of one cookie name looked at: a page on a sibling host or another
/// port of this one can set a cookie of the same name (cookies ignore ports), which
/// the browser may send first; each is tried, a few at most.
const MAX_COOKIE_VALUES: usize = 4;

/// The values of cookie `name` in the request's `Cookie` headers, in order.
pub(super) fn cookies(headers: &HeaderMap, name: &str) -> Vec<String> {
    headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|pair| pair.trim().split_once('='))
        .filter(|(k, _)| *k == name)
        .map(|(_, v)| v.trim().to_string())
        .take(MAX_COOKIE_VALUES)
        .collect()
}

/// A `Set-Cookie` value: HttpOnly, SameSite=Strict, on `path`, `Secure` over TLS;
/// `max_age` 0 deletes it.
pub(super) fn set_cookie(
    name: &str,
    value: &str,
    path: &str,
    max_age: u64,
    secure: bool,
) -> HeaderValue {
    let secure = if secure { "; Secure" } else { "" };
    HeaderValue::from_str(&format!(
        "{name}={value}; Path={path}; Max-Age={max_age}; HttpOnly; SameSite=Strict{secure}"
    ))
    .expect("cookie values are hex")
}

/// Whether the request came over TLS.
pub(super) fn over_tls(req: &Request) -> bool {
    req.extensions().get::<crate::listener::OverTls>().is_some()
}

/// Whether a form post comes from the dashboard's own origin: its `Origin`, when
/// sent, names the `Host` it was sent to, and `Sec-Fetch-Site`, when sent, says
/// `same-origin` (or `none`: typed by the user). Browsers send both on form posts;
/// the CSRF token is checked besides.
pub(super) fn same_origin(headers: &HeaderMap) -> bool {
    let host = headers.get(header::HOST).and_then(|h| h.to_str().ok());
    if let Some(origin) = headers.get(header::ORIGIN) {
        let authority = origin
            .to_str()
            .ok()
            .and_then(|o| o.split_once("://"))
            .map(|(_, a)| a);
        if authority.is_none() || authority != host {
            return false;
        }
    }
    match headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()) {
        None | Some("same-origin") | Some("none") => true,
        Some(_) => false,
    }
}

/// Constant-time equality of two tokens; an empty one never matches.
pub(super) fn tokens_match(expected: &str, given: &str) -> bool {
    !expected.is_empty()
        && expected.len() == given.len()
        && bool::from(expected.as_bytes().ct_eq(given.as_bytes()))
}

/// A posted form's fields, in order (a field may repeat).
pub(super) struct Form(Vec<(String, String)>);

impl Form {
    /// Reads an `application/x-www-form-urlencoded` body of at most
    /// [`MAX_FORM_BYTES`]; `None` when larger or unreadable.
    pub(super) async fn read(body: Body) -> Option<Self> {
        let bytes = axum::body::to_bytes(body, MAX_FORM_BYTES).await.ok()?;
        Some(Self(
            form_urlencoded::parse(&bytes)
                .map(|(k, v)| (k.into_owned(), v.into_owned()))
                .collect(),
        ))
    }

    /// The first value of field `name`.
    pub(super) fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// Every value of field `name`.
    pub(super) fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.0
            .iter()
            .filter(move |(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The sign-in form's double-submit token: a fresh one set as [`PRE_COOKIE`] and
/// put in the form.
fn pre_session(path: &str, secure: bool) -> (String, HeaderValue) {
    let token = tessera_tenancy::random_hex(32);
    let c = set_cookie(PRE_COOKIE, &token, path, PRE_SESSION_SECS, secure);
    (token, c)
}

/// Whether a sign-in post is genuine: same origin, and its form token equals a
/// pre-session cookie.
fn sign_in_allowed(headers: &HeaderMap, form: &Form) -> bool {
    let given = form.get("csrf").unwrap_or("");
    same_origin(headers)
        && cookies(headers, PRE_COOKIE)
            .iter()
            .any(|pre| tokens_match(pre, given))
}

/// UTC `YYYY-MM-DD HH:MM` of Unix ms.
pub(super) fn utc_minute(ms: i64) -> String {
    let s = tessera_tenancy::store::rfc3339(ms);
    s.get(..16).unwrap_or(&s).replacen('T', " ", 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, HeaderValue::from_str(v).unwrap());
        }
        h
    }

    #[test]
    fn cookies_are_found_by_exact_name_every_value_a_few_at_most() {
        let h = headers(&[
            ("cookie", "a=1; tessera_dash_pre=p; tessera_dash=planted"),
            ("cookie", "tessera_dash=s"),
        ]);
        assert_eq!(cookies(&h, TENANT_COOKIE), ["planted", "s"]);
        assert_eq!(cookies(&h, PRE_COOKIE), ["p"]);
        assert!(cookies(&h, "tessera").is_empty());
        let many = headers(&[("cookie", &"tessera_dash=x; ".repeat(100))]);
        assert_eq!(cookies(&many, TENANT_COOKIE).len(), MAX_COOKIE_VALUES);
    }

    #[test]
    fn only_same_origin_posts_pass() {
        let host = ("host", "gw.example:8080");
        assert!(same_origin(&headers(&[host])));
        assert!(same_origin(&headers(&[
            host,
            ("origin", "https://gw.example:8080"),
            ("sec-fetch-site", "same-origin"),
        ])));
        assert!(!same_origin(&headers(&[
            host,
            ("origin", "https://evil.example")
        ])));
        assert!(!same_origin(&headers(&[host, ("origin", "null")])));
        assert!(!same_origin(&headers(&[
            host,
            ("sec-fetch-site", "cross-site")
        ])));
        assert!(!same_origin(&headers(&[
            host,
            ("origin", "http://gw.example:8080"),
            ("sec-fetch-site", "same-site"),
        ])));
    }

    #[test]
    fn empty_or_different_tokens_never_match() {
        assert!(tokens_match("ab12", "ab12"));
        assert!(!tokens_match("", ""));
        assert!(!tokens_match("ab12", "ab13"));
        assert!(!tokens_match("ab12", "ab1"));
    }

    #[test]
    fn names_are_escaped_in_every_template() {
        let evil = "<img src=x onerror=alert(1)>\"'&";
        let html = templates()
            .get_template("message.html")
            .unwrap()
            .render(minijinja::context! { css => "/c", heading => evil, error => evil, back => "/dash/" })
            .unwrap();
        assert!(!html.contains("<img"), "{html}");
        assert!(
            html.contains("&lt;img src=x onerror=alert(1)&gt;"),
            "{html}"
        );
    }
}
