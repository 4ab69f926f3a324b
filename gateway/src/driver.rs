//! One driver task per admitted request: it owns the request's stream, the
//! request's limit [`Reservation`] and its registration among the requests in
//! flight, forwards text to the HTTP side, and ends the request exactly once.
//!
//! The request ends when the engine finishes it (done or error), or when the
//! driver aborts it: the client went away (the HTTP side dropped its receiver),
//! the server shuts down, a deadline passed (no first token in time, or no end in
//! time: 408, 3007), or its key stopped being valid (revoked, expired, tenant
//! suspended: 401/403, 10000). An abort cancels the stream: every node holding the
//! request aborts it (a queued request is dropped before its prefill starts). Either
//! way the driver waits until serving confirms the release (every node acknowledged,
//! every page freed, I6) before the limits are given back and the row is written, so
//! a request that is still computing keeps its concurrency slot and usage counts what
//! was computed. The client sees an abort's error at once.
//!
//! Charges: prompt tokens once the first token exists (the prompt was computed),
//! plus every generated token; an abort or failure before the first token charges
//! nothing. The usage row and the daily quota get the same numbers. The row is
//! written right after the final message (a client that saw its response end may
//! see its row a moment later).

use crate::error::{ApiError, ErrorKind};
use crate::live::LiveGuard;
use crate::metrics::AbortReason;
use crate::state::{AppState, Ctx};
use std::sync::Arc;
use std::time::Duration;
use tessera_model::sampling::Logprobs;
use tessera_serving::{
    FinishReason, RequestStream, ServeError, ServeErrorKind, StreamEvent, Usage,
};
use tessera_tenancy::{Reservation, UsageRecord};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};
use tracing::Instrument;

/// Longest wait for serving to confirm a request's release (every node let go)
/// before its limits are given back and its row written anyway (logged as an error
/// and counted in `tessera_release_wait_timeouts_total`: a node is stuck).
pub(crate) const RELEASE_WAIT: Duration = Duration::from_secs(30);

/// Messages from the driver to the HTTP side, in order: text, then one `Done` or
/// `Error`.
#[derive(Debug)]
pub(crate) enum ResponseEvent {
    /// Newly completed text (never empty without `logprobs`), and the log
    /// probabilities of the token that completed it when the request asked.
    Text {
        /// The text.
        text: String,
        /// The token's (and on the first token the prompt's) log probabilities.
        logprobs: Option<Box<Logprobs>>,
    },
    /// Normal end.
    Done {
        /// Why.
        reason: FinishReason,
        /// Token counts.
        tokens: TokenCounts,
    },
    /// Failure after admission (I8: an error, never partial text as success).
    Error(ApiError),
}

/// A finished request's token counts, as its response reports them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct TokenCounts {
    /// Prompt tokens.
    pub(crate) prompt: usize,
    /// Generated tokens.
    pub(crate) completion: usize,
    /// Prompt tokens served from the prefix cache (part of `prompt`).
    pub(crate) cached: usize,
}

