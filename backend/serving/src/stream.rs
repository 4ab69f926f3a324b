//! A request's stream as its submitter sees it ([`RequestStream`]) and as the serving
//! side feeds it ([`ClientSink`]).
//!
//! Three things travel between them:
//! - events: tokens, then one `Done` or `Error` ([`StreamEvent`]);
//! - cancellation: [`RequestStream::cancel`] (or dropping the stream) asks every node
//!   holding the request to abort it (I6);
//! - release: [`RequestStream::released`] resolves once nothing is held for the
//!   request anywhere (every node acknowledged its abort or end, or is known dead, or
//!   the engine freed its pages). The gateway waits for it before it returns the
//!   tenant's permits and writes the usage row, so usage counts what was computed.

use crate::error::ServeError;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tessera_engine::sink::{EventSink, Gone};
use tessera_engine::Event;
use tessera_transfer::protocol::{StreamFence, StreamItem};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::sync::oneshot;

/// What a request's stream receives, in order: tokens, then one `Done` or `Error`
/// (none when the request was cancelled): the engine's [`Event`] with the serving
/// layer's error.
pub type StreamEvent = Event<ServeError>;

/// Signals release when dropped: its owner held the last resource of the request.
#[derive(Debug)]
pub(crate) struct ReleaseGuard(Option<oneshot::Sender<()>>);

impl Drop for ReleaseGuard {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

/// What a stream's client received, under the stream's lock.
#[derive(Debug)]
struct Delivered {
    fence: StreamFence,
    /// Every token id the client received, in order.
    tokens: Vec<u32>,
    /// The sampler's RNG word position after the last of them.
    rng_word_pos: u64,
    /// The client's last token, or the current attempt's start.
    progress: Instant,
}

/// Where a restarted request continues: the tokens its client has (empty: from
/// the beginning) and the sampler's RNG position after them.
#[derive(Debug)]
pub(crate) struct Continue {
    pub(crate) tokens: Vec<u32>,
    pub(crate) rng_word_pos: u64,
}

/// The serving side of a request's stream: where events go, whether the client
/// cancelled, and (for its one owner) the release guard.
#[derive(Debug)]
pub struct ClientSink {
    tx: UnboundedSender<StreamEvent>,
    cancel: Arc<AtomicBool>,
    /// Which attempt of the request may write to the client and what reached it
    /// (shared by every sink of the stream; events are sent under its lock, so a
    /// restart decided on it is never followed by an old attempt's token).
    shared: Arc<Mutex<Delivered>>,
    /// The attempt this sink writes for.
    attempt: u32,
    /// Held, never read: dropping it is the release signal.
    _release: Option<ReleaseGuard>,
}

impl ClientSink {
    /// Another sink for the same stream without the release guard (a decode engine
    /// streams into it while the coordinator owns the release).
    pub fn detached(&self) -> Self {
        Self {
            tx: self.tx.clone(),
            cancel: self.cancel.clone(),
            shared: self.shared.clone(),
            attempt: self.attempt,
            _release: None,
        }
    }

    /// Sends an event; false when the stream's receiver is gone or the event's
    /// attempt was fenced off (a restarted request: its old attempt is dropped).
    pub fn send_event(&self, ev: StreamEvent) -> bool {
        let item = match ev {
            StreamEvent::Token { .. } => StreamItem::Token,
            StreamEvent::Done { .. } | StreamEvent::Error(_) => StreamItem::End,
        };
        let mut d = self.lock();
        if !d.fence.admit(self.attempt, item) {
            return false;
        }
        if let StreamEvent::Token {
            id, rng_word_pos, ..
        } = &ev
        {
            d.tokens.push(*id);
            d.rng_word_pos = *rng_word_pos;
            d.progress = Instant::now();
        }
        self.tx.send(ev).is_ok()
    }

