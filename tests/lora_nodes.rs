//! LoRA fine-tunes on a deployment of `tessera node` processes (issue 38): the
//! gateway sends the adapter's file over each node link before the first request
//! under it, the nodes check and load it, and the answer under the fine-tune is the
//! in-process server's answer, byte for byte (greedy), while the base model's answer
//! stays the base's.

mod common;

use common::*;
use serde_json::{json, Value};
use std::path::Path;

/// `tessera finetune create` for `tenant` in the store of `data`, named `tuned`.
fn create(data: &Path, tenant: &str, file: &Path) {
    let model = model_path();
    tessera(&[
        "finetune",
        "create",
        "--tenant",
        tenant,
        "--model",
        MODEL_ID,
        "--model-file",
        model.to_str().unwrap(),
        "--name",
        "tuned",
        file.to_str().unwrap(),
        "--data-dir",
        data.to_str().unwrap(),
    ]);
}

/// A random adapter for the default model on four projections of every block
/// (`scripts/make_lora.py`, llama.cpp's `gguf` package).
fn adapter(dir: &Path) -> std::path::PathBuf {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = dir.join("tuned.gguf");
    let ok = std::process::Command::new(test_python())
        .arg(format!("{root}/scripts/make_lora.py"))
        .arg(model_path())
        .arg(&out)
        .args([
            "--kind",
            "random",
            "--targets",
            "attn_q,attn_v,ffn_up,ffn_down",
        ])
        .args(["--scale", "0.05", "--seed", "3"])
        .status()
        .unwrap()
        .success();
    assert!(ok, "make_lora.py");
    out
}

fn answer(v: &Value) -> String {
    assert_eq!(v["success"], true, "{v}");
    v["result"]["response"].as_str().unwrap().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_processes_serve_a_fine_tune_as_the_in_process_server_does() {
    let dir = tempfile::tempdir().unwrap();
    let file = adapter(dir.path());
    let prompt = "Describe the colour of the sky in one sentence. ".repeat(4);
    let body = |lora: Option<&str>| {
        let mut b = json!({"prompt": prompt, "max_tokens": 24, "temperature": 0});
        if let Some(l) = lora {
            b["lora"] = l.into();
        }
        b
    };

    // The in-process server's answers.
    let data = dir.path().join("serve");
    let gw = start_serve(&data, &dir.path().join("serve.log")).await;
    create(&data, &gw.account, &file);
    let (st, base) = gw.run(&body(None)).await;
    assert_eq!(st, 200, "{base}");
    let (st, tuned) = gw.run(&body(Some("tuned"))).await;
    assert_eq!(st, 200, "{tuned}");
    let (base, tuned) = (answer(&base), answer(&tuned));
    assert_ne!(base, tuned, "the fine-tune changes the answer");
    drop(gw);

    // Node processes: the same answers, the adapter sent once per link.
    let dep = Deployment::start().await;
    create(&dep.dir.path().join("data"), &dep.gateway.account, &file);
    for lora in [Some("tuned"), None, Some("tuned")] {
        let (st, v) = dep.gateway.run(&body(lora)).await;
        assert_eq!(st, 200, "{lora:?}: {v}");
        let want = if lora.is_some() { &tuned } else { &base };
        assert_eq!(&answer(&v), want, "{lora:?}");
    }
    // Streamed too.
    let mut sse = dep.gateway.stream(&body(Some("tuned"))).await;
    sse.read_to_end().await;
    assert!(sse.has_done() && !sse.has_error(), "{:?}", sse.events);
    assert_eq!(sse.text(), tuned);
}
