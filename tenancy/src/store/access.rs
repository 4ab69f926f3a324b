//! Model access queries: who may use which model.

use super::audit::audit_in;
use super::rows::get_str;
use super::types::{AuditCtx, ModelAccess, StoreError};
use super::Store;
use crate::now_ms;
use serde_json::json;

impl Store {
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

    pub(super) async fn set_model_access_as(
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
}
