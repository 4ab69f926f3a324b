#!/usr/bin/env python3
"""Perplexity of a fixed text through Tessera, llama.cpp and an f32 reference.

The text is scripts/data/tinyshakespeare-4k.txt (public domain; source in
scripts/data/README.md) and its token ids, llama.cpp's tokenization of it (no BOS:
the model's `tokenizer.ggml.add_bos_token` is false), are in
scripts/data/tinyshakespeare-4k.ids.json. Every mode scores exactly those ids.

Two scoring conventions; every mode reports both (NLL in nats, perplexity =
exp(mean NLL), the log-softmax taken over each engine's own logits):
  window      the whole text in one context window: every token after the first,
              conditioned on all the tokens before it (T - 1 tokens scored). This
              is what `echo` + `logprobs` on POST /v1/completions returns.
  chunks2048  llama-perplexity's default with `-c 2048`: the first 2 x 2048 ids cut
              into 2 chunks of 2048, each evaluated from an empty KV cache, and in
              each chunk the tokens at positions 1025..2047 scored (conditioned on
              the chunk's tokens before them): 2 x 1023 tokens. llama-perplexity
              needs at least 2 x n_ctx tokens, so it cannot score one window.

Modes (run from the repository root):
  ids        python with llama_cpp: tokenize the text with llama.cpp the way
             llama-perplexity does (add_special=true, parse_special=false) and
             write the ids file with each token's text.
  llama      python with llama_cpp: llama.cpp through libllama (llama-cpp-python's
             low-level bindings; llama-perplexity's context settings: n_batch 2048,
             n_ubatch 512, f16 KV cache, flash attention auto), logits of every
             position. With --llama-perplexity BIN it also runs that binary
             (`-c 2048 -b 2048`) on the text and records its final estimate.
  reference  python with numpy and gguf-py: the GGUF's weights dequantized and
             the forward pass of scripts/exact_reference.py with float32
             activations (--dtype float64 for the exact one). --emulate rounds
             like an engine (8-bit matmul inputs, 8-bit or f16 attention inputs)
             to attribute an engine's distance; it is then no reference.
  tessera    standard library only: POST URL/v1/completions with the text (for
             chunks2048, each chunk's text), `echo: true`, `logprobs: 0`,
             `max_tokens: 1`; checks that the returned prompt tokens are the ids'
             tokens and `usage.prompt_tokens` their count.
  compare    a markdown table from the JSON files the modes wrote (--out).

Each mode prints one JSON line per convention ({"system", "convention", "ppl",
"mean_nll", "tokens"}) and writes the per-token NLLs to --out for `compare`.

The llama-perplexity binary, from the same build as the Python bindings: install
llama-cpp-python keeping its CMake tree (scikit-build-core, cmake and ninja in the
venv), `CMAKE_ARGS=-DGGML_NATIVE=ON pip install --no-build-isolation
-C build-dir=$D/build llama-cpp-python==0.3.36`; the tree refers to pip's
temporary copy of the sdist (/tmp/pip-req-build-*, named in the build log), which
pip deletes: unpack the sdist there again (`tar --strip-components=1`; tar keeps
the mtimes, so nothing rebuilds), then `cmake -DLLAMA_BUILD_TOOLS=ON
-DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAVA_BUILD=OFF $D/build &&
ninja -C $D/build llama-perplexity` (four steps: it links the existing libllama).

Usage (what docs/benchmarks.md ran; llama.cpp as in scripts/bench_llamacpp.sh):
  PY=/work/ext/venv/bin/python   # llama-cpp-python==0.3.36, numpy
  M=models/SmolLM2-135M-Instruct.Q4_1.gguf
  $PY scripts/perplexity.py ids --model $M            # only to regenerate the ids file
  $PY scripts/perplexity.py llama --threads 2 --out target/ppl/llama.json \\
      --llama-perplexity /work/ext/build/bin/llama-perplexity
  PYTHONPATH=<llama.cpp>/gguf-py $PY scripts/perplexity.py reference --model $M \\
      --out target/ppl/f32.json
  PYTHONPATH=<llama.cpp>/gguf-py $PY scripts/perplexity.py reference --model $M \\
      --dtype float64 --out target/ppl/f64.json
  python3 scripts/perplexity.py tessera --url http://127.0.0.1:8787 --key $KEY \\
      --out target/ppl/tessera.json
  python3 scripts/perplexity.py compare --reference target/ppl/f32.json \\
      target/ppl/tessera.json target/ppl/llama.json target/ppl/f64.json
"""
import argparse
import json
import math
import os
import re
import subprocess
import sys
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
TEXT = os.path.join(HERE, "data", "tinyshakespeare-4k.txt")
IDS = os.path.join(HERE, "data", "tinyshakespeare-4k.ids.json")
MODEL = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
CHUNK = 2048  # llama-perplexity -c


