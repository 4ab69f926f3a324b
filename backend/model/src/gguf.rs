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
    /// What a LoRA adapter for this model is checked against.
    pub lora_base: Arc<crate::lora::LoraBase>,
}

/// Catalog metadata read from a GGUF file's header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelInfo {
    /// `general.name`, if set.
    pub name: Option<String>,
    /// `general.architecture` (`llama`, `qwen2`, `gemma3`, ...), empty if unset.
    pub architecture: String,
    /// Weights: the sum of every tensor's element count (tied embeddings counted
    /// once, as the file stores them once).
    pub parameters: u64,
    /// The file's quantization as llama.cpp names it: the `general.file_type`
    /// ([`file_type_name`], e.g. `Q4_K_M` for 15), or, for a file without that key
    /// or with a value not named there, the GGML type holding most of the matrices'
    /// weights (by element count, e.g. `Q4_1`).
    pub quantization: String,
    /// Whether the file carries `tokenizer.chat_template`.
    pub chat_template: bool,
    /// Context window in tokens (`<arch>.context_length`).
    pub context: usize,
}

/// GGUF key of the file's quantization (llama.cpp's `llama_ftype`).
pub const KEY_FILE_TYPE: &str = "general.file_type";

/// The name of a `general.file_type` value: llama.cpp's `enum llama_ftype`
/// (`include/llama.h` of ggml-org/llama.cpp,
/// <https://github.com/ggml-org/llama.cpp/blob/master/include/llama.h>) without its
/// `LLAMA_FTYPE_MOSTLY_` / `LLAMA_FTYPE_ALL_` prefix: 0 `F32`, 1 `F16`, 2 `Q4_0`,
/// 3 `Q4_1`, 7 `Q8_0`, 8 `Q5_0`, 9 `Q5_1`, 10 `Q2_K`, 11 to 13 `Q3_K_S`/`_M`/`_L`,
/// 14 and 15 `Q4_K_S`/`_M`, 16 and 17 `Q5_K_S`/`_M`, 18 `Q6_K`, then the I-quants,
/// `BF16` (32) and the ternary `TQ1_0`/`TQ2_0` (36, 37). `None` for the values
/// llama.cpp removed (4 to 6, 33 to 35) and any other. The flag
/// `LLAMA_FTYPE_GUESSED` (1024) is not a file value and is not named.
pub fn file_type_name(ftype: u32) -> Option<&'static str> {
    Some(match ftype {
        0 => "F32",
        1 => "F16",
        2 => "Q4_0",
        3 => "Q4_1",
        7 => "Q8_0",
        8 => "Q5_0",
        9 => "Q5_1",
        10 => "Q2_K",
        11 => "Q3_K_S",
        12 => "Q3_K_M",
        13 => "Q3_K_L",
        14 => "Q4_K_S",
        15 => "Q4_K_M",
        16 => "Q5_K_S",
        17 => "Q5_K_M",
        18 => "Q6_K",
        19 => "IQ2_XXS",
        20 => "IQ2_XS",
        21 => "Q2_K_S",
        22 => "IQ3_XS",
        23 => "IQ3_XXS",
        24 => "IQ1_S",
        25 => "IQ4_NL",
        26 => "IQ3_S",
        27 => "IQ3_M",
        28 => "IQ2_S",
        29 => "IQ2_M",
        30 => "IQ4_XS",
        31 => "IQ1_M",
        32 => "BF16",
        36 => "TQ1_0",
        37 => "TQ2_0",
        _ => return None,
    })
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
        let dominant = || {
            by_type
                .into_iter()
                .max_by_key(|(_, n)| *n)
                .map(|(t, _)| t)
                .unwrap_or_default()
        };
        let file_type = content
            .metadata
            .get(KEY_FILE_TYPE)
            .and_then(|v| match v.to_u64() {
                Ok(n) => u32::try_from(n).ok(),
                Err(_) => v.to_i32().ok().and_then(|n| u32::try_from(n).ok()),
            })
            .and_then(file_type_name);
        let text = |key: &str| {
            content
                .metadata
                .get(key)
                .and_then(|v| v.to_string().ok())
                .cloned()
        };
        Self {
            name: text("general.name"),
            architecture: text("general.architecture").unwrap_or_default(),
            parameters,
            quantization: file_type.map_or_else(dominant, str::to_string),
            chat_template: content.metadata.contains_key("tokenizer.chat_template"),
            context,
        }
    }

    /// A one-line description from the metadata, e.g. `Qwen2.5 Coder 0.5B Instruct
    /// AWQ: qwen2, 494M parameters, 32,768-token context window, GGUF Q4_K_M`; the
    /// file name stands in for a missing `general.name`, and unknown parts are left
    /// out. `context` is the window the model is served with.
    pub fn description(&self, file_name: &str, context: usize) -> String {
        let mut parts = Vec::new();
        if !self.architecture.is_empty() {
            parts.push(self.architecture.clone());
        }
        if self.parameters > 0 {
            parts.push(format!("{} parameters", approx_count(self.parameters)));
        }
        if context > 0 {
            parts.push(format!(
                "{}-token context window",
                thousands(context as u64)
            ));
        }
        if !self.quantization.is_empty() {
            parts.push(format!("GGUF {}", self.quantization));
        }
        let name = self.name.as_deref().filter(|n| !n.trim().is_empty());
        let name = name.unwrap_or(file_name).trim();
        if parts.is_empty() {
            name.to_string()
        } else {
            format!("{name}: {}", parts.join(", "))
        }
    }
}

