//! Generates the feed and peer protocols with a vendored protoc, so no system protoc is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: a build script is single-threaded, so nothing reads the environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc) };
    println!("cargo:rerun-if-changed=llmgw/feed/v1/feed.proto");
    println!("cargo:rerun-if-changed=llmgw/peer/v1/peer.proto");
    tonic_prost_build::configure().compile_protos(
        &["llmgw/feed/v1/feed.proto", "llmgw/peer/v1/peer.proto"],
        &["."],
    )?;
    Ok(())
}
