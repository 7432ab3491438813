//! Any-of and N-of demands: which pools the planner chooses under binpack
//! and spread, eviction only when no choice fits as things stand, and a
//! refusal that gives every candidate's reasons.

use std::sync::Arc;

use crate::support::*;
use resident_core::{AnyOf, Demand, Entry, GB, GpuChoice, NodeState, Plan, Policy, Reason, Spec};

/// A spec asking `gb` on any `count` of `candidates`.
fn any(name: &str, candidates: &[&str], count: usize, gb: u64) -> Spec {
    let mut s = spec(name, &[]);
    s.any_of.push(AnyOf {
        label: "gpu".into(),
        candidates: candidates.iter().map(|c| pool(c)).collect(),
        count,
        demand: Demand {
            weights: gb * GB,
            kv: 0,
            ..Default::default()
        },
    });
    s
}

/// Four GPUs of 24 GB; `residents` are (name, pool, GB), admitted in order.
fn gpus(choice: GpuChoice, residents: &[(&str, &str, u64)]) -> NodeState {
    let pools = ["gpu0", "gpu1", "gpu2", "gpu3"]
        .map(|p| static_pool(p, Some(24)))
        .to_vec();
    let mut n = node(pools, vec![]);
    n.set_gpu_choice(choice);
    for (i, (name, p, gb)) in residents.iter().enumerate() {
        put(&mut n, name, spec(name, &[(p, *gb)]), i as u64);
    }
    n
}

/// The plan as `admit [victims] on pools` or `refuse CODE@pool,...`.
fn show(plan: &Plan) -> String {
    match plan {
        Plan::Existing => "existing".into(),
        Plan::Admit { evict, chosen, .. } => {
            let pools: Vec<&str> = chosen.iter().flatten().map(|p| p.as_str()).collect();
            format!("admit [{}] on {}", ids(evict).join(", "), pools.join("+"))
        }
        Plan::Refuse(r) => {
            let codes: Vec<String> = r
                .reasons()
                .iter()
                .map(|x| match x.pool() {
                    Some(p) => format!("{}@{p}", x.code()),
                    None => x.code().to_string(),
                })
                .collect();
            format!("refuse {}", codes.join(","))
        }
    }
}

#[test]
fn binpack_and_spread_choose_as_they_say_and_names_break_ties() {
    const ALL: &[&str] = &["gpu0", "gpu1", "gpu2", "gpu3"];
    // (strategy, residents, target: candidates, count, GB, policy, plan)
    type Row<'a> = (
        GpuChoice,
        &'a [(&'a str, &'a str, u64)],
        &'a [&'a str],
        usize,
        u64,
        Policy,
        &'a str,
    );
    use GpuChoice::{Binpack, Spread};
    use Policy::{Evict, Refuse};
    #[rustfmt::skip]
    let rows: &[Row] = &[
        // An empty node: every pool alike, the first name wins.
        (Binpack, &[], ALL, 1, 8, Refuse, "admit [] on gpu0"),
        (Spread, &[], ALL, 1, 8, Refuse, "admit [] on gpu0"),
        // Binpack fills the fullest pool that still fits; spread the emptiest.
        (Binpack, &[("a", "gpu0", 10), ("b", "gpu1", 4)], ALL, 1, 8, Refuse, "admit [] on gpu0"),
        (Spread, &[("a", "gpu0", 10), ("b", "gpu1", 4)], ALL, 1, 8, Refuse, "admit [] on gpu2"),
        // The fullest pool does not fit: binpack takes the next fullest.
        (Binpack, &[("a", "gpu0", 20), ("b", "gpu1", 4)], ALL, 1, 8, Refuse, "admit [] on gpu1"),
        // Only the candidates are considered.
        (Spread, &[("a", "gpu2", 1)], &["gpu2", "gpu3"], 1, 8, Refuse, "admit [] on gpu3"),
        (Binpack, &[("a", "gpu2", 1)], &["gpu2", "gpu3"], 1, 8, Refuse, "admit [] on gpu2"),
        // N of the pools (tensor parallel): distinct pools, the pair with
        // the least room under binpack, the most under spread.
        (Binpack, &[("a", "gpu1", 8), ("b", "gpu3", 8)], ALL, 2, 12, Refuse, "admit [] on gpu1+gpu3"),
        (Spread, &[("a", "gpu1", 8), ("b", "gpu3", 8)], ALL, 2, 12, Refuse, "admit [] on gpu0+gpu2"),
        (Binpack, &[("a", "gpu1", 20)], ALL, 4, 5, Refuse, "refuse OVER_BUDGET@gpu1"),
        (Binpack, &[("a", "gpu1", 20)], ALL, 4, 4, Refuse, "admit [] on gpu0+gpu1+gpu2+gpu3"),
        // A choice that fits as things stand wins over one that evicts,
        // even where the evicting one is what binpack would like best.
        (Binpack, &[("a", "gpu0", 20), ("b", "gpu1", 20), ("c", "gpu2", 20)], ALL, 1, 8, Evict, "admit [] on gpu3"),
        // No choice fits without eviction: evict, on the best-ranked pool.
        (Binpack, &[("a", "gpu0", 20), ("b", "gpu1", 18), ("c", "gpu2", 20), ("d", "gpu3", 20)], ALL, 1, 8, Evict, "admit [a] on gpu0"),
        (Spread, &[("a", "gpu0", 20), ("b", "gpu1", 18), ("c", "gpu2", 20), ("d", "gpu3", 20)], ALL, 1, 8, Evict, "admit [b] on gpu1"),
        // Fits nowhere: refused with every candidate's reason, nothing evicted.
        (Binpack, &[("a", "gpu0", 20), ("b", "gpu1", 20)], &["gpu0", "gpu1"], 1, 8, Refuse, "refuse OVER_BUDGET@gpu0,OVER_BUDGET@gpu1"),
        (Binpack, &[("a", "gpu0", 20), ("b", "gpu1", 20)], &["gpu0", "gpu1"], 1, 30, Evict, "refuse OVER_BUDGET@gpu0,OVER_BUDGET@gpu1"),
    ];
    for (i, (choice, residents, candidates, count, gb, policy, want)) in rows.iter().enumerate() {
        let n = gpus(*choice, residents);
        let target = any("t", candidates, *count, *gb);
        let got = show(&n.plan(&id("t"), &target, *policy, 100).expect("valid"));
        assert_eq!(
            &got, want,
            "row {i}: {choice:?} {residents:?} -> {candidates:?}"
        );
    }
}

