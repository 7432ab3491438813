//! The supervisor: the table of instances, their actors, the memory
//! sampler, and the calls the daemon makes (start, stop, status, logs,
//! shutdown).

use std::collections::HashMap;
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinSet;

use crate::adopted::{AdoptActor, Adoption};
use crate::cgroup::{CgroupMode, Cgroups};
use crate::instance::{Actor, First, Shared, StopRequest};
use crate::logs::{LogLimits, LogRing, PipeSpares};
use crate::pidfd::Watched;
use crate::spawn::Ports;
use crate::spec::LaunchSpec;
use crate::status::{State, Status};

/// Pairs of emptied output pipes kept for later runs (as many as emptied
/// cgroups are: only a run whose cgroup was emptied hands its pipes back).
const PIPE_SPARES: usize = 256;

/// Settings that apply to every instance.
#[derive(Debug, Clone)]
pub struct SupervisorConfig {
    /// How often the resident bytes of every group are sampled.
    pub sample_every: Duration,
    /// Bounds of each instance's log ring.
    pub logs: LogLimits,
    /// Whether instances get cgroups of their own.
    pub cgroups: CgroupMode,
    /// Instances outlive the supervisor: spawned without a parent-death
    /// signal, writing into named pipes in this directory, and what dead
    /// agents left in cgroups is cleared only once the caller has said
    /// what it took over (`clear_dead_agents`). `None`: they die with it.
    pub outlive: Option<std::path::PathBuf>,
}

impl Default for SupervisorConfig {
    fn default() -> Self {
        Self {
            sample_every: Duration::from_secs(2),
            logs: LogLimits::default(),
            cgroups: CgroupMode::Auto,
            outlive: None,
        }
    }
}

/// Why a supervisor call did nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SupervisorError {
    /// Start of an instance that is still live.
    #[error("instance '{0}' is already running")]
    AlreadyRunning(String),
    /// No such instance.
    #[error("no instance '{0}'")]
    NotFound(String),
    /// A stop for a run that is not the instance's current one.
    #[error("run {generation} of instance '{instance}' is not its current run")]
    NotTheRun {
        /// The instance.
        instance: String,
        /// The run the stop was for.
        generation: u64,
    },
    /// No port could be assigned.
    #[error("cannot assign a port to instance '{instance}': {message}")]
    NoPort {
        /// The instance.
        instance: String,
        /// What the system said.
        message: String,
    },
    /// The agent is shutting down.
    #[error("the supervisor is shutting down")]
    ShuttingDown,
    /// The process to adopt cannot be watched.
    #[error("cannot adopt pid {pid}: {message}")]
    Adopt {
        /// The pid.
        pid: u32,
        /// Why.
        message: String,
    },
}

/// A run's process as the journal records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunProcess {
    /// Its pid (the leader of its process group).
    pub pid: u32,
    /// Its start time, when its spawn could tell.
    pub start_ticks: Option<u64>,
    /// Its port.
    pub port: u16,
    /// The instance's restarts so far.
    pub restarts: u32,
}

/// A process an earlier agent spawned for an instance and left running,
/// as its journal recorded it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TakeOver {
    /// Its pid (the leader of its process group).
    pub pid: u32,
    /// Its start time (`/proc/PID/stat`), against a reused pid.
    pub start_ticks: u64,
    /// The port it was given.
    pub port: u16,
    /// The instance's restarts so far (its status goes on from there).
    pub restarts: u32,
}

#[derive(Debug)]
struct Entry {
    shared: Arc<Shared>,
    stops: mpsc::Sender<StopRequest>,
    grace: Duration,
    /// Watched, not spawned: shutdown lets it go without a signal.
    adopted: bool,
}

#[derive(Debug)]
struct Inner {
    config: SupervisorConfig,
    instances: Mutex<HashMap<String, Entry>>,
    ports: Arc<Ports>,
    events: mpsc::UnboundedSender<Status>,
    closing: std::sync::atomic::AtomicBool,
    cgroups: Option<Arc<Cgroups>>,
    /// Emptied output pipes, kept for later runs.
    pipes: Arc<PipeSpares>,
}

