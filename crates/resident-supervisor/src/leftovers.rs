//! What an earlier agent's runs left as process groups (the journal lists
//! them), killed when the next agent does not take them over: the
//! process-group half of clearing leftovers, beside the cgroups' half
//! (`cgroup/leftovers.rs`). Blocking: one scan of /proc.

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use crate::procfs;

/// A process group an earlier run left: its id and its leader's start
/// time (`/proc/PID/stat`), against a reused pid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leftover {
    pub pgid: i32,
    pub start_ticks: u64,
}

/// SIGKILLs what is left of each group, after one scan of the process
/// table; returns how many processes were signalled. A group is the one
/// left when its leader still runs with the recorded start time, or when
/// the leader is gone but members remain (a live group id cannot be
/// reused as a pid).
pub fn kill_leftovers(groups: &[Leftover]) -> usize {
    let table = procfs::scan();
    let mut killed = 0;
    for group in groups {
        if group.pgid <= 1 {
            continue;
        }
        let leader = table.iter().find(|p| p.pid == group.pgid);
        if leader.is_some_and(|l| l.start_ticks != group.start_ticks) {
            continue;
        }
        let members = table
            .iter()
            .filter(|p| p.pgrp == group.pgid && p.state != 'Z')
            .count();
        if members > 0 {
            let _ = killpg(Pid::from_raw(group.pgid), Signal::SIGKILL);
            killed += members;
        }
    }
    killed
}
