//! KV pages as attention reads them: the byte layout of a page ([`KvLayout`]), the
//! owner tag each page carries ([`PageTag`]) and the block-table entries that name
//! it ([`BlockRef`]), the tag check ([`verify_tags`], I3) and the views of the pool
//! one attention pass takes ([`SeqKv`], [`PoolKv`], [`AttnJob`]).
//!
//! Shared by the attention entry points (`attention`) and the kernel (`flash`);
//! public through `attention` and the crate root.

/// Owner tag of one physical KV page. Written when the page is filled, checked at
/// every read. `epoch` changes every time the page is freed, so a tag taken before a
/// free never validates after it.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize,
)]
#[repr(C)]
pub struct PageTag {
    /// Tenant (account) that owns the data.
    pub tenant: u64,
    /// Sequence (request) id within the node.
    pub seq: u64,
    /// Page generation; bumped on free.
    pub epoch: u32,
    /// Index of this page in the sequence's block table.
    pub logical_block: u32,
}

/// One block-table entry: where a logical block lives and the tag it must carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockRef {
    /// Physical page index in the pool.
    pub page: u32,
    /// Tag the page must carry.
    pub tag: PageTag,
}

/// Shape of the KV pool's pages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Transformer layers.
    pub layers: usize,
    /// Token slots per page.
    pub page_size: usize,
    /// KV heads.
    pub kv_heads: usize,
    /// Dimension per head.
    pub head_dim: usize,
}

