//! Carrying a Start and an Adopt out: the books decide (one critical
//! section), then victims are stopped side by side (`stop.rs`), evicted memory is
//! awaited, the journal that records the admission is awaited on disk,
//! and only then is the instance spawned. A journal known to fail refuses
//! a Start before anything is decided. Once admitted, a Start runs to its
//! end in a task of its own, so a caller that hangs up cannot leave a
//! reservation without a run.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use resident_api::{ApiError, pb};
use resident_config::{Config, Workload};
use resident_core::{InstanceId, Policy};
use resident_supervisor::{Adoption, State, Supervisor};

use super::adoption::{AdoptCall, Looked, look_at};
use super::books::{Admitted, Books, Decision, Sleepy};
use super::durability::Durability;
use super::kv::KvStore;
use super::parts::Parts;
use super::probes::Probes;
use super::reading::Reader;
use super::roster::{Keys, workload_of};
use super::shared::{Clock, Closing, Current};
use super::sleep::Sleeps;
use super::stop::Stopper;
use super::tell::Teller;
use crate::metrics::Metrics;

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

/// The admissions: Start, Adopt, and the wakes a Start makes.
#[derive(Debug)]
pub(super) struct Admissions {
    config: Current,
    books: Arc<Books>,
    sup: Supervisor,
    kv: Arc<KvStore>,
    probes: Arc<Probes>,
    durability: Arc<Durability>,
    metrics: Arc<Metrics>,
    teller: Arc<Teller>,
    reader: Arc<Reader>,
    stopper: Arc<Stopper>,
    sleeps: Arc<Sleeps>,
    keys: Arc<Keys>,
    clock: Clock,
    closing: Closing,
    /// Numbers generated instance ids.
    id_seq: AtomicU64,
}

impl Admissions {
    /// The room, on the parts (and the rooms) it uses.
    pub(super) fn new(
        p: &Parts,
        teller: Arc<Teller>,
        reader: Arc<Reader>,
        stopper: Arc<Stopper>,
        sleeps: Arc<Sleeps>,
    ) -> Self {
        Self {
            config: p.config.clone(),
            books: p.books.clone(),
            sup: p.sup.clone(),
            kv: p.kv.clone(),
            probes: p.probes.clone(),
            durability: p.durability.clone(),
            metrics: p.metrics.clone(),
            teller,
            reader,
            stopper,
            sleeps,
            keys: p.keys.clone(),
            clock: p.clock,
            closing: p.closing.clone(),
            id_seq: AtomicU64::new(0),
        }
    }
}

/// When a Start answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Answer {
    /// Once the journal on disk holds the instance (`durable_answers`).
    Durable,
    /// Without waiting for the disk (restoring: one write at the end).
    Prompt,
}

/// What the decision half of a Start came to.
pub(super) enum Admission {
    /// The instance exists: the answer.
    Existing(Started),
    /// Admitted: to be carried out.
    New(Request, Admitted),
}

/// A run an earlier agent left running, which a restore takes over: the
/// pools it was given, and where it stood in its sleep.
pub(super) struct TakenOver<'a> {
    /// The pools of each any-of demand, in label order.
    pub(super) chosen: &'a [Vec<String>],
    /// `None`: awake; asleep, or falling asleep or waking (its call to be
    /// made again).
    pub(super) as_it_was: Option<Sleepy>,
}

/// One Start, as decided on one config snapshot.
pub(super) struct Request {
    config: Arc<Config>,
    workload: Arc<Workload>,
    id: InstanceId,
    wait_ready: bool,
    answer: Answer,
    /// The journal change that records the admission.
    admitted: u64,
    /// A process an earlier agent left running for it, taken over instead
    /// of spawning one (a restore).
    take_over: Option<resident_supervisor::TakeOver>,
}

impl Request {
    /// Takes over `process` instead of spawning.
    pub(super) fn taking_over(self, process: resident_supervisor::TakeOver) -> Self {
        Self {
            take_over: Some(process),
            ..self
        }
    }
}

