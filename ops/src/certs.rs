//! `tessera ops certs init|issue`: the cluster CA of the node links and a certificate
//! for every identity a deployment file lists (rcgen, ECDSA P-256).
//!
//! - `init --dir DIR` writes `DIR/ca.pem` (the CA certificate every node and gateway
//!   trusts) and `DIR/ca.key` (its private key, mode 0600: keep it off the nodes).
//!   It refuses to overwrite an existing CA.
//! - `issue --config FILE --dir DIR` signs, with `DIR/ca.key`, one certificate and
//!   key per [`LinkIdentity`] of the file (the gateway, then every prefill and decode
//!   node) and writes them as `DIR/<stem>.pem` and `DIR/<stem>.key` (mode 0600), the
//!   names `[node_links] cert_dir` is read with ([`LinkIdentity::file_stem`]). Each
//!   certificate carries its identity's name ([`LinkIdentity::name`]) as DNS subject
//!   alternative name and common name, and allows TLS server and client
//!   authentication.
//!
//! Re-issuing replaces an identity's key and certificate; the CA stays.

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use std::path::{Path, PathBuf};
use tessera_config::{DeploymentConfig, LinkIdentity};
use time::{Duration, OffsetDateTime};

/// The CA's file names inside the certificate directory.
pub const CA_CERT: &str = "ca.pem";
/// See [`CA_CERT`].
pub const CA_KEY: &str = "ca.key";
/// Default validity of issued certificates, days.
pub const DEFAULT_DAYS: u32 = 365;
/// Validity of the CA, days.
pub const CA_DAYS: u32 = 3650;

/// Why a certificate command failed.
#[derive(Debug, thiserror::Error)]
pub enum CertsError {
    /// `init` found a CA already there.
    #[error("{0} already exists; a new CA would orphan every certificate it issued (remove it first to start over)")]
    CaExists(PathBuf),
    /// A file could not be read or written.
    #[error("{path}: {source}", path = path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
    /// The CA key or an identity could not be used.
    #[error("{0}")]
    Invalid(String),
    /// The deployment file could not be loaded.
    #[error(transparent)]
    Config(#[from] tessera_config::ConfigError),
    /// Certificate generation failed.
    #[error("generating a certificate: {0}")]
    Rcgen(#[from] rcgen::Error),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CertsError + '_ {
    move |source| CertsError::Io {
        path: path.into(),
        source,
    }
}

/// Writes `text` to `path`; with `secret`, readable by the owner only.
fn write(path: &Path, text: &str, secret: bool) -> Result<(), CertsError> {
    std::fs::write(path, text).map_err(io(path))?;
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).map_err(io(path))?;
    }
    #[cfg(not(unix))]
    let _ = secret;
    Ok(())
}

/// The CA's parameters. Deterministic, so `issue` can rebuild the issuer from the
/// key alone (rcgen signs with the issuer's name, key identifier method and key).
fn ca_params() -> CertificateParams {
    let mut p = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::OrganizationName, "Tessera");
    dn.push(DnType::CommonName, "Tessera node-links CA");
    p.distinguished_name = dn;
    p.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    p.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    p
}

fn validity(p: &mut CertificateParams, days: u32) {
    let now = OffsetDateTime::now_utc();
    // An hour of slack for clocks that are a little behind.
    p.not_before = now - Duration::hours(1);
    p.not_after = now + Duration::days(i64::from(days));
}

/// `init`: writes a fresh CA into `dir` (created if needed). Returns the paths of
/// the certificate and the key.
///
/// Errors: a CA is already there, or a file cannot be written.
pub fn init(dir: &Path) -> Result<(PathBuf, PathBuf), CertsError> {
    std::fs::create_dir_all(dir).map_err(io(dir))?;
    let (cert_path, key_path) = (dir.join(CA_CERT), dir.join(CA_KEY));
    for p in [&cert_path, &key_path] {
        if p.exists() {
            return Err(CertsError::CaExists(p.clone()));
        }
    }
    let key = KeyPair::generate()?;
    let mut params = ca_params();
    validity(&mut params, CA_DAYS);
    let cert = params.self_signed(&key)?;
    write(&key_path, &key.serialize_pem(), true)?;
    write(&cert_path, &cert.pem(), false)?;
    Ok((cert_path, key_path))
}

/// One identity's issued files.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Issued {
    /// Whose.
    pub identity: LinkIdentity,
    /// The name the certificate carries.
    pub name: String,
    /// Certificate file.
    pub cert: PathBuf,
    /// Key file.
    pub key: PathBuf,
}

