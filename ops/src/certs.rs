//! `tessera ops certs init|issue`: the cluster CA of the node links and a certificate
//! for every identity a deployment file lists (rcgen, ECDSA P-256).
//!
//! - `init --ca-dir CA_DIR` writes `CA_DIR/ca.pem` (the CA certificate every node and
//!   gateway trusts) and `CA_DIR/ca.key` (its private key: keep it off the nodes). It
//!   refuses to overwrite an existing CA.
//! - `issue --config FILE --ca-dir CA_DIR --dir DIR` signs, with `CA_DIR/ca.key`, one
//!   certificate and key per [`LinkIdentity`] of the file (the gateway, then every
//!   prefill and decode node) and writes them as `DIR/<stem>.pem` and
//!   `DIR/<stem>.key`, the names `[node_links] cert_dir` is read with
//!   ([`LinkIdentity::file_stem`]), plus a copy of the CA certificate as
//!   `DIR/ca.pem`: DIR is what the nodes are given (`[node_links] ca = "DIR/ca.pem"`,
//!   `cert_dir = "DIR"`), and it never holds `ca.key`. Each certificate carries its
//!   identity's name ([`LinkIdentity::name`]) as DNS subject alternative name and
//!   common name, and allows TLS server and client authentication.
//!
//! Secrets are created with their final modes ([`tessera_config::secret_files`]):
//! missing directories `0700`, keys `0600` (`ca.key` with `O_EXCL`; an identity's key
//! through a fresh file renamed into place, never written through what is there).
//! Re-issuing replaces an identity's key and certificate; the CA stays.

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType, SerialNumber,
};
use std::path::{Path, PathBuf};
use tessera_config::secret_files::{
    check_key_dir_mode, check_private_key_mode, create_private_dir, create_secret_file,
    replace_file, SECRET_FILE_MODE,
};
use tessera_config::{DeploymentConfig, LinkIdentity};
use time::{Duration, OffsetDateTime};

/// The CA certificate's file name, in the CA directory and in the node files'.
pub const CA_CERT: &str = "ca.pem";
/// The CA key's file name, in the CA directory only.
pub const CA_KEY: &str = tessera_config::node_links::CA_KEY_FILE;
/// Mode of certificates (public).
const CERT_MODE: u32 = 0o644;
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
    /// The directories would expose a secret: the node files' directory is the CA's,
    /// holds a `ca.key`, or group or others can write it.
    #[error("{0}")]
    Exposed(String),
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

/// Writes `text` to `path` through a fresh file renamed into place: with `secret`
/// mode `0600` from its creation, else `0644`.
fn write(path: &Path, text: &str, secret: bool) -> Result<(), CertsError> {
    let mode = if secret { SECRET_FILE_MODE } else { CERT_MODE };
    replace_file(path, text.as_bytes(), mode).map_err(io(path))
}

