//! Saved conversations (`keep_kv = "POOL"`): before the agent stops a
//! READY llama-server that keeps its KV, the server saves its slots
//! (`POST /slots/N?action=save`) into a directory of its workload's in a
//! disk pool (`[[pool]] path`); the next start of the workload restores
//! them (`action=restore`) as soon as it is READY, before a Start that
//! waits for READY answers, so a conversation that comes back finds its
//! prompt already computed. A room of its own: `KvStore` owns what the
//! disk pools hold and knows nothing of the agent.
//!
//! What is saved is charged to its disk pool: the pool's budget bounds
//! the bytes of every state under its directory, and the least recently
//! used go first when a save needs room (a state larger than the budget
//! is not kept). A state is saved under the workload's footprint key (its
//! command and its files), so one saved before the model file or the
//! arguments changed is never restored: it is dropped. A save or restore
//! that fails never fails the stop or the start: it is counted and logged.

use std::collections::BTreeMap;
use std::os::unix::fs::DirBuilderExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use resident_config::{Config, Workload};

use super::http::post_json;

/// A save or restore of one server's slots may take this long.
const SLOT_CALL: Duration = Duration::from_secs(60);

/// One saved slot: its file, size and last use.
#[derive(Debug, Clone)]
struct Saved {
    bytes: u64,
    used: SystemTime,
}

/// A disk pool: its directory, budget and what it holds.
#[derive(Debug, Default)]
struct Disk {
    dir: PathBuf,
    budget: u64,
    files: BTreeMap<PathBuf, Saved>,
}

impl Disk {
    fn used(&self) -> u64 {
        self.files.values().map(|s| s.bytes).sum()
    }

    /// Forgets what is gone and adds what is there, under `dir` (one
    /// directory per workload).
    #[allow(clippy::disallowed_methods)] // on a blocking thread
    fn rescan(&mut self) {
        self.files.clear();
        let Ok(workloads) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for w in workloads.flatten() {
            let Ok(files) = std::fs::read_dir(w.path()) else {
                continue;
            };
            for f in files.flatten() {
                let Ok(meta) = f.metadata() else { continue };
                if meta.is_file() {
                    let used = meta.modified().unwrap_or(SystemTime::UNIX_EPOCH);
                    let saved = Saved {
                        bytes: meta.len(),
                        used,
                    };
                    self.files.insert(f.path(), saved);
                }
            }
        }
    }

    /// Removes the least recently used states until the pool is within
    /// its budget; returns how many went.
    #[allow(clippy::disallowed_methods)] // on a blocking thread
    fn evict(&mut self) -> usize {
        let mut gone = 0;
        while self.used() > self.budget {
            let Some(oldest) = self
                .files
                .iter()
                .min_by_key(|(_, s)| s.used)
                .map(|(p, _)| p.clone())
            else {
                break;
            };
            let _ = std::fs::remove_file(&oldest);
            self.files.remove(&oldest);
            gone += 1;
        }
        gone
    }
}

/// What a save or a restore came to, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct KvCounts {
    pub(super) saved: u64,
    pub(super) restored: u64,
    pub(super) failed: u64,
    pub(super) evicted: u64,
}

/// The disk pools and the conversations saved in them.
#[derive(Debug, Default)]
pub(super) struct KvStore {
    disks: Mutex<BTreeMap<String, Disk>>,
}

/// The file of slot `slot` of a state saved under `key`.
fn file_name(key: u64, slot: u64) -> String {
    format!("{key:016x}-{slot}.bin")
}

impl KvStore {
    /// The disk pools of `config`, their directories made (0700) where
    /// missing and what they hold read. Blocking: at start and reload.
    #[allow(clippy::disallowed_methods)]
    pub(super) fn configure(&self, config: &Config) {
        let mut disks = self.disks.lock().unwrap_or_else(|e| e.into_inner());
        disks.clear();
        for p in &config.pools {
            let Some(dir) = &p.path else { continue };
            if let Err(e) = std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
            {
                tracing::warn!(pool = %p.pool.name, dir = %dir.display(), error = %e, "cannot make the disk pool's directory; nothing is saved there");
            }
            let mut disk = Disk {
                dir: dir.clone(),
                budget: p.pool.budget.unwrap_or(0),
                files: BTreeMap::new(),
            };
            disk.rescan();
            disks.insert(p.pool.name.to_string(), disk);
        }
    }

