//! The decoder-only transformer forward pass over the paged KV cache, for the
//! architectures of [`Arch`]: one pass with per-architecture pieces.
//!
//! Weights come from a GGUF file (candle-core's GGUF reader; tensor names and
//! metadata keys as written by llama.cpp's `convert_hf_to_gguf.py`). `Q4_0`,
//! `Q4_1`, `Q5_0`, `Q8_0`, `Q4_K`, `Q5_K` and `Q6_K` matrices use our kernels
//! directly (repacked at load into interleaved tiles, no requantization: see
//! `tessera_kernels::quant`); other quantized types are requantized to `Q8_0` at
//! load and unquantized ones (`F32`, `F16`, `BF16`) kept in `f32`. The math follows
//! llama.cpp's graph builders (`src/models/llama.cpp`, `qwen2.cpp`, `gemma3.cpp`):
//!
//! - `llama`: RMSNorm, Q/K/V, normal-mode RoPE, grouped-query attention, output
//!   projection, SwiGLU FFN, residuals, final RMSNorm and the LM head (tied to the
//!   embeddings when the file has no `output.weight`);
//! - `qwen2`: the same with Q/K/V biases and NEOX-mode RoPE;
//! - `gemma3`: embeddings scaled by `sqrt(hidden)`, NEOX RoPE, RMSNorm of each
//!   query and key head (QK-norm), RMSNorm after attention and after the FFN
//!   (before each residual add), a GELU-tanh gated FFN (GeGLU), and sliding-window
//!   attention on five of every six layers (`il % 6 < 5`, window
//!   `gemma3.attention.sliding_window`, RoPE base 10000) with full attention and
//!   the file's RoPE base on the others. The converter stores Gemma's `(1 + w)`
//!   norm weights with the 1 added, so every norm here is a plain RMSNorm.

use crate::kv::{KvManager, SeqId};
use crate::lora::{LoraWeights, Target};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use std::collections::HashMap;
use std::io::{Read, Seek};
use tessera_kernels::ops::{gelu_tanh_rows, rms_norm, swiglu_rows, Rope};
use tessera_kernels::quant::QFormat;
use tessera_kernels::{
    paged_attention_jobs, Activations, AttnJob, IntegrityError, KvLayout, PoolKv, QMatrix,
};

/// Errors loading a model.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// GGUF parse or tensor read failure.
    #[error("reading GGUF: {0}")]
    Gguf(#[from] candle_core::Error),
    /// A required metadata key is missing or has the wrong type.
    #[error("GGUF metadata key `{0}` is missing or not a number")]
    Metadata(String),
    /// The file's `general.architecture` is not one this crate runs.
    #[error("unsupported architecture `{0}` (supported: {supported})", supported = Arch::SUPPORTED)]
    Architecture(String),
    /// The architecture has no GPU forward pass yet.
    #[error(
        "architecture `{0}` runs on the CPU only so far (the GPU forward pass supports llama)"
    )]
    CpuOnly(&'static str),
    /// A tensor is missing or has an unexpected shape.
    #[error("tensor `{name}`: {problem}")]
    Tensor {
        /// Tensor name.
        name: String,
        /// What is wrong.
        problem: String,
    },
    /// Weight matrix construction failed.
    #[error(transparent)]
    Matrix(#[from] tessera_kernels::matmul::MatrixError),
}

/// Model architectures (GGUF `general.architecture`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Arch {
    /// `llama` (Llama, SmolLM2, Mistral-style dense models).
    Llama,
    /// `qwen2` (Qwen2, Qwen2.5, Qwen2.5-Coder).
    Qwen2,
    /// `gemma3` (Gemma 3 text models).
    Gemma3,
}

impl Arch {
    /// The supported values of `general.architecture`, for error messages.
    pub const SUPPORTED: &'static str = "llama, qwen2, gemma3";

    /// Parses `general.architecture`.
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "llama" => Some(Self::Llama),
            "qwen2" => Some(Self::Qwen2),
            "gemma3" => Some(Self::Gemma3),
            _ => None,
        }
    }

    /// The GGUF name, also the prefix of its metadata keys.
    pub fn name(self) -> &'static str {
        match self {
            Self::Llama => "llama",
            Self::Qwen2 => "qwen2",
            Self::Gemma3 => "gemma3",
        }
    }

    /// Whether RoPE rotates `(x[i], x[i + d/2])` pairs (GGML's NEOX mode) rather
    /// than adjacent pairs (llama files' Q/K rows are permuted for the latter).
    pub fn neox_rope(self) -> bool {
        !matches!(self, Self::Llama)
    }
}

