//! Spawn, readiness, stop, exit reporting and containment, with real
//! child processes and real signals.

use std::time::Duration;

use crate::support::*;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use resident_supervisor::{Exit, Readiness, State, procfs};
use tokio::time::Instant;

#[tokio::test]
async fn http_readiness_waits_through_503_until_200() {
    let mut h = Harness::new();
    let mut spec = child("web", &["http=/health,400"]);
    spec.env.insert("PORT".into(), "${PORT}".into());
    spec.readiness = Readiness::Http {
        path: "/health".into(),
    };
    spec.readiness_timeout = Duration::from_secs(20);
    let started = Instant::now();
    let status = h.sup.start(spec).await.expect("starts");
    assert_eq!(status.state, State::Starting);
    h.until("web", State::Ready).await;
    // The child answers 503 for its first 400 ms: ready cannot come sooner.
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert_eq!(
        h.states("web"),
        [State::Pending, State::Starting, State::Ready]
    );
    let stopped = h.sup.stop("web", None).await.expect("stops");
    assert_eq!(stopped.state, State::Exited);
}

#[tokio::test]
async fn never_ready_is_killed_after_the_timeout_and_fails() {
    let mut h = Harness::new();
    let mut spec = child("slow", &["http=/health,3600000"]);
    spec.env.insert("PORT".into(), "${PORT}".into());
    spec.readiness = Readiness::Http {
        path: "/health".into(),
    };
    spec.readiness_timeout = Duration::from_millis(300);
    let pid = h.sup.start(spec).await.expect("starts").pid.expect("a pid") as i32;
    let failed = h.until("slow", State::Failed).await;
    assert_eq!(failed.reason, "not ready within 300ms");
    assert!(!alive(pid), "the never-ready child was stopped");
    assert!(h.states("slow").contains(&State::Stopping));
}

#[tokio::test]
async fn tcp_readiness_and_an_exit_during_readiness_fails_at_once() {
    let mut h = Harness::new();
    let mut spec = child("early-exit", &["sleep=50", "exit=4"]);
    spec.readiness = Readiness::Tcp;
    spec.readiness_timeout = Duration::from_secs(3600);
    h.sup.start(spec).await.expect("starts");
    let failed = h.until("early-exit", State::Failed).await;
    assert_eq!(failed.exit, Some(Exit::Code(4)));

    let mut spec = child("tcp", &["http=/x,0"]);
    spec.env.insert("PORT".into(), "${PORT}".into());
    spec.readiness = Readiness::Tcp;
    h.sup.start(spec).await.expect("starts");
    h.until("tcp", State::Ready).await;
    h.sup.stop("tcp", None).await.expect("stops");
}

#[tokio::test]
async fn ignoring_sigterm_gets_sigkill_after_the_grace() {
    let h = Harness::new();
    h.sup
        .start(child(
            "stubborn",
            &["ignore-term", "print=ignoring", "forever"],
        ))
        .await
        .expect("starts");
    let logs = h.sup.logs("stubborn").expect("a log");
    assert!(
        eventually(PATIENCE, || async { !logs.tail(1).is_empty() }).await,
        "the child set up its handler"
    );
    let grace = Duration::from_millis(300);
    let asked = Instant::now();
    let stopped = h.sup.stop("stubborn", Some(grace)).await.expect("stops");
    let took = asked.elapsed();
    assert_eq!(stopped.exit, Some(Exit::Signal(9)));
    assert!(took >= grace, "SIGKILL came before the grace: {took:?}");
    assert!(took < grace + Duration::from_secs(2), "stop took {took:?}");
    assert_eq!(stopped.reason, "stopped (killed by SIGKILL (9))");
}

