//! `[node_links]`: how gateways and nodes authenticate each other on node links
//! (mutual TLS under one cluster CA) and how they tell a dead link from a quiet one.
//!
//! ```toml
//! [node_links]
//! ca = "certs/ca.pem"          # the cluster CA certificate (PEM); its key stays offline
//! cert_dir = "certs"           # one certificate and key per identity, named below
//! # heartbeat_ms = 1000        # a link sends a Ping after this long without a frame
//! # dead_after_ms = 5000       # a link with no frame for this long is dead
//! # min_heartbeat_ms = 50      # heartbeat_ms below this is refused
//! # max_dead_after_ms = 60000  # dead_after_ms above this is refused
//! # allow_group_readable_keys = false  # true only for Kubernetes fsGroup Secret mounts
//! ```
//!
//! Secrets. `cert_dir` is what every node is given, so it must not hold the CA's
//! key (`ca.key`: whoever has it can issue any identity; `tessera ops certs init
//! --ca-dir` keeps it in a directory of its own). Group and others must not be able
//! to read a private key in it (`chmod 600`) nor write the directory (`chmod 700`);
//! [`NodeLinksConfig::load`] refuses otherwise, naming the file and the fix.
//!
//! Identities. Every gateway and every node listed in a `prefill` or `decode` pool has
//! one ([`LinkIdentity`]); its certificate carries the identity's name
//! ([`LinkIdentity::name`]) as its only DNS subject alternative name (and as its
//! common name), and is valid for both TLS server and client authentication:
//!
//! | identity | name | files in `cert_dir` |
//! |---|---|---|
//! | the gateway(s) | `gateway.tessera` | `gateway.pem`, `gateway.key` |
//! | node `10.0.0.2:9201` of a decode pool | `decode-9201.10.0.0.2.tessera` | `decode-10.0.0.2-9201.pem`, `.key` |
//! | node `pf-a.internal:9101` of a prefill pool | `prefill-9101.pf-a.internal.tessera` | `prefill-pf-a.internal-9101.pem`, `.key` |
//! | node `[fd00::2]:9201` | `decode-9201.ip6-fd00-0-0-0-0-0-0-2.tessera` | `decode-ip6-fd00-0-0-0-0-0-0-2-9201.pem`, `.key` |
//!
//! `tessera ops certs init` writes the CA, `tessera ops certs issue` every identity's
//! files; [`NodeLinksConfig::load`] reads one identity's files and checks them (the
//! certificate chains to the CA, carries the identity's name, is valid now for both
//! uses, and matches the key), which is what a node does at start and what
//! `tessera ops check-config` does for every identity.

use crate::{check_host_port, NodeRole};
use rustls::client::danger::ServerCertVerifier;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use serde::Deserialize;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Default `heartbeat_ms`.
pub const DEFAULT_HEARTBEAT_MS: u64 = 1000;
/// Default `dead_after_ms`.
pub const DEFAULT_DEAD_AFTER_MS: u64 = 5000;
/// Default `min_heartbeat_ms`: a shorter heartbeat only loads the links.
pub const DEFAULT_MIN_HEARTBEAT_MS: u64 = 50;
/// Default `max_dead_after_ms`: a dead node holds its requests at most this long.
pub const DEFAULT_MAX_DEAD_AFTER_MS: u64 = 60_000;
/// The CA key's file name, which must not be in `cert_dir`.
pub const CA_KEY_FILE: &str = "ca.key";
/// The last label of every identity name.
pub const IDENTITY_DOMAIN: &str = "tessera";

fn default_heartbeat_ms() -> u64 {
    DEFAULT_HEARTBEAT_MS
}

fn default_dead_after_ms() -> u64 {
    DEFAULT_DEAD_AFTER_MS
}

fn default_min_heartbeat_ms() -> u64 {
    DEFAULT_MIN_HEARTBEAT_MS
}

fn default_max_dead_after_ms() -> u64 {
    DEFAULT_MAX_DEAD_AFTER_MS
}

