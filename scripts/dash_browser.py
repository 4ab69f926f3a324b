#!/usr/bin/env python3
"""Drives the gateway's browser dashboard (`/dash/`, `/dash/admin/`) with headless
Chromium against a live server and checks what a person would see.

Why a real browser: the dashboard is server-rendered HTML with no script at all,
so the things that matter are what the browser does with it: which cookies it
sends where (HttpOnly, SameSite=Strict, Path), whether a cross-origin form post
carries a session, whether a name with HTML in it renders as text, and whether
the numbers on the page are the numbers the usage API gives for the same range.

What it checks (each check prints one line, `ok: ...` or `FAIL: ...`):

- Without a session `/dash/` and `/dash/admin/` redirect to their login pages;
  every page has a Content-Security-Policy that allows no script and no
  `<script>` element.
- Sign-in through the form (typing the key, clicking the button): a bad key is a
  401 with `#error`, a key without `usage:read` a 403 with `#error` and no
  session cookie, a good key a 303 to `/dash/` with an HttpOnly, SameSite=Strict
  `tessera_dash` cookie on Path=/dash.
- For the windows hour, day and month, every number of the by-model and by-key
  tables equals the usage API (`.../ai/usage?since=S&until=U&group_by=...`, with
  the tenant's key) for the page's own `#range`; the series adds up to the same
  totals (and matches the API's hour/day buckets when its buckets are hours or
  days); the limits table shows the tenant's limits; the keys table lists exactly
  the tenant's keys (names as literal text, state, scopes).
- Screenshots at 1280x900 and 390x844 (login, tenant and operator pages) under
  --out.
- Attacks: another tenant's key revoked from this tenant's session (404, the key
  still works), another account named in the URL (still only this tenant's
  data), posts with no, a wrong, or a leaked csrf token from a foreign Origin
  (403), a forged form on another origin clicked in the browser (no key made), a
  session cookie replayed after its key was revoked (redirect to login), a tenant
  cookie against the operator view and the other way round, HTML in tenant and
  key names (escaped), a key created through the form with HTML in its name
  (shown once, escaped, working), path traversal in a runbook URL.
- The operator view: per-tenant numbers equal the admin usage API for the page's
  range; a runbook link opens the runbook.

The revocation-replay check revokes the key created through the form (used only
by a second browser session), so the main key (--key) stays valid throughout.

Exit status: 0 all passed, 1 some check failed, 2 Chromium, chromedriver or
Selenium missing (run scripts/test, which installs them).

    scripts/dash_browser.py --base http://127.0.0.1:PORT --admin-base URL \\
        --key KEY_A --account ACCOUNT_A --other-key KEY_B --other-account ACCOUNT_B \\
        --readonly-key KEY_A_INFERENCE_ONLY --admin-token TOKEN --out DIR
"""

import argparse
import json
import os
import re
import struct
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROME_ARGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-proxy-server",
    "--window-size=1280,900",
)
DESKTOP = (1280, 900)
PHONE = (390, 844)

WINDOWS = ("hour", "day", "month")
USAGE_COLS = ("requests", "errors", "input_tokens", "output_tokens", "cached_tokens")
SERIES_COLS = ("requests", "input_tokens", "output_tokens")
LIMIT_ROWS = (
    "requests_per_minute",
    "input_tokens_per_minute",
    "output_tokens_per_minute",
    "max_concurrent",
    "daily_tokens",
)
OPERATOR_COLS = ("requests", "input_tokens", "output_tokens")
# The name typed into the create-key form: it must come back as literal text.
FORM_KEY_NAME = "<img src=x onerror=alert(1)><b>k</b>"
KEY_RE = re.compile(r"^tsk_([0-9a-f]{16})_([0-9a-f]{64})$")
RUNBOOKS = Path(__file__).resolve().parent.parent / "ops" / "runbooks"


class Failure(Exception):
    """A check that cannot go on (its message is the FAIL line)."""


# ---------------------------------------------------------------- reporting


class Checks:
    """Counts and prints check results."""

    def __init__(self):
        self.passed = 0
        self.failed = 0

    def ok(self, what):
        self.passed += 1
        print(f"ok: {what}", flush=True)

    def fail(self, what):
        self.failed += 1
        print(f"FAIL: {what}", flush=True)

    def check(self, cond, what, why=""):
        if cond:
            self.ok(what)
        else:
            self.fail(f"{what}{': ' + why if why else ''}")
        return cond

    def warn(self, what):
        print(f"warn: {what}", flush=True)

    def group(self, name, fn, *a):
        """Runs one group of checks; an exception is one FAIL line and the next
        group still runs."""
        try:
            return fn(*a)
        except Failure as e:
            self.fail(f"{name}: {e}")
        except Exception as e:  # noqa: BLE001 - any error is a failed check
            # Selenium's messages carry a native stack trace: the first line says it.
            first = (str(e).strip().splitlines() or [""])[0]
            self.fail(f"{name}: {type(e).__name__}: {first}")
        return None


# ---------------------------------------------------------------- plain HTTP


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *_a, **_k):
        return None


# No proxies (the server is on loopback) and no redirects (they are checked).
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect)


class Resp:
    def __init__(self, status, headers, body):
        self.status = status
        self.headers = headers
        self.body = body

    @property
    def text(self):
        return self.body.decode("utf-8", "replace")

    def json(self):
        return json.loads(self.body)

    @property
    def location_path(self):
        return urllib.parse.urlsplit(self.headers.get("Location") or "").path


def http(method, url, headers=None, form=None):
    """One request, redirects not followed; returns a Resp for any status."""
    data = None if form is None else urllib.parse.urlencode(form, doseq=True).encode()
    req = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    if data is not None:
        req.add_header("Content-Type", "application/x-www-form-urlencoded")
    try:
        with _OPENER.open(req, timeout=60) as r:
            return Resp(r.status, r.headers, r.read())
    except urllib.error.HTTPError as e:
        return Resp(e.code, e.headers, e.read())


def origin_of(url):
    p = urllib.parse.urlsplit(url)
    return f"{p.scheme}://{p.netloc}"


def key_id(key):
    m = KEY_RE.match(key)
    if not m:
        raise Failure(f"not a tsk_<id>_<secret> key: {key[:12]}...")
    return m.group(1)


