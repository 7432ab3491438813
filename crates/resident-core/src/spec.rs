//! What a workload asks of the node: memory per pool, exclusions, group and
//! priority. Specs are immutable and shared (`Arc<Spec>`) between the roster
//! and the ledger entries made from them.

use std::collections::BTreeMap;

use crate::name::{GroupName, PoolName, Role, WorkloadName};

/// Memory one instance holds in one pool while resident.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Demand {
    /// Model weights, in bytes.
    pub weights: u64,
    /// KV-cache budget, in bytes.
    pub kv: u64,
}

impl Demand {
    /// Weights plus KV, saturating: what the ledger charges.
    pub fn footprint(&self) -> u64 {
        self.weights.saturating_add(self.kv)
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
}

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
        }
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
