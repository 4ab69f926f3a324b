//! Liveness: from every reachable state (faults included), progress steps alone
//! reach a state where every request is finished, and one where no reservation is
//! quarantined.

use crate::configs::*;
use crate::model::{nothing_held, Action, Cfg, PdModel, PdState};
use stateright::Model;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::time::Instant;
use tessera_transfer::protocol::{Coordinator, DecodeState};

/// The goal of [`every_request_can_finish`]: every coordinator is done, or, once the
/// coordinators are gone (their process crashed), nothing is held or in flight
/// anywhere.
const FINISHED: Goal = ("a request can never finish", |st| {
    st.coords.iter().all(Coordinator::is_done) || (!st.coord_alive && nothing_held(st))
});

/// The goal of [`every_quarantine_ends`]: the decode node (if alive) holds no
/// quarantined reservation.
const NO_QUARANTINE: Goal = ("a quarantine never ends", |st| {
    st.decode.as_ref().is_none_or(|(d, _)| {
        !d.records()
            .states()
            .any(|(_, s)| matches!(s, DecodeState::Quarantined(_)))
    })
});

/// What a liveness check wants reachable, and how its failure reads.
type Goal = (&'static str, fn(&PdState) -> bool);

/// Liveness under fair scheduling: from every reachable state (faults included), a
/// state where every coordinator is done is reachable by progress steps alone (no
/// further fault, abort or crash). With finitely many states this rules out a request
/// stuck forever (a deadlock or a retransmission livelock).
fn every_request_can_finish(name: &str, cfg: Cfg) {
    always_reachable(name, cfg, &[FINISHED]);
}

/// Every quarantine ends: from every reachable state, a state where the decode node
/// holds no quarantined reservation is reachable by progress steps alone. A
/// quarantine never ends on a timer (S2 forbids it while a write can land): this
/// shows that the writer's answer, a commit, the coordinator's abort or the writer's
/// link closing always comes, also when the writer never heard of the request.
/// Checked with [`every_request_can_finish`]'s goal in the same pass.
fn every_quarantine_ends(name: &str, cfg: Cfg) {
    always_reachable(name, cfg, &[NO_QUARANTINE, FINISHED]);
}

/// For each goal: from every reachable state (faults included) a state where it
/// holds is reachable by progress steps alone (no further fault, abort or crash);
/// otherwise prints the shortest path to the first state that cannot reach it and
/// fails. One exploration for all goals.
fn always_reachable(name: &str, cfg: Cfg, goals: &[Goal]) {
    use std::collections::{HashMap, VecDeque};
    let t = Instant::now();
    let model = PdModel { cfg };
    let fp = |st: &PdState| {
        let mut h = DefaultHasher::new();
        st.hash(&mut h);
        h.finish()
    };
    let mut ids: HashMap<u64, u32> = HashMap::new();
    let mut preds: Vec<Vec<u32>> = Vec::new();
    // Per state, a bit per goal that holds there.
    let mut holds: Vec<u8> = Vec::new();
    let mut parent: Vec<Option<(u32, Action)>> = Vec::new();
    let mut queue = VecDeque::new();
    assert!(goals.len() <= 8);
    for st in model.init_states() {
        ids.insert(fp(&st), 0);
        preds.push(Vec::new());
        holds.push(0);
        parent.push(None);
        queue.push_back((0u32, st));
    }
    let mut acts = Vec::new();
    while let Some((id, st)) = queue.pop_front() {
        holds[id as usize] = goals
            .iter()
            .enumerate()
            .filter(|(_, (_, g))| g(&st))
            .fold(0, |bits, (i, _)| bits | 1 << i);
        acts.clear();
        model.actions(&st, &mut acts);
        for a in acts.drain(..) {
            let progress = !a.is_fault();
            let Some(next) = model.next_state(&st, a.clone()) else {
                continue;
            };
            let n = ids.len() as u32;
            let nid = *ids.entry(fp(&next)).or_insert_with(|| {
                preds.push(Vec::new());
                holds.push(0);
                parent.push(Some((id, a.clone())));
                queue.push_back((n, next));
                n
            });
            if progress {
                preds[nid as usize].push(id);
            }
        }
    }
    let mut failed = Vec::new();
    for (i, (what, _)) in goals.iter().enumerate() {
        let mut can: Vec<bool> = holds.iter().map(|h| h & 1 << i != 0).collect();
        let mut stack: Vec<u32> = (0..can.len() as u32).filter(|&i| can[i as usize]).collect();
        while let Some(n) = stack.pop() {
            for &p in &preds[n as usize] {
                if !can[p as usize] {
                    can[p as usize] = true;
                    stack.push(p);
                }
            }
        }
        let stuck = can.iter().filter(|c| !**c).count();
        if let Some(bad) = can.iter().position(|c| !*c) {
            // Replay the shortest path to the first such state, for the failure message.
            let mut path = Vec::new();
            let mut at = bad as u32;
            while let Some((p, a)) = &parent[at as usize] {
                path.push(a.clone());
                at = *p;
            }
            path.reverse();
            let mut st = model.init_states().remove(0);
            for a in &path {
                st = model.next_state(&st, a.clone()).expect("replay");
            }
            println!("{name}: stuck after {path:?}\n{st:#?}");
            failed.push(format!("{stuck} states from which {what}"));
        }
        println!(
            "{name}: {} states, {stuck} from which {what}, {:.1?}",
            can.len(),
            t.elapsed()
        );
    }
    assert!(failed.is_empty(), "{name}: {}", failed.join("; "));
}

#[test]
fn every_request_can_finish_despite_faults() {
    every_request_can_finish("abort+reorder", two_requests());
    every_request_can_finish("loss+dup", lossy());
    every_request_can_finish("crash", crashing());
    every_request_can_finish("write faults", faulty_writes());
    every_request_can_finish("oversized", oversized());
    every_request_can_finish("queued", queued());
    every_request_can_finish("coordinator crash", coordinator_crash());
    every_request_can_finish("lease expiry", lease_expiry());
    every_request_can_finish("draining", draining());
}

/// The issue's configuration, with coordinators learning of the crash together (the
/// per-coordinator schedules are covered by `crashing()` above; together they would
/// take too long for the test suite).
#[test]
fn every_request_can_finish_in_the_issue_configuration() {
    let mut c = everything();
    c.joint_detection = true;
    every_request_can_finish("abort+loss+dup+crash, joint detection", c);
}

/// Every quarantine ends, by progress alone: after a gateway crash (also before the
/// prefill node heard of the request, also with a lost query or answer, also when
/// the lease ran out first) and after a lease expiry.
#[test]
fn every_quarantine_ends_despite_faults() {
    every_quarantine_ends("coordinator crash", coordinator_crash());
    every_quarantine_ends("coordinator crash, lossy", coordinator_crash_lossy());
    every_quarantine_ends("lease expiry", lease_expiry());
}
