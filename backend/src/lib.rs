//! Tessera backend: the model runtime.
//!
//! - [`runtime`]: load a GGUF file (weights, tokenizer, chat template).
//! - [`model`]: llama forward pass over the paged KV cache.
//! - [`kv`]: page pool with tags and epochs, per-sequence block tables.
//! - [`engine`]: admission, continuous batching with chunked prefill, streaming.
//! - [`handle`]: the engine on its own thread behind a cloneable, async-friendly handle.
//! - [`config`]: the deployment file (`tessera.toml`) and its checks (I2).
//! - [`tokenizer`], [`chat`], [`detok`], [`sampling`]: text in and out.

pub mod chat;
pub mod config;
pub mod detok;
pub mod engine;
pub mod handle;
pub mod kv;
pub mod model;
pub mod pd;
pub mod runtime;
pub mod sampling;
pub mod tokenizer;

pub use engine::{Admitted, Engine, EngineConfig, Event, FinishReason, GenerateRequest, Rejection};
pub use handle::{EngineHandle, EngineStats};
pub use runtime::LoadedModel;
