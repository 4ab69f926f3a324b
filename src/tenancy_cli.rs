//! `tessera tenant|key|usage|audit`: the admin operations against the store
//! directly (the same store `tessera serve` uses; changes apply to a running server
//! on its next request, and a revocation or suspension aborts the requests it has
//! in flight within its revocation poll). Every change writes an audit row
//! (source `cli:<user>`). Output is JSON.

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use serde_json::json;
use std::path::PathBuf;
use tessera_config::secret_files::{create_private_dir, create_secret_file};
use tessera_tenancy::store::{parse_time, rfc3339};
use tessera_tenancy::{
    AuditCtx, CacheLimits, GroupBy, Limits, LimitsPatch, NewKey, PriorityCeiling, Scheduling,
    Scopes, Store, TenantStatus,
};

/// Where the store lives: `--store URL`, or a SQLite file in `--data-dir`.
#[derive(Args, Debug, Clone)]
pub(crate) struct StoreArgs {
    /// Store URL: sqlite://PATH or postgres://USER@HOST/DB (default: SQLite in --data-dir).
    #[arg(long, env = "TESSERA_STORE", global = true)]
    pub(crate) store: Option<String>,
    /// Directory for the default SQLite store, the admin token and TLS files.
    #[arg(
        long,
        env = "TESSERA_DATA_DIR",
        default_value = ".tessera",
        global = true
    )]
    pub(crate) data_dir: PathBuf,
}

impl StoreArgs {
    pub(crate) async fn open(&self) -> Result<Store> {
        let url = match &self.store {
            Some(u) => u.clone(),
            None => {
                // The store holds key hashes and every tenant's usage: owner only,
                // from the directory's creation on (and an existing one tightened).
                create_private_dir(&self.data_dir)
                    .with_context(|| format!("creating {}", self.data_dir.display()))?;
                #[cfg(unix)]
                {
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(
                        &self.data_dir,
                        std::fs::Permissions::from_mode(0o700),
                    )
                    .with_context(|| format!("restricting {}", self.data_dir.display()))?;
                }
                format!("sqlite://{}", self.data_dir.join("tessera.db").display())
            }
        };
        precreate_sqlite(&url)?;
        Store::connect(&url)
            .await
            .with_context(|| format!("opening store {url}"))
    }
}

