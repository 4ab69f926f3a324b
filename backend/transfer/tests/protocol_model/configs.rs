//! The model configurations: page size 4 tokens, decode pool 3 pages, prefill pool
//! 2 pages, two requests, and the faults each one enables.

use crate::model::{Budget, Cfg, ReqSpec};
use tessera_transfer::protocol::{Flaws, Role};

/// Two requests whose pools overlap: page size 4 tokens; decode pool 3 pages
/// (request 0: 5 + 2 tokens, 2 pages; request 1: 3 + 1 tokens, 1 page), prefill pool
/// 2 pages (request 0 needs 2, request 1 needs 1: whichever comes second is refused
/// while the other holds its pages, and freed pages are reused). Request 0 may be
/// aborted by its client at any point. No fault is enabled.
pub(crate) fn two_requests() -> Cfg {
    Cfg {
        page_size: 4,
        decode_pages: 3,
        prefill_pages: 2,
        reqs: vec![
            ReqSpec {
                tenant: 100,
                prompt: 5,
                max: 2,
                abortable: true,
            },
            ReqSpec {
                tenant: 200,
                prompt: 3,
                max: 1,
                abortable: false,
            },
        ],
        budget: Budget {
            losses: 0,
            dups: 0,
            corrupt_writes: 0,
            failed_writes: 0,
            aborts: 1,
            crashes: 0,
            coord_crashes: 0,
            lease_expiries: 0,
            drains: 0,
        },
        crash_roles: vec![],
        joint_detection: false,
        queue_when_busy: false,
        writer_lost_notices: false,
        flaws: Flaws::default(),
        expect_all_succeed: true,
        expect_rejection: true,
        expect_commit_failure: false,
    }
}

/// [`two_requests`] where one control message may be lost and one duplicated.
pub(crate) fn lossy() -> Cfg {
    let mut c = two_requests();
    c.budget.losses = 1;
    c.budget.dups = 1;
    c
}

/// [`two_requests`] where the prefill or the decode node may crash once.
pub(crate) fn crashing() -> Cfg {
    let mut c = two_requests();
    c.budget.crashes = 1;
    c.crash_roles = vec![Role::Prefill, Role::Decode];
    c
}

/// The configuration: two requests, one client abort, reordering, one lost
/// and one duplicated control message, and a crash of either node at any point.
pub(crate) fn everything() -> Cfg {
    let mut c = lossy();
    c.budget.crashes = 1;
    c.crash_roles = vec![Role::Prefill, Role::Decode];
    c
}

/// [`two_requests`] where one page write may land corrupted and one may fail.
pub(crate) fn faulty_writes() -> Cfg {
    let mut c = two_requests();
    c.budget.corrupt_writes = 1;
    c.budget.failed_writes = 1;
    c.expect_commit_failure = true;
    c
}

/// The incident's shape: request 1's prompt (9 tokens, 3 pages) is over the prefill
/// pool (2 pages) but fits the decode pool (3 pages), so decode reserves and prefill
/// refuses it for size; request 0 (1 page) competes with it for decode pages, so
/// decode may refuse one of them (pool busy).
pub(crate) fn oversized() -> Cfg {
    let mut c = two_requests();
    c.reqs[0].prompt = 3;
    c.reqs[0].max = 1;
    c.reqs[1].prompt = 9;
    c.reqs[1].max = 2;
    c.expect_all_succeed = false;
    c
}

/// [`two_requests`] with a decode pool of 2 pages, which holds either request but not
/// both: the second waits in the decode node's FIFO (no busy refusal) until the first
/// one's pages are freed, and both must still complete. With one lost and one
/// duplicated message and a crash of either node.
pub(crate) fn queued() -> Cfg {
    let mut c = two_requests();
    c.decode_pages = 2;
    c.queue_when_busy = true;
    // Nothing is refused: the decode node waits instead of answering busy.
    c.expect_rejection = false;
    c.budget.losses = 1;
    c.budget.dups = 1;
    c
}

/// [`two_requests`] where the gateway process may crash at any point (every
/// coordinator gone, each node told per request, in any order, while page writes may
/// still be in flight and land late) and the prefill node may crash too (the decode
/// node then hears that the writer is gone).
pub(crate) fn coordinator_crash() -> Cfg {
    let mut c = two_requests();
    c.budget.aborts = 0;
    c.budget.coord_crashes = 1;
    c.budget.crashes = 1;
    c.crash_roles = vec![Role::Prefill];
    c.writer_lost_notices = true;
    c.expect_all_succeed = false;
    c
}

/// [`coordinator_crash`] where one control message may be lost (the decode node's
/// `QuietQuery` or the writer's `WriterQuiet` among them) and a
/// reservation's lease may run out before its commit; the prefill node does not
/// crash, so only its answers end quarantines.
pub(crate) fn coordinator_crash_lossy() -> Cfg {
    let mut c = coordinator_crash();
    c.budget.crashes = 0;
    c.crash_roles = vec![];
    c.budget.losses = 1;
    c.budget.lease_expiries = 1;
    c
}

/// [`two_requests`] where a decode reservation's lease may run out before its commit
/// (a slow or stuck prefill), and a client may abort.
pub(crate) fn lease_expiry() -> Cfg {
    let mut c = two_requests();
    c.budget.lease_expiries = 1;
    c
}

/// [`queued`] (the second request waits for decode pages; one lost and one
/// duplicated message) where either node may begin draining at any point: a drain
/// refuses new requests and, at the decode node, the waiting one.
pub(crate) fn draining() -> Cfg {
    let mut c = queued();
    c.budget.drains = 2;
    // Drain refusals are rejections.
    c.expect_rejection = true;
    c
}
