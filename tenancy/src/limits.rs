//! Per-tenant limits: in memory for one gateway process ([`Limiter::new`]), or in
//! Redis, shared by every gateway pointed at it ([`Limiter::shared`]).
//!
//! A request takes its allowances in two phases, so that no limit can be overdrawn
//! and a refusal keeps nothing:
//!
//! 1. [`Limiter::admit`], before the body is read or tokenized: concurrent requests,
//!    then requests/minute. The [`Admission`] holds one concurrency slot (given back
//!    when it drops) and has spent one request.
//! 2. [`Admission::reserve`], once the prompt is tokenized: input tokens/minute
//!    (the prompt), output tokens/minute (`max_tokens`, the bound of what may be
//!    generated) and the daily quota (`prompt + max_tokens` reserved against what
//!    was used today plus what requests in flight reserved). All three are checked
//!    and taken under one lock, all or nothing; a refusal also gives back the
//!    request spent in phase 1, and the slot.
//! 3. At the end, [`Reservation::settle`] with the real token counts: the daily
//!    reservation becomes the real count and the unused token allowance goes back to
//!    the buckets; [`Reservation::cancel`] charges no tokens (nothing was computed).
//!    A reservation dropped unsettled charges everything it reserved, so a lost
//!    settle can never let the quota be exceeded.
//!
//! Rate limits are token buckets holding one minute's allowance, refilled
//! continuously. Limits of 0 are unlimited. Changing a tenant's limits updates its
//! state in place: requests in flight keep counting against the concurrency limit,
//! bucket levels are kept (clamped to the new size) and reservations stay.
//!
//! Every guard ([`Admission`], [`Reservation`]) gives back what it holds in `Drop`;
//! [`Limiter::inflight`] and [`Limiter::daily`] show it.
//!
//! # Shared limits (Redis)
//!
//! With [`Limiter::shared`] the same semantics hold across gateways: each phase is
//! one Lua script run atomically by Redis on Redis' clock, the rate limits are GCRA
//! (the ATM Forum's generic cell rate algorithm, as in redis-cell; equivalent to the
//! buckets above), and concurrency slots are leases that the gateway holding them
//! refreshes, so that the slots of a gateway that died come back within
//! [`SharedLimits::lease_ttl`]. Settles and releases stay synchronous for the caller:
//! they are handed to a tokio task ([`Limiter::flush`] waits for them). When Redis
//! fails or does not answer within [`SharedLimits::timeout`], [`FailMode`] decides:
//! refuse ([`LimitKind::Unavailable`]) or fall back to this process's in-memory
//! limits. The usage API's own limit ([`Limiter::usage_query`]) stays per gateway.
//! The Redis side (keys, scripts) is described in the `shared` module's source.

mod counters;
mod policy;
mod shared;

use counters::{ms_to_next_day, Bucket, Now, TenantLimiter, TenantState};
pub use counters::{utc_day, DailyState};
use policy::{concurrency_error, daily_error, requests_error, tokens_error, unavailable_error};
pub use policy::{FailMode, LimitError, LimitKind, SharedLimits, SharedLimitsError};

use crate::store::Limits;
use dashmap::DashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The limiter's backend, for readiness checks and metrics ([`Limiter::health`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LimitsHealth {
    /// `"memory"` or `"redis"`.
    pub backend: &'static str,
    /// Whether the backend answers: Redis answered a PING within the timeout
    /// (always true in memory).
    pub up: bool,
    /// What the limiter does while it is down (`None` in memory).
    pub fail_mode: Option<FailMode>,
}

/// One counted request in flight; the count drops with it.
struct Slot(Arc<TenantLimiter>);

impl Drop for Slot {
    fn drop(&mut self) {
        let mut st = self.0.lock();
        st.inflight = st.inflight.saturating_sub(1);
    }
}

/// Phase 1 passed: one concurrency slot held (released on drop) and one request
/// spent. [`Admission::reserve`] continues once the prompt is tokenized.
pub struct Admission {
    inner: Phase1,
    /// Requests spent (given back if phase 2 refuses).
    requests: u32,
}

enum Phase1 {
    Local(Slot),
    Shared {
        lease: shared::Lease,
        limits: Limits,
        /// This process's state of the tenant when failing open: phase 2 falls
        /// back to it if Redis fails then.
        local: Option<Arc<TenantLimiter>>,
    },
}

