//! [`Store`]: the tenancy database over sqlx's `Any` driver, so one set of SQL
//! statements and migrations serves SQLite (`sqlite://path`, the embedded default)
//! and PostgreSQL (`postgres://...`). Placeholders are `$1, $2, ...` (both accept them).

use crate::keys::{ApiKey, Scopes};
use crate::now_ms;
use serde::Serialize;
use serde_json::json;
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::{AnyConnection, AnyPool, Row};
use std::str::FromStr;

/// Migrations, in order; each runs once, inside a transaction.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "init", include_str!("../migrations/0001_init.sql")),
    (
        2,
        "scopes_audit_retention",
        include_str!("../migrations/0002_scopes_audit_retention.sql"),
    ),
    (
        3,
        "scheduling_cache",
        include_str!("../migrations/0003_scheduling_cache.sql"),
    ),
    (
        4,
        "model_access",
        include_str!("../migrations/0004_model_access.sql"),
    ),
];

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
    /// Scopes ([`Scopes::ALL`] by default).
    pub scopes: Scopes,
    /// Expiry time (Unix ms); `None`: never expires.
    pub expires_ms: Option<i64>,
}

impl NewKey {
    /// A key named `name` with every scope and no expiry.
    pub fn named(name: &str) -> Self {
        Self {
            name: name.into(),
            scopes: Scopes::ALL,
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
    /// Cached prompt tokens.
    pub cached_tokens: i64,
    /// Requests that ended in an error status (>= 400).
    pub errors: i64,
}

/// The tenancy database. Cheap to clone (a pool handle).
#[derive(Clone, Debug)]
pub struct Store {
    pool: AnyPool,
    backend: &'static str,
}

/// `YYYY-MM-DDTHH:MM:SSZ` for Unix milliseconds.
pub fn rfc3339(ms: i64) -> String {
    let secs = ms.div_euclid(1000);
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        (rem % 3600) / 60,
        rem % 60
    )
}

/// Days since 1970-01-01 -> (year, month, day) (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let y = yoe + era * 400;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (if m <= 2 { y + 1 } else { y }, m, d)
}

/// (year, month, day) -> days since 1970-01-01.
pub fn days_from_civil(y: i64, m: u32, d: u32) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = m as i64;
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + d as i64 - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Parses a time given as Unix seconds, `YYYY-MM-DD` or `YYYY-MM-DDTHH:MM:SSZ`
/// into Unix milliseconds.
pub fn parse_time(s: &str) -> Option<i64> {
    if let Ok(n) = s.parse::<i64>() {
        return n.checked_mul(1000);
    }
    let b = s.as_bytes();
    let num = |r: std::ops::Range<usize>| -> Option<i64> {
        let t = s.get(r)?;
        if t.bytes().all(|c| c.is_ascii_digit()) {
            t.parse().ok()
        } else {
            None
        }
    };
    if b.len() < 10 || b[4] != b'-' || b[7] != b'-' {
        return None;
    }
    let (y, mo, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    if !(1..=12).contains(&mo) || !(1..=31).contains(&d) {
        return None;
    }
    let mut secs = days_from_civil(y, mo as u32, d as u32) * 86_400;
    if b.len() > 10 {
        if b.len() != 20 || b[10] != b'T' || b[13] != b':' || b[16] != b':' || b[19] != b'Z' {
            return None;
        }
        let (h, mi, se) = (num(11..13)?, num(14..16)?, num(17..19)?);
        if h > 23 || mi > 59 || se > 60 {
            return None;
        }
        secs += h * 3600 + mi * 60 + se;
    }
    Some(secs * 1000)
}

fn get_i64(r: &AnyRow, c: &str) -> Result<i64, StoreError> {
    Ok(r.try_get::<i64, _>(c)?)
}

fn get_str(r: &AnyRow, c: &str) -> Result<String, StoreError> {
    Ok(r.try_get::<String, _>(c)?)
}

const TENANT_COLS: &str = "t.id, t.name, t.status, t.created_ms, t.weight, t.max_priority, \
     t.cache_salt, l.requests_per_minute, l.input_tokens_per_minute, l.output_tokens_per_minute, \
     l.max_concurrent, l.daily_tokens";

fn tenant_from_row(r: &AnyRow) -> Result<Tenant, StoreError> {
    Ok(Tenant {
        id: get_str(r, "id")?,
        name: get_str(r, "name")?,
        status: get_str(r, "status")?.parse()?,
        created_ms: get_i64(r, "created_ms")?,
        limits: Limits {
            requests_per_minute: get_i64(r, "requests_per_minute")? as u32,
            input_tokens_per_minute: get_i64(r, "input_tokens_per_minute")? as u32,
            output_tokens_per_minute: get_i64(r, "output_tokens_per_minute")? as u32,
            max_concurrent: get_i64(r, "max_concurrent")? as u32,
            daily_tokens: get_i64(r, "daily_tokens")? as u64,
        },
        scheduling: Scheduling {
            weight: get_i64(r, "weight")?.clamp(1, i64::from(Scheduling::MAX_WEIGHT)) as u32,
            max_priority: get_str(r, "max_priority")?
                .parse()
                .map_err(StoreError::Corrupt)?,
        },
        cache_salt: get_str(r, "cache_salt")?,
    })
}

fn scopes_of(r: &AnyRow) -> Result<Scopes, StoreError> {
    Scopes::parse(&get_str(r, "scopes")?).map_err(StoreError::Corrupt)
}

fn key_from_row(r: &AnyRow) -> Result<KeyInfo, StoreError> {
    Ok(KeyInfo {
        key_id: get_str(r, "key_id")?,
        tenant_id: get_str(r, "tenant_id")?,
        name: get_str(r, "name")?,
        created_ms: get_i64(r, "created_ms")?,
        revoked_ms: r.try_get::<Option<i64>, _>("revoked_ms")?,
        scopes: scopes_of(r)?,
        expires_ms: r.try_get::<Option<i64>, _>("expires_ms")?,
    })
}

fn audit_from_row(r: &AnyRow) -> Result<AuditRecord, StoreError> {
    let detail = get_str(r, "detail")?;
    Ok(AuditRecord {
        id: get_str(r, "id")?,
        at_ms: get_i64(r, "at_ms")?,
        action: get_str(r, "action")?,
        target: get_str(r, "target")?,
        request_id: get_str(r, "request_id")?,
        source: get_str(r, "source")?,
        detail: serde_json::from_str(&detail)
            .map_err(|e| StoreError::Corrupt(format!("audit detail: {e}")))?,
    })
}

/// Appends one audit row on `conn` (inside the action's transaction).
async fn audit_in(
    conn: &mut AnyConnection,
    by: Option<&AuditCtx>,
    action: &str,
    target: &str,
    detail: serde_json::Value,
) -> Result<(), StoreError> {
    let Some(by) = by else {
        return Ok(());
    };
    let us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0);
    sqlx::query(
        "INSERT INTO admin_audit (id, at_ms, action, target, request_id, source, detail) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
    )
    .bind(format!("{us:016x}{}", crate::random_hex(8)))
    .bind((us / 1000) as i64)
    .bind(action)
    .bind(target)
    .bind(&by.request_id)
    .bind(&by.source)
    .bind(detail.to_string())
    .execute(conn)
    .await?;
    Ok(())
}

