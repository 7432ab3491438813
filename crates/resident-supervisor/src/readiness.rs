//! Readiness probes: a TCP connect, or an HTTP `GET` whose status line says
//! 200. A 503 (still loading) or any other answer means "not yet".
//!
//! Every orchestrator waits on READY, so it is seen promptly: probes run
//! at a steady short interval (after a quicker start for fast servers),
//! and a line of the server's output, which is how servers announce that
//! they listen or have loaded, brings the next probe forward at once.

use std::net::Ipv4Addr;
use std::time::Duration;

use std::pin::pin;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use tokio::sync::Notify;
use tokio::time::{Instant, sleep, sleep_until, timeout};

use crate::spec::Readiness;

/// Most of a readiness response read before the connection is closed.
const MAX_RESPONSE: usize = 1 << 20;

/// Each probe attempt gives up after this long.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);

/// One probe attempt.
async fn probe_once(readiness: &Readiness, port: u16) -> bool {
    let connect = TcpStream::connect((Ipv4Addr::LOCALHOST, port));
    let Ok(Ok(mut stream)) = timeout(ATTEMPT_TIMEOUT, connect).await else {
        return false;
    };
    let path = match readiness {
        Readiness::None | Readiness::Tcp => return true,
        Readiness::Http { path } => path,
    };
    let request =
        format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n");
    let exchange = async {
        stream.write_all(request.as_bytes()).await?;
        // Read the whole (bounded) response before closing: a server that
        // is still writing its body would otherwise see a reset and log it.
        let mut response = Vec::with_capacity(1024);
        let mut chunk = [0u8; 8192];
        while response.len() < MAX_RESPONSE {
            let n = stream.read(&mut chunk).await?;
            if n == 0 {
                break;
            }
            response.extend_from_slice(&chunk[..n]);
        }
        Ok::<_, std::io::Error>(response)
    };
    match timeout(ATTEMPT_TIMEOUT, exchange).await {
        Ok(Ok(response)) => status_is_ok(&response[..response.len().min(32)]),
        _ => false,
    }
}

fn status_is_ok(head: &[u8]) -> bool {
    let text = String::from_utf8_lossy(head);
    let mut parts = text.split_whitespace();
    matches!((parts.next(), parts.next()), (Some(v), Some("200")) if v.starts_with("HTTP/"))
}

/// The first probes come this fast, for servers that are up at once.
const FIRST_INTERVAL: Duration = Duration::from_millis(10);
/// The interval the probes settle at while a server loads: a connect
/// (refused until the port is bound) or one small GET each time.
pub const STEADY_INTERVAL: Duration = Duration::from_millis(40);
/// Output-triggered probes are at least this far apart, so a server that
/// logs a flood while loading does not turn into a flood of probes.
const MIN_GAP: Duration = Duration::from_millis(5);

/// Whose listener a probe counts: the processes a closure lists (a run's
/// cgroup or process group, an adopted process's group). A port answered
/// by any other process (a local user who bound it first, while the
/// server loaded) is not the server's, and is never READY.
pub type Owners = std::sync::Arc<dyn Fn() -> Vec<i32> + Send + Sync>;

/// Whether one of the processes `owners` lists listens on `port`: their
/// list, one read of the TCP tables and of their descriptors, on a
/// blocking thread.
async fn owned(port: u16, owners: &Owners) -> bool {
    let owners = owners.clone();
    tokio::task::spawn_blocking(move || {
        let pids = owners();
        let listeners = crate::procfs::listening_on(port);
        !listeners.is_empty() && crate::procfs::holds_listener(&pids, &listeners)
    })
    .await
    .unwrap_or(false)
}

/// Probes until ready (true) or `deadline` (false): at once, then at an
/// interval growing from 10 ms to [`STEADY_INTERVAL`], and whenever
/// `output` (notified at each line of the server's, when given) fires. A
/// probe answered on a port that none of `owners` listens on does not
/// count (said once in the log).
pub async fn wait_ready(
    readiness: &Readiness,
    port: u16,
    deadline: Instant,
    output: Option<&Notify>,
    owners: Option<Owners>,
) -> bool {
    if *readiness == Readiness::None {
        return true;
    }
    let mut interval = FIRST_INTERVAL;
    let mut told = false;
    loop {
        // Listening from before the probe, so a line printed during it
        // is not missed.
        let mut woken = pin!(output.map(Notify::notified));
        if let Some(w) = woken.as_mut().as_pin_mut() {
            w.enable();
        }
        let probed = Instant::now();
        if probe_once(readiness, port).await {
            match &owners {
                None => return true,
                Some(owners) if owned(port, owners).await => return true,
                Some(_) if !told => {
                    told = true;
                    tracing::warn!(
                        port,
                        "the port answers, but no process of the instance listens on it (another process holds it): not ready"
                    );
                }
                Some(_) => {}
            }
        }
        let now = Instant::now();
        if now >= deadline {
            return false;
        }
        let line = async {
            match woken.as_mut().as_pin_mut() {
                Some(w) => w.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = sleep(interval.min(deadline - now)) => {}
            () = line => sleep_until((probed + MIN_GAP).min(deadline)).await,
        }
        interval = (interval * 2).min(STEADY_INTERVAL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_status_line() {
        assert!(status_is_ok(b"HTTP/1.1 200 OK\r\n"));
        assert!(status_is_ok(b"HTTP/1.0 200"));
        assert!(!status_is_ok(b"HTTP/1.1 503 Service Unavailable"));
        assert!(!status_is_ok(b"HTTP/1.1 2000"));
        assert!(!status_is_ok(b"SSH-2.0-OpenSSH"));
        assert!(!status_is_ok(b""));
    }

    #[tokio::test]
    async fn a_closed_port_is_not_ready_by_the_deadline() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let deadline = Instant::now() + Duration::from_millis(100);
        assert!(!wait_ready(&Readiness::Tcp, port, deadline, None, None).await);
    }
}
