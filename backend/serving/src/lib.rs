//! Tessera serving: the engines behind one handle, in one process or across nodes.
//!
//! - [`handle`]: [`EngineHandle`], what the gateway submits to; [`RequestStream`] is
//!   what it gets back; [`ServeError`] is the only error it sees.
//! - [`cluster`]: prefill and decode engines in one process, joined by the transfer
//!   protocol over the in-process transport.
//! - [`remote`]: the gateway's side of `tessera node` processes, and the node process
//!   itself ([`remote::run_node_process`]).
//! - Inside: the node loops (`decode_node`, `prefill_node`) that drive the protocol
//!   machines of `tessera_transfer` against an engine, the `coordinator` thread, the
//!   pair choice (`routing`), the node links (`net`: frames, caps, heartbeats, on a
//!   small tokio runtime) and who may be on them (`link_security`: mutual TLS,
//!   [`remote::NodeLinks`]).

mod adapters;
mod cache_query;
pub mod cluster;
mod conn_gate;
mod coordinator;
mod decode_node;
pub mod error;
pub mod handle;
mod link_security;
mod links;
pub mod metrics;
mod net;
mod node_loop;
mod node_process;
mod prefill_node;
pub mod remote;
mod routing;
pub mod stream;
pub mod telemetry;

pub use error::{ServeError, ServeErrorKind};
pub use handle::EngineHandle;
pub use links::{PdCounters, TransferFault};
pub use metrics::NodeMetrics;
pub use node_loop::EngineStats;
pub use stream::{RequestStream, StreamEvent};
/// Admission (I1) as the gateway runs it before submitting (the engine's types).
pub use tessera_engine::admission;
pub use tessera_engine::{
    AdapterFile, CachePolicy, DraftModel, EngineConfig, FairnessConfig, FinishReason,
    GenerateRequest, LoraRef, Policy, Priority, SpecMode, Usage, MAX_SPECULATE,
};
