//! `tessera generate --prompt` reads a prompt as the server reads a raw one (issue
//! 40): control-token text (`<|im_start|>`, ...) becomes the control tokens, as
//! llama.cpp parses it; `--no-parse-special` keeps that text plain text.

mod common;

use serde_json::Value;
use std::process::Command;
use tessera_model::LoadedModel;

/// A user turn and the assistant's opening, in SmolLM2's ChatML.
const SHORT: &str =
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n";

/// The prompt ids `tessera generate --json --prompt SHORT EXTRA...` reports.
fn generate_prompt_ids(extra: &[&str]) -> Vec<u32> {
    let out = Command::new(common::BIN)
        .args(["generate", "--json", "--max-tokens", "1", "--model"])
        .arg(common::model_path())
        .args(["--prompt", SHORT])
        .args(extra)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "generate {extra:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    serde_json::from_value(v["prompt_ids"].clone()).unwrap()
}

/// llama.cpp's ids for SHORT (`special`: control-token text parsed), from the file
/// gateway/tests/parity.rs holds the server's raw prompts to (written by
/// `scripts/raw_prompt_reference.py` through llama.cpp's `llama-server /tokenize`,
/// without BOS).
fn llama_cpp_ids(special: bool) -> Vec<u32> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/gateway/tests/data/raw_prompt_reference.json"
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let case = v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["text"] == SHORT && c["special"] == special)
        .expect("reference case for SHORT");
    serde_json::from_value(case["ids"].clone()).unwrap()
}

#[test]
fn generate_parses_control_tokens_as_the_server_raw_prompt_does() {
    let m = LoadedModel::load(&common::model_path()).unwrap();
    let tok = &m.tokenizer;
    let bos: Vec<u32> = tok.bos_id().filter(|_| tok.add_bos()).into_iter().collect();

    let parsed = generate_prompt_ids(&[]);
    // The server's raw prompt (`raw: true`, `/v1/completions`): gateway model_check
    // tokenizes it with `encode_with_bos_eos(text, true)`.
    assert_eq!(parsed, tok.encode_with_bos_eos(SHORT, true).unwrap());
    assert_eq!(parsed, [bos.clone(), llama_cpp_ids(true)].concat());
    assert_eq!(parsed.len(), 16, "{parsed:?}");

    let plain = generate_prompt_ids(&["--no-parse-special"]);
    assert_eq!(plain, [bos, llama_cpp_ids(false)].concat());
    assert_eq!(plain.len(), 33, "{plain:?}");
}
