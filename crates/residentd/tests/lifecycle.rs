//! Instances over time through the real agent: crashes and restarts and
//! what they hold, Watch and Logs streams, what SIGTERM and kill -9 of the
//! agent leave behind, and the laptop example the agent starts with.

mod support;

use std::time::Duration;

use resident_api::pb;
use support::*;
use tokio_stream::StreamExt as _;

fn pool() -> String {
    String::from("[[pool]]\nname = \"ram\"\nbudget = \"10GB\"\n\n")
}

async fn used(
    c: &mut resident_api::pb::node_agent_client::NodeAgentClient<tonic::transport::Channel>,
) -> u64 {
    c.node(pb::NodeRequest {})
        .await
        .expect("node")
        .into_inner()
        .pools[0]
        .used_bytes
}

#[tokio::test]
async fn crashes_release_memory_restarts_keep_it_giving_up_releases_it() {
    let mut config = pool();
    config += &shell("crasher", "exit 3", "policy = \"never\"");
    config += &shell(
        "looper",
        "sleep 0.3; exit 3",
        "policy = \"on-failure\"\nmax_restarts = 2\nbackoff = \"200ms\"",
    );
    let mut d = Daemon::start(&config).await;
    d.client
        .start(start_req("crasher", "c"))
        .await
        .expect("starts");
    let failed = d.wait_state("c", pb::State::Failed).await;
    assert_eq!(failed.exit_code, 3);
    assert_eq!(used(&mut d.client).await, 0, "a crash releases the memory");

    d.client
        .start(start_req("looper", "l"))
        .await
        .expect("starts");
    let backoff = d.wait_state("l", pb::State::Backoff).await;
    assert!(
        backoff.message.contains("restart 1 of 2"),
        "{}",
        backoff.message
    );
    assert_eq!(
        used(&mut d.client).await,
        4_000_000_000,
        "a restarting instance keeps its memory"
    );
    let gave_up = d.wait_state("l", pb::State::Failed).await;
    assert_eq!(gave_up.restarts, 2);
    assert!(
        gave_up.message.starts_with("gave up after 2 restarts"),
        "{}",
        gave_up.message
    );
    assert_eq!(used(&mut d.client).await, 0, "giving up releases it");
}

#[tokio::test]
async fn watch_sees_every_transition_in_order_and_resumes() {
    let mut config = pool();
    config += &sleeper("a", "ram", 6, "");
    config += &sleeper("b", "ram", 6, "");
    let mut d = Daemon::start(&config).await;
    d.client.start(start_req("a", "a1")).await.expect("starts");
    let mut stream = d
        .client
        .watch(pb::WatchRequest { since_revision: 0 })
        .await
        .expect("watch")
        .into_inner();
    let snapshot = stream.next().await.expect("an event").expect("ok");
    assert_eq!(snapshot.kind, pb::EventKind::Snapshot as i32);
    assert_eq!(
        snapshot.instance.as_ref().map(|i| i.instance_id.as_str()),
        Some("a1")
    );
    // Evict a1 for b1: a1 must be gone before b1 is spawned.
    let mut req = start_req("b", "b1");
    req.on_full = pb::Policy::Evict as i32;
    d.client.start(req).await.expect("evicts a1");
    let mut seen = Vec::new();
    let mut last_revision = snapshot.revision;
    while !seen
        .iter()
        .any(|(id, s): &(String, i32)| id == "b1" && *s == pb::State::Ready as i32)
    {
        let e = tokio::time::timeout(PATIENCE, stream.next())
            .await
            .expect("in time")
            .expect("open")
            .expect("ok");
        assert!(e.revision > last_revision, "revisions only grow");
        last_revision = e.revision;
        let i = e.instance.expect("a transition carries its instance");
        seen.push((i.instance_id, i.state));
    }
    let pos = |id: &str, st: pb::State| seen.iter().position(|(i, s)| i == id && *s == st as i32);
    let a_exit = pos("a1", pb::State::Exited).expect("a1 exited");
    let b_start = pos("b1", pb::State::Starting).expect("b1 started");
    assert!(
        a_exit < b_start,
        "the victim exited before the target was spawned: {seen:?}"
    );
    assert!(pos("a1", pb::State::Stopping).expect("a1 stopping") < a_exit);
    // A refusal is an event too.
    d.client
        .start(start_req("a", "a2"))
        .await
        .expect_err("no room beside b1");
    let refused = tokio::time::timeout(PATIENCE, stream.next())
        .await
        .expect("in time")
        .expect("open")
        .expect("ok");
    assert_eq!(refused.kind, pb::EventKind::Refused as i32);
    assert_eq!(refused.workload, "a");
    assert!(
        refused
            .refusal
            .expect("the refusal")
            .message
            .starts_with("unplaceable: 'a' needs 6.0 GB")
    );
    // Resume from the middle: the same events after that revision.
    let mut resumed = d
        .client
        .watch(pb::WatchRequest {
            since_revision: snapshot.revision,
        })
        .await
        .expect("resume")
        .into_inner();
    let first = resumed.next().await.expect("an event").expect("ok");
    assert_eq!(first.revision, snapshot.revision + 1);
    // A revision from the future is not in the history.
    let err = d
        .client
        .watch(pb::WatchRequest {
            since_revision: 1_000_000,
        })
        .await;
    let err = match err {
        Ok(s) => s
            .into_inner()
            .next()
            .await
            .expect("an answer")
            .expect_err("out of range"),
        Err(e) => e,
    };
    assert_eq!(err.code(), tonic::Code::OutOfRange);
}

