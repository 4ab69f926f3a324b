//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`) through the HF `tokenizers`
//! crate, assembled from GGUF metadata the way llama.cpp reads the same file.
//!
//! - model: BPE over the byte-level vocabulary as stored (`tokenizer.ggml.tokens`)
//!   with the ranked merges of `tokenizer.ggml.merges`;
//! - pre-tokenizer, by `tokenizer.ggml.pre` (llama.cpp's `llm_tokenizer_bpe`
//!   regexes in `src/llama-vocab.cpp`, as HF `tokenizer.json` files write them):
//!   - `smollm`: `\p{N}` then the GPT-2 regex, i.e. HF `Sequence[Digits(individual_digits),
//!     ByteLevel(add_prefix_space=false, use_regex=true)]`;
//!   - `gpt-2`: the GPT-2 regex alone;
//!   - `qwen2`: [`QWEN2_SPLIT`] (single digits), `llama-bpe` (Llama 3):
//!     [`LLAMA3_SPLIT`] (runs of up to three digits, and a word that is a whole
//!     token is taken as is, llama.cpp's `ignore_merges`), each as HF
//!     `Sequence[Split(regex, Isolated), ByteLevel(use_regex=false)]`;
//! - control tokens (`token_type` 3) are special added tokens, parsed from text
//!   only when asked; user-defined tokens (`token_type` 4) are always parsed,
//!   as in llama.cpp.

use super::metadata::{TokenizerError, KEY_MERGES, KEY_PRE, TYPE_CONTROL, TYPE_USER_DEFINED};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

/// The byte-level BPE engine.
pub(super) struct Bpe {
    /// Parses control tokens in text as special tokens.
    pub(super) with_special: tokenizers::Tokenizer,
    /// Same tokenizer with special-token parsing off (control token text is plain text).
    pub(super) without_special: tokenizers::Tokenizer,
}

/// The `tokenizer.ggml.pre` values [`build`] accepts, for error messages.
pub(super) const SUPPORTED_PRE: &str = "\"smollm\", \"gpt-2\", \"qwen2\", \"llama-bpe\"";

/// llama.cpp's Qwen2 split (`LLAMA_VOCAB_PRE_TYPE_QWEN2`): the Llama 3 regex
/// with single digits, contractions spelled out case-insensitively.
pub(super) const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// llama.cpp's Llama 3 split (`LLAMA_VOCAB_PRE_TYPE_LLAMA3`, `pre = "llama-bpe"`):
/// as [`QWEN2_SPLIT`] with runs of up to three digits.
pub(super) const LLAMA3_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// What [`build`] gives the [`super::Tokenizer`].
pub(super) struct Built {
    pub(super) engine: Bpe,
    /// Raw bytes of every token, indexed by id.
    pub(super) bytes: Vec<Vec<u8>>,
    /// Whether prompts start with BOS when the metadata does not say
    /// (llama.cpp: true for Llama 3's pre-tokenizer, else false).
    pub(super) add_bos_default: bool,
}

/// Whether [`build`] knows pre-tokenizer `pre`.
pub(super) fn supports(pre: &str) -> bool {
    matches!(pre, "smollm" | "gpt-2" | "qwen2" | "llama-bpe")
}

