//! Every listener's connections, counted and bounded, so that no client,
//! stalled or hostile, holds the agent's sockets and memory for ever:
//!
//! - all listeners together keep at most `node.max_connections` open, and
//!   one TCP peer (a client's IP address) at most
//!   `node.max_connections_per_peer`; Unix callers, local users the socket's
//!   mode already let in, count against the total only (a service's many
//!   clients share its uid); a connection over either limit is
//!   closed as soon as it is accepted, logged (once until a connection
//!   closes) and counted in `residentd_connections_refused_total`;
//! - a TCP connection must finish its TLS handshake, or send HTTP/2's
//!   preface when plaintext, within 10 s of being accepted, each on its own
//!   task so that a stalled one delays nobody;
//! - once serving, HTTP/2 keepalive pings (`server.rs`) close a connection
//!   whose peer stops answering, a client that never reads included.
//!
//! The limits are read from the configuration at each accept, so a reload
//! changes them for new connections.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::server::Connected;

use crate::metrics::Metrics;

/// What the connections need of the agent they serve.
pub trait Host: Send + Sync + fmt::Debug {
    /// `max_connections` and `max_connections_per_peer` in force now.
    fn limits(&self) -> (usize, usize);
    /// Where opened, refused and closed connections are counted.
    fn metrics(&self) -> &Metrics;
}

/// How long a TCP client may take to finish its TLS handshake, or to send
/// HTTP/2's preface on a plaintext listener.
pub const HANDSHAKE: Duration = Duration::from_secs(10);

/// Who holds a connection, for the per-peer limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Peer {
    /// A TCP client, by address (any port).
    Ip(IpAddr),
    /// A Unix-socket caller, by uid.
    Uid(u32),
}

impl fmt::Display for Peer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Ip(ip) => write!(f, "{ip}"),
            Self::Uid(uid) => write!(f, "uid {uid}"),
        }
    }
}

impl Peer {
    fn transport(self) -> &'static str {
        match self {
            Self::Ip(_) => "tcp",
            Self::Uid(_) => "unix",
        }
    }
}

#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_peer: HashMap<Peer, usize>,
    /// Peers refused at their own limit since their count last dropped
    /// (logged once); only peers that hold connections, so it is bounded.
    refused: HashSet<Peer>,
    /// Whether a refusal at the node's limit was logged since a
    /// connection last closed.
    refused_total: bool,
}

/// The open connections of every listener.
#[derive(Debug)]
pub struct Connections {
    host: Arc<dyn Host>,
    open: Mutex<Open>,
}

impl Connections {
    pub fn new(host: Arc<dyn Host>) -> Arc<Self> {
        Arc::new(Self {
            host,
            open: Mutex::new(Open::default()),
        })
    }

    fn lock(&self) -> parking_lot::MutexGuard<'_, Open> {
        self.open.lock()
    }

    /// A slot for a new connection of `peer`, or `None` (logged and
    /// counted) when it would go over a limit.
    pub fn admit(self: &Arc<Self>, peer: Peer) -> Option<Slot> {
        let (max, per_peer) = self.host.limits();
        let mut open = self.lock();
        let held = open.by_peer.get(&peer).copied().unwrap_or(0);
        let over = if open.total >= max {
            let first = !std::mem::replace(&mut open.refused_total, true);
            Some(("total", format!("{max} connections are open"), first))
        } else if matches!(peer, Peer::Ip(_)) && held >= per_peer {
            let first = open.refused.insert(peer);
            Some(("peer", format!("{peer} has {held} open"), first))
        } else {
            None
        };
        if let Some((limit, why, first)) = over {
            drop(open);
            self.host.metrics().connection_refused(limit);
            if first {
                tracing::warn!(target: "audit", %peer, limit, "connection refused: {why}; further refusals like it are counted, not logged, until a connection closes");
            }
            return None;
        }
        open.total += 1;
        *open.by_peer.entry(peer).or_default() += 1;
        drop(open);
        self.host.metrics().connection_opened(peer.transport());
        Some(Slot {
            connections: self.clone(),
            peer,
        })
    }

    /// The TCP connections accepted on `listener` that `handshake` turns
    /// into a stream within `HANDSHAKE`; the others are logged (as
    /// `refusal`, with the peer and the reason) and closed.
    pub fn tcp<T, F, H>(
        self: Arc<Self>,
        listener: TcpListener,
        refusal: &'static str,
        handshake: H,
    ) -> ReceiverStream<io::Result<Counted<T>>>
    where
        T: Send + 'static,
        F: Future<Output = io::Result<T>> + Send + 'static,
        H: Fn(TcpStream) -> F + Send + 'static,
    {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        tokio::spawn(async move {
            loop {
                let (tcp, addr) = match listener.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of descriptors, most likely: wait for some.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                if tx.is_closed() {
                    return;
                }
                let Some(slot) = self.admit(Peer::Ip(addr.ip())) else {
                    continue;
                };
                let _ = tcp.set_nodelay(true);
                let shaking = handshake(tcp);
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE, shaking).await {
                        Ok(Ok(io)) => {
                            let _ = tx.send(Ok(Counted { io, _slot: slot })).await;
                        }
                        Ok(Err(e)) => refused(refusal, addr, &e.to_string()),
                        Err(_) => refused(refusal, addr, "the handshake took longer than 10 s"),
                    }
                });
            }
        });
        ReceiverStream::new(rx)
    }
}

fn refused(refusal: &str, peer: SocketAddr, reason: &str) {
    tracing::warn!(target: "audit", %peer, reason, "{refusal}");
}

/// A plaintext TCP connection, once its peer has sent the 24 bytes of
/// HTTP/2's connection preface (h2 checks them; a client that stalls
/// inside them is polled every 10 ms until `HANDSHAKE` runs out).
pub async fn preface(tcp: TcpStream) -> io::Result<TcpStream> {
    let mut buf = [0u8; 24];
    loop {
        match tcp.peek(&mut buf).await? {
            0 => {
                return Err(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "closed before sending its preface",
                ));
            }
            24 => return Ok(tcp),
            _ => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// One open connection's place in the count, given back when dropped.
#[derive(Debug)]
pub struct Slot {
    connections: Arc<Connections>,
    peer: Peer,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut open = self.connections.lock();
        open.total -= 1;
        if let Some(n) = open.by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                open.by_peer.remove(&self.peer);
            }
        }
        open.refused.remove(&self.peer);
        open.refused_total = false;
        drop(open);
        let metrics = self.connections.host.metrics();
        metrics.connection_closed(self.peer.transport());
    }
}

/// A connection holding its slot: reads and writes go to `io`; the slot
/// is given back when the server drops the connection.
#[derive(Debug)]
pub struct Counted<S> {
    io: S,
    _slot: Slot,
}

impl<S> Counted<S> {
    pub fn new(io: S, slot: Slot) -> Self {
        Self { io, _slot: slot }
    }
}

impl<S: Connected> Connected for Counted<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io.connect_info()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Counted<S> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Counted<S> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}
