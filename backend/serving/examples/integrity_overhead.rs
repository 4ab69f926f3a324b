//! What the integrity checks cost end to end: page-tag checks on every KV read and
//! write (I3) plus the transfer's CRC-32C page checksums on both sides (I4), as a
//! ratio of disaggregated (prefill + decode, in-process transfer) output throughput
//! with the checks on vs off, in the same process.
//!
//! ```sh
//! cargo run --release -p tessera-serving --example integrity_overhead -- [BLOCKS] [REQUESTS] [MAX_TOKENS]
//! ```
//!
//! Each block runs on, off, off, on (the next block mirrors the order: off, on, on,
//! off), so a drift of the machine's speed during a block, or a bias of the first run
//! after a switch, weighs on both sides alike. A block's ratio is its on-throughput
//! over its off-throughput (two runs each); the summary gives the mean ratio over the
//! blocks with a 95 % confidence interval (Student's t, BLOCKS - 1 degrees of freedom).
//! Prints one JSON line per run and a summary line. The checks are never off in a
//! server; this is the only caller of the switch.

mod bench_common;

use bench_common::{chat_ids, load_model, run, spawn_pd};
use std::time::Instant;
use tessera_engine::GenerateRequest;
use tessera_kernels::attention::set_integrity_checks_for_benchmark;

const PROMPTS: [&str; 8] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten year old in two sentences.",
    "List three primary colors.",
    "Translate 'good morning' into Spanish, French and German.",
    "What is 12 times 7?",
    "Give me a short, friendly greeting for a birthday card.",
    "Describe a lighthouse at night.",
];

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("ROUNDS REQUESTS MAX_TOKENS are numbers"))
        .collect();
    let rounds = args.first().copied().unwrap_or(8);
    let requests = args.get(1).copied().unwrap_or(16);
    let max_tokens = args.get(2).copied().unwrap_or(64);
    let model = load_model();
    let h = spawn_pd(&model);
    let reqs: Vec<GenerateRequest> = (0..requests)
        .map(|i| GenerateRequest {
            ignore_eos: true,
            ..GenerateRequest::new(
                1 + i as u64 % 4,
                chat_ids(&model, PROMPTS[i % PROMPTS.len()]),
                max_tokens,
            )
        })
        .collect();
    // Warm-up (page faults, thread pool).
    run(&h, &reqs[..2]);
    let blocks = rounds.max(2);
    let (mut on, mut off, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for block in 0..blocks {
        let order = if block % 2 == 0 {
            [true, false, false, true]
        } else {
            [false, true, true, false]
        };
        let (mut sum_on, mut sum_off) = (0.0, 0.0);
        for checks in order {
            set_integrity_checks_for_benchmark(checks);
            let tps = run(&h, &reqs);
            println!(
                "{{\"block\": {block}, \"checks\": {checks}, \"requests\": {requests}, \"max_tokens\": {max_tokens}, \"output_tok_per_s\": {tps:.1}}}"
            );
            if checks {
                sum_on += tps;
                on.push(tps);
            } else {
                sum_off += tps;
                off.push(tps);
            }
        }
        ratios.push(sum_on / sum_off);
    }
    set_integrity_checks_for_benchmark(true);
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (m_on, m_off) = (median(&mut on), median(&mut off));
    let n = ratios.len() as f64;
    let mean = ratios.iter().sum::<f64>() / n;
    let sd = (ratios.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
    let half = t_975(ratios.len() - 1) * sd / n.sqrt();
    // The checksums' share, measured directly: every prompt page is checksummed
    // twice (prefill over the source bytes, decode over the landed bytes).
    let layout = model.transformer.config().kv_layout(16);
    let page = vec![0x5au8; layout.page_bytes()];
    let samples = 2000;
    let t = Instant::now();
    let mut acc = 0u32;
    for _ in 0..samples {
        acc ^= tessera_transfer::checksum::page_checksum(std::hint::black_box(&page));
    }
    let per_page = t.elapsed().as_secs_f64() / samples as f64;
    std::hint::black_box(acc);
    let pages: usize = reqs.iter().map(|r| 2 * r.prompt.len().div_ceil(16)).sum();
    let run_s = (requests * max_tokens) as f64 / m_on;
    println!(
        "{{\"summary\": true, \"blocks\": {blocks}, \"median_on\": {m_on:.1}, \"median_off\": {m_off:.1}, \"on_over_off_mean\": {mean:.4}, \"on_over_off_ci95\": [{:.4}, {:.4}], \"cost_percent\": {:.2}, \"crc_us_per_page\": {:.1}, \"crc_gb_per_s\": {:.1}, \"checksummed_pages_per_run\": {pages}, \"crc_share_of_run_percent\": {:.3}}}",
        mean - half,
        mean + half,
        (1.0 - mean) * 100.0,
        per_page * 1e6,
        page.len() as f64 / per_page / 1e9,
        pages as f64 * per_page / run_s * 100.0
    );
}

/// The 97.5 % quantile of Student's t distribution with `df` degrees of freedom
/// (two-sided 95 % interval), from the standard table; 1.96 beyond 30.
fn t_975(df: usize) -> f64 {
    const T: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160,
        2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056,
        2.052, 2.048, 2.045, 2.042,
    ];
    T.get(df.max(1) - 1).copied().unwrap_or(1.96)
}
