#!/usr/bin/env python3
"""Greedy-decoding reference outputs from llama.cpp for Tessera's model tests.

Loads a GGUF with llama-cpp-python (PyPI `llama-cpp-python==0.3.36`, which builds
llama.cpp from source), and for a fixed set of prompts runs greedy decoding by hand:
evaluate the prompt tokens, then repeat N times: take the raw logits of the last
position, argmax, record the top-2 token ids and logits, evaluate that token.
llama.cpp's sampler is not used, so the recorded logits are the model's raw output.
Decoding always runs N steps: an end-of-sequence token (<|im_end|> = 2) does not stop
it; the positions where one was emitted are listed in the case's `eos_positions`.

Usage (from the repository root, with the model from `tessera model fetch`):

    python scripts/greedy_reference.py models/SmolLM2-135M-Instruct.Q4_1.gguf \
        -o backend/model/tests/data/greedy_reference.json

Run with a python that has llama-cpp-python installed (outside the repository, e.g.
/work/ext/venv/bin/python).
"""

import argparse
import hashlib
import json
import os
import sys

import numpy as np
import llama_cpp
from llama_cpp import Llama

RAW_PROMPTS = [
    ("raw_capital_france", "The capital of France is"),
    ("raw_fibonacci", "def fibonacci(n):"),
    ("raw_once_upon", "Once upon a time, in a small village"),
]

# Per architecture: the vocabulary size, the chat turn the model's own template
# renders for one user message (None: a base model, raw prompts only), and the
# end-of-turn token.
FAMILIES = {
    "llama": dict(
        vocab=49152,
        chat=(
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
            "<|im_end|>\n<|im_start|>user\n{msg}<|im_end|>\n<|im_start|>assistant\n"
        ),
        eos=2,  # <|im_end|>
    ),
    "qwen2": dict(
        vocab=151936,
        chat=(
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
            "assistant.<|im_end|>\n<|im_start|>user\n{msg}<|im_end|>\n<|im_start|>assistant\n"
        ),
        eos=151645,  # <|im_end|>
    ),
    "gemma3": dict(vocab=262144, chat=None, eos=1),  # base model: no template
}

CHAT_PROMPTS = [
    ("chat_capital_france", "What is the capital of France?"),
    ("chat_haiku_sea", "Write a haiku about the sea."),
    ("chat_primary_colors", "List three primary colors."),
]



def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def top2(logits):
    """Top-2 (id, logit) by descending logit, ties broken by the lower id (= argmax)."""
    # argmax returns the first maximal index; do the same for the runner-up.
    i1 = int(np.argmax(logits))
    rest = logits.copy()
    rest[i1] = -np.inf
    i2 = int(np.argmax(rest))
    return i1, float(logits[i1]), i2, float(logits[i2])


def run_case(llm, name, chat, text, n_out, add_bos, eos_id):
    prompt_ids = llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)
    llm.reset()
    llm.eval(prompt_ids)
    output_ids, records, eos_positions = [], [], []
    for step in range(n_out):
        # Raw logits of the last evaluated position (logits_all=True keeps every row).
        logits = np.array(llm.scores[llm.n_tokens - 1, :], dtype=np.float32)
        i1, l1, i2, l2 = top2(logits)
        output_ids.append(i1)
        records.append([i1, l1, i2, l2])
        if i1 == eos_id:
            eos_positions.append(step)
        llm.eval([i1])
    output_text = llm.detokenize(output_ids, special=True).decode("utf-8", errors="replace")
    return {
        "name": name,
        "chat": chat,
        "text": text,
        "prompt_ids": [int(t) for t in prompt_ids],
        "output_ids": output_ids,
        "top2": records,
        "output_text": output_text,
        "eos_positions": eos_positions,
        "min_top2_margin": min(r[1] - r[3] for r in records),
    }


