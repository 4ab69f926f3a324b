#!/usr/bin/env bash
# Prepares what scripts/gpu_check.sh needs on a lent GPU machine (docs/benchmarks.md,
# "CUDA backend"), here, where cargo and the model are: the gpu_check program and
# the CUDA kernel tests built with --features cuda and stripped, and the model file
# in two halves (one call carries at most 64 MiB) with its sha256.
#
#   scripts/gpu_pack.sh       # -> .gpu1/ (binaries, first half, sha256), .gpu2/ (second half)
#
# .gpu1/ and .gpu2/ are added to .git/info/exclude (they are build outputs, never
# committed); the device tool's `carry` takes ignored paths only.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
for d in /.gpu1/ /.gpu2/; do
    grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >>.git/info/exclude
done
model=${TESSERA_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$model" ] || { echo "gpu_pack: $model missing: run \`cargo run --release -- model fetch\`" >&2; exit 1; }
rm -rf .gpu1 .gpu2
mkdir -p .gpu1 .gpu2
nice -n 19 cargo build --release -p tessera-model --features cuda --example gpu_check
cp target/release/examples/gpu_check .gpu1/gpu_check
exe=$(nice -n 19 cargo test --release -p tessera-kernels --features cuda --test cuda_kernels \
    --no-run --message-format=json |
    python3 -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "cuda_kernels":
        print(m["executable"])')
cp "$exe" .gpu1/cuda_kernels
strip .gpu1/gpu_check .gpu1/cuda_kernels
size=$(stat -c %s "$model")
half=$(( (size + 1) / 2 ))
head -c "$half" "$model" >.gpu1/model.part1
tail -c +"$(( half + 1 ))" "$model" >.gpu2/model.part2
sha256sum <"$model" | cut -d' ' -f1 >.gpu1/model.sha256
git rev-parse HEAD >.gpu1/commit
du -sh .gpu1 .gpu2
echo "gpu_pack: ready; see docs/benchmarks.md (CUDA backend) for the two device calls"
