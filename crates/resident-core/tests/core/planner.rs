//! Planner tables: the reference planner's budget and live-ceiling cases,
//! group rules, multi-pool demands, priorities and holds.

use std::sync::Arc;

use crate::support::*;
use resident_core::{Entry, GB, GroupPolicy, NodeState, Plan, Policy, Reason, Spec};

/// Renders a plan compactly: `admit []`, `admit [a, b]`, `refuse OVER_BUDGET`.
fn show(plan: &Plan) -> String {
    match plan {
        Plan::Existing => "existing".into(),
        Plan::Admit { evict, .. } => format!("admit [{}]", ids(evict).join(", ")),
        Plan::Refuse(r) => {
            let codes: Vec<_> = r.reasons().iter().map(Reason::code).collect();
            format!("refuse {}", codes.join(","))
        }
    }
}

/// Residents are admitted in the order given, so the first is the least
/// recently used. Returns the plan for `target` as instance "t".
fn plan(n: &NodeState, target: Spec, policy: Policy) -> Plan {
    n.plan(&id("t"), &target, policy, 100)
        .expect("a valid request")
}

/// One pool "unified" of `budget` GB, a live ceiling of `ceiling` GB (the
/// probe shows it available while residents have touched nothing yet).
fn one_pool(budget: u64, ceiling: Option<u64>, residents: &[(&str, u64)]) -> NodeState {
    let pool = match ceiling {
        Some(_) => live_pool("unified", Some(budget), 0),
        None => static_pool("unified", Some(budget)),
    };
    let pins = group(
        "pins",
        &["pin"],
        GroupPolicy {
            persistent: true,
            ..Default::default()
        },
    );
    let mut n = node(vec![pool], vec![pins]);
    for (i, (name, gb)) in residents.iter().enumerate() {
        put(&mut n, name, unified(name, *gb), i as u64);
    }
    if let Some(c) = ceiling {
        n.set_available("unified", Some(c * GB));
    }
    n
}

#[test]
fn reference_budget_and_live_ceiling_cases() {
    // (budget, ceiling, residents LRU first, target, under evict, under refuse)
    #[rustfmt::skip]
    type Row<'a> = (u64, Option<u64>, &'a [(&'a str, u64)], (&'a str, u64), &'a str, &'a str);
    let rows: &[Row] = &[
        (
            24,
            None,
            &[("a", 6), ("b", 5)],
            ("c", 4),
            "admit []",
            "admit []",
        ),
        (
            12,
            None,
            &[("a", 5), ("b", 5)],
            ("c", 5),
            "admit [a]",
            "refuse OVER_BUDGET",
        ),
        (
            8,
            None,
            &[("a", 4), ("b", 4)],
            ("big", 10),
            "refuse OVER_BUDGET",
            "refuse OVER_BUDGET",
        ),
        (
            12,
            None,
            &[("pin", 4), ("a", 5)],
            ("c", 5),
            "admit [a]",
            "refuse OVER_BUDGET",
        ),
        (
            24,
            Some(10),
            &[("a", 6), ("b", 5)],
            ("c", 4),
            "admit [a]",
            "refuse HOST_MEMORY",
        ),
        (
            12,
            Some(48),
            &[("a", 5), ("b", 5)],
            ("c", 5),
            "admit [a]",
            "refuse OVER_BUDGET",
        ),
        (
            24,
            Some(1),
            &[("a", 6), ("b", 5)],
            ("c", 4),
            "refuse HOST_MEMORY",
            "refuse HOST_MEMORY",
        ),
    ];
    for (budget, ceiling, residents, (target, gb), evict, refuse) in rows {
        let n = one_pool(*budget, *ceiling, residents);
        let row = format!("budget {budget} ceiling {ceiling:?} residents {residents:?}");
        assert_eq!(
            show(&plan(&n, unified(target, *gb), Policy::Evict)),
            *evict,
            "{row}"
        );
        let refused = plan(&n, unified(target, *gb), Policy::Refuse);
        assert_eq!(show(&refused), *refuse, "{row}");
        if let Plan::Refuse(r) = refused {
            // Every refusal names the holders of the pool.
            let text = r.to_string();
            for (name, gb) in *residents {
                let holder = format!("{name} {gb}.0 GB");
                assert!(text.contains(&holder), "{row}: {text} lacks {holder}");
            }
        }
    }
}

