//! Streaming detokenization: whole UTF-8 characters out, stop strings held back.
//!
//! A byte-level BPE token, or a SentencePiece byte-fallback token (`<0xNN>`),
//! can stand for part of a UTF-8 character (an emoji is often two or more
//! tokens). [`IncrementalDecoder`] buffers token bytes and only
//! emits complete characters. [`StopMatcher`] sits after it: it holds back any
//! tail of the stream that could still become a stop string, and cuts the
//! stream at the first stop string, which is never emitted (nor is anything
//! after it).

use crate::tokenizer::Tokenizer;

/// Turns token ids into text one token at a time, never splitting a character.
///
/// The concatenation of everything returned by [`push`](Self::push) and
/// [`finish`](Self::finish) equals `String::from_utf8_lossy` of all the token
/// bytes: invalid sequences become U+FFFD as soon as they are known to be
/// invalid, incomplete ones wait for more bytes.
#[derive(Clone, Debug, Default)]
pub struct IncrementalDecoder {
    pending: Vec<u8>,
    skip_special: bool,
}

impl IncrementalDecoder {
    /// A decoder; with `skip_special`, control tokens (e.g. `<|im_end|>`) produce no text.
    pub fn new(skip_special: bool) -> Self {
        Self {
            pending: Vec::new(),
            skip_special,
        }
    }

    /// Adds token `id` and returns the text it completes (possibly empty).
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> String {
        if self.skip_special && tok.is_control(id) {
            return String::new();
        }
        self.push_bytes(tok.token_bytes_ref(id))
    }

    /// Adds raw bytes and returns the text they complete (possibly empty).
    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut start = 0;
        while start < self.pending.len() {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    if let Ok(s) = std::str::from_utf8(&self.pending[start..start + valid]) {
                        out.push_str(s);
                    }
                    match e.error_len() {
                        // An invalid sequence: replace it, as from_utf8_lossy does.
                        Some(len) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start += valid + len;
                        }
                        // An incomplete character at the end: wait for more bytes.
                        None => {
                            start += valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }

    /// Bytes held back waiting for the rest of a character (at most 3).
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Flushes leftover bytes at the end of the stream (an incomplete
    /// character becomes U+FFFD) and resets the decoder.
    pub fn finish(&mut self) -> String {
        let out = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        out
    }
}

/// What [`StopMatcher::push`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StopOutcome {
    /// No stop string yet; the text may be emitted (possibly empty: it is held back
    /// while it could be the start of a stop string).
    Continue(String),
    /// A stop string was hit. `text` is what is left to emit before it; the stop
    /// string and everything after it are dropped. Generation should end.
    Stopped {
        /// Text before the stop string not emitted yet.
        text: String,
        /// Index of the stop string hit, in the order given to [`StopMatcher::new`].
        stop_index: usize,
    },
}

/// Most stop strings one request may give.
pub const MAX_STOPS: usize = 4;
/// Longest stop string, in bytes. The matcher's work per token and the text it
/// holds back are bounded by the longest stop, so this bounds both.
pub const MAX_STOP_BYTES: usize = 256;

/// A request's stop strings outside [`MAX_STOPS`] / [`MAX_STOP_BYTES`]. Messages
/// name the field (`stop`), the limit and the value given.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum StopError {
    /// More than [`MAX_STOPS`] strings.
    #[error(
        "`stop` must be a string or an array of at most {MAX_STOPS} strings. Given: {0} strings"
    )]
    TooMany(usize),
    /// A string longer than [`MAX_STOP_BYTES`].
    #[error("each `stop` string must be at most {MAX_STOP_BYTES} bytes. Given: {bytes} bytes (stop[{index}])")]
    TooLong {
        /// Position of the string in the request's list.
        index: usize,
        /// Its length in bytes.
        bytes: usize,
    },
}

/// Checks a request's stop strings against [`MAX_STOPS`] and [`MAX_STOP_BYTES`].
pub fn check_stops(stops: &[String]) -> Result<(), StopError> {
    if stops.len() > MAX_STOPS {
        return Err(StopError::TooMany(stops.len()));
    }
    match stops.iter().position(|s| s.len() > MAX_STOP_BYTES) {
        Some(index) => Err(StopError::TooLong {
            index,
            bytes: stops[index].len(),
        }),
        None => Ok(()),
    }
}

