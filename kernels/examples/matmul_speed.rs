//! Speed of the quantized matmul alone, for kernel work (not a benchmark of
//! record: `tessera bench` is). One `[rows, cols]` weight matrix of random blocks
//! in `FORMAT` (`q4_0`, `q4_1`, `q8_0`) against `N` activation rows, on the
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
    let blocks = rows * cols / 32;
    let mut bytes = Vec::new();
    for _ in 0..blocks {
        let d = f16::from_f32(0.01 + (rnd() % 100) as f32 * 1e-4).to_le_bytes();
        match format.as_str() {
            "q4_0" | "q4_1" => {
                bytes.extend(d);
                if format == "q4_1" {
                    bytes.extend(f16::from_f32(-0.05).to_le_bytes());
                }
                bytes.extend((0..16).map(|_| rnd() as u8));
            }
            "q8_0" => {
                bytes.extend(d);
                bytes.extend((0..32).map(|_| rnd() as u8));
            }
            f => panic!("format {f}: q4_0, q4_1 or q8_0"),
        }
    }
    let w = match format.as_str() {
        "q4_0" => QMatrix::from_q4_0_bytes(&bytes, rows, cols),
        "q4_1" => QMatrix::from_q4_1_bytes(&bytes, rows, cols),
        _ => QMatrix::from_q8_0_bytes(&bytes, rows, cols),
    }
    .expect("matrix");
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
