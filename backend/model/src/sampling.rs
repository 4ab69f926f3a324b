//! Next-token sampling: penalties, greedy, temperature, top-k, top-p.
//!
//! [`SamplingParams`] is what a request asks for; [`SamplingParams::validate`]
//! checks it. A [`Sampler`] is created per sequence and owns that sequence's
//! random number generator (ChaCha20 seeded from the request's `seed`, or
//! from a fallback chosen by the caller), so the same seed and the same logits
//! give the same tokens.
//!
//! Order of operations in [`Sampler::sample`]:
//! 0. with a [`Constraint`] (the request's `response_format`), every token it
//!    forbids gets `-inf`;
//! 1. repetition penalty over every distinct token of prompt + output
//!    (llama.cpp/HF: a positive logit is divided by the penalty, a negative one
//!    multiplied), then frequency and presence penalties over the output
//!    (OpenAI: `logit -= frequency * count + presence * (count > 0)`);
//! 2. greedy (`temperature == 0`): argmax, ties to the lowest id;
//! 3. temperature, top-k, softmax, top-p, then one draw.

use crate::grammar::Constraint;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde::{Deserialize, Serialize};

/// Largest accepted `temperature`.
pub const MAX_TEMPERATURE: f32 = 5.0;
/// Bound of `frequency_penalty` and `presence_penalty` (accepted range is `[-2, 2]`).
pub const MAX_ABS_PENALTY: f32 = 2.0;
/// Smallest accepted `repetition_penalty`. Below it a seen token's positive logit is
/// multiplied by more than 10 (at 1e-40 it overflows to infinity): degenerate text,
/// never a useful setting.
pub const MIN_REPETITION_PENALTY: f32 = 0.1;
/// Largest accepted `repetition_penalty` (Workers AI's documented maximum).
pub const MAX_REPETITION_PENALTY: f32 = 2.0;
/// Largest accepted `top_k` (0 disables it). Workers AI documents at most 50;
/// beyond a few hundred candidates the draw is the same as without top-k.
pub const MAX_TOP_K: u32 = 1000;

/// How to pick the next token. `Default` is greedy with no penalties.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// Softmax temperature in `[0, 5]`; 0 means greedy (argmax).
    pub temperature: f32,
    /// Nucleus sampling mass in `(0, 1]`; 1.0 disables it.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens, at most [`MAX_TOP_K`]; 0 disables it.
    pub top_k: u32,
    /// Seed of the sequence's random number generator; `None` uses the
    /// sampler's fallback seed.
    pub seed: Option<u64>,
    /// Multiplicative penalty on every token seen in prompt or output, in
    /// `[0.1, 2]` ([`MIN_REPETITION_PENALTY`], [`MAX_REPETITION_PENALTY`]); 1.0
    /// disables it.
    pub repetition_penalty: f32,
    /// Subtracted from a logit once per occurrence in the output, in `[-2, 2]`.
    pub frequency_penalty: f32,
    /// Subtracted from a logit of any token present in the output, in `[-2, 2]`.
    pub presence_penalty: f32,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            repetition_penalty: 1.0,
            frequency_penalty: 0.0,
            presence_penalty: 0.0,
        }
    }
}

/// A sampling parameter outside its accepted range. Messages name the field,
/// the limit and the value given.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum SamplingError {
    /// `temperature` is NaN, negative or above [`MAX_TEMPERATURE`].
    #[error("`temperature` must be >= 0 and <= {MAX_TEMPERATURE}. Given: {0}")]
    Temperature(f32),
    /// `top_p` is not in `(0, 1]`.
    #[error("`top_p` must be > 0 and <= 1. Given: {0}")]
    TopP(f32),
    /// `top_k` is above [`MAX_TOP_K`].
    #[error("`top_k` must be >= 0 and <= {MAX_TOP_K} (0 disables it). Given: {0}")]
    TopK(u64),
    /// `repetition_penalty` is outside `[0.1, 2]`.
    #[error("`repetition_penalty` must be >= {MIN_REPETITION_PENALTY} and <= {MAX_REPETITION_PENALTY}. Given: {0}")]
    RepetitionPenalty(f32),
    /// `frequency_penalty` is outside `[-2, 2]`.
    #[error(
        "`frequency_penalty` must be >= -{MAX_ABS_PENALTY} and <= {MAX_ABS_PENALTY}. Given: {0}"
    )]
    FrequencyPenalty(f32),
    /// `presence_penalty` is outside `[-2, 2]`.
    #[error(
        "`presence_penalty` must be >= -{MAX_ABS_PENALTY} and <= {MAX_ABS_PENALTY}. Given: {0}"
    )]
    PresencePenalty(f32),
}

