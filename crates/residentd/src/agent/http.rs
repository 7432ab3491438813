//! The agent's HTTP client for the servers it runs: one HTTP/1.0 call on a
//! loopback port (a sleep or wake, a readiness check, llama-server's
//! `/props`, `/slots` and its slot saves), bounded in time and in what it reads. A
//! room of its own: it knows nothing of the agent.

use std::time::Duration;

use resident_config::HttpCall;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// Most of an answer read.
const MAX_ANSWER: usize = 64 * 1024;

/// Most of a JSON answer read (`GET /slots` of a server with many slots).
const MAX_JSON: usize = 1024 * 1024;

/// One call without a body on loopback `port`: the body of a 2xx answer.
pub(super) async fn http_call(
    port: u16,
    call: &HttpCall,
    timeout: Duration,
) -> Result<String, String> {
    exchange(port, &call.method, &call.path, None, timeout, MAX_ANSWER).await
}

/// `GET path` on loopback `port`: the body of a 2xx answer (at most 1 MiB
/// read); otherwise the status line and what the server said.
pub(super) async fn get_json(port: u16, path: &str, timeout: Duration) -> Result<String, String> {
    exchange(port, "GET", path, None, timeout, MAX_JSON).await
}

/// One call on loopback `port` with a JSON `body`: the body of a 2xx
/// answer; otherwise the status line and what the server said.
pub(super) async fn post_json(
    port: u16,
    path: &str,
    body: &str,
    timeout: Duration,
) -> Result<String, String> {
    exchange(port, "POST", path, Some(body), timeout, MAX_ANSWER).await
}

async fn exchange(
    port: u16,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
    max: usize,
) -> Result<String, String> {
    let exchange = async {
        let mut stream = TcpStream::connect((std::net::Ipv4Addr::LOCALHOST, port))
            .await
            .map_err(|e| format!("could not connect to port {port}: {e}"))?;
        let (kind, content) = match body {
            Some(b) => ("Content-Type: application/json\r\n", b),
            None => ("", ""),
        };
        let request = format!(
            "{method} {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\n{kind}Content-Length: {}\r\nConnection: close\r\n\r\n{content}",
            content.len()
        );
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("could not be sent: {e}"))?;
        let mut answer = Vec::with_capacity(1024);
        let mut chunk = [0u8; 4096];
        while answer.len() < max {
            match stream.read(&mut chunk).await {
                Ok(0) => break,
                Ok(n) => answer.extend_from_slice(&chunk[..n]),
                Err(e) => return Err(format!("broke off: {e}")),
            }
        }
        let head = String::from_utf8_lossy(&answer[..answer.len().min(64)]).into_owned();
        let status = head.split_whitespace().nth(1).unwrap_or("");
        let text = String::from_utf8_lossy(&answer).into_owned();
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_string())
            .unwrap_or_default();
        if status.starts_with('2') && status.len() == 3 {
            Ok(body)
        } else {
            let line = head.lines().next().unwrap_or("").trim();
            let said: String = body.chars().take(200).collect();
            Err(format!("answered {line:?} {said}"))
        }
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(result) => result,
        Err(_) => Err(format!("took longer than {timeout:?}")),
    }
}
