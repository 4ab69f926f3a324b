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
use serde_json::Value;
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
        let mut r = self
            .s
            .client
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
    for name in [".hidden", "a%20b", long.as_str()] {
        let (status, v) = api.put_file(&a.id, &a_key, name, &random).await;
        assert_eq!(status, 400, "{name}: {v}");
    }
    let (status, v) = api.put_file(&a.id, &a_key, "style-v1", &random).await;
    assert_eq!(status, 409, "{v}");
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
