//! Byte-level BPE tokenizer built from GGUF metadata.
//!
//! The tokenizer is assembled in code from the `tokenizer.ggml.*` keys of a GGUF
//! file (no `tokenizer.json`), so that it matches what llama.cpp does with the
//! same file:
//!
//! - model: BPE over the byte-level vocabulary as stored (`tokenizer.ggml.tokens`)
//!   with the ranked merges of `tokenizer.ggml.merges`;
//! - pre-tokenizer: for `tokenizer.ggml.pre = "smollm"`, llama.cpp's regexes
//!   `\p{N}` then the GPT-2 regex, i.e. HF `Sequence[Digits(individual_digits),
//!   ByteLevel(add_prefix_space=false, use_regex=true)]`; `"gpt-2"` is the
//!   GPT-2 regex alone;
//! - control tokens (`token_type` 3) are special added tokens, parsed from text
//!   only when asked; user-defined tokens (`token_type` 4) are always parsed,
//!   as in llama.cpp.
//!
//! Decoding does not go through the HF decoder: every token maps to the raw
//! bytes it stands for ([`Tokenizer::token_bytes`]), which is also what the
//! incremental decoder in [`crate::detok`] uses.

use candle_core::quantized::gguf_file::{Content, Value};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper};

/// GGUF key of the tokenizer model name (must be `gpt2`).
pub const KEY_MODEL: &str = "tokenizer.ggml.model";
/// GGUF key of the pre-tokenizer name (`smollm` or `gpt-2`).
pub const KEY_PRE: &str = "tokenizer.ggml.pre";
/// GGUF key of the token strings (byte-level encoded).
pub const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
/// GGUF key of the per-token types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
pub const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
/// GGUF key of the BPE merges (`"a b"` strings, highest priority first).
pub const KEY_MERGES: &str = "tokenizer.ggml.merges";
/// GGUF key of the beginning-of-sequence token id.
pub const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
/// GGUF key of the end-of-sequence token id.
pub const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
/// GGUF key saying whether a BOS token is prepended to prompts.
pub const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";

/// `token_type` value of a normal token.
const TYPE_NORMAL: i32 = 1;
/// `token_type` value of a control token (`<|im_start|>`, ...).
const TYPE_CONTROL: i32 = 3;
/// `token_type` value of a user-defined token.
const TYPE_USER_DEFINED: i32 = 4;

/// Errors building or using a [`Tokenizer`].
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A required metadata key is absent.
    #[error("GGUF metadata key `{key}` is missing")]
    MissingKey {
        /// The missing key.
        key: &'static str,
    },
    /// A metadata key holds a value of the wrong type.
    #[error("GGUF metadata key `{key}` must be {expected}")]
    WrongType {
        /// The offending key.
        key: &'static str,
        /// What the key should hold.
        expected: &'static str,
    },
    /// The metadata names a tokenizer this crate does not implement.
    #[error("GGUF metadata key `{key}` = {found:?} is not supported (supported: {supported})")]
    Unsupported {
        /// The offending key.
        key: &'static str,
        /// The value found.
        found: String,
        /// The values this crate supports.
        supported: &'static str,
    },
    /// Metadata arrays or ids that do not fit together.
    #[error("GGUF metadata key `{key}` is inconsistent: {detail}")]
    Inconsistent {
        /// The offending key.
        key: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// The HF tokenizer refused to build or encode.
    #[error("tokenizer {stage} failed: {message}")]
    Tokenizers {
        /// `build` or `encode`.
        stage: &'static str,
        /// The underlying error message.
        message: String,
    },
}

impl TokenizerError {
    /// A stable machine-readable label for the error kind.
    pub fn label(&self) -> &'static str {
        match self {
            Self::MissingKey { .. } => "missing_key",
            Self::WrongType { .. } => "wrong_type",
            Self::Unsupported { .. } => "unsupported",
            Self::Inconsistent { .. } => "inconsistent",
            Self::Tokenizers { .. } => "tokenizers",
        }
    }
}

