//! The CPU paged attention on the shared reference table
//! (`tests/common/attention_cases.rs`, also run by the CUDA kernel in
//! `tests/cuda_kernels.rs`): exact attention within the 8-bit kernel's tolerance,
//! and a planted tag fault failing exactly its sequence; then the same table
//! with sliding windows (CPU only: the CUDA kernel refuses windows), where a
//! fault fails its sequence only if the faulted page is inside some window.

#[path = "common/attention_cases.rs"]
mod attention_cases;

use attention_cases::{cases, max_abs_error, Fixture, LAYER};
use tessera_kernels::{paged_attention_jobs, AttnJob, PoolKv};

/// Largest |CPU - exact| accepted: the CPU kernel quantizes queries to 8 bits
/// and probability weights to 16 bits (`flash.rs`); measured up to 0.005, values in [-1, 1]. A wrong
/// key, scale or softmax is off by 0.1 or more.
const CPU_TOL: f64 = 0.01;

/// Runs every case of the table with `window` and checks each sequence against
/// [`Fixture::expected_in_window`].
fn check_table(window: Option<usize>) {
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
                window,
            })
            .collect();
        let pool = PoolKv {
            layout: &c.layout,
            data: &f.data,
            tags: &f.tags,
            layer: LAYER,
        };
        let results = paged_attention_jobs(pool, c.n_heads, &mut jobs);
        let name = format!("{} (window {window:?})", c.name);
        for (s, res) in results.into_iter().enumerate() {
            match (f.expected_in_window(s, window), res) {
                (Ok(want), Ok(())) => {
                    let err = max_abs_error(&name, s, &outs[s], &want);
                    eprintln!("{name}: sequence {s}: max |cpu - exact| {err:.5}");
                    assert!(err < CPU_TOL, "{name}: sequence {s} is off by {err}");
                }
                (Err(block), Err(e)) => {
                    assert_eq!(e.logical_block, block, "{name}: sequence {s}");
                    assert!(outs[s].iter().all(|v| *v == 0.0), "{name}: failed output");
                }
                (want, got) => panic!(
                    "{name}: sequence {s}: expected {:?}, got {got:?}",
                    want.map(|_| "output")
                ),
            }
        }
    }
}

#[test]
fn cpu_attention_matches_the_reference_table() {
    check_table(None);
}

#[test]
fn cpu_windowed_attention_matches_the_reference_table() {
    // One key; shorter than a page of 6, 8 or 16 and starting mid-page; two
    // pages of 16; the prefill rows' windows straddling the 512-key chunk line
    // (600 - 100); and wider than every sequence. The foreign page (block 2 of
    // a 100-key decode row) is below windows of up to 52 keys, the stale epoch
    // (block 0 of rows 33..=48) below windows of up to 17: each fault is
    // skipped by some windows here and fails its sequence under the others.
    for window in [1, 5, 20, 32, 100, 2000] {
        check_table(Some(window));
    }
}
