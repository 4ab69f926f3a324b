//! One request over HTTP: the body in the target's API shape, the response read
//! whole or as server-sent events (timing every text event), an optional
//! disconnect at a chosen event, and the [`Outcome`] with what the client saw.

use crate::args::{Api, Mode};
use crate::tenants::Tenant;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

/// Where requests go and in which shape.
#[derive(Clone, Debug, Serialize)]
pub struct Target {
    /// Name in reports.
    pub label: String,
    /// Base URL without a trailing slash (with a fleet: the first gateway's).
    pub base: String,
    /// Every gateway's base URL (at least `base`): request `i` goes to
    /// `fleet[i % n]`.
    pub fleet: Vec<String>,
    /// API shape.
    pub api: Api,
    /// Chat or raw prompts.
    pub mode: Mode,
    /// Model ids (at least one): prompt `i` is sent to `models[i % n]`.
    pub models: Vec<String>,
}

/// How a request ended, from the client's side.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum End {
    /// 2xx and the whole answer (a stream up to `[DONE]`).
    Complete,
    /// The client disconnected on purpose after the response headers.
    Disconnected,
    /// A non-2xx status with an error body.
    HttpError,
    /// 2xx, then an error event from the server (or a body without text).
    StreamError,
    /// 2xx, then the body ended or broke before the end (no `[DONE]`): the
    /// server or the connection went away.
    Cut,
    /// No HTTP status: connection refused or reset, timeout.
    Transport,
}

/// What the client saw of one request. Times are seconds.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Outcome {
    /// Position in the request sequence (solo runs: the prompt id).
    pub index: usize,
    /// Tenant index.
    pub tenant: usize,
    /// Prompt id.
    pub prompt: usize,
    /// Streamed.
    pub stream: bool,
    /// How it ended.
    pub end: End,
    /// HTTP status, if one arrived.
    pub status: Option<u16>,
    /// Error code from the body or event (Workers AI `errors[0].code`, OpenAI
    /// `error.code` or `error.type`), or a transport error's kind.
    pub error: Option<String>,
    /// The transport error's message with its causes, when there was one.
    #[serde(default)]
    pub error_detail: Option<String>,
    /// The server's request id (`x-request-id`), if any.
    pub request_id: Option<String>,
    /// Generated text as received (partial for disconnects and stream errors).
    #[serde(default)]
    pub text: String,
    /// Prompt tokens the server reported.
    pub prompt_tokens: Option<u64>,
    /// Generated tokens the server reported.
    pub completion_tokens: Option<u64>,
    /// Prompt tokens the server reported as served from its prefix cache
    /// (OpenAI and Tessera: `usage.prompt_tokens_details.cached_tokens`; also
    /// read from `usage.cached_tokens`); `None` when the usage did not say.
    #[serde(default)]
    pub cached_tokens: Option<u64>,
    /// Events with non-empty text received.
    pub text_events: usize,
    /// Start, from the start of the phase.
    pub start_s: f64,
    /// Time to the first text event (streams only).
    pub ttft_s: Option<f64>,
    /// Time to the end (last byte read, error, or disconnect).
    pub e2e_s: f64,
    /// Arrival of each text event, from the request's start.
    #[serde(default)]
    pub event_times_s: Vec<f64>,
}

impl Outcome {
    /// A request that has not got anywhere yet: nothing received, ended by a
    /// transport failure until something better is known.
    pub fn pending(index: usize, tenant: usize, prompt: usize, stream: bool, start_s: f64) -> Self {
        Self {
            index,
            tenant,
            prompt,
            stream,
            end: End::Transport,
            status: None,
            error: None,
            error_detail: None,
            request_id: None,
            text: String::new(),
            prompt_tokens: None,
            completion_tokens: None,
            cached_tokens: None,
            text_events: 0,
            start_s,
            ttft_s: None,
            e2e_s: 0.0,
            event_times_s: Vec::new(),
        }
    }

    /// Generated tokens as the client counts them: the server's
    /// `completion_tokens` when it sent one, else the text events (for
    /// Tessera one event carries one token, except tokens that end inside a
    /// UTF-8 character).
    pub fn output_tokens(&self) -> u64 {
        self.completion_tokens.unwrap_or(self.text_events as u64)
    }

    /// Mean time per output token after the first (streams with >= 2 tokens).
    pub fn tpot_s(&self) -> Option<f64> {
        let first = self.ttft_s?;
        let last = *self.event_times_s.last()?;
        let n = self.output_tokens();
        (n >= 2 && last > first).then(|| (last - first) / (n - 1) as f64)
    }
}

