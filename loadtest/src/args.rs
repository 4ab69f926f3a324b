//! Command-line arguments of `tessera loadtest` ([`LoadtestArgs`]) and the small
//! value types they parse into.

use clap::{Args, ValueEnum};
use serde::Serialize;
use std::path::PathBuf;
use std::str::FromStr;

/// The default model's catalog id.
pub const DEFAULT_MODEL: &str = "@cf/huggingfacetb/smollm2-135m-instruct";

/// Which HTTP API shape the requests use.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Api {
    /// Workers AI: `POST /client/v4/accounts/{account_id}/ai/run/{model}` (needs
    /// each tenant's account id).
    WorkersAi,
    /// OpenAI: `POST /v1/chat/completions` (chat) or `/v1/completions` (raw).
    Openai,
}

/// Prompt rendering.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// The server applies the model's chat template (one user message).
    Chat,
    /// The prompt is sent as raw text (no template).
    Raw,
}

/// A length distribution: `N` or `fixed:N` (always N), or `uniform:LO:HI`
/// (each value in LO..=HI equally likely).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LenDist {
    /// Always this many.
    Fixed {
        /// The value.
        n: usize,
    },
    /// Uniform in `lo..=hi`.
    Uniform {
        /// Smallest value.
        lo: usize,
        /// Largest value.
        hi: usize,
    },
}

impl LenDist {
    /// Draws one value.
    pub fn sample(&self, rng: &mut impl rand::Rng) -> usize {
        match *self {
            LenDist::Fixed { n } => n,
            LenDist::Uniform { lo, hi } => rng.random_range(lo..=hi),
        }
    }
}

impl FromStr for LenDist {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let num = |t: &str| {
            t.trim()
                .parse::<usize>()
                .map_err(|_| format!("`{t}` is not a non-negative integer"))
        };
        let parts: Vec<&str> = s.split(':').collect();
        let d = match parts.as_slice() {
            [n] => LenDist::Fixed { n: num(n)? },
            ["fixed", n] => LenDist::Fixed { n: num(n)? },
            ["uniform", lo, hi] => LenDist::Uniform {
                lo: num(lo)?,
                hi: num(hi)?,
            },
            _ => {
                return Err(format!(
                    "a length must be N, fixed:N or uniform:LO:HI. Given: {s}"
                ))
            }
        };
        match d {
            LenDist::Fixed { n: 0 } => Err("a length must be >= 1. Given: 0".into()),
            LenDist::Uniform { lo, hi } if lo == 0 || lo > hi => Err(format!(
                "uniform:LO:HI needs 1 <= LO <= HI. Given: {lo}:{hi}"
            )),
            d => Ok(d),
        }
    }
}

/// Arguments of `tessera loadtest`. Run length is `--requests` or
/// `--duration-secs` (default: 100 requests); arrivals are open-loop with
/// `--rate`, else closed-loop with `--concurrency` clients.
#[derive(Args, Clone, Debug)]
pub struct LoadtestArgs {
    /// Base URL of the server under test (`http://HOST:PORT`, no path). Repeat for
    /// a fleet of gateways on one store: request `i` goes to URL `i mod n`; tenant
    /// creation, the catalog and the usage reads use the first.
    #[arg(long, default_value = "http://127.0.0.1:8787")]
    pub url: Vec<String>,
    /// API shape: `workers-ai` (Tessera's `ai/run` route) or `openai`.
    #[arg(long, value_enum, default_value_t = Api::WorkersAi)]
    pub api: Api,
    /// Model id; repeat for several models behind one server. Prompt `i` goes to
    /// model `i mod n`, so requests interleave across models and each prompt's
    /// solo answer (solo-equality) comes from the same model.
    #[arg(long, default_value = DEFAULT_MODEL)]
    pub model: Vec<String>,
    /// `chat` (the server applies the chat template) or `raw` (text completion).
    #[arg(long, value_enum, default_value_t = Mode::Chat)]
    pub mode: Mode,

    /// Admin token of a Tessera gateway: the harness creates `--tenants` fresh
    /// tenants with one key each through the admin API.
    #[arg(long, env = "TESSERA_ADMIN_TOKEN", hide_env_values = true)]
    pub admin_token: Option<String>,
    /// Tenants to create with `--admin-token`, or virtual tenants (canaries
    /// only, one shared `--api-key`) without one.
    #[arg(long, default_value_t = 4)]
    pub tenants: usize,
    /// A JSON file with existing tenants: `[{"account_id": "...", "key": "tsk_..."}, ...]`
    /// (or the same objects one per line).
    #[arg(long, conflicts_with = "admin_token")]
    pub keys_file: Option<PathBuf>,
    /// One bearer key for every request (servers without tenants, e.g. llama-server
    /// started with `--api-key`).
    #[arg(long, conflicts_with_all = ["admin_token", "keys_file"])]
    pub api_key: Option<String>,

