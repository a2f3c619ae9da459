//! `llmgw-bench-overload`'s traffic classes, its per-class statistics and the report with the
//! issue's two checks: the high priority's TTFT p99 under overload within 1.5× of its p99
//! alone, and the quiet tenant's p99 within 1.5× of the noisy one's.

use std::collections::BTreeMap;

use serde::Serialize;

use crate::routing::percentile;

/// One stream of requests: an objective (priority) and a tenant, at a share of the capacity.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Class {
    pub name: &'static str,
    /// The `x-gateway-inference-objective` header.
    pub objective: &'static str,
    /// The `x-gateway-inference-fairness-id` header.
    pub tenant: &'static str,
    /// Offered rate as a share of the measured capacity.
    pub share: f64,
}

/// The overload mix: 1.5× the capacity in all; the interactive objective (priority 10) at
/// 0.3×, and the sheddable batch objective (priority -1) from a noisy tenant at 1.0× and a
/// quiet one at 0.2×.
pub fn overload_mix() -> Vec<Class> {
    vec![
        Class {
            name: "interactive",
            objective: "interactive",
            tenant: "app",
            share: 0.3,
        },
        Class {
            name: "batch-noisy",
            objective: "batch",
            tenant: "noisy",
            share: 1.0,
        },
        Class {
            name: "batch-quiet",
            objective: "batch",
            tenant: "quiet",
            share: 0.2,
        },
    ]
}

/// The objectives file the bench's router runs with: the batch objective may wait 2 s.
pub const OBJECTIVES_YAML: &str = "flow_control:\n  queue_timeout: 10s\n  objectives:\n    - {name: interactive, priority: 10}\n    - {name: batch, priority: -1, queue_timeout: 2s}\n";

/// How one request ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Ending {
    /// Streamed to its end; time to the first token, in milliseconds.
    Served { ttft_ms: f64 },
    /// Answered by flow control (429 or 503): why, from its error message.
    Shed { status: u16, reason: ShedReason },
    /// Anything else (a transport error, another status).
    Failed(String),
}

/// Why flow control answered a request itself, read from the error's message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ShedReason {
    Displaced,
    QueueFull,
    Deadline,
    Other,
}

impl ShedReason {
    pub fn of(message: &str) -> ShedReason {
        if message.contains("displaced") {
            ShedReason::Displaced
        } else if message.contains("are waiting") {
            ShedReason::QueueFull
        } else if message.contains("queue timeout") {
            ShedReason::Deadline
        } else {
            ShedReason::Other
        }
    }
}

/// One class's outcome in one phase.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct ClassReport {
    pub sent: usize,
    pub served: usize,
    pub shed: BTreeMap<ShedReason, usize>,
    pub failed: usize,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
}

impl ClassReport {
    pub fn of(endings: &[Ending]) -> ClassReport {
        let mut report = ClassReport {
            sent: endings.len(),
            ..ClassReport::default()
        };
        let mut ttfts = Vec::new();
        for ending in endings {
            match ending {
                Ending::Served { ttft_ms } => {
                    report.served += 1;
                    ttfts.push(*ttft_ms);
                }
                Ending::Shed { reason, .. } => *report.shed.entry(*reason).or_default() += 1,
                Ending::Failed(_) => report.failed += 1,
            }
        }
        ttfts.sort_by(f64::total_cmp);
        report.ttft_p50_ms = percentile(&ttfts, 50.0);
        report.ttft_p99_ms = percentile(&ttfts, 99.0);
        report
    }

    pub fn shed_total(&self) -> usize {
        self.shed.values().sum()
    }
}

/// A check of the issue, met or missed, with its figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    pub what: String,
    pub ratio: Option<f64>,
    pub limit: f64,
    pub met: bool,
}

fn check(what: String, numerator: Option<f64>, denominator: Option<f64>, limit: f64) -> Check {
    let ratio = numerator
        .zip(denominator)
        .filter(|(_, d)| *d > 0.0)
        .map(|(n, d)| n / d);
    Check {
        what,
        ratio,
        limit,
        met: ratio.is_some_and(|r| r <= limit),
    }
}

/// The two checks.
pub fn checks(alone: &ClassReport, overloaded: &BTreeMap<String, ClassReport>) -> Vec<Check> {
    let p99 = |name: &str| overloaded.get(name).and_then(|r| r.ttft_p99_ms);
    vec![
        check(
            "interactive TTFT p99 under overload / alone".to_owned(),
            p99("interactive"),
            alone.ttft_p99_ms,
            1.5,
        ),
        check(
            "quiet tenant's TTFT p99 / noisy tenant's".to_owned(),
            p99("batch-quiet"),
            p99("batch-noisy"),
            1.5,
        ),
    ]
}

fn ms(value: Option<f64>) -> String {
    value.map_or("–".to_owned(), |v| format!("{v:.1}"))
}

/// The Markdown table of one phase.
pub fn markdown(phase: &str, rows: &BTreeMap<String, ClassReport>) -> String {
    let mut out = format!(
        "### {phase}\n\n| class | sent | served | shed (displaced / queue full / deadline) | failed | TTFT p50 ms | TTFT p99 ms |\n|---|---|---|---|---|---|---|\n"
    );
    for (name, row) in rows {
        let shed = |reason| row.shed.get(&reason).copied().unwrap_or(0);
        out.push_str(&format!(
            "| {name} | {} | {} | {} ({} / {} / {}) | {} | {} | {} |\n",
            row.sent,
            row.served,
            row.shed_total(),
            shed(ShedReason::Displaced),
            shed(ShedReason::QueueFull),
            shed(ShedReason::Deadline),
            row.failed,
            ms(row.ttft_p50_ms),
            ms(row.ttft_p99_ms),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_count_endings_and_checks_compare_p99s() {
        let endings: Vec<Ending> = (1..=100)
            .map(|i| Ending::Served {
                ttft_ms: f64::from(i),
            })
            .chain([
                Ending::Shed {
                    status: 429,
                    reason: ShedReason::of("displaced from the queue"),
                },
                Ending::Shed {
                    status: 429,
                    reason: ShedReason::of("within the queue timeout (2s)"),
                },
                Ending::Failed("reset".into()),
            ])
            .collect();
        let report = ClassReport::of(&endings);
        assert_eq!((report.sent, report.served, report.failed), (103, 100, 1));
        assert_eq!(report.shed_total(), 2);
        assert_eq!(report.ttft_p50_ms, Some(51.0));
        assert_eq!(report.ttft_p99_ms, Some(99.0));
        let alone = ClassReport {
            ttft_p99_ms: Some(60.0),
            ..ClassReport::default()
        };
        let overloaded = BTreeMap::from([
            ("interactive".to_owned(), report.clone()),
            ("batch-quiet".to_owned(), report.clone()),
            ("batch-noisy".to_owned(), ClassReport::default()),
        ]);
        let checks = checks(&alone, &overloaded);
        assert_eq!(checks[0].ratio, Some(99.0 / 60.0));
        assert!(!checks[0].met);
        // No noisy figure: nothing to compare, so not met.
        assert_eq!(checks[1].ratio, None);
        assert!(!checks[1].met);
        let table = markdown("overload", &overloaded);
        assert!(table.contains("| interactive | 103 | 100 | 2 (1 / 0 / 1) | 1 | 51.0 | 99.0 |"));
        assert_eq!(
            ShedReason::of("4 requests of the same or higher priority are waiting"),
            ShedReason::QueueFull
        );
    }
}
