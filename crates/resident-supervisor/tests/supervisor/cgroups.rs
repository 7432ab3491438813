//! Per-instance cgroups on the real machine: a process that leaves its
//! group (`setsid()`) is still stopped with its instance, a run over its
//! memory limit is OOM-killed and reported, the cgroups a killed agent
//! left are cleared by the next one, and a run's output pipes serve a
//! later run only when its emptied cgroup shows nothing can still write.

use std::time::Duration;

use crate::support::*;
use resident_supervisor::{CgroupMode, State, SupervisorConfig, procfs};

fn with_cgroups(mode: CgroupMode) -> Harness {
    Harness::with(SupervisorConfig {
        cgroups: mode,
        ..SupervisorConfig::default()
    })
}

#[tokio::test]
async fn an_escaped_helper_dies_with_its_instance() {
    if !cgroups_usable() {
        return;
    }
    let h = with_cgroups(CgroupMode::Auto);
    assert!(h.sup.uses_cgroups(), "{}", h.sup.containment());
    let status = h
        .sup
        .start(child("runner", &["escapee", "forever"]))
        .await
        .expect("starts");
    let pgid = status.pid.expect("a pid") as i32;
    let escapee = logged_number(&h.sup, "runner", "escapee").await;
    let left_group = eventually(PATIENCE, || {
        std::future::ready(procfs::stat(escapee).is_some_and(|s| s.pgrp != pgid))
    })
    .await;
    assert!(left_group, "the helper left the instance's process group");
    h.sup.stop("runner", None).await.expect("stops");
    assert!(
        !alive(escapee),
        "the escaped helper {escapee} outlived its instance"
    );
}

#[tokio::test]
async fn without_cgroups_an_escaped_helper_survives() {
    // The other side of the test above: it shows that the cgroup, not the
    // process group, is what caught the helper.
    let h = with_cgroups(CgroupMode::Off);
    assert!(!h.sup.uses_cgroups());
    h.sup
        .start(child("runner", &["escapee", "forever"]))
        .await
        .expect("starts");
    let escapee = logged_number(&h.sup, "runner", "escapee").await;
    let escaped = eventually(PATIENCE, || {
        std::future::ready(procfs::stat(escapee).is_some_and(|s| s.pgrp == escapee))
    })
    .await;
    assert!(escaped, "the helper leads a session of its own");
    h.sup.stop("runner", None).await.expect("stops");
    let survived = alive(escapee);
    // The escapee still holds the run's stdout: the next run gets a pipe
    // of its own, so nothing the escapee writes lands in another's log.
    let held = output_pipe(escapee);
    let next = h
        .sup
        .start(child("next", &["forever"]))
        .await
        .expect("starts");
    let next_pipe = output_pipe(next.pid.expect("a pid") as i32);
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(escapee),
        nix::sys::signal::Signal::SIGKILL,
    );
    h.sup.stop("next", None).await.expect("stops");
    assert!(survived, "process groups alone cannot contain a setsid()");
    assert_ne!(
        held, next_pipe,
        "a pipe an escapee holds went to another run"
    );
}

/// The pipe a process's stdout is (`pipe:[INODE]`).
fn output_pipe(pid: i32) -> String {
    let link =
        std::fs::read_link(format!("/proc/{pid}/fd/1")).expect("the stdout of a live process");
    link.display().to_string()
}

#[tokio::test]
async fn an_emptied_runs_pipes_serve_the_next_run_with_its_own_lines_only() {
    if !cgroups_usable() {
        return;
    }
    let h = with_cgroups(CgroupMode::Auto);
    let first = h
        .sup
        .start(child(
            "first",
            &["print=first out", "eprint=first err", "forever"],
        ))
        .await
        .expect("starts");
    let first_pipe = output_pipe(first.pid.expect("a pid") as i32);
    logged_line(&h.sup, "first", "first out").await;
    logged_line(&h.sup, "first", "first err").await;
    h.sup.stop("first", None).await.expect("stops");
    // Another instance, started after the first's cgroup emptied: it
    // writes into the same pipe, and its log holds its own lines alone.
    let second = h
        .sup
        .start(child("second", &["print=second out", "forever"]))
        .await
        .expect("starts");
    let second_pipe = output_pipe(second.pid.expect("a pid") as i32);
    logged_line(&h.sup, "second", "second out").await;
    h.sup.stop("second", None).await.expect("stops");
    assert!(first_pipe.starts_with("pipe:"), "{first_pipe}");
    assert_eq!(first_pipe, second_pipe, "an emptied run's pipe is reused");
    let lines = h.lines("second", 50);
    assert_eq!(lines, ["second out"]);
    let first_lines = h.lines("first", 50).len();
    assert_eq!(first_lines, 2, "the first run's log gained nothing later");
}

