//! Prefill/decode disaggregation (DESIGN.md §4, §6): the KV transfer protocol as a
//! pure state machine ([`protocol`]), the byte movers behind [`transport::KvTransport`]
//! (in-process copy and UCX one-sided puts), and the drivers that run the protocol
//! against real engines.

pub mod cluster;
pub mod inproc;
pub mod protocol;
pub mod remote;
pub mod transport;
pub mod ucx;
