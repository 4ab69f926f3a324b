//! `tessera bench`: engine throughput on this machine, printed as JSON lines that
//! `scripts/bench.sh` and `scripts/bench_long.sh` put beside llama.cpp's figures
//! from the same run:
//! - prefill tokens/s of one prompt (time to its first token) at `--prompt-tokens`
//!   and at each of `--prefill-lengths` (default 512, 2,048, 6,000);
//! - decode tokens/s at batch 1 (after the `--prompt-tokens` prompt) and batch N,
//!   and the time until all N sequences have their first token (`batch_ttft_ms`:
//!   N 16-token prompts prefilled in one step, as at a server's 16 streams);
//! - decode TPOT at `--tpot-context` tokens of context (default 4,000): one
//!   sequence, `--tpot-tokens` tokens generated after a prompt of that length.

use crate::generate::model_path;
use anyhow::Result;
use clap::Args;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tessera_engine::{Engine, EngineConfig, Event, GenerateRequest};
use tessera_model::LoadedModel;

/// Arguments of `tessera bench`.
#[derive(Args, Debug)]
pub(crate) struct BenchArgs {
    /// GGUF model file (default: the fetched default model).
    #[arg(long, env = "TESSERA_MODEL")]
    model: Option<PathBuf>,
    /// Prompt length for the prefill measurement.
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    /// Output tokens per sequence for the decode measurements.
    #[arg(long, default_value_t = 128)]
    decode_tokens: usize,
    /// Concurrent sequences for the batched decode measurement.
    #[arg(long, default_value_t = 16)]
    batch: usize,
    /// Repetitions (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Prompt lengths for the long-prompt prefill measurements (comma-separated;
    /// `0` for none).
    #[arg(long, value_delimiter = ',', default_value = "512,2048,6000")]
    prefill_lengths: Vec<usize>,
    /// Context (prompt) length for the decode TPOT measurement (0: skip).
    #[arg(long, default_value_t = 4000)]
    tpot_context: usize,
    /// Tokens generated for the TPOT measurement.
    #[arg(long, default_value_t = 64)]
    tpot_tokens: usize,
    /// Skip the short measurements (256-token prefill, decode at batch 1 and N).
    #[arg(long)]
    long_only: bool,
}

