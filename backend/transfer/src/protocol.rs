#![doc = include_str!("../../../docs/transfer-protocol.md")]

use crate::transport::DestPage;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use tessera_kernels::PageTag;

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
    /// again on a timer ([`DecodeNode::ask_writers`]). Changes no decode state.
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
    /// [`LinkViolation::WrongSender`] (a decode node's link cannot speak for a prefill
    /// node, nor send a coordinator's messages).
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

/// Why a receiver refused a message (or a stream event) from a node link. Each is a
/// protocol violation by that link's peer: the receiver drops it, counts it and
/// cuts the link.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LinkViolation {
    /// About a request that was never routed to this link: another node's request
    /// (whose id the peer guessed or learnt), or none at all.
    NotRouted,
    /// A message the link's peer never sends to this receiver in the protocol
    /// ([`Msg::may_send`]): a decode node speaking for a prefill node, a node sending
    /// a coordinator's message.
    WrongSender,
}

impl LinkViolation {
    /// Every violation, in declaration order.
    pub const ALL: [LinkViolation; 2] = [LinkViolation::NotRouted, LinkViolation::WrongSender];

    /// The stable metric label.
    pub fn label(self) -> &'static str {
        match self {
            LinkViolation::NotRouted => "not_routed",
            LinkViolation::WrongSender => "wrong_sender",
        }
    }
}

/// What a receiver does with a message that passed [`RouteBook::check`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Routed {
    /// The request is live and was routed to this link: act on it.
    Live,
    /// The request ended (it was routed to this link): a late duplicate, dropped
    /// without acting and without cutting the link.
    Ended,
}

/// The coordinator side's record of which node link carries each request, by role:
/// a message or stream event from a link is accepted only for requests routed to
/// that very link (the node's identity and its link incarnation, `L`), never for
/// another node's (S1 across nodes: one node's certificate reaches only the
/// requests routed to it). An ended request's route is kept for as long as a late
/// copy of a message for it can arrive ([`RouteBook::expire`]), so a late duplicate
/// from its own link is dropped quietly while one from any other link is still a
/// violation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RouteBook<L> {
    /// Live requests' routes.
    live: BTreeMap<ReqId, Route<L>>,
    /// Ended requests' routes and the clock reading when each ended.
    ended: BTreeMap<ReqId, (Route<L>, u64)>,
    /// The driver's clock as of the last [`RouteBook::expire`] (milliseconds).
    now: u64,
}

/// A request's (prefill link, decode link), each once routed.
type Route<L> = (Option<L>, Option<L>);

impl<L> Default for RouteBook<L> {
    fn default() -> Self {
        Self {
            live: BTreeMap::new(),
            ended: BTreeMap::new(),
            now: 0,
        }
    }
}

impl<L: Copy + Eq> RouteBook<L> {
    /// Records that `link` carries `req` for `role` (call before the first message
    /// for `req` goes onto it). The first link routed for a role stays the
    /// request's: a request never moves to another link (a new link of the node does
    /// not know it). Ignored for an ended request and for the coordinator role.
    pub fn route(&mut self, req: ReqId, role: Role, link: L) {
        if self.ended.contains_key(&req) {
            return;
        }
        let r = self.live.entry(req).or_insert((None, None));
        match role {
            Role::Prefill => {
                r.0.get_or_insert(link);
            }
            Role::Decode => {
                r.1.get_or_insert(link);
            }
            Role::Coordinator => {}
        }
    }

    /// The request ended (released everywhere): later messages from its links are
    /// [`Routed::Ended`] until [`RouteBook::expire`] forgets it.
    pub fn end(&mut self, req: ReqId) {
        if let Some(r) = self.live.remove(&req) {
            self.ended.insert(req, (r, self.now));
        }
    }

    /// Whether `msg`, read from `link` whose peer has role `from`, may be acted on by
    /// the coordinator: the peer's role sends it to the coordinator
    /// ([`Msg::may_send`]) and the request was routed to that very link.
    ///
    /// Errors: the violation (drop the message, count it, cut the link).
    pub fn check(&self, link: L, from: Role, msg: &Msg) -> Result<Routed, LinkViolation> {
        if !msg.may_send(from, Role::Coordinator) {
            return Err(LinkViolation::WrongSender);
        }
        self.check_req(link, from, msg.req())
    }

    /// Whether a stream event (decode node to coordinator) for `req` from decode
    /// link `link` may be delivered: only for a request routed to that link.
    ///
    /// Errors: [`LinkViolation::NotRouted`].
    pub fn check_event(&self, link: L, req: ReqId) -> Result<Routed, LinkViolation> {
        self.check_req(link, Role::Decode, req)
    }

    fn check_req(&self, link: L, from: Role, req: ReqId) -> Result<Routed, LinkViolation> {
        let pick = |r: &Route<L>| match from {
            Role::Prefill => r.0,
            Role::Decode => r.1,
            Role::Coordinator => None,
        };
        if let Some(r) = self.live.get(&req) {
            if pick(r) == Some(link) {
                return Ok(Routed::Live);
            }
        } else if let Some((r, _)) = self.ended.get(&req) {
            if pick(r) == Some(link) {
                return Ok(Routed::Ended);
            }
        }
        Err(LinkViolation::NotRouted)
    }

    /// Advances the clock to `now` (milliseconds, monotonic) and forgets ended
    /// requests that ended at least `ttl` milliseconds ago (the longest a late copy
    /// of a message can still arrive). Returns how many were forgotten.
    pub fn expire(&mut self, now: u64, ttl: u64) -> usize {
        self.now = self.now.max(now);
        let before = self.ended.len();
        let now = self.now;
        self.ended.retain(|_, (_, t)| t.saturating_add(ttl) > now);
        before - self.ended.len()
    }

    /// Live requests routed.
    pub fn live(&self) -> usize {
        self.live.len()
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

/// Deliberate protocol breakages for the model checker's failing-variant tests.
/// Production code always runs with the default (every flaw off).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Flaws {
    /// Decode admits any commit for a reserved request without the I4 checks.
    pub decode_skips_commit_checks: bool,
    /// Decode admits a duplicate commit again.
    pub decode_accepts_duplicate_commit: bool,
    /// Decode keeps the reserved pages after a failed commit.
    pub decode_leaks_on_commit_failed: bool,
    /// Coordinator aborts prefill and decode at once (decode frees before prefill's ack).
    pub abort_decode_with_prefill: bool,
    /// Prefill releases its source pages and commits without waiting for the drain.
    pub prefill_commits_before_drain: bool,
    /// Prefill turns a refused request into a one-token placeholder and transfers it.
    pub prefill_placeholder_on_refusal: bool,
    /// Prefill keeps no tombstone for aborted requests.
    pub prefill_forgets_aborts: bool,
    /// Coordinator goes on to prefill after the decode node refused (empty descriptor).
    pub coordinator_proceeds_on_rejected: bool,
    /// Coordinator reports success when the decode node dies mid-decode.
    pub coordinator_success_on_decode_crash: bool,
    /// Decode frees a reservation at once when its coordinator is lost (instead of
    /// quarantining it until the prefill side is quiet).
    pub decode_frees_on_coordinator_lost: bool,
    /// Decode frees a reservation at once when its lease expires.
    pub decode_frees_on_lease_expiry: bool,
    /// Decode frees a reservation quarantined for a lost coordinator when its retry
    /// timer fires, without its writer's answer (a bounded quarantine).
    pub decode_frees_quarantine_unasked: bool,
    /// Prefill answers a `QuietQuery` at once, even while it computes or drains the
    /// request.
    pub prefill_quiet_while_writing: bool,
    /// Prefill answers a `QuietQuery` for a request it never heard of without keeping
    /// a record of it (a late `Prefill` then starts writing).
    pub prefill_quiet_without_record: bool,
}

fn send(out: &mut Vec<Output>, to: Role, msg: Msg) {
    out.push(Output::Send { to, msg });
}

// ---------------------------------------------------------------------------
// Coordinator
// ---------------------------------------------------------------------------

/// Where a request stands at its coordinator.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CoordPhase {
    /// `Prealloc` sent; waiting for `Descriptor` or `Rejected`.
    Reserving,
    /// `Prefill` sent; waiting for `Committed`, `CommitFailed`, `PrefillFailed` or `Rejected`.
    Transferring {
        /// Destination pages from the descriptor.
        dest: Vec<DestPage>,
    },
    /// `Committed` received; waiting for `Finished`.
    Decoding,
    /// `Abort` sent to the prefill node; waiting for its `AbortAck`.
    AbortingPrefill,
    /// `Abort` sent to the decode node; waiting for its `AbortAck`.
    AbortingDecode,
    /// Nothing held anywhere; [`Output::Released`] was emitted.
    Done,
}

/// The gateway-side driver of one request (DESIGN.md §4 steps 3-7, §6).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Coordinator {
    req: ReqId,
    tenant: u64,
    prompt_tokens: u32,
    max_tokens: u32,
    phase: CoordPhase,
    outcome: Option<Outcome>,
    prefill_down: bool,
    decode_down: bool,
    flaws: Flaws,
}

impl Coordinator {
    /// Starts a request that passed the gateway's admission (I1): sends `Prealloc` to
    /// the decode node.
    pub fn start(
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
        out: &mut Vec<Output>,
    ) -> Self {
        Self::start_with_flaws(
            req,
            tenant,
            prompt_tokens,
            max_tokens,
            Flaws::default(),
            out,
        )
    }

    /// [`start`](Self::start) with deliberate flaws (model checker tests only).
    #[doc(hidden)]
    pub fn start_with_flaws(
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
        flaws: Flaws,
        out: &mut Vec<Output>,
    ) -> Self {
        let c = Self {
            req,
            tenant,
            prompt_tokens,
            max_tokens,
            phase: CoordPhase::Reserving,
            outcome: None,
            prefill_down: false,
            decode_down: false,
            flaws,
        };
        send(out, Role::Decode, c.prealloc());
        c
    }

    /// The request.
    pub fn req(&self) -> ReqId {
        self.req
    }

    /// Current phase.
    pub fn phase(&self) -> &CoordPhase {
        &self.phase
    }

    /// The outcome, once decided.
    pub fn outcome(&self) -> Option<&Outcome> {
        self.outcome.as_ref()
    }

    /// Whether every node released the request.
    pub fn is_done(&self) -> bool {
        self.phase == CoordPhase::Done
    }

    fn prealloc(&self) -> Msg {
        Msg::Prealloc {
            req: self.req,
            tenant: self.tenant,
            prompt_tokens: self.prompt_tokens,
            max_tokens: self.max_tokens,
        }
    }

    fn prefill(&self, dest: &[DestPage]) -> Msg {
        Msg::Prefill {
            req: self.req,
            tenant: self.tenant,
            prompt_tokens: self.prompt_tokens,
            max_tokens: self.max_tokens,
            dest: dest.to_vec(),
        }
    }

    /// Decides the outcome (first decision wins: S4).
    fn decide(&mut self, outcome: Outcome, out: &mut Vec<Output>) {
        if self.outcome.is_none() {
            self.outcome = Some(outcome.clone());
            out.push(Output::Outcome(outcome));
        }
    }

    fn finish(&mut self, out: &mut Vec<Output>) {
        self.phase = CoordPhase::Done;
        out.push(Output::Released);
    }

    /// Aborts the decode side (after the prefill side is quiet): its pages are freed.
    fn abort_decode(&mut self, out: &mut Vec<Output>) {
        if self.decode_down {
            self.finish(out);
        } else {
            self.phase = CoordPhase::AbortingDecode;
            send(out, Role::Decode, Msg::Abort { req: self.req });
        }
    }

    /// Aborts the prefill side first; the decode side follows on its `AbortAck` (S2).
    fn abort_prefill(&mut self, out: &mut Vec<Output>) {
        if self.prefill_down {
            self.abort_decode(out);
        } else {
            self.phase = CoordPhase::AbortingPrefill;
            send(out, Role::Prefill, Msg::Abort { req: self.req });
            if self.flaws.abort_decode_with_prefill && !self.decode_down {
                send(out, Role::Decode, Msg::Abort { req: self.req });
            }
        }
    }