    /// Ends the stream with `e` (I8).
    pub fn fail(&self, e: ServeError) {
        self.send_event(StreamEvent::Error(e));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Delivered> {
        self.shared.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Runs `decide` (the retry decision, issue 36) with the stream's lock held, on
    /// its fence, the tokens the client has and how long it has waited without
    /// progress (since its last token or the current attempt's start), and moves
    /// this sink to the attempt `decide` returns, if any. Returns that attempt with
    /// the client's tokens and the RNG position after them: where it continues.
    pub(crate) fn decide_restart(
        &mut self,
        decide: impl FnOnce(&mut StreamFence, &[u32], Duration) -> Option<u32>,
    ) -> Option<Continue> {
        let shared = self.shared.clone();
        let mut d = shared.lock().unwrap_or_else(|p| p.into_inner());
        let Delivered {
            fence,
            tokens,
            progress,
            ..
        } = &mut *d;
        let attempt = decide(fence, tokens, progress.elapsed())?;
        self.attempt = attempt;
        d.progress = Instant::now();
        Some(Continue {
            tokens: d.tokens.clone(),
            rng_word_pos: d.rng_word_pos,
        })
    }

    /// Whether the client cancelled or dropped its stream.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.load(Ordering::Acquire) || self.tx.is_closed()
    }
}

impl EventSink for ClientSink {
    fn send(&mut self, event: Event) -> Result<(), Gone> {
        if self.send_event(event.map_error(ServeError::from)) {
            Ok(())
        } else {
            Err(Gone)
        }
    }

    /// The client left, or this sink's attempt was fenced off (its request started
    /// again elsewhere): either way nobody reads what it computes.
    fn cancelled(&self) -> bool {
        self.is_cancelled() || self.lock().fence.attempt() != self.attempt
    }
}

/// A submitted request's stream: its events, its cancellation, its release.
#[derive(Debug)]
pub struct RequestStream {
    rx: UnboundedReceiver<StreamEvent>,
    cancel: Arc<AtomicBool>,
    released: Option<oneshot::Receiver<()>>,
}

impl RequestStream {
    /// The next event; `None` once the stream ended and every sender is gone.
    pub async fn recv(&mut self) -> Option<StreamEvent> {
        self.rx.recv().await
    }

    /// The next event if one is queued.
    pub fn try_recv(&mut self) -> Option<StreamEvent> {
        self.rx.try_recv().ok()
    }

    /// The next event, blocking the thread (not for async contexts).
    pub fn blocking_recv(&mut self) -> Option<StreamEvent> {
        self.rx.blocking_recv()
    }

    /// Asks every node holding the request to abort it (I6). Events already sent stay
    /// readable; the stream closes once every node let go.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Release);
    }

    /// Whether [`Self::cancel`] was called.
    pub fn is_cancelled(&self) -> bool {
        self.cancel.load(Ordering::Acquire)
    }

    /// Resolves once nothing is held for the request anywhere (pages freed on every
    /// node, every abort acknowledged or its node known dead). Returns at once after
    /// the first time.
    pub async fn released(&mut self) {
        if let Some(rx) = &mut self.released {
            let _ = rx.await;
            self.released = None;
        }
    }

    /// [`Self::released`] without waiting: whether it has happened.
    pub fn is_released(&mut self) -> bool {
        match &mut self.released {
            None => true,
            Some(rx) => match rx.try_recv() {
                Err(oneshot::error::TryRecvError::Empty) => false,
                _ => {
                    self.released = None;
                    true
                }
            },
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        self.cancel();
    }
}

/// A new request's two ends; the sink holds the release guard.
pub fn request_channel() -> (ClientSink, RequestStream) {
    let (tx, rx) = unbounded_channel();
    let (rtx, rrx) = oneshot::channel();
    let cancel = Arc::new(AtomicBool::new(false));
    (
        ClientSink {
            tx,
            cancel: cancel.clone(),
            shared: Arc::new(Mutex::new(Delivered {
                fence: StreamFence::default(),
                tokens: Vec::new(),
                rng_word_pos: 0,
                progress: Instant::now(),
            })),
            attempt: 0,
            _release: Some(ReleaseGuard(Some(rtx))),
        },
        RequestStream {
            rx,
            cancel,
            released: Some(rrx),
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn release_follows_the_guard_not_the_events() {
        let (sink, mut stream) = request_channel();
        let decode = sink.detached();
        assert!(decode.send_event(StreamEvent::Token {
            id: 1,
            text: "a".into(),
            logprobs: None,
            rng_word_pos: 0,
        }));
        drop(decode);
        assert!(!stream.is_released(), "the guard's owner still holds it");
        stream.cancel();
        assert!(sink.is_cancelled());
        drop(sink);
        stream.released().await;
        assert!(stream.is_released());
        assert!(matches!(
            stream.recv().await,
            Some(StreamEvent::Token { .. })
        ));
        assert_eq!(stream.recv().await, None);
    }

    #[test]
    fn dropping_the_stream_cancels() {
        let (sink, stream) = request_channel();
        assert!(!sink.is_cancelled());
        drop(stream);
        assert!(sink.is_cancelled());
    }
}
