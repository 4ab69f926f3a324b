//! The prefix cache's lower tiers (issue 39): pages evicted from the pool's cache
//! spill to a bounded host-memory tier, then to sealed files on disk, and come back
//! on a hit.
//!
//! Every spilled page keeps the tag it had in the cache, `(tenant, cache_seq(key),
//! epoch, logical block)`, and its key; a page comes back only into a sequence of
//! the same tenant whose chain names the same key at the same block, after the tag
//! is compared with the one the reader derives (I3,
//! [`KvManager::reserve_cached`](super::KvManager::reserve_cached)).
//!
//! On disk a page is sealed with ChaCha20-Poly1305 (RFC 8439, `ring`) under a key
//! per tenant: HKDF-SHA256 (RFC 5869) of the engine's secret with a random salt per
//! tenant generation and info `"tessera.kv-spill.v1" || tenant`. The associated data
//! is the key and the tag, so a file moved to another entry, another tenant or
//! another salt's chain does not open, and neither does one changed by a byte.
//! Secret and generations live in memory only: purging a tenant forgets its
//! generation, so its files are unreadable before they are deleted, and files left
//! by an earlier process are unreadable (and deleted when a disk tier starts).
//! File layout: `MAGIC (8) || nonce (12) || ciphertext || Poly1305 tag (16)`.

use super::prefix::ChainHash;
use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, CHACHA20_POLY1305, NONCE_LEN};
use ring::hkdf::{Salt, HKDF_SHA256};
use ring::rand::{SecureRandom, SystemRandom};
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tessera_kernels::PageTag;

/// First bytes of every spill file (format version 1).
const MAGIC: &[u8; 8] = b"TKVSPL01";
/// HKDF info prefix; the tenant id follows.
const KDF_INFO: &[u8] = b"tessera.kv-spill.v1";

/// Sizes of the lower tiers, in pages of the pool's layout.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpillConfig {
    /// Most pages kept in host memory (0: no host tier; pages spill straight to disk).
    pub host_pages: usize,
    /// Most pages kept on disk (0 or no `dir`: no disk tier).
    pub disk_pages: usize,
    /// Directory of the disk tier (created `0700`; an earlier process's `*.kv`
    /// files are deleted at start).
    pub dir: Option<PathBuf>,
}

/// The tier a cached page is in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Tier {
    /// The pool (device memory on a GPU).
    Pool,
    /// Host memory.
    Host,
    /// Sealed files on disk.
    Disk,
}

/// Counts of the lower tiers since the engine started (the metrics read them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpillStats {
    /// Pages evicted from the pool's cache into the host tier.
    pub spilled_host: u64,
    /// Pages moved from the host tier to disk (or evicted straight there).
    pub spilled_disk: u64,
    /// Pages brought back into the pool from host memory.
    pub restored_host: u64,
    /// Pages brought back into the pool from disk.
    pub restored_disk: u64,
    /// Disk pages that failed to open (tampered, moved, or their key forgotten):
    /// each dropped, counted and answered as a miss.
    pub open_failures: u64,
    /// Host pages dropped by tenant purges.
    pub purged_host: u64,
    /// Disk pages dropped by tenant purges.
    pub purged_disk: u64,
}

/// A page in a lower tier: the tag it had in the cache, its owner, and its bytes
/// (host) or file (disk).
struct Spilled {
    tag: PageTag,
    tenant: u64,
    tick: u64,
    /// When the page was last used in the pool (its idle time counts from here).
    used: Instant,
    place: Place,
}

enum Place {
    Host(Box<[u8]>),
    Disk { path: PathBuf, generation: [u8; 32] },
}

/// The host and disk tiers of one engine's prefix cache.
pub(crate) struct SpillTiers {
    cfg: SpillConfig,
    entries: HashMap<ChainHash, Spilled>,
    /// Host entries by age (oldest first), and disk entries by age.
    host_lru: BTreeMap<u64, ChainHash>,
    disk_lru: BTreeMap<u64, ChainHash>,
    tick: u64,
    secret: [u8; 32],
    /// The current key generation (HKDF salt) of each tenant with pages on disk.
    generations: HashMap<u64, [u8; 32]>,
    rng: SystemRandom,
    pub(crate) stats: SpillStats,
    /// Disk pages the current call may still write ([`Self::set_disk_budget`]).
    disk_budget: usize,
}