    /// Handles a message from a node about this request (others are ignored).
    pub fn on_msg(&mut self, msg: Msg, out: &mut Vec<Output>) {
        if msg.req() != self.req {
            return;
        }
        match (&self.phase, msg) {
            (CoordPhase::Reserving, Msg::Descriptor { pages, .. }) => {
                self.on_descriptor(pages, out)
            }
            (CoordPhase::Reserving, Msg::Rejected { reason, .. }) => {
                if self.flaws.coordinator_proceeds_on_rejected {
                    // The incident's shape: a refused request treated as ready.
                    self.on_descriptor(Vec::new(), out);
                    return;
                }
                // The decode node refused: nothing is held anywhere.
                self.decide(Outcome::Rejected(reason), out);
                self.finish(out);
            }
            (CoordPhase::Transferring { .. }, Msg::Committed { .. }) => {
                self.phase = CoordPhase::Decoding;
            }
            (CoordPhase::Transferring { .. }, Msg::CommitFailed { reason, .. }) => {
                // The decode node freed its pages; the prefill drained before committing.
                self.decide(Outcome::Failed(Failure::Commit(reason)), out);
                self.finish(out);
            }
            (CoordPhase::Transferring { .. }, Msg::PrefillFailed { reason, .. }) => {
                // The prefill drained and released; free the decode reservation.
                self.decide(Outcome::Failed(Failure::Prefill(reason)), out);
                self.abort_decode(out);
            }
            (CoordPhase::Transferring { .. }, Msg::Rejected { reason, .. }) => {
                // The prefill node refused (nothing written); free the decode reservation.
                self.decide(Outcome::Rejected(reason), out);
                self.abort_decode(out);
            }
            (CoordPhase::Reserving | CoordPhase::Transferring { .. }, Msg::LeaseExpired { .. }) => {
                // The decode node quarantined the pages; the prefill side may still be
                // writing: quiet it first, then abort the decode side (which frees them).
                self.decide(Outcome::Failed(Failure::LeaseExpired), out);
                self.abort_prefill(out);
            }
            // Decode sends `Finished` only for a sequence it admitted on a verified
            // commit, so it also stands for a `Committed` that was lost.
            (
                CoordPhase::Transferring { .. } | CoordPhase::Decoding,
                Msg::Finished { outcome, .. },
            ) => {
                let o = match outcome {
                    DecodeOutcome::Completed => Outcome::Succeeded,
                    // The decode node saw the client leave before this coordinator did.
                    DecodeOutcome::Failed { reason } if reason.kind == FailKind::ClientGone => {
                        Outcome::Aborted
                    }
                    DecodeOutcome::Failed { reason } => Outcome::Failed(Failure::Decode(reason)),
                };
                self.decide(o, out);
                self.finish(out);
            }
            (
                CoordPhase::AbortingPrefill,
                Msg::AbortAck {
                    from: Role::Prefill,
                    ..
                },
            ) => {
                self.abort_decode(out);
            }
            (
                CoordPhase::AbortingDecode,
                Msg::AbortAck {
                    from: Role::Decode, ..
                },
            ) => {
                self.finish(out);
            }
            _ => {} // duplicates, late replies: nothing to do
        }
    }

    fn on_descriptor(&mut self, pages: Vec<DestPage>, out: &mut Vec<Output>) {
        if self.prefill_down {
            self.decide(Outcome::Failed(Failure::NodeDown(Role::Prefill)), out);
            self.abort_decode(out);
            return;
        }
        send(out, Role::Prefill, self.prefill(&pages));
        self.phase = CoordPhase::Transferring { dest: pages };
    }

    /// The client went away (disconnect, timeout, shutdown): abort with acks (I6).
    /// No-op once the outcome is decided.
    pub fn on_client_gone(&mut self, out: &mut Vec<Output>) {
        if self.outcome.is_some() {
            return;
        }
        self.decide(Outcome::Aborted, out);
        match self.phase {
            CoordPhase::Reserving | CoordPhase::Decoding => self.abort_decode(out),
            CoordPhase::Transferring { .. } => self.abort_prefill(out),
            _ => {}
        }
    }

    /// Nothing arrived for a while: re-send the message this phase waits on.
    pub fn on_timeout(&mut self, out: &mut Vec<Output>) {
        let req = self.req;
        match &self.phase {
            CoordPhase::Reserving => send(out, Role::Decode, self.prealloc()),
            CoordPhase::Transferring { dest } => send(out, Role::Prefill, self.prefill(dest)),
            CoordPhase::Decoding => send(out, Role::Decode, Msg::Poll { req }),
            CoordPhase::AbortingPrefill => send(out, Role::Prefill, Msg::Abort { req }),
            CoordPhase::AbortingDecode => send(out, Role::Decode, Msg::Abort { req }),
            CoordPhase::Done => {}
        }
    }

    /// The failure detector declared `role`'s node dead. A dead node holds nothing and
    /// writes nothing (its transport connection is gone), so it counts as having
    /// acknowledged every abort.
    pub fn on_node_down(&mut self, role: Role, out: &mut Vec<Output>) {
        match role {
            Role::Prefill => self.prefill_down = true,
            Role::Decode => self.decode_down = true,
            Role::Coordinator => return,
        }
        match (&self.phase, role) {
            (CoordPhase::Reserving, Role::Decode) => {
                self.decide(Outcome::Failed(Failure::NodeDown(Role::Decode)), out);
                self.finish(out);
            }
            (CoordPhase::Transferring { .. }, Role::Prefill) => {
                self.decide(Outcome::Failed(Failure::NodeDown(Role::Prefill)), out);
                self.abort_decode(out);
            }
            (CoordPhase::Transferring { .. }, Role::Decode) => {
                // The prefill may still be writing: stop it before anything else.
                self.decide(Outcome::Failed(Failure::NodeDown(Role::Decode)), out);
                self.abort_prefill(out);
            }
            (CoordPhase::Decoding, Role::Decode) => {
                let o = if self.flaws.coordinator_success_on_decode_crash {
                    Outcome::Succeeded
                } else {
                    Outcome::Failed(Failure::NodeDown(Role::Decode))
                };
                self.decide(o, out);
                self.finish(out);
            }
            (CoordPhase::AbortingPrefill, Role::Prefill) => self.abort_decode(out),
            (CoordPhase::AbortingDecode, Role::Decode) => self.finish(out),
            _ => {}
        }
    }
}

// ---------------------------------------------------------------------------
// Decode node
// ---------------------------------------------------------------------------

/// Why the decode node could not reserve pages for a request now.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum ReserveError {
    /// Refused for good (terminal, S3).
    Refused(Refusal),
    /// The request fits the pool but not right now: it waits (FIFO) until pages are
    /// freed ([`DecodeNode::on_capacity`]).
    NoRoomYet,
}

impl From<Refusal> for ReserveError {
    fn from(r: Refusal) -> Self {
        Self::Refused(r)
    }
}

/// The decode node's pool and engine as the protocol sees them.
pub trait DecodeEnv {
    /// Admission (I1) of a new request, before any page is touched: whether it can
    /// ever be served by this node. The default admits everything (then
    /// [`reserve`](Self::reserve) refuses).
    fn admit(
        &mut self,
        _req: ReqId,
        _tenant: u64,
        _prompt_tokens: u32,
        _max_tokens: u32,
    ) -> Result<(), Refusal> {
        Ok(())
    }

    /// Reservation, all or nothing: pages for `prompt_tokens + max_tokens`. Returns the
    /// transfer pages (those the prompt's KV fills, in logical block order, with the
    /// tags written at reservation).
    fn reserve(
        &mut self,
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
    ) -> Result<Vec<DestPage>, ReserveError>;

    /// Checksum of the bytes now in `dest.page`, or `None` unless the page is held by
    /// `req` and carries exactly `dest.tag` (I3).
    fn landed_checksum(&self, req: ReqId, dest: DestPage) -> Option<u32>;

    /// Adds the verified sequence to the running batch: `tokens` prompt tokens of KV in
    /// `pages` (the reservation's transfer pages, exactly as the descriptor named
    /// them), next input `first_token`. Report its end with
    /// [`DecodeNode::on_decode_finished`]. An error fails the request (its pages are
    /// then released).
    fn start_decode(
        &mut self,
        req: ReqId,
        tokens: u32,
        first_token: u32,
        pages: &[DestPage],
    ) -> Result<(), FailReason>;

    /// Stops the sequence if it runs and frees every page of `req` (bumping epochs, I5).
    fn release(&mut self, req: ReqId);

    /// Whether the node that writes `req`'s pages is known gone (its link closed): then
    /// nothing it issued can still land. The default knows nothing.
    fn writer_gone(&self, _req: ReqId) -> bool {
        false
    }
}

/// A request's state on the decode node.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum DecodeState {
    /// Admission refused; nothing held (terminal).
    Refused(Refusal),
    /// Admitted, waiting (FIFO) for pages; nothing held.
    Waiting {
        /// Owning tenant.
        tenant: u64,
        /// Prompt tokens the prefill will transfer.
        prompt_tokens: u32,
        /// Tokens the decode may generate.
        max_tokens: u32,
    },
    /// Pages reserved; waiting for the commit.
    Reserved {
        /// Reserved prompt tokens.
        tokens: u32,
        /// Reserved transfer pages.
        dest: Vec<DestPage>,
    },
    /// Commit verified; decoding.
    Running,
    /// Pages still held but never to be read: a write into them may still be on its
    /// way (the coordinator was lost or the lease ran out before a commit). Freed once
    /// the prefill side is known quiet: an `Abort` from the coordinator (sent only
    /// after the prefill acknowledged), `WriterQuiet` from the prefill node (on its
    /// own when its coordinator is gone, or answering the `QuietQuery` this node
    /// sends its writer while the coordinator is gone), a commit (sent only after its
    /// writes drained), or the writer's last link closed. Never freed on a timer.
    Quarantined(Quarantine),
    /// Decode ended; pages freed (terminal).
    Finished(DecodeOutcome),
    /// Commit refused; pages freed (terminal).
    CommitFailed(CommitError),
    /// Aborted; pages freed (terminal tombstone).
    Aborted,
}

/// Why a reservation is quarantined.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Quarantine {
    /// Its coordinator's link closed.
    CoordinatorLost,
    /// Its lease ran out before a commit.
    LeaseExpired,
}

impl RequestState for DecodeState {
    fn is_terminal(&self) -> bool {
        !matches!(
            self,
            DecodeState::Waiting { .. }
                | DecodeState::Reserved { .. }
                | DecodeState::Running
                | DecodeState::Quarantined(_)
        )
    }
}

/// What a decode node does with one page write that arrived for a request (the
/// writer's identity is checked by the driver before this is asked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PageWrite {
    /// Apply it: the request is reserved and `dest` is one of its transfer pages.
    Apply,
    /// Drop it without applying: a late write into a reservation that ended or is
    /// quarantined (S2: its pages are never read again before they are freed).
    DropLate,
    /// A protocol violation: the request is not awaiting writes (unknown, committed
    /// or running), or `dest` is not one of the pages reserved for it (a write aimed
    /// at another request's pages, I3/I4).
    Refuse(&'static str),
}

/// A node's per-request records: the live state machine of each request, then its
/// tombstone once terminal (what stops a late `Prealloc`, `Prefill` or `Commit` from
/// acting again).
///
/// Each terminal record remembers when (on the driver's clock, [`Records::expire`])
/// it became terminal, so the node can forget it once no copy of a message for it can
/// still arrive. Under the model checker the clock never moves.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Records<S> {
    reqs: BTreeMap<ReqId, S>,
    /// Terminal records and the clock reading when each became terminal.
    ended: BTreeMap<ReqId, u64>,
    /// The driver's clock as of the last [`Records::expire`] (milliseconds).
    now: u64,
}

impl<S> Default for Records<S> {
    fn default() -> Self {
        Self {
            reqs: BTreeMap::new(),
            ended: BTreeMap::new(),
            now: 0,
        }
    }
}

/// A per-request state that can end.
pub trait RequestState {
    /// Whether the request is over on this node (nothing held, nothing to do).
    fn is_terminal(&self) -> bool;
}

impl<S: RequestState> Records<S> {
    /// The state of `req`, if the node has a record of it.
    pub fn state(&self, req: ReqId) -> Option<&S> {
        self.reqs.get(&req)
    }

    /// Every request with a record, and its state.
    pub fn states(&self) -> impl Iterator<Item = (ReqId, &S)> {
        self.reqs.iter().map(|(r, s)| (*r, s))
    }

    /// Drops the record of a terminal request. Call only once no copy of a message for
    /// it can still arrive: the record is what stops a late `Prealloc` or `Commit`.
    /// Returns false (and keeps it) if the request is not terminal.
    pub fn forget(&mut self, req: ReqId) -> bool {
        match self.reqs.get(&req) {
            Some(s) if s.is_terminal() => {
                self.reqs.remove(&req);
                self.ended.remove(&req);
                true
            }
            _ => false,
        }
    }

