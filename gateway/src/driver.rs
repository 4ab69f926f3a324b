//! One driver task per admitted request: it owns the request's stream and its limit
//! permit, forwards text to the HTTP side, and notices when the client goes away
//! (the HTTP side dropped its receiver) or the server shuts down, and then cancels the
//! request. Either way it waits until serving confirms that nothing is held for the
//! request on any node (I6: every abort acknowledged, every page freed), bounded by
//! [`RELEASE_WAIT`], before it returns the tenant's permits and writes the usage row,
//! exactly once, with the tokens computed.

use crate::error::{ApiError, ErrorKind};
use crate::server::{AppState, Ctx};
use std::sync::Arc;
use std::time::Duration;
use tessera_serving::{
    FinishReason, RequestStream, ServeError, ServeErrorKind, StreamEvent, Usage,
};
use tessera_tenancy::Permit;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Longest wait for the nodes to confirm a request's release before its permits and
/// usage row go ahead anyway (counted in `tessera_release_wait_timeouts_total`).
pub(crate) const RELEASE_WAIT: Duration = Duration::from_secs(10);

/// Messages from the driver to the HTTP side, in order: text, then one `Done` or
/// `Error`.
#[derive(Debug)]
pub(crate) enum Msg {
    /// Newly completed text (never empty).
    Text(String),
    /// Normal end.
    Done {
        /// Why.
        reason: FinishReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
    },
    /// Failure after admission (I8: an error, never partial text as success).
    Error(ApiError),
}

pub(crate) fn finish_label(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

/// Starts the driver; returns the receiver the HTTP side reads.
pub(crate) fn spawn(
    state: Arc<AppState>,
    ctx: Ctx,
    mut stream: RequestStream,
    permit: Permit,
    prompt_tokens: usize,
) -> UnboundedReceiver<Msg> {
    let (tx, rx) = unbounded_channel();
    let inflight = state.inflight_guard();
    let mut abort = state.abort_signal();
    tokio::spawn(async move {
        let mut generated = 0usize;
        let mut ttft = None;
        enum End {
            Done(FinishReason, Usage),
            Error(ServeError),
            Aborted,
            Shutdown,
        }
        let end = loop {
            tokio::select! {
                biased;
                _ = tx.closed() => break End::Aborted,
                _ = abort.wait_for(|a| *a) => break End::Shutdown,
                ev = stream.recv() => match ev {
                    Some(StreamEvent::Token { text, .. }) => {
                        generated += 1;
                        ttft.get_or_insert_with(|| ctx.started.elapsed());
                        if !text.is_empty() {
                            let _ = tx.send(Msg::Text(text));
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
        let aborted = matches!(end, End::Aborted | End::Shutdown);
        if aborted {
            stream.cancel();
        }
        // I6: nothing may still be held for the request on any node before its
        // permits come back and its usage is recorded.
        if tokio::time::timeout(RELEASE_WAIT, stream.released())
            .await
            .is_err()
        {
            state.metrics.release_timeout();
            tracing::warn!(request_id = %ctx.rid, "nodes did not confirm the release in time");
        }
        // Tokens the engine computed before the abort took effect count, even if the
        // client never saw them.
        if aborted {
            while let Some(ev) = stream.try_recv() {
                if matches!(ev, StreamEvent::Token { .. }) {
                    generated += 1;
                }
            }
        }
        drop(stream);
        let ttft_us = ttft.map(|d| d.as_micros() as i64).unwrap_or(0);
        let (record, msg) = match end {
            End::Done(reason, u) => (
                ctx.usage(
                    200,
                    0,
                    finish_label(reason),
                    u.prompt_tokens,
                    u.completion_tokens,
                    u.ttft.as_micros() as i64,
                ),
                Some(Msg::Done {
                    reason,
                    prompt_tokens: u.prompt_tokens,
                    completion_tokens: u.completion_tokens,
                }),
            ),
            End::Error(e) => {
                let err = ApiError::serving(&e);
                if err.kind == ErrorKind::Internal {
                    tracing::error!(request_id = %ctx.rid, kind = e.kind().label(), error = %e, "generation failed");
                } else {
                    tracing::info!(request_id = %ctx.rid, kind = e.kind().label(), error = %e, "request refused or failed");
                }
                (
                    ctx.usage(
                        err.kind.status().as_u16(),
                        err.kind.workers_code(),
                        "error",
                        prompt_tokens,
                        generated,
                        ttft_us,
                    ),
                    Some(Msg::Error(err)),
                )
            }
            End::Aborted => (
                ctx.usage(499, 3008, "aborted", prompt_tokens, generated, ttft_us),
                None,
            ),
            End::Shutdown => {
                let err = ApiError::new(
                    ErrorKind::Unavailable,
                    "the server is shutting down; the request was aborted",
                );
                (
                    ctx.usage(
                        503,
                        err.kind.workers_code(),
                        "aborted",
                        prompt_tokens,
                        generated,
                        ttft_us,
                    ),
                    Some(Msg::Error(err)),
                )
            }
        };
        // Release the limits first, so a client that sends its next request as
        // soon as it sees this one end is not refused by its own finished request;
        // then answer, then write the row (off the response's critical path; the
        // in-flight guard keeps shutdown waiting for it).
        permit.finish(record.input_tokens + record.output_tokens);
        drop(permit);
        if let Some(m) = msg {
            let _ = tx.send(m);
        }
        state.record(&record).await;
        drop(inflight);
    });
    rx
}
