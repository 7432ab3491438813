//! The disk pools' books: a state's room is reserved before it is
//! written, the least recently used states go for it, nothing goes for a
//! state that cannot fit, and the files on disk are always what the books
//! hold. The property test drives the books with a fake server that
//! writes files of any size up to (and sometimes past) what was reserved.
#![allow(clippy::disallowed_methods)] // plain tests: no runtime to block

use std::cell::Cell;
use std::path::{Path, PathBuf};

use proptest::prelude::*;
use resident_core::{PoolConfig, PoolName};

use super::disks::{Disks, Moves};
use super::{Slot, bound, file_name, slots_holding};

thread_local! {
    /// The fake filesystem's capacity and the bytes of other files on it.
    static DISK: Cell<(u64, u64)> = const { Cell::new((u64::MAX / 4, 0)) };
}

/// Free space as a filesystem holding `dir` and the foreign bytes would
/// show it: its capacity less everything stored under `dir`.
fn fake_free(dir: &Path) -> Option<u64> {
    let (capacity, foreign) = DISK.with(Cell::get);
    Some(
        capacity
            .saturating_sub(foreign)
            .saturating_sub(on_disk(dir).values().sum()),
    )
}

/// Every file under a disk pool's `dir` and its size.
fn on_disk(dir: &Path) -> std::collections::BTreeMap<PathBuf, u64> {
    let mut out = std::collections::BTreeMap::new();
    for w in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        for f in std::fs::read_dir(w.path()).into_iter().flatten().flatten() {
            out.insert(f.path(), f.metadata().expect("metadata").len());
        }
    }
    out
}

fn pool(budget: u64) -> PoolConfig {
    PoolConfig::new(PoolName::new("kv").expect("name"), Some(budget))
}

/// Books over one disk pool `kv` of `budget` under `dir`.
fn books(dir: &Path, budget: u64) -> Disks {
    let mut d = Disks::new(fake_free);
    d.set_pools(vec![(pool(budget), dir.to_path_buf())]);
    d
}

/// The file of `workload`'s slot `slot` (key 1).
fn file(dir: &Path, workload: &str, slot: u64) -> PathBuf {
    dir.join(workload).join(file_name(1, slot))
}

/// Saves slot `slot` of `workload`, reserving `reserve` and writing
/// `write` bytes: whether it was saved.
fn save(
    d: &mut Disks,
    dir: &Path,
    workload: &str,
    slot: u64,
    reserve: u64,
    write: u64,
    now: u64,
) -> (bool, Moves) {
    let f = file(dir, workload, slot);
    let mut moves = Moves::default();
    let reserved = d.reserve(
        "kv",
        workload,
        &[(slot, f.clone(), reserve)],
        now,
        &mut moves,
    );
    if reserved.is_empty() {
        return (false, moves);
    }
    std::fs::create_dir_all(f.parent().expect("dir")).expect("mkdir");
    std::fs::File::create(&f)
        .expect("create")
        .set_len(write)
        .expect("set_len");
    d.settle("kv", workload, &f, Some(write), now, &mut moves);
    (f.exists(), moves)
}

fn used(d: &Disks) -> u64 {
    d.ledger().used("kv")
}

#[test]
fn a_slot_is_sized_by_its_tokens_share_of_the_cache() {
    let answer = r#"[{"id":0,"n_ctx":2048,"n_prompt_tokens":1024},{"id":1,"n_ctx":2048,"is_processing":false}]"#;
    let slots = slots_holding(answer).expect("understood");
    assert_eq!(
        slots,
        vec![Slot {
            id: 0,
            cells: 2048,
            tokens: 1024
        }],
        "a slot without tokens is not saved"
    );
    // Half the cells: half the cache, plus each token's bookkeeping and
    // the header.
    assert_eq!(
        bound(4_000_000, &slots[0]),
        2_000_000 + 16 * 1024 + 64 * 1024
    );
    assert_eq!(slots_holding("{\"error\": 1}"), None, "not a list");
}