/// `n` with three significant digits and a unit: `135M`, `494M`, `1.24B`, `7.6K`.
fn approx_count(n: u64) -> String {
    let (scaled, unit) = match n {
        0..1_000 => return n.to_string(),
        1_000..1_000_000 => (n as f64 / 1e3, "K"),
        1_000_000..1_000_000_000 => (n as f64 / 1e6, "M"),
        1_000_000_000..1_000_000_000_000 => (n as f64 / 1e9, "B"),
        _ => (n as f64 / 1e12, "T"),
    };
    let digits = if scaled >= 100.0 {
        0
    } else if scaled >= 10.0 {
        1
    } else {
        2
    };
    let s = format!("{scaled:.digits$}");
    let s = if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    };
    format!("{s}{unit}")
}

/// `n` with thousands separators: `32,768`.
fn thousands(n: u64) -> String {
    let digits = n.to_string();
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// Opens a GGUF file and reads its header (metadata and tensor directory, not the
/// weights); the file is returned for reading the weights.
///
/// Errors: [`LoadError::Open`], [`LoadError::Gguf`].
pub fn read_header(path: &Path) -> Result<(std::fs::File, Content), LoadError> {
    let mut f = std::fs::File::open(path).map_err(|source| LoadError::Open {
        path: path.into(),
        source,
    })?;
    let content = Content::read(&mut f).map_err(|source| LoadError::Gguf {
        path: path.into(),
        source,
    })?;
    Ok((f, content))
}

/// What a LoRA adapter for the model in `path` is checked against, from its
/// header alone (not its weights).
///
/// Errors: [`LoadError::Open`], [`LoadError::Gguf`].
pub fn lora_base_of(path: &Path) -> Result<crate::lora::LoraBase, LoadError> {
    let (_, content) = read_header(path)?;
    Ok(crate::lora::LoraBase::from_gguf(&content))
}

impl LoadedModel {
    /// Loads a GGUF file of one of the supported architectures
    /// ([`crate::transformer::Arch`]).
    pub fn load(path: &Path) -> Result<Self, LoadError> {
        let (mut f, content) = read_header(path)?;
        let tokenizer = Tokenizer::from_gguf(&content)?;
        let chat = ChatTemplate::from_gguf(&content)?;
        let transformer = Transformer::load(&content, &mut f)?;
        let info = ModelInfo::from_gguf(&content, transformer.config().context);
        Ok(Self {
            info,
            lora_base: Arc::new(crate::lora::LoraBase::from_gguf(&content)),
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

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::{TensorInfo, Value, VersionedMagic};
    use candle_core::quantized::GgmlDType;

    /// A header with `metadata` and one 256 x 1024 matrix of `dtype` (no data).
    fn header(metadata: Vec<(&str, Value)>, dtype: GgmlDType) -> Content {
        let tensor = TensorInfo {
            ggml_dtype: dtype,
            shape: candle_core::Shape::from((256, 1024)),
            offset: 0,
        };
        Content {
            magic: VersionedMagic::GgufV3,
            metadata: metadata
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            tensor_infos: [("blk.0.ffn_down.weight".to_string(), tensor)]
                .into_iter()
                .collect(),
            tensor_data_offset: 0,
        }
    }

    /// A review of the model families found `/v1/models` reporting Qwen's and
    /// Gemma's Q4_K_M files as `Q5_0` and `Q8_0`, the types most of their elements
    /// happen to be stored in: the file's own `general.file_type` names it.
    #[test]
    fn quantization_is_the_files_type_and_the_dominant_type_without_it() {
        let info = |md, dtype| ModelInfo::from_gguf(&header(md, dtype), 32768);
        let q4km = info(vec![(KEY_FILE_TYPE, Value::U32(15))], GgmlDType::Q5_0);
        assert_eq!(q4km.quantization, "Q4_K_M");
        for (ftype, name) in [
            (0, "F32"),
            (1, "F16"),
            (2, "Q4_0"),
            (3, "Q4_1"),
            (7, "Q8_0"),
            (8, "Q5_0"),
            (9, "Q5_1"),
            (10, "Q2_K"),
            (11, "Q3_K_S"),
            (12, "Q3_K_M"),
            (13, "Q3_K_L"),
            (14, "Q4_K_S"),
            (16, "Q5_K_S"),
            (17, "Q5_K_M"),
            (18, "Q6_K"),
            (32, "BF16"),
        ] {
            assert_eq!(file_type_name(ftype), Some(name));
        }
        assert_eq!(file_type_name(4), None, "removed from llama.cpp");
        // No key, or a value llama.cpp does not name: the dominant type.
        assert_eq!(info(vec![], GgmlDType::Q8_0).quantization, "Q8_0");
        let odd = info(vec![(KEY_FILE_TYPE, Value::U32(4242))], GgmlDType::Q4_1);
        assert_eq!(odd.quantization, "Q4_1");
    }

    /// The shipped files: the families' are Q4_K_M (most of their elements are in
    /// Q5_0 or Q8_0 matrices), SmolLM2's Q4_1.
    #[test]
    fn the_shipped_files_name_their_quantization() {
        use crate::tokenizer::tests::{model_content, test_content, GEMMA3_FILE, QWEN2_FILE};
        for file in [GEMMA3_FILE, QWEN2_FILE] {
            let info = ModelInfo::from_gguf(model_content(file), 32768);
            assert_eq!(info.quantization, "Q4_K_M", "{file}");
        }
        let qwen = ModelInfo::from_gguf(model_content(QWEN2_FILE), 32768);
        let d = qwen.description("x", 32768);
        assert!(
            d.starts_with("Qwen2.5 Coder 0.5B Instruct AWQ: qwen2, ")
                && d.ends_with(" parameters, 32,768-token context window, GGUF Q4_K_M"),
            "{d}"
        );
        if let Some(c) = test_content() {
            assert_eq!(ModelInfo::from_gguf(c, 8192).quantization, "Q4_1");
        }
    }

    #[test]
    fn the_description_is_built_from_the_metadata() {
        let md = vec![
            (
                "general.name",
                Value::String("Qwen2.5 Coder 0.5B Instruct".into()),
            ),
            ("general.architecture", Value::String("qwen2".into())),
            (KEY_FILE_TYPE, Value::U32(15)),
        ];
        let mut info = ModelInfo::from_gguf(&header(md, GgmlDType::Q4K), 32768);
        info.parameters = 494_032_768;
        assert_eq!(
            info.description("q.gguf", 32768),
            "Qwen2.5 Coder 0.5B Instruct: qwen2, 494M parameters, 32,768-token context \
             window, GGUF Q4_K_M"
        );
        let bare = ModelInfo::from_gguf(&header(vec![], GgmlDType::F32), 0);
        assert_eq!(
            bare.description("tiny.gguf", 0),
            "tiny.gguf: 262K parameters, GGUF F32"
        );
        for (n, s) in [
            (999, "999"),
            (1_049_728, "1.05M"),
            (134_515_008, "135M"),
            (1_240_000_000, "1.24B"),
            (12_500_000_000, "12.5B"),
        ] {
            assert_eq!(approx_count(n), s);
        }
        assert_eq!(thousands(8192), "8,192");
        assert_eq!(thousands(512), "512");
    }
}
