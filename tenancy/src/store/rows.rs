//! Row mapping shared by the query modules.

use super::types::{CacheLimits, KeyInfo, Limits, Scheduling, StoreError, Tenant};
use crate::keys::Scopes;
use sqlx::any::AnyRow;
use sqlx::Row;

pub(super) fn get_i64(r: &AnyRow, c: &str) -> Result<i64, StoreError> {
    Ok(r.try_get::<i64, _>(c)?)
}

pub(super) fn get_str(r: &AnyRow, c: &str) -> Result<String, StoreError> {
    Ok(r.try_get::<String, _>(c)?)
}

pub(super) const TENANT_COLS: &str =
    "t.id, t.name, t.status, t.created_ms, t.weight, t.max_priority, \
     t.cache_salt, t.cache_max_tokens, t.cache_idle_ttl_secs, t.cache_limits_ms, \
     l.requests_per_minute, l.input_tokens_per_minute, l.output_tokens_per_minute, \
     l.max_concurrent, l.daily_tokens";

pub(super) fn tenant_from_row(r: &AnyRow) -> Result<Tenant, StoreError> {
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
        cache_limits: CacheLimits {
            max_cached_tokens: get_i64(r, "cache_max_tokens")?.max(0) as u64,
            idle_ttl_secs: get_i64(r, "cache_idle_ttl_secs")?.max(0) as u64,
            set_ms: get_i64(r, "cache_limits_ms")?,
        },
        cache_salt: get_str(r, "cache_salt")?,
    })
}

pub(super) fn scopes_of(r: &AnyRow) -> Result<Scopes, StoreError> {
    Scopes::parse(&get_str(r, "scopes")?).map_err(StoreError::Corrupt)
}

pub(super) fn key_from_row(r: &AnyRow) -> Result<KeyInfo, StoreError> {
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
