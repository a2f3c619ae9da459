//! The two plugin traits of the scheduler: [`Filter`] and [`Scorer`].
//!
//! A **filter** removes candidates (a saturated replica, one without a LoRA adapter). A
//! **scorer** gives each remaining candidate one number in `[0, 1]` (1 = send it here), and may
//! await once for it (the precise `kv_cache` scorer tokenizes over HTTP); it can also abstain
//! with a reason (no events for the model yet, tokenizer down). After the pick every scorer is
//! told what became of its answer ([`Role`]), so one that keeps state (speculative index
//! entries, the prefix tree, session stickiness) can learn from the pick without recomputing.
//!
//! Plugins are built by name from the scheduling profile ([`super::profile`]) through the
//! registry ([`super::registry`]); the scheduler ([`super::Scheduler`]) owns them.
//!
//! # Concurrency model
//! Plugins are shared by every ext_proc stream (`Send + Sync`, called through `&self`); any
//! state they keep sits behind their own short-held locks or atomics, never held across an
//! `.await`.

use std::any::Any;

use futures::future::BoxFuture;

use super::Candidate;
use crate::openai::ParsedRequest;
use crate::peers::PeerPick;

/// What a plugin may look at besides the candidates.
#[derive(Debug, Clone, Copy)]
pub struct ScoringContext<'a> {
    pub request: &'a ParsedRequest,
    /// The request headers the profile's plugins asked for ([`Scorer::request_headers`]),
    /// names lower-case.
    pub headers: &'a [(String, String)],
    /// The prompt's length in the replicas' cache blocks, as an affinity scorer counted it
    /// ([`Scores::prompt_blocks`]); given to placement scorers only, `None` when none did.
    pub prompt_blocks: Option<u32>,
    /// How many replicas serving the request's model are not healthy (down, restarting, not
    /// yet probed): their prompts wait elsewhere for their return.
    pub replicas_down: usize,
}

impl ScoringContext<'_> {
    /// The first value of header `name` (lower-case), if the request carried it.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }
}

/// What a scorer's numbers are about. The imbalance guard skips [`Category::Affinity`] and
/// [`Category::Placement`] scorers when load is lopsided, so that load can outvote them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Category {
    /// Spreads load (queue, in-flight, KV utilization).
    Load,
    /// Keeps requests where their state is (cached prefixes, sessions, adapters).
    Affinity,
    /// Chooses a home for a request whose state is nowhere yet (a new prefix): asked after the
    /// affinity scorers, and only when they were asked and none counted a positive score.
    Placement,
}

/// One score per candidate, aligned with the `candidates` slice the scorer was given.
pub struct Scores {
    /// In `[0, 1]` (values outside are clamped); a wrong length counts as an abstention.
    pub per_candidate: Vec<f64>,
    /// Whatever the scorer wants back after the pick (e.g. the request's block hashes).
    pub memo: Option<Box<dyn Any + Send + Sync>>,
    /// An affinity scorer's all-zero answer that is still an answer: it looked and found no
    /// replica worth sending the request to for its cache, so the placement scorers decide and
    /// its fallback is not asked.
    pub placement_decides: bool,
    /// The prompt's length in cache blocks, when the scorer counted them (`kv_cache` hashes
    /// the prompt): what a placement scorer must find room for.
    pub prompt_blocks: Option<u32>,
}

impl Scores {
    pub fn new(per_candidate: Vec<f64>) -> Scores {
        Scores {
            per_candidate,
            memo: None,
            placement_decides: false,
            prompt_blocks: None,
        }
    }

    pub fn with_memo(per_candidate: Vec<f64>, memo: impl Any + Send + Sync) -> Scores {
        Scores {
            per_candidate,
            memo: Some(Box::new(memo)),
            placement_decides: false,
            prompt_blocks: None,
        }
    }

    /// Tells the placement scorers the prompt's length in cache blocks.
    pub fn with_prompt_blocks(mut self, blocks: u32) -> Scores {
        self.prompt_blocks = Some(blocks);
        self
    }

    /// Marks an all-zero answer as final (see [`Scores::placement_decides`]).
    pub fn placement_decides(mut self) -> Scores {
        self.placement_decides = true;
        self
    }

    /// The memo, if it is a `T`.
    pub fn memo<T: 'static>(&self) -> Option<&T> {
        self.memo.as_ref().and_then(|m| m.downcast_ref::<T>())
    }

    /// Whether any candidate scored above 0 (a scorer with nothing but zeros has no opinion).
    pub fn any_positive(&self) -> bool {
        self.per_candidate.iter().any(|s| *s > 0.0)
    }
}

