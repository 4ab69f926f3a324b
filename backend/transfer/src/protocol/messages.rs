//! The protocol's vocabulary, shared by every role: request ids and roles,
//! admission refusals and failures, the messages the roles exchange (who sends
//! which to whom), and what a state machine asks its driver to do.

use super::wire;
use crate::transport::DestPage;
use serde::{Deserialize, Serialize};

/// Request id, unique across every coordinator that talks to a node (the gateway
/// puts its own id in the high bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ReqId(pub u64);

/// A protocol role (DESIGN.md §6).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Role {
    /// Gateway-side driver of one request.
    Coordinator,
    /// The node that computes the prompt's KV and writes it into the decode node.
    Prefill,
    /// The node that reserves pages, verifies the commit and generates.
    Decode,
}

/// What kind of admission refusal (I1); the gateway maps it to a status code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum RefusalKind {
    /// The request is malformed (empty prompt, zero `max_tokens`, bad token id): 4xx.
    Invalid,
    /// The request can never fit (context window, the node's KV pool): 4xx.
    TooLarge,
    /// The node has no room right now (pages, queue): retryable (429/503).
    Busy,
}

/// An admission refusal (I1). Terminal: a refused request holds nothing anywhere, no
/// state machine accepts it again, and it never reaches transfer (S3).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct Refusal {
    /// Kind of refusal.
    pub kind: RefusalKind,
    /// The original admission error, for the client.
    pub message: String,
}

impl Refusal {
    /// The refusal of a node that drains (SIGTERM, `tessera node drain`): it takes no
    /// new request. Like any refusal it holds nothing for the request anywhere; it is
    /// retryable ([`RefusalKind::Busy`]), and a coordinator starts the request again
    /// on other nodes when it sees one ([`Refusal::drained_by`]).
    pub fn draining(by: Role) -> Self {
        let node = match by {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Coordinator => "coordinator",
        };
        Self {
            kind: RefusalKind::Busy,
            message: format!("the {node} node is draining and takes no new requests"),
        }
    }

    /// The role of the node that refused, when this is a drain refusal
    /// ([`Refusal::draining`]); `None` for any other refusal. (The refusal's wire form
    /// is kind and message only, so a drain refusal is recognised by its exact value.)
    pub fn drained_by(&self) -> Option<Role> {
        [Role::Decode, Role::Prefill]
            .into_iter()
            .find(|r| *self == Self::draining(*r))
    }
}

/// One written page as the prefill node commits it: the destination page (with the
/// tag the decode node expects) and the checksum of the bytes the prefill put there.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct PageCommit {
    /// Destination page and expected tag, as the descriptor named it.
    #[serde(with = "wire::DestPageWire")]
    pub dest: DestPage,
    /// Checksum of the page's bytes at the source.
    pub checksum: u32,
}

/// Why the decode node refused a commit (I4). Any of these fails the request.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, thiserror::Error)]
pub enum CommitError {
    /// No record of the request on the decode node.
    #[error("commit for a request the decode node does not know")]
    UnknownRequest,
    /// The request is not waiting for a commit (duplicate, refused, aborted, ended).
    #[error("request is not awaiting a commit (duplicate or late commit)")]
    NotAwaitingCommit,
    /// Tokens covered differ from the reservation.
    #[error("commit covers {got} tokens but {expected} were reserved")]
    TokenCount {
        /// Reserved prompt tokens.
        expected: u32,
        /// Tokens the commit claims.
        got: u32,
    },
    /// Pages written differ in number from the pages reserved.
    #[error("commit lists {got} pages but {expected} were reserved")]
    PageCount {
        /// Reserved transfer pages.
        expected: u32,
        /// Pages the commit lists.
        got: u32,
    },
    /// A committed page is not in the reservation.
    #[error("page {page} is not reserved for this request")]
    UnexpectedPage {
        /// Physical page index.
        page: u32,
    },
    /// A page is listed twice.
    #[error("page {page} is listed twice")]
    DuplicatePage {
        /// Physical page index.
        page: u32,
    },
    /// A page's tag is not the one reserved, or the page no longer carries it.
    #[error("page {page} does not carry the reserved tag")]
    TagMismatch {
        /// Physical page index.
        page: u32,
    },
    /// The writer aimed a page write outside the reservation (refused, not applied):
    /// it is not trusted to commit this request.
    #[error("a page write aimed at page {page}, outside the reservation, was refused")]
    ForeignWrite {
        /// Physical page index the refused write aimed at.
        page: u32,
    },
    /// The bytes that landed do not match the source checksum.
    #[error("page {page} checksum {got:#010x} does not match the committed {expected:#010x}")]
    ChecksumMismatch {
        /// Physical page index.
        page: u32,
        /// Checksum in the commit.
        expected: u32,
        /// Checksum of the landed bytes.
        got: u32,
    },
}

