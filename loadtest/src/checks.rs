//! The isolation checks, as pure functions over what the clients saw:
//!
//! - **canaries**: no response may contain a canary of another tenant;
//! - **solo-equality**: with greedy decoding each completed response equals its
//!   prompt's solo response (text and token count);
//! - **over-long**: every prompt longer than the context window gets a 4xx;
//! - **usage**: the usage API's totals per tenant equal what the clients counted
//!   (requests, input, output and cached prompt tokens, errors).
//!
//! ## How the clients count usage
//!
//! Every request the gateway admitted has exactly one ledger row; one it refused
//! before admission (401, 403, 429: authentication, scope, limits) has none. Per request
//! the client derives a range `[lo, hi]` for each total (requests, input tokens,
//! output tokens, errors); the ledger's change over the run must lie inside the
//! sum of the ranges, per tenant. The ranges are exact (lo = hi) except where the
//! client cannot know what the server computed:
//!
//! | client saw | requests | input | output | errors |
//! |---|---|---|---|---|
//! | complete answer | 1 | reported prompt tokens | reported completion tokens | 0 |
//! | 401, 403, 429 (refused before admission) | 0 | 0 | 0 | 0 |
//! | other 4xx (except 408) | 1 | 0 | 0 | 1 |
//! | 408 (a deadline), 5xx | 1 | 0..=P | 0..=H | 1 |
//! | disconnect after k >= 1 text events | 1 | P | k..=H | 0..=1 |
//! | disconnect before any text event | 1 | 0..=P | 0..=H | 0..=1 |
//! | error event after 200 | 1 | P | k..=H | 1 |
//! | connection refused | 0 | 0 | 0 | 0 |
//! | stream cut, or no status otherwise | 0..=1 | 0..=P | 0..=H | 0..=1 |
//!
//! Cached prompt tokens (the ledger's `cached_tokens`, prompt tokens the prefix
//! cache served): exactly the reported `cached_tokens` of a complete answer, 0 for
//! a refusal or a 4xx, and `0..=P` for every other row (the server may have
//! finished an answer the client never read to the end, and may count a hit
//! before failing). A server whose answers do not report `cached_tokens` gets
//! `0..=P` for every complete answer too.
//!
//! P is the prompt's token count and H = min(`max_tokens`, the solo answer's
//! token count) (greedy decoding cannot go past where the solo answer stopped),
//! both from the solo run. A disconnect is recorded by the server as 499 with the
//! tokens it computed, which is at least the k tokens the client saw (each text
//! event carries at least one token), unless the request finished before the
//! server noticed the disconnect (then 200 and the full count, still within the
//! range). The prompt is charged once the first token exists, so a client gone
//! before any text may be charged nothing. Without disconnects and faults every
//! range is exact.

use crate::client::{End, Outcome};
use crate::workload::Workload;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// At most this many details are kept per check in reports.
pub const MAX_DETAILS: usize = 50;

fn snippet(s: &str, from: usize, len: usize) -> String {
    s.chars().skip(from).take(len).collect()
}

/// A response that contains another tenant's canary.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leak {
    /// Request index in its phase.
    pub request_index: usize,
    /// The server's request id.
    pub request_id: Option<String>,
    /// Phase (`solo` or `load`).
    pub phase: String,
    /// Tenant that sent the request.
    pub tenant: usize,
    /// Tenant whose canary appeared.
    pub foreign_tenant: usize,
    /// The canary.
    pub canary: String,
    /// HTTP status of the response.
    pub status: Option<u16>,
}

/// Result of the canary check.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct CanaryReport {
    /// Responses with text that were searched.
    pub responses_checked: usize,
    /// Responses carrying another tenant's canary (must be 0).
    pub leaks: usize,
    /// Responses that repeat their own prompt's canary: shows that the model
    /// does copy canaries, so a leaked context would show.
    pub own_canary_echoed: usize,
    /// The first [`MAX_DETAILS`] leaks.
    pub details: Vec<Leak>,
}

