//! Who may be at the other end of a node link, and how that is proven: mutual TLS
//! under the deployment's cluster CA, with each peer's identity (its role and
//! address, carried in its certificate) checked against the deployment file on both
//! ends; or, only when every node is on loopback and only when asked for
//! (`--insecure-node-links`), plain TCP that trusts the peer's `Hello`.
//!
//! - A dialer (gateway -> node, prefill -> decode) asks for the name of the node it
//!   means ([`LinkIdentity::name`]), so a certificate of any other identity fails the
//!   handshake.
//! - An acceptor requires a client certificate from the CA, then [`NodeLinks::authorize`]
//!   checks it against what the peer says it is: `Hello{from: Coordinator}` only from
//!   the gateway identity, `Hello{from: Prefill}` only from a prefill node the file
//!   lists (which gets the UCX region) or another decode node of the same model (a
//!   draining one moving KV: `Land` frames only, no region), nothing else.

use std::collections::HashMap;
use std::io;
use std::sync::{Arc, RwLock};
use std::time::Duration;
use tessera_config::node_links::name_of;
use tessera_config::{
    is_loopback_address, DeploymentConfig, LinkFileError, LinkIdentity, NodeRole,
};
use tessera_transfer::protocol::Role;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

/// Largest frame header accepted by default (control frames: a request body with its
/// prompt ids fits many times over; see [`NodeLinks::with_context`]).
pub const DEFAULT_MAX_HEADER: usize = 1 << 20;
/// Time for a TCP connect.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Time for a TLS handshake.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Timings and size caps every link of a process uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LinkSettings {
    /// Idle time after which a link sends a `Ping` (`heartbeat_ms`).
    pub heartbeat: Duration,
    /// Silence (no frame read) or a stuck write after which a link is closed as dead
    /// (`dead_after_ms`).
    pub dead_after: Duration,
    /// Largest frame header read, bytes; a longer length prefix closes the link
    /// before anything is allocated.
    pub max_header: usize,
}

/// Why a process cannot set up its node links.
#[derive(Debug, thiserror::Error)]
pub enum LinkSetupError {
    /// No `[node_links] ca`/`cert_dir` and no `--insecure-node-links`.
    #[error(
        "node links need mutual TLS, but the deployment file's [node_links] names no `ca` and \
         `cert_dir` (create them with `tessera ops certs init` and `tessera ops certs issue`), \
         or run every node on loopback with --insecure-node-links"
    )]
    NoTls,
    /// `--insecure-node-links` with TLS configured too.
    #[error(
        "--insecure-node-links given, but [node_links] configures mutual TLS; drop one of them"
    )]
    Conflict,
    /// `--insecure-node-links` with an address off loopback.
    #[error(
        "refusing plain node links: {address} is not a loopback address \
         (--insecure-node-links is only allowed when every node and the listen address are \
         on loopback; configure [node_links] ca and cert_dir instead)"
    )]
    NotLoopback {
        /// The first address that is not on loopback.
        address: String,
    },
    /// This process's certificate, key or CA.
    #[error("node links: {0}")]
    Files(#[from] LinkFileError),
    /// rustls refused the material.
    #[error("node links: TLS setup failed: {0}")]
    Tls(String),
}

/// The TLS half of [`NodeLinks`].
#[derive(Clone)]
struct Tls {
    server: Arc<rustls::ServerConfig>,
    client: Arc<rustls::ClientConfig>,
}

/// What [`NodeLinks`] shares between its clones: how links authenticate (TLS or
/// plain), their timings, and whom they accept (the gateway's and prefill nodes'
/// identities, the model's fingerprint).
#[derive(Clone)]
struct LinkPolicy {
    /// `None`: plain TCP (loopback only, checked at construction).
    tls: Option<Tls>,
    settings: LinkSettings,
    /// The gateway identity's name.
    gateway: String,
    /// Identity names of the writers the file lists, each with the node's address
    /// (its name as a request's writer) and role. For a decode node, the prefill
    /// nodes of pools that serve a model its own pool serves, and the other decode
    /// nodes of such pools (they move drained requests' KV). Shared by every clone
    /// of these links, and replaced when the node re-reads its file
    /// ([`NodeLinks::reload_peers`]).
    prefill: Arc<RwLock<HashMap<String, (String, NodeRole)>>>,
    /// The fingerprint (64 hex digits, [`tessera_model::transformer::Transformer::fingerprint`])
    /// of the model this process's links serve ([`NodeLinks::for_model`]): said in
    /// `Hello` and `Welcome`, and a peer that says another one is refused.
    model: Option<String>,
}

/// How this process's node links authenticate, and their timings. Cheap to clone.
#[derive(Clone)]
pub struct NodeLinks(Arc<LinkPolicy>);

