//! Many models behind one gateway, in one process: the default model and a small
//! random-weight llama of another shape (vocabulary, layers, width, context), each
//! served by its own prefill and decode engines. Requests are routed by model id
//! (Workers AI path, OpenAI `model` field); every answer equals that model's solo
//! answer when the models' requests interleave; each model is admitted against its
//! own context window; the usage rows carry the model that served them.

mod common;

use common::*;
use serde_json::{json, Value};
use tessera_gateway::{GatewayOptions, ServedModel};
use tessera_model::gguf_write::{write_random_llama, RandomLlama};
use tessera_model::LoadedModel;
use tessera_serving::{EngineConfig, EngineHandle};

/// The second model's catalog id.
const TINY: &str = "@cf/tessera/random-llama-tiny";

fn pd(model: &LoadedModel, tokens: usize) -> EngineHandle {
    let cfg = EngineConfig {
        kv_pool_tokens: tokens,
        ..EngineConfig::default()
    };
    EngineHandle::spawn_disaggregated(
        model,
        std::slice::from_ref(&cfg),
        std::slice::from_ref(&cfg),
    )
}

/// A gateway serving the default model and the random one (written into `dir`).
async fn two_models(dir: &std::path::Path) -> TestServer {
    let path = dir.join("tiny.gguf");
    write_random_llama(&model_path(), &path, &RandomLlama::SMALL).unwrap();
    let tiny = LoadedModel::load(&path).unwrap();
    let base = LoadedModel::load(&model_path()).unwrap();
    let served = vec![
        ServedModel::new(MODEL, base.clone(), pd(&base, 8192)),
        ServedModel::new(TINY, tiny.clone(), pd(&tiny, 4096)),
    ];
    start_models(GatewayOptions::default(), served).await
}

fn run_url(s: &TestServer, model: &str) -> String {
    format!(
        "{}/client/v4/accounts/{}/ai/run/{model}",
        s.base, s.tenant.id
    )
}

const PROMPTS: [&str; 3] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
];