impl std::fmt::Debug for SpillTiers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SpillTiers")
            .field("cfg", &self.cfg)
            .field("host", &self.host_lru.len())
            .field("disk", &self.disk_lru.len())
            .field("stats", &self.stats)
            .finish_non_exhaustive()
    }
}

/// Why the disk tier could not start.
#[derive(Debug, thiserror::Error)]
#[error("KV spill directory {dir}: {source}")]
pub struct SpillDirError {
    dir: PathBuf,
    source: std::io::Error,
}

impl SpillTiers {
    /// Tiers of `cfg`'s sizes with a fresh random secret; the disk directory is
    /// created (`0700`) and an earlier process's page files (`*.kv`, unreadable
    /// without its keys) are deleted from it; nothing else in it is touched.
    ///
    /// Errors: the directory cannot be created, read or cleaned.
    pub(crate) fn new(cfg: SpillConfig) -> Result<Self, SpillDirError> {
        if let (Some(dir), true) = (&cfg.dir, cfg.disk_pages > 0) {
            let err = |source| SpillDirError {
                dir: dir.clone(),
                source,
            };
            std::fs::create_dir_all(dir).map_err(err)?;
            for entry in std::fs::read_dir(dir).map_err(err)? {
                let path = entry.map_err(err)?.path();
                if path.extension().is_some_and(|x| x == "kv") && path.is_file() {
                    std::fs::remove_file(&path).map_err(err)?;
                }
            }
            #[cfg(unix)]
            {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                    .map_err(err)?;
            }
        }
        let rng = SystemRandom::new();
        let mut secret = [0u8; 32];
        rng.fill(&mut secret).expect("the OS random source");
        Ok(Self {
            cfg,
            entries: HashMap::new(),
            host_lru: BTreeMap::new(),
            disk_lru: BTreeMap::new(),
            tick: 0,
            secret,
            generations: HashMap::new(),
            rng,
            stats: SpillStats::default(),
            disk_budget: usize::MAX,
        })
    }

    fn disk_on(&self) -> bool {
        self.cfg.disk_pages > 0 && self.cfg.dir.is_some()
    }

    /// Whether `h` is spilled for `tenant` (in either tier).
    pub(crate) fn holds(&self, h: &ChainHash, tenant: u64) -> bool {
        self.entries.get(h).is_some_and(|e| e.tenant == tenant)
    }

    /// Takes in a page evicted from the pool's cache (`bytes`, with the cache's
    /// `tag`, owned by `tenant`, last used at `used`). Older pages move down a tier
    /// or out to make room.
    pub(crate) fn spill(
        &mut self,
        h: ChainHash,
        tenant: u64,
        tag: PageTag,
        used: Instant,
        bytes: &[u8],
    ) {
        self.drop_entry(&h);
        self.tick += 1;
        let tick = self.tick;
        if self.cfg.host_pages > 0 {
            let place = Place::Host(bytes.into());
            self.insert(
                h,
                Spilled {
                    tag,
                    tenant,
                    tick,
                    used,
                    place,
                },
            );
            while self.host_lru.len() > self.cfg.host_pages {
                let (_, old) = self.host_lru.pop_first().expect("over the bound");
                self.demote(old);
            }
        } else if self.disk_on() {
            self.write_disk(h, tenant, tag, tick, used, bytes);
        }
    }

    /// Records spilled page `h` in the tier its place names, at its age.
    fn insert(&mut self, h: ChainHash, s: Spilled) {
        match s.place {
            Place::Host(_) => {
                self.host_lru.insert(s.tick, h);
                self.stats.spilled_host += 1;
            }
            Place::Disk { .. } => {
                self.disk_lru.insert(s.tick, h);
                self.stats.spilled_disk += 1;
            }
        }
        self.entries.insert(h, s);
    }

    /// Moves host entry `h` to disk, or drops it without a disk tier.
    fn demote(&mut self, h: ChainHash) {
        let Some(e) = self.entries.remove(&h) else {
            return;
        };
        if let (Place::Host(bytes), true) = (&e.place, self.disk_on()) {
            self.write_disk(h, e.tenant, e.tag, e.tick, e.used, bytes);
        }
    }

    /// Lets the calls that follow write at most `n` disk pages (a page past it is
    /// dropped instead).
    pub(crate) fn set_disk_budget(&mut self, n: usize) {
        self.disk_budget = n;
    }

