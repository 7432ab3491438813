//! residentctl against a real residentd: tables, JSON, exit codes, and
//! `logs -f`, which ends with the instance's run.

use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;

use crate::support::*;
use resident_api::pb;

const CTL: &str = env!("CARGO_BIN_EXE_residentctl");

/// residentctl with `args` against `d`.
fn ctl_command(d: &Daemon, args: &[&str]) -> Command {
    let mut cmd = Command::new(CTL);
    cmd.arg("--socket").arg(&d.socket).args(args);
    cmd
}

/// Runs residentctl with `args` against `d` to its end.
fn ctl(d: &Daemon, args: &[&str]) -> Output {
    ctl_command(d, args).output().expect("run residentctl")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_subcommand_against_a_live_agent() {
    let mut config = pool("unified", "96GB");
    config += &sleeper("coder-daily", "unified", 55, "");
    config += &sleeper("coder-small", "unified", 9, "");
    config += &sleeper("planner", "unified", 55, "");
    let d = Daemon::start(&config).await;
    let run = |args: &[&str]| ctl(&d, args);
    let o = tokio::task::block_in_place(|| run(&["start", "coder-daily", "--id", "a", "--wait"]));
    assert!(o.status.success(), "{:?}", text(&o));
    let (out, _) = text(&o);
    assert!(out.starts_with("INSTANCE"), "{out}");
    assert!(
        out.lines()
            .next()
            .is_some_and(|h| h.contains("RESTARTS  AGE")),
        "{out}"
    );
    let row: Vec<&str> = out
        .lines()
        .nth(1)
        .expect("a row")
        .split_whitespace()
        .collect();
    assert!(
        row[12].ends_with('s'),
        "a fresh instance is seconds old: {row:?}"
    );
    assert!(
        out.contains("a ") && out.contains("READY") && out.contains("55.0 GB"),
        "{out}"
    );
    let o = tokio::task::block_in_place(|| run(&["start", "coder-small", "--id", "b"]));
    assert!(o.status.success());
    // A refusal: exit 3, the reasons with their holders.
    let o = tokio::task::block_in_place(|| run(&["start", "planner", "--id", "c"]));
    assert_eq!(o.status.code(), Some(3));
    let (_, err) = text(&o);
    assert!(
        err.contains("unplaceable: 'planner' needs 55.0 GB but only 32.0 GB"),
        "{err}"
    );
    let holder = |id: &str, role: &str, gb: &str| {
        err.lines().any(|l| {
            let cells: Vec<&str> = l.split_whitespace().collect();
            cells == [id, role, gb, "GB"]
        })
    };
    assert!(
        holder("a", "coder-daily", "55.0") && holder("b", "coder-small", "9.0"),
        "{err}"
    );
    // The same as JSON, for scripts.
    let o = tokio::task::block_in_place(|| run(&["--json", "start", "planner", "--id", "c"]));
    assert_eq!(o.status.code(), Some(3));
    let v: serde_json::Value = serde_json::from_str(&text(&o).0).expect("JSON");
    assert_eq!(v["refusals"][0]["reason"], "OVER_BUDGET");
    assert_eq!(v["refusals"][0]["detail"]["holders"][1]["instance_id"], "b");
    // Place: exit 3 when it does not fit, 0 when it does (under evict).
    let o = tokio::task::block_in_place(|| run(&["place", "planner"]));
    assert_eq!(o.status.code(), Some(3));
    let o = tokio::task::block_in_place(|| run(&["place", "planner", "--policy", "evict"]));
    assert!(o.status.success());
    assert_eq!(text(&o).0.trim(), "fits in unified after evicting a");
    // ls, get, touch, node, as JSON.
    let o = tokio::task::block_in_place(|| run(&["--json", "ls"]));
    let v: serde_json::Value = serde_json::from_str(&text(&o).0).expect("JSON");
    assert_eq!(v.as_array().map(Vec::len), Some(2));
    assert_eq!(v[0]["state"], "READY");
    let o = tokio::task::block_in_place(|| run(&["touch", "b", "--hold", "1m"]));
    assert!(o.status.success(), "{:?}", text(&o));
    let o = tokio::task::block_in_place(|| run(&["--json", "node"]));
    let v: serde_json::Value = serde_json::from_str(&text(&o).0).expect("JSON");
    assert_eq!(v["pools"][0]["used_bytes"], 64_000_000_000u64);
    // The agent's pid, which an upgrade changes (docs/operations.md).
    let pid = d.pid();
    assert_eq!(v["agent_pid"], pid, "{v}");
    let o = tokio::task::block_in_place(|| run(&["node"]));
    assert!(text(&o).0.contains("unified  96.0 GB"), "{}", text(&o).0);
    let first = text(&o).0.lines().next().unwrap_or_default().to_string();
    assert!(first.ends_with(&format!(", pid {pid})")), "{first}");
    // The roster: declared, learned (nothing yet), reserved.
    let o = tokio::task::block_in_place(|| run(&["workloads"]));
    let (out, _) = text(&o);
    assert!(
        out.lines()
            .next()
            .is_some_and(|h| h.contains("DECLARED  LEARNED  RESERVED")),
        "{out}"
    );
    let row = out
        .lines()
        .find(|l| l.starts_with("coder-small "))
        .expect("a row");
    let cells: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cells[4..], ["9.0", "GB", "-", "9.0", "GB"], "{row}");
    let o = tokio::task::block_in_place(|| run(&["--json", "workloads"]));
    let v: serde_json::Value = serde_json::from_str(&text(&o).0).expect("JSON");
    assert_eq!(v[0]["name"], "coder-daily");
    assert_eq!(v[0]["reserved_bytes"], 55_000_000_000u64);
    assert_eq!(v[0]["learned_bytes"], 0);
    let o = tokio::task::block_in_place(|| run(&["forget-footprint", "coder-small"]));
    assert!(o.status.success(), "{:?}", text(&o));
    assert!(text(&o).0.contains("coder-small"), "{:?}", text(&o));
    // top: one frame after the snapshot, bars of held and free.
    let o = tokio::task::block_in_place(|| run(&["top", "--frames", "1"]));
    assert!(o.status.success(), "{:?}", text(&o));
    let frame = text(&o).0;
    let bar: String = "#".repeat(26) + &".".repeat(14);
    assert!(
        frame.contains(&format!("unified    [{bar}] 64.0 GB used of 96.0 GB")),
        "{frame}"
    );
    // stop, then get shows EXITED; logs of it answer (empty).
    let o = tokio::task::block_in_place(|| run(&["stop", "a", "--grace", "2s"]));
    assert!(o.status.success());
    assert!(text(&o).0.contains("EXITED"));
    let o = tokio::task::block_in_place(|| run(&["logs", "a"]));
    assert!(o.status.success());
    // Errors and bad usage.
    let o = tokio::task::block_in_place(|| run(&["get", "ghost"]));
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).1.contains("NOT_FOUND: no instance 'ghost'"),
        "{:?}",
        text(&o)
    );
    let o = tokio::task::block_in_place(|| run(&["get", "not an id"]));
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).1.contains("residentctl: INVALID_ARGUMENT: "),
        "{:?}",
        text(&o)
    );
    let o = tokio::task::block_in_place(|| run(&["stop", "b", "--grace", "soon"]));
    assert_eq!(o.status.code(), Some(2));
    let o = tokio::task::block_in_place(|| run(&["frobnicate"]));
    assert_eq!(o.status.code(), Some(2));
    let o = Command::new(CTL)
        .args(["--socket", "/nonexistent/x.sock", "ls"])
        .output()
        .expect("run");
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o)
            .1
            .contains("cannot reach residentd at /nonexistent/x.sock")
    );
}

