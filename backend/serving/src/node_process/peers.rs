//! A prefill node's outgoing links to decode nodes: opening them, naming them by
//! address, and the page transport (UCX puts or `Land` frames) over them.

use super::ledger::{Budget, Carried, Registry};
use crate::link_security::{fingerprint_hex, node_name, NodeLinks};
use crate::links::{CommitExtra, PdCounters, TransferFault};
use crate::net::{self, block_on, open_link, Conn, Control, Frame, LinkEnd};
use crate::prefill_node::{PrefillCmd, PrefillLinks};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::Duration;
use tessera_transfer::protocol::{Msg, Role};
use tessera_transfer::transport::{DestPage, KvTransport, TransportError};
use tessera_transfer::ucx::{UcxContext, UcxSource, UcxSourceConfig};
/// How long a flush waits for the decode node's acknowledgement (a dead link ends
/// the wait sooner).
const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);

/// A prefill node's connection to one decode node.
struct Peer {
    conn: Arc<Conn>,
    acks: Mutex<HashMap<u64, mpsc::Sender<()>>>,
    next_flush: AtomicU64,
    /// UCX endpoint into the decode node's registered pool, when both use UCX.
    ucx: Option<Mutex<UcxSource>>,
}

/// Most decode nodes a prefill node keeps a place for (its file's, and those
/// gateways named since).
const MAX_DECODE_PEERS: usize = 4096;

/// One decode node a prefill node writes to, with its own lock: connecting to one
/// node never waits on another.
pub(super) struct PeerSlot {
    addr: String,
    conn: Mutex<Option<Arc<Peer>>>,
}

impl PeerSlot {
    pub(super) fn new(addr: &str) -> Self {
        Self {
            addr: addr.to_string(),
            conn: Mutex::new(None),
        }
    }
}

/// How a prefill node process reaches the decode nodes of its deployment.
pub(super) struct PeerLinks {
    /// This prefill node's name (its listen address).
    pub(super) name: String,
    /// Decode nodes by this node's index: its deployment file's, in file order,
    /// then any a gateway named by address since (a node added by a reload of the
    /// gateways). Only grows, so an index always names the same node.
    pub(super) peers: RwLock<Vec<Arc<PeerSlot>>>,
    /// This node's UCX context (`--transport ucx`).
    pub(super) ucx: Option<UcxContext>,
    pub(super) links: NodeLinks,
    pub(super) carried: Arc<Carried>,
    pub(super) registry: Arc<Registry>,
    pub(super) counters: Arc<PdCounters>,
    /// This node's engine thread (a decode node's `QuietQuery` goes there).
    pub(super) cmds: mpsc::Sender<PrefillCmd>,
}

impl PeerLinks {
    /// This node's index of the decode node at `addr`, which a gateway named: a node
    /// of its file, or one a reload of the gateways added (then kept from now on).
    /// The link to it is still authenticated as to any decode node: its certificate
    /// must name `decode` at `addr` under the cluster CA (and, on plain links, which
    /// only loopback deployments may use, the address must be on loopback).
    ///
    /// Errors: the address is no node address, not on loopback on plain links, or
    /// too many decode nodes were named.
    pub(super) fn index_of(&self, addr: &str) -> Result<usize, String> {
        if let Some(i) = self
            .peers
            .read()
            .unwrap()
            .iter()
            .position(|p| p.addr == addr)
        {
            return Ok(i);
        }
        node_name(Role::Decode, addr)
            .map_err(|e| format!("a Prefill for decode node {addr:?}: {e}"))?;
        if !self.links.is_tls() && !tessera_config::is_loopback_address(addr) {
            return Err(format!(
                "a Prefill for decode node {addr}, not on loopback, over plain node links"
            ));
        }
        let mut peers = self.peers.write().unwrap();
        if let Some(i) = peers.iter().position(|p| p.addr == addr) {
            return Ok(i);
        }
        if peers.len() >= MAX_DECODE_PEERS {
            return Err(format!(
                "a Prefill for decode node {addr}: this node already knows {MAX_DECODE_PEERS} decode nodes"
            ));
        }
        tracing::warn!(
            addr,
            "a gateway named a decode node this node's file does not list; writing to it"
        );
        peers.push(Arc::new(PeerSlot::new(addr)));
        Ok(peers.len() - 1)
    }

