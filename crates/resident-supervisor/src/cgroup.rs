//! Per-instance cgroups: containment that `setsid()` cannot escape, a
//! memory limit, and OOM-kill detection.
//!
//! Each run of an instance gets a cgroup of its own below a directory of
//! this supervisor (`residentd-PID-N`), in every hierarchy the agent can write
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

use std::fs;
use std::io;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

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
/// N-th supervisor of process PID.
const BASE_PREFIX: &str = "residentd-";

/// Where the cgroup hierarchies of this process are.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Hierarchies {
    /// This process's own cgroup in the v2 hierarchy.
    pub v2: Option<PathBuf>,
    /// This process's own cgroup in the v1 memory hierarchy.
    pub v1_memory: Option<PathBuf>,
}

impl Hierarchies {
    /// Reads `/proc/self/mountinfo` and `/proc/self/cgroup`.
    pub fn of_self() -> Self {
        let mounts = fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let own = fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
        Self::parse(&mounts, &own)
    }

    /// Finds the hierarchies from the texts of `mountinfo` and `cgroup`.
    pub fn parse(mountinfo: &str, cgroup: &str) -> Self {
        let mut out = Self::default();
        for line in mountinfo.lines() {
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            let fields: Vec<&str> = left.split(' ').collect();
            let theirs: Vec<&str> = right.split(' ').collect();
            let (Some(root), Some(point), Some(fstype)) =
                (fields.get(3), fields.get(4), theirs.first())
            else {
                continue;
            };
            let options = theirs.get(2).copied().unwrap_or("");
            let own_path = |matches: &dyn Fn(&str) -> bool| {
                cgroup.lines().find_map(|l| {
                    let mut parts = l.splitn(3, ':');
                    let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
                    matches(controllers).then(|| path.to_string())
                })
            };
            let dir = |path: String| {
                let rel = path.strip_prefix(root).unwrap_or(&path).trim_matches('/');
                let dir = PathBuf::from(point);
                if rel.is_empty() { dir } else { dir.join(rel) }
            };
            if *fstype == "cgroup2" && out.v2.is_none() {
                out.v2 = own_path(&|c| c.is_empty()).map(dir);
            } else if *fstype == "cgroup"
                && out.v1_memory.is_none()
                && options.split(',').any(|o| o == "memory")
            {
                out.v1_memory = own_path(&|c| c.split(',').any(|x| x == "memory")).map(dir);
            }
        }
        out
    }
}

/// A supervisor's cgroup directories, one per usable hierarchy.
#[derive(Debug)]
pub struct Cgroups {
    v2: Option<PathBuf>,
    /// Whether `memory.max` is available below `v2`.
    v2_memory: bool,
    v1_memory: Option<PathBuf>,
    next: AtomicU64,
    /// Emptied run cgroups kept for the next runs: making and removing a
    /// cgroup costs the kernel far more than a spawn does.
    spare: std::sync::Mutex<Vec<RunCgroup>>,
}

/// At most this many emptied cgroups are kept for reuse.
const SPARES: usize = 256;

/// A one-line description of how instances are contained.
pub fn describe(c: Option<&Cgroups>) -> String {
    let Some(c) = c else {
        return "process groups only (no writable cgroup hierarchy, or cgroups = \"off\")".into();
    };
    let mut parts = Vec::new();
    if let Some(v2) = &c.v2 {
        let mem = if c.v2_memory {
            "with memory.max"
        } else {
            "no memory controller"
        };
        parts.push(format!("cgroup v2 at {} ({mem})", v2.display()));
    }
    if let Some(v1) = &c.v1_memory {
        parts.push(format!("cgroup v1 memory at {}", v1.display()));
    }
    format!("per-instance cgroups: {}", parts.join(", "))
}

fn write(path: &Path, text: &str) -> io::Result<()> {
    fs::write(path, text).map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
}

