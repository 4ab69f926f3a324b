#!/usr/bin/env python3
"""Single-stream decode rate of an OpenAI-compatible server on prompts whose answers
repeat their input (a code edit, a quoting summary) and on open-ended ones, with
request variants alternated on the same server (issue 37: speculation; see
docs/benchmarks.md).

Usage: bench_spec_servers.py BASE_URL API_KEY MODEL --label NAME
                             [--variant NAME=JSON]... [--reps 3] [--max-tokens 128]
Each --variant adds its JSON object's keys to every request body (for example
`draft={"speculative": {"mode": "draft"}}`); none: one variant, the plain body.
For each prompt the variants run in turn, `--reps` rounds; each request streams
`/v1/chat/completions` (greedy) and its rate is (completion tokens - 1) / (last
chunk - first chunk), prefill excluded. Prints one JSON line per prompt and
variant: the median rate, every round's rate, the completion tokens and the
answer's length in characters (equal lengths across variants: the same answer).
Standard library only.
"""
import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_servers import stream  # noqa: E402

CODE = ("fn total(items: &[Item]) -> u64 {\n    let mut sum = 0;\n    for item in items {\n"
        "        if item.active {\n            sum += item.price * item.count;\n        }\n"
        "    }\n    sum\n}\n")
ARTICLE = ("The city council met on Tuesday to discuss the new bicycle lanes. The council "
           "approved a plan to build twelve kilometres of protected lanes along the river, "
           "connecting the old town with the university. Construction starts in March and "
           "ends in October. The plan costs four million euros, paid by the regional "
           "transport fund. Shop owners on Market Street asked for more parking; the "
           "council promised a study of delivery zones before the lanes open.")
# The prompts of backend/engine/examples/speculation.rs.
PROMPTS = [
    ("code edit", "Rename the variable `sum` to `total_price` in this function and "
                  "return the whole function:\n" + CODE),
    ("summarise", "Summarise this article, quoting its key sentences:\n" + ARTICLE),
    ("open-ended", "Write a short story about a lighthouse keeper who counts ships."),
    ("open-ended 2", "Explain how bread is made, step by step."),
]


def one(base, key, model, prompt, max_tokens, extra):
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt}]}
    body.update(extra)
    times, usage, text = stream(base, key, "/v1/chat/completions", body)
    n = (usage or {}).get("completion_tokens", len(times))
    rate = (n - 1) / (times[-1] - times[0]) if len(times) > 1 else None
    return rate, n, len(text)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("base")
    ap.add_argument("key")
    ap.add_argument("model")
    ap.add_argument("--label", required=True)
    ap.add_argument("--variant", action="append", default=[])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    a = ap.parse_args()
    variants = [(v.split("=", 1)[0], json.loads(v.split("=", 1)[1])) for v in a.variant]
    variants = variants or [("plain", {})]
    # Warm-up: weights paged in, threads started.
    for _, extra in variants:
        one(a.base, a.key, a.model, "Hi", 8, extra)
    for name, prompt in PROMPTS:
        rates = {v: [] for v, _ in variants}
        last = {}
        for _ in range(a.reps):
            for v, extra in variants:
                rate, n, chars = one(a.base, a.key, a.model, prompt, a.max_tokens, extra)
                rates[v].append(rate)
                last[v] = (n, chars)
        for v, _ in variants:
            print(json.dumps({"server": a.label, "variant": v, "prompt": name,
                              "tok_s": round(statistics.median(rates[v]), 1),
                              "rounds": [round(r, 1) for r in rates[v]],
                              "completion_tokens": last[v][0], "chars": last[v][1]}),
                  flush=True)


if __name__ == "__main__":
    main()
