//! LoRA adapters in the GGUF form llama.cpp reads and writes
//! (`convert_lora_to_gguf.py`; the checks of llama.cpp's `src/llama-adapter.cpp`),
//! validated against the base model they adapt before anything stores or serves them.
//!
//! Format: metadata `general.type = "adapter"`, `adapter.type = "lora"`,
//! `general.architecture` equal to the base model's, `adapter.lora.alpha` (f32,
//! optional: 0 or absent means a scale of 1, else the scale is alpha / rank); per
//! adapted base weight `W` (GGUF shape `ne = [in, out]`) a pair of tensors
//! `W.lora_a` (`ne = [in, rank]`) and `W.lora_b` (`ne = [rank, out]`), so that the
//! adapted layer computes `y = W x + scale * B (A x)` (Hu et al. 2021, "LoRA:
//! Low-Rank Adaptation of Large Language Models", arXiv:2106.09685).
//!
//! Tessera adapts the attention and MLP projections of each block (`attn_q`,
//! `attn_k`, `attn_v`, `attn_output`, `ffn_gate`, `ffn_up`, `ffn_down`); an adapter
//! for anything else (embeddings, norms, the output head) is refused by name.

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use std::collections::BTreeMap;
use std::io::Cursor;

/// Largest accepted `adapter.lora.alpha`.
pub const MAX_ALPHA: f32 = 65536.0;
/// Largest accepted magnitude of an A or B value (f16's largest finite value).
const MAX_VALUE: f32 = 65504.0;

/// Largest rank accepted (Workers AI's limit is 32; vLLM's default maximum is 64).
pub const MAX_RANK: usize = 64;

/// The per-block weights an adapter may target (GGUF names after `blk.N.`).
pub const ADAPTABLE: [&str; 7] = [
    "attn_q.weight",
    "attn_k.weight",
    "attn_v.weight",
    "attn_output.weight",
    "ffn_gate.weight",
    "ffn_up.weight",
    "ffn_down.weight",
];

/// What an adapter is checked against: the base model's architecture and the GGUF
/// shapes (`[ne0 = in, ne1 = out]`) of its adaptable weights, by tensor name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoraBase {
    /// `general.architecture` of the base file (`llama`, `qwen2`, `gemma3`, ...).
    pub architecture: String,
    /// `blk.N.<ADAPTABLE>` weights: name to `[in, out]`.
    pub matrices: BTreeMap<String, [usize; 2]>,
}

impl LoraBase {
    /// Reads the adaptable weights' shapes from a base model's GGUF header.
    pub fn from_gguf(content: &Content) -> Self {
        let architecture = match content.metadata.get("general.architecture") {
            Some(Value::String(s)) => s.clone(),
            _ => String::new(),
        };
        let matrices = content
            .tensor_infos
            .iter()
            .filter(|(name, _)| adaptable(name))
            .filter_map(|(name, info)| match info.shape.dims() {
                // candle lists dims outermost first: [out, in].
                [out, inp] => Some((name.clone(), [*inp, *out])),
                _ => None,
            })
            .collect();
        Self {
            architecture,
            matrices,
        }
    }
}

/// Whether `name` is a weight an adapter may target (`blk.<N>.<ADAPTABLE>`).
fn adaptable(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("blk.") else {
        return false;
    };
    let Some((layer, weight)) = rest.split_once('.') else {
        return false;
    };
    !layer.is_empty() && layer.bytes().all(|b| b.is_ascii_digit()) && ADAPTABLE.contains(&weight)
}

/// What a valid adapter holds (for the store and the listing).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraSummary {
    /// `general.architecture` (equal to the base's).
    pub architecture: String,
    /// The largest rank of its pairs (1..=[`MAX_RANK`]).
    pub rank: usize,
    /// `adapter.lora.alpha` (0 when absent).
    pub alpha: f32,
    /// Adapted base weights, sorted by name.
    pub targets: Vec<String>,
    /// Bytes of adapter weights (the A and B tensors' data).
    pub weight_bytes: u64,
}

