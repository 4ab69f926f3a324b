//! The modelled environments of the two nodes: page pools whose pages carry a tag
//! (decode) and a content, the engines, and the prefill node's side of the
//! one-sided transport. Checksums are computed from the content, so a short, mixed
//! or corrupt transfer is detectable.

use std::collections::{BTreeMap, BTreeSet};
use tessera_kernels::PageTag;
use tessera_transfer::protocol::{
    DecodeEnv, DecodeReserveError, FailReason, PrefillEnv, Refusal, RefusalKind, ReqId,
};
use tessera_transfer::transport::DestPage;

pub(crate) const FIRST_TOKEN: u32 = 7;

/// What a page holds. Pages are not scrubbed between requests.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum Content {
    /// Another tenant's old KV.
    Stale,
    /// Logical block `block` of request `req`.
    Kv { req: u64, block: u32 },
    /// Bytes damaged in transit.
    Corrupt,
}

pub(crate) fn checksum(c: Content) -> u32 {
    match c {
        Content::Stale => 0xdead,
        Content::Corrupt => 0xbad,
        Content::Kv { req, block } => ((req as u32) << 8) | block,
    }
}

/// A page of the decode pool: who holds it, the tag it carries, what it contains.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct DPage {
    pub(crate) held: Option<ReqId>,
    pub(crate) tag: PageTag,
    pub(crate) content: Content,
}

/// The decode node's pool and engine.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct DPool {
    pub(crate) page_size: u32,
    pub(crate) pages: Vec<DPage>,
    /// Sequences in the running batch and the pages they read.
    pub(crate) running: BTreeMap<ReqId, Vec<DestPage>>,
    /// Admissions since the model last looked (moved into the ghost state).
    pub(crate) admitted: Vec<(ReqId, u32, Vec<DestPage>)>,
    /// Requests refused at admission since the model last looked.
    pub(crate) refused: Vec<ReqId>,
    /// A request that fits the pool but not now waits for pages instead of being
    /// refused as busy (the decode node's FIFO).
    pub(crate) queue_when_busy: bool,
    /// The decode node's driver saw the prefill node's link close.
    pub(crate) writer_gone: bool,
}

/// A model pool's admission (I1): refuses a request that can never fit its pool
/// (`TooLarge`) or does not fit now (`Busy`); else returns the free pages' indices
/// (`held[i]`: page `i` is taken).
pub(crate) fn claim(held: &[bool], need: usize, pool: &str) -> Result<Vec<usize>, Refusal> {
    if need > held.len() {
        return Err(Refusal {
            kind: RefusalKind::TooLarge,
            message: format!("over the {pool} pool"),
        });
    }
    let free: Vec<usize> = (0..held.len()).filter(|&i| !held[i]).collect();
    if need > free.len() {
        return Err(Refusal {
            kind: RefusalKind::Busy,
            message: format!("{pool} pool full"),
        });
    }
    Ok(free)
}

impl DecodeEnv for DPool {
    type Attached = ();

    fn reserve(
        &mut self,
        req: ReqId,
        tenant: u64,
        prompt_tokens: u32,
        max_tokens: u32,
    ) -> Result<Vec<DestPage>, DecodeReserveError> {
        let need = (prompt_tokens + max_tokens).div_ceil(self.page_size) as usize;
        let held: Vec<bool> = self.pages.iter().map(|p| p.held.is_some()).collect();
        let free = match claim(&held, need, "decode") {
            Ok(free) => free,
            Err(r) if r.kind == RefusalKind::Busy && self.queue_when_busy => {
                return Err(DecodeReserveError::NoRoomYet)
            }
            Err(r) => {
                self.refused.push(req);
                return Err(DecodeReserveError::Refused(r));
            }
        };
        let transfer = prompt_tokens.div_ceil(self.page_size) as usize;
        let mut dest = Vec::new();
        for (block, &i) in free[..need].iter().enumerate() {
            let p = &mut self.pages[i];
            p.held = Some(req);
            p.tag = PageTag {
                tenant,
                seq: req.0,
                epoch: p.tag.epoch,
                logical_block: block as u32,
            };
            if block < transfer {
                dest.push(DestPage {
                    page: i as u32,
                    tag: p.tag,
                });
            }
        }
        Ok(dest)
    }