#[tokio::test]
async fn stop_leaves_no_process_of_the_group() {
    let h = Harness::new();
    let status = h
        .sup
        .start(child("forker", &["grandchild", "forever"]))
        .await
        .expect("starts");
    let pgid = status.pid.expect("a pid") as i32;
    let logs = h.sup.logs("forker").expect("a log");
    let mut grandchild = None;
    let found = eventually(PATIENCE, || {
        grandchild = logs
            .tail(10)
            .iter()
            .find_map(|l| l.line.strip_prefix("grandchild=")?.parse::<i32>().ok());
        std::future::ready(grandchild.is_some())
    })
    .await;
    assert!(found, "the child reported its grandchild");
    let grandchild = grandchild.expect("found above");
    assert_eq!(
        procfs::stat(grandchild).map(|s| s.pgrp),
        Some(pgid),
        "same group"
    );
    h.sup.stop("forker", None).await.expect("stops");
    assert!(
        procfs::group_members(pgid).is_empty(),
        "members left: {:?}",
        procfs::group_members(pgid)
    );
    assert!(!alive(grandchild));
}

#[tokio::test]
async fn a_leader_that_exits_takes_its_helpers_with_it() {
    let mut h = Harness::new();
    let status = h
        .sup
        .start(child("leaver", &["grandchild", "sleep=100", "exit=0"]))
        .await
        .expect("starts");
    let pgid = status.pid.expect("a pid") as i32;
    let exited = h.until("leaver", State::Exited).await;
    assert_eq!(exited.exit, Some(Exit::Code(0)));
    assert!(procfs::group_members(pgid).is_empty());
}

#[tokio::test]
async fn exit_codes_and_signals_are_reported_exactly() {
    let mut h = Harness::new();
    h.sup
        .start(child("seven", &["exit=7"]))
        .await
        .expect("starts");
    let failed = h.until("seven", State::Failed).await;
    assert_eq!(
        (failed.exit, failed.reason.as_str()),
        (Some(Exit::Code(7)), "exited with code 7")
    );

    h.sup
        .start(child("zero", &["exit=0"]))
        .await
        .expect("starts");
    let exited = h.until("zero", State::Exited).await;
    assert_eq!(exited.exit, Some(Exit::Code(0)));

    // SIGUSR1, not SIGSEGV: Rust's runtime in the child catches a SIGSEGV
    // (its stack-overflow guard) and would survive one sent by kill.
    let started = h.sup.start(child("victim", &["print=up", "forever"])).await;
    let pid = started.expect("starts").pid.expect("pid");
    let logs = h.sup.logs("victim").expect("a log");
    assert!(
        eventually(PATIENCE, || async { !logs.tail(1).is_empty() }).await,
        "the child runs"
    );
    kill(Pid::from_raw(pid as i32), Signal::SIGUSR1).expect("signal the child");
    let failed = h.until("victim", State::Failed).await;
    assert_eq!(failed.exit, Some(Exit::Signal(10)));
    assert_eq!(failed.reason, "killed by SIGUSR1 (10)");
    assert_eq!(failed.exit.map(Exit::code), Some(138));
}

#[tokio::test]
async fn a_program_that_cannot_start_fails_with_the_reason() {
    let h = Harness::new();
    let mut spec = child("missing", &[]);
    spec.argv = vec!["/nonexistent/llama-server".into()];
    let status = h.sup.start(spec).await.expect("the start is accepted");
    assert_eq!(status.state, State::Failed);
    assert!(
        status
            .reason
            .starts_with("cannot start \"/nonexistent/llama-server\""),
        "{}",
        status.reason
    );
}

#[tokio::test]
async fn environment_is_cleared_and_macros_expand() {
    let mut h = Harness::new();
    let mut spec = child(
        "envy",
        &[
            "env=PATH",
            "env=CARGO",
            "env=WHO",
            "print=${INSTANCE}/${WORKLOAD}/${ROLE}",
            "exit=0",
        ],
    );
    spec.workload = "coder".into();
    spec.role = "writer".into();
    spec.env.insert("WHO".into(), "${INSTANCE}:${PORT}".into());
    let port = h.sup.start(spec).await.expect("starts").port;
    h.until("envy", State::Exited).await;
    let lines = h.lines("envy", 10);
    assert!(lines[0].starts_with("PATH="), "PATH is kept: {lines:?}");
    // cargo sets CARGO for the test; the cleared environment drops it.
    assert_eq!(lines[1], "CARGO unset");
    assert_eq!(lines[2], format!("WHO=envy:{port}"));
    assert_eq!(lines[3], "envy/coder/writer");
}

