//! SentencePiece-style tokenization by token scores (`tokenizer.ggml.model =
//! "llama"`), as llama.cpp does it.
//!
//! The algorithm is llama.cpp's `llm_tokenizer_spm` (`src/llama-vocab.cpp`,
//! first written in ggml-org/llama.cpp commit 074bea2e): SentencePiece's BPE
//! model (Kudo & Richardson 2018) driven by the vocabulary's scores instead of a
//! merge list:
//!
//! 1. spaces are written as U+2581 `▁` (by the caller, [`escape`]);
//! 2. every UTF-8 character is a symbol;
//! 3. of all adjacent symbol pairs whose concatenation is a vocabulary token, the
//!    one whose token has the highest score is merged (ties: the leftmost pair),
//!    until no pair is a token;
//! 4. each symbol that is a token gives its id; any other (a character missing
//!    from the vocabulary) gives one byte token `<0xNN>` per UTF-8 byte (byte
//!    fallback).
//!
//! Pairs wait in a priority queue; a merge invalidates the queued pairs of the
//! two symbols it joins, which are skipped when popped (their recorded length no
//! longer matches). So a text of `n` characters costs `O(n log n)` heap work plus
//! one hash lookup per candidate pair, whatever the vocabulary size.

use std::cmp::Ordering;
use std::collections::{BinaryHeap, HashMap};

/// How SentencePiece writes a space inside tokens.
pub(super) const ESCAPED_SPACE: char = '\u{2581}';

/// A score-ranked vocabulary with byte fallback.
#[derive(Debug)]
pub(super) struct Spm {
    /// Token text (as stored, spaces as `▁`) -> id; for a text stored twice the
    /// later id, as llama.cpp's text-to-id map keeps.
    ids: HashMap<Box<[u8]>, u32>,
    /// Score of each id (higher merges first); `-0.0` stored as `0.0`.
    scores: Vec<f32>,
    /// The token for each byte: `<0xNN>`, else the one-byte text.
    byte_ids: [Option<u32>; 256],
}

/// A character was not in the vocabulary and neither was the byte token for
/// one of its bytes (llama.cpp aborts the tokenization there).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct MissingByte(pub(super) u8);

/// Writes `text` the way SPM tokens store it: each space as `▁`, with one more
/// in front when `prefix_space`.
pub(super) fn escape(text: &str, prefix_space: bool) -> String {
    let mut out = String::with_capacity(text.len() + 3);
    if prefix_space {
        out.push(ESCAPED_SPACE);
    }
    for c in text.chars() {
        out.push(if c == ' ' { ESCAPED_SPACE } else { c });
    }
    out
}

/// One symbol: `len` bytes of the text from `start` (0 once merged into its
/// left neighbour), linked to its live neighbours.
#[derive(Clone, Copy, Debug)]
struct Symbol {
    start: usize,
    len: usize,
    prev: usize,
    next: usize,
}

/// No neighbour.
const NONE: usize = usize::MAX;

/// A candidate merge of symbols `left` and `right` (adjacent when queued) into a
/// token of `size` bytes whose score is `score`.
#[derive(Clone, Copy, Debug)]
struct Bigram {
    score: f32,
    left: usize,
    right: usize,
    size: usize,
}

impl Ord for Bigram {
    /// Higher score first; among equal scores, the leftmost.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl Eq for Bigram {}

impl Spm {
    /// A vocabulary of `tokens` (id = index, text as stored) with their `scores`
    /// (same length; missing scores are 0, as in llama.cpp).
    pub(super) fn new(tokens: &[&str], scores: &[f32]) -> Self {
        let mut ids = HashMap::with_capacity(tokens.len());
        for (id, t) in tokens.iter().enumerate() {
            ids.insert(t.as_bytes().into(), id as u32);
        }
        // `+ 0.0` turns -0.0 into 0.0: llama.cpp compares scores with `<`, which
        // holds the two equal, and `total_cmp` would not.
        let scores = (0..tokens.len())
            .map(|i| scores.get(i).copied().unwrap_or(0.0) + 0.0)
            .collect();
        let mut byte_ids = [None; 256];
        for (b, slot) in byte_ids.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            *slot = ids
                .get(hex.as_bytes())
                .or_else(|| ids.get(&[b as u8][..]))
                .copied();
        }
        Self {
            ids,
            scores,
            byte_ids,
        }
    }

    /// The id of the token stored as exactly `text`.
    pub(super) fn id(&self, text: &[u8]) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// The token standing for byte `b` in byte fallback.
    pub(super) fn byte_id(&self, b: u8) -> Option<u32> {
        self.byte_ids[usize::from(b)]
    }

