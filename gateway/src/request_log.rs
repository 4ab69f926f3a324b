//! One structured log line per finished request (target `tessera::request`, level
//! INFO): the usage row's fields and the request id. Never the prompt or the output
//! text (unless the operator turned on `log_request_text` for debugging), never an
//! API key or a token (`key_id` is the key's public id, as in the ledger).
//!
//! With `--log-format json` each line is one JSON object whose `fields` hold these
//! values, so a log pipeline can join it to the ledger and to the trace by
//! `request_id`.

use tessera_tenancy::UsageRecord;

/// The log target of request lines (filter with `RUST_LOG=tessera::request=info`).
pub(crate) const TARGET: &str = "tessera::request";

/// Logs `r`'s line; `text` is (prompt, output) when the debug flag is on.
pub(crate) fn finished(r: &UsageRecord, text: Option<(&str, &str)>) {
    let (prompt, output) = match text {
        Some((p, o)) => (Some(p), Some(o)),
        None => (None, None),
    };
    tracing::info!(
        target: TARGET,
        request_id = %r.request_id,
        tenant_id = %r.tenant_id,
        key_id = %r.key_id,
        model = %r.model,
        endpoint = %r.endpoint,
        status = r.status,
        error_code = r.error_code,
        finish = %r.finish,
        input_tokens = r.input_tokens,
        output_tokens = r.output_tokens,
        cached_tokens = r.cached_tokens,
        ttft_us = r.ttft_us,
        duration_us = r.duration_us,
        prompt,
        output,
        "request finished"
    );
}
