//! Where each of an engine's sequences stands: one record per sequence, its stage an
//! enum (vLLM's one `Request` per request with its status), all in one list.
//!
//! The list's order is the order in which sequences entered their current stage:
//! waiting ones in arrival order (first come, first served within a tenant), running
//! ones in admission order (the scheduler plans over them in that order, and its
//! `Work::seq` indices count running sequences only, [`Sequences::running_slots`]).

use super::{Parked, Seq, Waiting};
use std::collections::HashMap;
use tessera_model::kv::SeqId;

/// A sequence's stage in its engine, holding what the sequence needs there.
pub(crate) enum Stage {
    /// Admitted and queued for the running batch; holds no pages. (Both large
    /// stages are boxed: a transition moves a pointer, and the list stays small.)
    Waiting(Box<Waiting>),
    /// In the running batch with all its pages reserved.
    Running(Box<Seq>),
    /// Prefill role: its compute ended; its pages are held for export until
    /// [`Engine::release_prefill`](super::Engine::release_prefill).
    Parked(Parked),
}

impl Stage {
    /// The sequence's id (unique in its engine).
    pub(crate) fn id(&self) -> SeqId {
        match self {
            Stage::Waiting(w) => w.id,
            Stage::Running(s) => s.id,
            Stage::Parked(p) => p.id,
        }
    }
}

/// Every sequence of one engine, one [`Stage`] each.
#[derive(Default)]
pub(crate) struct Sequences {
    list: Vec<Stage>,
}

impl Sequences {
    /// Adds a sequence at the end of its new stage's order. The caller has taken it
    /// out of its previous stage ([`Self::take`]); ids stay unique.
    pub(crate) fn enter(&mut self, stage: Stage) {
        debug_assert!(
            !self.contains(stage.id()),
            "sequence {:?} twice",
            stage.id()
        );
        self.list.push(stage);
    }

    /// Removes sequence `id` in whatever stage it is.
    pub(crate) fn take(&mut self, id: SeqId) -> Option<Stage> {
        let i = self.list.iter().position(|s| s.id() == id)?;
        Some(self.list.remove(i))
    }

    /// Removes sequence `id` when it is running; leaves it where it is otherwise.
    pub(crate) fn take_running(&mut self, id: SeqId) -> Option<Box<Seq>> {
        let i = self
            .list
            .iter()
            .position(|s| matches!(s, Stage::Running(r) if r.id == id))?;
        match self.list.remove(i) {
            Stage::Running(s) => Some(s),
            _ => unreachable!("position matched a running sequence"),
        }
    }

    /// Removes every waiting or running sequence for which `drop` says so, and
    /// returns them in order (parked ones stay: their client is the protocol).
    pub(crate) fn take_where(&mut self, mut drop: impl FnMut(&Stage) -> bool) -> Vec<Stage> {
        let mut taken = Vec::new();
        let mut kept = Vec::with_capacity(self.list.len());
        for s in self.list.drain(..) {
            if !matches!(s, Stage::Parked(_)) && drop(&s) {
                taken.push(s);
            } else {
                kept.push(s);
            }
        }
        self.list = kept;
        taken
    }

    /// Whether a sequence `id` is here, in any stage.
    pub(crate) fn contains(&self, id: SeqId) -> bool {
        self.list.iter().any(|s| s.id() == id)
    }

    /// Waiting sequences in arrival order.
    pub(crate) fn waiting(&self) -> impl Iterator<Item = &Waiting> {
        self.list.iter().filter_map(|s| match s {
            Stage::Waiting(w) => Some(&**w),
            _ => None,
        })
    }

    /// Running sequences in admission order.
    pub(crate) fn running(&self) -> impl Iterator<Item = &Seq> {
        self.list.iter().filter_map(|s| match s {
            Stage::Running(r) => Some(&**r),
            _ => None,
        })
    }

    /// Running sequences in admission order, mutable.
    pub(crate) fn running_mut(&mut self) -> impl Iterator<Item = &mut Seq> {
        self.list.iter_mut().filter_map(|s| match s {
            Stage::Running(r) => Some(&mut **r),
            _ => None,
        })
    }

    /// Parked sequences.
    pub(crate) fn parked(&self) -> impl Iterator<Item = &Parked> {
        self.list.iter().filter_map(|s| match s {
            Stage::Parked(p) => Some(p),
            _ => None,
        })
    }

    /// Parked sequence `id`, if it is parked.
    pub(crate) fn parked_by_id(&self, id: SeqId) -> Option<&Parked> {
        self.parked().find(|p| p.id == id)
    }

    /// Where each running sequence is, in admission order: slot `i` belongs to the
    /// scheduler's running index `i`. Valid until a sequence enters or leaves.
    pub(crate) fn running_slots(&self) -> Vec<usize> {
        (0..self.list.len())
            .filter(|&i| matches!(self.list[i], Stage::Running(_)))
            .collect()
    }

    /// Each running sequence's slot by id (valid as [`Self::running_slots`]).
    pub(crate) fn running_slot_by_id(&self) -> HashMap<SeqId, usize> {
        self.running_slots()
            .into_iter()
            .map(|i| (self.list[i].id(), i))
            .collect()
    }

    /// The running sequence in `slot`.
    ///
    /// Panics: `slot` is not a running sequence's (a slot taken before a sequence
    /// entered or left).
    pub(crate) fn at(&self, slot: usize) -> &Seq {
        match &self.list[slot] {
            Stage::Running(s) => s,
            _ => panic!("slot {slot} is not a running sequence's"),
        }
    }

    /// [`Self::at`], mutable.
    pub(crate) fn at_mut(&mut self, slot: usize) -> &mut Seq {
        match &mut self.list[slot] {
            Stage::Running(s) => s,
            _ => panic!("slot {slot} is not a running sequence's"),
        }
    }

    /// Sequences per stage: (waiting, running, parked).
    pub(crate) fn counts(&self) -> (usize, usize, usize) {
        self.list.iter().fold((0, 0, 0), |(w, r, p), s| match s {
            Stage::Waiting(_) => (w + 1, r, p),
            Stage::Running(_) => (w, r + 1, p),
            Stage::Parked(_) => (w, r, p + 1),
        })
    }
}