    /// The tier `h` is in, if it is spilled.
    pub(crate) fn tier_of(&self, h: &ChainHash) -> Option<Tier> {
        self.entries.get(h).map(|e| match e.place {
            Place::Host(_) => Tier::Host,
            Place::Disk { .. } => Tier::Disk,
        })
    }

    fn write_disk(
        &mut self,
        h: ChainHash,
        tenant: u64,
        tag: PageTag,
        tick: u64,
        used: Instant,
        bytes: &[u8],
    ) {
        if self.disk_budget == 0 {
            return;
        }
        self.disk_budget -= 1;
        let generation = *self.generations.entry(tenant).or_insert_with(|| {
            let mut g = [0u8; 32];
            self.rng.fill(&mut g).expect("the OS random source");
            g
        });
        let key = self.key(tenant, &generation);
        let mut nonce = [0u8; NONCE_LEN];
        self.rng.fill(&mut nonce).expect("the OS random source");
        let mut sealed = bytes.to_vec();
        key.seal_in_place_append_tag(
            Nonce::assume_unique_for_key(nonce),
            Aad::from(associated_data(&h, &tag)),
            &mut sealed,
        )
        .expect("a page is far below ChaCha20-Poly1305's message limit");
        let path = self.path(&h);
        let file = [MAGIC.as_slice(), &nonce, &sealed].concat();
        if let Err(e) = std::fs::write(&path, file) {
            tracing::warn!(error = %e, path = %path.display(), "could not spill a KV page to disk; dropped");
            let _ = std::fs::remove_file(&path);
            return;
        }
        let place = Place::Disk { path, generation };
        self.insert(
            h,
            Spilled {
                tag,
                tenant,
                tick,
                used,
                place,
            },
        );
        while self.disk_lru.len() > self.cfg.disk_pages {
            let (_, old) = self.disk_lru.pop_first().expect("over the bound");
            self.drop_entry(&old);
        }
    }

    fn key(&self, tenant: u64, generation: &[u8; 32]) -> LessSafeKey {
        let info = [KDF_INFO, &tenant.to_le_bytes()];
        let prk = Salt::new(HKDF_SHA256, generation).extract(&self.secret);
        let okm = prk
            .expand(&info, &CHACHA20_POLY1305)
            .expect("32 bytes is within HKDF-SHA256's output limit");
        LessSafeKey::new(UnboundKey::from(okm))
    }

    fn path(&self, h: &ChainHash) -> PathBuf {
        let name: String = h.iter().map(|b| format!("{b:02x}")).collect();
        self.cfg
            .dir
            .as_ref()
            .expect("disk tier on")
            .join(format!("{name}.kv"))
    }

    /// Takes spilled page `h` out of its tier for `tenant`: its cache tag and bytes.
    /// `None` when it is not spilled for `tenant`, or its file is gone or does not
    /// open (counted in [`SpillStats::open_failures`]; the entry is dropped).
    pub(crate) fn take(&mut self, h: &ChainHash, tenant: u64) -> Option<(PageTag, Vec<u8>, Tier)> {
        if !self.holds(h, tenant) {
            return None;
        }
        let e = self.remove_entry(h)?;
        let (tag, tenant) = (e.tag, e.tenant);
        match e.place {
            Place::Host(bytes) => {
                self.stats.restored_host += 1;
                Some((tag, bytes.into_vec(), Tier::Host))
            }
            Place::Disk { path, generation } => {
                let opened = self.open(&path, h, tag, tenant, &generation);
                let _ = std::fs::remove_file(&path);
                match opened {
                    Some(bytes) => {
                        self.stats.restored_disk += 1;
                        Some((tag, bytes, Tier::Disk))
                    }
                    None => {
                        self.stats.open_failures += 1;
                        tracing::error!(path = %path.display(), "a spilled KV page failed to open; dropped (a miss)");
                        None
                    }
                }
            }
        }
    }

