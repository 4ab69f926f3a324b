//! Per-tenant limits, enforced in memory by one gateway process.
//!
//! [`Limiter::check`] runs the checks in this order and stops at the first failure:
//! daily token quota, concurrent requests, requests/minute, input tokens/minute,
//! output tokens/minute (charged with `max_tokens`: the bound of what may be
//! generated). The rate limits are GCRA buckets from `governor` with a burst of one
//! minute's allowance. A success returns a [`Permit`] that holds one concurrency
//! slot until dropped; [`Permit::finish`] adds the request's tokens to the daily
//! counter. Limits of 0 are unlimited. A tenant's limiter is rebuilt when its
//! limits change.

use crate::store::Limits;
use governor::clock::{Clock, DefaultClock};
use governor::{Quota, RateLimiter};
use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

type Bucket = RateLimiter<
    governor::state::NotKeyed,
    governor::state::InMemoryState,
    DefaultClock,
    governor::middleware::NoOpMiddleware<<DefaultClock as Clock>::Instant>,
>;

/// Which limit refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LimitKind {
    /// Requests per minute.
    Requests,
    /// Input tokens per minute.
    InputTokens,
    /// Output tokens per minute.
    OutputTokens,
    /// Concurrent requests.
    Concurrency,
    /// Daily token quota.
    DailyQuota,
}

impl LimitKind {
    /// Stable machine label.
    pub fn label(self) -> &'static str {
        match self {
            Self::Requests => "requests_per_minute",
            Self::InputTokens => "input_tokens_per_minute",
            Self::OutputTokens => "output_tokens_per_minute",
            Self::Concurrency => "max_concurrent",
            Self::DailyQuota => "daily_tokens",
        }
    }
}

/// A limit refused the request.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("rate limit exceeded: {} ({detail})", kind.label())]
pub struct LimitError {
    /// Which limit.
    pub kind: LimitKind,
    /// How long to wait before a retry can succeed.
    pub retry_after: Duration,
    /// False when waiting cannot help (the request alone exceeds the limit).
    pub retryable: bool,
    /// Human-readable numbers.
    pub detail: String,
}

struct TenantLimiter {
    limits: Limits,
    requests: Option<Bucket>,
    input: Option<Bucket>,
    output: Option<Bucket>,
    concurrency: Option<Arc<Semaphore>>,
    /// (UTC day number, tokens used that day); `None` until loaded from the ledger.
    daily: Mutex<Option<(i64, i64)>>,
}

fn per_minute(n: u32) -> Option<Bucket> {
    NonZeroU32::new(n).map(|n| RateLimiter::direct(Quota::per_minute(n)))
}

impl TenantLimiter {
    fn new(limits: Limits) -> Self {
        Self {
            limits,
            requests: per_minute(limits.requests_per_minute),
            input: per_minute(limits.input_tokens_per_minute),
            output: per_minute(limits.output_tokens_per_minute),
            concurrency: (limits.max_concurrent > 0)
                .then(|| Arc::new(Semaphore::new(limits.max_concurrent as usize))),
            daily: Mutex::new(None),
        }
    }
}

/// What a request holds while it runs: a concurrency slot (released on drop).
pub struct Permit {
    _slot: Option<OwnedSemaphorePermit>,
    tenant: Arc<TenantLimiter>,
}

impl std::fmt::Debug for Permit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Permit").finish_non_exhaustive()
    }
}

impl Permit {
    /// Adds a finished request's tokens to the tenant's daily counter.
    pub fn finish(&self, tokens: i64) {
        let mut d = self.tenant.daily.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((day, used)) = d.as_mut() {
            if *day == utc_day(crate::now_ms()) {
                *used += tokens;
            }
        }
    }
}

/// Days since the epoch (UTC) of a Unix-ms time.
pub fn utc_day(ms: i64) -> i64 {
    ms.div_euclid(86_400_000)
}

/// Per-tenant limiters of one gateway process.
#[derive(Default)]
pub struct Limiter {
    tenants: Mutex<HashMap<String, Arc<TenantLimiter>>>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter").finish_non_exhaustive()
    }
}

fn wait_of(e: &governor::NotUntil<<DefaultClock as Clock>::Instant>) -> Duration {
    e.wait_time_from(DefaultClock::default().now())
}

impl Limiter {
    /// An empty limiter.
    pub fn new() -> Self {
        Self::default()
    }

    fn tenant(&self, id: &str, limits: Limits) -> Arc<TenantLimiter> {
        let mut m = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        match m.get(id) {
            Some(t) if t.limits == limits => t.clone(),
            _ => {
                let t = Arc::new(TenantLimiter::new(limits));
                m.insert(id.into(), t.clone());
                t
            }
        }
    }

    /// Whether the tenant's daily counter must be loaded from the ledger first
    /// (first request of the process or of a new UTC day). Pass the loaded value to
    /// [`Limiter::set_daily_used`].
    pub fn needs_daily(&self, id: &str, limits: Limits) -> bool {
        if limits.daily_tokens == 0 {
            return false;
        }
        let t = self.tenant(id, limits);
        let d = t.daily.lock().unwrap_or_else(|e| e.into_inner());
        !matches!(*d, Some((day, _)) if day == utc_day(crate::now_ms()))
    }

    /// Sets today's used tokens (from the ledger).
    pub fn set_daily_used(&self, id: &str, limits: Limits, used: i64) {
        let t = self.tenant(id, limits);
        *t.daily.lock().unwrap_or_else(|e| e.into_inner()) = Some((utc_day(crate::now_ms()), used));
    }

