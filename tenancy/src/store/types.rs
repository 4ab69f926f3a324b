//! The records and errors the [`Store`](super::Store) hands out.

use crate::keys::Scopes;
use serde::Serialize;
use std::str::FromStr;

/// Who may use a model (by catalog id): every tenant (public, the default for a
/// model the store has no row for), or only the tenants listed (private).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ModelAccess {
    /// Catalog id.
    pub model: String,
    /// Only `tenants` may use it.
    pub private: bool,
    /// Tenant ids a private model admits, sorted (empty for a public model).
    pub tenants: Vec<String>,
}

impl ModelAccess {
    /// The access of a model the store has no row for: public.
    pub fn public(model: &str) -> Self {
        Self {
            model: model.into(),
            private: false,
            tenants: Vec::new(),
        }
    }

    /// Whether tenant `tenant_id` may use the model.
    pub fn allows(&self, tenant_id: &str) -> bool {
        !self.private || self.tenants.iter().any(|t| t == tenant_id)
    }
}

/// Store failures.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database reported an error.
    #[error("database error: {0}")]
    Db(#[from] sqlx::Error),
    /// The URL names no supported database.
    #[error("unsupported store URL `{0}` (use sqlite://PATH or postgres://...)")]
    BadUrl(String),
    /// No such tenant.
    #[error("no tenant with id `{0}`")]
    NoTenant(String),
    /// A value in the database is not what this code wrote.
    #[error("corrupt row: {0}")]
    Corrupt(String),
    /// A value given to a store operation is out of range (names the field).
    #[error("{0}")]
    Invalid(String),
    /// The change conflicts with what the store holds (a name in use, a cap
    /// reached); says which.
    #[error("{0}")]
    Conflict(String),
}

/// Why authentication failed. All map to 401 except [`AuthError::Suspended`] (403).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No `Authorization: Bearer` header.
    #[error("missing API key: send `Authorization: Bearer tsk_...`")]
    Missing,
    /// Not of the form `tsk_<key_id>_<secret>`.
    #[error("malformed API key")]
    Malformed,
    /// Unknown key id or wrong secret.
    #[error("invalid API key")]
    Invalid,
    /// The key was revoked.
    #[error("API key has been revoked")]
    Revoked,
    /// The key's expiry time has passed.
    #[error("API key has expired")]
    Expired,
    /// The key's tenant is suspended.
    #[error("account {0} is suspended")]
    Suspended(String),
}

impl AuthError {
    /// Stable machine label.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Missing => "missing_key",
            Self::Malformed => "malformed_key",
            Self::Invalid => "invalid_key",
            Self::Revoked => "revoked_key",
            Self::Expired => "expired_key",
            Self::Suspended(_) => "tenant_suspended",
        }
    }
}

/// Tenant status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TenantStatus {
    /// Requests are served.
    Active,
    /// Every request is refused with 403.
    Suspended,
}

impl TenantStatus {
    /// Database spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Active => "active",
            Self::Suspended => "suspended",
        }
    }
}

impl FromStr for TenantStatus {
    type Err = StoreError;
    fn from_str(s: &str) -> Result<Self, StoreError> {
        match s {
            "active" => Ok(Self::Active),
            "suspended" => Ok(Self::Suspended),
            o => Err(StoreError::Corrupt(format!("tenant status `{o}`"))),
        }
    }
}

/// Per-tenant limits; 0 means unlimited. `Default` is [`Limits::UNLIMITED`]; new
/// tenants get the operator's configured defaults ([`Limits::NEW_TENANT`] unless
/// configured otherwise), never "unlimited" by omission.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Limits {
    /// Requests per minute.
    pub requests_per_minute: u32,
    /// Prompt tokens per minute.
    pub input_tokens_per_minute: u32,
    /// Output tokens per minute (charged with `max_tokens` at admission).
    pub output_tokens_per_minute: u32,
    /// Requests in flight at once.
    pub max_concurrent: u32,
    /// Input + output tokens per UTC day.
    pub daily_tokens: u64,
}

impl Limits {
    /// No limit at all (every field 0).
    pub const UNLIMITED: Limits = Limits {
        requests_per_minute: 0,
        input_tokens_per_minute: 0,
        output_tokens_per_minute: 0,
        max_concurrent: 0,
        daily_tokens: 0,
    };

    /// The built-in defaults for a new tenant: 600 requests/minute, 400,000 input
    /// and 100,000 output tokens/minute, 16 requests at once, 10,000,000 tokens/day.
    pub const NEW_TENANT: Limits = Limits {
        requests_per_minute: 600,
        input_tokens_per_minute: 400_000,
        output_tokens_per_minute: 100_000,
        max_concurrent: 16,
        daily_tokens: 10_000_000,
    };
}

/// A partial [`Limits`]: the fields given replace those of a base, the others keep
/// the base's value. Unknown fields are an error (a typo never reads as "unchanged").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LimitsPatch {
    /// Requests per minute.
    pub requests_per_minute: Option<u32>,
    /// Prompt tokens per minute.
    pub input_tokens_per_minute: Option<u32>,
    /// Output tokens per minute.
    pub output_tokens_per_minute: Option<u32>,
    /// Requests in flight at once.
    pub max_concurrent: Option<u32>,
    /// Input + output tokens per UTC day.
    pub daily_tokens: Option<u64>,
}

