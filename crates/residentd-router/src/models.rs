//! Which model a request names, and getting it READY and held.
//!
//! - The roster (names and aliases, concurrency limits) comes from the
//!   agent's `Workloads` RPC and is asked again when a request names a model
//!   the router does not know.
//! - Each workload is served by one instance: a READY instance of it that
//!   is already running, under whatever id it was started (by an operator,
//!   an orchestrator), else one the router starts with the workload's name
//!   as its id. A request *holds* it (Touch with a hold) while it is answered;
//!   the holds of one model are counted here, renewed while any request is
//!   in flight, and released (Touch `release_hold`) when the last one ends.
//!   Count and RPC change under one lock per model, so a release can never
//!   overtake a newer hold.
//! - Starts go through one FIFO gate. A start the agent refuses as
//!   *temporary* (memory held by requests in flight) waits at the head of
//!   the gate until a hold drops here or a dry run of it (Place naming the
//!   instance) says it would go through, bounded by the queue timeout. For its
//!   first `swap_after`, new requests for the loaded models it waits for
//!   (the refusal's holders) are still served: a loaded model's requests
//!   go before a swap, so A-B-A does not thrash. After it, they queue
//!   behind the start instead of renewing their holds, so a swap cannot be
//!   starved; requests for other resident models are served meanwhile.
//! - A start on demand whose every waiting request has gone (clients that
//!   hung up) is stopped while it still loads, unless a request waits for
//!   it again: memory is not held for a model nobody waits for.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, RwLock};
use resident_api::pb;
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};

use crate::agent::{Agent, StartError};
use crate::error::RouterError;
use crate::metrics::Metrics;

/// How often a start blocked by holds asks (with a dry run) whether it
/// still would be, without a release seen here (holds set by other
/// clients of the agent lapse on their own).
const RECHECK: Duration = Duration::from_millis(250);

/// The least time between two reads of the roster for unknown names.
const REREAD: Duration = Duration::from_secs(1);

/// Starts of one request after which it gives up on a model that keeps
/// ending right after it became ready.
const MAX_STARTS: u32 = 3;

/// One workload as the router serves it.
#[derive(Debug)]
pub struct Model {
    /// The workload's name, also the id of the instances the router starts.
    pub name: String,
    /// The concurrency limit (0: none) and its permits. A refresh that
    /// changes the limit puts new permits here; requests in flight keep
    /// theirs of the old ones.
    limits: Mutex<(u32, Arc<Semaphore>)>,
    /// Requests in flight holding the instance, and which instance.
    holds: tokio::sync::Mutex<Holds>,
    /// Requests waiting for its start on demand.
    waiters: std::sync::atomic::AtomicUsize,
    /// Whether a start on demand of it is under way.
    loading: std::sync::atomic::AtomicBool,
}

/// The instance a model is served through and the requests holding it.
#[derive(Debug)]
struct Holds {
    count: u32,
    /// Its id: the workload's name, or another READY instance's id.
    instance: String,
}

fn permits(limit: u32) -> Arc<Semaphore> {
    Arc::new(Semaphore::new(if limit == 0 {
        Semaphore::MAX_PERMITS
    } else {
        limit as usize
    }))
}

impl Model {
    fn new(name: &str, limit: u32) -> Self {
        Self {
            name: name.to_string(),
            limits: Mutex::new((limit, permits(limit))),
            holds: tokio::sync::Mutex::new(Holds {
                count: 0,
                instance: name.to_string(),
            }),
            waiters: std::sync::atomic::AtomicUsize::new(0),
            loading: std::sync::atomic::AtomicBool::new(false),
        }
    }

    fn limits(&self) -> parking_lot::MutexGuard<'_, (u32, Arc<Semaphore>)> {
        self.limits.lock()
    }

    fn set_limit(&self, limit: u32) {
        let mut l = self.limits();
        if l.0 != limit {
            *l = (limit, permits(limit));
        }
    }
}

/// The roster as last read from the agent.
#[derive(Debug, Default)]
struct Roster {
    /// Name or alias to model.
    by_name: HashMap<String, Arc<Model>>,
    /// Every model ever served, by workload name: a refresh never replaces
    /// or drops one, so the holds of requests in flight stay counted (and
    /// renewed) whatever the roster becomes.
    all: HashMap<String, Arc<Model>>,
    /// When the roster was last read.
    read_at: Option<Instant>,
    /// The workloads, in the agent's order.
    workloads: Vec<pb::Workload>,
}

