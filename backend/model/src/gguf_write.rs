//! Writing GGUF files: requantized copies of a model ([`requantize`]: every weight
//! matrix dequantized and requantized to GGML `Q8_0` or `Q4_0` blocks by our kernels'
//! quantizers) and small random-weight llama models ([`write_random_llama`]) whose
//! shape differs from the default model's, for tests and demos.
//!
//! Format: GGUF as specified in ggml's `docs/gguf.md`
//! (<https://github.com/ggml-org/ggml/blob/master/docs/gguf.md>): header, metadata
//! key/value pairs, tensor infos (name, dimensions innermost first, GGML type, offset),
//! then the tensor data, each tensor aligned to 32 bytes. Serialized by candle-core's
//! `gguf_file::write` (already our GGUF reader; it writes version 2 of the layout with
//! the default 32-byte alignment, so a source's `general.alignment` is dropped).
//! Block layouts: [`tessera_kernels::quant`] (GGML's `ggml-common.h`).
//!
//! Output is deterministic: metadata keys are written sorted and tensors in the
//! source's file order, so the same input gives the same bytes (and sha256) on every
//! machine. Files are written to `<dst>.<pid>.partial` and renamed into place.

use crate::transformer::ModelError;
use candle_core::quantized::gguf_file::{self, Content, Value};
use candle_core::quantized::{ggml_file::qtensor_from_ggml, GgmlDType, QTensor};
use candle_core::Device;
use rand::{Rng, SeedableRng};
use sha2::{Digest, Sha256};
use std::io::{BufWriter, Read};
use std::path::{Path, PathBuf};
use tessera_kernels::quant::{quantize_blocks, QFormat, QK};

/// `general.file_type` values (llama.cpp's `llama_ftype`) of the formats we write.
const FTYPE_MOSTLY_Q4_0: u32 = 2;
const FTYPE_MOSTLY_Q8_0: u32 = 7;

/// Errors writing a GGUF file.
#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    /// The source could not be opened or read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The destination could not be written.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// GGUF parsing, a tensor conversion or serialization failed.
    #[error("{path}: {source}")]
    Gguf {
        /// The file being read or written.
        path: PathBuf,
        /// candle-core's error.
        source: candle_core::Error,
    },
    /// The source is not a llama model we can read.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A format we cannot write (only `Q8_0` and `Q4_0`).
    #[error("cannot requantize to {0} (supported: Q8_0, Q4_0)")]
    Format(&'static str),
    /// The shape asked for a random model is not one the kernels run.
    #[error("random model shape: {0}")]
    Shape(String),
}

/// A file written: where, its sha256 (lowercase hex) and size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Written {
    /// The file.
    pub path: PathBuf,
    /// sha256 of its bytes, lowercase hex.
    pub sha256: String,
    /// Size in bytes.
    pub bytes: u64,
    /// Tensors stored in the new format (requantized or generated).
    pub matrices: usize,
}

/// A requantized copy of the default model that `tessera model fetch --variant`
/// writes, served under its own catalog id.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Variant {
    /// `--variant` value: `q8_0` or `q4_0`.
    pub name: &'static str,
    /// Block format of every weight matrix.
    pub format: QFormat,
    /// Catalog id.
    pub id: &'static str,
    /// File name in the models directory.
    pub file: &'static str,
    /// sha256 of the file requantized from the default model (lowercase hex): the
    /// output is deterministic, so a different hash means a different quantizer or
    /// source.
    pub sha256: &'static str,
}

/// The variants of the default model.
pub const VARIANTS: [Variant; 2] = [
    Variant {
        name: "q8_0",
        format: QFormat::Q8_0,
        id: "@cf/huggingfacetb/smollm2-135m-instruct-q8",
        file: "SmolLM2-135M-Instruct.Q8_0.gguf",
        sha256: "257696939ce6f79563f920bafae1e7f7a5495eb9385faf510b7a67622e1fa3e7",
    },
    Variant {
        name: "q4_0",
        format: QFormat::Q4_0,
        id: "@cf/huggingfacetb/smollm2-135m-instruct-q4",
        file: "SmolLM2-135M-Instruct.Q4_0.gguf",
        sha256: "37198867b2cb43714f40c2fed8b1d89db11cdacdea741f3090016561f5d3b570",
    },
];

impl Variant {
    /// The variant called `name` (`q8_0`, `q4_0`; case-insensitive).
    pub fn named(name: &str) -> Option<Self> {
        VARIANTS
            .into_iter()
            .find(|v| v.name.eq_ignore_ascii_case(name))
    }
}