#[test]
fn the_oldest_state_goes_for_a_new_one_and_nothing_for_one_that_cannot_fit() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let mut d = books(dir, 1000);
    assert!(save(&mut d, dir, "a", 0, 400, 300, 1).0);
    assert!(save(&mut d, dir, "b", 0, 400, 300, 2).0);
    d.touch("a", &file(dir, "a", 0), 3);
    // 600 held; 500 more needs one to go: b, the least recently used.
    let (saved, moves) = save(&mut d, dir, "c", 0, 500, 450, 4);
    assert!(saved);
    assert_eq!(moves.evicted, 1);
    assert!(file(dir, "a", 0).exists() && !file(dir, "b", 0).exists());
    assert_eq!(used(&d), 750, "each charged what its file holds");
    // Larger than the whole pool: refused, and nothing evicted for it.
    let (saved, moves) = save(&mut d, dir, "d", 0, 1001, 10, 5);
    assert!(!saved);
    assert_eq!((moves.refused, moves.evicted), (1, 0));
    assert_eq!(on_disk(dir).len(), 2);
    // A slot saved again replaces its own state; when the new one cannot
    // fit, the old one stays.
    let (saved, _) = save(&mut d, dir, "a", 0, 2000, 10, 6);
    assert!(!saved);
    assert!(file(dir, "a", 0).exists(), "the old state stays");
    assert_eq!(used(&d), 750);
}

#[test]
fn a_state_larger_than_reserved_is_kept_only_if_room_is_made() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let mut d = books(dir, 1000);
    assert!(save(&mut d, dir, "a", 0, 500, 500, 1).0);
    let (saved, moves) = save(&mut d, dir, "b", 0, 400, 600, 2);
    assert!(saved, "a went for it");
    assert_eq!((moves.evicted, moves.dropped), (1, 0));
    let (saved, moves) = save(&mut d, dir, "c", 0, 300, 1200, 3);
    assert!(!saved, "no room for 1,200 of 1,000");
    assert_eq!(moves.dropped, 1);
    assert_eq!(on_disk(dir).values().sum::<u64>(), used(&d));
}

#[test]
fn a_budget_lowered_or_a_disk_filled_keeps_the_newest_states() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let dir = tmp.path();
    let mut d = books(dir, 1000);
    for (i, w) in ["a", "b", "c"].iter().enumerate() {
        assert!(save(&mut d, dir, w, 0, 300, 300, i as u64).0);
        let t = std::time::SystemTime::UNIX_EPOCH + std::time::Duration::from_secs(1000 + i as u64);
        std::fs::File::options()
            .write(true)
            .open(file(dir, w, 0))
            .and_then(|f| f.set_modified(t))
            .expect("mtime");
    }
    assert_eq!(d.set_pools(vec![(pool(700), dir.to_path_buf())]), 1);
    assert!(!file(dir, "a", 0).exists(), "the oldest went");
    assert_eq!(used(&d), 600);
    // Another writer fills the disk: the pool's room shrinks with it. 600
    // ours + 350 foreign + 100 new passes 1,000: the oldest (b) goes.
    DISK.with(|c| c.set((1000, 350)));
    let (saved, moves) = save(&mut d, dir, "d", 0, 100, 100, 10);
    assert!(saved);
    assert_eq!(moves.evicted, 1);
    assert!(!file(dir, "b", 0).exists(), "the oldest went");
    // 400 ours + 550 foreign: 450 is all the pool can ever hold now; a
    // state of 500 is not written, and nothing goes for it.
    DISK.with(|c| c.set((1000, 550)));
    let (saved, moves) = save(&mut d, dir, "e", 0, 500, 500, 11);
    assert!(!saved);
    assert_eq!((moves.refused, moves.evicted), (1, 0));
    assert_eq!(used(&d), 400);
    DISK.with(|c| c.set((u64::MAX / 4, 0)));
}

#[derive(Debug, Clone)]
enum Op {
    /// Save `slot` of workload `w`: reserve `reserve`, write `fill`
    /// thousandths of it (past 1,000: more than reserved), or fail.
    Save {
        w: usize,
        slot: u64,
        reserve: u64,
        fill: u64,
        fails: bool,
    },
    Restore {
        w: usize,
        slot: u64,
    },
    Stale {
        w: usize,
    },
    Foreign(u64),
    Reload(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        5 => (0..3usize, 0..2u64, 1..700u64, 100..1200u64, proptest::bool::weighted(0.1))
            .prop_map(|(w, slot, reserve, fill, fails)| Op::Save { w, slot, reserve, fill, fails }),
        2 => (0..3usize, 0..2u64).prop_map(|(w, slot)| Op::Restore { w, slot }),
        1 => (0..3usize).prop_map(|w| Op::Stale { w }),
        1 => (0..800u64).prop_map(Op::Foreign),
        1 => (200..1500u64).prop_map(Op::Reload),
    ]
}

