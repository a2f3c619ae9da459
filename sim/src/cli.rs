//! Command line: the `vllm serve` flags for what the simulator models, with vLLM's meaning, plus
//! its own `--sim-*` flags. `PYTHONHASHSEED` and `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` come
//! from the environment as for vLLM.

use std::num::NonZeroUsize;
use std::ops::RangeInclusive;
use std::path::PathBuf;

use clap::Parser;
use llmgw::blockhash::{HashAlgo, SaltEncoding};

use crate::events::EventFormat;
use crate::lora::{LoraModule, parse_lora_module};
use crate::publisher::KvEventsConfig;

/// A simulated vLLM replica: vLLM's OpenAI server, prefix cache and KV events, without a GPU.
#[derive(Debug, Clone, Parser)]
#[command(name = "llmgw-sim", version, args_override_self = true)]
pub struct Cli {
    /// The model (as `vllm serve MODEL`); names the served model unless
    /// `--served-model-name` is given.
    #[arg(value_name = "MODEL")]
    pub model_tag: Option<String>,

    /// Same as the positional MODEL.
    #[arg(long, env = "LLMGW_SIM_MODEL", default_value = "llmgw-sim/tiny")]
    pub model: String,

    #[arg(long, default_value = "0.0.0.0")]
    pub host: String,

    /// HTTP port; 0 picks a free one (printed on stdout).
    #[arg(long, default_value_t = 8000)]
    pub port: u16,

    /// Names the model answers to; the first is reported in responses and metrics.
    #[arg(long, num_args = 1..)]
    pub served_model_name: Vec<String>,

    /// Tokens per KV block.
    #[arg(long, default_value_t = NonZeroUsize::new(16).unwrap_or(NonZeroUsize::MIN))]
    pub block_size: NonZeroUsize,

    /// Cache capacity in blocks (block 0 is vLLM's reserved null block).
    #[arg(long, default_value_t = 8192)]
    pub num_gpu_blocks_override: usize,

    /// Context limit (prompt + completion tokens).
    #[arg(long, default_value_t = 4096)]
    pub max_model_len: usize,

    /// Running-batch limit; further requests wait.
    #[arg(long, default_value_t = 256)]
    pub max_num_seqs: usize,

    /// sha256_cbor or xxhash_cbor (the pickle-based algorithms cannot be reproduced).
    #[arg(long, default_value = "sha256_cbor", value_parser = parse_algo)]
    pub prefix_caching_hash_algo: HashAlgo,

    /// Prefix caching is on by default (as in vLLM V1).
    #[arg(long, overrides_with = "no_enable_prefix_caching")]
    pub enable_prefix_caching: bool,

    #[arg(long)]
    pub no_enable_prefix_caching: bool,

    /// vLLM's KVEventsConfig as JSON.
    #[arg(long, value_parser = parse_kv_events)]
    pub kv_events_config: Option<KvEventsConfig>,

    /// A tokenizer.json, or a directory holding one (default: the one the repo ships).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,

    /// A chat template file or inline Jinja (default: the shipped template).
    #[arg(long)]
    pub chat_template: Option<String>,

    /// Accepted for compatibility: usage always carries `prompt_tokens_details`.
    #[arg(long)]
    pub enable_prompt_tokens_details: bool,

    /// Accepted for compatibility (request logging is off).
    #[arg(long)]
    pub disable_log_requests: bool,

    /// Accepted for compatibility (always on).
    #[arg(long)]
    pub enable_server_dev_mode: bool,

    /// 1 (default): events carry hashes as u64; 0: raw digests as msgpack bin.
    #[arg(long, env = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", default_value = "1", value_parser = parse_bool01)]
    pub kv_events_use_int_block_hashes: bool,

    /// Data-parallel rank stamped into event batches and the `engine` metrics label.
    #[arg(long, default_value_t = 0)]
    pub data_parallel_rank: u32,

    /// Serve LoRA adapters besides the base model.
    #[arg(long)]
    pub enable_lora: bool,

    /// LoRA adapters, each `name=path` or JSON `{"name": …, "path": …, "base_model_name": …}`;
    /// ids 1, 2, … in this order. Needs `--enable-lora`.
    #[arg(long, num_args = 1.., value_parser = parse_lora_module, requires = "enable_lora")]
    pub lora_modules: Vec<LoraModule>,

