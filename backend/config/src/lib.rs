//! The deployment file (`tessera.toml`) and its validation, including the I2 check:
//! every node's usable KV pool holds a full context window of every model it serves.
//!
//! One file describes a whole deployment: the gateway, the models and the node pools.
//! Nodes read it at startup (`tessera node --role prefill|decode --config tessera.toml`)
//! and refuse to start on a violation; `tessera ops check-config tessera.toml` gives the
//! same verdict offline for the whole file.
//!
//! ```toml
//! [gateway]
//! listen = "127.0.0.1:8787"          # socket address the gateway binds
//!
//! [[models]]
//! id = "@cf/huggingfacetb/smollm2-135m-instruct"
//! path = "models/SmolLM2-135M-Instruct.Q4_1.gguf"   # relative to the working directory
//! # context = 8192                   # optional; read from the GGUF when the file is there
//!
//! [[pools]]
//! name = "prefill"
//! role = "prefill"                   # prefill | decode | colocated
//! page_size = 16                     # tokens per KV page (default 16)
//! kv_pool_tokens = 16384             # pool size; usable = whole pages only
//! nodes = ["127.0.0.1:9101"]         # node control addresses, host:port
//! # models = ["@cf/..."]             # optional; default: every model
//! ```
//!
//! - [`DeploymentConfig::load`] parses (unknown fields are errors, with the location).
//! - [`DeploymentConfig::check`] / [`DeploymentConfig::check_offline`] return a
//!   [`Verdict`]: every [`Violation`] (structure, context windows, I2) and one
//!   [`PoolFit`] line per (model, pool) pair.
//! - [`check_pool_fits`] is the I2 check alone, pure, for a node that already knows
//!   its model's context window.
//! - [`node_links`]: the optional `[node_links]` section (mutual TLS files, liveness
//!   timings), link identities and their certificate checks.
//! - [`secret_files`]: secret files and directories created with their final modes
//!   (`0600` with `O_EXCL`, `0700`), and the mode checks of keys and key directories.

use candle_core::quantized::gguf_file::{Content, Value};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::str::FromStr;

pub mod node_links;
pub mod secret_files;
pub use node_links::{
    is_loopback_address, LinkCredentials, LinkFileError, LinkIdentity, NodeLinksConfig,
};

/// Tokens per KV page when a pool does not set `page_size` (the engine's default).
pub const DEFAULT_PAGE_SIZE: usize = 16;

/// A whole deployment: the contents of `tessera.toml`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeploymentConfig {
    /// The public gateway.
    pub gateway: GatewayConfig,
    /// Models served (`[[models]]`), at least one.
    pub models: Vec<ModelEntry>,
    /// Node pools (`[[pools]]`).
    #[serde(default)]
    pub pools: Vec<PoolConfig>,
    /// How gateways and nodes authenticate each other and detect dead links
    /// (`[node_links]`, optional: see [`node_links`]).
    #[serde(default)]
    pub node_links: Option<NodeLinksConfig>,
}

/// `[gateway]`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewayConfig {
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

/// Whether `id` may name a model: 1 to [`MAX_MODEL_ID_BYTES`] bytes, no whitespace
/// or control characters.
fn check_model_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_MODEL_ID_BYTES {
        return Err(format!(
            "must be 1 to {MAX_MODEL_ID_BYTES} bytes (given {} bytes)",
            id.len()
        ));
    }
    if id.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("`{id}` contains whitespace or a control character"));
    }
    Ok(())
}

impl ModelEntry {
    /// The catalog fields' violations: id, aliases, description and tag lengths,
    /// dates (`deprecated` before `sunset`).
    fn field_violations(&self) -> Vec<Violation> {
        let mut out = Vec::new();
        let mut bad = |field: &str, reason: String| {
            out.push(Violation::BadModelField {
                model: self.id.clone(),
                field: field.to_string(),
                reason,
            })
        };
        if let Err(r) = check_model_id(&self.id) {
            bad("id", r);
        }
        for a in &self.aliases {
            if let Err(r) = check_model_id(a) {
                bad("aliases", r);
            }
        }
        if self.description.as_ref().is_some_and(|d| d.len() > 1024) {
            bad("description", "must be at most 1024 bytes".into());
        }
        for t in &self.tags {
            if t.is_empty() || t.len() > 64 {
                bad("tags", format!("`{t}` must be 1 to 64 bytes"));
            }
        }
        let date = |v: &Option<String>| v.as_deref().map(parse_date);
        let (dep, sun) = (date(&self.deprecated), date(&self.sunset));
        if let Some(Err(r)) = &dep {
            bad("deprecated", r.clone());
        }
        if let Some(Err(r)) = &sun {
            bad("sunset", r.clone());
        }
        if let (Some(Ok(d)), Some(Ok(s))) = (dep, sun) {
            if s <= d {
                bad(
                    "sunset",
                    format!(
                        "{} must be after deprecated = {}",
                        self.sunset.as_deref().unwrap_or_default(),
                        self.deprecated.as_deref().unwrap_or_default()
                    ),
                );
            }
        }
        out
    }
}

/// Which part of the request a node pool runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Computes prompts' KV and sends it to a decode node.
    Prefill,
    /// Receives KV and generates tokens.
    Decode,
    /// Both, in one pool, with no transfer.
    Colocated,
}

impl Role {
    /// Every role.
    pub const ALL: [Role; 3] = [Role::Prefill, Role::Decode, Role::Colocated];

    /// The lowercase name used in the file and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Colocated => "colocated",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A role name that is not `prefill`, `decode` or `colocated`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown role `{0}` (expected prefill, decode or colocated)")]
pub struct UnknownRole(pub String);

impl FromStr for Role {
    type Err = UnknownRole;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
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
    pub role: Role,
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
    pub role: Role,
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
    role: Role,
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

/// Errors reading or parsing a deployment file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read deployment file {path}: {source}")]
    Read {
        /// File.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// Not valid TOML, or not the schema (unknown field, wrong type, missing field).
    #[error("invalid deployment file {path}: {source}")]
    Parse {
        /// File.
        path: PathBuf,
        /// Parser error, with line, column and the offending text.
        source: Box<toml::de::Error>,
    },
}

impl ConfigError {
    /// Stable machine label.
    pub fn label(&self) -> &'static str {
        match self {
            ConfigError::Read { .. } => "unreadable_config",
            ConfigError::Parse { .. } => "invalid_config",
        }
    }
}

/// Why a model's context window is unknown.
#[derive(Debug, thiserror::Error)]
pub enum ContextError {
    /// No file and no `context` in the entry.
    #[error(
        "model file {path} not found and no `context` is set; set `context = N` in its \
         [[models]] entry or fetch the file"
    )]
    NotFound {
        /// File tried.
        path: PathBuf,
    },
    /// The file exists but could not be opened.
    #[error("cannot open model file {path}: {source}")]
    Open {
        /// File.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// Not a readable GGUF file.
    #[error("{path} is not a readable GGUF file: {source}")]
    Gguf {
        /// File.
        path: PathBuf,
        /// Parser error.
        source: Box<candle_core::Error>,
    },
    /// The GGUF has no context length.
    #[error("{path} has no `{key}` metadata; set `context = N` in its [[models]] entry")]
    Missing {
        /// File.
        path: PathBuf,
        /// Metadata key looked up.
        key: String,
    },
    /// `context` in the file disagrees with the GGUF.
    #[error(
        "`context = {configured}` disagrees with {path}, whose context window is {gguf} \
         tokens; remove `context` or correct it"
    )]
    Mismatch {
        /// File.
        path: PathBuf,
        /// Value in the deployment file.
        configured: usize,
        /// Value in the GGUF.
        gguf: usize,
    },
}

