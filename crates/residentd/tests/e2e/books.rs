//! Every charge is planned: a sleep whose asleep demand does not fit is
//! refused (by RPC) or stopped instead (by idle time), and the books never
//! pass a budget; a wake kept out only by a hold is temporary, so the
//! router queues it and serves it once the hold ends. Against the vLLM
//! stand-in (tests/sleep/standin.py), whose level-1 sleep moves its
//! weights into host memory.

use std::time::Duration;

use resident_api::pb;

use crate::router::{post, raw};
use crate::support::*;
use crate::takeover::{journaled_running, replace_file};

const GB: u64 = 1_000_000_000;

/// A vLLM-flavoured stand-in `name`: 3 GB of `gpu` awake; asleep (level
/// 1), 0.5 GB of `gpu` and its 3 GB of weights in `ram`. `idle`: its sleep
/// idle, if any.
fn level_one(name: &str, idle: Option<&str>) -> String {
    let script = workspace().join("tests/sleep/standin.py");
    let idle = idle.map_or_else(String::new, |i| format!("idle = \"{i}\"\n"));
    format!(
        "[[workload]]\nname = \"{name}\"\ncommand = [\"python3\", \"-u\", \"{}\", \"${{PORT}}\", \"20\"]\nstop_grace = \"2s\"\n[workload.memory.gpu]\nweights = \"3GB\"\n[workload.readiness]\nhttp = \"/health\"\ntimeout = \"30s\"\n[workload.sleep]\nsleep = \"POST /sleep?level=1\"\nwake = \"POST /wake_up\"\ntimeout = \"3s\"\n{idle}[workload.sleep.memory.gpu]\noverhead = \"0.5GB\"\n[workload.sleep.memory.ram]\nweights = \"3GB\"\n\n",
        script.display()
    )
}

/// Two level-1 models on a GPU with room for both, and host memory with
/// room for one model's weights (4 GB).
fn two_models(idle: Option<&str>) -> String {
    pool("gpu", "8GB") + &pool("ram", "4GB") + &level_one("a", idle) + &level_one("b", idle)
}

/// `used_bytes` and `budget_bytes` of pool `name`.
async fn pool_of(d: &mut Daemon, name: &str) -> (u64, u64) {
    let node = d.node().await;
    let p = node
        .pools
        .iter()
        .find(|p| p.name == name)
        .unwrap_or_else(|| panic!("pool {name}: {node:?}"));
    (p.used_bytes, p.budget_bytes.unwrap_or(u64::MAX))
}

/// Fails when any pool's counted bytes pass its budget.
async fn within_budgets(d: &mut Daemon, when: &str) {
    for name in ["gpu", "ram"] {
        let (used, budget) = pool_of(d, name).await;
        assert!(
            used <= budget,
            "{when}: pool {name} holds {used} of {budget}"
        );
    }
}

async fn sleep(d: &mut Daemon, id: &str) -> Result<pb::Instance, tonic::Status> {
    let req = pb::SleepRequest {
        instance_id: id.into(),
    };
    d.client.sleep(req).await.map(|r| r.into_inner())
}

/// Before the sleep was planned, both calls answered OK and `Node` showed
/// the host pool at 6 GB of 4.
#[tokio::test]
async fn a_second_level_one_sleep_into_host_memory_for_one_is_refused() {
    let mut d = Daemon::start(&two_models(None)).await;
    d.ready("a", "a").await;
    d.ready("b", "b").await;
    within_budgets(&mut d, "both awake").await;
    let a = sleep(&mut d, "a").await.expect("a fits asleep");
    assert_eq!(a.state, pb::State::Sleeping as i32, "{a:?}");
    assert_eq!(pool_of(&mut d, "ram").await.0, 3 * GB);
    let refused = sleep(&mut d, "b")
        .await
        .expect_err("no room for b's weights");
    assert_eq!(
        refused.code(),
        tonic::Code::ResourceExhausted,
        "{refused:?}"
    );
    // The same details as a refused start: the reason (ErrorInfo, the
    // first reason's code) and the Placement with the pool figures it was
    // decided on.
    let (reason, placement) = refused_details(&refused);
    assert_eq!(reason, "OVER_BUDGET", "{refused:?}");
    let ram = placement.pools.iter().find(|p| p.name == "ram");
    assert_eq!(ram.map(|p| p.used_bytes), Some(3 * GB), "{placement:?}");
    assert!(
        refused.message().contains("ram") && refused.message().contains("a"),
        "{}",
        refused.message()
    );
    // Nothing changed: b serves, awake, holding what it held.
    let b = d.get("b").await;
    assert_eq!(b.state, pb::State::Ready as i32, "{b:?}");
    assert_eq!(pool_of(&mut d, "ram").await.0, 3 * GB);
    within_budgets(&mut d, "after the refusal").await;
}