/// Finds stop strings in a text stream arriving in chunks.
///
/// Incremental (Knuth-Morris-Pratt per stop string, over bytes): each stop keeps
/// the length of its longest prefix that ends the stream so far, so a chunk costs
/// O(chunk bytes x stops) amortized, whatever the length of the text before it,
/// and the text held back is the longest such prefix (shorter than the longest
/// stop). Stops and text are UTF-8, so a byte match is a character match and a
/// held prefix always starts on a character boundary.
#[derive(Clone, Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Per stop, KMP failure links: `fail[k][q]` is the length of the longest
    /// proper prefix of `stops[k][..q + 1]` that is also its suffix.
    fail: Vec<Vec<usize>>,
    /// Per stop, the length of its longest prefix the stream ends with.
    state: Vec<usize>,
    /// Length of the longest stop, in bytes.
    longest: usize,
    held: String,
    stopped: Option<usize>,
}

/// KMP failure links of `p` (see [`StopMatcher`]).
fn failure_links(p: &[u8]) -> Vec<usize> {
    let mut fail = vec![0; p.len()];
    let mut q = 0;
    for i in 1..p.len() {
        while q > 0 && p[i] != p[q] {
            q = fail[q - 1];
        }
        if p[i] == p[q] {
            q += 1;
        }
        fail[i] = q;
    }
    fail
}

impl StopMatcher {
    /// A matcher for `stops`; empty strings never match. Callers bound the
    /// stops first ([`check_stops`]); the matcher itself works for any length.
    pub fn new(stops: Vec<String>) -> Self {
        Self {
            fail: stops.iter().map(|s| failure_links(s.as_bytes())).collect(),
            state: vec![0; stops.len()],
            longest: stops.iter().map(String::len).max().unwrap_or(0),
            stops,
            held: String::new(),
            stopped: None,
        }
    }

    /// The stop strings, in the order given.
    pub fn stops(&self) -> &[String] {
        &self.stops
    }

    /// Index of the stop string hit, once one has been.
    pub fn stopped(&self) -> Option<usize> {
        self.stopped
    }

    /// Adds the next chunk of text. After a stop, further chunks are ignored and
    /// give `Stopped` with empty text.
    pub fn push(&mut self, chunk: &str) -> StopOutcome {
        if let Some(stop_index) = self.stopped {
            return StopOutcome::Stopped {
                text: String::new(),
                stop_index,
            };
        }
        let base = self.held.len();
        self.held.push_str(chunk);

        // Earliest start of any stop string (lowest index on a tie). A match
        // completing later can still start earlier (`abcd` after `bc`), but never
        // once `longest` bytes have passed its start.
        let mut hit: Option<(usize, usize)> = None;
        for (i, &b) in chunk.as_bytes().iter().enumerate() {
            let end = base + i + 1;
            for (k, stop) in self.stops.iter().enumerate() {
                let p = stop.as_bytes();
                if p.is_empty() {
                    continue;
                }
                let fail = &self.fail[k];
                let mut q = self.state[k];
                while q > 0 && p[q] != b {
                    q = fail[q - 1];
                }
                if p[q] == b {
                    q += 1;
                }
                if q == p.len() {
                    let start = end - p.len();
                    if hit.is_none_or(|h| (start, k) < h) {
                        hit = Some((start, k));
                    }
                    q = fail[q - 1];
                }
                self.state[k] = q;
            }
            if hit.is_some_and(|(start, _)| end >= start + self.longest) {
                break;
            }
        }
        if let Some((pos, stop_index)) = hit {
            self.held.truncate(pos);
            self.stopped = Some(stop_index);
            return StopOutcome::Stopped {
                text: std::mem::take(&mut self.held),
                stop_index,
            };
        }

        // Hold back the longest tail that is a proper prefix of some stop string.
        let hold = self.state.iter().copied().max().unwrap_or(0);
        let emit_len = self.held.len() - hold;
        let rest = self.held.split_off(emit_len);
        StopOutcome::Continue(std::mem::replace(&mut self.held, rest))
    }

