//! The disk pools' books: every saved state is a resident of one ledger
//! (`resident_core::NodeState`, one pool per disk pool), entered by the
//! same planner as every memory charge. A save reserves room for the
//! largest state it can write *before* the server writes it, evicting the
//! least recently used states for it (nothing when it could not fit
//! anyway); once written, the reservation is replaced by the file's real
//! size. The live reading of a disk pool is its filesystem's free space,
//! so a disk filling up with other files tightens the budget as a memory
//! probe does. Blocking: every method here runs on a blocking thread.

use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use resident_config::Config;
use resident_core::{
    Demand, Entry, Groups, InstanceId, NodeState, Policy, PoolConfig, PoolName, Running, Spec,
    Tier, WorkloadName,
};

/// Reads a directory's filesystem free space (bytes an unprivileged
/// writer may still use); `None` when it cannot be read.
pub(super) type FreeSpace = fn(&Path) -> Option<u64>;

/// The free space of the filesystem holding `dir` (`statvfs`).
pub(super) fn statvfs_free(dir: &Path) -> Option<u64> {
    let s = nix::sys::statvfs::statvfs(dir).ok()?;
    Some(s.blocks_available().saturating_mul(s.fragment_size()))
}

/// What became of a save's files, for the metrics and the log.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Moves {
    /// States removed, least recently used first, to make room.
    pub(super) evicted: u64,
    /// Slots not saved: their largest state does not fit even with every
    /// other state gone.
    pub(super) refused: u64,
    /// States written but not kept: larger than reserved, and no room for
    /// what they really hold.
    pub(super) dropped: u64,
}

impl std::ops::AddAssign for Moves {
    fn add_assign(&mut self, other: Moves) {
        self.evicted += other.evicted;
        self.refused += other.refused;
        self.dropped += other.dropped;
    }
}

/// The disk pools, their directories and the states they hold.
#[derive(Debug)]
pub(super) struct Disks {
    ledger: NodeState,
    dirs: BTreeMap<String, PathBuf>,
    /// The file of each state (its id in `ledger`).
    files: BTreeMap<InstanceId, PathBuf>,
    free: FreeSpace,
}

impl Default for Disks {
    fn default() -> Self {
        Self::new(statvfs_free)
    }
}

/// Milliseconds since the epoch: the disk books' clock (a state's last use
/// is its file's modification time when the agent starts).
pub(super) fn epoch_ms(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The id of the state in `file` of workload directory `workload`
/// (`WORKLOAD.FILE`), or one made from its hash when that is no valid id
/// (a file of someone else's: it takes room all the same).
fn state_id(workload: &str, file: &Path) -> InstanceId {
    let file = file
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    InstanceId::new(format!("{workload}.{file}")).unwrap_or_else(|_| {
        use std::hash::{Hash as _, Hasher as _};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        (workload, file).hash(&mut h);
        InstanceId::new(format!("stray.{:016x}", h.finish())).expect("a valid id")
    })
}

/// A state of `bytes` in `pool`, charged to `workload` (its directory's
/// name; `stray` where that is no workload name).
fn state_spec(workload: &str, pool: &PoolName, bytes: u64) -> Arc<Spec> {
    let name = WorkloadName::new(workload)
        .unwrap_or_else(|_| WorkloadName::new("stray").expect("a valid name"));
    let mut spec = Spec::new(name);
    let demand = Demand {
        kv: bytes,
        ..Demand::default()
    };
    spec.demand.insert(pool.clone(), demand);
    Arc::new(spec)
}

#[allow(clippy::disallowed_methods)] // on a blocking thread
fn remove(file: &Path) {
    if let Err(e) = std::fs::remove_file(file)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(file = %file.display(), error = %e, "cannot remove a saved state");
    }
}

impl Disks {
    /// No disk pools, reading free space with `free`.
    pub(super) fn new(free: FreeSpace) -> Self {
        Self {
            ledger: NodeState::default(),
            dirs: BTreeMap::new(),
            files: BTreeMap::new(),
            free,
        }
    }

