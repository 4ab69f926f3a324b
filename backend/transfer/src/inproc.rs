//! The in-process transport: prefill and decode engines in one process, pages
//! copied through the decode node's command queue (the embedded default, so the
//! transfer protocol runs even on one machine).

use crate::transport::{DestPage, KvTransport, TransportError};

/// One page on its way into a decode node's pool.
#[derive(Debug)]
pub struct PageLanding {
    /// Transfer (request) id.
    pub req: u64,
    /// Destination page and the tag it must still carry when the bytes land.
    pub dest: DestPage,
    /// Exactly one page of K/V data (`layout.page_bytes()` bytes, see `KvLayout`).
    pub bytes: Vec<u8>,
}

/// Delivers landings into a decode node's FIFO command queue. Returns `false` when
/// the decode node is gone.
pub type LandingSink = Box<dyn Fn(PageLanding) -> bool + Send>;

/// [`KvTransport`] over a decode node's command queue in this process.
///
/// A put copies the page into an owned buffer (the source page may be released as
/// soon as `put` returns) and queues it. The decode node applies queued landings
/// before any message queued after them, and `Commit`/`AbortAck` are causally after
/// the puts, so `flush` has nothing left to wait for. The decode side still checks
/// each landing's tag against its pool, so a put that somehow outlives its
/// reservation is dropped, never written into a reused page.
pub struct InprocTransport {
    sink: LandingSink,
}

impl InprocTransport {
    /// A transport that hands landings to `sink`.
    pub fn new(sink: LandingSink) -> Self {
        Self { sink }
    }
}

impl KvTransport for InprocTransport {
    fn put(&mut self, req: u64, dest: DestPage, bytes: &[u8]) -> Result<(), TransportError> {
        let landing = PageLanding {
            req,
            dest,
            bytes: bytes.to_vec(),
        };
        if (self.sink)(landing) {
            Ok(())
        } else {
            Err(TransportError::PeerGone("decode engine stopped".into()))
        }
    }

    fn flush(&mut self) -> Result<(), TransportError> {
        Ok(())
    }
}
