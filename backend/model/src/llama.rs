//! Llama-architecture forward pass over the paged KV cache.
//!
//! Weights come from a GGUF file (candle-core's GGUF reader; tensor names and
//! metadata keys as written by llama.cpp's `convert_hf_to_gguf.py`). `Q4_0`,
//! `Q4_1` and `Q8_0` matrices use our kernels directly (repacked at load into
//! interleaved tiles); other quantized types are requantized to `Q8_0` at load and
//! unquantized ones (`F32`, `F16`, `BF16`) kept in `f32`. The math follows llama.cpp's `llm_build_llama`: RMSNorm, Q/K/V,
//! normal-mode RoPE, grouped-query attention, output projection, SwiGLU FFN,
//! residuals, final RMSNorm and the LM head (tied to the embeddings when the file
//! has no `output.weight`).

use crate::kv::{KvManager, SeqId};
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use std::collections::HashMap;
use std::io::{Read, Seek};
use tessera_kernels::ops::{rms_norm, swiglu_rows, Rope};
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
    /// The file is not a llama-architecture model.
    #[error("unsupported architecture `{0}` (only `llama` is supported)")]
    Architecture(String),
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

/// Hyperparameters read from `llama.*` GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Transformer blocks (`llama.block_count`).
    pub layers: usize,
    /// Model width (`llama.embedding_length`).
    pub hidden: usize,
    /// FFN width (`llama.feed_forward_length`).
    pub ffn: usize,
    /// Query heads (`llama.attention.head_count`).
    pub heads: usize,
    /// KV heads (`llama.attention.head_count_kv`).
    pub kv_heads: usize,
    /// `hidden / heads`.
    pub head_dim: usize,
    /// Vocabulary size (rows of the embedding matrix).
    pub vocab: usize,
    /// Trained context window in tokens (`llama.context_length`).
    pub context: usize,
    /// RoPE base (`llama.rope.freq_base`, default 10000).
    pub rope_base: f32,
    /// RMSNorm epsilon (`llama.attention.layer_norm_rms_epsilon`).
    pub eps: f32,
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

