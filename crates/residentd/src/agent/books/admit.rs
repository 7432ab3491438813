//! Admission, release and cancel: the decisions of the books and what is
//! said about them from the same critical section (a refusal's Placement,
//! the victims with their causes, the memory to wait for).

use std::collections::BTreeMap;
use std::sync::Arc;

use resident_api::{ApiError, pb};
use resident_config::{Config, Workload};
use resident_core::{
    AdmitError, Entry, InstanceId, NodeState, Plan, PlanError, Policy, PoolName, PoolStatus,
    Running, Spec, Tier,
};
use resident_supervisor::Adoption;
use tokio::sync::oneshot;

use super::*;

/// A victim of a Start: which run of whom, of which workload, and the
/// cause its stop reports.
#[derive(Debug)]
pub(in crate::agent) struct Eviction {
    pub(in crate::agent) id: String,
    /// The run chosen: its stop never ends a later run of the same id.
    pub(in crate::agent) generation: u64,
    pub(in crate::agent) workload: String,
    pub(in crate::agent) cause: String,
}

/// A resident to put to sleep: which run of whom, of which workload.
#[derive(Debug, Clone)]
pub(in crate::agent) struct Sleeper {
    pub(in crate::agent) id: String,
    pub(in crate::agent) generation: u64,
    pub(in crate::agent) workload: String,
}

/// An admitted Start, with everything decided under the lock.
#[derive(Debug)]
pub(in crate::agent) struct Admitted {
    pub(in crate::agent) generation: u64,
    /// The device indexes of the pools chosen for its any-of demands.
    pub(in crate::agent) devices: Vec<u32>,
    /// Residents to put to sleep first, now falling asleep in the books.
    pub(in crate::agent) sleepers: Vec<Sleeper>,
    pub(in crate::agent) evictions: Vec<Eviction>,
    /// Conflicting runs (id, generation) already being evicted for
    /// another start: this one waits for their release.
    pub(in crate::agent) wait_for: Vec<(String, u64)>,
    /// For each live pool the target needs: the bytes to see available
    /// again once the victims have exited.
    pub(in crate::agent) recovery: Vec<(String, u64)>,
    /// Ended records dropped to keep the table bounded.
    pub(in crate::agent) forgotten: Vec<(String, Record)>,
}

/// What the books decided for a Start.
#[derive(Debug)]
pub(in crate::agent) enum Decision {
    /// Admitted: a new run.
    Admitted(Admitted),
    /// The same instance of the same workload is resident: an idempotent
    /// repeat, answered with its current run.
    Existing(Record),
    /// The same instance is stopping, falling asleep or waking; admit
    /// again once this fires (or its sender is dropped).
    Stopping(oneshot::Receiver<()>),
    /// The same instance is asleep: its wake is admitted (the same run,
    /// `generation`), to be carried out.
    Wake(Admitted),
    /// The config the call decided with is not the one the books hold (a
    /// reload came between): nothing was decided; decide again on the
    /// current one.
    Reconfigured,
}

