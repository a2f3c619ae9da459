//! `prefix_tree`: approximate prefix affinity from the text of recently routed prompts
//! ([`crate::prefix::PrefixTree`]), for when the precise index cannot answer (no tokens in
//! time, no events yet for the model, unknown hash settings) or matches nothing. The share of
//! the prompt's chunks last sent to a candidate is its score. Every pick is recorded in the
//! tree, whether or not this scorer was asked, so it knows where each prefix went; peer
//! routers' picks are too ([`crate::peers`]: the text's chain hashes, never the text).
//!
//! Parameters: `chunk_bytes` (bytes of prompt text per node, default 64), `max_nodes` (default
//! 1,048,576; about 100 bytes each).
//!
//! Metrics: `llmgw_prefix_decisions_total{decision}` (hit, miss, load_override; counted when its
//! scores decided), `llmgw_prefix_tree_nodes`.

use std::borrow::Cow;
use std::num::NonZeroUsize;
use std::sync::Arc;

use parking_lot::Mutex;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use serde::Deserialize;

use super::{DecisionLabels, classify};
use crate::openai::{ParsedRequest, Prompt, RequestInput};
use crate::peers::{PeerPick, PickOutbox};
use crate::prefix::{PrefixTree, PrefixTreeConfig};
use crate::scheduler::Candidate;
use crate::scheduler::plugin::{Answer, Category, Pick, Role, Scorer, Scores, Scoring, ScoringContext};
use crate::scheduler::registry::{BuildContext, PluginError, ScorerPlugin, parameters};

pub(super) static PLUGIN: ScorerPlugin = ScorerPlugin {
    kind: "prefix_tree",
    build,
};

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct Parameters {
    chunk_bytes: NonZeroUsize,
    max_nodes: NonZeroUsize,
}

impl Default for Parameters {
    fn default() -> Self {
        let config = PrefixTreeConfig::default();
        Parameters {
            chunk_bytes: config.chunk_bytes,
            max_nodes: config.max_nodes,
        }
    }
}

fn build(context: &mut BuildContext<'_>, value: serde_yaml::Value) -> Result<Arc<dyn Scorer>, PluginError> {
    let parameters: Parameters = parameters(value)?;
    let tree = Arc::new(PrefixTree::new(PrefixTreeConfig {
        chunk_bytes: parameters.chunk_bytes,
        max_nodes: parameters.max_nodes,
    }));
    let metrics = context.shared(TreeMetrics::register);
    metrics.trees.lock().push(Arc::clone(&tree));
    Ok(Arc::new(PrefixTreeScorer {
        tree,
        metrics,
        picks: Arc::clone(&context.resources.picks),
    }))
}

/// Shared by every `prefix_tree` of a scheduler.
#[derive(Debug, Default)]
struct TreeMetrics {
    decisions: Family<DecisionLabels, Counter>,
    trees: Arc<Mutex<Vec<Arc<PrefixTree>>>>,
}

impl TreeMetrics {
    fn register(registry: &mut Registry) -> TreeMetrics {
        let metrics = TreeMetrics::default();
        // Exported at zero from the start: the dashboard's panel and `rate()` need the series
        // before the tree first decides (with agents, a fleet's first prompts are the index's).
        for decision in ["hit", "miss", "load_override"] {
            drop(metrics.decisions.get_or_create(&DecisionLabels { decision }));
        }
        registry.register(
            "llmgw_prefix_decisions",
            "Decisions of the approximate prefix tree tier: hit, miss, load_override",
            metrics.decisions.clone(),
        );
        registry.register_collector(Box::new(TreeNodes(Arc::clone(&metrics.trees))));
        metrics
    }
}

/// `llmgw_prefix_tree_nodes`, read when `/metrics` is.
#[derive(Debug)]
struct TreeNodes(Arc<Mutex<Vec<Arc<PrefixTree>>>>);

impl Collector for TreeNodes {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let nodes: usize = self.0.lock().iter().map(|t| t.len()).sum();
        let gauge = Gauge::<i64>::default();
        gauge.set(i64::try_from(nodes).unwrap_or(i64::MAX));
        gauge.encode(encoder.encode_descriptor(
            "llmgw_prefix_tree_nodes",
            "Nodes in the approximate prefix tree",
            None,
            gauge.metric_type(),
        )?)
    }
}

struct PrefixTreeScorer {
    tree: Arc<PrefixTree>,
    metrics: Arc<TreeMetrics>,
    /// Where the text of this router's picks goes to its peer routers.
    picks: Arc<PickOutbox>,
}

impl Scorer for PrefixTreeScorer {
    fn category(&self) -> Category {
        Category::Affinity
    }

    fn score<'a>(&'a self, context: &'a ScoringContext<'a>, candidates: &'a [Candidate]) -> Scoring<'a> {
        let request = context.request;
        let _span = tracing::debug_span!("prefix_tree").entered();
        let endpoints: Vec<&str> = candidates.iter().map(|c| c.replica.endpoint()).collect();
        let mut shares = Vec::with_capacity(candidates.len());
        self.tree.match_shares(
            &tree_scope(request),
            &prompt_text(request),
            &endpoints,
            &mut shares,
        );
        Scoring::Ready(Answer::Scored(Scores::new(shares)))
    }

    fn after_pick(&self, context: &ScoringContext<'_>, pick: Pick<'_>, role: Role<'_>) {
        let request = context.request;
        let replica = pick.chosen().replica.endpoint();
        let chain = self.tree.chain(&tree_scope(request), &prompt_text(request));
        self.tree.record_chain(&chain, replica);
        if !chain.is_empty() {
            self.picks.publish(|| PeerPick {
                model: request.model.clone(),
                replica: replica.to_owned(),
                hashes: Arc::from([]),
                new_blocks: 0,
                tree_chain: chain.into(),
                placed: false,
            });
        }
        if let Role::Counted(scores) = role {
            let shares = scores.per_candidate.iter().copied();
            let decision = classify(shares, pick.chosen);
            self.metrics
                .decisions
                .get_or_create(&DecisionLabels { decision })
                .inc();
            let route = tracing::Span::current();
            route.record("prefix_outcome", decision);
            route.record("tier", "tree");
            route.record(
                "matched_share",
                scores.per_candidate.get(pick.chosen).copied().unwrap_or(0.0),
            );
        }
    }

    fn peer_picked(&self, pick: &PeerPick) {
        if !pick.tree_chain.is_empty() {
            self.tree.record_chain(&pick.tree_chain, &pick.replica);
        }
    }
}

/// The prefix tree's scope for a request: its model, and its `cache_salt` when it has one, since
/// requests with different salts never share cached blocks however alike their text.
fn tree_scope(request: &ParsedRequest) -> Cow<'_, str> {
    match &request.cache_salt {
        None => request.model.as_str().into(),
        // NUL cannot appear in a model name taken from JSON text unescaped, and the tree only
        // compares scopes for equality.
        Some(salt) => format!("{}\0{salt}", request.model).into(),
    }
}

/// The bytes the prefix tree keys a request by: the prompt text, the token ids, or the chat
/// messages' JSON (which grows by appending as a conversation goes on).
fn prompt_text(request: &ParsedRequest) -> Cow<'_, [u8]> {
    match &request.input {
        RequestInput::Completion(Prompt::Text(text)) => text.as_bytes().into(),
        RequestInput::Completion(Prompt::TokenIds(ids)) => ids
            .iter()
            .flat_map(|id| id.to_le_bytes())
            .collect::<Vec<u8>>()
            .into(),
        RequestInput::Chat(chat) => chat.messages.get().as_bytes().into(),
    }
}
