//! Logs and traces for both binaries: a `tracing` subscriber writing one line per event to
//! stderr (text or JSON), plus, when an OTLP endpoint is configured, an OpenTelemetry layer that
//! exports the pipeline's spans over OTLP/gRPC.
//!
//! # Cost when tracing is off
//! The pipeline's spans are declared at DEBUG level under this crate's targets. Without an
//! endpoint no layer asks for them at the default log level, so `tracing` disables their
//! callsites once: creating one is a branch on a cached interest, recording a field on it does
//! nothing, and no W3C header is parsed or written.
//!
//! # Trace context
//! [`parent_from_headers`] turns a caller's `traceparent`/`tracestate` into the parent of a span;
//! [`traceparent_of`] gives the `traceparent` that continues a span's trace at the next hop.
//! Only the W3C Trace Context format is read and written.
//!
//! # Attributes
//! Integer fields are recorded as `i64`: OpenTelemetry has no unsigned attributes, and
//! `tracing-opentelemetry` would export a `u64`/`usize` as its decimal string.
//!
//! See `docs/observability.md` for the span tree and attributes.

#[cfg(test)]
mod tests;

use std::time::Duration;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::WithExportConfig;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use thiserror::Error;
use tracing::Subscriber;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::Layer;
use tracing_subscriber::filter::Targets;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::util::SubscriberInitExt;

/// The W3C Trace Context request header.
pub const TRACEPARENT: &str = "traceparent";
/// The W3C Trace Context vendor header, passed along with `traceparent`.
pub const TRACESTATE: &str = "tracestate";

/// The standard OpenTelemetry variables consulted when no endpoint flag is given, most specific
/// first.
const OTEL_ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];

/// How long one export may take before the batch is dropped.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(5);

/// How log lines are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `fields`, `target`, spans).
    Json,
}

/// What [`init`] sets up.
#[derive(Debug, Clone)]
pub struct TelemetryConfig {
    /// `service.name` of the exported spans (`llmgw-router`, `llmgw-agent`).
    pub service_name: &'static str,
    /// OTLP/gRPC collector, e.g. `http://otel-collector:4317`; `None`: no tracing.
    pub otlp_endpoint: Option<String>,
    pub log_format: LogFormat,
    /// The variable holding the log filter (`RUST_LOG` syntax); `info` when unset.
    pub log_filter_var: &'static str,
    /// The crates whose spans are exported (e.g. `["llmgw"]`).
    pub traced_targets: &'static [&'static str],
}

#[derive(Debug, Error)]
pub enum TelemetryError {
    #[error("OTLP exporter for {endpoint}: {source}")]
    Exporter {
        endpoint: String,
        #[source]
        source: opentelemetry_otlp::ExporterBuildError,
    },
    #[error("log filter in {var}: {source}")]
    Filter {
        var: &'static str,
        #[source]
        source: tracing_subscriber::filter::FromEnvError,
    },
    #[error("a global tracing subscriber is already installed: {0}")]
    AlreadyInstalled(#[from] tracing_subscriber::util::TryInitError),
}

/// `flag`, or else the standard OpenTelemetry variables; empty values count as unset.
pub fn resolve_endpoint(flag: Option<String>) -> Option<String> {
    flag.filter(|e| !e.trim().is_empty()).or_else(|| {
        OTEL_ENDPOINT_VARS
            .iter()
            .filter_map(|var| std::env::var(var).ok())
            .find(|e| !e.trim().is_empty())
    })
}

/// Keeps the exporter alive; dropping it flushes the spans not yet sent and stops the exporter.
/// Drop it while the Tokio runtime that [`init`] ran in is still alive.
#[derive(Debug, Default)]
pub struct TelemetryGuard {
    provider: Option<SdkTracerProvider>,
}

impl TelemetryGuard {
    /// Whether spans are exported.
    pub fn tracing_enabled(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take()
            && let Err(error) = provider.shutdown()
        {
            eprintln!("OpenTelemetry exporter shutdown: {error}");
        }
    }
}

/// An OTLP/gRPC exporter to `endpoint` behind a batch processor, for `service_name`. Must be
/// called inside a Tokio runtime (the gRPC channel's connection task runs on it).
pub fn tracer_provider(
    endpoint: &str,
    service_name: &'static str,
) -> Result<SdkTracerProvider, TelemetryError> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(endpoint)
        .with_timeout(EXPORT_TIMEOUT)
        .build()
        .map_err(|source| TelemetryError::Exporter {
            endpoint: endpoint.to_string(),
            source,
        })?;
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(service_name).build())
        .build())
}

