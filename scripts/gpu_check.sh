#!/usr/bin/env bash
# The GPU checks of issue 16 (item 5), on a lent GPU machine, in the repository root,
# after scripts/gpu_pack.sh ran here and both halves were carried (docs/benchmarks.md,
# "CUDA backend"). Finishes in about 3 minutes (each step has its own time limit; at
# most 8 minutes in all) and writes into $OUT:
#   device.txt         date, nvidia-smi, driver, CUDA toolkit, libraries used
#   kernel_tests.log   the CUDA kernel tests (kernels/tests/cuda_kernels.rs), GPU required
#   gpu_check.jsonl    one JSON object per check (backend/model/examples/gpu_check.rs)
#   gpu_check.log      its output
#   summary.txt        the table printed last
# Exit status: 0 when every check passed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-target/gpu_out}
mkdir -p "$OUT"
rc=0
say() { echo "gpu_check: $*" | tee -a "$OUT/device.txt"; }

# 1. The machine.
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "commit: $(cat .gpu1/commit 2>/dev/null || git rev-parse HEAD 2>/dev/null)"
    uname -a
    nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used,clocks.sm,clocks.mem,power.limit \
        --format=csv 2>&1
    nvcc --version 2>&1 | tail -2
} >"$OUT/device.txt"

# 2. The model, joined and checked.
model=/tmp/tessera-model.gguf
if [ ! -f .gpu1/model.part1 ] || [ ! -f .gpu2/model.part2 ]; then
    say "missing .gpu1/model.part1 or .gpu2/model.part2: carry .gpu1 in one call and .gpu2 in the next while the machine is warm"
    exit 3
fi
cat .gpu1/model.part1 .gpu2/model.part2 >"$model"
if [ "$(sha256sum <"$model" | cut -d' ' -f1)" != "$(cat .gpu1/model.sha256)" ]; then
    say "model sha256 mismatch after joining the halves"
    exit 3
fi
say "model joined, sha256 $(cat .gpu1/model.sha256)"

# 3. The libraries: the driver (libcuda), NVRTC and cuBLAS, wherever this image has them.
first() { for p in "$@"; do [ -e "$p" ] && { echo "$p"; return 0; }; done; return 1; }
pydirs=$(python3 -c 'import site; print(" ".join(site.getsitepackages()))' 2>/dev/null)
search=(/usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib)
for d in $pydirs; do search+=("$d/nvidia/cu13/lib" "$d/nvidia/cublas/lib" "$d/nvidia/cuda_nvrtc/lib"); done
nvrtc=""
for d in "${search[@]}"; do
    nvrtc=$(first "$d/libnvrtc.so.13" "$d/libnvrtc.so.12" "$d/libnvrtc.so") && break
done
[ -n "$nvrtc" ] && export TESSERA_NVRTC_LIB="$nvrtc"
libpath=""
for d in "${search[@]}"; do
    if first "$d/libcublas.so.13" "$d/libcublas.so.12" >/dev/null; then libpath="$d"; break; fi
done
ldconfig -p 2>/dev/null | grep -q 'libcuda.so.1 ' || libpath="$libpath:/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu"
export LD_LIBRARY_PATH="${libpath}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
say "NVRTC: ${TESSERA_NVRTC_LIB:-not found}; cuBLAS dir: ${libpath:-not found}"

# 4. The kernel tests (shared attention table, kv_store bytes, checksums, tags,
# dequantization, ops, GEMM), one thread so their device contexts do not overlap.
TESSERA_REQUIRE_CUDA=1 timeout 240 .gpu1/cuda_kernels --test-threads=1 --nocapture \
    >"$OUT/kernel_tests.log" 2>&1 || { rc=1; say "kernel tests FAILED (kernel_tests.log)"; }
grep -E '^test result|panicked' "$OUT/kernel_tests.log" | head -20

# 5. The model checks and benchmarks.
timeout 300 .gpu1/gpu_check --model "$model" --out "$OUT" >"$OUT/gpu_check.log" 2>&1 ||
    { rc=1; say "gpu_check FAILED or timed out (gpu_check.log)"; }

# 6. The table.
python3 - "$OUT/gpu_check.jsonl" <<'PY' | tee "$OUT/summary.txt"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()] if len(sys.argv) > 1 else []
for r in rows:
    c = r.get("check")
    ok = {True: "ok", False: "FAIL"}.get(r.get("ok"), "")
    if c == "device":
        print(f"device   {ok:4} {r.get('name')} {r.get('arch')} driver {r.get('driver_cuda_version')} "
              f"copy {r.get('copy_bandwidth_bytes_per_s', 0)/1e12:.2f} TB/s, weights {r.get('weight_bytes_bf16', 0)/1e6:.0f} MB, "
              f"pool at 0.9: {r.get('pool_tokens_at_fraction_0_9')} tokens {r.get('error', '')}")
    elif c == "greedy":
        d = r.get("divergence")
        print(f"greedy   {ok:4} {r['case']:22} {r['equal_tokens']}/{r['of']} equal"
              + (f", diverges at {d['at']} (margins cpu {d['cpu_margin']:.3f} gpu {d['gpu_margin']:.3f})" if d else "")
              + f", max top-logit diff {r['max_top_logit_diff_while_equal']:.3f}")
    elif c == "tag_mismatch":
        print(f"mismatch {ok:4} {r['fault']:12} failed {r['failed']} (victim {r['victim']}), others equal: {r['others_tokens_equal_clean_step']}")
    elif c == "decode":
        extra = f", floor {r['floor_step_ms_weights_over_copy_bandwidth']:.3f} ms/step" if "floor_step_ms_weights_over_copy_bandwidth" in r else ""
        print(f"decode   batch {r['batch']:3}: {r['tokens_per_s_checks_on']:9.0f} tok/s checks on, "
              f"{r['tokens_per_s_checks_off']:9.0f} off ({r['check_overhead_percent']:+.2f}%), "
              f"{r['step_ms_checks_on']:.3f} ms/step{extra}")
    elif c == "prefill":
        print(f"prefill  {r['tokens']:5} tokens: {r['tokens_per_s']:9.0f} tok/s ({r['median_s']*1e3:.1f} ms)")
    elif c in ("summary", "error"):
        print(f"{c:8} {ok:4} {r.get('error', '')}")
PY
[ "$rc" -eq 0 ] && grep -q '"check":"summary","ok":true' "$OUT/gpu_check.jsonl" || rc=1
echo "gpu_check: $([ "$rc" -eq 0 ] && echo PASS || echo FAIL)"
exit "$rc"
