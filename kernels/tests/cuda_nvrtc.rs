//! Every CUDA kernel source compiles with NVRTC for Hopper (`sm_90`): to PTX for
//! `compute_90` and to CUBIN for `sm_90` (ptxas included), and defines each kernel
//! the host launches. Needs no GPU, only the NVRTC library.
//!
//! NVRTC is found at `TESSERA_NVRTC_LIB`, else in the tests' Python environment
//! (`target/py`, or `TESSERA_TEST_VENV`), where `scripts/python-env` installs the
//! PyPI wheel `nvidia-cuda-nvrtc` from `scripts/requirements-test.txt`, else by
//! the usual library names. Without it the test says so and passes, unless
//! `TESSERA_REQUIRE_NVRTC=1` (set by `.ci/run`), which makes that a failure.
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use tessera_kernels::cuda::nvrtc::{wheel_libraries, Nvrtc, Output, NVRTC_LIB_ENV};
use tessera_kernels::cuda::sources::SOURCES;

fn nvrtc() -> Option<Nvrtc> {
    let required = std::env::var("TESSERA_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    if std::env::var_os(NVRTC_LIB_ENV).is_some() {
        return Some(Nvrtc::load().expect("NVRTC from TESSERA_NVRTC_LIB"));
    }
    let venv = std::env::var_os("TESSERA_TEST_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/py"));
    let mut why = Vec::new();
    for p in wheel_libraries(&venv) {
        match Nvrtc::load_path(&p) {
            Ok(n) => return Some(n),
            Err(e) => why.push(e.to_string()),
        }
    }
    match Nvrtc::load() {
        Ok(n) => Some(n),
        Err(e) => {
            why.push(e.to_string());
            let msg = format!(
                "NVRTC not found, so the CUDA sources were not compiled: no wheel under {} \
                 (run scripts/python-env) and {}",
                venv.display(),
                why.join("; ")
            );
            assert!(!required, "TESSERA_REQUIRE_NVRTC=1: {msg}");
            eprintln!("skipped: {msg}");
            None
        }
    }
}

#[test]
fn every_kernel_source_compiles_for_sm_90() {
    let Some(nv) = nvrtc() else { return };
    let (major, minor) = nv.version().unwrap();
    eprintln!("NVRTC {major}.{minor} from {}", nv.path());
    for src in SOURCES {
        let ptx = nv
            .compile(src, "compute_90", Output::Ptx)
            .unwrap_or_else(|e| panic!("{e}"));
        let ptx = String::from_utf8_lossy(&ptx);
        assert!(ptx.contains(".target sm_90"), "{}: target", src.name);
        for k in src.kernels {
            assert!(
                ptx.contains(&format!(".entry {k}(")),
                "{}: kernel {k} missing from the PTX",
                src.name
            );
        }
        let (cubin, log) = nv
            .compile_with(src, "sm_90", Output::Cubin, &["--ptxas-options=--verbose"])
            .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            &cubin[..4],
            b"\x7fELF",
            "{}: CUBIN is an ELF image",
            src.name
        );
        // ptxas's report: every kernel keeps its arrays in registers (a stack frame
        // or spills mean local-memory traffic, HOPPER.md).
        for k in src.kernels {
            let report = log
                .split("Compiling entry function '")
                .find(|part| part.starts_with(&format!("{k}'")))
                .unwrap_or_else(|| panic!("{}: no ptxas report for {k}:\n{log}", src.name));
            eprintln!("{}", report.lines().take(4).collect::<Vec<_>>().join(" | "));
            assert!(
                report.contains("0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"),
                "{}: {k} uses local memory:\n{report}",
                src.name
            );
        }
    }
}

#[test]
fn a_broken_source_reports_the_compiler_log() {
    let Some(nv) = nvrtc() else { return };
    let bad = tessera_kernels::cuda::sources::KernelSource {
        name: "broken.cu",
        text:
            "#include \"tessera_common.cuh\"\nextern \"C\" __global__ void k() { undeclared(); }\n",
        kernels: &["k"],
    };
    let e = nv.compile(&bad, "sm_90", Output::Cubin).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("broken.cu") && msg.contains("undeclared"),
        "{msg}"
    );
}
