//! OpenAI shapes (chat completions, completions, chunks) and the response
//! formatter shared with the Workers AI shape. The model catalog's endpoints are in
//! `models_api`.

use crate::driver::{finish_label, Msg, TokenCounts};
use crate::http::{sse, Shape};
use crate::workers_ai;
use serde_json::{json, Value};
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

    /// The whole (non-streaming) response body.
    pub(crate) fn complete(&self, text: &str, reason: FinishReason, tokens: TokenCounts) -> Value {
        let choice = match self.shape {
            Shape::WorkersAi => return workers_ai::complete(text, tokens),
            Shape::Chat => json!({
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": null,
                "finish_reason": finish_label(reason),
            }),
            Shape::Completion => json!({
                "index": 0, "text": text, "logprobs": null, "finish_reason": finish_label(reason),
            }),
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

    fn delta(&self, text: Option<&str>, finish: Option<FinishReason>) -> Value {
        let finish = finish.map(finish_label);
        match self.shape {
            Shape::Completion => {
                json!({"index": 0, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish})
            }
            _ => {
                let delta = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish})
            }
        }
    }

    /// The SSE bytes for one driver message.
    pub(crate) fn frame(&mut self, m: Msg) -> String {
        let mut out = String::new();
        if !self.started && self.shape == Shape::Chat {
            let first = json!({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
            out.push_str(&self.chunk(Some(first), None));
        }
        self.started = true;
        match (self.shape, m) {
            (Shape::WorkersAi, Msg::Text(t)) => out.push_str(&workers_ai::text_frame(&t)),
            (Shape::WorkersAi, Msg::Done { tokens, .. }) => {
                out.push_str(&workers_ai::done_frames(tokens))
            }
            (Shape::WorkersAi, Msg::Error(e)) => out.push_str(&workers_ai::error_frame(&e)),
            (_, Msg::Text(t)) => out.push_str(&self.chunk(Some(self.delta(Some(&t), None)), None)),
            (_, Msg::Done { reason, tokens }) => {
                out.push_str(&self.chunk(Some(self.delta(None, Some(reason))), None));
                if self.include_usage {
                    out.push_str(&self.chunk(None, Some(usage(tokens))));
                }
                out.push_str("data: [DONE]\n\n");
            }
            (_, Msg::Error(e)) => {
                let (ty, code) = e.kind.openai();
                out.push_str(&sse(&json!({"error": {"message": e.message, "type": ty, "param": null, "code": code}})));
            }
        }
        out
    }
}