/// `[node_links]` (optional; absent: no TLS files and the default liveness timings).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NodeLinksConfig {
    /// The cluster CA certificate (PEM). With `cert_dir`, node links use mutual TLS;
    /// without both, nodes and gateways start only with `--insecure-node-links`, and
    /// only on loopback.
    #[serde(default)]
    pub ca: Option<PathBuf>,
    /// Directory holding `<stem>.pem` (certificate chain) and `<stem>.key` (private
    /// key) for every identity ([`LinkIdentity::file_stem`]).
    #[serde(default)]
    pub cert_dir: Option<PathBuf>,
    /// Milliseconds without an outgoing frame after which a link sends a `Ping`.
    #[serde(default = "default_heartbeat_ms")]
    pub heartbeat_ms: u64,
    /// Milliseconds without an incoming frame (or with a write that does not
    /// complete) after which a link counts as dead and is closed. Must exceed
    /// `heartbeat_ms`.
    #[serde(default = "default_dead_after_ms")]
    pub dead_after_ms: u64,
    /// Smallest accepted `heartbeat_ms` (default [`DEFAULT_MIN_HEARTBEAT_MS`]).
    #[serde(default = "default_min_heartbeat_ms")]
    pub min_heartbeat_ms: u64,
    /// Largest accepted `dead_after_ms` (default [`DEFAULT_MAX_DEAD_AFTER_MS`]).
    #[serde(default = "default_max_dead_after_ms")]
    pub max_dead_after_ms: u64,
    /// Accept private keys that their group can read (mode `0440`/`0640`): only for
    /// Kubernetes Secret volumes with `fsGroup`, which make every file readable by
    /// the pod's own group. Others may never read a key.
    #[serde(default)]
    pub allow_group_readable_keys: bool,
}

impl Default for NodeLinksConfig {
    fn default() -> Self {
        Self {
            ca: None,
            cert_dir: None,
            heartbeat_ms: DEFAULT_HEARTBEAT_MS,
            dead_after_ms: DEFAULT_DEAD_AFTER_MS,
            min_heartbeat_ms: DEFAULT_MIN_HEARTBEAT_MS,
            max_dead_after_ms: DEFAULT_MAX_DEAD_AFTER_MS,
            allow_group_readable_keys: false,
        }
    }
}

/// Who is at one end of a node link.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LinkIdentity {
    /// A gateway (every gateway of a deployment shares this identity).
    Gateway,
    /// A prefill or decode node, by its control address as the deployment file
    /// lists it.
    Node {
        /// The node's pool role.
        role: NodeRole,
        /// Its `host:port` from the pool's `nodes`.
        address: String,
    },
}

/// An address that cannot be turned into an identity name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("node address `{address}` cannot name a link identity: {reason}")]
pub struct BadIdentity {
    /// The address as written.
    pub address: String,
    /// Why.
    pub reason: String,
}

impl LinkIdentity {
    /// (host as DNS labels, port) of a node identity; `None` for the gateway.
    fn host_port(&self) -> Result<Option<(String, u16)>, BadIdentity> {
        let LinkIdentity::Node { address, .. } = self else {
            return Ok(None);
        };
        let bad = |reason: String| BadIdentity {
            address: address.clone(),
            reason,
        };
        check_host_port(address).map_err(bad)?;
        if let Ok(sa) = address.parse::<SocketAddr>() {
            let host = match sa.ip() {
                IpAddr::V4(ip) => ip.to_string(),
                IpAddr::V6(ip) => {
                    let hextets: Vec<String> =
                        ip.segments().iter().map(|s| format!("{s:x}")).collect();
                    format!("ip6-{}", hextets.join("-"))
                }
            };
            return Ok(Some((host, sa.port())));
        }
        let (host, port) = address
            .rsplit_once(':')
            .ok_or_else(|| bad("missing `:port`".into()))?;
        let port = port.parse().map_err(|_| bad("bad port".into()))?;
        Ok(Some((host.to_ascii_lowercase(), port)))
    }

    /// The name its certificate carries: `gateway.tessera`, or
    /// `<role>-<port>.<host>.tessera` for a node (an IPv6 host written as
    /// `ip6-` and its eight hextets joined by `-`).
    ///
    /// Errors: the node address is not `host:port`, or the name would exceed 253
    /// bytes.
    pub fn name(&self) -> Result<String, BadIdentity> {
        let name = match (self, self.host_port()?) {
            (LinkIdentity::Node { role, .. }, Some((host, port))) => {
                format!("{role}-{port}.{host}.{IDENTITY_DOMAIN}")
            }
            _ => format!("gateway.{IDENTITY_DOMAIN}"),
        };
        if name.len() > 253 {
            return Err(BadIdentity {
                address: self.to_string(),
                reason: format!(
                    "its identity name would be {} bytes (at most 253)",
                    name.len()
                ),
            });
        }
        Ok(name)
    }

