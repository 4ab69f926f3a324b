//! The Redis backend of [`Limiter`](super::Limiter) ([`Limiter::shared`](super::Limiter::shared)):
//! every gateway pointed at one Redis enforces one set of limits per tenant.
//!
//! Each decision is one Lua script (sent with EVALSHA, loaded on NOSCRIPT) that
//! Redis runs atomically, reading the time from Redis itself (`TIME`): gateways
//! racing on one tenant see one order of events, and their clock skew does not
//! matter. The keys of tenant `t` share the hash tag `{t}`, so a Redis Cluster keeps
//! them in one slot (every script declares the keys it touches):
//!
//! | key | type | content |
//! |---|---|---|
//! | `tessera:{t}:leases` | sorted set | concurrency leases: lease id, scored by its expiry (Redis ms) |
//! | `tessera:{t}:held` | hash | lease id -> `day:tokens` it reserved against the daily quota |
//! | `tessera:{t}:daily` | hash | `day` (UTC day number), `used`, `reserved`: [`DailyState`](super::DailyState) |
//! | `tessera:{t}:rpm`, `:itpm`, `:otpm` | hash | a rate bucket: `tat` (ms), `lim` (the limit it was written with) |
//!
//! Rate limits are GCRA, the generic cell rate algorithm of the ATM Forum's traffic
//! management specification (as in redis-cell, and Brandur Leach's "Rate limiting,
//! cells, and GCRA"): a bucket of `lim` units a minute is one timestamp, its
//! theoretical arrival time `tat`; a unit costs the emission interval
//! `T = 60000 / lim` ms and `n` units fit iff `max(tat, now) + n*T - now <= 60000`.
//! That is the local token bucket holding one minute's allowance, refilled
//! continuously: its level is `lim - (max(tat, now) - now) / T`. A bucket key expires
//! once the bucket is full again; a changed limit keeps the level, clamped to the new
//! size, as the local limiter does.
//!
//! Concurrency is a sorted set of leases. A lease expires `lease_ttl` after it was
//! taken unless its gateway refreshes it: one background task per limiter refreshes
//! every lease it holds each `lease_ttl / 3`, so a live gateway's leases last while a
//! dead gateway's lapse within `lease_ttl`. The next admission of the tenant (on any
//! gateway) removes lapsed leases and charges their daily reservations in full, as a
//! reservation dropped unsettled is charged: a request that may have run is never
//! charged less than it may have used.
//!
//! Settles and releases are asynchronous: the guards' synchronous `settle`, `cancel`
//! and `Drop` stop refreshing the lease at once and hand the Redis call to a tokio
//! task ([`Limiter::flush`](super::Limiter::flush) waits for them).

use super::policy::{
    concurrency_error, daily_error, requests_error, tokens_error, FailMode, LimitError, LimitKind,
    SharedLimits,
};
use crate::store::Limits;
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, RedisResult, Script};
use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicI64, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

/// Lua helpers shared by the scripts (a macro, so that `concat!` can prepend them).
macro_rules! lua_prelude {
    () => {
        r#"
-- Keys that outlive a request (leases, held reservations, the daily counter) are
-- kept two days after their last write.
local KEEP = 172800000
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
-- GCRA: a bucket of `lim` units a minute at `now` is its theoretical arrival time
-- (`now` when full). Written with another limit, it keeps its level (units) clamped
-- to the new size: owed' = max(owed + lim - was, 0).
local function tat_of(key, lim, now)
  local v = redis.call('HMGET', key, 'tat', 'lim')
  local tat, was = tonumber(v[1]), tonumber(v[2])
  if not tat or tat <= now then return now end
  if was and was > 0 and was ~= lim then
    local owed = (tat - now) * was / 60000
    return now + math.max(owed + lim - was, 0) * 60000 / lim
  end
  return tat
end
-- Stores a bucket; a full one needs no key. The key lapses once the bucket is full.
local function put(key, lim, tat, now)
  if tat <= now then
    redis.call('DEL', key)
  else
    redis.call('HSET', key, 'tat', string.format('%.3f', tat), 'lim', lim)
    redis.call('PEXPIRE', key, math.ceil(tat - now) + 1000)
  end
end
-- Milliseconds until `n` units fit (0: now); a micro-ms of slack absorbs rounding.
local function wait_for(tat, lim, n, now)
  local w = tat + n * 60000 / lim - now - 60000
  if w <= 0.001 then return 0 end
  return w
end
-- Today's UTC day number, and whether the daily counter at `key` holds it.
local function daily_is_today(key)
  local day = math.floor(now_ms() / 86400000)
  return tonumber(redis.call('HGET', key, 'day')) == day, day
end
-- Ends a lease's daily reservation unsettled: charged in full to its own day.
local function charge_held(held, daily, id)
  local h = redis.call('HGET', held, id)
  if not h then return end
  redis.call('HDEL', held, id)
  local day, n = string.match(h, '^(%d+):(%d+)$')
  if tonumber(redis.call('HGET', daily, 'day')) == tonumber(day) then
    redis.call('HINCRBY', daily, 'reserved', -tonumber(n))
    redis.call('HINCRBY', daily, 'used', tonumber(n))
  end
end
"#
    };
}

