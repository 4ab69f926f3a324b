//! A decode node's engine thread with a writer beside its decode loop (issue 36):
//! when a drain ends the node's running sequences, their computed pages stay in the
//! engine's prefix cache ([`tessera_engine::Engine::end_caching_output`]) and each
//! one's continuation is written from here into another decode node, through the
//! transfer protocol's prefill side ([`PrefillLoop`]): its prefill of the prompt and
//! the tokens the client has hits those pages and computes only the last partial
//! page, then the pages go out with the same commit, tags and checksums as any
//! prefill node's.

use crate::decode_node::{DecodeCmd, DecodeLoop};
use crate::node_loop::NodeLoop;
use crate::prefill_node::{PrefillCmd, PrefillLoop};
use std::sync::mpsc;
use std::time::Duration;
use tessera_engine::Engine;
use tessera_transfer::protocol::Msg;

/// A command for one half of a [`DecodeAndWriter`] loop.
// Each command is moved once through the queue; boxing the larger half's would only
// add an allocation (as for the halves' own command types).
#[allow(clippy::large_enum_variant)]
pub(super) enum MoverCmd {
    Decode(DecodeCmd),
    Writer(PrefillCmd),
}

/// The decode loop and the writer loop over one engine: commands go to their own
/// half; every hook asks both.
pub(super) struct DecodeAndWriter {
    pub(super) decode: DecodeLoop,
    pub(super) writer: PrefillLoop,
}

impl NodeLoop for DecodeAndWriter {
    type Cmd = MoverCmd;

    fn on_cmd(&mut self, engine: &mut Engine, cmd: MoverCmd) {
        // One engine, one sequence per request id: a request new to one half under
        // an id the other half holds is dropped (ids are 64 random bits per
        // attempt, so only a forged or broken gateway gets here).
        match cmd {
            MoverCmd::Decode(DecodeCmd::FromCoordinator {
                msg: msg @ Msg::Prealloc { .. },
                ..
            }) if self.writer.knows(msg.req()) => {
                tracing::warn!(req = ?msg.req(), "dropped a Prealloc for a request this node writes");
            }
            MoverCmd::Writer(PrefillCmd::FromCoordinator {
                msg: msg @ Msg::Prefill { .. },
                ..
            }) if self.decode.knows(msg.req()) => {
                tracing::warn!(req = ?msg.req(), "dropped a Prefill for a request this node decodes");
            }
            MoverCmd::Decode(c) => self.decode.on_cmd(engine, c),
            MoverCmd::Writer(c) => self.writer.on_cmd(engine, c),
        }
    }

    fn busy(&self) -> bool {
        self.decode.busy() || self.writer.busy()
    }

    fn after_step(&mut self, engine: &mut Engine) {
        self.decode.after_step(engine);
        self.writer.after_step(engine);
    }

    fn timer(&self) -> Option<Duration> {
        match (self.decode.timer(), self.writer.timer()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    fn queued(&self) -> usize {
        self.decode.queued() + self.writer.queued()
    }

    fn live(&self) -> usize {
        self.decode.live() + self.writer.live()
    }

    fn quarantined_pages(&self, engine: &Engine) -> usize {
        self.decode.quarantined_pages(engine)
    }

    fn stop(&self) -> bool {
        self.decode.stop() || self.writer.stop()
    }
}

/// A sender of one half's commands into the engine thread's queue of `MoverCmd`s:
/// a thread forwards them in order until either side is gone.
pub(super) fn forward<C: Send + 'static>(
    to: mpsc::Sender<MoverCmd>,
    wrap: fn(C) -> MoverCmd,
    name: &str,
) -> std::io::Result<mpsc::Sender<C>> {
    let (tx, rx) = mpsc::channel::<C>();
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            for c in rx {
                if to.send(wrap(c)).is_err() {
                    return;
                }
            }
        })?;
    Ok(tx)
}
