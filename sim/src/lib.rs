//! `llmgw-sim`: a simulated vLLM replica that behaves on the wire like vLLM's OpenAI server
//! with prefix caching and KV events on (`shared/reference/vllm.md`).
//!
//! | module | what |
//! |---|---|
//! | [`cli`] | `vllm serve` flags plus `--sim-*` |
//! | [`tokenizer`] | HF `tokenizers` BPE + chat template (minijinja) |
//! | [`engine`] | scheduler loop, latency model, [`engine::pool`] block pool with prefix caching |
//! | [`events`] | KV events and their msgpack encoding (map and array forms) |
//! | [`lora`] | LoRA adapters (`--enable-lora --lora-modules`) and `vllm:lora_requests_info` |
//! | [`publisher`] | ZMQ PUB (topic, seq, payload) and replay ROUTER |
//! | [`http`] | OpenAI routes, `/tokenize`, `/metrics`, `/debug/blocks`, `/sim/*` faults |
//! | [`metrics`], [`error`] | Prometheus text; vLLM's error JSON |
//!
//! Concurrency model: the binary runs everything on one current-thread tokio runtime (one
//! core per simulated replica). The engine task owns the engine state; the publisher tasks own
//! the sockets; HTTP handlers share immutable state. See each module.
//!
//! On start the simulator prints, on stdout and in this order: `llmgw-sim kv-events on
//! ENDPOINT` (when the PUB socket binds), `llmgw-sim kv-replay on ENDPOINT` (with a replay
//! endpoint), then `llmgw-sim listening on http://HOST:PORT` once everything accepts
//! connections.

pub mod cli;
pub mod engine;
pub mod error;
pub mod events;
pub mod http;
pub mod lora;
pub mod metrics;
pub mod publisher;
pub mod tokenizer;

use std::io::Write as _;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::http::HeaderValue;
use llmgw::blockhash::{BlockHasher, HashAlgo, HashSettings};
use tokio::sync::mpsc;

use self::cli::Cli;
use self::engine::{Engine, EngineConfig, LatencyModel};
use self::events::{Encoding, EventFormat, HashForm};
use self::publisher::{Faults, PublisherConfig};
use self::tokenizer::SimTokenizer;

/// Startup errors.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Tokenizer(#[from] tokenizer::TokenizerError),
    #[error(transparent)]
    Hash(#[from] llmgw::blockhash::BlockHashError),
    #[error(transparent)]
    Publisher(#[from] publisher::PublisherError),
    #[error(transparent)]
    Lora(#[from] lora::LoraError),
    #[error("cannot listen on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error(
        "max_model_len {max_model_len} does not fit the KV cache: {blocks} usable blocks of \
         {block_size} tokens hold {capacity} tokens"
    )]
    CacheTooSmall {
        max_model_len: usize,
        blocks: usize,
        block_size: usize,
        capacity: usize,
    },
    #[error("invalid --sim-replica header value")]
    Replica,
    #[error("server error: {0}")]
    Serve(std::io::Error),
}

