use std::num::NonZeroUsize;

use proptest::prelude::*;
use serde::Deserialize;

use super::*;

#[derive(Deserialize)]
struct FixtureFile {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    name: String,
    algo: String,
    seed: Option<String>,
    block_size: usize,
    cache_salt: Option<String>,
    tokens: Vec<u64>,
    none_hash: String,
    digests: Vec<String>,
    external_u64: Vec<u64>,
}

fn cases() -> Vec<Case> {
    let file: FixtureFile = serde_json::from_str(&crate::fixtures::read("block_hashes.json"))
        .expect("block_hashes.json parses");
    assert!(!file.cases.is_empty());
    file.cases
}

fn settings(algo: HashAlgo, seed: Option<&str>, block_size: usize) -> HashSettings {
    HashSettings {
        algo,
        seed: seed.map(str::to_owned),
        block_size: NonZeroUsize::new(block_size).expect("nonzero"),
        salt_encoding: SaltEncoding::Tagged,
    }
}

#[test]
fn every_fixture_case_matches_vllm() {
    for case in cases() {
        let algo: HashAlgo = case.algo.parse().expect("known algo");
        let hasher = BlockHasher::new(&settings(algo, case.seed.as_deref(), case.block_size))
            .expect("hasher builds");
        assert_eq!(
            hasher.none_hash().to_hex(),
            case.none_hash,
            "{}: NONE_HASH",
            case.name
        );
        let digests: Vec<String> = hasher
            .prompt_blocks(&case.tokens, case.cache_salt.as_deref())
            .map(|d| d.to_hex())
            .collect();
        assert_eq!(digests, case.digests, "{}: digests", case.name);
        let mut external = Vec::new();
        hasher.external_hashes_into(&case.tokens, case.cache_salt.as_deref(), &mut external);
        let external: Vec<u64> = external.iter().map(|h| h.0).collect();
        assert_eq!(
            external, case.external_u64,
            "{}: external hashes",
            case.name
        );
    }
}

/// Made by vLLM 0.32's own engine code (`e2e/make_fixtures.py`, `make fixtures-vllm`): a
/// request with a `LoRARequest` hashes `("lora", name, path)` into every block.
#[derive(Deserialize)]
struct LoraCase {
    seed: String,
    block_size: usize,
    lora_name: String,
    lora_path: String,
    cache_salt: Option<String>,
    tokens: Vec<u64>,
    digests: Vec<String>,
    external_u64: Vec<u64>,
}

#[test]
fn lora_requests_hash_as_vllm_hashes_them() {
    #[derive(Deserialize)]
    struct LoraFile {
        cases: Vec<LoraCase>,
    }
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../fixtures/vllm-0.32.0-lora-block-hashes.json"
    );
    let text = std::fs::read_to_string(path).expect("the LoRA fixture is in the repository");
    let file: LoraFile = serde_json::from_str(&text).expect("the LoRA fixture parses");
    assert_eq!(file.cases.len(), 16);
    for case in file.cases {
        let what = format!(
            "{:?} at {:?}, salt {:?}, block size {}",
            case.lora_name, case.lora_path, case.cache_salt, case.block_size
        );
        let hasher = BlockHasher::new(&settings(
            HashAlgo::Sha256Cbor,
            Some(&case.seed),
            case.block_size,
        ))
        .expect("hasher builds");
        let keys = RequestKeys {
            lora: Some(LoraKey {
                name: &case.lora_name,
                path: &case.lora_path,
            }),
            cache_salt: case.cache_salt.as_deref(),
        };
        let digests: Vec<String> = hasher
            .request_blocks(&case.tokens, keys)
            .map(|d| d.to_hex())
            .collect();
        assert_eq!(digests, case.digests, "{what}: digests");
        let mut external = Vec::new();
        hasher.request_hashes_into(&case.tokens, keys, &mut external);
        let external: Vec<u64> = external.iter().map(|h| h.0).collect();
        assert_eq!(external, case.external_u64, "{what}: external hashes");
        // Without the adapter every block differs: the key is on each one, not only the first.
        let base: Vec<String> = hasher
            .prompt_blocks(&case.tokens, case.cache_salt.as_deref())
            .map(|d| d.to_hex())
            .collect();
        assert!(base.iter().zip(&digests).all(|(b, l)| b != l), "{what}");
    }
}