/// The times that shape the queue.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    /// How long each hold lasts (renewed while a request is in flight).
    pub hold: Duration,
    /// The longest a request waits for its start.
    pub queue_timeout: Duration,
    /// How long a start waiting for a loaded model's memory lets that
    /// model's new requests go first.
    pub swap_after: Duration,
    /// The most requests forwarded at once, all models together (0: no
    /// limit).
    pub max_busy: usize,
}

/// Everything the router knows about its models.
#[derive(Debug)]
pub struct Models {
    agent: Agent,
    hold: Duration,
    queue_timeout: Duration,
    swap_after: Duration,
    roster: RwLock<Roster>,
    gate: tokio::sync::Mutex<()>,
    /// Turns to be forwarded (`max_busy`), handed out in arrival order;
    /// `None` without a limit.
    busy: Option<Arc<Semaphore>>,
    /// The instances that starts now waiting on holds wait for, each with
    /// when each of those starts began to wait. A request for one of them
    /// queues behind a start that has waited `swap_after` instead of
    /// holding it again.
    blocking: Mutex<HashMap<String, Vec<Instant>>>,
    /// Signalled whenever a model's last hold was released.
    released: Notify,
    metrics: Arc<Metrics>,
    /// Holds whose release is still to be sent (counted for shutdown).
    releasing: Mutex<tokio::task::JoinSet<()>>,
}

/// A request's claim on a READY instance: its hold and its permit. Dropped
/// when the answer has been sent (or the client went away).
#[derive(Debug)]
pub struct Held {
    /// The model.
    pub model: Arc<Model>,
    /// The port of its server on loopback.
    pub port: u16,
    /// The instance's pid (for the request log).
    pub pid: u32,
    models: Arc<Models>,
    permit: Option<OwnedSemaphorePermit>,
    /// Its turn to be forwarded (`max_busy`), taken last.
    busy: Option<OwnedSemaphorePermit>,
}

impl Held {
    /// The claim, with the request's concurrency permit.
    fn with(mut self, permit: Option<OwnedSemaphorePermit>) -> Self {
        self.permit = permit;
        self
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let models = self.models.clone();
        let model = self.model.clone();
        models.metrics.in_flight(&model.name, -1);
        let mut tasks = self.models.releasing.lock();
        while tasks.try_join_next().is_some() {}
        tasks.spawn(async move { models.unhold(&model).await });
    }
}

impl Models {
    /// Models served through `agent`, each request holding its instance for
    /// `hold` (renewed) and a start waiting at most `queue_timeout`.
    pub fn new(agent: Agent, timing: Timing, metrics: Arc<Metrics>) -> Arc<Self> {
        Arc::new(Self {
            agent,
            hold: timing.hold,
            queue_timeout: timing.queue_timeout,
            swap_after: timing.swap_after,
            roster: RwLock::new(Roster::default()),
            gate: tokio::sync::Mutex::new(()),
            busy: (timing.max_busy > 0).then(|| Arc::new(Semaphore::new(timing.max_busy))),
            blocking: Mutex::new(HashMap::new()),
            released: Notify::new(),
            metrics,
            releasing: Mutex::new(tokio::task::JoinSet::new()),
        })
    }

    /// The agent.
    pub fn agent(&self) -> &Agent {
        &self.agent
    }

    /// Reads the roster again from the agent.
    pub async fn refresh(&self) -> Result<(), tonic::Status> {
        let workloads = self.agent.workloads().await?;
        let mut roster = self.roster.write();
        let mut by_name = HashMap::new();
        for w in &workloads {
            let model = roster
                .all
                .entry(w.name.clone())
                .or_insert_with(|| Arc::new(Model::new(&w.name, w.concurrency_limit)))
                .clone();
            model.set_limit(w.concurrency_limit);
            by_name.insert(w.name.clone(), model.clone());
            for alias in &w.aliases {
                by_name.insert(alias.clone(), model.clone());
            }
        }
        roster.by_name = by_name;
        roster.workloads = workloads;
        roster.read_at = Some(Instant::now());
        Ok(())
    }

    /// The workload a name or alias stands for, as last read (no RPC).
    pub fn known(&self, name: &str) -> Option<String> {
        self.lookup(name).map(|m| m.name.clone())
    }

    /// The roster's workloads.
    pub fn workloads(&self) -> Vec<pb::Workload> {
        self.roster.read().workloads.clone()
    }

    fn lookup(&self, name: &str) -> Option<Arc<Model>> {
        let roster = self.roster.read();
        roster.by_name.get(name).cloned()
    }