def usage_api(a, key, since, until, group_by):
    """The tenant usage API's groups for [since, until), by group key."""
    q = urllib.parse.urlencode({"since": since, "until": until, "group_by": group_by})
    url = f"{a.base}/client/v4/accounts/{a.account}/ai/usage?{q}"
    for _ in range(3):
        r = http("GET", url, {"Authorization": f"Bearer {key}"})
        if r.status != 429:
            break
        time.sleep(min(int(r.headers.get("Retry-After") or 5), 30))
    if r.status != 200:
        raise Failure(f"usage API group_by={group_by}: HTTP {r.status}: {r.text[:300]}")
    v = r.json()
    if not v.get("success"):
        raise Failure(f"usage API group_by={group_by}: {v}")
    return {g["key"]: g for g in v["result"]["groups"]}


def admin_api(a, method, path):
    """An admin API call with the admin token; its `result`."""
    r = http(method, a.admin_base + path, {"Authorization": f"Bearer {a.admin_token}"})
    if r.status != 200:
        raise Failure(f"admin API {method} {path}: HTTP {r.status}: {r.text[:300]}")
    return r.json()["result"]


# ---------------------------------------------------------------- the browser


def tools_missing():
    missing = [p for p in (CHROMIUM, CHROMEDRIVER) if not os.access(p, os.X_OK)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package (scripts/python-env installs it)")
    return missing


def new_driver():
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must never go online
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in CHROME_ARGS:
        opts.add_argument(arg)
    # Network events, to read the status of each page load.
    opts.set_capability("goog:loggingPrefs", {"performance": "ALL"})
    d = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)
    d.set_page_load_timeout(60)
    return d


def by_css(d, sel):
    from selenium.webdriver.common.by import By

    return d.find_elements(By.CSS_SELECTOR, sel)


def one(d, sel):
    found = by_css(d, sel)
    if not found:
        raise Failure(f"no `{sel}` on {d.current_url}")
    return found[0]


def path_of(d):
    return urllib.parse.urlsplit(d.current_url).path


def drain_log(d):
    d.get_log("performance")


# path -> the Origin and Sec-Fetch-Site headers of the last form post the browser
# sent there (read from the network log by statuses(), for the FAIL lines).
SENT = {}


def statuses(d, path):
    """HTTP statuses of the responses (redirects included) the browser got for
    URLs with this path since the last drain, in order."""
    out, posts = [], set()
    for entry in d.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        method, params = msg.get("method"), msg.get("params", {})
        resp = None
        if method == "Network.responseReceived":
            resp = params.get("response")
        elif method == "Network.requestWillBeSent":
            resp = params.get("redirectResponse")
            req = params.get("request", {})
            if req.get("method") == "POST" and urllib.parse.urlsplit(req.get("url", "")).path == path:
                posts.add(params.get("requestId"))
        elif method == "Network.requestWillBeSentExtraInfo" and params.get("requestId") in posts:
            h = {k.lower(): v for k, v in params.get("headers", {}).items()}
            SENT[path] = {k: h.get(k) for k in ("origin", "sec-fetch-site")}
        if resp and urllib.parse.urlsplit(resp.get("url", "")).path == path:
            out.append(int(resp["status"]))
    return out


def sent(path):
    """What the browser sent with its last post to `path`, for a FAIL line."""
    return f"; the browser's post carried {SENT[path]}" if path in SENT else ""


def load(d, url):
    """Navigates and drains the network log first, so statuses() sees this load."""
    drain_log(d)
    d.get(url)


def submit(d, button):
    """Clicks a submit button and waits for the next page."""
    from selenium.webdriver.support.ui import WebDriverWait

    drain_log(d)
    html = one(d, "html")
    button.click()

    def left(_):
        # The old document is gone once touching its root fails, whichever error
        # chromedriver gives for it (a stale element, or "node does not belong to
        # the document" while the navigation is under way).
        try:
            html.is_enabled()
            return False
        except Exception:
            return True

    WebDriverWait(d, 30).until(left)
    WebDriverWait(d, 30).until(
        lambda x: x.execute_script("return document.readyState") == "complete"
    )


def cookie(d, name):
    return next((c for c in d.get_cookies() if c["name"] == name), None)


def script_count(d):
    return d.execute_script("return document.querySelectorAll('script').length")


def text_of(d, sel):
    return d.execute_script(
        "const e = document.querySelector(arguments[0]);"
        "return e ? e.textContent.trim() : null;",
        sel,
    )


def rows(d, table, attr, cols):
    """{row id: {col: text}} of `table`'s body rows; duplicate ids are an error."""
    got = d.execute_script(
        """
        const out = [];
        for (const tr of document.querySelectorAll(arguments[0] + ' tbody tr[' + arguments[1] + ']')) {
            const cells = {};
            for (const td of tr.querySelectorAll('td[data-col]'))
                cells[td.getAttribute('data-col')] = td.textContent.trim();
            out.push([tr.getAttribute(arguments[1]), cells]);
        }
        return out;
        """,
        table,
        attr,
    )
    out = {}
    for rid, cells in got:
        if rid in out:
            raise Failure(f"{table}: two rows with {attr}={rid!r}")
        missing = [c for c in cols if c not in cells]
        if missing:
            raise Failure(f"{table} row {rid!r}: no cell data-col={missing}")
        out[rid] = cells
    return out


def as_int(table, rid, col, s):
    if not re.fullmatch(r"-?\d+", s):
        raise Failure(f"{table} row {rid!r} {col}: {s!r} is not a plain integer")
    return int(s)


def read_range(d):
    e = one(d, "#range")
    since, until = e.get_attribute("data-since"), e.get_attribute("data-until")
    if not (since and until and since.isdigit() and until.isdigit()):
        raise Failure(f"#range data-since={since!r} data-until={until!r} on {d.current_url}")
    since, until = int(since), int(until)
    if since >= until:
        raise Failure(f"#range is empty: {since} >= {until}")
    return since, until


def png_size(path):
    with open(path, "rb") as f:
        head = f.read(24)
    return struct.unpack(">II", head[16:24])


