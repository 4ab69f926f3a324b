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
    EngineHandle::spawn_disaggregated(model, std::slice::from_ref(&cfg), std::slice::from_ref(&cfg))
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
