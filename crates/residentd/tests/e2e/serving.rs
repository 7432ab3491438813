//! The router's queue under traffic (issue #44): a loaded model's requests
//! are served before a swap to another model is started, within
//! `swap_after` (no A-B-A thrash), and queue behind the swap after it (no
//! starvation); a load that every waiting request abandoned is stopped; a
//! streamed request that waits for a load gets SSE comment lines
//! meanwhile. Against tests/router/slow_server.py, a stand-in that
//! streams one chunk every 50 ms (and loads slowly with `--slow-load`).

use std::time::{Duration, Instant};

use resident_api::pb;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::router::post;
use crate::support::*;

/// The slow stand-in as workload `name` of pool `fake`, holding 6 of its
/// 10 GB (two never fit together), with `flags`.
fn slow(name: &str, python: &std::path::Path, flags: &str) -> String {
    let flags: String = flags
        .split_whitespace()
        .map(|f| format!(", \"{f}\""))
        .collect();
    format!(
        "[[workload]]\nname = \"{name}\"\ncommand = [\"{py}\", \"{script}\", \"${{PORT}}\"{flags}]\nstop_grace = \"2s\"\n[workload.memory.fake]\nweights = \"6GB\"\n[workload.readiness]\nhttp = \"/v1/models\"\ntimeout = \"30s\"\n[workload.restart]\npolicy = \"never\"\n",
        py = python.display(),
        script = workspace().join("tests/router/slow_server.py").display(),
    )
}

fn node(workloads: &str) -> String {
    String::from("on_full = \"evict\"\n\n[[pool]]\nname = \"fake\"\nbudget = \"10GB\"\n\n")
        + workloads
}

fn chat(model: &str, stream: bool, tokens: u32) -> Vec<u8> {
    post(
        "/v1/chat/completions",
        &format!(
            r#"{{"model": "{model}", "stream": {stream}, "max_tokens": {tokens}, "messages": [{{"role": "user", "content": "hi"}}]}}"#
        ),
    )
}

/// Sends `request` and reads until `seen` says enough (bounded by the
/// patience): the connection and what came.
async fn send_until(
    port: u16,
    request: &[u8],
    enough: impl Fn(&str) -> bool,
) -> (TcpStream, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    s.write_all(request).await.expect("send");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let read = tokio::time::timeout(PATIENCE, async {
        while !enough(&String::from_utf8_lossy(&seen)) {
            let n = s.read(&mut buf).await.expect("read");
            if n == 0 {
                break;
            }
            seen.extend_from_slice(&buf[..n]);
        }
    });
    read.await.expect("within the patience");
    (s, String::from_utf8_lossy(&seen).into_owned())
}

/// A held and B waiting for its memory: within `swap_after` a new
/// request for A is served at once (A is loaded: no swap back and forth);
/// after it, a new request for A queues behind B's swap, and is answered
/// after B. Before, the second request for A queued behind B at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_loaded_models_requests_go_before_a_swap_within_its_bound() {
    let Some(python) = venv_python("the router test's stand-in") else {
        return;
    };
    let mut d = Daemon::start(&node(&(slow("a", &python, "") + &slow("b", &python, "")))).await;
    let swap_after = Duration::from_secs(3);
    let r = serve_router_with(&d.socket.display().to_string(), |o| {
        o.swap_after = swap_after;
        o.queue_timeout = Duration::from_secs(60);
    })
    .await;
    let has_chunk = |s: &str| s.contains("data: ");
    // A streams on (its hold renewed), while B waits for its memory.
    let (first_a, _) = send_until(r.port, &chat("a", true, 2000), has_chunk).await;
    let port = r.port;
    let waited_from = Instant::now();
    let b = tokio::spawn(async move {
        let (_, said) = send_until(port, &chat("b", false, 2), |s| {
            s.contains("chat.completion")
        })
        .await;
        (Instant::now(), said)
    });
    let waiting = eventually(async || {
        let i = d.get("a").await;
        i.state == pb::State::Ready as i32
            && !b.is_finished()
            && waited_from.elapsed() > Duration::from_millis(300)
    });
    assert!(waiting.await);
    // Within the bound: a second request for A is served at once.
    let began = Instant::now();
    let (second_a, _) = send_until(r.port, &chat("a", true, 2000), has_chunk).await;
    assert!(
        began.elapsed() < swap_after,
        "a loaded model's request went before the swap: {:?}",
        began.elapsed()
    );
    assert!(!b.is_finished(), "B waits while A is in use");
    // Past the bound: a new request for A queues behind B's swap.
    tokio::time::sleep_until((waited_from + swap_after + Duration::from_millis(200)).into()).await;
    let late = tokio::spawn(async move {
        let (_, said) = send_until(port, &chat("a", false, 2), |s| {
            s.contains("chat.completion")
        })
        .await;
        (Instant::now(), said)
    });
    // A's streams end: B is started (A evicted), then the late A request.
    drop((first_a, second_a));
    let (b_at, b_said) = b.await.expect("joined");
    let (late_at, late_said) = late.await.expect("joined");
    assert!(b_said.starts_with("HTTP/1.1 200"), "{b_said}");
    assert!(late_said.starts_with("HTTP/1.1 200"), "{late_said}");
    assert!(
        late_at >= b_at,
        "the late request for A came after B's swap"
    );
}

