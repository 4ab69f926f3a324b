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

/// The models this gateway serves (one engine per entry; today exactly one).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Catalog {
    entries: Vec<CatalogEntry>,
}

impl Catalog {
    /// A catalog with the default model and the given context window.
    pub fn single(id: &str, context_window: usize) -> Self {
        Self {
            entries: vec![CatalogEntry {
                id: id.into(),
                task: "Text Generation".into(),
                description: "SmolLM2-135M-Instruct (Hugging Face TB), GGUF Q4_1, served by the \
                              Tessera CPU runtime"
                    .into(),
                context_window,
            }],
        }
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
