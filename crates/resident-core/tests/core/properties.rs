//! Property tests of the ledger and planner over random operation
//! sequences, budgets, specs and policies.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::support::*;
use proptest::prelude::*;
use resident_core::{
    AdmitError, AnyOf, Asleep, Demand, Entry, GB, GpuChoice, GroupPolicy, InstanceId, NodeState,
    Plan, Policy, Reason, Resident, Spec, Tier,
};

const POOLS: [&str; 3] = ["p0", "p1", "p2"];
const WORKLOADS: usize = 6;

#[derive(Debug, Clone)]
enum Op {
    Start {
        id: u8,
        workload: usize,
        evict: bool,
    },
    Release {
        id: u8,
    },
    Touch {
        id: u8,
        hold: u64,
    },
    Measure {
        id: u8,
        pool: usize,
        gb: u64,
    },
    Reading {
        pool: usize,
        gb: Option<u64>,
    },
    Tick {
        ms: u64,
    },
    /// A resident falling asleep (or waking) gets there.
    Settle {
        id: u8,
    },
    /// A Start of a sleeping resident.
    Wake {
        id: u8,
        evict: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..10, 0..WORKLOADS, any::<bool>()).prop_map(|(id, workload, evict)| Op::Start { id, workload, evict }),
        2 => (0u8..10).prop_map(|id| Op::Release { id }),
        1 => (0u8..10, 0u64..50).prop_map(|(id, hold)| Op::Touch { id, hold }),
        1 => (0u8..10, 0..3usize, 0u64..10).prop_map(|(id, pool, gb)| Op::Measure { id, pool, gb }),
        1 => (0..3usize, proptest::option::of(0u64..30)).prop_map(|(pool, gb)| Op::Reading { pool, gb }),
        1 => (1u64..20).prop_map(|ms| Op::Tick { ms }),
        2 => (0u8..10).prop_map(|id| Op::Settle { id }),
        1 => (0u8..10, any::<bool>()).prop_map(|(id, evict)| Op::Wake { id, evict }),
    ]
}

fn policy() -> impl Strategy<Value = GroupPolicy> {
    (any::<bool>(), any::<bool>(), any::<bool>()).prop_map(|(swap, exclusive, persistent)| {
        GroupPolicy {
            swap,
            exclusive,
            persistent,
        }
    })
}

#[derive(Debug, Clone)]
struct World {
    pools: Vec<(Option<u64>, bool, u64)>,
    spread: bool,
    groups: Vec<(Vec<usize>, GroupPolicy)>,
    specs: Vec<Spec>,
}

fn world() -> impl Strategy<Value = World> {
    let pools =
        proptest::collection::vec((proptest::option::of(0u64..20), any::<bool>(), 0u64..3), 3);
    let memberships = proptest::collection::vec(proptest::option::of(0usize..3), WORKLOADS);
    let policies = proptest::collection::vec(policy(), 3);
    let demands = proptest::collection::vec(
        (
            proptest::collection::vec(0u64..8, 3),
            -1i32..3,
            proptest::collection::vec(0..WORKLOADS, 0..2),
            // An any-of demand: candidate pools (a bit mask), count, size.
            proptest::option::of((1u8..8, 1usize..3, 1u64..8)),
            // Can sleep: what it holds asleep per pool (a residue, or
            // weights moved to another pool).
            proptest::option::of(proptest::collection::vec(0u64..4, 3)),
        ),
        WORKLOADS,
    );
    (pools, memberships, policies, demands, any::<bool>()).prop_map(
        |(pools, members, policies, demands, spread)| {
            let groups = policies
                .into_iter()
                .enumerate()
                .map(|(g, p)| {
                    (
                        (0..WORKLOADS).filter(|w| members[*w] == Some(g)).collect(),
                        p,
                    )
                })
                .collect();
            let specs = demands
                .into_iter()
                .enumerate()
                .map(|(w, (gbs, priority, excludes, any_of, asleep))| {
                    let mut s = spec(&format!("w{w}"), &[]);
                    if let Some(asleep) = asleep {
                        let mut a = Asleep::default();
                        for (p, gb) in asleep.into_iter().enumerate() {
                            if gb > 0 {
                                let d = Demand {
                                    weights: gb * GB - 1,
                                    ..Default::default()
                                };
                                a.demand.insert(pool(POOLS[p]), d);
                            }
                        }
                        if any_of.is_some() {
                            a.any_of.push(Demand {
                                overhead: GB / 3,
                                ..Default::default()
                            });
                        }
                        s.asleep = Some(a);
                    }
                    if let Some((mask, count, gb)) = any_of {
                        let candidates: Vec<_> = (0..3)
                            .filter(|p| mask & (1 << p) != 0)
                            .map(|p| pool(POOLS[p]))
                            .collect();
                        let count = count.min(candidates.len());
                        s.any_of.push(AnyOf {
                            label: "gpu".into(),
                            candidates,
                            count,
                            demand: Demand {
                                weights: gb * GB,
                                kv: 3,
                                ..Default::default()
                            },
                        });
                    }
                    for (p, gb) in gbs.into_iter().enumerate() {
                        // Odd byte counts so that "exactly fits" edges come up.
                        s.demand.insert(
                            pool(POOLS[p]),
                            Demand {
                                weights: gb * GB,
                                kv: gb * 7,
                                // Overhead, and sometimes a learned floor above
                                // the declaration.
                                overhead: gb * 5,
                                floor: if gb % 3 == 0 { gb * GB + GB / 2 } else { 0 },
                            },
                        );
                    }
                    s.priority = priority;
                    s.excludes = excludes.iter().map(|x| format!("role:w{x}")).collect();
                    s
                })
                .collect();
            World {
                pools,
                spread,
                groups,
                specs,
            }
        },
    )
}

