//! One engine step: the scheduler's plan (admission, chunks, decode rows) run as
//! one forward pass, its tokens sampled and sent, finished sequences retired.

use super::seq::{
    accept_token, output_logprobs, penalty_view, sampler_for, Accepted, Seq, SeqRole,
};
use super::speculate::propose;
use super::{Engine, FirstToken, Parked, Prefilled, SeqEnd, Stage, Waiting};
use crate::admission::SpecMode;
use crate::scheduler::{self, Queued, SeqProgress, StepLimits, Work};
use crate::sink::{EngineError, Event};
use std::time::Instant;
use tessera_model::kv::{ReserveError, SeqId};
use tessera_model::sampling::token_logprobs;
use tessera_model::transformer::BatchRow;
impl Engine {
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
        self.seqs
            .waiting()
            .map(|w| {
                let r = w.req.request();
                let max_hit = w.max_hit_pages(ps);
                let hits = self.kv.cached_prefix(r.tenant, &w.chain, max_hit);
                // Spilled pages come back into fresh pages: compute saved, no page.
                let spilled = self.kv.spilled_prefix(r.tenant, &w.chain, hits, max_hit);
                Queued {
                    prompt: r.prompt.len(),
                    cached: (hits + spilled) * ps,
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
        if now.duration_since(self.last_expiry) >= super::EXPIRY_EVERY {
            self.last_expiry = now;
            self.kv.expire_idle(now);
        }
        let limits = self.step_limits();
        let admission = {
            let running: Vec<SeqProgress> = self.seqs.running().map(Seq::progress).collect();
            scheduler::plan(&running, &self.queue_view(now), limits, &self.vtc)
        };
        self.apply_admission(&admission, now);
        // The work is planned over the batch as it now is: a request admitted with
        // fewer cached pages than the queue view promised computes them itself.
        let plan = {
            let running: Vec<SeqProgress> = self.seqs.running().map(Seq::progress).collect();
            scheduler::plan(&running, &[], limits, &self.vtc)
        };
        let slots = self.seqs.running_slots();
        let charges = scheduler::computed_by_tenant(&plan, |i| self.seqs.at(slots[i]).tenant);
        for (tenant, prefill, decode) in charges {
            self.vtc.charge(tenant, prefill, decode);
        }
        let live: Vec<u64> = self
            .seqs
            .running()
            .map(|s| s.tenant)
            .chain(self.seqs.parked().map(|p| p.tenant))
            .collect();
        let waiting = self.waiting_tenants();
        self.vtc
            .forget_idle(&waiting, |t| live.contains(&t) || waiting.contains(&t));
        self.propose_drafts(&plan.work, &slots);
        let rows = self.rows(&plan.work, &slots);
        if rows.is_empty() {
            return 0;
        }
        // No sequence enters or leaves from here to the sampling below.
        let slot_of = self.seqs.running_slot_by_id();
        let out = {
            // Each row's adapter (none at all: the plain pass).
            let lora: Vec<_> = rows
                .iter()
                .map(|r| self.seqs.at(slot_of[&r.seq]).lora.as_deref())
                .collect();
            let lora = if lora.iter().any(Option::is_some) {
                &lora[..]
            } else {
                &[]
            };
            self.model.forward_lora(&rows, lora, &mut self.kv)
        };
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
            let s = self.seqs.at_mut(slot_of[&r.seq]);
            if r.pos < s.prompt.len() {
                s.prefilled = s.prefilled.max(r.pos + 1);
            }
        }
        // Sequences that ended in this step: their later draft rows are void.
        let mut ended: Vec<SeqId> = Vec::new();
        for (row, mut logits) in out.logits {
            let (seq, pos) = (rows[row].seq, rows[row].pos);
            let s = self.seqs.at_mut(slot_of[&seq]);
            if pos >= s.prompt.len() {
                // A decode row, or a draft row (speculate.rs): it counts only when its
                // position is the next one and its input the last token sampled, i.e.
                // every earlier draft was accepted.
                let next = pos + 1 == s.prompt.len() + s.generated.len();
                if !next || s.generated.last() != Some(&rows[row].token) || ended.contains(&seq) {
                    continue;
                }
                if !s.drafts.is_empty() && pos > s.drafts_after {
                    self.speculation.accepted += 1;
                    self.metrics.spec_accepted[usize::from(s.drafts_from_model)].inc();
                    s.accepted_now += 1;
                }
            }
            if pos + 1 < s.prompt.len() {
                // A prompt position computed for its logprobs: scores the next
                // prompt token (raw logits; nothing is sampled).
                if let Some(k) = s.prompt_logprobs {
                    s.prompt_lp
                        .push(token_logprobs(&logits, s.prompt[pos + 1], k));
                }
                continue;
            }
            let (prompt, output) = penalty_view(&s.prompt, &s.generated, s.resumed);
            let (tok, lp) = s
                .sampler
                .sample_logprobs(&mut logits, prompt, &output, s.logprobs);
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
                    cached_tiers: s.cached_tiers,
                });
                continue;
            }
            match accept_token(s, tok, logprobs, &self.tokenizer, &self.stop_ids) {
                Accepted::Continue => {}
                Accepted::Finished(ev) => {
                    ended.push(seq);
                    finished.push((seq, SeqEnd::Completed, Some(ev)))
                }
                // The receiver is gone (client disconnected): abort and free.
                Accepted::Disconnected => {
                    ended.push(seq);
                    finished.push((seq, SeqEnd::ClientGone, None))
                }
            }
        }
        for p in prefilled {
            self.park(p);
        }
        for (id, end, ev) in finished {
            let Some(s) = self.seqs.running().find(|s| s.id == id) else {
                continue;
            };
            if s.role == SeqRole::Prefill {
                // An integrity error while computing the prompt: reported for export
                // handling; the pages stay until released.
                if let SeqEnd::Failed(e) = end {
                    let (cached_tokens, cached_tiers) = (s.cached, s.cached_tiers);
                    self.park(Prefilled {
                        seq: id,
                        result: Err(e),
                        cached_tokens,
                        cached_tiers,
                    });
                }
                continue;
            }
            let Some(mut s) = self.seqs.take_running(id) else {
                continue;
            };
            // Pages of a failed sequence are not trusted for reuse.
            self.free_seq(&s, !matches!(end, SeqEnd::Failed(_)));
            if let Some(ev) = ev {
                let _ = s.sink.send(ev);
            }
            self.record_end(id, end);
        }
        // Ended sequences' draft pages go back now, not at the next step.
        self.settle_draft_pool();
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
        if let Some(s) = self.seqs.take_running(p.seq) {
            self.seqs.enter(Stage::Parked(Parked {
                id: s.id,
                prompt: s.prompt.len(),
                tenant: s.tenant,
                chain: s.chain,
                ok: p.result.is_ok(),
            }));
            self.prefilled.push(p);
        }
    }

    /// Drops requests whose client cancelled: waiting ones are never computed, running
    /// ones stop and free their pages (computed prompt pages may be cached).
    fn drop_cancelled(&mut self) {
        let cancelled = self.seqs.take_where(|s| match s {
            Stage::Waiting(w) => w.sink.cancelled(),
            Stage::Running(r) => r.sink.cancelled(),
            Stage::Parked(_) => false,
        });
        for s in cancelled {
            if let Stage::Running(s) = s {
                self.free_seq(&s, true);
                self.record_end(s.id, SeqEnd::ClientGone);
            }
        }
    }

    /// Carries out a plan's admission decisions: expired batch requests fail as
    /// busy; admitted ones join the running batch with all their pages (the
    /// scheduler counted them), reusing cached prompt pages.
    fn apply_admission(&mut self, plan: &scheduler::Plan, now: Instant) {
        if plan.admit.is_empty() && plan.expire.is_empty() {
            return;
        }
        // The plan's indices count waiting sequences in arrival order.
        let queue: Vec<_> = self.seqs.waiting().map(|w| w.id).collect();
        let take = |seqs: &mut super::Sequences, i: usize| match seqs.take(queue[i]) {
            Some(Stage::Waiting(w)) => Some(*w),
            _ => None,
        };
        for &i in &plan.expire {
            if let Some(w) = take(&mut self.seqs, i) {
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
            if let Some(w) = take(&mut self.seqs, i) {
                last = Some(w.req.request().tenant);
                self.start_waiting(w);
            }
        }
        if let (true, Some(t)) = (self.seqs.waiting().next().is_none(), last) {
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
                cached_tiers: Default::default(),
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
        let sampler = match sampler_for(&self.tokenizer, r, w.id.0, None) {
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
            .reserve_cached_by_tier(w.id, tenant, tokens, &w.chain, max_hit)
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
        let root = self.chain_root_of(&r);
        let mut s = Seq::new(id, r, sampler, sink, submitted, role);
        s.root = root;
        s.prime(&self.tokenizer);
        let ps = self.cfg.page_size;
        s.cached = (hits.pool + hits.host + hits.disk) * ps;
        s.cached_tiers = crate::sink::CachedTiers {
            host: hits.host * ps,
            disk: hits.disk * ps,
        };
        s.prefilled = s.cached;
        s.chain = chain;
        self.seqs.enter(Stage::Running(Box::new(s)));
    }

    /// Sets each decoding sequence's drafts for this step (prompt-lookup
    /// speculation, `speculate.rs`): while the step decodes at most
    /// `speculate_max_decodes` sequences, up to the request's `speculate` (else the
    /// engine's) tokens each, and never
    /// more than it may still generate, less one (the drafts' positions stay inside
    /// the pages reserved for prompt + `max_tokens`).
    fn propose_drafts(&mut self, work: &[Work], slots: &[usize]) {
        self.settle_draft_pool();
        for s in self.seqs.running_mut() {
            if s.drafts_from_model {
                s.draft_model.observe(s.accepted_now, s.drafts.len());
            } else if !s.drafts.is_empty() {
                // Prompt lookup backs off where drafts miss: after n steps in a row
                // whose drafts were all rejected, wait 2^n steps (at most 32).
                if s.accepted_now == 0 {
                    s.draft_misses += 1;
                    s.draft_wait = 1 << s.draft_misses.min(5);
                } else {
                    s.draft_misses = 0;
                }
            }
            s.drafts.clear();
            s.drafts_from_model = false;
            s.accepted_now = 0;
        }
        let decodes = work
            .iter()
            .filter(|w| matches!(w, Work::Decode { .. }))
            .count();
        if decodes > self.cfg.speculate_max_decodes {
            return;
        }
        let default_mode = self.default_spec_mode();
        let draft_cost = self.drafter.as_ref().map(|d| d.cost());
        let mut from_model = Vec::new();
        for w in work {
            let Work::Decode { seq, pos } = *w else {
                continue;
            };
            let s = self.seqs.at_mut(slots[seq]);
            let left = s.max_tokens.saturating_sub(s.generated.len());
            let k = s
                .speculate
                .unwrap_or(self.cfg.speculate)
                .min(left.saturating_sub(1));
            s.drafts_after = pos;
            if s.draft_wait > 0 {
                s.draft_wait -= 1;
            } else {
                s.drafts = propose(&s.prompt, &s.generated, k);
            }
            // Draft mode: prompt lookup where the request's own history offers drafts
            // (free; on text that repeats its input they beat the draft model's), the
            // draft model elsewhere, for as many tokens as pay (`draft.rs`). Without
            // a draft model a request asking for one drafts by prompt lookup alone
            // (the gateway refuses it where no engine has one).
            if s.drafts.is_empty()
                && k > 0
                && s.speculate_mode.unwrap_or(default_mode) == SpecMode::Draft
            {
                if let Some(cost) = draft_cost {
                    if let Some(k) = s.draft_model.next_k(k, cost) {
                        from_model.push((slots[seq], pos, k));
                    }
                }
                continue;
            }
            self.speculation.drafted += s.drafts.len() as u64;
            self.metrics.spec_drafted[0].inc_by(s.drafts.len() as u64);
        }
        if !from_model.is_empty() {
            let drafted = self.draft_with_model(&from_model) as u64;
            self.speculation.drafted += drafted;
            self.metrics.spec_drafted[1].inc_by(drafted);
        }
    }

    /// The forward pass's rows for the planned work: a decoding sequence's drafts
    /// follow its decode row at the next positions.
    fn rows(&self, work: &[Work], slots: &[usize]) -> Vec<BatchRow> {
        let mut rows = Vec::new();
        for w in work {
            match *w {
                Work::Decode { seq, pos } => {
                    let s = self.seqs.at(slots[seq]);
                    rows.push(BatchRow {
                        seq: s.id,
                        token: *s.generated.last().expect("a decoding sequence"),
                        pos,
                        want_logits: true,
                    });
                    for (j, &token) in s.drafts.iter().enumerate() {
                        rows.push(BatchRow {
                            seq: s.id,
                            token,
                            pos: pos + 1 + j,
                            want_logits: true,
                        });
                    }
                }
                Work::Prefill { seq, start, end } => {
                    let s = self.seqs.at(slots[seq]);
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