/// `issue`: signs a certificate for every identity of `config` with the CA in
/// `dir`, valid for `days`, and writes them into `dir`.
///
/// Errors: the CA key is missing or unreadable, an identity has no name (a bad
/// node address), a file cannot be written.
pub fn issue(config: &DeploymentConfig, dir: &Path, days: u32) -> Result<Vec<Issued>, CertsError> {
    let key_path = dir.join(CA_KEY);
    let pem = std::fs::read_to_string(&key_path).map_err(io(&key_path))?;
    let ca_key = KeyPair::from_pem(&pem)
        .map_err(|e| CertsError::Invalid(format!("{}: not a CA key: {e}", key_path.display())))?;
    let ca = ca_params().self_signed(&ca_key)?;
    let mut out = Vec::new();
    for identity in config.link_identities() {
        let name = identity
            .name()
            .map_err(|e| CertsError::Invalid(e.to_string()))?;
        let stem = identity
            .file_stem()
            .map_err(|e| CertsError::Invalid(e.to_string()))?;
        let key = KeyPair::generate()?;
        let mut p = CertificateParams::default();
        p.subject_alt_names = vec![SanType::DnsName(name.clone().try_into()?)];
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, "Tessera");
        dn.push(DnType::CommonName, name.as_str());
        p.distinguished_name = dn;
        p.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        p.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        p.serial_number = Some(SerialNumber::from(rand::random::<[u8; 16]>().to_vec()));
        validity(&mut p, days);
        let cert = p.signed_by(&key, &ca, &ca_key)?;
        let (cert_file, key_file) = (
            dir.join(format!("{stem}.pem")),
            dir.join(format!("{stem}.key")),
        );
        write(&key_file, &key.serialize_pem(), true)?;
        write(&cert_file, &cert.pem(), false)?;
        out.push(Issued {
            identity,
            name,
            cert: cert_file,
            key: key_file,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_config::{LinkFileError, NodeLinksConfig};

    fn config() -> DeploymentConfig {
        DeploymentConfig::parse(
            r#"
[gateway]
listen = "127.0.0.1:8787"
[[models]]
id = "m"
path = "/nonexistent/m.gguf"
context = 16
[[pools]]
name = "p"
role = "prefill"
kv_pool_tokens = 16
nodes = ["127.0.0.1:9101"]
[[pools]]
name = "d"
role = "decode"
kv_pool_tokens = 16
nodes = ["127.0.0.1:9201", "[::1]:9202"]
"#,
            Path::new("t.toml"),
        )
        .unwrap()
    }

    fn links(dir: &Path) -> NodeLinksConfig {
        NodeLinksConfig {
            ca: Some(dir.join(CA_CERT)),
            cert_dir: Some(dir.to_path_buf()),
            ..NodeLinksConfig::default()
        }
    }

    #[test]
    fn issued_files_load_and_check_for_every_identity() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path()).unwrap();
        let cfg = config();
        let issued = issue(&cfg, dir.path(), 30).unwrap();
        let stems: Vec<String> = issued
            .iter()
            .map(|i| i.cert.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            stems,
            [
                "gateway.pem",
                "prefill-127.0.0.1-9101.pem",
                "decode-127.0.0.1-9201.pem",
                "decode-ip6-0-0-0-0-0-0-0-1-9202.pem"
            ]
        );
        let links = links(dir.path());
        for i in &issued {
            let c = links.load(&i.identity).unwrap();
            assert_eq!(c.name, i.name);
            assert_eq!(c.chain.len(), 1);
        }
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = std::fs::metadata(&issued[0].key)
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
            let mode = std::fs::metadata(dir.path().join(CA_KEY))
                .unwrap()
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
    }

    #[test]
    fn init_refuses_to_replace_a_ca() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path()).unwrap();
        assert!(matches!(init(dir.path()), Err(CertsError::CaExists(_))));
    }

    #[test]
    fn a_certificate_of_another_identity_or_ca_or_key_is_refused() {
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        init(a.path()).unwrap();
        init(b.path()).unwrap();
        let cfg = config();
        let ia = issue(&cfg, a.path(), 30).unwrap();
        issue(&cfg, b.path(), 30).unwrap();
        let links = links(a.path());
        let expect_invalid = |e: LinkFileError, needle: &str| {
            assert!(matches!(e, LinkFileError::Invalid { .. }), "{e:?}");
            assert!(e.to_string().contains(needle), "{e}");
        };
        // The prefill node's certificate under the gateway's file name.
        std::fs::copy(&ia[1].cert, &ia[0].cert).unwrap();
        std::fs::copy(&ia[1].key, &ia[0].key).unwrap();
        expect_invalid(
            links.load(&LinkIdentity::Gateway).unwrap_err(),
            "gateway.tessera",
        );
        // A certificate from the other CA.
        let decode = &ia[2];
        std::fs::copy(b.path().join("decode-127.0.0.1-9201.pem"), &decode.cert).unwrap();
        std::fs::copy(b.path().join("decode-127.0.0.1-9201.key"), &decode.key).unwrap();
        expect_invalid(links.load(&decode.identity).unwrap_err(), "from the CA");
        // The right certificate with another identity's key.
        let v6 = &ia[3];
        std::fs::copy(&ia[1].key, &v6.key).unwrap();
        expect_invalid(links.load(&v6.identity).unwrap_err(), "does not belong");
        // Not PEM at all.
        std::fs::write(&ia[1].key, "garbage").unwrap();
        assert!(matches!(
            links.load(&ia[1].identity).unwrap_err(),
            LinkFileError::Parse { .. }
        ));
    }
}
