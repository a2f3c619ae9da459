use std::num::NonZeroUsize;

use super::*;

fn tree(chunk: usize, max_nodes: usize) -> PrefixTree {
    PrefixTree::new(PrefixTreeConfig {
        chunk_bytes: NonZeroUsize::new(chunk).expect("nonzero"),
        max_nodes: NonZeroUsize::new(max_nodes).expect("nonzero"),
    })
}

fn shares(t: &PrefixTree, model: &str, text: &str, candidates: &[&str]) -> Vec<f64> {
    let mut out = Vec::new();
    t.match_shares(model, text.as_bytes(), candidates, &mut out);
    out
}

#[test]
fn a_routed_prefix_points_at_its_replica() {
    let t = tree(4, 1000);
    t.record("m", b"aaaabbbbcccc", "r1:1");
    t.record("m", b"aaaaxxxx", "r2:1");
    // "aaaa" went to both; "aaaabbbb" only to r1.
    assert_eq!(
        shares(&t, "m", "aaaabbbbdddd", &["r1:1", "r2:1", "r3:1"]),
        vec![2.0 / 3.0, 1.0 / 3.0, 0.0]
    );
    assert_eq!(
        shares(&t, "m", "aaaaxxxxyyyy", &["r1:1", "r2:1"]),
        vec![1.0 / 3.0, 2.0 / 3.0]
    );
}

#[test]
fn models_do_not_share_prefixes() {
    let t = tree(4, 1000);
    t.record("m1", b"aaaabbbb", "r1:1");
    assert_eq!(shares(&t, "m2", "aaaabbbb", &["r1:1"]), vec![0.0]);
    assert_eq!(shares(&t, "m1", "aaaabbbb", &["r1:1"]), vec![1.0]);
}

#[test]
fn short_prompts_and_no_candidates_score_zero() {
    let t = tree(4, 1000);
    t.record("m", b"abc", "r1:1");
    assert!(t.is_empty(), "a partial chunk is not recorded");
    assert_eq!(shares(&t, "m", "abc", &["r1:1"]), vec![0.0]);
    assert!(shares(&t, "m", "abcdefgh", &[]).is_empty());
}

#[test]
fn size_cap_evicts_least_recently_used() {
    let t = tree(4, 4);
    t.record("m", b"aaaabbbb", "r1:1"); // 2 nodes
    t.record("m", b"ccccdddd", "r2:1"); // 2 nodes, full
    // Touch the first prompt so the second is least recent, then add 2 more nodes.
    assert_eq!(shares(&t, "m", "aaaabbbb", &["r1:1"]), vec![1.0]);
    t.record("m", b"eeeeffff", "r3:1");
    assert_eq!(t.len(), 4);
    assert_eq!(shares(&t, "m", "aaaabbbb", &["r1:1"]), vec![1.0]);
    assert_eq!(shares(&t, "m", "ccccdddd", &["r2:1"]), vec![0.0]);
}

#[test]
fn a_node_remembers_the_most_recent_replicas() {
    let t = tree(4, 1000);
    for r in ["r1:1", "r2:1", "r3:1", "r4:1", "r5:1"] {
        t.record("m", b"aaaa", r);
    }
    assert_eq!(
        shares(&t, "m", "aaaa", &["r1:1", "r2:1", "r5:1"]),
        vec![0.0, 1.0, 1.0]
    );
    t.record("m", b"aaaa", "r2:1");
    t.record("m", b"aaaa", "r6:1");
    assert_eq!(shares(&t, "m", "aaaa", &["r2:1", "r3:1"]), vec![1.0, 0.0]);
}

#[test]
fn another_tree_recording_a_shared_chain_points_at_the_same_replica() {
    // Two routers' trees (separate instances, as in two processes of one build) key a text
    // alike, so one's chain recorded in the other is a match there.
    let (here, there) = (tree(4, 1024), tree(4, 1024));
    let text = "abcdefghijklmnop";
    let chain = here.chain("m", text.as_bytes());
    assert_eq!(chain.len(), 4);
    assert_eq!(chain, there.chain("m", text.as_bytes()));
    assert_ne!(chain, there.chain("other", text.as_bytes()));
    there.record_chain(&chain, "r2");
    assert_eq!(shares(&there, "m", text, &["r1", "r2"]), vec![0.0, 1.0]);
    assert_eq!(
        shares(&there, "m", "abcdefgh", &["r1", "r2"]),
        vec![0.0, 1.0]
    );
}
