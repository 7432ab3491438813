//! Adopted processes: servers the agent did not start (by hand, or under
//! another tool), watched without being its children. The exit is seen
//! through a pidfd, which turns readable once the process has exited (its
//! exit status goes to its own parent, not to us); the memory is sampled
//! like a child's group when the process leads its process group; the
//! readiness probe is the workload's. A process is signalled only when the
//! adoption says the agent manages it, and only through its pidfd (and its
//! group while it is alive), so a reused pid is never hit. At shutdown the
//! supervisor lets every adopted process go without a signal.

use std::io;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use nix::libc;
use nix::sys::signal::Signal;
use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout};

use crate::instance::{Shared, StopRequest};
use crate::spawn::signal_group;
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

/// A pidfd on a process that is not our child.
#[derive(Debug)]
pub(crate) struct Watched {
    pid: i32,
    pidfd: AsyncFd<OwnedFd>,
}

impl Watched {
    /// Opens a pidfd on `pid` and checks, after opening it, that the
    /// process still has `start_ticks`: the pidfd then names that process
    /// for good.
    pub(crate) fn open(pid: u32, start_ticks: u64) -> io::Result<Self> {
        let pid = i32::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the syscall just returned this fd, owned by nobody else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as RawFd) };
        match procfs::stat(pid) {
            Some(s) if s.start_ticks == start_ticks && s.state != 'Z' => {}
            _ => {
                return Err(io::Error::other(format!(
                    "pid {pid} is no longer the process that was found (it exited or its pid was reused)"
                )));
            }
        }
        // SAFETY: an OwnedFd keeps the same descriptor open for as long as
        // the AsyncFd owns it.
        let pidfd = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
            .map_err(|e| e.into_parts().1)?;
        Ok(Self { pid, pidfd })
    }

    /// Resolves once the process has exited.
    pub(crate) async fn exited(&self) {
        // A pidfd is readable from the moment its process exits, and stays
        // so; an error to wait on it would be a kernel without pidfd poll
        // support, which pidfd_open already ruled out.
        let _ = self.pidfd.readable().await;
    }

    /// Whether it has exited (without waiting).
    fn is_gone(&self) -> bool {
        let mut poll = libc::pollfd {
            fd: self.pidfd.get_ref().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, a zero timeout.
        let n = unsafe { libc::poll(&mut poll, 1, 0) };
        n > 0 && poll.revents & libc::POLLIN != 0
    }

    /// Sends `signal` to the process through its pidfd, and to its group
    /// when it leads one and is still alive.
    fn signal(&self, signal: Signal, leader: bool) {
        let fd = self.pidfd.get_ref().as_raw_fd();
        // SAFETY: a valid pidfd, a signal number, no siginfo, no flags.
        let _ = unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd,
                signal as libc::c_int,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
        if leader && !self.is_gone() {
            let _ = signal_group(self.pid, signal);
        }
    }
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
