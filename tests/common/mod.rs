//! Helpers shared by the multi-process tests (`pd_nodes.rs`, `node_links.rs`, ...):
//! free loopback ports, deployment files with their node-link certificates, `tessera
//! node` and `tessera serve` processes, HTTP and SSE clients, and request bodies; a raw
//! node-link client in [`links`], `/metrics` scraping in [`metrics`], a prefill node
//! and two decode nodes behind a gateway in [`two_decodes`].
//!
//! Every wait is bounded by a deadline; nothing asserts how fast anything runs.

#![allow(dead_code, unreachable_pub)]

pub mod links;
pub mod metrics;
pub mod two_decodes;

use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub const BIN: &str = env!("CARGO_BIN_EXE_tessera");
pub const MODEL_ID: &str = "@cf/huggingfacetb/smollm2-135m-instruct";
/// The default model's context window; both pools hold exactly one (I2).
pub const CONTEXT: usize = 8192;
/// Deadline for a process to print its ready line.
pub const START: Duration = Duration::from_secs(60);
/// Deadline for a request that must finish (generous: 2 cores, parallel tests).
pub const REQUEST: Duration = Duration::from_secs(90);

pub fn model_path() -> PathBuf {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
    assert!(
        p.exists(),
        "{} is missing: run `tessera model fetch`",
        p.display()
    );
    p
}

/// The test Python (`scripts/python-env`: a virtual environment with the test
/// requirements, `gguf` among them).
pub fn test_python() -> String {
    let root = env!("CARGO_MANIFEST_DIR");
    let py = std::process::Command::new(format!("{root}/scripts/python-env"))
        .output()
        .unwrap();
    assert!(py.status.success(), "scripts/python-env failed");
    String::from_utf8(py.stdout).unwrap().trim().to_string()
}

