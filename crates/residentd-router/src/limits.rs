//! The router's bounds on what clients can make it hold (docs/router.md,
//! Bounds; docs/security.md):
//!
//! - [`serve`]: the HTTP/1 server: at most `--max-connections` open
//!   connections (one more is answered 503 and closed at accept), and
//!   `--header-timeout` for a request's headers, also the next one's on
//!   a kept-alive connection (so an idle connection is closed too);
//! - [`BodyBudget`]: the bytes of request bodies held at once
//!   (`--body-budget`), set aside before a body is read and given back
//!   once it has been forwarded; a request waits for room up to
//!   `--queue-timeout`, then 503 `body_budget`;
//! - [`Streams`]: the console's open streams (`/ui/events`, `/ui/logs`),
//!   at most `--max-streams`; one more is 503 `too_many_streams`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::RouterError;
use crate::metrics::Metrics;

/// How long a refused connection is kept open to read what its client
/// sent, so that the client reads the 503 rather than a reset.
const LINGER: Duration = Duration::from_millis(500);

/// How many refused connections linger at once; beyond, they are closed
/// at once.
const LINGERING: usize = 64;

/// The least time between two warnings that connections are refused.
const WARN_EVERY: Duration = Duration::from_secs(10);

/// How long accepting pauses after an error (out of file descriptors).
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// Serves `routes` on `listener` within `max_connections` and
/// `header_timeout` until `shutdown` resolves; then stops accepting and
/// waits for the open connections to finish their answers.
pub async fn serve(
    listener: TcpListener,
    routes: axum::Router,
    max_connections: usize,
    header_timeout: Duration,
    metrics: Arc<Metrics>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) {
    let open = Arc::new(Semaphore::new(max_connections));
    let lingering = Arc::new(Semaphore::new(LINGERING));
    let mut warned = None;
    let graceful = GracefulShutdown::new();
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(header_timeout);
    tokio::pin!(shutdown);
    loop {
        let (tcp, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(a) => a,
                Err(e) => {
                    tracing::warn!(error = %e, "accepting a connection failed");
                    tokio::time::sleep(ACCEPT_PAUSE).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(slot) = open.clone().try_acquire_owned() else {
            metrics.refused("connections");
            if warned.is_none_or(|w: Instant| w.elapsed() >= WARN_EVERY) {
                warned = Some(Instant::now());
                tracing::warn!(%peer, max_connections, "connections refused: --max-connections are open (counted in residentd_router_refused_total{{why=\"connections\"}})");
            }
            refuse(tcp, max_connections, &lingering);
            continue;
        };
        // Each SSE event is a small write: without TCP_NODELAY, Nagle's
        // algorithm holds it back until the client's delayed ACK (about
        // 40 ms), and a stream crawls at ~25 events a second.
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "TCP_NODELAY not set");
        }
        let conn =
            http.serve_connection(TokioIo::new(tcp), TowerToHyperService::new(routes.clone()));
        let conn = graceful.watch(conn);
        metrics.connections(1);
        let metrics = metrics.clone();
        tokio::spawn(async move {
            match conn.await {
                Err(e) if e.is_timeout() => {
                    tracing::info!(%peer, "connection closed: its request's headers did not arrive within --header-timeout");
                }
                Err(e) => tracing::debug!(%peer, error = %e, "connection ended"),
                Ok(()) => {}
            }
            metrics.connections(-1);
            drop(slot);
        });
    }
    drop(listener);
    graceful.shutdown().await;
}

/// Answers a connection over the cap with 503 and closes it, reading what
/// its client sent for a moment first (a socket closed with unread bytes
/// is reset, and the 503 lost); when [`LINGERING`] others already do,
/// closes it at once.
fn refuse(tcp: TcpStream, max: usize, lingering: &Arc<Semaphore>) {
    let Ok(lingers) = lingering.clone().try_acquire_owned() else {
        return;
    };
    let e = RouterError::busy(
        "too_many_connections",
        format!("the router has its {max} connections open (--max-connections); try again soon"),
    );
    let body = e.body().to_string();
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut tcp = tcp;
        let _ = tokio::time::timeout(LINGER, async {
            tcp.write_all(answer.as_bytes()).await?;
            tcp.shutdown().await?;
            let mut sink = [0u8; 4096];
            while tcp.read(&mut sink).await? > 0 {}
            Ok::<_, std::io::Error>(())
        })
        .await;
        drop(lingers);
    });
}

/// The bytes of request bodies the router holds at once.
#[derive(Debug)]
pub struct BodyBudget {
    /// In KiB: a semaphore counts in u32 per acquisition.
    room: Arc<Semaphore>,
    total_kib: u32,
    bytes: usize,
    metrics: Arc<Metrics>,
}

