//! LoRA adapters as vLLM serves them (`--enable-lora --lora-modules …`): the adapters, their
//! place in block hashes and KV events, and vLLM's `vllm:lora_requests_info` gauge.
//!
//! * An adapter is loaded at start-up with an int id (1, 2, … in the order given, as vLLM's
//!   `OpenAIServingModels` counts them), its name (the `model` requests name it by) and its
//!   path. vLLM ≥ 0.31 hashes `("lora", name, path)` into every block of the adapter's requests
//!   (`llmgw::blockhash::LoraKey`), so its blocks never match the base model's or another
//!   adapter's; KV events publish the int id, the name, and the name as each block's extra key.
//! * [`LoraInfoGauge`] is vLLM's v1 Prometheus `vllm:lora_requests_info`: a gauge whose labels
//!   name the adapters and whose value is the time it was last set. Each label set ever seen
//!   stays exported (bounded here), so a scraper takes the series with the largest value.
//!
//! Plain data; the engine task owns the adapter bookkeeping, the gauge is shared behind a lock
//! (see `engine`).

use std::sync::Arc;

use llmgw::blockhash::LoraKey;
use serde::Deserialize;

/// One `--lora-modules` item: `name=path`, or vLLM's JSON form
/// `{"name": …, "path": …, "base_model_name": …}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraModule {
    pub name: String,
    pub path: String,
    /// The `parent` `/v1/models` lists (default: the first served model name).
    #[serde(default)]
    pub base_model_name: Option<String>,
}

/// Parses one `--lora-modules` item as vLLM's `LoRAParserAction` does: an item with `=` and
/// no `,` is `name=path`; anything else must be the JSON form.
pub fn parse_lora_module(item: &str) -> Result<LoraModule, String> {
    if item.contains('=') && !item.contains(',') {
        let mut parts = item.split('=');
        return match (parts.next(), parts.next(), parts.next()) {
            (Some(name), Some(path), None) => Ok(LoraModule {
                name: name.to_owned(),
                path: path.to_owned(),
                base_model_name: None,
            }),
            _ => Err(format!(
                "invalid --lora-modules item {item:?}: expected name=path"
            )),
        };
    }
    serde_json::from_str(item).map_err(|e| {
        if e.is_data() {
            format!("Invalid fields for --lora-modules: {item} - {e}")
        } else {
            format!("Invalid JSON format for --lora-modules: {item}")
        }
    })
}

/// A loaded adapter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoraAdapter {
    /// vLLM's `lora_int_id` (published as `lora_id`): 1, 2, … in the order given.
    pub id: u32,
    pub name: String,
    /// Where it was loaded from: hashed into its blocks, listed as its `root`.
    pub path: String,
    pub base_model_name: Option<String>,
}

impl LoraAdapter {
    /// What vLLM mixes into every block hash of this adapter's requests.
    pub fn key(&self) -> LoraKey<'_> {
        LoraKey {
            name: &self.name,
            path: &self.path,
        }
    }
}

/// Start-up errors for the adapters.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum LoraError {
    #[error("--lora-modules needs --enable-lora")]
    NotEnabled,
    /// vLLM's `load_lora_adapter` refuses a second adapter of the same name.
    #[error("The lora adapter '{0}' has already been loaded.")]
    Duplicate(String),
    #[error("too many LoRA adapters")]
    TooMany,
}

/// The adapters of `--lora-modules`, with ids 1, 2, … in the order given.
pub fn load_adapters(
    modules: &[LoraModule],
    enabled: bool,
) -> Result<Vec<Arc<LoraAdapter>>, LoraError> {
    if !modules.is_empty() && !enabled {
        return Err(LoraError::NotEnabled);
    }
    let mut out: Vec<Arc<LoraAdapter>> = Vec::with_capacity(modules.len());
    for (i, m) in modules.iter().enumerate() {
        if out.iter().any(|a| a.name == m.name) {
            return Err(LoraError::Duplicate(m.name.clone()));
        }
        let id = u32::try_from(i + 1).map_err(|_| LoraError::TooMany)?;
        out.push(Arc::new(LoraAdapter {
            id,
            name: m.name.clone(),
            path: m.path.clone(),
            base_model_name: m.base_model_name.clone(),
        }));
    }
    Ok(out)
}

/// How many old label sets `vllm:lora_requests_info` keeps (vLLM keeps every one; bounded here
/// so a long run's memory is too). The oldest-set one goes first.
pub const MAX_LORA_INFO_SERIES: usize = 64;

/// One series of `vllm:lora_requests_info`: its adapter labels and the unix time it was last
/// set.
#[derive(Debug, Clone, PartialEq)]
pub struct LoraInfoSample {
    pub running: String,
    pub waiting: String,
    pub value: f64,
}

/// vLLM's `vllm:lora_requests_info` gauge: `labels(...).set_to_current_time()` on every stats
/// update, each label set a series of its own that stays exported.
#[derive(Debug, Clone, Default)]
pub struct LoraInfoGauge {
    /// In first-seen order, as prometheus_client lists a labelled gauge's children.
    series: Vec<LoraInfoSample>,
    last: f64,
}

impl LoraInfoGauge {
    /// Sets the series `(running, waiting)` to `now` (unix seconds). Values only grow: a clock
    /// that did not advance since the last set still moves this one just past it, so the
    /// series set last is always the one with the largest value.
    pub fn set(&mut self, running: &str, waiting: &str, now: f64) {
        let value = if now > self.last {
            now
        } else {
            self.last.next_up()
        };
        self.last = value;
        if let Some(s) = self
            .series
            .iter_mut()
            .find(|s| s.running == running && s.waiting == waiting)
        {
            s.value = value;
            return;
        }
        self.series.push(LoraInfoSample {
            running: running.to_owned(),
            waiting: waiting.to_owned(),
            value,
        });
        if self.series.len() > MAX_LORA_INFO_SERIES
            && let Some(oldest) = self
                .series
                .iter()
                .enumerate()
                .min_by(|a, b| a.1.value.total_cmp(&b.1.value))
                .map(|(i, _)| i)
        {
            self.series.remove(oldest);
        }
    }