impl LimitsPatch {
    /// `base` with this patch's fields replaced.
    pub fn apply(&self, base: Limits) -> Limits {
        Limits {
            requests_per_minute: self.requests_per_minute.unwrap_or(base.requests_per_minute),
            input_tokens_per_minute: self
                .input_tokens_per_minute
                .unwrap_or(base.input_tokens_per_minute),
            output_tokens_per_minute: self
                .output_tokens_per_minute
                .unwrap_or(base.output_tokens_per_minute),
            max_concurrent: self.max_concurrent.unwrap_or(base.max_concurrent),
            daily_tokens: self.daily_tokens.unwrap_or(base.daily_tokens),
        }
    }
}

/// The highest priority class a tenant's requests may run in (set by the admin; a
/// request may ask for a lower class, never a higher one).
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum PriorityCeiling {
    /// Interactive (the highest class) and batch.
    #[default]
    Interactive,
    /// Batch only.
    Batch,
}

impl PriorityCeiling {
    /// Database spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Interactive => "interactive",
            Self::Batch => "batch",
        }
    }
}

impl FromStr for PriorityCeiling {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "interactive" => Ok(Self::Interactive),
            "batch" => Ok(Self::Batch),
            o => Err(format!(
                "priority must be `interactive` or `batch`. Given: {o}"
            )),
        }
    }
}

/// How the engines schedule a tenant's requests (set by the admin).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scheduling {
    /// Fair-share weight, 1..=[`Scheduling::MAX_WEIGHT`]: service in proportion.
    pub weight: u32,
    /// Highest class its requests run in.
    pub max_priority: PriorityCeiling,
}

impl Scheduling {
    /// Largest accepted weight.
    pub const MAX_WEIGHT: u32 = 1000;
}

impl Default for Scheduling {
    /// Weight 1, interactive allowed.
    fn default() -> Self {
        Self {
            weight: 1,
            max_priority: PriorityCeiling::Interactive,
        }
    }
}

/// A tenant's own bounds on the KV the engines keep cached of it (set by the admin;
/// 0: no bound of its own).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheLimits {
    /// Most prompt tokens (whole pages) each engine keeps in its pool for the
    /// tenant, at most [`CacheLimits::MAX_VALUE`]; past it its least recently used
    /// pages are dropped.
    pub max_cached_tokens: u64,
    /// Seconds a cached page may go unused before engines drop it (in every tier),
    /// at most [`CacheLimits::MAX_IDLE_TTL_SECS`].
    pub idle_ttl_secs: u64,
    /// When they were last set (Unix ms; 0: never). Engines keep the latest limits
    /// they have seen, so a request submitted before a change cannot undo it.
    #[serde(skip)]
    pub set_ms: i64,
}

impl CacheLimits {
    /// Largest accepted `max_cached_tokens`.
    pub const MAX_VALUE: u64 = 1 << 40;
    /// Largest accepted `idle_ttl_secs` (30 days).
    pub const MAX_IDLE_TTL_SECS: u64 = 30 * 86_400;
}

/// A tenant (account).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Tenant {
    /// Account id (32 lowercase hex chars), as used in `/client/v4/accounts/{id}`.
    pub id: String,
    /// Display name.
    pub name: String,
    /// Status.
    pub status: TenantStatus,
    /// Creation time (Unix ms).
    pub created_ms: i64,
    /// Limits.
    pub limits: Limits,
    /// Weight and priority ceiling.
    pub scheduling: Scheduling,
    /// Its own bounds on its cached KV.
    pub cache_limits: CacheLimits,
    /// Salt of the prefix-cache namespace (never shown).
    #[serde(skip)]
    pub cache_salt: String,
}

impl Tenant {
    /// The tenant id the engine tags KV pages with: the first 16 hex digits of the
    /// account id.
    pub fn engine_id(&self) -> u64 {
        u64::from_str_radix(self.id.get(..16).unwrap_or("0"), 16).unwrap_or(0)
    }

    /// The tenant's prefix-cache namespace: SHA-256 of a domain string, the account
    /// id and the cache salt. Derived here, on the server, from the tenant's record
    /// only: no request field reaches it, so no client can name another tenant's
    /// cache, and rotating the salt ([`Store::rotate_cache_salt`]) gives a namespace
    /// in which nothing is cached.
    ///
    /// [`Store::rotate_cache_salt`]: super::Store::rotate_cache_salt
    pub fn cache_namespace(&self) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(b"tessera.cache-namespace.v1\0");
        h.update(self.id.as_bytes());
        h.update(b"\0");
        h.update(self.cache_salt.as_bytes());
        h.finalize().into()
    }
}

