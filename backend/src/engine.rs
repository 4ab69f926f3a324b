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
use crate::kv::{KvManager, PagePool, SeqId};
use crate::model::{BatchRow, Llama};
use crate::sampling::{Sampler, SamplingError, SamplingParams};
use crate::tokenizer::Tokenizer;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tessera_kernels::IntegrityError;
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
#[derive(Clone, Debug)]
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
}

/// The engine: one owner of the model's KV pool and the running batch.
pub struct Engine {
    model: Arc<Llama>,
    tokenizer: Arc<Tokenizer>,
    cfg: EngineConfig,
    kv: KvManager,
    waiting: VecDeque<(Admitted, UnboundedSender<Event>, Instant)>,
    running: Vec<Seq>,
    stop_ids: Vec<u32>,
    next_seq: u64,
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
        self.waiting.push_back((req, sink, submitted));
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
            match Self::accept_token(s, tok, &self.tokenizer, &self.stop_ids) {
                Accepted::Continue => {}
                Accepted::Finished(ev) => finished.push((seq, Some(ev))),
                // The receiver is gone (client disconnected): abort and free.
                Accepted::Disconnected => finished.push((seq, None)),
            }
        }
        for (id, ev) in finished {
            if let Some(i) = self.running.iter().position(|s| s.id == id) {
                let s = self.running.remove(i);
                self.kv.release(id);
                if let Some(ev) = ev {
                    let _ = s.sink.send(ev);
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
            let Some((req, _, _)) = self.waiting.front() else {
                break;
            };
            let r = req.request();
            let tokens = r.prompt.len().saturating_add(r.max_tokens);
            if !self.kv.can_reserve(tokens) {
                break; // FIFO: wait for pages rather than overtaking.
            }
            let (Admitted(r), sink, submitted) = self.waiting.pop_front().unwrap();
            let id = SeqId(self.next_seq);
            self.next_seq += 1;
            self.kv
                .reserve(id, r.tenant, tokens)
                .expect("can_reserve checked; the engine is the pool's only user");
            self.running.push(Seq {
                id,
                sampler: Sampler::new(r.sampling.clone(), id.0),
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

enum Accepted {
    Continue,
    Finished(Event),
    Disconnected,
}

/// What admission checks a request against: the model's context window and the
/// node's pool. Copyable, so any thread can admit without touching the engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