/// Creates `dir` (`0700`) when missing; an existing one must not be writable by
/// group or others.
fn key_dir(dir: &Path) -> Result<(), CertsError> {
    create_private_dir(dir).map_err(io(dir))?;
    check_key_dir_mode(dir).map_err(CertsError::Exposed)
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

/// `init`: writes a fresh CA into `ca_dir` (created `0700` if needed; the key
/// `0600`, `O_EXCL`). Returns the paths of the certificate and the key.
///
/// Errors: a CA is already there, `ca_dir` is writable by group or others, or a
/// file cannot be written.
pub fn init(ca_dir: &Path) -> Result<(PathBuf, PathBuf), CertsError> {
    key_dir(ca_dir)?;
    let (cert_path, key_path) = (ca_dir.join(CA_CERT), ca_dir.join(CA_KEY));
    for p in [&cert_path, &key_path] {
        if std::fs::symlink_metadata(p).is_ok() {
            return Err(CertsError::CaExists(p.clone()));
        }
    }
    let key = KeyPair::generate()?;
    let mut params = ca_params();
    validity(&mut params, CA_DAYS);
    let cert = params.self_signed(&key)?;
    create_secret_file(&key_path, key.serialize_pem().as_bytes()).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            CertsError::CaExists(key_path.clone())
        } else {
            io(&key_path)(e)
        }
    })?;
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
/// `ca_dir`, valid for `days`, and writes them and a copy of the CA certificate into
/// `dir` (created `0700` if needed), the directory the nodes are given.
///
/// Errors: `dir` is `ca_dir`, holds it, holds a `ca.key` or is writable by group or
/// others, or the CA key is open to group or others ([`CertsError::Exposed`]); the
/// CA key is missing or unreadable; an identity has
/// no name (a bad node address); a file cannot be written.
pub fn issue(
    config: &DeploymentConfig,
    ca_dir: &Path,
    dir: &Path,
    days: u32,
) -> Result<Vec<Issued>, CertsError> {
    let key_path = ca_dir.join(CA_KEY);
    let pem = std::fs::read_to_string(&key_path).map_err(io(&key_path))?;
    // A CA key others could read may already have issued identities elsewhere.
    check_private_key_mode(&key_path, false).map_err(|reason| {
        CertsError::Exposed(format!(
            "{}: {reason} (and if others may have read it, start over with a new CA)",
            key_path.display()
        ))
    })?;
    let ca_key = KeyPair::from_pem(&pem)
        .map_err(|e| CertsError::Invalid(format!("{}: not a CA key: {e}", key_path.display())))?;
    // The CA's directory is the node files' or lies inside it (DIR/ca/ca.key would
    // travel with DIR to every node).
    let (same, inside) = match (ca_dir.canonicalize(), dir.canonicalize()) {
        (Ok(a), Ok(b)) => (a == b, a != b && a.starts_with(&b)),
        _ => (false, false),
    };
    if inside {
        return Err(CertsError::Exposed(format!(
            "{}: the CA's directory {} lies inside the node files' directory; every node \
             is given it, and whoever holds the CA key can issue any identity: move the CA \
             apart from --dir",
            dir.display(),
            ca_dir.display()
        )));
    }
    if same || std::fs::symlink_metadata(dir.join(CA_KEY)).is_ok() {
        return Err(CertsError::Exposed(format!(
            "{}: the node files' directory {}; every node is given it, and whoever holds \
             the CA key can issue any identity: give --dir a directory apart from \
             --ca-dir {} (and move any ca.key out of it)",
            dir.display(),
            if same {
                "is the CA's directory"
            } else {
                "holds ca.key"
            },
            ca_dir.display()
        )));
    }
    // Created (0700) only once the layout passed: a refusal leaves nothing behind.
    key_dir(dir)?;
    let ca = ca_params().self_signed(&ca_key)?;
    let ca_pem_path = ca_dir.join(CA_CERT);
    let ca_pem = std::fs::read_to_string(&ca_pem_path).map_err(io(&ca_pem_path))?;
    write(&dir.join(CA_CERT), &ca_pem, false)?;
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

    /// A CA in `root/ca` and the node files issued into `root/certs`.
    fn ca_and_certs(root: &Path) -> (PathBuf, PathBuf, Vec<Issued>) {
        let (ca, certs) = (root.join("ca"), root.join("certs"));
        init(&ca).unwrap();
        let issued = issue(&config(), &ca, &certs, 30).unwrap();
        (ca, certs, issued)
    }

    #[test]
    fn issued_files_load_and_check_for_every_identity() {
        let root = tempfile::tempdir().unwrap();
        let (ca_dir, certs, issued) = ca_and_certs(root.path());
        let dir = certs.as_path();
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
        let links = links(dir);
        for i in &issued {
            let c = links.load(&i.identity).unwrap();
            assert_eq!(c.name, i.name);
            assert_eq!(c.chain.len(), 1);
        }
        // The nodes' directory holds the CA certificate, never its key.
        assert_eq!(
            std::fs::read(dir.join(CA_CERT)).unwrap(),
            std::fs::read(ca_dir.join(CA_CERT)).unwrap()
        );
        assert!(!dir.join(CA_KEY).exists());
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode(&issued[0].key), 0o600);
            assert_eq!(mode(&ca_dir.join(CA_KEY)), 0o600);
            assert_eq!(mode(&ca_dir), 0o700);
            assert_eq!(mode(dir), 0o700);
        }
    }

    #[test]
    fn init_refuses_to_replace_a_ca() {
        let dir = tempfile::tempdir().unwrap();
        init(dir.path()).unwrap();
        assert!(matches!(init(dir.path()), Err(CertsError::CaExists(_))));
    }

    /// Node files are never written into the CA's directory, nor next to a `ca.key`.
    #[test]
    fn issue_keeps_the_ca_key_out_of_the_node_files() {
        let root = tempfile::tempdir().unwrap();
        let ca = root.path().join("ca");
        init(&ca).unwrap();
        let e = issue(&config(), &ca, &ca, 30).unwrap_err();
        assert!(matches!(e, CertsError::Exposed(_)), "{e:?}");
        assert!(e.to_string().contains("apart from --ca-dir"), "{e}");
        assert!(!ca.join("gateway.key").exists());
        let certs = root.path().join("certs");
        std::fs::create_dir(&certs).unwrap();
        std::fs::copy(ca.join(CA_KEY), certs.join(CA_KEY)).unwrap();
        let e = issue(&config(), &ca, &certs, 30).unwrap_err();
        assert!(e.to_string().contains("holds ca.key"), "{e}");
        // Issue 32 review: a CA directory inside the node files' one was accepted.
        let nested = root.path().join("nodes");
        std::fs::create_dir(&nested).unwrap();
        init(&nested.join("ca")).unwrap();
        let e = issue(&config(), &nested.join("ca"), &nested, 30).unwrap_err();
        assert!(e.to_string().contains("lies inside the node files"), "{e}");
        assert!(!nested.join("gateway.key").exists());
    }

    /// Issue 32 review: `issue` signed with a `ca.key` every local user could read.
    #[cfg(unix)]
    #[test]
    fn issue_refuses_a_ca_key_others_can_read() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let (ca, certs) = (root.path().join("ca"), root.path().join("certs"));
        init(&ca).unwrap();
        let key = ca.join(CA_KEY);
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        let e = issue(&config(), &ca, &certs, 30).unwrap_err();
        assert!(matches!(e, CertsError::Exposed(_)), "{e:?}");
        assert!(e.to_string().contains("chmod 600"), "{e}");
        assert!(
            !certs.exists(),
            "a refused issue leaves no directory behind"
        );
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
        issue(&config(), &ca, &certs, 30).unwrap();
    }

    /// A symlink planted where a key will be written is replaced, not written through
    /// (the old code followed it: the key landed wherever the link pointed), and a
    /// planted `ca.key` stops `init`.
    #[cfg(unix)]
    #[test]
    fn keys_are_never_written_through_a_planted_symlink() {
        let root = tempfile::tempdir().unwrap();
        let (ca, certs) = (root.path().join("ca"), root.path().join("certs"));
        create_private_dir(&certs).unwrap();
        let stolen = root.path().join("stolen.key");
        std::os::unix::fs::symlink(&stolen, certs.join("gateway.key")).unwrap();
        init(&ca).unwrap();
        issue(&config(), &ca, &certs, 30).unwrap();
        assert!(!stolen.exists(), "the key was written through the symlink");
        let meta = std::fs::symlink_metadata(certs.join("gateway.key")).unwrap();
        assert!(meta.file_type().is_file());
        let other = root.path().join("other-ca");
        create_private_dir(&other).unwrap();
        std::os::unix::fs::symlink(&stolen, other.join(CA_KEY)).unwrap();
        assert!(matches!(init(&other), Err(CertsError::CaExists(_))));
        assert!(!stolen.exists());
    }

    /// A key that group or others can read, a node directory they can write, and a
    /// `ca.key` among the node files: each refused by [`NodeLinksConfig::load`] (what
    /// a node runs at start and `check-config` for every identity), naming the fix.
    #[cfg(unix)]
    #[test]
    fn exposed_node_files_are_refused_with_the_fix() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let (ca_dir, certs, issued) = ca_and_certs(root.path());
        let links = links(&certs);
        let gw = &issued[0];
        let chmod = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        chmod(&gw.key, 0o644);
        let e = links.load(&gw.identity).unwrap_err();
        assert!(matches!(e, LinkFileError::Exposed { .. }), "{e:?}");
        assert!(
            e.to_string()
                .contains(&format!("run `chmod 600 {}`", gw.key.display())),
            "{e}"
        );
        // Group-readable passes only where the file allows it (Kubernetes fsGroup).
        chmod(&gw.key, 0o440);
        assert!(links.load(&gw.identity).is_err());
        let k8s = NodeLinksConfig {
            allow_group_readable_keys: true,
            ..links.clone()
        };
        k8s.load(&gw.identity).unwrap();
        chmod(&gw.key, 0o444);
        assert!(k8s.load(&gw.identity).is_err());
        chmod(&gw.key, 0o600);
        links.load(&gw.identity).unwrap();
        chmod(&certs, 0o777);
        let e = links.load(&gw.identity).unwrap_err();
        assert!(e.to_string().contains("chmod 700"), "{e}");
        chmod(&certs, 0o700);
        std::fs::copy(ca_dir.join(CA_KEY), certs.join(CA_KEY)).unwrap();
        let e = links.load(&gw.identity).unwrap_err();
        assert_eq!(e.path(), Some(certs.join(CA_KEY).as_path()));
    }

    #[test]
    fn a_certificate_of_another_identity_or_ca_or_key_is_refused() {
        let (ra, rb) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let (_, a, ia) = ca_and_certs(ra.path());
        let (_, b, _) = ca_and_certs(rb.path());
        let links = links(&a);
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
        std::fs::copy(b.join("decode-127.0.0.1-9201.pem"), &decode.cert).unwrap();
        std::fs::copy(b.join("decode-127.0.0.1-9201.key"), &decode.key).unwrap();
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
