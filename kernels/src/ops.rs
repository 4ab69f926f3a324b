//! Elementwise and normalization ops of the llama forward pass.

/// RMSNorm (Zhang & Sennrich 2019): `out = x / sqrt(mean(x^2) + eps) * w`, per row.
/// `x` and `out` are `[n, w.len()]`.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let d = w.len();
    for (xr, or) in x.chunks_exact(d).zip(out.chunks_exact_mut(d)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / d as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for ((o, &xv), &wv) in or.iter_mut().zip(xr).zip(w) {
            *o = xv * inv * wv;
        }
    }
}

/// Rotary position embedding tables (RoFormer, Su et al. 2021) for one head size.
#[derive(Debug, Clone)]
pub struct Rope {
    head_dim: usize,
    inv_freq: Vec<f32>,
}

impl Rope {
    /// `inv_freq[i] = base^(-2i / head_dim)`.
    pub fn new(head_dim: usize, base: f32) -> Self {
        let inv_freq = (0..head_dim / 2)
            .map(|i| base.powf(-2.0 * i as f32 / head_dim as f32))
            .collect();
        Self { head_dim, inv_freq }
    }

    /// The rotation frequencies, `[head_dim / 2]` (the device RoPE reads them).
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// Rotates adjacent pairs `(x[2i], x[2i+1])` of every head in `x`
    /// (`[n_heads * head_dim]`) by `pos * inv_freq[i]`: GGML's "normal" RoPE mode,
    /// which llama GGUF files expect (their Q/K weights are permuted for it).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        // The angles depend on the position only: once for all heads.
        let sc: Vec<(f32, f32)> = self
            .inv_freq
            .iter()
            .map(|&f| (pos as f32 * f).sin_cos())
            .collect();
        for head in x.chunks_exact_mut(self.head_dim) {
            for (i, &(s, c)) in sc.iter().enumerate() {
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * c - b * s;
                head[2 * i + 1] = a * s + b * c;
            }
        }
    }
}

/// SwiGLU over rows of a stacked gate/up projection: for each row `r` of
/// `gate_up` (`[n, 2 * ffn]`: gate then up), `out[r] = silu(gate) * up`
/// (`out`: `[n, ffn]`). Rows run in parallel on the global pool; each row's
/// values are exactly those of [`swiglu`].
pub fn swiglu_rows(gate_up: &[f32], ffn: usize, out: &mut [f32]) {
    let n = out.len() / ffn.max(1);
    assert_eq!(gate_up.len(), 2 * n * ffn, "gate/up shape");
    assert_eq!(out.len(), n * ffn, "output shape");
    let pool = crate::pool::global();
    let per = n.div_ceil(pool.threads()).max(8);
    let base = RowsPtr(out.as_mut_ptr());
    let rows = |c: usize| {
        for r in c * per..((c + 1) * per).min(n) {
            // SAFETY: row r of `out` is in bounds and written by this task only.
            let g = unsafe { std::slice::from_raw_parts_mut(base.at(r * ffn), ffn) };
            let gu = &gate_up[2 * r * ffn..2 * (r + 1) * ffn];
            g.copy_from_slice(&gu[..ffn]);
            swiglu(g, &gu[ffn..]);
        }
    };
    match n.div_ceil(per) {
        0 => {}
        1 => rows(0),
        chunks => pool.parallel_for(chunks, rows),
    }
}

/// Base pointer of a row-major buffer whose rows pool tasks write disjointly.
#[derive(Clone, Copy)]
struct RowsPtr(*mut f32);
// SAFETY: tasks write disjoint rows of a buffer that outlives the region.
unsafe impl Send for RowsPtr {}
unsafe impl Sync for RowsPtr {}
impl RowsPtr {
    fn at(self, i: usize) -> *mut f32 {
        // SAFETY: callers pass in-bounds indices.
        unsafe { self.0.add(i) }
    }
}

/// SwiGLU gate: `gate[i] = silu(gate[i]) * up[i]`.
pub fn swiglu(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        *g = *g / (1.0 + (-*g).exp()) * u;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_of_constant_row_is_weight() {
        let mut out = [0f32; 4];
        rms_norm(&[2.0; 4], &[1.0, 2.0, 3.0, 4.0], 0.0, &mut out);
        assert_eq!(out, [1.0, 2.0, 3.0, 4.0]);
    }

    #[test]
    fn rope_at_zero_is_identity_and_preserves_norm() {
        let r = Rope::new(8, 10000.0);
        let x0: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
        let mut x = x0.clone();
        r.apply(&mut x, 0);
        assert_eq!(x, x0);
        r.apply(&mut x, 17);
        let n0: f32 = x0.iter().map(|v| v * v).sum();
        let n1: f32 = x.iter().map(|v| v * v).sum();
        assert!((n0 - n1).abs() < 1e-4);
        // Pair 0 rotates by exactly 17 radians.
        let (s, c) = 17f32.sin_cos();
        assert!((x[0] - (x0[0] * c - x0[1] * s)).abs() < 1e-5);
    }

    #[test]
    fn swiglu_rows_equal_row_by_row_swiglu() {
        let (n, ffn) = (37, 24);
        let gu: Vec<f32> = (0..2 * n * ffn)
            .map(|i| (i % 17) as f32 * 0.3 - 2.0)
            .collect();
        let mut out = vec![0f32; n * ffn];
        swiglu_rows(&gu, ffn, &mut out);
        for r in 0..n {
            let mut g = gu[2 * r * ffn..(2 * r + 1) * ffn].to_vec();
            swiglu(&mut g, &gu[(2 * r + 1) * ffn..2 * (r + 1) * ffn]);
            assert_eq!(&out[r * ffn..(r + 1) * ffn], &g[..]);
        }
    }

    #[test]
    fn swiglu_matches_formula() {
        let mut g = [0.0, 1.0];
        swiglu(&mut g, &[3.0, 2.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }
}
