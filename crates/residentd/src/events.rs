//! The event log behind `Watch`: every transition and refusal gets the next
//! revision; a bounded history lets a client resume, and a broadcast feeds
//! live watchers (and followed `Logs` calls, which end with their
//! instance's run). Revision order equals delivery order, because both are
//! decided under one lock. Revisions belong to an epoch, drawn at random
//! when the log begins afresh and handed over with the history by an
//! upgrade: a client that kept a revision of another epoch (the agent
//! crashed and began again at 0) must not resume from it.

use std::collections::VecDeque;

use parking_lot::Mutex;
use resident_api::pb;
use tokio::sync::broadcast;

/// How a watch can begin.
#[derive(Debug)]
pub enum Resume {
    /// The events to send first, then everything from the receiver.
    From(Vec<pb::Event>, broadcast::Receiver<pb::Event>),
    /// The revision asked for is older than the history kept; re-list.
    TooOld {
        /// The oldest revision that can still be resumed after.
        oldest: u64,
    },
}

#[derive(Debug)]
struct Inner {
    revision: u64,
    epoch: u64,
    history: VecDeque<pb::Event>,
}

/// The log.
#[derive(Debug)]
pub struct EventLog {
    inner: Mutex<Inner>,
    live: broadcast::Sender<pb::Event>,
    keep: usize,
}

/// What `save` writes after the revision before the epoch: eight bytes
/// no file of the earlier format can begin its events with (a length
/// varint of 0xff bytes is longer than any file).
const EPOCH_MARK: [u8; 8] = [0xff; 8];

/// A fresh epoch: eight random bytes from the kernel, never 0 (0 means
/// "none" in a request). Without /dev/urandom, the process's randomly
/// seeded hasher over the pid and the clock.
fn fresh_epoch() -> u64 {
    use std::io::Read as _;
    let mut bytes = [0u8; 8];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    let epoch = match read {
        Ok(()) => u64::from_le_bytes(bytes),
        Err(_) => {
            use std::hash::BuildHasher as _;
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            std::collections::hash_map::RandomState::new().hash_one((std::process::id(), now))
        }
    };
    epoch.max(1)
}

