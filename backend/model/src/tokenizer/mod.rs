//! Tokenizers built from GGUF metadata, each matching llama.cpp on the same file.
//!
//! The tokenizer is assembled in code from the `tokenizer.ggml.*` keys of a GGUF
//! file (no `tokenizer.json`), one of two kinds by `tokenizer.ggml.model`:
//!
//! - `gpt2`: byte-level BPE with a ranked merge list and a pre-tokenizer named by
//!   `tokenizer.ggml.pre` (`smollm`, `gpt-2`, `qwen2`, `llama-bpe`), through the HF
//!   `tokenizers` crate (module `bpe`);
//! - `llama`: SentencePiece-style BPE driven by `tokenizer.ggml.scores`, with byte
//!   fallback (module `spm`, llama.cpp's `llm_tokenizer_spm`); special-token text
//!   is cut out first as llama.cpp's `tokenizer_st_partition` does (module
//!   `special`).
//!
//! In both, control tokens (`token_type` 3) are parsed from text only when asked,
//! and user-defined tokens (`token_type` 4) always, as in llama.cpp.
//!
//! Decoding does not go through the HF decoder: every token maps to the raw
//! bytes it stands for ([`Tokenizer::token_bytes`]: byte-level characters back to
//! bytes for `gpt2`; `▁` to a space and `<0xNN>` to its byte for `llama`), which
//! is also what the incremental decoder in [`crate::detok`] uses.

mod bpe;
#[cfg(test)]
mod gguf_tests;
mod metadata;
mod special;
mod spm;

use bpe::Bpe;
pub use metadata::*;

use candle_core::quantized::gguf_file::{Content, Value};

/// The `tokenizer.ggml.model` values [`Tokenizer::from_gguf`] accepts.
const SUPPORTED_MODELS: &str = "\"gpt2\", \"llama\"";
/// The `tokenizer.ggml.pre` values accepted with `tokenizer.ggml.model = "llama"`.
const SUPPORTED_SPM_PRE: &str = "\"default\" (or no key)";

/// A tokenizer equivalent to llama.cpp's for the same GGUF (byte-level BPE or
/// SentencePiece-style, see the module docs).
///
/// Cheap to share behind an `Arc`; all methods take `&self`.
pub struct Tokenizer {
    /// How text becomes ids.
    engine: Engine,
    /// Raw bytes of every token, indexed by id.
    bytes: Vec<Vec<u8>>,
    /// Whether each token is a control token (skipped by `decode(.., true)`).
    control: Vec<bool>,
    /// The most bytes of input one token can stand for (at least 1): no token
    /// covers more (see [`Tokenizer::min_tokens`]).
    max_token_bytes: usize,
    /// The pre-tokenizer never joins text across a [`safe_cut`] and no control or
    /// user-defined token contains a space (see [`Tokenizer::exceeds`]).
    cuts_are_safe: bool,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    /// Built on first use: most requests never ask for a format.
    grammar:
        std::sync::OnceLock<Result<crate::grammar::GrammarCompiler, crate::grammar::GrammarError>>,
}

/// How text becomes ids, by `tokenizer.ggml.model`.
enum Engine {
    /// `gpt2`: byte-level BPE.
    Bpe(Box<Bpe>),
    /// `llama`: SentencePiece-style BPE by scores.
    Spm(Box<Spm>),
}

/// The SentencePiece-style engine.
struct Spm {
    /// The score-ranked vocabulary.
    vocab: spm::Spm,
    /// Control, unknown and user-defined tokens, cut out of the text first.
    specials: special::SpecialTokens,
    /// Write a space before the text and after each special token.
    add_space_prefix: bool,
    /// Every token's text as stored, indexed by id.
    texts: Vec<String>,
}

impl Spm {
    /// llama.cpp's SPM `tokenize` without BOS/EOS: special tokens cut out, each
    /// plain piece escaped (and given a leading `▁` after a special token or at
    /// the start when `add_space_prefix`) and tokenized alone.
    fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 1);
        let mut after_special = true;
        for fragment in self.specials.partition(text, parse_special) {
            match fragment {
                special::Fragment::Text(t) => {
                    let escaped = spm::escape(t, self.add_space_prefix && after_special);
                    self.vocab
                        .tokenize(&escaped, &mut out)
                        .map_err(|spm::MissingByte(b)| TokenizerError::Inconsistent {
                            key: KEY_TOKENS,
                            detail: format!(
                                "no byte token <0x{b:02X}> for a character outside the vocabulary"
                            ),
                        })?;
                    after_special = false;
                }
                special::Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
            }
        }
        Ok(out)
    }
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field(
                "model",
                &match self.engine {
                    Engine::Bpe(_) => "gpt2",
                    Engine::Spm(_) => "llama",
                },
            )
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

