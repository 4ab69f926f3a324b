//! Deliberate protocol breakages for the model checker's failing-variant tests
//! (`tests/protocol_model/`). Test builds only (`cfg(test)` or the `test-util`
//! feature): a production build has no `Flaws`, no constructor taking one, and
//! every `flaw!` check is `false`.

/// Deliberate protocol breakages for the model checker's failing-variant tests.
/// Test builds only; the machines' ordinary constructors leave every flaw off.
#[cfg(any(test, feature = "test-util"))]
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

/// `flaw!(machine, name)`: whether the deliberate flaw `name` is on for `machine`
/// (its `flaws` field).
#[cfg(any(test, feature = "test-util"))]
macro_rules! flaw {
    ($machine:expr, $name:ident) => {
        $machine.flaws.$name
    };
}

/// `flaw!(machine, name)`: always `false` (a production build has no flaws).
#[cfg(not(any(test, feature = "test-util")))]
macro_rules! flaw {
    ($machine:expr, $name:ident) => {
        false
    };
}

pub(super) use flaw;
