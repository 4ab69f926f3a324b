//! `tessera serve` first start (tenant, key and a curl command that works) and the
//! `tessera tenant|key|usage` subcommands, run as real processes.

mod common;

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
    let cmd = tokio::process::Command::new(BIN);
    serve_with(cmd, data, &[], Stdio::inherit()).await
}

/// [`serve`] from `cmd` (the binary, or a shell that runs it), with `extra` arguments
/// and stderr to `stderr`.
async fn serve_with(
    mut cmd: tokio::process::Command,
    data: &std::path::Path,
    extra: &[&str],
    stderr: Stdio,
) -> (tokio::process::Child, Vec<String>) {
    let mut child = cmd
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .args(extra)
        .env_remove("TESSERA_STORE")
        .env_remove("TESSERA_ADMIN_TOKEN")
        .env_remove("TESSERA_METRICS_TOKEN")
        .stdout(Stdio::piped())
        .stderr(stderr)
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
    // Flags not given keep their value.
    assert_eq!(v[0]["limits"]["requests_per_minute"], 60);
    // Created without limit flags: the defaults (built in, or TESSERA_DEFAULT_*).
    let (ok, v, _) = cli(d, &["tenant", "create", "--name", "plain"]);
    assert!(ok);
    assert_eq!(v["tenant"]["limits"]["requests_per_minute"], 600);
    assert_eq!(v["tenant"]["limits"]["max_concurrent"], 16);
    let plain = v["tenant"]["id"].as_str().unwrap().to_string();
    // Scopes and expiry.
    let (ok, v, err) = cli(
        d,
        &[
            "key",
            "create",
            "--tenant",
            &plain,
            "--name",
            "reader",
            "--scope",
            "usage:read",
            "--expires-in-days",
            "30",
        ],
    );
    assert!(ok, "{err}");
    assert_eq!(v["info"]["scopes"], serde_json::json!(["usage:read"]));
    assert!(v["info"]["expires_ms"].as_i64().unwrap() > 0);
    let (ok, _, err) = cli(
        d,
        &["key", "create", "--tenant", &plain, "--scope", "admin"],
    );
    assert!(!ok && err.contains("unknown scope `admin`"), "{err}");
    let (ok, _, err) = cli(
        d,
        &[
            "key",
            "create",
            "--tenant",
            &plain,
            "--expires",
            "2001-01-01",
        ],
    );
    assert!(!ok && err.contains("future"), "{err}");
    // Every change above is in the audit log, as done by the CLI.
    let (ok, v, _) = cli(d, &["audit"]);
    assert!(ok);
    let actions: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["action"].as_str().unwrap())
        .collect();
    assert_eq!(
        actions,
        [
            "tenant.create",
            "key.create",
            "key.create",
            "key.revoke",
            "tenant.suspend",
            "tenant.limits",
            "tenant.create",
            "key.create",
        ]
    );
    assert!(v
        .as_array()
        .unwrap()
        .iter()
        .all(|r| r["source"].as_str().unwrap().starts_with("cli:")));
    let (_, v, _) = cli(d, &["audit", "--limit", "2"]);
    assert_eq!(v.as_array().unwrap().len(), 2);
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