impl Books {
    /// Plans and reserves a Start of `w` as `id`, under `config`; `key`:
    /// what its footprint is learned for (`None`: not learning).
    /// `taken_over`: the run is a process an earlier agent left, entered
    /// as it was (`None`: awake; asleep, or falling asleep or waking:
    /// holding both its demands until its call is made again) under
    /// refuse, whatever `policy` says.
    #[allow(clippy::too_many_arguments)]
    pub(in crate::agent) fn admit(
        &self,
        config: &Arc<Config>,
        w: &Arc<Workload>,
        id: &InstanceId,
        policy: Policy,
        now: u64,
        lease_ms: u64,
        key: Option<u64>,
        taken_over: Option<Option<Sleepy>>,
    ) -> Result<Decision, ApiError> {
        let mut b = self.lock();
        if !Arc::ptr_eq(config, &b.config) {
            return Ok(Decision::Reconfigured);
        }
        let asked = b.learned_spec(w, key);
        if let Some(r) = b.ledger.resident(id.as_str())
            && r.leaving()
        {
            return Ok(Decision::Stopping(b.waiter(id.as_str())));
        }
        taken(&b, id, w)?;
        if taken_over.is_some() && b.ledger.resident(id.as_str()).is_some() {
            // A process taken over is a new resident: never a wake or a
            // repeat of one that holds memory already.
            return Err(ApiError::AlreadyExists(format!(
                "instance '{id}' already holds memory; it cannot be taken over"
            )));
        }
        match b.ledger.resident(id.as_str()).map(|r| r.tier) {
            Some(Tier::Moving) => return Ok(Decision::Stopping(b.waiter(id.as_str()))),
            Some(Tier::Asleep) => return wake(&mut b, id, policy, now, lease_ms),
            _ => {}
        }
        let max = config.node.max_instances;
        room(&b, id, max)?;
        let restored = taken_over.flatten();
        let entry = match taken_over {
            Some(as_it_was) => {
                let (tier, planned) = match as_it_was {
                    None | Some(Sleepy::Woken(_)) => (Tier::Awake, Tier::Awake),
                    Some(Sleepy::Asleep(_)) => (Tier::Asleep, Tier::Asleep),
                    Some(Sleepy::Falling) => (Tier::Moving, Tier::Asleep),
                    Some(Sleepy::Waking) => (Tier::Moving, Tier::Moving),
                };
                Entry::Running(Running {
                    spec: asked.clone(),
                    tier,
                    planned,
                    present: BTreeMap::new(),
                    evictable: true,
                })
            }
            None => Entry::Start(asked.clone()),
        };
        let admitted = b.ledger.admit(id, entry, policy, now);
        let a = match admitted {
            Err(AdmitError::Refused(refusal)) => {
                return Err(refused(&b.ledger, refusal, &asked));
            }
            Err(AdmitError::Invalid(e)) => return Err(plan_error(e)),
            Ok(a) if !a.created => {
                // A repeat by the owner sets its lease anew.
                if let Some(r) = b.records.get_mut(id.as_str()) {
                    r.lease = Lease::new(lease_ms, now);
                }
                let record = b.records.get(id.as_str()).cloned();
                let record = record.unwrap_or_else(|| Record::run(w, asked, 0));
                return Ok(Decision::Existing(record));
            }
            Ok(a) => a,
        };
        let spec = b
            .ledger
            .resident(id.as_str())
            .map_or_else(|| asked.clone(), |r| r.spec.clone());
        let evictions = evictions(&b, &spec, id, &a.evict);
        let (sleepers, wait_for, recovery) = moves(&mut b, &spec, &a);
        let devices = config.devices(&a.chosen);
        b.generation += 1;
        let generation = b.generation;
        let record = Record {
            devices: devices.clone(),
            chosen: a.chosen.clone(),
            lease: Lease::new(lease_ms, now),
            footprint_key: key,
            sleep: restored,
            ..Record::run(w, spec, generation)
        };
        b.enter(id, record);
        let forgotten = prune_ended(&mut b, max);
        Ok(Decision::Admitted(Admitted {
            generation,
            devices,
            sleepers,
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
    pub(in crate::agent) fn adopt(
        &self,
        config: &Arc<Config>,
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
        let running = Running {
            spec: w.spec.clone(),
            tier: Tier::Awake,
            planned: Tier::Awake,
            present: present.clone(),
            evictable: adoption.manage,
        };
        match b
            .ledger
            .admit(id, Entry::Running(running), Policy::Refuse, now)
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

    /// The placement query: what a Start of `w` would do, with the pool
    /// figures it was decided on. Naming `id`, that Start's dry run:
    /// admitted at once for an instance of it resident and awake, a
    /// wake's plan for one asleep, a new instance's under `id` otherwise
    /// (refused as that Start would be when `id` is another workload's).
    pub(in crate::agent) fn place(
        &self,
        w: &Workload,
        id: Option<&InstanceId>,
        policy: Policy,
        now: u64,
        key: Option<u64>,
    ) -> Result<pb::Placement, ApiError> {
        let b = self.lock();
        let spec = b.learned_spec(w, key);
        let plan = match id {
            None => b.ledger.place(&spec, policy, now),
            Some(id) => {
                taken(&b, id, w)?;
                let entry = match b.ledger.resident(id.as_str()).map(|r| r.tier) {
                    Some(Tier::Asleep) => Entry::Wake,
                    _ => Entry::Start(spec.clone()),
                };
                b.ledger.plan_entry(id, &entry, policy, now)
            }
        };
        Ok(placement(&b.ledger, &plan.map_err(plan_error)?, &spec))
    }

    /// Ends the reservation of `id`'s run `generation`, if it is still the
    /// current one and holds one. The one release path.
    pub(in crate::agent) fn release(&self, id: &str, generation: u64) -> bool {
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
    pub(in crate::agent) async fn released(&self, id: &str, generation: u64) {
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
    pub(in crate::agent) fn cancel(
        &self,
        id: &str,
        run: Option<u64>,
        cause: pb::Cause,
    ) -> Option<Cancelled> {
        let mut b = self.lock();
        let resident = b.ledger.resident(id).is_some();
        let r = b
            .records
            .get_mut(id)
            .filter(|r| run.is_none_or(|g| g == r.generation))?;
        r.cancelled = true;
        // The first stop asked is the one its end reports.
        r.cause.get_or_insert(cause);
        let cancelled = Cancelled {
            generation: r.generation,
            spec: r.spec.clone(),
            resident,
        };
        // The ledger's phase too: a stopping resident is no victim and no
        // conflict for the starts planned while it stops.
        b.ledger.leave(id);
        Some(cancelled)
    }
}

/// A plan as a `Placement`: the pools as they are, the demand as it would
/// be placed, each victim with what it holds, and what the start would
/// leave free.
fn placement(ledger: &NodeState, plan: &Plan, spec: &Spec) -> pb::Placement {
    let pools = ledger.pools();
    let mut out = resident_api::placement(plan, pool_statuses(ledger, &pools));
    let (evict, sleep, concrete): (&[InstanceId], &[InstanceId], Spec) = match plan {
        Plan::Admit {
            evict,
            sleep,
            chosen,
            ..
        } => (evict, sleep, spec.concrete(chosen)),
        Plan::Existing => (&[], &[], spec.clone()),
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
                .pools()
                .map(|p| v.charge(p.as_str()).counted())
                .fold(0, u64::saturating_add),
            priority: v.spec.priority,
        })
        .collect();
    let existing = matches!(plan, Plan::Existing);
    out.free_after_bytes = ledger.free_after(spec, evict, sleep, existing);
    out
}

/// `pools` (the ledger's figures) as the API shows them, with each live
/// pool's last reading.
pub(super) fn pool_statuses(ledger: &NodeState, pools: &[PoolStatus]) -> Vec<pb::PoolStatus> {
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
pub(super) fn refused(
    ledger: &NodeState,
    refusal: resident_core::Refusal,
    spec: &Spec,
) -> ApiError {
    let plan = Plan::Refuse(refusal.clone());
    let placement = placement(ledger, &plan, spec);
    ApiError::Refused {
        refusal,
        placement: Box::new(placement),
    }
}

pub(in crate::agent) fn plan_error(e: PlanError) -> ApiError {
    match e {
        PlanError::AlreadyExists { .. } => ApiError::AlreadyExists(e.to_string()),
        PlanError::Evicting { .. } => ApiError::Unavailable(e.to_string()),
        PlanError::NotResident { .. } => ApiError::NotFound(e.to_string()),
        PlanError::UnknownPool { .. }
        | PlanError::AnyOfCount { .. }
        | PlanError::CannotSleep { .. } => ApiError::FailedPrecondition(e.to_string()),
    }
}

/// The wake of `id`, asleep: its awake demand admitted (moves made), the
/// same run waking; a refusal changes nothing.
fn wake(
    b: &mut Inner,
    id: &InstanceId,
    policy: Policy,
    now: u64,
    lease_ms: u64,
) -> Result<Decision, ApiError> {
    let Some(spec) = b.ledger.resident(id.as_str()).map(|r| r.spec.clone()) else {
        return Err(ApiError::NotFound(format!("no instance '{id}'")));
    };
    let a = match b.ledger.admit(id, Entry::Wake, policy, now) {
        Err(AdmitError::Refused(refusal)) => return Err(refused(&b.ledger, refusal, &spec)),
        Err(AdmitError::Invalid(e)) => return Err(plan_error(e)),
        Ok(a) => a,
    };
    let evictions = evictions(b, &spec, id, &a.evict);
    let (sleepers, wait_for, recovery) = moves(b, &spec, &a);
    let Some(record) = b.records.get_mut(id.as_str()) else {
        return Err(ApiError::NotFound(format!("no instance '{id}'")));
    };
    record.sleep = Some(Sleepy::Waking);
    if lease_ms > 0 {
        record.lease = Lease::new(lease_ms, now);
    }
    Ok(Decision::Wake(Admitted {
        generation: record.generation,
        devices: record.devices.clone(),
        sleepers,
        evictions,
        wait_for,
        recovery,
        forgotten: Vec::new(),
    }))
}

/// What an admission's moves come to in the records: the victims marked
/// cancelled, the sleepers falling asleep; and the sleepers, the runs to
/// wait for and the memory to see back before `spec` starts.
#[allow(clippy::type_complexity)]
fn moves(
    b: &mut Inner,
    spec: &Spec,
    a: &resident_core::Admission,
) -> (Vec<Sleeper>, Vec<(String, u64)>, Vec<(String, u64)>) {
    let wait_for = a
        .wait_for
        .iter()
        .filter_map(|w| Some((w.to_string(), b.records.get(w.as_str())?.generation)))
        .collect();
    let recovery = b
        .ledger
        .recovery(spec, &a.evict, &a.sleep)
        .into_iter()
        .map(|(pool, bytes)| (pool.to_string(), bytes))
        .collect();
    for v in &a.evict {
        if let Some(r) = b.records.get_mut(v.as_str()) {
            r.cancelled = true;
        }
    }
    let mut sleepers = Vec::with_capacity(a.sleep.len());
    for s in &a.sleep {
        if let Some(r) = b.records.get_mut(s.as_str()) {
            r.sleep = Some(Sleepy::Falling);
            sleepers.push(Sleeper {
                id: s.to_string(),
                generation: r.generation,
                workload: r.workload.spec.workload.to_string(),
            });
        }
    }
    (sleepers, wait_for, recovery)
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
                        .pools()
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
