//! Adopted processes: servers the agent did not start (by hand, or under
//! another tool), watched without being its children. The exit is seen
//! through a pidfd, which turns readable once the process has exited (its
//! exit status goes to its own parent, not to us); the memory is sampled
//! like a child's group when the process leads its process group; the
//! readiness probe is the workload's. A process is signalled only when the
//! adoption says the agent manages it, and only through its pidfd (and its
//! group while it is alive), so a reused pid is never hit. At shutdown the
//! supervisor lets every adopted process go without a signal.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout};

use crate::instance::{Shared, StopRequest};
use crate::pidfd::Watched;
use crate::spec::LaunchSpec;
use crate::status::State;
use crate::{procfs, readiness};

/// A running process to adopt, as the caller found it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Adoption {
    /// Its pid.
    pub pid: u32,
    /// Its start time (`/proc/PID/stat`), against a reused pid.
    pub start_ticks: u64,
    /// The port its readiness probe reaches (0: none).
    pub port: u16,
    /// Whether the agent may signal it (Stop, eviction).
    pub manage: bool,
}

/// The task that watches one adopted process; the only writer of its
/// status, as `Actor` is for a child.
pub(crate) struct AdoptActor {
    pub(crate) spec: LaunchSpec,
    pub(crate) adoption: Adoption,
    pub(crate) watched: Watched,
    pub(crate) shared: Arc<Shared>,
    pub(crate) stops: mpsc::Receiver<StopRequest>,
}

impl AdoptActor {
    pub(crate) async fn run(mut self) {
        let pid = self.adoption.pid;
        let leader = procfs::stat(pid as i32).is_some_and(|s| s.pgrp == pid as i32);
        if leader {
            // Sampled as a group, like a child's run.
            self.shared.pgid.store(pid as i32, Ordering::Relaxed);
        }
        self.shared
            .transition(State::Starting, format!("adopted pid {pid}"), |s| {
                s.pid = Some(pid);
                s.started_at = Some(std::time::SystemTime::now());
            });
        let deadline = Instant::now() + self.spec.readiness_timeout;
        // Only a listener of the adopted process (its group, when it
        // leads one) counts.
        let owners: readiness::Owners = Arc::new(move || {
            if leader {
                procfs::group_members(pid as i32)
            } else {
                vec![pid as i32]
            }
        });
        let probe = readiness::wait_ready(
            &self.spec.readiness,
            self.adoption.port,
            deadline,
            None,
            Some(owners),
        );
        let ready = tokio::select! {
            req = self.stops.recv() => return self.stop(req, leader).await,
            () = self.watched.exited() => return self.exited(),
            ready = probe => ready,
        };
        if ready {
            self.shared
                .transition(State::Ready, format!("ready (adopted pid {pid})"), |_| {});
        } else if self.adoption.manage {
            let limit = self.spec.readiness_timeout;
            let how = self.terminate(self.spec.stop_grace, leader).await;
            return self.finish(State::Failed, format!("not ready within {limit:?} ({how})"));
        } else {
            let limit = self.spec.readiness_timeout;
            let reason = format!(
                "not ready within {limit:?}; adopted without manage, so left running and still watched"
            );
            self.shared.transition(State::Starting, reason, |_| {});
        }
        tokio::select! {
            req = self.stops.recv() => self.stop(req, leader).await,
            () = self.watched.exited() => self.exited(),
        }
    }

    fn exited(&self) {
        let pid = self.adoption.pid;
        self.finish(
            State::Exited,
            format!("adopted pid {pid} exited (its exit status went to its own parent)"),
        );
    }

    /// A Stop: signalled when managed; otherwise (and at shutdown) let go.
    async fn stop(&mut self, req: Option<StopRequest>, leader: bool) {
        let Some(mut req) = req else {
            return self.finish(State::Exited, "no longer watched".into());
        };
        if let Some(done) = req.hand_over.take() {
            // The next agent adopts it again; nothing is published.
            let _ = done.send(());
            return;
        }
        if req.detach || !self.adoption.manage {
            let pid = self.adoption.pid;
            let reason = format!("let go: adopted pid {pid} runs on, no longer watched");
            self.finish(State::Exited, reason);
        } else {
            let how = self.terminate(req.grace, leader).await;
            let cause = req.cause.clone().unwrap_or_else(|| "stopped".into());
            self.finish(State::Exited, format!("{cause} ({how})"));
        }
    }

    /// SIGTERM (and SIGCONT), `grace`, then SIGKILL; returns once the
    /// process has exited, saying which signal ended it.
    async fn terminate(&mut self, grace: Duration, leader: bool) -> String {
        let reason = format!("stopping: SIGTERM, SIGKILL after {grace:?}");
        self.shared.transition(State::Stopping, reason, |_| {});
        self.watched.signal(Signal::SIGTERM, leader);
        self.watched.signal(Signal::SIGCONT, leader);
        if timeout(grace, self.watched.exited()).await.is_ok() {
            return "exited after SIGTERM".into();
        }
        self.watched.signal(Signal::SIGKILL, leader);
        self.watched.exited().await;
        "killed by SIGKILL after the grace".into()
    }

    fn finish(&self, state: State, reason: String) {
        self.shared.pgid.store(0, Ordering::Relaxed);
        self.shared.transition(state, reason, |s| {
            s.pid = None;
            s.start_ticks = None;
            s.measured_bytes = 0;
            s.measured_at = None;
        });
    }
}