/// Two resident models, A streaming for about 3 s, then a short request
/// for B. Without a limit (the control), B is answered while A still
/// streams; with `--max-busy 1` it waits its turn and is answered after
/// A's stream ends. Before, the flag did not exist and two servers on the
/// same cores computed at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_busy_forwards_one_request_at_a_time_across_models() {
    let Some(python) = venv_python("the router test's stand-in") else {
        return;
    };
    let config = String::from("[[pool]]\nname = \"fake\"\nbudget = \"20GB\"\n\n")
        + &slow("a", &python, "")
        + &slow("b", &python, "");
    let mut d = Daemon::start(&config).await;
    for name in ["a", "b"] {
        d.started(name, name).await;
        d.wait_state(name, pb::State::Ready).await;
    }
    let done = |s: &str| s.contains("[DONE]");
    for max_busy in [0, 1] {
        let r = serve_router_with(&d.socket.display().to_string(), |o| {
            o.max_busy = max_busy;
            o.queue_timeout = Duration::from_secs(60);
        })
        .await;
        let port = r.port;
        // A streams 60 chunks, one every 50 ms; B is asked once A's first
        // chunk is out.
        let (mut a, first) = send_until(port, &chat("a", true, 60), |s| s.contains("data: ")).await;
        assert!(first.starts_with("HTTP/1.1 200"), "{first}");
        let b = tokio::spawn(async move {
            let (_, said) = send_until(port, &chat("b", false, 2), |s| {
                s.contains("chat.completion")
            })
            .await;
            (Instant::now(), said)
        });
        let mut rest = first;
        let mut buf = [0u8; 4096];
        let read = tokio::time::timeout(PATIENCE, async {
            while !done(&rest) {
                let n = a.read(&mut buf).await.expect("read");
                assert!(n > 0, "A's stream ended early: {rest}");
                rest.push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        read.await.expect("A's stream ends within the patience");
        let a_ended = Instant::now();
        let (b_at, said) = b.await.expect("joined");
        assert!(said.starts_with("HTTP/1.1 200"), "{said}");
        if max_busy == 0 {
            assert!(
                b_at < a_ended,
                "without a limit, B is answered while A streams"
            );
        } else {
            assert!(
                b_at >= a_ended,
                "with --max-busy 1, B waits for A's stream to end"
            );
        }
    }
}

/// A request for a model that loads for 4 s goes away after half a
/// second: nobody waits for the load any more, so it is stopped while it
/// still loads, and its memory given back. Before, it loaded on and stayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_every_waiting_request_abandoned_is_stopped() {
    let Some(python) = venv_python("the router test's stand-in") else {
        return;
    };
    let mut d = Daemon::start(&node(&slow("big", &python, "--slow-load 4"))).await;
    let r = serve_router(
        &d.socket.display().to_string(),
        None,
        Duration::from_secs(60),
        None,
    )
    .await;
    let mut s = TcpStream::connect(("127.0.0.1", r.port))
        .await
        .expect("connect");
    s.write_all(&chat("big", false, 2)).await.expect("send");
    let loading = eventually(async || {
        d.ids().await.contains(&"big".to_string())
            && d.get("big").await.state == pb::State::Starting as i32
    });
    assert!(loading.await, "the load began");
    drop(s);
    let ended = until(async || {
        let i = d.get("big").await;
        let over = i.state == pb::State::Exited as i32 || i.state == pb::State::Failed as i32;
        (over || i.state == pb::State::Ready as i32).then_some(i)
    })
    .await
    .expect("the load settled");
    assert_ne!(
        ended.state,
        pb::State::Ready as i32,
        "loaded for nobody: {ended:?}"
    );
    assert_eq!(ended.cause, pb::Cause::Stopped as i32, "{ended:?}");
    let node = d.node().await;
    assert_eq!(node.pools[0].used_bytes, 0, "its memory given back");
}

/// A streamed request for a model that loads for 3 s is answered at once
/// with an event stream whose comment lines say it waits, then the
/// model's chunks. Before, nothing came until the model was READY.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_request_waiting_for_a_load_hears_that_it_waits() {
    let Some(python) = venv_python("the router test's stand-in") else {
        return;
    };
    let d = Daemon::start(&node(&slow("big", &python, "--slow-load 3"))).await;
    let r = serve_router(
        &d.socket.display().to_string(),
        None,
        Duration::from_secs(60),
        None,
    )
    .await;
    let began = Instant::now();
    let (s, head) = send_until(r.port, &chat("big", true, 4), |s| {
        s.contains(": waiting for")
    })
    .await;
    let waited = began.elapsed();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.to_lowercase().contains("text/event-stream"), "{head}");
    assert!(
        waited < Duration::from_secs(2),
        "told it waits before the model is READY: {waited:?}"
    );
    drop(s);
    // Heard again by a request that stays, then the model's own events.
    let (_, all) = send_until(r.port, &chat("big", true, 4), |s| {
        s.contains("data: [DONE]")
    })
    .await;
    assert!(all.contains("t0 ") && all.contains("data: [DONE]"), "{all}");
    drop(d);
}

