//! Node membership without restarts: `tessera serve --config FILE` re-reads FILE on
//! SIGHUP or `POST /admin/v1/reload` (`tessera ops reload`) and applies the nodes
//! added to and removed from its pools; `tessera node` re-reads it on SIGHUP for the
//! prefill nodes a decode node accepts; and `tessera ops reload`, the client.
//!
//! A new file is taken as a whole or not at all: it must pass the same checks as at
//! start (structure, I2, the gateway's node-link files), change nothing but pool
//! membership (models, pools' settings, `[gateway]` and `[node_links]` need a
//! restart), and every added node must be reachable and pass the link checks (its
//! certificate names it, it serves its pool's model: the fingerprint check) before
//! any change is made. Otherwise the gateway serves on with the old membership and
//! the caller gets the reason.

use anyhow::{bail, Context, Result};
use clap::Args;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;
use tessera_config::{DeploymentConfig, LinkIdentity};
use tessera_gateway::Reload;
use tessera_serving::remote::NodeLinks;
use tessera_serving::EngineHandle;

/// The gateway's reloader of its deployment file.
pub(crate) struct DeploymentReloader {
    path: PathBuf,
    insecure_node_links: bool,
    /// The file as applied last (the lock also keeps reloads one at a time).
    applied: Mutex<DeploymentConfig>,
    /// Each `[[models]]` id with its engines (remote clusters).
    models: Vec<(String, EngineHandle)>,
}

impl DeploymentReloader {
    /// The reloader of `path`, which the gateway started with as `applied`.
    pub(crate) fn new(
        path: PathBuf,
        insecure_node_links: bool,
        applied: DeploymentConfig,
        models: Vec<(String, EngineHandle)>,
    ) -> Self {
        Self {
            path,
            insecure_node_links,
            applied: Mutex::new(applied),
            models,
        }
    }

    fn engine(&self, id: &str) -> Option<&EngineHandle> {
        self.models.iter().find(|(m, _)| m == id).map(|(_, e)| e)
    }
}

impl Reload for DeploymentReloader {
    fn reload(&self) -> Result<Value, String> {
        let mut applied = self.applied.lock().unwrap();
        let file = self.path.display();
        let (models, cfg) =
            crate::deployment::remote_deployment(&self.path, self.insecure_node_links).map_err(
                |e| {
                    format!("{e:#}")
                        .trim_start_matches("refusing to start: ")
                        .to_string()
                },
            )?;
        let restart = applied.changes_needing_restart(&cfg);
        if !restart.is_empty() {
            return Err(format!(
                "{file}: these changes need a restart (a reload applies only nodes added to or removed from existing pools): {}",
                restart.join("; ")
            ));
        }
        // Every model's added nodes are connected and checked before anything changes;
        // a failure drops the prepared changes (closing their links).
        let mut changes = Vec::new();
        let mut errors = Vec::new();
        for (entry, nodes) in &models {
            let Some(remote) = self.engine(&entry.id).and_then(|e| e.remote()) else {
                errors.push(format!("model {} is not served by this gateway", entry.id));
                continue;
            };
            match remote.prepare_members(&nodes.prefill, &nodes.decode) {
                Ok(c) => changes.push((entry.id.clone(), c)),
                Err(e) => errors.extend(e.into_iter().map(|e| format!("model {}: {e}", entry.id))),
            }
        }
        if !errors.is_empty() {
            return Err(format!("{file}: {}", errors.join("; ")));
        }
        let summary: Vec<Value> = changes
            .iter()
            .filter(|(_, c)| !c.is_empty())
            .map(|(id, c)| {
                let list = |v: Vec<(&str, String)>| -> Vec<Value> {
                    v.into_iter()
                        .map(|(role, addr)| json!({"role": role, "addr": addr}))
                        .collect()
                };
                json!({"model": id, "added": list(c.added()), "removed": list(c.removed())})
            })
            .collect();
        for (_, c) in changes {
            c.apply();
        }
        *applied = cfg;
        Ok(json!({"file": file.to_string(), "changed": summary}))
    }

    fn nodes(&self) -> Value {
        let models: Vec<Value> = self
            .models
            .iter()
            .map(|(id, e)| {
                let nodes = e.remote().map(|r| r.member_status()).unwrap_or_default();
                json!({"model": id, "nodes": nodes})
            })
            .collect();
        json!(models)
    }
}

/// `tessera node`: on SIGHUP, re-read `path` and take from it the prefill nodes this
/// (decode) node accepts links from, so a prefill node added to the file can write
/// into this node without a restart. A file that fails its checks is ignored (the
/// node logs why). Installed before the node serves, so a SIGHUP never kills it.
pub(crate) fn reload_node_peers_on_sighup(
    path: PathBuf,
    me: LinkIdentity,
    links: NodeLinks,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let mut hup = {
        let _g = rt.enter();
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?
    };
    std::thread::Builder::new()
        .name("tessera-sighup".into())
        .spawn(move || {
            rt.block_on(async move {
                while hup.recv().await.is_some() {
                    match reread_node_file(&path, &me) {
                        Ok(cfg) => {
                            let n = links.reload_peers(&cfg, &me);
                            tracing::warn!(file = %path.display(), writers = n, "SIGHUP: re-read the deployment file; accepting writer links from the prefill nodes it lists (and the other decode nodes, which move KV when they drain)");
                        }
                        Err(e) => {
                            tracing::error!(file = %path.display(), error = %format!("{e:#}"), "SIGHUP: refused the deployment file; keeping the old one");
                        }
                    }
                }
            })
        })?;
    Ok(())
}