/// An optional bool key; `default` when absent.
fn get_bool(content: &Content, key: &'static str, default: bool) -> Result<bool, TokenizerError> {
    match content.metadata.get(key) {
        None => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(TokenizerError::WrongType {
            key,
            expected: "a bool",
        }),
    }
}

/// The type of each of `n` tokens; all normal when the key is absent.
fn get_types(content: &Content, n: usize) -> Result<Vec<i32>, TokenizerError> {
    let wrong = TokenizerError::WrongType {
        key: KEY_TOKEN_TYPE,
        expected: "an array of integers",
    };
    let types: Vec<i32> = match content.metadata.get(KEY_TOKEN_TYPE) {
        None => vec![TYPE_NORMAL; n],
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| as_int(v).and_then(|x| i32::try_from(x).ok()))
            .collect::<Option<_>>()
            .ok_or(wrong)?,
        Some(_) => return Err(wrong),
    };
    if types.len() != n {
        return Err(TokenizerError::Inconsistent {
            key: KEY_TOKEN_TYPE,
            detail: format!("{} entries for {n} tokens in `{KEY_TOKENS}`", types.len()),
        });
    }
    Ok(types)
}

/// The score of each of `n` tokens (float or integer array, at least `n`
/// entries); all 0 when the key is absent, as in llama.cpp.
fn get_scores(content: &Content, n: usize) -> Result<Vec<f32>, TokenizerError> {
    let wrong = TokenizerError::WrongType {
        key: KEY_SCORES,
        expected: "an array of numbers",
    };
    let scores: Vec<f32> = match content.metadata.get(KEY_SCORES) {
        None => return Ok(vec![0.0; n]),
        Some(Value::Array(items)) => items
            .iter()
            .map(|v| match *v {
                Value::F32(x) => Some(x),
                // llama.cpp reads integer scores as floats too.
                _ => as_int(v).map(|x| x as f32),
            })
            .collect::<Option<_>>()
            .ok_or(wrong)?,
        Some(_) => return Err(wrong),
    };
    if scores.len() < n {
        return Err(TokenizerError::Inconsistent {
            key: KEY_SCORES,
            detail: format!("{} entries for {n} tokens in `{KEY_TOKENS}`", scores.len()),
        });
    }
    Ok(scores)
}