impl SamplingError {
    /// The name of the offending field (stable, machine-readable).
    pub fn field(&self) -> &'static str {
        match self {
            Self::Temperature(_) => "temperature",
            Self::TopP(_) => "top_p",
            Self::TopK(_) => "top_k",
            Self::RepetitionPenalty(_) => "repetition_penalty",
            Self::FrequencyPenalty(_) => "frequency_penalty",
            Self::PresencePenalty(_) => "presence_penalty",
        }
    }
}

impl SamplingParams {
    /// Checks every field against its range (NaN is always rejected).
    pub fn validate(&self) -> Result<(), SamplingError> {
        let t = self.temperature;
        if !(0.0..=MAX_TEMPERATURE).contains(&t) {
            return Err(SamplingError::Temperature(t));
        }
        let p = self.top_p;
        if !(p > 0.0 && p <= 1.0) {
            return Err(SamplingError::TopP(p));
        }
        if self.top_k > MAX_TOP_K {
            return Err(SamplingError::TopK(self.top_k.into()));
        }
        let r = self.repetition_penalty;
        if !(MIN_REPETITION_PENALTY..=MAX_REPETITION_PENALTY).contains(&r) {
            return Err(SamplingError::RepetitionPenalty(r));
        }
        let range = -MAX_ABS_PENALTY..=MAX_ABS_PENALTY;
        if !range.contains(&self.frequency_penalty) {
            return Err(SamplingError::FrequencyPenalty(self.frequency_penalty));
        }
        if !range.contains(&self.presence_penalty) {
            return Err(SamplingError::PresencePenalty(self.presence_penalty));
        }
        Ok(())
    }

    /// Whether sampling is greedy (deterministic argmax).
    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }
}

/// Index of the largest value, ties to the lowest index; NaN never wins.
/// Returns 0 for an empty or all-NaN slice.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    let mut found = false;
    for (i, &v) in logits.iter().enumerate() {
        if v.is_nan() {
            continue;
        }
        if !found || v > best_v {
            best = i;
            best_v = v;
            found = true;
        }
    }
    best as u32
}

/// Most alternatives a request may ask for at each position (OpenAI's
/// `top_logprobs` limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// Most bytes the prompt log probabilities of one request may take on the wire:
/// they travel inside one control frame (prefill -> decode node, decode node ->
/// gateway), whose header is limited to 1 MiB by default, with room to spare.
pub const MAX_PROMPT_LOGPROBS_BYTES: usize = 640 * 1024;

/// An upper bound on the JSON bytes of `positions` prompt entries with `top`
/// alternatives each: 48 bytes per entry plus 24 per alternative (an id of at most
/// 6 digits and the shortest f32 text of at most 13 characters, with separators).
pub fn prompt_logprobs_wire_bytes(positions: usize, top: usize) -> usize {
    positions.saturating_mul(48 + 24 * top.min(MAX_TOP_LOGPROBS))
}

/// The log probability reported for a token the logits exclude, and the lowest
/// one reported (OpenAI's value for it).
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// Log probabilities at one position: the token there and the most likely
/// alternatives, from one row of logits.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprobs {
    /// The token at this position (sampled, or the prompt's next token).
    pub id: u32,
    /// Natural-log probability of `id`: `logit[id] - logsumexp(logits)`, in
    /// `[LOGPROB_FLOOR, 0]`; [`LOGPROB_FLOOR`] for a token the logits exclude
    /// (`-inf` or NaN logit), since JSON, on the node links and in the API, has no
    /// infinity.
    pub logprob: f32,
    /// The most likely tokens, `(id, logprob)`, by descending logprob, ties to the
    /// lowest id; at most [`MAX_TOP_LOGPROBS`] entries.
    pub top: Vec<(u32, f32)>,
}

/// Log probabilities of a generated token, and of the prompt on the first one.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Logprobs {
    /// The sampled token's entry (`None` when only prompt logprobs were asked for).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<TokenLogprobs>,
    /// On a request's first token only, when it asked for prompt logprobs: one entry
    /// per prompt token after the first (position `p + 1` scored by the logits at
    /// `p`); the first prompt token has no context and no entry.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub prompt: Vec<TokenLogprobs>,
}

