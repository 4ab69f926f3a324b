//! Constrained decoding: a request's `response_format` (any JSON object, or JSON
//! that matches a JSON Schema) enforced as a token mask applied to the logits before
//! each draw.
//!
//! The masks come from llguidance (Low-level Guidance,
//! <https://github.com/guidance-ai/llguidance>): the schema becomes a context-free
//! grammar over a regex lexer, and each step's mask is the set of vocabulary tokens
//! whose bytes keep the output a prefix of some valid document (computed by walking
//! a trie of the vocabulary, `toktrie`). A mask depends on the sequence's own tokens
//! only, so constrained outputs stay batch-invariant.
//!
//! Bounds (a schema is attacker-controlled input): at most [`MAX_SCHEMA_BYTES`] of
//! JSON, nested at most [`MAX_SCHEMA_DEPTH`] deep; compilation and each mask run on
//! llguidance's fuel limits ([`GrammarCompiler::new`]), so a pathological schema
//! fails with [`GrammarError::Invalid`] instead of stalling a batch.

use llguidance::api::{ParserLimits, TopLevelGrammar};
use llguidance::toktrie::{ApproximateTokEnv, TokEnv, TokRxInfo, TokTrie};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::sync::Arc;

/// Largest accepted schema, as compact JSON bytes.
pub const MAX_SCHEMA_BYTES: usize = 32 * 1024;
/// Deepest accepted nesting of objects and arrays in a schema document.
pub const MAX_SCHEMA_DEPTH: usize = 32;

/// What shape a request's output must take.
///
/// Serialized with a `type` tag, as OpenAI's `response_format` (`{"type":
/// "json_object"}`, `{"type": "json_schema", "schema": {...}}`); this is the engine's
/// form, which travels on the node links, not the API's (the gateway maps both APIs'
/// shapes onto it).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    /// Any JSON object (OpenAI's JSON mode).
    JsonObject,
    /// A JSON document valid against `schema` (JSON Schema draft 2020-12, the
    /// subset llguidance supports: objects, arrays, enums, consts, numbers and
    /// integers with bounds, string lengths and patterns, `anyOf`, local `$ref`).
    JsonSchema {
        /// The schema document.
        schema: Value,
    },
}

/// Why a format cannot be enforced. Messages say what to change.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// The schema is larger than [`MAX_SCHEMA_BYTES`].
    #[error("the schema is {bytes} bytes of JSON; the limit is {MAX_SCHEMA_BYTES}")]
    TooLarge {
        /// Its size as compact JSON.
        bytes: usize,
    },
    /// The schema nests deeper than [`MAX_SCHEMA_DEPTH`].
    #[error("the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")]
    TooDeep,
    /// The schema is not an object or boolean, uses something llguidance does not
    /// support, cannot be satisfied, or exceeds the compile budget.
    #[error("the schema cannot be compiled: {0}")]
    Invalid(String),
    /// The vocabulary could not be loaded into the constraint engine.
    #[error("constrained decoding is unavailable for this model: {0}")]
    Vocabulary(String),
}