    /// The model called `name` (a workload or an alias); asks the agent
    /// again before saying there is none, at most once a second (so a
    /// stream of unknown names costs the agent little).
    pub async fn resolve(&self, name: &str) -> Result<Arc<Model>, RouterError> {
        if let Some(m) = self.lookup(name) {
            return Ok(m);
        }
        let read_at = self.roster.read().read_at;
        if read_at.is_none_or(|t| t.elapsed() >= REREAD) {
            self.refresh()
                .await
                .map_err(|s| RouterError::from_status(&s))?;
        }
        self.lookup(name)
            .ok_or_else(|| RouterError::unknown_model(name))
    }

    /// A READY instance of `model`, held for this request: at once when it
    /// is resident, else started on demand (one start at a time, in
    /// arrival order); then, under `max_busy`, its turn to be forwarded
    /// (in arrival order, all models together), within the same
    /// `queue_timeout`.
    pub async fn acquire(self: &Arc<Self>, model: Arc<Model>) -> Result<Held, RouterError> {
        let deadline = Instant::now() + self.queue_timeout;
        let mut held = self.instance(model, deadline).await?;
        if let Some(busy) = &self.busy {
            let turn = tokio::time::timeout_at(deadline.into(), busy.clone().acquire_owned());
            match turn.await {
                Ok(Ok(permit)) => held.busy = Some(permit),
                Ok(Err(_)) => unreachable!("the busy semaphore is never closed"),
                Err(_) => {
                    self.metrics.queue_timeout(&held.model.name);
                    return Err(self.timed_out(
                        &held.model,
                        "other requests were being answered (--max-busy)",
                    ));
                }
            }
        }
        Ok(held)
    }

    /// A READY instance of `model`, held for this request (`acquire`
    /// without the turn to be forwarded).
    async fn instance(
        self: &Arc<Self>,
        model: Arc<Model>,
        deadline: Instant,
    ) -> Result<Held, RouterError> {
        let (limit, permits) = model.limits().clone();
        let permit = match limit {
            0 => None,
            limit => Some(
                permits
                    .try_acquire_owned()
                    .map_err(|_| RouterError::too_many(&model.name, limit))?,
            ),
        };
        if !self.blocks(&model.holds.lock().await.instance)
            && let Some(held) = self.hold(&model).await?
        {
            return Ok(held.with(permit));
        }
        // From here it waits for a start: counted, so that a start nobody
        // waits for any more is stopped while it loads.
        let _waiting = Waiter::new(self, &model);
        let Ok(turn) = tokio::time::timeout_at(deadline.into(), self.gate.lock()).await else {
            self.metrics.queue_timeout(&model.name);
            return Err(self.timed_out(&model, "other starts were ahead of it"));
        };
        let mut starts = 0;
        // Set at the first temporary refusal, kept until this returns: new
        // requests queue behind this start meanwhile.
        let mut waiting: Option<Waiting<'_>> = None;
        let mut looked = false;
        loop {
            if let Some(held) = self.hold(&model).await? {
                drop(turn);
                return Ok(held.with(permit));
            }
            // Not served through the instance it knew: one already READY
            // under another id (started by an operator or an
            // orchestrator) serves it as well as one of ours; else ours,
            // started below under the workload's name.
            let other = if looked {
                None
            } else {
                looked = true;
                self.running_instance(&model.name).await
            };
            if self.serve_through(&model, other.as_deref()).await {
                continue;
            }
            if starts == MAX_STARTS {
                return Err(RouterError::upstream(
                    &model.name,
                    format!("ended right after becoming ready, {MAX_STARTS} times"),
                ));
            }
            // Armed before the start, so a release while it is refused is
            // not missed.
            let released = self.released.notified();
            tokio::pin!(released);
            released.as_mut().enable();
            let began = Instant::now();
            model
                .loading
                .store(true, std::sync::atomic::Ordering::SeqCst);
            let started = self.agent.start(&model.name, &model.name).await;
            model
                .loading
                .store(false, std::sync::atomic::Ordering::SeqCst);
            match started {
                Ok(_) => {
                    starts += 1;
                    self.metrics.started(&model.name, "ok", began.elapsed());
                    tracing::info!(model = %model.name, ms = began.elapsed().as_millis() as u64, "started on demand");
                }
                Err(StartError::Refused {
                    temporary: true,
                    message,
                    holders,
                    ..
                }) => {
                    match &mut waiting {
                        Some(w) => w.wait_for(holders),
                        None => waiting = Some(Waiting::new(self, &model.name, holders)),
                    }
                    tracing::debug!(model = %model.name, %message, "waiting for held memory");
                    // Started again once a release is seen here, or once a
                    // dry run of the Start (Place, which the agent neither
                    // logs nor counts) says it would no longer wait: a Start
                    // refused every RECHECK would fill the agent's log, its
                    // audit lines, events and refusal count meanwhile.
                    let wait = async {
                        loop {
                            tokio::select! {
                                () = released.as_mut() => return,
                                () = tokio::time::sleep(RECHECK) => {},
                            }
                            match self.agent.place_start(&model.name, &model.name).await {
                                Ok(p) if !p.admitted && p.refusals.iter().any(|r| r.temporary) => {}
                                _ => return,
                            }
                        }
                    };
                    if tokio::time::timeout_at(deadline.into(), wait)
                        .await
                        .is_err()
                    {
                        self.metrics.queue_timeout(&model.name);
                        return Err(self.timed_out(&model, &message));
                    }
                }
                Err(StartError::Refused {
                    reason, message, ..
                }) => {
                    self.metrics
                        .started(&model.name, "refused", began.elapsed());
                    return Err(RouterError::unplaceable(&reason, &message));
                }
                Err(StartError::Failed(message)) => {
                    self.metrics.started(&model.name, "failed", began.elapsed());
                    return Err(RouterError::upstream(&model.name, message));
                }
                Err(StartError::Unavailable(message)) => return Err(RouterError::agent(message)),
                Err(StartError::Denied(message)) => return Err(RouterError::denied(message)),
            }
        }
    }

