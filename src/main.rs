//! `tessera`: the single Tessera binary. Subcommands parse arguments and call into
//! the library crates; no logic lives here.

mod bench;
mod generate;
mod model_fetch;

use anyhow::Result;
use clap::{Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser)]
#[command(
    name = "tessera",
    version,
    about = "Multi-tenant LLM inference platform"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

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
}

#[derive(Subcommand)]
enum ModelCommand {
    /// Download and verify the default model (SmolLM2-135M-Instruct, GGUF Q4_1).
    Fetch {
        /// Where to keep model files.
        #[arg(long, default_value = "models")]
        models_dir: PathBuf,
        /// Download again even if a verified copy exists.
        #[arg(long)]
        force: bool,
    },
}

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    match Cli::parse().command {
        Command::Model {
            command: ModelCommand::Fetch { models_dir, force },
        } => {
            model_fetch::fetch_default_model(&model_fetch::FetchOptions { models_dir, force })?;
            Ok(())
        }
        Command::Generate(args) => generate::run(args),
        Command::Bench(args) => bench::run(args),
    }
}
