use std::collections::{HashMap, HashSet};
use std::num::NonZeroUsize;

use llmgw_core::blockhash::{BlockDigest, BlockHasher, ExtraKey, HashSettings};
use proptest::prelude::*;

use super::*;
use crate::capture::Capture;

fn hasher(block_size: usize, seed: &str) -> BlockHasher {
    let size = NonZeroUsize::new(block_size).expect("non-zero block size");
    BlockHasher::new(&HashSettings::sha256_cbor(size, Some(seed))).expect("sha256_cbor hasher")
}

type Version = (u32, u32, u32);

/// `(label, version, payload)` for every entry of event_batches.json.
fn fixture_batches() -> Vec<(String, Version, Vec<u8>)> {
    let doc: serde_json::Value =
        serde_json::from_str(&llmgw_core::fixtures::read("event_batches.json")).expect("json");
    doc["batches"]
        .as_array()
        .expect("batches array")
        .iter()
        .map(|b| {
            let label = b["vllm"].as_str().expect("vllm label").to_owned();
            let version = label
                .strip_prefix("vLLM ")
                .and_then(|rest| rest.split([':', ' ']).next())
                .map(|v| {
                    let parts: Vec<u32> = v.split('.').map(|p| p.parse().expect("num")).collect();
                    (parts[0], parts[1], parts[2])
                })
                .expect("version in label");
            let payload = hex::decode(b["hex"].as_str().expect("hex")).expect("valid hex");
            (label, version, payload)
        })
        .collect()
}

fn capture() -> Capture {
    Capture::parse(&llmgw_core::fixtures::read("vllm-0.32.0-capture.jsonl"))
        .expect("capture parses")
}

/// The events every fixture batch holds, built from vLLM's hash chain (tokens 0..31, block
/// size 16, seed 1729) and the fields each release declares.
fn expected_fixture_batch(version: (u32, u32, u32), raw_digests: bool) -> EventBatch {
    let h = hasher(16, "1729");
    let tokens: Vec<u32> = (0..32).collect();
    let chain: Vec<ExternalHash> = h
        .prompt_blocks(&tokens, None)
        .map(|d| d.external())
        .collect();
    let at_least = |v: (u32, u32, u32)| version >= v;
    let medium = at_least((0, 10, 2)).then_some(Medium::Gpu);
    let group_idx = at_least((0, 20, 0)).then_some(0);
    let kind = at_least((0, 22, 0)).then(|| "full_attention".into());
    if raw_digests {
        return EventBatch {
            ts: 1_700_000_000.5,
            dp_rank: Some(0),
            events: vec![KvEvent::BlockStored(BlockStored {
                block_hashes: vec![chain[1]],
                parent_block_hash: Some(chain[0]),
                token_ids: tokens[16..].to_vec(),
                block_size: 16,
                medium,
                extra_keys: Some(vec![Value::Nil]),
                group_idx,
                kv_cache_spec_kind: kind,
                ..BlockStored::default()
            })],
        };
    }
    EventBatch {
        ts: 1_700_000_000.5,
        dp_rank: at_least((0, 9, 1)).then_some(0),
        events: vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: chain.clone(),
                parent_block_hash: None,
                token_ids: tokens.clone(),
                block_size: 16,
                medium: medium.clone(),
                extra_keys: at_least((0, 17, 0)).then(|| vec![Value::Nil, Value::Nil]),
                group_idx,
                kv_cache_spec_kind: kind,
                ..BlockStored::default()
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![chain[0]],
                medium,
                ..BlockRemoved::default()
            }),
            KvEvent::AllBlocksCleared(AllBlocksCleared),
        ],
    }
}

#[test]
fn every_fixture_batch_decodes_to_its_events() {
    let batches = fixture_batches();
    assert_eq!(
        batches.len(),
        11,
        "one batch per release plus the raw-digest variant"
    );
    for (label, version, payload) in &batches {
        let raw = label.contains("USE_INT_BLOCK_HASHES=0");
        let got = decode_batch(payload).unwrap_or_else(|e| panic!("{label}: {e}"));
        assert_eq!(got, expected_fixture_batch(*version, raw), "{label}");
    }
}

