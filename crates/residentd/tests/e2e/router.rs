//! residentd-router in front of the real agent, called as applications
//! call it: the `openai` client from PyPI (tests/router/client.py) and raw
//! HTTP for what a client library would never send. The router is its
//! library (`residentd_router::App`) served in the test process; the agent
//! is the real binary, and the models are real servers: llama-cpp-python on
//! GGUF models the test writes, and tests/router/slow_server.py where a
//! request must stay in flight as long as the test says. One router
//! reaches its agent over TCP with mutual TLS (the agent of `tls.rs`).

use std::path::Path;
use std::time::Duration;

use resident_api::pb;
use residentd_router::AgentTls;
use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::llama::{declared, llama_server_bin, make_model, python, workload};
use crate::support::*;
use crate::tls::{ca, connect_tls, leaf, tls_agent_serving};

/// A router served in this process until dropped.
async fn router(socket: &Path, queue_timeout: Duration) -> Router {
    router_to(&socket.display().to_string(), None, queue_timeout).await
}

/// A router of the agent at `agent` (a socket, `http://` or `https://`
/// with `tls`).
async fn router_to(agent: &str, tls: Option<AgentTls>, queue_timeout: Duration) -> Router {
    serve_router(agent, tls, queue_timeout, None).await
}

/// Runs tests/router/client.py with `args`; its JSON answer.
async fn client(python: &Path, args: &[&str]) -> Value {
    let script = workspace().join("tests/router/client.py");
    let out = tokio::process::Command::new(python)
        .arg(script)
        .args(args)
        .output()
        .await
        .expect("run client.py");
    assert!(
        out.status.success(),
        "client.py {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "client.py {args:?} printed no JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// Sends `request` as is and reads the whole answer (the request should
/// say `Connection: close`): status and body.
pub(crate) async fn raw(port: u16, request: &[u8]) -> (u16, String, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    s.write_all(request).await.expect("send");
    let mut answer = Vec::new();
    tokio::time::timeout(PATIENCE, s.read_to_end(&mut answer))
        .await
        .expect("the router answers within the patience")
        .expect("read");
    let text = String::from_utf8_lossy(&answer).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, head.to_string(), body.to_string())
}

pub(crate) fn post(path: &str, body: &str) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .into_bytes()
}

/// The OpenAI error of a body: (type, code).
fn error_of(body: &str) -> (String, String) {
    let v: Value = serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("{e}: {body}"));
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    (
        e["type"].as_str().unwrap_or_default().to_string(),
        e["code"].as_str().unwrap_or_default().to_string(),
    )
}

fn state(d: &[pb::Instance], id: &str) -> Option<pb::State> {
    d.iter()
        .find(|i| i.instance_id == id)
        .and_then(|i| pb::State::try_from(i.state).ok())
}

/// Each instance's id, state and pid.
async fn runs(d: &mut Daemon) -> Vec<(String, i32, u32)> {
    let list = d.list().await;
    list.into_iter()
        .map(|i| (i.instance_id, i.state, i.pid))
        .collect()
}