/// What kind of failure ended a request after admission; the gateway maps it to a
/// status (an integrity failure is never retried, a transport failure may be).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailKind {
    /// A page tag or checksum did not match (I3, I4).
    Integrity,
    /// A page write, a flush or a node link failed.
    Transport,
    /// The client went away before the decode finished.
    ClientGone,
    /// The node had no capacity in time (a batch request that waited past its
    /// deadline); retryable.
    Busy,
    /// The node drained: its drain deadline ended the request before it finished.
    /// Nothing is wrong with the request; the coordinator continues it on another
    /// node ([`crate::protocol::Cause::of`]).
    Drained,
    /// A draining decode node ended the request and keeps its computed pages (its
    /// prefix cache) for the next attempt to move (issue 36): the coordinator names
    /// that node the next attempt's writer ([`crate::protocol::Cause::of`]).
    Moving,
    /// Anything else (a bad descriptor, an engine that refused a verified sequence).
    Internal,
}

/// Why a node failed a request after admission: its kind and a message for logs and
/// the client.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct FailReason {
    /// What kind of failure.
    pub kind: FailKind,
    /// What went wrong.
    pub message: String,
}

impl FailReason {
    /// A failure of `kind` with `message`.
    pub fn new(kind: FailKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }
}

/// How a decode ended, as the decode node reports it in `Finished`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DecodeOutcome {
    /// The sequence completed (stop token, stop string or `max_tokens`).
    Completed,
    /// The decode failed (integrity error on a page read, engine error).
    Failed {
        /// What went wrong.
        reason: FailReason,
    },
}

