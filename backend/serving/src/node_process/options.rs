//! What `tessera node` runs: its options, the page transport and the test-only
//! panic it may be asked for.

use crate::link_security::NodeLinks;
use std::time::Duration;
use tessera_engine::EngineConfig;
use tessera_transfer::protocol::Role;
/// How page bytes move from prefill to decode nodes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// `Land` frames on the control connection, flush acknowledged.
    Tcp,
    /// UCX one-sided puts into the decode pool, registered with UCX (UCX picks
    /// shared memory, TCP or RDMA verbs; `UCX_TLS` narrows the choice).
    Ucx,
}

/// A deliberate panic for the supervision tests (`TESSERA_TEST_NODE_PANIC`, read
/// once at start by `tessera node`; test-only, never set it in a deployment).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestPanic {
    /// `engine`: the engine thread panics after its first step with a running
    /// request (a decode node: mid-stream).
    Engine,
    /// `connection`: a connection task panics on its first control frame.
    Connection,
}

impl TestPanic {
    /// `engine` or `connection`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "engine" => Some(Self::Engine),
            "connection" => Some(Self::Connection),
            _ => None,
        }
    }
}

/// What `tessera node` runs.
#[derive(Clone, Debug)]
pub struct NodeOptions {
    /// Page transport: a decode node registers its pool for UCX when `Ucx`; a
    /// prefill node uses UCX puts when `Ucx` and the decode node offers a region.
    pub transport: TransportKind,
    /// This node's role: [`Role::Prefill`] or [`Role::Decode`].
    pub role: Role,
    /// Control address to listen on.
    pub listen: String,
    /// Every decode node's control address, in deployment-file order (a prefill
    /// node writes into them; the gateway names them by index).
    pub decode_peers: Vec<String>,
    /// Pool and batch sizes.
    pub engine: EngineConfig,
    /// Authentication and timings of the node links.
    pub links: NodeLinks,
    /// How long a drain lets running requests finish before it ends them.
    pub drain_timeout: Duration,
    /// Test-only fault ([`TestPanic`]).
    #[doc(hidden)]
    pub test_panic: Option<TestPanic>,
    /// Serve `GET /metrics` (plain HTTP, read-only) on this address; `None`: no
    /// metrics listener.
    pub metrics_listen: Option<String>,
}

/// The engine configuration of one of `pool`'s nodes: the pool's page size and pool
/// size, the engine's defaults for everything else.
pub fn pool_engine_config(pool: &tessera_config::PoolConfig) -> EngineConfig {
    EngineConfig {
        page_size: pool.page_size,
        kv_pool_tokens: pool.kv_pool_tokens,
        ..EngineConfig::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pools_default_page_size_is_the_engines() {
        assert_eq!(
            tessera_config::DEFAULT_PAGE_SIZE,
            EngineConfig::default().page_size
        );
        let pool: tessera_config::PoolConfig = toml::from_str(
            r#"name = "p"
               role = "decode"
               kv_pool_tokens = 4096
               nodes = ["h:1"]"#,
        )
        .unwrap();
        let e = pool_engine_config(&pool);
        assert_eq!((e.page_size, e.kv_pool_tokens), (16, 4096));
    }
}