/// Hyperparameters read from `<arch>.*` GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// Architecture (`general.architecture`).
    pub arch: Arch,
    /// Transformer blocks (`<arch>.block_count`).
    pub layers: usize,
    /// Model width (`<arch>.embedding_length`).
    pub hidden: usize,
    /// FFN width (`<arch>.feed_forward_length`).
    pub ffn: usize,
    /// Query heads (`<arch>.attention.head_count`).
    pub heads: usize,
    /// KV heads (`<arch>.attention.head_count_kv`).
    pub kv_heads: usize,
    /// Width of one head (`<arch>.attention.key_length`, else `hidden / heads`).
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding matrix).
    pub vocab: usize,
    /// Trained context window in tokens (`<arch>.context_length`).
    pub context: usize,
    /// RoPE base of full-attention layers (`<arch>.rope.freq_base`, default 10000).
    pub rope_base: f32,
    /// RMSNorm epsilon (`<arch>.attention.layer_norm_rms_epsilon`).
    pub eps: f32,
    /// Sliding-window attention: `(window in tokens, RoPE base)` of the local
    /// layers (Gemma 3: `gemma3.attention.sliding_window`, base 10000); `None`
    /// when every layer attends to the whole context.
    pub sliding_window: Option<(usize, f32)>,
}

fn meta_u(c: &Content, key: &str) -> Result<usize, ModelError> {
    match c.metadata.get(key) {
        Some(Value::U32(v)) => Ok(*v as usize),
        Some(Value::U64(v)) => Ok(*v as usize),
        Some(Value::I32(v)) if *v >= 0 => Ok(*v as usize),
        _ => Err(ModelError::Metadata(key.into())),
    }
}

fn meta_f(c: &Content, key: &str) -> Option<f32> {
    c.metadata.get(key).and_then(|v| v.to_f32().ok())
}

/// Gemma 3's layer pattern: five sliding-window layers, then one global
/// (llama.cpp `hparams.set_swa_pattern(6)`).
const GEMMA3_SWA_PATTERN: usize = 6;
/// RoPE base of Gemma 3's sliding-window layers (llama.cpp
/// `rope_freq_base_train_swa`).
const GEMMA3_LOCAL_ROPE_BASE: f32 = 10_000.0;

impl ModelConfig {
    /// Reads the config from GGUF metadata.
    ///
    /// Errors: [`ModelError::Architecture`] for an architecture outside [`Arch`],
    /// [`ModelError::Metadata`] for a missing hyperparameter,
    /// [`ModelError::Tensor`] without `token_embd.weight`.
    pub fn from_gguf(c: &Content) -> Result<Self, ModelError> {
        let name = c
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        let arch = Arch::from_name(&name).ok_or(ModelError::Architecture(name))?;
        let key = |k: &str| format!("{}.{k}", arch.name());
        let hidden = meta_u(c, &key("embedding_length"))?;
        let heads = meta_u(c, &key("attention.head_count"))?;
        let vocab = c
            .tensor_infos
            .get("token_embd.weight")
            .map(|t| t.shape.dims()[0])
            .ok_or_else(|| ModelError::Tensor {
                name: "token_embd.weight".into(),
                problem: "missing".into(),
            })?;
        let sliding_window = match arch {
            Arch::Gemma3 => Some((
                meta_u(c, &key("attention.sliding_window"))?,
                GEMMA3_LOCAL_ROPE_BASE,
            )),
            _ => None,
        };
        Ok(Self {
            arch,
            layers: meta_u(c, &key("block_count"))?,
            hidden,
            ffn: meta_u(c, &key("feed_forward_length"))?,
            heads,
            kv_heads: meta_u(c, &key("attention.head_count_kv")).unwrap_or(heads),
            head_dim: meta_u(c, &key("attention.key_length")).unwrap_or(hidden / heads),
            vocab,
            context: meta_u(c, &key("context_length"))?,
            rope_base: meta_f(c, &key("rope.freq_base")).unwrap_or(10000.0),
            eps: meta_f(c, &key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-5),
            sliding_window,
        })
    }

    /// Width of all query heads together (`heads * head_dim`; Gemma 3's is not
    /// `hidden`).
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of all KV heads together (`kv_heads * head_dim`).
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// The attention window of layer `layer` in tokens (`None`: the whole context).
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        let (window, _) = self.sliding_window?;
        (layer % GEMMA3_SWA_PATTERN < GEMMA3_SWA_PATTERN - 1).then_some(window)
    }

    /// KV page shape for this model with `page_size` tokens per page.
    pub fn kv_layout(&self, page_size: usize) -> KvLayout {
        KvLayout {
            layers: self.layers,
            page_size,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
        }
    }
}

