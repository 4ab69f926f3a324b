//! [`ServeError`]: the one error type the gateway sees from serving, with a stable
//! kind it maps to a status code and a retry hint. Protocol and engine errors are
//! turned into it here and nowhere else.

use serde::{Deserialize, Serialize};
use tessera_engine::{EngineError, Rejection};
use tessera_transfer::protocol::{FailKind, FailReason, Failure, Refusal, RefusalKind, Role};

/// What kind of failure a request met. Closed set; the gateway maps each to a status.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ServeErrorKind {
    /// The request is malformed for the model (empty prompt, zero `max_tokens`, a
    /// token id outside the vocabulary, bad sampling parameters). Client error.
    Invalid,
    /// The request can never fit (context window, a node's KV pool). Client error.
    TooLarge,
    /// No room right now (pages, queue). Retryable.
    Busy,
    /// A KV page tag or a transfer checksum did not match (I3, I4): the request was
    /// failed rather than answered with another sequence's data. Not retryable as is.
    Integrity,
    /// A node holding or needed for the request is unreachable or died. Retryable.
    NodeDown,
    /// A bounded wait ran out (a node did not answer in time). Retryable.
    Timeout,
    /// The serving side is shutting down. Retryable elsewhere.
    Shutdown,
    /// Anything else. Not retryable.
    Internal,
}

impl ServeErrorKind {
    /// Stable machine label (logs, metrics, usage rows).
    pub fn label(self) -> &'static str {
        match self {
            Self::Invalid => "invalid",
            Self::TooLarge => "too_large",
            Self::Busy => "busy",
            Self::Integrity => "integrity",
            Self::NodeDown => "node_down",
            Self::Timeout => "timeout",
            Self::Shutdown => "shutdown",
            Self::Internal => "internal",
        }
    }
}

/// A request's failure as serving reports it: a kind and a message naming what went
/// wrong (the field and the limit, for client errors).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ServeError {
    kind: ServeErrorKind,
    message: String,
}

impl ServeError {
    /// An error of `kind` with `message`.
    pub fn new(kind: ServeErrorKind, message: impl Into<String>) -> Self {
        Self {
            kind,
            message: message.into(),
        }
    }

    /// What kind of failure.
    pub fn kind(&self) -> ServeErrorKind {
        self.kind
    }

    /// The message.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// Whether the same request may succeed if sent again later.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self.kind,
            ServeErrorKind::Busy
                | ServeErrorKind::NodeDown
                | ServeErrorKind::Timeout
                | ServeErrorKind::Shutdown
        )
    }

    /// A node's admission refusal (I1).
    pub fn refused(r: &Refusal) -> Self {
        let kind = match r.kind {
            RefusalKind::Invalid => ServeErrorKind::Invalid,
            RefusalKind::TooLarge => ServeErrorKind::TooLarge,
            RefusalKind::Busy => ServeErrorKind::Busy,
        };
        Self::new(kind, r.message.clone())
    }

    /// A node's failure after admission.
    pub fn failed(r: &FailReason) -> Self {
        let kind = match r.kind {
            FailKind::Integrity => ServeErrorKind::Integrity,
            // A drained node that no other node could take the request from.
            FailKind::Transport | FailKind::Drained | FailKind::Moving => ServeErrorKind::NodeDown,
            FailKind::Busy => ServeErrorKind::Busy,
            // The client is gone: nobody reads this, but it must not read as success.
            FailKind::ClientGone | FailKind::Internal => ServeErrorKind::Internal,
        };
        Self::new(kind, r.message.clone())
    }

    /// The coordinator's verdict on a failed request.
    pub fn from_failure(f: &Failure) -> Self {
        match f {
            Failure::Commit(e) => Self::new(
                ServeErrorKind::Integrity,
                format!("KV transfer failed: the decode node refused the commit: {e}"),
            ),
            Failure::Prefill(r) => {
                let e = Self::failed(r);
                Self::new(e.kind, format!("KV transfer failed: prefill failed: {r}"))
            }
            Failure::Decode(r) => {
                let e = Self::failed(r);
                Self::new(e.kind, format!("decode failed: {r}"))
            }
            Failure::LeaseExpired => Self::new(
                ServeErrorKind::Timeout,
                "KV transfer failed: the prefill node did not commit before the decode \
                 reservation's lease ran out",
            ),
            Failure::NodeDown(role) => Self::new(
                ServeErrorKind::NodeDown,
                format!(
                    "the {} node holding the request went down",
                    role_name(*role)
                ),
            ),
        }
    }
}

