//! Validation of a parsed deployment file: structure, context windows, I2 for every
//! (model, pool) and node-link files, gathered into one [`Verdict`].

use crate::context_window::ContextError;
use crate::node_links::{is_loopback_address, LinkIdentity};
use crate::schema::{parse_date, DeploymentConfig, ModelEntry, NodeRole, MAX_MODEL_ID_BYTES};
use crate::violation::Violation;
use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Whether `id` may name a model: 1 to [`MAX_MODEL_ID_BYTES`] bytes, no whitespace
/// or control characters.
fn check_model_id(id: &str) -> Result<(), String> {
    if id.is_empty() || id.len() > MAX_MODEL_ID_BYTES {
        return Err(format!(
            "must be 1 to {MAX_MODEL_ID_BYTES} bytes (given {} bytes)",
            id.len()
        ));
    }
    if id.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(format!("`{id}` contains whitespace or a control character"));
    }
    Ok(())
}

impl ModelEntry {
    /// The catalog fields' violations: id, aliases, description and tag lengths,
    /// dates (`deprecated` before `sunset`).
    fn field_violations(&self) -> Vec<Violation> {
        let mut out = Vec::new();
        let mut bad = |field: &str, reason: String| {
            out.push(Violation::BadModelField {
                model: self.id.clone(),
                field: field.to_string(),
                reason,
            })
        };
        if let Err(r) = check_model_id(&self.id) {
            bad("id", r);
        }
        for a in &self.aliases {
            if let Err(r) = check_model_id(a) {
                bad("aliases", r);
            }
        }
        if self.description.as_ref().is_some_and(|d| d.len() > 1024) {
            bad("description", "must be at most 1024 bytes".into());
        }
        for t in &self.tags {
            if t.is_empty() || t.len() > 64 {
                bad("tags", format!("`{t}` must be 1 to 64 bytes"));
            }
        }
        let date = |v: &Option<String>| v.as_deref().map(parse_date);
        let (dep, sun) = (date(&self.deprecated), date(&self.sunset));
        if let Some(Err(r)) = &dep {
            bad("deprecated", r.clone());
        }
        if let Some(Err(r)) = &sun {
            bad("sunset", r.clone());
        }
        if let (Some(Ok(d)), Some(Ok(s))) = (dep, sun) {
            if s <= d {
                bad(
                    "sunset",
                    format!(
                        "{} must be after deprecated = {}",
                        self.sunset.as_deref().unwrap_or_default(),
                        self.deprecated.as_deref().unwrap_or_default()
                    ),
                );
            }
        }
        out
    }
}

/// A model's context window as the check found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelContext {
    /// Model id.
    pub id: String,
    /// GGUF file.
    pub path: PathBuf,
    /// Context window in tokens; `None` when unknown (a violation says why).
    pub context: Option<usize>,
}

/// The I2 comparison for one (model, pool) pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolFit {
    /// Model id.
    pub model: String,
    /// Its context window, tokens.
    pub context: usize,
    /// Pool name.
    pub pool: String,
    /// Pool role.
    pub role: NodeRole,
    /// Usable KV tokens of one node of the pool.
    pub usable_tokens: usize,
}

impl PoolFit {
    /// `usable_tokens >= context`.
    pub fn fits(&self) -> bool {
        self.usable_tokens >= self.context
    }
}

/// Everything [`DeploymentConfig::check`] found.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Verdict {
    /// Each model (first entry per id) and its context window.
    pub models: Vec<ModelContext>,
    /// One line per (model, pool serving it) whose context is known.
    pub fits: Vec<PoolFit>,
    /// Every violation, structural ones first.
    pub violations: Vec<Violation>,
}

impl Verdict {
    /// No violations.
    pub fn is_ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// `Ok(self)` when there are no violations, else all of them as one error
    /// (for a node's startup: `cfg.check_offline().into_result()?`).
    pub fn into_result(self) -> Result<Verdict, ConfigRejected> {
        if self.is_ok() {
            Ok(self)
        } else {
            Err(ConfigRejected {
                violations: self.violations,
            })
        }
    }
}

/// A deployment file with violations; the message lists every one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigRejected {
    /// Every violation found.
    pub violations: Vec<Violation>,
}

