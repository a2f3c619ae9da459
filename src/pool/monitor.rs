//! Background probing: `/health` for membership, `/metrics` for load.
//!
//! Two tasks per pool, each a loop on its own interval that probes every replica of the current
//! snapshot concurrently and writes the results into the replicas' atomics (see the parent
//! module's concurrency model). A probe never blocks the request path; a slow replica only delays
//! its own result, bounded by the probe timeout.

use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use thiserror::Error;
use tokio::time::{Instant, MissedTickBehavior};
use tracing::{debug, info, warn};

use super::adapters::{AdapterCatalog, ModelCard, fetch_model_cards};
use super::{Health, Pool, Replica, vllm_metrics};

/// How often and how patiently replicas are probed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProbeSettings {
    pub health_interval: Duration,
    pub scrape_interval: Duration,
    /// Per HTTP probe.
    pub timeout: Duration,
    /// A scrape older than this counts as unknown load.
    pub staleness: Duration,
    /// How often each replica's `/v1/models` is asked for its LoRA adapters.
    pub models_interval: Duration,
}

impl Default for ProbeSettings {
    fn default() -> Self {
        ProbeSettings {
            health_interval: Duration::from_secs(1),
            scrape_interval: Duration::from_millis(200),
            timeout: Duration::from_secs(1),
            staleness: Duration::from_secs(2),
            models_interval: Duration::from_secs(10),
        }
    }
}

/// The probes' options: flags (and `LLMGW_*` variables) with the same names as the
/// configuration file's keys. What neither sets is [`ProbeSettings::default`].
#[derive(Debug, Clone, Default, clap::Args, serde::Deserialize)]
#[serde(default)]
pub struct ProbeOptions {
    /// How often each replica's /health is probed (default 1s).
    #[arg(long, env = "LLMGW_HEALTH_INTERVAL", value_parser = crate::duration::parse)]
    #[serde(deserialize_with = "crate::duration::optional")]
    pub health_interval: Option<Duration>,
    /// How often each replica's /metrics is scraped (default 200ms).
    #[arg(long, env = "LLMGW_SCRAPE_INTERVAL", value_parser = crate::duration::parse)]
    #[serde(deserialize_with = "crate::duration::optional")]
    pub scrape_interval: Option<Duration>,
    /// A scrape older than this counts as unknown load (default 2s).
    #[arg(long, env = "LLMGW_METRICS_STALENESS", value_parser = crate::duration::parse)]
    #[serde(deserialize_with = "crate::duration::optional")]
    pub metrics_staleness: Option<Duration>,
    /// Timeout of one health probe or scrape (default 1s). A replica leaves the candidates after
    /// 3 health probes in a row time out, at once when one is refused or answers non-2xx.
    #[arg(long, env = "LLMGW_PROBE_TIMEOUT", value_parser = crate::duration::parse)]
    #[serde(deserialize_with = "crate::duration::optional")]
    pub probe_timeout: Option<Duration>,
    /// How often each replica's /v1/models is asked for its LoRA adapters and their paths
    /// (default 10s).
    #[arg(long, env = "LLMGW_MODELS_INTERVAL", value_parser = crate::duration::parse)]
    #[serde(deserialize_with = "crate::duration::optional")]
    pub models_interval: Option<Duration>,
}

impl ProbeOptions {
    /// These options (the flags) over `file`'s, over the defaults.
    pub fn resolve(&self, file: &ProbeOptions) -> ProbeSettings {
        let default = ProbeSettings::default();
        let pick = |flag: Option<Duration>, key: Option<Duration>, default| {
            flag.or(key).unwrap_or(default)
        };
        ProbeSettings {
            health_interval: pick(
                self.health_interval,
                file.health_interval,
                default.health_interval,
            ),
            scrape_interval: pick(
                self.scrape_interval,
                file.scrape_interval,
                default.scrape_interval,
            ),
            timeout: pick(self.probe_timeout, file.probe_timeout, default.timeout),
            staleness: pick(
                self.metrics_staleness,
                file.metrics_staleness,
                default.staleness,
            ),
            models_interval: pick(
                self.models_interval,
                file.models_interval,
                default.models_interval,
            ),
        }
    }
}

