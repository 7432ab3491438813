//! residentd's configuration: the TOML of the design brief, parsed and
//! validated into core specs and supervisor launch templates. Every error
//! names the file, the line and the key.

// clippy.toml's `disallowed-methods` are for validate/ only (its checks
// look at the machine through `Lookups`); the lint is on there.
#![allow(clippy::disallowed_methods)]

mod duration;
mod error;
pub mod gguf;
mod host;
pub mod private_dir;
pub mod projection;
mod raw;
pub mod report;
mod validate;

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use resident_core::{GpuChoice, Groups, Policy, PoolConfig, PoolName, Spec};
use resident_supervisor::{CgroupMode, LaunchSpec, Readiness, RestartPolicy};

pub use duration::parse_duration;
pub use error::ConfigError;
pub use host::{Host, UNRESOLVED_ID};

/// Where the API listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Listen {
    /// A Unix socket at this path.
    Unix(PathBuf),
    /// TCP on this address.
    Tcp(SocketAddr),
}

/// The `[node]` table.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// The node's name, reported by `Node`.
    pub name: String,
    /// Where the API listens: one or more Unix sockets and TCP addresses,
    /// in the order written.
    pub listen: Vec<Listen>,
    /// TCP without TLS was asked for explicitly.
    pub insecure: bool,
    /// Where the journal lives.
    pub state_dir: PathBuf,
    /// What a Start with POLICY_UNSPECIFIED does when it does not fit.
    pub on_full: Policy,
    /// What an instance measured above its reservation meets, unless its
    /// workload says otherwise.
    pub on_overrun: OnOverrun,
    /// The user children run as unless their workload says otherwise.
    pub run_as: Option<User>,
    /// The Prometheus endpoint, if any.
    pub metrics_listen: Option<SocketAddr>,
    /// How often memory is sampled.
    pub sample_every: Duration,
    /// How long a start waits for evicted victims' memory to show as
    /// available again on a live pool.
    pub memory_recovery: Duration,
    /// TLS for a TCP listener: server identity and the CA that client
    /// certificates must chain to.
    pub tls: Option<TlsFiles>,
    /// Whether instances get cgroups of their own (`cgroups`).
    pub cgroups: CgroupMode,
    /// Added to an instance's declared host-memory footprint to make its
    /// cgroup memory limit (`memory_slack`).
    pub memory_slack: u64,
    /// The group that owns the Unix socket (`socket_group`), resolved.
    pub socket_group: Option<(String, u32)>,
    /// Callers allowed to change state over the Unix socket (Start, Stop,
    /// Touch, Adopt), by uid or gid; both empty: anyone who can open the socket.
    pub allow: Allowlist,
    /// The most instances that may hold memory at once.
    pub max_instances: usize,
    /// The most client connections open at once, every listener
    /// together.
    pub max_connections: usize,
    /// The most one TCP peer (a client's IP address) may hold open; Unix
    /// callers count against `max_connections` only.
    pub max_connections_per_peer: usize,
    /// How often a connection is pinged (HTTP/2 keepalive).
    pub keepalive_interval: Duration,
    /// How long a ping's answer may take before the connection is closed.
    pub keepalive_timeout: Duration,
    /// Start and Stop answer only once the journal on disk says what they
    /// did (`durable_answers`, default true).
    pub durable_answers: bool,
    /// Whether a workload's high-water measured bytes per pool are kept
    /// (in the journal) and reserved at its next admission
    /// (`learn_footprints`, default true).
    pub learn_footprints: bool,
    /// Instances run on when the agent ends without stopping them (a
    /// crash, kill -9), and the next agent takes them over
    /// (`instances_outlive_agent`, default true).
    pub instances_outlive_agent: bool,
    /// How an any-of demand chooses among pools that fit alike
    /// (`gpu_choice`, default binpack).
    pub gpu_choice: GpuChoice,
    /// `[node.access]`, when given: who holds which role. `None`: the
    /// defaults (see docs/security.md).
    pub access: Option<Access>,
}