/// A byte-level BPE tokenizer equivalent to llama.cpp's for the same GGUF.
///
/// Cheap to share behind an `Arc`; all methods take `&self`.
pub struct Tokenizer {
    /// Parses control tokens in text as special tokens.
    with_special: tokenizers::Tokenizer,
    /// Same tokenizer with special-token parsing off (control token text is plain text).
    without_special: tokenizers::Tokenizer,
    /// Raw bytes of every token, indexed by id.
    bytes: Vec<Vec<u8>>,
    /// Whether each token is a control token (skipped by `decode(.., true)`).
    control: Vec<bool>,
    /// The longest token's byte length (at least 1): no token covers more input.
    max_token_bytes: usize,
    /// No control or user-defined token contains a space, so none can span a
    /// [`safe_cut`] (see [`Tokenizer::exceeds`]).
    cuts_are_safe: bool,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    /// Built on first use: most requests never ask for a format.
    grammar:
        std::sync::OnceLock<Result<crate::grammar::GrammarCompiler, crate::grammar::GrammarError>>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab_size", &self.bytes.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

fn get<'a>(content: &'a Content, key: &'static str) -> Result<&'a Value, TokenizerError> {
    content
        .metadata
        .get(key)
        .ok_or(TokenizerError::MissingKey { key })
}

fn get_str<'a>(content: &'a Content, key: &'static str) -> Result<&'a str, TokenizerError> {
    match get(content, key)? {
        Value::String(s) => Ok(s),
        _ => Err(TokenizerError::WrongType {
            key,
            expected: "a string",
        }),
    }
}

fn get_str_array<'a>(
    content: &'a Content,
    key: &'static str,
) -> Result<Vec<&'a str>, TokenizerError> {
    let wrong = || TokenizerError::WrongType {
        key,
        expected: "an array of strings",
    };
    match get(content, key)? {
        Value::Array(items) => items
            .iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.as_str()),
                _ => Err(wrong()),
            })
            .collect(),
        _ => Err(wrong()),
    }
}

/// An integer value of any GGUF integer type, as i64.
fn as_int(v: &Value) -> Option<i64> {
    Some(match *v {
        Value::U8(x) => x.into(),
        Value::I8(x) => x.into(),
        Value::U16(x) => x.into(),
        Value::I16(x) => x.into(),
        Value::U32(x) => x.into(),
        Value::I32(x) => x.into(),
        Value::U64(x) => i64::try_from(x).ok()?,
        Value::I64(x) => x,
        _ => return None,
    })
}