pub(crate) fn finish_label(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// Where an admitted request's limits are held and its tokens charged.
pub(crate) enum Charge {
    /// Its own reservation (slot, token allowances, daily reservation), settled
    /// with its tokens when it ends.
    Own(Reservation),
    /// An async batch item: its batch's reservation, which holds every item's
    /// allowances and is settled once, with all their tokens, when the last item
    /// ends.
    Batch(Arc<BatchCharge>),
}

impl Charge {
    fn settle(self, input: i64, output: i64) {
        match self {
            Self::Own(r) => r.settle(input, output),
            Self::Batch(b) => b.add(input, output),
        }
    }

    /// Ends a request that computed nothing.
    pub(crate) fn cancel(self) {
        self.settle(0, 0);
    }
}

/// An async batch's reservation, shared by its items (see [`Charge::Batch`]): the
/// tokens its items used are added up and the reservation is settled with the sum
/// when the last holder drops it (items never started charge nothing).
pub(crate) struct BatchCharge {
    reservation: std::sync::Mutex<Option<Reservation>>,
    input: std::sync::atomic::AtomicI64,
    output: std::sync::atomic::AtomicI64,
}

impl BatchCharge {
    pub(crate) fn new(r: Reservation) -> Arc<Self> {
        Arc::new(Self {
            reservation: std::sync::Mutex::new(Some(r)),
            input: 0.into(),
            output: 0.into(),
        })
    }

    /// Adds one item's tokens.
    fn add(&self, input: i64, output: i64) {
        use std::sync::atomic::Ordering::Relaxed;
        self.input.fetch_add(input.max(0), Relaxed);
        self.output.fetch_add(output.max(0), Relaxed);
    }
}

impl Drop for BatchCharge {
    fn drop(&mut self) {
        let r = self
            .reservation
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(r) = r {
            r.settle(*self.input.get_mut(), *self.output.get_mut());
        }
    }
}

/// What an admitted request holds until its row is written.
pub(crate) struct RequestHoldings {
    /// Its limits (slot, token allowances, daily reservation).
    pub(crate) charge: Charge,
    /// Its registration among the requests in flight (revocation aborts it).
    pub(crate) live: LiveGuard,
}

enum End {
    Done(FinishReason, Usage),
    Error(ServeError),
    /// The client went away.
    Aborted,
    Shutdown,
    /// No first token by the first-token deadline (`true`), or no end by the total
    /// deadline (`false`).
    Timeout(bool),
    /// The key stopped being valid.
    Killed(ApiError),
}

fn serving_error(ctx: &Ctx, e: &ServeError) -> ApiError {
    let err = ApiError::serving(e);
    if err.kind == ErrorKind::Internal {
        tracing::error!(request_id = %ctx.rid, kind = e.kind().label(), error = %e, "generation failed");
    } else {
        // A node's own admission check (I1) or a capacity limit: not our fault.
        tracing::info!(request_id = %ctx.rid, kind = e.kind().label(), error = %e, "refused or failed by serving");
    }
    err
}

/// Starts the driver; returns the receiver the HTTP side reads.
pub(crate) fn spawn(
    state: Arc<AppState>,
    ctx: Ctx,
    mut stream: RequestStream,
    held: RequestHoldings,
    prompt_tokens: usize,
) -> UnboundedReceiver<ResponseEvent> {
    let (tx, rx) = unbounded_channel();
    let inflight = state.inflight_guard();
    let mut abort = state.abort_signal();
    let RequestHoldings { charge, mut live } = held;
    let started = tokio::time::Instant::from_std(ctx.started);
    let first_deadline = started + state.deadlines.first_token;
    let total_deadline = started + state.deadlines.total;
    let span = tracing::info_span!(target: tessera_serving::telemetry::TARGET, "stream");
    let task = async move {
        let mut generated = 0usize;
        let mut ttft = None;
        // Kept only for the debug log line (`log_request_text`).
        let mut output_text = state.log_request_text.then(String::new);
        let end = loop {
            let deadline = if ttft.is_none() {
                first_deadline.min(total_deadline)
            } else {
                total_deadline
            };
            tokio::select! {
                biased;
                _ = tx.closed() => break End::Aborted,
                _ = abort.wait_for(|a| *a) => break End::Shutdown,
                k = live.kill.wait_for(|k| k.is_some()) => {
                    let e = k.ok().and_then(|k| (*k).clone()).unwrap_or_else(|| {
                        ApiError::new(ErrorKind::Unauthenticated, "the API key is no longer valid")
                    });
                    break End::Killed(e);
                }
                _ = tokio::time::sleep_until(deadline) => break End::Timeout(ttft.is_none()),
                ev = stream.recv() => match ev {
                    Some(StreamEvent::Token { text, logprobs, .. }) => {
                        generated += 1;
                        ttft.get_or_insert_with(|| ctx.started.elapsed());
                        if !text.is_empty() || logprobs.is_some() {
                            if let Some(o) = &mut output_text {
                                o.push_str(&text);
                            }
                            let _ = tx.send(ResponseEvent::Text { text, logprobs });
                        }
                    }
                    Some(StreamEvent::Done { reason, usage }) => break End::Done(reason, usage),
                    Some(StreamEvent::Error(e)) => break End::Error(e),
                    None => break End::Error(ServeError::new(
                        ServeErrorKind::Shutdown,
                        "the engine stopped before the request finished",
                    )),
                },
            }
        };
        let ttft_us = ttft.map(|d| d.as_micros() as i64).unwrap_or(0);
        // The client-visible error of an abort the driver decided, sent at once.
        let abort_error = match &end {
            End::Shutdown => Some(ApiError::new(
                ErrorKind::Unavailable,
                "the server is shutting down; the request was aborted",
            )),
            End::Timeout(true) => Some(ApiError::new(
                ErrorKind::Timeout,
                format!(
                    "no first token within the deadline of {} s; the request was aborted",
                    state.deadlines.first_token.as_secs_f64()
                ),
            )),
            End::Timeout(false) => Some(ApiError::new(
                ErrorKind::Timeout,
                format!(
                    "the request exceeded the deadline of {} s; it was aborted",
                    state.deadlines.total.as_secs_f64()
                ),
            )),
            End::Killed(e) => Some(e.clone()),
            _ => None,
        };
        let aborted = matches!(
            end,
            End::Aborted | End::Shutdown | End::Timeout(_) | End::Killed(_)
        );
        if aborted {
            if let Some(e) = &abort_error {
                let _ = tx.send(ResponseEvent::Error(e.clone()));
            }
            // Abort on every node holding the request (I6).
            stream.cancel();
        }
        // I6: whatever the end, nothing may still be held for the request on any node
        // (every abort acknowledged, every page freed) before its limits come back and
        // its usage is recorded.
        let wait = std::time::Instant::now();
        let released = tokio::time::timeout(RELEASE_WAIT, stream.released())
            .await
            .is_ok();
        if !released {
            state.metrics.release_timeout();
            tracing::error!(request_id = %ctx.rid, "serving did not confirm the release in time");
        }
        let reason = match &end {
            End::Aborted => Some(AbortReason::ClientGone),
            End::Shutdown => Some(AbortReason::Shutdown),
            End::Timeout(_) => Some(AbortReason::Timeout),
            End::Killed(_) => Some(AbortReason::KeyInvalid),
            _ => None,
        };
        if let Some(reason) = reason {
            let ack = released.then(|| wait.elapsed());
            state.metrics.abort(ttft.is_some(), reason, ack);
        }
        // Tokens the engine sent before the abort took effect were computed even if
        // nobody saw them.
        if aborted {
            while let Some(ev) = stream.try_recv() {
                if matches!(ev, StreamEvent::Token { .. }) {
                    generated += 1;
                }
            }
        }
        drop(stream);
        let charged_prompt = if generated > 0 { prompt_tokens } else { 0 };
        if let End::Done(_, u) = &end {
            if u.completion_tokens > 1 {
                state.metrics.tpot(&ctx.model, u.tpot);
            }
        }
        let (record, msg) = match end {
            End::Done(reason, u) => (
                UsageRecord {
                    cached_tokens: u.cached_tokens as i64,
                    cached_host_tokens: u.cached_tiers.host as i64,
                    cached_disk_tokens: u.cached_tiers.disk as i64,
                    ..ctx.usage(
                        200,
                        0,
                        finish_label(reason),
                        u.prompt_tokens,
                        u.completion_tokens,
                        u.ttft.as_micros() as i64,
                    )
                },
                Some(ResponseEvent::Done {
                    reason,
                    tokens: TokenCounts {
                        prompt: u.prompt_tokens,
                        completion: u.completion_tokens,
                        cached: u.cached_tokens,
                    },
                }),
            ),
            End::Error(e) => {
                state.metrics.serve_error(e.kind().label());
                let err = serving_error(&ctx, &e);
                (
                    ctx.usage(
                        err.kind.status().as_u16(),
                        err.kind.workers_code(),
                        "error",
                        charged_prompt,
                        generated,
                        ttft_us,
                    ),
                    Some(ResponseEvent::Error(err)),
                )
            }
            End::Aborted => (
                ctx.usage(499, 3008, "aborted", charged_prompt, generated, ttft_us),
                None,
            ),
            End::Shutdown | End::Timeout(_) | End::Killed(_) => {
                let e = abort_error.expect("set for driver aborts");
                (
                    ctx.usage(
                        e.kind.status().as_u16(),
                        e.kind.workers_code(),
                        "aborted",
                        charged_prompt,
                        generated,
                        ttft_us,
                    ),
                    None, // already sent
                )
            }
        };
        // Release the limits before the final message, so a client that sends its
        // next request as soon as it sees this one end is not refused by its own
        // finished request; then answer, then write the row (off the response's
        // critical path; the in-flight guard keeps shutdown waiting for it).
        charge.settle(record.input_tokens, record.output_tokens);
        if let Some(m) = msg {
            let _ = tx.send(m);
        }
        let text = output_text
            .as_deref()
            .map(|o| (ctx.prompt_text.as_deref().unwrap_or_default(), o));
        state.record_with_text(&record, text).await;
        drop(live);
        drop(inflight);
    };
    tokio::spawn(task.instrument(span));
    rx
}
