//! The deployment file (`tessera.toml`) and its validation, including the I2 check:
//! every node's usable KV pool holds a full context window of every model it serves.
//!
//! One file describes a whole deployment: the gateway, the models and the node pools.
//! Nodes read it at startup (`tessera node --role prefill|decode --config tessera.toml`)
//! and refuse to start on a violation; `tessera ops check-config tessera.toml` gives the
//! same verdict offline for the whole file.
//!
//! ```toml
//! [gateway]
//! listen = "127.0.0.1:8787"          # socket address the gateway binds
//!
//! [[models]]
//! id = "@cf/huggingfacetb/smollm2-135m-instruct"
//! path = "models/SmolLM2-135M-Instruct.Q4_1.gguf"   # relative to the working directory
//! # context = 8192                   # optional; read from the GGUF when the file is there
//!
//! [[pools]]
//! name = "prefill"
//! role = "prefill"                   # prefill | decode | colocated
//! page_size = 16                     # tokens per KV page (default 16)
//! kv_pool_tokens = 16384             # pool size; usable = whole pages only
//! nodes = ["127.0.0.1:9101"]         # node control addresses, host:port
//! # models = ["@cf/..."]             # optional; default: every model
//! ```
//!
//! - [`DeploymentConfig::load`] parses (unknown fields are errors, with the location).
//! - [`DeploymentConfig::check`] / [`DeploymentConfig::check_offline`] return a
//!   [`Verdict`]: every [`Violation`] (structure, context windows, I2) and one
//!   [`PoolFit`] line per (model, pool) pair.
//! - [`check_pool_fits`] is the I2 check alone, pure, for a node that already knows
//!   its model's context window.
//! - [`node_links`]: the optional `[node_links]` section (mutual TLS files, liveness
//!   timings), link identities and their certificate checks.
//! - [`secret_files`]: secret files and directories created with their final modes
//!   (`0600` with `O_EXCL`, `0700`), and the mode checks of keys and key directories.

mod check;
mod context_window;
mod load;
pub mod node_links;
mod schema;
pub mod secret_files;
#[cfg(test)]
mod tests;
mod violation;

pub use check::{check_host_port, ConfigRejected, ModelContext, PoolFit, Verdict};
pub use context_window::{read_context_window, ContextError};
pub use load::ConfigError;
pub use node_links::{
    is_loopback_address, LinkCredentials, LinkFileError, LinkIdentity, NodeLinksConfig,
};
pub use schema::{
    check_pool_fits, parse_date, DeploymentConfig, GatewaySection, ModelEntry, NodeRole,
    PoolConfig, PoolTooSmall, UnknownRole, DEFAULT_PAGE_SIZE, MAX_MODEL_ID_BYTES,
};
pub use violation::Violation;
