//! The parsed request ([`ParsedRequest`]) and the field readers both API shapes
//! share, every field read with its bounds; each shape reads its own body
//! ([`crate::openai::parse_chat`], [`crate::openai::parse_completion`],
//! [`crate::workers_ai::parse_run`]). [`crate::model_check`] takes it on to a
//! `ValidRequest` (prompt rendered and tokenized, I1 checked). Messages name the
//! field, the limit and the value given.

use crate::error::{type_name, ApiError, ErrorKind};
use crate::tools::{history_text, Tools};
use serde_json::{Map, Value};
use tessera_model::chat::ChatMessage;
use tessera_model::detok::{MAX_STOPS, MAX_STOP_BYTES};
use tessera_model::grammar::ResponseFormat;
use tessera_model::sampling::{SamplingError, SamplingParams, MAX_TOP_K};
use tessera_serving::{Priority, SpecMode, MAX_SPECULATE};

/// Default `max_tokens` when a request gives none.
pub const DEFAULT_MAX_TOKENS: usize = 256;

/// What to feed the model.
#[derive(Clone, Debug, PartialEq)]
pub enum Input {
    /// A text prompt; `chat` wraps it as one user message in the chat template
    /// (its text stays plain text); without `chat` it is a raw prompt whose
    /// control-token text is parsed as control tokens.
    Prompt {
        /// The text.
        text: String,
        /// Apply the chat template.
        chat: bool,
    },
    /// A conversation, rendered by the chat template.
    Messages(Vec<ChatMessage>),
}

/// A syntactically valid request (types and ranges checked, nothing tokenized).
#[derive(Clone, Debug, PartialEq)]
pub struct ParsedRequest {
    /// Model id from the body (OpenAI) or path (Workers AI).
    pub model: String,
    /// Prompt or messages.
    pub input: Input,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling parameters (validated).
    pub sampling: SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Stream as server-sent events.
    pub stream: bool,
    /// OpenAI `stream_options.include_usage`.
    pub include_usage: bool,
    /// The class the request asks for (`priority` field, OpenAI `service_tier`
    /// `flex`); capped at the tenant's ceiling by [`validate`].
    pub priority: Option<Priority>,
    /// Log probabilities of each generated token with this many alternatives
    /// (chat `logprobs` + `top_logprobs`, completions `logprobs`); `None`: none.
    pub logprobs: Option<u32>,
    /// Completions `echo`: the prompt comes back before the completion (with its
    /// log probabilities when `logprobs` is set).
    pub echo: bool,
    /// `response_format`: the shape the output must take; `None`: free text.
    pub format: Option<ResponseFormat>,
    /// `tools` and `tool_choice` (chat and Workers AI); `None`: no tools, or
    /// `tool_choice: "none"`.
    pub tools: Option<Tools>,
    /// `speculative`: draft tokens per step and where they come from; `None`: the
    /// model's setting (`tessera serve --speculate`, `--draft-model`).
    pub speculative: Option<Speculative>,
    /// `lora`: the caller's LoRA fine-tune (id or name) to run the model under
    /// (OpenAI also `model: "<base>:<fine-tune>"`); `None`: the base model.
    pub lora: Option<String>,
}

/// Parses a JSON object body.
pub fn parse_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(other) => Err(ApiError::new(
            ErrorKind::BadRequest,
            format!(
                "request body must be a JSON object. Given: {}",
                type_name(&other)
            ),
        )),
        Err(e) => Err(ApiError::new(
            ErrorKind::BadRequest,
            format!("request body is not valid JSON: {e}"),
        )),
    }
}

pub(crate) fn present<'a>(o: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    o.get(k).filter(|v| !v.is_null())
}

pub(crate) fn opt_bool(o: &Map<String, Value>, k: &str) -> Result<Option<bool>, ApiError> {
    match present(o, k) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(ApiError::field(
            k,
            format!("`{k}` must be a boolean. Given: {}", type_name(v)),
        )),
    }
}

