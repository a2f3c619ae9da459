# llmgw-router image. Build from the repository root:
#   docker build -f docker/router.Dockerfile -t llmgw-router .
# Ports: 9002 ext_proc gRPC, 9003 gRPC health (--grpc-health-port), 9004 agent feed
# (--feed-addr), 9090 admin HTTP. Flags: `llmgw-router serve --help`; docs/deploy.md.
FROM rust:1.90-bookworm AS builder
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --profile dist --locked -p llmgw --bin llmgw-router && \
    cp target/dist/llmgw-router /llmgw-router

# glibc + libgcc only (no shell); runs as the distroless nonroot user (65532).
FROM gcr.io/distroless/cc-debian12:nonroot AS runtime
COPY --from=builder /llmgw-router /usr/local/bin/llmgw-router
USER 65532:65532
EXPOSE 9002 9003 9004 9090
ENTRYPOINT ["/usr/local/bin/llmgw-router"]
CMD ["serve", "--grpc-port=9002", "--grpc-health-port=9003", "--feed-addr=0.0.0.0:9004", "--admin-addr=0.0.0.0:9090"]