/// Phase 1. KEYS: leases, held, daily, requests. ARGV: max concurrent, requests per
/// minute, lease id, lease ttl (ms), requests taken (a batch's items). Returns {0, inflight} | {1, inflight}
/// (concurrency) | {2, wait ms} (requests/minute).
const ADMIT: &str = concat!(
    lua_prelude!(),
    r#"
local now = now_ms()
local maxc, rpm, ttl, n = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4]), tonumber(ARGV[5])
-- Leases not refreshed in time belong to dead gateways: end them unsettled.
local lapsed = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)
if #lapsed > 0 then
  for _, id in ipairs(lapsed) do charge_held(KEYS[2], KEYS[3], id) end
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
end
local inflight = redis.call('ZCARD', KEYS[1])
if maxc > 0 and inflight >= maxc then return {1, inflight} end
if rpm > 0 then
  local tat = tat_of(KEYS[4], rpm, now)
  local w = wait_for(tat, rpm, n, now)
  -- Refused: still store the bucket at the current limit, so a raised limit
  -- refills at its new rate from now on (as the local bucket does).
  if w > 0 then put(KEYS[4], rpm, tat, now) return {2, math.ceil(w)} end
  put(KEYS[4], rpm, tat + n * 60000 / rpm, now)
else
  -- Unlimited: a later limit starts full.
  redis.call('DEL', KEYS[4])
end
-- Counted whatever the limit, so that a limit change keeps counting it.
redis.call('ZADD', KEYS[1], now + ttl, ARGV[3])
redis.call('PEXPIRE', KEYS[1], KEEP)
return {0, inflight + 1}
"#
);

/// Phase 2. KEYS: leases, held, daily, requests, input, output. ARGV: lease id,
/// requests/minute, input/minute, output/minute, daily tokens, prompt tokens, max
/// tokens, requests taken in phase 1. Returns {0, day, 0, 0} | {3 or 4, wait ms or -1 (never), 0, 0} (input or
/// output tokens) | {5, used, reserved, ms to the next UTC day} (daily quota). A
/// refusal gives back the requests of phase 1 and ends the lease.
const RESERVE: &str = concat!(
    lua_prelude!(),
    r#"
local now = now_ms()
local id = ARGV[1]
local rpm, dlim, nreq = tonumber(ARGV[2]), tonumber(ARGV[5]), tonumber(ARGV[8])
local day = math.floor(now / 86400000)
local function refuse(code, a, b, c)
  if rpm > 0 then
    put(KEYS[4], rpm, math.max(tat_of(KEYS[4], rpm, now) - nreq * 60000 / rpm, now), now)
  end
  redis.call('ZREM', KEYS[1], id)
  return {code, a, b, c}
end
local buckets = {
  {KEYS[5], tonumber(ARGV[3]), tonumber(ARGV[6]), 3},
  {KEYS[6], tonumber(ARGV[4]), tonumber(ARGV[7]), 4},
}
-- Check everything first, then take everything: all or nothing.
for _, b in ipairs(buckets) do
  local key, lim, n = b[1], b[2], b[3]
  if lim == 0 then
    redis.call('DEL', key)
  elseif n > 0 then
    b[5] = tat_of(key, lim, now)
    -- Stored at the current limit even when refused (see ADMIT).
    if n > lim then put(key, lim, b[5], now) return refuse(b[4], -1, 0, 0) end
    local w = wait_for(b[5], lim, n, now)
    if w > 0 then put(key, lim, b[5], now) return refuse(b[4], math.ceil(w), 0, 0) end
  end
end
local need = tonumber(ARGV[6]) + tonumber(ARGV[7])
local used, reserved = 0, 0
local today = false
if dlim > 0 then
  local d = redis.call('HMGET', KEYS[3], 'day', 'used', 'reserved')
  today = tonumber(d[1]) == day
  if today then used, reserved = tonumber(d[2]) or 0, tonumber(d[3]) or 0 end
  if used + reserved + need > dlim then
    return refuse(5, used, reserved, (day + 1) * 86400000 - now)
  end
end
for _, b in ipairs(buckets) do
  if b[5] then put(b[1], b[2], b[5] + b[3] * 60000 / b[2], now) end
end
if dlim > 0 then
  -- A new day starts at 0, as the local counter does (the ledger loads first).
  if not today then redis.call('HSET', KEYS[3], 'day', day, 'used', 0, 'reserved', 0) end
  redis.call('HINCRBY', KEYS[3], 'reserved', need)
  redis.call('PEXPIRE', KEYS[3], KEEP)
  redis.call('HSET', KEYS[2], id, day .. ':' .. need)
  redis.call('PEXPIRE', KEYS[2], KEEP)
end
return {0, day, 0, 0}
"#
);

