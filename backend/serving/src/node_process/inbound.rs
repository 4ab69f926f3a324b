//! Inbound node links: the accept loop, each link's handshake and hello, and the
//! check that turns each frame a peer sends into an engine-thread command.

use super::ledger::{Budget, CoordReply, UNKNOWN_BURST, UNKNOWN_PER_SEC};
use super::options::TestPanic;
use super::state::{NodeCmds, NodeState};
use crate::conn_gate::{HeadGate, Ticket};
use crate::decode_node::{DecodeCmd, RequestBody};
use crate::link_security::parse_fingerprint;
use crate::links::{CommitExtra, ReplyTo, WriterLink};
use crate::net::{Conn, Control, Frame, FrameLimits, FrameReader, LinkEnd, WireEvent};
use crate::prefill_node::PrefillCmd;
use std::io;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_engine::sink::{EventSink, Gone};
use tessera_engine::Event;
use tessera_transfer::inproc::PageLanding;
use tessera_transfer::protocol::{Msg, ReqId, Role};
/// How long a control connection may take from accept to its hello (TLS handshake
/// included), however it trickles its bytes or pings.
pub(crate) const CONTROL_HEAD_DEADLINE: Duration = Duration::from_secs(10);
/// Most control connections at once (gateways and prefill peers, one link each).
pub(crate) const MAX_CONTROL_CONNECTIONS: usize = 1024;
/// Most control connections before their hello; a new one past the cap cuts the one
/// that has been in its head the longest ([`crate::conn_gate`]).
pub(crate) const MAX_CONTROL_HEADS: usize = 64;

