//! The official `openai` Python SDK against the live server, and a TLS handshake
//! with the self-signed mode.

mod common;

use common::*;
use rustls::pki_types::pem::PemObject;
use serde_json::Value;
use std::sync::Arc;
use tessera_gateway::{GatewayOptions, TlsMode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn usage(v: &Value) -> (i64, i64) {
    (
        v["prompt_tokens"].as_i64().unwrap(),
        v["completion_tokens"].as_i64().unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_python_sdk_against_the_live_server() {
    let s = start().await;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/openai_sdk.py");
    let out = tokio::process::Command::new(test_python())
        .arg(script)
        .env("TESSERA_BASE", &s.base)
        .env("TESSERA_KEY", &s.key)
        .env("TESSERA_ACCOUNT", &s.tenant.id)
        .env("TESSERA_MODEL_ID", MODEL)
        .env_remove("OPENAI_BASE_URL")
        .env_remove("OPENAI_API_KEY")
        .output()
        .await
        .expect("run the test Python");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "SDK script failed: {stderr}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();

    // Non-streaming: usage equals the ledger row.
    let chat = &v["chat"];
    let rid = chat["request_id"].as_str().unwrap();
    assert_eq!(chat["id"], format!("chatcmpl-{rid}"));
    let row = s.row(rid).await;
    assert_eq!(usage(&chat["usage"]), (row.input_tokens, row.output_tokens));
    assert_eq!(
        chat["usage"]["total_tokens"].as_i64().unwrap(),
        row.input_tokens + row.output_tokens
    );
    assert_eq!(row.status, 200);
    let content = chat["content"].as_str().unwrap();
    assert!(!content.is_empty());

    // Streaming: one id, same greedy text; ledger row for it.
    let st = &v["stream"];
    assert_eq!(st["ids"].as_array().unwrap().len(), 1);
    assert_eq!(st["content"].as_str().unwrap(), content);
    assert_eq!(st["finish_reason"], chat["finish_reason"]);
    let srid = st["ids"][0]
        .as_str()
        .unwrap()
        .strip_prefix("chatcmpl-")
        .unwrap();
    assert_eq!(s.row(srid).await.output_tokens, row.output_tokens);

    // include_usage: the usage chunk equals the ledger row.
    let su = &v["stream_usage"];
    assert_eq!(su["content"].as_str().unwrap(), content);
    let urid = su["ids"][0]
        .as_str()
        .unwrap()
        .strip_prefix("chatcmpl-")
        .unwrap();
    let urow = s.row(urid).await;
    assert_eq!(usage(&su["usage"]), (urow.input_tokens, urow.output_tokens));

    // Completions.
    let crid = v["completion"]["id"]
        .as_str()
        .unwrap()
        .strip_prefix("cmpl-")
        .unwrap();
    let crow = s.row(crid).await;
    assert_eq!(
        usage(&v["completion"]["usage"]),
        (crow.input_tokens, crow.output_tokens)
    );
    assert_eq!(crow.endpoint, "openai.completions");

    assert_eq!(v["models"], serde_json::json!([MODEL]));
    let e = &v["errors"];
    assert_eq!(
        (
            e["context"]["status"].as_i64(),
            e["context"]["code"].as_str()
        ),
        (Some(400), Some("context_length_exceeded"))
    );
    assert!(e["context"]["message"]
        .as_str()
        .unwrap()
        .contains("max_tokens (100000)"));
    assert_eq!(e["auth"]["status"], 401);
    assert_eq!(
        (&e["top_logprobs"]["status"], &e["top_logprobs"]["param"]),
        (&serde_json::json!(400), &serde_json::json!("top_logprobs"))
    );

    assert_eq!(
        (&e["n"]["status"], &e["n"]["param"]),
        (&serde_json::json!(400), &serde_json::json!("n"))
    );

    // Log probabilities as the SDK parses them: greedy tokens are the most likely,
    // their text is the content, the stream carries the same entries.
    let lc = &v["chat_logprobs"];
    let entries = lc["entries"].as_array().unwrap();
    assert!(!entries.is_empty());
    let joined: String = entries
        .iter()
        .map(|e| e["token"].as_str().unwrap())
        .collect();
    assert_eq!(joined, lc["content"].as_str().unwrap());
    for e in entries {
        let top = e["top"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!((&top[0][0], &top[0][1]), (&e["token"], &e["logprob"]));
    }
    assert_eq!(lc["streamed"], lc["entries"]);
    let cl = &v["completion_logprobs"];
    let (p, c) = usage(&cl["usage"]);
    assert_eq!(cl["tokens"].as_array().unwrap().len() as i64, p + c);
    assert!(cl["text"]
        .as_str()
        .unwrap()
        .starts_with("The capital of France is"));
    assert!(cl["token_logprobs"][0].is_null() && cl["token_logprobs"][1].is_f64());
    assert_eq!(cl["text_offset"][0], 0);
    assert_eq!(
        (e["model"]["status"].as_i64(), e["model"]["code"].as_str()),
        (Some(404), Some("model_not_found"))
    );

    // Structured outputs: the SDK's pydantic `parse` got an object of its model
    // (the content validates against the schema pydantic generated), JSON mode an
    // object, and a schema that cannot compile a 400 naming `response_format`.
    let parsed = &v["parsed"];
    assert_eq!(parsed["finish_reason"], "stop", "{parsed}");
    assert!(parsed["pet"]["name"].is_string(), "{parsed}");
    let content: serde_json::Value =
        serde_json::from_str(parsed["content"].as_str().unwrap()).unwrap();
    assert_eq!(content, parsed["pet"]);
    let validator = jsonschema::validator_for(&parsed["schema"]).unwrap();
    assert!(validator.is_valid(&content), "{parsed}");
    let jm: serde_json::Value =
        serde_json::from_str(v["json_mode"]["content"].as_str().unwrap()).unwrap();
    assert!(jm.is_object(), "{jm}");
    assert_eq!(
        (
            &e["response_format"]["status"],
            &e["response_format"]["param"]
        ),
        (
            &serde_json::json!(400),
            &serde_json::json!("response_format")
        )
    );

    // Tools: the SDK's strict pydantic function tool with `required` came back as a
    // call whose arguments the SDK parsed into the model and that validate against
    // its schema; the named call streamed joins into the same shape; the answer as a
    // `tool` message is accepted; a bad `tool_choice` is a 400 naming it.
    let tc = &v["tool_call"];
    assert_eq!(
        (&tc["finish_reason"], &tc["name"]),
        (
            &serde_json::json!("tool_calls"),
            &serde_json::json!("get_weather")
        ),
        "{tc}"
    );
    assert_eq!(tc["parsed"], tc["arguments"], "{tc}");
    let weather = jsonschema::validator_for(&tc["schema"]).unwrap();
    assert!(weather.is_valid(&tc["arguments"]), "{tc}");
    let ts = &v["tool_call_stream"];
    assert_eq!(ts["finish_reason"], "tool_calls", "{ts}");
    assert!(weather.is_valid(&ts["arguments"]), "{ts}");
    assert!(v["tool_answer"]["finish_reason"].is_string());
    assert_eq!(
        (&e["tool_choice"]["status"], &e["tool_choice"]["param"]),
        (&serde_json::json!(400), &serde_json::json!("tool_choice"))
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_self_signed_handshake_and_request() {
    let cfg = GatewayOptions {
        tls: TlsMode::SelfSigned(None),
        ..GatewayOptions::default()
    };
    let s = start_with(cfg).await;
    assert!(s.base.starts_with("https://"));
    let pem = std::fs::read(s.dir.path().join("cert.pem")).unwrap();
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls::pki_types::CertificateDer::pem_slice_iter(&pem) {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(cfg));
    let body = r#"{"prompt":"Hi","max_tokens":3}"#;
    let req = format!(
        "POST /client/v4/accounts/{}/ai/run/{MODEL} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        s.tenant.id,
        s.key,
        body.len()
    );
    let tcp = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    let mut tls = connector.connect(name, tcp).await.expect("TLS handshake");
    assert_eq!(
        tls.get_ref().1.protocol_version(),
        Some(rustls::ProtocolVersion::TLSv1_3)
    );
    tls.write_all(req.as_bytes()).await.unwrap();
    let mut resp = Vec::new();
    let _ = tls.read_to_end(&mut resp).await;
    let resp = String::from_utf8_lossy(&resp);
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("\"success\":true"), "{resp}");
    // A client that does not trust the certificate fails the handshake.
    let untrusting = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .unwrap()
    .with_root_certificates(rustls::RootCertStore::empty())
    .with_no_client_auth();
    // Plain HTTP is refused on a non-loopback address unless allowed.
    let public = GatewayOptions {
        listen: "0.0.0.0:0".parse().unwrap(),
        ..GatewayOptions::default()
    };
    let err = tessera_gateway::Server::bind(&public, s.state.clone())
        .await
        .unwrap_err();
    assert!(
        err.to_string().contains("refusing to serve plain HTTP"),
        "{err}"
    );
    assert!(
        matches!(err, tessera_gateway::StartError::PlainHttp(a) if a == public.listen),
        "{err:?}"
    );
    let allowed = GatewayOptions {
        allow_insecure_http: true,
        ..public
    };
    assert!(tessera_gateway::Server::bind(&allowed, s.state.clone())
        .await
        .is_ok());
    let tcp = tokio::net::TcpStream::connect(s.addr).await.unwrap();
    let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
    assert!(tokio_rustls::TlsConnector::from(Arc::new(untrusting))
        .connect(name, tcp)
        .await
        .is_err());
}
