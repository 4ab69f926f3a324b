//! The deployment file as the binary reads it: loaded and checked, each pool's
//! model, and what `tessera serve --config` needs to reach its nodes. Shared by
//! `tessera node`, `tessera serve` and the reloads of both.

use anyhow::{bail, Result};
use std::path::Path;
use tessera_config::{DeploymentConfig, LinkIdentity, ModelEntry, NodeRole, PoolConfig};
use tessera_serving::remote::{NodeLinks, RemoteNodes};

/// Loads the deployment file at `path`. Errors: unreadable, unparsable, or
/// structurally invalid (every violation listed).
pub(crate) fn load_config(path: &Path) -> Result<DeploymentConfig> {
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
pub(crate) fn pool_model<'a>(
    cfg: &'a DeploymentConfig,
    pool: &'a PoolConfig,
) -> Result<&'a ModelEntry> {
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

/// The pools of `role` that serve model `id`, in file order.
pub(crate) fn pools_of<'a>(
    cfg: &'a DeploymentConfig,
    role: NodeRole,
    id: &'a str,
) -> impl Iterator<Item = &'a PoolConfig> + 'a {
    cfg.pools_with_role(role).filter(move |p| p.serves(id))
}

/// The decode nodes serving model `id`, in file order: the list a prefill node of
/// that model and the gateway's cluster for it both index (so an index names the
/// same node on both sides, and never a node of another model).
pub(crate) fn decode_nodes(cfg: &DeploymentConfig, id: &str) -> Vec<String> {
    pools_of(cfg, NodeRole::Decode, id)
        .flat_map(|p| p.nodes.iter().cloned())
        .collect()
}

/// What `tessera serve --config` needs from the deployment file: for every
/// `[[models]]` entry, the entry and the prefill and decode nodes of the pools that
/// serve it with their pool sizes; and the file. Checks the whole file first, I2
/// included, against each model's real context window, and that each prefill and
/// decode pool serves one model (a node loads one).
pub(crate) fn remote_deployment(
    path: &Path,
    insecure_node_links: bool,
) -> Result<(Vec<(ModelEntry, RemoteNodes)>, DeploymentConfig)> {
    let cfg = load_config(path)?;
    // The gateway's own node-link files only: it is not given the nodes' keys.
    let verdict = cfg.check_offline_for(&LinkIdentity::Gateway);
    if !verdict.is_ok() {
        bail!("refusing to start: {}", verdict.into_result().unwrap_err());
    }
    let links =
        NodeLinks::from_deployment(&cfg, &LinkIdentity::Gateway, insecure_node_links, None)?;
    let mut out = Vec::new();
    for pool in cfg
        .pools_with_role(NodeRole::Prefill)
        .chain(cfg.pools_with_role(NodeRole::Decode))
    {
        pool_model(&cfg, pool)?;
    }
    for m in &cfg.models {
        let prefill: Vec<&PoolConfig> = pools_of(&cfg, NodeRole::Prefill, &m.id).collect();
        let decode: Vec<&PoolConfig> = pools_of(&cfg, NodeRole::Decode, &m.id).collect();
        if prefill.is_empty() || decode.is_empty() {
            bail!(
                "{}: model {} needs at least one prefill and one decode pool for a disaggregated gateway",
                path.display(),
                m.id
            );
        }
        let usable = |pools: &[&PoolConfig]| pools.iter().map(|p| p.usable_tokens()).min();
        out.push((
            m.clone(),
            RemoteNodes {
                prefill: prefill
                    .iter()
                    .flat_map(|p| p.nodes.iter().cloned())
                    .collect(),
                decode: decode_nodes(&cfg, &m.id),
                prefill_pool_tokens: usable(&prefill).unwrap_or(0),
                decode_pool_tokens: usable(&decode).unwrap_or(0),
                page_size: decode[0].page_size,
                draft: m.draft.is_some(),
                links: links.clone(),
            },
        ));
    }
    Ok((out, cfg))
}
