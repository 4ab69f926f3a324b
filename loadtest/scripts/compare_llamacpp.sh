#!/usr/bin/env bash
# `tessera loadtest --compare` against llama.cpp's llama-server on the same GGUF,
# at 1, 4 and 16 concurrent clients (closed loop, fixed seeds), one server loaded
# at a time (the harness runs the main target, then the baseline).
#
#   LLAMA_SERVER=/path/to/llama-server loadtest/scripts/compare_llamacpp.sh [OUT_DIR]
#
# Needs `cargo build --release` and the default model (`tessera model fetch`).
# Writes OUT_DIR/c{1,4,16}/report.{json,html} and prints one table.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=$root/target/release/tessera
model=${MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
out=${1:-$root/target/loadtest-compare}
: "${LLAMA_SERVER:?set LLAMA_SERVER to the llama-server binary}"
tport=${TESSERA_PORT:-18787}
lport=${LLAMA_PORT:-18080}
threads=${THREADS:-2}
work=$(mktemp -d)
admin=tadm_bench_$(od -An -N24 -tx1 /dev/urandom | tr -d " \n")
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  mkdir -p "$out" && cp "$work"/*.log "$out"/ 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

TESSERA_ADMIN_TOKEN=$admin "$bin" serve --listen 127.0.0.1:$tport --data-dir "$work/data" \
  --model "$model" >"$work/serve.log" 2>&1 &
pids+=($!)
# Same KV budget as Tessera's default pool (16,384 tokens), shared by 16 slots.
"$LLAMA_SERVER" -m "$model" -np 16 -c 16384 -kvu -t "$threads" --host 127.0.0.1 --port $lport \
  >"$work/llama.log" 2>&1 &
pids+=($!)
for url in http://127.0.0.1:$tport/healthz http://127.0.0.1:$lport/health; do
  for _ in $(seq 600); do curl -sf "$url" >/dev/null && break; sleep 0.2; done
  curl -sf "$url" >/dev/null || { echo "server at $url did not start" >&2; cat "$work"/*.log >&2; exit 1; }
done

for c in 1 4 16; do
  n=$((c < 4 ? 16 : 4 * c))
  "$bin" loadtest --url http://127.0.0.1:$tport --api openai --admin-token "$admin" \
    --tenants 4 --prompts-per-tenant $((n / 4)) --concurrency $c --requests $n --seed $c \
    --prompt-len uniform:16:96 --output-len fixed:64 \
    --compare http://127.0.0.1:$lport --compare-label llama.cpp --label tessera \
    --out "$out/c$c" --quiet
done

python3 - "$out" <<'PY'
import json, sys
print("| clients | system | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | checks |")
print("|---|---|---|---|---|---|---|")
for c in (1, 4, 16):
    r = json.load(open(f"{sys.argv[1]}/c{c}/report.json"))
    t, b = r["targets"]
    def row(x, checks):
        l, tp = x["latency"], x["throughput"]
        return f"| {c} | {x['label']} | {tp['output_tokens_per_s']:.1f} | {l['ttft_ms']['p50']:.0f} | {l['ttft_ms']['p99']:.0f} | {l['tpot_ms']['p50']:.1f} | {checks} |"
    ch = t["checks"]
    print(row(t, f"leaks {ch['leaks']}, mismatches {ch['mismatches']}, usage {ch['usage_mismatches']}"))
    print(row(b, "-"))
    rat = {x["metric"]: x["ratio"] for x in r["comparison"]["rows"]}
    f = lambda k: f"{rat[k]:.2f}x" if rat[k] is not None else "-"
    print(f"| {c} | ratio | **{f('output_tokens_per_s')}** | {f('ttft_p50_ms')} | {f('ttft_p99_ms')} | {f('tpot_p50_ms')} | |")
PY
