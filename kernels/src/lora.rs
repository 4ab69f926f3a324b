//! A LoRA delta, `scale * B (A x)` (Hu et al. 2021, arXiv:2106.09685; llama.cpp's
//! `llm_build_lora_mm`), for the rows of a batch that share one adapter:
//! [`LoraFactors::apply`].
//!
//! The factors are held in f16 (the type llama.cpp's `convert_lora_to_gguf.py`
//! writes by default; f32 files are rounded to nearest, a relative error of at most
//! 2^-11, and the adapter check already caps values at f16's largest, 65504): at 16
//! decoding rows under 8 rank-16 adapters on every projection of a 135M model, the
//! step reads 8 adapters' factors besides the model, and in f32 they were 1.6x the
//! model's bytes.
//!
//! Each row's arithmetic is fixed (the same fused multiply-adds in the same order
//! whatever the other rows are and whichever path runs), so a row's delta is
//! bit-identical alone, in any batch, and on either path. The portable path's
//! `mul_add` is one instruction on aarch64 and a library call on x86-64 without FMA
//! (where AVX2 is missing too, so it never runs on a machine worth serving from).

use crate::isa::{isa, Isa};
use half::f16;

/// Output columns a panel of B: 32 accumulators (four AVX2 registers) stay in
/// registers while the panel's `rank` rows of 32 (contiguous, in L1) are added.
const PANEL: usize = 32;

/// One adapter pair, packed: A as f16 `[rank, inputs]` row-major, B as f16 in
/// column panels (for each run of [`PANEL`] output columns, its `rank` rows of
/// `PANEL` values one after another; the last, narrower panel likewise).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraFactors {
    rank: usize,
    inputs: usize,
    outputs: usize,
    a: Vec<f16>,
    b: Vec<f16>,
}

impl LoraFactors {
    /// Packs `a` (`[rank, inputs]` row-major: the GGUF data of `lora_a`, `ne =
    /// [inputs, rank]`) and `b` (`[outputs, rank]` row-major: `lora_b`, `ne =
    /// [rank, outputs]`), each value rounded to the nearest f16.
    ///
    /// Panics when the lengths are not `rank * inputs` and `outputs * rank` or the
    /// rank is 0.
    pub fn new(rank: usize, inputs: usize, outputs: usize, a: &[f32], b: &[f32]) -> Self {
        assert!(rank > 0 && a.len() == rank * inputs && b.len() == outputs * rank);
        let mut packed = Vec::with_capacity(b.len());
        for c0 in (0..outputs).step_by(PANEL) {
            let width = PANEL.min(outputs - c0);
            for r in 0..rank {
                packed.extend((c0..c0 + width).map(|o| f16::from_f32(b[o * rank + r])));
            }
        }
        LoraFactors {
            rank,
            inputs,
            outputs,
            a: a.iter().map(|&v| f16::from_f32(v)).collect(),
            b: packed,
        }
    }

    /// Bytes held (2 per value).
    pub fn bytes(&self) -> usize {
        2 * (self.a.len() + self.b.len())
    }

    /// A's value at `[r, j]` as held (for references in tests).
    pub fn a_at(&self, r: usize, j: usize) -> f32 {
        self.a[r * self.inputs + j].to_f32()
    }

    /// B's value at `[o, r]` as held.
    pub fn b_at(&self, o: usize, r: usize) -> f32 {
        let c0 = o / PANEL * PANEL;
        let width = PANEL.min(self.outputs - c0);
        self.b[c0 * self.rank + r * width + (o - c0)].to_f32()
    }

