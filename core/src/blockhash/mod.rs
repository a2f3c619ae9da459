//! Block hashes computed exactly as vLLM's prefix cache computes them.
//!
//! vLLM (≥ 0.10.2, `vllm/v1/core/kv_cache_utils.py`) hashes a prompt in full blocks of
//! `block_size` tokens, chaining each block to the digest of the one before:
//!
//! ```text
//! NONE_HASH = H(cbor(seed as text))
//! h_i       = H(cbor([h_{i-1} or NONE_HASH, [tokens of block i], extra_keys_i or null]))
//! ```
//!
//! with canonical CBOR and `H` SHA-256 (`sha256_cbor`) or XXH3-128 (`xxhash_cbor`). Trailing
//! tokens short of a full block are never hashed. Engines publish a block's *external* hash in
//! KV events: the digest's last 8 bytes read big-endian ([`ExternalHash`]).
//!
//! Everything here is pure and `Send + Sync`: a [`BlockHasher`] is built once per set of engine
//! settings and shared by reference. A block of up to 64 tokens without extra keys is encoded
//! into a stack buffer (one per prompt, its heads written once), padded in place and hashed in
//! one shot; larger items stream through a small stack buffer. No block allocates.

mod cbor;

use std::fmt;
use std::num::NonZeroUsize;
use std::str::FromStr;

use sha2::Digest as _;

pub use cbor::{ExtraKey, encode_block, encode_text};

/// The seed vLLM ≥ 0.29 uses for the sha256 family when `PYTHONHASHSEED` is unset.
pub const DEFAULT_SHA256_SEED: &str = "vllm-none-hash";

/// Errors from building a [`BlockHasher`] or parsing its settings.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BlockHashError {
    #[error(
        "unknown prefix-caching hash algorithm {0:?}: llmgw reproduces only sha256_cbor and \
         xxhash_cbor (the pickle-based sha256 and xxhash cannot be recomputed outside Python)"
    )]
    UnknownAlgo(String),
    #[error(
        "xxhash_cbor needs an explicit seed: with PYTHONHASHSEED unset vLLM picks a random one, \
         so no other process can reproduce its hashes"
    )]
    XxhashNeedsSeed,
    #[error("unknown cache_salt encoding {0:?}: expected tagged or untagged")]
    UnknownSaltEncoding(String),
}

/// `--prefix-caching-hash-algo` values whose hashes can be recomputed outside vLLM.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum HashAlgo {
    #[default]
    Sha256Cbor,
    XxhashCbor,
}

impl HashAlgo {
    pub const fn as_str(self) -> &'static str {
        match self {
            HashAlgo::Sha256Cbor => "sha256_cbor",
            HashAlgo::XxhashCbor => "xxhash_cbor",
        }
    }

    /// Digest length in bytes (32 for SHA-256, 16 for XXH3-128).
    pub const fn digest_len(self) -> usize {
        match self {
            HashAlgo::Sha256Cbor => 32,
            HashAlgo::XxhashCbor => 16,
        }
    }
}

impl fmt::Display for HashAlgo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for HashAlgo {
    type Err = BlockHashError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "sha256_cbor" => Ok(HashAlgo::Sha256Cbor),
            "xxhash_cbor" => Ok(HashAlgo::XxhashCbor),
            other => Err(BlockHashError::UnknownAlgo(other.to_owned())),
        }
    }
}

/// How `cache_salt` enters block 0's extra keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum SaltEncoding {
    /// `("cache_salt", salt)`, as vLLM ≥ 0.31 hashes it.
    #[default]
    Tagged,
    /// The bare salt string, as vLLM 0.9 – 0.30 hashes it.
    Untagged,
}

impl SaltEncoding {
    pub const fn as_str(self) -> &'static str {
        match self {
            SaltEncoding::Tagged => "tagged",
            SaltEncoding::Untagged => "untagged",
        }
    }
}

