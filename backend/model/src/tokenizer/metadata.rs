//! The GGUF tokenizer metadata: the `tokenizer.ggml.*` keys, the token types of
//! `tokenizer.ggml.token_type` (llama.cpp `llama_token_type`), and the errors
//! reading them; shared by the tokenizer and its engines (`bpe`, `spm`, `special`).

/// GGUF key of the tokenizer model name (`gpt2` or `llama`).
pub const KEY_MODEL: &str = "tokenizer.ggml.model";
/// GGUF key of the pre-tokenizer name (for `gpt2`: `smollm`, `gpt-2`, `qwen2` or
/// `llama-bpe`; for `llama`: absent or `default`).
pub const KEY_PRE: &str = "tokenizer.ggml.pre";
/// GGUF key of the token strings (byte-level encoded for `gpt2`, `▁` for spaces for `llama`).
pub const KEY_TOKENS: &str = "tokenizer.ggml.tokens";
/// GGUF key of the per-token scores (`llama` only; higher merges first).
pub const KEY_SCORES: &str = "tokenizer.ggml.scores";
/// GGUF key of the per-token types (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
pub const KEY_TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
/// GGUF key of the BPE merges (`"a b"` strings, highest priority first; `gpt2` only).
pub const KEY_MERGES: &str = "tokenizer.ggml.merges";
/// GGUF key of the beginning-of-sequence token id.
pub const KEY_BOS: &str = "tokenizer.ggml.bos_token_id";
/// GGUF key of the end-of-sequence token id.
pub const KEY_EOS: &str = "tokenizer.ggml.eos_token_id";
/// GGUF key saying whether a BOS token is prepended to prompts.
pub const KEY_ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
/// GGUF key saying whether an EOS token is appended to prompts.
pub const KEY_ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
/// GGUF key saying whether `llama` tokenization writes a space before the text
/// (and after every special token).
pub const KEY_ADD_SPACE_PREFIX: &str = "tokenizer.ggml.add_space_prefix";

/// `token_type` value of a normal token.
pub(super) const TYPE_NORMAL: i32 = 1;
/// `token_type` value of the unknown token (`<unk>`).
pub(super) const TYPE_UNKNOWN: i32 = 2;
/// `token_type` value of a control token (`<|im_start|>`, ...).
pub(super) const TYPE_CONTROL: i32 = 3;
/// `token_type` value of a user-defined token.
pub(super) const TYPE_USER_DEFINED: i32 = 4;
/// `token_type` value of a byte token (`<0x0A>`, `llama` only).
pub(super) const TYPE_BYTE: i32 = 6;

/// Errors building or using a [`super::Tokenizer`].
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
    /// Metadata arrays or ids that do not fit together, or a vocabulary that
    /// cannot encode a text (a `llama` vocabulary without the byte token a
    /// character outside it needs).
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