#[derive(Debug)]
struct Layer {
    attn_norm: Vec<f32>,
    /// Q, K and V stacked: `[q_dim + 2 * kv_dim, hidden]`.
    wqkv: QMatrix,
    /// Q, K and V biases stacked, `[q_dim + 2 * kv_dim]` (qwen2).
    qkv_bias: Option<Vec<f32>>,
    /// RMSNorm weights of each query and key head, `[head_dim]` each (gemma3).
    qk_norm: Option<(Vec<f32>, Vec<f32>)>,
    /// `[hidden, q_dim]`.
    wo: QMatrix,
    /// RMSNorm of the attention output before its residual add (gemma3).
    attn_post_norm: Option<Vec<f32>>,
    ffn_norm: Vec<f32>,
    /// Gate and up stacked: `[2 * ffn, hidden]`.
    gate_up: QMatrix,
    down: QMatrix,
    /// RMSNorm of the FFN output before its residual add (gemma3).
    ffn_post_norm: Option<Vec<f32>>,
    /// Attention window in tokens (`None`: the whole context).
    window: Option<usize>,
    /// Index into [`Transformer::ropes`].
    rope: usize,
}

/// Loaded weights of one model.
#[derive(Debug)]
pub struct Transformer {
    cfg: ModelConfig,
    embed: QMatrix,
    /// Multiplier of the embedding rows (`sqrt(hidden)` for gemma3, else 1).
    embed_scale: f32,
    output: Option<QMatrix>,
    output_norm: Vec<f32>,
    layers: Vec<Layer>,
    /// RoPE tables: `[0]` full-attention layers, `[1]` sliding-window layers.
    ropes: Vec<Rope>,
    fingerprint: [u8; 32],
}

/// One token of a forward batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BatchRow {
    /// Sequence the token belongs to (must have a block table covering `pos`).
    pub seq: SeqId,
    /// Token id.
    pub token: u32,
    /// Position in the sequence (0-based); the row attends to keys `0..=pos`.
    pub pos: usize,
    /// Whether to compute next-token logits for this row.
    pub want_logits: bool,
}

/// Result of one forward pass.
#[derive(Debug, Default)]
pub struct ForwardOutput {
    /// `(row index, logits [vocab])` for every row that asked and did not fail.
    pub logits: Vec<(usize, Vec<f32>)>,
    /// Sequences that failed an integrity check; they produced no logits.
    pub failed: HashMap<SeqId, IntegrityError>,
}

fn read_vec<R: Read + Seek>(c: &Content, r: &mut R, name: &str) -> Result<Vec<f32>, ModelError> {
    let t = c.tensor(r, name, &candle_core::Device::Cpu)?;
    Ok(t.dequantize(&candle_core::Device::Cpu)?
        .flatten_all()?
        .to_vec1::<f32>()?)
}