/// The log-softmax entry of `id` in `logits` (one value per vocabulary id), with the
/// `top` most likely tokens (capped at [`MAX_TOP_LOGPROBS`]).
///
/// Exact within f32: the log-sum-exp is accumulated in f64 around the maximum. NaN
/// logits count as `-inf`. Cost: two passes over the row plus a partial selection
/// of `top` entries (O(vocab)); only requests that ask pay it.
pub fn token_logprobs(logits: &[f32], id: u32, top: usize) -> TokenLogprobs {
    let val = |l: f32| if l.is_nan() { f32::NEG_INFINITY } else { l };
    let max = logits
        .iter()
        .map(|&l| val(l))
        .fold(f32::NEG_INFINITY, f32::max);
    let lse = if max.is_finite() {
        let sum: f64 = logits
            .iter()
            .map(|&l| (f64::from(val(l)) - f64::from(max)).exp())
            .sum();
        f64::from(max) + sum.ln()
    } else {
        0.0
    };
    let lp = |l: f32| ((f64::from(val(l)) - lse) as f32).max(LOGPROB_FLOOR);
    let logprob = logits.get(id as usize).map_or(LOGPROB_FLOOR, |&l| lp(l));
    let k = top.min(MAX_TOP_LOGPROBS).min(logits.len());
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        // Keep the k best by (logit desc, id asc) in one pass.
        for (i, &l) in logits.iter().enumerate() {
            let l = val(l);
            if best.len() == k && l <= best[k - 1].1 {
                continue;
            }
            let at = best.partition_point(|&(bi, bl)| bl > l || (bl == l && (bi as usize) < i));
            best.insert(at, (i as u32, l));
            best.truncate(k);
        }
    }
    TokenLogprobs {
        id,
        logprob,
        top: best.into_iter().map(|(i, l)| (i, lp(l))).collect(),
    }
}

/// Per-sequence sampler: the parameters plus the sequence's RNG and scratch space.
#[derive(Clone, Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: ChaCha20Rng,
    /// Scratch: sorted token ids for penalty counting.
    seen: Vec<u32>,
    /// Scratch: candidate (id, logit or probability) pairs.
    cands: Vec<(u32, f32)>,
    /// The request's output format, when it gave one: masks the logits before
    /// the penalties and advances with each draw.
    constraint: Option<Box<Constraint>>,
}

impl Sampler {
    /// A sampler for one sequence. The RNG is seeded from `params.seed`, or from
    /// `request_seed_fallback` when the request gave none. `params` are
    /// expected to have passed [`SamplingParams::validate`].
    pub fn new(params: SamplingParams, request_seed_fallback: u64) -> Self {
        let seed = params.seed.unwrap_or(request_seed_fallback);
        Self {
            params,
            rng: ChaCha20Rng::seed_from_u64(seed),
            seen: Vec::new(),
            cands: Vec::new(),
            constraint: None,
        }
    }

    /// This sampler with its draws restricted to what `constraint` allows (a
    /// request's `response_format`, [`crate::grammar`]).
    pub fn with_constraint(mut self, constraint: Constraint) -> Self {
        self.constraint = Some(Box::new(constraint));
        self
    }

    /// The output-format constraint, if the request has one.
    pub fn constraint(&self) -> Option<&Constraint> {
        self.constraint.as_deref()
    }

    /// Advances the constraint past `token` sampled elsewhere (the first token,
    /// sampled by a prefill node). No-op without a constraint.
    pub fn accept_external(&mut self, token: u32) {
        if let Some(c) = &mut self.constraint {
            c.accept(token);
        }
    }

    /// Where the RNG stream stands (ChaCha20 word position). A sequence that moves
    /// to another node carries it, so its samples there continue the same stream.
    pub fn rng_word_pos(&self) -> u128 {
        self.rng.get_word_pos()
    }

    /// A sampler that continues a stream at `word_pos` (see [`Self::rng_word_pos`]).
    pub fn resume(params: SamplingParams, request_seed_fallback: u64, word_pos: u128) -> Self {
        let mut s = Self::new(params, request_seed_fallback);
        s.rng.set_word_pos(word_pos);
        s
    }

