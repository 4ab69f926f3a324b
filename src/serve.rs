//! `tessera serve`: the gateway, the engine and the tenancy store in one process.
//! On first start (an empty store) it creates a tenant and an API key and prints
//! both with a ready-to-paste curl command.

use crate::generate::model_path;
use anyhow::{Context, Result};
use clap::Args;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use tessera_config::{check_pool_fits, Role};
use tessera_engine::EngineConfig;
use tessera_gateway::{AppState, GatewayConfig, Server, TlsMode};
use tessera_model::gguf::DEFAULT_MODEL_ID;
use tessera_model::LoadedModel;
use tessera_serving::EngineHandle;
use tessera_tenancy::{Limits, Store};

/// Where the store lives: `--store URL`, or a SQLite file in `--data-dir`.
#[derive(Args, Debug, Clone)]
pub(crate) struct StoreArgs {
    /// Store URL: sqlite://PATH or postgres://USER@HOST/DB (default: SQLite in --data-dir).
    #[arg(long, env = "TESSERA_STORE", global = true)]
    store: Option<String>,
    /// Directory for the default SQLite store, the admin token and TLS files.
    #[arg(
        long,
        env = "TESSERA_DATA_DIR",
        default_value = ".tessera",
        global = true
    )]
    data_dir: PathBuf,
}

impl StoreArgs {
    pub(crate) async fn open(&self) -> Result<Store> {
        let url = match &self.store {
            Some(u) => u.clone(),
            None => {
                std::fs::create_dir_all(&self.data_dir)
                    .with_context(|| format!("creating {}", self.data_dir.display()))?;
                // The store holds key hashes and every tenant's usage: owner only.
                #[cfg(unix)]
                {
                    use std::os::unix::fs::PermissionsExt;
                    std::fs::set_permissions(
                        &self.data_dir,
                        std::fs::Permissions::from_mode(0o700),
                    )
                    .with_context(|| format!("restricting {}", self.data_dir.display()))?;
                }
                format!("sqlite://{}", self.data_dir.join("tessera.db").display())
            }
        };
        Store::connect(&url)
            .await
            .with_context(|| format!("opening store {url}"))
    }
}

/// Arguments of `tessera serve`.
#[derive(Args, Debug)]
pub(crate) struct ServeArgs {
    /// Address to listen on (plain HTTP only on loopback unless --allow-insecure-http;
    /// default 127.0.0.1:8787, or the deployment file's `[gateway] listen`).
    #[arg(long)]
    listen: Option<SocketAddr>,
    /// Deployment file: serve through the prefill and decode nodes it lists
    /// (`tessera node` processes) instead of engines in this process.
    #[arg(long, conflicts_with_all = ["colocated", "disaggregated"])]
    config: Option<PathBuf>,
    #[command(flatten)]
    store: StoreArgs,
    /// GGUF model file (default: the fetched default model).
    #[arg(long, env = "TESSERA_MODEL")]
    model: Option<PathBuf>,
    /// Run one prefill and one decode engine joined by the KV transfer protocol over
    /// the in-process transport (the default).
    #[arg(long, conflicts_with = "colocated")]
    disaggregated: bool,
    /// Run one engine that does prefill and decode itself (no transfer).
    #[arg(long)]
    colocated: bool,
    /// KV pool size in tokens (the decode engine's, or the co-located engine's).
    #[arg(long, default_value_t = EngineConfig::default().kv_pool_tokens)]
    kv_pool_tokens: usize,
    /// The prefill engine's KV pool size in tokens (disaggregated mode; it holds
    /// prompts only, and at least one full context window, I2).
    #[arg(long, default_value_t = 8192)]
    prefill_kv_pool_tokens: usize,
    /// Zero KV pages when they are freed (defence in depth; page tags already make
    /// freed pages unreadable).
    #[arg(long)]
    kv_scrub: bool,
    /// TLS: `off`, or `self-signed` (a fresh certificate for localhost, written to
    /// DATA_DIR/tls-cert.pem).
    #[arg(long, default_value = "off")]
    tls: String,
    /// TLS certificate chain (PEM); with --tls-key.
    #[arg(long, requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// TLS private key (PEM).
    #[arg(long, requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Allow plain HTTP on a non-loopback address.
    #[arg(long)]
    allow_insecure_http: bool,
    /// Admin API token (default: DATA_DIR/admin-token, created on first start).
    #[arg(long, env = "TESSERA_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Largest accepted request body in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// On Ctrl-C or SIGTERM: seconds running requests may finish before they are aborted.
    #[arg(long, default_value_t = 30)]
    drain_timeout_secs: u64,
}

