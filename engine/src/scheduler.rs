//! The scheduler: which queued requests join the running batch and which tokens the
//! next forward pass computes. Pure: it sees counts, never pages or the model, so it
//! is tested without a GGUF, and the engine only carries its plan out.
//!
//! Policy (continuous batching with chunked prefill, vLLM-style):
//! - admission is FIFO: the oldest queued request joins once the batch has a slot and
//!   the pool has pages for all of it (`prompt + max_tokens`, reserved at once so a
//!   running sequence never runs out of KV memory); a request that does not fit blocks
//!   the ones behind it (no overtaking, so a long request is never starved);
//! - every decoding sequence gets one token per step, first;
//! - prompt chunks of prefilling sequences fill the rest of the step's token budget,
//!   oldest first.

/// What the scheduler sees of a running sequence.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqProgress {
    /// Prompt tokens.
    pub prompt: usize,
    /// Prompt tokens whose KV is computed.
    pub prefilled: usize,
    /// Tokens generated so far (a decoding sequence has at least one).
    pub generated: usize,
}

impl SeqProgress {
    /// A sequence that has not started.
    pub fn new(prompt: usize) -> Self {
        Self {
            prompt,
            prefilled: 0,
            generated: 0,
        }
    }
}

/// What the scheduler sees of a queued request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Queued {
    /// Prompt tokens.
    pub prompt: usize,
    /// Pages it needs reserved before it may run.
    pub pages: usize,
}

/// The step's limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepLimits {
    /// Tokens one forward pass may compute (decode tokens + prefill chunk tokens).
    pub max_batch_tokens: usize,
    /// Most sequences in the running batch.
    pub max_running: usize,
    /// Free pages in the pool now.
    pub free_pages: usize,
}

/// One piece of the next forward pass. `seq` indexes the running sequences followed
/// by the ones the plan admits, in that order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// One decode token at position `pos` (the last generated token is its input).
    Decode {
        /// Sequence index.
        seq: usize,
        /// Position of the input token.
        pos: usize,
    },
    /// Prompt positions `start..end`; logits are wanted when `end` is the prompt's end.
    Prefill {
        /// Sequence index.
        seq: usize,
        /// First position.
        start: usize,
        /// One past the last position.
        end: usize,
    },
}

/// The scheduler's decision for one step.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// How many queued requests (from the front) join the running batch now.
    pub admit: usize,
    /// The forward pass, decode tokens first.
    pub work: Vec<Work>,
}

impl Plan {
    /// Tokens the forward pass computes.
    pub fn tokens(&self) -> usize {
        self.work
            .iter()
            .map(|w| match *w {
                Work::Decode { .. } => 1,
                Work::Prefill { start, end, .. } => end - start,
            })
            .sum()
    }
}

/// Plans one step over `running` (in admission order) and `queue` (oldest first).
pub fn plan(running: &[SeqProgress], queue: &[Queued], limits: StepLimits) -> Plan {
    let mut admit = 0;
    let mut free = limits.free_pages;
    for q in queue {
        if running.len() + admit >= limits.max_running || q.pages > free {
            break; // FIFO: wait for a slot or pages rather than overtaking.
        }
        free -= q.pages;
        admit += 1;
    }
    let seqs: Vec<SeqProgress> = running
        .iter()
        .copied()
        .chain(queue[..admit].iter().map(|q| SeqProgress::new(q.prompt)))
        .collect();
    let mut work = Vec::new();
    let mut budget = limits.max_batch_tokens;
    for (i, s) in seqs.iter().enumerate() {
        if s.prefilled == s.prompt && s.generated > 0 {
            work.push(Work::Decode {
                seq: i,
                pos: s.prompt + s.generated - 1,
            });
            budget = budget.saturating_sub(1);
        }
    }
    for (i, s) in seqs.iter().enumerate() {
        if budget == 0 {
            break;
        }
        if s.prefilled < s.prompt {
            let end = (s.prefilled + budget).min(s.prompt);
            work.push(Work::Prefill {
                seq: i,
                start: s.prefilled,
                end,
            });
            budget -= end - s.prefilled;
        }
    }
    Plan { admit, work }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_batch_tokens: usize, max_running: usize, free_pages: usize) -> StepLimits {
        StepLimits {
            max_batch_tokens,
            max_running,
            free_pages,
        }
    }

    fn decoding(prompt: usize, generated: usize) -> SeqProgress {
        SeqProgress {
            prompt,
            prefilled: prompt,
            generated,
        }
    }

    #[test]
    fn decode_tokens_come_first_then_prompt_chunks_fill_the_budget_oldest_first() {
        let running = [
            SeqProgress::new(100),
            decoding(10, 3),
            SeqProgress {
                prompt: 50,
                prefilled: 20,
                generated: 0,
            },
        ];
        let p = plan(&running, &[], limits(64, 8, 0));
        assert_eq!(
            p.work,
            [
                Work::Decode { seq: 1, pos: 12 },
                Work::Prefill {
                    seq: 0,
                    start: 0,
                    end: 63
                },
            ]
        );
        assert_eq!(p.tokens(), 64);
        assert_eq!(p.admit, 0);
    }

    #[test]
    fn a_prompt_longer_than_the_budget_is_chunked_across_steps() {
        let mut s = SeqProgress::new(1000);
        let mut steps = 0;
        while s.prefilled < s.prompt {
            let p = plan(&[s], &[], limits(512, 8, 0));
            let [Work::Prefill { start, end, .. }] = p.work[..] else {
                panic!("{p:?}");
            };
            assert_eq!(start, s.prefilled);
            assert!(end - start <= 512);
            s.prefilled = end;
            steps += 1;
        }
        assert_eq!(steps, 2);
        s.generated = 1;
        assert_eq!(
            plan(&[s], &[], limits(512, 8, 0)).work,
            [Work::Decode { seq: 0, pos: 1000 }]
        );
    }

    #[test]
    fn admission_is_fifo_and_a_request_that_does_not_fit_blocks_the_ones_behind() {
        let queue = [
            Queued {
                prompt: 10,
                pages: 3,
            },
            Queued {
                prompt: 10,
                pages: 5,
            },
            Queued {
                prompt: 1,
                pages: 1,
            },
        ];
        // 7 free pages: the first (3) fits, the second (5) does not, and the third
        // (1) would, but may not overtake.
        let p = plan(&[], &queue, limits(512, 8, 7));
        assert_eq!(p.admit, 1);
        assert_eq!(
            p.work,
            [Work::Prefill {
                seq: 0,
                start: 0,
                end: 10
            }]
        );
        assert_eq!(plan(&[], &queue, limits(512, 8, 9)).admit, 3);
    }

    #[test]
    fn the_batch_never_exceeds_max_running() {
        let running = [decoding(4, 1), decoding(4, 2)];
        let queue = [Queued {
            prompt: 4,
            pages: 1,
        }; 5];
        let p = plan(&running, &queue, limits(512, 4, 100));
        assert_eq!(p.admit, 2);
        // Admitted sequences are indexed after the running ones.
        assert!(p.work.contains(&Work::Prefill {
            seq: 3,
            start: 0,
            end: 4
        }));
        assert_eq!(plan(&running, &queue, limits(512, 2, 100)).admit, 0);
    }

    #[test]
    fn a_zero_budget_plans_no_prefill_but_decodes_still_run() {
        let running = [decoding(4, 1), SeqProgress::new(9)];
        let p = plan(&running, &[], limits(1, 8, 0));
        assert_eq!(p.work, [Work::Decode { seq: 0, pos: 4 }]);
    }
}
