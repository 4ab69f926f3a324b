//! Paged attention on CPU with page-tag verification (DESIGN.md §2 I3, §5).
//!
//! KV memory is a pool of fixed pages. One page holds `page_size` token slots for
//! every layer and KV head (K 16-bit, V 8-bit) with one `f32` scale per token and head
//! (see [`KvLayout`] for the byte layout), so a page is one contiguous byte range
//! (one transfer write). A sequence reaches its pages only through its block table,
//! whose entries carry the tag the page must hold; the kernel compares that with
//! the pool's tag array before it reads a page and fails the sequence with
//! [`IntegrityError`] on any difference, so a wrong mapping can never yield a token.
//!
//! The page layout, tags and tag check are in `page` (re-exported here); the
//! arithmetic (tiled, online softmax, int8 dot products) is in `flash`.

pub use crate::page::{
    integrity_checks, set_integrity_checks_for_benchmark, verify_tags, AttnJob, BlockRef,
    IntegrityError, KvLayout, PageTag, PoolKv, SeqKv,
};

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
/// grouped (and equal [`paged_attention_jobs`] bit for bit). All keys, no
/// sliding window (for one: [`paged_attention_jobs`] with [`AttnJob::window`]).
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
        window: None,
    }];
    crate::flash::run(pool, n_heads, &mut jobs, crate::flash::Exec::Serial)
        .pop()
        .expect("one job")
}