#[test]
fn untagged_lora_is_the_bare_name_before_the_salt() {
    let mut older = settings(HashAlgo::Sha256Cbor, Some("1729"), 4);
    older.salt_encoding = SaltEncoding::Untagged;
    let hasher = BlockHasher::new(&older).expect("hasher builds");
    let tokens = [1u32, 2, 3, 4, 5, 6, 7, 8];
    let keys = RequestKeys {
        lora: Some(LoraKey {
            name: "sql",
            path: "/p",
        }),
        cache_salt: Some("s"),
    };
    let first = hasher.hash_block(
        None,
        &tokens[..4],
        Some(&[ExtraKey::Text("sql"), ExtraKey::Text("s")]),
    );
    let second = hasher.hash_block(Some(&first), &tokens[4..], Some(&[ExtraKey::Text("sql")]));
    let blocks: Vec<BlockDigest> = hasher.request_blocks(&tokens, keys).collect();
    assert_eq!(blocks, [first, second]);
}

#[test]
fn golden_vector_cbor_bytes() {
    // ../shared/reference/vllm.md §3.6: the exact input of block 0 for seed 1729.
    let hasher = BlockHasher::new(&settings(HashAlgo::Sha256Cbor, Some("1729"), 16)).expect("ok");
    let mut seed = Vec::new();
    encode_text(&mut seed, "1729");
    assert_eq!(hex::encode(&seed), "6431373239");
    let tokens: Vec<u32> = (0..16).collect();
    let mut block = Vec::new();
    encode_block(&mut block, hasher.none_hash().as_bytes(), &tokens, None);
    assert_eq!(
        hex::encode(&block),
        format!(
            "835820{}90000102030405060708090a0b0c0d0e0ff6",
            hasher.none_hash().to_hex()
        )
    );
}

#[test]
fn untagged_salt_matches_older_vllm() {
    // vllm.md §3.6: cache_salt "tenant-a", untagged (vLLM 0.9 – 0.30), seed 1729.
    let mut s = settings(HashAlgo::Sha256Cbor, Some("1729"), 16);
    s.salt_encoding = SaltEncoding::Untagged;
    let hasher = BlockHasher::new(&s).expect("ok");
    let tokens: Vec<u32> = (0..40).collect();
    let mut out = Vec::new();
    hasher.external_hashes_into(&tokens, Some("tenant-a"), &mut out);
    assert_eq!(
        out,
        vec![
            ExternalHash(5035961742439249402),
            ExternalHash(17281650648942978224)
        ]
    );
}

#[test]
fn xxhash_without_seed_is_refused() {
    let err = BlockHasher::new(&settings(HashAlgo::XxhashCbor, None, 16)).unwrap_err();
    assert_eq!(err, BlockHashError::XxhashNeedsSeed);
}

#[test]
fn empty_seed_is_a_seed() {
    let unset = BlockHasher::new(&settings(HashAlgo::Sha256Cbor, None, 16)).expect("ok");
    let empty = BlockHasher::new(&settings(HashAlgo::Sha256Cbor, Some(""), 16)).expect("ok");
    assert_ne!(unset.none_hash(), empty.none_hash());
}

#[test]
fn algo_and_salt_encoding_parse_by_vllm_names() {
    assert_eq!("sha256_cbor".parse(), Ok(HashAlgo::Sha256Cbor));
    assert_eq!("xxhash_cbor".parse(), Ok(HashAlgo::XxhashCbor));
    assert!(matches!(
        "sha256".parse::<HashAlgo>(),
        Err(BlockHashError::UnknownAlgo(_))
    ));
    assert_eq!("untagged".parse(), Ok(SaltEncoding::Untagged));
    assert_eq!(HashAlgo::XxhashCbor.to_string(), "xxhash_cbor");
}

