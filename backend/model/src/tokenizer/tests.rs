use super::*;
use std::path::PathBuf;
use std::sync::OnceLock;

/// Path of the test model: `$TESSERA_MODEL`, else `models/SmolLM2-135M-Instruct.Q4_1.gguf`
/// under the workspace root.
pub(crate) fn model_path() -> PathBuf {
    match std::env::var_os("TESSERA_MODEL") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../..")
            .join("models")
            .join("SmolLM2-135M-Instruct.Q4_1.gguf"),
    }
}

/// The GGUF metadata of the test model; panics when the file is absent.
pub(crate) fn test_content() -> Option<&'static Content> {
    static CONTENT: OnceLock<Option<Content>> = OnceLock::new();
    CONTENT
        .get_or_init(|| {
            let path = model_path();
            let Ok(mut f) = std::fs::File::open(&path) else {
                return None;
            };
            Some(Content::read(&mut f).expect("GGUF metadata reads"))
        })
        .as_ref()
        .or_else(|| {
            // The model is part of the test setup (`.ci/run` fetches it): a missing
            // file is a failure, never a silent skip.
            panic!(
                "model file {} not found: run `cargo run --release -- model fetch` or set TESSERA_MODEL",
                model_path().display()
            )
        })
}

/// The tokenizer of the test model, or `None` (with a message) when absent.
pub(crate) fn test_tokenizer() -> Option<&'static Tokenizer> {
    static TOK: OnceLock<Option<Tokenizer>> = OnceLock::new();
    let content = test_content()?;
    TOK.get_or_init(|| Some(Tokenizer::from_gguf(content).expect("tokenizer builds")))
        .as_ref()
}

/// The Gemma 3 file: a `llama` (SPM) vocabulary of 262144 tokens.
pub(crate) const GEMMA3_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
/// The Qwen2.5-Coder file: `gpt2` with `pre = "qwen2"`.
pub(crate) const QWEN2_FILE: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

/// The GGUF metadata of `models/<file>` under the workspace root, read once per
/// file. Panics when the file is absent: like the default model, these files are
/// part of the test setup (fetched into `models/`), never a silent skip.
pub(crate) fn model_content(file: &'static str) -> &'static Content {
    static CONTENTS: OnceLock<std::sync::Mutex<Vec<(&str, &'static Content)>>> = OnceLock::new();
    let mut cache = CONTENTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, c)) = cache.iter().find(|(f, _)| *f == file) {
        return c;
    }
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../models")
        .join(file);
    let mut f = std::fs::File::open(&path).unwrap_or_else(|e| {
        panic!(
            "model file {} not found ({e}): run `cargo run --release -- model fetch \
             --model gemma-3-270m --model qwen2.5-coder-0.5b-instruct`",
            path.display()
        )
    });
    let content: &'static Content = Box::leak(Box::new(
        Content::read(&mut f).expect("GGUF metadata reads"),
    ));
    cache.push((file, content));
    content
}

/// The tokenizer of `models/<file>`, built once per file (see [`model_content`]).
pub(crate) fn model_tokenizer(file: &'static str) -> &'static Tokenizer {
    static TOKS: OnceLock<std::sync::Mutex<Vec<(&str, &'static Tokenizer)>>> = OnceLock::new();
    let content = model_content(file);
    let mut cache = TOKS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, t)) = cache.iter().find(|(f, _)| *f == file) {
        return t;
    }
    let tok: &'static Tokenizer = Box::leak(Box::new(
        Tokenizer::from_gguf(content).expect("tokenizer builds"),
    ));
    cache.push((file, tok));
    tok
}

fn ids_of(tok: &Tokenizer, pieces: &[&str]) -> Vec<u32> {
    pieces
        .iter()
        .map(|p| tok.token_id(p).unwrap_or_else(|| panic!("{p:?} in vocab")))
        .collect()
}

#[test]
fn metadata_basics() {
    let Some(tok) = test_tokenizer() else { return };
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.bos_id(), Some(1));
    assert_eq!(tok.eos_id(), Some(2));
    assert!(!tok.add_bos());
    assert_eq!(tok.token_id("<|im_start|>"), Some(1));
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert!(tok.is_control(1) && tok.is_control(16) && !tok.is_control(17));
    assert_eq!(tok.token_bytes(2), b"<|im_end|>".to_vec());
    assert_eq!(tok.token_bytes(u32::MAX), Vec::<u8>::new());
}

#[test]
fn hello_world() {
    let Some(tok) = test_tokenizer() else { return };
    let ids = tok.encode("Hello world", true).unwrap();
    assert_eq!(ids, ids_of(tok, &["Hello", "Ġworld"]));
    assert_eq!(tok.decode(&ids, false), "Hello world");
}

#[test]
fn digits_split_one_per_token() {
    let Some(tok) = test_tokenizer() else { return };
    let ids = tok.encode("12345", true).unwrap();
    assert_eq!(ids, ids_of(tok, &["1", "2", "3", "4", "5"]));
    let ids = tok.encode("pi 3.14", true).unwrap();
    assert_eq!(ids, ids_of(tok, &["pi", "Ġ", "3", ".", "1", "4"]));
}

#[test]
fn special_tokens_only_when_parsed() {
    let Some(tok) = test_tokenizer() else { return };
    let text = "<|im_start|>user\nhi<|im_end|>";
    let ids = tok.encode(text, true).unwrap();
    assert_eq!(ids.first(), Some(&1));
    assert_eq!(ids.last(), Some(&2));
    assert_eq!(tok.decode(&ids, false), text);
    assert_eq!(tok.decode(&ids, true), "user\nhi");

    let plain = tok.encode(text, false).unwrap();
    assert!(plain.len() > ids.len());
    assert!(plain.iter().all(|&id| !tok.is_control(id)), "{plain:?}");
    assert_eq!(tok.decode(&plain, false), text);
}