/// Runs `tessera serve` expecting it to refuse to start; returns its stderr.
fn serve_refusal(data: &std::path::Path, args: &[&str], env: Option<&str>) -> String {
    let mut c = std::process::Command::new(BIN);
    c.args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(data)
        .args(args)
        .env_remove("TESSERA_STORE")
        .env_remove("TESSERA_ADMIN_TOKEN");
    if let Some(t) = env {
        c.env("TESSERA_ADMIN_TOKEN", t);
    }
    let out = c.output().unwrap();
    assert!(!out.status.success(), "serve started with {args:?} {env:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn serve_refuses_empty_or_short_admin_tokens_naming_the_source() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let err = serve_refusal(d, &["--admin-token", ""], None);
    assert!(
        err.contains("--admin-token") && err.contains("is 0 bytes"),
        "{err}"
    );
    let err = serve_refusal(d, &[], Some("too-short"));
    assert!(
        err.contains("TESSERA_ADMIN_TOKEN") && err.contains("is 9 bytes"),
        "{err}"
    );
    // An empty token file (a botched rotation) is refused, not served open.
    std::fs::create_dir_all(d).unwrap();
    let file = d.join("admin-token");
    std::fs::write(&file, "\n").unwrap();
    let err = serve_refusal(d, &[], None);
    assert!(
        err.contains(&file.display().to_string()) && err.contains("is 0 bytes"),
        "{err}"
    );
    let other = d.join("other-token");
    std::fs::write(&other, "short\n").unwrap();
    let err = serve_refusal(d, &["--admin-token-file", other.to_str().unwrap()], None);
    assert!(
        err.contains("other-token") && err.contains("at least 32"),
        "{err}"
    );
    let err = serve_refusal(
        d,
        &["--admin-token", GOOD_TOKEN, "--metrics-token", "m"],
        None,
    );
    assert!(err.contains("metrics token"), "{err}");
    // Nothing was created or served: no store file.
    assert!(!d.join("tessera.db").exists());
}

/// A token of 16 distinct bytes and more than 32 bytes.
const GOOD_TOKEN: &str = "tadm_0123456789abcdef0123456789abcdef";

/// Issue 32: a 32-byte admin token of one repeated character, from a file anyone can
/// write (0666), was accepted; so was a repetitive metrics token. Both are refused
/// now, naming their source (a token file others can write is refused for that
/// first; one others can read gets a warning); `--admin-token` and `--metrics-token` on the command
/// line (visible in `ps`) print a warning naming the alternatives.
#[test]
fn serve_refuses_repetitive_tokens_and_warns_about_tokens_in_ps() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let file = d.join("weak-token");
    std::fs::write(&file, format!("{}\n", "x".repeat(32))).unwrap();
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    let err = serve_refusal(d, &["--admin-token-file", file.to_str().unwrap()], None);
    assert!(
        err.contains(&file.display().to_string())
            && err.contains("writable by group or others (mode 0666)"),
        "{err}"
    );
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    }
    let err = serve_refusal(d, &["--admin-token-file", file.to_str().unwrap()], None);
    assert!(
        err.contains(&format!("admin token from file {}", file.display()))
            && err.contains("has 1 distinct bytes; it must have at least 16"),
        "{err}"
    );
    assert!(
        err.contains("is readable by every local user; run `chmod 600"),
        "{err}"
    );
    let pattern = "abcdefgh".repeat(5);
    let err = serve_refusal(d, &[], Some(&pattern));
    assert!(
        err.contains("TESSERA_ADMIN_TOKEN") && err.contains("has 8 distinct bytes"),
        "{err}"
    );
    let err = serve_refusal(
        d,
        &[
            "--admin-token",
            GOOD_TOKEN,
            "--metrics-token",
            &"m".repeat(40),
        ],
        None,
    );
    assert!(
        err.contains("warning: --admin-token puts a secret on the command line")
            && err.contains("--admin-token-file FILE or TESSERA_ADMIN_TOKEN"),
        "{err}"
    );
    assert!(
        err.contains("warning: --metrics-token puts a secret on the command line"),
        "{err}"
    );
    assert!(
        err.contains("metrics token from --metrics-token has 1 distinct bytes"),
        "{err}"
    );
    assert!(!d.join("tessera.db").exists());
}

