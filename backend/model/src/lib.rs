//! Tessera model runtime: everything that turns a GGUF file into logits.
//!
//! - [`gguf`]: load a GGUF file (weights, tokenizer and chat template from one file).
//! - [`gguf_write`]: write GGUF files (requantized Q8_0/Q4_0 copies, random-weight
//!   test models).
//! - [`llama`]: the llama forward pass over the paged KV cache.
//! - [`lora`]: LoRA adapter files (llama.cpp's GGUF form) checked against a base model.
//! - [`kv`]: the page pool (tags, epochs, free list) and per-sequence block tables.
//! - [`tokenizer`], [`chat`], [`detok`], [`sampling`]: text in and out.
//! - `cuda` (feature `cuda`): the forward pass on a CUDA device.

pub mod chat;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod detok;
pub mod gguf;
pub mod gguf_write;
pub mod grammar;
pub mod kv;
pub mod lora;
pub mod sampling;
#[cfg(feature = "test-util")]
pub mod testing;
pub mod tokenizer;
pub mod transformer;

pub use gguf::{LoadedModel, DEFAULT_MODEL_ID};