    /// The file name stem of its certificate (`<stem>.pem`) and key (`<stem>.key`):
    /// `gateway`, or `<role>-<host>-<port>`.
    pub fn file_stem(&self) -> Result<String, BadIdentity> {
        Ok(match (self, self.host_port()?) {
            (LinkIdentity::Node { role, .. }, Some((host, port))) => {
                format!("{role}-{host}-{port}")
            }
            _ => "gateway".to_string(),
        })
    }
}

impl std::fmt::Display for LinkIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkIdentity::Gateway => f.write_str("the gateway"),
            LinkIdentity::Node { role, address } => write!(f, "{role} node {address}"),
        }
    }
}

/// Whether `address` (`host:port`) is on loopback: a loopback IP (`127.0.0.0/8`,
/// `::1`) or the host name `localhost`. No name resolution.
pub fn is_loopback_address(address: &str) -> bool {
    if let Ok(sa) = address.parse::<SocketAddr>() {
        return sa.ip().is_loopback();
    }
    address
        .rsplit_once(':')
        .is_some_and(|(host, _)| host.eq_ignore_ascii_case("localhost"))
}

/// One identity's TLS material, read and checked ([`NodeLinksConfig::load`]).
#[derive(Debug)]
pub struct LinkCredentials {
    /// Whose it is.
    pub identity: LinkIdentity,
    /// [`LinkIdentity::name`].
    pub name: String,
    /// The cluster CA certificate(s), the only trust anchors of node links.
    pub ca: Vec<CertificateDer<'static>>,
    /// The identity's certificate chain, end entity first.
    pub chain: Vec<CertificateDer<'static>>,
    /// Its private key.
    pub key: PrivateKeyDer<'static>,
}

/// Why an identity's TLS files cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LinkFileError {
    /// `[node_links]` sets no `ca` and `cert_dir`.
    #[error("[node_links] names no `ca` and `cert_dir`")]
    NotConfigured,
    /// The identity has no name (bad address).
    #[error(transparent)]
    Identity(#[from] BadIdentity),
    /// A file is missing or unreadable.
    #[error("{path}: {reason}", path = path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// OS error.
        reason: String,
    },
    /// A file is not the PEM it should be.
    #[error("{path}: {reason}", path = path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The certificate does not serve the identity (CA, name, validity, key).
    #[error("{path}: {reason}", path = path.display())]
    Invalid {
        /// The certificate file.
        path: PathBuf,
        /// What the check found.
        reason: String,
    },
    /// A secret is exposed: a private key group or others can read, a key directory
    /// they can write, or the CA key inside `cert_dir`.
    #[error("{path}: {reason}", path = path.display())]
    Exposed {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong and the fix.
        reason: String,
    },
}

impl LinkFileError {
    /// The file the error is about, if any.
    pub fn path(&self) -> Option<&Path> {
        match self {
            LinkFileError::Read { path, .. }
            | LinkFileError::Parse { path, .. }
            | LinkFileError::Invalid { path, .. }
            | LinkFileError::Exposed { path, .. } => Some(path),
            _ => None,
        }
    }
}

fn read(path: &Path) -> Result<Vec<u8>, LinkFileError> {
    std::fs::read(path).map_err(|e| LinkFileError::Read {
        path: path.into(),
        reason: e.to_string(),
    })
}

fn certs_pem(path: &Path) -> Result<Vec<CertificateDer<'static>>, LinkFileError> {
    let parse = |reason: String| LinkFileError::Parse {
        path: path.into(),
        reason,
    };
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&read(path)?)
        .collect::<Result<_, _>>()
        .map_err(|e| parse(format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(parse("holds no certificate".into()));
    }
    Ok(certs)
}

impl NodeLinksConfig {
    /// The CA file and certificate directory, when both are set (mutual TLS).
    pub fn tls_files(&self) -> Option<(&Path, &Path)> {
        Some((self.ca.as_deref()?, self.cert_dir.as_deref()?))
    }

    /// (certificate, key) paths of `id` in `cert_dir`.
    pub fn files_of(&self, id: &LinkIdentity) -> Result<(PathBuf, PathBuf), LinkFileError> {
        let (_, dir) = self.tls_files().ok_or(LinkFileError::NotConfigured)?;
        let stem = id.file_stem()?;
        Ok((
            dir.join(format!("{stem}.pem")),
            dir.join(format!("{stem}.key")),
        ))
    }

