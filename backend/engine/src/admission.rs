//! Admission (I1): every check that can refuse a request, before any page is
//! allocated, any bootstrap starts or any byte moves. [`AdmissionLimits::admit`] turns
//! a [`GenerateRequest`] into an [`Admitted`] request or a [`Rejection`]; only
//! admitted requests can be queued, and a rejection is a terminal value that no queue
//! accepts (there is no placeholder request).

use crate::scheduler::Priority;
use tessera_model::detok::{check_stops, StopError};
use tessera_model::sampling::{SamplingError, SamplingParams};

/// A prefix-cache namespace: 32 bytes the server derives from the tenant's account
/// and its cache salt. Requests with the same namespace may share cached prompt
/// pages; no request ever chooses its own.
pub type CacheNamespace = [u8; 32];

fn one() -> u32 {
    1
}

/// A tenant's own bounds on its prefix-cache pages on each engine (0: no bound of
/// its own; the engine's share of the pool still applies). `max_tokens` counts in
/// whole pages, rounded up.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CachePolicy {
    /// Most tokens (whole pages) kept in an engine's pool for the tenant: past it
    /// its least recently used pages are dropped, not spilled to a lower tier.
    #[serde(default)]
    pub max_tokens: u64,
    /// Seconds a cached page of the tenant may go unused before it is dropped (in
    /// the pool and in the lower tiers).
    #[serde(default)]
    pub idle_ttl_secs: u64,
    /// When the tenant's limits were last set (Unix ms, from its record): an engine
    /// keeps the latest it has seen and ignores older ones (requests in flight and
    /// queued batch items carry the limits of their submission).
    #[serde(default)]
    pub version: u64,
}

/// A generation request as the engine sees it (token ids, not text).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct GenerateRequest {
    /// Owner of the request's KV pages.
    pub tenant: u64,
    /// Priority class (already capped at the tenant's ceiling by the gateway).
    #[serde(default)]
    pub priority: Priority,
    /// The tenant's fair-share weight (>= 1; 0 is read as 1): its virtual token
    /// counter advances by cost / weight.
    #[serde(default = "one")]
    pub weight: u32,
    /// The tenant's prefix-cache namespace; `None`: this request neither reuses nor
    /// leaves cached pages.
    #[serde(default)]
    pub cache_namespace: Option<CacheNamespace>,
    /// The tenant's own bounds on what engines keep cached of it (from its tenant
    /// record; the latest request of a tenant sets them on the engine).
    #[serde(default)]
    pub cache_policy: CachePolicy,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Most tokens to generate (>= 1).
    pub max_tokens: usize,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Stop strings: generation ends before the first occurrence. At most
    /// [`tessera_model::detok::MAX_STOPS`] of at most
    /// [`tessera_model::detok::MAX_STOP_BYTES`] bytes each.
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens (benchmarks, reference tests).
    pub ignore_eos: bool,
    /// What the request asks of its output beyond tokens (log probabilities);
    /// the default asks nothing and costs nothing.
    #[serde(default)]
    pub output: OutputOptions,
    /// Set when the request continues another attempt's output on this node (a
    /// node failed mid-stream, issue 36); `None` for every new request.
    #[serde(default)]
    pub resume: Option<Resume>,
    /// Prompt-lookup speculation for this request: at most this many draft tokens a
    /// step (capped at [`MAX_SPECULATE`]; 0: none); `None`: the engine's
    /// [`EngineConfig::speculate`](crate::EngineConfig::speculate). The output is the
    /// same either way; only its speed changes.
    #[serde(default)]
    pub speculate: Option<u32>,
    /// Where the drafts come from ([`SpecMode`]); `None`: the engine's default (a
    /// draft model where the engine has one, else prompt lookup).
    #[serde(default)]
    pub speculate_mode: Option<SpecMode>,
    /// The tenant's LoRA fine-tune this request runs under (`None`: the base model).
    /// Its weights travel only within a process; over a node link only its id does,
    /// and an engine without the weights refuses the request ([`Rejection::Lora`]).
    #[serde(default)]
    pub lora: Option<LoraRef>,
}

/// A request's LoRA adapter: the fine-tune's id and its loaded weights. Serialized
/// as the id alone (weights are never sent in a request), so a deserialized one has
/// no weights: a node gets the adapter's file once per link ([`AdapterFile`]) and
/// attaches the weights it loaded from it.
#[derive(Clone, Debug)]
pub struct LoraRef {
    /// The fine-tune's id (what its pages' cache namespace is derived with).
    pub id: String,
    /// The adapter, when this process has it.
    pub weights: Option<std::sync::Arc<tessera_model::lora::LoraWeights>>,
    /// The adapter's file, where this process may have to send it to the nodes
    /// that run the request (a gateway in front of `tessera node` processes).
    pub file: Option<std::sync::Arc<AdapterFile>>,
}

