//! The books: the ledger (`NodeState`) and a record per instance id, under
//! one lock. `Books` is the only way to admit, release and cancel: an
//! admission plans and reserves in one critical section, and everything
//! said about the decision (a refusal's Placement with its pool figures,
//! the victims with their causes, what to wait for) comes out of that same
//! section, so an answer never contradicts the decision it explains.
//!
//! Memory is released in one place, `Books::release`, called with the run
//! (generation) whose end it marks: by the supervisor's terminal event for
//! that run, or by the admission path for a run that was never spawned.
//! Nothing under the lock makes a system call, writes the journal or calls
//! into the supervisor.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};

use resident_api::{ApiError, pb};
use resident_config::{Config, Workload};
use resident_core::{
    AdmitError, Charge, InstanceId, NodeState, Plan, PlanError, Policy, PoolName, PoolStatus, Spec,
};
use resident_supervisor::Adoption;
use tokio::sync::oneshot;

/// What a Touch does to an instance's hold against eviction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Holds it at least this many milliseconds from now (0: no change).
    For(u64),
    /// Ends the hold now.
    Release,
}

/// How an instance came to be and which run of it is current.
#[derive(Debug, Clone)]
pub(super) struct Record {
    pub(super) workload: Arc<Workload>,
    /// What this run holds: the workload's spec with its any-of demands
    /// resolved to the chosen pools.
    pub(super) spec: Arc<Spec>,
    /// The device indexes of the chosen pools (`CUDA_VISIBLE_DEVICES`).
    pub(super) devices: Vec<u32>,
    /// Bumped at every admission of this id; tags the supervisor's run.
    pub(super) generation: u64,
    /// A Stop (or an eviction) has been asked for this run.
    pub(super) cancelled: bool,
    /// The owner's lease, if any.
    pub(super) lease: Option<Lease>,
    /// Entered by Adopt: the process, and whether the agent may signal it.
    pub(super) adopted: Option<Adoption>,
    /// What the agent found about this run beside its state (an adopted
    /// server listening beyond loopback), for its message.
    pub(super) note: Option<String>,
    /// Measured above its reservation: in which pools, and the words of
    /// its message.
    pub(super) overrun: Option<Overrun>,
}

/// A run measured above its reservation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Overrun {
    /// The pools it overran, in name order: an event is told when these
    /// change, not at every reading.
    pub(super) pools: Vec<PoolName>,
    /// `OVERRUN: ...` with both figures of each pool.
    pub(super) text: String,
}

/// A run whose overrun began, changed pools or ended.
#[derive(Debug)]
pub(super) struct OverrunChange {
    pub(super) id: String,
    pub(super) generation: u64,
    /// `None`: back within its reservation.
    pub(super) overrun: Option<Overrun>,
    /// Whether the agent may stop it (not an unmanaged adoption) and no
    /// Stop asked for it yet.
    pub(super) stoppable: bool,
    pub(super) on_overrun: resident_config::OnOverrun,
}

impl Record {
    /// Run `generation` of `w` holding `spec`: not cancelled, no lease, no
    /// devices, not adopted, no note.
    fn run(w: &Arc<Workload>, spec: Arc<Spec>, generation: u64) -> Self {
        Self {
            workload: w.clone(),
            spec,
            devices: Vec::new(),
            generation,
            cancelled: false,
            lease: None,
            adopted: None,
            note: None,
            overrun: None,
        }
    }
}

/// An owner's lease on an instance: it runs out at `until` (the agent's
/// monotonic milliseconds) unless a Touch renews it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Lease {
    pub(super) ms: u64,
    pub(super) until: u64,
}

impl Lease {
    /// A lease of `ms` from `now`; none for 0.
    pub(super) fn new(ms: u64, now: u64) -> Option<Self> {
        (ms > 0).then(|| Self {
            ms,
            until: now.saturating_add(ms),
        })
    }
}

/// A victim of a Start: which run of whom, of which workload, and the
/// cause its stop reports.
#[derive(Debug)]
pub(super) struct Eviction {
    pub(super) id: String,
    /// The run chosen: its stop never ends a later run of the same id.
    pub(super) generation: u64,
    pub(super) workload: String,
    pub(super) cause: String,
}

