//! What the gateway's examples share: command-line numbers and percentiles.

/// The number after `name` on the command line (`--loops 6`), or `default`.
pub(crate) fn arg(name: &str, default: u64) -> u64 {
    let a: Vec<String> = std::env::args().collect();
    a.iter()
        .position(|x| x == name)
        .and_then(|i| a.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The `p` quantile (0..=1, nearest rank) of `v`, sorting it; NaN when empty.
pub(crate) fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() - 1) as f64 * p).round() as usize]
}