impl std::fmt::Debug for Admission {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let backend = match self.inner {
            Phase1::Local(_) => "memory",
            Phase1::Shared { .. } => "redis",
        };
        f.debug_struct("Admission")
            .field("backend", &backend)
            .finish_non_exhaustive()
    }
}

/// Phase 2 passed: the slot, the token allowances and the daily reservation of one
/// running request. End it with [`Reservation::settle`] or [`Reservation::cancel`];
/// dropped unsettled, it charges everything it reserved.
pub struct Reservation {
    inner: Phase2,
}

enum Phase2 {
    Local(LocalReservation),
    Shared {
        lease: shared::Lease,
        input: u32,
        output: u32,
        /// Tokens reserved against the daily quota (0 without one).
        daily: i64,
    },
}

struct LocalReservation {
    slot: Slot,
    input: u32,
    output: u32,
    /// (UTC day, tokens reserved that day) when the tenant has a daily quota.
    daily: Option<(i64, i64)>,
    open: bool,
}

impl std::fmt::Debug for Reservation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut d = f.debug_struct("Reservation");
        match &self.inner {
            Phase2::Local(r) => d
                .field("input", &r.input)
                .field("output", &r.output)
                .field("daily", &r.daily),
            Phase2::Shared {
                input,
                output,
                daily,
                ..
            } => d
                .field("input", input)
                .field("output", output)
                .field("daily", daily),
        };
        d.finish_non_exhaustive()
    }
}

/// Per-tenant limiters of one gateway process, in memory ([`Limiter::new`]) or in
/// Redis ([`Limiter::shared`]). The in-memory map is a [`DashMap`] (sharded locks):
/// every request looks its tenant up twice, and requests of different tenants
/// should not queue on one process-wide lock; each tenant's state has its own mutex.
#[derive(Default)]
pub struct Limiter {
    /// The in-memory limits (with Redis: the fallback of [`FailMode::Open`]).
    tenants: DashMap<String, Arc<TenantLimiter>>,
    shared: Option<Arc<shared::Shared>>,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter")
            .field("backend", &self.backend())
            .finish_non_exhaustive()
    }
}

impl Drop for Limiter {
    fn drop(&mut self) {
        // Stop refreshing leases: those of requests still running lapse within
        // lease_ttl, as a dead gateway's do.
        if let Some(s) = &self.shared {
            s.stop_refresher();
        }
    }
}

impl Limiter {
    /// An empty in-memory limiter: limits per gateway process.
    pub fn new() -> Self {
        Self::default()
    }

    /// A limiter whose limits live in the Redis server at `cfg.url`, shared by every
    /// gateway using the same server. Connects lazily, at the first call (so a
    /// gateway starts while Redis is down; [`Limiter::health`] tells), and
    /// reconnects after a failure. Leases are refreshed by a tokio task started at
    /// the first admission and stopped when the limiter drops.
    ///
    /// Errors: a URL that does not parse, a zero timeout or a lease_ttl under 3 ms.
    pub fn shared(cfg: SharedLimits) -> Result<Self, SharedLimitsError> {
        let s = shared::Shared::new(cfg).map_err(SharedLimitsError)?;
        Ok(Self {
            tenants: DashMap::new(),
            shared: Some(Arc::new(s)),
        })
    }