    /// Seed of the workload (prompts, canaries, arrivals, lengths, disconnects).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Open loop: Poisson arrivals at this many requests per second.
    #[arg(long)]
    pub rate: Option<f64>,
    /// Closed loop: this many clients, each sending its next request when the
    /// last one ends (ignored with `--rate`).
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// Run length in requests (default 100 when no `--duration-secs`).
    #[arg(long)]
    pub requests: Option<usize>,
    /// Run length in seconds (no new request starts after it).
    #[arg(long, conflicts_with = "requests")]
    pub duration_secs: Option<f64>,
    /// Prompt length in words (about one token each) before the canary line:
    /// `N`, `fixed:N` or `uniform:LO:HI`.
    #[arg(long, default_value = "uniform:8:96")]
    pub prompt_len: LenDist,
    /// Output length (`max_tokens`): `N`, `fixed:N` or `uniform:LO:HI`.
    #[arg(long, default_value = "uniform:16:64")]
    pub output_len: LenDist,
    /// Prompts from a JSONL file: each line a JSON string or
    /// `{"prompt": "...", "max_tokens": N}` (`max_tokens` optional).
    #[arg(long)]
    pub prompts_file: Option<PathBuf>,
    /// Distinct prompts per tenant (each is first run alone for solo-equality).
    #[arg(long, default_value_t = 8)]
    pub prompts_per_tenant: usize,
    /// Prefix-sharing workload: every prompt of a tenant starts with the same
    /// text of this many words (no tokenizer here: about 1.2 tokens a word with
    /// SmolLM2's), different per tenant, then its canary and question
    /// (`--prompt-len` words of its own: keep it short).
    /// A tenant-scoped prefix cache can then hit within a tenant only; the report
    /// shows the cached prompt tokens per tenant and the hit rate.
    #[arg(long)]
    pub shared_prefix_tokens: Option<usize>,
    /// Share of requests that stream (server-sent events), 0..=1.
    #[arg(long, default_value_t = 1.0)]
    pub stream_share: f64,
    /// Share of requests with a prompt longer than the context window, 0..=1;
    /// each must get a 4xx.
    #[arg(long, default_value_t = 0.0)]
    pub overlong_share: f64,
    /// Share of requests whose client disconnects at a random point of the
    /// stream, 0..=1 (such requests always stream).
    #[arg(long, default_value_t = 0.0)]
    pub disconnect_share: f64,
    /// Context window of the model in tokens (default: from the server's
    /// catalog, else 8192). With several models of different windows, normal
    /// prompts fit the smallest and over-long prompts exceed the largest.
    #[arg(long)]
    pub context_window: Option<usize>,
    /// Per-request time limit in seconds.
    #[arg(long, default_value_t = 300.0)]
    pub request_timeout_secs: f64,

    /// Skip the isolation checks (canaries, solo-equality, over-long, usage):
    /// a pure speed run.
    #[arg(long)]
    pub no_checks: bool,

    /// Folder for `report.json` and `report.html` (created).
    #[arg(long, default_value = "loadtest-report")]
    pub out: PathBuf,

    /// Run the same seeded workload against this OpenAI-compatible server after
    /// the main run and print both side by side.
    #[arg(long)]
    pub compare: Option<String>,
    /// Model id for the `--compare` server (default: the `--model` ids).
    #[arg(long)]
    pub compare_model: Option<String>,
    /// Bearer key for the `--compare` server (default: none).
    #[arg(long)]
    pub compare_key: Option<String>,
    /// Label of the main target in reports.
    #[arg(long, default_value = "tessera")]
    pub label: String,
    /// Label of the `--compare` target in reports.
    #[arg(long, default_value = "baseline")]
    pub compare_label: String,

    /// Fault mix: shell command (`sh -c`) that kills a node, run `--fault-at-secs`
    /// into the load phase.
    #[arg(long)]
    pub fault_kill_cmd: Option<String>,
    /// Fault mix: shell command that restarts it, run `--fault-downtime-secs`
    /// after the kill; it must return (start servers in the background). The
    /// outage ends when `GET URL/readyz` answers 200.
    #[arg(long, requires = "fault_kill_cmd")]
    pub fault_restart_cmd: Option<String>,
    /// Seconds into the load phase when the kill command runs.
    #[arg(long, default_value_t = 2.0)]
    pub fault_at_secs: f64,
    /// Seconds between the kill and the restart command.
    #[arg(long, default_value_t = 2.0)]
    pub fault_downtime_secs: f64,
    /// Repeat the fault: a kill every this many seconds (the first at
    /// `--fault-at-secs`), each followed by its restart, until the load phase
    /// ends. Without it, one kill.
    #[arg(long, requires = "fault_kill_cmd")]
    pub fault_every_secs: Option<f64>,
    /// Bearer token for the gateways' `/metrics` (their `--metrics-token`), read
    /// before and after the load phase for `tessera_request_restarts_total`;
    /// default: `--admin-token`.
    #[arg(long, env = "TESSERA_METRICS_TOKEN", hide_env_values = true)]
    pub metrics_token: Option<String>,

