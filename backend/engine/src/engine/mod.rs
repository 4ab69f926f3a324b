//! The engine: one owner of a node's KV pool and running batch.
//!
//! Lifecycle of a request: admission ([`crate::admission`], I1) turns it into an
//! [`Admitted`] request; admitted requests wait until the [`scheduler`](crate::scheduler)
//! admits them to the running batch with all their pages; every [`Engine::step`] runs
//! the scheduler's plan as one forward pass, samples, and emits events to each
//! request's [`EventSink`]. A request ends with `Done`, an `Error`, or (when its sink is
//! cancelled or gone) silently, with its pages freed either way.
//!
//! Roles: a co-located engine prefills and decodes; a prefill node's engine runs
//! prefill-only sequences whose pages are exported ([`crate::kv_transfer`]); a decode
//! node's engine adopts transferred sequences and decodes them.

mod draft;
mod drafting;
mod seq;
mod speculate;
mod stage;
mod step;

pub use draft::DraftModel;
pub(crate) use seq::{accept_token, sampler_for, Accepted, Seq, SeqRole};
pub(crate) use stage::{Sequences, Stage};

use crate::admission::{AdmissionLimits, Admitted, GenerateRequest, Rejection};
use crate::scheduler::{FairnessConfig, Served, Vtc};
use crate::sink::EventSink;
pub use crate::sink::{EngineError, Event, FinishReason, Usage};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_model::kv::prefix::{chain, chain_root, lora_root, ChainHash};
use tessera_model::kv::spill::SpillConfig;
use tessera_model::kv::{CacheBounds, CachePurge, KvManager, PagePool, SeqId};
use tessera_model::sampling::Logprobs;
use tessera_model::tokenizer::Tokenizer;
use tessera_model::transformer::Transformer;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

pub use prometheus_client::metrics::counter::Counter;
/// The integrity counters an engine increments where its checks fail (I3). Each is a
/// Prometheus counter handle: by default unregistered (counted, exported nowhere); a
/// node passes handles of its registry's families ([`Engine::set_metrics`]).
#[derive(Clone, Debug, Default)]
pub struct EngineMetrics {
    /// Pages whose tag did not match their block table when attention read them: one
    /// per failed sequence of a step (`out.failed`).
    pub attention_tag_mismatches: Counter,
    /// Pages whose tag did not match when a prefill's pages were exported for
    /// transfer ([`Engine::export_pages`]): one per failed export.
    pub transfer_source_tag_mismatches: Counter,
    /// Draft tokens fed to forward passes: `[prompt lookup, draft model]`.
    pub spec_drafted: [Counter; 2],
    /// Draft tokens accepted (each equalled the token sampled at its position):
    /// `[prompt lookup, draft model]`.
    pub spec_accepted: [Counter; 2],
    /// Prefix-cache pages dropped by tenant purges ([`Engine::purge_tenant_cache`]):
    /// freed at once, poisoned until their reader ends, or dropped from a lower
    /// tier.
    pub cache_pages_purged: Counter,
}

/// How a pool's pages are held right now, in pages; the three sum to the capacity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageStates {
    /// On the free list.
    pub free: usize,
    /// Held for a sequence that is not in the running batch: a decode reservation
    /// awaiting its transfer and commit, a computed prefill held for export.
    pub reserved: usize,
    /// Held by sequences in the running batch (their own pages; prefix-cache pages
    /// they reuse count as `cached`).
    pub in_use: usize,
    /// Held by the prefix cache (reused by running sequences or evictable).
    pub cached: usize,
}

