//! What the node loops and the coordinator share about the links between them: where
//! a request's replies go, the protocol-level counters, and the transfer faults the
//! in-process tests inject.

use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Instant;
use tessera_model::sampling::Logprobs;
use tessera_transfer::protocol::Msg;

/// Where a node sends one request's replies: the link to its coordinator. Must not
/// block (queue the message; a link that cannot take it is broken, and the
/// coordinator's failure detector and retransmissions handle the rest).
pub(crate) trait Reply: Send + Sync {
    /// Sends `msg`; false when the link is gone.
    fn send(&self, msg: Msg) -> bool;
}

/// A request's reply link.
pub(crate) type ReplyTo = Arc<dyn Reply>;

/// What travels from a prefill node to a decode node beside a `Commit` (the protocol
/// leaves it out): the sampler position after the first token, how many prompt
/// tokens the prefill node took from its prefix cache (for the request's usage), the
/// fingerprint of the model that computed the KV (a decode node serving another
/// model fails the commit; `None` from a peer that does not say), and the first
/// token's and the prompt's log probabilities when the request asked for them.
#[derive(Clone, Debug, Default, PartialEq)]
pub(crate) struct CommitExtra {
    pub(crate) rng_pos: u128,
    pub(crate) cached_tokens: usize,
    pub(crate) cached_tiers: tessera_engine::CachedTiers,
    pub(crate) model: Option<[u8; 32]>,
    pub(crate) logprobs: Option<Box<Logprobs>>,
}

/// A link a node can cut when its peer breaks the protocol.
pub(crate) trait Link: Send + Sync {
    /// Closes the link (both directions).
    fn close(&self);
}

/// The prefill link a writer-side frame (a page, a commit, a renewal) came on: the
/// peer's name (its node address, or `prefill-N` in one process) and, over a network,
/// the connection to cut on a violation.
#[derive(Clone)]
pub(crate) struct WriterLink {
    pub(crate) name: String,
    pub(crate) link: Option<Arc<dyn Link>>,
}

impl WriterLink {
    /// Cuts the link (a protocol violation by the peer).
    pub(crate) fn cut(&self) {
        if let Some(l) = &self.link {
            l.close();
        }
    }
}

/// Protocol-level error counters (all nodes of a deployment in this process, or one
/// node process).
#[derive(Debug, Default)]
pub struct PdCounters {
    /// Commits the decode side refused (I4), including duplicates and unknown ids.
    pub commits_rejected: AtomicU64,
    /// Page writes dropped because their page no longer held the named tag.
    pub writes_dropped: AtomicU64,
    /// Requests that reached `Released` (every node acknowledged or was down).
    pub released: AtomicU64,
    /// Node-link frames refused at the link (a header over the cap, a page payload
    /// that is not exactly one page, a payload on a frame that has none, a malformed
    /// header, a frame the peer may not send, messages for requests the link never
    /// carried beyond its budget). Each closes its connection.
    pub frames_rejected: AtomicU64,
    /// Node-link connections refused before their first frame was served: a failed
    /// TLS handshake (no certificate, another CA, plaintext), or a `Hello` whose role
    /// the peer's certificate does not carry.
    pub peers_refused: AtomicU64,
    /// Frames refused as protocol violations by a peer (a page or commit from a node
    /// that is not the request's writer, a write into pages already committed, a
    /// malformed page); each also cuts the peer's link.
    pub link_violations: AtomicU64,
    /// Decode reservations whose lease ran out before their commit.
    pub leases_expired: AtomicU64,
    /// Requests started again from the beginning on another pair after a node
    /// failed or refused them before their first token (issue 36).
    pub restarted: AtomicU64,
    /// Requests continued on another pair after a node failed mid-stream, from the
    /// tokens their client had.
    pub continued: AtomicU64,
    /// Requests a draining decode node ended that went on on another decode node
    /// with their KV moved from the draining one (it writes the next attempt's pages
    /// from its prefix cache); counted here instead of `restarted` or `continued`.
    pub moved: AtomicU64,
    /// Requests a node's failure ended although a restart could have cured it (no
    /// other pair up, the attempt bound or the deadline reached, nothing left to
    /// generate): each ended with an error.
    pub not_restarted: AtomicU64,
}

/// A fault the next transfer suffers (tests only): each reproduces a bug class of
/// PD serving engines that the protocol must turn into an error.
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransferFault {
    /// The transport silently loses the last page write.
    DropLastWrite,
    /// One byte of the first page is flipped in flight.
    CorruptByte,
    /// The prefill node sends its `Commit` twice.
    DuplicateCommit,
    /// The prefill node's `Commit` names a first token outside the vocabulary.
    FirstTokenOutOfVocab,
}

/// How long a node keeps a terminal request record (a tombstone): longer than any
/// copy of a message for the request can still be on its way, the coordinator's
/// retransmissions included.
pub(crate) const TOMBSTONE_TTL_MS: u64 = 60_000;

/// The node loops' clock for
/// [`Records::expire`](tessera_transfer::protocol::Records::expire), read at most once a second.
pub(crate) struct ExpiryClock {
    started: Instant,
    last: Instant,
}

impl ExpiryClock {
    pub(crate) fn new() -> Self {
        Self {
            started: Instant::now(),
            last: Instant::now(),
        }
    }

    /// Calls `expire(now_ms, ttl_ms)` with [`TOMBSTONE_TTL_MS`], if a second passed since
    /// the last time.
    pub(crate) fn tick(&mut self, expire: impl FnOnce(u64, u64)) {
        if self.last.elapsed().as_millis() < 1000 {
            return;
        }
        self.last = Instant::now();
        expire(self.started.elapsed().as_millis() as u64, TOMBSTONE_TTL_MS);
    }
}
