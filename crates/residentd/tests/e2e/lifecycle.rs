//! Instances over time through the real agent: crashes and restarts and
//! what they hold, Watch and Logs streams, reloads, idle expiry, and a
//! start that meets its own instance stopping.

use crate::support::*;
use nix::sys::signal::Signal;
use resident_api::pb;
use tokio_stream::StreamExt as _;

fn ram() -> String {
    pool("ram", "10GB")
}

#[tokio::test]
async fn crashes_release_memory_restarts_keep_it_giving_up_releases_it() {
    let mut config = ram();
    config += &shell("crasher", "exit 3", "policy = \"never\"");
    config += &shell(
        "looper",
        "sleep 0.3; exit 3",
        "policy = \"on-failure\"\nmax_restarts = 2\nbackoff = \"200ms\"",
    );
    let mut d = Daemon::start(&config).await;
    d.started("crasher", "c").await;
    let failed = d.wait_state("c", pb::State::Failed).await;
    assert_eq!(failed.exit_code, 3);
    assert_eq!(d.used().await, 0, "a crash releases the memory");

    d.started("looper", "l").await;
    let backoff = d.wait_state("l", pb::State::Backoff).await;
    assert!(
        backoff.message.contains("restart 1 of 2"),
        "{}",
        backoff.message
    );
    assert_eq!(
        d.used().await,
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
    assert_eq!(d.used().await, 0, "giving up releases it");
}

#[tokio::test]
async fn watch_sees_every_transition_in_order_and_resumes() {
    let mut config = ram();
    config += &sleeper("a", "ram", 6, "");
    config += &sleeper("b", "ram", 6, "");
    let mut d = Daemon::start(&config).await;
    d.started("a", "a1").await;
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
    let mut config = ram();
    config += &shell(
        "talker",
        "echo one; echo two >&2; sleep 0.5; echo three; sleep 3600",
        "policy = \"never\"",
    );
    let mut d = Daemon::start(&config).await;
    d.started("talker", "t").await;
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
async fn sighup_reloads_pools_without_touching_instances_and_refuses_a_bad_file() {
    let config = ram() + &sleeper("a", "ram", 1, "");
    let mut d = Daemon::start(&config).await;
    let a = d.started("a", "a").await;
    let pid = a.pid;
    let path = d.dir.path().join("residentd.toml");
    let grown =
        config_text(d.dir.path(), &config).replace("budget = \"10GB\"", "budget = \"20GB\"");
    std::fs::write(&path, grown).expect("rewrite the config");
    d.signal(Signal::SIGHUP);
    let budget = |n: pb::NodeStatus| n.pools[0].budget_bytes;
    let grew = eventually(async || budget(d.node().await) == Some(20_000_000_000)).await;
    assert!(grew, "the reload did not take effect");
    let a_now = d.get("a").await;
    assert_eq!(
        (a_now.pid, a_now.state),
        (pid, pb::State::Ready as i32),
        "the instance was not touched"
    );
    // A broken file: refused, logged, the previous config stays.
    std::fs::write(&path, "[node\nname = ").expect("break the config");
    d.signal(Signal::SIGHUP);
    let refused = eventually(async || d.log().contains("configuration reload refused")).await;
    assert!(refused, "the bad reload is logged: {}", d.log());
    assert!(
        d.log().contains("residentd.toml:1"),
        "the error names file and line"
    );
    assert_eq!(budget(d.node().await), Some(20_000_000_000));
}

#[tokio::test]
async fn an_idle_instance_is_stopped_after_its_ttl_and_a_touched_one_is_not() {
    let mut config = ram();
    config += &sleeper("idle", "ram", 1, "idle_ttl = \"1s\"");
    config += &sleeper("busy", "ram", 1, "idle_ttl = \"1s\"");
    let mut d = Daemon::start(&config).await;
    d.started("idle", "idle").await;
    d.started("busy", "busy").await;
    // Keep "busy" in use while "idle" expires.
    let expired = eventually(async || {
        let touch = pb::TouchRequest {
            instance_id: "busy".into(),
            hold_ms: 0,
            ..Default::default()
        };
        d.client.touch(touch).await.expect("touch");
        d.get("idle").await.state == pb::State::Exited as i32
    })
    .await;
    assert!(expired, "the idle instance was never stopped");
    let busy = d.get("busy").await;
    assert_eq!(busy.state, pb::State::Ready as i32, "a used instance stays");
    assert_eq!(
        d.used().await,
        1_000_000_000,
        "the idle one's memory is released"
    );
}

#[tokio::test]
async fn a_start_while_the_same_instance_stops_waits_and_answers_a_new_run() {
    let mut config = ram();
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
    assert_eq!(d.used().await, 4_000_000_000, "one reservation");
}

#[tokio::test]
async fn a_start_with_wait_ready_of_a_starting_instance_answers_when_it_is_ready() {
    let dir = tempfile::tempdir().expect("tempdir");
    let go = dir.path().join("go");
    // Listens (and so becomes READY) only once the file `go` exists.
    let script = format!(
        "while [ ! -e {go} ]; do sleep 0.02; done; exec python3 -m http.server $1 --bind 127.0.0.1",
        go = go.display()
    );
    let mut config = ram();
    config += &format!(
        "[[workload]]\nname = \"late\"\ncommand = [\"/bin/sh\", \"-c\", \"{script}\", \"late\", \"${{PORT}}\"]\nstop_grace = \"2s\"\n[workload.memory.ram]\nweights = \"1GB\"\n[workload.readiness]\ntcp = true\ntimeout = \"60s\"\n"
    );
    write_config(dir.path(), &config);
    let mut d = Daemon::start_in(dir).await;
    d.started("late", "l").await;
    assert_eq!(d.get("l").await.state, pb::State::Starting as i32);
    let mut c = d.client.clone();
    let second = tokio::spawn(async move {
        let mut req = start_req("late", "l");
        req.wait_ready = true;
        c.start(req).await
    });
    std::fs::File::create(&go).expect("create go");
    let answer = second.await.expect("join").expect("start").into_inner();
    assert!(!answer.created, "the same run");
    assert_eq!(
        answer.instance.expect("instance").state,
        pb::State::Ready as i32,
        "wait_ready answers READY, also for an instance that already existed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_stopped_before_its_spawn_ends_with_an_event() {
    let mut config = ram();
    // Ignores SIGTERM: its eviction takes its whole stop grace.
    config += &shell(
        "stubborn",
        "trap '' TERM; while true; do sleep 1; done",
        "policy = \"never\"",
    )
    .replace("stop_grace = \"2s\"", "stop_grace = \"3s\"");
    config += &sleeper("big", "ram", 8, "");
    let mut d = Daemon::start(&config).await;
    d.started("stubborn", "s").await;
    let mut events = d.watch(0).await;
    let mut c = d.client.clone();
    let start = tokio::spawn(async move {
        let mut req = start_req("big", "b");
        req.on_full = pb::Policy::Evict as i32;
        c.start(req).await
    });
    // b is admitted and waits for s to leave; stopped now, it never spawns.
    let pending = until(async || {
        let b = d.list().await.into_iter().find(|i| i.instance_id == "b")?;
        (b.state == pb::State::Pending as i32).then_some(b)
    })
    .await;
    assert!(pending.is_some(), "b was never admitted");
    d.stopped("b").await;
    let e = start
        .await
        .expect("join")
        .expect_err("stopped before its spawn");
    assert_eq!(e.code(), tonic::Code::Aborted, "{e:?}");
    // Watchers hear how it ended, as List says.
    let listed = d.get("b").await;
    assert_eq!(listed.state, pb::State::Exited as i32, "{listed:?}");
    let heard = tokio::time::timeout(PATIENCE, async {
        while let Some(Ok(e)) = events.next().await {
            if e.instance
                .as_ref()
                .is_some_and(|i| i.instance_id == "b" && i.state == pb::State::Exited as i32)
            {
                return true;
            }
        }
        false
    })
    .await;
    assert_eq!(heard, Ok(true), "no event told watchers that b ended");
}
