//! From the raw document to a `Config`: every rule of the design brief's
//! config contract, each failure reported with file, line and key.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use resident_core::{
    Demand, GroupDef, GroupName, GroupPolicy, Groups, Policy, PoolConfig, PoolName, Role, Spec,
    WorkloadName, parse_bytes,
};
use resident_supervisor::{CgroupMode, MACROS, Readiness, RestartMode, RestartPolicy};
use toml::Spanned;

use crate::duration::parse_duration;
use crate::error::Source;
use crate::raw::{self, Quantity};
use crate::{Config, ConfigError, Listen, NodeConfig, PoolDef, TlsFiles, User, Workload};

type Result<T> = std::result::Result<T, ConfigError>;

pub(crate) fn validate(file: &Path, text: &str, check_programs: bool) -> Result<Config> {
    let src = Source { file, text };
    let doc = raw::document(&src)?;
    let node = node(&src, &doc.node)?;
    let pools = pools(&src, &doc.pool)?;
    let workloads = workloads(&src, &doc.workload, &pools)?;
    let groups = groups(&src, &doc.group, &workloads)?;
    if check_programs {
        for w in &doc.workload {
            let name = spanned_str(&w.get_ref().name);
            let command = &w.get_ref().command;
            let path = w.get_ref().env.get("PATH").map(|p| p.get_ref().as_str());
            program(command.get_ref(), path)
                .map_err(|m| src.err(command.span(), format!("workload[{name}].command"), m))?;
        }
    }
    let warnings = root_warnings(&node, &workloads);
    Ok(Config {
        source: file.to_path_buf(),
        node,
        pools,
        groups,
        workloads,
        warnings,
    })
}

/// Checks that the program of `argv` (a path, or a name on the PATH the
/// child will have: the workload's own `env.PATH`, else the agent's) is a
/// file this agent may execute and that nobody else may
/// replace: not writable by everyone.
fn program(argv: &[String], path: Option<&str>) -> std::result::Result<(), String> {
    use std::os::unix::fs::PermissionsExt as _;
    let Some(program) = argv.first() else {
        return Err("empty command".into());
    };
    // The lookup the supervisor makes when it spawns.
    let agents = std::env::var("PATH").ok();
    let path = resident_supervisor::find_program(program, path.or(agents.as_deref()))
        .map_err(|_| format!("program {program:?} is not on PATH"))?;
    let meta = std::fs::metadata(&path).map_err(|e| format!("program {}: {e}", path.display()))?;
    if !meta.is_file() {
        return Err(format!("program {} is not a file", path.display()));
    }
    if nix::unistd::access(&path, nix::unistd::AccessFlags::X_OK).is_err() {
        return Err(format!("program {} is not executable", path.display()));
    }
    if meta.permissions().mode() & 0o002 != 0 {
        return Err(format!(
            "program {} is writable by every user: anyone could replace what the agent runs",
            path.display()
        ));
    }
    Ok(())
}

/// Workloads that would run as root while the agent is root.
fn root_warnings(node: &NodeConfig, workloads: &BTreeMap<String, Arc<Workload>>) -> Vec<String> {
    if !nix::unistd::geteuid().is_root() {
        return Vec::new();
    }
    workloads
        .iter()
        .filter(|(_, w)| w.run_as.as_ref().or(node.run_as.as_ref()).is_none_or(|u| u.uid == 0))
        .map(|(name, _)| {
            format!("workload[{name}] would run as root: set run_as (in [node] or on the workload) to a user of its own")
        })
        .collect()
}

fn spanned_str(s: &Spanned<String>) -> &str {
    s.get_ref().as_str()
}

