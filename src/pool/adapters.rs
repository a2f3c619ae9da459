//! LoRA adapters on a replica: which it serves and where each was loaded from (its
//! `GET /v1/models`, asked by [`super::monitor::run_model_listings`]), and which are active now
//! (`vllm:lora_requests_info`, read from every `/metrics` scrape).
//!
//! vLLM lists an adapter in `/v1/models` with `root` = the path it was loaded from and `parent`
//! = its base model. The path matters for routing: vLLM ≥ 0.31 hashes `("lora", name, path)`
//! into every block of an adapter's requests, so the router can reproduce those hashes only
//! with the path each replica loaded the adapter from.
//!
//! Concurrency: plain values, parsed once per answer and shared read-only behind the replica's
//! `ArcSwapOption`s.

use std::collections::HashMap;

use serde::Deserialize;

/// At most this much of a `/v1/models` answer is read, and at most this many models kept.
pub const MAX_MODELS_BODY: usize = 1024 * 1024;
pub const MAX_MODELS: usize = 1024;

/// One entry of a `/v1/models` answer.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ModelCard {
    pub id: String,
    /// The model tag for a base model; the path an adapter was loaded from.
    #[serde(default)]
    pub root: Option<String>,
    /// An adapter's base model; `None` for a base model.
    #[serde(default)]
    pub parent: Option<String>,
}

/// Why a `/v1/models` answer is unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ListingError {
    #[error("the answer is over {MAX_MODELS_BODY} bytes")]
    TooLarge,
    #[error("it lists over {MAX_MODELS} models")]
    TooMany,
    #[error("not a model list: {0}")]
    Malformed(String),
    #[error("it lists no model")]
    Empty,
}

/// The models a vLLM `/v1/models` answer lists (entries with an empty id dropped), bounded.
pub fn model_cards(body: &[u8]) -> Result<Vec<ModelCard>, ListingError> {
    #[derive(Deserialize)]
    struct Listing {
        data: Vec<ModelCard>,
    }
    if body.len() > MAX_MODELS_BODY {
        return Err(ListingError::TooLarge);
    }
    let listing: Listing =
        serde_json::from_slice(body).map_err(|e| ListingError::Malformed(e.to_string()))?;
    if listing.data.len() > MAX_MODELS {
        return Err(ListingError::TooMany);
    }
    let cards: Vec<ModelCard> = listing
        .data
        .into_iter()
        .filter(|c| !c.id.is_empty())
        .collect();
    if cards.is_empty() {
        return Err(ListingError::Empty);
    }
    Ok(cards)
}

/// Asks the replica at `address` (`ip:port`) for its models, reading at most
/// [`MAX_MODELS_BODY`] bytes of the answer.
pub async fn fetch_model_cards(
    client: &reqwest::Client,
    address: &str,
) -> Result<Vec<ModelCard>, String> {
    let response = client
        .get(format!("http://{address}/v1/models"))
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("status {}", response.status()));
    }
    let body = crate::http_body::read_capped(response, MAX_MODELS_BODY)
        .await
        .map_err(|e| match e {
            crate::http_body::BodyError::TooLong(_) => ListingError::TooLarge.to_string(),
            other => other.to_string(),
        })?;
    model_cards(&body).map_err(|e| e.to_string())
}

/// An adapter as one replica serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Adapter {
    /// Where the replica loaded it from (hashed into its blocks by vLLM ≥ 0.31).
    pub path: String,
    /// The base model it adapts.
    pub base: String,
}

/// The adapters one replica lists, by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AdapterCatalog {
    by_name: HashMap<String, Adapter>,
}

impl AdapterCatalog {
    /// The adapters among `cards`: those with a `parent`. An adapter listed without a `root`
    /// has no path to hash and is left out.
    pub fn from_cards(cards: &[ModelCard]) -> AdapterCatalog {
        let by_name = cards
            .iter()
            .filter_map(|card| {
                let base = card.parent.clone()?;
                let path = card.root.clone()?;
                Some((card.id.clone(), Adapter { path, base }))
            })
            .collect();
        AdapterCatalog { by_name }
    }

    pub fn get(&self, name: &str) -> Option<&Adapter> {
        self.by_name.get(name)
    }

    /// Each adapter's name and path.
    pub fn paths(&self) -> impl Iterator<Item = (String, String)> + '_ {
        self.by_name
            .iter()
            .map(|(name, adapter)| (name.clone(), adapter.path.clone()))
    }

    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }
}

/// The engine's adapter slots at its last scrape (`vllm:lora_requests_info`): at most
/// `max_loras` distinct adapters among its running requests; a request for another one waits
/// until a slot frees.
///
/// vLLM ≥ 0.30 writes every adapter with a request in flight into **both** labels (with its
/// running and its waiting count, and only the names are exported: `LoRARequestStates`), so
/// there `running` is every active adapter, waiting ones included, and counting it against
/// `max_loras` errs towards "full". Older engines list them apart.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct AdapterSlots {
    pub max_loras: u32,
    /// Adapters of running requests (with vLLM ≥ 0.30: of every request in flight).
    pub running: Vec<String>,
    /// Adapters of waiting requests.
    pub waiting: Vec<String>,
}

impl AdapterSlots {
    pub fn is_running(&self, adapter: &str) -> bool {
        self.running.iter().any(|a| a == adapter)
    }

    pub fn is_waiting(&self, adapter: &str) -> bool {
        self.waiting.iter().any(|a| a == adapter)
    }

    /// Whether another adapter could be loaded now.
    pub fn has_free_slot(&self) -> bool {
        self.running.len() < self.max_loras as usize
    }

    /// Whether a request for `adapter` would wait for a slot: every slot holds another one.
    pub fn is_full_without(&self, adapter: &str) -> bool {
        !self.has_free_slot() && !self.is_running(adapter)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LISTING: &str = r#"{"object":"list","data":[
        {"id":"tiny","object":"model","root":"/models/tiny","parent":null},
        {"id":"sql","object":"model","root":"/adapters/sql","parent":"tiny"},
        {"id":"rootless","object":"model","parent":"tiny"},
        {"id":"","object":"model"}]}"#;

    #[test]
    fn adapters_are_the_cards_with_a_parent_and_a_root() {
        let cards = model_cards(LISTING.as_bytes()).expect("a listing");
        let ids: Vec<&str> = cards.iter().map(|c| c.id.as_str()).collect();
        assert_eq!(ids, ["tiny", "sql", "rootless"]);
        let catalog = AdapterCatalog::from_cards(&cards);
        assert_eq!(catalog.len(), 1);
        assert_eq!(
            catalog.get("sql"),
            Some(&Adapter {
                path: "/adapters/sql".into(),
                base: "tiny".into()
            })
        );
        assert_eq!(catalog.get("tiny"), None);
        assert_eq!(catalog.get("rootless"), None);
    }

    #[test]
    fn slots_say_whether_an_adapter_would_wait() {
        let slots = AdapterSlots {
            max_loras: 2,
            running: vec!["a".into(), "b".into()],
            waiting: vec!["c".into()],
        };
        assert!(slots.is_running("a") && !slots.is_running("c"));
        assert!(slots.is_waiting("c"));
        assert!(!slots.has_free_slot());
        assert!(slots.is_full_without("c"));
        assert!(!slots.is_full_without("a"));
        let roomy = AdapterSlots {
            max_loras: 2,
            running: vec!["a".into()],
            waiting: vec![],
        };
        assert!(roomy.has_free_slot() && !roomy.is_full_without("z"));
    }
}
