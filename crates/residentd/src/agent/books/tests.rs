//! The books on their own: a refusal's Placement says what the decision
//! saw, a release counts only for the run it names, and under any sequence
//! of admissions, cancels and releases every reservation is released
//! exactly once (checked against a model); owners' leases lapse unless
//! renewed.

use std::collections::BTreeSet;
use std::path::Path;

use proptest::prelude::*;
use resident_core::Reason;

use super::*;
use resident_api::{ApiError, pb};
use resident_core::{Policy, PoolName};

const GB: u64 = 1_000_000_000;

fn config() -> Config {
    let mut text = String::from(
        "[node]\nname = \"n\"\nlisten = \"unix:///tmp/residentd-unused/unused.sock\"\nstate_dir = \"/tmp/residentd-unused/state\"\n\n[[pool]]\nname = \"ram\"\nbudget = \"10GB\"\n",
    );
    for (name, gb) in [("small", 3), ("big", 6)] {
        text += &format!(
            "\n[[workload]]\nname = \"{name}\"\ncommand = [\"/bin/sleep\", \"1\"]\n[workload.memory.ram]\nweights = \"{gb}GB\"\n"
        );
    }
    resident_config::parse(Path::new("books-test.toml"), &text).expect("a valid config")
}

fn admit(
    b: &Books,
    c: &Arc<Config>,
    workload: &str,
    id: &str,
    policy: Policy,
) -> Result<Decision, ApiError> {
    let w = c.workloads[workload].clone();
    let id = InstanceId::new(id).expect("an id");
    b.admit(c, &w, &id, policy, 0, 0, None, None)
}

fn generation_of(d: Result<Decision, ApiError>) -> u64 {
    match d {
        Ok(Decision::Admitted(a)) => a.generation,
        other => panic!("admitted: {other:?}"),
    }
}

#[test]
fn a_refusal_says_what_the_decision_saw() {
    let c = Arc::new(config());
    let b = Books::new(&c);
    generation_of(admit(&b, &c, "big", "a", Policy::Refuse));
    let Err(ApiError::Refused { refusal, placement }) = admit(&b, &c, "big", "b", Policy::Refuse)
    else {
        panic!("refused");
    };
    let pool = &placement.pools[0];
    assert_eq!(pool.used_bytes, 6 * GB);
    let Reason::OverBudget { free, holders, .. } = refusal.first() else {
        panic!("over budget: {refusal:?}");
    };
    assert_eq!(Some(*free), pool.free_bytes);
    assert_eq!(
        holders.iter().map(|h| h.bytes).sum::<u64>(),
        pool.used_bytes
    );
}

/// Feeds one reading of `bytes` measured in pool `ram` for `id`; says
/// whether a learned figure rose.
fn measure(b: &Books, id: &str, bytes: u64) -> bool {
    b.set_readings(Readings {
        available: Vec::new(),
        measured: vec![(id.into(), PoolName::new("ram").expect("a pool"), bytes)],
        host: Vec::new(),
        host_pools: Vec::new(),
        learn: true,
    })
}

#[test]
fn a_learned_footprint_raises_the_next_admission_of_the_same_command_only() {
    let c = Arc::new(config());
    let b = Books::new(&c);
    let w = c.workloads["small"].clone();
    let start = |id: &str, key: u64| {
        let id = InstanceId::new(id).expect("an id");
        generation_of(b.admit(&c, &w, &id, Policy::Refuse, 0, 0, Some(key), None))
    };
    let reserved = |id: &str| b.charges(id)[0].1.reserved;
    let g = start("a", 7);
    assert_eq!(reserved("a"), 3 * GB, "nothing learned yet: as declared");
    assert!(
        measure(&b, "a", 4 * GB),
        "a high-water above the declaration"
    );
    assert!(
        !measure(&b, "a", 4 * GB + 1000),
        "within the step: nothing to journal"
    );
    assert!(
        !measure(&b, "a", 2 * GB),
        "a lower reading keeps the high-water"
    );
    let rows = b.learned_rows();
    assert_eq!(rows.len(), 1);
    assert_eq!((rows[0].key, rows[0].pools["ram"]), (7, 4 * GB));
    // Its run keeps what it was admitted with; the next one reserves the
    // learned figure, and a Place says the same.
    assert_eq!(reserved("a"), 3 * GB);
    assert!(b.release("a", g));
    start("b", 7);
    assert_eq!(reserved("b"), 4 * GB);
    let placement = b
        .place(&w, None, Policy::Refuse, 0, Some(7))
        .expect("a placement");
    assert_eq!(placement.pools[0].used_bytes, 4 * GB);
    // Another command (key): the declaration, and its first reading
    // starts afresh, since its run is newer.
    start("c", 8);
    assert_eq!(reserved("c"), 3 * GB);
    assert!(measure(&b, "c", GB + GB / 2));
    let rows = b.learned_rows();
    assert_eq!((rows[0].key, rows[0].pools["ram"]), (8, GB + GB / 2));
    // The older run under the old key does not undo it.
    assert!(!measure(&b, "b", 5 * GB));
    assert_eq!(b.learned_rows()[0].key, 8);
    // Not learning: the declaration, whatever was learned.
    assert_eq!(
        b.learned_spec(&w, None)
            .demand
            .values()
            .next()
            .map(|d| d.footprint()),
        Some(3 * GB)
    );
    // Forgotten: nothing left to journal.
    assert!(b.forget_learned("small"));
    assert!(b.learned_rows().is_empty());
    assert!(!b.forget_learned("small"));
}

