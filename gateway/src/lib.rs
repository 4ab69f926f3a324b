//! Tessera gateway: the public HTTP(S) API in front of the model runtime.
//!
//! A generation request runs through these phases, in order (see [`server`]):
//! request id -> authentication ([`tessera_tenancy::Store::authenticate`]) ->
//! account check (the path's account must be the key's tenant) -> body read with a
//! size limit -> [`validation`] (typed fields, model lookup in the [`catalog`],
//! chat template and tokenizer, I1 context check) -> per-tenant limits
//! ([`tessera_tenancy::Limiter`]) -> engine submit -> one driver task per request
//! that forwards tokens and writes the usage row exactly once, also when the client
//! goes away (I6). Errors of every phase are [`error::ApiError`]s; their HTTP status
//! and the Workers AI / OpenAI error shapes are assigned in one place.
//!
//! The phases, the usage rows they write and shutdown are drawn in
//! `gateway/docs/request-lifecycle.md`.
//!
//! Endpoints:
//! - `POST /client/v4/accounts/{account_id}/ai/run/{model}` (Workers AI),
//! - `POST /client/v4/accounts/{account_id}/ai/v1/chat/completions`, `POST /v1/chat/completions`,
//!   `POST /client/v4/accounts/{account_id}/ai/v1/completions`, `POST /v1/completions` (OpenAI),
//! - `GET /client/v4/accounts/{account_id}/ai/models/search`, `GET /v1/models`,
//! - `GET /client/v4/accounts/{account_id}/ai/usage?since=&until=&group_by=`,
//! - `/admin/v1/...` and `GET /metrics` (Prometheus) behind the admin token,
//!   `GET /healthz`, `GET /readyz`.

pub mod catalog;
pub mod error;
pub mod metrics;
pub mod server;
pub mod tls;
pub mod validation;

pub mod admin;
pub mod listener;

mod driver;
mod live;
mod openai;
mod usage_api;
mod workers_ai;

pub use admin::{check_token, TokenError, MIN_TOKEN_BYTES};
pub use error::{ApiError, ErrorKind};
pub use listener::ConnLimits;
pub use server::{AppState, Deadlines, GatewayConfig, Server, UsageConfig, MAX_ID_BYTES};
pub use tls::TlsMode;
