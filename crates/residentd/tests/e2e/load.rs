//! Load at the edges: a thousand Watch streams at once, each served every
//! event, and the agent's memory with them, round after round: once the
//! allocator has warmed up, another thousand do not grow it further
//! (nothing is kept per stream after its end). And 10,000 instances
//! listed again and again without the memory growing per call. And an
//! agent started under a low soft limit on open files raises it, so its
//! instances' descriptors do not run out.

use crate::support::*;
use resident_api::pb;
use tokio_stream::StreamExt as _;

const WATCHERS: usize = 1000;
/// Streams per connection (the agent allows 256).
const PER_CONNECTION: usize = 200;

/// The agent's resident memory, in bytes.
fn rss(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS");
    kb * 1024
}

/// Opens `WATCHERS` Watch streams, checks each gets the snapshot and then
/// the event of one start, and closes them; returns the agent's memory
/// while they were open.
async fn round(d: &mut Daemon, id: &str) -> u64 {
    let mut streams = Vec::with_capacity(WATCHERS);
    let mut clients = Vec::new();
    for _ in 0..WATCHERS.div_ceil(PER_CONNECTION) {
        clients.push(connect(&d.socket).await);
    }
    for n in 0..WATCHERS {
        let c = &mut clients[n / PER_CONNECTION];
        let s = c
            .watch(pb::WatchRequest { since_revision: 0 })
            .await
            .expect("watch")
            .into_inner();
        streams.push(s);
    }
    // Every stream sees the snapshot of "base", then the new instance.
    d.started("nap", id).await;
    let mut tasks = tokio::task::JoinSet::new();
    for mut s in streams {
        let id = id.to_string();
        tasks.spawn(async move {
            let mut saw_base = false;
            loop {
                let e = s.next().await.expect("open").expect("ok");
                let Some(i) = e.instance else { continue };
                saw_base |= i.instance_id == "base";
                if i.instance_id == id && i.state == pb::State::Ready as i32 {
                    return saw_base;
                }
            }
        });
    }
    let during = rss(d.pid());
    let mut served = 0;
    while let Some(done) = tasks.join_next().await {
        assert!(
            done.expect("a watcher"),
            "each watcher got the snapshot first"
        );
        served += 1;
    }
    assert_eq!(served, WATCHERS);
    drop(clients);
    d.stopped(id).await;
    during
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_watchers_are_served_and_leave_nothing_behind() {
    let mut d = Daemon::start(&(pool("ram", "100GB") + &sleeper("nap", "ram", 1, ""))).await;
    d.started("nap", "base").await;
    let idle = rss(d.pid());
    let first = round(&mut d, "one").await;
    let after_first = rss(d.pid());
    let second = round(&mut d, "two").await;
    let after_second = rss(d.pid());
    let third = round(&mut d, "three").await;
    let after_third = rss(d.pid());
    println!(
        "agent RSS: idle {} MB; 1000 watchers {} / {} / {} MB; after each round {} / {} / {} MB",
        idle >> 20,
        first >> 20,
        second >> 20,
        third >> 20,
        after_first >> 20,
        after_second >> 20,
        after_third >> 20
    );
    // A second thousand costs no more than the first: nothing per stream
    // outlives it (allow the allocator 10% and 4 MB of slack).
    assert!(
        second <= first + first / 10 + (4 << 20),
        "memory grew round over round: {first} then {second}"
    );
    assert!(
        after_second <= after_first + after_first / 10 + (4 << 20),
        "memory kept after the watchers left grew: {after_first} then {after_second}"
    );
    // And the agent still answers as before.
    assert!(
        third <= second + second / 10 + (4 << 20),
        "memory grew round over round: {second} then {third}"
    );
    assert_eq!(d.ids().await, ["base", "one", "three", "two"]);
}

/// Instances in the List load: with `max_instances` raised to hold them.
const LISTED: usize = 10_000;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_instances_are_listed_without_the_memory_growing_per_call() {
    // Each run exits at once and stays listed as EXITED (up to
    // max_instances ended records are kept).
    let config = format!(
        "max_instances = {LISTED}\n{}[[workload]]\nname = \"blink\"\ncommand = [\"/bin/true\"]\n[workload.restart]\npolicy = \"never\"\n[workload.memory.ram]\nweights = \"1MB\"\n",
        pool("ram", "100GB")
    );
    let mut d = Daemon::start(&config).await;
    let mut clients = Vec::new();
    for _ in 0..8 {
        clients.push(connect(&d.socket).await);
    }
    let mut tasks = tokio::task::JoinSet::new();
    for (k, mut c) in clients.into_iter().enumerate() {
        tasks.spawn(async move {
            for n in (k..LISTED).step_by(8) {
                c.start(start_req("blink", &format!("b{n}")))
                    .await
                    .expect("start");
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.expect("a client");
    }
    let listed = until(async || {
        let list = d.list().await;
        let ended = list
            .iter()
            .filter(|i| i.state == pb::State::Exited as i32)
            .count();
        (ended == LISTED).then_some(list.len())
    })
    .await;
    assert_eq!(listed, Some(LISTED), "every instance listed, ended");
    let before = rss(d.pid());
    for _ in 0..20 {
        assert_eq!(d.list().await.len(), LISTED);
    }
    let after = rss(d.pid());
    println!(
        "agent RSS with {LISTED} instances: {} MB, after 20 Lists {} MB",
        before >> 20,
        after >> 20
    );
    assert!(
        after <= before + before / 10 + (8 << 20),
        "List kept memory: {before} then {after}"
    );
}

/// Instances started under the low soft limit below: with the agent's own
/// descriptors, more than 64 open files.
const UNDER_A_LOW_LIMIT: usize = 16;

#[tokio::test]
async fn a_low_soft_limit_on_open_files_is_raised_to_the_hard_one() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    use std::os::unix::process::CommandExt as _;
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    // The agent and 16 instances (a pidfd, two pipes and sampled files
    // each) need more than 64.
    let soft = 64;
    if hard <= soft {
        return skip("the hard limit on open files is 64 or less here");
    }
    let dir = tempfile::tempdir().expect("tempdir");
    write_config(
        dir.path(),
        &(pool("ram", "100GB") + &sleeper("nap", "ram", 1, "")),
    );
    let mut d = Daemon::start_in_with(dir, |cmd| {
        // SAFETY: the closure runs in the forked child before exec and
        // makes one system call, setrlimit, which is async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                setrlimit(Resource::RLIMIT_NOFILE, soft, hard).map_err(std::io::Error::from)
            });
        }
    })
    .await;
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", d.pid())).expect("limits");
    let line = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .expect("a line for open files");
    // "Max open files  SOFT  HARD  files"
    let numbers: Vec<&str> = line.split_whitespace().skip(3).take(2).collect();
    assert_eq!(numbers, [hard.to_string(), hard.to_string()], "{line}");
    for i in 0..UNDER_A_LOW_LIMIT {
        d.started("nap", &format!("n{i}")).await;
    }
    for i in 0..UNDER_A_LOW_LIMIT {
        d.wait_state(&format!("n{i}"), pb::State::Ready).await;
    }
    assert!(!d.log().contains("Too many open files"), "{}", d.log());
}
