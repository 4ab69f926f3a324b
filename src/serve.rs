//! `tessera serve`: the gateway, the engine and the tenancy store in one process.
//! On first start (an empty store) it creates a tenant and an API key and prints
//! both with a ready-to-paste curl command.

use crate::generate::model_path;
use crate::secret_flags::{on_command_line, warn_secret_flag};
use crate::tenancy_cli::{DefaultLimitArgs, StoreArgs};
use anyhow::{Context, Result};
use clap::Args;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tessera_config::secret_files::{check_token_file_mode, create_private_dir, create_secret_file};
use tessera_config::{check_pool_fits, NodeRole};
use tessera_gateway::catalog::{CatalogEntry, Dated};
use tessera_gateway::{
    check_token, AppState, ConnLimits, Deadlines, GatewayOptions, ServedModel, Server, TlsMode,
    UsageConfig,
};
use tessera_model::gguf::DEFAULT_MODEL_ID;
use tessera_model::LoadedModel;
use tessera_serving::{EngineConfig, EngineHandle};
use tessera_tenancy::{AuditCtx, NewKey};

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
    /// A model to serve, as `ID=PATH` (catalog id, GGUF file) or a bare `PATH`
    /// (served as the default model's id); repeatable: every model gets its own
    /// engines (each with the pool sizes below) and requests are routed by model id.
    /// Default: the fetched default model. With --config the file's `[[models]]` are
    /// served instead.
    #[arg(long, env = "TESSERA_MODEL", value_parser = parse_model_arg, conflicts_with = "config")]
    model: Vec<ModelArg>,
    /// Run one prefill and one decode engine joined by the KV transfer protocol over
    /// the in-process transport (the default).
    #[arg(long, conflicts_with = "colocated")]
    disaggregated: bool,
    /// Run one engine that does prefill and decode itself (no transfer).
    #[arg(long)]
    colocated: bool,
    /// KV pool size in tokens (the decode engine's, or the co-located engine's).
    /// Default: 16384, or a model's context window when that is larger (I2: a pool
    /// holds at least one full context); a value given here applies to every model
    /// and one under a model's window refuses to start.
    #[arg(long)]
    kv_pool_tokens: Option<usize>,
    /// The prefill engine's KV pool size in tokens (disaggregated mode; it holds
    /// prompts only, and at least one full context window, I2). Default: 8192, or
    /// a model's context window when that is larger.
    #[arg(long)]
    prefill_kv_pool_tokens: Option<usize>,
    /// Zero KV pages when they are freed (defence in depth; page tags already make
    /// freed pages unreadable).
    #[arg(long)]
    kv_scrub: bool,
    /// Prompt-lookup speculation: draft tokens per decoding request and step (0:
    /// off, at most 8), for requests that do not set `speculative` themselves. Drafts
    /// come from each request's own prompt and output; the output is the same with or
    /// without them (faster where answers repeat their input, e.g. code edits).
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u32).range(0..=8))]
    speculate: u32,
    /// Draft-model speculation: `ID=PATH` (or a bare `PATH` for the first --model),
    /// a GGUF of a smaller model with the same tokenizer that drafts for model ID;
    /// repeatable, one per model. Requests of that model may then ask for
    /// `speculative` mode `draft`, which is also the mode of those that speculate
    /// without naming one (with --speculate K: every request). The output is the
    /// same with or without drafts. With --config: the file's `draft` per model.
    #[arg(long, value_parser = parse_draft_arg, conflicts_with = "config")]
    draft_model: Vec<(Option<String>, PathBuf)>,
    #[command(flatten)]
    kv_spill: crate::kv_spill::KvSpillArgs,
    #[command(flatten)]
    device: crate::device::DeviceArgs,
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
    /// Admin API token, at least 32 bytes with 16 distinct (else TESSERA_ADMIN_TOKEN,
    /// else --admin-token-file, else DATA_DIR/admin-token, created 0600 on first
    /// start). On the command line every local user can read it (ps): prefer the
    /// file or the environment (a warning says so).
    #[arg(long)]
    admin_token: Option<String>,
    /// File holding the admin token (at least 32 bytes with 16 distinct; must exist).
    #[arg(long)]
    admin_token_file: Option<PathBuf>,
    /// Token that reads /metrics and nothing else (at least 32 bytes with 16
    /// distinct; surrounding whitespace is ignored). Prefer TESSERA_METRICS_TOKEN to
    /// the flag, which every local user can read (ps).
    #[arg(long, env = "TESSERA_METRICS_TOKEN", hide_env_values = true)]
    metrics_token: Option<String>,
    /// Serve the admin API and /metrics on this address instead of --listen (then
    /// the public port answers 404 there).
    #[arg(long)]
    admin_listen: Option<SocketAddr>,
    #[command(flatten)]
    defaults: DefaultLimitArgs,
    /// Largest accepted request body in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// Largest accepted LoRA adapter upload (`ai/finetunes`) in bytes.
    #[arg(long, default_value_t = tessera_gateway::DEFAULT_MAX_FINETUNE_BYTES)]
    max_finetune_bytes: usize,
    /// Seconds a client has to send a request head (request line and headers);
    /// also bounds an idle kept-alive connection.
    #[arg(long, default_value_t = 10)]
    header_timeout_secs: u64,
    /// Seconds a client has to send the whole request body (then 408, 3007).
    #[arg(long, default_value_t = 30)]
    body_timeout_secs: u64,
    /// Seconds a client has to finish the TLS handshake.
    #[arg(long, default_value_t = 10)]
    tls_handshake_timeout_secs: u64,
    /// Seconds a kept-alive connection may sit idle (no request, no bytes).
    #[arg(long, default_value_t = 5)]
    keepalive_idle_secs: u64,
    /// Most client connections open at once (per listener).
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// Seconds from arrival to the first token before a request is aborted (408, 3007).
    #[arg(long, default_value_t = 120)]
    ttft_timeout_secs: u64,
    /// Seconds from arrival to the end of the answer before it is aborted (408, 3007).
    #[arg(long, default_value_t = 600)]
    request_timeout_secs: u64,
    /// Usage-API queries per tenant per minute (0: unlimited).
    #[arg(long, default_value_t = 60)]
    usage_rpm: u32,
    /// Longest time range one usage query may cover, in days.
    #[arg(long, default_value_t = 31)]
    usage_max_range_days: u64,
    /// Delete ledger rows older than this many days (checked hourly; 0: keep forever).
    #[arg(long, default_value_t = 90)]
    usage_retention_days: u64,
    /// On Ctrl-C or SIGTERM: seconds running requests may finish before they are aborted.
    #[arg(long, default_value_t = 30)]
    drain_timeout_secs: u64,
    /// Where per-tenant limits live: `memory` (this process; N gateways allow N times
    /// the limits) or `redis://HOST:PORT` / `redis+unix:///PATH` (shared by every
    /// gateway on that Redis: rate limits, concurrency and the daily quota).
    #[arg(long, default_value = "memory", env = "TESSERA_LIMITS")]
    limits: String,
    /// With `--limits redis://...`: what a request gets while Redis fails: `closed`
    /// (503, and /readyz fails) or `open` (this gateway's own limits).
    #[arg(long, default_value = "closed")]
    limits_on_failure: tessera_tenancy::limits::FailMode,
    /// With `--limits redis://...`: seconds a concurrency slot outlives a gateway
    /// that died holding it.
    #[arg(long, default_value_t = 30)]
    limits_lease_secs: u64,
    /// Seconds a finished async batch's results (`?queueRequest=true`) are kept for polling.
    #[arg(long, default_value_t = 3600)]
    batch_retention_secs: u64,
    /// With --config: plain TCP node links instead of mutual TLS, only when every node
    /// of the deployment file is on loopback (refuses to start otherwise).
    #[arg(long, requires = "config")]
    insecure_node_links: bool,
    /// Tenants with their own `tenant` label in /metrics: the top N by requests (the
    /// rest are `other`).
    #[arg(long, default_value_t = tessera_gateway::metrics::DEFAULT_TOP_TENANTS)]
    metrics_top_tenants: usize,
    /// Put each request's prompt and output text in its log line (debugging only:
    /// tenants' data lands in the logs).
    #[arg(long)]
    log_request_text: bool,
    /// A tenant asking for a private model it may not use gets the same 404 (Workers
    /// AI 5007) as for an unknown model, so private model ids cannot be probed
    /// (default: 403 with Workers AI code 5018 naming the model).
    #[arg(long)]
    private_models_as_404: bool,
}