impl Admissions {
    /// Starts an instance of `workload`: plan and reserve atomically, stop
    /// the victims, spawn, and (with `wait_ready`) wait for READY. Answers
    /// once the journal on disk holds the instance.
    pub(super) async fn start(
        self: &Arc<Self>,
        workload: &str,
        id: Option<InstanceId>,
        policy: Option<Policy>,
        wait_ready: bool,
        lease_ms: u64,
    ) -> Result<Started, ApiError> {
        let answer = Answer::Durable;
        let admission = self
            .admit_start(workload, id, policy, wait_ready, lease_ms, answer, None)
            .await?;
        let (request, admitted) = match admission {
            Admission::Existing(started) => return Ok(started),
            Admission::New(request, admitted) => (request, admitted),
        };
        let me = self.clone();
        tokio::spawn(async move { me.carry_out(request, admitted).await })
            .await
            .map_err(|e| ApiError::Internal(format!("the start task failed: {e}")))?
    }

    /// The decision half of a Start: the books admit it (or it exists, or
    /// it is refused); nothing is stopped or spawned yet. `taken`: a
    /// process an earlier agent left, admitted as it was (under refuse),
    /// each any-of demand pinned to the pools it was given while they are
    /// still among its candidates (when not, the log and the run's
    /// message say so).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn admit_start(
        self: &Arc<Self>,
        workload: &str,
        id: Option<InstanceId>,
        policy: Option<Policy>,
        wait_ready: bool,
        lease_ms: u64,
        answer: Answer,
        taken: Option<&TakenOver<'_>>,
    ) -> Result<Admission, ApiError> {
        let mut config = self.config.get();
        let pinned = taken.map_or(&[][..], |t| t.chosen);
        let (mut w, mut unpinned) = pin(workload_of(&config, workload)?, pinned);
        let id = match id {
            Some(id) => id,
            None => generated_id(&w, self.id_seq.fetch_add(1, Ordering::Relaxed) + 1),
        };
        let asked = policy;
        let mut policy = asked.unwrap_or(config.node.on_full);
        if answer == Answer::Durable && config.node.durable_answers {
            // A journal that cannot be written (a full or read-only
            // state_dir) refuses starts before anything is decided; the
            // writer retries every second and starts resume once it can.
            if let Some(why) = self.durability.failing() {
                return Err(ApiError::Unavailable(format!(
                    "the journal cannot be written ({why}); no start until it can, so that nothing runs that a crash would forget"
                )));
            }
        }
        self.reader.refresh_async(&config).await;
        let mut key = self.keys.fresh(&config, &w);
        let admitted = loop {
            if self.closing.is_closing() {
                return Err(ApiError::Unavailable("the agent is shutting down".into()));
            }
            let now = self.clock.now_ms();
            let taken_over = taken.map(|t| t.as_it_was);
            match self
                .books
                .admit(&config, &w, &id, policy, now, lease_ms, key, taken_over)
            {
                Err(ApiError::Refused { refusal, placement }) => {
                    self.teller.refused(workload, &refusal, policy);
                    return Err(ApiError::Refused { refusal, placement });
                }
                Err(e) => return Err(e),
                Ok(Decision::Stopping(released)) => {
                    // The same instance is stopping: answering with its
                    // run would promise a dying one. Admit it anew once
                    // that run has released its memory.
                    tracing::debug!(instance_id = %id, "waiting for the stopping run to end");
                    let _ = released.await;
                }
                Ok(Decision::Wake(a)) => {
                    let me = self.clone();
                    let workload = w.spec.workload.to_string();
                    let woken =
                        tokio::spawn(async move { me.carry_out_wake(id, &workload, a).await })
                            .await
                            .map_err(|e| {
                                ApiError::Internal(format!("the wake task failed: {e}"))
                            })??;
                    return Ok(Admission::Existing(woken));
                }
                Ok(Decision::Existing(record)) => {
                    if wait_ready {
                        // A caller asking for READY gets READY (or why
                        // not), whoever started the instance.
                        self.ready_or_failed(id.as_str(), record.generation).await?;
                    }
                    let record = self.books.record(id.as_str()).unwrap_or(record);
                    return Ok(Admission::Existing(Started {
                        instance: self.teller.view(id.as_str(), &record),
                        created: false,
                        evicted: Vec::new(),
                        slept: Vec::new(),
                    }));
                }
                Ok(Decision::Admitted(a)) => break a,
                Ok(Decision::Reconfigured) => {
                    // A reload came between this call's snapshot and the
                    // books: decide again on the config the books hold.
                    tokio::task::yield_now().await;
                    config = self.config.get();
                    (w, unpinned) = pin(workload_of(&config, workload)?, pinned);
                    policy = asked.unwrap_or(config.node.on_full);
                    key = self.keys.fresh(&config, &w);
                }
            }
        };
        for (gone, record) in &admitted.forgotten {
            self.teller.forgotten(gone, record);
        }
        if let Some(text) = unpinned {
            // Its process uses the pools it was given; the books now say
            // others. Said, not chosen in silence.
            tracing::warn!(instance_id = %id, "{text}");
            self.books.note(id.as_str(), admitted.generation, text);
        }
        let admitted_change = self.durability.change();
        self.metrics.admitted(workload);
        let request = Request {
            config,
            workload: w,
            id,
            wait_ready,
            answer,
            admitted: admitted_change,
            take_over: None,
        };
        Ok(Admission::New(request, admitted))
    }

    /// The admitted Start: victims, memory, spawn, journal, readiness.
    pub(super) async fn carry_out(
        self: Arc<Self>,
        r: Request,
        a: Admitted,
    ) -> Result<Started, ApiError> {
        let (evicted, slept) = self
            .make_room(r.id.as_str(), &r.config, &r.workload, &a)
            .await;
        let instance = self.spawn(&r, a.generation, &a.devices).await?;
        Ok(Started {
            instance,
            created: true,
            evicted,
            slept,
        })
    }

    /// The admitted wake of `id`, asleep: victims, sleepers, memory, then
    /// its wake call.
    async fn carry_out_wake(
        self: Arc<Self>,
        id: InstanceId,
        workload: &str,
        a: Admitted,
    ) -> Result<Started, ApiError> {
        let config = self.config.get();
        // The workload the run was started from: a reload since may have
        // changed or removed it, and the wake admitted must still be made
        // (or it would be left waking for good).
        let w = self
            .books
            .record(id.as_str())
            .filter(|r| r.generation == a.generation)
            .map(|r| r.workload.clone())
            .ok_or_else(|| {
                ApiError::Aborted(format!("instance '{id}' was stopped before it woke"))
            })?;
        let (evicted, slept) = self.make_room(id.as_str(), &config, &w, &a).await;
        self.sleeps
            .wake_up(id.as_str(), a.generation, workload)
            .await?;
        let record = self
            .books
            .record(id.as_str())
            .filter(|r| r.generation == a.generation)
            .ok_or_else(|| {
                ApiError::Aborted(format!("instance '{id}' was stopped while it woke"))
            })?;
        Ok(Started {
            instance: self.teller.view(id.as_str(), &record),
            created: false,
            evicted,
            slept,
        })
    }

    /// An admission's moves: the sleepers put to sleep and the victims
    /// stopped, side by side; the runs in the way awaited; the memory they
    /// give back awaited. Returns who was evicted and who put to sleep.
    async fn make_room(
        self: &Arc<Self>,
        id: &str,
        config: &Config,
        w: &Workload,
        a: &Admitted,
    ) -> (Vec<String>, Vec<String>) {
        let mut evicted: Vec<String> = a.evictions.iter().map(|v| v.id.clone()).collect();
        // A sleeper must be serving to take its sleep call. One chosen
        // while it was still loading (or not yet spawned) is stopped
        // instead: that frees all its sleep would have, and more.
        let (sleepers, unready): (Vec<_>, Vec<_>) = a.sleepers.iter().partition(|s| {
            self.sup
                .status(&s.id)
                .is_some_and(|st| st.generation == s.generation && st.state == State::Ready)
        });
        evicted.extend(unready.iter().map(|s| s.id.clone()));
        let slept: Vec<String> = sleepers.iter().map(|s| s.id.clone()).collect();
        if !slept.is_empty() {
            tracing::info!(instance_id = %id, sleepers = ?slept, "putting to sleep to make room");
        }
        if !evicted.is_empty() {
            tracing::info!(instance_id = %id, victims = ?evicted, "evicting to make room");
        }
        // Victims are stopped side by side, each the run chosen (a victim
        // whose run has ended meanwhile is not stopped again, whatever
        // runs under its id now); each keeps its memory in the books until
        // its run's terminal event. Sleepers fall asleep beside them.
        let mut stops = tokio::task::JoinSet::new();
        let not_serving = format!(
            "to make room for '{}' (instance '{id}'): chosen to sleep, but not serving yet",
            w.spec.workload
        );
        let victims = (a.evictions.iter())
            .map(|v| (&v.id, v.generation, &v.workload, v.cause.clone()))
            .chain(
                (unready.iter()).map(|s| (&s.id, s.generation, &s.workload, not_serving.clone())),
            );
        for (vid, generation, workload, why) in victims {
            self.metrics.evicted(w.spec.workload.as_str(), workload);
            let stopper = self.stopper.clone();
            let (vid, run) = (vid.clone(), Some(generation));
            let cause = Some((pb::Cause::Evicted, why));
            stops.spawn(async move { stopper.stop(&vid, run, None, cause).await.map(|_| ()) });
        }
        for sleeper in sleepers {
            let sleeps = self.sleeps.clone();
            let sleeper = sleeper.clone();
            let why = format!("to make room for '{}' (instance '{id}')", w.spec.workload);
            stops.spawn(async move { sleeps.fall_asleep(&sleeper, &why).await });
        }
        while let Some(result) = stops.join_next().await {
            // NotFound: the chosen run ended by another path meanwhile.
            if let Ok(Err(e)) = result
                && !matches!(e, ApiError::NotFound(_))
            {
                tracing::warn!(instance_id = %id, error = %e, "a victim could not be stopped or put to sleep");
            }
        }
        // Runs in the way that another start is evicting: their release
        // (their group gone, or never spawned) is what this one needs.
        for (other, generation) in &a.wait_for {
            self.books.released(other, *generation).await;
        }
        if !a.recovery.is_empty() {
            self.probes
                .await_back(config.node.memory_recovery, &a.recovery)
                .await;
        }
        (evicted, slept)
    }

    async fn spawn(
        self: &Arc<Self>,
        r: &Request,
        generation: u64,
        devices: &[u32],
    ) -> Result<pb::Instance, ApiError> {
        let id = r.id.as_str();
        if !self.books.wanted(id, generation) {
            // Stopped before it was spawned: the run never existed, so its
            // end is marked here, and told to watchers (no supervisor
            // event will).
            self.books.release(id, generation);
            self.durability.change();
            self.teller.publish_ended(id);
            return Err(ApiError::Aborted(format!(
                "instance '{id}' was stopped before it was spawned"
            )));
        }
        if r.answer == Answer::Durable && r.config.node.durable_answers {
            // The journal holds the instance before its process exists: a
            // crash from here on restores it, and a journal that cannot be
            // written never has a process running that it does not list.
            if let Err(e) = self.durability.settled(r.admitted).await {
                self.books
                    .cancel(id, Some(generation), pb::Cause::Unspecified);
                self.books.release(id, generation);
                self.durability.change();
                self.teller.publish_ended(id);
                return Err(e);
            }
        }
        if r.workload.keep_kv.is_some() {
            let w = r.workload.clone();
            let _ = tokio::task::spawn_blocking(move || KvStore::prepare(&w)).await;
        }
        let spec = r.workload.launch(id, generation, &r.config.node, devices);
        let launched = match r.take_over {
            Some(process) => self.sup.take_over(spec, process).await,
            None => self.sup.start(spec).await,
        };
        match launched {
            // Failed with no exit: the process never ran (spawn error). Its
            // terminal event releases the reservation.
            Ok(status) if status.state == State::Failed && status.exit.is_none() => {
                self.books.released(id, generation).await;
                return Err(ApiError::Internal(format!(
                    "instance '{id}': {}",
                    status.reason
                )));
            }
            Ok(_) => {}
            Err(e) => {
                // No run was made: nothing will report its end.
                self.books.release(id, generation);
                return Err(ApiError::Unavailable(e.to_string()));
            }
        }
        // A fresh run of a workload that keeps its KV restores its saved
        // conversations once READY (a run taken over has them still).
        if r.take_over.is_none() {
            self.restore_conversations(id, generation, &r.workload);
        }
        // The journal records the process group too (for the leftovers a
        // next agent clears); the answer does not wait for that write.
        self.durability.change();
        if !self.books.wanted(id, generation) {
            // A Stop came while it was being spawned; the Stop waits for
            // this run's end, which this stop brings.
            if let Ok(stopping) = self.sup.stop_run(id, generation, None, None).await {
                stopping.ended().await;
            }
            return Err(ApiError::Aborted(format!(
                "instance '{id}' was stopped while it was being spawned"
            )));
        }
        if r.wait_ready {
            self.ready_or_failed(id, generation).await?;
            self.conversations_restored(id, generation).await;
        }
        // The answer is this run: by now a Stop may have ended it and
        // another Start begun a newer one, which the id's record names.
        match self.books.record(id).filter(|r| r.generation == generation) {
            Some(record) => Ok(self.teller.view(id, &record)),
            None => Err(ApiError::Aborted(format!(
                "instance '{id}' was stopped while it was being started"
            ))),
        }
    }

    /// Waits until run `generation` of `id` is READY; Err when it ended
    /// first. A run admitted by another Start and not spawned yet is waited
    /// for while the books still want it.
    async fn ready_or_failed(&self, id: &str, generation: u64) -> Result<(), ApiError> {
        let rx = loop {
            match self.sup.subscribe(id) {
                Some(rx) if rx.borrow().generation == generation => break rx,
                _ if self.books.wanted(id, generation) => {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
                _ => {
                    return Err(ApiError::Aborted(format!(
                        "instance '{id}' was stopped before it became ready"
                    )));
                }
            }
        };
        let mut rx = rx;
        let settled = rx
            .wait_for(|s| s.state == State::Ready || s.state.is_terminal())
            .await
            .map(|s| s.clone());
        match settled {
            Ok(s) if s.state.is_terminal() => Err(ApiError::FailedPrecondition(format!(
                "instance '{id}' did not become ready: {}",
                s.reason
            ))),
            _ => Ok(()),
        }
    }
}

