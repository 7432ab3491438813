//! Adoptions: a process already running entered into the ledger, its
//! present memory counted as touched, never evicting for it, and never a
//! victim when the caller may not stop it.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::support::*;
use resident_core::{AdmitError, Entry, GB, NodeState, Plan, Policy, Reason, Running, Spec, Tier};

#[test]
fn a_running_process_counts_what_it_already_holds_as_touched() {
    // A live 24 GB pool whose reading shows 10 GB available: the process
    // to adopt already holds 12 GB of the 14 GB in use.
    let mut n = node(vec![live_pool("ram", Some(24), 0)], vec![]);
    n.set_available("ram", Some(10 * GB));
    let target = Arc::new(spec("srv", &[("ram", 12)]));
    // Without its present bytes it would not fit the live ceiling (10 GB).
    let refused = adopt(&mut n, "a", target.clone(), 0, &BTreeMap::new(), false);
    let Err(AdmitError::Refused(r)) = refused else {
        panic!("12 GB against 10 GB available: {refused:?}");
    };
    assert!(matches!(r.first(), Reason::HostMemory { .. }), "{r}");
    // With them, it fits: those bytes are the process's own.
    let present = BTreeMap::from([(pool("ram"), 12 * GB)]);
    let a = adopt(&mut n, "a", target.clone(), 0, &present, false)
        .expect("fits with its present bytes");
    assert!(a.created && a.evict.is_empty());
    assert_eq!(n.used("ram"), 12 * GB);
    assert_eq!(n.resident("a").expect("resident").measured, present);
    // Adopting the same id again is an error, not an idempotent repeat.
    assert!(adopt(&mut n, "a", target, 0, &present, false).is_err());
}

#[test]
fn an_adoption_never_evicts_and_an_unmanaged_one_is_never_a_victim() {
    let mut n = node(vec![static_pool("unified", Some(24))], vec![]);
    put(&mut n, "old", unified("old", 16), 0);
    // 10 GB do not fit beside 16: refused, nothing evicted.
    let r = adopt(
        &mut n,
        "a",
        Arc::new(unified("srv", 10)),
        1,
        &BTreeMap::new(),
        true,
    );
    assert!(matches!(r, Err(AdmitError::Refused(_))), "{r:?}");
    assert!(!n.resident("old").expect("still there").leaving());
    n.release("old");
    adopt(
        &mut n,
        "a",
        Arc::new(unified("srv", 10)),
        1,
        &BTreeMap::new(),
        false,
    )
    .expect("fits");
    // A start that needs its room cannot have it, even under evict.
    let plan = n
        .plan(&id("t"), &unified("t", 20), Policy::Evict, 100)
        .expect("valid");
    assert!(matches!(plan, Plan::Refuse(_)), "{plan:?}");
    // A managed adoption may be evicted like any resident.
    n.release("a");
    adopt(
        &mut n,
        "m",
        Arc::new(unified("srv", 10)),
        1,
        &BTreeMap::new(),
        true,
    )
    .expect("fits");
    let plan = n
        .plan(&id("t"), &unified("t", 20), Policy::Evict, 100)
        .expect("valid");
    let Plan::Admit { evict, .. } = plan else {
        panic!("the managed one may go: {plan:?}");
    };
    assert_eq!(ids(&evict), ["m"]);
}

/// Enters a running process as `name`, holding `present` bytes already.
fn adopt(
    n: &mut NodeState,
    name: &str,
    spec: Arc<Spec>,
    now: u64,
    present: &BTreeMap<resident_core::PoolName, u64>,
    evictable: bool,
) -> Result<resident_core::Admission, AdmitError> {
    let run = Running {
        spec,
        tier: Tier::Awake,
        planned: Tier::Awake,
        present: present.clone(),
        evictable,
    };
    n.admit(&id(name), Entry::Running(run), Policy::Refuse, now)
}