/// An admitted Start, with everything decided under the lock.
#[derive(Debug)]
pub(super) struct Admitted {
    pub(super) generation: u64,
    /// The device indexes of the pools chosen for its any-of demands.
    pub(super) devices: Vec<u32>,
    pub(super) evictions: Vec<Eviction>,
    /// Conflicting runs (id, generation) already being evicted for
    /// another start: this one waits for their release.
    pub(super) wait_for: Vec<(String, u64)>,
    /// For each live pool the target needs: the bytes to see available
    /// again once the victims have exited.
    pub(super) recovery: Vec<(String, u64)>,
    /// Ended records dropped to keep the table bounded.
    pub(super) forgotten: Vec<(String, Record)>,
}

/// What the books decided for a Start.
#[derive(Debug)]
pub(super) enum Decision {
    /// Admitted: a new run.
    Admitted(Admitted),
    /// The same instance of the same workload is resident: an idempotent
    /// repeat, answered with its current run.
    Existing(Record),
    /// The same instance is stopping; admit again once this fires (or
    /// its sender is dropped).
    Stopping(oneshot::Receiver<()>),
}

/// A Stop's mark on the books.
#[derive(Debug)]
pub(super) struct Cancelled {
    pub(super) generation: u64,
    /// What the run holds (its chosen pools).
    pub(super) spec: Arc<Spec>,
    /// Whether the run still holds its reservation.
    pub(super) resident: bool,
}

#[derive(Debug)]
struct Inner {
    ledger: NodeState,
    records: BTreeMap<String, Record>,
    /// The records whose run holds no reservation, oldest run first: what
    /// `prune_ended` forgets first (kept here so that an admission does
    /// not walk the whole table).
    ended: BTreeSet<(u64, String)>,
    generation: u64,
    /// Who waits for each instance's release (Stops, Starts of a stopping
    /// instance, shutdown): told by `release`, each for its own instance
    /// only, so a storm of n stops wakes n waiters, not n squared.
    waiters: HashMap<String, Vec<oneshot::Sender<()>>>,
}

impl Inner {
    /// Enters the record of a run just reserved, in place of the ended
    /// record of the same id, if any.
    fn enter(&mut self, id: &InstanceId, record: Record) {
        if let Some(before) = self.records.insert(id.to_string(), record) {
            self.ended.remove(&(before.generation, id.to_string()));
        }
    }

    /// Whether `ended` lists exactly the records without a reservation.
    #[cfg(test)]
    fn ended_is_true(&self) -> bool {
        let truth: BTreeSet<(u64, String)> = self
            .records
            .iter()
            .filter(|(id, _)| self.ledger.resident(id).is_none())
            .map(|(id, r)| (r.generation, id.clone()))
            .collect();
        truth == self.ended
    }

    /// A receiver that fires at the next release of `id`; registered
    /// under the lock, so no release is missed.
    fn waiter(&mut self, id: &str) -> oneshot::Receiver<()> {
        let (tx, rx) = oneshot::channel();
        let waiting = self.waiters.entry(id.to_string()).or_default();
        // Waiters that gave up (a cancelled call) go now.
        waiting.retain(|w| !w.is_closed());
        waiting.push(tx);
        rx
    }
}

/// The books of one agent.
#[derive(Debug)]
pub(super) struct Books {
    inner: Mutex<Inner>,
}

