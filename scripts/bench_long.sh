#!/usr/bin/env bash
# Long prompts and long contexts: `tessera bench` beside llama.cpp's `llama-bench`
# on the same GGUF files, measured alternately in one run.
#
# Metrics, per model file:
#   - prefill tok/s of one prompt of 512, 2,048 and 6,000 tokens (Tessera: time to
#     the first token of one request; llama-bench: ppN, the prompt in 512-token
#     micro-batches);
#   - decode TPOT at 4,000 tokens of context, batch 1 (Tessera: tokens after a
#     4,000-token prompt; llama-bench: tg64 at depth 4000).
# Each round runs Tessera then llama.cpp on every file; the summary prints the
# median per system and metric, the ratio Tessera / llama.cpp on the same file
# and, with two files, Tessera on the first against llama.cpp on the second
# (e.g. the shipped Q4_1 against llama.cpp's fastest format, Q4_0). Raw JSON
# lines go to $OUT (default target/bench/long.jsonl). Run on an idle machine:
# llama.cpp's thread barriers collapse when another process takes a core.
#
# Usage: scripts/bench_long.sh MODEL.gguf [MODEL2.gguf ...]
#   env: ROUNDS (2), REPS (3, repetitions per system per round), THREADS (2),
#        LLAMA_BENCH (path of llama-bench, built outside the repository, e.g.
#        /work/llama.cpp-build/build-noamx/bin/llama-bench), FA (llama.cpp
#        flash attention: auto|on|off, default auto, llama-bench's default)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
[ $# -ge 1 ] || { echo "usage: $0 MODEL.gguf [MODEL2.gguf ...]" >&2; exit 2; }
ROUNDS=${ROUNDS:-2}
REPS=${REPS:-3}
THREADS=${THREADS:-2}
FA=${FA:-auto}
LLAMA_BENCH=${LLAMA_BENCH:?set LLAMA_BENCH to a llama-bench binary (built outside the repository)}
OUT=${OUT:-target/bench/long.jsonl}
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
cargo build --release --quiet
for round in $(seq "$ROUNDS"); do
    for model in "$@"; do
        name=$(basename "$model")
        load=$(cut -d' ' -f1 /proc/loadavg)
        echo "round $round/$ROUNDS: tessera on $name (load $load)" >&2
        TESSERA_THREADS=$THREADS ./target/release/tessera bench --model "$model" --long-only \
            --reps "$REPS" --prefill-lengths 512,2048,6000 --tpot-context 4000 --tpot-tokens 64 \
            | python3 -c '
import json, sys
for l in sys.stdin:
    r = json.loads(l); r["model"] = sys.argv[1]; r["load_1m_before"] = float(sys.argv[2]); print(json.dumps(r))
' "$name" "$load" | tee -a "$OUT" >&2
        load=$(cut -d' ' -f1 /proc/loadavg)
        echo "round $round/$ROUNDS: llama.cpp on $name (load $load)" >&2
        { "$LLAMA_BENCH" -m "$model" -t "$THREADS" -fa "$FA" -r "$REPS" -p 512,2048,6000 -n 0 -o jsonl
          "$LLAMA_BENCH" -m "$model" -t "$THREADS" -fa "$FA" -r "$REPS" -p 0 -n 64 -d 4000 -o jsonl
        } 2>/dev/null | python3 -c '
import json, statistics, sys
for l in sys.stdin:
    r = json.loads(l)
    ts = statistics.median(r["samples_ts"])
    out = {"system": "llama.cpp", "model": sys.argv[1], "load_1m_before": float(sys.argv[2]),
           "build": r["build_commit"], "flash_attn": r["flash_attn"], "type_k": r["type_k"]}
    if r["n_gen"] == 0:
        out.update(metric="prefill_tok_s", prompt_tokens=r["n_prompt"], value=ts)
    else:
        out.update(metric="decode_tpot_ms", batch=1, context_tokens=r["n_depth"], value=1e3 / ts)
    print(json.dumps(out))
' "$name" "$load" | tee -a "$OUT" >&2
    done
done
python3 - "$OUT" "$@" <<'PY'
import json, os, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
models = [os.path.basename(m) for m in sys.argv[2:]]
def key(r):
    return (r["metric"], r.get("prompt_tokens") or r.get("context_tokens"))
vals = {}
for r in rows:
    if r["metric"] in ("prefill_tok_s", "decode_tpot_ms"):
        vals.setdefault((r["system"], r["model"], key(r)), []).append(r["value"])
def med(s, m, k):
    v = vals.get((s, m, k))
    return statistics.median(v) if v else None
def name(k):
    return f"prefill tok/s, {k[1]} tokens" if k[0] == "prefill_tok_s" else f"decode TPOT ms, {k[1]} context"
def ratio(k, t, l):
    # Tessera / llama.cpp, oriented so that > 1 means Tessera is faster.
    return t / l if k[0] == "prefill_tok_s" else l / t
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(f"machine: {cpu}, {os.cpu_count()} cores; values are medians over rounds x reps")
keys = sorted({key(r) for r in rows if r["metric"] in ("prefill_tok_s", "decode_tpot_ms")})
for m in models:
    print(f"\n{m}\n| metric | Tessera | llama.cpp | Tessera speed / llama.cpp |\n|---|---|---|---|")
    for k in keys:
        t, l = med("tessera", m, k), med("llama.cpp", m, k)
        if t and l:
            print(f"| {name(k)} | {t:.1f} | {l:.1f} | {ratio(k, t, l):.2f}x |")
if len(models) >= 2:
    a, b = models[0], models[1]
    print(f"\nTessera on {a} vs llama.cpp on {b}\n| metric | Tessera | llama.cpp | ratio |\n|---|---|---|---|")
    for k in keys:
        t, l = med("tessera", a, k), med("llama.cpp", b, k)
        if t and l:
            print(f"| {name(k)} | {t:.1f} | {l:.1f} | {ratio(k, t, l):.2f}x |")
for m in models:
    p = {n: med("tessera", m, ("prefill_tok_s", n)) for n in (512, 6000)}
    if all(p.values()):
        print(f"\nTessera on {m}: prefill rate at 6,000 / at 512 tokens = {p[6000] / p[512]:.2f} (target >= 0.5)")
PY
