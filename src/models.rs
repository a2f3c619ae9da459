//! Per-model engine settings: how the engines hash blocks (algo, seed, block size, salt
//! encoding) and, optionally, a local tokenizer. Read by the agent feed (which refuses an engine
//! whose reported settings differ) and by the precise `kv_cache` scorer (which hashes prompts
//! with them), so it lives here beside [`crate::blockhash`] rather than inside either.
//!
//! Concurrency: plain values, built once at start-up and shared read-only.
//!
//! Given on the command line as `--model MODEL=block_size=16,algo=sha256_cbor,seed=1729` (keys
//! in any order; `salt=untagged` for vLLM < 0.31, `tokenizer=PATH` for a tokenizer.json or a
//! model directory, `chat_template=PATH` for a Jinja file overriding the one in the
//! tokenizer's `tokenizer_config.json`), or in the YAML file under `models:`. A model without an entry is routed by the approximate tier.

use std::collections::HashMap;
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::Arc;

use serde::Deserialize;

use crate::blockhash::{BlockHashError, BlockHasher, HashAlgo, HashSettings, SaltEncoding};
use crate::tokenize::{LocalTokenizer, LocalTokenizerError, Tokenizer};

/// Each model's engine hash settings, as a block hasher.
pub type HashersByModel = HashMap<String, Arc<BlockHasher>>;

/// One model's engine settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelSettings {
    pub model: String,
    pub hashing: HashSettings,
    /// A `tokenizer.json` (or a model directory) to tokenize in process.
    pub tokenizer: Option<PathBuf>,
    /// A chat template overriding the one in `tokenizer_config.json` (needs `tokenizer`).
    pub chat_template: Option<PathBuf>,
}

/// Why a model's settings are unusable.
#[derive(Debug, thiserror::Error)]
pub enum ModelSettingsError {
    #[error(
        "--model {0:?}: expected MODEL=block_size=N[,algo=A][,seed=S][,salt=tagged|untagged][,tokenizer=PATH][,chat_template=PATH]"
    )]
    Syntax(String),
    #[error("--model {0:?}: chat_template needs tokenizer")]
    TemplateWithoutTokenizer(String),
    #[error("--model {spec:?}: unknown key {key:?}")]
    UnknownKey { spec: String, key: String },
    #[error("--model {spec:?}: block_size must be a positive integer")]
    BlockSize { spec: String },
    #[error("model {model:?}: {source}")]
    Hashing {
        model: String,
        #[source]
        source: BlockHashError,
    },
    #[error("model {model:?}: {source}")]
    Tokenizer {
        model: String,
        #[source]
        source: LocalTokenizerError,
    },
}

impl FromStr for ModelSettings {
    type Err = ModelSettingsError;

    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let syntax = || ModelSettingsError::Syntax(spec.to_owned());
        let (model, rest) = spec.split_once('=').ok_or_else(syntax)?;
        if model.is_empty() {
            return Err(syntax());
        }
        let mut block_size = None;
        let mut algo = HashAlgo::default();
        let mut seed = None;
        let mut salt_encoding = SaltEncoding::default();
        let mut tokenizer = None;
        let mut chat_template = None;
        for pair in rest.split(',') {
            let (key, value) = pair.split_once('=').ok_or_else(syntax)?;
            let hashing_error = |source| ModelSettingsError::Hashing {
                model: model.to_owned(),
                source,
            };
            match key {
                "block_size" => {
                    block_size = Some(value.parse::<NonZeroUsize>().map_err(|_| {
                        ModelSettingsError::BlockSize {
                            spec: spec.to_owned(),
                        }
                    })?)
                }
                "algo" => algo = value.parse().map_err(hashing_error)?,
                "seed" => seed = Some(value.to_owned()),
                "salt" => salt_encoding = value.parse().map_err(hashing_error)?,
                "tokenizer" => tokenizer = Some(PathBuf::from(value)),
                "chat_template" => chat_template = Some(PathBuf::from(value)),
                other => {
                    return Err(ModelSettingsError::UnknownKey {
                        spec: spec.to_owned(),
                        key: other.to_owned(),
                    });
                }
            }
        }
        let block_size = block_size.ok_or(ModelSettingsError::BlockSize {
            spec: spec.to_owned(),
        })?;
        if chat_template.is_some() && tokenizer.is_none() {
            return Err(ModelSettingsError::TemplateWithoutTokenizer(
                spec.to_owned(),
            ));
        }
        Ok(ModelSettings {
            model: model.to_owned(),
            hashing: HashSettings {
                algo,
                seed,
                block_size,
                salt_encoding,
            },
            tokenizer,
            chat_template,
        })
    }
}

/// The YAML form, one entry of `models:`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileModel {
    pub name: String,
    pub block_size: NonZeroUsize,
    #[serde(default = "default_algo")]
    pub hash_algo: String,
    /// The engines' PYTHONHASHSEED (omit when unset; an empty string is a seed).
    #[serde(default)]
    pub hash_seed: Option<String>,
    #[serde(default = "default_salt")]
    pub salt_encoding: String,
    #[serde(default)]
    pub tokenizer: Option<PathBuf>,
    #[serde(default)]
    pub chat_template: Option<PathBuf>,
}