    /// Advances the clock to `now` (milliseconds, monotonic, the driver's) and forgets
    /// every record that has been terminal for at least `ttl` milliseconds: the
    /// longest a copy of a message for a request can still be on its way (a lost
    /// reply's retransmission included). Returns how many were forgotten. Costs one
    /// pass over the terminal records.
    pub fn expire(&mut self, now: u64, ttl: u64) -> usize {
        self.now = self.now.max(now);
        let old: Vec<ReqId> = self
            .ended
            .iter()
            .filter(|(_, &t)| t.saturating_add(ttl) <= self.now)
            .map(|(r, _)| *r)
            .collect();
        old.into_iter().filter(|r| self.forget(*r)).count()
    }

    /// Number of records (live and terminal).
    pub fn len(&self) -> usize {
        self.reqs.len()
    }

    /// Whether there is no record.
    pub fn is_empty(&self) -> bool {
        self.reqs.is_empty()
    }

    fn get(&self, req: &ReqId) -> Option<&S> {
        self.reqs.get(req)
    }

    fn insert(&mut self, req: ReqId, state: S) {
        if state.is_terminal() {
            self.ended.entry(req).or_insert(self.now);
        } else {
            self.ended.remove(&req);
        }
        self.reqs.insert(req, state);
    }

    fn remove(&mut self, req: &ReqId) {
        self.reqs.remove(req);
        self.ended.remove(req);
    }
}

/// The decode side of the protocol for every request on one decode node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct DecodeNode {
    reqs: Records<DecodeState>,
    /// Admitted requests waiting for pages, oldest first (FIFO: none overtakes).
    waiting: VecDeque<ReqId>,
    /// Requests whose prefill side already said it is quiet (before they were
    /// quarantined, or even before their `Prealloc` arrived: the two come on different
    /// links), and the driver's clock when it said so.
    quiet: BTreeMap<ReqId, u64>,
    /// Reserved requests whose writer aimed a page write outside the reservation,
    /// and the page it aimed at: their commit fails.
    foreign_writes: BTreeMap<ReqId, u32>,
    /// The node drains ([`DecodeNode::begin_drain`]): new requests are refused.
    draining: bool,
    flaws: Flaws,
}

impl DecodeNode {
    /// An empty node.
    pub fn new() -> Self {
        Self::default()
    }

    /// A node with deliberate flaws (model checker tests only).
    #[doc(hidden)]
    pub fn with_flaws(flaws: Flaws) -> Self {
        Self {
            reqs: Records::default(),
            waiting: VecDeque::new(),
            quiet: BTreeMap::new(),
            foreign_writes: BTreeMap::new(),
            draining: false,
            flaws,
        }
    }

    /// Requests admitted and waiting for pages, oldest first.
    pub fn waiting(&self) -> impl Iterator<Item = ReqId> + '_ {
        self.waiting.iter().copied()
    }

    /// Every request's record (state machine, then tombstone).
    pub fn records(&self) -> &Records<DecodeState> {
        &self.reqs
    }

    /// Mutable records, to [`Records::forget`] tombstones.
    pub fn records_mut(&mut self) -> &mut Records<DecodeState> {
        &mut self.reqs
    }

    /// Dispatches a message addressed to the decode node.
    pub fn on_msg(&mut self, msg: Msg, env: &mut impl DecodeEnv, out: &mut Vec<Output>) {
        match msg {
            Msg::Prealloc {
                req,
                tenant,
                prompt_tokens,
                max_tokens,
            } => self.on_prealloc(req, tenant, prompt_tokens, max_tokens, env, out),
            Msg::Commit {
                req,
                tokens,
                pages,
                first_token,
            } => {
                let _ = self.on_commit(req, tokens, &pages, first_token, env, out);
            }
            Msg::Abort { req } => self.on_abort(req, env, out),
            Msg::Poll { req } => self.resend(req, out),
            Msg::WriterQuiet { req } => self.on_writer_quiet(req, env, out),
            _ => {}
        }
    }

    /// The node starts draining: from now on every new request is refused with
    /// [`Refusal::draining`] (a duplicate `Prealloc` of a request it already has is
    /// answered from its record, as always). Requests waiting for pages hold nothing
    /// and have not started: they are refused now, so their coordinators start them
    /// elsewhere instead of waiting for pages here. Reserved and running requests are
    /// untouched (the driver ends what is left at its drain deadline).
    pub fn begin_drain(&mut self, out: &mut Vec<Output>) {
        self.draining = true;
        for req in std::mem::take(&mut self.waiting) {
            if matches!(self.reqs.get(&req), Some(DecodeState::Waiting { .. })) {
                self.set(req, DecodeState::Refused(Refusal::draining(Role::Decode)));
                self.resend(req, out);
            }
        }
    }

    /// Whether the node drains ([`DecodeNode::begin_drain`]).
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Whether page writes for `req` may be applied now: only while its pages are
    /// reserved and waiting for the commit (never into a running sequence's pages,
    /// never after the reservation ended or was quarantined).
    pub fn accepts_writes(&self, req: ReqId) -> bool {
        matches!(self.reqs.get(&req), Some(DecodeState::Reserved { .. }))
    }

    /// Records `state` for `req` (and forgets a quiet note once it left `Reserved`).
    fn set(&mut self, req: ReqId, state: DecodeState) {
        if state.is_terminal() {
            self.quiet.remove(&req);
            self.foreign_writes.remove(&req);
        }
        self.reqs.insert(req, state);
    }

    /// Advances the driver's clock to `now` (milliseconds) and forgets what is older
    /// than `ttl`: terminal records ([`Records::expire`]) and quiet notes of requests
    /// that never arrived. Returns how many records were forgotten.
    pub fn expire(&mut self, now: u64, ttl: u64) -> usize {
        let forgotten = self.reqs.expire(now, ttl);
        let reqs = &self.reqs;
        self.quiet
            .retain(|r, t| reqs.state(*r).is_some() || t.saturating_add(ttl) > now);
        forgotten
    }

    /// The reply the coordinator last got for `req`, re-sent for a duplicate or a poll.
    fn resend(&self, req: ReqId, out: &mut Vec<Output>) {
        let Some(state) = self.reqs.get(&req) else {
            return;
        };
        let msg = match state {
            DecodeState::Refused(reason) => Msg::Rejected {
                req,
                by: Role::Decode,
                reason: reason.clone(),
            },
            // Nothing decided yet; the coordinator's retransmissions find it here.
            DecodeState::Waiting { .. } => return,
            DecodeState::Reserved { dest, .. } => Msg::Descriptor {
                req,
                pages: dest.clone(),
            },
            DecodeState::Running => Msg::Committed { req },
            DecodeState::Quarantined(Quarantine::LeaseExpired) => Msg::LeaseExpired { req },
            DecodeState::Quarantined(Quarantine::CoordinatorLost) => return,
            DecodeState::Finished(outcome) => Msg::Finished {
                req,
                outcome: outcome.clone(),
            },
            DecodeState::CommitFailed(reason) => Msg::CommitFailed {
                req,
                reason: reason.clone(),
            },
            DecodeState::Aborted => Msg::AbortAck {
                req,
                from: Role::Decode,
            },
        };
        send(out, Role::Coordinator, msg);
    }

    /// `Prealloc`: admission (I1) and reservation for a new request, or a place in
    /// the FIFO of requests waiting for pages; a duplicate re-sends the latest reply; a
    /// tombstone ignores it. A draining node refuses every new request
    /// ([`Refusal::draining`]).
    pub fn on_prealloc(
        &mut self,
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
        env: &mut impl DecodeEnv,
        out: &mut Vec<Output>,
    ) {
        match self.reqs.get(&req) {
            None => {}
            Some(DecodeState::Aborted) => return,
            Some(_) => return self.resend(req, out),
        }
        if self.draining {
            // Before admission: nothing is looked at or held for it here.
            self.set(req, DecodeState::Refused(Refusal::draining(Role::Decode)));
            return self.resend(req, out);
        }
        if let Err(refusal) = env.admit(req, tenant, prompt_tokens, max_tokens) {
            self.set(req, DecodeState::Refused(refusal));
            return self.resend(req, out);
        }
        let waiting = DecodeState::Waiting {
            tenant,
            prompt_tokens,
            max_tokens,
        };
        if !self.waiting.is_empty() {
            // Behind older requests: no overtaking.
            self.set(req, waiting);
            self.waiting.push_back(req);
            return;
        }
        if self.try_reserve(req, tenant, prompt_tokens, max_tokens, env, out) {
            return;
        }
        self.set(req, waiting);
        self.waiting.push_back(req);
    }

    /// Reserves for `req` and answers, or returns false (nothing changed) when the pool
    /// has no room yet.
    fn try_reserve(
        &mut self,
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
        env: &mut impl DecodeEnv,
        out: &mut Vec<Output>,
    ) -> bool {
        let state = match env.reserve(req, tenant, prompt_tokens, max_tokens) {
            Ok(dest) => DecodeState::Reserved {
                tokens: prompt_tokens,
                dest,
            },
            Err(ReserveError::Refused(refusal)) => DecodeState::Refused(refusal),
            Err(ReserveError::NoRoomYet) => return false,
        };
        self.set(req, state);
        self.resend(req, out);
        true
    }

    /// Pages were freed: reserves for waiting requests in arrival order until one does
    /// not fit (it stays first in line).
    pub fn on_capacity(&mut self, env: &mut impl DecodeEnv, out: &mut Vec<Output>) {
        while let Some(&req) = self.waiting.front() {
            let Some(&DecodeState::Waiting {
                tenant,
                prompt_tokens,
                max_tokens,
            }) = self.reqs.get(&req)
            else {
                self.waiting.pop_front(); // aborted meanwhile
                continue;
            };
            if !self.try_reserve(req, tenant, prompt_tokens, max_tokens, env, out) {
                return;
            }
            self.waiting.pop_front();
        }
    }

    /// A page write into `dest` arrived for `req` from its writer (the driver checked
    /// the writer's identity). Only a reserved request's own transfer pages, with the
    /// tags its descriptor named, may be written. A write aimed anywhere else is
    /// refused and the request's commit will fail ([`CommitError::ForeignWrite`]):
    /// its writer is not trusted with it. Late writes into a reservation that ended
    /// or is quarantined are dropped (S2: those pages are never read before they are
    /// freed).
    pub fn on_page_write(&mut self, req: ReqId, dest: &DestPage) -> PageWrite {
        match self.reqs.get(&req) {
            Some(DecodeState::Reserved { dest: pages, .. }) => {
                if pages.iter().any(|p| p == dest) {
                    PageWrite::Apply
                } else {
                    self.foreign_writes.entry(req).or_insert(dest.page);
                    PageWrite::Refuse("a page write outside the request's reservation")
                }
            }
            Some(
                DecodeState::Quarantined(_) | DecodeState::Aborted | DecodeState::CommitFailed(_),
            ) => PageWrite::DropLate,
            _ => PageWrite::Refuse(
                "a page write for pages not awaiting one (unknown, committed or finished)",
            ),
        }
    }

    /// `Commit`: verifies it (I4) and admits the sequence, or fails the request and
    /// frees its pages. Anything but a first commit for a reserved request changes
    /// nothing: the latest reply is re-sent (an unknown request gets `CommitFailed`).
    /// Returns the verdict, for logs and metrics.
    pub fn on_commit(
        &mut self,
        req: ReqId,
        tokens: u32,
        pages: &[PageCommit],
        first_token: u32,
        env: &mut impl DecodeEnv,
        out: &mut Vec<Output>,
    ) -> Result<(), CommitError> {
        let Some(state) = self.reqs.get(&req) else {
            send(
                out,
                Role::Coordinator,
                Msg::CommitFailed {
                    req,
                    reason: CommitError::UnknownRequest,
                },
            );
            return Err(CommitError::UnknownRequest);
        };
        // The block table decode will read: its own reservation, never the commit's list.
        let (verdict, table, table_tokens) = match state {
            DecodeState::Reserved {
                tokens: reserved,
                dest,
            } => {
                let verdict = if self.flaws.decode_skips_commit_checks {
                    Ok(())
                } else if let Some(&page) = self.foreign_writes.get(&req) {
                    Err(CommitError::ForeignWrite { page })
                } else {
                    verify_commit(req, *reserved, dest, tokens, pages, env)
                };
                (verdict, dest.clone(), *reserved)
            }
            DecodeState::Running | DecodeState::Finished(_)
                if self.flaws.decode_accepts_duplicate_commit =>
            {
                (Ok(()), pages.iter().map(|p| p.dest).collect(), tokens)
            }
            DecodeState::Quarantined(_) => {
                // A commit is sent only after its writes drained: nothing can land now.
                env.release(req);
                self.set(req, DecodeState::Aborted);
                send(
                    out,
                    Role::Coordinator,
                    Msg::CommitFailed {
                        req,
                        reason: CommitError::NotAwaitingCommit,
                    },
                );
                return Err(CommitError::NotAwaitingCommit);
            }
            _ => {
                self.resend(req, out);
                return Err(CommitError::NotAwaitingCommit);
            }
        };
        match &verdict {
            Ok(()) => match env.start_decode(req, table_tokens, first_token, &table) {
                Ok(()) => self.set(req, DecodeState::Running),
                Err(reason) => {
                    // Verified, but the engine would not run it: fail it, free its pages.
                    env.release(req);
                    let outcome = DecodeOutcome::Failed { reason };
                    self.set(req, DecodeState::Finished(outcome));
                }
            },
            Err(e) => {
                // The prefill drained before committing: nothing can still land (S2).
                if !self.flaws.decode_leaks_on_commit_failed {
                    env.release(req);
                }
                self.set(req, DecodeState::CommitFailed(e.clone()));
            }
        }
        self.resend(req, out);
        verdict
    }

    /// `Abort`: frees whatever the request holds, leaves a tombstone, acknowledges.
    /// The coordinator sends it only once the prefill side is quiet (S2).
    pub fn on_abort(&mut self, req: ReqId, env: &mut impl DecodeEnv, out: &mut Vec<Output>) {
        match self.reqs.get(&req) {
            // A quarantined reservation too: the coordinator aborts the decode side only
            // once the prefill side acknowledged (or is dead), so nothing can land.
            Some(
                DecodeState::Reserved { .. } | DecodeState::Running | DecodeState::Quarantined(_),
            ) => {
                env.release(req);
                self.set(req, DecodeState::Aborted);
            }
            Some(DecodeState::Waiting { .. }) => {
                self.waiting.retain(|r| *r != req);
                self.set(req, DecodeState::Aborted);
            }
            None => {
                self.set(req, DecodeState::Aborted);
            }
            Some(_) => {} // terminal: nothing held
        }
        send(
            out,
            Role::Coordinator,
            Msg::AbortAck {
                req,
                from: Role::Decode,
            },
        );
    }

    /// The coordinator of `req` is gone (its link closed): nobody will finish or abort
    /// the request, so the node ends it itself, without an acknowledgement. A running
    /// sequence's pages are freed at once (its commit proved the prefill drained); a
    /// reservation still waiting for its commit is quarantined (S2: the prefill may
    /// still be writing into it) until the prefill side is quiet, unless it already
    /// said so. Nobody else will quiet the prefill side now (the prefill node may
    /// never have heard of the request: its `Prefill` may have died with the
    /// coordinator), so the node asks the writer itself (`QuietQuery`), and again on
    /// every [`ask_writers`](Self::ask_writers) until it answers. A reservation whose
    /// lease ran out is asked about too: its coordinator would have quieted the
    /// prefill side.
    pub fn on_coordinator_lost(
        &mut self,
        req: ReqId,
        env: &mut impl DecodeEnv,
        out: &mut Vec<Output>,
    ) {
        match self.reqs.get(&req) {
            Some(DecodeState::Reserved { .. })
                if !self.quiet.contains_key(&req)
                    && !env.writer_gone(req)
                    && !self.flaws.decode_frees_on_coordinator_lost =>
            {
                self.set(req, DecodeState::Quarantined(Quarantine::CoordinatorLost));
                send(out, Role::Prefill, Msg::QuietQuery { req });
            }
            Some(DecodeState::Quarantined(Quarantine::LeaseExpired)) => {
                self.set(req, DecodeState::Quarantined(Quarantine::CoordinatorLost));
                send(out, Role::Prefill, Msg::QuietQuery { req });
            }
            Some(DecodeState::Reserved { .. } | DecodeState::Running) => {
                env.release(req);
                self.set(req, DecodeState::Aborted);
            }
            Some(DecodeState::Waiting { .. }) => {
                self.waiting.retain(|r| *r != req);
                self.set(req, DecodeState::Aborted);
            }
            None => self.set(req, DecodeState::Aborted),
            Some(_) => {} // quarantined already, or terminal
        }
    }

    /// The retry timer of the quarantine of `req` fired: if its pages are quarantined
    /// because its coordinator is gone, asks its writer again whether it is quiet
    /// (`QuietQuery`; the first one went out with the quarantine, and any may be
    /// lost). The pages stay quarantined until the answer: a timer alone never frees
    /// them (S2). Ignored otherwise.
    pub fn ask_writer(&mut self, req: ReqId, env: &mut impl DecodeEnv, out: &mut Vec<Output>) {
        if self.reqs.get(&req) != Some(&DecodeState::Quarantined(Quarantine::CoordinatorLost)) {
            return;
        }
        if self.flaws.decode_frees_quarantine_unasked {
            env.release(req);
            self.set(req, DecodeState::Aborted);
            return;
        }
        send(out, Role::Prefill, Msg::QuietQuery { req });
    }

    /// [`ask_writer`](Self::ask_writer) for every reservation quarantined because its
    /// coordinator is gone (the driver's retry timer). Each `Send` goes to the writer
    /// of its `msg.req()`.
    pub fn ask_writers(&mut self, env: &mut impl DecodeEnv, out: &mut Vec<Output>) {
        let asked: Vec<ReqId> = self
            .reqs
            .states()
            .filter(|(_, s)| **s == DecodeState::Quarantined(Quarantine::CoordinatorLost))
            .map(|(r, _)| r)
            .collect();
        for req in asked {
            self.ask_writer(req, env, out);
        }
    }

    /// The reservation's lease ran out (the prefill neither committed nor renewed):
    /// the pages are quarantined, never read, and the coordinator hears
    /// `LeaseExpired`; it quiets the prefill side and then aborts this side, which
    /// frees them. Ignored unless `req` is reserved.
    pub fn on_lease_expired(
        &mut self,
        req: ReqId,
        env: &mut impl DecodeEnv,
        out: &mut Vec<Output>,
    ) {
        if !matches!(self.reqs.get(&req), Some(DecodeState::Reserved { .. })) {
            return;
        }
        if self.flaws.decode_frees_on_lease_expiry {
            env.release(req);
            self.set(req, DecodeState::Aborted);
        } else {
            self.set(req, DecodeState::Quarantined(Quarantine::LeaseExpired));
        }
        send(out, Role::Coordinator, Msg::LeaseExpired { req });
    }

    /// `WriterQuiet` (or the driver saw the writer's link close): the prefill side
    /// will write nothing more for `req`. Frees a quarantined reservation; remembered
    /// for one that is not quarantined (yet) or not even reserved yet.
    pub fn on_writer_quiet(
        &mut self,
        req: ReqId,
        env: &mut impl DecodeEnv,
        _out: &mut Vec<Output>,
    ) {
        match self.reqs.get(&req) {
            Some(DecodeState::Quarantined(_)) => {
                env.release(req);
                self.set(req, DecodeState::Aborted);
            }
            Some(DecodeState::Reserved { .. } | DecodeState::Waiting { .. }) | None => {
                self.quiet.insert(req, self.reqs.now);
            }
            Some(_) => {}
        }
    }

    /// The engine reports that the sequence ended: frees its pages and tells the
    /// coordinator. Ignored unless the request is running.
    pub fn on_decode_finished(
        &mut self,
        req: ReqId,
        outcome: DecodeOutcome,
        env: &mut impl DecodeEnv,
        out: &mut Vec<Output>,
    ) {
        if self.reqs.get(&req) != Some(&DecodeState::Running) {
            return;
        }
        env.release(req);
        self.set(req, DecodeState::Finished(outcome));
        self.resend(req, out);
    }
}

