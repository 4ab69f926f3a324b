#!/usr/bin/env python3
"""Times the dashboard's pages for a tenant with a month of usage (issue 40's
target: under 100 ms a page at 10,000 requests a day).

It starts `tessera serve` on a fresh data directory (first start: one tenant, one
key), stops it, writes a generated ledger into its SQLite store (--per-day rows a
day over the last 30 days, 3 models, 4 keys, 2% errors), rebuilds the hourly
rollup from it with the statement migration 0007 backfills with (read from its file), starts the
server again, signs in through the form and loads each page --reps times over
one kept-alive connection. Reported: median, p95 and max wall time a page, from
request to the last byte, and beside them, as the baseline, the time SQLite takes
for the month's by-model sum straight from the ledger (what the pages read before
the rollup), measured on the same file in the same run.

    scripts/bench_dash.py [--bin target/release/tessera] [--per-day 10000] [--reps 30]
"""

import argparse
import http.client
import os
import random
import re
import signal
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse

MODELS = ["@cf/huggingfacetb/smollm2-135m-instruct", "@cf/qwen/qwen2.5-coder-0.5b-instruct",
          "@cf/google/gemma-3-270m-it"]


def rollup_sql(root):
    """The statement migration 0007 fills `usage_hourly` from the ledger with."""
    sql = open(os.path.join(root, "tenancy/migrations/0007_dashboard.sql")).read()
    start = sql.index("INSERT INTO usage_hourly")
    return "DELETE FROM usage_hourly;\n" + sql[start:sql.index(";", start) + 1]


def ready(port):
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
        c.request("GET", "/readyz")
        return c.getresponse().status == 200
    except OSError:
        return False


def start(binary, data, port):
    """Starts `tessera serve`; returns the process and its output once ready (the
    output goes to a file, so a chatty log never blocks it)."""
    log = open(os.path.join(data, "serve.log"), "a+")
    # --usage-rpm 0: page loads share the usage API's per-tenant rate, which would
    # otherwise stop the repetitions at 60 a minute.
    p = subprocess.Popen([binary, "serve", "--data-dir", data, "--listen", f"127.0.0.1:{port}",
                          "--usage-rpm", "0"], stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + 120
    while time.time() < deadline and p.poll() is None:
        if ready(port):
            log.seek(0)
            return p, log.read()
        time.sleep(0.2)
    p.kill()
    log.seek(0)
    sys.exit("the server did not become ready:\n" + log.read())


def stop(p):
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()


def seed(db, account, key_id, per_day, rollup):
    now = int(time.time() * 1000)
    rng = random.Random(7)
    keys = [key_id] + [f"{i:016x}" for i in range(1, 4)]
    rows = []
    n = per_day * 30
    for i in range(n):
        at = now - rng.randrange(30 * 86_400_000)
        status = 500 if rng.random() < 0.02 else 200
        rows.append((f"bench-{i}", account, rng.choice(keys), rng.choice(MODELS), "ai/run", status,
                     3040 if status >= 400 else 0, "error" if status >= 400 else "stop",
                     rng.randrange(20, 2000), rng.randrange(0, 512), rng.randrange(0, 256), 0, 0,
                     rng.randrange(1000, 90000), rng.randrange(10000, 900000), at))
    con = sqlite3.connect(db)
    con.executemany(
        "INSERT INTO usage_ledger (request_id, tenant_id, key_id, model, endpoint, status, "
        "error_code, finish, input_tokens, output_tokens, cached_tokens, cached_host_tokens, "
        "cached_disk_tokens, ttft_us, duration_us, created_ms) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows)
    con.executescript(rollup)
    con.commit()
    since = now - 30 * 86_400_000
    ledger_ms = []
    for _ in range(5):
        t = time.perf_counter()
        con.execute(
            "SELECT model, COUNT(*), SUM(input_tokens), SUM(output_tokens) FROM usage_ledger "
            "WHERE tenant_id = ? AND created_ms >= ? AND created_ms < ? GROUP BY model",
            (account, since, now + 1)).fetchall()
        ledger_ms.append((time.perf_counter() - t) * 1000)
    con.close()
    return n, statistics.median(ledger_ms)


class Session:
    def __init__(self, port):
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        self.cookies = {}

    def request(self, method, path, body=None):
        headers = {"Cookie": "; ".join(f"{k}={v}" for k, v in self.cookies.items())}
        if body is not None:
            headers["Content-Type"] = "application/x-www-form-urlencoded"
            headers["Origin"] = f"http://127.0.0.1:{self.conn.port}"
        self.conn.request(method, path, body=body, headers=headers)
        r = self.conn.getresponse()
        data = r.read()
        for v in r.headers.get_all("Set-Cookie") or []:
            k, _, rest = v.partition("=")
            val = rest.split(";", 1)[0]
            if "Max-Age=0" in v:
                self.cookies.pop(k, None)
            else:
                self.cookies[k] = val
        return r.status, data.decode()

    def sign_in(self, path, field, secret):
        st, html = self.request("GET", path)
        csrf = re.search(r'name="csrf" value="([0-9a-f]{64})"', html).group(1)
        st, _ = self.request("POST", path, urllib.parse.urlencode({"csrf": csrf, field: secret}))
        assert st == 303, st


def timed(session, path, reps):
    ms = []
    for _ in range(reps):
        t = time.perf_counter()
        st, html = session.request("GET", path)
        ms.append((time.perf_counter() - t) * 1000)
        assert st == 200, (path, st, html[:300])
    ms.sort()
    return statistics.median(ms), ms[max(0, int(len(ms) * 0.95) - 1)], ms[-1], html


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ap.add_argument("--bin", default=os.path.join(root, "target/release/tessera"))
    ap.add_argument("--per-day", type=int, default=10_000)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--port", type=int, default=18931)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as data:
        p, out = start(a.bin, data, a.port)
        stop(p)
        key = re.search(r"(tsk_[0-9a-f]+_[0-9a-f]+)", out).group(1)
        account = re.search(r"/accounts/([0-9a-f]{32})/", out).group(1)
        admin = open(os.path.join(data, "admin-token")).read().strip()
        n, ledger_ms = seed(os.path.join(data, "tessera.db"), account, key.split("_")[1], a.per_day,
                            rollup_sql(root))
        p, _ = start(a.bin, data, a.port)
        try:
            tenant = Session(a.port)
            tenant.sign_in("/dash/login", "key", key)
            op = Session(a.port)
            op.sign_in("/dash/admin/login", "token", admin)
            print(f"ledger: {n} rows over 30 days ({a.per_day}/day); {a.reps} loads a page")
            print(f"{'page':<28}{'median ms':>10}{'p95 ms':>10}{'max ms':>10}")
            for name, s, path in [("tenant, last hour", tenant, "/dash/?window=hour"),
                                  ("tenant, last 24 hours", tenant, "/dash/?window=day"),
                                  ("tenant, last 30 days", tenant, "/dash/?window=month"),
                                  ("operator view", op, "/dash/admin/")]:
                med, p95, mx, html = timed(s, path, a.reps)
                print(f"{name:<28}{med:>10.1f}{p95:>10.1f}{mx:>10.1f}")
            m = re.search(r'id="total-requests">(\d+)<', html) or re.search(
                r'id="total-requests">(\d+)<', tenant.request("GET", "/dash/?window=month")[1])
            print(f"(30-day page shows {m.group(1)} requests)")
            print(f"baseline: the month's by-model sum from the ledger alone: {ledger_ms:.1f} ms "
                  "(SQLite, same file)")
        finally:
            stop(p)


if __name__ == "__main__":
    main()
