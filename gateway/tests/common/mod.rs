//! Test harness: the real server on 127.0.0.1:0 with the real model, a real SQLite
//! file in a temp dir, and real HTTP clients.
#![allow(dead_code, unreachable_pub)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tessera_gateway::{AppState, GatewayOptions, ServedModel, Server, TlsMode};
use tessera_model::LoadedModel;
use tessera_serving::EngineConfig;
use tessera_serving::EngineHandle;
use tessera_tenancy::{Limits, Store, Tenant, UsageRecord};

pub const MODEL: &str = "@cf/huggingfacetb/smollm2-135m-instruct";
/// The admin token of test servers (at least 32 bytes, as the server requires).
pub const ADMIN: &str = "test-admin-token-0123456789abcdef0123";

pub fn model_path() -> PathBuf {
    std::env::var_os("TESSERA_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/../models/SmolLM2-135M-Instruct.Q4_1.gguf"
            ))
        })
}

pub struct TestServer {
    pub base: String,
    /// The admin listener's base URL, when the config asked for one.
    pub admin_base: Option<String>,
    pub addr: std::net::SocketAddr,
    pub state: Arc<AppState>,
    pub tenant: Tenant,
    pub key: String,
    pub client: reqwest::Client,
    pub dir: tempfile::TempDir,
    /// Send to shut the server down (drain, then abort).
    pub shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    /// The server task.
    pub task: tokio::task::JoinHandle<Result<(), tessera_gateway::StartError>>,
}

pub async fn start() -> TestServer {
    start_with(GatewayOptions::default()).await
}

pub async fn start_with(cfg: GatewayOptions) -> TestServer {
    start_with_store(cfg, None).await
}

/// Starts the server on the store at `url` (default: a SQLite file in a temp dir).
pub async fn start_with_store(cfg: GatewayOptions, url: Option<String>) -> TestServer {
    start_full(cfg, url, EngineConfig::default(), false).await
}

/// Starts the server with a co-located engine configured as `engine`.
pub async fn start_with_engine(cfg: GatewayOptions, engine: EngineConfig) -> TestServer {
    start_full(cfg, None, engine, false).await
}

/// Starts the server with a prefill and a decode engine in this process (the
/// `tessera serve` default), each with a pool of one context window.
pub async fn start_pd(cfg: GatewayOptions) -> TestServer {
    let engine = EngineConfig {
        kv_pool_tokens: 8192,
        ..EngineConfig::default()
    };
    start_full(cfg, None, engine, true).await
}

async fn start_full(
    cfg: GatewayOptions,
    url: Option<String>,
    ecfg: EngineConfig,
    pd: bool,
) -> TestServer {
    let model = LoadedModel::load(&model_path()).expect("model (run `tessera model fetch`)");
    let engine = if pd {
        EngineHandle::spawn_disaggregated(
            &model,
            std::slice::from_ref(&ecfg),
            std::slice::from_ref(&ecfg),
        )
    } else {
        EngineHandle::spawn(&model, ecfg)
    };
    start_served(cfg, url, vec![ServedModel::new(MODEL, model, engine)]).await
}

/// Starts the server with `models`, each served by its own engines, on a SQLite
/// file in a temp dir.
pub async fn start_models(cfg: GatewayOptions, models: Vec<ServedModel>) -> TestServer {
    start_served(cfg, None, models).await
}

async fn start_served(
    mut cfg: GatewayOptions,
    url: Option<String>,
    models: Vec<ServedModel>,
) -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    let url =
        url.unwrap_or_else(|| format!("sqlite://{}", dir.path().join("tessera.db").display()));
    let store = Store::connect(&url).await.unwrap();
    cfg.listen = "127.0.0.1:0".parse().unwrap();
    if cfg.admin_listen.is_some() {
        cfg.admin_listen = Some("127.0.0.1:0".parse().unwrap());
    }
    cfg.admin_token.get_or_insert_with(|| ADMIN.into());
    if let TlsMode::SelfSigned(None) = cfg.tls {
        cfg.tls = TlsMode::SelfSigned(Some(dir.path().join("cert.pem")));
    }
    let state = AppState::with_models(store.clone(), models, &cfg).unwrap();
    let server = Server::bind(&cfg, state.clone()).await.unwrap();
    let addr = server.local_addr();
    let base = format!("{}://{}", server.scheme(), addr);
    let admin_base = server
        .admin_addr()
        .map(|a| format!("{}://{a}", server.scheme()));
    let (shutdown, rx) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(server.run_until(async move {
        let _ = rx.await;
    }));
    let tenant = store
        .create_tenant("alpha", Limits::default())
        .await
        .unwrap();
    let (_, key) = store.create_key(&tenant.id, "test").await.unwrap();
    TestServer {
        base,
        admin_base,
        addr,
        state,
        tenant,
        key,
        client: reqwest::Client::builder()
            .timeout(Duration::from_secs(300))
            .build()
            .unwrap(),
        dir,
        shutdown: Some(shutdown),
        task,
    }
}