/// A LoRA adapter's GGUF file as uploaded, with its SHA-256 (lowercase hex).
#[derive(Debug, PartialEq, Eq)]
pub struct AdapterFile {
    /// SHA-256 of `bytes`, lowercase hex (64 digits).
    pub sha256: String,
    /// The file.
    pub bytes: Vec<u8>,
}

/// Equal: the same fine-tune id and the same loaded weights (or neither loaded).
impl PartialEq for LoraRef {
    fn eq(&self, o: &Self) -> bool {
        self.id == o.id
            && match (&self.weights, &o.weights) {
                (Some(a), Some(b)) => std::sync::Arc::ptr_eq(a, b),
                (None, None) => true,
                _ => false,
            }
    }
}

impl Eq for LoraRef {}

impl serde::Serialize for LoraRef {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.id)
    }
}

impl<'de> serde::Deserialize<'de> for LoraRef {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Ok(Self {
            id: String::deserialize(d)?,
            weights: None,
            file: None,
        })
    }
}

/// Most draft tokens a request may ask for per step.
pub const MAX_SPECULATE: u32 = 8;

/// Where a speculating request's draft tokens come from (issue 37). Either way they
/// are verified by the served model in its own forward pass, so the output is the
/// same as without drafts; only its speed changes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpecMode {
    /// Prompt lookup: the request's own prompt and output ("prompt lookup
    /// decoding", Saxena 2023).
    Ngram,
    /// A smaller model of the same tokenizer drafts greedily (Leviathan et al.,
    /// "Fast Inference from Transformers via Speculative Decoding", 2023), with its
    /// KV in a tagged pool of its own under the request's tenant tags.
    Draft,
}

/// A request that continues output a client already received: its `prompt` is the
/// original prompt followed by that output's `output_tokens` ids, prefilled like the
/// prompt but counted as output by the penalties, the format constraint, the
/// detokenizer, stop strings and usage, so the tokens that follow are those the
/// uninterrupted run would have produced (greedy, and seeded sampling through
/// `rng_word_pos`). `max_tokens` counts what is still to generate.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Resume {
    /// Output tokens at the end of `prompt` (fewer than the prompt's tokens).
    pub output_tokens: usize,
    /// The sampler's RNG word position after the last of them
    /// ([`tessera_model::sampling::Sampler::rng_word_pos`]).
    pub rng_word_pos: u64,
}

/// What a request asks of its output beyond the tokens. The default asks nothing.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OutputOptions {
    /// Each generated token's log probability with this many alternatives
    /// (capped at [`tessera_model::sampling::MAX_TOP_LOGPROBS`]); `None`: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logprobs: Option<u32>,
    /// Each prompt token's log probability (after the first) with this many
    /// alternatives, sent with the first token; `None`: none. Such a request
    /// computes its whole prompt (no prefix-cache reuse) and the logits of every
    /// prompt position.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_logprobs: Option<u32>,
    /// The shape the output must take (JSON object, JSON Schema), enforced by
    /// constrained decoding ([`tessera_model::grammar`]); `None`: free text, and no
    /// mask is computed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<tessera_model::grammar::ResponseFormat>,
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
    /// Too many or too long stop strings.
    #[error(transparent)]
    Stop(#[from] StopError),
    /// No node can take the request now (every node of a role is unreachable);
    /// retryable.
    #[error("{0}")]
    Unavailable(String),
    /// The request names a LoRA fine-tune whose weights this engine does not have.
    #[error("the fine-tune {0} is not available on this engine")]
    Lora(String),
    /// The request asks for draft-model speculation and the model has no draft
    /// model (`tessera serve --draft-model`).
    #[error(
        "`speculative.mode` \"draft\": this model has no draft model; use \"ngram\" \
         (prompt lookup) or leave `mode` out"
    )]
    NoDraftModel,
}

impl GenerateRequest {
    /// A request of `tenant`: interactive, weight 1, no prefix cache, default
    /// sampling (greedy), no stop strings.
    pub fn new(tenant: u64, prompt: Vec<u32>, max_tokens: usize) -> Self {
        Self {
            tenant,
            priority: Priority::Interactive,
            weight: 1,
            cache_namespace: None,
            cache_policy: CachePolicy::default(),
            prompt,
            max_tokens,
            sampling: SamplingParams::default(),
            stop: vec![],
            ignore_eos: false,
            output: OutputOptions::default(),
            resume: None,
            speculate: None,
            speculate_mode: None,
            lora: None,
        }
    }
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
            Self::Stop(_) => "bad_stop",
            Self::Unavailable(_) => "unavailable",
            Self::Lora(_) => "lora_unavailable",
            Self::NoDraftModel => "no_draft_model",
        }
    }
}