#[test]
fn fixture_batches_cover_both_event_forms() {
    // Map events from 0.24 (0x8X fixmap or 0xde map16 right after the events array header).
    for (label, version, payload) in fixture_batches() {
        let events_at = 1 + 9; // batch header + f64 ts
        let first_event_marker = payload[events_at + 1];
        let is_map = matches!(first_event_marker, 0x80..=0x8f | 0xde);
        assert_eq!(is_map, version >= (0, 24, 0), "{label}");
    }
}

#[test]
fn every_capture_frame_decodes_and_every_hash_recomputes() {
    let cap = capture();
    assert_eq!(cap.frames.len(), 26);
    let h = hasher(32, "1729");
    let mut digests: HashMap<ExternalHash, BlockDigest> = HashMap::new();
    let mut stored = HashSet::new();
    let mut stored_with_repeats = Vec::new();
    let (mut n_stored, mut n_removed, mut n_cleared, mut n_salted) = (0, 0, 0, 0);
    for (i, frame) in cap.frames.iter().enumerate() {
        assert_eq!(frame.topic, b"kv");
        assert_eq!(frame.seq, i as u64, "consecutive sequence numbers");
        let batch = decode_batch(&frame.payload).unwrap_or_else(|e| panic!("seq {i}: {e}"));
        assert_eq!(batch.dp_rank, Some(0));
        assert!(batch.ts > 1.7e9, "ts is a Unix time");
        assert!(
            !batch.events.is_empty(),
            "vLLM never publishes empty batches"
        );
        for ev in &batch.events {
            match ev {
                KvEvent::BlockStored(s) => {
                    n_stored += 1;
                    assert_eq!(s.block_size, 32);
                    assert_eq!(s.medium, Some(Medium::Gpu));
                    assert_eq!(s.group_idx, Some(0));
                    assert_eq!(s.token_ids.len(), s.block_hashes.len() * 32);
                    let mut parent = s.parent_block_hash.map(|p| {
                        *digests
                            .get(&p)
                            .unwrap_or_else(|| panic!("seq {i}: parent {p} never stored"))
                    });
                    for (b, (hash, block)) in s
                        .block_hashes
                        .iter()
                        .zip(s.token_ids.chunks(32))
                        .enumerate()
                    {
                        let digest = match (parent, b) {
                            (None, 0) => match s.first_block_keys() {
                                FirstBlockKeys::Plain => h.first_block(block, None),
                                FirstBlockKeys::Salt(salt) => {
                                    n_salted += 1;
                                    h.first_block(block, Some(salt))
                                }
                                FirstBlockKeys::Other => panic!("seq {i}: unexpected keys"),
                            },
                            (p, _) => h.hash_block(p.as_ref(), block, None::<&[ExtraKey<'_>]>),
                        };
                        assert_eq!(digest.external(), *hash, "seq {i} block {b}");
                        digests.insert(*hash, digest);
                        stored.insert(*hash);
                        stored_with_repeats.push(*hash);
                        parent = Some(digest);
                    }
                }
                KvEvent::BlockRemoved(r) => {
                    n_removed += 1;
                    assert!(r.block_hashes.iter().all(|x| stored.contains(x)));
                }
                KvEvent::AllBlocksCleared(_) => n_cleared += 1,
                KvEvent::Unknown { kind } => panic!("seq {i}: unknown event {kind}"),
            }
        }
    }
    assert!(
        n_stored > 20 && n_removed > 20,
        "{n_stored} stores, {n_removed} removes"
    );
    assert_eq!(n_cleared, 1, "the prefix-cache reset");
    assert_eq!(n_salted, 1, "the salted request's block 0");
    assert_eq!(
        stored_with_repeats.len(),
        127,
        "the README's count of stored hashes"
    );
    assert_eq!(
        stored.len(),
        123,
        "four blocks stored again after the reset"
    );

    // The prompt blocks the engine's own /tokenize answers imply are all among them.
    let mut prompt = HashSet::new();
    for req in &cap.requests {
        for d in h.prompt_blocks(&req.tokens, req.cache_salt.as_deref()) {
            prompt.insert(d.external());
        }
    }
    let from_prompts = stored_with_repeats
        .iter()
        .filter(|h| prompt.contains(h))
        .count();
    assert_eq!(
        from_prompts, 118,
        "prompt blocks; the other 9 hold generated tokens"
    );
}

#[test]
fn map_key_positions_match_the_declared_field_order() {
    for (i, name) in super::decode::STORED_FIELDS.iter().enumerate() {
        assert_eq!(
            super::decode::stored_pos(name.as_bytes()),
            Some(i),
            "{name}"
        );
    }
    for (i, name) in super::decode::REMOVED_FIELDS.iter().enumerate() {
        assert_eq!(
            super::decode::removed_pos(name.as_bytes()),
            Some(i),
            "{name}"
        );
    }
    assert_eq!(super::decode::stored_pos(b"type"), None);
}

#[test]
fn map_form_batch_is_accepted() {
    let ev = rmpv::Value::Map(vec![
        ("type".into(), "BlockRemoved".into()),
        ("block_hashes".into(), rmpv::Value::Array(vec![7u64.into()])),
    ]);
    let batch = rmpv::Value::Map(vec![
        ("data_parallel_rank".into(), 3.into()),
        ("unknown".into(), rmpv::Value::Array(vec![1.into()])),
        ("events".into(), rmpv::Value::Array(vec![ev])),
        ("ts".into(), rmpv::Value::F64(2.5)),
    ]);
    let got = decode_batch(&mp(&batch)).expect("map batch");
    assert_eq!(got.ts, 2.5);
    assert_eq!(got.dp_rank, Some(3));
    assert_eq!(
        got.events,
        vec![KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![ExternalHash(7)],
            ..BlockRemoved::default()
        })]
    );
}