    /// `outs[k][o] += scale * sum_r B[o, r] * t_k[r]` with `t_k[r] = dot(A[r], xs[k])`,
    /// for every row `k`: `xs[k]` is `inputs` long, `outs[k]` is `outputs` long. The
    /// dot keeps 8 partial sums (lane `i` fuses in the products at `8c + i`), added
    /// lane 0 to 7, then fuses in the tail in order; B's sum starts from zero and fuses
    /// in `r = 0` up, then `scale` times it is fused into the output.
    ///
    /// Panics on other lengths.
    pub fn apply(&self, xs: &[&[f32]], scale: f32, outs: &mut [&mut [f32]]) {
        assert_eq!(xs.len(), outs.len());
        assert!(xs.iter().all(|x| x.len() == self.inputs));
        assert!(outs.iter().all(|o| o.len() == self.outputs));
        let mut t = vec![0f32; xs.len() * self.rank];
        #[cfg(target_arch = "x86_64")]
        if isa() != Isa::Scalar {
            // SAFETY: `isa()` found AVX2 and F16C; lengths checked above.
            unsafe {
                avx2::down(self, xs, &mut t);
                avx2::up(self, &t, scale, outs);
            }
            return;
        }
        self.down(xs, &mut t);
        self.up(&t, scale, outs);
    }

    /// `t[k * rank + r] = dot(A[r], xs[k])`, portable.
    fn down(&self, xs: &[&[f32]], t: &mut [f32]) {
        let (rank, inputs) = (self.rank, self.inputs);
        for r in 0..rank {
            let ar = &self.a[r * inputs..(r + 1) * inputs];
            for (k, x) in xs.iter().enumerate() {
                let mut acc = [0f32; 8];
                let (ac, xc) = (ar.chunks_exact(8), x.chunks_exact(8));
                let (at, xt) = (ac.remainder(), xc.remainder());
                for (a, x) in ac.zip(xc) {
                    for i in 0..8 {
                        acc[i] = a[i].to_f32().mul_add(x[i], acc[i]);
                    }
                }
                let mut s = lanes_sum(acc);
                for (a, x) in at.iter().zip(xt) {
                    s = a.to_f32().mul_add(*x, s);
                }
                t[k * rank + r] = s;
            }
        }
    }

    /// `outs[k] += scale * B t_k`, portable.
    fn up(&self, t: &[f32], scale: f32, outs: &mut [&mut [f32]]) {
        let rank = self.rank;
        for c0 in (0..self.outputs).step_by(PANEL) {
            let width = PANEL.min(self.outputs - c0);
            let panel = &self.b[c0 * rank..c0 * rank + rank * width];
            for (k, out) in outs.iter_mut().enumerate() {
                let mut acc = [0f32; PANEL];
                for r in 0..rank {
                    let tr = t[k * rank + r];
                    for (acc, b) in acc.iter_mut().zip(&panel[r * width..(r + 1) * width]) {
                        *acc = tr.mul_add(b.to_f32(), *acc);
                    }
                }
                for (y, acc) in out[c0..c0 + width].iter_mut().zip(acc) {
                    *y = scale.mul_add(acc, *y);
                }
            }
        }
    }
}

