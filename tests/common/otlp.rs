//! An OTLP/HTTP trace receiver on a loopback port: decodes every
//! `ExportTraceServiceRequest` (protobuf) posted to `/v1/traces` and keeps its spans.
//!
//! Shared by `tests/observability.rs` and `examples/ttft_phases.rs` (each includes
//! this file with `#[path]`; it is not part of `common/mod.rs`, so the other test
//! crates do not compile it). Each user reads a different subset of [`Span`].

#![allow(dead_code)]

use axum::body::Bytes;
use axum::extract::State;
use axum::http::header::CONTENT_TYPE;
use axum::routing::post;
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::{any_value, AnyValue, KeyValue};
use prost::Message;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// One span as the receiver got it.
#[derive(Clone, Debug)]
pub struct Span {
    /// The exporting process's `service.name`.
    pub service: String,
    pub name: String,
    pub trace_id: Vec<u8>,
    pub span_id: Vec<u8>,
    pub parent_span_id: Vec<u8>,
    /// Wall-clock start and end (unix nanoseconds, the exporting process's clock).
    pub start_unix_nano: u64,
    pub end_unix_nano: u64,
    /// String and integer attributes, as strings.
    pub attrs: HashMap<String, String>,
}

/// The receiver: its address, what it decoded, and what it could not.
pub struct Otlp {
    pub addr: std::net::SocketAddr,
    pub spans: Arc<Mutex<Vec<Span>>>,
    /// Bodies that were not a valid protobuf export request.
    pub bad: Arc<Mutex<Vec<String>>>,
}

type Received = (Arc<Mutex<Vec<Span>>>, Arc<Mutex<Vec<String>>>);

fn value_text(v: &Option<AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(any_value::Value::StringValue(s)) => s.clone(),
        Some(any_value::Value::IntValue(i)) => i.to_string(),
        Some(any_value::Value::BoolValue(b)) => b.to_string(),
        Some(any_value::Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

fn attrs(kvs: &[KeyValue]) -> HashMap<String, String> {
    kvs.iter()
        .map(|kv| (kv.key.clone(), value_text(&kv.value)))
        .collect()
}

async fn export(
    State((spans, bad)): State<Received>,
    body: Bytes,
) -> impl axum::response::IntoResponse {
    match ExportTraceServiceRequest::decode(body) {
        Ok(req) => {
            let mut got = spans.lock().unwrap();
            for rs in req.resource_spans {
                let service = rs
                    .resource
                    .as_ref()
                    .and_then(|r| attrs(&r.attributes).remove("service.name"))
                    .unwrap_or_default();
                for ss in rs.scope_spans {
                    for s in ss.spans {
                        got.push(Span {
                            service: service.clone(),
                            name: s.name,
                            trace_id: s.trace_id,
                            span_id: s.span_id,
                            parent_span_id: s.parent_span_id,
                            start_unix_nano: s.start_time_unix_nano,
                            end_unix_nano: s.end_time_unix_nano,
                            attrs: attrs(&s.attributes),
                        });
                    }
                }
            }
        }
        Err(e) => bad.lock().unwrap().push(e.to_string()),
    }
    (
        [(CONTENT_TYPE, "application/x-protobuf")],
        ExportTraceServiceResponse::default().encode_to_vec(),
    )
}

impl Otlp {
    /// Listens on `127.0.0.1:0`, serving on the current tokio runtime.
    pub async fn start() -> Self {
        let spans = Arc::new(Mutex::new(Vec::new()));
        let bad = Arc::new(Mutex::new(Vec::new()));
        let app = axum::Router::new()
            .route("/v1/traces", post(export))
            .with_state((spans.clone(), bad.clone()));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self { addr, spans, bad }
    }

    /// What `OTEL_EXPORTER_OTLP_ENDPOINT` is set to (the exporter appends
    /// `/v1/traces`).
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every span received so far.
    pub fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }

    /// The decode errors of bodies that were not a valid export request.
    pub fn bad(&self) -> Vec<String> {
        self.bad.lock().unwrap().clone()
    }
}