def screenshot(c, d, out, name, size, mobile):
    """A viewport screenshot of the current page at exactly `size` CSS pixels."""
    w, h = size
    d.execute_cdp_cmd(
        "Emulation.setDeviceMetricsOverride",
        {"width": w, "height": h, "deviceScaleFactor": 1, "mobile": mobile},
    )
    try:
        time.sleep(0.3)  # a frame at the new size
        overflow = d.execute_script("return document.documentElement.scrollWidth") - w
        path = os.path.join(out, name)
        d.save_screenshot(path)
    finally:
        d.execute_cdp_cmd("Emulation.clearDeviceMetricsOverride", {})
    c.check(png_size(path) == (w, h), f"screenshot {path} ({w}x{h})", f"size {png_size(path)}")
    if overflow > 0:
        c.warn(f"{name}: the page is {overflow}px wider than the {w}px viewport")


def no_scripts(c, d, what):
    n = script_count(d)
    c.check(n == 0, f"{what}: no <script> element", f"{n} found")


# ---------------------------------------------------------------- sessions


def sign_in(d, base, login_path, field, secret):
    """Opens the login page, types the secret, clicks sign-in; returns the
    statuses of the POST to the login path."""
    load(d, base + login_path)
    form = one(d, "form#login")
    if form.get_dom_attribute("action") != login_path or form.get_attribute("method") != "post":
        raise Failure(f"{login_path}: form#login is not method=post action={login_path}")
    one(d, "form#login input[type=hidden][name=csrf]")
    el = one(d, f"form#login input[type=password][name={field}]#{field}")
    el.clear()
    el.send_keys(secret)
    submit(d, one(d, "button#sign-in[type=submit]"))
    return statuses(d, login_path)


def check_session_cookie(c, d, name, path):
    k = cookie(d, name)
    if not c.check(k is not None, f"cookie {name} set"):
        return None
    c.check(
        k.get("httpOnly") and k.get("sameSite") == "Strict" and k.get("path") == path,
        f"cookie {name} is HttpOnly, SameSite=Strict, Path={path}",
        f"httpOnly={k.get('httpOnly')} sameSite={k.get('sameSite')} path={k.get('path')}",
    )
    return k["value"]


def csrf_of(d, form_sel="#create-key"):
    v = one(d, f"{form_sel} input[type=hidden][name=csrf]").get_attribute("value")
    if not v:
        raise Failure(f"{form_sel}: empty csrf value")
    return v


# ---------------------------------------------------------------- tenant checks


def csp_allows_no_script(r):
    """Whether the response's CSP has `script-src 'none'` (or no script-src and
    `default-src 'none'`)."""
    csp = (r.headers.get("Content-Security-Policy") or "").lower()
    directives = {p.split()[0]: p.split()[1:] for p in csp.split(";") if p.strip()}
    return directives.get("script-src", directives.get("default-src")) == ["'none'"]


def check_no_session(c, a):
    r = http("GET", a.base + "/dash/")
    c.check(
        r.status == 303 and r.location_path == "/dash/login",
        "GET /dash/ without a session: 303 to /dash/login",
        f"{r.status} Location={r.headers.get('Location')}",
    )
    r = http("GET", a.admin_base + "/dash/admin/")
    c.check(
        r.status == 303 and r.location_path == "/dash/admin/login",
        "GET /dash/admin/ without a session: 303 to /dash/admin/login",
        f"{r.status} Location={r.headers.get('Location')}",
    )
    r = http("GET", a.base + "/dash/login")
    c.check(
        r.status == 200 and csp_allows_no_script(r),
        "GET /dash/login: 200 with a Content-Security-Policy that allows no script",
        f"{r.status} CSP={r.headers.get('Content-Security-Policy')!r}",
    )
    c.check(
        "<script" not in r.text.lower(), "GET /dash/login: no <script> in the HTML source"
    )


def check_login_page(c, d, a):
    load(d, a.base + "/dash/login")
    c.check(statuses(d, "/dash/login")[-1:] == [200], "login page loads (200)")
    no_scripts(c, d, "login page")
    screenshot(c, d, a.out, "login-desktop.png", DESKTOP, False)
    screenshot(c, d, a.out, "login-phone.png", PHONE, True)


def check_refused_login(c, d, a, key, want, what):
    """A refused sign-in. The unknown key's 401 is also the control that the form
    itself passes the csrf and origin checks: without it a 403 proves nothing."""
    st = sign_in(d, a.base, "/dash/login", "key", key)
    err = text_of(d, "p#error")
    if want == 401:
        a.login_form_works = st[-1:] == [401]
    elif not getattr(a, "login_form_works", False):
        c.fail(f"sign-in with {what}: inconclusive: the unknown key was not refused as unknown "
               f"(401), so this {st} may be the form's csrf/origin refusal; #error={err!r}")
        return
    c.check(
        st[-1:] == [want] and err,
        f"sign-in with {what}: {want} with #error",
        f"statuses {st}, #error={err!r}{sent('/dash/login')}",
    )
    c.check(cookie(d, "tessera_dash") is None, f"sign-in with {what}: no tessera_dash cookie")
    no_scripts(c, d, f"sign-in refusal ({what})")


def signed_in(c, d, base, login, field, secret, home, name, path, who):
    """Signs in through `login` and checks the 303 to `home` and the session cookie
    `name` on `path`; returns the cookie's value (raises without one)."""
    st = sign_in(d, base, login, field, secret)
    c.check(
        st[:1] == [303] and path_of(d) == home,
        f"{who} sign-in: 303 to {home}",
        f"statuses {st}, now at {d.current_url}{sent(login)}",
    )
    value = check_session_cookie(c, d, name, path)
    if not value:
        raise Failure(f"no {who} session: its checks cannot run")
    return value


def check_sign_in(c, d, a):
    a.cookie = signed_in(c, d, a.base, "/dash/login", "key", a.key, "/dash/",
                         "tessera_dash", "/dash", "tenant")


