//! The admin audit log: the audit row written inside each admin change's
//! transaction, the audited write shared by the single-row updates, [`Audited`]
//! and reading the log back.

use super::rows::{get_i64, get_str};
use super::types::{
    AuditCtx, AuditRecord, CacheLimits, KeyInfo, Limits, ModelAccess, NewKey, Scheduling,
    StoreError, Tenant, TenantStatus,
};
use super::Store;
use sqlx::any::AnyRow;
use sqlx::AnyConnection;

/// A statement with its arguments bound, ready to run in a transaction.
pub(super) type Update<'q> = sqlx::query::Query<'q, sqlx::Any, sqlx::any::AnyArguments<'q>>;

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
pub(super) async fn audit_in(
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
    pub(super) store: &'a Store,
    pub(super) by: &'a AuditCtx,
}

impl Audited<'_> {
    /// [`Store::create_tenant`], audited as `tenant.create`.
    pub async fn create_tenant(&self, name: &str, limits: Limits) -> Result<Tenant, StoreError> {
        self.store
            .create_tenant_as(Some(self.by), name, limits)
            .await
    }

    /// Writes one audit row for an action that changes nothing in the store (a
    /// tenant's cache purge on the engines): `action` on `target`, with `detail`.
    ///
    /// Errors: [`StoreError`] from the database.
    pub async fn record(
        &self,
        action: &str,
        target: &str,
        detail: serde_json::Value,
    ) -> Result<(), StoreError> {
        let mut tx = self.store.write_tx().await?;
        audit_in(&mut tx, Some(self.by), action, target, detail).await?;
        tx.commit().await?;
        Ok(())
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

    /// [`Store::set_cache_limits`], audited as `tenant.cache_limits`.
    pub async fn set_cache_limits(&self, id: &str, c: CacheLimits) -> Result<(), StoreError> {
        self.store.set_cache_limits_as(Some(self.by), id, c).await
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

impl Store {
    /// The admin operations, audited as done `by` (one audit row per change, in
    /// the change's transaction). The unaudited methods below are for tests and
    /// tools that are not admin actions.
    pub fn audited<'a>(&'a self, by: &'a AuditCtx) -> Audited<'a> {
        Audited { store: self, by }
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

    /// The newest `limit` audit rows, newest first (the operator view).
    pub async fn audit_latest(&self, limit: u32) -> Result<Vec<AuditRecord>, StoreError> {
        let rows = sqlx::query(
            "SELECT id, at_ms, action, target, request_id, source, detail FROM admin_audit \
             ORDER BY id DESC LIMIT $1",
        )
        .bind(i64::from(limit))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(audit_from_row).collect()
    }

    /// The audited write of one UPDATE (or other single statement), shared by the
    /// `*_as` writes that change one row: in one write transaction, runs `update`;
    /// when it changed no row, returns `Ok(false)` and writes nothing (no audit
    /// row); otherwise appends the audit row of `action` on `target` with `detail`
    /// (when `by` is given), commits, and returns `Ok(true)`.
    pub(super) async fn update_audited(
        &self,
        by: Option<&AuditCtx>,
        update: Update<'_>,
        action: &str,
        target: &str,
        detail: serde_json::Value,
    ) -> Result<bool, StoreError> {
        let mut tx = self.write_tx().await?;
        if update.execute(&mut *tx).await?.rows_affected() == 0 {
            return Ok(false);
        }
        audit_in(&mut tx, by, action, target, detail).await?;
        tx.commit().await?;
        Ok(true)
    }
}
