//! Function calling: OpenAI `tools` / `tool_choice` and Workers AI `tools`.
//!
//! How a tool list reaches the model: the default model's chat template has no
//! tool section, so every model gets the same fallback, a system message in the
//! Hermes style that instruction-tuned models know (function signatures as JSON
//! inside `<tools></tools>`, calls answered as `<tool_call>{"name": .., "arguments":
//! ..}</tool_call>`). It is a message content, so it is tokenized as plain text like
//! every other content (no control tokens from the caller). Assistant turns that
//! made calls and `tool` turns that answer them are rendered the same way, so a
//! conversation round-trips.
//!
//! What comes back:
//! - `tool_choice: "none"`: the tools are not shown to the model; plain text.
//! - `"auto"` (the default with tools): free text; every `<tool_call>` block whose
//!   JSON names a listed function with an object of arguments becomes a tool call
//!   ([`CallScanner`]), the rest stays text. Arguments are whatever the model wrote
//!   (not schema-checked), as with OpenAI's non-strict functions.
//! - `"required"` or a named function: the output is constrained by grammar
//!   (request validation sets a `response_format`) to one JSON object
//!   `{"name": N, "arguments": A}` where A satisfies N's `parameters` schema, so the
//!   call parses and validates unless `max_tokens` cuts it off (then it is text with
//!   `finish_reason: "length"`).

use crate::error::{type_name, ApiError};
use serde_json::{json, Map, Value};
use tessera_model::chat::ChatMessage;
use tessera_model::grammar::ResponseFormat;

/// Most tools per request (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;

/// The tag that opens a call in the model's output (and in rendered history).
const OPEN: &str = "<tool_call>";
/// The tag that closes it.
const CLOSE: &str = "</tool_call>";

/// One function the model may call.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    /// 1 to 64 of `a-z A-Z 0-9 _ -`, unique in the request.
    pub name: String,
    /// What it does, for the model.
    pub description: Option<String>,
    /// JSON Schema of its arguments (an object schema); `{"type": "object"}` when
    /// the caller gave none.
    pub parameters: Value,
}

/// Whether and which function the model must call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    /// Text only; the tools are not shown.
    None,
    /// The model decides.
    Auto,
    /// One call of any listed function, grammar-enforced.
    Required,
    /// One call of this function, grammar-enforced.
    Named(String),
}

/// A request's tools and choice (only present with at least one tool).
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    /// The functions, in the caller's order.
    pub tools: Vec<Tool>,
    /// What the model must do.
    pub choice: ToolChoice,
}

/// A call parsed from the output.
#[derive(Clone, Debug, PartialEq)]
pub struct ToolCall {
    /// The function's name (one of the request's tools).
    pub name: String,
    /// Its arguments (a JSON object).
    pub arguments: Value,
}

fn valid_name(n: &str) -> bool {
    !n.is_empty()
        && n.len() <= 64
        && n.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// One entry of `tools`: OpenAI's `{"type": "function", "function": {name,
/// description?, parameters?, strict?}}`, or (Workers AI) the function object
/// itself `{name, description?, parameters?}`.
fn tool(i: usize, v: &Value, openai: bool) -> Result<Tool, ApiError> {
    let field = |msg: String| ApiError::field("tools", msg);
    let Value::Object(o) = v else {
        return Err(field(format!(
            "`tools[{i}]` must be an object. Given: {}",
            type_name(v)
        )));
    };
    let f = match o.get("function") {
        Some(Value::Object(f)) => {
            match o.get("type") {
                Some(Value::String(t)) if t == "function" => {}
                None if !openai => {}
                _ => return Err(field(format!("`tools[{i}].type` must be \"function\""))),
            }
            f
        }
        Some(other) => {
            return Err(field(format!(
                "`tools[{i}].function` must be an object. Given: {}",
                type_name(other)
            )))
        }
        None if openai => {
            return Err(field(format!(
                "`tools[{i}]` must be {{\"type\": \"function\", \"function\": {{..}}}}"
            )))
        }
        None => o,
    };
    let name = match f.get("name") {
        Some(Value::String(n)) if valid_name(n) => n.clone(),
        _ => {
            return Err(field(format!(
                "`tools[{i}]` needs a `name` of 1 to 64 of a-z, A-Z, 0-9, _ and -"
            )))
        }
    };
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(d)) => Some(d.clone()),
        Some(other) => {
            return Err(field(format!(
                "`tools[{i}].description` must be a string. Given: {}",
                type_name(other)
            )))
        }
    };
    let parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(other) => {
            return Err(field(format!(
                "`tools[{i}].parameters` must be a JSON Schema object. Given: {}",
                type_name(other)
            )))
        }
    };
    if let Some(s) = f.get("strict") {
        if !s.is_boolean() && !s.is_null() {
            return Err(field(format!("`tools[{i}].strict` must be a boolean")));
        }
    }
    Ok(Tool {
        name,
        description,
        parameters,
    })
}

