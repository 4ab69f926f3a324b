//! One driver task per admitted request: it owns the engine's event receiver and
//! the request's limit permit, forwards text to the HTTP side, notices when the
//! client goes away (the HTTP side dropped its receiver) and then aborts by dropping
//! the engine receiver, and writes the usage row exactly once, right after the
//! final message (a client that saw its response end may see its row a moment
//! later).

use crate::error::{ApiError, ErrorKind};
use crate::server::{AppState, Ctx};
use std::sync::Arc;
use tessera_engine::engine::EngineError;
use tessera_engine::{Event, FinishReason};
use tessera_tenancy::Permit;
use tessera_transfer::protocol::RefusalKind;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

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
    mut events: UnboundedReceiver<Event>,
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
            Done(FinishReason, tessera_engine::engine::Usage),
            Error(EngineError),
            Aborted,
            Shutdown,
        }
        let end = loop {
            tokio::select! {
                biased;
                _ = tx.closed() => break End::Aborted,
                _ = abort.wait_for(|a| *a) => break End::Shutdown,
                ev = events.recv() => match ev {
                    Some(Event::Token { text, .. }) => {
                        generated += 1;
                        ttft.get_or_insert_with(|| ctx.started.elapsed());
                        if !text.is_empty() {
                            let _ = tx.send(Msg::Text(text));
                        }
                    }
                    Some(Event::Done { reason, usage }) => break End::Done(reason, usage),
                    Some(Event::Error(e)) => break End::Error(e),
                    None => break End::Error(EngineError::Shutdown),
                },
            }
        };
        // Tokens the engine already sent count as computed even if the client never
        // saw them.
        if matches!(end, End::Aborted | End::Shutdown) {
            while let Ok(ev) = events.try_recv() {
                if matches!(ev, Event::Token { .. }) {
                    generated += 1;
                }
            }
        }
        // Abort (if still running): the engine frees the request's pages when it
        // sees the closed channel.
        drop(events);
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
                let err = match &e {
                    // A node's own admission check (I1) refused it: the client's
                    // error, not ours.
                    EngineError::Refused(r) => {
                        tracing::info!(request_id = %ctx.rid, error = %e, "refused by a node");
                        let kind = match r.kind {
                            RefusalKind::TooLarge => ErrorKind::ContextOverflow,
                            RefusalKind::Invalid => ErrorKind::BadRequest,
                            RefusalKind::Busy => ErrorKind::Unavailable,
                        };
                        ApiError::new(kind, r.message.clone())
                    }
                    _ => {
                        tracing::error!(request_id = %ctx.rid, error = %e, "generation failed");
                        ApiError::new(ErrorKind::Internal, format!("generation failed: {e}"))
                    }
                };
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