/// The ErrorInfo reason and the Placement of a refusal's rich details.
fn refused_details(status: &tonic::Status) -> (String, pb::Placement) {
    use prost::Message as _;
    use tonic_types::StatusExt as _;
    let reason = status
        .get_error_details()
        .error_info()
        .map(|i| i.reason.clone())
        .unwrap_or_default();
    let rich = tonic_types::pb::Status::decode(status.details()).expect("rich details");
    let placement = rich
        .details
        .iter()
        .find(|a| a.type_url.ends_with("resident.v1.Placement"))
        .map(|a| pb::Placement::decode(a.value.as_slice()).expect("a Placement"))
        .expect("the refusal carries its Placement");
    (reason, placement)
}

/// With a sleep idle and no call at all: the first to fall idle sleeps,
/// the other, whose weights would not fit beside it, is stopped as its
/// idle time would have stopped it without sleep, its message saying why.
/// Before, both fell asleep and the host pool held 6 GB of 4.
#[tokio::test]
async fn an_idle_sleep_that_does_not_fit_stops_the_instance_instead() {
    let mut d = Daemon::start(&two_models(Some("1s"))).await;
    d.ready("a", "a").await;
    d.ready("b", "b").await;
    let mut seen_over = None;
    let settled = until(async || {
        let (used, budget) = pool_of(&mut d, "ram").await;
        if used > budget {
            seen_over = Some(used);
        }
        let a = d.get("a").await;
        let b = d.get("b").await;
        let asleep = |i: &pb::Instance| {
            i.state == pb::State::Sleeping as i32 && i.message.starts_with("SLEEPING")
        };
        let ended = |i: &pb::Instance| i.state == pb::State::Exited as i32;
        let one = (asleep(&a) && ended(&b)) || (asleep(&b) && ended(&a));
        one.then_some((a, b))
    })
    .await;
    assert_eq!(seen_over, None, "the host pool passed its budget");
    let (a, b) = settled.expect("one asleep, the other stopped");
    let stopped = if a.state == pb::State::Exited as i32 {
        a
    } else {
        b
    };
    assert_eq!(stopped.cause, pb::Cause::Idle as i32, "{stopped:?}");
    assert!(
        stopped.message.contains("does not fit") && stopped.message.contains("ram"),
        "{}",
        stopped.message
    );
    assert_eq!(pool_of(&mut d, "ram").await.0, 3 * GB);
    within_budgets(&mut d, "settled").await;
}

/// A model asleep, and another held on the GPU its wake needs: the
/// router's request waits (the wake's refusal is temporary, as a start's
/// is) and is served by the woken model once the hold ends. Before, a
/// wake was never refused as temporary, and the router answered 503 at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wake_kept_out_by_a_hold_is_queued_by_the_router_and_served_when_it_ends() {
    let config = String::from("on_full = \"evict\"\n\n")
        + &pool("gpu", "4GB")
        + &pool("ram", "8GB")
        + &level_one("big", None)
        + &sleeper("other", "gpu", 3, "");
    let mut d = Daemon::start(&config).await;
    let awake = d.ready("big", "big").await;
    let asleep = sleep(&mut d, "big").await.expect("asleep");
    assert_eq!(asleep.state, pb::State::Sleeping as i32);
    d.ready("other", "o").await;
    let hold = pb::TouchRequest {
        instance_id: "o".into(),
        hold_ms: 1_500,
        release_hold: false,
    };
    d.client.touch(hold).await.expect("held");
    let r = serve_router(
        &d.socket.display().to_string(),
        None,
        Duration::from_secs(30),
        None,
    )
    .await;
    let chat = r#"{"model": "big", "messages": [{"role": "user", "content": "hi"}]}"#;
    let began = std::time::Instant::now();
    let (status, _, body) = raw(r.port, &post("/v1/chat/completions", chat)).await;
    assert_eq!(
        status, 200,
        "queued until the hold ended, then woken: {body}"
    );
    assert!(
        began.elapsed() >= Duration::from_millis(500),
        "served before the hold could have ended: {:?}",
        began.elapsed()
    );
    let big = d.get("big").await;
    assert_eq!(
        (big.state, big.pid),
        (pb::State::Ready as i32, awake.pid),
        "{big:?}"
    );
    let other = d.get("o").await;
    assert_eq!(other.cause, pb::Cause::Evicted as i32, "{other:?}");
    // While it waited the router asked again with dry runs (Place), not a
    // Start every 250 ms: one refusal in the agent's log and metrics.
    let log = d.log();
    assert_eq!(
        log.matches("start refused").count(),
        1,
        "one refused Start while the hold lasted: {log}"
    );
}

