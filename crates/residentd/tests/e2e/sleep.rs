//! Sleep (`[workload.sleep]`), against a stand-in that speaks vLLM's sleep
//! API and really frees and takes its memory again (tests/sleep/standin.py):
//! a sleeping instance keeps its process, pid and port and the books hold
//! its asleep demand; a Start wakes it; the planner puts it to sleep before
//! it evicts anyone; a refused wake changes nothing; a failed wake, or a
//! server that dies asleep, stops it and releases what it held; an agent
//! killed and started again takes it over asleep.

use std::time::Duration;

use resident_api::pb;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use crate::support::*;

const GB: u64 = 1_000_000_000;

/// Pools `gpu` (4 GB) and `ram` (8 GB); workload `big` (the stand-in,
/// holding 40 MB, with `flags`: 3 GB of `gpu` awake; asleep 0.5 GB of
/// `gpu` and its 3 GB of weights in `ram`), and `other` (3 GB of `gpu`,
/// cannot sleep).
pub(crate) fn config(flags: &str) -> String {
    let script = workspace().join("tests/sleep/standin.py");
    let flags: String = flags
        .split_whitespace()
        .map(|f| format!(", \"{f}\""))
        .collect();
    format!(
        "{}{}[[workload]]\nname = \"big\"\ncommand = [\"python3\", \"-u\", \"{}\", \"${{PORT}}\", \"40\"{flags}]\nstop_grace = \"2s\"\n[workload.memory.gpu]\nweights = \"3GB\"\n[workload.readiness]\nhttp = \"/health\"\ntimeout = \"30s\"\n[workload.sleep]\nsleep = \"POST /sleep?level=1\"\nwake = \"POST /wake_up\"\ntimeout = \"3s\"\n[workload.sleep.memory.gpu]\noverhead = \"0.5GB\"\n[workload.sleep.memory.ram]\nweights = \"3GB\"\n\n{}",
        pool("gpu", "4GB"),
        pool("ram", "8GB"),
        script.display(),
        sleeper("other", "gpu", 3, ""),
    )
}

/// `used_bytes` of each pool, by name.
async fn used(d: &mut Daemon) -> (u64, u64) {
    let node = d.node().await;
    let of = |name: &str| {
        node.pools
            .iter()
            .find(|p| p.name == name)
            .map_or(0, |p| p.used_bytes)
    };
    (of("gpu"), of("ram"))
}

/// The body of `GET path` on loopback `port`.
async fn get(port: u32, path: &str) -> String {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port as u16))
        .await
        .unwrap_or_else(|e| panic!("connect to {port} for {path}: {e}"));
    let ask = format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n");
    s.write_all(ask.as_bytes()).await.expect("ask");
    let mut answer = String::new();
    let read = tokio::time::timeout(Duration::from_secs(30), s.read_to_string(&mut answer));
    read.await.expect("answered in time").expect("read");
    answer
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_string()
}

/// An agent on `config(flags)` with `big` READY as instance `b`.
pub(crate) async fn big_ready(flags: &str) -> (Daemon, pb::Instance) {
    let mut d = Daemon::start(&config(flags)).await;
    d.client
        .start(start("big", "b", false))
        .await
        .expect("started");
    let awake = d.wait_state("b", pb::State::Ready).await;
    (d, awake)
}

async fn sleep(d: &mut Daemon, id: &str) -> Result<pb::Instance, tonic::Status> {
    let req = pb::SleepRequest {
        instance_id: id.into(),
    };
    d.client.sleep(req).await.map(|r| r.into_inner())
}

/// The answer to `req`, which must be admitted (`what` says why it is).
async fn started(d: &mut Daemon, req: pb::StartRequest, what: &str) -> pb::StartResponse {
    let answer = d.client.start(req).await;
    answer.expect(what).into_inner()
}

/// Kills the agent once `call` (a Sleep or Start in flight) has reached
/// the stand-in on `port`: once it says it is `sleeping` (or not); the
/// call then gets no answer.
async fn killed_once_reached(
    d: &mut Daemon,
    call: tokio::task::JoinHandle<Result<(), tonic::Status>>,
    port: u32,
    sleeping: bool,
) {
    let said = format!("{sleeping}");
    let reached = async || get(port, "/is_sleeping").await.contains(&said);
    assert!(eventually(reached).await, "the call reached the server");
    d.kill();
    let answer = call.await.expect("joined");
    assert!(answer.is_err(), "no answer from a killed agent");
}

