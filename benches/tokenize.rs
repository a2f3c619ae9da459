//! In-process tokenization (`tokenize::LocalTokenizer`), what a precise pick costs when the
//! router tokenizes itself instead of calling a replica's `/tokenize`: a chat like the routing
//! benchmark's (a ~700-token system prompt, then five turns) rendered with the chat template and
//! encoded, cold (a system prompt never seen) and as the next turn of a conversation (only the
//! new message is new: the pieces between special tokens are cached), and an 8 KB completion
//! prompt (uncached).
//!
//! `cargo bench -p llmgw --bench tokenize`

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a bench or test harness: a panic is a failed run, not a crashed router"
)]

use std::hint::black_box;
use std::path::Path;

use criterion::{Criterion, criterion_group, criterion_main};
use llmgw::tokenize::{ChatOptions, LocalTokenizer};
use serde_json::json;

fn tokenizer() -> LocalTokenizer {
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("sim/assets");
    LocalTokenizer::load(
        &assets.join("tokenizer.json"),
        Some(&assets.join("chat_template.jinja")),
    )
    .expect("the simulator's tokenizer and template load")
}

/// The routing benchmark's conversation after `turns` turns, for `tenant`, whose last user
/// message carries `nonce`.
fn conversation(tenant: u64, turns: usize, nonce: u64) -> String {
    let rules: Vec<String> = (0..45)
        .map(|r| {
            format!(
                "Rule {r} of tenant {tenant}: answer politely about topic {}.",
                r * 7 % 13
            )
        })
        .collect();
    let mut messages = vec![
        json!({"role": "system", "content": format!("You are the assistant of tenant {tenant}. {}", rules.join(" "))}),
        json!({"role": "user", "content": "Conversation 7: what is rule 7?"}),
    ];
    for turn in 0..turns {
        messages.push(json!({"role": "assistant", "content": "Rule seven says to answer politely about topic ten, always."}));
        messages.push(json!({"role": "user", "content": format!("Turn {turn}: and then?")}));
    }
    messages.push(json!({"role": "user", "content": format!("Request {nonce}: and then?")}));
    serde_json::Value::Array(messages).to_string()
}

fn bench(c: &mut Criterion) {
    let local = tokenizer();
    let opts = ChatOptions {
        add_generation_prompt: true,
        continue_final_message: false,
    };
    let tokens = local
        .encode_chat(&conversation(0, 4, 0), opts)
        .expect("encodes")
        .len();
    let mut nonce = 0;
    c.bench_function(
        &format!("tokenize/local_chat_next_turn_{tokens}_tokens"),
        |b| {
            b.iter_batched(
                || {
                    nonce += 1;
                    conversation(0, 4, nonce)
                },
                |chat| local.encode_chat(black_box(&chat), opts).expect("encodes"),
                criterion::BatchSize::SmallInput,
            )
        },
    );
    let mut tenant = 1;
    c.bench_function(&format!("tokenize/local_chat_cold_{tokens}_tokens"), |b| {
        b.iter_batched(
            || {
                tenant += 1;
                conversation(tenant, 4, 0)
            },
            |chat| local.encode_chat(black_box(&chat), opts).expect("encodes"),
            criterion::BatchSize::SmallInput,
        )
    });
    let prompt: String = "Licensed under the Apache License, Version 2.0. "
        .repeat(8192 / 48)
        .chars()
        .take(8192)
        .collect();
    let tokens = local.encode_prompt(&prompt).expect("encodes").len();
    // Each prompt new (its first line differs), so nothing comes from the cache.
    let mut n = 0u64;
    c.bench_function(
        &format!("tokenize/local_completion_8KB_{tokens}_tokens"),
        |b| {
            b.iter_batched(
                || {
                    n += 1;
                    format!("{n}{prompt}")
                },
                |prompt| local.encode_prompt(black_box(&prompt)).expect("encodes"),
                criterion::BatchSize::SmallInput,
            )
        },
    );
    // A conversation sent as a completion: the same 8 KB of earlier lines, a new last turn
    // each time. The earlier lines' segments come from the local tokenizer's cache.
    let earlier: String = prompt
        .split_inclusive(". ")
        .enumerate()
        .map(|(i, s)| {
            if i % 8 == 7 {
                format!("{s}\nnoted\n")
            } else {
                s.to_owned()
            }
        })
        .collect();
    let mut turn = 0u64;
    c.bench_function("tokenize/local_completion_8KB_next_turn", |b| {
        b.iter_batched(
            || {
                turn += 1;
                format!("{earlier}\nquestion {turn}: what does the license permit?\n")
            },
            |prompt| local.encode_prompt(black_box(&prompt)).expect("encodes"),
            criterion::BatchSize::SmallInput,
        )
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30);
    targets = bench
}
criterion_main!(benches);