/// Engine sizing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineConfig {
    /// Tokens per KV page.
    pub page_size: usize,
    /// KV pool size in tokens (rounded down to whole pages).
    pub kv_pool_tokens: usize,
    /// Token budget of one forward pass (decode tokens + prefill chunk tokens).
    pub max_batch_tokens: usize,
    /// Most sequences running at once.
    pub max_running: usize,
    /// Zero pages on free (defence in depth; tags already make reuse safe).
    pub kv_scrub: bool,
    /// Keep the full prompt pages of requests that carry a cache namespace after
    /// they end, and reuse them for later requests of the same namespace.
    pub prefix_cache: bool,
    /// Most of the pool (percent of its pages) one tenant's cached pages may hold.
    pub prefix_cache_tenant_share: u32,
    /// Fair admission across tenants (policy and token costs).
    pub fairness: FairnessConfig,
    /// Longest a batch-class request may wait for admission before it fails as
    /// busy (`None`: no limit).
    pub batch_max_wait: Option<Duration>,
    /// Most prompt tokens of batch-class requests computed in one step, so that a
    /// step in flight delays an arriving interactive request only a little.
    pub batch_prefill_chunk: usize,
    /// Prompt-lookup speculation: at most this many draft tokens per decoding
    /// sequence and step, taken from its own prompt and output and verified in the
    /// same forward pass (output unchanged, token for token; `speculate.rs`). Used
    /// while a step decodes at most `speculate_max_decodes` sequences (where a
    /// decode step reads all weights for few rows); 0 disables it.
    pub speculate: usize,
    /// Most decoding sequences in a step for which drafts are added (default
    /// [`SPECULATE_MAX_DECODES`]): past it a step's rows already amortize the
    /// weights it reads, and draft rows cost more than they save.
    pub speculate_max_decodes: usize,
    /// The prefix cache's lower tiers (host memory, sealed files on disk): pages
    /// evicted for room spill there and come back on a hit. Default: none.
    pub spill: SpillConfig,
    /// Draft-model speculation (`draft.rs`): the model that drafts for this
    /// engine's, with a KV pool of its own of `kv_pool_tokens` tokens; requests
    /// that name no speculation mode then draft with it. `None` (the default):
    /// prompt lookup only.
    pub draft: Option<DraftModel>,
}

/// Most decoding sequences in a step for which drafts are added by default: past it,
/// a step's rows already amortize the weights it reads. Measured (Qwen2.5-Coder
/// 0.5B, 2 threads, drafting for every stream, docs/benchmarks.md): 2 streams
/// 1.17x, 4 streams 0.91x.
pub const SPECULATE_MAX_DECODES: usize = 2;

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            page_size: 16,
            kv_pool_tokens: 16384,
            max_batch_tokens: 512,
            max_running: 32,
            kv_scrub: false,
            prefix_cache: true,
            prefix_cache_tenant_share: 50,
            fairness: FairnessConfig::default(),
            batch_max_wait: Some(Duration::from_secs(60)),
            batch_prefill_chunk: 128,
            speculate: 0,
            speculate_max_decodes: SPECULATE_MAX_DECODES,
            spill: SpillConfig::default(),
            draft: None,
        }
    }
}

/// How a sequence left the running batch (decode role: reported to the protocol).
#[derive(Clone, Debug, PartialEq)]
pub enum SeqEnd {
    /// It completed (its `Done` went out).
    Completed,
    /// Its client cancelled or went away; nothing more was sent.
    ClientGone,
    /// It failed (its `Error` went out).
    Failed(EngineError),
}

/// A queued request (co-located, or a prefill node's prefill-only sequence).
pub(crate) struct Waiting {
    req: Admitted,
    id: SeqId,
    sink: Box<dyn EventSink>,
    submitted: Instant,
    role: SeqRole,
    /// When it entered the queue (the batch deadline counts from here).
    queued_at: Instant,
    /// Prefix-cache keys of its full prompt pages (empty: not cached).
    chain: Vec<ChainHash>,
}

impl Waiting {
    /// Tokens whose pages it reserves: a prefill-only sequence needs its prompt's
    /// pages (its output pages are reserved on the decode node).
    fn tokens(&self) -> usize {
        let r = self.req.request();
        match self.role {
            SeqRole::Prefill => r.prompt.len(),
            SeqRole::Generate => r.prompt.len().saturating_add(r.max_tokens),
        }
    }

