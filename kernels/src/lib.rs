//! Tessera compute kernels (CPU).
//!
//! - [`quant`]: GGML block formats (`Q4_0`, `Q4_1`, `Q5_0`, `Q8_0`, `Q4_K`, `Q5_K`,
//!   `Q6_K`) and 8-bit activation quantization.
//! - [`dot`]: 4-/8-bit dot products, runtime-dispatched (AVX-512 VNNI, AVX2+FMA, scalar).
//! - [`lora`]: the two products of a LoRA delta for the rows of one adapter.
//! - [`matmul`]: batch-invariant quantized matmul, threaded over output features.
//! - [`attention`]: paged attention (16-bit K and 8-bit V pages, tiled online softmax,
//!   optional sliding window) that verifies each KV page's tag before reading it.
//! - [`ops`]: RMSNorm, RoPE (GGML normal and NEOX modes), SwiGLU, GeGLU (tanh GELU).
//! - [`pool`]: the fork-join thread pool the kernels run on.
//! - `cuda` (feature `cuda`): the CUDA backend (NVRTC-compiled kernels, cuBLAS,
//!   the device KV pool with its tag array).

pub mod attention;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod dot;
mod flash;
mod isa;
pub mod lora;
pub mod matmul;
pub mod ops;
mod page;
pub mod pool;
pub mod quant;

pub use attention::{
    paged_attention, paged_attention_block, paged_attention_jobs, AttnJob, BlockRef,
    IntegrityError, KvLayout, PageTag, PoolKv, SeqKv,
};
pub use matmul::{Activations, QMatrix, Weights};
