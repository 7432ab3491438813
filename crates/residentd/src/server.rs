//! Serving the API: on every address of `listen` (Unix sockets, TCP with
//! mutual TLS through `tls.rs`, or plain TCP), grpc.health.v1, server
//! reflection, every service behind the access layer (`access.rs`), every
//! connection within the limits of `connections.rs` and pinged by HTTP/2
//! keepalive, and the orderly shutdown on SIGTERM/SIGINT. Every listening
//! socket is kept for an upgrade (`upgrade.rs`; SIGUSR2 starts one), and
//! taken from the agent this one replaces when it was started by one.

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
use crate::tls::TlsServer;

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
    /// The metrics endpoint's address (`metrics_listen`).
    Metrics(tokio::net::TcpListener, SocketAddr),
}

/// Binds every address of `listen` and `metrics_listen`, or takes the
/// sockets the agent this one replaces handed over (an upgrade). Done
/// before the journal is restored, so a second agent started on a node
/// that runs one stops here, before it touches the first one's instances
/// or journal. Each socket is kept for a later upgrade.
pub async fn bind(config: &resident_config::Config) -> anyhow::Result<Vec<Bound>> {
    let mut inherited = crate::upgrade::Inherited::from_env();
    if !inherited.is_empty() {
        tracing::info!("taking the listening sockets over from the agent this one replaces");
    }
    let tcp = |fd: std::os::fd::OwnedFd| -> std::io::Result<tokio::net::TcpListener> {
        let std = std::net::TcpListener::from(fd);
        std.set_nonblocking(true)?;
        tokio::net::TcpListener::from_std(std)
    };
    let bind_tcp =
        async |kind: &str, addr: &SocketAddr, inherited: &mut crate::upgrade::Inherited| {
            let key = crate::upgrade::key_tcp(kind, addr);
            let listener = match inherited.take(&key) {
                Some(fd) => tcp(fd).with_context(|| format!("the inherited socket of {addr}"))?,
                None => tokio::net::TcpListener::bind(addr)
                    .await
                    .with_context(|| format!("cannot listen on {addr}"))?,
            };
            crate::upgrade::keep_listener(key, std::os::fd::AsFd::as_fd(&listener))?;
            Ok::<_, anyhow::Error>(listener)
        };
    let mut out = Vec::new();
    for listen in &config.node.listen {
        out.push(match listen {
            Listen::Unix(path) => {
                let key = crate::upgrade::key_unix(path);
                let listener = match inherited.take(&key) {
                    Some(fd) => {
                        let std = std::os::unix::net::UnixListener::from(fd);
                        std.set_nonblocking(true)?;
                        UnixListener::from_std(std)
                            .with_context(|| format!("the inherited socket {}", path.display()))?
                    }
                    None => bind_unix(path, config.node.socket_group.as_ref())?,
                };
                crate::upgrade::keep_listener(key, std::os::fd::AsFd::as_fd(&listener))?;
                Bound::Unix(listener, path.clone())
            }
            Listen::Tcp(addr) => Bound::Tcp(bind_tcp("api", addr, &mut inherited).await?, *addr),
        });
    }
    if let Some(addr) = config.node.metrics_listen {
        out.push(Bound::Metrics(
            bind_tcp("metrics", &addr, &mut inherited).await?,
            addr,
        ));
    }
    Ok(out)
}

