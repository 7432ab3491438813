//! Saved conversations (`keep_kv = "POOL"`): before the agent stops a
//! READY llama-server that keeps its KV, the server saves its slots
//! (`POST /slots/N?action=save`) into a directory of its workload's in a
//! disk pool (`[[pool]] path`); the next start of the workload restores
//! them (`action=restore`) as soon as it is READY, before a Start that
//! waits for READY answers, so a conversation that comes back finds its
//! prompt already computed. A room of its own: `KvStore` owns what the
//! disk pools hold and knows nothing of the agent.
//!
//! What is saved is charged to its disk pool through the planner, as
//! every charge is (`disks.rs`): before a slot is saved, room is reserved
//! for the most its state can hold (its cached tokens, from `GET /slots`,
//! times the KV bytes per token of the workload's reservation), evicting
//! the least recently used states for it; a state that cannot fit is not
//! saved and nothing is evicted for it. Once written, the state is
//! charged what its file holds. A state is saved under the workload's
//! footprint key (its command and its files), so one saved before the
//! model file or the arguments changed is never restored: it is dropped.
//! A save or restore that fails never fails the stop or the start: it is
//! counted and logged.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;
use resident_config::{Config, Workload};

use super::http::{get_json, post_json};

mod disks;
#[cfg(test)]
mod tests;

use disks::{Disks, Moves, epoch_ms};

/// A save or restore of one server's slots may take this long.
const SLOT_CALL: Duration = Duration::from_secs(60);

/// What a state holds beside its tokens' KV: per token, its id and its
/// cell's position and sequence (llama.cpp's `state_write_meta`), and per
/// file a header and each layer's row sizes.
const PER_TOKEN: u64 = 16;
const PER_FILE: u64 = 64 * 1024;

/// What a save or a restore came to, for the metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct KvCounts {
    pub(super) saved: u64,
    pub(super) restored: u64,
    pub(super) failed: u64,
    pub(super) evicted: u64,
}

impl KvCounts {
    /// Adds them to `metrics` (`residentd_kv_states_total`).
    pub(super) fn count(self, metrics: &crate::metrics::Metrics) {
        metrics.kv(self.saved, self.restored, self.failed, self.evicted);
    }
}

/// The disk pools and the conversations saved in them.
#[derive(Debug, Default)]
pub(super) struct KvStore {
    disks: Mutex<Disks>,
    /// What was last seen of each run that saves ahead of its sleep.
    quiet: Mutex<BTreeMap<(String, u64), Quiet>>,
    /// Runs whose conversations are being restored: done when true.
    restoring: Mutex<BTreeMap<(String, u64), tokio::sync::watch::Receiver<bool>>>,
}

/// A restore under way (`KvStore::restoring`): done when dropped.
pub(super) struct Restoring {
    store: Arc<KvStore>,
    run: (String, u64),
    done: tokio::sync::watch::Sender<bool>,
}

impl Drop for Restoring {
    fn drop(&mut self) {
        let _ = self.done.send(true);
        self.store.restoring.lock().remove(&self.run);
    }
}

/// A run's activity as last read (its `/metrics` counters), since when it
/// has not changed, and the activity its last save followed.
#[derive(Debug)]
struct Quiet {
    seen: String,
    since: Instant,
    saved: Option<String>,
}

/// The file of slot `slot` of a state saved under `key`.
fn file_name(key: u64, slot: u64) -> String {
    format!("{key:016x}-{slot}.bin")
}

/// One slot as `GET /slots` shows it: its id, its cells (`n_ctx`) and
/// the tokens it holds (`n_prompt_tokens`: its prompt and what it
/// generated, all of which a save writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Slot {
    pub(super) id: u64,
    pub(super) cells: u64,
    pub(super) tokens: u64,
}

/// The slots of a `GET /slots` answer that hold tokens.
pub(super) fn slots_holding(answer: &str) -> Option<Vec<Slot>> {
    let v: serde_json::Value = serde_json::from_str(answer).ok()?;
    let slots = v
        .as_array()?
        .iter()
        .filter_map(|s| {
            Some(Slot {
                id: s.get("id")?.as_u64()?,
                cells: s.get("n_ctx")?.as_u64()?,
                tokens: s
                    .get("n_prompt_tokens")
                    .and_then(|n| n.as_u64())
                    .unwrap_or(0),
            })
        })
        .filter(|s| s.tokens > 0)
        .collect();
    Some(slots)
}

