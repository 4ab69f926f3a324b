//! Tessera tenancy: tenants (accounts), API keys, per-tenant limits and the usage
//! ledger, kept in a SQL store (SQLite file by default, PostgreSQL by URL; the same
//! SQL and migrations for both).
//!
//! - [`keys`]: the `tsk_<key_id>_<secret>` format, hashing and constant-time checks.
//! - [`store`]: [`Store`]: tenants, keys, limits, usage ledger, usage aggregation.
//! - [`limits`]: [`Limiter`]: per-tenant rate limits (governor), concurrency and the
//!   daily token quota, with guards that release in `Drop`.

pub mod keys;
pub mod limits;
pub mod store;
#[cfg(feature = "test-util")]
pub mod testing;

pub use keys::{ApiKey, KeyError};
pub use limits::{LimitError, LimitKind, Limiter, Permit};
pub use store::{
    AuthError, GroupBy, KeyInfo, Limits, Principal, Store, StoreError, Tenant, TenantStatus,
    UsageGroup, UsageRecord,
};

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