    /// The connection to decode node `index`, opened (again) if needed: TLS to that
    /// node's identity, `Hello { from: Prefill }`, its welcome (and UCX region).
    fn peer(&self, index: usize) -> Result<Arc<Peer>, TransportError> {
        let gone = |m: String| TransportError::PeerGone(m);
        let Some(slot) = self.peers.read().unwrap().get(index).cloned() else {
            return Err(gone(format!("no decode node {index} in the deployment")));
        };
        let addr = &slot.addr;
        let mut slot = slot.conn.lock().unwrap();
        if let Some(p) = slot.as_ref() {
            if p.conn.is_alive() {
                return Ok(p.clone());
            }
        }
        let name = node_name(Role::Decode, addr).map_err(|e| gone(e.to_string()))?;
        let (conn, welcome, mut reader) = block_on(open_link(
            self.links.clone(),
            addr.clone(),
            name,
            Role::Prefill,
            Some(self.name.clone()),
            None,
        ))
        .map_err(|e| gone(format!("cannot reach decode node {addr}: {e}")))?;
        let ucx = match (&self.ucx, welcome.ucx) {
            (Some(ctx), Some(desc)) => {
                match UcxSource::connect(ctx, &desc, UcxSourceConfig::default()) {
                    Ok(src) => Some(Mutex::new(src)),
                    Err(e) => {
                        conn.close();
                        return Err(gone(format!("UCX connect to {addr} failed: {e}")));
                    }
                }
            }
            (Some(_), None) => {
                tracing::warn!(addr, "decode node offers no UCX region; using TCP frames");
                None
            }
            _ => None,
        };
        self.registry.add(&conn);
        let peer = Arc::new(Peer {
            conn,
            acks: Mutex::new(HashMap::new()),
            next_flush: AtomicU64::new(1),
            ucx,
        });
        let (p, counters, cmds) = (peer.clone(), self.counters.clone(), self.cmds.clone());
        net::spawn(async move {
            // Queries beyond this budget are dropped (the decode node asks again).
            let mut queries = Budget::new();
            let end = loop {
                match reader.next_on(&p.conn).await {
                    Ok((Frame::FlushAck { id }, _)) => {
                        if let Some(tx) = p.acks.lock().unwrap().remove(&id) {
                            let _ = tx.send(());
                        }
                    }
                    Ok((Frame::Control(c), _)) if matches!(c.msg, Msg::QuietQuery { .. }) => {
                        let req = c.msg.req();
                        if !queries.spend() {
                            tracing::debug!(?req, "dropped a quiet query over the budget");
                        } else if cmds
                            .send(PrefillCmd::QuietQuery { req, decode: index })
                            .is_err()
                        {
                            break LinkEnd::Closed("the engine thread is gone".into());
                        }
                    }
                    Ok((f, _)) => {
                        break LinkEnd::Violation(format!(
                            "a {} frame from a decode node",
                            f.kind()
                        ))
                    }
                    Err(end) => break end,
                }
            };
            end.note(p.conn.peer(), &counters);
            p.conn.close();
            // Waiting flushes fail: their senders drop.
            p.acks.lock().unwrap().clear();
        });
        *slot = Some(peer.clone());
        Ok(peer)
    }
}

impl PrefillLinks for PeerLinks {
    fn transport(
        &self,
        decode: usize,
        _fault: Option<TransferFault>,
        _dest: &[DestPage],
    ) -> Result<Box<dyn KvTransport>, TransportError> {
        Ok(Box::new(PeerTransport {
            peer: self.peer(decode)?,
        }))
    }

    fn to_decode(&self, decode: usize, msg: Msg, extra: CommitExtra) -> bool {
        let req = msg.req();
        let commit = matches!(msg, Msg::Commit { .. });
        let sent = self.peer(decode).is_ok_and(|p| {
            p.conn.send(
                &Frame::Control(Control {
                    rng_pos: Some(extra.rng_pos),
                    cached_tokens: Some(extra.cached_tokens),
                    cached_tiers: Some(extra.cached_tiers),
                    model: extra.model.map(|m| fingerprint_hex(&m)),
                    logprobs: extra.logprobs,
                    ..Control::new(msg)
                }),
                &[],
            )
        });
        if commit {
            // The prefill side's last message for the request.
            self.carried.done(req);
        }
        sent
    }
}

/// [`KvTransport`] from a prefill node into one decode node: UCX one-sided puts
/// and a UCX flush (remote completion) when both nodes run `--transport ucx`;
/// otherwise each put is a `Land` frame on the link and `flush` waits for the decode
/// node's `FlushAck`, which it sends after applying every earlier frame (so the
/// writes have landed). Runs on a transfer worker: it may block.
struct PeerTransport {
    peer: Arc<Peer>,
}

impl PeerTransport {
    /// A failed UCX endpoint is unusable: drop the connection so the next transfer
    /// opens a fresh one.
    fn fail(&self, e: TransportError) -> TransportError {
        self.peer.conn.close();
        e
    }
}

impl KvTransport for PeerTransport {
    fn put(&mut self, req: u64, dest: DestPage, bytes: &[u8]) -> Result<(), TransportError> {
        if let Some(ucx) = &self.peer.ucx {
            let r = ucx.lock().unwrap().put(req, dest, bytes);
            return r.map_err(|e| self.fail(e));
        }
        if self.peer.conn.send(&Frame::Land { req, dest }, bytes) {
            Ok(())
        } else {
            Err(TransportError::PeerGone(
                "decode node connection closed".into(),
            ))
        }
    }

    fn flush(&mut self) -> Result<(), TransportError> {
        if let Some(ucx) = &self.peer.ucx {
            let r = ucx.lock().unwrap().flush();
            return r.map_err(|e| self.fail(e));
        }
        let p = &self.peer;
        let id = p.next_flush.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::channel();
        p.acks.lock().unwrap().insert(id, tx);
        if !p.conn.send(&Frame::Flush { id }, &[]) {
            return Err(TransportError::PeerGone(
                "decode node connection closed".into(),
            ));
        }
        rx.recv_timeout(FLUSH_TIMEOUT).map_err(|_| {
            TransportError::PeerGone("decode node did not acknowledge the writes".into())
        })
    }
}