/// The admin operations of a [`Store`], each writing its audit row in the same
/// transaction as the change (see [`Store::audited`]).
#[derive(Clone, Copy, Debug)]
pub struct Audited<'a> {
    store: &'a Store,
    by: &'a AuditCtx,
}

impl Audited<'_> {
    /// [`Store::create_tenant`], audited as `tenant.create`.
    pub async fn create_tenant(&self, name: &str, limits: Limits) -> Result<Tenant, StoreError> {
        self.store
            .create_tenant_as(Some(self.by), name, limits)
            .await
    }

    /// [`Store::set_status`], audited as `tenant.suspend` / `tenant.activate`.
    pub async fn set_status(&self, id: &str, status: TenantStatus) -> Result<(), StoreError> {
        self.store.set_status_as(Some(self.by), id, status).await
    }

    /// [`Store::set_limits`], audited as `tenant.limits`.
    pub async fn set_limits(&self, id: &str, l: Limits) -> Result<(), StoreError> {
        self.store.set_limits_as(Some(self.by), id, l).await
    }

    /// [`Store::set_scheduling`], audited as `tenant.scheduling`.
    pub async fn set_scheduling(&self, id: &str, s: Scheduling) -> Result<(), StoreError> {
        self.store.set_scheduling_as(Some(self.by), id, s).await
    }

    /// [`Store::rotate_cache_salt`], audited as `tenant.rotate_cache_salt` (the
    /// salt itself is not logged).
    pub async fn rotate_cache_salt(&self, id: &str) -> Result<(), StoreError> {
        self.store.rotate_cache_salt_as(Some(self.by), id).await
    }

    /// [`Store::create_key_with`], audited as `key.create` (the secret is not logged).
    pub async fn create_key(
        &self,
        tenant_id: &str,
        key: &NewKey,
    ) -> Result<(KeyInfo, String), StoreError> {
        self.store
            .create_key_as(Some(self.by), tenant_id, key)
            .await
    }

    /// [`Store::revoke_key`], audited as `key.revoke` (only when a key was revoked).
    pub async fn revoke_key(&self, key_id: &str) -> Result<bool, StoreError> {
        self.store.revoke_key_as(Some(self.by), key_id).await
    }

    /// [`Store::set_model_access`], audited as `model.access` (detail: `private`,
    /// `tenants`).
    pub async fn set_model_access(
        &self,
        model: &str,
        private: bool,
        tenants: &[String],
    ) -> Result<ModelAccess, StoreError> {
        self.store
            .set_model_access_as(Some(self.by), model, private, tenants)
            .await
    }
}

