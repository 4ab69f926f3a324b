//! Node membership without restarts, as real processes: `tessera serve --config`
//! re-reads its deployment file on SIGHUP or `POST /admin/v1/reload` (`tessera ops
//! reload`). Added nodes are checked (link identity, model) and then get traffic;
//! removed nodes get no new requests, finish what they hold and are dropped; a file
//! that is invalid, changes more than membership or names a node that fails its
//! check is refused as a whole while the old membership serves on; the endpoint
//! needs the admin token.
//!
//! Every wait is bounded by a deadline; nothing asserts how fast anything runs.

mod common;

use common::metrics::gateway_metric;
use common::*;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The deployment file `dir/tessera.toml` with these prefill and decode nodes (pools
/// of one context window each) and mutual TLS links; certificates for every node it
/// lists are issued into `dir/certs` (the CA is made once).
fn write_file(dir: &Path, gateway: u16, prefill: &[u16], decode: &[u16]) -> PathBuf {
    let path = write_config(dir, gateway, prefill[0], decode, (CONTEXT, CONTEXT));
    if prefill.len() > 1 {
        let list: Vec<String> = prefill
            .iter()
            .map(|p| format!("\"127.0.0.1:{p}\""))
            .collect();
        let text = std::fs::read_to_string(&path).unwrap().replacen(
            &format!("nodes = [\"127.0.0.1:{}\"]", prefill[0]),
            &format!("nodes = [{}]", list.join(", ")),
            1,
        );
        std::fs::write(&path, text).unwrap();
        issue_certs(&path, &dir.join("certs"));
    }
    path
}

/// The gateway's admin token (written to its data dir on first start).
fn admin_token(dir: &Path) -> String {
    std::fs::read_to_string(dir.join("data/admin-token"))
        .unwrap()
        .trim()
        .to_string()
}

/// `POST /admin/v1/reload` with `token` (none: no header): (status, body).
async fn reload(gw: &Gateway, token: Option<&str>) -> (u16, Value) {
    let mut req = reqwest::Client::new()
        .post(format!("{}/admin/v1/reload", gw.base))
        .timeout(REQUEST);
    if let Some(t) = token {
        req = req.bearer_auth(t);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

/// One row of `GET /admin/v1/nodes`.
#[derive(Debug)]
struct Member {
    addr: String,
    state: String,
    outstanding: u64,
    assigned: u64,
}

/// `GET /admin/v1/nodes`: the model's nodes.
async fn nodes(gw: &Gateway, token: &str) -> Vec<Member> {
    let v: Value = reqwest::Client::new()
        .get(format!("{}/admin/v1/nodes", gw.base))
        .bearer_auth(token)
        .timeout(REQUEST)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["success"], true, "{v}");
    v["result"][0]["nodes"]
        .as_array()
        .unwrap_or_else(|| panic!("no nodes in {v}"))
        .iter()
        .map(|n| Member {
            addr: n["addr"].as_str().unwrap().to_string(),
            state: n["state"].as_str().unwrap().to_string(),
            outstanding: n["outstanding"].as_u64().unwrap(),
            assigned: n["assigned"].as_u64().unwrap(),
        })
        .collect()
}

/// The node at `addr` in `list`.
fn node<'a>(list: &'a [Member], addr: &str) -> Option<&'a Member> {
    list.iter().find(|n| n.addr == addr)
}

/// With the first node busy on a long stream (dropped at the end), `body` goes to
/// the node at `new`, which answers `solo` (the same text the old nodes gave).
async fn goes_to_the_new_node(
    gw: &Gateway,
    token: &str,
    dir: &Path,
    body: &Value,
    solo: &str,
    new: &str,
) {
    let mut busy = gw.stream(&endless(2000)).await;
    busy.read_texts(2).await;
    let mut r = gw.stream(body).await;
    r.read_to_end().await;
    assert!(
        r.has_done() && !r.has_error(),
        "{:?}\n{}",
        r.events,
        logs(dir)
    );
    assert_eq!(r.text(), solo, "{new}'s answer differs");
    let table = nodes(gw, token).await;
    assert_eq!(node(&table, new).unwrap().assigned, 1, "{table:?}");
    assert!(!busy.has_error(), "{:?}", busy.events.last());
}

