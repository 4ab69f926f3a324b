//! Prompt-lookup speculation (issue 37): draft tokens for a decoding sequence from
//! its own prompt and output, verified in the same forward pass as its decode row.
//!
//! Drafts come only from the sequence's own tokens (never from a structure shared
//! across requests or tenants, which would propose other tenants' text and let
//! acceptance timing confirm a guess). The engine feeds the drafts as extra rows
//! after the sequence's decode row; each row's logits are sampled in order exactly
//! as plain decoding samples them (same penalties, format constraint and RNG
//! stream), and a draft is kept only while it equals the token sampled at its
//! position. So the output is token-for-token what plain decoding produces, for
//! greedy and for seeded sampling alike; rejected drafts' KV stays in the
//! sequence's own pages beyond its length and is overwritten when decoding reaches
//! those positions (attention never reads past a row's own position).
//!
//! The lookup is the one of "prompt lookup decoding" (Saxena, 2023) and vLLM's
//! n-gram proposer: the most recent earlier occurrence of the sequence's last
//! `n` tokens (longest `n` first), and the tokens that followed it.

/// Longest suffix matched against the history.
const MAX_NGRAM: usize = 3;
/// Shortest suffix matched: shorter ones match too often in open-ended text to be
/// worth their rows (2: open-ended prompts 0.95x, 3: 0.99-1.01x, same run).
const MIN_NGRAM: usize = 3;
/// How far back the lookup searches (tokens), bounding its cost per step.
const LOOKBACK: usize = 4096;

/// Up to `k` draft tokens for the sequence whose tokens so far are `prompt`
/// followed by `output`: the tokens that followed the most recent earlier
/// occurrence of its last `n` tokens, for the longest `n` in
/// `MIN_NGRAM..=MAX_NGRAM` that occurs. Empty when nothing matches or `k` is 0.
pub(crate) fn propose(prompt: &[u32], output: &[u32], k: usize) -> Vec<u32> {
    let len = prompt.len() + output.len();
    let at = |i: usize| {
        if i < prompt.len() {
            prompt[i]
        } else {
            output[i - prompt.len()]
        }
    };
    if k == 0 || len < MIN_NGRAM + 1 {
        return Vec::new();
    }
    let from = len.saturating_sub(LOOKBACK);
    for n in (MIN_NGRAM..=MAX_NGRAM.min(len - 1)).rev() {
        let suffix = len - n;
        // Candidates end before the suffix starts; latest first.
        let found = (from..suffix)
            .rev()
            .find(|&start| start + n <= suffix && (0..n).all(|j| at(start + j) == at(suffix + j)));
        if let Some(start) = found {
            let next = start + n;
            return (next..len.min(next + k)).map(at).collect();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn drafts_continue_the_latest_earlier_occurrence() {
        // "1 2 3 4 5 1 2 3" -> after the earlier "1 2 3" came "4 5 1 2 3".
        let p = [1, 2, 3, 4, 5, 1, 2, 3];
        assert_eq!(propose(&p, &[], 2), [4, 5]);
        assert_eq!(
            propose(&p, &[], 8),
            [4, 5, 1, 2, 3],
            "up to the end of the history"
        );
        // The latest earlier occurrence wins.
        assert_eq!(propose(&[1, 2, 3, 7, 1, 2, 3, 9], &[1, 2, 3], 1), [9]);
        // Prompt and output are one history.
        assert_eq!(propose(&[5, 6, 7, 8, 9], &[5, 6, 7], 2), [8, 9]);
    }

    #[test]
    fn nothing_to_propose() {
        assert!(propose(&[1, 2, 3, 4], &[], 4).is_empty(), "no repeat");
        assert!(propose(&[1, 2, 3, 1, 2, 3], &[], 0).is_empty(), "k = 0");
        assert!(propose(&[1], &[], 4).is_empty());
        assert!(propose(&[], &[], 4).is_empty());
        // Two repeated tokens are below the shortest n-gram (they match too often in
        // open-ended text to be worth a row).
        assert!(propose(&[1, 2, 9, 1, 2], &[], 4).is_empty());
    }
}