fn usage_from_row(r: &AnyRow) -> Result<UsageRecord, StoreError> {
    Ok(UsageRecord {
        request_id: get_str(r, "request_id")?,
        tenant_id: get_str(r, "tenant_id")?,
        key_id: get_str(r, "key_id")?,
        model: get_str(r, "model")?,
        endpoint: get_str(r, "endpoint")?,
        status: get_i64(r, "status")? as u16,
        error_code: get_i64(r, "error_code")? as u32,
        finish: get_str(r, "finish")?,
        input_tokens: get_i64(r, "input_tokens")?,
        output_tokens: get_i64(r, "output_tokens")?,
        cached_tokens: get_i64(r, "cached_tokens")?,
        ttft_us: get_i64(r, "ttft_us")?,
        duration_us: get_i64(r, "duration_us")?,
        created_ms: get_i64(r, "created_ms")?,
    })
}

impl Store {
    /// Opens (creating a SQLite file if needed) and migrates the store at `url`:
    /// `sqlite://PATH` or `postgres://USER@HOST/DB`.
    pub async fn connect(url: &str) -> Result<Self, StoreError> {
        sqlx::any::install_default_drivers();
        let (url, backend, max) = if let Some(path) = url.strip_prefix("sqlite://") {
            let sep = if path.contains('?') { '&' } else { '?' };
            let u = if path.contains("mode=") {
                url.to_string()
            } else {
                format!("{url}{sep}mode=rwc")
            };
            (u, "sqlite", 4)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            (url.to_string(), "postgres", 16)
        } else {
            return Err(StoreError::BadUrl(url.into()));
        };
        let pool = AnyPoolOptions::new()
            .max_connections(max)
            .after_connect(move |conn, _| {
                Box::pin(async move {
                    if backend == "sqlite" {
                        // WAL + synchronous=NORMAL: a commit does not wait for
                        // fsync (the WAL is synced at checkpoints); the database
                        // stays consistent, and an OS crash or power loss can lose
                        // the last commits. Use PostgreSQL where that matters.
                        sqlx::query("PRAGMA synchronous=NORMAL")
                            .execute(&mut *conn)
                            .await?;
                    }
                    Ok(())
                })
            })
            .connect(&url)
            .await?;
        if backend == "sqlite" {
            // Persistent per database file; sqlx already sets a busy timeout and
            // enables foreign keys on every SQLite connection.
            sqlx::query("PRAGMA journal_mode=WAL")
                .fetch_all(&pool)
                .await?;
        }
        let store = Self { pool, backend };
        store.migrate().await?;
        Ok(store)
    }

