//! The planner: a pure function from (node state, target, policy, now) to a
//! plan — admit, evicting these instances (possibly none), or refuse, for
//! these reasons. No I/O, no clock (time comes in as `now`), no allocation
//! beyond the answer and one sorted candidate list.
//!
//! The rule that sets this planner apart from the ones it grew from: when
//! the target cannot fit even after every permitted eviction, nothing is
//! evicted and the start is refused with every reason.
//!
//! Under policy `Evict` a plan is a list of moves: residents whose
//! workload can sleep are put to sleep first (least-recently-used first,
//! each only when its asleep demand fits where it goes), and only when
//! that is not enough are residents evicted, a sleeper among them where
//! its asleep demand is in the way.
//!
//! A spec with any-of demands is planned once per concrete choice of pools
//! (`Spec::choices`): a choice that fits without eviction wins over one
//! that needs evictions, then the node's `GpuChoice` (binpack: least room
//! left, spread: most), then the pool names. Refused only when every
//! choice is, with the reasons of all of them.

use std::collections::{BTreeMap, BTreeSet};

use crate::name::{GroupName, InstanceId, PoolName, Role, WorkloadName};
use crate::reason::{GroupRule, Reason, Refusal};
use crate::spec::{Choice, GpuChoice, GroupPolicy, Spec};
use crate::state::{NodeState, Pool, Resident, Tier, Totals};

/// What to do when a constraint fails.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Policy {
    /// Refuse with every failing reason.
    #[default]
    Refuse,
    /// Evict conflicting and least-recently-used residents where permitted.
    Evict,
}

/// The planner's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Plan {
    /// The instance is already resident with this workload.
    Existing,
    /// The target fits once `sleep` are asleep and `evict` (in this
    /// order) are gone.
    Admit {
        /// Residents to put to sleep first (policy `Evict` only),
        /// least-recently-used first.
        sleep: Vec<InstanceId>,
        /// Victims: conflicting residents first, then least-recently-used.
        evict: Vec<InstanceId>,
        /// Conflicting instances already being evicted for another start.
        wait_for: Vec<InstanceId>,
        /// The pools chosen for each any-of demand (empty when the spec
        /// has none): `spec.concrete(&chosen)` is what is reserved.
        chosen: Choice,
    },
    /// The target cannot be placed; nothing is to be evicted.
    Refuse(Refusal),
}

/// A request the planner cannot even weigh.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlanError {
    /// The spec asks memory of a pool the node does not have.
    #[error(
        "workload '{workload}' asks for memory in pool '{pool}', which this node does not have"
    )]
    UnknownPool {
        /// The workload.
        workload: WorkloadName,
        /// The unknown pool.
        pool: PoolName,
    },
    /// The id is taken by an instance of another workload.
    #[error("instance '{id}' already exists with workload '{existing}'")]
    AlreadyExists {
        /// The instance.
        id: InstanceId,
        /// Its workload.
        existing: WorkloadName,
    },
    /// An any-of demand asks for more pools than it names (or none).
    #[error(
        "workload '{workload}' asks for {count} pools of '{label}', which names {candidates}: give 1 to {candidates}"
    )]
    AnyOfCount {
        /// The workload.
        workload: WorkloadName,
        /// The any-of label.
        label: String,
        /// Pools asked for.
        count: usize,
        /// Pools named.
        candidates: usize,
    },
    /// The instance to wake is not resident.
    #[error("no instance '{id}' is resident")]
    NotResident {
        /// The instance.
        id: InstanceId,
    },
    /// The id belongs to an instance that is being evicted.
    #[error("instance '{id}' is being evicted; start it again once it has exited")]
    Evicting {
        /// The instance.
        id: InstanceId,
    },
}

/// A pool's budget arithmetic at one moment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PoolFigures {
    budget: Option<u64>,
    /// Counted bytes of every entry (the larger of reserved and measured).
    used: u128,
    live: Option<Live>,
}

#[derive(Debug, Clone, Copy)]
struct Live {
    available: u64,
    reserve: u64,
    /// Measured bytes of every entry: already missing from `available`.
    measured: u128,
}

impl PoolFigures {
    pub(crate) fn of(state: &NodeState, pool: &Pool) -> Self {
        let name = pool.config.name.as_str();
        let mut totals = Totals::default();
        for r in state.residents.values() {
            totals.add(r.charge(name));
        }
        Self::new(pool, totals)
    }

