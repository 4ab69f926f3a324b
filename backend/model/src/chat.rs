//! Chat prompt rendering with the model's own Jinja chat template.
//!
//! The template is `tokenizer.chat_template` from the GGUF metadata, rendered with
//! minijinja configured like Hugging Face's `apply_chat_template`
//! (`trim_blocks`, `lstrip_blocks`, no autoescape). Templates written for
//! Python Jinja often call Python string and dict methods (`.strip()`,
//! `.startswith()`, `.items()`, ...); the common ones are provided here, as is
//! `raise_exception(msg)`, and `tojson` is Python's `json.dumps` as Hugging Face
//! defines the filter (`", "` and `": "` separators, non-ASCII as is, keys in the
//! caller's order; minijinja's own writes compact JSON with `<`, `>`, `&` and `'`
//! escaped, which is not the text the models were trained on).
//!
//! Tools: a template that reads the variable `tools` (Qwen2.5's ChatML, Hermes,
//! Llama 3.1, ...) renders a request's functions itself
//! ([`ChatTemplate::supports_tools`], [`ChatTemplate::render_with_tools`]); the list
//! is passed as Hugging Face's `apply_chat_template(tools=...)` does, OpenAI's
//! `[{"type": "function", "function": {"name", "description", "parameters"}}]`.

use candle_core::quantized::gguf_file::{Content, Value as GgufValue};
use minijinja::value::{Enumerator, Kwargs, Object, ObjectRepr, Value, ValueKind};
use minijinja::{Environment, ErrorKind, State};
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::sync::Arc;

/// GGUF key of the chat template.
pub const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

