//! `ai/finetunes` against a live gateway and the real default model (issue 38 item
//! 1), with adapters written by `scripts/make_lora.py` through llama.cpp's own
//! `gguf` package: an upload is checked against the base model (each kind of
//! mismatch refused with a 400 naming it), stored byte for byte with its hash and
//! audited; and as an attacker: no key, a key without `finetunes:write`, another
//! account's key on the account's URL, another account's fine-tune by id and by
//! name (the same 404 as an unknown one, for reads and deletes), garbage, empty and
//! oversized bodies, multipart, an unknown base model, a reused name.

mod common;

use common::*;
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use tessera_gateway::GatewayOptions;
use tessera_tenancy::{Limits, NewKey, Scopes};

/// Cap on uploads in this test: over every adapter below, under a few MB of garbage.
const CAP: usize = 4 << 20;

/// Writes an adapter of `kind` for the default model into `dir` (extra args to
/// `make_lora.py`); returns its path.
fn adapter(dir: &Path, kind: &str, extra: &[&str]) -> PathBuf {
    let out = dir.join(format!("{kind}.gguf"));
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/make_lora.py");
    let status = std::process::Command::new(test_python())
        .arg(script)
        .arg(model_path())
        .arg(&out)
        .args(["--kind", kind])
        .args(extra)
        .status()
        .expect("run scripts/make_lora.py");
    assert!(status.success(), "make_lora.py --kind {kind} failed");
    out
}

struct Api<'a> {
    s: &'a TestServer,
}

impl Api<'_> {
    fn url(&self, account: &str, rest: &str) -> String {
        format!(
            "{}/client/v4/accounts/{account}/ai/finetunes{rest}",
            self.s.base
        )
    }

    async fn upload(
        &self,
        account: &str,
        key: Option<&str>,
        query: &str,
        body: Vec<u8>,
        content_type: &str,
    ) -> (u16, Value) {
        // A fresh connection per upload: a refusal before the body is read closes
        // its connection, and a pooled one reused after it fails mid-request.
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(0)
            .build()
            .unwrap();
        let mut r = client
            .post(format!("{}?{query}", self.url(account, "")))
            .header("content-type", content_type)
            .body(body);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        let (status, _, v) = split(r.send().await.unwrap()).await;
        (status, v)
    }

    async fn put_file(&self, account: &str, key: &str, name: &str, file: &Path) -> (u16, Value) {
        let q = format!("model={}&name={name}&description=test", urlencode(MODEL_ID));
        self.upload(
            account,
            Some(key),
            &q,
            std::fs::read(file).unwrap(),
            "application/octet-stream",
        )
        .await
    }

    async fn get(&self, account: &str, key: &str, rest: &str) -> (u16, Value) {
        let (status, _, v) = self.s.get(&self.url(account, rest), Some(key)).await;
        (status, v)
    }

    async fn delete(&self, account: &str, key: &str, rest: &str) -> (u16, Value) {
        let r = self
            .s
            .client
            .delete(self.url(account, rest))
            .bearer_auth(key);
        let (status, _, v) = split(r.send().await.unwrap()).await;
        (status, v)
    }
}

const MODEL_ID: &str = tessera_model::DEFAULT_MODEL_ID;

fn urlencode(s: &str) -> String {
    s.replace('@', "%40").replace('/', "%2F")
}

