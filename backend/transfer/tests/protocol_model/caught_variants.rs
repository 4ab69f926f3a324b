//! The failing variants: each property is shown to bite by a deliberately broken
//! protocol (`Flaws`) for which the checker must find a counterexample.

use crate::configs::*;
use crate::model::{Action, Cfg};
use crate::properties::{S1, S2, S3, S4, S5};
use crate::run;
use stateright::{Checker, Model};
use std::time::Instant;
use tessera_transfer::protocol::{Flaws, Role};

/// Runs a deliberately broken variant and requires the checker to find a
/// counterexample to `property`; prints the shortest prefix that breaks it.
fn caught(cfg: Cfg, flaws: Flaws, property: &'static str) {
    let t = Instant::now();
    let checker = run(Cfg { flaws, ..cfg }, Some(property));
    let path = checker.discovery(property).unwrap_or_else(|| {
        panic!(
            "{flaws:?}: no counterexample to {property:?} in {} states",
            checker.unique_state_count()
        )
    });
    let model = checker.model();
    let prop = model
        .properties()
        .into_iter()
        .find(|p| p.name == property)
        .expect("property exists");
    let steps = path.into_vec();
    let first_bad = steps
        .iter()
        .position(|(st, _)| !(prop.condition)(model, st))
        .expect("the counterexample's last state violates the property");
    let actions: Vec<&Action> = steps[..first_bad]
        .iter()
        .filter_map(|(_, a)| a.as_ref())
        .collect();
    println!(
        "{property}: caught in {:.1?} after {} states, {} steps: {actions:?}",
        t.elapsed(),
        checker.unique_state_count(),
        actions.len()
    );
}

fn flaw(f: fn(&mut Flaws)) -> Flaws {
    let mut flaws = Flaws::default();
    f(&mut flaws);
    flaws
}

#[test]
fn s2_catches_freeing_at_once_when_the_coordinator_is_lost() {
    caught(
        coordinator_crash(),
        flaw(|f| f.decode_frees_on_coordinator_lost = true),
        S2,
    );
}

#[test]
fn s2_catches_freeing_at_once_when_the_lease_expires() {
    caught(
        lease_expiry(),
        flaw(|f| f.decode_frees_on_lease_expiry = true),
        S2,
    );
}

/// Decode trusts the commit without the I4 checks: a corrupted page is decoded (S1)
/// and the client gets a 200 (S4).
#[test]
fn s1_s4_catch_decode_skipping_commit_checks() {
    let mut c = two_requests();
    c.budget.corrupt_writes = 1;
    let f = flaw(|f| f.decode_skips_commit_checks = true);
    caught(c.clone(), f, S1);
    caught(c, f, S4);
}

/// Incident shape: prefill turns a refused request into a one-token placeholder and
/// decode trusts the (short) commit: decode reads stale pages of another tenant (S1).
#[test]
fn s1_s3_catch_placeholder_with_trusting_decode() {
    let f = flaw(|f| {
        f.prefill_placeholder_on_refusal = true;
        f.decode_skips_commit_checks = true;
    });
    caught(two_requests(), f, S3);
    caught(two_requests(), f, S1);
}

/// Decode admits a duplicated commit again, after the pages were freed (S1).
#[test]
fn s1_catches_duplicate_commit_admission() {
    let mut c = two_requests();
    c.budget.dups = 1;
    caught(c, flaw(|f| f.decode_accepts_duplicate_commit = true), S1);
}

/// The coordinator aborts both sides at once: decode frees pages a write still targets.
#[test]
fn s2_catches_abort_without_waiting_for_prefill_ack() {
    caught(
        two_requests(),
        flaw(|f| f.abort_decode_with_prefill = true),
        S2,
    );
}

/// Prefill releases its source pages and commits before the transport drained.
#[test]
fn s2_catches_commit_before_drain() {
    caught(
        two_requests(),
        flaw(|f| f.prefill_commits_before_drain = true),
        S2,
    );
}

/// Without an abort tombstone a late `Prefill` starts writing into freed pages.
#[test]
fn s2_catches_missing_abort_tombstone() {
    caught(
        two_requests(),
        flaw(|f| f.prefill_forgets_aborts = true),
        S2,
    );
}

/// The coordinator treats decode's refusal as "go on" (finished-vs-rejected).
#[test]
fn s3_catches_coordinator_proceeding_after_rejection() {
    caught(
        oversized(),
        flaw(|f| f.coordinator_proceeds_on_rejected = true),
        S3,
    );
}

/// The incident: a refused prompt rides on as a one-token placeholder and is transferred.
#[test]
fn s3_catches_placeholder_transfer() {
    caught(
        oversized(),
        flaw(|f| f.prefill_placeholder_on_refusal = true),
        S3,
    );
}

/// The coordinator reports success when the decode node dies mid-decode (200 on a
/// truncated answer).
#[test]
fn s4_catches_success_on_decode_crash() {
    let mut c = two_requests();
    c.budget.crashes = 1;
    c.crash_roles = vec![Role::Decode];
    caught(
        c,
        flaw(|f| f.coordinator_success_on_decode_crash = true),
        S4,
    );
}

/// Decode keeps the reserved pages after a failed commit.
#[test]
fn s5_catches_leak_on_commit_failure() {
    let mut c = two_requests();
    c.budget.corrupt_writes = 1;
    caught(c, flaw(|f| f.decode_leaks_on_commit_failed = true), S5);
}

/// A bounded quarantine: the decode node frees a reservation quarantined for a lost
/// coordinator when its retry timer fires, without the writer's answer, while the
/// writer's pages are still on their way (S2).
#[test]
fn s2_catches_a_quarantine_freed_on_a_timer() {
    caught(
        coordinator_crash(),
        flaw(|f| f.decode_frees_quarantine_unasked = true),
        S2,
    );
}

/// The writer answers `QuietQuery` while it still computes or drains the request.
#[test]
fn s2_catches_a_writer_answering_quiet_while_writing() {
    caught(
        coordinator_crash(),
        flaw(|f| f.prefill_quiet_while_writing = true),
        S2,
    );
}

/// The writer answers `QuietQuery` for a request it never heard of without keeping a
/// record: the coordinator's `Prefill`, still on its way, starts writing into pages
/// the decode node freed on that answer.
#[test]
fn s2_catches_a_writer_answering_quiet_without_a_record() {
    caught(
        coordinator_crash(),
        flaw(|f| f.prefill_quiet_without_record = true),
        S2,
    );
}