    /// Most prompt pages it may reuse from the cache: every full page before the
    /// prompt's last token, which is always computed (its logits are sampled).
    fn max_hit_pages(&self, page_size: usize) -> usize {
        (self.req.request().prompt.len() - 1) / page_size
    }
}

/// A prefill-only sequence whose compute ended, while its pages are held for export.
#[derive(Debug)]
pub(crate) struct Parked {
    pub(crate) id: SeqId,
    /// Prompt tokens.
    pub(crate) prompt: usize,
    tenant: u64,
    chain: Vec<ChainHash>,
    /// Whether the compute succeeded (only then may its pages be cached).
    ok: bool,
}

/// A prefill-only sequence whose compute ended ([`Engine::take_prefilled`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Prefilled {
    /// The sequence (the transfer id on a prefill node).
    pub seq: SeqId,
    /// The first token and the sampler position after it, or the error that stopped
    /// the compute (an integrity error; a batch request that expired in the queue).
    /// The pages stay reserved either way (none for an expired request).
    pub result: Result<FirstToken, EngineError>,
    /// Prompt tokens reused from this node's prefix cache.
    pub cached_tokens: usize,
    /// Of `cached_tokens`, those restored from the lower tiers.
    pub cached_tiers: crate::sink::CachedTiers,
}

/// The token sampled at the end of a prefill, and the sampler's RNG position after it
/// ([`Sampler::rng_word_pos`](tessera_model::sampling::Sampler::rng_word_pos)), so the
/// decode node continues the same stream.
#[derive(Clone, Debug, PartialEq)]
pub struct FirstToken {
    /// Token id.
    pub token: u32,
    /// Sampler RNG word position after sampling it.
    pub rng_word_pos: u128,
    /// Its log probabilities and the prompt's, when the request asked (they
    /// travel with the commit to the decode node, which emits the first token).
    pub logprobs: Option<Box<Logprobs>>,
}

/// The engine: one owner of the model's KV pool and the running batch.
pub struct Engine {
    pub(crate) model: Arc<Transformer>,
    pub(crate) tokenizer: Arc<Tokenizer>,
    pub(crate) cfg: EngineConfig,
    pub(crate) kv: KvManager,
    /// Every sequence here, waiting, running or parked ([`Stage`]).
    pub(crate) seqs: Sequences,
    pub(crate) stop_ids: Vec<u32>,
    next_seq: u64,
    /// Decode role: sequences that left the running batch, and how. `None` when not
    /// tracked.
    ended: Option<Vec<(SeqId, SeqEnd)>>,
    /// Prefill role: finished prefills not yet taken, and every prefill-only
    /// sequence whose compute ended and whose pages are still held.
    prefilled: Vec<Prefilled>,
    /// Virtual token counters (fair admission) and tokens served per tenant.
    vtc: Vtc,
    /// The model's fingerprint (part of every prefix-cache key).
    model_fp: [u8; 32],
    pub(crate) metrics: EngineMetrics,
    /// Draft tokens proposed and accepted since the engine started.
    pub(crate) speculation: Speculation,
    /// When idle cached pages were last looked for ([`KvManager::expire_idle`]).
    pub(crate) last_expiry: Instant,
    /// The cache namespace each tenant's requests last came with: a new one is a
    /// rotated salt ([`Self::push_waiting`] purges the old one's pages).
    namespaces: HashMap<u64, crate::admission::CacheNamespace>,
    /// The draft model and its pool ([`EngineConfig::draft`]).
    pub(crate) drafter: Option<draft::Drafter>,
}

/// How often a step looks for cached pages past their tenant's idle time.
pub(crate) const EXPIRY_EVERY: Duration = Duration::from_millis(250);

