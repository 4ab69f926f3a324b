//! The llama forward pass on a CUDA device (feature `cuda`), over a KV pool in
//! device memory whose pages carry tags the kernels check (DESIGN.md §5, §7).
//!
//! Same model and same contract as [`crate::transformer::Transformer::forward`]: rows of any
//! number of sequences in, logits (or greedy tokens) for the rows that want them
//! out, and every sequence whose block table does not match the pool's tags (I3)
//! reported as failed with no logits. The host [`KvManager`] keeps what it keeps on
//! the CPU (block tables, tags, epochs, the free list; its page bytes go unused,
//! a lazily mapped zero allocation); the device holds the page bytes and a copy of
//! the tag array, brought up to date before each step for every page the step
//! touches, so a device tag that differs from the host's (a stale or planted
//! write on the device) fails the sequence like a wrong block table does.
//!
//! Weights: GGUF `Q4_0`/`Q4_1`/`Q8_0` matrices are uploaded as file bytes and
//! dequantized to bf16 on the device (exactly `quant::dequantize_block`, rounded
//! to nearest even); other types go through candle's dequantizer on the host. The
//! GEMMs are cuBLAS bf16 x bf16 with f32 accumulation; activations, norms, RoPE,
//! softmax and the residual stream are f32; K/V are stored as the CPU stores them
//! (8-bit with per-token scales, [`tessera_kernels::KvLayout`]). So greedy output
//! equals the CPU's except at near-ties (bf16 weights against 8-bit activations).
//!
//! Per layer: RMSNorm -> bf16 -> GEMM (Q, K, V stacked) -> RoPE on Q and K ->
//! `kv_store` (tag check, 16-bit K and 8-bit V into the row's slot) -> paged attention (tag
//! check per page) -> bf16 -> GEMM (output, accumulated into the residual) ->
//! RMSNorm -> GEMM (gate, up) -> SwiGLU -> GEMM (down, accumulated).

use crate::kv::{KvManager, SeqId};
use crate::transformer::{Arch, BatchRow, ForwardOutput, ModelConfig, ModelError};
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::GgmlDType;
use std::collections::HashMap;
use std::io::{Read, Seek};
use tessera_kernels::cuda::{
    pool_pages, AttentionLaunch, CudaDevice, CudaError, CudaSlice, DeviceKv, SizingError, StepRow,
    StepSeq, StepTables,
};
use tessera_kernels::ops::Rope;
use tessera_kernels::quant::QFormat;
use tessera_kernels::{IntegrityError, PageTag};

/// Errors of the device model.
#[derive(Debug, thiserror::Error)]
pub enum CudaModelError {
    /// The GGUF file (as on the CPU).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The device.
    #[error(transparent)]
    Cuda(#[from] CudaError),
    /// The pool's size.
    #[error(transparent)]
    Sizing(#[from] SizingError),
    /// A row names a position its sequence's block table does not cover.
    #[error("sequence {seq} has no page for position {pos}")]
    NoPage {
        /// Sequence.
        seq: u64,
        /// Position.
        pos: usize,
    },
}

impl From<candle_core::Error> for CudaModelError {
    fn from(e: candle_core::Error) -> Self {
        Self::Model(ModelError::Gguf(e))
    }
}

/// How large the device KV pool is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum PoolSize {
    /// Exactly this many pages.
    Pages(usize),
    /// This fraction of the device memory free once weights and step buffers are
    /// allocated ([`tessera_kernels::cuda::pool_pages`]).
    Fraction(f64),
}

/// Options of [`CudaLlama::load`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CudaOptions {
    /// Token slots per KV page (the engine's page size).
    pub page_size: usize,
    /// Most rows (tokens) one step computes: the step buffers' size.
    pub max_rows: usize,
    /// The KV pool.
    pub pool: PoolSize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            page_size: 16,
            max_rows: 4096,
            pool: PoolSize::Fraction(0.9),
        }
    }
}

