//! One prefill node and two decode nodes behind a `tessera serve --config` gateway
//! ([`TwoDecodes`]), for the tests that stop, freeze or drain one decode node while
//! the other serves (`node_loss.rs`).

use super::{
    free_port, start_config_gateway, start_node, start_node_with, write_config_with, Gateway,
    CONTEXT,
};
use tokio::process::Child;

/// The gateway's `/metrics` token.
pub const METRICS_TOKEN: &str = "metrics-node-loss-3f9c2a7e5b1d4c8a";

/// One prefill node and two decode nodes behind a `tessera serve --config` gateway
/// (its `/metrics` read with [`METRICS_TOKEN`]); every process is killed when this
/// is dropped. Keep it whole and borrow its fields (`let gw = &dep.gw;`): a
/// `Child` moved out of it and dropped is killed at once.
pub struct TwoDecodes {
    /// Decode node 0 (routing's tie-break goes to it).
    pub decode0: Child,
    pub decode1: Child,
    pub prefill: Child,
    pub gw: Gateway,
    /// Last, so that it is removed after the processes are killed (fields drop in
    /// order).
    pub dir: tempfile::TempDir,
}

impl TwoDecodes {
    /// Starts the deployment: `links` is extra `[node_links]` text (e.g. liveness
    /// settings), `decode0_args` extra `tessera node` arguments of decode 0.
    pub async fn start(links: &str, decode0_args: &[&str]) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let (p, d0, d1) = (free_port(), free_port(), free_port());
        let config = write_config_with(
            dir.path(),
            free_port(),
            p,
            &[d0, d1],
            (CONTEXT, CONTEXT),
            Some(links),
        );
        let decode0 = start_node_with(dir.path(), &config, "decode", d0, decode0_args, &[]).await;
        let decode1 = start_node(dir.path(), &config, "decode", d1).await;
        let prefill = start_node(dir.path(), &config, "prefill", p).await;
        let gw = start_config_gateway(
            dir.path(),
            &config,
            "data",
            "gateway.log",
            &["--metrics-token", METRICS_TOKEN],
        )
        .await;
        Self {
            decode0,
            decode1,
            prefill,
            gw,
            dir,
        }
    }
}