/// One `--model` value: the catalog id and the GGUF file.
#[derive(Clone, Debug)]
pub(crate) struct ModelArg {
    id: String,
    path: PathBuf,
}

/// Parses `ID=PATH` or `PATH` (the default model's id). The id must be 1 to 256
/// bytes without whitespace; the message names `--model` and the value.
fn parse_model_arg(v: &str) -> Result<ModelArg, String> {
    let (id, path) = match v.split_once('=') {
        Some((id, path)) => (id.to_string(), path),
        None => (DEFAULT_MODEL_ID.to_string(), v),
    };
    if id.is_empty() || id.len() > tessera_gateway::MAX_ID_BYTES || id.contains(char::is_whitespace)
    {
        return Err(format!(
            "--model: the model id must be 1 to {} bytes without whitespace (ID=PATH). Given: {v:?}",
            tessera_gateway::MAX_ID_BYTES
        ));
    }
    if path.is_empty() {
        return Err(format!("--model: no file after `=`. Given: {v:?}"));
    }
    Ok(ModelArg {
        id,
        path: path.into(),
    })
}

/// Parses `--draft-model`: `ID=PATH`, or `PATH` (`None`: the first model's).
fn parse_draft_arg(v: &str) -> Result<(Option<String>, PathBuf), String> {
    let m = parse_model_arg(v).map_err(|e| e.replace("--model", "--draft-model"))?;
    Ok((v.contains('=').then_some(m.id), m.path))
}

