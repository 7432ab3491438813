//! Waking in the ledger: a wake is planned for what it adds beside what
//! the sleeper holds asleep, which stays counted until its call is done.

use resident_core::{Asleep, Demand, GB, NodeState, Plan, Policy, Spec, Tier};

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
    assert!(n.set_tier("a", Tier::Asleep));
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
    let woken = n.wake(&id("a"), Policy::Evict, 3).expect("admitted");
    assert_eq!(ids(&woken.sleep), Vec::<&str>::new(), "{woken:?}");
    assert_eq!(ids(&woken.evict), ["b"]);
    // `a` holds both demands while it wakes: its weights in host memory
    // and its awake demand on the GPU; `b` holds the GPU until it exits.
    assert_eq!(n.used("ram"), 3 * GB);
    n.release("b");
    assert!(n.set_tier("a", Tier::Awake));
    assert_eq!((n.used("gpu"), n.used("ram")), (3 * GB, 0));
}

/// With room in host memory for both, the same wake puts `b` to sleep
/// rather than evicting it, and under refuse is refused, naming `b`.
#[test]
fn a_swap_with_room_for_both_weights_puts_the_other_to_sleep() {
    let mut n = a_asleep_b_awake(8);
    let refused = n.plan_wake(&id("a"), Policy::Refuse, 3).expect("planned");
    let Plan::Refuse(refusal) = refused else {
        panic!("a wake with no room on the GPU: {refused:?}");
    };
    assert!(format!("{refusal:?}").contains("\"b\""), "{refusal:?}");
    let woken = n.wake(&id("a"), Policy::Evict, 3).expect("admitted");
    assert_eq!((ids(&woken.sleep), ids(&woken.evict)), (vec!["b"], vec![]));
    assert!(n.set_tier("b", Tier::Asleep));
    assert!(n.set_tier("a", Tier::Awake));
    assert_eq!((n.used("gpu"), n.used("ram")), (3 * GB, 3 * GB));
}
