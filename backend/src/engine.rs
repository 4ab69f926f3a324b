//! Co-located engine: admission, continuous batching with chunked prefill,
//! sampling and streaming events.
//!
//! Lifecycle of a request: [`Engine::admit`] turns a [`GenerateRequest`] into an
//! [`Admitted`] request or a [`Rejection`] (I1: checked before any page is touched;
//! a rejection is a terminal value no queue accepts). Admitted requests wait in FIFO
//! order until the pool can hold `prompt + max_tokens` tokens, then get all their
//! pages at once, so a running sequence never runs out of KV memory. Every
//! [`Engine::step`] runs one forward pass over one decode token of every decoding
//! sequence plus prompt chunks of prefilling sequences up to `max_batch_tokens`.

use crate::detok::{IncrementalDecoder, StopMatcher, StopOutcome};
use crate::kv::{KvManager, PagePool, PoolError, SeqId};
use crate::model::{BatchRow, Llama};
use crate::pd::inproc::PageLanding;
use crate::pd::transport::{DestPage, KvTransport, TransportError};
use crate::sampling::{Sampler, SamplingError, SamplingParams};
use crate::tokenizer::Tokenizer;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_kernels::{BlockRef, IntegrityError};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

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

/// A generation request as the engine sees it (token ids, not text).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct GenerateRequest {
    /// Owner of the request's KV pages.
    pub tenant: u64,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate (>= 1).
    pub max_tokens: usize,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Stop strings: generation ends before the first occurrence.
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens (benchmarks, reference tests).
    pub ignore_eos: bool,
}

/// Why a request was refused at admission. Terminal: nothing was allocated.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Rejection {
    /// No prompt tokens.
    #[error("prompt is empty")]
    EmptyPrompt,
    /// `max_tokens` was 0.
    #[error("`max_tokens` must be >= 1. Given: 0")]
    ZeroMaxTokens,
    /// Prompt plus `max_tokens` does not fit the context window.
    #[error("prompt ({prompt} tokens) + max_tokens ({max_tokens}) = {} exceeds the model's context window of {context} tokens", prompt.saturating_add(*max_tokens))]
    ContextOverflow {
        /// Prompt tokens.
        prompt: usize,
        /// Requested output tokens.
        max_tokens: usize,
        /// Model context window.
        context: usize,
    },
    /// The request can never fit this node's KV pool.
    #[error("request needs {needed} KV tokens but this node's pool holds {capacity}")]
    PoolTooSmall {
        /// Tokens needed (prompt + max_tokens, rounded to pages).
        needed: usize,
        /// Pool capacity in tokens.
        capacity: usize,
    },
    /// A prompt token id is outside the vocabulary.
    #[error("token id {id} is outside the vocabulary of {vocab}")]
    BadToken {
        /// Offending id.
        id: u32,
        /// Vocabulary size.
        vocab: usize,
    },
    /// Invalid sampling parameters.
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// No node can take the request now (every node of a role is unreachable);
    /// retryable.
    #[error("{0}")]
    Unavailable(String),
}

impl Rejection {
    /// Stable machine label.
    pub fn label(&self) -> &'static str {
        match self {
            Self::EmptyPrompt => "empty_prompt",
            Self::ZeroMaxTokens => "zero_max_tokens",
            Self::ContextOverflow { .. } => "context_overflow",
            Self::PoolTooSmall { .. } => "pool_too_small",
            Self::BadToken { .. } => "bad_token",
            Self::Sampling(_) => "bad_sampling",
            Self::Unavailable(_) => "unavailable",
        }
    }
}

/// A request that passed admission. Only [`Engine::admit`] makes one.
#[derive(Debug)]
pub struct Admitted(GenerateRequest);

