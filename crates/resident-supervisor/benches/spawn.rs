//! Start 100 trivial children until all are running, then stop them all
//! (children that exit on SIGTERM), through the supervisor and through a
//! plain loop of tokio spawn / kill + wait (the floor), alternating in one
//! run. Prints medians and the ratios.
//!
//! The supervisor runs twice: with process groups only (`cgroups =
//! "off"`) and with a cgroup per instance (`"auto"`, on whatever hierarchy
//! the machine lets it write to). A further column runs the floor loop with a no-op `pre_exec`, which makes
//! std fork instead of posix_spawn (vfork): what spawning would cost if the
//! supervisor set the parent-death signal the easy way. It clones with
//! CLONE_VM | CLONE_VFORK instead (see `child.rs`).
//!
//! Run: `cargo bench -p resident-supervisor --bench spawn` (`-- --test`
//! runs one round, as CI's smoke does).

use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use resident_supervisor::{CgroupMode, LaunchSpec, State, Supervisor, SupervisorConfig};
use tokio::process::Command;

const CHILDREN: usize = 100;
const PROGRAM: &str = "/bin/sleep";

async fn floor_round(fork: bool) -> (Duration, Duration) {
    use std::os::unix::process::CommandExt as _;
    let t0 = Instant::now();
    let mut children = Vec::with_capacity(CHILDREN);
    for _ in 0..CHILDREN {
        let mut cmd = std::process::Command::new(PROGRAM);
        cmd.arg("3600").process_group(0);
        if fork {
            // SAFETY: the closure does nothing.
            unsafe { cmd.pre_exec(|| Ok(())) };
        }
        children.push(Command::from(cmd).spawn().expect("spawn"));
    }
    let started = t0.elapsed();
    let t1 = Instant::now();
    for c in &children {
        let pid = c.id().expect("running") as i32;
        kill(Pid::from_raw(pid), Signal::SIGTERM).expect("signal");
    }
    for c in &mut children {
        c.wait().await.expect("wait");
    }
    (started, t1.elapsed())
}

async fn supervisor_round(sup: &Supervisor, round: usize) -> (Duration, Duration) {
    let ids: Vec<String> = (0..CHILDREN).map(|i| format!("r{round}-{i}")).collect();
    let t0 = Instant::now();
    let starts = ids.iter().map(|id| {
        let mut spec = LaunchSpec::new(id.clone(), vec![PROGRAM.into(), "3600".into()]);
        spec.stop_grace = Duration::from_secs(10);
        let sup = sup.clone();
        tokio::spawn(async move {
            sup.start(spec).await.expect("start");
        })
    });
    for s in starts.collect::<Vec<_>>() {
        s.await.expect("join");
    }
    for id in &ids {
        sup.wait_for(id, |s| s.state == State::Ready)
            .await
            .expect("ready");
    }
    let started = t0.elapsed();
    let t1 = Instant::now();
    let stops = ids.iter().map(|id| {
        let (sup, id) = (sup.clone(), id.clone());
        tokio::spawn(async move { sup.stop(&id, None).await.expect("stop") })
    });
    let mut ended = Vec::new();
    for s in stops.collect::<Vec<_>>() {
        let st = s.await.expect("join");
        assert_eq!(st.state, State::Exited);
        ended.push(st);
    }
    let stopped = t1.elapsed();
    for st in &ended {
        sup.forget(&st.instance, st.generation);
    }
    (started, stopped)
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn supervisor(cgroups: CgroupMode) -> Supervisor {
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move { while rx.recv().await.is_some() {} });
    Supervisor::new(
        SupervisorConfig {
            cgroups,
            ..SupervisorConfig::default()
        },
        tx,
    )
}

fn main() {
    let smoke = std::env::args().any(|a| a == "--test");
    let rounds = if smoke { 1 } else { 15 };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let by_group = supervisor(CgroupMode::Off);
        let by_cgroup = supervisor(CgroupMode::Auto);
        // [start, stop] samples per column: floor, floor+fork, process
        // groups, cgroups.
        let mut cols: [[Vec<Duration>; 2]; 4] = Default::default();
        for round in 0..rounds {
            let results = [
                floor_round(false).await,
                floor_round(true).await,
                supervisor_round(&by_group, round).await,
                supervisor_round(&by_cgroup, round).await,
            ];
            for (col, (start, stop)) in cols.iter_mut().zip(results) {
                col[0].push(start);
                col[1].push(stop);
            }
        }
        let [floor, forked, groups, cgroups] = cols.map(|c| c.map(median));
        let ratio = |a: Duration, b: Duration| a.as_secs_f64() / b.as_secs_f64();
        println!("{CHILDREN} children of {PROGRAM}, median of {rounds} rounds, side by side");
        println!(
            "containment of the cgroup column: {}",
            by_cgroup.containment()
        );
        println!(
            "{:<26}{:>12}{:>12}{:>8}{:>12}{:>8}{:>12}{:>8}",
            "", "floor", "floor+fork", "ratio", "pgroups", "ratio", "cgroups", "ratio"
        );
        for (i, name) in ["start until all running", "stop all until all gone"]
            .iter()
            .enumerate()
        {
            let (f, k, g, c) = (floor[i], forked[i], groups[i], cgroups[i]);
            println!(
                "{name:<26}{f:>12.2?}{k:>12.2?}{:>8.2}{g:>12.2?}{:>8.2}{c:>12.2?}{:>8.2}",
                ratio(k, f),
                ratio(g, f),
                ratio(c, f)
            );
        }
        by_cgroup.shutdown().await;
    });
}
