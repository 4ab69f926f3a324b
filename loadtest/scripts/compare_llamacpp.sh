#!/usr/bin/env bash
# `tessera loadtest --compare` against a baseline server on the same GGUF, at 1, 4
# and 16 concurrent clients (closed loop, fixed seeds), one server loaded at a time
# (the harness runs the main target, then the baseline; an idle server takes no CPU).
#
#   LLAMA_SERVER=/path/to/llama-server loadtest/scripts/compare_llamacpp.sh [OUT_DIR]
#   BASELINE_BIN=/path/to/older/tessera loadtest/scripts/compare_llamacpp.sh [OUT_DIR]
#     (BASELINE_LABEL names it in the reports; default "before")
#
# Baseline: llama.cpp's llama-server (LLAMA_SERVER), or, with BASELINE_BIN,
# `tessera serve` from another build (a before/after comparison of two versions;
# its first-start key is read from its log).
# Other settings (environment):
#   TESSERA_BIN    the server under test and the load generator
#                  (default: target/release/tessera; needs `cargo build --release`)
#   MODEL          the GGUF (default: the `tessera model fetch` file)
#   CLIENTS        concurrency levels (default "1 4 16")
#   REQUESTS       requests per level (default: 16 below 4 clients, else 4 x clients)
#   OUTPUT_LEN     --output-len (default fixed:64)
#   LOADTEST_ARGS  extra `tessera loadtest` arguments, e.g. "--shared-prefix-tokens 800";
#                  "--no-checks" for timing runs: the isolation checks' solo phase sends
#                  every prompt to the server under test first, which warms its prefix
#                  cache for the timed phase (the baseline gets no such phase)
#   LLAMA_ARGS     extra llama-server arguments
#   TESSERA_ENV, BASELINE_ENV
#                  extra VAR=value words for the server under test / a tessera
#                  baseline only, e.g. TESSERA_ENV=OTEL_EXPORTER_OTLP_ENDPOINT=http://...
#                  with BASELINE_BIN set to the same binary: tracing on vs off
# Tenants the harness creates get no limits (TESSERA_DEFAULT_* = 0), so a limit
# never throttles the measurement.
# Writes OUT_DIR/c{N}/report.{json,html} and prints one table.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
bin=${TESSERA_BIN:-$root/target/release/tessera}
model=${MODEL:-$root/models/SmolLM2-135M-Instruct.Q4_1.gguf}
out=${1:-$root/target/loadtest-compare}
clients=${CLIENTS:-1 4 16}
output_len=${OUTPUT_LEN:-fixed:64}
if [ -z "${BASELINE_BIN:-}" ]; then
  : "${LLAMA_SERVER:?set LLAMA_SERVER to the llama-server binary (or BASELINE_BIN to another tessera)}"
fi
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
export TESSERA_DEFAULT_RPM=0 TESSERA_DEFAULT_INPUT_TPM=0 TESSERA_DEFAULT_OUTPUT_TPM=0 \
  TESSERA_DEFAULT_MAX_CONCURRENT=0 TESSERA_DEFAULT_DAILY_TOKENS=0

# shellcheck disable=SC2086
env ${TESSERA_ENV:-} TESSERA_ADMIN_TOKEN=$admin "$bin" serve --listen 127.0.0.1:$tport --data-dir "$work/data" \
  --model "$model" >"$work/serve.log" 2>&1 &
pids+=($!)
compare_args=(--compare http://127.0.0.1:$lport)
if [ -n "${BASELINE_BIN:-}" ]; then
  label=${BASELINE_LABEL:-before}
  # shellcheck disable=SC2086
  env ${BASELINE_ENV:-} TESSERA_ADMIN_TOKEN=$admin "$BASELINE_BIN" serve --listen 127.0.0.1:$lport \
    --data-dir "$work/baseline-data" --model "$model" >"$work/baseline.log" 2>&1 &
  pids+=($!)
  health=http://127.0.0.1:$lport/healthz
else
  label=llama.cpp
  # Same KV budget as Tessera's default pool (16,384 tokens), shared by 16 slots.
  # shellcheck disable=SC2086
  "$LLAMA_SERVER" -m "$model" -np 16 -c 16384 -kvu -t "$threads" --host 127.0.0.1 --port $lport \
    ${LLAMA_ARGS:-} >"$work/llama.log" 2>&1 &
  pids+=($!)
  health=http://127.0.0.1:$lport/health
fi
for url in http://127.0.0.1:$tport/healthz $health; do
  for _ in $(seq 600); do curl -sf "$url" >/dev/null && break; sleep 0.2; done
  curl -sf "$url" >/dev/null || { echo "server at $url did not start" >&2; cat "$work"/*.log >&2; exit 1; }
done
if [ -n "${BASELINE_BIN:-}" ]; then
  key=$(grep -o 'tsk_[A-Za-z0-9_]*' "$work/baseline.log" | head -1)
  [ -n "$key" ] || { echo "no API key in the baseline's log" >&2; exit 1; }
  compare_args+=(--compare-key "$key")
fi

for c in $clients; do
  n=${REQUESTS:-$((c < 4 ? 16 : 4 * c))}
  # shellcheck disable=SC2086
  "$bin" loadtest --url http://127.0.0.1:$tport --api openai --admin-token "$admin" \
    --tenants 4 --prompts-per-tenant $(((n + 3) / 4)) --concurrency "$c" --requests "$n" --seed "$c" \
    --prompt-len uniform:16:96 --output-len "$output_len" \
    "${compare_args[@]}" --compare-label "$label" --label tessera \
    --out "$out/c$c" --quiet ${LOADTEST_ARGS:-}
done

python3 - "$out" $clients <<'PY'
import json, sys
print("| clients | system | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | checks |")
print("|---|---|---|---|---|---|---|")
for c in sys.argv[2:]:
    r = json.load(open(f"{sys.argv[1]}/c{c}/report.json"))
    t, b = r["targets"]
    def row(x, checks):
        l, tp = x["latency"], x["throughput"]
        return f"| {c} | {x['label']} | {tp['output_tokens_per_s']:.1f} | {l['ttft_ms']['p50']:.0f} | {l['ttft_ms']['p99']:.0f} | {l['tpot_ms']['p50']:.1f} | {checks} |"
    ch = t.get("checks") or {}
    checks = f"leaks {ch.get('leaks')}, mismatches {ch.get('mismatches')}, usage {ch.get('usage_mismatches')}" if ch else "off"
    print(row(t, checks))
    print(row(b, "-"))
    rat = {x["metric"]: x["ratio"] for x in r["comparison"]["rows"]}
    f = lambda k: f"{rat[k]:.2f}x" if rat.get(k) is not None else "-"
    print(f"| {c} | ratio | **{f('output_tokens_per_s')}** | {f('ttft_p50_ms')} | {f('ttft_p99_ms')} | {f('tpot_p50_ms')} | |")
    pc = t.get("prefix_cache")
    if pc and pc.get("prompt_tokens"):
        print(f"| {c} | tessera prefix cache | {pc['cached_tokens']} of {pc['prompt_tokens']} prompt tokens cached ({100 * pc['hit_rate']:.0f}%), {pc['requests_with_hit']} of {pc['requests_with_usage']} answers hit | | | | |")
PY