/// `tool_choice`: `"none"`, `"auto"`, `"required"`, or `{"type": "function",
/// "function": {"name": N}}` naming one of the tools.
fn choice(v: Option<&Value>, tools: &[Tool]) -> Result<ToolChoice, ApiError> {
    let field = |msg: String| ApiError::field("tool_choice", msg);
    let c = match v {
        None | Some(Value::Null) => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => ToolChoice::None,
            "auto" => ToolChoice::Auto,
            "required" => ToolChoice::Required,
            other => {
                return Err(field(format!(
                    "`tool_choice` must be none, auto, required or {{\"type\": \"function\", \
                     \"function\": {{\"name\": ..}}}}. Given: {}",
                    other.chars().take(64).collect::<String>()
                )))
            }
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| {
                    field("`tool_choice` must be {\"type\": \"function\", \"function\": {\"name\": ..}}".into())
                })?;
            ToolChoice::Named(name.to_string())
        }
        Some(other) => {
            return Err(field(format!(
                "`tool_choice` must be a string or an object. Given: {}",
                type_name(other)
            )))
        }
    };
    match &c {
        ToolChoice::Required if tools.is_empty() => Err(field(
            "`tool_choice: \"required\"` needs at least one entry in `tools`".into(),
        )),
        ToolChoice::Named(n) if !tools.iter().any(|t| &t.name == n) => Err(field(format!(
            "`tool_choice` names function {}, which is not in `tools`",
            n.chars().take(64).collect::<String>()
        ))),
        _ => Ok(c),
    }
}

/// Reads `tools` and `tool_choice` (and checks `parallel_tool_calls` is a boolean).
/// `None` when there are no tools, or `tool_choice` is `"none"`: the request is then
/// served as plain text.
///
/// Errors: a 400 naming `tools` or `tool_choice` for a wrong type, more than
/// [`MAX_TOOLS`] tools, a bad or repeated name, or a choice that names no tool.
pub fn parse(o: &Map<String, Value>, openai: bool) -> Result<Option<Tools>, ApiError> {
    let tools = match o.get("tools") {
        None | Some(Value::Null) => vec![],
        Some(Value::Array(items)) => {
            if items.len() > MAX_TOOLS {
                return Err(ApiError::field(
                    "tools",
                    format!(
                        "`tools` may list at most {MAX_TOOLS} functions. Given: {}",
                        items.len()
                    ),
                ));
            }
            let mut out: Vec<Tool> = Vec::with_capacity(items.len());
            for (i, v) in items.iter().enumerate() {
                let t = tool(i, v, openai)?;
                if out.iter().any(|u| u.name == t.name) {
                    return Err(ApiError::field(
                        "tools",
                        format!("`tools[{i}].name` repeats function {}", t.name),
                    ));
                }
                out.push(t);
            }
            out
        }
        Some(other) => {
            return Err(ApiError::field(
                "tools",
                format!("`tools` must be an array. Given: {}", type_name(other)),
            ))
        }
    };
    match o.get("parallel_tool_calls") {
        None | Some(Value::Null | Value::Bool(_)) => {}
        Some(_) => {
            return Err(ApiError::field(
                "parallel_tool_calls",
                "`parallel_tool_calls` must be a boolean",
            ))
        }
    }
    let choice = choice(o.get("tool_choice"), &tools)?;
    if tools.is_empty() || choice == ToolChoice::None {
        return Ok(None);
    }
    Ok(Some(Tools { tools, choice }))
}