/// One request to send.
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    /// Sequence index (copied into the outcome).
    pub index: usize,
    /// Tenant index.
    pub tenant_index: usize,
    /// The tenant (key, account).
    pub tenant: &'a Tenant,
    /// Prompt id.
    pub prompt_id: usize,
    /// Prompt text.
    pub prompt: &'a str,
    /// `max_tokens`.
    pub max_tokens: usize,
    /// Stream.
    pub stream: bool,
    /// Disconnect after this many text events.
    pub disconnect_after: Option<usize>,
}

fn error_code(v: &Value) -> Option<String> {
    let s = |x: &Value| match x {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    };
    if let Some(e) = v.get("errors").and_then(|e| e.get(0)) {
        return e.get("code").and_then(s);
    }
    let e = v.get("error")?;
    if e.is_string() {
        return s(e);
    }
    e.get("code")
        .and_then(s)
        .or_else(|| e.get("type").and_then(s))
        .or_else(|| Some("error".into()))
}

/// Token counts of a usage object.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Usage {
    prompt: Option<u64>,
    completion: Option<u64>,
    cached: Option<u64>,
}

/// The usage object of a response or event (`usage`, or Workers AI's
/// `result.usage`). Cached prompt tokens are read from
/// `prompt_tokens_details.cached_tokens` (OpenAI's field; Tessera sends it in both
/// API shapes) or a flat `cached_tokens` (Workers AI's documented field).
fn usage_of(v: &Value) -> Option<Usage> {
    let u = v
        .get("usage")
        .filter(|u| u.is_object())
        .or_else(|| v.get("result")?.get("usage").filter(|u| u.is_object()))?;
    Some(Usage {
        prompt: u.get("prompt_tokens").and_then(Value::as_u64),
        completion: u.get("completion_tokens").and_then(Value::as_u64),
        cached: u
            .get("prompt_tokens_details")
            .and_then(|d| d.get("cached_tokens"))
            .and_then(Value::as_u64)
            .or_else(|| u.get("cached_tokens").and_then(Value::as_u64)),
    })
}

/// Text of a whole response or of one stream event, in any supported shape.
fn text_of(v: &Value) -> Option<&str> {
    if let Some(r) = v.get("response").and_then(Value::as_str) {
        return Some(r);
    }
    if let Some(r) = v
        .get("result")
        .and_then(|r| r.get("response"))
        .and_then(Value::as_str)
    {
        return Some(r);
    }
    let c = v.get("choices")?.get(0)?;
    c.get("delta")
        .and_then(|d| d.get("content"))
        .and_then(Value::as_str)
        .or_else(|| c.get("message")?.get("content")?.as_str())
        .or_else(|| c.get("text")?.as_str())
}

impl Target {
    /// The model prompt `prompt_id` is sent to.
    pub fn model_for(&self, prompt_id: usize) -> &str {
        &self.models[prompt_id % self.models.len().max(1)]
    }

    /// The request URL and JSON body of `call`.
    ///
    /// # Errors
    /// Workers AI needs the tenant's account id.
    pub fn request(&self, call: &Call<'_>) -> Result<(String, Value), String> {
        let model = self.model_for(call.prompt_id);
        let mut body = match (self.api, self.mode) {
            (Api::WorkersAi, mode) => json!({
                "prompt": call.prompt,
                "raw": mode == Mode::Raw,
            }),
            (Api::Openai, Mode::Chat) => json!({
                "model": model,
                "messages": [{"role": "user", "content": call.prompt}],
            }),
            (Api::Openai, Mode::Raw) => json!({"model": model, "prompt": call.prompt}),
        };
        body["max_tokens"] = json!(call.max_tokens);
        body["temperature"] = json!(0.0);
        body["stream"] = json!(call.stream);
        if call.stream && self.api == Api::Openai {
            body["stream_options"] = json!({"include_usage": true});
        }
        let base = self
            .fleet
            .get(call.index % self.fleet.len().max(1))
            .unwrap_or(&self.base);
        let url = match (self.api, self.mode) {
            (Api::WorkersAi, _) => {
                let acct = call.tenant.account_id.as_deref().ok_or_else(|| {
                    format!(
                        "tenant {} has no account id (the workers-ai API needs one: use --admin-token or --keys-file)",
                        call.tenant.label
                    )
                })?;
                format!("{base}/client/v4/accounts/{acct}/ai/run/{model}")
            }
            (Api::Openai, Mode::Chat) => format!("{base}/v1/chat/completions"),
            (Api::Openai, Mode::Raw) => format!("{base}/v1/completions"),
        };
        Ok((url, body))
    }