fn node(src: &Source<'_>, n: &Spanned<raw::Node>) -> Result<NodeConfig> {
    let n = n.get_ref();
    let name = spanned_str(&n.name);
    if name.is_empty() {
        return Err(src.err(n.name.span(), "node.name", "must not be empty"));
    }
    let tls = n.tls.as_ref().map(|t| tls(src, t.get_ref())).transpose()?;
    let listen = listen(src, &n.listen, n.insecure || tls.is_some())?;
    let on_full = match n.on_full.as_ref().map(|s| (s, s.get_ref().as_str())) {
        None | Some((_, "refuse")) => Policy::Refuse,
        Some((_, "evict")) => Policy::Evict,
        Some((s, other)) => {
            let msg = format!("{other:?} is not a policy (use \"refuse\" or \"evict\")");
            return Err(src.err(s.span(), "node.on_full", msg));
        }
    };
    let state_dir = n.state_dir.as_ref().map_or_else(
        || PathBuf::from("/var/lib/residentd"),
        |s| PathBuf::from(s.get_ref()),
    );
    let metrics_listen = match &n.metrics_listen {
        None => None,
        Some(s) => Some(s.get_ref().parse().map_err(|_| {
            src.err(
                s.span(),
                "node.metrics_listen",
                format!(
                    "{:?} is not an address like \"127.0.0.1:9464\"",
                    s.get_ref()
                ),
            )
        })?),
    };
    let memory_recovery = match &n.memory_recovery {
        None => Duration::from_secs(5),
        Some(s) => duration(src, s, "node.memory_recovery")?,
    };
    let sample_every = match &n.sample_every {
        None => Duration::from_secs(2),
        Some(s) => duration(src, s, "node.sample_every")?,
    };
    let cgroups = match n.cgroups.as_ref().map(|s| (s, s.get_ref().as_str())) {
        None | Some((_, "auto")) => CgroupMode::Auto,
        Some((_, "off")) => CgroupMode::Off,
        Some((s, other)) => {
            let msg = format!("{other:?} is not a cgroup mode (use \"auto\" or \"off\")");
            return Err(src.err(s.span(), "node.cgroups", msg));
        }
    };
    let memory_slack = match &n.memory_slack {
        None => 1_000_000_000,
        Some(q) => bytes(src, q, "node.memory_slack")?,
    };
    let socket_group = match &n.socket_group {
        None => None,
        Some(g) => {
            let found = nix::unistd::Group::from_name(g.get_ref()).ok().flatten();
            let group = found.ok_or_else(|| {
                src.err(
                    g.span(),
                    "node.socket_group",
                    format!("no group {:?} on this machine", g.get_ref()),
                )
            })?;
            Some((g.get_ref().clone(), group.gid.as_raw()))
        }
    };
    let max_instances = match &n.max_instances {
        None => 256,
        Some(m) if *m.get_ref() == 0 => {
            return Err(src.err(m.span(), "node.max_instances", "must be at least 1"));
        }
        Some(m) => *m.get_ref() as usize,
    };
    Ok(NodeConfig {
        name: name.to_string(),
        listen,
        insecure: n.insecure,
        state_dir,
        on_full,
        run_as: n
            .run_as
            .as_ref()
            .map(|u| user(src, u, "node.run_as"))
            .transpose()?,
        metrics_listen,
        sample_every,
        memory_recovery,
        tls,
        cgroups,
        memory_slack,
        socket_group,
        allow: crate::Allowlist {
            uids: n.allow_uids.clone(),
            gids: n.allow_gids.clone(),
        },
        max_instances,
        durable_answers: n.durable_answers.unwrap_or(true),
    })
}

fn tls(src: &Source<'_>, t: &raw::Tls) -> Result<TlsFiles> {
    let read = |s: &Spanned<String>, key: &str| {
        std::fs::read(s.get_ref())
            .map_err(|e| src.err(s.span(), key, format!("cannot read {:?}: {e}", s.get_ref())))
    };
    Ok(TlsFiles {
        cert: read(&t.cert, "node.tls.cert")?,
        key: read(&t.key, "node.tls.key")?,
        client_ca: read(&t.client_ca, "node.tls.client_ca")?,
    })
}

/// `tcp_allowed`: TLS is configured, or plaintext was asked for.
fn listen(src: &Source<'_>, l: &Spanned<String>, tcp_allowed: bool) -> Result<Listen> {
    let text = l.get_ref();
    if let Some(path) = text.strip_prefix("unix://") {
        if !path.starts_with('/') {
            return Err(src.err(
                l.span(),
                "node.listen",
                format!("{text:?}: the socket path must be absolute"),
            ));
        }
        return Ok(Listen::Unix(PathBuf::from(path)));
    }
    if let Some(addr) = text.strip_prefix("tcp://") {
        let addr = addr.parse().map_err(|_| {
            src.err(
                l.span(),
                "node.listen",
                format!("{text:?}: expected tcp://HOST:PORT with an IP address"),
            )
        })?;
        if !tcp_allowed {
            let msg = "TCP needs TLS with client certificates: add [node.tls] with cert, key and \
                       client_ca, or set insecure = true to accept plaintext TCP";
            return Err(src.err(l.span(), "node.listen", msg));
        }
        return Ok(Listen::Tcp(addr));
    }
    Err(src.err(
        l.span(),
        "node.listen",
        format!("{text:?}: expected unix:///PATH or tcp://HOST:PORT"),
    ))
}

