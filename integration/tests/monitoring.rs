//! The monitoring assets (`deploy/monitoring/`) against the binaries: every alert and dashboard
//! expression parses as PromQL, and every metric it names is one a running router, agent or
//! (for `vllm:` metrics) replica exports, so that no panel stays empty and no alert is silent
//! because of a misspelled or renamed metric.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::collections::BTreeSet;
use std::time::Duration;

use llmgw_integration::prom;
use llmgw_integration::repo_root;
use llmgw_integration::system::{self, SystemConfig};
use promql_parser::parser::{self, Expr};
use promql_parser::util::{ExprVisitor, walk_expr};

/// Every PromQL expression of the alerts and of the dashboard's panels, with where it is.
fn expressions() -> Vec<(String, String)> {
    let dir = repo_root().join("deploy/monitoring");
    let mut exprs = Vec::new();
    let rules: serde_yaml::Value = serde_yaml::from_str(
        &std::fs::read_to_string(dir.join("prometheusrule.yaml")).expect("prometheusrule.yaml"),
    )
    .expect("rules parse");
    for group in rules["spec"]["groups"].as_sequence().expect("groups") {
        for rule in group["rules"].as_sequence().expect("rules") {
            let name = rule["alert"].as_str().expect("an alert name");
            let expr = rule["expr"].as_str().expect("an expr");
            exprs.push((format!("alert {name}"), expr.to_owned()));
        }
    }
    let dashboard: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("llmgw-dashboard.json")).expect("dashboard"),
    )
    .expect("dashboard parses");
    for panel in dashboard["panels"].as_array().expect("panels") {
        let title = panel["title"].as_str().expect("a title");
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("an expr");
            exprs.push((format!("panel {title:?}"), expr.to_owned()));
        }
    }
    exprs
}

/// The metric names an expression selects.
#[derive(Default)]
struct Names(BTreeSet<String>);

impl ExprVisitor for Names {
    type Error = ();

    fn pre_visit(&mut self, expr: &Expr) -> Result<bool, ()> {
        let selector = match expr {
            Expr::VectorSelector(vs) => Some(vs),
            Expr::MatrixSelector(ms) => Some(&ms.vs),
            _ => None,
        };
        if let Some(name) = selector.and_then(|s| s.name.clone()) {
            self.0.insert(name);
        }
        Ok(true)
    }

    fn post_visit(&mut self, _expr: &Expr) -> Result<bool, ()> {
        Ok(true)
    }
}

/// Histogram series carry their family's name plus a suffix.
fn family(name: &str) -> &str {
    ["_bucket", "_sum", "_count"]
        .iter()
        .find_map(|suffix| name.strip_suffix(suffix))
        .unwrap_or(name)
}

#[test]
fn every_expression_parses_and_names_metrics() {
    let exprs = expressions();
    assert!(exprs.len() >= 10, "only {} expressions", exprs.len());
    for (where_, expr) in exprs {
        let parsed = parser::parse(&expr).unwrap_or_else(|e| panic!("{where_}: {e}: {expr}"));
        let mut names = Names::default();
        walk_expr(&mut names, &parsed).unwrap();
        assert!(!names.0.is_empty(), "{where_} selects no metric: {expr}");
    }
}

#[test]
fn a_misspelled_expression_is_refused() {
    assert!(parser::parse("sum(rate(llmgw_decisions_total[5m])").is_err());
    assert!(parser::parse("sum by (pod) llmgw_feed_streams) == 0").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_alerts_and_dashboard_name_is_exported() {
    let system = system::start(SystemConfig {
        replicas: 2,
        sim_args: vec!["--sim-no-latency".to_owned()],
        ..SystemConfig::default()
    })
    .await;
    // A few requests, so that the per-decision families have samples.
    let client = reqwest::Client::new();
    for i in 0..4 {
        let body = serde_json::json!({"model": "tiny", "prompt": format!("monitoring check {i} with a prompt long enough to span blocks of sixteen tokens"), "max_tokens": 4});
        let status = client
            .post(system.url("/v1/completions"))
            .json(&body)
            .send()
            .await
            .expect("a request through Envoy")
            .status();
        assert_eq!(status, 200);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut exported = String::new();
    exported += &prom::scrape(&format!("http://{}/metrics", system.router.admin))
        .await
        .expect("router metrics");
    let agent = system.agent_admin.expect("an agent");
    exported += &prom::scrape(&format!("http://{agent}/metrics"))
        .await
        .expect("agent metrics");
    for sim in &system.sims {
        exported += &prom::scrape(&format!("{}/metrics", sim.url()))
            .await
            .expect("replica metrics");
    }
    let families: BTreeSet<&str> = prom::samples(&exported).map(|s| family(s.name)).collect();

    let mut missing = Vec::new();
    for (where_, expr) in expressions() {
        let mut names = Names::default();
        walk_expr(&mut names, &parser::parse(&expr).expect("parses")).unwrap();
        for name in names.0 {
            // `up` is Prometheus's own.
            if name != "up" && !families.contains(family(&name)) {
                missing.push(format!("{where_}: {name}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "named but not exported: {missing:#?}\nexported: {families:#?}"
    );
}