/// Something that can probe a replica over HTTP. The real one is [`HttpProber`]; tests use fakes
/// to drive health changes under paused time.
pub trait Prober: Send + Sync + 'static {
    /// `Ok` when `/health` answered 2xx.
    fn health(&self, replica: &Replica) -> impl Future<Output = Result<(), ProbeError>> + Send;
    /// The `/metrics` page.
    fn metrics(&self, replica: &Replica)
    -> impl Future<Output = Result<String, ProbeError>> + Send;
    /// The `/v1/models` listing.
    fn models(
        &self,
        replica: &Replica,
    ) -> impl Future<Output = Result<Vec<ModelCard>, ProbeError>> + Send;
}

#[derive(Debug, Error)]
pub enum ProbeError {
    #[error("request failed: {0}")]
    Request(#[from] reqwest::Error),
    #[error("answered HTTP {0}")]
    Status(u16),
    #[error("timed out")]
    Timeout,
    #[error("unusable /v1/models: {0}")]
    Listing(String),
    #[error("unreadable answer: {0}")]
    Body(#[from] crate::http_body::BodyError),
}

impl ProbeError {
    /// The replica did not answer in time (as opposed to refusing, or answering no).
    pub fn is_timeout(&self) -> bool {
        match self {
            ProbeError::Timeout => true,
            ProbeError::Request(error) => error.is_timeout(),
            ProbeError::Body(crate::http_body::BodyError::Http(error)) => error.is_timeout(),
            ProbeError::Status(_) | ProbeError::Listing(_) | ProbeError::Body(_) => false,
        }
    }
}

/// Consecutive timed-out `/health` probes before a replica leaves the candidates (Kubernetes'
/// default readiness `failureThreshold`). A replica busy with long prompts can answer its health
/// check late while it serves; one late answer must not take it, or, when every replica is that
/// busy, the whole pool out of service. A refused connection or a non-2xx answer counts at once.
pub const SLOW_PROBES_TO_UNHEALTHY: u32 = 3;

/// At most this much of a `/metrics` answer is read (vLLM's is tens of KB, more with many
/// adapters or histograms).
pub const MAX_METRICS_BODY: usize = 16 << 20;

/// Probes over plain HTTP with a shared connection pool.
#[derive(Debug, Clone)]
pub struct HttpProber {
    client: reqwest::Client,
}

impl HttpProber {
    pub fn new(timeout: Duration) -> Result<HttpProber, ProbeError> {
        let client = reqwest::Client::builder()
            .timeout(timeout)
            .connect_timeout(timeout)
            .pool_max_idle_per_host(2)
            .build()?;
        Ok(HttpProber { client })
    }

    async fn get(&self, replica: &Replica, path: &str) -> Result<reqwest::Response, ProbeError> {
        let url = format!("http://{}{}", replica.endpoint(), path);
        let response = self.client.get(url).send().await?;
        let status = response.status();
        if status.is_success() {
            Ok(response)
        } else {
            Err(ProbeError::Status(status.as_u16()))
        }
    }
}

impl Prober for HttpProber {
    async fn health(&self, replica: &Replica) -> Result<(), ProbeError> {
        self.get(replica, "/health").await.map(drop)
    }

    async fn metrics(&self, replica: &Replica) -> Result<String, ProbeError> {
        let response = self.get(replica, "/metrics").await?;
        let body = crate::http_body::read_capped(response, MAX_METRICS_BODY).await?;
        Ok(String::from_utf8_lossy(&body).into_owned())
    }

    async fn models(&self, replica: &Replica) -> Result<Vec<ModelCard>, ProbeError> {
        fetch_model_cards(&self.client, replica.endpoint())
            .await
            .map_err(ProbeError::Listing)
    }
}

/// Probes `/health` of every replica each `interval`, forever. A replica that refuses or
/// answers non-2xx leaves the candidates, as does one whose probe timed out
/// [`SLOW_PROBES_TO_UNHEALTHY`] times in a row; the next good answer brings it back.
pub async fn run_health_checks<P: Prober>(
    pool: Arc<Pool>,
    prober: Arc<P>,
    settings: ProbeSettings,
) {
    let mut ticker = tokio::time::interval(settings.health_interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let snapshot = pool.snapshot();
        join_all(snapshot.replicas().iter().map(|replica| {
            let (prober, pool) = (&prober, &pool);
            async move {
                let result = tokio::time::timeout(settings.timeout, prober.health(replica))
                    .await
                    .unwrap_or(Err(ProbeError::Timeout));
                let timed_out = result.as_ref().is_err_and(ProbeError::is_timeout);
                let streak = replica.record_probe_timeout(timed_out);
                let health = match &result {
                    Ok(()) => Health::Healthy,
                    Err(_) if (1..SLOW_PROBES_TO_UNHEALTHY).contains(&streak) => {
                        debug!(
                            replica = replica.endpoint(),
                            streak, "health probe timed out"
                        );
                        return;
                    }
                    Err(_) => Health::Unhealthy,
                };
                let before = replica.set_health(health);
                if before != health {
                    // At once, not after the round's slowest probe.
                    pool.announce_health_change();
                    match &result {
                        Ok(()) => info!(replica = replica.endpoint(), "replica healthy"),
                        Err(e) => {
                            warn!(replica = replica.endpoint(), error = %e, "replica unhealthy")
                        }
                    }
                }
            }
        }))
        .await;
    }
}

/// Scrapes `/metrics` of every replica each `interval`, forever. A failed scrape forgets the
/// previous one at once, so the replica's load reads as unknown rather than as its old value; a
/// successful scrape that merely ages past the pool's staleness limit reads as unknown too.
/// The page's prefix-cache counters go to the replica's drift check ([`super::drift`]).
pub async fn run_scrapes<P: Prober>(pool: Arc<Pool>, prober: Arc<P>, settings: ProbeSettings) {
    let mut ticker = tokio::time::interval(settings.scrape_interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let snapshot = pool.snapshot();
        join_all(snapshot.replicas().iter().map(|replica| {
            let prober = &prober;
            async move {
                let result = tokio::time::timeout(settings.timeout, prober.metrics(replica))
                    .await
                    .unwrap_or(Err(ProbeError::Timeout));
                match result {
                    Ok(page) => {
                        let now = Instant::now();
                        replica.record_scrape_with_adapters(
                            vllm_metrics::parse_engine_load(&page),
                            vllm_metrics::parse_adapter_slots(&page),
                            now,
                        );
                        if let Some(blocks) = vllm_metrics::parse_cache_blocks(&page) {
                            replica.set_cache_blocks(blocks);
                        }
                        if let Some(totals) = vllm_metrics::parse_cache_totals(&page) {
                            replica.drift().observe(replica.endpoint(), totals, now);
                        }
                    }
                    Err(_) => replica.forget_scrape(),
                }
            }
        }))
        .await;
    }
}

/// Asks every replica for its `/v1/models` each `interval`, forever, and keeps the adapters it
/// lists (their paths are hashed into their blocks; vLLM can load and unload adapters at run
/// time, hence the repeat). A failed ask keeps the last good listing, and is logged once per
/// streak of failures.
pub async fn run_model_listings<P: Prober>(
    pool: Arc<Pool>,
    prober: Arc<P>,
    settings: ProbeSettings,
) {
    let (interval, timeout) = (settings.models_interval, settings.timeout);
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let failing = parking_lot::Mutex::new(std::collections::HashSet::<String>::new());
    loop {
        ticker.tick().await;
        let snapshot = pool.snapshot();
        join_all(snapshot.replicas().iter().map(|replica| {
            let (prober, failing) = (&prober, &failing);
            async move {
                let result = tokio::time::timeout(timeout, prober.models(replica))
                    .await
                    .unwrap_or(Err(ProbeError::Timeout));
                match result {
                    Ok(cards) => {
                        failing.lock().remove(replica.endpoint());
                        let catalog = AdapterCatalog::from_cards(&cards);
                        let count = catalog.len();
                        if replica.set_adapters(catalog) && count > 0 {
                            info!(replica = replica.endpoint(), adapters = count, "LoRA adapters listed");
                        }
                    }
                    Err(e) => {
                        if failing.lock().insert(replica.endpoint().to_owned()) {
                            warn!(replica = replica.endpoint(), error = %e, "cannot read the replica's /v1/models; keeping its last adapter list");
                        }
                    }
                }
            }
        }))
        .await;
    }
}
