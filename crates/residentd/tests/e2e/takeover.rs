//! Instances outlive the agent (`instances_outlive_agent`, the default):
//! after a kill -9 of the agent its instances run on, and the next agent
//! takes them over (same pids, never restarted, READY, the books exact),
//! reading on the output they wrote while no agent ran; a process that
//! ended meanwhile, or whose pid now names another process, goes by its
//! restart policy.

use std::path::Path;
use std::time::Duration;

use resident_api::pb;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::support::*;

/// A workload running tests/takeover/talker.py (1 GB of pool `ram`).
fn talker(name: &str, restart: &str) -> String {
    format!(
        "[[workload]]\nname = \"{name}\"\ncommand = [\"python3\", \"-u\", \"{script}\", \"${{PORT}}\"]\nstop_grace = \"2s\"\n[workload.memory.ram]\nweights = \"1GB\"\n[workload.readiness]\nhttp = \"/health\"\ntimeout = \"30s\"\n[workload.restart]\n{restart}\n",
        script = workspace().join("tests/takeover/talker.py").display(),
    )
}

/// GET `path` on loopback `port`; the body of a 200 answer.
async fn get(port: u32, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port as u16))
        .await
        .unwrap_or_else(|e| panic!("connect to the instance on {port} for {path}: {e}"));
    let ask = format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
    s.write_all(ask.as_bytes()).await.expect("ask");
    let mut answer = String::new();
    let read = tokio::time::timeout(Duration::from_secs(30), s.read_to_string(&mut answer));
    read.await.expect("answered in time").expect("read");
    assert!(answer.starts_with("HTTP/1.0 200"), "{answer}");
    answer
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_string()
}

/// Every line of `id`'s log that the agent holds now.
async fn log_lines(d: &mut Daemon, id: &str) -> Vec<pb::LogLine> {
    let req = pb::LogsRequest {
        instance_id: id.into(),
        tail: 100_000,
        follow: false,
    };
    let mut stream = d.client.logs(req).await.expect("logs").into_inner();
    let mut lines = Vec::new();
    while let Some(line) = stream.message().await.expect("a log line") {
        lines.push(line);
    }
    lines
}

/// The numbers of the `said NNNNNN` lines in `lines`, in order.
fn said(lines: &[pb::LogLine]) -> Vec<u32> {
    lines
        .iter()
        .filter_map(|l| l.line.strip_prefix("said ")?.get(..6)?.parse().ok())
        .collect()
}

/// Waits (bounded) until the journal lists each of `ids` with its running
/// process and port: what a takeover starts from.
pub(crate) async fn journaled_running(d: &Daemon, ids: &[&str]) {
    let ok = eventually(async || {
        let entries = d.journaled();
        ids.iter().all(|id| {
            entries
                .iter()
                .any(|e| e.instance == *id && e.pgid > 1 && e.port != 0)
        })
    })
    .await;
    assert!(
        ok,
        "the journal records {ids:?} running: {:?}",
        d.journaled()
    );
}

/// An agent running a talker `t` (1 GB) and a sleeper `n` (2 GB), both
/// READY: the agent and the two instances.
async fn talker_and_sleeper() -> (Daemon, pb::Instance, pb::Instance) {
    let config = pool("ram", "10GB")
        + &talker("talk", "policy = \"on-failure\"")
        + &sleeper("nap", "ram", 2, "");
    let mut d = Daemon::start(&config).await;
    d.started("talk", "t").await;
    d.started("nap", "n").await;
    let t = d.wait_state("t", pb::State::Ready).await;
    let n = d.wait_state("n", pb::State::Ready).await;
    (d, t, n)
}