#[tokio::test]
async fn logs_tail_then_follow_a_live_child() {
    let mut config = pool();
    config += &shell(
        "talker",
        "echo one; echo two >&2; sleep 0.5; echo three; sleep 3600",
        "policy = \"never\"",
    );
    let mut d = Daemon::start(&config).await;
    d.client
        .start(start_req("talker", "t"))
        .await
        .expect("starts");
    let req = pb::LogsRequest {
        instance_id: "t".into(),
        tail: 10,
        follow: true,
    };
    let mut stream = d.client.logs(req).await.expect("logs").into_inner();
    // stdout and stderr are two pipes read side by side: their lines keep
    // their order within a stream, not across streams.
    let mut lines = Vec::new();
    while lines.len() < 3 {
        let l = tokio::time::timeout(PATIENCE, stream.next())
            .await
            .expect("in time")
            .expect("open")
            .expect("ok");
        lines.push((l.line, l.stream, l.seq));
    }
    let find = |text: &str| lines.iter().find(|l| l.0 == text).cloned().expect(text);
    assert_eq!(find("one").1, pb::LogStream::Stdout as i32);
    assert_eq!(find("two").1, pb::LogStream::Stderr as i32);
    assert_eq!(find("three").1, pb::LogStream::Stdout as i32);
    assert!(find("one").2 < find("three").2, "in order within stdout");
    assert!(
        lines.windows(2).all(|w| w[0].2 < w[1].2),
        "in seq order: {lines:?}"
    );
    // Ask again later: the tail has all three, the follower then waits.
    let tail = pb::LogsRequest {
        instance_id: "t".into(),
        tail: 2,
        follow: false,
    };
    let mut last_two = d.client.logs(tail).await.expect("logs").into_inner();
    let mut got = Vec::new();
    while let Some(l) = last_two.next().await {
        got.push(l.expect("ok").seq);
    }
    assert_eq!(got, [2, 3], "the last two lines, in order");
}

#[tokio::test]
async fn sigterm_stops_every_child_and_exits_zero() {
    let mut config = pool();
    config += &sleeper("a", "ram", 1, "");
    config += &shell(
        "stubborn",
        "trap '' TERM; while true; do sleep 0.05; done",
        "policy = \"never\"",
    );
    let mut d = Daemon::start(&config).await;
    let a = d.started("a", "a").await;
    let s = d.started("stubborn", "s").await;
    let pids = [a.pid as i32, s.pid as i32];
    let status = d.terminate().await;
    assert!(status.success(), "residentd exited with {status:?}");
    for pid in pids {
        assert!(!alive(pid), "child {pid} outlived the agent");
        assert!(
            resident_supervisor::procfs::group_members(pid).is_empty(),
            "group {pid} left members"
        );
    }
    assert!(!d.socket.exists(), "the socket is removed");
    // What ran at shutdown comes back with the next start.
    let mut d = d.restart().await;
    let ids = d.ids().await;
    assert_eq!(ids, ["a", "s"]);
}

