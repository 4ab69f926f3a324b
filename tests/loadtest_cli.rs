//! `tessera loadtest` against a real `tessera serve` with the real model, at small
//! scale: three tenants created through the admin API, a few tens of requests
//! with streaming, over-long prompts and client disconnects mixed in. The report
//! must show zero foreign canaries, zero solo mismatches, every over-long prompt
//! rejected with a 4xx and the usage API matching what the clients counted.
//! The report's fairness section (per-tenant service, TTFT, Jain's index) must be
//! there, and a prefix-sharing run (`--shared-prefix-tokens`, OpenAI shape) must
//! show every tenant's repeated prefix served from the prefix cache
//! (`cached_tokens` > 0), with the same checks at zero and the ledger's cached
//! tokens matching the answers'.
//! A second test kills the server with SIGKILL during the run and restarts it
//! through the fault hooks.

use serde_json::Value;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;
use tokio::io::{AsyncBufReadExt, BufReader};

const BIN: &str = env!("CARGO_BIN_EXE_tessera");

/// Starts `tessera serve` on `listen` with `admin` as admin token; returns the
/// child and the base URL from its banner.
async fn serve(data: &Path, admin: &str, listen: &str) -> (tokio::process::Child, String) {
    serve_with(data, admin, listen, &[]).await
}

/// [`serve`] with extra `tessera serve` arguments.
async fn serve_with(
    data: &Path,
    admin: &str,
    listen: &str,
    extra: &[&str],
) -> (tokio::process::Child, String) {
    let mut child = tokio::process::Command::new(BIN)
        .args(["serve", "--listen", listen, "--data-dir"])
        .arg(data)
        .args(extra)
        .env_remove("TESSERA_STORE")
        .env("TESSERA_ADMIN_TOKEN", admin)
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let read = async {
        while let Some(l) = lines.next_line().await.unwrap() {
            if let Some(url) = l.strip_prefix("tessera: listening on ") {
                return url.trim().to_string();
            }
        }
        panic!("serve exited before listening");
    };
    let base = tokio::time::timeout(Duration::from_secs(120), read)
        .await
        .expect("serve banner");
    // Keep draining stdout so the server never writes into a closed pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, base)
}

/// Runs `tessera loadtest` with `args`; returns (exit success, report.json, stderr).
async fn loadtest(args: &[&str], admin: Option<&str>, out: &Path) -> (bool, Value, String) {
    let mut cmd = tokio::process::Command::new(BIN);
    cmd.arg("loadtest").args(args).arg("--out").arg(out);
    match admin {
        Some(a) => cmd.env("TESSERA_ADMIN_TOKEN", a),
        None => cmd.env_remove("TESSERA_ADMIN_TOKEN"),
    };
    let o = cmd.output().await.unwrap();
    let report = std::fs::read(out.join("report.json"))
        .map(|b| serde_json::from_slice(&b).unwrap())
        .unwrap_or(Value::Null);
    (
        o.status.success(),
        report,
        String::from_utf8_lossy(&o.stderr).into_owned() + &String::from_utf8_lossy(&o.stdout),
    )
}

/// The small mixed workload of the multi-target runs: 2 tenants x 3 prompts, 16
/// requests 4 at a time, half of them streamed.
fn small_workload(seed: &str) -> Vec<&str> {
    vec![
        "--tenants",
        "2",
        "--prompts-per-tenant",
        "3",
        "--requests",
        "16",
        "--concurrency",
        "4",
        "--seed",
        seed,
        "--prompt-len",
        "uniform:8:32",
        "--output-len",
        "uniform:8:16",
        "--stream-share",
        "0.5",
        "--quiet",
    ]
}

/// Asserts the run passed with zero leaks, solo mismatches and usage mismatches;
/// returns the report.
fn clean_report<'a>(ok: bool, r: &'a Value, log: &str) -> &'a Value {
    assert!(ok, "loadtest failed:\n{log}\n{r:#}");
    assert_eq!(r["passed"], true, "{:#}", r["failures"]);
    let c = &r["targets"][0]["checks"];
    assert_eq!(n(&c["leaks"]), 0, "{:#}", c["canary"]);
    assert_eq!(n(&c["mismatches"]), 0, "{:#}", c["solo_equality"]);
    assert_eq!(n(&c["usage_mismatches"]), 0, "{:#}", c["usage"]);
    r
}