#[tokio::test]
async fn after_kill_9_the_next_agent_takes_every_instance_over_with_its_output() {
    let (mut d, t, n) = talker_and_sleeper().await;
    assert_eq!(get(t.port, "/say/3").await, "3");
    let seen = until(async || {
        let got = said(&log_lines(&mut d, "t").await);
        (got.len() == 3).then_some(got)
    })
    .await;
    assert_eq!(seen, Some(vec![1, 2, 3]), "the agent reads its output");
    let used = d.used().await;
    assert_eq!(used, 3_000_000_000);
    journaled_running(&d, &["t", "n"]).await;

    // A second of age before the agent goes, which the next one must not
    // start counting anew.
    tokio::time::sleep(Duration::from_secs(1)).await;
    d.kill();
    assert!(
        alive(t.pid as i32) && alive(n.pid as i32),
        "they outlive the agent"
    );
    // While no agent runs: 1,500 lines of ~200 bytes (about 300 KB) and a
    // line to stderr; the server neither blocks nor dies writing them.
    // (Within the log ring's 2,000 lines, so all of them stay in view.)
    assert_eq!(get(t.port, "/say/1500").await, "1503");

    let mut d = d.restart().await;
    // The first List already shows them, their memory reserved.
    let mut ids = d.ids().await;
    ids.sort();
    assert_eq!(ids, ["n", "t"]);
    assert_eq!(d.used().await, used, "the books are exact at once");
    for (before, id) in [(&t, "t"), (&n, "n")] {
        let i = d.wait_state(id, pb::State::Ready).await;
        assert_eq!(i.pid, before.pid, "{id}: the same process, taken over");
        assert_eq!(i.port, before.port, "{id}: the same port");
        assert_eq!(i.restarts, 0, "{id}: never restarted");
        // Its age (residentctl ls) runs from its spawn, not the takeover:
        // the start time the journal kept, to a tick and the spawn's own
        // few milliseconds.
        assert!(
            i.started_unix_ms.abs_diff(before.started_unix_ms) < 250,
            "{id}: started {} before the takeover, {} after",
            before.started_unix_ms,
            i.started_unix_ms
        );
    }
    assert_eq!(d.used().await, used, "each reserved once");
    // What it wrote while no agent ran, in order, nothing missing; and
    // what it writes now.
    assert_eq!(get(t.port, "/say/1").await, "1504");
    let got = until(async || {
        let lines = log_lines(&mut d, "t").await;
        let got = said(&lines);
        (got.last() == Some(&1504)).then_some((got, lines))
    })
    .await;
    let (got, lines) = got.expect("the lines said after the takeover reach the log");
    // The new agent's log starts with what the old one had not read: the
    // first line said while no agent ran.
    let in_order = got.windows(2).all(|w| w[1] == w[0] + 1);
    assert!(
        in_order && got.first() == Some(&4),
        "in order, none lost: {} lines, {:?}..{:?}",
        got.len(),
        got.first(),
        got.last()
    );
    assert!(
        lines
            .iter()
            .any(|l| l.line == "told up to 1503" && l.stream == pb::LogStream::Stderr as i32),
        "stderr too"
    );

    // Taken over, it is supervised as ever: a Stop ends it, its named
    // pipes go with it.
    d.stopped("t").await;
    assert!(!alive(t.pid as i32), "stopped through its group");
    let output = d.dir.path().join("state/output");
    assert!(
        !output.join("t.stdout").exists(),
        "its named pipes are removed"
    );
    assert_eq!(d.used().await, 2_000_000_000);
    // A SIGTERM to the agent (systemctl stop) still stops what it runs.
    let status = d.terminate().await;
    assert!(status.success(), "{status:?}");
    assert!(!alive(n.pid as i32), "stopped with the agent");
}

/// Appends a put line to the journal in `state` that gives instance `id`
/// another start time: as if its pid had been reused by then.
fn journal_a_reused_pid(state: &Path, id: &str) {
    let entry = journaled_in(state)
        .into_iter()
        .find(|e| e.instance == id)
        .expect("journaled");
    let line = format!(
        "{}\t{}\t{}\t{}\t{}\trun\t{}\t{}\n",
        entry.instance,
        entry.workload,
        entry.pgid,
        entry.start_ticks + 1,
        entry.lease_ms,
        entry.port,
        entry.restarts
    );
    let path = state.join("instances.journal");
    let mut text = std::fs::read_to_string(&path).expect("the journal");
    text.push_str(&line);
    std::fs::write(&path, text).expect("write the journal");
}