/// The I4 check of a commit against a reservation: tokens covered == reserved, the
/// committed pages are exactly the reserved pages (each once, each with its reserved
/// tag), and the bytes that landed in each page match the committed checksum.
pub fn verify_commit(
    req: ReqId,
    reserved_tokens: u32,
    reserved: &[DestPage],
    tokens: u32,
    pages: &[PageCommit],
    env: &impl DecodeEnv,
) -> Result<(), CommitError> {
    if tokens != reserved_tokens {
        return Err(CommitError::TokenCount {
            expected: reserved_tokens,
            got: tokens,
        });
    }
    if pages.len() != reserved.len() {
        return Err(CommitError::PageCount {
            expected: reserved.len() as u32,
            got: pages.len() as u32,
        });
    }
    let mut seen = BTreeSet::new();
    for pc in pages {
        let page = pc.dest.page;
        let Some(r) = reserved.iter().find(|r| r.page == page) else {
            return Err(CommitError::UnexpectedPage { page });
        };
        if !seen.insert(page) {
            return Err(CommitError::DuplicatePage { page });
        }
        if r.tag != pc.dest.tag {
            return Err(CommitError::TagMismatch { page });
        }
        match env.landed_checksum(req, *r) {
            None => return Err(CommitError::TagMismatch { page }),
            Some(got) if got != pc.checksum => {
                return Err(CommitError::ChecksumMismatch {
                    page,
                    expected: pc.checksum,
                    got,
                })
            }
            Some(_) => {}
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Prefill node
// ---------------------------------------------------------------------------

/// The prefill node's pool, engine and transport as the protocol sees them.
pub trait PrefillEnv {
    /// Pages needed to hold `tokens` tokens (the descriptor must name that many).
    fn pages_for(&self, tokens: u32) -> usize;

    /// Admission (I1) and allocation of source pages, all or nothing.
    fn admit_and_alloc(
        &mut self,
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
    ) -> Result<(), Refusal>;

    /// Starts computing the prompt's KV (`tokens` tokens); page `i` is put into
    /// `dest[i]` through the transport once computed. Report the end with
    /// [`PrefillNode::on_computed`] or [`PrefillNode::on_compute_failed`].
    fn start_prefill(&mut self, req: ReqId, tokens: u32, dest: &[DestPage]);

    /// Stops computing `req`: once this returns no further put for it is issued
    /// (puts already issued may still be in flight).
    fn stop_prefill(&mut self, req: ReqId);

    /// Asks the transport to drain every put issued so far; report completion with
    /// [`PrefillNode::on_drained`].
    fn flush(&mut self, req: ReqId);

    /// Frees `req`'s source pages. Called only once its writes are drained (I5).
    fn release(&mut self, req: ReqId);
}

/// What the prefill node does once the drain it waits for completes.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum AfterDrain {
    /// Release and send this `Commit`.
    Commit(Msg),
    /// Release and send `PrefillFailed`.
    Fail(FailReason),
    /// Release and send `AbortAck`.
    AbortAck,
    /// Release and tell the decode node `WriterQuiet` (the coordinator is gone).
    Quiet,
}

/// A request's state on the prefill node.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum PrefillState {
    /// Admission refused; nothing held (terminal).
    Refused(Refusal),
    /// Admitted, source pages allocated, computing and writing.
    Computing {
        /// Tokens being prefilled.
        tokens: u32,
        /// Destination pages.
        dest: Vec<DestPage>,
    },
    /// Waiting for the transport to drain; source pages still held (I5).
    Draining(AfterDrain),
    /// Commit sent, source pages released; kept to re-send the commit.
    Committed(Msg),
    /// Failed after draining; pages released (terminal).
    Failed(FailReason),
    /// Aborted; nothing held (terminal tombstone).
    Aborted,
}

impl RequestState for PrefillState {
    fn is_terminal(&self) -> bool {
        !matches!(
            self,
            PrefillState::Computing { .. } | PrefillState::Draining(_)
        )
    }
}

/// The prefill side of the protocol for every request on one prefill node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct PrefillNode {
    reqs: Records<PrefillState>,
    /// The node drains ([`PrefillNode::begin_drain`]): new requests are refused.
    draining: bool,
    flaws: Flaws,
}

impl PrefillNode {
    /// An empty node.
    pub fn new() -> Self {
        Self::default()
    }

