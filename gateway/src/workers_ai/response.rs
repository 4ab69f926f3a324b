//! Workers AI shapes: the `{"result":..,"success":..}` envelope, SSE frames and
//! `models/search`.

use crate::driver::TokenCounts;
use crate::http::{envelope, sse};
use serde_json::{json, Value};

/// The usage object of both API shapes: counts, and the prompt tokens served from
/// the prefix cache in `prompt_tokens_details.cached_tokens`.
pub(crate) fn usage(t: TokenCounts) -> Value {
    json!({
        "prompt_tokens": t.prompt,
        "completion_tokens": t.completion,
        "total_tokens": t.prompt + t.completion,
        "prompt_tokens_details": {"cached_tokens": t.cached},
    })
}

/// Non-streaming `ai/run` result; `tool_calls` (`[{"name", "arguments"}]`) when
/// the output held calls.
pub(crate) fn complete(text: &str, calls: Option<Value>, t: TokenCounts) -> Value {
    let mut result = json!({"response": text, "usage": usage(t)});
    if let Some(calls) = calls {
        result["tool_calls"] = calls;
    }
    envelope(result)
}

/// The SSE frame of the calls the output held, before the usage frame.
pub(crate) fn calls_frame(calls: Value) -> String {
    sse(&json!({"response": "", "tool_calls": calls}))
}

/// One SSE frame of text.
pub(crate) fn text_frame(text: &str) -> String {
    sse(&json!({"response": text}))
}

/// The final frames: usage, then `[DONE]`.
pub(crate) fn done_frames(t: TokenCounts) -> String {
    let mut s = sse(&json!({"response": "", "usage": usage(t)}));
    s.push_str("data: [DONE]\n\n");
    s
}

/// An error after the stream began (status 200 was already sent): an error frame
/// and no `[DONE]`, so no client mistakes the partial text for a complete answer.
pub(crate) fn error_frame(e: &crate::ApiError) -> String {
    sse(&json!({"error": {"code": e.kind.workers_code(), "message": e.message}}))
}
