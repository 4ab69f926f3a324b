//! Many models: `tessera model fetch --variant` writes requantized copies of the
//! default model.

mod common;

use common::{model_path, BIN};
use std::process::Command;
use tessera_model::gguf_write::VARIANTS;

fn fetch(dir: &std::path::Path, extra: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .args(["model", "fetch", "--models-dir"])
        .arg(dir)
        .args(extra)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn model_fetch_writes_each_variant_with_its_recorded_sha256() {
    let dir = tempfile::tempdir().unwrap();
    // The default model is already installed (verified, not downloaded again).
    std::os::unix::fs::symlink(
        model_path(),
        dir.path().join("SmolLM2-135M-Instruct.Q4_1.gguf"),
    )
    .unwrap();
    let (ok, out, err) = fetch(dir.path(), &["--variant", "q8_0", "--variant", "q4_0"]);
    assert!(ok, "{err}");
    for v in VARIANTS {
        let path = dir.path().join(v.file);
        assert!(path.exists(), "{}", path.display());
        // One line per variant: sha256, path, catalog id.
        let line = format!("{}  {}  {}", v.sha256, path.display(), v.id);
        assert!(out.contains(&line), "{out}");
    }
    // Installed: nothing to do; damaged: written again.
    let (ok, _, err) = fetch(dir.path(), &["--variant", "q8_0"]);
    assert!(ok && err.contains("nothing to do"), "{err}");
    let q8 = dir.path().join(VARIANTS[0].file);
    std::fs::write(&q8, b"damaged").unwrap();
    let (ok, out, err) = fetch(dir.path(), &["--variant", "q8_0"]);
    assert!(ok && err.contains("writing it again"), "{err}");
    assert!(out.contains(VARIANTS[0].sha256), "{out}");
    // Unknown variants are refused by name.
    let (ok, _, err) = fetch(dir.path(), &["--variant", "q2_k"]);
    assert!(!ok && err.contains("q2_k"), "{err}");
}