/// Room set aside for one body, given back when dropped.
#[derive(Debug)]
pub struct Buffered {
    _permit: Option<OwnedSemaphorePermit>,
    bytes: i64,
    metrics: Arc<Metrics>,
}

impl Drop for Buffered {
    fn drop(&mut self) {
        self.metrics.buffered(-self.bytes);
    }
}

impl BodyBudget {
    /// A budget of `bytes`.
    pub fn new(bytes: usize, metrics: Arc<Metrics>) -> Self {
        let total_kib = u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX);
        Self {
            room: Arc::new(Semaphore::new(total_kib as usize)),
            total_kib,
            bytes,
            metrics,
        }
    }

    /// Room for a body of up to `bytes`, waited for up to `wait`; 503
    /// `body_budget` when it did not come.
    pub async fn room(&self, bytes: usize, wait: Duration) -> Result<Buffered, RouterError> {
        let kib = u32::try_from(bytes.div_ceil(1024))
            .unwrap_or(u32::MAX)
            .min(self.total_kib);
        let permit = if kib == 0 {
            None
        } else {
            let acquired =
                tokio::time::timeout(wait, self.room.clone().acquire_many_owned(kib)).await;
            match acquired {
                Ok(Ok(p)) => Some(p),
                _ => {
                    self.metrics.refused("body_budget");
                    return Err(RouterError::busy(
                        "body_budget",
                        format!(
                            "the router holds {} bytes of request bodies already (--body-budget) and none came free within {} s (--queue-timeout); try again soon",
                            self.bytes,
                            wait.as_secs()
                        ),
                    ));
                }
            }
        };
        let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        self.metrics.buffered(bytes);
        Ok(Buffered {
            _permit: permit,
            bytes,
            metrics: self.metrics.clone(),
        })
    }
}

/// The console's streams open at once.
#[derive(Debug)]
pub struct Streams {
    open: Arc<Semaphore>,
    max: usize,
    metrics: Arc<Metrics>,
}

/// One open stream, counted until dropped.
#[derive(Debug)]
pub struct StreamSlot {
    _permit: OwnedSemaphorePermit,
    metrics: Arc<Metrics>,
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.metrics.console_stream(-1);
    }
}

impl Streams {
    /// At most `max` at once.
    pub fn new(max: usize, metrics: Arc<Metrics>) -> Self {
        Self {
            open: Arc::new(Semaphore::new(max)),
            max,
            metrics,
        }
    }

    /// A slot for one more stream, or 503 `too_many_streams`.
    pub fn open(&self) -> Result<StreamSlot, RouterError> {
        match self.open.clone().try_acquire_owned() {
            Ok(permit) => {
                self.metrics.console_stream(1);
                Ok(StreamSlot {
                    _permit: permit,
                    metrics: self.metrics.clone(),
                })
            }
            Err(_) => {
                self.metrics.refused("streams");
                Err(RouterError::busy(
                    "too_many_streams",
                    format!(
                        "the console has its {} streams open (--max-streams: /ui/events and /ui/logs together); close a page or try again soon",
                        self.max
                    ),
                ))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn bodies_get_room_within_the_budget_and_give_it_back() {
        let metrics = Arc::new(Metrics::new());
        let budget = BodyBudget::new(4096, metrics.clone());
        let wait = Duration::from_millis(50);
        let first = budget.room(3000, wait).await.expect("room");
        let e = budget.room(2000, wait).await.expect_err("no room left");
        assert_eq!((e.code.as_str(), e.status.as_u16()), ("body_budget", 503));
        assert!(e.message.contains("--body-budget"), "{}", e.message);
        // An empty body takes none; a body larger than the budget takes
        // all of it once free, never waits for ever.
        let empty = budget.room(0, wait).await.expect("no room needed");
        drop(first);
        let whole = budget.room(1 << 20, wait).await.expect("all of it");
        assert!(
            metrics
                .render()
                .contains("residentd_router_buffered_bytes 1048576")
        );
        drop((whole, empty));
        assert!(
            metrics
                .render()
                .contains("residentd_router_buffered_bytes 0")
        );
    }

    #[test]
    fn the_consoles_streams_are_counted_and_capped() {
        let metrics = Arc::new(Metrics::new());
        let streams = Streams::new(2, metrics.clone());
        let (a, _b) = (streams.open().expect("one"), streams.open().expect("two"));
        let e = streams.open().expect_err("a third");
        assert_eq!(e.code, "too_many_streams");
        assert!(e.message.contains("--max-streams"), "{}", e.message);
        drop(a);
        let _c = streams.open().expect("a place came free");
        let text = metrics.render();
        assert!(
            text.contains("residentd_router_console_streams 2"),
            "{text}"
        );
        assert!(
            text.contains("residentd_router_refused_total{why=\"streams\"} 1"),
            "{text}"
        );
    }
}