/// Attention for every job of a forward pass at once, on the global thread pool
/// (work is split by job, query block, KV head and, when there is little of it,
/// by 512-key chunk). Returns one result per job: a job whose pages fail the tag
/// check (I3) gets [`IntegrityError`], zero output, and no page of it is read; the
/// other jobs are unaffected. The pages checked are those the job reads: every
/// page holding a key some row attends to, which with a sliding window
/// ([`AttnJob::window`]) leaves out the pages below the windows. Each row's
/// result is the same bits as the row alone in a job of its own (without a
/// window, as [`paged_attention`]).
///
/// Panics on inconsistent shapes (`q`/`out` not `[m, n_heads * head_dim]`,
/// `n_heads` not a multiple of `kv_heads`, a table shorter than the keys) and on
/// a window of 0 keys.
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
    use crate::page::tests::{bits, tag};
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;

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
                // Quantized queries, keys, values and probabilities: within 1% of the value range.
                let got = out[h * 64 + d] as f64;
                assert!(
                    (got - want).abs() < 0.01,
                    "head {h} dim {d}: {got} vs {want}"
                );
            }
        }
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
        let run = |exec: crate::flash::Exec, window: Option<usize>| -> Vec<Vec<f32>> {
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
                    window,
                })
                .collect();
            let res = crate::flash::run(f.pool(1), n_heads, &mut jobs, exec);
            assert!(res.iter().all(|r| r.is_ok()));
            outs
        };
        let serial = run(crate::flash::Exec::Serial, None);
        // Windows: one key, starting mid-page, a whole page, across the 512-key
        // chunk line (so the prefill rows' windows start in different chunks,
        // some in chunk 0 and some in 1), one chunk, and more than every row.
        for window in [
            None,
            Some(1),
            Some(7),
            Some(16),
            Some(100),
            Some(512),
            Some(611),
            Some(1000),
        ] {
            let serial_w = run(crate::flash::Exec::Serial, window);
            if window.is_none() || window >= Some(1000) {
                for (a, b) in serial_w.iter().zip(&serial) {
                    assert_eq!(bits(a), bits(b), "window {window:?} covers every key");
                }
            }
            for exec in [
                crate::flash::Exec::Parallel,
                crate::flash::Exec::ParallelSplit,
            ] {
                let got = run(exec, window);
                for (a, b) in got.iter().zip(&serial_w) {
                    assert_eq!(bits(a), bits(b), "{exec:?}, window {window:?}");
                }
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
        // Gemma 3's shape (head_dim 256, one KV head, 4 query heads).
        let layout = KvLayout {
            layers: 2,
            page_size: 16,
            kv_heads: 1,
            head_dim: 256,
        };
        let f = fixture(layout, 700 / 16 + 1, 700, 0x33, 14);
        let mut rng = ChaCha8Rng::seed_from_u64(15);
        let n_keys = [1, 5, 16, 63, 64, 65, 256, 257, 700];
        let q = queries(&mut rng, n_keys.len(), 4 * 256, 4.0);
        let run = |portable: bool| {
            crate::flash::FORCE_PORTABLE.with(|c| c.set(portable));
            let mut out = vec![0f32; q.len()];
            paged_attention_block(&q, &n_keys, 4, f.kv(1), &mut out).unwrap();
            crate::flash::FORCE_PORTABLE.with(|c| c.set(false));
            out
        };
        assert_eq!(bits(&run(false)), bits(&run(true)), "head_dim 256");
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
                window: None,
            },
            AttnJob {
                q: &q[row..],
                n_keys: &[50],
                table: &f.table,
                out: &mut o2,
                window: None,
            },
        ];
        let res = paged_attention_jobs(f.pool(0), n_heads, &mut jobs);
        assert_eq!(res[0].unwrap_err().logical_block, 2);
        assert!(res[1].is_ok());
        assert!(o1.iter().all(|v| *v == 0.0));
        assert_eq!(bits(&o2), bits(&alone));
    }

    /// Runs one job on the calling thread (so `FORCE_PORTABLE` applies):
    /// its result and output.
    fn run_serial(
        pool: PoolKv,
        n_heads: usize,
        q: &[f32],
        n_keys: &[usize],
        table: &[BlockRef],
        window: Option<usize>,
    ) -> (Result<(), IntegrityError>, Vec<f32>) {
        let mut out = vec![7f32; q.len()];
        let mut jobs = [AttnJob {
            q,
            n_keys,
            table,
            out: &mut out,
            window,
        }];
        let res = crate::flash::run(pool, n_heads, &mut jobs, crate::flash::Exec::Serial);
        (res.into_iter().next().expect("one job"), out)
    }

    /// Exact (f64) attention of query rows `q` (`[keys.len(), n_heads * hd]`),
    /// row `i` over keys `keys[i]` of the sequence whose block table is `table`,
    /// from the values stored in `data`.
    fn exact(
        pool: PoolKv,
        n_heads: usize,
        table: &[BlockRef],
        q: &[f32],
        keys: &[std::ops::Range<usize>],
    ) -> Vec<f64> {
        let l = pool.layout;
        let (hd, ps, pb) = (l.head_dim, l.page_size, l.page_bytes());
        let group = n_heads / l.kv_heads;
        let row = n_heads * hd;
        let read = |t: usize, g: usize, v: bool| {
            let p = table[t / ps].page as usize;
            l.read_token(&pool.data[p * pb..(p + 1) * pb], pool.layer, g, t % ps, v)
        };
        let mut out = vec![0f64; keys.len() * row];
        for (i, ks) in keys.iter().enumerate() {
            for g in 0..l.kv_heads {
                let kv: Vec<(Vec<f32>, Vec<f32>)> = ks
                    .clone()
                    .map(|t| (read(t, g, false), read(t, g, true)))
                    .collect();
                for h in g * group..(g + 1) * group {
                    let qh = &q[i * row + h * hd..i * row + (h + 1) * hd];
                    let sc: Vec<f64> = kv
                        .iter()
                        .map(|(k, _)| {
                            qh.iter()
                                .zip(k)
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum::<f64>()
                                / (hd as f64).sqrt()
                        })
                        .collect();
                    let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
                    let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                    let z: f64 = e.iter().sum();
                    let o = &mut out[i * row + h * hd..i * row + (h + 1) * hd];
                    for (et, (_, v)) in e.iter().zip(&kv) {
                        for (od, vd) in o.iter_mut().zip(v) {
                            *od += et / z * *vd as f64;
                        }
                    }
                }
            }
        }
        out
    }

    #[test]
    fn a_window_attends_to_exactly_the_last_keys_of_each_row() {
        // One job of rows with different key counts (a prefill block beside
        // scattered rows); windows of one key, starting mid-page, of one page,
        // across pages and chunks, and wider than every row.
        let (layout, n_heads) = (smollm_layout(16), 9);
        let row = n_heads * 64;
        let f = fixture(layout, 70, 1100, 0xFF, 20);
        let mut rng = ChaCha8Rng::seed_from_u64(21);
        let n_keys = [1, 5, 16, 17, 300, 700, 1100, 1099, 1098];
        let q = queries(&mut rng, n_keys.len(), row, 1.5);
        for window in [1, 7, 16, 20, 512, 513, 5000] {
            let (res, out) = run_serial(f.pool(1), n_heads, &q, &n_keys, &f.table, Some(window));
            res.unwrap();
            let keys: Vec<_> = n_keys
                .iter()
                .map(|&nk| nk.saturating_sub(window)..nk)
                .collect();
            let want = exact(f.pool(1), n_heads, &f.table, &q, &keys);
            for (i, (g, w)) in out.iter().zip(&want).enumerate() {
                // Quantized queries, keys, values and probabilities: within 1%
                // of the value range (stale 0xFF slots would give NaN).
                assert!(
                    (*g as f64 - w).abs() < 0.01,
                    "window {window}, row {}, value {}: {g} vs {w}",
                    i / row,
                    i % row
                );
            }
        }
    }

    #[test]
    fn every_kernel_gives_the_same_bits_with_a_window_alone_or_in_a_block() {
        // The portable, AVX2 and AVX-512 kernels (CI runs this with
        // TESSERA_ISA=avx2 and =scalar too) on windows that start mid-page, at
        // page and chunk lines, of one key, and wider than the keys; rows in
        // one job (more than a 16-row tile, with windows starting in different
        // pages, groups and chunks), each equal to the row in a job of its own.
        let layouts = [
            (16, 64, 3, 9),
            (8, 64, 3, 9),
            (12, 64, 1, 2),
            (4, 64, 1, 3),
            (8, 128, 2, 4),
            (16, 128, 1, 2),
            // Gemma 3 270M: one KV head of 256 for 4 query heads.
            (16, 256, 1, 4),
        ];
        for (page_size, head_dim, kv_heads, n_heads) in layouts {
            let layout = KvLayout {
                layers: 2,
                page_size,
                kv_heads,
                head_dim,
            };
            let row = n_heads * head_dim;
            let f = fixture(layout, 1200 / page_size + 1, 1200, 0xFF, 22);
            let mut rng = ChaCha8Rng::seed_from_u64(23);
            let mut n_keys = vec![1, 5, 16, 63, 64, 65, 256, 257, 700, 1200];
            n_keys.extend(1000..1020);
            let q = queries(&mut rng, n_keys.len(), row, 4.0);
            let run = |portable: bool, window: Option<usize>, nk: &[usize], q: &[f32]| {
                crate::flash::FORCE_PORTABLE.with(|c| c.set(portable));
                let (res, out) = run_serial(f.pool(1), n_heads, q, nk, &f.table, window);
                crate::flash::FORCE_PORTABLE.with(|c| c.set(false));
                res.unwrap();
                out
            };
            let none = run(false, None, &n_keys, &q);
            for window in [1, 3, 4, 16, 17, 100, 511, 512, 513, 1199, 1200, 5000] {
                let w = Some(window);
                let got = run(false, w, &n_keys, &q);
                let at = format!("page {page_size}, head_dim {head_dim}, window {window}");
                assert_eq!(bits(&got), bits(&run(true, w, &n_keys, &q)), "{at}");
                if window >= 1200 {
                    assert_eq!(bits(&got), bits(&none), "{at}: covers every key");
                } else {
                    assert_ne!(bits(&got), bits(&none), "{at}: the window is ignored");
                }
                for (i, nk) in n_keys.iter().enumerate().step_by(3) {
                    let qi = &q[i * row..(i + 1) * row];
                    let alone = run(false, w, &[*nk], qi);
                    assert_eq!(
                        bits(&got[i * row..(i + 1) * row]),
                        bits(&alone),
                        "{at}, row {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn only_pages_inside_some_row_window_are_tag_checked_and_read() {
        // Rows at 300 and 1900 keys with window 100 read blocks 12..19 and
        // 112..119 (16-key pages; the first window starts mid-page 12, at key
        // 200). Blocks below and between the windows point outside the pool,
        // where a read panics and a tag check fails: the job neither reads nor
        // checks them, and its result is that of the intact table.
        let (layout, n_heads) = (smollm_layout(16), 3);
        let row = n_heads * 64;
        let f = fixture(layout, 120, 1900, 0, 24);
        let mut rng = ChaCha8Rng::seed_from_u64(25);
        let n_keys = [300, 1900];
        let q = queries(&mut rng, 2, row, 2.0);
        let (res, intact) = run_serial(f.pool(0), n_heads, &q, &n_keys, &f.table, Some(100));
        res.unwrap();
        let mut holes = f.table.clone();
        for (b, e) in holes.iter_mut().enumerate() {
            if !(12..19).contains(&b) && !(112..119).contains(&b) {
                e.page = 1_000_000 + b as u32;
            }
        }
        let (res, got) = run_serial(f.pool(0), n_heads, &q, &n_keys, &holes, Some(100));
        res.unwrap();
        assert_eq!(bits(&got), bits(&intact));
        // Without the window the same table fails at block 0.
        let (res, got) = run_serial(f.pool(0), n_heads, &q, &n_keys, &holes, None);
        assert_eq!(res.unwrap_err().logical_block, 0);
        assert!(got.iter().all(|v| *v == 0.0));
        // A bad tag on a page inside a window fails the job before any read:
        // the page holding the first window's start, and the last page.
        for block in [12, 118] {
            let mut bad = holes.clone();
            bad[block].tag.epoch += 1;
            let (res, got) = run_serial(f.pool(0), n_heads, &q, &n_keys, &bad, Some(100));
            let e = res.unwrap_err();
            assert_eq!((e.logical_block, e.page), (block as u32, bad[block].page));
            assert!(got.iter().all(|v| *v == 0.0), "block {block}");
        }
        // Window 92 starts at key 208, on block 13: block 12 is no longer read.
        let mut bad = holes.clone();
        bad[12].tag.epoch += 1;
        let (res, _) = run_serial(f.pool(0), n_heads, &q, &n_keys, &bad, Some(92));
        res.unwrap();
        let (res, _) = run_serial(f.pool(0), n_heads, &q, &n_keys, &bad, Some(93));
        assert_eq!(res.unwrap_err().logical_block, 12);
    }

    #[test]
    fn a_window_at_a_32k_context_reads_only_its_own_pages() {
        // 2048 logical blocks (32,768 keys), of which the pool holds only the
        // 33 that window 520 reaches (from key 32,248, mid-block 2015): every
        // other entry names a page outside the pool, so the job must not touch
        // them, nor iterate the keys below the window to mask them.
        let (layout, n_heads) = (smollm_layout(16), 9);
        let row = n_heads * 64;
        let f = fixture(layout, 33, 33 * 16, 0, 26);
        let (blocks, base) = (2048, 2048 - 33);
        let mut tags = f.tags.clone();
        let table: Vec<BlockRef> = (0..blocks)
            .map(|b| {
                if b < base {
                    return BlockRef {
                        page: 1_000_000 + b as u32,
                        tag: tag(5, b as u32),
                    };
                }
                let page = f.table[b - base].page;
                tags[page as usize] = tag(5, b as u32);
                BlockRef {
                    page,
                    tag: tag(5, b as u32),
                }
            })
            .collect();
        let pool = PoolKv {
            layout: &f.layout,
            data: &f.data,
            tags: &tags,
            layer: 1,
        };
        let mut rng = ChaCha8Rng::seed_from_u64(27);
        // A decode row and a 4-row prefill block at the end of the context.
        let n_keys = [32765, 32766, 32767, 32768];
        let q = queries(&mut rng, 4, row, 1.5);
        let (res, serial) = run_serial(pool, n_heads, &q, &n_keys, &table, Some(520));
        res.unwrap();
        let keys: Vec<_> = n_keys.iter().map(|&nk| nk - 520..nk).collect();
        let want = exact(pool, n_heads, &table, &q, &keys);
        for (g, w) in serial.iter().zip(&want) {
            assert!((*g as f64 - w).abs() < 0.01, "{g} vs {w}");
        }
        for exec in [
            crate::flash::Exec::Parallel,
            crate::flash::Exec::ParallelSplit,
        ] {
            let mut out = vec![0f32; q.len()];
            let mut jobs = [AttnJob {
                q: &q,
                n_keys: &n_keys,
                table: &table,
                out: &mut out,
                window: Some(520),
            }];
            assert!(crate::flash::run(pool, n_heads, &mut jobs, exec)[0].is_ok());
            assert_eq!(bits(&out), bits(&serial), "{exec:?}");
        }
    }

    #[test]
    #[should_panic(expected = "window must be at least 1")]
    fn a_window_of_zero_keys_is_refused() {
        let f = fixture(smollm_layout(16), 1, 4, 0, 28);
        let _ = run_serial(f.pool(0), 3, &[0.0; 192], &[4], &f.table, Some(0));
    }
}