/// The log of `id`'s ended run, to continue; an error while it is live.
fn ended_logs(
    table: &HashMap<String, Entry>,
    id: &str,
) -> Result<Option<Arc<LogRing>>, SupervisorError> {
    match table.get(id) {
        Some(e) if !e.shared.status.borrow().state.is_terminal() => {
            Err(SupervisorError::AlreadyRunning(id.to_string()))
        }
        Some(e) => Ok(Some(e.shared.logs.clone())),
        None => Ok(None),
    }
}

/// The first status after PENDING (or the last one, if the actor ended).
async fn settled(rx: &mut watch::Receiver<Status>) -> Status {
    let settled = rx
        .wait_for(|s| s.state != State::Pending)
        .await
        .map(|s| s.clone());
    settled.unwrap_or_else(|_| rx.borrow().clone())
}

/// Runs instances as child processes. Cheap to clone; all clones share one
/// table. Every transition of every instance is sent, in order per
/// instance, on the events channel given to `new`.
#[derive(Debug, Clone)]
pub struct Supervisor {
    inner: Arc<Inner>,
}

impl Supervisor {
    /// A supervisor publishing transitions on `events`. Must be called
    /// within a tokio runtime (it starts the memory sampler).
    pub fn new(config: SupervisorConfig, events: mpsc::UnboundedSender<Status>) -> Self {
        crate::spawn::start_spawners();
        let lineage = config.outlive.as_deref().map(crate::cgroup::lineage);
        let cgroups = Cgroups::setup(config.cgroups, lineage).map(Arc::new);
        tracing::info!(
            "instances are contained by {}",
            crate::cgroup::describe(cgroups.as_deref())
        );
        let inner = Arc::new(Inner {
            config,
            instances: Mutex::new(HashMap::new()),
            ports: Arc::new(Ports::default()),
            events,
            closing: std::sync::atomic::AtomicBool::new(false),
            cgroups,
            pipes: Arc::new(PipeSpares::new(PIPE_SPARES)),
        });
        let every = inner.config.sample_every;
        tokio::spawn(sample_memory(Arc::downgrade(&inner), every));
        Self { inner }
    }