fn start(workload: &str, id: &str, evict: bool) -> pb::StartRequest {
    let policy = if evict {
        pb::Policy::Evict
    } else {
        pb::Policy::Refuse
    };
    pb::StartRequest {
        on_full: policy as i32,
        wait_ready: true,
        ..start_req(workload, id)
    }
}

#[tokio::test]
async fn a_sleeping_instance_keeps_its_process_and_port_and_a_start_wakes_it() {
    let mut d = Daemon::start(&config("")).await;
    let mut events = d.watch(0).await;
    d.client
        .start(start("big", "b", false))
        .await
        .expect("started");
    let awake = d.wait_state("b", pb::State::Ready).await;
    assert_eq!(used(&mut d).await, (3 * GB, 0));
    // The stand-in's 40 MB are measured while awake.
    let measured = until(async || {
        let i = d.get("b").await;
        (i.measured_bytes > 40_000_000).then_some(i.measured_bytes)
    })
    .await;
    assert!(measured.is_some(), "its memory was never measured");

    let asleep = sleep(&mut d, "b").await.expect("put to sleep");
    assert_eq!(asleep.state, pb::State::Sleeping as i32, "{asleep:?}");
    assert!(asleep.message.starts_with("SLEEPING"), "{}", asleep.message);
    assert_eq!((asleep.pid, asleep.port), (awake.pid, awake.port));
    assert!(alive(awake.pid as i32));
    assert_eq!(
        get(awake.port, "/is_sleeping").await,
        "{\"is_sleeping\": true}"
    );
    // The books hold its asleep demand: 0.5 GB of gpu, its weights in ram.
    assert_eq!(used(&mut d).await, (GB / 2, 3 * GB));
    // And the server really gave its memory back.
    let freed = eventually(async || d.get("b").await.measured_bytes < 30_000_000).await;
    assert!(
        freed,
        "measured {} bytes asleep",
        d.get("b").await.measured_bytes
    );
    // A second Sleep is refused, with why.
    let again = sleep(&mut d, "b").await.expect_err("asleep already");
    assert_eq!(again.code(), tonic::Code::FailedPrecondition, "{again:?}");

    // A Start wakes it: the same process, not created.
    let woken = d.client.start(start("b-again", "b", false)).await;
    assert!(woken.is_err(), "another workload's id is refused");
    let woken = started(&mut d, start("big", "b", false), "woken").await;
    assert!(!woken.created);
    let i = woken.instance.expect("the instance");
    assert_eq!(i.state, pb::State::Ready as i32, "{i:?}");
    assert!(i.message.contains("WOKEN"), "{}", i.message);
    assert_eq!((i.pid, i.port), (awake.pid, awake.port));
    assert_eq!(
        get(awake.port, "/is_sleeping").await,
        "{\"is_sleeping\": false}"
    );
    assert_eq!(used(&mut d).await, (3 * GB, 0));

    // Watchers saw it: SLEEPING, then READY and WOKEN.
    let mut seen = Vec::new();
    let saw = until(async || {
        let e = tokio::time::timeout(Duration::from_secs(5), events.message())
            .await
            .ok()?
            .ok()??;
        if let Some(i) = e.instance.filter(|i| i.instance_id == "b") {
            seen.push((i.state, i.message.clone()));
        }
        let slept = seen.iter().any(|(s, _)| *s == pb::State::Sleeping as i32);
        let woke = seen.iter().any(|(_, m)| m.contains("WOKEN"));
        (slept && woke).then_some(())
    })
    .await;
    assert!(saw.is_some(), "events: {seen:?}");
}