fn read_matrix<R: Read + Seek>(
    c: &Content,
    r: &mut R,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<QMatrix, ModelError> {
    let t = c.tensor(r, name, &candle_core::Device::Cpu)?;
    let dims = t.shape().dims().to_vec();
    if dims != [rows, cols] {
        return Err(ModelError::Tensor {
            name: name.into(),
            problem: format!("shape {dims:?}, expected [{rows}, {cols}]"),
        });
    }
    let dense = || -> Result<Vec<f32>, ModelError> {
        Ok(t.dequantize(&candle_core::Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?)
    };
    Ok(match t.dtype() {
        GgmlDType::Q4_0 => QMatrix::from_gguf_bytes(QFormat::Q4_0, &t.data()?, rows, cols)?,
        GgmlDType::Q4_1 => QMatrix::from_gguf_bytes(QFormat::Q4_1, &t.data()?, rows, cols)?,
        GgmlDType::Q8_0 => QMatrix::from_gguf_bytes(QFormat::Q8_0, &t.data()?, rows, cols)?,
        GgmlDType::Q5_0 => QMatrix::from_gguf_bytes(QFormat::Q5_0, &t.data()?, rows, cols)?,
        GgmlDType::Q4K => QMatrix::from_gguf_bytes(QFormat::Q4K, &t.data()?, rows, cols)?,
        GgmlDType::Q5K => QMatrix::from_gguf_bytes(QFormat::Q5K, &t.data()?, rows, cols)?,
        GgmlDType::Q6K => QMatrix::from_gguf_bytes(QFormat::Q6K, &t.data()?, rows, cols)?,
        GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
            QMatrix::from_f32(dense()?, rows, cols)?
        }
        // Other quantized types (Q5_1, Q2_K, Q3_K, ...): already lossy, so
        // they run on the 8-bit kernels, requantized to Q8_0 at load.
        _ => QMatrix::requantize_q8_0(&dense()?, rows, cols)?,
    })
}

/// Feeds a matrix's format, size and its first and last 4 KiB of weights to `h`.
fn weights_digest(m: &QMatrix, h: &mut impl sha2::Digest) {
    const SAMPLE: usize = 4096;
    let bytes: &[u8] = match m.weights() {
        tessera_kernels::matmul::Weights::Quant { format, tiles } => {
            h.update(format.name());
            tiles
        }
        tessera_kernels::matmul::Weights::F32(v) => {
            h.update("F32");
            let n = v.len().min(SAMPLE / 4);
            for x in v[..n].iter().chain(&v[v.len() - n..]) {
                h.update(x.to_le_bytes());
            }
            &[]
        }
    };
    h.update((m.rows() as u64).to_le_bytes());
    h.update((m.cols() as u64).to_le_bytes());
    let n = bytes.len().min(SAMPLE);
    h.update(&bytes[..n]);
    h.update(&bytes[bytes.len() - n..]);
}

impl Transformer {
    /// Loads weights described by `content` from `reader` (the same GGUF file).
    ///
    /// Errors: see [`ModelConfig::from_gguf`]; [`ModelError::Tensor`] for a
    /// missing tensor or one of the wrong shape (vectors included).
    pub fn load<R: Read + Seek>(content: &Content, reader: &mut R) -> Result<Self, ModelError> {
        let cfg = ModelConfig::from_gguf(content)?;
        let (d, qd, kvd, hd) = (cfg.hidden, cfg.q_dim(), cfg.kv_dim(), cfg.head_dim);
        let gemma = cfg.arch == Arch::Gemma3;
        let mut vector = |name: String, len: usize| -> Result<Vec<f32>, ModelError> {
            let v = read_vec(content, reader, &name)?;
            if v.len() != len {
                return Err(ModelError::Tensor {
                    name,
                    problem: format!("{} values, expected {len}", v.len()),
                });
            }
            Ok(v)
        };
        let mut norms = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = |s: &str| format!("blk.{i}.{s}");
            let qkv_bias = match cfg.arch {
                Arch::Qwen2 => {
                    let mut b = vector(p("attn_q.bias"), qd)?;
                    b.extend(vector(p("attn_k.bias"), kvd)?);
                    b.extend(vector(p("attn_v.bias"), kvd)?);
                    Some(b)
                }
                _ => None,
            };
            norms.push((
                vector(p("attn_norm.weight"), d)?,
                vector(p("ffn_norm.weight"), d)?,
                qkv_bias,
                if gemma {
                    Some((
                        vector(p("attn_q_norm.weight"), hd)?,
                        vector(p("attn_k_norm.weight"), hd)?,
                    ))
                } else {
                    None
                },
                if gemma {
                    Some((
                        vector(p("post_attention_norm.weight"), d)?,
                        vector(p("post_ffw_norm.weight"), d)?,
                    ))
                } else {
                    None
                },
            ));
        }
        let output_norm = vector("output_norm.weight".into(), d)?;
        let mut layers = Vec::with_capacity(cfg.layers);
        for (i, (attn_norm, ffn_norm, qkv_bias, qk_norm, post)) in norms.into_iter().enumerate() {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let window = cfg.layer_window(i);
            let (attn_post_norm, ffn_post_norm) = post.unzip();
            layers.push(Layer {
                attn_norm,
                wqkv: QMatrix::concat_rows(vec![
                    read_matrix(content, reader, &p("attn_q"), qd, d)?,
                    read_matrix(content, reader, &p("attn_k"), kvd, d)?,
                    read_matrix(content, reader, &p("attn_v"), kvd, d)?,
                ])?,
                qkv_bias,
                qk_norm,
                wo: read_matrix(content, reader, &p("attn_output"), d, qd)?,
                attn_post_norm,
                ffn_norm,
                gate_up: QMatrix::concat_rows(vec![
                    read_matrix(content, reader, &p("ffn_gate"), cfg.ffn, d)?,
                    read_matrix(content, reader, &p("ffn_up"), cfg.ffn, d)?,
                ])?,
                down: read_matrix(content, reader, &p("ffn_down"), d, cfg.ffn)?,
                ffn_post_norm,
                window,
                rope: usize::from(window.is_some()),
            });
        }
        let embed = read_matrix(content, reader, "token_embd.weight", cfg.vocab, d)?;
        let output = if content.tensor_infos.contains_key("output.weight") {
            Some(read_matrix(content, reader, "output.weight", cfg.vocab, d)?)
        } else {
            None
        };
        let fingerprint = {
            use sha2::{Digest, Sha256};
            let mut h = Sha256::new();
            h.update(format!("{cfg:?}"));
            let vectors = layers.iter().flat_map(|l| {
                [Some(&l.attn_norm), Some(&l.ffn_norm), l.qkv_bias.as_ref()]
                    .into_iter()
                    .chain([l.attn_post_norm.as_ref(), l.ffn_post_norm.as_ref()])
                    .chain([
                        l.qk_norm.as_ref().map(|(q, _)| q),
                        l.qk_norm.as_ref().map(|(_, k)| k),
                    ])
                    .flatten()
            });
            for v in std::iter::once(&output_norm).chain(vectors).flatten() {
                h.update(v.to_le_bytes());
            }
            // Each matrix's format and the ends of its weights: two files of one
            // shape (a requantized copy, other weights) never share a fingerprint.
            let matrices = layers
                .iter()
                .flat_map(|l| [&l.wqkv, &l.wo, &l.gate_up, &l.down])
                .chain([&embed])
                .chain(output.as_ref());
            for m in matrices {
                weights_digest(m, &mut h);
            }
            h.finalize().into()
        };
        let mut ropes = vec![Rope::new(hd, cfg.rope_base)];
        if let Some((_, base)) = cfg.sliding_window {
            ropes.push(Rope::new(hd, base));
        }
        Ok(Self {
            output_norm,
            ropes,
            fingerprint,
            embed_scale: if gemma { (d as f32).sqrt() } else { 1.0 },
            cfg,
            embed,
            output,
            layers,
        })
    }

    /// Model hyperparameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// A digest identifying these weights: SHA-256 of the hyperparameters, the
    /// normalization weights of every layer and each matrix's format, size and first
    /// and last 4 KiB (32 bytes; the prefix cache keys include it, so K/V computed by
    /// one model is never found for another, and a decode node refuses a commit of
    /// K/V another model computed).
    pub fn fingerprint(&self) -> [u8; 32] {
        self.fingerprint
    }

    /// Bytes of weights read per decode step (all matrices once).
    pub fn weight_bytes(&self) -> usize {
        let l: usize = self
            .layers
            .iter()
            .map(|l| {
                [&l.wqkv, &l.wo, &l.gate_up, &l.down]
                    .iter()
                    .map(|m| m.weight_bytes())
                    .sum::<usize>()
            })
            .sum();
        l + self.output.as_ref().unwrap_or(&self.embed).weight_bytes()
    }

    /// Runs one forward pass over `rows` (tokens of any number of sequences, each
    /// sequence's rows in increasing position), writing their K/V into the pages of
    /// their block tables and returning logits for rows that want them.
    ///
    /// A sequence whose block table does not match the pool's tags (I3) is reported in
    /// [`ForwardOutput::failed`]; nothing is written to or read from the mismatched
    /// page, and the other sequences' results are unaffected.
    pub fn forward(&self, rows: &[BatchRow], kv: &mut KvManager) -> ForwardOutput {
        self.forward_lora(rows, &[], kv)
    }

    /// [`Self::forward`] with a LoRA adapter per row (`lora[i]` for `rows[i]`;
    /// empty: none for any row): each adapted projection of a row adds `scale * B
    /// (A x)` of its own adapter to the base product, before any bias (as llama.cpp's
    /// `llm_build_lora_mm`). One batch mixes rows of any adapters and of none; a
    /// row's delta depends on that row alone, so its output is the same in any batch.
    pub fn forward_lora(
        &self,
        rows: &[BatchRow],
        lora: &[Option<&LoraWeights>],
        kv: &mut KvManager,
    ) -> ForwardOutput {
        let cfg = &self.cfg;
        let n = rows.len();
        let (d, nh) = (cfg.hidden, cfg.heads);
        let (qd, kvd) = (cfg.q_dim(), cfg.kv_dim());
        let layout = *kv.layout();
        let ps = layout.page_size;
        let mut failed: HashMap<SeqId, IntegrityError> = HashMap::new();

        let mut x = vec![0f32; n * d];
        for (r, xr) in rows.iter().zip(x.chunks_exact_mut(d)) {
            self.embed.dequantize_row(r.token as usize, xr);
            if self.embed_scale != 1.0 {
                xr.iter_mut().for_each(|v| *v *= self.embed_scale);
            }
        }
        let mut h = vec![0f32; n * d];
        let mut acts = Activations::default();
        let qkv_dim = qd + 2 * kvd;
        let mut qkv = vec![0f32; n * qkv_dim];
        let (mut q, mut k, mut v) = (vec![0f32; n * qd], vec![0f32; n * kvd], vec![0f32; n * kvd]);
        let mut attn = vec![0f32; n * qd];
        let mut proj = vec![0f32; n * d];
        let mut gate_up = vec![0f32; n * 2 * cfg.ffn];
        let mut gate = vec![0f32; n * cfg.ffn];
        let mut normed = Vec::new();

        for (li, l) in self.layers.iter().enumerate() {
            rms_norm(&x, &l.attn_norm, cfg.eps, &mut h);
            acts.set(&h, n, d);
            l.wqkv.matmul(&acts, &mut qkv);
            let parts = [
                (Target::Q, 0, qd),
                (Target::K, qd, kvd),
                (Target::V, qd + kvd, kvd),
            ];
            add_lora(lora, li, &parts, &h, d, &mut qkv, qkv_dim);
            if let Some(bias) = &l.qkv_bias {
                for row in qkv.chunks_exact_mut(qkv_dim) {
                    row.iter_mut().zip(bias).for_each(|(a, b)| *a += b);
                }
            }
            for (i, row) in qkv.chunks_exact(qkv_dim).enumerate() {
                q[i * qd..(i + 1) * qd].copy_from_slice(&row[..qd]);
                k[i * kvd..(i + 1) * kvd].copy_from_slice(&row[qd..qd + kvd]);
                v[i * kvd..(i + 1) * kvd].copy_from_slice(&row[qd + kvd..]);
            }
            if let Some((qn, kn)) = &l.qk_norm {
                // Per head: every `head_dim` values are one RMSNorm row.
                for (t, w) in [(&mut q, qn), (&mut k, kn)] {
                    normed.resize(t.len(), 0.0);
                    rms_norm(t, w, cfg.eps, &mut normed);
                    std::mem::swap(t, &mut normed);
                }
            }
            let rope = &self.ropes[l.rope];
            for (i, r) in rows.iter().enumerate() {
                let (qr, kr) = (&mut q[i * qd..(i + 1) * qd], &mut k[i * kvd..(i + 1) * kvd]);
                if cfg.arch.neox_rope() {
                    rope.apply_neox(qr, r.pos);
                    rope.apply_neox(kr, r.pos);
                } else {
                    rope.apply(qr, r.pos);
                    rope.apply(kr, r.pos);
                }
            }

            // Write this layer's K/V into each row's page, after checking its tag.
            let (pool, tables) = kv.split_mut();
            let (data, tags) = pool.data_and_tags_mut();
            for (i, r) in rows.iter().enumerate() {
                if failed.contains_key(&r.seq) {
                    continue;
                }
                let table = tables.get(&r.seq).map(|t| t.as_slice()).unwrap_or(&[]);
                let Some(e) = table.get(r.pos / ps) else {
                    panic!("sequence {:?} has no page for position {}", r.seq, r.pos);
                };
                if let Err(err) =
                    tessera_kernels::attention::verify_tags(tags, &table[..=r.pos / ps])
                {
                    failed.insert(r.seq, err);
                    continue;
                }
                let pb = layout.page_bytes();
                let page = &mut data[e.page as usize * pb..(e.page as usize + 1) * pb];
                let (kr, vr) = (&k[i * kvd..(i + 1) * kvd], &v[i * kvd..(i + 1) * kvd]);
                layout.write_token(page, li, r.pos % ps, kr, vr);
            }

            // Runs of consecutive rows of one sequence (a prefill chunk, or one
            // decode token) are one attention job; the kernel splits them further.
            let mut runs: Vec<(usize, usize)> = Vec::new();
            for (i, r) in rows.iter().enumerate() {
                match runs.last_mut() {
                    Some((s, len)) if rows[*s].seq == r.seq && *s + *len == i => *len += 1,
                    _ => runs.push((i, 1)),
                }
            }
            let runs: Vec<(usize, usize)> = runs
                .into_iter()
                .filter(|(s, _)| !failed.contains_key(&rows[*s].seq))
                .collect();
            let n_keys: Vec<usize> = rows.iter().map(|r| r.pos + 1).collect();
            attn.fill(0.0);
            let mut jobs = Vec::with_capacity(runs.len());
            let mut rest = &mut attn[..];
            let mut at = 0;
            for &(start, len) in &runs {
                let (_, tail) = std::mem::take(&mut rest).split_at_mut((start - at) * qd);
                let (out, tail) = tail.split_at_mut(len * qd);
                rest = tail;
                at = start + len;
                jobs.push(AttnJob {
                    q: &q[start * qd..(start + len) * qd],
                    n_keys: &n_keys[start..start + len],
                    table: kv.table(rows[start].seq).unwrap_or(&[]),
                    window: l.window,
                    out,
                });
            }
            let pool = PoolKv {
                layout: &layout,
                data: kv.pool().data(),
                tags: kv.pool().tags(),
                layer: li,
            };
            let results = paged_attention_jobs(pool, nh, &mut jobs);
            for (&(start, _), res) in runs.iter().zip(results) {
                if let Err(e) = res {
                    failed.entry(rows[start].seq).or_insert(e);
                }
            }

            acts.set(&attn, n, qd);
            l.wo.matmul(&acts, &mut proj);
            add_lora(lora, li, &[(Target::O, 0, d)], &attn, qd, &mut proj, d);
            add_residual(
                &mut x,
                &mut proj,
                l.attn_post_norm.as_deref(),
                cfg.eps,
                &mut h,
            );

            rms_norm(&x, &l.ffn_norm, cfg.eps, &mut h);
            acts.set(&h, n, d);
            l.gate_up.matmul(&acts, &mut gate_up);
            let ffn = cfg.ffn;
            let parts = [(Target::Gate, 0, ffn), (Target::Up, ffn, ffn)];
            add_lora(lora, li, &parts, &h, d, &mut gate_up, 2 * ffn);
            match cfg.arch {
                Arch::Gemma3 => gelu_tanh_rows(&gate_up, cfg.ffn, &mut gate),
                Arch::Llama | Arch::Qwen2 => swiglu_rows(&gate_up, cfg.ffn, &mut gate),
            }
            acts.set(&gate, n, cfg.ffn);
            l.down.matmul(&acts, &mut proj);
            add_lora(
                lora,
                li,
                &[(Target::Down, 0, d)],
                &gate,
                cfg.ffn,
                &mut proj,
                d,
            );
            add_residual(
                &mut x,
                &mut proj,
                l.ffn_post_norm.as_deref(),
                cfg.eps,
                &mut h,
            );
        }

        let want: Vec<usize> = (0..n)
            .filter(|&i| rows[i].want_logits && !failed.contains_key(&rows[i].seq))
            .collect();
        let mut logits = Vec::with_capacity(want.len());
        if !want.is_empty() {
            let mut xs = Vec::with_capacity(want.len() * d);
            for &i in &want {
                xs.extend_from_slice(&x[i * d..(i + 1) * d]);
            }
            let mut hs = vec![0f32; xs.len()];
            rms_norm(&xs, &self.output_norm, cfg.eps, &mut hs);
            acts.set(&hs, want.len(), d);
            let head = self.output.as_ref().unwrap_or(&self.embed);
            let mut out = vec![0f32; want.len() * cfg.vocab];
            head.matmul(&acts, &mut out);
            for (j, &i) in want.iter().enumerate() {
                logits.push((i, out[j * cfg.vocab..(j + 1) * cfg.vocab].to_vec()));
            }
        }
        ForwardOutput { logits, failed }
    }
}