/// What a caller may do: each role includes the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum AccessRole {
    /// Get, List, Place, Watch, Logs, Node, Workloads, health, reflection.
    Viewer,
    /// And Start, Stop, Touch, Adopt, Sleep.
    Operator,
    /// And Reload, ForgetFootprint, Upgrade.
    Admin,
}

impl AccessRole {
    /// Its name, as `[node.access]` spells its list (singular).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Viewer => "viewer",
            Self::Operator => "operator",
            Self::Admin => "admin",
        }
    }
}

/// One entry of a `[node.access]` list: whom it grants the role.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Principal {
    /// A Unix caller with this uid (`uid:N`, `user:NAME`).
    Uid(u32),
    /// A Unix caller with this gid, primary or supplementary (`gid:N`,
    /// `group:NAME`).
    Gid(u32),
    /// A client certificate with this SAN DNS name (`cert-dns:NAME`).
    CertDns(String),
    /// A client certificate with this SAN URI, such as a SPIFFE id
    /// (`cert-uri:URI`).
    CertUri(String),
    /// A client certificate with this subject common name (`cert-cn:NAME`).
    CertCn(String),
}

/// `[node.access]`: who holds each role.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Access {
    /// Granted viewer.
    pub viewers: Vec<Principal>,
    /// Granted operator (and viewer).
    pub operators: Vec<Principal>,
    /// Granted admin (and operator and viewer).
    pub admins: Vec<Principal>,
}

/// Who may call the mutating RPCs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowlist {
    /// Allowed uids.
    pub uids: Vec<u32>,
    /// Allowed gids (the caller's primary gid, as the socket reports it).
    pub gids: Vec<u32>,
}

impl Allowlist {
    /// Whether a caller with `uid` and `gid` may change state.
    pub fn permits(&self, uid: u32, gid: u32) -> bool {
        (self.uids.is_empty() && self.gids.is_empty())
            || self.uids.contains(&uid)
            || self.gids.contains(&gid)
    }
}

/// The PEM files of `[node.tls]`, read when the config loads.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate chain.
    pub cert: Vec<u8>,
    /// The server's private key.
    pub key: Vec<u8>,
    /// The CA whose certificates clients must present.
    pub client_ca: Vec<u8>,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print key material.
        f.write_str("TlsFiles { .. }")
    }
}

/// A user children run as, resolved when the config loads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    /// As written.
    pub name: String,
    /// Its uid.
    pub uid: u32,
    /// Its primary gid.
    pub gid: u32,
    /// Its supplementary groups as the machine lists them (`getgrouplist`,
    /// the primary one among them); empty where nothing was looked up.
    pub groups: Vec<u32>,
}

/// A `[[pool]]`.
#[derive(Debug, Clone)]
pub struct PoolDef {
    /// What the planner needs.
    pub pool: PoolConfig,
    /// Bound to host memory.
    pub host: bool,
    /// Bound to a device probe (`nvml:0`).
    pub device: Option<String>,
    /// The device index its children see (`CUDA_VISIBLE_DEVICES`,
    /// `${DEVICE}`): the pool's `index`, or N of `device = "nvml:N"`.
    pub index: Option<u32>,
    /// A disk pool: the directory its bytes are stored under (the saved
    /// conversations of `keep_kv` workloads); its budget bounds them. It
    /// holds no memory: no workload's memory table may name it.
    pub path: Option<std::path::PathBuf>,
}

impl PoolDef {
    /// Bound to no device (no probe, no index) and not a disk pool: host
    /// memory, or a budget of the operator's own.
    pub fn device_free(&self) -> bool {
        self.device.is_none() && self.index.is_none() && self.path.is_none()
    }
}

/// What the agent does with an instance measured above its reservation
/// (`on_overrun`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OnOverrun {
    /// The books count the measured bytes; the instance runs on.
    #[default]
    Account,
    /// The instance is stopped (reason `OVERRUN`).
    Stop,
}

impl OnOverrun {
    /// `on_overrun`'s value, or `None` for one it does not know.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "account" => Some(Self::Account),
            "stop" => Some(Self::Stop),
            _ => None,
        }
    }
}