    /// The disk pools of `config`, their directories made (0700) where
    /// missing and the states they hold entered, newest first; a state
    /// that no longer fits (a budget lowered) is removed. Returns how many
    /// were.
    pub(super) fn configure(&mut self, config: &Config) -> u64 {
        let pools = config
            .pools
            .iter()
            .filter_map(|p| Some((p.pool.clone(), p.path.clone()?)))
            .collect();
        self.set_pools(pools)
    }

    /// `configure` for these pools and their directories.
    #[allow(clippy::disallowed_methods)] // on a blocking thread
    pub(super) fn set_pools(&mut self, disks: Vec<(PoolConfig, PathBuf)>) -> u64 {
        let mut pools = Vec::new();
        self.dirs.clear();
        self.files.clear();
        for (pool, dir) in disks {
            if let Err(e) = std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&dir)
            {
                tracing::warn!(pool = %pool.name, dir = %dir.display(), error = %e, "cannot make the disk pool's directory; nothing is saved there");
            }
            self.dirs.insert(pool.name.to_string(), dir);
            pools.push(PoolConfig { live: true, ..pool });
        }
        self.ledger = NodeState::new(pools, Groups::default());
        self.read_free();
        let mut found = Vec::new();
        for (pool, dir) in &self.dirs {
            for (workload, file, bytes, used) in stored(dir) {
                found.push((used, pool.clone(), workload, file, bytes));
            }
        }
        found.sort_by_key(|f| std::cmp::Reverse(f.0));
        let mut removed = 0;
        for (used, pool, workload, file, bytes) in found {
            let id = state_id(&workload, &file);
            if self.enter_present(&id, &pool, &workload, bytes, used) {
                self.files.insert(id, file);
            } else {
                tracing::info!(pool, file = %file.display(), "a saved state no longer fits its disk pool; removed");
                remove(&file);
                removed += 1;
            }
        }
        removed
    }

    /// Reads every disk pool's free space into the ledger.
    fn read_free(&mut self) {
        for (pool, dir) in &self.dirs {
            self.ledger.set_available(pool, (self.free)(dir));
        }
    }

    /// Enters a state already on disk: planned under refuse (nothing is
    /// evicted for it), its bytes counted as present. False: no room.
    fn enter_present(
        &mut self,
        id: &InstanceId,
        pool: &str,
        workload: &str,
        bytes: u64,
        now: u64,
    ) -> bool {
        let Ok(pool) = PoolName::new(pool) else {
            return false;
        };
        let run = Running {
            spec: state_spec(workload, &pool, bytes),
            tier: Tier::Awake,
            planned: Tier::Awake,
            present: BTreeMap::from([(pool, bytes)]),
            evictable: true,
        };
        self.ledger
            .admit(id, Entry::Running(run), Policy::Refuse, now)
            .is_ok()
    }

    /// Reserves room in `pool` for the state of each `(slot, file, bound)`
    /// of `workload` (`bound`: the most it can hold) before its server
    /// writes it, evicting the least recently used states where needed. A
    /// state the file already holds (an earlier save of the slot) gives
    /// way to the new one; when the new one cannot fit, the old one stays.
    /// Returns the slots reserved for, to be saved and then `settle`d.
    pub(super) fn reserve(
        &mut self,
        pool: &str,
        workload: &str,
        slots: &[(u64, PathBuf, u64)],
        now: u64,
        moves: &mut Moves,
    ) -> Vec<u64> {
        self.read_free();
        let Ok(pool_name) = PoolName::new(pool) else {
            return Vec::new();
        };
        let mut reserved = Vec::new();
        for (slot, file, bound) in slots {
            let id = state_id(workload, file);
            // The slot's earlier state gives way to the new one, planned
            // without it; refused, the books are as they were.
            let before = self.ledger.clone();
            self.ledger.release(id.as_str());
            let spec = state_spec(workload, &pool_name, *bound);
            match self.make_room(&id, spec, now, moves) {
                Ok(()) => {
                    self.files.insert(id, file.clone());
                    reserved.push(*slot);
                }
                Err(e) => {
                    self.ledger = before;
                    moves.refused += 1;
                    tracing::info!(pool, workload, slot, bytes = bound, reason = %e, "a conversation is not saved: its state may not fit the disk pool");
                }
            }
        }
        reserved
    }

    /// After the save of `file` (`written`: its size, `None` when the
    /// save failed): the reservation becomes what the file holds. A file
    /// larger than reserved is kept only if room can be made for it now;
    /// otherwise it is removed (`moves.dropped`). Whether it is kept.
    pub(super) fn settle(
        &mut self,
        pool: &str,
        workload: &str,
        file: &Path,
        written: Option<u64>,
        now: u64,
        moves: &mut Moves,
    ) -> bool {
        let id = state_id(workload, file);
        let reserved = self.ledger.release(id.as_str());
        let Some(bytes) = written else {
            self.files.remove(&id);
            remove(file);
            return false;
        };
        self.read_free();
        if self.enter_present(&id, pool, workload, bytes, now) {
            self.files.insert(id, file.to_path_buf());
            return true;
        }
        // More than the reservation (or the disk filled meanwhile): room
        // is made for it as for a new state, or it goes.
        let was = reserved.map_or(0, |r| r.footprint(pool));
        tracing::warn!(pool, workload, file = %file.display(), bytes, reserved = was, "a saved state is larger than the room reserved for it");
        let Ok(pool_name) = PoolName::new(pool) else {
            return false;
        };
        let spec = state_spec(workload, &pool_name, bytes);
        match self.make_room(&id, spec, now, moves) {
            Ok(()) => {
                self.ledger.set_measured(id.as_str(), &pool_name, bytes);
                self.files.insert(id, file.to_path_buf());
                true
            }
            Err(_) => {
                self.files.remove(&id);
                remove(file);
                moves.dropped += 1;
                false
            }
        }
    }

    /// Admits state `id` of `spec` under evict: the least recently used
    /// states the planner chose are removed (files and charges) to make
    /// its room. A refusal changes nothing.
    fn make_room(
        &mut self,
        id: &InstanceId,
        spec: Arc<Spec>,
        now: u64,
        moves: &mut Moves,
    ) -> Result<(), resident_core::AdmitError> {
        let admission = self
            .ledger
            .admit(id, Entry::Start(spec), Policy::Evict, now)?;
        for victim in admission.evict {
            if let Some(f) = self.files.remove(&victim) {
                remove(&f);
            }
            self.ledger.release(victim.as_str());
            moves.evicted += 1;
        }
        Ok(())
    }

    /// Marks the state in `file` of `workload` used at `now`.
    pub(super) fn touch(&mut self, workload: &str, file: &Path, now: u64) {
        let id = state_id(workload, file);
        self.ledger.touch(id.as_str(), now, 0);
    }

    /// Removes the state in `file` of `workload` and its charge.
    pub(super) fn drop_state(&mut self, workload: &str, file: &Path) {
        let id = state_id(workload, file);
        self.ledger.release(id.as_str());
        self.files.remove(&id);
        remove(file);
    }

    /// Each disk pool as the API shows it, with its last free-space
    /// reading.
    pub(super) fn pools(&self) -> Vec<resident_api::pb::PoolStatus> {
        self.ledger
            .pools()
            .iter()
            .map(|p| resident_api::pool_status(p, self.ledger.available(p.name.as_str())))
            .collect()
    }

    /// The ledger, for the tests' checks.
    #[cfg(test)]
    pub(super) fn ledger(&self) -> &NodeState {
        &self.ledger
    }
}

/// The files under a disk pool's `dir` (one directory per workload): the
/// workload's directory name, the file, its size and last modification.
#[allow(clippy::disallowed_methods)] // on a blocking thread
fn stored(dir: &Path) -> Vec<(String, PathBuf, u64, u64)> {
    let mut out = Vec::new();
    let Ok(workloads) = std::fs::read_dir(dir) else {
        return out;
    };
    for w in workloads.flatten() {
        let workload = w.file_name().to_string_lossy().into_owned();
        let Ok(files) = std::fs::read_dir(w.path()) else {
            continue;
        };
        for f in files.flatten() {
            let Ok(meta) = f.metadata() else { continue };
            if meta.is_file() {
                let used = epoch_ms(meta.modified().unwrap_or(SystemTime::UNIX_EPOCH));
                out.push((workload.clone(), f.path(), meta.len(), used));
            }
        }
    }
    out
}