impl fmt::Display for SaltEncoding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SaltEncoding {
    type Err = BlockHashError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "tagged" => Ok(SaltEncoding::Tagged),
            "untagged" => Ok(SaltEncoding::Untagged),
            other => Err(BlockHashError::UnknownSaltEncoding(other.to_owned())),
        }
    }
}

/// An engine's hashing settings: everything that must agree between vLLM and llmgw.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HashSettings {
    pub algo: HashAlgo,
    /// The engine's `PYTHONHASHSEED`; `None` when unset (an empty string counts as set).
    pub seed: Option<String>,
    pub block_size: NonZeroUsize,
    pub salt_encoding: SaltEncoding,
}

impl HashSettings {
    /// vLLM's defaults for the sha256_cbor algo with the given block size and seed.
    pub fn sha256_cbor(block_size: NonZeroUsize, seed: Option<&str>) -> Self {
        HashSettings {
            algo: HashAlgo::Sha256Cbor,
            seed: seed.map(str::to_owned),
            block_size,
            salt_encoding: SaltEncoding::Tagged,
        }
    }
}

/// A full block digest: 32 bytes for SHA-256, 16 for XXH3-128.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct BlockDigest {
    bytes: [u8; 32],
    len: u8,
}

impl BlockDigest {
    fn from_slice(digest: &[u8]) -> Self {
        let mut bytes = [0u8; 32];
        bytes[..digest.len()].copy_from_slice(digest);
        BlockDigest {
            bytes,
            len: digest.len() as u8,
        }
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }

    /// What engines publish in KV events: the digest's last 8 bytes, big-endian.
    pub fn external(&self) -> ExternalHash {
        ExternalHash::from_digest_bytes(self.as_bytes())
    }

    pub fn to_hex(&self) -> String {
        hex::encode(self.as_bytes())
    }
}

impl fmt::Debug for BlockDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockDigest({})", self.to_hex())
    }
}

/// A block's hash as engines publish it in KV events and as the KV index keys it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExternalHash(pub u64);

impl ExternalHash {
    /// The last 8 bytes of a digest read big-endian (vLLM's `maybe_convert_block_hash`); a
    /// shorter input is zero-extended on the left.
    pub fn from_digest_bytes(digest: &[u8]) -> Self {
        let tail = &digest[digest.len().saturating_sub(8)..];
        let mut be = [0u8; 8];
        be[8 - tail.len()..].copy_from_slice(tail);
        ExternalHash(u64::from_be_bytes(be))
    }
}

impl fmt::Display for ExternalHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Hashes blocks for one engine configuration.
#[derive(Debug, Clone)]
pub struct BlockHasher {
    algo: HashAlgo,
    block_size: NonZeroUsize,
    salt_encoding: SaltEncoding,
    none_hash: BlockDigest,
}

impl BlockHasher {
    pub fn new(settings: &HashSettings) -> Result<Self, BlockHashError> {
        let seed = match (&settings.seed, settings.algo) {
            (Some(seed), _) => seed.as_str(),
            (None, HashAlgo::Sha256Cbor) => DEFAULT_SHA256_SEED,
            (None, HashAlgo::XxhashCbor) => return Err(BlockHashError::XxhashNeedsSeed),
        };
        let none_hash = match settings.algo {
            HashAlgo::Sha256Cbor => digest_text::<sha2::Sha256>(seed),
            HashAlgo::XxhashCbor => digest_text::<xxhash_rust::xxh3::Xxh3>(seed),
        };
        Ok(BlockHasher {
            algo: settings.algo,
            block_size: settings.block_size,
            salt_encoding: settings.salt_encoding,
            none_hash,
        })
    }

    pub fn algo(&self) -> HashAlgo {
        self.algo
    }

    pub fn block_size(&self) -> usize {
        self.block_size.get()
    }

    pub fn salt_encoding(&self) -> SaltEncoding {
        self.salt_encoding
    }

    /// `NONE_HASH`: the parent of every chain's first block.
    pub fn none_hash(&self) -> &BlockDigest {
        &self.none_hash
    }

