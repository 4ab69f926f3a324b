//! Speed of the quantized matmul per weight format against `Q8_0`, for kernel work
//! (not a benchmark of record: `tessera bench` is). For every format, `COPIES`
//! random `[rows, cols]` matrices (enough that they do not fit in the caches, as a
//! model's weights do not) are multiplied in turn by `N` activation rows, at batch
//! 1 (GEMV: decode) and 16, the formats interleaved so a disturbance of the shared
//! machine hits them alike:
//! `cargo run --release -p tessera-kernels --example format_speed -- 896 4864 24`
//! (the default: Qwen2.5 0.5B's `ffn_down`, `[896, 4864]`; `cols` must be a multiple
//! of 256 for the K formats).
//!
//! Prints one JSON line per format and batch: the best of 15 passes (the least
//! disturbed) as milliseconds per matrix, the weight bytes read per second (from
//! [`QMatrix::weight_bytes`]: the repacked size) and the speed relative to `Q8_0`
//! (`Q8_0`'s time / this format's time, same run).

use std::time::Instant;
use tessera_kernels::quant::{QFormat, QK};
use tessera_kernels::{Activations, QMatrix};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let arg = |i: usize, d: usize| args.get(i).map_or(d, |a| a.parse().expect("number"));
    let (rows, cols, copies) = (arg(0, 896), arg(1, 4864), arg(2, 24));
    let mut x = 0x2545_f491u32;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x
    };
    let formats = [
        QFormat::Q8_0,
        QFormat::Q4_0,
        QFormat::Q4_1,
        QFormat::Q5_0,
        QFormat::Q4K,
        QFormat::Q5K,
        QFormat::Q6K,
    ];
    let mats: Vec<Vec<QMatrix>> = formats
        .iter()
        .map(|&f| {
            (0..copies)
                .map(|_| {
                    let blocks = rows * cols / f.block_values();
                    let mut bytes: Vec<u8> =
                        (0..blocks * f.block_bytes()).map(|_| rnd() as u8).collect();
                    // Sane f16 scales (0.01..0.02) where the format keeps them.
                    let halves: &[usize] = match f {
                        QFormat::Q4_1 | QFormat::Q4K | QFormat::Q5K => &[0, 2],
                        QFormat::Q6K => &[208],
                        _ => &[0],
                    };
                    for blk in bytes.chunks_exact_mut(f.block_bytes()) {
                        for &at in halves {
                            let d = half::f16::from_f32(0.01 + (rnd() % 100) as f32 * 1e-4);
                            blk[at..at + 2].copy_from_slice(&d.to_le_bytes());
                        }
                    }
                    QMatrix::from_gguf_bytes(f, &bytes, rows, cols).expect("matrix")
                })
                .collect()
        })
        .collect();
    assert!(cols.is_multiple_of(QK));
    let threads = tessera_kernels::pool::global().threads();
    for n in [1usize, 16] {
        let xs: Vec<f32> = (0..n * cols)
            .map(|_| (rnd() % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        let act = Activations::new(&xs, n, cols);
        let mut out = vec![0f32; n * rows];
        let mut best = vec![f64::INFINITY; formats.len()];
        for pass in 0..16 {
            for (ms, b) in mats.iter().zip(best.iter_mut()) {
                let t = Instant::now();
                for m in ms {
                    m.matmul(&act, &mut out);
                }
                let s = t.elapsed().as_secs_f64() / copies as f64;
                // The first pass warms up (page faults, pool start).
                if pass > 0 {
                    *b = b.min(s);
                }
            }
        }
        for ((f, ms), &s) in formats.iter().zip(&mats).zip(&best) {
            let bytes = ms[0].weight_bytes();
            println!(
                "{{\"format\":\"{}\",\"rows\":{rows},\"cols\":{cols},\"n\":{n},\"threads\":{threads},\"bits_per_weight\":{:.4},\"best_ms\":{:.4},\"gb_s\":{:.2},\"speed_vs_q8_0\":{:.3}}}",
                f.name(),
                (bytes * 8) as f64 / (rows * cols) as f64,
                s * 1e3,
                bytes as f64 / s / 1e9,
                best[0] / s
            );
        }
    }
}
