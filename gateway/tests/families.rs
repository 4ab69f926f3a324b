//! The model families behind one gateway, as a tenant reaches them: Gemma 3 270M
//! (a base model: no chat template, BOS required) and Qwen2.5-Coder 0.5B (ChatML
//! from its file) beside the default model, each on its own prefill and decode
//! engines with pools of its 32,768-token context window (I2). Answers equal the
//! direct forward pass's greedy tokens; a chat request to the base model is
//! refused with a 400 that names raw prompts (and `messages`), tools to it with one
//! naming `tools`; each model is admitted against its own window. The catalog names
//! each file's quantization as llama.cpp does and describes it from its metadata.
//! Qwen's template shows `tools` itself, and its native `<tool_call>` answers come
//! back as OpenAI `tool_calls`, streamed and not.

mod common;

use common::*;
use serde_json::json;
use tessera_gateway::{GatewayOptions, ServedModel};
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
        start_models(GatewayOptions::default(), served).await,
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
    // The OpenAI error names the field at fault (it was `null`).
    assert_eq!(v["error"]["param"], "messages", "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("raw prompt"),
        "{v}"
    );

    // Tools cannot be shown to a model without a chat template: a 400 naming
    // `tools` (a Workers AI `prompt` with tools ran as raw text, tools dropped).
    let tools = json!([weather_tool()]);
    let chat = format!("{}/v1/chat/completions", s.base);
    let body =
        json!({"model": GEMMA, "messages": [{"role": "user", "content": "hi"}], "tools": tools});
    let (status, _, v) = s.post(&chat, Some(&s.key), &body).await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("tools")),
        "{v}"
    );
    let body = json!({"prompt": "Weather in Paris?", "tools": tools, "max_tokens": 4});
    let (status, _, v) = s.post(&run_url(&s, GEMMA), Some(&s.key), &body).await;
    assert_eq!(status, 400, "{v}");
    assert!(
        v["errors"][0]["message"]
            .as_str()
            .unwrap()
            .contains("`tools`"),
        "{v}"
    );
    // Completions have no `tools` in OpenAI's API: an unknown field, ignored as any.
    let body = json!({"model": GEMMA, "prompt": "Hello", "tools": tools, "max_tokens": 2});
    let (status, _, v) = s
        .post(&format!("{}/v1/completions", s.base), Some(&s.key), &body)
        .await;
    assert_eq!(status, 200, "{v}");
    // OpenAI's bounds on log probabilities: 5 alternatives on completions.
    let body = json!({"model": GEMMA, "prompt": "Hello", "logprobs": 6, "max_tokens": 2});
    let (status, _, v) = s
        .post(&format!("{}/v1/completions", s.base), Some(&s.key), &body)
        .await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (400, &json!("logprobs")),
        "{v}"
    );
    // An unknown model names `model`; ids match in any case.
    let body = json!({"model": "@cf/google/gemma-3-27b", "prompt": "Hello", "max_tokens": 2});
    let (status, _, v) = s
        .post(&format!("{}/v1/completions", s.base), Some(&s.key), &body)
        .await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (404, &json!("model")),
        "{v}"
    );
    let body = json!({"model": GEMMA.to_uppercase(), "prompt": "Hello", "max_tokens": 2});
    let (status, _, v) = s
        .post(&format!("{}/v1/completions", s.base), Some(&s.key), &body)
        .await;
    assert_eq!((status, &v["model"]), (200, &json!(GEMMA)), "{v}");

    // I2 per model: about 40,000 tokens is over either 32,768-token window.
    let long = "ocean ".repeat(40_000);
    for model in [GEMMA, QWEN] {
        let body = json!({"prompt": long, "raw": true, "max_tokens": 4});
        let (status, _, v) = s.post(&run_url(&s, model), Some(&s.key), &body).await;
        assert_eq!(status, 400, "{model}: {v}");
        assert!(v.to_string().contains("32768"), "{model}: {v}");
    }
    // OpenAI's context refusal names the input, as OpenAI's does.
    let body =
        json!({"model": QWEN, "messages": [{"role": "user", "content": long}], "max_tokens": 4});
    let (status, _, v) = s.post(&chat, Some(&s.key), &body).await;
    assert_eq!(
        (status, &v["error"]["code"], &v["error"]["param"]),
        (400, &json!("context_length_exceeded"), &json!("messages")),
        "{v}"
    );
    // Nothing was reserved by the refusals: a small request still runs.
    let body = json!({"prompt": "def add(a, b):", "raw": true, "max_tokens": 4});
    let (status, _, v) = s.post(&run_url(&s, QWEN), Some(&s.key), &body).await;
    assert_eq!(status, 200, "{v}");
}

fn weather_tool() -> serde_json::Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the current weather in a given city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city name"}},
            "required": ["city"]
        }
    }})
}

