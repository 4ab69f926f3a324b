#!/usr/bin/env python3
"""Many models behind one gateway: memory and throughput (issue 18).

Starts `tessera serve` (embedded: every model with its own prefill and decode
engines) with the first 1, 2 and 3 of the models given, and reports

- the gateway process's resident memory (VmRSS from /proc/PID/status, KiB) after
  start and after load, for 1, 2 and 3 models;
- with every model loaded, each model's output tokens per second alone (its
  clients only) and together (every model's clients at once), in the same run.

Requests are Workers AI `run` calls (greedy, `max_tokens` output tokens, a raw
counting prompt so answers run to the limit); throughput is the sum of the answers'
`usage.completion_tokens` over the phase's wall time. Standard library only.

Usage: scripts/bench_models.py [--bin target/release/tessera] [--seconds 20]
           [--clients 2] [--max-tokens 48] ID=PATH ID=PATH ID=PATH
Prints one JSON object per measurement, then a Markdown table.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class Server:
    def __init__(self, binary, models, data):
        args = [binary, "serve", "--listen", "127.0.0.1:0", "--data-dir", data,
                "--kv-pool-tokens", "8192", "--prefill-kv-pool-tokens", "8192"]
        for m in models:
            args += ["--model", m]
        env = dict(os.environ, TESSERA_DEFAULT_RPM="0", TESSERA_DEFAULT_INPUT_TPM="0",
                   TESSERA_DEFAULT_OUTPUT_TPM="0", TESSERA_DEFAULT_MAX_CONCURRENT="0",
                   TESSERA_DEFAULT_DAILY_TOKENS="0")
        env.pop("TESSERA_MODEL", None)
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=env)
        self.base = self.account = self.key = None
        deadline = time.time() + 180
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("tessera: listening on "):
                self.base = line.split()[-1]
            elif line.startswith("account id:"):
                self.account = line.split()[-1]
            elif line.startswith("API key:"):
                self.key = line.split()[-1]
            elif line.startswith("-d "):
                break
            if time.time() > deadline:
                break
        if not (self.base and self.account and self.key):
            self.stop()
            sys.exit("tessera serve did not start")
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()

    def run(self, model, max_tokens):
        body = json.dumps({"prompt": ", ".join(str(i) for i in range(1, 30)) + ",",
                           "raw": True, "max_tokens": max_tokens}).encode()
        req = urllib.request.Request(
            f"{self.base}/client/v4/accounts/{self.account}/ai/run/{model}", data=body,
            headers={"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            v = json.load(r)
        return v["result"]["usage"]["completion_tokens"]

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def phase(server, models, clients, seconds, max_tokens):
    """Runs `clients` closed-loop clients per model for `seconds`; tokens/s per model."""
    tokens = {m: 0 for m in models}
    lock = threading.Lock()
    stop = time.time() + seconds

    def client(m):
        while time.time() < stop:
            n = server.run(m, max_tokens)
            with lock:
                tokens[m] += n

    start = time.time()
    threads = [threading.Thread(target=client, args=(m,)) for m in models for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.time() - start
    return {m: tokens[m] / wall for m in models}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default="target/release/tessera")
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("models", nargs="+", help="ID=PATH")
    a = ap.parse_args()
    ids = [m.split("=", 1)[0] for m in a.models]
    rows = []
    for n in range(1, len(a.models) + 1):
        with tempfile.TemporaryDirectory() as data:
            s = Server(a.bin, a.models[:n], data)
            try:
                idle = rss_kib(s.proc.pid)
                for m in ids[:n]:
                    s.run(m, 4)  # warm up
                alone, together = {}, {}
                if n == len(a.models):
                    for m in ids:
                        alone.update(phase(s, [m], a.clients, a.seconds, a.max_tokens))
                    together = phase(s, ids, a.clients, a.seconds, a.max_tokens)
                loaded = rss_kib(s.proc.pid)
                row = {"models": n, "rss_kib_start": idle, "rss_kib_after_load": loaded,
                       "alone_tokens_per_s": alone, "together_tokens_per_s": together}
                print(json.dumps(row), flush=True)
                rows.append(row)
            finally:
                s.stop()
    print("\n| models loaded | gateway RSS after start (MiB) | after load (MiB) |")
    print("|---|---|---|")
    for r in rows:
        print(f"| {r['models']} | {r['rss_kib_start'] / 1024:.0f} | {r['rss_kib_after_load'] / 1024:.0f} |")
    last = rows[-1]
    print(f"\n| model | alone (tokens/s) | together (tokens/s) |")
    print("|---|---|---|")
    for m in ids:
        print(f"| `{m}` | {last['alone_tokens_per_s'][m]:.1f} | {last['together_tokens_per_s'][m]:.1f} |")
    print(f"| sum | | {sum(last['together_tokens_per_s'].values()):.1f} |")


if __name__ == "__main__":
    main()