impl Tools {
    /// The fallback system text that shows the tools to the model.
    fn system_text(&self) -> String {
        let mut s = String::from(
            "You can call functions to help with the user's request. The functions \
             you may call are listed as JSON inside <tools></tools>:\n<tools>\n",
        );
        for t in &self.tools {
            let mut f = json!({"name": t.name});
            if let Some(d) = &t.description {
                f["description"] = json!(d);
            }
            f["parameters"] = t.parameters.clone();
            s.push_str(&json!({"type": "function", "function": f}).to_string());
            s.push('\n');
        }
        s.push_str(
            "</tools>\nTo call a function, answer with a JSON object holding its name \
             and arguments inside <tool_call></tool_call> tags:\n<tool_call>\n\
             {\"name\": \"<function name>\", \"arguments\": {<arguments>}}\n</tool_call>",
        );
        if let ToolChoice::Named(n) = &self.choice {
            s.push_str(&format!("\nCall the function {n} now."));
        }
        s
    }

    /// `messages` with the tools shown: appended to the first message when it is a
    /// system message, else as a new system message before the others.
    pub fn show(&self, mut messages: Vec<ChatMessage>) -> Vec<ChatMessage> {
        let text = self.system_text();
        match messages.first_mut() {
            Some(m) if m.role == "system" => {
                m.content = format!("{}\n\n{text}", m.content);
            }
            _ => messages.insert(0, ChatMessage::new("system", text)),
        }
        messages
    }

    /// For `required` and a named function: the grammar the output must follow, one
    /// object `{"name": N, "arguments": A}` (an `anyOf` over the allowed functions);
    /// `None` for `auto`.
    pub fn format(&self) -> Option<ResponseFormat> {
        let call = |t: &Tool| {
            json!({
                "type": "object",
                "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"],
                "additionalProperties": false,
            })
        };
        let schema = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Required if self.tools.len() == 1 => call(&self.tools[0]),
            ToolChoice::Required => {
                json!({"anyOf": self.tools.iter().map(call).collect::<Vec<_>>()})
            }
            ToolChoice::Named(n) => call(self.tools.iter().find(|t| &t.name == n)?),
        };
        Some(ResponseFormat::JsonSchema { schema })
    }

    /// The scanner for this request's output.
    pub fn scanner(&self) -> CallScanner {
        CallScanner {
            names: self.tools.iter().map(|t| t.name.clone()).collect(),
            whole: !matches!(self.choice, ToolChoice::Auto),
            buf: String::new(),
            in_call: false,
            calls: vec![],
        }
    }
}

/// The text of a history message: for an assistant turn with `tool_calls`, its
/// text followed by each call as the model writes one; for a `tool` turn, its
/// content inside `<tool_response>` tags. Accepts OpenAI's call shape
/// `{"id", "type": "function", "function": {"name", "arguments": "<JSON text>"}}`
/// and Workers AI's `{"name", "arguments": {..}}`.
///
/// Errors: a 400 naming `messages` when `tool_calls` is not an array of calls.
pub fn history_text(
    i: usize,
    role: &str,
    content: Option<String>,
    m: &Value,
) -> Result<String, ApiError> {
    let field = |msg: String| ApiError::field("messages", msg);
    match (role, m.get("tool_calls")) {
        ("assistant", Some(Value::Array(calls))) => {
            let mut s = content.unwrap_or_default();
            for (j, c) in calls.iter().enumerate() {
                let f = c.get("function").unwrap_or(c);
                let name = f
                    .get("name")
                    .and_then(Value::as_str)
                    .filter(|n| valid_name(n))
                    .ok_or_else(|| {
                        field(format!(
                            "`messages[{i}].tool_calls[{j}]` needs a function `name`"
                        ))
                    })?;
                let arguments = match f.get("arguments") {
                    None | Some(Value::Null) => json!({}),
                    // OpenAI sends the arguments as JSON text; kept as written when
                    // they do not parse.
                    Some(Value::String(a)) => {
                        serde_json::from_str(a).unwrap_or_else(|_| Value::String(a.clone()))
                    }
                    Some(a) => a.clone(),
                };
                if !s.is_empty() {
                    s.push('\n');
                }
                let call = json!({"name": name, "arguments": arguments});
                s.push_str(&format!("{OPEN}\n{call}\n{CLOSE}"));
            }
            Ok(s)
        }
        ("assistant", Some(Value::Null) | None) | (_, None | Some(Value::Null)) => {
            let content = content
                .ok_or_else(|| field(format!("`messages[{i}].content` must be a string")))?;
            Ok(if role == "tool" {
                format!("<tool_response>\n{content}\n</tool_response>")
            } else {
                content
            })
        }
        ("assistant", Some(other)) => Err(field(format!(
            "`messages[{i}].tool_calls` must be an array. Given: {}",
            type_name(other)
        ))),
        (_, Some(_)) => Err(field(format!(
            "`messages[{i}].tool_calls` is only allowed on assistant messages"
        ))),
    }
}

