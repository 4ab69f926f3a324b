#!/usr/bin/env bash
# Tessera's engine beside llama.cpp on the same GGUF, measured in the same run.
#
# Runs `tessera bench` and scripts/bench_llamacpp.sh alternately ROUNDS times and
# prints, per metric, the median of each system and the ratio Tessera / llama.cpp.
# Metrics: prefill tok/s (256-token prompt), decode tok/s at batch 1 (after that
# prompt) and at batch BATCH (16-token prompts). Raw JSON lines are kept in
# $OUT (default target/bench/results.jsonl). Run on an idle machine.
#
# Usage: scripts/bench.sh [MODEL.gguf]   (env: ROUNDS=2 BATCH=16 DECODE_TOKENS=128)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODEL=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
ROUNDS=${ROUNDS:-2}
export BATCH=${BATCH:-16} DECODE_TOKENS=${DECODE_TOKENS:-128} RUNS=${RUNS:-3}
OUT=${OUT:-target/bench/results.jsonl}
mkdir -p "$(dirname "$OUT")"
: > "$OUT"
cargo build --release --quiet
for round in $(seq "$ROUNDS"); do
    echo "round $round/$ROUNDS: tessera" >&2
    ./target/release/tessera bench --model "$MODEL" --batch "$BATCH" \
        --decode-tokens "$DECODE_TOKENS" --reps "$RUNS" | tee -a "$OUT" >&2
    echo "round $round/$ROUNDS: llama.cpp" >&2
    bash scripts/bench_llamacpp.sh "$MODEL" | tee -a "$OUT" >&2
done
python3 - "$OUT" <<'PY'
import json, statistics, sys, platform, os
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
def key(r):
    return (r["metric"], r.get("batch"))
vals = {}
for r in rows:
    vals.setdefault((r["system"], key(r)), []).append(r["value"])
cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
print(f"machine: {cpu}, {os.cpu_count()} cores")
print(f"| metric | Tessera | llama.cpp | ratio |")
print(f"|---|---|---|---|")
for metric, batch in sorted({key(r) for r in rows if r["system"] == "tessera"}, key=str):
    t = vals.get(("tessera", (metric, batch)))
    l = vals.get(("llama.cpp", (metric, batch)))
    if not t or not l:
        continue
    tm, lm = statistics.median(t), statistics.median(l)
    name = metric + (f" (batch {batch})" if batch else "")
    print(f"| {name} | {tm:.1f} | {lm:.1f} | {tm / lm:.2f}x |")
PY
