//! Durability, a room of its own: the journal file, the numbering of
//! changes, group commit, and who waits for which change to be on disk.
//! It knows nothing of the agent: the agent numbers each change it makes
//! (`change`), hands the writer what the journal should hold when it
//! writes (`write`), and waits for a change before it answers
//! (`settled`).
//!
//! One writer writes what the books hold at the moment it writes, so
//! changes made while a write is under way all go into the next one: a
//! storm of starts shares writes and fsyncs instead of paying one each.
//! Once sealed (shutdown, an upgrade's hand-over) only the sealing write
//! goes through, so a late background write can never replace it.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;
use resident_api::ApiError;
use tokio::sync::{Notify, oneshot};

use super::shared::Closing;
use crate::journal::{self, Journal};

/// The journal and what of it is on disk.
#[derive(Debug)]
pub(super) struct Durability {
    journal: Journal,
    /// Ends the waits when the agent has closed.
    closing: Closing,
    /// Wakes the writer.
    dirty: Notify,
    /// One write at a time.
    one_writer: Mutex<()>,
    /// Numbers the changes the journal must record.
    changes: AtomicU64,
    state: Mutex<OnDisk>,
    /// Set by shutdown and by an upgrade's hand-over.
    sealed: AtomicBool,
}

/// What of the journal is on disk, and who waits for what.
#[derive(Debug, Default)]
struct OnDisk {
    /// Every change up to this number is on disk.
    written: u64,
    /// The last write failed: the newest change it held, and why.
    failed: Option<(u64, String)>,
    /// Who waits for which change, woken by the write that settles it.
    waiting: BTreeMap<u64, Vec<oneshot::Sender<()>>>,
}

impl OnDisk {
    /// Whether `change` is settled: on disk, or in a write that failed.
    fn settles(&self, change: u64) -> bool {
        self.written >= change || self.failed.as_ref().is_some_and(|f| f.0 >= change)
    }
}

impl Durability {
    pub(super) fn new(journal: Journal, closing: Closing) -> Self {
        Self {
            journal,
            closing,
            dirty: Notify::new(),
            one_writer: Mutex::new(()),
            changes: AtomicU64::new(0),
            state: Mutex::new(OnDisk::default()),
            sealed: AtomicBool::new(false),
        }
    }

    /// The journal, as the agent reads it at a restore.
    pub(super) fn journal(&self) -> &Journal {
        &self.journal
    }

    /// Numbers a change the journal must record and wakes the writer
    /// (unless sealed: the journal stays as the sealing write left it).
    pub(super) fn change(&self) -> u64 {
        let change = self.changes.fetch_add(1, Ordering::SeqCst) + 1;
        if !self.sealed.load(Ordering::Acquire) {
            self.dirty.notify_one();
        }
        change
    }

    /// Numbers a change and, with `wait` (`durable_answers`), waits until
    /// the journal on disk holds it: the answer that follows is then a
    /// promise a crash keeps.
    pub(super) async fn commit(&self, wait: bool) -> Result<(), ApiError> {
        let change = self.change();
        if wait {
            self.settled(change).await?;
        }
        Ok(())
    }

    /// From now on only a sealing write goes through.
    pub(super) fn seal(&self) {
        self.sealed.store(true, Ordering::Release);
    }

    /// Resolves when a change was made since the writer last looked.
    pub(super) async fn dirtied(&self) {
        self.dirty.notified().await;
    }

    /// Why the last write failed, while none has succeeded since.
    pub(super) fn failing(&self) -> Option<String> {
        self.state
            .lock()
            .failed
            .as_ref()
            .map(|(_, why)| why.clone())
    }

    /// Waits until the journal on disk holds `change` (and every earlier
    /// one). Err when the write failed, or the agent finished closing
    /// before it was made. Each waiter is woken once, by the
    /// write that settles its change.
    pub(super) async fn settled(&self, change: u64) -> Result<(), ApiError> {
        let closing = self.closing.finished();
        tokio::pin!(closing);
        loop {
            let woken = {
                let mut d = self.state.lock();
                if d.settles(change) {
                    break;
                }
                let (tx, rx) = oneshot::channel();
                d.waiting.entry(change).or_default().push(tx);
                rx
            };
            tokio::select! {
                _ = woken => {}
                () = &mut closing => break,
            }
        }
        let d = self.state.lock();
        if d.written >= change {
            return Ok(());
        }
        Err(ApiError::Unavailable(match &d.failed {
            Some((_, e)) => format!("the journal could not be written: {e}"),
            None => "the agent is shutting down; the journal was not written".into(),
        }))
    }

    /// Writes what `rows` says the journal should hold now (blocking: it
    /// fsyncs) and settles every change numbered before it was read.
    /// `None` when sealed and this is not the sealing write; else whether
    /// the write succeeded.
    pub(super) fn write(
        &self,
        sealing: bool,
        rows: impl FnOnce() -> (Vec<journal::Entry>, Vec<journal::Learned>),
    ) -> Option<bool> {
        let _one_writer = self.one_writer.lock();
        if !sealing && self.sealed.load(Ordering::Acquire) {
            return None;
        }
        // Read before the rows: every change numbered up to here was made
        // in the books before it took its number.
        let change = self.changes.load(Ordering::SeqCst);
        let was_failing = self.failing().is_some();
        let (entries, learned) = rows();
        let written = self.journal.write(entries, learned);
        let ok = written.is_ok();
        let settled = {
            let mut d = self.state.lock();
            match written {
                Ok(()) => {
                    if was_failing {
                        tracing::info!("the journal is written again: starts resume");
                    }
                    d.written = d.written.max(change);
                    d.failed = None;
                }
                Err(e) => {
                    // Once per failure, not at every retry.
                    if !was_failing {
                        tracing::error!(error = %e, "cannot write the journal: starts are refused until it can be written");
                    }
                    d.failed = Some((change, e.to_string()));
                }
            }
            // Those waiting for a change this write settled.
            let later = d.waiting.split_off(&(change + 1));
            std::mem::replace(&mut d.waiting, later)
        };
        for waiter in settled.into_values().flatten() {
            let _ = waiter.send(());
        }
        Some(ok)
    }
}
