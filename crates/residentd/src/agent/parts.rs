//! The parts the agent's rooms are built from: the books, the supervisor,
//! the event log, the metrics, the journal's durability, the disk pools,
//! the probes, the fleet views' signals, the footprint keys, and what
//! `shared.rs` holds. Each room takes what it needs of them in its `new`
//! and keeps nothing else; its fields are its own.

use std::sync::Arc;

use resident_supervisor::Supervisor;

use super::books::Books;
use super::durability::Durability;
use super::kv::KvStore;
use super::picture::Signals;
use super::probes::Probes;
use super::roster::Keys;
use super::shared::{Clock, Closing, Current};
use crate::events::EventLog;
use crate::metrics::Metrics;

/// The parts, each a handle.
#[derive(Debug, Clone)]
pub(super) struct Parts {
    pub(super) config: Current,
    pub(super) books: Arc<Books>,
    pub(super) sup: Supervisor,
    pub(super) events: Arc<EventLog>,
    pub(super) metrics: Arc<Metrics>,
    pub(super) durability: Arc<Durability>,
    pub(super) kv: Arc<KvStore>,
    pub(super) probes: Arc<Probes>,
    pub(super) signals: Arc<Signals>,
    pub(super) keys: Arc<Keys>,
    pub(super) clock: Clock,
    pub(super) closing: Closing,
}
