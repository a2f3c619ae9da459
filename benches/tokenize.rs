//! In-process tokenization (`tokenize::LocalTokenizer`), what a precise pick costs when the
//! router tokenizes itself instead of calling a replica's `/tokenize`: a chat like the routing
//! benchmark's (a ~700-token system prompt, then five turns) rendered with the chat template and
//! encoded, and an 8 KB completion prompt. Uncached: every call tokenizes from scratch.
//!
//! `cargo bench -p llmgw --bench tokenize`

use std::hint::black_box;
use std::path::Path;

use criterion::{Criterion, criterion_group, criterion_main};
use llmgw::tokenize::{ChatOptions, LocalTokenizer};
use serde_json::json;

fn tokenizer() -> LocalTokenizer {
    let assets = Path::new(env!("CARGO_MANIFEST_DIR")).join("integration/assets");
    LocalTokenizer::load(
        &assets.join("tokenizer.json"),
        Some(&assets.join("chat_template.jinja")),
    )
    .expect("the simulator's tokenizer and template load")
}

/// The routing benchmark's conversation after `turns` turns.
fn conversation(turns: usize) -> String {
    let rules: Vec<String> = (0..45)
        .map(|r| {
            format!(
                "Rule {r} of tenant 0: answer politely about topic {}.",
                r * 7 % 13
            )
        })
        .collect();
    let mut messages = vec![
        json!({"role": "system", "content": format!("You are the assistant of tenant 0. {}", rules.join(" "))}),
        json!({"role": "user", "content": "Conversation 7: what is rule 7?"}),
    ];
    for turn in 0..turns {
        messages.push(json!({"role": "assistant", "content": "Rule seven says to answer politely about topic ten, always."}));
        messages.push(json!({"role": "user", "content": format!("Turn {turn}: and then?")}));
    }
    serde_json::Value::Array(messages).to_string()
}

fn bench(c: &mut Criterion) {
    let local = tokenizer();
    let opts = ChatOptions {
        add_generation_prompt: true,
        continue_final_message: false,
    };
    let chat = conversation(4);
    let tokens = local.encode_chat(&chat, opts).expect("encodes").len();
    c.bench_function(&format!("tokenize/local_chat_{tokens}_tokens"), |b| {
        b.iter(|| local.encode_chat(black_box(&chat), opts).expect("encodes"))
    });
    let prompt: String = "Licensed under the Apache License, Version 2.0. "
        .repeat(8192 / 48)
        .chars()
        .take(8192)
        .collect();
    let tokens = local.encode_prompt(&prompt).expect("encodes").len();
    c.bench_function(
        &format!("tokenize/local_completion_8KB_{tokens}_tokens"),
        |b| b.iter(|| local.encode_prompt(black_box(&prompt)).expect("encodes")),
    );
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(30);
    targets = bench
}
criterion_main!(benches);