def read_ids(path):
    doc = json.load(open(path))
    ids, pieces = doc["ids"], doc["pieces"]
    assert len(ids) == len(pieces)
    return ids, pieces


def windows(n):
    """(convention, [(start, end, first scored nll index)]): nll index j of a
    window is token start+j+1 given tokens start..start+j."""
    if n < 2 * CHUNK:  # llama-perplexity -c CHUNK needs 2 x CHUNK tokens
        return [("window", [(0, n, 0)])]
    return [("window", [(0, n, 0)]),
            (f"chunks{CHUNK}", [(k * CHUNK, (k + 1) * CHUNK, CHUNK // 2)
                                for k in range(n // CHUNK)])]


def nll_of_logits(logits, targets):
    """-log softmax(row)[target] per row, in float64."""
    import numpy as np

    out = np.empty(len(targets))
    for a in range(0, len(targets), 256):
        t = np.asarray(targets[a:a + 256])
        x = np.asarray(logits[a:a + len(t)], dtype=np.float64)
        m = x.max(-1, keepdims=True)
        lse = (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))[:, 0]
        out[a:a + len(t)] = lse - x[np.arange(len(t)), t]
    return out


def score(system, ids, window_nll, detail):
    """Runs `window_nll(start, end) -> per-token NLLs of ids[start:end]` for each
    convention; prints and returns the results."""
    results, per_token = {}, {}
    for conv, wins in windows(len(ids)):
        nll = []
        for start, end, first in wins:
            w = [float(v) for v in window_nll(start, end)]
            assert len(w) == end - start - 1
            nll += w[first:]
        mean = math.fsum(nll) / len(nll)
        results[conv] = {"ppl": math.exp(mean), "mean_nll": mean, "tokens": len(nll)}
        per_token[conv] = nll
        print(json.dumps({"system": system, "convention": conv, **results[conv]}), flush=True)
    return {"system": system, "detail": detail, "results": results, "nll": per_token}


def write(args, doc):
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        json.dump(doc, open(args.out, "w"))


def load_llama(args):
    import llama_cpp
    from llama_cpp import Llama

    llm = Llama(model_path=args.model, n_ctx=512, vocab_only=True, verbose=False)
    return llama_cpp, llm


def llama_tokenize(llm, text):
    # llama-perplexity: common_tokenize(ctx, text, add_special=true, parse_special=false)
    return llm.tokenize(text.encode("utf-8"), add_bos=True, special=False)


def mode_ids(args):
    llama_cpp, llm = load_llama(args)
    text = open(args.text, encoding="utf-8").read()
    ids = llama_tokenize(llm, text)
    # A vocabulary that adds BOS (Gemma) starts with it: its piece is empty, it is
    # never scored, and Tessera adds it to the prompt text itself.
    bos = ids[0] == llm.token_bos()
    pieces = [""] * bos + [llm.detokenize([i]).decode("utf-8") for i in ids[bos:]]
    assert "".join(pieces) == text, "token texts do not concatenate to the text"
    doc = {"tokenizer": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}), "
                        f"add_special=true ({'BOS first' if bos else 'no BOS for this vocab'}), "
                        "parse_special=false",
           "model": os.path.basename(args.model), "text": os.path.basename(args.text),
           "bos": bos, "ids": ids, "pieces": pieces}
    with open(args.ids, "w") as f:  # one field a line
        f.write("{\n" + ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items())
                + "\n}\n")
    assert json.load(open(args.ids)) == doc
    print(f"{len(ids)} tokens -> {args.ids}", file=sys.stderr)


def mode_llama(args):
    import numpy as np

    llama_cpp, _ = load_llama(args)
    ids, _ = read_ids(args.ids)
    text = open(args.text, encoding="utf-8").read()
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(args.model.encode(), mp)
    vocab = llama_cpp.llama_model_get_vocab(model)
    buf = (llama_cpp.llama_token * (len(text) + 16))()
    n = llama_cpp.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, len(buf), True, False)
    assert list(buf[:n]) == ids, "llama.cpp's tokenization differs from the ids file"
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    contexts = {}

    def context(n_ctx):  # llama-perplexity's: common_params defaults, n_batch = min(2048, n_ctx)
        if n_ctx not in contexts:
            cp = llama_cpp.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, min(2048, n_ctx), 512
            cp.n_seq_max = 1
            cp.n_threads = cp.n_threads_batch = args.threads
            contexts[n_ctx] = (llama_cpp.llama_init_from_model(model, cp), cp.n_batch)
        return contexts[n_ctx]

    def window_nll(start, end):
        ctx, n_batch = context(max(CHUNK, end - start))
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)
        w = ids[start:end]
        batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        rows = []
        for a in range(0, len(w), n_batch):
            m = min(n_batch, len(w) - a)
            batch.n_tokens = m
            for k in range(m):
                batch.token[k], batch.pos[k], batch.n_seq_id[k] = w[a + k], a + k, 1
                batch.seq_id[k][0], batch.logits[k] = 0, 1
            assert llama_cpp.llama_decode(ctx, batch) == 0
            logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(m, n_vocab))
            rows.append(nll_of_logits(logits, w[a + 1:a + m + 1]))
        llama_cpp.llama_batch_free(batch)
        return np.concatenate(rows)[:len(w) - 1]

    detail = {"llama_cpp_python": llama_cpp.__version__, "threads": args.threads,
              "n_batch": 2048, "n_ubatch": 512, "kv_cache": "f16 (default)",
              "flash_attn_type": int(getattr(llama_cpp.llama_context_default_params(),
                                             "flash_attn_type", -1)),
              "system_info": llama_cpp.llama_print_system_info().decode().strip()}
    doc = score("llama.cpp", ids, window_nll, detail)
    if args.llama_perplexity:
        cmd = [args.llama_perplexity, "-m", args.model, "-f", args.text, "-c", str(CHUNK),
               "-b", str(CHUNK), "-t", str(args.threads)]
        p = subprocess.run(cmd, capture_output=True, text=True)
        log = p.stdout + p.stderr
        m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", log)
        assert p.returncode == 0 and m, log[-3000:]
        toks = re.search(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)", log)
        r = {"ppl": float(m.group(1)), "plus_minus": float(m.group(2)),
             "chunks": int(toks.group(1)), "command": " ".join(cmd)}
        doc["llama_perplexity"] = r
        print(json.dumps({"system": "llama-perplexity", "convention": f"chunks{CHUNK}", **r}),
              flush=True)
    write(args, doc)