impl KvLayout {
    /// `kv_heads * head_dim`: values per token per layer for K (or V).
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Token slots of a page rounded up to a multiple of 4 (V is stored in groups
    /// of 4 slots; the padding slots are never written or read).
    pub fn slots4(&self) -> usize {
        self.page_size.next_multiple_of(4)
    }

    /// Bytes of one (layer, KV head) block of a page. Within it, for `ps` slots,
    /// `hd` dimensions and `s4 = slots4()`:
    /// - `[0, 2*hd*ps)`: K as `[hd/2][ps][2]` little-endian `i16` in
    ///   `-K_MAX..=K_MAX` ([`K_MAX`]): dimension `d` of slot `s` at byte
    ///   `(d/2)*ps*4 + s*4 + (d%2)*2`, so 2 consecutive dimensions of 16 slots are
    ///   one 64-byte row of a 16-bit dot product (`vpdpwssd`). K is 16-bit because
    ///   8-bit keys were the largest rounding error of the forward pass
    ///   (docs/benchmarks.md, perplexity);
    /// - then `ps` `f32` (little-endian) K scales, one per slot: `k ~= scale * k_i16`;
    /// - then V as `[s4/4][hd][4]` signed bytes: slot `s`, dimension `d` at
    ///   `(s/4)*hd*4 + d*4 + s%4` (4 slots of one dimension side by side);
    /// - then `s4` `f32` V scales.
    pub fn head_block_bytes(&self) -> usize {
        let (hd, ps, s4) = (self.head_dim, self.page_size, self.slots4());
        2 * hd * ps + 4 * ps + hd * s4 + 4 * s4
    }

    /// Bytes of one page: `layers * kv_heads` head blocks, layer-major.
    pub fn page_bytes(&self) -> usize {
        self.layers * self.kv_heads * self.head_block_bytes()
    }

    /// Byte offset of the (layer, KV head) block within a page.
    pub fn head_offset(&self, layer: usize, head: usize) -> usize {
        (layer * self.kv_heads + head) * self.head_block_bytes()
    }

    /// Byte offset of the K scales within a head block.
    pub(crate) fn k_scale_offset(&self) -> usize {
        2 * self.head_dim * self.page_size
    }

    /// Byte offset of the V values within a head block.
    pub(crate) fn v_offset(&self) -> usize {
        self.k_scale_offset() + 4 * self.page_size
    }

    /// Byte offset of the V scales within a head block.
    pub(crate) fn v_scale_offset(&self) -> usize {
        self.v_offset() + self.head_dim * self.slots4()
    }

    /// Quantizes one token's K and V for `layer` (`k`, `v`: `[kv_heads * head_dim]`)
    /// into slot `slot` of `page` (one page, [`Self::page_bytes`] long): per KV head,
    /// symmetric with round-to-nearest, K to 16 bits (scale `max|k| / K_MAX`) and V
    /// to 8 bits (scale `max|v| / 127`).
    ///
    /// Panics if `head_dim` is not a multiple of 4, `slot >= page_size` or a slice
    /// has the wrong length.
    pub fn write_token(&self, page: &mut [u8], layer: usize, slot: usize, k: &[f32], v: &[f32]) {
        let (hd, ps) = (self.head_dim, self.page_size);
        assert!(hd.is_multiple_of(4), "head_dim must be a multiple of 4");
        assert!(slot < ps, "slot {slot} outside a page of {ps}");
        assert_eq!(page.len(), self.page_bytes(), "page length");
        assert!(
            k.len() == self.kv_dim() && v.len() == self.kv_dim(),
            "K/V length"
        );
        for g in 0..self.kv_heads {
            let hb = &mut page[self.head_offset(layer, g)..][..self.head_block_bytes()];
            let d = quantize_sym(&k[g * hd..(g + 1) * hd], K_MAX, |dd, q| {
                let at = (dd / 2) * ps * 4 + slot * 4 + (dd % 2) * 2;
                hb[at..at + 2].copy_from_slice(&(q as i16).to_le_bytes());
            });
            let ks = self.k_scale_offset() + slot * 4;
            hb[ks..ks + 4].copy_from_slice(&d.to_le_bytes());
            let vo = self.v_offset() + (slot / 4) * hd * 4 + slot % 4;
            let d = quantize_sym(&v[g * hd..(g + 1) * hd], 127, |dd, q| {
                hb[vo + dd * 4] = q as i8 as u8
            });
            let vs = self.v_scale_offset() + slot * 4;
            hb[vs..vs + 4].copy_from_slice(&d.to_le_bytes());
        }
    }

    /// Zeroes every byte of slots `from..` (values and scales, every layer and
    /// head) of `page`, so a partly filled page carries no stale bytes.
    pub fn clear_slots_from(&self, page: &mut [u8], from: usize) {
        assert_eq!(page.len(), self.page_bytes(), "page length");
        let (hd, ps, s4) = (self.head_dim, self.page_size, self.slots4());
        if from >= s4 {
            return;
        }
        for hb in page.chunks_exact_mut(self.head_block_bytes()) {
            for pair in 0..hd / 2 {
                hb[pair * ps * 4 + from.min(ps) * 4..(pair + 1) * ps * 4].fill(0);
            }
            let ks = self.k_scale_offset();
            hb[ks + from.min(ps) * 4..ks + ps * 4].fill(0);
            for s in from..s4 {
                let vo = self.v_offset() + (s / 4) * hd * 4 + s % 4;
                for dd in 0..hd {
                    hb[vo + dd * 4] = 0;
                }
            }
            let vs = self.v_scale_offset();
            hb[vs + from * 4..vs + s4 * 4].fill(0);
        }
    }

    /// Dequantized K (`v = false`) or V of one slot, layer and KV head: the values
    /// attention reads (for tests and debugging; the kernels read bytes directly).
    pub fn read_token(
        &self,
        page: &[u8],
        layer: usize,
        head: usize,
        slot: usize,
        v: bool,
    ) -> Vec<f32> {
        let (hd, ps) = (self.head_dim, self.page_size);
        let hb = &page[self.head_offset(layer, head)..][..self.head_block_bytes()];
        let scale = |at: usize| f32::from_le_bytes(hb[at..at + 4].try_into().expect("4 bytes"));
        if v {
            let d = scale(self.v_scale_offset() + slot * 4);
            let vo = self.v_offset() + (slot / 4) * hd * 4 + slot % 4;
            (0..hd).map(|dd| hb[vo + dd * 4] as i8 as f32 * d).collect()
        } else {
            let d = scale(self.k_scale_offset() + slot * 4);
            (0..hd)
                .map(|dd| {
                    let at = (dd / 2) * ps * 4 + slot * 4 + (dd % 2) * 2;
                    i16::from_le_bytes([hb[at], hb[at + 1]]) as f32 * d
                })
                .collect()
        }
    }
}

/// Largest magnitude of a stored K value (14 bits and a sign): with queries at
/// most [`q_max`]`(hd)`, a score's integer dot product stays below `2^31`.
pub(crate) const K_MAX: i32 = 16383;

/// Dimensions of one exact integer partial score: a head wider than this (Gemma 3's
/// 256) sums its score over segments of this many dimensions, each exact in `i32`,
/// converted to `f32` and added in order, so its queries keep the 12 bits of a
/// 64-dimension head (at one segment of 256 they had 10: most of Gemma's perplexity
/// bias against exact arithmetic, 0.0049 nats against 0.0015 now, docs/benchmarks.md).
pub(crate) const SCORE_SEGMENT: usize = 64;

/// Largest magnitude of a quantized query for head dimension `hd`:
/// `floor((2^31 - 1) / (K_MAX * min(hd, SCORE_SEGMENT)))`, at most `i16::MAX`
/// (2,047 for every `hd` from 64 up), so `sum_d q_d k_d` over one
/// [`SCORE_SEGMENT`] of dimensions is exact in `i32`.
pub(crate) fn q_max(hd: usize) -> i32 {
    let dims = hd.clamp(1, SCORE_SEGMENT) as i64;
    (i32::MAX as i64 / (K_MAX as i64 * dims)).min(i16::MAX as i64) as i32
}

/// Symmetric quantization of `x` to integers in `-max..=max`, handing value `i` to
/// `put(i, q_i)`: returns the scale `d = max|x| / max` with `x ~= d * q`, rounding
/// half away from zero (0 for a zero row).
pub(crate) fn quantize_sym(x: &[f32], max: i32, mut put: impl FnMut(usize, i32)) -> f32 {
    let (d, id) = sym_scale(x, max);
    for (i, &v) in x.iter().enumerate() {
        put(i, round_clamp(v * id, max));
    }
    d
}

/// [`quantize_sym`] into a contiguous `i16` row (`out.len() == x.len()`,
/// `max <= i16::MAX`): the same integers, in a loop the compiler vectorizes
/// (the query rows of attention, once per unit of work).
#[inline(always)]
pub(crate) fn quantize_sym_i16(x: &[f32], max: i32, out: &mut [i16]) -> f32 {
    assert_eq!(x.len(), out.len(), "quantize_sym_i16 shapes");
    debug_assert!(max <= i32::from(i16::MAX));
    let (d, id) = sym_scale(x, max);
    for (o, &v) in out.iter_mut().zip(x) {
        *o = round_clamp(v * id, max) as i16;
    }
    d
}

/// `(d, 1 / d)` of [`quantize_sym`], with `1 / d` 0 for an all-zero row.
#[inline(always)]
fn sym_scale(x: &[f32], max: i32) -> (f32, f32) {
    // 16 running maxima, so the loop vectorizes (a max is exact: any order
    // gives the same value; NaNs are skipped either way).
    let mut lanes = [0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (a, &v) in lanes.iter_mut().zip(c) {
            *a = a.max(v.abs());
        }
    }
    let amax = chunks
        .remainder()
        .iter()
        .chain(&lanes)
        .fold(0f32, |a, &v| a.max(v.abs()));
    let d = amax / max as f32;
    (d, if d > 0.0 { 1.0 / d } else { 0.0 })
}

/// `(x.round() as i32).clamp(-max, max)` (half away from zero; NaN to 0,
/// infinities to `±max`) for `0 <= max < 2^24`, without the `roundf` library call
/// `f32::round` compiles to on baseline x86-64 (it was a few percent of prefill),
/// and in a form loops vectorize. Clamping first in `f32` gives the same integer
/// (`max` is exact in `f32`), and the fraction `y - trunc(y)` is exact, so the
/// result equals `roundf`'s bit for bit (the CUDA `kv_store` uses `roundf`).
/// A tiny nonzero row makes `1 / d` infinite; its values land on `±max` here.
#[inline(always)]
pub(crate) fn round_clamp(x: f32, max: i32) -> i32 {
    debug_assert!((0..1 << 24).contains(&max));
    let m = max as f32;
    let y = if x.is_nan() { 0.0 } else { x.clamp(-m, m) };
    // SAFETY: `y` is finite and |y| <= max < 2^24.
    let t = unsafe { y.to_int_unchecked::<i32>() };
    let f = y - t as f32;
    // Wrapping (|t| < 2^24 cannot overflow): the release profile's overflow
    // checks would otherwise keep callers' loops scalar.
    t.wrapping_add(i32::from(f >= 0.5))
        .wrapping_sub(i32::from(f <= -0.5))
}

/// A page's tag differs from the one its block table expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "KV page {page} (logical block {logical_block}) carries tag {found:?}, expected {expected:?}"
)]
pub struct IntegrityError {
    /// Physical page.
    pub page: u32,
    /// Logical block in the reading sequence.
    pub logical_block: u32,
    /// Tag the block table expected.
    pub expected: PageTag,
    /// Tag found in the pool.
    pub found: PageTag,
}