#[tokio::test]
async fn a_child_holds_its_three_streams_and_nothing_else_of_the_agent() {
    let h = Harness::new();
    // An agent with many descriptors open, one of them without
    // close-on-exec (nix's dup sets no flag): the run's output pipes are
    // made after them.
    let file = std::fs::File::open("/proc/self/status").expect("open");
    let many: Vec<std::fs::File> = (0..300)
        .map(|_| file.try_clone().expect("a descriptor"))
        .collect();
    let leaky = nix::unistd::dup(&file).expect("dup");
    let spec = child("fds", &["fds", "eprint=to stderr", "forever"]);
    let pid = h.sup.start(spec).await.expect("starts").pid.expect("a pid");
    let printed = eventually(PATIENCE, || async { h.lines("fds", 10).len() == 2 }).await;
    let lines = h.lines("fds", 10);
    assert!(printed, "{lines:?}");
    // The child's table was never a copy of the agent's large one (exec
    // keeps a table's size).
    let agent = fd_table_size(std::process::id());
    let size = fd_table_size(pid);
    h.sup.stop("fds", None).await.expect("stops");
    // Both streams reached the agent through their pipes.
    assert!(lines.iter().any(|l| l == "to stderr"), "{lines:?}");
    assert!(
        lines.iter().any(|l| l == "fds 0 1 2"),
        "only stdin, stdout and stderr, not {} nor any of {}: {lines:?}",
        std::os::fd::AsRawFd::as_raw_fd(&leaky),
        many.len(),
    );
    assert!(agent >= 512, "the agent's table holds {agent}");
    assert!(
        size < agent,
        "the child's table holds {size}, the agent's {agent}"
    );
}

#[tokio::test]
async fn starting_a_live_instance_twice_is_refused() {
    let h = Harness::new();
    h.sup
        .start(child("once", &["forever"]))
        .await
        .expect("starts");
    let again = h.sup.start(child("once", &["forever"])).await;
    assert!(matches!(
        again,
        Err(resident_supervisor::SupervisorError::AlreadyRunning(_))
    ));
    h.sup
        .stop("once", Some(Duration::from_secs(1)))
        .await
        .expect("stops");
    // Ended: it may start again, and its log continues.
    h.sup
        .start(child("once", &["print=second", "forever"]))
        .await
        .expect("restarts");
    h.sup.stop("once", None).await.expect("stops");
}

#[tokio::test]
async fn shutdown_stops_every_child_in_parallel() {
    let h = Harness::new();
    let grace = Duration::from_millis(500);
    let mut pids = Vec::new();
    for i in 0..4 {
        let mut spec = child(&format!("s{i}"), &["ignore-term", "print=up", "forever"]);
        spec.stop_grace = grace;
        pids.push(h.sup.start(spec).await.expect("starts").pid.expect("pid") as i32);
    }
    for i in 0..4 {
        let logs = h.sup.logs(&format!("s{i}")).expect("a log");
        assert!(eventually(PATIENCE, || async { !logs.tail(1).is_empty() }).await);
    }
    let asked = Instant::now();
    h.sup.shutdown().await;
    let took = asked.elapsed();
    assert!(pids.iter().all(|p| !alive(*p)));
    // One grace, not four: they were stopped side by side.
    assert!(took >= grace && took < grace * 3, "shutdown took {took:?}");
    assert!(
        h.sup.start(child("late", &["forever"])).await.is_err(),
        "no start after shutdown"
    );
}

