//! Tessera operations tooling.
//!
//! - [`check_config`]: `tessera ops check-config FILE [--json]`, the offline verdict on a
//!   deployment file (structure and I2: every pool holds a full context window of every
//!   model it serves), as a human report or JSON.
//! - [`certs`]: `tessera ops certs init|issue`, the node links' cluster CA and one
//!   certificate per identity of a deployment file.
//!
//! The deployment-file types and checks live in `tessera_config`, so nodes
//! check their own configuration at startup with the same code.

pub mod certs;
pub mod check_config;

pub use check_config::{check_config, check_config_command, CheckConfigError, Checked, Report};