/// Why an adapter file is refused; each message names what is wrong and where.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum LoraError {
    /// The bytes are not a readable GGUF file.
    #[error("not a readable GGUF file: {0}")]
    Unreadable(String),
    /// `general.type` is not `adapter`.
    #[error("general.type is {0}, not \"adapter\": this is not a LoRA adapter file")]
    NotAnAdapter(String),
    /// `adapter.type` is not `lora`.
    #[error("adapter.type is {0}, not \"lora\" (only LoRA adapters are supported)")]
    NotLora(String),
    /// The adapter was made for another architecture.
    #[error("the adapter is for architecture {adapter:?}, the base model {model} is {base:?}")]
    Architecture {
        /// The adapter's `general.architecture`.
        adapter: String,
        /// The base model's.
        base: String,
        /// The base model's name.
        model: String,
    },
    /// `adapter.lora.alpha` is not an f32 from 0 to [`MAX_ALPHA`].
    #[error("adapter.lora.alpha must be an f32 from 0 to 65536; found {0}")]
    Alpha(String),
    /// No A/B pair at all.
    #[error("the adapter has no lora_a/lora_b tensor pairs")]
    Empty,
    /// A tensor whose name does not end in `.lora_a` or `.lora_b`.
    #[error("tensor {0:?} is not a LoRA tensor (names end in .lora_a or .lora_b)")]
    UnexpectedTensor(String),
    /// One half of a pair is missing.
    #[error("LoRA pair for {target:?} is missing its {missing} tensor")]
    MissingHalf {
        /// The base weight.
        target: String,
        /// `lora_a` or `lora_b`.
        missing: &'static str,
    },
    /// A pair for a weight the base model does not have, or one Tessera does not adapt.
    #[error("{target:?} is not a weight of the base model {model} that adapters may target (attention and MLP projections of each block: blk.N.{{{list}}})", list = ADAPTABLE.join(","))]
    NotAdaptable {
        /// The base weight named.
        target: String,
        /// The base model's name.
        model: String,
    },
    /// A tensor that is not a matrix.
    #[error("tensor {tensor:?} has {dims} dimensions; LoRA tensors are matrices")]
    NotMatrix {
        /// The tensor.
        tensor: String,
        /// Its number of dimensions.
        dims: usize,
    },
    /// A or B does not fit the base weight.
    #[error("tensor {tensor:?} has GGUF shape {got:?}; the base weight {target:?} of {model} needs {expected:?}")]
    Shape {
        /// The adapter tensor.
        tensor: String,
        /// The base weight it adapts.
        target: String,
        /// The base model's name.
        model: String,
        /// Its GGUF shape `[ne0, ne1]`.
        got: [usize; 2],
        /// The shape the base weight needs.
        expected: [usize; 2],
    },
    /// lora_a stored as `[rank, in]` (llama.cpp: "lora_a tensor is not transposed").
    #[error("tensor {tensor:?} has GGUF shape {got:?}: lora_a must be stored transposed, GGUF shape [in, rank] = {expected:?}")]
    Untransposed {
        /// The lora_a tensor.
        tensor: String,
        /// Its GGUF shape.
        got: [usize; 2],
        /// The shape it needs.
        expected: [usize; 2],
    },
    /// A's rank and B's differ.
    #[error("tensors of {target:?} disagree on the rank: lora_a has {a}, lora_b has {b} (lora_a must be stored transposed, GGUF shape [in, rank])")]
    RankMismatch {
        /// The base weight.
        target: String,
        /// lora_a's rank (its `ne1`).
        a: usize,
        /// lora_b's rank (its `ne0`).
        b: usize,
    },
    /// The rank is 0 or over the limit.
    #[error("the rank of {target:?} is {rank}; ranks of 1 to {max} are accepted")]
    Rank {
        /// The base weight.
        target: String,
        /// The pair's rank.
        rank: usize,
        /// The largest accepted.
        max: usize,
    },
    /// A tensor type the serving path does not read.
    #[error("tensor {tensor:?} is {dtype}; adapter tensors must be F32, F16, BF16 or Q8_0")]
    TensorType {
        /// The tensor.
        tensor: String,
        /// Its GGML type.
        dtype: String,
    },
    /// A weight that is not finite or absurdly large.
    #[error("{0}")]
    Values(String),
    /// A tensor's data lies outside the file.
    #[error("tensor {0:?}'s data lies outside the file (truncated or corrupt)")]
    Truncated(String),
}