/// Binds the Unix socket at `path`: makes its directory where missing
/// (mode 0700, or 0750 and the socket's group with `group`, so that the
/// group reaches the socket) and refuses one that is not the agent's own
/// or that its group or others can write (`private_dir`); removes a stale
/// socket left by a dead agent (only a socket: anything else at the path
/// is an error), refuses to steal a live one, and sets the mode to 0660.
pub fn bind_unix(path: &Path, group: Option<&(String, u32)>) -> anyhow::Result<UnixListener> {
    use std::os::unix::fs::FileTypeExt as _;
    let dir = resident_config::private_dir::socket_dir(path);
    let euid = nix::unistd::geteuid().as_raw();
    let made = !dir.exists();
    let mode = if group.is_some() { 0o750 } else { 0o700 };
    resident_config::private_dir::ensure(&dir, mode, euid)
        .map_err(|why| anyhow::anyhow!("the socket's directory: {why}"))?;
    if made && let Some((name, gid)) = group {
        std::os::unix::fs::chown(&dir, None, Some(*gid))
            .with_context(|| format!("giving {} to group {name}", dir.display()))?;
    }
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            bail!(
                "{} exists and is not a socket: remove it, or listen elsewhere",
                path.display()
            );
        }
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
pub async fn serve(
    agent: Arc<Agent>,
    listeners: Vec<Bound>,
    tls: Option<Arc<TlsServer>>,
) -> anyhow::Result<()> {
    let config = agent.config();
    if let Some(tls) = &tls {
        follow_certificates(tls, &agent);
    }
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
    let usr2 = signal(SignalKind::user_defined2()).context("watching SIGUSR2")?;
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
    tokio::spawn(upgrade_on_sigusr2(agent.clone(), usr2));
    // Each listener is served by a clone of the router; all stop together:
    // at shutdown, or once an upgrade hands everything over (the sockets
    // stay open for the next agent; what arrives waits in their backlog).
    let (stopping_tx, stopping) = tokio::sync::watch::channel(false);
    let handing_over = agent.handing_over();
    tokio::spawn(async move {
        tokio::select! {
            _ = stop_rx => {}
            () = handing_over => {}
        }
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
        if let Bound::Metrics(listener, addr) = bound {
            let weak = Arc::downgrade(&agent);
            tokio::spawn(async move {
                if let Err(e) = serve_metrics(listener, addr, weak).await {
                    tracing::error!(%addr, error = %e, "the metrics endpoint stopped");
                }
            });
            continue;
        }
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
            Bound::Metrics(..) => {}
            Bound::Tcp(listener, addr) => match tls.clone() {
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
    crate::upgrade::report_ready();
    let all = async {
        while let Some(done) = servers.join_next().await {
            done.context("a listener's task")??;
        }
        Ok::<(), anyhow::Error>(())
    };
    let upgraded = {
        let upgraded = agent.upgraded();
        async move {
            upgraded.await;
            tokio::time::sleep(DRAIN).await;
        }
    };
    tokio::select! {
        result = all => result?,
        () = drain_bound => {}
        () = upgraded => {
            // The next agent serves on the same sockets and runs every
            // instance: nothing of theirs is undone here.
            tracing::warn!("connections still open {DRAIN:?} after the upgrade; exiting anyway");
            return Ok(());
        }
    }
    if agent.upgrading() {
        // The calls in flight have been answered; the next agent serves.
        agent.upgraded().await;
        tracing::info!("handed over to the upgraded agent; exiting");
        return Ok(());
    }
    for path in sockets {
        let _ = std::fs::remove_file(path);
    }
    tracing::info!("stopped");
    Ok(())
}

/// SIGUSR2 upgrades the agent to the binary now at its path (as the
/// `Upgrade` RPC does); the outcome is logged.
async fn upgrade_on_sigusr2(agent: Arc<Agent>, mut usr2: Signal) {
    while usr2.recv().await.is_some() {
        match agent.clone().upgrade().await {
            Ok(r) => {
                tracing::info!(old = %r.old_version, new = %r.new_version, "upgraded (SIGUSR2)")
            }
            Err(e) => tracing::error!(error = %e, "the upgrade (SIGUSR2) did not happen"),
        }
    }
}

/// SIGHUP re-reads the configuration; a bad file is logged and ignored.
/// The TLS listeners follow reloads of the agent's config: new
/// certificates (the files were checked with the rest of the config) for
/// new connections; a reload whose files cannot be used is refused,
/// naming `node.tls`.
fn follow_certificates(tls: &Arc<TlsServer>, agent: &Agent) {
    let tls = tls.clone();
    agent.on_reload(Box::new(move |old, new| {
        let Some(files) = &new.node.tls else {
            return Ok(());
        };
        if old.node.tls.as_ref() == Some(files) {
            return Ok(());
        }
        tls.reload(files).map_err(|e| {
            resident_config::ConfigError::of_file(
                &new.source,
                "node.tls",
                format!("the TLS files cannot be used: {e}"),
            )
        })?;
        tracing::info!("TLS certificates reloaded: new connections use them");
        Ok(())
    }));
}

/// What the connections need of the agent: the limits in force (a reload
/// changes them) and where to count.
impl crate::connections::Host for Agent {
    fn limits(&self) -> (usize, usize) {
        let config = self.config();
        (
            config.node.max_connections,
            config.node.max_connections_per_peer,
        )
    }

    fn metrics(&self) -> &crate::metrics::Metrics {
        Agent::metrics(self)
    }
}

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
    let enabled = sd_notify::watchdog_enabled(false, &mut usec)
        // Started by an upgrade: the watchdog was set for the agent this
        // one replaces (WATCHDOG_PID names it), and is this one's once it
        // is the service's main process.
        || (std::env::var_os(crate::upgrade::READY_ENV).is_some()
            && std::env::var("WATCHDOG_USEC")
                .ok()
                .and_then(|v| v.parse().ok())
                .inspect(|v| usec = *v)
                .is_some());
    if !enabled || usec == 0 {
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

/// Most connections the metrics endpoint keeps open at once; one more is
/// closed at accept. A scraper needs one.
pub const METRICS_CONNECTIONS: usize = 64;

/// The longest a client of the metrics endpoint may take to send its
/// request's headers, or to begin its next one on a kept-alive
/// connection (then closed).
pub const METRICS_HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `GET /metrics` (plain HTTP/1) on `addr` until the process ends,
/// the gauges read from the agent at each scrape; within
/// [`METRICS_CONNECTIONS`] and [`METRICS_HEADER_TIMEOUT`], so that no one
/// who reaches the port can hold the agent's file descriptors.
async fn serve_metrics(
    listener: tokio::net::TcpListener,
    addr: SocketAddr,
    agent: Weak<Agent>,
) -> std::io::Result<()> {
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
    let open = Arc::new(tokio::sync::Semaphore::new(METRICS_CONNECTIONS));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(METRICS_HEADER_TIMEOUT);
    let mut warned: Option<std::time::Instant> = None;
    loop {
        let (tcp, peer) = match listener.accept().await {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(%addr, error = %e, "the metrics endpoint could not accept");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Ok(slot) = open.clone().try_acquire_owned() else {
            if warned.is_none_or(|w| w.elapsed() >= Duration::from_secs(10)) {
                warned = Some(std::time::Instant::now());
                tracing::warn!(%addr, %peer, "metrics connection closed at accept: {METRICS_CONNECTIONS} are open");
            }
            drop(tcp);
            continue;
        };
        let conn = http.serve_connection(
            hyper_util::rt::TokioIo::new(tcp),
            hyper_util::service::TowerToHyperService::new(app.clone()),
        );
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(%peer, error = %e, "a metrics connection ended");
            }
            drop(slot);
        });
    }
}
