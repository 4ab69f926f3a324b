//! Request parsing of the OpenAI shapes (`POST /v1/chat/completions`,
//! `POST /v1/completions`): the body's fields read into a [`ParsedRequest`] with
//! OpenAI's names, defaults and limits; the field readers they share with the
//! Workers AI shape are in [`crate::validation`].

use crate::error::{type_name, ApiError};
use crate::tools;
use crate::validation::{
    check_len, lora, max_tokens, messages, opt_bool, opt_string, opt_uint, present, prompt_text,
    requested_priority, response_format, sampling, speculative, stop, top_count, Input,
    ParsedRequest,
};
use serde_json::{Map, Value};
use tessera_model::sampling::MAX_TOP_LOGPROBS;

/// Most alternatives per token of completions `logprobs`: OpenAI's limit ("The
/// maximum value for `logprobs` is 5", legacy Completions API). Chat's
/// `top_logprobs` goes to [`MAX_TOP_LOGPROBS`] (20), as OpenAI's does.
pub const MAX_COMPLETION_LOGPROBS: u32 = 5;

/// Chat `logprobs` (boolean) and `top_logprobs` (0..=20, only with `logprobs`).
fn chat_logprobs(o: &Map<String, Value>) -> Result<Option<u32>, ApiError> {
    let on = opt_bool(o, "logprobs")?.unwrap_or(false);
    let top = top_count(o, "top_logprobs", MAX_TOP_LOGPROBS as u32)?;
    match (on, top) {
        (false, Some(_)) => Err(ApiError::field(
            "top_logprobs",
            "`top_logprobs` requires `logprobs: true`",
        )),
        (false, None) => Ok(None),
        (true, top) => Ok(Some(top.unwrap_or(0))),
    }
}

fn common(o: &Map<String, Value>, input: Input) -> Result<ParsedRequest, ApiError> {
    let model =
        opt_string(o, "model")?.ok_or_else(|| ApiError::field("model", "`model` is required"))?;
    check_len("model", model)?;
    // `model: "<base>:<fine-tune>"` names a fine-tune as the `lora` field does.
    if let Some((base, ft)) = model.split_once(':') {
        if base.is_empty() || ft.is_empty() {
            return Err(ApiError::field(
                "model",
                format!("`model` names a base model and a fine-tune as `<base>:<fine-tune>`, both non-empty. Given: {model:?}"),
            ));
        }
    }
    let (model, lora) = match (model.split_once(':'), lora(o)?) {
        (Some((_, ft)), Some(_)) if !ft.is_empty() => {
            return Err(ApiError::field(
                "lora",
                "name the fine-tune once: in `model` (`<base>:<fine-tune>`) or in `lora`",
            ))
        }
        (Some((base, ft)), None) if !ft.is_empty() => (base, Some(ft.to_string())),
        (_, lora) => (model, lora),
    };
    if let Some(n) = opt_uint(o, "n", 1)? {
        if n != 1 {
            return Err(ApiError::field(
                "n",
                format!(
                    "`n` must be 1: each request returns one choice (send n requests, \
                     with different seeds when sampling, for n choices). Given: {n}"
                ),
            ));
        }
    }
    let stream = opt_bool(o, "stream")?.unwrap_or(false);
    let include_usage = match present(o, "stream_options") {
        None => false,
        Some(Value::Object(so)) => opt_bool(so, "include_usage")?.unwrap_or(false),
        Some(v) => {
            return Err(ApiError::field(
                "stream_options",
                format!(
                    "`stream_options` must be an object. Given: {}",
                    type_name(v)
                ),
            ))
        }
    };
    Ok(ParsedRequest {
        model: model.into(),
        input,
        max_tokens: max_tokens(o, &["max_completion_tokens", "max_tokens"])?,
        sampling: sampling(o)?,
        stop: stop(o)?,
        stream,
        include_usage,
        priority: requested_priority(o, true)?,
        logprobs: None,
        echo: false,
        format: response_format(o, true)?,
        tools: None,
        speculative: speculative(o)?,
        lora,
    })
}

/// `POST /v1/chat/completions`.
pub fn parse_chat(o: &Map<String, Value>) -> Result<ParsedRequest, ApiError> {
    let m = present(o, "messages")
        .ok_or_else(|| ApiError::field("messages", "`messages` is required"))?;
    let input = Input::Messages(messages(m)?);
    Ok(ParsedRequest {
        logprobs: chat_logprobs(o)?,
        tools: tools::parse(o, true)?,
        ..common(o, input)?
    })
}

/// `POST /v1/completions` (raw prompt, no chat template): also `logprobs`
/// (alternatives per token, `0..=`[`MAX_COMPLETION_LOGPROBS`]) and `echo`.
pub fn parse_completion(o: &Map<String, Value>) -> Result<ParsedRequest, ApiError> {
    let text = prompt_text(o)?.ok_or_else(|| ApiError::field("prompt", "`prompt` is required"))?;
    Ok(ParsedRequest {
        logprobs: top_count(o, "logprobs", MAX_COMPLETION_LOGPROBS)?,
        echo: opt_bool(o, "echo")?.unwrap_or(false),
        ..common(o, Input::Prompt { text, chat: false })?
    })
}
