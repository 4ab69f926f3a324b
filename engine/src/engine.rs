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
use crate::scheduler::{self, Queued, SeqProgress, StepLimits, Work};
use crate::sink::EventSink;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_kernels::IntegrityError;
use tessera_model::detok::{IncrementalDecoder, StopMatcher, StopOutcome};
use tessera_model::kv::{KvManager, PagePool, SeqId};
use tessera_model::llama::{BatchRow, Llama};
use tessera_model::sampling::Sampler;
use tessera_model::tokenizer::Tokenizer;
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
    /// Held by sequences in the running batch.
    pub in_use: usize,
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
}

impl Default for EngineConfig {
    fn default() -> Self {
        Self {
            page_size: 16,
            kv_pool_tokens: 16384,
            max_batch_tokens: 512,
            max_running: 32,
            kv_scrub: false,
        }
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// End-of-sequence token or stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
}

/// Failures after admission on this engine; the request yields no further tokens.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// A KV page's tag did not match (I3).
    #[error("KV integrity check failed: {0}")]
    Integrity(#[from] IntegrityError),
    /// The engine stopped before the request finished.
    #[error("engine shut down")]
    Shutdown,
}

/// Token counts and timings of a finished request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Generated tokens (including a final stop token).
    pub completion_tokens: usize,
    /// Submit to first token.
    pub ttft: Duration,
    /// Mean time per output token after the first.
    pub tpot: Duration,
}

/// What a request's stream receives, in order: tokens, then one `Done` or `Error`.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// A generated token and the text it completed (may be empty mid-character or
    /// while a possible stop string is held back).
    Token {
        /// Token id.
        id: u32,
        /// Newly completed text.
        text: String,
    },
    /// Normal end.
    Done {
        /// Why.
        reason: FinishReason,
        /// Counts and timings.
        usage: Usage,
    },
    /// Abnormal end; no further tokens.
    Error(EngineError),
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
}

/// A prefill-only sequence whose compute ended ([`Engine::take_prefilled`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prefilled {
    /// The sequence (the transfer id on a prefill node).
    pub seq: SeqId,
    /// The first token and the sampler position after it, or the integrity error that
    /// stopped the compute. The pages stay reserved either way.
    pub result: Result<FirstToken, IntegrityError>,
}

/// The token sampled at the end of a prefill, and the sampler's RNG position after it
/// ([`Sampler::rng_word_pos`]), so the decode node continues the same stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FirstToken {
    /// Token id.
    pub token: u32,
    /// Sampler RNG word position after sampling it.
    pub rng_word_pos: u128,
}

/// The engine: one owner of the model's KV pool and the running batch.
pub struct Engine {
    pub(crate) model: Arc<Llama>,
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
    /// Prefill role: finished prefills not yet taken, and the prompt length of every
    /// prefill-only sequence whose compute ended and whose pages are still held.
    prefilled: Vec<Prefilled>,
    pub(crate) parked: HashMap<SeqId, usize>,
    pub(crate) metrics: EngineMetrics,
}

