//! The ledger: pools with budgets and live readings, what every resident
//! holds, and the budget arithmetic every figure and plan reads
//! (`PoolFigures`). It imports neither the planner nor the admission: the
//! planner reads it, and `admit.rs` changes what it holds.
//!
//! What may change here without a plan lowers a charge or records a fact:
//! a release, a settle (`admit.rs`), a reading, a use, a hold, a Stop's
//! mark. Whatever raises a charge enters through `NodeState::admit`.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::name::{InstanceId, PoolName};
use crate::reason::Holder;
use crate::spec::{GpuChoice, Groups, Spec};

/// A pool as configured.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolConfig {
    /// Its name.
    pub name: PoolName,
    /// The configured budget; `None` leaves it unbounded unless a live
    /// reading bounds it.
    pub budget: Option<u64>,
    /// Headroom kept free on a live (probe-bound) pool.
    pub reserve: u64,
    /// Whether a probe reading bounds this pool.
    pub live: bool,
}

impl PoolConfig {
    /// A static pool with this budget.
    pub fn new(name: PoolName, budget: Option<u64>) -> Self {
        Self {
            name,
            budget,
            reserve: 0,
            live: false,
        }
    }
}

/// A pool and its last probe reading.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Pool {
    pub(crate) config: PoolConfig,
    /// Bytes the probe last read as available; `None`: no trustworthy
    /// reading, the configured budget stands.
    pub(crate) available: Option<u64>,
}

/// One entry of the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resident {
    /// The instance.
    pub id: InstanceId,
    /// What it declared.
    pub spec: Arc<Spec>,
    /// Admission order, the tie-break of least-recently-used.
    pub seq: u64,
    /// Last use on the caller's clock (admission, repeated Start, Touch).
    pub last_used: u64,
    /// Not evictable before this instant on the caller's clock.
    pub hold_until: u64,
    /// Measured bytes per pool (what the instance really touched).
    pub measured: BTreeMap<PoolName, u64>,
    /// Where it is in its life: held, or leaving (chosen as a victim or
    /// asked to stop: it still holds its memory until released, but it is
    /// no longer a candidate and a start it conflicts with waits for it).
    pub phase: Phase,
    /// Whether it may be evicted at all (false for a process the caller
    /// may not stop, such as an adopted one it does not manage).
    pub evictable: bool,
    /// Awake, asleep, or between the two: which of its demands it holds.
    pub tier: Tier,
}

/// Which of its demands a resident holds: the awake one (its memory
/// tables), the asleep one (`Spec::asleep`), or, while it falls asleep or
/// wakes, in each pool the larger of the two (the memory moves during the
/// call; the books never hold both, nor neither).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Tier {
    /// Serving: its awake demand.
    #[default]
    Awake,
    /// Asleep: its process and port kept, its asleep demand held.
    Asleep,
    /// Falling asleep or waking: the larger demand of each pool.
    Moving,
}

/// Where a resident is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Holding its reservation, a candidate for eviction by policy.
    Held,
    /// Stopping (evicted, or a Stop was asked): its memory is held until
    /// its release, and nothing plans to stop it again.
    Leaving,
}

impl Resident {
    /// Whether it is leaving.
    pub fn leaving(&self) -> bool {
        self.phase == Phase::Leaving
    }
}

/// What one resident is charged in one pool: the one figure every sum
/// of the ledger reads (`Resident::charge`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Charge {
    /// What the books reserved at admission (declared, raised by what was
    /// learned).
    pub reserved: u64,
    /// What it was last measured to hold (0: no reading yet).
    pub measured: u64,
}

impl Charge {
    /// What the pool counts as held: the larger of the reservation and
    /// the measurement. Memory measured beyond the reservation is not
    /// there for anyone else, whatever was declared.
    pub fn counted(&self) -> u64 {
        self.reserved.max(self.measured)
    }

    /// Bytes measured beyond the reservation (0: within it).
    pub fn overrun(&self) -> u64 {
        self.measured.saturating_sub(self.reserved)
    }
}

