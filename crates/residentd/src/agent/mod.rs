//! The agent: a small coordinator over rooms with walls. Each room is a
//! struct holding the handles it needs (the books, the supervisor, the
//! journal's durability, another room) and nothing else, taken from the
//! parts (`parts.rs`) in its `new` and kept in fields of its own; no file
//! here but this one names `Agent` (`walls.rs` checks these, and that
//! the rooms use each other one way, with no circle). Every RPC of the service is one
//! method here, handed to the room that answers it; the service only
//! translates. Here: the parts and rooms built, shutdown, and the walk of
//! an upgrade.
//!
//! The rooms that carry the agent's flows, in the order they use each
//! other: `tell.rs` (an instance as the agent tells it, and the events
//! that carry it), `reading.rs` (the probes' readings into the books),
//! `stop.rs` (every stop), `sleep.rs` (sleeps and wakes,
//! `[workload.sleep]`), `admission.rs` (a Start, its wake, an Adopt),
//! `restore.rs` (the journaled instances back after a restart), then
//! `follower.rs` (the supervisor's transitions, the one place a run's end
//! releases its memory, and the per-second tick) and `queries.rs` (pools,
//! Place, Touch, Node, the roster, reload). `persist.rs` composes what the
//! journal holds for its one writer.
//!
//! The parts they share: `books.rs` (admits, releases and cancels:
//! nothing else touches the ledger), `upgrade.rs` (where an upgrade
//! stands, what it hands over), `durability.rs` (change numbers, the
//! journal written with group commit, who waits for what), `adoption.rs`
//! (what Adopt checks of a process), `probes.rs` (host and device probes,
//! their health, per-process device use, the wait for memory to come
//! back), `exposure.rs` (who listens beyond loopback under `expose =
//! "loopback"`), `overrun.rs` (an overrun's words and whether its policy
//! stops it), `picture.rs` (what a fleet view keeps of the node,
//! `WatchNode`), `kv.rs` (saved conversations and the disk pools' books),
//! `http.rs` (the client for the servers' own endpoints), `roster.rs` (a
//! workload by name) and `shared.rs` (the clock, the config in force, the
//! agent's end); `parts.rs` hands them to the rooms.
//!
//! No code here reads the file system or scans /proc on a runtime thread:
//! clippy's `disallowed_methods` (crates/residentd/clippy.toml) is on for
//! this module, and what must read runs on a blocking thread, allowed
//! function by function with the reason.

#![warn(clippy::disallowed_methods)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use resident_api::{ApiError, pb};
use resident_config::Config;
use resident_core::{InstanceId, Policy};
use resident_probe::MemoryProbe;
use resident_supervisor::{Supervisor, SupervisorConfig};
use tokio::sync::mpsc;

use crate::events::EventLog;
use crate::journal::Journal;
use crate::metrics::Metrics;
use upgrade::Stage;

mod admission;
mod adoption;
mod books;
mod durability;
mod exposure;
mod follower;
mod http;
mod kv;
mod overrun;
mod parts;
mod persist;
mod picture;
mod probes;
mod queries;
mod reading;
mod restore;
mod roster;
mod shared;
mod sleep;
mod stop;
mod tell;
mod upgrade;
#[cfg(test)]
mod walls;

pub use admission::Started;
pub use adoption::AdoptCall;
use books::Books;
pub use books::Hold;
pub use picture::Figures;
pub use queries::ReloadHook;

/// How long shutdown waits for the supervisor's last terminal events to
/// release every reservation.
const SHUTDOWN_RELEASE: Duration = Duration::from_secs(5);

/// The node agent.
#[derive(Debug)]
pub struct Agent {
    parts: parts::Parts,
    /// Where an upgrade stands (`upgrade.rs`).
    upgrade: upgrade::Upgrades,
    teller: Arc<tell::Teller>,
    reader: Arc<reading::Reader>,
    stopper: Arc<stop::Stopper>,
    sleeps: Arc<sleep::Sleeps>,
    admissions: Arc<admission::Admissions>,
    queries: Arc<queries::Queries>,
    /// Held, never called: the supervisor's follower and the tick hold it
    /// weakly, and end with the agent.
    #[allow(dead_code, reason = "its tasks end when the agent drops it")]
    follower: Arc<follower::Follower>,
    scribe: Arc<persist::Scribe>,
    restorer: Arc<restore::Restorer>,
}