/// Checks `bytes` as a LoRA adapter for the base model `model` (its name, for the
/// messages) of shapes `base`, with ranks up to `max_rank`.
///
/// Errors: [`LoraError`], the first thing found wrong. Never panics on any input
/// (a reader panic on a malformed header is caught and reported as unreadable).
pub fn validate(
    bytes: &[u8],
    base: &LoraBase,
    model: &str,
    max_rank: usize,
) -> Result<LoraSummary, LoraError> {
    let content = read_header(bytes)?;
    let text = |key: &str| match content.metadata.get(key) {
        Some(Value::String(s)) => format!("{s:?}"),
        Some(v) => format!("a {:?} value", v.value_type()),
        None => "missing".to_string(),
    };
    let is = |key: &str, want: &str| matches!(content.metadata.get(key), Some(Value::String(s)) if s == want);
    if !is("general.type", "adapter") {
        return Err(LoraError::NotAnAdapter(text("general.type")));
    }
    if !is("adapter.type", "lora") {
        return Err(LoraError::NotLora(text("adapter.type")));
    }
    let architecture = match content.metadata.get("general.architecture") {
        Some(Value::String(s)) => s.clone(),
        _ => text("general.architecture"),
    };
    if architecture != base.architecture {
        return Err(LoraError::Architecture {
            adapter: architecture,
            base: base.architecture.clone(),
            model: model.into(),
        });
    }
    let alpha = match content.metadata.get("adapter.lora.alpha") {
        None => 0.0,
        Some(Value::F32(a)) if a.is_finite() && (0.0..=MAX_ALPHA).contains(a) => *a,
        Some(Value::F32(a)) => return Err(LoraError::Alpha(a.to_string())),
        Some(v) => return Err(LoraError::Alpha(format!("a {:?} value", v.value_type()))),
    };

    let mut pairs: BTreeMap<&str, [Option<&str>; 2]> = BTreeMap::new();
    for name in content.tensor_infos.keys() {
        let (target, half) = if let Some(t) = name.strip_suffix(".lora_a") {
            (t, 0)
        } else if let Some(t) = name.strip_suffix(".lora_b") {
            (t, 1)
        } else {
            return Err(LoraError::UnexpectedTensor(name.clone()));
        };
        pairs.entry(target).or_default()[half] = Some(name);
    }
    if pairs.is_empty() {
        return Err(LoraError::Empty);
    }
    let data_len = (bytes.len() as u64).saturating_sub(content.tensor_data_offset);
    let mut rank = 0;
    let mut weight_bytes = 0u64;
    for (target, [a, b]) in &pairs {
        let missing = |m| LoraError::MissingHalf {
            target: target.to_string(),
            missing: m,
        };
        let (a, b) = (
            a.ok_or_else(|| missing("lora_a"))?,
            b.ok_or_else(|| missing("lora_b"))?,
        );
        let Some(&[inp, out]) = base.matrices.get(*target) else {
            return Err(LoraError::NotAdaptable {
                target: target.to_string(),
                model: model.into(),
            });
        };
        let [a_in, a_rank] = ne(&content, a)?;
        let [b_rank, b_out] = ne(&content, b)?;
        let shape = |tensor: &str, got, expected| LoraError::Shape {
            tensor: tensor.into(),
            target: target.to_string(),
            model: model.into(),
            got,
            expected,
        };
        if a_rank == inp && a_in != inp && a_in == b_rank {
            // PEFT's (rank, in) layout written without the transpose llama.cpp's
            // converter applies.
            return Err(LoraError::Untransposed {
                tensor: a.into(),
                got: [a_in, a_rank],
                expected: [a_rank, a_in],
            });
        }
        if a_in != inp {
            return Err(shape(a, [a_in, a_rank], [inp, a_rank]));
        }
        if b_out != out {
            return Err(shape(b, [b_rank, b_out], [b_rank, out]));
        }
        if a_rank != b_rank {
            return Err(LoraError::RankMismatch {
                target: target.to_string(),
                a: a_rank,
                b: b_rank,
            });
        }
        if a_rank == 0 || a_rank > max_rank {
            return Err(LoraError::Rank {
                target: target.to_string(),
                rank: a_rank,
                max: max_rank,
            });
        }
        rank = rank.max(a_rank);
        for t in [a, b] {
            weight_bytes += data_bytes(&content, t, data_len)?;
        }
    }
    Ok(LoraSummary {
        architecture,
        rank,
        alpha,
        targets: pairs.keys().map(|t| t.to_string()).collect(),
        weight_bytes,
    })
}

/// The GGUF header of `bytes`; a panic in the reader (a crafted header) is an
/// unreadable file, not a crashed caller.
fn read_header(bytes: &[u8]) -> Result<Content, LoraError> {
    prescan(bytes).map_err(LoraError::Unreadable)?;
    let read = std::panic::catch_unwind(|| Content::read(&mut Cursor::new(bytes)));
    match read {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(LoraError::Unreadable(first_line(&e))),
        Err(_) => Err(LoraError::Unreadable("malformed header".into())),
    }
}

