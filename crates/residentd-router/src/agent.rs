//! The router's only way to the agent: its public gRPC API, over the Unix
//! socket, plaintext TCP or TCP with mutual TLS (tonic's rustls client,
//! as residentctl's). Each call is one RPC; a refusal is decoded from the
//! status's ErrorInfo (reason, `temporary`), a role refusal
//! (PERMISSION_DENIED) kept as such.
//!
//! Two connections to the agent: one for the calls that serve requests
//! and act (Start, Touch, Stop, Sleep, Workloads, List, Place), one for
//! the console's streams and reads (Watch, Logs, Node). The agent serves
//! at most 256 calls at once per connection, so streams that pile up on
//! one (the console's logs, say) never keep a Start from being sent.

use std::path::PathBuf;
use std::time::Duration;

use prost::Message as _;
use resident_api::pb;
use resident_api::pb::node_agent_client::NodeAgentClient;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject as _;
use tonic::Code;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity, Uri};
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

/// The longest a console action (Start without waiting for READY, Stop,
/// Sleep) may take: it waits for evictions, a stop's grace, a sleep or
/// wake call, which the workloads' own timeouts bound.
const ACTION_TIMEOUT: Duration = Duration::from_secs(300);

/// `msg` as a request bounded by [`ACTION_TIMEOUT`].
fn action<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    r.set_timeout(ACTION_TIMEOUT);
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
    /// The agent refused the router's identity the call (its roles): its
    /// words.
    Denied(String),
}

/// The client side of the agent's mutual TLS, as PEM: what `--ca`,
/// `--cert` and `--key` name.
#[derive(Clone)]
pub struct AgentTls {
    /// The CA that signed the agent's certificate.
    pub ca: Vec<u8>,
    /// The router's certificate, signed by the agent's `client_ca`.
    pub cert: Vec<u8>,
    /// The router's private key.
    pub key: Vec<u8>,
    /// The name the agent's certificate is checked against; `None`: the
    /// endpoint's host.
    pub name: Option<String>,
}

impl std::fmt::Debug for AgentTls {
    // Never the key, not even in a debug print of the options.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentTls")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// Why the router cannot be connected to its agent as told.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AgentAddressError {
    /// An `https://` agent, and no certificates to reach it with.
    #[error(
        "{endpoint}: an agent over TLS needs --ca, --cert and --key (or RESIDENTD_CA, RESIDENTD_CERT, RESIDENTD_KEY)"
    )]
    TlsMissing { endpoint: String },
    /// Certificates for an agent reached without TLS (a Unix socket,
    /// `http://`): said rather than ignored.
    #[error("--ca, --cert and --key are for an https://HOST:PORT agent, not {endpoint}")]
    TlsUnused { endpoint: String },
    /// A `--ca` without one certificate that could anchor a chain: every
    /// handshake would fail, so the router says so at start.
    #[error("--ca: no CA certificate in it ({found} PEM certificates, none usable)")]
    NoCa { found: usize },
    /// The endpoint does not parse, or tonic refuses the TLS material.
    #[error("--agent {endpoint}: {reason}")]
    Endpoint { endpoint: String, reason: String },
}

/// A client of one agent.
#[derive(Debug, Clone)]
pub struct Agent {
    /// Requests' and actions' calls.
    client: NodeAgentClient<Channel>,
    /// The console's streams (Watch, Logs) and its reads of the node.
    streams: NodeAgentClient<Channel>,
}

impl Agent {
    /// A client of the agent at `endpoint`: a Unix socket path (optionally
    /// `unix:` or `unix://` before it), `http://HOST:PORT`, or
    /// `https://HOST:PORT` with `tls`. Connects lazily, so the router can
    /// start before the agent.
    pub fn new(endpoint: &str, tls: Option<&AgentTls>) -> Result<Self, AgentAddressError> {
        Ok(Self {
            client: NodeAgentClient::new(Self::channel(endpoint, tls)?),
            streams: NodeAgentClient::new(Self::channel(endpoint, tls)?),
        })
    }

    /// A lazy channel (a connection of its own) to the agent at `endpoint`.
    fn channel(endpoint: &str, tls: Option<&AgentTls>) -> Result<Channel, AgentAddressError> {
        let scheme = endpoint.split_once("://").map(|(scheme, _)| scheme);
        let channel = match (scheme, tls) {
            (Some("https"), Some(tls)) => Self::tls(endpoint, tls)?,
            (Some("https"), None) => {
                return Err(AgentAddressError::TlsMissing {
                    endpoint: endpoint.to_string(),
                });
            }
            (_, Some(_)) => {
                return Err(AgentAddressError::TlsUnused {
                    endpoint: endpoint.to_string(),
                });
            }
            (Some("http"), None) => tcp(endpoint)?.connect_lazy(),
            (_, None) => {
                let path = PathBuf::from(
                    endpoint
                        .strip_prefix("unix://")
                        .or_else(|| endpoint.strip_prefix("unix:"))
                        .unwrap_or(endpoint),
                );
                let endpoint = Endpoint::from_static("http://localhost")
                    .connect_timeout(Duration::from_secs(5));
                resident_api::endpoint_unix_lazy(endpoint, path)
            }
        };
        Ok(channel)
    }

