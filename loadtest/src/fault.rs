//! The fault mix's node kills and restarts, as operator-supplied shell commands
//! (so it works with any deployment: a process, a container, a Kubernetes pod),
//! and what they cost the clients.
//!
//! During the load phase: at `at` the kill command runs; `downtime` later the
//! restart command runs (it must return: start servers in the background); the
//! outage ends when `GET {base}/readyz` answers 200 (the gateway is up and reaches
//! its engines or nodes). With `every` the cycle repeats every `every` seconds
//! (kill `k` at `at + k * every`, at once if the last cycle ran late) until the
//! load phase ends; the first always runs. While a cycle runs, `GET {base}/healthz`
//! is polled: a connection that fails means the fault took the gateway itself
//! down, which explains streams cut without an error event.
//!
//! Requests that overlap an outage are counted apart in the report. A request that
//! failed with an error (an HTTP error status, an error event in the stream)
//! during an outage is excused; one that failed without any (a stream cut before
//! `[DONE]`: *truncated*; no HTTP status at all) only when the gateway was
//! unreachable during that outage ([`NodeLoss`]).
//!
//! The gateway's `tessera_request_restarts_total` (issue 36: what the gateway did
//! with the requests a node's failure hit) is read before and after the load phase
//! ([`read_restarts`]); the report shows the difference.

use crate::client::{End, Outcome};
use crate::metrics::{dist, Dist};
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// What to run and when.
#[derive(Clone, Debug)]
pub struct FaultPlan {
    /// Kills a node (`sh -c`).
    pub kill_cmd: String,
    /// Restarts it (`sh -c`); `None`: the deployment recovers by itself.
    pub restart_cmd: Option<String>,
    /// Delay from the phase start to the (first) kill.
    pub at: Duration,
    /// Delay from the kill to the restart.
    pub downtime: Duration,
    /// Repeat the cycle this often (kill to kill) until the load phase ends;
    /// `None`: one kill.
    pub every: Option<Duration>,
    /// Polled after the restart until it answers 200.
    pub health_url: String,
    /// Polled from the kill until healthy: a failed connection marks the
    /// gateway unreachable during that fault (`GET /healthz`).
    pub probe_url: String,
    /// Longest wait for health after the restart.
    pub health_timeout: Duration,
}

/// When things happened (seconds from the phase start) and how the commands
/// exited, for one kill.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FaultTimes {
    /// Kill command started.
    pub kill_at_s: f64,
    /// Its exit code (`None`: killed by a signal or not started).
    pub kill_exit_code: Option<i32>,
    /// Restart command started.
    pub restart_at_s: Option<f64>,
    /// Its exit code.
    pub restart_exit_code: Option<i32>,
    /// Health check answered 200 after the restart (`None`: never, within the
    /// timeout).
    pub ready_at_s: Option<f64>,
    /// A connection to the gateway failed between the kill and health: the
    /// fault took the gateway down too (cut streams are then excused).
    #[serde(default)]
    pub gateway_unreachable: bool,
}

/// The fault part of a target's report.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FaultReport {
    /// The kill command.
    pub kill_cmd: String,
    /// The restart command.
    pub restart_cmd: Option<String>,
    /// `--fault-every-secs`: the cycle's period (`None`: one kill).
    #[serde(default)]
    pub every_s: Option<f64>,
    /// Kills run.
    #[serde(default)]
    pub kills: usize,
    /// Timings and exit codes of the first kill.
    pub times: FaultTimes,
    /// Every kill's timings and exit codes, in order.
    #[serde(default)]
    pub cycles: Vec<FaultTimes>,
    /// Outage length (s): kill to ready (or to the end of the phase), summed over
    /// the kills.
    pub outage_s: f64,
    /// Requests whose lifetime overlapped an outage.
    pub requests_during_outage: usize,
    /// Of those, requests that failed (status >= 500, cut, or no answer).
    pub errors_during_outage: usize,
    /// Failed requests outside the outages (should be 0 on a healthy deployment).
    pub errors_outside_outage: usize,
}