/// One layer's weights on the device (bf16 matrices `[out, in]` row-major).
struct Layer {
    attn_norm: CudaSlice<f32>,
    /// Q, K and V stacked: `[hidden + 2 * kv_dim, hidden]`.
    wqkv: CudaSlice<u16>,
    wo: CudaSlice<u16>,
    ffn_norm: CudaSlice<f32>,
    /// Gate and up stacked: `[2 * ffn, hidden]`.
    gate_up: CudaSlice<u16>,
    down: CudaSlice<u16>,
}

/// Step buffers, sized for `rows` rows and `logit_rows` rows of logits.
struct Scratch {
    rows: usize,
    logit_rows: usize,
    x: CudaSlice<f32>,
    /// bf16 GEMM input, `[rows, max(hidden, ffn)]`.
    h: CudaSlice<u16>,
    qkv: CudaSlice<f32>,
    attn: CudaSlice<f32>,
    gate_up: CudaSlice<f32>,
    tokens: CudaSlice<u32>,
    want: CudaSlice<u32>,
    logits: CudaSlice<f32>,
    greedy: CudaSlice<u32>,
}

impl Scratch {
    fn new(
        dev: &CudaDevice,
        cfg: &ModelConfig,
        rows: usize,
        logit_rows: usize,
    ) -> Result<Self, CudaError> {
        let (d, kvd) = (cfg.hidden, cfg.kv_heads * cfg.head_dim);
        Ok(Self {
            rows,
            logit_rows,
            x: dev.zeros(rows * d)?,
            h: dev.zeros(rows * d.max(cfg.ffn))?,
            qkv: dev.zeros(rows * (d + 2 * kvd))?,
            attn: dev.zeros(rows * d)?,
            gate_up: dev.zeros(rows * 2 * cfg.ffn)?,
            tokens: dev.zeros(rows)?,
            want: dev.zeros(rows)?,
            logits: dev.zeros(logit_rows * cfg.vocab)?,
            greedy: dev.zeros(logit_rows)?,
        })
    }
}

/// What a step returns besides failures.
enum Wanted {
    Logits(Vec<(usize, Vec<f32>)>),
    Greedy(Vec<(usize, u32)>),
}

/// Greedy tokens of one forward pass on the device.
#[derive(Debug, Default)]
pub struct GreedyOutput {
    /// `(row index, argmax token)` for every row that asked and did not fail.
    pub tokens: Vec<(usize, u32)>,
    /// Sequences that failed an integrity check; they produced no token.
    pub failed: HashMap<SeqId, IntegrityError>,
}

/// A llama model on a CUDA device with its device KV pool.
pub struct CudaLlama {
    dev: CudaDevice,
    cfg: ModelConfig,
    layers: Vec<Layer>,
    embed: CudaSlice<u16>,
    output: Option<CudaSlice<u16>>,
    output_norm: CudaSlice<f32>,
    inv_freq: CudaSlice<f32>,
    weight_bytes: usize,
    kv: DeviceKv,
    /// The device tag array as this host last wrote it.
    shadow: Vec<PageTag>,
    tables: StepTables,
    scratch: Scratch,
}

impl std::fmt::Debug for CudaLlama {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaLlama")
            .field("device", self.dev.info())
            .field("config", &self.cfg)
            .field("kv", &self.kv)
            .finish()
    }
}

/// Reads tensors of one GGUF file onto the device.
struct Loader<'a, R> {
    dev: &'a CudaDevice,
    c: &'a Content,
    r: &'a mut R,
}