fn addr(port: u16) -> String {
    format!("127.0.0.1:{port}")
}

/// `tessera_config_reloads_total` for `outcome` (`applied` or `refused`), read from
/// `/metrics` with the admin token; 0 when absent.
async fn reloads(gw: &Gateway, token: &str, outcome: &str) -> f64 {
    let series = format!("tessera_config_reloads_total{{outcome=\"{outcome}\"}}");
    gateway_metric(gw, token, &series).await.0
}

/// Waits until `path` contains `needle` (a log line), or panics at the deadline.
async fn wait_for_log(path: &Path, needle: &str, logs_of: &Path) {
    let deadline = Instant::now() + START;
    while !std::fs::read_to_string(path)
        .unwrap_or_default()
        .contains(needle)
    {
        assert!(
            Instant::now() < deadline,
            "no `{needle}` in {}\n{}",
            path.display(),
            logs(logs_of)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Sends SIGHUP to `child`.
fn hup(child: &tokio::process::Child) {
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-HUP", &pid])
        .status()
        .unwrap()
        .success());
}

/// A gateway with one prefill and one decode node gets a second decode node by
/// `tessera ops reload`: while a stream holds the first decode node, the next request
/// goes to the new one, written by the old prefill node (whose file does not list
/// it: the gateway names it by address). Then a second prefill node by `POST
/// /admin/v1/reload` (the running decode nodes learn it on SIGHUP): while a stream
/// holds the first pair, the next request is served by the new prefill node. Every
/// answer equals the one from before the reloads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nodes_added_by_a_reload_get_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let (gw_port, p0, p1, d0, d1) = (
        free_port(),
        free_port(),
        free_port(),
        free_port(),
        free_port(),
    );
    let config = write_file(dir.path(), gw_port, &[p0], &[d0]);
    let decode0 = start_node(dir.path(), &config, "decode", d0).await;
    let _prefill0 = start_node(dir.path(), &config, "prefill", p0).await;
    let gw = start_config_gateway(dir.path(), &config, "data", "gateway.log", &[]).await;
    let token = admin_token(dir.path());
    let body = endless(16);
    let mut solo = gw.stream(&body).await;
    solo.read_to_end().await;
    assert!(
        solo.has_done() && !solo.has_error(),
        "{:?}\n{}",
        solo.events,
        logs(dir.path())
    );

    // A decode node: started on the new file, then `tessera ops reload`.
    write_file(dir.path(), gw_port, &[p0], &[d0, d1]);
    let decode1 = start_node(dir.path(), &config, "decode", d1).await;
    let token_file = dir.path().join("data/admin-token");
    let out = std::process::Command::new(BIN)
        .args([
            "ops",
            "reload",
            "--url",
            &gw.base,
            "--admin-token-file",
            token_file.to_str().unwrap(),
        ])
        .env_remove("TESSERA_ADMIN_TOKEN")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        logs(dir.path())
    );
    assert!(stdout.contains(&addr(d1)), "{stdout}");
    let table = nodes(&gw, &token).await;
    assert_eq!(table.len(), 3, "{table:?}");
    assert!(table.iter().all(|n| n.state == "up"), "{table:?}");
    assert_eq!(node(&table, &addr(d1)).unwrap().assigned, 0, "{table:?}");
    // Decode 0 is busy with a long stream: the next request goes to decode 1.
    goes_to_the_new_node(&gw, &token, dir.path(), &body, &solo.text(), &addr(d1)).await;
    // Both decode nodes free again (the dropped stream released).
    let deadline = Instant::now() + REQUEST;
    while nodes(&gw, &token).await.iter().any(|n| n.outstanding > 0) {
        assert!(Instant::now() < deadline, "{}", logs(dir.path()));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A prefill node: the decode nodes re-read the file on SIGHUP first.
    write_file(dir.path(), gw_port, &[p0, p1], &[d0, d1]);
    let _prefill1 = start_node(dir.path(), &config, "prefill", p1).await;
    hup(&decode0);
    hup(&decode1);
    let d1_log = format!("decode-{d1}.log");
    for log in ["decode.log", d1_log.as_str()] {
        wait_for_log(&dir.path().join(log), "SIGHUP: re-read", dir.path()).await;
    }
    let (status, v) = reload(&gw, Some(&token)).await;
    assert_eq!(status, 200, "{v}\n{}", logs(dir.path()));
    assert_eq!(
        v["result"]["changed"][0]["added"],
        json!([{"role": "prefill", "addr": addr(p1)}]),
        "{v}"
    );
    let table = nodes(&gw, &token).await;
    assert_eq!(table.len(), 4, "{table:?}");
    // The first pair is busy with a long stream: the next goes to the new prefill node.
    goes_to_the_new_node(&gw, &token, dir.path(), &body, &solo.text(), &addr(p1)).await;
    assert_eq!(reloads(&gw, &token, "applied").await, 2.0);
}