    /// Appends the tokens of `text`, already [`escape`]d, to `out`.
    ///
    /// Errors: a character is not in the vocabulary and one of its bytes has no
    /// byte token.
    pub(super) fn tokenize(&self, text: &str, out: &mut Vec<u32>) -> Result<(), MissingByte> {
        let bytes = text.as_bytes();
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            let len = c.len_utf8();
            symbols.push(Symbol {
                start,
                len,
                prev: if i == 0 { NONE } else { i - 1 },
                next: if start + len == text.len() {
                    NONE
                } else {
                    i + 1
                },
            });
        }
        if symbols.is_empty() {
            return Ok(());
        }
        let mut queue = BinaryHeap::with_capacity(symbols.len());
        let pair =
            |symbols: &[Symbol], queue: &mut BinaryHeap<Bigram>, left: usize, right: usize| {
                if left == NONE || right == NONE {
                    return;
                }
                let (l, r) = (symbols[left], symbols[right]);
                let size = l.len + r.len;
                if let Some(&id) = self.ids.get(&bytes[l.start..l.start + size]) {
                    queue.push(Bigram {
                        score: self.scores[id as usize],
                        left,
                        right,
                        size,
                    });
                }
            };
        for i in 1..symbols.len() {
            pair(&symbols, &mut queue, i - 1, i);
        }
        while let Some(b) = queue.pop() {
            let (l, r) = (symbols[b.left], symbols[b.right]);
            // Stale: one side was merged away or grew since this pair was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != b.size {
                continue;
            }
            symbols[b.left].len = b.size;
            symbols[b.left].next = r.next;
            symbols[b.right].len = 0;
            if r.next != NONE {
                symbols[r.next].prev = b.left;
            }
            pair(&symbols, &mut queue, l.prev, b.left);
            pair(&symbols, &mut queue, b.left, r.next);
        }
        let mut i = 0;
        while i != NONE {
            let s = symbols[i];
            let piece = &bytes[s.start..s.start + s.len];
            match self.ids.get(piece) {
                Some(&id) => out.push(id),
                None => {
                    for &byte in piece {
                        out.push(self.byte_id(byte).ok_or(MissingByte(byte))?);
                    }
                }
            }
            i = s.next;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A toy vocabulary: (text, score).
    fn vocab(entries: &[(&str, f32)]) -> (Spm, Vec<String>) {
        let mut texts: Vec<String> = entries.iter().map(|(t, _)| t.to_string()).collect();
        let mut scores: Vec<f32> = entries.iter().map(|(_, s)| *s).collect();
        for b in 0..=255u8 {
            texts.push(format!("<0x{b:02X}>"));
            scores.push(0.0);
        }
        let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
        (Spm::new(&refs, &scores), texts)
    }

    fn pieces(spm: &Spm, texts: &[String], text: &str) -> Vec<String> {
        let mut ids = Vec::new();
        spm.tokenize(&escape(text, false), &mut ids).unwrap();
        ids.iter().map(|&id| texts[id as usize].clone()).collect()
    }

    #[test]
    fn the_highest_scoring_pair_merges_first() {
        let (spm, t) = vocab(&[
            ("a", 0.0),
            ("b", 0.0),
            ("c", 0.0),
            ("ab", -1.0),
            ("bc", -2.0),
        ]);
        assert_eq!(pieces(&spm, &t, "abc"), ["ab", "c"]);
        let (spm, t) = vocab(&[
            ("a", 0.0),
            ("b", 0.0),
            ("c", 0.0),
            ("ab", -2.0),
            ("bc", -1.0),
        ]);
        assert_eq!(pieces(&spm, &t, "abc"), ["a", "bc"]);
    }

    #[test]
    fn equal_scores_merge_leftmost_first() {
        let (spm, t) = vocab(&[("a", 0.0), ("aa", -1.0)]);
        assert_eq!(pieces(&spm, &t, "aaa"), ["aa", "a"]);
        assert_eq!(pieces(&spm, &t, "aaaaa"), ["aa", "aa", "a"]);
    }

    #[test]
    fn merged_symbols_keep_merging() {
        // "abc" is not a token, so "abcd" is only reached through "ab" + "cd".
        let (spm, t) = vocab(&[
            ("a", 0.0),
            ("b", 0.0),
            ("c", 0.0),
            ("d", 0.0),
            ("ab", -1.0),
            ("cd", -1.0),
            ("bc", -0.5),
            ("abcd", -3.0),
        ]);
        // "bc" scores best, then neither "abc" nor "bcd" exists: no further merge.
        assert_eq!(pieces(&spm, &t, "abcd"), ["a", "bc", "d"]);
        let (spm, t) = vocab(&[
            ("a", 0.0),
            ("b", 0.0),
            ("c", 0.0),
            ("d", 0.0),
            ("ab", -1.0),
            ("cd", -1.0),
            ("abcd", -3.0),
        ]);
        assert_eq!(pieces(&spm, &t, "abcd"), ["abcd"]);
    }

    #[test]
    fn spaces_are_escaped_and_unknown_characters_fall_back_to_bytes() {
        let (spm, t) = vocab(&[
            ("a", 0.0),
            ("b", 0.0),
            ("\u{2581}", 0.0),
            ("\u{2581}b", -1.0),
        ]);
        assert_eq!(pieces(&spm, &t, "a b"), ["a", "\u{2581}b"]);
        assert_eq!(pieces(&spm, &t, "é"), ["<0xC3>", "<0xA9>"]);
        assert_eq!(
            pieces(&spm, &t, "a👋"),
            ["a", "<0xF0>", "<0x9F>", "<0x91>", "<0x8B>"]
        );
        assert!(pieces(&spm, &t, "").is_empty());
        assert_eq!(escape(" a  b", true), "\u{2581}\u{2581}a\u{2581}\u{2581}b");
    }

    #[test]
    fn byte_fallback_without_byte_tokens_is_an_error() {
        let spm = Spm::new(&["a"], &[0.0]);
        let mut ids = Vec::new();
        assert_eq!(spm.tokenize("aé", &mut ids), Err(MissingByte(0xC3)));
        // A one-byte token stands in for `<0xNN>` when that is missing.
        let spm = Spm::new(&["a", "\n"], &[0.0, 0.0]);
        assert_eq!(spm.byte_id(b'\n'), Some(1));
    }

    #[test]
    fn negative_zero_ties_with_zero() {
        // With -0.0 below 0.0, "bc" would lose to the leftmost "ab"; llama.cpp
        // holds them equal and takes the leftmost: "ab".
        let (spm, t) = vocab(&[
            ("a", 0.0),
            ("b", 0.0),
            ("c", 0.0),
            ("ab", -0.0),
            ("bc", 0.0),
        ]);
        assert_eq!(pieces(&spm, &t, "abc"), ["ab", "c"]);
    }

    /// The definition, quadratic: merge the best pair (ties leftmost) until none.
    fn naive(spm: &Spm, text: &str) -> Vec<u32> {
        let mut syms: Vec<&str> = text
            .char_indices()
            .map(|(i, c)| &text[i..i + c.len_utf8()])
            .collect();
        let joined = |a: &str, b: &str| format!("{a}{b}");
        loop {
            let mut best: Option<(f32, usize)> = None;
            for i in 1..syms.len() {
                if let Some(id) = spm.id(joined(syms[i - 1], syms[i]).as_bytes()) {
                    let s = spm.scores[id as usize];
                    if best.is_none_or(|(bs, _)| s > bs) {
                        best = Some((s, i - 1));
                    }
                }
            }
            let Some((_, i)) = best else { break };
            // Symbols are contiguous slices of `text`: widen the left one.
            let start = syms[i].as_ptr() as usize - text.as_ptr() as usize;
            let end = start + syms[i].len() + syms[i + 1].len();
            syms[i] = &text[start..end];
            syms.remove(i + 1);
        }
        let mut out = Vec::new();
        for s in syms {
            match spm.id(s.as_bytes()) {
                Some(id) => out.push(id),
                None => out.extend(s.bytes().map(|b| spm.byte_id(b).unwrap())),
            }
        }
        out
    }

    proptest! {
        #[test]
        fn the_queue_equals_the_quadratic_definition(
            words in proptest::collection::vec("[ab▁é]{2,4}", 0..12),
            scores in proptest::collection::vec(-4i8..1, 12),
            text in "[ab▁é]{0,40}",
        ) {
            let mut entries: Vec<(String, f32)> =
                vec![("a".into(), 0.0), ("b".into(), 0.0), ("▁".into(), 0.0)];
            for (w, s) in words.iter().zip(&scores) {
                entries.push((w.clone(), f32::from(*s)));
            }
            let refs: Vec<(&str, f32)> = entries.iter().map(|(t, s)| (t.as_str(), *s)).collect();
            let (spm, _) = vocab(&refs);
            let mut ids = Vec::new();
            spm.tokenize(&text, &mut ids).unwrap();
            prop_assert_eq!(ids, naive(&spm, &text));
        }
    }
}