/// (status, answer text, usage) of one Workers AI request.
async fn ask(s: &TestServer, model: &str, prompt: &str) -> (u16, String, Value) {
    let body = json!({"prompt": prompt, "max_tokens": 12});
    let (status, _, v) = s.post(&run_url(s, model), Some(&s.key), &body).await;
    let text = v["result"]["response"]
        .as_str()
        .unwrap_or_default()
        .to_string();
    (status, text, v["result"]["usage"].clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_models_of_different_shapes_answer_their_solo_answers_interleaved() {
    let dir = tempfile::tempdir().unwrap();
    let s = two_models(dir.path()).await;
    // Each model's limits are its own.
    let limits: Vec<usize> = s
        .state
        .models
        .iter()
        .map(|m| m.engine.limits().context)
        .collect();
    assert_eq!(limits, vec![8192, 4096]);

    // Solo: one request at a time.
    let mut solo = Vec::new();
    for model in [MODEL, TINY] {
        for p in PROMPTS {
            let (status, text, _) = ask(&s, model, p).await;
            assert_eq!(status, 200, "{model} {p}");
            assert!(!text.is_empty(), "{model} {p}");
            solo.push(((model, p), text));
        }
    }
    // The random model is another model: its answers are not the default's.
    for p in PROMPTS {
        let of = |m: &str| {
            solo.iter()
                .find(|((mm, pp), _)| *mm == m && *pp == p)
                .unwrap()
        };
        assert_ne!(of(MODEL).1, of(TINY).1, "{p}");
    }
    // Interleaved: every request of both models at once, twice over.
    let jobs: Vec<_> = solo
        .iter()
        .chain(solo.iter())
        .map(|((m, p), want)| {
            let s = &s;
            async move { (m, p, want, ask(s, m, p).await) }
        })
        .collect();
    for (m, p, want, (status, got, _)) in futures_util::future::join_all(jobs).await {
        assert_eq!(status, 200, "{m} {p}");
        assert_eq!(&got, want, "{m} {p}: interleaved differs from solo");
    }

    // OpenAI shape: the `model` field routes; the same conversation gives the same
    // answer as the Workers AI prompt.
    let body = json!({"model": TINY, "max_tokens": 12,
        "messages": [{"role": "user", "content": PROMPTS[0]}]});
    let (status, _, v) = s
        .post(
            &format!("{}/v1/chat/completions", s.base),
            Some(&s.key),
            &body,
        )
        .await;
    assert_eq!(status, 200, "{v}");
    let want = &solo
        .iter()
        .find(|((m, p), _)| *m == TINY && *p == PROMPTS[0])
        .unwrap()
        .1;
    assert_eq!(v["choices"][0]["message"]["content"], json!(want));
    assert_eq!(v["model"], TINY);

    // Admission is per model: 4,000 output tokens fit the default model's window
    // but not the random model's (4,096), which refuses before any engine sees it.
    let long = json!({"prompt": "Hi", "max_tokens": 4090});
    let (status, _, v) = s.post(&run_url(&s, TINY), Some(&s.key), &long).await;
    assert_eq!(status, 400, "{v}");
    let msg = v["errors"][0]["message"].as_str().unwrap();
    assert!(msg.contains("4096"), "{msg}");
    // An unknown model is a 404 with Workers AI code 5007.
    let (status, _, v) = s
        .post(&run_url(&s, "@cf/nobody/nothing"), Some(&s.key), &long)
        .await;
    assert_eq!((status, v["errors"][0]["code"].clone()), (404, json!(5007)));

    // Every usage row names the model that served it.
    s.settle().await;
    let rows = s.store().usage_rows(None).await.unwrap();
    let served = |m: &str| {
        rows.iter()
            .filter(|r| r.model == m && r.status == 200)
            .count()
    };
    assert_eq!((served(MODEL), served(TINY)), (9, 10));
}

/// The catalog: GGUF metadata joined with the operator's (description, tags,
/// aliases, deprecation and sunset dates); an alias resolves; a deprecated model's
/// answers carry `Deprecation` and `Sunset`; a model past its sunset is a 404 with
/// Workers AI code 5007 and is not listed; `models/search` filters and pages.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_catalog_lists_metadata_resolves_aliases_and_retires_models() {
    use tessera_gateway::catalog::{CatalogEntry, Dated};
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_random_llama(&model_path(), &path, &RandomLlama::SMALL).unwrap();
    let tiny = LoadedModel::load(&path).unwrap();
    let base = LoadedModel::load(&model_path()).unwrap();
    let date = |d: &str, unix: i64| {
        Some(Dated {
            date: d.into(),
            unix,
        })
    };
    let mut a = CatalogEntry::new(MODEL, 8192).with_file(&base.info);
    a.description = "small chat model".into();
    a.tags = vec!["chat".into(), "small".into()];
    a.aliases = vec!["smollm2".into()];
    let mut b = CatalogEntry::new(TINY, 4096).with_file(&tiny.info);
    (b.deprecated, b.sunset) = (
        date("2020-01-01", 1_577_836_800),
        date("2999-12-31", 32_503_593_600),
    );
    let retired = "@cf/tessera/retired";
    let mut c = CatalogEntry::new(retired, 4096).with_file(&tiny.info);
    (c.deprecated, c.sunset) = (
        date("2020-01-01", 1_577_836_800),
        date("2020-06-01", 1_590_969_600),
    );
    let small = EngineConfig {
        kv_pool_tokens: 4096,
        ..EngineConfig::default()
    };
    let served = vec![
        ServedModel::with_entry(a, base.clone(), pd(&base, 8192)),
        ServedModel::with_entry(b, tiny.clone(), pd(&tiny, 4096)),
        ServedModel::with_entry(c, tiny.clone(), EngineHandle::spawn(&tiny, small)),
    ];
    let s = start_models(GatewayOptions::default(), served).await;

    // The OpenAI list: every model not past its sunset, with its metadata.
    let (status, _, v) = s.get(&format!("{}/v1/models", s.base), Some(&s.key)).await;
    assert_eq!(status, 200, "{v}");
    let data = v["data"].as_array().unwrap();
    let ids: Vec<&str> = data.iter().map(|m| m["id"].as_str().unwrap()).collect();
    assert_eq!(ids, vec![MODEL, TINY]);
    assert_eq!(
        (
            &data[0]["context_window"],
            &data[0]["quantization"],
            &data[0]["chat_template"]
        ),
        (&json!(8192), &json!("Q4_1"), &json!(true))
    );
    assert_eq!(data[0]["parameters"], json!(base.info.parameters));
    assert_eq!(data[0]["tags"], json!(["chat", "small"]));
    assert_eq!(data[0]["aliases"], json!(["smollm2"]));
    assert_eq!(
        (&data[0]["owned_by"], &data[0]["description"]),
        (&json!("huggingfacetb"), &json!("small chat model"))
    );
    assert_eq!(
        (
            &data[1]["parameters"],
            &data[1]["context_window"],
            &data[1]["quantization"]
        ),
        (&json!(1_049_728), &json!(4096), &json!("Q8_0"))
    );
    assert_eq!(
        (&data[1]["deprecated"], &data[1]["sunset"]),
        (&json!("2020-01-01"), &json!("2999-12-31"))
    );

    // One model: an alias resolves to its model; a deprecated one carries the
    // headers; a removed one is a 404.
    let one = |id: &str| format!("{}/v1/models/{id}", s.base);
    let (status, _, v) = s.get(&one("SMOLLM2"), Some(&s.key)).await;
    assert_eq!((status, v["id"].as_str()), (200, Some(MODEL)));
    let r = s
        .client
        .get(one(TINY))
        .bearer_auth(&s.key)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["deprecation"], "@1577836800");
    assert_eq!(r.headers()["sunset"], "Tue, 31 Dec 2999 00:00:00 GMT");
    let (status, _, v) = s.get(&one(retired), Some(&s.key)).await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("model_not_found")),
        "{v}"
    );
    let (status, _, _) = s.get(&one(MODEL), None).await;
    assert_eq!(status, 401, "the catalog needs a key");

    // Generation: by alias (the answer and the usage row name the model), a
    // deprecated model's answer carries the headers, a removed one is 404 / 5007.
    let body = json!({"prompt": PROMPTS[0], "max_tokens": 6});
    let (status, rid, _) = s.post(&run_url(&s, "smollm2"), Some(&s.key), &body).await;
    assert_eq!(status, 200);
    assert_eq!(s.row(&rid).await.model, MODEL);
    let r = s
        .client
        .post(run_url(&s, TINY))
        .bearer_auth(&s.key)
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers()["deprecation"], "@1577836800");
    let (status, _, v) = s.post(&run_url(&s, retired), Some(&s.key), &body).await;
    assert_eq!(
        (status, &v["errors"][0]["code"]),
        (404, &json!(5007)),
        "{v}"
    );
    let msg = v["errors"][0]["message"].as_str().unwrap();
    assert!(msg.contains("removed on 2020-06-01"), "{msg}");

    // Workers AI search: filters and pages.
    let search = |q: &str| format!("{}?{q}", s.account_url("models/search"));
    let names = |v: &Value| -> Vec<String> {
        v["result"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| m["name"].as_str().unwrap().to_string())
            .collect()
    };
    for (q, want) in [
        ("task=text-generation", vec![MODEL, TINY]),
        ("task=Text%20Generation&author=tessera", vec![TINY]),
        ("author=huggingfacetb", vec![MODEL]),
        ("search=chat", vec![MODEL]),
        ("search=SMOLLM2", vec![MODEL]),
        ("search=retired", vec![]),
        ("task=summarization", vec![]),
        ("per_page=1&page=2", vec![TINY]),
    ] {
        let (status, _, v) = s.get(&search(q), Some(&s.key)).await;
        assert_eq!(status, 200, "{q}: {v}");
        assert_eq!(names(&v), want, "{q}");
    }
    let (_, _, v) = s.get(&search("per_page=1&page=2"), Some(&s.key)).await;
    assert_eq!(
        v["result_info"],
        json!({"page": 2, "per_page": 1, "count": 1, "total_count": 2})
    );
    let (_, _, v) = s.get(&search("author=tessera"), Some(&s.key)).await;
    let props = &v["result"][0]["properties"];
    assert_eq!(
        props[0],
        json!({"property_id": "context_window", "value": "4096"})
    );
    for (q, field) in [
        ("page=0", "page"),
        ("per_page=101", "per_page"),
        ("per_page=x", "per_page"),
    ] {
        let (status, _, v) = s.get(&search(q), Some(&s.key)).await;
        assert_eq!(status, 400, "{q}: {v}");
        let msg = v["errors"][0]["message"].as_str().unwrap();
        assert!(msg.starts_with(&format!("`{field}` must be")), "{q}: {msg}");
    }
}

