//! Per-instance cgroups: containment that `setsid()` cannot escape, a
//! memory limit, and OOM-kill detection.
//!
//! Each run of an instance gets a cgroup of its own below a directory of
//! this supervisor (`residentd-PID-N`, or `residentd-LINEAGE-PID-N` when
//! instances outlive the agent), in every hierarchy the agent can write
//! to:
//!
//! - cgroup v2 (the unified mount, or `/sys/fs/cgroup/unified` on a hybrid
//!   machine): members are listed and killed as one (`cgroup.kill`), and
//!   `cgroup.events` says when the last one is gone. Where the v2 memory
//!   controller can be enabled for the subtree, `memory.max` and
//!   `memory.events` give the limit and OOM kills.
//! - the cgroup v1 memory hierarchy, where memory is still bound to v1
//!   (hybrid machines): `memory.limit_in_bytes` and the `oom_kill` count
//!   of `memory.oom_control`.
//!
//! The child joins its cgroups between clone and exec (it writes `0` to
//! each `cgroup.procs`, descriptors the parent opened), so it never runs a
//! single instruction of the server outside them. Where no hierarchy is
//! writable, or `cgroups = "off"`, instances are contained by process
//! groups only, and the supervisor says so once at start.
//!
//! One room per job: `discover.rs` finds the hierarchies, `setup.rs` makes
//! this supervisor's directories and its runs' cgroups (spares, limits),
//! `leftovers.rs` clears what dead agents left, `run.rs` reads and writes
//! the files of one run. This file holds what they share.

mod discover;
mod leftovers;
mod run;
mod setup;

use std::fs;
use std::io;
use std::path::Path;

pub use discover::Hierarchies;
pub use run::RunCgroup;
pub use setup::{Cgroups, describe};

/// Whether to use cgroups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CgroupMode {
    /// Use every writable hierarchy; process groups where there is none.
    #[default]
    Auto,
    /// Process groups only.
    Off,
}

/// The prefix of every supervisor's directory: `residentd-PID-N`, for the
/// N-th supervisor of process PID, or `residentd-LINEAGE-PID-N` for one
/// whose instances outlive it: LINEAGE names its state (`lineage`), so an
/// agent clears and takes over only what agents of its own state left,
/// never the live instances of another agent's state beside it.
const BASE_PREFIX: &str = "residentd-";

/// The lineage tag of instances that outlive their agent, kept in `state`:
/// `s` and 16 hex digits of a hash of the path (never a number, so it is
/// not read as a pid).
pub fn lineage(state: &Path) -> String {
    // FNV-1a: stable across builds and runs, unlike std's hasher.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in state.as_os_str().as_encoded_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("s{h:016x}")
}

/// The pid of the agent whose directory is `name`, when it is of
/// `lineage` ("": the untagged `residentd-PID-N`).
fn agent_of(name: &str, lineage: &str) -> Option<i32> {
    let rest = name.strip_prefix(BASE_PREFIX)?;
    let rest = if lineage.is_empty() {
        rest
    } else {
        rest.strip_prefix(lineage)?.strip_prefix('-')?
    };
    rest.split('-').next()?.parse().ok()
}

/// `e`, with the path it happened at in its message.
fn at_path(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

fn write(path: &Path, text: &str) -> io::Result<()> {
    fs::write(path, text).map_err(|e| at_path(path, e))
}

fn make_dir(path: &Path) -> io::Result<()> {
    match fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(at_path(path, e)),
    }
}

/// A directory of this test's own (tests run side by side).
#[cfg(test)]
fn tempfile_dir(test: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("resident-cg-{}-{test}", std::process::id()));
    fs::create_dir_all(&d).expect("temp dir");
    d
}