    fn blocking_lock(&self) -> parking_lot::MutexGuard<'_, HashMap<String, Vec<Instant>>> {
        self.blocking.lock()
    }

    /// Whether a start has waited `swap_after` for memory that `name`'s
    /// instance holds: then a new request for it queues behind that start.
    fn blocks(&self, name: &str) -> bool {
        self.blocking_lock()
            .get(name)
            .is_some_and(|since| since.iter().any(|t| t.elapsed() >= self.swap_after))
    }

    /// The last request waiting for `model`'s start went away: if that
    /// start is still loading and nobody waits for it again, it is
    /// stopped, so that no memory is held for a model nobody waits for.
    async fn abandoned(self: Arc<Self>, model: Arc<Model>) {
        use std::sync::atomic::Ordering;
        if !model.loading.load(Ordering::SeqCst) || model.waiters.load(Ordering::SeqCst) > 0 {
            return;
        }
        let loading = self.agent.list().await.ok().and_then(|list| {
            list.into_iter().find(|i| {
                i.instance_id == model.name
                    && (i.state == pb::State::Pending as i32
                        || i.state == pb::State::Starting as i32)
            })
        });
        if loading.is_none() || model.waiters.load(Ordering::SeqCst) > 0 {
            return;
        }
        tracing::info!(model = %model.name, "every request waiting for its start went away: stopping the load");
        self.metrics.load_abandoned(&model.name);
        if let Err(e) = self.agent.stop(&model.name).await {
            tracing::warn!(model = %model.name, error = %e.message(), "could not stop the abandoned load");
        }
    }

    fn timed_out(&self, model: &Model, why: &str) -> RouterError {
        RouterError::queue_timeout(&model.name, self.queue_timeout.as_secs(), why)
    }

    /// Holds `model`'s instance if it is READY; counts the hold. `None`
    /// (and no hold left behind) when it is not. Runs in a task of its own:
    /// a caller that goes away mid-way (its client hung up) cannot leave
    /// the agent holding what nothing counts, since the task's `Held`, then
    /// dropped unclaimed, releases it.
    async fn hold(self: &Arc<Self>, model: &Arc<Model>) -> Result<Option<Held>, RouterError> {
        let (me, model) = (self.clone(), model.clone());
        tokio::spawn(async move { me.hold_now(model).await })
            .await
            .map_err(|e| RouterError::agent(format!("the hold task failed: {e}")))?
    }

    async fn hold_now(self: Arc<Self>, model: Arc<Model>) -> Result<Option<Held>, RouterError> {
        let mut holds = model.holds.lock().await;
        let instance = self
            .agent
            .hold(&holds.instance, self.hold)
            .await
            .map_err(|s| RouterError::from_status(&s))?;
        match instance {
            Some(i) if i.state == pb::State::Ready as i32 && i.port != 0 => {
                holds.count += 1;
                drop(holds);
                self.metrics.in_flight(&model.name, 1);
                Ok(Some(Held {
                    port: u16::try_from(i.port).unwrap_or(0),
                    pid: i.pid,
                    model,
                    models: self.clone(),
                    permit: None,
                    busy: None,
                }))
            }
            Some(_) if holds.count == 0 => {
                // Resident but not serving (starting, restarting): our
                // touch must not leave a hold on it.
                let _ = self.agent.release(&holds.instance).await;
                Ok(None)
            }
            _ => Ok(None),
        }
    }

    /// A READY instance of workload `name` running under another id than
    /// its name, if the agent lists one (the oldest id first).
    async fn running_instance(&self, name: &str) -> Option<String> {
        let listed = self.agent.list().await.ok()?;
        listed
            .into_iter()
            .filter(|i| i.workload == name && i.instance_id != name)
            .find(|i| i.state == pb::State::Ready as i32 && i.port != 0)
            .map(|i| i.instance_id)
    }

    /// Serves `model` through instance `other` (its own name when `None`)
    /// from now on, unless requests in flight hold the one it has; says
    /// whether that changed the instance it knew.
    async fn serve_through(&self, model: &Model, other: Option<&str>) -> bool {
        let mut holds = model.holds.lock().await;
        let id = other.unwrap_or(&model.name);
        if holds.count > 0 || holds.instance == id {
            return false;
        }
        tracing::info!(model = %model.name, instance_id = id, "served through instance");
        holds.instance = id.to_string();
        other.is_some()
    }

    /// One request of `model` is done: the last one releases the hold.
    async fn unhold(&self, model: &Model) {
        let mut holds = model.holds.lock().await;
        holds.count = holds.count.saturating_sub(1);
        if holds.count == 0 {
            if let Err(e) = self.agent.release(&holds.instance).await {
                tracing::warn!(model = %model.name, error = %e.message(), "could not release the hold; it lapses on its own");
            }
            self.released.notify_waiters();
        }
    }

    /// Renews the holds of every model with requests in flight, every
    /// third of the hold, until the router stops.
    pub async fn renew_holds(self: Arc<Self>) {
        let mut every = tokio::time::interval(self.hold / 3);
        every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            every.tick().await;
            let models: Vec<Arc<Model>> = {
                let roster = self.roster.read();
                roster.all.values().cloned().collect()
            };
            for m in models {
                let holds = m.holds.lock().await;
                if holds.count > 0 {
                    let _ = self.agent.hold(&holds.instance, self.hold).await;
                }
            }
        }
    }

    /// Waits until every hold release already begun has been sent.
    pub async fn settle(&self) {
        let mut tasks = std::mem::take(&mut *self.releasing.lock());
        while tasks.join_next().await.is_some() {}
    }
}

