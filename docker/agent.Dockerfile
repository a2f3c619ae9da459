# llmgw-agent image, for the sidecar beside a vLLM container or the per-node DaemonSet
# (deploy/vllm.yaml, deploy/agent-daemonset.yaml). Build from the repository root:
#   docker build -f docker/agent.Dockerfile -t llmgw-agent .
# Port: 9101 agent admin (--admin-addr). Flags: `llmgw-agent serve --help`; docs/deploy.md.
# (`llmgw-agent run -- vllm serve …` needs vLLM in the same image: build FROM a vLLM image then.)
FROM rust:1.90-bookworm AS builder
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --profile dist --locked -p llmgw-agent --bin llmgw-agent && \
    cp target/dist/llmgw-agent /llmgw-agent

FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
COPY --from=builder /llmgw-agent /usr/local/bin/llmgw-agent
USER 65532:65532
EXPOSE 9101
ENTRYPOINT ["/usr/local/bin/llmgw-agent"]
CMD ["serve", "--help"]
