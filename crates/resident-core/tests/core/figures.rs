//! The pool figures every `Place` and `Node` answer carries
//! (`NodeState::pools()`), in the cases the property test does not make:
//! a resident's pool dropped by a reload, and bytes measured in a pool a
//! resident does not ask of.

use crate::support::*;
use resident_core::{AdmitError, Charge, Entry, GB, Groups, NodeState, Policy, Reason};
use std::sync::Arc;

/// A pool's figures as (name, effective budget, used, free).
fn figures(n: &NodeState) -> Vec<(String, Option<u64>, u64, Option<u64>)> {
    n.pools()
        .iter()
        .map(|s| (s.name.to_string(), s.effective, s.used, s.free))
        .collect()
}

#[test]
fn a_pool_dropped_by_a_reload_leaves_the_others_figures_whole() {
    let mut n = node(
        vec![live_pool("ram", Some(100), 0), static_pool("gpu", Some(24))],
        vec![],
    );
    put(&mut n, "a", spec("a", &[("ram", 10), ("gpu", 8)]), 0);
    put(&mut n, "b", spec("b", &[("ram", 5)]), 0);
    put(&mut n, "c", spec("c", &[("gpu", 4)]), 0);
    // Measured above its declaration: counts as the measured 12 GB.
    n.set_measured("a", &pool("ram"), 12 * GB);
    // Measured in a pool it does not ask of: counts for nothing.
    n.set_measured("c", &pool("ram"), 7 * GB);
    n.set_available("ram", Some(50 * GB));
    // The live ceiling: 50 GB available + 12 GB measured for residents.
    let gb = |x: u64| x * GB;
    assert_eq!(
        figures(&n),
        [
            ("gpu".to_string(), Some(gb(24)), gb(12), Some(gb(12))),
            ("ram".to_string(), Some(gb(62)), gb(17), Some(gb(45))),
        ]
    );
    // A reload drops "gpu" while `a` and `c` still hold it: the figures
    // list the configured pools only, and "ram" keeps its own.
    n.reconfigure([live_pool("ram", Some(100), 0)], Groups::default());
    assert_eq!(
        figures(&n),
        [("ram".to_string(), Some(gb(62)), gb(17), Some(gb(45)))]
    );
    assert_eq!(n.holders("gpu").len(), 2, "a and c still hold memory there");
}

#[test]
fn an_overrun_counts_what_was_measured_in_every_figure_and_admission() {
    let mut n = node(vec![static_pool("ram", Some(20))], vec![]);
    put(&mut n, "a", spec("a", &[("ram", 10)]), 0);
    assert!(n.overruns().is_empty(), "nothing measured yet");
    n.set_measured("a", &pool("ram"), 14 * GB);
    let charge = Charge {
        reserved: 10 * GB,
        measured: 14 * GB,
    };
    assert_eq!(n.resident("a").expect("a").charge("ram"), charge);
    assert_eq!(charge.counted(), 14 * GB);
    assert_eq!(charge.overrun(), 4 * GB);
    let overruns: Vec<_> = n
        .overruns()
        .into_iter()
        .map(|(id, pool, c)| (id.to_string(), pool.to_string(), c))
        .collect();
    assert_eq!(overruns, [("a".to_string(), "ram".to_string(), charge)]);
    assert_eq!(n.used("ram"), 14 * GB);
    assert_eq!(n.pools()[0].free, Some(6 * GB));
    // 8 GB would fit beside the declared 10 GB, not beside the 14 held:
    // refused, naming what `a` really holds.
    let refused = n.admit(
        &id("b"),
        Entry::Start(Arc::new(spec("b", &[("ram", 8)]))),
        Policy::Refuse,
        0,
    );
    let Err(AdmitError::Refused(refusal)) = refused else {
        panic!("admitted into memory that is not there: {refused:?}");
    };
    let Some(Reason::OverBudget { holders, free, .. }) = refusal.reasons().first() else {
        panic!("not a budget reason: {refusal}");
    };
    assert_eq!(*free, 6 * GB);
    assert_eq!(holders[0].bytes, 14 * GB, "the holder shows what it holds");
    // Measured back within its reservation: the reservation counts again.
    n.set_measured("a", &pool("ram"), 3 * GB);
    assert_eq!(n.used("ram"), 10 * GB);
    assert!(n.overruns().is_empty());
}