fn user(src: &Source<'_>, u: &Spanned<String>, key: &str) -> Result<User> {
    let name = u.get_ref();
    match nix::unistd::User::from_name(name) {
        Ok(Some(found)) => Ok(User {
            name: name.clone(),
            uid: found.uid.as_raw(),
            gid: found.gid.as_raw(),
        }),
        Ok(None) => Err(src.err(u.span(), key, format!("no user {name:?} on this machine"))),
        Err(e) => Err(src.err(u.span(), key, format!("cannot look up user {name:?}: {e}"))),
    }
}

fn bytes(src: &Source<'_>, q: &Spanned<Quantity>, key: &str) -> Result<u64> {
    match q.get_ref() {
        Quantity::Bytes(b) => Ok(*b),
        Quantity::Text(t) => parse_bytes(t).map_err(|e| src.err(q.span(), key, e.to_string())),
    }
}

fn duration(src: &Source<'_>, d: &Spanned<String>, key: &str) -> Result<Duration> {
    parse_duration(d.get_ref()).map_err(|e| src.err(d.span(), key, e))
}

fn pools(src: &Source<'_>, raw: &[Spanned<raw::Pool>]) -> Result<Vec<PoolDef>> {
    let mut seen = BTreeSet::new();
    let mut out = Vec::new();
    for p in raw {
        let span = p.span();
        let p = p.get_ref();
        let name = PoolName::new(spanned_str(&p.name))
            .map_err(|e| src.err(p.name.span(), "pool.name", e.to_string()))?;
        let key = |k: &str| format!("pool[{name}].{k}");
        if !seen.insert(name.clone()) {
            return Err(src.err(p.name.span(), key("name"), "declared twice"));
        }
        let budget = p
            .budget
            .as_ref()
            .map(|b| bytes(src, b, &key("budget")))
            .transpose()?;
        let reserve = p
            .reserve
            .as_ref()
            .map(|r| bytes(src, r, &key("reserve")))
            .transpose()?
            .unwrap_or(0);
        if let Some(d) = &p.device {
            let text = d.get_ref();
            let nvml = text
                .strip_prefix("nvml:")
                .is_some_and(|n| n.parse::<u32>().is_ok());
            let file = text
                .strip_prefix("file:")
                .is_some_and(|p| p.starts_with('/'));
            if !(nvml || file) {
                let msg = format!(
                    "{text:?}: expected \"nvml:N\" (a GPU) or \"file:/path\" (a reading kept in a file)"
                );
                return Err(src.err(d.span(), key("device"), msg));
            }
            if p.host {
                return Err(src.err(
                    span,
                    key("device"),
                    "a pool is bound to host memory or to a device, not both",
                ));
            }
        }
        let live = p.host || p.device.is_some();
        out.push(PoolDef {
            pool: PoolConfig {
                name,
                budget,
                reserve,
                live,
            },
            host: p.host,
            device: p.device.as_ref().map(|d| d.get_ref().clone()),
        });
    }
    Ok(out)
}

fn groups(
    src: &Source<'_>,
    raw: &[Spanned<raw::Group>],
    workloads: &BTreeMap<String, Arc<Workload>>,
) -> Result<Groups> {
    let mut defs = Vec::new();
    let mut member_of: BTreeMap<String, String> = BTreeMap::new();
    for g in raw {
        let g = g.get_ref();
        let name = GroupName::new(spanned_str(&g.name))
            .map_err(|e| src.err(g.name.span(), "group.name", e.to_string()))?;
        let mut members = Vec::new();
        for m in &g.members {
            let key = format!("group[{name}].members");
            if !workloads.contains_key(m.get_ref()) {
                return Err(src.err(
                    m.span(),
                    key,
                    format!("no workload {:?} in the roster", m.get_ref()),
                ));
            }
            if let Some(first) = member_of.insert(m.get_ref().clone(), name.to_string())
                && first != name.as_str()
            {
                let msg = format!(
                    "workload {:?} is already a member of group '{first}'",
                    m.get_ref()
                );
                return Err(src.err(m.span(), key, msg));
            }
            members.push(
                WorkloadName::new(m.get_ref().as_str())
                    .map_err(|e| src.err(m.span(), key, e.to_string()))?,
            );
        }
        let policy = GroupPolicy {
            swap: g.swap,
            exclusive: g.exclusive,
            persistent: g.persistent,
        };
        defs.push(GroupDef {
            name,
            members,
            policy,
        });
    }
    let span = raw.first().map_or(0..0, Spanned::span);
    Groups::new(defs).map_err(|e| src.err(span, "group", e.to_string()))
}