fn secs_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Runs the simulator until the process is stopped. Must be called inside a tokio runtime.
pub async fn run(cli: Cli) -> Result<(), SimError> {
    let block_size = cli.block_size.get();
    let usable = cli.num_gpu_blocks_override.saturating_sub(1);
    if usable * block_size < cli.max_model_len {
        return Err(SimError::CacheTooSmall {
            max_model_len: cli.max_model_len,
            blocks: usable,
            block_size,
            capacity: usable * block_size,
        });
    }
    let adapters = lora::load_adapters(&cli.lora_modules, cli.enable_lora)?;
    let max_loras = cli.enable_lora.then_some(cli.max_loras.get());
    let seed = Cli::python_hash_seed().or_else(|| match cli.prefix_caching_hash_algo {
        // vLLM ≥ 0.29 seeds xxhash randomly when PYTHONHASHSEED is unset.
        HashAlgo::XxhashCbor => Some(format!(
            "{:032x}",
            secs_now().to_bits() ^ u64::from(std::process::id())
        )),
        HashAlgo::Sha256Cbor => None,
    });
    let hasher = BlockHasher::new(&HashSettings {
        algo: cli.prefix_caching_hash_algo,
        seed,
        block_size: cli.block_size,
        salt_encoding: cli.sim_salt_encoding,
    })?;
    let tokenizer = Arc::new(SimTokenizer::load(
        cli.tokenizer.as_deref(),
        cli.chat_template.as_deref(),
    )?);
    let events_cfg = cli.kv_events_config.clone().unwrap_or_default();
    let publishes = events_cfg.publishes();
    let faults = Arc::new(Faults::default());
    for r in &cli.sim_drop_seqs {
        faults.drop_seqs(r.clone());
    }

    // Publisher first, so its endpoints are known before the HTTP line is printed.
    let mut stdout_lines = Vec::new();
    let events_tx = if publishes {
        let (tx, rx) = mpsc::channel(events_cfg.max_queue_size.max(1));
        let encoding = Encoding {
            format: cli.sim_event_format,
            hashes: if cli.kv_events_use_int_block_hashes {
                HashForm::Int
            } else {
                HashForm::Bytes
            },
        };
        let bound = publisher::start(
            PublisherConfig {
                events: events_cfg.clone(),
                encoding,
                replay_topic_frame: cli
                    .sim_replay_topic_frame
                    .unwrap_or(cli.sim_event_format != EventFormat::Array),
            },
            rx,
            Arc::clone(&faults),
        )
        .await?;
        if let Some(ep) = bound.publisher {
            stdout_lines.push(format!("llmgw-sim kv-events on {ep}"));
        }
        if let Some(ep) = bound.replay {
            stdout_lines.push(format!("llmgw-sim kv-replay on {ep}"));
        }
        Some(tx)
    } else {
        None
    };

    let latency = if cli.sim_no_latency {
        LatencyModel::default()
    } else {
        LatencyModel {
            prefill_per_token: Duration::from_micros(cli.sim_prefill_us_per_token),
            decode_per_step: Duration::from_micros(cli.sim_decode_us_per_token),
            step_overhead: Duration::from_micros(cli.sim_step_overhead_us),
        }
    };
    let engine = Engine::spawn(
        EngineConfig {
            num_blocks: cli.num_gpu_blocks_override,
            max_num_seqs: cli.max_num_seqs.max(1),
            prefix_caching: cli.prefix_caching(),
            kv_events: publishes && cli.prefix_caching(),
            latency,
            output_len: cli.sim_output_len,
            hasher,
            vocab: tokenizer.word_ids().into(),
            data_parallel_rank: cli.data_parallel_rank,
            max_loras,
        },
        events_tx,
    );

    let addr = format!("{}:{}", cli.host, cli.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| SimError::Listen {
            addr: addr.clone(),
            source,
        })?;
    let local = listener.local_addr().map_err(|source| SimError::Listen {
        addr: addr.clone(),
        source,
    })?;
    let shown_host = if local.ip().is_unspecified() {
        "127.0.0.1".to_owned()
    } else {
        local.ip().to_string()
    };
    let shown = format!("{shown_host}:{}", local.port());
    let replica = cli.sim_replica.clone().unwrap_or_else(|| shown.clone());
    let names = cli.served_names();
    let created = secs_now();
    let state = Arc::new(http::AppState {
        metrics: metrics::MetricsInfo {
            model_name: names.first().cloned().unwrap_or_default(),
            engine: cli.data_parallel_rank.to_string(),
            block_size,
            num_gpu_blocks: cli.num_gpu_blocks_override,
            prefix_caching: cli.prefix_caching(),
            hash_algo: cli.prefix_caching_hash_algo.to_string(),
            created,
            max_loras,
        },
        names,
        adapters,
        root: cli.model_tag.clone().unwrap_or_else(|| cli.model.clone()),
        max_model_len: cli.max_model_len,
        tokenize_delay_ms: std::sync::atomic::AtomicU64::new(cli.sim_tokenize_delay_ms),
        tokenizer,
        engine,
        faults,
        replica: HeaderValue::from_str(&replica).map_err(|_| SimError::Replica)?,
        created: created as u64,
        next_id: AtomicU64::new(0),
    });
    stdout_lines.push(format!("llmgw-sim listening on http://{shown}"));
    {
        let mut out = std::io::stdout().lock();
        for line in &stdout_lines {
            let _ = writeln!(out, "{line}");
        }
        let _ = out.flush();
    }
    // TCP_NODELAY, as vLLM's uvicorn (asyncio) sets it: without it a streamed response's small
    // writes on a kept-alive connection meet the client's delayed ACK and the first token
    // arrives ~40 ms late.
    let listener = axum::serve::ListenerExt::tap_io(listener, |tcp| {
        if let Err(error) = tcp.set_nodelay(true) {
            tracing::warn!("TCP_NODELAY on an accepted connection: {error}");
        }
    });
    axum::serve(listener, http::router(state))
        .await
        .map_err(SimError::Serve)
}
