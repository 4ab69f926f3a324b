//! Where a request's events go, as the engine sees it: the client's stream in this
//! process, a node link to the gateway, or nowhere (a prefill node's sequence, whose
//! first token travels in the transfer commit instead).

use crate::Event;
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
