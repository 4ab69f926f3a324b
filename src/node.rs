//! `tessera node`: one prefill or decode node as its own process, configured by the
//! deployment file, and the deployment-file side of `tessera serve --config`.

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use std::path::{Path, PathBuf};
use tessera_config::{DeploymentConfig, ModelEntry, PoolConfig, Role};
use tessera_model::LoadedModel;
use tessera_serving::remote::{run_node_process, NodeOptions, RemoteNodes, TransportKind};

/// A node's role on the command line.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum RoleArg {
    /// Computes prompts and writes their KV into decode nodes.
    Prefill,
    /// Reserves pages, verifies transfers and generates.
    Decode,
}

/// Arguments of `tessera node`.
#[derive(Args, Debug)]
pub(crate) struct NodeArgs {
    /// The node's role.
    #[arg(long)]
    role: RoleArg,
    /// The deployment file (pools, nodes, models).
    #[arg(long)]
    config: PathBuf,
    /// This node's control address: one of its pool's `nodes` (default: the first
    /// node of the first pool with this role).
    #[arg(long)]
    listen: Option<String>,
    /// Zero KV pages when they are freed.
    #[arg(long)]
    kv_scrub: bool,
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
}

/// `--transport`.
#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum TransportArg {
    /// Frames on the TCP control connection.
    Tcp,
    /// UCX one-sided puts (shared memory, TCP or RDMA verbs, as UCX picks).
    Ucx,
}

fn load_config(path: &Path) -> Result<DeploymentConfig> {
    let cfg = DeploymentConfig::load(path)?;
    let problems = cfg.structural_violations();
    if !problems.is_empty() {
        let list: Vec<String> = problems.iter().map(|v| format!("  - {v}")).collect();
        bail!(
            "deployment file {} is invalid:\n{}",
            path.display(),
            list.join("\n")
        );
    }
    Ok(cfg)
}

/// The one model a pool serves (one model per node for now).
fn pool_model<'a>(cfg: &'a DeploymentConfig, pool: &'a PoolConfig) -> Result<&'a ModelEntry> {
    let models: Vec<&ModelEntry> = cfg.models_served_by(pool).collect();
    match models.as_slice() {
        [m] => Ok(m),
        [] => bail!("pool \"{}\" serves no model", pool.name),
        _ => bail!(
            "pool \"{}\" serves {} models; a node serves one model",
            pool.name,
            models.len()
        ),
    }
}

fn load_model(m: &ModelEntry) -> Result<LoadedModel> {
    LoadedModel::load(&m.path).with_context(|| format!("loading {}", m.path.display()))
}

impl NodeArgs {
    /// `prefill` or `decode`.
    pub(crate) fn role_name(&self) -> &'static str {
        match self.role {
            RoleArg::Prefill => "prefill",
            RoleArg::Decode => "decode",
        }
    }
}

pub(crate) fn run(a: NodeArgs) -> Result<()> {
    let cfg = load_config(&a.config)?;
    let role = match a.role {
        RoleArg::Prefill => Role::Prefill,
        RoleArg::Decode => Role::Decode,
    };
    let pool = match &a.listen {
        Some(addr) => cfg
            .pools_with_role(role)
            .find(|p| p.nodes.iter().any(|n| n == addr))
            .with_context(|| {
                format!("no {role} pool in {} lists node {addr}", a.config.display())
            })?,
        None => cfg
            .pools_with_role(role)
            .next()
            .with_context(|| format!("{} has no {role} pool", a.config.display()))?,
    };
    let listen = a.listen.clone().unwrap_or_else(|| pool.nodes[0].clone());
    let entry = pool_model(&cfg, pool)?;
    let model = load_model(entry)?;
    // I2: refuse to start with a pool that cannot hold one full context window.
    pool.check_fits(&entry.id, model.llama.config().context)
        .map_err(|e| anyhow::anyhow!("refusing to start: {e}"))?;
    let mut engine = tessera_serving::remote::pool_engine_config(pool);
    engine.kv_scrub = a.kv_scrub;
    let opts = NodeOptions {
        role: match a.role {
            RoleArg::Prefill => tessera_serving::remote::ProtocolRole::Prefill,
            RoleArg::Decode => tessera_serving::remote::ProtocolRole::Decode,
        },
        listen,
        decode_peers: decode_nodes(&cfg),
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
            "tessera node: {role} pool \"{pool_name}\" ({usable} KV tokens), model {}, {transport:?} page transport, listening on {addr}",
            entry.id
        );
    })
    .context("running the node")
}

fn decode_nodes(cfg: &DeploymentConfig) -> Vec<String> {
    cfg.pools_with_role(Role::Decode)
        .flat_map(|p| p.nodes.iter().cloned())
        .collect()
}

/// What `tessera serve --config` needs from the deployment file: the model to
/// tokenize with, the nodes and their pool sizes. Checks the whole file first,
/// I2 included, against the model's real context window.
pub(crate) fn remote_deployment(
    path: &Path,
) -> Result<(ModelEntry, RemoteNodes, DeploymentConfig)> {
    let cfg = load_config(path)?;
    let verdict = cfg.check_offline();
    if !verdict.is_ok() {
        bail!("refusing to start: {}", verdict.into_result().unwrap_err());
    }
    let prefill: Vec<&PoolConfig> = cfg.pools_with_role(Role::Prefill).collect();
    let decode: Vec<&PoolConfig> = cfg.pools_with_role(Role::Decode).collect();
    if prefill.is_empty() || decode.is_empty() {
        bail!(
            "{} needs at least one prefill and one decode pool for a disaggregated gateway",
            path.display()
        );
    }
    let model = pool_model(&cfg, decode[0])?.clone();
    let nodes = RemoteNodes {
        prefill: prefill
            .iter()
            .flat_map(|p| p.nodes.iter().cloned())
            .collect(),
        decode: decode_nodes(&cfg),
        prefill_pool_tokens: prefill.iter().map(|p| p.usable_tokens()).min().unwrap_or(0),
        decode_pool_tokens: decode.iter().map(|p| p.usable_tokens()).min().unwrap_or(0),
        page_size: decode[0].page_size,
    };
    Ok((model, nodes, cfg))
}
