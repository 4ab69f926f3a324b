//! Splitting text at special-token text, the way llama.cpp does before its SPM
//! tokenizer runs (`tokenizer_st_partition` in llama.cpp's `src/llama-vocab.cpp`).
//!
//! The special tokens are the control, user-defined and unknown tokens. llama.cpp
//! takes them longest text first and, for each in turn, cuts every remaining piece
//! of plain text at each leftmost non-overlapping occurrence of its text. So a
//! longer special token wins over a shorter one wherever both could match, even
//! when the shorter one starts earlier (unlike the leftmost-longest scan of the HF
//! `tokenizers` crate, which the byte-level BPE path uses). Control and unknown
//! tokens are looked for only when special-token parsing is on; user-defined ones
//! always.
//!
//! Same-length tokens are taken in id order here; llama.cpp sorts with
//! `std::sort` (not stable), so two same-length special tokens whose texts
//! overlap in one input (one's suffix is the other's prefix) may be split
//! differently. No such pair occurs in the vocabularies this crate is tested on
//! (their special tokens are `<...>` names and runs of one whitespace character).

use super::metadata::{TYPE_CONTROL, TYPE_USER_DEFINED};
use std::collections::{BTreeMap, HashMap};

/// One piece of a partitioned text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Fragment<'a> {
    /// Plain text, for the tokenizer proper (never empty).
    Text(&'a str),
    /// A special token found in the text.
    Token(u32),
}

/// The special tokens of a vocabulary, ready to find in text.
#[derive(Debug, Default)]
pub(super) struct SpecialTokens {
    /// In llama.cpp's order: longest text first, then by id.
    tokens: Vec<Special>,
    /// Text -> index in `tokens`.
    by_text: HashMap<Box<[u8]>, usize>,
    /// For each first byte, the distinct text lengths of the tokens starting with
    /// it, longest first.
    lengths: Vec<Vec<usize>>,
}

#[derive(Debug)]
struct Special {
    id: u32,
    /// Byte length of its text.
    len: usize,
    /// Looked for only when special-token parsing is on (control, unknown).
    needs_parse_special: bool,
}

impl SpecialTokens {
    /// `tokens`: (text, id, parsed only with `parse_special`) for every control,
    /// user-defined and unknown token. Empty texts are ignored; of two tokens with
    /// the same text, the first one given is kept.
    pub(super) fn new<'a>(tokens: impl IntoIterator<Item = (&'a str, u32, bool)>) -> Self {
        let mut all: Vec<(&str, u32, bool)> = tokens
            .into_iter()
            .filter(|(t, _, _)| !t.is_empty())
            .collect();
        all.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        let mut out = SpecialTokens {
            tokens: Vec::with_capacity(all.len()),
            by_text: HashMap::with_capacity(all.len()),
            lengths: vec![Vec::new(); 256],
        };
        for (text, id, needs_parse_special) in all {
            let key: Box<[u8]> = text.as_bytes().into();
            if out.by_text.contains_key(&key) {
                continue;
            }
            out.by_text.insert(key, out.tokens.len());
            out.tokens.push(Special {
                id,
                len: text.len(),
                needs_parse_special,
            });
            let lens = &mut out.lengths[usize::from(text.as_bytes()[0])];
            if !lens.contains(&text.len()) {
                // Tokens come longest first, so each list stays sorted.
                lens.push(text.len());
            }
        }
        out
    }

    /// Splits `text` into plain-text pieces and special tokens, in order.
    ///
    /// Cost: one hash lookup per (byte, candidate length starting with that byte),
    /// then a sort of the occurrences found; no scan per special token.
    pub(super) fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let b = text.as_bytes();
        // Every occurrence of every special token: (rank, start). An occurrence
        // of a valid UTF-8 string in valid UTF-8 text starts and ends on char
        // boundaries.
        let mut found: Vec<(usize, usize)> = Vec::new();
        for start in 0..b.len() {
            for &len in &self.lengths[usize::from(b[start])] {
                let Some(piece) = b.get(start..start + len) else {
                    continue;
                };
                if let Some(&rank) = self.by_text.get(piece) {
                    if parse_special || !self.tokens[rank].needs_parse_special {
                        found.push((rank, start));
                    }
                }
            }
        }
        if found.is_empty() {
            return if text.is_empty() {
                Vec::new()
            } else {
                vec![Fragment::Text(text)]
            };
        }
        // Token by token in rank order, occurrences left to right: one is taken
        // when it lies in text no earlier token took (llama.cpp cuts each
        // remaining piece at the token's leftmost match, then looks again after it).
        found.sort_unstable();
        let mut taken: BTreeMap<usize, (usize, u32)> = BTreeMap::new();
        for (rank, start) in found {
            let end = start + self.tokens[rank].len;
            let overlaps = taken
                .range(..end)
                .next_back()
                .is_some_and(|(_, &(e, _))| e > start);
            if !overlaps {
                taken.insert(start, (end, self.tokens[rank].id));
            }
        }
        let mut out = Vec::with_capacity(2 * taken.len() + 1);
        let mut at = 0;
        for (start, (end, id)) in taken {
            if start > at {
                out.push(Fragment::Text(&text[at..start]));
            }
            out.push(Fragment::Token(id));
            at = end;
        }
        if at < text.len() {
            out.push(Fragment::Text(&text[at..]));
        }
        out
    }
}

