//! What a fleet view keeps of this node (`WatchNode`): the whole node at
//! once (`node_status`), its pools' figures and holds (`figures`), the
//! roster, the epoch its revisions belong to, and the two signals a
//! watcher waits on: figures that may have moved without an event (a
//! probe reading, a measurement, a hold) and a roster that changed (a
//! reload, a learned footprint raised or forgotten).

use std::sync::atomic::Ordering;

use resident_api::pb;

use super::Agent;

/// The pools' figures and the holds at one moment of the agent's clock.
#[derive(Debug, Clone)]
pub struct Figures {
    pools: Vec<pb::PoolStatus>,
    /// Each held instance and what is left of its hold at `now`.
    holds: Vec<(String, u64)>,
    now: u64,
}

impl Figures {
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

impl Agent {
    /// The epoch of this agent's revisions (drawn when it began afresh;
    /// an upgrade hands it over with the history).
    pub fn epoch(&self) -> u64 {
        self.events.epoch()
    }

    /// The whole node, as `Node` answers: `revision` and `instances` as
    /// read together by the caller (the revision first), the pools read
    /// now.
    pub fn node_status(&self, revision: u64, instances: Vec<pb::Instance>) -> pb::NodeStatus {
        let config = self.config();
        let on_full = match config.node.on_full {
            resident_core::Policy::Refuse => pb::Policy::Refuse,
            resident_core::Policy::Evict => pb::Policy::Evict,
        };
        pb::NodeStatus {
            revision,
            node: config.node.name.clone(),
            version: env!("CARGO_PKG_VERSION").to_string(),
            agent_pid: std::process::id(),
            pools: self.pools(),
            instances,
            epoch: self.epoch(),
            on_full: on_full as i32,
        }
    }

    /// The pools' figures and every hold in force, now.
    pub fn figures(&self) -> Figures {
        let now = self.now_ms();
        Figures {
            pools: self.pools(),
            holds: self.books.holds(now),
            now,
        }
    }

    /// Changes each time the figures may have moved without an event.
    pub fn figures_moved(&self) -> tokio::sync::watch::Receiver<u64> {
        self.figures_moved.subscribe()
    }

    /// Tells watchers that the figures may have moved (a reading, a hold).
    pub(super) fn figures_may_have_moved(&self) {
        self.figures_moved.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Counts changes of the roster (`Workloads`' answer).
    pub fn roster_generation(&self) -> u64 {
        self.roster_generation.load(Ordering::Acquire)
    }

    /// Tells watchers that the roster changed.
    pub(super) fn roster_changed(&self) {
        self.roster_generation.fetch_add(1, Ordering::AcqRel);
        self.figures_may_have_moved();
    }
}
