#!/usr/bin/env python3
"""Write llama.cpp's token ids for a fixed list of strings.

The Rust tokenizer (backend/model/src/tokenizer/) must give the same ids; its tests
read the files written here:

- the default model (SmolLM2, `gpt2`/`smollm`): CASES, read by
  `tokenizer::tests::matches_llama_cpp_reference`;
- Gemma 3 (`llama`, SentencePiece-style): CASES + MORE_CASES + GEMMA3_CASES, read by
  `tokenizer::gguf_tests::gemma3_matches_llama_cpp_reference`;
- Qwen2.5-Coder (`gpt2`/`qwen2`): CASES + MORE_CASES + QWEN2_CASES, read by
  `tokenizer::gguf_tests::qwen2_matches_llama_cpp_reference`.

The case list follows the model file's name; any other file gets CASES alone.

Usage (llama-cpp-python installed in the interpreter):
    python scripts/tokenizer_reference.py models/SmolLM2-135M-Instruct.Q4_1.gguf backend/model/tests/data/tokenizer_reference.json
    python scripts/tokenizer_reference.py models/gemma-3-270m-q4_k_m.gguf backend/model/tests/data/tokenizer_reference_gemma3.json
    python scripts/tokenizer_reference.py models/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf backend/model/tests/data/tokenizer_reference_qwen2.json
"""

import json
import os
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

# More multilingual text and code, for the Gemma 3 and Qwen2.5 files.
MORE_CASES = [
    ("    def indented():\n        return {'a': [1, 2, 3]}\n", True),
    ("for (int i = 0; i < 10; ++i) { sum += a[i]; }", True),
    ("SELECT name, COUNT(*) FROM users WHERE age >= 18 GROUP BY name;", True),
    ("<html><body><table><tr><td>cell</td></tr></table></body></html>", False),
    ("Ünïcödé façade — naïve coöperation", True),
    ("日本語のテキストと English mixed 한국어", True),
    ("Tiếng Việt có dấu, ภาษาไทย, Ἑλληνικά", True),
    ("१२३ ٤٥٦ 123456789 0.5", True),
    ("    \n\t\t\n   \n", True),
    ("a  b   c    d\t\te     f", True),
    ("x = 1_000_000 + 0xFF - 3.5e-10", True),
    ("emoji: 🤖🚀✨ and flags 🇯🇵", True),
    ("\u2581literal\u2581block chars\u2581", True),
    ("\U0010FFFD rare \U000F0000 code points \U0001FAE8", True),
    ("'S 'T 'RE 'VE 'M 'LL 'D and 's 't", True),
    ("line1\r\nline2\rline3\n", True),
    ("$$\\frac{a}{b}$$ and `code` and ~~strike~~", True),
    ("pneumonoultramicroscopicsilicovolcanoconiosis", True),
    ("        ", True),
    ("\n", True),
    (" ", True),
]

# Gemma 3 chat control strings: (text, parse special[, add_special]).
GEMMA3_CASES = [
    ("<start_of_turn>user\nhi<end_of_turn>\n", True),
    ("<start_of_turn>user\nhi<end_of_turn>\n", False),
    ("<bos><start_of_turn>user\nWrite a haiku.<end_of_turn>\n<start_of_turn>model\n", True),
    ("<start_of_image> look <end_of_image>", False),
    ("<unused0> <mask> <pad>x<eos>", True),
    ("<unused0> <mask> <pad>x<eos>", False),
    ("<b>bold</b> and <s>strike</s> [multimodal]", False),
    ("Hello world", True, True),
    ("<start_of_turn>user\nhi<end_of_turn>\n", True, True),
]

# Qwen2.5 chat, fill-in-the-middle and tool-call strings.
QWEN2_CASES = [
    ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", True),
    ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", False),
    ("<|fim_prefix|>def f():\n<|fim_suffix|>\n    return 1<|fim_middle|>", True),
    ("<|fim_prefix|>def f():\n<|fim_suffix|>\n    return 1<|fim_middle|>", False),
    ("<tool_call>\n{\"name\": \"f\", \"arguments\": {}}\n</tool_call>", False),
    ("<|endoftext|><|endoftext|>", True),
    ("Hello world", True, True),
]


def cases_for(model_name):
    """The case list for a model file, by its name."""
    if model_name.startswith("gemma-3"):
        return CASES + MORE_CASES + GEMMA3_CASES
    if model_name.startswith("qwen2.5"):
        return CASES + MORE_CASES + QWEN2_CASES
    return CASES


def main() -> None:
    model_path, out_path = sys.argv[1], sys.argv[2]
    model_name = os.path.basename(model_path)
    llm = llama_cpp.Llama(model_path=model_path, vocab_only=True, verbose=False)
    cases = []
    for text, special, *rest in cases_for(model_name):
        add_special = bool(rest and rest[0])
        # llama-cpp-python's `add_bos` is llama.cpp's `add_special` (BOS and EOS
        # as the model's flags say).
        ids = llm.tokenize(text.encode("utf-8"), add_bos=add_special, special=special)
        case = {"text": text, "special": special, "ids": ids}
        if add_special:
            case = {"text": text, "special": special, "add_special": True, "ids": ids}
        cases.append(case)
    doc = {
        "command": " ".join([sys.executable] + sys.argv),
        "generator": f"llama-cpp-python {llama_cpp.__version__}, "
        "Llama(model_path, vocab_only=True).tokenize(text, add_bos=<case.add_special, default false>, "
        "special=<case.special>)",
        "model": model_name,
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
