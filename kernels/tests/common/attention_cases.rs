//! The reference table of paged-attention cases that the CPU kernel
//! (`tests/attention_reference.rs`) and the CUDA kernel (`tests/cuda_kernels.rs`)
//! both run, and what each must produce: per sequence, either the exact softmax
//! attention (computed here in f64 over the values stored in the pages) or a tag
//! failure at a given logical block, with the other sequences unaffected.
//!
//! A fixture is a pool of pages shared by several sequences, their pages
//! interleaved and in no particular physical order, with random K/V written through
//! `KvLayout::write_token` in every layer and the rest of each page left at a stale
//! byte (0xFF makes stale scales NaN: a kernel that reads past its keys or
//! multiplies a stale scale by zero produces NaN).
#![allow(dead_code, unreachable_pub)] // each test crate uses part of it

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tessera_kernels::{BlockRef, KvLayout, PageTag};

/// One sequence of a case: keys filled, and the key count of each query row.
#[derive(Clone, Debug)]
pub struct SeqCase {
    /// Tokens whose K/V are in the pages.
    pub keys: usize,
    /// Query rows: row `i` attends to keys `0..rows[i]` (each `<= keys`).
    pub rows: Vec<usize>,
}

/// A block-table fault planted in a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Every table matches the pool.
    None,
    /// Sequence `seq`'s entry for logical block `block` names a page of sequence
    /// `owner` (keeping the tag `seq` expects): the pool's tag differs.
    ForeignPage {
        /// Victim sequence (index in the case).
        seq: usize,
        /// Its logical block pointed elsewhere.
        block: usize,
        /// Sequence whose page it names.
        owner: usize,
    },
    /// The pool's tag of sequence `seq`'s logical block `block` has a newer epoch
    /// (the page was freed and reallocated since the table was made).
    StaleEpoch {
        /// Sequence.
        seq: usize,
        /// Logical block.
        block: usize,
    },
}

/// One case of the table.
#[derive(Clone, Debug)]
pub struct Case {
    /// Name in failure messages.
    pub name: &'static str,
    /// Page shape (`layers` 2; the case reads layer 1).
    pub layout: KvLayout,
    /// Query heads (a multiple of `kv_heads`).
    pub n_heads: usize,
    /// The sequences sharing the pool.
    pub seqs: Vec<SeqCase>,
    /// Byte of never-written slots.
    pub stale: u8,
    /// Seed of the values.
    pub seed: u64,
    /// Planted fault.
    pub fault: Fault,
}

fn layout(page_size: usize, kv_heads: usize, head_dim: usize) -> KvLayout {
    KvLayout {
        layers: 2,
        page_size,
        kv_heads,
        head_dim,
    }
}

fn decode(keys: usize) -> SeqCase {
    SeqCase {
        keys,
        rows: vec![keys],
    }
}

/// The table. Shapes the CUDA kernel supports (`head_dim` a multiple of 32 up to
/// 256, at most 32 query heads per KV head) and the CPU kernel supports (any page
/// size, `head_dim` a multiple of 4).
pub fn cases() -> Vec<Case> {
    let smollm = layout(16, 3, 64);
    vec![
        Case {
            name: "decode_batch_gqa_smollm_shape",
            layout: smollm,
            n_heads: 9,
            seqs: vec![decode(700), decode(37), decode(1), decode(512), decode(513)],
            stale: 0xFF,
            seed: 1,
            fault: Fault::None,
        },
        Case {
            name: "prefill_chunk_across_pages_and_chunks_beside_a_decode_row",
            layout: smollm,
            n_heads: 9,
            seqs: vec![
                SeqCase {
                    keys: 600,
                    rows: (561..=600).collect(),
                },
                decode(1000),
                SeqCase {
                    keys: 40,
                    rows: (1..=40).collect(),
                },
            ],
            stale: 0x5A,
            seed: 2,
            fault: Fault::None,
        },
        Case {
            name: "page_size_6_not_a_multiple_of_4",
            layout: layout(6, 3, 64),
            n_heads: 9,
            seqs: vec![
                decode(97),
                SeqCase {
                    keys: 20,
                    rows: vec![1, 5, 6, 7, 12, 13, 20],
                },
            ],
            stale: 0xFF,
            seed: 3,
            fault: Fault::None,
        },
        Case {
            name: "page_size_8_head_dim_128_one_query_head_per_kv_head",
            layout: layout(8, 2, 128),
            n_heads: 2,
            seqs: vec![decode(300), decode(9)],
            stale: 0xFF,
            seed: 4,
            fault: Fault::None,
        },
        Case {
            name: "page_size_32_head_dim_32_eight_query_heads_per_kv_head",
            layout: layout(32, 1, 32),
            n_heads: 8,
            seqs: vec![decode(100), decode(64), decode(65)],
            stale: 0xFF,
            seed: 5,
            fault: Fault::None,
        },
        Case {
            name: "a_foreign_page_fails_only_its_sequence",
            layout: smollm,
            n_heads: 9,
            seqs: vec![decode(100), decode(80), decode(50)],
            stale: 0xFF,
            seed: 6,
            fault: Fault::ForeignPage {
                seq: 0,
                block: 2,
                owner: 1,
            },
        },
        Case {
            name: "a_stale_epoch_fails_only_its_sequence",
            layout: smollm,
            n_heads: 9,
            seqs: vec![
                decode(100),
                SeqCase {
                    keys: 48,
                    rows: (33..=48).collect(),
                },
                decode(7),
            ],
            stale: 0xFF,
            seed: 7,
            fault: Fault::StaleEpoch { seq: 1, block: 0 },
        },
    ]
}

