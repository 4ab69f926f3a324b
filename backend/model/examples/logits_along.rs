//! Tessera's next-token logits along the token paths of the llama.cpp greedy
//! reference (`tests/data/greedy_reference.json`), teacher-forced, as JSON lines
//! for `scripts/exact_reference.py --compare` (numerics against an exact float64
//! forward pass).
//!
//! `cargo run --release -p tessera-model --example logits_along -- [EXACT_JSON] [MODEL] [GREEDY_JSON]`
//!
//! Per generated position: the case name, the step, our argmax and our logits at
//! the ids of interest (llama.cpp's top 2 and, given EXACT_JSON, the exact top 8).

use serde_json::{json, Value};
use tessera_model::kv::{KvManager, PagePool, SeqId};
use tessera_model::transformer::BatchRow;
use tessera_model::LoadedModel;

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let exact: Option<Value> = match args.next() {
        Some(p) => Some(serde_json::from_str(&std::fs::read_to_string(p)?)?),
        None => None,
    };
    let model = args.next().unwrap_or_else(|| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../models/SmolLM2-135M-Instruct.Q4_1.gguf"
        )
        .into()
    });
    let m = LoadedModel::load(std::path::Path::new(&model))?;
    let reference = args.next().unwrap_or_else(|| {
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/greedy_reference.json"
        )
        .into()
    });
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(reference)?)?;
    for (ci, c) in reference["cases"]
        .as_array()
        .expect("cases")
        .iter()
        .enumerate()
    {
        let (prompt, output) = (ids(&c["prompt_ids"]), ids(&c["output_ids"]));
        let tokens: Vec<u32> = prompt.iter().chain(&output).copied().collect();
        let mut kv = KvManager::new(PagePool::new(
            m.config().kv_layout(16),
            tokens.len().div_ceil(16),
            false,
        ));
        let seq = SeqId(1);
        kv.reserve(seq, 1, tokens.len())?;
        let first = prompt.len() - 1;
        let rows: Vec<BatchRow> = tokens
            .iter()
            .enumerate()
            .map(|(pos, &token)| BatchRow {
                seq,
                token,
                pos,
                want_logits: pos >= first && pos < first + output.len(),
            })
            .collect();
        let out = m.transformer.forward(&rows, &mut kv);
        anyhow::ensure!(out.failed.is_empty(), "integrity failure");
        for (row, logits) in out.logits {
            let step = row - first;
            let mut want: Vec<u64> = c["top2"][step]
                .as_array()
                .map(|t| vec![t[0].as_u64().unwrap_or(0), t[2].as_u64().unwrap_or(0)])
                .unwrap_or_default();
            if let Some(e) = &exact {
                for pair in e["cases"][ci]["top8"][step]
                    .as_array()
                    .into_iter()
                    .flatten()
                {
                    want.push(pair[0].as_u64().unwrap_or(0));
                }
            }
            let at: serde_json::Map<String, Value> = want
                .iter()
                .map(|&i| (i.to_string(), json!(logits[i as usize])))
                .collect();
            let argmax = tessera_model::sampling::argmax(&logits);
            println!(
                "{}",
                json!({"name": c["name"], "step": step, "argmax": argmax, "logits_at": at})
            );
        }
    }
    Ok(())
}
