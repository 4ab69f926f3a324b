//! Tessera tenancy: tenants (accounts), API keys, per-tenant limits and the usage
//! ledger, kept in a SQL store (SQLite file by default, PostgreSQL by URL; the same
//! SQL and migrations for both).
//!
//! - [`keys`]: the `tsk_<key_id>_<secret>` format, hashing and constant-time checks,
//!   key [`Scopes`].
//! - [`store`]: [`Store`]: tenants, keys (scopes, expiry), limits, usage ledger, usage
//!   aggregation and retention, the admin audit log ([`Store::audited`]).
//! - [`limits`]: [`Limiter`]: per-tenant rate limits, concurrency and the daily token
//!   quota, taken in two phases ([`Admission`], then [`Reservation`]) by guards that
//!   give back what they hold in `Drop`; in memory per gateway, or shared by
//!   several gateways through Redis ([`Limiter::shared`]).

pub mod keys;
pub mod limits;
pub mod store;
#[cfg(feature = "test-util")]
pub mod testing;

pub use keys::{ApiKey, KeyError, Scope, Scopes};
pub use limits::{
    Admission, DailyState, FailMode, LimitError, LimitKind, Limiter, LimitsHealth, Reservation,
    SharedLimits, SharedLimitsError,
};
pub use store::{
    AuditCtx, AuditRecord, Audited, AuthError, CacheLimits, DashSession, Finetune, GroupBy,
    KeyInfo, Limits, LimitsPatch, ModelAccess, NewFinetune, NewKey, Principal, PriorityCeiling,
    Scheduling, Store, StoreError, Tenant, TenantStatus, UsageGroup, UsageRecord,
    MAX_FINETUNES_PER_TENANT,
};

/// 128 random bits in the UUID text form (`8-4-4-4-12` hex digits; not a
/// version-4 UUID's fixed bits).
pub fn random_uuid() -> String {
    let h = random_hex(16);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Milliseconds since the Unix epoch, now.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[(b >> 4) as usize] as char);
        s.push(DIGITS[(b & 15) as usize] as char);
    }
    s
}

/// `n` random bytes as lowercase hex (from the OS-seeded thread RNG).
pub fn random_hex(n: usize) -> String {
    use rand::RngCore;
    let mut buf = vec![0u8; n];
    rand::rng().fill_bytes(&mut buf);
    hex(&buf)
}