pub(crate) fn opt_f32(o: &Map<String, Value>, k: &str) -> Result<Option<f32>, ApiError> {
    match present(o, k) {
        None => Ok(None),
        Some(Value::Number(n)) => {
            let f = n.as_f64().unwrap_or(f64::NAN);
            let narrow = f as f32;
            // A value f32 cannot hold (or only as a subnormal) would be checked,
            // and echoed, as something else.
            if f != 0.0 && !narrow.is_normal() {
                return Err(ApiError::field(
                    k,
                    format!(
                        "`{k}` must be 0 or between 1.2e-38 and 3.4e38 in magnitude. Given: {n}"
                    ),
                ));
            }
            Ok(Some(narrow))
        }
        Some(v) => Err(ApiError::field(
            k,
            format!("`{k}` must be a number. Given: {}", type_name(v)),
        )),
    }
}

/// A non-negative integer field; `min` is the smallest accepted value.
pub(crate) fn opt_uint(o: &Map<String, Value>, k: &str, min: u64) -> Result<Option<u64>, ApiError> {
    let Some(v) = present(o, k) else {
        return Ok(None);
    };
    let bad = |given: String| {
        ApiError::field(
            k,
            format!("`{k}` must be an integer >= {min}. Given: {given}"),
        )
    };
    match v {
        Value::Number(n) => {
            if let Some(u) = n.as_u64() {
                if u < min {
                    return Err(bad(u.to_string()));
                }
                Ok(Some(u))
            } else if n.as_i64().is_some() {
                Err(bad(n.to_string()))
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                if f.fract() == 0.0 && f >= min as f64 {
                    // A whole number written as a float (`2.0`, `1e3`): take its
                    // value; one too large for u64 saturates, and the context
                    // check rejects it with both numbers.
                    Ok(Some(if f < u64::MAX as f64 {
                        f as u64
                    } else {
                        u64::MAX
                    }))
                } else {
                    Err(bad(n.to_string()))
                }
            }
        }
        other => Err(bad(type_name(other).into())),
    }
}

/// A priority class name (`interactive`, `batch`) given in `field`.
pub fn priority_name(field: &str, v: &str) -> Result<Priority, ApiError> {
    Priority::parse(v).ok_or_else(|| {
        ApiError::field(
            field,
            format!("`{field}` must be `interactive` or `batch`. Given: {v}"),
        )
    })
}

/// The class asked for in the body: `priority` (both API shapes), or OpenAI's
/// `service_tier` (`flex` is batch; `auto`, `default`, `priority` and `scale` ask
/// for nothing beyond the tenant's class).
pub(crate) fn requested_priority(
    o: &Map<String, Value>,
    openai: bool,
) -> Result<Option<Priority>, ApiError> {
    if let Some(p) = opt_string(o, "priority")? {
        return priority_name("priority", p).map(Some);
    }
    if !openai {
        return Ok(None);
    }
    match opt_string(o, "service_tier")? {
        None | Some("auto" | "default" | "priority" | "scale") => Ok(None),
        Some("flex") => Ok(Some(Priority::Batch)),
        Some(v) => Err(ApiError::field(
            "service_tier",
            format!(
                "`service_tier` must be one of auto, default, flex, priority, scale. Given: {v}"
            ),
        )),
    }
}

pub(crate) fn opt_string<'a>(
    o: &'a Map<String, Value>,
    k: &str,
) -> Result<Option<&'a str>, ApiError> {
    match present(o, k) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(ApiError::field(
            k,
            format!("`{k}` must be a string. Given: {}", type_name(v)),
        )),
    }
}

pub(crate) fn sampling(o: &Map<String, Value>) -> Result<SamplingParams, ApiError> {
    let d = SamplingParams::default();
    // Workers AI's default temperature is 0.6; an absent field keeps our greedy
    // default so answers are reproducible unless a client asks otherwise.
    let s = SamplingParams {
        temperature: opt_f32(o, "temperature")?.unwrap_or(d.temperature),
        top_p: opt_f32(o, "top_p")?.unwrap_or(d.top_p),
        top_k: match opt_uint(o, "top_k", 0)? {
            // Checked here so the message shows the value given, not a saturated one.
            Some(k) if k > u64::from(MAX_TOP_K) => {
                let e = SamplingError::TopK(k);
                return Err(ApiError::field(e.field(), e.to_string()));
            }
            Some(k) => k as u32,
            None => d.top_k,
        },
        seed: seed(o)?,
        repetition_penalty: opt_f32(o, "repetition_penalty")?.unwrap_or(d.repetition_penalty),
        frequency_penalty: opt_f32(o, "frequency_penalty")?.unwrap_or(d.frequency_penalty),
        presence_penalty: opt_f32(o, "presence_penalty")?.unwrap_or(d.presence_penalty),
    };
    s.validate()
        .map_err(|e| ApiError::field(e.field(), e.to_string()))?;
    Ok(s)
}

