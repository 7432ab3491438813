//! Every error the agent answers with, and its gRPC status: code, message
//! and rich details (`google.rpc.ErrorInfo`, `BadRequest`, the `Placement`).

use std::collections::HashMap;

use prost::Message;
use resident_core::Refusal;
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::{ERROR_DOMAIN, pb};

/// Why a call did not do what it was asked.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// Fields of the request are wrong: (field, what is wrong).
    #[error("invalid request: {}", .0.iter().map(|(f, d)| format!("{f}: {d}")).collect::<Vec<_>>().join("; "))]
    InvalidArgument(Vec<(String, String)>),
    /// No such workload or instance.
    #[error("{0}")]
    NotFound(String),
    /// The instance id is taken by another workload.
    #[error("{0}")]
    AlreadyExists(String),
    /// The request cannot be carried out in the current state.
    #[error("{0}")]
    FailedPrecondition(String),
    /// The start was refused; `placement` carries every reason.
    #[error("{refusal}")]
    Refused {
        /// Every reason.
        refusal: Refusal,
        /// The plan and the pools, for the details.
        placement: Box<pb::Placement>,
    },
    /// The agent is shutting down or cannot serve this now.
    #[error("{0}")]
    Unavailable(String),
    /// The caller's request was abandoned (e.g. stopped while pending).
    #[error("{0}")]
    Aborted(String),
    /// The caller may not make this call (not in the node's allowlist).
    #[error("{0}")]
    PermissionDenied(String),
    /// A limit of the agent is reached (`max_instances`).
    #[error("{0}")]
    LimitReached(String),
    /// Something the agent could not do (a spawn that failed, I/O).
    #[error("{0}")]
    Internal(String),
}

impl ApiError {
    /// One invalid field.
    pub fn invalid(field: impl Into<String>, description: impl Into<String>) -> Self {
        Self::InvalidArgument(vec![(field.into(), description.into())])
    }
}

fn any(type_name: &str, bytes: Vec<u8>) -> prost_types::Any {
    prost_types::Any {
        type_url: format!("type.googleapis.com/{type_name}"),
        value: bytes,
    }
}

/// The status of a refused start: RESOURCE_EXHAUSTED for memory,
/// FAILED_PRECONDITION for a co-residency rule (by the first reason), the
/// first reason's text, ErrorInfo with the byte figures, and the Placement.
fn refused(refusal: &Refusal, placement: &pb::Placement) -> Status {
    let first = refusal.first();
    let code = if first.is_memory() {
        Code::ResourceExhausted
    } else {
        Code::FailedPrecondition
    };
    let mut metadata: HashMap<String, String> = first
        .facts()
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect();
    if refusal.temporary() {
        metadata.insert("temporary".into(), "true".into());
    }
    let info = tonic_types::pb::ErrorInfo {
        reason: first.code().into(),
        domain: ERROR_DOMAIN.into(),
        metadata,
    };
    let message = first.to_string();
    let status = tonic_types::pb::Status {
        code: code as i32,
        message: message.clone(),
        details: vec![
            any("google.rpc.ErrorInfo", info.encode_to_vec()),
            any("resident.v1.Placement", placement.encode_to_vec()),
        ],
    };
    Status::with_details(code, message, status.encode_to_vec().into())
}

impl From<ApiError> for Status {
    fn from(e: ApiError) -> Self {
        match e {
            ApiError::InvalidArgument(fields) => {
                let mut details = ErrorDetails::new();
                for (field, description) in &fields {
                    details.add_bad_request_violation(field.clone(), description.clone());
                }
                let message = ApiError::InvalidArgument(fields).to_string();
                Status::with_error_details(Code::InvalidArgument, message, details)
            }
            ApiError::NotFound(m) => Status::not_found(m),
            ApiError::AlreadyExists(m) => Status::already_exists(m),
            ApiError::FailedPrecondition(m) => Status::failed_precondition(m),
            ApiError::Refused { refusal, placement } => refused(&refusal, &placement),
            ApiError::Unavailable(m) => Status::unavailable(m),
            ApiError::Aborted(m) => Status::aborted(m),
            ApiError::Internal(m) => Status::internal(m),
            ApiError::PermissionDenied(m) => Status::permission_denied(m),
            ApiError::LimitReached(m) => Status::resource_exhausted(m),
        }
    }
}

/// A gRPC status code as the gRPC documentation (and docs/api.md) spells
/// it.
pub fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code;
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_codes_are_spelled_as_grpc_documents_them() {
        // The canonical names, in code order (grpc/grpc doc/statuscodes.md).
        let grpc = [
            "OK",
            "CANCELLED",
            "UNKNOWN",
            "INVALID_ARGUMENT",
            "DEADLINE_EXCEEDED",
            "NOT_FOUND",
            "ALREADY_EXISTS",
            "PERMISSION_DENIED",
            "RESOURCE_EXHAUSTED",
            "FAILED_PRECONDITION",
            "ABORTED",
            "OUT_OF_RANGE",
            "UNIMPLEMENTED",
            "INTERNAL",
            "UNAVAILABLE",
            "DATA_LOSS",
            "UNAUTHENTICATED",
        ];
        for (n, want) in grpc.into_iter().enumerate() {
            let code = tonic::Code::from_i32(n as i32);
            assert_eq!(code_name(code), want, "code {n}");
        }
    }
}
