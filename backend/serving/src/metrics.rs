//! Node metrics (Prometheus, through `prometheus-client`): KV pages by state, queue
//! depth, the integrity counters where their checks fail (tag mismatches by reader,
//! refused commits by reason, dropped late writes) and KV transfer bytes and time.
//!
//! One [`NodeMetrics`] per process holds the metric families and their registry:
//! a `tessera node` process serves it on `--metrics-listen` ([`serve_metrics`]); an
//! in-process deployment (`tessera serve`) appends it to the gateway's `/metrics`.
//! Every node of the process gets its own series through its `node` and `role`
//! labels ([`NodeMetrics::node`]); the handles a node keeps are resolved once, so an
//! update on a hot path is one atomic operation.
//!
//! Names carry their unit; counters end in `_total` (the encoder appends it to the
//! registered name).

use crate::conn_gate::{HeadGate, Ticket};
use crate::links::PdCounters;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::io::{self, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_engine::{Engine, EngineMetrics, PageStates};
use tessera_transfer::protocol::CommitError;

/// A node's identity in its series.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabels {
    node: String,
    role: &'static str,
}

/// A node's speculation series: where the drafts came from.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct SpecLabels {
    node: String,
    role: &'static str,
    mode: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PageLabels {
    node: String,
    role: &'static str,
    state: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReaderLabels {
    node: String,
    role: &'static str,
    reader: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    node: String,
    role: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabels {
    node: String,
    role: &'static str,
    tier: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierEventLabels {
    node: String,
    role: &'static str,
    tier: &'static str,
    event: &'static str,
}

/// The `(tier, event)` labels of `tessera_kv_tier_events_total`, in the order
/// [`tier_event_counts`] returns them.
pub const TIER_EVENTS: [(&str, &str); 7] = [
    ("host", "spill"),
    ("disk", "spill"),
    ("host", "restore"),
    ("disk", "restore"),
    ("disk", "open_failure"),
    ("host", "purge"),
    ("disk", "purge"),
];

/// An engine's lower-tier counts in [`TIER_EVENTS`] order.
fn tier_event_counts(s: tessera_model::kv::spill::SpillStats) -> [u64; 7] {
    [
        s.spilled_host,
        s.spilled_disk,
        s.restored_host,
        s.restored_disk,
        s.open_failures,
        s.purged_host,
        s.purged_disk,
    ]
}

type HistogramFamily<S> = Family<S, Histogram, fn() -> Histogram>;

fn transfer_histogram() -> Histogram {
    // 100 us .. ~13 s.
    Histogram::new(exponential_buckets(0.0001, 2.0, 18))
}

/// Every [`CommitError`]'s reason label, in declaration order.
pub const COMMIT_REASONS: [&str; 9] = [
    "unknown_request",
    "not_awaiting_commit",
    "token_count",
    "page_count",
    "unexpected_page",
    "duplicate_page",
    "tag_mismatch",
    "checksum_mismatch",
    "foreign_write",
];

/// The stable label of a refused commit's reason (one of [`COMMIT_REASONS`]).
pub fn commit_reason(e: &CommitError) -> &'static str {
    match e {
        CommitError::UnknownRequest => "unknown_request",
        CommitError::NotAwaitingCommit => "not_awaiting_commit",
        CommitError::TokenCount { .. } => "token_count",
        CommitError::PageCount { .. } => "page_count",
        CommitError::UnexpectedPage { .. } => "unexpected_page",
        CommitError::DuplicatePage { .. } => "duplicate_page",
        CommitError::TagMismatch { .. } => "tag_mismatch",
        CommitError::ChecksumMismatch { .. } => "checksum_mismatch",
        CommitError::ForeignWrite { .. } => "foreign_write",
    }
}

/// The `reason` labels of `tessera_node_link_violations_total` on a decode node (the
/// violations of its prefill peers): a write or commit for a request that peer was
/// not assigned (`not_routed`), a message a prefill node does not send
/// (`wrong_sender`), a write the protocol refuses (into pages not awaiting one:
/// `refused_write`), a page the engine cannot take (`malformed_page`).
pub const NODE_VIOLATIONS: [&str; 4] = [
    "not_routed",
    "wrong_sender",
    "refused_write",
    "malformed_page",
];

/// The `reason` labels of `tessera_node_link_violations_total` on a gateway (series
/// `node="gateway"`, `role="coordinator"`: the violations of the nodes it dials): a
/// message or stream event about a request not routed to that link (`not_routed`,
/// [`LinkViolation::NotRouted`](tessera_transfer::protocol::LinkViolation)), a
/// message the node's role does not send to a coordinator (`wrong_sender`), a frame
/// kind a node may not send at all (`frame_kind`).
pub const GATEWAY_VIOLATIONS: [&str; 3] = ["not_routed", "wrong_sender", "frame_kind"];

/// The `state` labels of `tessera_kv_pages`, in the order [`page_counts`] returns
/// them; the five sum to the pool's capacity.
pub const PAGE_STATES: [&str; 5] = ["free", "reserved", "in_use", "cached", "quarantined"];

/// Pages per [`PAGE_STATES`] entry: the engine's states, with the `quarantined`
/// pages (which the engine holds as reserved: it does not know the protocol's
/// states) moved out of `reserved`.
pub fn page_counts(s: PageStates, quarantined: usize) -> [usize; 5] {
    let q = quarantined.min(s.reserved);
    [s.free, s.reserved - q, s.in_use, s.cached, q]
}

/// The metric families of every node in this process, and their registry.
#[derive(Debug)]
pub struct NodeMetrics {
    registry: Registry,
    kv_pages: Family<PageLabels, Gauge>,
    queue_depth: Family<NodeLabels, Gauge>,
    tag_mismatches: Family<ReaderLabels, Counter>,
    commits_rejected: Family<ReasonLabels, Counter>,
    late_writes_dropped: Family<NodeLabels, Counter>,
    link_violations: Family<ReasonLabels, Counter>,
    frames_rejected: Family<NodeLabels, Counter>,
    peers_refused: Family<NodeLabels, Counter>,
    request_restarts: Family<ReasonLabels, Counter>,
    spec_drafted: Family<SpecLabels, Counter>,
    spec_accepted: Family<SpecLabels, Counter>,
    cache_pages_purged: Family<NodeLabels, Counter>,
    tier_pages: Family<TierLabels, Gauge>,
    tier_events: Family<TierEventLabels, Counter>,
    /// The link counters exported from [`PdCounters`] (synced when encoded), by the
    /// series they feed.
    link_sources: Mutex<Vec<(NodeLabels, Arc<PdCounters>)>>,
    transfer_bytes: Family<NodeLabels, Counter>,
    transfer_seconds: HistogramFamily<NodeLabels>,
}

impl Default for NodeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl NodeMetrics {
    /// Empty families, registered.
    pub fn new() -> Self {
        let mut m = Self {
            registry: Registry::default(),
            kv_pages: Family::default(),
            queue_depth: Family::default(),
            tag_mismatches: Family::default(),
            commits_rejected: Family::default(),
            late_writes_dropped: Family::default(),
            link_violations: Family::default(),
            frames_rejected: Family::default(),
            peers_refused: Family::default(),
            request_restarts: Family::default(),
            spec_drafted: Family::default(),
            spec_accepted: Family::default(),
            cache_pages_purged: Family::default(),
            tier_pages: Family::default(),
            tier_events: Family::default(),
            link_sources: Mutex::new(Vec::new()),
            transfer_bytes: Family::default(),
            transfer_seconds: Family::new_with_constructor(transfer_histogram),
        };
        let r = &mut m.registry;
        r.register(
            "tessera_kv_pages",
            "KV pages by state (free, reserved: held for a transfer or an export, in_use: held by running sequences, cached: held by the prefix cache, evictable unless reused, quarantined: a decode reservation whose coordinator is gone or whose lease ran out, never read, held until its writer is known quiet)",
            m.kv_pages.clone(),
        );
        r.register(
            "tessera_queue_depth",
            "Requests waiting on the node (for a batch slot, or for pages)",
            m.queue_depth.clone(),
        );
        r.register(
            "tessera_kv_tag_mismatches",
            "KV page tag checks that failed (I3), by reader: attention, transfer_source (export), transfer_sink (commit check). Any is an incident",
            m.tag_mismatches.clone(),
        );
        r.register(
            "tessera_kv_commits_rejected",
            "KV transfer commits the decode node refused (I4), by reason",
            m.commits_rejected.clone(),
        );
        r.register(
            "tessera_kv_late_writes_dropped",
            "Page writes dropped, never applied: late writes to a reservation that ended or was quarantined, and refused writes (from a node that is not the request's writer, or to pages not awaiting one)",
            m.late_writes_dropped.clone(),
        );
        r.register(
            "tessera_node_link_violations",
            "Protocol violations by a peer, by reason, counted where they were refused (node and role: a decode node for its prefill peers; node=gateway, role=coordinator for the nodes a gateway dials): a message, stream event, write or commit about a request not routed to that link (not_routed), a message the peer's role does not send (wrong_sender), a frame kind the peer may not send (frame_kind), a write into pages not awaiting one (refused_write), a malformed page (malformed_page). Each cuts that peer's link",
            m.link_violations.clone(),
        );
        r.register(
            "tessera_node_frames_rejected",
            "Node-link frames refused at the link (a header over the cap, a page payload that is not one page, a malformed header, a frame the peer may not send, a budget spent, a protocol violation); each closes its connection",
            m.frames_rejected.clone(),
        );
        r.register(
            "tessera_node_peers_refused",
            "Node-link peers refused before their first frame was served (a failed TLS handshake, a Hello whose role the certificate does not carry; on a gateway, a node that failed its identity or model check)",
            m.peers_refused.clone(),
        );
        r.register(
            "tessera_request_restarts",
            "Requests a node's failure or drain hit, by what the gateway did (node=gateway, role=coordinator): restarted (from the beginning on another pair, before the first token), continued (on another pair from the tokens the client had), moved (a draining decode node's request, on another decode node with its KV moved from the draining one), not_restarted (no pair left, the attempt bound or the deadline reached: the client got an error)",
            m.request_restarts.clone(),
        );
        r.register(
            "tessera_spec_drafted_tokens",
            "Draft tokens fed to a decoding engine's forward passes, by mode: ngram (prompt lookup, from the request's own prompt and output) or draft (the model's draft model)",
            m.spec_drafted.clone(),
        );
        r.register(
            "tessera_spec_accepted_tokens",
            "Draft tokens accepted: each equalled the token sampled at its position and saved its request one forward pass (accepted / drafted is the acceptance rate)",
            m.spec_accepted.clone(),
        );
        r.register(
            "tessera_kv_cache_purged_pages",
            "Prefix-cache pages dropped by tenant cache purges (DELETE .../ai/cache, tessera tenant purge-cache): freed at once, or poisoned and freed when the request still reading them ends",
            m.cache_pages_purged.clone(),
        );
        r.register(
            "tessera_kv_tier_pages",
            "Prefix-cache pages spilled to the lower tiers (host memory, sealed files on disk), by tier",
            m.tier_pages.clone(),
        );
        r.register(
            "tessera_kv_tier_events",
            "Prefix-cache pages moved through the lower tiers, by tier and event: spill (evicted for room from the pool or moved down from host memory), restore (brought back into the pool on a hit), open_failure (a sealed page that did not open: tampered, moved or its key forgotten; answered as a miss, any is worth a look), purge (dropped by a tenant cache purge)",
            m.tier_events.clone(),
        );
        r.register(
            "tessera_kv_transfer_bytes",
            "KV page bytes a prefill node put into decode nodes",
            m.transfer_bytes.clone(),
        );
        r.register(
            "tessera_kv_transfer_seconds",
            "Time to put and flush one request's KV pages (prefill node, transfer worker)",
            m.transfer_seconds.clone(),
        );
        m
    }

    /// The handles of node `node` (its address, or `decode-0` in one process) of
    /// `role` (`prefill`, `decode`, `colocated`). Its counters exist from now on, at
    /// zero, so `rate()` and alerts see them before the first event.
    pub(crate) fn node(&self, node: &str, role: &'static str) -> NodeHandles {
        let labels = NodeLabels {
            node: node.to_string(),
            role,
        };
        let page = |state: &'static str| {
            self.kv_pages.get_or_create_owned(&PageLabels {
                node: node.to_string(),
                role,
                state,
            })
        };
        let reader = |reader| {
            self.tag_mismatches.get_or_create_owned(&ReaderLabels {
                node: node.to_string(),
                role,
                reader,
            })
        };
        let spec = |family: &Family<SpecLabels, Counter>| {
            ["ngram", "draft"].map(|mode| {
                family.get_or_create_owned(&SpecLabels {
                    node: node.to_string(),
                    role,
                    mode,
                })
            })
        };
        let decode = role == "decode";
        let commits = if decode {
            COMMIT_REASONS
                .iter()
                .map(|&reason| {
                    self.commits_rejected.get_or_create_owned(&ReasonLabels {
                        node: node.to_string(),
                        role,
                        reason,
                    })
                })
                .collect()
        } else {
            Vec::new()
        };
        let tier = |tier| {
            self.tier_pages.get_or_create_owned(&TierLabels {
                node: node.to_string(),
                role,
                tier,
            })
        };
        let tier_events = TIER_EVENTS.map(|(tier, event)| {
            self.tier_events.get_or_create_owned(&TierEventLabels {
                node: node.to_string(),
                role,
                tier,
                event,
            })
        });
        NodeHandles {
            pages: PAGE_STATES.map(page),
            tier_pages: [tier("host"), tier("disk")],
            tier_events,
            queue: self.queue_depth.get_or_create_owned(&labels),
            engine: EngineMetrics {
                attention_tag_mismatches: reader("attention"),
                transfer_source_tag_mismatches: reader("transfer_source"),
                spec_drafted: spec(&self.spec_drafted),
                spec_accepted: spec(&self.spec_accepted),
                cache_pages_purged: self.cache_pages_purged.get_or_create_owned(&labels),
            },
            sink_tag_mismatches: decode.then(|| reader("transfer_sink")),
            commits,
            late_writes: decode.then(|| self.late_writes_dropped.get_or_create_owned(&labels)),
            link_violations: if decode {
                NODE_VIOLATIONS
                    .iter()
                    .map(|&reason| {
                        self.link_violations.get_or_create_owned(&ReasonLabels {
                            node: node.to_string(),
                            role,
                            reason,
                        })
                    })
                    .collect()
            } else {
                Vec::new()
            },
            transfer_bytes: (role == "prefill")
                .then(|| self.transfer_bytes.get_or_create_owned(&labels)),
            transfer_seconds: (role == "prefill")
                .then(|| self.transfer_seconds.get_or_create_owned(&labels)),
        }
    }

    /// A gateway's `tessera_node_link_violations_total` counters, by
    /// [`GATEWAY_VIOLATIONS`] index (series `node="gateway"`, `role="coordinator"`,
    /// at zero from now on).
    pub(crate) fn gateway_violations(&self) -> Vec<Counter> {
        GATEWAY_VIOLATIONS
            .iter()
            .map(|&reason| {
                self.link_violations.get_or_create_owned(&ReasonLabels {
                    node: "gateway".into(),
                    role: "coordinator",
                    reason,
                })
            })
            .collect()
    }

    /// Exports `counters`' `frames_rejected` and `peers_refused` as the series of
    /// `node` and `role` (at zero from now on; several sources of one series add up).
    pub(crate) fn watch_links(&self, node: &str, role: &'static str, counters: Arc<PdCounters>) {
        let labels = NodeLabels {
            node: node.to_string(),
            role,
        };
        let _ = self.frames_rejected.get_or_create(&labels);
        let _ = self.peers_refused.get_or_create(&labels);
        // Restarts are a coordinator's decision: only a gateway exports them.
        for reason in RESTART_KINDS.into_iter().filter(|_| role == "coordinator") {
            let _ = self.request_restarts.get_or_create(&ReasonLabels {
                node: node.to_string(),
                role,
                reason,
            });
        }
        self.link_sources.lock().unwrap().push((labels, counters));
    }

    /// Brings the series fed by [`PdCounters`] up to their counters' values.
    fn sync_links(&self) {
        let sources = self.link_sources.lock().unwrap();
        let mut sums: Vec<(&NodeLabels, u64, u64)> = Vec::new();
        for (labels, c) in sources.iter() {
            let (f, p) = (
                c.frames_rejected.load(Ordering::Relaxed),
                c.peers_refused.load(Ordering::Relaxed),
            );
            match sums.iter_mut().find(|(l, ..)| *l == labels) {
                Some(s) => (s.1, s.2) = (s.1 + f, s.2 + p),
                None => sums.push((labels, f, p)),
            }
        }
        for (labels, f, p) in sums {
            for (family, v) in [(&self.frames_rejected, f), (&self.peers_refused, p)] {
                let c = family.get_or_create(labels);
                c.inc_by(v.saturating_sub(c.get()));
            }
        }
        let mut restarts: Vec<(ReasonLabels, u64)> = Vec::new();
        for (labels, c) in sources.iter().filter(|(l, _)| l.role == "coordinator") {
            for (reason, v) in [
                ("restarted", &c.restarted),
                ("continued", &c.continued),
                ("moved", &c.moved),
                ("not_restarted", &c.not_restarted),
            ] {
                let key = ReasonLabels {
                    node: labels.node.clone(),
                    role: labels.role,
                    reason,
                };
                let v = v.load(Ordering::Relaxed);
                match restarts.iter_mut().find(|(l, _)| *l == key) {
                    Some(s) => s.1 += v,
                    None => restarts.push((key, v)),
                }
            }
        }
        for (labels, v) in restarts {
            let c = self.request_restarts.get_or_create(&labels);
            c.inc_by(v.saturating_sub(c.get()));
        }
    }

    /// Appends the OpenMetrics text of every family (no `# EOF`: the caller may
    /// append more and ends the message).
    pub fn encode(&self, out: &mut String) -> std::fmt::Result {
        self.sync_links();
        prometheus_client::encoding::text::encode_registry(out, &self.registry)
    }

    /// The whole exposition, `# EOF` included.
    pub fn render(&self) -> String {
        self.sync_links();
        let mut out = String::new();
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The `reason` values of `tessera_request_restarts`.
const RESTART_KINDS: [&str; 4] = ["restarted", "continued", "moved", "not_restarted"];

/// One node's resolved metric handles (cheap to clone: each is an `Arc`).
#[derive(Clone, Debug)]
pub(crate) struct NodeHandles {
    /// By [`PAGE_STATES`] index.
    pages: [Gauge; 5],
    /// Spilled pages in (host, disk).
    tier_pages: [Gauge; 2],
    /// By [`TIER_EVENTS`] index.
    tier_events: [Counter; 7],
    queue: Gauge,
    engine: EngineMetrics,
    sink_tag_mismatches: Option<Counter>,
    /// By [`COMMIT_REASONS`] index (decode nodes).
    commits: Vec<Counter>,
    late_writes: Option<Counter>,
    /// By [`NODE_VIOLATIONS`] index (decode nodes).
    link_violations: Vec<Counter>,
    transfer_bytes: Option<Counter>,
    transfer_seconds: Option<Histogram>,
}

impl NodeHandles {
    /// The counters the node's engine increments.
    pub(crate) fn engine_metrics(&self) -> EngineMetrics {
        self.engine.clone()
    }

    /// Publishes the engine's page states and queue (`waiting_extra`: requests the
    /// node queues outside the engine; `quarantined`: pages of quarantined
    /// reservations, which the engine counts as reserved).
    pub(crate) fn publish(&self, e: &Engine, waiting_extra: usize, quarantined: usize) {
        for (g, v) in self
            .pages
            .iter()
            .zip(page_counts(e.page_states(), quarantined))
        {
            g.set(v as i64);
        }
        self.queue.set((e.waiting_len() + waiting_extra) as i64);
        let (host, disk) = e.kv().spilled_pages();
        self.tier_pages[0].set(host as i64);
        self.tier_pages[1].set(disk as i64);
        // The engine keeps running totals: each counter catches up to its total.
        for (c, total) in self
            .tier_events
            .iter()
            .zip(tier_event_counts(e.kv().spill_stats()))
        {
            c.inc_by(total.saturating_sub(c.get()));
        }
    }

    /// A refused commit (decode node): by reason, and a tag mismatch at the transfer
    /// sink when that is the reason.
    pub(crate) fn commit_rejected(&self, e: &CommitError) {
        let reason = commit_reason(e);
        if let Some(i) = COMMIT_REASONS.iter().position(|r| *r == reason) {
            if let Some(c) = self.commits.get(i) {
                c.inc();
            }
        }
        if matches!(e, CommitError::TagMismatch { .. }) {
            if let Some(c) = &self.sink_tag_mismatches {
                c.inc();
            }
        }
    }

    /// A peer node broke the protocol (see `tessera_node_link_violations`);
    /// `reason`: one of [`NODE_VIOLATIONS`].
    pub(crate) fn link_violation(&self, reason: &str) {
        if let Some(i) = NODE_VIOLATIONS.iter().position(|r| *r == reason) {
            if let Some(c) = self.link_violations.get(i) {
                c.inc();
            }
        }
    }

    /// A page write dropped (decode node).
    pub(crate) fn late_write_dropped(&self) {
        if let Some(c) = &self.late_writes {
            c.inc();
        }
    }

    /// One request's pages put and flushed (prefill node): `bytes` in `took`.
    pub(crate) fn transferred(&self, bytes: u64, took: Duration) {
        if let Some(c) = &self.transfer_bytes {
            c.inc_by(bytes);
        }
        if let Some(h) = &self.transfer_seconds {
            h.observe(took.as_secs_f64());
        }
    }
}

/// Longest request head the metrics listener reads.
const MAX_HEAD: usize = 8 << 10;
/// How long a metrics client may take to send its whole request head.
pub const METRICS_HEAD_DEADLINE: Duration = Duration::from_secs(5);
/// Most metrics connections at once (each is a short-lived thread); a new one past
/// the cap cuts the one that has been sending its head the longest.
pub const MAX_METRICS_CONNECTIONS: usize = 64;

/// Serves `GET /metrics` (OpenMetrics text) on `listener` until the process exits:
/// plain HTTP/1.1, one request per connection, read-only. Anything else is answered
/// 404 (another path), 405 (another method) or 400 (not HTTP, a head over 8 KiB).
/// Each connection runs on its own short-lived thread, at most
/// [`MAX_METRICS_CONNECTIONS`] at once; a client that has not sent its whole head
/// within [`METRICS_HEAD_DEADLINE`] of connecting is disconnected (however it
/// trickles it), and when the cap is reached the connection that has been in its
/// head the longest is cut for the newcomer ([`crate::conn_gate`]), so slow
/// clients delay neither a scrape nor the node.
pub fn serve_metrics(listener: TcpListener, metrics: Arc<NodeMetrics>) {
    let gate = HeadGate::new(MAX_METRICS_CONNECTIONS, MAX_METRICS_CONNECTIONS);
    for stream in listener.incoming() {
        let Ok(stream) = stream else {
            // Out of file descriptors or similar: back off instead of spinning.
            std::thread::sleep(Duration::from_millis(50));
            continue;
        };
        let Ok(handle) = stream.try_clone() else {
            continue;
        };
        let Some(ticket) = gate.admit(Box::new(move || {
            let _ = handle.shutdown(std::net::Shutdown::Both);
        })) else {
            // Every slot is writing a response: refuse this one.
            continue;
        };
        let m = metrics.clone();
        let spawned = std::thread::Builder::new()
            .name("tessera-metrics-conn".into())
            .spawn(move || {
                if let Err(e) = answer(stream, ticket, &m) {
                    tracing::debug!(error = %e, "metrics connection ended");
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot start a metrics connection thread");
        }
    }
}

/// Reads a request head (up to the blank line) from `stream` by `deadline`:
/// `Some(head)` without the blank line, `None` when the client closed first or
/// the head is over [`MAX_HEAD`]; an error (`TimedOut`) at the deadline.
fn read_head(stream: &TcpStream, deadline: Instant) -> io::Result<Option<String>> {
    let mut head = Vec::with_capacity(512);
    let mut buf = [0u8; 1024];
    loop {
        let end = head
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .or_else(|| head.windows(2).position(|w| w == b"\n\n"));
        if let Some(end) = end {
            head.truncate(end);
            return Ok(Some(String::from_utf8_lossy(&head).into_owned()));
        }
        if head.len() >= MAX_HEAD {
            return Ok(None);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "no whole request head by the deadline",
            ));
        }
        stream.set_read_timeout(Some(left))?;
        let room = buf.len().min(MAX_HEAD - head.len());
        let n = (&*stream).read(&mut buf[..room])?;
        if n == 0 {
            return Ok(None);
        }
        head.extend_from_slice(&buf[..n]);
    }
}

fn answer(stream: TcpStream, mut ticket: Ticket, metrics: &NodeMetrics) -> io::Result<()> {
    let head = read_head(&stream, Instant::now() + METRICS_HEAD_DEADLINE)?;
    if !ticket.head_done() {
        return Err(io::Error::other("cut to make room for another connection"));
    }
    stream.set_write_timeout(Some(METRICS_HEAD_DEADLINE))?;
    let line = head
        .as_deref()
        .and_then(|h| h.lines().next())
        .unwrap_or_default();
    let mut parts = line.split_whitespace();
    let (method, path, version) = (parts.next(), parts.next(), parts.next());
    let (status, body, ctype) = match (method, path, version) {
        _ if head.is_none() => ("400 Bad Request", "bad request\n".to_string(), "text/plain"),
        (Some(_), Some(_), Some(v)) if !v.starts_with("HTTP/1.") => {
            ("400 Bad Request", "bad request\n".into(), "text/plain")
        }
        (Some("GET" | "HEAD"), Some(p), Some(_))
            if p == "/metrics" || p.starts_with("/metrics?") =>
        {
            (
                "200 OK",
                metrics.render(),
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
            )
        }
        (Some("GET" | "HEAD"), Some(_), Some(_)) => {
            ("404 Not Found", "not found\n".into(), "text/plain")
        }
        (Some(_), Some(_), Some(_)) => (
            "405 Method Not Allowed",
            "only GET /metrics\n".into(),
            "text/plain",
        ),
        _ => ("400 Bad Request", "bad request\n".into(), "text/plain"),
    };
    let head_only = method == Some("HEAD");
    let mut w = &stream;
    write!(
        w,
        "HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\nconnection: close\r\n{}\r\n",
        body.len(),
        if status.starts_with("405") {
            "allow: GET, HEAD\r\n"
        } else {
            ""
        }
    )?;
    if !head_only {
        w.write_all(body.as_bytes())?;
    }
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_commit_error_has_its_own_reason_label() {
        let errors = [
            CommitError::UnknownRequest,
            CommitError::NotAwaitingCommit,
            CommitError::TokenCount {
                expected: 1,
                got: 2,
            },
            CommitError::PageCount {
                expected: 1,
                got: 2,
            },
            CommitError::UnexpectedPage { page: 1 },
            CommitError::DuplicatePage { page: 1 },
            CommitError::TagMismatch { page: 1 },
            CommitError::ChecksumMismatch {
                page: 1,
                expected: 1,
                got: 2,
            },
            CommitError::ForeignWrite { page: 1 },
        ];
        let labels: Vec<&str> = errors.iter().map(commit_reason).collect();
        assert_eq!(labels, COMMIT_REASONS);
    }

    #[test]
    fn a_refused_commit_counts_its_reason_and_a_sink_tag_mismatch() {
        let m = NodeMetrics::new();
        let h = m.node("decode-0", "decode");
        h.commit_rejected(&CommitError::TagMismatch { page: 3 });
        h.commit_rejected(&CommitError::NotAwaitingCommit);
        h.commit_rejected(&CommitError::NotAwaitingCommit);
        h.late_write_dropped();
        let text = m.render();
        for line in [
            r#"tessera_kv_commits_rejected_total{node="decode-0",role="decode",reason="tag_mismatch"} 1"#,
            r#"tessera_kv_commits_rejected_total{node="decode-0",role="decode",reason="not_awaiting_commit"} 2"#,
            r#"tessera_kv_commits_rejected_total{node="decode-0",role="decode",reason="checksum_mismatch"} 0"#,
            r#"tessera_kv_tag_mismatches_total{node="decode-0",role="decode",reader="transfer_sink"} 1"#,
            r#"tessera_kv_tag_mismatches_total{node="decode-0",role="decode",reader="attention"} 0"#,
            r#"tessera_kv_late_writes_dropped_total{node="decode-0",role="decode"} 1"#,
            // Every page state has its series from the start, quarantined included.
            r#"tessera_kv_pages{node="decode-0",role="decode",state="quarantined"} 0"#,
            r#"tessera_kv_pages{node="decode-0",role="decode",state="reserved"} 0"#,
        ] {
            assert!(text.lines().any(|l| l == line), "{line} missing in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn quarantined_pages_move_out_of_reserved() {
        let s = PageStates {
            free: 10,
            reserved: 6,
            in_use: 3,
            cached: 1,
        };
        // The engine's 6 reserved pages: 4 of a quarantined reservation.
        assert_eq!(page_counts(s, 4), [10, 2, 3, 1, 4]);
        assert_eq!(page_counts(s, 0), [10, 6, 3, 1, 0]);
        // Never more quarantined than the engine holds reserved; the sum stays the
        // capacity.
        let c = page_counts(s, 9);
        assert_eq!(c, [10, 0, 3, 1, 6]);
        assert_eq!(c.iter().sum::<usize>(), 20);
    }
}