    fn open(
        &self,
        path: &std::path::Path,
        h: &ChainHash,
        tag: PageTag,
        tenant: u64,
        generation: &[u8; 32],
    ) -> Option<Vec<u8>> {
        // The tenant's current generation: after a purge forgot it, nothing opens.
        if self.generations.get(&tenant) != Some(generation) {
            return None;
        }
        let file = std::fs::read(path).ok()?;
        let rest = file.strip_prefix(MAGIC.as_slice())?;
        if rest.len() < NONCE_LEN {
            return None;
        }
        let (nonce, sealed) = rest.split_at(NONCE_LEN);
        let nonce = Nonce::try_assume_unique_for_key(nonce).ok()?;
        let mut buf = sealed.to_vec();
        let key = self.key(tenant, generation);
        let n = key
            .open_in_place(nonce, Aad::from(associated_data(h, &tag)), &mut buf)
            .ok()?
            .len();
        buf.truncate(n);
        Some(buf)
    }

    fn remove_entry(&mut self, h: &ChainHash) -> Option<Spilled> {
        let e = self.entries.remove(h)?;
        match e.place {
            Place::Host(_) => self.host_lru.remove(&e.tick),
            Place::Disk { .. } => self.disk_lru.remove(&e.tick),
        };
        Some(e)
    }

    /// Drops `h` from the lower tiers (its page is back in the pool's cache).
    pub(crate) fn forget(&mut self, h: &ChainHash) {
        self.drop_entry(h);
    }

    /// Drops `h` from whichever tier holds it (its file deleted).
    fn drop_entry(&mut self, h: &ChainHash) {
        if let Some(Spilled {
            place: Place::Disk { path, .. },
            ..
        }) = self.remove_entry(h)
        {
            let _ = std::fs::remove_file(path);
        }
    }

    /// Drops every spilled page of `tenant`: its key generation is forgotten first
    /// (its files are unreadable from then on), then entries and files go. Returns
    /// the pages dropped from (host, disk).
    pub(crate) fn purge_tenant(&mut self, tenant: u64) -> (usize, usize) {
        self.generations.remove(&tenant);
        let keys: Vec<ChainHash> = self
            .entries
            .iter()
            .filter(|(_, e)| e.tenant == tenant)
            .map(|(h, _)| *h)
            .collect();
        let (mut host, mut disk) = (0, 0);
        for h in keys {
            match self
                .entries
                .get(&h)
                .map(|e| matches!(e.place, Place::Host(_)))
            {
                Some(true) => host += 1,
                Some(false) => disk += 1,
                None => {}
            }
            self.drop_entry(&h);
        }
        self.stats.purged_host += host as u64;
        self.stats.purged_disk += disk as u64;
        (host, disk)
    }

    /// Drops every spilled page whose tenant's idle time (`ttl_of`) passed at `now`.
    /// Returns the pages dropped.
    pub(crate) fn expire(
        &mut self,
        now: Instant,
        ttl_of: impl Fn(u64) -> Option<Duration>,
    ) -> usize {
        let idle: Vec<ChainHash> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                ttl_of(e.tenant).is_some_and(|t| now.saturating_duration_since(e.used) > t)
            })
            .map(|(h, _)| *h)
            .collect();
        for h in &idle {
            self.drop_entry(h);
        }
        idle.len()
    }

    /// Pages `tenant` has in (host, disk).
    pub(crate) fn tenant_pages(&self, tenant: u64) -> (usize, usize) {
        self.entries
            .values()
            .filter(|e| e.tenant == tenant)
            .fold((0, 0), |(h, d), e| match e.place {
                Place::Host(_) => (h + 1, d),
                Place::Disk { .. } => (h, d + 1),
            })
    }

    /// Pages in (host, disk).
    pub(crate) fn pages(&self) -> (usize, usize) {
        (self.host_lru.len(), self.disk_lru.len())
    }

    /// Drops every spilled page (files deleted).
    pub(crate) fn clear(&mut self) {
        let keys: Vec<ChainHash> = self.entries.keys().copied().collect();
        for h in keys {
            self.drop_entry(&h);
        }
    }
}

/// A sealed page's associated data: its key, then its tag's fields (little-endian).
fn associated_data(h: &ChainHash, tag: &PageTag) -> Vec<u8> {
    let mut ad = Vec::with_capacity(32 + 24);
    ad.extend_from_slice(h);
    ad.extend_from_slice(&tag.tenant.to_le_bytes());
    ad.extend_from_slice(&tag.seq.to_le_bytes());
    ad.extend_from_slice(&tag.epoch.to_le_bytes());
    ad.extend_from_slice(&tag.logical_block.to_le_bytes());
    ad
}

#[cfg(test)]
mod tests {
    use super::super::tests::keys;
    use super::super::{prefix, KvManager, SeqId, TierPages};
    use super::*;

