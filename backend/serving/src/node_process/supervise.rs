//! Supervision of a node process: a panic anywhere ends the process, as does an
//! engine thread that stops (with the test-only engine panic wrapped around the loop).

use crate::node_loop::{run_node, NodeLoop, Shared};
use std::io;
use std::sync::{mpsc, Arc};
use std::time::Duration;
use tessera_engine::Engine;
/// Logs any panic and ends the process with status 101 (a node never limps on with
/// a dead engine or connection thread).
pub(super) fn exit_on_panic() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default(info);
        tracing::error!(%info, "panic in a node process; exiting");
        std::process::exit(101);
    }));
}

/// A node loop that panics after its first step with a running request
/// ([`TestPanic::Engine`](super::options::TestPanic::Engine)).
struct PanicOnWork<N>(N);

impl<N: NodeLoop> NodeLoop for PanicOnWork<N> {
    type Cmd = N::Cmd;

    fn on_cmd(&mut self, engine: &mut Engine, cmd: N::Cmd) {
        self.0.on_cmd(engine, cmd)
    }

    fn busy(&self) -> bool {
        self.0.busy()
    }

    fn after_step(&mut self, engine: &mut Engine) {
        self.0.after_step(engine);
        if engine.running_len() > 0 {
            panic!("TESSERA_TEST_NODE_PANIC=engine: a test-only panic on the engine thread");
        }
    }

    fn queued(&self) -> usize {
        self.0.queued()
    }

    fn live(&self) -> usize {
        self.0.live()
    }

    fn stop(&self) -> bool {
        self.0.stop()
    }

    fn timer(&self) -> Option<Duration> {
        self.0.timer()
    }
}

/// Starts the engine thread; the process exits if it ever stops.
pub(super) fn spawn_engine<N: NodeLoop + Send + 'static>(
    engine: Engine,
    node: N,
    rx: mpsc::Receiver<N::Cmd>,
    shared: Arc<Shared>,
    name: &str,
    panic: bool,
) -> io::Result<()> {
    let t = std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            if panic {
                run_node(engine, PanicOnWork(node), rx, &shared)
            } else {
                run_node(engine, node, rx, &shared)
            }
        })?;
    std::thread::Builder::new()
        .name("tessera-supervisor".into())
        .spawn(move || {
            let _ = t.join();
            tracing::error!("the engine thread stopped; exiting");
            std::process::exit(1);
        })?;
    Ok(())
}
