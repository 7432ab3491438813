//! Whether per-instance cgroups could contain instances on this machine.
//!
//! Process groups are what residentd contains children with today. A child
//! that calls `setsid()` escapes its group; only a cgroup v2 subtree
//! delegated to the agent would contain it for sure (and give `memory.max`
//! and OOM events). This module detects that and says once, at start, what
//! the agent will use.

use std::sync::Once;

/// What the machine offers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupSupport {
    /// `/sys/fs/cgroup` is not a cgroup v2 mount (v1 or a hybrid).
    NotUnified,
    /// cgroup v2, but the agent's own cgroup is not writable to it.
    NotDelegated(String),
    /// cgroup v2 with a writable subtree at this path.
    Delegated(String),
}

/// Detects what the machine offers.
pub fn detect() -> CgroupSupport {
    let unified = nix::sys::statfs::statfs("/sys/fs/cgroup")
        .map(|s| s.filesystem_type() == nix::sys::statfs::CGROUP2_SUPER_MAGIC)
        .unwrap_or(false);
    if !unified {
        return CgroupSupport::NotUnified;
    }
    let own = std::fs::read_to_string("/proc/self/cgroup")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("0::").map(str::to_string))
        })
        .unwrap_or_else(|| "/".into());
    let dir = format!("/sys/fs/cgroup{}", own.trim_end_matches('/'));
    let writable = nix::unistd::access(
        format!("{dir}/cgroup.subtree_control").as_str(),
        nix::unistd::AccessFlags::W_OK,
    )
    .is_ok();
    if writable {
        CgroupSupport::Delegated(dir)
    } else {
        CgroupSupport::NotDelegated(dir)
    }
}

/// Logs once per process how instances are contained.
pub fn report_once() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| match detect() {
        CgroupSupport::NotUnified => tracing::info!(
            "cgroup v2 is not mounted at /sys/fs/cgroup (v1 or hybrid): instances are contained by process groups"
        ),
        CgroupSupport::NotDelegated(dir) => tracing::info!(
            cgroup = %dir,
            "cgroup v2 subtree is not delegated to the agent: instances are contained by process groups"
        ),
        CgroupSupport::Delegated(dir) => tracing::info!(
            cgroup = %dir,
            "cgroup v2 is delegated, but per-instance cgroups are not implemented yet: instances are contained by process groups"
        ),
    });
}
