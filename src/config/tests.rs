use super::*;
use crate::pool::Pool;

#[test]
fn replica_flags_parse() {
    let spec = parse_replica_flag("tiny=127.0.0.1:8001@node-a").unwrap();
    assert_eq!(spec.address, "127.0.0.1:8001".parse().unwrap());
    assert_eq!(spec.models, vec!["tiny"]);
    assert_eq!(spec.node.as_deref(), Some("node-a"));
    let local = parse_replica_flag("m=localhost:9").unwrap();
    assert_eq!(local.address, "127.0.0.1:9".parse().unwrap());
    assert_eq!(local.node, None);
    for bad in [
        "tiny",
        "=1.2.3.4:1",
        "m=host.example:1",
        "m=1.2.3.4",
        "m=1.2.3.4:1@",
    ] {
        assert!(parse_replica_flag(bad).is_err(), "{bad}");
    }
}

/// Writes `text` as the configuration file llmgw.yaml in `dir`.
fn write_file(dir: &tempfile::TempDir, text: &str) -> PathBuf {
    crate::testing::write_file(dir.path(), "llmgw.yaml", text)
}

#[test]
fn flags_override_file_override_defaults() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(
        &dir,
        "grpc_addr: 127.0.0.1:7000\nscrape_interval: 50ms\nreplicas:\n  - address: 127.0.0.1:8001\n    models: [tiny, tiny-lora]\nscheduler:\n  weights: {queue: 3}\n  fallbacks: 1\n",
    );
    let args = ServeArgs {
        config: Some(path),
        replicas: vec!["tiny=127.0.0.1:8002".to_string()],
        grpc_addr: Some("127.0.0.1:7001".parse().unwrap()),
        scheduler: SchedulerArgs {
            weight_kv_utilization: Some(0.5),
            ..SchedulerArgs::default()
        },
        ..ServeArgs::default()
    };
    let settings = Settings::resolve(&args).unwrap();
    assert_eq!(settings.grpc_addr, "127.0.0.1:7001".parse().unwrap());
    assert_eq!(settings.admin_addr, "127.0.0.1:9090".parse().unwrap());
    assert_eq!(settings.probes.scrape_interval, Duration::from_millis(50));
    assert_eq!(settings.probes.health_interval, Duration::from_secs(1));
    assert_eq!(settings.replicas.len(), 2);
    assert_eq!(settings.replicas[0].models, vec!["tiny", "tiny-lora"]);
    let weights: Vec<(String, Option<f64>)> = settings
        .scheduler
        .effective_profile()
        .unwrap()
        .scorers
        .into_iter()
        .map(|s| (s.name().to_owned(), s.weight))
        .collect();
    assert_eq!(
        weights,
        [
            ("kv_cache".to_owned(), Some(2.0)),
            ("adapter_affinity".to_owned(), Some(1.0)),
            ("cache_footprint".to_owned(), Some(2.0)),
            ("queue".to_owned(), Some(3.0)),
            ("in_flight".to_owned(), Some(1.0)),
            ("kv_utilization".to_owned(), Some(0.5)),
        ]
    );
    assert_eq!(settings.scheduler.fallbacks, 1);
    assert_eq!(settings.destination_header, DESTINATION_HEADER);
}