    /// The figures of `pool` whose residents' charges sum to `totals`.
    pub(crate) fn new(pool: &Pool, totals: Totals) -> Self {
        let live = match (pool.config.live, pool.available) {
            (true, Some(available)) => Some(Live {
                available,
                reserve: pool.config.reserve,
                measured: totals.measured,
            }),
            _ => None,
        };
        Self {
            budget: pool.config.budget,
            used: totals.used,
            live,
        }
    }

    /// The live ceiling in budget terms: what the probe shows available
    /// plus what our residents are measured to hold, less the reserve.
    fn ceiling(&self) -> Option<u128> {
        self.live
            .map(|l| (u128::from(l.available) + l.measured).saturating_sub(u128::from(l.reserve)))
    }

    /// The configured budget tightened by the ceiling; a reading never
    /// raises it.
    pub(crate) fn effective(&self) -> Option<u64> {
        let limit = match (self.budget.map(u128::from), self.ceiling()) {
            (Some(b), Some(c)) => Some(b.min(c)),
            (b, c) => b.or(c),
        };
        limit.map(|l| u64::try_from(l).unwrap_or(u64::MAX))
    }

    /// How far `used + need` exceeds the effective budget (negative: room).
    fn excess(&self, need: u64) -> i128 {
        match self.effective() {
            Some(e) => (self.used + u128::from(need)) as i128 - i128::from(e),
            None => i128::MIN / 2,
        }
    }
}

/// Plans the start of `spec` as instance `id` (`None`: a new instance,
/// for a placement query).
pub fn plan(
    state: &NodeState,
    id: Option<&InstanceId>,
    spec: &Spec,
    policy: Policy,
    now: u64,
) -> Result<Plan, PlanError> {
    if spec.any_of.is_empty() {
        return plan_concrete(state, id, spec, policy, now);
    }
    if let Some(plan) = existing(state, id, spec)? {
        return Ok(plan);
    }
    if let Some(a) = spec
        .any_of
        .iter()
        .find(|a| a.count == 0 || a.count > a.candidates.len())
    {
        return Err(PlanError::AnyOfCount {
            workload: spec.workload.clone(),
            label: a.label.clone(),
            count: a.count,
            candidates: a.candidates.len(),
        });
    }
    let choices = spec.choices();
    let mut best: Option<((u8, i128, usize), Plan)> = None;
    let mut reasons: Vec<Reason> = Vec::new();
    let mut temporary = false;
    for (n, choice) in choices.iter().enumerate() {
        let concrete = spec.concrete(choice);
        match plan_concrete(state, id, &concrete, policy, now)? {
            Plan::Admit {
                sleep,
                evict,
                wait_for,
                ..
            } => {
                // Fits as is, then by sleeping only, then by evicting.
                let moves = if !evict.is_empty() {
                    2
                } else {
                    u8::from(!sleep.is_empty())
                };
                let key = (moves, room(state, choice), n);
                if best.as_ref().is_none_or(|(k, _)| key < *k) {
                    let chosen = choice.clone();
                    let plan = Plan::Admit {
                        sleep,
                        evict,
                        wait_for,
                        chosen,
                    };
                    best = Some((key, plan));
                }
            }
            Plan::Refuse(refusal) => {
                temporary |= refusal.temporary();
                for r in refusal.reasons() {
                    if !reasons.contains(r) {
                        reasons.push(r.clone());
                    }
                }
            }
            Plan::Existing => return Ok(Plan::Existing),
        }
    }
    if let Some((_, plan)) = best {
        return Ok(plan);
    }
    // Co-residency rules first, then the pools by name, as for one choice.
    reasons.sort_by(|a, b| (a.is_memory(), a.pool()).cmp(&(b.is_memory(), b.pool())));
    let refusal = Refusal::new(reasons).expect("every choice was refused with a reason");
    Ok(Plan::Refuse(if temporary {
        refusal.mark_temporary()
    } else {
        refusal
    }))
}

/// How a choice ranks under the node's `GpuChoice`: the room its pools
/// have left now, ascending for binpack and descending for spread.
fn room(state: &NodeState, choice: &[Vec<PoolName>]) -> i128 {
    let free: i128 = choice
        .iter()
        .flatten()
        .map(|name| {
            let Some(pool) = state.pools.get(name) else {
                return 0;
            };
            let figures = PoolFigures::of(state, pool);
            match figures.effective() {
                Some(e) => i128::from(e) - figures.used as i128,
                None => i128::from(u64::MAX),
            }
        })
        .sum();
    match state.gpu_choice {
        GpuChoice::Binpack => free,
        GpuChoice::Spread => -free,
    }
}

