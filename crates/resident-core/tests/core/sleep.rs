//! Waking in the ledger: a wake is planned for what it adds beside what
//! the sleeper holds asleep, which stays counted until its call is done.

use resident_core::{
    AdmitError, Asleep, Demand, Entry, GB, NodeState, Plan, Policy, Reason, Spec, Tier,
};

use crate::support::*;

/// A vLLM server in sleep mode level 1: 3 GB of `gpu` awake; asleep, its
/// weights in host memory (3 GB of `ram`).
fn level_one(name: &str) -> Spec {
    let mut s = spec(name, &[("gpu", 3)]);
    let weights = Demand {
        weights: 3 * GB,
        ..Demand::default()
    };
    s.asleep = Some(Asleep {
        demand: [(pool("ram"), weights)].into(),
        ..Asleep::default()
    });
    s
}

/// `gpu` 4 GB and `ram` of `ram_gb`; `a` asleep (its weights in `ram`),
/// `b` awake on `gpu`.
fn a_asleep_b_awake(ram_gb: u64) -> NodeState {
    let mut n = node(
        vec![
            static_pool("gpu", Some(4)),
            static_pool("ram", Some(ram_gb)),
        ],
        vec![],
    );
    put(&mut n, "a", level_one("a"), 1);
    asleep(&mut n, "a", 1);
    put(&mut n, "b", level_one("b"), 2);
    assert_eq!((n.used("gpu"), n.used("ram")), (3 * GB, 3 * GB));
    n
}

/// Host memory holds one model's weights, not two: waking `a` cannot put
/// `b` to sleep (its weights would join `a`'s, still there until `a` is
/// awake), so `b` is evicted, and no pool is ever over its budget.
#[test]
fn a_swap_puts_no_second_weights_in_host_memory_that_has_room_for_one() {
    let mut n = a_asleep_b_awake(4);
    let woken = n
        .admit(&id("a"), Entry::Wake, Policy::Evict, 3)
        .expect("admitted");
    assert_eq!(ids(&woken.sleep), Vec::<&str>::new(), "{woken:?}");
    assert_eq!(ids(&woken.evict), ["b"]);
    // `a` holds both demands while it wakes: its weights in host memory
    // and its awake demand on the GPU; `b` holds the GPU until it exits.
    assert_eq!(n.used("ram"), 3 * GB);
    n.release("b");
    assert!(n.settle("a", Tier::Awake));
    assert_eq!((n.used("gpu"), n.used("ram")), (3 * GB, 0));
}

/// With room in host memory for both, the same wake puts `b` to sleep
/// rather than evicting it, and under refuse is refused, naming `b`.
#[test]
fn a_swap_with_room_for_both_weights_puts_the_other_to_sleep() {
    let mut n = a_asleep_b_awake(8);
    let refused = n
        .plan_entry(&id("a"), &Entry::Wake, Policy::Refuse, 3)
        .expect("planned");
    let Plan::Refuse(refusal) = refused else {
        panic!("a wake with no room on the GPU: {refused:?}");
    };
    assert!(format!("{refusal:?}").contains("\"b\""), "{refusal:?}");
    let woken = n
        .admit(&id("a"), Entry::Wake, Policy::Evict, 3)
        .expect("admitted");
    assert_eq!((ids(&woken.sleep), ids(&woken.evict)), (vec!["b"], vec![]));
    assert!(n.settle("b", Tier::Asleep));
    assert!(n.settle("a", Tier::Awake));
    assert_eq!((n.used("gpu"), n.used("ram")), (3 * GB, 3 * GB));
}

/// Two level-1 servers on a GPU of 8 GB whose host memory holds one
/// model's weights: the first falls asleep (its weights into `ram`), the
/// second is refused, naming the first as the holder, and nothing moves;
/// `ram` never holds more than its budget. Before the sleep went through
/// the planner, both fell asleep and `ram` held 6 GB of 4.
#[test]
fn a_sleep_whose_weights_do_not_fit_in_host_memory_is_refused() {
    let mut n = node(
        vec![static_pool("gpu", Some(8)), static_pool("ram", Some(4))],
        vec![],
    );
    put(&mut n, "a", level_one("a"), 1);
    put(&mut n, "b", level_one("b"), 2);
    asleep(&mut n, "a", 3);
    assert_eq!((n.used("gpu"), n.used("ram")), (3 * GB, 3 * GB));
    let before = format!("{:?}", n.residents().collect::<Vec<_>>());
    let refused = n.admit(&id("b"), Entry::Sleep, Policy::Refuse, 4);
    let Err(AdmitError::Refused(refusal)) = refused else {
        panic!("two models' weights in host memory for one: {refused:?}");
    };
    let Reason::OverBudget { pool, holders, .. } = refusal.first() else {
        panic!("not a budget reason: {refusal}");
    };
    assert_eq!(pool.as_str(), "ram");
    assert_eq!(
        holders
            .iter()
            .map(|h| h.instance_id.as_str())
            .collect::<Vec<_>>(),
        ["a"]
    );
    let after = format!("{:?}", n.residents().collect::<Vec<_>>());
    assert_eq!(before, after, "a refused sleep changes nothing");
    // Under evict it may make room as a start would: `a` asleep is the
    // least recently used, and goes.
    let slept = n
        .admit(&id("b"), Entry::Sleep, Policy::Evict, 5)
        .expect("room made");
    assert_eq!(ids(&slept.evict), ["a"]);
    assert!(n.settle("b", Tier::Asleep));
    n.release("a");
    assert_eq!((n.used("gpu"), n.used("ram")), (0, 3 * GB));
}

/// A wake kept out only by a held resident is refused as temporary (the
/// router waits for the hold to end), as a start would be; one that could
/// never fit is not.
#[test]
fn a_wake_refused_only_for_a_hold_is_temporary() {
    let mut n = a_asleep_b_awake(4);
    assert!(n.touch("b", 3, 1_000));
    let refused = n.admit(&id("a"), Entry::Wake, Policy::Evict, 4);
    let Err(AdmitError::Refused(refusal)) = refused else {
        panic!("b is held: {refused:?}");
    };
    assert!(refusal.temporary(), "{refusal}");
    let refused = n.admit(&id("a"), Entry::Wake, Policy::Refuse, 4);
    let Err(AdmitError::Refused(refusal)) = refused else {
        panic!("refuse never evicts: {refused:?}");
    };
    assert!(
        !refusal.temporary(),
        "under refuse, waiting changes nothing"
    );
    // Once the hold has lapsed, the same wake is admitted.
    let woken = n
        .admit(&id("a"), Entry::Wake, Policy::Evict, 1_004)
        .expect("admitted");
    assert_eq!(ids(&woken.evict), ["b"]);
}

/// `settle` only lowers: a sleeper cannot be made awake again without a
/// planned wake, nor an awake one asleep where that raises a pool.
#[test]
fn settle_never_raises_a_charge() {
    let mut n = a_asleep_b_awake(8);
    assert!(
        !n.settle("a", Tier::Awake),
        "a wake is planned, not settled"
    );
    assert!(
        !n.settle("b", Tier::Asleep),
        "its weights would enter ram unplanned"
    );
    assert!(!n.settle("b", Tier::Moving));
    assert_eq!((n.used("gpu"), n.used("ram")), (3 * GB, 3 * GB));
}