/// A review of the families as a client found `/v1/models` giving the dominant
/// tensor type (Gemma's file as `Q8_0`, Qwen's as `Q5_0`) and bare descriptions: the
/// quantization is the file's `general.file_type` (15, `Q4_K_M`) and the
/// description is built from its metadata.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_catalog_names_each_files_quantization_and_describes_it() {
    let (s, gemma, qwen) = families().await;
    let (status, _, v) = s.get(&format!("{}/v1/models", s.base), Some(&s.key)).await;
    assert_eq!(status, 200, "{v}");
    let data = v["data"].as_array().unwrap();
    for (m, id, description) in [
        (
            &gemma,
            GEMMA,
            "Gemma 3 270m: gemma3, 268M parameters, 32,768-token context window, GGUF Q4_K_M",
        ),
        (
            &qwen,
            QWEN,
            "Qwen2.5 Coder 0.5B Instruct AWQ: qwen2, 630M parameters, 32,768-token context \
             window, GGUF Q4_K_M",
        ),
    ] {
        let o = data.iter().find(|o| o["id"] == id).unwrap();
        assert_eq!(o["quantization"], "Q4_K_M", "{o}");
        assert_eq!(o["description"], description, "{o}");
        assert_eq!(o["parameters"], m.info.parameters);
    }
    // Workers AI's search shows the same in `properties`.
    let url = format!(
        "{}/client/v4/accounts/{}/ai/models/search?search=qwen",
        s.base, s.tenant.id
    );
    let (status, _, v) = s.get(&url, Some(&s.key)).await;
    assert_eq!(status, 200, "{v}");
    let props = v["result"][0]["properties"].as_array().unwrap();
    let q = props
        .iter()
        .find(|p| p["property_id"] == "quantization")
        .unwrap();
    assert_eq!(q["value"], "Q4_K_M", "{v}");
}

/// Qwen2.5's chat template renders `tools` itself (the `<tools>` block of its
/// ChatML system turn): the gateway gives them to it, rather than its fallback
/// system message, so the prompt is the one `transformers` and llama.cpp build
/// from the file. Greedy, the 0.5B coder answers the question with the call's JSON
/// but without the `<tool_call>` tags its template asks for (no prompt tried made
/// it write them; its tagged format, as its tokens arrive, is checked in the
/// gateway's `openai.rs` and `tools.rs` unit tests); either way the call comes back
/// as OpenAI `tool_calls` with `finish_reason: "tool_calls"`, streamed and not,
/// and as Workers AI `tool_calls`; the call and its answer round-trip as history,
/// in the tags.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn qwen_sees_tools_in_its_own_template_and_its_calls_come_back_as_tool_calls() {
    let (s, _, qwen) = families().await;
    let tools = json!([weather_tool()]);
    let question = "What is the weather like in Paris today?";
    let msgs = [ChatMessage::new("user", question)];
    let text = qwen
        .chat
        .render_with_tools(&msgs, Some(&tools), true)
        .unwrap();
    assert!(
        text.contains(
            "<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
        ),
        "{text}"
    );
    let ids = qwen
        .chat
        .encode_with_tools(&qwen.tokenizer, &msgs, Some(&tools), true, usize::MAX)
        .unwrap();
    // Greedy, the model calls the function (its text up to the end of its turn).
    let (mut want, _) = greedy_with_logits(&qwen, &ids, 40);
    let eos = qwen.tokenizer.eos_id().unwrap();
    want.truncate(want.iter().position(|&t| t == eos).expect("the turn ends"));
    let json_call = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}";
    assert_eq!(text_of(&qwen, &want), json_call);
    let call = format!("<tool_call>\n{json_call}\n</tool_call>");

    let chat = format!("{}/v1/chat/completions", s.base);
    let body = json!({"model": QWEN, "messages": [{"role": "user", "content": question}],
                      "tools": tools, "max_tokens": 40});
    let (status, _, v) = s.post(&chat, Some(&s.key), &body).await;
    assert_eq!(status, 200, "{v}");
    // The prompt was the template's own rendering of the tools.
    assert_eq!(v["usage"]["prompt_tokens"], ids.len(), "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    assert!(c["message"]["content"].is_null(), "{v}");
    let got = &c["message"]["tool_calls"][0];
    assert_eq!(
        (&got["type"], &got["function"]["name"]),
        (&json!("function"), &json!("get_weather"))
    );
    let args: serde_json::Value =
        serde_json::from_str(got["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_eq!(args, json!({"city": "Paris"}));

    // Streamed: no text, one `tool_calls` delta, then the finish reason.
    let mut stream = body.clone();
    stream["stream"] = json!(true);
    let chunks = s.post_stream(&chat, &stream).await;
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "", "{chunks:?}");
    let deltas: Vec<&serde_json::Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(deltas.len(), 1, "{chunks:?}");
    assert_eq!(
        (&deltas[0][0]["index"], &deltas[0][0]["function"]["name"]),
        (&json!(0), &json!("get_weather"))
    );
    assert_eq!(
        deltas[0][0]["function"]["arguments"],
        got["function"]["arguments"]
    );
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );

    // Workers AI: the function object itself; object arguments back.
    let body = json!({"messages": [{"role": "user", "content": question}],
                      "tools": [weather_tool()["function"]], "max_tokens": 40});
    let (status, _, v) = s.post(&run_url(&s, QWEN), Some(&s.key), &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["result"]["tool_calls"],
        json!([{"name": "get_weather", "arguments": {"city": "Paris"}}]),
        "{v}"
    );

    // The call and its answer as history: rendered as the template renders them
    // (the call as the model wrote it, the answer in `<tool_response>` tags of a
    // user turn), so the prompt is exactly the template's.
    let history = json!([
        {"role": "user", "content": question},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"}
    ]);
    let turns = [
        ChatMessage::new("user", question),
        ChatMessage::new("assistant", call.as_str()),
        ChatMessage::new("tool", "18 degrees and sunny"),
    ];
    let want = qwen
        .chat
        .encode_with_tools(&qwen.tokenizer, &turns, Some(&tools), true, usize::MAX)
        .unwrap();
    let body = json!({"model": QWEN, "messages": history, "tools": tools, "max_tokens": 16});
    let (status, _, v) = s.post(&chat, Some(&s.key), &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], want.len(), "{v}");
}