/// An error's message without the backtrace candle appends (`RUST_BACKTRACE`):
/// messages go to clients.
fn first_line(e: &impl std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// Most metadata entries, and most elements of one metadata array, an adapter may
/// have (a LoRA file has a handful of scalars and strings).
const MAX_METADATA: u64 = 256;
/// Most bytes of an adapter's metadata section.
const MAX_METADATA_BYTES: usize = 64 << 10;

/// Walks the GGUF header's metadata before the reader does (GGUF spec,
/// ggml/docs/gguf.md: magic, version, tensor count, metadata count, then
/// key-type-value entries), refusing what no LoRA adapter has and what would make
/// the reader allocate far more than the file (it keeps each array element as a
/// 32-byte value): more than [`MAX_METADATA`] entries or array elements, nested
/// arrays, a section over [`MAX_METADATA_BYTES`], or `general.alignment` 0.
fn prescan(b: &[u8]) -> Result<(), String> {
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8], String> {
        let end = at
            .checked_add(n)
            .filter(|&e| e <= b.len().min(MAX_METADATA_BYTES + 24));
        let end = end.ok_or("the header's metadata is truncated or over 64 KiB")?;
        let s = &b[at..end];
        at = end;
        Ok(s)
    };
    let u32_ = |s: &[u8]| u32::from_le_bytes(s.try_into().unwrap());
    let u64_ = |s: &[u8]| u64::from_le_bytes(s.try_into().unwrap());
    if b.is_empty() {
        return Err("the file is empty".into());
    }
    if take(4)? != b"GGUF" {
        return Err("not a GGUF file (no GGUF magic)".into());
    }
    let version = u32_(take(4)?);
    if !(2..=3).contains(&version) {
        return Err(format!("GGUF version {version} (2 and 3 are read)"));
    }
    let _tensors = u64_(take(8)?);
    let kvs = u64_(take(8)?);
    if kvs > MAX_METADATA {
        return Err(format!("{kvs} metadata entries (at most {MAX_METADATA})"));
    }
    // Scalar value types' sizes (GGUF type ids 0-12); 8 is a string, 9 an array.
    let size = |t: u32| -> Option<usize> {
        match t {
            0 | 1 | 7 => Some(1),
            2 | 3 => Some(2),
            4..=6 => Some(4),
            10..=12 => Some(8),
            _ => None,
        }
    };
    for _ in 0..kvs {
        let len = u64_(take(8)?) as usize;
        let key = take(len)?.to_vec();
        let t = u32_(take(4)?);
        match t {
            8 => {
                let len = u64_(take(8)?) as usize;
                take(len)?;
            }
            9 => {
                let et = u32_(take(4)?);
                let n = u64_(take(8)?);
                if n > MAX_METADATA {
                    return Err(format!(
                        "metadata array {:?} has {n} elements (at most {MAX_METADATA})",
                        String::from_utf8_lossy(&key)
                    ));
                }
                for _ in 0..n {
                    match (et, size(et)) {
                        (8, _) => {
                            let len = u64_(take(8)?) as usize;
                            take(len)?;
                        }
                        (_, Some(n)) => {
                            take(n)?;
                        }
                        _ => return Err("a nested or unknown metadata array type".into()),
                    }
                }
            }
            t => {
                let n = size(t).ok_or(format!("metadata value type {t}"))?;
                let v = take(n)?;
                if key == b"general.alignment" && v.iter().all(|&x| x == 0) {
                    return Err("general.alignment is 0".into());
                }
            }
        }
    }
    Ok(())
}

/// A 2-D tensor's GGUF shape `[ne0, ne1]`.
fn ne(content: &Content, name: &str) -> Result<[usize; 2], LoraError> {
    let dims = content.tensor_infos[name].shape.dims();
    match dims {
        [ne1, ne0] => Ok([*ne0, *ne1]),
        _ => Err(LoraError::NotMatrix {
            tensor: name.into(),
            dims: dims.len(),
        }),
    }
}

/// The byte length of tensor `name`'s data, checked to lie within the `data_len`
/// bytes after the header and to be of a type the serving path reads.
fn data_bytes(content: &Content, name: &str, data_len: u64) -> Result<u64, LoraError> {
    let info = &content.tensor_infos[name];
    let dtype = info.ggml_dtype;
    if !matches!(
        dtype,
        GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 | GgmlDType::Q8_0
    ) {
        return Err(LoraError::TensorType {
            tensor: name.into(),
            dtype: format!("{dtype:?}"),
        });
    }
    let truncated = || LoraError::Truncated(name.into());
    let elems = info
        .shape
        .dims()
        .iter()
        .try_fold(1u64, |n, &d| n.checked_mul(d as u64))
        .ok_or_else(truncated)?;
    let block = dtype.block_size() as u64;
    // Blocks never straddle rows (ggml): each row's length is whole blocks.
    let row = info.shape.dims().last().copied().unwrap_or(0) as u64;
    if !row.is_multiple_of(block) {
        return Err(LoraError::TensorType {
            tensor: name.into(),
            dtype: format!("{dtype:?} with rows of {row} values (not whole blocks of {block})"),
        });
    }
    let size = (elems / block)
        .checked_mul(dtype.type_size() as u64)
        .ok_or_else(truncated)?;
    match info.offset.checked_add(size) {
        Some(end) if end <= data_len => Ok(size),
        _ => Err(truncated()),
    }
}

/// The weight an adapter pair targets, within a block.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Target {
    /// `attn_q.weight`.
    Q,
    /// `attn_k.weight`.
    K,
    /// `attn_v.weight`.
    V,
    /// `attn_output.weight`.
    O,
    /// `ffn_gate.weight`.
    Gate,
    /// `ffn_up.weight`.
    Up,
    /// `ffn_down.weight`.
    Down,
}

impl Target {
    const ALL: [Target; 7] = [
        Target::Q,
        Target::K,
        Target::V,
        Target::O,
        Target::Gate,
        Target::Up,
        Target::Down,
    ];

    fn of(weight: &str) -> Option<Self> {
        ADAPTABLE
            .iter()
            .position(|w| *w == weight)
            .map(|i| Self::ALL[i])
    }
}

/// One A/B pair in f32: `a` is `[rank, in]` row-major (the GGUF data of `lora_a`,
/// `ne = [in, rank]`), `bt` is B transposed, `[rank, out]` row-major (`lora_b` has
/// `ne = [rank, out]`, i.e. B is `[out, rank]`), and `scale` is `alpha / rank` (1
/// when alpha is 0), as llama.cpp's `llm_build_lora_mm` scales it.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraPair {
    /// The rank.
    pub rank: usize,
    /// Input size (the base weight's `ne0`).
    pub inputs: usize,
    /// Output size (the base weight's `ne1`).
    pub outputs: usize,
    /// `[rank, inputs]`.
    pub a: Vec<f32>,
    /// B transposed: `[rank, outputs]` (so `B t` is a sum of scaled rows).
    pub bt: Vec<f32>,
    /// Multiplier of `B (A x)`.
    pub scale: f32,
}