fn workloads(
    src: &Source<'_>,
    raw: &[Spanned<raw::Workload>],
    pools: &[PoolDef],
) -> Result<BTreeMap<String, Arc<Workload>>> {
    let mut out = BTreeMap::new();
    for w in raw {
        let w = w.get_ref();
        let name = WorkloadName::new(spanned_str(&w.name))
            .map_err(|e| src.err(w.name.span(), "workload.name", e.to_string()))?;
        if out.contains_key(name.as_str()) {
            return Err(src.err(
                w.name.span(),
                format!("workload[{name}].name"),
                "declared twice",
            ));
        }
        let workload = workload(src, &name, w, pools)?;
        out.insert(name.to_string(), Arc::new(workload));
    }
    Ok(out)
}

fn workload(
    src: &Source<'_>,
    name: &WorkloadName,
    w: &raw::Workload,
    pools: &[PoolDef],
) -> Result<Workload> {
    let key = |k: &str| format!("workload[{name}].{k}");
    let mut spec = Spec::new(name.clone());
    if let Some(role) = &w.role {
        spec.role = Role::new(spanned_str(role))
            .map_err(|e| src.err(role.span(), key("role"), e.to_string()))?;
    }
    spec.priority = w.priority;
    for x in &w.excludes {
        let bare = x.get_ref().strip_prefix("role:").unwrap_or(x.get_ref());
        Role::new(bare).map_err(|e| src.err(x.span(), key("excludes"), e.to_string()))?;
        spec.excludes.push(x.get_ref().clone());
    }
    for (pool, d) in &w.memory {
        let k = |f: &str| key(&format!("memory.{pool}.{f}"));
        if !pools.iter().any(|p| p.pool.name.as_str() == pool) {
            let msg = format!("no pool {pool:?} on this node (declare it with [[pool]])");
            return Err(src.err(d.span(), key(&format!("memory.{pool}")), msg));
        }
        let (weights, kv) = demand(src, d, &k)?;
        let pool = PoolName::new(pool.as_str())
            .map_err(|e| src.err(d.span(), key("memory"), e.to_string()))?;
        spec.demand.insert(pool, Demand { weights, kv });
    }
    let argv = w.command.get_ref().clone();
    if argv.first().is_none_or(|p| p.is_empty()) {
        return Err(src.err(
            w.command.span(),
            key("command"),
            "must name a program (an argv list, never a shell string)",
        ));
    }
    for arg in &argv {
        check_macros(arg).map_err(|m| src.err(w.command.span(), key("command"), m))?;
    }
    let mut env = BTreeMap::new();
    for (k, v) in &w.env {
        check_macros(v.get_ref()).map_err(|m| src.err(v.span(), key(&format!("env.{k}")), m))?;
        env.insert(k.clone(), v.get_ref().clone());
    }
    let (readiness, readiness_timeout) = readiness(src, w, &key)?;
    let restart = restart(src, w, &key)?;
    let stop_grace = match &w.stop_grace {
        Some(d) => duration(src, d, &key("stop_grace"))?,
        None => Duration::from_secs(10),
    };
    let idle_ttl = match &w.idle_ttl {
        Some(d) => Some(duration(src, d, &key("idle_ttl"))?).filter(|d| !d.is_zero()),
        None => None,
    };
    let host_bytes = pools
        .iter()
        .filter(|p| p.device.is_none())
        .map(|p| spec.footprint(p.pool.name.as_str()))
        .fold(0u64, u64::saturating_add);
    Ok(Workload {
        host_bytes,
        spec: Arc::new(spec),
        argv,
        env,
        pass_env: w.pass_env.clone(),
        cwd: w.cwd.as_ref().map(PathBuf::from),
        readiness,
        readiness_timeout,
        restart,
        stop_grace,
        idle_ttl,
        run_as: w
            .run_as
            .as_ref()
            .map(|u| user(src, u, &key("run_as")))
            .transpose()?,
    })
}