/// Loads `path` as the draft model of `model` (served as `id`).
///
/// Errors: the file does not load, or its tokenizer is not the served model's.
pub(crate) fn load_draft(
    id: &str,
    path: &Path,
    model: &LoadedModel,
) -> Result<tessera_serving::DraftModel> {
    let small = load(path)?;
    tessera_serving::DraftModel::new(
        small.transformer.clone(),
        &small.tokenizer,
        &model.tokenizer,
    )
    .map_err(|e| anyhow::anyhow!("the draft model {} for {id}: {e}", path.display()))
}

/// A fresh admin token: `tadm_` and 48 random hex digits, drawn again in the rare
/// case it has too few distinct bytes for [`check_token`].
fn new_admin_token() -> String {
    loop {
        let t = format!("tadm_{}", tessera_tenancy::random_hex(24));
        if check_token("admin token", &t).is_ok() {
            return t;
        }
    }
}

/// Refuses an admin token file that group or others can write; warns when others
/// can read it.
fn token_file_mode(p: &Path) -> Result<()> {
    let others_read = check_token_file_mode(p)
        .map_err(|e| anyhow::anyhow!("refusing to start: {}: {e}", p.display()))?;
    if others_read {
        eprintln!(
            "warning: the admin token file {} is readable by every local user; run `chmod 600 {}`",
            p.display(),
            p.display()
        );
    }
    Ok(())
}