impl std::fmt::Debug for Scores {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scores")
            .field("per_candidate", &self.per_candidate)
            .field("memo", &self.memo.is_some())
            .field("placement_decides", &self.placement_decides)
            .field("prompt_blocks", &self.prompt_blocks)
            .finish()
    }
}

/// A scorer's answer for one decision.
#[derive(Debug)]
pub enum Answer {
    Scored(Scores),
    /// No opinion on this request, and why (a metric label: `no_events`, `tokenize_timeout`).
    Abstain(&'static str),
}

impl Answer {
    pub fn scores(&self) -> Option<&Scores> {
        match self {
            Answer::Scored(scores) => Some(scores),
            Answer::Abstain(_) => None,
        }
    }

    pub fn abstained(&self) -> Option<&'static str> {
        match self {
            Answer::Scored(_) => None,
            Answer::Abstain(reason) => Some(reason),
        }
    }
}

/// An answer now, or one to await. Load scorers answer at once, so they cost no allocation for
/// a future.
pub enum Scoring<'a> {
    Ready(Answer),
    Pending(BoxFuture<'a, Answer>),
}

impl Scoring<'_> {
    pub async fn answer(self) -> Answer {
        match self {
            Scoring::Ready(answer) => answer,
            Scoring::Pending(future) => future.await,
        }
    }
}

/// What became of a scorer's answer in a decision, told to it after the pick.
#[derive(Debug, Clone, Copy)]
pub enum Role<'a> {
    /// Its scores were counted in the pick.
    Counted(&'a Scores),
    /// It was asked, but its answer was not counted: it abstained, or it scored every candidate
    /// 0 and its fallback had something to say.
    NotCounted {
        scores: Option<&'a Scores>,
        abstained: Option<&'static str>,
    },
    /// It was not asked: the imbalance guard skipped it, or it is a fallback whose primary
    /// answered.
    NotAsked,
}

/// The pick a scorer hears about.
#[derive(Debug, Clone, Copy)]
pub struct Pick<'a> {
    pub candidates: &'a [Candidate],
    /// Index of the chosen candidate in `candidates` (and so in the scores).
    pub chosen: usize,
}

impl Pick<'_> {
    pub fn chosen(&self) -> &Candidate {
        &self.candidates[self.chosen]
    }
}

/// A scorer plugin.
pub trait Scorer: Send + Sync + 'static {
    fn category(&self) -> Category;

    /// Scores each candidate.
    fn score<'a>(
        &'a self,
        context: &'a ScoringContext<'a>,
        candidates: &'a [Candidate],
    ) -> Scoring<'a>;

    /// Refuses a request this scorer cannot accept (a session key over its limit), before any
    /// scoring: the client gets 400 with the reason. Most scorers accept everything.
    fn check(&self, _context: &ScoringContext<'_>) -> Result<(), String> {
        Ok(())
    }

    /// Called once per successful decision. Must not block: it runs on the request path.
    fn after_pick(&self, _context: &ScoringContext<'_>, _pick: Pick<'_>, _role: Role<'_>) {}

    /// A peer router routed a prompt ([`crate::peers`]): a scorer that keeps state about recent
    /// picks credits it as it would its own. Must not block: it runs on the peering task.
    fn peer_picked(&self, _pick: &PeerPick) {}

    /// Request headers (lower-case names) this scorer reads; the protocol layer keeps only
    /// the headers some plugin asked for.
    fn request_headers(&self) -> Vec<String> {
        Vec::new()
    }
}

/// What a decision does when a filter removes every candidate.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenNonePass {
    /// Refuse the request: every replica is saturated (HTTP 429).
    RefuseSaturated,
    /// Keep the candidates the filter was given (a preference, not a rule).
    KeepAll,
}

/// A filter plugin.
pub trait Filter: Send + Sync + 'static {
    /// Keeps in `candidates` only those that pass. `request` is `None` for requests that are
    /// not completions (`GET /v1/models`).
    fn filter(&self, request: Option<&ParsedRequest>, candidates: &mut Vec<Candidate>);

    fn when_none_pass(&self) -> WhenNonePass;

    /// How many more requests `candidate` can be sent before this filter removes it; `None`
    /// when it sets no such limit. Flow control dispatches queued requests by it.
    fn headroom(&self, _candidate: &Candidate) -> Option<u32> {
        None
    }
}