    /// Sends `call` and reads the answer. `phase_start` is the origin of
    /// [`Outcome::start_s`]. Never fails: failures are outcomes.
    pub async fn send(
        &self,
        http: &reqwest::Client,
        call: Call<'_>,
        phase_start: Instant,
    ) -> Outcome {
        let t0 = Instant::now();
        let mut out = Outcome::pending(
            call.index,
            call.tenant_index,
            call.prompt_id,
            call.stream,
            t0.duration_since(phase_start).as_secs_f64(),
        );
        let (url, body) = match self.request(&call) {
            Ok(x) => x,
            Err(e) => {
                out.error = Some(e);
                return out;
            }
        };
        let mut req = http.post(url).json(&body);
        if let Some(k) = &call.tenant.key {
            req = req.bearer_auth(k);
        }
        let resp = match req.send().await {
            Ok(r) => r,
            Err(e) => {
                out.error = Some(transport_kind(&e));
                out.error_detail = Some(chain(&e));
                out.e2e_s = t0.elapsed().as_secs_f64();
                return out;
            }
        };
        out.status = Some(resp.status().as_u16());
        out.request_id = resp
            .headers()
            .get("x-request-id")
            .and_then(|v| v.to_str().ok())
            .map(str::to_string);
        if !resp.status().is_success() {
            let v: Value = resp.json().await.unwrap_or(Value::Null);
            out.end = End::HttpError;
            out.error = error_code(&v).or_else(|| Some(out.status.unwrap_or(0).to_string()));
            out.e2e_s = t0.elapsed().as_secs_f64();
            return out;
        }
        if call.stream {
            read_stream(resp, call.disconnect_after, t0, &mut out).await;
        } else {
            match resp.json::<Value>().await {
                Ok(v) => {
                    if let Some(t) = text_of(&v) {
                        out.text = t.to_string();
                        out.end = End::Complete;
                    } else {
                        out.end = End::StreamError;
                        out.error = error_code(&v).or_else(|| Some("no_text".into()));
                    }
                    if let Some(u) = usage_of(&v) {
                        out.prompt_tokens = u.prompt;
                        out.completion_tokens = u.completion;
                        out.cached_tokens = u.cached;
                    }
                }
                Err(e) => {
                    out.end = End::Cut;
                    out.error = Some(transport_kind(&e));
                    out.error_detail = Some(chain(&e));
                }
            }
        }
        out.e2e_s = t0.elapsed().as_secs_f64();
        out
    }
}

/// The error's message followed by its causes.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

fn transport_kind(e: &reqwest::Error) -> String {
    if e.is_timeout() {
        "timeout".into()
    } else if e.is_connect() {
        "connect".into()
    } else if e.is_body() || e.is_decode() {
        "body".into()
    } else {
        "request".into()
    }
}

/// What one server-sent event meant.
enum Event {
    Text(String),
    Done,
    Error(String),
    Other,
}

fn parse_event(data: &str, out: &mut Outcome) -> Event {
    let data = data.trim();
    if data == "[DONE]" {
        return Event::Done;
    }
    let Ok(v) = serde_json::from_str::<Value>(data) else {
        return Event::Error("bad_event".into());
    };
    if v.get("error").is_some_and(|e| !e.is_null()) {
        return Event::Error(error_code(&v).unwrap_or_else(|| "error".into()));
    }
    if let Some(u) = usage_of(&v) {
        out.prompt_tokens = u.prompt.or(out.prompt_tokens);
        out.completion_tokens = u.completion.or(out.completion_tokens);
        out.cached_tokens = u.cached.or(out.cached_tokens);
    }
    match text_of(&v) {
        Some(t) if !t.is_empty() => Event::Text(t.to_string()),
        _ => Event::Other,
    }
}

/// Reads server-sent events until `[DONE]`, an error event, the end of the body,
/// or the planned disconnect (then drops the response, closing the connection).
async fn read_stream(
    mut resp: reqwest::Response,
    disconnect_after: Option<usize>,
    t0: Instant,
    out: &mut Outcome,
) {
    if disconnect_after == Some(0) {
        out.end = End::Disconnected;
        return;
    }
    let mut buf: Vec<u8> = Vec::new();
    let mut data = String::new();
    loop {
        let chunk = match resp.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => {
                out.end = End::Cut;
                out.error = Some("incomplete_stream".into());
                return;
            }
            Err(e) => {
                out.end = End::Cut;
                out.error = Some(transport_kind(&e));
                out.error_detail = Some(chain(&e));
                return;
            }
        };
        let now = t0.elapsed().as_secs_f64();
        buf.extend_from_slice(&chunk);
        while let Some(nl) = buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            if !line.is_empty() {
                if let Some(d) = line.strip_prefix("data:") {
                    if !data.is_empty() {
                        data.push('\n');
                    }
                    data.push_str(d.strip_prefix(' ').unwrap_or(d));
                }
                continue;
            }
            if data.is_empty() {
                continue;
            }
            let ev = parse_event(&std::mem::take(&mut data), out);
            match ev {
                Event::Text(t) => {
                    out.text.push_str(&t);
                    out.text_events += 1;
                    out.event_times_s.push(now);
                    out.ttft_s.get_or_insert(now);
                    if disconnect_after == Some(out.text_events) {
                        out.end = End::Disconnected;
                        return;
                    }
                }
                Event::Done => {
                    out.end = End::Complete;
                    return;
                }
                Event::Error(code) => {
                    out.end = End::StreamError;
                    out.error = Some(code);
                    return;
                }
                Event::Other => {}
            }
        }
    }
}