/// The admin token and where it came from: `--admin-token` (with a warning: it is
/// visible in `ps`), `TESSERA_ADMIN_TOKEN`, `--admin-token-file`, or
/// DATA_DIR/admin-token (created `0600` with `O_EXCL`, its directory `0700`, holding a
/// fresh token, when absent). Refuses an empty, short or repetitive token, naming its
/// source. Returns (token, whether the file was just created).
fn admin_token(a: &ServeArgs) -> Result<(String, bool)> {
    let checked = |t: String, source: String| -> Result<(String, bool)> {
        check_token(&format!("admin token from {source}"), &t)?;
        Ok((t.trim().to_string(), false))
    };
    if let Some(t) = &a.admin_token {
        warn_secret_flag(
            "--admin-token",
            "--admin-token-file FILE or TESSERA_ADMIN_TOKEN",
        );
        return checked(t.clone(), "--admin-token".into());
    }
    if let Some(t) = std::env::var_os("TESSERA_ADMIN_TOKEN") {
        return checked(
            t.to_string_lossy().into_owned(),
            "TESSERA_ADMIN_TOKEN".into(),
        );
    }
    if let Some(p) = &a.admin_token_file {
        let t = std::fs::read_to_string(p)
            .with_context(|| format!("reading the admin token file {}", p.display()))?;
        token_file_mode(p)?;
        return checked(t, format!("file {}", p.display()));
    }
    let dir = &a.store.data_dir;
    let p = dir.join("admin-token");
    if let Ok(t) = std::fs::read_to_string(&p) {
        token_file_mode(&p)?;
        return checked(t, format!("file {}", p.display()));
    }
    create_private_dir(dir).with_context(|| format!("creating {}", dir.display()))?;
    let t = new_admin_token();
    create_secret_file(&p, format!("{t}\n").as_bytes())
        .with_context(|| format!("creating {}", p.display()))?;
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
    // Tokens first: a bad one fails at once, before the model loads.
    let (admin, admin_new) = admin_token(&a)?;
    // Trimmed like the admin token: `--metrics-token " T "` must match `Bearer T`.
    let metrics_token = a.metrics_token.as_deref().map(str::trim);
    if let Some(t) = metrics_token {
        let source = if on_command_line("--metrics-token") {
            warn_secret_flag("--metrics-token", "TESSERA_METRICS_TOKEN");
            "--metrics-token"
        } else {
            "TESSERA_METRICS_TOKEN"
        };
        check_token(&format!("metrics token from {source}"), t)?;
    }
    device_check(&a)?;
    let remote = match &a.config {
        Some(f) => Some(crate::deployment::remote_deployment(
            f,
            a.insecure_node_links,
        )?),
        None => None,
    };
    let listen = a
        .listen
        .or(remote.as_ref().map(|(_, cfg)| cfg.gateway.listen))
        .unwrap_or_else(|| "127.0.0.1:8787".parse().expect("valid address"));
    let mut reloader = None;
    let served: Vec<(ServedModel, PathBuf)> = match remote {
        Some((models, deployment)) => {
            let mut served = Vec::new();
            let mut engines = Vec::new();
            // The gateway's node-link counters, for every model's nodes.
            let metrics = std::sync::Arc::new(tessera_serving::NodeMetrics::new());
            for (entry, nodes) in models {
                let model = load(&entry.path)?;
                let engine = EngineHandle::connect_remote_in(&model, nodes, metrics.clone());
                engines.push((entry.id.clone(), engine.clone()));
                let catalog = catalog_entry(&entry, &model, engine.limits().context)?;
                served.push((ServedModel::with_entry(catalog, model, engine), entry.path));
            }
            if let Some(f) = &a.config {
                reloader = Some(crate::reload::DeploymentReloader::new(
                    f.clone(),
                    a.insecure_node_links,
                    deployment,
                    engines,
                ));
            }
            served
        }
        None => embedded(&a)?
            .into_iter()
            .map(|(id, path, model, engine)| (ServedModel::new(&id, model, engine), path))
            .collect(),
    };
    let engine = served[0].0.engine.clone();
    let first_id = served[0].0.entry.id.clone();
    let model_lines: Vec<String> = served
        .iter()
        .map(|(m, path)| {
            let limits = m.engine.limits();
            let pools = match m.engine.cluster() {
                Some(c) => format!(
                    "prefill pool {}, decode pool {}",
                    c.admission().prefill_pool_tokens,
                    limits.pool_tokens
                ),
                None => format!("pool {}", limits.pool_tokens),
            };
            let drafts = if m.engine.admission().limits.draft {
                "; a draft model drafts for it"
            } else {
                ""
            };
            format!(
                "tessera: serving {} (context {} tokens; {pools} tokens{drafts}) from {}",
                m.entry.id,
                m.entry.context_window,
                path.display()
            )
        })
        .collect();
    let served: Vec<ServedModel> = served.into_iter().map(|(m, _)| m).collect();
    let store = a.store.open().await?;
    let data_dir = &a.store.data_dir;
    let tls = match (a.tls.as_str(), &a.tls_cert, &a.tls_key) {
        (_, Some(cert), Some(key)) => TlsMode::Files {
            cert: cert.clone(),
            key: key.clone(),
        },
        ("off", _, _) => TlsMode::Off,
        ("self-signed", _, _) => {
            create_private_dir(data_dir)?;
            TlsMode::SelfSigned(Some(data_dir.join("tls-cert.pem")))
        }
        (other, _, _) => anyhow::bail!("--tls must be `off` or `self-signed`. Given: {other}"),
    };
    let secs = Duration::from_secs;
    let default_limits = a.defaults.limits();
    let cfg = GatewayOptions {
        listen,
        admin_listen: a.admin_listen,
        tls: tls.clone(),
        allow_insecure_http: a.allow_insecure_http,
        max_body_bytes: a.max_body_bytes,
        max_finetune_bytes: a.max_finetune_bytes,
        admin_token: Some(admin),
        metrics_token: metrics_token.map(str::to_string),
        default_limits,
        conn: ConnLimits {
            header_read: secs(a.header_timeout_secs),
            tls_handshake: secs(a.tls_handshake_timeout_secs),
            keepalive_idle: secs(a.keepalive_idle_secs),
            max_connections: a.max_connections,
        },
        deadlines: Deadlines {
            body_read: secs(a.body_timeout_secs),
            first_token: secs(a.ttft_timeout_secs),
            total: secs(a.request_timeout_secs),
        },
        usage: UsageConfig {
            queries_per_minute: a.usage_rpm,
            max_range: secs(a.usage_max_range_days.saturating_mul(86_400)),
            retention: (a.usage_retention_days > 0)
                .then(|| secs(a.usage_retention_days.saturating_mul(86_400))),
            ..UsageConfig::default()
        },
        drain_timeout: secs(a.drain_timeout_secs),
        batch_retention: secs(a.batch_retention_secs),
        shared_limits: shared_limits(&a)?,
        metrics_top_tenants: a.metrics_top_tenants,
        log_request_text: a.log_request_text,
        private_models_as_404: a.private_models_as_404,
        ..GatewayOptions::default()
    };
    let state = AppState::with_models(store.clone(), served, &cfg)
        .map_err(|e| anyhow::anyhow!("refusing to start: {e}"))?;
    if let Some(r) = reloader {
        state.set_reloader(std::sync::Arc::new(r));
        reload_on_sighup(state.clone())?;
    }
    let server = Server::bind(&cfg, state).await?;
    let addr = server.local_addr();
    let admin_base = server
        .admin_addr()
        .map(|a| format!("{}://{a}", server.scheme()));
    let base = format!("{}://{}", server.scheme(), addr);
    let limits = engine.limits();
    let mode = match engine.cluster() {
        None if engine.remote().is_some() => format!(
            "remote prefill/decode nodes from {}, decode KV pool {} tokens",
            a.config.as_deref().unwrap_or(Path::new("")).display(),
            limits.pool_tokens
        ),
        Some(_) => "disaggregated: a prefill and a decode engine, in-process transfer".into(),
        None => "co-located: one engine".into(),
    };
    for line in &model_lines {
        say!("{line}");
    }
    say!("tessera: engines: {mode} (per model)");
    say!(
        "tessera: store {} ({})",
        store.backend(),
        a.store
            .store
            .as_deref()
            .map_or("SQLite in data dir".into(), redact_password)
    );
    match a.limits.as_str() {
        "memory" => say!("tessera: limits in this process's memory (per gateway)"),
        url => say!(
            "tessera: limits shared in {} (on failure: {}, leases {} s)",
            redact_password(url),
            a.limits_on_failure.label(),
            a.limits_lease_secs
        ),
    }
    if admin_new {
        say!(
            "tessera: admin token written to {}",
            data_dir.join("admin-token").display()
        );
    }
    let shutdown = shutdown_signal();
    let tenants = store.list_tenants().await?;
    let (account, key) = if tenants.is_empty() {
        let by = AuditCtx {
            request_id: tessera_tenancy::random_hex(16),
            source: "serve:first-start".into(),
        };
        let admin = store.audited(&by);
        let t = admin.create_tenant("default", default_limits).await?;
        // The account owner's key: every scope, `keys:write` (the dashboard's key
        // management) and `finetunes:write` included.
        let owner = NewKey {
            scopes: tessera_tenancy::Scopes::ALL,
            ..NewKey::named("default")
        };
        let (_, key) = admin.create_key(&t.id, &owner).await?;
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
    say!("tessera: usage dashboard on {host}/dash/ (sign in with a key holding usage:read)");
    match &admin_base {
        Some(ab) => {
            say!("tessera: admin API, /metrics and the operator view ({ab}/dash/admin/) on {ab}")
        }
        None => say!("tessera: operator view on {host}/dash/admin/ (sign in with the admin token)"),
    }
    say!("");
    say!("Try it:");
    say!(
        "curl{cacert} {host}/client/v4/accounts/{account}/ai/run/{first_id} \\\n  -H \"Authorization: Bearer {key}\" \\\n  -d '{{\"prompt\": \"What is a tessellation?\", \"max_tokens\": 64}}'"
    );
    say!("");
    server
        .run_until(async {
            shutdown.await;
            eprintln!("tessera: shutting down (draining running requests)");
        })
        .await?;
    Ok(())
}

/// The catalog entry of a deployment file's model: the GGUF's metadata and the
/// file's description, tags, aliases and deprecation and sunset dates.
fn catalog_entry(
    e: &tessera_config::ModelEntry,
    model: &LoadedModel,
    context: usize,
) -> Result<CatalogEntry> {
    let mut c = CatalogEntry::new(&e.id, context).with_file(&model.info);
    if let Some(d) = &e.description {
        c.description = d.clone();
    }
    c.tags = e.tags.clone();
    c.aliases = e.aliases.clone();
    let dated = |field: &str, v: &Option<String>| -> Result<Option<Dated>> {
        v.as_ref()
            .map(|d| {
                let unix = tessera_config::parse_date(d)
                    .map_err(|r| anyhow::anyhow!("model {}: `{field}` {r}", e.id))?;
                Ok(Dated {
                    date: d.clone(),
                    unix,
                })
            })
            .transpose()
    };
    c.deprecated = dated("deprecated", &e.deprecated)?;
    c.sunset = dated("sunset", &e.sunset)?;
    Ok(c)
}

fn load(path: &Path) -> Result<LoadedModel> {
    LoadedModel::load(path).with_context(|| format!("loading {}", path.display()))
}

/// The `--model` values, or the fetched default model when none is given.
fn model_args(a: &ServeArgs) -> Result<Vec<ModelArg>> {
    if !a.model.is_empty() {
        return Ok(a.model.clone());
    }
    Ok(vec![ModelArg {
        id: DEFAULT_MODEL_ID.into(),
        path: model_path(None)?,
    }])
}

/// The decode (or co-located) pool of a model whose context window is smaller.
const DEFAULT_DECODE_POOL_TOKENS: usize = 16384;
/// The prefill pool of a model whose context window is smaller.
const DEFAULT_PREFILL_POOL_TOKENS: usize = 8192;

/// The models of `tessera serve` without a deployment file, each loaded and given
/// its own engines in this process: (id, path, model, engines). Refuses to start
/// when a pool cannot hold one full context window of a model (I2), naming both.
fn embedded(a: &ServeArgs) -> Result<Vec<(String, PathBuf, LoadedModel, EngineHandle)>> {
    let args = model_args(a)?;
    for (i, (id, _)) in a.draft_model.iter().enumerate() {
        let named = |j: usize| {
            a.draft_model[j]
                .0
                .as_deref()
                .unwrap_or(&args[0].id)
                .to_string()
        };
        let id = id.as_deref().unwrap_or(&args[0].id);
        if !args.iter().any(|m| m.id.eq_ignore_ascii_case(id)) {
            anyhow::bail!("--draft-model: no --model has the id {id}");
        }
        if (0..i).any(|j| named(j).eq_ignore_ascii_case(id)) {
            anyhow::bail!("--draft-model: model {id} is given two draft models");
        }
    }
    let engine_cfg = |tokens: usize| EngineConfig {
        kv_pool_tokens: tokens,
        kv_scrub: a.kv_scrub,
        speculate: a.speculate as usize,
        ..EngineConfig::default()
    };
    // The engine that keeps the prefix cache (prefill, or co-located) gets the tiers.
    let spill_default = a.store.data_dir.join("kv-spill");
    let caching_cfg = |tokens: usize, model: &LoadedModel, name: String| -> Result<EngineConfig> {
        let mut cfg = engine_cfg(tokens);
        let page_bytes = model
            .transformer
            .config()
            .kv_layout(cfg.page_size)
            .page_bytes();
        cfg.spill = a.kv_spill.config(page_bytes, Some(&spill_default), &name)?;
        Ok(cfg)
    };
    // Unset sizes follow each model's context window (I2) above their floors.
    let sized =
        |given: Option<usize>, floor: usize, context: usize| given.unwrap_or(floor.max(context));
    // One registry for every model's engines; with several models node names carry
    // the model's position (`m1-decode-0`).
    let metrics = std::sync::Arc::new(tessera_serving::NodeMetrics::new());
    let mut out = Vec::new();
    for (i, m) in args.iter().enumerate() {
        if out
            .iter()
            .any(|(id, ..): &(String, _, _, _)| id.eq_ignore_ascii_case(&m.id))
        {
            anyhow::bail!("--model: model id {} is given twice", m.id);
        }
        let model = load(&m.path)?;
        let draft = match a.draft_model.iter().find(|(id, _)| {
            id.as_deref()
                .map_or(i == 0, |d| d.eq_ignore_ascii_case(&m.id))
        }) {
            Some((_, path)) => Some(load_draft(&m.id, path, &model)?),
            None => None,
        };
        let context = model.transformer.config().context;
        let (decode_tokens, prefill_tokens) = (
            sized(a.kv_pool_tokens, DEFAULT_DECODE_POOL_TOKENS, context),
            sized(
                a.prefill_kv_pool_tokens,
                DEFAULT_PREFILL_POOL_TOKENS,
                context,
            ),
        );
        let pools: &[(NodeRole, &str, usize)] = if a.colocated {
            &[(NodeRole::Colocated, "colocated", decode_tokens)]
        } else {
            &[
                (NodeRole::Prefill, "prefill", prefill_tokens),
                (NodeRole::Decode, "decode", decode_tokens),
            ]
        };
        // I2: refuse to start with a pool that cannot hold one full context window.
        for &(role, name, tokens) in pools {
            let page = EngineConfig::default().page_size;
            check_pool_fits(&m.id, context, role, name, tokens / page * page)
                .map_err(|e| anyhow::anyhow!("refusing to start: {e}"))?;
        }
        let prefix = if args.len() > 1 {
            format!("m{i}-")
        } else {
            String::new()
        };
        let engine = if a.colocated {
            let mut cfg = caching_cfg(decode_tokens, &model, format!("{prefix}colocated"))?;
            cfg.draft = draft;
            EngineHandle::spawn_in(&model, cfg, metrics.clone(), &prefix)
        } else {
            EngineHandle::spawn_disaggregated_in(
                &model,
                &[caching_cfg(
                    prefill_tokens,
                    &model,
                    format!("{prefix}prefill-0"),
                )?],
                &[EngineConfig {
                    draft,
                    ..engine_cfg(decode_tokens)
                }],
                metrics.clone(),
                &prefix,
            )
        };
        out.push((m.id.clone(), m.path.clone(), model, engine));
    }
    Ok(out)
}

/// With `--config`: SIGHUP re-reads the deployment file and applies its node
/// membership (as `POST /admin/v1/reload` does; the outcome is logged and counted).
/// Installed before the banner, so a SIGHUP never ends the process.
fn reload_on_sighup(state: std::sync::Arc<AppState>) -> Result<()> {
    #[cfg(unix)]
    {
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())?;
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                let st = state.clone();
                // The outcome is logged and counted by reload_deployment.
                let _ = tokio::task::spawn_blocking(move || st.reload_deployment("SIGHUP")).await;
            }
        });
    }
    #[cfg(not(unix))]
    let _ = state;
    Ok(())
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