/// Searches every response for every canary of every other tenant (the random
/// part `XXXX-XXXX`, so a leak is found even if the model drops the prefix).
pub fn canary_check(w: &Workload, phases: &[(&str, &[Outcome])]) -> CanaryReport {
    let needles: Vec<(usize, &str, &str)> = w
        .canaries
        .iter()
        .enumerate()
        .flat_map(|(t, cs)| {
            cs.iter()
                .map(move |c| (t, c.as_str(), c.strip_prefix("CANARY-").unwrap_or(c)))
        })
        .collect();
    let mut r = CanaryReport::default();
    for (phase, outs) in phases {
        for o in outs.iter() {
            if o.text.is_empty() {
                continue;
            }
            r.responses_checked += 1;
            let own = &w.prompts[o.prompt].canary;
            if o.text.contains(own.strip_prefix("CANARY-").unwrap_or(own)) {
                r.own_canary_echoed += 1;
            }
            for &(t, full, part) in &needles {
                if t != o.tenant && o.text.contains(part) {
                    r.leaks += 1;
                    if r.details.len() < MAX_DETAILS {
                        r.details.push(Leak {
                            request_index: o.index,
                            request_id: o.request_id.clone(),
                            phase: phase.to_string(),
                            tenant: o.tenant,
                            foreign_tenant: t,
                            canary: full.to_string(),
                            status: o.status,
                        });
                    }
                }
            }
        }
    }
    r
}

/// A completed response that differs from its prompt's solo response.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mismatch {
    /// Request index.
    pub request_index: usize,
    /// The server's request id.
    pub request_id: Option<String>,
    /// Tenant.
    pub tenant: usize,
    /// Prompt id.
    pub prompt: usize,
    /// First differing character (chars, not bytes); `None` if the texts are
    /// equal and only the token counts differ.
    pub first_difference_at: Option<usize>,
    /// Solo text from a little before the difference.
    pub expected: String,
    /// Text under load from the same place.
    pub got: String,
    /// Solo completion tokens.
    pub expected_tokens: Option<u64>,
    /// Completion tokens under load.
    pub got_tokens: Option<u64>,
}

/// Result of the solo-equality check.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct EqualityReport {
    /// Completed responses compared with their solo response.
    pub compared: usize,
    /// Responses not compared (not complete, over-long, or no solo answer).
    pub skipped: usize,
    /// Responses that differ (must be 0).
    pub mismatches: usize,
    /// The first [`MAX_DETAILS`] mismatches.
    pub details: Vec<Mismatch>,
}

/// Compares each completed response with `solo[prompt]` (the same prompt run
/// alone, greedy); text and, where both are known, completion tokens.
pub fn solo_equality(solo: &[Option<Outcome>], outs: &[Outcome]) -> EqualityReport {
    let mut r = EqualityReport::default();
    for o in outs {
        let Some(s) = solo
            .get(o.prompt)
            .and_then(Option::as_ref)
            .filter(|s| s.end == End::Complete)
        else {
            r.skipped += 1;
            continue;
        };
        if o.end != End::Complete {
            r.skipped += 1;
            continue;
        }
        r.compared += 1;
        let diff = o
            .text
            .chars()
            .zip(s.text.chars())
            .position(|(a, b)| a != b)
            .or_else(|| {
                let (a, b) = (o.text.chars().count(), s.text.chars().count());
                (a != b).then_some(a.min(b))
            });
        let tokens_differ = matches!(
            (s.completion_tokens, o.completion_tokens),
            (Some(a), Some(b)) if a != b
        );
        if diff.is_some() || tokens_differ {
            r.mismatches += 1;
            if r.details.len() < MAX_DETAILS {
                let from = diff.unwrap_or(0).saturating_sub(20);
                r.details.push(Mismatch {
                    request_index: o.index,
                    request_id: o.request_id.clone(),
                    tenant: o.tenant,
                    prompt: o.prompt,
                    first_difference_at: diff,
                    expected: snippet(&s.text, from, 80),
                    got: snippet(&o.text, from, 80),
                    expected_tokens: s.completion_tokens,
                    got_tokens: o.completion_tokens,
                });
            }
        }
    }
    r
}