/// A protocol message (DESIGN.md §6). Page writes are not messages: they go through
/// the transport.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Msg {
    /// Coordinator -> decode: admit (I1) and reserve pages for the request.
    Prealloc {
        /// Request.
        req: ReqId,
        /// Owning tenant.
        tenant: u64,
        /// Prompt tokens the prefill will transfer.
        prompt_tokens: u32,
        /// Tokens the decode may generate.
        max_tokens: u32,
    },
    /// Decode -> coordinator: the transfer descriptor, the reserved destination pages
    /// for the prompt's KV (logical block order) with their expected tags.
    Descriptor {
        /// Request.
        req: ReqId,
        /// Destination pages.
        #[serde(with = "wire::dest_pages")]
        pages: Vec<DestPage>,
    },
    /// Decode or prefill -> coordinator: admission refused (terminal, I1, S3).
    Rejected {
        /// Request.
        req: ReqId,
        /// The role that refused.
        by: Role,
        /// The original admission error.
        reason: Refusal,
    },
    /// Coordinator -> prefill: admit (I1), compute the prompt's KV and write it into `dest`.
    Prefill {
        /// Request.
        req: ReqId,
        /// Owning tenant.
        tenant: u64,
        /// Prompt tokens.
        prompt_tokens: u32,
        /// Tokens the decode may generate.
        max_tokens: u32,
        /// Destination pages from the descriptor.
        #[serde(with = "wire::dest_pages")]
        dest: Vec<DestPage>,
    },
    /// Prefill -> decode: every write drained and source pages released; what was written.
    Commit {
        /// Request.
        req: ReqId,
        /// Prompt tokens covered.
        tokens: u32,
        /// Pages written, with their checksums.
        pages: Vec<PageCommit>,
        /// The first generated token (sampled at the end of prefill).
        first_token: u32,
    },
    /// Decode -> coordinator: commit verified (I4), the sequence is decoding.
    Committed {
        /// Request.
        req: ReqId,
    },
    /// Decode -> coordinator: commit refused (I4); the reserved pages are freed.
    CommitFailed {
        /// Request.
        req: ReqId,
        /// What the verification found.
        reason: CommitError,
    },
    /// Decode -> coordinator: the decode ended and its pages are freed.
    Finished {
        /// Request.
        req: ReqId,
        /// How it ended.
        outcome: DecodeOutcome,
    },
    /// Prefill -> coordinator: the prefill failed; its writes are drained and its
    /// pages released.
    PrefillFailed {
        /// Request.
        req: ReqId,
        /// What went wrong.
        reason: FailReason,
    },
    /// Coordinator -> prefill or decode: stop, drain, release, then acknowledge (I6).
    Abort {
        /// Request.
        req: ReqId,
    },
    /// Prefill or decode -> coordinator: the abort is done; the node holds no page and
    /// will write none for the request.
    AbortAck {
        /// Request.
        req: ReqId,
        /// The acknowledging role.
        from: Role,
    },
    /// Coordinator -> decode: re-send your latest reply for the request (lost-reply
    /// recovery while decoding). Never creates state.
    Poll {
        /// Request.
        req: ReqId,
    },
    /// Decode -> coordinator: the reservation's lease ran out before a commit (the
    /// prefill neither committed nor renewed); its pages are quarantined until the
    /// prefill side is quiet.
    LeaseExpired {
        /// Request.
        req: ReqId,
    },
    /// Prefill -> decode: the prefill node still works on the request (extends the
    /// reservation's lease; changes no protocol state).
    Renew {
        /// Request.
        req: ReqId,
    },
    /// Prefill -> decode: the prefill node drained every write it issued for the
    /// request and will issue none (sent when its coordinator is gone, so the decode
    /// node can free pages it quarantined, or as the answer to a `QuietQuery`).
    WriterQuiet {
        /// Request.
        req: ReqId,
    },
    /// Decode -> prefill (the request's writer): the decode node holds the request's
    /// pages quarantined because its coordinator is gone, so nobody else will quiet
    /// the prefill side; is the prefill node quiet for it? Answered with
    /// `WriterQuiet` once it will write nothing more for the request: at once when it
    /// holds no live record of it (it then keeps a record that fails a late
    /// `Prefill`), after its writes drained when it has one and its coordinator is
    /// gone. Unanswered while its coordinator still drives it; the decode node asks
    /// again on a timer
    /// ([`DecodeNode::ask_writers`](super::DecodeNode::ask_writers)). Changes no
    /// decode state.
    QuietQuery {
        /// Request.
        req: ReqId,
    },
}

impl Msg {
    /// The request the message is about.
    pub fn req(&self) -> ReqId {
        match self {
            Msg::Prealloc { req, .. }
            | Msg::Descriptor { req, .. }
            | Msg::Rejected { req, .. }
            | Msg::Prefill { req, .. }
            | Msg::Commit { req, .. }
            | Msg::Committed { req }
            | Msg::CommitFailed { req, .. }
            | Msg::Finished { req, .. }
            | Msg::PrefillFailed { req, .. }
            | Msg::Abort { req }
            | Msg::AbortAck { req, .. }
            | Msg::Poll { req }
            | Msg::LeaseExpired { req }
            | Msg::Renew { req }
            | Msg::WriterQuiet { req }
            | Msg::QuietQuery { req } => *req,
        }
    }
}

impl Msg {
    /// The role that sends this message (for `Rejected` and `AbortAck`, the role the
    /// message names as its sender).
    pub fn sender(&self) -> Role {
        match self {
            Msg::Prealloc { .. } | Msg::Prefill { .. } | Msg::Abort { .. } | Msg::Poll { .. } => {
                Role::Coordinator
            }
            Msg::Descriptor { .. }
            | Msg::Committed { .. }
            | Msg::CommitFailed { .. }
            | Msg::Finished { .. }
            | Msg::LeaseExpired { .. }
            | Msg::QuietQuery { .. } => Role::Decode,
            Msg::Commit { .. }
            | Msg::PrefillFailed { .. }
            | Msg::Renew { .. }
            | Msg::WriterQuiet { .. } => Role::Prefill,
            Msg::Rejected { by, .. } => *by,
            Msg::AbortAck { from, .. } => *from,
        }
    }

