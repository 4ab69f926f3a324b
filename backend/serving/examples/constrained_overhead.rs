//! What constrained decoding (`response_format`) costs: output throughput of the
//! same requests with no format, in JSON mode and with a JSON Schema, as ratios
//! against the unconstrained run of the same block, in one process (the `tessera
//! serve` default: prefill and decode engines in process).
//!
//! ```sh
//! cargo run --release -p tessera-serving --example constrained_overhead -- [BLOCKS] [REQUESTS] [MAX_TOKENS]
//! ```
//!
//! Every request generates exactly MAX_TOKENS tokens (`ignore_eos`), so each run
//! does the same forward passes and differs only by the masks: once a document is
//! complete its mask allows only end-of-sequence, which is still a mask computed
//! and applied over the whole vocabulary. Each block runs free, json, schema,
//! schema, json, free (the next block mirrors it), so drift weighs on every side
//! alike. Prints one JSON line per run and a summary with the median ratio per
//! format and its range over the blocks.

mod bench_common;

use bench_common::{chat_ids, load_model, run, spawn_pd};
use tessera_engine::GenerateRequest;
use tessera_model::grammar::ResponseFormat;

const PROMPTS: [&str; 4] = [
    "Describe a person you admire, as JSON.",
    "List the planets of the solar system with a fact about each, as JSON.",
    "Write a short story about a lighthouse keeper, as JSON.",
    "Give a recipe for pancakes with ingredients and steps, as JSON.",
];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Free,
    Json,
    Schema,
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("BLOCKS REQUESTS MAX_TOKENS are numbers"))
        .collect();
    let blocks = args.first().copied().unwrap_or(4).max(1);
    let requests = args.get(1).copied().unwrap_or(16);
    let max_tokens = args.get(2).copied().unwrap_or(128);
    let model = load_model();
    let h = spawn_pd(&model);
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 60},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string"},
                        "detail": {"type": "string"},
                        "rank": {"type": "integer", "minimum": 1, "maximum": 100}
                    },
                    "required": ["name", "detail", "rank"],
                    "additionalProperties": false
                }
            }
        },
        "required": ["title", "items"],
        "additionalProperties": false
    });
    let reqs = |kind: Kind| -> Vec<GenerateRequest> {
        (0..requests)
            .map(|i| {
                let mut r = GenerateRequest {
                    ignore_eos: true,
                    ..GenerateRequest::new(
                        1 + i as u64 % 4,
                        chat_ids(&model, PROMPTS[i % PROMPTS.len()]),
                        max_tokens,
                    )
                };
                r.output.format = match kind {
                    Kind::Free => None,
                    Kind::Json => Some(ResponseFormat::JsonObject),
                    Kind::Schema => Some(ResponseFormat::JsonSchema {
                        schema: schema.clone(),
                    }),
                };
                r
            })
            .collect()
    };
    let sets = [
        (Kind::Free, reqs(Kind::Free)),
        (Kind::Json, reqs(Kind::Json)),
        (Kind::Schema, reqs(Kind::Schema)),
    ];
    let set = |k: Kind| &sets.iter().find(|s| s.0 == k).unwrap().1;
    // Warm-up (page faults, thread pool, the vocabulary trie).
    run(&h, &set(Kind::Json)[..2]);
    let (mut json_ratios, mut schema_ratios) = (Vec::new(), Vec::new());
    for block in 0..blocks {
        let mut order = [
            Kind::Free,
            Kind::Json,
            Kind::Schema,
            Kind::Schema,
            Kind::Json,
            Kind::Free,
        ];
        if block % 2 == 1 {
            order.reverse();
            order.rotate_left(1);
        }
        let mut sum = [0.0f64; 3];
        for kind in order {
            let tps = run(&h, set(kind));
            println!(
                "{{\"block\": {block}, \"format\": \"{kind:?}\", \"requests\": {requests}, \"max_tokens\": {max_tokens}, \"output_tok_per_s\": {tps:.1}}}"
            );
            sum[kind as usize] += tps;
        }
        json_ratios.push(sum[1] / sum[0]);
        schema_ratios.push(sum[2] / sum[0]);
    }
    let summary = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        (v[v.len() / 2], v[0], v[v.len() - 1])
    };
    let (jm, jlo, jhi) = summary(&mut json_ratios);
    let (sm, slo, shi) = summary(&mut schema_ratios);
    println!(
        "{{\"summary\": true, \"blocks\": {blocks}, \"json_over_free_median\": {jm:.4}, \"json_range\": [{jlo:.4}, {jhi:.4}], \"schema_over_free_median\": {sm:.4}, \"schema_range\": [{slo:.4}, {shi:.4}], \"json_cost_percent\": {:.2}, \"schema_cost_percent\": {:.2}}}",
        (1.0 - jm) * 100.0,
        (1.0 - sm) * 100.0
    );
}