/// `GET url` with a bearer token; the body.
async fn get_text(url: &str, token: &str) -> String {
    let r = reqwest::Client::new()
        .get(url)
        .bearer_auth(token)
        .send()
        .await
        .unwrap();
    r.text().await.unwrap()
}

fn n(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a count: {v}"))
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or_else(|| panic!("not a number: {v}"))
}

/// Two models of different shapes behind one `tessera serve` (issue 18): `--model`
/// given twice sends prompt `i` to model `i mod 2`, interleaved in one run. Every
/// answer equals its prompt's solo answer from the same model, no canary crosses
/// tenants, the usage API matches the clients' counts, and both models answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_interleaved_keep_solo_equality_per_model() {
    use tessera_model::gguf_write::{write_random_llama, RandomLlama};
    const DEFAULT: &str = "@cf/huggingfacetb/smollm2-135m-instruct";
    const TINY: &str = "@cf/tessera/random-llama-tiny";
    let dir = tempfile::tempdir().unwrap();
    let default_path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let tiny = dir.path().join("tiny.gguf");
    write_random_llama(&default_path, &tiny, &RandomLlama::SMALL).unwrap();
    let admin = "tadm_loadtest_ci_token_0123456789abcdef";
    let models = [
        format!("{DEFAULT}={}", default_path.display()),
        format!("{TINY}={}", tiny.display()),
    ];
    let extra = ["--model", &models[0], "--model", &models[1]];
    let (mut child, base) =
        serve_with(&dir.path().join("data"), admin, "127.0.0.1:0", &extra).await;
    let out = dir.path().join("report");
    let (ok, r, log) = loadtest(
        &["--url", base.as_str(), "--model", DEFAULT, "--model", TINY]
            .into_iter()
            .chain(small_workload("5"))
            .collect::<Vec<_>>(),
        Some(admin),
        &out,
    )
    .await;
    let t = &clean_report(ok, &r, &log)["targets"][0];
    let c = &t["checks"];
    let completed = n(&t["requests"]["completed"]);
    assert_eq!(n(&c["solo_equality"]["compared"]), completed);
    let per_model = t["completed_by_model"].as_object().unwrap();
    assert_eq!(per_model.len(), 2, "{per_model:?}");
    assert!(per_model.values().all(|v| n(v) >= 4), "{per_model:?}");
    assert_eq!(per_model.values().map(n).sum::<u64>(), completed);
    assert_eq!(t["model"], format!("{DEFAULT},{TINY}"));
    child.kill().await.ok();
}

/// The three model families behind one `tessera serve` (issue 34): SmolLM2
/// (llama), Gemma 3 and Qwen2.5-Coder, the last two from their Q4_K_M files, with
/// prompt `i` sent to model `i mod 3` as raw completions (Gemma 3 base has no chat
/// template). Zero foreign canaries, every answer equal to its prompt's solo answer
/// from the same model, usage as the clients counted, and every family answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_families_interleaved_keep_isolation_and_solo_equality() {
    const SMOL: &str = "@cf/huggingfacetb/smollm2-135m-instruct";
    const GEMMA: &str = "@cf/google/gemma-3-270m";
    const QWEN: &str = "@cf/qwen/qwen2.5-coder-0.5b-instruct";
    let dir = tempfile::tempdir().unwrap();
    let file = |f: &str| Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join(f);
    let models = [
        format!(
            "{SMOL}={}",
            file("SmolLM2-135M-Instruct.Q4_1.gguf").display()
        ),
        format!("{GEMMA}={}", file("gemma-3-270m-q4_k_m.gguf").display()),
        format!(
            "{QWEN}={}",
            file("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf").display()
        ),
    ];
    let admin = "tadm_loadtest_ci_token_0123456789abcdef";
    let extra = [
        "--model", &models[0], "--model", &models[1], "--model", &models[2],
    ];
    let (mut child, base) =
        serve_with(&dir.path().join("data"), admin, "127.0.0.1:0", &extra).await;
    let out = dir.path().join("report");
    let args: Vec<&str> = [
        "--url",
        base.as_str(),
        "--model",
        SMOL,
        "--model",
        GEMMA,
        "--model",
        QWEN,
        "--mode",
        "raw",
    ]
    .into_iter()
    .chain(small_workload("34"))
    .map(|a| match a {
        "16" => "18", // six requests per family
        a => a,
    })
    .collect();
    let (ok, r, log) = loadtest(&args, Some(admin), &out).await;
    let t = &clean_report(ok, &r, &log)["targets"][0];
    let c = &t["checks"];
    let completed = n(&t["requests"]["completed"]);
    assert_eq!(n(&c["solo_equality"]["compared"]), completed);
    assert!(
        n(&c["canary"]["responses_checked"]) >= completed,
        "{:#}",
        c["canary"]
    );
    let per_model = t["completed_by_model"].as_object().unwrap();
    assert_eq!(per_model.len(), 3, "{per_model:?}");
    assert!(per_model.values().all(|v| n(v) >= 4), "{per_model:?}");
    child.kill().await.ok();
}

