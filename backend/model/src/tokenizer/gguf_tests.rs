//! Tokenizers built from whole GGUF metadata beyond the default model: small
//! synthetic `llama` (SPM) vocabularies, and the Gemma 3 (`llama`) and
//! Qwen2.5-Coder (`gpt2`, `pre = "qwen2"`) files against llama.cpp's ids.

use super::tests::{assert_matches_reference, model_tokenizer, GEMMA3_FILE, QWEN2_FILE};
use super::*;
use crate::detok::IncrementalDecoder;
use candle_core::quantized::gguf_file::VersionedMagic;
use proptest::prelude::*;

/// Synthetic `llama` metadata: `entries` (text, type, score) get ids 0.., then
/// the 256 byte tokens `<0x00>`..`<0xFF>` (when `byte_tokens`), then `extra` keys.
fn spm_content(
    entries: &[(&str, i32, f32)],
    byte_tokens: bool,
    extra: &[(&str, Value)],
) -> Content {
    let mut tokens: Vec<String> = entries.iter().map(|e| e.0.to_string()).collect();
    let mut types: Vec<i32> = entries.iter().map(|e| e.1).collect();
    let mut scores: Vec<f32> = entries.iter().map(|e| e.2).collect();
    if byte_tokens {
        for b in 0..=255u8 {
            tokens.push(format!("<0x{b:02X}>"));
            types.push(TYPE_BYTE);
            scores.push(0.0);
        }
    }
    let mut metadata = std::collections::HashMap::new();
    metadata.insert(KEY_MODEL.to_string(), Value::String("llama".into()));
    metadata.insert(
        KEY_TOKENS.to_string(),
        Value::Array(tokens.into_iter().map(Value::String).collect()),
    );
    metadata.insert(
        KEY_TOKEN_TYPE.to_string(),
        Value::Array(types.into_iter().map(Value::I32).collect()),
    );
    metadata.insert(
        KEY_SCORES.to_string(),
        Value::Array(scores.into_iter().map(Value::F32).collect()),
    );
    metadata.insert(KEY_BOS.to_string(), Value::U32(1));
    metadata.insert(KEY_EOS.to_string(), Value::U32(2));
    for (k, v) in extra {
        metadata.insert(k.to_string(), v.clone());
    }
    Content {
        magic: VersionedMagic::GgufV3,
        metadata,
        tensor_infos: Default::default(),
        tensor_data_offset: 0,
    }
}

/// A toy SentencePiece vocabulary: ids 0..=12, then the byte tokens from 13.
const TOY: &[(&str, i32, f32)] = &[
    ("<unk>", TYPE_UNKNOWN, 0.0),
    ("<s>", TYPE_CONTROL, 0.0),
    ("</s>", TYPE_CONTROL, 0.0),
    ("<ctl>", TYPE_CONTROL, 0.0),
    ("\n\n", TYPE_USER_DEFINED, 0.0),
    ("\u{2581}", TYPE_NORMAL, -5.0),
    ("h", TYPE_NORMAL, -3.0),
    ("i", TYPE_NORMAL, -3.0),
    ("\u{2581}h", TYPE_NORMAL, -2.0),
    ("\u{2581}hi", TYPE_NORMAL, -1.0),
    ("hi", TYPE_NORMAL, -1.5),
    ("a", TYPE_NORMAL, -3.0),
    ("\u{2581}\u{2581}", TYPE_NORMAL, -4.0),
];

/// The id of byte `b` in [`TOY`] vocabularies.
fn toy_byte(b: u8) -> u32 {
    TOY.len() as u32 + u32::from(b)
}

fn toy(extra: &[(&str, Value)]) -> Tokenizer {
    Tokenizer::from_gguf(&spm_content(TOY, true, extra)).expect("toy tokenizer builds")
}