#[test]
fn admission_reserves_the_chosen_pools_and_says_which() {
    let mut n = gpus(GpuChoice::Spread, &[("a", "gpu0", 10)]);
    let target = Arc::new(any("t", &["gpu0", "gpu1"], 1, 8));
    let a = n
        .admit(&id("t"), Entry::Start(target.clone()), Policy::Refuse, 5)
        .expect("fits");
    assert!(a.created);
    assert_eq!(a.chosen, vec![vec![pool("gpu1")]]);
    let r = n.resident("t").expect("resident");
    assert!(r.spec.any_of.is_empty(), "the ledger holds a concrete spec");
    assert_eq!(r.footprint("gpu1"), 8 * GB);
    assert_eq!(n.used("gpu1"), 8 * GB);
    assert_eq!(n.used("gpu0"), 10 * GB);
    // A repeat of the same instance is idempotent and reserves nothing.
    let again = n
        .admit(&id("t"), Entry::Start(target), Policy::Refuse, 6)
        .expect("existing");
    assert!(!again.created && again.chosen.is_empty());
    assert_eq!(n.used("gpu1"), 8 * GB);
    // Released, the pool is free again.
    n.release("t");
    assert_eq!(n.used("gpu1"), 0);
}

#[test]
fn fixed_and_any_of_demands_combine() {
    // 4 GB of host memory always, plus 8 GB on one GPU.
    let mut n = gpus(GpuChoice::Binpack, &[]);
    n.reconfigure(
        [
            static_pool("gpu0", Some(24)),
            static_pool("gpu1", Some(24)),
            static_pool("ram", Some(6)),
        ],
        Default::default(),
    );
    let mut target = any("t", &["gpu0", "gpu1"], 1, 8);
    target.demand.insert(
        pool("ram"),
        resident_core::Demand {
            weights: 4 * GB,
            kv: 0,
            ..Default::default()
        },
    );
    let plan = n.plan(&id("t"), &target, Policy::Refuse, 0).expect("valid");
    assert_eq!(show(&plan), "admit [] on gpu0");
    // The fixed pool is short: every choice is refused for it, once.
    put(&mut n, "r", spec("r", &[("ram", 4)]), 0);
    let plan = n.plan(&id("t"), &target, Policy::Refuse, 0).expect("valid");
    assert_eq!(show(&plan), "refuse OVER_BUDGET@ram");
}

#[test]
fn a_refusal_is_temporary_when_a_hold_is_all_that_blocks_every_choice() {
    let mut n = gpus(GpuChoice::Binpack, &[("a", "gpu0", 20), ("b", "gpu1", 20)]);
    n.touch("a", 10, 1_000);
    n.touch("b", 10, 1_000);
    let target = any("t", &["gpu0", "gpu1"], 1, 8);
    let Plan::Refuse(r) = n.plan(&id("t"), &target, Policy::Evict, 20).expect("valid") else {
        panic!("both candidates are held");
    };
    assert!(r.temporary(), "{r}");
    assert!(r.reasons().iter().all(Reason::is_memory));
    // Once the holds lapse, the least recently used goes.
    let plan = n
        .plan(&id("t"), &target, Policy::Evict, 2_000)
        .expect("valid");
    assert_eq!(show(&plan), "admit [a] on gpu0");
}

#[test]
fn a_count_beyond_the_candidates_is_an_error_not_a_panic() {
    let n = gpus(GpuChoice::Binpack, &[]);
    for count in [0, 3] {
        let s = any("big", &["gpu0", "gpu1"], count, 4);
        let err = n
            .place(&s, Policy::Evict, 0)
            .expect_err("no choice can be made");
        assert!(
            matches!(err, resident_core::PlanError::AnyOfCount { count: c, candidates: 2, .. } if c == count),
            "{err}"
        );
        assert!(err.to_string().contains("give 1 to 2"), "{err}");
    }
}