/// `seed`: an integer in `[0, 2^64 - 1]` (a whole float beyond it is refused, not
/// saturated: two different seeds must not silently become one).
pub(crate) fn seed(o: &Map<String, Value>) -> Result<Option<u64>, ApiError> {
    let s = opt_uint(o, "seed", 0)?;
    if s == Some(u64::MAX) && present(o, "seed").and_then(Value::as_u64) != Some(u64::MAX) {
        return Err(ApiError::field(
            "seed",
            format!(
                "`seed` must be an integer >= 0 and <= {}. Given: {}",
                u64::MAX,
                present(o, "seed").map(Value::to_string).unwrap_or_default()
            ),
        ));
    }
    Ok(s)
}

pub(crate) fn max_tokens(o: &Map<String, Value>, keys: &[&str]) -> Result<usize, ApiError> {
    for k in keys {
        if let Some(n) = opt_uint(o, k, 1)? {
            return Ok(usize::try_from(n).unwrap_or(usize::MAX));
        }
    }
    Ok(DEFAULT_MAX_TOKENS)
}

pub(crate) fn content_text(v: &Value, field: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut out = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => out.push_str(t),
                    _ => {
                        return Err(ApiError::field(
                            field,
                            format!("`{field}` parts must be {{\"type\":\"text\",\"text\":..}}"),
                        ))
                    }
                }
            }
            Ok(out)
        }
        other => Err(ApiError::field(
            field,
            format!("`{field}` must be a string. Given: {}", type_name(other)),
        )),
    }
}

pub(crate) fn messages(v: &Value) -> Result<Vec<ChatMessage>, ApiError> {
    let Value::Array(items) = v else {
        return Err(ApiError::field(
            "messages",
            format!("`messages` must be an array. Given: {}", type_name(v)),
        ));
    };
    if items.is_empty() {
        return Err(ApiError::field(
            "messages",
            "`messages` must contain at least 1 message. Given: 0",
        ));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, m) in items.iter().enumerate() {
        let role = m.get("role").and_then(Value::as_str).ok_or_else(|| {
            ApiError::field("messages", format!("`messages[{i}].role` must be a string"))
        })?;
        if !matches!(role, "system" | "user" | "assistant" | "developer" | "tool") {
            return Err(ApiError::field(
                "messages",
                format!(
                    "`messages[{i}].role` must be one of system, developer, user, assistant, tool. Given: {role}"
                ),
            ));
        }
        let role = if role == "developer" { "system" } else { role };
        let content = match m.get("content") {
            None | Some(Value::Null) => None,
            Some(c) => Some(content_text(c, &format!("messages[{i}].content"))?),
        };
        out.push(ChatMessage::new(role, history_text(i, role, content, m)?));
    }
    Ok(out)
}

pub(crate) fn prompt_text(o: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    match present(o, "prompt") {
        None => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Err(ApiError::field(
            "prompt",
            "`prompt` must be a non-empty string. Given: \"\"",
        )),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Array(a)) if a.len() == 1 && a[0].is_string() => {
            let s = a[0].as_str().unwrap_or_default();
            if s.is_empty() {
                return Err(ApiError::field(
                    "prompt",
                    "`prompt` must be a non-empty string. Given: \"\"",
                ));
            }
            Ok(Some(s.into()))
        }
        Some(v) => Err(ApiError::field(
            "prompt",
            format!("`prompt` must be a string. Given: {}", type_name(v)),
        )),
    }
}

