//! The reference ledger's four unit tests, replayed against our API: same
//! numbers, same message fragments.

use std::sync::Arc;

use crate::support::*;
use resident_core::{AdmitError, Entry, GB, Policy, Reason};

fn refuse(state: &mut resident_core::NodeState, name: &str, s: resident_core::Spec) -> Reason {
    match state.admit(&id(name), Entry::Start(Arc::new(s)), Policy::Refuse, 0) {
        Err(AdmitError::Refused(r)) => r.first().clone(),
        other => panic!("expected a refusal, got {other:?}"),
    }
}

#[test]
fn fits_until_the_budget_is_spent_then_says_who_holds_it() {
    let mut n = node(vec![static_pool("unified", Some(96))], vec![]);
    // Instances named after their workloads, as the brief's own text has
    // them (an instance named otherwise is told with its role beside it).
    put(
        &mut n,
        "coder-daily",
        with_role(unified("coder-daily", 55), "coder-daily"),
        0,
    );
    put(&mut n, "coder-small", unified("coder-small", 9), 0);
    let text = refuse(&mut n, "c", unified("planner", 55)).to_string();
    for fragment in [
        "'planner' needs 55.0 GB",
        "32.0 GB of the 96.0 GB",
        "coder-daily 55.0 GB",
        "coder-small 9.0 GB",
    ] {
        assert!(text.contains(fragment), "{text} lacks {fragment}");
    }
    assert_eq!(
        text,
        "unplaceable: 'planner' needs 55.0 GB but only 32.0 GB of the 96.0 GB 'unified' pool is free (held by coder-daily 55.0 GB, coder-small 9.0 GB)"
    );
    assert_eq!(n.used("unified"), 64 * GB, "a refusal reserves nothing");
    assert!(n.resident("c").is_none());
    n.release("coder-daily");
    put(&mut n, "c", unified("planner", 55), 0);
    assert_eq!(n.used("unified"), 64 * GB);
}

#[test]
fn exactly_the_budget_fits_and_one_byte_more_does_not() {
    let mut n = node(vec![static_pool("unified", Some(10))], vec![]);
    put(&mut n, "x", unified("x", 10), 0);
    assert_eq!(n.pools()[0].free, Some(0));
    n.release("x");
    let mut s = unified("x", 10);
    s.demand.get_mut("unified").expect("set above").kv = 1;
    let reason = refuse(&mut n, "x", s);
    assert!(
        matches!(reason, Reason::OverBudget { need, free, .. } if need == 10 * GB + 1 && free == 10 * GB)
    );
}

#[test]
fn exclusions_hold_in_both_directions_and_with_the_role_prefix() {
    let mut n = node(vec![static_pool("unified", None)], vec![]);
    put(
        &mut n,
        "a",
        excluding(unified("planner", 1), &["role:coder-daily"]),
        0,
    );
    // The newcomer is the one excluded by a running role.
    let reason = refuse(&mut n, "b", unified("coder-daily", 1));
    let Reason::Excluded {
        role,
        with,
        declared_by,
        with_instance,
    } = &reason
    else {
        panic!("expected an exclusion, got {reason:?}");
    };
    assert_eq!(
        (
            role.as_str(),
            with.as_str(),
            declared_by.as_str(),
            with_instance.as_str()
        ),
        ("coder-daily", "planner", "planner", "a")
    );
    assert!(
        reason.to_string().contains("'planner' excludes it"),
        "{reason}"
    );
    assert_eq!(
        reason.to_string(),
        "unplaceable: 'coder-daily' cannot be resident beside 'planner' ('planner' excludes it)"
    );
    // The newcomer excludes a running role (bare name form).
    let reason = refuse(&mut n, "c", excluding(unified("swarm", 1), &["planner"]));
    assert!(
        matches!(reason, Reason::Excluded { ref declared_by, .. } if declared_by.as_str() == "swarm")
    );
    // Unrelated roles coexist; no budget means no memory check.
    put(&mut n, "d", unified("embed", 500), 0);
}

#[test]
fn reserving_twice_for_one_instance_counts_once() {
    let mut n = node(vec![static_pool("unified", Some(60))], vec![]);
    let s = Arc::new(unified("coder", 55));
    let first = n
        .admit(&id("a"), Entry::Start(s.clone()), Policy::Refuse, 0)
        .expect("fits");
    let again = n
        .admit(&id("a"), Entry::Start(s), Policy::Refuse, 5)
        .expect("idempotent");
    assert!(first.created && !again.created);
    assert_eq!(n.used("unified"), 55 * GB);
    assert_eq!(
        n.resident("a").map(|r| r.last_used),
        Some(5),
        "a repeated start is a use"
    );
    // The same id with another workload is not the same instance.
    let other = n.admit(
        &id("a"),
        Entry::Start(Arc::new(unified("other", 1))),
        Policy::Refuse,
        0,
    );
    assert!(matches!(
        other,
        Err(AdmitError::Invalid(
            resident_core::PlanError::AlreadyExists { .. }
        ))
    ));
}
