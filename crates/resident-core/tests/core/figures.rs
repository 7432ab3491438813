//! The pool figures every `Place` and `Node` answer carries
//! (`NodeState::pools()`), in the cases the property test does not make:
//! a resident's pool dropped by a reload, and bytes measured in a pool a
//! resident does not ask of.

use crate::support::*;
use resident_core::{GB, Groups, NodeState};

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
    // Measured above its declaration: counts as the declared 10 GB.
    n.set_measured("a", &pool("ram"), 12 * GB);
    // Measured in a pool it does not ask of: counts for nothing.
    n.set_measured("c", &pool("ram"), 7 * GB);
    n.set_available("ram", Some(50 * GB));
    // The live ceiling: 50 GB available + 10 GB touched by residents.
    let gb = |x: u64| x * GB;
    assert_eq!(
        figures(&n),
        [
            ("gpu".to_string(), Some(gb(24)), gb(12), Some(gb(12))),
            ("ram".to_string(), Some(gb(60)), gb(15), Some(gb(45))),
        ]
    );
    // A reload drops "gpu" while `a` and `c` still hold it: the figures
    // list the configured pools only, and "ram" keeps its own.
    n.reconfigure([live_pool("ram", Some(100), 0)], Groups::default());
    assert_eq!(
        figures(&n),
        [("ram".to_string(), Some(gb(60)), gb(15), Some(gb(45)))]
    );
    assert_eq!(n.holders("gpu").len(), 2, "a and c still hold memory there");
}
