#!/usr/bin/env python3
"""Write llama.cpp's token ids for a fixed list of strings.

The Rust tokenizer (backend/model/src/tokenizer.rs) must give the same ids; its test
`tokenizer::tests::matches_llama_cpp_reference` reads the file written here.

Usage (llama-cpp-python installed in the interpreter):
    python scripts/tokenizer_reference.py MODEL.gguf backend/model/tests/data/tokenizer_reference.json
"""

import json
import sys

import llama_cpp

# (text, parse special tokens)
CASES = [
    ("Hello world", True),
    ("Hello, world! How are you today?", True),
    ("The quick brown fox jumps over the lazy dog.", True),
    ("12345 and 3.14159", True),
    ("In 2024, 1,000,000 people paid $19.99 each.", True),
    ("👋🌍🎉", True),
    ("Party time 🎉🎉 with friends 👨‍👩‍👧", True),
    ("你好，世界", True),
    ("Привет, мир", True),
    ("مرحبا بالعالم", True),
    ("def f(x):\n\treturn x * 2\n\n\nprint(f(21))\n", True),
    ("fn main() {\n    println!(\"{}\", 1 + 2);\n}", True),
    ("multiple    spaces   here  ", True),
    ("  leading and trailing  ", True),
    (" hello", True),
    ("don't I'll we're they've she's it'd I'm", True),
    ("DON'T Shout", True),
    ("<|im_start|>user\nhi<|im_end|>", True),
    ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n", True),
    ("<|im_start|>user\nhi<|im_end|>", False),
    ("<|endoftext|> is plain text here", False),
    ("Mixed: café naïve résumé – “quotes” … ©", True),
    ("tabs\tand\nnewlines\r\nand\u00a0nbsp", True),
    ("½ ² ٣ ① numbers", True),
    ("こんにちは世界 안녕하세요 नमस्ते दुनिया", True),
    ("Ελληνικά and ภาษาไทย and עברית", True),
    ("e\u0301 combining and ZWJ\u200dhere", True),
    ("https://example.com/path?q=1&r=two#frag user@example.org", True),
    ("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", True),
    ("!!! ??? ... --- *** ''' \"\"\" ```python\n", True),
    ("\n\n\n\n  \n\t\t\n", True),
    ("x<|im_end|>y <|im_start|> z<|endoftext|>", True),
    ("Hello world", False),
    ("", True),
]


def main() -> None:
    model_path, out_path = sys.argv[1], sys.argv[2]
    llm = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    cases = []
    for text, special in CASES:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=special)
        cases.append({"text": text, "special": special, "ids": ids})
    doc = {
        "command": " ".join([sys.executable] + sys.argv),
        "generator": f"llama-cpp-python {llama_cpp.__version__}, "
        "Llama(model_path, vocab_only=True).tokenize(text, add_bos=False, special=<case.special>)",
        "model": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "cases": cases,
    }
    # One case per line keeps the file short and its diffs readable.
    head = {k: v for k, v in doc.items() if k != "cases"}
    lines = [json.dumps(c, ensure_ascii=False) for c in cases]
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(json.dumps(head, ensure_ascii=False, indent=1)[:-2])
        f.write(',\n "cases": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n")


if __name__ == "__main__":
    main()
