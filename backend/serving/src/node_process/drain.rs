//! The drain: a node stops taking requests; a decode node with another to move to
//! ends its running requests at once and moves their KV there, any other node lets
//! them finish until its deadline and ends the rest; then it exits. And `tessera
//! node drain`, which asks a node to.

use super::state::NodeState;
use crate::link_security::{node_name, NodeLinks};
use crate::net::{block_on, open_link, Frame};
use crate::prefill_node::PrefillCmd;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_transfer::protocol::Role;
/// After a drain's deadline, how long the node waits for the requests it ended to
/// be reported before it exits anyway.
const DRAIN_GRACE: Duration = Duration::from_secs(10);
/// How long a draining decode node that moves KV stays idle, with no move left to
/// start, before it exits (a margin for a command on its way to the engine thread).
const MOVE_WINDOW: Duration = Duration::from_millis(200);

impl NodeState {
    /// Starts a drain (once): tells the gateways, then waits on a thread of its own.
    pub(super) fn begin_drain(self: &Arc<Self>, why: &str) {
        if self.draining.swap(true, Ordering::AcqRel) {
            return;
        }
        if self.mover.is_some() {
            tracing::warn!(
                timeout = ?self.drain_timeout,
                "draining ({why}): no new requests; running requests move to other decode nodes"
            );
        } else {
            tracing::warn!(
                timeout = ?self.drain_timeout,
                "draining ({why}): no new requests; running requests may finish until the deadline"
            );
        }
        // The protocol refuses new requests from here on (the coordinator retries
        // them on another node); told before the gateways, so whatever a gateway
        // sends after it read the status below is refused, never accepted.
        self.cmds.begin_drain();
        for g in self.gateways.open() {
            g.try_send(&Frame::Status { draining: true }, &[]);
        }
        let node = self.clone();
        let spawned = std::thread::Builder::new()
            .name("tessera-drain".into())
            .spawn(move || node.drain());
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the drain; exiting");
            std::process::exit(1);
        }
    }

    /// Whether the node holds no request any more.
    fn idle(&self) -> bool {
        self.carried.is_empty() && self.shared.live() == 0
    }

    /// Waits until `deadline` for the node to be idle; returns whether it is.
    fn wait_idle(&self, deadline: Instant) -> bool {
        let mut said = Instant::now();
        while !self.idle() {
            if Instant::now() >= deadline {
                return false;
            }
            if said.elapsed() >= Duration::from_secs(5) {
                said = Instant::now();
                tracing::warn!(
                    carried = self.carried.len(),
                    held = self.shared.live(),
                    "draining: requests still held"
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    /// Waits until `deadline` for every kept request's move to have started (its
    /// `Prefill` arrives once another decode node reserved pages for it) and for
    /// the node to be idle, [`MOVE_WINDOW`] in a row; returns whether it was.
    fn wait_moves(&self, deadline: Instant) -> bool {
        let mut quiet_since = Instant::now();
        while Instant::now() < deadline {
            // A kept request waits for its move's `Prefill` while a gateway that can
            // send it is linked.
            let kept = !self.kept.lock().unwrap().is_empty() && !self.gateways.open().is_empty();
            if !self.idle() || kept {
                quiet_since = Instant::now();
            } else if quiet_since.elapsed() >= MOVE_WINDOW {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    /// The drain. A decode node with another decode node to move to ends its
    /// running requests at once, keeping their computed pages, and writes each
    /// one's continuation into the decode node its gateway chose (issue 36): the
    /// drain takes as long as those transfers, not as the longest request. Any
    /// other node lets running requests finish until the deadline and ends the
    /// rest as drained (their gateways continue them on other nodes). Queued
    /// frames go out; then `run_node_process` returns.
    fn drain(&self) {
        let deadline = Instant::now() + self.drain_timeout;
        let idle = if self.mover.is_some() {
            self.cmds.move_all(
                "the node drains: the request goes on on another decode node, with its KV moved there",
            );
            self.wait_moves(deadline)
        } else {
            self.wait_idle(deadline)
        };
        if !idle {
            tracing::warn!(
                "drain deadline passed; ending the requests still running (their gateways \
                 continue them on other nodes)"
            );
            self.cmds.end_all(
                "the node is shutting down: its drain deadline passed before the request finished",
            );
            if let Some(mover) = &self.mover {
                let _ = mover.send(PrefillCmd::EndAll);
            }
            if !self.wait_idle(Instant::now() + DRAIN_GRACE) {
                tracing::warn!("requests still held after the drain grace period; exiting anyway");
            }
        }
        let conns = self.registry.open();
        for c in &conns {
            c.finish();
        }
        let deadline = Instant::now() + Duration::from_secs(2);
        while conns.iter().any(|c| c.is_alive()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(10));
        }
        tracing::warn!("drained; exiting");
        if let Some(tx) = self.exit.lock().unwrap().take() {
            let _ = tx.send(());
        }
    }
}

/// `tessera node drain`: asks node `addr` (of `role`) to drain, over a link with the
/// gateway identity, and returns once it said so; with `wait`, also waits (that long
/// at most) until the node finished draining and closed the link.
///
/// Errors: the node cannot be reached or refused the link (not a gateway identity),
/// it did not confirm, or it still runs after `wait`.
pub fn drain_node(
    links: &NodeLinks,
    addr: &str,
    role: Role,
    wait: Option<Duration>,
) -> io::Result<()> {
    let name = node_name(role, addr)?;
    let (links, addr) = (links.clone(), addr.to_string());
    block_on(async move {
        let (conn, welcome, mut reader) =
            open_link(links, addr.clone(), name, Role::Coordinator, None, None).await?;
        let timeout = |m: String| io::Error::new(io::ErrorKind::TimedOut, m);
        if !welcome.draining {
            conn.try_send(&Frame::Drain, &[]);
            let confirmed = async {
                loop {
                    match reader.next_on(&conn).await {
                        Ok((Frame::Status { draining: true }, _)) => return Ok(()),
                        Ok(_) => continue,
                        Err(e) => return Err(io::Error::other(format!("{addr}: {e}"))),
                    }
                }
            };
            tokio::time::timeout(crate::link_security::HANDSHAKE_TIMEOUT, confirmed)
                .await
                .map_err(|_| timeout(format!("{addr} did not confirm the drain")))??;
        }
        if let Some(wait) = wait {
            let ended = async { while reader.next_on(&conn).await.is_ok() {} };
            tokio::time::timeout(wait, ended)
                .await
                .map_err(|_| timeout(format!("{addr} still runs after {wait:?}")))?;
        }
        conn.finish();
        Ok(())
    })
}
