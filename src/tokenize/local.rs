//! A model's own tokenizer, loaded from a user-supplied `tokenizer.json` (HF `tokenizers`), for
//! completion prompts: no network round trip. Chat requests still go to `/tokenize`, because the
//! chat template lives with the engine.

use std::path::Path;
use std::sync::Arc;

/// Why a local tokenizer could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LocalTokenizerError {
    #[error("cannot load tokenizer {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("local tokenization failed: {0}")]
    Encode(String),
}

/// A loaded `tokenizer.json`, shared by every request for its model.
#[derive(Clone)]
pub struct LocalTokenizer {
    inner: Arc<tokenizers::Tokenizer>,
}

impl LocalTokenizer {
    pub fn from_file(path: &Path) -> Result<Self, LocalTokenizerError> {
        let inner =
            tokenizers::Tokenizer::from_file(path).map_err(|e| LocalTokenizerError::Load {
                path: path.display().to_string(),
                reason: e.to_string(),
            })?;
        Ok(LocalTokenizer {
            inner: Arc::new(inner),
        })
    }

    /// Token ids of a completion prompt, with special tokens added as vLLM's
    /// `/v1/completions` does by default.
    pub fn encode_prompt(&self, prompt: &str) -> Result<Vec<u32>, LocalTokenizerError> {
        self.inner
            .encode(prompt, true)
            .map(|encoding| encoding.get_ids().to_vec())
            .map_err(|e| LocalTokenizerError::Encode(e.to_string()))
    }
}

impl std::fmt::Debug for LocalTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalTokenizer")
            .field("vocab", &self.inner.get_vocab_size(true))
            .finish()
    }
}
