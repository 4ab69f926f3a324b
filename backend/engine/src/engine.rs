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

use crate::admission::{AdmissionLimits, Admitted, GenerateRequest, Rejection};
use crate::scheduler::{
    self, FairnessConfig, Priority, Queued, SeqProgress, Served, StepLimits, Vtc, Work,
};
use crate::sink::EventSink;
pub use crate::sink::{EngineError, Event, FinishReason, Usage};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_model::detok::{IncrementalDecoder, StopMatcher, StopOutcome};
use tessera_model::kv::prefix::{chain, chain_root, ChainHash};
use tessera_model::kv::{KvManager, PagePool, ReserveError, SeqId};
use tessera_model::sampling::{token_logprobs, Logprobs, Sampler, TokenLogprobs};
use tessera_model::tokenizer::Tokenizer;
use tessera_model::transformer::{BatchRow, Transformer};
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
}

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

/// What a sequence does once its prompt is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SeqRole {
    /// Samples and streams until it ends (co-located, decode node).
    Generate,
    /// Prefill node: the first token ends the sequence's compute; its pages stay
    /// reserved for export until [`Engine::release_prefill`].
    Prefill,
}

pub(crate) struct Seq {
    pub(crate) id: SeqId,
    pub(crate) prompt: Vec<u32>,
    pub(crate) generated: Vec<u32>,
    pub(crate) max_tokens: usize,
    pub(crate) ignore_eos: bool,
    pub(crate) prefilled: usize,
    pub(crate) sampler: Sampler,
    pub(crate) detok: IncrementalDecoder,
    pub(crate) stop: StopMatcher,
    pub(crate) sink: Box<dyn EventSink>,
    pub(crate) submitted: Instant,
    pub(crate) first_token: Option<Instant>,
    pub(crate) role: SeqRole,
    pub(crate) tenant: u64,
    pub(crate) priority: Priority,
    /// Prefix-cache keys of the full prompt pages (empty: not cached).
    pub(crate) chain: Vec<ChainHash>,
    /// Prompt tokens reused from the prefix cache.
    pub(crate) cached: usize,
    /// Alternatives per generated token's log probabilities (`None`: none asked).
    pub(crate) logprobs: Option<usize>,
    /// Alternatives per prompt token's log probabilities (`None`: none asked).
    pub(crate) prompt_logprobs: Option<usize>,
    /// Prompt log probabilities computed so far (positions 1.., in order); sent
    /// with the first token.
    pub(crate) prompt_lp: Vec<TokenLogprobs>,
}

impl Seq {
    /// A sequence about to start (nothing computed).
    pub(crate) fn new(
        id: SeqId,
        req: GenerateRequest,
        sampler: Sampler,
        sink: Box<dyn EventSink>,
        submitted: Instant,
        role: SeqRole,
    ) -> Self {
        Self {
            id,
            sampler,
            tenant: req.tenant,
            priority: req.priority,
            chain: Vec::new(),
            cached: 0,
            logprobs: req.output.logprobs.map(|k| k as usize),
            prompt_logprobs: req.output.prompt_logprobs.map(|k| k as usize),
            prompt_lp: Vec::new(),
            prompt: req.prompt,
            generated: Vec::new(),
            max_tokens: req.max_tokens,
            ignore_eos: req.ignore_eos,
            prefilled: 0,
            detok: IncrementalDecoder::new(true),
            stop: StopMatcher::new(req.stop),
            sink,
            submitted,
            first_token: None,
            role,
        }
    }

    fn progress(&self) -> SeqProgress {
        SeqProgress {
            prompt: self.prompt.len(),
            prefilled: self.prefilled,
            generated: self.generated.len(),
            tenant: self.tenant,
            priority: self.priority,
        }
    }
}

/// A queued request (co-located, or a prefill node's prefill-only sequence).
struct Waiting {
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
}

/// The token sampled at the end of a prefill, and the sampler's RNG position after it
/// ([`Sampler::rng_word_pos`]), so the decode node continues the same stream.
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
    waiting: VecDeque<Waiting>,
    pub(crate) running: Vec<Seq>,
    pub(crate) stop_ids: Vec<u32>,
    next_seq: u64,
    /// Decode role: sequences that left the running batch, and how. `None` when not
    /// tracked.
    ended: Option<Vec<(SeqId, SeqEnd)>>,
    /// Prefill role: finished prefills not yet taken, and every prefill-only
    /// sequence whose compute ended and whose pages are still held.
    prefilled: Vec<Prefilled>,
    pub(crate) parked: HashMap<SeqId, Parked>,
    /// Virtual token counters (fair admission) and tokens served per tenant.
    vtc: Vtc,
    /// The model's fingerprint (part of every prefix-cache key).
    model_fp: [u8; 32],
    pub(crate) metrics: EngineMetrics,
}