def compare_groups(c, what, page, api, cols):
    """Page rows against API groups: the same ids and every number equal."""
    diffs = []
    for rid in sorted(set(page) | set(api)):
        if rid not in page:
            diffs.append(f"{rid!r} missing on the page")
            continue
        if rid not in api:
            diffs.append(f"{rid!r} on the page, not in the API")
            continue
        for col in cols:
            got = as_int(what, rid, col, page[rid][col])
            if got != api[rid][col]:
                diffs.append(f"{rid!r} {col}: page {got}, API {api[rid][col]}")
    total = sum(g["requests"] for g in api.values())
    c.check(
        not diffs,
        f"{what}: {len(page)} rows, {total} requests, every number equals the usage API",
        "; ".join(diffs),
    )


def bucket_secs(s):
    return int(datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp())


def check_series(c, d, a, window, since, until, by_model):
    one(d, "svg#chart")
    series = rows(d, "#series", "data-bucket", SERIES_COLS)
    sums = {
        col: sum(as_int("#series", b, col, cells[col]) for b, cells in series.items())
        for col in SERIES_COLS
    }
    want = {col: sum(g[col] for g in by_model.values()) for col in SERIES_COLS}
    c.check(
        sums == want,
        f"window={window} #series: {len(series)} buckets adding up to the range's totals",
        f"series {sums}, usage API {want}",
    )
    # The bucket size: the step between rows when the page lists consecutive
    # buckets (empty ones included); else whichever of hour and day matches.
    starts = sorted(bucket_secs(b) for b in series)
    step = min((y - x for x, y in zip(starts, starts[1:])), default=None)
    page = {
        bucket_secs(b): {col: int(cells[col]) for col in SERIES_COLS}
        for b, cells in series.items()
        if int(cells["requests"]) != 0
    }
    sizes = {3600: ["hour"], 86400: ["day"]}.get(step, ["hour", "day"])
    apis = {}
    for group in sizes:
        groups = usage_api(a, a.key, since, until, group)
        apis[group] = {bucket_secs(k): {col: g[col] for col in SERIES_COLS} for k, g in groups.items()}
        if page == apis[group]:
            c.ok(f"window={window} #series: every {group} bucket equals the usage API's group_by={group}")
            return
    if len(sizes) == 1:
        c.fail(f"window={window} #series: {sizes[0]} buckets differ from the usage API: page {page}, API {apis}")
    else:
        c.warn(f"window={window} #series: buckets are neither the API's hours nor days "
               f"(step {step}s): compared by totals only")


def check_window(c, d, a, window):
    load(d, f"{a.base}/dash/?window={window}")
    if path_of(d) != "/dash/":
        raise Failure(f"window={window}: at {d.current_url}, not /dash/")
    if 429 in statuses(d, "/dash/"):
        raise Failure(f"window={window}: 429: the tenant's usage-query rate limit (page views "
                      "and usage-API calls share it) ran out during this script")
    since, until = read_range(d)
    by_model = usage_api(a, a.key, since, until, "model")
    by_key = usage_api(a, a.key, since, until, "key")
    compare_groups(c, f"window={window} #by-model", rows(d, "#by-model", "data-model", USAGE_COLS), by_model, USAGE_COLS)
    compare_groups(c, f"window={window} #by-key", rows(d, "#by-key", "data-key", USAGE_COLS), by_key, USAGE_COLS)
    check_series(c, d, a, window, since, until, by_model)
    no_scripts(c, d, f"window={window}")
    return (since, until), sum(g["requests"] for g in by_model.values())


def check_windows(c, d, a):
    ranges = {}
    for w in WINDOWS:
        got = c.group(f"window={w}", check_window, c, d, a, w)
        if got:
            ranges[w] = got
    if len(ranges) == len(WINDOWS):
        spans = [r for r, _ in ranges.values()]
        c.check(
            len(set(spans)) == len(spans),
            "the hour, day and month windows cover different ranges",
            f"{ranges}",
        )
        c.check(
            ranges["day"][1] > 0,
            f"window=day shows usage ({ranges['day'][1]} requests: the comparison is not vacuous)",
        )
    load(d, f"{a.base}/dash/")
    since, until = read_range(d)
    if len(ranges) == len(WINDOWS):
        # Ranges move with the clock (and may start on whole hours), so the
        # default is the window whose span is nearest to its own.
        span = until - since
        nearest = min(ranges, key=lambda w: abs(ranges[w][0][1] - ranges[w][0][0] - span))
        c.check(nearest == "day", "/dash/ without ?window shows the day window",
                f"its span {span}s is nearest to window={nearest}")


def check_tenant_tables(c, d, a):
    load(d, f"{a.base}/dash/")
    t = admin_api(a, "GET", f"/admin/v1/tenants/{a.account}")
    c.check(
        text_of(d, "h1#tenant") == t["name"] and not by_css(d, "h1#tenant *"),
        f"h1#tenant shows the tenant name {t['name']!r} as literal text",
        f"got {text_of(d, 'h1#tenant')!r}",
    )
    limits = rows(d, "#limits", "data-limit", ("used", "limit"))
    want = {k: (str(v) if v else "unlimited") for k, v in t["limits"].items()}
    got = {k: cells["limit"] for k, cells in limits.items()}
    c.check(
        got == {k: want[k] for k in LIMIT_ROWS},
        "#limits: one row per limit, each showing the tenant's limit ('unlimited' for 0)",
        f"page {got}, admin API {want}",
    )
    for k, cells in limits.items():
        as_int("#limits", k, "used", cells["used"])
    check_keys_table(c, d, a, "#keys lists exactly the tenant's keys")
    one(d, "table#batches")
    batches = rows(d, "#batches", "data-batch", ("state",))
    c.ok(f"table#batches present ({len(batches)} rows)")
    one(d, "form#logout[method=post][action='/dash/logout'] input[type=hidden][name=csrf]")
    c.ok("form#logout with a csrf field")


def key_state(k, now_ms):
    if k.get("revoked_ms") is not None:
        return "revoked"
    if k.get("expires_ms") is not None and k["expires_ms"] <= now_ms:
        return "expired"
    return "active"


