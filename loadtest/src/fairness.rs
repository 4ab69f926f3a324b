//! Per-tenant service and latency of the load phase, Jain's fairness index over
//! the tenants, and the prefix cache's hits per tenant (all from what the
//! clients saw; nothing here asks the server).
//!
//! ## What "service" is
//!
//! A tenant's **service** is the output tokens it received in the load phase: a
//! complete answer counts its reported `completion_tokens` (else its text
//! events), any other request the text events that arrived (each carries at
//! least one token). Its **demand** is the output tokens it asked for: per
//! normal (not over-long) request, `H = min(max_tokens, the solo answer's
//! tokens)` (greedy decoding stops where the solo answer stopped; `max_tokens`
//! when there is no solo answer, e.g. `--no-checks` or a `--compare` target),
//! except that a request the client dropped on purpose demands only what it read
//! before dropping. Over-long requests demand and get nothing.
//!
//! ## Jain's index
//!
//! R. Jain, D.-M. Chiu, W. Hawe, "A Quantitative Measure of Fairness and
//! Discrimination for Resource Allocation in Shared Computer Systems",
//! DEC-TR-301, 1984: for allocations `x_1..x_n`,
//! `J = (Σ x_i)² / (n · Σ x_i²)`, between `1/n` (one tenant got everything) and
//! 1 (all equal); `k` equal tenants and `n - k` with nothing give `k/n`. The
//! paper normalises each allocation by its fair value (`x_i = T_i / O_i`); the
//! report gives two indices:
//!
//! - [`FairnessReport::jain_index`]: `x_i = service_i / demand_i`, the fraction
//!   of its own demand each tenant got (the fair value of a tenant's share is
//!   its share of the demand; tenants that asked for nothing are left out).
//!   1 when every tenant got the same fraction of what it asked for, whatever
//!   the mix of tenants and prompt lengths the seed drew; a closed-loop run in
//!   which every request completes gives exactly 1, so a value below 1 means
//!   some tenants' requests failed, were cut or ran short more than others'.
//! - [`FairnessReport::jain_index_equal_split`]: `x_i = service_i` (equal weights,
//!   as the harness's tenants have): 1 when every tenant received the same
//!   number of output tokens. It also reflects how unevenly the workload drew
//!   tenants, so read it beside the demand shares.
//!
//! Latency fairness shows in the per-tenant TTFT (p50, p99): under a fair
//! scheduler a light tenant's first token does not wait behind a heavy
//! tenant's backlog.

use crate::client::{End, Outcome};
use crate::metrics::{dist, Dist};
use crate::workload::Workload;
use serde::{Deserialize, Serialize};

/// Jain's fairness index `(Σ x)² / (n · Σ x²)` (Jain, Chiu, Hawe 1984) of
/// non-negative allocations; `None` when there are none or all are 0 (the index
/// is undefined there).
pub fn jain(xs: &[f64]) -> Option<f64> {
    let sum: f64 = xs.iter().sum();
    let sq: f64 = xs.iter().map(|x| x * x).sum();
    (!xs.is_empty() && sq > 0.0).then(|| sum * sum / (xs.len() as f64 * sq))
}

/// One tenant's service in the load phase.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TenantService {
    /// Tenant index.
    pub tenant: usize,
    /// Tenant label.
    pub label: String,
    /// Requests sent (over-long ones included).
    pub requests_sent: usize,
    /// Complete answers.
    pub requests_completed: usize,
    /// Prompt tokens the server reported (requests whose usage arrived).
    pub input_tokens: u64,
    /// Of those, prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// Output tokens received: the tenant's service (see the module docs).
    pub output_tokens: u64,
    /// Output tokens asked for: the tenant's demand (see the module docs).
    pub demand_output_tokens: u64,
    /// `output_tokens` / all tenants' `output_tokens` (0 when nothing was served).
    pub service_share: f64,
    /// `demand_output_tokens` / all tenants' demand (0 when nothing was asked).
    pub demand_share: f64,
    /// TTFT of the tenant's complete streamed answers (ms).
    pub ttft_ms: Dist,
    /// End-to-end latency of the tenant's complete answers (ms).
    pub e2e_ms: Dist,
}

