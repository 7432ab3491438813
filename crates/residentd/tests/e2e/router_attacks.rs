//! The attacks a review found on residentd-router (issue #43, points 7
//! and 8), each performed against the router (its library, served in
//! this process) in front of the real agent, over real sockets: a web
//! page driving it (a cross-site `text/plain` POST, a name rebound to
//! 127.0.0.1, a model server's own controls through `/upstream`), and
//! clients that hold what the router has (slow headers, connections,
//! bodies, the console's streams against the agent's calls), and the
//! agent's own metrics endpoint held the same way. Each test fails on the
//! router as it was before the bounds (see the commit that added them).

use std::time::{Duration, Instant};

use resident_api::pb;
use serde_json::Value;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::support::*;

/// Sends `request` as is on a new connection and reads the whole answer
/// (the request says `Connection: close`, or the server closes): the
/// status (0 when none came) and the body.
async fn exchange(port: u16, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap_or_else(|e| panic!("connect to {port}: {e}"));
    // A server that closed at accept may reset the connection first.
    if s.write_all(request.as_bytes()).await.is_err() {
        return (0, String::new());
    }
    read_answer(&mut s).await
}

/// Reads until the server closes: the status (0 when none came) and the
/// body.
async fn read_answer(s: &mut TcpStream) -> (u16, String) {
    let mut answer = Vec::new();
    let read = tokio::time::timeout(PATIENCE, s.read_to_end(&mut answer)).await;
    // A reset after the answer still leaves the answer read.
    let _ = read.expect("the server closes within the patience");
    split(&String::from_utf8_lossy(&answer))
}

/// The status and body of an HTTP answer.
fn split(text: &str) -> (u16, String) {
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, body.to_string())
}

/// Reads one answer of a kept-alive connection (its head and its
/// Content-Length of body): the status.
async fn read_one(s: &mut TcpStream) -> u16 {
    let mut seen = Vec::new();
    let mut buf = [0u8; 4096];
    let whole = tokio::time::timeout(PATIENCE, async {
        loop {
            let text = String::from_utf8_lossy(&seen).to_string();
            if let Some((head, body)) = text.split_once("\r\n\r\n") {
                let length = head
                    .lines()
                    .find_map(|l| {
                        let (k, v) = l.split_once(':')?;
                        k.eq_ignore_ascii_case("content-length")
                            .then(|| v.trim().parse::<usize>().ok())?
                    })
                    .unwrap_or(0);
                if body.len() >= length {
                    return split(&text).0;
                }
            }
            let n = s.read(&mut buf).await.expect("read");
            assert!(n > 0, "closed mid-answer: {text}");
            seen.extend_from_slice(&buf[..n]);
        }
    });
    whole.await.expect("an answer within the patience")
}

/// The OpenAI error code of a body.
fn code(body: &str) -> String {
    let v: Value = serde_json::from_str(body.trim()).unwrap_or_else(|e| panic!("{e}: {body}"));
    v["error"]["code"].as_str().unwrap_or_default().to_string()
}

