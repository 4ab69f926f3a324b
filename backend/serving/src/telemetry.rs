//! Logs and traces of a Tessera process.
//!
//! - Logs: `tracing` events to stderr, as text or one JSON object per line
//!   ([`LogFormat`]); the filter is `RUST_LOG`, by default warnings and the gateway's
//!   one line per finished request (`tessera::request=info`).
//! - Traces: when `OTEL_EXPORTER_OTLP_ENDPOINT` (or `..._TRACES_ENDPOINT`) is set, the
//!   request spans (target [`TARGET`]) are exported over OTLP/HTTP with protobuf
//!   bodies, in batches (`OTEL_BSP_*` tune the batching, `OTEL_SERVICE_NAME` the
//!   service name). A request's spans on the gateway and on every node share one
//!   trace: node links carry the W3C `traceparent` of the request ([`traceparent`],
//!   [`child_span`]). Without the variable no span is recorded and nothing travels:
//!   spans of [`TARGET`] are disabled for every layer, and [`traceparent`] returns
//!   `None` after one atomic load.

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::Layer;

/// The target of request spans (the only spans exported as traces).
pub const TARGET: &str = "tessera::trace";

/// Whether spans are exported (set once by [`init`]).
static TRACING: AtomicBool = AtomicBool::new(false);

/// How log lines look on stderr.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line: `timestamp`, `level`, `target`, `fields`.
    Json,
}

/// Flushes and stops the trace exporter when dropped (keep it until the process
/// ends).
#[must_use = "dropping the guard stops the trace exporter"]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl std::fmt::Debug for TelemetryGuard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TelemetryGuard")
            .field("exporting", &self.provider.is_some())
            .finish()
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take() {
            if let Err(e) = p.shutdown() {
                eprintln!("tessera: flushing traces failed: {e}");
            }
        }
    }
}

/// Whether `OTEL_EXPORTER_OTLP_ENDPOINT` or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` is
/// set (non-empty).
pub fn otlp_configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()))
}

/// Installs the process's subscriber: logs in `format` to stderr, and OTLP trace
/// export as service `service` (unless `OTEL_SERVICE_NAME` names it) when
/// [`otlp_configured`]. Call once, before any async runtime starts (the exporter's
/// HTTP client runs on its own thread).
///
/// Errors: the OTLP exporter cannot be built (the message names why); logs work
/// either way, so the caller may go on without traces.
pub fn init(format: LogFormat, service: &str) -> Result<TelemetryGuard, String> {
    let filter = || {
        EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| EnvFilter::new("warn,tessera::request=info"))
    };
    let logs = match format {
        // Colours only on a terminal: escape codes in a log file or journal are noise.
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .with_writer(std::io::stderr)
            .with_filter(filter())
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .flatten_event(false)
            .with_current_span(false)
            .with_span_list(false)
            .with_writer(std::io::stderr)
            .with_filter(filter())
            .boxed(),
    };
    let (provider, error) = if otlp_configured() {
        match exporter(service) {
            Ok(p) => (Some(p), None),
            Err(e) => (None, Some(e)),
        }
    } else {
        (None, None)
    };
    let traces = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("tessera"))
            .with_filter(Targets::new().with_target(TARGET, LevelFilter::INFO))
    });
    let _ = tracing_subscriber::registry()
        .with(logs)
        .with(traces)
        .try_init();
    TRACING.store(provider.is_some(), Ordering::Release);
    match error {
        Some(e) => Err(e),
        None => Ok(TelemetryGuard { provider }),
    }
}

fn exporter(service: &str) -> Result<SdkTracerProvider, String> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .map_err(|e| format!("cannot build the OTLP/HTTP span exporter: {e}"))?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var_os("OTEL_SERVICE_NAME").is_none() {
        resource = resource.with_service_name(service.to_string());
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

/// Whether spans are exported in this process.
pub fn tracing_enabled() -> bool {
    TRACING.load(Ordering::Acquire)
}

/// The W3C `traceparent` of the current span, to carry to another process; `None`
/// when traces are off (one atomic load) or there is no current request span.
pub fn traceparent() -> Option<String> {
    if !tracing_enabled() {
        return None;
    }
    let cx = tracing::Span::current().context();
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove("traceparent")
}

/// Makes `span` a child of the remote span `traceparent` names (a malformed value
/// leaves `span` a root). Call before the span is entered.
pub fn set_remote_parent(span: &tracing::Span, traceparent: &str) {
    let carrier = HashMap::from([("traceparent".to_string(), traceparent.to_string())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    let _ = span.set_parent(cx);
}

/// A span of phase `name` (`queue`, `prefill`, `transfer`, `decode`) for request
/// `req`, child of the remote span `parent`; `None` when there is no parent (traces
/// off, or the peer sent none), so untraced requests cost nothing.
pub fn child_span(name: &'static str, req: u64, parent: Option<&str>) -> Option<tracing::Span> {
    let parent = parent?;
    let span = match name {
        "queue" => tracing::info_span!(target: TARGET, "queue", req),
        "prefill" => tracing::info_span!(target: TARGET, "prefill", req),
        "transfer" => tracing::info_span!(target: TARGET, "transfer", req),
        _ => tracing::info_span!(target: TARGET, "decode", req),
    };
    set_remote_parent(&span, parent);
    Some(span)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_an_exporter_nothing_is_propagated() {
        // No `init` ran in this test binary: traces are off.
        assert!(!tracing_enabled());
        let span = tracing::info_span!(target: TARGET, "request");
        let _e = span.enter();
        assert_eq!(traceparent(), None);
        assert!(child_span("prefill", 1, None).is_none());
    }
}
