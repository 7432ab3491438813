//! Restart with backoff, log capture under a flood, measured memory, the
//! parent-death signal, and events under concurrency.

use std::time::Duration;

use crate::support::*;
use resident_supervisor::{Exit, LogLimits, RestartMode, RestartPolicy, State, SupervisorConfig};
use tokio::time::Instant;

fn crash_loop(max_restarts: u32) -> RestartPolicy {
    RestartPolicy {
        mode: RestartMode::OnFailure,
        max_restarts,
        backoff: Duration::from_millis(100),
        backoff_max: Duration::from_secs(2),
        stable_after: Duration::from_secs(60),
    }
}

#[tokio::test]
async fn a_crash_loop_backs_off_longer_each_time_then_fails() {
    let mut h = Harness::new();
    let mut spec = child("crashy", &["exit=3"]);
    spec.restart = crash_loop(3);
    h.sup.start(spec).await.expect("starts");
    let failed = h.until("crashy", State::Failed).await;
    assert_eq!(
        failed.reason,
        "gave up after 3 restarts: exited with code 3"
    );
    assert_eq!((failed.restarts, failed.exit), (3, Some(Exit::Code(3))));
    use State::*;
    // With no readiness probe a run is READY at once, unless its exit wins
    // the race; leave READY out of the comparison.
    let mut states = h.states("crashy");
    states.retain(|s| *s != Ready);
    #[rustfmt::skip]
    let expected = [Pending, Starting, Backoff, Starting, Backoff, Starting, Backoff, Starting, Failed];
    assert_eq!(states, expected);
    // Each backoff announces its delay, and the next start waits at least that.
    let events: Vec<_> = h
        .seen
        .iter()
        .filter(|(_, s)| &*s.instance == "crashy")
        .collect();
    let mut gaps = Vec::new();
    for pair in events.windows(2) {
        let ((t0, a), (t1, b)) = (pair[0], pair[1]);
        if a.state == Backoff && b.state == Starting {
            gaps.push((a.reason.clone(), *t1 - *t0));
        }
    }
    let delays = [100, 200, 400];
    assert_eq!(gaps.len(), 3);
    for (i, ((reason, gap), ms)) in gaps.iter().zip(delays).enumerate() {
        assert_eq!(
            *reason,
            format!("exited with code 3; restart {} of 3 in {ms}ms", i + 1)
        );
        assert!(
            *gap >= Duration::from_millis(ms),
            "restart {} came after {gap:?}",
            i + 1
        );
    }
}

#[tokio::test]
async fn always_restarts_clean_exits_and_a_stop_during_backoff_ends_it() {
    let mut h = Harness::new();
    let mut spec = child("again", &["exit=0"]);
    spec.restart = RestartPolicy {
        mode: RestartMode::Always,
        backoff: Duration::from_secs(30),
        ..crash_loop(10)
    };
    h.sup.start(spec).await.expect("starts");
    let backoff = h.until("again", State::Backoff).await;
    assert_eq!(backoff.restarts, 1);
    let asked = Instant::now();
    let stopped = h.sup.stop("again", None).await.expect("stops");
    assert!(
        asked.elapsed() < Duration::from_secs(5),
        "the stop did not wait out the backoff"
    );
    assert_eq!(
        (stopped.state, stopped.reason.as_str()),
        (State::Exited, "stopped during backoff")
    );
}

#[tokio::test]
async fn a_stable_run_resets_the_backoff() {
    let mut h = Harness::new();
    let mut spec = child("stable", &["sleep=300", "exit=1"]);
    spec.restart = RestartPolicy {
        stable_after: Duration::from_millis(200),
        ..crash_loop(2)
    };
    h.sup.start(spec).await.expect("starts");
    // Every run lasts longer than stable_after, so every restart is the
    // first of a series: same delay, and the limit of 2 is never reached.
    for _ in 0..3 {
        let b = h.until("stable", State::Backoff).await;
        assert!(
            b.reason.ends_with("restart 1 of 2 in 100ms"),
            "{}",
            b.reason
        );
    }
    h.sup.stop("stable", None).await.expect("stops");
}

