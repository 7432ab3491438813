//! `WatchNode`, what a fleet view (`residentd.fleet.View`) keeps a node's
//! picture by: the whole node first (with its roster and epoch), every
//! event with the figures after it, figures that move without an event
//! (a hold, a probe reading) at most once per interval, heartbeats, and
//! epochs: a crashed agent's revisions are never resumed from, an
//! upgraded agent's are.

use std::time::{Duration, Instant};

use resident_api::pb;
use tonic::Code;

use crate::support::*;

const GB: u64 = 1_000_000_000;

fn request(since: u64, epoch: u64, every_ms: u32, heartbeat_ms: u32) -> pb::WatchNodeRequest {
    pb::WatchNodeRequest {
        since_revision: since,
        epoch,
        figures_every_ms: every_ms,
        heartbeat_ms,
    }
}

async fn watch_node(d: &mut Daemon, req: pb::WatchNodeRequest) -> tonic::Streaming<pb::NodeUpdate> {
    d.client
        .watch_node(req)
        .await
        .expect("watch node")
        .into_inner()
}

/// Updates of `stream` until `done` holds for one, for at most
/// `PATIENCE`: every update read, the last the one `done` took.
async fn read_until(
    stream: &mut tonic::Streaming<pb::NodeUpdate>,
    mut done: impl FnMut(&pb::NodeUpdate) -> bool,
) -> Vec<pb::NodeUpdate> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let mut seen = Vec::new();
    loop {
        let next = tokio::time::timeout_at(deadline, stream.message()).await;
        let Ok(next) = next else {
            panic!("never came within {PATIENCE:?}; read {seen:#?}");
        };
        let u = next.expect("the stream").expect("an update");
        let stop = done(&u);
        seen.push(u);
        if stop {
            return seen;
        }
    }
}

fn used(f: &pb::NodeFigures) -> u64 {
    f.pools[0].used_bytes
}

#[tokio::test]
async fn the_whole_node_first_then_each_event_with_the_figures_after_it() {
    let config = pool("ram", "10GB")
        + &sleeper("a", "ram", 2, "priority = 3\nexcludes = [\"role:x\"]")
        + &sleeper("b", "ram", 3, "")
        + &sleeper("x", "ram", 1, "")
        + "[[group]]\nname = \"solo\"\nmembers = [\"b\"]\nexclusive = true\n";
    let mut d = Daemon::start(&config).await;
    d.ready("a", "a1").await;
    let node = d.node().await;
    assert_ne!(node.epoch, 0, "an epoch is drawn");
    assert_eq!(node.on_full, pb::Policy::Refuse as i32);
    let mut s = watch_node(&mut d, request(0, 0, 0, 0)).await;
    let first = s.message().await.expect("stream").expect("first");
    let whole = first.node.as_ref().expect("the whole node first");
    assert_eq!((first.epoch, whole.epoch), (node.epoch, node.epoch));
    assert_eq!(first.revision, whole.revision);
    assert!(first.revision >= node.revision);
    let ids: Vec<&str> = whole
        .instances
        .iter()
        .map(|i| i.instance_id.as_str())
        .collect();
    assert_eq!(ids, ["a1"]);
    assert_eq!(whole.instances[0].priority, 3);
    assert_eq!(used(first.figures.as_ref().expect("figures")), 2 * GB);
    let roster = &first.roster.as_ref().expect("the roster").workloads;
    let a = roster.iter().find(|w| w.name == "a").expect("a");
    assert_eq!(
        (a.priority, a.excludes.clone()),
        (3, vec!["role:x".to_string()])
    );
    assert!(a.group.is_none() && !a.can_sleep);
    let b = roster.iter().find(|w| w.name == "b").expect("b");
    let g = b.group.as_ref().expect("b's group");
    assert_eq!(
        (g.name.as_str(), g.exclusive, g.swap, g.persistent),
        ("solo", true, false, false)
    );

    // Another client starts b: its events come, the one ending a run with
    // the figures as they are after it.
    d.ready("b", "b1").await;
    let seen = read_until(&mut s, |u| {
        u.event.as_ref().is_some_and(|e| {
            e.instance
                .as_ref()
                .is_some_and(|i| i.instance_id == "b1" && i.state == pb::State::Ready as i32)
        }) && u.figures.is_some()
    })
    .await;
    let last = seen.last().expect("an update");
    assert_eq!(used(last.figures.as_ref().expect("figures")), 5 * GB);
    let revisions: Vec<u64> = seen
        .iter()
        .filter(|u| u.event.is_some())
        .map(|u| u.revision)
        .collect();
    assert!(revisions.windows(2).all(|w| w[0] < w[1]), "{revisions:?}");
    assert!(
        seen.iter()
            .all(|u| u.node.is_none() && u.epoch == node.epoch)
    );
}