#[test]
fn a_stopping_resident_is_never_chosen_again_as_a_victim() {
    let c = Arc::new(config());
    let b = Books::new(&c);
    generation_of(admit(&b, &c, "big", "a", Policy::Refuse));
    // A Stop is under way: "a" holds its memory until its release.
    b.cancel("a", None, pb::Cause::Stopped).expect("a record");
    assert!(b.lock().ledger.resident("a").is_some_and(|r| r.leaving()));
    // Evicting it again would stop a stopping run twice and count its
    // memory as freed twice: the start is refused instead.
    match admit(&b, &c, "big", "b", Policy::Evict) {
        Err(ApiError::Refused { .. }) => {}
        other => panic!("refused while a stops: {other:?}"),
    }
}

#[test]
fn an_admission_on_a_config_the_books_no_longer_hold_is_decided_again() {
    let c = Arc::new(config());
    let b = Books::new(&c);
    // A reload: the books hold the new config; a call that took its
    // snapshot before decides nothing and is told to decide again.
    let reloaded = Arc::new(config());
    b.reconfigure(&reloaded);
    assert!(matches!(
        admit(&b, &c, "small", "a", Policy::Refuse),
        Ok(Decision::Reconfigured)
    ));
    assert!(b.lock().ledger.resident("a").is_none(), "nothing reserved");
    generation_of(admit(&b, &reloaded, "small", "a", Policy::Refuse));
}

#[test]
fn a_lease_lapses_unless_a_touch_renews_it_and_only_leased_residents_lapse() {
    let c = Arc::new(config());
    let b = Books::new(&c);
    let leased = |id: &str, ms: u64| {
        let id = InstanceId::new(id).expect("an id");
        generation_of(b.admit(
            &c,
            &c.workloads["small"],
            &id,
            Policy::Refuse,
            0,
            ms,
            None,
            None,
        ))
    };
    leased("leased", 1_000);
    leased("unleased", 0);
    leased("cancelled", 1_000);
    b.cancel("cancelled", None, pb::Cause::Stopped)
        .expect("a record");
    assert!(b.leases_expired(999).is_empty(), "not yet");
    // A touch at 500 renews the lease for another 1000 ms.
    assert!(b.touch("leased", 500, Hold::For(0)));
    assert!(b.leases_expired(1_400).is_empty(), "renewed");
    let generation = b.record("leased").expect("a record").generation;
    assert_eq!(
        b.leases_expired(1_500),
        [("leased".to_string(), generation, 1_000)]
    );
    // Released, it is no longer anyone's to stop.
    assert!(b.release("leased", generation));
    assert!(b.leases_expired(u64::MAX).is_empty());
}

#[test]
fn a_release_counts_only_for_the_run_it_names() {
    let c = Arc::new(config());
    let b = Books::new(&c);
    let first = generation_of(admit(&b, &c, "small", "a", Policy::Refuse));
    assert!(b.cancel("a", None, pb::Cause::Stopped).is_some());
    assert!(matches!(
        admit(&b, &c, "small", "a", Policy::Refuse),
        Ok(Decision::Stopping(_))
    ));
    assert!(b.release("a", first));
    assert!(!b.release("a", first), "released once");
    let second = generation_of(admit(&b, &c, "small", "a", Policy::Refuse));
    assert!(second > first);
    assert!(!b.release("a", first), "a late end of the first run");
    assert_eq!(b.resident_ids(), ["a"]);
    assert!(b.release("a", second));
    assert!(b.resident_ids().is_empty());
}

#[test]
fn an_eviction_names_its_run_and_never_stops_the_next_run_of_that_id() {
    let c = Arc::new(config());
    let b = Books::new(&c);
    let victim = generation_of(admit(&b, &c, "big", "v", Policy::Refuse));
    let Ok(Decision::Admitted(a)) = admit(&b, &c, "big", "x", Policy::Evict) else {
        panic!("admitted by evicting v");
    };
    let chosen: Vec<(&str, u64)> = a
        .evictions
        .iter()
        .map(|e| (e.id.as_str(), e.generation))
        .collect();
    assert_eq!(chosen, [("v", victim)]);
    // The victim's run ends by another path (a Stop), and its id is
    // started anew (evicting in turn) before the eviction's stop comes
    // round.
    assert!(b.release("v", victim));
    let next = generation_of(admit(&b, &c, "big", "v", Policy::Evict));
    assert!(
        b.cancel("v", Some(victim), pb::Cause::Stopped).is_none(),
        "the chosen run has ended"
    );
    assert!(b.wanted("v", next), "the next run is untouched");
    assert!(b.cancel("v", Some(next), pb::Cause::Stopped).is_some());
    assert!(!b.wanted("v", next));
}