    /// Checks `cert_dir` itself: it holds no `ca.key` (every node is given this
    /// directory) and group and others cannot write it (a sticky directory passes).
    /// A missing directory passes here; reading its files reports it.
    ///
    /// Errors: [`LinkFileError::Exposed`] naming the path and the fix.
    pub fn check_cert_dir(&self) -> Result<(), LinkFileError> {
        let (_, dir) = self.tls_files().ok_or(LinkFileError::NotConfigured)?;
        let ca_key = dir.join(CA_KEY_FILE);
        if std::fs::symlink_metadata(&ca_key).is_ok() {
            return Err(LinkFileError::Exposed {
                path: ca_key,
                reason: "the CA's private key is in [node_links] cert_dir, which every node \
                         is given: whoever holds it can issue any identity. Keep it off the \
                         nodes, apart from the certificates (`tessera ops certs init --ca-dir \
                         DIR`, `tessera ops certs issue --ca-dir DIR --dir CERT_DIR`), and \
                         remove it here"
                    .into(),
            });
        }
        if !dir.is_dir() {
            return Ok(());
        }
        crate::secret_files::check_key_dir_mode(dir).map_err(|reason| LinkFileError::Exposed {
            path: dir.into(),
            reason,
        })
    }

    /// Reads `id`'s certificate and key and the CA, and checks them: `cert_dir`
    /// passes [`Self::check_cert_dir`], the key is its owner's alone (`0600`, or
    /// group-readable with `allow_group_readable_keys`), the chain leads to the CA,
    /// the end-entity certificate carries `id`'s name, is valid now for TLS server
    /// and client authentication, and its public key is the key's.
    ///
    /// Errors: [`LinkFileError`] naming the file and what is wrong with it.
    pub fn load(&self, id: &LinkIdentity) -> Result<LinkCredentials, LinkFileError> {
        self.check_cert_dir()?;
        self.load_files(id)
    }

    /// [`Self::load`] without the `cert_dir` check (done once for all identities).
    pub(crate) fn load_files(&self, id: &LinkIdentity) -> Result<LinkCredentials, LinkFileError> {
        let (ca_path, _) = self.tls_files().ok_or(LinkFileError::NotConfigured)?;
        let name = id.name()?;
        let (cert_path, key_path) = self.files_of(id)?;
        let ca = certs_pem(ca_path)?;
        let chain = certs_pem(&cert_path)?;
        let key_bytes = read(&key_path)?;
        crate::secret_files::check_private_key_mode(&key_path, self.allow_group_readable_keys)
            .map_err(|reason| LinkFileError::Exposed {
                path: key_path.clone(),
                reason,
            })?;
        let key = PrivateKeyDer::from_pem_slice(&key_bytes).map_err(|e| LinkFileError::Parse {
            path: key_path.clone(),
            reason: format!("not a PEM private key: {e}"),
        })?;
        let invalid = |path: &Path, reason: String| LinkFileError::Invalid {
            path: path.into(),
            reason,
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        for c in &ca {
            roots
                .add(c.clone())
                .map_err(|e| invalid(ca_path, format!("not a usable CA certificate: {e}")))?;
        }
        let roots = Arc::new(roots);
        let server = name_of(&name).map_err(|r| invalid(&cert_path, r))?;
        let now = UnixTime::now();
        rustls::client::WebPkiServerVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        )
        .build()
        .map_err(|e| invalid(ca_path, e.to_string()))?
        .verify_server_cert(&chain[0], &chain[1..], &server, &[], now)
        .map_err(|e| {
            invalid(
                &cert_path,
                format!(
                    "not a certificate of {id} ({name}) from the CA {}: {e}",
                    ca_path.display()
                ),
            )
        })?;
        rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
            .build()
            .map_err(|e| invalid(ca_path, e.to_string()))?
            .verify_client_cert(&chain[0], &chain[1..], now)
            .map_err(|e| {
                invalid(
                    &cert_path,
                    format!("not valid for TLS client authentication: {e}"),
                )
            })?;
        rustls::sign::CertifiedKey::from_der(chain.clone(), key.clone_key(), &provider).map_err(
            |e| {
                invalid(
                    &key_path,
                    format!("does not belong to {}: {e}", cert_path.display()),
                )
            },
        )?;
        Ok(LinkCredentials {
            identity: id.clone(),
            name,
            ca,
            chain,
            key,
        })
    }
}

