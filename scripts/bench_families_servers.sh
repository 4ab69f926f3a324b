#!/usr/bin/env bash
# `tessera serve` against llama.cpp's `llama-server` on one GGUF, server level, same
# run: ONE server up at a time, alternating (round 1 Tessera first, round 2
# llama.cpp first, ...), each measured by scripts/bench_servers.py (streaming,
# greedy, N concurrent streams) and killed after its run. Prints one markdown table.
#
#   scripts/bench_families_servers.sh MODEL_FILE raw|chat [OUT_DIR]
#
#   raw   the prompts as raw text through /v1/completions (base models without a
#         chat template, e.g. models/gemma-3-270m-q4_k_m.gguf)
#   chat  /v1/chat/completions with each server's chat template (e.g.
#         models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf)
#
# Settings (environment):
#   LLAMA_SERVER   llama-server binary (default /work/ext/build/bin/llama-server), built
#                  from the llama.cpp that llama-cpp-python 0.3.36 vendors:
#                    pip download --no-deps --no-binary llama-cpp-python \
#                      llama-cpp-python==0.3.36 -d /work/ext/src   # then untar it
#                    cmake -S /work/ext/src/llama_cpp_python-0.3.36/vendor/llama.cpp \
#                      -B /work/ext/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
#                      -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF \
#                      -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
#                      -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
#                    cmake --build /work/ext/build --target llama-server -j2
#                  (cmake from pip where the machine has none)
#   TESSERA_BIN    default target/release/tessera (`cargo build --release -p tessera`)
#   ROUNDS         rounds, each runs both servers once (default 2)
#   CONCURRENCY    concurrent streams (default 16)
#   REQUESTS       requests per run (default 32)
#   MAX_TOKENS     max_tokens per request (default 128)
#   THREADS        compute threads of both servers (default 2: llama-server -t,
#                  Tessera TESSERA_THREADS)
#   MODEL_ID       the id Tessera serves the file as (default: the catalog id of the
#                  two family files, else local/<file name>)
#   TESSERA_PORT, LLAMA_PORT   default 18787, 18080
#   LLAMA_ARGS, TESSERA_ARGS   extra server arguments (word-split)
#   READY_TIMEOUT  seconds to wait for a server to answer its health check (300)
# OUT_DIR (default target/bench-families-servers/<model>-<mode>) keeps the servers'
# logs and results.jsonl (one bench_servers.py JSON line per run).
#
# llama-server runs as `-m MODEL -np 16 -c 16384 -kvu -t THREADS` (16 slots sharing
# one 16,384-token KV cache, prompt cache at its default), Tessera as `tessera serve
# --model ID=MODEL` (its default pools; a pool is at least one context window) with
# a fresh data dir per run, its first-start API key read from its log, and tenant
# limits off (TESSERA_DEFAULT_* = 0) so no limit throttles the measurement.
# Peak RSS is the server's VmHWM (/proc/PID/status) read right after its run.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
usage() { sed -n '2,12p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
[ $# -ge 2 ] || usage
model=$1
mode=$2
case $mode in raw) raw_flag=--raw ;; chat) raw_flag= ;; *) usage ;; esac
[ -f "$model" ] || { echo "no model file: $model" >&2; exit 1; }
model=$(cd "$(dirname "$model")" && pwd)/$(basename "$model")
# shellcheck source=scripts/bench_server_lib.sh
. "$root/scripts/bench_server_lib.sh"
rounds=${ROUNDS:-2}
conc=${CONCURRENCY:-16}
nreq=${REQUESTS:-32}
maxtok=${MAX_TOKENS:-128}
base=$(basename "$model" .gguf)
case $base in
  gemma-3-270m*) default_id=@cf/google/gemma-3-270m ;;
  qwen2.5-coder-0.5b-instruct*) default_id=@cf/qwen/qwen2.5-coder-0.5b-instruct ;;
  SmolLM2-135M-Instruct*) default_id=@cf/huggingfacetb/smollm2-135m-instruct ;;
  *) default_id=local/$base ;;
esac
model_id=${MODEL_ID:-$default_id}
out=${3:-$root/target/bench-families-servers/$base-$mode}
mkdir -p "$out"
: >"$out/results.jsonl"
bench=$root/scripts/bench_servers.py

admin=tadm_bench_$(od -An -N24 -tx1 /dev/urandom | tr -d " \n")
work=$(mktemp -d)
trap 'stop_server; rm -rf "$work"' EXIT