/// A concrete spec's plan, temporary refusals told apart.
fn plan_concrete(
    state: &NodeState,
    id: Option<&InstanceId>,
    spec: &Spec,
    policy: Policy,
    now: u64,
) -> Result<Plan, PlanError> {
    let plan = plan_at(state, id, spec, policy, now)?;
    // A refusal under evict is temporary when the same start, with every
    // hold lapsed (`now` at the end of time), would be admitted: only held
    // residents stand in the way, so waiting may help.
    Ok(match plan {
        Plan::Refuse(refusal)
            if policy == Policy::Evict
                && matches!(
                    plan_at(state, id, spec, policy, u64::MAX)?,
                    Plan::Admit { .. }
                ) =>
        {
            Plan::Refuse(refusal.mark_temporary())
        }
        plan => plan,
    })
}

/// `Plan::Existing` when `id` is resident with `spec`'s workload; an
/// error when it is another workload's or on its way out.
fn existing(
    state: &NodeState,
    id: Option<&InstanceId>,
    spec: &Spec,
) -> Result<Option<Plan>, PlanError> {
    let Some((id, r)) = id.and_then(|id| Some((id, state.residents.get(id)?))) else {
        return Ok(None);
    };
    if r.spec.workload != spec.workload {
        let existing = r.spec.workload.clone();
        return Err(PlanError::AlreadyExists {
            id: id.clone(),
            existing,
        });
    }
    if r.leaving() {
        return Err(PlanError::Evicting { id: id.clone() });
    }
    Ok(Some(Plan::Existing))
}

/// [`plan_concrete`] at `now`, without telling temporary refusals apart.
fn plan_at(
    state: &NodeState,
    id: Option<&InstanceId>,
    spec: &Spec,
    policy: Policy,
    now: u64,
) -> Result<Plan, PlanError> {
    plan_present(state, id, spec, policy, now, &BTreeMap::new())
}

/// Plans a target whose process already runs and already holds `present`
/// bytes per pool (an adoption): a live pool's reading shows that memory
/// as taken, so it counts as measured for the target, like a resident's,
/// and the target needs the larger of its demand and those bytes.
pub(crate) fn plan_present(
    state: &NodeState,
    id: Option<&InstanceId>,
    spec: &Spec,
    policy: Policy,
    now: u64,
    present: &BTreeMap<PoolName, u64>,
) -> Result<Plan, PlanError> {
    if let Some(plan) = existing(state, id, spec)? {
        return Ok(plan);
    }
    plan_beside(state, None, spec, policy, now, present)
}

/// [`plan_present`] of `spec` for what resident `waking` (when given)
/// adds to what it holds already: it stays in `state`, counted as it
/// stands, and is no conflict of its own (the caller keeps it from being
/// a victim).
pub(crate) fn plan_beside(
    state: &NodeState,
    waking: Option<&InstanceId>,
    spec: &Spec,
    policy: Policy,
    now: u64,
    present: &BTreeMap<PoolName, u64>,
) -> Result<Plan, PlanError> {
    let mut pools = Vec::with_capacity(spec.demand.len());
    for (name, demand) in &spec.demand {
        let Some(pool) = state.pools.get(name) else {
            let workload = spec.workload.clone();
            return Err(PlanError::UnknownPool {
                workload,
                pool: name.clone(),
            });
        };
        let present = present.get(name).copied().unwrap_or(0);
        let need = demand.footprint().max(present);
        if need > 0 {
            let mut figures = PoolFigures::of(state, pool);
            if let Some(live) = figures.live.as_mut() {
                live.measured += u128::from(present);
            }
            pools.push((pool, figures, need));
        }
    }

    let target_group = state.groups.of(spec.workload.as_str());
    let mut conflicts = Vec::new();
    let mut wait_for = Vec::new();
    for r in state.residents.values() {
        if Some(&r.id) == waking {
            continue;
        }
        let Some(reason) = conflict(state, spec, target_group, r) else {
            continue;
        };
        if r.leaving() {
            wait_for.push(r.id.clone());
        } else {
            conflicts.push((r, reason));
        }
    }
    let short = pools
        .iter()
        .any(|(_, figures, need)| figures.excess(*need) > 0);
    if conflicts.is_empty() && !short {
        return Ok(Plan::Admit {
            sleep: Vec::new(),
            evict: Vec::new(),
            wait_for,
            chosen: Vec::new(),
        });
    }
    if policy == Policy::Evict {
        let conflicting: Vec<&Resident> = conflicts.iter().map(|(r, _)| *r).collect();
        if let Some(moves) = victims(state, spec, now, &conflicting, &pools) {
            return Ok(Plan::Admit {
                sleep: moves.sleep,
                evict: moves.evict,
                wait_for,
                chosen: Vec::new(),
            });
        }
    }
    // Refused: only now is it worth building every reason, with holders.
    let mut reasons: Vec<Reason> = conflicts.into_iter().map(|(_, reason)| reason).collect();
    for (pool, figures, need) in &pools {
        memory_reasons(state, spec, pool, figures, *need, &mut reasons);
    }
    let refusal = Refusal::new(reasons).expect("a conflict or a short pool gives a reason");
    Ok(Plan::Refuse(refusal))
}

