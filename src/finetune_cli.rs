//! `tessera finetune`: tenants' LoRA fine-tunes against the store directly (the
//! operator's side of `ai/finetunes`): create one for a tenant from an adapter file,
//! checked against its base model's file exactly as an upload is; list, delete,
//! make public or private. Every change writes an audit row (source `cli:<user>`).
//! Output is JSON.

use crate::tenancy_cli::{cli_actor, print, rt, StoreArgs};
use anyhow::{bail, Context, Result};
use clap::Subcommand;
use serde_json::json;
use std::path::PathBuf;
use tessera_model::lora::{self, LoraWeights, MAX_RANK};
use tessera_tenancy::NewFinetune;

/// `tessera finetune ...`.
#[derive(Subcommand, Debug)]
pub(crate) enum FinetuneCommand {
    /// Check a LoRA adapter (GGUF, llama.cpp's form) against its base model and
    /// store it as a fine-tune of a tenant.
    Create {
        /// The owning tenant's id.
        #[arg(long)]
        tenant: String,
        /// The base model's catalog id (with `--model-file`, the file it is served
        /// from; default: the default model and its file in `models/`).
        #[arg(long, requires = "model_file")]
        model: Option<String>,
        /// The base model's GGUF file (only its header is read).
        #[arg(long, requires = "model")]
        model_file: Option<PathBuf>,
        /// Name, unique per tenant (default: the file's name without `.gguf`).
        #[arg(long)]
        name: Option<String>,
        /// Description.
        #[arg(long, default_value = "")]
        description: String,
        /// Largest accepted file, in bytes (the gateway's default cap).
        #[arg(long, default_value_t = tessera_gateway::DEFAULT_MAX_FINETUNE_BYTES)]
        max_bytes: usize,
        /// The adapter file.
        file: PathBuf,
    },
    /// A tenant's fine-tunes.
    List {
        /// The tenant's id.
        #[arg(long)]
        tenant: String,
    },
    /// Delete a tenant's fine-tune (by id or name) and its file.
    Delete {
        /// The owning tenant's id.
        #[arg(long)]
        tenant: String,
        /// Its id or name.
        id: String,
    },
    /// Let every tenant run a fine-tune (`--private` takes that back).
    Publish {
        /// Its id.
        id: String,
        /// Make it private to its tenant again.
        #[arg(long)]
        private: bool,
    },
}

pub(crate) fn finetune(store: StoreArgs, cmd: FinetuneCommand) -> Result<()> {
    rt()?.block_on(async {
        let s = store.open().await?;
        let by = cli_actor();
        let admin = s.audited(&by);
        match cmd {
            FinetuneCommand::Create {
                tenant,
                model,
                model_file,
                name,
                description,
                max_bytes,
                file,
            } => {
                let data =
                    std::fs::read(&file).with_context(|| format!("reading {}", file.display()))?;
                if data.len() > max_bytes {
                    bail!(
                        "{} is {} bytes, over the limit of {max_bytes}",
                        file.display(),
                        data.len()
                    );
                }
                let (model, model_file) = match (model, model_file) {
                    (Some(m), Some(f)) => (m, f),
                    _ => (
                        tessera_model::DEFAULT_MODEL_ID.to_string(),
                        PathBuf::from("models/SmolLM2-135M-Instruct.Q4_1.gguf"),
                    ),
                };
                let base = tessera_model::gguf::lora_base_of(&model_file)?;
                // Decoded in full, as serving loads it (a stored fine-tune always loads).
                let layers = base
                    .matrices
                    .keys()
                    .filter_map(|n| n.split('.').nth(1)?.parse::<usize>().ok())
                    .max()
                    .map_or(0, |l| l + 1);
                let summary = lora::validate(&data, &base, &model, MAX_RANK)
                    .and_then(|s| LoraWeights::load(&data, &base, &model, layers).map(|_| s))
                    .map_err(|e| anyhow::anyhow!("the adapter does not fit model {model}: {e}"))?;
                let name = match name {
                    Some(n) => n,
                    None => file
                        .file_stem()
                        .and_then(|s| s.to_str())
                        .context("name the fine-tune with --name")?
                        .to_string(),
                };
                let ft = admin
                    .create_finetune(&NewFinetune {
                        tenant_id: &tenant,
                        name: &name,
                        base_model: &model,
                        description: &description,
                        rank: summary.rank as u32,
                        alpha: f64::from(summary.alpha),
                        targets: summary.targets.len() as u32,
                        data: &data,
                    })
                    .await?;
                print(ft.api_json(true))
            }
            // The API's shape (`api_json`), so scripts read one set of fields.
            FinetuneCommand::List { tenant } => {
                let all = s.finetunes_of(&tenant).await?;
                print(json!(all
                    .iter()
                    .map(|f| f.api_json(true))
                    .collect::<Vec<_>>()))
            }
            FinetuneCommand::Delete { tenant, id } => {
                match admin.delete_finetune(&tenant, &id).await? {
                    Some(ft) => print(json!({ "deleted": ft.api_json(true) })),
                    None => bail!("tenant {tenant} has no fine-tune {id:?}"),
                }
            }
            FinetuneCommand::Publish { id, private } => {
                if !admin.set_finetune_public(&id, !private).await? {
                    bail!("no fine-tune with id {id:?}");
                }
                print(json!({ "id": id, "public": !private }))
            }
        }
    })
}
