//! Dashboard sessions (`dash_sessions`): what a signed-in browser's cookie stands
//! for. Only the cookie's SHA-256 is stored, so a copy of the database opens no
//! session.

use super::rows::{get_i64, get_str};
use super::types::StoreError;
use super::Store;
use crate::{hex, now_ms, random_hex};
use sha2::{Digest, Sha256};

/// A signed-in dashboard session.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DashSession {
    /// The tenant, or `""` for an operator session (signed in with the admin token).
    pub tenant_id: String,
    /// The key it signed in with; the dashboard checks it is still valid on every
    /// page. For an operator session, `admin:` and a digest of the admin token it
    /// signed in with (see [`DashSession::operator_id`]), checked against the
    /// current token on every page.
    pub key_id: String,
    /// The token every form of the session carries (CSRF), 64 hex chars.
    pub csrf: String,
    /// When it ends (Unix ms).
    pub expires_ms: i64,
}

impl DashSession {
    /// Whether the session is an operator's.
    pub fn is_operator(&self) -> bool {
        self.tenant_id.is_empty() && self.key_id.starts_with("admin:")
    }

    /// The `key_id` of an operator session signed in with `admin_token`: `admin:`
    /// and 32 hex chars of a SHA-256 of the token (a rotated token ends the
    /// sessions of the old one; the token itself is not stored).
    pub fn operator_id(admin_token: &str) -> String {
        let d = Sha256::digest(format!("tessera-dash-admin-v1:{admin_token}").as_bytes());
        format!("admin:{}", &hex(&d)[..32])
    }
}

fn digest(cookie: &str) -> String {
    hex(&Sha256::digest(
        format!("tessera-dash-v1:{cookie}").as_bytes(),
    ))
}

impl Store {
    /// Starts a session for `key_id` of `tenant_id` (an operator: `""` and
    /// [`DashSession::operator_id`]) lasting
    /// `ttl_ms`; returns the cookie value (64 hex chars, shown to the browser only)
    /// and the session. Sessions that ended are deleted on the way.
    pub async fn create_dash_session(
        &self,
        tenant_id: &str,
        key_id: &str,
        ttl_ms: i64,
    ) -> Result<(String, DashSession), StoreError> {
        let now = now_ms();
        sqlx::query("DELETE FROM dash_sessions WHERE expires_ms <= $1")
            .bind(now)
            .execute(&self.pool)
            .await?;
        let cookie = random_hex(32);
        let session = DashSession {
            tenant_id: tenant_id.into(),
            key_id: key_id.into(),
            csrf: random_hex(32),
            expires_ms: now.saturating_add(ttl_ms),
        };
        sqlx::query(
            "INSERT INTO dash_sessions (id_sha256, tenant_id, key_id, csrf, created_ms, expires_ms) \
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(digest(&cookie))
        .bind(&session.tenant_id)
        .bind(&session.key_id)
        .bind(&session.csrf)
        .bind(now)
        .bind(session.expires_ms)
        .execute(&self.pool)
        .await?;
        Ok((cookie, session))
    }

    /// The live session of a cookie, or `None` (unknown, ended, or malformed).
    pub async fn dash_session(&self, cookie: &str) -> Result<Option<DashSession>, StoreError> {
        if cookie.len() != 64 || !cookie.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Ok(None);
        }
        let row = sqlx::query(
            "SELECT tenant_id, key_id, csrf, expires_ms FROM dash_sessions \
             WHERE id_sha256 = $1 AND expires_ms > $2",
        )
        .bind(digest(cookie))
        .bind(now_ms())
        .fetch_optional(&self.pool)
        .await?;
        row.map(|r| {
            Ok(DashSession {
                tenant_id: get_str(&r, "tenant_id")?,
                key_id: get_str(&r, "key_id")?,
                csrf: get_str(&r, "csrf")?,
                expires_ms: get_i64(&r, "expires_ms")?,
            })
        })
        .transpose()
    }

    /// Ends a cookie's session; returns whether there was one.
    pub async fn end_dash_session(&self, cookie: &str) -> Result<bool, StoreError> {
        let r = sqlx::query("DELETE FROM dash_sessions WHERE id_sha256 = $1")
            .bind(digest(cookie))
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected() > 0)
    }

    /// Ends every session signed in with `key_id` (its key was revoked); returns how
    /// many.
    pub async fn end_key_dash_sessions(&self, key_id: &str) -> Result<u64, StoreError> {
        let r = sqlx::query("DELETE FROM dash_sessions WHERE key_id = $1 AND tenant_id <> ''")
            .bind(key_id)
            .execute(&self.pool)
            .await?;
        Ok(r.rows_affected())
    }
}
