//! Paged attention on CPU with page-tag verification (DESIGN.md §2 I3, §5).
//!
//! KV memory is a pool of fixed pages. One page holds `page_size` token slots for
//! every layer, laid out `[layer][K|V][slot][kv_head][head_dim]` in `f16`, so a page
//! is one contiguous range (one transfer write). A sequence reaches its pages only
//! through its block table, whose entries carry the tag the page must hold; the
//! kernel compares that with the pool's tag array before it reads a page and fails
//! the row with [`IntegrityError`] on any difference, so a wrong mapping can never
//! yield a token.

use half::f16;
use half::slice::HalfFloatSliceExt;

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

    /// `f16` values in one page.
    pub fn page_elems(&self) -> usize {
        self.layers * 2 * self.page_size * self.kv_dim()
    }

    /// Offset (in `f16` values) of slot 0 of K (`v = false`) or V for `layer` in `page`.
    pub fn offset(&self, page: usize, layer: usize, v: bool) -> usize {
        page * self.page_elems() + (layer * 2 + v as usize) * self.page_size * self.kv_dim()
    }
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
    /// All page data of the pool.
    pub data: &'a [f16],
    /// The pool's tag array, indexed by physical page.
    pub tags: &'a [PageTag],
    /// The sequence's block table (must cover the keys read).
    pub table: &'a [BlockRef],
    /// Transformer layer to read.
    pub layer: usize,
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
/// chunk): `q` and `out` are `[m, n_heads * head_dim]`, query `i` attends to keys
/// `0..n_keys[i]`. Each page is tag-checked and converted from `f16` once for all
/// `m` queries; each query's arithmetic is exactly that of a single-query call, so
/// results do not depend on how queries are grouped.
pub fn paged_attention_block(
    q: &[f32],
    n_keys: &[usize],
    n_heads: usize,
    kv: SeqKv,
    out: &mut [f32],
) -> Result<(), IntegrityError> {
    #[cfg(target_arch = "x86_64")]
    if crate::dot::isa() != crate::dot::Isa::Scalar {
        // SAFETY: `isa()` verified avx2, fma and f16c.
        return unsafe { attention_avx2(q, n_keys, n_heads, kv, out) };
    }
    attention(q, n_keys, n_heads, kv, out)
}

/// [`attention`] compiled for AVX2 + FMA, so its loops vectorize 8 wide.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn attention_avx2(
    q: &[f32],
    n_keys: &[usize],
    n_heads: usize,
    kv: SeqKv,
    out: &mut [f32],
) -> Result<(), IntegrityError> {
    attention(q, n_keys, n_heads, kv, out)
}

#[inline(always)]
fn attention(
    q: &[f32],
    n_keys: &[usize],
    n_heads: usize,
    kv: SeqKv,
    out: &mut [f32],
) -> Result<(), IntegrityError> {
    let SeqKv {
        layout,
        data,
        tags,
        table,
        layer,
    } = kv;
    let (hd, kvd, ps) = (layout.head_dim, layout.kv_dim(), layout.page_size);
    let group = n_heads / layout.kv_heads;
    let (m, row) = (n_keys.len(), n_heads * hd);
    assert_eq!(q.len(), m * row);
    assert_eq!(out.len(), m * row);
    let max_keys = n_keys.iter().copied().max().unwrap_or(0);
    let n_pages = max_keys.div_ceil(ps);
    assert!(table.len() >= n_pages, "block table shorter than the keys");
    verify_tags(tags, &table[..n_pages])?;

    let scale = 1.0 / (hd as f32).sqrt();
    // scores[i][h][t]: query i, head h, key t (row stride max_keys).
    let mut scores = vec![0f32; m * n_heads * max_keys];
    let mut kbuf = vec![0f32; ps * kvd];
    for (b, e) in table[..n_pages].iter().enumerate() {
        let slots = (max_keys - b * ps).min(ps);
        let off = layout.offset(e.page as usize, layer, false);
        data[off..off + slots * kvd].convert_to_f32_slice(&mut kbuf[..slots * kvd]);
        for (i, &nk) in n_keys.iter().enumerate() {
            let own = nk.saturating_sub(b * ps).min(slots);
            for h in 0..n_heads {
                let qh = &q[i * row + h * hd..i * row + (h + 1) * hd];
                let g = h / group;
                let sc = &mut scores[(i * n_heads + h) * max_keys..];
                for s in 0..own {
                    let k = &kbuf[s * kvd + g * hd..s * kvd + (g + 1) * hd];
                    sc[b * ps + s] = dot(qh, k) * scale;
                }
            }
        }
    }
    for (i, &nk) in n_keys.iter().enumerate() {
        for h in 0..n_heads {
            let at = (i * n_heads + h) * max_keys;
            softmax(&mut scores[at..at + nk]);
        }
    }
    out.fill(0.0);
    for (b, e) in table[..n_pages].iter().enumerate() {
        let slots = (max_keys - b * ps).min(ps);
        let off = layout.offset(e.page as usize, layer, true);
        data[off..off + slots * kvd].convert_to_f32_slice(&mut kbuf[..slots * kvd]);
        for (i, &nk) in n_keys.iter().enumerate() {
            let own = nk.saturating_sub(b * ps).min(slots);
            for h in 0..n_heads {
                let g = h / group;
                let sc = &scores[(i * n_heads + h) * max_keys..];
                let o = &mut out[i * row + h * hd..i * row + (h + 1) * hd];
                for s in 0..own {
                    let p = sc[b * ps + s];
                    let v = &kbuf[s * kvd + g * hd..s * kvd + (g + 1) * hd];
                    for (oi, vi) in o.iter_mut().zip(v) {
                        *oi += p * vi;
                    }
                }
            }
        }
    }
    Ok(())
}