/// The tag sequence `s` of a case expects on logical block `b` (tenant 10 + s,
/// sequence id 100 + s, epoch 3 + s).
pub fn tag(s: usize, b: usize) -> PageTag {
    PageTag {
        tenant: 10 + s as u64,
        seq: 100 + s as u64,
        epoch: 3 + s as u32,
        logical_block: b as u32,
    }
}

/// K and V of one token in one layer: `(k, v)`, `[kv_dim]` each.
pub type TokenKv = (Vec<f32>, Vec<f32>);

/// A case's pool, tables and queries, built on the host.
pub struct Fixture {
    /// The case.
    pub case: Case,
    /// Pool bytes (`pages * page_bytes`).
    pub data: Vec<u8>,
    /// The pool's tag array.
    pub tags: Vec<PageTag>,
    /// Block table per sequence (faults applied).
    pub tables: Vec<Vec<BlockRef>>,
    /// K and V written, per sequence, token and layer.
    pub kv: Vec<Vec<Vec<TokenKv>>>,
    /// Queries per sequence: `[rows, n_heads * head_dim]`.
    pub q: Vec<Vec<f32>>,
}

/// The layer every case reads.
pub const LAYER: usize = 1;

impl Fixture {
    /// Builds case `c`: physical pages handed out round-robin between the
    /// sequences, in reverse, so no table is in physical order.
    pub fn new(c: &Case) -> Self {
        let l = c.layout;
        let mut rng = ChaCha8Rng::seed_from_u64(c.seed);
        let need: Vec<usize> = c
            .seqs
            .iter()
            .map(|s| s.keys.div_ceil(l.page_size))
            .collect();
        let total: usize = need.iter().sum();
        // Round-robin assignment of logical blocks to physical pages.
        let mut order = Vec::new();
        let mut b = 0;
        while order.len() < total {
            for (s, &n) in need.iter().enumerate() {
                if b < n {
                    order.push((s, b));
                }
            }
            b += 1;
        }
        let mut tables: Vec<Vec<BlockRef>> = need.iter().map(|&n| Vec::with_capacity(n)).collect();
        let mut tags = vec![PageTag::default(); total];
        for (i, &(s, b)) in order.iter().enumerate() {
            let page = (total - 1 - i) as u32;
            tags[page as usize] = tag(s, b);
            tables[s].push(BlockRef {
                page,
                tag: tag(s, b),
            });
        }
        for t in &mut tables {
            t.sort_by_key(|e| e.tag.logical_block);
        }
        let pb = l.page_bytes();
        let mut data = vec![c.stale; total * pb];
        let kvd = l.kv_dim();
        let mut kv = Vec::new();
        for (s, sc) in c.seqs.iter().enumerate() {
            let mut toks = Vec::new();
            for t in 0..sc.keys {
                let p = tables[s][t / l.page_size].page as usize;
                let mut layers = Vec::new();
                for layer in 0..l.layers {
                    let k: Vec<f32> = (0..kvd).map(|_| rng.random_range(-2.0..2.0)).collect();
                    let v: Vec<f32> = (0..kvd).map(|_| rng.random_range(-1.0..1.0)).collect();
                    l.write_token(
                        &mut data[p * pb..(p + 1) * pb],
                        layer,
                        t % l.page_size,
                        &k,
                        &v,
                    );
                    layers.push((k, v));
                }
                toks.push(layers);
            }
            kv.push(toks);
        }
        let row = c.n_heads * l.head_dim;
        let q = c
            .seqs
            .iter()
            .map(|sc| {
                (0..sc.rows.len() * row)
                    .map(|_| rng.random_range(-1.5..1.5))
                    .collect()
            })
            .collect();
        match c.fault {
            Fault::None => {}
            Fault::ForeignPage { seq, block, owner } => {
                tables[seq][block].page = tables[owner][0].page;
            }
            Fault::StaleEpoch { seq, block } => {
                tags[tables[seq][block].page as usize].epoch += 1;
            }
        }
        Self {
            case: c.clone(),
            data,
            tags,
            tables,
            kv,
            q,
        }
    }

