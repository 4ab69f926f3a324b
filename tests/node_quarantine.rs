//! Quarantined reservations, with real `tessera node` processes on loopback: a raw
//! gateway identity (`common/links.rs`) reserves decode pages naming a writer, then
//! its link closes (the coordinator died); the pages stay quarantined while a write
//! could still land, and go back to the pool once the writer says it is quiet or its
//! last link closed. The decode node's `tessera_kv_pages` shows each step.
//!
//! Every wait is bounded by a deadline; nothing asserts how fast anything runs.

mod common;

use common::links::*;
use common::metrics::*;
use common::*;
use serde_json::json;
use std::path::Path;
use std::time::{Duration, Instant};

/// The decode pool's pages, in pages (one context window of 16-token pages).
const POOL_PAGES: f64 = (CONTEXT / 16) as f64;

/// Scrapes decode node `d`'s `tessera_kv_pages` (free, quarantined) from `url` until
/// `ok` holds for them; panics with the logs of `dir` at the deadline.
async fn wait_pages(
    url: &str,
    d: u16,
    dir: &Path,
    what: &str,
    ok: impl Fn(f64, f64) -> bool,
) -> (f64, f64) {
    let series = |state: &str| {
        format!(r#"tessera_kv_pages{{node="127.0.0.1:{d}",role="decode",state="{state}"}}"#)
    };
    let deadline = Instant::now() + REQUEST;
    loop {
        let pages = (
            metric(url, &series("free")).await,
            metric(url, &series("quarantined")).await,
        );
        if ok(pages.0, pages.1) {
            return pages;
        }
        assert!(
            Instant::now() < deadline,
            "{what} never held: (free, quarantined) = {pages:?}\n{}",
            logs(dir)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A reservation whose coordinator dies before its writer heard of the request (a raw
/// gateway identity reserves it, naming the deployment's running prefill node as its
/// writer, and closes its link without ever sending `Prefill`) is quarantined (a
/// write could still come) and then freed while the prefill node stays up and keeps
/// its link: the decode node asks the writer whether it is quiet for the request,
/// and the writer, which holds no record of it, says so (and keeps a record that
/// would fail a late `Prefill`). The deployment then serves a request that needs the
/// whole decode pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reservation_its_writer_never_heard_of_is_freed_while_the_writer_runs() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = (free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
    let (mut dep, metrics) = Deployment::start_metered(dir, config, p, d).await;
    // One request: the prefill node's link to the decode node is up.
    dep.gateway.run_when_up(&greedy(4)).await;
    wait_pages(&metrics, d, dep.dir.path(), "a free pool", |free, _| {
        free == POOL_PAGES
    })
    .await;

    let certs = dep.dir.path().join("certs");
    let as_gateway = client(&certs.join("ca.pem"), Some(&identity(&certs, "gateway")));
    let mut gw = Raw::open(d, &node_name("decode", d), &as_gateway, "Coordinator").await;
    let r = raw_req(1);
    gw.send(&raw_prealloc(r, 20, 4, (20, 4), &dep.prefill_addr))
        .await;
    let pages = descriptor(&gw.reply(r).await);
    assert_eq!(pages.len(), 2);
    let (free, _) = wait_pages(&metrics, d, dep.dir.path(), "a reservation", |free, _| {
        free < POOL_PAGES
    })
    .await;
    // The coordinator dies; the prefill node never heard of the request.
    drop(gw);
    wait_pages(
        &metrics,
        d,
        dep.dir.path(),
        "the quarantined pages freed while the writer runs",
        |free, quarantined| free == POOL_PAGES && quarantined == 0.0,
    )
    .await;
    assert!(free < POOL_PAGES);
    let logs = dep.logs();
    for (role, node) in [("prefill", &mut dep.prefill), ("decode", &mut dep.decode)] {
        let node = node.as_mut().unwrap();
        assert!(
            node.try_wait().unwrap().is_none(),
            "the {role} node exited\n{logs}"
        );
    }
    dep.pool_is_free().await;
}

/// Two links from one writer identity (as across a reconnect, when the new link is up
/// before the old one is noticed closed): when one closes, the writer is not gone.
/// A raw gateway identity reserves a request naming the writer; the writer opens two
/// links; the decode node cuts the first (it sends a frame a prefill node may not
/// send), and a flush acknowledged on the second shows the cut was applied; then the
/// coordinator dies. The reservation is quarantined, not freed (writes from the open
/// link could still land), and the decode node asks the writer on its open link
/// whether it is quiet; once that last link closes too, the pages are free.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_of_two_writer_links_closing_does_not_free_a_quarantine() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = (free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
    // The prefill node in the file never runs: only the raw links carry its name.
    let (mut decode, metrics) =
        start_node_with_metrics(dir.path(), &config, "decode", d, &[]).await;
    let (as_gateway, as_writer) = gateway_and_writer(dir.path(), p);
    let decode_name = node_name("decode", d);
    let mut gw = Raw::open(d, &decode_name, &as_gateway, "Coordinator").await;
    let r = raw_req(1);
    gw.send(&raw_prealloc(r, 20, 4, (20, 4), &format!("127.0.0.1:{p}")))
        .await;
    let pages = descriptor(&gw.reply(r).await);
    assert_eq!(pages.len(), 2);

    let old = Raw::open(d, &decode_name, &as_writer, "Prefill").await;
    let mut new = Raw::open(d, &decode_name, &as_writer, "Prefill").await;
    let mut old = old;
    old.send(&frame(&json!("drain"), &[])).await;
    old.assert_cut("a drain frame from a prefill identity")
        .await;
    new.send(&frame(&json!({"flush": {"id": 1}}), &[])).await;
    let ack = new.until(|h| !h["flush_ack"].is_null()).await;
    assert_eq!(
        ack,
        Some(json!({"flush_ack": {"id": 1}})),
        "{}",
        logs(dir.path())
    );

    // The coordinator dies: quarantined, and the writer is asked on its open link.
    drop(gw);
    let (_, quarantined) = wait_pages(
        &metrics,
        d,
        dir.path(),
        "a quarantine while a writer link is open",
        |_, quarantined| quarantined > 0.0,
    )
    .await;
    assert_eq!(quarantined, 2.0);
    let query = new
        .until(|h| h["control"]["msg"]["type"] == "quiet_query")
        .await;
    assert_eq!(
        query.map(|h| h["control"]["msg"].clone()),
        Some(json!({"type": "quiet_query", "req": r})),
        "{}",
        logs(dir.path())
    );
    // A page the open link writes now is dropped, never applied.
    let (page_bytes, _) = model_shape();
    new.send(&land(r, &pages[0], &vec![0x11u8; page_bytes]))
        .await;

    // The writer's last link closes: nothing it issued can land any more.
    drop(new);
    wait_pages(
        &metrics,
        d,
        dir.path(),
        "the pages freed once the writer's last link closed",
        |free, quarantined| free == POOL_PAGES && quarantined == 0.0,
    )
    .await;
    assert!(decode.try_wait().unwrap().is_none(), "{}", logs(dir.path()));
}
