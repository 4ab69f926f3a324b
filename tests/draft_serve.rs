//! Draft-model speculation through `tessera serve` (issue 37): `--draft-model`
//! gives Qwen2.5-Coder-1.5B the 0.5B as its draft model; a request's
//! `speculative` mode `draft` (and a `speculative` without a mode) answers exactly
//! what plain decoding answers on both API shapes, and the drafts show in the
//! metrics; a model without a draft model refuses mode `draft` with a 400 naming
//! the field; a draft model of another tokenizer or for an unknown id stops the
//! server at start.

mod common;

use common::*;
use serde_json::{json, Value};
use std::path::PathBuf;

const TARGET: &str = "@cf/qwen/qwen2.5-coder-1.5b-instruct";
const SMALL: &str = "@cf/qwen/qwen2.5-coder-0.5b-instruct";

fn models_file(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("models")
        .join(name);
    assert!(p.exists(), "{} is missing: run scripts/test", p.display());
    p
}

async fn post(url: &str, key: &str, body: &Value) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(url)
        .bearer_auth(key)
        .json(body)
        .timeout(REQUEST)
        .send()
        .await
        .unwrap();
    (
        resp.status().as_u16(),
        resp.json().await.unwrap_or(Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draft_model_serves_the_same_answers_and_only_where_configured() {
    let dir = tempfile::tempdir().unwrap();
    let target = models_file("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf");
    let small = models_file("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let (t, s) = (target.to_str().unwrap(), small.to_str().unwrap());
    let data = dir.path().join("data");
    let gw = start_gateway(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--data-dir",
            data.to_str().unwrap(),
            "--model",
            &format!("{TARGET}={t}"),
            "--model",
            &format!("{SMALL}={s}"),
            "--draft-model",
            &format!("{TARGET}={s}"),
        ],
        &dir.path().join("serve.log"),
    )
    .await;
    let admin = std::fs::read_to_string(data.join("admin-token")).unwrap();
    let admin = admin.trim();
    let chat = format!("{}/v1/chat/completions", gw.base);
    let run = |model: &str| {
        format!(
            "{}/client/v4/accounts/{}/ai/run/{model}",
            gw.base, gw.account
        )
    };
    let msgs = json!([{"role": "user", "content":
        "Rename `n` to `count` and return the code:\ndef twice(n):\n    return n + n\n"}]);
    let body = |model: &str, sp: Value| {
        let mut b = json!({"model": model, "messages": msgs, "max_tokens": 32, "temperature": 0});
        if !sp.is_null() {
            b["speculative"] = sp;
        }
        b
    };
    let answer = |v: &Value| {
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (st, plain) = post(&chat, &gw.key, &body(TARGET, json!({"k": 0}))).await;
    assert_eq!(st, 200, "{plain}");
    let plain = answer(&plain);
    assert!(!plain.is_empty());
    let before =
        metrics::gateway_metric_sum(&gw, admin, "tessera_spec_accepted_tokens_total").await;
    for sp in [json!({"mode": "draft", "k": 4}), json!({}), json!({"k": 2})] {
        let (st, v) = post(&chat, &gw.key, &body(TARGET, sp.clone())).await;
        assert_eq!(st, 200, "{sp}: {v}");
        assert_eq!(answer(&v), plain, "{sp}");
    }
    let wai = json!({"messages": msgs, "max_tokens": 32, "temperature": 0,
        "speculative": {"mode": "draft"}});
    let (st, v) = post(&run(TARGET), &gw.key, &wai).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["result"]["response"], json!(plain));
    let after = metrics::gateway_metric_sum(&gw, admin, "tessera_spec_accepted_tokens_total").await;
    assert!(after > before, "drafts accepted: {before} -> {after}");

    // The 0.5B has no draft model: `draft` is a 400 naming the field; `ngram` serves.
    for (url, b) in [
        (chat.clone(), body(SMALL, json!({"mode": "draft"}))),
        (run(SMALL), wai.clone()),
    ] {
        let (st, v) = post(&url, &gw.key, &b).await;
        assert_eq!(st, 400, "{v}");
        let text = v.to_string();
        assert!(
            text.contains("speculative") && text.contains("no draft model"),
            "{v}"
        );
    }
    let (st, v) = post(&chat, &gw.key, &body(SMALL, json!({"mode": "ngram"}))).await;
    assert_eq!(st, 200, "{v}");
}

fn refusal(args: &[&str]) -> String {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .args(args)
        .env_remove("TESSERA_STORE")
        .env_remove("TESSERA_ADMIN_TOKEN")
        .env_remove("TESSERA_MODEL")
        .output()
        .unwrap();
    assert!(!out.status.success(), "serve started with {args:?}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn a_draft_model_must_share_the_tokenizer_and_name_a_served_model() {
    let small = models_file("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf");
    let s = small.to_str().unwrap();
    let smol = model_path();
    let m = smol.to_str().unwrap();
    // SmolLM2 drafting for Qwen: another vocabulary.
    let err = refusal(&[
        "--model",
        &format!("{SMALL}={s}"),
        "--draft-model",
        &format!("{SMALL}={m}"),
    ]);
    assert!(err.contains("tokenizer") && err.contains(SMALL), "{err}");
    // A draft model for a model that is not served.
    let err = refusal(&["--model", m, "--draft-model", &format!("{TARGET}={s}")]);
    assert!(err.contains("no --model has the id"), "{err}");
}

/// The `[[models]]` entry's `draft` in a node deployment: the decode node loads the
/// draft model (here the model itself: same tokenizer) and the gateway accepts mode
/// `draft`; the answer is plain decoding's and the decode node counts drafts of
/// mode `draft`. A deployment without `draft` refuses the mode with a 400.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_deployment_drafts_on_its_decode_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d) = (free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
    let text = std::fs::read_to_string(&config).unwrap();
    let path_line = format!("path = \"{}\"", model_path().display());
    assert!(text.contains(&path_line));
    let with_draft = text.replace(
        &path_line,
        &format!("{path_line}\ndraft = \"{}\"", model_path().display()),
    );
    std::fs::write(&config, with_draft).unwrap();
    let (dep, metrics_url) = Deployment::start_metered(dir, config, p, d).await;
    let body = |sp: Value| {
        json!({"prompt": "Write a short poem about rivers.", "max_tokens": 24,
               "temperature": 0, "speculative": sp})
    };
    let (st, plain) = dep.gateway.run(&body(json!({"k": 0}))).await;
    assert_eq!(st, 200, "{plain}");
    let (st, v) = dep
        .gateway
        .run(&body(json!({"mode": "draft", "k": 4})))
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["result"]["response"], plain["result"]["response"]);
    let text = reqwest::get(&metrics_url)
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let drafted: f64 = text
        .lines()
        .filter(|l| {
            l.starts_with("tessera_spec_accepted_tokens_total{") && l.contains("mode=\"draft\"")
        })
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum();
    assert!(drafted > 0.0, "{text}");
    drop(dep);

    let plain_dep = Deployment::start().await;
    let (st, v) = plain_dep.gateway.run(&body(json!({"mode": "draft"}))).await;
    assert_eq!(st, 400, "{v}");
    assert!(v.to_string().contains("no draft model"), "{v}");
}