    /// What sequence `s` must give: `Err(logical block)` of the planted fault, or
    /// the exact attention of each of its rows (`[rows, n_heads * head_dim]`,
    /// f64 softmax over the dequantized page values, scale `1/sqrt(head_dim)`).
    pub fn expected(&self, s: usize) -> Result<Vec<f64>, u32> {
        self.expected_in_window(s, None)
    }

    /// [`Self::expected`] with a sliding window: row `i` attends to keys
    /// `rows[i].saturating_sub(w)..rows[i]` (`AttnJob::window`). A planted fault
    /// fails the sequence only when its block holds a key some row attends to
    /// (the pages read are the pages checked).
    pub fn expected_in_window(&self, s: usize, window: Option<usize>) -> Result<Vec<f64>, u32> {
        let ps = self.case.layout.page_size;
        let keys = |nk: usize| window.map_or(0, |w| nk.saturating_sub(w))..nk;
        match self.case.fault {
            Fault::ForeignPage { seq, block, .. } | Fault::StaleEpoch { seq, block }
                if seq == s
                    && self.case.seqs[s].rows.iter().any(|&nk| {
                        let k = keys(nk);
                        k.start / ps <= block && block < k.end.div_ceil(ps)
                    }) =>
            {
                return Err(block as u32);
            }
            _ => {}
        }
        let (l, nh) = (self.case.layout, self.case.n_heads);
        let (hd, group) = (l.head_dim, nh / l.kv_heads);
        let pb = l.page_bytes();
        let read = |t: usize, g: usize, v: bool| {
            let p = self.tables[s][t / l.page_size].page as usize;
            l.read_token(
                &self.data[p * pb..(p + 1) * pb],
                LAYER,
                g,
                t % l.page_size,
                v,
            )
        };
        let row = nh * hd;
        let mut out = vec![0f64; self.case.seqs[s].rows.len() * row];
        for (i, &nk) in self.case.seqs[s].rows.iter().enumerate() {
            for h in 0..nh {
                let g = h / group;
                let q = &self.q[s][i * row + h * hd..i * row + (h + 1) * hd];
                let sc: Vec<f64> = keys(nk)
                    .map(|t| {
                        let k = read(t, g, false);
                        q.iter()
                            .zip(&k)
                            .map(|(a, b)| *a as f64 * *b as f64)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let mx = sc.iter().cloned().fold(f64::MIN, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                let o = &mut out[i * row + h * hd..i * row + (h + 1) * hd];
                for (t, et) in keys(nk).zip(&e) {
                    let v = read(t, g, true);
                    for (od, vd) in o.iter_mut().zip(&v) {
                        *od += et / z * *vd as f64;
                    }
                }
            }
        }
        Ok(out)
    }
}

/// Largest |got - want| over a sequence's outputs; panics on a NaN.
pub fn max_abs_error(name: &str, s: usize, got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len(), "{name}: sequence {s} output length");
    got.iter()
        .zip(want)
        .map(|(g, w)| {
            assert!(
                g.is_finite(),
                "{name}: sequence {s} has a non-finite output"
            );
            (*g as f64 - w).abs()
        })
        .fold(0.0, f64::max)
}