def check_keys_table(c, d, a, what):
    """#keys against the admin API's key list: ids, names (as text), scopes,
    state, and a revoke form on each active key only (not on the session's own)."""
    keys = {k["key_id"]: k for k in admin_api(a, "GET", f"/admin/v1/tenants/{a.account}/keys")}
    page = rows(d, "#keys", "data-key", ("name", "scopes", "created", "expires", "state"))
    now_ms = int(time.time() * 1000)
    diffs = []
    if set(page) != set(keys):
        diffs.append(f"ids: page {sorted(page)}, admin API {sorted(keys)}")
    for kid in set(page) & set(keys):
        k, cells = keys[kid], page[kid]
        if cells["name"] != k["name"]:
            diffs.append(f"{kid} name {cells['name']!r} != {k['name']!r}")
        if set(re.split(r"[\s,]+", cells["scopes"])) - {""} != set(k["scopes"]):
            diffs.append(f"{kid} scopes {cells['scopes']!r} != {k['scopes']}")
        state = key_state(k, now_ms)
        if cells["state"] != state:
            diffs.append(f"{kid} state {cells['state']!r} != {state}")
        forms = by_css(d, f"#keys tr[data-key='{kid}'] form.revoke")
        action = f"/dash/keys/{kid}/revoke"
        good = [
            f for f in forms
            if f.get_dom_attribute("action") == action and f.get_attribute("method") == "post"
            and by_css(d, f"#keys tr[data-key='{kid}'] form.revoke input[type=hidden][name=csrf]")
        ]
        own = kid == key_id(a.key)  # the session's own key: never revoked with one click
        if state == "active" and not own and len(good) != 1:
            diffs.append(f"{kid} is active but has no revoke form posting to {action}")
        if own and forms:
            diffs.append(f"{kid} is the session's own key but has a revoke form")
        if state != "active" and forms:
            diffs.append(f"{kid} is {state} but has a revoke form")
    n_img = len(by_css(d, "#keys img"))
    if n_img:
        diffs.append(f"{n_img} <img> inside #keys (a name was not escaped)")
    c.check(not diffs, f"{what} ({len(page)} keys)", "; ".join(diffs))
    no_scripts(c, d, "the keys table's page")
    return page


def check_screenshots_tenant(c, d, a):
    load(d, f"{a.base}/dash/")
    screenshot(c, d, a.out, "tenant-desktop.png", DESKTOP, False)
    screenshot(c, d, a.out, "tenant-phone.png", PHONE, True)


def session_headers(a, cookie_name="tessera_dash", value=None):
    return {"Cookie": f"{cookie_name}={value or a.cookie}", "Origin": origin_of(a.base)}


def check_other_tenant(c, d, a):
    """Another tenant's key and account named by URL from this tenant's session."""
    b = admin_api(a, "GET", f"/admin/v1/tenants/{a.other_account}")
    b_keys = {k["key_id"] for k in admin_api(a, "GET", f"/admin/v1/tenants/{a.other_account}/keys")}
    mine = admin_api(a, "GET", f"/admin/v1/tenants/{a.account}")["name"]
    for q in ("account", "account_id", "tenant"):
        load(d, f"{a.base}/dash/?{q}={a.other_account}")
        shown = set(rows(d, "#keys", "data-key", ())) | set(rows(d, "#by-key", "data-key", ()))
        body = text_of(d, "body") or ""
        c.check(
            text_of(d, "h1#tenant") == mine and not shown & b_keys and b["name"] not in body,
            f"/dash/?{q}=OTHER shows only this tenant's data",
            f"h1={text_of(d, 'h1#tenant')!r}, other's keys shown: {shown & b_keys}",
        )
    load(d, f"{a.base}/dash/")
    token = csrf_of(d)
    other = key_id(a.other_key)
    r = http("POST", f"{a.base}/dash/keys/{other}/revoke", session_headers(a), {"csrf": token})
    c.check(r.status == 404, "revoking the other tenant's key from this session: 404", f"HTTP {r.status}")
    r = http("POST", f"{a.base}/dash/keys/0123456789abcdef/revoke", session_headers(a), {"csrf": token})
    c.check(r.status == 404, "revoking an unknown key id: 404", f"HTTP {r.status}")
    still = [k for k in admin_api(a, "GET", f"/admin/v1/tenants/{a.other_account}/keys") if k["key_id"] == other]
    c.check(
        still and still[0].get("revoked_ms") is None,
        "the other tenant's key is still active (admin API)",
    )
    r = http("GET", f"{a.base}/client/v4/accounts/{a.other_account}/ai/usage",
             {"Authorization": f"Bearer {a.other_key}"})
    c.check(r.status == 200, "the other tenant's key still works (its usage API)", f"HTTP {r.status}")
    r = http("GET", f"{a.base}/dash/", {"Cookie": f"tessera_dash={a.cookie}"})
    c.check(
        r.status == 200 and csp_allows_no_script(r) and "<script" not in r.text.lower(),
        "/dash/ (signed in): 200, a CSP that allows no script, no <script> in the source",
        f"HTTP {r.status} CSP={r.headers.get('Content-Security-Policy')!r}",
    )
    c.check(
        b["name"] not in r.text and html_escape(b["name"]) not in r.text,
        "/dash/ never shows the other tenant's name",
    )


def html_escape(s):
    import html

    return html.escape(s, quote=True)


def check_csrf_http(c, d, a):
    """Session-authenticated posts with no, a wrong, or a right token from a
    foreign Origin: each a 403, and no key made."""
    load(d, f"{a.base}/dash/")
    token = csrf_of(d)
    form = {"name": "forged-http", "scope": ["inference", "usage:read"], "expires_days": "1"}
    cases = (
        ("no csrf field", session_headers(a), {}),
        ("a wrong csrf token", session_headers(a), {"csrf": "0" * len(token)}),
        ("the right token but a cross-site Origin",
         {"Cookie": f"tessera_dash={a.cookie}", "Origin": "https://attacker.example"},
         {"csrf": token}),
    )
    for what, headers, extra in cases:
        r = http("POST", f"{a.base}/dash/keys", headers, {**form, **extra})
        c.check(r.status == 403, f"POST /dash/keys with {what}: 403", f"HTTP {r.status}")