#[test]
fn unknown_file_fields_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "grpc_adr: 127.0.0.1:7000\n");
    let args = ServeArgs {
        config: Some(path),
        ..ServeArgs::default()
    };
    let err = Settings::resolve(&args).unwrap_err();
    assert!(
        matches!(&err, ConfigError::UnknownKeys { keys, .. } if keys == "grpc_adr"),
        "{err}"
    );
    // Keys of the modules' flattened groups are known; their neighbours' typos are not.
    let path = write_file(
        &dir,
        "tokenize_deadline: 20ms\nfeed_grace: 5s\nfeed_gracee: 5s\nhealth_intreval: 1s\n",
    );
    let err = Settings::resolve(&ServeArgs {
        config: Some(path),
        ..ServeArgs::default()
    })
    .unwrap_err();
    assert!(
        matches!(&err, ConfigError::UnknownKeys { keys, .. } if keys == "feed_gracee, health_intreval"),
        "{err}"
    );
    // A flag-only key (a secret) is not a file key.
    let path = write_file(&dir, "feed_token: hunter2\n");
    let err = Settings::resolve(&ServeArgs {
        config: Some(path),
        ..ServeArgs::default()
    })
    .unwrap_err();
    assert!(err.to_string().contains("feed_token"), "{err}");
    // A known key with a bad value is still the YAML's error, naming the key.
    let path = write_file(&dir, "feed_grace: soon\n");
    let err = Settings::resolve(&ServeArgs {
        config: Some(path),
        ..ServeArgs::default()
    })
    .unwrap_err();
    assert!(matches!(err, ConfigError::Yaml { .. }), "{err}");
}

#[tokio::test]
async fn changed_file_swaps_the_replicas() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(
        &dir,
        "replicas:\n  - address: 127.0.0.1:8001\n    models: [m]\n",
    );
    let flag = parse_replica_flag("m=127.0.0.1:8009").unwrap();
    let settings = Settings::resolve(&ServeArgs {
        config: Some(path.clone()),
        ..ServeArgs::default()
    })
    .unwrap();
    let pool = Arc::new(Pool::new(settings.replicas, Duration::from_secs(2)));
    let sources = Arc::new(ReplicaSources::new(Arc::clone(&pool), 1, |_| {}));
    let watcher = tokio::spawn(watch_replicas(
        path.clone(),
        Duration::from_millis(20),
        vec![flag],
        sources,
    ));
    write_file(
        &dir,
        "replicas:\n  - address: 127.0.0.1:8001\n    models: [m]\n  - address: 127.0.0.1:8002\n    models: [m]\n",
    );
    let mut endpoints = Vec::new();
    for _ in 0..200 {
        endpoints = pool
            .snapshot()
            .replicas()
            .iter()
            .map(|r| r.endpoint().to_string())
            .collect();
        if endpoints.len() == 3 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        endpoints,
        vec!["127.0.0.1:8001", "127.0.0.1:8002", "127.0.0.1:8009"]
    );

    // A broken file keeps the current replicas.
    write_file(&dir, "replicas: [oops\n");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(pool.snapshot().replicas().len(), 3);
    watcher.abort();
}

#[test]
fn models_and_precise_settings_from_file_and_flags() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(
        &dir,
        "models:\n  - name: tiny\n    block_size: 16\n    hash_seed: \"1729\"\n  - name: big\n    block_size: 32\ntokenize_deadline: 20ms\nscheduler:\n  profile:\n    scorers:\n      - {type: kv_cache, parameters: {speculative_ttl: 0s}}\n",
    );
    let args = ServeArgs {
        config: Some(path),
        models: vec!["big=block_size=64,algo=xxhash_cbor,seed=7".to_string()],
        scheduler: SchedulerArgs {
            min_prefix_blocks: Some(3),
            ..SchedulerArgs::default()
        },
        ..ServeArgs::default()
    };
    let settings = Settings::resolve(&args).unwrap();
    assert_eq!(settings.models.len(), 2);
    assert_eq!(settings.models[0].model, "tiny");
    assert_eq!(settings.models[0].hashing.seed.as_deref(), Some("1729"));
    // The flag replaced the file's entry for the same model.
    assert_eq!(settings.models[1].model, "big");
    assert_eq!(settings.models[1].hashing.block_size.get(), 64);
    assert_eq!(settings.tokenizer.deadline, Duration::from_millis(20));
    let kv_cache = &settings.scheduler.profile.scorers[0];
    assert_eq!(
        kv_cache.parameters["speculative_ttl"],
        serde_yaml::Value::from("0s")
    );
    assert_eq!(
        kv_cache.parameters["min_blocks"],
        serde_yaml::Value::from(3)
    );

    let unreproducible = ServeArgs {
        models: vec!["m=block_size=16,algo=xxhash_cbor".to_string()],
        ..ServeArgs::default()
    };
    let err = Settings::resolve(&unreproducible).unwrap_err().to_string();
    assert!(err.contains("seed"), "{err}");
}

