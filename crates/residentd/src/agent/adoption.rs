//! What Adopt checks of a server someone else started, a room with walls
//! (it imports nothing of the agent): the process alive (and, for a
//! journaled adoption, the one that started then), adoptable by the
//! caller (for one without the admin role, the workload's own program
//! running as the workload's user: `may_adopt`), its port found from its
//! listening sockets when the call does not give one, and its present
//! memory, counted as already touched. `admission.rs` then admits it
//! under the refuse policy (nothing is evicted for a process that is
//! already there) and hands it to the supervisor, whose watch releases it
//! at its exit like any run's end. The journal keeps it, with its start
//! time, so the next agent re-adopts it if it still runs.

use std::collections::BTreeMap;

use resident_api::ApiError;
use resident_core::{InstanceId, PoolName};
use resident_supervisor::{Readiness, procfs};

/// An Adopt as asked.
#[derive(Debug, Clone)]
pub struct AdoptCall {
    /// The roster workload (or alias) it is an instance of.
    pub workload: String,
    /// Its instance id.
    pub id: InstanceId,
    /// The running process.
    pub pid: u32,
    /// Whether the agent may signal it.
    pub manage: bool,
    /// Its readiness port; 0: found from its listening sockets.
    pub port: u16,
    /// Whether the caller holds the admin role: an operator may adopt only
    /// a process that runs the workload's own program as the workload's
    /// user (`may_adopt`).
    pub admin: bool,
}

/// What an Adopt found of its process.
#[derive(Debug)]
pub(super) struct Looked {
    /// Its /proc/PID/stat.
    pub stat: procfs::ProcStat,
    /// Its readiness port.
    pub port: u16,
    /// What it holds now, by pool.
    pub present: BTreeMap<PoolName, u64>,
}

/// The process `pid` (started at `start_ticks`, when given), checked as
/// an instance of `w` for a caller (`admin` or not): alive, adoptable by
/// that caller, its port (`port`, or the one it listens on) and what it
/// holds. Reads /proc: runs on a blocking thread.
#[allow(clippy::disallowed_methods)]
pub(super) fn look_at(
    pid: u32,
    start_ticks: Option<u64>,
    w: &resident_config::Workload,
    config: &resident_config::Config,
    port: u16,
    admin: bool,
) -> Result<Looked, ApiError> {
    let stat = procfs::stat(pid as i32)
        .filter(|s| s.state != 'Z' && s.state != 'X')
        .filter(|s| start_ticks.is_none_or(|t| t == s.start_ticks))
        .ok_or_else(|| ApiError::NotFound(format!("no process {pid} to adopt")))?;
    may_adopt(w, &config.node, pid, admin)?;
    let port = match port {
        0 => discovered_port(pid, &w.readiness)?,
        p => p,
    };
    let present = present_bytes(config, &w.spec, &stat);
    Ok(Looked {
        stat,
        port,
        present,
    })
}

/// Whether the caller may adopt `pid` as an instance of `w`: an admin
/// may adopt any process; an operator (who may run the node's models,
/// and with `manage` stop what it adopts) only one that runs the
/// workload's own program as the user the workload runs as. Otherwise
/// PERMISSION_DENIED naming what did not match. Reads /proc: called by
/// `look_at`, on a blocking thread.
#[allow(clippy::disallowed_methods)]
fn may_adopt(
    w: &resident_config::Workload,
    node: &resident_config::NodeConfig,
    pid: u32,
    admin: bool,
) -> Result<(), ApiError> {
    if admin {
        return Ok(());
    }
    let mut unlike = Vec::new();
    let program = w.argv.first().map(String::as_str).unwrap_or("");
    let path = std::env::var("PATH").ok();
    let want =
        resident_supervisor::find_program(program, path.as_deref()).and_then(std::fs::canonicalize);
    let exe = std::fs::read_link(format!("/proc/{pid}/exe"));
    match (&want, &exe) {
        (Ok(want), Ok(exe)) if want == exe => {}
        (Ok(want), Ok(exe)) => unlike.push(format!(
            "it runs {}, not the workload's program {}",
            exe.display(),
            want.display()
        )),
        (Err(e), _) => unlike.push(format!(
            "the workload's program {program:?} cannot be resolved ({e})"
        )),
        (_, Err(e)) => unlike.push(format!("its program cannot be read ({e})")),
    }
    let user = w.run_as.as_ref().or(node.run_as.as_ref());
    let want_uid = user.map_or_else(|| nix::unistd::geteuid().as_raw(), |u| u.uid);
    match procfs::uids(pid as i32) {
        Some((real, effective)) if real == want_uid && effective == want_uid => {}
        Some((real, effective)) => unlike.push(format!(
            "it runs as uid {real} (effective {effective}), not the workload's uid {want_uid}"
        )),
        None => unlike.push("its user cannot be read".into()),
    }
    if unlike.is_empty() {
        return Ok(());
    }
    Err(ApiError::PermissionDenied(format!(
        "adopting pid {pid} as workload '{}' needs the admin role: {}",
        w.spec.workload,
        unlike.join("; ")
    )))
}

/// The port a readiness probe reaches: the one TCP port the process
/// listens on (with no probe, the lowest, or 0 for none).
fn discovered_port(pid: u32, readiness: &Readiness) -> Result<u16, ApiError> {
    let mut ports: Vec<u16> = super::exposure::listeners_of(pid as i32)
        .iter()
        .map(|a| a.port())
        .collect();
    ports.dedup();
    if *readiness == Readiness::None {
        // Nothing is probed: the port is only shown.
        return Ok(ports.first().copied().unwrap_or(0));
    }
    match ports.as_slice() {
        [one] => Ok(*one),
        [] => Err(ApiError::FailedPrecondition(format!(
            "pid {pid} listens on no TCP port; give the port its readiness probe reaches"
        ))),
        many => {
            let list: Vec<String> = many.iter().map(u16::to_string).collect();
            Err(ApiError::FailedPrecondition(format!(
                "pid {pid} listens on ports {}; give the one its readiness probe reaches",
                list.join(", ")
            )))
        }
    }
}

/// What the process already holds, for the first host-memory pool its
/// workload declares: its group's resident bytes when it leads its group,
/// its own otherwise. (A device pool's share is not known here; the
/// device's probe shows it as foreign use until the agent's own reading
/// counts it.)
#[allow(clippy::disallowed_methods)] // called by `look_at`, on a blocking thread
fn present_bytes(
    config: &resident_config::Config,
    spec: &resident_core::Spec,
    stat: &procfs::ProcStat,
) -> BTreeMap<PoolName, u64> {
    let pool = spec.demand.keys().find(|name| {
        config
            .pools
            .iter()
            .any(|p| p.pool.name == **name && p.device.is_none())
    });
    let Some(pool) = pool else {
        return BTreeMap::new();
    };
    let bytes = if stat.pgrp == stat.pid {
        procfs::group_rss(&[stat.pid])
            .get(&stat.pid)
            .copied()
            .unwrap_or(0)
    } else {
        stat.rss_pages * procfs::page_size()
    };
    BTreeMap::from([(pool.clone(), bytes)])
}