impl std::fmt::Debug for NodeLinks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeLinks")
            .field("mutual_tls", &self.0.tls.is_some())
            .field("settings", &self.0.settings)
            .finish()
    }
}

/// A connection's reading and writing halves, TLS or not.
pub(crate) type ReadHalf = Box<dyn AsyncRead + Send + Unpin>;
/// See [`ReadHalf`].
pub(crate) type WriteHalf = Box<dyn AsyncWrite + Send + Unpin>;
/// The peer's end-entity certificate (TLS links).
pub(crate) type PeerCert = Option<rustls::pki_types::CertificateDer<'static>>;

fn node_role(role: Role) -> NodeRole {
    match role {
        Role::Prefill => NodeRole::Prefill,
        _ => NodeRole::Decode,
    }
}

/// The identity name of node `address` of `role` (what a dialer asks for).
pub(crate) fn node_name(role: Role, address: &str) -> io::Result<String> {
    LinkIdentity::Node {
        role: node_role(role),
        address: address.to_string(),
    }
    .name()
    .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
}

impl NodeLinks {
    /// The node links of `me` in deployment `cfg`: mutual TLS from `[node_links]`
    /// (this identity's certificate and key, checked against the CA and the identity's
    /// name), or with `insecure`, plain TCP, allowed only when every node of the file
    /// and `listen` (a node's own address) are on loopback.
    ///
    /// Errors: [`LinkSetupError`], naming the file or the address at fault.
    pub fn from_deployment(
        cfg: &DeploymentConfig,
        me: &LinkIdentity,
        insecure: bool,
        listen: Option<&str>,
    ) -> Result<Self, LinkSetupError> {
        let links = cfg.links();
        let tls = match (links.tls_files(), insecure) {
            (Some(_), true) => return Err(LinkSetupError::Conflict),
            (None, false) => return Err(LinkSetupError::NoTls),
            (None, true) => {
                let nodes = cfg.link_identities().into_iter().filter_map(|i| match i {
                    LinkIdentity::Node { address, .. } => Some(address),
                    LinkIdentity::Gateway => None,
                });
                let all: Vec<String> = nodes.chain(listen.map(str::to_string)).collect();
                if let Some(address) = all.into_iter().find(|a| !is_loopback_address(a)) {
                    return Err(LinkSetupError::NotLoopback { address });
                }
                None
            }
            (Some(_), false) => Some(tls_configs(&links.load(me)?)?),
        };
        Ok(Self(Arc::new(LinkPolicy {
            tls,
            settings: LinkSettings {
                heartbeat: Duration::from_millis(links.heartbeat_ms),
                dead_after: Duration::from_millis(links.dead_after_ms),
                max_header: DEFAULT_MAX_HEADER,
            },
            gateway: LinkIdentity::Gateway
                .name()
                .expect("the gateway identity always has a name"),
            prefill: Arc::new(RwLock::new(prefill_names(cfg, me))),
            model: None,
        })))
    }

    /// Takes the writers a decode node accepts (prefill nodes, and the other decode
    /// nodes) out of `cfg` (a re-read deployment file, SIGHUP on `tessera node`), for
    /// every clone of these links: a node added to the file may connect from now on,
    /// and one removed may not open new links (links already open stay until they
    /// close). Returns how many writer identities are accepted now.
    pub fn reload_peers(&self, cfg: &DeploymentConfig, me: &LinkIdentity) -> usize {
        let names = prefill_names(cfg, me);
        let n = names.len();
        *self.0.prefill.write().unwrap() = names;
        n
    }

    /// The same links for a process (or, at a gateway, a cluster) serving the model
    /// with `fingerprint` ([`tessera_model::transformer::Transformer::fingerprint`], 32 bytes):
    /// its links say so in `Hello` and `Welcome` and refuse a peer that names
    /// another model.
    pub fn for_model(self, fingerprint: [u8; 32]) -> Self {
        let mut policy = (*self.0).clone();
        policy.model = Some(fingerprint_hex(&fingerprint));
        Self(Arc::new(policy))
    }

    /// The model fingerprint these links serve (hex), if set.
    pub(crate) fn model(&self) -> Option<String> {
        self.0.model.clone()
    }

    /// Refuses a peer that serves another model than these links: `theirs` is the
    /// fingerprint the peer said (`None`: a peer that says nothing, accepted).
    pub(crate) fn check_model(&self, theirs: Option<&str>) -> Result<(), String> {
        match (&self.0.model, theirs) {
            (Some(mine), Some(theirs)) if mine != theirs => Err(format!(
                "it serves model {}, this end serves model {} (KV never moves between models)",
                short(theirs),
                short(mine)
            )),
            _ => Ok(()),
        }
    }

