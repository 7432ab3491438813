//! Who may do what. Every call names its caller: over the Unix socket its
//! uid, gid, pid and, where `[node.access]` grants a role to a group, its
//! supplementary groups (read for its pid); over TCP
//! with mutual TLS its certificate's SAN DNS names, SAN URIs and subject
//! CN. The caller's role (viewer, operator, admin; each includes the ones
//! before it) comes from `[node.access]`, or from the defaults:
//!
//! - Unix socket: every caller is a viewer and an operator (the socket's
//!   mode 0660 already limits callers to the agent's user, the socket
//!   group and root); with `allow_uids` / `allow_gids`, callers outside
//!   them are viewers only.
//! - Root and the agent's own uid over the Unix socket are admins always,
//!   whatever `[node.access]` or `allow_uids` say: nothing locks them out.
//! - TCP with mutual TLS: nothing, until `[node.access]` grants it.
//! - Plain TCP (`insecure = true`): every caller is an operator, as the
//!   operator chose; `[node.access]` can grant nothing to a caller without
//!   a certificate.

use std::fmt;
use std::net::SocketAddr;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use resident_config::{AccessRole, Config, Principal};
use tonic::Request;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};
use x509_parser::extensions::GeneralName;

use crate::agent::Agent;

/// What the access layer found for a call it let through, for the
/// service's audit lines.
#[derive(Debug, Clone)]
pub struct Authorized {
    /// Who.
    pub caller: Caller,
    /// With which role.
    pub role: AccessRole,
}

/// The tower layer in front of every service (NodeAgent, health,
/// reflection): the caller's role must cover the method's, or the call is
/// answered PERMISSION_DENIED before any service sees it.
#[derive(Debug, Clone)]
pub struct AccessLayer {
    agent: Arc<Agent>,
}

impl AccessLayer {
    /// The layer, reading the roles from `agent`'s current config.
    pub fn new(agent: Arc<Agent>) -> Self {
        Self { agent }
    }
}

impl<S> tower::Layer<S> for AccessLayer {
    type Service = Guarded<S>;
    fn layer(&self, inner: S) -> Guarded<S> {
        Guarded {
            inner,
            agent: self.agent.clone(),
        }
    }
}

/// A service behind the access check.
#[derive(Debug, Clone)]
pub struct Guarded<S> {
    inner: S,
    agent: Arc<Agent>,
}

type Boxed<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S, B> tower::Service<http::Request<B>> for Guarded<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<tonic::body::Body>>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
    B: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Boxed<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let config = self.agent.config();
        // Supplementary groups cost a read of /proc per call: only where a
        // `gid:` or `group:` principal can match them.
        let groups = config.node.access.as_ref().is_some_and(|a| {
            [&a.viewers, &a.operators, &a.admins]
                .iter()
                .any(|list| list.iter().any(|p| matches!(p, Principal::Gid(_))))
        });
        let caller = Caller::from_extensions(req.extensions(), groups);
        let path = req.uri().path().to_string();
        let need = required(&path);
        let has = caller.role(&config);
        match (need, has) {
            (Some(need), Some(_)) if need >= AccessRole::Operator && self.agent.upgrading() => {
                // A change now would fall between the two agents.
                let status = tonic::Status::unavailable(
                    "the agent is being upgraded to a new binary; try again in a moment",
                );
                Box::pin(async move { Ok(status.into_http()) })
            }
            (Some(need), Some(role)) if role >= need => {
                req.extensions_mut().insert(Authorized { caller, role });
                // The service that was polled ready takes the call; a
                // clone takes its place.
                let clone = self.inner.clone();
                let mut ready = std::mem::replace(&mut self.inner, clone);
                Box::pin(ready.call(req))
            }
            _ => {
                let denied = deny(&self.agent, &caller, &path, need, has);
                Box::pin(async move { Ok(denied.into_http()) })
            }
        }
    }
}

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// Over the Unix socket (SO_PEERCRED).
    Unix {
        /// Its uid.
        uid: u32,
        /// Its primary gid.
        gid: u32,
        /// Its pid, when the kernel says.
        pid: Option<i32>,
        /// Its supplementary groups, read from `/proc/PID/status` (only
        /// when `[node.access]` grants a role to a group).
        groups: Vec<u32>,
    },
    /// Over TCP with a client certificate.
    Cert {
        /// SAN DNS names.
        dns: Vec<String>,
        /// SAN URIs (a SPIFFE id).
        uris: Vec<String>,
        /// Subject common names.
        cn: Vec<String>,
        /// Where from.
        addr: Option<SocketAddr>,
    },
    /// Over TCP without a certificate (`insecure = true`).
    Anonymous {
        /// Where from.
        addr: Option<SocketAddr>,
    },
}