impl Books {
    pub(super) fn new(config: &Config) -> Self {
        let mut ledger = NodeState::new(config.pool_configs(), config.groups.clone());
        ledger.set_gpu_choice(config.node.gpu_choice);
        Self {
            inner: Mutex::new(Inner {
                ledger,
                records: BTreeMap::new(),
                ended: BTreeSet::new(),
                generation: 0,
                waiters: HashMap::new(),
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Plans and reserves a Start of `w` as `id`, under `config`.
    pub(super) fn admit(
        &self,
        config: &Config,
        w: &Arc<Workload>,
        id: &InstanceId,
        policy: Policy,
        now: u64,
        lease_ms: u64,
    ) -> Result<Decision, ApiError> {
        let mut b = self.lock();
        let cancelled = b.records.get(id.as_str()).is_some_and(|r| r.cancelled);
        if let Some(r) = b.ledger.resident(id.as_str())
            && (cancelled || r.evicting)
        {
            return Ok(Decision::Stopping(b.waiter(id.as_str())));
        }
        taken(&b, id, w)?;
        let max = config.node.max_instances;
        room(&b, id, max)?;
        let a = match b.ledger.admit(id, w.spec.clone(), policy, now) {
            Err(AdmitError::Refused(refusal)) => {
                return Err(refused(&b.ledger, refusal, &w.spec));
            }
            Err(AdmitError::Invalid(e)) => return Err(plan_error(e)),
            Ok(a) if !a.created => {
                // A repeat by the owner sets its lease anew.
                if let Some(r) = b.records.get_mut(id.as_str()) {
                    r.lease = Lease::new(lease_ms, now);
                }
                let record = b.records.get(id.as_str()).cloned();
                let record = record.unwrap_or_else(|| Record::run(w, w.spec.clone(), 0));
                return Ok(Decision::Existing(record));
            }
            Ok(a) => a,
        };
        let spec = b
            .ledger
            .resident(id.as_str())
            .map_or_else(|| w.spec.clone(), |r| r.spec.clone());
        let evictions = evictions(&b, &spec, id, &a.evict);
        let wait_for = a
            .wait_for
            .iter()
            .filter_map(|w| Some((w.to_string(), b.records.get(w.as_str())?.generation)))
            .collect();
        let recovery = recovery(&b.ledger, config, &spec, &a.evict);
        let devices = config.devices(&a.chosen);
        b.generation += 1;
        let generation = b.generation;
        for v in &a.evict {
            if let Some(r) = b.records.get_mut(v.as_str()) {
                r.cancelled = true;
            }
        }
        let record = Record {
            devices: devices.clone(),
            lease: Lease::new(lease_ms, now),
            ..Record::run(w, spec, generation)
        };
        b.enter(id, record);
        let forgotten = prune_ended(&mut b, max);
        Ok(Decision::Admitted(Admitted {
            generation,
            devices,
            evictions,
            wait_for,
            recovery,
            forgotten,
        }))
    }

    /// Enters the running process of `adoption` as `id`, an instance of
    /// `w` holding `present` bytes already: nothing is evicted for it, and
    /// an unmanaged one is never a victim. Returns the run's generation and
    /// the ended records dropped to keep the table bounded.
    pub(super) fn adopt(
        &self,
        config: &Config,
        w: &Arc<Workload>,
        id: &InstanceId,
        now: u64,
        adoption: Adoption,
        present: &BTreeMap<PoolName, u64>,
    ) -> Result<(u64, Vec<(String, Record)>), ApiError> {
        let mut b = self.lock();
        if b.ledger.resident(id.as_str()).is_some() {
            return Err(ApiError::AlreadyExists(format!(
                "instance '{id}' already holds memory; adopt under another id"
            )));
        }
        taken(&b, id, w)?;
        let twice = b.records.iter().find(|(other, r)| {
            r.adopted.is_some_and(|a| a.pid == adoption.pid) && b.ledger.resident(other).is_some()
        });
        if let Some((other, _)) = twice {
            return Err(ApiError::AlreadyExists(format!(
                "pid {} is already adopted as instance '{other}'",
                adoption.pid
            )));
        }
        let max = config.node.max_instances;
        room(&b, id, max)?;
        match b
            .ledger
            .adopt(id, w.spec.clone(), now, present, adoption.manage)
        {
            Ok(_) => {}
            Err(AdmitError::Refused(refusal)) => {
                return Err(refused(&b.ledger, refusal, &w.spec));
            }
            Err(AdmitError::Invalid(e)) => return Err(plan_error(e)),
        }
        b.generation += 1;
        let generation = b.generation;
        let record = Record {
            adopted: Some(adoption),
            ..Record::run(w, w.spec.clone(), generation)
        };
        b.enter(id, record);
        let forgotten = prune_ended(&mut b, max);
        Ok((generation, forgotten))
    }

    /// Notes what was found about `id`'s run `generation` (shown in its
    /// message); false when that run is no longer current or already has
    /// this note.
    pub(super) fn note(&self, id: &str, generation: u64, note: String) -> bool {
        let mut b = self.lock();
        match b.records.get_mut(id) {
            Some(r) if r.generation == generation && r.note.as_ref() != Some(&note) => {
                r.note = Some(note);
                true
            }
            _ => false,
        }
    }

    /// The placement query: what a Start would do, with the pool figures
    /// it was decided on.
    pub(super) fn place(
        &self,
        w: &Workload,
        policy: Policy,
        now: u64,
    ) -> Result<pb::Placement, ApiError> {
        let b = self.lock();
        let plan = b.ledger.place(&w.spec, policy, now).map_err(plan_error)?;
        Ok(placement(&b.ledger, &plan, &w.spec))
    }

    /// Ends the reservation of `id`'s run `generation`, if it is still the
    /// current one and holds one. The one release path.
    pub(super) fn release(&self, id: &str, generation: u64) -> bool {
        let mut b = self.lock();
        let current = b
            .records
            .get(id)
            .is_some_and(|r| r.generation == generation);
        if current && b.ledger.release(id).is_some() {
            b.ended.insert((generation, id.to_string()));
            for waiter in b.waiters.remove(id).unwrap_or_default() {
                let _ = waiter.send(());
            }
            return true;
        }
        false
    }

    /// Waits until `id`'s run `generation` holds no reservation.
    pub(super) async fn released(&self, id: &str, generation: u64) {
        loop {
            let rx = {
                let mut b = self.lock();
                let holds = b
                    .records
                    .get(id)
                    .is_some_and(|r| r.generation == generation)
                    && b.ledger.resident(id).is_some();
                if !holds {
                    return;
                }
                b.waiter(id)
            };
            let _ = rx.await;
        }
    }

    /// Marks `id`'s current run as stopping; with `run`, only when that is
    /// the current run (a stop decided for one run never ends the next).
    pub(super) fn cancel(&self, id: &str, run: Option<u64>) -> Option<Cancelled> {
        let mut b = self.lock();
        let resident = b.ledger.resident(id).is_some();
        let r = b
            .records
            .get_mut(id)
            .filter(|r| run.is_none_or(|g| g == r.generation))?;
        r.cancelled = true;
        Some(Cancelled {
            generation: r.generation,
            spec: r.spec.clone(),
            resident,
        })
    }

    /// Whether `generation` is still `id`'s run and no Stop asked for it.
    pub(super) fn wanted(&self, id: &str, generation: u64) -> bool {
        let b = self.lock();
        b.records
            .get(id)
            .is_some_and(|r| r.generation == generation && !r.cancelled)
    }

    /// The record of `id`.
    pub(super) fn record(&self, id: &str) -> Option<Record> {
        self.lock().records.get(id).cloned()
    }

    /// Every record, in id order.
    pub(super) fn records(&self) -> Vec<(String, Record)> {
        let b = self.lock();
        b.records
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }

    /// The live instances the exposure guard watches (`expose =
    /// "loopback"`): id, workload, run, and whether it was adopted.
    /// Nothing is copied for the rest.
    pub(super) fn loopback_only(&self) -> Vec<Guarded> {
        let b = self.lock();
        b.records
            .iter()
            .filter(|(_, r)| r.workload.expose == resident_config::Expose::Loopback && !r.cancelled)
            .map(|(id, r)| Guarded {
                id: id.clone(),
                workload: r.workload.spec.workload.to_string(),
                generation: r.generation,
                adopted: r.adopted.is_some(),
            })
            .collect()
    }

    /// What `id` is charged in each pool it asks of; empty when it holds
    /// no reservation.
    pub(super) fn charges(&self, id: &str) -> Vec<(PoolName, Charge)> {
        let b = self.lock();
        let Some(r) = b.ledger.resident(id) else {
            return Vec::new();
        };
        r.spec
            .demand
            .keys()
            .map(|p| (p.clone(), r.charge(p.as_str())))
            .collect()
    }

    /// Brings every record's overrun up to the ledger's last readings
    /// (`text` words one run's overrunning pools) and returns the runs
    /// whose overrun began, changed pools or ended. The words of a
    /// continuing overrun follow the readings without a change listed.
    pub(super) fn sync_overruns(
        &self,
        node_default: resident_config::OnOverrun,
        text: impl Fn(&[(&PoolName, Charge)]) -> String,
    ) -> Vec<OverrunChange> {
        let mut b = self.lock();
        let Inner {
            ledger, records, ..
        } = &mut *b;
        let mut now: BTreeMap<String, Vec<(&PoolName, Charge)>> = BTreeMap::new();
        for (id, pool, charge) in ledger.overruns() {
            now.entry(id.to_string()).or_default().push((pool, charge));
        }
        let now: BTreeMap<String, Overrun> = now
            .into_iter()
            .map(|(id, pools)| {
                let overrun = Overrun {
                    pools: pools.iter().map(|(p, _)| (*p).clone()).collect(),
                    text: text(&pools),
                };
                (id, overrun)
            })
            .collect();
        let mut changes = Vec::new();
        for (id, r) in records.iter_mut() {
            let next = now.get(id).cloned();
            if ledger.resident(id).is_none() {
                // An ended run: its last words stay with its end.
                r.overrun = None;
                continue;
            }
            let changed = r.overrun.as_ref().map(|o| &o.pools) != next.as_ref().map(|o| &o.pools);
            r.overrun = next;
            if changed {
                changes.push(OverrunChange {
                    id: id.clone(),
                    generation: r.generation,
                    overrun: r.overrun.clone(),
                    stoppable: !r.cancelled && r.adopted.is_none_or(|a| a.manage),
                    on_overrun: r.workload.on_overrun.unwrap_or(node_default),
                });
            }
        }
        changes
    }

    /// The pools as they are.
    pub(super) fn pools(&self) -> Vec<pb::PoolStatus> {
        let b = self.lock();
        pool_statuses(&b.ledger, &b.ledger.pools())
    }

    /// Records a use of `id` and renews its lease; false when it holds no
    /// reservation.
    pub(super) fn touch(&self, id: &str, now: u64, hold: Hold) -> bool {
        let mut b = self.lock();
        let used = match hold {
            Hold::For(ms) => b.ledger.touch(id, now, ms),
            Hold::Release => b.ledger.release_hold(id, now),
        };
        if !used {
            return false;
        }
        if let Some(lease) = b.records.get_mut(id).and_then(|r| r.lease.as_mut()) {
            lease.until = now.saturating_add(lease.ms);
        }
        true
    }

    /// Resident instances no Stop asked for whose lease ran out by `now`,
    /// with the lease's length.
    pub(super) fn leases_expired(&self, now: u64) -> Vec<(String, u64, u64)> {
        let b = self.lock();
        b.records
            .iter()
            .filter(|(id, r)| !r.cancelled && b.ledger.resident(id).is_some())
            .filter_map(|(id, r)| {
                let lease = r.lease?;
                (lease.until <= now).then(|| (id.clone(), r.generation, lease.ms))
            })
            .collect()
    }

    /// New pools and groups (a reload); residents keep their reservations.
    pub(super) fn reconfigure(&self, config: &Config) {
        let mut b = self.lock();
        b.ledger
            .reconfigure(config.pool_configs(), config.groups.clone());
        b.ledger.set_gpu_choice(config.node.gpu_choice);
    }

    /// Probe readings: bytes available per pool, and bytes measured per
    /// instance and pool. Host-measured bytes (`host`) count against the
    /// first host-bound pool (of `host_pools`) the instance declares.
    pub(super) fn set_readings(&self, readings: Readings) {
        let mut b = self.lock();
        for (pool, available) in readings.available {
            b.ledger.set_available(&pool, available);
        }
        for (id, pool, bytes) in readings.measured {
            b.ledger.set_measured(&id, &pool, bytes);
        }
        for (id, bytes) in readings.host {
            let pool = b.ledger.resident(&id).and_then(|r| {
                r.spec
                    .demand
                    .keys()
                    .find(|k| readings.host_pools.contains(k))
                    .cloned()
            });
            if let Some(pool) = pool {
                b.ledger.set_measured(&id, &pool, bytes);
            }
        }
    }

    /// Resident, not cancelled instances of workloads with an idle TTL
    /// that have gone unused (and unheld) for longer than it, with their
    /// current run.
    pub(super) fn idle(&self, now: u64) -> Vec<(String, u64)> {
        let b = self.lock();
        b.records
            .iter()
            .filter(|(_, rec)| !rec.cancelled && rec.adopted.is_none_or(|a| a.manage))
            .filter(|(id, rec)| {
                let Some(ttl) = rec.workload.idle_ttl else {
                    return false;
                };
                b.ledger.resident(id).is_some_and(|r| {
                    !r.evicting
                        && !r.held(now)
                        && now.saturating_sub(r.last_used) >= ttl.as_millis() as u64
                })
            })
            .map(|(id, rec)| (id.clone(), rec.generation))
            .collect()
    }

    /// What the journal should hold: resident instances no Stop asked for,
    /// in admission order.
    pub(super) fn journal_rows(&self) -> Vec<JournalRow> {
        let b = self.lock();
        // From the residents, not the records: the records also keep up to
        // `max_instances` ended runs, and the journal is written often.
        let mut rows: Vec<JournalRow> = b
            .ledger
            .residents()
            .filter_map(|res| {
                let id = res.id.as_str();
                b.records.get(id).map(|r| (id, r))
            })
            .filter(|(_, r)| !r.cancelled)
            .map(|(id, r)| JournalRow {
                id: id.to_string(),
                workload: r.workload.spec.workload.to_string(),
                generation: r.generation,
                lease_ms: r.lease.map_or(0, |l| l.ms),
                adopted: r.adopted,
            })
            .collect();
        rows.sort_by_key(|r| r.generation);
        rows
    }

    /// The ids that hold a reservation.
    pub(super) fn resident_ids(&self) -> Vec<String> {
        let b = self.lock();
        b.ledger.residents().map(|r| r.id.to_string()).collect()
    }
}

/// An instance the exposure guard checks.
#[derive(Debug)]
pub(super) struct Guarded {
    pub(super) id: String,
    pub(super) workload: String,
    pub(super) generation: u64,
    /// Adopted: reported, never stopped.
    pub(super) adopted: bool,
}

/// One instance as the journal keeps it.
#[derive(Debug)]
pub(super) struct JournalRow {
    pub(super) id: String,
    pub(super) workload: String,
    pub(super) generation: u64,
    pub(super) lease_ms: u64,
    pub(super) adopted: Option<Adoption>,
}

/// Probe readings for [`Books::set_readings`].
#[derive(Debug, Default)]
pub(super) struct Readings {
    pub(super) available: Vec<(String, Option<u64>)>,
    pub(super) measured: Vec<(String, PoolName, u64)>,
    pub(super) host: Vec<(String, u64)>,
    pub(super) host_pools: Vec<PoolName>,
}

/// A plan as a `Placement`: the pools as they are, the demand as it would
/// be placed, each victim with what it holds, and what the start would
/// leave free.
fn placement(ledger: &NodeState, plan: &Plan, spec: &Spec) -> pb::Placement {
    let pools = ledger.pools();
    let mut out = resident_api::placement(plan, pool_statuses(ledger, &pools));
    let (evict, concrete): (&[InstanceId], Spec) = match plan {
        Plan::Admit { evict, chosen, .. } => (evict, spec.concrete(chosen)),
        Plan::Existing => (&[], spec.clone()),
        Plan::Refuse(_) => return out,
    };
    let spec = &concrete;
    out.demand = resident_api::demand(spec);
    let victims: Vec<_> = evict
        .iter()
        .filter_map(|id| ledger.resident(id.as_str()))
        .collect();
    out.victims = victims
        .iter()
        .map(|v| pb::Victim {
            instance_id: v.id.to_string(),
            workload: v.spec.workload.to_string(),
            bytes: v
                .spec
                .demand
                .keys()
                .map(|p| v.charge(p.as_str()).counted())
                .fold(0, u64::saturating_add),
            priority: v.spec.priority,
        })
        .collect();
    let existing = matches!(plan, Plan::Existing);
    out.free_after_bytes = spec
        .demand
        .keys()
        .filter_map(|pool| {
            let figures = pools.iter().find(|p| p.name == *pool)?;
            let budget = figures.effective?;
            let freed: u64 = victims
                .iter()
                .map(|v| v.charge(pool.as_str()).counted())
                .sum();
            let taken = if existing {
                0
            } else {
                spec.footprint(pool.as_str())
            };
            let used = figures.used.saturating_sub(freed);
            Some(budget.saturating_sub(used).saturating_sub(taken))
        })
        .min();
    out
}

/// `pools` (the ledger's figures) as the API shows them, with each live
/// pool's last reading.
fn pool_statuses(ledger: &NodeState, pools: &[PoolStatus]) -> Vec<pb::PoolStatus> {
    pools
        .iter()
        .map(|p| resident_api::pool_status(p, ledger.available(p.name.as_str())))
        .collect()
}

/// `id` is an instance of another workload.
fn taken(b: &Inner, id: &InstanceId, w: &Workload) -> Result<(), ApiError> {
    match b.records.get(id.as_str()) {
        Some(r) if r.workload.spec.workload != w.spec.workload => {
            Err(ApiError::AlreadyExists(format!(
                "instance '{id}' already exists with workload '{}'",
                r.workload.spec.workload
            )))
        }
        _ => Ok(()),
    }
}

/// Whether one more resident (`id`, unless it is one already) stays within
/// `max_instances`.
fn room(b: &Inner, id: &InstanceId, max: usize) -> Result<(), ApiError> {
    if b.ledger.resident(id.as_str()).is_none() && b.ledger.residents().count() >= max {
        return Err(ApiError::LimitReached(format!(
            "the node already holds max_instances = {max} instances; stop one first"
        )));
    }
    Ok(())
}

/// A refused admission as the caller hears it: the refusal, and the
/// Placement it was decided on (the same critical section).
fn refused(ledger: &NodeState, refusal: resident_core::Refusal, spec: &Spec) -> ApiError {
    let plan = Plan::Refuse(refusal.clone());
    let placement = placement(ledger, &plan, spec);
    ApiError::Refused {
        refusal,
        placement: Box::new(placement),
    }
}

pub(super) fn plan_error(e: PlanError) -> ApiError {
    match e {
        PlanError::AlreadyExists { .. } => ApiError::AlreadyExists(e.to_string()),
        PlanError::Evicting { .. } => ApiError::Unavailable(e.to_string()),
        PlanError::UnknownPool { .. } | PlanError::AnyOfCount { .. } => {
            ApiError::FailedPrecondition(e.to_string())
        }
    }
}

/// Each victim with the cause its stop reports: for which start, and in
/// which of the target's pools it held memory (none: it was in the way of
/// a group or exclusion rule).
fn evictions(b: &Inner, spec: &Spec, id: &InstanceId, victims: &[InstanceId]) -> Vec<Eviction> {
    let ledger = &b.ledger;
    victims
        .iter()
        .map(|v| {
            let resident = ledger.resident(v.as_str());
            let pools: Vec<&str> = resident
                .map(|r| {
                    r.spec
                        .demand
                        .keys()
                        .filter(|p| spec.demand.contains_key(*p))
                        .map(|p| p.as_str())
                        .collect()
                })
                .unwrap_or_default();
            let start = format!("'{}' (instance '{id}')", spec.workload);
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
                generation: b.records.get(v.as_str()).map_or(0, |r| r.generation),
                workload: resident.map_or_else(String::new, |r| r.spec.workload.to_string()),
                cause,
            }
        })
        .collect()
}

/// For each live (probe-bound) pool `spec` needs: three quarters of what
/// the victims are counted as holding there.
fn recovery(
    ledger: &NodeState,
    config: &Config,
    spec: &Spec,
    victims: &[InstanceId],
) -> Vec<(String, u64)> {
    spec.demand
        .keys()
        .filter(|pool| {
            config
                .pools
                .iter()
                .any(|p| p.pool.name == **pool && p.pool.live)
        })
        .map(|pool| {
            let held: u64 = victims
                .iter()
                .filter_map(|v| ledger.resident(v.as_str()))
                .map(|r| r.charge(pool.as_str()).counted())
                .fold(0, u64::saturating_add);
            (pool.to_string(), held / 4 * 3)
        })
        .filter(|(_, want)| *want > 0)
        .collect()
}

/// Keeps at most `keep` ended instances (the newest): without a bound, a
/// caller that starts and stops ever-new ids would grow the table for
/// good. Returns the records dropped.
fn prune_ended(b: &mut Inner, keep: usize) -> Vec<(String, Record)> {
    let mut forgotten = Vec::new();
    while b.ended.len() > keep {
        let Some((_, id)) = b.ended.pop_first() else {
            break;
        };
        if let Some(r) = b.records.remove(&id) {
            forgotten.push((id, r));
        }
    }
    forgotten
}

#[cfg(test)]
mod tests;