#[tokio::test]
async fn figures_moved_without_an_event_come_at_most_once_per_interval() {
    let config = pool("ram", "10GB") + &sleeper("a", "ram", 2, "");
    let mut d = Daemon::start(&config).await;
    d.ready("a", "a1").await;
    let every = Duration::from_millis(300);
    let mut s = watch_node(&mut d, request(0, 0, every.as_millis() as u32, 0)).await;
    s.message().await.expect("stream").expect("the whole node");
    // A hold is no event: it comes as figures.
    let touch = |hold_ms, release_hold| pb::TouchRequest {
        instance_id: "a1".into(),
        hold_ms,
        release_hold,
    };
    d.client.touch(touch(60_000, false)).await.expect("touch");
    let seen = read_until(&mut s, |u| {
        u.figures.as_ref().is_some_and(|f| !f.holds.is_empty())
    })
    .await;
    let held = seen
        .last()
        .and_then(|u| u.figures.clone())
        .expect("figures");
    assert_eq!(held.holds[0].instance_id, "a1");
    assert!(held.holds[0].hold_left_ms > 50_000, "{held:?}");
    assert!(
        seen.iter().all(|u| u.event.is_none()),
        "a Touch publishes no event"
    );

    // Holds moved by Touches every 10 ms for a second, then released: the
    // figures come at most once per interval, and the last state comes.
    let began = Instant::now();
    let mut touches = 0;
    while began.elapsed() < Duration::from_secs(1) {
        d.client
            .touch(touch(60_000 + touches, false))
            .await
            .expect("touch");
        touches += 1;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    d.client.touch(touch(0, true)).await.expect("release");
    let seen = read_until(&mut s, |u| {
        u.figures.as_ref().is_some_and(|f| f.holds.is_empty())
    })
    .await;
    let took = began.elapsed();
    let figures = seen.iter().filter(|u| u.figures.is_some()).count() as u32;
    let bound = (took.as_millis() / every.as_millis()) as u32 + 2;
    // What each update carried, for a failure to show why.
    let carried: Vec<String> = seen
        .iter()
        .map(|u| {
            let event = u.event.as_ref().map(|e| format!("{:?}", e.kind()));
            let holds = u.figures.as_ref().map(|f| f.holds.len());
            format!(
                "event {event:?}, figures with holds {holds:?}, roster {}",
                u.roster.is_some()
            )
        })
        .collect();
    assert!(
        (1..=bound).contains(&figures),
        "{figures} figures updates in {took:?} for {touches} touches (at most {bound}):\n{}",
        carried.join("\n")
    );
}

#[tokio::test]
async fn a_probe_reading_that_moves_the_budget_comes_as_figures() {
    let dir = tempfile::tempdir().expect("tempdir");
    let reading = dir.path().join("gpu0.available");
    std::fs::write(&reading, format!("{}\n", 20 * GB)).expect("reading");
    let config = format!(
        "[[pool]]\nname = \"gpu0\"\nbudget = \"24GB\"\ndevice = \"file:{}\"\n\n",
        reading.display()
    ) + &sleeper("m", "gpu0", 1, "");
    write_config(dir.path(), &config);
    let mut d = Daemon::start_in(dir).await;
    let mut s = watch_node(&mut d, request(0, 0, 100, 0)).await;
    let first = s.message().await.expect("stream").expect("the whole node");
    let effective = |u: &pb::NodeUpdate| {
        u.figures
            .as_ref()
            .and_then(|f| f.pools[0].effective_budget_bytes)
    };
    assert_eq!(effective(&first), Some(20 * GB));
    // Someone else takes 8 GB of the card: no event, and no call of ours.
    std::fs::write(&reading, format!("{}\n", 12 * GB)).expect("reading");
    let seen = read_until(&mut s, |u| effective(u) == Some(12 * GB)).await;
    assert!(seen.iter().all(|u| u.event.is_none()), "{seen:#?}");
}

#[tokio::test]
async fn a_quiet_agent_sends_heartbeats() {
    let mut d = Daemon::start(&pool("ram", "10GB")).await;
    let mut s = watch_node(&mut d, request(0, 0, 0, 200)).await;
    let first = s.message().await.expect("stream").expect("the whole node");
    let mut beats = 0;
    read_until(&mut s, |u| {
        let empty =
            u.node.is_none() && u.event.is_none() && u.figures.is_none() && u.roster.is_none();
        assert!(empty, "nothing happened but time: {u:?}");
        assert_eq!((u.epoch, u.revision), (first.epoch, first.revision));
        beats += 1;
        beats == 2
    })
    .await;
}

#[tokio::test]
async fn out_of_range_intervals_are_refused() {
    let mut d = Daemon::start(&pool("ram", "10GB")).await;
    for req in [
        request(0, 0, 10, 0),
        request(0, 0, 0, 50),
        request(0, 0, 70_000, 0),
    ] {
        let e = d.client.watch_node(req).await.expect_err("out of range");
        assert_eq!(e.code(), Code::InvalidArgument, "{req:?}: {e:?}");
    }
}

/// The revision of the last update of `s`, read until it ends (for at
/// most `PATIENCE`), and how it ended.
async fn until_end(s: &mut tonic::Streaming<pb::NodeUpdate>) -> (u64, Option<tonic::Status>) {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let mut last = 0;
    loop {
        match tokio::time::timeout_at(deadline, s.message()).await {
            Ok(Ok(Some(u))) => last = u.revision,
            Ok(Ok(None)) => return (last, None),
            Ok(Err(e)) => return (last, Some(e)),
            Err(_) => panic!("the stream did not end within {PATIENCE:?}"),
        }
    }
}

#[tokio::test]
async fn a_crashed_agent_has_another_epoch_and_its_old_revisions_begin_afresh() {
    let config = pool("ram", "10GB") + &sleeper("a", "ram", 2, "");
    let mut d = Daemon::start(&config).await;
    for id in ["a1", "a2", "a3"] {
        d.ready("a", id).await;
    }
    let before = d.node().await;
    d.kill();
    let mut d = d.restart().await;
    let after = d.node().await;
    assert_ne!(after.epoch, before.epoch, "a crash draws a new epoch");
    // Resuming from the old revision with the old epoch: the whole node,
    // never events of the new agent read as the old one's.
    let mut s = watch_node(&mut d, request(before.revision, before.epoch, 0, 0)).await;
    let first = s.message().await.expect("stream").expect("first");
    assert_eq!(first.epoch, after.epoch);
    let whole = first.node.expect("the whole node, not a resume");
    assert_eq!(whole.instances.len(), 3, "taken over: {whole:?}");
    // Within the new epoch it resumes.
    let mut s = watch_node(&mut d, request(first.revision, after.epoch, 0, 0)).await;
    let resumed = s.message().await.expect("stream").expect("first");
    assert!(
        resumed.node.is_none() && resumed.figures.is_some(),
        "{resumed:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_keeps_the_epoch_and_a_watch_resumes_without_a_gap() {
    let config = pool("ram", "10GB") + &sleeper("a", "ram", 2, "");
    let mut d = Daemon::start(&config).await;
    d.ready("a", "a1").await;
    let epoch = d.node().await.epoch;
    let mut s = watch_node(&mut d, request(0, 0, 0, 0)).await;
    let first = s.message().await.expect("stream").expect("the whole node");
    let socket = d.socket.clone();
    let o = tokio::task::spawn_blocking(move || residentctl(&socket, &["upgrade"]))
        .await
        .expect("joined");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let _new = Upgraded(agent_pid(&d.socket).await);
    let (last, ended) = until_end(&mut s).await;
    let last = last.max(first.revision);
    assert_eq!(ended.map(|e| e.code()), Some(Code::Unavailable));
    d.client = connect(&d.socket).await;
    assert_eq!(
        d.node().await.epoch,
        epoch,
        "an upgrade hands the epoch over"
    );
    let mut s = watch_node(&mut d, request(last, epoch, 0, 0)).await;
    d.ready("a", "a2").await;
    let seen = read_until(&mut s, |u| {
        u.event.as_ref().is_some_and(|e| {
            e.instance
                .as_ref()
                .is_some_and(|i| i.instance_id == "a2" && i.state == pb::State::Ready as i32)
        })
    })
    .await;
    assert!(
        seen.iter().all(|u| u.node.is_none()),
        "resumed, not begun afresh"
    );
    let revisions: Vec<u64> = seen
        .iter()
        .filter(|u| u.event.is_some())
        .map(|u| u.revision)
        .collect();
    let expected: Vec<u64> = (last + 1..=last + revisions.len() as u64).collect();
    assert_eq!(revisions, expected, "no gap, no repeat after {last}");
}