impl Caller {
    /// The caller of `req`: the one the access layer found, or read anew.
    pub fn of<T>(req: &Request<T>) -> Self {
        match req.extensions().get::<Authorized>() {
            Some(a) => a.caller.clone(),
            None => Self::from_extensions(req.extensions(), false),
        }
    }

    /// The caller a request's connection says (the extensions tonic gives
    /// every request); a Unix caller's supplementary groups only when
    /// `groups` asks for them.
    pub fn from_extensions(ext: &http::Extensions, groups: bool) -> Self {
        if let Some(peer) = ext.get::<crate::authority::UnixPeer>()
            && let Some(cred) = peer.uds.peer_cred
        {
            // Taken at connect (SO_PEERGROUPS); /proc is read only where
            // the kernel could not say, and only when a group can matter.
            let supplementary = match &peer.groups {
                Some(list) => list.clone(),
                None => cred
                    .pid()
                    .filter(|_| groups)
                    .map(supplementary_groups)
                    .unwrap_or_default(),
            };
            return Self::Unix {
                uid: cred.uid(),
                gid: cred.gid(),
                pid: cred.pid(),
                groups: supplementary,
            };
        }
        if let Some(tls) = ext.get::<TlsConnectInfo<TcpConnectInfo>>() {
            let addr = tls.get_ref().remote_addr();
            if let Some(leaf) = tls.peer_certs().as_ref().and_then(|c| c.first().cloned()) {
                return identity(leaf.as_ref(), addr);
            }
            return Self::Anonymous { addr };
        }
        let addr = ext.get::<TcpConnectInfo>().and_then(|i| i.remote_addr());
        Self::Anonymous { addr }
    }

    /// Whether `p` names this caller.
    fn is(&self, p: &Principal) -> bool {
        match (self, p) {
            (Self::Unix { uid, .. }, Principal::Uid(u)) => uid == u,
            (Self::Unix { gid, groups, .. }, Principal::Gid(g)) => gid == g || groups.contains(g),
            (Self::Cert { dns, .. }, Principal::CertDns(d)) => dns.contains(d),
            (Self::Cert { uris, .. }, Principal::CertUri(u)) => uris.contains(u),
            (Self::Cert { cn, .. }, Principal::CertCn(c)) => cn.contains(c),
            _ => false,
        }
    }

    /// The highest role `config` grants this caller; `None`: no role.
    /// Root and the agent's own uid on the Unix socket are admins whatever
    /// the config says: they can do anything to the agent anyway, and a
    /// `[node.access]` or `allow_uids` written for others must not lock
    /// them out (health checks, `residentctl` as root).
    pub fn role(&self, config: &Config) -> Option<AccessRole> {
        if let Self::Unix { uid, .. } = self
            && (*uid == 0 || *uid == nix::unistd::geteuid().as_raw())
        {
            return Some(AccessRole::Admin);
        }
        let Some(access) = &config.node.access else {
            return self.default_role(config);
        };
        let granted = |list: &[Principal]| list.iter().any(|p| self.is(p));
        if granted(&access.admins) {
            Some(AccessRole::Admin)
        } else if granted(&access.operators) {
            Some(AccessRole::Operator)
        } else if granted(&access.viewers) {
            Some(AccessRole::Viewer)
        } else {
            None
        }
    }

