//! Greedy outputs and logits against llama.cpp on the same GGUF.
//!
//! The vector `tests/data/greedy_reference.json` was produced by llama.cpp
//! (llama-cpp-python 0.3.36); its `command` field is the exact command that
//! regenerates it (`scripts/greedy_reference.py`).
//!
//! Both implementations quantize activations to 8 bits before every matmul, and
//! that rounding is chaotic: equivalent arithmetic in a different order moves the
//! logits of this 135M model by a few tenths. Measured on this vector: our logits
//! differ from llama.cpp's by at most ~1.0 (typically 0.1-0.5, depending on which
//! SIMD path runs); and running *exact* `f32` activations against llama.cpp differs
//! just as much (up to 0.50) and flips argmax already at token 0 (margin 0.089).
//! So a divergence is accepted only where llama.cpp's own top-2 margin is under
//! [`MAX_MARGIN`], and only to llama.cpp's second choice, or where our token is the
//! exact reference's argmax at that position (`tests/data/exact_reference.json`:
//! `scripts/exact_reference.py`, the float64 forward pass teacher-forced along
//! llama.cpp's tokens, so it is llama.cpp that rounded away from exact there), or
//! its second choice where the exact top-2 margin is itself under [`MAX_MARGIN`]
//! (a near-tie of the arithmetic both engines approximate: Gemma's `raw_once_upon`
//! token 16, margin 0.055, with the file's K-quant weights read natively); after
//! it the case is not compared further. (The issue asked for margins under 0.05 and 8 exact tokens;
//! exact arithmetic itself misses that against llama.cpp: see the issue notes.)

use serde_json::Value;
use tessera_model::testing::*;

const MAX_MARGIN: f64 = 0.25;
/// Largest accepted |our logit - llama.cpp logit| for the reference's top token
/// while outputs agree (measured up to 0.98; logits are O(20)). A wrong rope, norm
/// or tokenizer moves them by several units.
const LOGIT_TOL: f32 = 1.5;

fn data(file: &str) -> Value {
    let path = format!("{}/tests/data/{file}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The exact (float64) reference at one output position: its argmax, its
/// second choice and the margin between their logits.
#[derive(Clone, Copy, Debug)]
struct Exact {
    argmax: u32,
    second: u32,
    margin: f64,
}

/// Per case name: the exact reference at each of llama.cpp's output positions.
fn exact_top2(file: &str) -> std::collections::HashMap<String, Vec<Exact>> {
    let v = data(file);
    v["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let steps = c["top8"].as_array().unwrap().iter().map(|s| {
                let (a, b) = (&s[0], &s[1]);
                Exact {
                    argmax: a[0].as_u64().unwrap() as u32,
                    second: b[0].as_u64().unwrap() as u32,
                    margin: a[1].as_f64().unwrap() - b[1].as_f64().unwrap(),
                }
            });
            (c["name"].as_str().unwrap().to_string(), steps.collect())
        })
        .collect()
}

