//! What a fleet view keeps of this node (`WatchNode`): the whole node at
//! once (`node_status`), its pools' figures and holds (`Figures`), and
//! the two signals a watcher waits on (`Signals`): figures that may have
//! moved without an event (a probe reading, a measurement, a hold) and a
//! roster that changed (a reload, a learned footprint raised or
//! forgotten). The agent answers with them in `queries.rs`.

use std::sync::atomic::{AtomicU64, Ordering};

use resident_api::pb;
use resident_config::Config;

/// The pools' figures and the holds at one moment of the agent's clock.
#[derive(Debug, Clone)]
pub struct Figures {
    pools: Vec<pb::PoolStatus>,
    /// Each held instance and what is left of its hold at `now`.
    holds: Vec<(String, u64)>,
    now: u64,
}

impl Figures {
    /// `pools` and `holds` (each held instance and what is left of its
    /// hold) read at `now`, on the agent's clock.
    pub fn new(pools: Vec<pb::PoolStatus>, holds: Vec<(String, u64)>, now: u64) -> Self {
        Self { pools, holds, now }
    }

    /// Whether `other` shows the same figures and the same holds (each
    /// ending at the same instant; what is left of one shrinks with time
    /// and is no change).
    pub fn same_as(&self, other: &Figures) -> bool {
        let ends = |f: &Figures| -> Vec<(String, u64)> {
            f.holds
                .iter()
                .map(|(id, left)| (id.clone(), f.now.saturating_add(*left)))
                .collect()
        };
        self.pools == other.pools && ends(self) == ends(other)
    }

    /// As the API sends them.
    pub fn to_pb(&self) -> pb::NodeFigures {
        pb::NodeFigures {
            pools: self.pools.clone(),
            holds: self
                .holds
                .iter()
                .map(|(id, left)| pb::InstanceHold {
                    instance_id: id.clone(),
                    hold_left_ms: *left,
                })
                .collect(),
        }
    }
}

/// The whole node, as `Node` answers: `revision` and `instances` as read
/// together by the caller (the revision first), `pools` read now, and the
/// epoch the revisions belong to.
pub(super) fn node_status(
    config: &Config,
    revision: u64,
    instances: Vec<pb::Instance>,
    pools: Vec<pb::PoolStatus>,
    epoch: u64,
) -> pb::NodeStatus {
    let on_full = match config.node.on_full {
        resident_core::Policy::Refuse => pb::Policy::Refuse,
        resident_core::Policy::Evict => pb::Policy::Evict,
    };
    pb::NodeStatus {
        revision,
        node: config.node.name.clone(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        agent_pid: std::process::id(),
        pools,
        instances,
        epoch,
        on_full: on_full as i32,
    }
}

/// The two signals a fleet view waits on.
#[derive(Debug)]
pub(super) struct Signals {
    /// Bumped when pool figures or holds may have moved without an event.
    figures_moved: tokio::sync::watch::Sender<u64>,
    /// Counts changes of the roster.
    roster_generation: AtomicU64,
}

impl Default for Signals {
    fn default() -> Self {
        Self {
            figures_moved: tokio::sync::watch::Sender::new(0),
            roster_generation: AtomicU64::new(0),
        }
    }
}

impl Signals {
    /// Changes each time the figures may have moved without an event.
    pub fn figures_moved(&self) -> tokio::sync::watch::Receiver<u64> {
        self.figures_moved.subscribe()
    }

    /// Tells watchers that the figures may have moved (a reading, a hold).
    pub fn figures_may_have_moved(&self) {
        self.figures_moved.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Counts changes of the roster (`Workloads`' answer).
    pub fn roster_generation(&self) -> u64 {
        self.roster_generation.load(Ordering::Acquire)
    }

    /// Tells watchers that the roster changed (and so the figures may
    /// have).
    pub fn roster_changed(&self) {
        self.roster_generation.fetch_add(1, Ordering::AcqRel);
        self.figures_may_have_moved();
    }
}
