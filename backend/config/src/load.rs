//! Reading `tessera.toml`: parsing with [`ConfigError`], and what a re-read file
//! changes that only a restart can apply.

use crate::schema::{DeploymentConfig, PoolConfig};
use std::path::{Path, PathBuf};

/// Errors reading or parsing a deployment file.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read deployment file {path}: {source}")]
    Read {
        /// File.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// Not valid TOML, or not the schema (unknown field, wrong type, missing field).
    #[error("invalid deployment file {path}: {source}")]
    Parse {
        /// File.
        path: PathBuf,
        /// Parser error, with line, column and the offending text.
        source: Box<toml::de::Error>,
    },
}

impl ConfigError {
    /// Stable machine label.
    pub fn label(&self) -> &'static str {
        match self {
            ConfigError::Read { .. } => "unreadable_config",
            ConfigError::Parse { .. } => "invalid_config",
        }
    }
}

impl DeploymentConfig {
    /// Reads and parses a deployment file. Only syntax and schema are checked here;
    /// [`DeploymentConfig::check`] does the rest.
    pub fn load(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.into(),
            source,
        })?;
        Self::parse(&text, path)
    }

    /// Parses deployment-file text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &Path) -> Result<Self, ConfigError> {
        toml::from_str(text).map_err(|source| ConfigError::Parse {
            path: origin.into(),
            source: Box::new(source),
        })
    }

    /// What a running gateway cannot take from `new` (a re-read of this file)
    /// without a restart: every difference except the `nodes` of pools that exist
    /// in both files with the same name, role and settings. Empty: `new` changes
    /// membership only (nodes added to or removed from existing pools), which a
    /// gateway applies live (`tessera ops reload`, SIGHUP).
    pub fn changes_needing_restart(&self, new: &DeploymentConfig) -> Vec<String> {
        let mut out = Vec::new();
        if self.gateway != new.gateway {
            out.push("[gateway] changed (listen address)".to_string());
        }
        if self.models != new.models {
            out.push("[[models]] changed (models are loaded at start)".to_string());
        }
        if self.node_links != new.node_links {
            out.push("[node_links] changed (CA, certificates, timings)".to_string());
        }
        let names =
            |c: &DeploymentConfig| c.pools.iter().map(|p| p.name.clone()).collect::<Vec<_>>();
        if names(self) != names(new) {
            out.push(format!(
                "the pools changed: {:?} became {:?} (pools are added, removed or reordered only by a restart)",
                names(self),
                names(new)
            ));
        } else {
            for (old, new) in self.pools.iter().zip(&new.pools) {
                let same_but_nodes = PoolConfig {
                    nodes: old.nodes.clone(),
                    ..new.clone()
                };
                if *old != same_but_nodes {
                    out.push(format!(
                        "pool {} changed beyond its nodes (role, page_size, kv_pool_tokens or models)",
                        old.name
                    ));
                }
            }
        }
        out
    }
}
