//! Prompt-lookup speculation, same run with and without (issue 37): single-stream
//! output tokens/s on prompts whose answers repeat their input (code editing,
//! summarising, copying) and on open-ended ones, and 16 streams together; greedy,
//! alternating plain and speculative runs, median of `REPS`. Prints one JSON line
//! per measurement.
//!
//! `cargo run --release -p tessera-engine --example speculation [-- K [REPS]]`
//! (model: `TESSERA_MODEL` or the default model; `TESSERA_THREADS` threads).

use std::time::Instant;
use tessera_engine::testing::*;
use tessera_engine::{Engine, EngineConfig, Event, GenerateRequest, SPECULATE_MAX_DECODES};
use tessera_model::LoadedModel;

const CODE: &str = "fn total(items: &[Item]) -> u64 {\n    let mut sum = 0;\n    for item in items {\n        if item.active {\n            sum += item.price * item.count;\n        }\n    }\n    sum\n}\n";
const ARTICLE: &str = "The city council met on Tuesday to discuss the new bicycle lanes. \
    The council approved a plan to build twelve kilometres of protected lanes along the \
    river, connecting the old town with the university. Construction starts in March and \
    ends in October. The plan costs four million euros, paid by the regional transport \
    fund. Shop owners on Market Street asked for more parking; the council promised a \
    study of delivery zones before the lanes open.";

fn prompts(m: &LoadedModel) -> Vec<(&'static str, Vec<u32>)> {
    vec![
        (
            "code edit",
            chat_prompt(
                m,
                &format!("Rename the variable `sum` to `total_price` in this function and return the whole function:\n{CODE}"),
            ),
        ),
        (
            "summarise",
            chat_prompt(
                m,
                &format!("Summarise this article, quoting its key sentences:\n{ARTICLE}"),
            ),
        ),
        (
            "open-ended",
            chat_prompt(m, "Write a short story about a lighthouse keeper who counts ships."),
        ),
        (
            "open-ended 2",
            chat_prompt(m, "Explain how bread is made, step by step."),
        ),
    ]
}

/// Output tokens/s of `reqs` run together on a fresh engine, the tokens generated
/// and the drafts drafted and accepted: one request's decode rate (1 / TPOT, its
/// prefill excluded), or several requests' total over the whole run.
fn tok_s(m: &LoadedModel, speculate: usize, reqs: &[GenerateRequest]) -> (f64, usize, u64, u64) {
    let mut e: Engine = engine(
        m,
        EngineConfig {
            speculate,
            // Drafting for every stream measured (the policy under test).
            speculate_max_decodes: reqs.len().max(SPECULATE_MAX_DECODES),
            ..EngineConfig::default()
        },
    );
    let mut rxs = enqueue_all(&mut e, reqs);
    let t0 = Instant::now();
    e.run_to_completion();
    let secs = t0.elapsed().as_secs_f64();
    let (mut n, mut tpot) = (0, None);
    for rx in &mut rxs {
        while let Ok(ev) = rx.try_recv() {
            match ev {
                Event::Token { .. } => n += 1,
                Event::Done { usage, .. } => tpot = Some(usage.tpot.as_secs_f64()),
                Event::Error(e) => panic!("{e}"),
            }
        }
    }
    let s = e.speculation();
    let rate = match tpot {
        Some(t) if reqs.len() == 1 && t > 0.0 => 1.0 / t,
        _ => n as f64 / secs,
    };
    (rate, n, s.drafted, s.accepted)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let k: usize = args.next().map_or(4, |a| a.parse().expect("K"));
    let reps: usize = args.next().map_or(3, |a| a.parse().expect("REPS"));
    let m = load();
    // Warm-up: weights paged in, threads started.
    tok_s(&m, 0, &[greedy(chat_prompt(&m, "Hi"), 8)]);
    let max_tokens = 128;
    let mut all: Vec<GenerateRequest> = Vec::new();
    for (name, p) in prompts(&m) {
        let req = greedy(p, max_tokens);
        all.push(req.clone());
        let (mut plain, mut spec) = (Vec::new(), Vec::new());
        let mut last = (0, 0, 0);
        for _ in 0..reps {
            plain.push(tok_s(&m, 0, std::slice::from_ref(&req)).0);
            let (t, n, d, a) = tok_s(&m, k, std::slice::from_ref(&req));
            spec.push(t);
            last = (n, d as usize, a as usize);
        }
        let (p, s) = (median(plain), median(spec));
        println!(
            "{{\"prompt\":\"{name}\",\"streams\":1,\"k\":{k},\"plain_tok_s\":{p:.1},\"spec_tok_s\":{s:.1},\"ratio\":{:.2},\"tokens\":{},\"drafted\":{},\"accepted\":{}}}",
            s / p,
            last.0,
            last.1,
            last.2
        );
    }
    // N streams of the four prompts (cycled), drafting for all of them: where the
    // draft rows stop paying is the engine's `speculate_max_decodes`.
    for streams in [2, 4, 8, 16] {
        let many: Vec<GenerateRequest> = all.iter().cycle().take(streams).cloned().collect();
        let (mut plain, mut spec) = (Vec::new(), Vec::new());
        for _ in 0..reps {
            plain.push(tok_s(&m, 0, &many).0);
            spec.push(tok_s(&m, k, &many).0);
        }
        let (p, s) = (median(plain), median(spec));
        println!(
            "{{\"prompt\":\"the four, cycled\",\"streams\":{streams},\"k\":{k},\"plain_tok_s\":{p:.1},\"spec_tok_s\":{s:.1},\"ratio\":{:.2}}}",
            s / p
        );
    }
}