/// An optional token id; negative values (llama.cpp's "none") give `None`.
fn get_token_id(
    content: &Content,
    key: &'static str,
    vocab: usize,
) -> Result<Option<u32>, TokenizerError> {
    let Some(v) = content.metadata.get(key) else {
        return Ok(None);
    };
    let id = as_int(v).ok_or(TokenizerError::WrongType {
        key,
        expected: "an integer",
    })?;
    if id < 0 {
        return Ok(None);
    }
    match u32::try_from(id) {
        Ok(id) if (id as usize) < vocab => Ok(Some(id)),
        _ => Err(TokenizerError::Inconsistent {
            key,
            detail: format!("token id {id} is outside the vocabulary of {vocab} tokens"),
        }),
    }
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

/// Bytes of prefix [`Tokenizer::exceeds`] tokenizes per allowed token: ordinary
/// text averages 3 to 5 bytes a token, so a prefix this long usually holds more
/// tokens than allowed when the whole text does.
pub const PREFIX_BYTES_PER_TOKEN: usize = 6;

/// How far past `near` [`safe_cut`] looks for a cut before giving up, in bytes.
const CUT_SEARCH_BYTES: usize = 4096;

/// The first index at or after `near` (within [`CUT_SEARCH_BYTES`]) where `text`
/// has a space between two ASCII letters: `text[..i]` ends with the letter and
/// `text[i..]` starts with the space (a char boundary: all three are ASCII).
fn safe_cut(text: &str, near: usize) -> Option<usize> {
    let b = text.as_bytes();
    let end = near
        .saturating_add(CUT_SEARCH_BYTES)
        .min(b.len().saturating_sub(1));
    (near.max(1)..end)
        .find(|&i| b[i] == b' ' && b[i - 1].is_ascii_alphabetic() && b[i + 1].is_ascii_alphabetic())
}

impl Tokenizer {
    /// Builds the tokenizer from the `tokenizer.ggml.*` metadata of a GGUF file.
    ///
    /// Errors name the metadata key at fault: a missing key, a tokenizer model
    /// other than `gpt2`, a pre-tokenizer other than `smollm`/`gpt-2`, arrays of
    /// different lengths, or a merge that is not `"a b"`.
    pub fn from_gguf(content: &Content) -> Result<Self, TokenizerError> {
        let model = get_str(content, KEY_MODEL)?;
        if model != "gpt2" {
            return Err(TokenizerError::Unsupported {
                key: KEY_MODEL,
                found: model.to_string(),
                supported: "\"gpt2\"",
            });
        }
        let pre = get_str(content, KEY_PRE)?;
        let byte_level = ByteLevel::new(false, false, true);
        let pre_tokenizer: PreTokenizerWrapper = match pre {
            "smollm" => Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
            "gpt-2" => byte_level.into(),
            other => {
                return Err(TokenizerError::Unsupported {
                    key: KEY_PRE,
                    found: other.to_string(),
                    supported: "\"smollm\", \"gpt-2\"",
                })
            }
        };

        let tokens = get_str_array(content, KEY_TOKENS)?;
        let types: Vec<i32> = match content.metadata.get(KEY_TOKEN_TYPE) {
            None => vec![TYPE_NORMAL; tokens.len()],
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| as_int(v).and_then(|x| i32::try_from(x).ok()))
                .collect::<Option<_>>()
                .ok_or(TokenizerError::WrongType {
                    key: KEY_TOKEN_TYPE,
                    expected: "an array of integers",
                })?,
            Some(_) => {
                return Err(TokenizerError::WrongType {
                    key: KEY_TOKEN_TYPE,
                    expected: "an array of integers",
                })
            }
        };
        if types.len() != tokens.len() {
            return Err(TokenizerError::Inconsistent {
                key: KEY_TOKEN_TYPE,
                detail: format!(
                    "{} entries for {} tokens in `{KEY_TOKENS}`",
                    types.len(),
                    tokens.len()
                ),
            });
        }
        let merges = get_str_array(content, KEY_MERGES)?
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
            // Duplicated strings keep their first id, as llama.cpp's text->id map does.
            vocab.entry(t.to_string()).or_insert(id as u32);
        }
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
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
            .zip(&types)
            .filter(|(_, &ty)| ty == TYPE_CONTROL)
            .map(|(t, _)| AddedToken::from(t.to_string(), true))
            .collect();
        let user: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
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
            .zip(&types)
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
            .collect::<Vec<Vec<u8>>>();
        let max_token_bytes = bytes.iter().map(Vec::len).max().unwrap_or(1).max(1);
        // The cut rule is proven for the GPT-2 split only (a new pre-tokenizer must
        // be added here deliberately, with the proptest run on its files).
        let gpt2_split = matches!(pre, "smollm" | "gpt-2");
        let cuts_are_safe = gpt2_split
            && !tokens
                .iter()
                .zip(&types)
                .any(|(t, &ty)| (ty == TYPE_CONTROL || ty == TYPE_USER_DEFINED) && t.contains(' '));
        let control = types.iter().map(|&ty| ty == TYPE_CONTROL).collect();

        let add_bos = match content.metadata.get(KEY_ADD_BOS) {
            None => false,
            Some(Value::Bool(b)) => *b,
            Some(_) => {
                return Err(TokenizerError::WrongType {
                    key: KEY_ADD_BOS,
                    expected: "a bool",
                })
            }
        };
        Ok(Self {
            with_special: hf,
            without_special,
            bytes,
            control,
            max_token_bytes,
            cuts_are_safe,
            bos: get_token_id(content, KEY_BOS, tokens.len())?,
            eos: get_token_id(content, KEY_EOS, tokens.len())?,
            add_bos,
            grammar: std::sync::OnceLock::new(),
        })
    }

    /// Encodes `text` into token ids. Never adds BOS.
    ///
    /// With `parse_special`, control-token text such as `<|im_start|>` becomes the
    /// control token; without it, that text is tokenized as ordinary text.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let tk = if parse_special {
            &self.with_special
        } else {
            &self.without_special
        };
        let enc = tk
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Tokenizers {
                stage: "encode",
                message: e.to_string(),
            })?;
        Ok(enc.get_ids().to_vec())
    }

    /// The fewest tokens `text_bytes` bytes of text can encode to, computed without
    /// tokenizing: each token covers at most [`Self::max_token_bytes`] bytes of the
    /// input (byte-level BPE splits the text into contiguous pieces, one per token,
    /// and control-token text counts as its own bytes). The gateway uses it to
    /// refuse a prompt far over the context window before spending seconds on it.
    pub fn min_tokens(&self, text_bytes: usize) -> usize {
        text_bytes.div_ceil(self.max_token_bytes)
    }

    /// Whether `text` is known to encode to more than `limit` tokens, found
    /// without tokenizing all of it: `Some(n)` with `n > limit` a lower bound, or
    /// `None` when it may fit (the caller tokenizes it and checks).
    ///
    /// First the byte bound ([`Self::min_tokens`]); then, for a text over
    /// [`PREFIX_BYTES_PER_TOKEN`] bytes per allowed token, only a prefix is
    /// tokenized, cut where the prefix's tokens are exactly the first tokens of the
    /// whole text: at a space between two ASCII letters. No pre-token of the GPT-2
    /// split (`smollm` and `gpt-2` here; Radford et al. 2019, the regex in
    /// `tokenizers`' `ByteLevel`) crosses such a space, and digit splitting does not
    /// either, so BPE merges nothing across it; no control or user-defined token
    /// contains a space, or the prefix check is skipped.
    ///
    /// Errors: the tokenizer failed on the prefix.
    pub fn exceeds(
        &self,
        text: &str,
        parse_special: bool,
        limit: usize,
    ) -> Result<Option<usize>, TokenizerError> {
        let at_least = self.min_tokens(text.len());
        if at_least > limit {
            return Ok(Some(at_least));
        }
        let prefix_bytes = limit
            .saturating_add(1)
            .saturating_mul(PREFIX_BYTES_PER_TOKEN);
        if !self.cuts_are_safe || text.len() <= prefix_bytes {
            return Ok(None);
        }
        let Some(cut) = safe_cut(text, prefix_bytes) else {
            return Ok(None);
        };
        let n = self.encode(&text[..cut], parse_special)?.len();
        Ok((n > limit).then_some(n))
    }

    /// The longest token, in bytes (control tokens by their text).
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// Decodes ids to text; invalid UTF-8 becomes U+FFFD and unknown ids are ignored.
    ///
    /// With `skip_special`, control tokens produce no text.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        let mut buf = Vec::new();
        for &id in ids {
            if skip_special && self.is_control(id) {
                continue;
            }
            if let Some(b) = self.bytes.get(id as usize) {
                buf.extend_from_slice(b);
            }
        }
        String::from_utf8_lossy(&buf).into_owned()
    }

    /// The raw bytes token `id` stands for after byte-level decoding (possibly
    /// part of a UTF-8 character). Control tokens give their text; an unknown
    /// id gives no bytes.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.token_bytes_ref(id).to_vec()
    }

    /// Like [`Tokenizer::token_bytes`] without allocating.
    pub fn token_bytes_ref(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// Whether `id` is a control token (`token_type` 3), e.g. `<|im_end|>`.
    pub fn is_control(&self, id: u32) -> bool {
        self.control.get(id as usize).copied().unwrap_or(false)
    }

    /// Number of tokens in the vocabulary (the logits width).
    pub fn vocab_size(&self) -> usize {
        self.bytes.len()
    }

    /// The beginning-of-sequence token, if the model declares one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence token, if the model declares one.
    pub fn eos_id(&self) -> Option<u32> {
        self.eos
    }

    /// Whether prompts should start with BOS (`tokenizer.ggml.add_bos_token`, default false).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// The id of the token whose stored string is exactly `text` (e.g. `"<|im_end|>"`;
    /// normal tokens are looked up in their byte-level form, e.g. `"Ġworld"`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.with_special.token_to_id(text)
    }

    /// The constrained-decoding compiler for this vocabulary, built on the first call
    /// (tens of ms) and shared by every later one.
    ///
    /// Errors: [`crate::grammar::GrammarError::Vocabulary`] when the vocabulary cannot
    /// be loaded into the constraint engine (then every call fails alike).
    pub fn grammar(
        &self,
    ) -> Result<&crate::grammar::GrammarCompiler, crate::grammar::GrammarError> {
        self.grammar
            .get_or_init(|| {
                let vocab = (0..self.vocab_size() as u32)
                    .map(|id| (self.token_bytes_ref(id), self.is_control(id)));
                crate::grammar::GrammarCompiler::new(vocab, self.eos_id(), self.bos_id())
            })
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The stored string of token `id` (byte-level form for normal tokens).
    pub fn token_text(&self, id: u32) -> Option<String> {
        self.with_special.id_to_token(id)
    }
}

