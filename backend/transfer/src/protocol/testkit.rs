//! Fixtures shared by the protocol's unit tests.

use super::messages::{PageCommit, ReqId};
use crate::transport::DestPage;
use tessera_kernels::PageTag;

/// The request most tests drive.
pub(super) const R: ReqId = ReqId(7);

pub(super) fn tag(epoch: u32, block: u32) -> PageTag {
    PageTag {
        tenant: 3,
        seq: R.0,
        epoch,
        logical_block: block,
    }
}

pub(super) fn dests(n: u32) -> Vec<DestPage> {
    (0..n)
        .map(|b| DestPage {
            page: 10 + b,
            tag: tag(1, b),
        })
        .collect()
}

pub(super) fn good(pages: &[DestPage]) -> Vec<PageCommit> {
    pages
        .iter()
        .map(|d| PageCommit {
            dest: *d,
            checksum: 100 + d.tag.logical_block,
        })
        .collect()
}
