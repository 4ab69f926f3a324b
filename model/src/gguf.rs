//! Loading a GGUF file into everything the engine needs: weights, tokenizer and
//! chat template, read from the same file.

use crate::chat::{ChatError, ChatTemplate};
use crate::llama::{Llama, LlamaConfig, ModelError};
use crate::tokenizer::{Tokenizer, TokenizerError};
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
    pub llama: Arc<Llama>,
    /// Tokenizer from the GGUF metadata.
    pub tokenizer: Arc<Tokenizer>,
    /// Chat template from the GGUF metadata.
    pub chat: Arc<ChatTemplate>,
    /// Where it was loaded from.
    pub path: PathBuf,
}

impl LoadedModel {
    /// Loads a llama-architecture GGUF file.
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
        let llama = Llama::load(&content, &mut f)?;
        Ok(Self {
            llama: Arc::new(llama),
            tokenizer: Arc::new(tokenizer),
            chat: Arc::new(chat),
            path: path.into(),
        })
    }

    /// Hyperparameters.
    pub fn config(&self) -> &LlamaConfig {
        self.llama.config()
    }
}
