//! [`Violation`]: one problem with a deployment file, with a stable machine label.

use crate::schema::{NodeRole, PoolTooSmall};

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
        role: NodeRole,
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
        role: NodeRole,
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
        /// Whose files ([`LinkIdentity`](crate::node_links::LinkIdentity) as text).
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
