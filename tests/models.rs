//! Many models: `tessera model fetch --variant` writes requantized copies of the
//! default model; one gateway serves two models of different shapes, each on its
//! own prefill and decode node processes.

mod common;

use common::*;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::Command;
use tessera_model::gguf_write::{write_random_llama, RandomLlama, VARIANTS};

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

/// The second model of the multi-process tests: random weights, another shape.
const TINY: &str = "@cf/tessera/random-llama-tiny";

/// A deployment file with two models, each on its own prefill and decode pool
/// (ports `p[0..4]`: prefill-a, decode-a, prefill-b, decode-b), mutual TLS with
/// certificates issued into `dir/certs`.
fn two_model_config(dir: &Path, tiny: &Path, ports: [u16; 4], swap_decode: bool) -> PathBuf {
    let pool = |name: &str, role: &str, tokens: usize, port: u16, model: &str| {
        format!(
            "[[pools]]\nname = \"{name}\"\nrole = \"{role}\"\nkv_pool_tokens = {tokens}\nnodes = [\"127.0.0.1:{port}\"]\nmodels = [\"{model}\"]\n\n"
        )
    };
    // `swap_decode`: a stale file that says model A's decode node is model B's.
    let (da, db) = if swap_decode {
        (ports[3], ports[1])
    } else {
        (ports[1], ports[3])
    };
    let certs = dir.join("certs");
    let text = format!(
        "[gateway]\nlisten = \"127.0.0.1:0\"\n\n\
         [[models]]\nid = \"{MODEL_ID}\"\npath = \"{}\"\ndescription = \"the default model\"\n\
         aliases = [\"smollm2\"]\ntags = [\"chat\"]\n\n\
         [[models]]\nid = \"{TINY}\"\npath = \"{}\"\ndeprecated = \"2020-01-01\"\n\n{}{}{}{}\
         [node_links]\nca = \"{}\"\ncert_dir = \"{}\"\n",
        model_path().display(),
        tiny.display(),
        pool("prefill-a", "prefill", CONTEXT, ports[0], MODEL_ID),
        pool("decode-a", "decode", CONTEXT, da, MODEL_ID),
        pool("prefill-b", "prefill", 4096, ports[2], TINY),
        pool("decode-b", "decode", 4096, db, TINY),
        certs.join("ca.pem").display(),
        certs.display(),
    );
    let name = if swap_decode {
        "stale.toml"
    } else {
        "tessera.toml"
    };
    let path = dir.join(name);
    std::fs::write(&path, text).unwrap();
    init_ca(&certs);
    issue_certs(&path, &certs);
    path
}

/// (status, body) of a Workers AI request for `model`.
async fn run_model(g: &Gateway, model: &str, body: &serde_json::Value) -> (u16, serde_json::Value) {
    run_at(
        g.base.clone(),
        g.account.clone(),
        g.key.clone(),
        model,
        body,
    )
    .await
}

/// [`run_model`] with the gateway's address and credentials owned (for tasks).
async fn run_at(
    base: String,
    account: String,
    key: String,
    model: &str,
    body: &serde_json::Value,
) -> (u16, serde_json::Value) {
    let url = format!("{base}/client/v4/accounts/{account}/ai/run/{model}");
    let resp = reqwest::Client::new()
        .post(url)
        .bearer_auth(&key)
        .json(body)
        .timeout(REQUEST)
        .send()
        .await
        .unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or_default())
}

