//! Wiring: builds the pool, its monitors, the scheduler, the router and the servers from
//! [`Settings`], and runs them until shutdown.
//!
//! # Concurrency model
//! Background tasks: the health checker, the scraper, the configuration watcher (with a file;
//! it updates the pool's replicas and the feed's node map), the Kubernetes watchers (with
//! `--k8s-service` or `--pool-name`; they update the same) and the readiness reporter; each
//! owns nothing but `Arc`s to shared immutable or lock-free state. Flow control's dispatcher is
//! one more (see [`crate::flowcontrol`]), and so is each peer router's subscription
//! ([`crate::peers`]). The gRPC server (ext_proc +
//! health, plaintext or TLS) and the admin server run side by side. On the shutdown signal the
//! router drains: the readiness reporter turns not-serving, after `--drain-delay` the servers
//! stop accepting, open ext_proc streams get `--drain-timeout` to end; the background tasks are
//! aborted when [`serve`] returns.

use std::net::SocketAddr;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;

use thiserror::Error;
use tokio::net::{TcpListener, UnixListener};
use tokio::task::JoinSet;
use tonic_health::ServingStatus;

use crate::admin::{self, AdminState};
use crate::config::{self, Settings};
use crate::discovery::{self, DiscoveryError, DiscoveryMetrics, ModelSource, PoolRef};
use crate::extproc::{ExtProcService, ExtProcSettings};
use crate::feed::{FeedConfig, FeedService};
use crate::flowcontrol::{FlowControl, FlowMetrics, Objectives};
use crate::kvindex::{KvEventSink, KvIndex};
use crate::metrics::Metrics;
use crate::metrics::state::StateCollector;
use crate::models::{self, ModelSettingsError};
use crate::peers::client::PeerContext;
use crate::peers::{self, PeerLoads, PeerMetrics, PeeringService, PickOutbox};
use crate::pool::monitor::{self, HttpProber, ProbeError};
use crate::pool::{CONFIG_SOURCE, Pool, ReplicaSources};
use crate::router::Router;
use crate::scheduler::{PluginResources, ProfileError, Scheduler};
use crate::tls::{ServingTls, TlsIncoming, TlsRefusals};
use crate::tokenize::Tokenizer;

/// How often flow control's dispatcher looks again without being woken: about as often as
/// scrapes and health checks can change a replica's capacity.
const FLOW_CONTROL_TICK: std::time::Duration = std::time::Duration::from_millis(50);

/// HTTP/2 flow-control windows of the ext_proc server: a whole large prompt per stream, many
/// streams per connection.
const GRPC_STREAM_WINDOW: u32 = 16 * 1024 * 1024;
const GRPC_CONNECTION_WINDOW: u32 = 64 * 1024 * 1024;

/// HTTP/2 pings on a quiet connection, and how long the peer has to answer one before the
/// connection is closed: a proxy (or agent) whose host vanished without closing its connections
/// would otherwise keep its streams, and the in-flight counts they hold, for ever.
pub const GRPC_KEEPALIVE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);
pub const GRPC_KEEPALIVE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(20);

/// The tonic server settings of the ext_proc listeners (TCP and Unix socket). BUFFERED bodies
/// arrive as one message: with h2's default 64 KiB stream window a 200 KB prompt would wait for
/// several WINDOW_UPDATE round trips. Envoy's own windows are large. (Public so that the
/// overhead bench's protocol-floor server runs on the same settings.)
pub fn ext_proc_server_settings() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .initial_stream_window_size(Some(GRPC_STREAM_WINDOW))
        .initial_connection_window_size(Some(GRPC_CONNECTION_WINDOW))
        .http2_keepalive_interval(Some(GRPC_KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(GRPC_KEEPALIVE_TIMEOUT))
}

/// The gRPC health service name for the ext_proc service (same as readiness).
pub const EXT_PROC_HEALTH_SERVICE: &str = "envoy.service.ext_proc.v3.ExternalProcessor";

