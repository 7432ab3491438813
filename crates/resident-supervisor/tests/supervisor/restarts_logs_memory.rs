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

/// The flood of these tests: 10 MB/s of 108-byte lines for 3 s, then
/// `flood done N` (N: the lines written; the child only writes as fast as
/// its pipe is drained).
const FLOOD: &[&str] = &["flood=10,3", "exit=0"];

/// The N of a `flood done N` line.
fn flood_done(line: &str) -> u64 {
    line.strip_prefix("flood done ")
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("not the flood's last line: {line:?}"))
}

/// The flood run with no supervisor: the child's stdout drained by a bare
/// loop of 64 KB reads here. The lines it wrote.
fn unsupervised_flood() -> u64 {
    use std::io::Read as _;
    let mut child = std::process::Command::new(TESTCHILD)
        .args(FLOOD)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("the test child runs");
    let mut out = child.stdout.take().expect("piped");
    let mut buf = vec![0u8; 64 << 10];
    let mut tail: Vec<u8> = Vec::new();
    loop {
        let n = out.read(&mut buf).expect("read the flood");
        if n == 0 {
            break;
        }
        tail.extend_from_slice(&buf[..n]);
        let keep = tail.len().saturating_sub(256);
        tail.drain(..keep);
    }
    assert!(child.wait().expect("reaped").success());
    let text = String::from_utf8_lossy(&tail);
    flood_done(text.lines().last().expect("a last line"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_child_neither_blocks_nor_loses_its_order() {
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
    // The same flood, at the same time, drained by a bare loop: what this
    // machine allows now, the floor's measure.
    let bare = tokio::task::spawn_blocking(unsupervised_flood);
    h.sup.start(child("flood", FLOOD)).await.expect("starts");
    let ended = h.until_any("flood", &[State::Exited, State::Failed]).await;
    assert_eq!(ended.state, State::Exited, "{}", ended.reason);
    let bare = bare.await.expect("the bare drain");
    let logs = h.sup.logs("flood").expect("a log");
    assert!(logs.held_bytes() <= 256 << 10);
    let tail = logs.tail(100);
    assert_eq!(tail.len(), 100);
    // In order, without gaps, ending with the child's last line.
    assert!(tail.windows(2).all(|w| w[1].seq == w[0].seq + 1));
    let written = flood_done(&tail[99].line);
    assert_eq!(tail[98].line, format!("{written:08} {}", "x".repeat(99)));
    println!(
        "flood: {written} lines through the supervisor, {bare} drained bare beside it ({} MB and {} MB in 3 s)",
        (written * 108) >> 20,
        (bare * 108) >> 20
    );
    // The supervisor keeps the child's pace: at least half of what the
    // bare drain let the same child write beside it.
    assert!(
        written * 2 >= bare,
        "the child was held back: {written} lines, against {bare} drained bare"
    );
}

/// VmRSS and VmHWM (its peak) of process `pid`, in bytes.
fn rss_and_peak(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("a status");
    let kb = |key: &str| -> u64 {
        let line = status.lines().find_map(|l| l.strip_prefix(key));
        let kb: Option<u64> = line.and_then(|v| v.split_whitespace().next()?.parse().ok());
        kb.unwrap_or_else(|| panic!("{key} of {pid}")) * 1024
    };
    (kb("VmRSS:"), kb("VmHWM:"))
}

/// The supervisor's memory under the flood, measured in a process of its
/// own (`resident-supervise`, default log limits: 2,000 lines, 1 MB), where
/// nothing else of the test runs: its peak once the flood is over, against
/// what it held before the flood began.
#[test]
fn a_flooding_child_does_not_grow_the_supervisor() {
    use std::io::BufRead as _;
    let mut steps = vec![TESTCHILD, "sleep=500"];
    steps.extend(FLOOD);
    let agent = std::process::Command::new(env!("CARGO_BIN_EXE_resident-supervise"))
        .arg("--")
        .args(&steps)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("start resident-supervise");
    let mut agent = Killed(agent);
    let pid = agent.0.id();
    let mut line = String::new();
    std::io::BufReader::new(agent.0.stdout.take().expect("piped"))
        .read_line(&mut line)
        .expect("it reports its child");
    assert!(line.starts_with("pid="), "{line}");
    // The child sleeps half a second before it floods.
    let (before, _) = rss_and_peak(pid);
    // Its events, one a line on stderr: wait for the child's end.
    let events = std::io::BufReader::new(agent.0.stderr.take().expect("piped"));
    let mut seen = Vec::new();
    for event in events.lines() {
        let event = event.expect("an event");
        let done = event.starts_with("supervised EXITED") || event.starts_with("supervised FAILED");
        seen.push(event);
        if done {
            break;
        }
    }
    let last = seen.last().cloned().unwrap_or_default();
    assert!(last.starts_with("supervised EXITED"), "{seen:?}");
    let (after, peak) = rss_and_peak(pid);
    let grew = peak.saturating_sub(before);
    println!(
        "flood: resident-supervise RSS {} KB before, {} KB after, peak {} KB",
        before >> 10,
        after >> 10,
        peak >> 10
    );
    // What it may hold more: its 1 MB of log, read buffers, and slack.
    assert!(
        grew < 4 << 20,
        "the supervisor grew by {grew} bytes under the flood ({} KB to a peak of {} KB)",
        before >> 10,
        peak >> 10
    );
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
