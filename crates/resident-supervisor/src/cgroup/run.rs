//! The files of one run's cgroups: the `cgroup.procs` descriptors the
//! child writes itself into, its members, `cgroup.kill` (or SIGKILL member
//! by member on v1), `cgroup.events`, and the OOM-kill counts of
//! `memory.events` (v2) and `memory.oom_control` (v1). The counter files
//! are opened once per cgroup and read in place (one `pread`): every start
//! and stop reads them, and a reused cgroup keeps them open.

use std::fs::{self, File};
use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;

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
    /// The counter files, opened at their first read (shared by the
    /// clones of one cgroup).
    pub(super) counters: Arc<Counters>,
}

/// A cgroup's counter files, each opened at its first read.
#[derive(Debug, Default)]
pub(super) struct Counters {
    events: Counter,
    memory_events: Counter,
    oom_control: Counter,
}

/// One counter file, kept open once opened (an open that fails is tried
/// again at the next read).
#[derive(Debug, Default)]
struct Counter(Mutex<Option<File>>);

impl Counter {
    /// The value of `key` in the file at `path` (`key value` lines, the
    /// path made only when the file is not open yet); 0 when the file or
    /// the key cannot be read.
    fn read(&self, path: impl FnOnce() -> PathBuf, key: &str) -> u64 {
        let mut file = self.0.lock();
        if file.is_none() {
            *file = File::open(path()).ok();
        }
        let Some(f) = file.as_ref() else {
            return 0;
        };
        // These files are a few short lines; a seq file read from 0 is
        // generated afresh.
        let mut buf = [0u8; 1024];
        let n = f.read_at(&mut buf, 0).unwrap_or(0);
        std::str::from_utf8(&buf[..n]).map_or(0, |t| count_in(t, key))
    }
}

/// The value of `key` in `key value` lines; 0 when absent.
fn count_in(text: &str, key: &str) -> u64 {
    text.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(' ')?;
            (k == key).then(|| v.trim().parse().ok())?
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
            counters: Arc::default(),
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
            Some(v2) => {
                let events = &self.counters.events;
                events.read(|| v2.join("cgroup.events"), "populated") > 0
            }
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
        let c = &self.counters;
        let v2 = self.v2.as_ref().filter(|_| self.v2_memory).map_or(0, |d| {
            c.memory_events.read(|| d.join("memory.events"), "oom_kill")
        });
        let v1 = self.v1_memory.as_ref().map_or(0, |d| {
            c.oom_control
                .read(|| d.join("memory.oom_control"), "oom_kill")
        });
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
    fn counts_are_read_by_key_and_read_again_in_place() {
        let dir = tempfile_dir("counts");
        let f = dir.join("memory.events");
        fs::write(&f, "low 0\nhigh 0\nmax 3\noom 1\noom_kill 2\n").expect("write");
        let c = Counter::default();
        assert_eq!(c.read(|| f.clone(), "oom_kill"), 2);
        assert_eq!(c.read(|| f.clone(), "oom"), 1);
        assert_eq!(c.read(|| f.clone(), "missing"), 0);
        // The same file, changed: the open file reads what it holds now.
        fs::write(&f, "oom 1\noom_kill 5\n").expect("write");
        assert_eq!(c.read(|| f.clone(), "oom_kill"), 5);
        // A file that cannot be opened reads 0, and is opened once it can.
        let later = Counter::default();
        let missing = dir.join("cgroup.events");
        assert_eq!(later.read(|| missing.clone(), "populated"), 0);
        fs::write(&missing, "populated 1\nfrozen 0\n").expect("write");
        assert_eq!(later.read(|| missing.clone(), "populated"), 1);
        let _ = fs::remove_dir_all(dir);
    }
}