/// Texts llama.cpp makes control tokens whatever their stored type: its
/// end-of-generation list (`special_eog_ids`, which holds the end-of-turn and
/// end-of-message texts too) and its fill-in-the-middle lists (`src/llama-vocab.cpp`,
/// "auto-detect special tokens by text"). A user-defined `</s>` (Gemma 3) is
/// thus parsed only with special-token parsing, and skipped in decoding.
///
/// llama.cpp marks only the first fill-in-the-middle text of each kind it meets
/// (in hash order), and none of a kind whose id the metadata gives; here every
/// one present is marked (vocabularies hold at most one of each kind).
const FORCED_CONTROL: &[&str] = &[
    // End of generation.
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>",
    "[e~[",
    // Fill in the middle: prefix, suffix, middle, pad, repository, file separator.
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<\u{ff5c}fim\u{2581}begin\u{ff5c}>",
    "<PRE>",
    "\u{2581}<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<\u{ff5c}fim\u{2581}hole\u{ff5c}>",
    "<SUF>",
    "\u{2581}<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<\u{ff5c}fim\u{2581}end\u{ff5c}>",
    "<MID>",
    "\u{2581}<MID>",
    "<|code_middle|>",
    "<|middle|>",
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "[PAD]",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
];

/// The token types as llama.cpp uses them after loading, from the stored
/// `types` (GGUF `token_type` values) of `tokens`: the [`FORCED_CONTROL`] texts
/// become control tokens, then llama.cpp's model-specific fixes apply:
/// gpt-oss's `<|channel|>`, `<|message|>`, `<|start|>`, `<|constrain|>` become
/// user-defined, `<|end|>` becomes user-defined next to `<|return|>` and
/// `<|call|>` (or `<|calls|>` and `<|flush|>`), and `</s>` becomes normal next to
/// `<|tool_response>` or `<|plamo:eos|>`.
pub(super) fn llama_cpp_types(tokens: &[&str], types: &[i32]) -> Vec<i32> {
    let forced: std::collections::HashSet<&str> = FORCED_CONTROL.iter().copied().collect();
    let has = |t: &str| tokens.contains(&t);
    let end_not_eog = (has("<|return|>") && (has("<|call|>") || has("<|calls|>")))
        || ((has("<|call|>") || has("<|calls|>")) && has("<|flush|>"));
    let s_is_normal = has("<|tool_response>") || has("<|plamo:eos|>");
    tokens
        .iter()
        .zip(types)
        .map(|(&t, &ty)| match t {
            "<|channel|>" | "<|message|>" | "<|start|>" | "<|constrain|>" => TYPE_USER_DEFINED,
            "<|end|>" if end_not_eog => TYPE_USER_DEFINED,
            "</s>" if s_is_normal => super::metadata::TYPE_NORMAL,
            _ if forced.contains(t) => TYPE_CONTROL,
            _ => ty,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::Fragment::{Text, Token};
    use super::*;

    fn specials() -> SpecialTokens {
        SpecialTokens::new([
            ("<ctl>", 10, true),
            ("\n", 11, false),
            ("\n\n", 12, false),
            ("xa", 13, false),
            ("abc", 14, false),
            ("<unk>", 15, true),
        ])
    }

    #[test]
    fn control_tokens_only_when_parsed_user_defined_always() {
        let s = specials();
        assert_eq!(
            s.partition("a<ctl>b\nc", true),
            [Text("a"), Token(10), Text("b"), Token(11), Text("c")]
        );
        assert_eq!(
            s.partition("a<ctl>b\nc", false),
            [Text("a<ctl>b"), Token(11), Text("c")]
        );
        assert_eq!(s.partition("<unk>", false), [Text("<unk>")]);
        assert_eq!(s.partition("", true), []);
        assert_eq!(s.partition("plain", true), [Text("plain")]);
    }

    #[test]
    fn longer_tokens_win_even_when_a_shorter_one_starts_earlier() {
        let s = specials();
        // "abc" (3 bytes) is cut out before "xa" (2 bytes) is looked for.
        assert_eq!(s.partition("xabc", true), [Text("x"), Token(14)]);
        // Runs: the longest first, then what is left.
        assert_eq!(
            s.partition("\n\n\n\n\n", true),
            [Token(12), Token(12), Token(11)]
        );
        assert_eq!(s.partition("<ctl><ctl>", true), [Token(10), Token(10)]);
    }

    #[test]
    fn llama_cpp_makes_end_of_turn_texts_control_tokens() {
        let tokens = [
            "</s>",
            "<b>",
            "<|end|>",
            "<|return|>",
            "<|call|>",
            "<|channel|>",
        ];
        let types = [
            TYPE_USER_DEFINED,
            TYPE_USER_DEFINED,
            TYPE_CONTROL,
            TYPE_CONTROL,
            TYPE_CONTROL,
            TYPE_CONTROL,
        ];
        assert_eq!(
            llama_cpp_types(&tokens, &types),
            [
                TYPE_CONTROL,
                TYPE_USER_DEFINED,
                TYPE_USER_DEFINED,
                TYPE_CONTROL,
                TYPE_CONTROL,
                TYPE_USER_DEFINED
            ]
        );
        let with_tool_response =
            llama_cpp_types(&["</s>", "<|tool_response>"], &[TYPE_CONTROL, TYPE_CONTROL]);
        assert_eq!(
            with_tool_response,
            [super::super::TYPE_NORMAL, TYPE_CONTROL]
        );
    }
}
