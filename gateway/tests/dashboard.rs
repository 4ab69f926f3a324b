//! The browser dashboard over real HTTP, as a browser without JavaScript sees it
//! (cookies kept by hand, no redirects followed): the numbers each window shows
//! equal the usage API's for the range the page states (real requests with the
//! real model, plus older ledger rows), and every attack ends in the right answer
//! with nothing changed: no or forged cookies, a forged or cross-site form post, a
//! sign-in without the form's token, another tenant's key by URL, a key with fewer
//! scopes creating or revoking more, a session replayed after its key was revoked
//! or its tenant suspended, HTML in tenant and key names, an oversized form, the
//! operator view with a tenant's session or a wrong token, and the operator view
//! off the public port when an admin listener is configured.
//! (`dashboard_browser.rs` drives the same pages in headless Chromium.)

mod common;

use common::*;
use reqwest::header::{HeaderMap, LOCATION, SET_COOKIE};
use reqwest::Method;
use serde_json::{json, Value};
use std::collections::HashMap;
use tessera_gateway::GatewayOptions;
use tessera_tenancy::{now_ms, Limits, NewKey, Scopes};

/// A cookie-keeping HTTP client that does not follow redirects.
struct Browser {
    http: reqwest::Client,
    base: String,
    cookies: HashMap<String, String>,
}

struct Page {
    status: u16,
    headers: HeaderMap,
    html: String,
}

impl Page {
    fn location(&self) -> &str {
        self.headers
            .get(LOCATION)
            .map_or("", |v| v.to_str().unwrap())
    }
}

impl Browser {
    fn new(base: &str) -> Self {
        Self {
            http: reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .build()
                .unwrap(),
            base: base.into(),
            cookies: HashMap::new(),
        }
    }

    fn cookie_header(&self) -> String {
        self.cookies
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("; ")
    }

    async fn send(&mut self, r: reqwest::RequestBuilder) -> Page {
        let r = if self.cookies.is_empty() {
            r
        } else {
            r.header("cookie", self.cookie_header())
        };
        let resp = r.send().await.unwrap();
        let status = resp.status().as_u16();
        let headers = resp.headers().clone();
        for c in headers.get_all(SET_COOKIE) {
            let c = c.to_str().unwrap();
            let (pair, attrs) = c.split_once(';').unwrap_or((c, ""));
            let (k, v) = pair.split_once('=').unwrap();
            assert!(
                attrs.contains("HttpOnly") && attrs.contains("SameSite=Strict"),
                "{c}"
            );
            if attrs.contains("Max-Age=0") {
                self.cookies.remove(k);
            } else {
                self.cookies.insert(k.into(), v.into());
            }
        }
        let html = resp.text().await.unwrap();
        Page {
            status,
            headers,
            html,
        }
    }

    async fn get(&mut self, path: &str) -> Page {
        let r = self.http.get(format!("{}{path}", self.base));
        self.send(r).await
    }

    /// A form post as the browser sends it from the dashboard's own page.
    async fn post(&mut self, path: &str, fields: &[(&str, &str)]) -> Page {
        let origin = self.base.clone();
        self.post_from(path, fields, Some(&origin)).await
    }

    async fn post_from(
        &mut self,
        path: &str,
        fields: &[(&str, &str)],
        origin: Option<&str>,
    ) -> Page {
        let mut r = self.http.post(format!("{}{path}", self.base)).form(fields);
        if let Some(o) = origin {
            r = r.header("origin", o);
        }
        self.send(r).await
    }

    /// A tenant session signed in with `key` (asserted), and its form token.
    async fn tenant_session(base: &str, key: &str) -> (Self, String) {
        let mut b = Self::new(base);
        let p = b.sign_in("/dash/login", "key", key).await;
        assert_eq!(p.status, 303, "{}", p.html);
        let csrf = csrf_of(&b.get("/dash/").await.html);
        (b, csrf)
    }

    /// Posts the create-key form with `csrf` and `fields` besides it.
    async fn create_key(&mut self, csrf: &str, fields: &[(&str, &str)]) -> Page {
        let mut all = vec![("csrf", csrf)];
        all.extend_from_slice(fields);
        self.post("/dash/keys", &all).await
    }

