//! The engine's side of draft-model speculation (`draft.rs` holds the model, its
//! pool and the per-sequence policy): the draft pool settled after each
//! verification, and one step's drafts computed in batched draft passes.

use super::draft::DraftSeq;
use super::Engine;
use crate::admission::SpecMode;
use std::collections::HashMap;
use tessera_model::kv::SeqId;
use tessera_model::transformer::BatchRow;

/// One sequence's drafting this step.
struct Job {
    slot: usize,
    seq: SeqId,
    /// Tokens known (prompt and output); the decode row is at `len - 1`.
    len: usize,
    k: usize,
    drafts: Vec<u32>,
}

impl Engine {
    /// The mode a request speculates in when it names none.
    pub(super) fn default_spec_mode(&self) -> SpecMode {
        if self.drafter.is_some() {
            SpecMode::Draft
        } else {
            SpecMode::Ngram
        }
    }

    /// Before this step's drafts: records how far each drafting sequence's draft
    /// K/V holds its own tokens after the last verification (its accepted drafts
    /// count), and frees the draft pages of sequences no longer running.
    pub(super) fn settle_draft_pool(&mut self) {
        let Some(d) = self.drafter.as_mut() else {
            return;
        };
        let mut running: HashMap<SeqId, usize> = HashMap::new();
        for s in self.seqs.running() {
            running.insert(s.id, s.accepted_now);
        }
        d.seqs.retain(|id, ds| match running.get(id) {
            Some(&accepted) => {
                if let Some((len, fed)) = ds.pending.take() {
                    ds.computed = len + accepted.min(fed);
                }
                true
            }
            None => {
                d.kv.release(*id);
                false
            }
        });
    }

    /// Sets the drafts of the decoding sequences `jobs` (`(slot, decode row
    /// position, k)`) from the draft model: catch-up rows for the tokens its pool
    /// lacks, then `k` greedy tokens, one batched draft pass per position. A
    /// sequence whose draft pages cannot be reserved, whose catch-up does not fit
    /// this step, or whose draft pages fail their tag check (counted, logged, its
    /// draft pages freed) drafts nothing this step. Returns the tokens drafted.
    pub(super) fn draft_with_model(&mut self, jobs: &[(usize, usize, usize)]) -> usize {
        let budget = self.cfg.max_batch_tokens;
        let Some(d) = self.drafter.as_mut() else {
            return 0;
        };
        let at = |s: &super::Seq, p: usize| {
            if p < s.prompt.len() {
                s.prompt[p]
            } else {
                s.generated[p - s.prompt.len()]
            }
        };
        // Catch-up rows: the sequence's own tokens the draft pool lacks.
        let mut rows = Vec::new();
        let mut live = Vec::new();
        for &(slot, pos, k) in jobs {
            let s = self.seqs.at(slot);
            let len = pos + 1;
            if !d.seqs.contains_key(&s.id) {
                let tokens = s.prompt.len() + s.max_tokens;
                if d.kv.reserve(s.id, s.tenant, tokens).is_err() {
                    continue;
                }
                d.seqs.insert(s.id, DraftSeq::default());
            }
            let ds = d.seqs.get_mut(&s.id).expect("inserted above");
            let room = budget.saturating_sub(rows.len());
            let end = len.min(ds.computed + room);
            for p in ds.computed..end {
                rows.push(BatchRow {
                    seq: s.id,
                    token: at(s, p),
                    pos: p,
                    want_logits: p + 1 == len,
                });
            }
            ds.computed = end;
            if end == len {
                live.push(Job {
                    slot,
                    seq: s.id,
                    len,
                    k,
                    drafts: Vec::with_capacity(k),
                });
            }
        }
        let vocab = self.tokenizer.vocab_size();
        let argmax = |logits: &[f32]| {
            let mut best = 0;
            for (i, &v) in logits[..vocab].iter().enumerate() {
                if v > logits[best] {
                    best = i;
                }
            }
            best as u32
        };
        // One pass per draft position; the first also computes the catch-up.
        let mut fed: HashMap<SeqId, usize> = HashMap::new();
        let mut j = 0;
        while !rows.is_empty() {
            let out = d.model.forward(&rows, &mut d.kv);
            for (seq, err) in &out.failed {
                tracing::error!(seq = ?seq, error = %err, "a draft page failed its tag check; the sequence drafts no more from this pool copy");
                self.metrics.attention_tag_mismatches.inc();
                d.kv.release(*seq);
                d.seqs.remove(seq);
                live.retain(|job| job.seq != *seq);
            }
            for (row, logits) in out.logits {
                if let Some(job) = live.iter_mut().find(|job| job.seq == rows[row].seq) {
                    job.drafts.push(argmax(&logits));
                }
            }
            j += 1;
            rows.clear();
            for job in &live {
                if job.drafts.len() == j && j < job.k {
                    // Feeding draft j (at position len - 1 + j) gives draft j + 1.
                    rows.push(BatchRow {
                        seq: job.seq,
                        token: job.drafts[j - 1],
                        pos: job.len - 1 + j,
                        want_logits: true,
                    });
                    *fed.entry(job.seq).or_default() += 1;
                }
            }
        }
        let mut drafted = 0;
        for job in live {
            if let Some(ds) = d.seqs.get_mut(&job.seq) {
                ds.pending = Some((job.len, fed.get(&job.seq).copied().unwrap_or(0)));
            }
            drafted += job.drafts.len();
            let s = self.seqs.at_mut(job.slot);
            s.drafts = job.drafts;
            s.drafts_from_model = true;
        }
        drafted
    }
}
