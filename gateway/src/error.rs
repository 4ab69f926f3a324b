//! API errors. Every failure a client can see is an [`ApiError`]; its HTTP status,
//! Workers AI code and OpenAI type/code come from [`ErrorKind`], mapped here and
//! nowhere else.

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use std::time::Duration;
use tessera_serving::{ServeError, ServeErrorKind};

/// The `retry-after` of a 503 for a request serving had no capacity for in time.
pub const BUSY_RETRY_AFTER: Duration = Duration::from_secs(5);

/// Which API shape an error is rendered in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// `{"success":false,"errors":[{"code":N,"message":..}],...}` (Workers AI, usage, admin).
    WorkersAi,
    /// `{"error":{"message":..,"type":..,"param":..,"code":..}}`.
    OpenAi,
}

/// What went wrong, as a closed set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// No, malformed, unknown or revoked API key (401).
    Unauthenticated,
    /// Key valid but not for this account or outside its scopes, or the tenant is
    /// suspended (403).
    Forbidden,
    /// Body is not JSON, a field has the wrong type or value (400).
    BadRequest,
    /// Prompt + max_tokens over the context window, or over the KV pool (400).
    ContextOverflow,
    /// Body over the size limit (413).
    TooLarge,
    /// Unknown model id (404).
    NoSuchModel,
    /// A private model the caller's account may not use (403, Workers AI 5018).
    ModelNotAllowed,
    /// Unknown route (404).
    NotFound,
    /// A known route asked with a method it does not serve (405, with `allow`).
    MethodNotAllowed,
    /// The change conflicts with what exists (a fine-tune name in use) or a count
    /// cap is reached (409).
    Conflict,
    /// A per-tenant rate limit (429).
    RateLimited,
    /// The tenant's daily token quota is used up (429).
    QuotaExceeded,
    /// The engine is not accepting work (503).
    Unavailable,
    /// A deadline passed: the body was not received in time, or no first token /
    /// no complete answer within the request deadline (408, Workers AI 3007).
    Timeout,
    /// An internal failure, e.g. a KV integrity error (500).
    Internal,
}