/// Splits a request's output into text and tool calls as it streams.
///
/// `auto`: text outside `<tool_call>` blocks passes through as soon as it cannot be
/// the start of an opening tag; a block is held until it closes (or the output
/// ends) and becomes a call when its JSON is `{"name": <a listed function>,
/// "arguments": <object or JSON text of one>}`, else it is given back as text.
/// `required` / named: the whole output is held and is one call when it parses
/// (the grammar makes it one unless `max_tokens` cut it off).
#[derive(Debug)]
pub struct CallScanner {
    names: Vec<String>,
    whole: bool,
    buf: String,
    in_call: bool,
    calls: Vec<ToolCall>,
}

impl CallScanner {
    /// Takes newly generated text; returns the text that may be shown now.
    pub fn push(&mut self, text: &str) -> String {
        self.buf.push_str(text);
        if self.whole {
            return String::new();
        }
        let mut out = String::new();
        loop {
            if self.in_call {
                let Some(end) = self.buf.find(CLOSE) else {
                    return out;
                };
                let body: String = self.buf[..end].to_string();
                self.buf.drain(..end + CLOSE.len());
                self.in_call = false;
                match self.call(&body) {
                    Some(c) => self.calls.push(c),
                    None => {
                        out.push_str(OPEN);
                        out.push_str(&body);
                        out.push_str(CLOSE);
                    }
                }
            } else if let Some(at) = self.buf.find(OPEN) {
                out.push_str(&self.buf[..at]);
                self.buf.drain(..at + OPEN.len());
                self.in_call = true;
            } else {
                // Hold back a tail that may be the start of an opening tag.
                let keep = (1..OPEN.len())
                    .rev()
                    .find(|&k| self.buf.ends_with(&OPEN[..k]))
                    .unwrap_or(0);
                let cut = self.buf.len() - keep;
                out.push_str(&self.buf[..cut]);
                self.buf.drain(..cut);
                return out;
            }
        }
    }

    /// Ends the output: the text still held that is not a call, and every call.
    pub fn finish(mut self) -> (String, Vec<ToolCall>) {
        let rest = std::mem::take(&mut self.buf);
        let tail = if self.whole {
            match self.call(&rest) {
                Some(c) => {
                    self.calls.push(c);
                    String::new()
                }
                None => rest,
            }
        } else if self.in_call {
            // Stopped (end of sequence) before the closing tag.
            match self.call(&rest) {
                Some(c) => {
                    self.calls.push(c);
                    String::new()
                }
                None => format!("{OPEN}{rest}"),
            }
        } else {
            rest
        };
        (tail, self.calls)
    }

    fn call(&self, body: &str) -> Option<ToolCall> {
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        let name = v.get("name")?.as_str()?;
        if !self.names.iter().any(|n| n == name) {
            return None;
        }
        let arguments = match v.get("arguments").or_else(|| v.get("parameters"))? {
            a @ Value::Object(_) => a.clone(),
            Value::String(s) => serde_json::from_str::<Value>(s)
                .ok()
                .filter(Value::is_object)?,
            _ => return None,
        };
        Some(ToolCall {
            name: name.to_string(),
            arguments,
        })
    }
}

/// A call's id in OpenAI's shape: the request id and the call's index.
pub fn call_id(rid: &str, index: usize) -> String {
    format!("call_{rid}_{index}")
}

