//! The loop every engine thread runs: apply queued commands, step, publish counters.
//! What the commands are (a co-located submit, a prefill or decode node's protocol
//! messages) is the [`NodeLoop`] implementation's business.

use crate::metrics::NodeHandles;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::time::Duration;
use tessera_engine::Engine;

/// Point-in-time engine counters (updated after every step).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Free KV pages.
    pub free_pages: usize,
    /// KV pages the prefix cache holds (never free; unused ones are evicted when a
    /// reservation needs them).
    pub cached_pages: usize,
    /// Total KV pages.
    pub capacity_pages: usize,
    /// Requests in the running batch.
    pub running: usize,
    /// Requests waiting for pages or a batch slot.
    pub waiting: usize,
}

impl EngineStats {
    /// Field-wise sum (counters of several nodes).
    pub fn sum(self, o: Self) -> Self {
        Self {
            free_pages: self.free_pages + o.free_pages,
            cached_pages: self.cached_pages + o.cached_pages,
            capacity_pages: self.capacity_pages + o.capacity_pages,
            running: self.running + o.running,
            waiting: self.waiting + o.waiting,
        }
    }
}

/// Counters an engine thread publishes for lock-free readers (and, with metrics, into
/// the node's gauges).
#[derive(Debug, Default)]
pub(crate) struct Shared {
    free_pages: AtomicUsize,
    cached_pages: AtomicUsize,
    capacity_pages: AtomicUsize,
    running: AtomicUsize,
    waiting: AtomicUsize,
    live: AtomicUsize,
    metrics: Option<NodeHandles>,
}

impl Shared {
    /// Counters that also publish into `metrics`.
    pub(crate) fn with_metrics(metrics: NodeHandles) -> Self {
        Self {
            metrics: Some(metrics),
            ..Self::default()
        }
    }

    pub(crate) fn snapshot(&self) -> EngineStats {
        EngineStats {
            free_pages: self.free_pages.load(Ordering::Acquire),
            cached_pages: self.cached_pages.load(Ordering::Acquire),
            capacity_pages: self.capacity_pages.load(Ordering::Acquire),
            running: self.running.load(Ordering::Acquire),
            waiting: self.waiting.load(Ordering::Acquire),
        }
    }

    /// Publishes how many requests a node loop holds ([`NodeLoop::live`]).
    pub(crate) fn publish_live(&self, live: usize) {
        self.live.store(live, Ordering::Release);
    }

    /// Requests the node loop held after its last step ([`NodeLoop::live`]).
    pub(crate) fn live(&self) -> usize {
        self.live.load(Ordering::Acquire)
    }

    /// Publishes `e`'s counters (plus `waiting_extra` requests a node queues outside
    /// the engine, e.g. decode reservations waiting for pages).
    pub(crate) fn publish(&self, e: &Engine, waiting_extra: usize) {
        self.publish_node(e, waiting_extra, || 0);
    }

    /// [`Self::publish`], with the pages of quarantined reservations counted apart in
    /// the metrics (`quarantined` runs only when this node has metrics).
    pub(crate) fn publish_node(
        &self,
        e: &Engine,
        waiting_extra: usize,
        quarantined: impl FnOnce() -> usize,
    ) {
        self.free_pages
            .store(e.kv().pool().free_pages(), Ordering::Release);
        self.cached_pages
            .store(e.kv().cached_pages(), Ordering::Release);
        self.capacity_pages
            .store(e.kv().pool().capacity(), Ordering::Release);
        self.running.store(e.running_len(), Ordering::Release);
        self.waiting
            .store(e.waiting_len() + waiting_extra, Ordering::Release);
        if let Some(m) = &self.metrics {
            m.publish(e, waiting_extra, quarantined());
        }
    }
}

/// What runs on an engine thread besides the engine: how commands are applied.
pub(crate) trait NodeLoop {
    /// Commands the thread receives.
    type Cmd: Send;
    /// Applies one command (between engine steps).
    fn on_cmd(&mut self, engine: &mut Engine, cmd: Self::Cmd);
    /// Whether the node has protocol work pending besides the engine's (keeps the
    /// loop from blocking).
    fn busy(&self) -> bool {
        false
    }
    /// Called after every step and command batch.
    fn after_step(&mut self, _engine: &mut Engine) {}
    /// How long the loop may wait for a command while the engine is idle before the
    /// node's timers must run (the loop then steps the idle engine and calls
    /// [`after_step`](Self::after_step)); `None`: no timer pending, wait for a
    /// command.
    fn timer(&self) -> Option<Duration> {
        None
    }
    /// Requests the node queues outside the engine (counted as waiting).
    fn queued(&self) -> usize {
        0
    }
    /// Requests the node holds in any non-terminal protocol state (a drain waits for
    /// none to be left).
    fn live(&self) -> usize {
        0
    }
    /// KV pages held by reservations the protocol quarantined (never read, freed once
    /// their writer is quiet); the engine counts them as reserved.
    fn quarantined_pages(&self, _engine: &Engine) -> usize {
        0
    }
    /// Whether the thread must exit now (dropping the engine and everything it holds).
    fn stop(&self) -> bool {
        false
    }
}

/// The engine thread's loop: apply queued commands, step, publish counters. Blocks
/// on the queue when idle (at most [`NodeLoop::timer`]); exits once every sender is
/// gone and nothing runs.
pub(crate) fn run_node<N: NodeLoop>(
    mut engine: Engine,
    mut node: N,
    rx: mpsc::Receiver<N::Cmd>,
    sh: &Shared,
) {
    // Before the first command: a fresh node's gauges show its whole pool free.
    sh.publish_node(&engine, node.queued(), || node.quarantined_pages(&engine));
    let mut open = true;
    loop {
        if !engine.has_work() && !node.busy() {
            if !open {
                return;
            }
            // An engine keeping pages with an idle time steps now and then to
            // drop the expired ones.
            let timer = match (node.timer(), engine.expiry_wait()) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
            let cmd = match timer {
                None => rx.recv().map_err(|_| ()).map(Some),
                Some(wait) => match rx.recv_timeout(wait) {
                    Ok(c) => Ok(Some(c)),
                    // A timer is due: the idle step and `after_step` below run it.
                    Err(mpsc::RecvTimeoutError::Timeout) => Ok(None),
                    Err(mpsc::RecvTimeoutError::Disconnected) => Err(()),
                },
            };
            match cmd {
                Ok(Some(c)) => node.on_cmd(&mut engine, c),
                Ok(None) => {}
                Err(()) => return,
            }
        }
        loop {
            if node.stop() {
                return;
            }
            match rx.try_recv() {
                Ok(c) => node.on_cmd(&mut engine, c),
                Err(mpsc::TryRecvError::Empty) => break,
                Err(mpsc::TryRecvError::Disconnected) => {
                    open = false;
                    break;
                }
            }
        }
        if node.stop() {
            return;
        }
        engine.step();
        node.after_step(&mut engine);
        sh.publish_node(&engine, node.queued(), || node.quarantined_pages(&engine));
        sh.publish_live(node.live());
    }
}