impl Admitted {
    /// The validated request.
    pub fn request(&self) -> &GenerateRequest {
        &self.0
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

/// Failures after admission; the request yields no further tokens.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// A KV page's tag did not match (I3).
    #[error("KV integrity check failed: {0}")]
    Integrity(#[from] IntegrityError),
    /// The engine stopped before the request finished.
    #[error("engine shut down")]
    Shutdown,
    /// A node refused the request at admission (I1): a client error (or, for
    /// [`RefusalKind::Busy`](crate::pd::protocol::RefusalKind::Busy), a retryable one), not a fault.
    #[error("request refused: {0}")]
    Refused(crate::pd::protocol::Refusal),
    /// The KV transfer between prefill and decode failed (I4) or a node holding the
    /// request was lost.
    #[error("KV transfer failed: {0}")]
    Transfer(String),
    /// A remote node failed the request after admission (its message).
    #[error("node error: {0}")]
    Node(String),
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

struct Seq {
    id: SeqId,
    prompt: Vec<u32>,
    generated: Vec<u32>,
    max_tokens: usize,
    ignore_eos: bool,
    prefilled: usize,
    sampler: Sampler,
    detok: IncrementalDecoder,
    stop: StopMatcher,
    sink: UnboundedSender<Event>,
    submitted: Instant,
    first_token: Option<Instant>,
    /// Prefill role: after the first token, move the pages out instead of decoding.
    export: Option<ExportJob>,
}

/// What a prefill node does with a sequence once its prompt is computed: write the
/// prompt's pages into the decode node's reserved pages and report the commit.
pub struct ExportJob {
    /// Transfer (request) id, unique per coordinator.
    pub req: u64,
    /// Destination pages from the decode node's descriptor, one per prompt page.
    pub dest: Vec<DestPage>,
    /// How bytes reach the decode node.
    pub transport: Box<dyn KvTransport>,
    /// Called once, on the engine thread, with the result (after the writes were
    /// flushed and the source pages released: I5).
    pub done: Box<dyn FnOnce(Result<Exported, ExportError>) + Send>,
}

impl std::fmt::Debug for ExportJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExportJob")
            .field("req", &self.req)
            .field("dest", &self.dest.len())
            .finish()
    }
}

/// A completed export: what the prefill node puts in its `Commit`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exported {
    /// Prompt tokens whose K/V the pages hold.
    pub tokens: usize,
    /// Each written destination page with the CRC-32C of the bytes written.
    pub pages: Vec<(DestPage, u32)>,
    /// The token sampled from the last prompt position.
    pub first_token: u32,
    /// Sampler RNG position after the first token ([`Sampler::rng_word_pos`]).
    pub rng_word_pos: u128,
}

/// Why an export failed. The source pages are released either way.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ExportError {
    /// A source page's tag did not match its block table (I3 at the transfer source).
    #[error("KV integrity check failed at the transfer source: {0}")]
    Integrity(#[from] IntegrityError),
    /// The descriptor does not name one destination page per prompt page.
    #[error("descriptor names {dest} destination pages but the prompt fills {pages}")]
    DescriptorMismatch {
        /// Destination pages in the descriptor.
        dest: usize,
        /// Pages the prompt fills.
        pages: usize,
    },
    /// The transport failed.
    #[error(transparent)]
    Transport(#[from] TransportError),
}

/// Why a page landing was dropped (decode side).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LandError {
    /// The destination page is not held with the expected tag: a late or stray
    /// write after the reservation ended (its epoch moved on) or a forged handle.
    #[error("page {page} is not reserved with the tag this write names")]
    NotReserved {
        /// Physical page.
        page: u32,
    },
    /// The payload is not exactly one page.
    #[error("landing of {got} bytes, a page is {want}")]
    WrongSize {
        /// Bytes received.
        got: usize,
        /// Bytes per page.
        want: usize,
    },
}