fn role_name(r: Role) -> &'static str {
    match r {
        Role::Coordinator => "coordinator",
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

impl From<Rejection> for ServeError {
    fn from(r: Rejection) -> Self {
        let kind = match &r {
            Rejection::ContextOverflow { .. } | Rejection::PoolTooSmall { .. } => {
                ServeErrorKind::TooLarge
            }
            Rejection::Unavailable(_) => ServeErrorKind::NodeDown,
            Rejection::EmptyPrompt
            | Rejection::ZeroMaxTokens
            | Rejection::BadToken { .. }
            | Rejection::Sampling(_)
            | Rejection::Stop(_)
            | Rejection::Lora(_)
            | Rejection::NoDraftModel => ServeErrorKind::Invalid,
        };
        Self::new(kind, r.to_string())
    }
}

impl From<EngineError> for ServeError {
    fn from(e: EngineError) -> Self {
        let kind = match e {
            EngineError::Integrity(_) => ServeErrorKind::Integrity,
            EngineError::Shutdown => ServeErrorKind::Shutdown,
            EngineError::BatchQueueTimeout { .. } => ServeErrorKind::Busy,
            EngineError::Format(_) => ServeErrorKind::Invalid,
        };
        Self::new(kind, e.to_string())
    }
}

/// The refusal a node sends for an admission rejection.
pub(crate) fn refusal(r: &Rejection) -> Refusal {
    let kind = match ServeError::from(r.clone()).kind() {
        ServeErrorKind::TooLarge => RefusalKind::TooLarge,
        ServeErrorKind::Busy | ServeErrorKind::NodeDown => RefusalKind::Busy,
        _ => RefusalKind::Invalid,
    };
    Refusal {
        kind,
        message: r.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn client_errors_are_not_retryable_and_capacity_errors_are() {
        let too_large = ServeError::from(Rejection::ContextOverflow {
            prompt: 9000,
            max_tokens: 10,
            context: 8192,
        });
        assert_eq!(too_large.kind(), ServeErrorKind::TooLarge);
        assert!(!too_large.is_retryable());
        assert!(too_large.message().contains("8192"));
        let busy = ServeError::refused(&Refusal {
            kind: RefusalKind::Busy,
            message: "full".into(),
        });
        assert!(busy.is_retryable());
        let integrity = ServeError::from_failure(&Failure::Commit(
            tessera_transfer::protocol::CommitError::TagMismatch { page: 3 },
        ));
        assert_eq!(integrity.kind(), ServeErrorKind::Integrity);
        assert!(!integrity.is_retryable());
        assert!(ServeError::from_failure(&Failure::NodeDown(Role::Decode)).is_retryable());
    }

    #[test]
    fn a_refusal_keeps_its_kind_through_the_wire_mapping() {
        for r in [
            Rejection::EmptyPrompt,
            Rejection::PoolTooSmall {
                needed: 10,
                capacity: 5,
            },
            Rejection::Unavailable("down".into()),
        ] {
            let direct = ServeError::from(r.clone()).kind();
            let via_node = ServeError::refused(&refusal(&r)).kind();
            let expect = if direct == ServeErrorKind::NodeDown {
                ServeErrorKind::Busy
            } else {
                direct
            };
            assert_eq!(via_node, expect, "{r:?}");
        }
    }
}