run_tessera() { # ROUND
  local log=$out/tessera-r$1.log data=$work/tessera-r$1
  # shellcheck disable=SC2086
  env TESSERA_ADMIN_TOKEN="$admin" TESSERA_THREADS="$threads" "$bin" serve \
    --listen 127.0.0.1:$tport --data-dir "$data" --model "$model_id=$model" ${TESSERA_ARGS:-} \
    >"$log" 2>&1 &
  spid=$!
  wait_ready http://127.0.0.1:$tport/healthz "$log"
  local key=
  for _ in $(seq 50); do
    key=$(grep -o 'tsk_[A-Za-z0-9_]*' "$log" | head -1 || true)
    [ -n "$key" ] && break
    sleep 0.2
  done
  [ -n "$key" ] || { echo "no API key in Tessera's log ($log)" >&2; exit 1; }
  # shellcheck disable=SC2086
  python3 "$bench" http://127.0.0.1:$tport "$key" "$model_id" --concurrency "$conc" \
    --requests "$nreq" --max-tokens "$maxtok" --label tessera --pid "$spid" $raw_flag \
    | sed "s/^{/{\"round\": $1, /" | tee -a "$out/results.jsonl"
  stop_server
}

run_llama() { # ROUND
  local log=$out/llama-r$1.log
  # shellcheck disable=SC2086
  "$llama" -m "$model" -np 16 -c 16384 -kvu -t "$threads" --host 127.0.0.1 --port $lport \
    ${LLAMA_ARGS:-} >"$log" 2>&1 &
  spid=$!
  wait_ready http://127.0.0.1:$lport/health "$log"
  # shellcheck disable=SC2086
  python3 "$bench" http://127.0.0.1:$lport none "$base" --concurrency "$conc" \
    --requests "$nreq" --max-tokens "$maxtok" --label llama.cpp --pid "$spid" $raw_flag \
    | sed "s/^{/{\"round\": $1, /" | tee -a "$out/results.jsonl"
  stop_server
}

echo "model $model ($model_id), mode $mode, rounds $rounds, $conc streams, $nreq requests," \
  "max_tokens $maxtok, $threads threads; logs in $out" >&2
for r in $(seq "$rounds"); do
  if [ $((r % 2)) -eq 1 ]; then run_tessera "$r"; run_llama "$r"; else run_llama "$r"; run_tessera "$r"; fi
done

python3 - "$out/results.jsonl" "$model" "$mode" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
by = {}
for x in rows:
    by.setdefault(x["round"], {})[x["system"]] = x
f = lambda v, d=1: "-" if v is None else f"{v:,.{d}f}"
r0 = rows[0]
print(f"{sys.argv[2].rsplit('/', 1)[-1]}, {'/v1/completions (raw)' if sys.argv[3] == 'raw' else '/v1/chat/completions'}: "
      f"{r0['concurrency']} streams, {r0['requests']} requests, max_tokens {r0['max_tokens']}\n")
print("| round | system | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | TPOT p50 (ms) | peak RSS (MB) | tokens | errors |")
print("|---|---|---|---|---|---|---|---|---|")
keys = ["value", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "peak_rss_mb"]
ratios = {k: [] for k in keys}
for r in sorted(by):
    for s in ("tessera", "llama.cpp"):
        x = by[r].get(s)
        if x:
            print(f"| {r} | {s} | {f(x['value'])} | {f(x['ttft_p50_ms'])} | {f(x['ttft_p99_ms'])} | "
                  f"{f(x['tpot_p50_ms'], 2)} | {f(x.get('peak_rss_mb'))} | {x['completion_tokens']} | {x['errors']} |")
    t, l = by[r].get("tessera"), by[r].get("llama.cpp")
    if t and l:
        cells = []
        for k in keys:
            if t.get(k) is not None and l.get(k):
                ratios[k].append(t[k] / l[k])
                cells.append(f"{t[k] / l[k]:.2f}x")
            else:
                cells.append("-")
        print(f"| {r} | ratio | **{cells[0]}** | {cells[1]} | {cells[2]} | {cells[3]} | {cells[4]} | | |")
if len(by) > 1 and ratios["value"]:
    m = [f"{statistics.median(ratios[k]):.2f}x" if ratios[k] else "-" for k in keys]
    print(f"| median | ratio | **{m[0]}** | {m[1]} | {m[2]} | {m[3]} | {m[4]} | | |")
print("\n(ratio = Tessera / llama.cpp; for TTFT, TPOT and RSS lower is better. "
      "Peak RSS = VmHWM after the run, model loading included.)")
PY