/// An upgrade whose next agent is slow to start (a wrapper holds it 4 s
/// before it runs), while a model's sleep idle (2 s) runs out: the agent
/// handing over makes no move after its last journal write, so the next
/// agent finds the model as it really is (awake, as journaled), and puts
/// it to sleep itself once idle. Before, the old agent's tick put it to
/// sleep after that write, and the next agent took the sleeping server
/// over as READY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_while_a_models_idle_time_runs_out_leaves_it_as_journaled() {
    let bin = tempfile::tempdir().expect("tempdir");
    let program = bin.path().join("residentd");
    std::fs::copy(RESIDENTD, &program).expect("copy residentd");
    let dir = tempfile::tempdir().expect("tempdir");
    let config = pool("gpu", "8GB") + &pool("ram", "8GB") + &level_one("m", Some("2s"));
    write_config(dir.path(), &config);
    let mut d = Daemon::start_program(&program, dir, |_| {}).await;
    let m = d.ready("m", "m").await;
    journaled_running(&d, &["m"]).await;
    let old_pid = agent_pid(&d.socket).await;
    // The checks run at once; the next agent itself starts 4 s late.
    let script = format!(
        "#!/bin/sh\ncase \"$1\" in --version|--check-config) exec {real} \"$@\";; esac\nsleep 4\nexec {real} \"$@\"\n",
        real = RESIDENTD
    );
    replace_file(&program, script.as_bytes());
    // Used now: its idle time runs out about 2 s into the hand-over.
    let touch = pb::TouchRequest {
        instance_id: "m".into(),
        hold_ms: 0,
        release_hold: false,
    };
    d.client.touch(touch).await.expect("touched");
    let socket = d.socket.clone();
    let o = tokio::task::spawn_blocking(move || residentctl(&socket, &["upgrade"]))
        .await
        .expect("joined");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let new_pid = agent_pid(&d.socket).await;
    let _new = Upgraded(new_pid);
    assert_ne!(new_pid, old_pid);
    d.client = connect(&d.socket).await;
    // The server as it is, read before and after the agent's view: the
    // new agent's own idle sleep (2 s after it took over) may come between.
    let said = |body: String| body.contains("true");
    let server_before = said(get(m.port, "/is_sleeping").await);
    let view = d.get("m").await;
    let server_after = said(get(m.port, "/is_sleeping").await);
    let agent_asleep = view.state == pb::State::Sleeping as i32;
    assert!(
        !(server_before && server_after && !agent_asleep),
        "the next agent shows {:?} ({}) over a sleeping server",
        view.state,
        view.message
    );
    assert!(
        !server_before,
        "the model fell asleep during the hand-over, after the last journal write"
    );
    // Its idle time then runs out under the new agent, which puts it to
    // sleep itself: the same process.
    let asleep = d.asleep("m").await;
    assert_eq!(asleep.pid, m.pid);
    assert!(said(get(m.port, "/is_sleeping").await));
}

/// The body of `GET path` on loopback `port`.
async fn get(port: u32, path: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port as u16))
        .await
        .unwrap_or_else(|e| panic!("connect to {port} for {path}: {e}"));
    let ask = format!("GET {path} HTTP/1.0\r\nHost: x\r\n\r\n");
    s.write_all(ask.as_bytes()).await.expect("ask");
    let mut answer = String::new();
    let read = tokio::time::timeout(PATIENCE, s.read_to_string(&mut answer));
    read.await.expect("answered in time").expect("read");
    answer
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_string()
}
