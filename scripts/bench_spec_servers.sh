#!/usr/bin/env bash
# Speculative decoding at the server, single stream (issue 37): `tessera serve` with
# a draft model against llama.cpp's `llama-server` with the same draft model, same
# GGUF files, same client (scripts/bench_spec_servers.py: four prompts, greedy,
# streamed chat, median of REPS rounds). ONE server up at a time:
#   1. tessera serve --model ID=TARGET --draft-model ID=DRAFT: per request plain
#      (`speculative.k` 0), prompt lookup (`ngram`) and draft model (`draft`),
#      alternated on the same server;
#   2. llama-server -m TARGET (plain);
#   3. llama-server -m TARGET --spec-type ngram-simple (its prompt lookup);
#   4. llama-server -m TARGET --spec-type draft-simple -md DRAFT --spec-draft-n-max K
#      (its draft model).
#
#   scripts/bench_spec_servers.sh [TARGET.gguf DRAFT.gguf [OUT_DIR]]
#
# Defaults: models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf drafted for by
# models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf (`tessera model fetch --model
# qwen2.5-coder-1.5b-instruct --model qwen2.5-coder-0.5b-instruct`).
# Settings (environment): LLAMA_SERVER (default /work/ext/build/bin/llama-server,
# built as scripts/bench_families_servers.sh says; on a CPU that reports AMX also
# configure with -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF: its AMX
# kernels stop on SIGILL where the kernel does not grant AMX state), TESSERA_BIN (default
# target/release/tessera), THREADS (2: both servers' compute threads), K (4: draft
# tokens per step for both), REPS (3), MAX_TOKENS (128), TESSERA_PORT (18787),
# LLAMA_PORT (18080), READY_TIMEOUT (300 s). OUT_DIR (default
# target/bench-spec-servers) keeps the logs and results.jsonl.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
target=${1:-$root/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf}
draft=${2:-$root/models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf}
out=${3:-$root/target/bench-spec-servers}
for f in "$target" "$draft"; do [ -f "$f" ] || { echo "no model file: $f" >&2; exit 1; }; done
# shellcheck source=scripts/bench_server_lib.sh
. "$root/scripts/bench_server_lib.sh"
k=${K:-4}
reps=${REPS:-3}
maxtok=${MAX_TOKENS:-128}
id=local/target
mkdir -p "$out"
: >"$out/results.jsonl"
bench="python3 $root/scripts/bench_spec_servers.py"

work=$(mktemp -d)
trap 'stop_server; rm -rf "$work"' EXIT

log=$out/tessera.log
env TESSERA_THREADS="$threads" "$bin" serve --listen 127.0.0.1:$tport --data-dir "$work/data" \
  --model "$id=$target" --draft-model "$id=$draft" >"$log" 2>&1 &
spid=$!
wait_ready http://127.0.0.1:$tport/healthz "$log"
key=$(grep -o 'tsk_[A-Za-z0-9_]*' "$log" | head -1)
$bench http://127.0.0.1:$tport "$key" "$id" --label tessera --reps "$reps" \
  --max-tokens "$maxtok" --variant 'plain={"speculative": {"k": 0}}' \
  --variant "ngram={\"speculative\": {\"mode\": \"ngram\", \"k\": $k}}" \
  --variant "draft={\"speculative\": {\"mode\": \"draft\", \"k\": $k}}" | tee -a "$out/results.jsonl"
stop_server

run_llama() { # LABEL ARGS...
  local label=$1 log=$out/llama-$1.log
  shift
  "$llama" -m "$target" -np 1 -c 4096 -t "$threads" --host 127.0.0.1 --port $lport "$@" \
    >"$log" 2>&1 &
  spid=$!
  wait_ready http://127.0.0.1:$lport/health "$log"
  $bench http://127.0.0.1:$lport none target --label "llama.cpp $label" --reps "$reps" \
    --max-tokens "$maxtok" | tee -a "$out/results.jsonl"
  stop_server
}
run_llama plain
run_llama ngram-simple --spec-type ngram-simple --spec-draft-n-max "$k"
run_llama draft --spec-type draft-simple -md "$draft" --spec-draft-n-max "$k" -td "$threads"