    /// Checks every limit for a request of `input_tokens` prompt tokens and at most
    /// `max_tokens` output tokens, consuming rate-limit allowance on success.
    pub fn check(
        &self,
        id: &str,
        limits: Limits,
        input_tokens: u32,
        max_tokens: u32,
    ) -> Result<Permit, LimitError> {
        let t = self.tenant(id, limits);
        if limits.daily_tokens > 0 {
            let now = crate::now_ms();
            let d = t.daily.lock().unwrap_or_else(|e| e.into_inner());
            let used = match *d {
                Some((day, used)) if day == utc_day(now) => used,
                _ => 0,
            };
            if used >= limits.daily_tokens as i64 {
                let next_day = (utc_day(now) + 1) * 86_400_000;
                return Err(LimitError {
                    kind: LimitKind::DailyQuota,
                    retry_after: Duration::from_millis((next_day - now).max(1000) as u64),
                    retryable: false,
                    detail: format!(
                        "{used} of {} daily tokens used; the quota resets at 00:00 UTC",
                        limits.daily_tokens
                    ),
                });
            }
        }
        let slot = match &t.concurrency {
            Some(s) => Some(s.clone().try_acquire_owned().map_err(|_| LimitError {
                kind: LimitKind::Concurrency,
                retry_after: Duration::from_secs(1),
                retryable: true,
                detail: format!("{} requests already in flight", limits.max_concurrent),
            })?),
            None => None,
        };
        if let Some(b) = &t.requests {
            if let Err(e) = b.check() {
                return Err(LimitError {
                    kind: LimitKind::Requests,
                    retry_after: wait_of(&e),
                    retryable: true,
                    detail: format!("limit {} requests/minute", limits.requests_per_minute),
                });
            }
        }
        for (bucket, n, kind, limit) in [
            (
                &t.input,
                input_tokens,
                LimitKind::InputTokens,
                limits.input_tokens_per_minute,
            ),
            (
                &t.output,
                max_tokens,
                LimitKind::OutputTokens,
                limits.output_tokens_per_minute,
            ),
        ] {
            let (Some(b), Some(n)) = (bucket, NonZeroU32::new(n)) else {
                continue;
            };
            match b.check_n(n) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    return Err(LimitError {
                        kind,
                        retry_after: wait_of(&e),
                        retryable: true,
                        detail: format!("request needs {n} tokens; limit {limit} tokens/minute"),
                    })
                }
                Err(_) => {
                    return Err(LimitError {
                        kind,
                        retry_after: Duration::from_secs(60),
                        retryable: false,
                        detail: format!(
                            "request needs {n} tokens, more than the limit of {limit} tokens/minute"
                        ),
                    })
                }
            }
        }
        Ok(Permit {
            _slot: slot,
            tenant: t,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_per_minute_and_isolation() {
        let l = Limiter::new();
        let lim = Limits {
            requests_per_minute: 2,
            ..Limits::default()
        };
        assert!(l.check("a", lim, 1, 1).is_ok());
        assert!(l.check("a", lim, 1, 1).is_ok());
        let e = l.check("a", lim, 1, 1).unwrap_err();
        assert_eq!(e.kind, LimitKind::Requests);
        assert!(e.retryable);
        assert!(e.retry_after > Duration::from_secs(1) && e.retry_after <= Duration::from_secs(30));
        // Another tenant with the same limits is unaffected.
        assert!(l.check("b", lim, 1, 1).is_ok());
    }

    #[test]
    fn concurrency_released_on_drop() {
        let l = Limiter::new();
        let lim = Limits {
            max_concurrent: 1,
            ..Limits::default()
        };
        let p = l.check("a", lim, 1, 1).unwrap();
        assert_eq!(
            l.check("a", lim, 1, 1).unwrap_err().kind,
            LimitKind::Concurrency
        );
        drop(p);
        assert!(l.check("a", lim, 1, 1).is_ok());
    }

    #[test]
    fn token_limits_and_oversized_requests() {
        let l = Limiter::new();
        let lim = Limits {
            input_tokens_per_minute: 100,
            output_tokens_per_minute: 50,
            ..Limits::default()
        };
        let e = l.check("a", lim, 101, 1).unwrap_err();
        assert_eq!((e.kind, e.retryable), (LimitKind::InputTokens, false));
        let e = l.check("a", lim, 1, 51).unwrap_err();
        assert_eq!((e.kind, e.retryable), (LimitKind::OutputTokens, false));
        assert!(l.check("a", lim, 60, 10).is_ok());
        let e = l.check("a", lim, 60, 10).unwrap_err();
        assert_eq!((e.kind, e.retryable), (LimitKind::InputTokens, true));
    }

    #[test]
    fn daily_quota() {
        let l = Limiter::new();
        let lim = Limits {
            daily_tokens: 100,
            ..Limits::default()
        };
        assert!(l.needs_daily("a", lim));
        l.set_daily_used("a", lim, 90);
        assert!(!l.needs_daily("a", lim));
        let p = l.check("a", lim, 5, 5).unwrap();
        p.finish(10);
        let e = l.check("a", lim, 1, 1).unwrap_err();
        assert_eq!((e.kind, e.retryable), (LimitKind::DailyQuota, false));
        assert!(e.retry_after >= Duration::from_secs(1));
    }

    #[test]
    fn unlimited_by_default() {
        let l = Limiter::new();
        for _ in 0..1000 {
            assert!(l.check("a", Limits::default(), 1000, 1000).is_ok());
        }
    }
}
