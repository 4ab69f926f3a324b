//! Structs passed by value to the device kernels, laid out as their C twins in
//! `kernels/cuda/tessera_common.cuh` (same fields, same order, `#[repr(C)]`; the
//! C side `static_assert`s the sizes these tests pin).

use crate::page::{KvLayout, PageTag};
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};

// SAFETY: PageTag is #[repr(C)] plain data (u64, u64, u32, u32: 24 bytes, no
// padding), the layout of the C `PageTag`; all-zero bits are a valid value.
unsafe impl DeviceRepr for PageTag {}
unsafe impl ValidAsZeroBits for PageTag {}

/// Geometry of the device KV pool (C `KvGeom`, 48 bytes): the byte offsets of
/// [`KvLayout`] and the page count every page index is checked against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct KvGeom {
    /// Bytes of one page.
    pub page_bytes: u64,
    /// Bytes of one (layer, KV head) block.
    pub head_bytes: u32,
    /// K scales within a head block.
    pub k_scale_off: u32,
    /// V values within a head block.
    pub v_off: u32,
    /// V scales within a head block.
    pub v_scale_off: u32,
    /// Token slots per page.
    pub page_size: u32,
    /// Dimensions per head.
    pub head_dim: u32,
    /// KV heads per layer.
    pub kv_heads: u32,
    /// Pages in the pool.
    pub n_pages: u32,
    pad: [u32; 2],
}

// SAFETY: #[repr(C)] plain data matching the C struct.
unsafe impl DeviceRepr for KvGeom {}

impl KvGeom {
    /// The geometry of a pool of `n_pages` pages of `layout`.
    pub fn new(layout: &KvLayout, n_pages: usize) -> Self {
        Self {
            page_bytes: layout.page_bytes() as u64,
            head_bytes: layout.head_block_bytes() as u32,
            k_scale_off: layout.k_scale_offset() as u32,
            v_off: layout.v_offset() as u32,
            v_scale_off: layout.v_scale_offset() as u32,
            page_size: layout.page_size as u32,
            head_dim: layout.head_dim as u32,
            kv_heads: layout.kv_heads as u32,
            n_pages: n_pages as u32,
            pad: [0; 2],
        }
    }
}

/// One step's sequences and block tables on the device (C `SeqTables`, 56
/// bytes): raw device addresses (`CUdeviceptr`) of the arrays the C side names,
/// all inside buffers the caller keeps alive until the step's kernels finished.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(C)]
pub struct SeqTables {
    /// `u32 [rows]`: slot of each row.
    pub row_slot: u64,
    /// `u32 [rows]`: position of each row (it attends to keys `0..=pos`).
    pub row_pos: u64,
    /// `u32 [slots]`: first block-table entry of each slot.
    pub slot_off: u64,
    /// `u32 [slots]`: block-table entries of each slot.
    pub slot_len: u64,
    /// `u32 [entries]`: physical page of each entry.
    pub tbl_page: u64,
    /// `PageTag [entries]`: the tag each entry's page must carry.
    pub tbl_tag: u64,
    /// `u32 [slots]`: failure words (first failing logical block, or `u32::MAX`).
    pub slot_fail: u64,
}

// SAFETY: #[repr(C)] plain data (device addresses) matching the C struct.
unsafe impl DeviceRepr for SeqTables {}

/// `slot_fail` value of a sequence that passed every check.
pub const NO_FAILURE: u32 = u32::MAX;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_the_c_static_asserts() {
        assert_eq!(std::mem::size_of::<PageTag>(), 24);
        assert_eq!(std::mem::size_of::<KvGeom>(), 48);
        assert_eq!(std::mem::size_of::<SeqTables>(), 56);
        let h = include_str!("../../cuda/tessera_common.cuh");
        for s in [
            "sizeof(KvGeom) == 48",
            "sizeof(SeqTables) == 56",
            "sizeof(PageTag) == 24",
        ] {
            assert!(h.contains(s), "{s}");
        }
    }

    #[test]
    fn geometry_is_the_layouts() {
        let l = KvLayout {
            layers: 30,
            page_size: 16,
            kv_heads: 3,
            head_dim: 64,
        };
        let g = KvGeom::new(&l, 7);
        assert_eq!(g.page_bytes as usize, l.page_bytes());
        assert_eq!(g.head_bytes as usize, l.head_block_bytes());
        assert_eq!(
            (g.k_scale_off, g.v_off, g.v_scale_off),
            (2048, 2048 + 64, 2048 + 64 + 1024)
        );
        assert_eq!(g.n_pages, 7);
    }
}