#[tokio::test]
async fn the_planner_puts_residents_to_sleep_before_it_evicts_and_a_wake_makes_room() {
    let (mut d, awake) = big_ready("").await;

    // Place says so first, changing nothing.
    let place = pb::PlaceRequest {
        workload: "other".into(),
        on_full: pb::Policy::Evict as i32,
        ..Default::default()
    };
    let placement = d.client.place(place).await.expect("place").into_inner();
    assert!(placement.admitted, "{placement:?}");
    assert_eq!(placement.sleep, ["b"]);
    assert!(placement.evict.is_empty(), "{placement:?}");
    assert_eq!(d.get("b").await.state, pb::State::Ready as i32);

    // Under refuse, nothing moves.
    let refused = d.client.start(start("other", "o", false)).await;
    assert_eq!(
        refused.expect_err("refused").code(),
        tonic::Code::ResourceExhausted
    );
    assert_eq!(d.get("b").await.state, pb::State::Ready as i32);

    // Under evict, `b` sleeps and nobody is evicted.
    let admitted = started(&mut d, start("other", "o", true), "admitted").await;
    assert_eq!(admitted.slept, ["b"]);
    assert!(admitted.evicted.is_empty(), "{admitted:?}");
    let b = d.get("b").await;
    assert_eq!(b.state, pb::State::Sleeping as i32, "{b:?}");
    assert_eq!(b.pid, awake.pid);
    assert_eq!(used(&mut d).await, (3 * GB + GB / 2, 3 * GB));

    // Waking `b` under refuse is refused (other holds the gpu), and
    // changes nothing.
    let refused = d.client.start(start("big", "b", false)).await;
    let status = refused.expect_err("the wake does not fit");
    assert_eq!(status.code(), tonic::Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("other"), "{}", status.message());
    assert_eq!(d.get("b").await.state, pb::State::Sleeping as i32);
    assert_eq!(used(&mut d).await, (3 * GB + GB / 2, 3 * GB));

    // Under evict the wake evicts `other` (it cannot sleep).
    let woken = started(&mut d, start("big", "b", true), "woken").await;
    assert_eq!(woken.evicted, ["o"]);
    assert!(!woken.created);
    let b = woken.instance.expect("b");
    assert_eq!((b.state, b.pid), (pb::State::Ready as i32, awake.pid));
    assert_eq!(used(&mut d).await, (3 * GB, 0));
}

#[tokio::test]
async fn a_resident_still_loading_is_evicted_rather_than_put_to_sleep() {
    let mut d = Daemon::start(&config("--slow-load")).await;
    // `b` is spawned but loads for 3 s: not serving, so no sleep call
    // can reach it.
    let req = pb::StartRequest {
        wait_ready: false,
        ..start("big", "b", false)
    };
    d.client.start(req).await.expect("admitted");
    let loading = d.wait_state("b", pb::State::Starting).await;
    // The plan frees the gpu by putting `b` to sleep; the agent stops it
    // instead, and says so.
    let admitted = started(&mut d, start("other", "o", true), "admitted").await;
    assert_eq!(admitted.evicted, ["b"], "{admitted:?}");
    assert!(admitted.slept.is_empty(), "{admitted:?}");
    let b = d.wait_state("b", pb::State::Exited).await;
    assert_eq!(b.cause, pb::Cause::Evicted as i32, "{b:?}");
    assert!(b.message.contains("not serving yet"), "{}", b.message);
    assert!(eventually(async || !alive(loading.pid as i32)).await);
    assert_eq!(used(&mut d).await, (3 * GB, 0));
}

#[tokio::test]
async fn a_failed_wake_stops_the_instance_and_releases_what_it_held() {
    let (mut d, awake) = big_ready("--fail-wake").await;
    sleep(&mut d, "b").await.expect("asleep");
    let failed = d.client.start(start("big", "b", false)).await;
    let status = failed.expect_err("the wake call fails");
    assert!(status.message().contains("SLEEP_FAILED"), "{status:?}");
    let ended = d.wait_state("b", pb::State::Exited).await;
    assert_eq!(ended.cause, pb::Cause::SleepFailed as i32, "{ended:?}");
    assert!(ended.message.contains("wake call"), "{}", ended.message);
    assert_eq!(used(&mut d).await, (0, 0));
    assert!(eventually(async || !alive(awake.pid as i32)).await);
}