    fn default_role(&self, config: &Config) -> Option<AccessRole> {
        match self {
            Self::Unix { uid, gid, .. } => {
                if config.node.allow.permits(*uid, *gid) {
                    Some(AccessRole::Operator)
                } else {
                    Some(AccessRole::Viewer)
                }
            }
            Self::Cert { .. } => None,
            Self::Anonymous { .. } => Some(AccessRole::Operator),
        }
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unix {
                uid,
                gid,
                pid,
                groups,
            } => {
                write!(f, "uid {uid} gid {gid}")?;
                if !groups.is_empty() {
                    let list: Vec<String> = groups.iter().map(u32::to_string).collect();
                    write!(f, " groups {}", list.join(","))?;
                }
                match pid {
                    Some(pid) => write!(f, " pid {pid}"),
                    None => Ok(()),
                }
            }
            Self::Cert {
                dns,
                uris,
                cn,
                addr,
            } => {
                let mut names: Vec<String> = Vec::new();
                names.extend(cn.iter().map(|c| format!("cert-cn:{c}")));
                names.extend(dns.iter().map(|d| format!("cert-dns:{d}")));
                names.extend(uris.iter().map(|u| format!("cert-uri:{u}")));
                if names.is_empty() {
                    names.push("a certificate without names".into());
                }
                write!(f, "{}", names.join(" "))?;
                match addr {
                    Some(a) => write!(f, " from {a}"),
                    None => Ok(()),
                }
            }
            Self::Anonymous { addr } => match addr {
                Some(a) => write!(f, "an unauthenticated TCP caller from {a}"),
                None => f.write_str("an unauthenticated TCP caller"),
            },
        }
    }
}

/// A refused call: logged (an audit line for a call that would change
/// something), counted by the role it needed, answered PERMISSION_DENIED.
fn deny(
    agent: &Agent,
    caller: &Caller,
    path: &str,
    need: Option<AccessRole>,
    has: Option<AccessRole>,
) -> tonic::Status {
    let rpc = path.rsplit('/').next().unwrap_or(path);
    let has = has.map_or("no role".to_string(), |r| {
        format!("the {} role", r.as_str())
    });
    let message = match need {
        Some(need) => format!("{rpc} needs the {} role; {caller} has {has}", need.as_str()),
        None => format!("{path} is not a method of this agent"),
    };
    let need_name = need.map_or("none", AccessRole::as_str);
    agent.metrics().denied(need_name);
    if need >= Some(AccessRole::Operator) {
        audit(rpc, caller, "", "denied", &message);
    } else {
        tracing::info!(rpc, caller = %caller, "refused: {message}");
    }
    tonic::Status::permission_denied(message)
}

/// The audit line of a call that changes something (Start, Stop, Touch,
/// Adopt, Reload, ForgetFootprint, Upgrade), allowed or not, with stable fields: `rpc`, `caller`
/// (as messages name it), `uid`, `gid` and `pid` for a Unix caller,
/// `instance_id` (at most 32 characters of it), `outcome` (`ok`, `denied`,
/// `refused`, or the gRPC code of the error) and `reason`. Logged under the
/// target `audit`.
pub fn audit(rpc: &str, caller: &Caller, instance_id: &str, outcome: &str, reason: &str) {
    let (uid, gid, pid) = match caller {
        Caller::Unix { uid, gid, pid, .. } => (Some(*uid), Some(*gid), *pid),
        _ => (None, None, None),
    };
    let instance_id = short(instance_id);
    tracing::info!(
        target: "audit",
        rpc,
        caller = ?caller.to_string(),
        uid,
        gid,
        pid,
        instance_id,
        outcome,
        reason,
        "audit"
    );
}

/// A caller-supplied value as a log field: whole when short, else an
/// excerpt with its length.
fn short(s: &str) -> String {
    if s.chars().count() <= resident_core::Excerpt::HEAD {
        s.to_string()
    } else {
        resident_core::Excerpt::of(s).to_string()
    }
}

