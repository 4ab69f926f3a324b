//! A model's context window: read from its GGUF header, or taken from the `context`
//! of its `[[models]]` entry when the file is not there.

use crate::schema::ModelEntry;
use candle_core::quantized::gguf_file::{Content, Value};
use std::path::{Path, PathBuf};

/// Why a model's context window is unknown.
#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    /// No file and no `context` in the entry.
    #[error(
        "model file {path} not found and no `context` is set; set `context = N` in its \
         [[models]] entry or fetch the file"
    )]
    NotFound {
        /// File tried.
        path: PathBuf,
    },
    /// The file exists but could not be opened.
    #[error("cannot open model file {path}: {source}")]
    Open {
        /// File.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// Not a readable GGUF file.
    #[error("{path} is not a readable GGUF file: {source}")]
    Gguf {
        /// File.
        path: PathBuf,
        /// Parser error.
        source: Box<candle_core::Error>,
    },
    /// The GGUF has no context length.
    #[error("{path} has no `{key}` metadata; set `context = N` in its [[models]] entry")]
    Missing {
        /// File.
        path: PathBuf,
        /// Metadata key looked up.
        key: String,
    },
    /// `context` in the file disagrees with the GGUF.
    #[error(
        "`context = {configured}` disagrees with {path}, whose context window is {gguf} \
         tokens; remove `context` or correct it"
    )]
    Mismatch {
        /// File.
        path: PathBuf,
        /// Value in the deployment file.
        configured: usize,
        /// Value in the GGUF.
        gguf: usize,
    },
}

/// Reads a model's context window from GGUF metadata (`<general.architecture>.context_length`,
/// `llama` when the architecture is absent) without reading the weights.
pub fn read_context_window(path: &Path) -> Result<usize, ContextError> {
    let mut f = std::fs::File::open(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            ContextError::NotFound { path: path.into() }
        } else {
            ContextError::Open {
                path: path.into(),
                source,
            }
        }
    })?;
    // Reads the header, metadata and tensor descriptions; the tensor data stays on disk.
    let content = Content::read(&mut f).map_err(|source| ContextError::Gguf {
        path: path.into(),
        source: Box::new(source),
    })?;
    let arch = match content.metadata.get("general.architecture") {
        Some(Value::String(a)) => a.as_str(),
        _ => "llama",
    };
    let key = format!("{arch}.context_length");
    match content.metadata.get(&key) {
        Some(Value::U32(v)) => Ok(*v as usize),
        Some(Value::U64(v)) => Ok(*v as usize),
        Some(Value::I32(v)) if *v > 0 => Ok(*v as usize),
        Some(Value::I64(v)) if *v > 0 => Ok(*v as usize),
        _ => Err(ContextError::Missing {
            path: path.into(),
            key,
        }),
    }
}

impl ModelEntry {
    /// The context window this model is served with: the GGUF's when the file is there
    /// (a `context` that disagrees is an error), else the entry's `context`.
    pub fn context_window(&self) -> Result<usize, ContextError> {
        match (read_context_window(&self.path), self.context) {
            (Ok(gguf), Some(configured)) if configured != gguf => Err(ContextError::Mismatch {
                path: self.path.clone(),
                configured,
                gguf,
            }),
            (Ok(gguf), _) => Ok(gguf),
            (Err(ContextError::NotFound { .. }), Some(configured)) => Ok(configured),
            (Err(e), _) => Err(e),
        }
    }
}