impl Agent {
    /// An agent for `config`, reading host memory from `host`. Starts the
    /// tasks that follow the supervisor and the probes; must run inside a
    /// tokio runtime.
    pub fn new(config: Config, host: Arc<dyn MemoryProbe>) -> std::io::Result<Arc<Self>> {
        let journal = Journal::open(&config.node.state_dir)?;
        let (tx, rx) = mpsc::unbounded_channel();
        let sup_config = SupervisorConfig {
            sample_every: config.node.sample_every,
            cgroups: config.node.cgroups,
            outlive: config
                .node
                .instances_outlive_agent
                .then(|| config.node.state_dir.join("output")),
            ..SupervisorConfig::default()
        };
        // The history handed over by the agent an upgrade replaced, if any.
        let events = Arc::new(EventLog::new(4096, 1024));
        events.load(&config.node.state_dir, upgrade::EVENTS_FILE);
        let config = Arc::new(config);
        let kv = Arc::new(kv::KvStore::default());
        kv.configure(&config);
        let closing = shared::Closing::new();
        let p = parts::Parts {
            books: Arc::new(Books::new(&config)),
            config: shared::Current::new(config),
            sup: Supervisor::new(sup_config, tx),
            events,
            metrics: Arc::new(Metrics::new()),
            durability: Arc::new(durability::Durability::new(journal, closing.clone())),
            kv,
            probes: Arc::new(probes::Probes::new(host)),
            signals: Arc::new(picture::Signals::default()),
            keys: Arc::new(roster::Keys::default()),
            clock: shared::Clock::new(),
            closing,
        };
        // The rooms, each built on those it uses.
        let teller = Arc::new(tell::Teller::new(&p));
        let reader = Arc::new(reading::Reader::new(&p, teller.clone()));
        let stopper = Arc::new(stop::Stopper::new(&p, teller.clone()));
        let sleeps = Arc::new(sleep::Sleeps::new(&p, teller.clone(), stopper.clone()));
        let admissions = Arc::new(admission::Admissions::new(
            &p,
            teller.clone(),
            reader.clone(),
            stopper.clone(),
            sleeps.clone(),
        ));
        let queries = Arc::new(queries::Queries::new(&p, teller.clone(), reader.clone()));
        let follower = Arc::new(follower::Follower::new(
            &p,
            teller.clone(),
            reader.clone(),
            stopper.clone(),
            sleeps.clone(),
        ));
        let scribe = Arc::new(persist::Scribe::new(&p));
        let restorer = Arc::new(restore::Restorer::new(
            &p,
            admissions.clone(),
            sleeps.clone(),
        ));
        reader.open_device_probes();
        reader.refresh();
        tokio::spawn(follower::follow_supervisor(Arc::downgrade(&follower), rx));
        tokio::spawn(follower::tick(Arc::downgrade(&follower)));
        tokio::spawn(persist::write_journal(Arc::downgrade(&scribe)));
        Ok(Arc::new(Self {
            parts: p,
            upgrade: upgrade::Upgrades::default(),
            teller,
            reader,
            stopper,
            sleeps,
            admissions,
            queries,
            follower,
            scribe,
            restorer,
        }))
    }

    /// The configuration in force. A request takes it once and decides on
    /// that one snapshot, so a reload never mixes two configs in it.
    pub fn config(&self) -> Arc<Config> {
        self.parts.config.get()
    }

    /// Has `hook` take each reloaded config (old, new) before the agent
    /// does: an error refuses the reload, and nothing changes. A listener
    /// follows its certificates this way.
    pub fn on_reload(&self, hook: ReloadHook) {
        self.queries.on_reload(hook);
    }

    /// The metrics.
    pub fn metrics(&self) -> &Metrics {
        &self.parts.metrics
    }

    /// The event log.
    pub fn events(&self) -> &EventLog {
        &self.parts.events
    }

    /// Resolves once shutdown has begun; Watch and Logs streams end then.
    pub fn closing(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        self.parts.closing.finished()
    }

    /// The supervisor.
    pub fn supervisor(&self) -> &Supervisor {
        &self.parts.sup
    }

