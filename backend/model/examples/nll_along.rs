//! Per-token negative log-likelihood of a token sequence under Tessera's forward
//! pass, against an exact reference's (`scripts/perplexity.py reference` output):
//! the mean NLL difference (the perplexity bias) and its RMS, without a server.
//!
//! `cargo run --release -p tessera-model --example nll_along -- MODEL IDS_JSON [REFERENCE_JSON]`
//!
//! IDS_JSON is `scripts/data/tinyshakespeare-4k.FAM.ids.json` (`{"ids": [...]}` or a
//! bare list); the whole sequence is one window, computed in 512-token chunks.

use serde_json::Value;
use tessera_model::kv::{KvManager, PagePool, SeqId};
use tessera_model::transformer::BatchRow;
use tessera_model::LoadedModel;

fn main() -> anyhow::Result<()> {
    let mut args = std::env::args().skip(1);
    let model = args.next().expect("MODEL");
    let ids: Value = serde_json::from_str(&std::fs::read_to_string(args.next().expect("IDS"))?)?;
    let ids = ids.get("ids").unwrap_or(&ids);
    let tokens: Vec<u32> = ids
        .as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect();
    let reference: Option<Vec<f64>> = match args.next() {
        Some(p) => {
            let v: Value = serde_json::from_str(&std::fs::read_to_string(p)?)?;
            Some(
                v["nll"]["window"]
                    .as_array()
                    .expect("nll.window")
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect(),
            )
        }
        None => None,
    };
    let m = LoadedModel::load(std::path::Path::new(&model))?;
    let mut kv = KvManager::new(PagePool::new(
        m.config().kv_layout(16),
        tokens.len().div_ceil(16),
        false,
    ));
    let seq = SeqId(1);
    kv.reserve(seq, 1, tokens.len())?;
    let mut nll = Vec::with_capacity(tokens.len() - 1);
    for start in (0..tokens.len() - 1).step_by(512) {
        let end = (start + 512).min(tokens.len() - 1);
        let rows: Vec<BatchRow> = (start..end)
            .map(|pos| BatchRow {
                seq,
                token: tokens[pos],
                pos,
                want_logits: true,
            })
            .collect();
        let out = m.transformer.forward(&rows, &mut kv);
        anyhow::ensure!(out.failed.is_empty(), "integrity failure");
        let mut logits = out.logits;
        logits.sort_by_key(|(r, _)| *r);
        for (r, l) in logits {
            let pos = start + r;
            let max = l.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = max + l.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln();
            nll.push(lse - l[tokens[pos + 1] as usize] as f64);
        }
    }
    let mean = nll.iter().sum::<f64>() / nll.len() as f64;
    println!(
        "tokens {} mean_nll {mean:.6} ppl {:.4}",
        nll.len(),
        mean.exp()
    );
    if let Some(r) = reference {
        let n = r.len().min(nll.len());
        let d: Vec<f64> = (0..n).map(|i| nll[i] - r[i]).collect();
        let bias = d.iter().sum::<f64>() / n as f64;
        let rms = (d.iter().map(|x| x * x).sum::<f64>() / n as f64).sqrt();
        let rmean = r[..n].iter().sum::<f64>() / n as f64;
        println!(
            "reference mean_nll {rmean:.6} ppl {:.4}; bias {bias:+.6} nats, rms {rms:.4}",
            rmean.exp()
        );
    }
    Ok(())
}
