//! [`LoadtestError`]: why a load test could not run, or ran and did not pass.

use std::fmt;
use std::path::PathBuf;

/// An input file of a run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputFile {
    /// `--prompts-file`: JSONL prompts.
    Prompts,
    /// `--keys-file`: the tenants' account ids and keys.
    Keys,
}

impl fmt::Display for InputFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Prompts => "prompts file",
            Self::Keys => "keys file",
        })
    }
}

/// Why a load test could not run ([`crate::run`]), or why it did not pass
/// ([`crate::main`]). A variant's message says what failed; an underlying error
/// (I/O, HTTP, JSON) is its [`source`](std::error::Error::source), not part of the
/// message.
#[derive(Debug, thiserror::Error)]
pub enum LoadtestError {
    /// An argument is out of its range: [`crate::LoadtestArgs::validate`]'s message,
    /// which names the flag, its limit and the value given.
    #[error("{0}")]
    InvalidArgs(String),
    /// `--shared-prefix-tokens` does not fit the (smallest) context window.
    #[error("--shared-prefix-tokens ({tokens}) must be less than the context window ({context_window} tokens)")]
    SharedPrefixTooLong {
        /// Words of the shared prefix asked for.
        tokens: usize,
        /// The context window it must fit (tokens).
        context_window: usize,
    },
    /// `--api workers-ai` with tenants that have no account id (virtual tenants).
    #[error("--api workers-ai needs tenants with account ids: give --admin-token or --keys-file (or use --api openai)")]
    NoAccountIds,
    /// An input file could not be read.
    #[error("reading {file} {}", path.display())]
    ReadInput {
        /// Which file.
        file: InputFile,
        /// Its path.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// A line of the prompts file is not a prompt: not JSON, an object without a
    /// string `prompt`, or neither a string nor an object.
    #[error("{} line {line}: {problem}", path.display())]
    BadPrompt {
        /// The prompts file.
        path: PathBuf,
        /// Line number (1-based).
        line: usize,
        /// What is wrong with the line.
        problem: &'static str,
        /// The JSON error, when the line is not JSON.
        #[source]
        json: Option<serde_json::Error>,
    },
    /// The prompts file has no prompt (only blank lines).
    #[error("prompts file {} has no prompts", path.display())]
    NoPrompts {
        /// The prompts file.
        path: PathBuf,
    },
    /// The keys file is not a JSON array of tenants, or (one tenant a line) a line
    /// is not a tenant object.
    #[error("parsing keys file {}{}", path.display(), at_line(*line))]
    BadKeysFile {
        /// The keys file.
        path: PathBuf,
        /// The line (1-based, counting non-blank lines), in the one-a-line format.
        line: Option<usize>,
        /// The JSON error.
        source: serde_json::Error,
    },
    /// The keys file lists no tenant.
    #[error("keys file {} lists no tenants", path.display())]
    NoTenants {
        /// The keys file.
        path: PathBuf,
    },
    /// An entry of the keys file has no `key`.
    #[error("keys file {} entry {entry} has no `key`", path.display())]
    KeylessTenant {
        /// The keys file.
        path: PathBuf,
        /// The entry's index (0-based).
        entry: usize,
    },
    /// The HTTP client could not be built.
    #[error("building the HTTP client")]
    HttpClient(#[source] reqwest::Error),
    /// A request of the harness's own (admin or usage API) got no answer, or its
    /// answer could not be read.
    #[error("{method} {url}")]
    Request {
        /// HTTP method.
        method: &'static str,
        /// The URL.
        url: String,
        /// The HTTP error.
        source: reqwest::Error,
    },
    /// The admin API refused to create a tenant (a wrong admin token: 401).
    #[error("creating tenant {name}: HTTP {status}: {body}")]
    TenantRefused {
        /// The tenant's name.
        name: String,
        /// The answer's status.
        status: reqwest::StatusCode,
        /// The answer's body (`null` when it is not JSON).
        body: serde_json::Value,
    },
    /// The admin API created a tenant but its answer lacks the tenant's id or key.
    #[error("creating tenant {name}: unexpected answer {body}")]
    TenantAnswer {
        /// The tenant's name.
        name: String,
        /// The answer's body.
        body: serde_json::Value,
    },
    /// Usage cannot be read for a tenant the server does not know (no account id
    /// and key).
    #[error("tenant {tenant} has no account id and key")]
    NoAccount {
        /// The tenant's label.
        tenant: String,
    },
    /// The usage API answered with an error status (a key the server does not
    /// know: 401).
    #[error("GET {url}: HTTP {status}: {body}")]
    UsageRefused {
        /// The usage URL.
        url: String,
        /// The answer's status.
        status: reqwest::StatusCode,
        /// The answer's body (`null` when it is not JSON).
        body: serde_json::Value,
    },
    /// The report folder could not be created.
    #[error("creating {}", path.display())]
    CreateDir {
        /// The folder.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// A report file could not be written.
    #[error("writing {}", path.display())]
    WriteFile {
        /// The file.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The report or a request record could not be serialized.
    #[error("serializing the report")]
    Serialize(#[from] serde_json::Error),
    /// The async runtime could not be started.
    #[error("starting the async runtime")]
    Runtime(#[source] std::io::Error),
    /// The run finished, and the report was written, but it did not pass: a check
    /// failed (a response with another tenant's canary, one unequal to its solo
    /// answer, an over-long prompt served, usage that does not match what the
    /// clients counted) or a phase failed. The counts are the main target's.
    #[error("load test failed: {}", failures.join("; "))]
    Failed {
        /// Responses carrying another tenant's canary.
        leaks: usize,
        /// Responses that differ from their solo answer.
        mismatches: usize,
        /// Over-long requests not answered with a 4xx.
        over_long_not_rejected: usize,
        /// Tenants whose usage does not match.
        usage_mismatches: usize,
        /// Every failure, as the report lists them.
        failures: Vec<String>,
    },
}

impl LoadtestError {
    /// Stable machine label.
    pub fn label(&self) -> &'static str {
        match self {
            Self::InvalidArgs(_) => "invalid_args",
            Self::SharedPrefixTooLong { .. } => "shared_prefix_too_long",
            Self::NoAccountIds => "no_account_ids",
            Self::ReadInput { .. } => "unreadable_input",
            Self::BadPrompt { .. } => "bad_prompt",
            Self::NoPrompts { .. } => "no_prompts",
            Self::BadKeysFile { .. } => "bad_keys_file",
            Self::NoTenants { .. } => "no_tenants",
            Self::KeylessTenant { .. } => "keyless_tenant",
            Self::HttpClient(_) => "http_client",
            Self::Request { .. } => "request_failed",
            Self::TenantRefused { .. } => "tenant_refused",
            Self::TenantAnswer { .. } => "tenant_answer",
            Self::NoAccount { .. } => "no_account",
            Self::UsageRefused { .. } => "usage_refused",
            Self::CreateDir { .. } => "create_dir",
            Self::WriteFile { .. } => "write_file",
            Self::Serialize(_) => "serialize",
            Self::Runtime(_) => "runtime",
            Self::Failed { .. } => "failed",
        }
    }

    /// The message and those of its sources, joined by `: ` (as the CLI prints an
    /// error).
    pub fn with_sources(&self) -> String {
        let mut s = self.to_string();
        let mut source = std::error::Error::source(self);
        while let Some(e) = source {
            s.push_str(": ");
            s.push_str(&e.to_string());
            source = e.source();
        }
        s
    }
}

/// ` line N`, or nothing.
fn at_line(line: Option<usize>) -> String {
    line.map(|l| format!(" line {l}")).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_are_kept_and_printed_after_the_message() {
        let json = serde_json::from_str::<serde_json::Value>("{").unwrap_err();
        let e = LoadtestError::BadKeysFile {
            path: "k.jsonl".into(),
            line: Some(2),
            source: json,
        };
        assert_eq!(e.to_string(), "parsing keys file k.jsonl line 2");
        assert_eq!(e.label(), "bad_keys_file");
        let source = std::error::Error::source(&e).expect("the JSON error");
        assert_eq!(
            e.with_sources(),
            format!("parsing keys file k.jsonl line 2: {source}")
        );
        let e = LoadtestError::NoPrompts {
            path: "p.jsonl".into(),
        };
        assert_eq!(e.with_sources(), "prompts file p.jsonl has no prompts");
    }
}
