//! [`EngineHandle`]: the one thing the gateway submits requests to, whatever the
//! deployment shape behind it.

use crate::cache_query::{CacheAnswer, CacheQuery};
use crate::cluster::PdCluster;
use crate::error::ServeError;
use crate::metrics::NodeMetrics;
use crate::node_loop::{run_node, EngineStats, NodeLoop, Shared};
use crate::remote::{RemoteCluster, RemoteNodes};
use crate::stream::{request_channel, ClientSink, RequestStream};
use std::sync::{mpsc, Arc};
use std::time::Instant;
use tessera_engine::{
    AdmissionLimits, Admitted, CachePolicy, Engine, EngineConfig, EngineError, GenerateRequest,
    PdAdmission, Rejection,
};
use tessera_model::kv::{CachePurge, TierPages};
use tessera_model::LoadedModel;

/// A co-located engine's command: an admitted request and its stream.
struct Submit {
    req: Admitted,
    client: ClientSink,
    at: Instant,
}

/// A cloneable handle to the serving engines: one co-located engine on a dedicated
/// thread, prefill and decode engines in this process joined by the KV transfer
/// protocol ([`PdCluster`]), or remote nodes ([`RemoteCluster`]). Callers see the same
/// `submit`, `limits` and `stats` either way.
#[derive(Clone)]
pub struct EngineHandle {
    backend: EngineBackend,
}

/// The engines an [`EngineHandle`] submits to: one co-located engine's thread, an
/// in-process [`PdCluster`], or a [`RemoteCluster`] of nodes.
#[derive(Clone)]
enum EngineBackend {
    Colocated {
        tx: mpsc::Sender<ColocatedCmd>,
        limits: AdmissionLimits,
        shared: Arc<Shared>,
        metrics: Arc<NodeMetrics>,
    },
    Disaggregated(Arc<PdCluster>),
    Remote(Arc<RemoteCluster>),
}

/// A co-located engine thread's command.
// Moved through a channel one at a time; the request is the large variant and the
// common one (boxing it would allocate per request for a rare admin command).
#[allow(clippy::large_enum_variant)]
enum ColocatedCmd {
    /// Queue a request.
    Submit(Submit),
    /// Run on the engine between two steps (a tenant's cache purge).
    WithEngine(Box<dyn FnOnce(&mut Engine) + Send>),
}

/// The co-located engine thread: submits become queued requests.
struct Colocated;

impl NodeLoop for Colocated {
    type Cmd = ColocatedCmd;
    fn on_cmd(&mut self, engine: &mut Engine, cmd: ColocatedCmd) {
        match cmd {
            // The engine owns the stream (and its release guard) from here: the guard
            // is dropped when the request's pages are freed or it is dropped unqueued.
            ColocatedCmd::Submit(s) => engine.enqueue_with_sink(s.req, Box::new(s.client), s.at),
            ColocatedCmd::WithEngine(f) => f(engine),
        }
    }
}

impl EngineHandle {
    /// Starts the engine thread. It exits once every handle is dropped and the
    /// requests it already accepted have finished.
    pub fn spawn(model: &LoadedModel, cfg: EngineConfig) -> Self {
        Self::spawn_in(model, cfg, Arc::new(NodeMetrics::new()), "")
    }

    /// [`Self::spawn`] publishing into `metrics` (shared by every model's engines of
    /// a process) as node `{prefix}colocated-0`.
    pub fn spawn_in(
        model: &LoadedModel,
        cfg: EngineConfig,
        metrics: Arc<NodeMetrics>,
        prefix: &str,
    ) -> Self {
        let mut engine = Engine::new(model.transformer.clone(), model.tokenizer.clone(), cfg);
        let limits = engine.limits();
        let handles = metrics.node(&format!("{prefix}colocated-0"), "colocated");
        engine.set_metrics(handles.engine_metrics());
        let shared = Arc::new(Shared::with_metrics(handles));
        shared.publish(&engine, 0);
        let (tx, rx) = mpsc::channel::<ColocatedCmd>();
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("tessera-engine".into())
            .spawn(move || run_node(engine, Colocated, rx, &sh))
            .expect("spawn engine thread");
        Self {
            backend: EngineBackend::Colocated {
                tx,
                limits,
                shared,
                metrics,
            },
        }
    }

    /// Starts prefill and decode engines in this process ([`PdCluster::spawn`]).
    pub fn spawn_disaggregated(
        model: &LoadedModel,
        prefill: &[EngineConfig],
        decode: &[EngineConfig],
    ) -> Self {
        Self {
            backend: EngineBackend::Disaggregated(Arc::new(PdCluster::spawn(
                model, prefill, decode,
            ))),
        }
    }

    /// [`Self::spawn_disaggregated`] publishing into `metrics` (shared by every
    /// model's engines of a process) under node names `{prefix}prefill-N`,
    /// `{prefix}decode-N` ([`PdCluster::spawn_in`]).
    pub fn spawn_disaggregated_in(
        model: &LoadedModel,
        prefill: &[EngineConfig],
        decode: &[EngineConfig],
        metrics: Arc<NodeMetrics>,
        prefix: &str,
    ) -> Self {
        let c = PdCluster::spawn_in(model, prefill, decode, metrics, prefix);
        Self {
            backend: EngineBackend::Disaggregated(Arc::new(c)),
        }
    }

