//! Node links over TCP: the frame format and connections whose writes run on their own
//! thread, so no engine or coordinator thread ever blocks on a socket.
//!
//! Frame: `u32` big-endian header length, the header as JSON ([`Frame`]), `u32`
//! big-endian payload length, the payload (page bytes for `Land`, else empty).
//!
//! Connections (one per pair, opened by the caller):
//! - gateway -> every node: protocol messages both ways; a decode node also streams
//!   each request's events (tokens, then `Done` or `Error`) on it, always before the
//!   `Finished` that follows them (one writer queue per connection keeps the order);
//! - prefill node -> every decode node: `Commit`s, and page writes for the `tcp`
//!   transport (a `Land` frame per page, a `Flush` answered by `FlushAck` once the
//!   decode node applied every earlier write).

use crate::error::{ServeError, ServeErrorKind};
use crate::stream::StreamEvent;
use serde::{Deserialize, Serialize};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;
use tessera_engine::{Event, FinishReason, GenerateRequest, Usage};
use tessera_transfer::protocol::{Msg, ReqId, Role};
use tessera_transfer::transport::DestPage;
use tessera_transfer::ucx::UcxRegionDescriptor;

/// Largest frame header or payload accepted (a page of a large model is a few MB).
pub(crate) const MAX_FRAME: u32 = 256 << 20;
/// Frames a connection queues for its writer before it counts as stalled: a sender
/// that finds the queue full closes the connection (the peer is not reading).
pub(crate) const WRITE_QUEUE: usize = 4096;

/// One frame's header. Externally tagged: serde's internally tagged enums buffer
/// their content, which cannot hold the `u128` sampler position.
// A frame lives only between a socket read and its dispatch; boxing the control
// variant would cost an allocation per message for no memory saved.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum Frame {
    /// First frame on a connection: the caller's role and, for a node, its name (its
    /// listen address in the deployment file).
    Hello {
        from: Role,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        name: Option<String>,
    },
    /// A protocol message, with what the protocol leaves out.
    Control(Control),
    /// One page write; the payload is the page.
    Land { req: u64, dest: DestPage },
    /// Answer `FlushAck { id }` once every earlier frame was applied.
    Flush { id: u64 },
    /// See `Flush`.
    FlushAck { id: u64 },
    /// Decode node -> gateway: one event of a request's stream.
    Event { req: ReqId, event: WireEvent },
    /// Decode node -> prefill node, answering its `Hello`: where UCX puts go, when
    /// the decode node registered its pool with UCX (`None`: TCP frames only).
    Region { ucx: Option<UcxRegionDescriptor> },
}

/// A protocol message on the wire, with what the protocol leaves out: the request body
/// (`Prealloc`, `Prefill`), the decode node chosen (`Prefill`), the prefill node
/// assigned to write (`Prealloc`), the sampler position and the prompt tokens taken
/// from the prefill node's cache (`Commit`).
#[derive(Debug, Serialize, Deserialize)]
pub(crate) struct Control {
    pub(crate) msg: Msg,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) body: Option<GenerateRequest>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) decode: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) rng_pos: Option<u128>,
    /// Prompt tokens the prefill node took from its prefix cache (`Commit`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) cached_tokens: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) prefill: Option<String>,
    /// The request's W3C `traceparent` (with `Prealloc` and `Prefill`, when the
    /// gateway exports traces), so the node's spans join the request's trace.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) trace: Option<String>,
}

impl Control {
    /// The message with nothing beside it.
    pub(crate) fn new(msg: Msg) -> Self {
        Self {
            msg,
            body: None,
            decode: None,
            rng_pos: None,
            cached_tokens: None,
            prefill: None,
            trace: None,
        }
    }
}

impl Frame {
    /// A control frame with nothing beside the message.
    pub(crate) fn control(msg: Msg) -> Self {
        Self::Control(Control::new(msg))
    }
}

/// A stream event on the wire.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub(crate) enum WireEvent {
    Token {
        id: u32,
        text: String,
    },
    Done {
        stop: bool,
        prompt_tokens: usize,
        completion_tokens: usize,
        #[serde(default)]
        cached_tokens: usize,
        ttft_us: u64,
        tpot_us: u64,
    },
    Error {
        kind: ServeErrorKind,
        message: String,
    },
}

impl WireEvent {
    /// An engine event as the decode node sends it.
    pub(crate) fn from_event(e: Event) -> Self {
        match StreamEvent::from(e) {
            StreamEvent::Token { id, text } => Self::Token { id, text },
            StreamEvent::Done { reason, usage } => Self::Done {
                stop: reason == FinishReason::Stop,
                prompt_tokens: usage.prompt_tokens,
                completion_tokens: usage.completion_tokens,
                cached_tokens: usage.cached_tokens,
                ttft_us: usage.ttft.as_micros() as u64,
                tpot_us: usage.tpot.as_micros() as u64,
            },
            StreamEvent::Error(e) => Self::Error {
                kind: e.kind(),
                message: e.message().to_string(),
            },
        }
    }

    /// The event as the gateway's stream receives it.
    pub(crate) fn into_stream_event(self) -> StreamEvent {
        match self {
            Self::Token { id, text } => StreamEvent::Token { id, text },
            Self::Done {
                stop,
                prompt_tokens,
                completion_tokens,
                cached_tokens,
                ttft_us,
                tpot_us,
            } => StreamEvent::Done {
                reason: if stop {
                    FinishReason::Stop
                } else {
                    FinishReason::Length
                },
                usage: Usage {
                    prompt_tokens,
                    completion_tokens,
                    cached_tokens,
                    ttft: Duration::from_micros(ttft_us),
                    tpot: Duration::from_micros(tpot_us),
                },
            },
            Self::Error { kind, message } => StreamEvent::Error(ServeError::new(kind, message)),
        }
    }