/// Whether tag checks (and the transfer's page checksums) run. Always on; only
/// the integrity-overhead benchmark turns them off, to measure what they cost.
static INTEGRITY_CHECKS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// Turns tag checks and transfer checksums off or on for the whole process.
/// Benchmarks only (`backend/serving/examples/integrity_overhead.rs`); nothing in a
/// server calls it, and with checks off I3/I4 do not hold.
#[doc(hidden)]
pub fn set_integrity_checks_for_benchmark(on: bool) {
    INTEGRITY_CHECKS.store(on, std::sync::atomic::Ordering::Relaxed);
}

/// Whether integrity checks run (see [`set_integrity_checks_for_benchmark`]).
pub fn integrity_checks() -> bool {
    INTEGRITY_CHECKS.load(std::sync::atomic::Ordering::Relaxed)
}

/// Checks every block-table entry against the pool's tags.
pub fn verify_tags(tags: &[PageTag], table: &[BlockRef]) -> Result<(), IntegrityError> {
    verify_tags_in(tags, table, 0..table.len())
}

/// [`verify_tags`] for the entries of logical blocks `blocks` only (each entry's
/// tag must name its own logical block, as there); the first mismatch in block
/// order is the error. Panics if `blocks` is outside `table`.
pub(crate) fn verify_tags_in(
    tags: &[PageTag],
    table: &[BlockRef],
    blocks: std::ops::Range<usize>,
) -> Result<(), IntegrityError> {
    if !integrity_checks() {
        return Ok(());
    }
    for i in blocks {
        let e = &table[i];
        let found = tags.get(e.page as usize).copied().unwrap_or_default();
        if found != e.tag || e.tag.logical_block as usize != i {
            return Err(IntegrityError {
                page: e.page,
                logical_block: i as u32,
                expected: e.tag,
                found,
            });
        }
    }
    Ok(())
}