fn ok(v: &Value, what: &str) {
    assert_eq!(v["ok"], true, "{what}: {v}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn openai_clients_start_swap_and_share_real_llama_servers() {
    let Some(python) = python() else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let (a, b) = (dir.path().join("a.gguf"), dir.path().join("b.gguf"));
    make_model(&python, &a, 128, 2);
    make_model(&python, &b, 128, 2);
    // Room for one of them, never both.
    let budget = declared(&a).max(declared(&b)) * 3 / 2;
    let mut config =
        format!("on_full = \"evict\"\n\n[[pool]]\nname = \"ram\"\nbudget = {budget}\n\n");
    // llama-cpp-python cuts a stream short when another request waits,
    // unless told not to (docs/router.md).
    let whole = |text: String| {
        text.replacen(
            r#""--use_mmap", "false"]"#,
            r#""--use_mmap", "false", "--interrupt_requests", "false"]"#,
            1,
        )
    };
    config += &whole(workload("a", &python, &a, "policy = \"never\"")).replacen(
        "name = \"a\"\n",
        "name = \"a\"\naliases = [\"alpha\"]\n",
        1,
    );
    config += &whole(workload("b", &python, &b, "policy = \"never\""));
    assert!(config.contains("interrupt_requests"), "{config}");
    // Larger than the pool: never placeable.
    config += &sleeper("huge", "ram", 1, "");
    write_config(dir.path(), &config);
    let mut d = Daemon::start_in(dir).await;
    let r = router(&d.socket, Duration::from_secs(120)).await;
    let base = r.base.as_str();

    // The roster, with states, before anything runs.
    let listed = client(&python, &["models", base]).await;
    let ids: Vec<&str> = listed["models"]
        .as_array()
        .expect("models")
        .iter()
        .filter_map(|m| m["id"].as_str())
        .collect();
    assert_eq!(ids, ["a", "alpha", "b", "huge"], "{listed}");
    assert_eq!(listed["models"][0]["state"], "STOPPED", "{listed}");

    // A, by its alias, started on demand; then streamed.
    let first = client(&python, &["chat", base, "alpha"]).await;
    ok(&first, "chat a");
    let streamed = client(
        &python,
        &["chat", base, "a", "--stream", "--max-tokens", "16"],
    )
    .await;
    ok(&streamed, "streamed chat a");
    assert!(streamed["chunks"].as_u64() > Some(1), "{streamed}");
    assert!(streamed["finish_reason"].is_string(), "{streamed}");
    assert_eq!(state(&d.list().await, "a"), Some(pb::State::Ready));

    // B: A is evicted to make room. Then A again: B goes.
    ok(&client(&python, &["chat", base, "b"]).await, "chat b");
    let now = d.list().await;
    assert_eq!(state(&now, "b"), Some(pb::State::Ready));
    assert_ne!(state(&now, "a"), Some(pb::State::Ready), "a was evicted");
    ok(&client(&python, &["chat", base, "a"]).await, "chat a again");
    assert_ne!(state(&d.list().await, "b"), Some(pb::State::Ready));
    let listed = client(&python, &["models", base]).await;
    assert_eq!(listed["models"][0]["state"], "READY", "{listed}");

    // 8 streams of A in flight when B is asked for: every stream ends
    // whole, and B waits for them, then swaps.
    let storm = client(&python, &["storm", base, "a", "b", "--n", "8"]).await;
    assert_eq!(storm["held_when_b_was_sent"], 8, "{storm}");
    let streams = storm["streams"].as_array().expect("streams");
    for s in streams {
        ok(s, "a stream of the storm");
        assert!(s["finish_reason"].is_string(), "cut short: {s}");
    }
    ok(&storm["b"], "b after the storm");
    let last_stream_end = streams
        .iter()
        .filter_map(|s| s["ended"].as_f64())
        .fold(0.0, f64::max);
    assert!(
        storm["b"]["ended"].as_f64() > Some(last_stream_end),
        "b was answered before every stream of a had ended: {storm}"
    );
    let now = d.list().await;
    assert_eq!(state(&now, "b"), Some(pb::State::Ready));
    assert_ne!(state(&now, "a"), Some(pb::State::Ready));

    // A client that hangs up mid-stream frees its hold: A swaps in.
    ok(
        &client(&python, &["disconnect", base, "b"]).await,
        "disconnect",
    );
    ok(
        &client(&python, &["chat", base, "a"]).await,
        "a after a hang-up",
    );

    // Never placeable: 503 with the agent's reason; unknown: 404.
    let huge = client(&python, &["chat", base, "huge"]).await;
    assert_eq!(huge["status"], 503, "{huge}");
    assert_eq!(huge["body"]["type"], "unplaceable", "{huge}");
    assert_eq!(huge["body"]["code"], "OVER_BUDGET", "{huge}");
    assert!(
        huge["body"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("huge") || m.contains("ram")),
        "{huge}"
    );
    let unknown = client(&python, &["chat", base, "nope"]).await;
    assert_eq!(unknown["status"], 404, "{unknown}");
    assert_eq!(unknown["body"]["type"], "model_not_found", "{unknown}");
    // Nothing was started for either.
    let ids = d.ids().await;
    assert!(!ids.contains(&"huge".to_string()), "{ids:?}");
}

/// The slow server as a workload of pool `fake`, holding 6 of its 10 GB.
fn slow(name: &str, python: &Path, extra: &str) -> String {
    format!(
        "[[workload]]\nname = \"{name}\"\ncommand = [\"{py}\", \"{script}\", \"${{PORT}}\"]\nstop_grace = \"2s\"\n{extra}\n[workload.memory.fake]\nweights = \"6GB\"\n[workload.readiness]\nhttp = \"/v1/models\"\ntimeout = \"30s\"\n[workload.restart]\npolicy = \"never\"\n",
        py = python.display(),
        script = workspace().join("tests/router/slow_server.py").display(),
    )
}

/// Opens a streamed chat completion of `model` through the router and
/// returns the connection once the first chunk has arrived.
async fn open_stream(port: u16, model: &str) -> TcpStream {
    open_stream_of(port, model, 2000).await
}

/// As [`open_stream`], for a stream of `chunks` chunks (one every 50 ms).
async fn open_stream_of(port: u16, model: &str, chunks: u32) -> TcpStream {
    let body = format!(
        r#"{{"model": "{model}", "stream": true, "max_tokens": {chunks}, "messages": [{{"role": "user", "content": "hi"}}]}}"#
    );
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    s.write_all(&post("/v1/chat/completions", &body))
        .await
        .expect("send");
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let first = tokio::time::timeout(PATIENCE, async {
        while !String::from_utf8_lossy(&seen).contains("data: ") {
            let n = s.read(&mut buf).await.expect("read");
            assert!(
                n > 0,
                "closed before a chunk: {}",
                String::from_utf8_lossy(&seen)
            );
            seen.extend_from_slice(&buf[..n]);
        }
    });
    first.await.expect("a first chunk within the patience");
    let head = String::from_utf8_lossy(&seen).to_string();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(head.to_lowercase().contains("text/event-stream"), "{head}");
    s
}

async fn place_temporary(d: &mut Daemon, workload: &str) -> Option<bool> {
    let p = d
        .client
        .place(pb::PlaceRequest {
            workload: workload.into(),
            on_full: pb::Policy::Evict as i32,
            ..Default::default()
        })
        .await
        .expect("place")
        .into_inner();
    if p.admitted {
        return None;
    }
    Some(p.refusals.iter().all(|r| r.temporary))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn holds_limits_queue_timeouts_and_bad_input_are_answered_openai_style() {
    let Some(python) = venv_python("the router test's OpenAI client") else {
        return;
    };
    let mut config =
        String::from("on_full = \"evict\"\n\n[[pool]]\nname = \"fake\"\nbudget = \"10GB\"\n\n");
    config += &slow("slow", &python, "concurrency_limit = 1");
    config += &slow("other", &python, "");
    // In a pool of its own: never in the way of the other two.
    config += &pool("aside", "10GB");
    config += &slow("side", &python, "").replace("memory.fake", "memory.aside");
    let mut d = Daemon::start(&config).await;
    // A short queue timeout, to see it run out.
    let r = router(&d.socket, Duration::from_secs(2)).await;
    let base = r.base.clone();
    ok(
        &client(&python, &["chat", &base, "side"]).await,
        "side, started",
    );

    // One stream of `slow` in flight holds it.
    let held = open_stream(r.port, "slow").await;
    assert_eq!(
        place_temporary(&mut d, "other").await,
        Some(true),
        "the stream's hold makes a start of other wait, not fail"
    );
    // Its concurrency limit is 1: a second request gets 429.
    let second = client(&python, &["chat", &base, "slow"]).await;
    assert_eq!(second["status"], 429, "{second}");
    assert_eq!(second["body"]["type"], "too_many_requests", "{second}");
    assert!(second["retry_after"].is_string(), "{second}");
    // `other` needs slow's memory, held: it waits 2 s, then 503 + Retry-After.
    // Meanwhile a request for `side`, resident and in nobody's way, is
    // served at once, not queued behind the waiting start.
    let waiting = {
        let (python, base) = (python.clone(), base.clone());
        tokio::spawn(async move { client(&python, &["chat", &base, "other"]).await })
    };
    let metric = |body: &str| body.contains("residentd_router_starts_waiting 1");
    let get_metrics =
        "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".as_bytes();
    assert!(
        eventually(async || metric(&raw(r.port, get_metrics).await.2)).await,
        "the start of other never waited"
    );
    let chat_side = post(
        "/v1/chat/completions",
        r#"{"model": "side", "messages": [{"role": "user", "content": "hi"}]}"#,
    );
    let (status, _, body) = raw(r.port, &chat_side).await;
    assert_eq!(status, 200, "side while other waits: {body}");
    assert!(
        metric(&raw(r.port, get_metrics).await.2),
        "side was answered only after other stopped waiting"
    );
    let waited = waiting.await.expect("join");
    assert_eq!(waited["status"], 503, "{waited}");
    assert_eq!(waited["body"]["type"], "queue_timeout", "{waited}");
    assert!(waited["retry_after"].is_string(), "{waited}");
    let slow_pid = d.get("slow").await.pid;
    assert!(alive(slow_pid as i32), "waiting evicted nothing");

    // Hanging up ends the upstream request and the hold: other swaps in.
    drop(held);
    let cancelled = eventually(async || {
        let lines = d
            .client
            .logs(pb::LogsRequest {
                instance_id: "slow".into(),
                tail: 50,
                ..Default::default()
            })
            .await;
        let Ok(lines) = lines else { return false };
        let mut lines = lines.into_inner();
        let mut text = String::new();
        while let Some(Ok(l)) = tokio_stream::StreamExt::next(&mut lines).await {
            text += &l.line;
        }
        text.contains("client went away")
    });
    assert!(cancelled.await, "the upstream request was not cancelled");
    assert_eq!(
        place_temporary(&mut d, "other").await,
        None,
        "the hold ended with the request"
    );
    ok(&client(&python, &["chat", &base, "other"]).await, "other");
    assert!(!alive(slow_pid as i32), "slow was evicted for other");
    // A model that stopped, or whose server died, is started again by the
    // next request.
    d.stopped("other").await;
    ok(
        &client(&python, &["chat", &base, "other"]).await,
        "other after a stop",
    );
    let pid = d.get("other").await.pid;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill the model's server");
    d.wait_state("other", pb::State::Failed).await;
    ok(
        &client(&python, &["chat", &base, "other"]).await,
        "other after a crash",
    );
    assert_ne!(d.get("other").await.pid, pid, "a new server");
    let before = runs(&mut d).await;

    // Bad input: a clear OpenAI error, nothing disturbed.
    let port = r.port;
    let (status, _, body) = raw(port, &post("/v1/chat/completions", "{\"model\": ")).await;
    assert_eq!(
        (status, error_of(&body).1.as_str()),
        (400, "invalid_json"),
        "{body}"
    );
    let (status, _, body) = raw(port, &post("/v1/chat/completions", "{\"messages\": []}")).await;
    assert_eq!(
        (status, error_of(&body).1.as_str()),
        (400, "missing_model"),
        "{body}"
    );
    // 16 MiB, more than the loopback's socket buffers hold: the client is
    // still writing when the router decides, and reads the 413 only if
    // the router takes what it sends (a reset broke the write before).
    let huge = format!(
        "{{\"model\": \"other\", \"pad\": \"{}\"}}",
        "x".repeat(16 << 20)
    );
    let (status, _, body) = raw(port, &post("/v1/chat/completions", &huge)).await;
    assert_eq!(
        error_of(&body),
        ("request_too_large".into(), "request_too_large".into())
    );
    assert_eq!(status, 413);
    // A client that sends 10 of its 100 bytes and stalls: 408 after 2 s.
    let stalled = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 100\r\nConnection: close\r\n\r\n{\"model\":";
    let (status, _, body) = raw(port, stalled).await;
    assert_eq!(
        (status, error_of(&body).1.as_str()),
        (408, "request_timeout"),
        "{body}"
    );
    let (status, _, body) = raw(port, &post("/v2/nothing", "{}")).await;
    assert_eq!(
        (status, error_of(&body).1.as_str()),
        (404, "unknown_endpoint"),
        "{body}"
    );
    let (status, _, body) = raw(
        port,
        &post(
            "/v1/embeddings",
            &format!("{{\"model\": \"{}\"}}", "m".repeat(5000)),
        ),
    )
    .await;
    assert_eq!(status, 404, "{body}");
    assert!(body.len() < 400, "the error quotes a short excerpt: {body}");
    assert_eq!(runs(&mut d).await, before, "bad input changed nothing");

    // The passthrough, health and metrics.
    let get = |path: &str| {
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").into_bytes()
    };
    let (status, _, body) = raw(port, &get("/upstream/other/v1/models")).await;
    assert_eq!(status, 200, "{body}");
    assert!(
        body.contains("\"slow\""),
        "the model server's own answer: {body}"
    );
    // The server's root, with and without the trailing slash: not among
    // the paths forwarded by default (a server's own web page), forwarded
    // by a router told to pass every path.
    let everything = serve_router_with(&d.socket.display().to_string(), |o| {
        o.upstream_allow = vec!["/".into()];
    })
    .await;
    for root in ["/upstream/other", "/upstream/other/"] {
        let (status, _, body) = raw(port, &get(root)).await;
        assert_eq!(status, 403, "{root}: {body}");
        assert_eq!(error_of(&body).1, "upstream_path_not_allowed", "{root}");
        let (status, _, body) = raw(everything.port, &get(root)).await;
        assert_eq!(status, 200, "{root}: {body}");
        assert!(body.contains("\"root\": \"slow\""), "{root}: {body}");
    }
    drop(everything);
    let (status, _, _) = raw(port, &get("/health")).await;
    assert_eq!(status, 200);
    let (status, _, body) = raw(port, &get("/metrics")).await;
    assert_eq!(status, 200);
    for needle in [
        "residentd_router_requests_total{model=\"slow\",status=\"429\"} 1",
        "residentd_router_queue_timeouts_total{model=\"other\"} 1",
        "residentd_router_in_flight{model=\"slow\"} 0",
    ] {
        assert!(body.contains(needle), "{needle} not in\n{body}");
    }
    drop(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_instance_started_under_another_id_is_served_not_started_again() {
    let Some(python) = venv_python("the router test's model server") else {
        return;
    };
    let mut config = String::from("[[pool]]\nname = \"fake\"\nbudget = \"10GB\"\n\n");
    // Its 6 GB fit once, not twice: a second instance would be refused.
    config += &slow("demo", &python, "");
    let mut d = Daemon::start(&config).await;
    // Started as an operator or an orchestrator would, under its own id.
    let mut req = start_req("demo", "mine");
    req.wait_ready = true;
    d.client.start(req).await.expect("started under its own id");
    let r = router(&d.socket, Duration::from_secs(5)).await;
    let get = |path: &str| {
        format!("GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n").into_bytes()
    };
    let (status, _, body) = raw(r.port, &get("/v1/models")).await;
    assert_eq!(status, 200, "{body}");
    let listed: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(listed["data"][0]["id"], "demo");
    assert_eq!(listed["data"][0]["state"], "READY", "{body}");
    // A request for the workload reaches the running instance.
    let (status, _, body) = raw(r.port, &get("/upstream/demo/v1/models")).await;
    assert_eq!(status, 200, "{body}");
    ok(
        &client(&python, &["chat", &r.base, "demo"]).await,
        "demo, through mine",
    );
    assert_eq!(d.ids().await, ["mine"], "nothing started beside it");
    // Once it is gone, the router starts its own, under the workload's
    // name.
    d.stopped("mine").await;
    ok(
        &client(&python, &["chat", &r.base, "demo"]).await,
        "demo, started by the router",
    );
    let running: Vec<String> = d
        .list()
        .await
        .into_iter()
        .filter(|i| i.state == pb::State::Ready as i32)
        .map(|i| i.instance_id)
        .collect();
    assert_eq!(running, ["demo"]);
    drop(r);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_and_its_hold_go_on_across_an_upgrade_of_the_agent() {
    let Some(python) = venv_python("the router test's OpenAI client") else {
        return;
    };
    let mut config =
        String::from("on_full = \"evict\"\n\n[[pool]]\nname = \"fake\"\nbudget = \"10GB\"\n\n");
    config += &slow("slow", &python, "");
    config += &slow("other", &python, "");
    let mut d = Daemon::start(&config).await;
    let r = router(&d.socket, Duration::from_secs(2)).await;
    // A stream of 120 chunks (6 s) under way holds `slow`.
    let mut stream = open_stream_of(r.port, "slow", 120).await;
    assert_eq!(place_temporary(&mut d, "other").await, Some(true), "held");
    let old = agent_pid(&d.socket).await;
    let socket = d.socket.clone();
    let o = tokio::task::spawn_blocking(move || residentctl(&socket, &["upgrade"]))
        .await
        .expect("joined");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let new = agent_pid(&d.socket).await;
    let _new = Upgraded(new);
    assert_ne!(new, old, "a new agent serves");
    d.client = connect(&d.socket).await;
    // The new agent has the hold at once (handed over, not waiting for the
    // router's next renewal).
    assert_eq!(
        place_temporary(&mut d, "other").await,
        Some(true),
        "the hold went over with the instance"
    );
    // The stream never noticed.
    let mut rest = Vec::new();
    let read = tokio::time::timeout(PATIENCE, stream.read_to_end(&mut rest)).await;
    read.expect("the stream ends in time").expect("read");
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        rest.contains("data: [DONE]"),
        "the stream ended whole: {rest}"
    );
    // And the router reaches the new agent for what comes next.
    ok(
        &client(&python, &["chat", &r.base, "slow"]).await,
        "slow, after the upgrade",
    );
    assert_eq!(d.ids().await, ["slow"], "served by the instance it had");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_router_serves_through_an_agent_reached_over_mutual_tls() {
    let Some(python) = venv_python("the router test's model server") else {
        return;
    };
    let body = String::from("[[pool]]\nname = \"fake\"\nbudget = \"10GB\"\n\n")
        + &slow("demo", &python, "");
    let a = tls_agent_serving(
        "[node.access]\noperators = [\"cert-dns:router\"]",
        false,
        &body,
    );
    let (cert, key) = leaf(&a.client_ca, &["router"]);
    let (foreign_cert, foreign_key) = leaf(&ca(), &["router"]);
    let mut agent = resident_api::pb::node_agent_client::NodeAgentClient::new(
        connect_tls(&a, &cert, &key).await,
    );
    let tls = |ca: &str, cert: &str, key: &str| AgentTls {
        ca: ca.as_bytes().to_vec(),
        cert: cert.as_bytes().to_vec(),
        key: key.as_bytes().to_vec(),
        name: None,
    };
    let https = format!("https://localhost:{}", a.port);
    let health = "GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";

    // With the router's certificate: the model is started on demand and
    // answers through the router.
    let r = router_to(&https, Some(tls(&a.server_ca, &cert, &key)), PATIENCE).await;
    let (status, _, said) = raw(r.port, health.as_bytes()).await;
    assert_eq!(status, 200, "{said}");
    ok(
        &client(&python, &["chat", &r.base, "demo"]).await,
        "demo, through an mTLS agent",
    );
    let list = agent
        .list(pb::ListRequest {})
        .await
        .expect("list")
        .into_inner()
        .instances;
    assert_eq!(state(&list, "demo"), Some(pb::State::Ready), "{list:?}");
    drop(r);

    // Plaintext to the TLS port, a certificate of another CA, a router
    // that trusts another CA: the agent is unavailable, nothing started.
    let refused = [
        ("plaintext", format!("http://localhost:{}", a.port), None),
        (
            "another CA's certificate",
            https.clone(),
            Some(tls(&a.server_ca, &foreign_cert, &foreign_key)),
        ),
        (
            "trusting another CA",
            https.clone(),
            Some(tls(&a.client_ca.cert.pem(), &cert, &key)),
        ),
    ];
    for (what, agent_at, tls) in refused {
        let r = router_to(&agent_at, tls, PATIENCE).await;
        let (status, _, said) = raw(r.port, health.as_bytes()).await;
        assert_eq!(status, 503, "{what}: {said}");
        assert_eq!(error_of(&said).1, "agent_unavailable", "{what}");
        let (status, _, said) = raw(
            r.port,
            &post(
                "/v1/chat/completions",
                r#"{"model": "demo", "messages": []}"#,
            ),
        )
        .await;
        assert_eq!(status, 503, "{what}: {said}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_router_without_the_operator_role_is_answered_403_with_the_agents_words() {
    // The router's certificate is granted viewer only: it may read the
    // roster, not hold or start a model.
    let body = String::from("[[pool]]\nname = \"ram\"\nbudget = \"10GB\"\n\n")
        + &sleeper("demo", "ram", 1, "");
    let a = tls_agent_serving(
        "[node.access]\nviewers = [\"cert-dns:router\"]",
        false,
        &body,
    );
    let (cert, key) = leaf(&a.client_ca, &["router"]);
    let tls = AgentTls {
        ca: a.server_ca.as_bytes().to_vec(),
        cert: cert.as_bytes().to_vec(),
        key: key.as_bytes().to_vec(),
        name: None,
    };
    // Connected once the agent serves.
    let mut agent = resident_api::pb::node_agent_client::NodeAgentClient::new(
        connect_tls(&a, &cert, &key).await,
    );
    let r = router_to(
        &format!("https://localhost:{}", a.port),
        Some(tls),
        PATIENCE,
    )
    .await;
    let health = "GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    let (status, _, said) = raw(r.port, health.as_bytes()).await;
    assert_eq!(status, 200, "a viewer reaches the agent: {said}");
    let chat = post(
        "/v1/chat/completions",
        r#"{"model": "demo", "messages": []}"#,
    );
    let (status, _, said) = raw(r.port, &chat).await;
    assert_eq!(status, 403, "{said}");
    assert_eq!(
        error_of(&said),
        ("permission_denied".into(), "permission_denied".into())
    );
    assert!(
        said.contains("needs the operator role") && said.contains("cert-dns:router"),
        "the agent's words: {said}"
    );
    let list = agent
        .list(pb::ListRequest {})
        .await
        .expect("a viewer lists")
        .into_inner()
        .instances;
    assert!(list.is_empty(), "nothing started: {list:?}");
}

/// Pools `gpu` and `ram`; workload `big`, the sleep stand-in (20 MB,
/// with `flags`), 3 GB of `gpu` awake and 3 GB of `ram` asleep.
fn sleepy_big(flags: &str) -> String {
    let script = workspace().join("tests/sleep/standin.py");
    let flags: String = flags
        .split_whitespace()
        .map(|f| format!(", \"{f}\""))
        .collect();
    format!(
        "[[pool]]\nname = \"gpu\"\nbudget = \"4GB\"\n\n[[pool]]\nname = \"ram\"\nbudget = \"8GB\"\n\n[[workload]]\nname = \"big\"\ncommand = [\"python3\", \"-u\", \"{}\", \"${{PORT}}\", \"20\"{flags}]\nstop_grace = \"2s\"\n[workload.memory.gpu]\nweights = \"3GB\"\n[workload.readiness]\nhttp = \"/health\"\n[workload.sleep]\nsleep = \"POST /sleep?level=1\"\nwake = \"POST /wake_up\"\n[workload.sleep.memory.ram]\nweights = \"3GB\"\n",
        script.display()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_for_a_sleeping_model_wakes_it_through_the_router() {
    let Some(python) = venv_python("the router test's openai client") else {
        return;
    };
    let mut d = Daemon::start(&sleepy_big("")).await;
    let r = router(&d.socket, Duration::from_secs(20)).await;
    let first = client(&python, &["chat", &r.base, "big"]).await;
    ok(&first, "started on demand");
    let awake = d.wait_state("big", pb::State::Ready).await;
    let slept = d
        .client
        .sleep(pb::SleepRequest {
            instance_id: "big".into(),
        })
        .await
        .expect("asleep")
        .into_inner();
    assert_eq!(slept.state, pb::State::Sleeping as i32);
    let get = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n";
    let (status, _, body) = raw(r.port, get).await;
    assert_eq!(status, 200, "{body}");
    let listed: Value = serde_json::from_str(&body).expect("JSON");
    assert_eq!(listed["data"][0]["state"], "SLEEPING", "{body}");
    // A request wakes it (the same process) and is answered by it awake.
    let woken = client(&python, &["chat", &r.base, "big"]).await;
    ok(&woken, "answered after a wake");
    assert_eq!(woken["text"], "awake", "the server answered awake: {woken}");
    let i = d.get("big").await;
    assert_eq!(
        (i.state, i.pid),
        (pb::State::Ready as i32, awake.pid),
        "{i:?}"
    );
    assert!(i.message.contains("WOKEN"), "{}", i.message);
    assert_eq!(d.ids().await, ["big"], "nothing else started");
    drop(r);
}

/// A request that arrives while its model falls asleep (its sleep call
/// under way: the server has let its weights go) is not sent to the
/// server mid-sleep: the instance shows SLEEPING, and the router's Start
/// waits for the sleep, wakes it and is answered by it awake.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_while_its_model_falls_asleep_waits_for_it_and_wakes_it() {
    let mut d = Daemon::start(&sleepy_big("--slow-sleep")).await;
    let r = router(&d.socket, Duration::from_secs(20)).await;
    let chat = r#"{"model": "big", "messages": [{"role": "user", "content": "hi"}]}"#;
    let (status, _, body) = raw(r.port, &post("/v1/chat/completions", chat)).await;
    assert_eq!(status, 200, "started on demand: {body}");
    let awake = d.wait_state("big", pb::State::Ready).await;
    // The sleep call takes a second to answer, its weights gone at once.
    let mut client = d.client.clone();
    let sleeping = tokio::spawn(async move {
        let req = pb::SleepRequest {
            instance_id: "big".into(),
        };
        client.sleep(req).await.map(|r| r.into_inner())
    });
    let falling = until(async || {
        let i = d.get("big").await;
        i.message.contains("falling asleep").then_some(i)
    })
    .await
    .expect("falling asleep");
    let (status, _, body) = raw(r.port, &post("/v1/chat/completions", chat)).await;
    assert_eq!(
        status, 200,
        "answered, not sent to a server mid-sleep: {body}"
    );
    assert!(body.contains("awake"), "{body}");
    assert_eq!(falling.state, pb::State::Sleeping as i32, "{falling:?}");
    // (Its answer may already show it woken by the request.)
    sleeping.await.expect("joined").expect("the sleep call");
    let i = d.get("big").await;
    assert_eq!(
        (i.state, i.pid),
        (pb::State::Ready as i32, awake.pid),
        "woken, the same process: {i:?}"
    );
    assert!(i.message.contains("WOKEN"), "{}", i.message);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_llama_server_sleeps_by_itself_and_a_request_through_the_router_wakes_it() {
    let (Some(python), Some(bin)) = (python(), llama_server_bin()) else {
        return;
    };
    let dir = tempfile::tempdir().expect("tempdir");
    let model = dir.path().join("small.gguf");
    make_model(&python, &model, 256, 4);
    let config = format!(
        "[[pool]]\nname = \"ram\"\nbudget = \"4GB\"\n\n[[workload]]\nname = \"tiny\"\nflavor = \"llama-server\"\nprogram = \"{}\"\nmodel = \"{}\"\nctx = 512\nparallel = 1\n[workload.sleep]\nidle = \"2s\"\n",
        bin.join("llama-server").display(),
        model.display()
    );
    write_config(dir.path(), &config);
    let mut d = Daemon::start_in(dir).await;
    let mut events = d.watch(0).await;
    let r = router(&d.socket, Duration::from_secs(120)).await;
    let body = r#"{"model": "tiny", "prompt": "hello", "max_tokens": 4}"#;
    let (status, _, answer) = raw(r.port, &post("/v1/completions", body)).await;
    assert_eq!(status, 200, "{answer}");
    let awake = d.get("tiny").await;
    assert_eq!(awake.state, pb::State::Ready as i32);
    // Idle for 2 s, the server sleeps by itself; the agent reads it from
    // /props and holds its asleep demand (its process, 27 MB) instead.
    let asleep = d.asleep("tiny").await;
    assert_eq!(asleep.pid, awake.pid);
    assert!(
        asleep.reserved_bytes < awake.reserved_bytes,
        "asleep {} reserved, awake {}",
        asleep.reserved_bytes,
        awake.reserved_bytes
    );
    let (status, _, listed) = raw(
        r.port,
        b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n",
    )
    .await;
    assert_eq!(status, 200);
    assert!(listed.contains("\"SLEEPING\""), "{listed}");
    // A request through the router: the wake is admitted first (the awake
    // demand reserved), then the request reaches the server, which wakes.
    let (status, _, answer) = raw(r.port, &post("/v1/completions", body)).await;
    assert_eq!(status, 200, "{answer}");
    let mut woke = false;
    let saw = until(async || {
        let e = tokio::time::timeout(Duration::from_secs(5), events.message())
            .await
            .ok()?
            .ok()??;
        let i = e.instance?;
        woke |= i.instance_id == "tiny" && i.message.contains("WOKEN");
        woke.then_some(i.pid)
    })
    .await;
    assert_eq!(saw, Some(awake.pid), "woken, the same process");
    assert_eq!(d.ids().await, ["tiny"]);
    drop(r);
}