#[tokio::test]
async fn a_run_over_its_memory_limit_is_oom_killed_and_reported() {
    if !cgroups_usable() {
        return;
    }
    let mut h = with_cgroups(CgroupMode::Auto);
    if !h.sup.limits_memory() {
        return skip(&format!(
            "no memory controller to write to: {}",
            h.sup.containment()
        ));
    }
    let mut spec = child("hog", &["alloc=256", "forever"]);
    spec.memory_limit = Some(128 << 20);
    h.sup.start(spec).await.expect("starts");
    let failed = h.until_any("hog", &[State::Failed, State::Exited]).await;
    assert_eq!(failed.state, State::Failed, "{}", failed.reason);
    assert!(failed.oom_killed, "{failed:?}");
    assert_eq!(failed.exit.map(|e| e.code()), Some(128 + 9));
    assert!(
        failed.reason.contains(&format!(
            "OOM-killed at its memory limit of {} bytes",
            128 << 20
        )),
        "{}",
        failed.reason
    );
    // Under the limit, the same program runs.
    let mut spec = child("fits", &["alloc=64", "print=done", "forever"]);
    spec.memory_limit = Some(128 << 20);
    h.sup.start(spec).await.expect("starts");
    logged_line(&h.sup, "fits", "done").await;
    let stopped = h.sup.stop("fits", None).await.expect("stops");
    assert!(!stopped.oom_killed, "{stopped:?}");
}

#[tokio::test]
async fn memory_counts_processes_that_left_the_group() {
    if !cgroups_usable() {
        return;
    }
    let h = Harness::with(SupervisorConfig {
        sample_every: Duration::from_millis(50),
        ..SupervisorConfig::default()
    });
    // The escapee allocates; the leader holds almost nothing.
    h.sup
        .start(child("split", &["escapee-alloc=100", "forever"]))
        .await
        .expect("starts");
    logged_number(&h.sup, "split", "escapee").await;
    let measured = h
        .sup
        .wait_for("split", |s| s.measured_bytes >= 100 << 20)
        .await;
    let stopped = h.sup.stop("split", None).await.expect("stops");
    assert!(
        measured.is_some(),
        "measured {} bytes, the escapee holds 100 MB",
        stopped.measured_bytes
    );
}

#[tokio::test]
async fn the_next_agent_clears_what_a_killed_agent_left_in_its_cgroups() {
    if !cgroups_usable() {
        return;
    }
    let (mut agent, leader) = supervise(&[TESTCHILD, "escapee", "forever"]);
    let mut escapee = None;
    let found = eventually(PATIENCE, || {
        escapee = procfs::scan()
            .into_iter()
            .find(|s| s.pid != leader && s.pgrp == s.pid && s.ppid == leader)
            .map(|s| s.pid);
        std::future::ready(escapee.is_some())
    })
    .await;
    assert!(found, "the child's escaped helper appeared");
    let escapee = escapee.expect("found above");
    agent.kill().expect("kill -9 the agent");
    agent.wait().expect("reap the agent");
    // The parent-death signal takes the leader; the escapee has none.
    let leader_gone = eventually(PATIENCE, || std::future::ready(!alive(leader))).await;
    assert!(leader_gone);
    assert!(alive(escapee), "nothing but a cgroup holds the escapee now");
    // A new supervisor finds the dead agent's cgroups and clears them.
    let h = with_cgroups(CgroupMode::Auto);
    assert!(h.sup.uses_cgroups());
    let cleared = eventually(PATIENCE, || std::future::ready(!alive(escapee))).await;
    assert!(
        cleared,
        "the escapee {escapee} survived the next agent's start"
    );
}