/// The 8 partial sums added lane 0 to 7 (both paths).
#[inline(always)]
fn lanes_sum(acc: [f32; 8]) -> f32 {
    let mut s = acc[0];
    for v in &acc[1..] {
        s += v;
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::{lanes_sum, LoraFactors, PANEL};
    use std::arch::x86_64::*;

    /// [`LoraFactors::down`] 8 lanes wide, up to four rows a pass over each A row
    /// (each A value is converted once for them).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn down(f: &LoraFactors, xs: &[&[f32]], t: &mut [f32]) {
        let (rank, inputs) = (f.rank, f.inputs);
        for r in 0..rank {
            let ar = &f.a[r * inputs..(r + 1) * inputs];
            // Adapters are read once a step from memory in short streams (one
            // projection's factors, tens of KB): ask for the row after next, and B's
            // first panel during the last rows, before the loads wait on them.
            if r + 2 < rank {
                prefetch(
                    f.a.as_ptr().wrapping_add((r + 2) * inputs).cast(),
                    2 * inputs,
                );
            } else {
                // May point past a B narrower than two panels: hence `wrapping_add`.
                let panel = (r + 2 - rank) * rank * PANEL;
                prefetch(f.b.as_ptr().wrapping_add(panel).cast(), 2 * rank * PANEL);
            }
            let mut k = 0;
            while k < xs.len() {
                let n = (xs.len() - k).min(4);
                let d = match n {
                    4 => dots::<4>(ar, &xs[k..k + 4]),
                    3 => pad(dots::<3>(ar, &xs[k..k + 3])),
                    2 => pad(dots::<2>(ar, &xs[k..k + 2])),
                    _ => pad(dots::<1>(ar, &xs[k..k + 1])),
                };
                for (q, v) in d.into_iter().take(n).enumerate() {
                    t[(k + q) * rank + r] = v;
                }
                k += n;
            }
        }
    }

    /// Asks the cache for `len` bytes from `at` (a hint: never faults).
    #[inline(always)]
    fn prefetch(at: *const u8, len: usize) {
        for line in (0..len).step_by(64) {
            // SAFETY: a prefetch does not access memory architecturally.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(line).cast()) };
        }
    }

    fn pad<const R: usize>(d: [f32; R]) -> [f32; 4] {
        let mut out = [0f32; 4];
        out[..R].copy_from_slice(&d);
        out
    }

    /// `dot(a, xs[q])` for `R` rows: 8 fused partial sums a row, added lane 0 to 7,
    /// then the tail fused in order (the portable path's arithmetic).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dots<const R: usize>(a: &[half::f16], xs: &[&[f32]]) -> [f32; R] {
        let inputs = a.len();
        let full = inputs / 8 * 8;
        let mut acc = [_mm256_setzero_ps(); R];
        for c in (0..full).step_by(8) {
            let a8 = _mm256_cvtph_ps(_mm_loadu_si128(a.as_ptr().add(c).cast()));
            for q in 0..R {
                acc[q] = _mm256_fmadd_ps(a8, _mm256_loadu_ps(xs[q].as_ptr().add(c)), acc[q]);
            }
        }
        let mut out = [0f32; R];
        for q in 0..R {
            let mut lanes = [0f32; 8];
            _mm256_storeu_ps(lanes.as_mut_ptr(), acc[q]);
            let mut s = lanes_sum(lanes);
            for j in full..inputs {
                s = a[j].to_f32().mul_add(xs[q][j], s);
            }
            out[q] = s;
        }
        out
    }

    /// [`LoraFactors::up`] 8 lanes wide for full panels, two rows at a time (eight
    /// independent accumulator chains keep both FMA ports busy); a panel is converted
    /// to f32 once for all rows. The narrower last panel runs the portable loop (the
    /// same arithmetic).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn up(f: &LoraFactors, t: &[f32], scale: f32, outs: &mut [&mut [f32]]) {
        let rank = f.rank;
        let full = f.outputs / PANEL * PANEL;
        let s = _mm256_set1_ps(scale);
        let mut panel = vec![0f32; rank * PANEL];
        for c0 in (0..full).step_by(PANEL) {
            let held = f.b.as_ptr().add(c0 * rank);
            if c0 + 2 * PANEL < f.outputs {
                let ahead = (c0 + 2 * PANEL) * rank;
                let len = PANEL.min(f.outputs - c0 - 2 * PANEL) * rank;
                prefetch(f.b.as_ptr().wrapping_add(ahead).cast(), 2 * len);
            }
            for (v, at) in panel.chunks_exact_mut(8).zip((0..).step_by(8)) {
                let b = _mm256_cvtph_ps(_mm_loadu_si128(held.add(at).cast()));
                _mm256_storeu_ps(v.as_mut_ptr(), b);
            }
            let mut k = 0;
            while k < outs.len() {
                let pair = k + 1 < outs.len();
                let mut acc = [[_mm256_setzero_ps(); 4]; 2];
                let (t0, t1) = (&t[k * rank..], &t[(k + pair as usize) * rank..]);
                for r in 0..rank {
                    let row = panel.as_ptr().add(r * PANEL);
                    let b = [0, 1, 2, 3].map(|q| _mm256_loadu_ps(row.add(8 * q)));
                    let tr = _mm256_set1_ps(t0[r]);
                    for q in 0..4 {
                        acc[0][q] = _mm256_fmadd_ps(tr, b[q], acc[0][q]);
                    }
                    if pair {
                        let tr = _mm256_set1_ps(t1[r]);
                        for q in 0..4 {
                            acc[1][q] = _mm256_fmadd_ps(tr, b[q], acc[1][q]);
                        }
                    }
                }
                for (j, acc) in acc.iter().enumerate().take(1 + pair as usize) {
                    let y = outs[k + j].as_mut_ptr().add(c0);
                    for (q, acc) in acc.iter().enumerate() {
                        let v = _mm256_fmadd_ps(s, *acc, _mm256_loadu_ps(y.add(8 * q)));
                        _mm256_storeu_ps(y.add(8 * q), v);
                    }
                }
                k += 1 + pair as usize;
            }
        }
        if full < f.outputs {
            let width = f.outputs - full;
            let panel = &f.b[full * rank..];
            for (k, out) in outs.iter_mut().enumerate() {
                let mut acc = [0f32; PANEL];
                for r in 0..rank {
                    let tr = t[k * rank + r];
                    for (acc, b) in acc.iter_mut().zip(&panel[r * width..(r + 1) * width]) {
                        *acc = tr.mul_add(b.to_f32(), *acc);
                    }
                }
                for (y, acc) in out[full..].iter_mut().zip(acc) {
                    *y = scale.mul_add(acc, *y);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2_654_435_761).max(1);
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 17;
                s ^= s << 5;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// The delta against an f64 sum over the values held, and each row's delta
    /// bit-identical alone, in any batch, and on the portable path (odd sizes reach
    /// every tail loop and a narrow last panel).
    #[test]
    fn deltas_match_f64_and_each_row_is_the_same_alone_batched_and_portable() {
        // Odd sizes, a rank of 1 with B narrower than a panel, and full panels only.
        for shape in [(5, 37, 70, 7), (1, 5, 6, 3), (16, 64, 96, 5)] {
            check_shape(shape);
        }
    }

    fn check_shape((rank, inputs, outputs, rows): (usize, usize, usize, usize)) {
        let f = LoraFactors::new(
            rank,
            inputs,
            outputs,
            &values(rank * inputs, 1),
            &values(outputs * rank, 2),
        );
        assert_eq!(f.bytes(), 2 * rank * (inputs + outputs));
        let x = values(rows * inputs, 3);
        let xs: Vec<&[f32]> = x.chunks(inputs).collect();
        let run = |xs: &[&[f32]], portable: bool| -> Vec<f32> {
            let mut out = vec![0.5f32; xs.len() * outputs];
            let mut outs: Vec<&mut [f32]> = out.chunks_mut(outputs).collect();
            if portable {
                let mut t = vec![0f32; xs.len() * rank];
                f.down(xs, &mut t);
                f.up(&t, 0.25, &mut outs);
            } else {
                f.apply(xs, 0.25, &mut outs);
            }
            out
        };
        let batched = run(&xs, false);
        assert_eq!(batched, run(&xs, true));
        for n in 1..rows {
            assert_eq!(
                run(&xs[..n], false),
                batched[..n * outputs],
                "first {n} rows"
            );
        }
        for (k, x) in xs.iter().enumerate() {
            let alone = run(&[x], false);
            assert_eq!(alone, batched[k * outputs..(k + 1) * outputs]);
            for (o, got) in alone.iter().enumerate() {
                let want = 0.5
                    + 0.25
                        * (0..rank)
                            .map(|r| {
                                let ax: f64 = (0..inputs)
                                    .map(|j| f64::from(f.a_at(r, j)) * f64::from(x[j]))
                                    .sum();
                                ax * f64::from(f.b_at(o, r))
                            })
                            .sum::<f64>();
                assert!(
                    (f64::from(*got) - want).abs() < 1e-5 * (1.0 + want.abs()),
                    "{o}: {got} vs {want}"
                );
            }
        }
    }

    /// Packing keeps each value to f16's precision, wherever it lands in a panel.
    #[test]
    fn packing_rounds_each_value_to_f16_in_place() {
        let (rank, inputs, outputs) = (3, 9, 40);
        let (a, b) = (values(rank * inputs, 4), values(outputs * rank, 5));
        let f = LoraFactors::new(rank, inputs, outputs, &a, &b);
        for r in 0..rank {
            for j in 0..inputs {
                assert!((f.a_at(r, j) - a[r * inputs + j]).abs() <= 1e-3);
            }
            for o in 0..outputs {
                assert!((f.b_at(o, r) - b[o * rank + r]).abs() <= 1e-3);
            }
        }
    }
}
