//! An ext_proc server that does no routing work, for `llmgw-bench-overhead`'s `floor` path.
//!
//! It is llmgw's own protocol layer ([`llmgw::extproc`]: the same state machine, decoding and
//! answers) on the same tonic server settings as `llmgw-router`, with a picker that sends each
//! request to the next replica in turn without looking at it: no parsing, no scheduler, no
//! metrics. What it adds over Envoy alone is what any ext_proc exchange costs on the machine at
//! hand (Envoy's side, gRPC, the kernel, wake-ups), so what the router adds beyond it is the
//! cost of routing.
//!
//! # Concurrency model
//! One tokio runtime (one worker per core, like the router's default); the picker's only state
//! is an atomic counter.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    reason = "a test and bench harness: a panic is a failed run, never a crashed router"
)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use anyhow::Context;
use clap::Parser;
use llmgw::extproc::{ExtProcService, ExtProcSettings, Picker, Rejection, Routed, RoutingRequest};

#[derive(Parser)]
#[command(about = "An ext_proc server that routes round robin without reading requests")]
struct Args {
    /// Where Envoy reaches it over TCP.
    #[arg(long, default_value = "127.0.0.1:9002")]
    grpc_addr: SocketAddr,
    /// Listen on this Unix socket instead of TCP.
    #[arg(long)]
    grpc_uds: Option<PathBuf>,
    /// A replica `ip:port` (repeatable); requests go to each in turn.
    #[arg(long = "replica", required = true)]
    replicas: Vec<SocketAddr>,
}

/// Round robin over fixed replicas; holds nothing for the request's lifetime.
struct RoundRobin {
    replicas: Vec<String>,
    next: AtomicUsize,
}

impl Picker for RoundRobin {
    type Hold = ();

    async fn pick(&self, _request: RoutingRequest) -> Result<Routed<()>, Rejection> {
        let turn = self.next.fetch_add(1, Ordering::Relaxed);
        Ok(Routed {
            destination: self.replicas[turn % self.replicas.len()].clone(),
            hold: (),
            headers: Vec::new(),
        })
    }
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(serve(args))
}

async fn serve(args: Args) -> anyhow::Result<()> {
    let picker = RoundRobin {
        replicas: args.replicas.iter().map(ToString::to_string).collect(),
        next: AtomicUsize::new(0),
    };
    let service = ExtProcService::new(Arc::new(picker), ExtProcSettings::default()).into_server();
    let server = llmgw::app::ext_proc_server_settings().add_service(service);
    match &args.grpc_uds {
        Some(path) => {
            let listener = tokio::net::UnixListener::bind(path)
                .with_context(|| format!("cannot listen on {}", path.display()))?;
            server
                .serve_with_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener))
                .await
        }
        None => {
            let listener = tokio::net::TcpListener::bind(args.grpc_addr)
                .await
                .with_context(|| format!("cannot listen on {}", args.grpc_addr))?;
            server
                .serve_with_incoming(
                    tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true)),
                )
                .await
        }
    }
    .context("gRPC server failed")
}