    /// One block: `H(cbor([parent or NONE_HASH, tokens, extra_keys or null]))`.
    pub fn hash_block<T: Copy + Into<u64>>(
        &self,
        parent: Option<&BlockDigest>,
        tokens: &[T],
        extra_keys: Option<&[ExtraKey<'_>]>,
    ) -> BlockDigest {
        let parent = parent.unwrap_or(&self.none_hash).as_bytes();
        match self.algo {
            HashAlgo::Sha256Cbor => digest_block::<sha2::Sha256, T>(parent, tokens, extra_keys),
            HashAlgo::XxhashCbor => {
                digest_block::<xxhash_rust::xxh3::Xxh3, T>(parent, tokens, extra_keys)
            }
        }
    }

    /// Block 0 of a request with this `cache_salt`, in the configured encoding.
    pub fn first_block<T: Copy + Into<u64>>(
        &self,
        tokens: &[T],
        cache_salt: Option<&str>,
    ) -> BlockDigest {
        self.request_block(None, tokens, RequestKeys::salted(cache_salt))
    }

    /// A block of a request whose keys are `keys`: vLLM adds the LoRA adapter to **every**
    /// block's extra keys and the `cache_salt` to block 0's (the block without a parent), in
    /// that order (`generate_block_hash_extra_keys`), tagged or bare as the engine's version
    /// does ([`SaltEncoding`] covers both).
    pub fn request_block<T: Copy + Into<u64>>(
        &self,
        parent: Option<&BlockDigest>,
        tokens: &[T],
        keys: RequestKeys<'_>,
    ) -> BlockDigest {
        let tagged = self.salt_encoding == SaltEncoding::Tagged;
        let lora_tuple = keys.lora.map(|l| {
            [
                ExtraKey::Text("lora"),
                ExtraKey::Text(l.name),
                ExtraKey::Text(l.path),
            ]
        });
        let salt_tuple = keys
            .cache_salt
            .map(|salt| [ExtraKey::Text("cache_salt"), ExtraKey::Text(salt)]);
        let mut extra = [ExtraKey::Int(0); 2];
        let mut len = 0;
        if let (Some(lora), Some(tuple)) = (keys.lora, &lora_tuple) {
            extra[len] = if tagged {
                ExtraKey::Tuple(tuple)
            } else {
                ExtraKey::Text(lora.name)
            };
            len += 1;
        }
        if parent.is_none()
            && let (Some(salt), Some(tuple)) = (keys.cache_salt, &salt_tuple)
        {
            extra[len] = if tagged {
                ExtraKey::Tuple(tuple)
            } else {
                ExtraKey::Text(salt)
            };
            len += 1;
        }
        self.hash_block(parent, tokens, (len > 0).then_some(&extra[..len]))
    }

    /// The digests of every full block of a prompt, in order.
    pub fn prompt_blocks<'a, T: Copy + Into<u64>>(
        &'a self,
        tokens: &'a [T],
        cache_salt: Option<&'a str>,
    ) -> PromptBlocks<'a, T> {
        self.request_blocks(tokens, RequestKeys::salted(cache_salt))
    }

    /// The digests of every full block of a request's prompt (LoRA adapter, salt), in order.
    pub fn request_blocks<'a, T: Copy + Into<u64>>(
        &'a self,
        tokens: &'a [T],
        keys: RequestKeys<'a>,
    ) -> PromptBlocks<'a, T> {
        let mut blocks = PromptBlocks {
            blocks: tokens.chunks_exact(self.block_size.get()),
            chain: Chain::new(self, keys),
            encoder: cbor::BlockEncoder::empty(),
        };
        blocks.chain.start(&mut blocks.encoder);
        blocks
    }

    /// Appends the external hashes of every full block of a prompt to `out`.
    pub fn external_hashes_into<T: Copy + Into<u64>>(
        &self,
        tokens: &[T],
        cache_salt: Option<&str>,
        out: &mut Vec<ExternalHash>,
    ) {
        self.request_hashes_into(tokens, RequestKeys::salted(cache_salt), out);
    }

    /// Appends the external hashes of every full block of a request's prompt to `out`.
    pub fn request_hashes_into<T: Copy + Into<u64>>(
        &self,
        tokens: &[T],
        keys: RequestKeys<'_>,
        out: &mut Vec<ExternalHash>,
    ) {
        out.reserve(tokens.len() / self.block_size.get());
        // The encoder stays in this frame rather than moving with an iterator: its buffer is
        // a few hundred bytes.
        let mut encoder = cbor::BlockEncoder::empty();
        let mut chain = Chain::new(self, keys);
        chain.start(&mut encoder);
        for block in tokens.chunks_exact(self.block_size.get()) {
            out.push(chain.next(&mut encoder, block).external());
        }
    }
}