#[tokio::test]
async fn after_kill_9_the_next_start_clears_leftovers_and_restores_the_journal() {
    let mut config = pool();
    // The shell forks a helper into its group; only the shell gets the
    // parent-death signal, so the helper is a leftover to clear.
    config += &shell(
        "forker",
        "sleep 3600 & echo helper=$!; wait",
        "policy = \"never\"",
    );
    config += &sleeper("a", "ram", 1, "");
    let mut d = Daemon::start(&config).await;
    d.client
        .start(start_req("a", "first"))
        .await
        .expect("starts");
    let f = d.started("forker", "second").await;
    let pgid = f.pid as i32;
    let logs = pb::LogsRequest {
        instance_id: "second".into(),
        tail: 1,
        follow: true,
    };
    let line = d
        .client
        .logs(logs)
        .await
        .expect("logs")
        .into_inner()
        .next()
        .await
        .expect("a line")
        .expect("ok");
    let helper: i32 = line
        .line
        .strip_prefix("helper=")
        .and_then(|p| p.parse().ok())
        .expect(&line.line);
    // Let the journal catch up with the spawn (it is written in the
    // background), then crash the agent.
    let journal = d.dir.path().join("state/instances.journal");
    let journaled = eventually(PATIENCE, || {
        std::fs::read_to_string(&journal)
            .is_ok_and(|j| j.contains(&format!("second\tforker\t{pgid}\t")))
    })
    .await;
    assert!(journaled, "the journal records the running group");
    let mut agent = d.child.take().expect("running");
    agent.kill().expect("kill -9");
    agent.wait().expect("reaped");
    assert!(
        alive(helper),
        "the helper survives its agent (this is what restore must clean)"
    );
    let mut d = d.restart().await;
    assert!(
        !alive(helper),
        "the leftover of the previous run was killed"
    );
    let ids = d.ids().await;
    assert_eq!(
        ids,
        ["first", "second"],
        "both journaled instances are back"
    );
    let list = d
        .client
        .list(pb::ListRequest {})
        .await
        .expect("list")
        .into_inner();
    assert!(
        list.instances
            .iter()
            .all(|i| i.pid != 0 && i.pid as i32 != pgid)
    );
    let node = d
        .client
        .node(pb::NodeRequest {})
        .await
        .expect("node")
        .into_inner();
    assert_eq!(
        node.pools[0].used_bytes, 5_000_000_000,
        "each reserved once"
    );
}

#[tokio::test]
async fn kill_9_of_the_agent_leaves_no_child_behind() {
    let mut config = pool();
    config += &sleeper("a", "ram", 1, "");
    config += &sleeper("b", "ram", 1, "");
    let mut d = Daemon::start(&config).await;
    let a = d.started("a", "a").await;
    let b = d.started("b", "b").await;
    let pids = [a.pid as i32, b.pid as i32];
    let mut agent = d.child.take().expect("running");
    agent.kill().expect("kill -9");
    agent.wait().expect("reaped");
    let gone = eventually(Duration::from_secs(1), || pids.iter().all(|p| !alive(*p))).await;
    assert!(
        gone,
        "children outlived a kill -9 of the agent by more than a second"
    );
}

#[tokio::test]
async fn sighup_reloads_pools_without_touching_instances_and_refuses_a_bad_file() {
    let config = pool() + &sleeper("a", "ram", 1, "");
    let mut d = Daemon::start(&config).await;
    let a = d.started("a", "a").await;
    let pid = a.pid;
    let path = d.dir.path().join("residentd.toml");
    let grown =
        config_text(d.dir.path(), &config).replace("budget = \"10GB\"", "budget = \"20GB\"");
    std::fs::write(&path, grown).expect("rewrite the config");
    let hup = |d: &Daemon| {
        let pid = nix::unistd::Pid::from_raw(d.pid());
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGHUP).expect("SIGHUP");
    };
    hup(&d);
    let budget = |n: pb::NodeStatus| n.pools[0].budget_bytes;
    let deadline = tokio::time::Instant::now() + PATIENCE;
    while budget(
        d.client
            .node(pb::NodeRequest {})
            .await
            .expect("node")
            .into_inner(),
    ) != Some(20_000_000_000)
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the reload did not take effect"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let a_now = d.get("a").await;
    assert_eq!(
        (a_now.pid, a_now.state),
        (pid, pb::State::Ready as i32),
        "the instance was not touched"
    );
    // A broken file: refused, logged, the previous config stays.
    std::fs::write(&path, "[node\nname = ").expect("break the config");
    hup(&d);
    let refused = eventually(PATIENCE, || {
        d.log().contains("configuration reload refused")
    })
    .await;
    assert!(refused, "the bad reload is logged: {}", d.log());
    assert!(
        d.log().contains("residentd.toml:1"),
        "the error names file and line"
    );
    let node = d
        .client
        .node(pb::NodeRequest {})
        .await
        .expect("node")
        .into_inner();
    assert_eq!(budget(node), Some(20_000_000_000));
}

#[tokio::test]
async fn an_idle_instance_is_stopped_after_its_ttl_and_a_touched_one_is_not() {
    let mut config = pool();
    config += &sleeper("idle", "ram", 1, "idle_ttl = \"1s\"");
    config += &sleeper("busy", "ram", 1, "idle_ttl = \"1s\"");
    let mut d = Daemon::start(&config).await;
    d.client
        .start(start_req("idle", "idle"))
        .await
        .expect("starts");
    d.client
        .start(start_req("busy", "busy"))
        .await
        .expect("starts");
    // Keep "busy" in use while "idle" expires.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        d.client
            .touch(pb::TouchRequest {
                instance_id: "busy".into(),
                hold_ms: 0,
            })
            .await
            .expect("touch");
        let idle = d.get("idle").await;
        if idle.state == pb::State::Exited as i32 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the idle instance was never stopped"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let busy = d.get("busy").await;
    assert_eq!(busy.state, pb::State::Ready as i32, "a used instance stays");
    assert_eq!(
        used(&mut d.client).await,
        1_000_000_000,
        "the idle one's memory is released"
    );
}

