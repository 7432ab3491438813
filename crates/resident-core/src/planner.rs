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
use std::sync::Arc;

use crate::ledger::{NodeState, Pool, PoolFigures, Resident, Tier};
use crate::name::{GroupName, InstanceId, PoolName, Role, WorkloadName};
use crate::reason::{GroupRule, Reason, Refusal};
use crate::spec::{Choice, GpuChoice, GroupPolicy, Spec};

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
    /// The instance to put to sleep belongs to a workload that cannot sleep.
    #[error("instance '{id}' cannot sleep: its workload has no [workload.sleep]")]
    CannotSleep {
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

/// Every way a charge of the ledger goes up. The planner plans each
/// (`plan_entry`) and `NodeState::admit` makes it: temporary refusals,
/// any-of choices, conflicts and budgets are decided in one place for all
/// of them. What lowers a charge (a release, a sleep or wake settled, a
/// server that fell asleep by itself) needs no plan.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Entry {
    /// A new instance of this spec, to be spawned awake (a Start).
    Start(Arc<Spec>),
    /// A process that already runs (an adoption, or a run an earlier agent
    /// left): planned under refuse, since nothing is evicted for a process
    /// already there.
    Running(Running),
    /// The resident, asleep, waking: planned for what waking adds beside
    /// what it holds asleep, which stays counted until its call is done.
    Wake,
    /// The resident, awake, falling asleep: planned for what its asleep
    /// demand adds beside what it holds awake (a vLLM level-1 sleeper's
    /// weights moving into host memory).
    Sleep,
}

/// A process that already runs, as [`Entry::Running`] enters it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Running {
    /// What it is an instance of.
    pub spec: Arc<Spec>,
    /// Which of its demands it holds: awake, asleep, or (a run taken over
    /// mid-call) both.
    pub tier: Tier,
    /// The demand it is planned for: `tier`'s, except for a run taken
    /// over falling asleep (`tier` moving), which is planned for its
    /// asleep demand, as the planner plans its own sleepers: nothing
    /// counts on its memory until its sleep is done, and a run waking
    /// beside it may count on it being asleep.
    pub planned: Tier,
    /// Bytes it already holds per pool (an adoption's, counted as
    /// measured: a live reading shows them as taken already).
    pub present: BTreeMap<PoolName, u64>,
    /// Whether it may later be chosen as a victim.
    pub evictable: bool,
}