/// Issue 32: under umask 022 the store was created 0644 (its -wal and -shm files
/// too), and a `--metrics-token` with surrounding spaces passed the length check but
/// never matched. Now the data directory is 0700 and the admin token file, the store
/// and its -wal/-shm files 0600 from their creation, and the metrics token is
/// trimmed like the admin token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_creates_its_secrets_owner_only_and_trims_the_metrics_token() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("a/data");
    let err_file = dir.path().join("stderr");
    let mut sh = tokio::process::Command::new("sh");
    sh.args(["-c", "umask 022; exec \"$0\" \"$@\"", BIN]);
    let metrics = format!("  {GOOD_TOKEN}  ");
    let (mut child, banner) = serve_with(
        sh,
        &data,
        &["--metrics-token", &metrics],
        Stdio::from(std::fs::File::create(&err_file).unwrap()),
    )
    .await;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&data), 0o700);
    assert_eq!(mode(&dir.path().join("a")), 0o700);
    assert_eq!(mode(&data.join("admin-token")), 0o600);
    assert_eq!(mode(&data.join("tessera.db")), 0o600);
    for side in ["tessera.db-wal", "tessera.db-shm"] {
        let p = data.join(side);
        if p.exists() {
            assert_eq!(mode(&p), 0o600, "{side}");
        }
    }
    let base = banner
        .iter()
        .find_map(|l| l.strip_prefix("tessera: listening on "))
        .unwrap()
        .trim()
        .to_string();
    let resp = reqwest::Client::new()
        .get(format!("{base}/metrics"))
        .bearer_auth(GOOD_TOKEN)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200, "{base}");
    let err = std::fs::read_to_string(&err_file).unwrap();
    assert!(err.contains("warning: --metrics-token"), "{err}");
    child.kill().await.unwrap();
}

/// CPU seconds (user + system) the process has used, from /proc.
fn cpu_secs(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = after.split_whitespace().collect();
    // Fields 14 and 15 (utime, stime) are 12 and 13 after the command name.
    let ticks: f64 = f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap();
    ticks / 100.0
}