#[cfg(test)]
pub(crate) mod tests {
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
            .insert(KEY_MODEL.into(), Value::String("llama".into()));
        let err = Tokenizer::from_gguf(&bad).unwrap_err();
        assert_eq!(err.label(), "unsupported");
        assert!(err.to_string().contains(KEY_MODEL), "{err}");

        bad.metadata
            .insert(KEY_MODEL.into(), Value::String("gpt2".into()));
        bad.metadata
            .insert(KEY_PRE.into(), Value::String("qwen2".into()));
        let err = Tokenizer::from_gguf(&bad).unwrap_err();
        assert!(err.to_string().contains(KEY_PRE), "{err}");

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
        ids: Vec<u32>,
    }

    fn yes() -> bool {
        true
    }

    /// Our ids equal llama.cpp's (via llama-cpp-python) for every case of
    /// `backend/model/tests/data/tokenizer_reference.json`.
    #[test]
    fn matches_llama_cpp_reference() {
        let Some(tok) = test_tokenizer() else { return };
        let path =
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/tokenizer_reference.json");
        let text = std::fs::read_to_string(&path).expect("reference file exists");
        let reference: Reference = serde_json::from_str(&text).expect("reference parses");
        assert!(!reference.command.is_empty());
        assert!(reference.cases.len() >= 20);
        for case in &reference.cases {
            let ids = tok.encode(&case.text, case.special).unwrap();
            assert_eq!(
                ids, case.ids,
                "text {:?} special {}",
                case.text, case.special
            );
            assert_eq!(tok.decode(&ids, false), case.text);
        }
    }
}

