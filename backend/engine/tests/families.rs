//! Batch invariance for every model family beside the default one: Gemma 3
//! (sliding-window layers, QK-norm, GeGLU; one prompt longer than its 512-token
//! window) and Qwen2 (attention biases, NEOX RoPE). Each request's greedy tokens
//! are the same alone and batched with the others, prefill chunks sharing passes
//! with decode tokens; the pool ends where it started.

use tessera_engine::testing::*;

fn greedy_alone_equals_greedy_batched(file: &str) {
    let m = load_family(file);
    let reqs: Vec<_> = family_prompts()
        .iter()
        .map(|p| greedy(raw_prompt(&m, p), 12))
        .collect();
    let longest = reqs.iter().map(|r| r.prompt.len()).max().unwrap();
    assert!(longest > 600, "the long prompt is {longest} tokens");
    let alone: Vec<_> = reqs.iter().map(|r| solo(&m, r.clone())).collect();

    // 48-token passes: the long prompt's prefill runs in chunks beside the
    // others' decode tokens.
    let mut e = engine_with_batch(&m, 48);
    let mut rxs = enqueue_all(&mut e, &reqs);
    let mut max_batch = 0;
    while e.has_work() {
        max_batch = max_batch.max(e.running_ids().len());
        e.step();
    }
    assert_eq!(max_batch, reqs.len(), "all requests must run together");
    for (i, rx) in rxs.iter_mut().enumerate() {
        let together = drain(rx);
        assert_eq!(together.ids.len(), 12, "request {i}");
        assert_eq!(together, alone[i], "{file}: request {i}");
    }
    assert_eq!(e.kv().pool().free_pages(), e.kv().pool().capacity());
}

#[test]
fn gemma3_greedy_alone_equals_greedy_batched() {
    greedy_alone_equals_greedy_batched(FAMILY_MODEL_FILES[0]);
}

#[test]
fn qwen2_greedy_alone_equals_greedy_batched() {
    greedy_alone_equals_greedy_batched(FAMILY_MODEL_FILES[1]);
}

/// The engine's greedy tokens equal the direct forward pass's for the long
/// prompt (the sliding window crosses page boundaries in both).
#[test]
fn gemma3_engine_equals_the_direct_forward_pass_past_the_window() {
    let m = load_family(FAMILY_MODEL_FILES[0]);
    let prompt = raw_prompt(&m, family_prompts().last().unwrap());
    let (direct, _) = greedy_with_logits(&m, &prompt, 8);
    let out = solo(&m, greedy(prompt, 8));
    assert_eq!(out.ids, direct);
}
