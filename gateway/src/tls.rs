//! TLS by rustls (ring provider): a certificate and key from PEM files, or a
//! self-signed certificate for `localhost` / `127.0.0.1` made at start (rcgen).

use anyhow::{Context, Result};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::PathBuf;
use std::sync::Arc;

/// How the server terminates TLS.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TlsMode {
    /// Plain HTTP (loopback only unless explicitly allowed).
    #[default]
    Off,
    /// A fresh self-signed certificate for localhost; its PEM is written to the
    /// path, if given, so clients can trust it.
    SelfSigned(Option<PathBuf>),
    /// Certificate chain and private key PEM files.
    Files {
        /// Certificate chain PEM.
        cert: PathBuf,
        /// Private key PEM.
        key: PathBuf,
    },
}

/// A self-signed certificate for `localhost`, `127.0.0.1` and `::1`: (cert PEM, key PEM).
pub fn self_signed() -> Result<(String, String)> {
    let names = vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        "::1".to_string(),
    ];
    let ck = rcgen::generate_simple_self_signed(names)
        .context("generating a self-signed certificate")?;
    Ok((ck.cert.pem(), ck.key_pair.serialize_pem()))
}

fn server_config(cert_pem: &[u8], key_pem: &[u8]) -> Result<rustls::ServerConfig> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .context("reading certificate PEM")?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).context("reading private key PEM")?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(certs, key)?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(cfg)
}

/// The acceptor for `mode`, or `None` for plain HTTP.
pub fn acceptor(mode: &TlsMode) -> Result<Option<tokio_rustls::TlsAcceptor>> {
    let cfg = match mode {
        TlsMode::Off => return Ok(None),
        TlsMode::SelfSigned(out) => {
            let (cert, key) = self_signed()?;
            if let Some(p) = out {
                std::fs::write(p, &cert).with_context(|| format!("writing {}", p.display()))?;
            }
            server_config(cert.as_bytes(), key.as_bytes())?
        }
        TlsMode::Files { cert, key } => {
            let c = std::fs::read(cert).with_context(|| format!("reading {}", cert.display()))?;
            let k = std::fs::read(key).with_context(|| format!("reading {}", key.display()))?;
            server_config(&c, &k)?
        }
    };
    Ok(Some(tokio_rustls::TlsAcceptor::from(Arc::new(cfg))))
}