impl<R: Read + Seek> Loader<'_, R> {
    /// Uploads matrix `name` (`[rows, cols]`) as bf16 into `out` at element `at`.
    fn matrix(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
        out: &mut CudaSlice<u16>,
        at: usize,
    ) -> Result<(), CudaModelError> {
        let t = self.c.tensor(self.r, name, &candle_core::Device::Cpu)?;
        let dims = t.shape().dims().to_vec();
        if dims != [rows, cols] {
            return Err(ModelError::Tensor {
                name: name.into(),
                problem: format!("shape {dims:?}, expected [{rows}, {cols}]"),
            }
            .into());
        }
        let format = match t.dtype() {
            GgmlDType::Q4_0 => Some(QFormat::Q4_0),
            GgmlDType::Q4_1 => Some(QFormat::Q4_1),
            GgmlDType::Q8_0 => Some(QFormat::Q8_0),
            _ => None,
        };
        match format {
            Some(f) => {
                let bytes = t.data()?;
                let blocks = rows * cols / 32;
                let dbytes = self.dev.upload(&bytes[..blocks * f.block_bytes()])?;
                self.dev.dequantize(f, &dbytes, blocks, out, at)?;
            }
            None => {
                // Other types: candle's dequantizer on the host, then bf16.
                let dense = t
                    .dequantize(&candle_core::Device::Cpu)?
                    .flatten_all()?
                    .to_vec1::<f32>()?;
                let bf: Vec<u16> = dense
                    .iter()
                    .map(|v| half::bf16::from_f32(*v).to_bits())
                    .collect();
                let tmp = self.dev.upload(&bf)?;
                self.dev.copy_into(&tmp, bf.len(), out, at)?;
            }
        }
        Ok(())
    }

    /// A new bf16 matrix `[rows, cols]` from tensor `name`.
    fn new_matrix(
        &mut self,
        name: &str,
        rows: usize,
        cols: usize,
    ) -> Result<CudaSlice<u16>, CudaModelError> {
        let mut m = self.dev.zeros::<u16>(rows * cols)?;
        self.matrix(name, rows, cols, &mut m, 0)?;
        Ok(m)
    }

    /// An f32 vector (norm weights).
    fn vector(&mut self, name: &str) -> Result<CudaSlice<f32>, CudaModelError> {
        let t = self.c.tensor(self.r, name, &candle_core::Device::Cpu)?;
        let v = t
            .dequantize(&candle_core::Device::Cpu)?
            .flatten_all()?
            .to_vec1::<f32>()?;
        Ok(self.dev.upload(&v)?)
    }
}

impl CudaLlama {
    /// Loads the weights of `content` (read from `reader`, the same GGUF file) onto
    /// `dev`, allocates the step buffers for `opts.max_rows` rows, then the KV
    /// pool ([`PoolSize`]; with a fraction, of the memory then free).
    ///
    /// Errors: the GGUF's ([`ModelError`]); the device's ([`CudaError`], out of
    /// memory included); [`SizingError`] when not one page fits.
    pub fn load<R: Read + Seek>(
        content: &Content,
        reader: &mut R,
        dev: CudaDevice,
        opts: CudaOptions,
    ) -> Result<Self, CudaModelError> {
        let cfg = ModelConfig::from_gguf(content)?;
        if cfg.arch != Arch::Llama {
            // The device forward pass has no biases, QK-norm, post-norms, GELU or
            // sliding windows yet.
            return Err(ModelError::CpuOnly(cfg.arch.name()).into());
        }
        let (d, kvd, ffn) = (cfg.hidden, cfg.kv_heads * cfg.head_dim, cfg.ffn);
        let mut layers = Vec::with_capacity(cfg.layers);
        let mut weight_bytes = 0;
        let mut ld = Loader {
            dev: &dev,
            c: content,
            r: reader,
        };
        for i in 0..cfg.layers {
            let p = |s: &str| format!("blk.{i}.{s}.weight");
            let mut wqkv = dev.zeros::<u16>((d + 2 * kvd) * d)?;
            ld.matrix(&p("attn_q"), d, d, &mut wqkv, 0)?;
            ld.matrix(&p("attn_k"), kvd, d, &mut wqkv, d * d)?;
            ld.matrix(&p("attn_v"), kvd, d, &mut wqkv, (d + kvd) * d)?;
            let wo = ld.new_matrix(&p("attn_output"), d, d)?;
            let mut gate_up = dev.zeros::<u16>(2 * ffn * d)?;
            ld.matrix(&p("ffn_gate"), ffn, d, &mut gate_up, 0)?;
            ld.matrix(&p("ffn_up"), ffn, d, &mut gate_up, ffn * d)?;
            let down = ld.new_matrix(&p("ffn_down"), d, ffn)?;
            weight_bytes += 2 * (wqkv.len() + wo.len() + gate_up.len() + down.len());
            layers.push(Layer {
                attn_norm: ld.vector(&p("attn_norm"))?,
                ffn_norm: ld.vector(&p("ffn_norm"))?,
                wqkv,
                wo,
                gate_up,
                down,
            });
        }
        let embed = ld.new_matrix("token_embd.weight", cfg.vocab, d)?;
        let output = if content.tensor_infos.contains_key("output.weight") {
            Some(ld.new_matrix("output.weight", cfg.vocab, d)?)
        } else {
            None
        };
        weight_bytes += 2 * output.as_ref().unwrap_or(&embed).len();
        let output_norm = ld.vector("output_norm.weight")?;
        let inv_freq = dev.upload(Rope::new(cfg.head_dim, cfg.rope_base).inv_freq())?;
        let scratch = Scratch::new(&dev, &cfg, opts.max_rows.max(1), 256)?;
        let tables = StepTables::new(&dev, 1 << 16)?;
        dev.synchronize()?;
        let layout = cfg.kv_layout(opts.page_size);
        let pages = match opts.pool {
            PoolSize::Pages(n) => n,
            PoolSize::Fraction(f) => pool_pages(dev.mem_info()?.0, f, &layout)?,
        };
        let kv = DeviceKv::new(&dev, layout, pages)?;
        Ok(Self {
            shadow: vec![PageTag::default(); pages],
            dev,
            cfg,
            layers,
            embed,
            output,
            output_norm,
            inv_freq,
            weight_bytes,
            kv,
            tables,
            scratch,
        })
    }