/// Result of the over-long check.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct OverlongReport {
    /// Over-long requests sent.
    pub sent: usize,
    /// Answered with a 4xx (as they must be).
    pub rejected_4xx: usize,
    /// Answered with anything else (must be 0): the request indices.
    pub not_rejected: Vec<usize>,
    /// No answer at all while a fault made the server unreachable (excused).
    pub unanswered_during_outage: usize,
    /// Status (or transport error) -> count.
    pub statuses: BTreeMap<String, usize>,
}

/// Checks that every over-long request got a 4xx. `in_outage` tells whether a
/// request overlapped a planned outage (then a missing answer is excused).
pub fn overlong_check(
    w: &Workload,
    outs: &[Outcome],
    in_outage: impl Fn(&Outcome) -> bool,
) -> OverlongReport {
    let mut r = OverlongReport::default();
    for o in outs.iter().filter(|o| w.prompts[o.prompt].over_long) {
        r.sent += 1;
        let key = match o.status {
            Some(s) => s.to_string(),
            None => o.error.clone().unwrap_or_else(|| "transport".into()),
        };
        *r.statuses.entry(key).or_default() += 1;
        match o.status {
            Some(s) if (400..500).contains(&s) => r.rejected_4xx += 1,
            None if in_outage(o) => r.unanswered_during_outage += 1,
            _ => r.not_rejected.push(o.index),
        }
    }
    r
}

/// An inclusive range of a count.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Range {
    /// Smallest value.
    pub lo: u64,
    /// Largest value.
    pub hi: u64,
}

impl Range {
    fn exact(n: u64) -> Self {
        Self { lo: n, hi: n }
    }
    fn upto(n: u64) -> Self {
        Self { lo: 0, hi: n }
    }
    fn add(&mut self, o: Range) {
        self.lo = self.lo.saturating_add(o.lo);
        self.hi = self.hi.saturating_add(o.hi);
    }
    /// Whether `v` lies in the range.
    pub fn contains(&self, v: u64) -> bool {
        (self.lo..=self.hi).contains(&v)
    }
}

/// The four totals of the usage API.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageTotals {
    /// Requests (ledger rows).
    pub requests: u64,
    /// Prompt tokens.
    pub input_tokens: u64,
    /// Generated tokens.
    pub output_tokens: u64,
    /// Rows with a status >= 400.
    pub errors: u64,
    /// Prompt tokens served from the prefix cache (0 from a server that does
    /// not report them).
    #[serde(default)]
    pub cached_tokens: u64,
}

impl UsageTotals {
    /// `self - before`, per field (saturating).
    pub fn minus(&self, before: &UsageTotals) -> UsageTotals {
        UsageTotals {
            requests: self.requests.saturating_sub(before.requests),
            input_tokens: self.input_tokens.saturating_sub(before.input_tokens),
            output_tokens: self.output_tokens.saturating_sub(before.output_tokens),
            errors: self.errors.saturating_sub(before.errors),
            cached_tokens: self.cached_tokens.saturating_sub(before.cached_tokens),
        }
    }
}

/// What the clients counted for one tenant: a range per total.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExpectedUsage {
    /// Requests.
    pub requests: Range,
    /// Prompt tokens.
    pub input_tokens: Range,
    /// Generated tokens.
    pub output_tokens: Range,
    /// Error rows.
    pub errors: Range,
    /// Cached prompt tokens.
    #[serde(default)]
    pub cached_tokens: Range,
}

impl ExpectedUsage {
    /// Whether `t` lies in every range.
    pub fn admits(&self, t: &UsageTotals) -> bool {
        self.requests.contains(t.requests)
            && self.input_tokens.contains(t.input_tokens)
            && self.output_tokens.contains(t.output_tokens)
            && self.errors.contains(t.errors)
            && self.cached_tokens.contains(t.cached_tokens)
    }

    /// Whether every range is a single value.
    pub fn is_exact(&self) -> bool {
        [
            self.requests,
            self.input_tokens,
            self.output_tokens,
            self.errors,
            self.cached_tokens,
        ]
        .iter()
        .all(|r| r.lo == r.hi)
    }

