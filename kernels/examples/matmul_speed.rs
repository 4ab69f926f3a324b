//! Speed of the quantized matmul alone, for kernel work (not a benchmark of
//! record: `tessera bench` is). One `[rows, cols]` weight matrix of random blocks
//! in `FORMAT` (`q4_0`, `q4_1`, `q8_0`, `q5_0`, `q4_k`, `q5_k`, `q6_k`) against `N` activation rows, on the
//! global pool (`TESSERA_THREADS` sets its size):
//! `cargo run --release -p tessera-kernels --example matmul_speed -- q4_1 1536 576 512`
//! (the default: the default model's gate projection over a 512-token chunk).
//!
//! Prints one JSON line: the best of 30 runs (the least disturbed by other work on
//! a shared machine) as milliseconds and as billions of multiply-adds per second,
//! and, for comparison with `cargo run --release -p tessera-kernels --example
//! peak`, the same per thread.

use half::f16;
use std::time::Instant;
use tessera_kernels::quant::QFormat;
use tessera_kernels::{Activations, QMatrix};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, d: usize| args.get(i).map_or(d, |a| a.parse().expect("number"));
    let format = args.first().map_or("q4_1", String::as_str).to_owned();
    let (rows, cols, n) = (arg(1, 1536), arg(2, 576), arg(3, 512));
    let mut x = 0x2545_f491u32;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    let qf = match format.as_str() {
        "q4_0" => QFormat::Q4_0,
        "q4_1" => QFormat::Q4_1,
        "q8_0" => QFormat::Q8_0,
        "q5_0" => QFormat::Q5_0,
        "q4_k" => QFormat::Q4K,
        "q5_k" => QFormat::Q5K,
        "q6_k" => QFormat::Q6K,
        f => panic!("format {f}: q4_0, q4_1, q8_0, q5_0, q4_k, q5_k or q6_k"),
    };
    let blocks = rows * cols / qf.block_values();
    let mut bytes = Vec::new();
    for _ in 0..blocks {
        let d = f16::from_f32(0.01 + (rnd() % 100) as f32 * 1e-4).to_le_bytes();
        let start = bytes.len();
        match qf {
            // Q6_K keeps its f16 d last.
            QFormat::Q6K => {
                bytes.extend((0..208).map(|_| rnd() as u8));
                bytes.extend(f16::from_f32(0.001).to_le_bytes());
            }
            QFormat::Q4K | QFormat::Q5K => {
                bytes.extend(f16::from_f32(0.002).to_le_bytes());
                bytes.extend(f16::from_f32(0.001).to_le_bytes());
            }
            _ => {
                bytes.extend(d);
                if qf == QFormat::Q4_1 {
                    bytes.extend(f16::from_f32(-0.05).to_le_bytes());
                }
            }
        }
        let rest = qf.block_bytes() - (bytes.len() - start);
        bytes.extend((0..rest).map(|_| rnd() as u8));
    }
    let w = QMatrix::from_gguf_bytes(qf, &bytes, rows, cols).expect("matrix");
    let xs: Vec<f32> = (0..n * cols)
        .map(|_| (rnd() % 2001) as f32 / 1000.0 - 1.0)
        .collect();
    let act = Activations::new(&xs, n, cols);
    let mut out = vec![0f32; n * rows];
    w.matmul(&act, &mut out);
    let best = (0..30)
        .map(|_| {
            let t = Instant::now();
            w.matmul(&act, &mut out);
            t.elapsed().as_secs_f64()
        })
        .fold(f64::INFINITY, f64::min);
    let threads = tessera_kernels::pool::global().threads();
    let gmac = (rows * cols * n) as f64 / best / 1e9;
    println!(
        "{{\"format\":\"{format}\",\"rows\":{rows},\"cols\":{cols},\"n\":{n},\"threads\":{threads},\"best_ms\":{:.3},\"g_mac_s\":{gmac:.1},\"g_mac_s_per_thread\":{:.1}}}",
        best * 1e3,
        gmac / threads as f64
    );
}
