//! The adapter format and its checks against a base model ([`validate`]).

use super::prescan::prescan;
use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::GgmlDType;
use std::collections::BTreeMap;
use std::io::Cursor;

/// Largest accepted `adapter.lora.alpha`.
pub const MAX_ALPHA: f32 = 65536.0;
/// Largest accepted magnitude of an A or B value (f16's largest finite value).
pub(super) const MAX_VALUE: f32 = 65504.0;

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
pub(super) fn adaptable(name: &str) -> bool {
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
pub(super) fn read_header(bytes: &[u8]) -> Result<Content, LoraError> {
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
pub(super) fn first_line(e: &impl std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
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