/// End of a request. KEYS: leases, held, daily, input, output. ARGV: lease id, input
/// tokens back, output tokens back, tokens used (charged up to the reservation).
const SETTLE: &str = concat!(
    lua_prelude!(),
    r#"
local now = now_ms()
local id = ARGV[1]
redis.call('ZREM', KEYS[1], id)
for i, key in ipairs({KEYS[4], KEYS[5]}) do
  local back = tonumber(ARGV[i + 1])
  if back > 0 then
    -- Given back at the bucket's current limit, clamped to a full bucket.
    local v = redis.call('HMGET', key, 'tat', 'lim')
    local tat, lim = tonumber(v[1]), tonumber(v[2])
    if tat and lim and lim > 0 and tat > now then
      put(key, lim, math.max(tat - back * 60000 / lim, now), now)
    end
  end
end
-- Missing when the lease lapsed first (then charged in full already).
local h = redis.call('HGET', KEYS[2], id)
if h then
  redis.call('HDEL', KEYS[2], id)
  local day, n = string.match(h, '^(%d+):(%d+)$')
  if tonumber(redis.call('HGET', KEYS[3], 'day')) == tonumber(day) then
    redis.call('HINCRBY', KEYS[3], 'reserved', -tonumber(n))
    redis.call('HINCRBY', KEYS[3], 'used', math.min(tonumber(ARGV[4]), tonumber(n)))
  end
end
return 0
"#
);

/// An admission or reservation ended without a settle. KEYS: leases, held, daily.
/// ARGV: lease id.
const RELEASE: &str = concat!(
    lua_prelude!(),
    r#"
redis.call('ZREM', KEYS[1], ARGV[1])
charge_held(KEYS[2], KEYS[3], ARGV[1])
return 0
"#
);

/// KEYS: leases. ARGV: lease ttl (ms), lease ids. `XX`: a lease already ended (or
/// lapsed and charged) is not brought back.
const REFRESH: &str = concat!(
    lua_prelude!(),
    r#"
local exp = now_ms() + tonumber(ARGV[1])
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', exp, ARGV[i]) end
return 0
"#
);

/// KEYS: daily. 1 when today's counter is not there yet (neither loaded nor started
/// by a reservation).
const NEEDS_DAILY: &str = concat!(
    lua_prelude!(),
    r#"
if daily_is_today(KEYS[1]) then return 0 end
return 1
"#
);

/// KEYS: daily. ARGV: tokens used today per the ledger. The first load of a day wins.
const SET_DAILY: &str = concat!(
    lua_prelude!(),
    r#"
local today, day = daily_is_today(KEYS[1])
if today then return 0 end
redis.call('HSET', KEYS[1], 'day', day, 'used', ARGV[1], 'reserved', 0)
redis.call('PEXPIRE', KEYS[1], KEEP)
return 1
"#
);

