//! The fault mix's node kill and restart, as operator-supplied shell commands
//! (so it works with any deployment: a process, a container, a Kubernetes pod).
//!
//! During the load phase: at `at` the kill command runs; `downtime` later the
//! restart command runs (it must return: start servers in the background); the
//! outage ends when `GET {base}/readyz` answers 200 (the gateway is up and reaches
//! its engines or nodes). Requests that overlap the
//! outage are counted apart in the report.

use crate::client::Outcome;
use serde::{Deserialize, Serialize};
use std::time::{Duration, Instant};

/// What to run and when.
#[derive(Clone, Debug)]
pub struct FaultPlan {
    /// Kills a node (`sh -c`).
    pub kill_cmd: String,
    /// Restarts it (`sh -c`); `None`: the deployment recovers by itself.
    pub restart_cmd: Option<String>,
    /// Delay from the phase start to the kill.
    pub at: Duration,
    /// Delay from the kill to the restart.
    pub downtime: Duration,
    /// Polled after the restart until it answers 200.
    pub health_url: String,
    /// Longest wait for health after the restart.
    pub health_timeout: Duration,
}

/// When things happened (seconds from the phase start) and how the commands
/// exited.
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
}

/// The fault part of a target's report.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct FaultReport {
    /// The kill command.
    pub kill_cmd: String,
    /// The restart command.
    pub restart_cmd: Option<String>,
    /// Timings and exit codes.
    pub times: FaultTimes,
    /// Outage length (s): kill to ready (or to the end of the phase).
    pub outage_s: f64,
    /// Requests whose lifetime overlapped the outage.
    pub requests_during_outage: usize,
    /// Of those, requests that failed (status >= 500, cut, or no answer).
    pub errors_during_outage: usize,
    /// Failed requests outside the outage (should be 0 on a healthy deployment).
    pub errors_outside_outage: usize,
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

/// Runs the plan; returns when the deployment is healthy again (or the health
/// timeout passed).
pub async fn run(plan: FaultPlan, phase_start: Instant) -> FaultTimes {
    let since = |t: Instant| t.duration_since(phase_start).as_secs_f64();
    tokio::time::sleep_until((phase_start + plan.at).into()).await;
    let mut times = FaultTimes {
        kill_at_s: since(Instant::now()),
        ..FaultTimes::default()
    };
    times.kill_exit_code = sh(&plan.kill_cmd).await;
    tokio::time::sleep(plan.downtime).await;
    if let Some(cmd) = &plan.restart_cmd {
        times.restart_at_s = Some(since(Instant::now()));
        times.restart_exit_code = sh(cmd).await;
    }
    let probe = reqwest::Client::builder()
        .timeout(Duration::from_secs(1))
        .build();
    let deadline = Instant::now() + plan.health_timeout;
    if let Ok(probe) = probe {
        while Instant::now() < deadline {
            let ok = probe
                .get(&plan.health_url)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success());
            if ok {
                times.ready_at_s = Some(since(Instant::now()));
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    times
}

/// Whether `o`'s lifetime overlaps `[from, to]` (seconds from the phase start).
pub fn overlaps(o: &Outcome, from: f64, to: f64) -> bool {
    o.start_s <= to && o.start_s + o.e2e_s >= from
}

/// Whether `o` failed in a way a dead node explains.
pub fn is_outage_error(o: &Outcome) -> bool {
    use crate::client::End;
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

/// The report for a phase with a fault; `phase_end_s` closes an outage that
/// never ended.
pub fn report(
    plan: &FaultPlan,
    times: FaultTimes,
    outs: &[Outcome],
    phase_end_s: f64,
) -> FaultReport {
    let from = times.kill_at_s;
    let to = times.ready_at_s.unwrap_or(phase_end_s.max(from));
    let during: Vec<&Outcome> = outs.iter().filter(|o| overlaps(o, from, to)).collect();
    FaultReport {
        kill_cmd: plan.kill_cmd.clone(),
        restart_cmd: plan.restart_cmd.clone(),
        outage_s: to - from,
        requests_during_outage: during.len(),
        errors_during_outage: during.iter().filter(|o| is_outage_error(o)).count(),
        errors_outside_outage: outs
            .iter()
            .filter(|o| !overlaps(o, from, to) && is_outage_error(o))
            .count(),
        times,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The hooks run at the planned times, their exit codes are kept, and the
    /// outage ends when the health URL answers (here: a tiny HTTP server on
    /// loopback that the restart command "starts" by creating a file).
    #[tokio::test]
    async fn hooks_run_in_order_and_health_ends_the_outage() {
        let dir = tempfile::tempdir().unwrap();
        let flag = dir.path().join("up");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let f2 = flag.clone();
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            loop {
                let (mut s, _) = listener.accept().await.unwrap();
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf).await;
                let resp: &[u8] = if f2.exists() {
                    b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\nconnection: close\r\n\r\nok\n"
                } else {
                    b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                };
                let _ = s.write_all(resp).await;
            }
        });
        let plan = FaultPlan {
            kill_cmd: "exit 3".into(),
            restart_cmd: Some(format!("touch {}", flag.display())),
            at: Duration::from_millis(100),
            downtime: Duration::from_millis(200),
            health_url: format!("http://{addr}/readyz"),
            health_timeout: Duration::from_secs(20),
        };
        let start = Instant::now();
        let t = run(plan.clone(), start).await;
        assert_eq!(t.kill_exit_code, Some(3));
        assert_eq!(t.restart_exit_code, Some(0));
        assert!(t.kill_at_s >= 0.1);
        let r = t.restart_at_s.unwrap();
        assert!(r >= t.kill_at_s + 0.2);
        assert!(t.ready_at_s.unwrap() >= r);
        let o = |start_s: f64, e2e_s: f64, end| Outcome {
            end,
            e2e_s,
            ..Outcome::pending(0, 0, 0, true, start_s)
        };
        use crate::client::End;
        let outs = vec![
            o(t.kill_at_s - 0.05, 0.1, End::Cut),
            o(t.ready_at_s.unwrap() + 5.0, 0.1, End::Transport),
            o(0.0, 0.01, End::Complete),
        ];
        let rep = report(&plan, t, &outs, 10.0);
        assert_eq!(rep.requests_during_outage, 1);
        assert_eq!(rep.errors_during_outage, 1);
        assert_eq!(rep.errors_outside_outage, 1);
    }
}
