//! Function calling: OpenAI `tools` / `tool_choice` and Workers AI `tools`.
//!
//! How a tool list reaches the model: a chat template that renders tools itself
//! (it reads the variable `tools`, as Qwen2.5's ChatML does:
//! [`ChatTemplate::supports_tools`](tessera_model::chat::ChatTemplate::supports_tools))
//! gets them as [`Tools::template_json`], OpenAI's tool objects, the way Hugging
//! Face's `apply_chat_template(tools=...)` passes them; its `tojson` output is
//! caller data, never control tokens. A template without (the default model's)
//! gets a fallback, a system message in the Hermes style that instruction-tuned
//! models know (function signatures as JSON inside `<tools></tools>`, calls answered
//! as `<tool_call>{"name": .., "arguments": ..}</tool_call>`), a message content, so
//! tokenized as plain text like every other content. A model without a chat
//! template (a base model) cannot be shown tools: a 400 naming `tools`.
//!
//! History: an assistant turn that made calls becomes its text followed by each
//! call as the model writes one (`<tool_call>\n{"name": "f", "arguments": {..}}\n
//! </tool_call>`, JSON as Python writes it, as Qwen2.5's template renders calls); a
//! `tool` turn keeps its content for a template that renders tools (Qwen2.5 puts it
//! in `<tool_response>` tags in a user turn itself) and is put in `<tool_response>`
//! tags for the fallback ([`tool_responses_as_text`]), so a conversation
//! round-trips either way.
//!
//! What comes back:
//! - `tool_choice: "none"`: the tools are not shown to the model; plain text.
//! - `"auto"` (the default with tools): free text; every `<tool_call>` block (Qwen2.5's
//!   native format, `<tool_call>\n{"name": .., "arguments": {..}}\n</tool_call>`) whose
//!   JSON names a listed function with an object of arguments becomes a tool call
//!   ([`CallScanner`]), and so does an output that is nothing but such JSON calls,
//!   bare or in a code fence (as small models write them); the rest stays text. Arguments are whatever the model wrote
//!   (not schema-checked), as with OpenAI's non-strict functions.
//! - `"required"` or a named function: the output is constrained by grammar
//!   (request validation sets a `response_format`) to one JSON object
//!   `{"name": N, "arguments": A}` where A satisfies N's `parameters` schema, so the
//!   call parses and validates unless `max_tokens` cuts it off (then it is text with
//!   `finish_reason: "length"`).

use crate::error::{type_name, ApiError};
use serde_json::{json, Map, Value};
use tessera_model::chat::{python_json, ChatMessage};
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
    /// The tools as a chat template that renders them gets them: OpenAI's tool
    /// objects, `[{"type": "function", "function": {"name", "description"?,
    /// "parameters"}}]`, keys in that order.
    pub fn template_json(&self) -> Value {
        self.tools
            .iter()
            .map(|t| {
                let mut f = Map::new();
                f.insert("name".into(), json!(t.name));
                if let Some(d) = &t.description {
                    f.insert("description".into(), json!(d));
                }
                f.insert("parameters".into(), t.parameters.clone());
                let mut o = Map::new();
                o.insert("type".into(), json!("function"));
                o.insert("function".into(), Value::Object(f));
                Value::Object(o)
            })
            .collect()
    }

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
            lead: Lead::Undecided,
            calls: vec![],
        }
    }
}