/// The file `path` for node `me`: structurally valid, and still listing `me`.
fn reread_node_file(path: &std::path::Path, me: &LinkIdentity) -> Result<DeploymentConfig> {
    let cfg = DeploymentConfig::load(path)?;
    let problems = cfg.structural_violations();
    if !problems.is_empty() {
        let list: Vec<String> = problems.iter().map(|v| v.to_string()).collect();
        bail!("invalid: {}", list.join("; "));
    }
    if !cfg.link_identities().contains(me) {
        bail!("it no longer lists this node ({me:?}); drain it (SIGTERM) instead");
    }
    Ok(cfg)
}

/// How a CLI command reaches a running gateway's admin API (`tessera ops reload`,
/// `tessera tenant purge-cache`).
#[derive(Args, Debug)]
pub(crate) struct AdminCallArgs {
    /// The gateway's admin API: its `--admin-listen` address, else its `--listen`
    /// address (`http://` or `https://`, certificates checked against the system's roots).
    #[arg(long, default_value = "http://127.0.0.1:8787")]
    url: String,
    /// The admin token (else TESSERA_ADMIN_TOKEN, else --admin-token-file). Visible
    /// in `ps`: prefer the file or the environment.
    #[arg(long)]
    admin_token: Option<String>,
    /// File holding the admin token [default: DATA_DIR/admin-token, the token
    /// `tessera serve` creates, with DATA_DIR from TESSERA_DATA_DIR, else .tessera].
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// Seconds to wait for the gateway's answer (a reload connects to every added
    /// node first; a purge waits for every engine).
    #[arg(long, default_value_t = 60)]
    timeout_secs: u64,
}

/// Where `tessera serve` keeps the admin token it creates: `admin-token` in its
/// data directory (`TESSERA_DATA_DIR`, else `.tessera` in the working directory).
fn default_token_file() -> PathBuf {
    std::env::var_os("TESSERA_DATA_DIR")
        .filter(|d| !d.is_empty())
        .map_or_else(|| PathBuf::from(".tessera"), PathBuf::from)
        .join("admin-token")
}

/// `POST {url}{path}` on the gateway's admin API with the admin token (flag,
/// TESSERA_ADMIN_TOKEN, the token file, else `default_token`). Returns the
/// status, the parsed body (a JSON string of the raw body when it is not JSON) and
/// the raw body.
///
/// Errors: no admin token; the request failing (connection, timeout).
pub(crate) fn admin_post(
    a: &AdminCallArgs,
    path: &str,
    default_token: &Path,
) -> Result<(u16, Value, String)> {
    let token = match (
        &a.admin_token,
        std::env::var("TESSERA_ADMIN_TOKEN"),
        &a.admin_token_file,
    ) {
        (Some(t), _, _) => {
            crate::secret_flags::warn_secret_flag(
                "--admin-token",
                "--admin-token-file FILE or TESSERA_ADMIN_TOKEN",
            );
            t.clone()
        }
        (None, Ok(t), _) => t,
        (None, Err(_), Some(p)) => std::fs::read_to_string(p)
            .with_context(|| format!("reading the admin token file {}", p.display()))?,
        (None, Err(_), None) => {
            let p = default_token;
            match std::fs::read_to_string(p) {
                Ok(t) => t,
                Err(e) => bail!(
                    "no admin token: give --admin-token-file FILE or TESSERA_ADMIN_TOKEN \
                     (reading the default {}: {e})",
                    p.display()
                ),
            }
        }
    };
    if token.trim().is_empty() {
        bail!("the admin token is empty (--admin-token, TESSERA_ADMIN_TOKEN or its file)");
    }
    let url = format!("{}{path}", a.url.trim_end_matches('/'));
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let (status, body) = rt.block_on(async {
        let http = tessera_loadtest::client::http_client(Duration::from_secs(a.timeout_secs))?;
        let resp = http
            .post(&url)
            .bearer_auth(token.trim())
            .send()
            .await
            .with_context(|| format!("POST {url}"))?;
        let status = resp.status().as_u16();
        let body = resp.text().await?;
        anyhow::Ok((status, body))
    })?;
    let v: Value = serde_json::from_str(&body).unwrap_or(Value::String(body.clone()));
    Ok((status, v, body))
}

/// `tessera ops reload`: asks a running gateway (`POST /admin/v1/reload`, admin
/// token) to re-read its deployment file and apply its node membership. Prints what
/// changed; fails with the gateway's reason when it refused the file.
pub(crate) fn ops_reload(a: AdminCallArgs) -> Result<()> {
    let (status, v, body) = admin_post(&a, "/admin/v1/reload", &default_token_file())?;
    if (200..300).contains(&status) {
        println!(
            "tessera ops reload: applied: {}",
            serde_json::to_string_pretty(&v["result"]).unwrap_or(body)
        );
        return Ok(());
    }
    let reason = v["errors"][0]["message"]
        .as_str()
        .map(str::to_string)
        .unwrap_or(body);
    bail!("the gateway refused the reload ({status}): {reason}")
}
