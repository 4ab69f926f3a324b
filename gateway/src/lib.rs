//! Tessera gateway: the public HTTP(S) API in front of the model runtime.
//!
//! A generation request runs through these phases, in order (see [`server`]):
//! connection limits ([`listener`]: connection cap, TLS-handshake, header and idle
//! timeouts) -> request id -> path and model-id length -> authentication
//! ([`tessera_tenancy::Store::authenticate`]), account and scope checks ->
//! concurrency and requests/minute ([`tessera_tenancy::Limiter::admit`]) -> body
//! read with a size limit and a deadline -> [`validation`] (typed fields, model
//! lookup in the [`catalog`], chat template and tokenizer, I1 context check) ->
//! token limits and the daily quota reserved
//! ([`tessera_tenancy::Admission::reserve`]) -> engine submit -> one driver task per
//! request that forwards tokens, enforces the first-token and total deadlines,
//! aborts when the client goes away or the key stops being valid, and writes the
//! usage row exactly once (I6). Refusals before admission write no usage row (they
//! are counted in [`metrics`]). Errors of every phase are [`error::ApiError`]s; their
//! HTTP status and the Workers AI / OpenAI error shapes are assigned in one place.
//!
//! The phases, the usage rows they write and shutdown are drawn in
//! `gateway/docs/request-lifecycle.md`.
//!
//! Endpoints:
//! - `POST /client/v4/accounts/{account_id}/ai/run/{model}` (Workers AI),
//! - `POST /client/v4/accounts/{account_id}/ai/v1/chat/completions`, `POST /v1/chat/completions`,
//!   `POST /client/v4/accounts/{account_id}/ai/v1/completions`, `POST /v1/completions` (OpenAI),
//! - `GET /client/v4/accounts/{account_id}/ai/models/search`, `GET /v1/models`,
//!   `GET /v1/models/{id}` (the catalog, [`catalog`]; per model: GGUF and
//!   deployment-file metadata, aliases, `Deprecation`/`Sunset` headers),
//! - `GET /client/v4/accounts/{account_id}/ai/usage?since=&until=&group_by=`,
//! - `/admin/v1/...` (with the audit log) behind the admin token, and `GET /metrics`
//!   (Prometheus) behind the admin or metrics token, on their own listener with
//!   `admin_listen` ([`admin`]),
//! - `GET /healthz`, `GET /readyz`.
//!
//! The threat model (who can reach what) is `docs/security.md`.

pub mod catalog;
pub mod error;
pub mod metrics;
pub mod model_check;
pub mod openai;
pub mod server;
pub mod tls;
pub mod tools;
pub mod validation;
pub mod workers_ai;

pub mod admin;
pub mod listener;

pub mod batch;
mod cache_api;
mod cpu;
mod dash;
mod driver;
mod finetune_resolve;
mod finetunes_api;
mod http;
mod integrity_log;
mod live;
mod lora_cache;
mod models_api;
mod pipeline;
mod request_log;
mod state;
mod usage_api;

pub use admin::{check_token, TokenError, MIN_TOKEN_BYTES, MIN_TOKEN_DISTINCT_BYTES};
pub use error::{ApiError, ErrorKind};
pub use server::{Server, StartError};
pub use state::{
    AppState, ConnLimits, Deadlines, GatewayOptions, Reload, ServedModel, UsageConfig,
    DEFAULT_MAX_FINETUNE_BYTES, MAX_ID_BYTES,
};
pub use tls::{TlsError, TlsMode};
