//! What the books keep per instance id besides the ledger: the record of
//! its current (or last) run, its owner's lease, its overrun.

use std::sync::Arc;

use resident_config::Workload;
use resident_core::{PoolName, Spec};
use resident_supervisor::Adoption;

/// How an instance came to be and which run of it is current.
#[derive(Debug, Clone)]
pub(in crate::agent) struct Record {
    pub(in crate::agent) workload: Arc<Workload>,
    /// What this run holds: the workload's spec with its any-of demands
    /// resolved to the chosen pools.
    pub(in crate::agent) spec: Arc<Spec>,
    /// The device indexes of the chosen pools (`CUDA_VISIBLE_DEVICES`).
    pub(in crate::agent) devices: Vec<u32>,
    /// The pools chosen for each any-of demand, in label order (journaled:
    /// a run taken over keeps them).
    pub(in crate::agent) chosen: Vec<Vec<PoolName>>,
    /// Bumped at every admission of this id; tags the supervisor's run.
    pub(in crate::agent) generation: u64,
    /// A Stop (or an eviction) has been asked for this run. While the run
    /// holds its reservation the ledger says the same (`Phase::Leaving`),
    /// which is what planning reads; this flag outlives the release, for
    /// what the record shows.
    pub(in crate::agent) cancelled: bool,
    /// The owner's lease, if any.
    pub(in crate::agent) lease: Option<Lease>,
    /// Entered by Adopt: the process, and whether the agent may signal it.
    pub(in crate::agent) adopted: Option<Adoption>,
    /// What the agent found about this run beside its state (an adopted
    /// server listening beyond loopback), for its message.
    pub(in crate::agent) note: Option<String>,
    /// Measured above its reservation: in which pools, and the words of
    /// its message.
    pub(in crate::agent) overrun: Option<Overrun>,
    /// What this run's measurements teach (`learn_footprints`): the key
    /// of its command and files; `None`: not learning (or adopted).
    pub(in crate::agent) footprint_key: Option<u64>,
    /// What its server reported allocating once READY (`report.rs`).
    pub(in crate::agent) report: Option<resident_config::report::Report>,
    /// Why a stop was asked for this run (the typed form of its words).
    pub(in crate::agent) cause: Option<resident_api::pb::Cause>,
    /// Where it is with sleep (`[workload.sleep]`); `None`: awake, never
    /// put to sleep this run.
    pub(in crate::agent) sleep: Option<Sleepy>,
}

/// Where a run is with sleep. The ledger's `Tier` is what it holds; this
/// is what its view says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::agent) enum Sleepy {
    /// Its sleep call is under way.
    Falling,
    /// Asleep since this instant (the agent's milliseconds).
    Asleep(u64),
    /// Its wake call is under way.
    Waking,
    /// Awake again: the wake took this many milliseconds.
    Woken(u64),
}

/// A run measured above its reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(in crate::agent) struct Overrun {
    /// The pools it overran, in name order: an event is told when these
    /// change, not at every reading.
    pub(in crate::agent) pools: Vec<PoolName>,
    /// `OVERRUN: ...` with both figures of each pool.
    pub(in crate::agent) text: String,
}

/// A run whose overrun began, changed pools or ended.
#[derive(Debug)]
pub(in crate::agent) struct OverrunChange {
    pub(in crate::agent) id: String,
    pub(in crate::agent) generation: u64,
    /// `None`: back within its reservation.
    pub(in crate::agent) overrun: Option<Overrun>,
    /// Whether the agent may stop it (not an unmanaged adoption) and no
    /// Stop asked for it yet.
    pub(in crate::agent) stoppable: bool,
    pub(in crate::agent) on_overrun: resident_config::OnOverrun,
}

impl Record {
    /// Whether the agent may act on this run's process (stop it, put it
    /// to sleep): not cancelled, and not adopted without `manage`.
    pub(in crate::agent) fn stoppable(&self) -> bool {
        !self.cancelled && self.adopted.is_none_or(|a| a.manage)
    }

    /// Run `generation` of `w` holding `spec`: not cancelled, no lease, no
    /// devices, not adopted, no note.
    pub(super) fn run(w: &Arc<Workload>, spec: Arc<Spec>, generation: u64) -> Self {
        Self {
            workload: w.clone(),
            spec,
            devices: Vec::new(),
            chosen: Vec::new(),
            generation,
            cancelled: false,
            lease: None,
            adopted: None,
            note: None,
            overrun: None,
            footprint_key: None,
            report: None,
            cause: None,
            sleep: None,
        }
    }
}

/// An owner's lease on an instance: it runs out at `until` (the agent's
/// monotonic milliseconds) unless a Touch renews it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(in crate::agent) struct Lease {
    pub(in crate::agent) ms: u64,
    pub(in crate::agent) until: u64,
}

impl Lease {
    /// A lease of `ms` from `now`; none for 0.
    pub(in crate::agent) fn new(ms: u64, now: u64) -> Option<Self> {
        (ms > 0).then(|| Self {
            ms,
            until: now.saturating_add(ms),
        })
    }
}