/// A client with the per-request time limit. Every request opens its own
/// connection (no keep-alive pool): many independent clients, and no request
/// lost to a server closing an idle pooled connection just as it is reused.
///
/// # Errors
/// The TLS backend cannot start.
pub fn http_client(timeout: Duration) -> reqwest::Result<reqwest::Client> {
    reqwest::Client::builder()
        .timeout(timeout)
        .pool_max_idle_per_host(0)
        .tcp_nodelay(true)
        .build()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn blank() -> Outcome {
        Outcome::pending(0, 0, 0, true, 0.0)
    }

    #[test]
    fn events_in_every_shape() {
        let mut o = blank();
        assert!(matches!(parse_event(r#"{"response":"Hi"}"#, &mut o), Event::Text(t) if t == "Hi"));
        assert!(matches!(
            parse_event(
                r#"{"response":"","usage":{"prompt_tokens":5,"completion_tokens":3,"total_tokens":8}}"#,
                &mut o
            ),
            Event::Other
        ));
        assert_eq!((o.prompt_tokens, o.completion_tokens), (Some(5), Some(3)));
        assert_eq!(o.cached_tokens, None);
        assert!(matches!(
            parse_event(r#"{"choices":[{"delta":{"content":"x"}}]}"#, &mut o),
            Event::Text(t) if t == "x"
        ));
        assert!(matches!(
            parse_event(r#"{"choices":[{"text":"y","index":0}],"usage":null}"#, &mut o),
            Event::Text(t) if t == "y"
        ));
        assert!(matches!(
            parse_event(r#"{"error":{"code":3043,"message":"boom"}}"#, &mut o),
            Event::Error(c) if c == "3043"
        ));
        assert!(matches!(parse_event("[DONE]", &mut o), Event::Done));
    }

    #[test]
    fn cached_tokens_in_every_usage_shape() {
        // Tessera and OpenAI: prompt_tokens_details.cached_tokens (stream events and
        // whole answers, both envelopes).
        let mut o = blank();
        parse_event(
            r#"{"response":"","usage":{"prompt_tokens":40,"completion_tokens":3,"prompt_tokens_details":{"cached_tokens":32}}}"#,
            &mut o,
        );
        assert_eq!(o.cached_tokens, Some(32));
        let v: Value = serde_json::from_str(
            r#"{"result":{"response":"x","usage":{"prompt_tokens":9,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":0}}},"success":true}"#,
        )
        .unwrap();
        assert_eq!(
            usage_of(&v),
            Some(Usage {
                prompt: Some(9),
                completion: Some(1),
                cached: Some(0)
            })
        );
        // Workers AI's flat field.
        let v: Value =
            serde_json::from_str(r#"{"usage":{"prompt_tokens":20,"cached_tokens":16}}"#).unwrap();
        assert_eq!(usage_of(&v).unwrap().cached, Some(16));
        // An OpenAI final chunk with usage after the text: the earlier value stays
        // when a later usage object does not say.
        let mut o = blank();
        parse_event(
            r#"{"choices":[],"usage":{"prompt_tokens":20,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":16}}}"#,
            &mut o,
        );
        parse_event(r#"{"usage":{"prompt_tokens":20}}"#, &mut o);
        assert_eq!(o.cached_tokens, Some(16));
    }

    #[test]
    fn error_codes_of_both_envelopes() {
        let w: Value = serde_json::from_str(
            r#"{"success":false,"errors":[{"code":3006,"message":"too long"}]}"#,
        )
        .unwrap();
        assert_eq!(error_code(&w).as_deref(), Some("3006"));
        let o: Value = serde_json::from_str(
            r#"{"error":{"message":"m","type":"invalid_request_error","code":null}}"#,
        )
        .unwrap();
        assert_eq!(error_code(&o).as_deref(), Some("invalid_request_error"));
    }

    #[test]
    fn tpot_from_event_times() {
        let mut o = blank();
        o.ttft_s = Some(0.1);
        o.event_times_s = vec![0.1, 0.2, 0.3, 0.5];
        o.completion_tokens = Some(5);
        assert!((o.tpot_s().unwrap() - 0.1).abs() < 1e-9);
        o.completion_tokens = Some(1);
        assert_eq!(o.tpot_s(), None);
    }
}