impl TestServer {
    pub fn store(&self) -> &Store {
        &self.state.store
    }

    pub fn run_url(&self, account: &str) -> String {
        format!("{}/client/v4/accounts/{account}/ai/run/{MODEL}", self.base)
    }

    pub async fn tenant_with_key(&self, name: &str, limits: Limits) -> (Tenant, String) {
        let t = self.store().create_tenant(name, limits).await.unwrap();
        let (_, k) = self.store().create_key(&t.id, "k").await.unwrap();
        (t, k)
    }

    /// POSTs JSON with a bearer key; returns status, x-request-id and body JSON.
    pub async fn post(
        &self,
        url: &str,
        key: Option<&str>,
        body: &serde_json::Value,
    ) -> (u16, String, serde_json::Value) {
        let mut r = self.client.post(url).json(body);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        let resp = r.send().await.unwrap();
        split(resp).await
    }

    /// POSTs a streaming request with the tenant's key; asserts 200 and returns the
    /// JSON frames ([`sse_json`]).
    pub async fn post_stream(&self, url: &str, body: &serde_json::Value) -> Vec<serde_json::Value> {
        let resp = self
            .client
            .post(url)
            .bearer_auth(&self.key)
            .json(body)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 200);
        sse_json(resp).await
    }

    pub async fn get(&self, url: &str, key: Option<&str>) -> (u16, String, serde_json::Value) {
        let mut r = self.client.get(url);
        if let Some(k) = key {
            r = r.bearer_auth(k);
        }
        split(r.send().await.unwrap()).await
    }

    /// The request's ledger row (written once the response ended and serving
    /// confirmed the release, which after an abort can take an engine step: polls,
    /// up to 30 s).
    pub async fn row(&self, rid: &str) -> UsageRecord {
        for _ in 0..6000 {
            if let Some(r) = self.store().usage_row(rid).await.unwrap() {
                return r;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        panic!("no usage row for {rid}")
    }

    /// Waits until every admitted request has written its usage row.
    pub async fn settle(&self) {
        assert!(self.state.wait_idle(Duration::from_secs(10)).await);
    }

    pub async fn row_count(&self) -> usize {
        self.settle().await;
        self.store().usage_rows(None).await.unwrap().len()
    }

    /// A request to the admin API (on the admin listener when there is one) with
    /// the admin token.
    pub fn admin(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        let base = self.admin_base.as_deref().unwrap_or(&self.base);
        self.client
            .request(method, format!("{base}{path}"))
            .bearer_auth(ADMIN)
    }

    /// An admin GET; returns status, x-request-id and body JSON.
    pub async fn admin_get(&self, path: &str) -> (u16, String, serde_json::Value) {
        split(self.admin(reqwest::Method::GET, path).send().await.unwrap()).await
    }

    /// Starts a streaming generation for `account` with `key`; returns the open
    /// response after its first frame.
    pub async fn open_stream(
        &self,
        account: &str,
        key: &str,
        max_tokens: u32,
    ) -> reqwest::Response {
        self.open_stream_with_first(account, key, max_tokens)
            .await
            .0
    }

    /// [`Self::open_stream`], also returning the first chunk's text.
    pub async fn open_stream_with_first(
        &self,
        account: &str,
        key: &str,
        max_tokens: u32,
    ) -> (reqwest::Response, String) {
        let body = serde_json::json!({
            "prompt": "Count from 1 to 1000, separated by commas.",
            "max_tokens": max_tokens, "stream": true,
        });
        open_stream_at(&self.client, &self.run_url(account), key, &body).await
    }

    /// The `/metrics` exposition, read with the admin token (on the admin listener
    /// when there is one).
    pub async fn metrics_text(&self) -> String {
        metrics_text(
            &self.client,
            self.admin_base.as_deref().unwrap_or(&self.base),
        )
        .await
    }

    pub fn account_url(&self, path: &str) -> String {
        format!(
            "{}/client/v4/accounts/{}/ai/{path}",
            self.base, self.tenant.id
        )
    }

    /// Waits until the engine is idle with every page free or held by the prefix
    /// cache (unused cached pages are evictable, never leaked).
    pub async fn wait_idle(&self) {
        for _ in 0..600 {
            let s = self.state.engine.stats();
            if s.running == 0 && s.waiting == 0 && s.free_pages + s.cached_pages == s.capacity_pages
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        panic!("engine not idle: {:?}", self.state.engine.stats());
    }
}

/// POSTs a streaming `body` to `url` with `key`; returns the open 200 response and
/// its first chunk's text.
pub async fn open_stream_at(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    body: &serde_json::Value,
) -> (reqwest::Response, String) {
    let mut resp = client
        .post(url)
        .bearer_auth(key)
        .json(body)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.unwrap().expect("first frame");
    (resp, String::from_utf8_lossy(&first).into_owned())
}

/// `GET {base}/metrics` with the admin token; the body.
pub async fn metrics_text(client: &reqwest::Client, base: &str) -> String {
    client
        .get(format!("{base}/metrics"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Reads the rest of a stream; returns its text.
pub async fn rest_of(mut resp: reqwest::Response) -> String {
    let mut body = String::new();
    while let Ok(Some(c)) = resp.chunk().await {
        body.push_str(&String::from_utf8_lossy(&c));
    }
    body
}

/// The last SSE frame's JSON.
pub fn last_frame(body: &str) -> serde_json::Value {
    let last = body.trim_end().rsplit("\n\n").next().unwrap_or_default();
    serde_json::from_str(last.strip_prefix("data: ").unwrap_or(last))
        .unwrap_or_else(|_| panic!("bad last frame in {body:?}"))
}

pub async fn split(resp: reqwest::Response) -> (u16, String, serde_json::Value) {
    let status = resp.status().as_u16();
    let rid = resp
        .headers()
        .get("x-request-id")
        .map(|v| v.to_str().unwrap().to_string())
        .unwrap_or_default();
    let text = resp.text().await.unwrap();
    let v = serde_json::from_str(&text).unwrap_or(serde_json::Value::String(text));
    (status, rid, v)
}

/// Reads a whole SSE body into its `data:` payloads.
pub async fn sse_events(resp: reqwest::Response) -> Vec<String> {
    let text = resp.text().await.unwrap();
    text.split("\n\n")
        .filter(|f| !f.trim().is_empty())
        .map(|f| {
            f.strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad SSE frame {f:?}"))
                .to_string()
        })
        .collect()
}

/// Reads a whole SSE body that ends with `[DONE]` into its JSON frames (the
/// `[DONE]` checked and dropped).
pub async fn sse_json(resp: reqwest::Response) -> Vec<serde_json::Value> {
    let mut ev = sse_events(resp).await;
    assert_eq!(
        ev.pop().as_deref(),
        Some("[DONE]"),
        "the stream did not end with [DONE]"
    );
    ev.iter()
        .map(|e| serde_json::from_str(e).unwrap_or_else(|err| panic!("{err}: {e}")))
        .collect()
}

/// The test Python (the packages of `scripts/requirements-test.txt`): `TESSERA_TEST_PYTHON` (set by
/// `scripts/test`), else the virtual environment `scripts/python-env` prepares under
/// `target/py` (created on first use from `scripts/requirements-test.txt`).
pub fn test_python() -> std::path::PathBuf {
    if let Some(p) = std::env::var_os("TESSERA_TEST_PYTHON").filter(|p| !p.is_empty()) {
        return p.into();
    }
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/python-env");
    let out = std::process::Command::new(script)
        .stderr(std::process::Stdio::inherit())
        .output()
        .expect("run scripts/python-env");
    assert!(
        out.status.success(),
        "scripts/python-env could not prepare the test Python (see its message above)"
    );
    String::from_utf8(out.stdout).unwrap().trim().into()
}

/// The key id of an API key `tsk_<key_id>_<secret>`.
pub fn key_id_of(key: &str) -> String {
    key.split('_').nth(1).expect("tsk_<key_id>_<secret>").into()
}

/// A ledger row of `tenant` as the server would have written it `age_ms` ago (for
/// seeding usage history without waiting); `tokens` are input, output, cached.
pub fn past_usage(
    tenant: &str,
    key_id: &str,
    model: &str,
    age_ms: i64,
    status: u16,
    tokens: (i64, i64, i64),
) -> UsageRecord {
    let (input, output, cached) = tokens;
    UsageRecord {
        request_id: format!("seed-{}", tessera_tenancy::random_hex(8)),
        tenant_id: tenant.into(),
        key_id: key_id.into(),
        model: model.into(),
        endpoint: "workers_ai.run".into(),
        status,
        error_code: if status >= 400 { 3040 } else { 0 },
        finish: if status >= 400 { "error" } else { "stop" }.into(),
        input_tokens: input,
        output_tokens: output,
        cached_tokens: cached,
        ttft_us: 20_000,
        duration_us: 90_000,
        created_ms: tessera_tenancy::now_ms() - age_ms,
        ..UsageRecord::default()
    }
}