    /// A node with deliberate flaws (model checker tests only).
    #[doc(hidden)]
    pub fn with_flaws(flaws: Flaws) -> Self {
        Self {
            reqs: Records::default(),
            draining: false,
            flaws,
        }
    }

    /// The node starts draining: from now on every new request is refused with
    /// [`Refusal::draining`] (a duplicate `Prefill` of a request it already has is
    /// answered from its record, as always); requests it computes or drains are
    /// untouched.
    pub fn begin_drain(&mut self) {
        self.draining = true;
    }

    /// Whether the node drains ([`PrefillNode::begin_drain`]).
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// Every request's record (state machine, then tombstone).
    pub fn records(&self) -> &Records<PrefillState> {
        &self.reqs
    }

    /// Mutable records, to [`Records::forget`] tombstones.
    pub fn records_mut(&mut self) -> &mut Records<PrefillState> {
        &mut self.reqs
    }

    /// Dispatches a message addressed to the prefill node.
    pub fn on_msg(&mut self, msg: Msg, env: &mut impl PrefillEnv, out: &mut Vec<Output>) {
        match msg {
            Msg::Prefill {
                req,
                tenant,
                prompt_tokens,
                max_tokens,
                dest,
            } => self.on_prefill(req, tenant, prompt_tokens, max_tokens, dest, env, out),
            Msg::Abort { req } => self.on_abort(req, env, out),
            Msg::QuietQuery { req } => self.on_quiet_query(req, out),
            _ => {}
        }
    }

    /// `QuietQuery` from the decode node that holds `req`'s pages quarantined (its
    /// coordinator is gone): `WriterQuiet` at once when nothing is in flight and
    /// nothing will be. A request it never heard of gets a failed record first, so a
    /// `Prefill` still on its way from the coordinator computes and writes nothing
    /// (its coordinator, if alive after all, hears `PrefillFailed`); a request that
    /// ended (committed, failed, refused, aborted) writes nothing more. A request it
    /// still computes or drains gets no answer now: its coordinator ends it (commit,
    /// failure, abort), or, if the coordinator is gone too,
    /// [`on_coordinator_lost`](Self::on_coordinator_lost) sends `WriterQuiet` once its
    /// writes drained; the decode node asks again meanwhile.
    pub fn on_quiet_query(&mut self, req: ReqId, out: &mut Vec<Output>) {
        match self.reqs.get(&req) {
            Some(PrefillState::Computing { .. } | PrefillState::Draining(_))
                if !self.flaws.prefill_quiet_while_writing =>
            {
                return;
            }
            None if !self.flaws.prefill_quiet_without_record => {
                let reason = FailReason::new(
                    FailKind::Transport,
                    "the decode node gave up the reservation (its coordinator link closed) \
                     before this prefill node heard of the request",
                );
                self.reqs.insert(req, PrefillState::Failed(reason));
            }
            _ => {}
        }
        send(out, Role::Decode, Msg::WriterQuiet { req });
    }

    /// `Prefill`: descriptor check, admission (I1) and allocation, then compute. A
    /// duplicate re-sends the latest reply (`Commit`, `PrefillFailed`, `Rejected`); a
    /// tombstone ignores it. A draining node refuses every new request
    /// ([`Refusal::draining`]).
    #[allow(clippy::too_many_arguments)]
    pub fn on_prefill(
        &mut self,
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
        dest: Vec<DestPage>,
        env: &mut impl PrefillEnv,
        out: &mut Vec<Output>,
    ) {
        match self.reqs.get(&req) {
            None => {}
            Some(PrefillState::Committed(commit)) => {
                return send(out, Role::Decode, commit.clone());
            }
            Some(PrefillState::Failed(reason)) => {
                let reason = reason.clone();
                return send(out, Role::Coordinator, Msg::PrefillFailed { req, reason });
            }
            Some(PrefillState::Refused(refusal)) => {
                let reason = refusal.clone();
                let msg = Msg::Rejected {
                    req,
                    by: Role::Prefill,
                    reason,
                };
                return send(out, Role::Coordinator, msg);
            }
            Some(_) => return, // working on it, or aborted (tombstone)
        }
        if self.draining {
            let refusal = Refusal::draining(Role::Prefill);
            self.reqs
                .insert(req, PrefillState::Refused(refusal.clone()));
            let msg = Msg::Rejected {
                req,
                by: Role::Prefill,
                reason: refusal,
            };
            return send(out, Role::Coordinator, msg);
        }
        let needed = env.pages_for(prompt_tokens);
        if dest.len() != needed {
            let reason = FailReason::new(
                FailKind::Internal,
                format!(
                    "descriptor names {} pages but {prompt_tokens} prompt tokens need {needed}",
                    dest.len()
                ),
            );
            self.reqs.insert(req, PrefillState::Failed(reason.clone()));
            return send(out, Role::Coordinator, Msg::PrefillFailed { req, reason });
        }
        match env.admit_and_alloc(req, tenant, prompt_tokens, max_tokens) {
            Ok(()) => {
                env.start_prefill(req, prompt_tokens, &dest);
                self.reqs.insert(
                    req,
                    PrefillState::Computing {
                        tokens: prompt_tokens,
                        dest,
                    },
                );
            }
            Err(refusal) => {
                if self.flaws.prefill_placeholder_on_refusal
                    && !dest.is_empty()
                    && env.admit_and_alloc(req, tenant, 1, 1).is_ok()
                {
                    // The incident: a one-token placeholder rides through the batch.
                    env.start_prefill(req, 1, &dest[..1]);
                    let dest = dest[..1].to_vec();
                    self.reqs
                        .insert(req, PrefillState::Computing { tokens: 1, dest });
                    return;
                }
                self.reqs
                    .insert(req, PrefillState::Refused(refusal.clone()));
                let msg = Msg::Rejected {
                    req,
                    by: Role::Prefill,
                    reason: refusal,
                };
                send(out, Role::Coordinator, msg);
            }
        }
    }

    /// The engine computed every page of `req` and issued every put; `checksums[i]` is
    /// the checksum of the bytes put into `dest[i]`. Drains the transport before
    /// anything is released or committed (I5, S2).
    pub fn on_computed(
        &mut self,
        req: ReqId,
        first_token: u32,
        checksums: &[u32],
        env: &mut impl PrefillEnv,
        out: &mut Vec<Output>,
    ) {
        let Some(PrefillState::Computing { tokens, dest }) = self.reqs.get(&req) else {
            return;
        };
        if checksums.len() != dest.len() {
            let reason = FailReason::new(
                FailKind::Internal,
                format!(
                    "prefill produced {} page checksums for {} pages",
                    checksums.len(),
                    dest.len()
                ),
            );
            env.flush(req);
            self.reqs
                .insert(req, PrefillState::Draining(AfterDrain::Fail(reason)));
            return;
        }
        let commit = Msg::Commit {
            req,
            tokens: *tokens,
            pages: dest
                .iter()
                .zip(checksums)
                .map(|(d, c)| PageCommit {
                    dest: *d,
                    checksum: *c,
                })
                .collect(),
            first_token,
        };
        if self.flaws.prefill_commits_before_drain {
            env.release(req);
            send(out, Role::Decode, commit.clone());
            self.reqs.insert(req, PrefillState::Committed(commit));
            return;
        }
        env.flush(req);
        self.reqs
            .insert(req, PrefillState::Draining(AfterDrain::Commit(commit)));
    }

    /// The engine failed computing `req` (it issues no further put): drain, then fail.
    pub fn on_compute_failed(
        &mut self,
        req: ReqId,
        reason: FailReason,
        env: &mut impl PrefillEnv,
        _out: &mut Vec<Output>,
    ) {
        if let Some(PrefillState::Computing { .. }) = self.reqs.get(&req) {
            env.flush(req);
            self.reqs
                .insert(req, PrefillState::Draining(AfterDrain::Fail(reason)));
        }
    }

    /// The transport drained (or failed) every put issued for `req` before the flush:
    /// nothing can land any more, so the source pages are released, then the commit,
    /// failure or abort ack goes out.
    pub fn on_drained(
        &mut self,
        req: ReqId,
        result: Result<(), FailReason>,
        env: &mut impl PrefillEnv,
        out: &mut Vec<Output>,
    ) {
        let Some(PrefillState::Draining(after)) = self.reqs.get(&req) else {
            return;
        };
        let after = after.clone();
        env.release(req);
        match (after, result) {
            (AfterDrain::Commit(commit), Ok(())) => {
                send(out, Role::Decode, commit.clone());
                self.reqs.insert(req, PrefillState::Committed(commit));
            }
            (AfterDrain::Commit(_), Err(reason)) | (AfterDrain::Fail(reason), _) => {
                self.reqs.insert(req, PrefillState::Failed(reason.clone()));
                send(out, Role::Coordinator, Msg::PrefillFailed { req, reason });
            }
            (AfterDrain::AbortAck, _) => {
                self.tombstone(req);
                let ack = Msg::AbortAck {
                    req,
                    from: Role::Prefill,
                };
                send(out, Role::Coordinator, ack);
            }
            (AfterDrain::Quiet, _) => {
                self.tombstone(req);
                send(out, Role::Decode, Msg::WriterQuiet { req });
            }
        }
    }

    fn tombstone(&mut self, req: ReqId) {
        if self.flaws.prefill_forgets_aborts {
            self.reqs.remove(&req);
        } else {
            self.reqs.insert(req, PrefillState::Aborted);
        }
    }

    /// The coordinator of `req` is gone (its link closed): the node stops the request
    /// as for an `Abort` (stop, drain, release), and then tells the decode node
    /// `WriterQuiet` instead of acknowledging to nobody, so the decode node can free
    /// the pages it quarantined. A request with nothing in flight (committed, failed,
    /// refused, aborted, or never seen: a tombstone stops a late `Prefill`) is quiet at
    /// once.
    pub fn on_coordinator_lost(
        &mut self,
        req: ReqId,
        env: &mut impl PrefillEnv,
        out: &mut Vec<Output>,
    ) {
        match self.reqs.get(&req) {
            Some(PrefillState::Computing { .. }) => {
                env.stop_prefill(req);
                env.flush(req);
                self.reqs
                    .insert(req, PrefillState::Draining(AfterDrain::Quiet));
            }
            Some(PrefillState::Draining(_)) => {
                self.reqs
                    .insert(req, PrefillState::Draining(AfterDrain::Quiet));
            }
            // Nothing in flight: its writes drained, or it never wrote and (with a
            // tombstone) never will.
            Some(PrefillState::Refused(_)) => send(out, Role::Decode, Msg::WriterQuiet { req }),
            _ => {
                self.tombstone(req);
                send(out, Role::Decode, Msg::WriterQuiet { req });
            }
        }
    }

    /// `Abort`: stops computing, drains, releases, then acknowledges (from
    /// [`on_drained`](Self::on_drained) if writes may be in flight, at once otherwise).
    /// An unknown request gets a tombstone so a late `Prefill` is ignored.
    pub fn on_abort(&mut self, req: ReqId, env: &mut impl PrefillEnv, out: &mut Vec<Output>) {
        match self.reqs.get(&req) {
            Some(PrefillState::Computing { .. }) => {
                env.stop_prefill(req);
                env.flush(req);
                self.reqs
                    .insert(req, PrefillState::Draining(AfterDrain::AbortAck));
                return;
            }
            Some(PrefillState::Draining(_)) => {
                // Drop the pending commit or failure; ack once drained.
                self.reqs
                    .insert(req, PrefillState::Draining(AfterDrain::AbortAck));
                return;
            }
            Some(PrefillState::Refused(_)) => {} // keep the refusal: nothing held
            None | Some(PrefillState::Committed(_) | PrefillState::Failed(_)) => {
                self.tombstone(req)
            }
            Some(PrefillState::Aborted) => {}
        }
        let ack = Msg::AbortAck {
            req,
            from: Role::Prefill,
        };
        send(out, Role::Coordinator, ack);
    }
}

/// Serde for [`DestPage`] (a transport type without serde) inside messages.
mod wire {
    use super::{DestPage, PageTag};
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    #[derive(Serialize, Deserialize)]
    #[serde(remote = "PageTag")]
    struct PageTagWire {
        tenant: u64,
        seq: u64,
        epoch: u32,
        logical_block: u32,
    }

    #[derive(Serialize, Deserialize)]
    #[serde(remote = "DestPage")]
    pub(super) struct DestPageWire {
        page: u32,
        #[serde(with = "PageTagWire")]
        tag: PageTag,
    }