    /// [`Self::load`] from a GGUF file.
    ///
    /// Errors: as [`Self::load`]; the file's ([`ModelError::Gguf`]).
    pub fn load_file(
        path: &std::path::Path,
        dev: CudaDevice,
        opts: CudaOptions,
    ) -> Result<Self, CudaModelError> {
        let mut f = std::fs::File::open(path).map_err(candle_core::Error::from)?;
        let content = Content::read(&mut f)?;
        Self::load(&content, &mut f, dev, opts)
    }

    /// Model hyperparameters.
    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// The device.
    pub fn device(&self) -> &CudaDevice {
        &self.dev
    }

    /// Bytes of bf16 weights read per decode step (every matrix once).
    pub fn weight_bytes(&self) -> usize {
        self.weight_bytes
    }

    /// Pages of the device KV pool (the host [`KvManager`]'s pool must have as
    /// many, of the same layout).
    pub fn kv_pages(&self) -> usize {
        self.kv.pages()
    }

    /// Tokens the device KV pool holds: the number I2 is checked against.
    pub fn kv_tokens(&self) -> usize {
        self.kv.pages() * self.kv.layout().page_size
    }

    /// The device KV pool (tests and fault injection).
    pub fn device_kv(&mut self) -> &mut DeviceKv {
        &mut self.kv
    }

    /// Writes `tag` into the device tag array of `page` behind the host's back
    /// (fault injection for the GPU check: the next read of that page fails).
    pub fn plant_device_tag(&mut self, page: u32, tag: PageTag) -> Result<(), CudaError> {
        self.kv.write_tags(&self.dev, &[(page, tag)])
    }

    /// One forward pass, as [`crate::transformer::Transformer::forward`]: logits for the rows
    /// that want them, failed sequences reported (no logits).
    pub fn forward(
        &mut self,
        rows: &[BatchRow],
        kv: &mut KvManager,
    ) -> Result<ForwardOutput, CudaModelError> {
        let (wanted, failed) = self.run(rows, kv, false)?;
        let Wanted::Logits(logits) = wanted else {
            unreachable!("logits asked for")
        };
        Ok(ForwardOutput { logits, failed })
    }

