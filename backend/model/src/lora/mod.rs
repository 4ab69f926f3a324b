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
//!
//! Layout: `check` (the format and its checks against a base model), `prescan` (a
//! bounded walk of the header before the GGUF reader), `weights` (the pairs in f32
//! and their product in the forward pass).

mod check;
mod prescan;
mod weights;

pub use check::{validate, LoraBase, LoraError, LoraSummary, ADAPTABLE, MAX_ALPHA, MAX_RANK};
pub use weights::{LoraPair, LoraWeights, Target};

#[cfg(test)]
mod tests;