/// `stop`: a string or an array of at most [`MAX_STOPS`] strings, each at most
/// [`MAX_STOP_BYTES`] bytes (the stop matcher's work per token is bounded by the
/// longest one); empty strings are dropped.
pub(crate) fn stop(o: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let shape = || {
        ApiError::field(
            "stop",
            format!("`stop` must be a string or an array of at most {MAX_STOPS} strings"),
        )
    };
    let stops: Vec<String> = match present(o, "stop") {
        None => return Ok(vec![]),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) if a.iter().all(Value::is_string) => {
            // Empty strings are ignored, so they do not count toward the cap.
            let counted = a.iter().filter(|s| s.as_str() != Some("")).count();
            if counted > MAX_STOPS {
                return Err(ApiError::field(
                    "stop",
                    format!(
                        "`stop` must be a string or an array of at most {MAX_STOPS} non-empty strings. Given: {counted} strings",
                    ),
                ));
            }
            a.iter()
                .filter_map(|s| s.as_str().map(String::from))
                .collect()
        }
        Some(_) => return Err(shape()),
    };
    if let Some((i, s)) = stops
        .iter()
        .enumerate()
        .find(|(_, s)| s.len() > MAX_STOP_BYTES)
    {
        return Err(ApiError::field(
            "stop",
            format!(
                "each `stop` string must be at most {MAX_STOP_BYTES} bytes. Given: {} bytes (stop[{i}])",
                s.len()
            ),
        ));
    }
    Ok(stops.into_iter().filter(|s| !s.is_empty()).collect())
}

/// A 400 naming `field` when `v` is longer than [`crate::MAX_ID_BYTES`] bytes
/// (ids and names: longer ones are never stored or looked up).
pub(crate) fn check_len(field: &str, v: &str) -> Result<(), ApiError> {
    let max = crate::state::MAX_ID_BYTES;
    if v.len() > max {
        return Err(ApiError::field(
            field,
            format!(
                "`{field}` must be at most {max} bytes. Given: {} bytes",
                v.len()
            ),
        ));
    }
    Ok(())
}

/// `lora`: a fine-tune's id or name (a non-empty string of at most
/// [`MAX_ID_BYTES`](crate::MAX_ID_BYTES) bytes), or absent.
pub(crate) fn lora(o: &Map<String, Value>) -> Result<Option<String>, ApiError> {
    match opt_string(o, "lora")? {
        None => Ok(None),
        Some("") => Err(ApiError::field("lora", "`lora` must not be empty")),
        Some(l) => {
            check_len("lora", l)?;
            Ok(Some(l.into()))
        }
    }
}

/// A request's `speculative` object.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Speculative {
    /// `mode`: `ngram` (prompt lookup) or `draft` (the model's draft model);
    /// `None`: the model's default (`draft` where it has a draft model).
    pub mode: Option<SpecMode>,
    /// `k`: draft tokens per step, `0..=`[`MAX_SPECULATE`] (0: off).
    pub k: u32,
}

/// `speculative`: `{"mode": "ngram" | "draft", "k": N}` (both keys optional: the
/// model's default mode, k 4; `k` in `0..=`[`MAX_SPECULATE`], 0 turns speculation
/// off for the request). Prompt-lookup drafts come from the request's own prompt
/// and output only; draft-model drafts from a model of the same tokenizer (a model
/// without one refuses `draft` at admission). The output is the same with or
/// without drafts.
pub(crate) fn speculative(o: &Map<String, Value>) -> Result<Option<Speculative>, ApiError> {
    const F: &str = "speculative";
    let Some(v) = present(o, F) else {
        return Ok(None);
    };
    let Value::Object(sp) = v else {
        return Err(ApiError::field(
            F,
            format!(
                "`{F}` must be an object like {{\"mode\": \"ngram\", \"k\": 4}}. Given: {}",
                type_name(v)
            ),
        ));
    };
    if let Some(k) = sp.keys().find(|k| !matches!(k.as_str(), "mode" | "k")) {
        return Err(ApiError::field(
            F,
            format!("`{F}` has an unknown key `{k}` (known: `mode`, `k`)"),
        ));
    }
    let mode = match present(sp, "mode") {
        None => None,
        Some(Value::String(m)) if m == "ngram" => Some(SpecMode::Ngram),
        Some(Value::String(m)) if m == "draft" => Some(SpecMode::Draft),
        Some(v) => {
            return Err(ApiError::field(
                F,
                format!("`speculative.mode` must be \"ngram\" or \"draft\". Given: {v}"),
            ))
        }
    };
    let k = |k: u32| Ok(Some(Speculative { mode, k }));
    match present(sp, "k") {
        None => k(4),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(n) if n <= u64::from(MAX_SPECULATE) => k(n as u32),
            _ => Err(ApiError::field(
                F,
                format!("`speculative.k` must be an integer from 0 to {MAX_SPECULATE}. Given: {n}"),
            )),
        },
        Some(v) => Err(ApiError::field(
            F,
            format!(
                "`speculative.k` must be an integer from 0 to {MAX_SPECULATE}. Given: {}",
                type_name(v)
            ),
        )),
    }
}