#[tokio::test]
async fn run_as_drops_to_the_user_and_its_group_only() {
    if !nix::unistd::getuid().is_root() {
        return skip("changing users needs root");
    }
    let mut h = Harness::new();
    let mut spec = child("nobody", &[]);
    spec.argv = vec!["/bin/sh".into(), "-c".into(), "id -u; id -g; id -G".into()];
    spec.user = Some((65534, 65534));
    h.sup.start(spec).await.expect("starts");
    h.until("nobody", State::Exited).await;
    let lines = h.lines("nobody", 3);
    assert_eq!(
        lines,
        ["65534", "65534", "65534"],
        "uid, gid and no supplementary group of root's"
    );
}

/// A child holds no capability of the agent's: its permitted, effective,
/// inheritable and ambient sets are empty and `no_new_privs` is set, as
/// root (which would otherwise keep every capability) and as another user.
/// Before, a root agent's child ran with every capability (`CapEff:
/// 000001ffffffffff`).
#[tokio::test]
async fn a_child_starts_with_no_capability_and_no_new_privileges() {
    let mut h = Harness::new();
    let read = "grep -E '^(CapInh|CapPrm|CapEff|CapAmb|NoNewPrivs):' /proc/self/status";
    let mut users = vec![("as-agent", None)];
    if nix::unistd::getuid().is_root() {
        users.push(("as-nobody", Some((65534, 65534))));
    }
    for (id, user) in users {
        let mut spec = child(id, &[]);
        spec.argv = vec!["/bin/sh".into(), "-c".into(), read.into()];
        spec.user = user;
        h.sup.start(spec).await.expect("starts");
        h.until(id, State::Exited).await;
        let lines = h.lines(id, 5);
        for line in &lines {
            let (key, value) = line.split_once(':').expect("key: value");
            let want = if key == "NoNewPrivs" {
                "1"
            } else {
                "0000000000000000"
            };
            assert_eq!(value.trim(), want, "{id}: {lines:?}");
        }
    }
}

/// With its user's supplementary groups (a model's user added to the
/// group of the GPU's device nodes), the child has them, and nothing of
/// root's.
#[tokio::test]
async fn run_as_takes_the_users_supplementary_groups() {
    if !nix::unistd::getuid().is_root() {
        return skip("changing users needs root");
    }
    let mut h = Harness::new();
    let mut spec = child("grouped", &[]);
    spec.argv = vec!["/bin/sh".into(), "-c".into(), "id -G".into()];
    spec.user = Some((65534, 65534));
    spec.groups = vec![65534, 4242];
    h.sup.start(spec).await.expect("starts");
    h.until("grouped", State::Exited).await;
    assert_eq!(h.lines("grouped", 1), ["65534 4242"]);
}

#[tokio::test]
async fn programs_are_found_on_path_and_exec_errors_are_reported() {
    let h = Harness::new();
    let mut spec = child("on-path", &[]);
    spec.argv = vec!["true".into()];
    let status = h.sup.start(spec).await.expect("starts");
    assert_ne!(status.reason.as_str(), "", "{status:?}");
    assert!(
        status.pid.is_some() || status.exit.is_some(),
        "true was found on PATH: {status:?}"
    );
    let mut spec = child("nowhere", &[]);
    spec.argv = vec!["no-such-program-anywhere".into()];
    let status = h.sup.start(spec).await.expect("the start is accepted");
    assert_eq!(status.state, State::Failed);
    assert!(
        status.reason.contains("not found on PATH"),
        "{}",
        status.reason
    );
    // A file without any execute bit: execve fails (even for root), and
    // the child's errno comes back as the reason, with the file that is
    // not executable and who could not run it.
    let file = std::env::temp_dir().join(format!("not-a-program-{}", std::process::id()));
    std::fs::write(&file, "just text\n").expect("write");
    let mut spec = child("not-executable", &[]);
    spec.argv = vec![file.display().to_string()];
    let status = h.sup.start(spec).await.expect("the start is accepted");
    let _ = std::fs::remove_file(&file);
    assert_eq!(status.state, State::Failed);
    let want = format!("cannot start {:?}: ", file.display().to_string());
    let uid = format!("(uid {}", nix::unistd::geteuid());
    assert!(
        status.reason.starts_with(&want)
            && status.reason.contains(&uid)
            && status.reason.contains("is not executable for it")
            && status.reason.ends_with("Permission denied (os error 13)"),
        "{}",
        status.reason
    );
}