fn ggml_type(format: QFormat) -> Result<(GgmlDType, u32), WriteError> {
    match format {
        QFormat::Q8_0 => Ok((GgmlDType::Q8_0, FTYPE_MOSTLY_Q8_0)),
        QFormat::Q4_0 => Ok((GgmlDType::Q4_0, FTYPE_MOSTLY_Q4_0)),
        f @ (QFormat::Q4_1 | QFormat::Q5_0 | QFormat::Q4K | QFormat::Q5K | QFormat::Q6K) => {
            Err(WriteError::Format(f.name()))
        }
    }
}

fn read_content(path: &Path) -> Result<(Content, std::fs::File), WriteError> {
    let read = |source| WriteError::Read {
        path: path.into(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(read)?;
    let content = Content::read(&mut f).map_err(|source| WriteError::Gguf {
        path: path.into(),
        source,
    })?;
    Ok((content, f))
}

/// Quantizes a row-major `[rows, cols]` `f32` matrix (`cols` a multiple of 32) into
/// a tensor of `format` with candle's dimensions `[rows, cols]`.
fn quantized(format: QFormat, data: &[f32], dims: Vec<usize>) -> candle_core::Result<QTensor> {
    let (dtype, _) = ggml_type(format).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    qtensor_from_ggml(dtype, &quantize_blocks(format, data), dims, &Device::Cpu)
}

/// Writes `metadata` (sorted by key) and `tensors` (in order) to `dst` through a
/// partial file, then hashes the result.
fn write_file(
    dst: &Path,
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, QTensor)>,
) -> Result<Written, WriteError> {
    let mut metadata = metadata;
    metadata.sort_by(|a, b| a.0.cmp(&b.0));
    let partial = dst.with_file_name(format!(
        ".{}.{}.partial",
        dst.file_name().unwrap_or_default().to_string_lossy(),
        std::process::id()
    ));
    let wio = |source| WriteError::Write {
        path: partial.clone(),
        source,
    };
    let result = (|| {
        let file = std::fs::File::create(&partial).map_err(wio)?;
        let mut w = BufWriter::with_capacity(1 << 20, file);
        let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (k.as_str(), v)).collect();
        let ts: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
        gguf_file::write(&mut w, &md, &ts).map_err(|source| WriteError::Gguf {
            path: partial.clone(),
            source,
        })?;
        let file = w.into_inner().map_err(|e| wio(e.into_error()))?;
        file.sync_all().map_err(wio)?;
        std::fs::rename(&partial, dst).map_err(|source| WriteError::Write {
            path: dst.into(),
            source,
        })
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&partial);
    }
    result?;
    let (sha256, bytes) = sha256_of(dst)?;
    Ok(Written {
        path: dst.into(),
        sha256,
        bytes,
        matrices: tensors
            .iter()
            .filter(|(_, t)| t.shape().dims().len() == 2)
            .count(),
    })
}

/// sha256 (lowercase hex) and size of a file, read in 1 MiB chunks.
pub fn sha256_of(path: &Path) -> Result<(String, u64), WriteError> {
    let read = |source| WriteError::Read {
        path: path.into(),
        source,
    };
    let mut f = std::fs::File::open(path).map_err(read)?;
    let (mut h, mut buf, mut n) = (Sha256::new(), vec![0u8; 1 << 20], 0u64);
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(k) => {
                h.update(&buf[..k]);
                n += k as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(read(e)),
        }
    }
    Ok((format!("{:x}", h.finalize()), n))
}

