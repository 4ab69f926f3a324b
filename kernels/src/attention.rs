//! Paged attention on CPU with page-tag verification (DESIGN.md §2 I3, §5).
//!
//! KV memory is a pool of fixed pages. One page holds `page_size` token slots for
//! every layer and KV head as 8-bit values with one `f32` scale per token and head
//! (see [`KvLayout`] for the byte layout), so a page is one contiguous byte range
//! (one transfer write). A sequence reaches its pages only through its block table,
//! whose entries carry the tag the page must hold; the kernel compares that with
//! the pool's tag array before it reads a page and fails the sequence with
//! [`IntegrityError`] on any difference, so a wrong mapping can never yield a token.
//!
//! The arithmetic (tiled, online softmax, int8 dot products) is in `flash`.

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
    /// - `[0, hd*ps)`: K as `[hd/4][ps][4]` bytes: dimension `d` of slot `s` at
    ///   `(d/4)*ps*4 + s*4 + d%4`, stored offset-binary (`k_i8 ^ 0x80`, i.e.
    ///   `k_i8 + 128` as `u8`), so 4 consecutive dimensions of 16 slots are one
    ///   64-byte row of a VNNI dot product;
    /// - then `ps` `f32` (little-endian) K scales, one per slot: `k ~= scale * k_i8`;
    /// - then V as `[s4/4][hd][4]` signed bytes: slot `s`, dimension `d` at
    ///   `(s/4)*hd*4 + d*4 + s%4` (4 slots of one dimension side by side);
    /// - then `s4` `f32` V scales.
    pub fn head_block_bytes(&self) -> usize {
        let (hd, ps, s4) = (self.head_dim, self.page_size, self.slots4());
        hd * ps + 4 * ps + hd * s4 + 4 * s4
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
        self.head_dim * self.page_size
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
    /// symmetric 8-bit with round-to-nearest and scale `max|x| / 127`.
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
            let d = quantize_i8_with(&k[g * hd..(g + 1) * hd], |dd, q| {
                hb[(dd / 4) * ps * 4 + slot * 4 + dd % 4] = (q as u8) ^ 0x80;
            });
            let ks = self.k_scale_offset() + slot * 4;
            hb[ks..ks + 4].copy_from_slice(&d.to_le_bytes());
            let vo = self.v_offset() + (slot / 4) * hd * 4 + slot % 4;
            let d = quantize_i8_with(&v[g * hd..(g + 1) * hd], |dd, q| hb[vo + dd * 4] = q as u8);
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
            for quad in 0..hd / 4 {
                hb[quad * ps * 4 + from.min(ps) * 4..(quad + 1) * ps * 4].fill(0);
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
                .map(|dd| (hb[(dd / 4) * ps * 4 + slot * 4 + dd % 4] ^ 0x80) as i8 as f32 * d)
                .collect()
        }
    }
}

/// Symmetric 8-bit quantization of `x` into `q` (same length): returns the scale
/// `d = max|x| / 127` with `x ~= d * q`, round half away from zero (0 for a zero row).
pub(crate) fn quantize_i8(x: &[f32], q: &mut [i8]) -> f32 {
    quantize_i8_with(x, |i, v| q[i] = v)
}