/// A program the child's user cannot reach (a `python3` that resolves into
/// a directory only root may enter, as /root/.pyenv/shims): the reason
/// names the program, the directory in the way and the user, where it
/// said only `Permission denied (os error 13)` before.
#[tokio::test]
async fn a_program_its_user_cannot_reach_fails_naming_the_path_and_the_user() {
    if !nix::unistd::getuid().is_root() {
        return skip("changing users needs root");
    }
    use std::os::unix::fs::PermissionsExt as _;
    let h = Harness::new();
    let dir = std::env::temp_dir().join(format!("roots-only-{}", std::process::id()));
    let shims = dir.join("shims");
    std::fs::create_dir_all(&shims).expect("mkdir");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let program = shims.join("python3");
    std::fs::copy("/bin/true", &program).expect("a program");
    let mut spec = child("unreachable", &[]);
    spec.argv = vec!["python3".into()];
    spec.env.insert("PATH".into(), shims.display().to_string());
    spec.user = Some((65534, 65534));
    let status = h.sup.start(spec).await.expect("the start is accepted");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(status.state, State::Failed);
    let reason = &status.reason;
    assert!(
        reason.starts_with("cannot start \"python3\": ")
            && reason.contains(&format!("program {}", program.display()))
            && reason.contains("(uid 65534, gid 65534)")
            && reason.contains(&format!("{} (mode 0700, owner uid 0", dir.display()))
            && reason.contains("is not searchable for it")
            && reason.ends_with("Permission denied (os error 13)"),
        "{reason}"
    );
}

#[tokio::test]
async fn a_child_starts_with_default_dispositions_and_no_signal_blocked() {
    // This process ignores SIGPIPE (Rust does) and, from here, SIGUSR1; a
    // server inherits neither, and nothing is blocked when it starts.
    // SAFETY: SIG_IGN installs no handler code; the other tests of this
    // binary neither send nor expect SIGUSR1.
    unsafe {
        nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGUSR1,
            nix::sys::signal::SigHandler::SigIgn,
        )
    }
    .expect("ignore SIGUSR1");
    let mut h = Harness::new();
    let argv = ["/bin/grep", "-E", "^Sig(Blk|Ign):", "/proc/self/status"];
    let mut spec = child("signals", &[]);
    spec.argv = argv.iter().map(|s| s.to_string()).collect();
    h.sup.start(spec).await.expect("starts");
    h.until("signals", State::Exited).await;
    let lines = h.lines("signals", 10);
    assert_eq!(
        lines,
        ["SigBlk:\t0000000000000000", "SigIgn:\t0000000000000000"],
        "the child's masks"
    );
}

#[tokio::test]
async fn a_runs_start_time_is_known_from_its_spawn_as_proc_gives_it() {
    // The journal guards against pid reuse with the leader's start time;
    // the spawn knows it without looking the child up in /proc (which
    // would make its reaping invalidate those entries). Where the spawn
    // cannot tell (its clock readings straddle a tick), /proc must say.
    let h = Harness::new();
    let mut known = 0;
    for i in 0..20 {
        let id = format!("t{i}");
        let status = h.sup.start(child(&id, &["forever"])).await.expect("starts");
        let pid = status.pid.expect("a pid");
        let from_proc = procfs::stat(pid as i32).expect("running").start_ticks;
        if let Some(ticks) = status.start_ticks {
            assert_eq!(ticks, from_proc, "run {id}: spawn and /proc disagree");
            known += 1;
        }
        assert_eq!(
            h.sup.pid(&id, status.generation),
            Some(resident_supervisor::RunProcess {
                pid,
                start_ticks: status.start_ticks,
                port: status.port,
                restarts: 0,
            })
        );
        h.sup.stop(&id, None).await.expect("stops");
    }
    // A straddled tick takes a clone of a hundred microseconds in ten
    // milliseconds: twenty straddles in a row would be a bug.
    assert!(known > 0, "no spawn knew its start time");
}

