//! Property tests of request bodies: arbitrary JSON values and byte strings thrown
//! at both APIs' validation (pure, with the real tokenizer and chat template) and
//! at the live server. Nothing panics; every refusal is a 4xx whose message names
//! the field (or the body) at fault.

mod common;

use common::*;
use proptest::collection::{btree_map, vec};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Map, Value};
use std::sync::OnceLock;
use std::time::Duration;
use tessera_gateway::catalog::Catalog;
use tessera_gateway::{model_check, openai, validation, workers_ai};
use tessera_gateway::{Deadlines, GatewayOptions};
use tessera_model::LoadedModel;
use tessera_serving::admission::{AdmissionLimits, PdAdmission};

/// Words a refusal may name: the request's fields, or the body itself.
const FIELDS: &[&str] = &[
    "prompt",
    "messages",
    "model",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "stream",
    "stream_options",
    "include_usage",
    "stop",
    "raw",
    "`n`",
    "request body",
];

fn names_a_field(msg: &str) -> bool {
    FIELDS.iter().any(|f| msg.contains(f))
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec![
            "prompt", "messages", "model", "max_tokens", "max_completion_tokens", "temperature",
            "top_p", "top_k", "seed", "repetition_penalty", "frequency_penalty",
            "presence_penalty", "stream", "stream_options", "include_usage", "stop", "raw", "n",
            "role", "content", "type", "text",
        ])
        .prop_map(String::from),
        1 => "[a-z_]{1,8}",
    ]
}

fn json_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        any::<f64>()
            .prop_filter("finite", |f| f.is_finite())
            .prop_map(|f| json!(f)),
        (0u32..4).prop_map(|n| json!(n)),
        "\\PC{0,24}".prop_map(Value::String),
        prop::sample::select(vec![
            "user",
            "system",
            "assistant",
            "tool",
            "text",
            "@cf/huggingfacetb/smollm2-135m-instruct",
            "<|im_start|>",
            ""
        ])
        .prop_map(|s| Value::String(s.into())),
    ];
    leaf.prop_recursive(3, 32, 6, |inner| {
        prop_oneof![
            vec(inner.clone(), 0..5).prop_map(Value::Array),
            btree_map(key(), inner, 0..5).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// One chat message: a valid one, or one with an arbitrary role or content.
fn message() -> impl Strategy<Value = Value> {
    let role = prop_oneof![
        8 => prop::sample::select(vec!["user", "system", "assistant", "developer", "tool"])
            .prop_map(|r| json!(r)),
        1 => json_value(),
    ];
    let content = prop_oneof![
        6 => "\\PC{0,40}".prop_map(Value::String),
        2 => "\\PC{0,20}".prop_map(|t| json!([{"type": "text", "text": t}])),
        1 => json_value(),
    ];
    prop_oneof![
        8 => (role, content).prop_map(|(r, c)| json!({"role": r, "content": c})),
        1 => json_value(),
    ]
}

/// A field of a request: mostly valid-looking (so that a case usually gets past
/// the other fields to this one), else any JSON value, or absent.
fn field(valid: impl Strategy<Value = Value>) -> impl Strategy<Value = Option<Value>> {
    prop_oneof![
        12 => valid.prop_map(Some),
        1 => json_value().prop_map(Some),
        1 => Just(None),
    ]
}

/// A request-shaped body: every known field valid-looking, arbitrary or absent,
/// plus arbitrary extra keys, so that validation is reached field by field.
fn request_like() -> impl Strategy<Value = Value> {
    let text = "\\PC{1,60}".prop_map(Value::String);
    let small = (1u64..40).prop_map(|n| json!(n));
    let unit = (0.0f64..2.0).prop_map(|f| json!(f));
    (
        (
            field(text.clone()),
            field(vec(message(), 1..4).prop_map(Value::Array)),
            field(Just(json!(MODEL))),
            field(small.clone()),
            field(small),
        ),
        (
            field(unit.clone()),
            field((0.05f64..1.0).prop_map(|f| json!(f))),
            field((0u64..100).prop_map(|n| json!(n))),
            field(any::<u64>().prop_map(|n| json!(n))),
            field(unit.clone()),
            field(unit),
        ),
        (
            field(any::<bool>().prop_map(Value::Bool)),
            field(any::<bool>().prop_map(|b| json!({"include_usage": b}))),
            field(vec("\\PC{0,8}", 0..6).prop_map(|v| json!(v))),
            field(any::<bool>().prop_map(Value::Bool)),
            field(prop_oneof![4 => Just(json!(1)), 1 => (0u64..3).prop_map(|n| json!(n))]),
        ),
        btree_map("[a-z_]{1,8}", json_value(), 0..3),
    )
        .prop_map(|(a, b, c, extra)| {
            let mut o: Map<String, Value> = extra.into_iter().collect();
            let named = [
                ("prompt", a.0),
                ("messages", a.1),
                ("model", a.2),
                ("max_tokens", a.3),
                ("max_completion_tokens", a.4),
                ("temperature", b.0),
                ("top_p", b.1),
                ("top_k", b.2),
                ("seed", b.3),
                ("repetition_penalty", b.4),
                ("presence_penalty", b.5),
                ("stream", c.0),
                ("stream_options", c.1),
                ("stop", c.2),
                ("raw", c.3),
                ("n", c.4),
            ];
            for (k, v) in named {
                if let Some(v) = v {
                    o.insert(k.into(), v);
                }
            }
            // Workers AI wants one of prompt and messages: keep one half the time
            // (the OpenAI endpoints each read only theirs).
            if o.contains_key("prompt") && o.contains_key("messages") && o.len().is_multiple_of(2) {
                let seed = o.get("seed").and_then(Value::as_u64).unwrap_or(0);
                o.remove(if seed.is_multiple_of(2) {
                    "prompt"
                } else {
                    "messages"
                });
            }
            Value::Object(o)
        })
}

/// A body: mostly request-shaped objects, sometimes objects with request-like
/// keys and arbitrary values, sometimes any JSON value.
fn body_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        6 => request_like(),
        2 => btree_map(key(), json_value(), 0..8)
            .prop_map(|m| Value::Object(m.into_iter().collect::<Map<_, _>>())),
        1 => json_value(),
    ]
}

/// Byte strings: random bytes, or a request body cut short or with a byte changed.
fn body_bytes() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        vec(any::<u8>(), 0..256),
        (body_value(), any::<prop::sample::Index>(), any::<u8>()).prop_map(|(v, i, b)| {
            let mut bytes = serde_json::to_vec(&v).unwrap();
            if !bytes.is_empty() {
                let at = i.index(bytes.len());
                if b % 2 == 0 {
                    bytes.truncate(at);
                } else {
                    bytes[at] = b;
                }
            }
            bytes
        }),
    ]
}