class Attacker:
    """A page on another origin (another port, or `localhost` for another site)
    with a plain form posting to the dashboard: no script needed."""

    def __init__(self, pages):
        self.pages = pages
        pages_ = pages

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                body = pages_.get(self.path)
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", "text/html; charset=utf-8")
                self.end_headers()
                self.wfile.write((body or "not found").encode())

            def log_message(self, *_):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def forged_form(a, name, csrf=None):
    field = f'<input type="hidden" name="csrf" value="{csrf}">' if csrf else ""
    return (
        "<!doctype html><title>win a prize</title>"
        f'<form method="post" action="{a.base}/dash/keys">'
        f'<input type="hidden" name="name" value="{name}">'
        '<input type="hidden" name="scope" value="inference">'
        '<input type="hidden" name="scope" value="usage:read">'
        '<input type="hidden" name="expires_days" value="1">'
        f'{field}<button type="submit" id="go">claim</button></form>'
    )


def check_forged_post(c, d, a):
    """A form on another origin, clicked in the signed-in browser, makes no key."""
    load(d, f"{a.base}/dash/")
    leaked = csrf_of(d)  # as if the token had leaked: the Origin check must still hold
    atk = Attacker({
        "/no-token.html": forged_form(a, "forged-no-token"),
        "/leaked-token.html": forged_form(a, "forged-leaked-token", leaked),
    })
    try:
        cases = (
            ("another origin, no token", f"http://127.0.0.1:{atk.port}/no-token.html", True),
            ("another origin, a leaked token", f"http://127.0.0.1:{atk.port}/leaked-token.html", True),
            ("another site, a leaked token", f"http://localhost:{atk.port}/leaked-token.html", False),
        )
        for what, url, same_site in cases:
            load(d, url)
            submit(d, one(d, "button#go"))
            st = statuses(d, "/dash/keys")
            created = by_css(d, "#new-key")
            if same_site:
                # 127.0.0.1 on another port is the same site: the Strict cookie
                # goes along, so only the token and Origin checks stop it.
                c.check(
                    st[:1] == [403] and not created,
                    f"forged form post from {what}: 403, no key shown",
                    f"statuses {st}, #new-key shown: {bool(created)}",
                )
            else:
                c.check(
                    not created and 200 not in st[:1],
                    f"forged form post from {what}: refused (statuses {st})",
                    f"statuses {st}, #new-key shown: {bool(created)}",
                )
    finally:
        atk.close()
    made = [k["name"] for k in admin_api(a, "GET", f"/admin/v1/tenants/{a.account}/keys")
            if k["name"].startswith("forged")]
    c.check(not made, "no forged key exists (admin API key list)", f"found {made}")
    load(d, f"{a.base}/dash/")
    names = [cells["name"] for cells in rows(d, "#keys", "data-key", ("name",)).values()]
    c.check(
        not [n for n in names if n.startswith("forged")],
        "no forged key in the dashboard's keys table",
    )


def check_revoke_own(c, d, a):
    """The positive control for the 404s: this tenant revokes its own
    (read-only) key through the page's revoke form."""
    rid = key_id(a.readonly_key)
    load(d, f"{a.base}/dash/")
    submit(d, one(d, f"#keys tr[data-key='{rid}'] form.revoke button, "
                     f"#keys tr[data-key='{rid}'] form.revoke input[type=submit]"))
    st = statuses(d, f"/dash/keys/{rid}/revoke")
    k = [k for k in admin_api(a, "GET", f"/admin/v1/tenants/{a.account}/keys") if k["key_id"] == rid]
    c.check(
        k and k[0].get("revoked_ms") is not None,
        f"revoking this tenant's own key through its form works (statuses {st})",
        f"admin API: {k}",
    )
    load(d, f"{a.base}/dash/")
    state = rows(d, "#keys", "data-key", ("state",)).get(rid, {}).get("state")
    c.check(state == "revoked", "the revoked key's row reads `revoked`", f"{state!r}")


def check_create_key(c, d, a):
    """A key made through the form: shown once, its HTML name escaped, working."""
    load(d, f"{a.base}/dash/")
    form = one(d, "form#create-key[method=post][action='/dash/keys']")
    one(d, "form#create-key input[type=hidden][name=csrf]")
    one(d, "form#create-key input[name=name]").send_keys(FORM_KEY_NAME)
    for scope in ("inference", "usage:read"):
        box = one(d, f"form#create-key input[type=checkbox][name=scope][value='{scope}']")
        if not box.is_selected():
            box.click()
    days = one(d, "form#create-key input[type=number][name=expires_days]")
    days.clear()
    days.send_keys("7")
    submit(d, form.find_element("css selector", "button#create[type=submit]"))
    st = statuses(d, "/dash/keys")
    new_key = text_of(d, "code#new-key") or ""
    c.check(
        st[-1:] == [200] and KEY_RE.match(new_key),
        "create-key form: 200 showing the new key in #new-key",
        f"statuses {st}, #new-key={new_key[:12]!r}{sent('/dash/keys')}",
    )
    back = by_css(d, "a#back")
    c.check(back and back[0].get_attribute("href").endswith("/dash/"), "a#back links to /dash/")
    no_scripts(c, d, "the new-key page")
    if not KEY_RE.match(new_key):
        raise Failure("no new key: the checks that use it cannot run")
    kid = key_id(new_key)
    info = [k for k in admin_api(a, "GET", f"/admin/v1/tenants/{a.account}/keys") if k["key_id"] == kid]
    want_exp = time.time() * 1000 + 7 * 86_400_000
    c.check(
        info and info[0]["name"] == FORM_KEY_NAME
        and set(info[0]["scopes"]) == {"inference", "usage:read"}
        and info[0]["expires_ms"] and abs(info[0]["expires_ms"] - want_exp) < 86_400_000,
        "the new key is stored with the typed name, both scopes and a 7-day expiry",
        f"admin API: {info}",
    )
    load(d, f"{a.base}/dash/")
    page = check_keys_table(c, d, a, "#keys after the create, the HTML name as literal text")
    c.check(
        page.get(kid, {}).get("name") == FORM_KEY_NAME and not by_css(d, "#keys img, #keys b"),
        "the new key's name renders as text, no <img> or <b> inside #keys",
        f"{page.get(kid)}",
    )
    c.check(
        not by_css(d, "#new-key") and KEY_RE.match(new_key).group(2) not in d.page_source,
        "the new key is shown once (not on /dash/ afterwards)",
    )
    r = http("GET", f"{a.base}/client/v4/accounts/{a.account}/ai/usage",
             {"Authorization": f"Bearer {new_key}"})
    c.check(r.status == 200, "the new key works against the usage API", f"HTTP {r.status}: {r.text[:200]}")
    a.form_key = new_key


