//! The `[node]` section: name, policy, sampling, cgroups, the socket's
//! group, limits and the allowlist (`listen.rs` has `listen` and
//! `[node.tls]`).

use std::path::PathBuf;
use std::time::Duration;

use resident_core::{GpuChoice, Policy};
use resident_supervisor::CgroupMode;
use toml::Spanned;

use super::listen::{listen, tls};
use super::{Result, bytes, duration, spanned_str, user};
use crate::error::Source;
use crate::host::Lookups;
use crate::{Allowlist, Listen, NodeConfig};
use crate::{OnOverrun, raw};

pub(super) fn node(src: &Source<'_>, n: &Spanned<raw::Node>, host: Lookups) -> Result<NodeConfig> {
    let n = n.get_ref();
    let name = spanned_str(&n.name);
    if name.is_empty() {
        return Err(src.err(n.name.span(), "node.name", "must not be empty"));
    }
    let tls = n
        .tls
        .as_ref()
        .map(|t| tls(src, t.get_ref(), host))
        .transpose()?;
    let listen = listen(src, &n.listen, n.insecure || tls.is_some())?;
    let on_full = on_full(src, n.on_full.as_ref())?;
    let state_dir = n.state_dir.as_ref().map_or_else(
        || PathBuf::from("/var/lib/residentd"),
        |s| PathBuf::from(s.get_ref()),
    );
    // The agent acts on what its state directory holds (a journal names
    // process groups it kills): one another user can write is refused.
    if let Err(why) = host.private_dir(&state_dir) {
        let span = n.state_dir.as_ref().map_or(0..0, |s| s.span());
        return Err(src.err(span, "node.state_dir", why));
    }
    for l in &listen {
        if let Listen::Unix(socket) = l
            && let Err(why) = host.private_dir(&crate::private_dir::socket_dir(socket))
        {
            return Err(src.err(n.listen.span(), "node.listen", why));
        }
    }
    let metrics_listen = metrics_listen(src, n.metrics_listen.as_ref())?;
    let memory_recovery = match &n.memory_recovery {
        None => Duration::from_secs(5),
        Some(s) => duration(src, s, "node.memory_recovery")?,
    };
    let sample_every = match &n.sample_every {
        None => Duration::from_secs(2),
        Some(s) => duration(src, s, "node.sample_every")?,
    };
    let cgroups = cgroups(src, n.cgroups.as_ref())?;
    let memory_slack = match &n.memory_slack {
        None => 1_000_000_000,
        Some(q) => bytes(src, q, "node.memory_slack")?,
    };
    let socket_group = n
        .socket_group
        .as_ref()
        .map(|g| socket_group(src, g, host))
        .transpose()?;
    let max_instances = at_least_one(src, n.max_instances.as_ref(), "node.max_instances", 256)?;
    let max_connections =
        at_least_one(src, n.max_connections.as_ref(), "node.max_connections", 512)?;
    let max_connections_per_peer = at_least_one(
        src,
        n.max_connections_per_peer.as_ref(),
        "node.max_connections_per_peer",
        64,
    )?;
    let keepalive_interval = keepalive(
        src,
        n.keepalive_interval.as_ref(),
        "node.keepalive_interval",
        30,
    )?;
    let keepalive_timeout = keepalive(
        src,
        n.keepalive_timeout.as_ref(),
        "node.keepalive_timeout",
        20,
    )?;
    let gpu_choice = gpu_choice(src, n.gpu_choice.as_ref())?;
    let on_overrun = match &n.on_overrun {
        None => OnOverrun::default(),
        Some(s) => on_overrun(src, s, "node.on_overrun")?,
    };
    let access = match &n.access {
        Some(a) if !n.allow_uids.is_empty() || !n.allow_gids.is_empty() => {
            return Err(src.err(
                a.span(),
                "node.access",
                "give either [node.access] or allow_uids / allow_gids (list those callers as operators)",
            ));
        }
        Some(a) => Some(super::access::access(src, a.get_ref(), host)?),
        None => None,
    };
    let run_as = n
        .run_as
        .as_ref()
        .map(|u| user(src, u, "node.run_as", host))
        .transpose()?;
    Ok(NodeConfig {
        name: name.to_string(),
        listen,
        insecure: n.insecure,
        state_dir,
        on_full,
        on_overrun,
        run_as,
        metrics_listen,
        sample_every,
        memory_recovery,
        tls,
        cgroups,
        memory_slack,
        socket_group,
        allow: Allowlist {
            uids: n.allow_uids.clone(),
            gids: n.allow_gids.clone(),
        },
        max_instances,
        max_connections,
        max_connections_per_peer,
        keepalive_interval,
        keepalive_timeout,
        durable_answers: n.durable_answers.unwrap_or(true),
        learn_footprints: n.learn_footprints.unwrap_or(true),
        instances_outlive_agent: n.instances_outlive_agent.unwrap_or(true),
        gpu_choice,
        access,
    })
}

