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

#[test]
fn repository_example_passes() {
    gguf();
    // Its node-link certificates, issued as its comments say (into a temporary
    // directory, which a copy of the example names).
    let certs = tempfile::tempdir().unwrap();
    let dir = certs.path().to_str().unwrap();
    let example = repo().join("ops/deploy/tessera.toml");
    for args in [
        vec!["ops", "certs", "init", "--dir", dir],
        vec![
            "ops",
            "certs",
            "issue",
            "--config",
            example.to_str().unwrap(),
            "--dir",
            dir,
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
    let text = std::fs::read_to_string(&example)
        .unwrap()
        .replace(
            "\".tessera/node-certs/ca.pem\"",
            &format!("\"{dir}/ca.pem\""),
        )
        .replace("\".tessera/node-certs\"", &format!("\"{dir}\""));
    let copy = certs.path().join("tessera.toml");
    std::fs::write(&copy, text).unwrap();
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
