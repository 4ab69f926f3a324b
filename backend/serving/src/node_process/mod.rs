//! `tessera node`: a prefill or decode node as its own process, serving node links
//! from gateways and (for a decode node) prefill nodes.
//!
//! The engine thread runs the same node loop as in one process
//! ([`crate::decode_node`], [`crate::prefill_node`]); connection tasks (on the node
//! links' runtime, [`crate::net`]) authenticate the peer, parse frames into the engine
//! thread's commands and check that each frame is one the peer may send; replies go
//! out through each connection's writer queue, so no socket ever blocks the engine.
//!
//! Supervision: any panic (engine thread, connection task, anywhere) logs and ends
//! the process with status 101, and an engine thread that stops ends it with status
//! 1: its connections close, so gateways fail its requests at once, and a supervisor
//! restarts it as a new incarnation. Drain (SIGTERM, or `Drain` from a gateway
//! identity): the node tells its gateways it is draining, lets running requests
//! finish until the drain deadline, ends the rest as drained (their gateways
//! continue them elsewhere), and exits 0.

mod drain;
mod inbound;
mod ledger;
mod mover;
mod options;
mod peers;
mod state;
mod supervise;

pub use drain::drain_node;
pub use options::{pool_engine_config, NodeOptions, TestPanic, TransportKind};

use crate::decode_node::{DecodeLoop, KeptForMoves};
use crate::links::PdCounters;
use crate::metrics::{serve_metrics, NodeMetrics};
use crate::net;
use crate::node_loop::Shared;
use crate::prefill_node::{PrefillCmd, PrefillLoop};
use inbound::accept_loop;
use ledger::{Carried, Registry};
use mover::{forward, DecodeAndWriter, MoverCmd};
use peers::{PeerLinks, PeerSlot};
use state::{NodeCmds, NodeState};
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::Duration;
use supervise::{exit_on_panic, spawn_engine};
use tessera_engine::Engine;
use tessera_model::LoadedModel;
use tessera_transfer::protocol::Role;
use tessera_transfer::ucx::{UcxContext, UcxRegionDescriptor, UcxSink};
/// Runs one node until it is drained (then returns `Ok`) or the process is killed:
/// binds `opts.listen` (and `opts.metrics_listen`), then serves node links. Calls
/// `ready` with the bound control address and the metrics address once listening.
/// Installs a panic hook that ends the process (see the module docs).
///
/// Errors: the role is not prefill or decode, an address cannot be bound, UCX is
/// asked for and unavailable.
pub fn run_node_process(
    model: &LoadedModel,
    opts: NodeOptions,
    ready: impl FnOnce(std::net::SocketAddr, Option<std::net::SocketAddr>),
) -> io::Result<()> {
    if opts.role == Role::Coordinator {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "a node is a prefill or a decode node",
        ));
    }
    exit_on_panic();
    let listener = std::net::TcpListener::bind(&opts.listen)?;
    listener.set_nonblocking(true)?;
    let metrics_listener = match &opts.metrics_listen {
        Some(a) => Some(std::net::TcpListener::bind(a)?),
        None => None,
    };
    let mut engine = Engine::new(
        model.transformer.clone(),
        model.tokenizer.clone(),
        opts.engine.clone(),
    );
    let page_bytes = engine.kv().layout().page_bytes();
    let metrics = Arc::new(NodeMetrics::new());
    let role_label = if opts.role == Role::Decode {
        "decode"
    } else {
        "prefill"
    };
    let handles = metrics.node(&opts.listen, role_label);
    engine.set_metrics(handles.engine_metrics());
    let ucx = match opts.transport {
        TransportKind::Ucx => Some(
            UcxContext::new()
                .map_err(|e| io::Error::other(format!("UCX transport unavailable: {e}")))?,
        ),
        TransportKind::Tcp => None,
    };
    let region = match (&ucx, opts.role) {
        (Some(ctx), Role::Decode) => Some(register_pool(ctx, &engine)?),
        _ => None,
    };
    let links = opts
        .links
        .clone()
        .with_context(model.transformer.config().context);
    let counters = Arc::new(PdCounters::default());
    metrics.watch_links(&opts.listen, role_label, counters.clone());
    let shared = Arc::new(Shared::with_metrics(handles.clone()));
    let carried = Arc::new(Carried::default());
    let registry = Arc::new(Registry::default());
    let panic_engine = opts.test_panic == Some(TestPanic::Engine);
    // Where a writer (a prefill node, or a decode node moving a drained
    // sequence's KV) writes: every decode node of the file.
    let peer_links_with = |cmds: mpsc::Sender<PrefillCmd>| {
        Arc::new(PeerLinks {
            name: opts.listen.clone(),
            peers: RwLock::new(
                opts.decode_peers
                    .iter()
                    .map(|a| Arc::new(PeerSlot::new(a)))
                    .collect(),
            ),
            ucx: ucx.clone(),
            links: links.clone(),
            carried: carried.clone(),
            registry: registry.clone(),
            counters: counters.clone(),
            cmds,
        })
    };
    let fp = engine.model_fingerprint();
    let kept = KeptForMoves::default();
    let mut peer_links = None;
    let mut mover = None;
    let cmds = match opts.role {
        Role::Decode => {
            engine.track_ended();
            let decode =
                DecodeLoop::new(counters.clone(), handles.clone()).keeping_moves(kept.clone());
            // Another decode node to move to: a writer beside the decode loop.
            if opts.decode_peers.iter().any(|a| *a != opts.listen) {
                let (tx, rx) = mpsc::channel();
                let decode_tx = forward(tx.clone(), MoverCmd::Decode, "tessera-decode-cmds")?;
                let writer_tx = forward(tx, MoverCmd::Writer, "tessera-mover-cmds")?;
                let peers = peer_links_with(writer_tx.clone());
                peer_links = Some(peers.clone());
                let writer =
                    PrefillLoop::new(peers, writer_tx.clone(), handles.clone(), fp).moving();
                let node = DecodeAndWriter { decode, writer };
                spawn_engine(
                    engine,
                    node,
                    rx,
                    shared.clone(),
                    "tessera-decode",
                    panic_engine,
                )?;
                mover = Some(writer_tx);
                NodeCmds::Decode(decode_tx)
            } else {
                let (tx, rx) = mpsc::channel();
                spawn_engine(
                    engine,
                    decode,
                    rx,
                    shared.clone(),
                    "tessera-decode",
                    panic_engine,
                )?;
                NodeCmds::Decode(tx)
            }
        }
        _ => {
            let (tx, rx) = mpsc::channel();
            let peers = peer_links_with(tx.clone());
            peer_links = Some(peers.clone());
            let node = PrefillLoop::new(peers, tx.clone(), handles.clone(), fp);
            spawn_engine(
                engine,
                node,
                rx,
                shared.clone(),
                "tessera-prefill",
                panic_engine,
            )?;
            NodeCmds::Prefill(tx)
        }
    };
    let (exit_tx, exit_rx) = mpsc::channel();
    let node = Arc::new(NodeState {
        role: opts.role,
        links,
        cmds,
        region,
        incarnation: rand::random(),
        counters,
        shared,
        page_bytes,
        decode_peers: opts.decode_peers.len(),
        peer_links,
        mover,
        kept,
        carried,
        registry,
        gateways: Registry::default(),
        next_conn: AtomicU64::new(1),
        draining: AtomicBool::new(false),
        drain_timeout: opts.drain_timeout,
        exit: Mutex::new(Some(exit_tx)),
        test_panic: opts.test_panic,
        adapters: crate::adapters::NodeAdapters::new(model),
    });
    let addr = listener.local_addr()?;
    let metrics_addr = match metrics_listener {
        Some(l) => {
            let addr = l.local_addr()?;
            std::thread::Builder::new()
                .name("tessera-metrics".into())
                .spawn(move || serve_metrics(l, metrics))?;
            Some(addr)
        }
        None => None,
    };
    {
        let _rt = net::enter();
        let listener = tokio::net::TcpListener::from_std(listener)?;
        #[cfg(unix)]
        {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            let n = node.clone();
            net::spawn(async move {
                if term.recv().await.is_some() {
                    n.begin_drain("SIGTERM");
                }
            });
        }
        net::spawn(accept_loop(node.clone(), listener));
    }
    ready(addr, metrics_addr);
    // Returns once a drain finished (or never).
    let _ = exit_rx.recv();
    Ok(())
}