fn default_algo() -> String {
    HashAlgo::default().as_str().to_owned()
}

fn default_salt() -> String {
    SaltEncoding::default().as_str().to_owned()
}

impl TryFrom<FileModel> for ModelSettings {
    type Error = ModelSettingsError;

    fn try_from(file: FileModel) -> Result<Self, Self::Error> {
        let hashing_error = |source| ModelSettingsError::Hashing {
            model: file.name.clone(),
            source,
        };
        if file.chat_template.is_some() && file.tokenizer.is_none() {
            return Err(ModelSettingsError::TemplateWithoutTokenizer(file.name));
        }
        Ok(ModelSettings {
            hashing: HashSettings {
                algo: file.hash_algo.parse().map_err(hashing_error)?,
                seed: file.hash_seed.clone(),
                block_size: file.block_size,
                salt_encoding: file.salt_encoding.parse().map_err(hashing_error)?,
            },
            tokenizer: file.tokenizer.clone(),
            chat_template: file.chat_template.clone(),
            model: file.name,
        })
    }
}

/// Builds every model's block hasher, refusing settings vLLM itself could not reproduce.
pub fn hashers(models: &[ModelSettings]) -> Result<HashersByModel, ModelSettingsError> {
    models
        .iter()
        .map(|m| {
            BlockHasher::new(&m.hashing)
                .map(|h| (m.model.clone(), Arc::new(h)))
                .map_err(|source| ModelSettingsError::Hashing {
                    model: m.model.clone(),
                    source,
                })
        })
        .collect::<Result<HashMap<_, _>, _>>()
}

/// Adds each model's local tokenizer to `tokenizer`.
pub fn with_local_tokenizers(
    mut tokenizer: Tokenizer,
    models: &[ModelSettings],
) -> Result<Tokenizer, ModelSettingsError> {
    for m in models {
        if let Some(path) = &m.tokenizer {
            let local =
                LocalTokenizer::load(path, m.chat_template.as_deref()).map_err(|source| {
                    ModelSettingsError::Tokenizer {
                        model: m.model.clone(),
                        source,
                    }
                })?;
            tokenizer = tokenizer.with_local(m.model.clone(), local);
        }
    }
    Ok(tokenizer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_flag_form() {
        let m: ModelSettings = "tiny=block_size=32,seed=1729,algo=xxhash_cbor,salt=untagged"
            .parse()
            .expect("parses");
        assert_eq!(m.model, "tiny");
        assert_eq!(m.hashing.block_size.get(), 32);
        assert_eq!(m.hashing.algo, HashAlgo::XxhashCbor);
        assert_eq!(m.hashing.seed.as_deref(), Some("1729"));
        assert_eq!(m.hashing.salt_encoding, SaltEncoding::Untagged);
        let d: ModelSettings = "m=block_size=16".parse().expect("defaults");
        assert_eq!(d.hashing.algo, HashAlgo::Sha256Cbor);
        assert_eq!(d.hashing.seed, None);
        assert_eq!(d.hashing.salt_encoding, SaltEncoding::Tagged);
        let t: ModelSettings = "m=block_size=16,tokenizer=/models/m,chat_template=/t/chat.jinja"
            .parse()
            .expect("tokenizer and template");
        assert_eq!(
            t.tokenizer.as_deref(),
            Some(std::path::Path::new("/models/m"))
        );
        assert_eq!(
            t.chat_template.as_deref(),
            Some(std::path::Path::new("/t/chat.jinja"))
        );
    }

    #[test]
    fn bad_flags_say_what_is_wrong() {
        for (spec, expect) in [
            ("tiny", "expected MODEL="),
            ("=block_size=16", "expected MODEL="),
            ("m=seed=1", "block_size"),
            ("m=block_size=0", "block_size"),
            ("m=block_size=16,colour=red", "colour"),
            (
                "m=block_size=16,chat_template=t.jinja",
                "chat_template needs tokenizer",
            ),
            ("m=block_size=16,algo=sha256", "sha256"),
        ] {
            let err = spec.parse::<ModelSettings>().unwrap_err().to_string();
            assert!(err.contains(expect), "{spec}: {err}");
        }
    }

    #[test]
    fn xxhash_without_a_seed_is_refused_when_building() {
        let m: ModelSettings = "m=block_size=16,algo=xxhash_cbor".parse().expect("parses");
        let err = hashers(&[m]).unwrap_err().to_string();
        assert!(err.contains("seed"), "{err}");
    }

    #[test]
    fn the_file_form_has_the_same_meaning() {
        let file: FileModel = serde_yaml::from_str(
            "name: tiny\nblock_size: 16\nhash_seed: \"1729\"\ntokenizer: /t.json\n",
        )
        .expect("yaml");
        let m = ModelSettings::try_from(file).expect("valid");
        assert_eq!(
            m,
            "tiny=block_size=16,seed=1729,tokenizer=/t.json"
                .parse()
                .expect("flag")
        );
        assert!(serde_yaml::from_str::<FileModel>("name: x\nblock_size: 16\nbogus: 1\n").is_err());
    }
}