def mode_reference(args):
    import numpy as np

    sys.path.insert(0, HERE)
    import exact_reference

    ids, _ = read_ids(args.ids)
    dtype = np.dtype(args.dtype)
    model = exact_reference.load(args.model, dtype)

    def q8(x, block):
        """Symmetric 8-bit per `block` trailing values (scale max|x| / 127, round
        half away from zero), dequantized."""
        b = x.reshape(-1, block)
        d = np.abs(b).max(-1, keepdims=True) / 127
        q = b / np.where(d > 0, d, 1)
        return (np.sign(q) * np.floor(np.abs(q) + 0.5) * d).reshape(x.shape).astype(x.dtype)

    def pq(p, v, levels):
        """kernels/src/flash.rs's probability weights: `w = p * dv` per key (`dv`
        the key's 8-bit V scale), rounded per 16-key page to `levels` steps of
        the page's largest `w`; returned as the `p` they stand for."""
        n, m = p.shape
        dv = np.abs(v).max(-1) / 127
        dv = np.where(dv > 0, dv, 1).astype(p.dtype)
        pad = (-m) % 16
        w = np.pad(p * dv[None, :], ((0, 0), (0, pad))).reshape(n, -1, 16)
        top = w.max(-1, keepdims=True)
        u = np.floor(w / np.where(top > 0, top, 1) * levels + 0.5)
        return ((u * top / levels).reshape(n, -1)[:, :m] / dv[None, :]).astype(p.dtype)

    def f16(x):
        return x.astype(np.float16).astype(x.dtype)

    hooks = {
        "none": {},
        # Both engines: matmul inputs as 8-bit blocks of 32 (llama.cpp q8_0/q8_1
        # with f16 scales, Tessera with f32 scales).
        "act8": {"act": lambda a: q8(a, 32)},
        # + Tessera's attention inputs: K, V 8-bit per token and KV head, Q 8-bit
        # per token and head (kernels/src/flash.rs; its 16-bit probabilities not emulated).
        "act8+kv8": {"act": lambda a: q8(a, 32),
                     "qkv": lambda q, k, v: (q8(q, q.shape[-1]), q8(k, k.shape[-1]),
                                             q8(v, v.shape[-1]))},
        # + llama.cpp's: f16 KV cache, Q converted to f16 in its CPU flash
        # attention (its f16 V accumulation not emulated).
        "act8+kv16": {"act": lambda a: q8(a, 32),
                      "qkv": lambda q, k, v: (f16(q), f16(k), f16(v))},
        # Which half of Tessera's rounding matters: 16-bit queries with 8-bit K/V,
        # and 8-bit queries with 16-bit K/V.
        "act8+q16kv8": {"act": lambda a: q8(a, 32),
                        "qkv": lambda q, k, v: (f16(q), q8(k, k.shape[-1]), q8(v, v.shape[-1]))},
        "act8+q8kv16": {"act": lambda a: q8(a, 32),
                        "qkv": lambda q, k, v: (q8(q, q.shape[-1]), f16(k), f16(v))},
        "act8+k8": {"act": lambda a: q8(a, 32),
                    "qkv": lambda q, k, v: (q, q8(k, k.shape[-1]), v)},
        "act8+v8": {"act": lambda a: q8(a, 32),
                    "qkv": lambda q, k, v: (q, k, q8(v, v.shape[-1]))},
        "act8+kv8b32": {"act": lambda a: q8(a, 32),
                        "qkv": lambda q, k, v: (q8(q, q.shape[-1]), q8(k, 32), q8(v, 32))},
        "act8+qkv8b32": {"act": lambda a: q8(a, 32),
                         "qkv": lambda q, k, v: (q8(q, 32), q8(k, 32), q8(v, v.shape[-1]))},
        "act8+q16k8b32": {"act": lambda a: q8(a, 32),
                          "qkv": lambda q, k, v: (f16(q), q8(k, 32), q8(v, v.shape[-1]))},
        # + the probability weights of P.V rounded as the kernel does: 16 bits
        # (today's) or 8 bits (half the P.V instructions; not adopted: see
        # docs/benchmarks.md, 2026-12-04).
        "act8+v8p16": {"act": lambda a: q8(a, 32),
                       "qkv": lambda q, k, v: (q, k, q8(v, v.shape[-1])),
                       "probs": lambda p, v: pq(p, v, 65535.0)},
        "act8+v8p8": {"act": lambda a: q8(a, 32),
                      "qkv": lambda q, k, v: (q, k, q8(v, v.shape[-1])),
                      "probs": lambda p, v: pq(p, v, 255.0)},
    }[args.emulate]

    def window_nll(start, end):
        w = ids[start:end]
        logits = exact_reference.forward(model, w, **hooks)
        assert logits.dtype == dtype
        return nll_of_logits(logits[:-1], w[1:])

    system = {"float32": "f32 reference", "float64": "f64 reference"}[args.dtype]
    if args.emulate != "none":
        system += f", emulating {args.emulate}"
    doc = score(system, ids, window_nll,
                {"dtype": args.dtype, "numpy": np.__version__, "emulate": args.emulate,
                 "forward": "scripts/exact_reference.py (weights dequantized with gguf-py)"})
    write(args, doc)