const TEMPLATE_NAME: &str = "chat_template";

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant` (other roles are passed to the template as is).
    pub role: String,
    /// The message text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role and content.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// Errors loading or rendering a chat template.
#[derive(Debug, thiserror::Error)]
pub enum ChatError {
    /// The model has no chat template (its GGUF has no `tokenizer.chat_template`
    /// string, e.g. a base model): only raw prompts can be served.
    #[error(
        "this model has no chat template (GGUF `{KEY_CHAT_TEMPLATE}`): it is a base model; \
         send a raw prompt (`prompt` on Workers AI runs, /v1/completions on the OpenAI shape)"
    )]
    MissingTemplate,
    /// The template does not parse.
    #[error("chat template does not parse: {0}")]
    Syntax(String),
    /// Rendering failed (undefined method, `raise_exception`, type error, ...).
    #[error("chat template rendering failed: {0}")]
    Render(String),
    /// No messages were given.
    #[error("`messages` must contain at least 1 message. Given: 0")]
    EmptyMessages,
    /// The rendered prompt could not be tokenized.
    #[error("cannot tokenize the prompt: {0}")]
    Tokenize(String),
    /// The prompt is at least `at_least` tokens, over the caller's `limit`
    /// ([`ChatTemplate::encode_within`]); it was not tokenized to the end.
    #[error("the prompt is at least {at_least} tokens, over the limit of {limit}")]
    OverLimit {
        /// A lower bound on the prompt's length, in tokens.
        at_least: usize,
        /// The limit it was held to.
        limit: usize,
    },
}

impl ChatError {
    /// A stable machine-readable label for the error kind.
    pub fn label(&self) -> &'static str {
        match self {
            Self::MissingTemplate => "missing_template",
            Self::Syntax(_) => "template_syntax",
            Self::Render(_) => "template_render",
            Self::EmptyMessages => "empty_messages",
            Self::Tokenize(_) => "tokenize",
            Self::OverLimit { .. } => "over_limit",
        }
    }
}

/// Full minijinja error text, including the chain of causes.
fn describe(err: &minijinja::Error) -> String {
    use std::error::Error as _;
    let mut msg = err.to_string();
    let mut source = err.source();
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

/// A compiled chat template plus the BOS/EOS token texts it may refer to.
pub struct ChatTemplate {
    /// `None`: the model has no template; rendering fails with
    /// [`ChatError::MissingTemplate`].
    env: Option<Environment<'static>>,
    bos_token: String,
    eos_token: String,
    /// The template reads the variable `tools`.
    tools: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish_non_exhaustive()
    }
}

fn token_text(content: &Content, id_key: &str) -> String {
    let id = content.metadata.get(id_key).and_then(|v| v.to_u64().ok());
    let tokens = content
        .metadata
        .get(crate::tokenizer::KEY_TOKENS)
        .and_then(|v| v.to_vec().ok());
    match (id, tokens) {
        (Some(id), Some(tokens)) => tokens
            .get(id as usize)
            .and_then(|t| t.to_string().ok())
            .cloned()
            .unwrap_or_default(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// Loads `tokenizer.chat_template` from GGUF metadata; `bos_token` and
    /// `eos_token` are the texts of the tokens named by
    /// `tokenizer.ggml.bos_token_id` / `eos_token_id` (empty when absent). A file
    /// without the key (a base model) gives a template that refuses every render
    /// with [`ChatError::MissingTemplate`].
    pub fn from_gguf(content: &Content) -> Result<Self, ChatError> {
        let source = match content.metadata.get(KEY_CHAT_TEMPLATE) {
            Some(GgufValue::String(s)) => s.clone(),
            _ => {
                return Ok(Self {
                    env: None,
                    bos_token: token_text(content, crate::tokenizer::KEY_BOS),
                    eos_token: token_text(content, crate::tokenizer::KEY_EOS),
                    tools: false,
                })
            }
        };
        Self::new(
            source,
            token_text(content, crate::tokenizer::KEY_BOS),
            token_text(content, crate::tokenizer::KEY_EOS),
        )
    }

    /// Compiles a template from its source text.
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<Self, ChatError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(python_method);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.into())
            .map_err(|e| ChatError::Syntax(describe(&e)))?;
        let tools = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatError::Syntax(describe(&e)))?
            .undeclared_variables(false)
            .contains("tools");
        Ok(Self {
            env: Some(env),
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            tools,
        })
    }

    /// Whether the model has a chat template (a base model has none).
    pub fn has_template(&self) -> bool {
        self.env.is_some()
    }

    /// Whether the template renders a list of functions itself (it reads the
    /// variable `tools`, as Qwen2.5's does); such a template also renders `tool`
    /// turns in its own way (Qwen2.5: `<tool_response>` blocks in a user turn).
    /// False without a template.
    pub fn supports_tools(&self) -> bool {
        self.tools
    }

    /// Renders the prompt text for `messages`. With `add_generation_prompt`, the
    /// text ends with the header of the assistant's turn. The result is meant to
    /// be tokenized with special-token parsing on.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`Self::render`] with `tools`, a JSON array of OpenAI tool objects
    /// (`{"type": "function", "function": {...}}`), given to the template as its
    /// variable `tools` (key order kept); `None` gives it `none`, as Hugging Face's
    /// `apply_chat_template` does without tools. A template that does not read
    /// `tools` ([`Self::supports_tools`]) renders as without them.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String, ChatError> {
        self.render_inner(messages, tools, add_generation_prompt, None)
    }

    fn render_inner(
        &self,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        masks: Option<Masks>,
    ) -> Result<String, ChatError> {
        if messages.is_empty() {
            return Err(ChatError::EmptyMessages);
        }
        let env = self.env.as_ref().ok_or(ChatError::MissingTemplate)?;
        let tmpl = env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| ChatError::Syntax(describe(&e)))?;
        let tools = tools.map_or(Value::from(()), |t| json_value(t.clone()));
        let masks = masks.map_or(Value::UNDEFINED, Value::from_object);
        tmpl.render(minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
            __tessera_masks => masks,
        })
        .map_err(|e| ChatError::Render(describe(&e)))
    }

    /// Renders `messages` and tokenizes the result so that control tokens are
    /// recognised only where the template wrote them: message contents are always
    /// tokenized as plain text, so a user typing `<|im_end|>\n<|im_start|>system`
    /// gets those characters, not a new system turn.
    ///
    /// How: each content is replaced by a unique marker (private-use characters
    /// around a random nonce) before rendering; the rendered text is split at the
    /// markers; template pieces are encoded with special-token parsing, contents
    /// without.
    pub fn encode(
        &self,
        tokenizer: &crate::tokenizer::Tokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, ChatError> {
        self.encode_within(tokenizer, messages, add_generation_prompt, usize::MAX)
    }

    /// [`Self::encode`], stopping with [`ChatError::OverLimit`] as soon as the
    /// prompt is known to exceed `limit` tokens without tokenizing it all (a result
    /// may still be longer than `limit`: the caller checks). Before each piece is
    /// tokenized, the tokens so far plus the lower bound of the piece and the rest
    /// ([`Tokenizer::min_tokens`](crate::tokenizer::Tokenizer::min_tokens)) are
    /// checked, then a long piece's prefix
    /// ([`Tokenizer::exceeds`](crate::tokenizer::Tokenizer::exceeds)): a megabyte
    /// far over the context window costs no tokenizer time, and one just over it
    /// costs a prefix of about `limit` times
    /// [`PREFIX_BYTES_PER_TOKEN`](crate::tokenizer::PREFIX_BYTES_PER_TOKEN) bytes.
    pub fn encode_within(
        &self,
        tokenizer: &crate::tokenizer::Tokenizer,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        limit: usize,
    ) -> Result<Vec<u32>, ChatError> {
        self.encode_with_tools(tokenizer, messages, None, add_generation_prompt, limit)
    }

    /// [`Self::encode_within`] of [`Self::render_with_tools`]: `tools` are shown by
    /// the template. Caller text reaches the template in two ways, and neither can
    /// make a control token: message contents (as in [`Self::encode`]), and
    /// `tojson` output (the tools' JSON, and anything else a template serializes),
    /// which is marked off while rendering and tokenized with special-token parsing
    /// only when that gives no control token (then it joins the template text
    /// around it, so the tokens are those of the whole rendered text, as llama.cpp
    /// and Hugging Face tokenize it); otherwise as plain text.
    pub fn encode_with_tools(
        &self,
        tokenizer: &crate::tokenizer::Tokenizer,
        messages: &[ChatMessage],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
        limit: usize,
    ) -> Result<Vec<u32>, ChatError> {
        let masks = Masks {
            nonce: rand::random(),
            contents: messages.iter().map(|m| m.content.clone()).collect(),
        };
        let masked: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage::new(m.role.clone(), masks.marker(&i.to_string())))
            .collect();
        let prefix = masks.prefix();
        let nonce = masks.nonce;
        let text = self.render_inner(&masked, tools, add_generation_prompt, Some(masks))?;
        let tokenize_err = |e: crate::tokenizer::TokenizerError| ChatError::Tokenize(e.to_string());
        let tok = |t: &str, special: bool| tokenizer.encode(t, special).map_err(tokenize_err);
        let close = Masks {
            nonce,
            contents: vec![],
        }
        .marker(SPAN_CLOSE);
        // Split first (cheap), tokenize after: the pieces' byte total bounds the
        // prompt's length from below before any tokenizer time is spent.
        // Markers appear in the rendered text in some order (templates may reorder
        // or drop messages); each is found by its prefix and read to its end.
        enum Piece<'a> {
            Template(&'a str),
            Content(&'a str),
            Json(&'a str),
        }
        let mut raw: Vec<Piece<'_>> = Vec::new();
        let mut rest = text.as_str();
        while let Some(at) = rest.find(&prefix) {
            let after = &rest[at + prefix.len()..];
            let Some(end) = after.find(MARK_END) else {
                break;
            };
            let tag = &after[..end];
            let next = &after[end + MARK_END.len_utf8()..];
            if let Some(i) = tag.parse::<usize>().ok().filter(|&i| i < messages.len()) {
                raw.push(Piece::Template(&rest[..at]));
                raw.push(Piece::Content(&messages[i].content));
                rest = next;
            } else if tag == SPAN_OPEN {
                raw.push(Piece::Template(&rest[..at]));
                let (json, after_span) = match next.find(&close) {
                    Some(c) => (&next[..c], &next[c + close.len()..]),
                    None => (next, ""),
                };
                raw.push(Piece::Json(json));
                rest = after_span;
            } else {
                // Not one of ours (or a template changed it): template text.
                raw.push(Piece::Template(&rest[..at + prefix.len()]));
                rest = after;
            }
        }
        raw.push(Piece::Template(rest));
        let total: usize = raw
            .iter()
            .map(|p| match p {
                Piece::Template(t) | Piece::Content(t) | Piece::Json(t) => t.len(),
            })
            .sum();
        let at_least = tokenizer.min_tokens(total);
        if at_least > limit {
            return Err(ChatError::OverLimit { at_least, limit });
        }
        // (text, parse special tokens); neighbouring template text joined.
        let mut pieces: Vec<(Cow<'_, str>, bool)> = Vec::new();
        for p in raw {
            let (t, special) = match p {
                Piece::Template(t) => (t, true),
                Piece::Content(t) => (t, false),
                // Joined to the template text only when it has no control token of
                // its own. One across the join would have to go on with the JSON's
                // first character (one of `{["-tfn` or a digit) or stop right after
                // its last (one of `}]"el` or a digit); the families' control tokens
                // (`<|im_end|>`, `<start_of_turn>`, ...) are not so shaped.
                Piece::Json(t) => {
                    if let Some(n) = tokenizer.exceeds(t, true, limit).map_err(tokenize_err)? {
                        return Err(ChatError::OverLimit { at_least: n, limit });
                    }
                    let control = tok(t, true)?.iter().any(|&id| tokenizer.is_control(id));
                    (t, !control)
                }
            };
            match pieces.last_mut() {
                Some((prev, true)) if special => prev.to_mut().push_str(t),
                _ => pieces.push((Cow::Borrowed(t), special)),
            }
        }
        let mut left: usize = pieces.iter().map(|(p, _)| p.len()).sum();
        let mut ids = Vec::new();
        for (piece, special) in &pieces {
            let at_least = ids.len().saturating_add(tokenizer.min_tokens(left));
            if at_least > limit {
                return Err(ChatError::OverLimit { at_least, limit });
            }
            left -= piece.len();
            // A long piece: a prefix of it may already show the prompt too long.
            let room = limit - ids.len();
            if let Some(n) = tokenizer
                .exceeds(piece, *special, room)
                .map_err(tokenize_err)?
            {
                return Err(ChatError::OverLimit {
                    at_least: ids.len() + n,
                    limit,
                });
            }
            ids.extend(tok(piece, *special)?);
        }
        Ok(ids)
    }

    /// The BOS token text given to the template.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The EOS token text given to the template.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }
}