/// One sequence's view of the KV pool for one layer: where its pages are and
/// the tags they must carry.
#[derive(Clone, Copy, Debug)]
pub struct SeqKv<'a> {
    /// Page shape.
    pub layout: &'a KvLayout,
    /// All page bytes of the pool (`pages * layout.page_bytes()`).
    pub data: &'a [u8],
    /// The pool's tag array, indexed by physical page.
    pub tags: &'a [PageTag],
    /// The sequence's block table (must cover the keys read).
    pub table: &'a [BlockRef],
    /// Transformer layer to read.
    pub layer: usize,
}

/// The KV pool as attention reads it for one layer (shared by every job of a pass).
#[derive(Clone, Copy, Debug)]
pub struct PoolKv<'a> {
    /// Page shape.
    pub layout: &'a KvLayout,
    /// All page bytes of the pool (`pages * layout.page_bytes()`).
    pub data: &'a [u8],
    /// The pool's tag array, indexed by physical page.
    pub tags: &'a [PageTag],
    /// Transformer layer to read.
    pub layer: usize,
}

/// `m` query rows of one sequence (a prefill chunk, or one decode token).
///
/// Pages read and tag-checked (I3): exactly the logical blocks that hold a key
/// some row attends to (the union of the rows' [`AttnJob::keys`] ranges, in
/// pages). Without a window that is every block below `max(n_keys)`; with one,
/// blocks wholly below every row's window (and any between the windows of rows
/// far apart) are neither checked nor read, so a bad tag there does not fail the
/// job: the sequence's result does not depend on them.
#[derive(Debug)]
pub struct AttnJob<'a> {
    /// Queries `[m, n_heads * head_dim]`, RoPE applied.
    pub q: &'a [f32],
    /// Row `i` attends to keys `0..n_keys[i]` (`[m]`, each >= 1), or to the last
    /// `window` of them (see [`Self::window`]).
    pub n_keys: &'a [usize],
    /// The sequence's block table, indexed by logical block (must cover
    /// `max(n_keys)` keys, including the blocks below a window).
    pub table: &'a [BlockRef],
    /// Output `[m, n_heads * head_dim]`; all zero when the job fails.
    pub out: &'a mut [f32],
    /// Sliding-window attention: with `Some(w)` (`w >= 1`), row `i` attends to
    /// keys `n_keys[i].saturating_sub(w)..n_keys[i]`, its last `w` keys including
    /// its own: llama.cpp's `LLAMA_SWA_TYPE_STANDARD` mask (a key at position
    /// `p0` is hidden from a query at `p1` when `p1 - p0 >= w`), the local layers
    /// of Gemma 2 and 3 (`w` = the GGUF's `sliding_window`, 512 for Gemma 3).
    /// `None`: all keys `0..n_keys[i]`. A window of at least every row's key
    /// count gives the same bits as `None`. The work, and the scheduler's cost
    /// estimate, follow the keys attended: a row at 32k keys with window 512
    /// costs about what a 512-key row does.
    pub window: Option<usize>,
}