#[tokio::test]
async fn a_sleep_whose_caller_goes_away_mid_call_still_ends_asleep() {
    let (mut d, awake) = big_ready("--slow-sleep").await;
    let mut req = tonic::Request::new(pb::SleepRequest {
        instance_id: "b".into(),
    });
    // The server takes a second to answer its sleep call; the caller
    // gives up long before.
    req.set_timeout(Duration::from_millis(200));
    let gone = d
        .client
        .sleep(req)
        .await
        .expect_err("the caller's deadline");
    // (tonic's client says Cancelled when its own timeout expires.)
    assert!(
        matches!(
            gone.code(),
            tonic::Code::Cancelled | tonic::Code::DeadlineExceeded
        ),
        "{gone:?}"
    );
    // The call carries on without it: asleep, its asleep demand held.
    let asleep = d.asleep("b").await;
    assert_eq!(asleep.pid, awake.pid);
    assert_eq!(used(&mut d).await, (GB / 2, 3 * GB));
    // And a Start wakes it, rather than waiting on a sleep that never ends.
    let woken = started(&mut d, start("big", "b", false), "woken").await;
    assert_eq!(
        woken.instance.map(|i| i.state),
        Some(pb::State::Ready as i32)
    );
    assert_eq!(used(&mut d).await, (3 * GB, 0));
}

#[tokio::test]
async fn a_failed_sleep_stops_the_instance() {
    let (mut d, _) = big_ready("--fail-sleep").await;
    let status = sleep(&mut d, "b").await.expect_err("the sleep call fails");
    assert!(status.message().contains("SLEEP_FAILED"), "{status:?}");
    let ended = d.wait_state("b", pb::State::Exited).await;
    assert_eq!(ended.cause, pb::Cause::SleepFailed as i32, "{ended:?}");
    assert_eq!(used(&mut d).await, (0, 0));
}

#[tokio::test]
async fn a_server_that_dies_asleep_releases_its_asleep_demand_and_is_not_restarted() {
    let (mut d, awake) = big_ready("").await;
    sleep(&mut d, "b").await.expect("asleep");
    assert_eq!(used(&mut d).await, (GB / 2, 3 * GB));
    let pid = nix::unistd::Pid::from_raw(awake.pid as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL).expect("kill the server");
    let ended = d.wait_state("b", pb::State::Exited).await;
    assert_eq!(ended.cause, pb::Cause::SleepFailed as i32, "{ended:?}");
    assert!(
        ended.message.contains("died while asleep"),
        "{}",
        ended.message
    );
    assert_eq!(used(&mut d).await, (0, 0));
}

#[tokio::test]
async fn an_agent_killed_and_started_again_takes_a_sleeping_instance_over_asleep() {
    let (mut d, awake) = big_ready("").await;
    sleep(&mut d, "b").await.expect("asleep");
    d.kill();
    let mut d = d.restart().await;
    let b = d.asleep("b").await;
    assert_eq!((b.pid, b.port), (awake.pid, awake.port));
    assert_eq!(used(&mut d).await, (GB / 2, 3 * GB));
    let woken = d
        .client
        .start(start("big", "b", false))
        .await
        .expect("woken");
    let b = woken.into_inner().instance.expect("b");
    assert_eq!((b.state, b.pid), (pb::State::Ready as i32, awake.pid));
}

/// An agent killed while its sleep call runs (the server has let its
/// model go, the answer not yet given): the journal says the instance was
/// falling asleep, and the next agent makes the call again (asleep
/// already, the server answers it done): asleep, the same process, its
/// asleep demand held.
#[tokio::test]
async fn an_agent_killed_mid_sleep_is_followed_by_one_that_finishes_the_sleep() {
    let (mut d, awake) = big_ready("--slow-sleep").await;
    let mut client = d.client.clone();
    let req = pb::SleepRequest {
        instance_id: "b".into(),
    };
    let call = tokio::spawn(async move { client.sleep(req).await.map(drop) });
    killed_once_reached(&mut d, call, awake.port, true).await;
    let mut d = d.restart().await;
    let b = d.asleep("b").await;
    assert_eq!((b.pid, b.port), (awake.pid, awake.port));
    assert_eq!(used(&mut d).await, (GB / 2, 3 * GB));
    assert!(get(awake.port, "/is_sleeping").await.contains("true"));
}