    fn add(&mut self, o: &ExpectedUsage) {
        self.requests.add(o.requests);
        self.input_tokens.add(o.input_tokens);
        self.output_tokens.add(o.output_tokens);
        self.errors.add(o.errors);
        self.cached_tokens.add(o.cached_tokens);
    }
}

/// The usage one request should have left in the ledger (see the module docs
/// for the table). `solo` gives the prompt's solo answer (P and H).
pub fn expected_for(w: &Workload, solo: &[Option<Outcome>], o: &Outcome) -> ExpectedUsage {
    let prompt = &w.prompts[o.prompt];
    let s = solo.get(o.prompt).and_then(Option::as_ref);
    let p = s.and_then(|s| s.prompt_tokens);
    let p_exact = p.map(Range::exact).unwrap_or(Range::upto(u64::MAX));
    let p_upto = Range::upto(p.unwrap_or(u64::MAX));
    let mut h = prompt.max_tokens as u64;
    if let Some(c) = s
        .filter(|s| s.end == End::Complete)
        .and_then(|s| s.completion_tokens)
    {
        h = h.min(c);
    }
    let seen = o.text_events as u64;
    let one = Range::exact(1);
    let zero = Range::exact(0);
    match o.end {
        End::Complete => ExpectedUsage {
            requests: one,
            input_tokens: o.prompt_tokens.map(Range::exact).unwrap_or(p_exact),
            output_tokens: Range::exact(o.output_tokens()),
            errors: zero,
            cached_tokens: match o.cached_tokens {
                Some(c) => Range::exact(c),
                None => Range::upto(o.prompt_tokens.or(p).unwrap_or(u64::MAX)),
            },
        },
        End::HttpError if matches!(o.status, Some(401 | 403 | 429)) => ExpectedUsage::default(),
        End::HttpError if o.status.is_some_and(|s| s < 500 && s != 408) => ExpectedUsage {
            requests: one,
            input_tokens: zero,
            output_tokens: zero,
            errors: one,
            cached_tokens: zero,
        },
        End::HttpError => ExpectedUsage {
            requests: one,
            input_tokens: p_upto,
            output_tokens: Range::upto(h),
            errors: one,
            cached_tokens: p_upto,
        },
        End::Disconnected => ExpectedUsage {
            requests: one,
            input_tokens: if seen > 0 { p_exact } else { p_upto },
            output_tokens: Range {
                lo: seen,
                hi: h.max(seen),
            },
            errors: Range::upto(1),
            cached_tokens: p_upto,
        },
        End::StreamError => ExpectedUsage {
            requests: one,
            input_tokens: p_exact,
            output_tokens: Range {
                lo: seen,
                hi: h.max(seen),
            },
            errors: one,
            cached_tokens: p_upto,
        },
        // The connection was never made: the server cannot have a row.
        End::Transport if o.error.as_deref() == Some("connect") => ExpectedUsage::default(),
        End::Cut | End::Transport => ExpectedUsage {
            requests: Range::upto(1),
            input_tokens: p_upto,
            output_tokens: Range::upto(h.max(seen)),
            errors: Range::upto(1),
            cached_tokens: p_upto,
        },
    }
}

/// Sums [`expected_for`] per tenant over the given phases. For requests where
/// `uncertain(o)` holds (they ended shortly before or during a node kill, when
/// the node may have died between answering and writing the row) every lower
/// bound drops to 0.
pub fn expected_usage(
    w: &Workload,
    solo: &[Option<Outcome>],
    phases: &[&[Outcome]],
    uncertain: impl Fn(&Outcome) -> bool,
) -> Vec<ExpectedUsage> {
    let mut out = vec![ExpectedUsage::default(); w.tenants()];
    for outs in phases {
        for o in outs.iter() {
            let mut e = expected_for(w, solo, o);
            if uncertain(o) {
                for r in [
                    &mut e.requests,
                    &mut e.input_tokens,
                    &mut e.output_tokens,
                    &mut e.errors,
                    &mut e.cached_tokens,
                ] {
                    r.lo = 0;
                }
            }
            out[o.tenant].add(&e);
        }
    }
    out
}

