//! What LoRA fine-tunes cost (issue 38 item 5), same run: output tokens/s of 16
//! greedy streams (different prompts, 128 tokens each, end-of-sequence ignored)
//! under no adapter, all under one adapter, and under 8 distinct adapters (two
//! streams each), every adapter rank `RANK` on all seven projections of every
//! block; configurations alternate within each round, median of `REPS` rounds; plus
//! each adapter's load time (checking and reading the file into f32) and memory.
//! Prints one JSON line per measurement, with the ratio to the base run.
//!
//! `cargo run --release -p tessera-engine --example lora_cost [-- RANK [REPS [TARGETS]]]`
//! (TARGETS: comma-separated, default all seven; `attn_q,attn_v` is PEFT's default)
//! (model: `TESSERA_MODEL` or the default model).

use std::sync::Arc;
use std::time::Instant;
use tessera_engine::testing::*;
use tessera_engine::{EngineConfig, GenerateRequest, LoraRef};
use tessera_model::lora::LoraWeights;
use tessera_model::testing::lora_file;
use tessera_model::LoadedModel;

const STREAMS: usize = 16;
const TOKENS: usize = 128;
const TARGETS: [&str; 7] = [
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Output tokens/s of 16 streams, stream `i` under `loras[i % loras.len()]`
/// (none when `loras` is empty).
fn run(m: &LoadedModel, prompts: &[Vec<u32>], loras: &[LoraRef]) -> f64 {
    let reqs: Vec<GenerateRequest> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut r = greedy(p.clone(), TOKENS);
            r.ignore_eos = true;
            r.lora = (!loras.is_empty()).then(|| loras[i % loras.len()].clone());
            r
        })
        .collect();
    let mut e = engine(m, EngineConfig::default());
    let t = Instant::now();
    let mut rxs = enqueue_all(&mut e, &reqs);
    e.run_to_completion();
    let secs = t.elapsed().as_secs_f64();
    let n: usize = rxs.iter_mut().map(|rx| drain(rx).ids.len()).sum();
    assert_eq!(n, STREAMS * TOKENS);
    n as f64 / secs
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let rank: usize = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(16);
    let reps: usize = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(3);
    let targets: Vec<&str> = match args.get(3) {
        Some(t) => t.split(',').collect(),
        None => TARGETS.to_vec(),
    };
    let tl = targets.join(",");
    let m = load();
    let layers = m.config().layers;
    let mut loads = Vec::new();
    let mut adapters = Vec::new();
    for i in 0..8 {
        let bytes = lora_file(&m, &targets, rank, 2.0 * rank as f32, 0.02, i);
        let t = Instant::now();
        let w = LoraWeights::load(&bytes, &m.lora_base, "bench", layers).unwrap();
        loads.push(t.elapsed().as_secs_f64() * 1e3);
        println!(
            "{}",
            serde_json::json!({"metric": "lora_adapter", "rank": rank, "targets": tl, "file_bytes": bytes.len(), "memory_bytes": w.bytes})
        );
        adapters.push(LoraRef {
            id: format!("bench-{i}"),
            weights: Some(Arc::new(w)),
            file: None,
        });
    }
    println!(
        "{}",
        serde_json::json!({"metric": "lora_load_ms", "rank": rank, "targets": tl, "value": median(loads)})
    );
    let prompts: Vec<Vec<u32>> = (0..STREAMS)
        .map(|i| {
            chat_prompt(
                &m,
                &format!("Write a long story about ship number {i} and its crew."),
            )
        })
        .collect();
    let configs: [(&str, &[LoraRef]); 3] = [
        ("base", &[]),
        ("1 adapter", &adapters[..1]),
        ("8 adapters", &adapters[..]),
    ];
    let mut tok_s: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    run(&m, &prompts, &[]); // warm-up
    for _ in 0..reps {
        for (c, (_, loras)) in configs.iter().enumerate() {
            tok_s[c].push(run(&m, &prompts, loras));
        }
    }
    let base = median(tok_s[0].clone());
    for ((what, _), v) in configs.iter().zip(tok_s) {
        let med = median(v.clone());
        println!(
            "{}",
            serde_json::json!({
                "metric": "lora_16_stream_tok_s", "config": what, "rank": rank, "targets": tl,
                "value": med, "ratio_to_base": med / base, "runs": v,
            })
        );
    }
}