    /// A handle on a cluster built elsewhere (tests: [`PdCluster::spawn_models`]).
    #[doc(hidden)]
    pub fn from_cluster(cluster: PdCluster) -> Self {
        Self {
            backend: EngineBackend::Disaggregated(Arc::new(cluster)),
        }
    }

    /// Coordinates remote prefill and decode nodes ([`RemoteCluster::connect`]).
    pub fn connect_remote(model: &LoadedModel, nodes: RemoteNodes) -> Self {
        Self {
            backend: EngineBackend::Remote(Arc::new(RemoteCluster::connect(model, nodes))),
        }
    }

    /// [`Self::connect_remote`] publishing the gateway's node-link counters into
    /// `metrics` (shared by every model of a process).
    pub fn connect_remote_in(
        model: &LoadedModel,
        nodes: RemoteNodes,
        metrics: Arc<NodeMetrics>,
    ) -> Self {
        let c = RemoteCluster::connect_in(model, nodes, metrics);
        Self {
            backend: EngineBackend::Remote(Arc::new(c)),
        }
    }

    /// Whether requests can be served now: a remote deployment needs at least one
    /// reachable prefill and one reachable decode node; in-process engines always can.
    pub fn ready(&self) -> bool {
        match &self.backend {
            EngineBackend::Remote(c) => c.ready(),
            _ => true,
        }
    }

    /// The in-process prefill/decode cluster behind this handle, if any.
    pub fn cluster(&self) -> Option<&PdCluster> {
        match &self.backend {
            EngineBackend::Disaggregated(c) => Some(c),
            _ => None,
        }
    }

    /// The remote nodes behind this handle, if any.
    pub fn remote(&self) -> Option<&RemoteCluster> {
        match &self.backend {
            EngineBackend::Remote(c) => Some(c),
            _ => None,
        }
    }

    /// What [`Self::admit`] checks a request against (I1): the context window and
    /// the smallest decode pool for prompt + `max_tokens`, the smallest prefill pool
    /// for the prompt (a co-located engine's one pool is both).
    pub fn admission(&self) -> PdAdmission {
        match &self.backend {
            EngineBackend::Colocated { limits, .. } => PdAdmission {
                limits: *limits,
                prefill_pool_tokens: limits.pool_tokens,
            },
            EngineBackend::Disaggregated(c) => c.admission(),
            EngineBackend::Remote(c) => c.admission(),
        }
    }

    /// The I1 checks of `req` against [`Self::admission`] (pure, nothing allocated):
    /// the proof [`Self::submit`] takes.
    ///
    /// Errors: the [`Rejection`] naming the limit.
    pub fn admit(&self, req: GenerateRequest) -> Result<Admitted, Rejection> {
        self.admission().admit(req)
    }

    /// Queues `req`, admitted by [`Self::admit`] (it is not checked again here; each
    /// prefill and decode node checks I1 against its own pool). `affinity` (a
    /// routing key derived from a session, e.g. Workers AI's `x-session-affinity`
    /// header) sends a session's requests to the same prefill node, where its prompt
    /// prefix is cached; no effect on a co-located engine. The stream yields the
    /// events; cancel or drop it to abort; [`RequestStream::released`] says when
    /// nothing is held any more.
    ///
    /// Errors: a node outage ([`ServeErrorKind::NodeDown`](crate::ServeErrorKind));
    /// a co-located engine's rejection of a request admitted against other limits;
    /// a node's own I1 refusal arrives as an error event.
    pub fn submit(
        &self,
        req: Admitted,
        affinity: Option<u64>,
    ) -> Result<RequestStream, ServeError> {
        let (tx, limits) = match &self.backend {
            EngineBackend::Colocated { tx, limits, .. } => (tx, limits),
            EngineBackend::Disaggregated(c) => return c.submit(req, affinity),
            EngineBackend::Remote(c) => return c.submit(req, affinity),
        };
        // The engine queues what it is given: a proof made against other limits is
        // checked against its own first.
        let req = if req.limits() == *limits {
            req
        } else {
            limits.admit(req.into_request())?
        };
        let (client, stream) = request_channel();
        let at = Instant::now();
        if let Err(mpsc::SendError(ColocatedCmd::Submit(s))) =
            tx.send(ColocatedCmd::Submit(Submit { req, client, at }))
        {
            s.client.fail(ServeError::from(EngineError::Shutdown));
        }
        Ok(stream)
    }

    /// Drops `tenant`'s prefix-cache pages on every engine behind this handle
    /// ([`Engine::purge_tenant_cache`]: unused pages freed now with a new epoch, pages
    /// a running sequence reads poisoned and freed at its end, spilled pages dropped)
    /// and returns the sum once every engine confirmed. Blocks the caller (up to
    /// [`ENGINE_ANSWER_WAIT`](crate::cluster::ENGINE_ANSWER_WAIT) per engine).
    ///
    /// Errors: as [`Self::ask_cache`].
    pub fn purge_tenant_cache(&self, tenant: u64) -> Result<CachePurge, ServeError> {
        self.ask_cache(CacheQuery::Purge { tenant }, |a| match a {
            CacheAnswer::Purged(p) => Some(p),
            _ => None,
        })
        .map(|all| {
            all.into_iter()
                .fold(CachePurge::default(), CachePurge::plus)
        })
    }