def mode_tessera(args):
    ids, pieces = read_ids(args.ids)
    text = open(args.text, encoding="utf-8").read()
    assert "".join(pieces) == text

    def window_nll(start, end):
        body = {"model": args.model_id, "prompt": "".join(pieces[start:end]), "max_tokens": 1,
                "temperature": 0, "echo": True, "logprobs": 0}
        req = urllib.request.Request(args.url.rstrip("/") + "/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              "Authorization": f"Bearer {args.key}"})
        with urllib.request.urlopen(req, timeout=600) as r:
            resp = json.load(r)
        n = end - start
        lp = resp["choices"][0]["logprobs"]
        assert resp["usage"]["prompt_tokens"] == n, (resp["usage"], n)
        skip = 1 if start == 0 and pieces[0] == "" else 0  # BOS: its text is Tessera's
        assert lp["tokens"][skip:n] == pieces[start + skip:end], \
            "Tessera tokenized the text differently"
        assert lp["token_logprobs"][0] is None
        lps = lp["token_logprobs"][1:n]
        assert all(isinstance(v, float) and v > -9999.0 for v in lps)
        return [-v for v in lps]

    doc = score("Tessera", ids, window_nll, {"url": args.url, "model": args.model_id})
    write(args, doc)


def mode_compare(args):
    ref = json.load(open(args.reference))
    docs = [ref] + [json.load(open(p)) for p in args.files]
    convs = list(ref["results"])
    head = "| system | " + " | ".join(
        f"{c} ppl | {c} \\|ppl - f32\\| | {c} RMS per-token ΔNLL" for c in convs) + " |"
    print(head)
    print("|---" * (1 + 3 * len(convs)) + "|")
    dist = {}
    for d in docs:
        cells = []
        for c in convs:
            r, base = d["results"][c], ref["results"][c]
            a, b = d["nll"][c], ref["nll"][c]
            assert len(a) == len(b)
            rms = math.sqrt(math.fsum((x - y) ** 2 for x, y in zip(a, b)) / len(a))
            dist[(d["system"], c)] = abs(r["ppl"] - base["ppl"])
            cells += [f"{r['ppl']:.4f}", f"{abs(r['ppl'] - base['ppl']):.4f}", f"{rms:.4f}"]
        print(f"| {d['system']} | " + " | ".join(cells) + " |")
        if "llama_perplexity" in d:
            lp = d["llama_perplexity"]
            cells = []
            for c in convs:
                if c == f"chunks{CHUNK}":
                    cells += [f"{lp['ppl']:.4f} ± {lp['plus_minus']:.4f}",
                              f"{abs(lp['ppl'] - ref['results'][c]['ppl']):.4f}", ""]
                else:
                    cells += ["(cannot: needs 2 x n_ctx tokens)", "", ""]
            print("| llama-perplexity binary | " + " | ".join(cells) + " |")
    for c in convs:
        t, l = dist.get(("Tessera", c)), dist.get(("llama.cpp", c))
        if t is not None and l:
            print(f"\n{c}: Tessera distance / llama.cpp distance = {t / l:.3f} "
                  f"({'<=' if t <= l else '>'} 1)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    modes = {"ids": mode_ids, "llama": mode_llama, "reference": mode_reference,
             "tessera": mode_tessera, "compare": mode_compare}
    for name in modes:
        p = sub.add_parser(name)
        if name == "compare":
            p.add_argument("--reference", required=True, help="the f32 reference's --out file")
            p.add_argument("files", nargs="*")
            continue
        p.add_argument("--text", default=TEXT)
        p.add_argument("--ids", default=IDS)
        p.add_argument("--out", help="write results and per-token NLLs (JSON) here")
        if name in ("ids", "llama", "reference"):
            p.add_argument("--model", default=MODEL)
        if name == "llama":
            p.add_argument("--threads", type=int, default=os.cpu_count())
            p.add_argument("--llama-perplexity", metavar="BIN",
                           help="also run this llama-perplexity binary (-c 2048)")
        if name == "reference":
            p.add_argument("--dtype", choices=["float32", "float64"], default="float32")
            p.add_argument("--emulate", choices=["none", "act8", "act8+kv8", "act8+kv16", "act8+q16kv8",
                                                 "act8+q8kv16", "act8+k8", "act8+v8", "act8+kv8b32",
                                                 "act8+qkv8b32", "act8+q16k8b32", "act8+v8p16", "act8+v8p8"],
                           default="none", help="round like an engine (to attribute its "
                           "distance; not part of the reference)")
        if name == "tessera":
            p.add_argument("--url", default="http://127.0.0.1:8787")
            p.add_argument("--key", required=True, help="an API key (tsk_...)")
            p.add_argument("--model-id", default="@cf/huggingfacetb/smollm2-135m-instruct")
    args = ap.parse_args()
    modes[args.mode](args)


if __name__ == "__main__":
    main()