fn build(w: &World) -> NodeState {
    let pools = w
        .pools
        .iter()
        .zip(POOLS)
        .map(|((budget, live, reserve), name)| match live {
            true => live_pool(name, *budget, *reserve),
            false => static_pool(name, *budget),
        })
        .collect();
    let groups = w
        .groups
        .iter()
        .enumerate()
        .map(|(g, (members, p))| {
            let names: Vec<String> = members.iter().map(|m| format!("w{m}")).collect();
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            group(&format!("g{g}"), &refs, *p)
        })
        .collect();
    let mut n = node(pools, groups);
    n.set_gpu_choice(if w.spread {
        GpuChoice::Spread
    } else {
        GpuChoice::Binpack
    });
    n
}

fn snapshot(n: &NodeState) -> Vec<Resident> {
    n.residents().cloned().collect()
}

fn permitted(n: &NodeState, target: &Spec, now: u64, r: &Resident) -> bool {
    !r.leaving()
        && r.tier != Tier::Moving
        && !r.held(now)
        && r.spec.priority <= target.priority
        && !n.groups().is_persistent(r.spec.workload.as_str())
}

/// The oracle for "could fit after every permitted eviction": release every
/// permitted resident, returning what it was measured to hold to the
/// probe's reading,
/// then ask whether a plain refuse-plan admits.
fn fits_after_all_evictions(n: &NodeState, target: &Spec, now: u64) -> bool {
    let mut m = n.clone();
    let mut returned: BTreeMap<&str, u64> = BTreeMap::new();
    for r in n.residents().filter(|r| permitted(n, target, now, r)) {
        for p in POOLS {
            *returned.entry(p).or_default() += r.charge(p).measured;
        }
        m.release(r.id.as_str());
    }
    for p in POOLS {
        if let Some(avail) = n.available(p) {
            m.set_available(p, Some(avail + returned.get(p).copied().unwrap_or(0)));
        }
    }
    matches!(
        m.plan(&id("t"), target, Policy::Refuse, now),
        Ok(Plan::Admit { .. })
    )
}

/// What putting `r` to sleep changes in pool `p`.
fn sleep_delta(r: &Resident, p: &str) -> i128 {
    let asleep = if r.spec.pools().any(|q| q.as_str() == p) {
        r.spec.asleep_footprint(p)
    } else {
        0
    };
    i128::from(asleep) - i128::from(r.charge(p).counted())
}

/// What pool `p` of `n` holds for residents that stay, once the sleepers
/// `sleep` (residents of `pre`) are asleep.
fn committed(n: &NodeState, pre: &NodeState, sleep: &[InstanceId], p: &str) -> u64 {
    n.residents()
        .filter(|r| !r.leaving())
        .map(|r| {
            if sleep.contains(&r.id) {
                let was = pre.resident(r.id.as_str()).expect("was resident");
                (i128::from(was.charge(p).counted()) + sleep_delta(was, p)) as u64
            } else {
                r.charge(p).counted()
            }
        })
        .sum()
}