/// Weights and KV of one pool: in bytes, or sized from a GGUF file.
fn demand(
    src: &Source<'_>,
    d: &Spanned<raw::Demand>,
    k: &dyn Fn(&str) -> String,
) -> Result<(u64, u64)> {
    let dem = d.get_ref();
    let kv = dem
        .kv
        .as_ref()
        .map(|q| bytes(src, q, &k("kv")))
        .transpose()?;
    match (&dem.weights, &dem.from_gguf) {
        (Some(w), None) => {
            if let Some(c) = &dem.ctx {
                return Err(src.err(
                    c.span(),
                    k("ctx"),
                    "ctx sizes the KV cache of a from_gguf model only",
                ));
            }
            Ok((bytes(src, w, &k("weights"))?, kv.unwrap_or(0)))
        }
        (None, Some(path)) => {
            let model = crate::gguf::read(std::path::Path::new(path.get_ref())).map_err(|e| {
                src.err(
                    path.span(),
                    k("from_gguf"),
                    format!("{}: {e}", path.get_ref()),
                )
            })?;
            let ctx = dem
                .ctx
                .as_ref()
                .map_or(model.context_length, |c| *c.get_ref());
            let kv_type = dem.kv_type.as_ref().map_or("f16", |t| t.get_ref().as_str());
            let kv = match kv {
                Some(kv) => kv,
                None => model.kv_bytes(ctx, kv_type).ok_or_else(|| {
                    let span = dem.kv_type.as_ref().map_or(path.span(), |t| t.span());
                    let msg = format!(
                        "{kv_type:?} is not a KV cache type (f32, f16, bf16, q8_0, q5_1, q5_0, q4_1, q4_0, iq4_nl)"
                    );
                    src.err(span, k("kv_type"), msg)
                })?,
            };
            Ok((model.weights_bytes, kv))
        }
        _ => Err(src.err(
            d.span(),
            k("weights"),
            "give either weights (bytes) or from_gguf (a model file)",
        )),
    }
}

/// Refuses `${NAME}` for a NAME the supervisor does not fill in.
fn check_macros(s: &str) -> std::result::Result<(), String> {
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        let after = &rest[start + 2..];
        let Some(end) = after.find('}') else {
            return Err(format!("{s:?}: unterminated ${{"));
        };
        let name = &after[..end];
        if !MACROS.contains(&name) {
            return Err(format!(
                "{s:?}: unknown macro ${{{name}}} (known: ${{PORT}}, ${{INSTANCE}}, ${{WORKLOAD}}, ${{ROLE}})"
            ));
        }
        rest = &after[end + 1..];
    }
    Ok(())
}

fn readiness(
    src: &Source<'_>,
    w: &raw::Workload,
    key: &dyn Fn(&str) -> String,
) -> Result<(Readiness, Duration)> {
    let default_timeout = Duration::from_secs(120);
    let Some(r) = &w.readiness else {
        return Ok((Readiness::None, default_timeout));
    };
    let raw = r.get_ref();
    let chosen = [
        raw.http.is_some(),
        raw.tcp == Some(true),
        raw.none == Some(true),
    ];
    if chosen.iter().filter(|c| **c).count() != 1 {
        return Err(src.err(
            r.span(),
            key("readiness"),
            "set exactly one of http = \"/path\", tcp = true or none = true",
        ));
    }
    let readiness = match &raw.http {
        Some(path) if !path.starts_with('/') => {
            return Err(src.err(
                r.span(),
                key("readiness.http"),
                format!("{path:?} must start with '/'"),
            ));
        }
        Some(path) => Readiness::Http { path: path.clone() },
        None if raw.tcp == Some(true) => Readiness::Tcp,
        None => Readiness::None,
    };
    let timeout = match &raw.timeout {
        Some(t) => duration(src, t, &key("readiness.timeout"))?,
        None => default_timeout,
    };
    Ok((readiness, timeout))
}

fn restart(
    src: &Source<'_>,
    w: &raw::Workload,
    key: &dyn Fn(&str) -> String,
) -> Result<RestartPolicy> {
    let mut policy = RestartPolicy::default();
    let Some(r) = &w.restart else {
        return Ok(policy);
    };
    let raw = r.get_ref();
    if let Some(p) = &raw.policy {
        policy.mode = match p.get_ref().as_str() {
            "never" => RestartMode::Never,
            "on-failure" => RestartMode::OnFailure,
            "always" => RestartMode::Always,
            other => {
                let msg = format!(
                    "{other:?} is not a restart policy (use \"never\", \"on-failure\" or \"always\")"
                );
                return Err(src.err(p.span(), key("restart.policy"), msg));
            }
        };
    }
    if let Some(m) = raw.max_restarts {
        policy.max_restarts = m;
    }
    if let Some(b) = &raw.backoff {
        policy.backoff = duration(src, b, &key("restart.backoff"))?;
    }
    if let Some(b) = &raw.backoff_max {
        policy.backoff_max = duration(src, b, &key("restart.backoff_max"))?;
    }
    if let Some(s) = &raw.stable_after {
        policy.stable_after = duration(src, s, &key("restart.stable_after"))?;
    }
    if policy.backoff_max < policy.backoff {
        return Err(src.err(
            r.span(),
            key("restart.backoff_max"),
            "must not be shorter than backoff",
        ));
    }
    Ok(policy)
}