#[test]
fn feed_tls_paths_come_from_flags_over_the_file_and_must_be_complete() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(
        &dir,
        "feed_tls_cert: /file/cert.pem\nfeed_tls_key: /file/key.pem\nfeed_tls_client_ca: /file/ca.pem\n",
    );
    let args = ServeArgs {
        config: Some(path),
        feed: FeedOptions {
            feed_tls_cert: Some("/flag/cert.pem".into()),
            ..FeedOptions::default()
        },
        ..ServeArgs::default()
    };
    let tls = Settings::resolve(&args).unwrap().feed.tls.unwrap();
    assert_eq!(tls.cert, PathBuf::from("/flag/cert.pem"));
    assert_eq!(tls.key, PathBuf::from("/file/key.pem"));
    assert_eq!(tls.client_ca, Some(PathBuf::from("/file/ca.pem")));
    assert!(
        tls.check_node,
        "a client cert must name its node by default"
    );
    for (flag, file) in [(true, ""), (false, "feed_tls_skip_node_check: true\n")] {
        let path = write_file(
            &dir,
            &format!("feed_tls_cert: /c.pem\nfeed_tls_key: /k.pem\n{file}"),
        );
        let args = ServeArgs {
            config: Some(path),
            feed: FeedOptions {
                feed_tls_skip_node_check: flag,
                ..FeedOptions::default()
            },
            ..ServeArgs::default()
        };
        let tls = Settings::resolve(&args).unwrap().feed.tls.unwrap();
        assert!(!tls.check_node, "flag {flag}, file {file:?}");
    }

    assert!(
        Settings::resolve(&ServeArgs::default())
            .unwrap()
            .feed
            .tls
            .is_none()
    );
    for args in [
        ServeArgs {
            feed: FeedOptions {
                feed_tls_cert: Some("c".into()),
                ..FeedOptions::default()
            },
            ..ServeArgs::default()
        },
        ServeArgs {
            feed: FeedOptions {
                feed_tls_key: Some("k".into()),
                ..FeedOptions::default()
            },
            ..ServeArgs::default()
        },
        ServeArgs {
            feed: FeedOptions {
                feed_tls_client_ca: Some("ca".into()),
                ..FeedOptions::default()
            },
            ..ServeArgs::default()
        },
    ] {
        let err = Settings::resolve(&args).unwrap_err();
        assert!(
            matches!(err, ConfigError::Feed(FeedOptionsError::Tls(_))),
            "{err}"
        );
    }
}

#[test]
fn a_change_is_applied_once_it_held_for_a_poll() {
    let mut changes = SettledChanges::new(Some(b"v1".to_vec()));
    assert!(!changes.settled(Some(b"v1")), "unchanged");
    // Half-written, then whole: the half never counts.
    assert!(!changes.settled(Some(b"v2 half")));
    assert!(!changes.settled(Some(b"v2 half and the rest")));
    assert!(changes.settled(Some(b"v2 half and the rest")));
    assert!(
        !changes.settled(Some(b"v2 half and the rest")),
        "applied once"
    );
    // A change undone before it settled is no change.
    assert!(!changes.settled(None));
    assert!(!changes.settled(Some(b"v2 half and the rest")));
    assert!(!changes.settled(Some(b"v2 half and the rest")));
    // A file that disappears is a change too, once it stays gone.
    assert!(!changes.settled(None));
    assert!(changes.settled(None));
}