    /// Whether it ends the stream.
    pub(crate) fn is_final(&self) -> bool {
        !matches!(self, Self::Token { .. })
    }
}

/// Encodes one frame.
fn encode(f: &Frame, payload: &[u8]) -> io::Result<Vec<u8>> {
    let header = serde_json::to_vec(f).map_err(io::Error::other)?;
    let mut buf = Vec::with_capacity(8 + header.len() + payload.len());
    buf.extend_from_slice(&(header.len() as u32).to_be_bytes());
    buf.extend_from_slice(&header);
    buf.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    buf.extend_from_slice(payload);
    Ok(buf)
}

fn read_len(r: &mut impl Read) -> io::Result<usize> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    let n = u32::from_be_bytes(b);
    if n > MAX_FRAME {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {n} bytes exceeds the {MAX_FRAME} byte limit"),
        ));
    }
    Ok(n as usize)
}

/// Reads one frame.
///
/// Errors: the connection closed or failed, a length over [`MAX_FRAME`], a header
/// that is not a [`Frame`].
pub(crate) fn read_frame(r: &mut impl Read) -> io::Result<(Frame, Vec<u8>)> {
    let mut header = vec![0u8; read_len(r)?];
    r.read_exact(&mut header)?;
    let f: Frame = serde_json::from_slice(&header)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    let mut payload = vec![0u8; read_len(r)?];
    r.read_exact(&mut payload)?;
    Ok((f, payload))
}

/// The writing half of a connection: frames are queued and written by the
/// connection's writer thread, in order.
#[derive(Debug)]
pub(crate) struct Conn {
    tx: mpsc::SyncSender<Vec<u8>>,
    stream: TcpStream,
    alive: Arc<AtomicBool>,
}

impl Conn {
    /// Starts the writer thread of `stream`.
    pub(crate) fn new(stream: TcpStream) -> io::Result<Arc<Self>> {
        stream.set_nodelay(true)?;
        let (tx, rx) = mpsc::sync_channel::<Vec<u8>>(WRITE_QUEUE);
        let alive = Arc::new(AtomicBool::new(true));
        let mut w = BufWriter::new(stream.try_clone()?);
        let sock = stream.try_clone()?;
        let a = alive.clone();
        std::thread::Builder::new()
            .name("tessera-conn-writer".into())
            .spawn(move || {
                while let Ok(buf) = rx.recv() {
                    let mut ok = w.write_all(&buf).is_ok();
                    // Batch what is already queued into one flush.
                    while ok {
                        match rx.try_recv() {
                            Ok(buf) => ok = w.write_all(&buf).is_ok(),
                            Err(_) => break,
                        }
                    }
                    if !ok || w.flush().is_err() {
                        a.store(false, Ordering::Release);
                        let _ = sock.shutdown(Shutdown::Both);
                        return;
                    }
                }
            })?;
        Ok(Arc::new(Self { tx, stream, alive }))
    }

    /// Queues a frame without blocking. A full queue means the peer stopped reading:
    /// the connection is closed. Returns whether the frame was queued.
    pub(crate) fn try_send(&self, f: &Frame, payload: &[u8]) -> bool {
        if !self.is_alive() {
            return false;
        }
        let Ok(buf) = encode(f, payload) else {
            return false;
        };
        match self.tx.try_send(buf) {
            Ok(()) => true,
            Err(mpsc::TrySendError::Full(_)) => {
                tracing::warn!(peer = ?self.stream.peer_addr().ok(), "peer stopped reading; closing the connection");
                self.close();
                false
            }
            Err(mpsc::TrySendError::Disconnected(_)) => {
                self.close();
                false
            }
        }
    }

    /// Queues a frame, waiting for room (transfer workers only: they may block).
    pub(crate) fn send(&self, f: &Frame, payload: &[u8]) -> bool {
        if !self.is_alive() {
            return false;
        }
        let Ok(buf) = encode(f, payload) else {
            return false;
        };
        self.tx.send(buf).is_ok()
    }

    /// Queues a protocol message.
    pub(crate) fn control(&self, msg: Msg) -> bool {
        self.try_send(&Frame::control(msg), &[])
    }

    /// Closes both directions (readers see end of stream).
    pub(crate) fn close(&self) {
        self.alive.store(false, Ordering::Release);
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// Whether the connection is still usable.
    pub(crate) fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Acquire)
    }
}

impl crate::links::Link for Conn {
    fn close(&self) {
        Conn::close(self);
    }
}

impl crate::links::Reply for Conn {
    fn send(&self, msg: Msg) -> bool {
        self.control(msg)
    }
}

/// Connects to `addr` (2 s timeout): the writing half and a buffered reader.
pub(crate) fn connect(addr: &str) -> io::Result<(Arc<Conn>, BufReader<TcpStream>)> {
    let sa = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| io::Error::new(io::ErrorKind::NotFound, format!("no address for {addr}")))?;
    let stream = TcpStream::connect_timeout(&sa, Duration::from_secs(2))?;
    let conn = Conn::new(stream.try_clone()?)?;
    Ok((conn, BufReader::new(stream)))
}
