#!/usr/bin/env bash
# Kernel A/B on a noisy 2-core machine: runs two builds of a kernel example at the
# same time, one per core (swapped every round), single-threaded, so both see the
# same neighbours. Prints each round's pair and the geometric mean of B / A.
#
#   scripts/kernel_pair.sh A B ROUNDS [example args...]
#   e.g. scripts/kernel_pair.sh target/tmp/att-before target/tmp/att-after 12 6000
#
# A and B are example binaries (e.g. copies of target/release/examples/
# attention_speed from two builds). LINE (default 1) picks the output line and
# FIELD (default 3) the whitespace-separated field holding the time: the defaults
# read attention_speed's prefill ms; LINE=2 FIELD=4 its decode us. A ratio below
# 1 means B is faster. Not a benchmark of record (docs/benchmarks.md).
set -euo pipefail
[ $# -ge 3 ] || { sed -n '2,12p' "$0"; exit 2; }
a=$1 b=$2 rounds=$3
shift 3
line=${LINE:-1} field=${FIELD:-3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for r in $(seq "$rounds"); do
  if (( r % 2 )); then ca=0 cb=1; else ca=1 cb=0; fi
  TESSERA_THREADS=1 taskset -c "$ca" "$a" "$@" 2>/dev/null | sed -n "${line}p" >"$tmp/a" &
  TESSERA_THREADS=1 taskset -c "$cb" "$b" "$@" 2>/dev/null | sed -n "${line}p" >"$tmp/b" &
  wait
  echo "$(awk -v f="$field" '{print $f}' "$tmp/a") $(awk -v f="$field" '{print $f}' "$tmp/b")"
done | awk '{print; s += log($2 / $1); n++}
  END {printf "geo-mean B/A time %.3f over %d rounds\n", exp(s / n), n}'
