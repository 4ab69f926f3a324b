//! The model catalog: what `/v1/models`, `/v1/models/{id}` and `models/search` list
//! and what model ids resolve to.
//!
//! An entry joins what the GGUF file says about itself (context window, parameter
//! count, quantization, chat template; [`tessera_model::gguf::ModelInfo`]) with what
//! the operator says in the deployment file (description, tags, aliases, deprecation
//! and sunset dates; `[[models]]` in `ops/deploy/README.md`). Ids and aliases
//! resolve case-insensitively to one entry. A model past its sunset date is
//! removed: it is not listed and a request for it is a 404 (Workers AI code 5007).

use serde::Serialize;

/// A date of the catalog (deprecation, sunset): as written (`YYYY-MM-DD`, UTC) and
/// as Unix seconds of its 00:00 UTC.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Dated {
    /// `YYYY-MM-DD`.
    pub date: String,
    /// Seconds since the Unix epoch at 00:00 UTC of that day.
    pub unix: i64,
}

/// One servable model.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CatalogEntry {
    /// Catalog id, e.g. `@cf/huggingfacetb/smollm2-135m-instruct`.
    pub id: String,
    /// Task name (`Text Generation`).
    pub task: String,
    /// One-line description: the deployment file's, else built from the GGUF's
    /// metadata ([`CatalogEntry::with_file`]).
    pub description: String,
    /// Context window in tokens.
    pub context_window: usize,
    /// Who publishes it: the second segment of an `@cf/{author}/{name}` id, else
    /// `tessera`.
    pub author: String,
    /// Weights (element count of every tensor in the GGUF), 0 when unknown.
    pub parameters: u64,
    /// The file's quantization as llama.cpp names it (`general.file_type`:
    /// `Q4_K_M`, `Q4_1`, ...; else the GGML type of most of the weights), empty
    /// when unknown.
    pub quantization: String,
    /// Whether the GGUF carries a chat template.
    pub chat_template: bool,
    /// Tags (deployment file).
    pub tags: Vec<String>,
    /// Other ids that resolve to this model (deployment file).
    pub aliases: Vec<String>,
    /// When it was deprecated: answers carry `Deprecation`.
    pub deprecated: Option<Dated>,
    /// When it is removed: answers carry `Sunset` until then, 404 from then on.
    pub sunset: Option<Dated>,
}

impl CatalogEntry {
    /// A text-generation model `id` with a `context_window`-token window and no
    /// other metadata.
    pub fn new(id: &str, context_window: usize) -> Self {
        let description = if id == tessera_model::gguf::DEFAULT_MODEL_ID {
            "SmolLM2-135M-Instruct (Hugging Face TB), GGUF Q4_1, served by the Tessera CPU \
             runtime"
                .to_string()
        } else {
            format!("{id}, served by the Tessera CPU runtime")
        };
        let author = id
            .strip_prefix("@cf/")
            .or_else(|| id.strip_prefix("@hf/"))
            .and_then(|rest| rest.split_once('/'))
            .map_or("tessera", |(author, _)| author)
            .to_string();
        Self {
            id: id.into(),
            task: "Text Generation".into(),
            description,
            context_window,
            author,
            parameters: 0,
            quantization: String::new(),
            chat_template: false,
            tags: Vec::new(),
            aliases: Vec::new(),
            deprecated: None,
            sunset: None,
        }
    }

    /// The entry with the metadata of a loaded GGUF (parameters, quantization, chat
    /// template, context window) and a description built from it
    /// ([`ModelInfo::description`](tessera_model::gguf::ModelInfo::description));
    /// a deployment file's description is set after this, replacing it.
    pub fn with_file(mut self, info: &tessera_model::gguf::ModelInfo) -> Self {
        self.parameters = info.parameters;
        self.quantization = info.quantization.clone();
        self.chat_template = info.chat_template;
        if self.context_window == 0 {
            self.context_window = info.context;
        }
        self.description = info.description(&self.id, self.context_window);
        self
    }

    /// Whether the sunset date has come at `now` (Unix seconds).
    pub fn removed_at(&self, now: i64) -> bool {
        self.sunset.as_ref().is_some_and(|s| now >= s.unix)
    }

    /// Whether `name` (any case) is this model's id or one of its aliases.
    pub fn answers_to(&self, name: &str) -> bool {
        self.id.eq_ignore_ascii_case(name)
            || self.aliases.iter().any(|a| a.eq_ignore_ascii_case(name))
    }

    /// The headers a deprecated or sunsetting model's answers carry: `Deprecation:
    /// @<unix seconds>` (RFC 9745) and `Sunset: <IMF-fixdate>` (RFC 8594).
    pub fn lifecycle_headers(&self) -> Vec<(&'static str, String)> {
        let mut h = Vec::new();
        if let Some(d) = &self.deprecated {
            h.push(("deprecation", format!("@{}", d.unix)));
        }
        if let Some(s) = &self.sunset {
            h.push(("sunset", http_date(s.unix)));
        }
        h
    }
}

