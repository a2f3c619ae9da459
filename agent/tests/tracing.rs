//! An event batch traced through the agent (decode → mirror → each router's uplink) with the
//! OpenTelemetry layer the binary installs and an in-test exporter. Alone in its test binary:
//! tracing caches per-callsite interest process-wide, so a test on another thread reaching these
//! callsites first, with no subscriber, could hide them from this one.

mod support;

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use support::*;

/// Keeps every span the SDK exports.
#[derive(Debug, Clone, Default)]
struct Exported(Arc<Mutex<Vec<opentelemetry_sdk::trace::SpanData>>>);

impl opentelemetry_sdk::trace::SpanExporter for Exported {
    fn export(
        &self,
        batch: Vec<opentelemetry_sdk::trace::SpanData>,
    ) -> impl Future<Output = opentelemetry_sdk::error::OTelSdkResult> + Send {
        self.0.lock().extend(batch);
        std::future::ready(Ok(()))
    }
}

#[tokio::test]
async fn a_batch_is_traced_from_decode_through_mirror_to_each_routers_uplink() {
    use tracing_subscriber::layer::SubscriberExt;
    let exported = Exported::default();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_simple_exporter(exported.clone())
        .build();
    let subscriber = tracing_subscriber::registry().with(llmgw::telemetry::otel_layer(
        &provider,
        "llmgw-agent",
        &["llmgw_agent"],
    ));
    // This test's runtime is single-threaded, so every task of the agent sees this subscriber.
    let default = tracing::subscriber::set_default(subscriber);

    let frames = frames();
    let first = &frames[..1];
    let want = final_set(first);
    assert!(!want.is_empty(), "the first batch stores blocks");
    let (a, b) = (router(None, None).await, router(None, None).await);
    let mut n = node(REPLICA, "1729", &[&a, &b], None).await;
    // Both streams up first, so that the batch reaches each router as a delta (an uplink span),
    // not inside a snapshot.
    eventually("both uplinks", || {
        let m = n.agent.metrics.encode();
        [&a, &b].iter().all(|r| {
            m.contains(&format!(
                "llmgw_agent_uplink_connected{{router=\"{}\"}} 1",
                r.addr
            ))
        })
    })
    .await;
    publish(&mut n, first).await;
    eventually("router a", || a.index.hashes(REPLICA) == want).await;
    eventually("router b", || b.index.hashes(REPLICA) == want).await;
    // The batch span ends when the last delta holding it is gone: stop the agent and let the
    // aborted uplink tasks be dropped.
    drop(n);
    tokio::time::sleep(Duration::from_millis(50)).await;
    drop(default);
    provider.force_flush().expect("flush");

    let spans = exported.0.lock();
    let names: Vec<&str> = spans.iter().map(|s| &*s.name).collect();
    let batch = spans
        .iter()
        .find(|s| s.name == "batch")
        .unwrap_or_else(|| panic!("no batch span in {names:?}"));
    let children = |name: &str| -> Vec<&opentelemetry_sdk::trace::SpanData> {
        spans
            .iter()
            .filter(|s| s.name == name && s.parent_span_id == batch.span_context.span_id())
            .collect()
    };
    assert_eq!(children("decode").len(), 1, "{names:?}");
    assert_eq!(children("mirror").len(), 1, "{names:?}");
    let uplinks = children("uplink");
    assert_eq!(uplinks.len(), 2, "one uplink span per router: {names:?}");
    let routers: HashSet<String> = uplinks
        .iter()
        .filter_map(|s| {
            s.attributes
                .iter()
                .find(|kv| kv.key.as_str() == "router")
                .map(|kv| kv.value.to_string())
        })
        .collect();
    assert_eq!(
        routers,
        [a.addr.clone(), b.addr.clone()].into_iter().collect()
    );
    for s in children("decode")
        .into_iter()
        .chain(children("mirror"))
        .chain(uplinks)
    {
        assert_eq!(s.span_context.trace_id(), batch.span_context.trace_id());
    }
    let attribute = |key: &str| {
        batch
            .attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.clone())
    };
    assert_eq!(attribute("engine"), Some(REPLICA.into()));
    assert_eq!(attribute("seq"), Some((first[0].seq as i64).into()));
}