/// The cut rule of [`Tokenizer::exceeds`], checked on the real tokenizer: at every
/// [`safe_cut`], the prefix's tokens are exactly the whole text's first tokens.
#[cfg(test)]
mod cut_tests {
    use super::tests::test_tokenizer;
    use super::*;
    use proptest::prelude::*;

    /// Text pieces that stress the GPT-2 split: words, runs of spaces, newlines,
    /// digits, punctuation, contractions, non-ASCII letters, emoji, control-token
    /// text.
    const PIECES: &[&str] = &[
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

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]
        #[test]
        fn a_safe_cut_never_changes_the_tokens_before_it(
            picks in proptest::collection::vec(0..PIECES.len(), 8..120),
            near in 0usize..400,
            special in any::<bool>(),
        ) {
            let Some(tok) = test_tokenizer() else { return Ok(()); };
            prop_assume!(tok.cuts_are_safe);
            let text: String = picks.iter().map(|&i| PIECES[i]).collect::<Vec<_>>().join("");
            let Some(cut) = safe_cut(&text, near.min(text.len())) else { return Ok(()); };
            let whole = tok.encode(&text, special).unwrap();
            let prefix = tok.encode(&text[..cut], special).unwrap();
            prop_assert!(prefix.len() <= whole.len());
            prop_assert_eq!(&whole[..prefix.len()], &prefix[..], "cut {} of {:?}", cut, text);
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
}