/// A LoRA adapter as vLLM mixes it into its requests' blocks: its name and the path it was
/// loaded from (vLLM ≥ 0.31 hashes both; `/v1/models` lists the path as the adapter's `root`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LoraKey<'a> {
    pub name: &'a str,
    pub path: &'a str,
}

/// What a request adds to its blocks' hashes besides the tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct RequestKeys<'a> {
    /// On every block.
    pub lora: Option<LoraKey<'a>>,
    /// On block 0 only (and, through the chain, on every later hash).
    pub cache_salt: Option<&'a str>,
}

impl<'a> RequestKeys<'a> {
    /// A base-model request with this salt (or none).
    pub fn salted(cache_salt: Option<&'a str>) -> Self {
        RequestKeys {
            lora: None,
            cache_salt,
        }
    }
}

/// Iterator over a prompt's block digests; see [`BlockHasher::prompt_blocks`].
pub struct PromptBlocks<'a, T> {
    blocks: std::slice::ChunksExact<'a, T>,
    chain: Chain<'a>,
    encoder: cbor::BlockEncoder,
}

impl<T: Copy + Into<u64>> Iterator for PromptBlocks<'_, T> {
    type Item = BlockDigest;

    fn next(&mut self) -> Option<BlockDigest> {
        let block = self.blocks.next()?;
        Some(self.chain.next(&mut self.encoder, block))
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.blocks.size_hint()
    }
}

impl<T: Copy + Into<u64>> ExactSizeIterator for PromptBlocks<'_, T> {}

/// One request's blocks hashed in order, each chained to the one before. The blocks without
/// extra keys (every block without a LoRA adapter, every one but block 0 with a salt) are
/// encoded by one [`cbor::BlockEncoder`] kept for the whole prompt, its parent slot holding
/// `parent` (or `NONE_HASH`); the caller owns it, so that it is not moved.
struct Chain<'a> {
    hasher: &'a BlockHasher,
    keys: RequestKeys<'a>,
    parent: Option<BlockDigest>,
}

impl<'a> Chain<'a> {
    fn new(hasher: &'a BlockHasher, keys: RequestKeys<'a>) -> Self {
        Chain {
            hasher,
            keys,
            parent: None,
        }
    }

    /// Starts `encoder` for this chain's blocks (when they can have no extra keys).
    fn start(&self, encoder: &mut cbor::BlockEncoder) {
        let none_hash = self.hasher.none_hash.as_bytes();
        if self.keys.lora.is_none() && encoder.start(none_hash.len(), self.hasher.block_size.get())
        {
            encoder.set_parent(none_hash);
        }
    }

    #[inline]
    fn next<T: Copy + Into<u64>>(
        &mut self,
        encoder: &mut cbor::BlockEncoder,
        block: &[T],
    ) -> BlockDigest {
        let plain = self.parent.is_some() || self.keys.cache_salt.is_none();
        // An encoder not started (a LoRA request, blocks over 64 tokens) takes no block.
        let fast = match (plain, self.hasher.algo) {
            (false, _) => None,
            (true, HashAlgo::Sha256Cbor) => encoder.hash::<sha2::Sha256, T>(block),
            (true, HashAlgo::XxhashCbor) => encoder.hash::<xxhash_rust::xxh3::Xxh3, T>(block),
        };
        let digest = fast.unwrap_or_else(|| {
            self.hasher
                .request_block(self.parent.as_ref(), block, self.keys)
        });
        encoder.set_parent(digest.as_bytes());
        self.parent = Some(digest);
        digest
    }
}

