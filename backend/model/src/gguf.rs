//! Loading a GGUF file into everything the engine needs: weights, tokenizer and
//! chat template, read from the same file.

use crate::chat::{ChatError, ChatTemplate};
use crate::tokenizer::{Tokenizer, TokenizerError};
use crate::transformer::{ModelConfig, ModelError, Transformer};
use candle_core::quantized::gguf_file::Content;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Catalog id of the default model.
pub const DEFAULT_MODEL_ID: &str = "@cf/huggingfacetb/smollm2-135m-instruct";

/// Errors loading a model file.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// The file could not be opened.
    #[error(
        "cannot open model file {path}: {source} (run `tessera model fetch` or pass --model PATH)"
    )]
    Open {
        /// Path tried.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// Not a readable GGUF file.
    #[error("{path} is not a readable GGUF file: {source}")]
    Gguf {
        /// Path.
        path: PathBuf,
        /// Parser error.
        source: candle_core::Error,
    },
    /// Weights.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// Tokenizer metadata.
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    /// Chat template metadata.
    #[error(transparent)]
    Chat(#[from] ChatError),
}

/// A model ready to serve.
#[derive(Debug, Clone)]
pub struct LoadedModel {
    /// Weights and forward pass.
    pub transformer: Arc<Transformer>,
    /// Tokenizer from the GGUF metadata.
    pub tokenizer: Arc<Tokenizer>,
    /// Chat template from the GGUF metadata.
    pub chat: Arc<ChatTemplate>,
    /// Where it was loaded from.
    pub path: PathBuf,
    /// What the file says about itself (catalog metadata).
    pub info: ModelInfo,
}

/// Catalog metadata read from a GGUF file's header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelInfo {
    /// `general.name`, if set.
    pub name: Option<String>,
    /// Weights: the sum of every tensor's element count (tied embeddings counted
    /// once, as the file stores them once).
    pub parameters: u64,
    /// The GGML type holding most of the matrices' weights (by element count),
    /// e.g. `Q4_1`.
    pub quantization: String,
    /// Whether the file carries `tokenizer.chat_template`.
    pub chat_template: bool,
    /// Context window in tokens (`<arch>.context_length`).
    pub context: usize,
}

impl ModelInfo {
    /// Reads the catalog metadata of a parsed GGUF (`context` from its hyperparameters).
    pub fn from_gguf(content: &Content, context: usize) -> Self {
        use std::collections::BTreeMap;
        let mut by_type: BTreeMap<String, u64> = BTreeMap::new();
        let mut parameters = 0u64;
        for t in content.tensor_infos.values() {
            let n = t.shape.elem_count() as u64;
            parameters += n;
            if t.shape.dims().len() == 2 {
                *by_type.entry(format!("{:?}", t.ggml_dtype)).or_default() += n;
            }
        }
        let quantization = by_type
            .into_iter()
            .max_by_key(|(_, n)| *n)
            .map(|(t, _)| t)
            .unwrap_or_default();
        Self {
            name: content
                .metadata
                .get("general.name")
                .and_then(|v| v.to_string().ok())
                .cloned(),
            parameters,
            quantization,
            chat_template: content.metadata.contains_key("tokenizer.chat_template"),
            context,
        }
    }
}

impl LoadedModel {
    /// Loads a GGUF file of one of the supported architectures
    /// ([`crate::transformer::Arch`]).
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        let mut f = std::fs::File::open(path).map_err(|source| LoadError::Open {
            path: path.into(),
            source,
        })?;
        let content = Content::read(&mut f).map_err(|source| LoadError::Gguf {
            path: path.into(),
            source,
        })?;
        let tokenizer = Tokenizer::from_gguf(&content)?;
        let chat = ChatTemplate::from_gguf(&content)?;
        let transformer = Transformer::load(&content, &mut f)?;
        let info = ModelInfo::from_gguf(&content, transformer.config().context);
        Ok(Self {
            info,
            transformer: Arc::new(transformer),
            tokenizer: Arc::new(tokenizer),
            chat: Arc::new(chat),
            path: path.into(),
        })
    }

    /// Hyperparameters.
    pub fn config(&self) -> &ModelConfig {
        self.transformer.config()
    }
}