/// A reference step's `[top id, its logit, second id, its logit]`.
fn top2_at(v: &Value) -> (usize, f64, u32, f64) {
    let t = v.as_array().unwrap();
    (
        t[0].as_u64().unwrap() as usize,
        t[1].as_f64().unwrap(),
        t[2].as_u64().unwrap() as u32,
        t[3].as_f64().unwrap(),
    )
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn greedy_tokens_match_llama_cpp_within_near_ties() {
    check(
        &load(),
        "greedy_reference.json",
        "exact_reference.json",
        5,
        LOGIT_TOL,
    );
}

#[test]
fn gemma3_greedy_tokens_match_llama_cpp_within_near_ties() {
    check(
        &load_family(FAMILY_MODEL_FILES[0]),
        "greedy_reference_gemma3.json",
        "exact_reference_gemma3.json",
        3,
        LOGIT_TOL,
    );
}

#[test]
fn qwen2_greedy_tokens_match_llama_cpp_within_near_ties() {
    check(
        &load_family(FAMILY_MODEL_FILES[1]),
        "greedy_reference_qwen2.json",
        "exact_reference_qwen2.json",
        5,
        LOGIT_TOL,
    );
}

/// Greedy decoding of every case of `greedy` (llama.cpp's path) against it and
/// the exact reference `exact` along it (see the module docs).
fn check(m: &tessera_model::LoadedModel, greedy: &str, exact: &str, min_cases: usize, tol: f32) {
    let r = data(greedy);
    let exact = exact_top2(exact);
    let cases = r["cases"].as_array().unwrap();
    assert!(cases.len() >= min_cases);
    let (mut report, mut failures) = (Vec::new(), Vec::new());
    for c in cases {
        let name = c["name"].as_str().unwrap();
        let chat = c["chat"].as_bool().unwrap();
        // llama.cpp's `add_special`: the BOS/EOS the file asks for (Gemma: BOS).
        let prompt = m
            .tokenizer
            .encode_with_bos_eos(c["text"].as_str().unwrap(), chat)
            .unwrap();
        assert_eq!(prompt, ids(&c["prompt_ids"]), "{name}: prompt tokenization");
        let want = ids(&c["output_ids"]);
        let top2 = c["top2"].as_array().unwrap();
        let exact = &exact[name];
        assert_eq!(exact.len(), want.len(), "{name}: exact reference length");
        let (got, logits) = greedy_with_logits(m, &prompt, want.len());
        let mut max_diff = 0f32;
        let mut diverged = None;
        for i in 0..want.len() {
            let (id1, l1, id2, l2) = top2_at(&top2[i]);
            max_diff = max_diff.max((logits[i][id1] - l1 as f32).abs());
            if got[i] != want[i] {
                let margin = l1 - l2;
                let e = exact[i];
                // A near-tie of llama.cpp's logits or of exact arithmetic's.
                let near_tie = (margin < MAX_MARGIN && got[i] == id2)
                    || (e.margin < MAX_MARGIN && got[i] == e.second);
                if !near_tie && got[i] != e.argmax {
                    failures.push(format!(
                        "{name}: token {i} is {} but llama.cpp chose {} (top-2 margin {margin:.4}, \
                         second choice {id2}) and exact arithmetic {}",
                        got[i], want[i], e.argmax
                    ));
                }
                diverged = Some((i, margin));
                break;
            }
        }
        if max_diff >= tol {
            failures.push(format!(
                "{name}: top logit differs from llama.cpp by {max_diff}"
            ));
        }
        report.push(format!(
            "{name}: max top-logit diff {max_diff:.3}, divergence {diverged:?}"
        ));
    }
    eprintln!("{}", report.join("\n"));
    assert!(
        failures.is_empty(),
        "divergences are accepted only at reference margins under {MAX_MARGIN}, to the \
         reference's second choice:\n{}",
        failures.join("\n")
    );
}

/// Largest llama.cpp top-2 margin at which an adapter run may take llama.cpp's
/// second choice. Wider than [`MAX_MARGIN`]: there is no exact (float64) reference
/// under an adapter to settle a divergence, and the two engines' logits differ by up
/// to ~1.0 already without one (module docs); the adapter runs measured 0.19-0.70.
const LORA_MAX_MARGIN: f64 = 0.5;

/// The adapter `make_lora.py ARGS` writes for the default model (into a temp dir,
/// with the test Python's `gguf` package), checked against the SHA-256 the
/// reference `greedy` recorded for llama.cpp's run: the same bytes.
fn make_adapter(dir: &std::path::Path, greedy: &Value, args: &[&str]) -> Vec<u8> {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let py = std::process::Command::new(format!("{root}/scripts/python-env"))
        .output()
        .expect("scripts/python-env");
    assert!(py.status.success(), "scripts/python-env failed");
    let python = String::from_utf8(py.stdout).unwrap().trim().to_string();
    let out = dir.join("adapter.gguf");
    let ok = std::process::Command::new(python)
        .arg(format!("{root}/scripts/make_lora.py"))
        .arg(model_path())
        .arg(&out)
        .args(args)
        .status()
        .unwrap()
        .success();
    assert!(ok, "make_lora.py {args:?}");
    let bytes = std::fs::read(&out).unwrap();
    use sha2::Digest;
    let sha: String = sha2::Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        greedy["lora"]["sha256"].as_str(),
        Some(sha.as_str()),
        "make_lora.py {args:?} no longer writes the adapter llama.cpp ran: regenerate \
         the reference with the `command` in its file"
    );
    bytes
}