/// A request waiting for its model's start, counted while it waits.
struct Waiter {
    models: Arc<Models>,
    model: Arc<Model>,
}

impl Waiter {
    fn new(models: &Arc<Models>, model: &Arc<Model>) -> Self {
        model
            .waiters
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self {
            models: models.clone(),
            model: model.clone(),
        }
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let before = self
            .model
            .waiters
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        if before == 1 && self.model.loading.load(std::sync::atomic::Ordering::SeqCst) {
            let (models, model) = (self.models.clone(), self.model.clone());
            tokio::spawn(models.abandoned(model));
        }
    }
}

/// A start waiting on holds, and the instances it waits for, while it
/// exists.
struct Waiting<'a> {
    models: &'a Models,
    model: String,
    holders: Vec<String>,
    since: Instant,
}

impl<'a> Waiting<'a> {
    fn new(models: &'a Models, model: &str, holders: Vec<String>) -> Self {
        models.metrics.waiting(model, 1);
        let mut w = Self {
            models,
            model: model.to_string(),
            holders: Vec::new(),
            since: Instant::now(),
        };
        w.wait_for(holders);
        w
    }

    /// Now waits for `holders` (the latest refusal's) instead.
    fn wait_for(&mut self, holders: Vec<String>) {
        let mut blocking = self.models.blocking_lock();
        unblock(&mut blocking, &self.holders, self.since);
        for h in &holders {
            blocking.entry(h.clone()).or_default().push(self.since);
        }
        self.holders = holders;
    }
}

fn unblock(blocking: &mut HashMap<String, Vec<Instant>>, holders: &[String], since: Instant) {
    for h in holders {
        if let Some(list) = blocking.get_mut(h) {
            if let Some(i) = list.iter().position(|t| *t == since) {
                list.swap_remove(i);
            }
            if list.is_empty() {
                blocking.remove(h);
            }
        }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        unblock(&mut self.models.blocking_lock(), &self.holders, self.since);
        self.models.metrics.waiting(&self.model, -1);
    }
}
