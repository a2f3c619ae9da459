//! Checks that an engine hashes blocks the way the routers will.
//!
//! For a `BlockStored` that starts a chain (no parent) on the GPU tier, block 0 is recomputed
//! from its `token_ids` with the configured algo and seed (and the `cache_salt` its extra keys
//! carry) and compared with the hash the engine published. A mismatch almost always means the
//! engine runs with another `PYTHONHASHSEED` or `--prefix-caching-hash-algo` than the agent was
//! told: then every router-side hash misses, so the engine's blocks must be kept out of the
//! precise index. Pure and `Send + Sync`.

use llmgw_core::blockhash::{BlockHashError, BlockHasher, HashSettings};
use llmgw_core::kv_event::Medium as Tier;

use crate::wire::{BlockStored, ExternalHash, FirstBlockKeys, Medium};

/// The outcome of checking one event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Match,
    /// Block 0 hashes differently: the seed or algo differ.
    Mismatch {
        published: ExternalHash,
        computed: ExternalHash,
    },
    /// The engine's block size is not the configured one.
    BlockSizeMismatch {
        published: u32,
        configured: usize,
    },
    /// Nothing to check (a continuation, an offload placeholder, LoRA or multimodal keys).
    Skipped,
}

/// Recomputes block 0 for one engine's settings.
#[derive(Debug, Clone)]
pub struct HashCheck {
    settings: HashSettings,
    hasher: BlockHasher,
}

impl HashCheck {
    pub fn new(settings: HashSettings) -> Result<Self, BlockHashError> {
        let hasher = BlockHasher::new(&settings)?;
        Ok(HashCheck { settings, hasher })
    }

    pub fn settings(&self) -> &HashSettings {
        &self.settings
    }

    pub fn check(&self, ev: &BlockStored) -> Verdict {
        let Some(&published) = ev.block_hashes.first() else {
            return Verdict::Skipped;
        };
        if ev.parent_block_hash.is_some()
            || Medium::tier(ev.medium.as_ref()) != Tier::Gpu
            || ev.block_size == 0
        {
            return Verdict::Skipped;
        }
        let configured = self.hasher.block_size();
        if usize::try_from(ev.block_size).ok() != Some(configured) {
            return Verdict::BlockSizeMismatch {
                published: ev.block_size,
                configured,
            };
        }
        let Some(tokens) = ev.token_ids.get(..configured) else {
            return Verdict::Skipped;
        };
        let salt = match ev.first_block_keys() {
            FirstBlockKeys::Plain => None,
            FirstBlockKeys::Salt(salt) => Some(salt),
            FirstBlockKeys::Other => return Verdict::Skipped,
        };
        let computed = self.hasher.first_block(tokens, salt).external();
        if computed == published {
            Verdict::Match
        } else {
            Verdict::Mismatch {
                published,
                computed,
            }
        }
    }

    /// The log line for a failed check, naming the likely cause.
    pub fn explain(&self, engine: &str, verdict: &Verdict) -> Option<String> {
        let seed = self.settings.seed.as_deref().unwrap_or("<unset>");
        match verdict {
            Verdict::Mismatch {
                published,
                computed,
            } => Some(format!(
                "engine {engine}: hash mismatch: block 0 published as {published}, but {algo} \
                 with PYTHONHASHSEED={seed} gives {computed}; the engine's PYTHONHASHSEED or \
                 --prefix-caching-hash-algo differs from the agent's settings (start vLLM with \
                 the flags `llmgw-agent vllm-args` prints); its blocks are withheld from the \
                 precise index",
                algo = self.settings.algo,
            )),
            Verdict::BlockSizeMismatch {
                published,
                configured,
            } => Some(format!(
                "engine {engine}: hash mismatch: the engine uses block size {published}, the \
                 agent is configured for {configured}; its blocks are withheld from the precise \
                 index"
            )),
            Verdict::Match | Verdict::Skipped => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroUsize;

    use super::*;
    use crate::capture::Capture;
    use crate::wire::{KvEvent, decode_batch};

    fn check(seed: &str, block_size: usize) -> HashCheck {
        let size = NonZeroUsize::new(block_size).expect("non-zero");
        HashCheck::new(HashSettings::sha256_cbor(size, Some(seed))).expect("settings")
    }

    fn capture_roots() -> Vec<BlockStored> {
        let cap = Capture::parse(&llmgw_core::fixtures::read("vllm-0.32.0-capture.jsonl"))
            .expect("capture");
        cap.frames
            .iter()
            .flat_map(|f| decode_batch(&f.payload).expect("decodes").events)
            .filter_map(|e| match e {
                KvEvent::BlockStored(s) if s.parent_block_hash.is_none() => Some(s),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn the_capture_verifies_with_its_seed_including_the_salted_root() {
        let roots = capture_roots();
        assert!(roots.len() >= 3, "{} roots", roots.len());
        assert!(
            roots
                .iter()
                .any(|r| matches!(r.first_block_keys(), FirstBlockKeys::Salt(_)))
        );
        let c = check("1729", 32);
        for r in &roots {
            assert_eq!(c.check(r), Verdict::Match);
        }
    }

    #[test]
    fn a_wrong_seed_is_a_mismatch_naming_the_cause() {
        let c = check("1730", 32);
        for r in capture_roots() {
            let v = c.check(&r);
            assert!(matches!(v, Verdict::Mismatch { .. }), "{v:?}");
            let line = c.explain("e0", &v).expect("explained");
            assert!(line.contains("PYTHONHASHSEED") && line.contains("sha256_cbor"));
        }
    }

    #[test]
    fn a_wrong_block_size_is_reported_and_continuations_are_skipped() {
        let roots = capture_roots();
        let v = check("1729", 16).check(&roots[0]);
        assert_eq!(
            v,
            Verdict::BlockSizeMismatch {
                published: 32,
                configured: 16
            }
        );
        let mut cont = roots[0].clone();
        cont.parent_block_hash = Some(ExternalHash(1));
        assert_eq!(check("1729", 32).check(&cont), Verdict::Skipped);
        let mut lora = roots[0].clone();
        lora.lora_name = Some("adapter".into());
        assert_eq!(check("1729", 32).check(&lora), Verdict::Skipped);
    }
}