/// One outage, seconds from the phase start.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Window {
    /// The kill.
    pub from: f64,
    /// Healthy again (or the phase's end).
    pub to: f64,
    /// The gateway was unreachable during it.
    pub gateway_unreachable: bool,
}

/// The outages of `cycles`; one that never became healthy ends at `phase_end_s`.
pub fn windows(cycles: &[FaultTimes], phase_end_s: f64) -> Vec<Window> {
    cycles
        .iter()
        .map(|t| Window {
            from: t.kill_at_s,
            to: t.ready_at_s.unwrap_or(phase_end_s.max(t.kill_at_s)),
            gateway_unreachable: t.gateway_unreachable,
        })
        .collect()
}

/// Whether `o` overlaps any of `ws`.
pub fn in_any(o: &Outcome, ws: &[Window]) -> bool {
    ws.iter().any(|w| overlaps(o, w.from, w.to))
}

async fn sh(cmd: &str) -> Option<i32> {
    match tokio::process::Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .stdin(std::process::Stdio::null())
        .status()
        .await
    {
        Ok(s) => s.code(),
        Err(e) => {
            eprintln!("loadtest: cannot run `{cmd}`: {e}");
            None
        }
    }
}

/// Whether `GET url` got no HTTP answer at all (any status is an answer).
async fn unreachable(probe: &reqwest::Client, url: &str) -> bool {
    probe.get(url).send().await.is_err()
}

