#!/usr/bin/env python3
"""Writes LoRA adapters for a base GGUF model with llama.cpp's `gguf` package, in
the form llama.cpp's convert_lora_to_gguf.py writes and `llama-server --lora`
reads: `general.type = adapter`, `adapter.type = lora`, `adapter.lora.alpha`, and
per adapted weight W (GGUF shape ne = [in, out]) the pair W.lora_a (ne = [in, rank])
and W.lora_b (ne = [rank, out]). gguf-py writes a numpy array's last axis as ne0,
so the arrays are shaped (rank, in) and (out, rank).

    make_lora.py BASE.gguf OUT.gguf [--kind random|bias-token|...] [--rank R]
                 [--alpha A] [--targets attn_q,attn_v] [--layers 0,1] [--seed S]
                 [--token ID] [--dtype f32|f16]

Kinds:
  random         small random A and B on --targets of --layers (changes logits a
                 little; output usually unchanged at temperature 0).
  bias-token     a structured rank-1 adapter on the last layer's ffn_down whose B
                 pushes the residual stream along the output-embedding row of
                 --token, by --scale times A x (whose sign depends on the position:
                 --sign -1 flips it), so greedy outputs change (towards that token
                 only where A x is positive).
  Deliberately invalid files (the upload must refuse them by name):
  wrong-arch     general.architecture is not the base's.
  wrong-shape    lora_a's input size is one less than the base weight's.
  untransposed   lora_a stored as (in, rank) instead of (rank, in).
  rank-too-big   rank 65 (> 64).
  half-pair      lora_b missing.
  not-adapter    general.type = model.
"""
import argparse
import sys

import numpy as np
import gguf


def base_info(path):
    r = gguf.GGUFReader(path)
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    shapes = {t.name: [int(x) for x in t.shape] for t in r.tensors}  # ne order
    return r, arch, shapes


def token_row(reader, token):
    """The output-embedding row of `token` as f32 (the tied embedding when the
    file has no output.weight)."""
    names = {t.name: t for t in reader.tensors}
    t = names.get("output.weight") or names["token_embd.weight"]
    data = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(data, dtype=np.float32).reshape(-1, int(t.shape[0]))[token]


def main():
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Kinds:"):],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("base")
    ap.add_argument("out")
    ap.add_argument("--kind", default="random")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=16.0)
    ap.add_argument("--targets", default="attn_q,attn_v")
    ap.add_argument("--layers", default="")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--token", type=int, default=0)
    ap.add_argument("--scale", type=float, default=0.02)
    ap.add_argument("--sign", type=float, default=1.0,
                    help="bias-token: multiplies B (which way A x pushes depends on the model)")
    ap.add_argument("--dtype", default="f32", choices=["f32", "f16"])
    a = ap.parse_args()

    reader, arch, shapes = base_info(a.base)
    n_layers = 1 + max(int(n.split(".")[1]) for n in shapes if n.startswith("blk."))
    layers = [int(x) for x in a.layers.split(",")] if a.layers else list(range(n_layers))
    rng = np.random.default_rng(a.seed)
    dtype = np.float16 if a.dtype == "f16" else np.float32
    rank = 65 if a.kind == "rank-too-big" else a.rank

    tensors = {}
    if a.kind == "bias-token":
        # h += B (A x) with A = a unit direction of the MLP input and B = the
        # token's output row: every position's residual moves towards the token.
        name = f"blk.{n_layers - 1}.ffn_down.weight"
        n_in, n_out = shapes[name]
        row = token_row(reader, a.token)
        A = np.zeros((1, n_in), np.float32)
        A[0] = rng.standard_normal(n_in)
        A /= np.linalg.norm(A)
        B = (row / np.linalg.norm(row)).reshape(n_out, 1) * a.scale * a.sign
        tensors[name] = (A, B)
    else:
        for layer in layers:
            for t in a.targets.split(","):
                name = f"blk.{layer}.{t}.weight"
                n_in, n_out = shapes[name]
                if a.kind == "wrong-shape":
                    n_in -= 1
                A = rng.standard_normal((rank, n_in)).astype(np.float32) * a.scale
                B = rng.standard_normal((n_out, rank)).astype(np.float32) * a.scale
                if a.kind == "untransposed":
                    A = np.ascontiguousarray(A.T)
                tensors[name] = (A, B)

    w = gguf.GGUFWriter(a.out, "gpt2" if a.kind == "wrong-arch" else arch)
    w.add_type(gguf.GGUFType.MODEL if a.kind == "not-adapter" else gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, a.alpha)
    for name, (A, B) in tensors.items():
        w.add_tensor(f"{name}.lora_a", A.astype(dtype))
        if a.kind != "half-pair":
            w.add_tensor(f"{name}.lora_b", B.astype(dtype))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ranks = sorted({A.shape[0] for A, _ in tensors.values()})
    print(f"{a.out}: {a.kind}, {len(tensors)} pairs, rank {ranks}", file=sys.stderr)


if __name__ == "__main__":
    main()