/// OpenAI's `tool_calls` entries (non-streaming message, or with `index` for a
/// streamed delta); `arguments` is JSON text.
pub fn openai_calls(rid: &str, calls: &[ToolCall], stream: bool) -> Value {
    calls
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let mut v = json!({
                "id": call_id(rid, i),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments.to_string()},
            });
            if stream {
                v["index"] = json!(i);
            }
            v
        })
        .collect()
}

/// Workers AI's `tool_calls`: `[{"name", "arguments": {..}}]`.
pub fn workers_ai_calls(calls: &[ToolCall]) -> Value {
    calls
        .iter()
        .map(|c| json!({"name": c.name, "arguments": c.arguments}))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn weather() -> Value {
        json!({"type": "function", "function": {"name": "get_weather", "description": "Weather now",
               "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                              "required": ["city"]}}})
    }

    #[test]
    fn parses_both_shapes_and_refuses_bad_lists_naming_the_field() {
        let t = parse(&obj(json!({"tools": [weather()]})), true)
            .unwrap()
            .unwrap();
        assert_eq!(t.choice, ToolChoice::Auto);
        assert_eq!(t.tools[0].name, "get_weather");
        // Workers AI: the function object itself.
        let bare = json!({"tools": [{"name": "sum", "description": "adds",
                                      "parameters": {"type": "object"}}]});
        assert_eq!(
            parse(&obj(bare.clone()), false).unwrap().unwrap().tools[0].name,
            "sum"
        );
        assert_eq!(
            parse(&obj(bare), true).unwrap_err().param.as_deref(),
            Some("tools")
        );
        // none, or no tools: plain text.
        assert!(parse(
            &obj(json!({"tools": [weather()], "tool_choice": "none"})),
            true
        )
        .unwrap()
        .is_none());
        assert!(parse(&obj(json!({"tool_choice": "auto"})), true)
            .unwrap()
            .is_none());
        let named = json!({"tools": [weather()],
                           "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
        assert_eq!(
            parse(&obj(named), true).unwrap().unwrap().choice,
            ToolChoice::Named("get_weather".into())
        );
        for (body, param) in [
            (json!({"tools": {}}), "tools"),
            (json!({"tools": [1]}), "tools"),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
                "tools",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": ""}}]}),
                "tools",
            ),
            (
                json!({"tools": [{"type": "other", "function": {"name": "a"}}]}),
                "tools",
            ),
            (
                json!({"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]}),
                "tools",
            ),
            (json!({"tools": [weather(), weather()]}), "tools"),
            (json!({"tools": vec![weather(); MAX_TOOLS + 1]}), "tools"),
            (
                json!({"tools": [weather()], "tool_choice": "always"}),
                "tool_choice",
            ),
            (
                json!({"tools": [weather()], "tool_choice": 3}),
                "tool_choice",
            ),
            (json!({"tool_choice": "required"}), "tool_choice"),
            (
                json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
                "tool_choice",
            ),
            (
                json!({"tools": [weather()], "parallel_tool_calls": "yes"}),
                "parallel_tool_calls",
            ),
        ] {
            let e = parse(&obj(body.clone()), true).unwrap_err();
            assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn tools_are_shown_in_the_system_message_and_enforced_only_when_required() {
        let t = parse(&obj(json!({"tools": [weather()]})), true)
            .unwrap()
            .unwrap();
        let m = t.show(vec![ChatMessage::new("user", "hi")]);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].role, "system");
        assert!(
            m[0].content.contains("\"name\":\"get_weather\""),
            "{}",
            m[0].content
        );
        let m = t.show(vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "hi"),
        ]);
        assert_eq!(m.len(), 2);
        assert!(
            m[0].content.starts_with("Be brief.\n\n<")
                || m[0].content.starts_with("Be brief.\n\nYou")
        );
        assert!(t.format().is_none());
        let r = parse(
            &obj(json!({"tools": [weather()], "tool_choice": "required"})),
            true,
        )
        .unwrap()
        .unwrap();
        let Some(ResponseFormat::JsonSchema { schema }) = r.format() else {
            panic!("required has a schema")
        };
        assert_eq!(schema["properties"]["name"]["const"], "get_weather");
        assert_eq!(schema["properties"]["arguments"]["required"][0], "city");
    }

    #[test]
    fn history_renders_calls_and_responses() {
        let m = json!({"role": "assistant", "content": null, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]});
        let s = history_text(1, "assistant", None, &m).unwrap();
        assert_eq!(s, "<tool_call>\n{\"name\":\"get_weather\",\"arguments\":{\"city\":\"Oslo\"}}\n</tool_call>");
        let s = history_text(2, "tool", Some("12 C".into()), &json!({"role": "tool"})).unwrap();
        assert_eq!(s, "<tool_response>\n12 C\n</tool_response>");
        for bad in [
            json!({"role": "assistant", "tool_calls": {}}),
            json!({"role": "assistant", "tool_calls": [{"function": {}}]}),
        ] {
            let e = history_text(0, "assistant", None, &bad).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("messages"));
        }
        let e = history_text(0, "user", Some("x".into()), &json!({"tool_calls": []})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
        assert!(history_text(0, "user", None, &json!({})).is_err());
    }

    fn scan(t: &Tools, pieces: &[&str]) -> (String, Vec<ToolCall>) {
        let mut s = t.scanner();
        let mut shown: String = pieces.iter().map(|p| s.push(p)).collect();
        let (tail, calls) = s.finish();
        shown.push_str(&tail);
        (shown, calls)
    }

    #[test]
    fn the_scanner_finds_calls_across_pieces_and_gives_back_everything_else() {
        let t = parse(&obj(json!({"tools": [weather()]})), true)
            .unwrap()
            .unwrap();
        // A call split at every boundary, with text around it.
        let out = "Let me check. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call> ok";
        for split in 0..out.len() {
            if !out.is_char_boundary(split) {
                continue;
            }
            let (text, calls) = scan(&t, &[&out[..split], &out[split..]]);
            assert_eq!(text, "Let me check.  ok", "split at {split}");
            assert_eq!(calls.len(), 1);
            assert_eq!(calls[0].arguments, json!({"city": "Oslo"}));
        }
        // Text is not held back longer than a possible tag start.
        let mut s = t.scanner();
        assert_eq!(s.push("a <tool"), "a ");
        assert_eq!(s.push("box>"), "<toolbox>");
        // Unclosed at the end, arguments as JSON text: still a call.
        let (text, calls) = scan(&t, &["<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}"]);
        assert_eq!(
            (text.as_str(), calls[0].arguments.clone()),
            ("", json!({"city": "Rome"}))
        );
        // Unknown function, bad JSON, arguments not an object: text.
        for body in [
            "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>",
            "<tool_call>{\"name\": \"get_weather\", </tool_call>",
            "<tool_call>{\"name\": \"get_weather\", \"arguments\": 3}</tool_call>",
            "<tool_call>{\"name\": \"get_weather\"",
        ] {
            let (text, calls) = scan(&t, &[body]);
            assert!(calls.is_empty(), "{body}");
            assert_eq!(text, body);
        }
        // Required: the whole output is the call.
        let r = Tools {
            choice: ToolChoice::Required,
            ..t.clone()
        };
        let (text, calls) = scan(
            &r,
            &[
                "{\"name\": \"get_weather\", ",
                "\"arguments\": {\"city\": \"X\"}}",
            ],
        );
        assert_eq!((text.as_str(), calls.len()), ("", 1));
        let (text, calls) = scan(&r, &["{\"name\": \"get_weather\", \"argu"]);
        assert_eq!(
            (text.as_str(), calls.len()),
            ("{\"name\": \"get_weather\", \"argu", 0)
        );
    }

    #[test]
    fn call_shapes() {
        let calls = vec![ToolCall {
            name: "f".into(),
            arguments: json!({"a": 1}),
        }];
        let o = openai_calls("r1", &calls, false);
        assert_eq!(o[0]["id"], "call_r1_0");
        assert_eq!(o[0]["function"]["arguments"], "{\"a\":1}");
        assert!(o[0].get("index").is_none());
        assert_eq!(openai_calls("r1", &calls, true)[0]["index"], 0);
        assert_eq!(
            workers_ai_calls(&calls),
            json!([{"name": "f", "arguments": {"a": 1}}])
        );
    }
}