    /// Cached pages `tenant` holds on every engine behind this handle, per tier,
    /// summed ([`KvManager::tenant_cache_pages`](tessera_model::kv::KvManager::tenant_cache_pages)).
    /// Blocks the caller like [`Self::purge_tenant_cache`].
    ///
    /// Errors: as [`Self::ask_cache`].
    pub fn tenant_cache_pages(&self, tenant: u64) -> Result<TierPages, ServeError> {
        self.ask_cache(CacheQuery::Report { tenant }, |a| match a {
            CacheAnswer::Report(p) => Some(p),
            _ => None,
        })
        .map(|all| all.into_iter().fold(TierPages::default(), TierPages::plus))
    }

    /// Applies `tenant`'s own cache bounds on every engine behind this handle now
    /// ([`Engine::set_cache_policy`]; the tenant's requests carry them too). Blocks
    /// the caller like [`Self::purge_tenant_cache`].
    ///
    /// Errors: as [`Self::ask_cache`].
    pub fn set_cache_policy(&self, tenant: u64, policy: CachePolicy) -> Result<(), ServeError> {
        self.ask_cache(CacheQuery::SetPolicy { tenant, policy }, |a| {
            matches!(a, CacheAnswer::PolicySet).then_some(())
        })
        .map(|_| ())
    }

    /// Asks `query` of every engine behind this handle (in this process between two
    /// of an engine's steps, on remote nodes over their links) and reads each answer
    /// with `read`.
    ///
    /// Errors: an engine down ([`ServeErrorKind::NodeDown`](crate::ServeErrorKind) or
    /// [`EngineError::Shutdown`]) or late ([`ServeErrorKind::Timeout`](crate::ServeErrorKind)),
    /// or an answer that is not one to `query` ([`ServeErrorKind::Internal`](crate::ServeErrorKind)).
    fn ask_cache<T>(
        &self,
        query: CacheQuery,
        read: impl Fn(CacheAnswer) -> Option<T>,
    ) -> Result<Vec<T>, ServeError> {
        let answers = self.ask_cache_raw(query)?;
        answers
            .into_iter()
            .map(|a| {
                read(a).ok_or_else(|| {
                    ServeError::new(
                        crate::ServeErrorKind::Internal,
                        format!("an engine answered {a:?} to {query:?}"),
                    )
                })
            })
            .collect()
    }

    fn ask_cache_raw(&self, query: CacheQuery) -> Result<Vec<CacheAnswer>, ServeError> {
        let f: crate::cluster::EngineQuery<CacheAnswer> = Arc::new(move |e| query.run(e));
        match &self.backend {
            EngineBackend::Colocated { tx, .. } => {
                let (rtx, rrx) = mpsc::channel();
                let job = ColocatedCmd::WithEngine(Box::new(move |e: &mut Engine| {
                    let _ = rtx.send(f(e));
                }));
                if tx.send(job).is_err() {
                    return Err(ServeError::from(EngineError::Shutdown));
                }
                crate::cluster::collect_answers(&rrx, 1)
            }
            EngineBackend::Disaggregated(c) => c.ask_every_engine(f),
            EngineBackend::Remote(c) => c.ask_cache(query),
        }
    }

    /// [`Self::admit`] then [`Self::submit`] with no session (tools, tests and
    /// benchmarks that hold a request, not a proof).
    ///
    /// Errors: the admission rejection (nothing was allocated anywhere), or as
    /// [`Self::submit`].
    pub fn admit_and_submit(&self, req: GenerateRequest) -> Result<RequestStream, ServeError> {
        self.submit(self.admit(req)?, None)
    }

    /// The metrics of the engines in this process; for remote nodes (each serves
    /// its own on `--metrics-listen`) the gateway's node-link counters.
    pub fn node_metrics(&self) -> Option<&NodeMetrics> {
        match &self.backend {
            EngineBackend::Colocated { metrics, .. } => Some(metrics),
            EngineBackend::Disaggregated(c) => Some(c.metrics()),
            EngineBackend::Remote(c) => Some(c.metrics()),
        }
    }

    /// The limits admission checks against.
    pub fn limits(&self) -> AdmissionLimits {
        match &self.backend {
            EngineBackend::Colocated { limits, .. } => *limits,
            EngineBackend::Disaggregated(c) => c.admission().limits,
            EngineBackend::Remote(c) => c.admission().limits,
        }
    }

    /// Current counters (summed over nodes when disaggregated).
    pub fn stats(&self) -> EngineStats {
        match &self.backend {
            EngineBackend::Colocated { shared, .. } => shared.snapshot(),
            EngineBackend::Disaggregated(c) => c.stats(),
            EngineBackend::Remote(c) => c.stats(),
        }
    }
}