#[test]
fn gie_flags_resolve() {
    let args = ServeArgs {
        replicas: vec!["tiny=127.0.0.1:8001".to_string()],
        grpc_port: Some(9102),
        grpc_health_port: Some(9103),
        pool_name: Some("pool".to_string()),
        ..ServeArgs::default()
    };
    let settings = Settings::resolve(&args).unwrap();
    assert_eq!(settings.grpc_addr, "0.0.0.0:9102".parse().unwrap());
    assert_eq!(
        settings.grpc_health_addr,
        Some("0.0.0.0:9103".parse().unwrap())
    );
    assert_eq!(
        settings.pool,
        Some(PoolIdentity {
            name: "pool".to_string(),
            namespace: String::new()
        })
    );
    // --grpc-addr wins over --grpc-port.
    let addr = ServeArgs {
        grpc_addr: Some("127.0.0.1:9200".parse().unwrap()),
        ..args.clone()
    };
    assert_eq!(
        Settings::resolve(&addr).unwrap().grpc_addr,
        "127.0.0.1:9200".parse().unwrap()
    );
    let namespace_only = ServeArgs {
        pool_name: None,
        pool_namespace: Some("llm".to_string()),
        ..args
    };
    assert!(matches!(
        Settings::resolve(&namespace_only),
        Err(ConfigError::PoolNamespaceWithoutName)
    ));
}

#[test]
fn kubernetes_services_from_file_and_flags() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(
        &dir,
        "k8s_services:\n  - {model: base, namespace: llm, service: vllm-base, port: 8000}\nkubeconfig: /etc/llmgw/kubeconfig\n",
    );
    let args = ServeArgs {
        config: Some(path),
        discovery: DiscoveryOptions {
            k8s_services: vec!["lora=llm/vllm-lora:8001".parse().unwrap()],
            ..DiscoveryOptions::default()
        },
        ..ServeArgs::default()
    };
    let settings = Settings::resolve(&args).unwrap();
    let specs: Vec<String> = settings
        .discovery
        .services
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(
        specs,
        ["base=llm/vllm-base:8000", "lora=llm/vllm-lora:8001"]
    );
    assert_eq!(
        settings.discovery.kubeconfig.as_deref(),
        Some(std::path::Path::new("/etc/llmgw/kubeconfig"))
    );
}

/// The flags as `llmgw-router serve` parses them.
#[derive(clap::Parser)]
struct Serve {
    #[command(flatten)]
    args: ServeArgs,
}

#[test]
fn a_bad_flag_value_is_refused_by_the_parser_naming_the_flag() {
    use clap::Parser as _;
    let err = Serve::try_parse_from(["serve", "--k8s-service", "lora=vllm-lora"])
        .err()
        .expect("refused");
    let text = err.to_string();
    assert!(text.contains("--k8s-service"), "{text}");
    assert!(text.contains("MODEL=NAMESPACE/SERVICE:PORT"), "{text}");
    let err = Serve::try_parse_from(["serve", "--feed-grace", "soon"])
        .err()
        .expect("refused");
    assert!(err.to_string().contains("--feed-grace"), "{err}");
    // The groups the modules own parse as flags like the rest.
    let parsed = Serve::try_parse_from([
        "serve",
        "--tokenize-deadline",
        "20ms",
        "--offloaded-weight",
        "0.25",
        "--index-home-memory",
        "5s",
        "--feed-max-blocks-per-engine",
        "9",
        "--probe-timeout",
        "3s",
        "--kubeconfig",
        "/tmp/kube.yaml",
    ])
    .expect("parses");
    let settings = Settings::resolve(&parsed.args).unwrap();
    assert_eq!(settings.tokenizer.deadline, Duration::from_millis(20));
    assert_eq!(settings.index.offloaded_weight, 0.25);
    assert_eq!(settings.index.home_memory, Duration::from_secs(5));
    assert_eq!(settings.feed.limits.max_blocks_per_engine, 9);
    assert_eq!(settings.probes.timeout, Duration::from_secs(3));
    assert_eq!(
        settings.discovery.kubeconfig.as_deref(),
        Some(std::path::Path::new("/tmp/kube.yaml"))
    );
}

