//! The accept loop and per-connection serving, for the public and the admin
//! listener alike (plain HTTP or TLS):
//!
//! - at most [`ConnLimits::max_connections`] connections at once: the loop waits
//!   for a free slot before it accepts (new clients wait in the kernel's backlog);
//! - `accept` errors that concern one connection are skipped; resource errors
//!   (out of file descriptors: EMFILE/ENFILE, out of memory) back off from 10 ms
//!   doubling to 1 s instead of spinning ([`accept_backoff`]);
//! - the TLS handshake must finish within [`ConnLimits::tls_handshake`];
//! - hyper's own `header_read_timeout` closes a connection whose request head is
//!   not complete within [`ConnLimits::header_read`]; hyper starts that timer when
//!   it starts reading a head, which on a kept-alive connection is right after the
//!   previous response, so an idle connection never outlives it either;
//! - a connection with no request in flight and no byte read or written for
//!   [`ConnLimits::keepalive_idle`] is closed (the effective idle limit is the
//!   smaller of the two);
//! - on shutdown, every connection is told to finish its request in flight and
//!   close (hyper's graceful shutdown).
//!
//! Each request gets the peer address as axum's `ConnectInfo<SocketAddr>`.

use crate::state::AppState;
pub use crate::state::ConnLimits;
use axum::body::Body;
use axum::body::Bytes;
use axum::extract::ConnectInfo;
use axum::Router;
use hyper::body::Incoming;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tower::ServiceExt;

/// What to wait after `accept` failed with `e`, given the previous wait: `None`
/// when the error concerns only the connection being accepted (try the next one
/// now), else the next back-off step (10 ms, doubling, at most 1 s).
pub fn accept_backoff(e: &io::Error, prev: Option<Duration>) -> Option<Duration> {
    use io::ErrorKind as K;
    if matches!(
        e.kind(),
        K::ConnectionAborted | K::ConnectionReset | K::ConnectionRefused | K::Interrupted
    ) {
        return None;
    }
    let next = prev.map_or(Duration::from_millis(10), |d| d * 2);
    Some(next.min(Duration::from_secs(1)))
}

/// One connection's activity: requests in flight and the time of the last byte.
struct Activity {
    start: Instant,
    busy: AtomicUsize,
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            busy: AtomicUsize::new(0),
            last_ms: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        self.last_ms
            .store(self.start.elapsed().as_millis() as u64, Ordering::Relaxed);
    }

    fn idle_for(&self) -> Option<Duration> {
        if self.busy.load(Ordering::Acquire) > 0 {
            return None;
        }
        let now = self.start.elapsed().as_millis() as u64;
        Some(Duration::from_millis(
            now.saturating_sub(self.last_ms.load(Ordering::Relaxed)),
        ))
    }
}

/// Counts one request in flight on its connection until the response body is
/// done (dropped).
struct Busy(Arc<Activity>);

