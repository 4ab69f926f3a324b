//! The OpenAI API shapes: request parsing ([`parse_chat`], [`parse_completion`])
//! and the response formatter, which renders the Workers AI shape too (through
//! [`crate::workers_ai`]'s frames). The model catalog's endpoints are in
//! `models_api`.

mod request;
mod response;

pub use request::{parse_chat, parse_completion, MAX_COMPLETION_LOGPROBS};
pub(crate) use response::{Collected, Formatter, LogprobsView};