/// With file descriptors exhausted, the accept loop backs off instead of spinning,
/// and serves again once descriptors free up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_loop_backs_off_when_out_of_file_descriptors() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cmd = format!(
        "ulimit -n 192 && exec {BIN} serve --listen 127.0.0.1:0 --data-dir {} --tls self-signed \\
         --header-timeout-secs 120 --tls-handshake-timeout-secs 120 --keepalive-idle-secs 120",
        data.display()
    );
    let mut child = tokio::process::Command::new("sh")
        .args(["-c", &cmd])
        .env_remove("TESSERA_STORE")
        .env_remove("TESSERA_ADMIN_TOKEN")
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let addr = tokio::time::timeout(Duration::from_secs(120), async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if let Some(u) = l.strip_prefix("tessera: listening on https://") {
                return u.trim().to_string();
            }
        }
        panic!("serve exited before listening");
    })
    .await
    .expect("serve banner");
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    let pid = child.id().unwrap();
    // More connections than the server has descriptors: it accepts until EMFILE.
    let mut conns = Vec::new();
    for _ in 0..300 {
        conns.push(tokio::net::TcpStream::connect(&addr).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = cpu_secs(pid);
    tokio::time::sleep(Duration::from_secs(2)).await;
    let used = cpu_secs(pid) - before;
    assert!(
        used < 0.5,
        "the server used {used} CPU s in 2 s while out of descriptors"
    );
    // While out of descriptors a new client waits in the backlog, unanswered.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut probe = tokio::net::TcpStream::connect(&addr).await.unwrap();
    probe
        .write_all(b"GET /healthz HTTP/1.1\r\n\r\n")
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let waiting = tokio::time::timeout(Duration::from_millis(500), probe.read(&mut buf)).await;
    assert!(waiting.is_err(), "answered while out of descriptors");
    // Descriptors free up: it accepts again (and its TLS handshake refuses the
    // plain-text request at once).
    drop(conns);
    let answered = tokio::time::timeout(Duration::from_secs(10), probe.read(&mut buf)).await;
    assert!(answered.is_ok(), "not accepting after descriptors freed");
    child.kill().await.unwrap();
}

/// `tessera finetune create|list|publish|delete`: an adapter written by
/// `scripts/make_lora.py` (llama.cpp's `gguf` package) is checked against the
/// default model's file and stored; one for another architecture is refused by
/// name; another tenant cannot delete it; every change is audited.
#[test]
fn finetune_commands() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let root = env!("CARGO_MANIFEST_DIR");
    let python = common::test_python();
    let model = format!("{root}/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let make = |kind: &str| {
        let out = d.join(format!("{kind}.gguf"));
        let ok = std::process::Command::new(&python)
            .arg(format!("{root}/scripts/make_lora.py"))
            .args([model.as_str(), out.to_str().unwrap(), "--kind", kind])
            .args(["--layers", "0,1"])
            .status()
            .unwrap()
            .success();
        assert!(ok, "make_lora.py {kind}");
        out.to_str().unwrap().to_string()
    };
    let (good, bad) = (make("random"), make("wrong-arch"));
    let tenant = |name: &str| {
        let (ok, v, err) = cli(d, &["tenant", "create", "--name", name]);
        assert!(ok, "{err}");
        v["tenant"]["id"].as_str().unwrap().to_string()
    };
    let (a, b) = (tenant("a"), tenant("b"));
    let create = |t: &str, file: &str| {
        cli(
            d,
            &[
                "finetune",
                "create",
                "--tenant",
                t,
                "--model",
                "@cf/huggingfacetb/smollm2-135m-instruct",
                "--model-file",
                &model,
                file,
            ],
        )
    };
    let (ok, v, err) = create(&a, &good);
    assert!(ok, "{err}");
    assert_eq!(
        (v["name"].as_str(), v["rank"].as_u64()),
        (Some("random"), Some(8))
    );
    // The API's field names.
    assert_eq!(v["model"], "@cf/huggingfacetb/smollm2-135m-instruct", "{v}");
    assert_eq!(v["account_id"], a.as_str(), "{v}");
    assert!(
        v["created_at"].as_str().is_some_and(|t| t.ends_with('Z')),
        "{v}"
    );
    assert_eq!(v["targets"], 4, "attn_q and attn_v of layers 0 and 1");
    let id = v["id"].as_str().unwrap().to_string();
    // A model id without its file is refused (it would be checked against another).
    let (ok, _, err) = cli(
        d,
        &[
            "finetune", "create", "--tenant", &a, "--model", "@cf/x/y", &good,
        ],
    );
    assert!(!ok && err.contains("--model-file"), "{err}");
    let (ok, _, err) = create(&a, &bad);
    assert!(!ok);
    assert!(err.contains("architecture \"gpt2\""), "{err}");
    let (ok, _, err) = create(&a, &good);
    assert!(
        !ok && err.contains("already has a fine-tune named"),
        "{err}"
    );
    let (_, v, _) = cli(d, &["finetune", "list", "--tenant", &a]);
    assert_eq!(v.as_array().unwrap().len(), 1);
    let (_, v, _) = cli(d, &["finetune", "list", "--tenant", &b]);
    assert_eq!(v.as_array().unwrap().len(), 0);
    // Without $USER and $LOGNAME the audit names the uid, not `unknown`.
    let out = std::process::Command::new(BIN)
        .args(["finetune", "publish", &id, "--data-dir"])
        .arg(d)
        .env_remove("TESSERA_STORE")
        .env_remove("USER")
        .env_remove("LOGNAME")
        .output()
        .unwrap();
    let v: Value = serde_json::from_slice(&out.stdout).unwrap_or(Value::Null);
    assert!(out.status.success() && v["public"] == true, "{v}");
    let (ok, _, _) = cli(d, &["finetune", "delete", "--tenant", &b, &id]);
    assert!(!ok, "only the owner deletes");
    let (ok, v, _) = cli(d, &["finetune", "delete", "--tenant", &a, "random"]);
    assert!(ok && v["deleted"]["id"] == id.as_str());
    let (_, v, _) = cli(d, &["audit"]);
    let actions: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["action"].as_str().unwrap())
        .filter(|a| a.starts_with("finetune."))
        .collect();
    assert_eq!(
        actions,
        ["finetune.create", "finetune.visibility", "finetune.delete"]
    );
    let publish = v
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["action"] == "finetune.visibility")
        .unwrap();
    assert!(
        publish["source"]
            .as_str()
            .is_some_and(|s| s.starts_with("cli:uid-")),
        "{publish}"
    );
}