fn message(v: &Value) -> String {
    v["errors"][0]["message"].as_str().unwrap_or("").to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapters_are_checked_stored_and_reachable_by_their_tenant_alone() {
    let s = start_with(GatewayOptions {
        max_finetune_bytes: CAP,
        ..GatewayOptions::default()
    })
    .await;
    let api = Api { s: &s };
    let dir = s.dir.path();
    let store = s.store();
    let writer = |name: &'static str| NewKey {
        scopes: Scopes::ALL,
        ..NewKey::named(name)
    };
    let a = store
        .create_tenant("ft-a", Limits::NEW_TENANT)
        .await
        .unwrap();
    let (_, a_key) = store.create_key_with(&a.id, &writer("w")).await.unwrap();
    let (_, a_plain) = store.create_key(&a.id, "plain").await.unwrap();
    let b = store
        .create_tenant("ft-b", Limits::NEW_TENANT)
        .await
        .unwrap();
    let (_, b_key) = store.create_key_with(&b.id, &writer("w")).await.unwrap();

    // A valid adapter: stored byte for byte, described as it is.
    let random = adapter(dir, "random", &["--rank", "8"]);
    let bytes = std::fs::read(&random).unwrap();
    let (status, v) = api.put_file(&a.id, &a_key, "style-v1", &random).await;
    assert_eq!(status, 200, "{v}");
    let ft = &v["result"];
    assert_eq!(ft["name"], "style-v1");
    assert_eq!(ft["model"], MODEL_ID);
    assert_eq!(ft["rank"], 8);
    assert_eq!(ft["targets"], 60, "attn_q and attn_v of 30 layers");
    assert_eq!(ft["alpha"], 16.0);
    assert_eq!(ft["size_bytes"], bytes.len());
    assert_eq!(ft["sha256"], hex(&Sha256::digest(&bytes)));
    assert_eq!(ft["account_id"], a.id.as_str());
    let id = ft["id"].as_str().unwrap().to_string();
    assert_eq!(store.finetune_data(&id).await.unwrap().unwrap(), bytes);

    // Its tenant lists and reads it by id and by name.
    let (status, v) = api.get(&a.id, &a_key, "").await;
    assert_eq!((status, v["result"].as_array().unwrap().len()), (200, 1));
    for key in [&id, "style-v1"] {
        let (status, v) = api.get(&a.id, &a_plain, &format!("/{key}")).await;
        assert_eq!(
            (status, v["result"]["id"].as_str()),
            (200, Some(id.as_str()))
        );
    }
    // Another tenant: not in its list, and by id or name exactly an unknown one.
    let (status, v) = api.get(&b.id, &b_key, "").await;
    assert_eq!((status, v["result"].as_array().unwrap().len()), (200, 0));
    for key in [id.as_str(), "style-v1"] {
        let (s_b, v_b) = api.get(&b.id, &b_key, &format!("/{key}")).await;
        assert_eq!(s_b, 404, "{v_b}");
        assert_eq!(message(&v_b), format!("no fine-tune {key:?}"));
        let (s_d, _) = api.delete(&b.id, &b_key, &format!("/{key}")).await;
        assert_eq!(s_d, 404);
    }
    let (status, _) = api.get(&b.id, &b_key, "/public").await;
    assert_eq!(status, 200);
    // B's key on A's URL: the account check, before anything else. (Refusals
    // before the body is read answer at once and close the connection: small
    // bodies here, so the client is still there to read them.)
    let tiny = || b"GGUF".to_vec();
    let q = format!("model={}&name=n", urlencode(MODEL_ID));
    let oct = "application/octet-stream";
    assert_eq!(api.get(&a.id, &b_key, &format!("/{id}")).await.0, 403);
    assert_eq!(api.delete(&a.id, &b_key, &format!("/{id}")).await.0, 403);
    assert_eq!(
        api.upload(&a.id, Some(&b_key), &q, tiny(), oct).await.0,
        403
    );
    // Still there for A.
    assert_eq!(api.get(&a.id, &a_key, &format!("/{id}")).await.0, 200);

    // Credentials and scopes.
    assert_eq!(api.upload(&a.id, None, &q, tiny(), oct).await.0, 401);
    assert_eq!(api.upload(&a.id, Some(""), &q, tiny(), oct).await.0, 401);
    let (status, v) = api.upload(&a.id, Some(&a_plain), &q, tiny(), oct).await;
    assert_eq!(status, 403, "a key without finetunes:write: {v}");
    assert_eq!(api.delete(&a.id, &a_plain, &format!("/{id}")).await.0, 403);

    // Each mismatch refused with a 400 that names it; nothing stored.
    let cases: &[(&str, &[&str], &str)] = &[
        ("wrong-arch", &[], "architecture \"gpt2\""),
        ("wrong-shape", &["--layers", "0"], "has GGUF shape"),
        (
            "untransposed",
            &["--layers", "0"],
            "lora_a must be stored transposed",
        ),
        ("rank-too-big", &["--layers", "0"], "ranks of 1 to 64"),
        ("half-pair", &["--layers", "0"], "missing its lora_b"),
        ("not-adapter", &["--layers", "0"], "not a LoRA adapter"),
    ];
    for (kind, extra, says) in cases {
        let f = adapter(dir, kind, extra);
        let (status, v) = api.put_file(&a.id, &a_key, kind, &f).await;
        assert_eq!(status, 400, "{kind}: {v}");
        let m = message(&v);
        assert!(m.contains(says) && m.contains(MODEL_ID), "{kind}: {m}");
    }
    for (body, says) in [
        (b"definitely not GGUF".to_vec(), "not a readable GGUF"),
        (Vec::new(), "not a readable GGUF"),
        (bytes[..bytes.len() / 2].to_vec(), "outside the file"),
    ] {
        let (status, v) = api
            .upload(&a.id, Some(&a_key), &q, body, "application/octet-stream")
            .await;
        assert_eq!(status, 400, "{v}");
        assert!(message(&v).contains(says), "{v}");
    }
    // Oversized, multipart, missing fields, unknown model, bad and reused names.
    let (status, v) = api
        .upload(
            &a.id,
            Some(&a_key),
            &q,
            vec![0u8; CAP + 1],
            "application/octet-stream",
        )
        .await;
    assert_eq!(status, 413, "{v}");
    let (status, v) = api
        .upload(
            &a.id,
            Some(&a_key),
            &q,
            tiny(),
            "multipart/form-data; boundary=x",
        )
        .await;
    assert_eq!(status, 400, "{v}");
    assert!(message(&v).contains("raw request body"), "{v}");
    let model_only = format!("model={}", urlencode(MODEL_ID));
    for (query, param) in [("name=n", "model"), (model_only.as_str(), "name")] {
        let (status, v) = api.upload(&a.id, Some(&a_key), query, tiny(), oct).await;
        assert_eq!(status, 400, "{v}");
        assert!(message(&v).contains(param), "{v}");
    }
    let (status, _) = api
        .upload(
            &a.id,
            Some(&a_key),
            "model=%40cf%2Fnobody%2Fnothing&name=n",
            tiny(),
            oct,
        )
        .await;
    assert_eq!(status, 404);
    let long = "n".repeat(65);
    // Names that shadow a route or an id too; all refused before the file is read.
    let id_shaped = "c9e0451e-65db-5080-e949-ac2a878263f5";
    for name in [".hidden", "a%20b", long.as_str(), "public", id_shaped] {
        let q = format!("model={}&name={name}", urlencode(MODEL_ID));
        let (status, v) = api.upload(&a.id, Some(&a_key), &q, tiny(), oct).await;
        assert_eq!(status, 400, "{name}: {v}");
    }
    let taken = format!("model={}&name=style-v1", urlencode(MODEL_ID));
    let (status, v) = api.upload(&a.id, Some(&a_key), &taken, tiny(), oct).await;
    assert_eq!(status, 409, "{v}");

    // A stalled upload holds its own account's slot only: A's next upload waits
    // (429), B's goes through.
    let mut stalled = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let head = format!(
        "POST /client/v4/accounts/{}/ai/finetunes?model={}&name=slow HTTP/1.1\r\nhost: x\r\n\
         authorization: Bearer {a_key}\r\ncontent-type: application/octet-stream\r\n\
         content-length: 100000\r\n\r\nGGUF",
        a.id,
        urlencode(MODEL_ID)
    );
    tokio::io::AsyncWriteExt::write_all(&mut stalled, head.as_bytes())
        .await
        .unwrap();
    let mut busy = None;
    for _ in 0..200 {
        let q = format!("model={}&name=second", urlencode(MODEL_ID));
        let (status, v) = api.upload(&a.id, Some(&a_key), &q, tiny(), oct).await;
        if status == 429 {
            busy = Some(v);
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    let busy = busy.expect("a second upload of the account while one stalls is no 429");
    assert!(message(&busy).contains("one at a time"), "{busy}");
    let (status, v) = api.put_file(&b.id, &b_key, "while-a-stalls", &random).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(api.delete(&b.id, &b_key, "/while-a-stalls").await.0, 200);
    drop(stalled);
    let (status, v) = api.get(&a.id, &a_key, "").await;
    assert_eq!(
        (status, v["result"].as_array().unwrap().len()),
        (200, 1),
        "refusals stored nothing"
    );

    // B may upload the same file under the same name: its own copy.
    let (status, v) = api.put_file(&b.id, &b_key, "style-v1", &random).await;
    assert_eq!(status, 200, "{v}");
    assert_ne!(v["result"]["id"].as_str(), Some(id.as_str()));

    // Deleted by its owner (by name): gone for good.
    let (status, v) = api.delete(&a.id, &a_key, "/style-v1").await;
    assert_eq!(
        (status, v["result"]["id"].as_str()),
        (200, Some(id.as_str()))
    );
    assert_eq!(api.get(&a.id, &a_key, &format!("/{id}")).await.0, 404);
    assert_eq!(store.finetune_data(&id).await.unwrap(), None);
    assert_eq!(api.delete(&a.id, &a_key, &format!("/{id}")).await.0, 404);

    // Audited, by the key that acted.
    let rows: Vec<_> = store
        .audit_rows(0, i64::MAX, 10_000)
        .await
        .unwrap()
        .into_iter()
        .filter(|r| r.action.starts_with("finetune."))
        .collect();
    let a_rows: Vec<(&str, &str)> = rows
        .iter()
        .filter(|r| r.target == a.id)
        .map(|r| (r.action.as_str(), r.source.as_str()))
        .collect();
    let by = format!("key:{}", key_id_of(&a_key));
    assert_eq!(
        a_rows,
        [
            ("finetune.create", by.as_str()),
            ("finetune.delete", by.as_str())
        ]
    );
    let created = rows.iter().find(|r| r.target == a.id).unwrap();
    assert_eq!(created.detail["sha256"], hex(&Sha256::digest(&bytes)));
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// The `response` of a Workers AI run, or the error message.
async fn run(s: &TestServer, account: &str, key: &str, body: Value) -> (u16, String) {
    let (status, _, v) = s.post(&s.run_url(account), Some(key), &body).await;
    let text = if status == 200 {
        v["result"]["response"].as_str().unwrap().to_string()
    } else {
        message(&v)
    };
    (status, text)
}

/// Requests run under a fine-tune (issue 38 items 2 and 3), on a co-located engine
/// and on disaggregated prefill and decode engines: the adapter changes the answer;
/// `lora` (Workers AI) and `model: "<base>:<fine-tune>"` (OpenAI) give the same one;
/// the base model's answer stays the base's, also for a prompt an adapter request
/// cached first; another tenant naming the fine-tune gets the 404 of an unknown one
/// until it is public, then the owner's answer; a deleted fine-tune is gone at once;
/// a fine-tune of another base, an async batch item and an empty name are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_run_under_their_tenants_fine_tune() {
    for pd in [false, true] {
        let s = if pd {
            start_pd(GatewayOptions::default()).await
        } else {
            start().await
        };
        serve_fine_tunes(&s).await;
    }
}

async fn serve_fine_tunes(s: &TestServer) {
    let api = Api { s };
    let store = s.store();
    let writer = NewKey {
        scopes: Scopes::ALL,
        ..NewKey::named("w")
    };
    let a = store
        .create_tenant("lora-a", Limits::NEW_TENANT)
        .await
        .unwrap();
    let (_, a_key) = store.create_key_with(&a.id, &writer).await.unwrap();
    let b = store
        .create_tenant("lora-b", Limits::NEW_TENANT)
        .await
        .unwrap();
    let (_, b_key) = store.create_key_with(&b.id, &writer).await.unwrap();
    let file = adapter(
        s.dir.path(),
        "random",
        &[
            "--targets",
            "attn_q,attn_v,ffn_up,ffn_down",
            "--scale",
            "0.05",
            "--seed",
            "3",
        ],
    );
    let (status, v) = api.put_file(&a.id, &a_key, "tuned", &file).await;
    assert_eq!(status, 200, "{v}");
    let id = v["result"]["id"].as_str().unwrap().to_string();
    // `GET /v1/models` lists it, as `model` takes it, to its tenant alone.
    let listed = |key: &str| {
        let key = key.to_string();
        async move {
            let (st, _, v) = s.get(&format!("{}/v1/models", s.base), Some(&key)).await;
            assert_eq!(st, 200, "{v}");
            v["data"]
                .as_array()
                .unwrap()
                .iter()
                .map(|m| m["id"].as_str().unwrap().to_string())
                .collect::<Vec<_>>()
        }
    };
    let tuned_id = format!("{MODEL_ID}:tuned");
    assert!(listed(&a_key).await.contains(&tuned_id));
    assert!(!listed(&b_key).await.contains(&tuned_id));
    // `GET /v1/models/{id}` answers what the list gives, by name or id, to its
    // tenant; to another it is an unknown model until an operator publishes it, and
    // then by id alone, without its name or owner.
    let one = |key: &str, asked: String| {
        let key = key.to_string();
        async move {
            let (st, _, v) = s
                .get(&format!("{}/v1/models/{asked}", s.base), Some(&key))
                .await;
            (st, v)
        }
    };
    for asked in [tuned_id.clone(), format!("{MODEL_ID}:{id}")] {
        let (st, v) = one(&a_key, asked).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["id"], tuned_id.as_str());
        assert_eq!(v["finetune"]["id"], id.as_str());
        assert_eq!(v["owned_by"], a.id.as_str());
    }
    let (st, unknown) = one(&b_key, format!("{MODEL_ID}:no-such-name")).await;
    assert_eq!(st, 404, "{unknown}");
    for asked in [tuned_id.clone(), format!("{MODEL_ID}:{id}")] {
        let (st, v) = one(&b_key, asked.clone()).await;
        assert_eq!(st, 404, "{v}");
        assert_eq!(v["error"]["code"], unknown["error"]["code"]);
        assert_eq!(
            v["error"]["message"],
            format!("No such model {asked}").as_str()
        );
    }
    assert_eq!(one(&a_key, "no-such-model:tuned".into()).await.0, 404);
    assert!(store.set_finetune_public(&id, true).await.unwrap());
    let (st, v) = one(&b_key, format!("{MODEL_ID}:{id}")).await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(v["id"], format!("{MODEL_ID}:{id}").as_str());
    assert_eq!(v["owned_by"], "public");
    assert!(v["finetune"]["name"].is_null(), "{v}");
    assert!(!v.to_string().contains(":tuned") && !v.to_string().contains(&a.id));
    assert_eq!(one(&b_key, tuned_id.clone()).await.0, 404);
    assert!(store.set_finetune_public(&id, false).await.unwrap());
    assert_eq!(one(&b_key, format!("{MODEL_ID}:{id}")).await.0, 404);

    let prompt = "Describe the colour of the sky in one sentence. ".repeat(4);
    let body = |lora: Option<&str>| {
        let mut b = serde_json::json!({"prompt": prompt, "max_tokens": 24});
        if let Some(l) = lora {
            b["lora"] = l.into();
        }
        b
    };
    let (status, base) = run(s, &a.id, &a_key, body(None)).await;
    assert_eq!(status, 200, "{base}");
    // The adapter first on this prompt, then the base again: the base's answer
    // (it neither hits the adapter's cached pages nor runs under the adapter).
    let (status, tuned) = run(s, &a.id, &a_key, body(Some("tuned"))).await;
    assert_eq!(status, 200, "{tuned}");
    assert_ne!(tuned, base, "the fine-tune does not change the answer");
    assert_eq!(
        run(s, &a.id, &a_key, body(Some(&id))).await,
        (200, tuned.clone())
    );
    assert_eq!(run(s, &a.id, &a_key, body(None)).await, (200, base.clone()));
    // OpenAI shapes: `model: base:fine-tune`, or the `lora` field.
    let chat = |model: String, lora: Option<&str>| {
        let mut b = serde_json::json!({
            "model": model, "max_tokens": 24,
            "messages": [{"role": "user", "content": prompt}],
        });
        if let Some(l) = lora {
            b["lora"] = l.into();
        }
        b
    };
    let url = format!("{}/v1/chat/completions", s.base);
    let content = |v: &Value| {
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_string()
    };
    let (st, _, plain) = s.post(&url, Some(&a_key), &chat(MODEL.into(), None)).await;
    let (st2, _, named) = s
        .post(&url, Some(&a_key), &chat(format!("{MODEL}:tuned"), None))
        .await;
    let (st3, _, field) = s
        .post(&url, Some(&a_key), &chat(MODEL.into(), Some("tuned")))
        .await;
    assert_eq!((st, st2, st3), (200, 200, 200), "{named} {field}");
    assert_eq!(content(&named), content(&field));
    assert_ne!(content(&named), content(&plain));
    // Answers name the fine-tune as asked, after the base model.
    let tuned_model = format!("{MODEL}:tuned");
    assert_eq!(
        (&plain["model"], &named["model"], &field["model"]),
        (&json!(MODEL), &json!(tuned_model), &json!(tuned_model))
    );
    let (st, _, v) = s
        .post(
            &url,
            Some(&a_key),
            &chat(format!("{MODEL}:tuned"), Some("tuned")),
        )
        .await;
    assert_eq!(st, 400, "{v}");
    for model in [format!("{MODEL}:"), ":tuned".to_string()] {
        let (st, _, v) = s.post(&url, Some(&a_key), &chat(model, None)).await;
        assert_eq!(st, 400, "{v}");
    }

    // Another tenant: by id or name, exactly an unknown fine-tune; public: by id,
    // and the owner's answer.
    for name in [id.as_str(), "tuned", "no-such-fine-tune"] {
        let (status, m) = run(s, &b.id, &b_key, body(Some(name))).await;
        assert_eq!((status, m), (404, format!("no fine-tune {name:?}")));
    }
    assert!(store.set_finetune_public(&id, true).await.unwrap());
    assert_eq!(
        run(s, &b.id, &b_key, body(Some(&id))).await,
        (200, tuned.clone())
    );
    assert_eq!(run(s, &b.id, &b_key, body(Some("tuned"))).await.0, 404);
    assert!(store.set_finetune_public(&id, false).await.unwrap());
    assert_eq!(run(s, &b.id, &b_key, body(Some(&id))).await.0, 404);

    // Refused: an empty name, a batch item, a fine-tune for another base model.
    assert_eq!(run(s, &a.id, &a_key, body(Some(""))).await.0, 400);
    // An async batch: its items run under the fine-tunes they name, each as alone;
    // another tenant's fine-tune in any item refuses the whole batch (404 naming it).
    let batch = format!("{}?queueRequest=true", s.run_url(&a.id));
    let items = serde_json::json!({"requests": [body(Some("tuned")), body(None)]});
    let (status, _, v) = s.post(&batch, Some(&a_key), &items).await;
    assert_eq!(status, 200, "{v}");
    let rid = v["result"]["request_id"].as_str().unwrap().to_string();
    let mut done = None;
    for _ in 0..600 {
        let poll = serde_json::json!({"request_id": rid});
        let (_, _, v) = s.post(&batch, Some(&a_key), &poll).await;
        if v["result"].get("responses").is_some() {
            done = Some(v["result"]["responses"].clone());
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let responses = done.expect("the batch did not finish");
    let text = |i: usize| {
        responses[i]["result"]["response"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert_eq!((text(0), text(1)), (tuned.clone(), base.clone()));
    let b_batch = format!("{}?queueRequest=true", s.run_url(&b.id));
    let items = serde_json::json!({"requests": [body(None), body(Some("tuned"))]});
    let (status, _, v) = s.post(&b_batch, Some(&b_key), &items).await;
    assert_eq!(status, 404, "{v}");
    assert_eq!(
        v["errors"][0]["message"],
        "requests[1].lora: no fine-tune \"tuned\""
    );
    let other = store
        .create_finetune(&tessera_tenancy::NewFinetune {
            tenant_id: &a.id,
            name: "for-another-model",
            base_model: "@cf/someone/else",
            description: "",
            rank: 8,
            alpha: 16.0,
            targets: 1,
            data: b"x",
        })
        .await
        .unwrap();
    let (status, m) = run(s, &a.id, &a_key, body(Some(&other.id))).await;
    assert_eq!(status, 400);
    assert!(m.contains("is for model @cf/someone/else"), "{m}");

    // Metrics count the load, never naming the fine-tune.
    let m = s.metrics_text().await;
    assert!(
        m.contains("tessera_lora_loads_total{outcome=\"loaded\"} 1\n"),
        "{m}"
    );
    assert!(
        m.contains("tessera_lora_loaded 1\n") && m.contains("tessera_lora_evictions_total 0\n")
    );
    let bytes: u64 = m
        .lines()
        .find_map(|l| l.strip_prefix("tessera_lora_loaded_bytes "))
        .and_then(|v| v.parse().ok())
        .unwrap();
    assert!(bytes > std::fs::metadata(&file).unwrap().len(), "{bytes}");
    assert!(!m.contains(&id) && !m.contains("tuned"));

    // Deleted: gone for the next request.
    assert_eq!(api.delete(&a.id, &a_key, "/tuned").await.0, 200);
    assert_eq!(run(s, &a.id, &a_key, body(Some("tuned"))).await.0, 404);
    assert_eq!(run(s, &a.id, &a_key, body(None)).await, (200, base));
}