    /// Refuses new starts and stops every instance gracefully; returns
    /// once their terminal events have released every reservation
    /// (bounded). The journal keeps what ran at shutdown, so the next
    /// start of the agent (an upgrade, a restart) brings the same
    /// instances back.
    pub async fn shutdown(&self) {
        self.close();
        // The last write fsyncs: off the runtime's worker (a runtime of
        // one thread has no other to hand its tasks to).
        let flavor = tokio::runtime::Handle::current().runtime_flavor();
        if flavor == tokio::runtime::RuntimeFlavor::MultiThread {
            tokio::task::block_in_place(|| self.scribe.write_now(true));
        } else {
            self.scribe.write_now(true);
        }
        self.parts.closing.finish();
        self.parts.sup.shutdown().await;
        let released = async {
            for id in self.parts.books.resident_ids() {
                if let Some(r) = self.parts.books.record(&id) {
                    self.parts.books.released(&id, r.generation).await;
                }
            }
        };
        if tokio::time::timeout(SHUTDOWN_RELEASE, released)
            .await
            .is_err()
        {
            tracing::warn!(held = ?self.parts.books.resident_ids(), "reservations still held after shutdown");
        }
    }

    /// Nothing moves after this: no admission, nothing the agent decides
    /// by itself (an idle sleep or stop, a lease's expiry), and only the
    /// sealing write of the journal (shutdown, hand-over) goes through.
    fn close(&self) {
        self.parts.books.close();
        self.parts.closing.close();
        self.parts.durability.seal();
    }

    /// Whether an upgrade is under way (changes are refused meanwhile).
    pub fn upgrading(&self) -> bool {
        self.upgrade.upgrading()
    }

    /// Resolves once an upgrade has begun to hand everything over.
    pub fn handing_over(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        self.upgrade.handing_over()
    }

    /// Resolves once the next agent serves.
    pub fn upgraded(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        self.upgrade.upgraded()
    }

