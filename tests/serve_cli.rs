//! `tessera serve` first start (tenant, key and a curl command that works) and the
//! `tessera tenant|key|usage` subcommands, run as real processes.

use serde_json::Value;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};

const BIN: &str = env!("CARGO_BIN_EXE_tessera");

fn cli(data: &std::path::Path, args: &[&str]) -> (bool, Value, String) {
    let out = std::process::Command::new(BIN)
        .args(args)
        .arg("--data-dir")
        .arg(data)
        .env_remove("TESSERA_STORE")
        .output()
        .unwrap();
    let v = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    (
        out.status.success(),
        v,
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// Starts `tessera serve` and reads its banner up to the end of the curl command.
async fn serve(data: &std::path::Path) -> (tokio::process::Child, Vec<String>) {
    let mut child = tokio::process::Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .env_remove("TESSERA_STORE")
        .env_remove("TESSERA_ADMIN_TOKEN")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut out = Vec::new();
    let read = async {
        while let Some(l) = lines.next_line().await.unwrap() {
            let done = l.trim_start().starts_with("-d ");
            out.push(l);
            if done {
                break;
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(120), read)
        .await
        .expect("serve banner");
    // Keep draining stdout so the server never writes into a closed pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, out)
}

/// Runs the printed curl command's request (URL, bearer key and body) with reqwest.
async fn run_printed_curl(banner: &[String]) -> Value {
    let i = banner
        .iter()
        .position(|l| l.starts_with("curl "))
        .expect("curl line");
    let url = banner[i].split_whitespace().nth(1).unwrap().to_string();
    let key = banner[i + 1]
        .split("Bearer ")
        .nth(1)
        .unwrap()
        .trim_end_matches(['"', ' ', '\\'])
        .to_string();
    let body = banner[i + 2]
        .trim()
        .strip_prefix("-d '")
        .unwrap()
        .strip_suffix('\'')
        .unwrap()
        .to_string();
    let resp = reqwest::Client::new()
        .post(&url)
        .bearer_auth(key)
        .header("content-type", "application/x-www-form-urlencoded") // what curl -d sends
        .body(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    resp.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_first_start_prints_a_key_and_a_working_curl() {
    let dir = tempfile::tempdir().unwrap();
    let (mut child, banner) = serve(dir.path()).await;
    let text = banner.join("\n");
    assert!(text.contains("first start: created tenant"), "{text}");
    assert!(text.contains("API key:    tsk_"), "{text}");
    let v = run_printed_curl(&banner).await;
    assert_eq!(v["success"], true, "{v}");
    assert!(v["result"]["usage"]["completion_tokens"].as_i64().unwrap() >= 1);
    // The row is written right after the response; the CLI reads the same store.
    let id = cli(dir.path(), &["tenant", "list"]).1[0]["id"]
        .as_str()
        .unwrap()
        .to_string();
    let mut requests = Value::Null;
    for _ in 0..100 {
        requests = cli(dir.path(), &["usage", "--tenant", &id]).1["groups"][0]["requests"].clone();
        if requests == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(requests, 1);
    child.kill().await.unwrap();

    // The key is stored only as a hash; the CLI sees the tenant and the ledger row.
    let db = std::fs::read(dir.path().join("tessera.db")).unwrap();
    let key = banner
        .iter()
        .find_map(|l| l.split("API key:    ").nth(1))
        .unwrap()
        .trim();
    let secret = key.rsplit('_').next().unwrap();
    assert!(
        !db.windows(secret.len()).any(|w| w == secret.as_bytes()),
        "secret stored in clear"
    );
    let (ok, usage, _) = cli(dir.path(), &["usage", "--tenant", &id]);
    assert!(ok);
    assert_eq!(usage["groups"][0]["requests"], 1);

    // A second start creates nothing and prints a curl with a placeholder key.
    let (mut child, banner) = serve(dir.path()).await;
    let text = banner.join("\n");
    assert!(text.contains("1 tenant(s) in the store"), "{text}");
    assert!(text.contains("$TESSERA_API_KEY"), "{text}");
    // SIGTERM: drain (nothing running) and exit 0.
    let pid = child.id().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap()
        .success());
    let status = tokio::time::timeout(Duration::from_secs(30), child.wait())
        .await
        .expect("serve exits on SIGTERM")
        .unwrap();
    assert!(status.success(), "{status:?}");
}

#[test]
fn tenant_key_and_usage_commands() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let (ok, v, err) = cli(
        d,
        &[
            "tenant",
            "create",
            "--name",
            "acme",
            "--rpm",
            "60",
            "--with-key",
        ],
    );
    assert!(ok, "{err}");
    let id = v["tenant"]["id"].as_str().unwrap().to_string();
    assert_eq!(v["tenant"]["limits"]["requests_per_minute"], 60);
    assert!(v["key"]["secret"].as_str().unwrap().starts_with("tsk_"));
    let (ok, v, _) = cli(d, &["key", "create", "--tenant", &id, "--name", "ci"]);
    assert!(ok);
    let key_id = v["info"]["key_id"].as_str().unwrap().to_string();
    let (_, v, _) = cli(d, &["key", "list", "--tenant", &id]);
    assert_eq!(v.as_array().unwrap().len(), 2);
    assert!(v.to_string().find("secret").is_none());
    let (ok, _, _) = cli(d, &["key", "revoke", &key_id]);
    assert!(ok);
    let (ok, _, err) = cli(d, &["key", "revoke", &key_id]);
    assert!(!ok && err.contains("no active key"), "{err}");
    let (ok, v, _) = cli(d, &["tenant", "suspend", &id]);
    assert!(ok);
    assert_eq!(v["status"], "suspended");
    let (_, v, _) = cli(d, &["tenant", "list"]);
    assert_eq!(v[0]["status"], "suspended");
    let (ok, _, _) = cli(d, &["tenant", "limits", &id, "--daily-tokens", "1000"]);
    assert!(ok);
    let (_, v, _) = cli(d, &["tenant", "list"]);
    assert_eq!(v[0]["limits"]["daily_tokens"], 1000);
    assert_eq!(v[0]["limits"]["requests_per_minute"], 0);
    let (ok, v, _) = cli(
        d,
        &[
            "usage",
            "--tenant",
            &id,
            "--group-by",
            "day",
            "--since",
            "2026-01-01",
        ],
    );
    assert!(ok);
    assert_eq!(v["groups"], serde_json::json!([]));
    let (ok, _, err) = cli(d, &["usage", "--tenant", &id, "--group-by", "week"]);
    assert!(!ok && err.contains("group_by"), "{err}");
}
