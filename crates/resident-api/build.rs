//! Generates the resident.v1 types and service from `proto/`, with a
//! protoc that comes from a crate (no system protoc needed).

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let proto = root.join("resident/v1/node_agent.proto");
    let out = PathBuf::from(std::env::var("OUT_DIR")?);
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    // SAFETY: build scripts are single-threaded; nothing reads the
    // environment concurrently.
    unsafe { std::env::set_var("PROTOC", protoc) };
    let mut config = tonic_prost_build::configure();
    // A refusal's reason messages are the one mapping of a reason's fields
    // (`convert::refusal`); the error details' metadata is read back from
    // them through serde, so it cannot name a field differently.
    for message in [
        "OverBudget",
        "Excluded",
        "GroupConflict",
        "HostMemory",
        "Holder",
    ] {
        config = config.type_attribute(
            format!("resident.v1.{message}"),
            "#[derive(serde::Serialize)]",
        );
    }
    config
        .file_descriptor_set_path(out.join("resident_v1_descriptor.bin"))
        .compile_protos(&[proto.as_path()], &[root.as_path()])?;
    println!("cargo:rerun-if-changed={}", proto.display());
    Ok(())
}
