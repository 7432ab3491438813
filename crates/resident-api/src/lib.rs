//! The resident.v1 gRPC contract: the generated types and service, the
//! conversions from core and supervisor types, and the one place where
//! errors become gRPC statuses.
//!
//! Architecture invariant: this crate decides nothing. It translates.

mod client;
mod convert;
mod error;

pub use client::{channel_unix, connect_unix, endpoint_unix, endpoint_unix_lazy};

pub use convert::{any_of, demand, instance, placement, pool_status, refusal, unspawned};
pub use error::{ApiError, code_name};

/// Generated types and service traits of `resident.v1`.
#[allow(missing_docs, clippy::all, missing_debug_implementations)]
pub mod pb {
    tonic::include_proto!("resident.v1");

    /// The encoded file descriptor set, for server reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] =
        tonic::include_file_descriptor_set!("resident_v1_descriptor");
}

/// The fully qualified service name, as health checks and reflection name it.
pub const SERVICE_NAME: &str = "resident.v1.NodeAgent";

/// The `google.rpc.ErrorInfo` domain of every refusal.
pub const ERROR_DOMAIN: &str = "resident.v1";
