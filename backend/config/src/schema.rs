//! The schema of `tessera.toml`: one type per section ([`DeploymentConfig`], its
//! models, pools and roles), lookups over them, and the pure I2 check of one pool.

use crate::node_links::{LinkIdentity, NodeLinksConfig};
use serde::{Deserialize, Serialize};
use std::collections::HashSet;
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

/// Tokens per KV page when a pool does not set `page_size` (the engine's default).
pub const DEFAULT_PAGE_SIZE: usize = 16;

/// A whole deployment: the contents of `tessera.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeploymentConfig {
    /// The public gateway.
    pub gateway: GatewaySection,
    /// Models served (`[[models]]`), at least one.
    pub models: Vec<ModelEntry>,
    /// Node pools (`[[pools]]`).
    #[serde(default)]
    pub pools: Vec<PoolConfig>,
    /// How gateways and nodes authenticate each other and detect dead links
    /// (`[node_links]`, optional: see [`node_links`](crate::node_links)).
    #[serde(default)]
    pub node_links: Option<NodeLinksConfig>,
}

/// The deployment file's `[gateway]` section (the gateway process's own runtime
/// options are `tessera_gateway::GatewayOptions`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewaySection {
    /// Socket address the gateway listens on (`ip:port`).
    pub listen: SocketAddr,
}

/// One `[[models]]` entry.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    /// Catalog id, e.g. `@cf/huggingfacetb/smollm2-135m-instruct`.
    pub id: String,
    /// GGUF file; a relative path is taken from the working directory, as every
    /// other `tessera` path is.
    pub path: PathBuf,
    /// Context window in tokens. Optional: read from the GGUF (`<arch>.context_length`)
    /// when the file is there; when both are known they must agree. Set it to check a
    /// deployment file on a machine without the weights.
    #[serde(default)]
    pub context: Option<usize>,
    /// One-line description for the catalog (`/v1/models`, `models/search`);
    /// optional, at most 1,024 bytes.
    #[serde(default)]
    pub description: Option<String>,
    /// Catalog tags (`models/search?search=` matches them); each 1 to 64 bytes.
    #[serde(default)]
    pub tags: Vec<String>,
    /// Other ids requests may use for this model (each unique among every id and
    /// alias of the file, ignoring case; same rules as an id).
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Date the model was deprecated, `YYYY-MM-DD` (UTC): its answers carry
    /// `Deprecation: @<unix seconds>` (RFC 9745).
    #[serde(default)]
    pub deprecated: Option<String>,
    /// Date the model is removed, `YYYY-MM-DD` (UTC), after `deprecated` when both
    /// are set: until then its answers carry `Sunset: <HTTP-date>` (RFC 8594); from
    /// that day on it answers 404 with Workers AI code 5007.
    #[serde(default)]
    pub sunset: Option<String>,
    /// GGUF of a smaller model of the same tokenizer that drafts for this one
    /// (draft-model speculation, issue 37): its decode nodes load it (and refuse to
    /// start when its vocabulary differs), and the gateway then accepts requests'
    /// `speculative.mode` `"draft"`, the default mode of requests that speculate.
    /// Absent: prompt lookup only.
    #[serde(default)]
    pub draft: Option<PathBuf>,
}

/// Longest model id or alias, bytes (the gateway refuses longer path segments).
pub const MAX_MODEL_ID_BYTES: usize = 256;

/// Seconds since the Unix epoch of 00:00 UTC on the date `YYYY-MM-DD` (proleptic
/// Gregorian calendar; H. Hinnant's `days_from_civil`,
/// <https://howardhinnant.github.io/date_algorithms.html#days_from_civil>).
///
/// Errors: anything but four digits, `-`, two, `-`, two naming a real date.
pub fn parse_date(s: &str) -> Result<i64, String> {
    let bad = || format!("`{s}` is not a date YYYY-MM-DD");
    let b = s.as_bytes();
    if b.len() != 10 || b[4] != b'-' || b[7] != b'-' {
        return Err(bad());
    }
    let num = |r: std::ops::Range<usize>| -> Result<i64, String> {
        let t = &s[r];
        if t.bytes().all(|c| c.is_ascii_digit()) {
            t.parse().map_err(|_| bad())
        } else {
            Err(bad())
        }
    };
    let (y, m, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    let leap = (y % 4 == 0 && y % 100 != 0) || y % 400 == 0;
    let days_in = match m {
        1 | 3 | 5 | 7 | 8 | 10 | 12 => 31,
        4 | 6 | 9 | 11 => 30,
        2 if leap => 29,
        2 => 28,
        _ => return Err(bad()),
    };
    if d < 1 || d > days_in {
        return Err(bad());
    }
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    Ok((era * 146_097 + doe - 719_468) * 86_400)
}

/// A node pool's role in the deployment file: which part of the request its nodes
/// run (the transfer protocol's roles, which add the coordinator, are
/// `tessera_transfer::protocol::Role`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NodeRole {
    /// Computes prompts' KV and sends it to a decode node.
    Prefill,
    /// Receives KV and generates tokens.
    Decode,
    /// Both, in one pool, with no transfer.
    Colocated,
}

impl NodeRole {
    /// Every role.
    pub const ALL: [NodeRole; 3] = [NodeRole::Prefill, NodeRole::Decode, NodeRole::Colocated];

