//! Tenants' LoRA fine-tunes (`finetunes`, `finetune_blobs`): what each adapter is,
//! whose it is, and its file. A tenant reaches its own fine-tunes by id or name and
//! public ones by id; anything else does not exist for it (the same `None` as an
//! unknown id), so ids and names of other tenants cannot be probed.

use super::audit::audit_in;
use super::rows::{get_i64, get_str};
use super::types::{AuditCtx, StoreError};
use super::{Audited, Store};
use crate::{now_ms, random_uuid};
use serde_json::json;
use sqlx::any::AnyRow;
use sqlx::Row;

/// Most fine-tunes one tenant may hold.
pub const MAX_FINETUNES_PER_TENANT: i64 = 100;
/// Longest name, in bytes.
const MAX_NAME_BYTES: usize = 64;
/// Longest description, in bytes.
const MAX_DESCRIPTION_BYTES: usize = 1024;

/// One stored fine-tune (without its file: [`Store::finetune_data`]).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Finetune {
    /// Random UUID-shaped id.
    pub id: String,
    /// The owning tenant.
    pub tenant_id: String,
    /// Unique per tenant: 1-64 bytes of `A-Z a-z 0-9 . _ -`, not starting with `.`.
    pub name: String,
    /// The catalog id of the base model it was checked against.
    pub base_model: String,
    /// Free text, at most 1024 bytes.
    pub description: String,
    /// Whether every tenant may run it (an operator's choice).
    pub public: bool,
    /// SHA-256 of the adapter file, lowercase hex.
    pub sha256: String,
    /// The file's size.
    pub size_bytes: u64,
    /// The adapter's largest rank.
    pub rank: u32,
    /// `adapter.lora.alpha` (0: scale 1).
    pub alpha: f64,
    /// How many base weights it adapts.
    pub targets: u32,
    /// Upload time, Unix ms.
    pub created_ms: i64,
}

impl Finetune {
    /// The fine-tune as the API (`GET .../ai/finetunes`) and the CLI show it:
    /// `id`, `name`, `description`, `model` (the base), `public`, `created_at`
    /// (RFC 3339), `sha256`, `size_bytes`, `rank`, `alpha`, `targets`, and, for its
    /// owner (`own`), `account_id`.
    pub fn api_json(&self, own: bool) -> serde_json::Value {
        let mut v = json!({
            "id": self.id,
            "name": self.name,
            "description": self.description,
            "model": self.base_model,
            "public": self.public,
            "created_at": super::rfc3339(self.created_ms),
            "sha256": self.sha256,
            "size_bytes": self.size_bytes,
            "rank": self.rank,
            "alpha": self.alpha,
            "targets": self.targets,
        });
        if own {
            v["account_id"] = json!(self.tenant_id);
        }
        v
    }
}

/// A fine-tune to store: its description (checked by the caller against its base
/// model) and its file.
#[derive(Clone, Debug)]
pub struct NewFinetune<'a> {
    /// The owning tenant.
    pub tenant_id: &'a str,
    /// See [`Finetune::name`].
    pub name: &'a str,
    /// See [`Finetune::base_model`].
    pub base_model: &'a str,
    /// See [`Finetune::description`].
    pub description: &'a str,
    /// See [`Finetune::rank`].
    pub rank: u32,
    /// See [`Finetune::alpha`].
    pub alpha: f64,
    /// See [`Finetune::targets`].
    pub targets: u32,
    /// The adapter file.
    pub data: &'a [u8],
}

const COLS: &str = "id, tenant_id, name, base_model, description, visibility, sha256, \
                    size_bytes, lora_rank, alpha, targets, created_ms";