/// Service per tenant and Jain's index over the tenants.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FairnessReport {
    /// Per tenant, in tenant order.
    pub tenants: Vec<TenantService>,
    /// Jain's index over `output_tokens / demand_output_tokens` of the tenants
    /// that asked for something (see the module docs); `None` when no tenant
    /// was served anything.
    pub jain_index: Option<f64>,
    /// Jain's index over `output_tokens` of every tenant; `None` when no tenant
    /// was served anything.
    pub jain_index_equal_split: Option<f64>,
}

/// Output tokens `o` delivered to its client.
fn served(o: &Outcome) -> u64 {
    match o.end {
        End::Complete => o.output_tokens(),
        _ => o.text_events as u64,
    }
}

/// Output tokens `o` asked for (see the module docs); `solo` is indexed by
/// prompt id (empty: no solo answers).
fn demanded(w: &Workload, solo: &[Option<Outcome>], o: &Outcome) -> u64 {
    let p = &w.prompts[o.prompt];
    if p.over_long {
        return 0;
    }
    if o.end == End::Disconnected {
        return served(o);
    }
    let mut h = p.max_tokens as u64;
    if let Some(c) = solo
        .get(o.prompt)
        .and_then(Option::as_ref)
        .filter(|s| s.end == End::Complete)
        .and_then(|s| s.completion_tokens)
    {
        h = h.min(c);
    }
    h.max(served(o))
}

fn share(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 / whole as f64
    }
}

/// Service, demand and latency per tenant over the load phase's `outs`, and
/// Jain's indices. `labels` names the tenants (index order); `solo` gives the
/// solo answers by prompt id (empty slice: none).
pub fn fairness(
    w: &Workload,
    solo: &[Option<Outcome>],
    outs: &[Outcome],
    labels: &[String],
) -> FairnessReport {
    let n = w.tenants();
    let mut tenants: Vec<TenantService> = (0..n)
        .map(|t| TenantService {
            tenant: t,
            label: labels.get(t).cloned().unwrap_or_else(|| format!("t{t}")),
            ..TenantService::default()
        })
        .collect();
    let mut ttft: Vec<Vec<f64>> = vec![Vec::new(); n];
    let mut e2e: Vec<Vec<f64>> = vec![Vec::new(); n];
    for o in outs {
        let Some(t) = tenants.get_mut(o.tenant) else {
            continue;
        };
        t.requests_sent += 1;
        t.input_tokens += o.prompt_tokens.unwrap_or(0);
        t.cached_tokens += o.cached_tokens.unwrap_or(0);
        if !w.prompts[o.prompt].over_long {
            t.output_tokens += served(o);
            t.demand_output_tokens += demanded(w, solo, o);
        }
        if o.end == End::Complete {
            t.requests_completed += 1;
            e2e[o.tenant].push(o.e2e_s);
            if let Some(x) = o.ttft_s {
                ttft[o.tenant].push(x);
            }
        }
    }
    let total_out: u64 = tenants.iter().map(|t| t.output_tokens).sum();
    let total_demand: u64 = tenants.iter().map(|t| t.demand_output_tokens).sum();
    for (i, t) in tenants.iter_mut().enumerate() {
        t.service_share = share(t.output_tokens, total_out);
        t.demand_share = share(t.demand_output_tokens, total_demand);
        t.ttft_ms = dist(&ttft[i]);
        t.e2e_ms = dist(&e2e[i]);
    }
    let normalised: Vec<f64> = tenants
        .iter()
        .filter(|t| t.demand_output_tokens > 0)
        .map(|t| t.output_tokens as f64 / t.demand_output_tokens as f64)
        .collect();
    let raw: Vec<f64> = tenants.iter().map(|t| t.output_tokens as f64).collect();
    FairnessReport {
        jain_index: jain(&normalised),
        jain_index_equal_split: jain(&raw),
        tenants,
    }
}

