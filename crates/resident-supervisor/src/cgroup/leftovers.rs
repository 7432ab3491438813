//! Clearing what dead agents left: the `residentd-PID-N` directories of a
//! PID that is gone (of this supervisor's lineage only: another state's
//! instances may outlive their agent and be another live agent's), their
//! runs' processes killed and their cgroups removed, in the background
//! from when a supervisor sets up its cgroups, or once it has taken over
//! what it takes over.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{RunCgroup, agent_of};

/// Kills and removes what agents that are gone left below `own`, on a
/// thread of its own: a new agent does not wait for it to serve. Every
/// leftover run is killed first and only then waited for, so clearing 200
/// runs costs about one wait, not 200 in a row. The run cgroups in `keep`
/// (of processes taken over) are left alone, and so is their agent's
/// directory while it holds them.
pub(super) fn clear_dead_agents(own: &Path, lineage: &str, keep: &[PathBuf], keep_pids: &[i32]) {
    let dead = dead_agents(own, lineage);
    if dead.is_empty() {
        return;
    }
    let (keep, keep_pids) = (keep.to_vec(), keep_pids.to_vec());
    let spawned = std::thread::Builder::new()
        .name("resident-leftovers".into())
        .spawn(move || clear(&dead, &keep, &keep_pids));
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot clear a dead agent's cgroups");
    }
}

/// The directories of `lineage` below `own` of an agent PID that is gone.
fn dead_agents(own: &Path, lineage: &str) -> Vec<PathBuf> {
    let Ok(entries) = fs::read_dir(own) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|entry| {
            let name = entry.file_name();
            let pid = name.to_str().and_then(|n| agent_of(n, lineage));
            pid.is_some_and(|pid| {
                pid != std::process::id() as i32 && !Path::new(&format!("/proc/{pid}")).exists()
            })
        })
        .map(|entry| entry.path())
        .collect()
}

/// Kills and removes the run cgroups below `dead` but those in `keep`
/// and any that holds a process of `keep_pids` (taken over, whichever
/// hierarchy its cgroup was found in).
fn clear(dead: &[PathBuf], keep: &[PathBuf], keep_pids: &[i32]) {
    let runs: Vec<(PathBuf, RunCgroup, usize)> = dead
        .iter()
        .flat_map(|base| fs::read_dir(base).into_iter().flatten().flatten())
        .filter(|r| r.path().is_dir() && !keep.contains(&r.path()))
        .filter_map(|run| {
            let left = RunCgroup::at(run.path());
            let members = left.members();
            if members.iter().any(|p| keep_pids.contains(p)) {
                return None;
            }
            left.kill_all();
            Some((run.path(), left, members.len()))
        })
        .collect();
    for (path, left, killed) in runs {
        if !left.wait_empty(Duration::from_secs(2)) {
            tracing::warn!(cgroup = %path.display(), "a dead agent's instance would not die");
        }
        left.remove();
        if killed > 0 {
            tracing::info!(cgroup = %path.display(), processes = killed, "killed what a dead agent left in an instance cgroup");
        }
    }
    for base in dead {
        let _ = fs::remove_dir(base);
    }
}
