//! OpenAI shapes (chat completions, completions, chunks, models) and the
//! response formatter shared with the Workers AI shape.

use crate::catalog::CatalogEntry;
use crate::driver::{finish_label, Msg, TokenCounts};
use crate::error::Flavor;
use crate::http::{authenticate, envelope, sse, Shape};
use crate::state::{AppState, Ctx};
use crate::workers_ai;
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;
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

fn model_object(e: &CatalogEntry) -> Value {
    json!({
        "id": e.id,
        "object": "model",
        "created": 0,
        "owned_by": "tessera",
        "task": e.task,
        "description": e.description,
        "context_window": e.context_window,
    })
}

async fn list(
    state: Arc<AppState>,
    headers: HeaderMap,
    account: Option<String>,
    flavor: Flavor,
    query: HashMap<String, String>,
) -> Response {
    let mut ctx = Ctx::new("models", flavor);
    let scope = tessera_tenancy::Scope::Inference;
    if let Err((reason, e)) =
        authenticate(&state, &mut ctx, &headers, account.as_deref(), scope).await
    {
        return ctx.refuse(&state, reason, e);
    }
    let body = match flavor {
        Flavor::OpenAi => json!({
            "object": "list",
            "data": state.catalog.entries().iter().map(model_object).collect::<Vec<_>>(),
        }),
        Flavor::WorkersAi => envelope(Value::Array(
            state
                .catalog
                .entries()
                .iter()
                .filter(|e| matches_search(e, &query))
                .map(|e| {
                    json!({
                        "id": e.id,
                        "name": e.id,
                        "description": e.description,
                        "task": {"id": "text-generation", "name": e.task, "description": "Generation of text from a prompt or a conversation"},
                        "context_window": e.context_window,
                        "properties": [{"property_id": "context_window", "value": e.context_window.to_string()}],
                    })
                })
                .collect(),
        )),
    };
    ctx.header(axum::Json(body).into_response())
}

/// `models/search` filters: `search` (in id or description) and `task` (task
/// name or `text-generation`), both case-insensitive.
fn matches_search(e: &CatalogEntry, q: &HashMap<String, String>) -> bool {
    let has = |hay: &str, needle: &str| hay.to_lowercase().contains(&needle.to_lowercase());
    let search = q
        .get("search")
        .is_none_or(|s| has(&e.id, s) || has(&e.description, s));
    let task = q.get("task").is_none_or(|t| {
        t.eq_ignore_ascii_case(&e.task) || t.eq_ignore_ascii_case("text-generation")
    });
    search && task
}

/// `GET /v1/models`.
pub(crate) async fn models(State(state): State<Arc<AppState>>, headers: HeaderMap) -> Response {
    list(state, headers, None, Flavor::OpenAi, HashMap::new()).await
}

/// `GET /client/v4/accounts/{account_id}/ai/v1/models`.
pub(crate) async fn models_scoped(
    State(state): State<Arc<AppState>>,
    Path(account): Path<String>,
    headers: HeaderMap,
) -> Response {
    list(
        state,
        headers,
        Some(account),
        Flavor::OpenAi,
        HashMap::new(),
    )
    .await
}

/// `GET /client/v4/accounts/{account_id}/ai/models/search`.
pub(crate) async fn models_search(
    State(state): State<Arc<AppState>>,
    Path(account): Path<String>,
    Query(query): Query<HashMap<String, String>>,
    headers: HeaderMap,
) -> Response {
    list(state, headers, Some(account), Flavor::WorkersAi, query).await
}