impl EventLog {
    /// A log keeping `keep` events for resumption and buffering `buffer`
    /// events per live watcher.
    pub fn new(keep: usize, buffer: usize) -> Self {
        let (live, _) = broadcast::channel(buffer.max(1));
        Self {
            inner: Mutex::new(Inner {
                revision: 0,
                epoch: fresh_epoch(),
                history: VecDeque::new(),
            }),
            live,
            keep: keep.max(1),
        }
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// Publishes `event` with the next revision; returns the revision.
    pub fn publish(&self, mut event: pb::Event) -> u64 {
        let mut inner = self.lock();
        inner.revision += 1;
        event.revision = inner.revision;
        if inner.history.len() == self.keep {
            inner.history.pop_front();
        }
        // A copy only for live watchers, when there are any (a node often
        // has none: every transition would pay a deep copy for nothing).
        if self.live.receiver_count() > 0 {
            let _ = self.live.send(event.clone());
        }
        inner.history.push_back(event);
        inner.revision
    }

    /// Writes the revision, the epoch and the kept history to file `name`
    /// of the state directory `dir`, for the agent an upgrade hands over
    /// to (`load`); never through a link (`state_files`).
    pub fn save(&self, dir: &std::path::Path, name: &str) -> std::io::Result<()> {
        use prost::Message as _;
        let inner = self.lock();
        let mut bytes = inner.revision.to_le_bytes().to_vec();
        bytes.extend_from_slice(&EPOCH_MARK);
        bytes.extend_from_slice(&inner.epoch.to_le_bytes());
        for e in &inner.history {
            e.encode_length_delimited(&mut bytes)
                .map_err(std::io::Error::other)?;
        }
        crate::state_files::write_new(dir, name, &bytes)
    }

    /// Takes over what `save` wrote in `dir`, if anything, and removes
    /// the file: revisions go on from where the previous agent's ended, in
    /// its epoch, and a watcher resumes across the upgrade without a gap.
    /// A file of an agent that wrote no epoch keeps this log's fresh one.
    pub fn load(&self, dir: &std::path::Path, name: &str) {
        use prost::Message as _;
        let Ok(bytes) = crate::state_files::read(dir, name) else {
            return;
        };
        crate::state_files::remove(dir, name);
        let Some((revision, mut rest)) = bytes.split_first_chunk::<8>() else {
            return;
        };
        let mut inner = self.lock();
        inner.revision = u64::from_le_bytes(*revision);
        if let Some((mark, after)) = rest.split_first_chunk::<8>()
            && *mark == EPOCH_MARK
            && let Some((epoch, events)) = after.split_first_chunk::<8>()
        {
            inner.epoch = u64::from_le_bytes(*epoch).max(1);
            rest = events;
        }
        while !rest.is_empty() {
            match pb::Event::decode_length_delimited(&mut rest) {
                Ok(e) => {
                    if inner.history.len() == self.keep {
                        inner.history.pop_front();
                    }
                    inner.history.push_back(e);
                }
                Err(_) => break,
            }
        }
    }

    /// The revision of the latest event published.
    pub fn revision(&self) -> u64 {
        self.lock().revision
    }

    /// The epoch its revisions belong to.
    pub fn epoch(&self) -> u64 {
        self.lock().epoch
    }

    /// Begins a watch with the whole state: under one lock, the live
    /// receiver, the latest revision and `snapshot()` (the books as they
    /// are, which may be a step ahead of the events published: such a
    /// change shows in the snapshot and again in its event).
    pub fn begin<T>(
        &self,
        snapshot: impl FnOnce() -> T,
    ) -> (u64, T, broadcast::Receiver<pb::Event>) {
        let inner = self.lock();
        let rx = self.live.subscribe();
        (inner.revision, snapshot(), rx)
    }

    /// Every event published from now on (no snapshot, no history).
    pub fn subscribe(&self) -> broadcast::Receiver<pb::Event> {
        self.live.subscribe()
    }

    /// Begins a watch. `since == 0`: one SNAPSHOT event per instance from
    /// `snapshot`, numbered with the current revision, then every later
    /// event. The snapshot is the books as they are, which can be a step
    /// ahead of the published events (a run spawned whose STARTING event
    /// the follower has not published yet): such a change shows in the
    /// snapshot and again in its event.
    /// `since > 0`: the kept events after `since`, then every later one.
    pub fn resume(&self, since: u64, snapshot: impl FnOnce() -> Vec<pb::Instance>) -> Resume {
        let inner = self.lock();
        let rx = self.live.subscribe();
        if since == 0 {
            let events = snapshot()
                .into_iter()
                .map(|i| pb::Event {
                    revision: inner.revision,
                    instance: Some(i),
                    kind: pb::EventKind::Snapshot as i32,
                    ..Default::default()
                })
                .collect();
            return Resume::From(events, rx);
        }
        let oldest = inner
            .history
            .front()
            .map_or(inner.revision, |e| e.revision.saturating_sub(1));
        if since < oldest || since > inner.revision {
            return Resume::TooOld { oldest };
        }
        let events = inner
            .history
            .iter()
            .filter(|e| e.revision > since)
            .cloned()
            .collect();
        Resume::From(events, rx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(workload: &str) -> pb::Event {
        pb::Event {
            workload: workload.into(),
            ..Default::default()
        }
    }

    #[tokio::test]
    async fn resumes_without_gap_or_repeat_and_refuses_what_it_forgot() {
        let log = EventLog::new(3, 16);
        for w in ["a", "b", "c", "d"] {
            log.publish(event(w));
        }
        // History holds revisions 2..=4: resuming after 1 still works.
        let Resume::From(events, _) = log.resume(1, Vec::new) else {
            panic!("revision 1 is the last one before the kept history");
        };
        assert_eq!(events.len(), 3);
        let Resume::From(events, mut rx) = log.resume(2, Vec::new) else {
            panic!("revision 2 is kept");
        };
        let revs: Vec<u64> = events.iter().map(|e| e.revision).collect();
        assert_eq!(revs, [3, 4]);
        log.publish(event("e"));
        assert_eq!(rx.recv().await.expect("live").revision, 5);
        let log = EventLog::new(2, 16);
        for w in ["a", "b", "c", "d"] {
            log.publish(event(w));
        }
        assert!(matches!(
            log.resume(1, Vec::new),
            Resume::TooOld { oldest: 2 }
        ));
        assert!(matches!(log.resume(9, Vec::new), Resume::TooOld { .. }));
    }

    #[test]
    fn an_upgrade_hands_the_epoch_over_and_a_fresh_log_draws_another() {
        let dir = tempfile::tempdir().expect("tempdir");
        let old = EventLog::new(8, 16);
        old.publish(event("a"));
        old.publish(event("b"));
        old.save(dir.path(), "h").expect("save");
        let new = EventLog::new(8, 16);
        assert_ne!(new.epoch(), old.epoch(), "two fresh logs, two epochs");
        new.load(dir.path(), "h");
        assert_eq!((new.epoch(), new.revision()), (old.epoch(), 2));
        let Resume::From(events, _) = new.resume(1, Vec::new) else {
            panic!("revision 1 was handed over");
        };
        assert_eq!(events.len(), 1);
        assert_eq!(events[0].workload, "b");
        // A file of the earlier format (no epoch): the history is taken,
        // the fresh epoch kept.
        use prost::Message as _;
        let mut bytes = 5u64.to_le_bytes().to_vec();
        event("c")
            .encode_length_delimited(&mut bytes)
            .expect("encode");
        crate::state_files::write_new(dir.path(), "old", &bytes).expect("write");
        let log = EventLog::new(8, 16);
        let fresh = log.epoch();
        log.load(dir.path(), "old");
        assert_eq!((log.epoch(), log.revision()), (fresh, 5));
        assert_ne!(fresh, 0);
    }
}