impl Engine {
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
        Self {
            model_fp: model.fingerprint(),
            vtc: Vtc::new(cfg.fairness),
            model,
            tokenizer,
            cfg,
            kv,
            waiting: VecDeque::new(),
            running: Vec::new(),
            stop_ids,
            next_seq: 1,
            ended: None,
            prefilled: Vec::new(),
            parked: HashMap::new(),
            metrics: EngineMetrics::default(),
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
            .running
            .iter()
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
        // Prompt logprobs need every prompt position computed: no cache reuse.
        let cacheable = self.cfg.prefix_cache && r.output.prompt_logprobs.is_none();
        let chain = match (cacheable, &r.cache_namespace) {
            (true, Some(ns)) => {
                let root = chain_root(ns, &self.model_fp, self.cfg.page_size);
                chain(&root, &r.prompt, self.cfg.page_size)
            }
            _ => Vec::new(),
        };
        let waiting: Vec<u64> = self.waiting_tenants();
        self.vtc.on_arrival(r.tenant, r.weight, &waiting);
        self.waiting.push_back(Waiting {
            req,
            id,
            sink,
            submitted,
            role,
            queued_at: Instant::now(),
            chain,
        });
    }

    fn waiting_tenants(&self) -> Vec<u64> {
        self.waiting
            .iter()
            .map(|w| w.req.request().tenant)
            .collect()
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
        let mut found = false;
        if let Some(i) = self.waiting.iter().position(|w| w.id == seq) {
            self.waiting.remove(i);
            found = true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == seq) {
            let s = self.running.remove(i);
            self.free_seq(&s, true);
            found = true;
        }
        if let Some(p) = self.parked.remove(&seq) {
            let computed = if p.ok { p.prompt } else { 0 };
            let pages = computed / self.cfg.page_size;
            self.kv.release_caching(seq, &p.chain, pages);
            found = true;
        }
        self.prefilled.retain(|p| p.seq != seq);
        found | (self.kv.release(seq) > 0)
    }