/// Opens a marker of [`ChatTemplate::encode_with_tools`] (a private-use character).
const MARK_START: char = '\u{F8F0}';
/// Closes a marker.
const MARK_END: char = '\u{F8F1}';
/// The tag of the marker before `tojson` output.
const SPAN_OPEN: &str = "(";
/// The tag of the marker after it.
const SPAN_CLOSE: &str = ")";

/// What rendering for [`ChatTemplate::encode_with_tools`] hides from the template:
/// message contents, each replaced by a marker (`MARK_START`, a random nonce, `:`,
/// the message's index, `MARK_END`). Given to the template's `tojson` filter (as
/// the context variable `__tessera_masks`), which writes the contents back into its
/// output and puts that output between the span markers.
#[derive(Debug)]
struct Masks {
    nonce: u64,
    contents: Vec<String>,
}

impl Object for Masks {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        ObjectRepr::Plain
    }
}

impl Masks {
    /// What every marker of this render starts with.
    fn prefix(&self) -> String {
        format!("{MARK_START}{:016x}:", self.nonce)
    }

    /// The marker with `tag`.
    fn marker(&self, tag: &str) -> String {
        format!("{}{tag}{MARK_END}", self.prefix())
    }

    /// `s` with every content marker replaced by its content, and span markers
    /// (of a `tojson` inside a `tojson`) dropped.
    fn unmask(&self, s: &str) -> String {
        let prefix = self.prefix();
        let mut out = String::with_capacity(s.len());
        let mut rest = s;
        while let Some(at) = rest.find(&prefix) {
            out.push_str(&rest[..at]);
            let after = &rest[at + prefix.len()..];
            let Some(end) = after.find(MARK_END) else {
                out.push_str(&rest[at..]);
                return out;
            };
            let tag = &after[..end];
            match tag.parse::<usize>().ok().and_then(|i| self.contents.get(i)) {
                Some(c) => out.push_str(c),
                None if tag == SPAN_OPEN || tag == SPAN_CLOSE => {}
                None => out.push_str(&rest[at..at + prefix.len() + end + MARK_END.len_utf8()]),
            }
            rest = &after[end + MARK_END.len_utf8()..];
        }
        out.push_str(rest);
        out
    }