#[test]
fn external_hash_of_short_input_is_zero_extended() {
    assert_eq!(
        ExternalHash::from_digest_bytes(&[1, 2]),
        ExternalHash(0x0102)
    );
    assert_eq!(ExternalHash::from_digest_bytes(&[]), ExternalHash(0));
}

#[test]
fn negative_and_nested_extra_keys_encode_as_cbor() {
    let mut out = Vec::new();
    let inner = [ExtraKey::Text("mm"), ExtraKey::Int(-1), ExtraKey::Int(500)];
    encode_block::<u32>(
        &mut out,
        &[0xaa],
        &[],
        Some(&[ExtraKey::Tuple(&inner), ExtraKey::Bytes(&[1, 2])]),
    );
    // [h'aa', [], [["mm", -1, 500], h'0102']]
    assert_eq!(hex::encode(out), "8341aa808283626d6d201901f4420102");
}

/// Independent reference: a naive CBOR writer over owned values (the way cbor2 walks a tuple).
fn reference_encode(parent: &[u8], tokens: &[u64]) -> Vec<u8> {
    fn head(out: &mut Vec<u8>, major: u8, v: u64) {
        let m = major << 5;
        match v {
            0..=23 => out.push(m | v as u8),
            24..=0xff => out.extend([m | 24, v as u8]),
            0x100..=0xffff => {
                out.push(m | 25);
                out.extend((v as u16).to_be_bytes());
            }
            0x1_0000..=0xffff_ffff => {
                out.push(m | 26);
                out.extend((v as u32).to_be_bytes());
            }
            _ => {
                out.push(m | 27);
                out.extend(v.to_be_bytes());
            }
        }
    }
    let mut out = Vec::new();
    head(&mut out, 4, 3);
    head(&mut out, 2, parent.len() as u64);
    out.extend_from_slice(parent);
    head(&mut out, 4, tokens.len() as u64);
    for &t in tokens {
        head(&mut out, 0, t);
    }
    out.push(0xf6);
    out
}

/// Token ids spread over every CBOR integer form, each boundary included.
fn token_of_any_width() -> impl Strategy<Value = u64> {
    prop_oneof![
        0..24u64,
        22..26u64,
        24..256u64,
        254..258u64,
        256..65_536u64,
        65_534..65_538u64,
        65_536..=u64::from(u32::MAX),
        u64::from(u32::MAX) - 1..=u64::from(u32::MAX) + 1,
        any::<u64>(),
    ]
}

/// A prompt's digests chained by hand over [`reference_encode`]: block 0 through
/// `first_block` (its salt is the only extra key), every later one from its encoded bytes.
fn reference_chain(hasher: &BlockHasher, tokens: &[u64], salt: Option<&str>) -> Vec<BlockDigest> {
    let mut digests: Vec<BlockDigest> = Vec::new();
    for block in tokens.chunks_exact(hasher.block_size()) {
        let digest = match digests.last() {
            None if salt.is_some() => hasher.first_block(block, salt),
            parent => {
                let parent = parent.unwrap_or(hasher.none_hash()).as_bytes();
                let bytes = reference_encode(parent, block);
                match hasher.algo() {
                    HashAlgo::Sha256Cbor => BlockDigest::from_slice(&sha2::Sha256::digest(&bytes)),
                    HashAlgo::XxhashCbor => {
                        BlockDigest::from_slice(&xxhash_rust::xxh3::xxh3_128(&bytes).to_be_bytes())
                    }
                }
            }
        };
        digests.push(digest);
    }
    digests
}