    fn backend(&self) -> &'static str {
        if self.shared.is_some() {
            "redis"
        } else {
            "memory"
        }
    }

    /// The backend and whether it answers (a PING bounded by the timeout; no
    /// backend error is counted for it).
    pub async fn health(&self) -> LimitsHealth {
        match &self.shared {
            None => LimitsHealth {
                backend: "memory",
                up: true,
                fail_mode: None,
            },
            Some(s) => LimitsHealth {
                backend: "redis",
                up: s.ping().await,
                fail_mode: Some(s.on_failure()),
            },
        }
    }

    /// Redis calls that failed or timed out since the limiter was made (admit,
    /// reserve, daily load, settle, release, lease refresh); 0 in memory.
    pub fn backend_errors(&self) -> u64 {
        self.shared.as_ref().map_or(0, |s| s.errors())
    }

    /// Requests (phase 1 or 2) that [`FailMode::Open`] handed to the in-memory
    /// limits because Redis failed; 0 in memory.
    pub fn fallbacks(&self) -> u64 {
        self.shared.as_ref().map_or(0, |s| s.fallbacks())
    }

    /// Waits until the settles and releases handed to background tasks have reached
    /// Redis (or failed), e.g. before a shutdown. Returns at once in memory.
    pub async fn flush(&self) {
        if let Some(s) = &self.shared {
            s.flush().await;
        }
    }

    fn tenant(&self, id: &str, limits: Limits, now: Instant) -> Arc<TenantLimiter> {
        let existing = self.tenants.get(id).map(|t| t.clone());
        let t = match existing {
            Some(t) => t,
            None => self
                .tenants
                .entry(id.into())
                .or_insert_with(|| {
                    Arc::new(TenantLimiter {
                        state: Mutex::new(TenantState::new(limits, now)),
                    })
                })
                .clone(),
        };
        t.lock().update(limits, now);
        t
    }

    fn existing(&self, id: &str) -> Option<Arc<TenantLimiter>> {
        self.tenants.get(id).map(|t| t.clone())
    }

    /// Phase 1: concurrency, then requests/minute, for a request of tenant `id`
    /// whose limits are `limits` (as read with its key). Checked and taken together.
    ///
    /// Errors: the limit that refused; with Redis failing and [`FailMode::Closed`],
    /// [`LimitKind::Unavailable`] (with [`FailMode::Open`] the in-memory limits
    /// decide instead).
    pub async fn admit(&self, id: &str, limits: Limits) -> Result<Admission, LimitError> {
        self.admit_many(id, limits, 1).await
    }

    /// [`Limiter::admit`] for `requests` requests at once (an async batch of that
    /// many items): one concurrency slot, `requests` taken from requests/minute,
    /// all or nothing (0 counts as 1). A refusal in phase 2 gives all of them back.
    ///
    /// Errors: as [`Limiter::admit`]; more requests than the per-minute limit is
    /// a [`LimitKind::Requests`] refusal that is not retryable.
    pub async fn admit_many(
        &self,
        id: &str,
        limits: Limits,
        requests: u32,
    ) -> Result<Admission, LimitError> {
        let n = requests.max(1);
        let Some(s) = &self.shared else {
            return self.admit_at(id, limits, n, Now::real());
        };
        let cap = limits.requests_per_minute;
        if cap > 0 && n > cap {
            return Err(requests_error(n, cap, None));
        }
        match s.admit(id, limits, n).await {
            Ok(Ok(lease)) => Ok(Admission {
                inner: Phase1::Shared {
                    lease,
                    limits,
                    local: (s.on_failure() == FailMode::Open)
                        .then(|| self.tenant(id, limits, Instant::now())),
                },
                requests: n,
            }),
            Ok(Err(refused)) => Err(refused),
            Err(shared::Down { .. }) => match s.on_failure() {
                FailMode::Closed => Err(unavailable_error()),
                FailMode::Open => {
                    s.count_fallback();
                    self.admit_at(id, limits, n, Now::real())
                }
            },
        }
    }

    /// Whether tenant `id` could be admitted for one request now, without taking
    /// anything: its concurrency and requests/minute, in this process's memory.
    /// The gateway asks before parsing an async batch's body, so that a tenant
    /// whose minute is spent is refused without its megabyte being parsed
    /// ([`Limiter::admit_many`] still decides, and takes). With Redis the shared
    /// counters are not read (a round trip that admission makes anyway): always Ok.
    ///
    /// Errors: the limit that would refuse, as [`Limiter::admit`] gives it.
    pub fn precheck(&self, id: &str, limits: Limits) -> Result<(), LimitError> {
        if self.shared.is_some() {
            return Ok(());
        }
        let now = Instant::now();
        let t = self.tenant(id, limits, now);
        let mut st = t.lock();
        st.update(limits, now);
        if limits.max_concurrent > 0 && st.inflight >= limits.max_concurrent {
            return Err(concurrency_error(st.inflight, limits.max_concurrent));
        }
        let cap = limits.requests_per_minute;
        if cap > 0 {
            if let Err(wait) = st.requests.check(cap, 1, now) {
                return Err(requests_error(1, cap, wait));
            }
        }
        Ok(())
    }

    fn admit_at(
        &self,
        id: &str,
        limits: Limits,
        n: u32,
        now: Now,
    ) -> Result<Admission, LimitError> {
        admit_local(self.tenant(id, limits, now.at), limits, n, now)
    }

    /// Whether the tenant's daily counter must be loaded from the ledger first
    /// (first request of the process or of a new UTC day; with Redis, of any gateway
    /// sharing it). Pass the loaded value to [`Limiter::set_daily_used`] before
    /// [`Admission::reserve`]. With Redis failing: true (the reservation then
    /// decides), or with [`FailMode::Open`] whether the in-memory counter needs it.
    pub async fn needs_daily(&self, id: &str, limits: Limits) -> bool {
        if limits.daily_tokens == 0 {
            return false;
        }
        let Some(s) = &self.shared else {
            return self.needs_daily_at(id, limits, crate::now_ms());
        };
        let open = s.on_failure() == FailMode::Open;
        match s.needs_daily(id).await {
            // Failing open needs the in-memory counter loaded as well.
            Ok(needed) => needed || (open && self.needs_daily_at(id, limits, crate::now_ms())),
            Err(shared::Down { .. }) => !open || self.needs_daily_at(id, limits, crate::now_ms()),
        }
    }

    /// Loads tenant `id`'s tokens used today (UTC) from the usage ledger in
    /// `store` when the daily counter needs it ([`Limiter::needs_daily`]), so that
    /// [`Admission::reserve`] checks the quota against the ledger; a no-op without a
    /// daily quota or with the counter already loaded today.
    ///
    /// Errors: the ledger could not be read (the caller refuses the request, 503).
    pub async fn load_daily(
        &self,
        id: &str,
        limits: Limits,
        store: &crate::store::Store,
    ) -> Result<(), crate::store::StoreError> {
        if !self.needs_daily(id, limits).await {
            return Ok(());
        }
        let day_start = utc_day(crate::now_ms()) * 86_400_000;
        let used = store.tokens_since(id, day_start).await?;
        self.set_daily_used(id, limits, used).await;
        Ok(())
    }

    fn needs_daily_at(&self, id: &str, limits: Limits, ms: i64) -> bool {
        if limits.daily_tokens == 0 {
            return false;
        }
        let t = self.tenant(id, limits, Instant::now());
        let st = t.lock();
        let today = utc_day(ms);
        !matches!(st.daily, Some(d) if d.day == today)
    }

    /// Sets today's used tokens as read from the ledger. The first load of a day
    /// wins: once the counter holds today (loaded, or started by a reservation),
    /// later loads are ignored, so no settled or reserved token is lost to a read
    /// that raced with it. With Redis, the first load of any gateway wins; a failure
    /// is logged and counted ([`Limiter::backend_errors`]).
    pub async fn set_daily_used(&self, id: &str, limits: Limits, used: i64) {
        let Some(s) = &self.shared else {
            return self.set_daily_used_at(id, limits, used, crate::now_ms());
        };
        // A failure is logged and counted; the reservation then decides.
        let _ = s.set_daily_used(id, used).await;
        if s.on_failure() == FailMode::Open {
            self.set_daily_used_at(id, limits, used, crate::now_ms());
        }
    }

    fn set_daily_used_at(&self, id: &str, limits: Limits, used: i64, ms: i64) {
        let t = self.tenant(id, limits, Instant::now());
        let mut st = t.lock();
        let today = utc_day(ms);
        if !matches!(st.daily, Some(d) if d.day == today) {
            st.daily = Some(DailyState {
                day: today,
                used,
                reserved: 0,
            });
        }
    }

    /// The usage API's own limit: one query of tenant `id`, at most `per_minute`
    /// a minute (0: unlimited). Always in this process's memory, also with Redis:
    /// each gateway allows `per_minute` (usage queries are cheap reads, and a
    /// gateway's own share is enough to protect its store).
    pub fn usage_query(&self, id: &str, limits: Limits, per_minute: u32) -> Result<(), LimitError> {
        self.usage_query_at(id, limits, per_minute, Now::real())
    }

    fn usage_query_at(
        &self,
        id: &str,
        limits: Limits,
        per_minute: u32,
        now: Now,
    ) -> Result<(), LimitError> {
        if per_minute == 0 {
            return Ok(());
        }
        let t = self.tenant(id, limits, now.at);
        let mut st = t.lock();
        if !st.usage.level.is_finite() {
            st.usage = Bucket::full(per_minute, now.at);
        }
        match st.usage.check(per_minute, 1, now.at) {
            Ok(()) => {
                st.usage.take(1);
                Ok(())
            }
            Err(wait) => Err(LimitError {
                kind: LimitKind::UsageQueries,
                retry_after: wait.unwrap_or(Duration::from_secs(60)),
                retryable: true,
                detail: format!("limit {per_minute} usage queries/minute"),
            }),
        }
    }

    /// Admitted requests of tenant `id` not yet finished, in this process (with
    /// Redis: the leases this gateway holds plus the requests of the in-memory
    /// fallback).
    pub fn inflight(&self, id: &str) -> u32 {
        let local = self.existing(id).map_or(0, |t| t.lock().inflight);
        local + self.shared.as_ref().map_or(0, |s| s.held(id))
    }

    /// Tenant `id`'s in-memory daily counter, if it has one (with Redis: the
    /// fallback's counter; the shared one is in Redis).
    pub fn daily(&self, id: &str) -> Option<DailyState> {
        self.existing(id).and_then(|t| t.lock().daily)
    }
}