    /// No progress bar and no summary on stdout.
    #[arg(long)]
    pub quiet: bool,
}

impl LoadtestArgs {
    /// The first `--url` without a trailing slash: where tenants are created and
    /// the catalog and usage are read.
    pub fn primary_url(&self) -> String {
        self.url
            .first()
            .map_or("", String::as_str)
            .trim_end_matches('/')
            .to_string()
    }

    /// Checks ranges that clap cannot express.
    ///
    /// # Errors
    /// A message naming the argument, its limit and the value given.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("--stream-share", self.stream_share),
            ("--overlong-share", self.overlong_share),
            ("--disconnect-share", self.disconnect_share),
        ] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("{name} must be in 0..=1. Given: {v}"));
            }
        }
        if self.overlong_share + self.disconnect_share > 1.0 {
            return Err(format!(
                "--overlong-share + --disconnect-share must be <= 1. Given: {}",
                self.overlong_share + self.disconnect_share
            ));
        }
        if let Some(r) = self.rate {
            if !(r > 0.0 && r.is_finite()) {
                return Err(format!("--rate must be > 0. Given: {r}"));
            }
        }
        if self.url.is_empty() {
            return Err("--url must be given at least once".into());
        }
        if self.concurrency == 0 {
            return Err("--concurrency must be >= 1. Given: 0".into());
        }
        if self.tenants == 0 {
            return Err("--tenants must be >= 1. Given: 0".into());
        }
        if self.prompts_per_tenant == 0 {
            return Err("--prompts-per-tenant must be >= 1. Given: 0".into());
        }
        if self.shared_prefix_tokens == Some(0) {
            return Err("--shared-prefix-tokens must be >= 1. Given: 0".into());
        }
        if let Some(d) = self.duration_secs {
            if !(d > 0.0 && d.is_finite()) {
                return Err(format!("--duration-secs must be > 0. Given: {d}"));
            }
        }
        if self.requests == Some(0) {
            return Err("--requests must be >= 1. Given: 0".into());
        }
        if let Some(e) = self.fault_every_secs {
            if !(e > 0.0 && e.is_finite()) {
                return Err(format!("--fault-every-secs must be > 0. Given: {e}"));
            }
            if e <= self.fault_downtime_secs {
                return Err(format!(
                    "--fault-every-secs must be more than --fault-downtime-secs ({}). Given: {e}",
                    self.fault_downtime_secs
                ));
            }
        }
        if !(self.request_timeout_secs.is_finite() && self.request_timeout_secs > 0.0) {
            return Err(format!(
                "--request-timeout-secs must be > 0. Given: {}",
                self.request_timeout_secs
            ));
        }
        Ok(())
    }
}

/// `LoadtestArgs` parsed from `argv` (the program name first) as the CLI parses
/// them, or clap's error (tests only).
#[cfg(test)]
pub(crate) fn try_parse_args<I, T>(argv: I) -> Result<LoadtestArgs, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    use clap::Parser;
    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: LoadtestArgs,
    }
    Cli::try_parse_from(argv).map(|c| c.a)
}

/// [`try_parse_args`] for arguments that parse (tests only; panics otherwise).
#[cfg(test)]
pub(crate) fn parse_args<I, T>(argv: I) -> LoadtestArgs
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    try_parse_args(argv).unwrap_or_else(|e| panic!("{e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn len_dist_parses_and_rejects() {
        assert_eq!("32".parse(), Ok(LenDist::Fixed { n: 32 }));
        assert_eq!("fixed:7".parse(), Ok(LenDist::Fixed { n: 7 }));
        assert_eq!("uniform:4:9".parse(), Ok(LenDist::Uniform { lo: 4, hi: 9 }));
        assert!("0".parse::<LenDist>().is_err());
        assert!("uniform:9:4".parse::<LenDist>().is_err());
        assert!("normal:3".parse::<LenDist>().is_err());
        assert!("x".parse::<LenDist>().is_err());
    }

    #[test]
    fn fault_every_secs_parses_and_is_checked() {
        let kill = [
            "x",
            "--fault-kill-cmd",
            "true",
            "--fault-downtime-secs",
            "3",
        ];
        let a = parse_args(kill.iter().chain(&["--fault-every-secs", "20"]));
        assert_eq!(a.fault_every_secs, Some(20.0));
        assert_eq!(a.validate(), Ok(()));
        let a = parse_args(kill);
        assert_eq!(a.fault_every_secs, None);
        for bad in ["0", "3", "inf", "NaN"] {
            let a = parse_args(kill.iter().chain(&["--fault-every-secs", bad]));
            let e = a.validate().unwrap_err();
            assert!(e.contains("--fault-every-secs"), "{e}");
        }
        // It needs a kill command.
        assert!(try_parse_args(["x", "--fault-every-secs", "20"]).is_err());
        let a = parse_args(["x", "--metrics-token", "m".repeat(32).as_str()]);
        assert_eq!(a.metrics_token.as_deref().map(str::len), Some(32));
    }
}