#[test]
fn a_toy_llama_vocabulary_merges_by_score() {
    let tok = toy(&[(KEY_ADD_SPACE_PREFIX, Value::Bool(false))]);
    assert!(format!("{tok:?}").contains("llama"));
    assert_eq!(tok.vocab_size(), TOY.len() + 256);
    // "hi▁hi": both "hi" merge first (-1.5, leftmost first), then "▁" + "hi".
    assert_eq!(tok.encode("hi hi", true).unwrap(), [10, 9]);
    assert_eq!(tok.encode("hi", true).unwrap(), [10]);
    // Two spaces: "▁▁" is a token.
    assert_eq!(tok.encode("a  a", true).unwrap(), [11, 12, 11]);
    assert_eq!(tok.encode("", true).unwrap(), Vec::<u32>::new());
    assert_eq!(tok.token_id("\u{2581}hi"), Some(9));
    assert_eq!(tok.token_text(9).as_deref(), Some("\u{2581}hi"));
    assert_eq!(tok.token_text(100_000), None);
}

#[test]
fn a_space_prefix_goes_before_the_text_and_after_each_special_token() {
    // llama.cpp's default for `llama` vocabularies when the key is absent.
    let tok = toy(&[]);
    assert_eq!(tok.encode("hi hi", true).unwrap(), [9, 9]);
    assert_eq!(tok.encode("<ctl>hi", true).unwrap(), [3, 9]);
    // "\n\n" is a user-defined token: a special token too.
    assert_eq!(tok.encode("hi\n\nhi", true).unwrap(), [9, 4, 9]);
    assert_eq!(tok.decode(&[9, 4, 9], false), " hi\n\n hi");
}

#[test]
fn control_tokens_parse_only_when_asked_and_user_defined_always() {
    let tok = toy(&[(KEY_ADD_SPACE_PREFIX, Value::Bool(false))]);
    assert_eq!(tok.encode("<ctl>hi\n\nhi", true).unwrap(), [3, 10, 4, 10]);
    let plain = tok.encode("<ctl>hi\n\nhi", false).unwrap();
    let ctl: Vec<u32> = b"<ctl>".iter().map(|&b| toy_byte(b)).collect();
    assert_eq!(plain, [&ctl[..], &[10, 4, 10]].concat());
    assert_eq!(tok.decode(&plain, false), "<ctl>hi\n\nhi");
    // The unknown token is special like a control token.
    assert_eq!(tok.encode("<unk>", true).unwrap(), [0]);
    assert!(tok.is_control(0) && tok.is_control(3) && !tok.is_control(4));
    assert_eq!(tok.decode(&[3, 10, 0], true), "hi");
    assert_eq!(tok.decode(&[3, 10, 0], false), "<ctl>hi<unk>");
}

#[test]
fn characters_outside_the_vocabulary_fall_back_to_byte_tokens() {
    let tok = toy(&[(KEY_ADD_SPACE_PREFIX, Value::Bool(false))]);
    let ids = tok.encode("hé", true).unwrap();
    assert_eq!(ids, [6, toy_byte(0xC3), toy_byte(0xA9)]);
    assert_eq!(tok.token_bytes(toy_byte(0xC3)), [0xC3]);
    assert_eq!(tok.token_bytes(9), b" hi");
    assert_eq!(tok.decode(&ids, false), "hé");
    // A literal "▁" in the text is the escaped space: it decodes as a space.
    assert_eq!(tok.encode("\u{2581}hi", true).unwrap(), [9]);

    // Without byte tokens llama.cpp cannot encode the text either.
    let no_bytes = Tokenizer::from_gguf(&spm_content(TOY, false, &[])).unwrap();
    let err = no_bytes.encode("é", true).unwrap_err();
    assert_eq!(err.label(), "inconsistent");
    assert!(err.to_string().contains("<0xC3>"), "{err}");
}

#[test]
fn byte_fallback_tokens_stream_out_as_whole_characters() {
    let tok = toy(&[(KEY_ADD_SPACE_PREFIX, Value::Bool(false))]);
    let text = "hi 👋é";
    let ids = tok.encode(text, true).unwrap();
    let mut dec = IncrementalDecoder::new(false);
    let mut out = Vec::new();
    for &id in &ids {
        out.push(dec.push(&tok, id));
    }
    out.push(dec.finish());
    // Each character comes out whole, at the token that completes it.
    assert_eq!(out.concat(), text);
    assert!(out
        .iter()
        .all(|s| s.chars().all(|c| c != char::REPLACEMENT_CHARACTER)));
    assert_eq!(out.iter().filter(|s| s.contains('👋')).count(), 1);
    assert!(out.contains(&"👋".to_string()), "{out:?}");
}