/// The bytes a `llama` (SPM) token stands for, as llama.cpp's `token_to_piece`
/// gives them: a normal token's text with `▁` as a space, a byte token's byte,
/// a control, unknown or user-defined token's text, nothing for other types.
fn spm_token_bytes(text: &str, ty: i32) -> Vec<u8> {
    match ty {
        TYPE_NORMAL => text.replace(spm::ESCAPED_SPACE, " ").into_bytes(),
        TYPE_BYTE => text
            .strip_prefix("<0x")
            .and_then(|h| h.strip_suffix('>'))
            .filter(|h| h.len() == 2)
            .and_then(|h| u8::from_str_radix(h, 16).ok())
            .map_or_else(|| text.as_bytes().to_vec(), |b| vec![b]),
        TYPE_CONTROL | TYPE_UNKNOWN | TYPE_USER_DEFINED => text.as_bytes().to_vec(),
        _ => Vec::new(),
    }
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
    /// other than `gpt2`/`llama`, a pre-tokenizer other than those listed on
    /// [`KEY_PRE`], arrays of different lengths, or a merge that is not `"a b"`.
    pub fn from_gguf(content: &Content) -> Result<Self, TokenizerError> {
        let model = get_str(content, KEY_MODEL)?;
        if !matches!(model, "gpt2" | "llama") {
            return Err(TokenizerError::Unsupported {
                key: KEY_MODEL,
                found: model.to_string(),
                supported: SUPPORTED_MODELS,
            });
        }
        // Checked before the large arrays are read.
        let pre = match content.metadata.get(KEY_PRE) {
            None if model == "llama" => "default",
            None => return Err(TokenizerError::MissingKey { key: KEY_PRE }),
            Some(Value::String(s)) => s.as_str(),
            Some(_) => {
                return Err(TokenizerError::WrongType {
                    key: KEY_PRE,
                    expected: "a string",
                })
            }
        };
        if model == "gpt2" && !bpe::supports(pre) {
            return Err(TokenizerError::Unsupported {
                key: KEY_PRE,
                found: pre.to_string(),
                supported: bpe::SUPPORTED_PRE,
            });
        }
        if model == "llama" && pre != "default" {
            return Err(TokenizerError::Unsupported {
                key: KEY_PRE,
                found: pre.to_string(),
                supported: SUPPORTED_SPM_PRE,
            });
        }
        let tokens = get_str_array(content, KEY_TOKENS)?;
        let types = special::llama_cpp_types(&tokens, &get_types(content, tokens.len())?);
        let special_has_space = tokens
            .iter()
            .zip(&types)
            .any(|(t, &ty)| (ty == TYPE_CONTROL || ty == TYPE_USER_DEFINED) && t.contains(' '));

        let (engine, bytes, control, max_token_bytes, cuts_are_safe, add_bos_default) =
            if model == "gpt2" {
                let built = bpe::build(pre, &tokens, &types, get_str_array(content, KEY_MERGES)?)?;
                // Each token stands for exactly its bytes of input.
                let max = built.bytes.iter().map(Vec::len).max().unwrap_or(1);
                // The cut rule is proven per pre-tokenizer (a new one must be added
                // there deliberately, with the proptest run on its files).
                let cuts = bpe::cuts_are_safe(pre) && !special_has_space;
                let control = types.iter().map(|&ty| ty == TYPE_CONTROL).collect();
                let add_bos = built.add_bos_default;
                (
                    Engine::Bpe(Box::new(built.engine)),
                    built.bytes,
                    control,
                    max,
                    cuts,
                    add_bos,
                )
            } else {
                let scores = get_scores(content, tokens.len())?;
                // llama.cpp renames an empty token so that it cannot match.
                let texts: Vec<String> = tokens
                    .iter()
                    .enumerate()
                    .map(|(i, t)| match t.is_empty() {
                        true => format!("[EMPTY_{i}]"),
                        false => t.to_string(),
                    })
                    .collect();
                let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
                let specials =
                    special::SpecialTokens::new(refs.iter().zip(&types).enumerate().filter_map(
                        |(id, (t, &ty))| match ty {
                            TYPE_CONTROL | TYPE_UNKNOWN => Some((*t, id as u32, true)),
                            TYPE_USER_DEFINED => Some((*t, id as u32, false)),
                            _ => None,
                        },
                    ));
                let bytes = refs
                    .iter()
                    .zip(&types)
                    .map(|(t, &ty)| spm_token_bytes(t, ty))
                    .collect();
                // A token covers at most its stored text: each `▁` in it stands for
                // a space (1 byte) or a literal `▁` of the input (3 bytes).
                let max = refs.iter().map(|t| t.len()).max().unwrap_or(1);
                let control = types
                    .iter()
                    .map(|&ty| ty == TYPE_CONTROL || ty == TYPE_UNKNOWN)
                    .collect();
                let engine = Spm {
                    vocab: spm::Spm::new(&refs, &scores),
                    specials,
                    add_space_prefix: get_bool(content, KEY_ADD_SPACE_PREFIX, true)?,
                    texts,
                };
                // No pre-tokenizer: SPM merges across spaces, so no cut is safe.
                (
                    Engine::Spm(Box::new(engine)),
                    bytes,
                    control,
                    max,
                    false,
                    true,
                )
            };
        Ok(Self {
            engine,
            bytes,
            control,
            max_token_bytes: max_token_bytes.max(1),
            cuts_are_safe,
            bos: get_token_id(content, KEY_BOS, tokens.len())?,
            eos: get_token_id(content, KEY_EOS, tokens.len())?,
            add_bos: get_bool(content, KEY_ADD_BOS, add_bos_default)?,
            add_eos: get_bool(content, KEY_ADD_EOS, false)?,
            grammar: std::sync::OnceLock::new(),
        })
    }

    /// Encodes `text` into token ids. Never adds BOS or EOS (see
    /// [`Self::encode_with_bos_eos`]).
    ///
    /// With `parse_special`, control-token text such as `<|im_start|>` becomes the
    /// control token; without it, that text is tokenized as ordinary text.
    /// User-defined tokens are always parsed.
    ///
    /// Errors: the HF tokenizer failed (`gpt2`), or a character outside a `llama`
    /// vocabulary has no byte token to fall back to.
    pub fn encode(&self, text: &str, parse_special: bool) -> Result<Vec<u32>, TokenizerError> {
        match &self.engine {
            Engine::Bpe(bpe) => {
                let tk = if parse_special {
                    &bpe.with_special
                } else {
                    &bpe.without_special
                };
                let enc = tk
                    .encode_fast(text, false)
                    .map_err(|e| TokenizerError::Tokenizers {
                        stage: "encode",
                        message: e.to_string(),
                    })?;
                Ok(enc.get_ids().to_vec())
            }
            Engine::Spm(spm) => spm.encode(text, parse_special),
        }
    }

    /// [`Self::encode`] with BOS in front when [`Self::add_bos`] and EOS at the end
    /// when [`Self::add_eos`] (llama.cpp's `tokenize` with `add_special`): a whole
    /// prompt as the model expects it, for a caller that does not place them itself.
    /// A flag whose token the model does not declare adds nothing.
    ///
    /// Errors: as [`Self::encode`].
    pub fn encode_with_bos_eos(
        &self,
        text: &str,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut ids = Vec::new();
        if let (true, Some(bos)) = (self.add_bos, self.bos) {
            ids.push(bos);
        }
        ids.extend(self.encode(text, parse_special)?);
        if let (true, Some(eos)) = (self.add_eos, self.eos) {
            ids.push(eos);
        }
        Ok(ids)
    }

    /// The fewest tokens `text_bytes` bytes of text can encode to, computed without
    /// tokenizing: each token covers at most [`Self::max_token_bytes`] bytes of the
    /// input (both tokenizers split the text into contiguous pieces, one per token
    /// or per byte token, and special-token text counts as its own bytes; an SPM
    /// space prefix only adds tokens). The gateway uses it to refuse a prompt far
    /// over the context window before spending seconds on it.
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
    /// either, so BPE merges nothing across it; nor does one of the Qwen2 or Llama 3
    /// splits (`qwen2`, `llama-bpe`; the argument on `bpe::cuts_are_safe`). No
    /// control or user-defined token may contain a space, or the prefix check is
    /// skipped. It is skipped for `llama` (SPM) vocabularies too: with no
    /// pre-tokenizer, SPM merges across spaces, so a prefix's tokens need not be
    /// the whole text's; there only the byte bound refuses.
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

    /// The most input bytes one token stands for: the longest token in bytes for
    /// `gpt2` (control tokens by their text); the longest stored text for `llama`,
    /// where a `▁` may stand for a literal `▁` (3 bytes) of the input. At least 1.
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

    /// The raw bytes token `id` stands for (possibly part of a UTF-8 character):
    /// byte-level characters decoded (`gpt2`), `▁` as a space and `<0xNN>` as its
    /// byte (`llama`). Control and user-defined tokens give their text; an
    /// unknown id, and a `llama` token of an unused or undefined type, no bytes.
    pub fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.token_bytes_ref(id).to_vec()
    }

    /// Like [`Tokenizer::token_bytes`] without allocating.
    pub fn token_bytes_ref(&self, id: u32) -> &[u8] {
        self.bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// Whether `id` is a control token (`token_type` 3, and for `llama` the unknown
    /// token, type 2, which llama.cpp treats alike), e.g. `<|im_end|>`.
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

    /// Whether prompts should start with BOS (`tokenizer.ggml.add_bos_token`; when
    /// absent, llama.cpp's default: true for `llama` and for `pre = "llama-bpe"`,
    /// else false).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }

    /// Tokens [`Self::encode_with_bos_eos`] adds around the text's own: 0, 1 or 2.
    pub fn added_special_tokens(&self) -> usize {
        usize::from(self.add_bos && self.bos.is_some())
            + usize::from(self.add_eos && self.eos.is_some())
    }

    /// Whether prompts should end with EOS (`tokenizer.ggml.add_eos_token`, default false).
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }

    /// The id of the token whose stored string is exactly `text` (e.g. `"<|im_end|>"`;
    /// normal tokens are looked up in their stored form, e.g. `"Ġworld"` for `gpt2`,
    /// `"▁world"` for `llama`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        match &self.engine {
            Engine::Bpe(bpe) => bpe.with_special.token_to_id(text),
            Engine::Spm(spm) => spm.vocab.id(text.as_bytes()),
        }
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

    /// The stored string of token `id` (byte-level form for `gpt2` normal tokens,
    /// `▁` for spaces for `llama`).
    pub fn token_text(&self, id: u32) -> Option<String> {
        match &self.engine {
            Engine::Bpe(bpe) => bpe.with_special.id_to_token(id),
            Engine::Spm(spm) => spm.texts.get(id as usize).cloned(),
        }
    }
}

#[cfg(test)]
pub(crate) mod tests;

/// The cut rule of [`Tokenizer::exceeds`], checked on the real tokenizer.
#[cfg(test)]
mod cut_tests;