def to_json(doc):
    """Indented JSON with each case field on one line (lists stay compact)."""
    lines = ["{"]
    top = [k for k in doc if k != "cases"]
    for k in top:
        lines.append(f" {json.dumps(k)}: {json.dumps(doc[k], ensure_ascii=False)},")
    lines.append(' "cases": [')
    for i, case in enumerate(doc["cases"]):
        lines.append("  {")
        items = list(case.items())
        for j, (k, v) in enumerate(items):
            comma = "," if j + 1 < len(items) else ""
            lines.append(f"   {json.dumps(k)}: {json.dumps(v, ensure_ascii=False)}{comma}")
        lines.append("  }" + ("," if i + 1 < len(doc["cases"]) else ""))
    lines.append(" ]")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    assert json.loads(text) == json.loads(json.dumps(doc))
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="path to SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("-o", "--out", default="backend/model/tests/data/greedy_reference.json")
    ap.add_argument("-n", "--n-out", type=int, default=32, help="tokens per case")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--lora", help="a LoRA adapter (GGUF) applied at scale 1, as `llama-server --lora`")
    args = ap.parse_args()

    sha = sha256_file(args.model)
    if args.lora:
        # llama.cpp 0.3.36 crashes (SIGSEGV at the first decode) with an adapter on
        # weights repacked for AMX ("lora ... cannot use buft 'AMX'"): load plain.
        default_params = llama_cpp.llama_model_default_params

        def plain_params():
            p = default_params()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama_model_default_params = plain_params
        llama_cpp.llama.llama_cpp.llama_model_default_params = plain_params
    llm = Llama(
        model_path=args.model,
        n_ctx=2048,
        n_batch=2048,
        n_ubatch=2048,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=True,
        seed=1234,
        verbose=False,
        **({"lora_path": args.lora, "lora_scale": 1.0} if args.lora else {}),
    )
    arch = llm.metadata["general.architecture"]
    fam = FAMILIES[arch]
    assert llm.n_vocab() == fam["vocab"], llm.n_vocab()
    # The file's own flag (Gemma: true), as Tessera's tokenizer applies it.
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token", "false") == "true"

    def all_cases(llm):
        cases = []
        for name, text in RAW_PROMPTS:
            cases.append(run_case(llm, name, False, text, args.n_out, add_bos, fam["eos"]))
        for name, msg in CHAT_PROMPTS if fam["chat"] else []:
            text = fam["chat"].format(msg=msg)
            case = run_case(llm, name, True, text, args.n_out, add_bos, fam["eos"])
            assert case["prompt_ids"][0] == llm.tokenize(b"<|im_start|>", add_bos=False, special=True)[0], \
                "special tokens were not parsed"
            cases.append(case)
        return cases

    cases = all_cases(llm)
    if args.lora:
        # The base model's output in the same settings, so a reader sees what the
        # adapter changed.
        base_llm = Llama(
            model_path=args.model, n_ctx=2048, n_batch=2048, n_ubatch=2048,
            n_threads=args.threads, n_threads_batch=args.threads, logits_all=True,
            seed=1234, verbose=False,
        )
        for c, b in zip(cases, all_cases(base_llm)):
            c["base_output_ids"] = b["output_ids"]

    for c in cases:
        print(
            f"{c['name']:22} prompt {len(c['prompt_ids']):3} tok  eos at {c['eos_positions']}"
            f"  min margin {c['min_top2_margin']:.4f}  {c['output_text']!r}",
            file=sys.stderr,
        )

    model_arg = os.path.relpath(args.model) if not os.path.isabs(args.model) else args.model
    command = ["python", "scripts/greedy_reference.py", model_arg, "-o", args.out]
    if args.n_out != 32:
        command += ["-n", str(args.n_out)]
    if args.threads != 2:
        command += ["--threads", str(args.threads)]
    if args.lora:
        command += ["--lora", os.path.relpath(args.lora) if not os.path.isabs(args.lora) else args.lora]
    doc = {
        "generator": (
            f"llama-cpp-python {llama_cpp.__version__} (llama.cpp) on "
            f"{os.path.basename(args.model)} sha256 {sha}"
        ),
        "command": " ".join(command)
        + f"  # python with llama-cpp-python=={llama_cpp.__version__}",
        "settings": {
            "n_ctx": 2048,
            "n_batch": 2048,
            "n_threads": args.threads,
            "kv_cache_type": "f16 (llama.cpp default)",
            "flash_attn": False,
            "add_bos": add_bos,
            "special": True,
            "decoding": "manual greedy argmax over raw logits (lowest id wins ties); "
            "prompt evaluated as one batch, then one token per step; "
            "never stops at EOS",
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        },
        "eos_id": fam["eos"],
        "lora": {"file": os.path.basename(args.lora), "sha256": sha256_file(args.lora)} if args.lora else None,
        "n_out": args.n_out,
        "cases": cases,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    tmp = args.out + ".partial"
    with open(tmp, "w") as f:
        f.write(to_json(doc))
    os.replace(tmp, args.out)
    print(f"wrote {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
