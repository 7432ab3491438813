//! What a workload asks of the node: memory per pool (or on any `count` of
//! several candidate pools), exclusions, group and priority. Specs are
//! immutable and shared (`Arc<Spec>`) between the roster and the ledger
//! entries made from them; a ledger entry always holds a concrete spec,
//! with every any-of demand resolved to the pools the planner chose.

use std::collections::BTreeMap;

use crate::name::{GroupName, PoolName, Role, WorkloadName};

/// Memory one instance holds in one pool while resident.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Demand {
    /// Model weights, in bytes.
    pub weights: u64,
    /// KV-cache budget, in bytes.
    pub kv: u64,
    /// What the server holds beyond weights and KV cache: its process and
    /// runtime, compute buffers.
    pub overhead: u64,
    /// A floor under the reservation: what this workload was measured to
    /// hold before (a learned footprint); 0 for none.
    pub floor: u64,
}

impl Demand {
    /// Weights plus KV plus overhead, saturating: what was declared.
    pub fn declared(&self) -> u64 {
        self.weights
            .saturating_add(self.kv)
            .saturating_add(self.overhead)
    }

    /// What the ledger reserves: the declared bytes, raised to the floor.
    pub fn footprint(&self) -> u64 {
        self.declared().max(self.floor)
    }

    /// `self` and `other` held together in one pool (floors add too: each
    /// was measured for its own part).
    pub fn plus(&self, other: &Demand) -> Demand {
        Demand {
            weights: self.weights.saturating_add(other.weights),
            kv: self.kv.saturating_add(other.kv),
            overhead: self.overhead.saturating_add(other.overhead),
            floor: self.floor.saturating_add(other.floor),
        }
    }
}

/// The placement-relevant part of a roster workload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Spec {
    /// The roster name, also the key of group membership.
    pub workload: WorkloadName,
    /// The role exclusions are matched against.
    pub role: Role,
    /// Higher priority residents are never evicted for a lower one.
    pub priority: i32,
    /// Memory per pool. Pools not listed are not touched.
    pub demand: BTreeMap<PoolName, Demand>,
    /// Roles this workload cannot sit beside: `"planner"` or `"role:planner"`.
    pub excludes: Vec<String>,
    /// Demands the planner places on any `count` of several pools, in
    /// label order; empty for a concrete spec.
    pub any_of: Vec<AnyOf>,
    /// What it holds while asleep (`[workload.sleep]`); `None`: it cannot
    /// sleep, and making room means evicting it.
    pub asleep: Option<Asleep>,
}

/// What a sleeping instance still holds: its process's residue, and for
/// a server that moves its weights to host memory (vLLM level 1), those
/// weights in the host pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Asleep {
    /// Memory per pool while asleep.
    pub demand: BTreeMap<PoolName, Demand>,
    /// The asleep demand on each pool chosen for the spec's any-of demand
    /// of the same index (empty, or one per any-of demand).
    pub any_of: Vec<Demand>,
    /// It sleeps only by itself (llama-server after its idle time): never
    /// put to sleep by the planner or a Sleep call.
    pub by_itself: bool,
}

/// A demand on any `count` distinct pools of `candidates` (the memory of a
/// model that may run on any one GPU, or across N of them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnyOf {
    /// The name the operator gave it (`[workload.memory.LABEL]`).
    pub label: String,
    /// The pools to choose from: distinct, in name order.
    pub candidates: Vec<PoolName>,
    /// How many distinct pools to take, at least 1 and at most the
    /// number of candidates.
    pub count: usize,
    /// What it holds in each chosen pool.
    pub demand: Demand,
}

/// The pools chosen for each any-of demand of a spec, in the spec's label
/// order, each list in name order.
pub type Choice = Vec<Vec<PoolName>>;

impl Spec {
    /// A spec with no demand, no exclusions and priority 0; the role is the
    /// workload name.
    pub fn new(workload: WorkloadName) -> Self {
        let role = Role::new(workload.as_str()).expect("a workload name is a valid role");
        Self {
            workload,
            role,
            priority: 0,
            demand: BTreeMap::new(),
            excludes: Vec::new(),
            any_of: Vec::new(),
            asleep: None,
        }
    }

    /// Every way to resolve the any-of demands, in name order (the
    /// product, over labels, of the `count`-subsets of each label's
    /// candidates). One empty choice for a concrete spec.
    pub fn choices(&self) -> Vec<Choice> {
        let mut out: Vec<Choice> = vec![Vec::new()];
        for a in &self.any_of {
            let subsets = subsets(&a.candidates, a.count);
            out = out
                .into_iter()
                .flat_map(|prefix| {
                    subsets.iter().map(move |s| {
                        let mut c = prefix.clone();
                        c.push(s.clone());
                        c
                    })
                })
                .collect();
        }
        out
    }

