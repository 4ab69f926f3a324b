//! Byte movers for the KV transfer protocol (DESIGN.md §6). A transport only moves
//! page bytes from a prefill node into pages a decode node reserved; it decides
//! nothing. Which pages, when to commit and when memory may be freed is the
//! protocol's business ([`super::protocol`]).

use tessera_kernels::PageTag;

/// One destination page as a decode node's descriptor names it: the physical page
/// in the decode pool and the tag the decode node expects it to carry once filled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct DestPage {
    /// Physical page index in the decode node's pool.
    pub page: u32,
    /// Tag the decode node assigned at reservation.
    pub tag: PageTag,
}

/// A transport failure. The request that hit it fails; the protocol decides what is
/// released and when.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// The peer is gone (process exited, connection reset, channel closed).
    #[error("transport peer unreachable: {0}")]
    PeerGone(String),
    /// A put named memory outside the registered destination region.
    #[error(
        "put of {len} bytes at offset {offset} is outside the {region} byte destination region"
    )]
    OutOfBounds {
        /// Byte offset into the region.
        offset: u64,
        /// Bytes to write.
        len: u64,
        /// Region size in bytes.
        region: u64,
    },
    /// The transport library reported an error.
    #[error("transport error: {0}")]
    Library(String),
}

/// Moves KV page bytes one-sidedly into a decode node's reserved pages.
///
/// Contract (what the protocol relies on for I5):
/// - [`put`](KvTransport::put) may return before the bytes have landed; the source
///   buffer may be reused as soon as it returns.
/// - [`flush`](KvTransport::flush) returns only once every put issued before it is
///   complete at the destination (or has failed). Only then may the source release
///   its pages or send `Commit`.
pub trait KvTransport: Send {
    /// Starts writing `bytes` (exactly one page: `layout.page_bytes()` bytes) into
    /// destination page `dest` of request `req`.
    fn put(&mut self, req: u64, dest: DestPage, bytes: &[u8]) -> Result<(), TransportError>;

    /// Blocks until every earlier put has completed at the destination.
    fn flush(&mut self) -> Result<(), TransportError>;
}