    /// The lowercase name used in the file and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            NodeRole::Prefill => "prefill",
            NodeRole::Decode => "decode",
            NodeRole::Colocated => "colocated",
        }
    }
}

impl fmt::Display for NodeRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A role name that is not `prefill`, `decode` or `colocated`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown role `{0}` (expected prefill, decode or colocated)")]
pub struct UnknownRole(pub String);

impl FromStr for NodeRole {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        NodeRole::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| UnknownRole(s.to_string()))
    }
}

fn default_page_size() -> usize {
    DEFAULT_PAGE_SIZE
}

/// One `[[pools]]` entry: nodes of one role with identical KV pools.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolConfig {
    /// Unique pool name (used in messages and by `tessera node`).
    pub name: String,
    /// What the pool's nodes run.
    pub role: NodeRole,
    /// Tokens per KV page (> 0; default [`DEFAULT_PAGE_SIZE`]).
    #[serde(default = "default_page_size")]
    pub page_size: usize,
    /// KV pool size per node, in tokens; only whole pages are usable.
    pub kv_pool_tokens: usize,
    /// Node control addresses (`host:port`, IPv6 as `[addr]:port`), at least one.
    pub nodes: Vec<String>,
    /// Model ids this pool serves; absent: every model in the file.
    #[serde(default)]
    pub models: Option<Vec<String>>,
}

impl PoolConfig {
    /// Tokens the pool can actually hold: whole pages only,
    /// `floor(kv_pool_tokens / page_size) * page_size` (0 when `page_size` is 0).
    pub fn usable_tokens(&self) -> usize {
        self.kv_pool_tokens
            .checked_div(self.page_size)
            .map_or(0, |pages| pages * self.page_size)
    }

    /// Whether this pool serves `model_id`.
    pub fn serves(&self, model_id: &str) -> bool {
        self.models
            .as_ref()
            .is_none_or(|ids| ids.iter().any(|m| m == model_id))
    }

    /// The I2 check for this pool and one model: [`check_pool_fits`] with this pool's
    /// name, role and usable tokens.
    pub fn check_fits(&self, model_id: &str, context: usize) -> Result<(), PoolTooSmall> {
        check_pool_fits(
            model_id,
            context,
            self.role,
            &self.name,
            self.usable_tokens(),
        )
    }
}

/// I2 violated: a pool cannot hold one full context window of a model it serves, so a
/// request that passes the context check could never be served by its nodes.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{role} pool \"{pool}\" holds {usable_tokens} usable KV tokens but model {model} has a \
     context window of {context} tokens (I2: a node's pool must hold a full context; raise \
     kv_pool_tokens)"
)]
pub struct PoolTooSmall {
    /// Model id.
    pub model: String,
    /// The model's context window, tokens.
    pub context: usize,
    /// The pool's role.
    pub role: NodeRole,
    /// Pool name.
    pub pool: String,
    /// Usable KV tokens of one node of the pool (whole pages).
    pub usable_tokens: usize,
}

/// The I2 check, pure: `usable_tokens >= context`.
///
/// `usable_tokens` must be whole pages ([`PoolConfig::usable_tokens`]); then it is
/// equivalent to admission's test for a request of exactly `context` tokens (rounded
/// up to pages), so every request that fits the context window fits the pool.
pub fn check_pool_fits(
    model_id: &str,
    context: usize,
    role: NodeRole,
    pool: &str,
    usable_tokens: usize,
) -> Result<(), PoolTooSmall> {
    if usable_tokens >= context {
        Ok(())
    } else {
        Err(PoolTooSmall {
            model: model_id.to_string(),
            context,
            role,
            pool: pool.to_string(),
            usable_tokens,
        })
    }
}

impl DeploymentConfig {
    /// The pool named `name`.
    pub fn pool(&self, name: &str) -> Option<&PoolConfig> {
        self.pools.iter().find(|p| p.name == name)
    }

    /// Pools with `role`, in file order.
    pub fn pools_with_role(&self, role: NodeRole) -> impl Iterator<Item = &PoolConfig> {
        self.pools.iter().filter(move |p| p.role == role)
    }

    /// The model entry with id `id`.
    pub fn model(&self, id: &str) -> Option<&ModelEntry> {
        self.models.iter().find(|m| m.id == id)
    }

    /// Models `pool` serves, in file order (first entry per id).
    pub fn models_served_by<'a>(
        &'a self,
        pool: &'a PoolConfig,
    ) -> impl Iterator<Item = &'a ModelEntry> + 'a {
        let mut seen = HashSet::new();
        self.models
            .iter()
            .filter(move |m| seen.insert(m.id.as_str()) && pool.serves(&m.id))
    }

    /// `[node_links]` as written, or the defaults (no TLS files, default timings).
    pub fn links(&self) -> NodeLinksConfig {
        self.node_links.clone().unwrap_or_default()
    }

    /// Every identity on the node links: the gateway, then every node of every
    /// prefill and decode pool, in file order.
    pub fn link_identities(&self) -> Vec<LinkIdentity> {
        let nodes = self
            .pools
            .iter()
            .filter(|p| matches!(p.role, NodeRole::Prefill | NodeRole::Decode))
            .flat_map(|p| {
                p.nodes.iter().map(|a| LinkIdentity::Node {
                    role: p.role,
                    address: a.clone(),
                })
            });
        std::iter::once(LinkIdentity::Gateway)
            .chain(nodes)
            .collect()
    }
}