    /// The parameters this sampler uses.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (one value per vocabulary id; the
    /// penalties are applied in place). `prompt_tokens` and
    /// `generated` are the sequence so far; ids outside `logits` are ignored.
    pub fn sample(&mut self, logits: &mut [f32], prompt_tokens: &[u32], generated: &[u32]) -> u32 {
        self.sample_logprobs(logits, prompt_tokens, generated, None)
            .0
    }

    /// [`Self::sample`], and with `top` the sampled token's log probability and the
    /// `top` most likely alternatives ([`token_logprobs`]) from the same logits the
    /// draw used: after the format mask and the penalties, before temperature, top-k and top-p (which
    /// shape the draw, not the model's distribution). `None` costs nothing extra.
    pub fn sample_logprobs(
        &mut self,
        logits: &mut [f32],
        prompt_tokens: &[u32],
        generated: &[u32],
        top: Option<usize>,
    ) -> (u32, Option<TokenLogprobs>) {
        if let Some(c) = &mut self.constraint {
            c.mask_logits(logits);
        }
        self.apply_penalties(logits, prompt_tokens, generated);
        let id = self.pick(logits);
        if let Some(c) = &mut self.constraint {
            c.accept(id);
        }
        (id, top.map(|k| token_logprobs(logits, id, k)))
    }

    /// The draw itself, on logits already penalized.
    fn pick(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() || logits.len() <= 1 {
            return argmax(logits);
        }

        let inv_t = 1.0 / self.params.temperature;
        let n = logits.len();
        let top_k = self.params.top_k as usize;
        let cands = &mut self.cands;
        cands.clear();
        cands.extend(
            logits
                .iter()
                .enumerate()
                .map(|(i, &l)| (i as u32, if l.is_nan() { f32::NEG_INFINITY } else { l })),
        );
        // Descending logit, ties to the lowest id: a total order. Candidates are
        // ranked on logits (before softmax rounding) whenever the order matters.
        let by_rank = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let top_p = f64::from(self.params.top_p);
        if top_k > 0 && top_k < n {
            cands.select_nth_unstable_by(top_k - 1, by_rank);
            cands.truncate(top_k);
            cands.sort_unstable_by(by_rank);
        } else if top_p < 1.0 {
            cands.sort_unstable_by(by_rank);
        }

        // Softmax of logit / temperature over the candidates.
        let max = cands.iter().map(|c| c.1).fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return argmax(logits);
        }
        let mut total = 0.0f64;
        for c in cands.iter_mut() {
            c.1 = ((c.1 - max) * inv_t).exp();
            total += f64::from(c.1);
        }
        if !(total.is_finite() && total > 0.0) {
            return argmax(logits);
        }

        // Nucleus: the shortest prefix (candidates are ranked) whose mass reaches top_p.
        if top_p < 1.0 {
            let target = top_p * total;
            let mut acc = 0.0f64;
            let mut keep = cands.len();
            for (i, c) in cands.iter().enumerate() {
                acc += f64::from(c.1);
                if acc >= target {
                    keep = i + 1;
                    break;
                }
            }
            cands.truncate(keep);
            total = cands.iter().map(|c| f64::from(c.1)).sum();
        }