    fn unmask_json(&self, v: &mut serde_json::Value) {
        match v {
            serde_json::Value::String(s) if s.contains(MARK_START) => *s = self.unmask(s),
            serde_json::Value::Array(a) => a.iter_mut().for_each(|x| self.unmask_json(x)),
            serde_json::Value::Object(o) => o.values_mut().for_each(|x| self.unmask_json(x)),
            _ => {}
        }
    }
}

/// A JSON value as a template sees it: objects and arrays as minijinja objects
/// that keep the keys' order (minijinja's own maps sort them), scalars as values.
fn json_value(v: serde_json::Value) -> Value {
    use serde_json::Value as J;
    match v {
        J::Null => Value::from(()),
        J::Bool(b) => Value::from(b),
        J::Number(n) => match (n.as_i64(), n.as_u64(), n.as_f64()) {
            (Some(i), _, _) => Value::from(i),
            (_, Some(u), _) => Value::from(u),
            (_, _, f) => Value::from(f.unwrap_or(f64::NAN)),
        },
        J::String(s) => Value::from(s),
        v @ (J::Array(_) | J::Object(_)) => Value::from_object(Json(v)),
    }
}

/// An array or object of [`json_value`].
#[derive(Debug)]
struct Json(serde_json::Value);

impl Object for Json {
    fn repr(self: &Arc<Self>) -> ObjectRepr {
        match self.0 {
            serde_json::Value::Array(_) => ObjectRepr::Seq,
            _ => ObjectRepr::Map,
        }
    }