/// The role an RPC needs, by its gRPC method path; `None` for a path no
/// role covers (refused).
pub fn required(path: &str) -> Option<AccessRole> {
    let (service, method) = path.trim_start_matches('/').split_once('/')?;
    match service {
        // Every method is named: one the table does not list (a new RPC
        // added without its role) needs the highest role, never the lowest.
        "resident.v1.NodeAgent" => match method {
            "Get" | "List" | "Place" | "Watch" | "Logs" | "Node" | "Workloads" | "WatchNode" => {
                Some(AccessRole::Viewer)
            }
            "Start" | "Stop" | "Touch" | "Adopt" | "Sleep" => Some(AccessRole::Operator),
            _ => Some(AccessRole::Admin),
        },
        "grpc.health.v1.Health"
        | "grpc.reflection.v1.ServerReflection"
        | "grpc.reflection.v1alpha.ServerReflection" => Some(AccessRole::Viewer),
        _ => None,
    }
}

/// A certificate's names; one that does not parse names nobody.
fn identity(der: &[u8], addr: Option<SocketAddr>) -> Caller {
    let (mut dns, mut uris, mut cn) = (Vec::new(), Vec::new(), Vec::new());
    if let Ok((_, cert)) = x509_parser::parse_x509_certificate(der) {
        if let Ok(Some(san)) = cert.subject_alternative_name() {
            for name in &san.value.general_names {
                match name {
                    GeneralName::DNSName(d) => dns.push((*d).to_string()),
                    GeneralName::URI(u) => uris.push((*u).to_string()),
                    _ => {}
                }
            }
        }
        cn.extend(
            cert.subject()
                .iter_common_name()
                .filter_map(|a| a.as_str().ok())
                .map(String::from),
        );
    }
    Caller::Cert {
        dns,
        uris,
        cn,
        addr,
    }
}

