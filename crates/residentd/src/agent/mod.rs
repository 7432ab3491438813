//! The agent: the books (one lock, so plan-and-reserve is atomic), the
//! supervisor, the event log, the probes and the journal, joined. Every
//! RPC of the service is one method here; the service only translates.
//!
//! The coordinator's rooms, each an `impl Agent` of its own:
//! `admission.rs` carries a Start, an Adopt and a Stop out; `follower.rs`
//! applies the supervisor's transitions (the one place a run's end
//! releases its memory), feeds the probes' readings to the books and runs
//! the periodic work; `queries.rs` answers Get, List, Place, Touch, Node
//! and reload; `persist.rs` composes what the journal holds and restores
//! from it; `sleep.rs` puts servers to sleep and wakes them
//! (`[workload.sleep]`). Here: the parts joined, shutdown, and the walk
//! of an upgrade.
//!
//! Rooms with walls, which import nothing of the agent: `books.rs`
//! (admits, releases and cancels: nothing else touches the ledger),
//! `upgrade.rs` (where an upgrade stands, what it hands over),
//! `durability.rs` (change numbers, the journal written with group
//! commit, who waits for what), `adoption.rs` (what Adopt checks of a
//! process), `probes.rs` (host and device probes, their health,
//! per-process device use, the wait for memory to come back),
//! `exposure.rs` (who listens beyond loopback under `expose =
//! "loopback"`), `overrun.rs` (an overrun's words and whether its policy
//! stops it), `picture.rs` (what a fleet view keeps of the node,
//! `WatchNode`), `kv.rs` (saved conversations and the disk pools' books),
//! `http.rs` (the client for the servers' own endpoints) and `roster.rs`
//! (a workload by name).
//!
//! No code here reads the file system or scans /proc on a runtime thread:
//! clippy's `disallowed_methods` (crates/residentd/clippy.toml) is on for
//! this module, and what must read runs on a blocking thread, allowed
//! function by function with the reason.

#![warn(clippy::disallowed_methods)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use resident_api::{ApiError, pb};
use resident_config::Config;
use resident_probe::MemoryProbe;
use resident_supervisor::{Supervisor, SupervisorConfig};
use tokio::sync::mpsc;

use crate::events::EventLog;
use crate::journal::Journal;
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
mod persist;
mod picture;
mod probes;
mod queries;
mod roster;
mod sleep;
mod upgrade;

pub use adoption::AdoptCall;
use books::Books;
pub use books::Hold;
pub use picture::Figures;

/// The result of a Start.
#[derive(Debug)]
pub struct Started {
    /// The instance now.
    pub instance: pb::Instance,
    /// False for an idempotent repeat.
    pub created: bool,
    /// Who was stopped to make room.
    pub evicted: Vec<String>,
    /// Who was put to sleep to make room.
    pub slept: Vec<String>,
}

/// Something outside the agent that follows the config (`on_reload`).
pub type ReloadHook =
    Box<dyn Fn(&Config, &Config) -> Result<(), resident_config::ConfigError> + Send + Sync>;

/// The hooks `on_reload` registered, in order.
#[derive(Default)]
struct ReloadHooks(Vec<ReloadHook>);

impl std::fmt::Debug for ReloadHooks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} reload hooks", self.0.len())
    }
}

/// How long shutdown waits for the supervisor's last terminal events to
/// release every reservation.
const SHUTDOWN_RELEASE: Duration = Duration::from_secs(5);