    /// The concrete spec for `choice` (one list of pools per any-of
    /// demand): each chosen pool gets that label's demand, added to what
    /// the spec already asks of the pool.
    pub fn concrete(&self, choice: &[Vec<PoolName>]) -> Spec {
        let mut out = Spec {
            any_of: Vec::new(),
            ..self.clone()
        };
        for (a, pools) in self.any_of.iter().zip(choice) {
            for pool in pools {
                let d = out.demand.entry(pool.clone()).or_default();
                *d = d.plus(&a.demand);
            }
        }
        if let Some(asleep) = &mut out.asleep {
            for (d, pools) in asleep.any_of.iter().zip(choice) {
                for pool in pools {
                    let held = asleep.demand.entry(pool.clone()).or_default();
                    *held = held.plus(d);
                }
            }
            asleep.any_of.clear();
        }
        out
    }

    /// Bytes this spec holds in `pool` while asleep (0 when it asks
    /// nothing of it asleep, or cannot sleep).
    pub fn asleep_footprint(&self, pool: &str) -> u64 {
        self.asleep
            .as_ref()
            .and_then(|a| a.demand.get(pool))
            .map_or(0, Demand::footprint)
    }

    /// Every pool it asks memory of, awake or asleep, in name order.
    pub fn pools(&self) -> impl Iterator<Item = &PoolName> {
        let asleep = self.asleep.iter().flat_map(|a| a.demand.keys());
        let mut all: Vec<&PoolName> = self.demand.keys().chain(asleep).collect();
        all.sort();
        all.dedup();
        all.into_iter()
    }

    /// Bytes this spec holds in `pool` (0 when it asks nothing of it).
    pub fn footprint(&self, pool: &str) -> u64 {
        self.demand.get(pool).map_or(0, Demand::footprint)
    }

    /// Whether this spec lists `role` in its exclusions, by bare name or
    /// with the `role:` prefix.
    pub fn excludes(&self, role: &Role) -> bool {
        self.excludes.iter().any(|x| {
            let name = x.strip_prefix("role:").unwrap_or(x);
            name == role.as_str()
        })
    }
}

/// The `count`-element subsets of `items`, in lexicographic order.
fn subsets(items: &[PoolName], count: usize) -> Vec<Vec<PoolName>> {
    if count == 0 {
        return vec![Vec::new()];
    }
    if count > items.len() {
        return Vec::new();
    }
    let mut out = Vec::new();
    for (i, first) in items.iter().enumerate() {
        for mut rest in subsets(&items[i + 1..], count - 1) {
            rest.insert(0, first.clone());
            out.push(rest);
        }
    }
    out
}

/// How the planner chooses among pools that fit an any-of demand equally
/// well (`[node] gpu_choice`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum GpuChoice {
    /// The pools with the least room left: keeps whole devices free for
    /// large models.
    #[default]
    Binpack,
    /// The pools with the most room left: spreads load across devices.
    Spread,
}

/// How members of one group may share the node.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupPolicy {
    /// At most one member resident at a time.
    pub swap: bool,
    /// While a member is resident, no member of another non-persistent
    /// group may be, and the reverse.
    pub exclusive: bool,
    /// Members are never evicted but count against the budget.
    pub persistent: bool,
}

/// A group as the operator declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupDef {
    /// Its name.
    pub name: GroupName,
    /// Workload names it holds.
    pub members: Vec<WorkloadName>,
    /// Its rules.
    pub policy: GroupPolicy,
}

/// Why a set of groups is not a valid table.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GroupError {
    /// A workload may belong to one group only.
    #[error("workload '{workload}' is a member of both group '{first}' and group '{second}'")]
    TwoGroups {
        /// The workload.
        workload: WorkloadName,
        /// The group that listed it first.
        first: GroupName,
        /// The group that listed it again.
        second: GroupName,
    },
    /// Two groups with one name.
    #[error("group '{0}' is declared twice")]
    Duplicate(GroupName),
}

/// Groups and the membership index: which group, if any, a workload is in.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Groups {
    policies: BTreeMap<GroupName, GroupPolicy>,
    member_of: BTreeMap<WorkloadName, GroupName>,
}

impl Groups {
    /// Builds the table, refusing a workload listed in two groups.
    pub fn new(defs: impl IntoIterator<Item = GroupDef>) -> Result<Self, GroupError> {
        let mut groups = Self::default();
        for def in defs {
            if groups
                .policies
                .insert(def.name.clone(), def.policy)
                .is_some()
            {
                return Err(GroupError::Duplicate(def.name));
            }
            for member in def.members {
                if let Some(first) = groups.member_of.get(&member) {
                    if *first != def.name {
                        return Err(GroupError::TwoGroups {
                            workload: member,
                            first: first.clone(),
                            second: def.name,
                        });
                    }
                    continue;
                }
                groups.member_of.insert(member, def.name.clone());
            }
        }
        Ok(groups)
    }

    /// The group `workload` belongs to, with its policy.
    pub fn of(&self, workload: &str) -> Option<(&GroupName, GroupPolicy)> {
        let name = self.member_of.get(workload)?;
        Some((name, self.policies.get(name).copied().unwrap_or_default()))
    }

    /// Whether `workload` is a member of a persistent group.
    pub fn is_persistent(&self, workload: &str) -> bool {
        self.of(workload).is_some_and(|(_, p)| p.persistent)
    }
}