/// An API key's public metadata (never the secret).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct KeyInfo {
    /// Public key id.
    pub key_id: String,
    /// Owner.
    pub tenant_id: String,
    /// Label.
    pub name: String,
    /// Creation time (Unix ms).
    pub created_ms: i64,
    /// Revocation time (Unix ms), if revoked.
    pub revoked_ms: Option<i64>,
    /// What the key may do.
    pub scopes: Scopes,
    /// Expiry time (Unix ms); `None`: never expires.
    pub expires_ms: Option<i64>,
}

/// What a new key carries besides its owner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NewKey {
    /// Label.
    pub name: String,
    /// Scopes ([`Scopes::DEFAULT`] by default).
    pub scopes: Scopes,
    /// Expiry time (Unix ms); `None`: never expires.
    pub expires_ms: Option<i64>,
}

impl NewKey {
    /// A key named `name` with every scope and no expiry.
    pub fn named(name: &str) -> Self {
        Self {
            name: name.into(),
            scopes: Scopes::DEFAULT,
            expires_ms: None,
        }
    }
}

/// An authenticated caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Principal {
    /// The key's tenant.
    pub tenant: Tenant,
    /// The key used.
    pub key_id: String,
    /// The key's scopes.
    pub scopes: Scopes,
}

/// Who performs an audited admin action: written into its audit row.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AuditCtx {
    /// The admin request's id (`x-request-id`; random per CLI run).
    pub request_id: String,
    /// The peer address of the admin request, or `cli:<user>`.
    pub source: String,
}

/// One row of the admin audit log.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct AuditRecord {
    /// Row id (sorts in time order).
    pub id: String,
    /// When (Unix ms).
    pub at_ms: i64,
    /// `tenant.create`, `tenant.suspend`, `tenant.activate`, `tenant.limits`,
    /// `tenant.scheduling`, `tenant.rotate_cache_salt`, `key.create` or `key.revoke`.
    pub action: String,
    /// The tenant id or key id acted on.
    pub target: String,
    /// The admin request id.
    pub request_id: String,
    /// Peer address or `cli:<user>`.
    pub source: String,
    /// What was set, as JSON (never a key secret).
    pub detail: serde_json::Value,
}

/// One usage-ledger row.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct UsageRecord {
    /// Request id (primary key: a request is recorded at most once).
    pub request_id: String,
    /// Tenant ('' when unauthenticated).
    pub tenant_id: String,
    /// Key id ('' when unauthenticated).
    pub key_id: String,
    /// Model id ('' when none was resolved).
    pub model: String,
    /// Endpoint label, e.g. `workers_ai.run`, `openai.chat`.
    pub endpoint: String,
    /// HTTP status sent.
    pub status: u16,
    /// Workers AI error code; 0 when none.
    pub error_code: u32,
    /// `stop`, `length`, `error` or `aborted`.
    pub finish: String,
    /// Prompt tokens.
    pub input_tokens: i64,
    /// Generated tokens.
    pub output_tokens: i64,
    /// Prompt tokens served from a cache (0: no prefix cache yet).
    pub cached_tokens: i64,
    /// Of `cached_tokens`, those restored from an engine's host-memory tier.
    pub cached_host_tokens: i64,
    /// Of `cached_tokens`, those restored from an engine's disk tier.
    pub cached_disk_tokens: i64,
    /// Time to first token, microseconds (0 when none).
    pub ttft_us: i64,
    /// Request duration, microseconds.
    pub duration_us: i64,
    /// When the request arrived (Unix ms).
    pub created_ms: i64,
}

/// Usage aggregation key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GroupBy {
    /// By model id.
    Model,
    /// By API key id.
    Key,
    /// By UTC hour.
    Hour,
    /// By UTC day.
    Day,
}

impl FromStr for GroupBy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "model" => Ok(Self::Model),
            "key" => Ok(Self::Key),
            "hour" => Ok(Self::Hour),
            "day" => Ok(Self::Day),
            o => Err(format!(
                "`group_by` must be one of model, key, hour, day. Given: {o}"
            )),
        }
    }
}

/// One group of the usage API.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct UsageGroup {
    /// Model id, key id, or bucket start (RFC 3339, UTC).
    pub key: String,
    /// Requests.
    pub requests: i64,
    /// Prompt tokens.
    pub input_tokens: i64,
    /// Generated tokens.
    pub output_tokens: i64,
    /// Cached prompt tokens (every tier).
    pub cached_tokens: i64,
    /// Of `cached_tokens`, those restored from host memory.
    pub cached_host_tokens: i64,
    /// Of `cached_tokens`, those restored from disk.
    pub cached_disk_tokens: i64,
    /// Requests that ended in an error status (>= 400).
    pub errors: i64,
}

impl UsageGroup {
    /// Adds `o`'s counts to this group's (the key stays).
    pub fn add(&mut self, o: &UsageGroup) {
        self.requests += o.requests;
        self.input_tokens += o.input_tokens;
        self.output_tokens += o.output_tokens;
        self.cached_tokens += o.cached_tokens;
        self.cached_host_tokens += o.cached_host_tokens;
        self.cached_disk_tokens += o.cached_disk_tokens;
        self.errors += o.errors;
    }
}