/// One kill, restart and wait for health.
async fn cycle(
    plan: &FaultPlan,
    phase_start: Instant,
    probe: Option<&reqwest::Client>,
) -> FaultTimes {
    let since = |t: Instant| t.duration_since(phase_start).as_secs_f64();
    let mut times = FaultTimes {
        kill_at_s: since(Instant::now()),
        ..FaultTimes::default()
    };
    times.kill_exit_code = sh(&plan.kill_cmd).await;
    // Probe the gateway while the node is down.
    let up_at = Instant::now() + plan.downtime;
    loop {
        let left = up_at.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        if let Some(p) = probe {
            if !times.gateway_unreachable && unreachable(p, &plan.probe_url).await {
                times.gateway_unreachable = true;
            }
        }
        let left = up_at.saturating_duration_since(Instant::now());
        tokio::time::sleep(left.min(Duration::from_millis(100))).await;
    }
    if let Some(cmd) = &plan.restart_cmd {
        times.restart_at_s = Some(since(Instant::now()));
        times.restart_exit_code = sh(cmd).await;
    }
    let deadline = Instant::now() + plan.health_timeout;
    if let Some(probe) = probe {
        while Instant::now() < deadline {
            match probe.get(&plan.health_url).send().await {
                Ok(r) if r.status().is_success() => {
                    times.ready_at_s = Some(since(Instant::now()));
                    break;
                }
                Ok(_) => {}
                Err(_) => times.gateway_unreachable = true,
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    times
}

/// Runs the plan: the first kill at `at`, then (with `every`) one every `every`
/// until `stop` turns true (the load phase ended); a cycle once begun always
/// runs to its restart and health. Returns every kill's times.
pub async fn run(
    plan: FaultPlan,
    phase_start: Instant,
    mut stop: tokio::sync::watch::Receiver<bool>,
) -> Vec<FaultTimes> {
    let probe = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .pool_max_idle_per_host(0)
        .build()
        .ok();
    let mut out = Vec::new();
    for k in 0u32.. {
        let at = phase_start + plan.at + plan.every.map_or(Duration::ZERO, |e| e * k);
        if k > 0 {
            if *stop.borrow() {
                break;
            }
            let wait = tokio::time::sleep_until(at.into());
            tokio::select! {
                () = wait => {}
                _ = stop.wait_for(|s| *s) => break,
            }
        } else {
            tokio::time::sleep_until(at.into()).await;
        }
        out.push(cycle(&plan, phase_start, probe.as_ref()).await);
        if plan.every.is_none() {
            break;
        }
    }
    out
}

/// Whether `o`'s lifetime overlaps `[from, to]` (seconds from the phase start).
pub fn overlaps(o: &Outcome, from: f64, to: f64) -> bool {
    o.start_s <= to && o.start_s + o.e2e_s >= from
}

/// Whether `o` failed in a way a dead node explains.
pub fn is_outage_error(o: &Outcome) -> bool {
    match o.end {
        End::Cut | End::Transport => true,
        End::HttpError => o.status.is_some_and(|s| s >= 500),
        // A stream that began (HTTP 200) and then failed on the server's side:
        // unavailable (3040) or internal (3043) in Workers AI codes, or an OpenAI
        // server error.
        End::StreamError => {
            o.status.is_some_and(|s| s >= 500)
                || o.error.as_deref().is_some_and(|e| {
                    matches!(
                        e,
                        "3040" | "3043" | "server_error" | "engine_unavailable" | "internal_error"
                    )
                })
        }
        End::Complete | End::Disconnected => false,
    }
}

/// The report for a phase with faults; `phase_end_s` closes an outage that
/// never ended.
pub fn report(
    plan: &FaultPlan,
    cycles: Vec<FaultTimes>,
    outs: &[Outcome],
    phase_end_s: f64,
) -> FaultReport {
    let ws = windows(&cycles, phase_end_s);
    let during: Vec<&Outcome> = outs.iter().filter(|o| in_any(o, &ws)).collect();
    FaultReport {
        kill_cmd: plan.kill_cmd.clone(),
        restart_cmd: plan.restart_cmd.clone(),
        every_s: plan.every.map(|e| e.as_secs_f64()),
        kills: cycles.len(),
        outage_s: ws.iter().map(|w| w.to - w.from).sum(),
        requests_during_outage: during.len(),
        errors_during_outage: during.iter().filter(|o| is_outage_error(o)).count(),
        errors_outside_outage: outs
            .iter()
            .filter(|o| !in_any(o, &ws) && is_outage_error(o))
            .count(),
        times: cycles.first().cloned().unwrap_or_default(),
        cycles,
    }
}

/// How a failed request ended, for the node-loss figures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// The server said why: an HTTP error status with an error body, or an error
    /// event in the stream.
    ErrorEvent,
    /// A body that ended or broke without `[DONE]` (or, not streamed, before the
    /// whole answer) and without an error event.
    Truncated,
    /// No HTTP status at all: connection refused or reset, the client's timeout.
    Transport,
}

/// `o`'s failure, if it failed (complete answers and the client's own
/// disconnects did not).
pub fn failure(o: &Outcome) -> Option<Failure> {
    match o.end {
        End::Complete | End::Disconnected => None,
        End::HttpError | End::StreamError => Some(Failure::ErrorEvent),
        End::Cut => Some(Failure::Truncated),
        End::Transport => Some(Failure::Transport),
    }
}

/// Whether a failed `o` is explained by the outages `ws`: it overlaps one, and,
/// when it failed without an error event, the gateway itself was unreachable
/// during an outage it overlaps (a gateway that stays up must end every request
/// with `[DONE]` or an error event).
pub fn excused(o: &Outcome, ws: &[Window]) -> bool {
    let Some(f) = failure(o) else { return false };
    ws.iter()
        .filter(|w| overlaps(o, w.from, w.to))
        .any(|w| match f {
            Failure::ErrorEvent => true,
            Failure::Truncated | Failure::Transport => w.gateway_unreachable,
        })
}

/// The gateway's `tessera_request_restarts_total` by reason (issue 36): what it
/// did with requests a node's failure or drain hit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RestartCounts {
    /// `reason="restarted"`: started again from the beginning on another pair
    /// (no token had reached the client): *retried*.
    pub restarted: u64,
    /// `reason="continued"`: went on on another pair from the tokens the client
    /// had.
    pub continued: u64,
    /// `reason="moved"`: a draining decode node's request, gone on on another
    /// decode node with its KV written from the draining node's cache.
    #[serde(default)]
    pub moved: u64,
    /// `reason="not_restarted"`: no pair left, the attempt bound or the
    /// deadline reached: the client got an error.
    pub not_restarted: u64,
}

impl RestartCounts {
    /// `self - before`, per reason (saturating: a gateway restarted in between
    /// starts from 0).
    pub fn minus(&self, before: &RestartCounts) -> RestartCounts {
        RestartCounts {
            restarted: self.restarted.saturating_sub(before.restarted),
            continued: self.continued.saturating_sub(before.continued),
            moved: self.moved.saturating_sub(before.moved),
            not_restarted: self.not_restarted.saturating_sub(before.not_restarted),
        }
    }

    fn add(&mut self, o: &RestartCounts) {
        self.restarted += o.restarted;
        self.continued += o.continued;
        self.moved += o.moved;
        self.not_restarted += o.not_restarted;
    }
}

/// The metric family read by [`parse_restarts`].
pub const RESTARTS_SERIES: &str = "tessera_request_restarts_total";

/// Sums the `tessera_request_restarts_total` series of a Prometheus/OpenMetrics
/// text by their `reason` label (any other labels, in any order). `None` when the
/// text has no such series (not a gateway with nodes).
pub fn parse_restarts(text: &str) -> Option<RestartCounts> {
    let mut c = RestartCounts::default();
    let mut seen = false;
    for line in text.lines().map(str::trim) {
        let Some(rest) = line.strip_prefix(RESTARTS_SERIES) else {
            continue;
        };
        let Some((labels, value)) = rest.strip_prefix('{').and_then(|r| r.split_once('}')) else {
            continue;
        };
        // The value, then an optional timestamp.
        let Some(v) = value
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        let reason = labels.split(',').find_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            (k.trim() == "reason").then(|| v.trim().trim_matches('"'))
        });
        let n = v.max(0.0).round() as u64;
        seen = true;
        match reason {
            Some("restarted") => c.restarted += n,
            Some("continued") => c.continued += n,
            Some("moved") => c.moved += n,
            Some("not_restarted") => c.not_restarted += n,
            _ => {}
        }
    }
    seen.then_some(c)
}