struct Scripts {
    admit: Script,
    reserve: Script,
    settle: Script,
    release: Script,
    refresh: Script,
    needs_daily: Script,
    set_daily: Script,
}

/// A Redis call failed or timed out (already logged and counted).
#[derive(Debug)]
pub(super) struct Down {
    /// Whether the command may have reached Redis (and run) before the failure;
    /// false when no connection could be made.
    pub(super) sent: bool,
}

/// The keys of one tenant; `{id}` is the Redis Cluster hash tag.
struct Keys(String);

impl Keys {
    fn new(tenant: &str) -> Self {
        Self(format!("tessera:{{{tenant}}}:"))
    }

    fn of(&self, what: &str) -> String {
        format!("{}{what}", self.0)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

/// The Redis side of one limiter: connection, scripts, the leases this process holds
/// (for the refresher) and counters.
pub(super) struct Shared {
    pub(super) cfg: SharedLimits,
    client: Client,
    /// The live connection (multiplexed: cloned per call) and its generation, so a
    /// failed call only drops the connection it used.
    conn: Mutex<Option<(u64, MultiplexedConnection)>>,
    /// Serializes reconnects; holds the last generation.
    connecting: tokio::sync::Mutex<u64>,
    scripts: Scripts,
    /// Lease ids held by this process, per tenant.
    leases: Mutex<HashMap<Arc<str>, HashSet<String>>>,
    errors: AtomicU64,
    fallbacks: AtomicU64,
    /// Background settles and releases not finished yet, and their wake-up.
    pending: AtomicUsize,
    idle: tokio::sync::Notify,
    refresher: Mutex<Option<tokio::task::AbortHandle>>,
    /// Unix ms of the last warning (warnings are rate-limited to one a second).
    last_warn: AtomicI64,
}

impl Shared {
    pub(super) fn new(cfg: SharedLimits) -> Result<Self, String> {
        if cfg.lease_ttl < Duration::from_millis(3) {
            return Err(format!("lease_ttl {:?} is too short", cfg.lease_ttl));
        }
        if cfg.timeout.is_zero() {
            return Err("timeout must not be 0".into());
        }
        // Parses the URL; connects at the first call.
        let client = Client::open(cfg.url.as_str()).map_err(|e| e.to_string())?;
        Ok(Self {
            cfg,
            client,
            conn: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(0),
            scripts: Scripts {
                admit: Script::new(ADMIT),
                reserve: Script::new(RESERVE),
                settle: Script::new(SETTLE),
                release: Script::new(RELEASE),
                refresh: Script::new(REFRESH),
                needs_daily: Script::new(NEEDS_DAILY),
                set_daily: Script::new(SET_DAILY),
            },
            leases: Mutex::new(HashMap::new()),
            errors: AtomicU64::new(0),
            fallbacks: AtomicU64::new(0),
            pending: AtomicUsize::new(0),
            idle: tokio::sync::Notify::new(),
            refresher: Mutex::new(None),
            last_warn: AtomicI64::new(i64::MIN),
        })
    }

    pub(super) fn errors(&self) -> u64 {
        self.errors.load(Ordering::Relaxed)
    }

    pub(super) fn fallbacks(&self) -> u64 {
        self.fallbacks.load(Ordering::Relaxed)
    }

    pub(super) fn count_fallback(&self) {
        self.fallbacks.fetch_add(1, Ordering::Relaxed);
    }

    /// Leases of tenant `id` this process holds.
    pub(super) fn held(&self, id: &str) -> u32 {
        lock(&self.leases)
            .get(id)
            .map_or(0, |s| u32::try_from(s.len()).unwrap_or(u32::MAX))
    }

    async fn connection(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        if let Some(c) = lock(&self.conn).clone() {
            return Ok(c);
        }
        let mut generation = self.connecting.lock().await;
        if let Some(c) = lock(&self.conn).clone() {
            return Ok(c); // Another call reconnected meanwhile.
        }
        let config = AsyncConnectionConfig::new()
            .set_connection_timeout(Some(self.cfg.timeout))
            .set_response_timeout(Some(self.cfg.timeout));
        let c = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        *generation += 1;
        *lock(&self.conn) = Some((*generation, c.clone()));
        Ok((*generation, c))
    }

    /// Runs `f` on the connection within the timeout; `Err` carries the reason and
    /// whether the command may have been sent.
    async fn try_call<T, F, Fut>(&self, f: F) -> Result<T, (String, bool)>
    where
        F: FnOnce(MultiplexedConnection) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        let mut used = None;
        let res = tokio::time::timeout(self.cfg.timeout, async {
            let (generation, c) = self.connection().await?;
            used = Some(generation);
            f(c).await
        })
        .await;
        let reason = match res {
            Ok(Ok(v)) => return Ok(v),
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {:?}", self.cfg.timeout),
        };
        // Reconnect at the next call: the connection may be broken or half-open.
        if let Some(generation) = used {
            let mut c = lock(&self.conn);
            if c.as_ref().is_some_and(|(g, _)| *g == generation) {
                *c = None;
            }
        }
        Err((reason, used.is_some()))
    }

    /// [`Self::try_call`], counting and logging a failure.
    async fn call<T, F, Fut>(&self, what: &'static str, f: F) -> Result<T, Down>
    where
        F: FnOnce(MultiplexedConnection) -> Fut,
        Fut: Future<Output = RedisResult<T>>,
    {
        self.try_call(f).await.map_err(|(reason, sent)| {
            let errors = self.errors.fetch_add(1, Ordering::Relaxed) + 1;
            // One warning a second at most: an outage fails every request.
            let now = crate::now_ms();
            let last = self.last_warn.load(Ordering::Relaxed);
            if now.saturating_sub(last) >= 1000
                && self
                    .last_warn
                    .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                    .is_ok()
            {
                tracing::warn!(
                    call = what,
                    error = %reason,
                    errors,
                    on_failure = self.cfg.on_failure.label(),
                    "shared limits: Redis call failed"
                );
            }
            Down { sent }
        })
    }

    /// PING within the timeout (not counted as a backend error).
    pub(super) async fn ping(&self) -> bool {
        self.try_call(|mut c| async move { redis::cmd("PING").query_async::<String>(&mut c).await })
            .await
            .is_ok()
    }

    /// Starts the lease refresher (once; needs a tokio runtime, as every caller of
    /// the async API has). It holds the backend weakly and is aborted when the
    /// [`Limiter`](super::Limiter) drops.
    fn ensure_refresher(self: &Arc<Self>) {
        let mut r = lock(&self.refresher);
        if r.is_some() {
            return;
        }
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let weak: Weak<Self> = Arc::downgrade(self);
        let every = self.cfg.lease_ttl / 3;
        let task = rt.spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await; // The first tick is immediate.
            loop {
                tick.tick().await;
                let Some(s) = weak.upgrade() else { break };
                s.refresh().await;
            }
        });
        *r = Some(task.abort_handle());
    }

