//! API key queries: create, list, revoke, check and authenticate.

use super::audit::audit_in;
use super::rows::{get_str, key_from_row, scopes_of, tenant_from_row, TENANT_COLS};
use super::types::{AuditCtx, AuthError, KeyInfo, NewKey, Principal, StoreError, TenantStatus};
use super::Store;
use crate::keys::ApiKey;
use crate::now_ms;
use serde_json::json;
use sqlx::Row;

impl Store {
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

    pub(super) async fn create_key_as(
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

    pub(super) async fn revoke_key_as(
        &self,
        by: Option<&AuditCtx>,
        key_id: &str,
    ) -> Result<bool, StoreError> {
        let update = sqlx::query(
            "UPDATE api_keys SET revoked_ms = $1 WHERE key_id = $2 AND revoked_ms IS NULL",
        )
        .bind(now_ms())
        .bind(key_id);
        self.update_audited(by, update, "key.revoke", key_id, json!({}))
            .await
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
}