#[test]
fn round_trips_exactly() {
    let Some(tok) = test_tokenizer() else { return };
    for text in [
        "👋🌍🎉 emoji",
        "你好，世界",
        "Привет, мир",
        "مرحبا بالعالم",
        "fn main() {\n\tprintln!(\"hi\");\n}\n",
        "  multiple   spaces  ",
        " hello",
        "don't I'll",
        "",
        "\u{0}\u{7f}\u{fffd}é",
    ] {
        for special in [false, true] {
            let ids = tok.encode(text, special).unwrap();
            assert_eq!(tok.decode(&ids, false), text, "ids {ids:?}");
            let bytes: Vec<u8> = ids.iter().flat_map(|&i| tok.token_bytes(i)).collect();
            assert_eq!(bytes, text.as_bytes());
        }
    }
}

#[test]
fn errors_name_the_key() {
    let Some(content) = test_content() else {
        return;
    };
    let mut bad = Content {
        magic: content.magic,
        metadata: content.metadata.clone(),
        tensor_infos: Default::default(),
        tensor_data_offset: 0,
    };
    bad.metadata
        .insert(KEY_MODEL.into(), Value::String("bert".into()));
    let err = Tokenizer::from_gguf(&bad).unwrap_err();
    assert_eq!(err.label(), "unsupported");
    assert!(err.to_string().contains(KEY_MODEL), "{err}");
    assert!(err.to_string().contains("\"gpt2\", \"llama\""), "{err}");

    bad.metadata
        .insert(KEY_MODEL.into(), Value::String("gpt2".into()));
    bad.metadata
        .insert(KEY_PRE.into(), Value::String("deepseek-llm".into()));
    let err = Tokenizer::from_gguf(&bad).unwrap_err();
    assert!(err.to_string().contains(KEY_PRE), "{err}");
    assert!(
        err.to_string().contains("\"qwen2\", \"llama-bpe\""),
        "{err}"
    );

    // SPM takes no pre-tokenizer but its default.
    bad.metadata
        .insert(KEY_MODEL.into(), Value::String("llama".into()));
    let err = Tokenizer::from_gguf(&bad).unwrap_err();
    assert_eq!(err.label(), "unsupported");
    assert!(err.to_string().contains(KEY_PRE), "{err}");
    assert!(err.to_string().contains("\"default\""), "{err}");

    bad.metadata
        .insert(KEY_MODEL.into(), Value::String("gpt2".into()));

    bad.metadata
        .insert(KEY_PRE.into(), Value::String("smollm".into()));
    bad.metadata.remove(KEY_MERGES);
    let err = Tokenizer::from_gguf(&bad).unwrap_err();
    assert!(matches!(
        err,
        TokenizerError::MissingKey { key: KEY_MERGES }
    ));

    bad.metadata = content.metadata.clone();
    bad.metadata
        .insert(KEY_TOKEN_TYPE.into(), Value::Array(vec![Value::I32(1)]));
    let err = Tokenizer::from_gguf(&bad).unwrap_err();
    assert_eq!(err.label(), "inconsistent");
    assert!(err.to_string().contains(KEY_TOKEN_TYPE), "{err}");
}

#[derive(serde::Deserialize)]
struct Reference {
    command: String,
    cases: Vec<RefCase>,
}

#[derive(serde::Deserialize)]
struct RefCase {
    text: String,
    #[serde(default = "yes")]
    special: bool,
    /// llama.cpp's `add_special`: BOS/EOS as the model's flags say.
    #[serde(default)]
    add_special: bool,
    ids: Vec<u32>,
}

fn yes() -> bool {
    true
}

/// Asserts that `tok` gives llama.cpp's ids (via llama-cpp-python) for every
/// case of `backend/model/tests/data/<file>`, and that they decode back to the
/// text; returns the number of cases.
pub(crate) fn assert_matches_reference(tok: &Tokenizer, file: &str) -> usize {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(file);
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("reference file {}: {e}", path.display()));
    let reference: Reference = serde_json::from_str(&text).expect("reference parses");
    assert!(!reference.command.is_empty());
    for case in &reference.cases {
        let ids = if case.add_special {
            tok.encode_with_bos_eos(&case.text, case.special).unwrap()
        } else {
            tok.encode(&case.text, case.special).unwrap()
        };
        assert_eq!(
            ids, case.ids,
            "{file}: text {:?} special {} add_special {}",
            case.text, case.special, case.add_special
        );
        if !case.add_special {
            // SPM reads a literal `▁` as the escaped space, and writes a space.
            let text = match tok.engine {
                Engine::Spm(_) => case.text.replace(spm::ESCAPED_SPACE, " "),
                Engine::Bpe(_) => case.text.clone(),
            };
            assert_eq!(tok.decode(&ids, false), text, "{file}");
        }
    }
    reference.cases.len()
}

/// Our ids equal llama.cpp's (via llama-cpp-python) for every case of
/// `backend/model/tests/data/tokenizer_reference.json`.
#[test]
fn matches_llama_cpp_reference() {
    let Some(tok) = test_tokenizer() else { return };
    assert!(assert_matches_reference(tok, "tokenizer_reference.json") >= 20);
}