/// A loopback port nobody listens on right now, never handed out before by this
/// process.
///
/// Drawn from 20000-31999, below Linux's ephemeral range (32768-60999): a port the
/// kernel picks for `bind(0)` can come back on the next `bind(0)` once released (CI
/// once got one port for two nodes of one deployment), and an outgoing connection of
/// another test can take it before the server binds. Each process starts at an offset
/// from its id so that parallel test processes walk apart.
pub fn free_port() -> u16 {
    use std::sync::atomic::AtomicU32;
    const FIRST: u32 = 20_000;
    const SPAN: u32 = 12_000;
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id().wrapping_mul(7_919) % SPAN;
    for _ in 0..SPAN {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let port = (FIRST + (start + n) % SPAN) as u16;
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
    panic!("no free loopback port in {FIRST}..{}", FIRST + SPAN);
}

/// Node-link timings for tests that need a stalled node noticed quickly.
pub const FAST_LIVENESS: &str = "heartbeat_ms = 250\ndead_after_ms = 1500\n";

/// A deployment file in `dir` (`tessera.toml`): one prefill node, the `decode`
/// nodes, pools of `pools` tokens, and mutual TLS node links whose certificates are
/// issued into `dir/certs` by `tessera ops certs` (default timings).
pub fn write_config(
    dir: &Path,
    gateway: u16,
    prefill: u16,
    decode: &[u16],
    pools: (usize, usize),
) -> PathBuf {
    write_config_with(dir, gateway, prefill, decode, pools, Some(""))
}

/// [`write_config`] with `[node_links]` lines `tls` (then certificates are issued), or
/// no `[node_links]` at all (`None`: plain links, `--insecure-node-links`).
pub fn write_config_with(
    dir: &Path,
    gateway: u16,
    prefill: u16,
    decode: &[u16],
    pools: (usize, usize),
    tls: Option<&str>,
) -> PathBuf {
    let decode: Vec<String> = decode
        .iter()
        .map(|d| format!("\"127.0.0.1:{d}\""))
        .collect();
    let certs = dir.join("certs");
    let links = match tls {
        Some(extra) => format!(
            "\n[node_links]\nca = \"{}\"\ncert_dir = \"{}\"\n{extra}",
            certs.join("ca.pem").display(),
            certs.display()
        ),
        None => String::new(),
    };
    let text = format!(
        r#"[gateway]
listen = "127.0.0.1:{gateway}"

[[models]]
id = "{MODEL_ID}"
path = "{model}"

[[pools]]
name = "prefill"
role = "prefill"
page_size = 16
kv_pool_tokens = {p}
nodes = ["127.0.0.1:{prefill}"]

[[pools]]
name = "decode"
role = "decode"
page_size = 16
kv_pool_tokens = {d}
nodes = [{decode}]
{links}"#,
        decode = decode.join(", "),
        model = model_path().display(),
        p = pools.0,
        d = pools.1,
    );
    let path = dir.join("tessera.toml");
    std::fs::write(&path, text).unwrap();
    if tls.is_some() {
        init_ca(&certs);
        issue_certs(&path, &certs);
    }
    path
}

/// The CA directory of the node files in `certs`: its sibling `<certs>-ca` (the CA
/// key is never among the node files).
pub fn ca_dir_of(certs: &Path) -> PathBuf {
    let name = certs.file_name().unwrap().to_string_lossy();
    certs.with_file_name(format!("{name}-ca"))
}

/// `tessera ops certs init` into [`ca_dir_of`] `certs`, unless a CA is there.
pub fn init_ca(certs: &Path) {
    let ca = ca_dir_of(certs);
    if !ca.join("ca.pem").exists() {
        ops(&["certs", "init", "--ca-dir", ca.to_str().unwrap()]);
    }
}

/// `tessera ops certs issue`: certificates for every node the file at `config` lists,
/// signed by the CA of `certs` ([`ca_dir_of`]) and written into `certs`.
pub fn issue_certs(config: &Path, certs: &Path) {
    ops(&[
        "certs",
        "issue",
        "--config",
        config.to_str().unwrap(),
        "--ca-dir",
        ca_dir_of(certs).to_str().unwrap(),
        "--dir",
        certs.to_str().unwrap(),
    ]);
}

/// Runs `tessera ops ARGS`; panics unless it succeeds. Returns stdout.
pub fn ops(args: &[&str]) -> String {
    tessera(&[&["ops"], args].concat())
}

/// Runs `tessera ARGS` (without `TESSERA_STORE`: a `--data-dir` names the store);
/// panics unless it succeeds. Returns stdout.
pub fn tessera(args: &[&str]) -> String {
    let out = std::process::Command::new(BIN)
        .args(args)
        .env_remove("TESSERA_STORE")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tessera {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Spawns `tessera ARGS` (stdout piped, stderr to `log`) and reads stdout until a
/// line satisfies `done`. Returns the child and the lines read; stdout keeps being
/// drained afterwards. Panics (with the log) when the process exits first or the
/// deadline passes.
pub async fn spawn_until(
    args: &[&str],
    log: &Path,
    done: impl Fn(&str) -> bool,
) -> (Child, Vec<String>) {
    spawn_until_env(args, &[], log, done).await
}

/// [`spawn_until`] with extra environment variables.
pub async fn spawn_until_env(
    args: &[&str],
    env: &[(&str, &str)],
    log: &Path,
    done: impl Fn(&str) -> bool,
) -> (Child, Vec<String>) {
    let mut child = Command::new(BIN)
        .args(args)
        .env_remove("TESSERA_TEST_NODE_PANIC")
        .envs(env.iter().copied())
        .env_remove("TESSERA_STORE")
        .env_remove("TESSERA_ADMIN_TOKEN")
        .env_remove("TESSERA_MODEL")
        .env_remove("TESSERA_DATA_DIR")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).unwrap())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut out = Vec::new();
    let read = async {
        while let Some(l) = lines.next_line().await.unwrap() {
            let d = done(&l);
            out.push(l);
            if d {
                return true;
            }
        }
        false
    };
    let ok = matches!(tokio::time::timeout(START, read).await, Ok(true));
    if !ok {
        let _ = child.start_kill();
        panic!(
            "tessera {args:?} did not start; stdout: {out:?}; stderr: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
    }
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    (child, out)
}

/// A gateway's address and credentials, read from its first-start banner.
pub struct Gateway {
    pub _child: Child,
    pub base: String,
    pub account: String,
    pub key: String,
}

/// `POST url` with `body` as tenant `key`: (status, body).
async fn run_at(url: String, key: String, body: Value) -> (u16, Value) {
    let resp = reqwest::Client::new()
        .post(url)
        .bearer_auth(key)
        .json(&body)
        .timeout(REQUEST)
        .send()
        .await
        .unwrap_or_else(|e| panic!("request {body} failed: {e}"));
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

pub async fn start_gateway(args: &[&str], log: &Path) -> Gateway {
    let (child, banner) = spawn_until(args, log, |l| l.trim_start().starts_with("-d ")).await;
    let find = |prefix: &str| {
        banner
            .iter()
            .find_map(|l| {
                l.trim_start()
                    .strip_prefix(prefix)
                    .map(|s| s.trim().to_string())
            })
            .unwrap_or_else(|| panic!("no `{prefix}` in banner {banner:?}"))
    };
    Gateway {
        _child: child,
        base: find("tessera: listening on "),
        account: find("account id:"),
        key: find("API key:"),
    }
}

/// `tessera serve` on the test model, in process (a prefill and a decode engine of
/// one context window each), its store and admin token in `data`, stderr in `log`.
pub async fn start_serve(data: &Path, log: &Path) -> Gateway {
    start_gateway(
        &[
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--model",
            model_path().to_str().unwrap(),
            "--kv-pool-tokens",
            "8192",
            "--prefill-kv-pool-tokens",
            "8192",
            "--data-dir",
            data.to_str().unwrap(),
        ],
        log,
    )
    .await
}

impl Gateway {
    pub fn url(&self) -> String {
        format!(
            "{}/client/v4/accounts/{}/ai/run/{MODEL_ID}",
            self.base, self.account
        )
    }

    /// Non-streaming Workers AI request: (status, body).
    pub async fn run(&self, body: &Value) -> (u16, Value) {
        run_at(self.url(), self.key.clone(), body.clone()).await
    }

    /// [`Self::run`] on its own task, so that several requests are in flight at once
    /// or one waits while the test acts.
    pub fn spawn_run(&self, body: &Value) -> tokio::task::JoinHandle<(u16, Value)> {
        tokio::spawn(run_at(self.url(), self.key.clone(), body.clone()))
    }

    /// Starts a streaming request; panics unless the response head arrives in time.
    pub async fn stream(&self, body: &Value) -> Sse {
        let mut body = body.clone();
        body["stream"] = json!(true);
        let resp = tokio::time::timeout(
            REQUEST,
            reqwest::Client::new()
                .post(self.url())
                .bearer_auth(&self.key)
                .json(&body)
                .send(),
        )
        .await
        .expect("stream response head")
        .unwrap();
        Sse {
            status: resp.status().as_u16(),
            resp,
            buf: String::new(),
            events: Vec::new(),
            ended: false,
        }
    }

    /// Retries `body` while the gateway answers 503 (a node it lost is not
    /// reconnected yet) until it succeeds or the deadline passes.
    pub async fn run_when_up(&self, body: &Value) -> Value {
        let deadline = Instant::now() + REQUEST;
        loop {
            let (status, v) = self.run(body).await;
            if status == 200 {
                assert_eq!(v["success"], true, "{v}");
                return v;
            }
            assert!(
                status == 503 && Instant::now() < deadline,
                "request {body} never succeeded: {status} {v}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// A tenant sending `body` in a loop until stopped; every answer must be 200 and
/// equal `solo`. The task returns how many it got, or the first bad answer.
pub fn serve_tenant(
    gw: &Gateway,
    body: Value,
    solo: Value,
) -> (
    Arc<AtomicBool>,
    tokio::task::JoinHandle<Result<usize, String>>,
) {
    let (url, key) = (gw.url(), gw.key.clone());
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let task = tokio::spawn(async move {
        let client = reqwest::Client::new();
        let mut n = 0;
        while !s.load(Ordering::Acquire) {
            let r = client
                .post(&url)
                .bearer_auth(&key)
                .json(&body)
                .timeout(REQUEST)
                .send()
                .await
                .map_err(|e| format!("request {n}: {e}"))?;
            let status = r.status().as_u16();
            let v: Value = r.json().await.unwrap_or(Value::Null);
            if status != 200 || answer(&v["result"]) != answer(&solo) {
                return Err(format!("request {n}: {status} {v} (solo: {solo})"));
            }
            n += 1;
        }
        Ok(n)
    });
    (stop, task)
}

/// One SSE event of a Workers AI stream.
#[derive(Debug, Clone, PartialEq)]
pub enum Ev {
    Text(String),
    Usage(Value),
    Error(Value),
    Done,
}

pub struct Sse {
    pub status: u16,
    pub resp: reqwest::Response,
    pub buf: String,
    pub events: Vec<Ev>,
    /// The body ended (cleanly or not).
    pub ended: bool,
}

impl Sse {
    /// Reads until `stop` holds for the events so far, the body ends, or the
    /// deadline passes. A body that breaks off counts as ended.
    pub async fn read_until(&mut self, wait: Duration, stop: impl Fn(&[Ev]) -> bool) {
        let deadline = Instant::now() + wait;
        while !self.ended && !stop(&self.events) {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.resp.chunk()).await {
                Err(_) => return,
                Ok(Ok(Some(bytes))) => {
                    self.buf.push_str(&String::from_utf8_lossy(&bytes));
                    while let Some(i) = self.buf.find("\n\n") {
                        let frame: String = self.buf.drain(..i + 2).collect();
                        for line in frame.lines() {
                            if let Some(data) = line.strip_prefix("data: ") {
                                self.events.push(parse_event(data));
                            }
                        }
                    }
                }
                Ok(Ok(None)) | Ok(Err(_)) => self.ended = true,
            }
        }
    }

    /// Reads until an error event or `[DONE]` (or the body ends, or the deadline).
    pub async fn read_to_end(&mut self) {
        self.read_until(REQUEST, |e| {
            e.iter().any(|e| matches!(e, Ev::Error(_) | Ev::Done))
        })
        .await
    }

    /// Reads until `n` text events arrived (or the body ends, or the deadline).
    pub async fn read_texts(&mut self, n: usize) {
        self.read_until(REQUEST, |e| {
            e.iter().filter(|e| matches!(e, Ev::Text(_))).count() >= n
        })
        .await
    }

    /// Asserts the stream ended with an error event and no `[DONE]` (a cut stream,
    /// never a truncated success); `logs` goes into the failure message.
    pub fn assert_cut(&self, logs: &str) {
        assert!(
            self.has_error() && !self.has_done(),
            "{:?}\n{logs}",
            self.events.last()
        );
    }

    pub fn text(&self) -> String {
        self.events
            .iter()
            .filter_map(|e| match e {
                Ev::Text(t) => Some(t.as_str()),
                _ => None,
            })
            .collect()
    }

    pub fn tokens(&self) -> usize {
        self.events
            .iter()
            .filter(|e| matches!(e, Ev::Text(t) if !t.is_empty()))
            .count()
    }

    pub fn has_error(&self) -> bool {
        self.events.iter().any(|e| matches!(e, Ev::Error(_)))
    }

    pub fn has_done(&self) -> bool {
        self.events.contains(&Ev::Done)
    }
}

pub fn parse_event(data: &str) -> Ev {
    if data.trim() == "[DONE]" {
        return Ev::Done;
    }
    let v: Value =
        serde_json::from_str(data).unwrap_or_else(|e| panic!("bad SSE data {data:?}: {e}"));
    if !v["error"].is_null() || !v["errors"].is_null() {
        Ev::Error(v)
    } else if !v["usage"].is_null() {
        Ev::Usage(v["usage"].clone())
    } else {
        Ev::Text(v["response"].as_str().unwrap_or_default().to_string())
    }
}

/// A decode node, a prefill node and a gateway in front of them, each its own
/// process; all killed on drop.
pub struct Deployment {
    pub dir: tempfile::TempDir,
    pub config: PathBuf,
    pub prefill_addr: String,
    pub decode_addr: String,
    pub prefill: Option<Child>,
    pub decode: Option<Child>,
    pub gateway: Gateway,
}

impl Deployment {
    pub async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// [`Deployment::start`] with `extra` arguments for both nodes.
    pub async fn start_with(extra: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (p, d) = (free_port(), free_port());
        let config = write_config(dir.path(), free_port(), p, &[d], (CONTEXT, CONTEXT));
        let mut dep_nodes = (None, None);
        dep_nodes.1 = Some(start_node_with(dir.path(), &config, "decode", d, extra, &[]).await);
        dep_nodes.0 = Some(start_node_with(dir.path(), &config, "prefill", p, extra, &[]).await);
        let gateway = start_config_gateway(dir.path(), &config, "data", "gateway.log", &[]).await;
        Self {
            prefill_addr: format!("127.0.0.1:{p}"),
            decode_addr: format!("127.0.0.1:{d}"),
            dir,
            config,
            prefill: dep_nodes.0,
            decode: dep_nodes.1,
            gateway,
        }
    }

    /// Starts the deployment file `config` in `dir` (written for prefill port `p` and
    /// decode port `d`): the decode node with its metrics on a port of its own, the
    /// prefill node and a gateway. Returns the decode node's metrics URL too.
    pub async fn start_metered(
        dir: tempfile::TempDir,
        config: PathBuf,
        p: u16,
        d: u16,
    ) -> (Self, String) {
        let (decode, metrics) =
            start_node_with_metrics(dir.path(), &config, "decode", d, &[]).await;
        let prefill = start_node(dir.path(), &config, "prefill", p).await;
        let gateway = start_config_gateway(dir.path(), &config, "data", "gateway.log", &[]).await;
        let dep = Self {
            prefill_addr: format!("127.0.0.1:{p}"),
            decode_addr: format!("127.0.0.1:{d}"),
            dir,
            config,
            prefill: Some(prefill),
            decode: Some(decode),
            gateway,
        };
        (dep, metrics)
    }

    pub fn port(addr: &str) -> u16 {
        addr.rsplit(':').next().unwrap().parse().unwrap()
    }

    /// SIGKILLs the gateway (mid-request, as a crash would) and starts a new one (with
    /// a store of its own) on the same nodes.
    pub async fn replace_gateway(&mut self) {
        self.gateway._child.start_kill().unwrap();
        tokio::time::timeout(START, self.gateway._child.wait())
            .await
            .expect("killed gateway exits")
            .unwrap();
        self.gateway =
            start_config_gateway(self.dir.path(), &self.config, "data2", "gateway2.log", &[]).await;
    }

    /// SIGKILLs a node and waits until it is gone.
    pub async fn kill(&mut self, role: &str) {
        let child = match role {
            "prefill" => self.prefill.as_mut(),
            _ => self.decode.as_mut(),
        }
        .expect("node running");
        child.start_kill().unwrap();
        tokio::time::timeout(START, child.wait())
            .await
            .expect("killed node exits")
            .unwrap();
    }

    /// Starts a node of `role` again on its old address.
    pub async fn restart(&mut self, role: &str) {
        let addr = match role {
            "prefill" => &self.prefill_addr,
            _ => &self.decode_addr,
        };
        let child = start_node(self.dir.path(), &self.config, role, Self::port(addr)).await;
        match role {
            "prefill" => self.prefill = Some(child),
            _ => self.decode = Some(child),
        }
    }

    pub fn logs(&self) -> String {
        logs(self.dir.path())
    }

    /// The pool-full probe: a request whose prompt + max_tokens needs every page of
    /// the decode pool, so it is admitted only once no page is held (leaked) by an
    /// earlier request. It must complete with 200 within the deadline.
    pub async fn pool_is_free(&self) {
        let body = |max: usize| json!({"prompt": "What is 2+2? Answer with one number.", "max_tokens": max, "temperature": 0});
        let probe = self.gateway.run_when_up(&body(1)).await;
        let prompt = probe["result"]["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
        let max = CONTEXT - prompt;
        let (status, v) = self.gateway.run(&body(max)).await;
        assert_eq!(
            status,
            200,
            "the pool-full request ({prompt} + {max} tokens) failed: {v}\n{}",
            self.logs()
        );
        assert_eq!(v["success"], true, "{v}");
        assert_eq!(v["result"]["usage"]["prompt_tokens"], prompt, "{v}");
    }
}

/// The page transport the nodes use: `TESSERA_PD_TRANSPORT` (`tcp` by default;
/// `.ci/run` runs this file again with `ucx` over shared memory and over TCP).
pub fn transport() -> String {
    std::env::var("TESSERA_PD_TRANSPORT").unwrap_or_else(|_| "tcp".into())
}

/// The last lines of every `*.log` in `dir` (gateway and nodes), newest first.
pub fn logs(dir: &Path) -> String {
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    names.retain(|p| p.extension().is_some_and(|e| e == "log"));
    names.sort();
    names
        .iter()
        .map(|p| {
            let t = std::fs::read_to_string(p).unwrap_or_default();
            let tail: Vec<&str> = t
                .lines()
                .rev()
                .take(
                    std::env::var("TESSERA_TEST_LOG_LINES")
                        .ok()
                        .and_then(|v| v.parse().ok())
                        .unwrap_or(20),
                )
                .collect();
            format!(
                "--- {} (last lines, newest first)\n{}",
                p.file_name().unwrap().to_string_lossy(),
                tail.join("\n")
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Sends `sig` (`-STOP`, `-CONT`, `-TERM`) to `node`.
pub fn signal(node: &Child, sig: &str) {
    let pid = node.id().unwrap().to_string();
    assert!(std::process::Command::new("kill")
        .args([sig, &pid])
        .status()
        .unwrap()
        .success());
}

/// Starts `tessera node --role ROLE` on `127.0.0.1:PORT` (log `ROLE.log`, or
/// `ROLE-PORT.log` beside another node of the role).
pub async fn start_node(dir: &Path, config: &Path, role: &str, port: u16) -> Child {
    start_node_with(dir, config, role, port, &[], &[]).await
}

/// [`start_node`] with extra arguments and environment variables.
pub async fn start_node_with(
    dir: &Path,
    config: &Path,
    role: &str,
    port: u16,
    extra: &[&str],
    env: &[(&str, &str)],
) -> Child {
    let log = if dir.join(format!("{role}.log")).exists() {
        dir.join(format!("{role}-{port}.log"))
    } else {
        dir.join(format!("{role}.log"))
    };
    spawn_node(config, role, port, extra, env, &log).await.0
}

/// Starts a node like [`start_node_with`], with its metrics on a port of its own
/// (log `ROLE-PORT.log`); returns the metrics URL too.
pub async fn start_node_with_metrics(
    dir: &Path,
    config: &Path,
    role: &str,
    port: u16,
    extra: &[&str],
) -> (Child, String) {
    let mut args = vec!["--metrics-listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let log = dir.join(format!("{role}-{port}.log"));
    let (child, lines) = spawn_node(config, role, port, &args, &[], &log).await;
    let url = lines
        .iter()
        .find_map(|l| l.strip_prefix("tessera node: metrics on "))
        .unwrap_or_else(|| panic!("no metrics line in {lines:?}"))
        .trim()
        .to_string();
    (child, url)
}

/// Spawns `tessera node --role ROLE` on `127.0.0.1:PORT` with `extra` arguments (log
/// `log`) and waits until it listens: the child and its stdout lines so far.
async fn spawn_node(
    config: &Path,
    role: &str,
    port: u16,
    extra: &[&str],
    env: &[(&str, &str)],
    log: &Path,
) -> (Child, Vec<String>) {
    let listen = format!("127.0.0.1:{port}");
    let transport = transport();
    let mut args = vec![
        "node",
        "--role",
        role,
        "--config",
        config.to_str().unwrap(),
        "--listen",
        &listen,
        "--transport",
        &transport,
    ];
    args.extend_from_slice(extra);
    spawn_until_env(&args, env, log, |l| l.contains("listening on")).await
}

/// Starts `tessera serve --config CONFIG` (store in `dir/DATA`) with `extra`
/// arguments; log `dir/LOG`.
pub async fn start_config_gateway(
    dir: &Path,
    config: &Path,
    data: &str,
    log: &str,
    extra: &[&str],
) -> Gateway {
    let data = dir.join(data);
    let mut args = vec![
        "serve",
        "--config",
        config.to_str().unwrap(),
        "--listen",
        "127.0.0.1:0",
        "--data-dir",
        data.to_str().unwrap(),
    ];
    args.extend_from_slice(extra);
    start_gateway(&args, &dir.join(log)).await
}

/// A greedy chat request with a short answer.
pub fn greedy(max_tokens: usize) -> Value {
    json!({"prompt": "What is a tessellation? Explain briefly.", "max_tokens": max_tokens, "temperature": 0})
}

/// A raw prompt the model keeps continuing (counting) until max_tokens.
pub fn endless(max_tokens: usize) -> Value {
    let numbers: Vec<String> = (1..=20).map(|i| i.to_string()).collect();
    json!({"prompt": numbers.join(", ") + ",", "raw": true, "max_tokens": max_tokens, "temperature": 0})
}

/// A chat prompt of about 3000 tokens, so prefill takes a while.
pub fn long_prompt(max_tokens: usize) -> Value {
    prompt_of_words(3000, max_tokens)
}

/// A chat prompt of about `words` tokens.
pub fn prompt_of_words(words: usize, max_tokens: usize) -> Value {
    let words: Vec<&str> = std::iter::repeat_n("apple", words).collect();
    json!({"prompt": words.join(" "), "max_tokens": max_tokens, "temperature": 0})
}

/// A Workers AI `result` as solo-equality compares it: the answer and every usage
/// count except `prompt_tokens_details` (a repeat may be served from a prefill node's
/// prefix cache, so `cached_tokens` legitimately differs from the solo run's).
pub fn answer(result: &Value) -> Value {
    let mut v = result.clone();
    if let Some(u) = v.get_mut("usage").and_then(Value::as_object_mut) {
        u.remove("prompt_tokens_details");
    }
    v
}
