//! The agent: the ledger (one lock, so plan-and-reserve is atomic), the
//! supervisor, the event log and the probes, joined. Every RPC of the
//! service is one method here; the service only translates.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use resident_api::{ApiError, pb};
use resident_config::{Config, Workload};
use resident_core::{AdmitError, InstanceId, NodeState, Plan, PlanError, Policy};
use resident_probe::MemoryProbe;
use resident_supervisor::{State, Status, Supervisor, SupervisorConfig};
use tokio::sync::mpsc;

use crate::events::EventLog;
use crate::journal::Journal;

mod memory;
mod persist;

use persist::write_journal;

/// How an instance came to be and which run of it is current.
#[derive(Debug, Clone)]
struct Record {
    workload: Arc<Workload>,
    /// Bumped at every admission of this id; tags the supervisor's run.
    generation: u64,
    /// A Stop arrived before the instance was spawned.
    cancelled: bool,
}

#[derive(Debug)]
struct Books {
    ledger: NodeState,
    records: BTreeMap<String, Record>,
}

/// A victim of a Start: who, of which workload, and the cause its stop
/// reports.
#[derive(Debug)]
struct Eviction {
    id: String,
    workload: String,
    cause: String,
}

/// When a Start answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    /// Once the journal on disk holds the instance (`durable_answers`).
    Durable,
    /// Without waiting for the disk (restoring: one write at the end).
    Prompt,
}

/// The result of a Start.
#[derive(Debug)]
pub struct Started {
    /// The instance now.
    pub instance: pb::Instance,
    /// False for an idempotent repeat.
    pub created: bool,
    /// Who was stopped to make room.
    pub evicted: Vec<String>,
}