    fn table(&self) -> parking_lot::MutexGuard<'_, HashMap<String, Entry>> {
        self.inner.instances.lock()
    }

    /// Starts an instance and answers once it is spawned (STARTING) or has
    /// failed to spawn (FAILED). An ended instance of the same id is
    /// replaced (its log continues).
    pub async fn start(&self, spec: LaunchSpec) -> Result<Status, SupervisorError> {
        self.launch(spec, None).await
    }

    /// Takes over instance `spec.instance`'s process that an earlier
    /// agent spawned and left running (`TakeOver`): the same pid, port,
    /// output (its named pipes) and cgroup; readiness is probed as after
    /// a spawn, and from then on it is supervised like any run (stop,
    /// exit, the restart policy; its exit code is unknown). A process
    /// that is gone (or whose pid now names another process) counts as a
    /// run that ended while no agent ran: the restart policy decides.
    /// Answers as `start` does.
    pub async fn take_over(
        &self,
        spec: LaunchSpec,
        process: TakeOver,
    ) -> Result<Status, SupervisorError> {
        let first = match Watched::open(process.pid, process.start_ticks) {
            Ok(watched) => First::Running {
                watched,
                pid: process.pid,
                start_ticks: process.start_ticks,
                restarts: process.restarts,
                cgroup: self
                    .inner
                    .cgroups
                    .as_ref()
                    .and_then(|c| c.run_of(process.pid))
                    .map(Arc::new),
            },
            Err(e) => First::Gone(format!(
                "pid {} ended while no agent ran ({e})",
                process.pid
            )),
        };
        self.launch(spec, Some((process.port, first))).await
    }

    /// After every take_over of a new agent: clears what agents that are
    /// gone left in cgroups, except the cgroups of the processes taken
    /// over. Nothing to do unless instances outlive the agent (otherwise
    /// it was done at start).
    pub fn clear_dead_agents(&self) {
        let (Some(cgroups), Some(_)) = (&self.inner.cgroups, &self.inner.config.outlive) else {
            return;
        };
        let (keep, pids): (Vec<_>, Vec<_>) = {
            let table = self.table();
            let keep = table
                .values()
                .filter_map(|e| e.shared.cgroup())
                .map(|cg| (*cg).clone())
                .collect();
            let pids = table
                .values()
                .map(|e| e.shared.pgid.load(Ordering::Relaxed))
                .filter(|p| *p > 1)
                .collect();
            (keep, pids)
        };
        cgroups.clear_dead_agents(&keep, &pids);
    }

    async fn launch(
        &self,
        spec: LaunchSpec,
        taken: Option<(u16, First)>,
    ) -> Result<Status, SupervisorError> {
        if self.inner.closing.load(Ordering::Acquire) {
            return Err(SupervisorError::ShuttingDown);
        }
        let id = spec.instance.clone();
        let (port, mut first) = match taken {
            Some((port, first)) => (Some(port), Some(first)),
            None => (None, None),
        };
        let mut status_rx = {
            let mut table = self.table();
            let old_logs = ended_logs(&table, &id)?;
            let port = match port {
                Some(port) => {
                    self.inner.ports.hold(port);
                    port
                }
                None => self
                    .inner
                    .ports
                    .take()
                    .map_err(|e| SupervisorError::NoPort {
                        instance: id.clone(),
                        message: e.to_string(),
                    })?,
            };
            let (shared, status_rx) = self.shared(&spec, port, old_logs);
            let (stops_tx, stops_rx) = mpsc::channel(4);
            let grace = spec.stop_grace;
            let actor = Actor {
                spec,
                port,
                shared: shared.clone(),
                stops: stops_rx,
                ports: self.inner.ports.clone(),
                cgroups: self.inner.cgroups.clone(),
                pipes: self.inner.pipes.clone(),
                output: None,
                outlive: self.inner.config.outlive.as_deref().map(Arc::from),
                first: first.take(),
                handed_over: false,
            };
            table.insert(
                id.clone(),
                Entry {
                    shared,
                    stops: stops_tx,
                    grace,
                    adopted: false,
                },
            );
            tokio::spawn(actor.run());
            status_rx
        };
        Ok(settled(&mut status_rx).await)
    }

    /// Watches a process that someone else started, as instance
    /// `spec.instance` (its argv is not used): readiness with the
    /// workload's probe on `adoption.port`, memory, exit. Answers once it
    /// is watched (STARTING), or why it cannot be (gone, pid reused). It
    /// is signalled only on a Stop of a managed adoption.
    pub async fn adopt(
        &self,
        spec: LaunchSpec,
        adoption: Adoption,
    ) -> Result<Status, SupervisorError> {
        if self.inner.closing.load(Ordering::Acquire) {
            return Err(SupervisorError::ShuttingDown);
        }
        let watched = Watched::open(adoption.pid, adoption.start_ticks).map_err(|e| {
            SupervisorError::Adopt {
                pid: adoption.pid,
                message: e.to_string(),
            }
        })?;
        let id = spec.instance.clone();
        let mut status_rx = {
            let mut table = self.table();
            let old_logs = ended_logs(&table, &id)?;
            let (shared, status_rx) = self.shared(&spec, adoption.port, old_logs);
            let (stops_tx, stops_rx) = mpsc::channel(4);
            let grace = spec.stop_grace;
            let actor = AdoptActor {
                spec,
                adoption,
                watched,
                shared: shared.clone(),
                stops: stops_rx,
            };
            table.insert(
                id,
                Entry {
                    shared,
                    stops: stops_tx,
                    grace,
                    adopted: true,
                },
            );
            tokio::spawn(actor.run());
            status_rx
        };
        Ok(settled(&mut status_rx).await)
    }

    /// The shared half of a new instance entry, PENDING, published.
    fn shared(
        &self,
        spec: &LaunchSpec,
        port: u16,
        old_logs: Option<Arc<LogRing>>,
    ) -> (Arc<Shared>, watch::Receiver<Status>) {
        let status = Status {
            instance: spec.instance.as_str().into(),
            workload: spec.workload.as_str().into(),
            role: spec.role.as_str().into(),
            state: State::Pending,
            pid: None,
            start_ticks: None,
            port,
            restarts: 0,
            exit: None,
            measured_bytes: 0,
            measured_at: None,
            reason: "accepted".into(),
            generation: spec.generation,
            started_at: None,
            oom_killed: false,
        };
        let (status_tx, status_rx) = watch::channel(status.clone());
        let shared = Arc::new(Shared {
            status: status_tx,
            events: self.inner.events.clone(),
            logs: old_logs.unwrap_or_else(|| LogRing::new(self.inner.config.logs)),
            pgid: AtomicI32::new(0),
            cgroup: Mutex::new(None),
        });
        let _ = self.inner.events.send(status);
        (shared, status_rx)
    }

    /// Stops an instance's current run (SIGTERM, `grace` or its own stop
    /// grace, SIGKILL) and answers once its process group is gone.
    /// Stopping an ended instance answers its status at once.
    pub async fn stop(&self, id: &str, grace: Option<Duration>) -> Result<Status, SupervisorError> {
        self.send_stop(id, grace, false).await
    }

    /// Stops run `generation` of `id` only, with the cause the ended
    /// run's reason gives instead of "stopped" (for example an eviction and
    /// for whom). [`SupervisorError::NotTheRun`] when `id`'s current run is
    /// another one (not spawned yet, or a later run has replaced it): a
    /// stop meant for one run never ends the next. The stop is under way
    /// when this returns; [`Stopping::ended`] waits for the run's end. A
    /// caller that learns of the end by another path (the agent, by the
    /// release of the run's memory, which follows it) reads it then,
    /// without a wake-up of its own for each of the run's transitions.
    pub async fn stop_run(
        &self,
        id: &str,
        generation: u64,
        grace: Option<Duration>,
        cause: Option<String>,
    ) -> Result<Stopping, SupervisorError> {
        self.request_stop(id, Some(generation), grace, cause, false)
            .await
    }

    /// Sends a stop request (or, `detach`, a let-go for an adopted
    /// process) to `id`'s current run and waits until that run is terminal.
    async fn send_stop(
        &self,
        id: &str,
        grace: Option<Duration>,
        detach: bool,
    ) -> Result<Status, SupervisorError> {
        let stopping = self.request_stop(id, None, grace, None, detach).await?;
        Ok(stopping.ended().await)
    }

    /// Sends a stop request to `id`'s current run, or to run `generation`
    /// only; the run's end is the returned handle's.
    async fn request_stop(
        &self,
        id: &str,
        generation: Option<u64>,
        grace: Option<Duration>,
        cause: Option<String>,
        detach: bool,
    ) -> Result<Stopping, SupervisorError> {
        let (stops, status, own_grace) = {
            let table = self.table();
            let e = table
                .get(id)
                .ok_or_else(|| SupervisorError::NotFound(id.to_string()))?;
            let current = e.shared.status.borrow().generation;
            if let Some(wanted) = generation.filter(|g| *g != current) {
                return Err(SupervisorError::NotTheRun {
                    instance: id.to_string(),
                    generation: wanted,
                });
            }
            (e.stops.clone(), e.shared.status.subscribe(), e.grace)
        };
        let request = StopRequest {
            grace: grace.unwrap_or(own_grace),
            cause,
            detach,
            hand_over: None,
        };
        // The answer is the run's terminal status, not a reply to the
        // request: a send that races the actor's end can land after the
        // actor dropped its receiver (tokio drains the queue on that drop,
        // but a sender that took its permit just before pushes after the
        // drain), and a reply awaited from it would never come. A failed
        // send means the actor has ended, its run terminal already.
        let _ = stops.send(request).await;
        Ok(Stopping { status })
    }

    /// The status of one instance.
    pub fn status(&self, id: &str) -> Option<Status> {
        self.table()
            .get(id)
            .map(|e| e.shared.status.borrow().clone())
    }

    /// Run `generation` of `id` while it has a process (no copy of the
    /// status: the journal asks for every instance at every write).
    pub fn pid(&self, id: &str, generation: u64) -> Option<RunProcess> {
        let table = self.table();
        let status = table.get(id)?.shared.status.borrow();
        let pid = status.pid.filter(|_| status.generation == generation)?;
        Some(RunProcess {
            pid,
            start_ticks: status.start_ticks,
            port: status.port,
            restarts: status.restarts,
        })
    }

    /// A receiver that sees every later status of `id`.
    pub fn subscribe(&self, id: &str) -> Option<watch::Receiver<Status>> {
        self.table().get(id).map(|e| e.shared.status.subscribe())
    }

    /// Waits until `id`'s status satisfies `pred` (or the instance is gone).
    pub async fn wait_for(&self, id: &str, pred: impl FnMut(&Status) -> bool) -> Option<Status> {
        let mut rx = self.subscribe(id)?;
        rx.wait_for(pred).await.ok().map(|s| s.clone())
    }

    /// Every instance's status, in id order.
    pub fn list(&self) -> Vec<Status> {
        let mut all: Vec<Status> = self
            .table()
            .values()
            .map(|e| e.shared.status.borrow().clone())
            .collect();
        all.sort_by(|a, b| a.instance.cmp(&b.instance));
        all
    }

    /// The log of one instance.
    pub fn logs(&self, id: &str) -> Option<Arc<LogRing>> {
        self.table().get(id).map(|e| e.shared.logs.clone())
    }

    /// Drops an ended run (`generation`) of an instance from the table.
    /// False when that run is live, or is not the instance's current one.
    pub fn forget(&self, id: &str, generation: u64) -> bool {
        let mut table = self.table();
        let ended = table.get(id).is_some_and(|e| {
            let s = e.shared.status.borrow();
            s.state.is_terminal() && s.generation == generation
        });
        if ended {
            table.remove(id);
        }
        ended
    }

    /// Refuses new starts and stops every live instance in parallel, each
    /// with its own grace; lets adopted processes go without a signal;
    /// answers when all are done.
    pub async fn shutdown(&self) {
        self.inner.closing.store(true, Ordering::Release);
        let ids: Vec<(String, bool)> = self
            .table()
            .iter()
            .map(|(id, e)| (id.clone(), e.adopted))
            .collect();
        let mut stops = JoinSet::new();
        for (id, adopted) in ids {
            let me = self.clone();
            stops.spawn(async move { me.send_stop(&id, None, adopted).await });
        }
        while stops.join_next().await.is_some() {}
        if let Some(cg) = &self.inner.cgroups {
            cg.remove();
        }
    }

    /// Hands every instance over to the next agent (an upgrade): refuses
    /// new starts, and each actor lets its process run on unsignalled and
    /// ends without a transition, its output left unread in its named
    /// pipes; answers once all have, or at `bound`. Only for instances
    /// that outlive the agent (`SupervisorConfig::outlive`); after it, this
    /// supervisor serves nothing.
    pub async fn hand_over(&self, bound: Duration) {
        self.inner.closing.store(true, Ordering::Release);
        let stops: Vec<mpsc::Sender<StopRequest>> =
            self.table().values().map(|e| e.stops.clone()).collect();
        let mut done = JoinSet::new();
        for stops in stops {
            done.spawn(async move {
                let (tx, rx) = tokio::sync::oneshot::channel();
                let request = StopRequest {
                    grace: Duration::ZERO,
                    cause: None,
                    detach: false,
                    hand_over: Some(tx),
                };
                // An actor that has ended has nothing to hand over.
                if stops.send(request).await.is_ok() {
                    let _ = rx.await;
                }
            });
        }
        let all = async { while done.join_next().await.is_some() {} };
        if tokio::time::timeout(bound, all).await.is_err() {
            tracing::warn!("some instances were not handed over within {bound:?}");
        }
    }

    /// Whether instances get cgroups that can limit their memory.
    pub fn limits_memory(&self) -> bool {
        self.inner
            .cgroups
            .as_ref()
            .is_some_and(|c| c.limits_memory())
    }

    /// Whether instances get cgroups at all.
    pub fn uses_cgroups(&self) -> bool {
        self.inner.cgroups.is_some()
    }

    /// Whether instances get cgroups, and where: a line for operators.
    pub fn containment(&self) -> String {
        crate::cgroup::describe(self.inner.cgroups.as_deref())
    }
}

