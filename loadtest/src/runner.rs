//! The phases of a run, in order: tenants, context window, usage baseline, solo
//! phase, load phase (with the fault hooks), checks, usage read-back, then the
//! `--compare` target with the same workload, and the report.

use crate::args::{Api, LoadtestArgs};
use crate::checks::{self, UsageTotals};
use crate::client::{self, Call, End, Outcome, Target};
use crate::error::LoadtestError;
use crate::fairness;
use crate::fault::{self, FaultPlan, FaultTimes, Window};
use crate::metrics;
use crate::report::{
    Checks, Comparison, Report, RequestCounts, SoloReport, TargetReport, WorkloadInfo,
    SCHEMA_VERSION,
};
use crate::tenants::{self, Tenant};
use crate::workload::{describe, PlannedRequest, Workload};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::IsTerminal;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

/// Context window assumed when the server's catalog does not say.
const DEFAULT_CONTEXT: usize = 8192;

/// Requests that ended this long before a node kill may have lost their
/// ledger row (seconds).
const KILL_MARGIN_S: f64 = 1.0;

/// Longest wait for the ledger to show every row after the load phase.
const USAGE_SETTLE: Duration = Duration::from_secs(30);

fn progress(args: &LoadtestArgs, len: u64, prefix: &str) -> ProgressBar {
    let target = if args.quiet || !std::io::stderr().is_terminal() {
        ProgressDrawTarget::hidden()
    } else {
        ProgressDrawTarget::stderr()
    };
    let pb = ProgressBar::with_draw_target(Some(len), target);
    if let Ok(style) =
        ProgressStyle::with_template("{prefix:>8} [{elapsed_precise}] {wide_bar} {pos}/{len} {msg}")
    {
        pb.set_style(style);
    }
    pb.set_prefix(prefix.to_string());
    pb
}

/// Reads the context window of `model` from the server's `/v1/models` (Tessera
/// lists `context_window`); `None` if the server does not say.
async fn catalog_context(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    key: Option<&str>,
) -> Option<usize> {
    let mut req = http.get(format!("{base}/v1/models"));
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let v: Value = req.send().await.ok()?.json().await.ok()?;
    v.get("data")?
        .as_array()?
        .iter()
        .find(|m| {
            m.get("id")
                .and_then(Value::as_str)
                .is_some_and(|id| id.eq_ignore_ascii_case(model))
        })?
        .get("context_window")?
        .as_u64()
        .map(|c| c as usize)
}

/// A tenant's usage totals from `GET /client/v4/accounts/{id}/ai/usage`.
async fn read_usage(
    http: &reqwest::Client,
    base: &str,
    t: &Tenant,
) -> Result<UsageTotals, LoadtestError> {
    let (Some(acct), Some(key)) = (&t.account_id, &t.key) else {
        return Err(LoadtestError::NoAccount {
            tenant: t.label.clone(),
        });
    };
    let url = format!("{base}/client/v4/accounts/{acct}/ai/usage");
    let resp = http
        .get(&url)
        .bearer_auth(key)
        .send()
        .await
        .map_err(|source| LoadtestError::Request {
            method: "GET",
            url: url.clone(),
            source,
        })?;
    let status = resp.status();
    let v: Value = resp.json().await.unwrap_or(Value::Null);
    if !status.is_success() {
        return Err(LoadtestError::UsageRefused {
            url,
            status,
            body: v,
        });
    }
    let tot = &v["result"]["totals"];
    let n = |k: &str| tot.get(k).and_then(Value::as_u64).unwrap_or(0);
    Ok(UsageTotals {
        requests: n("requests"),
        input_tokens: n("input_tokens"),
        output_tokens: n("output_tokens"),
        errors: n("errors"),
        cached_tokens: n("cached_tokens"),
    })
}

async fn read_usage_all(
    http: &reqwest::Client,
    base: &str,
    tenants: &[Tenant],
) -> Result<Vec<UsageTotals>, LoadtestError> {
    let mut out = Vec::with_capacity(tenants.len());
    for t in tenants {
        out.push(read_usage(http, base, t).await?);
    }
    Ok(out)
}

