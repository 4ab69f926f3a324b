//! An adapter's pairs ([`LoraWeights`], held in f16) and their product in the
//! forward pass ([`LoraPair::apply_rows`]).

use super::check::{
    first_line, read_header, validate, LoraBase, LoraError, ADAPTABLE, MAX_RANK, MAX_VALUE,
};
use std::io::Cursor;
use tessera_kernels::lora::LoraFactors;

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

/// One A/B pair: its factors packed in f16 for the forward pass
/// ([`LoraFactors`]: A is `[rank, in]`, the GGUF data of `lora_a`, `ne = [in,
/// rank]`; B is `[out, rank]`, `lora_b`, `ne = [rank, out]`), and `scale`, `alpha /
/// rank` (1 when alpha is 0), as llama.cpp's `llm_build_lora_mm` scales it.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraPair {
    /// The rank.
    pub rank: usize,
    /// Input size (the base weight's `ne0`).
    pub inputs: usize,
    /// Output size (the base weight's `ne1`).
    pub outputs: usize,
    /// A and B as held.
    pub factors: LoraFactors,
    /// Multiplier of `B (A x)`.
    pub scale: f32,
}

impl LoraPair {
    /// A pair from A (`[rank, inputs]` row-major) and B (`[outputs, rank]`
    /// row-major) in f32, rounded to f16 as held. Panics on other lengths.
    pub fn new(
        rank: usize,
        inputs: usize,
        outputs: usize,
        a: &[f32],
        b: &[f32],
        scale: f32,
    ) -> Self {
        LoraPair {
            rank,
            inputs,
            outputs,
            factors: LoraFactors::new(rank, inputs, outputs, a, b),
            scale,
        }
    }

    /// `out[o] += scale * sum_r B[o, r] * (sum_j A[r, j] * x[j])` for one row `x`
    /// (`inputs` long) into `out` (`outputs` long). A row's result depends on that
    /// row alone (fixed loop order), so it is the same in any batch.
    pub fn apply_row(&self, x: &[f32], out: &mut [f32]) {
        debug_assert_eq!((x.len(), out.len()), (self.inputs, self.outputs));
        self.apply_rows(&[0], x, out, self.outputs, 0);
    }

    /// [`Self::apply_row`] for the rows `rows` of a batch at once: row `i` reads
    /// `x[i * inputs..][..inputs]` and adds into `out[i * stride + at..][..outputs]`.
    /// Each A and B value is read once for all of them (the rows of one adapter share
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
    /// long; called once per row, all before any is written).
    pub fn apply_rows_to<'o>(
        &self,
        rows: &[usize],
        x: &[f32],
        mut out_row: impl FnMut(usize) -> &'o mut [f32],
    ) {
        let inputs = self.inputs;
        let xs: Vec<&[f32]> = rows
            .iter()
            .map(|&i| &x[i * inputs..(i + 1) * inputs])
            .collect();
        let mut outs: Vec<&mut [f32]> = rows.iter().map(|&i| out_row(i)).collect();
        self.factors.apply(&xs, self.scale, &mut outs);
    }
}

/// A loaded adapter: per block, the pairs it has (a block or target it does not
/// adapt runs the base weight alone).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoraWeights {
    /// `layers[i]`: block `i`'s pairs.
    pub layers: Vec<std::collections::HashMap<Target, LoraPair>>,
    /// Bytes of weights held (f16).
    pub bytes: usize,
}

impl LoraWeights {
    /// The pair of block `layer` for `target`, if the adapter has one.
    pub fn pair(&self, layer: usize, target: Target) -> Option<&LoraPair> {
        self.layers.get(layer)?.get(&target)
    }

    /// Checks `bytes` as [`validate`] does, then reads every pair (into f16).
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
            let scale = if alpha == 0.0 {
                1.0
            } else {
                alpha / rank as f32
            };
            let pair = LoraPair::new(rank, inputs, outputs, &a, &b, scale);
            out.bytes += pair.factors.bytes();
            out.layers[layer].insert(weight, pair);
        }
        Ok(out)
    }
}
