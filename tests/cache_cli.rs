//! `tessera tenant purge-cache` against a running `tessera serve` (the real binary,
//! the real model, prefill and decode engines in one process): the account's repeated
//! prompt hits the prefix cache, the command drops the account's pages on every
//! engine through the admin API, and the same prompt then misses with the same
//! answer. Refusals: an unknown account (404 from the gateway), an id that is not
//! one (refused before any request), an empty admin token file (refused before any
//! request), a wrong admin token (401).

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_purge_cache_erases_the_accounts_cached_prefix_in_a_running_server() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let gw = start_serve(&data, &dir.path().join("serve.log")).await;
    let mut question = String::from("Inventory notes.\n");
    for i in 0..20 {
        question.push_str(&format!("Bin {i} has {} green cubes.\n", i * 3 + 1));
    }
    question.push_str("Which bin has the most cubes?");
    let body = json!({"messages": [{"role": "user", "content": question}], "max_tokens": 4});
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
