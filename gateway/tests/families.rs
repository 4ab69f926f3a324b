//! The model families behind one gateway, as a tenant reaches them: Gemma 3 270M
//! (a base model: no chat template, BOS required) and Qwen2.5-Coder 0.5B (ChatML
//! from its file) beside the default model, each on its own prefill and decode
//! engines with pools of its 32,768-token context window (I2). Answers equal the
//! direct forward pass's greedy tokens; a chat request to the base model is
//! refused with a 400 that names raw prompts; each model is admitted against its
//! own window.

mod common;

use common::*;
use serde_json::json;
use tessera_gateway::{GatewayConfig, ServedModel};
use tessera_model::chat::ChatMessage;
use tessera_model::testing::{greedy_with_logits, load_family, FAMILY_MODEL_FILES};
use tessera_model::LoadedModel;
use tessera_serving::{EngineConfig, EngineHandle};

const GEMMA: &str = "@cf/google/gemma-3-270m";
const QWEN: &str = "@cf/qwen/qwen2.5-coder-0.5b-instruct";

fn pd(model: &LoadedModel) -> EngineHandle {
    let cfg = EngineConfig {
        kv_pool_tokens: model.config().context,
        ..EngineConfig::default()
    };
    EngineHandle::spawn_disaggregated(
        model,
        std::slice::from_ref(&cfg),
        std::slice::from_ref(&cfg),
    )
}

async fn families() -> (TestServer, LoadedModel, LoadedModel) {
    let gemma = load_family(FAMILY_MODEL_FILES[0]);
    let qwen = load_family(FAMILY_MODEL_FILES[1]);
    let served = vec![
        ServedModel::new(GEMMA, gemma.clone(), pd(&gemma)),
        ServedModel::new(QWEN, qwen.clone(), pd(&qwen)),
    ];
    (
        start_models(GatewayConfig::default(), served).await,
        gemma,
        qwen,
    )
}

fn run_url(s: &TestServer, model: &str) -> String {
    format!(
        "{}/client/v4/accounts/{}/ai/run/{model}",
        s.base, s.tenant.id
    )
}

/// The text of greedy tokens, as the gateway streams it.
fn text_of(m: &LoadedModel, ids: &[u32]) -> String {
    m.tokenizer.decode(ids, true)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn each_family_answers_its_direct_greedy_tokens_and_its_own_window() {
    let (s, gemma, qwen) = families().await;
    let windows: Vec<usize> = s
        .state
        .models
        .iter()
        .map(|m| m.engine.limits().context)
        .collect();
    assert_eq!(windows, vec![32768, 32768]);

    // Gemma: a `prompt` runs as raw text with the BOS its tokenizer asks for.
    let prompt = "The capital of France is";
    let ids = gemma.tokenizer.encode_with_bos_eos(prompt, false).unwrap();
    assert_eq!(ids[0], gemma.tokenizer.bos_id().unwrap());
    let (want, _) = greedy_with_logits(&gemma, &ids, 10);
    for body in [
        json!({"prompt": prompt, "max_tokens": 10}),
        json!({"prompt": prompt, "raw": true, "max_tokens": 10}),
    ] {
        let (status, _, v) = s.post(&run_url(&s, GEMMA), Some(&s.key), &body).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["result"]["response"], text_of(&gemma, &want), "{body}");
        assert_eq!(v["result"]["usage"]["prompt_tokens"], ids.len());
    }

    // Echo + logprobs: the BOS the tokenizer added is not in the returned text,
    // so it takes no characters of `text_offset`.
    let body =
        json!({"model": GEMMA, "prompt": "Hello", "max_tokens": 2, "echo": true, "logprobs": 1});
    let (status, _, v) = s
        .post(&format!("{}/v1/completions", s.base), Some(&s.key), &body)
        .await;
    assert_eq!(status, 200, "{v}");
    let lp = &v["choices"][0]["logprobs"];
    let text = v["choices"][0]["text"].as_str().unwrap();
    assert!(text.starts_with("Hello"), "{text:?}");
    let offsets: Vec<usize> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap() as usize)
        .collect();
    assert_eq!(&offsets[..3], &[0, 0, 5], "{lp}");
    for (tok, &at) in lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .zip(&offsets)
        .skip(1)
    {
        let tok = tok.as_str().unwrap();
        assert_eq!(
            &text
                .chars()
                .skip(at)
                .take(tok.chars().count())
                .collect::<String>(),
            tok
        );
    }

    // Qwen: chat through the template in its file.
    let msgs = [ChatMessage::new(
        "user",
        "Write a Python function that adds two numbers.",
    )];
    let ids = qwen.chat.encode(&qwen.tokenizer, &msgs, true).unwrap();
    let (want, _) = greedy_with_logits(&qwen, &ids, 12);
    let body =
        json!({"messages": [{"role": "user", "content": msgs[0].content}], "max_tokens": 12});
    let (status, _, v) = s.post(&run_url(&s, QWEN), Some(&s.key), &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["result"]["response"], text_of(&qwen, &want));
    // The same through the OpenAI shape.
    let body = json!({"model": QWEN, "messages": [{"role": "user", "content": msgs[0].content}], "max_tokens": 12});
    let (status, _, v) = s
        .post(
            &format!("{}/v1/chat/completions", s.base),
            Some(&s.key),
            &body,
        )
        .await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["message"]["content"], text_of(&qwen, &want));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn chat_to_a_base_model_and_prompts_over_its_window_are_refused() {
    let (s, _, _) = families().await;
    // Gemma 3 base has no chat template: `messages` is a clear 400 naming raw prompts.
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4});
    let (status, _, v) = s.post(&run_url(&s, GEMMA), Some(&s.key), &body).await;
    assert_eq!(status, 400, "{v}");
    let text = v.to_string();
    assert!(
        text.contains("no chat template") && text.contains("raw prompt"),
        "{text}"
    );
    let (status, _, v) = s
        .post(
            &format!("{}/v1/chat/completions", s.base),
            Some(&s.key),
            &json!({"model": GEMMA, "messages": [{"role": "user", "content": "hi"}]}),
        )
        .await;
    assert_eq!(status, 400, "{v}");

    // I2 per model: about 40,000 tokens is over either 32,768-token window.
    let long = "ocean ".repeat(40_000);
    for model in [GEMMA, QWEN] {
        let body = json!({"prompt": long, "raw": true, "max_tokens": 4});
        let (status, _, v) = s.post(&run_url(&s, model), Some(&s.key), &body).await;
        assert_eq!(status, 400, "{model}: {v}");
        assert!(v.to_string().contains("32768"), "{model}: {v}");
    }
    // Nothing was reserved by the refusals: a small request still runs.
    let body = json!({"prompt": "def add(a, b):", "raw": true, "max_tokens": 4});
    let (status, _, v) = s.post(&run_url(&s, QWEN), Some(&s.key), &body).await;
    assert_eq!(status, 200, "{v}");
}