/// Deterministic prompt of `n` ordinary tokens (a fixed text repeated), `salt` varies it.
fn prompt(m: &LoadedModel, n: usize, salt: usize) -> Vec<u32> {
    let text = format!(
        "Story {salt}: the lighthouse keeper counted ships in the harbor every night, \
         writing each name in a worn blue notebook beside the lamp. "
    );
    let unit = m.tokenizer.encode(&text, false).expect("tokenize");
    unit.iter().copied().cycle().take(n).collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> GenerateRequest {
    GenerateRequest {
        ignore_eos: true,
        ..GenerateRequest::new(0, prompt, max_tokens)
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn emit(metric: &str, extra: serde_json::Value, value: f64) {
    let mut o = serde_json::json!({"system": "tessera", "metric": metric, "value": value});
    if let (Some(o), Some(e)) = (o.as_object_mut(), extra.as_object()) {
        o.extend(e.clone());
    }
    println!("{o}");
}

/// Runs `reqs` together; returns (time until every request has its first token,
/// time from then until all finished, tokens generated after that point).
fn run_batch(engine: &mut Engine, reqs: Vec<GenerateRequest>) -> (Duration, Duration, usize) {
    let t0 = Instant::now();
    let mut rxs: Vec<_> = reqs
        .into_iter()
        .map(|r| engine.enqueue(engine.admit(r).expect("admit")))
        .collect();
    let mut counts = vec![0usize; rxs.len()];
    let mut all_first: Option<(Instant, usize)> = None;
    while engine.has_work() {
        engine.step();
        for (c, rx) in counts.iter_mut().zip(rxs.iter_mut()) {
            while let Ok(ev) = rx.try_recv() {
                match ev {
                    Event::Token { .. } => *c += 1,
                    Event::Error(e) => panic!("bench request failed: {e}"),
                    Event::Done { .. } => {}
                }
            }
        }
        if all_first.is_none() && counts.iter().all(|&c| c >= 1) {
            all_first = Some((Instant::now(), counts.iter().sum()));
        }
    }
    let end = Instant::now();
    let (t1, at_first) = all_first.expect("every request produced a token");
    (t1 - t0, end - t1, counts.iter().sum::<usize>() - at_first)
}

pub(crate) fn run(a: BenchArgs) -> Result<()> {
    let m = LoadedModel::load(&model_path(a.model)?)?;
    let cfg = EngineConfig {
        max_running: a.batch.max(1),
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(m.transformer.clone(), m.tokenizer.clone(), cfg);
    // Warm-up: page in weights, start the thread pool.
    run_batch(&mut engine, vec![request(prompt(&m, 32, 0), 4)]);

    let lengths = (!a.long_only).then_some(a.prompt_tokens);
    for n in lengths
        .into_iter()
        .chain(a.prefill_lengths.iter().copied().filter(|&n| n > 0))
    {
        let mut rates = Vec::new();
        for rep in 0..a.reps {
            let (ttft, _, _) = run_batch(&mut engine, vec![request(prompt(&m, n, rep), 1)]);
            rates.push(n as f64 / ttft.as_secs_f64());
        }
        let rate = median(rates);
        emit(
            "prefill_tok_s",
            serde_json::json!({"prompt_tokens": n, "ttft_ms": n as f64 / rate * 1e3}),
            rate,
        );
    }

    if a.tpot_context > 0 {
        let mut tpots = Vec::new();
        for rep in 0..a.reps {
            let req = request(prompt(&m, a.tpot_context, rep + 50), a.tpot_tokens + 1);
            let (_, decode, tokens) = run_batch(&mut engine, vec![req]);
            tpots.push(decode.as_secs_f64() * 1e3 / tokens as f64);
        }
        emit(
            "decode_tpot_ms",
            serde_json::json!({"batch": 1, "context_tokens": a.tpot_context,
                "decode_tokens": a.tpot_tokens}),
            median(tpots),
        );
    }

    for batch in [1, a.batch].into_iter().filter(|_| !a.long_only) {
        let (mut rates, mut ttfts) = (Vec::new(), Vec::new());
        for rep in 0..a.reps {
            // Batch 1 continues after a full-length prompt, batch N after 16-token
            // prompts: the same shapes scripts/bench_llamacpp.sh gives llama.cpp.
            let plen = if batch == 1 { a.prompt_tokens } else { 16 };
            let reqs = (0..batch)
                .map(|i| request(prompt(&m, plen, rep * 100 + i), a.decode_tokens))
                .collect();
            let (ttft, decode, tokens) = run_batch(&mut engine, reqs);
            rates.push(tokens as f64 / decode.as_secs_f64());
            ttfts.push(ttft.as_secs_f64() * 1e3);
        }
        if batch > 1 {
            // The first step of the batch: its N prompts prefilled together, the
            // output matrix applied to their N last tokens.
            emit(
                "batch_ttft_ms",
                serde_json::json!({"batch": batch, "prompt_tokens": 16}),
                median(ttfts),
            );
        }
        emit(
            "decode_tok_s",
            serde_json::json!({"batch": batch, "decode_tokens": a.decode_tokens,
                "prompt_tokens": if batch == 1 { a.prompt_tokens } else { 16 }}),
            median(rates),
        );
    }
    let weights_mb = m.transformer.weight_bytes() as f64 / 1e6;
    emit(
        "weight_bytes_per_step_mb",
        serde_json::json!({}),
        weights_mb,
    );
    let pool = engine.kv().pool();
    let pool_mb = (pool.capacity() * pool.layout().page_bytes()) as f64 / 1e6;
    emit(
        "kv_pool_mb",
        serde_json::json!({"tokens": pool.capacity_tokens()}),
        pool_mb,
    );
    if let Some(rss) = rss_mb() {
        emit("rss_mb", serde_json::json!({}), rss);
    }
    Ok(())
}

/// Resident set size of this process (Linux), in MB.
fn rss_mb() -> Option<f64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: f64 = s
        .lines()
        .find(|l| l.starts_with("VmRSS:"))?
        .split_whitespace()
        .nth(1)?
        .parse()
        .ok()?;
    Some(kb * 1024.0 / 1e6)
}
