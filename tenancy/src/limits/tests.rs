//! Tests of the in-memory limiter (the Redis backend's are in `tests/redis_limits.rs`).

use super::*;

/// Phases 1 and 2 of one request of tenant `id` on `l`: admitted, then `input` and
/// `output` tokens reserved. Panics if phase 1 refuses.
async fn admit_and_reserve(
    l: &Limiter,
    id: &str,
    lim: Limits,
    input: u32,
    output: u32,
) -> Result<Reservation, LimitError> {
    l.admit(id, lim).await.unwrap().reserve(input, output).await
}

const DAY0: i64 = 1_767_225_600_000; // 2026-01-01T00:00:00Z

fn at(base: Instant, secs: f64) -> Now {
    Now {
        at: base + Duration::from_secs_f64(secs),
        ms: DAY0 + (secs * 1000.0) as i64,
    }
}

#[test]
fn requests_per_minute_refill_and_isolation() {
    let l = Limiter::new();
    let t0 = Instant::now();
    let lim = Limits {
        requests_per_minute: 2,
        ..Limits::UNLIMITED
    };
    assert!(l.admit_at("a", lim, 1, at(t0, 0.0)).is_ok());
    assert!(l.admit_at("a", lim, 1, at(t0, 0.0)).is_ok());
    let e = l.admit_at("a", lim, 1, at(t0, 0.0)).unwrap_err();
    assert_eq!(e.kind, LimitKind::Requests);
    assert!(e.retryable);
    assert_eq!(e.retry_after, Duration::from_secs(30));
    // Half a minute later one request's worth has refilled, not two.
    assert!(l.admit_at("a", lim, 1, at(t0, 30.0)).is_ok());
    assert!(l.admit_at("a", lim, 1, at(t0, 30.0)).is_err());
    // Another tenant with the same limits is unaffected.
    assert!(l.admit_at("b", lim, 1, at(t0, 0.0)).is_ok());
}

/// A batch of `n` items takes `n` requests and one slot, all or nothing; a
/// phase-2 refusal gives all `n` back; more than the limit never fits.
#[test]
fn admit_many_takes_n_requests_and_one_slot() {
    let l = Limiter::new();
    let t0 = Instant::now();
    let lim = Limits {
        requests_per_minute: 4,
        max_concurrent: 2,
        daily_tokens: 10,
        ..Limits::UNLIMITED
    };
    let a = l.admit_at("a", lim, 3, at(t0, 0.0)).unwrap();
    assert_eq!(l.inflight("a"), 1, "one slot for the whole batch");
    let e = l.admit_at("a", lim, 2, at(t0, 0.0)).unwrap_err();
    assert_eq!(e.kind, LimitKind::Requests);
    assert!(e.retryable);
    // Refused in phase 2 (daily quota): the three requests come back.
    assert_eq!(
        a.reserve_at(5, 6, at(t0, 0.0)).unwrap_err().kind,
        LimitKind::DailyQuota
    );
    assert_eq!(l.inflight("a"), 0);
    let b = l.admit_at("a", lim, 4, at(t0, 0.0)).unwrap();
    drop(b);
    let e = l.admit_at("a", lim, 5, at(t0, 59.0)).unwrap_err();
    assert_eq!(e.kind, LimitKind::Requests);
    assert!(!e.retryable, "5 requests never fit a limit of 4/minute");
}

#[tokio::test]
async fn concurrency_slot_released_on_drop_of_each_guard() {
    let l = Limiter::new();
    let lim = Limits {
        max_concurrent: 1,
        ..Limits::UNLIMITED
    };
    let a = l.admit("a", lim).await.unwrap();
    assert_eq!(l.inflight("a"), 1);
    assert_eq!(
        l.admit("a", lim).await.unwrap_err().kind,
        LimitKind::Concurrency
    );
    drop(a);
    assert_eq!(l.inflight("a"), 0);
    let r = admit_and_reserve(&l, "a", lim, 1, 1).await.unwrap();
    assert_eq!(l.inflight("a"), 1);
    drop(r);
    assert_eq!(l.inflight("a"), 0);
    let r = admit_and_reserve(&l, "a", lim, 1, 1).await.unwrap();
    r.settle(1, 1);
    assert_eq!(l.inflight("a"), 0);
}