    /// Text held back at the end of the stream (no stop string can complete any more).
    pub fn finish(&mut self) -> String {
        self.state.fill(0);
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::test_tokenizer;
    use proptest::prelude::*;

    fn stops(s: &[&str]) -> StopMatcher {
        StopMatcher::new(s.iter().map(|s| s.to_string()).collect())
    }

    fn cont(s: &str) -> StopOutcome {
        StopOutcome::Continue(s.to_string())
    }

    #[test]
    fn emoji_from_byte_tokens_comes_out_whole() {
        let Some(tok) = test_tokenizer() else { return };
        // One token per byte: the emoji only appears with its last byte.
        let byte_token = |b: u8| {
            (0..tok.vocab_size() as u32)
                .find(|&id| tok.token_bytes(id) == [b])
                .expect("every byte has a token")
        };
        let mut dec = IncrementalDecoder::new(true);
        let emoji = "👋".as_bytes();
        let outs: Vec<String> = emoji
            .iter()
            .map(|&b| dec.push(tok, byte_token(b)))
            .collect();
        assert_eq!(outs, ["", "", "", "👋"]);
        assert_eq!(dec.pending_len(), 0);
        assert_eq!(dec.finish(), "");
    }

    #[test]
    fn encoded_text_streams_back_exactly() {
        let Some(tok) = test_tokenizer() else { return };
        for text in ["Hi 👋🌍🎉! 你好，世界 Привет", "🎉🎉🎉 مرحبا 𝄞"]
        {
            let ids = tok.encode(text, false).unwrap();
            let mut dec = IncrementalDecoder::new(false);
            let mut out = String::new();
            let mut held_back = false;
            for &id in &ids {
                let piece = dec.push(tok, id);
                held_back |= piece.is_empty();
                assert!(!piece.contains('\u{FFFD}'), "{piece:?}");
                out.push_str(&piece);
            }
            out.push_str(&dec.finish());
            assert_eq!(out, text);
            assert!(held_back, "some token of {text:?} is a partial character");
        }
    }

    #[test]
    fn special_tokens_skipped_or_kept() {
        let Some(tok) = test_tokenizer() else { return };
        let ids = tok.encode("hi<|im_end|>", true).unwrap();
        let run = |skip| {
            let mut dec = IncrementalDecoder::new(skip);
            let mut s: String = ids.iter().map(|&id| dec.push(tok, id)).collect();
            s.push_str(&dec.finish());
            s
        };
        assert_eq!(run(true), "hi");
        assert_eq!(run(false), "hi<|im_end|>");
    }

    #[test]
    fn invalid_and_truncated_bytes_become_replacement() {
        let mut dec = IncrementalDecoder::new(false);
        assert_eq!(dec.push_bytes(b"a\xF0\x9F"), "a");
        assert_eq!(dec.push_bytes(b"b"), "\u{FFFD}b");
        assert_eq!(dec.push_bytes(b"\xFF\xE4\xBD"), "\u{FFFD}");
        assert_eq!(dec.finish(), "\u{FFFD}");
        assert_eq!(dec.finish(), "");
    }

    proptest! {
        #[test]
        fn chunked_decoding_equals_lossy(chunks in prop::collection::vec(prop::collection::vec(any::<u8>(), 0..6), 0..12)) {
            let mut dec = IncrementalDecoder::new(false);
            let mut out = String::new();
            for c in &chunks {
                out.push_str(&dec.push_bytes(c));
                prop_assert!(dec.pending_len() <= 3);
            }
            out.push_str(&dec.finish());
            let all: Vec<u8> = chunks.concat();
            prop_assert_eq!(out, String::from_utf8_lossy(&all).into_owned());
        }

        #[test]
        fn stop_matcher_equals_cut_at_first_stop(text in "[ab\\n#é]{0,24}", cuts in prop::collection::vec(0usize..24, 0..6)) {
            let stop_list = ["##", "ab\n", "é#"];
            let mut m = stops(&stop_list);
            let mut boundaries: Vec<usize> = cuts.into_iter().filter(|&c| c <= text.len() && text.is_char_boundary(c)).collect();
            boundaries.sort_unstable();
            boundaries.push(text.len());
            let (mut out, mut prev, mut hit) = (String::new(), 0, None);
            for b in boundaries {
                match m.push(&text[prev..b]) {
                    StopOutcome::Continue(s) => out.push_str(&s),
                    StopOutcome::Stopped { text, stop_index } => {
                        out.push_str(&text);
                        hit = Some(stop_index);
                        break;
                    }
                }
                prev = b;
            }
            if hit.is_none() {
                out.push_str(&m.finish());
            }
            let first = stop_list.iter().filter_map(|s| text.find(s)).min();
            prop_assert_eq!(&out[..], &text[..first.unwrap_or(text.len())]);
            prop_assert_eq!(hit.is_some(), first.is_some());
        }
    }

    /// The matcher before it was incremental: every prefix of every stop checked
    /// against the whole held text on each chunk. The reference for the proptest.
    struct Naive {
        stops: Vec<String>,
        held: String,
    }

    impl Naive {
        fn push(&mut self, chunk: &str) -> StopOutcome {
            self.held.push_str(chunk);
            let hit = self
                .stops
                .iter()
                .enumerate()
                .filter(|(_, s)| !s.is_empty())
                .filter_map(|(i, s)| self.held.find(s.as_str()).map(|pos| (pos, i)))
                .min();
            if let Some((pos, stop_index)) = hit {
                self.held.truncate(pos);
                return StopOutcome::Stopped {
                    text: std::mem::take(&mut self.held),
                    stop_index,
                };
            }
            let hold = self
                .stops
                .iter()
                .filter_map(|s| {
                    (1..s.len())
                        .rev()
                        .filter(|&n| s.is_char_boundary(n))
                        .find(|&n| self.held.ends_with(&s[..n]))
                })
                .max()
                .unwrap_or(0);
            let rest = self.held.split_off(self.held.len() - hold);
            StopOutcome::Continue(std::mem::replace(&mut self.held, rest))
        }
    }

    proptest! {
        /// Any stops (overlapping, self-similar, one inside another, multibyte),
        /// any chunking: the incremental matcher gives exactly the reference's
        /// outcomes, chunk by chunk.
        #[test]
        fn incremental_matcher_equals_the_reference(
            stop_list in prop::collection::vec("[ab#é]{0,5}", 0..5),
            text in "[ab#é]{0,40}",
            cuts in prop::collection::vec(0usize..40, 0..10),
        ) {
            let mut m = StopMatcher::new(stop_list.clone());
            let mut naive = Naive { stops: stop_list, held: String::new() };
            let mut boundaries: Vec<usize> = cuts.into_iter().filter(|&c| c <= text.len() && text.is_char_boundary(c)).collect();
            boundaries.sort_unstable();
            boundaries.push(text.len());
            let mut prev = 0;
            for b in boundaries {
                let (got, want) = (m.push(&text[prev..b]), naive.push(&text[prev..b]));
                prop_assert_eq!(&got, &want);
                if matches!(got, StopOutcome::Stopped { .. }) {
                    return Ok(());
                }
                prev = b;
            }
            prop_assert_eq!(m.finish(), std::mem::take(&mut naive.held));
        }
    }

    #[test]
    fn stops_spanning_token_boundaries_match() {
        let Some(tok) = test_tokenizer() else { return };
        let long_stop: String =
            "the longest stop, ".repeat(15)[..MAX_STOP_BYTES - 5].to_string() + "👋!";
        assert_eq!(long_stop.len(), MAX_STOP_BYTES);
        let text = format!("Hello world, 你好 👋🌍 and {long_stop} then <|im_end|> more");
        let before_last = format!("Hello world, 你好 👋🌍 and {long_stop} ");
        // Each stop covers several tokens; the emoji ones end inside a character's
        // bytes on the way (the decoder emits whole characters only).
        for (stop, before) in [
            ("world, 你好 👋", "Hello "),
            ("👋🌍 and", "Hello world, 你好 "),
            (long_stop.as_str(), "Hello world, 你好 👋🌍 and "),
            ("then <|im_end|>", before_last.as_str()),
        ] {
            let ids = tok.encode(&text, false).unwrap();
            let tokens_in_stop = tok.encode(stop, false).unwrap().len();
            assert!(tokens_in_stop >= 2, "{stop:?} is one token");
            let mut dec = IncrementalDecoder::new(false);
            let mut m = StopMatcher::new(vec!["never".into(), stop.to_string()]);
            let mut out = String::new();
            let mut hit = None;
            for &id in &ids {
                match m.push(&dec.push(tok, id)) {
                    StopOutcome::Continue(t) => out.push_str(&t),
                    StopOutcome::Stopped { text, stop_index } => {
                        out.push_str(&text);
                        hit = Some(stop_index);
                        break;
                    }
                }
            }
            assert_eq!(hit, Some(1), "{stop:?} not found in {out:?}");
            assert_eq!(out, before, "{stop:?}");
        }
    }

    #[test]
    fn held_back_text_is_shorter_than_the_longest_stop() {
        // A stop whose every prefix keeps matching a long run of `a`: the text held
        // back never exceeds the stop minus one byte, however long the run.
        let stop = "a".repeat(MAX_STOP_BYTES - 1) + "b";
        let mut m = StopMatcher::new(vec![stop.clone(), "ab".into()]);
        let (mut pushed, mut emitted) = (0, 0);
        for _ in 0..2000 {
            match m.push("a") {
                StopOutcome::Continue(t) => emitted += t.len(),
                other => panic!("{other:?}"),
            }
            pushed += 1;
            assert!(pushed - emitted < MAX_STOP_BYTES, "{pushed} {emitted}");
        }
        assert_eq!(pushed - emitted, MAX_STOP_BYTES - 1);
        // The long stop completes (it starts before "ab", which ends at the same byte).
        assert_eq!(
            m.push("b"),
            StopOutcome::Stopped {
                text: String::new(),
                stop_index: 0
            }
        );
    }

    #[test]
    fn stop_limits_name_the_field() {
        let ok: Vec<String> = vec!["x".repeat(MAX_STOP_BYTES); MAX_STOPS];
        assert_eq!(check_stops(&ok), Ok(()));
        let five = vec!["x".to_string(); MAX_STOPS + 1];
        assert_eq!(check_stops(&five), Err(StopError::TooMany(5)));
        let long = vec!["a".into(), "y".repeat(MAX_STOP_BYTES + 1)];
        let e = check_stops(&long).unwrap_err();
        assert_eq!(
            e,
            StopError::TooLong {
                index: 1,
                bytes: 257
            }
        );
        assert!(e.to_string().contains("`stop`"), "{e}");
    }

    #[test]
    fn stop_across_chunk_boundaries() {
        let mut m = stops(&["</end>"]);
        assert_eq!(m.push("Hello </"), cont("Hello "));
        assert_eq!(m.push("en"), cont(""));
        assert_eq!(
            m.push("d> and more"),
            StopOutcome::Stopped {
                text: String::new(),
                stop_index: 0
            }
        );
        assert_eq!(m.stopped(), Some(0));
        // Nothing after the stop is ever emitted.
        assert_eq!(
            m.push("later"),
            StopOutcome::Stopped {
                text: String::new(),
                stop_index: 0
            }
        );
        assert_eq!(m.finish(), "");
    }

    #[test]
    fn held_prefix_released_when_it_diverges() {
        let mut m = stops(&["</end>"]);
        assert_eq!(m.push("a </e"), cont("a "));
        assert_eq!(m.push("x"), cont("</ex"));
        assert_eq!(
            m.push("y</end>z"),
            StopOutcome::Stopped {
                text: "y".into(),
                stop_index: 0
            }
        );
    }

    #[test]
    fn multiple_stop_strings_earliest_wins() {
        let mut m = stops(&["STOP", "\n\n", "User:"]);
        assert_eq!(m.push("one\n"), cont("one"));
        assert_eq!(m.push("two User"), cont("\ntwo "));
        assert_eq!(
            m.push(": x\n\nSTOP"),
            StopOutcome::Stopped {
                text: String::new(),
                stop_index: 2
            }
        );

        // The earliest position wins, whatever the order of the stop strings.
        let mut m = stops(&["bc", "abcd"]);
        assert_eq!(
            m.push("xabcd"),
            StopOutcome::Stopped {
                text: "x".into(),
                stop_index: 1
            }
        );
    }

    #[test]
    fn no_false_holding() {
        let mut m = stops(&["###", "Ω!"]);
        assert_eq!(m.push("hello world"), cont("hello world"));
        assert_eq!(m.push("#"), cont(""));
        assert_eq!(m.push("# ok Ω"), cont("## ok "));
        // End of stream: a held partial stop string is released.
        assert_eq!(m.finish(), "Ω");
        assert_eq!(m.finish(), "");

        let mut none = stops(&[]);
        assert_eq!(none.push("abc"), cont("abc"));
        let mut empty = stops(&[""]);
        assert_eq!(empty.push("abc"), cont("abc"));
    }
}
