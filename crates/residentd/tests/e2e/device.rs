//! A device-bound pool through the daemon, with a probe fed from a file
//! (the stand-in for NVML): foreign use tightens the budget, never loosens
//! it, and the budget comes back when the foreign process goes.

use crate::support::*;
use resident_api::pb;
use tonic::Code;

const GB: u64 = 1_000_000_000;

/// An agent with one 24 GB pool `gpu0` read from a file holding
/// `available` bytes, `pool_extra` more pool keys, `node_extra` more node
/// keys, and `workloads`. Returns it and the reading's path.
async fn gpu_daemon(
    available: u64,
    pool_extra: &str,
    node_extra: &str,
    workloads: &str,
) -> (Daemon, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("tempdir");
    let reading = dir.path().join("gpu0.available");
    std::fs::write(&reading, format!("{available}\n")).expect("reading");
    let config = format!(
        "{node_extra}[[pool]]\nname = \"gpu0\"\nbudget = \"24GB\"\ndevice = \"file:{}\"\n{pool_extra}\n\n{workloads}",
        reading.display()
    );
    write_config(dir.path(), &config);
    (Daemon::start_in(dir).await, reading)
}

/// The one pool of these agents.
fn gpu(node: pb::NodeStatus) -> pb::PoolStatus {
    node.pools.into_iter().next().expect("gpu0")
}

#[tokio::test]
async fn foreign_use_of_the_gpu_tightens_the_budget_until_it_exits() {
    // A 24 GB card with a foreign process holding 8 GB: 16 GB free.
    let workloads = sleeper("m15", "gpu0", 15, "") + &sleeper("m16", "gpu0", 16, "");
    let (mut d, reading) = gpu_daemon(16 * GB, "reserve = \"1GB\"", "", &workloads).await;
    let gpu0 = gpu(d.node().await);
    assert_eq!(
        gpu0.effective_budget_bytes,
        Some(15 * GB),
        "16 GB free less the 1 GB reserve"
    );
    assert_eq!(gpu0.available_bytes, Some(16 * GB));
    // 16 GB does not fit the live ceiling though it fits the budget.
    let e = d
        .client
        .start(start_req("m16", "big"))
        .await
        .expect_err("over the live ceiling");
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert_eq!(refusal_details(&e).0.reason, "HOST_MEMORY");
    assert!(
        e.message().starts_with(
            "unplaceable: 'm16' needs 16.0 GB but the live 'gpu0' pool has only 15.0 GB free"
        ),
        "{}",
        e.message()
    );
    // The foreign process exits: 24 GB free, the budget is back.
    std::fs::write(&reading, format!("{}\n", 24 * GB)).expect("reading");
    let back = eventually(async || gpu(d.node().await).effective_budget_bytes == Some(23 * GB));
    let back = back.await;
    assert!(back, "the budget came back (24 GB less the reserve)");
    d.client
        .start(start_req("m16", "big"))
        .await
        .expect("fits now");
    // A garbled reading is no reading: the configured budget stands, and a
    // reading above the budget never raises it.
    std::fs::write(&reading, "unknown\n").expect("reading");
    let place = pb::PlaceRequest {
        workload: "m16".into(),
        on_full: 0,
        ..Default::default()
    };
    let p = d.client.place(place).await.expect("place").into_inner();
    assert_eq!(p.pools[0].effective_budget_bytes, Some(24 * GB));
    assert!(!p.admitted, "16 + 16 GB exceed the 24 GB budget");
}

/// A GPU pool read from a file, an "old" model that takes a second to exit
/// on SIGTERM, and a "new" one that needs it gone.
async fn eviction_setup(recovery: &str) -> (Daemon, std::path::PathBuf) {
    let old = "[[workload]]\nname = \"old\"\ncommand = [\"/bin/sh\", \"-c\", \"trap 'sleep 1; exit 0' TERM; while true; do sleep 0.05; done\"]\nstop_grace = \"10s\"\n[workload.memory.gpu0]\nweights = \"16GB\"\n";
    let workloads = String::from(old) + &sleeper("new", "gpu0", 16, "");
    let node = format!("memory_recovery = \"{recovery}\"\n");
    let (mut d, reading) = gpu_daemon(24 * GB, "", &node, &workloads).await;
    d.started("old", "old").await;
    (d, reading)
}

/// The next event that moves instance `id` out of PENDING: its spawn.
async fn spawned(events: &mut tonic::Streaming<pb::Event>, id: &str) -> pb::Instance {
    use tokio_stream::StreamExt as _;
    loop {
        let e = events.next().await.expect("the watch goes on").expect("ok");
        if let Some(i) = e.instance
            && i.instance_id == id
            && i.state != pb::State::Pending as i32
        {
            return i;
        }
    }
}

/// How many times the agent must have read the probe, after the victim
/// exited while the memory does not show free, with the start still
/// unspawned: 15 rounds of its 20 ms re-reading (a start that did not wait
/// spawns at once, within one).
const READS: usize = 15;