/// Where a workload's servers may listen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Expose {
    /// Loopback only: a listener elsewhere stops the instance (EXPOSED).
    Loopback,
    /// Anywhere.
    Any,
}

/// A `[[workload]]`: the placement spec and the launch template.
#[derive(Debug, Clone)]
pub struct Workload {
    /// What the planner needs.
    pub spec: Arc<Spec>,
    /// Command line, macros unexpanded.
    pub argv: Vec<String>,
    /// Environment, macros unexpanded.
    pub env: BTreeMap<String, String>,
    /// Agent variables passed through besides PATH, HOME and LANG.
    pub pass_env: Vec<String>,
    /// Working directory.
    pub cwd: Option<PathBuf>,
    /// Readiness probe.
    pub readiness: Readiness,
    /// Readiness timeout.
    pub readiness_timeout: Duration,
    /// Restart policy.
    pub restart: RestartPolicy,
    /// SIGTERM to SIGKILL.
    pub stop_grace: Duration,
    /// Unused for this long: stopped. `None`: never.
    pub idle_ttl: Option<Duration>,
    /// Run as this user (overrides `[node] run_as`).
    pub run_as: Option<User>,
    /// Its declared footprint on pools of host memory (every pool not bound
    /// to a device); 0 when it declares none.
    pub host_bytes: u64,
    /// Other names it answers to (`aliases`), unique among every workload
    /// name and alias of the roster.
    pub aliases: Vec<String>,
    /// The most requests a front door (the router) sends it at once
    /// (`concurrency_limit`); `None`: no limit.
    pub concurrency_limit: Option<u32>,
    /// Per memory table: what it reserves and where each part came
    /// from (`--check-config` prints these).
    pub reservation: Vec<String>,
    /// What went wrong sizing it (a projection that failed): said as
    /// config warnings.
    pub reservation_warnings: Vec<String>,
    /// What it meets when measured above its reservation; `None`: the
    /// node's `on_overrun`.
    pub on_overrun: Option<OnOverrun>,
    /// Whether its servers may listen beyond loopback (`expose = "any"`);
    /// under `"loopback"` a listener on another address stops it (EXPOSED).
    pub expose: Expose,
    /// Whether its server reports the buffers it allocated in its output
    /// (llama.cpp's, `report.rs`): read once it is READY.
    pub reports_buffers: bool,
    /// How its server sleeps and wakes (`[workload.sleep]`); `None`: it
    /// cannot. What it holds asleep is `spec.asleep`.
    pub sleep: Option<Sleep>,
    /// Where its server's conversations (llama-server's slots) are saved
    /// when it is stopped, and restored from at its next start
    /// (`keep_kv`); `None`: not kept.
    pub keep_kv: Option<KeepKv>,
}

/// A workload's saved conversations (`keep_kv = "POOL"`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeepKv {
    /// The disk pool they are charged to.
    pub pool: String,
    /// The directory its server saves into (`--slot-save-path`): the
    /// pool's directory and the workload's name.
    pub dir: std::path::PathBuf,
    /// For a server that sleeps by itself: how long quiet before the agent
    /// has it save its conversations, ahead of its own sleep (the flavor
    /// gives the server the rest of the idle time, counted from the save,
    /// and `--metrics`, which tells the agent it is quiet without
    /// restarting its idle timer); `None`: saved only before a stop.
    pub save_quiet: Option<std::time::Duration>,
}

/// How a workload's server sleeps and wakes (`[workload.sleep]`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sleep {
    /// The call that puts it to sleep; `None`: it sleeps only by itself
    /// (llama-server, after `idle`), which `follow` tells.
    pub sleep: Option<HttpCall>,
    /// The call that wakes it; `None`: it wakes by itself at the next
    /// request (llama-server), once the books have admitted the wake.
    pub wake: Option<HttpCall>,
    /// A path that says, as JSON `"is_sleeping": true|false`, whether the
    /// server sleeps now (llama-server's `/props`): the agent reads it
    /// every second and follows it.
    pub follow: Option<String>,
    /// Put to sleep after this long unused; `None` (`0s`): only to make
    /// room, or when asked.
    pub idle: Option<Duration>,
    /// How long a sleep or wake call may take before the instance is
    /// stopped as failed.
    pub timeout: Duration,
}