/// The engine: one owner of the model's KV pool and the running batch.
pub struct Engine {
    model: Arc<Llama>,
    tokenizer: Arc<Tokenizer>,
    cfg: EngineConfig,
    kv: KvManager,
    waiting: VecDeque<Waiting>,
    running: Vec<Seq>,
    stop_ids: Vec<u32>,
    next_seq: u64,
    /// Decode role: sequences that left the running batch, and why (`None`: finished
    /// normally or the client went away; `Some`: an error). `None` when not tracked.
    ended: Option<Vec<(SeqId, Option<String>)>>,
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
        }
    }

    /// Starts recording which sequences leave the running batch (decode role: the
    /// protocol must learn when a decode ended). Drain with [`Self::take_ended`].
    pub fn track_ended(&mut self) {
        self.ended.get_or_insert_with(Vec::new);
    }

    /// Sequences that left the running batch since the last call, with the error that
    /// ended them, if any.
    pub fn take_ended(&mut self) -> Vec<(SeqId, Option<String>)> {
        self.ended.as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn record_end(&mut self, seq: SeqId, error: Option<String>) {
        if let Some(log) = &mut self.ended {
            log.push((seq, error));
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

    /// Queues an admitted request; its events go to the returned receiver.
    pub fn enqueue(&mut self, req: Admitted) -> UnboundedReceiver<Event> {
        let (tx, rx) = unbounded_channel();
        self.enqueue_with_sink(req, tx, Instant::now());
        rx
    }

    /// Queues an admitted request whose events go to `sink`; `submitted` is when
    /// the client's request arrived (TTFT is measured from it).
    pub fn enqueue_with_sink(
        &mut self,
        req: Admitted,
        sink: UnboundedSender<Event>,
        submitted: Instant,
    ) {
        self.waiting.push_back(Waiting {
            req,
            sink,
            submitted,
            export: None,
        });
    }

    /// Prefill role: queues an admitted request whose prompt is computed here and
    /// whose pages then go to a decode node as `job` says. Only the prompt's pages
    /// are allocated on this node. The sampler's fallback seed is the transfer id,
    /// so the decode node can continue the same RNG stream.
    pub fn enqueue_export(&mut self, req: Admitted, job: ExportJob) {
        // Nobody reads a prefill sequence's events; the first token goes in the
        // commit.
        let (sink, rx) = unbounded_channel();
        std::mem::forget(rx);
        self.waiting.push_back(Waiting {
            req,
            sink,
            submitted: Instant::now(),
            export: Some(job),
        });
    }

    /// Prefill role: drops the export of transfer `req` wherever it is (queued or
    /// computing) and frees its pages. Nothing of it is in flight afterwards: writes
    /// are issued and flushed within one step. Returns whether it was found.
    pub fn abort_export(&mut self, req: u64) -> bool {
        if let Some(i) = self
            .waiting
            .iter()
            .position(|w| w.export.as_ref().is_some_and(|j| j.req == req))
        {
            self.waiting.remove(i);
            return true;
        }
        if let Some(i) = self
            .running
            .iter()
            .position(|s| s.export.as_ref().is_some_and(|j| j.req == req))
        {
            let s = self.running.remove(i);
            self.kv.release(s.id);
            return true;
        }
        false
    }

    /// Decode role: reserves pages for `prompt_tokens + max_tokens` tokens of a
    /// sequence whose prompt K/V will arrive by transfer, all or nothing. Returns the
    /// new sequence and the destination pages of the prompt (one per prompt page, in
    /// logical order) for the descriptor.
    pub fn reserve_import(
        &mut self,
        tenant: u64,
        prompt_tokens: usize,
        max_tokens: usize,
    ) -> Result<(SeqId, Vec<DestPage>), PoolError> {
        let id = SeqId(self.next_seq);
        self.kv
            .reserve(id, tenant, prompt_tokens.saturating_add(max_tokens))?;
        self.next_seq += 1;
        let n = self.kv.pages_for(prompt_tokens);
        let table = self.kv.table(id).expect("just reserved");
        let dest = table[..n]
            .iter()
            .map(|r| DestPage {
                page: r.page,
                tag: r.tag,
            })
            .collect();
        Ok((id, dest))
    }

    /// Decode role: writes one transferred page into the pool, if the page is still
    /// reserved with the tag the write names (a late write after its reservation
    /// ended is dropped: the epoch moved on).
    pub fn land(&mut self, landing: &PageLanding) -> Result<(), LandError> {
        let want = self.kv.layout().page_bytes();
        if landing.bytes.len() != want {
            return Err(LandError::WrongSize {
                got: landing.bytes.len(),
                want,
            });
        }
        let r = BlockRef {
            page: landing.dest.page,
            tag: landing.dest.tag,
        };
        let (pool, _) = self.kv.split_mut();
        let dst = pool
            .page_data_mut(r)
            .ok_or(LandError::NotReserved { page: r.page })?;
        dst.copy_from_slice(&landing.bytes);
        Ok(())
    }

    /// Decode role: CRC-32C of the bytes now in `dest`, or `None` when the page is
    /// not held with `dest.tag` (I4 commit verification).
    pub fn landed_checksum(&self, dest: DestPage) -> Option<u32> {
        let page = self.kv.pool().page_data(BlockRef {
            page: dest.page,
            tag: dest.tag,
        })?;
        Some(page_checksum(page))
    }

    /// Decode role: starts decoding a sequence whose prompt pages were transferred
    /// and verified. Emits `first_token` (sampled by the prefill node) as the first
    /// event, then decodes as usual. `seq` must come from [`Self::reserve_import`].
    pub fn adopt(&mut self, seq: SeqId, import: Import) {
        let Import {
            req,
            first_token,
            seed_fallback,
            rng_word_pos,
            sink,
            submitted,
        } = import;
        let Admitted(r) = req;
        let mut s = Seq {
            id: seq,
            sampler: Sampler::resume(r.sampling.clone(), seed_fallback, rng_word_pos),
            prefilled: r.prompt.len(),
            prompt: r.prompt,
            generated: Vec::new(),
            max_tokens: r.max_tokens,
            ignore_eos: r.ignore_eos,
            detok: IncrementalDecoder::new(true),
            stop: StopMatcher::new(r.stop),
            sink,
            submitted,
            first_token: None,
            export: None,
        };
        match Self::accept_token(&mut s, first_token, &self.tokenizer, &self.stop_ids) {
            Accepted::Continue => self.running.push(s),
            Accepted::Finished(ev) => {
                self.kv.release(seq);
                self.record_end(seq, None);
                let _ = s.sink.send(ev);
            }
            Accepted::Disconnected => {
                self.kv.release(seq);
                self.record_end(seq, None);
            }
        }
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

    /// Runs one scheduling step (admit, one forward pass, sample, emit). Returns the
    /// number of tokens in the forward pass (0 when idle).
    pub fn step(&mut self) -> usize {
        self.admit_waiting();
        let rows = self.build_batch();
        if rows.is_empty() {
            return 0;
        }
        let out = self.model.forward(&rows, &mut self.kv);
        let mut finished: Vec<(SeqId, Option<Event>)> = Vec::new();
        let mut exports: Vec<(SeqId, u32)> = Vec::new();
        for (seq, err) in &out.failed {
            finished.push((*seq, Some(Event::Error(EngineError::Integrity(*err)))));
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
            if s.export.is_some() {
                exports.push((seq, tok));
                continue;
            }
            match Self::accept_token(s, tok, &self.tokenizer, &self.stop_ids) {
                Accepted::Continue => {}
                Accepted::Finished(ev) => finished.push((seq, Some(ev))),
                // The receiver is gone (client disconnected): abort and free.
                Accepted::Disconnected => finished.push((seq, None)),
            }
        }
        for (id, tok) in exports {
            if let Some(i) = self.running.iter().position(|s| s.id == id) {
                let mut s = self.running.remove(i);
                let mut job = s.export.take().expect("export sequence");
                let result = export_pages(&self.kv, &s, &mut job).map(|pages| Exported {
                    tokens: s.prompt.len(),
                    pages,
                    first_token: tok,
                    rng_word_pos: s.sampler.rng_word_pos(),
                });
                // I5: the writes are flushed (or failed) before the source pages go.
                self.kv.release(id);
                (job.done)(result);
            }
        }
        for (id, ev) in finished {
            if let Some(i) = self.running.iter().position(|s| s.id == id) {
                let mut s = self.running.remove(i);
                self.kv.release(id);
                if let Some(job) = s.export.take() {
                    if let Some(Event::Error(EngineError::Integrity(e))) = ev {
                        (job.done)(Err(ExportError::Integrity(e)));
                    }
                } else {
                    let error = match &ev {
                        Some(Event::Error(e)) => Some(e.to_string()),
                        _ => None,
                    };
                    self.record_end(id, error);
                    if let Some(ev) = ev {
                        let _ = s.sink.send(ev);
                    }
                }
            }
        }
        rows.len()
    }

    /// Steps until nothing is waiting or running.
    pub fn run_to_completion(&mut self) {
        while self.has_work() {
            self.step();
        }
    }

    /// Appends a sampled token and sends its event.
    fn accept_token(s: &mut Seq, tok: u32, tk: &Tokenizer, stop_ids: &[u32]) -> Accepted {
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

    fn admit_waiting(&mut self) {
        while self.running.len() < self.cfg.max_running {
            let Some(w) = self.waiting.front() else {
                break;
            };
            let r = w.req.request();
            // A prefill-only sequence needs its prompt's pages; its output pages are
            // reserved on the decode node.
            let tokens = if w.export.is_some() {
                r.prompt.len()
            } else {
                r.prompt.len().saturating_add(r.max_tokens)
            };
            if !self.kv.can_reserve(tokens) {
                break; // FIFO: wait for pages rather than overtaking.
            }
            let Waiting {
                req: Admitted(r),
                sink,
                submitted,
                export,
            } = self.waiting.pop_front().unwrap();
            let id = SeqId(self.next_seq);
            let seed_fallback = export.as_ref().map_or(id.0, |j| j.req);
            self.next_seq += 1;
            self.kv
                .reserve(id, r.tenant, tokens)
                .expect("can_reserve checked; the engine is the pool's only user");
            self.running.push(Seq {
                id,
                sampler: Sampler::new(r.sampling.clone(), seed_fallback),
                prompt: r.prompt,
                generated: Vec::new(),
                max_tokens: r.max_tokens,
                ignore_eos: r.ignore_eos,
                prefilled: 0,
                detok: IncrementalDecoder::new(true),
                stop: StopMatcher::new(r.stop),
                sink,
                submitted,
                first_token: None,
                export,
            });
        }
    }

    fn build_batch(&self) -> Vec<BatchRow> {
        let mut rows = Vec::new();
        let mut budget = self.cfg.max_batch_tokens;
        // Decode tokens first: one per decoding sequence.
        for s in &self.running {
            if s.prefilled == s.prompt.len() {
                if let Some(&last) = s.generated.last() {
                    rows.push(BatchRow {
                        seq: s.id,
                        token: last,
                        pos: s.prompt.len() + s.generated.len() - 1,
                        want_logits: true,
                    });
                    budget = budget.saturating_sub(1);
                }
            }
        }
        // Then prompt chunks, oldest first, within the remaining budget.
        for s in &self.running {
            if budget == 0 {
                break;
            }
            if s.prefilled < s.prompt.len() {
                let end = (s.prefilled + budget).min(s.prompt.len());
                for pos in s.prefilled..end {
                    rows.push(BatchRow {
                        seq: s.id,
                        token: s.prompt[pos],
                        pos,
                        want_logits: pos + 1 == s.prompt.len(),
                    });
                }
                budget -= end - s.prefilled;
            }
        }
        rows
    }
}

/// A queued request (co-located, or a prefill node's export).
struct Waiting {
    req: Admitted,
    sink: UnboundedSender<Event>,
    submitted: Instant,
    export: Option<ExportJob>,
}

/// A transferred sequence the decode node starts decoding ([`Engine::adopt`]).
#[derive(Debug)]
pub struct Import {
    /// The admitted request (prompt ids, sampling, stops).
    pub req: Admitted,
    /// The prefill node's first token.
    pub first_token: u32,
    /// Sampler fallback seed both nodes use (the transfer id).
    pub seed_fallback: u64,
    /// Sampler RNG position after the first token.
    pub rng_word_pos: u128,
    /// Where the sequence's events go.
    pub sink: UnboundedSender<Event>,
    /// When the client's request arrived (TTFT).
    pub submitted: Instant,
}

/// CRC-32C (Castagnoli) of a page's transfer bytes, the checksum both sides of a
/// KV transfer compute (I4). 0 when the integrity-overhead benchmark turned checks
/// off.
pub fn page_checksum(bytes: &[u8]) -> u32 {
    if tessera_kernels::attention::integrity_checks() {
        crc32c::crc32c(bytes)
    } else {
        0
    }
}

/// Writes a prefill sequence's prompt pages into the destination pages: checks each
/// source page's tag first (I3), zeroes slots past the prompt in the last page (no
/// stale bytes leave the node), checksums what is sent, then flushes.
fn export_pages(
    kv: &KvManager,
    s: &Seq,
    job: &mut ExportJob,
) -> Result<Vec<(DestPage, u32)>, ExportError> {
    let table = kv.table(s.id).unwrap_or(&[]);
    let n = kv.pages_for(s.prompt.len());
    if job.dest.len() != n || table.len() < n {
        return Err(ExportError::DescriptorMismatch {
            dest: job.dest.len(),
            pages: n,
        });
    }
    tessera_kernels::attention::verify_tags(kv.pool().tags(), &table[..n])?;
    let layout = *kv.layout();
    let used_in_last = s.prompt.len() - (n - 1) * layout.page_size;
    let mut scratch: Vec<u8> = Vec::new();
    let mut pages = Vec::with_capacity(n);
    for (i, (r, dest)) in table[..n].iter().zip(&job.dest).enumerate() {
        let data = kv.pool().page_data(*r).ok_or(IntegrityError {
            page: r.page,
            logical_block: i as u32,
            expected: r.tag,
            found: kv.pool().tags()[r.page as usize],
        })?;
        let data = if i + 1 == n && used_in_last < layout.page_size {
            scratch.clear();
            scratch.extend_from_slice(data);
            layout.clear_slots_from(&mut scratch, used_in_last);
            &scratch[..]
        } else {
            data
        };
        job.transport.put(job.req, *dest, data)?;
        pages.push((*dest, page_checksum(data)));
    }
    job.transport.flush()?;
    Ok(pages)
}

enum Accepted {
    Continue,
    Finished(Event),
    Disconnected,
}

/// What admission checks a request against: the model's context window and the
/// node's pool. Copyable, so any thread can admit without touching the engine.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AdmissionLimits {
    /// Model context window (tokens).
    pub context: usize,
    /// KV pool capacity (tokens).
    pub pool_tokens: usize,
    /// Tokens per page.
    pub page_size: usize,
    /// Vocabulary size.
    pub vocab: usize,
}

impl AdmissionLimits {
    /// The I1 checks: pure, no allocation. Returns the validated request.
    pub fn admit(&self, req: GenerateRequest) -> Result<Admitted, Rejection> {
        check(
            &req,
            self.context,
            self.pool_tokens,
            self.page_size,
            self.vocab,
        )?;
        Ok(Admitted(req))
    }
}

fn check(
    req: &GenerateRequest,
    context: usize,
    pool_tokens: usize,
    page_size: usize,
    vocab: usize,
) -> Result<(), Rejection> {
    if req.prompt.is_empty() {
        return Err(Rejection::EmptyPrompt);
    }
    if req.max_tokens == 0 {
        return Err(Rejection::ZeroMaxTokens);
    }
    if let Some(&id) = req.prompt.iter().find(|&&t| t as usize >= vocab) {
        return Err(Rejection::BadToken { id, vocab });
    }
    let total = req.prompt.len().saturating_add(req.max_tokens);
    if total > context {
        return Err(Rejection::ContextOverflow {
            prompt: req.prompt.len(),
            max_tokens: req.max_tokens,
            context,
        });
    }
    let needed = total.div_ceil(page_size) * page_size;
    if needed > pool_tokens {
        return Err(Rejection::PoolTooSmall {
            needed,
            capacity: pool_tokens,
        });
    }
    req.sampling.validate()?;
    Ok(())
}
