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

/// A reason's scalar fields as (name, value), read from its message in the
/// `Refusal` (`need_bytes`, `declared_by`, ...): the error details say
/// what the Placement says, under the same names. Holders (a list) are
/// left out.
fn facts(refusal: &pb::Refusal) -> HashMap<String, String> {
    use pb::refusal::Reason as R;
    let fields = match &refusal.reason {
        Some(R::OverBudget(m)) => serde_json::to_value(m),
        Some(R::Excluded(m)) => serde_json::to_value(m),
        Some(R::GroupConflict(m)) => serde_json::to_value(m),
        Some(R::HostMemory(m)) => serde_json::to_value(m),
        None => return HashMap::new(),
    };
    let Ok(serde_json::Value::Object(fields)) = fields else {
        return HashMap::new();
    };
    fields
        .into_iter()
        .filter_map(|(name, value)| match value {
            serde_json::Value::String(s) => Some((name, s)),
            serde_json::Value::Number(n) => Some((name, n.to_string())),
            _ => None,
        })
        .collect()
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
    let mut metadata = facts(&crate::convert::refusal(first));
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

    #[test]
    fn error_metadata_names_each_reason_field_as_the_refusal_does() {
        use resident_core::{GroupName, GroupRule, Holder, InstanceId, PoolName, Reason, Role};
        let role = |s: &str| Role::new(s).expect("a role");
        let id = |s: &str| InstanceId::new(s).expect("an id");
        let pool = PoolName::new("unified").expect("a pool");
        let holders = vec![Holder {
            instance_id: id("p-1"),
            role: role("planner"),
            bytes: 9,
        }];
        let cases = [
            (
                Reason::OverBudget {
                    role: role("coder"),
                    pool: pool.clone(),
                    need: 55,
                    free: 32,
                    budget: 96,
                    holders: holders.clone(),
                },
                vec![
                    ("role", "coder"),
                    ("pool", "unified"),
                    ("need_bytes", "55"),
                    ("free_bytes", "32"),
                    ("budget_bytes", "96"),
                ],
            ),
            (
                Reason::Excluded {
                    role: role("coder"),
                    with: role("planner"),
                    with_instance: id("p-1"),
                    declared_by: role("planner"),
                },
                vec![
                    ("role", "coder"),
                    ("with", "planner"),
                    ("with_instance_id", "p-1"),
                    ("declared_by", "planner"),
                ],
            ),
            (
                Reason::GroupConflict {
                    role: role("coder"),
                    with: role("planner"),
                    with_instance: id("p-1"),
                    group: GroupName::new("daytime").expect("a group"),
                    rule: GroupRule::Swap,
                },
                vec![
                    ("role", "coder"),
                    ("with", "planner"),
                    ("with_instance_id", "p-1"),
                    ("group", "daytime"),
                    ("rule", "swap"),
                ],
            ),
            (
                Reason::HostMemory {
                    role: role("coder"),
                    pool,
                    need: 55,
                    available: 20,
                    reserve: 2,
                    pending: 4,
                    holders,
                },
                vec![
                    ("role", "coder"),
                    ("pool", "unified"),
                    ("need_bytes", "55"),
                    ("available_bytes", "20"),
                    ("reserve_bytes", "2"),
                    ("pending_bytes", "4"),
                ],
            ),
        ];
        for (reason, want) in cases {
            let want: HashMap<String, String> = want
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            let got = facts(&crate::convert::refusal(&reason));
            assert_eq!(got, want, "{}", reason.code());
        }
    }
}
