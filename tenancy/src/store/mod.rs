//! [`Store`]: the tenancy database over sqlx's `Any` driver, so one set of SQL
//! statements and migrations serves SQLite (`sqlite://path`, the embedded default)
//! and PostgreSQL (`postgres://...`). Placeholders are `$1, $2, ...` (both accept them).
//!
//! One module per concept: `types` (the records and errors the store hands out),
//! `dates` (UTC date and time text), `rows` (row mapping shared by the queries),
//! `audit` (the audit log, [`Audited`] and the one audited-write helper), and the
//! queries by table group: `tenants`, `keys`, `access` (model access), `usage`,
//! `sessions` (dashboard sign-ins), `finetunes` (LoRA adapters).

mod access;
mod audit;
mod dates;
mod finetunes;
mod keys;
mod rows;
mod sessions;
mod tenants;
mod types;
mod usage;

pub use audit::Audited;
pub use dates::{days_from_civil, parse_time, rfc3339};
pub use finetunes::{valid_finetune_name, Finetune, NewFinetune, MAX_FINETUNES_PER_TENANT};
pub use sessions::DashSession;
pub use types::{
    AuditCtx, AuditRecord, AuthError, CacheLimits, GroupBy, KeyInfo, Limits, LimitsPatch,
    ModelAccess, NewKey, Principal, PriorityCeiling, Scheduling, StoreError, Tenant, TenantStatus,
    UsageGroup, UsageRecord,
};

use crate::now_ms;
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::AnyPool;

/// Migrations, in order; each runs once, inside a transaction.
const MIGRATIONS: &[(i64, &str, &str)] = &[
    (1, "init", include_str!("../../migrations/0001_init.sql")),
    (
        2,
        "scopes_audit_retention",
        include_str!("../../migrations/0002_scopes_audit_retention.sql"),
    ),
    (
        3,
        "scheduling_cache",
        include_str!("../../migrations/0003_scheduling_cache.sql"),
    ),
    (
        4,
        "model_access",
        include_str!("../../migrations/0004_model_access.sql"),
    ),
    (
        5,
        "cache_limits",
        include_str!("../../migrations/0005_cache_limits.sql"),
    ),
    (
        6,
        "cached_tiers",
        include_str!("../../migrations/0006_cached_tiers.sql"),
    ),
    (
        7,
        "dashboard",
        include_str!("../../migrations/0007_dashboard.sql"),
    ),
    (
        8,
        "finetunes",
        include_str!("../../migrations/0008_finetunes.sql"),
    ),
];

/// The tenancy database. Cheap to clone (a pool handle).
#[derive(Clone, Debug)]
pub struct Store {
    pool: AnyPool,
    backend: &'static str,
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
}