#[test]
fn bos_and_eos_follow_the_flags() {
    // `llama` defaults: BOS yes, EOS no.
    let tok = toy(&[(KEY_ADD_SPACE_PREFIX, Value::Bool(false))]);
    assert!(tok.add_bos() && !tok.add_eos());
    assert_eq!(tok.encode_with_bos_eos("hi", true).unwrap(), [1, 10]);
    let tok = toy(&[
        (KEY_ADD_SPACE_PREFIX, Value::Bool(false)),
        (KEY_ADD_BOS, Value::Bool(false)),
        (KEY_ADD_EOS, Value::Bool(true)),
    ]);
    assert_eq!(tok.encode_with_bos_eos("hi", true).unwrap(), [10, 2]);
    assert_eq!(tok.encode("hi", true).unwrap(), [10]);
    let err =
        Tokenizer::from_gguf(&spm_content(TOY, true, &[(KEY_ADD_EOS, Value::U8(1))])).unwrap_err();
    assert_eq!(err.label(), "wrong_type");
}

#[test]
fn llama_metadata_errors_name_the_key() {
    let mut content = spm_content(TOY, true, &[]);
    content
        .metadata
        .insert(KEY_PRE.into(), Value::String("default".into()));
    assert!(Tokenizer::from_gguf(&content).is_ok());
    content
        .metadata
        .insert(KEY_SCORES.into(), Value::Array(vec![Value::F32(0.0)]));
    let err = Tokenizer::from_gguf(&content).unwrap_err();
    assert_eq!(err.label(), "inconsistent");
    assert!(err.to_string().contains(KEY_SCORES), "{err}");
    content
        .metadata
        .insert(KEY_SCORES.into(), Value::String("no".into()));
    let err = Tokenizer::from_gguf(&content).unwrap_err();
    assert_eq!(err.label(), "wrong_type");
    // Scores may be absent (all 0, as in llama.cpp).
    content.metadata.remove(KEY_SCORES);
    let tok = Tokenizer::from_gguf(&content).unwrap();
    assert_eq!(
        tok.decode(&tok.encode("hi hi", true).unwrap(), false),
        " hi hi"
    );
}

/// The early refusal of an SPM tokenizer only ever uses the byte bound, and that
/// bound never exceeds the true count.
fn check_bounds(tok: &Tokenizer, text: &str) -> Result<(), TestCaseError> {
    prop_assert!(!tok.cuts_are_safe);
    let n = tok.encode(text, true)?.len();
    prop_assert!(
        tok.min_tokens(text.len()) <= n,
        "{} > {} for {:?}",
        tok.min_tokens(text.len()),
        n,
        text
    );
    for limit in [0, n / 2, n.saturating_sub(1), n, n + 1] {
        match tok.exceeds(text, true, limit)? {
            Some(at_least) => prop_assert!(at_least > limit && at_least <= n),
            None => prop_assert!(tok.min_tokens(text.len()) <= limit),
        }
    }
    Ok(())
}

proptest! {
    #[test]
    fn spm_lower_bounds_hold_on_toy_text(text in "([hia ▁é<>]|<ctl>|\n\n){0,60}") {
        let tok = toy(&[]);
        check_bounds(&tok, &text)?;
    }

    #[test]
    fn spm_lower_bounds_hold_on_gemma3(text in "([a-z ▁é\n\t]|<start_of_turn>|  |\u{10FFFD}){0,80}") {
        check_bounds(model_tokenizer(GEMMA3_FILE), &text)?;
    }
}

