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
        .expect("connect to the instance");
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
async fn journaled_running(d: &Daemon, ids: &[&str]) {
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

#[tokio::test]
async fn after_kill_9_the_next_agent_takes_every_instance_over_with_its_output() {
    let config = pool("ram", "10GB")
        + &talker("talk", "policy = \"on-failure\"")
        + &sleeper("nap", "ram", 2, "");
    let mut d = Daemon::start(&config).await;
    d.started("talk", "t").await;
    d.started("nap", "n").await;
    let t = d.wait_state("t", pb::State::Ready).await;
    let n = d.wait_state("n", pb::State::Ready).await;
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
        "{}\t{}\t{}\t{}\t{}\trun\t{}\n",
        entry.instance,
        entry.workload,
        entry.pgid,
        entry.start_ticks + 1,
        entry.lease_ms,
        entry.port
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
