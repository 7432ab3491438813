//! Interoperability with gRPC clients we did not write: Python grpcio
//! from PyPI (installed into `.venv` at the workspace root by
//! `scripts/test` and CI) with its default options, using only
//! reflection, health and rich errors; and a bare HTTP/2 client that
//! sends the `:authority` values other stacks send over a Unix socket.

use std::process::Command;

use crate::support::*;

#[tokio::test]
async fn python_grpcio_finds_the_service_checks_health_and_decodes_refusals() {
    let Some(python) = venv_python("the Python grpcio client") else {
        return;
    };
    let mut config = pool("unified", "96GB");
    config += &sleeper("coder-daily", "unified", 55, "");
    config += &sleeper("coder-small", "unified", 9, "");
    config += &sleeper("planner", "unified", 55, "");
    let d = Daemon::start(&config).await;
    let socket = d.socket.clone();
    let script = workspace().join("tests/interop/grpc_client.py");
    let out =
        tokio::task::spawn_blocking(move || Command::new(python).arg(script).arg(socket).output())
            .await
            .expect("joined")
            .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the Python client failed:\n{stdout}");
    assert!(stdout.contains("ok   health of 'resident.v1.NodeAgent' is SERVING"));
    assert!(stdout.contains("ok   ErrorInfo OVER_BUDGET"));
    assert!(stdout.contains("ok   Watch streams the starts"));
    assert!(stdout.contains("ok   oversized input: INVALID_ARGUMENT"));
    assert!(stdout.trim_end().ends_with("interop ok"));
}

/// A bare HTTP/2 client over the agent's Unix socket or TCP: it writes the
/// frames itself, so it can send any `:authority`, or none, as grpc-core
/// and grpc-java do, and can stop reading (`connections.rs`).
pub mod raw {
    use loona_hpack::Decoder;
    use loona_hpack::encoder::encode_integer_into;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    use tokio::net::UnixStream;

    use crate::support::PATIENCE;

    const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
    const DATA: u8 = 0x0;
    const HEADERS: u8 = 0x1;
    const RST_STREAM: u8 = 0x3;
    const SETTINGS: u8 = 0x4;
    const GOAWAY: u8 = 0x7;
    const END_STREAM: u8 = 0x1;
    const END_HEADERS: u8 = 0x4;
    const ACK: u8 = 0x1;

    /// How the server answered one stream.
    #[derive(Debug, PartialEq, Eq)]
    pub enum Answer {
        /// Trailers with this `grpc-status`.
        Grpc(String),
        /// RST_STREAM with this error code.
        Reset(u32),
        /// GOAWAY with this error code.
        GoAway(u32),
    }

    pub trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send {}
    impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send> Io for T {}

