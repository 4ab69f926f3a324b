//! The engine's side of a KV transfer (DESIGN.md §6): a prefill node exports a
//! computed prompt's pages, a decode node reserves destination pages, lands the bytes
//! that arrive, checksums them for the commit check (I4) and adopts the sequence.
//!
//! Nothing here does I/O: [`Engine::export_pages`] copies the pages out (after their
//! tag check, I3) so that a transfer worker can put them while the engine keeps
//! stepping; the source pages stay reserved until the protocol says the writes are
//! drained ([`Engine::release_prefill`], I5).

use crate::admission::Admitted;
use crate::engine::{accept_token, Accepted, Engine, SeqEnd, SeqRole};
use crate::sink::EventSink;
use std::time::Instant;
use tessera_kernels::{BlockRef, IntegrityError};
use tessera_model::kv::{PoolError, SeqId};
use tessera_model::sampling::Logprobs;
use tessera_transfer::checksum::page_checksum;
use tessera_transfer::inproc::PageLanding;
use tessera_transfer::transport::DestPage;

/// One page of a prefill's export: where it goes, its bytes (the pool's page format,
/// `layout.page_bytes()` bytes: 16-bit K and 8-bit V with per-slot scales, see
/// `tessera_kernels::attention::KvLayout`) and their CRC-32C.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExportedPage {
    /// Destination page and the tag the decode node expects.
    pub dest: DestPage,
    /// The page's bytes, slots past the prompt zeroed.
    pub bytes: Vec<u8>,
    /// [`page_checksum`] of `bytes`.
    pub checksum: u32,
}

/// Why an export failed. The source pages stay reserved until released.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
    /// No computed prefill of that id is held here.
    #[error("no computed prefill {0:?} is held on this node")]
    Unknown(SeqId),
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

/// A transferred sequence the decode node starts decoding ([`Engine::adopt`]).
pub struct Import {
    /// The admitted request (prompt ids, sampling, stops).
    pub req: Admitted,
    /// The prefill node's first token.
    pub first_token: u32,
    /// Sampler fallback seed both nodes use (the transfer id).
    pub seed_fallback: u64,
    /// Sampler RNG position after the first token.
    pub rng_word_pos: u128,
    /// The first token's log probabilities and the prompt's, when the request
    /// asked (computed by the prefill node).
    pub logprobs: Option<Box<Logprobs>>,
    /// Prompt tokens the prefill node took from its prefix cache (usage only).
    pub cached_tokens: usize,
    /// Of `cached_tokens`, those the prefill node restored from its lower tiers.
    pub cached_tiers: crate::sink::CachedTiers,
    /// Where the sequence's events go.
    pub sink: Box<dyn EventSink>,
    /// When the client's request arrived (TTFT).
    pub submitted: Instant,
}

impl std::fmt::Debug for Import {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Import")
            .field("req", &self.req)
            .field("first_token", &self.first_token)
            .finish_non_exhaustive()
    }
}

