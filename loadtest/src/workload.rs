//! The seeded workload: per-tenant canaries and prompts, and the request sequence
//! (tenant, prompt, streaming, over-long, disconnect point, arrival time).
//!
//! Everything is drawn from ChaCha8 generators seeded by `--seed`, so the same
//! arguments give the same prompts and the same request sequence against any
//! server (the basis of `--compare`).

use crate::args::{LenDist, LoadtestArgs, Mode};
use crate::error::{InputFile, LoadtestError};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Exp};
use serde::Serialize;
use std::sync::Arc;
use std::time::Duration;

/// Characters of a canary's random part (no look-alikes such as 0/O, 1/I).
const CANARY_ALPHABET: &[u8] = b"ABCDEFGHJKLMNPQRSTUVWXYZ23456789";

/// Neutral filler sentences; prompts are built from them to a word count.
const CORPUS: &[&str] = &[
    "The river bends twice before it reaches the old stone bridge.",
    "Farmers in the valley plant barley in spring and harvest it in late summer.",
    "A lighthouse keeper writes the weather in a notebook every evening.",
    "The library on the hill keeps maps that are more than two hundred years old.",
    "Trains leave the northern station every twenty minutes during the day.",
    "Bees visit the lavender field from morning until the air gets cold.",
    "The baker opens the shop at six and sells bread until it runs out.",
    "Children in the town learn to swim in the lake behind the school.",
    "An old clock in the square has not shown the right time for years.",
    "Fishing boats return to the harbour when the tide turns in the afternoon.",
    "The museum shows tools that people used to weave cloth by hand.",
    "Snow covers the mountain pass from November until the end of March.",
    "A small orchestra plays in the park on the first Sunday of each month.",
    "The market sells apples, pears, cheese and honey from nearby farms.",
    "Engineers inspect the dam every year before the autumn rains begin.",
    "Wild horses graze on the plain where the road turns toward the coast.",
    "The ferry crosses the bay in forty minutes when the sea is calm.",
    "Students build a model of the solar system for the science fair.",
    "The garden behind the house has roses, tomatoes and a pear tree.",
    "A narrow path climbs through the forest to a waterfall and a pool.",
];

/// What a chat prompt asks for after repeating its canary.
const TASKS: &[&str] = &[
    "write two sentences about the sea",
    "name three colours of autumn leaves",
    "describe a quiet morning in a village",
    "explain in one sentence why the sky is blue",
    "list four animals that live in forests",
    "write a short greeting for a neighbour",
    "describe the taste of a fresh apple",
    "give two tips for learning to cook",
    "write a sentence about trains",
    "explain what a lighthouse is for",
    "describe a busy market in one sentence",
    "name three things people take on a picnic",
];

/// One distinct prompt of one tenant.
#[derive(Clone, Debug, Serialize)]
pub struct Prompt {
    /// Index in [`Workload::prompts`].
    pub id: usize,
    /// Owner (index into the tenant list).
    pub tenant: usize,
    /// The text sent (a user message in chat mode, the raw prompt otherwise).
    #[serde(skip)]
    pub text: String,
    /// `max_tokens` of every request with this prompt.
    pub max_tokens: usize,
    /// The canary this prompt carries (unique to its tenant).
    pub canary: String,
    /// Longer than the context window: every request must get a 4xx.
    pub over_long: bool,
    /// Words in the text (a lower bound on its tokens).
    pub words: usize,
}

/// One request of the sequence.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PlannedRequest {
    /// Position in the sequence (0-based).
    pub index: usize,
    /// Tenant index.
    pub tenant: usize,
    /// Prompt id.
    pub prompt: usize,
    /// Stream the response.
    pub stream: bool,
    /// Disconnect after this many text events (0: right after the response
    /// headers); `None`: read to the end.
    pub disconnect_after: Option<usize>,
    /// Open loop: arrival time after the start of the load phase.
    pub at: Option<Duration>,
}