/// The node agent.
#[derive(Debug)]
pub struct Agent {
    config: RwLock<Arc<Config>>,
    books: Mutex<Books>,
    sup: Supervisor,
    events: EventLog,
    host: Arc<dyn MemoryProbe>,
    /// Probes of device-bound pools (`device = "..."`), by pool name.
    devices: RwLock<Vec<(String, Arc<dyn MemoryProbe>)>>,
    epoch: Instant,
    generation: AtomicU64,
    closing: AtomicBool,
    /// Flips to true when shutdown begins; long streams end on it.
    closed: tokio::sync::watch::Sender<bool>,
    journal: Journal,
    /// Wakes the journal writer; writes coalesce.
    journal_dirty: tokio::sync::Notify,
    /// One journal write at a time (see `write_journal_now`).
    journal_lock: Mutex<()>,
    /// Numbers the changes the journal must record (`persist`).
    journal_changes: AtomicU64,
    /// Which change is on disk (`durable` waits on it).
    durable: tokio::sync::watch::Sender<persist::Durable>,
    metrics: crate::metrics::Metrics,
    /// Counts releases of reservations; a Start of an instance that is
    /// still stopping waits on it.
    released: tokio::sync::watch::Sender<u64>,
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
            ..SupervisorConfig::default()
        };
        let ledger = NodeState::new(config.pool_configs(), config.groups.clone());
        let agent = Arc::new(Self {
            config: RwLock::new(Arc::new(config)),
            books: Mutex::new(Books {
                ledger,
                records: BTreeMap::new(),
            }),
            sup: Supervisor::new(sup_config, tx),
            events: EventLog::new(4096, 1024),
            host,
            devices: RwLock::new(Vec::new()),
            epoch: Instant::now(),
            generation: AtomicU64::new(0),
            closing: AtomicBool::new(false),
            closed: tokio::sync::watch::Sender::new(false),
            journal,
            journal_dirty: tokio::sync::Notify::new(),
            journal_lock: Mutex::new(()),
            journal_changes: AtomicU64::new(0),
            durable: tokio::sync::watch::Sender::new(persist::Durable::default()),
            metrics: crate::metrics::Metrics::new(),
            released: tokio::sync::watch::Sender::new(0),
        });
        agent.open_device_probes();
        agent.refresh_probes();
        tokio::spawn(follow_supervisor(Arc::downgrade(&agent), rx));
        tokio::spawn(tick(Arc::downgrade(&agent)));
        tokio::spawn(write_journal(Arc::downgrade(&agent)));
        Ok(agent)
    }

    /// The configuration in force.
    pub fn config(&self) -> Arc<Config> {
        self.config
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    fn books(&self) -> std::sync::MutexGuard<'_, Books> {
        self.books.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX)
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

    fn workload(&self, name: &str) -> Result<Arc<Workload>, ApiError> {
        if name.is_empty() {
            return Err(ApiError::invalid(
                "workload",
                "must name a workload of the roster",
            ));
        }
        self.config().workloads.get(name).cloned().ok_or_else(|| {
            let name = resident_core::Excerpt::of(name);
            ApiError::NotFound(format!("no workload {name} in the roster"))
        })
    }

    fn view(&self, id: &str, record: &Record) -> pb::Instance {
        let status = self
            .sup
            .status(id)
            .filter(|s| s.generation == record.generation);
        let mut out = resident_api::instance(id, &record.workload.spec, status.as_ref());
        if status.is_none() && record.cancelled {
            out.state = pb::State::Exited as i32;
            out.message = "stopped before it was spawned".into();
        }
        out
    }

    /// One instance.
    pub fn get(&self, id: &str) -> Result<pb::Instance, ApiError> {
        let record = self.books().records.get(id).cloned();
        match record {
            Some(r) => Ok(self.view(id, &r)),
            None => Err(ApiError::NotFound(format!("no instance '{id}'"))),
        }
    }

    /// Every instance, in id order.
    pub fn list(&self) -> Vec<pb::Instance> {
        let records: Vec<(String, Record)> = self
            .books()
            .records
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        records.iter().map(|(id, r)| self.view(id, r)).collect()
    }

    /// The pools as they are.
    pub fn pools(&self) -> Vec<pb::PoolStatus> {
        let books = self.books();
        books
            .ledger
            .pools()
            .iter()
            .map(|p| resident_api::pool_status(p, books.ledger.available(p.name.as_str())))
            .collect()
    }

    /// The placement query: what a Start would do, changing nothing.
    pub fn place(&self, workload: &str, policy: Option<Policy>) -> Result<pb::Placement, ApiError> {
        let w = self.workload(workload)?;
        let policy = policy.unwrap_or(self.config().node.on_full);
        self.refresh_probes();
        let plan = self.books().ledger.place(&w.spec, policy, self.now_ms());
        let plan = plan.map_err(plan_error)?;
        Ok(resident_api::placement(&plan, self.pools()))
    }

    /// Starts an instance of `workload`: plan and reserve atomically, stop
    /// the victims, spawn, and (with `wait_ready`) wait for READY.
    pub async fn start(
        self: &Arc<Self>,
        workload: &str,
        id: Option<InstanceId>,
        policy: Option<Policy>,
        wait_ready: bool,
    ) -> Result<Started, ApiError> {
        self.start_answering(workload, id, policy, wait_ready, Answer::Durable)
            .await
    }

    /// [`Agent::start`], answering as `answer` says.
    async fn start_answering(
        self: &Arc<Self>,
        workload: &str,
        id: Option<InstanceId>,
        policy: Option<Policy>,
        wait_ready: bool,
        answer: Answer,
    ) -> Result<Started, ApiError> {
        let w = self.workload(workload)?;
        let config = self.config();
        let id = match id {
            Some(id) => id,
            None => generated_id(&w, self.generation.load(Ordering::Relaxed) + 1),
        };
        let policy = policy.unwrap_or(config.node.on_full);
        self.refresh_probes();
        let mut stopping: Option<tokio::sync::watch::Receiver<u64>> = None;
        let (admission, generation) = loop {
            if let Some(mut released) = stopping.take() {
                tracing::debug!(instance_id = %id, "waiting for the stopping run to end");
                let _ = released.changed().await;
            }
            if self.closing.load(Ordering::Acquire) {
                return Err(ApiError::Unavailable("the agent is shutting down".into()));
            }
            let mut books = self.books();
            // The same instance is stopping (a Stop, an eviction): its
            // current run is about to exit, so answering with it would
            // promise a dying run. Wait for its release, then admit anew.
            let cancelled = books.records.get(id.as_str()).is_some_and(|r| r.cancelled);
            if let Some(r) = books.ledger.resident(id.as_str())
                && (cancelled || r.evicting)
            {
                // Subscribed under the lock: no release is missed.
                stopping = Some(self.released.subscribe());
                continue;
            }
            if let Some(r) = books.records.get(id.as_str())
                && r.workload.spec.workload != w.spec.workload
            {
                let msg = format!(
                    "instance '{id}' already exists with workload '{}'",
                    r.workload.spec.workload
                );
                return Err(ApiError::AlreadyExists(msg));
            }
            let max = config.node.max_instances;
            if books.ledger.resident(id.as_str()).is_none()
                && books.ledger.residents().count() >= max
            {
                return Err(ApiError::LimitReached(format!(
                    "the node already holds max_instances = {max} instances; stop one first"
                )));
            }
            match books
                .ledger
                .admit(&id, w.spec.clone(), policy, self.now_ms())
            {
                Err(AdmitError::Refused(refusal)) => {
                    drop(books);
                    return Err(self.refused(workload, refusal, policy));
                }
                Err(AdmitError::Invalid(e)) => return Err(plan_error(e)),
                Ok(a) if !a.created => {
                    let record = books.records.get(id.as_str()).cloned();
                    drop(books);
                    let instance = match record {
                        Some(r) => self.view(id.as_str(), &r),
                        None => resident_api::instance(id.as_str(), &w.spec, None),
                    };
                    return Ok(Started {
                        instance,
                        created: false,
                        evicted: Vec::new(),
                    });
                }
                Ok(a) => {
                    let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
                    let record = Record {
                        workload: w.clone(),
                        generation,
                        cancelled: false,
                    };
                    books.records.insert(id.to_string(), record);
                    let forgotten = self.prune_ended(&mut books, config.node.max_instances);
                    drop(books);
                    for gone in forgotten {
                        self.forgotten(gone);
                    }
                    self.persist();
                    self.metrics.admitted(workload);
                    break (a, generation);
                }
            }
        };
        let evicted: Vec<String> = admission.evict.iter().map(ToString::to_string).collect();
        if !evicted.is_empty() {
            tracing::info!(instance_id = %id, victims = ?evicted, "evicting to make room");
        }
        // What the victims hold in each live pool the target needs, to see
        // it come back after they have exited.
        let recovery = self.recovery_targets(&w, &admission.evict);
        // Victims are stopped side by side; each keeps its memory in the
        // ledger until its process group has exited.
        let mut stops = tokio::task::JoinSet::new();
        for victim in self.evictions(&w, &id, &admission.evict) {
            self.metrics.evicted(workload, &victim.workload);
            let me = self.clone();
            stops.spawn(async move { me.stop_because(&victim.id, None, Some(victim.cause)).await });
        }
        while let Some(result) = stops.join_next().await {
            if let Ok(Err(e)) = result {
                tracing::warn!(instance_id = %id, error = %e, "a victim could not be stopped");
            }
        }
        for other in &admission.wait_for {
            self.sup
                .wait_for(other.as_str(), |s| s.state.is_terminal())
                .await;
        }
        if !recovery.is_empty() {
            self.await_memory_back(&recovery).await;
        }
        self.spawn(id.as_str(), &w, generation, wait_ready, answer)
            .await
            .map(|instance| Started {
                instance,
                created: true,
                evicted,
            })
    }

    async fn spawn(
        &self,
        id: &str,
        w: &Workload,
        generation: u64,
        wait_ready: bool,
        answer: Answer,
    ) -> Result<pb::Instance, ApiError> {
        let cancelled = self
            .books()
            .records
            .get(id)
            .is_none_or(|r| r.generation != generation || r.cancelled);
        if cancelled {
            self.release(id, generation);
            return Err(ApiError::Aborted(format!(
                "instance '{id}' was stopped before it was spawned"
            )));
        }
        let config = self.config();
        let spec = w.launch(id, generation, &config.node);
        match self.sup.start(spec).await {
            // Failed with no exit: the process never ran (spawn error). A
            // process that ran and already exited is reported as it is.
            Ok(status) if status.state == State::Failed && status.exit.is_none() => {
                self.release(id, generation);
                return Err(ApiError::Internal(format!(
                    "instance '{id}': {}",
                    status.reason
                )));
            }
            Ok(_) => {}
            Err(e) => {
                self.release(id, generation);
                return Err(ApiError::Unavailable(e.to_string()));
            }
        }
        if answer == Answer::Durable && config.node.durable_answers {
            // The journal now holds the instance with its process group;
            // no answer before it is on disk.
            if let Err(e) = self.durable(self.persist()).await {
                let cause = Some("stopped: its start could not be journaled".to_string());
                let _ = self.stop_because(id, None, cause).await;
                return Err(e);
            }
        }
        if wait_ready {
            let settled = self
                .sup
                .wait_for(id, |s| s.state == State::Ready || s.state.is_terminal())
                .await;
            if let Some(s) = settled.filter(|s| s.state.is_terminal()) {
                return Err(ApiError::FailedPrecondition(format!(
                    "instance '{id}' did not become ready: {}",
                    s.reason
                )));
            }
        }
        self.get(id)
    }

    /// Each victim with the cause its stop reports: for which start, and
    /// in which of the target's pools it held memory (none: it was in
    /// the way of a group or exclusion rule).
    fn evictions(&self, w: &Workload, id: &InstanceId, victims: &[InstanceId]) -> Vec<Eviction> {
        let books = self.books();
        victims
            .iter()
            .map(|v| {
                let resident = books.ledger.resident(v.as_str());
                let pools: Vec<&str> = resident
                    .map(|r| {
                        r.spec
                            .demand
                            .keys()
                            .filter(|p| w.spec.demand.contains_key(*p))
                            .map(|p| p.as_str())
                            .collect()
                    })
                    .unwrap_or_default();
                let start = format!("'{}' (instance '{id}')", w.spec.workload);
                let cause = match pools.as_slice() {
                    [] => format!("evicted for {start}: a group or exclusion rule"),
                    [one] => format!("evicted to make room for {start} in pool '{one}'"),
                    many => format!(
                        "evicted to make room for {start} in pools '{}'",
                        many.join("', '")
                    ),
                };
                Eviction {
                    id: v.to_string(),
                    workload: resident.map_or_else(String::new, |r| r.spec.workload.to_string()),
                    cause,
                }
            })
            .collect()
    }

    fn refused(&self, workload: &str, refusal: resident_core::Refusal, policy: Policy) -> ApiError {
        tracing::info!(workload, ?policy, reason = %refusal.first(), "start refused");
        self.metrics.refused(refusal.first().code());
        let placement = resident_api::placement(&Plan::Refuse(refusal.clone()), self.pools());
        self.events.publish(pb::Event {
            kind: pb::EventKind::Refused as i32,
            refusal: Some(resident_api::refusal(refusal.first())),
            workload: workload.to_string(),
            ..Default::default()
        });
        ApiError::Refused {
            refusal,
            placement: Box::new(placement),
        }
    }

    /// Releases `id`'s reservation if `generation` is still its current run.
    /// Keeps at most `keep` ended instances (the newest): without a bound,
    /// a caller that starts and stops ever-new ids would grow the table
    /// for good. Returns the records dropped.
    fn prune_ended(&self, books: &mut Books, keep: usize) -> Vec<pb::Instance> {
        let mut ended: Vec<(u64, String)> = books
            .records
            .iter()
            .filter(|(id, _)| books.ledger.resident(id).is_none())
            .map(|(id, r)| (r.generation, id.clone()))
            .collect();
        if ended.len() <= keep {
            return Vec::new();
        }
        ended.sort_unstable();
        let excess = ended.len() - keep;
        let mut gone = Vec::new();
        for (_, id) in ended.into_iter().take(excess) {
            let Some(record) = books.records.get(&id) else {
                continue;
            };
            let last = self.view(&id, record);
            if self.sup.forget(&id) || self.sup.status(&id).is_none() {
                books.records.remove(&id);
                gone.push(last);
            }
        }
        gone
    }

    /// Tells watchers that an ended instance was dropped.
    fn forgotten(&self, last: pb::Instance) {
        tracing::debug!(instance_id = %last.instance_id, "forgot an ended instance");
        self.events.publish(pb::Event {
            instance: Some(last),
            kind: pb::EventKind::Forgotten as i32,
            ..Default::default()
        });
    }

    fn release(&self, id: &str, generation: u64) {
        let mut books = self.books();
        if books
            .records
            .get(id)
            .is_some_and(|r| r.generation == generation)
        {
            books.ledger.release(id);
            self.released.send_modify(|n| *n += 1);
        }
    }

    /// Stops an instance and answers once its group has exited and its
    /// memory is released.
    pub async fn stop(&self, id: &str, grace: Option<Duration>) -> Result<pb::Instance, ApiError> {
        self.stop_because(id, grace, None).await
    }

    /// As [`Agent::stop`], with the cause the ended run's message gives
    /// instead of "stopped" (an eviction, an idle TTL).
    async fn stop_because(
        &self,
        id: &str,
        grace: Option<Duration>,
        cause: Option<String>,
    ) -> Result<pb::Instance, ApiError> {
        let (generation, workload) = {
            let mut books = self.books();
            let Some(record) = books.records.get_mut(id) else {
                return Err(ApiError::NotFound(format!("no instance '{id}'")));
            };
            record.cancelled = true;
            (record.generation, record.workload.clone())
        };
        let known = self
            .sup
            .status(id)
            .is_some_and(|s| s.generation == generation);
        let mut ended = None;
        if known {
            match self.sup.stop_because(id, grace, cause).await {
                Ok(status) => ended = Some(status),
                Err(e) => tracing::warn!(instance_id = id, error = %e, "stop"),
            }
        }
        self.release(id, generation);
        let change = self.persist();
        if self.config().node.durable_answers {
            // The journal no longer lists it: a crash cannot bring it back.
            self.durable(change).await?;
        }
        // The run this Stop ended, even when a Start has begun a new one
        // of the same id meanwhile.
        match ended.filter(|s| s.generation == generation) {
            Some(status) => Ok(resident_api::instance(id, &workload.spec, Some(&status))),
            None => self.get(id),
        }
    }

    /// Re-reads the configuration file: workloads, groups and pools change;
    /// running instances are not touched. An invalid file changes nothing.
    pub fn reload(&self) -> Result<(), resident_config::ConfigError> {
        let old = self.config();
        let new = resident_config::load(&old.source)?;
        for w in &new.warnings {
            tracing::warn!("{w}");
        }
        if new.node.listen != old.node.listen || new.node.state_dir != old.node.state_dir {
            tracing::warn!("listen and state_dir changes take effect at the next restart");
        }
        self.books()
            .ledger
            .reconfigure(new.pool_configs(), new.groups.clone());
        *self.config.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(new);
        self.open_device_probes();
        self.refresh_probes();
        Ok(())
    }

    /// Marks a use of `id` and, with `hold_ms`, protects it from eviction.
    pub fn touch(&self, id: &str, hold_ms: u64) -> Result<pb::Instance, ApiError> {
        let touched = self.books().ledger.touch(id, self.now_ms(), hold_ms);
        if !touched {
            self.get(id)?;
            return Err(ApiError::FailedPrecondition(format!(
                "instance '{id}' is not resident"
            )));
        }
        self.get(id)
    }

    /// Refuses new starts and stops every instance gracefully.
    /// The journal keeps what ran at shutdown, so the next start of the
    /// agent (an upgrade, a restart) brings the same instances back.
    pub async fn shutdown(&self) {
        self.closing.store(true, Ordering::Release);
        self.write_journal_now(true);
        self.closed.send_replace(true);
        self.sup.shutdown().await;
        let ids: Vec<String> = self.books().records.keys().cloned().collect();
        let mut books = self.books();
        for id in ids {
            books.ledger.release(&id);
        }
        self.released.send_modify(|n| *n += 1);
    }

    /// Stops instances unused for longer than their workload's idle TTL.
    async fn expire_idle(self: &Arc<Self>) {
        let now = self.now_ms();
        // Runs every second: only instances of workloads with a TTL are
        // looked at, so a node without TTLs does no per-instance work.
        let expired: Vec<String> = {
            let books = self.books();
            books
                .records
                .iter()
                .filter_map(|(id, rec)| Some((id, rec.workload.idle_ttl?)))
                .filter(|(id, ttl)| {
                    books.ledger.resident(id).is_some_and(|r| {
                        !r.evicting
                            && !r.held(now)
                            && now.saturating_sub(r.last_used) >= ttl.as_millis() as u64
                    })
                })
                .map(|(id, _)| id.clone())
                .collect()
        };
        for id in expired {
            tracing::info!(instance_id = %id, "idle TTL reached, stopping");
            let me = self.clone();
            let cause = Some("stopped after its idle TTL".to_string());
            tokio::spawn(async move { me.stop_because(&id, None, cause).await });
        }
    }

    fn on_transition(&self, status: Status) {
        let record = self.books().records.get(&status.instance).cloned();
        let Some(record) = record.filter(|r| r.generation == status.generation) else {
            return;
        };
        if status.state.is_terminal() {
            self.release(&status.instance, status.generation);
        }
        if matches!(status.state, State::Starting) || status.state.is_terminal() {
            self.persist();
        }
        if status.state == State::Backoff {
            self.metrics.restarted(&status.workload);
        }
        let instance =
            resident_api::instance(&status.instance, &record.workload.spec, Some(&status));
        self.events.publish(pb::Event {
            instance: Some(instance),
            kind: pb::EventKind::Transition as i32,
            ..Default::default()
        });
    }
}

