//! Builders shared by the core's integration tests: terse specs and nodes
//! in whole gigabytes, so table rows read like the brief's examples.

use std::sync::Arc;

use resident_core::{
    Demand, Entry, GB, GroupDef, GroupName, GroupPolicy, Groups, InstanceId, NodeState, PoolConfig,
    PoolName, Role, Spec, WorkloadName,
};

pub fn id(s: &str) -> InstanceId {
    InstanceId::new(s).expect("test ids are valid")
}

pub fn pool(s: &str) -> PoolName {
    PoolName::new(s).expect("test pool names are valid")
}

/// A spec for workload `name` (role = name) holding `gb` in each pool.
pub fn spec(name: &str, pools: &[(&str, u64)]) -> Spec {
    let mut s = Spec::new(WorkloadName::new(name).expect("test names are valid"));
    for (p, gb) in pools {
        s.demand.insert(
            pool(p),
            Demand {
                weights: gb * GB,
                kv: 0,
                ..Default::default()
            },
        );
    }
    s
}

/// `spec` in the single pool "unified".
pub fn unified(name: &str, gb: u64) -> Spec {
    spec(name, &[("unified", gb)])
}

pub fn with_role(mut s: Spec, role: &str) -> Spec {
    s.role = Role::new(role).expect("test roles are valid");
    s
}

pub fn excluding(mut s: Spec, excludes: &[&str]) -> Spec {
    s.excludes = excludes.iter().map(|x| x.to_string()).collect();
    s
}

pub fn static_pool(name: &str, budget_gb: Option<u64>) -> PoolConfig {
    PoolConfig::new(pool(name), budget_gb.map(|b| b * GB))
}

pub fn live_pool(name: &str, budget_gb: Option<u64>, reserve_gb: u64) -> PoolConfig {
    PoolConfig {
        reserve: reserve_gb * GB,
        live: true,
        ..static_pool(name, budget_gb)
    }
}

pub fn group(name: &str, members: &[&str], policy: GroupPolicy) -> GroupDef {
    GroupDef {
        name: GroupName::new(name).expect("test group names are valid"),
        members: members
            .iter()
            .map(|m| WorkloadName::new(*m).expect("valid"))
            .collect(),
        policy,
    }
}

pub fn node(pools: Vec<PoolConfig>, groups: Vec<GroupDef>) -> NodeState {
    NodeState::new(pools, Groups::new(groups).expect("test groups are valid"))
}

/// Admits `s` as instance `name` at time `now`, panicking on refusal.
pub fn put(state: &mut NodeState, name: &str, s: Spec, now: u64) {
    let policy = resident_core::Policy::Refuse;
    state
        .admit(&id(name), Entry::Start(Arc::new(s)), policy, now)
        .expect("setup admission fits");
}

/// Puts resident `name` to sleep as a Sleep call would (planned under
/// refuse, then settled asleep), panicking on refusal.
pub fn asleep(state: &mut NodeState, name: &str, now: u64) {
    let policy = resident_core::Policy::Refuse;
    state
        .admit(&id(name), Entry::Sleep, policy, now)
        .expect("setup sleep fits");
    assert!(state.settle(name, resident_core::Tier::Asleep));
}

pub fn ids(v: &[InstanceId]) -> Vec<&str> {
    v.iter().map(InstanceId::as_str).collect()
}