/// `name` as a TLS server name (a DNS name).
pub fn name_of(name: &str) -> Result<ServerName<'static>, String> {
    ServerName::try_from(name.to_string()).map_err(|e| format!("`{name}` is not a DNS name: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(role: NodeRole, address: &str) -> LinkIdentity {
        LinkIdentity::Node {
            role,
            address: address.into(),
        }
    }

    #[test]
    fn identity_names_and_file_stems_follow_the_documented_rule() {
        let cases = [
            (
                node(NodeRole::Decode, "10.0.0.2:9201"),
                "decode-9201.10.0.0.2.tessera",
                "decode-10.0.0.2-9201",
            ),
            (
                node(NodeRole::Prefill, "PF-A.internal:9101"),
                "prefill-9101.pf-a.internal.tessera",
                "prefill-pf-a.internal-9101",
            ),
            (
                node(NodeRole::Decode, "[fd00::2]:9201"),
                "decode-9201.ip6-fd00-0-0-0-0-0-0-2.tessera",
                "decode-ip6-fd00-0-0-0-0-0-0-2-9201",
            ),
            (LinkIdentity::Gateway, "gateway.tessera", "gateway"),
        ];
        for (id, name, stem) in cases {
            assert_eq!(id.name().unwrap(), name);
            assert_eq!(id.file_stem().unwrap(), stem);
            // Every name is a DNS name a TLS client can ask for.
            name_of(name).unwrap();
        }
        // Same host, other port or role: other identities.
        let a = node(NodeRole::Decode, "127.0.0.1:1").name().unwrap();
        let b = node(NodeRole::Decode, "127.0.0.1:2").name().unwrap();
        let c = node(NodeRole::Prefill, "127.0.0.1:1").name().unwrap();
        assert!(a != b && a != c && b != c);
        let err = node(NodeRole::Decode, "nohost").name().unwrap_err();
        assert_eq!(err.address, "nohost");
    }

    #[test]
    fn loopback_addresses() {
        for a in [
            "127.0.0.1:1",
            "127.9.9.9:80",
            "[::1]:5",
            "localhost:9",
            "LOCALHOST:9",
        ] {
            assert!(is_loopback_address(a), "{a}");
        }
        for a in [
            "10.0.0.2:1",
            "0.0.0.0:1",
            "[::]:1",
            "node-a:9",
            "localhost.evil:9",
        ] {
            assert!(!is_loopback_address(a), "{a}");
        }
    }

    #[test]
    fn unconfigured_tls_is_named() {
        let cfg = NodeLinksConfig::default();
        assert_eq!(
            cfg.load(&LinkIdentity::Gateway).unwrap_err(),
            LinkFileError::NotConfigured
        );
    }

    /// `cert_dir` holding `ca.key`, or writable by group or others, is refused
    /// before any file is read, naming the path and the fix.
    #[cfg(unix)]
    #[test]
    fn a_cert_dir_with_the_ca_key_or_open_to_writers_is_refused() {
        use std::os::unix::fs::PermissionsExt;
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("certs");
        crate::secret_files::create_private_dir(&dir).unwrap();
        let cfg = NodeLinksConfig {
            ca: Some(dir.join("ca.pem")),
            cert_dir: Some(dir.clone()),
            ..NodeLinksConfig::default()
        };
        cfg.check_cert_dir().unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = cfg.load(&LinkIdentity::Gateway).unwrap_err();
        assert!(matches!(e, LinkFileError::Exposed { .. }), "{e:?}");
        assert_eq!(e.path(), Some(dir.as_path()));
        assert!(
            e.to_string()
                .contains(&format!("run `chmod 700 {}`", dir.display())),
            "{e}"
        );
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let ca_key = dir.join(CA_KEY_FILE);
        crate::secret_files::create_secret_file(&ca_key, b"k").unwrap();
        let e = cfg.load(&LinkIdentity::Gateway).unwrap_err();
        assert_eq!(e.path(), Some(ca_key.as_path()));
        assert!(e.to_string().contains("--ca-dir"), "{e}");
    }

    #[test]
    fn missing_files_name_the_path() {
        let cfg = NodeLinksConfig {
            ca: Some("/nonexistent/tessera/ca.pem".into()),
            cert_dir: Some("/nonexistent/tessera".into()),
            ..NodeLinksConfig::default()
        };
        let e = cfg.load(&LinkIdentity::Gateway).unwrap_err();
        assert_eq!(e.path(), Some(Path::new("/nonexistent/tessera/ca.pem")));
        assert!(matches!(e, LinkFileError::Read { .. }), "{e:?}");
    }
}
