//! Draft-model speculation (issue 37): a smaller model of the same tokenizer
//! proposes a decoding sequence's next tokens, which the served model verifies in
//! the same forward pass as the sequence's decode row (`step.rs`), exactly as
//! prompt-lookup drafts are verified (`speculate.rs`): the output is token for
//! token what plain decoding produces.
//!
//! A sequence in draft mode first takes prompt-lookup drafts where its own history
//! offers them (free, and on text that repeats its input better than the draft
//! model's); elsewhere the draft model greedily extends it by as many tokens as pay
//! ([`DraftPolicy`]: none where its drafts keep missing), one batched forward
//! pass of the draft model per draft position over every drafting sequence
//! (Leviathan et al., "Fast Inference from Transformers via Speculative Decoding",
//! 2023; with a deterministic draft the acceptance test is "equals the token
//! sampled at its position", which keeps the target distribution for greedy and
//! seeded sampling alike). Its K/V lives in a pool of its own (the draft model's
//! page shape differs from the served model's), built and checked like the served
//! model's: pages reserved per sequence under the sequence's tenant, every page
//! read checked against its tag (I3), freed when the sequence leaves the running
//! batch. The draft K/V is computed lazily: a sequence's first drafting step
//! catches the draft pool up on its prompt and output so far (in chunks of at most
//! `max_batch_tokens`), later steps only on the tokens accepted since.

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use tessera_model::kv::{KvManager, PagePool, SeqId};
use tessera_model::tokenizer::Tokenizer;
use tessera_model::transformer::Transformer;

/// A model that drafts for an engine's model ([`EngineConfig::draft`](super::EngineConfig::draft)).
/// Equal when it is the same loaded model (`Arc` identity).
#[derive(Clone)]
pub struct DraftModel {
    model: Arc<Transformer>,
}

impl DraftModel {
    /// `model` (whose tokenizer is `tokenizer`) drafting for a model whose
    /// tokenizer is `target`.
    ///
    /// Errors: the vocabularies differ (a draft token id would name other text);
    /// the message names the first id that differs, or the two sizes.
    pub fn new(
        model: Arc<Transformer>,
        tokenizer: &Tokenizer,
        target: &Tokenizer,
    ) -> Result<Self, String> {
        let (n, m) = (tokenizer.vocab_size(), target.vocab_size());
        if n != m {
            return Err(format!(
                "the draft model's vocabulary has {n} tokens, the served model's {m}: a \
                 draft model must share the served model's tokenizer"
            ));
        }
        if let Some(id) =
            (0..n as u32).find(|&id| tokenizer.token_bytes_ref(id) != target.token_bytes_ref(id))
        {
            return Err(format!(
                "token {id} is {:?} in the draft model and {:?} in the served model: a draft \
                 model must share the served model's tokenizer",
                String::from_utf8_lossy(tokenizer.token_bytes_ref(id)),
                String::from_utf8_lossy(target.token_bytes_ref(id)),
            ));
        }
        if model.config().vocab < n {
            return Err(format!(
                "the draft model's output has {} logits for a vocabulary of {n} tokens",
                model.config().vocab
            ));
        }
        Ok(Self { model })
    }

    /// The draft model's fingerprint ([`Transformer::fingerprint`]).
    pub fn fingerprint(&self) -> [u8; 32] {
        self.model.fingerprint()
    }
}

impl PartialEq for DraftModel {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.model, &other.model)
    }
}

impl Eq for DraftModel {}

impl fmt::Debug for DraftModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = self.model.config();
        f.debug_struct("DraftModel")
            .field("arch", &c.arch)
            .field("layers", &c.layers)
            .field("hidden", &c.hidden)
            .finish()
    }
}

/// Cost of one verification row relative to a plain decode step (the served
/// model's extra row per draft). Measured, not guessed: prompt lookup on
/// Qwen2.5-Coder-1.5B (docs/benchmarks.md, 52 of 60 drafts accepted over 72 tokens
/// at 2.72x) puts a step with four draft rows at 1.32 plain steps.
const VERIFY_ROW_COST: f32 = 0.08;
/// Least predicted speed-up worth drafting for (the cost model is approximate).
const MIN_GAIN: f32 = 1.05;
/// Steps a sequence waits before probing again once drafting stopped paying.
const STAND_DOWN_STEPS: u32 = 8;
/// Weight of each past step in the acceptance estimate (about the last 10 steps).
const DECAY: f32 = 0.9;

/// How many tokens the draft model drafts for one sequence: it estimates the
/// sequence's acceptance rate α (accepted drafts over accepted plus first
/// rejections, a geometric model, decayed) and drafts the γ that maximises the
/// expected speed-up (1 - α^(γ+1)) / ((1 - α)(γc + 1)) of Leviathan et al. 2023
/// (§3.4), where c is one draft token's cost in plain decode steps (a draft pass
/// plus a verification row). Where no γ pays it stands down for a few steps and
/// then probes with one draft.
#[derive(Clone, Copy, Debug)]
pub(crate) struct DraftPolicy {
    accepted: f32,
    rejected: f32,
    wait: u32,
    probe: bool,
}

