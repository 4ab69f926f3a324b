//! Tessera engine: one owner of a node's KV pool and running batch.
//!
//! - [`admission`]: the I1 checks; [`Admitted`] is the only thing a queue accepts.
//! - [`scheduler`]: pure batch planning (priority classes, fair admission by virtual
//!   token counters, decode first, chunked prefill).
//! - [`engine`]: the step: forward pass, sampling, events, cancellation, the
//!   tenant-scoped prefix cache (cached prompt pages reused, tags checked first).
//! - [`kv_transfer`]: a prefill node's page export, a decode node's reservation,
//!   landing, commit checksums and adoption.
//! - [`sink`]: where a request's events go ([`EventSink`]).

pub mod admission;
pub mod engine;
pub mod kv_transfer;
pub mod scheduler;
pub mod sink;
#[cfg(feature = "test-util")]
pub mod testing;

pub use admission::{
    AdapterFile, AdmissionLimits, Admitted, CacheNamespace, CachePolicy, GenerateRequest, LoraRef,
    OutputOptions, PdAdmission, Rejection, Resume, SpecMode, MAX_SPECULATE,
};
pub use engine::{
    DraftModel, Engine, EngineConfig, EngineError, EngineMetrics, Event, FinishReason, FirstToken,
    PageStates, Prefilled, SeqEnd, Speculation, Usage, SPECULATE_MAX_DECODES,
};
pub use scheduler::{FairnessConfig, Policy, Priority, Served};
pub use sink::{CachedTiers, EventSink, Gone};