/// Reads the restart counters of every gateway in `fleet` (`GET {base}/metrics`
/// with `token`, the admin or metrics token) and adds them up.
///
/// # Errors
/// A message naming the gateway when one cannot be read or does not export the
/// series.
pub async fn read_restarts(
    http: &reqwest::Client,
    fleet: &[String],
    token: &str,
) -> Result<RestartCounts, String> {
    let mut total = RestartCounts::default();
    for base in fleet {
        let url = format!("{base}/metrics");
        let resp = http
            .get(&url)
            .bearer_auth(token)
            .send()
            .await
            .map_err(|e| format!("GET {url}: {e}"))?;
        let status = resp.status();
        if !status.is_success() {
            return Err(format!("GET {url}: HTTP {status}"));
        }
        let text = resp.text().await.map_err(|e| format!("GET {url}: {e}"))?;
        let c =
            parse_restarts(&text).ok_or_else(|| format!("{url} exports no {RESTARTS_SERIES}"))?;
        total.add(&c);
    }
    Ok(total)
}

/// What node failures cost the clients in the load phase (issue 36): failed
/// requests by how they ended, whether the outages explain them, the gateway's
/// restart decisions, and the longest pause inside each stream.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeLoss {
    /// Normal (not over-long) requests of the load phase.
    pub requests: usize,
    /// Of those, failed ones (not complete and not the client's own
    /// disconnect).
    pub failed: usize,
    /// `failed / requests`.
    pub failed_share: f64,
    /// Failed with an error the server sent (HTTP error status, or an error event
    /// after a 200).
    pub failed_with_error_event: usize,
    /// Failed without one: `truncated + transport`.
    pub failed_without_error_event: usize,
    /// Streams (or bodies) that ended without `[DONE]` and without an error
    /// event. Each fails the run unless the gateway itself was down.
    pub truncated: usize,
    /// No HTTP status (connection refused or reset, the client's timeout).
    pub transport: usize,
    /// Failed requests that overlapped an outage.
    pub failed_during_faults: usize,
    /// Failed requests the outages explain ([`excused`]).
    pub excused: usize,
    /// Failed requests they do not explain (each fails the run).
    pub unexcused: usize,
    /// Completed requests that overlapped an outage.
    pub completed_during_faults: usize,
    /// The gateways' `tessera_request_restarts_total` over the load phase
    /// (`None`: not read; see `restarts_unavailable`). `restarted` is *retried*.
    pub restarts: Option<RestartCounts>,
    /// Why the restart counters could not be read.
    pub restarts_unavailable: Option<String>,
    /// Per completed stream, its largest gap between consecutive text events:
    /// over every completed stream with two or more.
    pub max_gap_ms: Dist,
    /// The same over the streams that overlapped an outage: what a
    /// continuation adds to a stream's gap.
    pub max_gap_during_faults_ms: Dist,
    /// The same over the streams that did not.
    pub max_gap_outside_faults_ms: Dist,
    /// Time to first token of the completed streams that overlapped an outage
    /// (a restart before the first token shows here).
    pub ttft_during_faults_ms: Dist,
}

