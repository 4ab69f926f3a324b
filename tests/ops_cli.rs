//! `tessera ops check-config`, run as a real process on the repository's example
//! deployment file and on broken ones: the verdict, the messages and the exit status.

use serde_json::Value;
use std::path::{Path, PathBuf};

const BIN: &str = env!("CARGO_BIN_EXE_tessera");
const MODEL: &str = "@cf/huggingfacetb/smollm2-135m-instruct";

struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
}

fn repo() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `tessera ops check-config <file> [extra]` from the repository root.
fn check(file: &Path, extra: &[&str]) -> Run {
    let out = std::process::Command::new(BIN)
        .args(["ops", "check-config"])
        .arg(file)
        .args(extra)
        .current_dir(repo())
        .output()
        .unwrap();
    Run {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

fn gguf() -> PathBuf {
    let p = repo().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run `tessera model fetch`",
        p.display()
    );
    p
}

/// A PD deployment of the default model at `model_path` (absolute), with `extra`
/// lines in the model entry and a decode pool of `decode_tokens`.
fn deployment(dir: &Path, model_path: &Path, extra: &str, decode_tokens: usize) -> PathBuf {
    let text = format!(
        r#"[gateway]
listen = "127.0.0.1:8787"

[[models]]
id = "{MODEL}"
path = "{}"
{extra}

[[pools]]
name = "prefill"
role = "prefill"
page_size = 16
kv_pool_tokens = 16384
nodes = ["127.0.0.1:9101"]

[[pools]]
name = "decode-a"
role = "decode"
page_size = 16
kv_pool_tokens = {decode_tokens}
nodes = ["127.0.0.1:9201"]
"#,
        model_path.display()
    );
    let p = dir.join("tessera.toml");
    std::fs::write(&p, text).unwrap();
    p
}

/// The repository example with its node-link files issued as the README says: the CA
/// in `ROOT/node-ca`, the node files in `ROOT/node-certs`, and a copy of the example
/// naming them, `ROOT/tessera.toml` (returned with the node files' directory).
fn issued_example(root: &Path) -> (PathBuf, PathBuf) {
    let (ca, certs) = (root.join("node-ca"), root.join("node-certs"));
    let example = repo().join("ops/deploy/tessera.toml");
    for args in [
        vec!["ops", "certs", "init", "--ca-dir", ca.to_str().unwrap()],
        vec![
            "ops",
            "certs",
            "issue",
            "--config",
            example.to_str().unwrap(),
            "--ca-dir",
            ca.to_str().unwrap(),
            "--dir",
            certs.to_str().unwrap(),
        ],
    ] {
        let out = std::process::Command::new(BIN)
            .args(&args)
            .current_dir(repo())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let dir = certs.display();
    let text = std::fs::read_to_string(&example)
        .unwrap()
        .replace(
            "\".tessera/node-certs/ca.pem\"",
            &format!("\"{dir}/ca.pem\""),
        )
        .replace("\".tessera/node-certs\"", &format!("\"{dir}\""));
    let copy = root.join("tessera.toml");
    std::fs::write(&copy, text).unwrap();
    (copy, certs)
}

#[test]
fn repository_example_passes() {
    gguf();
    let root = tempfile::tempdir().unwrap();
    let (copy, certs) = issued_example(root.path());
    // The README's layout: the node files hold the CA certificate, not its key.
    assert!(certs.join("ca.pem").exists());
    assert!(!certs.join("ca.key").exists());
    assert!(root.path().join("node-ca/ca.key").exists());
    let r = check(&copy, &[]);
    assert!(r.ok, "stdout:\n{}\nstderr:\n{}", r.stdout, r.stderr);
    // The context window came from the GGUF: the example sets no `context`.
    assert!(
        r.stdout
            .contains(&format!("{MODEL}: context window 8192 tokens")),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains(&format!(
            "ok   decode pool \"decode\" x {MODEL}: 16384 >= 8192"
        )),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout
            .ends_with("verdict: OK (1 model, 2 pools, 2 nodes)\n"),
        "{}",
        r.stdout
    );
    assert_eq!(r.stderr, "");
}

#[test]
fn pool_smaller_than_the_real_context_fails_naming_everything() {
    let dir = tempfile::tempdir().unwrap();
    // One page short of the model's 8192-token context (read from the GGUF).
    let file = deployment(dir.path(), &gguf(), "", 8176);
    let r = check(&file, &[]);
    assert!(!r.ok, "{}", r.stdout);
    let msg = format!(
        "decode pool \"decode-a\" holds 8176 usable KV tokens but model {MODEL} has a context \
         window of 8192 tokens (I2: a node's pool must hold a full context; raise kv_pool_tokens)"
    );
    assert!(
        r.stdout.contains(&format!("  - [pool_too_small] {msg}\n")),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.contains(&format!(
            "FAIL decode pool \"decode-a\" x {MODEL}: 8176 < 8192"
        )),
        "{}",
        r.stdout
    );
    assert!(
        r.stdout.ends_with("verdict: FAIL (1 violation)\n"),
        "{}",
        r.stdout
    );
    assert_eq!(
        r.stderr,
        format!(
            "error: deployment file {} failed the configuration check: 1 violation\n",
            file.display()
        )
    );

    // The same verdict as JSON on stdout; still a failure.
    let r = check(&file, &["--json"]);
    assert!(!r.ok);
    let v: Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(v["ok"], false);
    assert_eq!(v["violations"].as_array().unwrap().len(), 1);
    assert_eq!(v["violations"][0]["label"], "pool_too_small");
    assert_eq!(v["violations"][0]["message"], msg);
    assert_eq!(v["models"][0]["context"], 8192);
    assert_eq!(v["fits"][1]["pool"], "decode-a");
    assert_eq!(v["fits"][1]["role"], "decode");
    assert_eq!(v["fits"][1]["usable_tokens"], 8176);
    assert_eq!(v["fits"][1]["ok"], false);

    // Exactly the context passes.
    let file = deployment(dir.path(), &gguf(), "", 8192);
    let r = check(&file, &[]);
    assert!(r.ok, "{}", r.stdout);
}

#[test]
fn unknown_field_fails_with_its_location() {
    let dir = tempfile::tempdir().unwrap();
    let file = deployment(dir.path(), &gguf(), "max_context = 9000", 16384);
    let r = check(&file, &[]);
    assert!(!r.ok);
    assert!(r.stdout.contains("[invalid_config]"), "{}", r.stdout);
    assert!(
        r.stdout.contains("unknown field `max_context`"),
        "{}",
        r.stdout
    );
    assert!(r.stdout.contains("line 7"), "{}", r.stdout);
    assert!(
        r.stderr.starts_with("error: deployment file"),
        "{}",
        r.stderr
    );
}

#[test]
fn missing_model_file_needs_a_context() {
    let dir = tempfile::tempdir().unwrap();
    let absent = dir.path().join("absent.gguf");
    let file = deployment(dir.path(), &absent, "", 16384);
    let r = check(&file, &[]);
    assert!(!r.ok);
    assert!(
        r.stdout.contains(&format!(
            "[context_unknown] cannot determine the context window of model {MODEL}: model \
             file {} not found and no `context` is set",
            absent.display()
        )),
        "{}",
        r.stdout
    );

    // With `context` the file can be checked without the weights.
    let file = deployment(dir.path(), &absent, "context = 8192", 16384);
    assert!(check(&file, &[]).ok);
    let file = deployment(dir.path(), &absent, "context = 32768", 16384);
    let r = check(&file, &[]);
    assert!(!r.ok);
    assert!(
        r.stdout
            .contains("prefill pool \"prefill\" holds 16384 usable KV tokens"),
        "{}",
        r.stdout
    );
}

#[test]
fn missing_deployment_file_fails() {
    let r = check(Path::new("/nonexistent/tessera.toml"), &[]);
    assert!(!r.ok);
    assert!(
        r.stdout
            .contains("[unreadable_config] cannot read deployment file /nonexistent/tessera.toml"),
        "{}",
        r.stdout
    );
}

/// Runs `tessera ARGS` (from the repository root, with a good admin token and a
/// fresh data directory) expecting it to refuse to start; returns its stderr. A
/// process still running after 60 s started: the test fails.
fn refusal(args: &[&str], data: &Path) -> String {
    let mut child = std::process::Command::new(BIN)
        .args(args)
        .current_dir(repo())
        .env(
            "TESSERA_ADMIN_TOKEN",
            "tadm_0123456789abcdef0123456789abcdef",
        )
        .env("TESSERA_DATA_DIR", data)
        .env_remove("TESSERA_STORE")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            child.kill().unwrap();
            panic!("`tessera {args:?}` started instead of refusing");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    assert!(!out.status.success(), "{args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn chmod(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Issue 32: a world-readable node key, a world-writable key directory, `ca.key`
/// among the node files (the old README layout) and liveness timings out of bounds
/// (`heartbeat_ms = 1`, `dead_after_ms` of an hour) were all accepted. Now
/// `check-config`, `tessera node` and `tessera serve --config` refuse each, naming
/// the file or field and the fix.
#[test]
fn exposed_secrets_and_liveness_out_of_bounds_are_refused_everywhere() {
    gguf();
    let root = tempfile::tempdir().unwrap();
    let (copy, certs) = issued_example(root.path());
    let data = root.path().join("data");
    let cfg = copy.to_str().unwrap();
    let node = ["node", "--role", "decode", "--config", cfg];
    let serve = ["serve", "--listen", "127.0.0.1:0", "--config", cfg];
    assert!(check(&copy, &[]).ok);
    let (decode_key, gateway_key) = (
        certs.join("decode-127.0.0.1-9201.key"),
        certs.join("gateway.key"),
    );
    // Keys that others (or the group) can read.
    chmod(&decode_key, 0o644);
    chmod(&gateway_key, 0o640);
    let r = check(&copy, &[]);
    assert!(!r.ok);
    for key in [&decode_key, &gateway_key] {
        let fix = format!("run `chmod 600 {}`", key.display());
        assert!(r.stdout.contains(&fix), "{}", r.stdout);
    }
    assert!(
        r.stdout.contains("verdict: FAIL (2 violations)"),
        "{}",
        r.stdout
    );
    let err = refusal(&node, &data);
    let fix = format!("chmod 600 {}", decode_key.display());
    assert!(err.contains(&fix), "{err}");
    let err = refusal(&serve, &data);
    let fix = format!("chmod 600 {}", gateway_key.display());
    assert!(err.contains(&fix), "{err}");
    chmod(&decode_key, 0o600);
    chmod(&gateway_key, 0o600);
    // A key directory anyone can write.
    chmod(&certs, 0o777);
    let r = check(&copy, &["--json"]);
    assert!(!r.ok);
    let v: Value = serde_json::from_str(&r.stdout).unwrap();
    assert_eq!(v["violations"].as_array().unwrap().len(), 1, "{v:#}");
    assert_eq!(v["violations"][0]["label"], "exposed_cert_dir");
    let fix = format!("chmod 700 {}", certs.display());
    assert!(
        v["violations"][0]["message"]
            .as_str()
            .unwrap()
            .contains(&fix),
        "{v:#}"
    );
    assert!(refusal(&node, &data).contains(&fix));
    assert!(refusal(&serve, &data).contains(&fix));
    chmod(&certs, 0o700);
    // The CA key among the node files.
    std::fs::copy(root.path().join("node-ca/ca.key"), certs.join("ca.key")).unwrap();
    let r = check(&copy, &[]);
    assert!(!r.ok);
    assert!(
        r.stdout.contains("[exposed_cert_dir]") && r.stdout.contains("ca.key"),
        "{}",
        r.stdout
    );
    for err in [refusal(&node, &data), refusal(&serve, &data)] {
        assert!(err.contains("ca.key") && err.contains("--ca-dir"), "{err}");
    }
    std::fs::remove_file(certs.join("ca.key")).unwrap();
    assert!(check(&copy, &[]).ok);
    // Liveness out of bounds.
    let text = std::fs::read_to_string(&copy).unwrap().replacen(
        "\n[[models]]",
        "heartbeat_ms = 1\ndead_after_ms = 3600000\n\n[[models]]",
        1,
    );
    std::fs::write(&copy, text).unwrap();
    let r = check(&copy, &[]);
    assert!(!r.ok);
    for needle in [
        "[heartbeat_too_short] [node_links] heartbeat_ms = 1 is below min_heartbeat_ms = 50",
        "[dead_after_too_long] [node_links] dead_after_ms = 3600000 is above max_dead_after_ms = 60000",
    ] {
        assert!(r.stdout.contains(needle), "{}", r.stdout);
    }
    for err in [refusal(&node, &data), refusal(&serve, &data)] {
        assert!(
            err.contains("min_heartbeat_ms = 50") && err.contains("max_dead_after_ms = 60000"),
            "{err}"
        );
    }
    // Nothing served: the refused gateway created no store.
    assert!(!data.join("tessera.db").exists());
}

/// `tessera ops certs` creates every secret with its final mode, under umask 022:
/// the CA and node directories 0700, `ca.key` and the node keys 0600 (certificates
/// 0644), and `issue` refuses to write node files into the CA's directory.
#[test]
fn certs_are_created_owner_only_and_apart_from_the_ca_key() {
    use std::os::unix::fs::PermissionsExt;
    let root = tempfile::tempdir().unwrap();
    let (ca, certs) = (root.path().join("a/ca"), root.path().join("b/certs"));
    let example = repo().join("ops/deploy/tessera.toml");
    let sh = |args: &str| {
        std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("umask 022; exec \"$0\" ops certs {args}"))
            .arg(BIN)
            .output()
            .unwrap()
    };
    let out = sh(&format!("init --ca-dir {}", ca.display()));
    assert!(out.status.success(), "{out:?}");
    let issue = |dir: &Path| {
        sh(&format!(
            "issue --config {} --ca-dir {} --dir {}",
            example.display(),
            ca.display(),
            dir.display()
        ))
    };
    let out = issue(&certs);
    assert!(out.status.success(), "{out:?}");
    let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode(&ca), 0o700);
    assert_eq!(mode(&root.path().join("b")), 0o700);
    assert_eq!(mode(&certs), 0o700);
    assert_eq!(mode(&ca.join("ca.key")), 0o600);
    assert_eq!(mode(&ca.join("ca.pem")), 0o644);
    assert_eq!(mode(&certs.join("gateway.key")), 0o600);
    assert_eq!(mode(&certs.join("decode-127.0.0.1-9201.key")), 0o600);
    assert_eq!(mode(&certs.join("gateway.pem")), 0o644);
    let out = issue(&ca);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("apart from --ca-dir"), "{err}");
    assert!(!ca.join("gateway.key").exists());
}

/// Issue 32 review: `ops reload` had no default token source. Without a flag or
/// `TESSERA_ADMIN_TOKEN` it reads DATA_DIR/admin-token (what `tessera serve` creates;
/// DATA_DIR from `TESSERA_DATA_DIR`, else `.tessera`), and names it when missing.
#[test]
fn ops_reload_reads_the_default_admin_token_file() {
    let dir = tempfile::tempdir().unwrap();
    // Port 1 on loopback: nothing listens, so a token that was read fails at the POST.
    let run_in = |data_dir: Option<&Path>| {
        let mut c = std::process::Command::new(BIN);
        c.args(["ops", "reload", "--url", "http://127.0.0.1:1"])
            .current_dir(dir.path())
            .env_remove("TESSERA_ADMIN_TOKEN")
            .env_remove("TESSERA_DATA_DIR");
        if let Some(d) = data_dir {
            c.env("TESSERA_DATA_DIR", d);
        }
        c.output().unwrap()
    };
    let run = || run_in(None);
    let out = run();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("no admin token") && err.contains(".tessera/admin-token"),
        "{err}"
    );
    std::fs::create_dir(dir.path().join(".tessera")).unwrap();
    std::fs::write(dir.path().join(".tessera/admin-token"), "tadm_x\n").unwrap();
    let out = run();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        !err.contains("no admin token") && err.contains("POST http://127.0.0.1:1/admin/v1/reload"),
        "{err}"
    );
    // With TESSERA_DATA_DIR (as `tessera serve` was given it), the token is read there.
    let data = dir.path().join("data");
    let out = run_in(Some(&data));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("no admin token") && err.contains(&format!("{}/admin-token", data.display())),
        "{err}"
    );
}