/// Writes a copy of the llama GGUF `src` to `dst` with every weight matrix (2-D
/// tensor, rows of whole 32-value blocks) dequantized to `f32` and requantized to
/// `format` (`Q8_0` or `Q4_0`; GGML's reference rounding). Vectors (norms) and all
/// metadata are kept, except `general.file_type` (set to llama.cpp's `MOSTLY_Q8_0` =
/// 7 or `MOSTLY_Q4_0` = 2) and `general.alignment` (the writer aligns to 32).
///
/// Errors: the source is unreadable or not a llama GGUF, `format` is `Q4_1`, or
/// writing fails (the partial file is removed).
pub fn requantize(src: &Path, dst: &Path, format: QFormat) -> Result<Written, WriteError> {
    let (_, ftype) = ggml_type(format)?;
    let (content, mut f) = read_content(src)?;
    crate::transformer::ModelConfig::from_gguf(&content)?;
    let gguf = |source| WriteError::Gguf {
        path: src.into(),
        source,
    };
    let mut names: Vec<(&String, u64)> = content
        .tensor_infos
        .iter()
        .map(|(n, i)| (n, i.offset))
        .collect();
    names.sort_by_key(|&(_, o)| o);
    let mut tensors = Vec::with_capacity(names.len());
    for (name, _) in names {
        let t = content.tensor(&mut f, name, &Device::Cpu).map_err(gguf)?;
        let dims = t.shape().dims().to_vec();
        let t = match dims.as_slice() {
            &[_, cols] if cols % QK == 0 => {
                let data = t
                    .dequantize(&Device::Cpu)
                    .and_then(|x| x.flatten_all())
                    .and_then(|x| x.to_vec1::<f32>())
                    .map_err(gguf)?;
                quantized(format, &data, dims).map_err(gguf)?
            }
            _ => t,
        };
        tensors.push((name.clone(), t));
    }
    let mut metadata: Vec<(String, Value)> = content
        .metadata
        .into_iter()
        .filter(|(k, _)| k != "general.alignment")
        .collect();
    metadata.retain(|(k, _)| k != "general.file_type");
    metadata.push(("general.file_type".into(), Value::U32(ftype)));
    write_file(dst, metadata, tensors)
}

/// The shape of a random-weight llama model ([`write_random_llama`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RandomLlama {
    /// Vocabulary: the first `vocab` tokens of the template's tokenizer (at least
    /// the 256 byte tokens and the chat template's special tokens).
    pub vocab: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Model width; a multiple of 32 and of `heads`.
    pub hidden: usize,
    /// Query heads (`hidden / heads` is the head dimension: a multiple of 16).
    pub heads: usize,
    /// KV heads (divides `heads`).
    pub kv_heads: usize,
    /// FFN width; a multiple of 32.
    pub ffn: usize,
    /// Context window in tokens (`llama.context_length`).
    pub context: usize,
    /// Seed of the weights (ChaCha8).
    pub seed: u64,
}

impl RandomLlama {
    /// A small model unlike the default one in every dimension: vocabulary 2,048,
    /// 4 layers, width 128 (2 heads of 64, 1 KV head), FFN 384, context 4,096.
    pub const SMALL: Self = Self {
        vocab: 2048,
        layers: 4,
        hidden: 128,
        heads: 2,
        kv_heads: 1,
        ffn: 384,
        context: 4096,
        seed: 18,
    };
}

/// The tokenizer metadata of `content` cut to its first `vocab` tokens: token
/// arrays truncated, merges kept only when both parts and their concatenation are
/// in the kept vocabulary, special-token ids that fall outside dropped.
fn truncated_tokenizer(content: &Content, vocab: usize) -> Result<Vec<(String, Value)>, String> {
    let tokens = match content.metadata.get("tokenizer.ggml.tokens") {
        Some(Value::Array(t)) if t.len() >= vocab => t[..vocab].to_vec(),
        Some(Value::Array(t)) => {
            return Err(format!(
                "vocab {vocab} is larger than the template's {} tokens",
                t.len()
            ))
        }
        _ => return Err("the template has no tokenizer.ggml.tokens".into()),
    };
    let kept: std::collections::HashSet<&str> = tokens
        .iter()
        .filter_map(|v| v.to_string().ok().map(String::as_str))
        .collect();
    let mut out = Vec::new();
    for (k, v) in &content.metadata {
        if !k.starts_with("tokenizer.") {
            continue;
        }
        let v = match (k.as_str(), v) {
            ("tokenizer.ggml.tokens", _) => Value::Array(tokens.clone()),
            ("tokenizer.ggml.token_type" | "tokenizer.ggml.scores", Value::Array(a)) => {
                Value::Array(a[..vocab.min(a.len())].to_vec())
            }
            ("tokenizer.ggml.merges", Value::Array(a)) => Value::Array(
                a.iter()
                    .filter(|m| {
                        m.to_string()
                            .ok()
                            .and_then(|m| m.split_once(' '))
                            .is_some_and(|(x, y)| {
                                kept.contains(x)
                                    && kept.contains(y)
                                    && kept.contains(format!("{x}{y}").as_str())
                            })
                    })
                    .cloned()
                    .collect(),
            ),
            (k, v) if k.ends_with("_token_id") => match v.to_u32() {
                Ok(id) if (id as usize) < vocab => v.clone(),
                _ => continue,
            },
            _ => v.clone(),
        };
        out.push((k.clone(), v));
    }
    Ok(out)
}