/// The largest gap between consecutive text events of `o` (s); `None` with
/// fewer than two.
pub fn max_gap_s(o: &Outcome) -> Option<f64> {
    o.event_times_s
        .windows(2)
        .map(|w| w[1] - w[0])
        .fold(None, |m: Option<f64>, g| Some(m.map_or(g, |m| m.max(g))))
}

/// The node-loss figures of `outs` (over-long requests, told by `over_long`,
/// left out) against the outages `ws`.
pub fn node_loss(
    outs: &[Outcome],
    over_long: impl Fn(&Outcome) -> bool,
    ws: &[Window],
) -> NodeLoss {
    let normal: Vec<&Outcome> = outs.iter().filter(|o| !over_long(o)).collect();
    let mut r = NodeLoss {
        requests: normal.len(),
        ..NodeLoss::default()
    };
    let (mut all, mut during, mut outside, mut ttft) = (vec![], vec![], vec![], vec![]);
    for o in &normal {
        let hit = in_any(o, ws);
        if let Some(f) = failure(o) {
            r.failed += 1;
            match f {
                Failure::ErrorEvent => r.failed_with_error_event += 1,
                Failure::Truncated => r.truncated += 1,
                Failure::Transport => r.transport += 1,
            }
            if hit {
                r.failed_during_faults += 1;
            }
            if excused(o, ws) {
                r.excused += 1;
            } else {
                r.unexcused += 1;
            }
            continue;
        }
        if o.end != End::Complete {
            continue;
        }
        if hit {
            r.completed_during_faults += 1;
        }
        if !o.stream {
            continue;
        }
        if hit {
            ttft.extend(o.ttft_s);
        }
        if let Some(g) = max_gap_s(o) {
            all.push(g);
            if hit { &mut during } else { &mut outside }.push(g);
        }
    }
    r.failed_without_error_event = r.truncated + r.transport;
    r.failed_share = if r.requests > 0 {
        r.failed as f64 / r.requests as f64
    } else {
        0.0
    };
    r.max_gap_ms = dist(&all);
    r.max_gap_during_faults_ms = dist(&during);
    r.max_gap_outside_faults_ms = dist(&outside);
    r.ttft_during_faults_ms = dist(&ttft);
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny HTTP server on loopback: 200 on every path once `flag` exists, 503
    /// before. Returns its address.
    async fn health_server(flag: std::path::PathBuf) -> std::net::SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let resp: &[u8] = if flag.exists() {
                    b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n"
                } else {
                    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                };
                let _ = s.write_all(resp).await;
            }
        });
        addr
    }

    fn plan(addr: std::net::SocketAddr, restart: String) -> FaultPlan {
        FaultPlan {
            kill_cmd: "exit 3".into(),
            restart_cmd: Some(restart),
            at: Duration::from_millis(100),
            downtime: Duration::from_millis(200),
            every: None,
            health_url: format!("http://{addr}/readyz"),
            probe_url: format!("http://{addr}/healthz"),
            health_timeout: Duration::from_secs(20),
        }
    }

    /// The hooks run at the planned times, their exit codes are kept, and the
    /// outage ends when the health URL answers (here: a tiny HTTP server on
    /// loopback that the restart command "starts" by creating a file).
    #[tokio::test]
    async fn hooks_run_in_order_and_health_ends_the_outage() {
        let dir = tempfile::tempdir().unwrap();
        let flag = dir.path().join("up");
        let addr = health_server(flag.clone()).await;
        let plan = plan(addr, format!("touch {}", flag.display()));
        let start = Instant::now();
        let (_tx, rx) = tokio::sync::watch::channel(false);
        let all = run(plan.clone(), start, rx).await;
        assert_eq!(all.len(), 1);
        let t = all[0].clone();
        assert_eq!(t.kill_exit_code, Some(3));
        assert_eq!(t.restart_exit_code, Some(0));
        assert!(!t.gateway_unreachable, "the server answered throughout");
        assert!(t.kill_at_s >= 0.1);
        let r = t.restart_at_s.unwrap();
        assert!(r >= t.kill_at_s + 0.2);
        assert!(t.ready_at_s.unwrap() >= r);
        let o = |start_s: f64, e2e_s: f64, end| Outcome {
            end,
            e2e_s,
            ..Outcome::pending(0, 0, 0, true, start_s)
        };
        let outs = vec![
            o(t.kill_at_s - 0.05, 0.1, End::Cut),
            o(t.ready_at_s.unwrap() + 5.0, 0.1, End::Transport),
            o(0.0, 0.01, End::Complete),
        ];
        let rep = report(&plan, all, &outs, 10.0);
        assert_eq!(rep.kills, 1);
        assert_eq!(rep.every_s, None);
        assert_eq!(rep.requests_during_outage, 1);
        assert_eq!(rep.errors_during_outage, 1);
        assert_eq!(rep.errors_outside_outage, 1);
    }

    /// With `every`, kills repeat on schedule until the stop signal, and the
    /// cycle under way when it comes still restarts; a probe URL nobody listens
    /// on marks the gateway unreachable.
    #[tokio::test]
    async fn repeated_faults_until_stopped() {
        let dir = tempfile::tempdir().unwrap();
        let flag = dir.path().join("up");
        let count = dir.path().join("kills");
        let addr = health_server(flag.clone()).await;
        let dead = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let dead_addr = dead.local_addr().unwrap();
        drop(dead);
        let mut p = plan(addr, format!("touch {}", flag.display()));
        p.kill_cmd = format!("echo k >> {}", count.display());
        p.every = Some(Duration::from_millis(400));
        p.probe_url = format!("http://{dead_addr}/healthz");
        let start = Instant::now();
        let (tx, rx) = tokio::sync::watch::channel(false);
        let task = tokio::spawn(run(p.clone(), start, rx));
        tokio::time::sleep(Duration::from_millis(1000)).await;
        tx.send(true).unwrap();
        let all = task.await.unwrap();
        // Kills at 0.1, 0.5, 0.9 s; none after the stop at 1.0 s.
        assert_eq!(all.len(), 3, "{all:?}");
        let lines = std::fs::read_to_string(&count).unwrap().lines().count();
        assert_eq!(lines, 3);
        for (k, t) in all.iter().enumerate() {
            assert!(t.kill_at_s >= 0.1 + 0.4 * k as f64 - 1e-3, "{t:?}");
            assert!(t.restart_exit_code == Some(0) && t.ready_at_s.is_some());
            assert!(t.gateway_unreachable);
        }
        let rep = report(&p, all, &[], 2.0);
        assert_eq!((rep.kills, rep.every_s), (3, Some(0.4)));
        assert_eq!(rep.cycles.len(), 3);
        assert!(rep.outage_s >= 3.0 * 0.2);
    }

    #[test]
    fn restart_counters_parse_in_any_label_order() {
        let text = "# HELP tessera_request_restarts Requests ...\n\
# TYPE tessera_request_restarts counter\n\
tessera_request_restarts_total{node=\"gateway\",role=\"coordinator\",reason=\"restarted\"} 4\n\
tessera_request_restarts_total{reason=\"continued\",node=\"gateway\",role=\"coordinator\"} 17 1700000000\n\
tessera_request_restarts_total{node=\"gateway\",role=\"coordinator\",reason=\"moved\"} 2\n\
tessera_request_restarts_total{node=\"gateway\",role=\"coordinator\",reason=\"not_restarted\"} 1\n\
tessera_request_restarts_created{node=\"gateway\",role=\"coordinator\",reason=\"restarted\"} 1700000000.1\n\
tessera_requests_total{node=\"gateway\"} 99\n\
# EOF\n";
        let c = parse_restarts(text).unwrap();
        assert_eq!(
            c,
            RestartCounts {
                restarted: 4,
                continued: 17,
                moved: 2,
                not_restarted: 1
            }
        );
        let before = RestartCounts {
            restarted: 1,
            continued: 20,
            moved: 0,
            not_restarted: 0,
        };
        assert_eq!(
            c.minus(&before),
            RestartCounts {
                restarted: 3,
                continued: 0,
                moved: 2,
                not_restarted: 1
            }
        );
        assert_eq!(parse_restarts("tessera_requests_total 3\n"), None);
        // Exported at zero counts as read.
        assert_eq!(
            parse_restarts("tessera_request_restarts_total{reason=\"continued\"} 0\n"),
            Some(RestartCounts::default())
        );
    }

    /// Failures by kind, which ones the outages excuse, and the gap figures.
    #[test]
    fn node_loss_counts_failures_and_gaps() {
        let o = |i: usize, start_s: f64, e2e_s: f64, end: End, times: &[f64]| Outcome {
            end,
            e2e_s,
            event_times_s: times.to_vec(),
            ttft_s: times.first().copied(),
            ..Outcome::pending(i, 0, 0, true, start_s)
        };
        let ws = [
            Window {
                from: 10.0,
                to: 12.0,
                gateway_unreachable: false,
            },
            Window {
                from: 30.0,
                to: 32.0,
                gateway_unreachable: true,
            },
        ];
        let outs = vec![
            // Outside the outages: a clean stream (gap 0.1 s) and a non-streamed answer.
            o(0, 0.0, 1.0, End::Complete, &[0.2, 0.3, 0.4]),
            Outcome {
                stream: false,
                ..o(1, 1.0, 1.0, End::Complete, &[])
            },
            // Across the first outage: a continued stream (gap 0.9 s).
            o(2, 9.5, 2.0, End::Complete, &[0.1, 0.2, 1.1, 1.2]),
            // Failed with an error event during it: excused.
            Outcome {
                status: Some(200),
                error: Some("3040".into()),
                ..o(3, 9.8, 0.5, End::StreamError, &[0.1])
            },
            // Truncated while the gateway was up: not excused.
            o(4, 9.9, 0.5, End::Cut, &[0.1]),
            // Truncated while the gateway was down: excused.
            o(5, 29.9, 0.5, End::Cut, &[0.1]),
            // A timeout outside any outage: not excused.
            o(6, 50.0, 0.5, End::Transport, &[]),
            // A disconnect is no failure; an over-long 400 is left out.
            o(7, 51.0, 0.1, End::Disconnected, &[0.05]),
            Outcome {
                status: Some(400),
                ..o(8, 52.0, 0.1, End::HttpError, &[])
            },
        ];
        assert!(excused(&outs[3], &ws) && !excused(&outs[4], &ws) && excused(&outs[5], &ws));
        assert!(
            !excused(&outs[2], &ws),
            "a completed request needs no excuse"
        );
        let r = node_loss(&outs, |o| o.index == 8, &ws);
        assert_eq!(r.requests, 8);
        assert_eq!(r.failed, 4);
        assert!((r.failed_share - 0.5).abs() < 1e-12);
        assert_eq!(r.failed_with_error_event, 1);
        assert_eq!((r.truncated, r.transport), (2, 1));
        assert_eq!(r.failed_without_error_event, 3);
        assert_eq!(r.failed_during_faults, 3);
        assert_eq!((r.excused, r.unexcused), (2, 2));
        assert_eq!(r.completed_during_faults, 1);
        assert_eq!(r.max_gap_ms.count, 2);
        assert!((r.max_gap_during_faults_ms.p50 - 900.0).abs() < 1e-6);
        assert!((r.max_gap_outside_faults_ms.p99 - 100.0).abs() < 1e-6);
        assert!((r.max_gap_ms.p99 - 900.0).abs() < 1e-6);
        assert!((r.ttft_during_faults_ms.p50 - 100.0).abs() < 1e-6);
        assert_eq!(max_gap_s(&outs[1]), None);
    }
}
