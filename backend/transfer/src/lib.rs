//! Tessera KV transfer (DESIGN.md §6): how a prompt's KV pages move from a prefill
//! node into a decode node's reserved pages, all or nothing.
//!
//! - [`protocol`]: the transfer protocol as pure state machines (coordinator, prefill
//!   node, decode node), no I/O; the stateright model in `tests/protocol_model/`
//!   checks S1-S5 over the same functions production runs.
//! - [`transport`]: the [`KvTransport`](transport::KvTransport) trait that moves page
//!   bytes, and the destination-page handle ([`DestPage`](transport::DestPage)).
//! - [`inproc`]: the in-process transport (memcpy), the embedded default.
//! - [`ucx`]: UCX one-sided puts into a registered decode pool (libucp loaded at run
//!   time).
//! - [`checksum`]: the per-page CRC-32C both sides of a transfer compute (I4).

pub mod checksum;
pub mod inproc;
pub mod protocol;
pub mod transport;
pub mod ucx;