/// What a model name resolves to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup<'a> {
    /// A served model.
    Served(&'a CatalogEntry),
    /// A model whose sunset date has come.
    Removed(&'a CatalogEntry),
    /// No such id or alias.
    Unknown,
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
    /// Errors: a name (id or alias, ignoring case) given to two entries, naming it.
    pub fn new(entries: Vec<CatalogEntry>) -> Result<Self, String> {
        let mut seen = std::collections::HashSet::new();
        for e in &entries {
            for name in std::iter::once(&e.id).chain(&e.aliases) {
                if !seen.insert(name.to_ascii_lowercase()) {
                    return Err(format!("model name {name} is given to two models"));
                }
            }
        }
        Ok(Self { entries })
    }

    /// All entries, removed ones included.
    pub fn entries(&self) -> &[CatalogEntry] {
        &self.entries
    }

    /// Resolves a model id or alias (any case), whether or not it was removed.
    pub fn get(&self, id: &str) -> Option<&CatalogEntry> {
        self.entries.iter().find(|e| e.answers_to(id))
    }

    /// Resolves a model id or alias (any case) at `now` (Unix seconds).
    pub fn lookup(&self, id: &str, now: i64) -> Lookup<'_> {
        match self.get(id) {
            Some(e) if e.removed_at(now) => Lookup::Removed(e),
            Some(e) => Lookup::Served(e),
            None => Lookup::Unknown,
        }
    }
}

/// Seconds since the Unix epoch, now.
pub fn now_secs() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// `unix` seconds as an HTTP date (RFC 9110 IMF-fixdate, e.g. `Sun, 06 Nov 1994
/// 08:49:37 GMT`). The civil date follows H. Hinnant's `civil_from_days`
/// (<https://howardhinnant.github.io/date_algorithms.html#civil_from_days>).
pub fn http_date(unix: i64) -> String {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let (days, secs) = (unix.div_euclid(86_400), unix.rem_euclid(86_400));
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{}, {d:02} {} {y:04} {:02}:{:02}:{:02} GMT",
        DAYS[days.rem_euclid(7) as usize],
        MONTHS[(m - 1) as usize],
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn http_dates_and_lifecycle_headers() {
        assert_eq!(http_date(784_111_777), "Sun, 06 Nov 1994 08:49:37 GMT");
        assert_eq!(http_date(0), "Thu, 01 Jan 1970 00:00:00 GMT");
        assert_eq!(http_date(1_709_164_800), "Thu, 29 Feb 2024 00:00:00 GMT");
        let mut e = CatalogEntry::new("@cf/meta/llama", 8192);
        assert_eq!(e.author, "meta");
        assert!(e.lifecycle_headers().is_empty());
        e.deprecated = Some(Dated {
            date: "2024-02-29".into(),
            unix: 1_709_164_800,
        });
        e.sunset = Some(Dated {
            date: "1994-11-06".into(),
            unix: 784_080_000,
        });
        assert_eq!(
            e.lifecycle_headers(),
            vec![
                ("deprecation", "@1709164800".to_string()),
                ("sunset", "Sun, 06 Nov 1994 00:00:00 GMT".to_string())
            ]
        );
        assert!(e.removed_at(784_080_000) && !e.removed_at(784_079_999));
    }

    /// A review of the model families found every description bare (the id and
    /// "served by the Tessera CPU runtime"): the file's metadata describes it.
    #[test]
    fn an_entry_with_a_file_is_described_by_its_metadata() {
        let info = tessera_model::gguf::ModelInfo {
            name: Some("Gemma 3 270m".into()),
            architecture: "gemma3".into(),
            parameters: 268_098_176,
            quantization: "Q4_K_M".into(),
            chat_template: false,
            context: 32768,
        };
        let e = CatalogEntry::new("@cf/google/gemma-3-270m", 32768).with_file(&info);
        assert_eq!(
            e.description,
            "Gemma 3 270m: gemma3, 268M parameters, 32,768-token context window, GGUF Q4_K_M"
        );
        assert_eq!(
            (e.quantization.as_str(), e.chat_template),
            ("Q4_K_M", false)
        );
        // No `general.name`: the id; the window is the one it is served with.
        let unnamed = tessera_model::gguf::ModelInfo { name: None, ..info };
        let e = CatalogEntry::new("@cf/x/y", 4096).with_file(&unnamed);
        assert_eq!(
            e.description,
            "@cf/x/y: gemma3, 268M parameters, 4,096-token context window, GGUF Q4_K_M"
        );
    }

    #[test]
    fn ids_and_aliases_resolve_to_one_entry() {
        let mut a = CatalogEntry::new("@cf/x/a", 1);
        a.aliases = vec!["short".into()];
        let b = CatalogEntry::new("@cf/x/b", 1);
        let c = Catalog::new(vec![a.clone(), b.clone()]).unwrap();
        assert_eq!(c.lookup("SHORT", 0), Lookup::Served(&a));
        assert_eq!(c.lookup("@CF/X/B", 0), Lookup::Served(&b));
        assert_eq!(c.lookup("c", 0), Lookup::Unknown);
        let mut dup = b;
        dup.aliases = vec!["@cf/x/A".into()];
        let e = Catalog::new(vec![a, dup]).unwrap_err();
        assert!(e.contains("@cf/x/A"), "{e}");
    }
}
