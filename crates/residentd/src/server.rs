//! Serving the API: on every address of `listen` (Unix sockets, TCP with
//! mutual TLS through `tls.rs`, or plain TCP), grpc.health.v1, server
//! reflection, every service behind the access layer (`access.rs`), every
//! connection within the limits of `connections.rs` and pinged by HTTP/2
//! keepalive, and the orderly shutdown on SIGTERM/SIGINT.

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::sync::{Arc, Weak};
use std::time::Duration;

use anyhow::{Context as _, bail};
use resident_api::pb::node_agent_server::NodeAgentServer;
use resident_config::Listen;
use tokio::net::UnixListener;
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::UnixListenerStream;
use tonic::transport::Server;
use tonic_health::ServingStatus;

use crate::agent::Agent;
use crate::authority::AuthorityFix;
use crate::connections::{Connections, Counted, Peer};
use crate::service::Service;

/// How long open connections may take to close once every child is gone.
const DRAIN: Duration = Duration::from_secs(3);

/// Largest request or response message, in bytes.
const MAX_MESSAGE: usize = 4 << 20;

/// Most concurrent streams (calls) on one client connection.
const MAX_STREAMS: u32 = 256;

/// A listener bound before the agent restores anything.
#[derive(Debug)]
pub enum Bound {
    /// A Unix socket, and its path (removed at exit).
    Unix(UnixListener, std::path::PathBuf),
    /// A TCP address.
    Tcp(tokio::net::TcpListener, SocketAddr),
}

/// Binds every address of `listen`. Done before the journal is restored,
/// so a second agent started on a node that runs one stops here, before
/// it touches the first one's instances or journal.
pub async fn bind(config: &resident_config::Config) -> anyhow::Result<Vec<Bound>> {
    let mut out = Vec::new();
    for listen in &config.node.listen {
        out.push(match listen {
            Listen::Unix(path) => Bound::Unix(
                bind_unix(path, config.node.socket_group.as_ref())?,
                path.clone(),
            ),
            Listen::Tcp(addr) => Bound::Tcp(
                tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot listen on {addr}"))?,
                *addr,
            ),
        });
    }
    Ok(out)
}

/// Binds the Unix socket at `path`: creates the directory, removes a stale
/// socket left by a dead agent, refuses to steal a live one, and sets the
/// mode to 0660.
pub fn bind_unix(path: &Path, group: Option<&(String, u32)>) -> anyhow::Result<UnixListener> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    if path.exists() {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            bail!("{} is in use by a running agent", path.display());
        }
        std::fs::remove_file(path)
            .with_context(|| format!("removing stale socket {}", path.display()))?;
        tracing::info!(socket = %path.display(), "removed a stale socket");
    }
    let listener =
        UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o660))
        .with_context(|| format!("setting the mode of {}", path.display()))?;
    if let Some((name, gid)) = group {
        std::os::unix::fs::chown(path, None, Some(*gid))
            .with_context(|| format!("giving {} to group {name}", path.display()))?;
    }
    Ok(listener)
}