/// Writes a llama GGUF with random weights (ChaCha8 from `shape.seed`; matrices
/// uniform in `±1/sqrt(cols)` stored as `Q8_0`, norms near 1 as `F32`, the LM head
/// tied to the embeddings) and the tokenizer and chat template of the GGUF
/// `template`, cut to `shape.vocab` tokens. Its answers are noise, but deterministic
/// and batch-invariant like any model's, and its shape (vocabulary, layers, width,
/// context) differs from the template's, so a request routed to the wrong model
/// cannot go unnoticed.
///
/// Errors: an unreadable template, a shape the kernels do not run, a write failure.
pub fn write_random_llama(
    template: &Path,
    dst: &Path,
    shape: &RandomLlama,
) -> Result<Written, WriteError> {
    let s = shape;
    let bad = |m: String| Err(WriteError::Shape(m));
    if s.heads == 0
        || s.kv_heads == 0
        || !s.hidden.is_multiple_of(s.heads)
        || !s.heads.is_multiple_of(s.kv_heads)
    {
        return bad(format!(
            "hidden {} / heads {} / kv_heads {} do not divide",
            s.hidden, s.heads, s.kv_heads
        ));
    }
    let head_dim = s.hidden / s.heads;
    if !s.hidden.is_multiple_of(QK)
        || !s.ffn.is_multiple_of(QK)
        || !head_dim.is_multiple_of(16)
        || s.layers == 0
    {
        return bad(format!(
            "hidden {} and ffn {} must be multiples of 32, head_dim {head_dim} of 16, layers > 0",
            s.hidden, s.ffn
        ));
    }
    let (content, _) = read_content(template)?;
    let mut metadata = truncated_tokenizer(&content, s.vocab).map_err(WriteError::Shape)?;
    let u = |v: usize| Value::U32(v as u32);
    metadata.extend([
        ("general.architecture".into(), Value::String("llama".into())),
        (
            "general.name".into(),
            Value::String(format!("tessera-random-llama-{}", s.seed)),
        ),
        ("general.file_type".into(), Value::U32(FTYPE_MOSTLY_Q8_0)),
        ("llama.block_count".into(), u(s.layers)),
        ("llama.context_length".into(), u(s.context)),
        ("llama.embedding_length".into(), u(s.hidden)),
        ("llama.feed_forward_length".into(), u(s.ffn)),
        ("llama.attention.head_count".into(), u(s.heads)),
        ("llama.attention.head_count_kv".into(), u(s.kv_heads)),
        ("llama.rope.dimension_count".into(), u(head_dim)),
        ("llama.rope.freq_base".into(), Value::F32(10000.0)),
        (
            "llama.attention.layer_norm_rms_epsilon".into(),
            Value::F32(1e-5),
        ),
        ("llama.vocab_size".into(), u(s.vocab)),
    ]);
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(s.seed);
    let gguf = |source| WriteError::Gguf {
        path: dst.into(),
        source,
    };
    let matrix = |rows: usize, cols: usize, rng: &mut rand_chacha::ChaCha8Rng| {
        let a = 1.0 / (cols as f32).sqrt();
        let data: Vec<f32> = (0..rows * cols).map(|_| rng.random_range(-a..a)).collect();
        quantized(QFormat::Q8_0, &data, vec![rows, cols]).map_err(gguf)
    };
    let norm = |n: usize, rng: &mut rand_chacha::ChaCha8Rng| -> Result<QTensor, WriteError> {
        let data: Vec<f32> = (0..n).map(|_| rng.random_range(0.9..1.1)).collect();
        let bytes: Vec<u8> = data.iter().flat_map(|x| x.to_le_bytes()).collect();
        qtensor_from_ggml(GgmlDType::F32, &bytes, vec![n], &Device::Cpu).map_err(gguf)
    };
    let (d, kvd) = (s.hidden, s.kv_heads * head_dim);
    let r = &mut rng;
    let mut tensors = vec![("token_embd.weight".to_string(), matrix(s.vocab, d, r)?)];
    for i in 0..s.layers {
        let p = |n: &str| format!("blk.{i}.{n}.weight");
        for (name, rows, cols) in [
            ("attn_q", d, d),
            ("attn_k", kvd, d),
            ("attn_v", kvd, d),
            ("attn_output", d, d),
            ("ffn_gate", s.ffn, d),
            ("ffn_up", s.ffn, d),
            ("ffn_down", d, s.ffn),
        ] {
            tensors.push((p(name), matrix(rows, cols, r)?));
        }
        tensors.push((p("attn_norm"), norm(d, r)?));
        tensors.push((p("ffn_norm"), norm(d, r)?));
    }
    tensors.push(("output_norm.weight".into(), norm(d, r)?));
    write_file(dst, metadata, tensors)
}