fn from_row(r: &AnyRow) -> Result<Finetune, StoreError> {
    Ok(Finetune {
        id: get_str(r, "id")?,
        tenant_id: get_str(r, "tenant_id")?,
        name: get_str(r, "name")?,
        base_model: get_str(r, "base_model")?,
        description: get_str(r, "description")?,
        public: get_str(r, "visibility")? == "public",
        sha256: get_str(r, "sha256")?,
        size_bytes: get_i64(r, "size_bytes")?.max(0) as u64,
        rank: get_i64(r, "lora_rank")?.clamp(0, i64::from(u32::MAX)) as u32,
        alpha: r.try_get::<f64, _>("alpha")?,
        targets: get_i64(r, "targets")?.clamp(0, i64::from(u32::MAX)) as u32,
        created_ms: get_i64(r, "created_ms")?,
    })
}

/// Whether `name` is a valid fine-tune name (see [`Finetune::name`]): also not
/// `public` (a route of its own) and not shaped like an id (`8-4-4-4-12` hex), so
/// a name never shadows an id.
pub fn valid_finetune_name(name: &str) -> bool {
    let id_shaped = name.len() == 36
        && name.split('-').map(str::len).eq([8, 4, 4, 4, 12])
        && name.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-');
    !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && !name.starts_with('.')
        && name != "public"
        && !id_shaped
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

impl Store {
    /// Stores `f` and its file as a new fine-tune of its tenant (not audited; see
    /// [`Store::audited`]).
    ///
    /// Errors: [`StoreError::Invalid`] for a bad name or description;
    /// [`StoreError::NoTenant`]; [`StoreError::Conflict`] when the tenant already
    /// has a fine-tune of that name or [`MAX_FINETUNES_PER_TENANT`] of them.
    pub async fn create_finetune(&self, f: &NewFinetune<'_>) -> Result<Finetune, StoreError> {
        self.create_finetune_as(None, f).await
    }

    pub(super) async fn create_finetune_as(
        &self,
        by: Option<&AuditCtx>,
        f: &NewFinetune<'_>,
    ) -> Result<Finetune, StoreError> {
        use sha2::{Digest, Sha256};
        if !valid_finetune_name(f.name) {
            return Err(StoreError::Invalid(format!(
                "name must be 1 to {MAX_NAME_BYTES} characters of A-Z, a-z, 0-9, '.', '_' \
                 and '-', not starting with '.', not `public` and not shaped like an id. \
                 Given: {:?}",
                f.name.chars().take(80).collect::<String>()
            )));
        }
        if f.description.len() > MAX_DESCRIPTION_BYTES {
            return Err(StoreError::Invalid(format!(
                "description must be at most {MAX_DESCRIPTION_BYTES} bytes. Given: {} bytes",
                f.description.len()
            )));
        }
        let ft = Finetune {
            id: random_uuid(),
            tenant_id: f.tenant_id.into(),
            name: f.name.into(),
            base_model: f.base_model.into(),
            description: f.description.into(),
            public: false,
            sha256: crate::hex(&Sha256::digest(f.data)),
            size_bytes: f.data.len() as u64,
            rank: f.rank,
            alpha: f.alpha,
            targets: f.targets,
            created_ms: now_ms(),
        };
        let mut tx = self.write_tx().await?;
        let tenant = sqlx::query("SELECT id FROM tenants WHERE id = $1")
            .bind(f.tenant_id)
            .fetch_optional(&mut *tx)
            .await?;
        if tenant.is_none() {
            return Err(StoreError::NoTenant(f.tenant_id.into()));
        }
        let rows = sqlx::query(
            "SELECT COUNT(*) AS n, SUM(CASE WHEN name = $2 THEN 1 ELSE 0 END) AS same \
             FROM finetunes WHERE tenant_id = $1",
        )
        .bind(f.tenant_id)
        .bind(f.name)
        .fetch_one(&mut *tx)
        .await?;
        let same = rows.try_get::<Option<i64>, _>("same")?.unwrap_or(0);
        if same > 0 {
            return Err(StoreError::Conflict(format!(
                "this account already has a fine-tune named {:?}",
                f.name
            )));
        }
        if get_i64(&rows, "n")? >= MAX_FINETUNES_PER_TENANT {
            return Err(StoreError::Conflict(format!(
                "this account already has {MAX_FINETUNES_PER_TENANT} fine-tunes; delete one first"
            )));
        }
        sqlx::query(&format!(
            "INSERT INTO finetunes ({COLS}) VALUES ($1, $2, $3, $4, $5, 'private', $6, $7, $8, $9, $10, $11)"
        ))
        .bind(&ft.id)
        .bind(&ft.tenant_id)
        .bind(&ft.name)
        .bind(&ft.base_model)
        .bind(&ft.description)
        .bind(&ft.sha256)
        .bind(ft.size_bytes as i64)
        .bind(i64::from(ft.rank))
        .bind(ft.alpha)
        .bind(i64::from(ft.targets))
        .bind(ft.created_ms)
        .execute(&mut *tx)
        .await
        .map_err(|e| match &e {
            // A concurrent upload of the same name won the race.
            sqlx::Error::Database(d) if d.is_unique_violation() => StoreError::Conflict(
                format!("this account already has a fine-tune named {:?}", f.name),
            ),
            _ => StoreError::from(e),
        })?;
        sqlx::query("INSERT INTO finetune_blobs (finetune_id, data) VALUES ($1, $2)")
            .bind(&ft.id)
            .bind(f.data)
            .execute(&mut *tx)
            .await?;
        let detail = json!({
            "id": ft.id, "name": ft.name, "base_model": ft.base_model,
            "sha256": ft.sha256, "size_bytes": ft.size_bytes, "rank": ft.rank,
        });
        audit_in(&mut tx, by, "finetune.create", f.tenant_id, detail).await?;
        tx.commit().await?;
        Ok(ft)
    }

    /// `tenant_id`'s fine-tunes, oldest first.
    pub async fn finetunes_of(&self, tenant_id: &str) -> Result<Vec<Finetune>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLS} FROM finetunes WHERE tenant_id = $1 ORDER BY created_ms, id"
        ))
        .bind(tenant_id)
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(from_row).collect()
    }

    /// Every public fine-tune, oldest first.
    pub async fn public_finetunes(&self) -> Result<Vec<Finetune>, StoreError> {
        let rows = sqlx::query(&format!(
            "SELECT {COLS} FROM finetunes WHERE visibility = 'public' ORDER BY created_ms, id"
        ))
        .fetch_all(&self.pool)
        .await?;
        rows.iter().map(from_row).collect()
    }

    /// The fine-tune `tenant_id` names `id_or_name`: its own by id or name, else a
    /// public one by id; `None` for anything else (another tenant's, unknown).
    pub async fn finetune_for(
        &self,
        tenant_id: &str,
        id_or_name: &str,
    ) -> Result<Option<Finetune>, StoreError> {
        let row = sqlx::query(&format!(
            "SELECT {COLS} FROM finetunes WHERE (tenant_id = $1 AND (id = $2 OR name = $2)) \
             OR (visibility = 'public' AND id = $2) \
             ORDER BY CASE WHEN tenant_id = $1 THEN 0 ELSE 1 END LIMIT 1"
        ))
        .bind(tenant_id)
        .bind(id_or_name)
        .fetch_optional(&self.pool)
        .await?;
        row.as_ref().map(from_row).transpose()
    }

    /// The adapter file of fine-tune `id`.
    pub async fn finetune_data(&self, id: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let row = sqlx::query("SELECT data FROM finetune_blobs WHERE finetune_id = $1")
            .bind(id)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|r| r.try_get::<Vec<u8>, _>("data")).transpose()?)
    }

    /// Deletes `tenant_id`'s own fine-tune `id_or_name` and its file (not audited;
    /// see [`Store::audited`]). Returns it, or `None` when the tenant has no such
    /// fine-tune (a public one of another tenant is not its to delete).
    pub async fn delete_finetune(
        &self,
        tenant_id: &str,
        id_or_name: &str,
    ) -> Result<Option<Finetune>, StoreError> {
        self.delete_finetune_as(None, tenant_id, id_or_name).await
    }

    pub(super) async fn delete_finetune_as(
        &self,
        by: Option<&AuditCtx>,
        tenant_id: &str,
        id_or_name: &str,
    ) -> Result<Option<Finetune>, StoreError> {
        let mut tx = self.write_tx().await?;
        let row = sqlx::query(&format!(
            "SELECT {COLS} FROM finetunes WHERE tenant_id = $1 AND (id = $2 OR name = $2)"
        ))
        .bind(tenant_id)
        .bind(id_or_name)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(ft) = row.as_ref().map(from_row).transpose()? else {
            return Ok(None);
        };
        sqlx::query("DELETE FROM finetune_blobs WHERE finetune_id = $1")
            .bind(&ft.id)
            .execute(&mut *tx)
            .await?;
        sqlx::query("DELETE FROM finetunes WHERE id = $1")
            .bind(&ft.id)
            .execute(&mut *tx)
            .await?;
        let detail = json!({ "id": ft.id, "name": ft.name, "base_model": ft.base_model });
        audit_in(&mut tx, by, "finetune.delete", tenant_id, detail).await?;
        tx.commit().await?;
        Ok(Some(ft))
    }

    /// Makes fine-tune `id` public (every tenant may run it) or private again (not
    /// audited; see [`Store::audited`]). Returns whether it exists.
    pub async fn set_finetune_public(&self, id: &str, public: bool) -> Result<bool, StoreError> {
        self.set_finetune_public_as(None, id, public).await
    }

    pub(super) async fn set_finetune_public_as(
        &self,
        by: Option<&AuditCtx>,
        id: &str,
        public: bool,
    ) -> Result<bool, StoreError> {
        let mut tx = self.write_tx().await?;
        let done = sqlx::query("UPDATE finetunes SET visibility = $1 WHERE id = $2")
            .bind(if public { "public" } else { "private" })
            .bind(id)
            .execute(&mut *tx)
            .await?
            .rows_affected()
            > 0;
        if done {
            audit_in(
                &mut tx,
                by,
                "finetune.visibility",
                id,
                json!({ "public": public }),
            )
            .await?;
        }
        tx.commit().await?;
        Ok(done)
    }
}

