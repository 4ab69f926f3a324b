#!/usr/bin/env python3
"""Aggregate decode throughput of an OpenAI-compatible server at N concurrent streams.

Used to put `tessera serve` beside llama.cpp's `llama-server` (same GGUF, same
client, same prompts, greedy) in one run; see docs/benchmarks.md.

Usage: bench_servers.py BASE_URL API_KEY MODEL [--concurrency 16] [--requests 32]
                        [--max-tokens 128] [--label NAME]
Prints one JSON line: output tokens/s (sum of completion tokens over wall time),
TTFT p50/p99 and TPOT p50 from streamed chunks.
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


def one(base, key, model, prompt, max_tokens):
    body = json.dumps({
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()
    req = urllib.request.Request(base.rstrip("/") + "/v1/chat/completions", data=body, headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    t0 = time.perf_counter()
    times, usage = [], None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            ev = json.loads(line[5:])
            if ev.get("usage"):
                usage = ev["usage"]
            if ev.get("choices") and ev["choices"][0].get("delta", {}).get("content"):
                times.append(time.perf_counter())
    n = (usage or {}).get("completion_tokens", len(times))
    ttft = (times[0] - t0) if times else None
    tpot = ((times[-1] - times[0]) / (len(times) - 1)) if len(times) > 1 else None
    return n, ttft, tpot


def main():
    p = argparse.ArgumentParser()
    p.add_argument("base")
    p.add_argument("key")
    p.add_argument("model")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--label", default="server")
    a = p.parse_args()
    one(a.base, a.key, a.model, "Hi", 4)  # warm-up
    results, lock, idx = [], threading.Lock(), [0]

    def worker():
        while True:
            with lock:
                i = idx[0]
                idx[0] += 1
            if i >= a.requests:
                return
            r = one(a.base, a.key, a.model, PROMPTS[i % len(PROMPTS)], a.max_tokens)
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
    print(json.dumps({
        "system": a.label, "metric": "server_output_tok_s", "concurrency": a.concurrency,
        "requests": a.requests, "max_tokens": a.max_tokens, "completion_tokens": toks,
        "value": round(toks / wall, 1),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p99_ms": round(1000 * ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 1),
        "tpot_p50_ms": round(1000 * statistics.median(tpots), 2),
    }))


if __name__ == "__main__":
    main()