fn model() -> &'static LoadedModel {
    static M: OnceLock<LoadedModel> = OnceLock::new();
    M.get_or_init(|| LoadedModel::load(&model_path()).expect("model"))
}

#[test]
fn validation_never_panics_and_names_the_field() {
    let catalog = Catalog::single(MODEL, 8192);
    let limits = AdmissionLimits {
        draft: false,
        context: 8192,
        pool_tokens: 16384,
        page_size: 16,
        vocab: 49152,
    };
    let check = |bytes: &[u8]| -> Result<(), TestCaseError> {
        for api in 0..3 {
            let r = validation::parse_object(bytes).and_then(|o| match api {
                0 => workers_ai::parse_run(MODEL, &o),
                1 => openai::parse_chat(&o),
                _ => openai::parse_completion(&o),
            });
            let r = r.and_then(|p| {
                model_check::validate(
                    p,
                    catalog.get(MODEL).expect("the test model"),
                    model(),
                    PdAdmission {
                        limits,
                        prefill_pool_tokens: limits.pool_tokens,
                    },
                    &model_check::TenantContext::plain(7),
                )
            });
            if let Err(e) = r {
                let st = e.kind.status();
                prop_assert!(
                    st.is_client_error(),
                    "{st} for {:?}",
                    String::from_utf8_lossy(bytes)
                );
                prop_assert!(
                    e.param.is_some() || names_a_field(&e.message),
                    "no field named in {:?} for {:?}",
                    e.message,
                    String::from_utf8_lossy(bytes)
                );
            }
        }
        Ok(())
    };
    let mut runner = TestRunner::new(Config {
        cases: 2000,
        ..Config::default()
    });
    runner
        .run(&body_value(), |v| check(&serde_json::to_vec(&v).unwrap()))
        .unwrap();
    runner.run(&body_bytes(), |b| check(&b)).unwrap();
}

#[test]
fn the_live_server_answers_every_body_with_a_4xx_naming_the_field() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    // A valid body generates; a short deadline bounds it (408 is a 4xx too).
    let cfg = GatewayOptions {
        deadlines: Deadlines {
            total: Duration::from_secs(1),
            ..Deadlines::default()
        },
        ..GatewayOptions::default()
    };
    let s = rt.block_on(start_with(cfg));
    let urls = [
        (s.run_url(&s.tenant.id), false),
        (format!("{}/v1/chat/completions", s.base), true),
        (format!("{}/v1/completions", s.base), true),
    ];
    let send = |bytes: Vec<u8>| -> Result<(), TestCaseError> {
        rt.block_on(async {
            for (url, openai) in &urls {
                let resp = s
                    .client
                    .post(url)
                    .bearer_auth(&s.key)
                    .header("content-type", "application/json")
                    .body(bytes.clone())
                    .send()
                    .await
                    .unwrap();
                let (st, _, v) = split(resp).await;
                if st == 200 || st == 408 {
                    continue; // a valid request: answered or cut by the deadline
                }
                prop_assert!(
                    (400..500).contains(&st),
                    "{st} {v} for {:?}",
                    String::from_utf8_lossy(&bytes)
                );
                let (msg, param) = if *openai {
                    (v["error"]["message"].as_str(), v["error"]["param"].as_str())
                } else {
                    (v["errors"][0]["message"].as_str(), None)
                };
                let msg = msg.unwrap_or_default();
                prop_assert!(
                    param.is_some() || names_a_field(msg),
                    "{st}: no field named in {msg:?} for {:?}",
                    String::from_utf8_lossy(&bytes)
                );
            }
            Ok(())
        })
    };
    let mut runner = TestRunner::new(Config {
        cases: 96,
        ..Config::default()
    });
    runner
        .run(&body_value(), |v| send(serde_json::to_vec(&v).unwrap()))
        .unwrap();
    runner.run(&body_bytes(), send).unwrap();
    // Nothing is left running.
    rt.block_on(async {
        s.settle().await;
        s.wait_idle().await;
    });
}