/// Speculation's counts ([`EngineConfig::speculate`]), both modes together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Speculation {
    /// Draft tokens fed to forward passes.
    pub drafted: u64,
    /// Draft tokens that equalled the token sampled at their position (each saved
    /// one forward pass of its sequence).
    pub accepted: u64,
}

impl Engine {
    /// Speculation's counts so far (prompt lookup and draft model).
    pub fn speculation(&self) -> Speculation {
        self.speculation
    }

    /// Pages of the draft model's pool held by sequences (0 without a draft model);
    /// they are freed when their sequence leaves the running batch.
    pub fn draft_pages_in_use(&self) -> usize {
        self.drafter.as_ref().map_or(0, |d| d.pages_in_use())
    }

    /// The fingerprint of the engine's model ([`Transformer::fingerprint`], 32 bytes).
    pub fn model_fingerprint(&self) -> [u8; 32] {
        self.model_fp
    }

    /// Builds an engine with a pool of `cfg.kv_pool_tokens / cfg.page_size` pages.
    pub fn new(model: Arc<Transformer>, tokenizer: Arc<Tokenizer>, cfg: EngineConfig) -> Self {
        let layout = model.config().kv_layout(cfg.page_size);
        let pool = PagePool::new(layout, cfg.kv_pool_tokens / cfg.page_size, cfg.kv_scrub);
        let mut stop_ids: Vec<u32> = [
            tokenizer.eos_id(),
            tokenizer.token_id("<|im_end|>"),
            tokenizer.token_id("<|endoftext|>"),
        ]
        .into_iter()
        .flatten()
        .collect();
        stop_ids.sort_unstable();
        stop_ids.dedup();
        let mut kv = KvManager::new(pool);
        kv.set_tenant_cache_share(cfg.prefix_cache_tenant_share);
        if let Err(e) = kv.set_spill(cfg.spill.clone()) {
            // The caller made the directory; a failure here leaves the pool's cache.
            tracing::error!(error = %e, "the prefix cache's lower tiers are off");
        }
        let drafter = cfg.draft.as_ref().map(|d| {
            draft::Drafter::new(
                d,
                &model,
                cfg.page_size,
                cfg.kv_pool_tokens / cfg.page_size,
                cfg.kv_scrub,
            )
        });
        Self {
            drafter,
            model_fp: model.fingerprint(),
            vtc: Vtc::new(cfg.fairness),
            model,
            tokenizer,
            cfg,
            kv,
            seqs: Sequences::default(),
            stop_ids,
            next_seq: 1,
            ended: None,
            prefilled: Vec::new(),
            metrics: EngineMetrics::default(),
            speculation: Speculation::default(),
            last_expiry: Instant::now(),
            namespaces: HashMap::new(),
        }
    }

    /// Counts integrity failures into `metrics` from now on (a node's registered
    /// counters).
    pub fn set_metrics(&mut self, metrics: EngineMetrics) {
        self.metrics = metrics;
    }

    /// The integrity counters this engine increments.
    pub fn metrics(&self) -> &EngineMetrics {
        &self.metrics
    }

    /// Pages by state (free, reserved, in use). Cost: one pass over the running batch.
    pub fn page_states(&self) -> PageStates {
        let pool = self.kv.pool();
        let free = pool.free_pages();
        let cached = pool.cached_pages();
        let in_use: usize = self
            .seqs
            .running()
            .filter_map(|s| self.kv.table(s.id))
            .map(|t| t.iter().filter(|r| !pool.is_cached(r.page)).count())
            .sum();
        let held = pool.capacity() - free - cached;
        PageStates {
            free,
            reserved: held.saturating_sub(in_use),
            in_use: in_use.min(held),
            cached,
        }
    }

    /// Starts recording which sequences leave the running batch (decode role: the
    /// protocol must learn when a decode ended). Drain with [`Self::take_ended`].
    pub fn track_ended(&mut self) {
        self.ended.get_or_insert_with(Vec::new);
    }

