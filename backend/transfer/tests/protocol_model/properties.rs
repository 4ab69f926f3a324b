//! The properties checked in every reachable state (S1-S5 of DESIGN.md §6, and the
//! links' sender checks) and the outcomes each configuration must be able to reach.

use crate::env::reads_own_pages;
use crate::model::{nothing_held, Cfg, PdModel, PdState};
use stateright::Property;
use tessera_transfer::protocol::{Coordinator, DecodeState, Outcome, Quarantine, Role};

pub(crate) const S1: &str = "S1 decode reads only its sequence's pages";
pub(crate) const S2: &str = "S2 no page freed while a write can land";
pub(crate) const S3: &str = "S3 a rejected request never reaches transfer";
pub(crate) const S4: &str = "S4 exactly one terminal outcome, success only when verified";
pub(crate) const S5: &str = "S5 every page free at quiescence";
pub(crate) const LINKS: &str = "every message passes its receiver's sender check";

/// Every property of a model of `cfg`.
pub(crate) fn of(cfg: &Cfg) -> Vec<Property<PdModel>> {
    let mut p = vec![
        Property::always(S1, |_, st: &PdState| {
            st.decode.as_ref().is_none_or(|(_, pool)| {
                pool.running
                    .iter()
                    .all(|(req, pages)| reads_own_pages(pool, *req, pages))
            })
        }),
        Property::always(S2, |_, st: &PdState| {
            st.writes.iter().all(|w| {
                let src_held = st
                    .prefill
                    .as_ref()
                    .is_none_or(|(_, p)| p.pages[w.src as usize].held == Some(w.req));
                let dest_held = st.decode.as_ref().is_none_or(|(_, d)| {
                    let page = &d.pages[w.dest.page as usize];
                    page.held == Some(w.req) && page.tag == w.dest.tag
                });
                src_held && dest_held
            })
        }),
        Property::always(S3, |_, st: &PdState| {
            st.ghost.iter().all(|g| {
                let transferred = g.wrote || g.commit_sent;
                !(g.refused_by_decode && (g.prefill_sent || transferred))
                    && !(g.refused_by_prefill && transferred)
            })
        }),
        Property::always(S4, |_, st: &PdState| {
            let each = st.ghost.iter().all(|g| {
                g.outcomes.len() <= 1
                    && (!g.outcomes.contains(&Outcome::Succeeded)
                        || (g.admitted_ok && !g.admitted_bad && g.finished_ok))
            });
            let all_done = st.coords.iter().all(Coordinator::is_done);
            each && (!all_done || st.ghost.iter().all(|g| g.outcomes.len() == 1))
        }),
        Property::always(S5, |_, st: &PdState| {
            let idle_prefill = st
                .prefill
                .as_ref()
                .is_none_or(|(_, p)| p.computing.is_empty() && p.flushing.is_empty());
            // A reservation quarantined for a lost coordinator keeps its decode
            // node's retry timer going (it asks the writer until it answers):
            // not quiescent. `every_quarantine_ends` shows that each one ends.
            let asking = st.decode.as_ref().is_some_and(|(d, _)| {
                d.records()
                    .states()
                    .any(|(_, s)| *s == DecodeState::Quarantined(Quarantine::CoordinatorLost))
            });
            let quiescent = st.net.is_empty()
                && st.writes.is_empty()
                && st.notices.is_empty()
                && !asking
                && (st.coords.iter().all(Coordinator::is_done)
                    || (!st.coord_alive && idle_prefill));
            let prefill_free = st.prefill.as_ref().is_none_or(|(_, p)| {
                p.pages.iter().all(|pg| pg.held.is_none())
                    && p.computing.is_empty()
                    && p.flushing.is_empty()
            });
            let decode_free = st.decode.as_ref().is_none_or(|(_, d)| {
                d.pages.iter().all(|pg| pg.held.is_none()) && d.running.is_empty()
            });
            !quiescent || (prefill_free && decode_free)
        }),
        Property::always(LINKS, |_, st: &PdState| {
            st.ghost.iter().all(|g| !g.unsendable)
        }),
        Property::sometimes("a request succeeds", |_, st: &PdState| {
            st.ghost
                .iter()
                .any(|g| g.outcomes.contains(&Outcome::Succeeded))
        }),
    ];
    if cfg.expect_all_succeed {
        p.push(Property::sometimes(
            "both requests succeed",
            |_, st: &PdState| {
                st.ghost
                    .iter()
                    .all(|g| g.outcomes.contains(&Outcome::Succeeded))
            },
        ));
    }
    if cfg.budget.aborts > 0 {
        p.push(Property::sometimes(
            "the client aborts mid-transfer",
            |_, st: &PdState| {
                st.ghost
                    .iter()
                    .any(|g| g.outcomes.contains(&Outcome::Aborted) && g.wrote && !g.commit_sent)
            },
        ));
    }
    if cfg.expect_rejection {
        p.push(Property::sometimes(
            "a request is rejected",
            |_, st: &PdState| {
                st.ghost
                    .iter()
                    .any(|g| matches!(g.outcomes.first(), Some(Outcome::Rejected(_))))
            },
        ));
    }
    if cfg.queue_when_busy {
        p.push(Property::sometimes(
            "a request waits for decode pages, then is reserved",
            |_, st: &PdState| {
                st.decode.as_ref().is_some_and(|(d, _)| {
                    d.waiting().count() == 1
                        && d.records()
                            .states()
                            .any(|(_, s)| matches!(s, DecodeState::Reserved { .. }))
                })
            },
        ));
    }
    if cfg.budget.coord_crashes + cfg.budget.lease_expiries > 0 {
        p.push(Property::sometimes(
            "a reservation is quarantined while a write is in flight",
            |_, st: &PdState| {
                st.decode.as_ref().is_some_and(|(d, _)| {
                    d.records().states().any(|(req, s)| {
                        matches!(s, DecodeState::Quarantined(_))
                            && st.writes.iter().any(|w| w.req == req)
                    })
                })
            },
        ));
    }
    if cfg.budget.coord_crashes > 0 {
        p.push(Property::sometimes(
            "a reservation whose writer never heard of it is freed on the writer's answer",
            |_, st: &PdState| {
                !st.coord_alive
                    && st.ghost.iter().any(|g| g.asked_unheard && !g.prefill_sent)
                    && nothing_held(st)
            },
        ));
    }
    if cfg.budget.drains > 0 {
        p.push(Property::sometimes(
            "a draining decode node refuses a request that waited for pages",
            |_, st: &PdState| {
                st.ghost.iter().any(|g| {
                    g.drained_while_waiting
                        && matches!(g.outcomes.first(), Some(Outcome::Rejected(r))
                            if r.drained_by() == Some(Role::Decode))
                })
            },
        ));
        p.push(Property::sometimes(
            "a draining prefill node refuses a request",
            |_, st: &PdState| {
                st.prefill.as_ref().is_some_and(|(p, _)| {
                    p.records().states().any(|(_, s)| {
                        matches!(s, tessera_transfer::protocol::PrefillState::Refused(r)
                            if r.drained_by() == Some(Role::Prefill))
                    })
                })
            },
        ));
    }
    if cfg.expect_commit_failure {
        p.push(Property::sometimes(
            "a commit fails verification",
            |_, st: &PdState| {
                st.decode.as_ref().is_some_and(|(d, _)| {
                    d.records()
                        .states()
                        .any(|(_, s)| matches!(s, DecodeState::CommitFailed(_)))
                })
            },
        ));
    }
    if !cfg.crash_roles.is_empty() {
        p.push(Property::sometimes(
            "a crash is survived",
            |_, st: &PdState| {
                (st.prefill.is_none() || st.decode.is_none())
                    && st.coords.iter().all(Coordinator::is_done)
                    && st.net.is_empty()
            },
        ));
    }
    p
}