#[tokio::test]
async fn a_stop_for_one_run_never_ends_the_next_run_of_the_same_id() {
    let h = Harness::new();
    let mut first = child("again", &["forever"]);
    first.generation = 1;
    h.sup.start(first).await.expect("starts");
    let stopping = h.sup.stop_run("again", 1, None, None).await;
    stopping.expect("stops").ended().await;
    let mut next = child("again", &["forever"]);
    next.generation = 2;
    let pid = h.sup.start(next).await.expect("starts").pid.expect("a pid") as i32;
    // A late stop meant for the first run: refused, the second runs on.
    let late = h.sup.stop_run("again", 1, None, None).await;
    assert!(
        matches!(
            late,
            Err(resident_supervisor::SupervisorError::NotTheRun { generation: 1, .. })
        ),
        "{late:?}"
    );
    assert!(alive(pid));
    assert_eq!(h.sup.status("again").expect("listed").generation, 2);
    let stopping = h.sup.stop_run("again", 2, None, None).await;
    let stopped = stopping.expect("stops").ended().await;
    assert_eq!((stopped.state, stopped.generation), (State::Exited, 2));
    assert!(!alive(pid));
}

/// Many stops of one run, side by side, racing the run's end: each one
/// answers, whether its request reached the run, queued behind another or
/// came as the run's actor went away. (A stop once waited for a reply that
/// a request sent just as the actor ended never got.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_one_of_many_stops_racing_a_runs_end_is_answered() {
    let h = Harness::new();
    for round in 0..40 {
        let mut spec = child("raced", &["forever"]);
        spec.generation = round;
        h.sup.start(spec).await.expect("starts");
        let stops: Vec<_> = (0..8)
            .map(|_| {
                let sup = h.sup.clone();
                tokio::spawn(async move {
                    let stop = async {
                        let stopping = sup.stop_run("raced", round, None, None).await?;
                        Ok::<_, resident_supervisor::SupervisorError>(stopping.ended().await)
                    };
                    tokio::time::timeout(Duration::from_secs(20), stop).await
                })
            })
            .collect();
        for stop in stops {
            let answer = stop.await.expect("joined");
            let status = answer
                .unwrap_or_else(|_| panic!("round {round}: a stop was not answered within 20 s"))
                .expect("the run it was sent to");
            assert_eq!((status.state, status.generation), (State::Exited, round));
        }
    }
}

/// A port answered by another process (a local user who binds it while
/// the server loads) is not the server's: the run is never READY on it.
/// The readiness probe counts only a listener of the run's own processes.
/// Before, it was READY as soon as the other process listened.
#[tokio::test]
async fn a_port_someone_else_listens_on_is_never_taken_for_the_server() {
    let mut h = Harness::new();
    let mut spec = child("squatted", &[]);
    // A server that never listens, on the port the supervisor gave it.
    spec.argv = vec!["/bin/sleep".into(), "3600".into()];
    spec.readiness = resident_supervisor::Readiness::Tcp;
    spec.readiness_timeout = Duration::from_millis(1500);
    let started = h.sup.start(spec).await.expect("starts");
    let squatter = std::net::TcpListener::bind(("127.0.0.1", started.port)).expect("bind");
    let ended = h
        .until_any("squatted", &[State::Ready, State::Failed])
        .await;
    assert_eq!(
        ended.state,
        State::Failed,
        "READY on another process's port: {ended:?}"
    );
    drop(squatter);
}
