//! The response formatter of every generation endpoint: OpenAI's shapes (chat
//! completions, completions, their chunks) here, Workers AI's through its frames.

use crate::driver::{finish_label, ResponseEvent, TokenCounts};
use crate::http::{sse, Shape};
use crate::tools::{openai_calls, workers_ai_calls, CallScanner, ToolCall};
use crate::workers_ai;
use serde_json::{json, Map, Value};
use std::sync::Arc;
use tessera_model::sampling::{Logprobs, TokenLogprobs};
use tessera_model::tokenizer::Tokenizer;
use tessera_serving::FinishReason;

use workers_ai::usage;

/// Renders driver messages in one API's shape.
pub(crate) struct Formatter {
    pub(crate) shape: Shape,
    pub(crate) rid: String,
    pub(crate) model: String,
    pub(crate) created: i64,
    pub(crate) include_usage: bool,
    pub(crate) started: bool,
    /// Log probabilities to render (the request asked for them).
    pub(crate) logprobs: Option<LogprobsView>,
    /// Completions `echo`: the prompt text, sent once before the completion.
    pub(crate) echo: Option<String>,
    /// The request's tools: the output is scanned for calls (chat, Workers AI).
    pub(crate) tools: Option<CallScanner>,
}

/// What rendering log probabilities needs: the tokenizer that names tokens, the
/// prompt (echo), and how many characters of text the tokens rendered so far
/// covered (completions `text_offset`).
pub(crate) struct LogprobsView {
    pub(crate) tokenizer: Arc<Tokenizer>,
    /// The prompt's token ids, when `echo` returns the prompt's log probabilities.
    pub(crate) prompt: Option<Vec<u32>>,
    /// Characters covered by the tokens rendered so far.
    pub(crate) offset: usize,
}

/// Log probabilities a whole (non-streaming) response collected.
#[derive(Default)]
pub(crate) struct Collected {
    /// Prompt positions 1.. (echo).
    pub(crate) prompt: Vec<TokenLogprobs>,
    /// Generated tokens.
    pub(crate) tokens: Vec<TokenLogprobs>,
}

impl Collected {
    /// Adds one token's log probabilities.
    pub(crate) fn push(&mut self, lp: Logprobs) {
        self.prompt.extend(lp.prompt);
        self.tokens.extend(lp.token);
    }
}

/// A log probability as JSON: `-inf` (a token the logits exclude) is OpenAI's
/// `-9999.0`, since JSON has no infinity.
fn lp_value(x: f32) -> Value {
    json!(if x.is_finite() { x } else { -9999.0 })
}

impl LogprobsView {
    fn token_text(&self, id: u32) -> String {
        String::from_utf8_lossy(self.tokenizer.token_bytes_ref(id)).into_owned()
    }

    /// Chat: `{"token", "logprob", "bytes", "top_logprobs": [...]}`.
    fn chat_entry(&self, e: &TokenLogprobs) -> Value {
        let one = |id: u32, lp: f32| {
            json!({"token": self.token_text(id), "logprob": lp_value(lp),
                   "bytes": self.tokenizer.token_bytes_ref(id)})
        };
        let mut v = one(e.id, e.logprob);
        v["top_logprobs"] = e.top.iter().map(|&(id, lp)| one(id, lp)).collect();
        v
    }

    /// Chat: the choice's `logprobs` object.
    fn chat(&self, entries: &[TokenLogprobs]) -> Value {
        let content: Vec<Value> = entries.iter().map(|e| self.chat_entry(e)).collect();
        json!({"content": content, "refusal": null})
    }

    /// Completions: the legacy `logprobs` object (`tokens`, `token_logprobs`,
    /// `top_logprobs`, `text_offset` in characters from the start of the returned
    /// text) over `prompt` (echo: the prompt's ids and its entries for positions
    /// 1..; the first token has no log probability, `null`) and then `entries`.
    fn completion(&mut self, prompt: Option<&[TokenLogprobs]>, entries: &[TokenLogprobs]) -> Value {
        let (mut tokens, mut lps, mut tops, mut offsets) = (vec![], vec![], vec![], vec![]);
        // `width`: whether the token's text is in the returned text (a BOS the
        // tokenizer added to the prompt is not: Gemma's `<bos>`).
        let mut add = |view: &mut Self, id: u32, e: Option<&TokenLogprobs>, width: bool| {
            let text = view.token_text(id);
            offsets.push(view.offset);
            if width {
                view.offset += text.chars().count();
            }
            tokens.push(text);
            lps.push(e.map_or(Value::Null, |e| lp_value(e.logprob)));
            tops.push(e.map_or(Value::Null, |e| {
                let mut m = Map::new();
                for &(id, lp) in &e.top {
                    m.entry(view.token_text(id)).or_insert(lp_value(lp));
                }
                Value::Object(m)
            }));
        };
        if let (Some(entries), Some(ids)) = (prompt, self.prompt.take()) {
            let added_bos = self
                .tokenizer
                .add_bos()
                .then(|| self.tokenizer.bos_id())
                .flatten();
            for (i, &id) in ids.iter().enumerate() {
                let e = i.checked_sub(1).and_then(|j| entries.get(j));
                add(self, id, e, !(i == 0 && Some(id) == added_bos));
            }
        }
        for e in entries {
            add(self, e.id, Some(e), true);
        }
        json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
    }
}

