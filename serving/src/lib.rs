//! Tessera serving: the engines behind one handle, in one process or across nodes.
//!
//! - [`handle`]: [`EngineHandle`], the cloneable handle the gateway submits to.
//! - [`cluster`]: prefill and decode engines in one process, joined by the transfer
//!   protocol over the in-process transport.
//! - [`remote`]: `tessera node` processes and the gateway's side of them, over TCP.

pub mod cluster;
pub mod handle;
pub mod remote;

pub use handle::{EngineHandle, EngineStats};