/// The prompts and canaries of a run, and the parameters of its request sequence.
#[derive(Clone, Debug)]
pub struct Workload {
    /// Every distinct prompt: per tenant `prompts_per_tenant` normal ones, then one
    /// over-long one per tenant.
    pub prompts: Vec<Prompt>,
    /// Canaries per tenant (tenant index -> canaries of its prompts).
    pub canaries: Vec<Vec<String>>,
    /// Per tenant, the text every one of its normal prompts starts with
    /// (`--shared-prefix-tokens`; empty strings without it).
    pub prefixes: Vec<String>,
    /// Normal prompt ids per tenant.
    normal: Vec<Vec<usize>>,
    /// Over-long prompt id per tenant.
    over_long: Vec<usize>,
    seed: u64,
    rate: Option<f64>,
    stream_share: f64,
    overlong_share: f64,
    disconnect_share: f64,
}

/// A fresh canary: `CANARY-XXXX-XXXX` with 8 random characters (40 bits).
pub fn canary(rng: &mut impl Rng) -> String {
    let mut part = || -> String {
        (0..4)
            .map(|_| CANARY_ALPHABET[rng.random_range(0..CANARY_ALPHABET.len())] as char)
            .collect()
    };
    format!("CANARY-{}-{}", part(), part())
}

/// Filler text of at least `words` words drawn from the corpus.
fn filler(rng: &mut impl Rng, words: usize) -> String {
    let mut out = String::new();
    let mut n = 0;
    while n < words {
        let s = CORPUS[rng.random_range(0..CORPUS.len())];
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(s);
        n += s.split_whitespace().count();
    }
    out
}

