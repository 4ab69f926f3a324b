//! The model catalog: what `/v1/models` and `models/search` list and what model ids
//! resolve to.

use serde::Serialize;

/// One servable model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CatalogEntry {
    /// Catalog id, e.g. `@cf/huggingfacetb/smollm2-135m-instruct`.
    pub id: String,
    /// Task name (`Text Generation`).
    pub task: String,
    /// One-line description.
    pub description: String,
    /// Context window in tokens.
    pub context_window: usize,
}

impl CatalogEntry {
    /// A text-generation model `id` with a `context_window`-token window.
    pub fn new(id: &str, context_window: usize) -> Self {
        let description = if id == tessera_model::gguf::DEFAULT_MODEL_ID {
            "SmolLM2-135M-Instruct (Hugging Face TB), GGUF Q4_1, served by the Tessera CPU \
             runtime"
                .to_string()
        } else {
            format!("{id}, served by the Tessera CPU runtime")
        };
        Self {
            id: id.into(),
            task: "Text Generation".into(),
            description,
            context_window,
        }
    }
}

/// The models this gateway serves (one set of engines per entry).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Catalog {
    entries: Vec<CatalogEntry>,
}

impl Catalog {
    /// A catalog with one model and the given context window.
    pub fn single(id: &str, context_window: usize) -> Self {
        Self {
            entries: vec![CatalogEntry::new(id, context_window)],
        }
    }

    /// A catalog of `entries`, in that order.
    ///
    /// Errors: two entries whose ids are equal ignoring case (requests resolve ids
    /// case-insensitively), naming the id.
    pub fn new(entries: Vec<CatalogEntry>) -> Result<Self, String> {
        let mut seen = std::collections::HashSet::new();
        for e in &entries {
            if !seen.insert(e.id.to_ascii_lowercase()) {
                return Err(format!("model id {} is served twice", e.id));
            }
        }
        Ok(Self { entries })
    }

    /// All entries.
    pub fn entries(&self) -> &[CatalogEntry] {
        &self.entries
    }

    /// Resolves a model id (exact, case-insensitive).
    pub fn get(&self, id: &str) -> Option<&CatalogEntry> {
        self.entries.iter().find(|e| e.id.eq_ignore_ascii_case(id))
    }
}