/// Reads a model's context window from GGUF metadata (`<general.architecture>.context_length`,
/// `llama` when the architecture is absent) without reading the weights.
pub fn read_context_window(path: &Path) -> Result<usize, ContextError> {
    let mut f = std::fs::File::open(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            ContextError::NotFound { path: path.into() }
        } else {
            ContextError::Open {
                path: path.into(),
                source,
            }
        }
    })?;
    // Reads the header, metadata and tensor descriptions; the tensor data stays on disk.
    let content = Content::read(&mut f).map_err(|source| ContextError::Gguf {
        path: path.into(),
        source: Box::new(source),
    })?;
    let arch = match content.metadata.get("general.architecture") {
        Some(Value::String(a)) => a.as_str(),
        _ => "llama",
    };
    let key = format!("{arch}.context_length");
    match content.metadata.get(&key) {
        Some(Value::U32(v)) => Ok(*v as usize),
        Some(Value::U64(v)) => Ok(*v as usize),
        Some(Value::I32(v)) if *v > 0 => Ok(*v as usize),
        Some(Value::I64(v)) if *v > 0 => Ok(*v as usize),
        _ => Err(ContextError::Missing {
            path: path.into(),
            key,
        }),
    }
}

impl ModelEntry {
    /// The context window this model is served with: the GGUF's when the file is there
    /// (a `context` that disagrees is an error), else the entry's `context`.
    pub fn context_window(&self) -> Result<usize, ContextError> {
        match (read_context_window(&self.path), self.context) {
            (Ok(gguf), Some(configured)) if configured != gguf => Err(ContextError::Mismatch {
                path: self.path.clone(),
                configured,
                gguf,
            }),
            (Ok(gguf), _) => Ok(gguf),
            (Err(ContextError::NotFound { .. }), Some(configured)) => Ok(configured),
            (Err(e), _) => Err(e),
        }
    }
}

/// One problem with a deployment file. Every variant makes nodes refuse to start and
/// `tessera ops check-config` exit non-zero.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Violation {
    /// `[[models]]` is empty.
    #[error("no models: add at least one [[models]] entry")]
    NoModels,
    /// Two `[[models]]` entries share an id.
    #[error("model id {id} appears more than once in [[models]]")]
    DuplicateModel {
        /// Model id.
        id: String,
    },
    /// Two `[[pools]]` entries share a name.
    #[error("pool name \"{name}\" appears more than once in [[pools]]")]
    DuplicatePool {
        /// Pool name.
        name: String,
    },
    /// `page_size = 0`.
    #[error("pool \"{pool}\": page_size must be > 0")]
    ZeroPageSize {
        /// Pool name.
        pool: String,
    },
    /// `nodes = []`.
    #[error("pool \"{pool}\" lists no nodes")]
    NoNodes {
        /// Pool name.
        pool: String,
    },
    /// `models = []`.
    #[error("pool \"{pool}\" serves no models (`models = []`); list models or omit `models`")]
    NoPoolModels {
        /// Pool name.
        pool: String,
    },
    /// A pool's `models` names a model not in `[[models]]`.
    #[error("pool \"{pool}\" lists model {model}, which is not in [[models]]")]
    UnknownModel {
        /// Pool name.
        pool: String,
        /// The unknown id.
        model: String,
    },
    /// A node address that is not `host:port`.
    #[error("pool \"{pool}\": node address `{address}` is not host:port: {reason}")]
    BadNodeAddress {
        /// Pool name.
        pool: String,
        /// The address as written.
        address: String,
        /// What is wrong with it.
        reason: String,
    },
    /// One node address in two places (a node runs one role, in one pool).
    #[error("node `{address}` is listed more than once (pools \"{first}\" and \"{second}\")")]
    DuplicateNode {
        /// The address.
        address: String,
        /// First pool listing it.
        first: String,
        /// Second pool listing it.
        second: String,
    },
    /// A model no pool of a needed role serves.
    #[error(
        "model {model} has no {role} pool: PD serving needs a prefill and a decode pool \
         for each model, or a colocated pool"
    )]
    MissingRole {
        /// Model id.
        model: String,
        /// The missing role.
        role: Role,
    },
    /// The context window could not be determined.
    #[error("cannot determine the context window of model {model}: {reason}")]
    ContextUnknown {
        /// Model id.
        model: String,
        /// Why.
        reason: String,
    },
    /// `context` in the file differs from the model file's own context window
    /// (admission uses the file's, so the pools are checked against that).
    #[error("model {model}: `context = {configured}` but its GGUF says {gguf} tokens; remove `context` or make it {gguf}")]
    ContextMismatch {
        /// Model id.
        model: String,
        /// `context` in the deployment file.
        configured: usize,
        /// `<arch>.context_length` in the GGUF.
        gguf: usize,
    },
    /// A catalog field of a `[[models]]` entry is malformed (`id`, `aliases`,
    /// `description`, `tags`, `deprecated`, `sunset`).
    #[error("model {model}: `{field}` {reason}")]
    BadModelField {
        /// Model id.
        model: String,
        /// The field at fault.
        field: String,
        /// What is wrong, with the value.
        reason: String,
    },
    /// An alias that is another model's id or alias (ignoring case).
    #[error("alias {alias} of model {model} is already {other}")]
    DuplicateAlias {
        /// The alias.
        alias: String,
        /// The model giving it.
        model: String,
        /// What it already names (`the id of model X` or `an alias of model X`).
        other: String,
    },
    /// A prefill or decode pool that serves more than one model: its nodes load one.
    #[error(
        "{role} pool \"{pool}\" serves {count} models; a prefill or decode node loads one \
         model, so list one in its `models`"
    )]
    PoolModels {
        /// Pool name.
        pool: String,
        /// Its role.
        role: Role,
        /// How many models it serves.
        count: usize,
    },
    /// I2.
    #[error(transparent)]
    PoolTooSmall(#[from] PoolTooSmall),
    /// `[node_links]` sets only one of `ca` and `cert_dir`.
    #[error("[node_links] sets {set} but not {missing}; mutual TLS needs both")]
    NodeLinksIncomplete {
        /// The field that is set.
        set: &'static str,
        /// The one that is not.
        missing: &'static str,
    },
    /// `heartbeat_ms` is 0 or not below `dead_after_ms`.
    #[error(
        "[node_links] heartbeat_ms = {heartbeat_ms} must be > 0 and below dead_after_ms = \
         {dead_after_ms} (a quiet link would be declared dead between its heartbeats)"
    )]
    BadLiveness {
        /// `heartbeat_ms`.
        heartbeat_ms: u64,
        /// `dead_after_ms`.
        dead_after_ms: u64,
    },
    /// `heartbeat_ms` below `min_heartbeat_ms`.
    #[error(
        "[node_links] heartbeat_ms = {heartbeat_ms} is below min_heartbeat_ms = {min}: pings \
         that often only load every link; raise heartbeat_ms (or, deliberately, lower \
         min_heartbeat_ms)"
    )]
    HeartbeatTooShort {
        /// `heartbeat_ms`.
        heartbeat_ms: u64,
        /// `min_heartbeat_ms`.
        min: u64,
    },
    /// `dead_after_ms` above `max_dead_after_ms`.
    #[error(
        "[node_links] dead_after_ms = {dead_after_ms} is above max_dead_after_ms = {max}: a \
         dead or stalled node would hold its requests that long; lower dead_after_ms (or, \
         deliberately, raise max_dead_after_ms)"
    )]
    DeadAfterTooLong {
        /// `dead_after_ms`.
        dead_after_ms: u64,
        /// `max_dead_after_ms`.
        max: u64,
    },
    /// `cert_dir` holds the CA key, or group or others can write it.
    #[error("node links: [node_links] cert_dir: {reason}")]
    ExposedCertDir {
        /// What is wrong, with the path and the fix.
        reason: String,
    },
    /// Node links without TLS but a node off loopback: its nodes would refuse to start.
    #[error(
        "node `{address}` is not on loopback but [node_links] configures no mutual TLS \
         (`ca`, `cert_dir`); plain node links are only allowed on loopback \
         (--insecure-node-links)"
    )]
    InsecureNodeLinks {
        /// The non-loopback address.
        address: String,
    },
    /// An identity's certificate or key is missing, unreadable or does not serve it.
    #[error("node links: {identity}: {reason}")]
    NodeLinkFile {
        /// Whose files ([`LinkIdentity`] as text).
        identity: String,
        /// What is wrong, with the file's path.
        reason: String,
    },
}