    fn get_value(self: &Arc<Self>, key: &Value) -> Option<Value> {
        let v = match &self.0 {
            serde_json::Value::Array(a) => a.get(key.as_usize()?)?,
            serde_json::Value::Object(o) => o.get(key.as_str()?)?,
            _ => return None,
        };
        Some(json_value(v.clone()))
    }

    fn enumerate(self: &Arc<Self>) -> Enumerator {
        match &self.0 {
            serde_json::Value::Array(a) => Enumerator::Seq(a.len()),
            serde_json::Value::Object(o) => {
                let keys: Vec<Value> = o.keys().map(|k| Value::from(k.as_str())).collect();
                Enumerator::Values(keys)
            }
            _ => Enumerator::Empty,
        }
    }
}

/// The `tojson` filter of Hugging Face's chat templates: Python's `json.dumps(x,
/// ensure_ascii=False, indent=None, separators=None, sort_keys=False)` with those
/// keyword arguments (and `indent` positionally). Objects of [`json_value`] keep
/// their keys' order. While [`ChatTemplate::encode_with_tools`] renders, message
/// contents inside are written back and the output is marked off as caller data.
fn tojson(
    state: &State,
    value: &Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> Result<Value, minijinja::Error> {
    let bad =
        |what: &str| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {what}"));
    let indent: Option<Value> = match indent {
        Some(i) => Some(i),
        None => kwargs.get("indent")?,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => Some(usize::try_from(v).map_err(|_| bad("`indent` must be a whole number"))?),
    };
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;
    let mut style = JsonStyle {
        indent,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
        item_sep: if indent.is_some() {
            ",".into()
        } else {
            ", ".into()
        },
        key_sep: ": ".into(),
    };
    if let Some(sep) = separators.filter(|s| !s.is_none()) {
        let item = sep
            .get_item_by_index(0)
            .ok()
            .and_then(|v| v.as_str().map(String::from));
        let key = sep
            .get_item_by_index(1)
            .ok()
            .and_then(|v| v.as_str().map(String::from));
        match (item, key) {
            (Some(i), Some(k)) => (style.item_sep, style.key_sep) = (i, k),
            _ => return Err(bad("`separators` must be two strings")),
        }
    }
    let mut json = match value.downcast_object_ref::<Json>() {
        Some(j) => j.0.clone(),
        None => serde_json::to_value(value).map_err(|e| bad(&e.to_string()))?,
    };
    let masks = state.lookup("__tessera_masks");
    let masks = masks
        .as_ref()
        .and_then(|m| m.downcast_object_ref::<Masks>());
    if let Some(m) = masks {
        m.unmask_json(&mut json);
    }
    let text = style.dump(&json);
    Ok(Value::from_safe_string(match masks {
        Some(m) => format!("{}{text}{}", m.marker(SPAN_OPEN), m.marker(SPAN_CLOSE)),
        None => text,
    }))
}

/// How Python's `json.dumps` writes a value.
struct JsonStyle {
    indent: Option<usize>,
    ensure_ascii: bool,
    sort_keys: bool,
    item_sep: String,
    key_sep: String,
}

impl JsonStyle {
    fn dump(&self, v: &serde_json::Value) -> String {
        let mut out = String::new();
        self.write(&mut out, v, 0);
        out
    }

    fn newline(&self, out: &mut String, level: usize) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    }

    fn write(&self, out: &mut String, v: &serde_json::Value, level: usize) {
        use serde_json::Value as J;
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => out.push_str(&n.to_string()),
            J::String(s) => self.string(out, s),
            J::Array(a) if a.is_empty() => out.push_str("[]"),
            J::Object(o) if o.is_empty() => out.push_str("{}"),
            J::Array(a) => {
                out.push('[');
                for (i, x) in a.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, level + 1);
                    self.write(out, x, level + 1);
                }
                self.newline(out, level);
                out.push(']');
            }
            J::Object(o) => {
                let mut entries: Vec<(&String, &J)> = o.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, x)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, level + 1);
                    self.string(out, k);
                    out.push_str(&self.key_sep);
                    self.write(out, x, level + 1);
                }
                self.newline(out, level);
                out.push('}');
            }
        }
    }

    /// A JSON string as Python writes it: `\"`, `\\`, `\n`, `\r`, `\t`, `\b`,
    /// `\f`, other control characters as `\u00XX`, and with `ensure_ascii` every
    /// non-ASCII character as `\uXXXX` (UTF-16 surrogate pairs above U+FFFF).
    fn string(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for u in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{u:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// `json.dumps(v)` as Python writes it (`", "` and `": "`, non-ASCII as is, keys
/// in order): the JSON text a chat template's `tojson` gives, for text the gateway
/// writes in the same style (tool calls in a conversation's history).
pub fn python_json(v: &serde_json::Value) -> String {
    JsonStyle {
        indent: None,
        ensure_ascii: false,
        sort_keys: false,
        item_sep: ", ".into(),
        key_sep: ": ".into(),
    }
    .dump(v)
}

/// `raise_exception(msg)`, used by HF templates to reject bad conversations.
fn raise_exception(msg: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

fn str_arg(args: &[Value], i: usize) -> Option<&str> {
    args.get(i).and_then(Value::as_str)
}

/// Python `str`/`dict` methods that HF templates use and minijinja lacks.
fn python_method(
    _state: &State,
    value: &Value,
    method: &str,
    args: &[Value],
) -> Result<Value, minijinja::Error> {
    let unknown = || {
        Err(minijinja::Error::new(
            ErrorKind::UnknownMethod,
            format!("{} has no method named {method}", value.kind()),
        ))
    };
    // Keyword arguments are not supported by these methods.
    if args.iter().any(Value::is_kwargs) {
        return unknown();
    }
    if let Some(s) = value.as_str() {
        let chars = str_arg(args, 0);
        let strip_set = |c: char| match chars {
            Some(set) => set.contains(c),
            None => c.is_whitespace(),
        };
        return Ok(match method {
            "strip" => Value::from(s.trim_matches(strip_set)),
            "lstrip" => Value::from(s.trim_start_matches(strip_set)),
            "rstrip" => Value::from(s.trim_end_matches(strip_set)),
            "upper" => Value::from(s.to_uppercase()),
            "lower" => Value::from(s.to_lowercase()),
            "title" => Value::from(title_case(s)),
            "capitalize" => {
                let mut cs = s.chars();
                Value::from(match cs.next() {
                    Some(c) => c
                        .to_uppercase()
                        .chain(cs.flat_map(char::to_lowercase))
                        .collect(),
                    None => String::new(),
                })
            }
            "startswith" | "endswith" => {
                let Some(arg) = args.first() else {
                    return unknown();
                };
                let prefixes: Vec<String> = if let Some(p) = arg.as_str() {
                    vec![p.to_string()]
                } else if arg.kind() == ValueKind::Seq {
                    arg.try_iter()?
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect()
                } else {
                    return unknown();
                };
                Value::from(prefixes.iter().any(|p| {
                    if method == "startswith" {
                        s.starts_with(p.as_str())
                    } else {
                        s.ends_with(p.as_str())
                    }
                }))
            }
            "split" => {
                let parts: Vec<Value> = match str_arg(args, 0) {
                    Some(sep) if !sep.is_empty() => s.split(sep).map(Value::from).collect(),
                    Some(_) => {
                        return Err(minijinja::Error::new(
                            ErrorKind::InvalidOperation,
                            "split(): empty separator",
                        ))
                    }
                    None => s.split_whitespace().map(Value::from).collect(),
                };
                Value::from(parts)
            }
            "replace" => match (str_arg(args, 0), str_arg(args, 1)) {
                (Some(from), Some(to)) => Value::from(s.replace(from, to)),
                _ => return unknown(),
            },
            "find" => match str_arg(args, 0) {
                Some(needle) => {
                    Value::from(s.find(needle).map_or(-1, |b| s[..b].chars().count() as i64))
                }
                None => return unknown(),
            },
            "count" => match str_arg(args, 0) {
                Some(needle) if !needle.is_empty() => Value::from(s.matches(needle).count()),
                _ => return unknown(),
            },
            "isspace" => Value::from(!s.is_empty() && s.chars().all(char::is_whitespace)),
            "isdigit" => Value::from(!s.is_empty() && s.chars().all(|c| c.is_ascii_digit())),
            _ => return unknown(),
        });
    }
    if value.kind() == ValueKind::Map {
        return match method {
            "items" => Ok(Value::from(
                value
                    .try_iter()?
                    .map(|k| {
                        let v = value.get_item(&k).unwrap_or_default();
                        Value::from(vec![k, v])
                    })
                    .collect::<Vec<_>>(),
            )),
            "keys" => Ok(Value::from(value.try_iter()?.collect::<Vec<_>>())),
            "values" => Ok(Value::from(
                value
                    .try_iter()?
                    .map(|k| value.get_item(&k).unwrap_or_default())
                    .collect::<Vec<_>>(),
            )),
            "get" => {
                let Some(key) = args.first() else {
                    return unknown();
                };
                let found = value.get_item(key).unwrap_or_default();
                Ok(if found.is_undefined() {
                    args.get(1).cloned().unwrap_or(Value::from(()))
                } else {
                    found
                })
            }
            _ => unknown(),
        };
    }
    unknown()
}

fn title_case(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut prev_alpha = false;
    for c in s.chars() {
        if prev_alpha {
            out.extend(c.to_lowercase());
        } else {
            out.extend(c.to_uppercase());
        }
        prev_alpha = c.is_alphabetic();
    }
    out
}

#[cfg(test)]
mod tests;
