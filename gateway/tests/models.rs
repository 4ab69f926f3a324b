//! Many models behind one gateway, in one process: the default model and a small
//! random-weight llama of another shape (vocabulary, layers, width, context), each
//! served by its own prefill and decode engines. Requests are routed by model id
//! (Workers AI path, OpenAI `model` field); every answer equals that model's solo
//! answer when the models' requests interleave; each model is admitted against its
//! own context window; the usage rows carry the model that served them.

mod common;

use common::*;
use serde_json::{json, Value};
use tessera_gateway::{GatewayConfig, ServedModel};
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
    start_models(GatewayConfig::default(), served).await
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
    let s = start_models(GatewayConfig::default(), served).await;

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