impl Violation {
    /// Stable machine label (JSON reports, tests).
    pub fn label(&self) -> &'static str {
        match self {
            Violation::NoModels => "no_models",
            Violation::DuplicateModel { .. } => "duplicate_model",
            Violation::DuplicatePool { .. } => "duplicate_pool",
            Violation::ZeroPageSize { .. } => "zero_page_size",
            Violation::NoNodes { .. } => "no_nodes",
            Violation::NoPoolModels { .. } => "no_pool_models",
            Violation::UnknownModel { .. } => "unknown_model",
            Violation::BadNodeAddress { .. } => "bad_node_address",
            Violation::DuplicateNode { .. } => "duplicate_node",
            Violation::MissingRole { .. } => "missing_role",
            Violation::ContextUnknown { .. } => "context_unknown",
            Violation::ContextMismatch { .. } => "context_mismatch",
            Violation::BadModelField { .. } => "bad_model_field",
            Violation::DuplicateAlias { .. } => "duplicate_alias",
            Violation::PoolModels { .. } => "pool_models",
            Violation::PoolTooSmall(_) => "pool_too_small",
            Violation::NodeLinksIncomplete { .. } => "node_links_incomplete",
            Violation::BadLiveness { .. } => "bad_liveness",
            Violation::HeartbeatTooShort { .. } => "heartbeat_too_short",
            Violation::DeadAfterTooLong { .. } => "dead_after_too_long",
            Violation::ExposedCertDir { .. } => "exposed_cert_dir",
            Violation::InsecureNodeLinks { .. } => "insecure_node_links",
            Violation::NodeLinkFile { .. } => "node_link_file",
        }
    }
}

/// A model's context window as the check found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelContext {
    /// Model id.
    pub id: String,
    /// GGUF file.
    pub path: PathBuf,
    /// Context window in tokens; `None` when unknown (a violation says why).
    pub context: Option<usize>,
}

/// The I2 comparison for one (model, pool) pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolFit {
    /// Model id.
    pub model: String,
    /// Its context window, tokens.
    pub context: usize,
    /// Pool name.
    pub pool: String,
    /// Pool role.
    pub role: Role,
    /// Usable KV tokens of one node of the pool.
    pub usable_tokens: usize,
}

impl PoolFit {
    /// `usable_tokens >= context`.
    pub fn fits(&self) -> bool {
        self.usable_tokens >= self.context
    }
}

/// Everything [`DeploymentConfig::check`] found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Verdict {
    /// Each model (first entry per id) and its context window.
    pub models: Vec<ModelContext>,
    /// One line per (model, pool serving it) whose context is known.
    pub fits: Vec<PoolFit>,
    /// Every violation, structural ones first.
    pub violations: Vec<Violation>,
}

impl Verdict {
    /// No violations.
    pub fn is_ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// `Ok(self)` when there are no violations, else all of them as one error
    /// (for a node's startup: `cfg.check_offline().into_result()?`).
    pub fn into_result(self) -> Result<Verdict, ConfigRejected> {
        if self.is_ok() {
            Ok(self)
        } else {
            Err(ConfigRejected {
                violations: self.violations,
            })
        }
    }
}

/// A deployment file with violations; the message lists every one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigRejected {
    /// Every violation found.
    pub violations: Vec<Violation>,
}