/// The co-residency rule, if any, that keeps `spec` from sitting beside `r`.
fn conflict(
    state: &NodeState,
    spec: &Spec,
    target_group: Option<(&GroupName, GroupPolicy)>,
    r: &Resident,
) -> Option<Reason> {
    let excluded = |declared_by: &Role| Reason::Excluded {
        role: spec.role.clone(),
        with: r.spec.role.clone(),
        with_instance: r.id.clone(),
        declared_by: declared_by.clone(),
    };
    if spec.excludes(&r.spec.role) {
        return Some(excluded(&spec.role));
    }
    if r.spec.excludes(&spec.role) {
        return Some(excluded(&r.spec.role));
    }
    let (tg, tp) = target_group?;
    let (rg, rp) = state.groups.of(r.spec.workload.as_str())?;
    let rule = if tg == rg {
        (tp.swap).then_some((tg, GroupRule::Swap))
    } else if tp.exclusive && !rp.persistent {
        Some((tg, GroupRule::Exclusive))
    } else if rp.exclusive && !tp.persistent {
        Some((rg, GroupRule::Exclusive))
    } else {
        None
    };
    rule.map(|(group, rule)| Reason::GroupConflict {
        role: spec.role.clone(),
        with: r.spec.role.clone(),
        with_instance: r.id.clone(),
        group: group.clone(),
        rule,
    })
}

/// The budget and live-ceiling reasons for one pool, as things stand.
fn memory_reasons(
    state: &NodeState,
    spec: &Spec,
    pool: &Pool,
    figures: &PoolFigures,
    need: u64,
    out: &mut Vec<Reason>,
) {
    let name = pool.config.name.as_str();
    let over = |limit: u128| figures.used + u128::from(need) > limit;
    if let Some(budget) = figures.budget.filter(|b| over(u128::from(*b))) {
        out.push(Reason::OverBudget {
            role: spec.role.clone(),
            pool: pool.config.name.clone(),
            need,
            free: u64::try_from(u128::from(budget).saturating_sub(figures.used)).unwrap_or(0),
            budget,
            holders: state.holders(name),
        });
    }
    if let (Some(live), Some(ceiling)) = (figures.live, figures.ceiling())
        && over(ceiling)
    {
        let pending = figures.used.saturating_sub(live.measured);
        out.push(Reason::HostMemory {
            role: spec.role.clone(),
            pool: pool.config.name.clone(),
            need,
            available: live.available,
            reserve: live.reserve,
            pending: u64::try_from(pending).unwrap_or(u64::MAX),
            holders: state.holders(name),
        });
    }
}

/// Whether policy lets `r` be evicted (or put to sleep) for `spec` at
/// `now`.
fn permitted(state: &NodeState, spec: &Spec, now: u64, r: &Resident) -> bool {
    r.evictable
        && !r.leaving()
        && r.tier != Tier::Moving
        && !r.held(now)
        && r.spec.priority <= spec.priority
        && !state.groups.is_persistent(r.spec.workload.as_str())
}

/// The moves that make room.
struct Moves {
    sleep: Vec<InstanceId>,
    evict: Vec<InstanceId>,
}

/// How far each pool of the node is over its effective budget with the
/// target in it (negative: room), as moves are applied; `target` lists
/// the pools the target needs, which must all end within budget.
struct Excess<'a> {
    by_pool: BTreeMap<&'a str, i128>,
    target: Vec<&'a str>,
}