    const PAGE: usize = 4;

    /// A disk tier of 16 pages in `dir`, no host tier.
    fn disk_only(dir: &std::path::Path) -> SpillConfig {
        SpillConfig {
            host_pages: 0,
            disk_pages: 16,
            dir: Some(dir.to_path_buf()),
        }
    }

    /// [`super::super::tests::manager`] with lower tiers of `cfg`.
    pub(super) fn manager(pages: usize, cfg: SpillConfig) -> KvManager {
        let mut m = super::super::tests::manager(pages);
        m.set_spill(cfg).unwrap();
        m
    }

    /// Caches `chain` for `tenant` as sequence `seq` with page `i` filled with
    /// bytes `fill + i`; returns the bytes of each page.
    fn cache(
        m: &mut KvManager,
        seq: u64,
        tenant: u64,
        chain: &[ChainHash],
        fill: u8,
    ) -> Vec<Vec<u8>> {
        let n = chain.len();
        assert_eq!(
            m.reserve_cached(SeqId(seq), tenant, n * PAGE, chain, n)
                .unwrap(),
            0
        );
        let table = m.table(SeqId(seq)).unwrap().to_vec();
        let mut out = Vec::new();
        for (i, r) in table.iter().enumerate() {
            let page = m.pool.page_data_mut(*r).unwrap();
            page.fill(fill.wrapping_add(i as u8));
            out.push(page.to_vec());
        }
        m.release_caching(SeqId(seq), chain, n);
        out
    }

    /// Reserves `chain` for `tenant`: pages whose K/V came back, and the bytes of
    /// those pages.
    fn reuse(
        m: &mut KvManager,
        seq: u64,
        tenant: u64,
        chain: &[ChainHash],
    ) -> (usize, Vec<Vec<u8>>) {
        let n = chain.len();
        let hits = m
            .reserve_cached(SeqId(seq), tenant, n * PAGE, chain, n)
            .unwrap();
        let table = m.table(SeqId(seq)).unwrap().to_vec();
        tessera_kernels::attention::verify_tags(m.pool().tags(), &table).unwrap();
        let bytes = table[..hits]
            .iter()
            .map(|r| m.pool().page_data(*r).unwrap().to_vec())
            .collect();
        (hits, bytes)
    }

    /// Fills the whole pool for another tenant, evicting every cached page.
    fn flood(m: &mut KvManager, seq: u64) {
        let all = m.pool().capacity() * PAGE;
        m.reserve_cached(SeqId(seq), 99, all, &[], 0).unwrap();
        m.release(SeqId(seq));
    }

