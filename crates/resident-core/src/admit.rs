//! The one way into the ledger: `NodeState::admit` plans an [`Entry`] (a
//! start, a wake, a sleep, a process already running) with the planner
//! and, admitted, makes it and its moves in the same `&mut` call, so plan
//! and reserve are one atomic step for the caller that holds the ledger.
//! A refusal changes nothing. `settle` is the other half of a sleep or a
//! wake: it only ever lowers what a resident is charged.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::ledger::{NodeState, Phase, Resident, Tier};
use crate::name::{InstanceId, PoolName};
use crate::planner::{self, Entry, Plan, PlanError, Policy};
use crate::reason::Refusal;
use crate::spec::{Choice, Spec};

/// The result of a successful `admit`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Admission {
    /// False when the instance was already resident (idempotent start).
    pub created: bool,
    /// Residents now falling asleep ([`Tier::Moving`]): put them to sleep,
    /// then mark them asleep.
    pub sleep: Vec<InstanceId>,
    /// Victims now marked evicting: stop them, then release them.
    pub evict: Vec<InstanceId>,
    /// Instances already on their way out that conflict with the target:
    /// spawn only once these (and `evict`) are released.
    pub wait_for: Vec<InstanceId>,
    /// The pools chosen for each any-of demand (empty when the spec has
    /// none, or when the instance was already resident).
    pub chosen: Choice,
}

/// Why `admit` reserved nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The plan is a refusal.
    #[error("{0}")]
    Refused(Refusal),
    /// The request itself is wrong.
    #[error(transparent)]
    Invalid(#[from] PlanError),
}

impl NodeState {
    /// The dry run of a Start: what `admit` of `Entry::Start(spec)` would
    /// do, changing nothing.
    pub fn plan(
        &self,
        id: &InstanceId,
        spec: &Spec,
        policy: Policy,
        now: u64,
    ) -> Result<Plan, PlanError> {
        planner::plan(self, Some(id), spec, policy, now)
    }

    /// The placement query: what starting a new instance of `spec` would
    /// do, changing nothing.
    pub fn place(&self, spec: &Spec, policy: Policy, now: u64) -> Result<Plan, PlanError> {
        planner::plan(self, None, spec, policy, now)
    }

    /// The dry run of any entry: what `admit` would do, changing nothing.
    pub fn plan_entry(
        &self,
        id: &InstanceId,
        entry: &Entry,
        policy: Policy,
        now: u64,
    ) -> Result<Plan, PlanError> {
        planner::plan_entry(self, id, entry, policy, now)
    }

    /// Plans `entry` for `id` and, admitted, makes it in the same step:
    /// the plan's sleepers marked falling asleep and its victims leaving;
    /// a start or a running process entered (holding the concrete spec of
    /// the pools chosen); a wake or a sleep marked moving (it holds both
    /// its demands until `settle`). A refusal changes nothing. A repeated
    /// Start of a resident counts as a use and reserves nothing more.
    pub fn admit(
        &mut self,
        id: &InstanceId,
        entry: Entry,
        policy: Policy,
        now: u64,
    ) -> Result<Admission, AdmitError> {
        let (sleep, evict, wait_for, chosen) =
            match planner::plan_entry(self, id, &entry, policy, now)? {
                Plan::Refuse(refusal) => return Err(AdmitError::Refused(refusal)),
                Plan::Existing => {
                    if matches!(entry, Entry::Start(_)) {
                        self.touch(id.as_str(), now, 0);
                    }
                    return Ok(Admission::default());
                }
                Plan::Admit {
                    sleep,
                    evict,
                    wait_for,
                    chosen,
                } => (sleep, evict, wait_for, chosen),
            };
        self.moving(&sleep, &evict);
        let concrete = |spec: Arc<Spec>| {
            if spec.any_of.is_empty() {
                spec
            } else {
                Arc::new(spec.concrete(&chosen))
            }
        };
        let created = match entry {
            Entry::Start(spec) => {
                let spec = concrete(spec);
                self.enter(id, spec, now, BTreeMap::new(), true, Tier::Awake);
                true
            }
            Entry::Running(run) => {
                let spec = concrete(run.spec);
                self.enter(id, spec, now, run.present, run.evictable, run.tier);
                true
            }
            Entry::Wake | Entry::Sleep => {
                if let Some(r) = self.residents.get_mut(id) {
                    r.tier = Tier::Moving;
                }
                if entry == Entry::Wake {
                    self.touch(id.as_str(), now, 0);
                }
                false
            }
        };
        Ok(Admission {
            created,
            sleep,
            evict,
            wait_for,
            chosen,
        })
    }

    /// Settles `id` in `tier`, where that raises its reservation in no
    /// pool: a sleep or wake done (from moving), or a server that fell
    /// asleep by itself (from awake, where its asleep demand is nowhere
    /// larger). Its readings are dropped (what it held before the move says
    /// nothing of what it holds after; the next reading tells), as the
    /// planner assumed when it planned the move. False, changing nothing,
    /// for any other move: what raises a charge is planned (`admit`).
    pub fn settle(&mut self, id: &str, tier: Tier) -> bool {
        let Some(r) = self.residents.get(id) else {
            return false;
        };
        let mut after = r.clone();
        after.tier = tier;
        let lowers = r
            .spec
            .pools()
            .all(|p| after.footprint(p.as_str()) <= r.footprint(p.as_str()));
        if !lowers {
            return false;
        }
        if let Some(r) = self.residents.get_mut(id) {
            r.tier = tier;
            r.measured.clear();
        }
        true
    }

    /// Marks a plan's moves: `sleep` falling asleep, `evict` leaving.
    fn moving(&mut self, sleep: &[InstanceId], evict: &[InstanceId]) {
        for s in sleep {
            if let Some(r) = self.residents.get_mut(s) {
                r.tier = Tier::Moving;
            }
        }
        for victim in evict {
            if let Some(r) = self.residents.get_mut(victim) {
                r.phase = Phase::Leaving;
            }
        }
    }

    /// Makes `id` a resident holding `spec` in `tier`, used at `now`.
    fn enter(
        &mut self,
        id: &InstanceId,
        spec: Arc<Spec>,
        now: u64,
        measured: BTreeMap<PoolName, u64>,
        evictable: bool,
        tier: Tier,
    ) {
        self.next_seq += 1;
        let resident = Resident {
            id: id.clone(),
            spec,
            seq: self.next_seq,
            last_used: now,
            hold_until: 0,
            measured,
            phase: Phase::Held,
            evictable,
            tier,
        };
        self.residents.insert(id.clone(), resident);
    }
}