/// Plans `entry` for instance `id`: the one planner of every way into the
/// ledger. `Plan::Existing`: nothing to do (the same instance is resident
/// with the same workload; a wake of one that is not asleep; a sleep of
/// one that is not awake).
pub fn plan_entry(
    state: &NodeState,
    id: &InstanceId,
    entry: &Entry,
    policy: Policy,
    now: u64,
) -> Result<Plan, PlanError> {
    match entry {
        Entry::Start(spec) => plan(state, Some(id), spec, policy, now),
        Entry::Running(run) => {
            if let Some(r) = state.residents.get(id) {
                return Err(PlanError::AlreadyExists {
                    id: id.clone(),
                    existing: r.spec.workload.clone(),
                });
            }
            per_choice(state, &run.spec, |concrete| {
                let held = in_tier(concrete, run.planned);
                plan_beside(state, None, &held, Policy::Refuse, now, &run.present)
            })
        }
        Entry::Wake | Entry::Sleep => {
            let Some(r) = state.residents.get(id) else {
                return Err(PlanError::NotResident { id: id.clone() });
            };
            if r.leaving() {
                return Err(PlanError::Evicting { id: id.clone() });
            }
            let from = if *entry == Entry::Wake {
                Tier::Asleep
            } else {
                if r.spec.asleep.is_none() {
                    return Err(PlanError::CannotSleep { id: id.clone() });
                }
                Tier::Awake
            };
            if r.tier != from {
                return Ok(Plan::Existing);
            }
            let adds = moving_adds(r);
            marked(policy, now, |at| {
                plan_beside(state, Some(id), &adds, policy, at, &BTreeMap::new())
            })
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
    if let Some(plan) = existing(state, id, spec)? {
        return Ok(plan);
    }
    per_choice(state, spec, |concrete| {
        marked(policy, now, |at| {
            plan_beside(state, None, concrete, policy, at, &BTreeMap::new())
        })
    })
}

/// What `r` holds in `tier` as a concrete spec of its own: its awake
/// demand, its asleep one, or (moving) the larger of the two per pool.
fn in_tier(spec: &Spec, tier: Tier) -> Spec {
    let asleep = || {
        spec.asleep
            .as_ref()
            .map(|a| a.demand.clone())
            .unwrap_or_default()
    };
    let demand = match tier {
        Tier::Awake => return spec.clone(),
        Tier::Asleep => asleep(),
        Tier::Moving => spec
            .pools()
            .map(|pool| {
                let bytes = spec
                    .footprint(pool.as_str())
                    .max(spec.asleep_footprint(pool.as_str()));
                let weights = crate::spec::Demand {
                    weights: bytes,
                    ..Default::default()
                };
                (pool.clone(), weights)
            })
            .collect(),
    };
    Spec {
        demand,
        ..spec.clone()
    }
}

/// What `r` adds in each pool once it moves (falls asleep or wakes): it
/// then holds both its demands, the larger in each pool, beside what it
/// is counted as holding now.
fn moving_adds(r: &Resident) -> Spec {
    let mut moving = r.clone();
    moving.tier = Tier::Moving;
    let demand = r
        .spec
        .pools()
        .filter_map(|pool| {
            let more = (moving.charge(pool.as_str()).counted())
                .saturating_sub(r.charge(pool.as_str()).counted());
            let weights = crate::spec::Demand {
                weights: more,
                ..Default::default()
            };
            (more > 0).then(|| (pool.clone(), weights))
        })
        .collect();
    Spec {
        demand,
        ..(*r.spec).clone()
    }
}

/// Plans `spec` through `one`, once per concrete choice of its any-of
/// demands (once, as it is, when it has none): a choice that fits without
/// a move wins over one that sleeps, which wins over one that evicts, then
/// the node's `GpuChoice`, then the pool names. Refused only when every
/// choice is, with every choice's reasons.
fn per_choice(
    state: &NodeState,
    spec: &Spec,
    mut one: impl FnMut(&Spec) -> Result<Plan, PlanError>,
) -> Result<Plan, PlanError> {
    if spec.any_of.is_empty() {
        return one(spec);
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
        match one(&concrete)? {
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

/// `plan_at(now)`, its refusal marked temporary when, under evict, the
/// same plan with every hold lapsed (`now` at the end of time) admits:
/// only held residents stand in the way, so waiting may help.
fn marked(
    policy: Policy,
    now: u64,
    plan_at: impl Fn(u64) -> Result<Plan, PlanError>,
) -> Result<Plan, PlanError> {
    Ok(match plan_at(now)? {
        Plan::Refuse(refusal)
            if policy == Policy::Evict && matches!(plan_at(u64::MAX)?, Plan::Admit { .. }) =>
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

/// Plans a concrete `spec` beside what the ledger holds. `beside`: a
/// resident whose own move this is (a wake, a sleep): it stays counted as
/// it stands, and is neither a conflict nor a victim of its own move.
/// `present`: bytes the target's process holds already (an adoption): a
/// live pool's reading shows them as taken, so they count as measured for
/// the target, like a resident's, and it needs the larger of its demand
/// and those bytes.
fn plan_beside(
    state: &NodeState,
    beside: Option<&InstanceId>,
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
        if Some(&r.id) == beside {
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
        let mover = Mover { spec, now, beside };
        if let Some(moves) = victims(state, &mover, &conflicting, &pools) {
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

/// Who makes room: the target's spec, at `now`, and the resident whose own
/// move it is (never moved for itself).
struct Mover<'a> {
    spec: &'a Spec,
    now: u64,
    beside: Option<&'a InstanceId>,
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

/// Whether policy lets `r` be evicted (or put to sleep) for `m`'s target
/// at its `now`: never the resident whose own move it is.
fn permitted(state: &NodeState, m: &Mover, r: &Resident) -> bool {
    r.evictable
        && Some(&r.id) != m.beside
        && !r.leaving()
        && r.tier != Tier::Moving
        && !r.held(m.now)
        && r.spec.priority <= m.spec.priority
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

/// What evicting `r` frees in `pool`: what it is counted as holding, or,
/// chosen to sleep first (`slept`), what it would hold asleep.
fn evicted_bytes(r: &Resident, slept: bool, pool: &str) -> u64 {
    let counted = r.charge(pool).counted();
    if slept {
        u64::try_from(i128::from(counted) + sleep_delta(r, pool)).unwrap_or(0)
    } else {
        counted
    }
}

/// The moves that make room, or `None` when even every permitted move
/// would not: conflicting residents are evicted (all must be permitted);
/// then, while a pool of the target is short, least-recently-used
/// permitted residents that can sleep are put to sleep where that frees
/// bytes in a short pool and their asleep demand fits everywhere it goes;
/// then, if still short, least-recently-used permitted residents holding
/// bytes in a short pool (sleepers, and those just chosen to sleep, among
/// them) are evicted. Victims and sleeps that later evictions made
/// needless are dropped, the most recently used first.
fn victims(
    state: &NodeState,
    m: &Mover,
    conflicting: &[&Resident],
    pools: &[(&Pool, PoolFigures, u64)],
) -> Option<Moves> {
    if !conflicting.iter().all(|r| permitted(state, m, r)) {
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
        .filter(|r| permitted(state, m, r) && !chosen.contains(&r.seq))
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
        // Each least-recently-used victim, and whether it had been chosen
        // to sleep.
        let mut picked: Vec<(&Resident, bool)> = Vec::new();
        for r in &candidates {
            let slept = sleep.iter().any(|s| s.seq == r.seq);
            if excess.helps(r, |pool| evicted_bytes(r, slept, pool)) {
                excess.apply(|pool| -i128::from(evicted_bytes(r, slept, pool)));
                sleep.retain(|s| s.seq != r.seq);
                picked.push((r, slept));
                if !excess.short() {
                    break;
                }
            }
        }
        if excess.short() {
            return None;
        }
        // A victim the later ones made needless stays (a small model
        // evicted first, then a large one that alone made the room): each
        // is spared, most recently used first, where the target still fits
        // without its eviction; one chosen to sleep first sleeps again.
        for i in (0..picked.len()).rev() {
            let (r, slept) = picked[i];
            excess.apply(|pool| i128::from(evicted_bytes(r, slept, pool)));
            if excess.short() {
                excess.apply(|pool| -i128::from(evicted_bytes(r, slept, pool)));
            } else {
                if slept {
                    sleep.push(r);
                }
                picked.remove(i);
            }
        }
        evict.extend(picked.iter().map(|(r, _)| r.id.clone()));
        sleep.sort_by_key(|r| (r.last_used, r.seq));
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
