//! The journal's scribe, a room of its own: what the journal should hold
//! (the books' rows, each run's process group and its start time),
//! written whenever a change is numbered.
//!
//! Answers are durable: every change takes a number, and a Start or Stop
//! answers only once a journal write that began after its change has
//! reached the disk; the numbering, group commit and waiting are
//! `durability.rs`'s, what the journal holds is composed here; a write
//! appends only what changed (`journal.rs`). The restore from it is
//! `restore.rs`'s.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use resident_supervisor::Supervisor;

use super::books::Books;
use super::durability::Durability;
use super::parts::Parts;
use crate::journal;
use crate::metrics::Metrics;

/// The scribe.
#[derive(Debug)]
pub(super) struct Scribe {
    books: Arc<Books>,
    sup: Supervisor,
    durability: Arc<Durability>,
    metrics: Arc<Metrics>,
    /// The start time of each journaled process group's leader, by
    /// instance, run and pid.
    start_ticks: Mutex<HashMap<String, Ticks>>,
}

impl Scribe {
    /// The room, on the parts (and the rooms) it uses.
    pub(super) fn new(p: &Parts) -> Self {
        Self {
            books: p.books.clone(),
            sup: p.sup.clone(),
            durability: p.durability.clone(),
            metrics: p.metrics.clone(),
            start_ticks: Mutex::default(),
        }
    }

    /// Writes the journal now (blocking: it fsyncs): what the books hold,
    /// with each run's group. Once sealed only the sealing write (at
    /// shutdown, at a hand-over) goes through.
    pub(super) fn write_now(&self, sealing: bool) {
        let rows = || (self.entries(), self.books.learned_rows());
        if let Some(ok) = self.durability.write(sealing, rows) {
            self.metrics.journal_written(ok);
        }
    }

    /// What the journal should hold now: resident instances no Stop or
    /// eviction asked for, in admission order, with their running group.
    /// The books are read under their lock; the process table after it is
    /// released. Reads /proc: called by the journal writer, on a blocking
    /// thread.
    #[allow(clippy::disallowed_methods)]
    pub(super) fn entries(&self) -> Vec<journal::Entry> {
        let live = self.books.journal_rows();
        // A group's start time comes from its spawn; when the spawn could
        // not tell, it is read from /proc once per process, not at every
        // write: a storm of starts writes often. Called only by the one
        // journal writer.
        let mut known = self.start_ticks.lock();
        // Ended runs' readings go now and then, not at every write.
        if known.len() > 2 * live.len() + 64 {
            let ids: std::collections::HashSet<&str> = live.iter().map(|r| r.id.as_str()).collect();
            known.retain(|id, _| ids.contains(id.as_str()));
        }
        live.into_iter()
            .map(|row| {
                let (id, generation) = (row.id, row.generation);
                let run = self.sup.pid(&id, generation);
                let (pid, spawned_at, port, restarts) = match run {
                    Some(r) => (r.pid as i32, r.start_ticks, r.port, r.restarts),
                    None => (0, None, 0, 0),
                };
                // Kept for the run and its pid, so a reused pid is read anew.
                let start_ticks = match (known.get(id.as_str()), spawned_at) {
                    // Known from the spawn itself: the child's /proc entry
                    // is never looked up.
                    (_, Some(ticks)) if pid > 0 => ticks,
                    (Some(t), _) if (t.generation, t.pid) == (generation, pid) => t.ticks,
                    // No group yet (not spawned, or between runs): nothing
                    // to read.
                    _ if pid <= 0 => 0,
                    _ => {
                        let ticks =
                            resident_supervisor::procfs::stat(pid).map_or(0, |s| s.start_ticks);
                        if ticks > 0 {
                            let t = Ticks {
                                generation,
                                pid,
                                ticks,
                            };
                            known.insert(id.clone(), t);
                        }
                        ticks
                    }
                };
                match row.adopted {
                    // Its own pid and start time, whatever its state.
                    Some(a) => journal::Entry {
                        instance: id,
                        workload: row.workload,
                        pgid: a.pid as i32,
                        start_ticks: a.start_ticks,
                        lease_ms: 0,
                        adopted: Some(journal::Adopted {
                            manage: a.manage,
                            port: a.port,
                        }),
                        port: a.port,
                        restarts: 0,
                        chosen: Vec::new(),
                        sleep: journal::Slumber::Awake,
                    },
                    None => journal::Entry {
                        instance: id,
                        workload: row.workload,
                        pgid: pid,
                        start_ticks,
                        lease_ms: row.lease_ms,
                        adopted: None,
                        port,
                        restarts,
                        chosen: row.chosen,
                        sleep: row.sleep,
                    },
                }
            })
            .collect()
    }
}

/// The start time of a journaled run's group leader, read once per run
/// and pid.
#[derive(Debug, Clone, Copy)]
pub(super) struct Ticks {
    generation: u64,
    pid: i32,
    ticks: u64,
}

/// Rewrites the journal whenever it is marked out of date, on a blocking
/// thread (the write fsyncs). Changes made during a write are all taken
/// by the next one.
pub(super) async fn write_journal(scribe: Weak<Scribe>) {
    loop {
        let Some(strong) = scribe.upgrade() else {
            return;
        };
        let notified = async {
            strong.durability.dirtied().await;
        };
        // Wake now and then, to notice when the agent is gone.
        let wait = tokio::time::timeout(Duration::from_secs(10), notified);
        if wait.await.is_err() {
            drop(strong);
            continue;
        }
        let writer = strong.clone();
        let _ = tokio::task::spawn_blocking(move || writer.write_now(false)).await;
    }
}