/// `response_format`: `{"type": "text"}` (free text, as if absent), `{"type":
/// "json_object"}` (any JSON object), or `{"type": "json_schema", "json_schema": X}`
/// where X is OpenAI's wrapper `{"name", "description"?, "schema"?, "strict"?}` (no
/// `schema`: any JSON object) or, on Workers AI, the schema itself (Workers AI
/// documents that shape; its wrapper form is accepted too: an object whose only
/// schema-like key is `schema`). Only the shape is checked here; [`validate`]
/// compiles the schema.
pub(crate) fn response_format(
    o: &Map<String, Value>,
    openai: bool,
) -> Result<Option<ResponseFormat>, ApiError> {
    const F: &str = "response_format";
    let Some(v) = present(o, F) else {
        return Ok(None);
    };
    let Value::Object(rf) = v else {
        return Err(ApiError::field(
            F,
            format!("`{F}` must be an object. Given: {}", type_name(v)),
        ));
    };
    let kind = opt_string(rf, "type")
        .map_err(|_| ApiError::field(F, format!("`{F}.type` must be a string")))?
        .ok_or_else(|| ApiError::field(F, format!("`{F}.type` is required")))?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(ResponseFormat::JsonObject)),
        "json_schema" => {
            let js = present(rf, "json_schema").ok_or_else(|| {
                ApiError::field(
                    F,
                    format!("`{F}.json_schema` is required with type json_schema"),
                )
            })?;
            let Value::Object(js) = js else {
                return Err(ApiError::field(
                    F,
                    format!(
                        "`{F}.json_schema` must be an object. Given: {}",
                        type_name(js)
                    ),
                ));
            };
            let schema_like = [
                "type",
                "properties",
                "$schema",
                "$defs",
                "anyOf",
                "oneOf",
                "allOf",
                "enum",
                "const",
                "items",
                "$ref",
            ];
            let wrapper = openai || !schema_like.iter().any(|k| js.contains_key(*k));
            if !wrapper {
                return Ok(Some(ResponseFormat::JsonSchema {
                    schema: Value::Object(js.clone()),
                }));
            }
            if let Some(name) = present(js, "name") {
                let ok = name.as_str().is_some_and(|n| {
                    !n.is_empty()
                        && n.len() <= 64
                        && n.bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
                });
                if !ok {
                    return Err(ApiError::field(
                        F,
                        format!("`{F}.json_schema.name` must be 1 to 64 of a-z, A-Z, 0-9, _ and -"),
                    ));
                }
            }
            opt_bool(js, "strict").map_err(|_| {
                ApiError::field(F, format!("`{F}.json_schema.strict` must be a boolean"))
            })?;
            match present(js, "schema") {
                None => Ok(Some(ResponseFormat::JsonObject)),
                Some(schema @ (Value::Object(_) | Value::Bool(_))) => {
                    Ok(Some(ResponseFormat::JsonSchema {
                        schema: schema.clone(),
                    }))
                }
                Some(other) => Err(ApiError::field(
                    F,
                    format!(
                        "`{F}.json_schema.schema` must be an object or boolean. Given: {}",
                        type_name(other)
                    ),
                )),
            }
        }
        other => Err(ApiError::field(
            F,
            format!(
                "`{F}.type` must be one of text, json_object, json_schema. Given: {}",
                other.chars().take(64).collect::<String>()
            ),
        )),
    }
}

