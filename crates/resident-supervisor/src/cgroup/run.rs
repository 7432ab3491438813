//! The files of one run's cgroups: the `cgroup.procs` descriptors the
//! child writes itself into, its members, `cgroup.kill` (or SIGKILL member
//! by member on v1), `cgroup.events`, and the OOM-kill counts of
//! `memory.events` (v2) and `memory.oom_control` (v1).

use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use super::{at_path, write};

/// The cgroups of one run of an instance.
#[derive(Debug, Clone)]
pub struct RunCgroup {
    pub(super) v2: Option<PathBuf>,
    /// Whether `memory.max` is available below `v2`.
    pub(super) v2_memory: bool,
    pub(super) v1_memory: Option<PathBuf>,
    pub(super) limit: Option<u64>,
    /// OOM kills counted before this run (a reused cgroup keeps its count).
    pub(super) oom_base: u64,
}

fn read_count(path: &Path, key: &str) -> u64 {
    fs::read_to_string(path)
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                let (k, v) = l.split_once(' ')?;
                (k == key).then(|| v.trim().parse().ok())?
            })
        })
        .unwrap_or(0)
}

impl RunCgroup {
    /// A run cgroup found on disk (in a v2 or v1 hierarchy).
    pub(super) fn at(dir: PathBuf) -> Self {
        let v2 = dir.join("cgroup.kill").exists() || dir.join("cgroup.events").exists();
        Self {
            v2: v2.then(|| dir.clone()),
            v2_memory: false,
            v1_memory: (!v2).then_some(dir),
            limit: None,
            oom_base: 0,
        }
    }

    pub(super) fn dirs(&self) -> impl Iterator<Item = &PathBuf> {
        self.v2.iter().chain(self.v1_memory.iter())
    }

    /// The memory limit set, if any.
    pub fn limit(&self) -> Option<u64> {
        self.limit
            .filter(|_| self.v2_memory || self.v1_memory.is_some())
    }

    /// The `cgroup.procs` files, opened for the child to write itself into.
    pub fn procs_files(&self) -> io::Result<Vec<OwnedFd>> {
        self.dirs()
            .map(|d| {
                let path = d.join("cgroup.procs");
                fs::OpenOptions::new()
                    .write(true)
                    .open(&path)
                    .map(OwnedFd::from)
                    .map_err(|e| at_path(&path, e))
            })
            .collect()
    }

    /// The `cgroup.procs` that lists the run's processes.
    pub fn procs_path(&self) -> Option<PathBuf> {
        self.dirs().next().map(|d| d.join("cgroup.procs"))
    }

    /// Every process in the run's cgroup (wherever it moved its group or
    /// session to).
    pub fn members(&self) -> Vec<i32> {
        let Some(procs) = self.procs_path() else {
            return Vec::new();
        };
        fs::read_to_string(procs)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect()
    }

    /// SIGKILL to every member: `cgroup.kill` on v2 (which no fork can
    /// race), member by member on v1.
    pub fn kill_all(&self) {
        if let Some(v2) = &self.v2
            && write(&v2.join("cgroup.kill"), "1").is_ok()
        {
            return;
        }
        for pid in self.members() {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }

    /// Whether any process is left.
    pub fn populated(&self) -> bool {
        match &self.v2 {
            Some(v2) => read_count(&v2.join("cgroup.events"), "populated") > 0,
            None => !self.members().is_empty(),
        }
    }

    /// Kills until empty, waiting at most `bound`; true when empty.
    pub fn wait_empty(&self, bound: Duration) -> bool {
        let deadline = std::time::Instant::now() + bound;
        let mut pause = Duration::from_micros(200);
        while self.populated() {
            self.kill_all();
            if std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
        true
    }

    /// OOM kills inside this run so far.
    pub fn oom_kills(&self) -> u64 {
        self.oom_count().saturating_sub(self.oom_base)
    }

    /// OOM kills the cgroups have counted since they were made.
    pub(super) fn oom_count(&self) -> u64 {
        let v2 = self
            .v2
            .as_ref()
            .filter(|_| self.v2_memory)
            .map_or(0, |d| read_count(&d.join("memory.events"), "oom_kill"));
        let v1 = self
            .v1_memory
            .as_ref()
            .map_or(0, |d| read_count(&d.join("memory.oom_control"), "oom_kill"));
        v2.max(v1)
    }

    /// Removes the run's directories (they must be empty).
    pub fn remove(&self) {
        for dir in self.dirs() {
            if let Err(e) = fs::remove_dir(dir) {
                tracing::warn!(cgroup = %dir.display(), error = %e, "cannot remove an instance cgroup");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tempfile_dir;
    use super::*;

    #[test]
    fn counts_are_read_by_key() {
        let dir = tempfile_dir("counts");
        let f = dir.join("memory.events");
        fs::write(&f, "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n").expect("write");
        assert_eq!(read_count(&f, "oom_kill"), 2);
        assert_eq!(read_count(&f, "oom"), 1);
        assert_eq!(read_count(&f, "missing"), 0);
        let _ = fs::remove_dir_all(dir);
    }
}