/// The supplementary groups of process `pid` (`Groups:` of its status).
fn supplementary_groups(pid: i32) -> Vec<u32> {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return Vec::new();
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("Groups:"))
        .map(|g| {
            g.split_whitespace()
                .filter_map(|n| n.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn methods_need_their_roles() {
        assert_eq!(
            required("/resident.v1.NodeAgent/Get"),
            Some(AccessRole::Viewer)
        );
        assert_eq!(
            required("/resident.v1.NodeAgent/Start"),
            Some(AccessRole::Operator)
        );
        assert_eq!(
            required("/resident.v1.NodeAgent/Adopt"),
            Some(AccessRole::Operator)
        );
        // A read-only stream of the node's picture (a fleet view).
        assert_eq!(
            required("/resident.v1.NodeAgent/WatchNode"),
            Some(AccessRole::Viewer)
        );
        assert_eq!(
            required("/resident.v1.NodeAgent/Reload"),
            Some(AccessRole::Admin)
        );
        assert_eq!(
            required("/resident.v1.NodeAgent/ForgetFootprint"),
            Some(AccessRole::Admin)
        );
        assert_eq!(
            required("/grpc.health.v1.Health/Check"),
            Some(AccessRole::Viewer)
        );
        assert_eq!(required("/other.Service/Call"), None);
        assert_eq!(required("nonsense"), None);
        // A method the table does not name needs the admin role.
        assert_eq!(
            required("/resident.v1.NodeAgent/SomethingNew"),
            Some(AccessRole::Admin)
        );
    }

    /// Every RPC of the proto is named in the table on purpose: the only
    /// admin ones are those meant to be (a new RPC added without a role
    /// would fall to admin, and this says which).
    #[test]
    fn every_rpc_of_the_proto_has_the_role_it_is_meant_to() {
        use prost::Message as _;
        let set = prost_types::FileDescriptorSet::decode(resident_api::pb::FILE_DESCRIPTOR_SET)
            .expect("the descriptor set");
        let methods: Vec<String> = set
            .file
            .iter()
            .flat_map(|f| &f.service)
            .filter(|s| s.name() == "NodeAgent")
            .flat_map(|s| &s.method)
            .map(|m| m.name().to_string())
            .collect();
        assert!(methods.len() >= 15, "{methods:?}");
        let admin: Vec<&str> = methods
            .iter()
            .filter(|m| required(&format!("/resident.v1.NodeAgent/{m}")) == Some(AccessRole::Admin))
            .map(String::as_str)
            .collect();
        assert_eq!(
            admin,
            ["Reload", "ForgetFootprint", "Upgrade"],
            "{methods:?}"
        );
    }

    #[test]
    fn root_and_the_agents_own_uid_are_admins_whatever_the_config_says() {
        let config = |node: &str| {
            let text = format!(
                "[node]\nname = \"n\"\nlisten = \"unix:///tmp/residentd-unused/x.sock\"\n{node}\n[[pool]]\nname = \"ram\"\nbudget = \"1GB\"\n"
            );
            resident_config::parse(std::path::Path::new("roles.toml"), &text).expect("valid")
        };
        let unix = |uid: u32| Caller::Unix {
            uid,
            gid: uid,
            pid: None,
            groups: Vec::new(),
        };
        let own = nix::unistd::geteuid().as_raw();
        let other = if own == 4321 { 4322 } else { 4321 };
        // Monitoring let in as viewers: nobody else is named.
        let viewers_only = config("[node.access]\nviewers = [\"uid:12345\"]");
        let allow_list = config("allow_uids = [12345]");
        let none = config("");
        let table = [
            (&viewers_only, 0, Some(AccessRole::Admin)),
            (&viewers_only, own, Some(AccessRole::Admin)),
            (&viewers_only, 12345, Some(AccessRole::Viewer)),
            (&viewers_only, other, None),
            (&allow_list, 0, Some(AccessRole::Admin)),
            (&allow_list, own, Some(AccessRole::Admin)),
            (&allow_list, 12345, Some(AccessRole::Operator)),
            (&allow_list, other, Some(AccessRole::Viewer)),
            (&none, 0, Some(AccessRole::Admin)),
            (&none, other, Some(AccessRole::Operator)),
        ];
        for (config, uid, want) in table {
            assert_eq!(unix(uid).role(config), want, "uid {uid}");
        }
        // A role granted to nobody is said.
        assert!(
            viewers_only
                .warnings
                .iter()
                .any(|w| w.contains("grants operator to no one")),
            "{:?}",
            viewers_only.warnings
        );
        assert!(none.warnings.is_empty(), "{:?}", none.warnings);
    }

    #[test]
    fn this_process_has_its_groups_read() {
        let mine = supplementary_groups(std::process::id() as i32);
        let want: Vec<u32> = nix::unistd::getgroups()
            .expect("getgroups")
            .iter()
            .map(|g| g.as_raw())
            .collect();
        assert_eq!(mine, want);
    }

    #[test]
    fn a_certificates_names_are_read() {
        let mut params =
            rcgen::CertificateParams::new(vec!["worker-1.example".to_string()]).expect("params");
        params.subject_alt_names.push(rcgen::SanType::URI(
            "spiffe://example/ns/a".try_into().expect("uri"),
        ));
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, "orchestrator");
        let key = rcgen::KeyPair::generate().expect("key");
        let cert = params.self_signed(&key).expect("cert");
        let caller = identity(cert.der(), None);
        assert_eq!(
            caller,
            Caller::Cert {
                dns: vec!["worker-1.example".into()],
                uris: vec!["spiffe://example/ns/a".into()],
                cn: vec!["orchestrator".into()],
                addr: None,
            }
        );
        assert!(caller.is(&Principal::CertUri("spiffe://example/ns/a".into())));
        assert!(!caller.is(&Principal::CertDns("worker-2.example".into())));
        assert_eq!(
            caller.to_string(),
            "cert-cn:orchestrator cert-dns:worker-1.example cert-uri:spiffe://example/ns/a"
        );
    }
}