/// The most a saved state of `slot` can hold when the workload reserves
/// `kv` bytes of KV cache: its tokens' share of the cache (a slot's cells
/// hold at most the whole cache's bytes per cell times the slots sharing
/// it, so `kv / cells` per token bounds it), plus each token's
/// bookkeeping and the file's header.
pub(super) fn bound(kv: u64, slot: &Slot) -> u64 {
    let share = (u128::from(kv) * u128::from(slot.tokens)).div_ceil(u128::from(slot.cells.max(1)));
    u64::try_from(share)
        .unwrap_or(u64::MAX)
        .saturating_add(slot.tokens.saturating_mul(PER_TOKEN))
        .saturating_add(PER_FILE)
}

/// The KV cache bytes `w` reserves, over all its pools.
fn kv_reserved(w: &Workload) -> u64 {
    let spec = &w.spec;
    let fixed = spec.demand.values().map(|d| d.kv);
    let any = spec
        .any_of
        .iter()
        .map(|a| a.demand.kv.saturating_mul(a.count as u64));
    fixed.chain(any).fold(0, u64::saturating_add)
}

impl KvStore {
    /// The disk pools of `config`, their directories made (0700) where
    /// missing and what they hold entered in their books. Blocking: at
    /// start and reload.
    pub(super) fn configure(&self, config: &Config) {
        let removed = self.disks().configure(config);
        if removed > 0 {
            tracing::info!(
                removed,
                "saved states removed: their disk pools no longer hold them"
            );
        }
    }

    /// Whether run `generation` of `id`, whose activity reads `seen` at
    /// `now`, has been quiet for `after` with something done since its
    /// last save: then it is marked saved at this activity.
    pub(super) fn save_due(
        &self,
        id: &str,
        generation: u64,
        seen: String,
        now: Instant,
        after: Duration,
    ) -> bool {
        let mut quiet = self.quiet.lock();
        let q = quiet
            .entry((id.to_string(), generation))
            .or_insert_with(|| Quiet {
                seen: seen.clone(),
                since: now,
                saved: None,
            });
        if q.seen != seen {
            q.seen = seen;
            q.since = now;
            return false;
        }
        let due =
            now.saturating_duration_since(q.since) >= after && q.saved.as_ref() != Some(&q.seen);
        if due {
            q.saved = Some(q.seen.clone());
        }
        due
    }

    /// Marks the restore of run `generation` of `id` under way until the
    /// returned guard is dropped; `restored` waits for it.
    pub(super) fn restoring(self: &Arc<Self>, id: &str, generation: u64) -> Restoring {
        let (done, rx) = tokio::sync::watch::channel(false);
        let run = (id.to_string(), generation);
        self.restoring.lock().insert(run.clone(), rx);
        Restoring {
            store: self.clone(),
            run,
            done,
        }
    }

    /// Waits until the restore of run `generation` of `id`, if one is
    /// under way, is done.
    pub(super) async fn restored(&self, id: &str, generation: u64) {
        let rx = self
            .restoring
            .lock()
            .get(&(id.to_string(), generation))
            .cloned();
        if let Some(mut rx) = rx {
            let _ = rx.wait_for(|done| *done).await;
        }
    }

    /// Forgets the runs `keep` does not name (ended, or no longer followed).
    pub(super) fn forget_runs(&self, keep: impl Fn(&str, u64) -> bool) {
        let mut quiet = self.quiet.lock();
        quiet.retain(|(id, generation), _| keep(id, *generation));
    }

