#!/usr/bin/env python3
"""Write llama.cpp's token ids for raw prompts in the model's chat format.

The gateway's raw prompts (Workers AI `raw: true`, OpenAI `/v1/completions`) must
parse control tokens as llama.cpp's server does; gateway/tests/parity.rs compares
our tokenizer's ids and the served prompt token counts with the file written here.

Usage (a llama.cpp `llama-server` binary; it is started here on a free local port):
    python3 scripts/raw_prompt_reference.py LLAMA_SERVER MODEL.gguf gateway/tests/data/raw_prompt_reference.json
"""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

CASES = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>system\nAnswer in one word.<|im_end|>\n<|im_start|>user\nSky colour?<|im_end|>\n"
    "<|im_start|>assistant\nBlue<|im_end|>\n<|im_start|>user\nGrass?<|im_end|>\n<|im_start|>assistant\n",
    "Plain text, then <|endoftext|> and <|im_end|>",
]


def post(port, path, body):
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.load(r)


def main() -> None:
    server, model, out_path = sys.argv[1], sys.argv[2], sys.argv[3]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.dirname(server))
    proc = subprocess.Popen(
        [server, "-m", model, "--port", str(port), "-t", "1", "-c", "512"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(300):
            try:
                post(port, "/tokenize", {"content": "x"})
                break
            except OSError:
                time.sleep(0.1)
        cases = []
        for text in CASES:
            for special in (True, False):
                ids = post(port, "/tokenize", {"content": text, "add_special": False, "parse_special": special})["tokens"]
                cases.append({"text": text, "special": special, "ids": ids})
    finally:
        proc.terminate()
        proc.wait()
    doc = {
        "command": " ".join(["python3"] + sys.argv),
        "generator": "llama.cpp llama-server POST /tokenize {content, add_special: false, parse_special}",
        "model": os.path.basename(model),
        "cases": cases,
    }
    head = {k: v for k, v in doc.items() if k != "cases"}
    lines = [json.dumps(c, ensure_ascii=False) for c in cases]
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(json.dumps(head, ensure_ascii=False, indent=1)[:-2])
        f.write(',\n "cases": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n")


if __name__ == "__main__":
    main()