/// Samples the resident bytes of every running group, until the
/// supervisor is dropped.
async fn sample_memory(inner: Weak<Inner>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sampler = Some(crate::sampler::Sampler::default());
    loop {
        tick.tick().await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let groups: Vec<(i32, Arc<Shared>)> = {
            let table = inner.instances.lock();
            table
                .values()
                .map(|e| (e.shared.pgid.load(Ordering::Relaxed), e.shared.clone()))
                .filter(|(pgid, _)| *pgid > 1)
                .collect()
        };
        drop(inner);
        if groups.is_empty() {
            continue;
        }
        let targets: Vec<_> = groups.iter().map(|(p, s)| (*p, s.cgroup())).collect();
        let Some(mut s) = sampler.take() else {
            return;
        };
        let Ok((sums, s)) = tokio::task::spawn_blocking(move || (s.sample(&targets), s)).await
        else {
            sampler = Some(crate::sampler::Sampler::default());
            continue;
        };
        sampler = Some(s);
        for (pgid, shared) in groups {
            let bytes = sums.get(&pgid).copied().unwrap_or(0);
            // The group may have ended during the scan; keep 0 then.
            if shared.pgid.load(Ordering::Relaxed) == pgid {
                let at = std::time::SystemTime::now();
                shared.status.send_if_modified(|s| {
                    let changed = s.measured_bytes != bytes;
                    s.measured_bytes = bytes;
                    s.measured_at = Some(at);
                    changed
                });
            }
        }
    }
}

