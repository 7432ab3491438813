//! Clients that hold connections without using them: a TCP client over
//! its share (`max_connections_per_peer`) or any caller over the node's
//! (`max_connections`) is closed at accept, logged and counted; a TCP
//! connection that never sends its preface is cut off after 10 s; one that
//! asks for a stream and then never reads is dropped by HTTP/2 keepalive.
//! Meanwhile every other caller is served.

use std::path::Path;

use prost::Message as _;
use resident_api::pb;
use tokio::io::AsyncReadExt as _;

use crate::interop::health_request;
use crate::interop::raw;
use crate::metrics::scrape;
use crate::support::*;

/// The agent on a Unix socket (the `Daemon`'s) and plaintext TCP, with
/// `node` keys and metrics; returns it with the TCP and metrics ports.
async fn both(node: &str, rest: &str) -> (Daemon, u16, u16) {
    let (port, metrics) = (free_port(), free_port());
    let dir = tempfile::tempdir().expect("tempdir");
    let text = format!(
        "[node]\nname = \"edges\"\nlisten = [\"unix://{}/agent.sock\", \"tcp://127.0.0.1:{port}\"]\ninsecure = true\nstate_dir = \"{}/state\"\nmetrics_listen = \"127.0.0.1:{metrics}\"\n{node}\n{rest}",
        dir.path().display(),
        dir.path().display(),
    );
    std::fs::write(dir.path().join("residentd.toml"), text).expect("config");
    (Daemon::start_in(dir).await, port, metrics)
}

/// The value of the sample `name` (with its labels) in a scrape, 0 when
/// absent.
fn sample(port: u16, name: &str) -> f64 {
    let body = scrape(port);
    let line = body
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '));
    line.map_or(0.0, |v| v.trim().parse().expect("a number"))
}

const TCP_OPEN: &str = "residentd_connections_open{transport=\"tcp\"}";

async fn wait_sample(port: u16, name: &str, want: f64) {
    let mut last = None;
    let reached = eventually(async || {
        let v = sample(port, name);
        last = Some(v);
        v == want
    })
    .await;
    assert!(reached, "{name} never became {want}: {last:?}");
}

/// Whether the agent closes a fresh connection on `socket` at once,
/// without a byte.
async fn closed_at_once(mut sock: impl tokio::io::AsyncRead + Unpin) -> bool {
    let mut buf = [0u8; 64];
    let read = tokio::time::timeout(PATIENCE, sock.read(&mut buf)).await;
    matches!(read.expect("an answer in time"), Ok(0) | Err(_))
}

async fn unix(socket: &Path) -> tokio::net::UnixStream {
    tokio::net::UnixStream::connect(socket)
        .await
        .expect("connect")
}

async fn tcp(port: u16) -> tokio::net::TcpStream {
    let sock = tokio::net::TcpStream::connect(("127.0.0.1", port)).await;
    sock.expect("connect")
}

#[tokio::test]
async fn tcp_clients_are_held_to_their_share_and_the_node_to_its_total() {
    let node = "max_connections = 5\nmax_connections_per_peer = 2";
    let (mut d, port, metrics) = both(node, &pool("ram", "1GB")).await;
    let unix_open = "residentd_connections_open{transport=\"unix\"}";
    wait_sample(metrics, unix_open, 1.0).await;
    // The Daemon's client holds one Unix connection; two TCP connections
    // that never send anything take 127.0.0.1's whole share.
    let silent = [tcp(port).await, tcp(port).await];
    wait_sample(metrics, TCP_OPEN, 2.0).await;
    // A third from the same address is closed at once.
    assert!(
        closed_at_once(tcp(port).await).await,
        "over the peer's share"
    );
    let logged = eventually(async || d.log().contains("connection refused: 127.0.0.1 has 2 open"));
    assert!(logged.await, "the refusal is logged with the peer");
    let refused_peer = "residentd_connections_refused_total{limit=\"peer\"}";
    assert_eq!(sample(metrics, refused_peer), 1.0);
    // Unix callers have no share of their own, only the node's total: a
    // second and a third connection of this uid are served...
    let mut served = Vec::new();
    for _ in 0..2 {
        let mut conn = raw::Conn::open(Box::new(unix(&d.socket).await)).await;
        let answer = conn.health_check(&health_request(Some("localhost"))).await;
        assert_eq!(answer, raw::Answer::Grpc("0".into()), "served");
        served.push(conn);
    }
    wait_sample(metrics, unix_open, 3.0).await;
    // ...and a fourth is over the node's total of five.
    assert!(
        closed_at_once(unix(&d.socket).await).await,
        "over the total"
    );
    let refused_total = "residentd_connections_refused_total{limit=\"total\"}";
    assert_eq!(sample(metrics, refused_total), 1.0);
    // The connections already open are served throughout.
    assert_eq!(d.node().await.node, "edges");

    // The silent ones never sent HTTP/2's preface: cut off after 10 s,
    // logged, and their places given back.
    for mut s in silent {
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(PATIENCE, s.read(&mut buf)).await;
        let read = read.expect("cut off in time");
        assert!(matches!(read, Ok(0) | Err(_)), "closed: {read:?}");
    }
    wait_sample(metrics, TCP_OPEN, 0.0).await;
    assert!(
        d.log().contains("plaintext connection refused")
            && d.log().contains("the handshake took longer than 10 s"),
        "the cut-off is logged"
    );
    let mut again = raw::Conn::tcp(port).await;
    let answer = again.health_check(&health_request(Some("localhost"))).await;
    assert_eq!(answer, raw::Answer::Grpc("0".into()), "room again");
}

#[tokio::test]
async fn a_client_that_stops_reading_its_stream_is_dropped() {
    let node = "keepalive_interval = \"1s\"\nkeepalive_timeout = \"1s\"";
    let chatty = shell(
        "chatty",
        "while true; do seq 1 2000; sleep 0.05; done",
        "policy = \"never\"",
    );
    let (mut d, port, metrics) = both(node, &(pool("ram", "10GB") + &chatty)).await;
    d.started("chatty", "chatty").await;
    // A client with a small receive buffer follows the logs, then never
    // reads again: the agent's writes to it stall once the buffers fill.
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("SO_RCVBUF");
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let stream = socket.connect(addr).await.expect("connect");
    let mut stalled = raw::Conn::open(Box::new(stream)).await;
    let follow = pb::LogsRequest {
        instance_id: "chatty".into(),
        tail: 0,
        follow: true,
    };
    let fields = [
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/resident.v1.NodeAgent/Logs"),
        (":authority", "localhost"),
        ("content-type", "application/grpc"),
        ("te", "trailers"),
    ];
    stalled.send(&fields, &follow.encode_to_vec()).await;
    wait_sample(metrics, TCP_OPEN, 1.0).await;
    // Others are served while it stalls...
    assert_eq!(d.get("chatty").await.state, pb::State::Ready as i32);
    // ...and its pings go unanswered (1 s, then 1 s): the agent closes
    // it, and what it had queued for it is dropped with it.
    wait_sample(metrics, TCP_OPEN, 0.0).await;
    let read = tokio::time::timeout(PATIENCE, stalled.drain()).await;
    let read = read.expect("the closed connection ends");
    assert!(read > 0, "the logs did flow before the stall");
    assert_eq!(d.get("chatty").await.state, pb::State::Ready as i32);
}