    pub(super) fn stop_refresher(&self) {
        if let Some(r) = lock(&self.refresher).take() {
            r.abort();
        }
    }

    /// Pushes back the expiry of every lease this process holds.
    async fn refresh(&self) {
        let groups: Vec<(String, Vec<String>)> = lock(&self.leases)
            .iter()
            .filter(|(_, ids)| !ids.is_empty())
            .map(|(t, ids)| (Keys::new(t).of("leases"), ids.iter().cloned().collect()))
            .collect();
        let ttl = millis(self.cfg.lease_ttl);
        let script = &self.scripts.refresh;
        futures_util::future::join_all(groups.iter().map(|(key, ids)| {
            self.call("refresh", move |mut c| async move {
                script
                    .key(key)
                    .arg(ttl)
                    .arg(ids.as_slice())
                    .invoke_async::<i64>(&mut c)
                    .await
            })
        }))
        .await;
    }

    fn track(&self, tenant: &Arc<str>, id: &str) {
        lock(&self.leases)
            .entry(tenant.clone())
            .or_default()
            .insert(id.to_owned());
    }

    fn untrack(&self, tenant: &str, id: &str) {
        let mut leases = lock(&self.leases);
        if let Some(ids) = leases.get_mut(tenant) {
            ids.remove(id);
            if ids.is_empty() {
                leases.remove(tenant);
            }
        }
    }

