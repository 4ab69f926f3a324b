#!/usr/bin/env bash
# llama.cpp baseline on this machine for the default model (see docs BENCHMARKS.md):
#   - prefill tok/s for a 256-token prompt (one llama_decode of 256 tokens), and
#   - batch-1 decode tok/s (greedy, one token per llama_decode, continuing after
#     that prompt, i.e. at context positions 256..256+DECODE_TOKENS-1).
# Prints one JSON object per line on stdout, e.g.
#   {"system":"llama.cpp","metric":"prefill_tok_s","prompt_tokens":256,"value":482.9,...}
#   {"system":"llama.cpp","metric":"decode_tok_s","batch":1,"prompt_tokens":256,"value":...}
# Each value is the median over RUNS timed runs after one warm-up run. Run it on
# an otherwise idle machine: with THREADS=nproc, llama.cpp's OpenMP barriers
# collapse when another process takes a core (decode seen to drop from ~150 to
# ~18 tok/s during a concurrent build); each line records the 1-minute load
# average at the start ("load_1m_before") so such runs can be recognised.
#
# How llama.cpp is run: through llama-cpp-python 0.3.36's low-level bindings (the
# library the package builds from its vendored llama.cpp, -march=native, with
# the OpenMP thread pool). That build already exists for the greedy reference
# (scripts/greedy_reference.py), so nothing else is compiled. llama-bench would
# need a second CMake build of ggml + libllama from the same sdist (~15 min on 2
# cores) for numbers that equal these up to the few microseconds per step that
# the Python loop adds (measured in-process around llama_decode; the decode loop
# also reads the last row of logits and takes its argmax, as a greedy server does).
#
# Usage: scripts/bench_llamacpp.sh [MODEL.gguf]
#   MODEL          default: models/SmolLM2-135M-Instruct.Q4_1.gguf (`tessera model fetch`)
#   LLAMA_CPP_DIR  where the llama.cpp build lives, outside the repository
#                  (default /work/ext; its Python venv is $LLAMA_CPP_DIR/venv)
#   PYTHON         a python with llama_cpp importable (default $LLAMA_CPP_DIR/venv/bin/python);
#                  if it has no llama_cpp the venv is created and llama-cpp-python built:
#                  CMAKE_BUILD_PARALLEL_LEVEL=2 pip install llama-cpp-python==0.3.36
#                  (about 15 minutes on 2 cores; log in $LLAMA_CPP_DIR/llama_build.log)
#   THREADS        llama.cpp threads (default: nproc)
#   PROMPT_TOKENS  default 256;  DECODE_TOKENS default 128;  RUNS default 5
#   BATCH          sequences decoded together for the batched figure (default 16):
#                  one llama_decode per step carrying one token of each sequence
#                  (unified KV cache), which is what llama-server's continuous
#                  batching does with -np BATCH, minus its HTTP layer.
# Nothing is written inside the repository.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
MODEL=${1:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
LLAMA_CPP_DIR=${LLAMA_CPP_DIR:-/work/ext}
PYTHON=${PYTHON:-$LLAMA_CPP_DIR/venv/bin/python}
THREADS=${THREADS:-$(nproc)}
PROMPT_TOKENS=${PROMPT_TOKENS:-256}
DECODE_TOKENS=${DECODE_TOKENS:-128}
RUNS=${RUNS:-5}
BATCH=${BATCH:-16}
LLAMA_CPP_PYTHON_VERSION=0.3.36

if [ ! -f "$MODEL" ]; then
    echo "model $MODEL not found; run: cargo run --release -- model fetch" >&2
    exit 1
fi

if ! "$PYTHON" -c 'import llama_cpp' 2>/dev/null; then
    echo "no llama_cpp in $PYTHON: building llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
         "into $LLAMA_CPP_DIR/venv (about 15 min on 2 cores)" >&2
    mkdir -p "$LLAMA_CPP_DIR"
    [ -x "$LLAMA_CPP_DIR/venv/bin/python" ] || python3 -m venv "$LLAMA_CPP_DIR/venv"
    PYTHON=$LLAMA_CPP_DIR/venv/bin/python
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=ON} \
        "$PYTHON" -m pip install -v "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" \
        >"$LLAMA_CPP_DIR/llama_build.log" 2>&1 || {
            echo "build failed; see $LLAMA_CPP_DIR/llama_build.log" >&2; exit 1; }
fi

exec "$PYTHON" - "$MODEL" "$THREADS" "$PROMPT_TOKENS" "$DECODE_TOKENS" "$RUNS" "$BATCH" <<'PY'
import hashlib, json, os, statistics, sys, time

import numpy as np
import llama_cpp
from llama_cpp import Llama

model, threads, n_prompt, n_decode, runs, n_batch_seq = sys.argv[1], *map(int, sys.argv[2:7])