    /// Every series, in first-seen order.
    pub fn samples(&self) -> Vec<LoraInfoSample> {
        self.series.clone()
    }
}

/// The adapters with a request in the engine (waiting or running), in the order they became
/// active: vLLM's `LoRARequestStates` is a dict keyed by adapter name, entries added when a
/// request arrives and deleted once the adapter has none.
#[derive(Debug, Clone, Default)]
pub struct LoraActivity {
    order: Vec<Arc<LoraAdapter>>,
}

impl LoraActivity {
    /// A request for `adapter` arrived.
    pub fn arrived(&mut self, adapter: &Arc<LoraAdapter>) {
        if !self.order.iter().any(|a| a.id == adapter.id) {
            self.order.push(Arc::clone(adapter));
        }
    }

    /// Drops the adapters `active` says have no request left.
    pub fn retain(&mut self, mut active: impl FnMut(&LoraAdapter) -> bool) {
        self.order.retain(|a| active(a));
    }

    pub fn clear(&mut self) {
        self.order.clear();
    }

    /// vLLM ≥ 0.30's labels, `(running_lora_adapters, waiting_lora_adapters)`:
    /// `update_scheduler_stats` writes a count into *both* dicts for every active adapter (zero
    /// counts included) and the logger joins each dict's keys, so both labels name every
    /// adapter with a waiting or running request, comma-separated in the order they became
    /// active.
    pub fn labels(&self) -> (String, String) {
        let joined = self
            .order
            .iter()
            .map(|a| a.name.as_str())
            .collect::<Vec<_>>()
            .join(",");
        (joined.clone(), joined)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_module_forms_as_vllm() {
        assert_eq!(
            parse_lora_module("sql=/adapters/sql").unwrap(),
            LoraModule {
                name: "sql".into(),
                path: "/adapters/sql".into(),
                base_model_name: None,
            }
        );
        assert_eq!(
            parse_lora_module(r#"{"name":"a","path":"/p","base_model_name":"m"}"#).unwrap(),
            LoraModule {
                name: "a".into(),
                path: "/p".into(),
                base_model_name: Some("m".into()),
            }
        );
        // No comma: vLLM reads `=` items as name=path, so the JSON form needs two fields.
        assert_eq!(
            parse_lora_module(r#"{"name":"a", "path":"/x=y"}"#)
                .unwrap()
                .path,
            "/x=y"
        );
        for bad in [
            "a=b=c",
            "{",
            r#"{"name":"a"}"#,
            r#"{"name":"a","path":"/p","rank":8}"#,
            "plain",
        ] {
            assert!(parse_lora_module(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn adapters_get_ids_in_order_and_names_are_unique() {
        let m = |n: &str| LoraModule {
            name: n.into(),
            path: format!("/a/{n}"),
            base_model_name: None,
        };
        let loaded = load_adapters(&[m("x"), m("y")], true).unwrap();
        assert_eq!(
            loaded
                .iter()
                .map(|a| (a.id, a.name.as_str(), a.path.as_str()))
                .collect::<Vec<_>>(),
            vec![(1, "x", "/a/x"), (2, "y", "/a/y")]
        );
        assert_eq!(
            load_adapters(&[m("x"), m("x")], true),
            Err(LoraError::Duplicate("x".into()))
        );
        assert_eq!(load_adapters(&[m("x")], false), Err(LoraError::NotEnabled));
        assert!(load_adapters(&[], false).unwrap().is_empty());
    }

    #[test]
    fn the_gauge_keeps_every_label_set_bounded_and_the_latest_is_largest() {
        let mut g = LoraInfoGauge::default();
        g.set("a", "a", 100.0);
        g.set("", "", 100.0); // a clock that did not advance
        g.set("a", "a", 99.0); // nor one that stepped back
        let samples = g.samples();
        assert_eq!(samples.len(), 2, "one series per label set");
        let latest = samples
            .iter()
            .max_by(|a, b| a.value.total_cmp(&b.value))
            .unwrap();
        assert_eq!(latest.running, "a");
        assert!(samples[1].value > 100.0 && latest.value > samples[1].value);

        for i in 0..200 {
            g.set(&format!("n{i}"), "", 200.0 + f64::from(i));
        }
        let samples = g.samples();
        assert_eq!(samples.len(), MAX_LORA_INFO_SERIES);
        assert!(
            samples.iter().all(|s| s.running.starts_with('n')),
            "the oldest sets went first"
        );
        assert_eq!(samples.last().unwrap().running, "n199");
    }

    #[test]
    fn activity_names_adapters_in_the_order_they_became_active() {
        let adapter = |id: u32, name: &str| {
            Arc::new(LoraAdapter {
                id,
                name: name.into(),
                path: format!("/{name}"),
                base_model_name: None,
            })
        };
        let (a, b) = (adapter(1, "a"), adapter(2, "b"));
        let mut act = LoraActivity::default();
        assert_eq!(act.labels(), (String::new(), String::new()));
        act.arrived(&b);
        act.arrived(&a);
        act.arrived(&b);
        assert_eq!(act.labels(), ("b,a".to_owned(), "b,a".to_owned()));
        act.retain(|x| x.name != "b");
        act.arrived(&b);
        assert_eq!(act.labels().0, "a,b", "a returning adapter goes last");
        act.clear();
        assert_eq!(act.labels().1, "");
    }
}