/// Serves until SIGTERM or SIGINT, then drains: health NOT_SERVING, new
/// starts refused, every child stopped, and returns.
pub async fn serve(agent: Arc<Agent>, listeners: Vec<Bound>) -> anyhow::Result<()> {
    let config = agent.config();
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<NodeAgentServer<Service>>().await;
    health.set_service_status("", ServingStatus::Serving).await;
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(resident_api::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(resident_api::pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;
    let service = NodeAgentServer::new(Service::new(agent.clone()))
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE);
    let builder = Server::builder()
        .max_concurrent_streams(MAX_STREAMS)
        // A peer that stops answering (gone, or a connection that never
        // reads) is found by HTTP/2 pings and dropped, with its streams.
        .http2_keepalive_interval(Some(config.node.keepalive_interval))
        .http2_keepalive_timeout(Some(config.node.keepalive_timeout))
        // The authority layer cuts the header blocks it re-encodes to
        // this size; it is h2's default, stated so it cannot drift.
        .max_frame_size(u32::try_from(crate::authority::MAX_FRAME).ok());
    // Every call, to every service, is checked against the caller's role.
    let mut builder = builder.layer(crate::access::AccessLayer::new(agent.clone()));
    let router = builder
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(service);

    // Signal handlers are installed before the socket exists, so a signal
    // sent as soon as the agent answers is never met by the default action.
    let term = signal(SignalKind::terminate()).context("watching SIGTERM")?;
    let int = signal(SignalKind::interrupt()).context("watching SIGINT")?;
    let hup = signal(SignalKind::hangup()).context("watching SIGHUP")?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let (drained_tx, drained_rx) = tokio::sync::oneshot::channel::<()>();
    let drained = {
        let agent = agent.clone();
        let health = health.clone();
        async move {
            wait_for_signal(term, int).await;
            tracing::info!("shutting down: refusing new starts, stopping every instance");
            let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
            health.set_not_serving::<NodeAgentServer<Service>>().await;
            health
                .set_service_status("", ServingStatus::NotServing)
                .await;
            agent.shutdown().await;
            let _ = stop_tx.send(());
            // Connections get this long to finish after the children are
            // gone; a client that never hangs up does not keep us alive.
            tokio::time::sleep(DRAIN).await;
            let _ = drained_tx.send(());
        }
    };
    tokio::spawn(drained);
    tokio::spawn(reload_on_sighup(agent.clone(), hup));
    if let Some(addr) = config.node.metrics_listen {
        let weak = Arc::downgrade(&agent);
        tokio::spawn(async move {
            if let Err(e) = serve_metrics(addr, weak).await {
                tracing::error!(%addr, error = %e, "the metrics endpoint stopped");
            }
        });
    }
    // Each listener is served by a clone of the router; all stop together.
    let (stopping_tx, stopping) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        let _ = stop_rx.await;
        let _ = stopping_tx.send(true);
    });
    let drain_bound = async {
        let _ = drained_rx.await;
        tracing::warn!("connections still open after {DRAIN:?}; exiting anyway");
    };
    start_watchdog();
    let mut servers = tokio::task::JoinSet::new();
    let mut sockets = Vec::new();
    // Every listener's connections count against the same limits.
    let connections = Connections::new(agent.clone());
    for bound in listeners {
        let router = router.clone();
        let mut stopping = stopping.clone();
        let shutdown = async move {
            let _ = stopping.wait_for(|s| *s).await;
        };
        match bound {
            Bound::Unix(listener, path) => {
                tracing::info!(socket = %path.display(), node = %config.node.name, "serving");
                sockets.push(path);
                // Stock gRPC clients send the socket path as :authority;
                // each connection goes through the layer that makes it one
                // h2 takes.
                let connections = connections.clone();
                let incoming = UnixListenerStream::new(listener).filter_map(move |conn| {
                    let conn = match conn {
                        Ok(conn) => conn,
                        Err(e) => return Some(Err(e)),
                    };
                    // For the log and the count: the caller's uid (u32::MAX
                    // when its credentials cannot be read).
                    let uid = conn.peer_cred().map_or(u32::MAX, |c| c.uid());
                    let slot = connections.admit(Peer::Uid(uid))?;
                    Some(Ok(Counted::new(AuthorityFix::new(conn), slot)))
                });
                servers.spawn(router.serve_with_incoming_shutdown(incoming, shutdown));
            }
            Bound::Tcp(listener, addr) => match agent.tls() {
                Some(tls) => {
                    tracing::info!(%addr, node = %config.node.name, "serving TCP with mutual TLS");
                    let incoming = tls.incoming(listener, connections.clone());
                    servers.spawn(router.serve_with_incoming_shutdown(incoming, shutdown));
                }
                None => {
                    tracing::warn!(%addr, "serving plaintext TCP (insecure = true)");
                    let incoming = connections.clone().tcp(
                        listener,
                        "plaintext connection refused",
                        crate::connections::preface,
                    );
                    servers.spawn(router.serve_with_incoming_shutdown(incoming, shutdown));
                }
            },
        }
    }
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);
    let all = async {
        while let Some(done) = servers.join_next().await {
            done.context("a listener's task")??;
        }
        Ok::<(), anyhow::Error>(())
    };
    tokio::select! {
        result = all => result?,
        () = drain_bound => {}
    }
    for path in sockets {
        let _ = std::fs::remove_file(path);
    }
    tracing::info!("stopped");
    Ok(())
}

/// SIGHUP re-reads the configuration; a bad file is logged and ignored.
async fn reload_on_sighup(agent: Arc<Agent>, mut hup: Signal) {
    while hup.recv().await.is_some() {
        let me = agent.clone();
        let reloaded = tokio::task::spawn_blocking(move || me.reload()).await;
        match reloaded {
            Ok(Ok(_warnings)) => {
                tracing::info!(target: "audit", rpc = "Reload", caller = "SIGHUP", outcome = "ok", reason = "", "audit");
                tracing::info!(config = %agent.config().source.display(), "configuration reloaded")
            }
            Ok(Err(e)) => {
                let reason = e.to_string();
                tracing::info!(target: "audit", rpc = "Reload", caller = "SIGHUP", outcome = "refused", reason, "audit");
                tracing::error!(error = %e, "configuration reload refused; the previous one stays in force")
            }
            Err(e) => tracing::error!(error = %e, "the reload task failed"),
        }
    }
}

async fn wait_for_signal(mut term: Signal, mut int: Signal) {
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

/// Pets systemd's watchdog at half its interval, when it is enabled.
fn start_watchdog() {
    let mut usec = 0;
    if !sd_notify::watchdog_enabled(false, &mut usec) || usec == 0 {
        return;
    }
    let every = Duration::from_micros(usec / 2);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        loop {
            tick.tick().await;
            let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Watchdog]);
        }
    });
}

/// Serves `GET /metrics` (plain HTTP) on `addr` until the process ends,
/// the gauges read from the agent at each scrape.
async fn serve_metrics(addr: SocketAddr, agent: Weak<Agent>) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving metrics");
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let agent = agent.clone();
            async move {
                let body = agent
                    .upgrade()
                    .map(|a| a.metrics().render(&a.pools(), &a.list()))
                    .unwrap_or_default();
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    body,
                )
            }
        }),
    );
    axum::serve(listener, app).await
}
