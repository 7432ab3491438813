//! One admission decision (plan, policy evict) against 10, 100 and 1,000
//! residents over 3 pools. The target needs a handful of evictions, so the
//! measurement covers conflicts, budgets, candidate sorting and selection.
//!
//! Run: `cargo bench -p resident-core --bench admission`

use std::hint::black_box;
use std::sync::Arc;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use resident_core::{
    Demand, Entry, GB, Groups, InstanceId, NodeState, Plan, Policy, PoolConfig, PoolName, Spec,
    WorkloadName,
};

const POOLS: [&str; 3] = ["ram", "gpu0", "gpu1"];

fn spec(name: &str, gb: [u64; 3]) -> Spec {
    let mut s = Spec::new(WorkloadName::new(name).expect("valid"));
    for (pool, gb) in POOLS.iter().zip(gb) {
        s.demand.insert(
            PoolName::new(*pool).expect("valid"),
            Demand {
                weights: gb * GB,
                kv: GB / 2,
                ..Default::default()
            },
        );
    }
    s.excludes = vec!["role:nobody-runs-this".into()];
    s
}

/// A node whose pools are exactly full with `n` residents; a deterministic
/// spread of last-use times so that LRU order differs from id order.
fn full_node(n: u64) -> NodeState {
    let pool = |p: &str, budget| PoolConfig::new(PoolName::new(p).expect("valid"), budget);
    let mut state = NodeState::new(POOLS.map(|p| pool(p, None)), Groups::default());
    for i in 0..n {
        let id = InstanceId::new(format!("inst-{i:05}")).expect("valid");
        let s = Arc::new(spec(&format!("w{}", i % 50), [2 + i % 3, 3, 1 + i % 2]));
        let last_used = (i * 7919) % n;
        state
            .admit(&id, Entry::Start(s), Policy::Refuse, last_used)
            .expect("no budget yet");
    }
    let full = POOLS.map(|p| pool(p, Some(state.used(p))));
    state.reconfigure(full, Groups::default());
    state
}

fn admission(c: &mut Criterion) {
    let mut group = c.benchmark_group("plan_evict");
    let target = spec("target", [12, 12, 12]);
    let id = InstanceId::new("target-0").expect("valid");
    for n in [10u64, 100, 1_000] {
        let state = full_node(n);
        let plan = state.plan(&id, &target, Policy::Evict, n).expect("valid");
        assert!(
            matches!(plan, Plan::Admit { ref evict, .. } if !evict.is_empty()),
            "{plan:?}"
        );
        group.throughput(Throughput::Elements(n));
        group.bench_with_input(BenchmarkId::from_parameter(n), &state, |b, state| {
            b.iter(|| black_box(state.plan(&id, black_box(&target), Policy::Evict, n)))
        });
    }
    group.finish();
}

criterion_group!(benches, admission);
criterion_main!(benches);