def check_revoked_replay(c, a):
    """A second browser session on the form-made key; the key revoked through
    the admin API; its cookie replayed."""
    key = getattr(a, "form_key", None)
    if not key:
        raise Failure("no key from the create-key form (see above)")
    d2 = new_driver()
    try:
        st = sign_in(d2, a.base, "/dash/login", "key", key)
        c.check(path_of(d2) == "/dash/", "second session signed in with the new key", f"statuses {st}")
        k2 = cookie(d2, "tessera_dash")
        if not k2:
            raise Failure("second session has no tessera_dash cookie")
        value = k2["value"]
        c.check(value != a.cookie, "the second session has its own cookie")
        # The form-made key has the default scopes (no keys:write): no create form,
        # so the session's token is read from its sign-out form.
        token = csrf_of(d2, "#logout")
        r = http("GET", f"{a.base}/dash/", {"Cookie": f"tessera_dash={value}"})
        c.check(r.status == 200, "its cookie opens /dash/ before the revocation", f"HTTP {r.status}")
        admin_api(a, "POST", f"/admin/v1/keys/{key_id(key)}/revoke")
        r = http("GET", f"{a.base}/dash/", {"Cookie": f"tessera_dash={value}"})
        c.check(
            r.status == 303 and r.location_path == "/dash/login",
            "the cookie replayed after its key was revoked: 303 to /dash/login",
            f"HTTP {r.status} Location={r.headers.get('Location')}",
        )
        r = http("POST", f"{a.base}/dash/keys", session_headers(a, value=value),
                 {"csrf": token, "name": "forged-after-revoke", "scope": "usage:read"})
        c.check(r.status in (303, 401, 403), "a post with the revoked session is refused", f"HTTP {r.status}")
        load(d2, f"{a.base}/dash/")
        c.check(path_of(d2) == "/dash/login", "the revoked session's browser lands on /dash/login",
                f"at {d2.current_url}")
    finally:
        d2.quit()
    r = http("GET", f"{a.base}/dash/", {"Cookie": f"tessera_dash={a.cookie}"})
    c.check(r.status == 200, "the main session is unaffected by the other key's revocation", f"HTTP {r.status}")


# ---------------------------------------------------------------- operator checks


def check_cookie_confusion(c, d, a):
    load(d, f"{a.admin_base}/dash/admin/")
    c.check(
        path_of(d) == "/dash/admin/login",
        "the tenant's session (browser) does not open /dash/admin/",
        f"at {d.current_url}",
    )
    for name in ("tessera_dash", "tessera_dash_admin"):
        r = http("GET", f"{a.admin_base}/dash/admin/", {"Cookie": f"{name}={a.cookie}"})
        c.check(
            r.status == 303 and r.location_path == "/dash/admin/login",
            f"the tenant's cookie value sent as {name}: /dash/admin/ is a 303 to its login",
            f"HTTP {r.status}",
        )


def check_operator(c, d, a):
    st = sign_in(d, a.admin_base, "/dash/admin/login", "token", "wrong-" + a.admin_token)
    c.check(
        st[-1:] == [401] and text_of(d, "p#error"),
        "operator sign-in with a wrong token: 401 with #error",
        f"statuses {st}{sent('/dash/admin/login')}",
    )
    c.check(cookie(d, "tessera_dash_admin") is None, "no tessera_dash_admin cookie after the refusal")
    a.admin_cookie = signed_in(c, d, a.admin_base, "/dash/admin/login", "token",
                               a.admin_token, "/dash/admin/", "tessera_dash_admin",
                               "/dash/admin", "operator")
    no_scripts(c, d, "operator page")
    since, until = read_range(d)
    page = rows(d, "#tenants", "data-tenant", ("name", "status") + OPERATOR_COLS)
    tenants = {t["id"]: t for t in admin_api(a, "GET", "/admin/v1/tenants")}
    diffs = []
    if set(page) != set(tenants):
        diffs.append(f"ids: page {sorted(page)}, admin API {sorted(tenants)}")
    for tid in set(page) & set(tenants):
        q = urllib.parse.urlencode({"since": since, "until": until})
        totals = admin_api(a, "GET", f"/admin/v1/tenants/{tid}/usage?{q}")["totals"]
        cells = page[tid]
        if cells["name"] != tenants[tid]["name"]:
            diffs.append(f"{tid} name {cells['name']!r} != {tenants[tid]['name']!r}")
        if cells["status"] != tenants[tid]["status"]:
            diffs.append(f"{tid} status {cells['status']!r} != {tenants[tid]['status']!r}")
        for col in OPERATOR_COLS + (("errors",) if "errors" in cells else ()):
            if as_int("#tenants", tid, col, cells[col]) != totals[col]:
                diffs.append(f"{tid} {col}: page {cells[col]}, admin API {totals[col]}")
    c.check(
        not diffs and a.account in page,
        f"#tenants: {len(page)} tenants, names as text, numbers equal the admin usage API for {since}..{until}",
        "; ".join(diffs),
    )
    c.check(not by_css(d, "#tenants b, #tenants i, #tenants img"), "no markup from tenant names inside #tenants")
    for t in ("#nodes", "#integrity", "#audit"):
        c.check(bool(by_css(d, f"table{t}")), f"table{t} present")
    screenshot(c, d, a.out, "operator-desktop.png", DESKTOP, False)
    screenshot(c, d, a.out, "operator-phone.png", PHONE, True)
    check_runbooks(c, d, a)


def runbook_title(name):
    f = RUNBOOKS / f"{name}.md"
    if not f.is_file():
        return None
    first = f.read_text().splitlines()[0].lstrip("#").strip()
    return first, re.sub(r"[`*_]", "", first)