        let u: f64 = self.rng.random::<f64>() * total;
        let mut acc = 0.0f64;
        for c in cands.iter() {
            acc += f64::from(c.1);
            if u < acc {
                return c.0;
            }
        }
        // Rounding left u at the very top: take the last candidate with mass.
        cands
            .iter()
            .rev()
            .find(|c| c.1 > 0.0)
            .map_or_else(|| argmax(logits), |c| c.0)
    }

    fn apply_penalties(&mut self, logits: &mut [f32], prompt: &[u32], generated: &[u32]) {
        let n = logits.len();
        let rep = self.params.repetition_penalty;
        if rep != 1.0 {
            self.seen.clear();
            self.seen.extend_from_slice(prompt);
            self.seen.extend_from_slice(generated);
            self.seen.sort_unstable();
            self.seen.dedup();
            for &id in &self.seen {
                if let Some(l) = logits.get_mut(id as usize) {
                    if *l > 0.0 {
                        *l /= rep;
                    } else {
                        *l *= rep;
                    }
                }
            }
        }
        let (freq, pres) = (self.params.frequency_penalty, self.params.presence_penalty);
        if freq != 0.0 || pres != 0.0 {
            self.seen.clear();
            self.seen.extend_from_slice(generated);
            self.seen.sort_unstable();
            for run in self.seen.chunk_by(|a, b| a == b) {
                let id = run[0] as usize;
                if id < n {
                    logits[id] -= freq * run.len() as f32 + pres;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, top_k: u32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            top_k,
            seed: Some(seed),
            ..SamplingParams::default()
        }
    }

    /// Smooth pseudo-random logits over a realistic vocabulary.
    fn logits(n: usize, salt: u32) -> Vec<f32> {
        (0..n as u32)
            .map(|i| {
                let x = i
                    .wrapping_mul(2_654_435_761)
                    .wrapping_add(salt.wrapping_mul(40_503));
                (x >> 8) as f32 / (1 << 24) as f32 * 8.0 - 4.0
            })
            .collect()
    }

    fn draws(p: &SamplingParams, fallback: u64, steps: u32) -> Vec<u32> {
        let mut s = Sampler::new(p.clone(), fallback);
        (0..steps)
            .map(|step| s.sample(&mut logits(49152, step), &[], &[]))
            .collect()
    }

    #[test]
    fn default_is_greedy_and_valid() {
        let p = SamplingParams::default();
        assert!(p.is_greedy());
        assert_eq!(p.validate(), Ok(()));
        let parsed: SamplingParams = serde_json::from_str(r#"{"temperature":0.7}"#).unwrap();
        assert_eq!(parsed.top_p, 1.0);
        assert_eq!(parsed.repetition_penalty, 1.0);
    }

    #[test]
    fn greedy_picks_argmax_lowest_id_on_ties() {
        let mut s = Sampler::new(SamplingParams::default(), 7);
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 2.9], &[], &[]), 1);
        assert_eq!(s.sample(&mut [0.1, 3.0, -1.0, 3.0], &[], &[]), 1);
        assert_eq!(s.sample(&mut [f32::NAN, -5.0, -5.0], &[], &[]), 1);
        let mut l = logits(49152, 3);
        let expect = argmax(&l);
        assert_eq!(s.sample(&mut l, &[], &[]), expect);
        assert_eq!(
            l[expect as usize],
            l.iter().copied().fold(f32::MIN, f32::max)
        );
    }

    #[test]
    fn same_seed_same_draws() {
        let p = params(1.0, 0.95, 50, 1234);
        assert_eq!(
            draws(&p, 0, 32),
            draws(&p, 99, 32),
            "explicit seed wins over fallback"
        );
        let unseeded = SamplingParams {
            seed: None,
            ..p.clone()
        };
        assert_eq!(draws(&unseeded, 5, 32), draws(&unseeded, 5, 32));
        let full = params(1.5, 1.0, 0, 42);
        assert_eq!(draws(&full, 0, 16), draws(&full, 0, 16));
    }

    #[test]
    fn different_seeds_differ() {
        for p in [params(1.0, 1.0, 0, 1), params(1.0, 0.9, 40, 1)] {
            let a = draws(&p, 0, 16);
            let b = draws(
                &SamplingParams {
                    seed: Some(2),
                    ..p.clone()
                },
                0,
                16,
            );
            assert_ne!(a, b);
        }
    }

    #[test]
    fn logprobs_are_a_log_softmax_with_ranked_alternatives() {
        let l = [1.0f32, 3.0, 3.0, -2.0, f32::NAN];
        let e = token_logprobs(&l, 0, 3);
        let lse = [1.0f64, 3.0, 3.0, -2.0]
            .iter()
            .map(|x| x.exp())
            .sum::<f64>()
            .ln();
        assert!((f64::from(e.logprob) - (1.0 - lse)).abs() < 1e-6, "{e:?}");
        // Ties to the lowest id; NaN never ranks.
        assert_eq!(e.top.iter().map(|t| t.0).collect::<Vec<_>>(), vec![1, 2, 0]);
        assert_eq!(e.top[0].1, e.top[1].1);
        let total: f64 = (0..4)
            .map(|i| f64::from(token_logprobs(&l, i, 0).logprob).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
        assert_eq!(token_logprobs(&l, 4, 0).logprob, LOGPROB_FLOOR);
        assert_eq!(token_logprobs(&l, 9, 0).logprob, LOGPROB_FLOOR);
        // The wire bound holds for the longest id and float texts.
        let worst = TokenLogprobs {
            id: 999_999,
            logprob: -1.175_494_4e-38,
            top: vec![(999_999, -1.175_494_4e-38); MAX_TOP_LOGPROBS],
        };
        for k in [0, 1, MAX_TOP_LOGPROBS] {
            let e = TokenLogprobs {
                top: worst.top[..k].to_vec(),
                ..worst.clone()
            };
            let bytes = serde_json::to_vec(&e).unwrap().len() + 1; // and a comma
            assert!(bytes <= prompt_logprobs_wire_bytes(1, k), "{k}: {bytes}");
            let back: TokenLogprobs =
                serde_json::from_slice(&serde_json::to_vec(&e).unwrap()).unwrap();
            assert_eq!(back, e);
        }
        assert_eq!(token_logprobs(&l, 1, 100).top.len(), 5);
        let big = logits(49152, 1);
        assert_eq!(token_logprobs(&big, 0, 50).top.len(), MAX_TOP_LOGPROBS);
        // The sampler reports the token it drew, greedy being the top entry.
        let mut s = Sampler::new(SamplingParams::default(), 0);
        let (id, lp) = s.sample_logprobs(&mut big.clone(), &[], &[], Some(2));
        let lp = lp.unwrap();
        assert_eq!((lp.id, lp.top[0].0), (id, id));
        assert_eq!(lp.logprob, lp.top[0].1);
    }

    #[test]
    fn top_k_one_equals_greedy() {
        let p = params(1.3, 1.0, 1, 9);
        let mut s = Sampler::new(p, 0);
        for step in 0..20 {
            let mut l = logits(49152, step);
            let expect = argmax(&l);
            assert_eq!(s.sample(&mut l, &[], &[]), expect);
        }
        // Ties resolve to the lowest id, like greedy.
        assert_eq!(s.sample(&mut [1.0, 5.0, 5.0, 0.0], &[], &[]), 1);
    }

    #[test]
    fn tiny_top_p_equals_greedy() {
        let mut s = Sampler::new(params(2.0, 1e-6, 0, 11), 0);
        for step in 0..20 {
            let mut l = logits(49152, step);
            let expect = argmax(&l);
            assert_eq!(s.sample(&mut l, &[], &[]), expect);
        }
        assert_eq!(s.sample(&mut [1.0, 5.0, 5.0, 0.0], &[], &[]), 1);
    }

    #[test]
    fn top_k_restricts_support() {
        let mut s = Sampler::new(params(5.0, 1.0, 3, 3), 0);
        let base = [0.0, 1.0, 4.0, 2.0, 3.0, 0.5];
        for _ in 0..200 {
            let t = s.sample(&mut base.clone(), &[], &[]);
            assert!([2, 3, 4].contains(&t), "{t}");
        }
    }

    #[test]
    fn top_p_restricts_support() {
        // Probabilities ~ [0.5, 0.3, 0.15, 0.05]: top_p 0.75 keeps ids 0 and 1.
        let base: Vec<f32> = [0.5f32, 0.3, 0.15, 0.05].iter().map(|p| p.ln()).collect();
        let mut s = Sampler::new(params(1.0, 0.75, 0, 3), 0);
        let mut counts = [0u32; 4];
        for _ in 0..2000 {
            counts[s.sample(&mut base.clone(), &[], &[]) as usize] += 1;
        }
        assert_eq!(counts[2] + counts[3], 0, "{counts:?}");
        assert!(counts[0] > counts[1] && counts[1] > 500, "{counts:?}");
    }

    #[test]
    fn repetition_penalty_changes_pick() {
        let p = SamplingParams {
            repetition_penalty: 1.5,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(p, 0);
        // 3.0 / 1.5 = 2.0 < 2.5: id 0 seen in the prompt loses to id 1.
        let mut l = [3.0, 2.5, -1.0];
        assert_eq!(s.sample(&mut l, &[0, 0, 7_000_000], &[]), 1);
        assert_eq!(l, [2.0, 2.5, -1.0]);
        // Negative logits are multiplied.
        let mut l = [-1.0, -1.2, -3.0];
        assert_eq!(s.sample(&mut l, &[], &[0]), 1);
        assert_eq!(l, [-1.5, -1.2, -3.0]);
    }

    #[test]
    fn frequency_and_presence_penalties_change_pick() {
        let p = SamplingParams {
            frequency_penalty: 0.5,
            presence_penalty: 0.25,
            ..SamplingParams::default()
        };
        let mut s = Sampler::new(p, 0);
        // id 0 generated twice: 3.0 - (0.5 * 2 + 0.25) = 1.75 < 2.0.
        let mut l = [3.0, 2.0, 1.0];
        assert_eq!(s.sample(&mut l, &[1, 1, 1], &[0, 2, 0]), 1);
        assert_eq!(l, [1.75, 2.0, 0.25]);
        // The prompt does not count for these penalties.
        let mut l = [3.0, 2.0, 1.0];
        assert_eq!(s.sample(&mut l, &[0, 0, 0], &[]), 0);
    }

    #[test]
    fn validation_rejects_each_bad_field() {
        let ok = SamplingParams::default();
        let tiny = 1e-40f32.to_string();
        let cases: Vec<(SamplingParams, &str, &str)> = vec![
            (
                SamplingParams {
                    temperature: f32::NAN,
                    ..ok.clone()
                },
                "temperature",
                "NaN",
            ),
            (
                SamplingParams {
                    temperature: -0.1,
                    ..ok.clone()
                },
                "temperature",
                "-0.1",
            ),
            (
                SamplingParams {
                    temperature: 5.5,
                    ..ok.clone()
                },
                "temperature",
                "5.5",
            ),
            (
                SamplingParams {
                    top_p: 0.0,
                    ..ok.clone()
                },
                "top_p",
                "0",
            ),
            (
                SamplingParams {
                    top_p: 1.01,
                    ..ok.clone()
                },
                "top_p",
                "1.01",
            ),
            (
                SamplingParams {
                    top_p: f32::NAN,
                    ..ok.clone()
                },
                "top_p",
                "NaN",
            ),
            (
                SamplingParams {
                    repetition_penalty: 0.0,
                    ..ok.clone()
                },
                "repetition_penalty",
                "0",
            ),
            (
                SamplingParams {
                    repetition_penalty: -1.0,
                    ..ok.clone()
                },
                "repetition_penalty",
                "-1",
            ),
            (
                SamplingParams {
                    repetition_penalty: f32::INFINITY,
                    ..ok.clone()
                },
                "repetition_penalty",
                "inf",
            ),
            (
                SamplingParams {
                    repetition_penalty: 1e-40,
                    ..ok.clone()
                },
                "repetition_penalty",
                &tiny,
            ),
            (
                SamplingParams {
                    repetition_penalty: 2.5,
                    ..ok.clone()
                },
                "repetition_penalty",
                "2.5",
            ),
            (
                SamplingParams {
                    top_k: MAX_TOP_K + 1,
                    ..ok.clone()
                },
                "top_k",
                "1001",
            ),
            (
                SamplingParams {
                    frequency_penalty: 2.5,
                    ..ok.clone()
                },
                "frequency_penalty",
                "2.5",
            ),
            (
                SamplingParams {
                    frequency_penalty: -2.1,
                    ..ok.clone()
                },
                "frequency_penalty",
                "-2.1",
            ),
            (
                SamplingParams {
                    presence_penalty: -3.0,
                    ..ok.clone()
                },
                "presence_penalty",
                "-3",
            ),
            (
                SamplingParams {
                    presence_penalty: f32::NAN,
                    ..ok.clone()
                },
                "presence_penalty",
                "NaN",
            ),
        ];
        for (p, field, given) in cases {
            let err = p.validate().unwrap_err();
            assert_eq!(err.field(), field);
            let msg = err.to_string();
            assert!(msg.starts_with(&format!("`{field}` must be")), "{msg}");
            assert!(msg.ends_with(&format!("Given: {given}")), "{msg}");
        }
        let edge = SamplingParams {
            temperature: 5.0,
            top_p: 1.0,
            top_k: MAX_TOP_K,
            seed: Some(u64::MAX),
            repetition_penalty: MIN_REPETITION_PENALTY,
            frequency_penalty: -2.0,
            presence_penalty: 2.0,
        };
        assert_eq!(edge.validate(), Ok(()));
        assert_eq!(
            SamplingParams {
                temperature: 6.0,
                ..ok
            }
            .validate()
            .unwrap_err()
            .to_string(),
            "`temperature` must be >= 0 and <= 5. Given: 6"
        );
    }
}