impl LlamaConfig {
    /// Reads the config from GGUF metadata.
    pub fn from_gguf(c: &Content) -> Result<Self, ModelError> {
        let arch = c
            .metadata
            .get("general.architecture")
            .and_then(|v| v.to_string().ok())
            .cloned()
            .unwrap_or_default();
        if arch != "llama" {
            return Err(ModelError::Architecture(arch));
        }
        let hidden = meta_u(c, "llama.embedding_length")?;
        let heads = meta_u(c, "llama.attention.head_count")?;
        let vocab = c
            .tensor_infos
            .get("token_embd.weight")
            .map(|t| t.shape.dims()[0])
            .ok_or_else(|| ModelError::Tensor {
                name: "token_embd.weight".into(),
                problem: "missing".into(),
            })?;
        Ok(Self {
            layers: meta_u(c, "llama.block_count")?,
            hidden,
            ffn: meta_u(c, "llama.feed_forward_length")?,
            heads,
            kv_heads: meta_u(c, "llama.attention.head_count_kv").unwrap_or(heads),
            head_dim: hidden / heads,
            vocab,
            context: meta_u(c, "llama.context_length")?,
            rope_base: meta_f(c, "llama.rope.freq_base").unwrap_or(10000.0),
            eps: meta_f(c, "llama.attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
        })
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
    /// Q, K and V stacked: `[hidden + 2 * kv_dim, hidden]`.
    wqkv: QMatrix,
    wo: QMatrix,
    ffn_norm: Vec<f32>,
    /// Gate and up stacked: `[2 * ffn, hidden]`.
    gate_up: QMatrix,
    down: QMatrix,
}

/// Loaded llama weights.
#[derive(Debug)]
pub struct Llama {
    cfg: LlamaConfig,
    embed: QMatrix,
    output: Option<QMatrix>,
    output_norm: Vec<f32>,
    layers: Vec<Layer>,
    rope: Rope,
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
        GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
            QMatrix::from_f32(dense()?, rows, cols)?
        }
        // Other quantized types (K-quants, Q5_x, ...): already lossy, so they run
        // on the 8-bit kernels, requantized to Q8_0 at load.
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

impl Llama {
    /// Loads weights described by `content` from `reader` (the same GGUF file).
    pub fn load<R: Read + Seek>(content: &Content, reader: &mut R) -> Result<Self, ModelError> {
        let cfg = LlamaConfig::from_gguf(content)?;
        let (d, kvd) = (cfg.hidden, cfg.kv_heads * cfg.head_dim);
        let mut layers = Vec::with_capacity(cfg.layers);
        for i in 0..cfg.layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            layers.push(Layer {
                attn_norm: read_vec(content, reader, &p("attn_norm"))?,
                wqkv: QMatrix::concat_rows(vec![
                    read_matrix(content, reader, &p("attn_q"), d, d)?,
                    read_matrix(content, reader, &p("attn_k"), kvd, d)?,
                    read_matrix(content, reader, &p("attn_v"), kvd, d)?,
                ])?,
                wo: read_matrix(content, reader, &p("attn_output"), d, d)?,
                ffn_norm: read_vec(content, reader, &p("ffn_norm"))?,
                gate_up: QMatrix::concat_rows(vec![
                    read_matrix(content, reader, &p("ffn_gate"), cfg.ffn, d)?,
                    read_matrix(content, reader, &p("ffn_up"), cfg.ffn, d)?,
                ])?,
                down: read_matrix(content, reader, &p("ffn_down"), d, cfg.ffn)?,
            });
        }
        let embed = read_matrix(content, reader, "token_embd.weight", cfg.vocab, d)?;
        let output = if content.tensor_infos.contains_key("output.weight") {
            Some(read_matrix(content, reader, "output.weight", cfg.vocab, d)?)
        } else {
            None
        };
        let output_norm = read_vec(content, reader, "output_norm.weight")?;
        let fingerprint = {
            use sha2::{Digest, Sha256};
            let mut h = Sha256::new();
            h.update(format!("{cfg:?}"));
            for v in output_norm
                .iter()
                .chain(layers.iter().flat_map(|l| &l.attn_norm))
            {
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
        Ok(Self {
            output_norm,
            rope: Rope::new(cfg.head_dim, cfg.rope_base),
            fingerprint,
            cfg,
            embed,
            output,
            layers,
        })
    }

    /// Model hyperparameters.
    pub fn config(&self) -> &LlamaConfig {
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
        let cfg = &self.cfg;
        let n = rows.len();
        let (d, hd, nh) = (cfg.hidden, cfg.head_dim, cfg.heads);
        let kvd = cfg.kv_heads * hd;
        let layout = *kv.layout();
        let ps = layout.page_size;
        let mut failed: HashMap<SeqId, IntegrityError> = HashMap::new();

        let mut x = vec![0f32; n * d];
        for (r, xr) in rows.iter().zip(x.chunks_exact_mut(d)) {
            self.embed.dequantize_row(r.token as usize, xr);
        }
        let mut h = vec![0f32; n * d];
        let mut acts = Activations::default();
        let qkv_dim = d + 2 * kvd;
        let mut qkv = vec![0f32; n * qkv_dim];
        let (mut q, mut k, mut v) = (vec![0f32; n * d], vec![0f32; n * kvd], vec![0f32; n * kvd]);
        let mut attn = vec![0f32; n * d];
        let mut proj = vec![0f32; n * d];
        let mut gate_up = vec![0f32; n * 2 * cfg.ffn];
        let mut gate = vec![0f32; n * cfg.ffn];

        for (li, l) in self.layers.iter().enumerate() {
            rms_norm(&x, &l.attn_norm, cfg.eps, &mut h);
            acts.set(&h, n, d);
            l.wqkv.matmul(&acts, &mut qkv);
            for (i, row) in qkv.chunks_exact(qkv_dim).enumerate() {
                q[i * d..(i + 1) * d].copy_from_slice(&row[..d]);
                k[i * kvd..(i + 1) * kvd].copy_from_slice(&row[d..d + kvd]);
                v[i * kvd..(i + 1) * kvd].copy_from_slice(&row[d + kvd..]);
            }
            for (i, r) in rows.iter().enumerate() {
                self.rope.apply(&mut q[i * d..(i + 1) * d], r.pos);
                self.rope.apply(&mut k[i * kvd..(i + 1) * kvd], r.pos);
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
                let (_, tail) = std::mem::take(&mut rest).split_at_mut((start - at) * d);
                let (out, tail) = tail.split_at_mut(len * d);
                rest = tail;
                at = start + len;
                jobs.push(AttnJob {
                    q: &q[start * d..(start + len) * d],
                    n_keys: &n_keys[start..start + len],
                    table: kv.table(rows[start].seq).unwrap_or(&[]),
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

            acts.set(&attn, n, d);
            l.wo.matmul(&acts, &mut proj);
            x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);

            rms_norm(&x, &l.ffn_norm, cfg.eps, &mut h);
            acts.set(&h, n, d);
            l.gate_up.matmul(&acts, &mut gate_up);
            swiglu_rows(&gate_up, cfg.ffn, &mut gate);
            acts.set(&gate, n, cfg.ffn);
            l.down.matmul(&acts, &mut proj);
            x.iter_mut().zip(&proj).for_each(|(a, b)| *a += b);
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