    /// Posts the revoke form of key `key_id` with `csrf`.
    async fn revoke(&mut self, csrf: &str, key_id: &str) -> Page {
        self.post(&format!("/dash/keys/{key_id}/revoke"), &[("csrf", csrf)])
            .await
    }

    /// Signs in through `login_path`'s form with `field` = `secret`.
    async fn sign_in(&mut self, login_path: &str, field: &str, secret: &str) -> Page {
        let form = self.get(login_path).await;
        assert_eq!(form.status, 200, "{}", form.html);
        let csrf = csrf_of(&form.html);
        self.post(login_path, &[("csrf", &csrf), (field, secret)])
            .await
    }
}

/// The first form token of a page.
fn csrf_of(html: &str) -> String {
    let at = html.find("name=\"csrf\" value=\"").expect("a form token") + 19;
    html[at..at + 64].to_string()
}

/// Text as minijinja's HTML escaping writes it.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#x27;")
        .replace('/', "&#x2f;")
}

/// The integer in cell `col` of the row `<tr data-{attr}="{value}">` of `html`, or
/// `None` when there is no such row.
fn cell(html: &str, attr: &str, value: &str, col: &str) -> Option<i64> {
    let row_at = html.find(&format!("<tr data-{attr}=\"{}\"", esc(value)))?;
    let row = &html[row_at..html[row_at..].find("</tr>").unwrap() + row_at];
    let at = row.find(&format!("data-col=\"{col}\">")).unwrap() + col.len() + 12;
    Some(row[at..row[at..].find('<').unwrap() + at].parse().unwrap())
}

/// The `<table id="{id}">` element of `html`.
fn table<'h>(html: &'h str, id: &str) -> &'h str {
    let at = html.find(&format!("<table id=\"{id}\">")).expect(id);
    &html[at..html[at..].find("</table>").unwrap() + at]
}

fn attr_i64(html: &str, name: &str) -> i64 {
    let at = html.find(&format!("{name}=\"")).unwrap() + name.len() + 2;
    html[at..html[at..].find('"').unwrap() + at]
        .parse()
        .unwrap()
}

async fn usage_api(
    s: &TestServer,
    account: &str,
    key: &str,
    since: i64,
    until: i64,
    by: &str,
) -> Value {
    let url = format!(
        "{}/client/v4/accounts/{account}/ai/usage?since={since}&until={until}&group_by={by}",
        s.base
    );
    let (st, _, v) = s.get(&url, Some(key)).await;
    assert_eq!(st, 200, "{v}");
    v["result"].clone()
}