def check_runbooks(c, d, a):
    in_rows = by_css(d, "#integrity tbody tr a.runbook")
    c.check(bool(in_rows), f"#integrity rows link their runbooks ({len(in_rows)} links)")
    # Every runbook link on the page (the tables' notes link some too) must load.
    hrefs = sorted({e.get_attribute("href") for e in by_css(d, "a.runbook")})
    bad = [h for h in hrefs
           if not re.fullmatch(r"/dash/admin/runbooks/[A-Za-z0-9_.-]+", urllib.parse.urlsplit(h).path)]
    c.check(not bad, f"runbook links point under /dash/admin/runbooks/ ({len(hrefs)})", f"{bad}")
    if not hrefs:
        return
    for h in hrefs:
        r = http("GET", h, {"Cookie": f"tessera_dash_admin={a.admin_cookie}"})
        c.check(r.status == 200, f"runbook {urllib.parse.urlsplit(h).path}: 200", f"HTTP {r.status}")
    load(d, hrefs[0])
    name = urllib.parse.urlsplit(hrefs[0]).path.rsplit("/", 1)[-1]
    body = " ".join((text_of(d, "body") or "").split())
    title = runbook_title(name)
    shows = any(t in body for t in title) if title else len(body) > 200
    c.check(
        statuses(d, urllib.parse.urlsplit(hrefs[0]).path)[-1:] == [200] and shows,
        f"runbook page {name} shows the runbook's text"
        + (f" ({title[1]!r})" if title else " (no local file to compare: length only)"),
        f"body starts {body[:200]!r}",
    )
    no_scripts(c, d, f"runbook {name}")
    for probe in ("..%2F..%2FCargo.toml", "%2e%2e%2f%2e%2e%2fCargo.toml", "..%5C..%5CCargo.toml"):
        r = http("GET", f"{a.admin_base}/dash/admin/runbooks/{probe}",
                 {"Cookie": f"tessera_dash_admin={a.admin_cookie}"})
        c.check(
            not (r.status == 200 and "[workspace" in r.text),
            f"runbook path traversal {probe}: no file outside the runbooks (HTTP {r.status})",
        )
    r = http("GET", f"{a.base}/dash/", {"Cookie": f"tessera_dash={a.admin_cookie}"})
    c.check(
        r.status == 303 and r.location_path == "/dash/login",
        "the operator's cookie value sent as tessera_dash does not open /dash/",
        f"HTTP {r.status}",
    )


def check_logout(c, d, a):
    r = http("POST", f"{a.base}/dash/logout", session_headers(a), {})
    c.check(r.status == 403, "POST /dash/logout with no csrf field: 403", f"HTTP {r.status}")
    r = http("GET", f"{a.base}/dash/", {"Cookie": f"tessera_dash={a.cookie}"})
    if not c.check(r.status == 200, "the session survived the refused logout", f"HTTP {r.status}"):
        return
    load(d, f"{a.base}/dash/")
    submit(d, one(d, "form#logout button, form#logout input[type=submit]"))
    c.check(path_of(d) == "/dash/login", "logout lands on /dash/login", f"at {d.current_url}")
    load(d, f"{a.base}/dash/")
    c.check(path_of(d) == "/dash/login", "after logout /dash/ redirects to the login", f"at {d.current_url}")
    r = http("GET", f"{a.base}/dash/", {"Cookie": f"tessera_dash={a.cookie}"})
    if r.status == 200:
        c.warn("the logged-out session cookie still opens /dash/ when replayed (not ended server-side)")
    else:
        c.ok(f"the logged-out session cookie replayed: HTTP {r.status}")


# ---------------------------------------------------------------- main


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", required=True, help="gateway base URL, http://127.0.0.1:PORT")
    p.add_argument("--admin-base", help="admin listener base URL (default: --base)")
    p.add_argument("--key", required=True, help="tenant A's key (inference + usage:read)")
    p.add_argument("--account", required=True, help="tenant A's account id")
    p.add_argument("--other-key", required=True, help="tenant B's key (usage:read)")
    p.add_argument("--other-account", required=True, help="tenant B's account id")
    p.add_argument("--readonly-key", required=True, help="a tenant A key with only the inference scope (revoked by this script)")
    p.add_argument("--admin-token", required=True)
    p.add_argument("--out", required=True, help="directory for the screenshots")
    a = p.parse_args()
    for url in (a.base, a.admin_base):
        if url and not re.match(r"^https?://", url):
            p.error(f"not an http(s) URL: {url!r}")
    a.base = a.base.rstrip("/")
    a.admin_base = (a.admin_base or a.base).rstrip("/")
    return a


def main():
    a = parse_args()
    missing = tools_missing()
    if missing:
        print(
            f"dash_browser: missing {', '.join(missing)}: run scripts/test (it installs them), "
            "or apt-get install chromium chromium-driver and run scripts/python-env",
            file=sys.stderr,
        )
        return 2
    os.makedirs(a.out, exist_ok=True)
    c = Checks()
    c.group("no session", check_no_session, c, a)
    d = new_driver()
    try:
        print(f"browser: {d.capabilities.get('browserVersion')}, screenshots in {a.out}", flush=True)
        c.group("login page", check_login_page, c, d, a)
        c.group("bad key", check_refused_login, c, d, a, "tsk_" + "0" * 16 + "_" + "0" * 64, 401, "an unknown key")
        c.group("read-only key", check_refused_login, c, d, a, a.readonly_key, 403, "a key without usage:read")
        a.cookie = None
        c.group("sign in", check_sign_in, c, d, a)
        if a.cookie:
            c.group("windows", check_windows, c, d, a)
            c.group("tables", check_tenant_tables, c, d, a)
            c.group("tenant screenshots", check_screenshots_tenant, c, d, a)
            c.group("another tenant", check_other_tenant, c, d, a)
            c.group("csrf", check_csrf_http, c, d, a)
            c.group("forged form post", check_forged_post, c, d, a)
            c.group("revoke own key", check_revoke_own, c, d, a)
            c.group("create key", check_create_key, c, d, a)
            # Last among the tenant checks: it revokes the key the form made.
            c.group("revoked session replay", check_revoked_replay, c, a)
            c.group("cookie confusion", check_cookie_confusion, c, d, a)
        c.group("operator", check_operator, c, d, a)
        if a.cookie:
            c.group("logout", check_logout, c, d, a)
    finally:
        d.quit()
    print(f"{c.passed} passed, {c.failed} failed", flush=True)
    return 1 if c.failed else 0


if __name__ == "__main__":
    sys.exit(main())
