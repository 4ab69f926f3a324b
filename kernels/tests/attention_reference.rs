//! The CPU paged attention on the shared reference table
//! (`tests/common/attention_cases.rs`, also run by the CUDA kernel in
//! `tests/cuda_kernels.rs`): exact attention within the 8-bit kernel's tolerance,
//! and a planted tag fault failing exactly its sequence.

#[path = "common/attention_cases.rs"]
mod attention_cases;

use attention_cases::{cases, max_abs_error, Fixture, LAYER};
use tessera_kernels::{paged_attention_jobs, AttnJob, PoolKv};

/// Largest |CPU - exact| accepted: the CPU kernel quantizes queries to 8 bits
/// and probability weights to 16 bits (`flash.rs`); measured up to 0.005, values in [-1, 1]. A wrong
/// key, scale or softmax is off by 0.1 or more.
const CPU_TOL: f64 = 0.01;

#[test]
fn cpu_attention_matches_the_reference_table() {
    for c in cases() {
        let f = Fixture::new(&c);
        let row = c.n_heads * c.layout.head_dim;
        let mut outs: Vec<Vec<f32>> = c
            .seqs
            .iter()
            .map(|s| vec![7f32; s.rows.len() * row])
            .collect();
        let mut jobs: Vec<AttnJob> = outs
            .iter_mut()
            .enumerate()
            .map(|(s, out)| AttnJob {
                q: &f.q[s],
                n_keys: &c.seqs[s].rows,
                table: &f.tables[s],
                out,
            })
            .collect();
        let pool = PoolKv {
            layout: &c.layout,
            data: &f.data,
            tags: &f.tags,
            layer: LAYER,
        };
        let results = paged_attention_jobs(pool, c.n_heads, &mut jobs);
        for (s, res) in results.into_iter().enumerate() {
            match (f.expected(s), res) {
                (Ok(want), Ok(())) => {
                    let err = max_abs_error(c.name, s, &outs[s], &want);
                    eprintln!("{}: sequence {s}: max |cpu - exact| {err:.5}", c.name);
                    assert!(err < CPU_TOL, "{}: sequence {s} is off by {err}", c.name);
                }
                (Err(block), Err(e)) => {
                    assert_eq!(e.logical_block, block, "{}: sequence {s}", c.name);
                    assert!(
                        outs[s].iter().all(|v| *v == 0.0),
                        "{}: failed output",
                        c.name
                    );
                }
                (want, got) => panic!(
                    "{}: sequence {s}: expected {:?}, got {got:?}",
                    c.name,
                    want.map(|_| "output")
                ),
            }
        }
    }
}
