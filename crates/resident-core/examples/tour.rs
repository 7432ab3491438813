//! A tour of the placement core on the reference scenario: a 96 GB unified
//! pool, two coders resident, a planner that does not fit, an exclusion,
//! and the same start under the evict policy. Prints each decision.
//!
//! Run: `cargo run -p resident-core --example tour`

use std::sync::Arc;

use resident_core::{
    AdmitError, Demand, Entry, GB, Gb, Groups, InstanceId, NodeState, Policy, PoolConfig, PoolName,
    Spec, WorkloadName,
};

fn spec(name: &str, gb: u64, excludes: &[&str]) -> Arc<Spec> {
    let mut s = Spec::new(WorkloadName::new(name).expect("tour names are valid"));
    let unified = PoolName::new("unified").expect("valid");
    s.demand.insert(
        unified,
        Demand {
            weights: gb * GB,
            kv: 0,
            ..Default::default()
        },
    );
    s.excludes = excludes.iter().map(|x| x.to_string()).collect();
    Arc::new(s)
}

fn start(node: &mut NodeState, id: &str, s: Arc<Spec>, policy: Policy, now: u64) {
    let iid = InstanceId::new(id).expect("tour ids are valid");
    match node.admit(&iid, Entry::Start(s), policy, now) {
        Ok(a) if a.evict.is_empty() => println!("start {id:<12} {policy:?}: admitted"),
        Ok(a) => {
            let victims: Vec<&str> = a.evict.iter().map(InstanceId::as_str).collect();
            println!(
                "start {id:<12} {policy:?}: admitted, evicting {}",
                victims.join(", ")
            );
            for v in &a.evict {
                node.release(v.as_str()); // the supervisor would stop it first
            }
        }
        Err(AdmitError::Refused(r)) => println!("start {id:<12} {policy:?}: {r}"),
        Err(e) => println!("start {id:<12} {policy:?}: error: {e}"),
    }
}

fn main() {
    let pool = PoolConfig::new(PoolName::new("unified").expect("valid"), Some(96 * GB));
    let mut node = NodeState::new([pool], Groups::default());
    start(
        &mut node,
        "coder-daily",
        spec("coder-daily", 55, &[]),
        Policy::Refuse,
        1,
    );
    start(
        &mut node,
        "coder-small",
        spec("coder-small", 9, &[]),
        Policy::Refuse,
        2,
    );
    start(
        &mut node,
        "planner",
        spec("planner", 55, &[]),
        Policy::Refuse,
        3,
    );
    let reviewer = spec("reviewer", 1, &["role:coder-small"]);
    start(&mut node, "reviewer", reviewer, Policy::Refuse, 4);
    node.touch("coder-daily", 5, 0);
    start(
        &mut node,
        "planner",
        spec("planner", 55, &[]),
        Policy::Evict,
        6,
    );
    for p in node.pools() {
        let free = p
            .free
            .map_or("unbounded".to_string(), |f| Gb(f).to_string());
        println!("pool {}: {} used, {free} free", p.name, Gb(p.used));
        for h in node.holders(p.name.as_str()) {
            println!("  {:<12} {:<12} {}", h.instance_id, h.role, Gb(h.bytes));
        }
    }
}