/// The shared prefix of one tenant (`--shared-prefix-tokens`): exactly `words`
/// words, starting with a random tag (so two tenants' prefixes differ from their
/// first tokens on), then corpus sentences.
fn shared_prefix(rng: &mut impl Rng, words: usize) -> String {
    let tag: String = (0..8)
        .map(|_| CANARY_ALPHABET[rng.random_range(0..CANARY_ALPHABET.len())] as char)
        .collect();
    let head = format!("Background notes {tag} for this conversation:");
    let body = filler(rng, words);
    head.split_whitespace()
        .chain(body.split_whitespace())
        .take(words)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The prompt text: the tenant's shared prefix (if any) first, so that every
/// prompt of the tenant begins with the same tokens; then the canary and the
/// question.
fn render(mode: Mode, prefix: &str, context: &str, canary: &str, task: &str) -> String {
    let body = render_body(mode, context, canary, task);
    if prefix.is_empty() {
        body
    } else {
        format!("{prefix}\n\n{body}")
    }
}

fn render_body(mode: Mode, context: &str, canary: &str, task: &str) -> String {
    match mode {
        // The canary first (its KV is in the first pages), the question last: the
        // small default model answers with the code, then the task.
        Mode::Chat => format!(
            "The secret code is {canary}.\n\n{context}\n\nWhat is the secret code? After it, {task}."
        ),
        Mode::Raw => format!("{context}\nThe secret code is {canary}. Again, the secret code is"),
    }
}

/// Reads a JSONL prompts file: each line a JSON string or an object with
/// `prompt` and optional `max_tokens`.
fn read_prompts_file(
    path: &std::path::Path,
) -> Result<Vec<(String, Option<usize>)>, LoadtestError> {
    let text = std::fs::read_to_string(path).map_err(|source| LoadtestError::ReadInput {
        file: InputFile::Prompts,
        path: path.into(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let bad = |problem, json| LoadtestError::BadPrompt {
            path: path.into(),
            line: i + 1,
            problem,
            json,
        };
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad("not JSON", Some(e)))?;
        let item = match &v {
            serde_json::Value::String(s) => (s.clone(), None),
            serde_json::Value::Object(o) => {
                let p = o
                    .get("prompt")
                    .and_then(|p| p.as_str())
                    .ok_or_else(|| bad("needs a string `prompt`", None))?;
                let m = o
                    .get("max_tokens")
                    .and_then(|m| m.as_u64())
                    .map(|m| m as usize);
                (p.to_string(), m)
            }
            _ => return Err(bad("must be a string or an object", None)),
        };
        out.push(item);
    }
    if out.is_empty() {
        return Err(LoadtestError::NoPrompts { path: path.into() });
    }
    Ok(out)
}

impl Workload {
    /// Builds the prompts for `tenants` tenants. `context_window` (tokens) sizes the
    /// over-long prompts: each has more words than that.
    ///
    /// With `--shared-prefix-tokens N` each tenant gets its own N-word prefix,
    /// drawn from a generator of its own (so the rest of the workload is the
    /// same as without the flag), put in front of each of its normal prompts.
    ///
    /// # Errors
    /// An unreadable or malformed `--prompts-file`; a shared prefix that does
    /// not fit the context window.
    pub fn new(
        args: &LoadtestArgs,
        tenants: usize,
        context_window: usize,
    ) -> Result<Self, LoadtestError> {
        Self::for_windows(args, tenants, context_window, context_window)
    }

    /// [`Self::new`] for models of different context windows (tokens): normal
    /// prompts and shared prefixes fit the `smallest`, over-long prompts exceed
    /// the `largest` (so every model must refuse them).
    ///
    /// # Errors
    /// As [`Self::new`].
    pub fn for_windows(
        args: &LoadtestArgs,
        tenants: usize,
        smallest: usize,
        largest: usize,
    ) -> Result<Self, LoadtestError> {
        let context_window = smallest;
        let file = match &args.prompts_file {
            Some(p) => Some(read_prompts_file(p)?),
            None => None,
        };
        let prefixes: Vec<String> = match args.shared_prefix_tokens {
            Some(n) if n >= context_window => {
                return Err(LoadtestError::SharedPrefixTooLong {
                    tokens: n,
                    context_window,
                })
            }
            Some(n) => {
                let mut prng = ChaCha8Rng::seed_from_u64(args.seed ^ 0x05ba_7ed0_9f1c_ed00);
                (0..tenants).map(|_| shared_prefix(&mut prng, n)).collect()
            }
            None => vec![String::new(); tenants],
        };
        let mut rng = ChaCha8Rng::seed_from_u64(args.seed);
        let mut prompts = Vec::new();
        let mut canaries = vec![Vec::new(); tenants];
        let mut normal = vec![Vec::new(); tenants];
        let mut over_long = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut fresh_canary = |rng: &mut ChaCha8Rng| loop {
            let c = canary(rng);
            if seen.insert(c.clone()) {
                return c;
            }
        };
        for (t, tenant_prompts) in normal.iter_mut().enumerate() {
            for _ in 0..args.prompts_per_tenant {
                let c = fresh_canary(&mut rng);
                let task = TASKS[rng.random_range(0..TASKS.len())];
                let (text, max_tokens) = match &file {
                    Some(items) => {
                        let (p, m) = &items[rng.random_range(0..items.len())];
                        let text = render(args.mode, &prefixes[t], p, &c, task);
                        (text, m.unwrap_or_else(|| args.output_len.sample(&mut rng)))
                    }
                    None => {
                        let words = args.prompt_len.sample(&mut rng);
                        let ctx = filler(&mut rng, words);
                        (
                            render(args.mode, &prefixes[t], &ctx, &c, task),
                            args.output_len.sample(&mut rng),
                        )
                    }
                };
                let id = prompts.len();
                tenant_prompts.push(id);
                canaries[t].push(c.clone());
                prompts.push(Prompt {
                    id,
                    tenant: t,
                    words: text.split_whitespace().count(),
                    text,
                    max_tokens: max_tokens.max(1),
                    canary: c,
                    over_long: false,
                });
            }
        }
        for (t, tenant_canaries) in canaries.iter_mut().enumerate() {
            let c = fresh_canary(&mut rng);
            let ctx = filler(&mut rng, largest.max(smallest) + 256);
            let text = render(args.mode, "", &ctx, &c, TASKS[0]);
            let id = prompts.len();
            over_long.push(id);
            tenant_canaries.push(c.clone());
            prompts.push(Prompt {
                id,
                tenant: t,
                words: text.split_whitespace().count(),
                text,
                max_tokens: 16,
                canary: c,
                over_long: true,
            });
        }
        Ok(Self {
            prompts,
            canaries,
            prefixes,
            normal,
            over_long,
            seed: args.seed,
            rate: args.rate,
            stream_share: args.stream_share,
            overlong_share: args.overlong_share,
            disconnect_share: args.disconnect_share,
        })
    }

    /// Number of tenants.
    pub fn tenants(&self) -> usize {
        self.canaries.len()
    }

    /// The request sequence (infinite; the run length cuts it).
    pub fn requests(self: &Arc<Self>) -> RequestGen {
        RequestGen {
            w: self.clone(),
            rng: ChaCha8Rng::seed_from_u64(self.seed ^ 0x5eed_f4e7_1e57),
            index: 0,
            clock: 0.0,
            turn: vec![0; self.tenants()],
        }
    }

    /// The normal (not over-long) prompts, in id order.
    pub fn normal_prompts(&self) -> impl Iterator<Item = &Prompt> {
        self.prompts.iter().filter(|p| !p.over_long)
    }
}

/// Iterator over the seeded request sequence.
#[derive(Debug)]
pub struct RequestGen {
    w: Arc<Workload>,
    rng: ChaCha8Rng,
    index: usize,
    /// Open loop: arrival time of the last request, in seconds.
    clock: f64,
    /// Per tenant: normal prompts used so far.
    turn: Vec<usize>,
}

impl RequestGen {
    /// Requests drawn so far.
    pub fn issued(&self) -> usize {
        self.index
    }
}

impl Iterator for RequestGen {
    type Item = PlannedRequest;
    fn next(&mut self) -> Option<PlannedRequest> {
        let w = self.w.clone();
        let rng = &mut self.rng;
        let tenant = rng.random_range(0..w.tenants());
        let u: f64 = rng.random();
        let stream_draw: f64 = rng.random();
        // Each tenant's prompts in turn: as many distinct prompts as possible
        // (no server-side prompt cache can make a repeat look fast).
        let normal = &w.normal[tenant];
        let pick = normal[self.turn[tenant] % normal.len()];
        self.turn[tenant] += 1;
        let disconnect_draw = rng.random_range(0..w.prompts[pick].max_tokens);
        let (prompt, stream, disconnect_after) = if u < w.overlong_share {
            (w.over_long[tenant], stream_draw < w.stream_share, None)
        } else if u < w.overlong_share + w.disconnect_share {
            (pick, true, Some(disconnect_draw))
        } else {
            (pick, stream_draw < w.stream_share, None)
        };
        let at = w.rate.map(|r| {
            // Poisson arrivals: exponential gaps with mean 1/rate.
            let gap = Exp::new(r).map(|e| e.sample(rng)).unwrap_or(0.0);
            self.clock += gap;
            Duration::from_secs_f64(self.clock)
        });
        let r = PlannedRequest {
            index: self.index,
            tenant,
            prompt,
            stream,
            disconnect_after,
            at,
        };
        self.index += 1;
        Some(r)
    }
}

/// Summary of a length distribution for the report.
pub fn describe(d: &LenDist) -> String {
    match d {
        LenDist::Fixed { n } => format!("fixed:{n}"),
        LenDist::Uniform { lo, hi } => format!("uniform:{lo}:{hi}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::args::parse_args;

    fn args(extra: &[&str]) -> LoadtestArgs {
        let mut v = vec!["x"];
        v.extend_from_slice(extra);
        parse_args(v)
    }

    #[test]
    fn same_seed_same_workload_other_seed_other() {
        let a = args(&["--seed", "7", "--rate", "5", "--overlong-share", "0.2"]);
        let w1 = Arc::new(Workload::new(&a, 3, 64).unwrap());
        let w2 = Arc::new(Workload::new(&a, 3, 64).unwrap());
        let s1: Vec<_> = w1.requests().take(50).collect();
        let s2: Vec<_> = w2.requests().take(50).collect();
        assert_eq!(s1, s2);
        assert_eq!(
            w1.prompts.iter().map(|p| &p.text).collect::<Vec<_>>(),
            w2.prompts.iter().map(|p| &p.text).collect::<Vec<_>>()
        );
        let w3 = Workload::new(&args(&["--seed", "8", "--rate", "5"]), 3, 64).unwrap();
        assert_ne!(w1.prompts[0].text, w3.prompts[0].text);
        // Arrivals increase; roughly 5 per second.
        let last = s1.last().unwrap().at.unwrap().as_secs_f64();
        assert!(s1.windows(2).all(|p| p[0].at <= p[1].at));
        assert!(last > 2.0 && last < 30.0, "{last}");
    }

    #[test]
    fn prompts_carry_their_tenants_canaries_and_over_long_ones_are_long() {
        let a = args(&["--prompts-per-tenant", "3"]);
        let w = Workload::new(&a, 4, 300).unwrap();
        assert_eq!(w.prompts.len(), 4 * 3 + 4);
        let all: std::collections::HashSet<_> = w.canaries.iter().flatten().collect();
        assert_eq!(all.len(), 16, "canaries are unique");
        for p in &w.prompts {
            assert!(p.text.contains(&p.canary));
            assert!(w.canaries[p.tenant].contains(&p.canary));
            if p.over_long {
                assert!(p.words > 300 + 256);
            }
        }
    }

    #[test]
    fn each_tenant_uses_all_its_prompts_before_repeating_one() {
        let a = args(&["--prompts-per-tenant", "5"]);
        let w = Arc::new(Workload::new(&a, 3, 64).unwrap());
        let reqs: Vec<_> = w.requests().take(40).collect();
        for t in 0..3 {
            let used: Vec<usize> = reqs
                .iter()
                .filter(|r| r.tenant == t)
                .map(|r| r.prompt)
                .collect();
            let first: std::collections::HashSet<_> = used.iter().take(5).collect();
            assert_eq!(first.len(), used.len().min(5), "{used:?}");
        }
    }

    #[test]
    fn shared_prefix_is_the_same_within_a_tenant_and_differs_across() {
        let plain = Workload::new(
            &args(&["--seed", "4", "--prompts-per-tenant", "3"]),
            3,
            4096,
        )
        .unwrap();
        let a = args(&[
            "--seed",
            "4",
            "--prompts-per-tenant",
            "3",
            "--shared-prefix-tokens",
            "200",
        ]);
        let w = Workload::new(&a, 3, 4096).unwrap();
        assert_eq!(w.prefixes.len(), 3);
        for (t, pre) in w.prefixes.iter().enumerate() {
            assert_eq!(pre.split_whitespace().count(), 200, "{pre}");
            for p in w.normal_prompts().filter(|p| p.tenant == t) {
                // The prefix first; the canary and question after it, as without
                // the flag (the rest of the workload does not change).
                let rest = p.text.strip_prefix(pre.as_str()).expect("prefix first");
                assert_eq!(rest.trim_start(), plain.prompts[p.id].text);
                assert!(p.text.find(&p.canary).unwrap() > pre.len());
                assert_eq!(p.max_tokens, plain.prompts[p.id].max_tokens);
            }
        }
        // Per tenant different from the first words on.
        let firsts: std::collections::HashSet<_> = w
            .prefixes
            .iter()
            .map(|p| p.split_whitespace().take(3).collect::<Vec<_>>())
            .collect();
        assert_eq!(firsts.len(), 3);
        // Over-long prompts carry no prefix; the request sequence is unchanged.
        assert!(w
            .prompts
            .iter()
            .filter(|p| p.over_long)
            .all(|p| !p.text.starts_with(&w.prefixes[p.tenant])));
        let (wa, wb) = (Arc::new(w), Arc::new(plain));
        assert_eq!(
            wa.requests().take(30).collect::<Vec<_>>(),
            wb.requests().take(30).collect::<Vec<_>>()
        );
        // Same seed, same prefixes; and a prefix that cannot fit is refused.
        assert_eq!(Workload::new(&a, 3, 4096).unwrap().prefixes, wa.prefixes);
        assert!(Workload::new(&a, 3, 200).is_err());
        assert!(args(&["--shared-prefix-tokens", "0"]).validate().is_err());
    }

    #[test]
    fn shares_are_respected() {
        let a = args(&[
            "--overlong-share",
            "0.25",
            "--disconnect-share",
            "0.25",
            "--stream-share",
            "0",
        ]);
        let w = Arc::new(Workload::new(&a, 2, 64).unwrap());
        let reqs: Vec<_> = w.requests().take(2000).collect();
        let over = reqs
            .iter()
            .filter(|r| w.prompts[r.prompt].over_long)
            .count();
        let disc = reqs.iter().filter(|r| r.disconnect_after.is_some()).count();
        assert!((400..600).contains(&over), "{over}");
        assert!((400..600).contains(&disc), "{disc}");
        // Disconnecting requests stream; the others follow --stream-share 0.
        assert!(reqs
            .iter()
            .all(|r| r.stream == r.disconnect_after.is_some()));
        assert!(reqs.iter().all(|r| r
            .disconnect_after
            .is_none_or(|k| k < w.prompts[r.prompt].max_tokens)));
    }
}