fn mp(v: &rmpv::Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, v).expect("encode to vec");
    out
}

fn batch_of(events: Vec<rmpv::Value>) -> Vec<u8> {
    mp(&rmpv::Value::Array(vec![
        rmpv::Value::F64(1.0),
        rmpv::Value::Array(events),
        rmpv::Value::Nil,
    ]))
}

#[test]
fn unknown_types_fields_and_trailing_elements_are_tolerated() {
    use rmpv::Value as V;
    let payload = batch_of(vec![
        // An event type from the future, in both forms.
        V::Array(vec![
            "BlockPinned".into(),
            V::Array(vec![1.into()]),
            "x".into(),
        ]),
        V::Map(vec![
            ("type".into(), "Spilled".into()),
            ("n".into(), 1.into()),
        ]),
        // Unknown map keys, "type" not first, a non-string key.
        V::Map(vec![
            ("future_field".into(), V::Map(vec![(1.into(), V::Nil)])),
            (5.into(), "ignored".into()),
            ("block_hashes".into(), V::Array(vec![9u64.into()])),
            ("type".into(), "BlockRemoved".into()),
            ("medium".into(), "cpu".into()),
        ]),
        // Trailing elements beyond the 15 known BlockStored fields.
        V::Array({
            let mut v = vec!["BlockStored".into(), V::Array(vec![1.into()]), V::Nil];
            v.extend([V::Array(vec![]), 0.into()]);
            v.extend(std::iter::repeat_n(V::Nil, 11));
            v.extend([V::Boolean(true), "more".into()]);
            v
        }),
        // Missing trailing fields: only the hashes.
        V::Array(vec!["BlockRemoved".into(), V::Array(vec![2.into()])]),
        V::Array(vec!["AllBlocksCleared".into(), "extra".into()]),
    ]);
    let got = decode_batch(&payload).expect("tolerant decode");
    let kinds: Vec<&str> = got.events.iter().map(KvEvent::kind).collect();
    assert_eq!(
        kinds,
        [
            "BlockPinned",
            "Spilled",
            "BlockRemoved",
            "BlockStored",
            "BlockRemoved",
            "AllBlocksCleared"
        ]
    );
    assert!(matches!(got.events[0], KvEvent::Unknown { .. }));
    let KvEvent::BlockRemoved(r) = &got.events[2] else {
        panic!("not removed")
    };
    assert_eq!(r.block_hashes, [ExternalHash(9)]);
    assert_eq!(r.medium, Some(Medium::Other("cpu".into())));
    assert_eq!(
        Medium::tier(r.medium.as_ref()),
        llmgw_core::kv_event::Medium::from_vllm(Some("CPU"))
    );
    assert_ne!(
        Medium::tier(r.medium.as_ref()),
        llmgw_core::kv_event::Medium::Gpu
    );
    let KvEvent::BlockStored(s) = &got.events[3] else {
        panic!("not stored")
    };
    assert_eq!(s.block_hashes, [ExternalHash(1)]);
    assert_eq!(s.lookahead_token_ids, None);
    let KvEvent::BlockRemoved(r) = &got.events[4] else {
        panic!("not removed")
    };
    assert_eq!(
        (r.block_hashes.as_slice(), &r.medium),
        ([ExternalHash(2)].as_slice(), &None)
    );
}