fn own_rss_bytes() -> u64 {
    let stat = resident_supervisor::procfs::stat(std::process::id() as i32).expect("own stat");
    stat.rss_pages * resident_supervisor::procfs::page_size()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_child_neither_blocks_nor_grows_the_agent() {
    let limits = LogLimits {
        lines: 1_000,
        bytes: 256 << 10,
        max_line: 4 << 10,
        follow_buffer: 64,
    };
    let mut h = Harness::with(SupervisorConfig {
        logs: limits,
        ..SupervisorConfig::default()
    });
    let before = own_rss_bytes();
    // 10 MB/s of 108-byte lines for 3 s.
    h.sup
        .start(child("flood", &["flood=10,3", "exit=0"]))
        .await
        .expect("starts");
    let ended = h.until_any("flood", &[State::Exited, State::Failed]).await;
    assert_eq!(ended.state, State::Exited, "{}", ended.reason);
    let logs = h.sup.logs("flood").expect("a log");
    assert!(logs.held_bytes() <= 256 << 10);
    let tail = logs.tail(100);
    assert_eq!(tail.len(), 100);
    // In order, without gaps, ending with the child's last line.
    assert!(tail.windows(2).all(|w| w[1].seq == w[0].seq + 1));
    let last = &tail[99].line;
    let written: u64 = last
        .strip_prefix("flood done ")
        .and_then(|n| n.parse().ok())
        .expect(last);
    // The child kept its pace: it wrote at least half of 30 MB in its 3 s
    // (it only writes as fast as its pipe is drained).
    assert!(
        written * 108 >= 15 << 20,
        "the child was held back: {written} lines"
    );
    assert_eq!(tail[98].line, format!("{written:08} {}", "x".repeat(99)));
    let grew = own_rss_bytes().saturating_sub(before);
    println!("flood: {written} lines captured, agent RSS grew {grew} bytes");
    assert!(grew < 32 << 20, "agent memory grew by {grew} bytes");
}

#[tokio::test]
async fn measured_bytes_track_the_group_resident_memory() {
    let config = SupervisorConfig {
        sample_every: Duration::from_millis(100),
        ..SupervisorConfig::default()
    };
    let h = Harness::with(config);
    let before = std::time::SystemTime::now();
    h.sup
        .start(child("hog", &["alloc=200", "forever"]))
        .await
        .expect("starts");
    let target = 200u64 << 20;
    let settled = h
        .sup
        .wait_for("hog", |s| s.measured_bytes >= target * 9 / 10);
    let status = tokio::time::timeout(PATIENCE, settled)
        .await
        .expect("measured in time")
        .expect("known");
    let measured = status.measured_bytes;
    println!("hog: measured {measured} bytes for 200 MiB touched");
    assert!(
        measured.abs_diff(target) <= target / 10,
        "measured {measured}"
    );
    let at = status.measured_at.expect("a sample says when it was taken");
    assert!(
        at >= before,
        "sampled at {at:?}, before the start {before:?}"
    );
    // Samples go on while the bytes stay the same: the time moves on.
    let later = async {
        loop {
            let now = h.sup.status("hog").expect("known").measured_at;
            if now.is_some_and(|t| t > at) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(PATIENCE, later)
        .await
        .expect("sampled again in time");
    let stopped = h.sup.stop("hog", None).await.expect("stops");
    assert_eq!(stopped.measured_bytes, 0, "an ended instance holds nothing");
    assert_eq!(stopped.measured_at, None, "nor was it measured to");
}

#[tokio::test]
async fn killing_the_agent_takes_its_children_within_a_second() {
    let (mut agent, pid) = supervise(&[TESTCHILD, "forever"]);
    assert!(alive(pid));
    agent.kill().expect("kill -9 the agent");
    agent.wait().expect("reap the agent");
    let gone = eventually(Duration::from_secs(1), || std::future::ready(!alive(pid))).await;
    assert!(gone, "child {pid} outlived its agent by more than a second");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_transition_is_lost_under_concurrency() {
    let mut h = Harness::new();
    let n = 40;
    let starts = (0..n).map(|i| {
        let sup = h.sup.clone();
        let steps: &[&str] = if i % 2 == 0 {
            &["exit=0"]
        } else {
            &["forever"]
        };
        let spec = child(&format!("c{i}"), steps);
        tokio::spawn(async move { sup.start(spec).await })
    });
    for s in starts.collect::<Vec<_>>() {
        s.await.expect("joined").expect("started");
    }
    let stops = (1..n).step_by(2).map(|i| {
        let sup = h.sup.clone();
        tokio::spawn(async move { sup.stop(&format!("c{i}"), None).await })
    });
    for s in stops.collect::<Vec<_>>() {
        s.await.expect("joined").expect("stopped");
    }
    for i in 0..n {
        h.until(&format!("c{i}"), State::Exited).await;
    }
    use State::*;
    for i in 0..n {
        let id = format!("c{i}");
        let want: &[State] = if i % 2 == 0 {
            &[Pending, Starting, Exited]
        } else {
            &[Pending, Starting, Stopping, Exited]
        };
        let mut states = h.states(&id);
        // READY comes at once with no probe, unless a quick exit wins.
        states.retain(|s| *s != Ready);
        assert_eq!(states, want, "{id}");
    }
}