/// Counts the reads of a file from now on: each read (a reading file is
/// opened, read and closed at every look) ends with an inotify
/// IN_CLOSE_NOWRITE; the test's own writes end with IN_CLOSE_WRITE.
struct Reads {
    inotify: nix::sys::inotify::Inotify,
    count: usize,
}

impl Reads {
    fn of(path: &std::path::Path) -> Self {
        use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
        let inotify =
            Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC).expect("inotify");
        inotify
            .add_watch(path, AddWatchFlags::IN_CLOSE_NOWRITE)
            .expect("watch the reading");
        Self { inotify, count: 0 }
    }

    /// Reads so far.
    fn count(&mut self) -> usize {
        loop {
            match self.inotify.read_events() {
                Ok(events) => self.count += events.len(),
                Err(nix::errno::Errno::EAGAIN) => return self.count,
                Err(e) => panic!("inotify: {e}"),
            }
        }
    }
}

#[tokio::test]
async fn a_start_waits_until_the_evicted_memory_shows_free_again() {
    let (mut d, reading) = eviction_setup("30s").await;
    let mut events = d.watch(0).await;
    let mut c = d.client.clone();
    let mut req = start_req("new", "new");
    req.on_full = pb::Policy::Evict as i32;
    let start = tokio::spawn(async move { c.start(req).await });
    // Admitted: the victim is stopping (it takes a second). Now the driver
    // reports its memory as still in use, even after it exits.
    d.wait_state("old", pb::State::Stopping).await;
    std::fs::write(&reading, format!("{}\n", 4 * GB)).expect("reading");
    d.wait_state("old", pb::State::Exited).await;
    // The victim is gone but only 4 GB show free (less than 3/4 of its
    // 16 GB): the new model must not be spawned. Nothing the agent shows
    // says "still waiting", so the control is the probe itself: the agent
    // read it READS times since, each time 4 GB, and the start is still
    // unspawned (no spawn event, not finished, PENDING).
    let mut reads = Reads::of(&reading);
    let began = tokio::time::Instant::now();
    let looked = eventually(async || reads.count() >= READS).await;
    let (n, took) = (reads.count(), began.elapsed());
    assert!(
        looked,
        "the agent read the probe {n} times in {took:?} while the start waited"
    );
    let early = tokio::time::timeout(
        std::time::Duration::from_millis(20),
        spawned(&mut events, "new"),
    )
    .await;
    assert!(
        early.is_err(),
        "the new model was spawned before the memory came back ({n} reads in {took:?}): {early:?}"
    );
    assert!(
        !start.is_finished(),
        "the start went ahead before the memory came back"
    );
    assert_eq!(d.get("new").await.state, pb::State::Pending as i32);
    eprintln!("the agent read the probe {n} times in {took:?} while the start waited");
    std::fs::write(&reading, format!("{}\n", 20 * GB)).expect("reading");
    let released = tokio::time::Instant::now();
    let spawn = tokio::time::timeout(PATIENCE, spawned(&mut events, "new")).await;
    assert_ne!(spawn.expect("spawned once the memory is back").pid, 0);
    let started = tokio::time::timeout(PATIENCE, start)
        .await
        .expect("in time")
        .expect("joined");
    let started = started.expect("the new model starts").into_inner();
    assert_eq!(started.evicted, ["old"]);
    assert!(released.elapsed() < PATIENCE);
    assert_ne!(started.instance.expect("instance").pid, 0);
}

#[tokio::test]
async fn the_wait_for_evicted_memory_is_bounded() {
    let (mut d, reading) = eviction_setup("500ms").await;
    std::fs::write(&reading, format!("{}\n", 24 * GB)).expect("reading");
    let mut req = start_req("new", "new");
    req.on_full = pb::Policy::Evict as i32;
    // The reading never shows the memory back (it drops to 1 GB once the
    // start has been admitted): the start goes ahead after the bound.
    let mut c = d.client.clone();
    let start = tokio::spawn(async move { c.start(req).await });
    d.wait_state("old", pb::State::Stopping).await;
    std::fs::write(&reading, format!("{}\n", GB)).expect("reading");
    let started = tokio::time::timeout(PATIENCE, start)
        .await
        .expect("in time")
        .expect("joined");
    started.expect("starts after the bound");
    assert!(
        d.log().contains("evicted memory not back in time"),
        "{}",
        d.log()
    );
    assert_eq!(d.get("old").await.state, pb::State::Exited as i32);
}