#[test]
fn the_unix_socket_comes_from_the_flag_or_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(&dir, "grpc_uds: /run/llmgw/file.sock\n");
    let from_file = ServeArgs {
        config: Some(path.clone()),
        replicas: vec!["tiny=127.0.0.1:8001".to_string()],
        ..ServeArgs::default()
    };
    assert_eq!(
        Settings::resolve(&from_file).unwrap().grpc_uds,
        Some(PathBuf::from("/run/llmgw/file.sock"))
    );
    let flag_wins = ServeArgs {
        grpc_uds: Some(PathBuf::from("/run/llmgw/flag.sock")),
        ..from_file
    };
    assert_eq!(
        Settings::resolve(&flag_wins).unwrap().grpc_uds,
        Some(PathBuf::from("/run/llmgw/flag.sock"))
    );
    let neither = ServeArgs {
        replicas: vec!["tiny=127.0.0.1:8001".to_string()],
        ..ServeArgs::default()
    };
    assert_eq!(Settings::resolve(&neither).unwrap().grpc_uds, None);
}

#[test]
fn an_inference_pool_alone_is_a_source_of_replicas() {
    let nothing = Settings::resolve(&ServeArgs::default()).unwrap();
    assert!(!nothing.has_replica_source());
    let pool = Settings::resolve(&ServeArgs {
        pool_name: Some("vllm".to_string()),
        ..ServeArgs::default()
    })
    .unwrap();
    assert!(pool.has_replica_source());
    let service = Settings::resolve(&ServeArgs {
        discovery: DiscoveryOptions {
            k8s_services: vec!["m=llm/vllm:8000".parse().unwrap()],
            ..DiscoveryOptions::default()
        },
        ..ServeArgs::default()
    })
    .unwrap();
    assert!(service.has_replica_source());
}

#[test]
fn peers_come_from_the_file_and_a_bad_one_is_refused_at_start_up() {
    let dir = tempfile::tempdir().unwrap();
    let path = write_file(
        &dir,
        "peers: [http://10.0.0.2:9003, http://10.0.0.3:9003]\npeer_service: routers.llmgw:9003\npeer_resolve_interval: 5s\n",
    );
    let args = ServeArgs {
        config: Some(path),
        ..ServeArgs::default()
    };
    let settings = Settings::resolve(&args).unwrap();
    let urls: Vec<&str> = settings
        .peers
        .peers
        .iter()
        .map(|p| p.url.as_str())
        .collect();
    assert_eq!(urls, ["http://10.0.0.2:9003", "http://10.0.0.3:9003"]);
    let service = settings.peers.service.expect("peer_service");
    assert_eq!(service.target, "routers.llmgw:9003");
    assert_eq!(service.interval, Duration::from_secs(5));

    let bad = write_file(&dir, "peers: [10.0.0.2:9003]\n");
    let error = Settings::resolve(&ServeArgs {
        config: Some(bad),
        ..ServeArgs::default()
    })
    .unwrap_err();
    assert!(error.to_string().contains("10.0.0.2:9003"), "{error}");
}

#[test]
fn peer_tls_comes_from_the_file_and_a_tls_feed_without_it_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let ca = crate::testing::TestCa::new("routers");
    let file = |name: &str, text: &str| crate::testing::write_file(dir.path(), name, text);
    let ca_path = file("ca.crt", &ca.pem());
    let (cert, key) = ca.leaf(&["localhost"], &[]);
    let cert_path = file("tls.crt", &cert);
    let key_path = file("tls.key", &key);
    let feed = format!(
        "feed_tls_cert: {}\nfeed_tls_key: {}\npeers: [https://router-2.llmgw:9003]\n",
        cert_path.display(),
        key_path.display()
    );
    let with_ca = write_file(&dir, &format!("{feed}peer_tls_ca: {}\n", ca_path.display()));
    let settings = Settings::resolve(&ServeArgs {
        config: Some(with_ca),
        ..ServeArgs::default()
    })
    .unwrap();
    assert_eq!(settings.peers.tls.expect("TLS to peers").files.ca, ca_path);

    let without = write_file(&dir, &feed);
    let error = Settings::resolve(&ServeArgs {
        config: Some(without),
        ..ServeArgs::default()
    })
    .unwrap_err();
    assert!(error.to_string().contains("--peer-tls-ca"), "{error}");
}