/// `--device cuda` (issue 16): before anything is loaded, each model this process
/// would serve is put on the device and its engines' pools checked (I2); see
/// `crate::device`. Nothing for `--device cpu`.
fn device_check(a: &ServeArgs) -> Result<()> {
    if a.device.device == crate::device::Device::Cpu {
        return Ok(());
    }
    if a.config.is_some() {
        anyhow::bail!("--device cuda: with --config the nodes compute (`tessera node --device cuda`), not the gateway");
    }
    let models: Vec<(String, PathBuf)> =
        model_args(a)?.into_iter().map(|m| (m.id, m.path)).collect();
    let engines: &[(NodeRole, &str)] = if a.colocated {
        &[(NodeRole::Colocated, "colocated")]
    } else {
        &[(NodeRole::Prefill, "prefill"), (NodeRole::Decode, "decode")]
    };
    for (id, path) in &models {
        a.device.prepare(id, path, engines)?;
    }
    Ok(())
}

/// `--limits`: `None` for `memory`, else the Redis settings.
fn shared_limits(a: &ServeArgs) -> anyhow::Result<Option<tessera_tenancy::limits::SharedLimits>> {
    if a.limits == "memory" {
        return Ok(None);
    }
    if !(a.limits.starts_with("redis://") || a.limits.starts_with("redis+unix://")) {
        anyhow::bail!(
            "--limits must be `memory`, `redis://HOST:PORT` or `redis+unix:///PATH`; given {:?}",
            a.limits
        );
    }
    if a.limits_lease_secs == 0 {
        anyhow::bail!("--limits-lease-secs must be at least 1");
    }
    Ok(Some(tessera_tenancy::limits::SharedLimits {
        on_failure: a.limits_on_failure,
        lease_ttl: Duration::from_secs(a.limits_lease_secs),
        ..tessera_tenancy::limits::SharedLimits::new(a.limits.clone())
    }))
}

/// `url` with the password of its user info (`scheme://user:PASSWORD@host`) shown
/// as `***`, for logs and banners.
fn redact_password(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_string();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => {
            let user_info = &rest[..at];
            let user = user_info.split_once(':').map_or(user_info, |(u, _)| u);
            let masked = if user_info.contains(':') {
                format!("{user}:***")
            } else {
                user.to_string()
            };
            format!("{scheme}://{masked}{}", &rest[at..])
        }
        None => url.to_string(),
    }
}

#[cfg(test)]
mod redact_tests {
    use super::redact_password;

    #[test]
    fn passwords_are_masked_and_the_rest_kept() {
        assert_eq!(
            redact_password("postgres://tessera:s3cret@db:5432/tessera"),
            "postgres://tessera:***@db:5432/tessera"
        );
        assert_eq!(
            redact_password("redis://:pw@redis:6379"),
            "redis://:***@redis:6379"
        );
        assert_eq!(redact_password("redis://redis:6379"), "redis://redis:6379");
        assert_eq!(
            redact_password("redis+unix:///tmp/r.sock"),
            "redis+unix:///tmp/r.sock"
        );
        assert_eq!(redact_password("sqlite:///a/b@c.db"), "sqlite:///a/b@c.db");
    }
}