/// Phase 1 against one tenant's in-memory state.
fn admit_local(
    t: Arc<TenantLimiter>,
    limits: Limits,
    n: u32,
    now: Now,
) -> Result<Admission, LimitError> {
    let mut st = t.lock();
    st.update(limits, now.at);
    if limits.max_concurrent > 0 && st.inflight >= limits.max_concurrent {
        return Err(concurrency_error(st.inflight, limits.max_concurrent));
    }
    let cap = limits.requests_per_minute;
    if cap > 0 {
        if let Err(wait) = st.requests.check(cap, n, now.at) {
            return Err(requests_error(n, cap, wait));
        }
        st.requests.take(n);
    }
    st.inflight += 1;
    drop(st);
    Ok(Admission {
        inner: Phase1::Local(Slot(t)),
        requests: n,
    })
}

impl Admission {
    /// Phase 2 for a prompt of `input_tokens` and at most `max_tokens` output
    /// tokens: input tokens/minute, output tokens/minute and the daily quota, checked
    /// and taken together. On a refusal the request spent in phase 1 is given back
    /// and the slot released (this admission is consumed either way).
    ///
    /// Errors: the limit that refused (a request larger than a per-minute limit is
    /// not retryable); with Redis failing, as [`Limiter::admit`] (failing open, the
    /// in-memory limits take the whole request, phase 1 included).
    pub async fn reserve(
        self,
        input_tokens: u32,
        max_tokens: u32,
    ) -> Result<Reservation, LimitError> {
        let n = self.requests;
        let (mut lease, limits, local) = match self.inner {
            Phase1::Local(slot) => {
                return reserve_local(slot, n, input_tokens, max_tokens, Now::real())
            }
            Phase1::Shared {
                lease,
                limits,
                local,
            } => (lease, limits, local),
        };
        match lease.reserve(limits, n, input_tokens, max_tokens).await {
            Ok(Ok(())) => Ok(Reservation {
                inner: Phase2::Shared {
                    lease,
                    input: input_tokens,
                    output: max_tokens,
                    daily: if limits.daily_tokens > 0 {
                        i64::from(input_tokens) + i64::from(max_tokens)
                    } else {
                        0
                    },
                },
            }),
            Ok(Err(refused)) => Err(refused), // Redis ended the lease.
            Err(shared::Down { .. }) => {
                let s = lease.shared().clone();
                // Released in the background (had the script run, its reservation
                // is charged in full).
                drop(lease);
                match (s.on_failure(), local) {
                    (FailMode::Open, Some(t)) => {
                        s.count_fallback();
                        let now = Now::real();
                        match admit_local(t, limits, n, now)?.inner {
                            Phase1::Local(slot) => {
                                reserve_local(slot, n, input_tokens, max_tokens, now)
                            }
                            Phase1::Shared { .. } => unreachable!("admit_local is local"),
                        }
                    }
                    _ => Err(unavailable_error()),
                }
            }
        }
    }

