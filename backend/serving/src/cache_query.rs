//! Questions a gateway asks every engine of a model about one tenant's cached KV
//! (the cache API, `tessera tenant purge-cache`): run between two steps of an engine
//! in this process, or sent to a remote node as a `cache` frame on its node link and
//! answered with a `cache_answer` frame of the same id (only a gateway identity may
//! ask; [`crate::remote::RemoteCluster`] waits for every node).

use serde::{Deserialize, Serialize};
use tessera_engine::{CachePolicy, Engine};
use tessera_model::kv::{CachePurge, TierPages};

/// A question about tenant `tenant`'s cached pages (the tenant's engine id).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum CacheQuery {
    /// Drop them on every tier ([`Engine::purge_tenant_cache`]).
    Purge { tenant: u64 },
    /// Count them per tier ([`tessera_model::kv::KvManager::tenant_cache_pages`]).
    Report { tenant: u64 },
    /// Apply the tenant's own cache bounds now ([`Engine::set_cache_policy`]).
    SetPolicy { tenant: u64, policy: CachePolicy },
}

/// One engine's answer to a [`CacheQuery`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(crate) enum CacheAnswer {
    /// What the purge dropped.
    Purged(CachePurge),
    /// The pages per tier.
    Report(TierPages),
    /// The bounds are applied (or newer ones were).
    PolicySet,
}

impl CacheQuery {
    /// The answer of engine `e` (runs on its thread, between two steps).
    pub(crate) fn run(self, e: &mut Engine) -> CacheAnswer {
        match self {
            CacheQuery::Purge { tenant } => CacheAnswer::Purged(e.purge_tenant_cache(tenant)),
            CacheQuery::Report { tenant } => CacheAnswer::Report(e.kv().tenant_cache_pages(tenant)),
            CacheQuery::SetPolicy { tenant, policy } => {
                e.set_cache_policy(tenant, policy);
                CacheAnswer::PolicySet
            }
        }
    }
}
