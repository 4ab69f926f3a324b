//! Connection limits over real sockets: slowloris clients (half a request head,
//! then silence) are closed by the header timeout while normal clients are served;
//! idle kept-alive connections and stalled TLS handshakes are closed; the
//! connection cap holds new clients back until a slot frees.

mod common;

use common::*;
use std::time::{Duration, Instant};
use tessera_gateway::{ConnLimits, GatewayOptions, TlsMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Reads until EOF or error; returns when the server closed the connection, or
/// `None` if it is still open at `deadline`.
async fn closed_by(c: &mut TcpStream, deadline: Instant) -> Option<Instant> {
    let mut buf = [0u8; 1024];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, c.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(Instant::now()),
            Ok(Ok(_)) => {} // an error response before the close is fine
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_slowloris_sockets_are_closed_within_the_header_timeout() {
    let header = Duration::from_secs(2);
    let cfg = GatewayOptions {
        conn: ConnLimits {
            header_read: header,
            keepalive_idle: Duration::from_secs(60),
            ..ConnLimits::default()
        },
        ..GatewayOptions::default()
    };
    let s = start_with(cfg).await;
    let mut socks = Vec::new();
    for _ in 0..200 {
        let mut c = TcpStream::connect(s.addr).await.unwrap();
        c.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            .await
            .unwrap();
        socks.push(c);
    }
    let sent = Instant::now();
    // A normal client keeps getting answers meanwhile (new connections each).
    let normal = async {
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap();
        for _ in 0..3 {
            let (st, _, v) = split(
                client
                    .post(s.run_url(&s.tenant.id))
                    .bearer_auth(&s.key)
                    .json(&serde_json::json!({"prompt": "Hi", "max_tokens": 2}))
                    .send()
                    .await
                    .unwrap(),
            )
            .await;
            assert_eq!(st, 200, "{v}");
            let h = client
                .get(format!("{}/healthz", s.base))
                .send()
                .await
                .unwrap();
            assert_eq!(h.status(), 200);
        }
    };
    let watch = async {
        let deadline = sent + header + Duration::from_secs(3);
        let mut latest = sent;
        for c in &mut socks {
            let at = closed_by(c, deadline)
                .await
                .expect("slowloris socket still open");
            latest = latest.max(at);
        }
        latest
    };
    let ((), latest) = tokio::join!(normal, watch);
    let took = latest.duration_since(sent);
    assert!(
        took >= header - Duration::from_millis(100),
        "closed too early: {took:?}"
    );
    eprintln!("200 slowloris sockets closed {took:?} after their last byte");
    let m = &s.state.metrics;
    let text = m.render(s.state.engine.stats(), 0);
    assert!(
        text.contains("tessera_connection_timeouts_total{phase=\"header\"} 200"),
        "{text}"
    );
    // Nothing reached the ledger.
    assert_eq!(s.row_count().await, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_keepalive_connections_and_stalled_tls_handshakes_are_closed() {
    let cfg = GatewayOptions {
        conn: ConnLimits {
            header_read: Duration::from_secs(30),
            keepalive_idle: Duration::from_millis(500),
            ..ConnLimits::default()
        },
        ..GatewayOptions::default()
    };
    let s = start_with(cfg).await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 512];
    let n = c.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    let answered = Instant::now();
    let at = closed_by(&mut c, answered + Duration::from_secs(5))
        .await
        .expect("idle connection still open");
    let idle = at.duration_since(answered);
    assert!(idle >= Duration::from_millis(400), "{idle:?}");
    assert!(s
        .state
        .metrics
        .render(s.state.engine.stats(), 0)
        .contains("tessera_connection_timeouts_total{phase=\"idle\"} 1"));
    drop(s);

    let cfg = GatewayOptions {
        tls: TlsMode::SelfSigned(None),
        conn: ConnLimits {
            tls_handshake: Duration::from_millis(500),
            header_read: Duration::from_secs(30),
            keepalive_idle: Duration::from_secs(30),
            ..ConnLimits::default()
        },
        ..GatewayOptions::default()
    };
    let s = start_with(cfg).await;
    let mut c = TcpStream::connect(s.addr).await.unwrap();
    c.write_all(&[0x16, 0x03, 0x01]).await.unwrap(); // the start of a ClientHello
    let start = Instant::now();
    let at = closed_by(&mut c, start + Duration::from_secs(5))
        .await
        .expect("stalled TLS handshake still open");
    assert!(at.duration_since(start) >= Duration::from_millis(400));
    assert!(s
        .state
        .metrics
        .render(s.state.engine.stats(), 0)
        .contains("tessera_connection_timeouts_total{phase=\"tls\"} 1"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_cap_holds_new_clients_until_a_slot_frees() {
    let cfg = GatewayOptions {
        conn: ConnLimits {
            max_connections: 4,
            header_read: Duration::from_secs(30),
            keepalive_idle: Duration::from_secs(30),
            ..ConnLimits::default()
        },
        ..GatewayOptions::default()
    };
    let s = start_with(cfg).await;
    let mut held = Vec::new();
    for _ in 0..4 {
        held.push(TcpStream::connect(s.addr).await.unwrap());
    }
    let mut open = false;
    for _ in 0..100 {
        if s.state.metrics.connections_open() == 4 {
            open = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(open);
    let mut fifth = TcpStream::connect(s.addr).await.unwrap(); // kernel backlog
    fifth
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut buf = vec![0u8; 512];
    let early = tokio::time::timeout(Duration::from_millis(500), fifth.read(&mut buf)).await;
    assert!(early.is_err(), "served beyond the cap");
    drop(held.pop());
    let n = tokio::time::timeout(Duration::from_secs(5), fifth.read(&mut buf))
        .await
        .expect("served once a slot freed")
        .unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
}