pub(super) async fn accept_loop(node: Arc<NodeState>, listener: tokio::net::TcpListener) {
    let gate = HeadGate::new(MAX_CONTROL_CONNECTIONS, MAX_CONTROL_HEADS);
    loop {
        match listener.accept().await {
            Ok((tcp, peer)) => {
                let (cut_tx, cut) = tokio::sync::oneshot::channel::<()>();
                let Some(ticket) = gate.admit(Box::new(move || {
                    let _ = cut_tx.send(());
                })) else {
                    tracing::warn!(%peer, "refused a node link: every connection slot is taken");
                    continue;
                };
                let n = node.clone();
                tokio::spawn(async move { n.serve(tcp, peer.to_string(), ticket, cut).await });
            }
            Err(e) => {
                // Out of file descriptors or memory: back off instead of spinning.
                tracing::warn!(error = %e, "accepting a node link failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

/// One accepted link, after its hello.
struct Link {
    id: u64,
    from: Role,
    conn: Arc<Conn>,
    reply: ReplyTo,
    unknown: Budget,
    control_frames: u64,
    /// A prefill peer as a request's writer (its name and this connection).
    writer: WriterLink,
}

impl NodeState {
    /// Serves one accepted connection: handshake, hello, then frames until it ends.
    /// The head (handshake and hello) must be done by [`CONTROL_HEAD_DEADLINE`] and
    /// ends early when `cut` fires (the slot is given to a newer connection).
    async fn serve(
        self: Arc<Self>,
        tcp: tokio::net::TcpStream,
        peer: String,
        mut ticket: Ticket,
        mut cut: tokio::sync::oneshot::Receiver<()>,
    ) {
        let s = self.links.settings();
        let deadline = tokio::time::Instant::now() + CONTROL_HEAD_DEADLINE;
        let late = || {
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no hello within {CONTROL_HEAD_DEADLINE:?} of connecting"),
            )
        };
        let accepted = tokio::select! {
            r = tokio::time::timeout_at(deadline, self.links.accept(tcp)) => r.unwrap_or_else(|_| Err(late())),
            _ = &mut cut => Err(io::Error::other("cut to make room for another connection")),
        };
        let (r, w, cert) = match accepted {
            Ok(x) => x,
            Err(e) => {
                self.counters.peers_refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%peer, error = %e, "refused a node link: TLS handshake failed");
                return;
            }
        };
        let conn = Conn::start(w, peer.clone(), s);
        let limits = FrameLimits {
            max_header: s.max_header,
            page_bytes: None,
            adapters: true,
        };
        let mut reader = FrameReader::new(r, limits, s.dead_after);
        let hello = tokio::select! {
            r = tokio::time::timeout_at(deadline, reader.next_on(&conn)) => {
                r.unwrap_or_else(|_| Err(LinkEnd::Closed(late().to_string())))
            }
            _ = &mut cut => Err(LinkEnd::Closed("cut to make room for another connection".into())),
        };
        let hello = if ticket.head_done() {
            hello
        } else {
            Err(LinkEnd::Closed(
                "cut to make room for another connection".into(),
            ))
        };
        let (from, hello_name, hello_model) = match hello {
            Ok((Frame::Hello { from, name, model }, _)) => (from, name, model),
            Ok((f, _)) => {
                let end = LinkEnd::Violation(format!("a {} frame before hello", f.kind()));
                end.note(&peer, &self.counters);
                conn.close();
                return;
            }
            Err(end) => {
                end.note(&peer, &self.counters);
                conn.close();
                return;
            }
        };
        let proven = match self
            .links
            .authorize(&cert, from, self.role, hello_model.as_deref())
        {
            Ok(address) => address,
            Err(why) => {
                self.counters.peers_refused.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%peer, ?from, "refused a node link: {why}");
                conn.close();
                return;
            }
        };
        // A prefill peer's name, what decode records name as a request's writer: the
        // address its certificate proves (TLS), else what it says (loopback only).
        let writer = WriterLink {
            name: proven.or(hello_name).unwrap_or_else(|| peer.clone()),
            link: Some(conn.clone()),
        };
        let id = self.next_conn.fetch_add(1, Ordering::Relaxed);
        if from == Role::Prefill {
            reader.take_pages(self.page_bytes);
            if let NodeCmds::Decode(tx) = &self.cmds {
                // Also where the decode node asks this writer whether it is quiet.
                let _ = tx.send(DecodeCmd::WriterLink {
                    name: writer.name.clone(),
                    id,
                    to: Some(conn.clone()),
                });
            }
        }
        conn.try_send(
            &Frame::Welcome {
                incarnation: self.incarnation,
                // A decode node moving KV writes with frames: no rkey of this pool.
                ucx: (from == Role::Prefill && !self.links.is_decode_writer(&writer.name))
                    .then(|| self.region.clone())
                    .flatten(),
                draining: self.draining(),
                model: self.links.model(),
            },
            &[],
        );
        self.registry.add(&conn);
        if from == Role::Coordinator {
            self.gateways.add(&conn);
        }
        let mut link = Link {
            id,
            from,
            reply: Arc::new(CoordReply {
                conn: conn.clone(),
                carried: self.carried.clone(),
            }),
            conn,
            unknown: Budget::new(),
            control_frames: 0,
            writer,
        };
        let end = loop {
            match reader.next_on(&link.conn).await {
                Ok((frame, payload)) => {
                    if let Err(why) = self.on_frame(&mut link, frame, payload) {
                        break LinkEnd::Violation(why);
                    }
                }
                Err(end) => break end,
            }
        };
        end.note(&peer, &self.counters);
        if let (Role::Prefill, NodeCmds::Decode(tx)) = (from, &self.cmds) {
            // Nothing it issued on this link can land any more (no frame of it is
            // read after this). Told before the link is closed, so whoever sees it
            // closed knows the engine thread hears of it before any later command.
            let _ = tx.send(DecodeCmd::WriterLink {
                name: link.writer.name.clone(),
                id: link.id,
                to: None,
            });
        }
        link.conn.close();
        // The coordinator is gone: nobody will finish or abort its requests, so the
        // protocol aborts them (answers into the closed connection are dropped).
        if from == Role::Coordinator {
            self.adapters.forget_link(link.id);
            for req in self.carried.take(link.id) {
                self.cmds.coordinator_lost(req);
                if let Some(mover) = &self.mover {
                    let _ = mover.send(PrefillCmd::CoordinatorLost(req));
                }
            }
        }
    }

    /// A message about `req` from a coordinator link that did not bring it: only
    /// within the link's budget, and never one about another link's request.
    /// Returns whether to pass it on.
    fn about_unknown(&self, link: &mut Link, req: ReqId) -> Result<bool, String> {
        match self.carried.carrier(req) {
            Some(c) if c == link.id => return Ok(true),
            Some(_) => {
                tracing::warn!(?req, "dropped a message about another link's request");
            }
            None => {}
        }
        if !link.unknown.spend() {
            return Err(format!(
                "more than {UNKNOWN_BURST} messages (then {UNKNOWN_PER_SEC}/s) about requests this link never carried"
            ));
        }
        Ok(self.carried.carrier(req).is_none())
    }

    /// A coordinator's message for this node's writer (a prefill node's, or a decode
    /// node's that moves drained requests' KV): `Prefill` with its body and decode
    /// node, or `Abort`.
    fn to_writer(
        &self,
        link: &mut Link,
        c: Control,
        tx: &std::sync::mpsc::Sender<PrefillCmd>,
    ) -> Result<(), String> {
        let gone = || "the engine thread is gone".to_string();
        let Control {
            msg,
            body,
            decode,
            decode_node,
            trace,
            moves,
            ..
        } = c;
        let req = msg.req();
        let body = match (&msg, body.zip(decode)) {
            (Msg::Prefill { .. }, Some((body, decode))) => {
                // By address when the gateway names one (its index may
                // follow another order than this node's file), else by
                // index into this node's file (an older gateway).
                let decode = match (decode_node, &self.peer_links) {
                    (Some(addr), Some(peers)) => peers.index_of(&addr)?,
                    _ if decode >= self.decode_peers => {
                        return Err(format!("a Prefill for decode node {decode}, which the deployment does not have"));
                    }
                    _ => decode,
                };
                if !self.carried.claim(req, link.id) {
                    return Err(format!("Prefill for {req:?}, which another link carries"));
                }
                // Claimed first: the drain sees it carried before it stops waiting.
                if let Some(old) = moves {
                    self.kept.lock().unwrap().remove(&old);
                }
                let mut body = body;
                self.adapters.attach(link.id, &mut body);
                Some((body, decode, valid_traceparent(trace)))
            }
            (Msg::Prefill { .. }, None) => {
                return Err("a Prefill without its request body and decode node".into())
            }
            (Msg::Abort { .. }, _) => {
                if !self.about_unknown(link, req)? {
                    return Ok(());
                }
                None
            }
            (m, _) => {
                return Err(format!(
                    "a coordinator may not send {} to a writer",
                    msg_name(m)
                ))
            }
        };
        tx.send(PrefillCmd::FromCoordinator {
            msg,
            reply: link.reply.clone(),
            body,
        })
        .map_err(|_| gone())
    }

    /// Turns one frame into the engine thread's command, or says why the peer may not
    /// send it (the link is then closed). Never blocks.
    fn on_frame(
        self: &Arc<Self>,
        link: &mut Link,
        frame: Frame,
        payload: Vec<u8>,
    ) -> Result<(), String> {
        if matches!(frame, Frame::Control { .. }) {
            link.control_frames += 1;
            if link.control_frames == 1 && self.test_panic == Some(TestPanic::Connection) {
                panic!(
                    "TESSERA_TEST_NODE_PANIC=connection: a test-only panic on a connection task"
                );
            }
        }
        let gone = || "the engine thread is gone".to_string();
        match (frame, &self.cmds, link.from) {
            (Frame::Unkeep { req }, NodeCmds::Decode(_), Role::Coordinator) => {
                self.kept.lock().unwrap().remove(&req);
                Ok(())
            }
            (
                Frame::Adapter {
                    id,
                    sha256,
                    offset,
                    total,
                },
                _,
                Role::Coordinator,
            ) => self
                .adapters
                .receive(link.id, id, sha256, offset, total, &payload),
            (Frame::Drain, _, Role::Coordinator) => {
                self.begin_drain("a drain request from a gateway identity");
                Ok(())
            }
            (Frame::Cache { id, query }, cmds, Role::Coordinator) => {
                // Answered from the engine thread, after the steps already queued.
                let conn = link.conn.clone();
                let job = Box::new(move |e: &mut tessera_engine::Engine| {
                    let answer = query.run(e);
                    conn.try_send(&Frame::CacheAnswer { id, answer }, &[]);
                });
                let sent = match cmds {
                    NodeCmds::Decode(tx) => tx.send(DecodeCmd::WithEngine(job)).is_ok(),
                    NodeCmds::Prefill(tx) => tx.send(PrefillCmd::WithEngine(job)).is_ok(),
                };
                sent.then_some(()).ok_or_else(gone)
            }
            (Frame::Control(c), NodeCmds::Decode(_), Role::Coordinator) if c.to_writer => {
                match &self.mover {
                    Some(tx) => self.to_writer(link, c, tx),
                    None => Err("a frame for the writer of a decode node without one".into()),
                }
            }
            (
                Frame::Control(Control {
                    msg,
                    body,
                    prefill,
                    trace,
                    ..
                }),
                NodeCmds::Decode(tx),
                Role::Coordinator,
            ) => {
                let req = msg.req();
                let body = match (&msg, body) {
                    (Msg::Prealloc { .. }, Some(body)) => {
                        if !self.carried.claim(req, link.id) {
                            return Err(format!(
                                "Prealloc for {req:?}, which another link carries"
                            ));
                        }
                        tracing::debug!(?req, "a new request from a gateway");
                        let mut body = body;
                        self.adapters.attach(link.id, &mut body);
                        Some(Box::new(RequestBody {
                            req: Some(body),
                            sink: Box::new(ConnSink {
                                conn: link.conn.clone(),
                                req,
                            }),
                            submitted: Instant::now(),
                            writer: prefill,
                            trace: valid_traceparent(trace),
                        }))
                    }
                    (Msg::Prealloc { .. }, None) => {
                        return Err("a Prealloc without its request body".into())
                    }
                    (Msg::Abort { .. } | Msg::Poll { .. }, _) => {
                        if !self.about_unknown(link, req)? {
                            return Ok(());
                        }
                        None
                    }
                    (m, _) => {
                        return Err(format!(
                            "a coordinator may not send {} to a decode node",
                            msg_name(m)
                        ))
                    }
                };
                tx.send(DecodeCmd::FromCoordinator {
                    msg,
                    reply: link.reply.clone(),
                    body,
                })
                .map_err(|_| gone())
            }
            (
                Frame::Control(Control {
                    msg,
                    rng_pos,
                    cached_tokens,
                    cached_tiers,
                    model,
                    logprobs,
                    ..
                }),
                NodeCmds::Decode(tx),
                Role::Prefill,
            ) => {
                // Usage counts only: never more from the tiers than was cached.
                let cached_tokens = cached_tokens.unwrap_or(0);
                let t = cached_tiers.unwrap_or_default();
                let host = t.host.min(cached_tokens);
                let cached_tiers = tessera_engine::CachedTiers {
                    host,
                    disk: t.disk.min(cached_tokens - host),
                };
                if !matches!(
                    msg,
                    Msg::Commit { .. } | Msg::Renew { .. } | Msg::WriterQuiet { .. }
                ) {
                    return Err(format!(
                        "a prefill node may not send {} to a decode node",
                        msg_name(&msg)
                    ));
                }
                tx.send(DecodeCmd::FromPrefill {
                    msg,
                    extra: CommitExtra {
                        rng_pos: rng_pos.unwrap_or(0),
                        cached_tokens,
                        cached_tiers,
                        model: model.as_deref().map(parse_fingerprint),
                        logprobs,
                    },
                    from: link.writer.clone(),
                })
                .map_err(|_| gone())
            }
            (Frame::Control(c), NodeCmds::Prefill(tx), Role::Coordinator) => {
                self.to_writer(link, c, tx)
            }
            (Frame::Land { req, dest }, NodeCmds::Decode(tx), Role::Prefill) => tx
                .send(DecodeCmd::Land {
                    landing: PageLanding {
                        req,
                        dest,
                        bytes: payload,
                    },
                    from: link.writer.clone(),
                })
                .map_err(|_| gone()),
            (Frame::Flush { id }, NodeCmds::Decode(tx), Role::Prefill) => {
                let c = link.conn.clone();
                let ack = Box::new(move || {
                    c.try_send(&Frame::FlushAck { id }, &[]);
                });
                tx.send(DecodeCmd::AfterEarlier(ack)).map_err(|_| gone())
            }
            (f, _, from) => Err(format!("a {} frame from a {from:?} peer", f.kind())),
        }
    }
}

fn msg_name(m: &Msg) -> &'static str {
    match m {
        Msg::Prealloc { .. } => "Prealloc",
        Msg::Descriptor { .. } => "Descriptor",
        Msg::Rejected { .. } => "Rejected",
        Msg::Prefill { .. } => "Prefill",
        Msg::Commit { .. } => "Commit",
        Msg::Committed { .. } => "Committed",
        Msg::CommitFailed { .. } => "CommitFailed",
        Msg::Finished { .. } => "Finished",
        Msg::PrefillFailed { .. } => "PrefillFailed",
        Msg::Abort { .. } => "Abort",
        Msg::AbortAck { .. } => "AbortAck",
        Msg::Poll { .. } => "Poll",
        Msg::LeaseExpired { .. } => "LeaseExpired",
        Msg::Renew { .. } => "Renew",
        Msg::WriterQuiet { .. } => "WriterQuiet",
        Msg::QuietQuery { .. } => "QuietQuery",
    }
}

/// A decode node's stream of one request's events into the gateway connection the
/// request came on. Never blocks: a gateway that stopped reading loses its link.
struct ConnSink {
    conn: Arc<Conn>,
    req: ReqId,
}

impl EventSink for ConnSink {
    fn send(&mut self, event: Event) -> Result<(), Gone> {
        let event = WireEvent::from_event(event);
        if self.conn.try_send(
            &Frame::Event {
                req: self.req,
                event,
            },
            &[],
        ) {
            Ok(())
        } else {
            Err(Gone)
        }
    }
}

/// A peer's `traceparent`, kept only when it is one: `00-<32 hex>-<16 hex>-<2 hex>`
/// (55 bytes). Anything else is dropped, so a peer cannot make the node log or
/// export arbitrary text.
fn valid_traceparent(t: Option<String>) -> Option<String> {
    let t = t?;
    let b = t.as_bytes();
    let hex = |r: std::ops::Range<usize>| b[r].iter().all(|c| c.is_ascii_hexdigit());
    let ok = b.len() == 55
        && b[2] == b'-'
        && b[35] == b'-'
        && b[52] == b'-'
        && hex(0..2)
        && hex(3..35)
        && hex(36..52)
        && hex(53..55);
    ok.then_some(t)
}