/// A decode node removed by a reload (SIGHUP here) keeps the stream it holds until
/// it ends, gets no new request, and is then dropped from the gateway's table;
/// the other node serves everything sent meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_node_finishes_its_stream_gets_nothing_new_and_is_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let (gw_port, p, d0, d1) = (free_port(), free_port(), free_port(), free_port());
    let config = write_file(dir.path(), gw_port, &[p], &[d0, d1]);
    let _decode0 = start_node(dir.path(), &config, "decode", d0).await;
    let _decode1 = start_node(dir.path(), &config, "decode", d1).await;
    let _prefill = start_node(dir.path(), &config, "prefill", p).await;
    let gw = start_config_gateway(dir.path(), &config, "data", "gateway.log", &[]).await;
    let token = admin_token(dir.path());
    let short = greedy(8);
    let solo = gw.run_when_up(&short).await["result"].clone();
    // Wait until both decode nodes are connected (ties go to decode 0 then).
    let deadline = Instant::now() + START;
    while nodes(&gw, &token).await.iter().any(|n| n.state != "up") {
        assert!(Instant::now() < deadline, "{}", logs(dir.path()));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // `a` on decode 0, `b` on decode 1: the next request would go to decode 0.
    let mut a = gw.stream(&endless(500)).await;
    a.read_texts(2).await;
    let mut b = gw.stream(&endless(500)).await;
    b.read_texts(2).await;
    let table = nodes(&gw, &token).await;
    let d0_assigned = node(&table, &addr(d0)).unwrap().assigned;
    assert_eq!(node(&table, &addr(d0)).unwrap().outstanding, 1, "{table:?}");
    assert_eq!(node(&table, &addr(d1)).unwrap().outstanding, 1, "{table:?}");

    write_file(dir.path(), gw_port, &[p], &[d1]);
    hup(&gw._child);
    let deadline = Instant::now() + START;
    loop {
        let table = nodes(&gw, &token).await;
        if node(&table, &addr(d0)).is_some_and(|n| n.state == "removing") {
            break;
        }
        assert!(Instant::now() < deadline, "{table:?}\n{}", logs(dir.path()));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // New requests while `a` runs on the removed node: none reaches it.
    for _ in 0..3 {
        let (status, v) = gw.run(&short).await;
        assert_eq!(status, 200, "{v}\n{}", logs(dir.path()));
        assert_eq!(answer(&v["result"]), answer(&solo));
    }
    let table = nodes(&gw, &token).await;
    assert!(
        node(&table, &addr(d0)).is_none_or(|n| n.assigned == d0_assigned),
        "a new request went to the removed node: {table:?}"
    );
    assert!(
        node(&table, &addr(d1)).is_some_and(|n| n.assigned >= 4),
        "{table:?}"
    );
    // The stream on the removed node completes.
    a.read_to_end().await;
    assert!(
        a.has_done() && !a.has_error(),
        "{:?}\n{}",
        a.events.last(),
        logs(dir.path())
    );
    b.read_to_end().await;
    assert!(b.has_done() && !b.has_error(), "{:?}", b.events.last());
    // Then it is dropped.
    let deadline = Instant::now() + START;
    while node(&nodes(&gw, &token).await, &addr(d0)).is_some() {
        assert!(Instant::now() < deadline, "{}", logs(dir.path()));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, v) = gw.run(&short).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(reloads(&gw, &token, "applied").await, 1.0);
}

/// Refused reloads change nothing: no admin token (401), an unparsable file, a
/// change that needs a restart, and a new node that fails its check (nobody
/// listens there) each get the reason; the old membership serves throughout and
/// every refusal is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_reloads_leave_the_old_membership_serving() {
    let dep = Deployment::start().await;
    let dir = dep.dir.path();
    let gw = &dep.gateway;
    let token = admin_token(dir);
    let short = greedy(8);
    let solo = gw.run_when_up(&short).await["result"].clone();
    let original = std::fs::read_to_string(&dep.config).unwrap();

    let (status, v) = reload(gw, None).await;
    assert_eq!(status, 401, "{v}");
    let (status, v) = reload(gw, Some("tadm_not-the-admin-token-but-long-enough")).await;
    assert_eq!(status, 401, "{v}");

    let refused = |v: &Value| v["errors"][0]["message"].as_str().unwrap_or("").to_string();
    std::fs::write(&dep.config, "[gateway\nlisten = ").unwrap();
    let (status, v) = reload(gw, Some(&token)).await;
    assert_eq!(status, 400, "{v}");
    assert!(refused(&v).contains("tessera.toml"), "{v}");

    std::fs::write(
        &dep.config,
        original.replacen(
            &format!("kv_pool_tokens = {CONTEXT}"),
            "kv_pool_tokens = 16384",
            1,
        ),
    )
    .unwrap();
    let (status, v) = reload(gw, Some(&token)).await;
    assert_eq!(status, 400, "{v}");
    assert!(refused(&v).contains("need a restart"), "{v}");

    // A new decode node (certificate issued) that is not running.
    let ghost = free_port();
    let (p, d) = (
        Deployment::port(&dep.prefill_addr),
        Deployment::port(&dep.decode_addr),
    );
    let gw_port: u16 = original
        .lines()
        .find_map(|l| l.strip_prefix("listen = \"127.0.0.1:"))
        .and_then(|l| l.trim_end_matches('"').parse().ok())
        .unwrap();
    write_file(dir, gw_port, &[p], &[d, ghost]);
    let (status, v) = reload(gw, Some(&token)).await;
    assert_eq!(status, 400, "{v}");
    let why = refused(&v);
    assert!(
        why.contains(&addr(ghost)) && why.contains("failed its check"),
        "{v}"
    );
    // The same through the command: it fails and prints the reason.
    let out = std::process::Command::new(BIN)
        .args(["ops", "reload", "--url", &gw.base, "--admin-token", &token])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains(&addr(ghost)), "{stderr}");

    let table = nodes(gw, &token).await;
    assert_eq!(table.len(), 2, "{table:?}");
    assert!(node(&table, &addr(ghost)).is_none(), "{table:?}");
    for _ in 0..2 {
        let (status, v) = gw.run(&short).await;
        assert_eq!(status, 200, "{v}\n{}", dep.logs());
        assert_eq!(answer(&v["result"]), answer(&solo));
    }
    assert_eq!(reloads(gw, &token, "refused").await, 4.0);
    assert_eq!(reloads(gw, &token, "applied").await, 0.0);
    // The original file again: applied, nothing changed.
    std::fs::write(&dep.config, &original).unwrap();
    let (status, v) = reload(gw, Some(&token)).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["result"]["changed"], json!([]), "{v}");
    assert!(dep.logs().contains("refused the reloaded deployment file"));
}