    /// Makes the directory `w`'s server saves into (0700), where missing:
    /// the server refuses to start without it. Blocking: small.
    #[allow(clippy::disallowed_methods)]
    pub(super) fn prepare(w: &Workload) {
        let Some(keep) = &w.keep_kv else { return };
        if let Err(e) = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&keep.dir)
        {
            tracing::warn!(dir = %keep.dir.display(), error = %e, "cannot make the directory a server saves its conversations in");
        }
    }

    /// Each disk pool's budget and the bytes saved in it, by name.
    pub(super) fn figures(&self) -> Vec<(String, u64, u64)> {
        let disks = self.disks.lock().unwrap_or_else(|e| e.into_inner());
        disks
            .iter()
            .map(|(name, d)| (name.clone(), d.budget, d.used()))
            .collect()
    }

    /// Has the server of `w` on `port` (its `slots` slots) save them under
    /// the workload's key, then charges the files to the disk pool,
    /// evicting the least recently used states past its budget. Failures
    /// are counted and logged, never returned.
    pub(super) async fn save(
        self: &Arc<Self>,
        id: &str,
        w: &Workload,
        port: u16,
        slots: u64,
    ) -> KvCounts {
        let mut counts = KvCounts::default();
        let Some(keep) = &w.keep_kv else {
            return counts;
        };
        let key = w.footprint_key();
        let mut saved = 0;
        for slot in 0..slots {
            let body = format!("{{\"filename\": \"{}\"}}", file_name(key, slot));
            let path = format!("/slots/{slot}?action=save");
            match post_json(port, &path, &body, SLOT_CALL).await {
                Ok(answer) if saved_tokens(&answer) > 0 => saved += 1,
                // An empty slot leaves an empty state: not kept.
                Ok(_) => {
                    let file = keep.dir.join(file_name(key, slot));
                    let _ = tokio::task::spawn_blocking(move || {
                        #[allow(clippy::disallowed_methods)] // a blocking thread
                        std::fs::remove_file(file)
                    })
                    .await;
                }
                Err(e) => {
                    counts.failed += 1;
                    tracing::warn!(instance_id = id, slot, error = %e, "saving a slot failed; the stop goes on");
                }
            }
        }
        if saved == 0 {
            return counts;
        }
        counts.saved = saved;
        let (me, pool) = (self.clone(), keep.pool.clone());
        let evicted = tokio::task::spawn_blocking(move || {
            let mut disks = me.disks.lock().unwrap_or_else(|e| e.into_inner());
            let Some(disk) = disks.get_mut(&pool) else {
                return 0;
            };
            disk.rescan();
            disk.evict()
        })
        .await
        .unwrap_or(0);
        let pool = &keep.pool;
        if evicted > 0 {
            counts.evicted = evicted as u64;
            tracing::info!(instance_id = id, pool = %pool, evicted, "saved states evicted, least recently used first, to keep the disk pool within its budget");
        }
        tracing::info!(instance_id = id, pool = %pool, slots = saved, "its conversations saved");
        counts
    }

    /// Has the server of `w` on `port` restore the states saved under the
    /// workload's key (their use counted), and drops those saved under
    /// another (the model file or the arguments changed). Failures are
    /// counted and logged, never returned.
    pub(super) async fn restore(&self, id: &str, w: &Workload, port: u16) -> KvCounts {
        let mut counts = KvCounts::default();
        let Some(keep) = &w.keep_kv else {
            return counts;
        };
        let key = w.footprint_key();
        let dir = keep.dir.clone();
        let prefix = format!("{key:016x}-");
        let (ours, stale) = tokio::task::spawn_blocking(move || saved_in(&dir, &prefix))
            .await
            .unwrap_or_default();
        for file in stale {
            let _ = tokio::task::spawn_blocking(move || {
                #[allow(clippy::disallowed_methods)] // a blocking thread
                std::fs::remove_file(file)
            })
            .await;
        }
        for (slot, file) in ours {
            let Some(name) = file.file_name().map(|n| n.to_string_lossy().into_owned()) else {
                continue;
            };
            let body = format!("{{\"filename\": \"{name}\"}}");
            let path = format!("/slots/{slot}?action=restore");
            match post_json(port, &path, &body, SLOT_CALL).await {
                Ok(_) => {
                    counts.restored += 1;
                    self.touched(&keep.pool, &file);
                    tracing::info!(instance_id = id, slot, "a saved conversation restored");
                }
                Err(e) => {
                    counts.failed += 1;
                    tracing::warn!(instance_id = id, slot, error = %e, "restoring a slot failed; the start goes on");
                }
            }
        }
        counts
    }

    /// Marks `file` of `pool` used now (the last to be evicted).
    fn touched(&self, pool: &str, file: &Path) {
        let mut disks = self.disks.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = disks.get_mut(pool).and_then(|d| d.files.get_mut(file)) {
            s.used = SystemTime::now();
        }
    }
}

/// The states in `dir`: those whose name starts with `prefix` (the
/// current key), each with its slot, and the others (another key: stale).
#[allow(clippy::disallowed_methods)] // on a blocking thread
fn saved_in(dir: &Path, prefix: &str) -> (Vec<(u64, PathBuf)>, Vec<PathBuf>) {
    let (mut ours, mut stale) = (Vec::new(), Vec::new());
    let Ok(files) = std::fs::read_dir(dir) else {
        return (ours, stale);
    };
    for f in files.flatten() {
        let name = f.file_name().to_string_lossy().into_owned();
        let slot = name
            .strip_prefix(prefix)
            .and_then(|r| r.strip_suffix(".bin"))
            .and_then(|n| n.parse::<u64>().ok());
        match slot {
            Some(slot) => ours.push((slot, f.path())),
            None => stale.push(f.path()),
        }
    }
    ours.sort();
    (ours, stale)
}

/// `n_saved` of a save's answer (0 when it says none).
fn saved_tokens(answer: &str) -> u64 {
    serde_json::from_str::<serde_json::Value>(answer)
        .ok()
        .and_then(|v| v.get("n_saved")?.as_u64())
        .unwrap_or(0)
}

/// The slots of a llama-server command line (`--parallel N`, `-np N`;
/// its default, 4, without).
pub(super) fn slots_of(argv: &[String]) -> u64 {
    argv.windows(2)
        .find(|p| p[0] == "--parallel" || p[0] == "-np")
        .and_then(|p| p[1].parse().ok())
        .unwrap_or(4)
}