#[tokio::test]
async fn changing_limits_keeps_the_inflight_count() {
    let l = Limiter::new();
    let one = Limits {
        max_concurrent: 1,
        ..Limits::UNLIMITED
    };
    let running = l.admit("a", one).await.unwrap();
    // New limits (rpm added, still one at a time): the running request counts.
    let changed = Limits {
        requests_per_minute: 100,
        ..one
    };
    assert_eq!(
        l.admit("a", changed).await.unwrap_err().kind,
        LimitKind::Concurrency
    );
    // Raised to two: exactly one more fits.
    let two = Limits {
        max_concurrent: 2,
        ..changed
    };
    let second = l.admit("a", two).await.unwrap();
    assert_eq!(
        l.admit("a", two).await.unwrap_err().kind,
        LimitKind::Concurrency
    );
    assert_eq!(l.inflight("a"), 2);
    drop((running, second));
    assert_eq!(l.inflight("a"), 0);
}

#[test]
fn token_limits_and_oversized_requests() {
    let l = Limiter::new();
    let t0 = Instant::now();
    let lim = Limits {
        input_tokens_per_minute: 100,
        output_tokens_per_minute: 50,
        ..Limits::UNLIMITED
    };
    let adm = |n| l.admit_at("a", lim, 1, at(t0, n)).unwrap();
    let e = adm(0.0).reserve_at(101, 1, at(t0, 0.0)).unwrap_err();
    assert_eq!((e.kind, e.retryable), (LimitKind::InputTokens, false));
    let e = adm(0.0).reserve_at(1, 51, at(t0, 0.0)).unwrap_err();
    assert_eq!((e.kind, e.retryable), (LimitKind::OutputTokens, false));
    let r = adm(0.0).reserve_at(60, 10, at(t0, 0.0)).unwrap();
    let e = adm(0.0).reserve_at(60, 10, at(t0, 0.0)).unwrap_err();
    assert_eq!((e.kind, e.retryable), (LimitKind::InputTokens, true));
    // 20 more input tokens are missing: 12 s at 100/minute.
    assert_eq!(e.retry_after, Duration::from_secs(12));
    // Settling below the reservation gives the rest back: the output bucket
    // held 10, used 2, so 48 of 50 are available again.
    r.settle(60, 2);
    assert!(adm(0.0).reserve_at(1, 48, at(t0, 0.0)).is_ok());
}

#[test]
fn a_refusal_in_phase_two_gives_back_the_request_and_the_slot() {
    let l = Limiter::new();
    let t0 = Instant::now();
    let lim = Limits {
        requests_per_minute: 1,
        input_tokens_per_minute: 10,
        max_concurrent: 1,
        ..Limits::UNLIMITED
    };
    let a = l.admit_at("a", lim, 1, at(t0, 0.0)).unwrap();
    assert_eq!(
        a.reserve_at(11, 1, at(t0, 0.0)).unwrap_err().kind,
        LimitKind::InputTokens
    );
    assert_eq!(l.inflight("a"), 0);
    // The one request of this minute is still there.
    let a = l.admit_at("a", lim, 1, at(t0, 0.0)).unwrap();
    assert!(a.reserve_at(5, 1, at(t0, 0.0)).is_ok());
}