impl AttnJob<'_> {
    /// Keys row `i` attends to: `n_keys[i] - window..n_keys[i]` (from 0 when the
    /// window is `None` or covers them all).
    pub fn keys(&self, i: usize) -> std::ops::Range<usize> {
        let nk = self.n_keys[i];
        window_start(nk, self.window)..nk
    }
}

/// First key a row with `nk` keys attends to under `window` (see
/// [`AttnJob::window`]).
#[inline]
pub(crate) fn window_start(nk: usize, window: Option<usize>) -> usize {
    window.map_or(0, |w| nk.saturating_sub(w))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    /// Tag of logical block `lb` of sequence `seq` (tenant 9, epoch 1).
    pub(crate) fn tag(seq: u64, lb: u32) -> PageTag {
        PageTag {
            tenant: 9,
            seq,
            epoch: 1,
            logical_block: lb,
        }
    }

    /// The bit patterns of `v` (for bit-for-bit comparisons).
    pub(crate) fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn stored_values_are_within_half_a_step_and_clearing_zeroes_only_later_slots() {
        let layout = KvLayout {
            layers: 2,
            page_size: 6,
            kv_heads: 2,
            head_dim: 8,
        };
        let mut page = vec![0xAAu8; layout.page_bytes()];
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let mut written = Vec::new();
        for slot in 0..6 {
            let k: Vec<f32> = (0..16).map(|_| rng.random_range(-3.0..3.0)).collect();
            let v: Vec<f32> = (0..16).map(|_| rng.random_range(-3.0..3.0)).collect();
            layout.write_token(&mut page, 1, slot, &k, &v);
            written.push((k, v));
        }
        for (slot, (k, v)) in written.iter().enumerate() {
            for g in 0..2 {
                for (x, back) in [(k, false), (v, true)] {
                    let x = &x[g * 8..(g + 1) * 8];
                    let max = if back { 127.0 } else { K_MAX as f32 };
                    let step = x.iter().fold(0f32, |a, v| a.max(v.abs())) / max;
                    let got = layout.read_token(&page, 1, g, slot, back);
                    for (a, b) in x.iter().zip(&got) {
                        assert!((a - b).abs() <= step * 0.5 + 1e-6);
                    }
                }
            }
        }
        let before = page.clone();
        layout.clear_slots_from(&mut page, 4);
        for layer in 0..2 {
            for g in 0..2 {
                for slot in 0..6 {
                    for v in [false, true] {
                        let now = layout.read_token(&page, layer, g, slot, v);
                        if slot >= 4 {
                            assert!(now.iter().all(|x| *x == 0.0), "slot {slot}");
                        } else {
                            assert_eq!(
                                bits(&now),
                                bits(&layout.read_token(&before, layer, g, slot, v))
                            );
                        }
                    }
                }
            }
        }
        // The clear touched at most the bytes of slots 4.. (K values, K scales, V
        // values and scales, including the padding slots 6 and 7), zeroing them; a
        // few of layer 1's were zero already (high bytes of small K values).
        let changed: Vec<usize> = (0..page.len()).filter(|&i| page[i] != before[i]).collect();
        assert!(changed.iter().all(|&i| page[i] == 0));
        let per_head = 2 * 8 * 2 + 4 * 2 + 8 * 4 + 4 * 4;
        assert!(changed.len() <= 2 * 2 * per_head, "{}", changed.len());
        assert!(changed.len() >= 2 * 2 * per_head - 8, "{}", changed.len());
    }

    #[test]
    fn a_stale_epoch_fails() {
        let tags = vec![PageTag {
            epoch: 2,
            ..tag(5, 0)
        }];
        let table = [BlockRef {
            page: 0,
            tag: tag(5, 0),
        }];
        assert!(verify_tags(&tags, &table).is_err());
    }

    #[test]
    fn a_denormal_row_quantizes_to_the_ends_without_overflow() {
        // d = amax / max is denormal and 1 / d infinite: every nonzero value
        // scales to an infinity (the old integer rounding overflowed here).
        let x = [1e-40f32, 0.0, -1e-40, 5e-41];
        let mut q = [0i32; 4];
        let d = quantize_sym(&x, 127, |i, v| q[i] = v);
        assert!(d > 0.0);
        assert_eq!(q, [127, 0, -127, 127]);
        let mut q16 = [0i16; 4];
        assert_eq!(
            quantize_sym_i16(&x, 2047, &mut q16).to_bits(),
            (1e-40f32 / 2047.0).to_bits()
        );
        assert_eq!(q16, [2047, 0, -2047, 2047]);
    }

    #[test]
    fn round_clamp_equals_roundf_then_clamp() {
        let mut vals = vec![
            0.0f32,
            -0.0,
            0.5,
            -0.5,
            1.5,
            -1.5,
            2.5,
            -2.5,
            0.49999997,
            -0.49999997,
            0.50000006,
            16383.5,
            -16383.5,
            8_388_607.5,
            8_388_608.0,
            16_777_217.0,
            2.1e9,
            -2.1e9,
            f32::NAN,
            f32::MIN_POSITIVE,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
        ];
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        vals.extend((0..200_000).map(|_| rng.random_range(-20_000.0f32..20_000.0)));
        // Exact halves and their neighbours.
        for i in -40_000i32..40_000 {
            let h = i as f32 + 0.5;
            vals.extend([
                h,
                f32::from_bits(h.to_bits() + 1),
                f32::from_bits(h.to_bits() - 1),
            ]);
        }
        for v in vals {
            for max in [127, 2047, 32767, (1 << 24) - 1] {
                assert_eq!(
                    round_clamp(v, max),
                    (v.round() as i32).clamp(-max, max),
                    "{v:e} {max}"
                );
            }
        }
    }
}
