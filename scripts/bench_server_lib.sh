# Shared by the server benchmarks (bench_families_servers.sh, bench_spec_servers.sh):
# source it after setting `root`. It sets, from the environment, `llama`
# (LLAMA_SERVER, default /work/ext/build/bin/llama-server) and `bin` (TESSERA_BIN,
# default target/release/tessera), both checked, `threads` (THREADS, 2), `tport` and
# `lport` (TESSERA_PORT 18787, LLAMA_PORT 18080) and `ready_timeout` (READY_TIMEOUT,
# 300 s). One server at a time runs as
# `$spid`; `stop_server` ends it (TERM, then KILL after 30 s), `wait_ready URL LOG`
# waits until URL answers (exits naming the log when the server dies or the
# deadline passes). The caller's EXIT trap calls stop_server. Tenant limits are off
# (TESSERA_DEFAULT_* = 0) so that no limit throttles a measurement.
llama=${LLAMA_SERVER:-/work/ext/build/bin/llama-server}
bin=${TESSERA_BIN:-$root/target/release/tessera}
[ -x "$llama" ] || { echo "no llama-server at $llama (set LLAMA_SERVER)" >&2; exit 1; }
[ -x "$bin" ] || { echo "no tessera at $bin (cargo build --release -p tessera, or set TESSERA_BIN)" >&2; exit 1; }
threads=${THREADS:-2}
tport=${TESSERA_PORT:-18787}
lport=${LLAMA_PORT:-18080}
ready_timeout=${READY_TIMEOUT:-300}
export TESSERA_DEFAULT_RPM=0 TESSERA_DEFAULT_INPUT_TPM=0 TESSERA_DEFAULT_OUTPUT_TPM=0 \
  TESSERA_DEFAULT_MAX_CONCURRENT=0 TESSERA_DEFAULT_DAILY_TOKENS=0
spid=
stop_server() {
  [ -n "$spid" ] || return 0
  kill "$spid" 2>/dev/null || true
  for _ in $(seq 150); do kill -0 "$spid" 2>/dev/null || break; sleep 0.2; done
  kill -9 "$spid" 2>/dev/null || true
  wait "$spid" 2>/dev/null || true
  spid=
}

wait_ready() { # URL LOG
  local end=$((SECONDS + ready_timeout))
  while [ $SECONDS -lt $end ]; do
    kill -0 "$spid" 2>/dev/null || { echo "server exited; its log:" >&2; tail -30 "$2" >&2; exit 1; }
    curl -sf -o /dev/null "$1" && return 0
    sleep 0.2
  done
  echo "server not ready at $1 after ${ready_timeout}s; its log:" >&2; tail -30 "$2" >&2; exit 1
}
