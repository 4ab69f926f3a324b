//! Limits shared through a real Redis server ([`tessera_tenancy::testing::RedisServer`]):
//! each test runs two or three [`Limiter::shared`] instances on one server, as
//! separate gateways would. Tenants get random ids, so a shared server
//! (`TESSERA_TEST_REDIS_URL`) may hold keys of earlier runs.

use std::time::{Duration, Instant};
use tessera_tenancy::testing::RedisServer;
use tessera_tenancy::{
    FailMode, LimitError, LimitKind, Limiter, Limits, Reservation, SharedLimits,
};

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

fn tenant() -> String {
    format!("t-{}", tessera_tenancy::random_hex(8))
}

fn gateway(url: &str) -> Limiter {
    Limiter::shared(SharedLimits::new(url)).unwrap()
}

fn gateway_with(url: &str, f: impl FnOnce(&mut SharedLimits)) -> Limiter {
    let mut cfg = SharedLimits::new(url);
    f(&mut cfg);
    Limiter::shared(cfg).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_per_minute_are_shared() {
    let (_server, url) = RedisServer::from_env_or_start();
    let gws = [gateway(&url), gateway(&url)];
    let t = tenant();
    let lim = Limits {
        requests_per_minute: 5,
        ..Limits::UNLIMITED
    };
    let mut admitted = 0;
    let mut refusals = Vec::new();
    for i in 0..10 {
        match gws[i % 2].admit(&t, lim).await {
            Ok(a) => {
                assert_eq!(refusals.len(), 0, "admitted after a refusal");
                admitted += 1;
                drop(a);
            }
            Err(e) => refusals.push(e),
        }
    }
    assert_eq!(admitted, 5);
    let e = &refusals[0];
    assert_eq!((e.kind, e.retryable), (LimitKind::Requests, true));
    // One request's worth comes back every 12 s (a little less: time went by).
    assert!(
        e.retry_after > Duration::from_secs(11) && e.retry_after <= Duration::from_secs(12),
        "{e:?}"
    );
    // Another tenant is unaffected.
    assert!(gws[1].admit(&tenant(), lim).await.is_ok());
    assert_eq!(gws[0].backend_errors() + gws[1].backend_errors(), 0);
}

/// An async batch of `n` items (`admit_many`) takes `n` requests and one lease in
/// Redis, all or nothing; a refusal in phase 2 gives all `n` back; more than the
/// limit never fits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_takes_n_shared_requests_and_one_lease() {
    let (_server, url) = RedisServer::from_env_or_start();
    let gws = [gateway(&url), gateway(&url)];
    let t = tenant();
    let lim = Limits {
        requests_per_minute: 5,
        daily_tokens: 10,
        ..Limits::UNLIMITED
    };
    let batch = gws[0].admit_many(&t, lim, 3).await.unwrap();
    assert_eq!(gws[0].inflight(&t), 1, "one lease for the batch");
    let e = gws[1].admit_many(&t, lim, 3).await.unwrap_err();
    assert_eq!((e.kind, e.retryable), (LimitKind::Requests, true));
    // Refused by the daily quota in phase 2: its 3 requests come back.
    let e = batch.reserve(6, 6).await.unwrap_err();
    assert_eq!(e.kind, LimitKind::DailyQuota);
    drop(gws[1].admit_many(&t, lim, 5).await.unwrap());
    assert!(gws[0].admit(&t, lim).await.is_err(), "all 5 spent");
    let e = gws[0].admit_many(&tenant(), lim, 6).await.unwrap_err();
    assert_eq!((e.kind, e.retryable), (LimitKind::Requests, false));
    assert_eq!(gws[0].backend_errors() + gws[1].backend_errors(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrency_is_shared_and_a_drop_frees_a_slot_for_the_other_gateway() {
    let (_server, url) = RedisServer::from_env_or_start();
    let (a, b) = (gateway(&url), gateway(&url));
    let t = tenant();
    let lim = Limits {
        max_concurrent: 3,
        ..Limits::UNLIMITED
    };
    // Racing from both gateways at once: exactly 3 get in.
    let tries = (0..10).map(|i| if i % 2 == 0 { &a } else { &b });
    let results = futures_util::future::join_all(tries.map(|g| g.admit(&t, lim))).await;
    let (held, refused): (Vec<_>, Vec<_>) = results.into_iter().partition(|r| r.is_ok());
    assert_eq!(held.len(), 3);
    for e in refused {
        let e = e.unwrap_err();
        assert_eq!((e.kind, e.retryable), (LimitKind::Concurrency, true), "{e}");
    }
    assert_eq!(a.inflight(&t) + b.inflight(&t), 3);
    drop(held);
    a.flush().await;
    b.flush().await;
    assert_eq!(a.inflight(&t) + b.inflight(&t), 0);

    // In turn: A, B, A get in; then neither gateway admits more.
    let a1 = a.admit(&t, lim).await.unwrap();
    let b1 = b.admit(&t, lim).await.unwrap();
    let a2 = a.admit(&t, lim).await.unwrap();
    for g in [&a, &b] {
        let e = g.admit(&t, lim).await.unwrap_err();
        assert_eq!(e.kind, LimitKind::Concurrency, "{e}");
    }
    assert_eq!((a.inflight(&t), b.inflight(&t)), (2, 1));
    // A's admission ends: its slot is free for B.
    drop(a1);
    a.flush().await;
    let b2 = b.admit(&t, lim).await.expect("the slot A gave back");
    assert_eq!(
        a.admit(&t, lim).await.unwrap_err().kind,
        LimitKind::Concurrency
    );
    drop((a2, b1, b2));
    a.flush().await;
    b.flush().await;
    assert!(a.admit(&t, lim).await.is_ok());
    assert_eq!(a.backend_errors() + b.backend_errors(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_daily_quota_is_shared_and_the_first_load_wins() {
    let (_server, url) = RedisServer::from_env_or_start();
    let (a, b) = (gateway(&url), gateway(&url));
    let t = tenant();
    let lim = Limits {
        daily_tokens: 100,
        ..Limits::UNLIMITED
    };
    assert!(a.needs_daily(&t, lim).await);
    assert!(b.needs_daily(&t, lim).await);
    a.set_daily_used(&t, lim, 0).await;
    assert!(!b.needs_daily(&t, lim).await);
    // A later load of the same day, from any gateway, is ignored.
    b.set_daily_used(&t, lim, 50).await;
    assert!(!a.needs_daily(&t, lim).await);

    let r = admit_and_reserve(&a, &t, lim, 30, 30).await.unwrap();
    assert_eq!(r.reserved_daily(), 60);
    let e = admit_and_reserve(&b, &t, lim, 30, 30).await.unwrap_err();
    // It would fit once A's request settles below its reservation: retry soon.
    assert_eq!((e.kind, e.retryable), (LimitKind::DailyQuota, true), "{e}");
    assert_eq!(e.retry_after, Duration::from_secs(1));
    // A refusal in phase 2 gives the slot back.
    b.flush().await;
    assert_eq!(b.inflight(&t), 0);
    r.settle(10, 10);
    a.flush().await;
    // 20 used: 20 + 60 fits.
    let r = admit_and_reserve(&b, &t, lim, 30, 30).await.unwrap();
    // Dropped unsettled: the whole 60 is charged (80 used).
    drop(r);
    b.flush().await;
    let e = admit_and_reserve(&a, &t, lim, 11, 10).await.unwrap_err();
    // More than what is left today, with nothing in flight: not before tomorrow.
    assert_eq!((e.kind, e.retryable), (LimitKind::DailyQuota, false), "{e}");
    assert!(e.retry_after >= Duration::from_secs(1));
    let r = admit_and_reserve(&a, &t, lim, 10, 10).await.unwrap();
    r.cancel();
    a.flush().await;
    // Cancelled: nothing charged, so exactly the remaining 20 still fit.
    let r = admit_and_reserve(&b, &t, lim, 10, 10).await.unwrap();
    r.settle(10, 10);

    // Another tenant: the first load (40) wins over a later one (0) of the other gateway.
    let t2 = tenant();
    a.set_daily_used(&t2, lim, 40).await;
    b.set_daily_used(&t2, lim, 0).await;
    let _r = admit_and_reserve(&b, &t2, lim, 30, 30).await.unwrap();
    let e = admit_and_reserve(&a, &t2, lim, 1, 0).await.unwrap_err();
    assert_eq!(e.kind, LimitKind::DailyQuota);
    assert_eq!(a.backend_errors() + b.backend_errors(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_gateways_leases_lapse_and_its_reservations_are_charged() {
    let (_server, url) = RedisServer::from_env_or_start();
    let ttl = Duration::from_secs(1);
    let dead = gateway_with(&url, |c| c.lease_ttl = ttl);
    let b = gateway(&url);
    let t = tenant();
    let lim = Limits {
        max_concurrent: 2,
        daily_tokens: 100,
        ..Limits::UNLIMITED
    };
    dead.set_daily_used(&t, lim, 0).await;
    let t0 = Instant::now();
    let running = dead.admit(&t, lim).await.unwrap();
    let reserved = admit_and_reserve(&dead, &t, lim, 20, 20).await.unwrap();
    // The gateway dies: nothing is released, nothing refreshed any more.
    std::mem::forget(running);
    std::mem::forget(reserved);
    drop(dead);
    assert_eq!(
        b.admit(&t, lim).await.unwrap_err().kind,
        LimitKind::Concurrency
    );
    let admitted = loop {
        match b.admit(&t, lim).await {
            Ok(a) => break a,
            Err(e) => assert_eq!(e.kind, LimitKind::Concurrency),
        }
        assert!(
            t0.elapsed() < Duration::from_secs(8),
            "the leases never lapsed"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(4),
        "{waited:?}"
    );
    // The lapsed reservation was charged in full: 40 used, so 61 more never fit today.
    let e = admitted.reserve(31, 30).await.unwrap_err();
    assert_eq!((e.kind, e.retryable), (LimitKind::DailyQuota, false), "{e}");
    let r = admit_and_reserve(&b, &t, lim, 30, 30).await.unwrap();
    r.settle(30, 30);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_gateway_keeps_its_leases_past_the_ttl() {
    let (_server, url) = RedisServer::from_env_or_start();
    // Refreshed every 500 ms: a refresh may come a second late and still be in time.
    let a = gateway_with(&url, |c| c.lease_ttl = Duration::from_millis(1500));
    let b = gateway(&url);
    let t = tenant();
    let lim = Limits {
        max_concurrent: 1,
        ..Limits::UNLIMITED
    };
    let held = a.admit(&t, lim).await.unwrap();
    // Over twice the ttl.
    tokio::time::sleep(Duration::from_millis(3500)).await;
    assert_eq!(
        b.admit(&t, lim).await.unwrap_err().kind,
        LimitKind::Concurrency
    );
    drop(held);
    a.flush().await;
    assert!(b.admit(&t, lim).await.is_ok());
    assert_eq!(a.backend_errors(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn token_buckets_are_shared_and_a_settle_gives_back_the_unused_part() {
    let (_server, url) = RedisServer::from_env_or_start();
    let (a, b) = (gateway(&url), gateway(&url));
    let t = tenant();
    let lim = Limits {
        requests_per_minute: 3,
        input_tokens_per_minute: 100,
        output_tokens_per_minute: 50,
        ..Limits::UNLIMITED
    };
    let e = admit_and_reserve(&a, &t, lim, 101, 0).await.unwrap_err();
    assert_eq!(
        (e.kind, e.retryable),
        (LimitKind::InputTokens, false),
        "{e}"
    );
    let e = admit_and_reserve(&b, &t, lim, 1, 51).await.unwrap_err();
    assert_eq!(
        (e.kind, e.retryable),
        (LimitKind::OutputTokens, false),
        "{e}"
    );
    // Both refusals gave their request back: 3 requests are still there.
    let r = admit_and_reserve(&a, &t, lim, 60, 0).await.unwrap();
    let e = admit_and_reserve(&b, &t, lim, 60, 0).await.unwrap_err();
    assert_eq!((e.kind, e.retryable), (LimitKind::InputTokens, true), "{e}");
    // 20 input tokens are missing: 12 s at 100/minute (a little less: time went by).
    assert!(
        e.retry_after > Duration::from_secs(11) && e.retry_after <= Duration::from_secs(12),
        "{e:?}"
    );
    // 10 used: 50 come back, 90 are there.
    r.settle(10, 0);
    a.flush().await;
    let r = admit_and_reserve(&b, &t, lim, 60, 0).await.unwrap();
    r.settle(60, 0);
    b.flush().await;
    // Only requests that got through phase 2 stay spent: 2 of 3, one is left.
    assert!(a.admit(&t, lim).await.is_ok());
    assert_eq!(
        a.admit(&t, lim).await.unwrap_err().kind,
        LimitKind::Requests
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changed_limits_keep_working_across_gateways() {
    let (_server, url) = RedisServer::from_env_or_start();
    let (a, b) = (gateway(&url), gateway(&url));
    let t = tenant();
    let ten = Limits {
        requests_per_minute: 10,
        max_concurrent: 1,
        ..Limits::UNLIMITED
    };
    let running = a.admit(&t, ten).await.unwrap();
    assert!(a.admit(&t, ten).await.is_err());
    // Raised to 2 at once: the running request still counts, one more fits.
    let two = Limits {
        max_concurrent: 2,
        ..ten
    };
    let second = b.admit(&t, two).await.unwrap();
    assert_eq!(
        a.admit(&t, two).await.unwrap_err().kind,
        LimitKind::Concurrency
    );
    drop((running, second));
    a.flush().await;
    b.flush().await;
    // 2 of 10 requests spent (8 left), cut to 5 a minute: the level is clamped to 5.
    let unlimited_concurrency = Limits {
        requests_per_minute: 5,
        max_concurrent: 0,
        ..two
    };
    for i in 0..5 {
        let g = if i % 2 == 0 { &a } else { &b };
        assert!(g.admit(&t, unlimited_concurrency).await.is_ok(), "{i}");
    }
    assert_eq!(
        b.admit(&t, unlimited_concurrency).await.unwrap_err().kind,
        LimitKind::Requests
    );
}

/// A limit raised while the tenant is being refused refills at the new rate at once
/// (the refusal stores the bucket at the new limit), as the local bucket does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raised_limit_applies_from_the_next_request() {
    let (_server, url) = RedisServer::from_env_or_start();
    let (a, b) = (gateway(&url), gateway(&url));
    let t = tenant();
    let six = Limits {
        requests_per_minute: 6,
        ..Limits::UNLIMITED
    };
    for _ in 0..6 {
        drop(a.admit(&t, six).await.unwrap());
    }
    assert_eq!(
        a.admit(&t, six).await.unwrap_err().kind,
        LimitKind::Requests
    );
    // Raised to 600 a minute (one per 100 ms): refused once more right away (the
    // bucket is empty), then admitted within a few of the new intervals, not the
    // old 10 s.
    let many = Limits {
        requests_per_minute: 600,
        ..Limits::UNLIMITED
    };
    let _ = b.admit(&t, many).await;
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert!(b.admit(&t, many).await.is_ok(), "the new rate applies");
    a.flush().await;
    b.flush().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_fails_closed_or_open() {
    let dir = tempfile::tempdir().unwrap();
    // Nothing listens on this socket.
    let url = format!("redis+unix://{}", dir.path().join("none.sock").display());
    let lim = Limits {
        requests_per_minute: 2,
        daily_tokens: 1000,
        ..Limits::UNLIMITED
    };
    let t = tenant();

    let closed = gateway_with(&url, |c| c.timeout = Duration::from_millis(200));
    let t0 = Instant::now();
    let e = closed.admit(&t, lim).await.unwrap_err();
    // Nothing listens: refused at once, well within the timeout.
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    assert_eq!((e.kind, e.retryable), (LimitKind::Unavailable, true), "{e}");
    assert_eq!(e.retry_after, Duration::from_secs(1));
    assert_eq!(e.kind.label(), "limits_unavailable");
    assert!(closed.backend_errors() >= 1);
    assert_eq!(closed.fallbacks(), 0);
    let h = closed.health().await;
    assert_eq!(
        (h.backend, h.up, h.fail_mode),
        ("redis", false, Some(FailMode::Closed))
    );

    let open = gateway_with(&url, |c| {
        c.timeout = Duration::from_millis(200);
        c.on_failure = FailMode::Open;
    });
    // The in-memory limits of this gateway apply: 2 requests a minute, daily quota.
    assert!(open.needs_daily(&t, lim).await);
    open.set_daily_used(&t, lim, 990).await;
    assert!(!open.needs_daily(&t, lim).await);
    let r = admit_and_reserve(&open, &t, lim, 5, 5).await.unwrap();
    assert_eq!(open.inflight(&t), 1);
    let e = admit_and_reserve(&open, &t, lim, 1, 0).await.unwrap_err();
    assert_eq!(e.kind, LimitKind::DailyQuota);
    r.settle(5, 5);
    assert_eq!(open.daily(&t).unwrap().used, 1000);
    // The refusal gave its request back: one is left this minute, then none.
    assert!(open.admit(&t, lim).await.is_ok());
    assert_eq!(
        open.admit(&t, lim).await.unwrap_err().kind,
        LimitKind::Requests
    );
    assert!(open.fallbacks() >= 4);
    assert!(open.backend_errors() >= 4);
    let h = open.health().await;
    assert_eq!((h.up, h.fail_mode), (false, Some(FailMode::Open)));
    open.flush().await;
    closed.flush().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_does_not_answer_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mute.sock");
    // Accepts connections and never answers.
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let mute = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    let url = format!("redis+unix://{}", path.display());
    let closed = gateway_with(&url, |c| c.timeout = Duration::from_millis(200));
    let t0 = Instant::now();
    let e = closed
        .admit(&tenant(), Limits::NEW_TENANT)
        .await
        .unwrap_err();
    assert_eq!(e.kind, LimitKind::Unavailable);
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(150) && took < Duration::from_secs(2),
        "{took:?}"
    );
    assert!(!closed.health().await.up);
    mute.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_and_the_memory_backend() {
    let (_server, url) = RedisServer::from_env_or_start();
    let h = gateway(&url).health().await;
    assert_eq!(
        (h.backend, h.up, h.fail_mode),
        ("redis", true, Some(FailMode::Closed))
    );
    let m = Limiter::new();
    let h = m.health().await;
    assert_eq!((h.backend, h.up, h.fail_mode), ("memory", true, None));
    assert_eq!((m.backend_errors(), m.fallbacks()), (0, 0));
    assert!(Limiter::shared(SharedLimits::new("not a url")).is_err());
    let zero = SharedLimits {
        timeout: Duration::ZERO,
        ..SharedLimits::new(url)
    };
    assert!(Limiter::shared(zero).is_err());
}