impl<'a> Excess<'a> {
    fn new(state: &'a NodeState, pools: &[(&'a Pool, PoolFigures, u64)]) -> Self {
        let mut by_pool: BTreeMap<&str, i128> = state
            .pools
            .values()
            .map(|p| (p.config.name.as_str(), PoolFigures::of(state, p).excess(0)))
            .collect();
        let mut target = Vec::with_capacity(pools.len());
        for (pool, figures, need) in pools {
            let name = pool.config.name.as_str();
            by_pool.insert(name, figures.excess(*need));
            target.push(name);
        }
        Self { by_pool, target }
    }

    fn short(&self) -> bool {
        self.target.iter().any(|p| self.by_pool[p] > 0)
    }

    /// Whether taking `counted(pool)` away from `r`'s pools relieves a
    /// short pool of the target.
    fn helps(&self, r: &Resident, counted: impl Fn(&str) -> u64) -> bool {
        self.target.iter().any(|p| {
            self.by_pool[p] > 0 && counted(p) > 0 && r.spec.pools().any(|q| q.as_str() == *p)
        })
    }

    /// Adds `delta(pool)` to every pool.
    fn apply(&mut self, delta: impl Fn(&str) -> i128) {
        for (pool, e) in self.by_pool.iter_mut() {
            *e += delta(pool);
        }
    }
}

/// What putting `r` to sleep changes in `pool`: its asleep reservation
/// there less what it is counted as holding now.
fn sleep_delta(r: &Resident, pool: &str) -> i128 {
    let now = r.charge(pool).counted();
    let asleep = if r.spec.pools().any(|p| p.as_str() == pool) {
        r.spec.asleep_footprint(pool)
    } else {
        0
    };
    i128::from(asleep) - i128::from(now)
}

/// The moves that make room, or `None` when even every permitted move
/// would not: conflicting residents are evicted (all must be permitted);
/// then, while a pool of the target is short, least-recently-used
/// permitted residents that can sleep are put to sleep where that frees
/// bytes in a short pool and their asleep demand fits everywhere it goes;
/// then, if still short, least-recently-used permitted residents holding
/// bytes in a short pool (sleepers, and those just chosen to sleep, among
/// them) are evicted. Sleeps that the evictions made needless are dropped.
fn victims(
    state: &NodeState,
    spec: &Spec,
    now: u64,
    conflicting: &[&Resident],
    pools: &[(&Pool, PoolFigures, u64)],
) -> Option<Moves> {
    if !conflicting.iter().all(|r| permitted(state, spec, now, r)) {
        return None;
    }
    let mut excess = Excess::new(state, pools);
    let mut evict = Vec::new();
    let mut chosen = BTreeSet::new();
    for r in conflicting {
        excess.apply(|pool| -i128::from(r.charge(pool).counted()));
        evict.push(r.id.clone());
        chosen.insert(r.seq);
    }
    if !excess.short() {
        return Some(Moves {
            sleep: Vec::new(),
            evict,
        });
    }
    let mut candidates: Vec<&Resident> = state
        .residents
        .values()
        .filter(|r| permitted(state, spec, now, r) && !chosen.contains(&r.seq))
        .collect();
    candidates.sort_by_key(|r| (r.last_used, r.seq));
    // Sleep first.
    let mut sleep: Vec<&Resident> = Vec::new();
    for r in candidates.iter().filter(|r| r.can_sleep()) {
        let frees = |pool: &str| u64::try_from(-sleep_delta(r, pool)).unwrap_or(0);
        let fits = excess
            .by_pool
            .iter()
            .all(|(pool, e)| sleep_delta(r, pool) <= 0 || e + sleep_delta(r, pool) <= 0);
        if excess.helps(r, frees) && fits {
            excess.apply(|pool| sleep_delta(r, pool));
            sleep.push(r);
            if !excess.short() {
                break;
            }
        }
    }
    // Then evict.
    if excess.short() {
        for r in &candidates {
            let slept = sleep.iter().any(|s| s.seq == r.seq);
            let counted = |pool: &str| {
                let c = r.charge(pool).counted();
                if slept {
                    u64::try_from(i128::from(c) + sleep_delta(r, pool)).unwrap_or(0)
                } else {
                    c
                }
            };
            if excess.helps(r, counted) {
                excess.apply(|pool| -i128::from(counted(pool)));
                sleep.retain(|s| s.seq != r.seq);
                evict.push(r.id.clone());
                if !excess.short() {
                    break;
                }
            }
        }
        if excess.short() {
            return None;
        }
        // A sleep the evictions made needless is not done: undone, most
        // recently used first, where the target still fits without it.
        for i in (0..sleep.len()).rev() {
            let r = sleep[i];
            excess.apply(|pool| -sleep_delta(r, pool));
            if excess.short() {
                excess.apply(|pool| sleep_delta(r, pool));
            } else {
                sleep.remove(i);
            }
        }
    }
    Some(Moves {
        sleep: sleep.iter().map(|r| r.id.clone()).collect(),
        evict,
    })
}