/// A fleet (issue 15): two `tessera serve` gateways on one PostgreSQL store and one
/// Redis (`--limits`), and `tessera loadtest` with `--url` given twice sending
/// request `i` to gateway `i mod 2`. Tenants created through the first gateway
/// serve on both; zero leaks, zero solo mismatches, and the usage API (read from
/// the first gateway, the fleet's one ledger) equals what the clients counted on
/// both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_gateway_fleet_on_one_store_and_redis_passes_the_isolation_checks() {
    let (_pg, pg_url) = tessera_tenancy::testing::PgServer::from_env_or_start();
    let (_redis, redis_url) = tessera_tenancy::testing::RedisServer::from_env_or_start();
    let dir = tempfile::tempdir().unwrap();
    let admin = "tadm_loadtest_ci_token_0123456789abcdef";
    let extra = [
        "--store",
        pg_url.as_str(),
        "--limits",
        redis_url.as_str(),
        "--colocated",
    ];
    let (mut a, base_a) = serve_with(&dir.path().join("a"), admin, "127.0.0.1:0", &extra).await;
    let (mut b, base_b) = serve_with(&dir.path().join("b"), admin, "127.0.0.1:0", &extra).await;
    let out = dir.path().join("report");
    let (ok, r, log) = loadtest(
        &["--url", base_a.as_str(), "--url", base_b.as_str()]
            .into_iter()
            .chain(small_workload("11"))
            .collect::<Vec<_>>(),
        Some(admin),
        &out,
    )
    .await;
    let t = &clean_report(ok, &r, &log)["targets"][0];
    assert_eq!(n(&t["requests"]["completed"]), 16);
    assert_eq!(t["base_url"], format!("{base_a},{base_b}"));
    // Both gateways served: each wrote usage rows (the first counts its own in
    // /metrics; the ledger is shared).
    for base in [&base_a, &base_b] {
        let m = get_text(&format!("{base}/metrics"), admin).await;
        let served: f64 = m
            .lines()
            .filter(|l| l.starts_with("tessera_requests_total{") && l.contains("status=\"200\""))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        assert!(served >= 8.0, "{base} served {served} requests");
    }
    a.kill().await.ok();
    b.kill().await.ok();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn harness_against_real_server_finds_no_leaks_mismatches_or_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    let admin = "tadm_loadtest_ci_token_0123456789abcdef";
    let (mut child, base) = serve(&dir.path().join("data"), admin, "127.0.0.1:0").await;
    let out = dir.path().join("report");
    let (ok, r, log) = loadtest(
        &[
            "--url",
            &base,
            "--tenants",
            "3",
            "--prompts-per-tenant",
            "3",
            "--requests",
            "30",
            "--concurrency",
            "4",
            "--seed",
            "11",
            "--prompt-len",
            "uniform:8:40",
            "--output-len",
            "uniform:16:24",
            "--stream-share",
            "0.7",
            "--overlong-share",
            "0.1",
            "--disconnect-share",
            "0.15",
            "--quiet",
        ],
        Some(admin),
        &out,
    )
    .await;
    assert!(ok, "loadtest failed:\n{log}\n{r:#}");
    assert_eq!(r["schema_version"], 1);
    assert_eq!(r["passed"], true, "{:#}", r["failures"]);
    let t = &r["targets"][0];
    let c = &t["checks"];
    // Canaries: searched in every answer, none foreign; the model does repeat
    // its own canaries, so a leaked context would show.
    assert_eq!(n(&c["leaks"]), 0, "{:#}", c["canary"]);
    assert!(
        n(&c["canary"]["responses_checked"]) >= 30,
        "{:#}",
        c["canary"]
    );
    assert!(
        n(&c["canary"]["own_canary_echoed"]) >= 10,
        "{:#}",
        c["canary"]
    );
    // Solo-equality over every completed answer.
    assert_eq!(n(&c["mismatches"]), 0, "{:#}", c["solo_equality"]);
    let completed = n(&t["requests"]["completed"]);
    assert_eq!(n(&c["solo_equality"]["compared"]), completed);
    assert!(completed >= 15, "{:#}", t["requests"]);
    assert_eq!(n(&t["solo"]["prompts"]), 9);
    assert_eq!(n(&t["solo"]["failed"]), 0);
    // Over-long prompts: sent, every one a 4xx (400, code 3006).
    let ol = &c["over_long"];
    assert!(n(&ol["sent"]) >= 1, "{ol:#}");
    assert_eq!(n(&ol["rejected_4xx"]), n(&ol["sent"]), "{ol:#}");
    assert_eq!(n(&ol["statuses"]["400"]), n(&ol["sent"]), "{ol:#}");
    // Disconnects happened and nothing else failed.
    assert!(
        n(&t["requests"]["disconnected"]) >= 1,
        "{:#}",
        t["requests"]
    );
    assert_eq!(
        completed + n(&t["requests"]["disconnected"]) + n(&ol["sent"]),
        30,
        "{:#}",
        t["requests"]
    );
    // Usage: per tenant, the ledger's change equals what the clients counted;
    // 9 solo + 30 load requests in all.
    let u = &c["usage"];
    assert_eq!(n(&c["usage_mismatches"]), 0, "{u:#}");
    let tenants = u["tenants"].as_array().unwrap();
    assert_eq!(tenants.len(), 3);
    let mut requests = 0;
    for tu in tenants {
        assert_eq!(tu["matched"], true, "{tu:#}");
        requests += n(&tu["observed"]["requests"]);
        // Prompt tokens are known exactly even for disconnected requests.
        assert_eq!(
            tu["expected"]["input_tokens"]["lo"],
            tu["expected"]["input_tokens"]["hi"]
        );
        assert_eq!(
            tu["observed"]["input_tokens"],
            tu["expected"]["input_tokens"]["lo"]
        );
        assert!(n(&tu["observed"]["output_tokens"]) > 0);
        // The ledger's cached prompt tokens are checked against the answers' too.
        assert!(tu["expected"]["cached_tokens"]["hi"].is_u64(), "{tu:#}");
        assert!(tu["observed"]["cached_tokens"].is_u64(), "{tu:#}");
    }
    assert_eq!(requests, 39);
    // Fairness: one row per tenant with its service, demand and TTFT; every
    // request was served in full (completed, or dropped by its client), so each
    // tenant got all it asked for and Jain's index over served/asked is 1.
    let fair = &t["fairness"];
    let rows = fair["tenants"].as_array().expect("fairness.tenants");
    assert_eq!(rows.len(), 3, "{fair:#}");
    assert!(f(&fair["jain_index"]) > 0.999, "{fair:#}");
    let eq = f(&fair["jain_index_equal_split"]);
    assert!(eq > 1.0 / 3.0 && eq <= 1.0 + 1e-9, "{fair:#}");
    let (mut sent, mut out_tokens, mut ttfts, mut share) = (0, 0, 0, 0.0);
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(n(&row["tenant"]), i as u64);
        assert_eq!(row["label"], format!("t{i}"));
        assert_eq!(
            n(&row["output_tokens"]),
            n(&row["demand_output_tokens"]),
            "{row:#}"
        );
        assert!(n(&row["input_tokens"]) > 0, "{row:#}");
        assert!(row["ttft_ms"]["p50"].is_number() && row["ttft_ms"]["p99"].is_number());
        sent += n(&row["requests_sent"]);
        out_tokens += n(&row["output_tokens"]);
        ttfts += n(&row["ttft_ms"]["count"]);
        share += f(&row["service_share"]);
    }
    assert_eq!(sent, 30);
    assert_eq!(ttfts, n(&t["latency"]["ttft_ms"]["count"]));
    assert!((share - 1.0).abs() < 1e-9, "{fair:#}");
    assert!(out_tokens >= n(&t["throughput"]["output_tokens"]));
    // The prefix-cache section is there without a shared prefix too.
    let pc = &t["prefix_cache"];
    assert_eq!(pc["shared_prefix_tokens"], Value::Null);
    assert_eq!(pc["tenants"].as_array().unwrap().len(), 3);
    assert!(n(&pc["prompt_tokens"]) > 0, "{pc:#}");
    // Metrics and report files.
    assert!(n(&t["latency"]["ttft_ms"]["count"]) >= 5);
    assert!(t["throughput"]["output_tokens_per_s"].as_f64().unwrap() > 0.0);
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    // Four plots, two fairness bar charts, one prefix-cache bar chart.
    assert!(html.contains("PASSED") && html.matches("<svg").count() == 7);
    assert!(html.contains("<h3>Fairness</h3>") && html.contains("Jain's index"));
    assert!(html.contains("<h3>Prefix cache</h3>"));
    let lines = std::fs::read_to_string(out.join("requests.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 39);

    // A key that the server does not know: the harness stops with the server's
    // answer instead of reporting a pass.
    let keys = dir.path().join("keys.json");
    let acct = r["targets"][0]["base_url"]
        .as_str()
        .map(|_| "0".repeat(32))
        .unwrap();
    std::fs::write(
        &keys,
        format!(r#"[{{"account_id":"{acct}","key":"tsk_0000000000000000_00"}}]"#),
    )
    .unwrap();
    let (ok, _, log) = loadtest(
        &[
            "--url",
            &base,
            "--keys-file",
            keys.to_str().unwrap(),
            "--requests",
            "2",
            "--quiet",
        ],
        None,
        &dir.path().join("report2"),
    )
    .await;
    assert!(!ok);
    assert!(log.contains("401"), "{log}");

    // Prefix sharing: two tenants, every prompt of a tenant starting with the
    // same 160 words, then a short question; OpenAI shape, half streamed.
    let out = dir.path().join("report-prefix");
    let (ok, r, log) = loadtest(
        &[
            "--url",
            &base,
            "--api",
            "openai",
            "--tenants",
            "2",
            "--prompts-per-tenant",
            "2",
            "--requests",
            "12",
            "--concurrency",
            "3",
            "--seed",
            "7",
            "--shared-prefix-tokens",
            "160",
            "--prompt-len",
            "fixed:6",
            "--output-len",
            "fixed:12",
            "--stream-share",
            "0.5",
        ],
        Some(admin),
        &out,
    )
    .await;
    assert!(ok, "loadtest failed:\n{log}\n{r:#}");
    assert_eq!(r["passed"], true, "{:#}", r["failures"]);
    assert_eq!(r["workload"]["shared_prefix_tokens"], 160);
    let t = &r["targets"][0];
    let c = &t["checks"];
    assert_eq!(n(&c["leaks"]), 0, "{:#}", c["canary"]);
    // Answers that reused cached pages equal their solo answers.
    assert_eq!(n(&c["mismatches"]), 0, "{:#}", c["solo_equality"]);
    assert_eq!(
        n(&c["solo_equality"]["compared"]),
        n(&t["requests"]["completed"])
    );
    assert_eq!(n(&c["usage_mismatches"]), 0, "{:#}", c["usage"]);
    let pc = &t["prefix_cache"];
    assert_eq!(pc["shared_prefix_tokens"], 160);
    let rows = pc["tenants"].as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (i, row) in rows.iter().enumerate() {
        // Each tenant's repeated prefix (at least 160 tokens: ten 16-token
        // pages) came from the cache: its own solo requests put it there.
        assert!(n(&row["requests_with_hit"]) >= 1, "{pc:#}");
        assert!(
            n(&row["cached_tokens"]) >= 128 * n(&row["requests_with_hit"]),
            "{pc:#}"
        );
        assert!(
            n(&row["cached_tokens"]) < n(&row["prompt_tokens"]),
            "{pc:#}"
        );
        assert!(f(&row["hit_rate"]) > 0.5, "{pc:#}");
        // The ledger charged the same cached tokens (solo and load phases).
        let tu = &c["usage"]["tenants"][i];
        assert_eq!(tu["matched"], true, "{tu:#}");
        assert!(
            n(&tu["observed"]["cached_tokens"]) >= n(&row["cached_tokens"]),
            "{tu:#}"
        );
        // The fairness rows carry the same totals.
        assert_eq!(
            t["fairness"]["tenants"][i]["cached_tokens"],
            row["cached_tokens"]
        );
    }
    assert!(f(&pc["hit_rate"]) > 0.5, "{pc:#}");
    assert!(
        f(&t["fairness"]["jain_index"]) > 0.999,
        "{:#}",
        t["fairness"]
    );
    // Per request, from the client log: a hit never covers the whole prompt.
    let logged: Vec<Value> = std::fs::read_to_string(out.join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(logged.len(), 4 + 12);
    // The solo phase runs each tenant's two prompts in turn, each for the first
    // time: the first misses (nothing of the tenant is cached yet), the second, a
    // different question, hits on the shared prefix alone.
    for tenant in 0..2u64 {
        let solo: Vec<&Value> = logged
            .iter()
            .filter(|o| o["phase"] == "solo" && o["tenant"] == tenant)
            .collect();
        assert_eq!(solo.len(), 2);
        assert_eq!(n(&solo[0]["cached_tokens"]), 0, "{}", solo[0]);
        let (c, p) = (n(&solo[1]["cached_tokens"]), n(&solo[1]["prompt_tokens"]));
        assert!(c >= 160 && c < p, "{}", solo[1]);
    }
    for o in logged.iter().filter(|o| o["cached_tokens"].is_u64()) {
        assert!(n(&o["cached_tokens"]) < n(&o["prompt_tokens"]), "{o}");
    }
    let html = std::fs::read_to_string(out.join("report.html")).unwrap();
    assert!(html.contains("shared prefix of 160 words per tenant"));
    assert!(html.contains("<h3>Prefix cache</h3>") && html.contains("<h3>Fairness</h3>"));
    assert!(log.contains("prefix cache"), "{log}");
    child.kill().await.unwrap();
}

/// Picks a free loopback port (bound and released at once).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// Kills the restarted server (not a child of this process) when dropped.
struct PidFile(std::path::PathBuf);

impl Drop for PidFile {
    fn drop(&mut self) {
        if let Ok(pid) = std::fs::read_to_string(&self.0) {
            let _ = std::process::Command::new("kill")
                .args(["-9", pid.trim()])
                .status();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_killed_and_restarted_mid_run_keeps_the_checks_at_zero() {
    let dir = tempfile::tempdir().unwrap();
    let admin = "tadm_loadtest_fault_token_0123456789abcdef";
    let data = dir.path().join("data");
    let port = free_port();
    let listen = format!("127.0.0.1:{port}");
    let (child, base) = serve(&data, admin, &listen).await;
    let pid = child.id().unwrap();
    let pidfile = PidFile(dir.path().join("restarted.pid"));
    let kill = format!("kill -9 {pid}");
    let restart = format!(
        "TESSERA_ADMIN_TOKEN={admin} {BIN} serve --listen {listen} --data-dir {} >{} 2>&1 & echo $! > {}",
        data.display(),
        dir.path().join("restarted.log").display(),
        pidfile.0.display()
    );
    let out = dir.path().join("report");
    let (ok, r, log) = loadtest(
        &[
            "--url",
            &base,
            "--tenants",
            "2",
            "--prompts-per-tenant",
            "2",
            "--duration-secs",
            "8",
            "--concurrency",
            "3",
            "--seed",
            "5",
            "--prompt-len",
            "uniform:8:24",
            "--output-len",
            "uniform:8:24",
            "--overlong-share",
            "0.1",
            "--fault-kill-cmd",
            &kill,
            "--fault-restart-cmd",
            &restart,
            "--fault-at-secs",
            "2",
            "--fault-downtime-secs",
            "1",
            "--quiet",
        ],
        Some(admin),
        &out,
    )
    .await;
    assert!(ok, "loadtest failed:\n{log}\n{r:#}");
    let t = &r["targets"][0];
    let f = &t["fault"];
    assert_eq!(f["times"]["kill_exit_code"], 0, "{f:#}");
    assert_eq!(f["times"]["restart_exit_code"], 0, "{f:#}");
    let ready = f["times"]["ready_at_s"].as_f64().expect("server came back");
    assert!(ready > f["times"]["restart_at_s"].as_f64().unwrap());
    assert!(n(&f["requests_during_outage"]) >= 1, "{f:#}");
    assert_eq!(n(&f["errors_outside_outage"]), 0, "{f:#}");
    // Requests completed after the restart too.
    let after = std::fs::read_to_string(out.join("requests.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|o| o["phase"] == "load" && o["end"] == "complete")
        .filter(|o| o["start_s"].as_f64().unwrap() > ready)
        .count();
    assert!(after >= 1);
    let c = &t["checks"];
    assert_eq!(n(&c["leaks"]), 0);
    assert_eq!(n(&c["mismatches"]), 0, "{:#}", c["solo_equality"]);
    assert_eq!(n(&c["over_long_not_rejected"]), 0, "{:#}", c["over_long"]);
    assert_eq!(n(&c["usage_mismatches"]), 0, "{:#}", c["usage"]);
    assert_eq!(r["passed"], true, "{:#}", r["failures"]);
}