impl Resident {
    /// Reserved bytes in `pool` for the demand it holds now (see [`Tier`]).
    pub fn footprint(&self, pool: &str) -> u64 {
        let awake = || self.spec.footprint(pool);
        let asleep = || self.spec.asleep_footprint(pool);
        match self.tier {
            Tier::Awake => awake(),
            Tier::Asleep => asleep(),
            Tier::Moving => awake().max(asleep()),
        }
    }

    /// What it is charged in `pool`. A pool it asks nothing of, awake or
    /// asleep, charges nothing (a reading there is not its reservation's
    /// to count).
    pub fn charge(&self, pool: &str) -> Charge {
        let asks = self.spec.demand.contains_key(pool)
            || self
                .spec
                .asleep
                .as_ref()
                .is_some_and(|a| a.demand.contains_key(pool));
        if !asks {
            return Charge::default();
        }
        Charge {
            reserved: self.footprint(pool),
            measured: self.measured.get(pool).copied().unwrap_or(0),
        }
    }

    /// Whether it can be put to sleep: its workload can be (not only by
    /// itself), and it is awake.
    pub fn can_sleep(&self) -> bool {
        self.spec.asleep.as_ref().is_some_and(|a| !a.by_itself) && self.tier == Tier::Awake
    }

    /// Whether a hold protects it at `now`.
    pub fn held(&self, now: u64) -> bool {
        now < self.hold_until
    }
}

/// A pool's figures as the `Node` RPC and a `Placement` show them (who
/// holds the memory is [`NodeState::holders`], which a refusal names).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolStatus {
    /// The pool.
    pub name: PoolName,
    /// Configured budget.
    pub budget: Option<u64>,
    /// Configured budget tightened by the live ceiling.
    pub effective: Option<u64>,
    /// Bytes counted for every entry, evicting ones included: for each,
    /// the larger of its reservation and its measurement.
    pub used: u64,
    /// `effective - used`, saturating; `None` when unbounded.
    pub free: Option<u64>,
}

/// Pools, groups and residents of one node.
#[derive(Debug, Clone, Default)]
pub struct NodeState {
    pub(crate) pools: BTreeMap<PoolName, Pool>,
    pub(crate) groups: Groups,
    pub(crate) residents: BTreeMap<InstanceId, Resident>,
    pub(crate) gpu_choice: GpuChoice,
    pub(crate) next_seq: u64,
}

impl NodeState {
    /// A node with these pools and groups and no residents.
    pub fn new(pools: impl IntoIterator<Item = PoolConfig>, groups: Groups) -> Self {
        let mut state = Self {
            groups,
            ..Self::default()
        };
        state.set_pools(pools);
        state
    }

    /// Replaces pools and groups (a config reload). Residents stay; a pool
    /// that keeps its name keeps its last reading.
    pub fn reconfigure(&mut self, pools: impl IntoIterator<Item = PoolConfig>, groups: Groups) {
        self.groups = groups;
        self.set_pools(pools);
    }

    fn set_pools(&mut self, pools: impl IntoIterator<Item = PoolConfig>) {
        let old = std::mem::take(&mut self.pools);
        for config in pools {
            let available = old.get(&config.name).and_then(|p| p.available);
            self.pools
                .insert(config.name.clone(), Pool { config, available });
        }
    }

    /// How any-of demands choose among pools that fit alike.
    pub fn set_gpu_choice(&mut self, choice: GpuChoice) {
        self.gpu_choice = choice;
    }

    /// The group table.
    pub fn groups(&self) -> &Groups {
        &self.groups
    }

    /// Releases what `id` held. `None` when it held nothing.
    pub fn release(&mut self, id: &str) -> Option<Resident> {
        self.residents.remove(id)
    }

    /// Marks a use of `id` at `now`, and with `hold_ms > 0` protects it from
    /// eviction until `now + hold_ms` (a hold never shortens). False when
    /// `id` is not resident.
    pub fn touch(&mut self, id: &str, now: u64, hold_ms: u64) -> bool {
        let Some(r) = self.residents.get_mut(id) else {
            return false;
        };
        r.last_used = r.last_used.max(now);
        r.hold_until = r.hold_until.max(now.saturating_add(hold_ms));
        true
    }

