//! `--device cuda` of `tessera serve` and `tessera node` where there is no CUDA
//! (issue 16): the command fails before it loads a model or listens, with an error
//! naming what is missing. A binary built without the cargo feature `cuda` says
//! so; one built with it (`.ci/run` phase cuda-nvrtc runs this file that way) names
//! the CUDA driver library this machine lacks.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_tessera");

/// What the error must say on this build.
fn expected() -> &'static str {
    if cfg!(feature = "cuda") {
        "--device cuda: CUDA driver library not found"
    } else {
        "--device cuda: this tessera binary was built without CUDA support"
    }
}

/// Whether this machine has an NVIDIA driver (then the CUDA build would go on to
/// open the device, which the GPU checks cover instead).
fn has_driver() -> bool {
    std::path::Path::new("/dev/nvidiactl").exists()
}

/// Runs `tessera ARGS`; returns stderr after checking it failed quickly.
fn fails(args: &[&str]) -> String {
    let t = Instant::now();
    let out = Command::new(BIN)
        .args(args)
        .env_remove("TESSERA_STORE")
        .env_remove("TESSERA_MODEL")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{args:?} succeeded:\n{err}");
    assert!(
        t.elapsed() < Duration::from_secs(30),
        "{args:?} took {:?}",
        t.elapsed()
    );
    err
}

#[test]
fn serve_with_device_cuda_fails_naming_what_is_missing() {
    if cfg!(feature = "cuda") && has_driver() {
        eprintln!("skipped: this machine has an NVIDIA driver");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    for extra in [&[][..], &["--colocated"][..]] {
        let mut args = vec![
            "serve",
            "--device",
            "cuda",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data,
        ];
        args.extend_from_slice(extra);
        let err = fails(&args);
        assert!(err.contains(expected()), "{err}");
        assert!(err.contains("--device cpu"), "{err}");
    }
}

#[test]
fn node_with_device_cuda_fails_naming_what_is_missing() {
    if cfg!(feature = "cuda") && has_driver() {
        eprintln!("skipped: this machine has an NVIDIA driver");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (g, p, d) = (
        common::free_port(),
        common::free_port(),
        common::free_port(),
    );
    let cfg = common::write_config_with(dir.path(), g, p, &[d], (8192, 8192), None);
    for role in ["prefill", "decode"] {
        let err = fails(&[
            "node",
            "--role",
            role,
            "--config",
            cfg.to_str().unwrap(),
            "--insecure-node-links",
            "--device",
            "cuda",
        ]);
        assert!(err.contains(expected()), "{role}: {err}");
    }
}

#[test]
fn device_cuda_with_a_deployment_file_is_refused_at_the_gateway() {
    let dir = tempfile::tempdir().unwrap();
    let (g, p, d) = (
        common::free_port(),
        common::free_port(),
        common::free_port(),
    );
    let cfg = common::write_config_with(dir.path(), g, p, &[d], (8192, 8192), None);
    let err = fails(&[
        "serve",
        "--device",
        "cuda",
        "--config",
        cfg.to_str().unwrap(),
        "--insecure-node-links",
        "--data-dir",
        dir.path().to_str().unwrap(),
    ]);
    assert!(err.contains("with --config the nodes compute"), "{err}");
}