/// The gateways' restart counters now ([`fault::read_restarts`]).
async fn restarts_now(
    http: &reqwest::Client,
    fleet: &[String],
    token: Option<&str>,
) -> Result<fault::RestartCounts, String> {
    match token {
        Some(t) => fault::read_restarts(http, fleet, t).await,
        None => Err("no --metrics-token or --admin-token to read /metrics with".into()),
    }
}

/// Sends one planned request.
async fn send_planned(
    http: &reqwest::Client,
    target: &Target,
    tenants: &[Tenant],
    w: &Workload,
    r: PlannedRequest,
    start: Instant,
) -> Outcome {
    let p = &w.prompts[r.prompt];
    target
        .send(
            http,
            Call {
                index: r.index,
                tenant_index: r.tenant,
                tenant: &tenants[r.tenant],
                prompt_id: r.prompt,
                prompt: &p.text,
                max_tokens: p.max_tokens,
                stream: r.stream,
                disconnect_after: r.disconnect_after,
            },
            start,
        )
        .await
}

/// The solo phase: every normal prompt alone, one at a time, not streamed.
/// Returns outcomes indexed by prompt id.
async fn run_solo(
    http: &reqwest::Client,
    target: &Target,
    tenants: &[Tenant],
    w: &Workload,
    args: &LoadtestArgs,
) -> (Vec<Option<Outcome>>, SoloReport) {
    let prompts: Vec<_> = w.normal_prompts().collect();
    let pb = progress(args, prompts.len() as u64, "solo");
    let start = Instant::now();
    let mut solo = vec![None; w.prompts.len()];
    let mut failed = 0;
    for p in prompts {
        let o = target
            .send(
                http,
                Call {
                    index: p.id,
                    tenant_index: p.tenant,
                    tenant: &tenants[p.tenant],
                    prompt_id: p.id,
                    prompt: &p.text,
                    max_tokens: p.max_tokens,
                    stream: false,
                    disconnect_after: None,
                },
                start,
            )
            .await;
        if o.end != End::Complete {
            failed += 1;
        }
        solo[p.id] = Some(o);
        pb.inc(1);
    }
    pb.finish_and_clear();
    let report = SoloReport {
        prompts: solo.iter().flatten().count(),
        failed,
        duration_s: start.elapsed().as_secs_f64(),
    };
    (solo, report)
}

/// Everything the load phase needs, shared by its tasks.
struct Phase {
    http: reqwest::Client,
    target: Target,
    tenants: Vec<Tenant>,
    w: Arc<Workload>,
    max_requests: Option<usize>,
    deadline: Option<Duration>,
}