const WORKLOADS: [&str; 3] = ["a", "b", "c"];

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, failure_persistence: None, ..ProptestConfig::default() })]

    /// After every step the files on disk are exactly the states the books
    /// hold, each charged what it holds, within the pool's budget and the
    /// disk's room; while a state is written within its reservation, the
    /// pool stays within both; a refused state moved nothing.
    #[test]
    fn the_disk_books_hold_every_state_once_and_never_pass_the_budget(ops in proptest::collection::vec(op(), 1..40)) {
        let tmp = tempfile::tempdir().expect("tempdir");
        let dir = tmp.path();
        let capacity = 2000u64;
        DISK.with(|c| c.set((capacity, 0)));
        let mut budget = 1000u64;
        let mut d = books(dir, budget);
        for (now, op) in ops.into_iter().enumerate() {
            let now = now as u64 + 1;
            match op {
                Op::Save { w, slot, reserve, fill, fails } => {
                    let workload = WORKLOADS[w];
                    let f = file(dir, workload, slot);
                    let before = on_disk(dir);
                    let foreign = DISK.with(Cell::get).1;
                    let mut moves = Moves::default();
                    let reserved = d.reserve("kv", workload, &[(slot, f.clone(), reserve)], now, &mut moves);
                    if reserved.is_empty() {
                        prop_assert_eq!(&on_disk(dir), &before, "a refused state moved nothing");
                        prop_assert_eq!(moves.evicted, 0);
                        continue;
                    }
                    let write = reserve * fill / 1000;
                    std::fs::create_dir_all(f.parent().expect("dir")).expect("mkdir");
                    std::fs::File::create(&f).expect("create").set_len(write).expect("set_len");
                    let now_on_disk: u64 = on_disk(dir).values().sum();
                    if write <= reserve {
                        prop_assert!(now_on_disk <= budget, "written within its reservation: {now_on_disk} of {budget}");
                        prop_assert!(now_on_disk + foreign <= capacity, "and within the disk: {now_on_disk} + {foreign} of {capacity}");
                    }
                    let written = (!fails).then_some(write);
                    d.settle("kv", workload, &f, written, now, &mut moves);
                }
                Op::Restore { w, slot } => {
                    let f = file(dir, WORKLOADS[w], slot);
                    if f.exists() {
                        d.touch(WORKLOADS[w], &f, now);
                    }
                }
                Op::Stale { w } => {
                    for slot in 0..2 {
                        let f = file(dir, WORKLOADS[w], slot);
                        if f.exists() {
                            d.drop_state(WORKLOADS[w], &f);
                        }
                    }
                }
                Op::Foreign(bytes) => DISK.with(|c| c.set((capacity, bytes))),
                Op::Reload(b) => {
                    budget = b;
                    d.set_pools(vec![(pool(budget), dir.to_path_buf())]);
                }
            }
            let files = on_disk(dir);
            let total: u64 = files.values().sum();
            prop_assert_eq!(total, used(&d), "every state charged once, what its file holds: {:?}", files);
            prop_assert_eq!(files.len(), d.ledger().residents().count());
            prop_assert!(total <= budget, "{} of {}", total, budget);
        }
        DISK.with(|c| c.set((u64::MAX / 4, 0)));
    }
}

/// A run is saved ahead of its sleep once it has been quiet long enough,
/// and again only after it did something new.
#[test]
fn a_save_ahead_of_sleep_is_due_once_per_quiet_spell() {
    use std::time::{Duration, Instant};
    let store = super::KvStore::default();
    let t0 = Instant::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    let after = Duration::from_secs(2);
    let due = |seen: &str, s: u64| store.save_due("a", 1, seen.to_string(), at(s), after);
    assert!(!due("x", 0), "first seen: quiet from now");
    assert!(!due("x", 1));
    assert!(due("x", 2), "quiet for 2 s");
    assert!(!due("x", 5), "nothing new since the save");
    assert!(!due("y", 6), "it worked: quiet again from now");
    assert!(!due("y", 7));
    assert!(due("y", 8));
    store.forget_runs(|_, _| false);
    assert!(!due("y", 9), "forgotten: quiet from now again");
}