fn generated_id(w: &Workload, n: u64) -> InstanceId {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let name = format!("{}-{n}-{nanos:x}", w.spec.workload);
    // A workload name (64 chars max) plus digits stays a valid id.
    InstanceId::new(name)
        .unwrap_or_else(|_| InstanceId::new(format!("instance-{n}")).expect("a valid id"))
}

fn plan_error(e: PlanError) -> ApiError {
    match e {
        PlanError::AlreadyExists { .. } => ApiError::AlreadyExists(e.to_string()),
        PlanError::Evicting { .. } => ApiError::Unavailable(e.to_string()),
        PlanError::UnknownPool { .. } => ApiError::FailedPrecondition(e.to_string()),
    }
}

/// Applies every supervisor transition to the books and the event log.
async fn follow_supervisor(agent: std::sync::Weak<Agent>, mut rx: mpsc::UnboundedReceiver<Status>) {
    while let Some(status) = rx.recv().await {
        let Some(agent) = agent.upgrade() else {
            return;
        };
        agent.on_transition(status);
    }
}

/// Periodic work: probe readings and idle expiry.
async fn tick(agent: std::sync::Weak<Agent>) {
    let mut interval = tokio::time::interval(Duration::from_secs(1));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        interval.tick().await;
        let Some(agent) = agent.upgrade() else {
            return;
        };
        agent.refresh_probes();
        agent.expire_idle().await;
    }
}
