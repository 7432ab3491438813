//! Clearing what dead agents left: the `residentd-PID-N` directories of a
//! PID that is gone, their runs' processes killed and their cgroups
//! removed, when a supervisor sets up its cgroups.

use std::fs;
use std::path::Path;
use std::time::Duration;

use super::{BASE_PREFIX, RunCgroup};

/// Kills and removes what agents that are gone left below `own`.
pub(super) fn clear_dead_agents(own: &Path) {
    let Ok(entries) = fs::read_dir(own) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(BASE_PREFIX))
            .and_then(|rest| rest.split('-').next()?.parse::<i32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() as i32 || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let base = entry.path();
        let runs = fs::read_dir(&base).into_iter().flatten().flatten();
        for run in runs.filter(|r| r.path().is_dir()) {
            let left = RunCgroup::at(run.path());
            let killed = left.members().len();
            left.kill_all();
            if !left.wait_empty(Duration::from_secs(2)) {
                tracing::warn!(cgroup = %run.path().display(), "a dead agent's instance would not die");
            }
            left.remove();
            if killed > 0 {
                tracing::info!(cgroup = %run.path().display(), processes = killed, "killed what a dead agent left in an instance cgroup");
            }
        }
        let _ = fs::remove_dir(&base);
    }
}
