#!/usr/bin/env python3
"""Exact reference logits: the GGUF's weights dequantized and the llama forward
pass in float64 (numpy), along the token paths of a greedy reference file.

No activation quantization and no KV quantization: this is the arithmetic both
llama.cpp and Tessera approximate (see ../shared/BENCHMARKS.md, "For numerics").
For every case of the reference file (default backend/model/tests/data/
greedy_reference.json: llama.cpp's greedy tokens) the prompt and llama.cpp's
output tokens are run teacher-forced, and for each generated position the exact
top-8 token ids and logits are written.

Compare with an engine's logits along the same paths, e.g. Tessera's
(`cargo run --release -p tessera-model --example logits_along > ours.jsonl`):
    python3 scripts/exact_reference.py MODEL.gguf -o exact.json
    python3 scripts/exact_reference.py --compare exact.json ours.jsonl

Needs numpy and llama.cpp's gguf-py (PYTHONPATH=<llama.cpp>/gguf-py, or the PyPI
package `gguf`, which needs PyYAML).
"""
import argparse
import json
import sys

import numpy as np


def load(path, dtype=np.float64):
    """The model's config and weights, dequantized to `dtype` (the forward pass
    computes in the dtype of the weights)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    r = GGUFReader(path)

    def meta(key, default=None):
        f = r.fields.get(key)
        return default if f is None else f.parts[f.data[0]][0]

    t = {x.name: x for x in r.tensors}

    def w(name):
        x = t[name]
        a = dequantize(x.data, x.tensor_type).astype(dtype)
        return a.reshape([int(d) for d in reversed(x.shape)])

    arch = str(bytes(r.fields["general.architecture"].parts[-1]), "utf-8")
    if arch not in ("llama", "qwen2", "gemma3"):
        sys.exit(f"unsupported architecture {arch}")
    m = lambda k, default=None: meta(f"{arch}.{k}", default)
    d = int(m("embedding_length"))
    heads = int(m("attention.head_count"))
    cfg = dict(
        arch=arch,
        layers=int(m("block_count")),
        heads=heads,
        kv_heads=int(m("attention.head_count_kv", heads)),
        head_dim=int(m("attention.key_length", d // heads)),
        eps=float(m("attention.layer_norm_rms_epsilon", 1e-5)),
        base=float(m("rope.freq_base", 10000.0)),
        # Gemma 3: 5 of every 6 layers attend to the last `window` tokens with
        # RoPE base 10000 (llama.cpp set_swa_pattern(6), rope_freq_base_train_swa).
        window=int(m("attention.sliding_window")) if arch == "gemma3" else None,
    )
    emb = w("token_embd.weight")
    out = w("output.weight") if "output.weight" in t else emb
    names = ["attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
             "ffn_gate", "ffn_up", "ffn_down"]
    if arch == "gemma3":
        names += ["attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"]
    layers = []
    for i in range(cfg["layers"]):
        L = {k: w(f"blk.{i}.{k}.weight") for k in names}
        if arch == "qwen2":
            for k in ("attn_q", "attn_k", "attn_v"):
                L[k + ".bias"] = w(f"blk.{i}.{k}.bias")
        layers.append(L)
    return cfg, emb, out, w("output_norm.weight"), layers


def forward(model, tokens, act=None, qkv=None, probs=None):
    """Logits [len(tokens), vocab] of a causal pass over `tokens`, every
    activation in the weights' dtype (float64 or float32).

    Hooks to emulate an engine's rounding (scripts/perplexity.py --emulate):
    `act(x)` is applied to every matmul input, `qkv(q, k, v)` to the attention
    inputs after RoPE, `probs(p, v)` to one head's unnormalized probabilities
    [queries, keys] (its V [keys, hd] given) before the product with V, the
    sum staying that of the unrounded ones (as in kernels/src/flash.rs); by
    default none changes anything."""
    act = act or (lambda a: a)
    cfg, emb, out, out_norm, layers = model
    dt = emb.dtype
    n, d = len(tokens), emb.shape[1]
    nh, nkv, hd = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    gemma = cfg["arch"] == "gemma3"
    x = emb[tokens]
    if gemma:
        x = x * dt.type(np.sqrt(d))
    pos = np.arange(n)[:, None]

    def tables(base):
        inv = base ** (-2.0 * np.arange(hd // 2) / hd)
        return np.cos(pos * inv).astype(dt), np.sin(pos * inv).astype(dt)

    glob = tables(cfg["base"])
    local = tables(10000.0) if gemma else glob
    sqrt_hd = dt.type(np.sqrt(hd))

    def norm(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + cfg["eps"]) * g

    def rope(v, cs):  # [n, heads, hd]
        c, s = cs[0][:, None, :], cs[1][:, None, :]
        r = np.empty_like(v)
        if cfg["arch"] == "llama":  # GGML "normal" mode: adjacent pairs
            a, b = v[..., 0::2], v[..., 1::2]
            r[..., 0::2] = a * c - b * s
            r[..., 1::2] = a * s + b * c
        else:  # NEOX mode: (i, i + hd/2) pairs
            a, b = v[..., : hd // 2], v[..., hd // 2:]
            r[..., : hd // 2] = a * c - b * s
            r[..., hd // 2:] = a * s + b * c
        return r

    causal = np.triu(np.full((n, n), -np.inf, dtype=dt), 1)
    windowed = causal.copy()
    if cfg["window"]:
        # Key j is visible from query i when i - window < j <= i.
        windowed[np.tril(np.ones((n, n), dtype=bool), -cfg["window"])] = -np.inf
    for li, L in enumerate(layers):
        is_local = gemma and li % 6 < 5
        cs, mask = (local, windowed) if is_local else (glob, causal)
        h = act(norm(x, L["attn_norm"]))
        q, k, v = h @ L["attn_q"].T, h @ L["attn_k"].T, h @ L["attn_v"].T
        if "attn_q.bias" in L:
            q, k, v = q + L["attn_q.bias"], k + L["attn_k.bias"], v + L["attn_v.bias"]
        q, k, v = q.reshape(n, nh, hd), k.reshape(n, nkv, hd), v.reshape(n, nkv, hd)
        if gemma:
            q, k = norm(q, L["attn_q_norm"]), norm(k, L["attn_k_norm"])
        q, k = rope(q, cs), rope(k, cs)
        if qkv:
            q, k, v = qkv(q, k, v)
        g = nh // nkv
        att = np.empty((n, nh, hd), dtype=dt)
        for hh in range(nh):
            s = q[:, hh] @ k[:, hh // g].T / sqrt_hd + mask
            s = np.exp(s - s.max(-1, keepdims=True))
            if probs:
                att[:, hh] = (probs(s, v[:, hh // g]) @ v[:, hh // g]) / s.sum(-1, keepdims=True)
            else:
                att[:, hh] = (s / s.sum(-1, keepdims=True)) @ v[:, hh // g]
        a = act(att.reshape(n, nh * hd)) @ L["attn_output"].T
        x = x + (norm(a, L["post_attention_norm"]) if gemma else a)
        h = act(norm(x, L["ffn_norm"]))
        gate, up = h @ L["ffn_gate"].T, h @ L["ffn_up"].T
        if gemma:  # GELU, tanh approximation
            c = dt.type(np.sqrt(2.0 / np.pi))
            gate = 0.5 * gate * (1.0 + np.tanh(c * (gate + 0.044715 * gate ** 3)))
        else:  # SiLU
            gate = gate / (1 + np.exp(-gate))
        f = act(gate * up) @ L["ffn_down"].T
        x = x + (norm(f, L["post_ffw_norm"]) if gemma else f)
    logits = act(norm(x, out_norm)) @ out.T
    assert logits.dtype == dt, (logits.dtype, dt)
    return logits


def top(l, k=8):
    idx = np.argsort(-l)[:k]
    return [[int(i), float(l[i])] for i in idx]


def generate(args):
    model = load(args.model)
    ref = json.load(open(args.reference))
    cases = []
    for c in ref["cases"]:
        p, o = c["prompt_ids"], c["output_ids"]
        logits = forward(model, p + o)
        steps = [top(logits[len(p) - 1 + i]) for i in range(len(o))]
        cases.append({"name": c["name"], "top8": steps})
        print(c["name"], file=sys.stderr)
    json.dump({"command": " ".join(sys.argv), "cases": cases}, open(args.output, "w"))


def compare(args):
    """Per case: where llama.cpp's greedy path first differs from the exact argmax
    (and the exact top-2 margin there), and each engine's top-logit error."""
    exact = {c["name"]: c["top8"] for c in json.load(open(args.compare[0]))["cases"]}
    ref = {c["name"]: c for c in json.load(open(args.reference))["cases"]}
    ours = {}
    for line in open(args.compare[1]):
        r = json.loads(line)
        ours.setdefault(r["name"], []).append(r)
    print("| case | exact argmax = llama.cpp token until | exact margin there | "
          "llama.cpp max top-logit err | Tessera max top-logit err | Tessera argmax = exact until |")
    print("|---|---|---|---|---|---|")
    for name, steps in exact.items():
        c = ref[name]
        first = next((i for i, s in enumerate(steps) if s[0][0] != c["output_ids"][i]), None)
        margin = "" if first is None else f"{steps[first][0][1] - steps[first][1][1]:.3f}"
        upto = len(steps) if first is None else first
        # Errors on the steps where all three follow the same path.
        lerr = max((abs(c["top2"][i][1] - dict(map(tuple, steps[i]))[c["top2"][i][0]])
                    for i in range(upto) if c["top2"][i][0] in dict(map(tuple, steps[i]))),
                   default=0.0)
        o = ours.get(name, [])
        terr = max((abs(o[i]["logits_at"][str(steps[i][0][0])] - steps[i][0][1])
                    for i in range(min(upto, len(o)))), default=float("nan"))
        tfirst = next((i for i in range(min(len(o), len(steps)))
                       if o[i]["argmax"] != steps[i][0][0]), None)
        print(f"| {name} | {'all' if first is None else first} | {margin} | {lerr:.3f} | "
              f"{terr:.3f} | {'all' if tfirst is None else tfirst} |")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("-o", "--output", default="exact_reference.json")
    ap.add_argument("--reference", default="backend/model/tests/data/greedy_reference.json")
    ap.add_argument("--compare", nargs=2, metavar=("EXACT_JSON", "OURS_JSONL"))
    args = ap.parse_args()
    if args.compare:
        compare(args)
    else:
        generate(args)


if __name__ == "__main__":
    main()
