//! Tessera engine: one owner of a node's KV pool and running batch.
//!
//! - [`engine`]: admission (I1), continuous batching with chunked prefill, sampling
//!   and streaming events; the prefill node's page export and the decode node's page
//!   landing and adoption.

pub mod engine;
#[cfg(feature = "test-util")]
pub mod testing;

pub use engine::{
    AdmissionLimits, Admitted, Engine, EngineConfig, EngineError, Event, FinishReason,
    GenerateRequest, Rejection, Usage,
};