/// Registers the decode engine's page memory with UCX and keeps a thread
/// progressing the worker (over TCP, and while endpoints connect, bytes land only
/// while it is progressed). Returns what prefill nodes need to put into it.
fn register_pool(ctx: &UcxContext, engine: &Engine) -> io::Result<UcxRegionDescriptor> {
    let pool = engine.kv().pool();
    let data = pool.data();
    let page_bytes = pool.layout().page_bytes();
    let base = std::ptr::NonNull::new(data.as_ptr() as *mut u8)
        .ok_or_else(|| io::Error::other("empty KV pool"))?;
    // SAFETY: the pool's page memory is allocated once and never moves or shrinks
    // (PagePool::new); the engine owns it until the process exits, and the sink
    // lives in a thread that runs until then too. Remote puts land only in pages
    // the decode node reserved for the writer, and the node reads them only after
    // the writer's flush and a verified commit (the protocol's S2 and I4): the same
    // contract as any DMA into host memory.
    let sink = unsafe { UcxSink::register(ctx, base, std::mem::size_of_val(data), page_bytes) }
        .map_err(|e| io::Error::other(format!("registering the KV pool with UCX: {e}")))?;
    let desc = sink.descriptor().clone();
    std::thread::Builder::new()
        .name("tessera-ucx-progress".into())
        .spawn(move || loop {
            if let Err(e) = sink.progress_wait(Duration::from_millis(100)) {
                tracing::warn!(error = %e, "UCX progress failed");
                std::thread::sleep(Duration::from_millis(100));
            }
        })?;
    Ok(desc)
}