/// One tenant's usage check.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TenantUsage {
    /// Tenant index.
    pub tenant: usize,
    /// Tenant label.
    pub label: String,
    /// What the clients counted.
    pub expected: ExpectedUsage,
    /// The ledger's change over the run (usage API totals after minus before).
    pub observed: UsageTotals,
    /// Observed lies in expected.
    pub matched: bool,
}

/// Result of the usage check.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct UsageReport {
    /// Per tenant.
    pub tenants: Vec<TenantUsage>,
    /// Tenants whose usage does not match (must be 0).
    pub mismatches: usize,
    /// Every expected range was a single value (no disconnects or faults).
    pub exact: bool,
}

/// Compares expected and observed usage per tenant.
pub fn usage_check(
    labels: &[String],
    expected: &[ExpectedUsage],
    observed: &[UsageTotals],
) -> UsageReport {
    let tenants: Vec<TenantUsage> = expected
        .iter()
        .zip(observed)
        .enumerate()
        .map(|(t, (e, o))| TenantUsage {
            tenant: t,
            label: labels.get(t).cloned().unwrap_or_default(),
            expected: *e,
            observed: *o,
            matched: e.admits(o),
        })
        .collect();
    UsageReport {
        mismatches: tenants.iter().filter(|t| !t.matched).count(),
        exact: expected.iter().all(ExpectedUsage::is_exact),
        tenants,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_args;

    fn workload() -> Workload {
        let a = parse_args(["x", "--prompts-per-tenant", "2", "--seed", "3"]);
        Workload::new(&a, 2, 64).unwrap()
    }

    fn outcome(w: &Workload, index: usize, prompt: usize, text: &str, tokens: u64) -> Outcome {
        Outcome {
            index,
            tenant: w.prompts[prompt].tenant,
            prompt,
            stream: true,
            end: End::Complete,
            status: Some(200),
            error: None,
            error_detail: None,
            request_id: Some(format!("rid{index}")),
            text: text.into(),
            prompt_tokens: Some(40 + prompt as u64),
            completion_tokens: Some(tokens),
            cached_tokens: Some(0),
            text_events: tokens as usize,
            start_s: 0.0,
            ttft_s: Some(0.01),
            e2e_s: 0.1,
            event_times_s: vec![],
        }
    }

    /// The required planted-fault test: one response carries another tenant's
    /// canary, another has one token changed; the harness reports both, and
    /// nothing else.
    #[test]
    fn planted_foreign_canary_and_changed_token_are_both_reported() {
        let w = workload();
        // Prompts 0, 1 belong to tenant 0; 2, 3 to tenant 1.
        assert_eq!((w.prompts[1].tenant, w.prompts[2].tenant), (0, 1));
        let solo: Vec<Option<Outcome>> = w
            .prompts
            .iter()
            .map(|p| {
                (!p.over_long).then(|| {
                    outcome(
                        &w,
                        p.id,
                        p.id,
                        &format!("The code is {}. The sea is wide and blue.", p.canary),
                        12,
                    )
                })
            })
            .collect();
        let s = |i: usize| solo[i].as_ref().unwrap().text.clone();
        let foreign = w.canaries[1][0].clone();
        let load = vec![
            outcome(&w, 0, 0, &s(0), 12),
            // Tenant 0's answer carries tenant 1's canary (and differs from solo).
            outcome(&w, 1, 1, &format!("{} {foreign}", s(1)), 12),
            // One token changed: "wide" -> "deep".
            outcome(&w, 2, 2, &s(2).replace("wide", "deep"), 12),
            outcome(&w, 3, 3, &s(3), 12),
        ];
        let c = canary_check(
            &w,
            &[
                ("solo", &solo.iter().flatten().cloned().collect::<Vec<_>>()),
                ("load", &load),
            ],
        );
        assert_eq!(c.leaks, 1, "{c:?}");
        assert_eq!(
            c.details,
            vec![Leak {
                request_index: 1,
                request_id: Some("rid1".into()),
                phase: "load".into(),
                tenant: 0,
                foreign_tenant: 1,
                canary: foreign,
                status: Some(200),
            }]
        );
        assert_eq!(c.responses_checked, 4 + 4);
        assert_eq!(c.own_canary_echoed, 8);

        let e = solo_equality(&solo, &load);
        assert_eq!((e.compared, e.mismatches, e.skipped), (4, 2, 0));
        let changed = e.details.iter().find(|m| m.request_index == 2).unwrap();
        let at = s(2).find("wide").unwrap();
        assert_eq!(
            changed.first_difference_at,
            Some(s(2)[..at].chars().count())
        );
        assert!(changed.expected.contains("wide") && changed.got.contains("deep"));
        let appended = e.details.iter().find(|m| m.request_index == 1).unwrap();
        assert_eq!(appended.first_difference_at, Some(s(1).chars().count()));
    }

    #[test]
    fn a_changed_token_count_alone_is_a_mismatch() {
        let w = workload();
        let solo = vec![Some(outcome(&w, 0, 0, "same", 5))];
        let e = solo_equality(&solo, &[outcome(&w, 0, 0, "same", 6)]);
        assert_eq!(e.mismatches, 1);
        assert_eq!(e.details[0].first_difference_at, None);
        assert_eq!(
            (e.details[0].expected_tokens, e.details[0].got_tokens),
            (Some(5), Some(6))
        );
    }

    #[test]
    fn over_long_must_be_4xx() {
        let w = workload();
        let ol = w.prompts.iter().find(|p| p.over_long).unwrap().id;
        let mut a = outcome(&w, 0, ol, "", 0);
        a.end = End::HttpError;
        a.status = Some(400);
        let b = outcome(&w, 1, ol, "text", 3); // 200: a violation
        let mut c = outcome(&w, 2, ol, "", 0);
        c.end = End::Transport;
        c.status = None;
        let r = overlong_check(&w, &[a.clone(), b.clone(), c.clone()], |_| false);
        assert_eq!(
            (r.sent, r.rejected_4xx, r.not_rejected.clone()),
            (3, 1, vec![1, 2])
        );
        let r = overlong_check(&w, &[a, b, c], |o| o.index == 2);
        assert_eq!((r.not_rejected, r.unanswered_during_outage), (vec![1], 1));
    }

    #[test]
    fn usage_ranges_exact_without_disconnects_and_bounded_with() {
        let w = workload();
        let solo: Vec<Option<Outcome>> =
            (0..4).map(|i| Some(outcome(&w, i, i, "abc", 10))).collect();
        let mut rej = outcome(&w, 1, 0, "", 0);
        rej.end = End::HttpError;
        rej.status = Some(400);
        let load = vec![outcome(&w, 0, 0, "abc", 10), rej];
        let e = expected_usage(&w, &solo, &[&load], |_| false);
        let loose = expected_usage(&w, &solo, &[&load], |o| o.index == 0);
        assert_eq!(loose[0].requests, Range { lo: 1, hi: 2 });
        assert!(e[0].is_exact());
        let exact = UsageTotals {
            requests: 2,
            input_tokens: 40,
            output_tokens: 10,
            errors: 1,
            cached_tokens: 0,
        };
        assert!(e[0].admits(&exact));
        assert!(!e[0].admits(&UsageTotals {
            output_tokens: 11,
            ..exact
        }));
        assert!(!e[0].admits(&UsageTotals {
            requests: 3,
            ..exact
        }));
        assert_eq!(e[1], ExpectedUsage::default());

        let mut d = outcome(&w, 2, 1, "ab", 0);
        d.end = End::Disconnected;
        d.completion_tokens = None;
        d.text_events = 3;
        let x = expected_for(&w, &solo, &d);
        assert_eq!(x.input_tokens, Range::exact(41));
        assert_eq!(x.output_tokens, Range { lo: 3, hi: 10 });
        assert_eq!(x.errors, Range { lo: 0, hi: 1 });
        // Gone before any text: the prompt may not have been charged.
        d.text_events = 0;
        let x0 = expected_for(&w, &solo, &d);
        assert_eq!(x0.input_tokens, Range { lo: 0, hi: 41 });
        // Refused before admission (limits, auth): no row at all.
        let mut limited = outcome(&w, 3, 1, "", 0);
        limited.end = End::HttpError;
        limited.status = Some(429);
        assert_eq!(expected_for(&w, &solo, &limited), ExpectedUsage::default());
        let mut refused = outcome(&w, 3, 1, "", 0);
        refused.end = End::Transport;
        refused.error = Some("connect".into());
        assert_eq!(expected_for(&w, &solo, &refused), ExpectedUsage::default());
        refused.error = Some("request".into());
        assert_eq!(
            expected_for(&w, &solo, &refused).requests,
            Range { lo: 0, hi: 1 }
        );
        let r = usage_check(
            &["t0".into(), "t1".into()],
            &[x, ExpectedUsage::default()],
            &[
                UsageTotals {
                    requests: 1,
                    input_tokens: 41,
                    output_tokens: 4,
                    errors: 1,
                    cached_tokens: 0,
                },
                UsageTotals::default(),
            ],
        );
        assert_eq!((r.mismatches, r.exact), (0, false));
        let r = usage_check(
            &["t0".into(), "t1".into()],
            &[x, ExpectedUsage::default()],
            &[
                UsageTotals {
                    requests: 1,
                    input_tokens: 41,
                    output_tokens: 2,
                    errors: 1,
                    cached_tokens: 0,
                },
                UsageTotals::default(),
            ],
        );
        assert_eq!(r.mismatches, 1);
    }

    #[test]
    fn cached_tokens_are_exact_for_complete_answers_and_bounded_otherwise() {
        let w = workload();
        let solo: Vec<Option<Outcome>> =
            (0..4).map(|i| Some(outcome(&w, i, i, "abc", 10))).collect();
        // Two complete answers of tenant 0 (prompt 0: 40 tokens), one a hit.
        let miss = outcome(&w, 0, 0, "abc", 10);
        let mut hit = outcome(&w, 1, 0, "abc", 10);
        hit.cached_tokens = Some(32);
        let e = expected_usage(&w, &solo, &[&[miss.clone(), hit.clone()]], |_| false);
        assert_eq!(e[0].cached_tokens, Range::exact(32));
        assert!(e[0].is_exact());
        let ledger = UsageTotals {
            requests: 2,
            input_tokens: 80,
            output_tokens: 20,
            errors: 0,
            cached_tokens: 32,
        };
        assert!(e[0].admits(&ledger));
        // A ledger that lost the hit, or charged one the answers did not report.
        for c in [0, 48] {
            assert!(!e[0].admits(&UsageTotals {
                cached_tokens: c,
                ..ledger
            }));
        }
        // A disconnect may have finished on the server with a hit: 0..=P.
        let mut d = outcome(&w, 2, 0, "ab", 0);
        d.end = End::Disconnected;
        d.cached_tokens = None;
        d.text_events = 2;
        assert_eq!(
            expected_for(&w, &solo, &d).cached_tokens,
            Range { lo: 0, hi: 40 }
        );
        // A validation 4xx and a refusal have none.
        let mut bad = outcome(&w, 3, 0, "", 0);
        bad.end = End::HttpError;
        bad.status = Some(400);
        assert_eq!(expected_for(&w, &solo, &bad).cached_tokens, Range::exact(0));
        // A server that does not report cached tokens: anything up to the prompt.
        let mut quiet = miss;
        quiet.cached_tokens = None;
        assert_eq!(
            expected_for(&w, &solo, &quiet).cached_tokens,
            Range { lo: 0, hi: 40 }
        );
        // Near a node kill the lower bound drops like the others'.
        let loose = expected_usage(&w, &solo, &[&[hit]], |_| true);
        assert_eq!(loose[0].cached_tokens, Range { lo: 0, hi: 32 });
        // Reports written before this field read back as 0.
        let old: UsageTotals =
            serde_json::from_str(r#"{"requests":1,"input_tokens":2,"output_tokens":3,"errors":0}"#)
                .unwrap();
        assert_eq!(old.cached_tokens, 0);
    }
}
