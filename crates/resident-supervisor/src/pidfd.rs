//! A pidfd on a process that is not the agent's child (an adopted server,
//! or one an earlier agent started): its exit seen when the pidfd turns
//! readable, its signals sent through the pidfd so a reused pid is never
//! hit. A leaf: the adopted and taken-over actors both use it.

use std::io;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd};

use nix::libc;
use nix::sys::signal::Signal;
use tokio::io::unix::AsyncFd;

use crate::procfs;
use crate::spawn::signal_group;

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
    pub(crate) fn is_gone(&self) -> bool {
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
    pub(crate) fn signal(&self, signal: Signal, leader: bool) {
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
