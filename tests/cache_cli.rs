//! `tessera tenant purge-cache` against a running `tessera serve` (the real binary,
//! the real model, prefill and decode engines in one process): the account's repeated
//! prompt hits the prefix cache, the command drops the account's pages on every
//! engine through the admin API, and the same prompt then misses with the same
//! answer. Refusals: an unknown account (404 from the gateway), an id that is not
//! one (refused before any request), an empty admin token file (refused before any
//! request), a wrong admin token (401). The same purge and the cache report against
//! remote nodes, over their node links.

mod common;

use common::*;
use serde_json::{json, Value};
use std::path::Path;

fn cached_of(v: &Value) -> i64 {
    v["result"]["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_i64()
        .unwrap_or_else(|| panic!("no cached_tokens in {v}"))
}

/// `tessera tenant purge-cache ARGS...` against `gw`, the admin token read from the
/// gateway's data dir given as `--data-dir` (as every `tessera tenant` command takes
/// it): (success, stdout, stderr).
fn purge(gw: &Gateway, data: &Path, args: &[&str]) -> (bool, String, String) {
    let out = std::process::Command::new(BIN)
        .args(["tenant", "purge-cache"])
        .args(args)
        .args(["--url", &gw.base])
        .arg("--data-dir")
        .arg(data)
        .env_remove("TESSERA_ADMIN_TOKEN")
        .env_remove("TESSERA_DATA_DIR")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A chat request whose prompt spans several full KV pages.
fn inventory() -> Value {
    let mut question = String::from("Inventory notes.\n");
    for i in 0..20 {
        question.push_str(&format!("Bin {i} has {} green cubes.\n", i * 3 + 1));
    }
    question.push_str("Which bin has the most cubes?");
    json!({"messages": [{"role": "user", "content": question}], "max_tokens": 4})
}

/// `GET .../ai/cache` as the gateway's tenant: `(tier, cached_pages)` per row.
async fn cache_report(gw: &Gateway) -> Vec<(String, u64)> {
    let url = format!("{}/client/v4/accounts/{}/ai/cache", gw.base, gw.account);
    let resp = reqwest::Client::new()
        .get(url)
        .bearer_auth(&gw.key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status().as_u16(), 200);
    let v: Value = resp.json().await.unwrap();
    v["result"]["models"]
        .as_array()
        .unwrap_or_else(|| panic!("{v}"))
        .iter()
        .map(|m| {
            let tier = m["tier"].as_str().unwrap().to_string();
            (tier, m["cached_pages"].as_u64().unwrap())
        })
        .collect()
}

/// With remote nodes (`tessera node` processes behind `tessera serve --config`) the
/// purge and the report go over the node links to every node: the repeated prompt
/// hits the prefill node's cache, the report counts its pages, the purge drops them
/// there (its answer counts them), the report then shows 0 on every tier and the
/// prompt misses with the same answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn purge_and_report_reach_remote_nodes_over_their_links() {
    // The prefill node gets a host-memory tier; the decode node takes the flag and
    // keeps no cache.
    let dep = Deployment::start_with(&["--kv-spill-host-mib", "4"]).await;
    let gw = &dep.gateway;
    let body = inventory();
    let first = gw.run_when_up(&body).await;
    assert_eq!(cached_of(&first), 0);
    let (_, again) = gw.run(&body).await;
    assert!(cached_of(&again) > 0, "{again}\n{}", dep.logs());
    let report = cache_report(gw).await;
    assert_eq!(report.len(), 3, "{report:?}");
    assert!(
        report[0].0 == "engine_pool" && report[0].1 > 0,
        "{report:?}"
    );

    let (ok, out, err) = purge(gw, &dep.dir.path().join("data"), &[&gw.account]);
    assert!(ok, "{err}\n{}", dep.logs());
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(
        v["models"][0]["freed_pages"].as_u64(),
        Some(report[0].1),
        "{v}"
    );
    assert!(cache_report(gw).await.iter().all(|(_, n)| *n == 0));
    let (st, after) = gw.run(&body).await;
    assert_eq!(st, 200, "{after}");
    assert_eq!(cached_of(&after), 0, "purged: {after}");
    assert_eq!(after["result"]["response"], first["result"]["response"]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_purge_cache_erases_the_accounts_cached_prefix_in_a_running_server() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let gw = start_serve(&data, &dir.path().join("serve.log")).await;
    let body = inventory();
    let (st, first) = gw.run(&body).await;
    assert_eq!(st, 200, "{first}");
    assert_eq!(cached_of(&first), 0);
    let (_, again) = gw.run(&body).await;
    assert!(cached_of(&again) > 0, "{again}");

    let (ok, out, err) = purge(&gw, &data, &[&gw.account]);
    assert!(ok, "{err}\n{}", logs(dir.path()));
    let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(v["id"], json!(gw.account), "{v}");
    assert!(v["models"][0]["freed_pages"].as_u64().unwrap() > 0, "{v}");

    let (st, after) = gw.run(&body).await;
    assert_eq!(st, 200, "{after}");
    assert_eq!(cached_of(&after), 0, "purged: {after}");
    assert_eq!(after["result"]["response"], first["result"]["response"]);

    let (ok, _, err) = purge(&gw, &data, &["no-such-account"]);
    assert!(
        !ok && err.contains("404") && err.contains("no tenant"),
        "{err}"
    );
    let (ok, _, err) = purge(&gw, &data, &["../admin/v1/reload"]);
    assert!(!ok && err.contains("not an account id"), "{err}");
    std::fs::write(dir.path().join("empty-token"), "\n").unwrap();
    let out = std::process::Command::new(BIN)
        .args(["tenant", "purge-cache", &gw.account, "--url", &gw.base])
        .arg("--admin-token-file")
        .arg(dir.path().join("empty-token"))
        .env_remove("TESSERA_ADMIN_TOKEN")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("admin token is empty"),
        "{err}"
    );
    std::fs::write(dir.path().join("wrong-token"), "tadm_wrong\n").unwrap();
    let out = std::process::Command::new(BIN)
        .args(["tenant", "purge-cache", &gw.account, "--url", &gw.base])
        .arg("--admin-token-file")
        .arg(dir.path().join("wrong-token"))
        .env_remove("TESSERA_ADMIN_TOKEN")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("401"), "{err}");
}