#[tokio::test]
async fn daily_quota_is_reserved_at_admission_and_settled_exactly() {
    let l = Limiter::new();
    let lim = Limits {
        daily_tokens: 100,
        ..Limits::UNLIMITED
    };
    assert!(l.needs_daily("a", lim).await);
    l.set_daily_used("a", lim, 40).await;
    assert!(!l.needs_daily("a", lim).await);
    // A later load of the same day is ignored (first load wins).
    l.set_daily_used("a", lim, 0).await;
    assert_eq!(l.daily("a").unwrap().used, 40);
    // Two requests of 30 reserved: 40 + 60 = 100 fits exactly; a third does not.
    let r1 = admit_and_reserve(&l, "a", lim, 10, 20).await.unwrap();
    let r2 = admit_and_reserve(&l, "a", lim, 10, 20).await.unwrap();
    assert_eq!(l.daily("a").unwrap().reserved, 60);
    let e = admit_and_reserve(&l, "a", lim, 1, 0).await.unwrap_err();
    assert_eq!(e.kind, LimitKind::DailyQuota);
    // It would fit once the others settle below their reservations: retry soon.
    assert!(e.retryable);
    assert_eq!(l.inflight("a"), 2);
    r1.settle(10, 5);
    let d = l.daily("a").unwrap();
    assert_eq!((d.used, d.reserved), (55, 30));
    // Cancelled: nothing charged.
    r2.cancel();
    let d = l.daily("a").unwrap();
    assert_eq!((d.used, d.reserved), (55, 0));
    // Dropped unsettled: the whole reservation is charged.
    drop(
        l.admit("a", lim)
            .await
            .unwrap()
            .reserve(10, 10)
            .await
            .unwrap(),
    );
    let d = l.daily("a").unwrap();
    assert_eq!((d.used, d.reserved), (75, 0));
    // More than what is left today, with nothing in flight: not before tomorrow.
    let e = admit_and_reserve(&l, "a", lim, 20, 10).await.unwrap_err();
    assert_eq!((e.kind, e.retryable), (LimitKind::DailyQuota, false));
    assert!(e.retry_after >= Duration::from_secs(1));
    assert_eq!(l.inflight("a"), 0);
}

#[test]
fn a_new_day_starts_at_zero_and_old_reservations_settle_into_their_day() {
    let l = Limiter::new();
    let t0 = Instant::now();
    let lim = Limits {
        daily_tokens: 100,
        ..Limits::UNLIMITED
    };
    let r = l
        .admit_at("a", lim, 1, at(t0, 0.0))
        .unwrap()
        .reserve_at(50, 50, at(t0, 0.0))
        .unwrap();
    let next_day = at(t0, 86_400.0);
    let r2 = l
        .admit_at("a", lim, 1, next_day)
        .unwrap()
        .reserve_at(50, 50, next_day)
        .unwrap();
    r.settle(50, 50);
    let d = l.daily("a").unwrap();
    assert_eq!((d.day, d.used, d.reserved), (utc_day(next_day.ms), 0, 100));
    drop(r2);
}

#[test]
fn usage_queries_have_their_own_bucket() {
    let l = Limiter::new();
    let t0 = Instant::now();
    let lim = Limits {
        requests_per_minute: 1,
        ..Limits::UNLIMITED
    };
    assert!(l.usage_query_at("a", lim, 2, at(t0, 0.0)).is_ok());
    assert!(l.usage_query_at("a", lim, 2, at(t0, 0.0)).is_ok());
    let e = l.usage_query_at("a", lim, 2, at(t0, 0.0)).unwrap_err();
    assert_eq!(e.kind, LimitKind::UsageQueries);
    // Inference is counted apart.
    assert!(l.admit_at("a", lim, 1, at(t0, 0.0)).is_ok());
    assert!(l.usage_query_at("a", lim, 2, at(t0, 30.0)).is_ok());
}

#[tokio::test]
async fn unlimited_means_unlimited() {
    let l = Limiter::new();
    for _ in 0..1000 {
        let r = admit_and_reserve(&l, "a", Limits::UNLIMITED, 1000, 1000).await;
        r.unwrap().settle(1000, 1000);
    }
    assert_eq!(l.inflight("a"), 0);
    assert_eq!(l.daily("a"), None);
}