/// Starts residentctl with `args` against `d`, its stdout and stderr piped.
fn spawn_ctl(d: &Daemon, args: &[&str]) -> Child {
    ctl_command(d, args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start residentctl")
}

/// Waits (bounded) until `child` has exited; then its status and what is
/// left of its output. Kills it and fails the test at the bound.
async fn exits(mut child: Child, what: &str) -> Output {
    let exited = eventually(async || matches!(child.try_wait(), Ok(Some(_)))).await;
    if !exited {
        let _ = child.kill();
    }
    let out = tokio::task::block_in_place(|| child.wait_with_output()).expect("residentctl output");
    assert!(
        exited,
        "{what} did not return within {PATIENCE:?}: {:?}",
        text(&out)
    );
    out
}

/// The lines of `child`'s stdout as they come (read on a thread of their
/// own, so a test can wait for one with a bound).
fn stdout_lines(child: &mut Child) -> mpsc::Receiver<String> {
    let out = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                return;
            }
        }
    });
    rx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_follow_ends_when_the_run_ends_not_at_a_restart() {
    // Each run prints a line, then waits for the test to write to a FIFO
    // and fails; one restart is allowed, so the second failure ends the run.
    let fifo_dir = tempfile::tempdir().expect("tempdir");
    let fifo = fifo_dir.path().join("go");
    nix::unistd::mkfifo(&fifo, nix::sys::stat::Mode::S_IRWXU).expect("mkfifo");
    let mut config = pool("ram", "10GB");
    config += &shell(
        "relay",
        &format!("echo run; read x < {}; exit 1", fifo.display()),
        "policy = \"on-failure\"\nmax_restarts = 1\nbackoff = \"100ms\"",
    );
    let mut d = Daemon::start(&config).await;
    d.started("relay", "r").await;
    let mut follow = spawn_ctl(&d, &["logs", "r", "-f"]);
    let lines = stdout_lines(&mut follow);
    let next = |what: &str| {
        tokio::task::block_in_place(|| lines.recv_timeout(PATIENCE))
            .unwrap_or_else(|e| panic!("{what}: {e}"))
    };
    let release = || tokio::task::block_in_place(|| std::fs::write(&fifo, "go\n")).expect("fifo");
    assert_eq!(next("the first run's line"), "run");
    release();
    assert_eq!(
        next("the second run's line, through the restart"),
        "run",
        "a restart does not end the follow"
    );
    release();
    let out = exits(follow, "logs -f of a failed instance").await;
    assert!(out.status.success(), "{:?}", text(&out));
    let (_, err) = text(&out);
    assert!(
        err.contains("instance r has failed (gave up after 1 restarts: exited with code 1)"),
        "{err}"
    );
    let rest: Vec<String> = lines.try_iter().collect();
    assert!(rest.is_empty(), "nothing after the run's lines: {rest:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_follow_of_an_ended_instance_prints_its_lines_and_returns() {
    let mut config = pool("ram", "10GB");
    config += &shell("once", "echo old; exit 0", "policy = \"never\"");
    config += &sleeper("idle", "ram", 1, "");
    let mut d = Daemon::start(&config).await;
    d.started("once", "o").await;
    d.wait_state("o", pb::State::Exited).await;
    let follow = spawn_ctl(&d, &["logs", "o", "-f"]);
    let out = exits(follow, "logs -f of an exited instance").await;
    assert!(out.status.success(), "{:?}", text(&out));
    let (lines, err) = text(&out);
    assert_eq!(lines, "old\n");
    assert!(
        err.contains("instance o has exited (exited with code 0)"),
        "{err}"
    );
    // Stopped while followed (or just before): the follow ends with it.
    d.started("idle", "i").await;
    let follow = spawn_ctl(&d, &["logs", "i", "-f"]);
    d.stopped("i").await;
    let out = exits(follow, "logs -f of a stopped instance").await;
    assert!(out.status.success(), "{:?}", text(&out));
    assert!(
        text(&out).1.contains("instance i has exited (stopped ("),
        "{:?}",
        text(&out)
    );
}

/// residentctl ended quietly: exit 0 and no panic on stderr.
fn quiet(out: &Output, what: &str) {
    let (_, err) = text(out);
    assert!(!err.contains("panicked"), "{what}: {err}");
    assert!(!err.contains("Broken pipe"), "{what}: {err}");
    assert_eq!(out.status.code(), Some(0), "{what}: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_output_pipe_ends_residentctl_quietly() {
    let config = pool("ram", "10GB") + &sleeper("a", "ram", 1, "") + &sleeper("b", "ram", 1, "");
    let mut d = Daemon::start(&config).await;
    d.started("a", "a").await;
    // A pipe whose reader has gone before the first write.
    for args in [&["node"][..], &["--json", "node"], &["ls"], &["get", "a"]] {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        let out = ctl_command(&d, args)
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .expect("run residentctl");
        quiet(&out, &format!("residentctl {args:?} into a closed pipe"));
    }
    // A stream whose reader goes after the first line: the next event's
    // write finds the pipe closed, and the watch ends.
    let mut watch = spawn_ctl(&d, &["watch"]);
    let mut first = String::new();
    let mut reader = BufReader::new(watch.stdout.take().expect("piped stdout"));
    tokio::task::block_in_place(|| reader.read_line(&mut first)).expect("a line");
    assert!(first.contains("SNAPSHOT"), "{first}");
    drop(reader);
    d.started("b", "b").await;
    let out = exits(watch, "watch into a closed pipe").await;
    quiet(&out, "watch into a pipe closed after its first line");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_print_both_streams_on_stdout_and_pick_one_with_stream() {
    let mut config = pool("ram", "10GB");
    config += &shell(
        "both",
        "echo to-out; echo to-err >&2; echo more-err >&2; exit 0",
        "policy = \"never\"",
    );
    let mut d = Daemon::start(&config).await;
    d.started("both", "b").await;
    d.wait_state("b", pb::State::Exited).await;
    let run = |args: &[&str]| tokio::task::block_in_place(|| ctl(&d, args));
    let lines = |o: &Output| -> Vec<String> { text(o).0.lines().map(String::from).collect() };
    // The two pipes are read side by side: order holds within a stream only.
    let o = run(&["logs", "b"]);
    assert!(o.status.success(), "{:?}", text(&o));
    let mut all = lines(&o);
    all.sort();
    assert_eq!(all, ["more-err", "to-err", "to-out"], "{:?}", text(&o));
    assert_eq!(text(&o).1, "", "nothing on residentctl's own stderr");
    let o = run(&["logs", "b", "--stream", "stderr"]);
    assert_eq!(lines(&o), ["to-err", "more-err"], "{:?}", text(&o));
    let o = run(&["logs", "b", "--stream", "stdout"]);
    assert_eq!(lines(&o), ["to-out"], "{:?}", text(&o));
    let o = run(&["--json", "logs", "b", "--stream", "stderr"]);
    let streams: Vec<String> = text(&o)
        .0
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line"))
        .map(|v| v["stream"].as_str().unwrap_or_default().to_string())
        .collect();
    assert_eq!(streams, ["STDERR", "STDERR"]);
    let o = run(&["logs", "b", "--stream", "both"]);
    assert_eq!(o.status.code(), Some(2), "an unknown stream is bad usage");
}