/// Compiles formats into [`Constraint`]s for one tokenizer's vocabulary. Building
/// it walks the whole vocabulary (tens of ms); one per tokenizer, shared
/// ([`crate::tokenizer::Tokenizer::grammar`]).
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab: usize,
    eos: u32,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab", &self.vocab)
            .finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// A compiler for one vocabulary: `tokens` yields each token id's bytes in id
    /// order (byte-level decoded) and whether it is a control token. Control
    /// tokens carry llguidance's special-token marker (byte 0xFF, never valid
    /// UTF-8), so no text can match them; the end-of-sequence token `eos` is what
    /// a completed document allows. Takes the vocabulary rather than the
    /// tokenizer, which caches one compiler ([`crate::tokenizer::Tokenizer::grammar`]).
    ///
    /// Budget: llguidance's default fuel (about 20 ms of lexer construction per
    /// compile, about 15 ms of lexer work per mask), a grammar of at most 200,000
    /// symbols and 50,000 lexer states.
    ///
    /// Errors: [`GrammarError::Vocabulary`] when `eos` is `None` (the model
    /// declares no end-of-sequence token) or the trie cannot be built.
    pub fn new<'a>(
        tokens: impl ExactSizeIterator<Item = (&'a [u8], bool)>,
        eos: Option<u32>,
        bos: Option<u32>,
    ) -> Result<Self, GrammarError> {
        let vocab = tokens.len();
        let eos = eos.ok_or_else(|| {
            GrammarError::Vocabulary("the model declares no end-of-sequence token".into())
        })?;
        let words: Vec<Vec<u8>> = tokens
            .map(|(bytes, control)| {
                if control {
                    let mut w = Vec::with_capacity(bytes.len() + 1);
                    w.push(TokTrie::SPECIAL_TOKEN_MARKER);
                    w.extend_from_slice(bytes);
                    w
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let mut info = TokRxInfo::new(vocab as u32, eos);
        info.tok_bos = bos;
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory =
            ParserFactory::new_simple(&env).map_err(|e| GrammarError::Vocabulary(e.to_string()))?;
        factory.quiet();
        let limits: &mut ParserLimits = factory.limits_mut();
        limits.max_grammar_size = 200_000;
        limits.max_lexer_states = 50_000;
        limits.verbose_errors = false;
        Ok(Self {
            factory,
            vocab,
            eos,
        })
    }

    /// Checks `format`'s bounds and compiles it into a fresh [`Constraint`] at the
    /// start of the output; the first mask is computed here, so a schema that fails
    /// only when used fails now.
    ///
    /// Errors: [`GrammarError::TooLarge`], [`GrammarError::TooDeep`],
    /// [`GrammarError::Invalid`].
    pub fn compile(&self, format: &ResponseFormat) -> Result<Constraint, GrammarError> {
        let schema = match format {
            ResponseFormat::JsonObject => serde_json::json!({"type": "object"}),
            ResponseFormat::JsonSchema { schema } => {
                check_bounds(schema)?;
                schema.clone()
            }
        };
        let mut schema = match schema {
            Value::Object(mut o) => {
                // Output formatting is the server's choice, not the caller's.
                o.remove("x-guidance");
                Value::Object(o)
            }
            Value::Bool(b) => Value::Bool(b),
            other => {
                return Err(GrammarError::Invalid(format!(
                    "a schema must be a JSON object or boolean, not {}",
                    json_type(&other)
                )))
            }
        };
        if let Value::Bool(b) = schema {
            // `true` accepts any JSON value; `false` accepts nothing.
            if !b {
                return Err(GrammarError::Invalid(
                    "the schema `false` accepts nothing".into(),
                ));
            }
            schema = serde_json::json!({});
        }
        output_options().apply_to(&mut schema);
        let grammar = TopLevelGrammar::from_json_schema(schema);
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| GrammarError::Invalid(short(&e.to_string())))?;
        let mut c = Constraint {
            matcher: Matcher::new(Ok(parser)),
            vocab: self.vocab,
            eos: self.eos,
            failed: None,
        };
        c.matcher
            .compute_mask()
            .map_err(|e| GrammarError::Invalid(short(&e.to_string())))?;
        if let Some(e) = c.matcher.get_error() {
            return Err(GrammarError::Invalid(short(&e)));
        }
        Ok(c)
    }
}

/// Compact, one-line JSON: `", "` between items and `": "` after keys (how models
/// write JSON in their training data), no other whitespace (so a sampled run of
/// blanks cannot fill `max_tokens`).
fn output_options() -> JsonCompileOptions {
    JsonCompileOptions {
        item_separator: ", ".into(),
        key_separator: ": ".into(),
        whitespace_flexible: false,
        ..JsonCompileOptions::default()
    }
}

/// The first line of an llguidance error, at most 300 bytes (errors can quote
/// the grammar).
fn short(e: &str) -> String {
    let line = e.lines().next().unwrap_or("").trim();
    let mut end = line.len().min(300);
    while !line.is_char_boundary(end) {
        end -= 1;
    }
    line[..end].to_string()
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// Size and depth bounds of a schema document.
fn check_bounds(schema: &Value) -> Result<(), GrammarError> {
    fn depth(v: &Value) -> usize {
        match v {
            Value::Array(a) => 1 + a.iter().map(depth).max().unwrap_or(0),
            Value::Object(o) => 1 + o.values().map(depth).max().unwrap_or(0),
            _ => 0,
        }
    }
    // serde_json's parser already refuses nesting beyond 128, so this recursion
    // is bounded.
    if depth(schema) > MAX_SCHEMA_DEPTH {
        return Err(GrammarError::TooDeep);
    }
    let bytes = serde_json::to_vec(schema).map_or(usize::MAX, |b| b.len());
    if bytes > MAX_SCHEMA_BYTES {
        return Err(GrammarError::TooLarge { bytes });
    }
    Ok(())
}

/// One sequence's grammar state: masks the logits before each draw and advances
/// with each sampled token.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
    eos: u32,
    /// Why the grammar stopped accepting tokens (an llguidance error or budget),
    /// when it did; from then on only end-of-sequence is allowed.
    failed: Option<String>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("vocab", &self.vocab)
            .field("failed", &self.failed)
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// Sets every logit the grammar forbids at this position to `-inf` (ids past
    /// the vocabulary too). Once the document is complete only end-of-sequence
    /// remains; if the grammar fails (budget, internal error) likewise, and
    /// [`Self::failure`] says why. Cost: one mask (tens of µs to a few ms).
    pub fn mask_logits(&mut self, logits: &mut [f32]) {
        let mask = match self.failed {
            Some(_) => None,
            None => match self.matcher.compute_mask_or_eos() {
                Ok(m) => Some(m),
                Err(e) => {
                    self.failed = Some(short(&e.to_string()));
                    None
                }
            },
        };
        let Some(mask) = mask else {
            for (i, l) in logits.iter_mut().enumerate() {
                if i != self.eos as usize {
                    *l = f32::NEG_INFINITY;
                }
            }
            return;
        };
        let n = logits.len().min(self.vocab);
        mask.iter_unset_entries(|i| {
            if i < n {
                logits[i] = f32::NEG_INFINITY;
            }
        });
        for l in logits.iter_mut().skip(self.vocab) {
            *l = f32::NEG_INFINITY;
        }
    }

    /// Advances past `token` (the token just sampled, or the first token a
    /// prefill node sampled). A token the grammar does not allow marks the
    /// constraint failed.
    pub fn accept(&mut self, token: u32) {
        if self.failed.is_some() || self.matcher.is_stopped() {
            return;
        }
        if let Err(e) = self.matcher.consume_token(token) {
            self.failed = Some(short(&e.to_string()));
        }
    }

    /// Whether the document is complete: no token but end-of-sequence may follow.
    pub fn is_complete(&self) -> bool {
        self.failed.is_none() && self.matcher.is_stopped()
    }

    /// Why the constraint stopped early, if it did.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokenizer::tests::test_tokenizer;
    use serde_json::json;

    fn compiler() -> &'static GrammarCompiler {
        test_tokenizer()
            .unwrap()
            .grammar()
            .expect("the vocabulary loads")
    }

    fn schema(s: Value) -> ResponseFormat {
        ResponseFormat::JsonSchema { schema: s }
    }

    fn allowed(c: &mut Constraint, vocab: usize) -> Vec<u32> {
        let mut logits = vec![0.0f32; vocab];
        c.mask_logits(&mut logits);
        (0..vocab as u32)
            .filter(|&i| logits[i as usize].is_finite())
            .collect()
    }

    /// Feeds `text`'s tokens one at a time; returns how many the mask allowed
    /// before the first it forbade.
    fn walk(c: &mut Constraint, text: &str) -> usize {
        let tok = test_tokenizer().unwrap();
        let ids = tok.encode(text, false).unwrap();
        for (n, &id) in ids.iter().enumerate() {
            if !allowed(c, tok.vocab_size()).contains(&id) {
                return n;
            }
            c.accept(id);
        }
        ids.len()
    }

    #[test]
    fn json_mode_starts_with_a_brace_and_ends_with_end_of_sequence() {
        let tok = test_tokenizer().unwrap();
        let mut c = compiler().compile(&ResponseFormat::JsonObject).unwrap();
        let first = allowed(&mut c, tok.vocab_size());
        assert!(!first.is_empty());
        for id in &first {
            assert_eq!(tok.token_bytes_ref(*id).first(), Some(&b'{'), "token {id}");
        }
        let doc = r#"{"name": "Bob", "age": 3}"#;
        assert_eq!(walk(&mut c, doc), tok.encode(doc, false).unwrap().len());
        assert!(c.is_complete());
        assert_eq!(
            allowed(&mut c, tok.vocab_size()),
            vec![tok.eos_id().unwrap()]
        );
        assert_eq!(c.failure(), None);
    }

    #[test]
    fn a_schema_forbids_what_it_does_not_allow() {
        let s = json!({
            "type": "object",
            "properties": {
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "color": {"enum": ["red", "blue"]}
            },
            "required": ["age", "color"],
            "additionalProperties": false
        });
        let c = compiler().compile(&schema(s)).unwrap();
        let ok = r#"{"age": 42, "color": "red"}"#;
        let n = test_tokenizer().unwrap().encode(ok, false).unwrap().len();
        assert_eq!(walk(&mut c.clone(), ok), n);
        for bad in [
            r#"{"age": 420, "color": "red"}"#,
            r#"{"age": 42, "color": "green"}"#,
            r#"{"color": "red", "age": 4}"#,
            r#"{"age": 42, "colour": "red"}"#,
            r#"{"age": -1, "color": "red"}"#,
        ] {
            let mut c = c.clone();
            let n = test_tokenizer().unwrap().encode(bad, false).unwrap().len();
            assert!(walk(&mut c, bad) < n, "{bad} was allowed whole");
        }
    }

    #[test]
    fn a_token_the_mask_forbade_marks_the_constraint_failed_and_allows_only_eos() {
        let tok = test_tokenizer().unwrap();
        let mut c = compiler().compile(&ResponseFormat::JsonObject).unwrap();
        c.accept(tok.encode("hello", false).unwrap()[0]);
        assert!(c.failure().is_some());
        assert!(!c.is_complete());
        assert_eq!(
            allowed(&mut c, tok.vocab_size()),
            vec![tok.eos_id().unwrap()]
        );
    }

    #[test]
    fn logits_past_the_vocabulary_are_masked() {
        let tok = test_tokenizer().unwrap();
        let mut c = compiler().compile(&ResponseFormat::JsonObject).unwrap();
        let mut logits = vec![0.0f32; tok.vocab_size() + 64];
        c.mask_logits(&mut logits);
        assert!(logits[tok.vocab_size()..]
            .iter()
            .all(|l| *l == f32::NEG_INFINITY));
    }

    #[test]
    fn schemas_out_of_bounds_or_unsupported_are_refused_with_the_reason() {
        let c = compiler();
        let mut deep = json!({"type": "integer"});
        for _ in 0..MAX_SCHEMA_DEPTH {
            deep = json!({"type": "array", "items": deep});
        }
        assert_eq!(c.compile(&schema(deep)).unwrap_err(), GrammarError::TooDeep);
        let big = json!({"type": "string", "description": "x".repeat(MAX_SCHEMA_BYTES)});
        assert!(matches!(
            c.compile(&schema(big)).unwrap_err(),
            GrammarError::TooLarge { bytes } if bytes > MAX_SCHEMA_BYTES
        ));
        for bad in [
            json!("object"),
            json!(false),
            json!({"type": "integer", "minimum": 5, "maximum": 1}),
            json!({"type": "wat"}),
            json!({"$ref": "#/$defs/missing"}),
            json!({"$ref": "https://example.com/schema.json"}),
        ] {
            let e = c.compile(&schema(bad.clone())).unwrap_err();
            assert!(
                matches!(e, GrammarError::Invalid(ref m) if !m.is_empty()),
                "{bad}: {e:?}"
            );
        }
    }

    #[test]
    fn a_caller_cannot_choose_the_output_formatting() {
        let s = json!({
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "required": ["a"],
            "additionalProperties": false,
            "x-guidance": {"whitespace_flexible": true, "key_separator": ":   "}
        });
        let mut c = compiler().compile(&schema(s)).unwrap();
        let spaced = r#"{"a":   1}"#;
        let n = test_tokenizer()
            .unwrap()
            .encode(spaced, false)
            .unwrap()
            .len();
        assert!(walk(&mut c, spaced) < n);
    }
}