impl Formatter {
    fn id(&self) -> String {
        match self.shape {
            Shape::Completion => format!("cmpl-{}", self.rid),
            _ => format!("chatcmpl-{}", self.rid),
        }
    }

    fn object(&self, chunk: bool) -> &'static str {
        match (self.shape, chunk) {
            (Shape::Completion, _) => "text_completion",
            (_, false) => "chat.completion",
            (_, true) => "chat.completion.chunk",
        }
    }

    /// `finish_reason`: `tool_calls` when the output held calls.
    fn finish(reason: FinishReason, calls: &[ToolCall]) -> &'static str {
        if calls.is_empty() {
            finish_label(reason)
        } else {
            "tool_calls"
        }
    }

    /// The whole (non-streaming) response body.
    pub(crate) fn complete(
        &mut self,
        text: &str,
        reason: FinishReason,
        tokens: TokenCounts,
        lp: &Collected,
    ) -> Value {
        let (text, calls) = match self.tools.take() {
            Some(mut scanner) => {
                let mut shown = scanner.push(text);
                let (tail, calls) = scanner.finish();
                shown.push_str(&tail);
                (shown, calls)
            }
            None => (text.to_string(), vec![]),
        };
        let text = text.as_str();
        let choice = match self.shape {
            Shape::WorkersAi => {
                let calls = (!calls.is_empty()).then(|| workers_ai_calls(&calls));
                return workers_ai::complete(text, calls, tokens);
            }
            Shape::Chat => {
                let mut message = json!({"role": "assistant", "content": text});
                if !calls.is_empty() {
                    if text.trim().is_empty() {
                        message["content"] = Value::Null;
                    }
                    message["tool_calls"] = openai_calls(&self.rid, &calls, false);
                }
                json!({
                    "index": 0,
                    "message": message,
                    "logprobs": self.logprobs.as_ref().map(|v| v.chat(&lp.tokens)),
                    "finish_reason": Self::finish(reason, &calls),
                })
            }
            Shape::Completion => {
                let echo = self.echo.take();
                let prompt = echo.as_ref().map(|_| lp.prompt.as_slice());
                let logprobs = self
                    .logprobs
                    .as_mut()
                    .map(|v| v.completion(prompt, &lp.tokens));
                json!({
                    "index": 0, "text": format!("{}{text}", echo.unwrap_or_default()),
                    "logprobs": logprobs, "finish_reason": finish_label(reason),
                })
            }
        };
        json!({
            "id": self.id(),
            "object": self.object(false),
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": usage(tokens),
        })
    }

    fn chunk(&self, choice: Option<Value>, usage_v: Option<Value>) -> String {
        let mut v = json!({
            "id": self.id(),
            "object": self.object(true),
            "created": self.created,
            "model": self.model,
            "choices": choice.map(|c| vec![c]).unwrap_or_default(),
        });
        if self.include_usage {
            v["usage"] = usage_v.unwrap_or(Value::Null);
        }
        sse(&v)
    }

    fn delta(&self, text: Option<&str>, finish: Option<&str>, logprobs: Value) -> Value {
        match self.shape {
            Shape::Completion => {
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": logprobs, "finish_reason": finish})
            }
            _ => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!({"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish})
            }
        }
    }

    /// The chunks of one token's text and log probabilities; on the first, a
    /// completions `echo` chunk (the prompt, with its log probabilities) first.
    fn text_chunks(&mut self, text: &str, lp: Option<Box<Logprobs>>, out: &mut String) {
        let lp = lp.map(|b| *b).unwrap_or_default();
        if let Some(echo) = self.echo.take() {
            let logprobs = match &mut self.logprobs {
                Some(v) => v.completion(Some(&lp.prompt), &[]),
                None => Value::Null,
            };
            out.push_str(&self.chunk(Some(self.delta(Some(&echo), None, logprobs)), None));
        }
        let entries: Vec<TokenLogprobs> = lp.token.into_iter().collect();
        let logprobs = match (&mut self.logprobs, self.shape) {
            (Some(v), Shape::Completion) => v.completion(None, &entries),
            (Some(v), _) => v.chat(&entries),
            (None, _) => Value::Null,
        };
        out.push_str(&self.chunk(Some(self.delta(Some(text), None, logprobs)), None));
    }

    /// The SSE bytes for one driver message.
    pub(crate) fn frame(&mut self, m: ResponseEvent) -> String {
        let mut out = String::new();
        if !self.started && self.shape == Shape::Chat {
            let first = json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
            out.push_str(&self.chunk(Some(first), None));
        }
        self.started = true;
        match (self.shape, m) {
            (Shape::WorkersAi, ResponseEvent::Text { text, .. }) => {
                let text = match &mut self.tools {
                    Some(scanner) => scanner.push(&text),
                    None => text,
                };
                if !text.is_empty() {
                    out.push_str(&workers_ai::text_frame(&text))
                }
            }
            (Shape::WorkersAi, ResponseEvent::Done { tokens, .. }) => {
                if let Some(scanner) = self.tools.take() {
                    let (tail, calls) = scanner.finish();
                    if !tail.is_empty() {
                        out.push_str(&workers_ai::text_frame(&tail));
                    }
                    if !calls.is_empty() {
                        out.push_str(&workers_ai::calls_frame(workers_ai_calls(&calls)));
                    }
                }
                out.push_str(&workers_ai::done_frames(tokens))
            }
            (Shape::WorkersAi, ResponseEvent::Error(e)) => {
                out.push_str(&workers_ai::error_frame(&e))
            }
            (_, ResponseEvent::Text { text, logprobs }) => {
                let text = match &mut self.tools {
                    Some(scanner) => scanner.push(&text),
                    None => text,
                };
                // Text held back by the tool-call scanner is sent later (or becomes a
                // call); a token's log probabilities are sent when it arrives.
                if !text.is_empty() || logprobs.is_some() {
                    self.text_chunks(&text, logprobs, &mut out)
                }
            }
            (_, ResponseEvent::Done { reason, tokens }) => {
                if let Some(echo) = self.echo.take() {
                    let echo = self.delta(Some(&echo), None, Value::Null);
                    out.push_str(&self.chunk(Some(echo), None));
                }
                let mut calls = vec![];
                if let Some(scanner) = self.tools.take() {
                    let (tail, found) = scanner.finish();
                    if !tail.is_empty() {
                        self.text_chunks(&tail, None, &mut out);
                    }
                    if !found.is_empty() {
                        let delta = json!({"index": 0,
                            "delta": {"tool_calls": openai_calls(&self.rid, &found, true)},
                            "logprobs": null, "finish_reason": null});
                        out.push_str(&self.chunk(Some(delta), None));
                    }
                    calls = found;
                }
                let last = self.delta(None, Some(Self::finish(reason, &calls)), Value::Null);
                out.push_str(&self.chunk(Some(last), None));
                if self.include_usage {
                    out.push_str(&self.chunk(None, Some(usage(tokens))));
                }
                out.push_str("data: [DONE]\n\n");
            }
            (_, ResponseEvent::Error(e)) => {
                let (ty, code) = e.kind.openai();
                out.push_str(&sse(&json!({"error": {"message": e.message, "type": ty, "param": null, "code": code}})));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::parse;
    use crate::tools::tests::QWEN_CALL;

    /// A chat formatter for a request with a `get_weather` tool (`auto`).
    fn formatter(shape: Shape) -> Formatter {
        let body = json!({"tools": [{"type": "function", "function": {"name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]});
        let tools = parse(body.as_object().unwrap(), true).unwrap().unwrap();
        Formatter {
            shape,
            rid: "r1".into(),
            model: "@cf/qwen/qwen2.5-coder-0.5b-instruct".into(),
            created: 0,
            include_usage: false,
            started: false,
            logprobs: None,
            echo: None,
            tools: Some(tools.scanner()),
        }
    }

    fn done() -> ResponseEvent {
        ResponseEvent::Done {
            reason: FinishReason::Stop,
            tokens: TokenCounts {
                prompt: 10,
                completion: QWEN_CALL.len(),
                cached: 0,
            },
        }
    }

    #[test]
    fn qwens_native_call_is_an_openai_tool_call_streamed_and_not() {
        let mut f = formatter(Shape::Chat);
        let v = f.complete(
            &QWEN_CALL.concat(),
            FinishReason::Stop,
            TokenCounts::default(),
            &Collected::default(),
        );
        let c = &v["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls", "{v}");
        assert_eq!(c["message"]["content"], Value::Null, "{v}");
        assert_eq!(
            c["message"]["tool_calls"],
            json!([{"id": "call_r1_0", "type": "function",
                    "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}])
        );

        let mut f = formatter(Shape::Chat);
        let mut sse = String::new();
        for t in QWEN_CALL {
            sse.push_str(&f.frame(ResponseEvent::Text {
                text: t.into(),
                logprobs: None,
            }));
        }
        sse.push_str(&f.frame(done()));
        let chunks: Vec<Value> = sse
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .filter(|e| *e != "[DONE]")
            .map(|e| serde_json::from_str(e).unwrap())
            .collect();
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(text, "", "the call leaked into the text: {sse}");
        let calls: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"].get("tool_calls"))
            .collect();
        assert_eq!(
            calls,
            vec![&json!([{"id": "call_r1_0", "type": "function", "index": 0,
                          "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}])]
        );
        assert_eq!(
            chunks.last().unwrap()["choices"][0]["finish_reason"],
            "tool_calls"
        );
        assert!(sse.ends_with("data: [DONE]\n\n"));

        // Workers AI: `result.tool_calls` with object arguments.
        let mut f = formatter(Shape::WorkersAi);
        let v = f.complete(
            &QWEN_CALL.concat(),
            FinishReason::Stop,
            TokenCounts::default(),
            &Collected::default(),
        );
        assert_eq!(
            v["result"]["tool_calls"],
            json!([{"name": "get_weather", "arguments": {"city": "Paris"}}]),
            "{v}"
        );
    }
}
