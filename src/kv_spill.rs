//! The prefix cache's lower tiers on the command line (`tessera serve`, `tessera
//! node`): sizes in MiB, turned into pages of one engine's layout.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use tessera_model::kv::spill::SpillConfig;

/// Flags of the prefix cache's lower tiers (issue 39), per caching engine (the
/// prefill or co-located one; decode engines cache nothing).
#[derive(Args, Debug, Clone, Default)]
pub(crate) struct KvSpillArgs {
    /// The prefix cache's host-memory tier, MiB per caching engine (0: none):
    /// cached prompt pages evicted from the KV pool for room move here and come back
    /// on a hit, their tags checked (I3).
    #[arg(long, default_value_t = 0)]
    kv_spill_host_mib: usize,
    /// The prefix cache's disk tier, MiB per caching engine (0: none): pages leaving
    /// the host tier (or the pool, without one) are sealed with ChaCha20-Poly1305
    /// under a key per tenant that only this process holds (a purge or salt
    /// rotation forgets it) and written to --kv-spill-dir (an earlier process's page
    /// files there are deleted at start).
    #[arg(long, default_value_t = 0)]
    kv_spill_disk_mib: usize,
    /// Directory of the disk tier (`tessera serve`: default DATA_DIR/kv-spill; one
    /// subdirectory per engine, created 0700).
    #[arg(long)]
    kv_spill_dir: Option<PathBuf>,
}

impl KvSpillArgs {
    /// The tiers of engine `engine` whose pages are `page_bytes` bytes; its disk
    /// tier in `--kv-spill-dir` (else `default_dir`) / `engine`.
    ///
    /// Errors: a size too large to count, a disk tier with no directory given and
    /// no default, or one whose directory cannot be created.
    pub(crate) fn config(
        &self,
        page_bytes: usize,
        default_dir: Option<&std::path::Path>,
        engine: &str,
    ) -> Result<SpillConfig> {
        let pages = |mib: usize, flag: &str| {
            mib.checked_mul(1 << 20)
                .map(|bytes| bytes / page_bytes.max(1))
                .ok_or_else(|| anyhow::anyhow!("--{flag} {mib} is too large"))
        };
        let dir = match (self.kv_spill_disk_mib, &self.kv_spill_dir, default_dir) {
            (0, _, _) => None,
            (_, Some(d), _) => Some(d.join(engine)),
            (_, None, Some(d)) => Some(d.join(engine)),
            (_, None, None) => anyhow::bail!("--kv-spill-disk-mib needs --kv-spill-dir"),
        };
        if let Some(d) = &dir {
            // Made here so that a bad path stops the start instead of the tier.
            std::fs::create_dir_all(d).map_err(|e| {
                anyhow::anyhow!("--kv-spill-dir: cannot create {}: {e}", d.display())
            })?;
        }
        Ok(SpillConfig {
            host_pages: pages(self.kv_spill_host_mib, "kv-spill-host-mib")?,
            disk_pages: pages(self.kv_spill_disk_mib, "kv-spill-disk-mib")?,
            dir,
        })
    }
}