impl LoraPair {
    /// `out[o] += scale * sum_r B[o, r] * (sum_j A[r, j] * x[j])` for one row `x`
    /// (`inputs` long) into `out` (`outputs` long). A row's result depends on that
    /// row alone (fixed loop order), so it is the same in any batch.
    pub fn apply_row(&self, x: &[f32], out: &mut [f32]) {
        debug_assert_eq!((x.len(), out.len()), (self.inputs, self.outputs));
        self.apply_rows(&[0], x, out, self.outputs, 0);
    }

    /// `u = B t` as rank scaled rows of `bt` added in order, then `out += scale * u`.
    fn add_bt(&self, t: &[f32], u: &mut [f32], out: &mut [f32]) {
        u.fill(0.0);
        for (r, &tr) in t.iter().enumerate() {
            let row = &self.bt[r * self.outputs..(r + 1) * self.outputs];
            u.iter_mut().zip(row).for_each(|(u, b)| *u += tr * b);
        }
        out.iter_mut()
            .zip(u.iter())
            .for_each(|(y, u)| *y += self.scale * u);
    }
}

impl LoraPair {
    /// [`Self::apply_row`] for the rows `rows` of a batch at once: row `i` reads
    /// `x[i * inputs..][..inputs]` and adds into `out[i * stride + at..][..outputs]`.
    /// Each A and B row is read once for all of them (the rows of one adapter share
    /// its weights' memory traffic); every row's arithmetic is exactly
    /// [`Self::apply_row`]'s, so its result does not depend on the other rows.
    pub fn apply_rows(&self, rows: &[usize], x: &[f32], out: &mut [f32], stride: usize, at: usize) {
        let outputs = self.outputs;
        let base = out.as_mut_ptr();
        assert!(rows.iter().all(|&i| i * stride + at + outputs <= out.len()));
        // SAFETY: each row's range is in bounds (checked above) and handed out once
        // per row; `rows` are distinct, so the ranges do not overlap (stride >= outputs).
        self.apply_rows_to(rows, x, |i| unsafe {
            std::slice::from_raw_parts_mut(base.add(i * stride + at), outputs)
        });
    }

    /// [`Self::apply_rows`], adding row `i`'s delta into `out_row(i)` (`outputs`
    /// long; called once per row).
    pub fn apply_rows_to<'o>(
        &self,
        rows: &[usize],
        x: &[f32],
        mut out_row: impl FnMut(usize) -> &'o mut [f32],
    ) {
        use tessera_kernels::dot::dot_f32;
        let (rank, inputs) = (self.rank, self.inputs);
        let mut t = vec![0f32; rows.len() * rank];
        let xr = |i: usize| &x[i * inputs..(i + 1) * inputs];
        for r in 0..rank {
            let a = &self.a[r * inputs..(r + 1) * inputs];
            let mut k = 0;
            while k + 4 <= rows.len() {
                let d = dot_f32(
                    a,
                    [
                        xr(rows[k]),
                        xr(rows[k + 1]),
                        xr(rows[k + 2]),
                        xr(rows[k + 3]),
                    ],
                );
                for (j, v) in d.into_iter().enumerate() {
                    t[(k + j) * rank + r] = v;
                }
                k += 4;
            }
            for k in k..rows.len() {
                t[k * rank + r] = dot_f32(a, [xr(rows[k])])[0];
            }
        }
        let mut u = vec![0f32; self.outputs];
        for (k, &i) in rows.iter().enumerate() {
            let tk = &t[k * rank..(k + 1) * rank];
            self.add_bt(tk, &mut u, out_row(i));
        }
    }
}

/// A loaded adapter: per block, the pairs it has (a block or target it does not
/// adapt runs the base weight alone).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoraWeights {
    /// `layers[i]`: block `i`'s pairs.
    pub layers: Vec<std::collections::HashMap<Target, LoraPair>>,
    /// Bytes of f32 weights held.
    pub bytes: usize,
}

impl LoraWeights {
    /// The pair of block `layer` for `target`, if the adapter has one.
    pub fn pair(&self, layer: usize, target: Target) -> Option<&LoraPair> {
        self.layers.get(layer)?.get(&target)
    }