    pub struct Conn {
        sock: Box<dyn Io>,
        decoder: Decoder<'static>,
        next: u32,
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(payload.len()).expect("small");
        let mut f = len.to_be_bytes()[1..].to_vec();
        f.extend_from_slice(&[kind, flags]);
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    impl Conn {
        pub async fn unix(socket: &std::path::Path) -> Self {
            Self::open(Box::new(
                UnixStream::connect(socket).await.expect("connect"),
            ))
            .await
        }

        pub async fn tcp(port: u16) -> Self {
            let sock = tokio::net::TcpStream::connect(("127.0.0.1", port)).await;
            Self::open(Box::new(sock.expect("connect"))).await
        }

        /// Over `sock`, after sending the preface and SETTINGS.
        pub async fn open(mut sock: Box<dyn Io>) -> Self {
            let mut hello = PREFACE.to_vec();
            hello.extend(frame(SETTINGS, 0, 0, &[]));
            sock.write_all(&hello).await.expect("preface");
            Self {
                sock,
                decoder: Decoder::new(),
                next: 1,
            }
        }

        /// Calls grpc.health.v1.Health/Check with these header fields
        /// (pseudo-headers included) and returns how it ended.
        pub async fn health_check(&mut self, fields: &[(&str, &str)]) -> Answer {
            // An empty HealthCheckRequest.
            let stream = self.send(fields, &[]).await;
            tokio::time::timeout(PATIENCE, self.answer(stream))
                .await
                .expect("an answer in time")
        }

        /// Sends one gRPC request (header fields, then `message`
        /// uncompressed) without waiting for anything; returns its stream.
        pub async fn send(&mut self, fields: &[(&str, &str)], message: &[u8]) -> u32 {
            let stream = self.next;
            self.next += 2;
            let mut block = Vec::new();
            for (name, value) in fields {
                block.push(0); // literal without indexing, new name
                for s in [name, value] {
                    encode_integer_into(s.len(), 7, 0, &mut block).expect("vec");
                    block.extend_from_slice(s.as_bytes());
                }
            }
            let mut out = frame(HEADERS, END_HEADERS, stream, &block);
            let mut data = vec![0];
            data.extend(u32::try_from(message.len()).expect("small").to_be_bytes());
            data.extend_from_slice(message);
            out.extend(frame(DATA, END_STREAM, stream, &data));
            self.sock.write_all(&out).await.expect("request");
            stream
        }

        /// Reads until the server closes the connection (EOF or a reset);
        /// the bytes read.
        pub async fn drain(&mut self) -> usize {
            let mut total = 0;
            let mut buf = vec![0u8; 64 << 10];
            loop {
                match self.sock.read(&mut buf).await {
                    Ok(0) | Err(_) => return total,
                    Ok(n) => total += n,
                }
            }
        }

        async fn answer(&mut self, stream: u32) -> Answer {
            loop {
                let mut head = [0u8; 9];
                self.sock.read_exact(&mut head).await.expect("a frame");
                let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                let (kind, flags) = (head[3], head[4]);
                let id = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) & 0x7fff_ffff;
                let mut payload = vec![0u8; len];
                self.sock.read_exact(&mut payload).await.expect("a payload");
                let code =
                    |at: usize| u32::from_be_bytes(payload[at..at + 4].try_into().expect("4"));
                match kind {
                    SETTINGS if flags & ACK == 0 => {
                        // The server may already have closed after a
                        // GOAWAY, which is then still to be read.
                        let ack = frame(SETTINGS, ACK, 0, &[]);
                        let _ = self.sock.write_all(&ack).await;
                    }
                    GOAWAY => return Answer::GoAway(code(4)),
                    RST_STREAM if id == stream => return Answer::Reset(code(0)),
                    HEADERS => {
                        // The server's blocks fit one frame here (no
                        // CONTINUATION); decoding keeps its table in step.
                        let fields = self.decoder.decode(&payload).expect("server HPACK");
                        let status = fields.iter().find(|(n, _)| n == b"grpc-status");
                        if id == stream && flags & END_STREAM != 0 {
                            let status =
                                status.map(|(_, v)| String::from_utf8_lossy(v).into_owned());
                            return Answer::Grpc(status.unwrap_or_default());
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

/// A request of grpc.health.v1.Health/Check, with `authority` if any.
pub fn health_request(authority: Option<&str>) -> Vec<(&str, &str)> {
    let mut f = vec![
        (":method", "POST"),
        (":scheme", "http"),
        (":path", "/grpc.health.v1.Health/Check"),
    ];
    if let Some(a) = authority {
        f.push((":authority", a));
    }
    f.extend([("content-type", "application/grpc"), ("te", "trailers")]);
    f
}

/// An agent on plaintext TCP, which has no authority layer; returns it
/// with its port once it accepts connections.
async fn plain_tcp_agent() -> (tempfile::TempDir, Killed, u16) {
    let port = free_port();
    let dir = tempfile::tempdir().expect("tempdir");
    let text = format!(
        "[node]\nname = \"tcp\"\nlisten = \"tcp://127.0.0.1:{port}\"\ninsecure = true\nstate_dir = \"{}/state\"\n\n[[pool]]\nname = \"ram\"\nbudget = \"1GB\"\n",
        dir.path().display()
    );
    let config = dir.path().join("residentd.toml");
    std::fs::write(&config, text).expect("config");
    let child = Command::new(RESIDENTD)
        .arg("--config")
        .arg(&config)
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start residentd");
    let child = Killed(child);
    let up = eventually(async || std::net::TcpStream::connect(("127.0.0.1", port)).is_ok());
    assert!(up.await, "the TCP agent never accepted a connection");
    (dir, child, port)
}

#[tokio::test]
async fn any_authority_a_client_sends_reaches_the_service_and_malformed_requests_are_refused() {
    let d = Daemon::start(&pool("unified", "1GB")).await;
    let path = d.socket.to_str().expect("utf-8 path").to_string();
    let encoded = path.replace('/', "%2F");
    let mut conn = raw::Conn::unix(&d.socket).await;
    for authority in [
        Some(path.as_str()),
        Some(encoded.as_str()),
        None,
        Some("localhost"),
    ] {
        let answer = conn.health_check(&health_request(authority)).await;
        assert_eq!(
            answer,
            raw::Answer::Grpc("0".into()),
            "authority {authority:?}"
        );
    }

    // Requests h2 refuses reach it unchanged and get the same protocol
    // error over the socket as over plain TCP, where no layer stands
    // between the client and h2 (PROTOCOL_ERROR is 1).
    let (_dir, tcp_agent, port) = plain_tcp_agent().await;
    let with = |extra: (&'static str, &'static str)| {
        let mut f = health_request(Some("localhost"));
        f.push(extra);
        f
    };
    let malformed: Vec<(&str, Vec<(&str, &str)>)> = vec![
        ("an upper-case name", with(("X-Upper", "1"))),
        (
            "a connection-specific field",
            with(("connection", "keep-alive")),
        ),
        ("a pseudo-header after a field", with((":method", "POST"))),
        (
            "no :path",
            health_request(Some("localhost"))
                .into_iter()
                .filter(|(n, _)| *n != ":path")
                .collect(),
        ),
    ];
    for (what, fields) in &malformed {
        let over_unix = raw::Conn::unix(&d.socket).await.health_check(fields).await;
        let over_tcp = raw::Conn::tcp(port).await.health_check(fields).await;
        assert_eq!(
            over_unix, over_tcp,
            "{what}: as h2 answers it without the layer"
        );
        assert!(
            matches!(over_unix, raw::Answer::Reset(1) | raw::Answer::GoAway(1)),
            "{what}: a protocol error, not {over_unix:?}"
        );
    }
    // The first connection was not disturbed by the others.
    let answer = conn.health_check(&health_request(Some(&path))).await;
    assert_eq!(answer, raw::Answer::Grpc("0".into()));
    drop(tcp_agent);
}
