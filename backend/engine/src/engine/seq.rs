//! A running sequence's state (its prompt, output, sampler, detokenizer and sink)
//! and how each sampled token is accepted into it and streamed out.

use crate::admission::GenerateRequest;
use crate::scheduler::{Priority, SeqProgress};
use crate::sink::{CachedTiers, EngineError, Event, EventSink, FinishReason, Usage};
use std::time::{Duration, Instant};
use tessera_model::detok::{IncrementalDecoder, StopMatcher, StopOutcome};
use tessera_model::kv::prefix::ChainHash;
use tessera_model::kv::SeqId;
use tessera_model::sampling::{Logprobs, Sampler, TokenLogprobs};
use tessera_model::tokenizer::Tokenizer;
/// What a sequence does once its prompt is computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SeqRole {
    /// Samples and streams until it ends (co-located, decode node).
    Generate,
    /// Prefill node: the first token ends the sequence's compute; its pages stay
    /// reserved for export until [`Engine::release_prefill`](super::Engine::release_prefill).
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
    /// Where the request's chain starts (`None`: its pages are never cached); a
    /// drained sequence's output pages are cached under it too
    /// ([`Engine::end_caching_output`](super::Engine::end_caching_output)).
    pub(crate) root: Option<ChainHash>,
    /// Prompt tokens reused from the prefix cache.
    pub(crate) cached: usize,
    /// Of `cached`, those restored from the lower tiers.
    pub(crate) cached_tiers: CachedTiers,
    /// Alternatives per generated token's log probabilities (`None`: none asked).
    pub(crate) logprobs: Option<usize>,
    /// Alternatives per prompt token's log probabilities (`None`: none asked).
    pub(crate) prompt_logprobs: Option<usize>,
    /// Prompt log probabilities computed so far (positions 1.., in order); sent
    /// with the first token.
    pub(crate) prompt_lp: Vec<TokenLogprobs>,
    /// Output tokens at the end of `prompt` that a client already received (a
    /// continuation, [`crate::Resume`]); 0 for a new request.
    pub(crate) resumed: usize,
    /// This step's draft tokens (prompt-lookup speculation), fed after its decode
    /// row; empty when it does not speculate.
    pub(crate) drafts: Vec<u32>,
    /// Whether this step's drafts came from the draft model (else prompt lookup).
    pub(crate) drafts_from_model: bool,
    /// How the draft model's drafts fare for this sequence (how many to draft).
    pub(crate) draft_model: super::draft::DraftPolicy,
    /// The position of this step's decode row, which the drafts follow.
    pub(crate) drafts_after: usize,
    /// The request's own draft limit, if it set one ([`GenerateRequest::speculate`]).
    pub(crate) speculate: Option<usize>,
    /// Where its drafts come from, if it said ([`GenerateRequest::speculate_mode`]).
    pub(crate) speculate_mode: Option<crate::admission::SpecMode>,
    /// Drafts accepted in this step.
    pub(crate) accepted_now: usize,
    /// Steps in a row whose drafts were all rejected, and steps left to wait before
    /// drafting again (backing off where the output does not repeat its input).
    pub(crate) draft_misses: u32,
    pub(crate) draft_wait: u32,
    /// The LoRA adapter every row of the sequence runs under (`None`: the base).
    pub(crate) lora: Option<std::sync::Arc<tessera_model::lora::LoraWeights>>,
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
            root: None,
            cached: 0,
            cached_tiers: CachedTiers::default(),
            logprobs: req.output.logprobs.map(|k| k as usize),
            prompt_logprobs: req.output.prompt_logprobs.map(|k| k as usize),
            prompt_lp: Vec::new(),
            resumed: req.resume.map_or(0, |r| r.output_tokens),
            drafts: Vec::new(),
            drafts_from_model: false,
            draft_model: Default::default(),
            drafts_after: 0,
            accepted_now: 0,
            draft_misses: 0,
            draft_wait: 0,
            lora: req.lora.and_then(|l| l.weights),
            speculate_mode: req.speculate_mode,
            speculate: req
                .speculate
                .map(|k| k.min(crate::admission::MAX_SPECULATE) as usize),
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

    /// A continuation's detokenizer and stop-string matcher as they stood after its
    /// resumed output (whose text the client has; what they still hold back comes
    /// out as it would have). No-op for a new request.
    pub(crate) fn prime(&mut self, tk: &Tokenizer) {
        let at = self.prompt.len() - self.resumed;
        for &t in &self.prompt[at..] {
            let piece = self.detok.push(tk, t);
            let _ = self.stop.push(&piece);
        }
    }

    pub(super) fn progress(&self) -> SeqProgress {
        SeqProgress {
            prompt: self.prompt.len(),
            prefilled: self.prefilled,
            generated: self.generated.len(),
            tenant: self.tenant,
            priority: self.priority,
        }
    }
}

/// A sequence's prompt and output so far as the penalties count them: the last
/// `resumed` prompt tokens (a continuation's, [`crate::Resume`]) are output.
pub(crate) fn penalty_view<'a>(
    prompt: &'a [u32],
    generated: &'a [u32],
    resumed: usize,
) -> (&'a [u32], std::borrow::Cow<'a, [u32]>) {
    if resumed == 0 {
        return (prompt, std::borrow::Cow::Borrowed(generated));
    }
    let (prompt, output) = prompt.split_at(prompt.len() - resumed);
    (prompt, [output, generated].concat().into())
}

/// The sampler a request starts with on this engine: seeded from the request (or
/// `seed_fallback`), its RNG stream at `rng_word_pos` (a sequence moved from a
/// prefill node) or at a continuation's resumed position, restricted to the
/// request's format, whose constraint has accepted a continuation's resumed output.
///
/// Errors: the format does not compile ([`constrain`]).
pub(crate) fn sampler_for(
    tk: &Tokenizer,
    r: &GenerateRequest,
    seed_fallback: u64,
    rng_word_pos: Option<u128>,
) -> Result<Sampler, EngineError> {
    let resume = r.resume.unwrap_or_default();
    let base = match rng_word_pos.or(r.resume.map(|x| u128::from(x.rng_word_pos))) {
        Some(pos) => Sampler::resume(r.sampling.clone(), seed_fallback, pos),
        None => Sampler::new(r.sampling.clone(), seed_fallback),
    };
    let mut sampler = constrain(tk, r, base)?;
    for &t in &r.prompt[r.prompt.len() - resume.output_tokens..] {
        sampler.accept_external(t);
    }
    Ok(sampler)
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
        rng_word_pos: s.sampler.rng_word_pos() as u64,
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
            // A continuation reports the whole request: its resumed output is output.
            prompt_tokens: s.prompt.len() - s.resumed,
            completion_tokens: n + s.resumed,
            cached_tokens: s.cached.min(s.prompt.len() - s.resumed),
            cached_tiers: s.cached_tiers,
            ttft: first - s.submitted,
            tpot: if n > 1 {
                (now - first) / (n as u32 - 1)
            } else {
                Duration::ZERO
            },
        },
    })
}
