#!/usr/bin/env python3
"""Aggregate decode throughput of an OpenAI-compatible server at N concurrent streams.

Used to put `tessera serve` beside llama.cpp's `llama-server` (same GGUF, same
client, same prompts, greedy) in one run; see docs/benchmarks.md.

Usage: bench_servers.py BASE_URL API_KEY MODEL [--concurrency 16] [--requests 32]
                        [--max-tokens 128] [--label NAME] [--raw] [--pid PID]
Prints one JSON line: output tokens/s (sum of completion tokens over wall time),
TTFT p50/p99 and TPOT p50 from streamed chunks.

--raw     send the same prompts as raw text to /v1/completions (`prompt`, no chat
          template: for base models without one) instead of /v1/chat/completions.
--pid PID the server's process id: its peak resident memory (VmHWM in
          /proc/PID/status, the high-water mark since it started, warm-up and
          loading included) is reported as `peak_rss_mb`, with `rss_mb` (VmRSS)
          at the end of the run.
Standard library only.
"""
import argparse
import json
import statistics
import threading
import time
import urllib.request

PROMPTS = [
    "Write a long story about a lighthouse keeper who counts ships.",
    "Explain in detail how bread is made, step by step.",
    "Describe a walk through a forest in autumn, with many details.",
    "Tell me about the history of bicycles, from the first designs to today.",
    "Write a letter to a friend describing your week, in a cheerful tone.",
    "Explain how a refrigerator works to a curious child.",
    "Describe the life cycle of a butterfly in detail.",
    "Write a travel guide for a small imaginary island.",
]


def stream(base, key, path, body):
    """POSTs the streaming `body` to `path`; returns the arrival time of each chunk
    with text (chat: `delta.content`, completions: `text`), the final usage and the
    text."""
    req = urllib.request.Request(base.rstrip("/") + path, data=json.dumps(body).encode(), headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    times, usage, text = [], None, ""
    with urllib.request.urlopen(req, timeout=600) as r:
        for chunk in r:
            line = chunk.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("usage"):
                usage = ev["usage"]
            for c in ev.get("choices") or []:
                piece = c.get("text") or (c.get("delta") or {}).get("content")
                if piece:
                    times.append(time.perf_counter())
                    text += piece
    return times, usage, text


def one(base, key, model, prompt, max_tokens, raw=False):
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if raw:
        body["prompt"] = prompt
        path = "/v1/completions"
    else:
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    t0 = time.perf_counter()
    times, usage, _ = stream(base, key, path, body)
    n = (usage or {}).get("completion_tokens", len(times))
    ttft = (times[0] - t0) if times else None
    tpot = ((times[-1] - times[0]) / (len(times) - 1)) if len(times) > 1 else None
    return n, ttft, tpot


def proc_status_kb(pid, field):
    """A `kB` field of /proc/PID/status (VmHWM, VmRSS), or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def ms(x, digits=1):
    return None if x is None else round(1000 * x, digits)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("base")
    p.add_argument("key")
    p.add_argument("model")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--label", default="server")
    p.add_argument("--raw", action="store_true",
                   help="raw prompts through /v1/completions (base models)")
    p.add_argument("--pid", type=int, help="server process id: report its peak RSS")
    a = p.parse_args()
    one(a.base, a.key, a.model, "Hi", 4, a.raw)  # warm-up
    results, errors, lock, idx = [], [], threading.Lock(), [0]

    def worker():
        while True:
            with lock:
                i = idx[0]
                idx[0] += 1
            if i >= a.requests:
                return
            try:
                r = one(a.base, a.key, a.model, PROMPTS[i % len(PROMPTS)], a.max_tokens, a.raw)
            except Exception as e:  # counted and reported, not fatal to the run
                with lock:
                    errors.append(repr(e))
                continue
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    toks = sum(r[0] for r in results)
    ttfts = sorted(r[1] for r in results if r[1] is not None)
    tpots = sorted(r[2] for r in results if r[2] is not None)
    out = {
        "system": a.label, "metric": "server_output_tok_s",
        "api": "completions" if a.raw else "chat", "concurrency": a.concurrency,
        "requests": a.requests, "max_tokens": a.max_tokens, "completion_tokens": toks,
        "value": round(toks / wall, 1),
        "ttft_p50_ms": ms(statistics.median(ttfts)) if ttfts else None,
        "ttft_p99_ms": ms(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]) if ttfts else None,
        "tpot_p50_ms": ms(statistics.median(tpots), 2) if tpots else None,
        "wall_s": round(wall, 2), "errors": len(errors),
    }
    if errors:
        out["first_error"] = errors[0][:300]
    if a.pid:
        hwm, rss = proc_status_kb(a.pid, "VmHWM"), proc_status_kb(a.pid, "VmRSS")
        out["pid"] = a.pid
        out["peak_rss_mb"] = None if hwm is None else round(hwm / 1024, 1)
        out["rss_mb"] = None if rss is None else round(rss / 1024, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
