//! `tessera tenant|key|usage`: the admin operations against the store directly
//! (the same store `tessera serve` uses; changes apply to a running server on its
//! next request). Output is JSON.

use crate::serve::StoreArgs;
use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use serde_json::json;
use tessera_tenancy::store::{parse_time, rfc3339};
use tessera_tenancy::{GroupBy, Limits, TenantStatus};

/// Limit flags (0 = unlimited).
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct LimitArgs {
    /// Requests per minute.
    #[arg(long, default_value_t = 0)]
    rpm: u32,
    /// Input tokens per minute.
    #[arg(long, default_value_t = 0)]
    input_tpm: u32,
    /// Output tokens per minute (charged with max_tokens at admission).
    #[arg(long, default_value_t = 0)]
    output_tpm: u32,
    /// Concurrent requests.
    #[arg(long, default_value_t = 0)]
    max_concurrent: u32,
    /// Tokens (input + output) per UTC day.
    #[arg(long, default_value_t = 0)]
    daily_tokens: u64,
}

impl LimitArgs {
    fn limits(&self) -> Limits {
        Limits {
            requests_per_minute: self.rpm,
            input_tokens_per_minute: self.input_tpm,
            output_tokens_per_minute: self.output_tpm,
            max_concurrent: self.max_concurrent,
            daily_tokens: self.daily_tokens,
        }
    }
}

/// `tessera tenant ...`.
#[derive(Subcommand, Debug)]
pub(crate) enum TenantCommand {
    /// Create a tenant (prints its account id; --with-key also makes a key).
    Create {
        /// Display name.
        #[arg(long)]
        name: String,
        #[command(flatten)]
        limits: LimitArgs,
        /// Also create an API key.
        #[arg(long)]
        with_key: bool,
    },
    /// List tenants.
    List,
    /// Suspend a tenant: its requests get 403 from the next one on.
    Suspend {
        /// Account id.
        id: String,
    },
    /// Re-activate a suspended tenant.
    Activate {
        /// Account id.
        id: String,
    },
    /// Replace a tenant's limits.
    Limits {
        /// Account id.
        id: String,
        #[command(flatten)]
        limits: LimitArgs,
    },
}

/// `tessera key ...`.
#[derive(Subcommand, Debug)]
pub(crate) enum KeyCommand {
    /// Create an API key (the secret is printed once).
    Create {
        /// Account id of the owner.
        #[arg(long)]
        tenant: String,
        /// Label.
        #[arg(long, default_value = "default")]
        name: String,
    },
    /// List keys (never their secrets).
    List {
        /// Only this tenant's keys.
        #[arg(long)]
        tenant: Option<String>,
    },
    /// Revoke a key by its id (the middle part of `tsk_<key_id>_<secret>`, as
    /// `tessera key list` shows it); effective on the next request.
    Revoke {
        /// Key id.
        key_id: String,
    },
}

/// `tessera usage`.
#[derive(Args, Debug)]
pub(crate) struct UsageArgs {
    /// Account id.
    #[arg(long)]
    tenant: String,
    /// Start (Unix seconds, YYYY-MM-DD or YYYY-MM-DDTHH:MM:SSZ); default: the beginning.
    #[arg(long)]
    since: Option<String>,
    /// End (exclusive); default: now.
    #[arg(long)]
    until: Option<String>,
    /// model, key, hour or day.
    #[arg(long, default_value = "model")]
    group_by: String,
}

fn rt() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn print(v: serde_json::Value) -> Result<()> {
    println!("{}", serde_json::to_string_pretty(&v)?);
    Ok(())
}

pub(crate) fn tenant(store: StoreArgs, cmd: TenantCommand) -> Result<()> {
    rt()?.block_on(async {
        let s = store.open().await?;
        match cmd {
            TenantCommand::Create {
                name,
                limits,
                with_key,
            } => {
                let t = s.create_tenant(&name, limits.limits()).await?;
                let mut out = json!({"tenant": t});
                if with_key {
                    let (info, secret) = s.create_key(&t.id, "default").await?;
                    out["key"] = json!({"info": info, "secret": secret});
                }
                print(out)
            }
            TenantCommand::List => print(json!(s.list_tenants().await?)),
            TenantCommand::Suspend { id } => {
                s.set_status(&id, TenantStatus::Suspended).await?;
                print(json!({"id": id, "status": "suspended"}))
            }
            TenantCommand::Activate { id } => {
                s.set_status(&id, TenantStatus::Active).await?;
                print(json!({"id": id, "status": "active"}))
            }
            TenantCommand::Limits { id, limits } => {
                s.set_limits(&id, limits.limits()).await?;
                print(json!({"id": id, "limits": limits.limits()}))
            }
        }
    })
}

pub(crate) fn key(store: StoreArgs, cmd: KeyCommand) -> Result<()> {
    rt()?.block_on(async {
        let s = store.open().await?;
        match cmd {
            KeyCommand::Create { tenant, name } => {
                let (info, secret) = s.create_key(&tenant, &name).await?;
                print(json!({"info": info, "secret": secret}))
            }
            KeyCommand::List { tenant } => print(json!(s.list_keys(tenant.as_deref()).await?)),
            KeyCommand::Revoke { key_id } => {
                if !s.revoke_key(&key_id).await? {
                    bail!("no active key with id {key_id}");
                }
                print(json!({"key_id": key_id, "revoked": true}))
            }
        }
    })
}

pub(crate) fn usage(store: StoreArgs, a: UsageArgs) -> Result<()> {
    let time = |v: &Option<String>, default: i64| -> Result<i64> {
        match v {
            None => Ok(default),
            Some(s) => parse_time(s).ok_or_else(|| anyhow::anyhow!("bad time `{s}`")),
        }
    };
    let since = time(&a.since, 0)?;
    let until = time(&a.until, tessera_tenancy::now_ms() + 1)?;
    let g: GroupBy = a.group_by.parse().map_err(anyhow::Error::msg)?;
    rt()?.block_on(async {
        let s = store.open().await?;
        let groups = s.usage_summary(&a.tenant, since, until, g).await?;
        print(json!({
            "account_id": a.tenant,
            "since": rfc3339(since),
            "until": rfc3339(until),
            "group_by": a.group_by,
            "groups": groups,
        }))
    })
}