/// `(status, Workers AI error code or 0, message)` of a run by `key` on `account`.
async fn run_as(
    s: &TestServer,
    account: &str,
    key: &str,
    model: &str,
    body: &Value,
) -> (u16, Value, Value) {
    let url = format!("{}/client/v4/accounts/{account}/ai/run/{model}", s.base);
    let (status, _, v) = s.post(&url, Some(key), body).await;
    (status, v["errors"][0]["code"].clone(), v)
}

/// Per-tenant model access: a private model serves only the accounts it lists
/// (others get 403 / 5018 and do not see it listed); set through the admin API with
/// an audit row and field-naming 400s; usage rows and the usage API's per-model
/// totals are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_private_model_serves_only_its_tenants_and_usage_is_per_model() {
    let dir = tempfile::tempdir().unwrap();
    let s = two_models(dir.path()).await;
    let alpha = (s.tenant.id.clone(), s.key.clone());
    let (beta_t, beta_key) = s
        .tenant_with_key("beta", tessera_tenancy::Limits::default())
        .await;
    let beta = (beta_t.id.clone(), beta_key);
    let s = &s;
    let access = |body: Value| async move {
        let r = s
            .admin(
                reqwest::Method::PUT,
                &format!("/admin/v1/model-access/{TINY}"),
            )
            .json(&body)
            .send()
            .await
            .unwrap();
        split(r).await
    };
    // Field-naming refusals; nothing changes.
    for (body, field) in [
        (json!({"visibility": "secret"}), "visibility"),
        (json!({"tenants": [alpha.0]}), "visibility"),
        (json!({"visibility": "private", "tenants": [1]}), "tenants"),
        (json!({"visibility": "private", "tenants": "x"}), "tenants"),
        (
            json!({"visibility": "public", "tenants": [alpha.0]}),
            "tenants",
        ),
        (
            json!({"visibility": "private", "tenants": ["no-such-tenant"]}),
            "tenants",
        ),
        (
            json!({"visibility": "private", "tenant": [alpha.0]}),
            "tenant",
        ),
    ] {
        let (status, _, v) = access(body.clone()).await;
        assert_eq!(status, 400, "{body}: {v}");
        let msg = v["errors"][0]["message"].as_str().unwrap();
        assert!(msg.contains(&format!("`{field}`")), "{body}: {msg}");
    }
    let r = s
        .admin(
            reqwest::Method::PUT,
            "/admin/v1/model-access/@cf/nobody/nothing",
        )
        .json(&json!({"visibility": "public"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    // Private to alpha.
    let (status, rid, v) = access(json!({"visibility": "private", "tenants": [alpha.0]})).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["result"],
        json!({"model": TINY, "private": true, "tenants": [alpha.0]})
    );
    let (_, _, audit) = s.admin_get("/admin/v1/audit").await;
    let row = audit["result"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["action"] == "model.access")
        .unwrap()
        .clone();
    assert_eq!(
        (row["target"].as_str(), row["request_id"].as_str()),
        (Some(TINY), Some(rid.as_str()))
    );
    let (_, _, models) = s.admin_get("/admin/v1/models").await;
    assert_eq!(models["result"][1]["access"]["private"], true, "{models}");

    // Beta: refused (403, 5018, naming the model), in both API shapes, and the
    // model is not listed; the public model still serves it.
    let body = json!({"prompt": PROMPTS[0], "max_tokens": 8});
    let (status, code, v) = run_as(s, &beta.0, &beta.1, TINY, &body).await;
    assert_eq!((status, code), (403, json!(5018)), "{v}");
    assert!(v["errors"][0]["message"].as_str().unwrap().contains(TINY));
    let chat =
        json!({"model": TINY, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]});
    let (status, _, v) = s
        .post(
            &format!("{}/v1/chat/completions", s.base),
            Some(&beta.1),
            &chat,
        )
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (403, Some("model_not_permitted")),
        "{v}"
    );
    let (_, _, v) = s.get(&format!("{}/v1/models", s.base), Some(&beta.1)).await;
    let ids: Vec<&str> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, vec![MODEL]);
    let (status, _, _) = s
        .get(&format!("{}/v1/models/{TINY}", s.base), Some(&beta.1))
        .await;
    assert_eq!(status, 403);

    // Per-model usage, exact: alpha's answers' usage summed by model equals the
    // usage API's groups; beta's refusal is one error row of 0 tokens.
    let mut want: std::collections::BTreeMap<&str, (i64, i64, i64)> = Default::default();
    for (i, model) in [MODEL, TINY, TINY, MODEL, TINY].into_iter().enumerate() {
        let b = json!({"prompt": PROMPTS[i % 3], "max_tokens": 5 + i});
        let (status, _, v) = run_as(s, &alpha.0, &alpha.1, model, &b).await;
        assert_eq!(status, 200, "{model}: {v}");
        let u = &v["result"]["usage"];
        let w = want.entry(model).or_default();
        w.0 += 1;
        w.1 += u["prompt_tokens"].as_i64().unwrap();
        w.2 += u["completion_tokens"].as_i64().unwrap();
    }
    s.settle().await;
    let (status, _, v) = s
        .get(&s.account_url("usage?group_by=model"), Some(&alpha.1))
        .await;
    assert_eq!(status, 200, "{v}");
    let got: std::collections::BTreeMap<&str, (i64, i64, i64)> = v["result"]["groups"]
        .as_array()
        .unwrap()
        .iter()
        .map(|g| {
            (
                g["key"].as_str().unwrap(),
                (
                    g["requests"].as_i64().unwrap(),
                    g["input_tokens"].as_i64().unwrap(),
                    g["output_tokens"].as_i64().unwrap(),
                ),
            )
        })
        .collect();
    assert_eq!(got, want);
    let rows = s.store().usage_rows(Some(&beta.0)).await.unwrap();
    let refused: Vec<_> = rows.iter().filter(|r| r.model == TINY).collect();
    assert_eq!(refused.len(), 2, "{rows:?}");
    assert!(refused
        .iter()
        .all(|r| r.status == 403 && r.error_code == 5018 && r.input_tokens + r.output_tokens == 0));

    // Public again: beta is served.
    let (status, _, _) = access(json!({"visibility": "public"})).await;
    assert_eq!(status, 200);
    let (status, _, v) = run_as(s, &beta.0, &beta.1, TINY, &body).await;
    assert_eq!(status, 200, "{v}");
}