#[test]
fn hashes_as_u64_i64_and_bytes_normalise_to_the_int_form() {
    use rmpv::Value as V;
    let digest: Vec<u8> = (1..=32).collect();
    let payload = batch_of(vec![V::Array(vec![
        "BlockRemoved".into(),
        V::Array(vec![
            u64::MAX.into(),
            (-2i64).into(),
            V::Binary(digest.clone()),
            V::Binary(vec![0x01, 0x02]),
            V::Binary(vec![]),
        ]),
    ])]);
    let got = decode_batch(&payload).expect("decodes");
    let KvEvent::BlockRemoved(r) = &got.events[0] else {
        panic!("not removed")
    };
    let tail = u64::from_be_bytes(digest[24..].try_into().expect("8 bytes"));
    assert_eq!(
        r.block_hashes,
        [
            ExternalHash(u64::MAX),
            ExternalHash((-2i64) as u64),
            ExternalHash(tail),
            ExternalHash(0x0102),
            ExternalHash(0)
        ]
    );
}

#[test]
fn malformed_payloads_are_errors_naming_the_problem() {
    use rmpv::Value as V;
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (vec![], "empty"),
        (mp(&V::from(5)), "a integer"),
        (mp(&V::Array(vec![V::F64(1.0)])), "array of 1"),
        (batch_of(vec![V::Array(vec![])]), "no type tag"),
        (batch_of(vec![V::from(3)]), "tagged array or map"),
        (
            batch_of(vec![V::Array(vec![
                "BlockStored".into(),
                V::Array(vec![]),
                V::Nil,
                V::Array(vec![(-1).into()]),
            ])]),
            "token_ids",
        ),
        (
            batch_of(vec![V::Array(vec![
                "BlockStored".into(),
                V::Array(vec!["not a hash".into()]),
            ])]),
            "block_hashes",
        ),
        (
            batch_of(vec![V::Map(vec![("block_hashes".into(), V::Nil)])]),
            "no type tag",
        ),
        ([batch_of(vec![]), vec![0xc0]].concat(), "trailing"),
    ];
    for (payload, needle) in cases {
        let err = decode_batch(&payload).expect_err(needle).to_string();
        assert!(err.contains(needle), "{err:?} should mention {needle:?}");
    }
}

#[test]
fn declared_counts_reserve_no_more_than_the_memory_budget() {
    use super::decode::{RESERVE_BUDGET_BYTES, reserve_for};
    fn bytes_reserved<T>(declared: usize, remaining: usize, min_encoded: usize) -> usize {
        reserve_for::<T>(declared, remaining, min_encoded) * std::mem::size_of::<T>()
    }
    let huge = u32::MAX as usize;
    let padded = 8 << 20;
    for reserved in [
        bytes_reserved::<KvEvent>(huge, padded, 1),
        bytes_reserved::<ExternalHash>(huge, padded, 1),
        bytes_reserved::<u32>(huge, padded, 1),
        bytes_reserved::<Value>(huge, padded, 1),
        bytes_reserved::<(Value, Value)>(huge, padded, 2),
    ] {
        assert!(
            reserved <= RESERVE_BUDGET_BYTES,
            "{reserved} bytes reserved"
        );
        assert!(reserved > 0);
    }
    // Within the budget the count and the payload still bound it.
    assert_eq!(reserve_for::<u32>(3, padded, 1), 3);
    assert_eq!(reserve_for::<u32>(huge, 10, 1), 10);
    assert_eq!(reserve_for::<(Value, Value)>(huge, 10, 2), 5);
    assert_eq!(reserve_for::<u32>(huge, 0, 1), 0);
}

/// `[0.0, <events>]` with `events` the raw bytes given.
fn padded_batch(events: &[u8], pad: u8, total: usize) -> Vec<u8> {
    let mut p = vec![0x92, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0];
    p.extend_from_slice(events);
    p.resize(total, pad);
    p
}

