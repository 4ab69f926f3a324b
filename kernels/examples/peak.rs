//! The arithmetic ceilings of this machine's cores, for the "distance to the
//! limits" in docs/benchmarks.md (../shared/BENCHMARKS.md asks which limit applies
//! and how far a figure is from it; the VM exposes no cycle counters, so the
//! ceiling is measured rather than looked up).
//!
//! Each figure is one instruction repeated over 16 independent zmm accumulators
//! (enough to hide its latency), on 1 thread and on all threads at once:
//! - `vpdpbusd`: 64 u8 x i8 multiply-adds (weights x activations in the matmuls);
//! - `vpdpwssd`: 32 i16 x i16 multiply-adds (queries x keys in attention);
//! - `vfmadd231ps`: 16 f32 multiply-adds.
//!
//! `cargo run --release -p tessera-kernels --example peak` prints JSON lines:
//! `{"op", "threads", "g_instr_s", "g_mac_s"}` (totals over the threads, per second
//! of wall time, best of 5 runs of 0.2 s). x86-64 with AVX-512 VNNI only.

use std::time::{Duration, Instant};

#[cfg(target_arch = "x86_64")]
mod ops {
    use std::arch::x86_64::*;

    macro_rules! chains {
        ($name:ident, $ty:ty, $zero:expr, $op:expr) => {
            /// Runs `iters` rounds of 16 independent instructions; the caller
            /// black-boxes the accumulators so nothing is optimized away.
            #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
            pub(crate) unsafe fn $name(iters: u64, a: $ty, b: $ty) -> [$ty; 16] {
                let mut acc = [$zero; 16];
                for _ in 0..iters {
                    for x in acc.iter_mut() {
                        *x = $op(*x, a, b);
                    }
                }
                acc
            }
        };
    }

    chains!(dpbusd, __m512i, _mm512_setzero_si512(), |x, a, b| {
        _mm512_dpbusd_epi32(x, a, b)
    });
    chains!(dpwssd, __m512i, _mm512_setzero_si512(), |x, a, b| {
        _mm512_dpwssd_epi32(x, a, b)
    });
    chains!(fma, __m512, _mm512_setzero_ps(), |x, a, b| {
        _mm512_fmadd_ps(a, b, x)
    });

    /// `(name, multiply-adds per instruction, run)`.
    pub(crate) type Op = (&'static str, u64, fn(u64));

    /// The measured instructions.
    pub(crate) fn all() -> [Op; 3] {
        // SAFETY (each closure): `main` checked the CPU features first.
        [
            ("vpdpbusd", 64, |n| {
                std::hint::black_box(unsafe {
                    dpbusd(n, _mm512_set1_epi8(3), _mm512_set1_epi8(-2))
                });
            }),
            ("vpdpwssd", 32, |n| {
                std::hint::black_box(unsafe {
                    dpwssd(n, _mm512_set1_epi16(3), _mm512_set1_epi16(-2))
                });
            }),
            ("vfmadd231ps", 16, |n| {
                std::hint::black_box(unsafe { fma(n, _mm512_set1_ps(1.0), _mm512_set1_ps(1e-9)) });
            }),
        ]
    }
}

#[cfg(target_arch = "x86_64")]
fn main() {
    if !(is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni"))
    {
        eprintln!("peak: needs AVX-512 VNNI");
        std::process::exit(2);
    }
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (name, macs, run) in ops::all() {
        // Calibrate iterations to ~0.2 s on one thread.
        let mut iters = 1u64 << 16;
        loop {
            let t = Instant::now();
            run(iters);
            if t.elapsed() > Duration::from_millis(50) {
                iters = (iters as f64 * 0.2 / t.elapsed().as_secs_f64()) as u64;
                break;
            }
            iters *= 4;
        }
        for n in [1, threads] {
            let best = (0..5)
                .map(|_| {
                    let t = Instant::now();
                    std::thread::scope(|s| {
                        for _ in 0..n {
                            s.spawn(|| run(iters));
                        }
                    });
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min);
            let instr = (n as u64 * iters * 16) as f64 / best / 1e9;
            println!(
                "{}",
                serde_like(name, n, instr, instr * macs as f64) // one JSON line
            );
        }
    }
}

/// One JSON line (the crate has no serde_json; the fields are plain numbers).
fn serde_like(op: &str, threads: usize, g_instr_s: f64, g_mac_s: f64) -> String {
    format!(
        "{{\"op\":\"{op}\",\"threads\":{threads},\"g_instr_s\":{g_instr_s:.2},\"g_mac_s\":{g_mac_s:.1}}}"
    )
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    eprintln!("peak: x86-64 only");
    std::process::exit(2);
}
