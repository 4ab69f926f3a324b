//! [`EngineHandle`]: the engine on its own thread, shared by many callers.
//!
//! One thread owns the [`Engine`] (and so the KV pool); callers hold cheap clones of
//! the handle. Admission runs in the caller's thread against copied
//! [`AdmissionLimits`], so a rejected request never reaches the engine's queue (I1).
//! Dropping a request's receiver aborts it at the next step and frees its pages.

use crate::cluster::PdCluster;
use crate::remote::{RemoteCluster, RemoteNodes};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Instant;
use tessera_engine::engine::{
    AdmissionLimits, Engine, EngineConfig, Event, GenerateRequest, Rejection,
};
use tessera_engine::Admitted;
use tessera_model::gguf::LoadedModel;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// Point-in-time engine counters (updated after every step).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Free KV pages.
    pub free_pages: usize,
    /// Total KV pages.
    pub capacity_pages: usize,
    /// Requests in the running batch.
    pub running: usize,
    /// Requests waiting for pages or a batch slot.
    pub waiting: usize,
}

/// Counters an engine thread publishes for lock-free readers.
#[derive(Default)]
pub(crate) struct Shared {
    free_pages: AtomicUsize,
    capacity_pages: AtomicUsize,
    running: AtomicUsize,
    waiting: AtomicUsize,
}

struct Submit {
    req: Admitted,
    sink: UnboundedSender<Event>,
    at: Instant,
}

/// A cloneable handle to the serving engines: one co-located engine on a dedicated
/// thread, or a prefill and a decode engine joined by the KV transfer protocol
/// ([`PdCluster`]). Callers see the same `submit`, `limits` and `stats` either way.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Inner,
}

#[derive(Clone)]
enum Inner {
    Colocated {
        tx: mpsc::Sender<Submit>,
        limits: AdmissionLimits,
        shared: Arc<Shared>,
    },
    Disaggregated(Arc<PdCluster>),
    Remote(Arc<RemoteCluster>),
}

impl EngineHandle {
    /// Starts the engine thread. It exits once every handle is dropped and the
    /// requests it already accepted have finished.
    pub fn spawn(model: &LoadedModel, cfg: EngineConfig) -> Self {
        let engine = Engine::new(model.llama.clone(), model.tokenizer.clone(), cfg);
        let limits = engine.limits();
        let shared = Arc::new(Shared::default());
        let (tx, rx) = mpsc::channel::<Submit>();
        let sh = shared.clone();
        publish(&engine, &sh);
        std::thread::Builder::new()
            .name("tessera-engine".into())
            .spawn(move || run(engine, rx, sh))
            .expect("spawn engine thread");
        Self {
            inner: Inner::Colocated { tx, limits, shared },
        }
    }

    /// Starts prefill and decode engines in this process ([`PdCluster::spawn`]).
    pub fn spawn_disaggregated(
        model: &LoadedModel,
        prefill: &[EngineConfig],
        decode: &[EngineConfig],
    ) -> Self {
        Self {
            inner: Inner::Disaggregated(Arc::new(PdCluster::spawn(model, prefill, decode))),
        }
    }

    /// Coordinates remote prefill and decode nodes ([`RemoteCluster::connect`]).
    pub fn connect_remote(model: &LoadedModel, nodes: RemoteNodes) -> Self {
        Self {
            inner: Inner::Remote(Arc::new(RemoteCluster::connect(model, nodes))),
        }
    }

    /// Whether requests can be served now: a remote deployment needs at least one
    /// reachable prefill and one reachable decode node; in-process engines always can.
    pub fn ready(&self) -> bool {
        match &self.inner {
            Inner::Remote(c) => c.ready(),
            _ => true,
        }
    }

    /// The in-process prefill/decode cluster behind this handle, if any.
    pub fn cluster(&self) -> Option<&PdCluster> {
        match &self.inner {
            Inner::Disaggregated(c) => Some(c),
            _ => None,
        }
    }

    /// The remote nodes behind this handle, if any.
    pub fn remote(&self) -> Option<&RemoteCluster> {
        match &self.inner {
            Inner::Remote(c) => Some(c),
            _ => None,
        }
    }

    /// Admits `req` (I1) and queues it; events arrive on the returned receiver.
    /// Drop the receiver to abort.
    pub fn submit(&self, req: GenerateRequest) -> Result<UnboundedReceiver<Event>, Rejection> {
        let (tx, limits) = match &self.inner {
            Inner::Colocated { tx, limits, .. } => (tx, limits),
            Inner::Disaggregated(c) => return c.submit(req),
            Inner::Remote(c) => return c.submit(req),
        };
        let req = limits.admit(req)?;
        let (sink, rx) = unbounded_channel();
        let at = Instant::now();
        if let Err(mpsc::SendError(s)) = tx.send(Submit { req, sink, at }) {
            let _ = s
                .sink
                .send(Event::Error(tessera_engine::engine::EngineError::Shutdown));
        }
        Ok(rx)
    }

    /// The limits admission checks against.
    pub fn limits(&self) -> AdmissionLimits {
        match &self.inner {
            Inner::Colocated { limits, .. } => *limits,
            Inner::Disaggregated(c) => c.admission().limits,
            Inner::Remote(c) => c.admission().limits,
        }
    }

    /// Current counters (summed over nodes when disaggregated).
    pub fn stats(&self) -> EngineStats {
        match &self.inner {
            Inner::Colocated { shared, .. } => shared.snapshot(),
            Inner::Disaggregated(c) => c.stats(),
            Inner::Remote(c) => c.stats(),
        }
    }
}

impl Shared {
    pub(crate) fn snapshot(&self) -> EngineStats {
        EngineStats {
            free_pages: self.free_pages.load(Ordering::Acquire),
            capacity_pages: self.capacity_pages.load(Ordering::Acquire),
            running: self.running.load(Ordering::Acquire),
            waiting: self.waiting.load(Ordering::Acquire),
        }
    }
}

pub(crate) fn publish(e: &Engine, sh: &Shared) {
    sh.free_pages
        .store(e.kv().pool().free_pages(), Ordering::Release);
    sh.capacity_pages
        .store(e.kv().pool().capacity(), Ordering::Release);
    sh.running.store(e.running_len(), Ordering::Release);
    sh.waiting.store(e.waiting_len(), Ordering::Release);
}

fn run(engine: Engine, rx: mpsc::Receiver<Submit>, sh: Arc<Shared>) {
    struct Colocated;
    impl NodeLoop for Colocated {
        type Cmd = Submit;
        fn on_cmd(&mut self, engine: &mut Engine, s: Submit) {
            engine.enqueue_with_sink(s.req, s.sink, s.at);
        }
    }
    run_node(engine, Colocated, rx, &sh);
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
    /// Whether the thread must exit now (dropping the engine and everything it holds).
    fn stop(&self) -> bool {
        false
    }
}

/// The engine thread's loop: apply queued commands, step, publish counters. Blocks
/// on the queue when idle; exits once every sender is gone and nothing runs.
pub(crate) fn run_node<N: NodeLoop>(
    mut engine: Engine,
    mut node: N,
    rx: mpsc::Receiver<N::Cmd>,
    sh: &Shared,
) {
    let mut open = true;
    loop {
        if !engine.has_work() && !node.busy() {
            if !open {
                return;
            }
            match rx.recv() {
                Ok(c) => node.on_cmd(&mut engine, c),
                Err(_) => return,
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
        publish(&engine, sh);
    }
}