#[test]
fn the_live_ceiling_reason_carries_the_reading() {
    let mut n = node(vec![live_pool("gpu0", Some(24), 1)], vec![]);
    // A foreign process holds 8 GB of the 24 GB card: 16 GB available.
    n.set_available("gpu0", Some(16 * GB));
    let fits = spec("m", &[("gpu0", 15)]);
    assert_eq!(
        show(&n.plan(&id("t"), &fits, Policy::Refuse, 0).expect("valid")),
        "admit []"
    );
    assert_eq!(n.effective_budget("gpu0"), Some(15 * GB));
    let Plan::Refuse(r) = n
        .plan(&id("t"), &spec("m", &[("gpu0", 16)]), Policy::Refuse, 0)
        .expect("valid")
    else {
        panic!("16 GB cannot fit in 15 GB");
    };
    assert_eq!(
        r.first(),
        &Reason::HostMemory {
            role: resident_core::Role::new("m").expect("valid"),
            pool: pool("gpu0"),
            need: 16 * GB,
            available: 16 * GB,
            reserve: GB,
            pending: 0,
            holders: vec![],
        }
    );
    assert_eq!(
        r.first().to_string(),
        "unplaceable: 'm' needs 16.0 GB but the live 'gpu0' pool has only 15.0 GB free (16.0 GB available, less 1.0 GB reserve, less 0.0 GB declared but not yet in use; held by nothing)"
    );
    // The foreign process exits: the configured budget comes back, no more.
    n.set_available("gpu0", Some(24 * GB));
    assert_eq!(n.effective_budget("gpu0"), Some(23 * GB));
    n.set_available("gpu0", Some(100 * GB));
    assert_eq!(n.effective_budget("gpu0"), Some(24 * GB));
    // No reading: the configured budget stands.
    n.set_available("gpu0", None);
    assert_eq!(n.effective_budget("gpu0"), Some(24 * GB));
}

#[test]
fn residents_memory_not_yet_touched_is_pending() {
    let mut n = node(vec![live_pool("ram", None, 2)], vec![]);
    n.set_available("ram", Some(20 * GB));
    put(&mut n, "a", spec("a", &[("ram", 10)]), 0);
    // a has touched 4 of its 10 GB: 16 GB show available, 6 GB are pending.
    n.set_measured("a", &pool("ram"), 4 * GB);
    n.set_available("ram", Some(16 * GB));
    // Free for a newcomer: 16 - 2 reserve - 6 pending = 8 GB.
    let at = |gb| {
        show(
            &n.plan(&id("t"), &spec("t", &[("ram", gb)]), Policy::Refuse, 0)
                .expect("valid"),
        )
    };
    assert_eq!(at(8), "admit []");
    assert_eq!(at(9), "refuse HOST_MEMORY");
    // Measured beyond the declaration is held, counted as such, and not
    // handed out again: 0 available + 30 measured - 2 reserve = 28 GB
    // effective, all of it used.
    n.set_measured("a", &pool("ram"), 30 * GB);
    n.set_available("ram", Some(0));
    assert_eq!(n.effective_budget("ram"), Some(28 * GB));
    assert_eq!(n.used("ram"), 30 * GB);
    assert_eq!(n.pools()[0].free, Some(0));
    let plan = n.plan(&id("t"), &spec("t", &[("ram", 1)]), Policy::Refuse, 0);
    assert_eq!(show(&plan.expect("valid")), "refuse HOST_MEMORY");
}

fn groups_node(policies: &[(&str, &[&str], GroupPolicy)]) -> NodeState {
    let defs = policies.iter().map(|(g, m, p)| group(g, m, *p)).collect();
    node(vec![static_pool("unified", Some(100))], defs)
}

const SWAP: GroupPolicy = GroupPolicy {
    swap: true,
    exclusive: false,
    persistent: false,
};
const SHARE: GroupPolicy = GroupPolicy {
    swap: false,
    exclusive: false,
    persistent: false,
};
const EXCLUSIVE: GroupPolicy = GroupPolicy {
    swap: false,
    exclusive: true,
    persistent: false,
};
const PERSISTENT: GroupPolicy = GroupPolicy {
    swap: false,
    exclusive: false,
    persistent: true,
};