/// The node agent.
#[derive(Debug)]
pub struct Agent {
    config: RwLock<Arc<Config>>,
    books: Books,
    sup: Supervisor,
    events: EventLog,
    /// Host memory and the device-bound pools' probes (`probes.rs`).
    probes: Arc<probes::Probes>,
    epoch: Instant,
    /// Numbers generated instance ids.
    id_seq: AtomicU64,
    closing: AtomicBool,
    /// Flips to true when shutdown begins; long streams end on it.
    closed: tokio::sync::watch::Sender<bool>,
    /// The journal, change numbers and durable answers (`durability.rs`).
    durability: durability::Durability,
    /// What follows the config outside the agent (the TLS listeners'
    /// certificates), asked at each reload before anything changes.
    reload_hooks: Mutex<ReloadHooks>,
    /// The start time of each journaled process group's leader, by
    /// instance, run and pid.
    start_ticks: Mutex<std::collections::HashMap<String, persist::Ticks>>,
    metrics: crate::metrics::Metrics,
    /// Where an upgrade stands (`upgrade.rs`).
    upgrade: upgrade::Upgrades,
    /// The exposure guard (`exposure.rs`).
    exposure: exposure::Guard,
    /// The disk pools and the conversations saved in them (`keep_kv`).
    kv: Arc<kv::KvStore>,
    /// What a fleet view waits on (`picture.rs`).
    signals: picture::Signals,
    /// Footprint keys read lately (`roster.rs`).
    keys: roster::Keys,
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
        let events = EventLog::new(4096, 1024);
        events.load(&config.node.state_dir, upgrade::EVENTS_FILE);
        let config = Arc::new(config);
        let agent = Arc::new(Self {
            books: Books::new(&config),
            config: RwLock::new(config),
            sup: Supervisor::new(sup_config, tx),
            events,
            probes: Arc::new(probes::Probes::new(host)),
            epoch: Instant::now(),
            id_seq: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            closed: tokio::sync::watch::Sender::new(false),
            upgrade: upgrade::Upgrades::default(),
            signals: picture::Signals::default(),
            keys: roster::Keys::default(),
            durability: durability::Durability::new(journal),
            start_ticks: Mutex::new(std::collections::HashMap::new()),
            metrics: crate::metrics::Metrics::new(),
            reload_hooks: Mutex::new(ReloadHooks::default()),
            exposure: exposure::Guard::default(),
            kv: Arc::new(kv::KvStore::default()),
        });
        agent.kv.configure(&agent.config());
        agent.open_device_probes();
        agent.refresh_probes();
        tokio::spawn(follower::follow_supervisor(Arc::downgrade(&agent), rx));
        tokio::spawn(follower::tick(Arc::downgrade(&agent)));
        tokio::spawn(persist::write_journal(Arc::downgrade(&agent)));
        Ok(agent)
    }

    /// The configuration in force. A request takes it once and decides on
    /// that one snapshot, so a reload never mixes two configs in it.
    pub fn config(&self) -> Arc<Config> {
        self.config.read().clone()
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Has `hook` take each reloaded config (old, new) before the agent
    /// does: an error refuses the reload, and nothing changes. A listener
    /// follows its certificates this way.
    pub fn on_reload(&self, hook: ReloadHook) {
        self.reload_hooks.lock().0.push(hook);
    }

    /// The metrics.
    pub fn metrics(&self) -> &crate::metrics::Metrics {
        &self.metrics
    }

    /// The event log.
    pub fn events(&self) -> &EventLog {
        &self.events
    }

    /// Resolves once shutdown has begun; Watch and Logs streams end then.
    pub fn closing(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.closed.subscribe();
        async move {
            let _ = rx.wait_for(|closed| *closed).await;
        }
    }

    /// The supervisor.
    pub fn supervisor(&self) -> &Supervisor {
        &self.sup
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
            tokio::task::block_in_place(|| self.write_journal_now(true));
        } else {
            self.write_journal_now(true);
        }
        self.closed.send_replace(true);
        self.sup.shutdown().await;
        let released = async {
            for id in self.books.resident_ids() {
                if let Some(r) = self.books.record(&id) {
                    self.books.released(&id, r.generation).await;
                }
            }
        };
        if tokio::time::timeout(SHUTDOWN_RELEASE, released)
            .await
            .is_err()
        {
            tracing::warn!(held = ?self.books.resident_ids(), "reservations still held after shutdown");
        }
    }

    /// Nothing moves after this: no admission, nothing the agent decides
    /// by itself (an idle sleep or stop, a lease's expiry), and only the
    /// sealing write of the journal (shutdown, hand-over) goes through.
    fn close(&self) {
        self.books.close();
        self.closing.store(true, Ordering::Release);
        self.durability.seal();
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
        self.closed.send_replace(true);
        self.sup.hand_over(upgrade::HAND_OVER_BOUND).await;
        let me = self.clone();
        let _ = tokio::task::spawn_blocking(move || me.write_journal_now(true)).await;
        let state_dir = self.config().node.state_dir.clone();
        if let Err(e) = self.events.save(&state_dir, upgrade::EVENTS_FILE) {
            tracing::warn!(error = %e, "cannot hand the event history over; watchers will list again");
        }
        upgrade::hand_holds_over(&state_dir, &self.books.holds(self.now_ms()));
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