    /// The same links with a header cap that fits the control frames of a model with a
    /// `context`-token window (prompt ids as JSON): at least [`DEFAULT_MAX_HEADER`],
    /// else 16 bytes per token.
    pub fn with_context(self, context: usize) -> Self {
        let mut policy = (*self.0).clone();
        policy.settings.max_header = DEFAULT_MAX_HEADER.max(context.saturating_mul(16));
        Self(Arc::new(policy))
    }

    /// Timings and caps.
    pub fn settings(&self) -> LinkSettings {
        self.0.settings
    }

    /// Whether links use mutual TLS (else plain TCP on loopback).
    pub fn is_tls(&self) -> bool {
        self.0.tls.is_some()
    }

    /// Connects to `addr`, expecting the node whose identity name is `peer_name`.
    ///
    /// Errors: no address, connect or handshake failure or timeout, a certificate that
    /// is not `peer_name`'s from the CA.
    pub(crate) async fn dial(
        &self,
        addr: &str,
        peer_name: &str,
    ) -> io::Result<(ReadHalf, WriteHalf)> {
        let tcp = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(addr))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connect timed out"))??;
        tcp.set_nodelay(true)?;
        let Some(tls) = &self.0.tls else {
            let (r, w) = tcp.into_split();
            return Ok((Box::new(r), Box::new(w)));
        };
        let name =
            name_of(peer_name).map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?;
        let connector = tokio_rustls::TlsConnector::from(tls.client.clone());
        let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, connector.connect(name, tcp))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
        let (r, w) = tokio::io::split(stream);
        Ok((Box::new(r), Box::new(w)))
    }

    /// Completes the server side of an accepted connection: the TLS handshake with a
    /// client certificate from the CA (or nothing, on plain links).
    ///
    /// Errors: handshake failure or timeout (no certificate, another CA, plaintext).
    pub(crate) async fn accept(
        &self,
        tcp: TcpStream,
    ) -> io::Result<(ReadHalf, WriteHalf, PeerCert)> {
        tcp.set_nodelay(true)?;
        let Some(tls) = &self.0.tls else {
            let (r, w) = tcp.into_split();
            return Ok((Box::new(r), Box::new(w), None));
        };
        let acceptor = tokio_rustls::TlsAcceptor::from(tls.server.clone());
        let stream = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp))
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
        let cert = stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(|c| c.clone().into_owned());
        let (r, w) = tokio::io::split(stream);
        Ok((Box::new(r), Box::new(w), cert))
    }

    /// Whether the writer at `address` is a decode node (moving a drained request's
    /// KV), not a prefill node: it writes with `Land` frames only and never gets this
    /// node's UCX region (decode nodes hold no rkey of each other's pools).
    pub(crate) fn is_decode_writer(&self, address: &str) -> bool {
        self.0
            .prefill
            .read()
            .unwrap()
            .values()
            .any(|(a, role)| a == address && *role == NodeRole::Decode)
    }

    /// Whether a peer with `cert` may open a link saying `Hello{from, model}` to a
    /// node of role `me`: never when it names another model than this node's
    /// ([`Self::check_model`]); a coordinator only with the gateway identity, a writer
    /// (to a decode node only) only with the identity of a prefill node, or of
    /// another decode node, that the file lists for a pool sharing a model with this
    /// node's. Plain links check only the roles and the model. Returns, for a writer
    /// on a TLS link, the address its certificate proves (the node's name as a
    /// request's writer).
    ///
    /// Errors: why not, for the node's log.
    pub(crate) fn authorize(
        &self,
        cert: &PeerCert,
        from: Role,
        me: Role,
        model: Option<&str>,
    ) -> Result<Option<String>, String> {
        self.check_model(model)?;
        let prefill: HashMap<String, (String, NodeRole)>;
        let allowed: Vec<(&String, Option<&String>)> = match (from, me) {
            (Role::Coordinator, _) => vec![(&self.0.gateway, None)],
            (Role::Prefill, Role::Decode) => {
                prefill = self.0.prefill.read().unwrap().clone();
                prefill.iter().map(|(n, (a, _))| (n, Some(a))).collect()
            }
            _ => return Err(format!("a {me:?} node takes no links from a {from:?} peer")),
        };
        if self.0.tls.is_none() {
            return Ok(None);
        }
        let Some(cert) = cert else {
            return Err("no client certificate".into());
        };
        let parsed = rustls::server::ParsedCertificate::try_from(cert)
            .map_err(|e| format!("unreadable client certificate: {e}"))?;
        let found = allowed.iter().find(|(name, _)| {
            name_of(name).is_ok_and(|n| rustls::client::verify_server_name(&parsed, &n).is_ok())
        });
        if let Some((_, address)) = found {
            Ok(address.cloned())
        } else {
            Err(format!(
                "its certificate is not a {} identity of the deployment",
                match from {
                    Role::Coordinator => "gateway",
                    _ => "writer (prefill or decode node)",
                }
            ))
        }
    }
}