/// A POST of `body` to `path` with `headers` (each ending in CRLF).
fn post_with(path: &str, headers: &str, body: &str) -> String {
    format!(
        "POST {path} HTTP/1.1\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

fn get_as(path: &str, host: &str) -> String {
    format!("GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n")
}

/// The router's metric `line` (a sample's name and labels): its value.
async fn metric(port: u16, line: &str) -> Option<f64> {
    let (_, body) = exchange(port, &get_as("/metrics", "localhost")).await;
    body.lines()
        .find_map(|l| l.strip_prefix(line)?.trim().parse().ok())
}

const CHAT: &str = r#"{"model": "big", "messages": [{"role": "user", "content": "hi"}]}"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cross_site_post_or_a_rebound_name_starts_and_evicts_nothing() {
    // `big` (the vLLM stand-in, 3 of the gpu's 4 GB) evicts `other` (3
    // GB) to start, under on_full = "evict".
    let config = String::from("on_full = \"evict\"\n\n") + &crate::sleep::config("");
    let mut d = Daemon::start(&config).await;
    d.ready("other", "o").await;
    let r = serve_router(&d.socket.display().to_string(), None, PATIENCE, None).await;
    let port = r.port;
    let untouched = async |d: &mut Daemon, what: &str| {
        let ids: Vec<(String, i32)> = d
            .list()
            .await
            .into_iter()
            .map(|i| (i.instance_id, i.state))
            .collect();
        assert_eq!(
            ids,
            [("o".to_string(), pb::State::Ready as i32)],
            "{what}: nothing started, nothing evicted"
        );
    };

    // A page of evil.example posts a form-like text/plain body (a
    // "simple" request: the browser sends it without asking), as the
    // review did.
    let cross_site = post_with(
        "/v1/chat/completions",
        &format!(
            "Host: 127.0.0.1:{port}\r\nOrigin: http://evil.example\r\nContent-Type: text/plain;charset=UTF-8\r\n"
        ),
        CHAT,
    );
    let (status, body) = exchange(port, &cross_site).await;
    assert_eq!(
        (status, code(&body).as_str()),
        (403, "origin_not_allowed"),
        "{body}"
    );
    assert!(
        body.contains("http://evil.example"),
        "names the origin: {body}"
    );
    untouched(&mut d, "a cross-site text/plain POST").await;
    // The same body without an Origin (a client that sends none): not
    // JSON, so 415, naming the type.
    let plain = post_with(
        "/v1/chat/completions",
        "Host: localhost\r\nContent-Type: text/plain\r\n",
        CHAT,
    );
    let (status, body) = exchange(port, &plain).await;
    assert_eq!(
        (status, code(&body).as_str()),
        (415, "unsupported_media_type"),
        "{body}"
    );
    assert!(body.contains("text/plain"), "{body}");
    untouched(&mut d, "a text/plain POST").await;

    // A page at evil.example whose name now points at 127.0.0.1 (DNS
    // rebinding) is same-origin to itself: no Origin check catches it,
    // its Host does. On the API and on the console's events alike.
    let rebound = format!("evil.example:{port}");
    for path in ["/v1/models", "/ui/events", "/ui/logs/o", "/health"] {
        let (status, body) = exchange(port, &get_as(path, &rebound)).await;
        assert_eq!(
            (status, code(&body).as_str()),
            (403, "host_not_allowed"),
            "{path}: {body}"
        );
        assert!(
            body.contains(&rebound) && body.contains("--allow-host"),
            "names the host and how to allow it: {body}"
        );
    }
    let rebound_post = post_with(
        "/v1/chat/completions",
        &format!("Host: {rebound}\r\nContent-Type: application/json\r\n"),
        CHAT,
    );
    let (status, body) = exchange(port, &rebound_post).await;
    assert_eq!((status, code(&body).as_str()), (403, "host_not_allowed"));
    untouched(&mut d, "a POST from a rebound name").await;

    // What is allowed still works: the router's own names, and a host the
    // operator added.
    for host in [
        format!("127.0.0.1:{port}"),
        "localhost".into(),
        format!("[::1]:{port}"),
    ] {
        let (status, body) = exchange(port, &get_as("/v1/models", &host)).await;
        assert_eq!(status, 200, "{host}: {body}");
    }
    let named = serve_router_with(&d.socket.display().to_string(), |o| {
        o.allow_hosts = vec!["node-7.example.org".into()];
    })
    .await;
    let (status, body) = exchange(named.port, &get_as("/v1/models", "node-7.example.org")).await;
    assert_eq!(status, 200, "an --allow-host name: {body}");
    // And a same-origin JSON POST (a page of the router itself) is served:
    // big is started, o evicted for it.
    let own = post_with(
        "/v1/chat/completions",
        &format!(
            "Host: 127.0.0.1:{port}\r\nOrigin: http://127.0.0.1:{port}\r\nContent-Type: application/json; charset=utf-8\r\n"
        ),
        CHAT,
    );
    let (status, body) = exchange(port, &own).await;
    assert!(
        ![403, 415].contains(&status),
        "a same-origin JSON POST passes: {status} {body}"
    );
    assert_eq!(d.get("big").await.state, pb::State::Ready as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_servers_own_controls_are_not_reachable_through_upstream() {
    // The vLLM stand-in, READY as `b`, answers /sleep and /wake_up as
    // vLLM does (with VLLM_SERVER_DEV_MODE=1).
    let (d, awake) = crate::sleep::big_ready("").await;
    let r = serve_router(&d.socket.display().to_string(), None, PATIENCE, None).await;
    let asleep = async || {
        let (status, body) =
            exchange(awake.port as u16, &get_as("/is_sleeping", "localhost")).await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).expect("JSON");
        v["is_sleeping"].as_bool().expect("is_sleeping")
    };
    assert!(!asleep().await);
    let json = "Host: localhost\r\nContent-Type: application/json\r\n";
    for path in [
        "/upstream/big/sleep?level=1",
        "/upstream/big/sleep",
        "/upstream/big/v1/models/../../sleep",
        "/upstream/big/health/..%2Fsleep",
        "/upstream/big/wake_up",
    ] {
        let (status, body) = exchange(r.port, &post_with(path, json, "")).await;
        assert_eq!(
            (status, code(&body).as_str()),
            (403, "upstream_path_not_allowed"),
            "{path}: {body}"
        );
        assert!(body.contains("--upstream-allow"), "{body}");
        assert!(!asleep().await, "{path} put the server to sleep");
    }
    // Its health, a read, is forwarded.
    let (status, body) = exchange(r.port, &get_as("/upstream/big/health", "localhost")).await;
    assert_eq!(status, 200, "{body}");
    // An operator who wants its controls through the router says so.
    let open = serve_router_with(&d.socket.display().to_string(), |o| {
        o.upstream_allow = vec!["default".into(), "/sleep".into()];
    })
    .await;
    let (status, body) = exchange(
        open.port,
        &post_with("/upstream/big/sleep?level=1", json, ""),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert!(asleep().await, "allowed, /sleep reached the server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_finishes_its_headers_is_cut_off_while_others_are_served() {
    let d = Daemon::start(&pool("ram", "1GB")).await;
    let timeout = Duration::from_secs(1);
    let r = serve_router_with(&d.socket.display().to_string(), |o| {
        o.header_timeout = timeout;
    })
    .await;
    // Half a request's headers, then nothing (slowloris).
    let mut slow = TcpStream::connect(("127.0.0.1", r.port))
        .await
        .expect("connect");
    let began = Instant::now();
    slow.write_all(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        .await
        .expect("send");
    // Served meanwhile.
    let (status, body) = exchange(r.port, &get_as("/health", "localhost")).await;
    assert_eq!(status, 200, "{body}");
    // And an idle kept-alive connection is closed the same way.
    let mut idle = TcpStream::connect(("127.0.0.1", r.port))
        .await
        .expect("connect");
    idle.write_all(
        get_as("/v1/models", "localhost")
            .replace("Connection: close\r\n", "")
            .as_bytes(),
    )
    .await
    .expect("send");
    assert_eq!(read_one(&mut idle).await, 200);
    let idle_since = Instant::now();
    let mut rest = Vec::new();
    let cut = tokio::time::timeout(10 * timeout, slow.read_to_end(&mut rest)).await;
    let took = began.elapsed();
    assert!(
        cut.is_ok(),
        "the slow client was still connected after {took:?} (--header-timeout {timeout:?})"
    );
    assert!(
        took >= timeout,
        "cut off after {took:?}, before the timeout"
    );
    assert!(rest.is_empty(), "{}", String::from_utf8_lossy(&rest));
    let cut = tokio::time::timeout(10 * timeout, idle.read_to_end(&mut rest)).await;
    assert!(cut.is_ok(), "an idle connection stayed open");
    assert!(idle_since.elapsed() >= timeout);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_beyond_the_cap_are_answered_503_and_the_cap_frees_as_they_close() {
    let d = Daemon::start(&pool("ram", "1GB")).await;
    let r = serve_router_with(&d.socket.display().to_string(), |o| {
        o.max_connections = 4;
    })
    .await;
    // Four connections, each answered once and kept open.
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut s = TcpStream::connect(("127.0.0.1", r.port))
            .await
            .expect("connect");
        s.write_all(b"GET /nothing HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .expect("send");
        assert_eq!(read_one(&mut s).await, 404);
        held.push(s);
    }
    // A fifth: 503, said as such, and closed.
    let (status, body) = exchange(r.port, &get_as("/health", "localhost")).await;
    assert_eq!(
        (status, code(&body).as_str()),
        (503, "too_many_connections"),
        "{body}"
    );
    assert!(body.contains("--max-connections"), "{body}");
    // One closes: a new one is served.
    drop(held.pop());
    let served =
        eventually(async || exchange(r.port, &get_as("/health", "localhost")).await.0 == 200);
    assert!(served.await, "a place came free once a connection closed");
    // The refusal was counted.
    let refused = "residentd_router_refused_total{why=\"connections\"}";
    let count = until(async || metric(r.port, refused).await).await;
    assert!(count >= Some(1.0), "{count:?}");
    drop(held);
}

/// A POST whose 1 MiB body is declared and never sent beyond its start.
async fn stalled_body(port: u16) -> TcpStream {
    let mut s = TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    let head = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{{\"model\":",
        1 << 20
    );
    s.write_all(head.as_bytes()).await.expect("send");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_are_buffered_within_the_budget_and_others_wait_their_turn() {
    let d = Daemon::start(&pool("ram", "1GB")).await;
    // Room for two bodies of the largest size (1 MiB); each has 2 s to
    // arrive.
    let r = serve_router_with(&d.socket.display().to_string(), |o| {
        o.body_budget = 2 << 20;
        o.body_timeout = Duration::from_secs(2);
        o.queue_timeout = PATIENCE;
    })
    .await;
    let port = r.port;
    let reserved = "residentd_router_buffered_bytes";
    let budget = f64::from(2 << 20);
    // The most set aside, sampled throughout.
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let sampler = tokio::spawn(async move {
        let mut most = 0.0f64;
        loop {
            most = most.max(metric(port, reserved).await.unwrap_or(0.0));
            tokio::select! {
                _ = &mut stopped => return most,
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    });
    // Four clients declare 1 MiB each and stall: two are read, 2 MiB set
    // aside, the other two wait without being read.
    let began = Instant::now();
    let mut stalled = Vec::new();
    for _ in 0..4 {
        stalled.push(stalled_body(port).await);
    }
    // Until two bodies' room is set aside (checked below: without the
    // budget nothing is).
    let full = until(async || metric(port, reserved).await.filter(|&b| b >= budget)).await;
    // A small, whole request now waits for room, behind the two waiting:
    // it is answered only after stalled bodies ran out of time (408).
    let small = post_with(
        "/v1/chat/completions",
        "Host: localhost\r\nContent-Type: application/json\r\n",
        r#"{"model": "nothing-by-this-name"}"#,
    );
    let asked = Instant::now();
    let (status, body) = exchange(port, &small).await;
    let waited = asked.elapsed();
    assert_eq!(
        (status, code(&body).as_str()),
        (404, "model_not_found"),
        "{body}"
    );
    // Room came free at the first stalled bodies' 2 s at the soonest.
    assert!(
        began.elapsed() >= Duration::from_secs(2) && waited >= Duration::from_secs(1),
        "the small request was read before room came free: after {waited:?}"
    );
    assert_eq!(full, Some(budget), "two bodies' room set aside");
    for s in &mut stalled {
        let (status, body) = read_answer(s).await;
        assert_eq!(status, 408, "{body}");
    }
    // Never more than the budget set aside, and all of it back at the end.
    let settled = eventually(async || metric(port, reserved).await == Some(0.0)).await;
    assert!(settled, "the room was given back");
    let _ = stop.send(());
    let most = sampler.await.expect("the sampler");
    assert_eq!(most, budget, "at most the budget set aside");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_hundred_log_streams_do_not_keep_a_start_on_demand_waiting() {
    let Some(python) = venv_python("the attack test's model server") else {
        return;
    };
    // An instance whose logs are followed (a line, then quiet), and a
    // model the chat request starts on demand.
    let talker = "[[workload]]\nname = \"talker\"\ncommand = [\"/bin/sh\", \"-c\", \"echo hello; exec sleep 3600\"]\nstop_grace = \"2s\"\n[workload.memory.ram]\nweights = \"1GB\"\n";
    let demo = format!(
        "[[workload]]\nname = \"demo\"\ncommand = [\"{}\", \"{}\", \"${{PORT}}\"]\nstop_grace = \"2s\"\n[workload.memory.ram]\nweights = \"1GB\"\n[workload.readiness]\nhttp = \"/v1/models\"\ntimeout = \"30s\"\n",
        python.display(),
        workspace().join("tests/router/slow_server.py").display()
    );
    let mut d = Daemon::start(&(pool("ram", "10GB") + talker + &demo)).await;
    d.ready("talker", "t").await;
    let r = serve_router(&d.socket.display().to_string(), None, PATIENCE, None).await;
    // 300 viewers follow t's logs at once (the agent serves 256 calls at
    // once on a connection).
    let mut streams = Vec::new();
    for _ in 0..300 {
        let mut s = TcpStream::connect(("127.0.0.1", r.port))
            .await
            .expect("connect");
        s.write_all(get_as("/ui/logs/t", "localhost").as_bytes())
            .await
            .expect("send");
        streams.push(s);
    }
    let mut heads = Vec::new();
    for s in &mut streams {
        let mut seen = Vec::new();
        let mut buf = [0u8; 1024];
        let head = tokio::time::timeout(PATIENCE, async {
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = s.read(&mut buf).await.expect("read");
                assert!(n > 0, "closed before its head");
                seen.extend_from_slice(&buf[..n]);
            }
            String::from_utf8_lossy(&seen).to_string()
        });
        heads.push(head.await.expect("a head within the patience"));
    }
    // A request for a model that is not running: started on demand and
    // answered within seconds, not after the log streams end.
    let asked = Instant::now();
    let chat = post_with(
        "/v1/chat/completions",
        "Host: localhost\r\nContent-Type: application/json\r\n",
        r#"{"model": "demo", "messages": [{"role": "user", "content": "hi"}]}"#,
    );
    let answered = tokio::time::timeout(Duration::from_secs(20), exchange(r.port, &chat)).await;
    let (status, body) = answered.unwrap_or_else(|_| {
        panic!("the chat request was not answered within 20 s while 300 log streams were open")
    });
    assert_eq!(status, 200, "{body}");
    println!(
        "a start on demand beside 300 log streams answered in {:?}",
        asked.elapsed()
    );
    // The streams beyond --max-streams (64) were refused, each saying so;
    // those served follow the instance's output.
    let served: Vec<usize> = (0..heads.len())
        .filter(|&k| heads[k].starts_with("HTTP/1.1 200"))
        .collect();
    let refused = heads
        .iter()
        .filter(|h| h.starts_with("HTTP/1.1 503") && h.to_lowercase().contains("connection: close"))
        .count();
    assert_eq!((served.len(), refused), (64, 236), "{:?}", &heads[..2]);
    for k in served {
        let s = &mut streams[k];
        // What came with the head counts.
        let mut seen = heads[k].as_bytes().to_vec();
        let mut buf = [0u8; 4096];
        let line = tokio::time::timeout(PATIENCE, async {
            while !String::from_utf8_lossy(&seen).contains("hello") {
                let n = s.read(&mut buf).await.expect("read");
                assert!(n > 0, "a served stream ended");
                seen.extend_from_slice(&buf[..n]);
            }
        });
        line.await.expect("t's line on every stream served");
    }
    drop(streams);
    assert_eq!(d.get("demo").await.state, pb::State::Ready as i32);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_agents_metrics_endpoint_cuts_off_slow_headers_and_caps_connections() {
    let metrics = free_port();
    let d = Daemon::start(
        &(format!("metrics_listen = \"127.0.0.1:{metrics}\"\n\n") + &pool("ram", "1GB")),
    )
    .await;
    let up = eventually(async || TcpStream::connect(("127.0.0.1", metrics)).await.is_ok());
    assert!(up.await, "the metrics endpoint listens");
    let cap = residentd::server::METRICS_CONNECTIONS;
    let timeout = residentd::server::METRICS_HEADER_TIMEOUT;
    // A client that never finishes its headers, and enough others to fill
    // the cap.
    let began = Instant::now();
    let mut slow = TcpStream::connect(("127.0.0.1", metrics))
        .await
        .expect("connect");
    slow.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n")
        .await
        .expect("send");
    let mut held = Vec::new();
    for _ in 1..cap {
        let mut s = TcpStream::connect(("127.0.0.1", metrics))
            .await
            .expect("connect");
        s.write_all(b"GET /metrics HTTP/1.1\r\nHost: localhost\r\n\r\n")
            .await
            .expect("send");
        assert_eq!(read_one(&mut s).await, 200);
        held.push(s);
    }
    // One more: closed without an answer.
    let (status, body) = exchange(metrics, &get_as("/metrics", "localhost")).await;
    assert_eq!(status, 0, "served beyond {cap} connections: {body}");
    // The slow one is cut off after the timeout, and its place given back.
    let mut rest = Vec::new();
    let cut = tokio::time::timeout(3 * timeout, slow.read_to_end(&mut rest)).await;
    assert!(
        cut.is_ok(),
        "the slow client was still connected after {:?}",
        began.elapsed()
    );
    assert!(began.elapsed() >= timeout);
    drop(held);
    let served =
        eventually(async || exchange(metrics, &get_as("/metrics", "localhost")).await.0 == 200);
    assert!(served.await, "served again once places came free");
    drop(d);
}