/// A request that passed admission (I1): the proof travels with the request, so a
/// stage that takes an `Admitted` need not check again. Only the `admit` functions
/// ([`AdmissionLimits::admit`], [`PdAdmission::admit`], [`Engine::admit`](crate::Engine::admit))
/// make one; it reads as the request ([`Deref`](std::ops::Deref)) but cannot be
/// changed, and a clone is the same admitted request (an async batch item may be
/// submitted again after a busy refusal).
#[derive(Clone, Debug)]
pub struct Admitted(GenerateRequest, AdmissionLimits);

impl std::ops::Deref for Admitted {
    type Target = GenerateRequest;

    fn deref(&self) -> &GenerateRequest {
        &self.0
    }
}

impl Admitted {
    /// The validated request.
    pub fn request(&self) -> &GenerateRequest {
        &self.0
    }

    /// The validated request, by value (the proof of admission ends here).
    pub fn into_request(self) -> GenerateRequest {
        self.0
    }

    /// The limits it was admitted against: an engine with other limits checks it
    /// again before it queues it.
    pub fn limits(&self) -> AdmissionLimits {
        self.1
    }
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
    /// Whether the decoding engines have a draft model ([`SpecMode::Draft`]).
    pub draft: bool,
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
        Ok(Admitted(req, *self))
    }
}

fn check(
    req: &GenerateRequest,
    context: usize,
    pool_tokens: usize,
    page_size: usize,
    vocab: usize,
) -> Result<(), Rejection> {
    // A continuation's resumed output must leave at least one prompt token.
    let resumed = req.resume.map_or(0, |r| r.output_tokens);
    if req.prompt.len() <= resumed {
        return Err(Rejection::EmptyPrompt);
    }
    if req.max_tokens == 0 {
        return Err(Rejection::ZeroMaxTokens);
    }
    if let Some(l) = req.lora.as_ref().filter(|l| l.weights.is_none()) {
        return Err(Rejection::Lora(l.id.clone()));
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
    check_stops(&req.stop)?;
    Ok(())
}

/// Admission (I1) for a disaggregated deployment, run before any node is asked for
/// anything: prompt + `max_tokens` against the context window and the decode pools,
/// the prompt against the prefill pools (whole pages; smallest node of each role).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PdAdmission {
    /// Context window, decode pool capacity (tokens), page size, vocabulary.
    pub limits: AdmissionLimits,
    /// Prefill pool capacity in tokens.
    pub prefill_pool_tokens: usize,
}

impl PdAdmission {
    /// The I1 checks: pure, no allocation.
    ///
    /// Errors: every [`Rejection`] of [`AdmissionLimits::admit`],
    /// [`Rejection::PoolTooSmall`] with the prefill pool's capacity when the prompt
    /// alone does not fit it, and [`Rejection::NoDraftModel`] for draft-model
    /// speculation where the decoding engines have no draft model. (An engine
    /// checks only its own limits again: a prefill engine never drafts, and a
    /// decoding engine without a draft model drafts by prompt lookup.)
    pub fn admit(&self, req: GenerateRequest) -> Result<Admitted, Rejection> {
        // `k: 0` turns speculation off: no draft model is needed then.
        if req.speculate_mode == Some(SpecMode::Draft)
            && req.speculate != Some(0)
            && !self.limits.draft
        {
            return Err(Rejection::NoDraftModel);
        }
        let admitted = self.limits.admit(req)?;
        prompt_fits(
            admitted.request(),
            self.limits.page_size,
            self.prefill_pool_tokens,
        )?;
        Ok(admitted)
    }
}

/// A prefill node's I1 check of the prompt alone against its pool (the output's pages
/// live on the decode node): the prompt, rounded up to whole pages of `page_size`
/// tokens, must fit `pool_tokens`.
pub fn prompt_fits(
    req: &GenerateRequest,
    page_size: usize,
    pool_tokens: usize,
) -> Result<(), Rejection> {
    let needed = req.prompt.len().div_ceil(page_size) * page_size;
    if needed > pool_tokens {
        return Err(Rejection::PoolTooSmall {
            needed,
            capacity: pool_tokens,
        });
    }
    Ok(())
}