impl Default for DraftPolicy {
    /// A prior of α = 0.7 worth two observations: a new sequence drafts.
    fn default() -> Self {
        Self {
            accepted: 1.4,
            rejected: 0.6,
            wait: 0,
            probe: false,
        }
    }
}

impl DraftPolicy {
    /// After a verification: `accepted` of `drafted` drafts were kept.
    pub(crate) fn observe(&mut self, accepted: usize, drafted: usize) {
        if drafted == 0 {
            return;
        }
        self.accepted = self.accepted * DECAY + accepted as f32;
        self.rejected = self.rejected * DECAY + f32::from(u8::from(accepted < drafted));
    }

    /// The estimated acceptance rate.
    pub(crate) fn alpha(&self) -> f32 {
        self.accepted / (self.accepted + self.rejected)
    }

    /// Tokens to draft this step (at most `k_max`; `None`: none), one draft
    /// token costing `cost` plain decode steps.
    pub(crate) fn next_k(&mut self, k_max: usize, cost: f32) -> Option<usize> {
        if self.wait > 0 {
            self.wait -= 1;
            return None;
        }
        if std::mem::take(&mut self.probe) {
            return Some(1);
        }
        match best_k(self.alpha(), cost, k_max) {
            0 => {
                self.probe = true;
                self.wait = STAND_DOWN_STEPS;
                None
            }
            k => Some(k),
        }
    }
}

/// The γ in `1..=k_max` with the largest expected speed-up (1 + α + ... + α^γ) /
/// (γc + 1), or 0 when none reaches [`MIN_GAIN`].
pub(crate) fn best_k(alpha: f32, cost: f32, k_max: usize) -> usize {
    let (mut best, mut best_gain) = (0, MIN_GAIN);
    let (mut tokens, mut power) = (1.0f32, 1.0f32);
    for k in 1..=k_max {
        power *= alpha;
        tokens += power;
        let gain = tokens / (k as f32 * cost + 1.0);
        if gain > best_gain {
            (best, best_gain) = (k, gain);
        }
    }
    best
}

/// An engine's draft model and its KV pool.
pub(crate) struct Drafter {
    pub(super) model: Arc<Transformer>,
    pub(super) kv: KvManager,
    /// One draft token's cost in plain decode steps: the draft pass (decode reads
    /// every weight once, so weight bytes in proportion) and a verification row.
    cost: f32,
    /// Sequences holding draft pages, and how far their draft K/V is computed.
    pub(super) seqs: HashMap<SeqId, DraftSeq>,
}

#[derive(Clone, Copy, Debug, Default)]
pub(super) struct DraftSeq {
    /// Leading positions whose draft K/V holds the sequence's own tokens.
    pub(super) computed: usize,
    /// The last drafting step: the sequence's length then, and how many of its
    /// drafts were fed to the draft model after it (valid as far as accepted).
    pub(super) pending: Option<(usize, usize)>,
}

impl Drafter {
    /// `draft`'s pool: `pool_pages` pages of `page_size` tokens in its own layout.
    pub(crate) fn new(
        draft: &DraftModel,
        target: &Transformer,
        page_size: usize,
        pool_pages: usize,
        scrub: bool,
    ) -> Self {
        let layout = draft.model.config().kv_layout(page_size);
        let bytes = draft.model.weight_bytes() as f32 / target.weight_bytes().max(1) as f32;
        Self {
            cost: bytes + VERIFY_ROW_COST,
            model: draft.model.clone(),
            kv: KvManager::new(PagePool::new(layout, pool_pages, scrub)),
            seqs: HashMap::new(),
        }
    }

    /// One draft token's cost in plain decode steps.
    pub(crate) fn cost(&self) -> f32 {
        self.cost
    }

    /// The draft pool (fault-injection tests).
    pub(crate) fn kv_mut(&mut self) -> &mut KvManager {
        &mut self.kv
    }

    /// Pages of the draft pool held by sequences.
    pub(crate) fn pages_in_use(&self) -> usize {
        self.kv.pool().capacity() - self.kv.pool().free_pages()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_as_many_tokens_as_pay() {
        // A draft token at 0.45 of a step: break-even near α = 0.5.
        assert_eq!(best_k(0.3, 0.45, 8), 0);
        assert_eq!(best_k(0.6, 0.45, 8), 1);
        assert_eq!(best_k(0.8, 0.45, 8), 2);
        assert!(best_k(0.95, 0.45, 8) >= 4);
        assert_eq!(best_k(0.95, 0.45, 2), 2, "never past the request's k");
        // A free draft always pays while anything is accepted.
        assert_eq!(best_k(0.5, 0.0, 4), 4);
    }

    #[test]
    fn stands_down_where_drafts_miss_and_probes_again() {
        let mut p = DraftPolicy::default();
        assert!(p.next_k(4, 0.45).is_some(), "a new sequence drafts");
        for _ in 0..20 {
            p.observe(0, 1);
        }
        assert!(p.alpha() < 0.1);
        assert_eq!(p.next_k(4, 0.45), None);
        for _ in 0..STAND_DOWN_STEPS {
            assert_eq!(p.next_k(4, 0.45), None);
        }
        assert_eq!(p.next_k(4, 0.45), Some(1), "a probe");
        for _ in 0..20 {
            p.observe(4, 4);
        }
        assert_eq!(p.next_k(4, 0.45), Some(4));
    }
}
