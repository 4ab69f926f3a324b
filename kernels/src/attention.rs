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
}