/// The text of a history message: for an assistant turn with `tool_calls`, its
/// text followed by each call as the model writes one; any other turn (`tool`
/// included: see [`tool_responses_as_text`]), its content. Accepts OpenAI's call shape
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
                let call = python_json(&json!({"name": name, "arguments": arguments}));
                s.push_str(&format!("{OPEN}\n{call}\n{CLOSE}"));
            }
            Ok(s)
        }
        ("assistant", Some(Value::Null) | None) | (_, None | Some(Value::Null)) => {
            content.ok_or_else(|| field(format!("`messages[{i}].content` must be a string")))
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

/// `messages` for a chat template that does not render tools: each `tool` turn's
/// content inside `<tool_response>` tags, as the fallback's instructions describe
/// answers (a template that renders tools wraps them itself).
pub fn tool_responses_as_text(mut messages: Vec<ChatMessage>) -> Vec<ChatMessage> {
    for m in messages.iter_mut().filter(|m| m.role == "tool") {
        m.content = format!("<tool_response>\n{}\n</tool_response>", m.content);
    }
    messages
}

/// Splits a request's output into text and tool calls as it streams.
///
/// `auto`: text outside `<tool_call>` blocks passes through as soon as it cannot be
/// the start of an opening tag; a block is held until it closes (or the output
/// ends) and becomes a call when its JSON is `{"name": <a listed function>,
/// "arguments": <object or JSON text of one>}`, else it is given back as text.
/// An output that starts (after whitespace) with `{`, or with a code fence whose
/// language is `json`, `xml` or none, is held to its end: when it is nothing but
/// such calls (one or more JSON objects, in the fence or bare) they are calls,
/// else it is scanned as above. Small models answer so (Qwen2.5-Coder 0.5B
/// writes `{"name": "get_weather", "arguments": {"city": "Paris"}}` without the
/// tags its template asks for), and llama.cpp's parser of this format (Hermes 2
/// Pro, used for Qwen2.5: `common_chat_parse_hermes_2_pro` in its
/// `common/chat.cpp`) takes them too.
/// `required` / named: the whole output is held and is one call when it parses
/// (the grammar makes it one unless `max_tokens` cut it off).
#[derive(Debug)]
pub struct CallScanner {
    names: Vec<String>,
    whole: bool,
    buf: String,
    in_call: bool,
    lead: Lead,
    calls: Vec<ToolCall>,
}

/// How an `auto` output begins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Lead {
    /// Only whitespace so far, or the start of a code fence.
    Undecided,
    /// A JSON object or a JSON code fence: held to the end.
    Bare,
    /// Anything else: text and `<tool_call>` blocks.
    Tagged,
}

/// The code fence that opens a block (three backticks).
const FENCE: &str = "```";

impl CallScanner {
    /// Takes newly generated text; returns the text that may be shown now.
    pub fn push(&mut self, text: &str) -> String {
        self.buf.push_str(text);
        if self.whole {
            return String::new();
        }
        if self.lead == Lead::Undecided {
            self.lead = lead(&self.buf);
        }
        if self.lead != Lead::Tagged {
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
        if !self.whole && self.lead != Lead::Tagged {
            if let Some(calls) = self.bare_calls(&self.buf) {
                self.calls.extend(calls);
                return (String::new(), self.calls);
            }
            // Not only calls: the text as any other, `<tool_call>` blocks and all.
            self.lead = Lead::Tagged;
            let held = std::mem::take(&mut self.buf);
            let mut shown = self.push(&held);
            let (tail, calls) = self.finish();
            shown.push_str(&tail);
            return (shown, calls);
        }
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

    /// The calls `text` consists of: one or more JSON calls separated by
    /// whitespace, bare or inside one code fence; `None` when it holds anything
    /// else (or nothing).
    fn bare_calls(&self, text: &str) -> Option<Vec<ToolCall>> {
        let mut body = text.trim();
        if let Some(fenced) = body.strip_prefix(FENCE) {
            // The language line, then the body up to the closing fence (absent
            // when the output ended first).
            let (_, rest) = fenced.split_once('\n')?;
            body = rest.trim_end();
            body = body.strip_suffix(FENCE).unwrap_or(body).trim();
        }
        let calls = serde_json::Deserializer::from_str(body)
            .into_iter::<Value>()
            .map(|v| v.ok().and_then(|v| self.call_value(&v)))
            .collect::<Option<Vec<ToolCall>>>()?;
        (!calls.is_empty()).then_some(calls)
    }

    fn call(&self, body: &str) -> Option<ToolCall> {
        let v: Value = serde_json::from_str(body.trim()).ok()?;
        self.call_value(&v)
    }

    fn call_value(&self, v: &Value) -> Option<ToolCall> {
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

/// How an `auto` output that begins with `text` is scanned, as far as `text`
/// tells: a JSON object, or a code fence of JSON, XML or no language, is held to
/// the end ([`Lead::Bare`]); whitespace and a fence whose language line is not
/// complete yet decide nothing.
fn lead(text: &str) -> Lead {
    let t = text.trim_start();
    if t.is_empty() {
        return Lead::Undecided;
    }
    if t.starts_with('{') {
        return Lead::Bare;
    }
    if t.len() < FENCE.len() {
        return match FENCE.starts_with(t) {
            true => Lead::Undecided,
            false => Lead::Tagged,
        };
    }
    let Some(rest) = t.strip_prefix(FENCE) else {
        return Lead::Tagged;
    };
    match rest.split_once('\n') {
        Some((lang, _)) if matches!(lang.trim(), "" | "json" | "xml") => Lead::Bare,
        Some(_) => Lead::Tagged,
        // The language line is still coming: a short one may still be `json`.
        None if rest.len() <= 8 => Lead::Undecided,
        None => Lead::Tagged,
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
pub(crate) mod tests;
