//! Tessera compute kernels (CPU).
//!
//! - [`quant`]: GGML block formats (`Q4_1`, `Q8_0`) and 8-bit activation quantization.
//! - [`dot`]: 4-/8-bit dot products, runtime-dispatched (AVX2+FMA, scalar fallback).
//! - [`matmul`]: batch-invariant quantized matmul, threaded over output features.
//! - [`attention`]: paged attention that verifies each KV page's tag before reading it.
//! - [`ops`]: RMSNorm, RoPE, SwiGLU.
//! - [`pool`]: the fork-join thread pool the kernels run on.

pub mod attention;
pub mod dot;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod quant;

pub use attention::{
    paged_attention, paged_attention_block, BlockRef, IntegrityError, KvLayout, PageTag, SeqKv,
};
pub use matmul::{Activations, QMatrix, Weights};