/// The load phase. Returns the outcomes (by request index) and the times of
/// every kill (`None`: no fault plan).
async fn run_load(
    phase: Arc<Phase>,
    args: &LoadtestArgs,
    fault: Option<FaultPlan>,
) -> (Vec<Outcome>, Option<Vec<FaultTimes>>) {
    let by_time = phase.deadline.is_some();
    let len = match (phase.max_requests, phase.deadline) {
        (Some(n), _) => n as u64,
        (None, Some(d)) => d.as_secs().max(1),
        (None, None) => 0,
    };
    let pb = progress(args, len, &phase.target.label);
    let start = Instant::now();
    // Repeated faults stop when the requests are done (a cycle under way still
    // restarts its node); the first kill always runs.
    let (stop_faults, stop_rx) = tokio::sync::watch::channel(false);
    let fault_task = fault.map(|plan| tokio::spawn(fault::run(plan, start, stop_rx)));
    let ticker = by_time.then(|| {
        let pb = pb.clone();
        tokio::spawn(async move {
            loop {
                pb.set_position(start.elapsed().as_secs().min(len));
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    });
    let results: Arc<Mutex<Vec<Outcome>>> = Arc::default();
    let gen = Arc::new(Mutex::new(phase.w.requests()));
    let record = {
        let results = results.clone();
        let pb = pb.clone();
        move |o: Outcome| {
            let mut r = results.lock().unwrap_or_else(|e| e.into_inner());
            r.push(o);
            let errors = r
                .iter()
                .filter(|o| metrics::error_label(o).is_some())
                .count();
            if !by_time {
                pb.inc(1);
            }
            pb.set_message(format!("done {} errors {errors}", r.len()));
        }
    };
    let mut set = tokio::task::JoinSet::new();
    if args.rate.is_some() {
        // Open loop: each request at its arrival time, however many are running.
        loop {
            let next = {
                let mut g = gen.lock().unwrap_or_else(|e| e.into_inner());
                if phase.max_requests.is_some_and(|n| g.issued() >= n) {
                    None
                } else {
                    g.next()
                }
            };
            let Some(r) = next else { break };
            let at = r.at.unwrap_or_default();
            if phase.deadline.is_some_and(|d| at >= d) {
                break;
            }
            tokio::time::sleep_until((start + at).into()).await;
            let (phase, record) = (phase.clone(), record.clone());
            set.spawn(async move {
                let o = send_planned(
                    &phase.http,
                    &phase.target,
                    &phase.tenants,
                    &phase.w,
                    r,
                    start,
                )
                .await;
                record(o);
            });
        }
    } else {
        // Closed loop: each client sends its next request when the last one ends.
        for _ in 0..args.concurrency {
            let (phase, record, gen) = (phase.clone(), record.clone(), gen.clone());
            set.spawn(async move {
                loop {
                    let next = {
                        let mut g = gen.lock().unwrap_or_else(|e| e.into_inner());
                        let over = phase.max_requests.is_some_and(|n| g.issued() >= n)
                            || phase.deadline.is_some_and(|d| start.elapsed() >= d);
                        if over {
                            None
                        } else {
                            g.next()
                        }
                    };
                    let Some(r) = next else { break };
                    let o = send_planned(
                        &phase.http,
                        &phase.target,
                        &phase.tenants,
                        &phase.w,
                        r,
                        start,
                    )
                    .await;
                    // A client backs off briefly when it cannot connect or the server
                    // says it cannot serve now (so an outage does not burn the run).
                    let back_off = crate::fault::is_outage_error(&o);
                    record(o);
                    if back_off {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            });
        }
    }
    while set.join_next().await.is_some() {}
    let _ = stop_faults.send(true);
    if let Some(t) = ticker {
        t.abort();
    }
    pb.finish_and_clear();
    let times = match fault_task {
        Some(t) => t.await.ok(),
        None => None,
    };
    let mut outs = std::mem::take(&mut *results.lock().unwrap_or_else(|e| e.into_inner()));
    outs.sort_by_key(|o| o.index);
    (outs, times)
}

/// Target report without checks. `solo` (by prompt id; empty: none) sizes each
/// request's demand for the fairness report; `labels` names the tenants.
fn measure(
    target: &Target,
    w: &Workload,
    outs: &[Outcome],
    solo: &[Option<Outcome>],
    labels: &[String],
    shared_prefix_tokens: Option<usize>,
) -> TargetReport {
    let tp = metrics::throughput(outs);
    let end = outs
        .iter()
        .map(|o| o.start_s + o.e2e_s)
        .fold(0.0f64, f64::max);
    let bucket = metrics::bucket_width(end);
    TargetReport {
        label: target.label.clone(),
        base_url: target.fleet.join(","),
        api: match target.api {
            Api::WorkersAi => "workers_ai",
            Api::Openai => "openai",
        }
        .into(),
        model: target.models.join(","),
        completed_by_model: outs.iter().filter(|o| o.end == End::Complete).fold(
            BTreeMap::new(),
            |mut m, o| {
                *m.entry(target.model_for(o.prompt).to_string()).or_insert(0) += 1;
                m
            },
        ),
        solo: None,
        requests: RequestCounts::of(outs, |o| w.prompts[o.prompt].over_long),
        latency: metrics::latency(outs),
        throughput: tp,
        errors_by_code: metrics::errors_by_code(outs),
        timeline_bucket_s: bucket,
        timeline: metrics::timeline(outs, end, bucket),
        checks: Checks::default(),
        fault: None,
        node_loss: fault::node_loss(outs, |o| w.prompts[o.prompt].over_long, &[]),
        fairness: fairness::fairness(w, solo, outs, labels),
        prefix_cache: fairness::prefix_cache(w.tenants(), outs, labels, shared_prefix_tokens),
    }
}

/// Runs the load test the arguments describe and writes the report into
/// `args.out`. Returns the report (also when checks failed: see
/// [`Report::passed`]).
///
/// # Errors
/// Invalid arguments, tenant creation or the usage API failing, or the report
/// folder not writable.
pub async fn run(args: LoadtestArgs) -> Result<Report, LoadtestError> {
    args.validate().map_err(LoadtestError::InvalidArgs)?;
    let created_unix_s = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let base = args.primary_url();
    let fleet: Vec<String> = args
        .url
        .iter()
        .map(|u| u.trim_end_matches('/').to_string())
        .collect();
    let timeout = Duration::from_secs_f64(args.request_timeout_secs);
    let http = client::http_client(timeout).map_err(LoadtestError::HttpClient)?;
    let run_id = format!("{:08x}", rand::random::<u32>());
    let tenants = tenants::resolve(&http, &args, &run_id).await?;
    if args.api == Api::WorkersAi && tenants.iter().any(|t| t.account_id.is_none()) {
        return Err(LoadtestError::NoAccountIds);
    }
    // Normal prompts fit the smallest window of the models (a prompt may go to any
    // of them); over-long ones exceed the largest.
    let (context, largest) = match args.context_window {
        Some(c) => (c, c),
        None => {
            let mut windows = Vec::new();
            for m in &args.model {
                if let Some(c) = catalog_context(&http, &base, m, tenants[0].key.as_deref()).await {
                    windows.push(c);
                }
            }
            (
                windows.iter().copied().min().unwrap_or(DEFAULT_CONTEXT),
                windows.iter().copied().max().unwrap_or(DEFAULT_CONTEXT),
            )
        }
    };
    let w = Arc::new(Workload::for_windows(
        &args,
        tenants.len(),
        context,
        largest,
    )?);
    let target = Target {
        label: args.label.clone(),
        base: base.clone(),
        fleet,
        api: args.api,
        mode: args.mode,
        models: args.model.clone(),
    };
    let checks_on = !args.no_checks;
    let usage_on = checks_on && tenants.iter().all(Tenant::is_real);
    let labels: Vec<String> = tenants.iter().map(|t| t.label.clone()).collect();
    let mut failures = Vec::new();

    let before = if usage_on {
        Some(read_usage_all(&http, &base, &tenants).await?)
    } else {
        None
    };
    let (solo, solo_report) = if checks_on {
        let (s, r) = run_solo(&http, &target, &tenants, &w, &args).await;
        (s, Some(r))
    } else {
        (vec![None; w.prompts.len()], None)
    };
    if let Some(r) = &solo_report {
        if r.failed > 0 {
            let first = solo.iter().flatten().find(|o| o.end != End::Complete);
            failures.push(format!(
                "{} of {} solo requests failed (first: {:?} {:?})",
                r.failed,
                r.prompts,
                first.map(|o| o.end),
                first.and_then(|o| o.error.clone())
            ));
        }
    }

    let run_length = (
        args.requests
            .or(args.duration_secs.is_none().then_some(100)),
        args.duration_secs.map(Duration::from_secs_f64),
    );
    let fault_plan = args.fault_kill_cmd.as_ref().map(|k| FaultPlan {
        kill_cmd: k.clone(),
        restart_cmd: args.fault_restart_cmd.clone(),
        at: Duration::from_secs_f64(args.fault_at_secs.max(0.0)),
        downtime: Duration::from_secs_f64(args.fault_downtime_secs.max(0.0)),
        every: args.fault_every_secs.map(Duration::from_secs_f64),
        health_url: format!("{base}/readyz"),
        probe_url: format!("{base}/healthz"),
        health_timeout: Duration::from_secs(300),
    });
    // The gateways' restart decisions (issue 36), before and after the phase.
    let metrics_token = args
        .metrics_token
        .as_deref()
        .or(args.admin_token.as_deref());
    let restarts_before = restarts_now(&http, &target.fleet, metrics_token).await;
    let phase = Arc::new(Phase {
        http: http.clone(),
        target: target.clone(),
        tenants: tenants.clone(),
        w: w.clone(),
        max_requests: run_length.0,
        deadline: run_length.1,
    });
    let (outs, fault_times) = run_load(phase, &args, fault_plan.clone()).await;
    let restarts_after = restarts_now(&http, &target.fleet, metrics_token).await;
    let mut main = measure(
        &target,
        &w,
        &outs,
        &solo,
        &labels,
        args.shared_prefix_tokens,
    );
    main.solo = solo_report;

    // Outage windows, for excusing failures a dead node explains.
    let phase_end = outs
        .iter()
        .map(|o| o.start_s + o.e2e_s)
        .fold(0.0f64, f64::max);
    let windows: Vec<Window> = fault_times
        .as_deref()
        .map(|t| fault::windows(t, phase_end))
        .unwrap_or_default();
    let in_outage = |o: &Outcome| fault::in_any(o, &windows);
    if let (Some(plan), Some(times)) = (&fault_plan, fault_times.clone()) {
        main.fault = Some(fault::report(plan, times, &outs, phase_end));
    }
    main.node_loss = fault::node_loss(&outs, |o| w.prompts[o.prompt].over_long, &windows);
    match (&restarts_before, &restarts_after) {
        (Ok(b), Ok(a)) => main.node_loss.restarts = Some(a.minus(b)),
        (Err(e), _) | (_, Err(e)) => main.node_loss.restarts_unavailable = Some(e.clone()),
    }

    if checks_on {
        let solo_outs: Vec<Outcome> = solo.iter().flatten().cloned().collect();
        let canary = checks::canary_check(&w, &[("solo", &solo_outs), ("load", &outs)]);
        let eq = checks::solo_equality(&solo, &outs);
        let ol = checks::overlong_check(&w, &outs, in_outage);
        main.checks.leaks = canary.leaks;
        main.checks.mismatches = eq.mismatches;
        main.checks.over_long_not_rejected = ol.not_rejected.len();
        if canary.leaks > 0 {
            failures.push(format!(
                "{} responses carry another tenant's canary",
                canary.leaks
            ));
        }
        if eq.mismatches > 0 {
            failures.push(format!(
                "{} responses differ from their solo answer",
                eq.mismatches
            ));
        }
        if !ol.not_rejected.is_empty() {
            failures.push(format!(
                "{} over-long requests were not answered with a 4xx",
                ol.not_rejected.len()
            ));
        }
        if eq.compared == 0 && main.requests.completed > 0 {
            failures.push("no completed response could be compared with a solo answer".into());
        }
        main.checks.canary = Some(canary);
        main.checks.solo_equality = Some(eq);
        main.checks.over_long = Some(ol);
    }
    // Failed normal requests a planned outage does not explain: outside one, or
    // during one without an error event while the gateway was up (truncated).
    let unexplained = |o: &&Outcome| {
        !w.prompts[o.prompt].over_long
            && metrics::error_label(o).is_some()
            && !fault::excused(o, &windows)
    };
    let unexpected = outs
        .iter()
        .filter(unexplained)
        .filter(|o| !in_outage(o))
        .count();
    if unexpected > 0 {
        failures.push(format!(
            "{unexpected} requests failed outside a planned fault: {:?}",
            main.errors_by_code
        ));
    }
    let silent = outs
        .iter()
        .filter(unexplained)
        .filter(|o| in_outage(o))
        .count();
    if silent > 0 {
        failures.push(format!(
            "{silent} requests during a fault ended without [DONE] or an error event while the gateway was up ({} truncated streams in all)",
            main.node_loss.truncated
        ));
    }
    if main.requests.completed == 0 {
        failures.push("no request completed".into());
    }

    if let Some(before) = &before {
        let solo_outs: Vec<Outcome> = solo.iter().flatten().cloned().collect();
        // A node killed between answering and writing a row loses that row: the
        // clients cannot tell, so requests that ended within a second before the
        // kill (or during the outage) have no lower bound. A complete answer has
        // its row unless the fault took the gateway (which writes it) down: the
        // gateway continues or restarts the requests a node's loss hits, and
        // charges each once.
        let uncertain = |o: &Outcome| {
            windows.iter().any(|win| {
                let near = fault::overlaps(o, win.from - KILL_MARGIN_S, win.to);
                near && (o.end != End::Complete || win.gateway_unreachable)
            })
        };
        let expected = checks::expected_usage(&w, &solo, &[&solo_outs, &outs], uncertain);
        let settle = Instant::now() + USAGE_SETTLE;
        let observed = loop {
            match read_usage_all(&http, &base, &tenants).await {
                Ok(after) => {
                    let delta: Vec<UsageTotals> =
                        after.iter().zip(before).map(|(a, b)| a.minus(b)).collect();
                    let ok = expected.iter().zip(&delta).all(|(e, d)| e.admits(d));
                    if ok || Instant::now() >= settle {
                        break Some(delta);
                    }
                }
                Err(e) if Instant::now() >= settle => {
                    failures.push(format!("cannot read usage: {}", e.with_sources()));
                    break None;
                }
                Err(_) => {}
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        if let Some(observed) = observed {
            let u = checks::usage_check(&labels, &expected, &observed);
            main.checks.usage_mismatches = u.mismatches;
            if u.mismatches > 0 {
                failures.push(format!(
                    "usage of {} tenants does not match what the clients counted",
                    u.mismatches
                ));
            }
            main.checks.usage = Some(u);
        }
    }

    let mut targets = vec![main];
    let mut phases: Vec<(String, &'static str, Vec<Outcome>)> = vec![
        (
            target.label.clone(),
            "solo",
            solo.iter().flatten().cloned().collect(),
        ),
        (target.label.clone(), "load", outs),
    ];
    if let Some(url) = &args.compare {
        let ctarget = Target {
            label: args.compare_label.clone(),
            base: url.trim_end_matches('/').to_string(),
            fleet: vec![url.trim_end_matches('/').to_string()],
            api: Api::Openai,
            mode: args.mode,
            models: args
                .compare_model
                .clone()
                .map_or_else(|| args.model.clone(), |m| vec![m]),
        };
        let phase = Arc::new(Phase {
            http: http.clone(),
            target: ctarget.clone(),
            tenants: tenants::virtual_tenants(tenants.len(), args.compare_key.as_deref()),
            w: w.clone(),
            max_requests: run_length.0,
            deadline: run_length.1,
        });
        let (couts, _) = run_load(phase, &args, None).await;
        let mut b = measure(
            &ctarget,
            &w,
            &couts,
            &[],
            &labels,
            args.shared_prefix_tokens,
        );
        if checks_on {
            let canary = checks::canary_check(&w, &[("load", &couts)]);
            let ol = checks::overlong_check(&w, &couts, |_| false);
            b.checks.leaks = canary.leaks;
            b.checks.over_long_not_rejected = ol.not_rejected.len();
            b.checks.canary = Some(canary);
            b.checks.over_long = Some(ol);
        }
        targets.push(b);
        phases.push((ctarget.label.clone(), "load", couts));
    }
    let comparison = (targets.len() == 2).then(|| Comparison::of(&targets[0], &targets[1]));
    let report = Report {
        schema_version: SCHEMA_VERSION,
        created_unix_s,
        workload: WorkloadInfo {
            seed: args.seed,
            tenants: tenants.len(),
            prompts_per_tenant: args.prompts_per_tenant,
            shared_prefix_tokens: args.shared_prefix_tokens,
            arrival: if args.rate.is_some() {
                "open_loop"
            } else {
                "closed_loop"
            }
            .into(),
            concurrency: args.rate.is_none().then_some(args.concurrency),
            rate_per_s: args.rate,
            requests: run_length.0,
            duration_s: args.duration_secs,
            prompt_len: describe(&args.prompt_len),
            output_len: describe(&args.output_len),
            prompts_file: args.prompts_file.as_ref().map(|p| p.display().to_string()),
            mode: format!("{:?}", args.mode).to_lowercase(),
            stream_share: args.stream_share,
            overlong_share: args.overlong_share,
            disconnect_share: args.disconnect_share,
            context_window: context,
        },
        targets,
        comparison,
        passed: failures.is_empty(),
        failures,
    };
    let phase_refs: Vec<(&str, &str, &[Outcome])> = phases
        .iter()
        .map(|(t, p, o)| (t.as_str(), *p, o.as_slice()))
        .collect();
    let load: Vec<&[Outcome]> = phases
        .iter()
        .filter(|(_, p, _)| *p == "load")
        .map(|(_, _, o)| o.as_slice())
        .collect();
    crate::report::write(&args.out, &report, &phase_refs, &load)?;
    Ok(report)
}