/// `w` with each any-of demand's candidates narrowed to the pools
/// `pinned` names for it (a run taken over keeps the pools it was given),
/// where those are still `count` of its candidates; `w` itself when
/// nothing is pinned. Where the pools given can no longer be pinned (the
/// config changed), also the words that say so.
fn pin(w: Arc<Workload>, pinned: &[Vec<String>]) -> (Arc<Workload>, Option<String>) {
    if pinned.is_empty() {
        return (w, None);
    }
    let given = || {
        let each: Vec<String> = pinned.iter().map(|p| p.join("+")).collect();
        each.join(", ")
    };
    if pinned.len() != w.spec.any_of.len() {
        let text = format!(
            "taken over on pools the planner chose: it was given {} by an earlier agent, and workload '{}' now has {} any-of demands",
            given(),
            w.spec.workload,
            w.spec.any_of.len()
        );
        return (w, Some(text));
    }
    let mut spec = (*w.spec).clone();
    let mut lost = Vec::new();
    for (a, pools) in spec.any_of.iter_mut().zip(pinned) {
        let chosen: Vec<_> = a
            .candidates
            .iter()
            .filter(|c| pools.iter().any(|p| p == c.as_str()))
            .cloned()
            .collect();
        if chosen.len() == a.count && chosen.len() == pools.len() {
            a.candidates = chosen;
        } else {
            lost.push(a.label.clone());
        }
    }
    let unpinned = (!lost.is_empty()).then(|| {
        format!(
            "taken over on pools the planner chose for '{}': an earlier agent gave it {}, which are no longer its candidates",
            lost.join("', '"),
            given()
        )
    });
    let mut pinned = (*w).clone();
    pinned.spec = Arc::new(spec);
    (Arc::new(pinned), unpinned)
}