#[test]
fn group_rules() {
    // (groups, resident, target, under evict, under refuse)
    type Row<'a> = (
        &'a [(&'a str, &'a [&'a str], GroupPolicy)],
        &'a str,
        &'a str,
        &'a str,
        &'a str,
    );
    #[rustfmt::skip]
    let rows: &[Row] = &[
        (&[("g", &["x", "y"], SWAP)], "x", "y", "admit [x]", "refuse GROUP_CONFLICT"),
        (&[("g", &["x", "y"], SHARE)], "x", "y", "admit []", "admit []"),
        // Exclusive holds in both directions.
        (&[("e", &["x"], EXCLUSIVE), ("o", &["y"], SHARE)], "x", "y", "admit [x]", "refuse GROUP_CONFLICT"),
        (&[("e", &["x"], EXCLUSIVE), ("o", &["y"], SHARE)], "y", "x", "admit [y]", "refuse GROUP_CONFLICT"),
        // Members of one exclusive group share it.
        (&[("e", &["x", "y"], EXCLUSIVE)], "x", "y", "admit []", "admit []"),
        // Persistent groups are outside exclusivity.
        (&[("e", &["x"], EXCLUSIVE), ("p", &["y"], PERSISTENT)], "y", "x", "admit []", "admit []"),
        (&[("e", &["x"], EXCLUSIVE), ("p", &["y"], PERSISTENT)], "x", "y", "admit []", "admit []"),
        // Ungrouped workloads are not members of another group.
        (&[("e", &["x"], EXCLUSIVE)], "x", "y", "admit []", "admit []"),
        // A persistent swap sibling cannot be evicted: refused, nothing evicted.
        (&[("g", &["x", "y"], GroupPolicy { swap: true, persistent: true, exclusive: false })], "x", "y",
            "refuse GROUP_CONFLICT", "refuse GROUP_CONFLICT"),
    ];
    for (groups, resident, target, evict, refuse) in rows {
        let mut n = groups_node(groups);
        put_unchecked(&mut n, resident);
        let row = format!("groups {groups:?}: {target} beside {resident}");
        assert_eq!(
            show(&plan(&n, unified(target, 1), Policy::Evict)),
            *evict,
            "{row}"
        );
        assert_eq!(
            show(&plan(&n, unified(target, 1), Policy::Refuse)),
            *refuse,
            "{row}"
        );
    }
}

fn put_unchecked(n: &mut NodeState, name: &str) {
    put(n, name, unified(name, 1), 0);
}

#[test]
fn persistent_members_are_never_victims_but_count_against_the_budget() {
    let mut n = node(
        vec![static_pool("unified", Some(10))],
        vec![group("p", &["pin"], PERSISTENT)],
    );
    put(&mut n, "pin", unified("pin", 8), 0);
    assert_eq!(
        show(&plan(&n, unified("t", 3), Policy::Evict)),
        "refuse OVER_BUDGET"
    );
    assert_eq!(show(&plan(&n, unified("t", 2), Policy::Evict)), "admit []");
}

#[test]
fn a_workload_in_two_groups_is_an_error() {
    let err = resident_core::Groups::new([group("a", &["x"], SWAP), group("b", &["x"], SHARE)])
        .expect_err("x is in two groups");
    assert_eq!(
        err.to_string(),
        "workload 'x' is a member of both group 'a' and group 'b'"
    );
}

#[test]
fn a_target_needing_two_pools_is_refused_if_either_is_short() {
    let pools = vec![static_pool("ram", Some(10)), static_pool("gpu0", Some(10))];
    let mut n = node(pools, vec![]);
    put(&mut n, "cpu-old", spec("cpu-old", &[("ram", 6)]), 0);
    put(&mut n, "gpu-old", spec("gpu-old", &[("gpu0", 6)]), 1);
    put(&mut n, "gpu-new", spec("gpu-new", &[("gpu0", 3)]), 2);
    let target = spec("t", &[("ram", 2), ("gpu0", 5)]);
    // ram fits (6 + 2 <= 10); gpu0 is short by 4: only gpu0 residents help,
    // and the least-recently-used of them is enough. cpu-old is older but
    // freeing it helps no short pool.
    assert_eq!(
        show(&plan(&n, target.clone(), Policy::Evict)),
        "admit [gpu-old]"
    );
    assert_eq!(
        show(&plan(&n, target, Policy::Refuse)),
        "refuse OVER_BUDGET"
    );
    // Short in both pools: a victim in each.
    let both = spec("t", &[("ram", 5), ("gpu0", 5)]);
    assert_eq!(
        show(&plan(&n, both, Policy::Evict)),
        "admit [cpu-old, gpu-old]"
    );
    // Too big for one pool even after every eviction: nothing is evicted.
    let huge = spec("t", &[("ram", 1), ("gpu0", 11)]);
    assert_eq!(show(&plan(&n, huge, Policy::Evict)), "refuse OVER_BUDGET");
}

