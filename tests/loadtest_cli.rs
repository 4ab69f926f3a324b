//! `tessera loadtest` against a real `tessera serve` with the real model, at small
//! scale: three tenants created through the admin API, a few tens of requests
//! with streaming, over-long prompts and client disconnects mixed in. The report
//! must show zero foreign canaries, zero solo mismatches, every over-long prompt
//! rejected with a 4xx and the usage API matching what the clients counted.
//! A second test kills the server with SIGKILL during the run and restarts it
//! through the fault hooks.

use serde_json::Value;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};

const BIN: &str = env!("CARGO_BIN_EXE_tessera");

/// Starts `tessera serve` on `listen` with `admin` as admin token; returns the
/// child and the base URL from its banner.
async fn serve(data: &Path, admin: &str, listen: &str) -> (tokio::process::Child, String) {
    let mut child = tokio::process::Command::new(BIN)
        .args(["serve", "--listen", listen, "--data-dir"])
        .arg(data)
        .env_remove("TESSERA_STORE")
        .env("TESSERA_ADMIN_TOKEN", admin)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let read = async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if let Some(url) = l.strip_prefix("tessera: listening on ") {
                return url.trim().to_string();
            }
        }
        panic!("serve exited before listening");
    };
    let base = tokio::time::timeout(Duration::from_secs(120), read)
        .await
        .expect("serve banner");
    // Keep draining stdout so the server never writes into a closed pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, base)
}