    fn disks(&self) -> parking_lot::MutexGuard<'_, Disks> {
        self.disks.lock()
    }

    /// Makes the directory `w`'s server saves into (0700), where missing:
    /// the server refuses to start without it. Blocking: small.
    #[allow(clippy::disallowed_methods)]
    pub(super) fn prepare(w: &Workload) {
        use std::os::unix::fs::DirBuilderExt as _;
        let Some(keep) = &w.keep_kv else { return };
        if let Err(e) = std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&keep.dir)
        {
            tracing::warn!(dir = %keep.dir.display(), error = %e, "cannot make the directory a server saves its conversations in");
        }
    }

    /// Each disk pool's figures, as `Node` shows them.
    pub(super) fn pools(&self) -> Vec<resident_api::pb::PoolStatus> {
        self.disks().pools()
    }

    /// Has the server of `w` on `port` save each slot that holds tokens
    /// under the workload's key, each into room reserved for it first
    /// (the least recently used states evicted for it). Failures are
    /// counted and logged, never returned.
    pub(super) async fn save(self: &Arc<Self>, id: &str, w: &Workload, port: u16) -> KvCounts {
        let mut counts = KvCounts::default();
        let Some(keep) = &w.keep_kv else {
            return counts;
        };
        let slots = match get_json(port, "/slots", SLOT_CALL)
            .await
            .map(|a| slots_holding(&a))
        {
            Ok(Some(slots)) => slots,
            Ok(None) => {
                counts.failed += 1;
                tracing::warn!(
                    instance_id = id,
                    "its server's /slots answer was not understood; nothing saved"
                );
                return counts;
            }
            Err(e) => {
                counts.failed += 1;
                tracing::warn!(instance_id = id, error = %e, "its server does not show its slots (GET /slots); nothing saved");
                return counts;
            }
        };
        let kv = kv_reserved(w);
        if slots.is_empty() {
            return counts;
        }
        if kv == 0 {
            counts.failed += 1;
            tracing::warn!(
                instance_id = id,
                "the workload reserves no KV cache, so a saved state cannot be sized before it is written; nothing saved"
            );
            return counts;
        }
        let key = w.footprint_key();
        let workload = w.spec.workload.to_string();
        let wanted: Vec<(u64, PathBuf, u64)> = slots
            .iter()
            .map(|s| (s.id, keep.dir.join(file_name(key, s.id)), bound(kv, s)))
            .collect();
        let (me, pool, name) = (self.clone(), keep.pool.clone(), workload.clone());
        let (reserved, mut moves) = tokio::task::spawn_blocking(move || {
            let mut moves = Moves::default();
            let now = epoch_ms(SystemTime::now());
            let reserved = me.disks().reserve(&pool, &name, &wanted, now, &mut moves);
            (reserved, moves)
        })
        .await
        .unwrap_or_default();
        for slot in reserved {
            let file = keep.dir.join(file_name(key, slot));
            let body = format!("{{\"filename\": \"{}\"}}", file_name(key, slot));
            let path = format!("/slots/{slot}?action=save");
            let done = post_json(port, &path, &body, SLOT_CALL).await;
            if let Err(e) = &done {
                counts.failed += 1;
                tracing::warn!(instance_id = id, slot, error = %e, "saving a slot failed; the stop goes on");
            }
            let (me, pool, name) = (self.clone(), keep.pool.clone(), workload.clone());
            let ok = done.is_ok();
            let (kept, m) = tokio::task::spawn_blocking(move || {
                #[allow(clippy::disallowed_methods)] // a blocking thread
                let written = ok
                    .then(|| std::fs::metadata(&file).ok().map(|m| m.len()))
                    .flatten();
                let mut moves = Moves::default();
                let now = epoch_ms(SystemTime::now());
                let kept = me
                    .disks()
                    .settle(&pool, &name, &file, written, now, &mut moves);
                (kept, moves)
            })
            .await
            .unwrap_or_default();
            counts.saved += u64::from(kept);
            moves += m;
        }
        counts.evicted = moves.evicted;
        counts.failed += moves.dropped;
        let pool = &keep.pool;
        if moves.evicted > 0 {
            tracing::info!(instance_id = id, pool = %pool, evicted = moves.evicted, "saved states evicted, least recently used first, to make room in the disk pool");
        }
        if counts.saved > 0 {
            tracing::info!(instance_id = id, pool = %pool, slots = counts.saved, "its conversations saved");
        }
        counts
    }

    /// Has the server of `w` on `port` restore the states saved under the
    /// workload's key (their use counted), and drops those saved under
    /// another (the model file or the arguments changed). Failures are
    /// counted and logged, never returned.
    pub(super) async fn restore(self: &Arc<Self>, id: &str, w: &Workload, port: u16) -> KvCounts {
        let mut counts = KvCounts::default();
        let Some(keep) = &w.keep_kv else {
            return counts;
        };
        let key = w.footprint_key();
        let dir = keep.dir.clone();
        let prefix = format!("{key:016x}-");
        let workload = w.spec.workload.to_string();
        let (me, name) = (self.clone(), workload.clone());
        let ours = tokio::task::spawn_blocking(move || {
            let (ours, stale) = saved_in(&dir, &prefix);
            let mut disks = me.disks();
            for file in stale {
                disks.drop_state(&name, &file);
            }
            ours
        })
        .await
        .unwrap_or_default();
        for (slot, file) in ours {
            let Some(name) = file.file_name().map(|n| n.to_string_lossy().into_owned()) else {
                continue;
            };
            let body = format!("{{\"filename\": \"{name}\"}}");
            let path = format!("/slots/{slot}?action=restore");
            match post_json(port, &path, &body, SLOT_CALL).await {
                Ok(_) => {
                    counts.restored += 1;
                    self.disks()
                        .touch(&workload, &file, epoch_ms(SystemTime::now()));
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