    /// Checks `bytes` as [`validate`] does, then reads every pair into f32.
    ///
    /// Errors: [`LoraError`] from the check, or [`LoraError::Unreadable`] when a
    /// tensor cannot be decoded.
    pub fn load(
        bytes: &[u8],
        base: &LoraBase,
        model: &str,
        layers: usize,
    ) -> Result<Self, LoraError> {
        let summary = validate(bytes, base, model, MAX_RANK)?;
        let content = read_header(bytes)?;
        let alpha = summary.alpha;
        let mut cursor = Cursor::new(bytes);
        let mut read = |name: &str| -> Result<Vec<f32>, LoraError> {
            let bad = |e: candle_core::Error| {
                LoraError::Unreadable(format!("{name}: {}", first_line(&e)))
            };
            let cpu = candle_core::Device::Cpu;
            let t = content.tensor(&mut cursor, name, &cpu).map_err(bad)?;
            t.dequantize(&cpu)
                .and_then(|t| t.flatten_all())
                .and_then(|t| t.to_vec1::<f32>())
                .map_err(bad)
        };
        let mut out = LoraWeights {
            layers: vec![Default::default(); layers],
            bytes: 0,
        };
        for target in &summary.targets {
            let (layer, weight) = target
                .strip_prefix("blk.")
                .and_then(|r| r.split_once('.'))
                .and_then(|(l, w)| Some((l.parse::<usize>().ok()?, Target::of(w)?)))
                .ok_or_else(|| LoraError::Unreadable(format!("target {target:?}")))?;
            let [inputs, outputs] = base.matrices[target];
            let a = read(&format!("{target}.lora_a"))?;
            let b = read(&format!("{target}.lora_b"))?;
            let rank = a.len() / inputs;
            if layer >= layers || a.len() != rank * inputs || b.len() != outputs * rank {
                return Err(LoraError::Unreadable(format!("target {target:?}")));
            }
            if !a
                .iter()
                .chain(&b)
                .all(|v| v.is_finite() && v.abs() <= MAX_VALUE)
            {
                return Err(LoraError::Values(format!(
                    "{target:?} holds a value that is not finite or over {MAX_VALUE} in magnitude"
                )));
            }
            out.bytes += 4 * (a.len() + b.len());
            let scale = if alpha == 0.0 {
                1.0
            } else {
                alpha / rank as f32
            };
            let mut bt = vec![0f32; b.len()];
            for o in 0..outputs {
                for r in 0..rank {
                    bt[r * outputs + o] = b[o * rank + r];
                }
            }
            out.layers[layer].insert(
                weight,
                LoraPair {
                    rank,
                    inputs,
                    outputs,
                    a,
                    bt,
                    scale,
                },
            );
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{gguf_file, QTensor};
    use candle_core::{Device, Tensor};

    /// A base of two blocks: attn_q 8 -> 8, ffn_down 16 -> 8.
    fn base() -> LoraBase {
        LoraBase {
            architecture: "llama".into(),
            matrices: [
                ("blk.0.attn_q.weight".to_string(), [8, 8]),
                ("blk.1.ffn_down.weight".to_string(), [16, 8]),
            ]
            .into_iter()
            .collect(),
        }
    }

    /// A GGUF file with `meta` and f32 tensors of the given GGUF shapes `[ne0, ne1]`.
    fn file(meta: &[(&str, Value)], tensors: &[(&str, [usize; 2])]) -> Vec<u8> {
        let qt: Vec<(String, QTensor)> = tensors
            .iter()
            .map(|(n, [ne0, ne1])| {
                let t = Tensor::zeros((*ne1, *ne0), candle_core::DType::F32, &Device::Cpu).unwrap();
                (
                    n.to_string(),
                    QTensor::quantize(&t, GgmlDType::F32).unwrap(),
                )
            })
            .collect();
        let meta: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
        let tensors: Vec<(&str, &QTensor)> = qt.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let mut out = Cursor::new(Vec::new());
        gguf_file::write(&mut out, &meta, &tensors).unwrap();
        out.into_inner()
    }

    fn lora_meta(arch: &str) -> Vec<(&'static str, Value)> {
        vec![
            ("general.type", Value::String("adapter".into())),
            ("adapter.type", Value::String("lora".into())),
            ("general.architecture", Value::String(arch.into())),
            ("adapter.lora.alpha", Value::F32(16.0)),
        ]
    }

    fn check(bytes: &[u8]) -> Result<LoraSummary, LoraError> {
        validate(bytes, &base(), "@cf/test", MAX_RANK)
    }

    #[test]
    fn a_well_formed_adapter_is_summarised() {
        let f = file(
            &lora_meta("llama"),
            &[
                ("blk.0.attn_q.weight.lora_a", [8, 4]),
                ("blk.0.attn_q.weight.lora_b", [4, 8]),
                ("blk.1.ffn_down.weight.lora_a", [16, 2]),
                ("blk.1.ffn_down.weight.lora_b", [2, 8]),
            ],
        );
        let s = check(&f).unwrap();
        assert_eq!(s.rank, 4);
        assert_eq!(s.alpha, 16.0);
        assert_eq!(s.targets, ["blk.0.attn_q.weight", "blk.1.ffn_down.weight"]);
        assert_eq!(s.weight_bytes, 4 * (32 + 32 + 32 + 16));
    }

    #[test]
    fn each_mismatch_is_refused_by_name() {
        let pair = |a: [usize; 2], b: [usize; 2]| {
            vec![
                ("blk.0.attn_q.weight.lora_a", a),
                ("blk.0.attn_q.weight.lora_b", b),
            ]
        };
        let ok = pair([8, 4], [4, 8]);
        let err =
            |meta: &[(&str, Value)], t: &[(&str, [usize; 2])]| check(&file(meta, t)).unwrap_err();

        assert!(
            matches!(err(&lora_meta("qwen2"), &ok), LoraError::Architecture { adapter, .. } if adapter == "qwen2")
        );
        let mut model = lora_meta("llama");
        model[0].1 = Value::String("model".into());
        assert!(matches!(err(&model, &ok), LoraError::NotAnAdapter(t) if t.contains("model")));
        let mut cvec = lora_meta("llama");
        cvec[1].1 = Value::String("control_vector".into());
        assert!(matches!(err(&cvec, &ok), LoraError::NotLora(_)));
        let mut alpha = lora_meta("llama");
        alpha[3].1 = Value::F32(f32::NAN);
        assert!(matches!(err(&alpha, &ok), LoraError::Alpha(_)));

        let m = lora_meta("llama");
        assert!(matches!(
            err(&m, &pair([6, 4], [4, 8])),
            LoraError::Shape {
                got: [6, 4],
                expected: [8, 4],
                ..
            }
        ));
        assert!(matches!(
            err(&m, &pair([8, 4], [4, 9])),
            LoraError::Shape { .. }
        ));
        // A stored untransposed: [rank, in] instead of [in, rank].
        assert!(matches!(
            err(&m, &pair([4, 8], [4, 8])),
            LoraError::Untransposed { got: [4, 8], .. }
        ));
        assert!(matches!(
            err(&m, &pair([8, 4], [8, 8])),
            LoraError::RankMismatch { a: 4, b: 8, .. }
        ));
        assert!(matches!(
            err(&m, &pair([8, 65], [65, 8])),
            LoraError::Rank { rank: 65, .. }
        ));
        assert!(matches!(
            err(&m, &[("blk.0.attn_q.weight.lora_a", [8, 4])]),
            LoraError::MissingHalf {
                missing: "lora_b",
                ..
            }
        ));
        assert!(matches!(
            err(&m, &[("token_embd.weight.lora_a", [8, 4]), ("token_embd.weight.lora_b", [4, 8])]),
            LoraError::NotAdaptable { target, .. } if target == "token_embd.weight"
        ));
        assert!(matches!(
            err(&m, &[("blk.0.attn_norm.weight", [8, 1])]),
            LoraError::UnexpectedTensor(_)
        ));
        assert!(matches!(err(&m, &[]), LoraError::Empty));
    }

    #[test]
    fn truncated_and_garbage_files_are_unreadable_not_panics() {
        let f = file(
            &lora_meta("llama"),
            &[
                ("blk.0.attn_q.weight.lora_a", [8, 4]),
                ("blk.0.attn_q.weight.lora_b", [4, 8]),
            ],
        );
        assert!(matches!(
            check(&f[..f.len() - 8]),
            Err(LoraError::Truncated(_))
        ));
        for n in [0, 3, 10, 40, 100] {
            assert!(check(&f[..n.min(f.len())]).is_err());
        }
        assert!(matches!(
            check(b"not a gguf file at all"),
            Err(LoraError::Unreadable(_))
        ));
        // general.alignment = 0 makes the header reader divide by zero.
        let mut meta = lora_meta("llama");
        meta.push(("general.alignment", Value::U32(0)));
        let f = file(&meta, &[("blk.0.attn_q.weight.lora_a", [8, 4])]);
        assert!(matches!(check(&f), Err(LoraError::Unreadable(_))));
    }

    /// `apply_row` is `y += scale * B (A x)` (checked in f64).
    #[test]
    fn a_pair_adds_its_scaled_low_rank_product() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(9);
        let (rank, inputs, outputs) = (5, 37, 23);
        let mut draw =
            |n: usize| -> Vec<f32> { (0..n).map(|_| rng.random_range(-1.0..1.0)).collect() };
        let p = LoraPair {
            rank,
            inputs,
            outputs,
            a: draw(rank * inputs),
            bt: draw(rank * outputs),
            scale: 0.75,
        };
        // Rows applied together equal each row applied alone, bit for bit.
        let xs = draw(7 * inputs);
        let mut together = draw(7 * outputs);
        let mut alone = together.clone();
        p.apply_rows(&[0, 2, 3, 4, 5, 6], &xs, &mut together, outputs, 0);
        for i in [0, 2, 3, 4, 5, 6] {
            let y = &mut alone[i * outputs..(i + 1) * outputs];
            p.apply_row(&xs[i * inputs..(i + 1) * inputs], y);
        }
        assert_eq!(together, alone);
        let x = draw(inputs);
        let y0 = draw(outputs);
        let mut y = y0.clone();
        p.apply_row(&x, &mut y);
        for o in 0..outputs {
            let mut u = 0f64;
            for r in 0..rank {
                let t: f64 = (0..inputs)
                    .map(|j| f64::from(p.a[r * inputs + j]) * f64::from(x[j]))
                    .sum();
                u += f64::from(p.bt[r * outputs + o]) * t;
            }
            let want = f64::from(y0[o]) + 0.75 * u;
            assert!(
                (f64::from(y[o]) - want).abs() < 1e-4,
                "{o}: {} vs {want}",
                y[o]
            );
        }
    }

    /// A llama adapter file of one pair on blk.0.attn_q.
    fn pair_file(a: &QTensor, b: &QTensor) -> Vec<u8> {
        let meta = lora_meta("llama");
        let meta: Vec<(&str, &Value)> = meta.iter().map(|(k, v)| (*k, v)).collect();
        let tensors = [
            ("blk.0.attn_q.weight.lora_a", a),
            ("blk.0.attn_q.weight.lora_b", b),
        ];
        let mut out = Cursor::new(Vec::new());
        gguf_file::write(&mut out, &meta, &tensors).unwrap();
        out.into_inner()
    }

    /// Crafted files from an attack review: a metadata array that the reader would
    /// blow up 32-fold in memory, non-finite and huge values, Q8_0 rows that are
    /// not whole blocks, an absurd alpha; every refusal one line (no backtrace).
    #[test]
    fn crafted_adapters_are_refused_before_they_cost_memory_or_run() {
        let pair = [
            ("blk.0.attn_q.weight.lora_a", [8, 4]),
            ("blk.0.attn_q.weight.lora_b", [4, 8]),
        ];
        let mut junk = lora_meta("llama");
        junk.push(("general.junk", Value::Array(vec![Value::U8(1); 100_000])));
        let e = check(&file(&junk, &pair)).unwrap_err();
        assert!(
            matches!(&e, LoraError::Unreadable(m) if m.contains("100000 elements")),
            "{e}"
        );
        let mut alpha = lora_meta("llama");
        alpha[3].1 = Value::F32(3e38);
        assert!(matches!(
            check(&file(&alpha, &pair)),
            Err(LoraError::Alpha(_))
        ));
        for garbage in [&b"GGUF\x09\0\0\0"[..], b"GGUF", b"\0\0\0\0\0\0\0\0"] {
            let e = check(garbage).unwrap_err().to_string();
            assert!(!e.contains('\n'), "{e}");
        }

        // Values: written as F32 tensors holding NaN, then 1e30.
        let m = LoraBase {
            architecture: "llama".into(),
            matrices: [("blk.0.attn_q.weight".to_string(), [8, 8])]
                .into_iter()
                .collect(),
        };
        for bad in [f32::NAN, 1e30] {
            let t = |rows, cols, v: f32| {
                let d = vec![v; rows * cols];
                let t = Tensor::from_vec(d, (rows, cols), &Device::Cpu).unwrap();
                QTensor::quantize(&t, GgmlDType::F32).unwrap()
            };
            let bytes = pair_file(&t(4, 8, bad), &t(8, 4, 0.1));
            assert!(
                validate(&bytes, &m, "m", MAX_RANK).is_ok(),
                "the header is fine"
            );
            assert!(matches!(
                LoraWeights::load(&bytes, &m, "m", 1),
                Err(LoraError::Values(_))
            ));
        }

        // Q8_0 rows of 8 values: not whole 32-value blocks.
        let q8 = LoraBase {
            architecture: "llama".into(),
            matrices: [("blk.0.attn_q.weight".to_string(), [64, 64])]
                .into_iter()
                .collect(),
        };
        let a = QTensor::quantize(
            &Tensor::zeros((8, 64), candle_core::DType::F32, &Device::Cpu).unwrap(),
            GgmlDType::Q8_0,
        )
        .unwrap();
        // B's rows are rank (8) long; build its bytes as if it were Q8_0.
        let b = QTensor::quantize(
            &Tensor::zeros((8, 64), candle_core::DType::F32, &Device::Cpu).unwrap(),
            GgmlDType::Q8_0,
        )
        .unwrap();
        let mut bytes = pair_file(&a, &b);
        // Rewrite lora_b's dims from [64, 8] (ne) to [8, 64]: rank 8, out 64.
        let name = b"blk.0.attn_q.weight.lora_b";
        let at = bytes.windows(name.len()).position(|w| w == name).unwrap() + name.len();
        let dims = at + 4;
        bytes[dims..dims + 8].copy_from_slice(&8u64.to_le_bytes());
        bytes[dims + 8..dims + 16].copy_from_slice(&64u64.to_le_bytes());
        let e = validate(&bytes, &q8, "m", MAX_RANK).unwrap_err();
        assert!(
            matches!(&e, LoraError::TensorType { dtype, .. } if dtype.contains("whole blocks")),
            "{e}"
        );
    }

    #[test]
    fn only_block_projections_are_adaptable() {
        assert!(adaptable("blk.12.attn_v.weight"));
        assert!(adaptable("blk.0.ffn_gate.weight"));
        assert!(!adaptable("blk..attn_v.weight"));
        assert!(!adaptable("blk.x.attn_v.weight"));
        assert!(!adaptable("blk.0.attn_norm.weight"));
        assert!(!adaptable("output.weight"));
        assert!(!adaptable("token_embd.weight"));
    }
}