impl Audited<'_> {
    /// [`Store::create_finetune`], audited as `finetune.create` (the file's hash,
    /// size and rank; not its contents).
    pub async fn create_finetune(&self, f: &NewFinetune<'_>) -> Result<Finetune, StoreError> {
        self.store.create_finetune_as(Some(self.by), f).await
    }

    /// [`Store::delete_finetune`], audited as `finetune.delete` (only when one was
    /// deleted).
    pub async fn delete_finetune(
        &self,
        tenant_id: &str,
        id_or_name: &str,
    ) -> Result<Option<Finetune>, StoreError> {
        self.store
            .delete_finetune_as(Some(self.by), tenant_id, id_or_name)
            .await
    }

    /// [`Store::set_finetune_public`], audited as `finetune.visibility`.
    pub async fn set_finetune_public(&self, id: &str, public: bool) -> Result<bool, StoreError> {
        self.store
            .set_finetune_public_as(Some(self.by), id, public)
            .await
    }
}

#[cfg(test)]
mod tests {
    use super::valid_finetune_name as valid;

    #[test]
    fn names_are_short_plain_and_not_hidden() {
        for ok in [
            "a",
            "my-adapter_v1.2",
            &"x".repeat(64),
            "publicity",
            "0123-4567",
        ] {
            assert!(valid(ok), "{ok}");
        }
        let id = "c9e0451e-65db-5080-e949-ac2a878263f5";
        for bad in [
            "",
            ".hidden",
            "a b",
            "a/b",
            "é",
            &"x".repeat(65),
            "a\u{0}",
            "public",
            id,
        ] {
            assert!(!valid(bad), "{bad:?}");
        }
    }
}
