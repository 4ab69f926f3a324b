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

    /// Rotates adjacent pairs `(x[2i], x[2i+1])` of every head in `x`
    /// (`[n_heads * head_dim]`) by `pos * inv_freq[i]`: GGML's "normal" RoPE mode,
    /// which llama GGUF files expect (their Q/K weights are permuted for it).
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        for head in x.chunks_exact_mut(self.head_dim) {
            for (i, &f) in self.inv_freq.iter().enumerate() {
                let theta = pos as f32 * f;
                let (s, c) = theta.sin_cos();
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * c - b * s;
                head[2 * i + 1] = a * s + b * c;
            }
        }
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
    fn swiglu_matches_formula() {
        let mut g = [0.0, 1.0];
        swiglu(&mut g, &[3.0, 2.0]);
        assert_eq!(g[0], 0.0);
        assert!((g[1] - 2.0 / (1.0 + (-1f32).exp())).abs() < 1e-6);
    }
}