/// A model fingerprint as 64 lowercase hex digits (how links and commits carry it).
pub(crate) fn fingerprint_hex(fp: &[u8; 32]) -> String {
    fp.iter().map(|b| format!("{b:02x}")).collect()
}

/// A fingerprint from 64 hex digits; anything else gives all zeros (which no model
/// has, so the comparison fails).
pub(crate) fn parse_fingerprint(hex: &str) -> [u8; 32] {
    let mut out = [0u8; 32];
    if hex.len() != 64 {
        return out;
    }
    for (i, o) in out.iter_mut().enumerate() {
        match u8::from_str_radix(hex.get(2 * i..2 * i + 2).unwrap_or("zz"), 16) {
            Ok(b) => *o = b,
            Err(_) => return [0; 32],
        }
    }
    out
}

/// The first 12 hex digits of a fingerprint, for messages.
pub(crate) fn short_fingerprint(fp: &[u8; 32]) -> String {
    fingerprint_hex(fp)[..12].to_string()
}

/// [`short_fingerprint`] of a hex fingerprint.
fn short(hex: &str) -> &str {
    hex.get(..12).unwrap_or(hex)
}

/// Identity names (with addresses) of the writers `cfg` lists that node `me` takes
/// writer links from: for a decode node, the prefill nodes of pools sharing a model
/// with its own pool, and the other decode nodes of such pools (which move their
/// drained requests' KV).
fn prefill_names(cfg: &DeploymentConfig, me: &LinkIdentity) -> HashMap<String, (String, NodeRole)> {
    // A decode node takes writers only from prefill pools that share a model
    // with its own pool (KV of one model never lands in another's pages).
    let my_models: Option<Vec<&str>> = match me {
        LinkIdentity::Node {
            role: NodeRole::Decode,
            address,
        } => cfg
            .pools
            .iter()
            .find(|p| p.role == NodeRole::Decode && p.nodes.contains(address))
            .map(|p| cfg.models_served_by(p).map(|m| m.id.as_str()).collect()),
        _ => None,
    };
    let shares_model = |address: &str| {
        my_models.as_ref().is_none_or(|mine| {
            cfg.pools
                .iter()
                .filter(|p| p.nodes.iter().any(|n| n == address))
                .any(|p| {
                    cfg.models_served_by(p)
                        .any(|m| mine.contains(&m.id.as_str()))
                })
        })
    };
    let names = |role: NodeRole| -> HashMap<String, (String, NodeRole)> {
        cfg.link_identities()
            .into_iter()
            .filter_map(|i| match &i {
                LinkIdentity::Node { role: r, address } if *r == role && shares_model(address) => {
                    i.name().ok().map(|n| (n, (address.clone(), role)))
                }
                _ => None,
            })
            .collect()
    };
    let mut writers = names(NodeRole::Prefill);
    // A decode node also takes writes from the other decode nodes of its model: a
    // draining one moves its requests' KV (issue 36).
    if let LinkIdentity::Node {
        role: NodeRole::Decode,
        address,
    } = me
    {
        writers.extend(
            names(NodeRole::Decode)
                .into_iter()
                .filter(|(_, (a, _))| a != address),
        );
    }
    writers
}

/// rustls configurations for one identity: a server that requires client
/// certificates from the CA, a client that presents the identity's certificate and
/// trusts only the CA.
fn tls_configs(c: &tessera_config::LinkCredentials) -> Result<Tls, LinkSetupError> {
    let err = |e: rustls::Error| LinkSetupError::Tls(e.to_string());
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for ca in &c.ca {
        roots.add(ca.clone()).map_err(err)?;
    }
    let roots = Arc::new(roots);
    let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
        roots.clone(),
        provider.clone(),
    )
    .build()
    .map_err(|e| LinkSetupError::Tls(e.to_string()))?;
    let server = rustls::ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(err)?
        .with_client_cert_verifier(verifier)
        .with_single_cert(c.chain.clone(), c.key.clone_key())
        .map_err(err)?;
    let client = rustls::ClientConfig::builder_with_provider(provider)
        .with_protocol_versions(&[&rustls::version::TLS13])
        .map_err(err)?
        .with_root_certificates(roots)
        .with_client_auth_cert(c.chain.clone(), c.key.clone_key())
        .map_err(err)?;
    Ok(Tls {
        server: Arc::new(server),
        client: Arc::new(client),
    })
}