fn gpu_choice(src: &Source<'_>, s: Option<&Spanned<String>>) -> Result<GpuChoice> {
    match s.map(|s| (s, s.get_ref().as_str())) {
        None | Some((_, "binpack")) => Ok(GpuChoice::Binpack),
        Some((_, "spread")) => Ok(GpuChoice::Spread),
        Some((s, other)) => {
            let msg = format!("{other:?} is not a choice (use \"binpack\" or \"spread\")");
            Err(src.err(s.span(), "node.gpu_choice", msg))
        }
    }
}

/// `on_overrun = "account" | "stop"` at `key`.
pub(super) fn on_overrun(src: &Source<'_>, s: &Spanned<String>, key: &str) -> Result<OnOverrun> {
    OnOverrun::parse(s.get_ref()).ok_or_else(|| {
        let msg = format!(
            "{:?} is not a choice (use \"account\" or \"stop\")",
            s.get_ref()
        );
        src.err(s.span(), key, msg)
    })
}

fn on_full(src: &Source<'_>, s: Option<&Spanned<String>>) -> Result<Policy> {
    match s.map(|s| (s, s.get_ref().as_str())) {
        None | Some((_, "refuse")) => Ok(Policy::Refuse),
        Some((_, "evict")) => Ok(Policy::Evict),
        Some((s, other)) => {
            let msg = format!("{other:?} is not a policy (use \"refuse\" or \"evict\")");
            Err(src.err(s.span(), "node.on_full", msg))
        }
    }
}

fn metrics_listen(
    src: &Source<'_>,
    s: Option<&Spanned<String>>,
) -> Result<Option<std::net::SocketAddr>> {
    let Some(s) = s else {
        return Ok(None);
    };
    let addr = s.get_ref().parse().map_err(|_| {
        src.err(
            s.span(),
            "node.metrics_listen",
            format!(
                "{:?} is not an address like \"127.0.0.1:9187\"",
                s.get_ref()
            ),
        )
    })?;
    Ok(Some(addr))
}

fn cgroups(src: &Source<'_>, s: Option<&Spanned<String>>) -> Result<CgroupMode> {
    match s.map(|s| (s, s.get_ref().as_str())) {
        None | Some((_, "auto")) => Ok(CgroupMode::Auto),
        Some((_, "off")) => Ok(CgroupMode::Off),
        Some((s, other)) => {
            let msg = format!("{other:?} is not a cgroup mode (use \"auto\" or \"off\")");
            Err(src.err(s.span(), "node.cgroups", msg))
        }
    }
}

/// The group's name as written, and its gid.
fn socket_group(src: &Source<'_>, g: &Spanned<String>, host: Lookups) -> Result<(String, u32)> {
    let gid = host
        .group(g.get_ref())
        .map_err(|m| src.err(g.span(), "node.socket_group", m))?;
    Ok((g.get_ref().clone(), gid))
}

/// A count that must be at least 1; `default` when not given.
fn at_least_one(
    src: &Source<'_>,
    m: Option<&Spanned<u32>>,
    key: &str,
    default: usize,
) -> Result<usize> {
    match m {
        None => Ok(default),
        Some(m) if *m.get_ref() == 0 => Err(src.err(m.span(), key, "must be at least 1")),
        Some(m) => Ok(*m.get_ref() as usize),
    }
}

/// A keepalive duration: at least 100 ms; `default_s` seconds when not given.
fn keepalive(
    src: &Source<'_>,
    d: Option<&Spanned<String>>,
    key: &str,
    default_s: u64,
) -> Result<Duration> {
    let Some(d) = d else {
        return Ok(Duration::from_secs(default_s));
    };
    let value = duration(src, d, key)?;
    if value < Duration::from_millis(100) {
        return Err(src.err(d.span(), key, "must be at least 100ms"));
    }
    Ok(value)
}