    /// Runs `f` on a tokio task (settles and releases happen in `Drop` and in
    /// synchronous calls); [`Self::flush`] waits for it.
    fn background<F, Fut>(self: &Arc<Self>, what: &'static str, f: F)
    where
        F: FnOnce(Arc<Self>) -> Fut + Send + 'static,
        Fut: Future<Output = ()> + Send + 'static,
    {
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                self.pending.fetch_add(1, Ordering::AcqRel);
                // Counted down when the task ends, or is dropped unrun (runtime
                // shutting down), so that `flush` cannot wait forever.
                let done = PendingGuard(self.clone());
                let s = self.clone();
                rt.spawn(async move {
                    let _done = done;
                    f(s).await;
                });
            }
            Err(_) => {
                // Outside a runtime the lease can only lapse (it is no longer
                // refreshed): within lease_ttl, charged in full.
                self.errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    call = what,
                    "shared limits: no tokio runtime to reach Redis"
                );
            }
        }
    }

    /// Waits until every background settle and release has finished.
    pub(super) async fn flush(&self) {
        loop {
            let notified = std::pin::pin!(self.idle.notified());
            let mut notified = notified;
            notified.as_mut().enable();
            if self.pending.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }

    /// Phase 1: takes a lease and `n` requests (or refuses).
    pub(super) async fn admit(
        self: &Arc<Self>,
        tenant: &str,
        limits: Limits,
        n: u32,
    ) -> Result<Result<Lease, LimitError>, Down> {
        self.ensure_refresher();
        let keys = Keys::new(tenant);
        let id = crate::random_hex(12);
        let (leases, held, daily, rpm) = (
            keys.of("leases"),
            keys.of("held"),
            keys.of("daily"),
            keys.of("rpm"),
        );
        let script = &self.scripts.admit;
        let (lid, ttl) = (id.as_str(), millis(self.cfg.lease_ttl));
        let reply: Result<Vec<i64>, Down> = self
            .call("admit", |mut c| async move {
                script
                    .key(&leases)
                    .key(&held)
                    .key(&daily)
                    .key(&rpm)
                    .arg(limits.max_concurrent)
                    .arg(limits.requests_per_minute)
                    .arg(lid)
                    .arg(ttl)
                    .arg(n)
                    .invoke_async(&mut c)
                    .await
            })
            .await;
        let tenant: Arc<str> = tenant.into();
        let mut lease = Lease {
            shared: self.clone(),
            tenant,
            id,
            open: true,
        };
        let reply = match reply {
            Ok(r) => r,
            Err(down) => {
                // Had the script run before the answer was lost, `lease` dropping
                // here releases it.
                lease.open = down.sent;
                return Err(down);
            }
        };
        Ok(match reply.as_slice() {
            [0, ..] => {
                self.track(&lease.tenant, &lease.id);
                Ok(lease)
            }
            [1, inflight, ..] => {
                lease.open = false;
                Err(concurrency_error(
                    u32::try_from(*inflight).unwrap_or(u32::MAX),
                    limits.max_concurrent,
                ))
            }
            [2, wait, ..] => {
                lease.open = false;
                Err(requests_error(
                    n,
                    limits.requests_per_minute,
                    Some(Duration::from_millis((*wait).max(0) as u64)),
                ))
            }
            other => {
                tracing::warn!(reply = ?other, "shared limits: unexpected admit reply");
                self.errors.fetch_add(1, Ordering::Relaxed);
                return Err(Down { sent: true });
            }
        })
    }
}

/// One background task of [`Shared::background`] not finished yet.
struct PendingGuard(Arc<Shared>);

impl Drop for PendingGuard {
    fn drop(&mut self) {
        if self.0.pending.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.idle.notify_waiters();
        }
    }
}

/// A concurrency lease in Redis, held by this process (refreshed until it ends).
/// Dropped while open, it is released in the background, and a daily reservation
/// it made is charged in full.
pub(super) struct Lease {
    shared: Arc<Shared>,
    tenant: Arc<str>,
    id: String,
    /// Still to be released in Redis.
    open: bool,
}

