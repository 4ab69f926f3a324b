//! What a node's connection tasks share: the engine thread's command queue and the
//! node's state behind every link.

use super::ledger::{Carried, Registry};
use super::options::TestPanic;
use super::peers::PeerLinks;
use crate::decode_node::{DecodeCmd, KeptForMoves};
use crate::link_security::NodeLinks;
use crate::links::PdCounters;
use crate::node_loop::Shared;
use crate::prefill_node::PrefillCmd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;
use tessera_transfer::protocol::{FailKind, FailReason, ReqId, Role};
use tessera_transfer::ucx::UcxRegionDescriptor;
/// The engine thread's command queue.
pub(super) enum NodeCmds {
    Decode(mpsc::Sender<DecodeCmd>),
    Prefill(mpsc::Sender<PrefillCmd>),
}

impl NodeCmds {
    pub(super) fn coordinator_lost(&self, req: ReqId) {
        let _ = match self {
            NodeCmds::Decode(tx) => tx.send(DecodeCmd::CoordinatorLost(req)).is_ok(),
            NodeCmds::Prefill(tx) => tx.send(PrefillCmd::CoordinatorLost(req)).is_ok(),
        };
    }

    /// Tells the engine thread's protocol machine that the node drains: it refuses
    /// new requests from now on (a refusal the coordinator retries elsewhere).
    pub(super) fn begin_drain(&self) {
        let _ = match self {
            NodeCmds::Decode(tx) => tx.send(DecodeCmd::Drain).is_ok(),
            NodeCmds::Prefill(tx) => tx.send(PrefillCmd::Drain).is_ok(),
        };
    }

    /// A drain that moves KV: running requests end now, those committing later as
    /// soon as they decode, with their pages kept for their moves (`why`: the
    /// failure's message).
    pub(super) fn move_all(&self, why: &str) {
        if let NodeCmds::Decode(tx) = self {
            let _ = tx.send(DecodeCmd::MoveAll(why.into()));
        }
    }

    /// Ends every request the engine thread holds: running ones as drained (their
    /// gateways continue them elsewhere; `why` is the failure's message), the rest
    /// as if their coordinator were gone.
    pub(super) fn end_all(&self, why: &str) {
        let reason = FailReason::new(FailKind::Drained, why);
        let _ = match self {
            NodeCmds::Decode(tx) => tx.send(DecodeCmd::EndAll(reason)).is_ok(),
            NodeCmds::Prefill(tx) => tx.send(PrefillCmd::EndAll).is_ok(),
        };
    }
}

/// Everything a node's connection tasks share.
pub(super) struct NodeState {
    pub(super) role: Role,
    pub(super) links: NodeLinks,
    pub(super) cmds: NodeCmds,
    pub(super) region: Option<UcxRegionDescriptor>,
    pub(super) incarnation: u64,
    pub(super) counters: Arc<PdCounters>,
    pub(super) shared: Arc<Shared>,
    pub(super) page_bytes: usize,
    pub(super) decode_peers: usize,
    /// A writer's decode peers (to look up a decode node a gateway names by
    /// address): a prefill node's, and a decode node's that can move KV.
    pub(super) peer_links: Option<Arc<PeerLinks>>,
    /// A decode node's writer, which moves drained sequences' KV to another decode
    /// node (`None`: a prefill node, or the only decode node of the file).
    pub(super) mover: Option<mpsc::Sender<PrefillCmd>>,
    /// Requests the drain ended whose KV this node keeps until their move's
    /// `Prefill` arrives (the drain waits for them, until its deadline).
    pub(super) kept: KeptForMoves,
    pub(super) carried: Arc<Carried>,
    pub(super) registry: Arc<Registry>,
    /// Coordinator links (they hear `Status`).
    pub(super) gateways: Registry,
    pub(super) next_conn: AtomicU64,
    pub(super) draining: AtomicBool,
    pub(super) drain_timeout: Duration,
    pub(super) exit: Mutex<Option<mpsc::Sender<()>>>,
    pub(super) test_panic: Option<TestPanic>,
    /// The LoRA adapters gateways sent (`Frame::Adapter`), attached to the requests
    /// that name them.
    pub(super) adapters: crate::adapters::NodeAdapters,
}

impl NodeState {
    pub(super) fn draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }
}