/// [`quantize_i8`] handing value `i` to `put(i, q_i)` instead of storing it.
fn quantize_i8_with(x: &[f32], mut put: impl FnMut(usize, i8)) -> f32 {
    let amax = x.iter().fold(0f32, |a, &v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    for (i, &v) in x.iter().enumerate() {
        put(i, (v * id).round() as i8);
    }
    d
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
/// Benchmarks only (`serving/examples/integrity_overhead.rs`); nothing in a
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
    if !integrity_checks() {
        return Ok(());
    }
    for (i, e) in table.iter().enumerate() {
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
#[derive(Debug)]
pub struct AttnJob<'a> {
    /// Queries `[m, n_heads * head_dim]`, RoPE applied.
    pub q: &'a [f32],
    /// Row `i` attends to keys `0..n_keys[i]` (`[m]`, each >= 1).
    pub n_keys: &'a [usize],
    /// The sequence's block table (must cover `max(n_keys)` keys).
    pub table: &'a [BlockRef],
    /// Output `[m, n_heads * head_dim]`; all zero when the job fails.
    pub out: &'a mut [f32],
}

/// Causal attention of one query token over keys `0..n_keys` of one sequence.
///
/// - `q`: `[n_heads * head_dim]` (RoPE already applied); `out`: same shape.
/// - Grouped-query attention: query head `h` reads KV head `h / (n_heads / kv_heads)`.
///
/// Softmax scale is `1/sqrt(head_dim)`. Every page is tag-checked before it is read.
pub fn paged_attention(
    q: &[f32],
    n_heads: usize,
    n_keys: usize,
    kv: SeqKv,
    out: &mut [f32],
) -> Result<(), IntegrityError> {
    paged_attention_block(q, &[n_keys], n_heads, kv, out)
}

/// [`paged_attention`] for `m` query tokens of one sequence at once (a prefill
/// chunk), on the calling thread: `q` and `out` are `[m, n_heads * head_dim]`,
/// query `i` attends to keys `0..n_keys[i]`. Each query's arithmetic is exactly
/// that of a single-query call, so results do not depend on how queries are
/// grouped (and equal [`paged_attention_jobs`] bit for bit).
pub fn paged_attention_block(
    q: &[f32],
    n_keys: &[usize],
    n_heads: usize,
    kv: SeqKv,
    out: &mut [f32],
) -> Result<(), IntegrityError> {
    let pool = PoolKv {
        layout: kv.layout,
        data: kv.data,
        tags: kv.tags,
        layer: kv.layer,
    };
    let mut jobs = [AttnJob {
        q,
        n_keys,
        table: kv.table,
        out,
    }];
    crate::flash::run(pool, n_heads, &mut jobs, crate::flash::Exec::Serial)
        .pop()
        .expect("one job")
}

/// Attention for every job of a forward pass at once, on the global thread pool
/// (work is split by job, query block, KV head and, when there is little of it,
/// by 512-key chunk). Returns one result per job: a job whose pages fail the tag
/// check (I3) gets [`IntegrityError`], zero output, and no page of it is read; the
/// other jobs are unaffected. Each row's result is the same bits as
/// [`paged_attention`] for that row alone.
///
/// Panics on inconsistent shapes (`q`/`out` not `[m, n_heads * head_dim]`,
/// `n_heads` not a multiple of `kv_heads`, a table shorter than the keys).
pub fn paged_attention_jobs(
    pool: PoolKv,
    n_heads: usize,
    jobs: &mut [AttnJob],
) -> Vec<Result<(), IntegrityError>> {
    crate::flash::run(pool, n_heads, jobs, crate::flash::Exec::Parallel)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

    fn tag(seq: u64, lb: u32) -> PageTag {
        PageTag {
            tenant: 9,
            seq,
            epoch: 1,
            logical_block: lb,
        }
    }

    /// A pool of `pages` pages, sequence 5 owning all of them in physical order
    /// reversed (logical block b on page pages-1-b), filled with random K/V for
    /// `n_keys` tokens; slots past them hold `stale` bytes.
    struct Fixture {
        layout: KvLayout,
        data: Vec<u8>,
        tags: Vec<PageTag>,
        table: Vec<BlockRef>,
    }

    fn fixture(layout: KvLayout, pages: usize, n_keys: usize, stale: u8, seed: u64) -> Fixture {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        let mut data = vec![stale; pages * layout.page_bytes()];
        let table: Vec<BlockRef> = (0..pages)
            .map(|b| BlockRef {
                page: (pages - 1 - b) as u32,
                tag: tag(5, b as u32),
            })
            .collect();
        let mut tags = vec![PageTag::default(); pages];
        for e in &table {
            tags[e.page as usize] = e.tag;
        }
        let kvd = layout.kv_dim();
        let pb = layout.page_bytes();
        for t in 0..n_keys {
            let p = table[t / layout.page_size].page as usize;
            for layer in 0..layout.layers {
                let k: Vec<f32> = (0..kvd).map(|_| rng.random_range(-2.0..2.0)).collect();
                let v: Vec<f32> = (0..kvd).map(|_| rng.random_range(-1.0..1.0)).collect();
                layout.write_token(
                    &mut data[p * pb..(p + 1) * pb],
                    layer,
                    t % layout.page_size,
                    &k,
                    &v,
                );
            }
        }
        Fixture {
            layout,
            data,
            tags,
            table,
        }
    }

    impl Fixture {
        fn kv(&self, layer: usize) -> SeqKv<'_> {
            SeqKv {
                layout: &self.layout,
                data: &self.data,
                tags: &self.tags,
                table: &self.table,
                layer,
            }
        }
        fn pool(&self, layer: usize) -> PoolKv<'_> {
            PoolKv {
                layout: &self.layout,
                data: &self.data,
                tags: &self.tags,
                layer,
            }
        }
        /// Dequantized K or V of key t, KV head g.
        fn key(&self, layer: usize, g: usize, t: usize, v: bool) -> Vec<f32> {
            let pb = self.layout.page_bytes();
            let p = self.table[t / self.layout.page_size].page as usize;
            self.layout.read_token(
                &self.data[p * pb..(p + 1) * pb],
                layer,
                g,
                t % self.layout.page_size,
                v,
            )
        }
    }

    fn smollm_layout(page_size: usize) -> KvLayout {
        KvLayout {
            layers: 2,
            page_size,
            kv_heads: 3,
            head_dim: 64,
        }
    }

    fn queries(rng: &mut ChaCha8Rng, m: usize, row: usize, amp: f32) -> Vec<f32> {
        (0..m * row).map(|_| rng.random_range(-amp..amp)).collect()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    #[test]
    fn attention_matches_exact_softmax_over_the_stored_values() {
        // Keys span many pages and two 512-key chunks; GQA with 9 query heads.
        let (layout, n_heads) = (smollm_layout(16), 9);
        let n_keys = 700;
        let f = fixture(layout, 44, n_keys, 0, 1);
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let row = n_heads * 64;
        let q = queries(&mut rng, 1, row, 1.5);
        let mut out = vec![0f32; row];
        paged_attention(&q, n_heads, n_keys, f.kv(1), &mut out).unwrap();
        for h in 0..n_heads {
            let g = h / 3;
            let qh = &q[h * 64..(h + 1) * 64];
            let s: Vec<f64> = (0..n_keys)
                .map(|t| {
                    let k = f.key(1, g, t, false);
                    qh.iter()
                        .zip(&k)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                        / 8.0
                })
                .collect();
            let mx = s.iter().cloned().fold(f64::MIN, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - mx).exp()).collect();
            let z: f64 = e.iter().sum();
            for d in 0..64 {
                let want: f64 = (0..n_keys)
                    .map(|t| e[t] / z * f.key(1, g, t, true)[d] as f64)
                    .sum();
                // 8-bit queries and probabilities: within 1% of the value range.
                let got = out[h * 64 + d] as f64;
                assert!(
                    (got - want).abs() < 0.01,
                    "head {h} dim {d}: {got} vs {want}"
                );
            }
        }
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
                    let step = x.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
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
        // Every byte the clear touched belongs to slots 4.. (K values, K scales, V
        // values and scales, including the padding slots 6 and 7).
        let changed = page.iter().zip(&before).filter(|(a, b)| a != b).count();
        let per_head = 8 * 2 + 4 * 2 + 8 * 4 + 4 * 4;
        assert_eq!(changed, 2 * 2 * per_head);
    }

    #[test]
    fn a_block_of_queries_equals_single_queries_bitwise() {
        for page_size in [16, 8, 12] {
            let (layout, n_heads) = (smollm_layout(page_size), 9);
            let f = fixture(layout, 600 / page_size + 1, 600, 0x5A, 4);
            let mut rng = ChaCha8Rng::seed_from_u64(5);
            let row = n_heads * 64;
            // Positions inside pages, at page ends, and across the 512-key chunk line.
            let n_keys = [1, 3, 16, 17, 255, 256, 257, 300, 511, 512, 513, 600];
            let q = queries(&mut rng, n_keys.len(), row, 2.0);
            let mut block = vec![0f32; q.len()];
            paged_attention_block(&q, &n_keys, n_heads, f.kv(0), &mut block).unwrap();
            for (i, &nk) in n_keys.iter().enumerate() {
                let mut one = vec![0f32; row];
                paged_attention(&q[i * row..(i + 1) * row], n_heads, nk, f.kv(0), &mut one)
                    .unwrap();
                assert_eq!(
                    bits(&block[i * row..(i + 1) * row]),
                    bits(&one),
                    "page {page_size}, query {i}"
                );
            }
        }
    }

    #[test]
    fn parallel_and_chunk_split_runs_equal_the_serial_kernel_bitwise() {
        let (layout, n_heads) = (smollm_layout(16), 9);
        let row = n_heads * 64;
        let f = fixture(layout, 64, 1000, 0, 6);
        let mut rng = ChaCha8Rng::seed_from_u64(7);
        // A 40-token prefill chunk at 600.., one decode row at 1000, one at 20.
        let shapes: Vec<Vec<usize>> = vec![(601..=640).collect(), vec![1000], vec![20]];
        let qs: Vec<Vec<f32>> = shapes
            .iter()
            .map(|nk| queries(&mut rng, nk.len(), row, 2.0))
            .collect();
        let run = |exec: crate::flash::Exec| -> Vec<Vec<f32>> {
            let mut outs: Vec<Vec<f32>> = qs.iter().map(|q| vec![0f32; q.len()]).collect();
            let mut jobs: Vec<AttnJob> = outs
                .iter_mut()
                .zip(&qs)
                .zip(&shapes)
                .map(|((out, q), nk)| AttnJob {
                    q,
                    n_keys: nk,
                    table: &f.table,
                    out,
                })
                .collect();
            let res = crate::flash::run(f.pool(1), n_heads, &mut jobs, exec);
            assert!(res.iter().all(|r| r.is_ok()));
            outs
        };
        let serial = run(crate::flash::Exec::Serial);
        for exec in [
            crate::flash::Exec::Parallel,
            crate::flash::Exec::ParallelSplit,
        ] {
            let got = run(exec);
            for (a, b) in got.iter().zip(&serial) {
                assert_eq!(bits(a), bits(b), "{exec:?}");
            }
        }
        // A row computed inside a prefill chunk equals the same row as a decode job.
        let mut one = vec![0f32; row];
        let i = 17;
        paged_attention(
            &qs[0][i * row..(i + 1) * row],
            n_heads,
            shapes[0][i],
            f.kv(1),
            &mut one,
        )
        .unwrap();
        assert_eq!(bits(&serial[0][i * row..(i + 1) * row]), bits(&one));
    }

    #[test]
    fn the_dispatched_kernel_equals_the_portable_one_bitwise() {
        // Same arithmetic in every instruction-set path, so outputs do not depend
        // on the machine (CI also runs this with TESSERA_ISA=avx2 and =scalar).
        for page_size in [16, 8, 12, 4] {
            let (layout, n_heads) = (smollm_layout(page_size), 9);
            let row = n_heads * 64;
            let f = fixture(layout, 700 / page_size + 1, 700, 0x33, 12);
            let mut rng = ChaCha8Rng::seed_from_u64(13);
            let n_keys = [1, 5, 16, 63, 64, 65, 256, 257, 700];
            let q = queries(&mut rng, n_keys.len(), row, 4.0);
            let run = |portable: bool| {
                crate::flash::FORCE_PORTABLE.with(|c| c.set(portable));
                let mut out = vec![0f32; q.len()];
                paged_attention_block(&q, &n_keys, n_heads, f.kv(1), &mut out).unwrap();
                crate::flash::FORCE_PORTABLE.with(|c| c.set(false));
                out
            };
            assert_eq!(bits(&run(false)), bits(&run(true)), "page size {page_size}");
        }
    }

    #[test]
    fn stale_bytes_past_the_keys_do_not_change_the_result() {
        // 0xFF scales are NaN; stale values must be neither read into the result
        // nor multiplied by zero (0 * NaN would poison it).
        let (layout, n_heads) = (smollm_layout(16), 3);
        let row = n_heads * 64;
        let clean = fixture(layout, 3, 37, 0, 8);
        let dirty = fixture(layout, 3, 37, 0xFF, 8);
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let q = queries(&mut rng, 3, row, 2.0);
        let n_keys = [35, 36, 37];
        let (mut a, mut b) = (vec![0f32; q.len()], vec![0f32; q.len()]);
        paged_attention_block(&q, &n_keys, n_heads, clean.kv(1), &mut a).unwrap();
        paged_attention_block(&q, &n_keys, n_heads, dirty.kv(1), &mut b).unwrap();
        assert!(a.iter().all(|v| v.is_finite()));
        assert_eq!(bits(&a), bits(&b));
    }

    #[test]
    fn extreme_values_do_not_overflow() {
        // All-equal maximal keys and values: softmax is uniform, output = value.
        let layout = KvLayout {
            layers: 1,
            page_size: 16,
            kv_heads: 1,
            head_dim: 128,
        };
        let pages = 20;
        let mut data = vec![0u8; pages * layout.page_bytes()];
        let pb = layout.page_bytes();
        for t in 0..pages * 16 {
            let p = t / 16;
            layout.write_token(
                &mut data[p * pb..(p + 1) * pb],
                0,
                t % 16,
                &[1e4; 128],
                &[-3e4; 128],
            );
        }
        let tags: Vec<PageTag> = (0..pages as u32).map(|b| tag(1, b)).collect();
        let table: Vec<BlockRef> = (0..pages as u32)
            .map(|b| BlockRef {
                page: b,
                tag: tag(1, b),
            })
            .collect();
        let kv = SeqKv {
            layout: &layout,
            data: &data,
            tags: &tags,
            table: &table,
            layer: 0,
        };
        let mut out = vec![0f32; 128];
        paged_attention(&[1e3; 128], 1, pages * 16, kv, &mut out).unwrap();
        for v in out {
            assert!((v + 3e4).abs() < 3e4 * 1e-5, "{v}");
        }
    }

    #[test]
    fn a_page_owned_by_another_sequence_fails_before_any_read() {
        let l = smollm_layout(16);
        let data = vec![0u8; 2 * l.page_bytes()];
        let tags = vec![tag(5, 0), tag(6, 0)];
        // Sequence 5's table points at sequence 6's page.
        let table = [BlockRef {
            page: 1,
            tag: tag(5, 0),
        }];
        let kv = SeqKv {
            layout: &l,
            data: &data,
            tags: &tags,
            table: &table,
            layer: 0,
        };
        let mut out = vec![1f32; 192];
        let err = paged_attention(&[0.0; 192], 3, 1, kv, &mut out).unwrap_err();
        assert_eq!(err.page, 1);
        assert_eq!(err.found.seq, 6);
        assert!(out.iter().all(|v| *v == 0.0));
    }

    #[test]
    fn a_failing_job_leaves_the_other_jobs_of_the_pass_untouched() {
        let (layout, n_heads) = (smollm_layout(16), 3);
        let row = n_heads * 64;
        let f = fixture(layout, 4, 50, 0, 10);
        let mut rng = ChaCha8Rng::seed_from_u64(11);
        let q = queries(&mut rng, 2, row, 1.0);
        let mut alone = vec![0f32; row];
        paged_attention(&q[row..], n_heads, 50, f.kv(0), &mut alone).unwrap();
        // A second table naming a page with a stale epoch.
        let mut bad = f.table.clone();
        bad[2].tag.epoch = 0;
        bad[2].tag.seq = 5;
        let (mut o1, mut o2) = (vec![7f32; row], vec![0f32; row]);
        let mut jobs = [
            AttnJob {
                q: &q[..row],
                n_keys: &[50],
                table: &bad,
                out: &mut o1,
            },
            AttnJob {
                q: &q[row..],
                n_keys: &[50],
                table: &f.table,
                out: &mut o2,
            },
        ];
        let res = paged_attention_jobs(f.pool(0), n_heads, &mut jobs);
        assert_eq!(res[0].unwrap_err().logical_block, 2);
        assert!(res[1].is_ok());
        assert!(o1.iter().all(|v| *v == 0.0));
        assert_eq!(bits(&o2), bits(&alone));
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
}