/// An agent killed while a wake call runs (the server has its memory
/// back, the answer not yet given): the journal says the instance was
/// waking, and the next agent makes the wake call again (awake already,
/// the server answers it done): READY, the same process, its awake demand
/// held.
#[tokio::test]
async fn an_agent_killed_mid_wake_is_followed_by_one_that_finishes_the_wake() {
    let (mut d, awake) = big_ready("--slow-wake").await;
    sleep(&mut d, "b").await.expect("asleep");
    let mut client = d.client.clone();
    let call = tokio::spawn(async move { client.start(start("big", "b", false)).await.map(drop) });
    killed_once_reached(&mut d, call, awake.port, false).await;
    let mut d = d.restart().await;
    let b = d.wait_state("b", pb::State::Ready).await;
    assert_eq!((b.pid, b.port), (awake.pid, awake.port));
    assert!(b.message.contains("WOKEN"), "{}", b.message);
    assert_eq!(used(&mut d).await, (3 * GB, 0));
}

/// An agent killed in the middle of a swap: `a` waking, `b` put to sleep
/// to make room for it, its sleep call under way. Awake, the two do not
/// fit together; the next agent takes both over as they were (both
/// demands held) and makes the calls again, the sleep first: `b` asleep,
/// `a` awake, the same processes; neither is refused or killed.
#[tokio::test]
async fn an_agent_killed_mid_swap_is_followed_by_one_that_finishes_it() {
    let mut d = Daemon::start(&config("--slow-sleep")).await;
    let a = started(&mut d, start("big", "a", false), "a").await;
    let a = a.instance.expect("a");
    sleep(&mut d, "a").await.expect("a asleep");
    let b = started(&mut d, start("big", "b", false), "b").await;
    let b = b.instance.expect("b");
    let mut client = d.client.clone();
    let swap = tokio::spawn(async move { client.start(start("big", "a", true)).await.map(drop) });
    killed_once_reached(&mut d, swap, b.port, true).await;
    let mut d = d.restart().await;
    let b_now = d.asleep("b").await;
    let a_now = d.wait_state("a", pb::State::Ready).await;
    assert_eq!((a_now.pid, b_now.pid), (a.pid, b.pid), "the same processes");
    assert!(a_now.message.contains("WOKEN"), "{}", a_now.message);
    assert!(get(a.port, "/is_sleeping").await.contains("false"));
    assert_eq!(used(&mut d).await, (3 * GB + GB / 2, 3 * GB));
}

/// An agent killed mid-sleep, and the workload's `[workload.sleep]`
/// taken out of the config before the next one starts: the sleep cannot
/// be finished, nor the server woken, so the instance is stopped
/// (SLEEP_FAILED), its memory released, rather than left half asleep.
#[tokio::test]
async fn a_sleep_under_way_whose_workload_no_longer_sleeps_is_stopped() {
    let (mut d, awake) = big_ready("--slow-sleep").await;
    let mut client = d.client.clone();
    let req = pb::SleepRequest {
        instance_id: "b".into(),
    };
    let call = tokio::spawn(async move { client.sleep(req).await.map(drop) });
    killed_once_reached(&mut d, call, awake.port, true).await;
    let table = "[workload.sleep]\nsleep = \"POST /sleep?level=1\"\nwake = \"POST /wake_up\"\ntimeout = \"3s\"\n[workload.sleep.memory.gpu]\noverhead = \"0.5GB\"\n[workload.sleep.memory.ram]\nweights = \"3GB\"\n";
    let sleepless = config("--slow-sleep");
    assert!(sleepless.contains(table), "{sleepless}");
    write_config(d.dir.path(), &sleepless.replace(table, ""));
    let mut d = d.restart().await;
    let ended = d.wait_state("b", pb::State::Exited).await;
    assert_eq!(ended.cause, pb::Cause::SleepFailed as i32, "{ended:?}");
    assert!(
        ended.message.contains("no longer sleeps"),
        "{}",
        ended.message
    );
    assert_eq!(used(&mut d).await, (0, 0));
    assert!(eventually(async || !alive(awake.pid as i32)).await);
}