impl fmt::Display for ConfigRejected {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.violations.len();
        write!(
            f,
            "deployment configuration rejected ({n} violation{})",
            if n == 1 { "" } else { "s" }
        )?;
        for v in &self.violations {
            write!(f, "\n  - {v}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigRejected {}

/// Checks that `address` is `host:port`: an IP socket address (IPv6 in brackets) or a
/// DNS host name, and a port in 1..=65535. No name resolution.
pub fn check_host_port(address: &str) -> Result<(), String> {
    if let Ok(sa) = address.parse::<SocketAddr>() {
        return if sa.port() == 0 {
            Err("port 0 is not a fixed port".into())
        } else {
            Ok(())
        };
    }
    let Some((host, port)) = address.rsplit_once(':') else {
        return Err("missing `:port`".into());
    };
    if host.is_empty() {
        return Err("empty host".into());
    }
    if host.contains(':') || host.starts_with('[') {
        return Err("IPv6 addresses are written `[addr]:port`".into());
    }
    match port.parse::<u16>() {
        Ok(0) => return Err("port 0 is not a fixed port".into()),
        Ok(_) => {}
        Err(_) => return Err(format!("port `{port}` is not a number in 1..=65535")),
    }
    let label_ok = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && !l.starts_with('-')
            && !l.ends_with('-')
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
    };
    if host.len() > 253 || !host.split('.').all(label_ok) {
        return Err(format!("`{host}` is not a valid host name"));
    }
    Ok(())
}

impl DeploymentConfig {
    /// Structural violations only (no model files read): models, names, page sizes,
    /// node addresses, pool coverage of every model.
    pub fn structural_violations(&self) -> Vec<Violation> {
        let mut out = Vec::new();
        if self.models.is_empty() {
            out.push(Violation::NoModels);
        }
        let mut ids = HashSet::new();
        for m in &self.models {
            if !ids.insert(m.id.as_str()) {
                out.push(Violation::DuplicateModel { id: m.id.clone() });
            }
            out.extend(m.field_violations());
        }
        // Ids and aliases resolve case-insensitively: each names one model.
        let mut names: BTreeMap<String, String> = self
            .models
            .iter()
            .map(|m| {
                (
                    m.id.to_ascii_lowercase(),
                    format!("the id of model {}", m.id),
                )
            })
            .collect();
        for m in &self.models {
            for a in &m.aliases {
                let key = a.to_ascii_lowercase();
                if let Some(other) = names.get(&key) {
                    out.push(Violation::DuplicateAlias {
                        alias: a.clone(),
                        model: m.id.clone(),
                        other: other.clone(),
                    });
                } else {
                    names.insert(key, format!("an alias of model {}", m.id));
                }
            }
        }
        let mut names = HashSet::new();
        let mut node_pool: BTreeMap<&str, &str> = BTreeMap::new();
        for p in &self.pools {
            if !names.insert(p.name.as_str()) {
                out.push(Violation::DuplicatePool {
                    name: p.name.clone(),
                });
            }
            if p.page_size == 0 {
                out.push(Violation::ZeroPageSize {
                    pool: p.name.clone(),
                });
            }
            if p.nodes.is_empty() {
                out.push(Violation::NoNodes {
                    pool: p.name.clone(),
                });
            }
            match &p.models {
                Some(list) if list.is_empty() => out.push(Violation::NoPoolModels {
                    pool: p.name.clone(),
                }),
                Some(list) => {
                    for m in list.iter().filter(|m| !ids.contains(m.as_str())) {
                        out.push(Violation::UnknownModel {
                            pool: p.name.clone(),
                            model: m.clone(),
                        });
                    }
                }
                None => {}
            }
            let served = self.models_served_by(p).count();
            if matches!(p.role, NodeRole::Prefill | NodeRole::Decode) && served > 1 {
                out.push(Violation::PoolModels {
                    pool: p.name.clone(),
                    role: p.role,
                    count: served,
                });
            }
            for a in &p.nodes {
                if let Err(reason) = check_host_port(a) {
                    out.push(Violation::BadNodeAddress {
                        pool: p.name.clone(),
                        address: a.clone(),
                        reason,
                    });
                } else if let Some(first) = node_pool.insert(a.as_str(), p.name.as_str()) {
                    out.push(Violation::DuplicateNode {
                        address: a.clone(),
                        first: first.to_string(),
                        second: p.name.clone(),
                    });
                }
            }
        }
        let mut seen = HashSet::new();
        for m in self.models.iter().filter(|m| seen.insert(m.id.as_str())) {
            let has = |role| self.pools_with_role(role).any(|p| p.serves(&m.id));
            if has(NodeRole::Colocated) {
                continue;
            }
            for role in [NodeRole::Prefill, NodeRole::Decode] {
                if !has(role) {
                    out.push(Violation::MissingRole {
                        model: m.id.clone(),
                        role,
                    });
                }
            }
        }
        out.extend(self.node_link_violations());
        out
    }

    /// `[node_links]` structure: both TLS fields or neither, sane timings within
    /// `min_heartbeat_ms` and `max_dead_after_ms`, and without TLS every node on
    /// loopback.
    fn node_link_violations(&self) -> Vec<Violation> {
        let links = self.links();
        let mut out = Vec::new();
        match (&links.ca, &links.cert_dir) {
            (Some(_), None) => out.push(Violation::NodeLinksIncomplete {
                set: "ca",
                missing: "cert_dir",
            }),
            (None, Some(_)) => out.push(Violation::NodeLinksIncomplete {
                set: "cert_dir",
                missing: "ca",
            }),
            _ => {}
        }
        if links.heartbeat_ms == 0 || links.heartbeat_ms >= links.dead_after_ms {
            out.push(Violation::BadLiveness {
                heartbeat_ms: links.heartbeat_ms,
                dead_after_ms: links.dead_after_ms,
            });
        }
        if links.heartbeat_ms < links.min_heartbeat_ms {
            out.push(Violation::HeartbeatTooShort {
                heartbeat_ms: links.heartbeat_ms,
                min: links.min_heartbeat_ms,
            });
        }
        if links.dead_after_ms > links.max_dead_after_ms {
            out.push(Violation::DeadAfterTooLong {
                dead_after_ms: links.dead_after_ms,
                max: links.max_dead_after_ms,
            });
        }
        if links.ca.is_none() && links.cert_dir.is_none() {
            for id in self.link_identities() {
                if let LinkIdentity::Node { address, .. } = id {
                    if check_host_port(&address).is_ok() && !is_loopback_address(&address) {
                        out.push(Violation::InsecureNodeLinks { address });
                    }
                }
            }
        }
        out
    }

    /// With mutual TLS configured: `cert_dir` itself ([`NodeLinksConfig::check_cert_dir`],
    /// one violation) and every identity's certificate and key
    /// ([`NodeLinksConfig::load`]); one violation per identity whose files fail.
    pub fn node_link_file_violations(&self) -> Vec<Violation> {
        self.link_file_violations(None)
    }

    /// [`Self::node_link_file_violations`] of every identity, or of `only`.
    pub(crate) fn link_file_violations(&self, only: Option<&LinkIdentity>) -> Vec<Violation> {
        let links = self.links();
        if links.tls_files().is_none() {
            return Vec::new();
        }
        let dir = links
            .check_cert_dir()
            .err()
            .map(|e| Violation::ExposedCertDir {
                reason: e.to_string(),
            });
        dir.into_iter()
            .chain(
                self.link_identities()
                    .into_iter()
                    .filter(|id| only.is_none_or(|me| me == id))
                    // A bad address is already a violation of its own.
                    .filter(|id| id.name().is_ok())
                    .filter_map(|id| {
                        links
                            .load_files(&id)
                            .err()
                            .map(|e| Violation::NodeLinkFile {
                                identity: id.to_string(),
                                reason: e.to_string(),
                            })
                    }),
            )
            .collect()
    }

    /// The full verdict: structural violations, then each model's context window from
    /// `context_of`, then I2 for every (model, pool serving it). Reports every
    /// violation, not just the first.
    ///
    /// A node passes a `context_of` that returns the context of the model it loaded;
    /// offline checks use [`DeploymentConfig::check_offline`].
    pub fn check<E: fmt::Display>(
        &self,
        mut context_of: impl FnMut(&ModelEntry) -> Result<usize, E>,
    ) -> Verdict {
        let mut verdict = Verdict {
            violations: self.structural_violations(),
            ..Verdict::default()
        };
        let mut seen = HashSet::new();
        for m in self.models.iter().filter(|m| seen.insert(m.id.as_str())) {
            let context = match context_of(m) {
                Ok(c) => Some(c),
                Err(e) => {
                    verdict.violations.push(Violation::ContextUnknown {
                        model: m.id.clone(),
                        reason: e.to_string(),
                    });
                    None
                }
            };
            verdict.models.push(ModelContext {
                id: m.id.clone(),
                path: m.path.clone(),
                context,
            });
            let Some(context) = context else { continue };
            // A zero page size is already a violation; its I2 line would say nothing.
            for p in self
                .pools
                .iter()
                .filter(|p| p.page_size > 0 && p.serves(&m.id))
            {
                verdict.fits.push(PoolFit {
                    model: m.id.clone(),
                    context,
                    pool: p.name.clone(),
                    role: p.role,
                    usable_tokens: p.usable_tokens(),
                });
                if let Err(e) = p.check_fits(&m.id, context) {
                    verdict.violations.push(e.into());
                }
            }
        }
        verdict
    }

    /// [`DeploymentConfig::check`] with context windows from the model files
    /// ([`ModelEntry::context_window`]), and every identity's node-link files (what
    /// `tessera ops check-config` checks on the operator's machine).
    pub fn check_offline(&self) -> Verdict {
        self.check_offline_as(None)
    }

    /// [`Self::check_offline`] for the process whose identity is `me`: of the
    /// node-link files only its own (a gateway or node loads no other key, and
    /// should not be given the others).
    pub fn check_offline_for(&self, me: &LinkIdentity) -> Verdict {
        self.check_offline_as(Some(me))
    }

    fn check_offline_as(&self, only: Option<&LinkIdentity>) -> Verdict {
        // A `context` that disagrees with the GGUF is reported as such, and the pools
        // are still checked against the GGUF's window (the one admission uses).
        let mut mismatches = Vec::new();
        let mut verdict = self.check(|m| match m.context_window() {
            Err(ContextError::Mismatch {
                configured, gguf, ..
            }) => {
                mismatches.push(Violation::ContextMismatch {
                    model: m.id.clone(),
                    configured,
                    gguf,
                });
                Ok(gguf)
            }
            other => other,
        });
        verdict.violations.extend(mismatches);
        verdict.violations.extend(self.link_file_violations(only));
        verdict
    }
}
