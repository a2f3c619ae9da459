use super::*;

#[test]
fn without_a_subscriber_nothing_is_parsed_or_propagated() {
    let span = tracing::debug_span!("route");
    parent_from_headers(
        &span,
        TraceHeaders {
            traceparent: Some("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            tracestate: None,
        },
    );
    assert!(span.is_disabled());
    assert!(propagation_headers(&span).is_empty());
    assert_eq!(traceparent_of(&span), None);
}

#[test]
fn an_endpoint_flag_wins_over_the_environment() {
    assert_eq!(
        resolve_endpoint(Some("http://collector:4317".to_string())).as_deref(),
        Some("http://collector:4317")
    );
}