impl Engine {
    /// Prefill role: copies computed prefill `seq`'s prompt pages out for the
    /// destination pages `dest` (one per prompt page, in logical order): checks each
    /// source page's tag first (I3), zeroes slots past the prompt in the last page (no
    /// stale bytes leave the node) and checksums what will be sent. The pages stay
    /// reserved.
    pub fn export_pages(
        &self,
        seq: SeqId,
        dest: &[DestPage],
    ) -> Result<Vec<ExportedPage>, ExportError> {
        let prompt = self
            .seqs
            .parked_by_id(seq)
            .ok_or(ExportError::Unknown(seq))?
            .prompt;
        let table = self.kv.table(seq).unwrap_or(&[]);
        let n = self.kv.pages_for(prompt);
        if dest.len() != n || table.len() < n {
            return Err(ExportError::DescriptorMismatch {
                dest: dest.len(),
                pages: n,
            });
        }
        let counted = |e: IntegrityError| {
            self.metrics.transfer_source_tag_mismatches.inc();
            ExportError::Integrity(e)
        };
        tessera_kernels::attention::verify_tags(self.kv.pool().tags(), &table[..n])
            .map_err(counted)?;
        let layout = *self.kv.layout();
        let used_in_last = prompt - (n - 1) * layout.page_size;
        let mut pages = Vec::with_capacity(n);
        for (i, (r, dest)) in table[..n].iter().zip(dest).enumerate() {
            let data = self.kv.pool().page_data(*r).ok_or_else(|| {
                counted(IntegrityError {
                    page: r.page,
                    logical_block: i as u32,
                    expected: r.tag,
                    found: self.kv.pool().tags()[r.page as usize],
                })
            })?;
            let mut bytes = data.to_vec();
            if i + 1 == n && used_in_last < layout.page_size {
                layout.clear_slots_from(&mut bytes, used_in_last);
            }
            let checksum = page_checksum(&bytes);
            pages.push(ExportedPage {
                dest: *dest,
                bytes,
                checksum,
            });
        }
        Ok(pages)
    }

    /// Decode role: reserves pages for `prompt_tokens + max_tokens` tokens of sequence
    /// `seq` (the request id), whose prompt K/V will arrive by transfer, all or nothing.
    /// Returns the destination pages of the prompt (one per prompt page, in logical
    /// order) for the descriptor.
    ///
    /// Errors: [`PoolError::Exhausted`] (nothing reserved), [`PoolError::SeqInUse`].
    pub fn reserve_import(
        &mut self,
        seq: SeqId,
        tenant: u64,
        prompt_tokens: usize,
        max_tokens: usize,
    ) -> Result<Vec<DestPage>, PoolError> {
        self.kv
            .reserve(seq, tenant, prompt_tokens.saturating_add(max_tokens))?;
        let n = self.kv.pages_for(prompt_tokens);
        let table = self.kv.table(seq).expect("just reserved");
        Ok(table[..n]
            .iter()
            .map(|r| DestPage {
                page: r.page,
                tag: r.tag,
            })
            .collect())
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
            logprobs,
            cached_tokens,
            cached_tiers,
            sink,
            submitted,
        } = import;
        let r = req.into_request();
        // Its tenant's cache bounds and namespace hold for the pages a drain may
        // cache from this sequence ([`Engine::end_caching_output`]).
        self.note_tenant_cache(&r);
        let root = self.chain_root_of(&r);
        let sampler =
            crate::engine::sampler_for(&self.tokenizer, &r, seed_fallback, Some(rng_word_pos));
        let mut sampler = match sampler {
            Ok(s) => s,
            Err(e) => {
                self.kv.release(seq);
                let mut sink = sink;
                let _ = sink.send(crate::sink::Event::Error(e.clone()));
                self.record_end(seq, SeqEnd::Failed(e));
                return;
            }
        };
        // The prefill node's sampler consumed the first token; this one catches up.
        sampler.accept_external(first_token);
        let mut s = crate::engine::Seq::new(seq, r, sampler, sink, submitted, SeqRole::Generate);
        s.root = root;
        s.prime(&self.tokenizer);
        s.prefilled = s.prompt.len();
        s.cached = cached_tokens;
        s.cached_tiers = cached_tiers;
        match accept_token(
            &mut s,
            first_token,
            logprobs,
            &self.tokenizer,
            &self.stop_ids,
        ) {
            Accepted::Continue => self.seqs.enter(crate::engine::Stage::Running(Box::new(s))),
            Accepted::Finished(ev) => {
                self.kv.release(seq);
                let _ = s.sink.send(ev);
                self.record_end(seq, SeqEnd::Completed);
            }
            Accepted::Disconnected => {
                self.kv.release(seq);
                self.record_end(seq, SeqEnd::ClientGone);
            }
        }
    }
}