    /// Marks a use of `id` at `now` and ends its hold. False when `id` is
    /// not resident.
    pub fn release_hold(&mut self, id: &str, now: u64) -> bool {
        let Some(r) = self.residents.get_mut(id) else {
            return false;
        };
        r.last_used = r.last_used.max(now);
        r.hold_until = 0;
        true
    }

    /// Records what `id` measurably holds in `pool`.
    pub fn set_measured(&mut self, id: &str, pool: &PoolName, bytes: u64) -> bool {
        let Some(r) = self.residents.get_mut(id) else {
            return false;
        };
        r.measured.insert(pool.clone(), bytes);
        true
    }

    /// Records a live pool's probe reading (`None`: no trustworthy reading).
    pub fn set_available(&mut self, pool: &str, available: Option<u64>) -> bool {
        match self.pools.get_mut(pool) {
            Some(p) => {
                p.available = available;
                true
            }
            None => false,
        }
    }

    /// A live pool's last probe reading.
    pub fn available(&self, pool: &str) -> Option<u64> {
        self.pools.get(pool).and_then(|p| p.available)
    }

    /// One resident.
    pub fn resident(&self, id: &str) -> Option<&Resident> {
        self.residents.get(id)
    }

    /// Marks `id` as leaving (a Stop was asked): it keeps its memory until
    /// released, and is no longer a victim or a conflict to plan around.
    /// False when it is not resident.
    pub fn leave(&mut self, id: &str) -> bool {
        match self.residents.get_mut(id) {
            Some(r) => {
                r.phase = Phase::Leaving;
                true
            }
            None => false,
        }
    }

    /// Every resident, in id order.
    pub fn residents(&self) -> impl Iterator<Item = &Resident> {
        self.residents.values()
    }

    /// Bytes counted in `pool` for every entry.
    pub fn used(&self, pool: &str) -> u64 {
        self.residents
            .values()
            .map(|r| r.charge(pool).counted())
            .fold(0, u64::saturating_add)
    }

    /// Every resident measured above its reservation somewhere: its id,
    /// the pool and the charge there, in id and pool order.
    pub fn overruns(&self) -> Vec<(&InstanceId, &PoolName, Charge)> {
        let mut out = Vec::new();
        for r in self.residents.values() {
            for pool in r.spec.pools() {
                let charge = r.charge(pool.as_str());
                if charge.overrun() > 0 {
                    out.push((&r.id, pool, charge));
                }
            }
        }
        out
    }

    /// The budget `pool` admits against now: the configured one, tightened
    /// by the live ceiling. `None` when unbounded or unknown.
    pub fn effective_budget(&self, pool: &str) -> Option<u64> {
        let p = self.pools.get(pool)?;
        PoolFigures::of(self, p).effective()
    }

    /// Figures of every pool, in name order: one pass over the residents
    /// (each adds to the pools it asks of), not one per pool. Every
    /// `Place` and `Node` answer carries these.
    pub fn pools(&self) -> Vec<PoolStatus> {
        let names: Vec<&PoolName> = self.pools.keys().collect();
        let mut sums = vec![Totals::default(); names.len()];
        for r in self.residents.values() {
            for pool in r.spec.pools() {
                if let Ok(i) = names.binary_search(&pool) {
                    sums[i].add(r.charge(pool.as_str()));
                }
            }
        }
        self.pools
            .values()
            .zip(sums)
            .map(|(p, totals)| {
                let used = totals.used;
                let effective = PoolFigures::new(p, totals).effective();
                let used = u64::try_from(used).unwrap_or(u64::MAX);
                PoolStatus {
                    name: p.config.name.clone(),
                    budget: p.config.budget,
                    effective,
                    used,
                    free: effective.map(|e| e.saturating_sub(used)),
                }
            })
            .collect()
    }