/// The gRPC health services that say whether the router can route: `readiness`, the ext_proc
/// service, and `inference-extension`, which Gateway API Inference Extension's probes and
/// conformance suite ask for.
pub const READINESS_SERVICES: [&str; 3] =
    ["readiness", EXT_PROC_HEALTH_SERVICE, "inference-extension"];

#[derive(Debug, Error)]
pub enum ServeError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot listen on Unix socket {}: {source}", path.display())]
    BindUnix {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot build the HTTP client: {0}")]
    HttpClient(#[from] ProbeError),
    #[error("gRPC server failed: {0}")]
    Grpc(#[from] tonic::transport::Error),
    #[error("admin server failed: {0}")]
    Admin(#[source] std::io::Error),
    #[error(transparent)]
    Models(#[from] ModelSettingsError),
    #[error("TLS: {0}")]
    Tls(#[from] crate::tls::TlsError),
    #[error(transparent)]
    Discovery(#[from] DiscoveryError),
    #[error("scheduling profile: {0}")]
    Profile(#[from] ProfileError),
}

/// The addresses actually bound (useful with port 0).
#[derive(Debug, Clone, Copy)]
pub struct BoundAddrs {
    pub grpc: SocketAddr,
    /// The health-only gRPC listener, when configured.
    pub grpc_health: Option<SocketAddr>,
    pub admin: SocketAddr,
    /// Where agents connect (llmgw.feed.v1).
    pub feed: SocketAddr,
}

/// Runs the router until `shutdown` completes. `on_bound` is called once both listeners are
/// bound.
pub async fn serve(
    settings: Settings,
    shutdown: impl Future<Output = ()> + Send + 'static,
    on_bound: impl FnOnce(BoundAddrs),
) -> Result<(), ServeError> {
    let pool = Arc::new(Pool::new(
        settings.replicas.clone(),
        settings.probes.staleness,
    ));
    let probe = settings.probes;
    let prober = Arc::new(HttpProber::new(probe.timeout)?);
    let mut background = JoinSet::new();
    background.spawn(monitor::run_health_checks(
        Arc::clone(&pool),
        Arc::clone(&prober),
        probe,
    ));
    background.spawn(monitor::run_scrapes(
        Arc::clone(&pool),
        Arc::clone(&prober),
        probe,
    ));
    background.spawn(monitor::run_model_listings(
        Arc::clone(&pool),
        prober,
        probe,
    ));
    // What the scheduler's plugins share: the KV index (fed by agents), the tokenizer and each
    // model's hash settings.
    let index = Arc::new(KvIndex::new(settings.index));
    let tokenizer = Arc::new(models::with_local_tokenizers(
        Tokenizer::new(settings.tokenizer),
        &settings.models,
    )?);
    let picks = Arc::new(PickOutbox::default());
    let resources = PluginResources {
        index: Arc::clone(&index),
        tokenizer: Arc::clone(&tokenizer),
        hashers: Arc::new(models::hashers(&settings.models)?),
        picks: Arc::clone(&picks),
    };

    // Agents feed the index; each node may only speak for its own replicas.
    let nodes = crate::feed::node_map(&settings.replicas);
    let feed = FeedService::new(
        Arc::clone(&index) as Arc<dyn KvEventSink>,
        FeedConfig {
            token: settings.feed.token.clone(),
            nodes,
            grace: settings.feed.grace,
            limits: settings.feed.limits,
            silence: settings.feed.silence,
        },
    )
    .expect_settings(&settings.models)
    .with_token_file(settings.feed.token_file.clone())
    .with_tls(
        settings
            .feed
            .tls
            .as_ref()
            .map(crate::tls::ServerTls::load)
            .transpose()?,
    );

    // The configuration (a reloaded file), each Kubernetes Service and the InferencePool are
    // sources of replicas; their union goes to the pool, and the feed's node map follows it.
    let services = settings.discovery.services.len();
    let sources = {
        let feed = feed.clone();
        let index = Arc::clone(&index);
        Arc::new(ReplicaSources::new(
            Arc::clone(&pool),
            1 + services + usize::from(settings.pool.is_some()),
            move |replicas| {
                if feed.set_nodes(crate::feed::node_map(replicas)) {
                    tracing::info!("agent feed's node map reloaded");
                }
                let present = replicas.iter().map(|r| r.address.to_string()).collect();
                index.pool_changed(&present, tokio::time::Instant::now());
            },
        ))
    };
    if let Some(path) = &settings.config_path {
        background.spawn(config::watch_replicas(
            path.clone(),
            settings.config_poll_interval,
            settings.flag_replicas.clone(),
            Arc::clone(&sources),
        ));
    }
    let discovery_metrics = DiscoveryMetrics::default();
    let objectives = Arc::new(Objectives::new(&settings.flow_control.objectives));
    if services > 0 || settings.pool.is_some() {
        let client = discovery::client(settings.discovery.kubeconfig.as_deref()).await?;
        if services > 0 {
            background.spawn(discovery::endpoint_slices::run(
                client.clone(),
                settings.discovery.services.clone(),
                Arc::clone(&sources),
                CONFIG_SOURCE + 1,
                discovery_metrics.clone(),
            ));
        }
        if let Some(identity) = &settings.pool {
            // The configured models, else each replica's own /v1/models.
            let configured: Vec<String> = settings.models.iter().map(|m| m.model.clone()).collect();
            let models = if configured.is_empty() {
                ModelSource::Discovered(
                    reqwest::Client::builder()
                        .timeout(settings.probes.timeout)
                        .build()
                        .map_err(ProbeError::from)?,
                )
            } else {
                ModelSource::Configured(configured)
            };
            let namespace = match identity.namespace.as_str() {
                "" => client.default_namespace().to_string(),
                given => given.to_string(),
            };
            let pool_ref = PoolRef {
                namespace,
                name: identity.name.clone(),
            };
            background.spawn(discovery::inference_objective::run(
                client.clone(),
                pool_ref.clone(),
                Arc::clone(&objectives),
                discovery_metrics.clone(),
            ));
            background.spawn(discovery::inference_pool::run(
                client,
                pool_ref,
                models,
                Arc::clone(&sources),
                CONFIG_SOURCE + 1 + services,
                discovery_metrics.clone(),
            ));
        }
    }

    let mut metrics = Metrics::new(Arc::clone(&pool));
    if let Some(pool) = &settings.pool {
        metrics.pool_info(&pool.name, &pool.namespace);
    }
    metrics
        .registry_mut()
        .register_collector(Box::new(StateCollector {
            index: Arc::clone(&index),
            tokenizer,
            pool: Arc::clone(&pool),
        }));
    feed.metrics.register(metrics.registry_mut());
    // TLS on ext_proc: the certificate is made or read before anything listens.
    let ext_proc_tls = settings
        .ext_proc_tls
        .as_ref()
        .map(ServingTls::acceptor)
        .transpose()?;
    let ext_proc_tls_refused = TlsRefusals::default();
    if ext_proc_tls.is_some() {
        metrics.registry_mut().register(
            "llmgw_extproc_tls_refused",
            "TLS handshakes refused on the ext_proc port, by reason",
            ext_proc_tls_refused.clone(),
        );
    }
    discovery_metrics.register(metrics.registry_mut());
    let scheduler = Scheduler::build(
        Arc::clone(&pool),
        &settings.scheduler,
        &resources,
        metrics.registry_mut(),
    )?;
    // Peer routers subscribe to this router's picks on the feed port, and it to theirs.
    let router_id = peers::router_id();
    let peer_metrics = PeerMetrics::default();
    peer_metrics.register(metrics.registry_mut());
    let peering = {
        let feed = feed.clone();
        PeeringService::new(
            router_id,
            picks,
            Arc::clone(&pool),
            Arc::new(move |metadata| feed.authorize(metadata, "peer subscription")),
            peer_metrics.clone(),
        )
    };
    let peer_context = PeerContext {
        router_id,
        tls: settings.peers.tls.clone().map(Arc::new),
        token: {
            let feed = feed.clone();
            Arc::new(move || feed.current_token())
        },
        sink: Arc::new(scheduler.pick_listeners()),
        pool: Arc::clone(&pool),
        loads: Arc::new(PeerLoads::new(Arc::clone(&pool))),
        metrics: peer_metrics.clone(),
    };
    for peer in &settings.peers.peers {
        background.spawn(
            peer_context
                .client(peer.url.clone(), peer.endpoint.clone())
                .run(),
        );
    }
    if let Some(service) = settings.peers.service.clone() {
        background.spawn(peers::mesh::follow(
            service,
            peers::mesh::SystemResolver,
            peer_context,
        ));
    }
    let flow_control = settings.flow_control.enabled.then(|| {
        let flow_metrics = FlowMetrics::new(
            metrics.registry_mut(),
            settings.pool.as_ref().map_or("", |p| p.name.as_str()),
        );
        Arc::new(FlowControl::new(
            settings.flow_control.clone(),
            Arc::clone(&objectives),
            scheduler.capacity(),
            flow_metrics,
        ))
    });
    let metrics = Arc::new(metrics);
    let mut router = Router::new(
        scheduler,
        Arc::clone(&metrics),
        settings.allow_test_endpoint_selection,
    );
    if let Some(flow) = &flow_control {
        background.spawn(Arc::clone(flow).run(FLOW_CONTROL_TICK));
        router = router.with_flow_control(Arc::clone(flow));
    }
    let request_headers = router.request_headers();
    let router = Arc::new(router);
    let ext_proc = ExtProcService::new(
        router,
        ExtProcSettings {
            destination_header: settings.destination_header.clone(),
            max_body_bytes: settings.max_body_bytes,
            request_headers,
        },
    )
    .into_server();

    let (health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter
        .set_service_status("liveness", ServingStatus::Serving)
        .await;
    // Not ready until `report_readiness` says so; registered now, so that a probe in between
    // hears NOT_SERVING rather than "service not registered".
    for service in READINESS_SERVICES {
        health_reporter
            .set_service_status(service, ServingStatus::NotServing)
            .await;
    }
    let (draining_tx, draining_rx) = tokio::sync::watch::channel(false);
    background.spawn(report_readiness(
        Arc::clone(&pool),
        FeedSync {
            feed: feed.clone(),
            timeout: settings.feed.sync_timeout,
        },
        health_reporter,
        draining_rx,
    ));

    let grpc_listener = bind(settings.grpc_addr).await?;
    let health_listener = match settings.grpc_health_addr {
        Some(addr) => Some((bind(addr).await?, addr)),
        None => None,
    };
    let uds_listener = settings.grpc_uds.as_deref().map(bind_unix).transpose()?;
    let admin_listener = bind(settings.admin_addr).await?;
    let feed_listener = bind(settings.feed.addr).await?;
    let bound = BoundAddrs {
        grpc: local_addr(&grpc_listener, settings.grpc_addr)?,
        grpc_health: health_listener
            .as_ref()
            .map(|(listener, addr)| local_addr(listener, *addr))
            .transpose()?,
        admin: local_addr(&admin_listener, settings.admin_addr)?,
        feed: local_addr(&feed_listener, settings.feed.addr)?,
    };
    on_bound(bound);
    tracing::info!(
        grpc = %bound.grpc,
        admin = %bound.admin,
        feed = %bound.feed,
        replicas = settings.replicas.len(),
        pool = ?settings.pool,
        ext_proc_tls = settings.ext_proc_tls.is_some(),
        "llmgw-router serving"
    );

    // The drain: not ready first (proxies' health checks and Kubernetes move new streams away),
    // then, after the delay, the listeners stop and open streams get `drain.timeout` to end.
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let drain = settings.drain;
    tokio::spawn(async move {
        shutdown.await;
        tracing::info!(delay = ?drain.delay, timeout = ?drain.timeout, "draining: not ready, then closing the listeners");
        let _ = draining_tx.send(true);
        tokio::time::sleep(drain.delay).await;
        let _ = stop_tx.send(true);
    });
    // Completes `drain.timeout` after the listeners close.
    let drain_deadline = || {
        let mut stop = stop_rx.clone();
        async move {
            let _ = stop.wait_for(|stop| *stop).await;
            tokio::time::sleep(drain.timeout).await;
        }
    };
    let mut grpc_stop = stop_rx.clone();
    let mut admin_stop = stop_rx.clone();
    let mut uds_stop = stop_rx.clone();

    // Kubernetes gRPC probes on their own port: the same health services, nothing else.
    let health_only = health_listener.map(|(listener, _)| {
        let mut stop = stop_rx.clone();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(health_service.clone())
                .serve_with_incoming_shutdown(
                    tonic::transport::server::TcpIncoming::from(listener),
                    async move {
                        let _ = stop.wait_for(|stop| *stop).await;
                    },
                ),
        )
    });

    let ext_proc_server = || {
        ext_proc_server_settings()
            .add_service(health_service.clone())
            .add_service(ext_proc.clone())
    };
    // The same services on the Unix socket, for an Envoy beside the router.
    let uds = uds_listener.map(|(listener, path)| {
        let server = ext_proc_server().serve_with_incoming_shutdown(
            tokio_stream::wrappers::UnixListenerStream::new(listener),
            async move {
                let _ = uds_stop.wait_for(|stop| *stop).await;
            },
        );
        let deadline = drain_deadline();
        let server = async move {
            tokio::select! {
                result = server => result,
                () = deadline => Ok(()),
            }
        };
        (tokio::spawn(server), path)
    });
    // TCP_NODELAY must be set on the accepted sockets here: tonic ignores `Server::tcp_nodelay`
    // for a caller-supplied listener, and with Nagle on, an answer written while an earlier small
    // write (a WINDOW_UPDATE, the header answer) is unacknowledged waits for Envoy's delayed ACK.
    // (The TLS listener sets it too.)
    let grpc_stopped = async move {
        let _ = grpc_stop.wait_for(|stop| *stop).await;
    };
    let grpc: Pin<Box<dyn Future<Output = Result<(), tonic::transport::Error>> + Send>> =
        match ext_proc_tls {
            Some(tls) => Box::pin(ext_proc_server().serve_with_incoming_shutdown(
                TlsIncoming::new("ext_proc", grpc_listener, tls, ext_proc_tls_refused),
                grpc_stopped,
            )),
            None => Box::pin(ext_proc_server().serve_with_incoming_shutdown(
                tonic::transport::server::TcpIncoming::from(grpc_listener).with_nodelay(Some(true)),
                grpc_stopped,
            )),
        };
    let admin_state = Arc::new(AdminState {
        pool,
        metrics,
        scheduler: settings.scheduler.clone(),
        index,
        inference_pool: settings.pool.clone(),
        flow_control,
    });
    let admin = axum::serve(admin_listener, admin::routes(admin_state)).with_graceful_shutdown(
        async move {
            let _ = admin_stop.wait_for(|stop| *stop).await;
        },
    );
    let feed_task = tokio::spawn(
        feed.clone()
            .serve_with_peering(feed_listener, Some(peering.into_server())),
    );
    // Open ext_proc streams (requests in flight) may finish until the drain deadline.
    let grpc = async move {
        tokio::select! {
            result = grpc => result,
            () = drain_deadline() => {
                tracing::warn!(timeout = ?drain.timeout, "drain timeout: ext_proc streams still open are cut");
                Ok(())
            }
        }
    };
    let (grpc_result, admin_result) = tokio::join!(grpc, admin);
    feed.shutdown();
    feed_task.abort();
    background.abort_all();
    if let Some((uds, path)) = uds {
        match uds.await {
            Ok(result) => result?,
            Err(error) => tracing::warn!(%error, "gRPC Unix-socket server task failed"),
        }
        let _ = std::fs::remove_file(&path);
    }
    if let Some(health_only) = health_only {
        match health_only.await {
            Ok(result) => result?,
            Err(error) => tracing::warn!(%error, "gRPC health server task failed"),
        }
    }
    grpc_result?;
    admin_result.map_err(ServeError::Admin)?;
    Ok(())
}

async fn bind(addr: SocketAddr) -> Result<TcpListener, ServeError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ServeError::Bind { addr, source })
}

/// Binds a Unix socket at `path`, first removing a socket file left there by an earlier run (but
/// never a file of another kind).
fn bind_unix(path: &Path) -> Result<(UnixListener, PathBuf), ServeError> {
    let error = |source| ServeError::BindUnix {
        path: path.to_owned(),
        source,
    };
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(error(std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                "a file that is not a socket is in the way",
            )));
        }
        std::fs::remove_file(path).map_err(error)?;
    }
    let listener = UnixListener::bind(path).map_err(error)?;
    Ok((listener, path.to_owned()))
}

fn local_addr(listener: &TcpListener, addr: SocketAddr) -> Result<SocketAddr, ServeError> {
    listener
        .local_addr()
        .map_err(|source| ServeError::Bind { addr, source })
}

/// The start-up wait for the agents' blocks.
struct FeedSync {
    feed: FeedService,
    /// Ready without them after this long.
    timeout: std::time::Duration,
}

/// How often readiness looks at the feed while it waits for the agents' blocks.
const FEED_SYNC_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// Keeps the readiness services in step with the pool: serving while at least one replica is
/// healthy, until the router drains (then not serving for good). At start it also waits until
/// every node its replicas run on has had its agent send all its blocks, or `sync.timeout`
/// passed, so that a new router does not take traffic with an empty index; once passed, that
/// wait never comes back (a lost agent is the feed's grace period's business). Woken by the
/// pool's health announcements and the drain, and polls the feed only while it waits for it.
async fn report_readiness(
    pool: Arc<Pool>,
    sync: FeedSync,
    reporter: tonic_health::server::HealthReporter,
    mut draining: tokio::sync::watch::Receiver<bool>,
) {
    let mut changes = pool.health_changes();
    let mut ready = None;
    let sync_deadline = tokio::time::Instant::now() + sync.timeout;
    let mut synced = false;
    let mut waiting_logged = false;
    loop {
        if *draining.borrow_and_update() {
            for service in READINESS_SERVICES {
                reporter
                    .set_service_status(service, ServingStatus::NotServing)
                    .await;
            }
            return;
        }
        let healthy = pool.snapshot().any_healthy();
        // Asked only once some replica is healthy: by then discovery has told the feed which
        // nodes the replicas run on.
        if !synced && healthy {
            let unsynced = sync.feed.unsynced_nodes();
            if unsynced.is_empty() {
                synced = true;
                if waiting_logged {
                    tracing::info!("every node's agent has sent its blocks");
                }
            } else if tokio::time::Instant::now() >= sync_deadline {
                synced = true;
                tracing::warn!(nodes = ?unsynced, timeout = ?sync.timeout, "ready without these nodes' blocks: their agents did not send them within --feed-sync-timeout");
            } else if !waiting_logged {
                waiting_logged = true;
                tracing::info!(nodes = ?unsynced, timeout = ?sync.timeout, "not ready until these nodes' agents have sent their blocks");
            }
        }
        let now_ready = synced && healthy;
        if ready != Some(now_ready) {
            ready = Some(now_ready);
            let status = if now_ready {
                ServingStatus::Serving
            } else {
                ServingStatus::NotServing
            };
            for service in READINESS_SERVICES {
                reporter.set_service_status(service, status).await;
            }
        }
        tokio::select! {
            // Fails only once the sender is gone, which cannot happen while this task holds
            // the pool.
            changed = changes.changed() => if changed.is_err() {
                return;
            },
            // A dropped sender (serve is returning) changes nothing here.
            _ = draining.changed() => {}
            () = tokio::time::sleep(FEED_SYNC_POLL), if !synced => {}
        }
    }
}

#[cfg(test)]
mod tests;