    fn files(dir: &std::path::Path) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn evicted_pages_come_back_from_host_memory_and_disk_with_their_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let cfg = SpillConfig {
            host_pages: 1,
            disk_pages: 8,
            dir: Some(dir.path().join("spill")),
        };
        let mut m = manager(4, cfg);
        let chain = keys(1, &(0..13).collect::<Vec<u32>>());
        assert_eq!(chain.len(), 3);
        let written = cache(&mut m, 1, 7, &chain, 10);
        flood(&mut m, 2);
        // Eviction takes a chain from its end: the first page evicted went to host
        // memory and was pushed to disk by the next ones; the last is in host memory.
        assert_eq!(
            m.tenant_cache_pages(7),
            TierPages {
                pool: 0,
                host: 1,
                disk: 2
            }
        );
        assert_eq!(files(&dir.path().join("spill")).len(), 2);
        assert_eq!(m.spilled_prefix(7, &chain, 0, 3), 3);
        assert_eq!(m.spilled_prefix(8, &chain, 0, 3), 0, "another tenant never");
        let (hits, bytes) = reuse(&mut m, 3, 7, &chain);
        assert_eq!((hits, bytes), (3, written));
        let s = m.spill_stats();
        assert_eq!(
            (s.restored_host, s.restored_disk, s.open_failures),
            (1, 2, 0)
        );
        assert!(
            files(&dir.path().join("spill")).is_empty(),
            "restored files are deleted"
        );
        // Back in the pool's cache when the sequence ends, and gone from the tiers.
        m.release_caching(SeqId(3), &chain, 3);
        assert_eq!(
            m.tenant_cache_pages(7),
            TierPages {
                pool: 3,
                host: 0,
                disk: 0
            }
        );
    }

    #[test]
    fn a_tampered_or_moved_file_is_a_miss_never_a_page() {
        let dir = tempfile::tempdir().unwrap();
        let spill = dir.path().join("spill");
        let mut m = manager(4, disk_only(&spill));
        let toks: Vec<u32> = (0..9).collect();
        let (a, b) = (keys(1, &toks), keys(2, &toks));
        cache(&mut m, 1, 7, &a, 10);
        flood(&mut m, 2);
        cache(&mut m, 3, 8, &b, 50);
        flood(&mut m, 4);
        // The same tenant's same tokens under another salt (another namespace).
        let c = keys(3, &toks);
        cache(&mut m, 7, 7, &c, 90);
        flood(&mut m, 8);
        let name = |h: &ChainHash| {
            spill.join(format!(
                "{}.kv",
                h.iter().map(|b| format!("{b:02x}")).collect::<String>()
            ))
        };
        // Tenant 8's first page replaced by tenant 7's (same tokens, same block).
        std::fs::copy(name(&a[0]), name(&b[0])).unwrap();
        // Tenant 7's other salt's first page replaced by the first salt's.
        std::fs::copy(name(&a[0]), name(&c[0])).unwrap();
        // Tenant 7's second page changed by one bit in its ciphertext.
        let mut f = std::fs::read(name(&a[1])).unwrap();
        f[MAGIC.len() + NONCE_LEN + 5] ^= 1;
        std::fs::write(name(&a[1]), f).unwrap();
        let (hits_b, _) = reuse(&mut m, 5, 8, &b);
        assert_eq!(hits_b, 0, "a page sealed for another tenant does not open");
        m.release(SeqId(5));
        let (hits_c, _) = reuse(&mut m, 9, 7, &c);
        assert_eq!(
            hits_c, 0,
            "a page sealed under another salt's key does not open"
        );
        m.release(SeqId(9));
        let (hits_a, _) = reuse(&mut m, 6, 7, &a);
        assert_eq!(hits_a, 1, "the untouched first page only");
        assert_eq!(m.spill_stats().open_failures, 3);
    }

    #[test]
    fn a_purge_forgets_the_key_before_the_files_go() {
        let dir = tempfile::tempdir().unwrap();
        let spill_dir = dir.path().join("spill");
        let mut tiers = SpillTiers::new(disk_only(&spill_dir)).unwrap();
        let h = [3u8; 32];
        let tag = PageTag {
            tenant: 7,
            seq: prefix::cache_seq(&h),
            epoch: 1,
            logical_block: 0,
        };
        tiers.spill(h, 7, tag, Instant::now(), &[42u8; 64]);
        let file = files(&spill_dir).pop().unwrap();
        let old = std::fs::read(&file).unwrap();
        assert_eq!(tiers.purge_tenant(7), (0, 1));
        assert!(files(&spill_dir).is_empty());
        // The same page spilled again under the tenant's new key; the old file put
        // in its place (a copy taken before the purge) does not open.
        tiers.spill(h, 7, tag, Instant::now(), &[43u8; 64]);
        std::fs::write(&file, &old).unwrap();
        assert_eq!(tiers.take(&h, 7), None);
        assert_eq!(tiers.stats.open_failures, 1);
        // Unchanged, a page opens (the check above is not vacuous).
        tiers.spill(h, 7, tag, Instant::now(), &[44u8; 64]);
        let (t, bytes, tier) = tiers.take(&h, 7).unwrap();
        assert_eq!((t, bytes, tier), (tag, vec![44u8; 64], Tier::Disk));
    }

    #[test]
    fn a_spilled_page_whose_tag_disagrees_with_its_key_fails_the_reservation() {
        let mut m = manager(
            4,
            SpillConfig {
                host_pages: 4,
                ..SpillConfig::default()
            },
        );
        let chain = keys(1, &(0..9).collect::<Vec<u32>>());
        cache(&mut m, 1, 7, &chain, 10);
        flood(&mut m, 2);
        // A host entry whose recorded tag names another block (a bug, or memory
        // corruption): the reader's own derivation refuses it.
        let spill = m.spill.as_mut().unwrap();
        let e = spill.entries.get_mut(&chain[0]).unwrap();
        e.tag.logical_block = 1;
        let free = m.pool().free_pages();
        let err = m
            .reserve_cached(SeqId(3), 7, 2 * PAGE, &chain, 2)
            .unwrap_err();
        assert!(
            matches!(err, super::super::ReserveError::Integrity(_)),
            "{err:?}"
        );
        assert_eq!(m.pool().free_pages(), free, "nothing stays reserved");
        assert!(m.table(SeqId(3)).is_none());
    }
}