#[derive(Debug, Clone)]
enum Op {
    Admit(usize, usize, bool),
    Cancel(usize),
    /// Ends a run: the current one, or a stale one.
    End(usize, bool),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0..4usize, 0..2usize, any::<bool>()).prop_map(|(i, w, e)| Op::Admit(i, w, e)),
        (0..4usize).prop_map(Op::Cancel),
        (0..4usize, any::<bool>()).prop_map(|(i, s)| Op::End(i, s)),
    ]
}

proptest! {
    #[test]
    fn every_reservation_is_released_once_and_only_by_its_run(ops in proptest::collection::vec(op(), 1..60)) {
        let c = Arc::new(config());
    let b = Books::new(&c);
        // The model: which (id, generation) hold a reservation.
        let mut held: BTreeSet<(String, u64)> = BTreeSet::new();
        for op in ops {
            match op {
                Op::Admit(i, w, evict) => {
                    let id = format!("i{i}");
                    let policy = if evict { Policy::Evict } else { Policy::Refuse };
                    let workload = ["small", "big"][w];
                    if let Ok(Decision::Admitted(a)) = admit(&b, &c, workload, &id, policy) {
                        prop_assert!(held.insert((id, a.generation)));
                        // Victims keep theirs until their runs end.
                        for v in &a.evictions {
                            prop_assert!(held.iter().any(|(h, _)| *h == v.id));
                        }
                    }
                }
                Op::Cancel(i) => {
                    b.cancel(&format!("i{i}"), None, pb::Cause::Stopped);
                }
                Op::End(i, stale) => {
                    let id = format!("i{i}");
                    let Some(r) = b.record(&id) else { continue };
                    let generation = if stale { r.generation.saturating_sub(1) } else { r.generation };
                    let expected = held.remove(&(id.clone(), generation));
                    prop_assert_eq!(b.release(&id, generation), expected);
                }
            }
            prop_assert!(b.lock().ended_is_true(), "the ended index differs from the records");
            let ids: BTreeSet<String> = b.resident_ids().into_iter().collect();
            let model: BTreeSet<String> = held.iter().map(|(id, _)| id.clone()).collect();
            prop_assert_eq!(&ids, &model);
            // Victims hold their memory until their runs end, so the
            // pool may hold more than its budget while they exit; what
            // stays within it is everything not being evicted.
            let kept: u64 = b
                .lock()
                .ledger
                .residents()
                .filter(|r| !r.leaving())
                .map(|r| r.footprint("ram"))
                .sum();
            prop_assert!(kept <= 10 * GB, "over budget: {}", kept);
        }
    }
}

#[test]
fn once_closed_nothing_idle_or_leased_moves() {
    let text = "[node]\nname = \"n\"\nlisten = \"unix:///tmp/residentd-unused/unused.sock\"\nstate_dir = \"/tmp/residentd-unused/state\"\n\n[[pool]]\nname = \"ram\"\nbudget = \"10GB\"\n\n[[workload]]\nname = \"nap\"\ncommand = [\"/bin/sleep\", \"1\"]\nidle_ttl = \"1s\"\n[workload.memory.ram]\nweights = \"1GB\"\n[workload.sleep]\nsleep = \"POST /sleep\"\nwake = \"POST /wake\"\nidle = \"1s\"\n[workload.sleep.memory.ram]\nweights = \"1GB\"\n";
    let c = Arc::new(resident_config::parse(Path::new("closed.toml"), text).expect("valid"));
    let b = Books::new(&c);
    let id = InstanceId::new("a").expect("an id");
    let w = c.workloads["nap"].clone();
    let g = generation_of(b.admit(&c, &w, &id, Policy::Refuse, 0, 500, None, None));
    // Open: idle for its TTL and its sleep idle, its lease lapsed.
    assert_eq!(b.idle(5_000), [("a".to_string(), g)]);
    assert_eq!(b.sleepy(5_000), [("a".to_string(), g)]);
    assert_eq!(b.leases_expired(5_000).len(), 1);
    // Closed (the last journal is being written): none of it begins.
    b.close();
    assert!(b.idle(5_000).is_empty());
    assert!(b.sleepy(5_000).is_empty());
    assert!(b.leases_expired(5_000).is_empty());
    assert!(matches!(
        b.begin_sleep("a", Some(g), 5_000),
        Err(ApiError::Unavailable(_))
    ));
}