#[tokio::test]
async fn a_start_while_the_same_instance_stops_waits_and_answers_a_new_run() {
    let mut config = pool();
    // Ignores SIGTERM, so each stop lasts its whole 1 s grace.
    config += &shell(
        "stubborn",
        "trap '' TERM; exec sleep 3600",
        "policy = \"never\"",
    )
    .replace("stop_grace = \"2s\"", "stop_grace = \"1s\"");
    let mut d = Daemon::start(&config).await;
    let old = d.started("stubborn", "s").await;
    let old_pid = old.pid;
    assert!(old_pid > 0);
    let mut other = d.client.clone();
    let stop = tokio::spawn(async move {
        let req = pb::StopRequest {
            instance_id: "s".into(),
            grace_ms: 0,
        };
        other.stop(req).await.map(|r| r.into_inner())
    });
    d.wait_state("s", pb::State::Stopping).await;
    let started = d
        .client
        .start(start_req("stubborn", "s"))
        .await
        .expect("the start is admitted once the stop is over")
        .into_inner();
    let new = started.instance.expect("an instance");
    assert!(started.created, "a new run, not the dying one: {new:?}");
    assert_ne!(new.state, pb::State::Stopping as i32, "{new:?}");
    assert!(new.pid > 0 && new.pid != old_pid, "{new:?}");
    assert!(
        !alive(old_pid as i32),
        "the old run is gone before the new one is answered"
    );
    // The Stop answers with the run it ended, not the new one.
    let stopped = stop.await.expect("joined").expect("the stop");
    let stopped = stopped.instance.expect("an instance");
    assert_eq!(stopped.state, pb::State::Exited as i32, "{stopped:?}");
    assert_eq!(d.get("s").await.pid, new.pid);
    assert_eq!(used(&mut d.client).await, 4_000_000_000, "one reservation");
}

#[tokio::test]
async fn the_laptop_example_runs_as_shipped_and_embedded() {
    let example =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples/laptop.toml");
    let out = std::process::Command::new(RESIDENTD)
        .arg("--check-config")
        .arg(&example)
        .output()
        .expect("run residentd --check-config");
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("valid (1 pools, 3 workloads)"), "{said}");
    // With no --config the same file runs, its socket under the runtime
    // directory.
    let dir = tempfile::tempdir().expect("tempdir");
    let log = std::fs::File::create(dir.path().join("residentd.log")).expect("log");
    let child = std::process::Command::new(RESIDENTD)
        .env("XDG_RUNTIME_DIR", dir.path())
        .stdout(std::process::Stdio::null())
        .stderr(log)
        .spawn()
        .expect("start residentd");
    let socket = dir.path().join("residentd/residentd.sock");
    let client = connect(&socket).await;
    let mut d = Daemon {
        dir,
        socket,
        child: Some(child),
        client,
    };
    let node = d
        .client
        .node(pb::NodeRequest {})
        .await
        .expect("node")
        .into_inner();
    assert_eq!(node.node, "laptop");
    let pools: Vec<&str> = node.pools.iter().map(|p| p.name.as_str()).collect();
    assert_eq!(pools, ["ram"]);
    assert!(d.dir.path().join("residentd/state").is_dir(), "{}", d.log());
    assert!(d.terminate().await.success(), "{}", d.log());
}

#[tokio::test]
async fn an_answered_start_or_stop_survives_kill_9_of_the_agent_right_after() {
    let mut config = pool();
    config += &sleeper("sleeper", "ram", 1, "");
    let mut d = Daemon::start(&config).await;
    for round in 0..50 {
        let id = format!("r{round}");
        d.started("sleeper", &id).await;
        // kill -9 as soon as the answer is in (restart drops the old
        // agent with SIGKILL), then a new agent on the same state.
        d = d.restart().await;
        let restored = d.get(&id).await;
        let live = [pb::State::Starting as i32, pb::State::Ready as i32];
        assert!(
            live.contains(&restored.state),
            "round {round}: the answered start is back: {restored:?}"
        );
        d.stopped(&id).await;
        d = d.restart().await;
        assert!(
            !d.ids().await.contains(&id),
            "round {round}: the answered stop stays done"
        );
    }
}
