//! Speculation, same run with and without (issue 37): single-stream output
//! tokens/s on prompts whose answers repeat their input (code editing,
//! summarising, copying) and on open-ended ones, and several streams together;
//! greedy, alternating plain and speculative runs, median of `REPS`. Prints one
//! JSON line per measurement.
//!
//! `cargo run --release -p tessera-engine --example speculation [-- K [REPS]]`
//! (model: `TESSERA_MODEL` or the default model; `TESSERA_THREADS` threads). With
//! `TESSERA_DRAFT_MODEL=PATH` (a model of the same tokenizer) each measurement
//! runs three ways, plain, prompt lookup (`ngram`) and draft model (`draft`), and
//! the streams go 1, 2, 4, 16.

use std::time::Instant;
use tessera_engine::testing::*;
use tessera_engine::{
    DraftModel, Engine, EngineConfig, Event, GenerateRequest, SpecMode, SPECULATE_MAX_DECODES,
};
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
fn tok_s(
    m: &LoadedModel,
    speculate: usize,
    draft: Option<&DraftModel>,
    reqs: &[GenerateRequest],
) -> (f64, usize, u64, u64) {
    let mut e: Engine = engine(
        m,
        EngineConfig {
            speculate,
            // Drafting for every stream measured (the policy under test).
            speculate_max_decodes: reqs.len().max(SPECULATE_MAX_DECODES),
            draft: draft.cloned(),
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

/// The ways each measurement runs: (label, k, draft model).
fn modes(k: usize, draft: Option<&DraftModel>) -> Vec<(&'static str, usize, Option<&DraftModel>)> {
    let mut v = vec![("plain", 0, None)];
    match draft {
        None => v.push(("spec", k, None)),
        Some(d) => {
            v.push(("ngram", k, None));
            v.push(("draft", k, Some(d)));
        }
    }
    v
}

fn main() {
    let mut args = std::env::args().skip(1);
    let k: usize = args.next().map_or(4, |a| a.parse().expect("K"));
    let reps: usize = args.next().map_or(3, |a| a.parse().expect("REPS"));
    let m = load();
    let small = std::env::var("TESSERA_DRAFT_MODEL")
        .ok()
        .map(|p| LoadedModel::load(std::path::Path::new(&p)).expect("load the draft model"));
    let draft = small.as_ref().map(|d| {
        DraftModel::new(d.transformer.clone(), &d.tokenizer, &m.tokenizer).expect("a draft model")
    });
    let modes = modes(k, draft.as_ref());
    // Warm-up: weights paged in, threads started.
    for &(_, k, d) in &modes {
        tok_s(&m, k, d, &[greedy(chat_prompt(&m, "Hi"), 8)]);
    }
    let max_tokens = 128;
    let mut all: Vec<GenerateRequest> = Vec::new();
    for (name, p) in prompts(&m) {
        let req = greedy(p, max_tokens);
        all.push(req.clone());
        let mut rates = vec![Vec::new(); modes.len()];
        let mut last = vec![(0, 0, 0); modes.len()];
        for _ in 0..reps {
            for (i, &(_, k, d)) in modes.iter().enumerate() {
                let mut r = req.clone();
                r.speculate_mode = d.map(|_| SpecMode::Draft);
                let (t, n, dr, a) = tok_s(&m, k, d, std::slice::from_ref(&r));
                rates[i].push(t);
                last[i] = (n, dr as usize, a as usize);
            }
        }
        let plain = median(rates[0].clone());
        for (i, &(label, ..)) in modes.iter().enumerate().skip(1) {
            let s = median(rates[i].clone());
            println!(
                "{{\"prompt\":\"{name}\",\"streams\":1,\"mode\":\"{label}\",\"k\":{k},\"plain_tok_s\":{plain:.1},\"spec_tok_s\":{s:.1},\"ratio\":{:.2},\"tokens\":{},\"drafted\":{},\"accepted\":{}}}",
                s / plain,
                last[i].0,
                last[i].1,
                last[i].2
            );
        }
    }
    // N streams of the four prompts (cycled), drafting for all of them: where the
    // draft rows stop paying is the engine's `speculate_max_decodes`.
    let streams: &[usize] = if draft.is_some() {
        &[2, 4, 16]
    } else {
        &[2, 4, 8, 16]
    };
    for &streams in streams {
        let many: Vec<GenerateRequest> = all.iter().cycle().take(streams).cloned().collect();
        let mut rates = vec![Vec::new(); modes.len()];
        for _ in 0..reps {
            for (i, &(_, k, d)) in modes.iter().enumerate() {
                rates[i].push(tok_s(&m, k, d, &many).0);
            }
        }
        let plain = median(rates[0].clone());
        for (i, &(label, ..)) in modes.iter().enumerate().skip(1) {
            let s = median(rates[i].clone());
            println!(
                "{{\"prompt\":\"the four, cycled\",\"streams\":{streams},\"mode\":\"{label}\",\"k\":{k},\"plain_tok_s\":{plain:.1},\"spec_tok_s\":{s:.1},\"ratio\":{:.2}}}",
                s / plain
            );
        }
    }
}