#[tokio::test]
async fn per_process_device_use_counts_as_touched_memory() {
    let workloads = sleeper("old", "gpu0", 16, "") + &sleeper("new", "gpu0", 16, "");
    let (mut d, reading) = gpu_daemon(24 * GB, "", "", &workloads).await;
    let old = d.started("old", "old").await;
    let place = pb::PlaceRequest {
        workload: "new".into(),
        on_full: pb::Policy::Evict as i32,
        ..Default::default()
    };
    // The device shows 8 GB free and, per process, that old holds its
    // 16 GB: evicting old gives them back, so new fits.
    std::fs::write(&reading, format!("{}\n{} {}\n", 8 * GB, old.pid, 16 * GB)).expect("reading");
    let p = d
        .client
        .place(place.clone())
        .await
        .expect("place")
        .into_inner();
    assert!(p.admitted, "{p:?}");
    assert_eq!(p.evict, ["old"]);
    // Without per-process accounting old's 16 GB count as not yet touched:
    // only the 8 GB shown free can be counted on, even after evicting.
    std::fs::write(&reading, format!("{}\n", 8 * GB)).expect("reading");
    let p = d.client.place(place).await.expect("place").into_inner();
    assert!(!p.admitted, "{p:?}");
    assert!(
        p.refusals.iter().any(|r| r
            .message
            .contains("less 16.0 GB declared but not yet in use")),
        "{p:?}"
    );
}

#[tokio::test]
async fn a_failing_probe_falls_back_to_the_budget_says_so_and_recovers() {
    let port = free_port();
    let node = format!("metrics_listen = \"127.0.0.1:{port}\"\n");
    let (mut d, reading) = gpu_daemon(10 * GB, "", &node, &sleeper("m4", "gpu0", 4, "")).await;
    let mut events = d.watch(0).await;
    assert_eq!(
        gpu(d.node().await).effective_budget_bytes,
        Some(10 * GB),
        "live"
    );
    // The probe fails (an unreadable reading, as an NVML error would be):
    // the configured 24 GB stand in.
    std::fs::write(&reading, "garbage\n").expect("reading");
    let fallback = until(async || {
        let g = gpu(d.node().await);
        (g.effective_budget_bytes == Some(24 * GB)).then_some(g)
    })
    .await;
    assert!(fallback.is_some(), "the configured budget stands in");
    let down = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        pool_event(&mut events, "no live reading"),
    );
    down.await.expect("a POOL event says the reading failed");
    assert!(
        d.log()
            .contains("no live reading: its configured budget stands in")
    );
    let metrics = tokio::task::spawn_blocking(move || crate::metrics::scrape(port))
        .await
        .expect("joined");
    assert!(
        metrics.contains("residentd_pool_live{pool=\"gpu0\"} 0"),
        "{metrics}"
    );
    assert!(
        metrics.contains("residentd_probe_failures_total{pool=\"gpu0\"} 1"),
        "{metrics}"
    );
    // Starts go on against the budget meanwhile.
    d.started("m4", "a").await;
    // Readings come back: live again.
    std::fs::write(&reading, format!("{}\n", 10 * GB)).expect("reading");
    let up = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        pool_event(&mut events, "are back"),
    );
    up.await.expect("a POOL event says readings are back");
    let live = until(async || {
        let g = gpu(d.node().await);
        (g.available_bytes == Some(10 * GB)).then_some(g)
    })
    .await;
    assert!(live.is_some(), "the live reading is used again");
    let metrics = tokio::task::spawn_blocking(move || crate::metrics::scrape(port))
        .await
        .expect("joined");
    assert!(
        metrics.contains("residentd_pool_live{pool=\"gpu0\"} 1"),
        "{metrics}"
    );
}

/// The next POOL event of gpu0 whose message has `want`.
async fn pool_event(events: &mut tonic::Streaming<pb::Event>, want: &str) -> pb::Event {
    use tokio_stream::StreamExt as _;
    loop {
        let e = events.next().await.expect("the watch goes on").expect("ok");
        if e.kind == pb::EventKind::Pool as i32 {
            assert_eq!(e.pool, "gpu0");
            if e.message.contains(want) {
                return e;
            }
        }
    }
}

#[test]
fn the_multi_gpu_example_checks_by_the_command_its_header_gives() {
    let example = workspace().join("examples/multi-gpu.toml");
    let text = std::fs::read_to_string(&example).expect("the example");
    let command = text
        .lines()
        .take_while(|l| l.starts_with('#'))
        .find_map(|l| l.trim_start_matches('#').trim().strip_prefix("residentd "))
        .expect("a residentd command in the header");
    let args: Vec<&str> = command.split_whitespace().collect();
    let out = std::process::Command::new(RESIDENTD)
        .args(&args)
        .current_dir(workspace())
        .output()
        .expect("residentd runs");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "`residentd {command}`: {stdout}{stderr}"
    );
    assert!(stdout.contains("valid (5 pools, 3 workloads)"), "{stdout}");
    // A build without NVML says what that means for each GPU pool.
    for gpu in ["gpu0", "gpu1", "gpu2", "gpu3"] {
        let warned = stderr.contains(&format!("pool '{gpu}': device = \"nvml:"))
            && stderr.contains("built without the nvml feature");
        assert_eq!(warned, !resident_probe::NVML_BUILT, "{gpu}: {stderr}");
    }
}
