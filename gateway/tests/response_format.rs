//! `response_format` over HTTP (issue 14): OpenAI's and Workers AI's shapes, JSON mode
//! and JSON Schema, streamed and not, through the in-process prefill -> decode hop
//! (the first token sampled by the prefill engine, the rest by the decode engine),
//! and every malformed or uncompilable format refused with a 400 naming
//! `response_format` and one ledger row with no tokens.

mod common;

use common::*;
use serde_json::{json, Value};

fn person() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3}
        },
        "required": ["name", "age", "pets"],
        "additionalProperties": false
    })
}

fn assert_valid(text: &str, schema: &Value) -> Value {
    let doc: Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text:?}"));
    let v = jsonschema::validator_for(schema).unwrap();
    let errors: Vec<String> = v.iter_errors(&doc).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{text} fails its schema: {errors:?}");
    doc
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn both_api_shapes_enforce_json_mode_and_schemas_across_the_pd_hop() {
    let s = start_pd(Default::default()).await;
    let msgs = json!([{"role": "user", "content": "Tell me about a person you know."}]);
    let chat = format!("{}/v1/chat/completions", s.base);
    // OpenAI: json_schema wrapper, greedy and sampled.
    for temperature in [0.0, 0.9] {
        let body = json!({
            "model": MODEL, "messages": msgs, "max_tokens": 120, "temperature": temperature, "seed": 3,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "person", "strict": true, "schema": person()}}
        });
        let (st, rid, v) = s.post(&chat, Some(&s.key), &body).await;
        assert_eq!(st, 200, "{v}");
        assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
        assert_valid(
            v["choices"][0]["message"]["content"].as_str().unwrap(),
            &person(),
        );
        let row = s.row(&rid).await;
        assert_eq!(
            row.output_tokens,
            v["usage"]["completion_tokens"].as_i64().unwrap()
        );
    }
    // OpenAI JSON mode, streamed: the deltas join into one JSON object.
    let frames = s
        .post_stream(
            &chat,
            &json!({"model": MODEL, "messages": msgs, "max_tokens": 120, "stream": true,
                       "response_format": {"type": "json_object"}}),
        )
        .await;
    let text: String = frames
        .iter()
        .filter_map(|c| {
            c["choices"][0]["delta"]["content"]
                .as_str()
                .map(String::from)
        })
        .collect();
    assert!(assert_valid(&text, &json!({"type": "object"})).is_object());
    // Workers AI: the schema itself under `json_schema`, with `prompt`.
    let (st, _, v) = s
        .post(
            &s.run_url(&s.tenant.id),
            Some(&s.key),
            &json!({"prompt": "Tell me about a person you know.", "max_tokens": 120,
                    "response_format": {"type": "json_schema", "json_schema": person()}}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_valid(v["result"]["response"].as_str().unwrap(), &person());
    // The same request without a format is free text (the format did the work).
    let (st, _, v) = s
        .post(
            &s.run_url(&s.tenant.id),
            Some(&s.key),
            &json!({"prompt": "Tell me about a person you know.", "max_tokens": 40}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    let free = v["result"]["response"].as_str().unwrap();
    assert!(serde_json::from_str::<Value>(free).is_err(), "{free}");
    // `text` is free text too.
    let (st, _, v) = s
        .post(
            &chat,
            Some(&s.key),
            &json!({"model": MODEL, "messages": msgs, "max_tokens": 40,
                    "response_format": {"type": "text"}}),
        )
        .await;
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        v["choices"][0]["message"]["content"].as_str().unwrap(),
        free
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_uncompilable_formats_are_400s_naming_the_field() {
    let s = start().await;
    let chat = format!("{}/v1/chat/completions", s.base);
    let before = s.row_count().await;
    let mut deep = json!({"type": "integer"});
    for _ in 0..40 {
        deep = json!({"type": "array", "items": deep});
    }
    let huge = json!({"type": "string", "description": "x".repeat(40_000)});
    let cases = [
        (json!("json_object"), "must be an object"),
        (json!({}), "`response_format.type` is required"),
        (
            json!({"type": "xml"}),
            "must be one of text, json_object, json_schema",
        ),
        (
            json!({"type": "json_schema"}),
            "`response_format.json_schema` is required",
        ),
        (
            json!({"type": "json_schema", "json_schema": []}),
            "must be an object",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}),
            "name",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}),
            "object or boolean",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}),
            "nests deeper",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x", "schema": huge}}),
            "bytes of JSON",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x",
                   "schema": {"type": "integer", "minimum": 9, "maximum": 1}}}),
            "cannot be compiled",
        ),
        (
            json!({"type": "json_schema", "json_schema": {"name": "x",
                   "schema": {"$ref": "https://example.com/s.json"}}}),
            "cannot be compiled",
        ),
    ];
    for (rf, says) in cases {
        let body = json!({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 8, "response_format": rf});
        let (st, _, v) = s.post(&chat, Some(&s.key), &body).await;
        assert_eq!(st, 400, "{rf}: {v}");
        assert_eq!(v["error"]["param"], "response_format", "{rf}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(says), "{rf}: {msg}");
        assert!(msg.len() < 600, "{rf}: an error quoting the grammar: {msg}");
    }
    // Workers AI shape: same checks, its envelope.
    let (st, _, v) = s
        .post(
            &s.run_url(&s.tenant.id),
            Some(&s.key),
            &json!({"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"type": "nope"}}}),
        )
        .await;
    assert_eq!(st, 400, "{v}");
    assert_eq!(v["success"], false, "{v}");
    assert!(
        v["errors"][0]["message"]
            .as_str()
            .unwrap()
            .contains("response_format"),
        "{v}"
    );
    // Validation errors write one row each (as every 400 after auth), no tokens.
    let rows = s.store().usage_rows(None).await.unwrap();
    assert_eq!(rows.len(), before + 12);
    assert!(
        rows.iter().all(|r| r.output_tokens == 0),
        "a refused format was billed tokens"
    );
}
