//! `llmgw-router hash` answers every case of ../shared/fixtures/block_hashes.json, and refuses
//! bad input with exit code 2 and a message.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a bench or test harness: a panic is a failed run, not a crashed router"
)]

use std::io::Write;
use std::process::{Command, Output, Stdio};

use serde_json::Value;

fn hash_cli(args: &[&str], stdin: &str) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_llmgw-router"))
        .arg("hash")
        .args(args)
        .env_remove("PYTHONHASHSEED")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("llmgw-router starts");
    let written = child
        .stdin
        .take()
        .expect("stdin piped")
        .write_all(stdin.as_bytes());
    // A refused flag exits before reading stdin: the write may then find the pipe closed.
    match written {
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {}
        other => other.expect("stdin written"),
    }
    child.wait_with_output().expect("llmgw-router exits")
}

fn lines(bytes: &[u8]) -> Vec<String> {
    String::from_utf8_lossy(bytes)
        .lines()
        .map(str::to_owned)
        .collect()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| match x {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
        .collect()
}

#[test]
fn answers_every_fixture_case() {
    let file: Value =
        serde_json::from_str(&llmgw::fixtures::read("block_hashes.json")).expect("json");
    let cases = file["cases"].as_array().expect("cases");
    assert!(cases.len() >= 10);
    for case in cases {
        let name = case["name"].as_str().expect("name");
        let block_size = case["block_size"].to_string();
        let mut args = vec!["--algo", case["algo"].as_str().expect("algo")];
        args.extend(["--block-size", &block_size]);
        if let Some(seed) = case["seed"].as_str() {
            args.extend(["--seed", seed]);
        }
        if let Some(salt) = case["cache_salt"].as_str() {
            args.extend(["--cache-salt", salt]);
        }
        let tokens = case["tokens"].to_string();

        let out = hash_cli(&args, &tokens);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(lines(&out.stdout), strings(&case["external_u64"]), "{name}");

        args.push("--digests");
        let out = hash_cli(&args, &tokens);
        assert!(out.status.success(), "{name}");
        assert_eq!(
            lines(&out.stdout),
            strings(&case["digests"]),
            "{name} --digests"
        );
    }
}

#[test]
fn bad_input_exits_2_with_a_message() {
    for (args, stdin, expect) in [
        (vec!["--block-size", "16"], "[1, 2", "JSON array"),
        (vec!["--block-size", "16"], "[1, -2]", "index 1"),
        (vec!["--block-size", "0"], "[1]", "block-size"),
        (
            vec!["--block-size", "16", "--algo", "sha256"],
            "[1]",
            "sha256",
        ),
        (
            vec!["--block-size", "16", "--algo", "xxhash_cbor"],
            "[1]",
            "seed",
        ),
    ] {
        let out = hash_cli(&args, stdin);
        assert_eq!(out.status.code(), Some(2), "{args:?} {stdin}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(expect), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty());
    }
}