/// An HTTP call on an instance's port: `"POST /sleep?level=1"`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpCall {
    /// `GET`, `POST`, `PUT` ...
    pub method: String,
    /// The path and query, starting with `/`.
    pub path: String,
}

impl std::fmt::Display for HttpCall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.method, self.path)
    }
}

impl Workload {
    /// What its learned footprint is learned for (`learn_footprints`): a
    /// stable 64-bit digest of the command line, environment and working
    /// directory as configured, the executable the command resolves to,
    /// and every file the command line names (a model file, a projector),
    /// each by its path, length and modification time. A changed command,
    /// a new binary or a model file replaced on disk gives another key, so
    /// what was measured for the old one is not reserved for the new.
    /// Reads file metadata (a few `stat` calls), no contents.
    pub fn footprint_key(&self) -> u64 {
        use std::hash::Hasher as _;
        let mut h = fnv::FnvHasher::default();
        fn put(h: &mut fnv::FnvHasher, bytes: &[u8]) {
            h.write_u64(bytes.len() as u64);
            h.write(bytes);
        }
        for a in &self.argv {
            put(&mut h, a.as_bytes());
        }
        for (k, v) in &self.env {
            put(&mut h, k.as_bytes());
            put(&mut h, v.as_bytes());
        }
        if let Some(cwd) = &self.cwd {
            put(&mut h, cwd.as_os_str().as_encoded_bytes());
        }
        let path_var = self
            .env
            .get("PATH")
            .cloned()
            .or_else(|| std::env::var("PATH").ok());
        let program = self
            .argv
            .first()
            .and_then(|p| resident_supervisor::find_program(p, path_var.as_deref()).ok());
        // `--model=FILE` names a file as well as `--model FILE`.
        let named = self
            .argv
            .iter()
            .skip(1)
            .map(|a| a.split_once('=').map_or(a.as_str(), |(_, v)| v))
            .map(|a| match &self.cwd {
                Some(cwd) if !a.starts_with('/') => cwd.join(a),
                _ => std::path::PathBuf::from(a),
            });
        for file in program.into_iter().chain(named) {
            let Ok(m) = std::fs::metadata(&file) else {
                continue;
            };
            if !m.is_file() {
                continue;
            }
            put(&mut h, file.as_os_str().as_encoded_bytes());
            h.write_u64(m.len());
            let mtime = m
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok());
            h.write_u128(mtime.map_or(0, |d| d.as_nanos()));
        }
        h.finish()
    }

    /// The supervisor's spec for instance `instance` of this workload. Its
    /// memory limit is the declared host footprint plus the node's slack;
    /// none when it declares no host memory. `devices` are the indexes of
    /// the devices its any-of demands were given (`Config::devices`): they
    /// fill in `${DEVICE}` and `CUDA_VISIBLE_DEVICES` (unless the workload
    /// sets that itself), comma-separated, with `CUDA_DEVICE_ORDER=PCI_BUS_ID`
    /// (unless the workload sets it): NVML numbers GPUs in PCI bus order,
    /// and CUDA by default fastest first, which on a node of mixed cards
    /// would hand the server another card than the one reserved.
    pub fn launch(
        &self,
        instance: &str,
        generation: u64,
        node: &NodeConfig,
        devices: &[u32],
    ) -> LaunchSpec {
        let default_user = node.run_as.as_ref();
        let user = self.run_as.as_ref().or(default_user);
        let groups = user.map(|u| u.groups.clone()).unwrap_or_default();
        let user = user.map(|u| (u.uid, u.gid));
        let (mut argv, mut env) = (self.argv.clone(), self.env.clone());
        if !devices.is_empty() {
            let list: Vec<String> = devices.iter().map(u32::to_string).collect();
            let list = list.join(",");
            for s in argv.iter_mut().chain(env.values_mut()) {
                if s.contains("${DEVICE}") {
                    *s = s.replace("${DEVICE}", &list);
                }
            }
            env.entry("CUDA_VISIBLE_DEVICES".into()).or_insert(list);
            env.entry("CUDA_DEVICE_ORDER".into())
                .or_insert_with(|| "PCI_BUS_ID".into());
        }
        LaunchSpec {
            instance: instance.to_string(),
            workload: self.spec.workload.to_string(),
            role: self.spec.role.to_string(),
            argv,
            env,
            pass_env: self.pass_env.clone(),
            cwd: self.cwd.clone(),
            user,
            groups,
            readiness: self.readiness.clone(),
            readiness_timeout: self.readiness_timeout,
            restart: self.restart,
            stop_grace: self.stop_grace,
            memory_limit: (self.host_bytes > 0)
                .then(|| self.host_bytes.saturating_add(node.memory_slack)),
            generation,
        }
    }
}