/// Creates a SQLite store's file `0600` (`O_EXCL`) before SQLite opens it, when it
/// does not exist yet: SQLite would create it with the umask's mode (0644), and gives
/// its `-wal` and `-shm` files the database file's mode. Other URLs, in-memory
/// databases and existing files are left alone; a missing directory is SQLite's
/// error to report.
fn precreate_sqlite(url: &str) -> Result<()> {
    let Some(rest) = url.strip_prefix("sqlite://") else {
        return Ok(());
    };
    let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
    if path.is_empty() || path == ":memory:" || query.contains("mode=memory") {
        return Ok(());
    }
    let path = std::path::Path::new(path);
    if !path
        .parent()
        .is_none_or(|d| d.as_os_str().is_empty() || d.is_dir())
    {
        return Ok(());
    }
    match create_secret_file(path, b"") {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => {
            Err(e).with_context(|| format!("creating the store file {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// Limit flags (0 = unlimited); a flag not given keeps the base value (the
/// defaults on `tenant create`, the tenant's current value on `tenant limits`).
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct LimitArgs {
    /// Requests per minute.
    #[arg(long)]
    rpm: Option<u32>,
    /// Input tokens per minute.
    #[arg(long)]
    input_tpm: Option<u32>,
    /// Output tokens per minute (charged with max_tokens at admission).
    #[arg(long)]
    output_tpm: Option<u32>,
    /// Concurrent requests.
    #[arg(long)]
    max_concurrent: Option<u32>,
    /// Tokens (input + output) per UTC day.
    #[arg(long)]
    daily_tokens: Option<u64>,
}

impl LimitArgs {
    fn patch(&self) -> LimitsPatch {
        LimitsPatch {
            requests_per_minute: self.rpm,
            input_tokens_per_minute: self.input_tpm,
            output_tokens_per_minute: self.output_tpm,
            max_concurrent: self.max_concurrent,
            daily_tokens: self.daily_tokens,
        }
    }
}

const NEW: Limits = Limits::NEW_TENANT;

/// The limits of new tenants (`tessera serve` for the admin API and the first-start
/// tenant, `tessera tenant create` for flags not given). Set the environment
/// variables once so that both agree.
#[derive(Args, Debug, Clone)]
pub(crate) struct DefaultLimitArgs {
    /// Default requests per minute of new tenants (0 = unlimited).
    #[arg(long, env = "TESSERA_DEFAULT_RPM", default_value_t = NEW.requests_per_minute)]
    default_rpm: u32,
    /// Default input tokens per minute of new tenants.
    #[arg(long, env = "TESSERA_DEFAULT_INPUT_TPM", default_value_t = NEW.input_tokens_per_minute)]
    default_input_tpm: u32,
    /// Default output tokens per minute of new tenants.
    #[arg(long, env = "TESSERA_DEFAULT_OUTPUT_TPM", default_value_t = NEW.output_tokens_per_minute)]
    default_output_tpm: u32,
    /// Default concurrent requests of new tenants.
    #[arg(long, env = "TESSERA_DEFAULT_MAX_CONCURRENT", default_value_t = NEW.max_concurrent)]
    default_max_concurrent: u32,
    /// Default tokens per UTC day of new tenants.
    #[arg(long, env = "TESSERA_DEFAULT_DAILY_TOKENS", default_value_t = NEW.daily_tokens)]
    default_daily_tokens: u64,
}

impl DefaultLimitArgs {
    pub(crate) fn limits(&self) -> Limits {
        Limits {
            requests_per_minute: self.default_rpm,
            input_tokens_per_minute: self.default_input_tpm,
            output_tokens_per_minute: self.default_output_tpm,
            max_concurrent: self.default_max_concurrent,
            daily_tokens: self.default_daily_tokens,
        }
    }
}

/// The process's real user id (`/proc/self/status`), or `unknown`.
fn current_uid() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("Uid:"))
                .and_then(|v| v.split_whitespace().next().map(str::to_string))
        })
        .unwrap_or_else(|| "unknown".into())
}

/// Who the CLI acts as in the audit log: `cli:<user>` (`cli:uid-<n>` without
/// `$USER` or `$LOGNAME`), one request id per run.
pub(crate) fn cli_actor() -> AuditCtx {
    // Without $USER or $LOGNAME (a container, a cron job) the numeric uid still
    // tells operators apart.
    let user = std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .unwrap_or_else(|_| format!("uid-{}", current_uid()));
    AuditCtx {
        request_id: tessera_tenancy::random_hex(16),
        source: format!("cli:{user}"),
    }
}

/// `tessera tenant ...`.
#[derive(Subcommand, Debug)]
pub(crate) enum TenantCommand {
    /// Create a tenant (prints its account id; --with-key also makes a key).
    Create {
        /// Display name.
        #[arg(long)]
        name: String,
        #[command(flatten)]
        limits: LimitArgs,
        #[command(flatten)]
        defaults: DefaultLimitArgs,
        /// Also create an API key.
        #[arg(long)]
        with_key: bool,
    },
    /// List tenants.
    List,
    /// Suspend a tenant: its requests get 403 from the next one on.
    Suspend {
        /// Account id.
        id: String,
    },
    /// Re-activate a suspended tenant.
    Activate {
        /// Account id.
        id: String,
    },
    /// Change a tenant's limits (flags not given keep their value).
    Limits {
        /// Account id.
        id: String,
        #[command(flatten)]
        limits: LimitArgs,
    },
    /// Change how the engines schedule a tenant (flags not given keep their value).
    Scheduling {
        /// Account id.
        id: String,
        /// Fair-share weight, 1..=1000: served tokens in proportion to it.
        #[arg(long)]
        weight: Option<u32>,
        /// Highest class its requests may run in: `interactive` or `batch`.
        #[arg(long)]
        max_priority: Option<PriorityCeiling>,
    },
    /// Set a tenant's own bounds on the KV engines keep cached of it (flags not
    /// given keep their value; 0: no bound of its own). Applied by each engine from
    /// the tenant's next request on.
    CacheLimits {
        /// Account id.
        id: String,
        /// Most prompt tokens (whole pages) each engine keeps in its pool for the
        /// tenant; past it its least recently used pages are dropped.
        #[arg(long)]
        max_cached_tokens: Option<u64>,
        /// Seconds a cached page may go unused before engines drop it (every tier;
        /// at most 30 days).
        #[arg(long)]
        idle_ttl_secs: Option<u64>,
    },
    /// Give a tenant a fresh prefix-cache salt: nothing it cached before is found
    /// again.
    RotateCacheSalt {
        /// Account id.
        id: String,
    },
    /// Drop every prefix-cache page of a tenant on every engine of a running
    /// gateway (`POST /admin/v1/tenants/{id}/purge-cache` on its admin API, which
    /// answers once each engine confirmed). Prints the pages freed per model, and
    /// those still read by a running request (freed when it ends). Audited.
    PurgeCache {
        /// Account id.
        id: String,
        #[command(flatten)]
        gateway: crate::reload::AdminCallArgs,
    },
}

/// `tessera key ...`.
#[derive(Subcommand, Debug)]
pub(crate) enum KeyCommand {
    /// Create an API key (the secret is printed once).
    Create {
        /// Account id of the owner.
        #[arg(long)]
        tenant: String,
        /// Label.
        #[arg(long, default_value = "default")]
        name: String,
        /// Scope (repeatable): `inference`, `usage:read`, `keys:write` (key
        /// management on the dashboard), `finetunes:write` (uploading and deleting
        /// LoRA fine-tunes); default `inference` and `usage:read`.
        #[arg(long = "scope")]
        scopes: Vec<String>,
        /// Expiry time (Unix seconds, YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ).
        #[arg(long, conflicts_with = "expires_in_days")]
        expires: Option<String>,
        /// Expiry, in days from now.
        #[arg(long)]
        expires_in_days: Option<u64>,
    },
    /// List keys (never their secrets).
    List {
        /// Only this tenant's keys.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Revoke a key by its id (the middle part of `tsk_<key_id>_<secret>`, as
    /// `tessera key list` shows it); effective on the next request.
    Revoke {
        /// Key id.
        key_id: String,
    },
}

/// `tessera audit`.
#[derive(Args, Debug)]
pub(crate) struct AuditArgs {
    /// Start (Unix seconds, YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ); default: the beginning.
    #[arg(long)]
    since: Option<String>,
    /// End (exclusive); default: now.
    #[arg(long)]
    until: Option<String>,
    /// Most rows, oldest first.
    #[arg(long, default_value_t = 1000)]
    limit: u32,
}

fn time_arg(v: &Option<String>, default: i64) -> Result<i64> {
    match v {
        None => Ok(default),
        Some(s) => parse_time(s).ok_or_else(|| anyhow::anyhow!("bad time `{s}`")),
    }
}

/// `tessera usage`.
#[derive(Args, Debug)]
pub(crate) struct UsageArgs {
    /// Account id.
    #[arg(long)]
    tenant: String,
    /// Start (Unix seconds, YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ); default: the beginning.
    #[arg(long)]
    since: Option<String>,
    /// End (exclusive); default: now.
    #[arg(long)]
    until: Option<String>,
    /// model, key, hour or day.
    #[arg(long, default_value = "model")]
    group_by: String,
}

pub(crate) fn rt() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// `tessera tenant purge-cache ID`: the gateway's admin API drops the tenant's
/// cached pages on every engine; prints its answer, or fails with its reason.
/// Without a token flag, the token file is `default_token` (the data dir's).
fn purge_cache(
    id: &str,
    gateway: &crate::reload::AdminCallArgs,
    default_token: &std::path::Path,
) -> Result<()> {
    if id.is_empty()
        || !id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        bail!("not an account id: {id:?}");
    }
    let path = format!("/admin/v1/tenants/{id}/purge-cache");
    let (status, v, body) = crate::reload::admin_post(gateway, &path, default_token)?;
    if (200..300).contains(&status) {
        return print(v["result"].clone());
    }
    let reason = v["errors"][0]["message"]
        .as_str()
        .map(str::to_string)
        .unwrap_or(body);
    bail!("the gateway refused the cache purge ({status}): {reason}")
}

pub(crate) fn print(v: serde_json::Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

pub(crate) fn tenant(store: StoreArgs, cmd: TenantCommand) -> Result<()> {
    if let TenantCommand::PurgeCache { id, gateway } = &cmd {
        return purge_cache(id, gateway, &store.data_dir.join("admin-token"));
    }
    rt()?.block_on(async {
        let s = store.open().await?;
        let by = cli_actor();
        let admin = s.audited(&by);
        match cmd {
            TenantCommand::Create {
                name,
                limits,
                defaults,
                with_key,
            } => {
                let t = admin
                    .create_tenant(&name, limits.patch().apply(defaults.limits()))
                    .await?;
                let mut out = json!({"tenant": t});
                if with_key {
                    let (info, secret) = admin.create_key(&t.id, &NewKey::named("default")).await?;
                    out["key"] = json!({"info": info, "secret": secret});
                }
                print(out)
            }
            TenantCommand::List => print(json!(s.list_tenants().await?)),
            TenantCommand::Suspend { id } => {
                admin.set_status(&id, TenantStatus::Suspended).await?;
                print(json!({"id": id, "status": "suspended"}))
            }
            TenantCommand::Activate { id } => {
                admin.set_status(&id, TenantStatus::Active).await?;
                print(json!({"id": id, "status": "active"}))
            }
            TenantCommand::Limits { id, limits } => {
                let Some(t) = s.tenant(&id).await? else {
                    bail!("no tenant with id {id}");
                };
                let l = limits.patch().apply(t.limits);
                admin.set_limits(&id, l).await?;
                print(json!({"id": id, "limits": l}))
            }
            TenantCommand::Scheduling {
                id,
                weight,
                max_priority,
            } => {
                let Some(t) = s.tenant(&id).await? else {
                    bail!("no tenant with id {id}");
                };
                let sch = Scheduling {
                    weight: weight.unwrap_or(t.scheduling.weight),
                    max_priority: max_priority.unwrap_or(t.scheduling.max_priority),
                };
                admin.set_scheduling(&id, sch).await?;
                print(json!({"id": id, "scheduling": sch}))
            }
            TenantCommand::CacheLimits {
                id,
                max_cached_tokens,
                idle_ttl_secs,
            } => {
                let Some(t) = s.tenant(&id).await? else {
                    bail!("no tenant with id {id}");
                };
                let c = CacheLimits {
                    max_cached_tokens: max_cached_tokens
                        .unwrap_or(t.cache_limits.max_cached_tokens),
                    idle_ttl_secs: idle_ttl_secs.unwrap_or(t.cache_limits.idle_ttl_secs),
                    set_ms: 0,
                };
                admin.set_cache_limits(&id, c).await?;
                print(json!({"id": id, "cache_limits": c}))
            }
            TenantCommand::RotateCacheSalt { id } => {
                admin.rotate_cache_salt(&id).await?;
                print(json!({"id": id, "cache_salt": "rotated"}))
            }
            TenantCommand::PurgeCache { .. } => {
                bail!("purge-cache asks the gateway, not the store")
            }
        }
    })
}

pub(crate) fn key(store: StoreArgs, cmd: KeyCommand) -> Result<()> {
    rt()?.block_on(async {
        let s = store.open().await?;
        let by = cli_actor();
        let admin = s.audited(&by);
        match cmd {
            KeyCommand::Create {
                tenant,
                name,
                scopes,
                expires,
                expires_in_days,
            } => {
                let scopes = if scopes.is_empty() {
                    Scopes::DEFAULT
                } else {
                    Scopes::from_names(scopes.iter().map(String::as_str))
                        .map_err(anyhow::Error::msg)?
                };
                let now = tessera_tenancy::now_ms();
                let expires_ms = match (expires, expires_in_days) {
                    (Some(t), _) => Some(time_arg(&Some(t), 0)?),
                    (None, Some(d)) => {
                        Some(now.saturating_add(d.saturating_mul(86_400_000) as i64))
                    }
                    (None, None) => None,
                };
                if expires_ms.is_some_and(|e| e <= now) {
                    bail!("--expires must lie in the future");
                }
                let key = NewKey {
                    name,
                    scopes,
                    expires_ms,
                };
                let (info, secret) = admin.create_key(&tenant, &key).await?;
                print(json!({"info": info, "secret": secret}))
            }
            KeyCommand::List { tenant } => print(json!(s.list_keys(tenant.as_deref()).await?)),
            KeyCommand::Revoke { key_id } => {
                if !admin.revoke_key(&key_id).await? {
                    bail!("no active key with id {key_id}");
                }
                print(json!({"key_id": key_id, "revoked": true}))
            }
        }
    })
}

pub(crate) fn audit(store: StoreArgs, a: AuditArgs) -> Result<()> {
    let since = time_arg(&a.since, 0)?;
    let until = time_arg(&a.until, tessera_tenancy::now_ms() + 1)?;
    rt()?.block_on(async {
        let s = store.open().await?;
        print(json!(s.audit_rows(since, until, a.limit).await?))
    })
}

pub(crate) fn usage(store: StoreArgs, a: UsageArgs) -> Result<()> {
    let since = time_arg(&a.since, 0)?;
    let until = time_arg(&a.until, tessera_tenancy::now_ms() + 1)?;
    let g: GroupBy = a.group_by.parse().map_err(anyhow::Error::msg)?;
    rt()?.block_on(async {
        let s = store.open().await?;
        let groups = s.usage_summary(&a.tenant, since, until, g).await?;
        print(json!({
            "account_id": a.tenant,
            "since": rfc3339(since),
            "until": rfc3339(until),
            "group_by": a.group_by,
            "groups": groups,
        }))
    })
}

/// Arguments of `tessera model access`.
#[derive(Args, Debug)]
pub(crate) struct ModelAccessArgs {
    /// The model's catalog id (its `id` in the deployment file or `--model ID=...`;
    /// not an alias).
    model: String,
    /// Every tenant may use the model (the default for a model never set).
    #[arg(long, conflicts_with_all = ["private", "tenant"])]
    public: bool,
    /// Only the tenants given with --tenant may use the model.
    #[arg(long)]
    private: bool,
    /// A tenant (account id) that may use the private model; repeatable.
    #[arg(long, requires = "private")]
    tenant: Vec<String>,
}

/// `tessera model access MODEL [--public | --private --tenant ID...]`: shows who
/// may use a model, or sets it (audited, source `cli:USER`); prints the access as
/// JSON (`model`, `private`, `tenants`).
pub(crate) fn model_access(store: StoreArgs, a: ModelAccessArgs) -> Result<()> {
    rt()?.block_on(async {
        let s = store.open().await?;
        let access = if a.public || a.private {
            let by = cli_actor();
            s.audited(&by)
                .set_model_access(&a.model, a.private, &a.tenant)
                .await?
        } else {
            s.model_access(&a.model).await?
        };
        print(json!(access))
    })
}