impl ErrorKind {
    /// HTTP status.
    pub fn status(self) -> StatusCode {
        match self {
            Self::Unauthenticated => StatusCode::UNAUTHORIZED,
            Self::Forbidden | Self::ModelNotAllowed => StatusCode::FORBIDDEN,
            Self::BadRequest | Self::ContextOverflow => StatusCode::BAD_REQUEST,
            Self::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Self::NoSuchModel | Self::NotFound => StatusCode::NOT_FOUND,
            Self::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            Self::Conflict => StatusCode::CONFLICT,
            Self::RateLimited | Self::QuotaExceeded => StatusCode::TOO_MANY_REQUESTS,
            Self::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Self::Timeout => StatusCode::REQUEST_TIMEOUT,
            Self::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// Workers AI error code.
    pub fn workers_code(self) -> u32 {
        match self {
            Self::Unauthenticated | Self::Forbidden => 10000,
            Self::BadRequest => 3003,
            Self::ContextOverflow | Self::TooLarge => 3006,
            Self::NoSuchModel => 5007,
            Self::ModelNotAllowed => 5018,
            Self::NotFound => 7000,
            Self::MethodNotAllowed => 7001,
            Self::Conflict => 3003,
            Self::RateLimited | Self::Unavailable => 3040,
            Self::QuotaExceeded => 3036,
            Self::Timeout => 3007,
            Self::Internal => 3043,
        }
    }

    /// OpenAI `(type, code)`.
    pub fn openai(self) -> (&'static str, &'static str) {
        match self {
            Self::Unauthenticated => ("invalid_request_error", "invalid_api_key"),
            Self::Forbidden => ("invalid_request_error", "permission_denied"),
            Self::BadRequest => ("invalid_request_error", "invalid_request"),
            Self::ContextOverflow => ("invalid_request_error", "context_length_exceeded"),
            Self::TooLarge => ("invalid_request_error", "request_too_large"),
            Self::NoSuchModel => ("invalid_request_error", "model_not_found"),
            Self::ModelNotAllowed => ("invalid_request_error", "model_not_permitted"),
            Self::NotFound => ("invalid_request_error", "not_found"),
            Self::MethodNotAllowed => ("invalid_request_error", "method_not_allowed"),
            Self::Conflict => ("invalid_request_error", "conflict"),
            Self::RateLimited => ("requests", "rate_limit_exceeded"),
            Self::QuotaExceeded => ("insufficient_quota", "insufficient_quota"),
            Self::Unavailable => ("server_error", "engine_unavailable"),
            Self::Timeout => ("timeout_error", "request_timeout"),
            Self::Internal => ("server_error", "internal_error"),
        }
    }
}

/// A client-visible error.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// Kind (status and codes).
    pub kind: ErrorKind,
    /// Message naming the field and the limit.
    pub message: String,
    /// Offending field, if one.
    pub param: Option<String>,
    /// For 429 and a busy 503: when a retry can succeed.
    pub retry_after: Option<Duration>,
    /// With `retry_after`: false when waiting cannot help.
    pub retryable: bool,
}

impl ApiError {
    /// An error of `kind` with `message`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
            param: None,
            retry_after: None,
            retryable: true,
        }
    }

    /// A 400 about `field`.
    pub fn field(field: &str, message: impl Into<String>) -> Self {
        Self {
            param: Some(field.into()),
            ..Self::new(ErrorKind::BadRequest, message)
        }
    }

    /// The client error for a serving failure (status by its kind; retryable ones
    /// carry `x-should-retry: true`).
    pub fn serving(e: &ServeError) -> Self {
        let kind = match e.kind() {
            ServeErrorKind::Invalid => ErrorKind::BadRequest,
            ServeErrorKind::TooLarge => ErrorKind::ContextOverflow,
            ServeErrorKind::Busy
            | ServeErrorKind::NodeDown
            | ServeErrorKind::Timeout
            | ServeErrorKind::Shutdown => ErrorKind::Unavailable,
            ServeErrorKind::Integrity | ServeErrorKind::Internal => ErrorKind::Internal,
        };
        let mut a = Self::new(kind, e.message());
        a.retryable = e.is_retryable();
        if e.kind() == ServeErrorKind::Busy {
            // No capacity now (a batch request that waited past its deadline).
            a.retry_after = Some(BUSY_RETRY_AFTER);
        }
        a
    }

    /// The response in `flavor`'s shape, with `x-request-id` and, when it has a retry
    /// hint (429, a busy 503), `retry-after` (whole seconds, rounded up) and
    /// `x-should-retry`.
    pub fn into_response_as(self, flavor: Flavor, request_id: &str) -> Response {
        let status = self.kind.status();
        let body = match flavor {
            Flavor::WorkersAi => json!({
                "result": null,
                "success": false,
                "errors": [{"code": self.kind.workers_code(), "message": self.message}],
                "messages": [],
            }),
            Flavor::OpenAi => {
                let (ty, code) = self.kind.openai();
                json!({"error": {"message": self.message, "type": ty, "param": self.param, "code": code}})
            }
        };
        let mut resp = (status, axum::Json(body)).into_response();
        let h = resp.headers_mut();
        if let Ok(v) = HeaderValue::from_str(request_id) {
            h.insert("x-request-id", v);
        }
        if let Some(d) = self.retry_after {
            let secs = d.as_secs() + u64::from(d.subsec_nanos() > 0);
            h.insert("retry-after", HeaderValue::from(secs.max(1)));
            h.insert(
                "x-should-retry",
                HeaderValue::from_static(if self.retryable { "true" } else { "false" }),
            );
        }
        resp
    }
}

/// The JSON type of `v`, as a 400's message names it ("`x` must be a string.
/// Given: number"). Shared by every body parser (validation, tools).
pub(crate) fn type_name(v: &serde_json::Value) -> &'static str {
    use serde_json::Value;
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_and_headers() {
        let mut e = ApiError::new(ErrorKind::RateLimited, "slow down");
        e.retry_after = Some(Duration::from_millis(1500));
        e.retryable = false;
        let r = e.clone().into_response_as(Flavor::WorkersAi, "rid");
        assert_eq!(r.status(), 429);
        assert_eq!(r.headers()["retry-after"], "2");
        assert_eq!(r.headers()["x-should-retry"], "false");
        assert_eq!(r.headers()["x-request-id"], "rid");
        let r = ApiError::field("max_tokens", "bad").into_response_as(Flavor::OpenAi, "rid");
        assert_eq!(r.status(), 400);
        assert!(r.headers().get("retry-after").is_none());
    }
}
