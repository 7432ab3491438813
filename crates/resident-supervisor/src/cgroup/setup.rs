//! Setup: this supervisor's directory in every writable hierarchy (with the
//! v2 memory controller enabled below the agent's own cgroup where it can
//! be), and the cgroups of each run: made as `slot.N`, given their memory
//! limit, and kept as spares when emptied, for the next run to reuse.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

use super::leftovers::clear_dead_agents;
use super::{BASE_PREFIX, CgroupMode, Hierarchies, RunCgroup, agent_of, make_dir, write};

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
    spare: parking_lot::Mutex<Vec<RunCgroup>>,
    /// Whose runs outlive their agent ("": they do not).
    lineage: String,
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

impl Cgroups {
    /// Sets up this supervisor's directories in every writable hierarchy,
    /// after clearing what dead agents left there. `None` when `mode` is
    /// off or nothing is writable.
    /// With a `lineage` (instances outlive the agent: `super::lineage`
    /// of its state), the directories are named with it, and what dead
    /// agents of the same lineage left is cleared only when the caller
    /// says what it took over (`clear_dead_agents`).
    pub fn setup(mode: CgroupMode, lineage: Option<String>) -> Option<Self> {
        if mode == CgroupMode::Off {
            return None;
        }
        Self::setup_in(&Hierarchies::of_self(), lineage)
    }

    /// As `setup`, in the given hierarchies.
    pub fn setup_in(h: &Hierarchies, lineage: Option<String>) -> Option<Self> {
        static SUPERVISORS: AtomicU64 = AtomicU64::new(0);
        let n = SUPERVISORS.fetch_add(1, Ordering::Relaxed);
        let keep_dead = lineage.is_some();
        let lineage = lineage.unwrap_or_default();
        let tag = if lineage.is_empty() {
            String::new()
        } else {
            format!("{lineage}-")
        };
        let name = format!("{BASE_PREFIX}{tag}{}-{n}", std::process::id());
        let mut v2_memory = false;
        let v2 = h.v2.as_ref().and_then(|own| {
            if !keep_dead {
                clear_dead_agents(own, "", &[], &[]);
            }
            let base = own.join(&name);
            if let Err(e) = make_dir(&base) {
                tracing::debug!(error = %e, "no cgroup v2 directory for instances");
                return None;
            }
            v2_memory = enable_v2_memory(own, &base);
            Some(base)
        });
        let v1_memory = h.v1_memory.as_ref().and_then(|own| {
            if !keep_dead {
                clear_dead_agents(own, "", &[], &[]);
            }
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
            spare: parking_lot::Mutex::new(Vec::new()),
            lineage,
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

    fn spares(&self) -> parking_lot::MutexGuard<'_, Vec<RunCgroup>> {
        self.spare.lock()
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
            counters: Default::default(),
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

    /// Clears what agents that are gone left beside this supervisor's
    /// directories (in the background), except the run cgroups of
    /// processes it took over (`keep`, as `run_of` found them) and any
    /// that holds one of `keep_pids`.
    pub fn clear_dead_agents(&self, keep: &[RunCgroup], keep_pids: &[i32]) {
        let keep: Vec<PathBuf> = keep.iter().flat_map(RunCgroup::dirs).cloned().collect();
        for base in self.bases() {
            if let Some(own) = base.parent() {
                clear_dead_agents(own, &self.lineage, &keep, keep_pids);
            }
        }
    }

    /// The run cgroup that process `pid` is in, when an agent's
    /// supervisor beside this one made it (`residentd-PID-N/slot.K`
    /// below the same cgroup): a process taken over from an agent that
    /// ended keeps its cgroup, and is sampled and stopped through it.
    pub fn run_of(&self, pid: u32) -> Option<RunCgroup> {
        let mounts = fs::read_to_string("/proc/self/mountinfo").ok()?;
        let theirs = fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        let found = Hierarchies::parse(&mounts, &theirs);
        let ours = |dir: Option<PathBuf>, base: Option<&PathBuf>| -> Option<PathBuf> {
            let (dir, base) = (dir?, base?);
            let agent = dir.parent()?;
            let named = agent
                .file_name()?
                .to_str()
                .and_then(|n| agent_of(n, &self.lineage))
                .is_some();
            (named && agent.parent() == base.parent()).then_some(dir)
        };
        let v2 = ours(found.v2, self.v2.as_ref());
        let v1_memory = ours(found.v1_memory, self.v1_memory.as_ref());
        if v2.is_none() && v1_memory.is_none() {
            return None;
        }
        let v2_memory = v2.as_ref().is_some_and(|d| d.join("memory.max").exists());
        let mut run = RunCgroup {
            v2,
            v2_memory,
            v1_memory,
            limit: None,
            oom_base: 0,
            counters: std::sync::Arc::default(),
        };
        run.oom_base = run.oom_count();
        Some(run)
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

#[cfg(test)]
mod tests {
    use super::super::tempfile_dir;
    use super::*;

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
        let cg = Cgroups::setup_in(&h, None).expect("a writable tree");
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
}