impl Engine {
    /// Builds an engine with a pool of `cfg.kv_pool_tokens / cfg.page_size` pages.
    pub fn new(model: Arc<Llama>, tokenizer: Arc<Tokenizer>, cfg: EngineConfig) -> Self {
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
        Self {
            model,
            tokenizer,
            cfg,
            kv: KvManager::new(pool),
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
        let in_use: usize = self
            .running
            .iter()
            .map(|s| self.kv.table(s.id).map_or(0, |t| t.len()))
            .sum();
        let held = pool.capacity() - free;
        PageStates {
            free,
            reserved: held.saturating_sub(in_use),
            in_use: in_use.min(held),
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
        self.waiting.push_back(Waiting {
            req,
            id,
            sink,
            submitted,
            role: SeqRole::Generate,
        });
    }

    /// Prefill role: queues a prefill-only sequence `seq` (the transfer id): only the
    /// prompt's pages are allocated here, the first token ends its compute, and
    /// [`Self::take_prefilled`] reports it; its pages stay reserved until
    /// [`Self::release_prefill`]. The sampler's fallback seed is `seq`, so the decode
    /// node can continue the same RNG stream.
    pub fn enqueue_prefill(&mut self, req: Admitted, seq: SeqId) {
        self.waiting.push_back(Waiting {
            req,
            id: seq,
            sink: Box::new(crate::sink::Discard),
            submitted: Instant::now(),
            role: SeqRole::Prefill,
        });
    }

    /// Prefill role: prefills whose compute ended since the last call.
    pub fn take_prefilled(&mut self) -> Vec<Prefilled> {
        std::mem::take(&mut self.prefilled)
    }

    /// Prefill role: drops prefill-only sequence `seq` wherever it is (queued,
    /// computing, or computed and held for export) and frees its pages. Returns
    /// whether it was found.
    pub fn release_prefill(&mut self, seq: SeqId) -> bool {
        let mut found = false;
        if let Some(i) = self.waiting.iter().position(|w| w.id == seq) {
            self.waiting.remove(i);
            found = true;
        }
        if let Some(i) = self.running.iter().position(|s| s.id == seq) {
            self.running.remove(i);
            found = true;
        }
        found |= self.parked.remove(&seq).is_some();
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

    /// Runs one scheduling step: drops cancelled requests, admits waiting ones, runs
    /// one forward pass, samples and emits. Returns the number of tokens in the
    /// forward pass (0 when idle).
    pub fn step(&mut self) -> usize {
        self.drop_cancelled();
        let plan = {
            let running: Vec<SeqProgress> = self.running.iter().map(Seq::progress).collect();
            let queue: Vec<Queued> = self
                .waiting
                .iter()
                .map(|w| Queued {
                    prompt: w.req.request().prompt.len(),
                    pages: self.kv.pages_for(w.tokens()),
                })
                .collect();
            scheduler::plan(
                &running,
                &queue,
                StepLimits {
                    max_batch_tokens: self.cfg.max_batch_tokens,
                    max_running: self.cfg.max_running,
                    free_pages: self.kv.pool().free_pages(),
                },
            )
        };
        for _ in 0..plan.admit {
            self.start_waiting();
        }
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
            let seq = rows[row].seq;
            let Some(s) = self.running.iter_mut().find(|s| s.id == seq) else {
                continue;
            };
            let tok = s.sampler.sample(&mut logits, &s.prompt, &s.generated);
            if s.role == SeqRole::Prefill {
                prefilled.push(Prefilled {
                    seq,
                    result: Ok(FirstToken {
                        token: tok,
                        rng_word_pos: s.sampler.rng_word_pos(),
                    }),
                });
                continue;
            }
            match accept_token(s, tok, &self.tokenizer, &self.stop_ids) {
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
                if let SeqEnd::Failed(EngineError::Integrity(e)) = end {
                    self.park(Prefilled {
                        seq: id,
                        result: Err(e),
                    });
                }
                continue;
            }
            let mut s = self.running.remove(i);
            self.kv.release(id);
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
            self.parked.insert(s.id, s.prompt.len());
            self.prefilled.push(p);
        }
    }

    /// Drops requests whose client cancelled: waiting ones are never computed, running
    /// ones stop and free their pages.
    fn drop_cancelled(&mut self) {
        self.waiting.retain(|w| !w.sink.cancelled());
        let gone: Vec<SeqId> = self
            .running
            .iter()
            .filter(|s| s.sink.cancelled())
            .map(|s| s.id)
            .collect();
        for id in gone {
            self.release_seq(id);
            self.record_end(id, SeqEnd::ClientGone);
        }
    }

    /// Moves the oldest waiting request into the running batch with all its pages
    /// (the scheduler checked they fit).
    fn start_waiting(&mut self) {
        let Some(w) = self.waiting.pop_front() else {
            return;
        };
        let tokens = w.tokens();
        let r = w.req.into_request();
        if let Err(e) = self.kv.reserve(w.id, r.tenant, tokens) {
            // The scheduler counted the free pages; only a duplicate id gets here.
            tracing::error!(seq = ?w.id, error = %e, "could not reserve a scheduled request");
            let mut sink = w.sink;
            let _ = sink.send(Event::Error(EngineError::Shutdown));
            return;
        }
        let sampler = Sampler::new(r.sampling.clone(), w.id.0);
        self.running
            .push(Seq::new(w.id, r, sampler, w.sink, w.submitted, w.role));
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
                            want_logits: pos + 1 == s.prompt.len(),
                        });
                    }
                }
            }
        }
        rows
    }
}

pub(crate) enum Accepted {
    Continue,
    Finished(Event),
    Disconnected,
}

/// Appends a sampled token and sends its event.
pub(crate) fn accept_token(s: &mut Seq, tok: u32, tk: &Tokenizer, stop_ids: &[u32]) -> Accepted {
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
    if s.sink.send(Event::Token { id: tok, text }).is_err() {
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
            ttft: first - s.submitted,
            tpot: if n > 1 {
                (now - first) / (n as u32 - 1)
            } else {
                Duration::ZERO
            },
        },
    })
}