/// With `private_models_as_404`, a private model a tenant may not use answers
/// exactly as an unknown model does (404, 5007, `No such model <id asked for>`), so
/// private ids cannot be probed; its tenants are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn private_models_can_answer_as_unknown_ones() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny.gguf");
    write_random_llama(&model_path(), &path, &RandomLlama::SMALL).unwrap();
    let tiny = LoadedModel::load(&path).unwrap();
    let cfg = GatewayOptions {
        private_models_as_404: true,
        ..GatewayOptions::default()
    };
    let s = start_models(
        cfg,
        vec![ServedModel::new(TINY, tiny.clone(), pd(&tiny, 4096))],
    )
    .await;
    let (other_t, other_key) = s
        .tenant_with_key("other", tessera_tenancy::Limits::default())
        .await;
    s.store()
        .set_model_access(TINY, true, std::slice::from_ref(&s.tenant.id))
        .await
        .unwrap();
    let body = json!({"prompt": "Hi", "max_tokens": 4});
    let unknown = "@cf/tessera/random-llama-tinz";
    let (s1, c1, v1) = run_as(&s, &other_t.id, &other_key, TINY, &body).await;
    let (s2, c2, v2) = run_as(&s, &other_t.id, &other_key, unknown, &body).await;
    assert_eq!((s1, &c1), (404, &json!(5007)), "{v1}");
    assert_eq!((s2, &c2), (404, &json!(5007)), "{v2}");
    let m1 = v1["errors"][0]["message"]
        .as_str()
        .unwrap()
        .replace(TINY, "ID");
    let m2 = v2["errors"][0]["message"]
        .as_str()
        .unwrap()
        .replace(unknown, "ID");
    assert_eq!(m1, m2);
    let (status, _, v) = s
        .get(&format!("{}/v1/models/{TINY}", s.base), Some(&other_key))
        .await;
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("model_not_found"))
    );
    let (status, _, _) = run_as(&s, &s.tenant.id, &s.key, TINY, &body).await;
    assert_eq!(status, 200);
}