    /// Whether the protocol has a node of role `from` send this message to `to`: the
    /// receiver of a link whose peer is `from` refuses anything else as a
    /// [`LinkViolation::WrongSender`](super::LinkViolation::WrongSender) (a decode
    /// node's link cannot speak for a prefill node, nor send a coordinator's
    /// messages).
    pub fn may_send(&self, from: Role, to: Role) -> bool {
        if self.sender() != from || from == to {
            return false;
        }
        match self {
            Msg::Prealloc { .. } | Msg::Poll { .. } => to == Role::Decode,
            Msg::Prefill { .. } => to == Role::Prefill,
            Msg::Abort { .. } => to != Role::Coordinator,
            Msg::Commit { .. } | Msg::Renew { .. } | Msg::WriterQuiet { .. } => to == Role::Decode,
            Msg::QuietQuery { .. } => to == Role::Prefill,
            // Rejected and AbortAck name a node role as their sender.
            Msg::Rejected { .. } | Msg::AbortAck { .. } => {
                from != Role::Coordinator && to == Role::Coordinator
            }
            Msg::Descriptor { .. }
            | Msg::Committed { .. }
            | Msg::CommitFailed { .. }
            | Msg::Finished { .. }
            | Msg::LeaseExpired { .. }
            | Msg::PrefillFailed { .. } => to == Role::Coordinator,
        }
    }
}

/// Why a request failed, as the coordinator reports it (an error to the client, I8).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Failure {
    /// The decode node refused the commit (I4).
    Commit(CommitError),
    /// The prefill node failed (compute or transport).
    Prefill(FailReason),
    /// The decode failed after admission.
    Decode(FailReason),
    /// A node holding the request died.
    NodeDown(Role),
    /// The decode reservation's lease ran out before the prefill committed.
    LeaseExpired,
}

/// A request's terminal outcome at the coordinator: exactly one per request (S4).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    /// Complete answer (HTTP 200 / a complete stream): only on `Finished(Completed)`
    /// (decode admitted the sequence on a verified commit and completed it).
    Succeeded,
    /// Admission refused (4xx or 429/503 by [`RefusalKind`]), I1.
    Rejected(Refusal),
    /// Error status or error event (I8).
    Failed(Failure),
    /// The client went away.
    Aborted,
}

/// What a state machine asks its driver to do, in order.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Output {
    /// Send a message. Nodes send to [`Role::Coordinator`] meaning the coordinator of
    /// `msg.req()`.
    Send {
        /// Destination role.
        to: Role,
        /// The message.
        msg: Msg,
    },
    /// Coordinator only: the request's terminal outcome for the client; emitted
    /// exactly once (S4).
    Outcome(Outcome),
    /// Coordinator only: every node acknowledged or is dead; nothing is held for the
    /// request anywhere. Record usage and release limits now (I6).
    Released,
}

/// Queues `msg` for `to` on a machine's output buffer.
pub(super) fn send(out: &mut Vec<Output>, to: Role, msg: Msg) {
    out.push(Output::Send { to, msg });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every message has one sending role and goes where the protocol sends it.
    #[test]
    fn each_message_kind_has_one_sender_and_destination() {
        let r = ReqId(1);
        let cases = [
            (Msg::Poll { req: r }, Role::Coordinator, Role::Decode),
            (Msg::Abort { req: r }, Role::Coordinator, Role::Prefill),
            (Msg::Abort { req: r }, Role::Coordinator, Role::Decode),
            (Msg::Committed { req: r }, Role::Decode, Role::Coordinator),
            (
                Msg::LeaseExpired { req: r },
                Role::Decode,
                Role::Coordinator,
            ),
            (Msg::QuietQuery { req: r }, Role::Decode, Role::Prefill),
            (Msg::Renew { req: r }, Role::Prefill, Role::Decode),
            (Msg::WriterQuiet { req: r }, Role::Prefill, Role::Decode),
            (
                Msg::AbortAck {
                    req: r,
                    from: Role::Prefill,
                },
                Role::Prefill,
                Role::Coordinator,
            ),
        ];
        let roles = [Role::Coordinator, Role::Prefill, Role::Decode];
        for (m, from, to) in cases {
            for f in roles {
                for t in roles {
                    let want = (f, t) == (from, to)
                        || matches!(m, Msg::Abort { .. })
                            && f == Role::Coordinator
                            && t != Role::Coordinator;
                    assert_eq!(m.may_send(f, t), want, "{m:?} {f:?} -> {t:?}");
                }
            }
        }
    }
}