#[cfg(test)]
mod policy_tests {
    use super::super::tests::keys;
    use super::super::{CacheBounds, KvManager, SeqId, TierPages};
    use super::*;

    fn manager(pages: usize) -> KvManager {
        super::tests::manager(
            pages,
            SpillConfig {
                host_pages: 16,
                ..SpillConfig::default()
            },
        )
    }

    fn cache(m: &mut KvManager, seq: u64, tenant: u64, ns: u8) {
        let chain = keys(ns, &(0..12).collect::<Vec<u32>>());
        m.reserve_cached(SeqId(seq), tenant, 12, &chain, 3).unwrap();
        m.release_caching(SeqId(seq), &chain, 3);
    }

    #[test]
    fn a_tenants_own_page_cap_drops_its_oldest_pages_instead_of_spilling_them() {
        let mut m = manager(8);
        m.set_tenant_policy(
            7,
            CacheBounds {
                max_pages: Some(1),
                idle_ttl: None,
            },
            1,
        );
        cache(&mut m, 1, 7, 1);
        cache(&mut m, 2, 8, 2);
        assert_eq!(
            m.tenant_cache_pages(7),
            TierPages {
                pool: 1,
                host: 0,
                disk: 0
            }
        );
        assert_eq!(
            m.tenant_cache_pages(8).pool,
            3,
            "others keep the engine's share"
        );
        m.set_tenant_policy(
            7,
            CacheBounds {
                max_pages: Some(0),
                idle_ttl: None,
            },
            3,
        );
        cache(&mut m, 3, 7, 3);
        assert_eq!(m.tenant_cache_pages(7).pool, 0, "a cap of 0 keeps nothing");
        // Older bounds (a request submitted before the change) do not undo it.
        m.set_tenant_policy(7, CacheBounds::default(), 2);
        cache(&mut m, 4, 7, 4);
        assert_eq!(m.tenant_cache_pages(7).pool, 0);
    }

    #[test]
    fn a_sequence_that_outlives_its_tenants_purge_caches_nothing() {
        let mut m = manager(8);
        let chain = keys(1, &(0..12).collect::<Vec<u32>>());
        m.reserve_cached(SeqId(1), 7, 12, &chain, 3).unwrap();
        let other = keys(2, &(0..12).collect::<Vec<u32>>());
        m.reserve_cached(SeqId(2), 8, 12, &other, 3).unwrap();
        m.purge_tenant_cache(7);
        m.release_caching(SeqId(1), &chain, 3);
        m.release_caching(SeqId(2), &other, 3);
        assert_eq!(m.tenant_cache_pages(7), TierPages::default());
        assert_eq!(
            m.tenant_cache_pages(8).pool,
            3,
            "another tenant's purge changes nothing"
        );
        // The next request of the tenant caches again.
        cache(&mut m, 3, 7, 1);
        assert_eq!(m.tenant_cache_pages(7).pool, 3);
    }

    #[test]
    fn pages_idle_past_their_tenants_time_are_dropped_from_every_tier() {
        let mut m = manager(5);
        let hour = std::time::Duration::from_secs(3600);
        m.set_tenant_policy(
            7,
            CacheBounds {
                max_pages: None,
                idle_ttl: Some(hour),
            },
            1,
        );
        cache(&mut m, 1, 7, 1);
        cache(&mut m, 2, 8, 2); // evicts part of tenant 7's chain to host memory
        let t7 = m.tenant_cache_pages(7);
        assert!(t7.host > 0 && t7.pool > 0, "{t7:?}");
        assert_eq!(m.expire_idle(Instant::now()), 0, "not idle long enough yet");
        let later = Instant::now() + hour + std::time::Duration::from_secs(1);
        assert_eq!(m.expire_idle(later), t7.pool + t7.host);
        assert_eq!(m.tenant_cache_pages(7), TierPages::default());
        assert_eq!(
            m.tenant_cache_pages(8).pool,
            3,
            "a tenant without an idle time keeps its pages"
        );
    }
}