    /// A lazy channel to `https://HOST:PORT` presenting the router's
    /// certificate, trusting only `tls.ca`.
    fn tls(endpoint: &str, tls: &AgentTls) -> Result<Channel, AgentAddressError> {
        // tonic skips CA certificates it cannot parse, and trusting none
        // fails every handshake later, far from the cause.
        let certs: Vec<_> = CertificateDer::pem_slice_iter(&tls.ca)
            .filter_map(Result::ok)
            .collect();
        let found = certs.len();
        let (usable, _) = rustls::RootCertStore::empty().add_parsable_certificates(certs);
        if usable == 0 {
            return Err(AgentAddressError::NoCa { found });
        }
        let host = endpoint
            .parse::<Uri>()
            .ok()
            // An IPv6 host is written in brackets; its name is without.
            .and_then(|u| {
                u.host()
                    .map(|h| h.trim_start_matches('[').trim_end_matches(']').to_string())
            });
        let name = tls.name.clone().or(host).unwrap_or_default();
        let config = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&tls.ca))
            .identity(Identity::from_pem(&tls.cert, &tls.key))
            .domain_name(name);
        let channel =
            tcp(endpoint)?
                .tls_config(config)
                .map_err(|e| AgentAddressError::Endpoint {
                    endpoint: endpoint.to_string(),
                    reason: with_causes(&e),
                })?;
        Ok(channel.connect_lazy())
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

    /// The node: its pools and every instance.
    pub async fn node(&self) -> Result<pb::NodeStatus, tonic::Status> {
        let r = self.streams.clone().node(quick(pb::NodeRequest {})).await?;
        Ok(r.into_inner())
    }

    /// The agent's events: the current state of each instance first, then
    /// every change, until the stream is dropped. No deadline: it is meant
    /// to stay open.
    pub async fn watch(&self) -> Result<tonic::Streaming<pb::Event>, tonic::Status> {
        self.watch_since(0).await
    }

    /// The agent's events after revision `since` (0: the current state
    /// first), then every change, until the stream is dropped.
    pub async fn watch_since(
        &self,
        since: u64,
    ) -> Result<tonic::Streaming<pb::Event>, tonic::Status> {
        let req = pb::WatchRequest {
            since_revision: since,
        };
        Ok(self.streams.clone().watch(req).await?.into_inner())
    }

    /// The last `tail` lines of instance `id`'s output, then each new one
    /// until the stream is dropped.
    pub async fn logs(
        &self,
        id: &str,
        tail: u32,
    ) -> Result<tonic::Streaming<pb::LogLine>, tonic::Status> {
        let req = pb::LogsRequest {
            instance_id: id.to_string(),
            tail,
            follow: true,
        };
        Ok(self.streams.clone().logs(req).await?.into_inner())
    }

    /// What a Start of `workload` would do now (a dry run, under the
    /// workload's own policy).
    pub async fn place(&self, workload: &str) -> Result<pb::Placement, tonic::Status> {
        self.place_start(workload, "").await
    }

    /// What a Start of `workload` naming `id` would do now (its dry run:
    /// a wake's for an instance asleep; empty: a new instance's), under
    /// the workload's own policy.
    pub async fn place_start(
        &self,
        workload: &str,
        id: &str,
    ) -> Result<pb::Placement, tonic::Status> {
        let req = pb::PlaceRequest {
            workload: workload.to_string(),
            instance_id: id.to_string(),
            ..Default::default()
        };
        Ok(self.client.clone().place(quick(req)).await?.into_inner())
    }

    /// Starts (or wakes) instance `id` of `workload` (a new id when
    /// empty) and answers once the agent has admitted it, not once it is
    /// READY: what the console asks.
    pub async fn start_admitted(
        &self,
        workload: &str,
        id: &str,
    ) -> Result<pb::StartResponse, tonic::Status> {
        let req = pb::StartRequest {
            workload: workload.to_string(),
            instance_id: id.to_string(),
            wait_ready: false,
            ..Default::default()
        };
        Ok(self.client.clone().start(action(req)).await?.into_inner())
    }

    /// Stops instance `id` with its workload's grace.
    pub async fn stop(&self, id: &str) -> Result<pb::Instance, tonic::Status> {
        let req = pb::StopRequest {
            instance_id: id.to_string(),
            grace_ms: 0,
        };
        let r = self.client.clone().stop(action(req)).await?.into_inner();
        r.instance
            .ok_or_else(|| tonic::Status::internal("the agent answered no instance"))
    }

    /// Puts instance `id` to sleep.
    pub async fn sleep(&self, id: &str) -> Result<pb::Instance, tonic::Status> {
        let req = pb::SleepRequest {
            instance_id: id.to_string(),
        };
        Ok(self.client.clone().sleep(action(req)).await?.into_inner())
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

/// `e` and what caused it: tonic's own text is only "transport error".
fn with_causes(e: &dyn std::error::Error) -> String {
    std::iter::successors(Some(e), |e| e.source())
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(": ")
}

/// The TCP endpoint `endpoint` (`http://` or `https://`), not connected.
fn tcp(endpoint: &str) -> Result<Endpoint, AgentAddressError> {
    let parsed =
        Endpoint::from_shared(endpoint.to_string()).map_err(|e| AgentAddressError::Endpoint {
            endpoint: endpoint.to_string(),
            reason: e.to_string(),
        })?;
    Ok(parsed.connect_timeout(Duration::from_secs(5)))
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
            Code::PermissionDenied | Code::Unauthenticated => {
                StartError::Denied(status.message().to_string())
            }
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A CA's PEM and a certificate and key it signed.
    fn material(name: Option<&str>) -> AgentTls {
        let ca_key = rcgen::KeyPair::generate().expect("key");
        let mut params = rcgen::CertificateParams::new(Vec::new()).expect("params");
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        let ca = params.self_signed(&ca_key).expect("CA");
        let key = rcgen::KeyPair::generate().expect("key");
        let params = rcgen::CertificateParams::new(vec!["router".to_string()]).expect("params");
        let cert = params.signed_by(&key, &ca, &ca_key).expect("signed");
        AgentTls {
            ca: ca.pem().into_bytes(),
            cert: cert.pem().into_bytes(),
            key: key.serialize_pem().into_bytes(),
            name: name.map(String::from),
        }
    }

    /// `Agent::new(endpoint, tls)`: connected (lazily) or the error's text.
    fn check(endpoint: &str, tls: Option<&AgentTls>, want: Result<(), &str>) {
        let got = Agent::new(endpoint, tls)
            .map(drop)
            .map_err(|e| e.to_string());
        match (&got, want) {
            (Ok(()), Ok(())) => {}
            (Err(text), Err(part)) if text.contains(part) => {}
            _ => panic!(
                "{endpoint} (tls: {}): {got:?}, want {want:?}",
                tls.is_some()
            ),
        }
    }

    #[tokio::test]
    async fn each_endpoint_takes_tls_material_only_where_it_speaks_tls() {
        let (good, named) = (material(None), material(Some("node-7.example.org")));
        let (mut bad_key, mut bad_ca, mut no_ca) = (material(None), material(None), material(None));
        bad_key.key = b"not a key".to_vec();
        bad_ca.ca = b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n".to_vec();
        no_ca.ca = b"just words".to_vec();
        let missing = "https://localhost:7443: an agent over TLS needs --ca, --cert and --key";
        let unused = "--ca, --cert and --key are for an https://HOST:PORT agent, not";
        let (sock, http, https) = (
            "/run/r.sock",
            "http://127.0.0.1:7443",
            "https://localhost:7443",
        );
        #[rustfmt::skip]
        let rows: &[(&str, Option<&AgentTls>, Result<(), &str>)] = &[
            (sock, None, Ok(())),
            ("unix:///run/a.sock", None, Ok(())),
            (http, None, Ok(())),
            (https, Some(&good), Ok(())),
            ("https://[::1]:7443", Some(&good), Ok(())),
            ("https://10.0.0.7:7443", Some(&named), Ok(())),
            (https, None, Err(missing)),
            (sock, Some(&good), Err(unused)),
            (http, Some(&good), Err(unused)),
            (https, Some(&bad_key), Err("--agent https://localhost:7443: ")),
            (https, Some(&bad_ca), Err("--ca: no CA certificate in it (1 PEM certificates")),
            (https, Some(&no_ca), Err("--ca: no CA certificate in it (0 PEM certificates")),
            ("https://local host:7443", Some(&good), Err("--agent https://local host:7443: ")),
        ];
        for (endpoint, tls, want) in rows {
            check(endpoint, *tls, *want);
        }
    }

    #[test]
    fn the_key_is_never_printed() {
        let text = format!("{:?}", material(Some("n")));
        assert_eq!(text, "AgentTls { name: Some(\"n\"), .. }");
    }
}
