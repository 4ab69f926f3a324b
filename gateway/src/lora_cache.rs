//! What a gateway holds for LoRA fine-tunes between requests: the adapters loaded
//! for serving (the least recently used dropped past [`MAX_LOADED`]) and the
//! accounts with an upload in progress. Types only, so the gateway's state can hold
//! them without depending on the handlers ([`crate::finetunes_api`]).

use std::collections::HashMap;
use std::sync::Arc;
use tessera_model::lora::LoraWeights;
use tessera_serving::AdapterFile;

/// Uploads decoded and checked at once per gateway (each holds its file and its
/// f16 weights in memory); reading the files is bounded by one per account.
pub(crate) const MAX_UPLOADS: usize = 2;

/// Loaded adapters a gateway keeps (the least recently used one goes first).
pub(crate) const MAX_LOADED: usize = 16;

/// Adapters loaded for serving, by fine-tune id (with the file's SHA-256, so a
/// changed file is loaded anew).
#[derive(Debug, Default)]
pub(crate) struct LoadedLoras {
    map: std::sync::Mutex<HashMap<String, Loaded>>,
    clock: std::sync::atomic::AtomicU64,
    /// One lock per fine-tune being loaded: concurrent first requests load it once.
    loading: std::sync::Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
}

/// A loaded adapter: its weights, its file (sent to the nodes of a node
/// deployment, and whose SHA-256 keys it), when it was last used.
type Loaded = (Arc<LoraWeights>, Arc<AdapterFile>, u64);

impl LoadedLoras {
    /// The lock a load of fine-tune `id` holds (the same for every caller while
    /// any holds it).
    pub(crate) fn load_gate(&self, id: &str) -> Arc<tokio::sync::Mutex<()>> {
        let mut loading = self.loading.lock().expect("lora loading lock");
        // Gates nobody holds any more go (the map stays as small as the loads).
        loading.retain(|_, g| Arc::strong_count(g) > 1);
        loading.entry(id.into()).or_default().clone()
    }

    /// Fine-tune `id`'s weights and file, when loaded from the file of SHA-256
    /// `sha256`.
    pub(crate) fn get(
        &self,
        id: &str,
        sha256: &str,
    ) -> Option<(Arc<LoraWeights>, Arc<AdapterFile>)> {
        let now = self
            .clock
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut map = self.map.lock().expect("lora cache lock");
        let (w, file, used) = map.get_mut(id)?;
        (file.sha256 == sha256).then(|| {
            *used = now;
            (w.clone(), file.clone())
        })
    }

    /// Keeps fine-tune `id`'s weights and file (the least recently used entry goes
    /// past [`MAX_LOADED`]). Returns what is loaded then: adapters, the bytes they
    /// hold (weights and files), and how many were dropped for this one (0 or 1).
    pub(crate) fn put(
        &self,
        id: &str,
        w: Arc<LoraWeights>,
        file: Arc<AdapterFile>,
    ) -> (usize, usize, usize) {
        let now = self
            .clock
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let mut map = self.map.lock().expect("lora cache lock");
        let mut evicted = 0;
        if map.len() >= MAX_LOADED && !map.contains_key(id) {
            let oldest = map.iter().min_by_key(|(_, v)| v.2).map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                map.remove(&k);
                evicted = 1;
            }
        }
        map.insert(id.into(), (w, file, now));
        let bytes = map.values().map(|(w, f, _)| w.bytes + f.bytes.len()).sum();
        (map.len(), bytes, evicted)
    }
}

/// Accounts with an upload in progress on this gateway.
pub(crate) type Uploading = std::sync::Mutex<std::collections::HashSet<String>>;

/// An account's upload slot, given back on drop.
pub(crate) struct UploadSlot<'a> {
    set: &'a Uploading,
    tenant: String,
}

impl<'a> UploadSlot<'a> {
    pub(crate) fn take(set: &'a Uploading, tenant: &str) -> Option<Self> {
        let fresh = set.lock().expect("uploads lock").insert(tenant.into());
        fresh.then(|| Self {
            set,
            tenant: tenant.into(),
        })
    }
}

impl Drop for UploadSlot<'_> {
    fn drop(&mut self) {
        self.set.lock().expect("uploads lock").remove(&self.tenant);
    }
}