/// One tenant's prefix-cache figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TenantPrefix {
    /// Tenant index.
    pub tenant: usize,
    /// Tenant label.
    pub label: String,
    /// Requests whose usage arrived with a cached-token count.
    pub requests_with_usage: usize,
    /// Of those, requests with `cached_tokens > 0`.
    pub requests_with_hit: usize,
    /// Their prompt tokens.
    pub prompt_tokens: u64,
    /// Their prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
    /// `cached_tokens / prompt_tokens`; `None` when no prompt tokens were reported.
    pub hit_rate: Option<f64>,
}

/// Prefix-cache hits as the answers' usage reported them.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct PrefixCacheReport {
    /// `--shared-prefix-tokens` (words per tenant prefix), if given.
    pub shared_prefix_tokens: Option<usize>,
    /// Per tenant, in tenant order.
    pub tenants: Vec<TenantPrefix>,
    /// All tenants: requests whose usage carried a cached-token count.
    pub requests_with_usage: usize,
    /// All tenants: requests with a hit.
    pub requests_with_hit: usize,
    /// All tenants: prompt tokens of those requests.
    pub prompt_tokens: u64,
    /// All tenants: cached prompt tokens.
    pub cached_tokens: u64,
    /// All tenants: `cached_tokens / prompt_tokens`.
    pub hit_rate: Option<f64>,
}