    #[cfg(test)]
    fn reserve_at(self, input: u32, output: u32, now: Now) -> Result<Reservation, LimitError> {
        match self.inner {
            Phase1::Local(slot) => reserve_local(slot, self.requests, input, output, now),
            Phase1::Shared { .. } => panic!("reserve_at is for in-memory admissions"),
        }
    }
}

/// Phase 2 against one tenant's in-memory state.
/// `requests`: spent in phase 1, given back on a refusal.
fn reserve_local(
    slot: Slot,
    requests: u32,
    input: u32,
    output: u32,
    now: Now,
) -> Result<Reservation, LimitError> {
    let t = slot.0.clone();
    let mut st = t.lock();
    let limits = st.limits;
    if let Err(e) = check_tokens(&mut st, input, output, now) {
        if limits.requests_per_minute > 0 {
            st.requests.give(limits.requests_per_minute, requests);
        }
        drop(st);
        return Err(e); // `slot` drops here: the slot goes back.
    }
    if limits.input_tokens_per_minute > 0 {
        st.input.take(input);
    }
    if limits.output_tokens_per_minute > 0 {
        st.output.take(output);
    }
    let daily = (limits.daily_tokens > 0).then(|| {
        let need = i64::from(input) + i64::from(output);
        let d = st.today(now.ms);
        d.reserved += need;
        (d.day, need)
    });
    drop(st);
    Ok(Reservation {
        inner: Phase2::Local(LocalReservation {
            slot,
            input,
            output,
            daily,
            open: true,
        }),
    })
}