    pub(super) mod dest_pages {
        use super::*;

        #[derive(Serialize, Deserialize)]
        struct Item(#[serde(with = "DestPageWire")] DestPage);

        pub(crate) fn serialize<S: Serializer>(v: &[DestPage], s: S) -> Result<S::Ok, S::Error> {
            s.collect_seq(v.iter().map(|d| Item(*d)))
        }

        pub(crate) fn deserialize<'de, D: Deserializer<'de>>(
            d: D,
        ) -> Result<Vec<DestPage>, D::Error> {
            Ok(Vec::<Item>::deserialize(d)?
                .into_iter()
                .map(|i| i.0)
                .collect())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    const R: ReqId = ReqId(7);

    fn tag(epoch: u32, block: u32) -> PageTag {
        PageTag {
            tenant: 3,
            seq: R.0,
            epoch,
            logical_block: block,
        }
    }

    /// A decode pool with 4 pages: page bytes are modelled by their checksum.
    #[derive(Default)]
    struct FakeDecode {
        /// page -> (tag it carries, owner, checksum of its bytes)
        pages: HashMap<u32, (PageTag, Option<ReqId>, u32)>,
        running: Vec<(ReqId, u32, Vec<DestPage>)>,
        released: Vec<ReqId>,
        free: u32,
        /// A full pool makes a request wait instead of refusing it.
        wait_when_full: bool,
        /// `start_decode` fails (an engine that will not run a verified sequence).
        fail_start: bool,
    }

    impl FakeDecode {
        fn new() -> Self {
            Self {
                free: 4,
                ..Default::default()
            }
        }
        fn land(&mut self, page: u32, checksum: u32) {
            self.pages.get_mut(&page).unwrap().2 = checksum;
        }
    }

    impl DecodeEnv for FakeDecode {
        fn reserve(
            &mut self,
            req: ReqId,
            _tenant: u64,
            prompt_tokens: u32,
            max_tokens: u32,
        ) -> Result<Vec<DestPage>, ReserveError> {
            let pages = (prompt_tokens + max_tokens).div_ceil(16);
            if pages > self.free {
                if self.wait_when_full {
                    return Err(ReserveError::NoRoomYet);
                }
                return Err(ReserveError::Refused(Refusal {
                    kind: RefusalKind::Busy,
                    message: "no pages".into(),
                }));
            }
            self.free -= pages;
            let transfer = prompt_tokens.div_ceil(16);
            let first = 10 + self.pages.len() as u32;
            Ok((0..transfer)
                .map(|b| {
                    let d = DestPage {
                        page: first + b,
                        tag: tag(1, b),
                    };
                    self.pages.insert(d.page, (d.tag, Some(req), 0xdead));
                    d
                })
                .collect())
        }
        fn landed_checksum(&self, req: ReqId, dest: DestPage) -> Option<u32> {
            let (t, owner, sum) = self.pages.get(&dest.page)?;
            (*t == dest.tag && *owner == Some(req)).then_some(*sum)
        }
        fn start_decode(
            &mut self,
            req: ReqId,
            tokens: u32,
            first: u32,
            pages: &[DestPage],
        ) -> Result<(), FailReason> {
            assert_eq!(first, 42);
            if self.fail_start {
                return Err(FailReason::new(FailKind::Internal, "engine refused"));
            }
            self.running.push((req, tokens, pages.to_vec()));
            Ok(())
        }
        fn release(&mut self, req: ReqId) {
            self.released.push(req);
            self.running.retain(|r| r.0 != req);
            for (t, owner, _) in self.pages.values_mut() {
                if *owner == Some(req) {
                    *owner = None;
                    t.epoch += 1;
                }
            }
        }
    }

    /// A decode node with `R` reserved for 20 prompt tokens (2 pages), both landed.
    fn reserved() -> (DecodeNode, FakeDecode, Vec<DestPage>) {
        let mut node = DecodeNode::new();
        let mut env = FakeDecode::new();
        let mut out = Vec::new();
        node.on_prealloc(R, 3, 20, 4, &mut env, &mut out);
        let [Output::Send {
            to: Role::Coordinator,
            msg: Msg::Descriptor { pages, .. },
        }] = out.as_slice()
        else {
            panic!("expected a descriptor, got {out:?}");
        };
        assert_eq!(pages.len(), 2);
        let pages = pages.clone();
        env.land(10, 100);
        env.land(11, 101);
        (node, env, pages)
    }

    fn good(pages: &[DestPage]) -> Vec<PageCommit> {
        pages
            .iter()
            .map(|d| PageCommit {
                dest: *d,
                checksum: 100 + d.tag.logical_block,
            })
            .collect()
    }

    fn commit(
        node: &mut DecodeNode,
        env: &mut FakeDecode,
        tokens: u32,
        pages: &[PageCommit],
    ) -> (Result<(), CommitError>, Vec<Output>) {
        let mut out = Vec::new();
        let r = node.on_commit(R, tokens, pages, 42, env, &mut out);
        (r, out)
    }

    fn reply(out: &[Output]) -> &Msg {
        match out {
            [Output::Send {
                to: Role::Coordinator,
                msg,
            }] => msg,
            _ => panic!("expected one reply, got {out:?}"),
        }
    }

    #[test]
    fn full_correct_commit_admits_once() {
        let (mut node, mut env, pages) = reserved();
        let (r, out) = commit(&mut node, &mut env, 20, &good(&pages));
        assert_eq!(r, Ok(()));
        assert_eq!(reply(&out), &Msg::Committed { req: R });
        assert_eq!(env.running, vec![(R, 20, pages.clone())]);
        assert_eq!(node.records().state(R), Some(&DecodeState::Running));

        // A duplicate is not admitted again; the reply is re-sent.
        let (r, out) = commit(&mut node, &mut env, 20, &good(&pages));
        assert_eq!(r, Err(CommitError::NotAwaitingCommit));
        assert_eq!(reply(&out), &Msg::Committed { req: R });
        assert_eq!(env.running.len(), 1);

        // After the decode ends, a duplicate commit still admits nothing.
        let mut out = Vec::new();
        node.on_decode_finished(R, DecodeOutcome::Completed, &mut env, &mut out);
        assert_eq!(
            reply(&out),
            &Msg::Finished {
                req: R,
                outcome: DecodeOutcome::Completed
            }
        );
        assert_eq!(env.released, vec![R]);
        let (r, _) = commit(&mut node, &mut env, 20, &good(&pages));
        assert_eq!(r, Err(CommitError::NotAwaitingCommit));
        assert!(env.running.is_empty());
    }

    fn assert_fails(
        tokens: u32,
        pages: Vec<PageCommit>,
        env_edit: impl Fn(&mut FakeDecode),
        want: CommitError,
    ) {
        let (mut node, mut env, _) = reserved();
        env_edit(&mut env);
        let (r, out) = commit(&mut node, &mut env, tokens, &pages);
        assert_eq!(r, Err(want.clone()));
        assert_eq!(
            reply(&out),
            &Msg::CommitFailed {
                req: R,
                reason: want.clone()
            }
        );
        assert!(env.running.is_empty(), "nothing admitted");
        assert_eq!(env.released, vec![R], "reserved pages freed");
        assert_eq!(
            node.records().state(R),
            Some(&DecodeState::CommitFailed(want))
        );
    }

    #[test]
    fn short_commits_fail() {
        let (_, _, pages) = reserved();
        // The incident: a one-token placeholder, one page.
        assert_fails(
            1,
            good(&pages[..1]),
            |_| {},
            CommitError::TokenCount {
                expected: 20,
                got: 1,
            },
        );
        assert_fails(
            20,
            good(&pages[..1]),
            |_| {},
            CommitError::PageCount {
                expected: 2,
                got: 1,
            },
        );
    }

    #[test]
    fn corrupt_commit_fails() {
        let (_, _, pages) = reserved();
        assert_fails(
            20,
            good(&pages),
            |env| env.land(11, 999),
            CommitError::ChecksumMismatch {
                page: 11,
                expected: 101,
                got: 999,
            },
        );
    }

    #[test]
    fn duplicate_and_foreign_pages_fail() {
        let (_, _, pages) = reserved();
        let twice = vec![good(&pages)[0], good(&pages)[0]];
        assert_fails(20, twice, |_| {}, CommitError::DuplicatePage { page: 10 });
        let mut foreign = good(&pages);
        foreign[1].dest.page = 3;
        assert_fails(20, foreign, |_| {}, CommitError::UnexpectedPage { page: 3 });
    }

    #[test]
    fn wrong_tag_fails() {
        let (_, _, pages) = reserved();
        let mut wrong = good(&pages);
        wrong[0].dest.tag.tenant = 4;
        assert_fails(20, wrong, |_| {}, CommitError::TagMismatch { page: 10 });
        // The page was freed and reused meanwhile (epoch bumped): the tag no longer validates.
        assert_fails(
            20,
            good(&pages),
            |env| env.pages.get_mut(&11).unwrap().0.epoch += 1,
            CommitError::TagMismatch { page: 11 },
        );
    }

    #[test]
    fn unknown_commit_changes_nothing() {
        let mut node = DecodeNode::new();
        let mut env = FakeDecode::new();
        let (r, out) = commit(&mut node, &mut env, 20, &[]);
        assert_eq!(r, Err(CommitError::UnknownRequest));
        assert_eq!(
            reply(&out),
            &Msg::CommitFailed {
                req: R,
                reason: CommitError::UnknownRequest
            }
        );
        assert_eq!(node.records().state(R), None);
        assert!(env.released.is_empty() && env.running.is_empty());
    }

    #[test]
    fn late_commit_after_abort_is_ignored() {
        let (mut node, mut env, pages) = reserved();
        let mut out = Vec::new();
        node.on_abort(R, &mut env, &mut out);
        assert_eq!(
            reply(&out),
            &Msg::AbortAck {
                req: R,
                from: Role::Decode
            }
        );
        assert_eq!(env.released, vec![R]);
        let (r, _) = commit(&mut node, &mut env, 20, &good(&pages));
        assert_eq!(r, Err(CommitError::NotAwaitingCommit));
        assert!(env.running.is_empty());
        // Even a verifying path would refuse: the freed pages' epochs moved on.
        assert_eq!(env.landed_checksum(R, pages[0]), None);
        // A late Prealloc after the abort reserves nothing.
        let mut out = Vec::new();
        node.on_prealloc(R, 3, 20, 4, &mut env, &mut out);
        assert!(out.is_empty());
        assert_eq!(env.free, 2, "one reservation only");
    }

    #[test]
    fn refused_prealloc_is_terminal() {
        let mut node = DecodeNode::new();
        let mut env = FakeDecode::new();
        let mut out = Vec::new();
        node.on_prealloc(R, 3, 200, 4, &mut env, &mut out);
        assert!(matches!(
            reply(&out),
            Msg::Rejected {
                by: Role::Decode,
                reason: Refusal {
                    kind: RefusalKind::Busy,
                    ..
                },
                ..
            }
        ));
        // Even once pages would fit, a duplicate is answered with the same refusal.
        env.free = 100;
        let mut again = Vec::new();
        node.on_prealloc(R, 3, 200, 4, &mut env, &mut again);
        assert_eq!(again, out);
        assert_eq!(env.free, 100);
    }

    fn prealloc(node: &mut DecodeNode, env: &mut FakeDecode, req: u64, prompt: u32) -> Vec<Output> {
        let mut out = Vec::new();
        node.on_prealloc(ReqId(req), 3, prompt, 4, env, &mut out);
        out
    }

    #[test]
    fn a_request_that_does_not_fit_now_waits_in_fifo_order_for_pages() {
        let mut node = DecodeNode::new();
        let mut env = FakeDecode::new();
        env.wait_when_full = true;
        // 3 of the 4 pages.
        assert!(matches!(
            reply(&prealloc(&mut node, &mut env, 1, 40)),
            Msg::Descriptor { .. }
        ));
        // 2 pages needed: waits, answers nothing yet.
        assert!(prealloc(&mut node, &mut env, 2, 20).is_empty());
        // 1 page would fit, but it may not overtake request 2.
        assert!(prealloc(&mut node, &mut env, 3, 1).is_empty());
        assert_eq!(node.waiting().collect::<Vec<_>>(), [ReqId(2), ReqId(3)]);
        // A duplicate Prealloc of a waiting request changes nothing.
        assert!(prealloc(&mut node, &mut env, 2, 20).is_empty());
        assert_eq!(node.waiting().count(), 2);
        // Nothing freed: capacity offers change nothing.
        let mut out = Vec::new();
        node.on_capacity(&mut env, &mut out);
        assert!(out.is_empty());
        // Request 1 is aborted: its pages go back, both waiting requests get theirs,
        // oldest first.
        node.on_abort(ReqId(1), &mut env, &mut Vec::new());
        env.free += 3;
        node.on_capacity(&mut env, &mut out);
        let descs: Vec<ReqId> = out
            .iter()
            .map(|o| match o {
                Output::Send {
                    msg: Msg::Descriptor { req, .. },
                    ..
                } => *req,
                o => panic!("expected descriptors, got {o:?}"),
            })
            .collect();
        assert_eq!(descs, [ReqId(2), ReqId(3)]);
        assert_eq!(node.waiting().count(), 0);
    }

    #[test]
    fn an_aborted_waiting_request_leaves_the_queue_and_holds_nothing() {
        let mut node = DecodeNode::new();
        let mut env = FakeDecode::new();
        env.wait_when_full = true;
        prealloc(&mut node, &mut env, 1, 60);
        assert!(prealloc(&mut node, &mut env, 2, 20).is_empty());
        let mut out = Vec::new();
        node.on_abort(ReqId(2), &mut env, &mut out);
        assert!(matches!(
            reply(&out),
            Msg::AbortAck {
                from: Role::Decode,
                ..
            }
        ));
        assert_eq!(node.waiting().count(), 0);
        assert_eq!(node.records().state(ReqId(2)), Some(&DecodeState::Aborted));
        // A late Prealloc for it is ignored (tombstone).
        env.free = 100;
        assert!(prealloc(&mut node, &mut env, 2, 20).is_empty());
        assert!(!env.released.contains(&ReqId(2)), "it never held a page");
    }

    #[test]
    fn a_verified_commit_the_engine_will_not_run_fails_and_frees_its_pages() {
        let (mut node, mut env, pages) = reserved();
        env.fail_start = true;
        let (r, out) = commit(&mut node, &mut env, 20, &good(&pages));
        assert_eq!(r, Ok(()));
        assert!(matches!(
            reply(&out),
            Msg::Finished {
                outcome: DecodeOutcome::Failed {
                    reason: FailReason {
                        kind: FailKind::Internal,
                        ..
                    }
                },
                ..
            }
        ));
        assert_eq!(env.released, [R]);
        assert!(env.running.is_empty());
    }

    #[test]
    fn terminal_records_expire_after_their_ttl_and_live_ones_never() {
        let (mut node, mut env, _) = reserved();
        prealloc(&mut node, &mut env, 9, 200); // refused: terminal at t = 0
        assert_eq!(node.records_mut().expire(0, 1000), 0);
        // R becomes terminal at t = 500.
        assert_eq!(node.records_mut().expire(500, 1000), 0);
        node.on_abort(R, &mut env, &mut Vec::new());
        assert_eq!(node.records_mut().expire(1000, 1000), 1); // request 9
        assert!(node.records().state(ReqId(9)).is_none());
        assert_eq!(node.records_mut().expire(1499, 1000), 0);
        assert_eq!(node.records_mut().expire(1500, 1000), 1); // R
        assert!(node.records().is_empty());
        // A live record never expires.
        prealloc(&mut node, &mut env, 10, 1);
        assert_eq!(node.records_mut().expire(1_000_000, 1000), 0);
        assert_eq!(node.records().len(), 1);
    }

    #[test]
    fn a_draining_decode_node_refuses_new_and_waiting_requests_and_keeps_the_rest() {
        let mut node = DecodeNode::new();
        let mut env = FakeDecode::new();
        env.wait_when_full = true;
        // 1 holds 3 of the 4 pages; 2 waits for pages.
        assert!(matches!(
            reply(&prealloc(&mut node, &mut env, 1, 40)),
            Msg::Descriptor { .. }
        ));
        assert!(prealloc(&mut node, &mut env, 2, 20).is_empty());
        let mut out = Vec::new();
        node.begin_drain(&mut out);
        assert!(node.is_draining());
        // The waiting request holds nothing: refused now, so it starts elsewhere.
        let drained = Msg::Rejected {
            req: ReqId(2),
            by: Role::Decode,
            reason: Refusal::draining(Role::Decode),
        };
        assert_eq!(reply(&out), &drained);
        assert_eq!(node.waiting().count(), 0);
        // A new request, even one that would fit, is refused before admission.
        let out = prealloc(&mut node, &mut env, 3, 1);
        let Msg::Rejected { by, reason, .. } = reply(&out) else {
            panic!("{out:?}");
        };
        assert_eq!((*by, reason.kind), (Role::Decode, RefusalKind::Busy));
        assert_eq!(reason.drained_by(), Some(Role::Decode));
        assert_eq!(env.free, 1, "nothing reserved for a refused request");
        // The reserved request is untouched: its duplicate gets its descriptor again,
        // and freed pages are offered to nobody.
        assert!(matches!(
            reply(&prealloc(&mut node, &mut env, 1, 40)),
            Msg::Descriptor { .. }
        ));
        node.on_abort(ReqId(1), &mut env, &mut Vec::new());
        env.free += 3;
        let mut out = Vec::new();
        node.on_capacity(&mut env, &mut out);
        assert!(out.is_empty(), "{out:?}");
        // Only a drain refusal says it is one.
        let busy = Refusal {
            kind: RefusalKind::Busy,
            message: "no pages".into(),
        };
        assert_eq!(busy.drained_by(), None);
        assert_eq!(
            Refusal::draining(Role::Prefill).drained_by(),
            Some(Role::Prefill)
        );
    }

    #[test]
    fn a_quarantine_for_a_lost_coordinator_asks_the_writer_until_it_answers() {
        let (mut node, mut env, _) = reserved();
        let mut out = Vec::new();
        node.on_coordinator_lost(R, &mut env, &mut out);
        let query = [Output::Send {
            to: Role::Prefill,
            msg: Msg::QuietQuery { req: R },
        }];
        assert_eq!(out, query);
        assert_eq!(
            node.records().state(R),
            Some(&DecodeState::Quarantined(Quarantine::CoordinatorLost))
        );
        // The retry timer asks again, and frees nothing: only the answer does.
        for _ in 0..3 {
            let mut again = Vec::new();
            node.ask_writers(&mut env, &mut again);
            assert_eq!(again, query);
        }
        assert!(env.released.is_empty());
        node.on_writer_quiet(R, &mut env, &mut Vec::new());
        assert_eq!(env.released, [R]);
        assert_eq!(node.records().state(R), Some(&DecodeState::Aborted));
        let mut none = Vec::new();
        node.ask_writers(&mut env, &mut none);
        node.ask_writer(R, &mut env, &mut none);
        assert!(none.is_empty(), "{none:?}");
    }

    #[test]
    fn a_lease_quarantine_whose_coordinator_is_lost_asks_the_writer() {
        let (mut node, mut env, _) = reserved();
        let mut out = Vec::new();
        node.on_lease_expired(R, &mut env, &mut out);
        assert_eq!(reply(&out), &Msg::LeaseExpired { req: R });
        // The coordinator would have quieted the prefill side; it is gone now.
        let mut out = Vec::new();
        node.on_coordinator_lost(R, &mut env, &mut out);
        assert_eq!(
            out,
            [Output::Send {
                to: Role::Prefill,
                msg: Msg::QuietQuery { req: R },
            }]
        );
        assert!(env.released.is_empty());
        // Only a reservation quarantined for a lost coordinator is asked about.
        let (mut live, mut env2, _) = reserved();
        let mut none = Vec::new();
        live.ask_writers(&mut env2, &mut none);
        assert!(none.is_empty());
    }

    #[test]
    fn the_writer_answers_a_quiet_query_once_it_will_write_nothing() {
        let quiet = |out: &[Output]| {
            out == [Output::Send {
                to: Role::Decode,
                msg: Msg::WriterQuiet { req: R },
            }]
        };
        // Never heard of the request: quiet at once, and a late Prefill is failed,
        // never computed.
        let mut node = PrefillNode::new();
        let mut env = FakePrefill {
            room: true,
            ..Default::default()
        };
        let mut out = Vec::new();
        node.on_msg(Msg::QuietQuery { req: R }, &mut env, &mut out);
        assert!(quiet(&out), "{out:?}");
        let mut late = Vec::new();
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut late);
        assert!(
            matches!(
                late.as_slice(),
                [Output::Send {
                    to: Role::Coordinator,
                    msg: Msg::PrefillFailed { .. }
                }]
            ),
            "{late:?}"
        );
        assert!(env.calls.is_empty(), "{:?}", env.calls);

        // Computing: no answer while its coordinator drives it; once the coordinator
        // is gone, quiet after the drain, and at once when asked again.
        let mut node = PrefillNode::new();
        let mut env = FakePrefill {
            room: true,
            ..Default::default()
        };
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut Vec::new());
        let mut out = Vec::new();
        node.on_quiet_query(R, &mut out);
        assert!(out.is_empty(), "{out:?}");
        node.on_coordinator_lost(R, &mut env, &mut out);
        node.on_quiet_query(R, &mut out);
        assert!(out.is_empty(), "no answer before the drain: {out:?}");
        node.on_drained(R, Ok(()), &mut env, &mut out);
        assert!(quiet(&out), "{out:?}");
        let mut again = Vec::new();
        node.on_quiet_query(R, &mut again);
        assert!(quiet(&again), "{again:?}");
    }

