//! Where a request's events go, as the engine sees it: the client's stream in this
//! process, a node link to the gateway, or nowhere (a prefill node's sequence, whose
//! first token travels in the transfer commit instead), and the events themselves.

use std::time::Duration;
use tessera_kernels::IntegrityError;
use tessera_model::sampling::Logprobs;
use tokio::sync::mpsc::UnboundedSender;

/// The receiver of a request's events is gone: the engine aborts the request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the request's event receiver is gone")]
pub struct Gone;

/// Receives one request's events, in order: tokens, then one `Done` or `Error`.
///
/// Called on the engine thread between forward passes: implementations must not
/// block (queue the event; a full queue is `Err(Gone)`).
pub trait EventSink: Send {
    /// Delivers `event`. `Err(Gone)` ends the request (the engine frees its pages).
    fn send(&mut self, event: Event) -> Result<(), Gone>;

    /// Whether the client asked to stop. Checked before every step: a cancelled
    /// request still waiting is dropped without computing it, a running one is
    /// stopped and its pages freed.
    fn cancelled(&self) -> bool {
        false
    }
}

/// A plain channel: dropping its receiver cancels.
impl EventSink for UnboundedSender<Event> {
    fn send(&mut self, event: Event) -> Result<(), Gone> {
        UnboundedSender::send(self, event).map_err(|_| Gone)
    }

    fn cancelled(&self) -> bool {
        self.is_closed()
    }
}

/// Drops every event (a prefill node's sequence: nobody reads its stream).
#[derive(Clone, Copy, Debug, Default)]
pub struct Discard;

impl EventSink for Discard {
    fn send(&mut self, _event: Event) -> Result<(), Gone> {
        Ok(())
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// End-of-sequence token or stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// Failures after admission on this engine; the request yields no further tokens.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// A KV page's tag did not match (I3).
    #[error("KV integrity check failed: {0}")]
    Integrity(#[from] IntegrityError),
    /// The engine stopped before the request finished.
    #[error("engine shut down")]
    Shutdown,
    /// A batch-class request waited for admission longer than the engine allows;
    /// nothing was computed. Retryable.
    #[error(
        "the request waited {waited_ms} ms in the batch queue (limit {limit_ms} ms); retry later"
    )]
    BatchQueueTimeout {
        /// How long it waited (ms).
        waited_ms: u64,
        /// The engine's limit (ms).
        limit_ms: u64,
    },
    /// The request's `response_format` could not be compiled here (the gateway
    /// compiles it first, so only a request that skipped it gets this).
    #[error("response_format: {0}")]
    Format(#[from] tessera_model::grammar::GrammarError),
}

impl EngineError {
    /// Stable machine label.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Integrity(_) => "integrity",
            Self::Shutdown => "shutdown",
            Self::BatchQueueTimeout { .. } => "batch_queue_timeout",
            Self::Format(_) => "bad_format",
        }
    }
}

/// Prompt tokens reused from the prefix cache's lower tiers (restored into the
/// pool; part of [`Usage::cached_tokens`], the rest were pool hits).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CachedTiers {
    /// Restored from host memory.
    #[serde(default)]
    pub host: usize,
    /// Restored from disk (sealed pages opened).
    #[serde(default)]
    pub disk: usize,
}

/// Token counts and timings of a finished request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (including a final stop token).
    pub completion_tokens: usize,
    /// Prompt tokens reused from the prefix cache (not computed; included in
    /// `prompt_tokens`).
    pub cached_tokens: usize,
    /// Of `cached_tokens`, those restored from the lower tiers.
    pub cached_tiers: CachedTiers,
    /// Submit to first token.
    pub ttft: Duration,
    /// Mean time per output token after the first.
    pub tpot: Duration,
}

/// What a request's stream receives, in order: tokens, then one `Done` or `Error`.
/// The one event type from the engine to the client's formatter: the serving layer
/// carries it as `Event<ServeError>` (`tessera_serving::StreamEvent`), which differs
/// only in its error ([`Event::map_error`]).
#[derive(Clone, Debug, PartialEq)]
pub enum Event<E = EngineError> {
    /// A generated token and the text it completed (may be empty mid-character or
    /// while a possible stop string is held back).
    Token {
        /// Token id.
        id: u32,
        /// Newly completed text.
        text: String,
        /// Log probabilities, when the request asked for them: the token's (none
        /// for an end-of-sequence token, which is not output), and on the first
        /// token the prompt's.
        logprobs: Option<Box<Logprobs>>,
        /// The sampler's RNG word position after this token: what a continuation
        /// elsewhere resumes from ([`crate::Resume`]).
        rng_word_pos: u64,
    },
    /// Normal end.
    Done {
        /// Why.
        reason: FinishReason,
        /// Counts and timings.
        usage: Usage,
    },
    /// Abnormal end; no further tokens (I8: never a partial answer as success).
    Error(E),
}

impl<E> Event<E> {
    /// The same event with its error (if it is one) mapped by `f`.
    pub fn map_error<F>(self, f: impl FnOnce(E) -> F) -> Event<F> {
        match self {
            Self::Token {
                id,
                text,
                logprobs,
                rng_word_pos,
            } => Event::Token {
                id,
                text,
                logprobs,
                rng_word_pos,
            },
            Self::Done { reason, usage } => Event::Done { reason, usage },
            Self::Error(e) => Event::Error(f(e)),
        }
    }
}