#[test]
fn huge_declared_counts_in_a_padded_payload_are_errors() {
    let any_count = [0xdd, 0xff, 0xff, 0xff, 0xff];
    let mut stored_with_hashes = vec![0xdd, 0, 0, 0, 1, 0x92, 0xab];
    stored_with_hashes.extend_from_slice(b"BlockStored");
    stored_with_hashes.extend_from_slice(&any_count);
    let mut extra_keys_map = vec![0x91, 0x99, 0xab];
    extra_keys_map.extend_from_slice(b"BlockStored");
    extra_keys_map.extend_from_slice(&[0xc0, 0xc0, 0xc0, 0xc0, 0xc0, 0xc0, 0xc0, 0x91]);
    extra_keys_map.extend_from_slice(&[0xdf, 0xff, 0xff, 0xff, 0xff]);
    let cases: [(&str, Vec<u8>, u8); 4] = [
        // 2^32-1 events, then empty arrays: event 0 has no tag.
        ("no type tag", any_count.to_vec(), 0x90),
        // 2^32-1 events, each a nil: event 0 is not an event.
        ("tagged array or map", any_count.to_vec(), 0xc0),
        // one BlockStored whose block_hashes declare 2^32-1 hashes, then nils.
        ("block_hashes", stored_with_hashes, 0xc0),
        // one BlockStored whose extra key is a map declaring 2^32-1 pairs, then 0xc1s.
        ("extra_keys", extra_keys_map, 0xc1),
    ];
    for (what, events, pad) in cases {
        let payload = padded_batch(&events, pad, 8 << 20);
        let started = std::time::Instant::now();
        let err = decode_batch(&payload).expect_err(what).to_string();
        assert!(err.contains(what), "{err:?} should mention {what:?}");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{what}: {err} took {:?}",
            started.elapsed()
        );
    }
}

#[test]
fn every_truncation_of_every_fixture_is_an_error() {
    let mut payloads: Vec<Vec<u8>> = fixture_batches().into_iter().map(|b| b.2).collect();
    payloads.extend(capture().frames.into_iter().map(|f| f.payload));
    for p in &payloads {
        for cut in 0..p.len() {
            assert!(decode_batch(&p[..cut]).is_err(), "prefix of {cut} bytes");
        }
    }
}

#[test]
fn json_view_uses_vllm_field_names_and_u64_hashes() {
    let (_, version, payload) = fixture_batches().pop().expect("a batch");
    assert_eq!(version, (0, 33, 0));
    let batch = decode_batch(&payload).expect("decodes");
    let json = serde_json::to_value(&batch).expect("serialises");
    let ev = &json["events"][0];
    assert_eq!(ev["type"], "BlockStored");
    let KvEvent::BlockStored(s) = &batch.events[0] else {
        panic!("not stored")
    };
    assert_eq!(ev["block_hashes"][0].as_u64(), Some(s.block_hashes[0].0));
    assert_eq!(
        ev["parent_block_hash"].as_u64(),
        s.parent_block_hash.map(|h| h.0)
    );
    for field in [
        "token_ids",
        "block_size",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    ] {
        assert!(ev.get(field).is_some(), "{field}");
    }
    assert_eq!(ev["medium"], "GPU");
    assert_eq!(json["dp_rank"], 0);
}

// ---- properties -------------------------------------------------------------------------

fn arb_value() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Nil),
        any::<bool>().prop_map(Value::Bool),
        (i64::MIN..0).prop_map(Value::Int),
        any::<u64>().prop_map(Value::UInt),
        (-1e12f64..1e12).prop_map(Value::Float),
        ".{0,12}".prop_map(Value::Str),
        proptest::collection::vec(any::<u8>(), 0..40).prop_map(Value::Bin),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            proptest::collection::vec((inner.clone(), inner), 0..3).prop_map(Value::Map),
        ]
    })
}

fn arb_medium() -> impl Strategy<Value = Option<Medium>> {
    proptest::option::of(prop_oneof![
        Just("GPU".to_owned()),
        Just("CPU".to_owned()),
        "[a-zA-Z]{0,8}"
    ])
    .prop_map(|m| m.map(|s| Medium::from_wire(&s)))
}

fn arb_hashes() -> impl Strategy<Value = Vec<ExternalHash>> {
    proptest::collection::vec(any::<u64>().prop_map(ExternalHash), 0..6)
}