/// Adds each row's LoRA deltas for the projections `parts` of block `layer` that
/// share the input `x`: `(target, at, len)` adds row `i`'s delta, reading
/// `x[i * in_dim..][..in_dim]`, into `out[i * stride + at..][..len]`.
fn add_lora(
    lora: &[Option<&LoraWeights>],
    layer: usize,
    parts: &[(Target, usize, usize)],
    x: &[f32],
    in_dim: usize,
    out: &mut [f32],
    stride: usize,
) {
    debug_assert!(parts
        .iter()
        .all(|&(target, _, len)| lora.iter().flatten().all(|w| w
            .pair(layer, target)
            .is_none_or(|p| p.inputs == in_dim && p.outputs == len))));
    // Rows grouped by adapter, so each adapter's weights are read once a pass (per
    // thread): work units of up to a group's share of rows for one projection, all
    // of `parts` in one parallel region (a fork-join costs microseconds, and a
    // decode step has one per region).
    let threads = tessera_kernels::pool::global().threads().max(1);
    let mut done = vec![false; lora.len()];
    let mut units: Vec<(&crate::lora::LoraPair, usize, Vec<usize>)> = Vec::new();
    for i in 0..lora.len() {
        let Some(w) = lora[i].filter(|_| !done[i]) else {
            continue;
        };
        let rows: Vec<usize> = (i..lora.len())
            .filter(|&j| lora[j].is_some_and(|v| std::ptr::eq(v, w)))
            .collect();
        for &j in &rows {
            done[j] = true;
        }
        for &(target, at, _) in parts {
            if let Some(p) = w.pair(layer, target) {
                let per = rows.len().div_ceil(threads).max(4);
                units.extend(rows.chunks(per).map(|c| (p, at, c.to_vec())));
            }
        }
    }
    assert!(parts.windows(2).all(|w| w[0].1 + w[0].2 <= w[1].1));
    assert!(units.iter().all(|(p, at, rows)| at + p.outputs <= stride
        && rows
            .iter()
            .all(|&i| (i + 1) * in_dim <= x.len() && (i + 1) * stride <= out.len())));
    let base = RowsPtr(out.as_mut_ptr());
    tessera_kernels::pool::global().parallel_for(units.len(), |u| {
        let (p, at, rows) = &units[u];
        // SAFETY: in bounds (checked above); each (row, projection) belongs to one
        // unit, and its range `i * stride + at..+outputs` to that row and projection
        // alone (the parts' column ranges are disjoint within a row).
        p.apply_rows_to(rows, x, |i| unsafe {
            std::slice::from_raw_parts_mut(base.at(i * stride + at), p.outputs)
        });
    });
}