/// Runs `tessera loadtest` with `args`; returns (exit success, report.json, stderr).
async fn loadtest(args: &[&str], admin: Option<&str>, out: &Path) -> (bool, Value, String) {
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.arg("loadtest").args(args).arg("--out").arg(out);
    match admin {
        Some(a) => cmd.env("TESSERA_ADMIN_TOKEN", a),
        None => cmd.env_remove("TESSERA_ADMIN_TOKEN"),
    };
    let o = cmd.output().await.unwrap();
    let report = std::fs::read(out.join("report.json"))
        .map(|b| serde_json::from_slice(&b).unwrap())
        .unwrap_or(Value::Null);
    (
        o.status.success(),
        report,
        String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout),
    )
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_against_real_server_finds_no_leaks_mismatches_or_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let admin = "tadm_loadtest_ci_token_0123456789abcdef";
    let (mut child, base) = serve(&dir.path().join("data"), admin, "127.0.0.1:0").await;
    let out = dir.path().join("report");
    let (ok, r, log) = loadtest(
        &[
            "--url",
            &base,
            "--tenants",
            "3",
            "--prompts-per-tenant",
            "3",
            "--requests",
            "30",
            "--concurrency",
            "4",
            "--seed",
            "11",
            "--prompt-len",
            "uniform:8:40",
            "--output-len",
            "uniform:16:24",
            "--stream-share",
            "0.7",
            "--overlong-share",
            "0.1",
            "--disconnect-share",
            "0.15",
            "--quiet",
        ],
        Some(admin),
        &out,
    )
    .await;
    assert!(ok, "loadtest failed:\n{log}\n{r:#}");
    assert_eq!(r["schema_version"], 1);
    assert_eq!(r["passed"], true, "{:#}", r["failures"]);
    let t = &r["targets"][0];
    let c = &t["checks"];
    // Canaries: searched in every answer, none foreign; the model does repeat
    // its own canaries, so a leaked context would show.
    assert_eq!(n(&c["leaks"]), 0, "{:#}", c["canary"]);
    assert!(
        n(&c["canary"]["responses_checked"]) >= 30,
        "{:#}",
        c["canary"]
    );
    assert!(
        n(&c["canary"]["own_canary_echoed"]) >= 10,
        "{:#}",
        c["canary"]
    );
    // Solo-equality over every completed answer.
    assert_eq!(n(&c["mismatches"]), 0, "{:#}", c["solo_equality"]);
    let completed = n(&t["requests"]["completed"]);
    assert_eq!(n(&c["solo_equality"]["compared"]), completed);
    assert!(completed >= 15, "{:#}", t["requests"]);
    assert_eq!(n(&t["solo"]["prompts"]), 9);
    assert_eq!(n(&t["solo"]["failed"]), 0);
    // Over-long prompts: sent, every one a 4xx (400, code 3006).
    let ol = &c["over_long"];
    assert!(n(&ol["sent"]) >= 1, "{ol:#}");
    assert_eq!(n(&ol["rejected_4xx"]), n(&ol["sent"]), "{ol:#}");
    assert_eq!(n(&ol["statuses"]["400"]), n(&ol["sent"]), "{ol:#}");
    // Disconnects happened and nothing else failed.
    assert!(
        n(&t["requests"]["disconnected"]) >= 1,
        "{:#}",
        t["requests"]
    );
    assert_eq!(
        completed + n(&t["requests"]["disconnected"]) + n(&ol["sent"]),
        30,
        "{:#}",
        t["requests"]
    );
    // Usage: per tenant, the ledger's change equals what the clients counted;
    // 9 solo + 30 load requests in all.
    let u = &c["usage"];
    assert_eq!(n(&c["usage_mismatches"]), 0, "{u:#}");
    let tenants = u["tenants"].as_array().unwrap();
    assert_eq!(tenants.len(), 3);
    let mut requests = 0;
    for tu in tenants {
        assert_eq!(tu["matched"], true, "{tu:#}");
        requests += n(&tu["observed"]["requests"]);
        // Prompt tokens are known exactly even for disconnected requests.
        assert_eq!(
            tu["expected"]["input_tokens"]["lo"],
            tu["expected"]["input_tokens"]["hi"]
        );
        assert_eq!(
            tu["observed"]["input_tokens"],
            tu["expected"]["input_tokens"]["lo"]
        );
        assert!(n(&tu["observed"]["output_tokens"]) > 0);
    }
    assert_eq!(requests, 39);
    // Metrics and report files.
    assert!(n(&t["latency"]["ttft_ms"]["count"]) >= 5);
    assert!(t["throughput"]["output_tokens_per_s"].as_f64().unwrap() > 0.0);
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("PASSED") && html.matches("<svg").count() == 4);
    let lines = std::fs::read_to_string(out.join("requests.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 39);

    // A key that the server does not know: the harness stops with the server's
    // answer instead of reporting a pass.
    let keys = dir.path().join("keys.json");
    let acct = r["targets"][0]["base_url"]
        .as_str()
        .map(|_| "0".repeat(32))
        .unwrap();
    std::fs::write(
        &keys,
        format!(r#"[{{"account_id":"{acct}","key":"tsk_0000000000000000_00"}}]"#),
    )
    .unwrap();
    let (ok, _, log) = loadtest(
        &[
            "--url",
            &base,
            "--keys-file",
            keys.to_str().unwrap(),
            "--requests",
            "2",
            "--quiet",
        ],
        None,
        &dir.path().join("report2"),
    )
    .await;
    assert!(!ok);
    assert!(log.contains("401"), "{log}");
    child.kill().await.unwrap();
}

/// Picks a free loopback port (bound and released at once).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Kills the restarted server (not a child of this process) when dropped.
struct PidFile(std::path::PathBuf);

impl Drop for PidFile {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(&self.0) {
            let _ = std::process::Command::new("kill")
                .args(["-9", pid.trim()])
                .status();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_killed_and_restarted_mid_run_keeps_the_checks_at_zero() {
    let dir = tempfile::tempdir().unwrap();
    let admin = "tadm_loadtest_fault_token_0123456789abcdef";
    let data = dir.path().join("data");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let (child, base) = serve(&data, admin, &listen).await;
    let pid = child.id().unwrap();
    let pidfile = PidFile(dir.path().join("restarted.pid"));
    let kill = format!("kill -9 {pid}");
    let restart = format!(
        "TESSERA_ADMIN_TOKEN={admin} {BIN} serve --listen {listen} --data-dir {} >{} 2>&1 & echo $! > {}",
        data.display(),
        dir.path().join("restarted.log").display(),
        pidfile.0.display()
    );
    let out = dir.path().join("report");
    let (ok, r, log) = loadtest(
        &[
            "--url",
            &base,
            "--tenants",
            "2",
            "--prompts-per-tenant",
            "2",
            "--duration-secs",
            "8",
            "--concurrency",
            "3",
            "--seed",
            "5",
            "--prompt-len",
            "uniform:8:24",
            "--output-len",
            "uniform:8:24",
            "--overlong-share",
            "0.1",
            "--fault-kill-cmd",
            &kill,
            "--fault-restart-cmd",
            &restart,
            "--fault-at-secs",
            "2",
            "--fault-downtime-secs",
            "1",
            "--quiet",
        ],
        Some(admin),
        &out,
    )
    .await;
    assert!(ok, "loadtest failed:\n{log}\n{r:#}");
    let t = &r["targets"][0];
    let f = &t["fault"];
    assert_eq!(f["times"]["kill_exit_code"], 0, "{f:#}");
    assert_eq!(f["times"]["restart_exit_code"], 0, "{f:#}");
    let ready = f["times"]["ready_at_s"].as_f64().expect("server came back");
    assert!(ready > f["times"]["restart_at_s"].as_f64().unwrap());
    assert!(n(&f["requests_during_outage"]) >= 1, "{f:#}");
    assert_eq!(n(&f["errors_outside_outage"]), 0, "{f:#}");
    // Requests completed after the restart too.
    let after = std::fs::read_to_string(out.join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|o| o["phase"] == "load" && o["end"] == "complete")
        .filter(|o| o["start_s"].as_f64().unwrap() > ready)
        .count();
    assert!(after >= 1);
    let c = &t["checks"];
    assert_eq!(n(&c["leaks"]), 0);
    assert_eq!(n(&c["mismatches"]), 0, "{:#}", c["solo_equality"]);
    assert_eq!(n(&c["over_long_not_rejected"]), 0, "{:#}", c["over_long"]);
    assert_eq!(n(&c["usage_mismatches"]), 0, "{:#}", c["usage"]);
    assert_eq!(r["passed"], true, "{:#}", r["failures"]);
}
