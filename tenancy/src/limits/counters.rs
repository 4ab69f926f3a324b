//! The in-memory counters of one tenant: token buckets refilled per minute, the
//! in-flight count and today's quota counter, behind one mutex per tenant
//! ([`TenantLimiter`]). [`Limiter`](super::Limiter) keeps one per tenant in memory,
//! and, failing open, beside Redis.

use crate::store::Limits;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// The clock of one limiter call: monotonic for the buckets, wall time (Unix ms)
/// for the UTC day. Tests pass their own.
#[derive(Clone, Copy, Debug)]
pub(super) struct Now {
    pub(super) at: Instant,
    pub(super) ms: i64,
}

impl Now {
    pub(super) fn real() -> Self {
        Self {
            at: Instant::now(),
            ms: crate::now_ms(),
        }
    }
}

/// A token bucket of `cap` tokens refilled at `cap` per minute (`cap` is passed in,
/// so a limit change resizes the bucket without losing its level).
#[derive(Clone, Copy, Debug)]
pub(super) struct Bucket {
    pub(super) level: f64,
    pub(super) last: Instant,
}

impl Bucket {
    pub(super) fn full(cap: u32, now: Instant) -> Self {
        Self {
            level: f64::from(cap),
            last: now,
        }
    }

    pub(super) fn refill(&mut self, cap: u32, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.level = (self.level + dt * f64::from(cap) / 60.0).min(f64::from(cap));
        self.last = now;
    }

    /// Whether `n` tokens are available now: `Ok`, `Err(Some(wait))`, or `Err(None)`
    /// when `n` exceeds the bucket and never fits. Takes nothing.
    pub(super) fn check(&mut self, cap: u32, n: u32, now: Instant) -> Result<(), Option<Duration>> {
        if n > cap {
            return Err(None);
        }
        self.refill(cap, now);
        let missing = f64::from(n) - self.level;
        if missing <= 0.0 {
            Ok(())
        } else {
            Err(Some(Duration::from_secs_f64(
                missing * 60.0 / f64::from(cap),
            )))
        }
    }

    pub(super) fn take(&mut self, n: u32) {
        self.level -= f64::from(n);
    }

    pub(super) fn give(&mut self, cap: u32, n: u32) {
        self.level = (self.level + f64::from(n)).min(f64::from(cap));
    }
}

/// Today's quota counter of one tenant (see [`Limiter::daily`](super::Limiter::daily)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DailyState {
    /// UTC day number ([`utc_day`]).
    pub day: i64,
    /// Tokens (input + output) charged today: the ledger's count when loaded, plus
    /// what requests settled since.
    pub used: i64,
    /// Tokens reserved by requests in flight (prompt + max_tokens each).
    pub reserved: i64,
}

pub(super) struct TenantState {
    pub(super) limits: Limits,
    pub(super) requests: Bucket,
    pub(super) input: Bucket,
    pub(super) output: Bucket,
    pub(super) usage: Bucket,
    /// Admitted requests not yet finished, whatever the limit (so a limit change
    /// keeps counting them).
    pub(super) inflight: u32,
    pub(super) daily: Option<DailyState>,
}

impl TenantState {
    pub(super) fn new(limits: Limits, now: Instant) -> Self {
        Self {
            limits,
            requests: Bucket::full(limits.requests_per_minute, now),
            input: Bucket::full(limits.input_tokens_per_minute, now),
            output: Bucket::full(limits.output_tokens_per_minute, now),
            usage: Bucket {
                level: f64::INFINITY,
                last: now,
            },
            inflight: 0,
            daily: None,
        }
    }

    /// Applies changed limits in place: levels kept, clamped to the new sizes (a
    /// limit that was unlimited starts full).
    pub(super) fn update(&mut self, limits: Limits, now: Instant) {
        if self.limits == limits {
            return;
        }
        let old = self.limits;
        for (b, was, cap) in [
            (
                &mut self.requests,
                old.requests_per_minute,
                limits.requests_per_minute,
            ),
            (
                &mut self.input,
                old.input_tokens_per_minute,
                limits.input_tokens_per_minute,
            ),
            (
                &mut self.output,
                old.output_tokens_per_minute,
                limits.output_tokens_per_minute,
            ),
        ] {
            if was == 0 {
                *b = Bucket::full(cap, now);
            } else {
                b.refill(was, now);
                b.level = b.level.min(f64::from(cap));
            }
        }
        self.limits = limits;
    }

    /// Today's counter, started at 0 when the day changed (the caller loads it from
    /// the ledger first at process start: [`Limiter::set_daily_used`](super::Limiter::set_daily_used)).
    pub(super) fn today(&mut self, ms: i64) -> &mut DailyState {
        let day = utc_day(ms);
        let d = self.daily.get_or_insert(DailyState {
            day,
            used: 0,
            reserved: 0,
        });
        if d.day != day {
            *d = DailyState {
                day,
                used: 0,
                reserved: 0,
            };
        }
        d
    }
}

pub(super) struct TenantLimiter {
    pub(super) state: Mutex<TenantState>,
}

impl TenantLimiter {
    pub(super) fn lock(&self) -> MutexGuard<'_, TenantState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Days since the epoch (UTC) of a Unix-ms time.
pub fn utc_day(ms: i64) -> i64 {
    ms.div_euclid(86_400_000)
}

pub(super) fn ms_to_next_day(ms: i64) -> i64 {
    (utc_day(ms) + 1) * 86_400_000 - ms
}