/// Checks the moves of an evict-plan: sleepers permitted, able to sleep
/// and not evicted, their asleep demand fitting wherever it goes; victims
/// permitted, conflicts first, then least-recently-used, each helping a
/// pool that was still short once the sleepers sleep.
fn check_moves(n: &NodeState, target: &Spec, now: u64, sleep: &[InstanceId], evict: &[InstanceId]) {
    let mut excess: BTreeMap<&str, i128> = BTreeMap::new();
    for p in POOLS {
        let need = target.footprint(p);
        if let Some(eff) = n.effective_budget(p) {
            excess.insert(
                p,
                i128::from(n.used(p)) + i128::from(need) - i128::from(eff),
            );
        }
    }
    let targets: Vec<&str> = POOLS
        .into_iter()
        .filter(|p| target.footprint(p) > 0)
        .collect();
    let mut grown = Vec::new();
    for s in sleep {
        let r = n.resident(s.as_str()).expect("sleepers are residents");
        assert!(permitted(n, target, now, r), "sleeper {s} is not permitted");
        assert!(r.can_sleep(), "sleeper {s} cannot sleep");
        assert!(!evict.contains(s), "{s} both sleeps and is evicted");
        for (p, e) in excess.iter_mut() {
            let d = sleep_delta(r, p);
            *e += d;
            if d > 0 {
                grown.push(*p);
            }
        }
    }
    let conflicting: Vec<_> = match n.plan(&id("t"), target, Policy::Refuse, now) {
        Ok(Plan::Refuse(r)) => r
            .reasons()
            .iter()
            .filter_map(|x| match x {
                Reason::Excluded { with_instance, .. }
                | Reason::GroupConflict { with_instance, .. } => Some(with_instance.clone()),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    assert!(
        evict.starts_with(&conflicting),
        "every conflicting resident goes, first"
    );
    let mut last_lru: Option<(u64, u64)> = None;
    for v in evict {
        let r = n.resident(v.as_str()).expect("victims are residents");
        assert!(permitted(n, target, now, r), "victim {v} is not permitted");
        if !conflicting.contains(v) {
            let key = (r.last_used, r.seq);
            assert!(last_lru.is_none_or(|l| l < key), "victims out of LRU order");
            last_lru = Some(key);
            let helps = targets
                .iter()
                .any(|p| excess.get(p).is_some_and(|e| *e > 0) && r.charge(p).counted() > 0);
            assert!(helps, "victim {v} helps no short pool");
        }
        for (p, e) in excess.iter_mut() {
            *e -= i128::from(r.charge(p).counted());
        }
    }
    for p in targets.iter().chain(&grown) {
        let e = excess.get(p).copied().unwrap_or(0);
        assert!(e <= 0, "the moves leave pool {p} short: {excess:?}");
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn the_ledger_keeps_its_promises(w in world(), ops in proptest::collection::vec(op(), 1..60)) {
        let mut n = build(&w);
        let mut now = 0u64;
        // Residents waking (the rest of the moving ones fall asleep).
        let mut waking = std::collections::BTreeSet::new();
        for op in ops {
            match op {
                Op::Start { id: i, workload, evict } => {
                    let target = Arc::new(w.specs[workload].clone());
                    let policy = if evict { Policy::Evict } else { Policy::Refuse };
                    let iid = id(&format!("i{i}"));
                    let before = snapshot(&n);
                    let planned = n.plan(&iid, &target, policy, now);
                    let could_fit = fits_after_all_evictions(&n, &target, now);
                    let pre = n.clone();
                    match n.admit(&iid, Entry::Start(target.clone()), policy, now) {
                        Err(AdmitError::Refused(refusal)) => {
                            prop_assert_eq!(snapshot(&n), before, "a refusal changes nothing");
                            prop_assert!(matches!(planned, Ok(Plan::Refuse(_))));
                            if evict {
                                prop_assert!(!could_fit, "refused although evicting every permitted candidate fits");
                            }
                            // Every choice's reasons are in the refusal.
                            for choice in target.choices() {
                                if let Ok(Plan::Refuse(one)) = pre.plan(&iid, &target.concrete(&choice), policy, now) {
                                    for r in one.reasons() {
                                        prop_assert!(refusal.reasons().contains(r), "choice {:?}: {} missing", choice, r);
                                    }
                                }
                            }
                        }
                        Err(AdmitError::Invalid(_)) => prop_assert_eq!(snapshot(&n), before),
                        Ok(a) if a.created => {
                            prop_assert!(could_fit || !evict, "admitted what cannot fit");
                            if !evict { prop_assert!(a.evict.is_empty() && a.sleep.is_empty()); }
                            if !a.evict.is_empty() || !a.sleep.is_empty() {
                                // No choice fitted without eviction.
                                prop_assert!(matches!(pre.plan(&iid, &target, Policy::Refuse, now), Ok(Plan::Refuse(_))), "evicted although a choice fits as things stand");
                            }
                            // The choice: one list per any-of demand, `count`
                            // distinct candidates each.
                            prop_assert_eq!(a.chosen.len(), target.any_of.len());
                            for (any, pools) in target.any_of.iter().zip(&a.chosen) {
                                prop_assert_eq!(pools.len(), any.count);
                                prop_assert!(pools.iter().all(|p| any.candidates.contains(p)));
                                prop_assert!(pools.windows(2).all(|w| w[0] < w[1]), "distinct, in order");
                            }
                            let target = Arc::new(target.concrete(&a.chosen));
                            prop_assert_eq!(&n.resident(iid.as_str()).expect("admitted").spec, &target, "the resident holds the concrete spec");
                            check_moves(&pre, &target, now, &a.sleep, &a.evict);
                            for s in &a.sleep {
                                prop_assert_eq!(n.resident(s.as_str()).expect("sleeper").tier, Tier::Moving);
                            }
                            // A reading may shrink under residents; an admission
                            // never takes a pool it draws on past its budget,
                            // once its sleepers sleep.
                            for p in POOLS.iter().filter(|p| target.footprint(p) > 0) {
                                let committed = committed(&n, &pre, &a.sleep, p);
                                if let Some(eff) = n.effective_budget(p) {
                                    prop_assert!(committed <= eff, "pool {} holds {} of {}", p, committed, eff);
                                }
                            }
                        }
                        Ok(_) => prop_assert!(matches!(planned, Ok(Plan::Existing))),
                    }
                }
                Op::Release { id: i } => { n.release(&format!("i{i}")); waking.remove(&format!("i{i}")); }
                Op::Touch { id: i, hold } => { n.touch(&format!("i{i}"), now, hold); }
                Op::Measure { id: i, pool: p, gb } => { n.set_measured(&format!("i{i}"), &pool(POOLS[p]), gb * GB); }
                Op::Reading { pool: p, gb } => { n.set_available(POOLS[p], gb.map(|g| g * GB)); }
                Op::Tick { ms } => now += ms,
                Op::Settle { id: i } => {
                    let name = format!("i{i}");
                    if n.resident(&name).is_some_and(|r| r.tier == Tier::Moving) {
                        let to = if waking.remove(&name) { Tier::Awake } else { Tier::Asleep };
                        assert!(n.settle(&name, to), "a move settles either way");
                    }
                }
                Op::Wake { id: i, evict } => {
                    let iid = id(&format!("i{i}"));
                    let policy = if evict { Policy::Evict } else { Policy::Refuse };
                    let before = snapshot(&n);
                    let asleep = n.resident(iid.as_str()).is_some_and(|r| r.tier == Tier::Asleep);
                    let pre = n.clone();
                    match n.admit(&iid, Entry::Wake, policy, now) {
                        Err(AdmitError::Refused(_)) | Err(AdmitError::Invalid(_)) => {
                            prop_assert_eq!(snapshot(&n), before, "a refused wake changes nothing");
                        }
                        Ok(a) if asleep => {
                            prop_assert!(!a.created);
                            if !evict { prop_assert!(a.evict.is_empty() && a.sleep.is_empty()); }
                            prop_assert!(!a.sleep.contains(&iid) && !a.evict.contains(&iid), "a wake never moves itself");
                            let r = pre.resident(iid.as_str()).expect("asleep");
                            let mut without = pre.clone();
                            without.release(iid.as_str());
                            check_moves(&without, &r.spec, now, &a.sleep, &a.evict);
                            prop_assert_eq!(n.resident(iid.as_str()).expect("waking").tier, Tier::Moving);
                            // It holds both its demands until its call is
                            // done, and its sleepers their asleep ones once
                            // asleep: no pool that was within its budget is
                            // taken past it (a sleeper's weights moving into
                            // host memory beside the waking one's among them).
                            for p in POOLS {
                                let Some(eff) = n.effective_budget(p) else { continue };
                                if pre.used(p) > eff {
                                    continue;
                                }
                                let committed = committed(&n, &pre, &a.sleep, p);
                                prop_assert!(committed <= eff, "waking {}: pool {} holds {} of {}", iid, p, committed, eff);
                            }
                            waking.insert(iid.to_string());
                        }
                        Ok(a) => prop_assert!(a.evict.is_empty() && a.sleep.is_empty(), "waking an awake resident moves nothing"),
                    }
                }
            }
            check_pools(&n);
        }
    }
}

/// The figures every `Place` and `Node` answer carries (`pools()`, one
/// pass over the residents) against each pool summed on its own.
fn check_pools(n: &NodeState) {
    let figures = n.pools();
    let names: Vec<&str> = figures.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, POOLS, "every configured pool, in name order");
    for f in &figures {
        let p = f.name.as_str();
        let used = n
            .residents()
            .map(|r| r.charge(p).counted())
            .fold(0, u64::saturating_add);
        assert_eq!(f.used, used, "pool {p}: used");
        assert_eq!(f.effective, n.effective_budget(p), "pool {p}: effective");
        assert_eq!(
            f.free,
            f.effective.map(|e| e.saturating_sub(used)),
            "pool {p}: free"
        );
    }
}