/// An output buffer written by several pool tasks at disjoint rows.
#[derive(Clone, Copy)]
struct RowsPtr(*mut f32);
// SAFETY: tasks write disjoint rows of a buffer that outlives the parallel region.
unsafe impl Send for RowsPtr {}
unsafe impl Sync for RowsPtr {}

impl RowsPtr {
    /// Pointer to element `idx` (a method, so closures capture the whole wrapper).
    fn at(self, idx: usize) -> *mut f32 {
        // SAFETY: callers pass in-bounds indices.
        unsafe { self.0.add(idx) }
    }
}

/// `x += block_out`, with `block_out` RMSNormed by `post_norm` first where the
/// architecture has one (gemma3); `scratch` is `block_out`'s size.
fn add_residual(
    x: &mut [f32],
    block_out: &mut [f32],
    post_norm: Option<&[f32]>,
    eps: f32,
    scratch: &mut [f32],
) {
    let out: &[f32] = match post_norm {
        Some(w) => {
            rms_norm(block_out, w, eps, scratch);
            scratch
        }
        None => block_out,
    };
    x.iter_mut().zip(out).for_each(|(a, b)| *a += b);
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{gguf_file, QTensor};
    use candle_core::{Device, Tensor};
    use rand::{Rng, SeedableRng};
    use tessera_kernels::matmul::Weights;

    /// A `Q5_K` tensor of a GGUF file loads as native `Q5_K` tiles, not requantized
    /// to `Q8_0`, and its rows read back as candle dequantizes them.
    #[test]
    fn q5_k_matrices_load_natively() {
        let (rows, cols) = (20, 512);
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(5);
        let data: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-0.1..0.1))
            .collect();
        let t = Tensor::from_vec(data, (rows, cols), &Device::Cpu).unwrap();
        let q = QTensor::quantize(&t, GgmlDType::Q5K).unwrap();
        let mut file = std::io::Cursor::new(Vec::new());
        gguf_file::write(&mut file, &[], &[("w", &q)]).unwrap();
        file.set_position(0);
        let content = Content::read(&mut file).unwrap();
        let m = read_matrix(&content, &mut file, "w", rows, cols).unwrap();
        assert!(matches!(
            m.weights(),
            Weights::Quant {
                format: QFormat::Q5K,
                ..
            }
        ));
        let want: Vec<f32> = q
            .dequantize(&Device::Cpu)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let mut row = vec![0f32; cols];
        for r in 0..rows {
            m.dequantize_row(r, &mut row);
            assert_eq!(row, want[r * cols..(r + 1) * cols], "row {r}");
        }
    }
}
