//! The router's only way to the agent: its public gRPC API, over the Unix
//! socket or TCP. Each call is one RPC; a refusal is decoded from the
//! status's ErrorInfo (reason, `temporary`).

use std::path::PathBuf;
use std::time::Duration;

use prost::Message as _;
use resident_api::pb;
use resident_api::pb::node_agent_client::NodeAgentClient;
use tonic::Code;
use tonic::transport::{Channel, Endpoint};
use tonic_types::StatusExt as _;

/// The longest a quick call (Touch, Workloads, List) may take: one that
/// hangs must not hold a model's hold count, or the renewal of every
/// model's holds, for longer.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// `msg` as a request bounded by [`CALL_TIMEOUT`].
fn quick<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(CALL_TIMEOUT);
    r
}

/// How an on-demand start ended, when not with a READY instance.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartError {
    /// The agent refused to place it. `temporary`: only residents under a
    /// hold stand in the way, so waiting may help.
    Refused {
        /// The first reason's code (`OVER_BUDGET`, `EXCLUDED`, ...).
        reason: String,
        /// The agent's text.
        message: String,
        /// Waiting may help.
        temporary: bool,
        /// The instances holding the memory it needs (from the refusal's
        /// Placement), the ones a temporary refusal waits for.
        holders: Vec<String>,
    },
    /// It was admitted but did not become ready (or could not be spawned).
    Failed(String),
    /// The agent could not be asked.
    Unavailable(String),
}

/// A client of one agent.
#[derive(Debug, Clone)]
pub struct Agent {
    client: NodeAgentClient<Channel>,
}

impl Agent {
    /// A client of the agent at `endpoint`: a Unix socket path (optionally
    /// `unix:` or `unix://` before it) or `http://HOST:PORT`. Connects
    /// lazily, so the router can start before the agent.
    pub fn new(endpoint: &str) -> anyhow::Result<Self> {
        let channel = if endpoint.starts_with("http://") {
            Endpoint::from_shared(endpoint.to_string())?
                .connect_timeout(Duration::from_secs(5))
                .connect_lazy()
        } else {
            let path = PathBuf::from(
                endpoint
                    .strip_prefix("unix://")
                    .or_else(|| endpoint.strip_prefix("unix:"))
                    .unwrap_or(endpoint),
            );
            let endpoint =
                Endpoint::from_static("http://localhost").connect_timeout(Duration::from_secs(5));
            resident_api::endpoint_unix_lazy(endpoint, path)
        };
        Ok(Self {
            client: NodeAgentClient::new(channel),
        })
    }

    /// The roster: every workload with its aliases and limits.
    pub async fn workloads(&self) -> Result<Vec<pb::Workload>, tonic::Status> {
        let r = self
            .client
            .clone()
            .workloads(quick(pb::WorkloadsRequest {}))
            .await?;
        Ok(r.into_inner().workloads)
    }

    /// Every instance.
    pub async fn list(&self) -> Result<Vec<pb::Instance>, tonic::Status> {
        let r = self.client.clone().list(quick(pb::ListRequest {})).await?;
        Ok(r.into_inner().instances)
    }

    /// A use of `id` that holds it against eviction for `hold`. `None`
    /// when it is not resident (never started, stopped, ended).
    pub async fn hold(
        &self,
        id: &str,
        hold: Duration,
    ) -> Result<Option<pb::Instance>, tonic::Status> {
        let req = pb::TouchRequest {
            instance_id: id.to_string(),
            hold_ms: u64::try_from(hold.as_millis()).unwrap_or(u64::MAX),
            release_hold: false,
        };
        not_resident_is_none(self.client.clone().touch(quick(req)).await)
    }

    /// A use of `id` that ends its hold.
    pub async fn release(&self, id: &str) -> Result<Option<pb::Instance>, tonic::Status> {
        let req = pb::TouchRequest {
            instance_id: id.to_string(),
            hold_ms: 0,
            release_hold: true,
        };
        not_resident_is_none(self.client.clone().touch(quick(req)).await)
    }

    /// Starts instance `id` of `workload` under the agent's policy and
    /// answers once it is READY.
    pub async fn start(&self, workload: &str, id: &str) -> Result<pb::Instance, StartError> {
        let req = pb::StartRequest {
            workload: workload.to_string(),
            instance_id: id.to_string(),
            wait_ready: true,
            ..Default::default()
        };
        match self.client.clone().start(req).await {
            Ok(r) => r
                .into_inner()
                .instance
                .ok_or_else(|| StartError::Failed("the agent answered no instance".into())),
            Err(status) => Err(start_error(&status)),
        }
    }
}

fn not_resident_is_none(
    r: Result<tonic::Response<pb::Instance>, tonic::Status>,
) -> Result<Option<pb::Instance>, tonic::Status> {
    match r {
        Ok(r) => Ok(Some(r.into_inner())),
        Err(s) if matches!(s.code(), Code::NotFound | Code::FailedPrecondition) => Ok(None),
        Err(s) => Err(s),
    }
}

/// What a failed Start status means for the router.
pub fn start_error(status: &tonic::Status) -> StartError {
    let info = status.get_error_details().error_info().cloned();
    match info {
        Some(info) if info.domain == resident_api::ERROR_DOMAIN => StartError::Refused {
            reason: info.reason,
            message: status.message().to_string(),
            temporary: info.metadata.get("temporary").is_some_and(|t| t == "true"),
            holders: holders(status),
        },
        _ => match status.code() {
            Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded => {
                StartError::Unavailable(status.message().to_string())
            }
            Code::ResourceExhausted => StartError::Refused {
                reason: "LIMIT_REACHED".into(),
                message: status.message().to_string(),
                temporary: false,
                holders: Vec::new(),
            },
            _ => StartError::Failed(status.message().to_string()),
        },
    }
}

/// The instances named as holders in a refusal's Placement detail.
fn holders(status: &tonic::Status) -> Vec<String> {
    let Ok(details) = tonic_types::pb::Status::decode(status.details()) else {
        return Vec::new();
    };
    let Some(placement) = details
        .details
        .iter()
        .find(|d| d.type_url.ends_with("/resident.v1.Placement"))
        .and_then(|d| pb::Placement::decode(d.value.as_slice()).ok())
    else {
        return Vec::new();
    };
    let mut ids: Vec<String> = placement
        .refusals
        .iter()
        .flat_map(|r| match &r.reason {
            Some(pb::refusal::Reason::OverBudget(o)) => o.holders.clone(),
            Some(pb::refusal::Reason::HostMemory(h)) => h.holders.clone(),
            _ => Vec::new(),
        })
        .map(|h| h.instance_id)
        .collect();
    ids.sort_unstable();
    ids.dedup();
    ids
}