    /// A prefill environment that records the calls the protocol makes.
    #[derive(Default)]
    struct FakePrefill {
        calls: Vec<String>,
        room: bool,
    }

    impl PrefillEnv for FakePrefill {
        fn pages_for(&self, tokens: u32) -> usize {
            tokens.div_ceil(16) as usize
        }
        fn admit_and_alloc(&mut self, _: ReqId, _: u64, p: u32, _: u32) -> Result<(), Refusal> {
            self.calls.push(format!("admit {p}"));
            if self.room {
                Ok(())
            } else {
                Err(Refusal {
                    kind: RefusalKind::TooLarge,
                    message: "prompt over pool".into(),
                })
            }
        }
        fn start_prefill(&mut self, _: ReqId, tokens: u32, dest: &[DestPage]) {
            self.calls.push(format!("start {tokens} {}", dest.len()));
        }
        fn stop_prefill(&mut self, _: ReqId) {
            self.calls.push("stop".into());
        }
        fn flush(&mut self, _: ReqId) {
            self.calls.push("flush".into());
        }
        fn release(&mut self, _: ReqId) {
            self.calls.push("release".into());
        }
    }

    /// A coordinator that has its descriptor (two pages) and sent `Prefill`.
    fn transferring() -> (Coordinator, Vec<Output>) {
        let mut out = Vec::new();
        let mut c = Coordinator::start(R, 3, 20, 4, &mut out);
        c.on_msg(
            Msg::Descriptor {
                req: R,
                pages: dests(2),
            },
            &mut out,
        );
        (c, out)
    }

    fn dests(n: u32) -> Vec<DestPage> {
        (0..n)
            .map(|b| DestPage {
                page: 10 + b,
                tag: tag(1, b),
            })
            .collect()
    }