#[test]
fn priority_and_holds_protect_residents() {
    let mut n = one_pool(10, None, &[]);
    let mut important = unified("important", 5);
    important.priority = 10;
    put(&mut n, "important", important, 0);
    put(&mut n, "held", unified("held", 3), 1);
    put(&mut n, "plain", unified("plain", 2), 2);
    assert!(n.touch("held", 50, 100));
    // At t=100 the hold (until 150) stands; only "plain" may go: not enough.
    assert_eq!(
        show(&plan(&n, unified("t", 4), Policy::Evict)),
        "refuse OVER_BUDGET"
    );
    assert_eq!(
        show(&plan(&n, unified("t", 2), Policy::Evict)),
        "admit [plain]"
    );
    // After the hold lapses "held" is a candidate again; the touch at t=50
    // made it more recently used than "plain".
    let later = n
        .plan(&id("t"), &unified("t", 4), Policy::Evict, 150)
        .expect("valid");
    assert_eq!(show(&later), "admit [plain, held]");
    // So the refusal at t=100 is temporary: only the hold stands in the
    // way. One that no eviction could fix, or one under refuse, is not.
    let temporary = |n: &NodeState, gb: u64, policy: Policy| match plan(n, unified("t", gb), policy)
    {
        Plan::Refuse(r) => r.temporary(),
        other => panic!("refused: {other:?}"),
    };
    assert!(temporary(&n, 4, Policy::Evict), "blocked by the hold alone");
    assert!(
        !temporary(&n, 9, Policy::Evict),
        "does not fit even with the hold lapsed"
    );
    assert!(
        !temporary(&n, 4, Policy::Refuse),
        "refuse evicts nothing, held or not"
    );
    // An equal or higher-priority target may evict "important" (held still
    // stands at t=100, so 7 GB is the most that can be freed).
    let mut boss = unified("boss", 7);
    boss.priority = 10;
    assert_eq!(
        show(&plan(&n, boss, Policy::Evict)),
        "admit [important, plain]"
    );
}

#[test]
fn evicting_marks_victims_that_keep_their_memory_until_released() {
    let mut n = one_pool(10, None, &[("a", 5), ("b", 5)]);
    let got = n
        .admit(
            &id("c"),
            Entry::Start(Arc::new(unified("c", 5))),
            Policy::Evict,
            100,
        )
        .expect("fits");
    assert_eq!(ids(&got.evict), ["a"]);
    assert!(n.resident("a").is_some_and(|r| r.leaving()));
    assert_eq!(
        n.used("unified"),
        15 * GB,
        "the victim holds its memory until it has exited"
    );
    // Another start meanwhile cannot count on a's memory (15 GB are held
    // of 10 GB until a has exited), nor evict a again: it takes b and c.
    assert_eq!(
        show(&plan(&n, unified("d", 5), Policy::Evict)),
        "admit [b, c]"
    );
    n.release("a");
    assert_eq!(n.used("unified"), 10 * GB);
    // A start of an id that is on its way out is told so.
    n.admit(
        &id("c2"),
        Entry::Start(Arc::new(unified("c2", 5))),
        Policy::Evict,
        101,
    )
    .expect("evicts b");
    let again = n.plan(&id("b"), &unified("b", 5), Policy::Evict, 102);
    assert!(
        matches!(again, Err(resident_core::PlanError::Evicting { .. })),
        "{again:?}"
    );
}

#[test]
fn conflicts_with_an_instance_already_leaving_wait_for_it() {
    let mut n = groups_node(&[("g", &["x", "y", "z"], SWAP)]);
    put_unchecked(&mut n, "x");
    let y = n
        .admit(
            &id("y"),
            Entry::Start(Arc::new(unified("y", 1))),
            Policy::Evict,
            1,
        )
        .expect("evicts x");
    assert_eq!(ids(&y.evict), ["x"]);
    // z conflicts with x (leaving: wait for it) and y (evict it).
    let Plan::Admit {
        evict, wait_for, ..
    } = plan(&n, unified("z", 1), Policy::Evict)
    else {
        panic!("z fits once y goes");
    };
    assert_eq!((ids(&evict), ids(&wait_for)), (vec!["y"], vec!["x"]));
}

#[test]
fn a_demand_on_an_unknown_pool_is_an_error() {
    let n = one_pool(10, None, &[]);
    let err = n
        .plan(&id("t"), &spec("t", &[("gpu9", 1)]), Policy::Refuse, 0)
        .expect_err("no gpu9");
    assert_eq!(
        err.to_string(),
        "workload 't' asks for memory in pool 'gpu9', which this node does not have"
    );
}

#[test]
fn a_victim_a_later_one_made_needless_is_spared() {
    // The serve trace's thrash: a small model used least recently, then a
    // large one; a start needing the large one's room took both (the small
    // first, still short, then the large), though the large alone was
    // enough. Only the large goes now.
    let mut n = one_pool(10, None, &[]);
    put(&mut n, "small", unified("small", 1), 0);
    put(&mut n, "large", unified("large", 5), 1);
    put(&mut n, "recent", unified("recent", 3), 2);
    assert_eq!(
        show(&plan(&n, unified("t", 5), Policy::Evict)),
        "admit [large]"
    );
    // When the large alone is not enough (9 held of 10, 7 wanted), the
    // small goes with it.
    assert_eq!(
        show(&plan(&n, unified("t", 7), Policy::Evict)),
        "admit [small, large]"
    );
}