    fn landed_checksum(&self, req: ReqId, dest: DestPage) -> Option<u32> {
        let p = self.pages.get(dest.page as usize)?;
        (p.held == Some(req) && p.tag == dest.tag).then(|| checksum(p.content))
    }

    fn start_decode(
        &mut self,
        req: ReqId,
        _attached: Option<&mut ()>,
        tokens: u32,
        first_token: u32,
        pages: &[DestPage],
    ) -> Result<(), FailReason> {
        assert_eq!(first_token, FIRST_TOKEN);
        self.running.insert(req, pages.to_vec());
        self.admitted.push((req, tokens, pages.to_vec()));
        Ok(())
    }

    fn writer_gone(&self, _req: ReqId, _attached: Option<&()>) -> bool {
        self.writer_gone
    }

    fn release(&mut self, req: ReqId) {
        self.running.remove(&req);
        for p in &mut self.pages {
            if p.held == Some(req) {
                p.held = None;
                p.tag.epoch += 1;
            }
        }
    }
}

/// A page of the prefill pool.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PPage {
    pub(crate) held: Option<ReqId>,
    pub(crate) content: Content,
}

/// The prefill node's pool, engine and transport.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PPool {
    pub(crate) page_size: u32,
    pub(crate) pages: Vec<PPage>,
    /// Requests being computed: next block, destination pages.
    pub(crate) computing: BTreeMap<ReqId, (usize, Vec<DestPage>)>,
    /// Requests whose drain was asked for.
    pub(crate) flushing: BTreeSet<ReqId>,
    /// Requests with a failed write since their last drain.
    pub(crate) failed: BTreeSet<ReqId>,
    /// Requests refused at admission since the model last looked.
    pub(crate) refused: Vec<ReqId>,
}

impl PrefillEnv for PPool {
    type Attached = ();

    fn pages_for(&self, tokens: u32) -> usize {
        tokens.div_ceil(self.page_size) as usize
    }

    fn admit_and_alloc(
        &mut self,
        req: ReqId,
        _attached: Option<&mut ()>,
        _tenant: u64,
        prompt_tokens: u32,
        _max_tokens: u32,
    ) -> Result<(), Refusal> {
        let need = self.pages_for(prompt_tokens);
        let held: Vec<bool> = self.pages.iter().map(|p| p.held.is_some()).collect();
        let free = claim(&held, need, "prefill").inspect_err(|_| self.refused.push(req))?;
        for &i in &free[..need] {
            self.pages[i].held = Some(req);
        }
        Ok(())
    }

    fn start_prefill(
        &mut self,
        req: ReqId,
        _attached: Option<&mut ()>,
        _tokens: u32,
        dest: &[DestPage],
    ) {
        self.computing.insert(req, (0, dest.to_vec()));
    }

    fn stop_prefill(&mut self, req: ReqId, _attached: Option<&mut ()>) {
        self.computing.remove(&req);
    }

    fn flush(&mut self, req: ReqId, _attached: Option<&mut ()>) {
        self.flushing.insert(req);
    }

    fn release(&mut self, req: ReqId) {
        for p in &mut self.pages {
            if p.held == Some(req) {
                p.held = None;
            }
        }
    }
}

/// Every page `req` reads is held for it, carries the tag it expects, the tag is the
/// request's, and the page holds the request's own KV for that block.
pub(crate) fn reads_own_pages(pool: &DPool, req: ReqId, pages: &[DestPage]) -> bool {
    pages.iter().all(|d| {
        let p = &pool.pages[d.page as usize];
        p.held == Some(req)
            && p.tag == d.tag
            && d.tag.seq == req.0
            && p.content
                == Content::Kv {
                    req: req.0,
                    block: d.tag.logical_block,
                }
    })
}
