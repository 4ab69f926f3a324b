//! Tool calls over HTTP (issue 14): OpenAI `tools` / `tool_choice` and Workers AI
//! `tools`, with the real model. `required` and a named function are grammar-enforced
//! (every call parses and its arguments validate against the function's schema),
//! streamed and not, through the in-process prefill -> decode hop; a conversation
//! with an assistant call and a `tool` answer round-trips; malformed lists are 400s
//! naming the field.

mod common;

use common::*;
use serde_json::{json, Value};

fn weather() -> Value {
    json!({"type": "function", "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]}
            },
            "required": ["city", "unit"],
            "additionalProperties": false
        }
    }})
}

fn add() -> Value {
    json!({"type": "function", "function": {
        "name": "add",
        "description": "Adds two integers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": false
        }
    }})
}

/// Checks `args` against the named tool's parameter schema.
fn assert_args(tools: &[Value], name: &str, args: &Value) {
    let tool = tools
        .iter()
        .find(|t| t["function"]["name"] == name)
        .unwrap_or_else(|| panic!("called {name}, which is not listed"));
    let v = jsonschema::validator_for(&tool["function"]["parameters"]).unwrap();
    let errors: Vec<String> = v.iter_errors(args).map(|e| e.to_string()).collect();
    assert!(
        errors.is_empty(),
        "{name}({args}) fails its schema: {errors:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn required_and_named_calls_parse_and_validate_in_both_shapes() {
    let s = start_pd(Default::default()).await;
    let chat = format!("{}/v1/chat/completions", s.base);
    let tools = [weather(), add()];
    let msgs = json!([{"role": "user", "content": "What is the weather in Paris?"}]);
    for (choice, temperature) in [
        (json!("required"), 0.0),
        (json!("required"), 0.9),
        (
            json!({"type": "function", "function": {"name": "add"}}),
            0.0,
        ),
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            0.9,
        ),
    ] {
        let body = json!({"model": MODEL, "messages": msgs, "tools": tools, "tool_choice": choice,
                          "max_tokens": 80, "temperature": temperature, "seed": 5});
        let (st, rid, v) = s.post(&chat, Some(&s.key), &body).await;
        assert_eq!(st, 200, "{v}");
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{choice}: {v}");
        assert!(c["message"]["content"].is_null(), "{v}");
        let call = &c["message"]["tool_calls"][0];
        assert_eq!(call["type"], "function");
        assert!(call["id"].as_str().unwrap().starts_with("call_"), "{v}");
        let name = call["function"]["name"].as_str().unwrap();
        if let Some(want) = choice["function"]["name"].as_str() {
            assert_eq!(name, want, "{v}");
        }
        let args: Value = serde_json::from_str(call["function"]["arguments"].as_str().unwrap())
            .unwrap_or_else(|e| panic!("arguments are not JSON ({e}): {v}"));
        assert_args(&tools, name, &args);
        // Billed as any other request.
        let row = s.row(&rid).await;
        assert_eq!(
            row.output_tokens,
            v["usage"]["completion_tokens"].as_i64().unwrap()
        );
    }
    // Streamed: the call arrives as a `tool_calls` delta, then finish_reason.
    let chunks = s
        .post_stream(
            &chat,
            &json!({"model": MODEL, "messages": msgs, "tools": tools, "tool_choice": "required",
                       "max_tokens": 80, "stream": true}),
        )
        .await;
    let calls: Vec<&Value> = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
        .collect();
    assert_eq!(calls.len(), 1, "{chunks:?}");
    let call = &calls[0][0];
    assert_eq!(call["index"], 0);
    let args: Value =
        serde_json::from_str(call["function"]["arguments"].as_str().unwrap()).unwrap();
    assert_args(&tools, call["function"]["name"].as_str().unwrap(), &args);
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(text, "", "the call leaked into the text: {chunks:?}");
    assert_eq!(
        chunks.last().unwrap()["choices"][0]["finish_reason"],
        "tool_calls"
    );
    // Workers AI: the function objects themselves; result.tool_calls with object
    // arguments.
    let wa_tools = json!([add()["function"], weather()["function"]]);
    let (st, _, v) = s
        .post(
            &s.run_url(&s.tenant.id),
            Some(&s.key),
            &json!({"messages": msgs, "tools": wa_tools, "tool_choice": "required", "max_tokens": 80}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let call = &v["result"]["tool_calls"][0];
    assert_args(&tools, call["name"].as_str().unwrap(), &call["arguments"]);
    // Workers AI streamed: a frame with the calls before the usage frame.
    let frames = s
        .post_stream(
            &s.run_url(&s.tenant.id),
            &json!({"prompt": "Add 2 and 3.", "tools": wa_tools, "max_tokens": 80, "stream": true,
                       "tool_choice": {"type": "function", "function": {"name": "add"}}}),
        )
        .await;
    let with_calls: Vec<&Value> = frames
        .iter()
        .filter(|f| f.get("tool_calls").is_some())
        .collect();
    assert_eq!(with_calls.len(), 1, "{frames:?}");
    assert_eq!(with_calls[0]["tool_calls"][0]["name"], "add");
    assert_args(&tools, "add", &with_calls[0]["tool_calls"][0]["arguments"]);
    assert!(frames.last().unwrap().get("usage").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_and_its_answer_round_trip_and_auto_returns_text_or_valid_calls() {
    let s = start().await;
    let chat = format!("{}/v1/chat/completions", s.base);
    let tools = [weather()];
    let history = json!([
        {"role": "user", "content": "What is the weather in Oslo?"},
        {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees and snowing"}
    ]);
    let mut prompt_tokens = vec![];
    for choice in ["auto", "none"] {
        let body = json!({"model": MODEL, "messages": history, "tools": tools, "tool_choice": choice,
                          "max_tokens": 40});
        let (st, _, v) = s.post(&chat, Some(&s.key), &body).await;
        assert_eq!(st, 200, "{v}");
        let c = &v["choices"][0];
        match c["finish_reason"].as_str().unwrap() {
            "tool_calls" => {
                assert_eq!(choice, "auto", "tool_choice none made a call: {v}");
                for call in c["message"]["tool_calls"].as_array().unwrap() {
                    assert_eq!(call["function"]["name"], "get_weather", "{v}");
                    let args: Value =
                        serde_json::from_str(call["function"]["arguments"].as_str().unwrap())
                            .unwrap();
                    assert!(args.is_object(), "{v}");
                }
            }
            "stop" | "length" => {
                assert!(c["message"]["content"].is_string(), "{v}");
                assert!(c["message"].get("tool_calls").is_none(), "{v}");
            }
            other => panic!("finish_reason {other}: {v}"),
        }
        prompt_tokens.push(v["usage"]["prompt_tokens"].as_u64().unwrap());
    }
    // `auto` shows the tools to the model; `none` does not.
    assert!(
        prompt_tokens[0] > prompt_tokens[1] + 40,
        "{prompt_tokens:?}"
    );
    // Workers AI history shape: calls with object arguments.
    let (st, _, v) = s
        .post(
            &s.run_url(&s.tenant.id),
            Some(&s.key),
            &json!({"messages": [
                {"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "tool_calls": [{"name": "get_weather", "arguments": {"city": "Oslo"}}]},
                {"role": "tool", "content": "4 degrees"}], "tools": [weather()["function"]], "max_tokens": 8}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_tool_lists_are_400s_naming_the_field() {
    let s = start().await;
    let chat = format!("{}/v1/chat/completions", s.base);
    let msgs = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (json!({"tools": "get_weather"}), "tools", "must be an array"),
        (json!({"tools": [{"name": "f"}]}), "tools", "type"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "rm -rf"}}]}),
            "tools",
            "name",
        ),
        (json!({"tools": [weather(), weather()]}), "tools", "repeats"),
        (json!({"tools": vec![add(); 129]}), "tools", "at most 128"),
        (
            json!({"tools": [add()], "tool_choice": "sometimes"}),
            "tool_choice",
            "must be none",
        ),
        (
            json!({"tool_choice": "required"}),
            "tool_choice",
            "needs at least one",
        ),
        (
            json!({"tools": [add()], "tool_choice": {"type": "function", "function": {"name": "sub"}}}),
            "tool_choice",
            "not in `tools`",
        ),
        (
            json!({"tools": [add()], "tool_choice": "required", "response_format": {"type": "json_object"}}),
            "response_format",
            "cannot be combined",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f",
                   "parameters": {"type": "integer", "minimum": 5, "maximum": 1}}}],
                   "tool_choice": "required"}),
            "tools",
            "cannot be compiled",
        ),
        (
            json!({"messages": [{"role": "assistant", "tool_calls": {"name": "f"}}]}),
            "messages",
            "must be an array",
        ),
        (
            json!({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}),
            "messages",
            "only allowed on assistant",
        ),
    ];
    for (extra, param, says) in cases {
        let mut body = json!({"model": MODEL, "messages": msgs, "max_tokens": 8});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (st, _, v) = s.post(&chat, Some(&s.key), &body).await;
        assert_eq!(st, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{extra}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(says), "{extra}: {msg}");
    }
    // Workers AI: a raw prompt has no chat template to show tools in.
    let (st, _, v) = s
        .post(
            &s.run_url(&s.tenant.id),
            Some(&s.key),
            &json!({"prompt": "hi", "raw": true, "tools": [add()["function"]]}),
        )
        .await;
    assert_eq!(st, 400, "{v}");
    assert!(
        v["errors"][0]["message"]
            .as_str()
            .unwrap()
            .contains("tools"),
        "{v}"
    );
}
