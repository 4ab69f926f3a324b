//! Workers AI shapes: the `{"result":..,"success":..}` envelope, SSE frames and
//! `models/search`.

use serde_json::{json, Value};

/// Successful envelope around `result`.
pub(crate) fn envelope(result: Value) -> Value {
    json!({"result": result, "success": true, "errors": [], "messages": []})
}

pub(crate) fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// Non-streaming `ai/run` result.
pub(crate) fn complete(text: &str, prompt: usize, completion: usize) -> Value {
    envelope(json!({"response": text, "usage": usage(prompt, completion)}))
}

/// One SSE frame of text.
pub(crate) fn text_frame(text: &str) -> String {
    crate::server::sse(&json!({"response": text}))
}

/// The final frames: usage, then `[DONE]`.
pub(crate) fn done_frames(prompt: usize, completion: usize) -> String {
    let mut s = crate::server::sse(&json!({"response": "", "usage": usage(prompt, completion)}));
    s.push_str("data: [DONE]\n\n");
    s
}

/// An error after the stream began (status 200 was already sent): an error frame
/// and no `[DONE]`, so no client mistakes the partial text for a complete answer.
pub(crate) fn error_frame(e: &crate::ApiError) -> String {
    crate::server::sse(&json!({"error": {"code": e.kind.workers_code(), "message": e.message}}))
}
