//! Connection caps for a node's listeners (the control port and `--metrics-listen`).
//!
//! A [`HeadGate`] holds at most `max_open` connections, of which at most `max_heads`
//! are still in their head (TLS handshake and hello on the control port, the request
//! head on the metrics listener). Each head also has a whole-head deadline, enforced
//! by the listener. When a new connection would pass either cap, the connection that
//! has been in its head the longest is cut to make room: slow clients (one byte
//! every few seconds) can hold at most `max_heads` slots, each for at most the
//! deadline, and a client that sends its head at once still gets in while they
//! wait. Only when every slot belongs to a connection past its head is the new
//! connection refused (closed at once).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// How a connection still in its head is cut: closes its socket or wakes its task.
pub(crate) type Cut = Box<dyn FnOnce() + Send>;

/// The caps of one listener (see the module docs).
pub(crate) struct HeadGate {
    max_open: usize,
    max_heads: usize,
    slots: Mutex<GateSlots>,
}

/// A [`HeadGate`]'s slot book: who holds a slot and which connections are still in
/// their head.
#[derive(Default)]
struct GateSlots {
    next: u64,
    /// Connections holding a slot (in their head or past it).
    open: usize,
    /// Connections in their head, oldest first, with how to cut each.
    heads: VecDeque<(u64, Cut)>,
}

/// A connection's slot; released when dropped.
pub(crate) struct Ticket {
    gate: Arc<HeadGate>,
    id: u64,
    in_head: bool,
}

impl HeadGate {
    /// A gate of at most `max_open` connections, at most `max_heads` (<= `max_open`)
    /// of them in their head.
    pub(crate) fn new(max_open: usize, max_heads: usize) -> Arc<Self> {
        Arc::new(Self {
            max_open,
            max_heads: max_heads.min(max_open),
            slots: Mutex::new(GateSlots::default()),
        })
    }

    /// Admits a new connection, in its head, cut by `cut` if it must make room
    /// later. Cuts the oldest head first when a cap is reached; `None` (refuse the
    /// connection) when every slot is held by a connection past its head.
    pub(crate) fn admit(self: &Arc<Self>, cut: Cut) -> Option<Ticket> {
        let mut g = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        while g.heads.len() >= self.max_heads || g.open >= self.max_open {
            let (_, oldest) = g.heads.pop_front()?;
            g.open -= 1;
            oldest();
        }
        g.next += 1;
        let id = g.next;
        g.open += 1;
        g.heads.push_back((id, cut));
        Some(Ticket {
            gate: self.clone(),
            id,
            in_head: true,
        })
    }

    /// Connections holding a slot and, of them, those in their head.
    #[cfg(test)]
    fn counts(&self) -> (usize, usize) {
        let g = self.slots.lock().unwrap();
        (g.open, g.heads.len())
    }
}

impl Ticket {
    /// The head is complete: the connection can no longer be cut to make room.
    /// False when it already was cut (the caller closes it).
    pub(crate) fn head_done(&mut self) -> bool {
        if !self.in_head {
            return true;
        }
        let mut g = self.gate.slots.lock().unwrap_or_else(|e| e.into_inner());
        match g.heads.iter().position(|(id, _)| *id == self.id) {
            Some(i) => {
                g.heads.remove(i);
                self.in_head = false;
                true
            }
            None => false,
        }
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut g = self.gate.slots.lock().unwrap_or_else(|e| e.into_inner());
        if !self.in_head {
            g.open -= 1;
        } else if let Some(i) = g.heads.iter().position(|(id, _)| *id == self.id) {
            g.heads.remove(i);
            g.open -= 1;
        }
        // Else it was cut, and its slot released then.
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn the_oldest_head_is_cut_for_a_newcomer_and_finished_heads_are_never_cut() {
        let gate = HeadGate::new(4, 2);
        let cuts = Arc::new(AtomicUsize::new(0));
        let cut = |n: usize| -> Cut {
            let c = cuts.clone();
            Box::new(move || {
                c.fetch_add(n, Ordering::SeqCst);
            })
        };
        let mut a = gate.admit(cut(1)).unwrap();
        let b = gate.admit(cut(10)).unwrap();
        assert_eq!(gate.counts(), (2, 2));
        // A third head: the oldest (a) is cut.
        let mut c = gate.admit(cut(100)).unwrap();
        assert_eq!(cuts.load(Ordering::SeqCst), 1);
        assert!(!a.head_done(), "a was cut");
        drop(a);
        assert_eq!(gate.counts(), (2, 2));
        // c finishes its head: it keeps its slot and is never cut.
        assert!(c.head_done());
        let _d = gate.admit(cut(1000)).unwrap();
        assert_eq!(gate.counts(), (3, 2));
        assert_eq!(cuts.load(Ordering::SeqCst), 1);
        let _e = gate.admit(cut(10_000)).unwrap();
        assert_eq!(
            cuts.load(Ordering::SeqCst),
            11,
            "b, the oldest head, was cut"
        );
        drop(b);
        assert_eq!(gate.counts(), (3, 2));
        drop(c);
        assert_eq!(gate.counts(), (2, 2));
    }

    #[test]
    fn a_gate_full_of_finished_heads_refuses() {
        let gate = HeadGate::new(2, 2);
        let mut t: Vec<Ticket> = (0..2)
            .map(|_| gate.admit(Box::new(|| {})).unwrap())
            .collect();
        for x in &mut t {
            assert!(x.head_done());
        }
        assert!(gate.admit(Box::new(|| {})).is_none());
        t.pop();
        assert!(gate.admit(Box::new(|| {})).is_some());
    }
}