impl fmt::Display for ConfigRejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.violations.len();
        write!(
            f,
            "deployment configuration rejected ({n} violation{})",
            if n == 1 { "" } else { "s" }
        )?;
        for v in &self.violations {
            write!(f, "\n  - {v}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigRejected {}

/// Checks that `address` is `host:port`: an IP socket address (IPv6 in brackets) or a
/// DNS host name, and a port in 1..=65535. No name resolution.
pub fn check_host_port(address: &str) -> Result<(), String> {
    if let Ok(sa) = address.parse::<SocketAddr>() {
        return if sa.port() == 0 {
            Err("port 0 is not a fixed port".into())
        } else {
            Ok(())
        };
    }
    let Some((host, port)) = address.rsplit_once(':') else {
        return Err("missing `:port`".into());
    };
    if host.is_empty() {
        return Err("empty host".into());
    }
    if host.contains(':') || host.starts_with('[') {
        return Err("IPv6 addresses are written `[addr]:port`".into());
    }
    match port.parse::<u16>() {
        Ok(0) => return Err("port 0 is not a fixed port".into()),
        Ok(_) => {}
        Err(_) => return Err(format!("port `{port}` is not a number in 1..=65535")),
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    if host.len() > 253 || !host.split('.').all(label_ok) {
        return Err(format!("`{host}` is not a valid host name"));
    }
    Ok(())
}

impl DeploymentConfig {
    /// Reads and parses a deployment file. Only syntax and schema are checked here;
    /// [`DeploymentConfig::check`] does the rest.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses deployment-file text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: origin.into(),
            source: Box::new(source),
        })
    }

    /// What a running gateway cannot take from `new` (a re-read of this file)
    /// without a restart: every difference except the `nodes` of pools that exist
    /// in both files with the same name, role and settings. Empty: `new` changes
    /// membership only (nodes added to or removed from existing pools), which a
    /// gateway applies live (`tessera ops reload`, SIGHUP).
    pub fn changes_needing_restart(&self, new: &DeploymentConfig) -> Vec<String> {
        let mut out = Vec::new();
        if self.gateway != new.gateway {
            out.push("[gateway] changed (listen address)".to_string());
        }
        if self.models != new.models {
            out.push("[[models]] changed (models are loaded at start)".to_string());
        }
        if self.node_links != new.node_links {
            out.push("[node_links] changed (CA, certificates, timings)".to_string());
        }
        let names =
            |c: &DeploymentConfig| c.pools.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
        if names(self) != names(new) {
            out.push(format!(
                "the pools changed: {:?} became {:?} (pools are added, removed or reordered only by a restart)",
                names(self),
                names(new)
            ));
        } else {
            for (old, new) in self.pools.iter().zip(&new.pools) {
                let same_but_nodes = PoolConfig {
                    nodes: old.nodes.clone(),
                    ..new.clone()
                };
                if *old != same_but_nodes {
                    out.push(format!(
                        "pool {} changed beyond its nodes (role, page_size, kv_pool_tokens or models)",
                        old.name
                    ));
                }
            }
        }
        out
    }

    /// The pool named `name`.
    pub fn pool(&self, name: &str) -> Option<&PoolConfig> {
        self.pools.iter().find(|p| p.name == name)
    }

    /// Pools with `role`, in file order.
    pub fn pools_with_role(&self, role: Role) -> impl Iterator<Item = &PoolConfig> {
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

    /// Structural violations only (no model files read): models, names, page sizes,
    /// node addresses, pool coverage of every model.
    pub fn structural_violations(&self) -> Vec<Violation> {
        let mut out = Vec::new();
        if self.models.is_empty() {
            out.push(Violation::NoModels);
        }
        let mut ids = HashSet::new();
        for m in &self.models {
            if !ids.insert(m.id.as_str()) {
                out.push(Violation::DuplicateModel { id: m.id.clone() });
            }
            out.extend(m.field_violations());
        }
        // Ids and aliases resolve case-insensitively: each names one model.
        let mut names: BTreeMap<String, String> = self
            .models
            .iter()
            .map(|m| {
                (
                    m.id.to_ascii_lowercase(),
                    format!("the id of model {}", m.id),
                )
            })
            .collect();
        for m in &self.models {
            for a in &m.aliases {
                let key = a.to_ascii_lowercase();
                if let Some(other) = names.get(&key) {
                    out.push(Violation::DuplicateAlias {
                        alias: a.clone(),
                        model: m.id.clone(),
                        other: other.clone(),
                    });
                } else {
                    names.insert(key, format!("an alias of model {}", m.id));
                }
            }
        }
        let mut names = HashSet::new();
        let mut node_pool: BTreeMap<&str, &str> = BTreeMap::new();
        for p in &self.pools {
            if !names.insert(p.name.as_str()) {
                out.push(Violation::DuplicatePool {
                    name: p.name.clone(),
                });
            }
            if p.page_size == 0 {
                out.push(Violation::ZeroPageSize {
                    pool: p.name.clone(),
                });
            }
            if p.nodes.is_empty() {
                out.push(Violation::NoNodes {
                    pool: p.name.clone(),
                });
            }
            match &p.models {
                Some(list) if list.is_empty() => out.push(Violation::NoPoolModels {
                    pool: p.name.clone(),
                }),
                Some(list) => {
                    for m in list.iter().filter(|m| !ids.contains(m.as_str())) {
                        out.push(Violation::UnknownModel {
                            pool: p.name.clone(),
                            model: m.clone(),
                        });
                    }
                }
                None => {}
            }
            let served = self.models_served_by(p).count();
            if matches!(p.role, Role::Prefill | Role::Decode) && served > 1 {
                out.push(Violation::PoolModels {
                    pool: p.name.clone(),
                    role: p.role,
                    count: served,
                });
            }
            for a in &p.nodes {
                if let Err(reason) = check_host_port(a) {
                    out.push(Violation::BadNodeAddress {
                        pool: p.name.clone(),
                        address: a.clone(),
                        reason,
                    });
                } else if let Some(first) = node_pool.insert(a.as_str(), p.name.as_str()) {
                    out.push(Violation::DuplicateNode {
                        address: a.clone(),
                        first: first.to_string(),
                        second: p.name.clone(),
                    });
                }
            }
        }
        let mut seen = HashSet::new();
        for m in self.models.iter().filter(|m| seen.insert(m.id.as_str())) {
            let has = |role| self.pools_with_role(role).any(|p| p.serves(&m.id));
            if has(Role::Colocated) {
                continue;
            }
            for role in [Role::Prefill, Role::Decode] {
                if !has(role) {
                    out.push(Violation::MissingRole {
                        model: m.id.clone(),
                        role,
                    });
                }
            }
        }
        out.extend(self.node_link_violations());
        out
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
            .filter(|p| matches!(p.role, Role::Prefill | Role::Decode))
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

    /// `[node_links]` structure: both TLS fields or neither, sane timings within
    /// `min_heartbeat_ms` and `max_dead_after_ms`, and without TLS every node on
    /// loopback.
    fn node_link_violations(&self) -> Vec<Violation> {
        let links = self.links();
        let mut out = Vec::new();
        match (&links.ca, &links.cert_dir) {
            (Some(_), None) => out.push(Violation::NodeLinksIncomplete {
                set: "ca",
                missing: "cert_dir",
            }),
            (None, Some(_)) => out.push(Violation::NodeLinksIncomplete {
                set: "cert_dir",
                missing: "ca",
            }),
            _ => {}
        }
        if links.heartbeat_ms == 0 || links.heartbeat_ms >= links.dead_after_ms {
            out.push(Violation::BadLiveness {
                heartbeat_ms: links.heartbeat_ms,
                dead_after_ms: links.dead_after_ms,
            });
        }
        if links.heartbeat_ms < links.min_heartbeat_ms {
            out.push(Violation::HeartbeatTooShort {
                heartbeat_ms: links.heartbeat_ms,
                min: links.min_heartbeat_ms,
            });
        }
        if links.dead_after_ms > links.max_dead_after_ms {
            out.push(Violation::DeadAfterTooLong {
                dead_after_ms: links.dead_after_ms,
                max: links.max_dead_after_ms,
            });
        }
        if links.ca.is_none() && links.cert_dir.is_none() {
            for id in self.link_identities() {
                if let LinkIdentity::Node { address, .. } = id {
                    if check_host_port(&address).is_ok() && !is_loopback_address(&address) {
                        out.push(Violation::InsecureNodeLinks { address });
                    }
                }
            }
        }
        out
    }

    /// With mutual TLS configured: `cert_dir` itself ([`NodeLinksConfig::check_cert_dir`],
    /// one violation) and every identity's certificate and key
    /// ([`NodeLinksConfig::load`]); one violation per identity whose files fail.
    pub fn node_link_file_violations(&self) -> Vec<Violation> {
        self.link_file_violations(None)
    }

    /// [`Self::node_link_file_violations`] of every identity, or of `only`.
    fn link_file_violations(&self, only: Option<&LinkIdentity>) -> Vec<Violation> {
        let links = self.links();
        if links.tls_files().is_none() {
            return Vec::new();
        }
        let dir = links
            .check_cert_dir()
            .err()
            .map(|e| Violation::ExposedCertDir {
                reason: e.to_string(),
            });
        dir.into_iter()
            .chain(
                self.link_identities()
                    .into_iter()
                    .filter(|id| only.is_none_or(|me| me == id))
                    // A bad address is already a violation of its own.
                    .filter(|id| id.name().is_ok())
                    .filter_map(|id| {
                        links
                            .load_files(&id)
                            .err()
                            .map(|e| Violation::NodeLinkFile {
                                identity: id.to_string(),
                                reason: e.to_string(),
                            })
                    }),
            )
            .collect()
    }

    /// The full verdict: structural violations, then each model's context window from
    /// `context_of`, then I2 for every (model, pool serving it). Reports every
    /// violation, not just the first.
    ///
    /// A node passes a `context_of` that returns the context of the model it loaded;
    /// offline checks use [`DeploymentConfig::check_offline`].
    pub fn check<E: fmt::Display>(
        &self,
        mut context_of: impl FnMut(&ModelEntry) -> Result<usize, E>,
    ) -> Verdict {
        let mut verdict = Verdict {
            violations: self.structural_violations(),
            ..Verdict::default()
        };
        let mut seen = HashSet::new();
        for m in self.models.iter().filter(|m| seen.insert(m.id.as_str())) {
            let context = match context_of(m) {
                Ok(c) => Some(c),
                Err(e) => {
                    verdict.violations.push(Violation::ContextUnknown {
                        model: m.id.clone(),
                        reason: e.to_string(),
                    });
                    None
                }
            };
            verdict.models.push(ModelContext {
                id: m.id.clone(),
                path: m.path.clone(),
                context,
            });
            let Some(context) = context else { continue };
            // A zero page size is already a violation; its I2 line would say nothing.
            for p in self
                .pools
                .iter()
                .filter(|p| p.page_size > 0 && p.serves(&m.id))
            {
                verdict.fits.push(PoolFit {
                    model: m.id.clone(),
                    context,
                    pool: p.name.clone(),
                    role: p.role,
                    usable_tokens: p.usable_tokens(),
                });
                if let Err(e) = p.check_fits(&m.id, context) {
                    verdict.violations.push(e.into());
                }
            }
        }
        verdict
    }

    /// [`DeploymentConfig::check`] with context windows from the model files
    /// ([`ModelEntry::context_window`]), and every identity's node-link files (what
    /// `tessera ops check-config` checks on the operator's machine).
    pub fn check_offline(&self) -> Verdict {
        self.check_offline_as(None)
    }

    /// [`Self::check_offline`] for the process whose identity is `me`: of the
    /// node-link files only its own (a gateway or node loads no other key, and
    /// should not be given the others).
    pub fn check_offline_for(&self, me: &LinkIdentity) -> Verdict {
        self.check_offline_as(Some(me))
    }

    fn check_offline_as(&self, only: Option<&LinkIdentity>) -> Verdict {
        // A `context` that disagrees with the GGUF is reported as such, and the pools
        // are still checked against the GGUF's window (the one admission uses).
        let mut mismatches = Vec::new();
        let mut verdict = self.check(|m| match m.context_window() {
            Err(ContextError::Mismatch {
                configured, gguf, ..
            }) => {
                mismatches.push(Violation::ContextMismatch {
                    model: m.id.clone(),
                    configured,
                    gguf,
                });
                Ok(gguf)
            }
            other => other,
        });
        verdict.violations.extend(mismatches);
        verdict.violations.extend(self.link_file_violations(only));
        verdict
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MODEL: &str = "@cf/huggingfacetb/smollm2-135m-instruct";

    fn pool(name: &str, role: Role, kv_pool_tokens: usize, node: &str) -> PoolConfig {
        PoolConfig {
            name: name.into(),
            role,
            page_size: 16,
            kv_pool_tokens,
            nodes: vec![node.into()],
            models: None,
        }
    }

    fn model(id: &str, context: Option<usize>) -> ModelEntry {
        ModelEntry {
            id: id.into(),
            path: PathBuf::from("/nonexistent/tessera-test/model.gguf"),
            context,
            ..ModelEntry::default()
        }
    }

    /// One prefill and one decode pool of 16384 tokens, one model with context 8192.
    fn pd() -> DeploymentConfig {
        DeploymentConfig {
            gateway: GatewayConfig {
                listen: "127.0.0.1:8787".parse().unwrap(),
            },
            models: vec![model(MODEL, Some(8192))],
            pools: vec![
                pool("prefill", Role::Prefill, 16384, "127.0.0.1:9101"),
                pool("decode", Role::Decode, 16384, "127.0.0.1:9201"),
            ],
            node_links: None,
        }
    }

    fn fixed(c: usize) -> impl FnMut(&ModelEntry) -> Result<usize, String> {
        move |_| Ok(c)
    }

    fn labels(v: &[Violation]) -> Vec<&'static str> {
        v.iter().map(Violation::label).collect()
    }

    #[test]
    fn usable_tokens_is_whole_pages() {
        let mut p = pool("p", Role::Decode, 16384, "h:1");
        assert_eq!(p.usable_tokens(), 16384);
        p.kv_pool_tokens = 16383;
        assert_eq!(p.usable_tokens(), 16368);
        p.kv_pool_tokens = 15;
        assert_eq!(p.usable_tokens(), 0);
        p.kv_pool_tokens = 100;
        p.page_size = 7;
        assert_eq!(p.usable_tokens(), 98);
        p.page_size = 0;
        assert_eq!(p.usable_tokens(), 0);
    }

    #[test]
    fn role_parses_and_prints() {
        for r in Role::ALL {
            assert_eq!(r.to_string().parse::<Role>(), Ok(r));
        }
        assert_eq!(Role::Prefill.to_string(), "prefill");
        assert_eq!("Decode".parse::<Role>(), Err(UnknownRole("Decode".into())));
    }

    #[test]
    fn i2_boundary_usable_equal_to_context_passes_one_page_less_fails() {
        assert_eq!(
            check_pool_fits(MODEL, 8192, Role::Decode, "d", 8192),
            Ok(())
        );
        let err = check_pool_fits(MODEL, 8192, Role::Decode, "decode-a", 8192 - 16).unwrap_err();
        assert_eq!(
            err,
            PoolTooSmall {
                model: MODEL.into(),
                context: 8192,
                role: Role::Decode,
                pool: "decode-a".into(),
                usable_tokens: 8176,
            }
        );
        let msg = err.to_string();
        assert!(
            msg.starts_with(&format!(
                "decode pool \"decode-a\" holds 8176 usable KV tokens but model {MODEL} has a \
                 context window of 8192 tokens (I2"
            )),
            "{msg}"
        );
    }

    #[test]
    fn i2_uses_whole_pages_of_the_pool() {
        // 8200 tokens configured, but only 512 whole pages (8192 tokens) are usable.
        let mut p = pool("prefill", Role::Prefill, 8200, "h:1");
        assert_eq!(p.check_fits(MODEL, 8192), Ok(()));
        assert!(p.check_fits(MODEL, 8193).is_err());
        // A context that is not a page multiple needs the next whole page.
        p.kv_pool_tokens = 8191;
        assert_eq!(p.check_fits(MODEL, 8176), Ok(()));
        assert_eq!(p.check_fits(MODEL, 8177).unwrap_err().usable_tokens, 8176);
    }

    #[test]
    fn good_pd_deployment_passes_with_one_line_per_pool() {
        let v = pd().check(fixed(8192));
        assert!(v.is_ok(), "{:?}", v.violations);
        assert_eq!(v.fits.len(), 2);
        assert!(v.fits.iter().all(PoolFit::fits));
        assert_eq!(v.models[0].context, Some(8192));
        assert!(v.into_result().is_ok());
    }

    #[test]
    fn every_small_pool_is_reported_not_just_the_first() {
        let mut c = pd();
        c.pools[0].kv_pool_tokens = 4096;
        c.pools[1].kv_pool_tokens = 8191;
        let v = c.check(fixed(8192));
        assert_eq!(labels(&v.violations), ["pool_too_small", "pool_too_small"]);
        let Violation::PoolTooSmall(e) = &v.violations[1] else {
            unreachable!()
        };
        assert_eq!(
            (e.role, e.usable_tokens, e.context),
            (Role::Decode, 8176, 8192)
        );
        let err = v.into_result().unwrap_err().to_string();
        assert!(
            err.starts_with("deployment configuration rejected (2 violations)"),
            "{err}"
        );
        assert!(err.contains("prefill pool \"prefill\" holds 4096"), "{err}");
    }

    #[test]
    fn structural_violations_each_reported() {
        let mut c = pd();
        c.models.push(model(MODEL, None));
        c.pools
            .push(pool("decode", Role::Decode, 16384, "127.0.0.1:9301"));
        c.pools[0].page_size = 0;
        c.pools[1].models = Some(vec!["@cf/nope".into()]);
        c.pools[2].nodes = vec![];
        let v = c.check(fixed(8192));
        assert_eq!(
            labels(&v.violations),
            [
                "duplicate_model",
                "zero_page_size",
                "unknown_model",
                "duplicate_pool",
                "no_nodes",
            ]
        );
        // Duplicate model ids are checked once; the zero-page pool gets no I2 line.
        assert_eq!(v.models.len(), 1);
        assert_eq!(v.fits.len(), 1);
        assert_eq!(v.fits[0].pool, "decode");
    }

    #[test]
    fn no_models_and_empty_pool_model_list() {
        let mut c = pd();
        c.models.clear();
        c.pools[0].models = Some(vec![]);
        let v = c.check(fixed(8192));
        assert_eq!(labels(&v.violations), ["no_models", "no_pool_models"]);
        assert_eq!(
            v.violations[1].to_string(),
            "pool \"prefill\" serves no models (`models = []`); list models or omit `models`"
        );
    }

    #[test]
    fn pd_needs_prefill_and_decode_unless_colocated() {
        let mut c = pd();
        c.pools.remove(1);
        let v = c.check(fixed(8192));
        assert_eq!(
            v.violations,
            [Violation::MissingRole {
                model: MODEL.into(),
                role: Role::Decode
            }]
        );
        assert!(v.violations[0].to_string().contains("has no decode pool"));

        // A pool limited to another model does not cover this one.
        let mut c = pd();
        c.models.push(model("@cf/other", Some(4096)));
        c.pools[0].models = Some(vec!["@cf/other".into()]);
        c.pools[1].models = Some(vec![MODEL.into()]);
        let v = c.check(fixed(8192));
        assert_eq!(
            v.violations,
            [
                Violation::MissingRole {
                    model: MODEL.into(),
                    role: Role::Prefill
                },
                Violation::MissingRole {
                    model: "@cf/other".into(),
                    role: Role::Decode
                },
            ]
        );

        // One colocated pool serves everything alone.
        let mut c = pd();
        c.pools = vec![pool("all", Role::Colocated, 8192, "127.0.0.1:9000")];
        assert!(c.check(fixed(8192)).is_ok());
    }

    #[test]
    fn node_addresses_must_be_host_port_and_unique() {
        for good in [
            "127.0.0.1:9101",
            "[::1]:9101",
            "node-1.pd.svc.cluster.local:9101",
            "h:1",
        ] {
            assert_eq!(check_host_port(good), Ok(()), "{good}");
        }
        for bad in [
            "127.0.0.1",
            ":9101",
            "h:0",
            "h:65536",
            "h:port",
            "::1:9101",
            "bad_host:1",
            "-h:1",
            "a..b:1",
        ] {
            assert!(check_host_port(bad).is_err(), "{bad}");
        }
        let mut c = pd();
        c.pools[0].nodes = vec!["127.0.0.1".into(), "127.0.0.1:9201".into()];
        let v = c.check(fixed(8192));
        assert_eq!(
            labels(&v.violations),
            ["bad_node_address", "duplicate_node"]
        );
        assert_eq!(
            v.violations[0].to_string(),
            "pool \"prefill\": node address `127.0.0.1` is not host:port: missing `:port`"
        );
        assert_eq!(
            v.violations[1].to_string(),
            "node `127.0.0.1:9201` is listed more than once (pools \"prefill\" and \"decode\")"
        );
    }

    #[test]
    fn context_that_disagrees_with_the_gguf_is_named_and_pools_are_still_checked() {
        let mut c = pd();
        c.models[0].path = gguf_path();
        c.models[0].context = Some(4096);
        for p in &mut c.pools {
            p.kv_pool_tokens = 4096;
        }
        let v = c.check_offline();
        let mut got = labels(&v.violations);
        got.sort_unstable();
        assert_eq!(
            got,
            ["context_mismatch", "pool_too_small", "pool_too_small"]
        );
        let msg = v
            .violations
            .iter()
            .find(|e| e.label() == "context_mismatch")
            .unwrap()
            .to_string();
        assert!(msg.contains("4096") && msg.contains("8192"), "{msg}");
    }

    #[test]
    fn unknown_context_is_a_violation_naming_the_model() {
        let mut c = pd();
        c.models[0].context = None;
        let v = c.check_offline();
        assert_eq!(labels(&v.violations), ["context_unknown"]);
        let msg = v.violations[0].to_string();
        assert!(
            msg.starts_with(&format!("cannot determine the context window of model {MODEL}: model file /nonexistent/tessera-test/model.gguf not found")),
            "{msg}"
        );
        assert!(msg.contains("set `context = N`"), "{msg}");
        assert_eq!(v.models[0].context, None);
        assert!(v.fits.is_empty());
        // With `context` set and no file, the configured value is used.
        assert!(pd().check_offline().is_ok());
    }

    #[test]
    fn dates_parse_to_unix_seconds_and_bad_ones_are_named() {
        assert_eq!(parse_date("1970-01-01"), Ok(0));
        assert_eq!(parse_date("2000-03-01"), Ok(951_868_800));
        assert_eq!(parse_date("2024-02-29"), Ok(1_709_164_800));
        for bad in [
            "2023-02-29",
            "2024-13-01",
            "2024-1-01",
            "24-01-01",
            "2024-01-00",
            "x",
        ] {
            let e = parse_date(bad).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn catalog_fields_are_checked_and_aliases_name_one_model() {
        let mut cfg = pd();
        let other = "@cf/tessera/other";
        cfg.models.push(ModelEntry {
            aliases: vec!["short".into(), MODEL.to_uppercase()],
            deprecated: Some("2026-02-30".into()),
            ..model(other, Some(8192))
        });
        cfg.models[0].aliases = vec!["SHORT".into()];
        cfg.models[0].tags = vec![String::new()];
        cfg.models[0].deprecated = Some("2026-06-01".into());
        cfg.models[0].sunset = Some("2026-01-01".into());
        cfg.models[0].description = Some("x".repeat(1025));
        let v = cfg.structural_violations();
        let fields: Vec<(String, String)> = v
            .iter()
            .filter_map(|v| match v {
                Violation::BadModelField { model, field, .. } => {
                    Some((model.clone(), field.clone()))
                }
                _ => None,
            })
            .collect();
        for f in ["tags", "sunset", "description"] {
            assert!(fields.contains(&(MODEL.into(), f.into())), "{f}: {v:?}");
        }
        assert!(
            fields.contains(&(other.into(), "deprecated".into())),
            "{v:?}"
        );
        let dups: Vec<String> = v
            .iter()
            .filter(|v| v.label() == "duplicate_alias")
            .map(|v| v.to_string())
            .collect();
        assert_eq!(
            dups,
            vec![
                format!("alias short of model {other} is already an alias of model {MODEL}"),
                format!(
                    "alias {} of model {other} is already the id of model {MODEL}",
                    MODEL.to_uppercase()
                ),
            ]
        );
        // Both models on the same prefill and decode pools: a node loads one model.
        let labels: Vec<&str> = v.iter().map(Violation::label).collect();
        assert_eq!(
            labels.iter().filter(|l| **l == "pool_models").count(),
            2,
            "{v:?}"
        );
        let e = DeploymentConfig::parse(
            "[gateway]\nlisten = \"127.0.0.1:1\"\n[[models]]\nid = \"a\"\npath = \"a\"\nsunset = 5\n",
            Path::new("t.toml"),
        )
        .unwrap_err();
        assert!(e.to_string().contains("sunset"), "{e}");
    }

    fn gguf_path() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../models/SmolLM2-135M-Instruct.Q4_1.gguf")
    }

    #[test]
    fn context_window_from_the_real_gguf() {
        let path = gguf_path();
        assert_eq!(read_context_window(&path).unwrap(), 8192);
        let mut m = ModelEntry {
            id: MODEL.into(),
            path,
            context: None,
            ..ModelEntry::default()
        };
        assert_eq!(m.context_window().unwrap(), 8192);
        m.context = Some(8192);
        assert_eq!(m.context_window().unwrap(), 8192);
        m.context = Some(4096);
        let err = m.context_window().unwrap_err();
        assert!(
            matches!(
                err,
                ContextError::Mismatch {
                    configured: 4096,
                    gguf: 8192,
                    ..
                }
            ),
            "{err}"
        );
    }

    #[test]
    fn a_file_that_is_not_gguf_is_an_error() {
        let dir = std::env::temp_dir().join(format!("tessera-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("not.gguf");
        std::fs::write(&path, b"definitely not gguf").unwrap();
        let err = read_context_window(&path).unwrap_err();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(err, ContextError::Gguf { .. }), "{err}");
    }

    const EXAMPLE: &str = r#"
[gateway]
listen = "127.0.0.1:8787"

[[models]]
id = "@cf/huggingfacetb/smollm2-135m-instruct"
path = "models/SmolLM2-135M-Instruct.Q4_1.gguf"
context = 8192

[[pools]]
name = "prefill"
role = "prefill"
kv_pool_tokens = 16384
nodes = ["127.0.0.1:9101"]

[[pools]]
name = "decode"
role = "decode"
page_size = 32
kv_pool_tokens = 16384
nodes = ["127.0.0.1:9201"]
models = ["@cf/huggingfacetb/smollm2-135m-instruct"]
"#;

    #[test]
    fn parses_the_documented_schema() {
        let c = DeploymentConfig::parse(EXAMPLE, Path::new("t.toml")).unwrap();
        assert_eq!(c.gateway.listen, "127.0.0.1:8787".parse().unwrap());
        assert_eq!(c.models[0].context, Some(8192));
        assert_eq!(c.pools[0].page_size, DEFAULT_PAGE_SIZE);
        assert_eq!(c.pools[0].models, None);
        assert_eq!(c.pools[1].page_size, 32);
        assert_eq!(c.pools[1].role, Role::Decode);
        assert_eq!(c.pools_with_role(Role::Decode).count(), 1);
        assert_eq!(c.pool("decode").unwrap().nodes, ["127.0.0.1:9201"]);
        let served: Vec<_> = c.models_served_by(&c.pools[1]).map(|m| &m.id).collect();
        assert_eq!(served, [MODEL]);
    }

    #[test]
    fn the_repository_example_parses_and_passes() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../ops/deploy/tessera.toml");
        let mut c = DeploymentConfig::load(&path).unwrap();
        // Its model path is relative to the repository root.
        for m in &mut c.models {
            m.path = Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../..")
                .join(&m.path);
        }
        // It names mutual TLS files that only `tessera ops certs issue` creates (the
        // ops tests issue them); everything else passes.
        assert!(c.links().tls_files().is_some());
        let v = c.check_offline();
        let other: Vec<&Violation> = v
            .violations
            .iter()
            .filter(|v| v.label() != "node_link_file")
            .collect();
        assert!(other.is_empty(), "{other:?}");
        assert_eq!(v.fits.len(), 2);
    }

    #[test]
    fn unknown_fields_and_bad_values_are_parse_errors_with_location() {
        let bad = EXAMPLE.replace(
            "kv_pool_tokens = 16384\nnodes = [\"127.0.0.1:9101\"]",
            "kv_pool_tokens = 16384\nkv_pool_tokenz = 1\nnodes = [\"127.0.0.1:9101\"]",
        );
        let err = DeploymentConfig::parse(&bad, Path::new("deploy/t.toml")).unwrap_err();
        assert_eq!(err.label(), "invalid_config");
        let msg = err.to_string();
        assert!(
            msg.starts_with("invalid deployment file deploy/t.toml: "),
            "{msg}"
        );
        assert!(msg.contains("unknown field `kv_pool_tokenz`"), "{msg}");
        assert!(msg.contains("line 14"), "{msg}");

        let bad = EXAMPLE.replace("role = \"prefill\"", "role = \"both\"");
        let msg = DeploymentConfig::parse(&bad, Path::new("t.toml"))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("both"), "{msg}");

        let bad = EXAMPLE.replace("127.0.0.1:8787", "localhost");
        assert!(DeploymentConfig::parse(&bad, Path::new("t.toml")).is_err());

        let err = DeploymentConfig::load(Path::new("/nonexistent/tessera.toml")).unwrap_err();
        assert_eq!(err.label(), "unreadable_config");
        assert!(err
            .to_string()
            .starts_with("cannot read deployment file /nonexistent/tessera.toml: "));
    }

    #[test]
    fn node_links_section_parses_and_its_structure_is_checked() {
        let base = r#"
[gateway]
listen = "127.0.0.1:8787"
[[models]]
id = "m"
path = "/nonexistent/m.gguf"
context = 16
[[pools]]
name = "p"
role = "prefill"
kv_pool_tokens = 16
nodes = ["127.0.0.1:9101"]
[[pools]]
name = "d"
role = "decode"
kv_pool_tokens = 16
nodes = ["10.0.0.2:9201"]
"#;
        let parse = |extra: &str| {
            DeploymentConfig::parse(&format!("{base}{extra}"), Path::new("t.toml")).unwrap()
        };
        // No TLS: the node off loopback is named.
        let cfg = parse("");
        assert_eq!(cfg.links(), NodeLinksConfig::default());
        assert_eq!(
            cfg.structural_violations(),
            vec![Violation::InsecureNodeLinks {
                address: "10.0.0.2:9201".into()
            }]
        );
        // Mutual TLS configured: no structural violation; identities in file order.
        let cfg = parse("[node_links]\nca = \"c/ca.pem\"\ncert_dir = \"c\"\nheartbeat_ms = 200\n");
        assert_eq!(cfg.structural_violations(), vec![]);
        assert_eq!(cfg.links().heartbeat_ms, 200);
        assert_eq!(cfg.links().dead_after_ms, 5000);
        let names: Vec<String> = cfg
            .link_identities()
            .iter()
            .map(|i| i.name().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "gateway.tessera",
                "prefill-9101.127.0.0.1.tessera",
                "decode-9201.10.0.0.2.tessera"
            ]
        );
        // Its files are checked offline, one violation per identity, naming the path.
        let files = cfg.node_link_file_violations();
        assert_eq!(labels(&files), ["node_link_file"; 3]);
        assert!(files[0].to_string().contains("c/ca.pem"), "{}", files[0]);
        // A process checks only its own identity's files (it is given no others).
        let own = cfg
            .check_offline_for(&LinkIdentity::Gateway)
            .violations
            .into_iter()
            .filter(|v| v.label() == "node_link_file")
            .count();
        assert_eq!(own, 1);
        let all = cfg
            .check_offline()
            .violations
            .into_iter()
            .filter(|v| v.label() == "node_link_file")
            .count();
        assert_eq!(all, 3);
        // Half a TLS setup, and timings that would call a quiet link dead.
        let cfg = parse("[node_links]\nca = \"c/ca.pem\"\nheartbeat_ms = 5000\n");
        assert_eq!(
            labels(&cfg.structural_violations()),
            ["node_links_incomplete", "bad_liveness"]
        );
        // A heartbeat of 1 ms and a dead-after of an hour: refused, naming the
        // field, the bound and the fix; the bounds themselves are configurable.
        let tls = "[node_links]\nca = \"c/ca.pem\"\ncert_dir = \"c\"\n";
        let cfg = parse(&format!("{tls}heartbeat_ms = 1\ndead_after_ms = 3600000\n"));
        let v = cfg.structural_violations();
        assert_eq!(labels(&v), ["heartbeat_too_short", "dead_after_too_long"]);
        let (short, long) = (v[0].to_string(), v[1].to_string());
        assert!(
            short.contains("heartbeat_ms = 1 is below min_heartbeat_ms = 50")
                && short.contains("raise heartbeat_ms"),
            "{short}"
        );
        assert!(
            long.contains("dead_after_ms = 3600000 is above max_dead_after_ms = 60000")
                && long.contains("lower dead_after_ms"),
            "{long}"
        );
        let cfg = parse(&format!("{tls}heartbeat_ms = 49\ndead_after_ms = 60001\n"));
        assert_eq!(
            labels(&cfg.structural_violations()),
            ["heartbeat_too_short", "dead_after_too_long"]
        );
        let cfg = parse(&format!("{tls}heartbeat_ms = 50\ndead_after_ms = 60000\n"));
        assert_eq!(cfg.structural_violations(), vec![]);
        let cfg = parse(&format!(
            "{tls}heartbeat_ms = 10\ndead_after_ms = 600000\nmin_heartbeat_ms = 10\n\
             max_dead_after_ms = 600000\n"
        ));
        assert_eq!(cfg.structural_violations(), vec![]);
        let e = DeploymentConfig::parse(
            &format!("{base}[node_links]\nkey = 1\n"),
            Path::new("t.toml"),
        );
        assert!(e.is_err());
    }

    #[test]
    fn only_node_membership_changes_need_no_restart() {
        let text = |decode: &str, kv: usize| {
            EXAMPLE
                .replace(
                    r#"nodes = ["127.0.0.1:9201"]"#,
                    &format!("nodes = [{decode}]"),
                )
                .replace(
                    "page_size = 32\nkv_pool_tokens = 16384",
                    &format!("page_size = 32\nkv_pool_tokens = {kv}"),
                )
        };
        let parse = |t: String| DeploymentConfig::parse(&t, Path::new("t.toml")).unwrap();
        let old = parse(text(r#""127.0.0.1:9201""#, 16384));
        let added = parse(text(r#""127.0.0.1:9201", "127.0.0.1:9202""#, 16384));
        assert_eq!(old.changes_needing_restart(&added), Vec::<String>::new());
        assert_eq!(added.changes_needing_restart(&old), Vec::<String>::new());
        let resized = parse(text(r#""127.0.0.1:9201""#, 32768));
        let c = old.changes_needing_restart(&resized);
        assert_eq!(c.len(), 1, "{c:?}");
        assert!(c[0].contains("pool decode"), "{c:?}");
        let mut moved = old.clone();
        moved.gateway.listen = "127.0.0.1:9999".parse().unwrap();
        moved.pools.pop();
        let c = old.changes_needing_restart(&moved);
        assert_eq!(c.len(), 2, "{c:?}");
    }
}