/// A stop under way, from [`Supervisor::stop_run`].
#[derive(Debug)]
pub struct Stopping {
    /// The run's own status (each run has its own channel, so a later run
    /// of the same id never shows here).
    status: watch::Receiver<Status>,
}

impl Stopping {
    /// The run's terminal status, once it has one.
    pub async fn ended(mut self) -> Status {
        let ended = self.status.wait_for(|s| s.state.is_terminal()).await;
        ended
            .map(|s| s.clone())
            .unwrap_or_else(|_| self.status.borrow().clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cgroup::CgroupMode;

    /// The race a stop once lost: its request lands in the run's channel
    /// after the actor has taken its last one, and nobody reads it again.
    /// Made here on purpose (a channel kept open and never read, the run
    /// already ended): the stop answers with the ended run.
    #[tokio::test]
    async fn a_stop_whose_request_is_never_read_answers_with_the_ended_run() {
        let (events, _events) = mpsc::unbounded_channel();
        let config = SupervisorConfig {
            cgroups: CgroupMode::Off,
            ..SupervisorConfig::default()
        };
        let sup = Supervisor::new(config, events);
        let mut spec = LaunchSpec::new("stranded", vec!["/bin/true".into()]);
        spec.generation = 7;
        let (shared, _status) = sup.shared(&spec, 0, None);
        shared.transition(State::Exited, "ended".into(), |_| {});
        let (stops, unread) = mpsc::channel(4);
        let entry = Entry {
            shared,
            stops,
            grace: Duration::from_secs(1),
            adopted: false,
        };
        sup.table().insert("stranded".into(), entry);
        let stopping = sup.stop_run("stranded", 7, None, None).await;
        let stop = stopping.expect("the run").ended();
        let answer = tokio::time::timeout(Duration::from_secs(10), stop).await;
        let status = answer.expect("answered");
        assert_eq!((status.state, status.generation), (State::Exited, 7));
        drop(unread);
    }
}
