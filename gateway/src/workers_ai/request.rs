//! Request parsing of the Workers AI shape (`POST .../ai/run/{model}`): the
//! body's fields read into a [`ParsedRequest`] with Workers AI's names and
//! defaults; the field readers it shares with the OpenAI shapes are in
//! [`crate::validation`].

use crate::error::{ApiError, ErrorKind};
use crate::tools;
use crate::validation::{
    lora, max_tokens, messages, opt_bool, present, prompt_text, requested_priority,
    response_format, sampling, speculative, stop, Input, ParsedRequest,
};
use serde_json::{Map, Value};

/// `POST .../ai/run/{model}`: `{prompt}` (chat-templated unless `raw`) or `{messages}`.
pub fn parse_run(model: &str, o: &Map<String, Value>) -> Result<ParsedRequest, ApiError> {
    let raw = opt_bool(o, "raw")?.unwrap_or(false);
    let prompt = prompt_text(o)?;
    let input = match (prompt, present(o, "messages")) {
        (Some(_), Some(_)) => {
            return Err(ApiError::new(
                ErrorKind::BadRequest,
                "give either `prompt` or `messages`, not both",
            ))
        }
        (Some(text), None) => Input::Prompt { text, chat: !raw },
        (None, Some(m)) => Input::Messages(messages(m)?),
        (None, None) => {
            return Err(ApiError::new(
                ErrorKind::BadRequest,
                "request needs `prompt` or `messages`",
            ))
        }
    };
    Ok(ParsedRequest {
        model: model.into(),
        input,
        max_tokens: max_tokens(o, &["max_tokens"])?,
        sampling: sampling(o)?,
        stop: stop(o)?,
        stream: opt_bool(o, "stream")?.unwrap_or(false),
        include_usage: true,
        priority: requested_priority(o, false)?,
        logprobs: None,
        echo: false,
        format: response_format(o, false)?,
        tools: tools::parse(o, false)?,
        speculative: speculative(o)?,
        lora: lora(o)?,
    })
}
