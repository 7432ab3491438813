//! The resident.v1 gRPC contract.

/// Generated types and service traits of `resident.v1`.
#[allow(missing_docs, clippy::all, missing_debug_implementations)]
pub mod pb {
    tonic::include_proto!("resident.v1");

    /// The encoded file descriptor set, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("resident_v1_descriptor");
}