/// A sleeping instance the next agent cannot restore (its node now takes
/// one instance, held by another restored first) is stopped, and nothing
/// of its sleep is left behind: started again later, it runs awake,
/// holding its awake demand.
#[tokio::test]
async fn a_sleeper_the_next_agent_could_not_restore_is_started_later_awake() {
    let rest = format!("{}{}", config(""), sleeper("small", "ram", 1, ""));
    let mut d = Daemon::start(&rest).await;
    started(&mut d, start("small", "s", false), "small").await;
    started(&mut d, start("big", "b", false), "big").await;
    sleep(&mut d, "b").await.expect("asleep");
    d.kill();
    write_config(d.dir.path(), &format!("max_instances = 1\n{rest}"));
    let mut d = d.restart().await;
    d.wait_state("s", pb::State::Ready).await;
    assert_eq!(
        d.ids().await,
        ["s"],
        "b is not restored: one instance at most"
    );
    d.stopped("s").await;
    let b = started(&mut d, start("big", "b", false), "b again").await;
    let b = b.instance.expect("b");
    assert_eq!(b.state, pb::State::Ready as i32, "{b:?}");
    assert_eq!(used(&mut d).await, (3 * GB, 0));
    assert!(get(b.port, "/is_sleeping").await.contains("false"));
}

#[tokio::test]
async fn residentctl_puts_to_sleep_says_whom_place_would_put_to_sleep_and_wakes() {
    let (mut d, _) = big_ready("").await;
    let text = |o: std::process::Output| {
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let placed = text(residentctl(
        &d.socket,
        &["place", "other", "--policy", "evict"],
    ));
    assert!(placed.contains("after putting b to sleep"), "{placed}");
    let slept = text(residentctl(&d.socket, &["sleep", "b"]));
    assert!(slept.contains("SLEEPING"), "{slept}");
    let woken = text(residentctl(
        &d.socket,
        &["start", "big", "--id", "b", "--wait"],
    ));
    assert!(woken.contains("woken"), "{woken}");
    assert_eq!(d.get("b").await.state, pb::State::Ready as i32);
}

#[tokio::test]
async fn an_instance_unused_for_its_sleep_idle_is_put_to_sleep_unless_held() {
    // Room for two of `big` awake (3 GB of gpu each) and asleep (3 GB of
    // ram each).
    let config = config("")
        .replace(
            "timeout = \"3s\"\n[workload.sleep.memory.gpu]",
            "timeout = \"3s\"\nidle = \"1s\"\n[workload.sleep.memory.gpu]",
        )
        .replace(
            "name = \"gpu\"\nbudget = \"4GB\"",
            "name = \"gpu\"\nbudget = \"8GB\"",
        );
    let mut d = Daemon::start(&config).await;
    d.client
        .start(start("big", "b", false))
        .await
        .expect("started");
    let awake = d.wait_state("b", pb::State::Ready).await;
    // Held for a while: not put to sleep however long it is unused.
    let hold = pb::TouchRequest {
        instance_id: "b".into(),
        hold_ms: 600_000,
        release_hold: false,
    };
    d.client.touch(hold).await.expect("held");
    // The control: `c`, of the same workload, unheld and last used after
    // `b` was: its idle second runs out after `b`'s, and the agent's idle
    // sweep (every second) puts it to sleep. Until it is asleep, and once
    // it is, `b` is still READY: the sweep that took `c` passed over `b`.
    d.client
        .start(start("big", "c", false))
        .await
        .expect("started");
    let mut b = d.get("b").await;
    let c_asleep = until(async || {
        b = d.get("b").await;
        if b.state != pb::State::Ready as i32 {
            return Some(false);
        }
        let c = d.get("c").await;
        (c.state == pb::State::Sleeping as i32 && c.message.starts_with("SLEEPING: asleep"))
            .then_some(true)
    })
    .await;
    assert_eq!(
        c_asleep,
        Some(true),
        "the unheld sibling falls asleep while the held one stays READY: b is {b:?}"
    );
    let b = d.get("b").await;
    assert_eq!(
        b.state,
        pb::State::Ready as i32,
        "a held instance was put to sleep: {b:?}"
    );
    assert_eq!(used(&mut d).await, (3 * GB + GB / 2, 3 * GB));
    // Its hold ended: asleep about a second later, the same process.
    let release = pb::TouchRequest {
        instance_id: "b".into(),
        hold_ms: 0,
        release_hold: true,
    };
    d.client.touch(release).await.expect("released");
    let asleep = d.asleep("b").await;
    assert_eq!(asleep.pid, awake.pid);
    assert_eq!(used(&mut d).await, (GB, 6 * GB));
}