/// The two hash functions behind one interface, so the CBOR encoder is shared: streamed for
/// the rare large item, one shot over a padded stack buffer for the common block.
trait StreamHash: Default {
    fn update(&mut self, bytes: &[u8]);
    fn finish(self) -> BlockDigest;
    /// The digest of `buf[..len]`; the bytes after `len` are scratch.
    fn one_shot(buf: &mut cbor::EncBuf, len: usize) -> BlockDigest;
}

/// SHA-256's initial state (FIPS 180-4 §5.3.3).
const SHA256_IV: [u32; 8] = [
    0x6a09_e667,
    0xbb67_ae85,
    0x3c6e_f372,
    0xa54f_f53a,
    0x510e_527f,
    0x9b05_688c,
    0x1f83_d9ab,
    0x5be0_cd19,
];

impl StreamHash for sha2::Sha256 {
    fn update(&mut self, bytes: &[u8]) {
        sha2::Digest::update(self, bytes);
    }
    fn finish(self) -> BlockDigest {
        BlockDigest::from_slice(self.finalize().as_slice())
    }
    /// Pads in place and compresses every block in one call: a block is only ~100 bytes, and
    /// the streaming API's buffering and finalisation cost about as much as encoding it.
    #[inline]
    fn one_shot(buf: &mut cbor::EncBuf, len: usize) -> BlockDigest {
        let padded = cbor::pad_sha256(buf, len);
        let mut state = SHA256_IV;
        let (blocks, _) = buf[..padded].as_chunks::<64>();
        sha2::block_api::compress256(&mut state, blocks);
        let mut bytes = [0u8; 32];
        for (out, word) in bytes.chunks_exact_mut(4).zip(state) {
            out.copy_from_slice(&word.to_be_bytes());
        }
        BlockDigest { bytes, len: 32 }
    }
}

impl StreamHash for xxhash_rust::xxh3::Xxh3 {
    fn update(&mut self, bytes: &[u8]) {
        xxhash_rust::xxh3::Xxh3::update(self, bytes);
    }
    fn finish(self) -> BlockDigest {
        // Python's `xxh3_128_digest` is the canonical (big-endian) form of the 128-bit value.
        BlockDigest::from_slice(&self.digest128().to_be_bytes())
    }
    #[inline]
    fn one_shot(buf: &mut cbor::EncBuf, len: usize) -> BlockDigest {
        BlockDigest::from_slice(&xxhash_rust::xxh3::xxh3_128(&buf[..len]).to_be_bytes())
    }
}

fn digest_text<H: StreamHash>(text: &str) -> BlockDigest {
    let mut sink = cbor::HashSink::<H>::default();
    cbor::write_text(&mut sink, text);
    sink.finish()
}

fn digest_block<H: StreamHash, T: Copy + Into<u64>>(
    parent: &[u8],
    tokens: &[T],
    extra_keys: Option<&[ExtraKey<'_>]>,
) -> BlockDigest {
    // The common block (no extra keys, up to 64 tokens) is encoded into one stack buffer and
    // hashed in one shot; anything else streams through the chunked sink.
    let mut encoder = cbor::BlockEncoder::empty();
    if extra_keys.is_none() && encoder.start(parent.len(), tokens.len()) {
        encoder.set_parent(parent);
        if let Some(digest) = encoder.hash::<H, T>(tokens) {
            return digest;
        }
    }
    let mut sink = cbor::HashSink::<H>::default();
    cbor::write_block(&mut sink, parent, tokens, extra_keys);
    sink.finish()
}

#[cfg(test)]
mod tests;