#[tokio::test]
async fn what_ended_while_no_agent_ran_goes_by_its_restart_policy() {
    let config = pool("ram", "10GB")
        + &sleeper("kept", "ram", 1, "")
        + &sleeper("died", "ram", 2, "[workload.restart]\npolicy = \"never\"")
        + &sleeper("reused", "ram", 3, "");
    let mut d = Daemon::start(&config).await;
    let mut before = Vec::new();
    for id in ["kept", "died", "reused"] {
        d.started(id, id).await;
        before.push(d.wait_state(id, pb::State::Ready).await);
    }
    journaled_running(&d, &["kept", "died", "reused"]).await;
    d.kill();
    // During the gap: one exits (killed by someone), one's journaled start
    // time no longer matches its pid.
    let died = before[1].pid as i32;
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(died), nix::sys::signal::SIGKILL)
        .expect("kill");
    assert!(eventually(async || !alive(died)).await);
    let state = d.dir.path().join("state");
    journal_a_reused_pid(&state, "reused");

    let mut d = d.restart().await;
    let kept = d.wait_state("kept", pb::State::Ready).await;
    assert_eq!((kept.pid, kept.restarts), (before[0].pid, 0), "taken over");
    // Ended while no agent ran, restart "never": ended for good, its
    // memory released, its end told.
    let gone = d.wait_state("died", pb::State::Exited).await;
    assert!(
        gone.message.contains("ended while no agent ran"),
        "{gone:?}"
    );
    // A pid that names another process is not that run: the run counts as
    // ended and the default policy (on-failure) starts it again.
    let reused = until(async || {
        let i = d.get("reused").await;
        (i.state == pb::State::Ready as i32 && i.pid != before[2].pid).then_some(i)
    })
    .await
    .expect("the instance whose pid was reused runs again");
    assert_eq!(reused.restarts, 1, "{reused:?}");
    let settled = eventually(async || d.used().await == 4_000_000_000).await;
    assert!(
        settled,
        "the books hold kept and reused: {}",
        d.used().await
    );
    // The process the journal no longer names is the test's own to end
    // (with cgroups, the new agent cleared it with the dead agent's
    // leftovers).
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(before[2].pid as i32),
        nix::sys::signal::SIGKILL,
    );
}

