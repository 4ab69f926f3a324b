//! Tessera's load test and isolation harness (`tessera loadtest`).
//!
//! It talks HTTP only, to a Tessera gateway (Workers AI or OpenAI routes) or to any
//! OpenAI-compatible server, and runs:
//!
//! 1. **tenants**: created through the admin API (`--admin-token`), read from a
//!    keys file, or virtual (one shared key);
//! 2. **solo phase**: every distinct prompt alone, greedy (`temperature` 0);
//! 3. **load phase**: a seeded request sequence, open loop (Poisson arrivals at
//!    `--rate`) or closed loop (`--concurrency` clients), with streaming,
//!    over-long prompts and client disconnects mixed in, and optionally a node
//!    killed and restarted by operator commands, once or every N seconds
//!    ([`fault`]), with what that cost the clients and the gateway's restart
//!    counters in the report's `node_loss`;
//! 4. **checks** ([`checks`]): no response carries another tenant's canary; each
//!    completed response equals its solo answer; over-long prompts get a 4xx; the
//!    usage API's totals equal what the clients counted, per tenant;
//! 5. **report** ([`report`]): `report.json`, `report.html` (plots inline),
//!    `requests.jsonl`, and a summary; per tenant the service, demand, TTFT and
//!    prefix-cache hits with Jain's fairness index ([`fairness`]); with
//!    `--compare URL` the same workload runs against a second server and both are
//!    shown side by side.
//!
//! `--shared-prefix-tokens N` turns the workload into a prefix-sharing one: every
//! prompt of a tenant starts with the same N-word text of its own
//! ([`workload`]).
//!
//! Entry points: [`run`] (async, returns the [`Report`]) and [`main`] (the CLI:
//! its own runtime, prints the summary, fails when a check fails).

pub mod args;
pub mod checks;
pub mod client;
pub mod error;
pub mod fairness;
pub mod fault;
pub mod metrics;
pub mod report;
mod runner;
pub mod tenants;
pub mod workload;

pub use args::{Api, LenDist, LoadtestArgs, Mode};
pub use error::{InputFile, LoadtestError};
pub use report::Report;
pub use runner::run;

/// `tessera loadtest`: runs [`run`] on a new multi-threaded runtime, prints the
/// summary (unless `--quiet`).
///
/// # Errors
/// What [`run`] returns, [`LoadtestError::Runtime`], and [`LoadtestError::Failed`]
/// with the failures when any check failed (so the process exits non-zero).
pub fn main(args: LoadtestArgs) -> Result<(), LoadtestError> {
    let quiet = args.quiet;
    let out = args.out.clone();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(LoadtestError::Runtime)?;
    let report = rt.block_on(run(args))?;
    if !quiet {
        print!("{}", report::summary(&report));
        println!("report: {}", out.join("report.html").display());
    }
    if !report.passed {
        // The main target's checks (the `--compare` target's, if any, come after).
        let main = report.targets.first().map(|t| &t.checks);
        let count = |f: fn(&report::Checks) -> usize| main.map_or(0, f);
        return Err(LoadtestError::Failed {
            leaks: count(|c| c.leaks),
            mismatches: count(|c| c.mismatches),
            over_long_not_rejected: count(|c| c.over_long_not_rejected),
            usage_mismatches: count(|c| c.usage_mismatches),
            failures: report.failures,
        });
    }
    Ok(())
}