    /// Replaces this agent with the binary now at its path, without
    /// stopping an instance. Answers once the next agent serves.
    /// FAILED_PRECONDITION when the new binary fails its check (nothing
    /// changed); INTERNAL when it did not start: this agent then executes
    /// itself afresh and takes everything over again.
    pub async fn upgrade(self: Arc<Self>) -> Result<pb::UpgradeResponse, ApiError> {
        let old_version = env!("CARGO_PKG_VERSION").to_string();
        if !self.config().node.instances_outlive_agent {
            return Err(ApiError::FailedPrecondition(
                "instances_outlive_agent = false: every instance would die with this agent; restart it instead".into(),
            ));
        }
        if !self.upgrade.begin() {
            return Err(ApiError::Unavailable(
                "an upgrade is already under way".into(),
            ));
        }
        let back = |e: ApiError| {
            self.upgrade.to(Stage::Idle);
            Err(e)
        };
        let new_version = match crate::upgrade::check_next().await {
            Ok(v) => v,
            Err(why) => {
                return back(ApiError::FailedPrecondition(format!(
                    "the new binary was not started: {why}; nothing changed"
                )));
            }
        };
        tracing::info!(old = %old_version, new = %new_version, "upgrading: the new binary passed its check");
        // Starts admitted before changes were refused are spawned first,
        // so the journal names every process.
        let deadline = Instant::now() + upgrade::SETTLE_BOUND;
        while self
            .list()
            .iter()
            .any(|i| i.state == pb::State::Pending as i32)
        {
            if Instant::now() >= deadline {
                return back(ApiError::Unavailable(
                    "starts are still under way; try the upgrade again".into(),
                ));
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        // From here on this process image ends: the next agent serves, or
        // this one runs afresh.
        self.upgrade.to(Stage::HandingOver);
        // Nothing the agent decides by itself (an idle sleep or stop, a
        // lease's expiry) begins after the journal below.
        self.close();
        self.parts.closing.finish();
        self.parts.sup.hand_over(upgrade::HAND_OVER_BOUND).await;
        let scribe = self.scribe.clone();
        let _ = tokio::task::spawn_blocking(move || scribe.write_now(true)).await;
        let state_dir = self.config().node.state_dir.clone();
        if let Err(e) = self.parts.events.save(&state_dir, upgrade::EVENTS_FILE) {
            tracing::warn!(error = %e, "cannot hand the event history over; watchers will list again");
        }
        upgrade::hand_holds_over(
            &state_dir,
            &self.parts.books.holds(self.parts.clock.now_ms()),
        );
        tracing::info!("every instance handed over; starting the new binary");
        match crate::upgrade::start_next().await {
            Ok(next) => {
                crate::upgrade::hand_main_pid(next.pid);
                self.upgrade.to(Stage::Upgraded);
                tracing::info!(pid = next.pid, version = %next.version, "the upgraded agent serves");
                Ok(pb::UpgradeResponse {
                    old_version,
                    new_version: next.version,
                })
            }
            Err(why) => {
                tracing::error!(error = %why, "the new binary did not start; this agent executes itself afresh");
                // After the answer has gone out.
                std::thread::spawn(|| {
                    std::thread::sleep(Duration::from_millis(300));
                    let e = crate::upgrade::reexec_self();
                    tracing::error!(error = %e, "cannot execute the agent afresh");
                    std::process::exit(1);
                });
                Err(ApiError::Internal(format!(
                    "the new binary did not start: {why}; this agent ({old_version}) goes on, executed afresh"
                )))
            }
        }
    }
}

/// The calls of the service, each handed to the room that answers it.
impl Agent {
    /// Starts an instance of `workload`: plan and reserve atomically, stop
    /// the victims, spawn, and (with `wait_ready`) wait for READY. Answers
    /// once the journal on disk holds the instance.
    pub async fn start(
        &self,
        workload: &str,
        id: Option<InstanceId>,
        policy: Option<Policy>,
        wait_ready: bool,
        lease_ms: u64,
    ) -> Result<Started, ApiError> {
        let admissions = &self.admissions;
        admissions
            .start(workload, id, policy, wait_ready, lease_ms)
            .await
    }

    /// Stops an instance and answers once its group has exited, its
    /// memory is released and the journal on disk no longer lists it.
    pub async fn stop(&self, id: &str, grace: Option<Duration>) -> Result<pb::Instance, ApiError> {
        self.stopper.stop(id, None, grace, None).await
    }

    /// Adopts a running process (`adoption.rs`); answers once the journal
    /// on disk holds it.
    pub async fn adopt(&self, call: AdoptCall) -> Result<pb::Instance, ApiError> {
        self.admissions.adopt(call).await
    }

    /// Puts `id` to sleep (the Sleep RPC); answers once it is SLEEPING.
    pub async fn sleep(&self, id: &str) -> Result<pb::Instance, ApiError> {
        self.sleeps.sleep(id).await
    }

    /// After a restart: the journaled instances admitted again, then
    /// taken over or spawned (`restore.rs`).
    pub async fn restore(&self) {
        self.restorer.restore().await;
    }

    /// One instance.
    pub fn get(&self, id: &str) -> Result<pb::Instance, ApiError> {
        self.teller.get(id)
    }

    /// Every instance, in id order.
    pub fn list(&self) -> Vec<pb::Instance> {
        self.teller.list()
    }

    /// The pools as they are.
    pub fn pools(&self) -> Vec<pb::PoolStatus> {
        self.queries.pools()
    }

    /// The placement query: what a Start would do, changing nothing; of
    /// a Start naming `id`, when given.
    pub async fn place(
        &self,
        workload: &str,
        policy: Option<Policy>,
        id: Option<&InstanceId>,
    ) -> Result<pb::Placement, ApiError> {
        self.queries.place(workload, policy, id).await
    }

    /// The roster: every workload with its declared and learned demand.
    pub fn workloads(&self) -> Vec<pb::Workload> {
        self.queries.workloads()
    }

    /// Forgets what was learned for `workload` (a name or alias).
    pub async fn forget_footprint(&self, workload: &str) -> Result<pb::Workload, ApiError> {
        self.queries.forget_footprint(workload).await
    }

    /// Marks a use of `id` and protects it from eviction, or ends that
    /// protection, as `hold` says.
    pub fn touch(&self, id: &str, hold: Hold) -> Result<pb::Instance, ApiError> {
        self.queries.touch(id, hold)
    }

    /// Re-reads the configuration file: workloads, groups and pools change;
    /// running instances are not touched. An invalid file changes nothing.
    pub fn reload(&self) -> Result<Vec<String>, resident_config::ConfigError> {
        self.queries.reload()
    }

    /// Reads the live probes into the books now.
    pub fn refresh_probes(&self) {
        self.reader.refresh();
    }

    /// The epoch of this agent's revisions.
    pub fn epoch(&self) -> u64 {
        self.queries.epoch()
    }

    /// The whole node, as `Node` answers.
    pub fn node_status(&self, revision: u64, instances: Vec<pb::Instance>) -> pb::NodeStatus {
        self.queries.node_status(revision, instances)
    }

    /// The pools' figures and every hold in force, now.
    pub fn figures(&self) -> Figures {
        self.queries.figures()
    }

    /// Changes each time the figures may have moved without an event.
    pub fn figures_moved(&self) -> tokio::sync::watch::Receiver<u64> {
        self.queries.figures_moved()
    }

    /// Counts changes of the roster (`Workloads`' answer).
    pub fn roster_generation(&self) -> u64 {
        self.queries.roster_generation()
    }
}
