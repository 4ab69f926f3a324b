//! The cut rule of [`Tokenizer::exceeds`], checked on the real tokenizer: at every
//! [`safe_cut`], the prefix's tokens are exactly the whole text's first tokens.

use super::tests::{model_content, model_tokenizer, test_tokenizer, QWEN2_FILE};
use super::*;
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;
use std::sync::OnceLock;

/// Text pieces that stress the GPT-2, Qwen2 and Llama 3 splits: words, runs of
/// spaces, newlines, digits, punctuation, contractions, non-ASCII letters,
/// emoji, control-token and user-defined token text.
const PIECES: &[&str] = &[
    "'S",
    "\r\n",
    "  \n",
    "123456",
    "x1",
    "\u{a0}",
    "<tool_call>",
    "the",
    "cat",
    "Hello",
    "x",
    "ab",
    " ",
    "  ",
    "   ",
    "\n",
    "\n\n",
    "\t",
    "123",
    "4",
    "2024",
    ",",
    ".",
    "!?",
    "'s",
    "'ll",
    "don't",
    "(",
    ")",
    "-",
    "--",
    "é",
    "naïve",
    "Straße",
    "日本語",
    "👋",
    "<|im_start|>",
    "<|im_end|>",
    "user",
    "a b",
    "::",
    "\"",
];

/// The property: the tokens of the text before a safe cut are the first
/// tokens of the whole text.
fn check_cut(
    tok: &Tokenizer,
    picks: &[usize],
    near: usize,
    special: bool,
) -> Result<(), TestCaseError> {
    prop_assert!(tok.cuts_are_safe);
    let text: String = picks
        .iter()
        .map(|&i| PIECES[i])
        .collect::<Vec<_>>()
        .join("");
    let Some(cut) = safe_cut(&text, near.min(text.len())) else {
        return Ok(());
    };
    let whole = tok.encode(&text, special).unwrap();
    let prefix = tok.encode(&text[..cut], special).unwrap();
    prop_assert!(prefix.len() <= whole.len());
    prop_assert_eq!(
        &whole[..prefix.len()],
        &prefix[..],
        "cut {} of {:?}",
        cut,
        text
    );
    Ok(())
}

/// Qwen2.5's vocabulary under the Llama 3 split (`pre = "llama-bpe"`, which
/// also skips the merges for whole-token words): no Llama 3 file is in the
/// test set, and the cut rule is about the split.
fn llama3_split_tokenizer() -> &'static Tokenizer {
    static TOK: OnceLock<Tokenizer> = OnceLock::new();
    TOK.get_or_init(|| {
        let content = model_content(QWEN2_FILE);
        let mut metadata = content.metadata.clone();
        metadata.insert(KEY_PRE.into(), Value::String("llama-bpe".into()));
        let content = Content {
            magic: content.magic,
            metadata,
            tensor_infos: Default::default(),
            tensor_data_offset: 0,
        };
        Tokenizer::from_gguf(&content).expect("tokenizer builds")
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
    #[test]
    fn a_safe_cut_never_changes_the_tokens_before_it(
        picks in proptest::collection::vec(0..PIECES.len(), 8..120),
        near in 0usize..400,
        special in any::<bool>(),
    ) {
        let Some(tok) = test_tokenizer() else { return Ok(()); };
        check_cut(tok, &picks, near, special)?;
    }

    #[test]
    fn a_safe_cut_never_changes_the_tokens_before_it_qwen2(
        picks in proptest::collection::vec(0..PIECES.len(), 8..120),
        near in 0usize..400,
        special in any::<bool>(),
    ) {
        check_cut(model_tokenizer(QWEN2_FILE), &picks, near, special)?;
    }

    #[test]
    fn a_safe_cut_never_changes_the_tokens_before_it_llama3_split(
        picks in proptest::collection::vec(0..PIECES.len(), 8..120),
        near in 0usize..400,
        special in any::<bool>(),
    ) {
        check_cut(llama3_split_tokenizer(), &picks, near, special)?;
    }
}

#[test]
fn a_long_text_is_known_too_long_from_a_prefix() {
    let Some(tok) = test_tokenizer() else {
        return;
    };
    assert!(tok.cuts_are_safe, "SmolLM2's control tokens hold no space");
    // About 4.6 bytes a token: 100 KB is ~20k tokens, under the byte bound's
    // reach for a limit of 8192, but its prefix shows it.
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
    // One that fits is not refused.
    let short = "the quick brown fox ".repeat(100);
    assert_eq!(tok.exceeds(&short, true, 8192).unwrap(), None);
    assert_eq!(safe_cut("ab", 0), None);
    assert_eq!(safe_cut("a b", 0), Some(1));
    assert_eq!(safe_cut("a  b", 0), None, "two spaces: the split differs");
}
