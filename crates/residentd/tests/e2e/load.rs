//! Load at the edges: a thousand Watch streams at once, each served every
//! event, and the agent's memory with them, round after round: once the
//! allocator has warmed up, five more thousands do not grow it, end to
//! end or in trend (nothing is kept per stream after its end). And 10,000 instances
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

/// Rounds of a thousand watchers before any is measured: the allocator
/// settles over the first few (here 46, 53, 56, 57, 57 MB, then within
/// 1 MB over ten more rounds).
const WARMUP: usize = 4;

/// Rounds measured after the warm-up.
const ROUNDS: usize = 5;

/// What the agent may hold more after the last round than after the
/// first, in all: the allocator's slack, not a per-round allowance. A
/// leak of 1 KB per stream grows the agent 1 MB a round, 4 MB over the
/// rounds.
const SLACK: u64 = 4 << 20;

/// The least-squares slope of `ys` over 0, 1, 2, ... (bytes a round).
fn slope(ys: &[u64]) -> f64 {
    let n = ys.len() as f64;
    let mean_x = (n - 1.0) / 2.0;
    let mean_y = ys.iter().map(|y| *y as f64).sum::<f64>() / n;
    let (mut num, mut den) = (0.0, 0.0);
    for (x, y) in ys.iter().enumerate() {
        let dx = x as f64 - mean_x;
        num += dx * (*y as f64 - mean_y);
        den += dx * dx;
    }
    num / den
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_watchers_are_served_and_leave_nothing_behind() {
    let mut d = Daemon::start(&(pool("ram", "100GB") + &sleeper("nap", "ram", 1, ""))).await;
    d.started("nap", "base").await;
    let idle = rss(d.pid());
    let (mut during, mut after) = (Vec::new(), Vec::new());
    let mut ids = vec!["base".to_string()];
    for k in 0..WARMUP + ROUNDS {
        let id = format!("r{k}");
        during.push(round(&mut d, &id).await);
        after.push(rss(d.pid()));
        ids.push(id);
    }
    let mb = |v: &[u64]| {
        v.iter()
            .map(|b| format!("{:.1}", *b as f64 / 1048576.0))
            .collect::<Vec<_>>()
            .join(" / ")
    };
    println!(
        "agent RSS: idle {:.1} MB; 1000 watchers {} MB; after each round {} MB",
        idle as f64 / 1048576.0,
        mb(&during),
        mb(&after),
    );
    // The rounds after the warm-up.
    let (during, after) = (&during[WARMUP..], &after[WARMUP..]);
    println!(
        "measured rounds: slopes {:.0} and {:.0} bytes a round",
        slope(during),
        slope(after)
    );
    // The last thousand cost no more than the first: nothing per stream
    // outlives it. Compared end to end (a per-round allowance would let a
    // steady leak through), and the trend over the rounds bounded too.
    let (first, last) = (during[0], during[ROUNDS - 1]);
    assert!(
        last <= first + SLACK,
        "memory grew over {ROUNDS} rounds of watchers: {first} then {last} ({} MB)",
        mb(during)
    );
    let (first, last) = (after[0], after[ROUNDS - 1]);
    assert!(
        last <= first + SLACK,
        "memory kept after the watchers left grew over {ROUNDS} rounds: {first} then {last} ({} MB)",
        mb(after)
    );
    for (what, v) in [("with the watchers", during), ("after them", after)] {
        let s = slope(v);
        assert!(
            s <= (SLACK / 4) as f64,
            "memory {what} grows {s:.0} bytes a round ({} MB)",
            mb(v)
        );
    }
    // And the agent still answers as before.
    ids.sort();
    assert_eq!(d.ids().await, ids);
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
