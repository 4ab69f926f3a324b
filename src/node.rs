//! `tessera node`: one prefill or decode node as its own process, configured by the
//! deployment file (read through [`crate::deployment`]).

use crate::deployment::{decode_nodes, load_config, pool_model};
use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use std::path::PathBuf;
use std::time::Duration;
use tessera_config::{LinkIdentity, ModelEntry, NodeRole};
use tessera_model::LoadedModel;
use tessera_serving::remote::{
    drain_node, run_node_process, NodeLinks, NodeOptions, TestPanic, TransportKind,
};
use tessera_transfer::protocol::Role;

/// Test-only: makes a node panic on purpose (`engine` or `connection`), for the
/// supervision tests. Read once at start; never set it in a deployment.
const TEST_PANIC_ENV: &str = "TESSERA_TEST_NODE_PANIC";

/// A node's role on the command line.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum NodeRoleArg {
    /// Computes prompts and writes their KV into decode nodes.
    Prefill,
    /// Reserves pages, verifies transfers and generates.
    Decode,
}

/// Arguments of `tessera node`: run a node, or `drain` one.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub(crate) struct NodeArgs {
    #[command(subcommand)]
    command: Option<NodeCommand>,
    /// The node's role.
    #[arg(long, required = true)]
    role: Option<NodeRoleArg>,
    /// The deployment file (pools, nodes, models, node links).
    #[arg(long, required = true)]
    config: Option<PathBuf>,
    /// This node's control address: one of its pool's `nodes` (default: the first
    /// node of the first pool with this role).
    #[arg(long)]
    listen: Option<String>,
    /// Zero KV pages when they are freed.
    #[arg(long)]
    kv_scrub: bool,
    /// Prompt-lookup speculation: draft tokens per decoding request and step (0:
    /// off, at most 8), for requests that do not set `speculative` themselves. Drafts
    /// come from each request's own prompt and output; the output is the same with or
    /// without them (faster where answers repeat their input, e.g. code edits).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=8))]
    speculate: u32,
    #[command(flatten)]
    kv_spill: crate::kv_spill::KvSpillArgs,
    #[command(flatten)]
    device: crate::device::DeviceArgs,
    /// Serve Prometheus metrics at `GET /metrics` (plain HTTP, read-only) on this
    /// address, on a listener of its own (keep it on a private network).
    #[arg(long)]
    metrics_listen: Option<String>,
    /// How KV pages move from prefill to decode nodes: `tcp` (frames on the control
    /// connection) or `ucx` (one-sided puts into the decode pool; needs libucx,
    /// Debian: apt-get install libucx0). Prefill and decode nodes must agree; a
    /// prefill node falls back to TCP frames when a decode node offers no UCX region.
    #[arg(long, value_enum, default_value = "tcp")]
    transport: TransportArg,
    /// Plain TCP node links instead of mutual TLS: only when every node of the
    /// deployment file and --listen are on loopback (the node refuses to start
    /// otherwise, naming the address).
    #[arg(long)]
    insecure_node_links: bool,
    /// On SIGTERM or `tessera node drain`: a decode node with another decode node in
    /// the file moves its running requests there with their KV and exits once the
    /// moves are written, within this many seconds; any other node lets running
    /// requests finish for this long, then ends the rest (their gateways continue
    /// them elsewhere) and exits 0.
    #[arg(long, default_value_t = 30)]
    drain_timeout_secs: u64,
}

/// `tessera node` subcommands.
#[derive(Subcommand, Debug)]
pub(crate) enum NodeCommand {
    /// Drain a running node: it stops taking new requests (the gateways route
    /// around it); a decode node moves its running requests to another decode node
    /// with their KV, any other node lets them finish until its
    /// --drain-timeout-secs and ends the rest; then it exits 0. Connects with the
    /// gateway identity.
    Drain(DrainArgs),
}

/// Arguments of `tessera node drain`.
#[derive(Args, Debug)]
pub(crate) struct DrainArgs {
    /// The node's control address, as the deployment file lists it.
    addr: String,
    /// The deployment file (the node's pool, the node links' CA and the gateway's
    /// certificate).
    #[arg(long)]
    config: PathBuf,
    /// Plain TCP (a deployment run with --insecure-node-links, on loopback).
    #[arg(long)]
    insecure_node_links: bool,
    /// Also wait, up to this many seconds, until the node finished draining.
    #[arg(long)]
    wait_secs: Option<u64>,
}

/// `--transport`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum TransportArg {
    /// Frames on the TCP control connection.
    Tcp,
    /// UCX one-sided puts (shared memory, TCP or RDMA verbs, as UCX picks).
    Ucx,
}

fn load_model(m: &ModelEntry) -> Result<LoadedModel> {
    LoadedModel::load(&m.path).with_context(|| format!("loading {}", m.path.display()))
}

impl NodeArgs {
    /// `prefill`, `decode`, or `node` (a subcommand such as `drain`).
    pub(crate) fn role_name(&self) -> &'static str {
        match (&self.command, self.role) {
            (Some(_), _) | (None, None) => "node",
            (None, Some(NodeRoleArg::Prefill)) => "prefill",
            (None, Some(NodeRoleArg::Decode)) => "decode",
        }
    }
}

fn protocol_role(role: NodeRole) -> Role {
    match role {
        NodeRole::Prefill => Role::Prefill,
        _ => Role::Decode,
    }
}