fn arb_event() -> impl Strategy<Value = KvEvent> {
    use proptest::option::of as s;
    let text = || s("[a-z_]{0,10}");
    let stored = (
        (
            arb_hashes(),
            s(any::<u64>().prop_map(ExternalHash)),
            proptest::collection::vec(any::<u32>(), 0..70),
            any::<u32>(),
            s(any::<i64>()),
            arb_medium(),
            text(),
        ),
        (
            s(proptest::collection::vec(arb_value(), 0..3)),
            s(any::<i64>()),
            text(),
            s(any::<i64>()),
            text(),
            text(),
            text(),
            s(arb_value()),
        ),
    )
        .prop_map(
            |((bh, p, t, bs, lid, m, ln), (ek, g, k, sw, loc, own, sid, la))| {
                KvEvent::BlockStored(BlockStored {
                    block_hashes: bh,
                    parent_block_hash: p,
                    token_ids: t,
                    block_size: bs,
                    lora_id: lid,
                    medium: m,
                    lora_name: ln,
                    extra_keys: ek,
                    group_idx: g,
                    kv_cache_spec_kind: k.map(Into::into),
                    kv_cache_spec_sliding_window: sw,
                    locality: loc,
                    ownership: own,
                    session_id: sid,
                    // A nil lookahead is indistinguishable from an absent one.
                    lookahead_token_ids: la.filter(|v| *v != Value::Nil),
                })
            },
        );
    let removed = (arb_hashes(), arb_medium(), s(any::<i64>()), text(), text()).prop_map(
        |(bh, m, g, loc, own)| {
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: bh,
                medium: m,
                group_idx: g,
                locality: loc,
                ownership: own,
            })
        },
    );
    prop_oneof![
        4 => stored,
        3 => removed,
        1 => Just(KvEvent::AllBlocksCleared(AllBlocksCleared)),
        1 => "[A-Z][a-zA-Z]{0,12}"
            .prop_filter("not a known tag", |k| {
                !matches!(k.as_str(), "BlockStored" | "BlockRemoved" | "AllBlocksCleared")
            })
            .prop_map(|kind| KvEvent::Unknown { kind }),
    ]
}

fn arb_batch() -> impl Strategy<Value = EventBatch> {
    (
        0f64..2e9,
        proptest::collection::vec(arb_event(), 0..6),
        proptest::option::of(any::<i64>()),
    )
        .prop_map(|(ts, events, dp_rank)| EventBatch {
            ts,
            events,
            dp_rank,
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..256)) {
        // Whatever the outcome, it is a value, not a panic; a success must re-encode to itself.
        if let Ok(batch) = decode_batch(&bytes)
            && batch.ts.is_finite()
            && !format!("{batch:?}").contains("NaN")
        {
            let again = decode_batch(&encode_batch(&batch, EventForm::TaggedArray));
            prop_assert_eq!(again, Ok(batch));
        }
    }

    #[test]
    fn mutated_real_payloads_never_panic(
        which in 0usize..37,
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..6),
    ) {
        let mut payloads: Vec<Vec<u8>> = fixture_batches().into_iter().map(|b| b.2).collect();
        payloads.extend(capture().frames.into_iter().map(|f| f.payload));
        let mut p = payloads[which % payloads.len()].clone();
        for (at, byte) in edits {
            let i = at.index(p.len());
            p[i] = byte;
        }
        let decoded = decode_batch(&p);
        // Mutating bytes never lengthens the payload, so an Ok batch has at most as many
        // events as the payload has bytes.
        if let Ok(batch) = decoded {
            prop_assert!(batch.events.len() <= p.len());
        }
    }

    #[test]
    fn declared_counts_past_the_payload_never_panic(
        count in any::<u32>(),
        marker in prop::sample::select(vec![0xdcu8, 0xdd]),
        pad in any::<u8>(),
        len in 0usize..4096,
    ) {
        let header = if marker == 0xdc {
            let c = (count as u16).to_be_bytes();
            vec![marker, c[0], c[1]]
        } else {
            let c = count.to_be_bytes();
            vec![marker, c[0], c[1], c[2], c[3]]
        };
        let payload = padded_batch(&header, pad, 10 + header.len() + len);
        if let Ok(batch) = decode_batch(&payload) {
            prop_assert!(batch.events.len() <= payload.len());
        }
    }

    #[test]
    fn encode_then_decode_round_trips(batch in arb_batch()) {
        for form in [EventForm::TaggedArray, EventForm::TaggedMap] {
            let bytes = encode_batch(&batch, form);
            prop_assert_eq!(decode_batch(&bytes), Ok(batch.clone()), "{:?}", form);
        }
    }
}