impl Admissions {
    /// After a spawn: once run `generation` of `id` is READY, its saved
    /// conversations (`keep_kv`) are restored, before a Start that waits
    /// for READY answers (`conversations_restored`).
    fn restore_conversations(self: &Arc<Self>, id: &str, generation: u64, w: &Arc<Workload>) {
        if w.keep_kv.is_none() {
            return;
        }
        let restoring = self.kv.restoring(id, generation);
        let (me, id, w) = (self.clone(), id.to_string(), w.clone());
        tokio::spawn(async move {
            let ready = me
                .sup
                .wait_for(&id, |s| {
                    s.generation != generation || s.state == State::Ready || s.state.is_terminal()
                })
                .await
                .filter(|s| s.generation == generation && s.state == State::Ready);
            if let Some(status) = ready {
                me.kv.restore(&id, &w, status.port).await.count(&me.metrics);
            }
            drop(restoring);
        });
    }

    /// Waits until the restore of run `generation` of `id`, if any, is
    /// done.
    async fn conversations_restored(&self, id: &str, generation: u64) {
        self.kv.restored(id, generation).await;
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

/// Adopt: the flow (adoption.rs checks the process).
impl Admissions {
    /// Adopts a running process (see the module's text); answers once the
    /// journal on disk holds it.
    pub(super) async fn adopt(self: &Arc<Self>, call: AdoptCall) -> Result<pb::Instance, ApiError> {
        self.adopt_answering(call, None, Answer::Durable).await
    }

    /// [`Admissions::adopt`]; with `start_ticks`, only the process that started
    /// then (a journaled adoption being restored).
    pub(super) async fn adopt_answering(
        self: &Arc<Self>,
        call: AdoptCall,
        start_ticks: Option<u64>,
        answer: Answer,
    ) -> Result<pb::Instance, ApiError> {
        let config = self.config.get();
        let w = workload_of(&config, &call.workload)?;
        let pid = call.pid;
        if !w.spec.any_of.is_empty() {
            return Err(ApiError::FailedPrecondition(format!(
                "workload '{}' has an any-of demand: which of its pools a running server holds is not known, so it cannot be adopted",
                w.spec.workload
            )));
        }
        // What the process is, what it may be adopted as, its port and
        // the memory it holds: read from /proc on a blocking thread.
        let looked = {
            let (w, config, port, admin) = (w.clone(), config.clone(), call.port, call.admin);
            tokio::task::spawn_blocking(move || look_at(pid, start_ticks, &w, &config, port, admin))
                .await
                .map_err(|e| ApiError::Internal(format!("looking at pid {pid}: {e}")))??
        };
        let Looked {
            stat,
            port,
            present,
        } = looked;
        if pid == std::process::id() {
            return Err(ApiError::FailedPrecondition(format!(
                "pid {pid} is the agent itself"
            )));
        }
        let ours = self.sup.list().into_iter().find(|s| {
            s.pid
                .is_some_and(|p| p == pid || p as i32 == stat.pgrp || p as i32 == stat.ppid)
        });
        // A process of one of our own runs (not an adoption: adopting the
        // same pid twice is the books' to refuse).
        if let Some(s) = ours
            && self
                .books
                .record(&s.instance)
                .is_none_or(|r| r.adopted.is_none())
        {
            return Err(ApiError::FailedPrecondition(format!(
                "pid {pid} belongs to instance '{}', which this agent runs",
                s.instance
            )));
        }
        let adoption = Adoption {
            pid,
            start_ticks: stat.start_ticks,
            port,
            manage: call.manage,
        };
        let id = call.id;
        let admitted = self
            .books
            .adopt(&config, &w, &id, self.clock.now_ms(), adoption, &present);
        let (generation, forgotten) = match admitted {
            Ok(a) => a,
            Err(ApiError::Refused { refusal, placement }) => {
                self.teller
                    .refused(&call.workload, &refusal, resident_core::Policy::Refuse);
                return Err(ApiError::Refused { refusal, placement });
            }
            Err(e) => return Err(e),
        };
        for (gone, record) in &forgotten {
            self.teller.forgotten(gone, record);
        }
        let spec = w.launch(id.as_str(), generation, &config.node, &[]);
        if let Err(e) = self.sup.adopt(spec, adoption).await {
            // Nothing watches it: its end is marked here.
            self.books.release(id.as_str(), generation);
            self.durability.change();
            self.teller.publish_ended(id.as_str());
            return Err(ApiError::FailedPrecondition(e.to_string()));
        }
        tracing::info!(instance_id = %id, pid, port, manage = call.manage, "adopted");
        let change = self.durability.change();
        if answer == Answer::Durable && config.node.durable_answers {
            // On failure it stays adopted and watched; the caller hears
            // that the journal could not say so.
            self.durability.settled(change).await?;
        }
        self.teller.get(id.as_str())
    }
}