/// The small version of the serve benchmark's trace (tests/serve/serve.py
/// --small: 6 conversations, 14 requests over 4 real llama-servers whose
/// memory holds two) against residentd + residentd-router and residentd
/// with one model at a time: what must always hold, not timings. Every
/// request answered by the model it asked for, none failed, and the
/// servers' measured peak within the budget (the script exits non-zero
/// otherwise).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_small_trace_is_served_whole_within_its_budget() {
    let (Some(python), Some(bin)) = (crate::llama::python(), crate::llama::llama_server_bin())
    else {
        return;
    };
    // The router's binary beside the agent's (cargo test --workspace
    // builds both).
    let router = std::path::Path::new(RESIDENTD).with_file_name("residentd-router");
    if !router.exists() {
        let why = "no residentd-router binary beside residentd: run cargo build -p residentd-router (scripts/test builds it)";
        assert!(std::env::var_os("CI").is_none(), "{why}");
        return skip(why);
    }
    let work = tempfile::tempdir().expect("tempdir");
    let json = work.path().join("serve.json");
    let out = tokio::process::Command::new(&python)
        .arg(workspace().join("tests/serve/serve.py"))
        .arg("--llama-bin")
        .arg(&bin)
        .args(["--residentd", RESIDENTD])
        .arg("--router")
        .arg(&router)
        .arg("--work")
        .arg(work.path())
        .args(["--small", "--systems", "a,c", "--json"])
        .arg(&json)
        .output()
        .await
        .expect("run serve.py");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{said}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("the figures")).expect("json");
    let results = v["results"].as_array().expect("results");
    assert_eq!(results.len(), 2, "{said}");
    for r in results {
        let system = r["system"].as_str().unwrap_or_default();
        assert_eq!(
            r["requests"], v["requests"],
            "{system}: every request replayed"
        );
        assert_eq!(r["failed"], 0, "{system}: {said}");
        let (peak, budget) = (r["peak_rss"].as_u64(), r["budget"].as_u64());
        assert!(
            peak.is_some_and(|p| p > 0) && peak <= budget,
            "{system}: measured {peak:?} of {budget:?}: {said}"
        );
    }
}