    #[test]
    fn prefill_commits_only_after_drain_and_release() {
        let mut node = PrefillNode::new();
        let mut env = FakePrefill {
            room: true,
            ..Default::default()
        };
        let mut out = Vec::new();
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut out);
        node.on_computed(R, 42, &[100, 101], &mut env, &mut out);
        assert!(out.is_empty(), "no commit before the drain");
        assert_eq!(env.calls, ["admit 20", "start 20 2", "flush"]);
        node.on_drained(R, Ok(()), &mut env, &mut out);
        assert_eq!(env.calls.last().unwrap(), "release");
        let [Output::Send {
            to: Role::Decode,
            msg:
                Msg::Commit {
                    tokens: 20,
                    pages,
                    first_token: 42,
                    ..
                },
        }] = out.as_slice()
        else {
            panic!("expected a commit, got {out:?}");
        };
        assert_eq!(pages, &good(&dests(2)));
        // A duplicated Prefill re-sends the commit and computes nothing.
        let mut again = Vec::new();
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut again);
        assert_eq!(again, out);
        assert_eq!(env.calls.len(), 4);
    }

    #[test]
    fn a_draining_prefill_node_refuses_new_requests_and_finishes_its_own() {
        let mut node = PrefillNode::new();
        let mut env = FakePrefill {
            room: true,
            ..Default::default()
        };
        let mut out = Vec::new();
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut out);
        node.begin_drain();
        assert!(node.is_draining());
        // A new request is refused before admission: nothing allocated.
        let other = ReqId(8);
        node.on_prefill(other, 3, 20, 4, dests(2), &mut env, &mut out);
        let refused = [Output::Send {
            to: Role::Coordinator,
            msg: Msg::Rejected {
                req: other,
                by: Role::Prefill,
                reason: Refusal::draining(Role::Prefill),
            },
        }];
        assert_eq!(out, refused);
        assert_eq!(env.calls, ["admit 20", "start 20 2"]);
        // Its duplicate gets the same refusal.
        let mut again = Vec::new();
        node.on_prefill(other, 3, 20, 4, dests(2), &mut env, &mut again);
        assert_eq!(again, refused);
        // The request it computes still commits.
        let mut out = Vec::new();
        node.on_computed(R, 42, &[100, 101], &mut env, &mut out);
        node.on_drained(R, Ok(()), &mut env, &mut out);
        assert!(
            matches!(
                out.as_slice(),
                [Output::Send {
                    to: Role::Decode,
                    msg: Msg::Commit { .. }
                }]
            ),
            "{out:?}"
        );
    }

    #[test]
    fn prefill_abort_acks_after_drain_and_leaves_tombstone() {
        let mut node = PrefillNode::new();
        let mut env = FakePrefill {
            room: true,
            ..Default::default()
        };
        let mut out = Vec::new();
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut out);
        node.on_abort(R, &mut env, &mut out);
        assert!(out.is_empty(), "no ack while writes may be in flight");
        node.on_computed(R, 42, &[1, 2], &mut env, &mut out); // late: ignored
        node.on_drained(R, Ok(()), &mut env, &mut out);
        assert_eq!(
            env.calls,
            ["admit 20", "start 20 2", "stop", "flush", "release"]
        );
        assert_eq!(
            out,
            [Output::Send {
                to: Role::Coordinator,
                msg: Msg::AbortAck {
                    req: R,
                    from: Role::Prefill
                }
            }]
        );
        // A late Prefill after the abort allocates nothing.
        let mut late = Vec::new();
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut late);
        assert!(late.is_empty());
        assert_eq!(env.calls.len(), 5);
        // Abort of an unknown request: acked at once, tombstone against a late Prefill.
        let other = ReqId(8);
        node.on_abort(other, &mut env, &mut late);
        assert_eq!(late.len(), 1);
        node.on_prefill(other, 3, 20, 4, dests(2), &mut env, &mut late);
        assert_eq!(env.calls.len(), 5);
    }

    #[test]
    fn prefill_refusal_is_terminal_and_bad_descriptor_fails() {
        let mut node = PrefillNode::new();
        let mut env = FakePrefill::default();
        let mut out = Vec::new();
        node.on_prefill(R, 3, 20, 4, dests(2), &mut env, &mut out);
        assert!(matches!(
            out.as_slice(),
            [Output::Send {
                to: Role::Coordinator,
                msg: Msg::Rejected {
                    by: Role::Prefill,
                    ..
                }
            }]
        ));
        assert_eq!(
            env.calls,
            ["admit 20"],
            "nothing started for a refused request"
        );
        let mut out = Vec::new();
        node.on_prefill(ReqId(9), 3, 20, 4, dests(1), &mut env, &mut out);
        assert!(matches!(
            out.as_slice(),
            [Output::Send {
                msg: Msg::PrefillFailed { .. },
                ..
            }]
        ));
        assert_eq!(
            env.calls.len(),
            1,
            "no admission for a malformed descriptor"
        );
    }

    fn sends(out: &[Output]) -> Vec<(Role, Msg)> {
        out.iter()
            .filter_map(|o| match o {
                Output::Send { to, msg } => Some((*to, msg.clone())),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn coordinator_happy_path() {
        let mut out = Vec::new();
        let mut c = Coordinator::start(R, 3, 20, 4, &mut out);
        assert!(matches!(
            sends(&out)[..],
            [(Role::Decode, Msg::Prealloc { .. })]
        ));
        out.clear();
        c.on_msg(
            Msg::Descriptor {
                req: R,
                pages: dests(2),
            },
            &mut out,
        );
        assert!(matches!(
            sends(&out)[..],
            [(Role::Prefill, Msg::Prefill { .. })]
        ));
        c.on_msg(Msg::Committed { req: R }, &mut out);
        assert_eq!(c.phase(), &CoordPhase::Decoding);
        out.clear();
        c.on_msg(
            Msg::Finished {
                req: R,
                outcome: DecodeOutcome::Completed,
            },
            &mut out,
        );
        assert_eq!(out, [Output::Outcome(Outcome::Succeeded), Output::Released]);
        c.on_client_gone(&mut out);
        assert_eq!(out.len(), 2, "a decided outcome never changes");
    }

    #[test]
    fn coordinator_aborts_prefill_before_decode() {
        let (mut c, mut out) = transferring();
        out.clear();
        c.on_client_gone(&mut out);
        assert_eq!(out[0], Output::Outcome(Outcome::Aborted));
        assert_eq!(sends(&out), [(Role::Prefill, Msg::Abort { req: R })]);
        out.clear();
        c.on_msg(
            Msg::AbortAck {
                req: R,
                from: Role::Decode,
            },
            &mut out,
        );
        assert!(out.is_empty(), "only the prefill ack moves on");
        c.on_msg(
            Msg::AbortAck {
                req: R,
                from: Role::Prefill,
            },
            &mut out,
        );
        assert_eq!(sends(&out), [(Role::Decode, Msg::Abort { req: R })]);
        out.clear();
        c.on_msg(
            Msg::AbortAck {
                req: R,
                from: Role::Decode,
            },
            &mut out,
        );
        assert_eq!(out, [Output::Released]);
    }

    #[test]
    fn coordinator_recovers_lost_replies() {
        let (mut c, mut out) = transferring();
        // `Committed` was lost: the timeout re-sends `Prefill` (prefill re-sends its
        // commit, decode its latest reply), and `Finished` alone completes the request.
        out.clear();
        c.on_timeout(&mut out);
        assert!(matches!(
            sends(&out)[..],
            [(Role::Prefill, Msg::Prefill { .. })]
        ));
        out.clear();
        c.on_msg(
            Msg::Finished {
                req: R,
                outcome: DecodeOutcome::Completed,
            },
            &mut out,
        );
        assert_eq!(out, [Output::Outcome(Outcome::Succeeded), Output::Released]);
    }

    #[test]
    fn coordinator_treats_a_dead_node_as_acked() {
        let (mut c, mut out) = transferring();
        out.clear();
        // Decode died mid-transfer: stop the prefill first, then nothing is left.
        c.on_node_down(Role::Decode, &mut out);
        assert_eq!(
            out[0],
            Output::Outcome(Outcome::Failed(Failure::NodeDown(Role::Decode)))
        );
        assert_eq!(sends(&out), [(Role::Prefill, Msg::Abort { req: R })]);
        out.clear();
        c.on_msg(
            Msg::AbortAck {
                req: R,
                from: Role::Prefill,
            },
            &mut out,
        );
        assert_eq!(out, [Output::Released]);

        // Prefill died mid-transfer: free the decode reservation at once.
        let (mut c, mut out) = transferring();
        out.clear();
        c.on_node_down(Role::Prefill, &mut out);
        assert_eq!(sends(&out), [(Role::Decode, Msg::Abort { req: R })]);
    }

    #[test]
    fn coordinator_rejection_is_terminal() {
        let mut out = Vec::new();
        let mut c = Coordinator::start(R, 3, 20, 4, &mut out);
        out.clear();
        let reason = Refusal {
            kind: RefusalKind::TooLarge,
            message: "prompt over pool".into(),
        };
        c.on_msg(
            Msg::Rejected {
                req: R,
                by: Role::Decode,
                reason: reason.clone(),
            },
            &mut out,
        );
        assert_eq!(
            out,
            [Output::Outcome(Outcome::Rejected(reason)), Output::Released]
        );
        out.clear();
        c.on_msg(
            Msg::Descriptor {
                req: R,
                pages: dests(2),
            },
            &mut out,
        );
        c.on_timeout(&mut out);
        assert!(out.is_empty(), "nothing is sent for a rejected request");
    }

    #[test]
    fn messages_round_trip_through_json() {
        let msgs = [
            Msg::Descriptor {
                req: R,
                pages: dests(2),
            },
            Msg::Commit {
                req: R,
                tokens: 20,
                pages: good(&dests(2)),
                first_token: 42,
            },
            Msg::Rejected {
                req: R,
                by: Role::Prefill,
                reason: Refusal {
                    kind: RefusalKind::TooLarge,
                    message: "x".into(),
                },
            },
            Msg::CommitFailed {
                req: R,
                reason: CommitError::ChecksumMismatch {
                    page: 1,
                    expected: 2,
                    got: 3,
                },
            },
        ];
        for m in msgs {
            let json = serde_json::to_string(&m).unwrap();
            let back: Msg = serde_json::from_str(&json).unwrap();
            assert_eq!(back, m, "{json}");
        }
    }

    /// A node link is believed only for what its role sends, and only about the
    /// requests routed to that very link: another link's request (even of a node of
    /// the same role) is `NotRouted`, a late duplicate from the request's own link
    /// after it ended is `Ended` until the route expires.
    #[test]
    fn a_route_book_believes_a_link_only_about_its_own_requests() {
        let mut b: RouteBook<u64> = RouteBook::default();
        let (a, other) = (ReqId(1), ReqId(2));
        b.route(a, Role::Decode, 10);
        b.route(a, Role::Prefill, 20);
        b.route(other, Role::Decode, 11);
        // A later link of the same role never takes a request over.
        b.route(a, Role::Decode, 12);
        let committed = |req| Msg::Committed { req };
        assert_eq!(b.check(10, Role::Decode, &committed(a)), Ok(Routed::Live));
        assert_eq!(b.check_event(10, a), Ok(Routed::Live));
        for (link, req) in [(11, a), (12, a), (10, other), (10, ReqId(3))] {
            assert_eq!(
                b.check(link, Role::Decode, &committed(req)),
                Err(LinkViolation::NotRouted),
                "link {link}, {req:?}"
            );
            assert_eq!(b.check_event(link, req), Err(LinkViolation::NotRouted));
        }
        // The prefill link of `a` is believed for what a prefill node sends only.
        let failed = Msg::PrefillFailed {
            req: a,
            reason: FailReason::new(FailKind::Internal, "x"),
        };
        assert_eq!(b.check(20, Role::Prefill, &failed), Ok(Routed::Live));
        assert_eq!(
            b.check(20, Role::Prefill, &committed(a)),
            Err(LinkViolation::WrongSender)
        );
        assert_eq!(
            b.check(20, Role::Prefill, &failed.clone()),
            Ok(Routed::Live)
        );
        assert_eq!(b.check_event(20, a), Err(LinkViolation::NotRouted));
        // A decode link cannot speak for the prefill node, nor as a coordinator.
        let ack = |from| Msg::AbortAck { req: a, from };
        assert_eq!(
            b.check(10, Role::Decode, &ack(Role::Prefill)),
            Err(LinkViolation::WrongSender)
        );
        assert_eq!(
            b.check(10, Role::Decode, &ack(Role::Decode)),
            Ok(Routed::Live)
        );
        for m in [
            Msg::Abort { req: a },
            Msg::Poll { req: a },
            Msg::Renew { req: a },
        ] {
            assert_eq!(
                b.check(10, Role::Decode, &m),
                Err(LinkViolation::WrongSender),
                "{m:?}"
            );
        }
        // Ended: its own link's late duplicates are dropped quietly until expiry.
        b.expire(1_000, 60_000);
        b.end(a);
        assert_eq!(b.check(10, Role::Decode, &committed(a)), Ok(Routed::Ended));
        assert_eq!(
            b.check(11, Role::Decode, &committed(a)),
            Err(LinkViolation::NotRouted)
        );
        b.route(a, Role::Decode, 11);
        assert_eq!(b.check_event(11, a), Err(LinkViolation::NotRouted));
        assert_eq!(b.expire(60_999, 60_000), 0);
        assert_eq!(b.expire(61_000, 60_000), 1);
        assert_eq!(
            b.check(10, Role::Decode, &committed(a)),
            Err(LinkViolation::NotRouted)
        );
        assert_eq!(b.live(), 1);
    }

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
