//! Tenant queries: create, list, read, and the audited status, limits,
//! scheduling and cache-salt writes.

use super::audit::{audit_in, Update};
use super::rows::{tenant_from_row, TENANT_COLS};
use super::types::{AuditCtx, CacheLimits, Limits, Scheduling, StoreError, Tenant, TenantStatus};
use super::Store;
use crate::now_ms;
use serde_json::json;

impl Store {
    /// Creates an active tenant with a fresh account id (not audited; see
    /// [`Store::audited`]).
    pub async fn create_tenant(&self, name: &str, limits: Limits) -> Result<Tenant, StoreError> {
        self.create_tenant_as(None, name, limits).await
    }

    pub(super) async fn create_tenant_as(
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
            cache_limits: CacheLimits::default(),
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

    /// Sets a tenant's status (not audited; see [`Store::audited`]); effective on
    /// its next request, and a running gateway aborts the tenant's requests in
    /// flight when it sees a suspension.
    pub async fn set_status(&self, id: &str, status: TenantStatus) -> Result<(), StoreError> {
        self.set_status_as(None, id, status).await
    }

    pub(super) async fn set_status_as(
        &self,
        by: Option<&AuditCtx>,
        id: &str,
        status: TenantStatus,
    ) -> Result<(), StoreError> {
        let update = sqlx::query("UPDATE tenants SET status = $1 WHERE id = $2")
            .bind(status.as_str())
            .bind(id);
        let action = match status {
            TenantStatus::Active => "tenant.activate",
            TenantStatus::Suspended => "tenant.suspend",
        };
        self.update_tenant_audited(by, id, update, action, json!({"status": status}))
            .await
    }

    /// Replaces a tenant's limits (not audited; see [`Store::audited`]); effective
    /// on its next request.
    pub async fn set_limits(&self, id: &str, l: Limits) -> Result<(), StoreError> {
        self.set_limits_as(None, id, l).await
    }

    pub(super) async fn set_limits_as(
        &self,
        by: Option<&AuditCtx>,
        id: &str,
        l: Limits,
    ) -> Result<(), StoreError> {
        let update = sqlx::query(
            "UPDATE tenant_limits SET requests_per_minute = $1, input_tokens_per_minute = $2, \
             output_tokens_per_minute = $3, max_concurrent = $4, daily_tokens = $5 WHERE tenant_id = $6",
        )
        .bind(l.requests_per_minute as i64)
        .bind(l.input_tokens_per_minute as i64)
        .bind(l.output_tokens_per_minute as i64)
        .bind(l.max_concurrent as i64)
        .bind(l.daily_tokens as i64)
        .bind(id);
        self.update_tenant_audited(by, id, update, "tenant.limits", json!({"limits": l}))
            .await
    }

    /// Sets a tenant's weight and priority ceiling (not audited; see
    /// [`Store::audited`]); effective on its next request.
    ///
    /// Errors: [`StoreError::NoTenant`]; [`StoreError::Invalid`] for a weight
    /// outside `1..=`[`Scheduling::MAX_WEIGHT`].
    pub async fn set_scheduling(&self, id: &str, s: Scheduling) -> Result<(), StoreError> {
        self.set_scheduling_as(None, id, s).await
    }

    pub(super) async fn set_scheduling_as(
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
        let update = sqlx::query("UPDATE tenants SET weight = $1, max_priority = $2 WHERE id = $3")
            .bind(i64::from(s.weight))
            .bind(s.max_priority.as_str())
            .bind(id);
        let detail = json!({"scheduling": s});
        self.update_tenant_audited(by, id, update, "tenant.scheduling", detail)
            .await
    }

    /// Sets a tenant's own bounds on its cached KV (not audited; see
    /// [`Store::audited`]); engines apply them from its next request on.
    ///
    /// Errors: [`StoreError::NoTenant`]; [`StoreError::Invalid`] for a value over
    /// its maximum ([`CacheLimits::MAX_VALUE`], [`CacheLimits::MAX_IDLE_TTL_SECS`]).
    pub async fn set_cache_limits(&self, id: &str, c: CacheLimits) -> Result<(), StoreError> {
        self.set_cache_limits_as(None, id, c).await
    }

    pub(super) async fn set_cache_limits_as(
        &self,
        by: Option<&AuditCtx>,
        id: &str,
        c: CacheLimits,
    ) -> Result<(), StoreError> {
        if c.max_cached_tokens > CacheLimits::MAX_VALUE {
            return Err(StoreError::Invalid(format!(
                "`max_cached_tokens` must be at most {}. Given: {}",
                CacheLimits::MAX_VALUE,
                c.max_cached_tokens
            )));
        }
        if c.idle_ttl_secs > CacheLimits::MAX_IDLE_TTL_SECS {
            return Err(StoreError::Invalid(format!(
                "`idle_ttl_secs` must be at most {}. Given: {}",
                CacheLimits::MAX_IDLE_TTL_SECS,
                c.idle_ttl_secs
            )));
        }
        let update = sqlx::query(
            "UPDATE tenants SET cache_max_tokens = $1, cache_idle_ttl_secs = $2, \
             cache_limits_ms = $3 WHERE id = $4",
        )
        .bind(c.max_cached_tokens as i64)
        .bind(c.idle_ttl_secs as i64)
        .bind(now_ms())
        .bind(id);
        let detail = json!({"cache_limits": c});
        self.update_tenant_audited(by, id, update, "tenant.cache_limits", detail)
            .await
    }

    /// Gives the tenant a fresh random cache salt (not audited; see
    /// [`Store::audited`]): from its next request on, nothing it cached before is
    /// found again (the old pages age out of the engines' caches).
    pub async fn rotate_cache_salt(&self, id: &str) -> Result<(), StoreError> {
        self.rotate_cache_salt_as(None, id).await
    }

    pub(super) async fn rotate_cache_salt_as(
        &self,
        by: Option<&AuditCtx>,
        id: &str,
    ) -> Result<(), StoreError> {
        let update = sqlx::query("UPDATE tenants SET cache_salt = $1 WHERE id = $2")
            .bind(crate::random_hex(16))
            .bind(id);
        self.update_tenant_audited(by, id, update, "tenant.rotate_cache_salt", json!({}))
            .await
    }

    /// [`Store::update_audited`] of tenant `id`'s row: [`StoreError::NoTenant`]
    /// (and nothing written) when the tenant does not exist.
    async fn update_tenant_audited(
        &self,
        by: Option<&AuditCtx>,
        id: &str,
        update: Update<'_>,
        action: &str,
        detail: serde_json::Value,
    ) -> Result<(), StoreError> {
        if self.update_audited(by, update, action, id, detail).await? {
            Ok(())
        } else {
            Err(StoreError::NoTenant(id.into()))
        }
    }
}
