//! The flags in the Kubernetes manifests are flags the binaries take: every `llmgw-router` and
//! `llmgw-agent` container in deploy/ and envoy/gie/ has its args (with `$(VAR)` expanded the
//! way the kubelet does, from the ConfigMaps and the downward API) parsed by the real binary.
//! `--help` after them makes clap stop once everything before it parsed: an unknown flag or a
//! value its parser rejects fails the run, and nothing is started.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::collections::HashMap;
use std::process::Command;

use llmgw_integration::{bin_path, repo_root};
use serde::Deserialize;
use serde_yaml::Value;

/// The YAML files under `dir`, recursively (the validator's node_modules aside), sorted.
fn yaml_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).expect("manifest directory") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "node_modules") {
                files.extend(yaml_files(&path));
            }
        } else if path.extension().is_some_and(|x| x == "yaml") {
            files.push(path);
        }
    }
    files.sort();
    files
}

/// Every YAML document in the manifests directories.
fn documents() -> Vec<(String, Value)> {
    let root = repo_root();
    let mut docs = Vec::new();
    for dir in ["deploy", "envoy/gie"] {
        for file in yaml_files(&root.join(dir)) {
            let text = std::fs::read_to_string(&file).expect("read manifest");
            let name = file
                .strip_prefix(&root)
                .unwrap_or(&file)
                .display()
                .to_string();
            for doc in serde_yaml::Deserializer::from_str(&text) {
                let value = Value::deserialize(doc).unwrap_or_else(|e| panic!("{name}: {e}"));
                if !value.is_null() {
                    docs.push((name.clone(), value));
                }
            }
        }
    }
    docs
}

fn str_of<'a>(v: &'a Value, key: &str) -> Option<&'a str> {
    v.get(key).and_then(Value::as_str)
}

/// ConfigMap name → its data.
fn config_maps(docs: &[(String, Value)]) -> HashMap<String, HashMap<String, String>> {
    docs.iter()
        .filter(|(_, d)| str_of(d, "kind") == Some("ConfigMap"))
        .filter_map(|(_, d)| {
            let name = str_of(d.get("metadata")?, "name")?.to_owned();
            let data = d
                .get("data")?
                .as_mapping()?
                .iter()
                .filter_map(|(k, v)| Some((k.as_str()?.to_owned(), v.as_str()?.to_owned())))
                .collect();
            Some((name, data))
        })
        .collect()
}

/// What the downward API would give, for the fields the manifests use.
fn field(path: &str) -> String {
    match path {
        "status.podIP" => "10.0.0.5".into(),
        "spec.nodeName" => "node-a".into(),
        "metadata.namespace" => "llmgw".into(),
        other => panic!("a downward API field this test does not know: {other}"),
    }
}

/// The container's environment as the kubelet builds it.
fn environment(
    container: &Value,
    maps: &HashMap<String, HashMap<String, String>>,
) -> HashMap<String, String> {
    let map = |name: &str| {
        maps.get(name)
            .unwrap_or_else(|| panic!("ConfigMap {name} is not in the manifests"))
    };
    let mut env = HashMap::new();
    for source in container
        .get("envFrom")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
    {
        if let Some(name) = source.get("configMapRef").and_then(|r| str_of(r, "name")) {
            env.extend(map(name).clone());
        }
    }
    for var in container
        .get("env")
        .and_then(Value::as_sequence)
        .into_iter()
        .flatten()
    {
        let name = str_of(var, "name").expect("env name").to_owned();
        let value = if let Some(v) = str_of(var, "value") {
            v.to_owned()
        } else if let Some(r) = var.get("valueFrom").and_then(|f| f.get("configMapKeyRef")) {
            let (m, key) = (
                str_of(r, "name").expect("map"),
                str_of(r, "key").expect("key"),
            );
            map(m)
                .get(key)
                .unwrap_or_else(|| panic!("ConfigMap {m} has no key {key}"))
                .clone()
        } else if let Some(r) = var.get("valueFrom").and_then(|f| f.get("fieldRef")) {
            field(str_of(r, "fieldPath").expect("fieldPath"))
        } else {
            panic!("env {name}: a source this test does not know");
        };
        env.insert(name, value);
    }
    env
}

/// `$(VAR)` expanded from `env`; an unknown variable fails (the kubelet would leave it as is).
fn expand(arg: &str, env: &HashMap<String, String>, what: &str) -> String {
    let mut out = String::new();
    let mut rest = arg;
    while let Some(start) = rest.find("$(") {
        out.push_str(&rest[..start]);
        let end = rest[start..]
            .find(')')
            .unwrap_or_else(|| panic!("{what}: unclosed $( in {arg}"));
        let name = &rest[start + 2..start + end];
        out.push_str(
            env.get(name)
                .unwrap_or_else(|| panic!("{what}: $({name}) is not in the container's env")),
        );
        rest = &rest[start + end + 1..];
    }
    out.push_str(rest);
    out
}

#[test]
fn every_llmgw_container_in_the_manifests_passes_flags_its_binary_takes() {
    let docs = documents();
    let maps = config_maps(&docs);
    let mut checked = Vec::new();
    for (file, doc) in &docs {
        let Some(containers) = doc
            .get("spec")
            .and_then(|s| s.get("template"))
            .and_then(|t| t.get("spec"))
            .and_then(|s| s.get("containers"))
            .and_then(Value::as_sequence)
        else {
            continue;
        };
        for c in containers {
            let image = str_of(c, "image").unwrap_or_default();
            let binary = if image.contains("llmgw-router") {
                "llmgw-router"
            } else if image.contains("llmgw-agent") {
                "llmgw-agent"
            } else {
                continue;
            };
            let what = format!("{file}: container {}", str_of(c, "name").unwrap_or("?"));
            let env = environment(c, &maps);
            let args: Vec<String> = c
                .get("args")
                .and_then(Value::as_sequence)
                .unwrap_or_else(|| panic!("{what}: no args"))
                .iter()
                .map(|a| expand(a.as_str().expect("string arg"), &env, &what))
                .collect();
            let out = Command::new(bin_path(binary))
                .args(&args)
                .arg("--help")
                .env_clear()
                .output()
                .expect("run the binary");
            assert!(
                out.status.success(),
                "{what}: `{binary} {}` is refused:\n{}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr)
            );
            checked.push(what);
        }
    }
    // The router and the sidecar agent (deploy/), the per-node agent, the GIE picker.
    assert!(
        checked.len() >= 4,
        "too few llmgw containers found: {checked:?}"
    );
    assert!(
        checked.iter().any(|c| c.contains("agent-daemonset")),
        "{checked:?}"
    );
}

#[test]
fn a_flag_the_binary_does_not_take_is_caught() {
    // The check above is only worth something if a wrong flag fails it.
    for bad in [
        vec!["serve", "--router=r:9004", "--no-such-flag"],
        vec!["serve", "--router-resolve-interval-ms=soon"],
    ] {
        let out = Command::new(bin_path("llmgw-agent"))
            .args(&bad)
            .arg("--help")
            .env_clear()
            .output()
            .expect("run the agent");
        assert!(!out.status.success(), "{bad:?} was accepted");
    }
}