#[test]
fn gemma3_metadata() {
    let tok = model_tokenizer(GEMMA3_FILE);
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!((tok.bos_id(), tok.eos_id()), (Some(2), Some(1)));
    assert!(tok.add_bos() && !tok.add_eos());
    assert_eq!(tok.token_id("<start_of_turn>"), Some(105));
    assert_eq!(tok.token_id("<end_of_turn>"), Some(106));
    assert!(tok.is_control(105) && tok.is_control(106));
    // "\n" is user-defined: always parsed, never skipped.
    assert_eq!(tok.token_id("\n"), Some(107));
    assert!(!tok.is_control(107));
    assert_eq!(tok.token_bytes(107), b"\n");
    assert_eq!(tok.token_bytes(236_743), b" ");
    assert_eq!(tok.token_bytes(238), [0x00]);
    assert_eq!(tok.token_bytes(2), b"<bos>");
    assert!(!tok.cuts_are_safe);
    // 262144 stored texts of at most 48 bytes.
    assert_eq!(tok.max_token_bytes(), 48);
    let text = "<start_of_turn>user\nhi<end_of_turn>\n";
    let ids = tok.encode(text, true).unwrap();
    assert_eq!(ids[0], 105);
    assert_eq!(tok.decode(&ids, false), text);
    assert_eq!(tok.decode(&ids, true), "user\nhi\n");
    assert_eq!(tok.encode_with_bos_eos(text, true).unwrap()[..2], [2, 105]);
}

#[test]
fn gemma3_matches_llama_cpp_reference() {
    let tok = model_tokenizer(GEMMA3_FILE);
    assert!(assert_matches_reference(tok, "tokenizer_reference_gemma3.json") >= 40);
}

#[test]
fn gemma3_byte_fallback_streams_whole_characters() {
    let tok = model_tokenizer(GEMMA3_FILE);
    // U+10FFFD is not in Gemma's vocabulary: four byte tokens.
    let ids = tok.encode("a\u{10FFFD}b", true).unwrap();
    let bytes: Vec<Vec<u8>> = ids.iter().map(|&id| tok.token_bytes(id)).collect();
    assert!(
        bytes.contains(&vec![0xF4]) && bytes.contains(&vec![0xBD]),
        "{bytes:?}"
    );
    let mut dec = IncrementalDecoder::new(true);
    let out: Vec<String> = ids.iter().map(|&id| dec.push(tok, id)).collect();
    assert_eq!(out.concat() + &dec.finish(), "a\u{10FFFD}b");
    assert!(out.contains(&"\u{10FFFD}".to_string()), "{out:?}");
}

#[test]
fn gemma3_long_text_is_refused_only_by_the_byte_bound() {
    let tok = model_tokenizer(GEMMA3_FILE);
    let text = "the quick brown fox jumps over a lazy dog ".repeat(2500);
    // Far more tokens than 8192, but SPM has no safe cut: no refusal from a prefix.
    assert!(tok.min_tokens(text.len()) <= 8192);
    assert_eq!(tok.exceeds(&text, true, 8192).unwrap(), None);
    assert!(tok.encode(&text, true).unwrap().len() > 8192);
    // Over the byte bound it is refused without tokenizing.
    let n = tok
        .exceeds(&text, true, 100)
        .unwrap()
        .expect("known too long");
    assert_eq!(n, tok.min_tokens(text.len()));
}

#[test]
fn qwen2_metadata() {
    let tok = model_tokenizer(QWEN2_FILE);
    assert_eq!(tok.vocab_size(), 151_936);
    assert_eq!(tok.eos_id(), Some(151_645));
    assert!(!tok.add_bos() && !tok.add_eos());
    assert!(tok.cuts_are_safe);
    assert_eq!(tok.token_id("<|im_start|>"), Some(151_644));
    assert!(tok.is_control(151_644));
    // User-defined: parsed even without special-token parsing.
    assert_eq!(tok.encode("<tool_call>", false).unwrap(), [151_657]);
    // Single digits, as the Qwen2 split says.
    let ids = tok.encode("12345", true).unwrap();
    assert_eq!(ids.len(), 5);
}

#[test]
fn qwen2_matches_llama_cpp_reference() {
    let tok = model_tokenizer(QWEN2_FILE);
    assert!(assert_matches_reference(tok, "tokenizer_reference_qwen2.json") >= 40);
}

#[test]
fn a_long_qwen2_text_is_known_too_long_from_a_prefix() {
    let tok = model_tokenizer(QWEN2_FILE);
    let text = "the quick brown fox jumps over a lazy dog ".repeat(2500);
    assert!(tok.min_tokens(text.len()) <= 8192);
    let n = tok
        .exceeds(&text, true, 8192)
        .unwrap()
        .expect("known too long");
    assert!(
        n > 8192 && n <= tok.encode(&text, true).unwrap().len(),
        "{n}"
    );
}