impl Busy {
    fn new(a: &Arc<Activity>) -> Self {
        a.busy.fetch_add(1, Ordering::AcqRel);
        Self(a.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.touch();
        self.0.busy.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A response body that keeps its request counted as in flight.
struct TrackedBody {
    inner: Body,
    _busy: Busy,
}

impl http_body::Body for TrackedBody {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// An IO stream that records when a byte last moved.
struct Tracked<S> {
    io: S,
    activity: Arc<Activity>,
}

impl<S: AsyncRead + Unpin> AsyncRead for Tracked<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.io).poll_read(cx, buf);
        if matches!(r, Poll::Ready(Ok(()))) && buf.filled().len() > before {
            self.activity.touch();
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Tracked<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(r, Poll::Ready(Ok(n)) if n > 0) {
            self.activity.touch();
        }
        r
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// Counts an open connection in the metrics until dropped.
struct OpenConn(Arc<AppState>);

impl Drop for OpenConn {
    fn drop(&mut self) {
        self.0.metrics.connection(false);
    }
}

/// Accepts and serves connections until `shutdown` turns true; then stops
/// accepting (the listener is dropped) and tells every connection to close after
/// its request in flight. Returns once the listener is closed; connections finish
/// on their own tasks.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    tls: Option<tokio_rustls::TlsAcceptor>,
    limits: ConnLimits,
    state: Arc<AppState>,
    mut shutdown: watch::Receiver<bool>,
) {
    let slots = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let mut backoff: Option<Duration> = None;
    loop {
        let permit = tokio::select! {
            _ = shutdown.wait_for(|s| *s) => break,
            p = slots.clone().acquire_owned() => match p {
                Ok(p) => p,
                Err(_) => break,
            },
        };
        let accepted = tokio::select! {
            _ = shutdown.wait_for(|s| *s) => break,
            r = listener.accept() => r,
        };
        let (tcp, peer) = match accepted {
            Ok(x) => {
                backoff = None;
                x
            }
            Err(e) => {
                state.metrics.accept_error();
                if let Some(wait) = accept_backoff(&e, backoff) {
                    if backoff.is_none() {
                        tracing::warn!(error = %e, "accept failed; backing off");
                    }
                    backoff = Some(wait);
                    tokio::select! {
                        _ = shutdown.wait_for(|s| *s) => break,
                        _ = tokio::time::sleep(wait) => {}
                    }
                }
                continue;
            }
        };
        let router = router.clone();
        let tls = tls.clone();
        let state = state.clone();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let _permit = permit;
            state.metrics.connection(true);
            let _open = OpenConn(state.clone());
            let _ = tcp.set_nodelay(true);
            let activity = Arc::new(Activity::new());
            match tls {
                None => {
                    let io = Tracked {
                        io: tcp,
                        activity: activity.clone(),
                    };
                    connection(io, router, peer, false, limits, activity, &state, shutdown).await;
                }
                Some(acceptor) => {
                    match tokio::time::timeout(limits.tls_handshake, acceptor.accept(tcp)).await {
                        Ok(Ok(s)) => {
                            let io = Tracked {
                                io: s,
                                activity: activity.clone(),
                            };
                            connection(io, router, peer, true, limits, activity, &state, shutdown)
                                .await;
                        }
                        Ok(Err(e)) => tracing::debug!(%peer, error = %e, "TLS handshake failed"),
                        Err(_) => {
                            state.metrics.connection_timeout("tls");
                            tracing::debug!(%peer, "TLS handshake timed out");
                        }
                    }
                }
            }
        });
    }
}

/// Marks a request that came over TLS (request extension; the dashboard's cookies
/// are `Secure` then).
#[derive(Clone, Copy, Debug)]
pub(crate) struct OverTls;

/// Serves one connection (HTTP/1.1) until it closes; `over_tls`: it is a TLS one.
#[allow(clippy::too_many_arguments)]
async fn connection<S>(
    io: Tracked<S>,
    router: Router,
    peer: SocketAddr,
    over_tls: bool,
    limits: ConnLimits,
    activity: Arc<Activity>,
    state: &AppState,
    mut shutdown: watch::Receiver<bool>,
) where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    let act = activity.clone();
    let svc = hyper::service::service_fn(move |mut req: hyper::Request<Incoming>| {
        req.extensions_mut().insert(ConnectInfo(peer));
        if over_tls {
            req.extensions_mut().insert(OverTls);
        }
        let busy = Busy::new(&act);
        let router = router.clone();
        async move {
            let resp = router.oneshot(req).await?;
            Ok::<_, std::convert::Infallible>(
                resp.map(|inner| Body::new(TrackedBody { inner, _busy: busy })),
            )
        }
    });
    let mut builder = hyper::server::conn::http1::Builder::new();
    builder
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read)
        .keep_alive(true);
    let conn = builder.serve_connection(TokioIo::new(io), svc);
    tokio::pin!(conn);
    let tick = (limits.keepalive_idle / 4).clamp(Duration::from_millis(20), Duration::from_secs(1));
    let mut closing = false;
    loop {
        tokio::select! {
            r = conn.as_mut() => {
                if let Err(e) = r {
                    if e.is_timeout() {
                        state.metrics.connection_timeout("header");
                    }
                    tracing::debug!(%peer, error = %e, "connection error");
                }
                return;
            }
            _ = shutdown.wait_for(|s| *s), if !closing => {
                closing = true;
                conn.as_mut().graceful_shutdown();
            }
            _ = tokio::time::sleep(tick), if !closing => {
                if activity.idle_for().is_some_and(|d| d >= limits.keepalive_idle) {
                    state.metrics.connection_timeout("idle");
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accept_backoff_skips_per_connection_errors_and_backs_off_on_resources() {
        let aborted = io::Error::from(io::ErrorKind::ConnectionAborted);
        assert_eq!(accept_backoff(&aborted, None), None);
        let emfile = io::Error::from_raw_os_error(24); // EMFILE
        let mut waits = vec![];
        let mut prev = None;
        for _ in 0..9 {
            prev = accept_backoff(&emfile, prev);
            waits.push(prev.unwrap().as_millis());
        }
        assert_eq!(waits, [10, 20, 40, 80, 160, 320, 640, 1000, 1000]);
    }
}