    /// Begins a transaction that will write. On SQLite it takes the write lock
    /// up front (`BEGIN IMMEDIATE`): a deferred transaction that reads first and
    /// then writes fails with SQLITE_BUSY at once when another connection wrote
    /// in between, without waiting for the busy timeout
    /// (<https://www.sqlite.org/lang_transaction.html>, "deferred").
    async fn write_tx(&self) -> Result<sqlx::Transaction<'static, sqlx::Any>, StoreError> {
        Ok(if self.backend == "sqlite" {
            self.pool.begin_with("BEGIN IMMEDIATE").await?
        } else {
            self.pool.begin().await?
        })
    }

    /// `sqlite` or `postgres`.
    pub fn backend(&self) -> &'static str {
        self.backend
    }

    async fn migrate(&self) -> Result<(), StoreError> {
        sqlx::raw_sql(
            "CREATE TABLE IF NOT EXISTS tessera_migrations (version BIGINT PRIMARY KEY, \
             name TEXT NOT NULL, applied_ms BIGINT NOT NULL)",
        )
        .execute(&self.pool)
        .await?;
        for &(version, name, sql) in MIGRATIONS {
            let done = sqlx::query("SELECT version FROM tessera_migrations WHERE version = $1")
                .bind(version)
                .fetch_optional(&self.pool)
                .await?;
            if done.is_some() {
                continue;
            }
            let mut tx = self.write_tx().await?;
            sqlx::raw_sql(sql).execute(&mut *tx).await?;
            sqlx::query(
                "INSERT INTO tessera_migrations (version, name, applied_ms) VALUES ($1, $2, $3)",
            )
            .bind(version)
            .bind(name)
            .bind(now_ms())
            .execute(&mut *tx)
            .await?;
            tx.commit().await?;
            tracing::info!(version, name, "applied migration");
        }
        Ok(())
    }

    /// Whether the database answers.
    pub async fn ping(&self) -> bool {
        sqlx::query("SELECT 1").fetch_one(&self.pool).await.is_ok()
    }

    /// The admin operations, audited as done `by` (one audit row per change, in
    /// the change's transaction). The unaudited methods below are for tests and
    /// tools that are not admin actions.
    pub fn audited<'a>(&'a self, by: &'a AuditCtx) -> Audited<'a> {
        Audited { store: self, by }
    }

    /// Creates an active tenant with a fresh account id (not audited; see
    /// [`Store::audited`]).
    pub async fn create_tenant(&self, name: &str, limits: Limits) -> Result<Tenant, StoreError> {
        self.create_tenant_as(None, name, limits).await
    }

    async fn create_tenant_as(
        &self,
        by: Option<&AuditCtx>,
        name: &str,
        limits: Limits,
    ) -> Result<Tenant, StoreError> {
        let t = Tenant {
            id: crate::random_hex(16),
            name: name.into(),
            status: TenantStatus::Active,
            created_ms: now_ms(),
            limits,
            scheduling: Scheduling::default(),
            cache_salt: crate::random_hex(16),
        };
        let mut tx = self.write_tx().await?;
        sqlx::query(
            "INSERT INTO tenants (id, name, status, created_ms, weight, max_priority, cache_salt) \
             VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(&t.id)
        .bind(&t.name)
        .bind(t.status.as_str())
        .bind(t.created_ms)
        .bind(i64::from(t.scheduling.weight))
        .bind(t.scheduling.max_priority.as_str())
        .bind(&t.cache_salt)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "INSERT INTO tenant_limits (tenant_id, requests_per_minute, input_tokens_per_minute, \
             output_tokens_per_minute, max_concurrent, daily_tokens) VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&t.id)
        .bind(limits.requests_per_minute as i64)
        .bind(limits.input_tokens_per_minute as i64)
        .bind(limits.output_tokens_per_minute as i64)
        .bind(limits.max_concurrent as i64)
        .bind(limits.daily_tokens as i64)
        .execute(&mut *tx)
        .await?;
        let detail = json!({"name": name, "limits": limits});
        audit_in(&mut tx, by, "tenant.create", &t.id, detail).await?;
        tx.commit().await?;
        Ok(t)
    }

    /// All tenants, oldest first.
    pub async fn list_tenants(&self) -> Result<Vec<Tenant>, StoreError> {
        let q = format!(
            "SELECT {TENANT_COLS} FROM tenants t JOIN tenant_limits l ON l.tenant_id = t.id \
             ORDER BY t.created_ms, t.id"
        );
        let rows = sqlx::query(&q).fetch_all(&self.pool).await?;
        rows.iter().map(tenant_from_row).collect()
    }

    /// One tenant.
    pub async fn tenant(&self, id: &str) -> Result<Option<Tenant>, StoreError> {
        let q = format!(
            "SELECT {TENANT_COLS} FROM tenants t JOIN tenant_limits l ON l.tenant_id = t.id \
             WHERE t.id = $1"
        );
        let row = sqlx::query(&q).bind(id).fetch_optional(&self.pool).await?;
        row.as_ref().map(tenant_from_row).transpose()
    }

    /// Who may use model `model` (a catalog id): its row, or public when the store
    /// has none.
    pub async fn model_access(&self, model: &str) -> Result<ModelAccess, StoreError> {
        let row = sqlx::query("SELECT visibility FROM model_access WHERE model = $1")
            .bind(model)
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else {
            return Ok(ModelAccess::public(model));
        };
        let private = get_str(&row, "visibility")? == "private";
        let tenants =
            sqlx::query("SELECT tenant_id FROM model_grants WHERE model = $1 ORDER BY tenant_id")
                .bind(model)
                .fetch_all(&self.pool)
                .await?
                .iter()
                .map(|r| get_str(r, "tenant_id"))
                .collect::<Result<_, _>>()?;
        Ok(ModelAccess {
            model: model.into(),
            private,
            tenants,
        })
    }

    /// Every model the store has an access row for, by id.
    pub async fn list_model_access(&self) -> Result<Vec<ModelAccess>, StoreError> {
        let models = sqlx::query("SELECT model FROM model_access ORDER BY model")
            .fetch_all(&self.pool)
            .await?;
        let mut out = Vec::with_capacity(models.len());
        for r in &models {
            out.push(self.model_access(&get_str(r, "model")?).await?);
        }
        Ok(out)
    }

    /// Makes model `model` public (`private` false: every tenant; `tenants` must be
    /// empty) or private to `tenants` (each an existing tenant id), replacing what
    /// was set before (not audited; see [`Store::audited`]). Effective on the next
    /// request.
    ///
    /// Errors: [`StoreError::Invalid`] for tenants given with a public model or a
    /// model id of 0 or over 256 bytes; [`StoreError::NoTenant`] naming the first
    /// unknown tenant.
    pub async fn set_model_access(
        &self,
        model: &str,
        private: bool,
        tenants: &[String],
    ) -> Result<ModelAccess, StoreError> {
        self.set_model_access_as(None, model, private, tenants)
            .await
    }

    async fn set_model_access_as(
        &self,
        by: Option<&AuditCtx>,
        model: &str,
        private: bool,
        tenants: &[String],
    ) -> Result<ModelAccess, StoreError> {
        if model.is_empty() || model.len() > 256 {
            return Err(StoreError::Invalid(format!(
                "a model id must be 1 to 256 bytes. Given: {} bytes",
                model.len()
            )));
        }
        if !private && !tenants.is_empty() {
            return Err(StoreError::Invalid(
                "`tenants` lists who may use a private model; a public model takes none".into(),
            ));
        }
        let mut tenants: Vec<String> = tenants.to_vec();
        tenants.sort();
        tenants.dedup();
        let mut tx = self.write_tx().await?;
        for t in &tenants {
            let found = sqlx::query("SELECT id FROM tenants WHERE id = $1")
                .bind(t)
                .fetch_optional(&mut *tx)
                .await?;
            if found.is_none() {
                return Err(StoreError::NoTenant(t.clone()));
            }
        }
        let visibility = if private { "private" } else { "public" };
        sqlx::query("DELETE FROM model_access WHERE model = $1")
            .bind(model)
            .execute(&mut *tx)
            .await?;
        sqlx::query("INSERT INTO model_access (model, visibility, updated_ms) VALUES ($1, $2, $3)")
            .bind(model)
            .bind(visibility)
            .bind(now_ms())
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM model_grants WHERE model = $1")
            .bind(model)
            .execute(&mut *tx)
            .await?;
        for t in &tenants {
            sqlx::query("INSERT INTO model_grants (model, tenant_id) VALUES ($1, $2)")
                .bind(model)
                .bind(t)
                .execute(&mut *tx)
                .await?;
        }
        let access = ModelAccess {
            model: model.into(),
            private,
            tenants,
        };
        audit_in(
            &mut tx,
            by,
            "model.access",
            model,
            json!({"private": access.private, "tenants": access.tenants}),
        )
        .await?;
        tx.commit().await?;
        Ok(access)
    }

    /// Sets a tenant's status (not audited; see [`Store::audited`]); effective on
    /// its next request, and a running gateway aborts the tenant's requests in
    /// flight when it sees a suspension.
    pub async fn set_status(&self, id: &str, status: TenantStatus) -> Result<(), StoreError> {
        self.set_status_as(None, id, status).await
    }

    async fn set_status_as(
        &self,
        by: Option<&AuditCtx>,
        id: &str,
        status: TenantStatus,
    ) -> Result<(), StoreError> {
        let mut tx = self.write_tx().await?;
        let r = sqlx::query("UPDATE tenants SET status = $1 WHERE id = $2")
            .bind(status.as_str())
            .bind(id)
            .execute(&mut *tx)
            .await?;
        if r.rows_affected() == 0 {
            return Err(StoreError::NoTenant(id.into()));
        }
        let action = match status {
            TenantStatus::Active => "tenant.activate",
            TenantStatus::Suspended => "tenant.suspend",
        };
        audit_in(&mut tx, by, action, id, json!({"status": status})).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Replaces a tenant's limits (not audited; see [`Store::audited`]); effective
    /// on its next request.
    pub async fn set_limits(&self, id: &str, l: Limits) -> Result<(), StoreError> {
        self.set_limits_as(None, id, l).await
    }

    async fn set_limits_as(
        &self,
        by: Option<&AuditCtx>,
        id: &str,
        l: Limits,
    ) -> Result<(), StoreError> {
        let mut tx = self.write_tx().await?;
        let r = sqlx::query(
            "UPDATE tenant_limits SET requests_per_minute = $1, input_tokens_per_minute = $2, \
             output_tokens_per_minute = $3, max_concurrent = $4, daily_tokens = $5 WHERE tenant_id = $6",
        )
        .bind(l.requests_per_minute as i64)
        .bind(l.input_tokens_per_minute as i64)
        .bind(l.output_tokens_per_minute as i64)
        .bind(l.max_concurrent as i64)
        .bind(l.daily_tokens as i64)
        .bind(id)
        .execute(&mut *tx)
        .await?;
        if r.rows_affected() == 0 {
            return Err(StoreError::NoTenant(id.into()));
        }
        audit_in(&mut tx, by, "tenant.limits", id, json!({"limits": l})).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Sets a tenant's weight and priority ceiling (not audited; see
    /// [`Store::audited`]); effective on its next request.
    ///
    /// Errors: [`StoreError::NoTenant`]; [`StoreError::Invalid`] for a weight
    /// outside `1..=`[`Scheduling::MAX_WEIGHT`].
    pub async fn set_scheduling(&self, id: &str, s: Scheduling) -> Result<(), StoreError> {
        self.set_scheduling_as(None, id, s).await
    }

    async fn set_scheduling_as(
        &self,
        by: Option<&AuditCtx>,
        id: &str,
        s: Scheduling,
    ) -> Result<(), StoreError> {
        if !(1..=Scheduling::MAX_WEIGHT).contains(&s.weight) {
            return Err(StoreError::Invalid(format!(
                "`weight` must be 1..={}. Given: {}",
                Scheduling::MAX_WEIGHT,
                s.weight
            )));
        }
        let mut tx = self.write_tx().await?;
        let r = sqlx::query("UPDATE tenants SET weight = $1, max_priority = $2 WHERE id = $3")
            .bind(i64::from(s.weight))
            .bind(s.max_priority.as_str())
            .bind(id)
            .execute(&mut *tx)
            .await?;
        if r.rows_affected() == 0 {
            return Err(StoreError::NoTenant(id.into()));
        }
        audit_in(
            &mut tx,
            by,
            "tenant.scheduling",
            id,
            json!({"scheduling": s}),
        )
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Gives the tenant a fresh random cache salt (not audited; see
    /// [`Store::audited`]): from its next request on, nothing it cached before is
    /// found again (the old pages age out of the engines' caches).
    pub async fn rotate_cache_salt(&self, id: &str) -> Result<(), StoreError> {
        self.rotate_cache_salt_as(None, id).await
    }

    async fn rotate_cache_salt_as(
        &self,
        by: Option<&AuditCtx>,
        id: &str,
    ) -> Result<(), StoreError> {
        let mut tx = self.write_tx().await?;
        let r = sqlx::query("UPDATE tenants SET cache_salt = $1 WHERE id = $2")
            .bind(crate::random_hex(16))
            .bind(id)
            .execute(&mut *tx)
            .await?;
        if r.rows_affected() == 0 {
            return Err(StoreError::NoTenant(id.into()));
        }
        audit_in(&mut tx, by, "tenant.rotate_cache_salt", id, json!({})).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Creates a key with every scope and no expiry for `tenant_id` (not audited);
    /// see [`Store::create_key_with`].
    pub async fn create_key(
        &self,
        tenant_id: &str,
        name: &str,
    ) -> Result<(KeyInfo, String), StoreError> {
        self.create_key_as(None, tenant_id, &NewKey::named(name))
            .await
    }

    /// Creates a key for `tenant_id` with `key`'s scopes and expiry (not audited;
    /// see [`Store::audited`]); returns its metadata and the full key string, which
    /// is shown once and never stored.
    pub async fn create_key_with(
        &self,
        tenant_id: &str,
        key: &NewKey,
    ) -> Result<(KeyInfo, String), StoreError> {
        self.create_key_as(None, tenant_id, key).await
    }

    async fn create_key_as(
        &self,
        by: Option<&AuditCtx>,
        tenant_id: &str,
        new: &NewKey,
    ) -> Result<(KeyInfo, String), StoreError> {
        let mut tx = self.write_tx().await?;
        let exists = sqlx::query("SELECT id FROM tenants WHERE id = $1")
            .bind(tenant_id)
            .fetch_optional(&mut *tx)
            .await?;
        if exists.is_none() {
            return Err(StoreError::NoTenant(tenant_id.into()));
        }
        let key = ApiKey::generate();
        let info = KeyInfo {
            key_id: key.key_id().into(),
            tenant_id: tenant_id.into(),
            name: new.name.clone(),
            created_ms: now_ms(),
            revoked_ms: None,
            scopes: new.scopes,
            expires_ms: new.expires_ms,
        };
        sqlx::query(
            "INSERT INTO api_keys (key_id, tenant_id, name, secret_sha256, created_ms, scopes, \
             expires_ms) VALUES ($1, $2, $3, $4, $5, $6, $7)",
        )
        .bind(&info.key_id)
        .bind(&info.tenant_id)
        .bind(&info.name)
        .bind(key.digest_hex())
        .bind(info.created_ms)
        .bind(info.scopes.to_string())
        .bind(info.expires_ms)
        .execute(&mut *tx)
        .await?;
        let detail = json!({
            "tenant_id": tenant_id, "name": new.name, "scopes": new.scopes,
            "expires_ms": new.expires_ms,
        });
        audit_in(&mut tx, by, "key.create", &info.key_id, detail).await?;
        tx.commit().await?;
        Ok((info, key.expose()))
    }

    /// `select` (no WHERE clause), restricted to `tenant_id` when given, then `order`.
    async fn select_for_tenant(
        &self,
        select: &str,
        order: &str,
        tenant_id: Option<&str>,
    ) -> Result<Vec<AnyRow>, StoreError> {
        Ok(match tenant_id {
            Some(t) => {
                sqlx::query(&format!("{select} WHERE tenant_id = $1 {order}"))
                    .bind(t)
                    .fetch_all(&self.pool)
                    .await?
            }
            None => {
                sqlx::query(&format!("{select} {order}"))
                    .fetch_all(&self.pool)
                    .await?
            }
        })
    }

    /// Keys, of one tenant or of all.
    pub async fn list_keys(&self, tenant_id: Option<&str>) -> Result<Vec<KeyInfo>, StoreError> {
        let cols = "key_id, tenant_id, name, created_ms, revoked_ms, scopes, expires_ms";
        let rows = self
            .select_for_tenant(
                &format!("SELECT {cols} FROM api_keys"),
                "ORDER BY created_ms, key_id",
                tenant_id,
            )
            .await?;
        rows.iter().map(key_from_row).collect()
    }

    /// Revokes a key (not audited; see [`Store::audited`]); returns false if no
    /// active key has that id. Effective on the next request (every request reads
    /// the key's row), and a running gateway aborts the key's requests in flight.
    pub async fn revoke_key(&self, key_id: &str) -> Result<bool, StoreError> {
        self.revoke_key_as(None, key_id).await
    }

    async fn revoke_key_as(&self, by: Option<&AuditCtx>, key_id: &str) -> Result<bool, StoreError> {
        let mut tx = self.write_tx().await?;
        let r = sqlx::query(
            "UPDATE api_keys SET revoked_ms = $1 WHERE key_id = $2 AND revoked_ms IS NULL",
        )
        .bind(now_ms())
        .bind(key_id)
        .execute(&mut *tx)
        .await?;
        let revoked = r.rows_affected() > 0;
        if revoked {
            audit_in(&mut tx, by, "key.revoke", key_id, json!({})).await?;
        }
        tx.commit().await?;
        Ok(revoked)
    }

    /// Of `key_ids`, those that can no longer authenticate (revoked, expired, the
    /// tenant suspended, or gone), each with the reason. One query per 100 ids.
    pub async fn invalid_keys(
        &self,
        key_ids: &[String],
    ) -> Result<Vec<(String, AuthError)>, StoreError> {
        let mut out = Vec::new();
        let now = now_ms();
        for chunk in key_ids.chunks(100) {
            let marks: Vec<String> = (1..=chunk.len()).map(|i| format!("${i}")).collect();
            let q = format!(
                "SELECT k.key_id, k.revoked_ms, k.expires_ms, t.id, t.status FROM api_keys k \
                 JOIN tenants t ON t.id = k.tenant_id WHERE k.key_id IN ({})",
                marks.join(", ")
            );
            let mut query = sqlx::query(&q);
            for k in chunk {
                query = query.bind(k);
            }
            let rows = query.fetch_all(&self.pool).await?;
            let mut seen = std::collections::HashSet::new();
            for r in &rows {
                let key_id = get_str(r, "key_id")?;
                seen.insert(key_id.clone());
                let why = if r.try_get::<Option<i64>, _>("revoked_ms")?.is_some() {
                    Some(AuthError::Revoked)
                } else if r
                    .try_get::<Option<i64>, _>("expires_ms")?
                    .is_some_and(|e| e <= now)
                {
                    Some(AuthError::Expired)
                } else if get_str(r, "status")?.parse::<TenantStatus>()? == TenantStatus::Suspended
                {
                    Some(AuthError::Suspended(get_str(r, "id")?))
                } else {
                    None
                };
                if let Some(w) = why {
                    out.push((key_id, w));
                }
            }
            for k in chunk {
                if !seen.contains(k) {
                    out.push((k.clone(), AuthError::Invalid));
                }
            }
        }
        Ok(out)
    }

    /// Resolves a presented key string to its tenant. The secret is checked by
    /// comparing SHA-256 digests in constant time; an unknown key id still costs
    /// one digest and one comparison.
    pub async fn authenticate(
        &self,
        presented: &str,
    ) -> Result<Result<Principal, AuthError>, StoreError> {
        let Ok(key) = ApiKey::parse(presented) else {
            return Ok(Err(AuthError::Malformed));
        };
        let q = format!(
            "SELECT k.secret_sha256, k.revoked_ms, k.expires_ms, k.scopes, {TENANT_COLS} FROM api_keys k \
             JOIN tenants t ON t.id = k.tenant_id JOIN tenant_limits l ON l.tenant_id = t.id \
             WHERE k.key_id = $1"
        );
        let row = sqlx::query(&q)
            .bind(key.key_id())
            .fetch_optional(&self.pool)
            .await?;
        let Some(row) = row else {
            let _ = key.verify(&"0".repeat(64));
            return Ok(Err(AuthError::Invalid));
        };
        let stored = get_str(&row, "secret_sha256")?;
        if !key.verify(&stored) {
            return Ok(Err(AuthError::Invalid));
        }
        if row.try_get::<Option<i64>, _>("revoked_ms")?.is_some() {
            return Ok(Err(AuthError::Revoked));
        }
        if row
            .try_get::<Option<i64>, _>("expires_ms")?
            .is_some_and(|e| e <= now_ms())
        {
            return Ok(Err(AuthError::Expired));
        }
        let tenant = tenant_from_row(&row)?;
        if tenant.status == TenantStatus::Suspended {
            return Ok(Err(AuthError::Suspended(tenant.id)));
        }
        Ok(Ok(Principal {
            tenant,
            key_id: key.key_id().into(),
            scopes: scopes_of(&row)?,
        }))
    }

    /// Writes a usage row. Returns false (and changes nothing) when a row with the
    /// same request id exists: a request is recorded exactly once.
    pub async fn record_usage(&self, u: &UsageRecord) -> Result<bool, StoreError> {
        let r = sqlx::query(
            "INSERT INTO usage_ledger (request_id, tenant_id, key_id, model, endpoint, status, \
             error_code, finish, input_tokens, output_tokens, cached_tokens, ttft_us, duration_us, \
             created_ms) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) \
             ON CONFLICT (request_id) DO NOTHING",
        )
        .bind(&u.request_id)
        .bind(&u.tenant_id)
        .bind(&u.key_id)
        .bind(&u.model)
        .bind(&u.endpoint)
        .bind(u.status as i64)
        .bind(u.error_code as i64)
        .bind(&u.finish)
        .bind(u.input_tokens)
        .bind(u.output_tokens)
        .bind(u.cached_tokens)
        .bind(u.ttft_us)
        .bind(u.duration_us)
        .bind(u.created_ms)
        .execute(&self.pool)
        .await?;
        Ok(r.rows_affected() == 1)
    }

    /// Ledger rows, optionally of one tenant, oldest first.
    pub async fn usage_rows(
        &self,
        tenant_id: Option<&str>,
    ) -> Result<Vec<UsageRecord>, StoreError> {
        let base = "SELECT request_id, tenant_id, key_id, model, endpoint, status, error_code, \
                    finish, input_tokens, output_tokens, cached_tokens, ttft_us, duration_us, \
                    created_ms FROM usage_ledger";
        let rows = self
            .select_for_tenant(base, "ORDER BY created_ms, request_id", tenant_id)
            .await?;
        rows.iter().map(usage_from_row).collect()
    }

    /// One ledger row by request id.
    pub async fn usage_row(&self, request_id: &str) -> Result<Option<UsageRecord>, StoreError> {
        let row = sqlx::query(
            "SELECT request_id, tenant_id, key_id, model, endpoint, status, error_code, finish, \
             input_tokens, output_tokens, cached_tokens, ttft_us, duration_us, created_ms \
             FROM usage_ledger WHERE request_id = $1",
        )
        .bind(request_id)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(usage_from_row).transpose()
    }

    /// Deletes ledger rows created before `before_ms` (the retention prune);
    /// returns how many.
    pub async fn prune_usage(&self, before_ms: i64) -> Result<u64, StoreError> {
        let r = sqlx::query("DELETE FROM usage_ledger WHERE created_ms < $1")
            .bind(before_ms)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected())
    }

    /// Audit rows in `[since_ms, until_ms)`, oldest first, at most `limit`.
    pub async fn audit_rows(
        &self,
        since_ms: i64,
        until_ms: i64,
        limit: u32,
    ) -> Result<Vec<AuditRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, at_ms, action, target, request_id, source, detail FROM admin_audit \
             WHERE at_ms >= $1 AND at_ms < $2 ORDER BY id LIMIT $3",
        )
        .bind(since_ms)
        .bind(until_ms)
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(audit_from_row).collect()
    }

    /// Input + output tokens of `tenant_id` since `since_ms`.
    pub async fn tokens_since(&self, tenant_id: &str, since_ms: i64) -> Result<i64, StoreError> {
        let row = sqlx::query(
            "SELECT CAST(COALESCE(SUM(input_tokens + output_tokens), 0) AS BIGINT) AS n \
             FROM usage_ledger WHERE tenant_id = $1 AND created_ms >= $2",
        )
        .bind(tenant_id)
        .bind(since_ms)
        .fetch_one(&self.pool)
        .await?;
        get_i64(&row, "n")
    }

    /// A tenant's usage in `[since_ms, until_ms)`, grouped. Only `tenant_id`'s rows
    /// are ever read.
    pub async fn usage_summary(
        &self,
        tenant_id: &str,
        since_ms: i64,
        until_ms: i64,
        group_by: GroupBy,
    ) -> Result<Vec<UsageGroup>, StoreError> {
        let expr = match group_by {
            GroupBy::Model => "model",
            GroupBy::Key => "key_id",
            GroupBy::Hour => "(created_ms / 3600000) * 3600000",
            GroupBy::Day => "(created_ms / 86400000) * 86400000",
        };
        let q = format!(
            "SELECT {expr} AS k, COUNT(*) AS requests, \
             CAST(COALESCE(SUM(input_tokens), 0) AS BIGINT) AS input_tokens, \
             CAST(COALESCE(SUM(output_tokens), 0) AS BIGINT) AS output_tokens, \
             CAST(COALESCE(SUM(cached_tokens), 0) AS BIGINT) AS cached_tokens, \
             CAST(COALESCE(SUM(CASE WHEN status >= 400 THEN 1 ELSE 0 END), 0) AS BIGINT) AS errors \
             FROM usage_ledger WHERE tenant_id = $1 AND created_ms >= $2 AND created_ms < $3 \
             GROUP BY {expr} ORDER BY 1"
        );
        let rows = sqlx::query(&q)
            .bind(tenant_id)
            .bind(since_ms)
            .bind(until_ms)
            .fetch_all(&self.pool)
            .await?;
        rows.iter()
            .map(|r| {
                let key = match group_by {
                    GroupBy::Model | GroupBy::Key => get_str(r, "k")?,
                    GroupBy::Hour | GroupBy::Day => rfc3339(get_i64(r, "k")?),
                };
                Ok(UsageGroup {
                    key,
                    requests: get_i64(r, "requests")?,
                    input_tokens: get_i64(r, "input_tokens")?,
                    output_tokens: get_i64(r, "output_tokens")?,
                    cached_tokens: get_i64(r, "cached_tokens")?,
                    errors: get_i64(r, "errors")?,
                })
            })
            .collect()
    }
}