/// A count of alternatives per position: an integer in `0..=max`.
pub(crate) fn top_count(
    o: &Map<String, Value>,
    k: &str,
    max: u32,
) -> Result<Option<u32>, ApiError> {
    let max = u64::from(max);
    match opt_uint(o, k, 0) {
        Ok(Some(n)) if n > max => Err(ApiError::field(
            k,
            format!("`{k}` must be an integer >= 0 and <= {max}. Given: {n}"),
        )),
        Ok(n) => Ok(n.map(|n| n as u32)),
        Err(_) => Err(ApiError::field(
            k,
            format!(
                "`{k}` must be an integer >= 0 and <= {max}. Given: {}",
                present(o, k).map_or("null".into(), |v| v.to_string())
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::{parse_chat as openai_chat, parse_completion as openai_completion};
    use crate::workers_ai::parse_run as workers_ai;
    use serde_json::json;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn workers_ai_fields() {
        let p = workers_ai("m", &obj(json!({"prompt": "hi"}))).unwrap();
        assert_eq!(p.max_tokens, DEFAULT_MAX_TOKENS);
        assert_eq!(
            p.input,
            Input::Prompt {
                text: "hi".into(),
                chat: true
            }
        );
        let p = workers_ai("m", &obj(json!({"prompt": "hi", "raw": true, "max_tokens": 5, "seed": 7, "temperature": 0.5}))).unwrap();
        assert_eq!(
            p.input,
            Input::Prompt {
                text: "hi".into(),
                chat: false
            }
        );
        assert_eq!(
            (p.max_tokens, p.sampling.seed, p.sampling.temperature),
            (5, Some(7), 0.5)
        );
        for (body, field) in [
            (json!({"prompt": 5}), "prompt"),
            (json!({"prompt": ""}), "prompt"),
            (json!({"prompt": "x", "max_tokens": -1}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": 0}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": 1.5}), "max_tokens"),
            (json!({"prompt": "x", "max_tokens": "12"}), "max_tokens"),
            (json!({"prompt": "x", "stream": "yes"}), "stream"),
            (json!({"prompt": "x", "temperature": 9.0}), "temperature"),
            (json!({"prompt": "x", "top_p": 0.0}), "top_p"),
            (json!({"messages": []}), "messages"),
            (
                json!({"messages": [{"role": "wizard", "content": "x"}]}),
                "messages",
            ),
        ] {
            let e = workers_ai("m", &obj(body.clone())).unwrap_err();
            assert_eq!(e.kind, ErrorKind::BadRequest, "{body}");
            assert_eq!(e.param.as_deref(), Some(field), "{body}: {}", e.message);
        }
        let e = workers_ai("m", &obj(json!({"prompt": "x", "max_tokens": -5}))).unwrap_err();
        assert_eq!(e.message, "`max_tokens` must be an integer >= 1. Given: -5");
        assert_eq!(
            workers_ai("m", &obj(json!({}))).unwrap_err().kind,
            ErrorKind::BadRequest
        );
        let huge = workers_ai("m", &obj(json!({"prompt": "x", "max_tokens": 1e30}))).unwrap();
        assert_eq!(huge.max_tokens, usize::MAX);
    }

    /// Issue 32 review: `top_p: 1e-300` was refused as "Given: 0" (its f32 cast), and
    /// empty stop strings, which are ignored, counted toward the cap of four.
    #[test]
    fn messages_echo_the_value_given_and_empty_stops_are_free() {
        let e = workers_ai("m", &obj(json!({"prompt": "x", "top_p": 1e-300}))).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_p"));
        assert!(e.message.ends_with("Given: 1e-300"), "{}", e.message);
        let e = workers_ai("m", &obj(json!({"prompt": "x", "temperature": 1e39}))).unwrap_err();
        assert!(e.message.contains("Given: 1e+39"), "{}", e.message);
        let e = workers_ai("m", &obj(json!({"prompt": "x", "top_p": 1e-40}))).unwrap_err();
        assert!(e.message.ends_with("Given: 1e-40"), "{}", e.message);
        let p = workers_ai("m", &obj(json!({"prompt": "x", "temperature": 0.0}))).unwrap();
        assert_eq!(p.sampling.temperature, 0.0);
        let stops = json!(["", "a", "", "b", "c", "", "d", ""]);
        let p = workers_ai("m", &obj(json!({"prompt": "x", "stop": stops}))).unwrap();
        assert_eq!(p.stop, ["a", "b", "c", "d"]);
        let five = json!(["a", "b", "c", "d", "e", ""]);
        let e = workers_ai("m", &obj(json!({"prompt": "x", "stop": five}))).unwrap_err();
        assert!(e.message.ends_with("Given: 5 strings"), "{}", e.message);
    }

    #[test]
    fn openai_fields() {
        let p = openai_chat(&obj(json!({
            "model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}]}],
            "stream": true, "stream_options": {"include_usage": true}, "stop": ["x", "y"], "max_tokens": 9
        })))
        .unwrap();
        assert!(p.stream && p.include_usage);
        assert_eq!(p.stop, vec!["x", "y"]);
        assert_eq!(p.max_tokens, 9);
        assert_eq!(
            p.input,
            Input::Messages(vec![ChatMessage::new("user", "a")])
        );
        assert_eq!(
            openai_chat(&obj(json!({"messages": []})))
                .unwrap_err()
                .param
                .as_deref(),
            Some("messages")
        );
        assert_eq!(
            openai_chat(&obj(json!({"messages": [{"role":"user","content":"x"}]})))
                .unwrap_err()
                .param
                .as_deref(),
            Some("model")
        );
        assert_eq!(
            openai_chat(&obj(
                json!({"model": "m", "n": 2, "messages": [{"role":"user","content":"x"}]})
            ))
            .unwrap_err()
            .param
            .as_deref(),
            Some("n")
        );
        let c = openai_completion(&obj(
            json!({"model": "m", "prompt": "abc", "max_completion_tokens": 3}),
        ))
        .unwrap();
        assert_eq!(
            c.input,
            Input::Prompt {
                text: "abc".into(),
                chat: false
            }
        );
        assert_eq!(c.max_tokens, 3);
    }

    /// A one-message chat request with `extra` fields, parsed.
    fn chat(extra: Value) -> Result<ParsedRequest, ApiError> {
        let mut v = json!({"model": "m", "messages": [{"role": "user", "content": "x"}]});
        v.as_object_mut()
            .unwrap()
            .extend(extra.as_object().unwrap().clone());
        openai_chat(&obj(v))
    }

    #[test]
    fn logprobs_fields() {
        assert_eq!(chat(json!({})).unwrap().logprobs, None);
        assert_eq!(chat(json!({"logprobs": true})).unwrap().logprobs, Some(0));
        let p = chat(json!({"logprobs": true, "top_logprobs": 20})).unwrap();
        assert_eq!((p.logprobs, p.echo), (Some(20), false));
        for (bad, field) in [
            (
                json!({"logprobs": true, "top_logprobs": 21}),
                "top_logprobs",
            ),
            (json!({"top_logprobs": 1}), "top_logprobs"),
            (json!({"logprobs": "yes"}), "logprobs"),
        ] {
            let e = chat(bad.clone()).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field), "{bad}: {}", e.message);
        }
        let c = openai_completion(&obj(
            json!({"model": "m", "prompt": "a", "logprobs": 5, "echo": true}),
        ))
        .unwrap();
        assert_eq!((c.logprobs, c.echo), (Some(5), true));
        let e = openai_completion(&obj(json!({"model": "m", "prompt": "a", "logprobs": 1.5})))
            .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("logprobs"));
        assert_eq!(
            e.message,
            "`logprobs` must be an integer >= 0 and <= 5. Given: 1.5"
        );
        // OpenAI's limits: 5 alternatives on completions, 20 on chat.
        let e = openai_completion(&obj(json!({"model": "m", "prompt": "a", "logprobs": 6})))
            .unwrap_err();
        assert_eq!(
            (e.param.as_deref(), e.message.as_str()),
            (
                Some("logprobs"),
                "`logprobs` must be an integer >= 0 and <= 5. Given: 6"
            )
        );
    }

    #[test]
    fn a_request_asks_for_a_class_but_never_above_its_tenant_ceiling() {
        let o = obj(json!({"prompt": "x", "priority": "batch"}));
        assert_eq!(workers_ai("m", &o).unwrap().priority, Some(Priority::Batch));
        assert_eq!(
            chat(json!({"service_tier": "flex"})).unwrap().priority,
            Some(Priority::Batch)
        );
        assert_eq!(
            chat(json!({"service_tier": "auto"})).unwrap().priority,
            None
        );
        assert_eq!(
            chat(json!({"priority": "interactive", "service_tier": "flex"}))
                .unwrap()
                .priority,
            Some(Priority::Interactive),
            "`priority` wins over `service_tier`"
        );
        for bad in [
            json!({"priority": "urgent"}),
            json!({"service_tier": "gold"}),
            json!({"priority": 1}),
        ] {
            let e = chat(bad.clone()).unwrap_err();
            assert!(e.param.is_some(), "{bad}: {e:?}");
        }
    }

    #[test]
    fn bodies() {
        assert!(parse_object(b"{\"a\":1}").is_ok());
        assert_eq!(
            parse_object(b"{nope").unwrap_err().kind,
            ErrorKind::BadRequest
        );
        assert!(parse_object(b"[1]").unwrap_err().message.contains("array"));
    }
}