    /// Most distinct adapters among the running requests at once.
    #[arg(long, default_value_t = NonZeroUsize::MIN)]
    pub max_loras: NonZeroUsize,

    /// Accepted for compatibility (adapter weights are not simulated).
    #[arg(long, default_value_t = 16)]
    pub max_lora_rank: u32,

    // ---- simulator flags ----
    /// Prefill time per uncached prompt token, in microseconds.
    #[arg(long, default_value_t = 50)]
    pub sim_prefill_us_per_token: u64,

    /// Decode time per engine step (one token for every running request), in microseconds.
    #[arg(long, default_value_t = 5_000)]
    pub sim_decode_us_per_token: u64,

    /// Fixed time added to each engine step, in microseconds.
    #[arg(long, default_value_t = 0)]
    pub sim_step_overhead_us: u64,

    /// Turns the latency model off (every step takes only the CPU time it needs).
    #[arg(long)]
    pub sim_no_latency: bool,

    /// Tokens the model says before its end of sequence (finish_reason "stop"), unless
    /// max_tokens cuts it first ("length").
    #[arg(long, default_value_t = 16)]
    pub sim_output_len: usize,

    /// Event container format: map (vLLM 0.24 – 0.32), map-0.33 (map16 BlockStored header) or
    /// array (vLLM ≤ 0.23).
    #[arg(long, default_value = "map")]
    pub sim_event_format: EventFormat,

    /// Replay replies carry a topic frame (vLLM ≥ 0.26). Default: on with map events, off with
    /// array events.
    #[arg(long)]
    pub sim_replay_topic_frame: Option<bool>,

    /// cache_salt hashing: tagged (vLLM ≥ 0.31) or untagged (0.9 – 0.30).
    #[arg(long, default_value = "tagged", value_parser = parse_salt)]
    pub sim_salt_encoding: SaltEncoding,

    /// Sequence numbers not sent on the PUB socket (still replayable): `N` or `A-B`;
    /// repeatable.
    #[arg(long, value_parser = parse_seq_range)]
    pub sim_drop_seqs: Vec<RangeInclusive<u64>>,

    /// Delay before every `/tokenize` answer, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub sim_tokenize_delay_ms: u64,
    /// Value of the `x-llmgw-sim-replica` response header (default: the bound address).
    #[arg(long)]
    pub sim_replica: Option<String>,
}

impl Cli {
    /// The name reported in responses and metrics.
    pub fn served_names(&self) -> Vec<String> {
        if self.served_model_name.is_empty() {
            vec![self.model_tag.clone().unwrap_or_else(|| self.model.clone())]
        } else {
            self.served_model_name.clone()
        }
    }

    pub fn prefix_caching(&self) -> bool {
        !self.no_enable_prefix_caching
    }

    /// `PYTHONHASHSEED` from the environment; set-but-empty counts as set, as in vLLM.
    pub fn python_hash_seed() -> Option<String> {
        std::env::var_os("PYTHONHASHSEED").map(|v| v.to_string_lossy().into_owned())
    }
}

fn parse_algo(s: &str) -> Result<HashAlgo, String> {
    s.parse::<HashAlgo>().map_err(|e| e.to_string())
}

fn parse_salt(s: &str) -> Result<SaltEncoding, String> {
    s.parse::<SaltEncoding>().map_err(|e| e.to_string())
}

fn parse_kv_events(s: &str) -> Result<KvEventsConfig, String> {
    serde_json::from_str(s).map_err(|e| format!("invalid --kv-events-config JSON: {e}"))
}

fn parse_bool01(s: &str) -> Result<bool, String> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" => Ok(true),
        "0" | "false" => Ok(false),
        other => Err(format!("expected 0 or 1, got {other:?}")),
    }
}