const COLS: [&str; 5] = [
    "requests",
    "errors",
    "input_tokens",
    "output_tokens",
    "cached_tokens",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_window_shows_the_usage_apis_numbers() {
    let s = start().await;
    let name = "Acme <b>&amp;</b> \"Co\"";
    let (t, key) = s.tenant_with_key(name, Limits::UNLIMITED).await;
    let (_, key2) = s
        .store()
        .create_key(&t.id, "second <i>key</i>")
        .await
        .unwrap();
    for (k, p) in [
        (&key, "Say hi."),
        (&key, "Name a color."),
        (&key2, "Count to three."),
    ] {
        let (st, _, v) = s
            .post(
                &s.run_url(&t.id),
                Some(k),
                &json!({"prompt": p, "max_tokens": 4}),
            )
            .await;
        assert_eq!(st, 200, "{v}");
    }
    let kid = key_id_of(&key);
    let h = 3_600_000;
    for (ago, status, i, o) in [
        (3 * h, 200, 40, 7),
        (5 * h + 17, 500, 9, 0),
        (2 * 24 * h, 200, 100, 20),
        (10 * 24 * h + 5, 200, 300, 50),
        (40 * 24 * h, 200, 999, 999),
    ] {
        assert!(s
            .store()
            .record_usage(&past_usage(&t.id, &kid, MODEL, ago, status, (i, o, 3)))
            .await
            .unwrap());
    }
    s.settle().await;

    let mut b = Browser::new(&s.base);
    let signed = b.sign_in("/dash/login", "key", &key).await;
    assert_eq!((signed.status, signed.location()), (303, "/dash/"));
    assert!(b.cookies.contains_key("tessera_dash"));
    assert!(
        !b.cookies.contains_key("tessera_dash_pre"),
        "the sign-in token is spent"
    );
    let mut requests = Vec::new();
    for window in ["hour", "day", "month"] {
        let p = b.get(&format!("/dash/?window={window}")).await;
        assert_eq!(p.status, 200, "{}", p.html);
        assert_eq!(
            p.headers["content-security-policy"].to_str().unwrap(),
            "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; \
             frame-ancestors 'none'; base-uri 'none'"
        );
        assert_eq!(p.headers["cache-control"], "no-store");
        assert!(!p.html.contains("<script"), "no page carries a script");
        assert!(
            !p.html.contains("<b>&amp;</b>"),
            "the tenant name is escaped"
        );
        assert!(p
            .html
            .contains(&format!("<h1 id=\"tenant\">{}</h1>", esc(name))));
        assert!(p.html.contains("<svg id=\"chart\""));
        let since = attr_i64(&p.html, "data-since");
        let until = attr_i64(&p.html, "data-until");
        for (by, attr) in [("model", "model"), ("key", "key")] {
            let table = table(&p.html, &format!("by-{by}"));
            let api = usage_api(&s, &t.id, &key, since, until, by).await;
            let groups = api["groups"].as_array().unwrap();
            assert!(!groups.is_empty(), "{window}: {api}");
            for g in groups {
                let k = g["key"].as_str().unwrap();
                for col in COLS {
                    assert_eq!(
                        cell(table, attr, k, col),
                        g[col].as_i64(),
                        "{window} {by} {k} {col}"
                    );
                }
            }
            // Nothing on the page the API does not have.
            let rows = table.matches(&format!("<tr data-{attr}=")).count();
            assert_eq!(rows, groups.len(), "{window} {by}");
        }
        let api = usage_api(&s, &t.id, &key, since, until, "model").await;
        requests.push(api["totals"]["requests"].as_i64().unwrap());
        // Both keys' names are escaped in the keys table.
        assert!(p.html.contains(&esc("second <i>key</i>")));
        assert!(!p.html.contains("<i>key</i>"));
    }
    // The windows differ by the older rows: 3 real requests in the last hour, 2
    // more in the day (one an error), 2 more in 30 days; the 40-day-old row in none.
    assert_eq!(requests, vec![3, 5, 7]);
    let p = b.get("/dash/?window=decade").await;
    assert_eq!(p.status, 400);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_attacks_end_in_the_right_answer_with_nothing_changed() {
    let s = start().await;
    let store = s.store();
    let scoped = |names: &[&str], name: &str| NewKey {
        name: name.into(),
        scopes: Scopes::from_names(names.iter().copied()).unwrap(),
        expires_ms: None,
    };
    // A's owner key holds every scope, keys:write included.
    let a = store.create_tenant("a", Limits::UNLIMITED).await.unwrap();
    let (_, key_a) = store
        .create_key_with(
            &a.id,
            &NewKey {
                scopes: Scopes::ALL,
                ..NewKey::named("owner")
            },
        )
        .await
        .unwrap();
    let (b_tenant, key_b) = s.tenant_with_key("b", Limits::UNLIMITED).await;
    let (_, inference_only) = store
        .create_key_with(&a.id, &scoped(&["inference"], "inf"))
        .await
        .unwrap();
    // May manage keys, but only within usage:read.
    let (_, read_only) = store
        .create_key_with(&a.id, &scoped(&["usage:read", "keys:write"], "ro"))
        .await
        .unwrap();
    // The default scopes (an app's key): no key management at all.
    let (_, app_key) = store
        .create_key_with(&a.id, &scoped(&["inference", "usage:read"], "app"))
        .await
        .unwrap();
    let keys_of = |t: String| async move { store.list_keys(Some(&t)).await.unwrap() };

    // No session, a malformed one, an unknown one: the sign-in page.
    let mut anon = Browser::new(&s.base);
    for cookie in [
        None,
        Some("x"),
        Some("'; DROP TABLE dash_sessions; --"),
        Some(&"ab".repeat(32)[..]),
    ] {
        if let Some(c) = cookie {
            anon.cookies.insert("tessera_dash".into(), c.into());
        }
        let p = anon.get("/dash/").await;
        // A cookie that opens nothing: the sign-in page says the session ended.
        let to = if cookie.is_some() {
            "/dash/login?ended"
        } else {
            "/dash/login"
        };
        assert_eq!((p.status, p.location()), (303, to), "{cookie:?}");
    }
    // A sign-in without the form's token (a login CSRF), a bad key, a key without
    // usage:read: no session.
    let mut b = Browser::new(&s.base);
    let p = b.post("/dash/login", &[("key", &key_a)]).await;
    assert_eq!(p.status, 403);
    assert!(p.html.contains("id=\"error\""));
    let unknown = format!("tsk_0123456789abcdef_{}", "ab".repeat(32));
    for (key, status) in [
        ("tsk_0000000000000000_00", 401),
        ("", 401),
        (&unknown[..], 401),
        (&inference_only[..], 403),
    ] {
        let mut b = Browser::new(&s.base);
        let p = b.sign_in("/dash/login", "key", key).await;
        assert_eq!(p.status, status, "{key}: {}", p.html);
        assert!(p.html.contains("id=\"error\""));
        assert!(!b.cookies.contains_key("tessera_dash"));
    }
    // Each refused sign-in is counted like the API's refusals.
    let metrics = s.metrics_text().await;
    for (reason, at_least) in [("invalid_key", 1), ("malformed_key", 1), ("scope", 1)] {
        let line = format!("tessera_refused_total{{reason=\"{reason}\"}} ");
        let n: u64 = metrics
            .lines()
            .find_map(|l| l.strip_prefix(&line))
            .unwrap_or_else(|| panic!("no {line} in the metrics"))
            .trim()
            .parse()
            .unwrap();
        assert!(n >= at_least, "{reason}: {n}");
    }
    // An oversized form.
    let mut b = Browser::new(&s.base);
    let big = "k".repeat(64 * 1024);
    let p = b.post("/dash/login", &[("key", &big)]).await;
    assert_eq!(p.status, 413);

    // Signed in as A: forged posts change nothing.
    let (mut a_browser, csrf) = Browser::tenant_session(&s.base, &key_a).await;
    let before = keys_of(a.id.clone()).await.len();
    type Fields<'a> = &'a [(&'a str, &'a str)];
    let forged: [(Fields, Option<&str>); 4] = [
        (&[("name", "forged"), ("scope", "inference")], Some(&s.base)),
        (
            &[
                ("csrf", &"0".repeat(64)),
                ("name", "forged"),
                ("scope", "inference"),
            ],
            Some(&s.base),
        ),
        (
            &[("csrf", &csrf), ("name", "forged"), ("scope", "inference")],
            Some("http://evil.example"),
        ),
        (
            &[("csrf", &csrf), ("name", "forged"), ("scope", "inference")],
            Some("null"),
        ),
    ];
    for (fields, origin) in forged {
        let p = a_browser.post_from("/dash/keys", fields, origin).await;
        assert_eq!(p.status, 403, "{origin:?}");
    }
    let cross_site = a_browser
        .send(
            a_browser
                .http
                .post(format!("{}/dash/keys", s.base))
                .header("sec-fetch-site", "cross-site")
                .form(&[
                    ("csrf", &csrf[..]),
                    ("name", "forged"),
                    ("scope", "inference"),
                ]),
        )
        .await;
    assert_eq!(cross_site.status, 403);
    assert_eq!(keys_of(a.id.clone()).await.len(), before, "no forged key");

    // Another tenant's key by URL: the same 404 as an unknown one; it stays active.
    let b_key_id = key_id_of(&key_b);
    for id in [&b_key_id[..], "0000000000000000", "..%2f..%2fadmin"] {
        let p = a_browser
            .post(&format!("/dash/keys/{id}/revoke"), &[("csrf", &csrf)])
            .await;
        assert_eq!(p.status, 404, "{id}");
    }
    assert!(keys_of(b_tenant.id.clone())
        .await
        .iter()
        .all(|k| k.revoked_ms.is_none()));
    // Query parameters cannot name another account.
    let p = a_browser
        .get(&format!(
            "/dash/?account={}&tenant={}",
            b_tenant.id, b_tenant.id
        ))
        .await;
    assert!(p.html.contains(&a.id) && !p.html.contains(&b_tenant.id));

    // A key created on the page: shown once, its HTML name escaped, and it works.
    let evil = "<img src=x onerror=alert(1)><b>k</b>";
    let fields = [
        ("name", evil),
        ("scope", "usage:read"),
        ("expires_days", "2"),
    ];
    let p = a_browser.create_key(&csrf, &fields).await;
    assert_eq!(p.status, 200, "{}", p.html);
    let at = p.html.find("<code id=\"new-key\">").unwrap() + 19;
    let new_key = p.html[at..p.html[at..].find('<').unwrap() + at].to_string();
    assert!(new_key.starts_with("tsk_"));
    assert!(!p.html.contains("<img"));
    let overview = a_browser.get("/dash/").await;
    assert!(!overview.html.contains("<img") && overview.html.contains(&esc(evil)));
    assert!(!overview.html.contains(&new_key), "the key is shown once");
    let usage = format!("{}/client/v4/accounts/{}/ai/usage", s.base, a.id);
    let (st, _, _) = s.get(&usage, Some(&new_key)).await;
    assert_eq!(st, 200);
    for (field, bad) in [("expires_days", "0"), ("expires_days", "x"), ("name", "")] {
        let mut f = vec![("csrf", &csrf[..]), ("name", "n"), ("scope", "inference")];
        f.retain(|(k, _)| *k != field);
        f.push((field, bad));
        assert_eq!(
            a_browser.post("/dash/keys", &f).await.status,
            400,
            "{field}={bad}"
        );
    }
    let p = a_browser
        .create_key(&csrf, &[("name", "n"), ("scope", "admin")])
        .await;
    assert_eq!(p.status, 400);

    // A usage:read-only session can neither mint nor revoke a key that can do more.
    let (mut ro, ro_csrf) = Browser::tenant_session(&s.base, &read_only).await;
    let p = ro
        .create_key(&ro_csrf, &[("name", "up"), ("scope", "inference")])
        .await;
    assert_eq!(p.status, 403);
    let p = ro.revoke(&ro_csrf, &key_id_of(&key_a)).await;
    assert_eq!(p.status, 403);
    assert!(keys_of(a.id.clone()).await.iter().all(|k| k.name != "up"));
    // A key made by a key that expires expires no later, asked for or not.
    let soon = now_ms() + 86_400_000;
    let (_, short) = store
        .create_key_with(
            &a.id,
            &NewKey {
                expires_ms: Some(soon),
                ..scoped(&["usage:read", "keys:write"], "short")
            },
        )
        .await
        .unwrap();
    let (mut sb, sb_csrf) = Browser::tenant_session(&s.base, &short).await;
    for (name, days) in [("child-none", ""), ("child-long", "30")] {
        let fields = [
            ("name", name),
            ("scope", "usage:read"),
            ("expires_days", days),
        ];
        let p = sb.create_key(&sb_csrf, &fields).await;
        assert_eq!(p.status, 200, "{}", p.html);
        assert!(p.html.contains("id=\"expiry-capped\""), "{}", p.html);
        let made = keys_of(a.id.clone())
            .await
            .into_iter()
            .find(|k| k.name == name)
            .unwrap();
        assert!(made.expires_ms.is_some_and(|e| e <= soon), "{made:?}");
    }
    // The key a session signed in with is not revoked with one click from it.
    let p = sb.revoke(&sb_csrf, &key_id_of(&short)).await;
    assert_eq!(p.status, 409);
    assert_eq!(sb.get("/dash/").await.status, 200);
    // A reload of a form's address lands on the dashboard, not on an error.
    for path in ["/dash/keys", "/dash/logout"] {
        let p = sb.get(path).await;
        assert_eq!((p.status, p.location()), (303, "/dash/"), "{path}");
    }
    // A key with the default scopes manages no keys: no form, and posts are refused.
    let mut app = Browser::new(&s.base);
    assert_eq!(
        app.sign_in("/dash/login", "key", &app_key).await.status,
        303
    );
    let app_page = app.get("/dash/").await;
    assert!(
        !app_page.html.contains("id=\"create-key\"") && !app_page.html.contains("class=\"revoke\"")
    );
    assert!(app_page.html.contains("id=\"no-key-management\""));
    let app_csrf = csrf_of(&app_page.html);
    let p = app
        .create_key(&app_csrf, &[("name", "x"), ("scope", "usage:read")])
        .await;
    assert_eq!(p.status, 403);
    let p = app.revoke(&app_csrf, &key_id_of(&inference_only)).await;
    assert_eq!(p.status, 403);
    assert!(keys_of(a.id.clone())
        .await
        .iter()
        .all(|k| k.revoked_ms.is_none() && k.name != "x"));
    // A cookie planted under the same name (by a sibling host or another port)
    // does not hide the real session.
    let real = app.cookies["tessera_dash"].clone();
    let planted = app
        .send(app.http.get(format!("{}/dash/", s.base)).header(
            "cookie",
            format!("tessera_dash={}; tessera_dash={real}", "ab".repeat(32)),
        ))
        .await;
    assert_eq!(planted.status, 200);

    // A's session token does not work in the read-only session.
    let p = ro
        .create_key(&csrf, &[("name", "ro2"), ("scope", "usage:read")])
        .await;
    assert_eq!(p.status, 403);

    // The tenant's session does not open the operator view.
    let p = a_browser.get("/dash/admin/").await;
    assert_eq!((p.status, p.location()), (303, "/dash/admin/login"));

    // A session replayed after its key was revoked (through the admin API): ended.
    let mut second = Browser::new(&s.base);
    assert_eq!(
        second.sign_in("/dash/login", "key", &new_key).await.status,
        303
    );
    assert_eq!(second.get("/dash/").await.status, 200);
    let resp = s
        .admin(
            Method::POST,
            &format!("/admin/v1/keys/{}/revoke", key_id_of(&new_key)),
        )
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    for _ in 0..2 {
        let p = second.get("/dash/").await;
        assert_eq!((p.status, p.location()), (303, "/dash/login?ended"));
    }
    let notice = second.get("/dash/login?ended").await;
    assert!(notice.status == 200 && notice.html.contains("id=\"notice\""));
    // Revoking the read-only key from A's page ends its session too.
    let p = a_browser.revoke(&csrf, &key_id_of(&read_only)).await;
    assert_eq!((p.status, p.location()), (303, "/dash/"));
    assert_eq!(ro.get("/dash/").await.status, 303);
    let audit = store.audit_rows(0, now_ms() + 1, 1000).await.unwrap();
    assert!(audit
        .iter()
        .any(|r| r.action == "key.revoke" && r.source.starts_with(&format!("dash:{}:", a.id))));

    // Sign-out ends the session: the old cookie does not come back.
    let stolen = a_browser.cookies["tessera_dash"].clone();
    let p = a_browser.post("/dash/logout", &[("csrf", &csrf)]).await;
    assert_eq!((p.status, p.location()), (303, "/dash/login"));
    assert!(!a_browser.cookies.contains_key("tessera_dash"));
    a_browser.cookies.insert("tessera_dash".into(), stolen);
    assert_eq!(a_browser.get("/dash/").await.status, 303);

    // A suspended tenant's session ends.
    let mut again = Browser::new(&s.base);
    assert_eq!(
        again.sign_in("/dash/login", "key", &key_a).await.status,
        303
    );
    let resp = s
        .admin(Method::POST, &format!("/admin/v1/tenants/{}/suspend", a.id))
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(again.get("/dash/").await.status, 303);
    let mut later = Browser::new(&s.base);
    assert_eq!(
        later.sign_in("/dash/login", "key", &key_a).await.status,
        403
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_operator_view_shows_the_admin_apis_numbers() {
    let s = start().await;
    let (a, key_a) = s.tenant_with_key("ops <a>", Limits::UNLIMITED).await;
    let (st, _, v) = s
        .post(
            &s.run_url(&a.id),
            Some(&key_a),
            &json!({"prompt": "Hi", "max_tokens": 3}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    s.settle().await;
    let admin_base = s.admin_base.clone().unwrap_or(s.base.clone());

    let mut op = Browser::new(&admin_base);
    let p = op.get("/dash/admin/").await;
    assert_eq!((p.status, p.location()), (303, "/dash/admin/login"));
    for wrong in ["", "nope", &key_a[..]] {
        let mut b = Browser::new(&admin_base);
        assert_eq!(
            b.sign_in("/dash/admin/login", "token", wrong).await.status,
            401
        );
        assert!(!b.cookies.contains_key("tessera_dash_admin"));
    }
    let p = op.sign_in("/dash/admin/login", "token", ADMIN).await;
    assert_eq!((p.status, p.location()), (303, "/dash/admin/"));
    let p = op.get("/dash/admin/").await;
    assert_eq!(p.status, 200, "{}", p.html);
    assert!(!p.html.contains("<script") && !p.html.contains("ops <a>"));
    let since = attr_i64(&p.html, "data-since");
    let until = attr_i64(&p.html, "data-until");
    for t in s.store().list_tenants().await.unwrap() {
        let (st, _, v) = s
            .admin_get(&format!(
                "/admin/v1/tenants/{}/usage?since={since}&until={until}",
                t.id
            ))
            .await;
        assert_eq!(st, 200, "{v}");
        let totals = &v["result"]["totals"];
        for col in ["requests", "errors", "input_tokens", "output_tokens"] {
            assert_eq!(
                cell(&p.html, "tenant", &t.id, col),
                totals[col].as_i64(),
                "{} {col}",
                t.id
            );
        }
    }
    assert_eq!(cell(&p.html, "tenant", &a.id, "requests"), Some(1));
    for table in ["nodes", "integrity", "audit"] {
        assert!(
            p.html.contains(&format!("<table id=\"{table}\">")),
            "{table}"
        );
    }
    assert_eq!(
        cell(&p.html, "event", "tessera_kv_tag_mismatches", "count"),
        Some(0)
    );
    // An integrity failure shows up among the recent events, with when and how many.
    assert!(p.html.contains("<table id=\"integrity-events\">"));
    s.state.metrics.serve_error("integrity");
    let mut listed = false;
    for _ in 0..60 {
        let page = op.get("/dash/admin/").await;
        let events = table(&page.html, "integrity-events");
        if events.contains("<tr data-event=\"tessera_serve_errors\"") {
            assert!(events.contains(">+1<"), "{events}");
            listed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    }
    assert!(listed, "no recent integrity event after 30 s");
    let runbook = op
        .get("/dash/admin/runbooks/suspected-cross-tenant-leak")
        .await;
    assert_eq!(runbook.status, 200);
    assert!(runbook.html.contains("id=\"runbook\""));
    for bad in ["nope", "..%2F..%2FCargo.toml", "kv-pool-sizing.md"] {
        assert_eq!(
            op.get(&format!("/dash/admin/runbooks/{bad}")).await.status,
            404,
            "{bad}"
        );
    }
    // A session signed in with another (an old, rotated) admin token is refused.
    let old_id = tessera_tenancy::DashSession::operator_id("an-old-admin-token-0123456789abcdef");
    let (old_cookie, _) = s
        .store()
        .create_dash_session("", &old_id, 60_000)
        .await
        .unwrap();
    let mut rotated = Browser::new(&admin_base);
    rotated
        .cookies
        .insert("tessera_dash_admin".into(), old_cookie);
    assert_eq!(rotated.get("/dash/admin/").await.status, 303);
    // The operator's session is not a tenant's.
    let mut mixed = Browser::new(&s.base);
    mixed.cookies.insert(
        "tessera_dash".into(),
        op.cookies["tessera_dash_admin"].clone(),
    );
    assert_eq!(mixed.get("/dash/").await.status, 303);
    // Sign-out needs the session's token.
    let csrf = csrf_of(&p.html);
    assert_eq!(
        op.post("/dash/admin/logout", &[("csrf", "x")]).await.status,
        403
    );
    let out = op.post("/dash/admin/logout", &[("csrf", &csrf)]).await;
    assert_eq!((out.status, out.location()), (303, "/dash/admin/login"));
    assert_eq!(op.get("/dash/admin/").await.status, 303);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_admin_listener_the_operator_view_is_only_there() {
    let s = start_with(GatewayOptions {
        admin_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..GatewayOptions::default()
    })
    .await;
    let admin_base = s.admin_base.clone().expect("an admin listener");
    let mut public = Browser::new(&s.base);
    assert_eq!(public.get("/dash/admin/login").await.status, 404);
    assert_eq!(public.get("/dash/login").await.status, 200);
    let mut op = Browser::new(&admin_base);
    assert_eq!(op.get("/dash/login").await.status, 404);
    assert_eq!(
        op.sign_in("/dash/admin/login", "token", ADMIN).await.status,
        303
    );
    assert_eq!(op.get("/dash/admin/").await.status, 200);
    let css = op.get("/dash/admin/static/dash.css").await;
    assert_eq!(css.status, 200);
    assert!(css.headers["content-type"]
        .to_str()
        .unwrap()
        .starts_with("text/css"));
}
