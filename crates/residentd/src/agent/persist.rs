//! The agent's journal: what should be running, written (coalesced) at
//! every change, and restored after a restart.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use resident_core::{InstanceId, Policy};

use super::{Agent, Record};
use crate::journal;

impl Agent {
    /// After a restart: kills what the previous run left behind (recorded
    /// process groups, checked against pid reuse), then starts the
    /// journaled instances again in their original order. Instances that no
    /// longer fit, or whose workload left the roster, are reported and
    /// dropped.
    pub async fn restore(self: &Arc<Self>) {
        let entries = self.journal.read();
        if entries.is_empty() {
            return;
        }
        let killed: usize = entries.iter().map(journal::kill_leftovers).sum();
        for e in entries.iter().filter(|e| e.pgid > 1) {
            let gone = || resident_supervisor::procfs::group_members(e.pgid).is_empty();
            let deadline = Instant::now() + Duration::from_secs(5);
            while !gone() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
        tracing::info!(
            instances = entries.len(),
            killed,
            "restoring journaled instances"
        );
        for e in entries {
            let Ok(id) = InstanceId::new(e.instance.as_str()) else {
                continue;
            };
            match self
                .start(&e.workload, Some(id), Some(Policy::Refuse), false)
                .await
            {
                Ok(_) => {
                    tracing::info!(instance_id = %e.instance, workload = %e.workload, "restored")
                }
                Err(err) => tracing::warn!(
                    instance_id = %e.instance, workload = %e.workload, error = %err,
                    "a journaled instance could not be restored"
                ),
            }
        }
        self.persist();
    }
    /// Marks the journal out of date; the writer task rewrites it soon.
    /// Once shutdown has begun the journal stays as shutdown wrote it.
    pub(super) fn persist(&self) {
        if !self.closing.load(Ordering::Acquire) {
            self.journal_dirty.notify_one();
        }
    }

    /// Writes the journal now (blocking: it fsyncs). Serialized with every
    /// other write; once `closing` is set only the sealing write (at
    /// shutdown) goes through, so a late background write can never
    /// replace what shutdown wrote.
    pub(super) fn write_journal_now(&self, sealing: bool) {
        let _one_writer = self.journal_lock.lock().unwrap_or_else(|e| e.into_inner());
        if !sealing && self.closing.load(Ordering::Acquire) {
            return;
        }
        if let Err(e) = self.journal.write(&self.journal_entries()) {
            tracing::error!(error = %e, "cannot write the journal");
        }
    }
    /// What the journal should hold now: resident, not evicted instances in
    /// admission order, with their running group.
    pub(super) fn journal_entries(&self) -> Vec<journal::Entry> {
        let books = self.books();
        let mut live: Vec<(&String, &Record)> = books
            .records
            .iter()
            .filter(|(id, _)| books.ledger.resident(id).is_some_and(|r| !r.evicting))
            .collect();
        live.sort_by_key(|(_, r)| r.generation);
        live.into_iter()
            .map(|(id, r)| {
                let pid = self
                    .sup
                    .status(id)
                    .filter(|s| s.generation == r.generation)
                    .and_then(|s| s.pid)
                    .map_or(0, |p| p as i32);
                let start_ticks =
                    resident_supervisor::procfs::stat(pid).map_or(0, |s| s.start_ticks);
                journal::Entry {
                    instance: id.clone(),
                    workload: r.workload.spec.workload.to_string(),
                    pgid: pid,
                    start_ticks,
                }
            })
            .collect()
    }
}

/// How long changes gather before the journal is written: a burst of
/// starts costs one write and one fsync, not one each.
const GATHER: Duration = Duration::from_millis(20);

/// Rewrites the journal whenever it is marked out of date, on a blocking
/// thread (the write fsyncs); bursts of changes coalesce into one write.
pub(super) async fn write_journal(agent: std::sync::Weak<Agent>) {
    loop {
        let Some(strong) = agent.upgrade() else {
            return;
        };
        let notified = async {
            strong.journal_dirty.notified().await;
        };
        // Wake now and then, to notice when the agent is gone.
        let wait = tokio::time::timeout(Duration::from_secs(10), notified);
        if wait.await.is_err() {
            drop(strong);
            continue;
        }
        tokio::time::sleep(GATHER).await;
        let writer = strong.clone();
        let _ = tokio::task::spawn_blocking(move || writer.write_journal_now(false)).await;
    }
}