    /// One forward pass returning the greedy token of each row that wants logits
    /// (argmax on the device: no logits cross to the host).
    pub fn forward_greedy(
        &mut self,
        rows: &[BatchRow],
        kv: &mut KvManager,
    ) -> Result<GreedyOutput, CudaModelError> {
        let (wanted, failed) = self.run(rows, kv, true)?;
        let Wanted::Greedy(tokens) = wanted else {
            unreachable!("greedy asked for")
        };
        Ok(GreedyOutput { tokens, failed })
    }

    fn run(
        &mut self,
        rows: &[BatchRow],
        kv: &mut KvManager,
        greedy: bool,
    ) -> Result<(Wanted, HashMap<SeqId, IntegrityError>), CudaModelError> {
        let cfg = self.cfg.clone();
        let n = rows.len();
        let empty = if greedy {
            Wanted::Greedy(Vec::new())
        } else {
            Wanted::Logits(Vec::new())
        };
        if n == 0 {
            return Ok((empty, HashMap::new()));
        }
        if n > self.scratch.rows {
            self.scratch = Scratch::new(&self.dev, &cfg, n, self.scratch.logit_rows)?;
        }
        let (d, hd, nh, kvh) = (cfg.hidden, cfg.head_dim, cfg.heads, cfg.kv_heads);
        let kvd = kvh * hd;
        let qkv_dim = d + 2 * kvd;
        let ps = kv.layout().page_size;
        assert_eq!(
            *kv.layout(),
            *self.kv.layout(),
            "host and device pools differ in layout"
        );
        assert_eq!(
            kv.pool().capacity(),
            self.kv.pages(),
            "host and device pools differ in size"
        );

        // Slots: the step's sequences in order of first appearance.
        let mut slot_of: HashMap<SeqId, u32> = HashMap::new();
        let mut slots: Vec<SeqId> = Vec::new();
        let mut step_rows = Vec::with_capacity(n);
        let mut need: Vec<usize> = Vec::new();
        for r in rows {
            let s = *slot_of.entry(r.seq).or_insert_with(|| {
                slots.push(r.seq);
                need.push(0);
                slots.len() as u32 - 1
            });
            need[s as usize] = need[s as usize].max(r.pos / ps + 1);
            step_rows.push(StepRow {
                slot: s,
                pos: r.pos as u32,
            });
        }
        let mut seqs = Vec::with_capacity(slots.len());
        for (i, s) in slots.iter().enumerate() {
            let table = kv.table(*s).unwrap_or(&[]);
            if table.len() < need[i] {
                let pos = rows
                    .iter()
                    .filter(|r| r.seq == *s)
                    .map(|r| r.pos)
                    .max()
                    .unwrap_or(0);
                return Err(CudaModelError::NoPage { seq: s.0, pos });
            }
            seqs.push(StepSeq {
                table: &table[..need[i]],
            });
        }
        // The device tags of every page this step touches, brought up to date.
        let host_tags = kv.pool().tags();
        let mut updates = Vec::new();
        for e in seqs.iter().flat_map(|q| q.table.iter()) {
            let p = e.page as usize;
            if p < host_tags.len() && self.shadow[p] != host_tags[p] {
                self.shadow[p] = host_tags[p];
                updates.push((e.page, host_tags[p]));
            }
        }
        updates.sort_by_key(|u| u.0);
        updates.dedup_by_key(|u| u.0);
        self.kv.write_tags(&self.dev, &updates)?;
        self.tables.set(&self.dev, &step_rows, &seqs)?;
        let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
        self.dev.upload_into(&tokens, &mut self.scratch.tokens)?;
        let check = tessera_kernels::attention::integrity_checks();

        let dev = &self.dev;
        let sc = &mut self.scratch;
        dev.embed_rows(&self.embed, cfg.vocab, &sc.tokens, n, &mut sc.x, d)?;
        for (li, l) in self.layers.iter().enumerate() {
            dev.rms_norm(
                &sc.x,
                &l.attn_norm,
                cfg.eps,
                d,
                n,
                None,
                None,
                Some(&mut sc.h),
            )?;
            dev.gemm_bf16(&l.wqkv, qkv_dim, d, &sc.h, n, &mut sc.qkv, false)?;
            let pos = self.tables.positions();
            dev.rope(&mut sc.qkv, qkv_dim, 0, nh, hd, n, &pos, &self.inv_freq)?;
            dev.rope(&mut sc.qkv, qkv_dim, d, kvh, hd, n, &pos, &self.inv_freq)?;
            dev.kv_store(
                &sc.qkv,
                qkv_dim,
                d,
                d + kvd,
                &mut self.kv,
                &self.tables,
                li,
                check,
            )?;
            dev.paged_attention(AttentionLaunch {
                q: &sc.qkv,
                q_stride: qkv_dim,
                out: &mut sc.attn,
                out_stride: d,
                kv: &self.kv,
                tables: &self.tables,
                layer: li,
                n_heads: nh,
                check_tags: check,
                // Only llama runs here (see `load`): no sliding windows.
                window: None,
            })?;
            dev.to_bf16(&sc.attn, n * d, &mut sc.h)?;
            dev.gemm_bf16(&l.wo, d, d, &sc.h, n, &mut sc.x, true)?;
            dev.rms_norm(
                &sc.x,
                &l.ffn_norm,
                cfg.eps,
                d,
                n,
                None,
                None,
                Some(&mut sc.h),
            )?;
            dev.gemm_bf16(&l.gate_up, 2 * cfg.ffn, d, &sc.h, n, &mut sc.gate_up, false)?;
            dev.swiglu(&sc.gate_up, cfg.ffn, n, None, Some(&mut sc.h))?;
            dev.gemm_bf16(&l.down, d, cfg.ffn, &sc.h, n, &mut sc.x, true)?;
        }

        // Failures first: no logits for a failed sequence.
        let fails = self.tables.failures(dev)?;
        let mut failed = HashMap::new();
        for (i, f) in fails.iter().enumerate() {
            if let Some(b) = *f {
                let e = seqs[i].table[b as usize];
                failed.insert(
                    slots[i],
                    IntegrityError {
                        page: e.page,
                        logical_block: b,
                        expected: e.tag,
                        found: self.kv.read_tag(dev, e.page)?,
                    },
                );
            }
        }
        let want: Vec<u32> = (0..n)
            .filter(|&i| rows[i].want_logits && !failed.contains_key(&rows[i].seq))
            .map(|i| i as u32)
            .collect();
        let nw = want.len();
        if nw == 0 {
            return Ok((empty, failed));
        }
        if nw > sc.logit_rows {
            sc.logits = dev.zeros(nw * cfg.vocab)?;
            sc.greedy = dev.zeros(nw)?;
            sc.logit_rows = nw;
        }
        dev.upload_into(&want, &mut sc.want)?;
        dev.rms_norm(
            &sc.x,
            &self.output_norm,
            cfg.eps,
            d,
            nw,
            Some(&sc.want),
            None,
            Some(&mut sc.h),
        )?;
        let head = self.output.as_ref().unwrap_or(&self.embed);
        dev.gemm_bf16(head, cfg.vocab, d, &sc.h, nw, &mut sc.logits, false)?;
        let wanted = if greedy {
            dev.argmax_rows(&sc.logits, cfg.vocab, nw, &mut sc.greedy)?;
            let ids = dev.download(&sc.greedy, nw)?;
            Wanted::Greedy(want.iter().map(|&i| i as usize).zip(ids).collect())
        } else {
            let all = dev.download(&sc.logits, nw * cfg.vocab)?;
            Wanted::Logits(
                want.iter()
                    .enumerate()
                    .map(|(j, &i)| (i as usize, all[j * cfg.vocab..(j + 1) * cfg.vocab].to_vec()))
                    .collect(),
            )
        };
        Ok((wanted, failed))
    }
}
