//! The books: the ledger (`NodeState`) and a record per instance id, under
//! one lock. This room holds the lock and the table; `admit.rs` admits,
//! releases and cancels (and says what a decision saw), `records.rs` is
//! what a record keeps, `learned.rs` the learned footprints that raise a
//! reservation, `views.rs` everything read or fed in besides (readings,
//! overruns, leases, idle expiry, the journal's rows). `Books` is the only way to admit, release and cancel: an
//! admission plans and reserves in one critical section, and everything
//! said about the decision (a refusal's Placement with its pool figures,
//! the victims with their causes, what to wait for) comes out of that same
//! section, so an answer never contradicts the decision it explains.
//!
//! Memory is released in one place, `Books::release`, called with the run
//! (generation) whose end it marks: by the supervisor's terminal event for
//! that run, or by the admission path for a run that was never spawned.
//! Nothing under the lock makes a system call, writes the journal or calls
//! into the supervisor.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use parking_lot::{Mutex, MutexGuard};
use resident_config::Config;
use resident_core::{InstanceId, NodeState, Spec};
use tokio::sync::oneshot;

mod admit;
mod learned;
mod records;
mod sleep;
mod views;

pub(in crate::agent) use admit::*;
pub(in crate::agent) use records::*;
pub(in crate::agent) use views::*;

/// What a Touch does to an instance's hold against eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Holds it at least this many milliseconds from now (0: no change).
    For(u64),
    /// Ends the hold now.
    Release,
}

/// A Stop's mark on the books.
#[derive(Debug)]
pub(super) struct Cancelled {
    pub(super) generation: u64,
    /// What the run holds (its chosen pools).
    pub(super) spec: Arc<Spec>,
    /// Whether the run still holds its reservation.
    pub(super) resident: bool,
}

#[derive(Debug)]
struct Inner {
    ledger: NodeState,
    records: BTreeMap<String, Record>,
    /// The records whose run holds no reservation, oldest run first: what
    /// `prune_ended` forgets first (kept here so that an admission does
    /// not walk the whole table).
    ended: BTreeSet<(u64, String)>,
    generation: u64,
    /// Who waits for each instance's release (Stops, Starts of a stopping
    /// instance, shutdown): told by `release`, each for its own instance
    /// only, so a storm of n stops wakes n waiters, not n squared.
    waiters: HashMap<String, Vec<oneshot::Sender<()>>>,
    /// Learned footprints, by workload name.
    learned: BTreeMap<String, learned::Learning>,
    /// The config the ledger is set up for: an admission decided on
    /// another snapshot (a reload between) is decided again.
    config: Arc<Config>,
    /// The agent is closing or handing over: its last journal is being
    /// written, so nothing the agent decides by itself (an idle sleep or
    /// stop, a lease's expiry) begins any more.
    closed: bool,
}

impl Inner {
    /// Enters the record of a run just reserved, in place of the ended
    /// record of the same id, if any.
    fn enter(&mut self, id: &InstanceId, record: Record) {
        if let Some(before) = self.records.insert(id.to_string(), record) {
            self.ended.remove(&(before.generation, id.to_string()));
        }
    }

    /// Whether `ended` lists exactly the records without a reservation.
    #[cfg(test)]
    fn ended_is_true(&self) -> bool {
        let truth: BTreeSet<(u64, String)> = self
            .records
            .iter()
            .filter(|(id, _)| self.ledger.resident(id).is_none())
            .map(|(id, r)| (r.generation, id.clone()))
            .collect();
        truth == self.ended
    }

    /// A receiver that fires at the next release of `id`; registered
    /// under the lock, so no release is missed.
    fn waiter(&mut self, id: &str) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        let waiting = self.waiters.entry(id.to_string()).or_default();
        // Waiters that gave up (a cancelled call) go now.
        waiting.retain(|w| !w.is_closed());
        waiting.push(tx);
        rx
    }
}

/// The books of one agent.
#[derive(Debug)]
pub(super) struct Books {
    inner: Mutex<Inner>,
}

impl Books {
    pub(super) fn new(config: &Arc<Config>) -> Self {
        let mut ledger = NodeState::new(config.pool_configs(), config.groups.clone());
        ledger.set_gpu_choice(config.node.gpu_choice);
        Self {
            inner: Mutex::new(Inner {
                ledger,
                records: BTreeMap::new(),
                ended: BTreeSet::new(),
                generation: 0,
                waiters: HashMap::new(),
                learned: BTreeMap::new(),
                config: config.clone(),
                closed: false,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock()
    }

    /// From now on nothing the agent decides by itself begins: no idle
    /// sleep or stop, no lease expiry (`idle`, `sleepy`, `leases_expired`
    /// list nothing, and `begin_sleep` refuses). Called before the last
    /// journal write of a shutdown or an upgrade, so that the next agent
    /// finds every run as that write says.
    pub(super) fn close(&self) {
        self.lock().closed = true;
    }
}

#[cfg(test)]
mod properties;
#[cfg(test)]
mod tests;