#[inline(always)]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    for (x, y) in a.chunks_exact(8).zip(b.chunks_exact(8)) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let tail: f32 = a
        .chunks_exact(8)
        .remainder()
        .iter()
        .zip(b.chunks_exact(8).remainder())
        .map(|(x, y)| x * y)
        .sum();
    acc.iter().sum::<f32>() + tail
}

/// In-place numerically stable softmax.
#[inline(always)]
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    let mut sum = 0f32;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout() -> KvLayout {
        KvLayout {
            layers: 2,
            page_size: 4,
            kv_heads: 1,
            head_dim: 32,
        }
    }

    fn kv<'a>(
        layout: &'a KvLayout,
        data: &'a [f16],
        tags: &'a [PageTag],
        table: &'a [BlockRef],
        layer: usize,
    ) -> SeqKv<'a> {
        SeqKv {
            layout,
            data,
            tags,
            table,
            layer,
        }
    }

    fn tag(seq: u64, lb: u32) -> PageTag {
        PageTag {
            tenant: 9,
            seq,
            epoch: 1,
            logical_block: lb,
        }
    }

    #[test]
    fn attention_matches_dense_reference_across_pages() {
        let l = layout();
        let n_pages = 3;
        let mut data = vec![f16::ZERO; n_pages * l.page_elems()];
        let n_keys = 6;
        // Sequence pages are physical 2 then 0 (out of order on purpose).
        let table = [
            BlockRef {
                page: 2,
                tag: tag(5, 0),
            },
            BlockRef {
                page: 0,
                tag: tag(5, 1),
            },
        ];
        let mut tags = vec![PageTag::default(); n_pages];
        tags[2] = tag(5, 0);
        tags[0] = tag(5, 1);
        let key = |t: usize, i: usize| ((t * 7 + i * 3) % 11) as f32 * 0.1 - 0.5;
        let val = |t: usize, i: usize| ((t * 5 + i) % 13) as f32 * 0.1;
        for t in 0..n_keys {
            let e = table[t / 4];
            for i in 0..32 {
                let ko = l.offset(e.page as usize, 1, false) + (t % 4) * 32 + i;
                let vo = l.offset(e.page as usize, 1, true) + (t % 4) * 32 + i;
                data[ko] = f16::from_f32(key(t, i));
                data[vo] = f16::from_f32(val(t, i));
            }
        }
        let q: Vec<f32> = (0..64).map(|i| (i % 5) as f32 * 0.2 - 0.3).collect();
        let mut out = vec![0f32; 64];
        paged_attention(&q, 2, n_keys, kv(&l, &data, &tags, &table, 1), &mut out).unwrap();
        for h in 0..2 {
            let mut s: Vec<f32> = (0..n_keys)
                .map(|t| {
                    (0..32)
                        .map(|i| q[h * 32 + i] * f16::from_f32(key(t, i)).to_f32())
                        .sum::<f32>()
                        / (32f32).sqrt()
                })
                .collect();
            softmax(&mut s);
            for i in 0..32 {
                let want: f32 = (0..n_keys)
                    .map(|t| s[t] * f16::from_f32(val(t, i)).to_f32())
                    .sum();
                assert!((out[h * 32 + i] - want).abs() < 1e-5);
            }
        }
    }

    #[test]
    fn a_block_of_queries_equals_single_queries_bitwise() {
        let l = layout();
        let n_pages = 3;
        let mut data = vec![f16::ZERO; n_pages * l.page_elems()];
        for (i, v) in data.iter_mut().enumerate() {
            *v = f16::from_f32(((i * 37) % 101) as f32 / 50.0 - 1.0);
        }
        let tags: Vec<PageTag> = (0..3).map(|b| tag(5, b)).collect();
        let table: Vec<BlockRef> = (0..3)
            .map(|b| BlockRef {
                page: b,
                tag: tag(5, b),
            })
            .collect();
        let n_keys = [3, 4, 5, 9, 12];
        let q: Vec<f32> = (0..n_keys.len() * 64)
            .map(|i| ((i * 13) % 17) as f32 / 8.0 - 1.0)
            .collect();
        let mut block = vec![0f32; q.len()];
        paged_attention_block(&q, &n_keys, 2, kv(&l, &data, &tags, &table, 1), &mut block).unwrap();
        for (i, &nk) in n_keys.iter().enumerate() {
            let mut one = vec![0f32; 64];
            paged_attention(
                &q[i * 64..(i + 1) * 64],
                2,
                nk,
                kv(&l, &data, &tags, &table, 1),
                &mut one,
            )
            .unwrap();
            let a: Vec<u32> = block[i * 64..(i + 1) * 64]
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let b: Vec<u32> = one.iter().map(|v| v.to_bits()).collect();
            assert_eq!(a, b, "query {i}");
        }
    }

    #[test]
    fn a_page_owned_by_another_sequence_fails_before_any_read() {
        let l = layout();
        let data = vec![f16::ZERO; 2 * l.page_elems()];
        let tags = vec![tag(5, 0), tag(6, 0)];
        // Sequence 5's table points at sequence 6's page.
        let table = [BlockRef {
            page: 1,
            tag: tag(5, 0),
        }];
        let mut out = vec![0f32; 32];
        let err = paged_attention(&[0.0; 32], 1, 1, kv(&l, &data, &tags, &table, 0), &mut out)
            .unwrap_err();
        assert_eq!(err.page, 1);
        assert_eq!(err.found.seq, 6);
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