/// The HF pre-tokenizer for `pre` and whether whole-word tokens skip the merges.
fn pre_tokenizer(pre: &str) -> Result<(PreTokenizerWrapper, bool), TokenizerError> {
    let split = |regex: &str| {
        let split = Split::new(
            SplitPattern::Regex(regex.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| TokenizerError::Tokenizers {
            stage: "build",
            message: e.to_string(),
        })?;
        let bytes = ByteLevel::new(false, false, false);
        Ok::<PreTokenizerWrapper, TokenizerError>(
            Sequence::new(vec![split.into(), bytes.into()]).into(),
        )
    };
    let byte_level = ByteLevel::new(false, false, true);
    Ok(match pre {
        "smollm" => (
            Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
            false,
        ),
        "gpt-2" => (byte_level.into(), false),
        "qwen2" => (split(QWEN2_SPLIT)?, false),
        "llama-bpe" => (split(LLAMA3_SPLIT)?, true),
        other => {
            return Err(TokenizerError::Unsupported {
                key: KEY_PRE,
                found: other.to_string(),
                supported: SUPPORTED_PRE,
            })
        }
    })
}

/// Whether [`super::safe_cut`]'s rule holds for pre-tokenizer `pre`: no
/// pre-token crosses a space between two ASCII letters.
///
/// GPT-2's regex (Radford et al. 2019, `smollm` and `gpt-2`) ends a letter run
/// at a space and starts the next pre-token there, and digit splitting does not
/// touch letters. In the Qwen2 and Llama 3 regexes the only alternatives that
/// take a letter are the contractions (which end at their letter) and
/// `[^\r\n\p{L}\p{N}]?\p{L}+` (greedy: it ends at the space); the space then
/// opens the next pre-token (` b...`), and the pre-tokens before the letter only
/// look one character past their end, still inside the prefix. Checked on real
/// vocabularies by `cut_tests`.
pub(super) fn cuts_are_safe(pre: &str) -> bool {
    matches!(pre, "smollm" | "gpt-2" | "qwen2" | "llama-bpe")
}

/// GPT-2's byte-to-unicode table, inverted: printable char -> raw byte.
fn char_to_byte_table() -> std::collections::HashMap<char, u8> {
    let mut direct: Vec<u8> = Vec::with_capacity(256);
    direct.extend(b'!'..=b'~');
    direct.extend(0xA1u8..=0xAC);
    direct.extend(0xAEu8..=0xFF);
    let mut table = std::collections::HashMap::with_capacity(256);
    for &b in &direct {
        table.insert(char::from(b), b);
    }
    let mut n = 0u32;
    for b in 0..=255u8 {
        if !direct.contains(&b) {
            // 256 + n is always a valid scalar value (256..=323).
            let c = char::from_u32(256 + n).unwrap_or(char::REPLACEMENT_CHARACTER);
            table.insert(c, b);
            n += 1;
        }
    }
    table
}

/// Builds the byte-level BPE tokenizer of `tokens` (with their `types`) and
/// `merges` for pre-tokenizer `pre`.
///
/// Errors: an unsupported `pre`, a merge that is not `"a b"`, or the HF
/// tokenizer refusing the vocabulary.
pub(super) fn build(
    pre: &str,
    tokens: &[&str],
    types: &[i32],
    merges: Vec<&str>,
) -> Result<Built, TokenizerError> {
    let (pre_tokenizer, ignore_merges) = pre_tokenizer(pre)?;
    let merges = merges
        .into_iter()
        .enumerate()
        .map(|(i, m)| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| TokenizerError::Inconsistent {
                    key: KEY_MERGES,
                    detail: format!("merge {i} ({m:?}) is not two tokens separated by a space"),
                })
        })
        .collect::<Result<Vec<_>, _>>()?;

    let mut vocab = Vocab::with_capacity(tokens.len());
    for (id, t) in tokens.iter().enumerate() {
        // Duplicated strings keep their first id.
        vocab.entry(t.to_string()).or_insert(id as u32);
    }
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .ignore_merges(ignore_merges)
        .build()
        .map_err(|e| TokenizerError::Tokenizers {
            stage: "build",
            message: e.to_string(),
        })?;

    let mut hf = tokenizers::Tokenizer::new(bpe);
    hf.with_pre_tokenizer(Some(pre_tokenizer));
    hf.with_decoder(Some(ByteLevelDecoder::default()));
    let control: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, &ty)| ty == TYPE_CONTROL)
        .map(|(t, _)| AddedToken::from(t.to_string(), true))
        .collect();
    let user: Vec<AddedToken> = tokens
        .iter()
        .zip(types)
        .filter(|(_, &ty)| ty == TYPE_USER_DEFINED)
        .map(|(t, _)| AddedToken::from(t.to_string(), false).normalized(false))
        .collect();
    hf.add_special_tokens(&control);
    hf.add_tokens(&user);
    let mut without_special = hf.clone();
    without_special.set_encode_special_tokens(true);

    let table = char_to_byte_table();
    let bytes = tokens
        .iter()
        .zip(types)
        .map(|(t, &ty)| {
            if ty == TYPE_CONTROL || ty == TYPE_USER_DEFINED {
                t.as_bytes().to_vec()
            } else {
                let mut out = Vec::with_capacity(t.len());
                for c in t.chars() {
                    match table.get(&c) {
                        Some(&b) => out.push(b),
                        // Not a byte-level char: keep its UTF-8 text.
                        None => out.extend_from_slice(c.encode_utf8(&mut [0; 4]).as_bytes()),
                    }
                }
                out
            }
        })
        .collect();
    Ok(Built {
        engine: Bpe {
            with_special: hf,
            without_special,
        },
        bytes,
        add_bos_default: pre == "llama-bpe",
    })
}