    /// Bytes given back in `pool` once `victims` have exited and
    /// `sleepers` fallen asleep: what the victims are counted as holding,
    /// and what each sleeper holds beyond its asleep reservation.
    fn freed(&self, victims: &[InstanceId], sleepers: &[InstanceId], pool: &str) -> u64 {
        let gone = victims
            .iter()
            .filter_map(|v| self.residents.get(v))
            .map(|r| r.charge(pool).counted());
        let slept = sleepers
            .iter()
            .filter_map(|v| self.residents.get(v))
            .map(|r| {
                let asleep = r.spec.asleep_footprint(pool);
                r.charge(pool).counted().saturating_sub(asleep)
            });
        gone.chain(slept).fold(0, u64::saturating_add)
    }

    /// For each live pool `spec` (a concrete spec) takes: the bytes to see
    /// available again once `victims` have exited and `sleepers` fallen
    /// asleep before its start goes on, three quarters of what they give
    /// back there (the kernel and the probe need not give back every byte
    /// at once).
    pub fn recovery(
        &self,
        spec: &Spec,
        victims: &[InstanceId],
        sleepers: &[InstanceId],
    ) -> Vec<(PoolName, u64)> {
        spec.demand
            .keys()
            .filter(|pool| self.pools.get(*pool).is_some_and(|p| p.config.live))
            .map(|pool| {
                let back = self.freed(victims, sleepers, pool.as_str());
                (pool.clone(), back / 4 * 3)
            })
            .filter(|(_, want)| *want > 0)
            .collect()
    }

    /// What a start of `spec` (a concrete spec) leaves free once `victims`
    /// are gone and `sleepers` asleep, in the tightest of its bounded pools: effective budget
    /// less what stays used less what it takes (nothing when `existing`,
    /// an instance already resident). `None` when none of its pools is
    /// bounded.
    pub fn free_after(
        &self,
        spec: &Spec,
        victims: &[InstanceId],
        sleepers: &[InstanceId],
        existing: bool,
    ) -> Option<u64> {
        let pools = self.pools();
        spec.demand
            .keys()
            .filter_map(|pool| {
                let figures = pools.iter().find(|p| p.name == *pool)?;
                let budget = figures.effective?;
                let freed = self.freed(victims, sleepers, pool.as_str());
                let taken = if existing {
                    0
                } else {
                    spec.footprint(pool.as_str())
                };
                let used = figures.used.saturating_sub(freed);
                Some(budget.saturating_sub(used).saturating_sub(taken))
            })
            .min()
    }

    /// Residents with bytes in `pool`, in id order, each with what it is
    /// counted as holding (measured, where that is more than reserved).
    pub fn holders(&self, pool: &str) -> Vec<Holder> {
        self.residents
            .values()
            .filter_map(|r| {
                let bytes = r.charge(pool).counted();
                (bytes > 0).then(|| Holder {
                    instance_id: r.id.clone(),
                    role: r.spec.role.clone(),
                    bytes,
                })
            })
            .collect()
    }
}

/// The sums of a pool's charges: the one accumulator behind every pool
/// figure.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Totals {
    /// Counted bytes (the larger of reserved and measured, per resident).
    pub(crate) used: u128,
    /// Measured bytes: what a live reading already shows as taken by our
    /// residents.
    pub(crate) measured: u128,
}

impl Totals {
    pub(crate) fn add(&mut self, charge: Charge) {
        self.used += u128::from(charge.counted());
        self.measured += u128::from(charge.measured);
    }
}

/// A pool's budget arithmetic at one moment.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PoolFigures {
    pub(crate) budget: Option<u64>,
    /// Counted bytes of every entry (the larger of reserved and measured).
    pub(crate) used: u128,
    pub(crate) live: Option<Live>,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct Live {
    pub(crate) available: u64,
    pub(crate) reserve: u64,
    /// Measured bytes of every entry: already missing from `available`.
    pub(crate) measured: u128,
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
    pub(crate) fn ceiling(&self) -> Option<u128> {
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
    pub(crate) fn excess(&self, need: u64) -> i128 {
        match self.effective() {
            Some(e) => (self.used + u128::from(need)) as i128 - i128::from(e),
            None => i128::MIN / 2,
        }
    }
}