fn admin_token(dir: &Path) -> Result<(String, bool)> {
    let p = dir.join("admin-token");
    if let Ok(t) = std::fs::read_to_string(&p) {
        return Ok((t.trim().to_string(), false));
    }
    std::fs::create_dir_all(dir)?;
    let t = format!("tadm_{}", tessera_tenancy::random_hex(24));
    std::fs::write(&p, format!("{t}\n")).with_context(|| format!("writing {}", p.display()))?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600))?;
    }
    Ok((t, true))
}

/// `println!` that ignores a closed stdout (a supervisor or test that stopped
/// reading the banner must not take the server down).
macro_rules! say {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, $($t)*);
        let _ = out.flush();
    }};
}

pub(crate) fn run(a: ServeArgs) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(serve(a))
}

async fn serve(a: ServeArgs) -> Result<()> {
    let remote = match &a.config {
        Some(f) => Some(crate::node::remote_deployment(f)?),
        None => None,
    };
    let path = match &remote {
        Some((entry, _, _)) if a.model.is_none() => entry.path.clone(),
        _ => model_path(a.model.clone())?,
    };
    let model = LoadedModel::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let listen = a
        .listen
        .or(remote.as_ref().map(|(_, _, cfg)| cfg.gateway.listen))
        .unwrap_or_else(|| "127.0.0.1:8787".parse().expect("valid address"));
    let engine_cfg = |tokens: usize| EngineConfig {
        kv_pool_tokens: tokens,
        kv_scrub: a.kv_scrub,
        ..EngineConfig::default()
    };
    let context = model.llama.config().context;
    // I2: refuse to start with a pool that cannot hold one full context window.
    let pools: &[(Role, &str, usize)] = if remote.is_some() {
        &[] // the nodes check their own pools; the file was checked above
    } else if a.colocated {
        &[(Role::Colocated, "colocated", a.kv_pool_tokens)]
    } else {
        &[
            (Role::Prefill, "prefill", a.prefill_kv_pool_tokens),
            (Role::Decode, "decode", a.kv_pool_tokens),
        ]
    };
    for &(role, name, tokens) in pools {
        let page = EngineConfig::default().page_size;
        check_pool_fits(DEFAULT_MODEL_ID, context, role, name, tokens / page * page)
            .map_err(|e| anyhow::anyhow!("refusing to start: {e}"))?;
    }
    let engine = if let Some((_, nodes, _)) = remote {
        EngineHandle::connect_remote(&model, nodes)
    } else if a.colocated {
        EngineHandle::spawn(&model, engine_cfg(a.kv_pool_tokens))
    } else {
        EngineHandle::spawn_disaggregated(
            &model,
            &[engine_cfg(a.prefill_kv_pool_tokens)],
            &[engine_cfg(a.kv_pool_tokens)],
        )
    };
    let store = a.store.open().await?;
    let data_dir = &a.store.data_dir;
    let (admin, admin_new) = match &a.admin_token {
        Some(t) => (t.clone(), false),
        None => admin_token(data_dir)?,
    };
    let tls = match (a.tls.as_str(), &a.tls_cert, &a.tls_key) {
        (_, Some(cert), Some(key)) => TlsMode::Files {
            cert: cert.clone(),
            key: key.clone(),
        },
        ("off", _, _) => TlsMode::Off,
        ("self-signed", _, _) => {
            std::fs::create_dir_all(data_dir)?;
            TlsMode::SelfSigned(Some(data_dir.join("tls-cert.pem")))
        }
        (other, _, _) => anyhow::bail!("--tls must be `off` or `self-signed`. Given: {other}"),
    };
    let cfg = GatewayConfig {
        listen,
        tls: tls.clone(),
        allow_insecure_http: a.allow_insecure_http,
        max_body_bytes: a.max_body_bytes,
        admin_token: Some(admin),
        drain_timeout: std::time::Duration::from_secs(a.drain_timeout_secs),
    };
    let state = AppState::new(store.clone(), model, engine.clone(), &cfg);
    let server = Server::bind(&cfg, state).await?;
    let addr = server.local_addr();
    let base = format!("{}://{}", server.scheme(), addr);
    let limits = engine.limits();
    let mode = match engine.cluster() {
        None if engine.remote().is_some() => format!(
            "remote prefill/decode nodes from {}, decode KV pool {} tokens",
            a.config.as_deref().unwrap_or(Path::new("")).display(),
            limits.pool_tokens
        ),
        Some(c) => format!(
            "disaggregated: prefill KV pool {} tokens, decode KV pool {} tokens, in-process transfer",
            c.admission().prefill_pool_tokens,
            limits.pool_tokens
        ),
        None => format!("co-located: KV pool {} tokens", limits.pool_tokens),
    };
    say!(
        "tessera: serving {DEFAULT_MODEL_ID} (context {} tokens; {mode}) from {}",
        limits.context,
        path.display()
    );
    say!(
        "tessera: store {} ({})",
        store.backend(),
        a.store.store.as_deref().unwrap_or("SQLite in data dir")
    );
    if admin_new {
        say!(
            "tessera: admin token written to {}",
            data_dir.join("admin-token").display()
        );
    }
    let shutdown = shutdown_signal();
    let tenants = store.list_tenants().await?;
    let (account, key) = if tenants.is_empty() {
        let t = store.create_tenant("default", Limits::default()).await?;
        let (_, key) = store.create_key(&t.id, "default").await?;
        say!("tessera: first start: created tenant `default`");
        say!("  account id: {}", t.id);
        say!("  API key:    {key}");
        say!("  (the key is shown once; only its hash is stored)");
        (t.id, key)
    } else {
        say!(
            "tessera: {} tenant(s) in the store; create keys with `tessera key create --tenant ID`",
            tenants.len()
        );
        (tenants[0].id.clone(), "$TESSERA_API_KEY".to_string())
    };
    let cacert = match &tls {
        TlsMode::SelfSigned(Some(p)) => format!(" --cacert {}", p.display()),
        _ => String::new(),
    };
    let host = if addr.ip().is_loopback() && matches!(tls, TlsMode::SelfSigned(_)) {
        format!("https://localhost:{}", addr.port())
    } else {
        base.clone()
    };
    say!("tessera: listening on {base}");
    say!("");
    say!("Try it:");
    say!(
        "curl{cacert} {host}/client/v4/accounts/{account}/ai/run/{DEFAULT_MODEL_ID} \\\n  -H \"Authorization: Bearer {key}\" \\\n  -d '{{\"prompt\": \"What is a tessellation?\", \"max_tokens\": 64}}'"
    );
    say!("");
    server
        .run_until(async {
            shutdown.await;
            eprintln!("tessera: shutting down (draining running requests)");
        })
        .await
}

/// Ctrl-C, or SIGTERM (what service managers and Kubernetes send). The handlers are
/// installed when this is called, before the future is first polled, so a signal that
/// arrives right after the banner (a supervisor that stops the server at once) drains
/// instead of killing the process.
fn shutdown_signal() -> impl std::future::Future<Output = ()> {
    #[cfg(unix)]
    let term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let ctrl_c = tokio::signal::ctrl_c();
    async move {
        #[cfg(unix)]
        if let Some(mut term) = term {
            tokio::select! {
                _ = ctrl_c => {}
                _ = term.recv() => {}
            }
            return;
        }
        let _ = ctrl_c.await;
    }
}