/// `N` or `A-B` (inclusive).
pub fn parse_seq_range(s: &str) -> Result<RangeInclusive<u64>, String> {
    let bad = || format!("expected N or A-B, got {s:?}");
    match s.split_once('-') {
        None => {
            let n = s.trim().parse().map_err(|_| bad())?;
            Ok(n..=n)
        }
        Some((a, b)) => {
            let a: u64 = a.trim().parse().map_err(|_| bad())?;
            let b: u64 = b.trim().parse().map_err(|_| bad())?;
            if a > b {
                return Err(bad());
            }
            Ok(a..=b)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_serve_flags() {
        let cli = Cli::try_parse_from([
            "llmgw-sim",
            "tiny",
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--served-model-name",
            "a",
            "b",
            "--block-size",
            "32",
            "--num-gpu-blocks-override",
            "48",
            "--max-model-len",
            "1024",
            "--prefix-caching-hash-algo",
            "xxhash_cbor",
            "--enable-prefix-caching",
            "--kv-events-config",
            r#"{"enable_kv_cache_events":true,"endpoint":"tcp://*:0","topic":"kv"}"#,
            "--sim-event-format",
            "array",
            "--sim-drop-seqs",
            "3-5",
            "--sim-drop-seqs",
            "9",
        ])
        .unwrap();
        assert_eq!(cli.served_names(), vec!["a", "b"]);
        assert_eq!(cli.block_size.get(), 32);
        assert_eq!(cli.prefix_caching_hash_algo, HashAlgo::XxhashCbor);
        assert!(cli.prefix_caching());
        assert_eq!(cli.sim_event_format, EventFormat::Array);
        assert_eq!(cli.sim_drop_seqs, vec![3..=5, 9..=9]);
        let events = cli.kv_events_config.unwrap();
        assert_eq!(events.topic, "kv");
        assert!(events.publishes());
    }

    #[test]
    fn rejects_what_cannot_be_simulated() {
        assert!(
            Cli::try_parse_from(["llmgw-sim", "--prefix-caching-hash-algo", "sha256"]).is_err()
        );
        assert!(Cli::try_parse_from(["llmgw-sim", "--kv-events-config", "{"]).is_err());
        assert!(Cli::try_parse_from(["llmgw-sim", "--sim-drop-seqs", "5-3"]).is_err());
        assert!(Cli::try_parse_from(["llmgw-sim", "--block-size", "0"]).is_err());
    }

    #[test]
    fn a_repeated_flag_takes_the_last_value() {
        // spawn_sim passes --host/--port first; a test's own --port must win.
        let cli = Cli::try_parse_from(["llmgw-sim", "--port", "0", "--port", "8123"]).unwrap();
        assert_eq!(cli.port, 8123);
    }

    #[test]
    fn lora_modules_take_both_forms_and_need_enable_lora() {
        let cli = Cli::try_parse_from([
            "llmgw-sim",
            "--enable-lora",
            "--lora-modules",
            "a=/adapters/a",
            r#"{"name":"b","path":"/adapters/b","base_model_name":"tiny"}"#,
            "--max-loras",
            "2",
            "--served-model-name",
            "tiny",
        ])
        .unwrap();
        assert!(cli.enable_lora);
        assert_eq!(cli.max_loras.get(), 2);
        assert_eq!(cli.max_lora_rank, 16);
        assert_eq!(
            cli.lora_modules,
            vec![
                LoraModule {
                    name: "a".into(),
                    path: "/adapters/a".into(),
                    base_model_name: None,
                },
                LoraModule {
                    name: "b".into(),
                    path: "/adapters/b".into(),
                    base_model_name: Some("tiny".into()),
                },
            ]
        );
        assert_eq!(
            cli.served_names(),
            vec!["tiny"],
            "the list ended at the next flag"
        );

        let plain = Cli::try_parse_from(["llmgw-sim", "--enable-lora"]).unwrap();
        assert_eq!(plain.max_loras.get(), 1, "vLLM's default");
        assert!(plain.lora_modules.is_empty());

        // vLLM refuses adapters without --enable-lora, and malformed items.
        assert!(Cli::try_parse_from(["llmgw-sim", "--lora-modules", "a=/adapters/a"]).is_err());
        for bad in ["a=b=c", "{\"name\":\"a\"}", "{"] {
            assert!(
                Cli::try_parse_from(["llmgw-sim", "--enable-lora", "--lora-modules", bad]).is_err(),
                "{bad}"
            );
        }
        assert!(Cli::try_parse_from(["llmgw-sim", "--enable-lora", "--max-loras", "0"]).is_err());
    }

    #[test]
    fn model_name_defaults_to_the_positional_model() {
        let cli =
            Cli::try_parse_from(["llmgw-sim", "org/m", "--no-enable-prefix-caching"]).unwrap();
        assert_eq!(cli.served_names(), vec!["org/m"]);
        assert!(!cli.prefix_caching());
    }
}