impl Lease {
    pub(super) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Phase 2 for this lease; on a refusal Redis has ended the lease.
    pub(super) async fn reserve(
        &mut self,
        limits: Limits,
        requests: u32,
        input: u32,
        output: u32,
    ) -> Result<Result<(), LimitError>, Down> {
        let keys = Keys::new(&self.tenant);
        let k = [
            keys.of("leases"),
            keys.of("held"),
            keys.of("daily"),
            keys.of("rpm"),
            keys.of("itpm"),
            keys.of("otpm"),
        ];
        let script = &self.shared.scripts.reserve;
        let id = self.id.as_str();
        let reply: Vec<i64> = self
            .shared
            .call("reserve", |mut c| async move {
                script
                    .key(k.as_slice())
                    .arg(id)
                    .arg(limits.requests_per_minute)
                    .arg(limits.input_tokens_per_minute)
                    .arg(limits.output_tokens_per_minute)
                    .arg(limits.daily_tokens)
                    .arg(input)
                    .arg(output)
                    .arg(requests)
                    .invoke_async(&mut c)
                    .await
            })
            .await?;
        let refused = match reply.as_slice() {
            [0, ..] => return Ok(Ok(())),
            [code @ (3 | 4), wait, ..] => {
                let (kind, n, cap) = if *code == 3 {
                    (
                        LimitKind::InputTokens,
                        input,
                        limits.input_tokens_per_minute,
                    )
                } else {
                    (
                        LimitKind::OutputTokens,
                        output,
                        limits.output_tokens_per_minute,
                    )
                };
                let wait = (*wait >= 0).then(|| Duration::from_millis(*wait as u64));
                tokens_error(kind, n, cap, wait)
            }
            [5, used, reserved, ms_left] => daily_error(
                *used,
                *reserved,
                i64::from(input) + i64::from(output),
                limits.daily_tokens as i64,
                *ms_left,
            ),
            other => {
                tracing::warn!(reply = ?other, "shared limits: unexpected reserve reply");
                self.shared.errors.fetch_add(1, Ordering::Relaxed);
                return Err(Down { sent: true });
            }
        };
        self.open = false;
        Ok(Err(refused))
    }

    /// Ends the request: `back_*` tokens back to the buckets, `used` charged against
    /// the daily reservation (at most what it reserved).
    pub(super) fn settle(mut self, back_in: u32, back_out: u32, used: i64) {
        self.open = false;
        let (tenant, id) = (self.tenant.clone(), self.id.clone());
        self.shared.background("settle", move |s| async move {
            let keys = Keys::new(&tenant);
            let k = [
                keys.of("leases"),
                keys.of("held"),
                keys.of("daily"),
                keys.of("itpm"),
                keys.of("otpm"),
            ];
            let script = &s.scripts.settle;
            let _ = s
                .call("settle", |mut c| async move {
                    script
                        .key(k.as_slice())
                        .arg(&id)
                        .arg(back_in)
                        .arg(back_out)
                        .arg(used)
                        .invoke_async::<i64>(&mut c)
                        .await
                })
                .await;
        });
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        // Stop refreshing now: if the release below is lost, the lease lapses.
        self.shared.untrack(&self.tenant, &self.id);
        if !self.open {
            return;
        }
        let (tenant, id) = (self.tenant.clone(), std::mem::take(&mut self.id));
        self.shared.background("release", move |s| async move {
            let keys = Keys::new(&tenant);
            let k = [keys.of("leases"), keys.of("held"), keys.of("daily")];
            let script = &s.scripts.release;
            let _ = s
                .call("release", |mut c| async move {
                    script
                        .key(k.as_slice())
                        .arg(&id)
                        .invoke_async::<i64>(&mut c)
                        .await
                })
                .await;
        });
    }
}

impl Shared {
    /// Whether today's counter of `tenant` must be loaded from the ledger.
    pub(super) async fn needs_daily(&self, tenant: &str) -> Result<bool, Down> {
        let key = Keys::new(tenant).of("daily");
        let script = &self.scripts.needs_daily;
        self.call("needs_daily", |mut c| async move {
            script.key(&key).invoke_async::<i64>(&mut c).await
        })
        .await
        .map(|n| n == 1)
    }

    /// Loads today's used tokens of `tenant` (the first load of a day wins).
    pub(super) async fn set_daily_used(&self, tenant: &str, used: i64) -> Result<(), Down> {
        let key = Keys::new(tenant).of("daily");
        let script = &self.scripts.set_daily;
        self.call("set_daily_used", |mut c| async move {
            script.key(&key).arg(used).invoke_async::<i64>(&mut c).await
        })
        .await
        .map(drop)
    }

    /// The configured failure mode.
    pub(super) fn on_failure(&self) -> FailMode {
        self.cfg.on_failure
    }
}