h = hashlib.sha256()
with open(model, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
sha = h.hexdigest()

llm = Llama(model_path=model, n_ctx=max(2048, n_prompt + n_decode + 8),
            n_batch=max(512, n_prompt), n_ubatch=max(512, n_prompt),
            n_threads=threads, n_threads_batch=threads, logits_all=False, verbose=False)
n_vocab = llm.n_vocab()

# A fixed, ordinary-text prompt of exactly n_prompt tokens.
text = ("The history of the city begins with a small settlement on the river, where "
        "farmers and traders met every week to exchange grain, wool and news. ") * (64 + n_prompt // 16)
prompt = llm.tokenize(text.encode(), add_bos=False, special=False)[:n_prompt]
assert len(prompt) == n_prompt, len(prompt)

def last_logits():
    ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
    return np.ctypeslib.as_array(ptr, shape=(n_vocab,))

def prefill():
    llm.reset()                     # next eval clears the KV cache from position 0
    t0 = time.perf_counter()
    llm.eval(prompt)                # one llama_decode of n_prompt tokens
    return time.perf_counter() - t0

def decode():
    prefill()
    tok = int(np.argmax(last_logits()))
    t0 = time.perf_counter()
    for _ in range(n_decode):
        llm.eval([tok])
        tok = int(np.argmax(last_logits()))
    return time.perf_counter() - t0

def emit(obj):
    print(json.dumps(obj, separators=(",", ":")), flush=True)

load_before = os.getloadavg()[0]
if load_before > 0.5:
    print(f"warning: load average {load_before:.2f} before the run: other processes compete "
          "for the cores (llama.cpp's OpenMP threads suffer badly when oversubscribed)",
          file=sys.stderr)
common = {"load_1m_before": round(load_before, 2), "model": model.rsplit("/", 1)[-1], "model_sha256": sha, "threads": threads,
          "runs": runs, "llama_cpp_python": llama_cpp.__version__}

prefill()  # warm-up
p = statistics.median(prefill() for _ in range(runs))
emit({"system": "llama.cpp", "metric": "prefill_tok_s",
                  "prompt_tokens": n_prompt, "value": round(n_prompt / p, 1),
                  "seconds": round(p, 5), **common})

decode()  # warm-up
d = statistics.median(decode() for _ in range(runs))
emit({"system": "llama.cpp", "metric": "decode_tok_s", "batch": 1,
                  "prompt_tokens": n_prompt, "decode_tokens": n_decode,
                  "value": round(n_decode / d, 1), "ms_per_token": round(1000 * d / n_decode, 3),
                  **common})

# Batched decode: n_batch_seq sequences with 16-token prompts, then n_decode steps
# of one llama_decode holding one greedy token per sequence.
cp = llama_cpp.llama_context_default_params()
cp.n_ctx = n_batch_seq * (16 + n_decode + 8)
cp.n_batch = cp.n_ubatch = max(512, n_batch_seq * 16)
cp.n_seq_max = n_batch_seq
cp.kv_unified = True
cp.n_threads = cp.n_threads_batch = threads
ctx = llama_cpp.llama_init_from_model(llm._model.model, cp)
batch = llama_cpp.llama_batch_init(n_batch_seq * 16, 0, n_batch_seq)
def fill(items):  # items: (token, pos, seq, want_logits)
    batch.n_tokens = len(items)
    for i, (t, p, s, l) in enumerate(items):
        batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, p, 1
        batch.seq_id[i][0], batch.logits[i] = s, int(l)
def batched():
    llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
    items = []
    for s in range(n_batch_seq):
        ids = llm.tokenize(f"Story {s}: the lighthouse keeper counted ships.".encode(), add_bos=False)[:16]
        ids = (ids * 16)[:16]
        items += [(t, p, s, p == 15) for p, t in enumerate(ids)]
    fill(items)
    assert llama_cpp.llama_decode(ctx, batch) == 0
    def argmax_all():
        out = []
        for i in range(n_batch_seq):
            ptr = llama_cpp.llama_get_logits_ith(ctx, i)
            out.append(int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,)))))
        return out
    toks = []
    for s in range(n_batch_seq):
        ptr = llama_cpp.llama_get_logits_ith(ctx, s * 16 + 15)
        toks.append(int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,)))))
    t0 = time.perf_counter()
    for step in range(n_decode):
        fill([(toks[s], 16 + step, s, True) for s in range(n_batch_seq)])
        assert llama_cpp.llama_decode(ctx, batch) == 0
        toks = argmax_all()
    return time.perf_counter() - t0
batched()  # warm-up
b = statistics.median(batched() for _ in range(runs))
emit({"system": "llama.cpp", "metric": "decode_tok_s", "batch": n_batch_seq,
      "prompt_tokens": 16, "decode_tokens": n_decode,
      "value": round(n_batch_seq * n_decode / b, 1), **common})
PY