/// `tessera node drain ADDR --config FILE`.
fn drain(a: DrainArgs) -> Result<()> {
    let cfg = load_config(&a.config)?;
    let pool = cfg
        .pools
        .iter()
        .find(|p| {
            matches!(p.role, NodeRole::Prefill | NodeRole::Decode) && p.nodes.contains(&a.addr)
        })
        .with_context(|| {
            format!(
                "no prefill or decode pool in {} lists node {}",
                a.config.display(),
                a.addr
            )
        })?;
    let links =
        NodeLinks::from_deployment(&cfg, &LinkIdentity::Gateway, a.insecure_node_links, None)?;
    let wait = a.wait_secs.map(Duration::from_secs);
    drain_node(&links, &a.addr, protocol_role(pool.role), wait)
        .with_context(|| format!("draining {} node {}", pool.role, a.addr))?;
    match wait {
        Some(_) => println!(
            "tessera node drain: {} node {} drained and exited",
            pool.role, a.addr
        ),
        None => println!(
            "tessera node drain: {} node {} is draining",
            pool.role, a.addr
        ),
    }
    Ok(())
}

pub(crate) fn run(a: NodeArgs) -> Result<()> {
    if let Some(NodeCommand::Drain(d)) = a.command {
        return drain(d);
    }
    let (Some(role), Some(config)) = (a.role, a.config.clone()) else {
        bail!("tessera node needs --role and --config (or a subcommand)");
    };
    let cfg = load_config(&config)?;
    let role = match role {
        NodeRoleArg::Prefill => NodeRole::Prefill,
        NodeRoleArg::Decode => NodeRole::Decode,
    };
    let pool = match &a.listen {
        Some(addr) => cfg
            .pools_with_role(role)
            .find(|p| p.nodes.iter().any(|n| n == addr))
            .with_context(|| format!("no {role} pool in {} lists node {addr}", config.display()))?,
        None => cfg
            .pools_with_role(role)
            .next()
            .with_context(|| format!("{} has no {role} pool", config.display()))?,
    };
    let listen = a.listen.clone().unwrap_or_else(|| pool.nodes[0].clone());
    let me = LinkIdentity::Node {
        role,
        address: listen.clone(),
    };
    let links = NodeLinks::from_deployment(&cfg, &me, a.insecure_node_links, Some(&listen))?;
    // SIGHUP re-reads the file: a decode node learns the prefill nodes added to it.
    crate::reload::reload_node_peers_on_sighup(config.clone(), me.clone(), links.clone())?;
    let test_panic = match std::env::var(TEST_PANIC_ENV) {
        Ok(v) => Some(
            TestPanic::parse(&v)
                .with_context(|| format!("{TEST_PANIC_ENV}={v}: expected engine or connection"))?,
        ),
        Err(_) => None,
    };
    let entry = pool_model(&cfg, pool)?;
    let engines = [(role, pool.name.as_str())];
    a.device.prepare(&entry.id, &entry.path, &engines)?;
    let model = load_model(entry)?;
    // I2: refuse to start with a pool that cannot hold one full context window.
    pool.check_fits(&entry.id, model.transformer.config().context)
        .map_err(|e| anyhow::anyhow!("refusing to start: {e}"))?;
    let mut engine = tessera_serving::remote::pool_engine_config(pool);
    engine.kv_scrub = a.kv_scrub;
    engine.speculate = a.speculate as usize;
    if let (NodeRole::Decode, Some(path)) = (role, &entry.draft) {
        engine.draft = Some(crate::serve::load_draft(&entry.id, path, &model)?);
    }
    if role == NodeRole::Prefill {
        // The prefill node keeps the prefix cache: its lower tiers, per pool.
        let page_bytes = model
            .transformer
            .config()
            .kv_layout(engine.page_size)
            .page_bytes();
        // One directory per node: nodes of a pool may share a host and a --kv-spill-dir.
        let name: String = format!("{}-{listen}", pool.name)
            .chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || c == '-' {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        engine.spill = a.kv_spill.config(page_bytes, None, &name)?;
    }
    let tls = if links.is_tls() {
        "mutual TLS"
    } else {
        "PLAIN TCP (--insecure-node-links, loopback only)"
    };
    let opts = NodeOptions {
        role: protocol_role(role),
        listen,
        // Links that name the model: peers serving another one are refused.
        links: links.for_model(model.transformer.fingerprint()),
        drain_timeout: Duration::from_secs(a.drain_timeout_secs),
        test_panic,
        decode_peers: decode_nodes(&cfg, &entry.id),
        engine,
        metrics_listen: a.metrics_listen.clone(),
        transport: match a.transport {
            TransportArg::Tcp => TransportKind::Tcp,
            TransportArg::Ucx => TransportKind::Ucx,
        },
    };
    let pool_name = pool.name.clone();
    let usable = pool.usable_tokens();
    let transport = opts.transport;
    run_node_process(&model, opts, |addr, metrics| {
        if let Some(m) = metrics {
            println!("tessera node: metrics on http://{m}/metrics");
        }
        println!(
            "tessera node: {role} pool \"{pool_name}\" ({usable} KV tokens), model {}, {transport:?} page transport, node links {tls}, listening on {addr}",
            entry.id
        );
    })
    .context("running the node")
}