/// Every event of `stream` until it ends (bounded).
async fn until_end(stream: &mut tonic::Streaming<pb::Event>) -> Vec<pb::Event> {
    let mut seen = Vec::new();
    loop {
        match tokio::time::timeout(PATIENCE, stream.message()).await {
            Ok(Ok(Some(e))) => seen.push(e),
            Ok(Ok(None) | Err(_)) => return seen,
            Err(_) => panic!("the watch did not end at the upgrade"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_hands_every_instance_and_the_watchers_to_the_new_agent() {
    let (mut d, t, n) = talker_and_sleeper().await;
    journaled_running(&d, &["t", "n"]).await;
    let used = d.used().await;
    let old_pid = agent_pid(&d.socket).await;
    let mut watch = d.watch(0).await;
    let snapshot = watch.message().await.expect("a snapshot").expect("event");
    let _ = get(t.port, "/say/2").await;

    // By the RPC (residentctl upgrade): it answers once the new agent
    // serves.
    let socket = d.socket.clone();
    let o = tokio::task::spawn_blocking(move || residentctl(&socket, &["upgrade"]))
        .await
        .expect("joined");
    let said = String::from_utf8_lossy(&o.stdout);
    assert!(
        o.status.success() && said.contains("upgraded residentd"),
        "{said}{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let new_pid = agent_pid(&d.socket).await;
    let _new = Upgraded(new_pid);
    assert_ne!(new_pid, old_pid, "a new agent serves");
    let old = d.child.as_mut().expect("the old agent");
    let exited = until(async || old.try_wait().expect("wait")).await;
    assert!(
        exited.is_some_and(|s| s.success()),
        "the old agent exited cleanly"
    );
    d.client = connect(&d.socket).await;
    assert_eq!(d.used().await, used, "the books are exact");
    for (before, id) in [(&t, "t"), (&n, "n")] {
        let i = d.wait_state(id, pb::State::Ready).await;
        assert_eq!((i.pid, i.restarts), (before.pid, 0), "{id}: taken over");
    }
    // The watch ended at the hand-over; resumed by revision, it goes on
    // without a gap: every event after the last one seen, in order.
    let mut seen = vec![snapshot];
    seen.extend(until_end(&mut watch).await);
    let last = seen.iter().map(|e| e.revision).max().unwrap_or(0);
    let mut resumed = d.watch(last).await;
    d.started("nap", "n2").await;
    let mut revisions = Vec::new();
    let reached = until(async || {
        let e = resumed.message().await.ok()??;
        revisions.push(e.revision);
        let n2_ready = e
            .instance
            .as_ref()
            .is_some_and(|i| i.instance_id == "n2" && i.state == pb::State::Ready as i32);
        n2_ready.then_some(())
    })
    .await;
    assert!(
        reached.is_some(),
        "the resumed watch shows n2: {revisions:?}"
    );
    let expected: Vec<u64> = (last + 1..=last + revisions.len() as u64).collect();
    assert_eq!(
        revisions, expected,
        "no gap, no repeat after revision {last}"
    );
    // The output goes on where the old agent let go.
    assert_eq!(get(t.port, "/say/1").await, "3");
    let tail = until(async || {
        let got = said_of(&mut d, "t").await;
        got.contains(&3).then_some(got)
    })
    .await;
    assert!(tail.is_some(), "the new agent reads the output");

    // And again by SIGUSR2, to the agent the first upgrade started.
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(new_pid),
        nix::sys::signal::SIGUSR2,
    )
    .expect("SIGUSR2");
    let socket = d.socket.clone();
    let third = until(async || {
        let pid = agent_pid(&socket).await;
        (pid != new_pid).then_some(pid)
    })
    .await
    .expect("a third agent serves after SIGUSR2");
    let _third = Upgraded(third);
    d.client = connect(&d.socket).await;
    for (before, id) in [(&t, "t"), (&n, "n")] {
        let i = d.wait_state(id, pb::State::Ready).await;
        assert_eq!(
            (i.pid, i.restarts),
            (before.pid, 0),
            "{id}: taken over again"
        );
    }
    assert!(alive(t.pid as i32) && alive(n.pid as i32));
}

async fn said_of(d: &mut Daemon, id: &str) -> Vec<u32> {
    said(&log_lines(d, id).await)
}

/// Puts `text` at `path` as a new file (a running binary cannot be
/// written in place), executable.
pub(crate) fn replace_file(path: &Path, text: &[u8]) {
    use std::os::unix::fs::PermissionsExt as _;
    let tmp = path.with_extension("new");
    std::fs::write(&tmp, text).expect("write");
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    std::fs::rename(&tmp, path).expect("rename");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_binary_that_fails_its_check_or_its_start_leaves_the_agent_serving() {
    // The agent runs from a copy of its binary, which the test replaces.
    let bin = tempfile::tempdir().expect("tempdir");
    let program = bin.path().join("residentd");
    std::fs::copy(RESIDENTD, &program).expect("copy residentd");
    let dir = tempfile::tempdir().expect("tempdir");
    write_config(
        dir.path(),
        &(pool("ram", "10GB") + &sleeper("nap", "ram", 2, "")),
    );
    let mut d = Daemon::start_program(&program, dir, |_| {}).await;
    d.started("nap", "n").await;
    let n = d.wait_state("n", pb::State::Ready).await;
    journaled_running(&d, &["n"]).await;
    let pid = agent_pid(&d.socket).await;

    // Not a residentd at all: refused by the check, nothing changed.
    replace_file(&program, b"#!/bin/sh\necho 'not residentd' >&2\nexit 3\n");
    let socket = d.socket.clone();
    let o = tokio::task::spawn_blocking(move || residentctl(&socket, &["upgrade"]))
        .await
        .expect("joined");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("FAILED_PRECONDITION")
            && err.contains("--version")
            && err.contains("not residentd"),
        "{err}"
    );
    assert_eq!(agent_pid(&d.socket).await, pid, "the same agent serves");
    d.started("nap", "n2").await;

    // Passes the check, then fails to start: the agent executes itself
    // afresh (the same pid) and takes its instances over again.
    let script = format!(
        "#!/bin/sh\ncase \"$1\" in --version|--check-config) exec {real} \"$@\";; esac\necho 'crashing on purpose' >&2\nexit 1\n",
        real = RESIDENTD
    );
    replace_file(&program, script.as_bytes());
    let socket = d.socket.clone();
    let o = tokio::task::spawn_blocking(move || residentctl(&socket, &["upgrade"]))
        .await
        .expect("joined");
    let err = String::from_utf8_lossy(&o.stderr).into_owned();
    assert!(!o.status.success(), "{err}");
    assert!(
        err.contains("did not start") && err.contains("exited"),
        "says why: {err}"
    );
    d.client = connect(&d.socket).await;
    assert_eq!(
        agent_pid(&d.socket).await,
        pid,
        "the agent itself, executed afresh"
    );
    let i = d.wait_state("n", pb::State::Ready).await;
    assert_eq!((i.pid, i.restarts), (n.pid, 0), "taken over again");
    d.wait_state("n2", pb::State::Ready).await;
    assert_eq!(d.used().await, 4_000_000_000, "the books are exact");
    let log = d.log();
    assert!(
        log.contains("crashing on purpose"),
        "the new binary's words reach the log"
    );
}