    /// Sequences that left the running batch since the last call, and how.
    pub fn take_ended(&mut self) -> Vec<(SeqId, SeqEnd)> {
        self.ended.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub(crate) fn record_end(&mut self, seq: SeqId, end: SeqEnd) {
        if let Some(log) = &mut self.ended {
            log.push((seq, end));
        }
    }

    /// Admission (I1): every check that can refuse the request, before any allocation.
    pub fn admit(&self, req: GenerateRequest) -> Result<Admitted, Rejection> {
        self.limits().admit(req)
    }

    /// The static limits admission checks against.
    pub fn limits(&self) -> AdmissionLimits {
        AdmissionLimits {
            context: self.model.config().context,
            pool_tokens: self.kv.pool().capacity_tokens(),
            page_size: self.cfg.page_size,
            vocab: self.model.config().vocab,
            draft: self.drafter.is_some(),
        }
    }

    /// Sizing.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Queues an admitted request; its events go to the returned receiver (dropping
    /// it cancels the request).
    pub fn enqueue(&mut self, req: Admitted) -> UnboundedReceiver<Event> {
        let (tx, rx) = unbounded_channel();
        self.enqueue_with_sink(req, Box::new(tx), Instant::now());
        rx
    }

    /// Queues an admitted request whose events go to `sink`; `submitted` is when the
    /// client's request arrived (TTFT is measured from it).
    pub fn enqueue_with_sink(
        &mut self,
        req: Admitted,
        sink: Box<dyn EventSink>,
        submitted: Instant,
    ) {
        let id = self.fresh_seq();
        self.push_waiting(req, id, sink, submitted, SeqRole::Generate);
    }

    /// Prefill role: queues a prefill-only sequence `seq` (the transfer id): only the
    /// prompt's pages are allocated here, the first token ends its compute, and
    /// [`Self::take_prefilled`] reports it; its pages stay reserved until
    /// [`Self::release_prefill`]. The sampler's fallback seed is `seq`, so the decode
    /// node can continue the same RNG stream.
    pub fn enqueue_prefill(&mut self, req: Admitted, seq: SeqId) {
        let sink = Box::new(crate::sink::Discard);
        self.push_waiting(req, seq, sink, Instant::now(), SeqRole::Prefill);
    }

    fn push_waiting(
        &mut self,
        req: Admitted,
        id: SeqId,
        sink: Box<dyn EventSink>,
        submitted: Instant,
        role: SeqRole,
    ) {
        let r = req.request();
        let chain = match self.chain_root_of(r) {
            Some(root) => chain(&root, &r.prompt, self.cfg.page_size),
            None => Vec::new(),
        };
        self.note_tenant_cache(r);
        let waiting: Vec<u64> = self.waiting_tenants();
        self.vtc.on_arrival(r.tenant, r.weight, &waiting);
        self.seqs.enter(Stage::Waiting(Box::new(Waiting {
            req,
            id,
            sink,
            submitted,
            role,
            queued_at: Instant::now(),
            chain,
        })));
    }

    /// Applies what request `r` says of its tenant's cache here: its own bounds,
    /// and its namespace (a new one purges what the tenant cached under the old).
    pub(crate) fn note_tenant_cache(&mut self, r: &GenerateRequest) {
        self.set_cache_policy(r.tenant, r.cache_policy);
        // A tenant's new namespace is a rotated salt: what it cached under the old
        // one can never be hit again, and its sealed pages must stop opening now,
        // however the salt was rotated (admin API or the store directly).
        if let Some(ns) = r.cache_namespace {
            if self
                .namespaces
                .insert(r.tenant, ns)
                .is_some_and(|old| old != ns)
            {
                let purged = self.purge_tenant_cache(r.tenant);
                tracing::info!(
                    tenant = r.tenant,
                    ?purged,
                    "a new cache namespace: the old one's pages purged"
                );
            }
        }
    }

    /// Where `r`'s prefix-cache chain starts: its namespace, the model, the page
    /// size and its fine-tune; `None` when its pages are never cached (no
    /// namespace, the cache off, or prompt log probabilities, which need every
    /// prompt position computed).
    pub(crate) fn chain_root_of(&self, r: &GenerateRequest) -> Option<ChainHash> {
        if !self.cfg.prefix_cache || r.output.prompt_logprobs.is_some() {
            return None;
        }
        let mut root = chain_root(
            r.cache_namespace.as_ref()?,
            &self.model_fp,
            self.cfg.page_size,
        );
        if let Some(l) = &r.lora {
            root = lora_root(&root, &l.id);
        }
        Some(root)
    }

    fn waiting_tenants(&self) -> Vec<u64> {
        self.seqs
            .waiting()
            .map(|w| w.req.request().tenant)
            .collect()
    }

    /// Applies `tenant`'s own cache bounds here ([`KvManager::set_tenant_policy`]):
    /// from its requests, and pushed by the gateway when the admin changes them.
    /// Bounds older than the latest seen (`policy.version`) are ignored.
    pub fn set_cache_policy(&mut self, tenant: u64, policy: crate::admission::CachePolicy) {
        let page = self.cfg.page_size as u64;
        let bounds = CacheBounds {
            max_pages: (policy.max_tokens > 0)
                .then(|| usize::try_from(policy.max_tokens.div_ceil(page)).unwrap_or(usize::MAX)),
            idle_ttl: (policy.idle_ttl_secs > 0).then(|| Duration::from_secs(policy.idle_ttl_secs)),
        };
        self.kv.set_tenant_policy(tenant, bounds, policy.version);
    }

    /// Prefill role: prefills whose compute ended since the last call.
    pub fn take_prefilled(&mut self) -> Vec<Prefilled> {
        std::mem::take(&mut self.prefilled)
    }

    /// Prefill role: drops prefill-only sequence `seq` wherever it is (queued,
    /// computing, or computed and held for export) and frees its pages; the prompt
    /// pages whose K/V was computed go to the prefix cache when the request carries a
    /// namespace (the prefill node is where a disaggregated deployment caches).
    /// Returns whether it was found.
    pub fn release_prefill(&mut self, seq: SeqId) -> bool {
        let found = match self.seqs.take(seq) {
            None => false,
            Some(Stage::Waiting(_)) => true,
            Some(Stage::Running(s)) => {
                self.free_seq(&s, true);
                true
            }
            Some(Stage::Parked(p)) => {
                let computed = if p.ok { p.prompt } else { 0 };
                let pages = computed / self.cfg.page_size;
                self.kv.release_caching(seq, &p.chain, pages);
                true
            }
        };
        self.prefilled.retain(|p| p.seq != seq);
        found | (self.kv.release(seq) > 0)
    }

    /// Frees every page of `seq` (decode role: a reservation that will not be
    /// adopted, after commit failure or acknowledged abort). Returns pages freed.
    pub fn release_seq(&mut self, seq: SeqId) -> usize {
        self.seqs.take_running(seq);
        self.kv.release(seq)
    }

    /// Decode role, at a drain: ends running sequence `seq` without an event (the
    /// transfer protocol reports the end) and caches every page whose K/V is
    /// computed, output pages included (all its tokens but the last sampled one),
    /// under the request's chain; the rest is freed. A continuation of it (its
    /// prompt followed by the tokens its client has, [`crate::Resume`]) then finds
    /// those pages in this engine's prefix cache: a drained decode node exports
    /// them as that continuation's writer, so the KV moves instead of being
    /// computed again (issue 36). Returns the pages cached: 0 when `seq` is not
    /// running or its request is never cached (no namespace).
    pub fn end_caching_output(&mut self, seq: SeqId) -> usize {
        let Some(s) = self.seqs.take_running(seq) else {
            return 0;
        };
        let Some(root) = s.root else {
            self.kv.release(seq);
            return 0;
        };
        let computed = if s.generated.is_empty() {
            s.prefilled
        } else {
            s.prompt.len() + s.generated.len() - 1
        };
        let mut tokens = s.prompt;
        tokens.extend_from_slice(&s.generated);
        tokens.truncate(computed);
        let keys = chain(&root, &tokens, self.cfg.page_size);
        self.kv.release_caching(seq, &keys, keys.len());
        self.kv.cached_prefix(s.tenant, &keys, keys.len())
    }

    /// Frees a sequence's pages; with `cache`, its prompt pages whose K/V is
    /// completely computed go to the prefix cache first (when it has keys).
    fn free_seq(&mut self, s: &Seq, cache: bool) {
        let computed = if cache {
            s.prefilled.min(s.prompt.len())
        } else {
            0
        };
        self.kv
            .release_caching(s.id, &s.chain, computed / self.cfg.page_size);
    }

    /// How long an idle engine may wait before a step must look for cached pages
    /// past their tenant's idle time (`None`: no tenant here has one).
    pub fn expiry_wait(&self) -> Option<Duration> {
        self.kv
            .has_idle_bounds()
            .then(|| EXPIRY_EVERY.saturating_sub(self.last_expiry.elapsed()))
    }

    /// Requests waiting for admission to the running batch.
    pub fn waiting_len(&self) -> usize {
        self.seqs.counts().0
    }

    /// Requests in the running batch.
    pub fn running_len(&self) -> usize {
        self.seqs.counts().1
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        let (waiting, running, _) = self.seqs.counts();
        waiting + running > 0
    }

    /// The KV manager (free-page counts for tests and metrics).
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    /// Drops every prefix-cache page of `tenant` on this engine
    /// ([`KvManager::purge_tenant_cache`]): unused ones are freed now, ones a running
    /// sequence reads are poisoned and freed at its end, spilled ones dropped. A
    /// request of the tenant still running caches nothing when it ends.
    pub fn purge_tenant_cache(&mut self, tenant: u64) -> CachePurge {
        let purge = self.kv.purge_tenant_cache(tenant);
        self.metrics
            .cache_pages_purged
            .inc_by((purge.freed + purge.poisoned + purge.host + purge.disk) as u64);
        purge
    }

    /// The draft model's KV manager ([`EngineConfig::draft`]), for fault-injection
    /// tests only.
    #[doc(hidden)]
    pub fn draft_kv_mut_for_test(&mut self) -> Option<&mut KvManager> {
        self.drafter.as_mut().map(|d| d.kv_mut())
    }

    /// Mutable KV manager, for fault-injection tests only.
    #[doc(hidden)]
    pub fn kv_mut_for_test(&mut self) -> &mut KvManager {
        &mut self.kv
    }

    /// The fair-admission counters.
    pub fn fairness(&self) -> &Vtc {
        &self.vtc
    }

    /// Prompt and generated tokens computed per tenant since start or
    /// [`Self::reset_served`] (prefix-cache hits are not computed).
    pub fn served(&self) -> &HashMap<u64, Served> {
        self.vtc.served()
    }

    /// Clears [`Self::served`].
    pub fn reset_served(&mut self) {
        self.vtc.reset_served();
    }

    /// Sequence ids of running requests in admission order (for tests).
    #[doc(hidden)]
    pub fn running_ids(&self) -> Vec<SeqId> {
        self.seqs.running().map(|s| s.id).collect()
    }

    /// A sequence id the engine assigns itself, never one in use.
    fn fresh_seq(&mut self) -> SeqId {
        loop {
            let id = SeqId(self.next_seq);
            self.next_seq += 1;
            if self.kv.table(id).is_none() && !self.seqs.contains(id) {
                return id;
            }
        }
    }
}