/// Cached prompt tokens per tenant over `outs`, from every answer whose usage
/// carried `cached_tokens` (Workers AI `usage.cached_tokens`, OpenAI and Tessera
/// `usage.prompt_tokens_details.cached_tokens`).
pub fn prefix_cache(
    n_tenants: usize,
    outs: &[Outcome],
    labels: &[String],
    shared_prefix_tokens: Option<usize>,
) -> PrefixCacheReport {
    let mut tenants: Vec<TenantPrefix> = (0..n_tenants)
        .map(|t| TenantPrefix {
            tenant: t,
            label: labels.get(t).cloned().unwrap_or_else(|| format!("t{t}")),
            ..TenantPrefix::default()
        })
        .collect();
    for o in outs {
        let (Some(t), Some(c)) = (tenants.get_mut(o.tenant), o.cached_tokens) else {
            continue;
        };
        t.requests_with_usage += 1;
        t.requests_with_hit += usize::from(c > 0);
        t.prompt_tokens += o.prompt_tokens.unwrap_or(0);
        t.cached_tokens += c;
    }
    let rate = |c: u64, p: u64| (p > 0).then(|| c as f64 / p as f64);
    for t in &mut tenants {
        t.hit_rate = rate(t.cached_tokens, t.prompt_tokens);
    }
    let prompt_tokens = tenants.iter().map(|t| t.prompt_tokens).sum();
    let cached_tokens = tenants.iter().map(|t| t.cached_tokens).sum();
    PrefixCacheReport {
        shared_prefix_tokens,
        requests_with_usage: tenants.iter().map(|t| t.requests_with_usage).sum(),
        requests_with_hit: tenants.iter().map(|t| t.requests_with_hit).sum(),
        prompt_tokens,
        cached_tokens,
        hit_rate: rate(cached_tokens, prompt_tokens),
        tenants,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_args;

    fn close(a: Option<f64>, b: f64) -> bool {
        a.is_some_and(|a| (a - b).abs() < 1e-12)
    }

    #[test]
    fn jain_index_matches_the_papers_bounds_and_examples() {
        // All equal: 1, whatever the scale.
        assert!(close(jain(&[3.0, 3.0, 3.0]), 1.0));
        assert!(close(jain(&[0.2; 7]), 1.0));
        // One of n gets everything: 1/n.
        assert!(close(jain(&[5.0, 0.0, 0.0, 0.0]), 0.25));
        // k of n equal, the rest nothing: k/n.
        assert!(close(jain(&[1.0, 1.0, 0.0, 0.0, 0.0]), 0.4));
        // Worked by hand: (1+2+3)^2 / (3 (1+4+9)) = 36/42.
        assert!(close(jain(&[1.0, 2.0, 3.0]), 36.0 / 42.0));
        // Scale-invariant.
        assert_eq!(jain(&[1.0, 2.0, 3.0]), jain(&[10.0, 20.0, 30.0]));
        // Undefined: nothing to compare, or nothing allocated.
        assert_eq!(jain(&[]), None);
        assert_eq!(jain(&[0.0, 0.0]), None);
        // One tenant: trivially fair.
        assert!(close(jain(&[4.0]), 1.0));
    }

    fn workload() -> Workload {
        // 2 tenants x 2 prompts; prompts 0, 1 are tenant 0's, 2, 3 tenant 1's,
        // 4, 5 the over-long ones.
        let a = parse_args(["x", "--prompts-per-tenant", "2", "--output-len", "20"]);
        Workload::new(&a, 2, 64).unwrap()
    }

    fn done(index: usize, prompt: usize, tenant: usize, tokens: u64, ttft: f64) -> Outcome {
        Outcome {
            end: End::Complete,
            status: Some(200),
            prompt_tokens: Some(50),
            completion_tokens: Some(tokens),
            cached_tokens: Some(32),
            text_events: tokens as usize,
            ttft_s: Some(ttft),
            e2e_s: ttft * 2.0,
            ..Outcome::pending(index, tenant, prompt, true, 0.0)
        }
    }

    #[test]
    fn report_fields_per_tenant_and_both_indices() {
        let w = workload();
        assert_eq!((w.prompts[2].tenant, w.prompts[4].over_long), (1, true));
        let labels = vec!["a".to_string(), "b".to_string()];
        // Solo answers: prompt 0 stops after 12 tokens, the others at max_tokens.
        let mut solo: Vec<Option<Outcome>> = (0..4).map(|p| Some(done(p, p, 0, 20, 0.1))).collect();
        solo[0] = Some(done(0, 0, 0, 12, 0.1));
        solo.resize(6, None);

        // Tenant 0: three complete answers (12 + 20 + 12 tokens).
        // Tenant 1: one complete (20), one disconnect after 5 events, one 503,
        // one over-long 400.
        let mut disc = Outcome::pending(4, 1, 3, true, 0.0);
        disc.end = End::Disconnected;
        disc.text_events = 5;
        let mut failed = Outcome::pending(5, 1, 2, true, 0.0);
        failed.end = End::HttpError;
        failed.status = Some(503);
        let mut over = Outcome::pending(6, 1, 5, false, 0.0);
        over.end = End::HttpError;
        over.status = Some(400);
        let outs = vec![
            done(0, 0, 0, 12, 0.010),
            done(1, 1, 0, 20, 0.020),
            done(2, 0, 0, 12, 0.030),
            done(3, 2, 1, 20, 0.100),
            disc,
            failed,
            over,
        ];
        let f = fairness(&w, &solo, &outs, &labels);
        let (a, b) = (&f.tenants[0], &f.tenants[1]);
        assert_eq!((a.label.as_str(), b.label.as_str()), ("a", "b"));
        assert_eq!((a.requests_sent, a.requests_completed), (3, 3));
        assert_eq!((b.requests_sent, b.requests_completed), (4, 1));
        assert_eq!((a.input_tokens, a.cached_tokens), (150, 96));
        assert_eq!((b.input_tokens, b.cached_tokens), (50, 32));
        // Service and demand: tenant 0 got all 44 it asked for; tenant 1 got
        // 20 + 5 of 20 + 5 + 20 (the 503 lost its 20; the over-long asked nothing).
        assert_eq!((a.output_tokens, a.demand_output_tokens), (44, 44));
        assert_eq!((b.output_tokens, b.demand_output_tokens), (25, 45));
        assert!((a.service_share - 44.0 / 69.0).abs() < 1e-12);
        assert!((b.demand_share - 45.0 / 89.0).abs() < 1e-12);
        // x = (1, 25/45): J = (1 + 5/9)^2 / (2 (1 + 25/81)).
        let x: f64 = 25.0 / 45.0;
        assert!(close(
            f.jain_index,
            (1.0 + x).powi(2) / (2.0 * (1.0 + x * x))
        ));
        assert!(close(
            f.jain_index_equal_split,
            69.0f64.powi(2) / (2.0 * (44.0f64.powi(2) + 25.0f64.powi(2)))
        ));
        // TTFT per tenant, from complete streamed answers (nearest rank).
        assert_eq!(a.ttft_ms.count, 3);
        assert!((a.ttft_ms.p50 - 20.0).abs() < 1e-9 && (a.ttft_ms.p99 - 30.0).abs() < 1e-9);
        assert_eq!(b.ttft_ms.count, 1);
        assert!((b.ttft_ms.p50 - 100.0).abs() < 1e-9);
        assert!((b.e2e_ms.p50 - 200.0).abs() < 1e-9);

        // Every request served in full: the demand-normalised index is 1 even
        // though the tenants' demands differ.
        let f = fairness(&w, &solo, &outs[..4], &labels);
        assert!(close(f.jain_index, 1.0));
        assert!(f.jain_index_equal_split.unwrap() < 1.0);
        // Without solo answers the demand is max_tokens (20 each).
        let f = fairness(&w, &[], &outs[..4], &labels);
        assert_eq!(f.tenants[0].demand_output_tokens, 60);
        // Nothing served: the indices are undefined, the shares 0.
        let f = fairness(&w, &solo, &outs[5..], &labels);
        assert_eq!((f.jain_index, f.jain_index_equal_split), (None, None));
        assert_eq!(f.tenants[1].service_share, 0.0);

        // The JSON field names are part of the report's layout.
        let v = serde_json::to_value(fairness(&w, &solo, &outs, &labels)).unwrap();
        for k in ["tenants", "jain_index", "jain_index_equal_split"] {
            assert!(v.get(k).is_some(), "{k}");
        }
        for k in [
            "tenant",
            "label",
            "requests_sent",
            "requests_completed",
            "input_tokens",
            "cached_tokens",
            "output_tokens",
            "demand_output_tokens",
            "service_share",
            "demand_share",
            "ttft_ms",
            "e2e_ms",
        ] {
            assert!(v["tenants"][0].get(k).is_some(), "{k}");
        }
        assert!(v["tenants"][0]["ttft_ms"]["p99"].is_number());
    }

    #[test]
    fn prefix_cache_totals_and_hit_rates() {
        let labels = vec!["a".to_string(), "b".to_string(), "c".to_string()];
        let mut miss = done(0, 0, 0, 5, 0.1);
        miss.cached_tokens = Some(0);
        let hit = done(1, 0, 0, 5, 0.1); // 32 of 50 cached
        let mut no_usage = done(2, 2, 1, 5, 0.1);
        no_usage.cached_tokens = None; // e.g. a server that does not report it
        let mut other = done(3, 2, 1, 5, 0.1);
        other.prompt_tokens = Some(100);
        other.cached_tokens = Some(96);
        let r = prefix_cache(3, &[miss, hit, no_usage, other], &labels, Some(200));
        assert_eq!(r.shared_prefix_tokens, Some(200));
        let (a, b, c) = (&r.tenants[0], &r.tenants[1], &r.tenants[2]);
        assert_eq!(
            (
                a.requests_with_usage,
                a.requests_with_hit,
                a.prompt_tokens,
                a.cached_tokens
            ),
            (2, 1, 100, 32)
        );
        assert!(close(a.hit_rate, 0.32));
        assert_eq!((b.requests_with_usage, b.cached_tokens), (1, 96));
        assert!(close(b.hit_rate, 0.96));
        assert_eq!((c.requests_with_usage, c.hit_rate), (0, None));
        assert_eq!((r.requests_with_usage, r.requests_with_hit), (3, 2));
        assert_eq!((r.prompt_tokens, r.cached_tokens), (200, 128));
        assert!(close(r.hit_rate, 0.64));
        let v = serde_json::to_value(&r).unwrap();
        for k in [
            "shared_prefix_tokens",
            "tenants",
            "requests_with_usage",
            "requests_with_hit",
            "prompt_tokens",
            "cached_tokens",
            "hit_rate",
        ] {
            assert!(v.get(k).is_some(), "{k}");
        }
        assert_eq!(v["tenants"][1]["cached_tokens"], 96);
    }
}