impl NodeConfig {
    /// The first Unix socket the API listens on, if any.
    pub fn socket(&self) -> Option<&Path> {
        self.listen.iter().find_map(|l| match l {
            Listen::Unix(p) => Some(p.as_path()),
            Listen::Tcp(_) => None,
        })
    }
}

/// A validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// The file it came from.
    pub source: PathBuf,
    /// `[node]`.
    pub node: NodeConfig,
    /// `[[pool]]`, in file order.
    pub pools: Vec<PoolDef>,
    /// `[[group]]`.
    pub groups: Groups,
    /// `[[workload]]` by name.
    pub workloads: BTreeMap<String, Arc<Workload>>,
    /// What is allowed but unwise (a workload that would run as root), for
    /// the operator to read at start and in `--check-config`.
    pub warnings: Vec<String>,
}

impl Config {
    /// The workload named `name`, or whose aliases include it.
    pub fn workload(&self, name: &str) -> Option<&Arc<Workload>> {
        self.workloads.get(name).or_else(|| {
            self.workloads
                .values()
                .find(|w| w.aliases.iter().any(|a| a == name))
        })
    }

    /// The device indexes of `chosen` pools (an admission's any-of
    /// choice), in order; empty unless every chosen pool has one.
    pub fn devices(&self, chosen: &[Vec<PoolName>]) -> Vec<u32> {
        let index = |name: &PoolName| {
            self.pools
                .iter()
                .find(|p| p.pool.name == *name)
                .and_then(|p| p.index)
        };
        chosen
            .iter()
            .flatten()
            .map(index)
            .collect::<Option<Vec<u32>>>()
            .unwrap_or_default()
    }

    /// The planner's pool configs.
    pub fn pool_configs(&self) -> Vec<PoolConfig> {
        self.pools.iter().map(|p| p.pool.clone()).collect()
    }
}

/// Reads and validates the file at `path` for this machine, including
/// that every workload's program exists, is executable and is not
/// world-writable: `load_with(path, Host::Local)`.
pub fn load(path: &Path) -> Result<Config, ConfigError> {
    load_with(path, Host::Local)
}

/// Reads the file at `path` and validates it for `host`: `Host::Local`
/// makes every look-up on this machine (as `load`), `Host::Elsewhere`
/// none (what that skips, and what stands in, is listed on `Host`).
pub fn load_with(path: &Path, host: Host) -> Result<Config, ConfigError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| ConfigError::of_file(path, "", format!("cannot read: {e}")))?;
    parse_with(path, &text, host)
}

/// Validates `text`, reporting errors against `file`. Programs are not
/// looked up; users, groups, the TLS files and GGUF files are, on this
/// machine (`parse_with(.., Host::Elsewhere)` looks up nothing).
pub fn parse(file: &Path, text: &str) -> Result<Config, ConfigError> {
    validate::validate(file, text, host::Lookups::local_without_programs())
}

/// As `parse`, and checks the programs on this machine, as `load` does:
/// `parse_with(file, text, Host::Local)`.
pub fn parse_checked(file: &Path, text: &str) -> Result<Config, ConfigError> {
    parse_with(file, text, Host::Local)
}

/// Validates `text` for `host`, reporting errors against `file`, as
/// `load_with` does.
pub fn parse_with(file: &Path, text: &str, host: Host) -> Result<Config, ConfigError> {
    validate::validate(file, text, host::Lookups::on(host))
}