const PROMPTS: [&str; 3] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
];

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_models_of_different_shapes_behind_one_gateway_of_node_processes() {
    let dir = tempfile::tempdir().unwrap();
    let tiny = dir.path().join("tiny.gguf");
    write_random_llama(&model_path(), &tiny, &RandomLlama::SMALL).unwrap();
    let ports = [free_port(), free_port(), free_port(), free_port()];
    let config = two_model_config(dir.path(), &tiny, ports, false);
    let report = ops(&["check-config", config.to_str().unwrap()]);
    assert!(
        report.contains("verdict: OK (2 models, 4 pools, 4 nodes)"),
        "{report}"
    );
    let d = dir.path();
    assert!(report.contains("), aliases smollm2"), "{report}");
    assert!(report.contains("), deprecated 2020-01-01"), "{report}");
    // The catalog fields are checked: a bad date, an alias that is another
    // model's id, a sunset before the deprecation, both models on one pool.
    let bad = std::fs::read_to_string(&config)
        .unwrap()
        .replace(
            "deprecated = \"2020-01-01\"",
            "deprecated = \"2020-13-01\"\naliases = [\"SMOLLM2\"]",
        )
        .replace(
            "tags = [\"chat\"]",
            "tags = [\"chat\"]\ndeprecated = \"2026-02-01\"\nsunset = \"2026-01-01\"",
        )
        .replace(
            &format!("models = [\"{TINY}\"]\n\n[[pools]]\nname = \"decode-b\""),
            "\n[[pools]]\nname = \"decode-b\"",
        );
    let bad_path = d.join("bad.toml");
    std::fs::write(&bad_path, bad).unwrap();
    let out = Command::new(BIN)
        .args(["ops", "check-config", "--json"])
        .arg(&bad_path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let messages = v["violations"].to_string();
    for l in ["bad_model_field", "duplicate_alias", "pool_models"] {
        assert!(messages.contains(&format!("\"{l}\"")), "{l}: {messages}");
    }
    for needle in [
        "`deprecated` `2020-13-01` is not a date",
        "`sunset` 2026-01-01 must be after",
        "alias SMOLLM2",
    ] {
        assert!(messages.contains(needle), "{needle}: {messages}");
    }
    assert_eq!(v["models"][0]["aliases"], json!(["smollm2"]));
    let _nodes = [
        start_node(d, &config, "decode", ports[1]).await,
        start_node(d, &config, "decode", ports[3]).await,
        start_node(d, &config, "prefill", ports[0]).await,
        start_node(d, &config, "prefill", ports[2]).await,
    ];
    let g = start_config_gateway(d, &config, "data", "gateway.log", &[]).await;
    let body = |p: &str| json!({"prompt": p, "max_tokens": 12, "temperature": 0});
    // Solo: one request at a time (retrying while the gateway's links come up).
    let mut solo = Vec::new();
    for model in [MODEL_ID, TINY] {
        for p in PROMPTS {
            let deadline = std::time::Instant::now() + REQUEST;
            let v = loop {
                let (status, v) = run_model(&g, model, &body(p)).await;
                if status == 200 {
                    break v;
                }
                assert!(
                    status == 503 && std::time::Instant::now() < deadline,
                    "{status} {v}\n{}",
                    logs(d)
                );
                tokio::time::sleep(std::time::Duration::from_millis(250)).await;
            };
            solo.push(((model, p), answer(&v["result"])));
        }
    }
    for p in PROMPTS {
        let of = |m: &str| {
            &solo
                .iter()
                .find(|((mm, pp), _)| *mm == m && *pp == p)
                .unwrap()
                .1
        };
        assert_ne!(of(MODEL_ID), of(TINY), "{p}");
    }
    // Interleaved across models, twice over.
    let mut tasks = tokio::task::JoinSet::new();
    for ((m, p), want) in solo.iter().chain(solo.iter()) {
        let (m, p, want, b) = (m.to_string(), p.to_string(), want.clone(), body(p));
        let (base, account, key) = (g.base.clone(), g.account.clone(), g.key.clone());
        tasks.spawn(async move {
            let got = run_at(base, account, key, &m, &b).await;
            (m, p, want, got)
        });
    }
    while let Some(r) = tasks.join_next().await {
        let (m, p, want, (status, v)) = r.unwrap();
        assert_eq!(status, 200, "{m} {p}: {v}");
        assert_eq!(
            answer(&v["result"]),
            want,
            "{m} {p}: interleaved differs from solo"
        );
    }
    // The catalog joins the file's metadata with the GGUF's; an alias routes.
    let models = reqwest::Client::new()
        .get(format!("{}/v1/models", g.base))
        .bearer_auth(&g.key)
        .send()
        .await
        .unwrap();
    let v: serde_json::Value = models.json().await.unwrap();
    assert_eq!(v["data"][0]["description"], "the default model", "{v}");
    assert_eq!(v["data"][0]["aliases"], json!(["smollm2"]));
    assert_eq!(v["data"][1]["context_window"], 4096);
    assert_eq!(v["data"][1]["deprecated"], "2020-01-01");
    let (status, v) = run_model(&g, "smollm2", &body(PROMPTS[0])).await;
    let want = &solo
        .iter()
        .find(|((m, p), _)| *m == MODEL_ID && *p == PROMPTS[0])
        .unwrap()
        .1;
    assert_eq!((status, &answer(&v["result"])), (200, want));
    // Per-model admission: the random model's window is 4096 tokens.
    let (status, v) = run_model(&g, TINY, &json!({"prompt": "Hi", "max_tokens": 4090})).await;
    assert_eq!(status, 400, "{v}");

    // A stale deployment file that points model A at model B's decode node: that
    // node refuses the gateway's link (it serves another model), so model A's
    // requests through that gateway get 503, never an answer from model B's pages.
    let stale = two_model_config(d, &tiny, ports, true);
    let bad = start_config_gateway(d, &stale, "data-stale", "stale-gateway.log", &[]).await;
    let (status, v) = run_model(&bad, MODEL_ID, &body(PROMPTS[0])).await;
    assert_eq!(status, 503, "{v}");
    let decode_b =
        std::fs::read_to_string(d.join("decode-".to_string() + &ports[3].to_string() + ".log"))
            .or_else(|_| std::fs::read_to_string(d.join("decode.log")))
            .unwrap();
    assert!(decode_b.contains("serves model"), "{}", logs(d));
    // The real gateway still serves both models their solo answers.
    for ((m, p), want) in &solo {
        let (status, v) = run_model(&g, m, &body(p)).await;
        assert_eq!((status, &answer(&v["result"])), (200, want), "{m} {p}");
    }
}

/// `tessera model access`: shows and sets who may use a model in the store
/// (audited as `model.access`); refuses unknown tenants and tenants on a public
/// model.
#[test]
fn model_access_cli_sets_and_shows_a_models_tenants() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().to_str().unwrap();
    let run = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(args)
            .args(["--data-dir", data])
            .env_remove("TESSERA_STORE")
            .output()
            .unwrap();
        let v = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
        (
            out.status.code(),
            v,
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, v, err) = run(&["tenant", "create", "--name", "acme"]);
    assert_eq!(code, Some(0), "{err}");
    let t = v["tenant"]["id"].as_str().unwrap().to_string();
    let (code, v, _) = run(&["model", "access", TINY]);
    assert_eq!(
        (code, &v),
        (
            Some(0),
            &json!({"model": TINY, "private": false, "tenants": []})
        )
    );
    let (code, v, err) = run(&["model", "access", TINY, "--private", "--tenant", &t]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(v, json!({"model": TINY, "private": true, "tenants": [t]}));
    let (_, shown, _) = run(&["model", "access", TINY]);
    assert_eq!(shown, v);
    let (code, _, err) = run(&["model", "access", TINY, "--private", "--tenant", "nobody"]);
    assert_eq!(code, Some(1));
    assert!(err.contains("no tenant with id `nobody`"), "{err}");
    let (code, _, err) = run(&["model", "access", TINY, "--public", "--tenant", &t]);
    assert_eq!(code, Some(2), "{err}");
    let (_, audit, _) = run(&["audit"]);
    let rows: Vec<_> = audit
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| r["action"] == "model.access")
        .collect();
    assert_eq!(rows.len(), 1);
    assert!(rows[0]["source"].as_str().unwrap().starts_with("cli:"));
}