    /// Frees every page of `seq` (decode role: a reservation that will not be
    /// adopted, after commit failure or acknowledged abort). Returns pages freed.
    pub fn release_seq(&mut self, seq: SeqId) -> usize {
        if let Some(i) = self.running.iter().position(|s| s.id == seq) {
            self.running.remove(i);
        }
        self.kv.release(seq)
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

    /// Requests waiting for admission to the running batch.
    pub fn waiting_len(&self) -> usize {
        self.waiting.len()
    }

    /// Requests in the running batch.
    pub fn running_len(&self) -> usize {
        self.running.len()
    }

    /// Whether any request is waiting or running.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// The KV manager (free-page counts for tests and metrics).
    pub fn kv(&self) -> &KvManager {
        &self.kv
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
        self.running.iter().map(|s| s.id).collect()
    }

    /// A sequence id the engine assigns itself, never one in use.
    fn fresh_seq(&mut self) -> SeqId {
        loop {
            let id = SeqId(self.next_seq);
            self.next_seq += 1;
            if self.kv.table(id).is_none() && !self.waiting.iter().any(|w| w.id == id) {
                return id;
            }
        }
    }

    fn step_limits(&self) -> StepLimits {
        StepLimits {
            max_batch_tokens: self.cfg.max_batch_tokens,
            max_running: self.cfg.max_running,
            free_pages: self.kv.available_pages(),
            batch_max_wait: self.cfg.batch_max_wait,
            batch_prefill_chunk: self.cfg.batch_prefill_chunk,
        }
    }

    /// What the scheduler sees of the queue, prefix-cache hits included.
    fn queue_view(&self, now: Instant) -> Vec<Queued> {
        let ps = self.cfg.page_size;
        self.waiting
            .iter()
            .map(|w| {
                let r = w.req.request();
                let hits = self
                    .kv
                    .cached_prefix(r.tenant, &w.chain, w.max_hit_pages(ps));
                Queued {
                    prompt: r.prompt.len(),
                    cached: hits * ps,
                    pages: self.kv.pages_for(w.tokens()) - hits
                        + self.kv.unpinned_hits(&w.chain, hits),
                    tenant: r.tenant,
                    priority: r.priority,
                    waited: now.saturating_duration_since(w.queued_at),
                }
            })
            .collect()
    }

    /// Runs one scheduling step: drops cancelled requests, fails expired batch
    /// requests, admits waiting ones (fairly, reusing cached prompt pages), runs one
    /// forward pass, charges each tenant what it computed, samples and emits.
    /// Returns the number of tokens in the forward pass (0 when idle).
    pub fn step(&mut self) -> usize {
        self.drop_cancelled();
        let now = Instant::now();
        let limits = self.step_limits();
        let admission = {
            let running: Vec<SeqProgress> = self.running.iter().map(Seq::progress).collect();
            scheduler::plan(&running, &self.queue_view(now), limits, &self.vtc)
        };
        self.apply_admission(&admission, now);
        // The work is planned over the batch as it now is: a request admitted with
        // fewer cached pages than the queue view promised computes them itself.
        let plan = {
            let running: Vec<SeqProgress> = self.running.iter().map(Seq::progress).collect();
            scheduler::plan(&running, &[], limits, &self.vtc)
        };
        let charges = scheduler::computed_by_tenant(&plan, |i| self.running[i].tenant);
        for (tenant, prefill, decode) in charges {
            self.vtc.charge(tenant, prefill, decode);
        }
        let live: Vec<u64> = self
            .running
            .iter()
            .map(|s| s.tenant)
            .chain(self.parked.values().map(|p| p.tenant))
            .collect();
        let waiting = self.waiting_tenants();
        self.vtc
            .forget_idle(&waiting, |t| live.contains(&t) || waiting.contains(&t));
        let rows = self.rows(&plan.work);
        if rows.is_empty() {
            return 0;
        }
        let out = self.model.forward(&rows, &mut self.kv);
        let mut finished: Vec<(SeqId, SeqEnd, Option<Event>)> = Vec::new();
        let mut prefilled: Vec<Prefilled> = Vec::new();
        self.metrics
            .attention_tag_mismatches
            .inc_by(out.failed.len() as u64);
        for (seq, err) in &out.failed {
            let e = EngineError::Integrity(*err);
            finished.push((*seq, SeqEnd::Failed(e.clone()), Some(Event::Error(e))));
        }
        // Prefill progress for rows that were not sampled.
        for r in &rows {
            if let Some(s) = self.running.iter_mut().find(|s| s.id == r.seq) {
                if r.pos < s.prompt.len() {
                    s.prefilled = s.prefilled.max(r.pos + 1);
                }
            }
        }
        for (row, mut logits) in out.logits {
            let (seq, pos) = (rows[row].seq, rows[row].pos);
            let Some(s) = self.running.iter_mut().find(|s| s.id == seq) else {
                continue;
            };
            if pos + 1 < s.prompt.len() {
                // A prompt position computed for its logprobs: scores the next
                // prompt token (raw logits; nothing is sampled).
                if let Some(k) = s.prompt_logprobs {
                    s.prompt_lp
                        .push(token_logprobs(&logits, s.prompt[pos + 1], k));
                }
                continue;
            }
            let (tok, lp) =
                s.sampler
                    .sample_logprobs(&mut logits, &s.prompt, &s.generated, s.logprobs);
            let logprobs = output_logprobs(s, tok, lp, &self.stop_ids);
            if s.role == SeqRole::Prefill {
                prefilled.push(Prefilled {
                    seq,
                    result: Ok(FirstToken {
                        token: tok,
                        rng_word_pos: s.sampler.rng_word_pos(),
                        logprobs,
                    }),
                    cached_tokens: s.cached,
                });
                continue;
            }
            match accept_token(s, tok, logprobs, &self.tokenizer, &self.stop_ids) {
                Accepted::Continue => {}
                Accepted::Finished(ev) => finished.push((seq, SeqEnd::Completed, Some(ev))),
                // The receiver is gone (client disconnected): abort and free.
                Accepted::Disconnected => finished.push((seq, SeqEnd::ClientGone, None)),
            }
        }
        for p in prefilled {
            self.park(p);
        }
        for (id, end, ev) in finished {
            let Some(i) = self.running.iter().position(|s| s.id == id) else {
                continue;
            };
            if self.running[i].role == SeqRole::Prefill {
                // An integrity error while computing the prompt: reported for export
                // handling; the pages stay until released.
                if let SeqEnd::Failed(e) = end {
                    let cached_tokens = self.running[i].cached;
                    self.park(Prefilled {
                        seq: id,
                        result: Err(e),
                        cached_tokens,
                    });
                }
                continue;
            }
            let mut s = self.running.remove(i);
            // Pages of a failed sequence are not trusted for reuse.
            self.free_seq(&s, !matches!(end, SeqEnd::Failed(_)));
            if let Some(ev) = ev {
                let _ = s.sink.send(ev);
            }
            self.record_end(id, end);
        }
        rows.len()
    }

    /// Steps until nothing is waiting or running.
    pub fn run_to_completion(&mut self) {
        while self.has_work() {
            self.step();
        }
    }

    /// Prefill role: takes a sequence whose compute ended out of the running batch,
    /// keeping its pages for export.
    fn park(&mut self, p: Prefilled) {
        if let Some(i) = self.running.iter().position(|s| s.id == p.seq) {
            let s = self.running.remove(i);
            self.parked.insert(
                s.id,
                Parked {
                    prompt: s.prompt.len(),
                    tenant: s.tenant,
                    chain: s.chain,
                    ok: p.result.is_ok(),
                },
            );
            self.prefilled.push(p);
        }
    }

    /// Drops requests whose client cancelled: waiting ones are never computed, running
    /// ones stop and free their pages (computed prompt pages may be cached).
    fn drop_cancelled(&mut self) {
        self.waiting.retain(|w| !w.sink.cancelled());
        let mut i = 0;
        while i < self.running.len() {
            if !self.running[i].sink.cancelled() {
                i += 1;
                continue;
            }
            let s = self.running.remove(i);
            self.free_seq(&s, true);
            self.record_end(s.id, SeqEnd::ClientGone);
        }
    }

    /// Carries out a plan's admission decisions: expired batch requests fail as
    /// busy; admitted ones join the running batch with all their pages (the
    /// scheduler counted them), reusing cached prompt pages.
    fn apply_admission(&mut self, plan: &scheduler::Plan, now: Instant) {
        if plan.admit.is_empty() && plan.expire.is_empty() {
            return;
        }
        let mut slots: Vec<Option<Waiting>> = self.waiting.drain(..).map(Some).collect();
        for &i in &plan.expire {
            if let Some(w) = slots[i].take() {
                let limit = self.cfg.batch_max_wait.unwrap_or_default();
                let e = EngineError::BatchQueueTimeout {
                    waited_ms: now.saturating_duration_since(w.queued_at).as_millis() as u64,
                    limit_ms: limit.as_millis() as u64,
                };
                self.fail_unstarted(w, e);
            }
        }
        let mut last = None;
        for &i in &plan.admit {
            if let Some(w) = slots[i].take() {
                last = Some(w.req.request().tenant);
                self.start_waiting(w);
            }
        }
        self.waiting = slots.into_iter().flatten().collect();
        if let (true, Some(t)) = (self.waiting.is_empty(), last) {
            self.vtc.on_queue_emptied(t);
        }
    }

    /// Ends a request that never started: its error goes to its sink (or, for a
    /// prefill-only sequence, to [`Self::take_prefilled`]); nothing is held.
    fn fail_unstarted(&mut self, w: Waiting, e: EngineError) {
        match w.role {
            SeqRole::Prefill => self.prefilled.push(Prefilled {
                seq: w.id,
                result: Err(e),
                cached_tokens: 0,
            }),
            SeqRole::Generate => {
                let mut sink = w.sink;
                let _ = sink.send(Event::Error(e.clone()));
                self.record_end(w.id, SeqEnd::Failed(e));
            }
        }
    }

    /// Moves a waiting request into the running batch with all its pages, reusing
    /// the cached pages of its prompt's longest cached prefix after their tags check
    /// (I3); a mismatch fails the request (the entry is evicted).
    fn start_waiting(&mut self, w: Waiting) {
        // The format compiles before any page is reserved (a few ms at most).
        let r = w.req.request();
        let sampler = match constrain(&self.tokenizer, r, Sampler::new(r.sampling.clone(), w.id.0))
        {
            Ok(s) => s,
            Err(e) => {
                self.fail_unstarted(w, e);
                return;
            }
        };
        let tokens = w.tokens();
        let max_hit = w.max_hit_pages(self.cfg.page_size);
        let tenant = w.req.request().tenant;
        let hits = match self
            .kv
            .reserve_cached(w.id, tenant, tokens, &w.chain, max_hit)
        {
            Ok(h) => h,
            Err(ReserveError::Integrity(e)) => {
                tracing::error!(seq = ?w.id, error = %e, "prefix-cache hit failed its tag check; entry evicted");
                self.fail_unstarted(w, EngineError::Integrity(e));
                return;
            }
            Err(ReserveError::Pool(e)) => {
                // The scheduler counted the pages; only a duplicate id gets here.
                tracing::error!(seq = ?w.id, error = %e, "could not reserve a scheduled request");
                self.fail_unstarted(w, EngineError::Shutdown);
                return;
            }
        };
        let Waiting {
            req,
            id,
            sink,
            submitted,
            role,
            chain,
            ..
        } = w;
        let r = req.into_request();
        let mut s = Seq::new(id, r, sampler, sink, submitted, role);
        s.cached = hits * self.cfg.page_size;
        s.prefilled = s.cached;
        s.chain = chain;
        self.running.push(s);
    }

    /// The forward pass's rows for the planned work.
    fn rows(&self, work: &[Work]) -> Vec<BatchRow> {
        let mut rows = Vec::new();
        for w in work {
            match *w {
                Work::Decode { seq, pos } => {
                    let s = &self.running[seq];
                    rows.push(BatchRow {
                        seq: s.id,
                        token: *s.generated.last().expect("a decoding sequence"),
                        pos,
                        want_logits: true,
                    });
                }
                Work::Prefill { seq, start, end } => {
                    let s = &self.running[seq];
                    for pos in start..end {
                        rows.push(BatchRow {
                            seq: s.id,
                            token: s.prompt[pos],
                            pos,
                            want_logits: pos + 1 == s.prompt.len() || s.prompt_logprobs.is_some(),
                        });
                    }
                }
            }
        }
        rows
    }
}

/// `sampler` restricted to the request's `response_format`, when it has one (the
/// grammar compiled for this engine's vocabulary).
pub(crate) fn constrain(
    tk: &Tokenizer,
    r: &GenerateRequest,
    sampler: Sampler,
) -> Result<Sampler, EngineError> {
    let Some(format) = &r.output.format else {
        return Ok(sampler);
    };
    let constraint = tk.grammar()?.compile(format)?;
    Ok(sampler.with_constraint(constraint))
}

pub(crate) enum Accepted {
    Continue,
    Finished(Event),
    Disconnected,
}

/// What a sampled token's event carries of log probabilities: its own entry (not
/// for an end-of-sequence token, which is no part of the output) and, on the first
/// token, the prompt's; `None` when the request asked for neither.
pub(crate) fn output_logprobs(
    s: &mut Seq,
    tok: u32,
    lp: Option<TokenLogprobs>,
    stop_ids: &[u32],
) -> Option<Box<Logprobs>> {
    if s.logprobs.is_none() && s.prompt_logprobs.is_none() {
        return None;
    }
    let token = lp.filter(|_| s.ignore_eos || !stop_ids.contains(&tok));
    let prompt = if s.generated.is_empty() {
        std::mem::take(&mut s.prompt_lp)
    } else {
        Vec::new()
    };
    Some(Box::new(Logprobs { token, prompt }))
}

/// Appends a sampled token and sends its event (with `logprobs`, when asked).
pub(crate) fn accept_token(
    s: &mut Seq,
    tok: u32,
    logprobs: Option<Box<Logprobs>>,
    tk: &Tokenizer,
    stop_ids: &[u32],
) -> Accepted {
    let now = Instant::now();
    s.first_token.get_or_insert(now);
    s.generated.push(tok);
    let mut reason = None;
    let mut text: String;
    if !s.ignore_eos && stop_ids.contains(&tok) {
        reason = Some(FinishReason::Stop);
        text = s.stop.finish();
    } else {
        let piece = s.detok.push(tk, tok);
        // At the length limit, bytes still pending are the start of a character
        // the cut split: dropped, never emitted as U+FFFD.
        let at_limit = s.generated.len() >= s.max_tokens;
        match s.stop.push(&piece) {
            StopOutcome::Stopped { text: t, .. } => {
                text = t;
                reason = Some(FinishReason::Stop);
            }
            StopOutcome::Continue(t) => {
                text = t;
                if at_limit {
                    text.push_str(&s.stop.finish());
                    reason = Some(FinishReason::Length);
                }
            }
        }
    }
    let ev = Event::Token {
        id: tok,
        text,
        logprobs,
    };
    if s.sink.send(ev).is_err() {
        return Accepted::Disconnected;
    }
    let Some(reason) = reason else {
        return Accepted::Continue;
    };
    let first = s.first_token.unwrap_or(now);
    let n = s.generated.len();
    Accepted::Finished(Event::Done {
        reason,
        usage: Usage {
            prompt_tokens: s.prompt.len(),
            completion_tokens: n,
            cached_tokens: s.cached,
            ttft: first - s.submitted,
            tpot: if n > 1 {
                (now - first) / (n as u32 - 1)
            } else {
                Duration::ZERO
            },
        },
    })
}