proptest! {
    /// The prompt path (one encoder kept across blocks, its parent slot rewritten per block,
    /// tokens of every CBOR width, the 9-byte ones through the streaming path) against the
    /// reference encoder, for both hashes, every block size the encoder takes and beyond.
    #[test]
    fn prompt_blocks_match_the_reference_chain(
        tokens in prop::collection::vec(token_of_any_width(), 0..300),
        block_size in 1usize..70,
        salt in prop::option::of("[a-z]{0,8}"),
        xxh in any::<bool>(),
        narrow in any::<bool>(),
    ) {
        let algo = if xxh { HashAlgo::XxhashCbor } else { HashAlgo::Sha256Cbor };
        let hasher = BlockHasher::new(&settings(algo, Some("7"), block_size)).expect("ok");
        let tokens: Vec<u64> = if narrow {
            tokens.iter().map(|&t| t & u64::from(u32::MAX)).collect()
        } else {
            tokens
        };
        let expected = reference_chain(&hasher, &tokens, salt.as_deref());
        let got: Vec<_> = hasher.prompt_blocks(&tokens, salt.as_deref()).collect();
        prop_assert_eq!(&got, &expected);
        let mut external = Vec::new();
        hasher.external_hashes_into(&tokens, salt.as_deref(), &mut external);
        let expected_external: Vec<_> = expected.iter().map(BlockDigest::external).collect();
        prop_assert_eq!(&external, &expected_external);
        if narrow {
            let tokens32: Vec<u32> = tokens.iter().map(|&t| t as u32).collect();
            let got32: Vec<_> = hasher.prompt_blocks(&tokens32, salt.as_deref()).collect();
            prop_assert_eq!(&got32, &expected);
        }
    }

    #[test]
    fn hashes_of_a_prefix_are_a_prefix_of_the_hashes(
        tokens in prop::collection::vec(any::<u32>(), 0..400),
        cut in 0usize..400,
        block_size in 1usize..40,
        salt in prop::option::of("[a-z]{0,8}"),
        xxh in any::<bool>(),
    ) {
        let algo = if xxh { HashAlgo::XxhashCbor } else { HashAlgo::Sha256Cbor };
        let hasher = BlockHasher::new(&settings(algo, Some("7"), block_size)).expect("ok");
        let cut = cut.min(tokens.len());
        let full: Vec<_> = hasher.prompt_blocks(&tokens, salt.as_deref()).collect();
        let prefix: Vec<_> = hasher.prompt_blocks(&tokens[..cut], salt.as_deref()).collect();
        prop_assert_eq!(full.len(), tokens.len() / block_size);
        prop_assert_eq!(prefix.len(), cut / block_size);
        prop_assert_eq!(&full[..prefix.len()], &prefix[..]);
    }

    #[test]
    fn hash_equals_hash_of_encoded_bytes(
        tokens in prop::collection::vec(token_of_any_width(), 0..300),
        parent in prop::collection::vec(any::<u8>(), 32),
    ) {
        let mut encoded = Vec::new();
        encode_block(&mut encoded, &parent, &tokens, None);
        prop_assert_eq!(&encoded, &reference_encode(&parent, &tokens));
        let parent_digest = BlockDigest::from_slice(&parent);
        let sha = BlockHasher::new(&settings(HashAlgo::Sha256Cbor, None, 1)).expect("ok");
        let hashed = sha.hash_block(Some(&parent_digest), &tokens, None);
        let direct = sha2::Sha256::digest(&encoded);
        prop_assert_eq!(hashed.as_bytes(), direct.as_slice());
        let xxh = BlockHasher::new(&settings(HashAlgo::XxhashCbor, Some("0"), 1)).expect("ok");
        let parent16 = BlockDigest::from_slice(&parent[..16]);
        encoded.clear();
        encode_block(&mut encoded, parent16.as_bytes(), &tokens, None);
        let hashed = xxh.hash_block(Some(&parent16), &tokens, None);
        let direct = xxhash_rust::xxh3::xxh3_128(&encoded).to_be_bytes();
        prop_assert_eq!(hashed.as_bytes(), &direct[..]);
    }

    #[test]
    fn token_width_does_not_change_the_hash(tokens in prop::collection::vec(any::<u32>(), 0..64)) {
        let hasher = BlockHasher::new(&settings(HashAlgo::Sha256Cbor, None, 16)).expect("ok");
        let wide: Vec<u64> = tokens.iter().map(|&t| u64::from(t)).collect();
        let a: Vec<_> = hasher.prompt_blocks(&tokens, None).collect();
        let b: Vec<_> = hasher.prompt_blocks(&wide, None).collect();
        prop_assert_eq!(a, b);
    }
}