/// Greedy decoding under a LoRA adapter against llama.cpp's (`llama-cpp-python`
/// with `lora_path`, i.e. `llama-server --lora` at scale 1) on the same base file
/// and adapter: `random` (rank 8 on attn_q, attn_v and ffn_down of every block)
/// and `bias` (a rank-1 structured adapter on the last block's ffn_down that
/// pushes the residual along one token's output row). Tokens must agree up to a
/// near-tie of llama.cpp's logits (then only to its second choice), top logits
/// within [`LOGIT_TOL`]; and each adapter must change llama.cpp's own output from
/// the base model's in the same settings (`base_output_ids`), so the comparison
/// tests the adapter, not the base. (The references load the base without AMX
/// repacking: llama.cpp 0.3.36 crashes with an adapter on repacked weights.)
#[test]
fn lora_greedy_tokens_match_llama_cpp_within_near_ties() {
    let m = load();
    let dir = tempfile::tempdir().unwrap();
    for (file, args) in [
        (
            "greedy_reference_lora_random.json",
            &[
                "--kind",
                "random",
                "--targets",
                "attn_q,attn_v,ffn_down",
                "--rank",
                "8",
                "--scale",
                "0.02",
                "--seed",
                "1",
            ][..],
        ),
        (
            "greedy_reference_lora_bias.json",
            &[
                "--kind",
                "bias-token",
                "--token",
                "21285",
                "--scale",
                "2",
                "--seed",
                "2",
            ][..],
        ),
    ] {
        let r = data(file);
        let bytes = make_adapter(dir.path(), &r, args);
        let w = tessera_model::lora::LoraWeights::load(
            &bytes,
            &m.lora_base,
            "reference",
            m.config().layers,
        )
        .unwrap();
        let cases = r["cases"].as_array().unwrap();
        let changed = cases
            .iter()
            .filter(|c| c["output_ids"] != c["base_output_ids"])
            .count();
        assert!(
            changed >= 3,
            "{file}: the adapter changed only {changed} of llama.cpp's outputs"
        );
        let mut failures = Vec::new();
        for c in cases {
            let name = c["name"].as_str().unwrap();
            let prompt = ids(&c["prompt_ids"]);
            let want = ids(&c["output_ids"]);
            let (got, logits) = greedy_with_logits_lora(&m, Some(&w), &prompt, want.len());
            let mut max_diff = 0f32;
            for i in 0..want.len() {
                let (id1, l1, id2, l2) = top2_at(&c["top2"][i]);
                max_diff = max_diff.max((logits[i][id1] - l1 as f32).abs());
                if got[i] != want[i] {
                    if !(l1 - l2 < LORA_MAX_MARGIN && got[i] == id2) {
                        failures.push(format!(
                            "{file} {name}: token {i} is {} but llama.cpp chose {} (margin {:.4})",
                            got[i],
                            want[i],
                            l1 - l2
                        ));
                    }
                    break;
                }
            }
            if max_diff >= LOGIT_TOL {
                failures.push(format!("{file} {name}: top logit differs by {max_diff}"));
            }
            eprintln!("{file} {name}: max top-logit diff {max_diff:.3}");
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}
