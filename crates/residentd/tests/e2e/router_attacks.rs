//! The attacks a review found on residentd-router (issue #43), each
//! performed against the router (its library, served in this process)
//! in front of the real agent, over real sockets: a web page driving it
//! (a cross-site `text/plain` POST, a name rebound to 127.0.0.1, a model
//! server's own controls through `/upstream`). Each test fails on the
//! router as it was before the check it shows (see the commit that added
//! it).

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
