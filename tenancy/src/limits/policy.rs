//! What a limit is and how it refuses: the kinds ([`LimitKind`]), the refusal
//! ([`LimitError`], built by one constructor per kind), and the settings of the
//! Redis backend ([`SharedLimits`], [`FailMode`]). Shared by the in-memory
//! limiter (`limits.rs`) and the Redis one (`shared.rs`), so neither imports the
//! other's internals back.

use std::time::Duration;

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
    /// Usage-API queries per minute.
    UsageQueries,
    /// No limit refused: the shared limits store (Redis) failed or did not answer in
    /// time, and the limiter fails closed ([`FailMode::Closed`]). Retryable.
    Unavailable,
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
            Self::UsageQueries => "usage_queries_per_minute",
            Self::Unavailable => "limits_unavailable",
        }
    }

    fn headline(self) -> &'static str {
        match self {
            Self::Unavailable => "limits unavailable",
            _ => "rate limit exceeded",
        }
    }
}

/// A limit refused the request (or, [`LimitKind::Unavailable`], the limits could not
/// be checked).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{}: {} ({detail})", kind.headline(), kind.label())]
pub struct LimitError {
    /// Which limit.
    pub kind: LimitKind,
    /// How long to wait before a retry can succeed.
    pub retry_after: Duration,
    /// False when waiting cannot help (the request alone exceeds the limit, or the
    /// daily quota is spent until 00:00 UTC).
    pub retryable: bool,
    /// Human-readable numbers.
    pub detail: String,
}

pub(super) fn concurrency_error(inflight: u32, max: u32) -> LimitError {
    LimitError {
        kind: LimitKind::Concurrency,
        retry_after: Duration::from_secs(1),
        retryable: true,
        detail: format!("{inflight} requests already in flight; limit {max}"),
    }
}

/// `n` requests refused; `wait`: `None` when `n` alone exceeds the limit (never
/// fits: not retryable).
pub(super) fn requests_error(n: u32, cap: u32, wait: Option<Duration>) -> LimitError {
    match wait {
        Some(wait) => LimitError {
            kind: LimitKind::Requests,
            retry_after: wait,
            retryable: true,
            detail: if n > 1 {
                format!("{n} requests at once; limit {cap} requests/minute")
            } else {
                format!("limit {cap} requests/minute")
            },
        },
        None => LimitError {
            kind: LimitKind::Requests,
            retry_after: Duration::from_secs(60),
            retryable: false,
            detail: format!(
                "{n} requests at once exceed the limit of {cap} requests/minute; send fewer"
            ),
        },
    }
}

/// `wait`: `None` when `n` alone exceeds the limit (never fits).
pub(super) fn tokens_error(
    kind: LimitKind,
    n: u32,
    cap: u32,
    wait: Option<Duration>,
) -> LimitError {
    match wait {
        Some(wait) => LimitError {
            kind,
            retry_after: wait,
            retryable: true,
            detail: format!("request needs {n} tokens; limit {cap} tokens/minute"),
        },
        None => LimitError {
            kind,
            retry_after: Duration::from_secs(60),
            retryable: false,
            detail: format!("request needs {n} tokens, more than the limit of {cap} tokens/minute"),
        },
    }
}

/// `ms_left`: until 00:00 UTC.
pub(super) fn daily_error(
    used: i64,
    reserved: i64,
    need: i64,
    daily: i64,
    ms_left: i64,
) -> LimitError {
    // Fits once the requests in flight settle (they may use less than they
    // reserved): worth a retry soon; else not before tomorrow.
    let soon = used + need <= daily;
    LimitError {
        kind: LimitKind::DailyQuota,
        retry_after: if soon {
            Duration::from_secs(1)
        } else {
            Duration::from_millis(ms_left.max(1000) as u64)
        },
        retryable: soon,
        detail: format!(
            "{used} of {daily} daily tokens used and {reserved} reserved by requests in flight; \
             this request needs {need} (prompt + max_tokens); the quota resets at 00:00 UTC"
        ),
    }
}

pub(super) fn unavailable_error() -> LimitError {
    LimitError {
        kind: LimitKind::Unavailable,
        retry_after: Duration::from_secs(1),
        retryable: true,
        detail: "the shared limits store (Redis) failed or did not answer in time".into(),
    }
}

/// What a shared limiter does with a request when Redis fails or does not answer
/// within [`SharedLimits::timeout`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FailMode {
    /// Admit it under this gateway's own in-memory limits (each gateway then allows
    /// a tenant its full limits: up to N times them with N gateways). Counted
    /// ([`Limiter::fallbacks`]).
    Open,
    /// Refuse it: [`LimitKind::Unavailable`] (503, retry after 1 s).
    #[default]
    Closed,
}

impl FailMode {
    /// `"open"` or `"closed"`.
    pub fn label(self) -> &'static str {
        match self {
            Self::Open => "open",
            Self::Closed => "closed",
        }
    }
}

impl std::str::FromStr for FailMode {
    type Err = String;

    /// Parses `open` or `closed`.
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "open" => Ok(Self::Open),
            "closed" => Ok(Self::Closed),
            _ => Err(format!("expected `open` or `closed`, not {s:?}")),
        }
    }
}

/// Where and how to share limits with other gateways ([`Limiter::shared`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SharedLimits {
    /// The Redis server: `redis://[user:password@]host:port[/db]` or
    /// `redis+unix:///path/to/socket`.
    pub url: String,
    /// What to do when Redis fails (default: refuse).
    pub on_failure: FailMode,
    /// How long a concurrency slot outlives the gateway holding it (it is refreshed
    /// every third of this while the gateway lives). Default 30 s; at least 3 ms.
    pub lease_ttl: Duration,
    /// The bound of each Redis call, connecting included. Default 500 ms; not 0.
    pub timeout: Duration,
}

impl SharedLimits {
    /// `url` with the defaults: fail closed, 30 s leases, 500 ms timeout.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            on_failure: FailMode::Closed,
            lease_ttl: Duration::from_secs(30),
            timeout: Duration::from_millis(500),
        }
    }
}

/// [`Limiter::shared`] was given an unusable configuration (a URL that does not
/// parse, a zero timeout).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("invalid shared limits configuration: {0}")]
pub struct SharedLimitsError(pub String);