/// The OpenTelemetry layer over `provider`, limited to the DEBUG-and-above spans and events of
/// `targets` (events become span events).
pub fn otel_layer<S>(
    provider: &SdkTracerProvider,
    service_name: &'static str,
    targets: &[&'static str],
) -> impl Layer<S> + Send + Sync + 'static
where
    S: Subscriber + for<'span> LookupSpan<'span> + Send + Sync,
{
    let filter = targets.iter().fold(Targets::new(), |t, target| {
        t.with_target(*target, tracing::Level::DEBUG)
    });
    tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(service_name))
        .with_location(false)
        .with_threads(false)
        .with_tracked_inactivity(false)
        .with_filter(filter)
}

/// Installs the global subscriber: log lines on stderr filtered by `config.log_filter_var`, and
/// the OTLP layer when an endpoint is configured. Call inside the Tokio runtime when tracing.
pub fn init(config: &TelemetryConfig) -> Result<TelemetryGuard, TelemetryError> {
    let filter = match std::env::var(config.log_filter_var) {
        Ok(_) => tracing_subscriber::EnvFilter::try_from_env(config.log_filter_var).map_err(
            |source| TelemetryError::Filter {
                var: config.log_filter_var,
                source,
            },
        )?,
        Err(_) => tracing_subscriber::EnvFilter::new("info"),
    };
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr);
    let fmt = match config.log_format {
        LogFormat::Text => fmt.boxed(),
        LogFormat::Json => fmt
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .boxed(),
    }
    .with_filter(filter);
    let provider = config
        .otlp_endpoint
        .as_deref()
        .map(|endpoint| tracer_provider(endpoint, config.service_name))
        .transpose()?;
    let otel = provider
        .as_ref()
        .map(|p| otel_layer(p, config.service_name, config.traced_targets));
    tracing_subscriber::registry()
        .with(fmt)
        .with(otel)
        .try_init()?;
    if let Some(endpoint) = &config.otlp_endpoint {
        tracing::info!(
            endpoint,
            service = config.service_name,
            "exporting traces over OTLP"
        );
    }
    Ok(TelemetryGuard { provider })
}

/// A caller's W3C trace headers.
#[derive(Debug, Clone, Copy, Default)]
pub struct TraceHeaders<'a> {
    pub traceparent: Option<&'a str>,
    pub tracestate: Option<&'a str>,
}

impl Extractor for TraceHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            TRACEPARENT => self.traceparent,
            TRACESTATE => self.tracestate,
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        [
            self.traceparent.map(|_| TRACEPARENT),
            self.tracestate.map(|_| TRACESTATE),
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// Makes `span` a child of the caller's span named in `headers`. Does nothing when the span is
/// disabled (tracing off), when there is no `traceparent`, or when it is malformed (the span
/// then starts a new trace).
pub fn parent_from_headers(span: &tracing::Span, headers: TraceHeaders<'_>) {
    if span.is_disabled() || headers.traceparent.is_none() {
        return;
    }
    let parent = TraceContextPropagator::new().extract(&headers);
    if parent.span().span_context().is_valid() {
        // Fails only when the span has already started, which a fresh span has not.
        let _ = span.set_parent(parent);
    }
}

/// `traceparent` (and `tracestate`, when any) naming `span` as the parent of the next hop's
/// work; empty when the span is disabled or not exported.
pub fn propagation_headers(span: &tracing::Span) -> Vec<(&'static str, String)> {
    if span.is_disabled() {
        return Vec::new();
    }
    let context = span.context();
    if !context.span().span_context().is_valid() {
        return Vec::new();
    }
    let mut headers = HeaderSink(Vec::with_capacity(2));
    TraceContextPropagator::new().inject_context(&context, &mut headers);
    headers.0
}

/// The `traceparent` of `span`, if it is exported (see [`propagation_headers`]).
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    propagation_headers(span)
        .into_iter()
        .find_map(|(k, v)| (k == TRACEPARENT).then_some(v))
}

struct HeaderSink(Vec<(&'static str, String)>);

impl Injector for HeaderSink {
    fn set(&mut self, key: &str, value: String) {
        let key = match key {
            TRACEPARENT => TRACEPARENT,
            TRACESTATE if !value.is_empty() => TRACESTATE,
            _ => return,
        };
        self.0.push((key, value));
    }
}