fn check_tokens(st: &mut TenantState, input: u32, output: u32, now: Now) -> Result<(), LimitError> {
    let limits = st.limits;
    for (bucket, n, kind, cap) in [
        (
            &mut st.input,
            input,
            LimitKind::InputTokens,
            limits.input_tokens_per_minute,
        ),
        (
            &mut st.output,
            output,
            LimitKind::OutputTokens,
            limits.output_tokens_per_minute,
        ),
    ] {
        if cap == 0 || n == 0 {
            continue;
        }
        if let Err(wait) = bucket.check(cap, n, now.at) {
            return Err(tokens_error(kind, n, cap, wait));
        }
    }
    let daily = limits.daily_tokens as i64;
    if daily > 0 {
        let need = i64::from(input) + i64::from(output);
        let d = st.today(now.ms);
        if d.used + d.reserved + need > daily {
            return Err(daily_error(
                d.used,
                d.reserved,
                need,
                daily,
                ms_to_next_day(now.ms),
            ));
        }
    }
    Ok(())
}

/// Tokens given back to a per-minute bucket: those held and not used.
fn unused(held: u32, used: i64) -> u32 {
    held.saturating_sub(used.clamp(0, i64::from(held)) as u32)
}

impl Reservation {
    /// Ends the request with what it really used: `input_used` prompt tokens and
    /// `output_used` generated tokens (each at most what was reserved). The daily
    /// counter is charged exactly that; unused token allowance goes back to the
    /// per-minute buckets; the slot is released. With Redis this happens in a
    /// background task ([`Limiter::flush`]); a failure is logged and counted, and
    /// the lease then lapses within lease_ttl, charging the whole reservation.
    pub fn settle(self, input_used: i64, output_used: i64) {
        match self.inner {
            Phase2::Local(mut r) => r.finish(Some((input_used, output_used))),
            Phase2::Shared {
                lease,
                input,
                output,
                daily,
            } => {
                let used = (input_used.max(0) + output_used.max(0)).min(daily);
                lease.settle(unused(input, input_used), unused(output, output_used), used);
            }
        }
    }

    /// Ends a request that computed nothing (refused by the engine, busy, aborted
    /// before its prefill): no tokens charged, allowances back, slot released.
    pub fn cancel(self) {
        self.settle(0, 0);
    }

    /// Tokens reserved against the daily quota (0 without one).
    pub fn reserved_daily(&self) -> i64 {
        match &self.inner {
            Phase2::Local(r) => r.daily.map_or(0, |(_, n)| n),
            Phase2::Shared { daily, .. } => *daily,
        }
    }
}

impl LocalReservation {
    fn finish(&mut self, used: Option<(i64, i64)>) {
        if !self.open {
            return;
        }
        self.open = false;
        let mut st = self.slot.0.lock();
        let limits = st.limits;
        if let Some((day, reserved)) = self.daily {
            if let Some(d) = st.daily.as_mut().filter(|d| d.day == day) {
                d.reserved -= reserved;
                d.used += match used {
                    Some((i, o)) => (i.max(0) + o.max(0)).min(reserved),
                    None => reserved,
                };
            }
        }
        if let Some((i, o)) = used {
            if limits.input_tokens_per_minute > 0 {
                st.input
                    .give(limits.input_tokens_per_minute, unused(self.input, i));
            }
            if limits.output_tokens_per_minute > 0 {
                st.output
                    .give(limits.output_tokens_per_minute, unused(self.output, o));
            }
        }
    }
}

impl Drop for LocalReservation {
    fn drop(&mut self) {
        // Unsettled: charge the whole reservation (never less than may have run).
        self.finish(None);
    }
}

#[cfg(test)]
mod tests;
