//! TLS by rustls (ring provider): a certificate and key from PEM files, or a
//! self-signed certificate for `localhost` / `127.0.0.1` made at start (rcgen).

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::path::PathBuf;
use std::sync::Arc;

/// Why the TLS acceptor could not be built.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A certificate or key file could not be read, or the self-signed
    /// certificate's PEM could not be written.
    #[error("{action} {path}: {source}", path = path.display())]
    File {
        /// `reading` or `writing`.
        action: &'static str,
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A PEM file holds no valid certificate chain or private key.
    #[error("reading {what} PEM: {source}")]
    Pem {
        /// `certificate` or `private key`.
        what: &'static str,
        /// The parser's error.
        source: rustls::pki_types::pem::Error,
    },
    /// rustls refused the certificate and key (e.g. a key that does not match).
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// The self-signed certificate could not be generated.
    #[error("generating a self-signed certificate: {0}")]
    SelfSigned(#[from] rcgen::Error),
}

type Result<T, E = TlsError> = std::result::Result<T, E>;

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
    let ck = rcgen::generate_simple_self_signed(names)?;
    Ok((ck.cert.pem(), ck.key_pair.serialize_pem()))
}

fn server_config(cert_pem: &[u8], key_pem: &[u8]) -> Result<rustls::ServerConfig> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|source| TlsError::Pem {
            what: "certificate",
            source,
        })?;
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(|source| TlsError::Pem {
        what: "private key",
        source,
    })?;
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
                std::fs::write(p, &cert).map_err(|source| TlsError::File {
                    action: "writing",
                    path: p.clone(),
                    source,
                })?;
            }
            server_config(cert.as_bytes(), key.as_bytes())?
        }
        TlsMode::Files { cert, key } => {
            let read = |path: &PathBuf| {
                std::fs::read(path).map_err(|source| TlsError::File {
                    action: "reading",
                    path: path.clone(),
                    source,
                })
            };
            let (c, k) = (read(cert)?, read(key)?);
            server_config(&c, &k)?
        }
    };
    Ok(Some(tokio_rustls::TlsAcceptor::from(Arc::new(cfg))))
}