fn make_dir(path: &Path) -> io::Result<()> {
    match fs::create_dir(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(io::Error::new(e.kind(), format!("{}: {e}", path.display()))),
    }
}

impl Cgroups {
    /// Sets up this supervisor's directories in every writable hierarchy,
    /// after clearing what dead agents left there. `None` when `mode` is
    /// off or nothing is writable.
    pub fn setup(mode: CgroupMode) -> Option<Self> {
        if mode == CgroupMode::Off {
            return None;
        }
        Self::setup_in(&Hierarchies::of_self())
    }

    /// As `setup`, in the given hierarchies.
    pub fn setup_in(h: &Hierarchies) -> Option<Self> {
        static SUPERVISORS: AtomicU64 = AtomicU64::new(0);
        let n = SUPERVISORS.fetch_add(1, Ordering::Relaxed);
        let name = format!("{BASE_PREFIX}{}-{n}", std::process::id());
        let mut v2_memory = false;
        let v2 = h.v2.as_ref().and_then(|own| {
            clear_dead_agents(own);
            let base = own.join(&name);
            if let Err(e) = make_dir(&base) {
                tracing::debug!(error = %e, "no cgroup v2 directory for instances");
                return None;
            }
            v2_memory = enable_v2_memory(own, &base);
            Some(base)
        });
        let v1_memory = h.v1_memory.as_ref().and_then(|own| {
            clear_dead_agents(own);
            let base = own.join(&name);
            match make_dir(&base) {
                Ok(()) => Some(base),
                Err(e) => {
                    tracing::debug!(error = %e, "no cgroup v1 memory directory for instances");
                    None
                }
            }
        });
        if v2.is_none() && v1_memory.is_none() {
            return None;
        }
        Some(Self {
            v2,
            v2_memory,
            v1_memory,
            next: AtomicU64::new(0),
            spare: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Whether a memory limit can be set.
    pub fn limits_memory(&self) -> bool {
        self.v2_memory || self.v1_memory.is_some()
    }

    /// The directories of this supervisor.
    fn bases(&self) -> impl Iterator<Item = &PathBuf> {
        self.v2.iter().chain(self.v1_memory.iter())
    }

    fn spares(&self) -> std::sync::MutexGuard<'_, Vec<RunCgroup>> {
        self.spare.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The cgroups of one run, with memory `limit`: an emptied one of an
    /// earlier run when there is one, else new ones (`slot.N`).
    pub fn create(&self, limit: Option<u64>) -> io::Result<RunCgroup> {
        let spare = self.spares().pop();
        let mut run = match spare {
            // The same limit as its last run: nothing to write.
            Some(run) if run.limit == limit => {
                let mut run = run;
                run.oom_base = run.oom_count();
                return Ok(run);
            }
            Some(run) => run,
            None => self.make()?,
        };
        run.limit = limit;
        if let (Some(dir), true) = (&run.v2, self.v2_memory) {
            let max = limit.map_or_else(|| "max".to_string(), |b| b.to_string());
            write(&dir.join("memory.max"), &max)?;
        }
        if let Some(dir) = &run.v1_memory {
            let max = limit.map_or_else(|| "-1".to_string(), |b| b.to_string());
            write(&dir.join("memory.limit_in_bytes"), &max)?;
        }
        run.oom_base = run.oom_count();
        Ok(run)
    }

    /// Whether an emptied cgroup waits for reuse (then `create` makes no
    /// directory and is quick enough to call from async code).
    pub fn has_spare(&self) -> bool {
        !self.spares().is_empty()
    }

    fn make(&self) -> io::Result<RunCgroup> {
        let name = format!("slot.{}", self.next.fetch_add(1, Ordering::Relaxed));
        let mut run = RunCgroup {
            v2: None,
            v2_memory: self.v2_memory,
            v1_memory: None,
            limit: None,
            oom_base: 0,
        };
        if let Some(base) = &self.v2 {
            let dir = base.join(&name);
            make_dir(&dir)?;
            if self.v2_memory {
                // One OOM kill takes the whole instance, not a random helper.
                let _ = write(&dir.join("memory.oom.group"), "1");
            }
            run.v2 = Some(dir);
        }
        if let Some(base) = &self.v1_memory {
            let dir = base.join(&name);
            make_dir(&dir)?;
            run.v1_memory = Some(dir);
        }
        Ok(run)
    }

    /// Takes back the cgroups of a run whose processes are all gone (the
    /// caller may know they are: `known_empty`), for reuse; removes them
    /// when enough are spare, or tries to when one is not empty.
    pub fn recycle(&self, run: &RunCgroup, known_empty: bool) {
        let mut spares = self.spares();
        if spares.len() < SPARES && (known_empty || !run.populated()) {
            spares.push(run.clone());
        } else {
            drop(spares);
            run.remove();
        }
    }

    /// Removes this supervisor's directories (each must be empty), saying
    /// so when one cannot go.
    pub fn remove(&self) {
        self.remove_dirs(true);
    }

    fn remove_dirs(&self, loud: bool) {
        let spares = std::mem::take(&mut *self.spares());
        let dirs = spares.iter().flat_map(RunCgroup::dirs).chain(self.bases());
        for dir in dirs {
            if let Err(e) = fs::remove_dir(dir)
                && loud
                && e.kind() != io::ErrorKind::NotFound
            {
                tracing::warn!(cgroup = %dir.display(), error = %e, "cannot remove a cgroup");
            }
        }
    }
}

impl Drop for Cgroups {
    fn drop(&mut self) {
        // Quietly: a supervisor dropped without a shutdown may still have
        // runs; the next agent clears those.
        self.remove_dirs(false);
    }
}

/// Enables the v2 memory controller for `base`'s children. The agent's own
/// cgroup may hold processes only while no controller is enabled below it
/// ("no internal processes"), so the agent first moves into a leaf of its
/// own (`agent`).
fn enable_v2_memory(own: &Path, base: &Path) -> bool {
    let offers = |dir: &Path| {
        fs::read_to_string(dir.join("cgroup.controllers"))
            .is_ok_and(|c| c.split_whitespace().any(|x| x == "memory"))
    };
    if !offers(own) {
        return false;
    }
    let control = own.join("cgroup.subtree_control");
    if write(&control, "+memory").is_err() {
        let leaf = own.join("agent");
        let moved = make_dir(&leaf).and_then(|()| write(&leaf.join("cgroup.procs"), "0"));
        if let Err(e) = moved.and_then(|()| write(&control, "+memory")) {
            tracing::debug!(error = %e, "cannot enable the v2 memory controller");
            return false;
        }
    }
    write(&base.join("cgroup.subtree_control"), "+memory").is_ok()
}

/// Kills and removes what agents that are gone left below `own`.
fn clear_dead_agents(own: &Path) {
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

/// The cgroups of one run of an instance.
#[derive(Debug, Clone)]
pub struct RunCgroup {
    v2: Option<PathBuf>,
    v2_memory: bool,
    v1_memory: Option<PathBuf>,
    limit: Option<u64>,
    /// OOM kills counted before this run (a reused cgroup keeps its count).
    oom_base: u64,
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
    fn at(dir: PathBuf) -> Self {
        let v2 = dir.join("cgroup.kill").exists() || dir.join("cgroup.events").exists();
        Self {
            v2: v2.then(|| dir.clone()),
            v2_memory: false,
            v1_memory: (!v2).then_some(dir),
            limit: None,
            oom_base: 0,
        }
    }

    fn dirs(&self) -> impl Iterator<Item = &PathBuf> {
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
                    .map_err(|e| io::Error::new(e.kind(), format!("{}: {e}", path.display())))
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
    fn oom_count(&self) -> u64 {
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
    use super::*;

    #[test]
    fn finds_both_hierarchies_of_a_hybrid_machine() {
        let mountinfo = "\
30 25 0:26 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755
35 30 0:31 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
36 30 0:32 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 30 0:37 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw";
        let cgroup = "4:memory:/box/a1\n1:cpu:/\n0::/svc/agent.service\n";
        let h = Hierarchies::parse(mountinfo, cgroup);
        assert_eq!(
            h.v2.as_deref(),
            Some(Path::new("/sys/fs/cgroup/unified/svc/agent.service"))
        );
        assert_eq!(
            h.v1_memory.as_deref(),
            Some(Path::new("/sys/fs/cgroup/memory/box/a1"))
        );
    }

    #[test]
    fn a_namespaced_mount_root_is_stripped() {
        let mountinfo = "50 40 0:40 /kubepods/pod1 /sys/fs/cgroup rw - cgroup2 cgroup2 rw";
        let h = Hierarchies::parse(mountinfo, "0::/kubepods/pod1/c\n");
        assert_eq!(h.v2.as_deref(), Some(Path::new("/sys/fs/cgroup/c")));
        assert_eq!(h.v1_memory, None);
        let root = Hierarchies::parse(mountinfo, "0::/kubepods/pod1\n");
        assert_eq!(root.v2.as_deref(), Some(Path::new("/sys/fs/cgroup")));
    }

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

    #[test]
    fn a_v2_tree_with_the_memory_controller_gets_limits() {
        // A stand-in for a delegated cgroup v2 directory (no machine here
        // has the v2 memory controller): plain files where the kernel would
        // have interface files, so the writes can be read back.
        let own = tempfile_dir("v2").join("delegated");
        fs::create_dir_all(&own).expect("own");
        fs::write(own.join("cgroup.controllers"), "cpu io memory pids\n").expect("write");
        fs::write(own.join("cgroup.subtree_control"), "").expect("write");
        let h = Hierarchies {
            v2: Some(own.clone()),
            v1_memory: None,
        };
        let cg = Cgroups::setup_in(&h).expect("a writable tree");
        assert!(cg.limits_memory(), "{}", describe(Some(&cg)));
        let base = cg.v2.clone().expect("a v2 base");
        let read = |p: &Path| fs::read_to_string(p).expect("read");
        assert_eq!(read(&own.join("cgroup.subtree_control")), "+memory");
        assert_eq!(read(&base.join("cgroup.subtree_control")), "+memory");
        let run = cg.create(Some(128 << 20)).expect("a run cgroup");
        let dir = run.v2.clone().expect("v2 dir");
        assert_eq!(read(&dir.join("memory.max")), (128u64 << 20).to_string());
        assert_eq!(read(&dir.join("memory.oom.group")), "1");
        // The kernel's memory.events, as an OOM kill leaves it.
        fs::write(
            dir.join("memory.events"),
            "low 0\nhigh 0\nmax 9\noom 1\noom_kill 1\n",
        )
        .expect("write");
        assert_eq!(run.oom_kills(), 1);
        assert_eq!(run.limit(), Some(128 << 20));
        // Reused for a run without a limit: the limit is lifted, and the
        // earlier OOM kill is not this run's.
        fs::write(dir.join("cgroup.events"), "populated 0\nfrozen 0\n").expect("write");
        cg.recycle(&run, true);
        let again = cg.create(None).expect("the spare");
        assert_eq!(again.v2, run.v2, "the emptied cgroup is reused");
        assert_eq!(read(&dir.join("memory.max")), "max");
        assert_eq!(again.oom_kills(), 0);
        let _ = fs::remove_dir_all(tempfile_dir("v2"));
    }

    /// A directory of this test's own (tests run side by side).
    fn tempfile_dir(test: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("resident-cg-{}-{test}", std::process::id()));
        fs::create_dir_all(&d).expect("temp dir");
        d
    }
}
