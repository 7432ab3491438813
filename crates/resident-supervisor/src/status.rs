//! The observable side of an instance: its state, exit and the status that
//! every transition publishes.

use std::fmt;
use std::os::unix::process::ExitStatusExt as _;
use std::process::ExitStatus;
use std::sync::Arc;

/// Lifecycle states. PENDING -> STARTING -> READY -> STOPPING -> EXITED or
/// FAILED, with BACKOFF between restarts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// Accepted, not yet spawned.
    Pending,
    /// Spawned, readiness not yet seen.
    Starting,
    /// Ready to serve.
    Ready,
    /// Exited; waiting to be restarted.
    Backoff,
    /// Being stopped.
    Stopping,
    /// Stopped or exited for good without failure.
    Exited,
    /// Gave up: failed readiness, crashed with no restart left, or could
    /// not be spawned.
    Failed,
}

impl State {
    /// Whether the instance has ended for good (no process, no restart).
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Exited | Self::Failed)
    }

    /// Whether the instance still holds its reservation: everything but
    /// the terminal states (a restarting instance keeps its memory).
    pub fn holds_memory(self) -> bool {
        !self.is_terminal()
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = match self {
            Self::Pending => "PENDING",
            Self::Starting => "STARTING",
            Self::Ready => "READY",
            Self::Backoff => "BACKOFF",
            Self::Stopping => "STOPPING",
            Self::Exited => "EXITED",
            Self::Failed => "FAILED",
        };
        f.write_str(s)
    }
}

/// How a process ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// It exited with this code.
    Code(i32),
    /// A signal killed it.
    Signal(i32),
    /// It ended while no agent was its parent (taken over after the agent
    /// that started it ended): its exit status went to its new parent.
    Unknown,
}

impl Exit {
    /// Whether it was a clean exit (code 0).
    pub fn success(self) -> bool {
        self == Self::Code(0)
    }

    /// The exit as a shell would report it: the code, or 128 + signal.
    pub fn code(self) -> i32 {
        match self {
            Self::Code(c) => c,
            Self::Signal(s) => 128 + s,
            Self::Unknown => -1,
        }
    }
}

impl From<ExitStatus> for Exit {
    fn from(status: ExitStatus) -> Self {
        match (status.code(), status.signal()) {
            (Some(code), _) => Self::Code(code),
            (None, Some(signal)) => Self::Signal(signal),
            // Neither: stopped/continued statuses never reach a final wait.
            (None, None) => Self::Code(-1),
        }
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Code(c) => write!(f, "exited with code {c}"),
            Self::Signal(s) => match nix::sys::signal::Signal::try_from(*s) {
                Ok(sig) => write!(f, "killed by {sig} ({s})"),
                Err(_) => write!(f, "killed by signal {s}"),
            },
            Self::Unknown => {
                f.write_str("exited (code unknown: it was taken over from an earlier agent)")
            }
        }
    }
}

/// An instance's status; every transition publishes a copy as an event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The instance id (shared: every transition publishes a copy).
    pub instance: Arc<str>,
    /// Its workload.
    pub workload: Arc<str>,
    /// Its role.
    pub role: Arc<str>,
    /// Current state.
    pub state: State,
    /// Process id of the group leader while a process runs.
    pub pid: Option<u32>,
    /// The leader's start time in clock ticks after boot (as
    /// `/proc/PID/stat` gives it), when its spawn could tell without
    /// reading `/proc`; with `pid`.
    pub start_ticks: Option<u64>,
    /// The port assigned to `${PORT}`.
    pub port: u16,
    /// Restarts so far.
    pub restarts: u32,
    /// How the last process ended.
    pub exit: Option<Exit>,
    /// Resident bytes of the whole process group, last sample.
    pub measured_bytes: u64,
    /// When `measured_bytes` was last sampled (`None` before the first
    /// sample of this run). Updated on every sample, but watchers are
    /// woken only when the bytes change.
    pub measured_at: Option<std::time::SystemTime>,
    /// Why it is in this state, for people.
    pub reason: String,
    /// The `generation` of the spec this run was started from.
    pub generation: u64,
    /// When the current (or last) process was spawned.
    pub started_at: Option<std::time::SystemTime>,
    /// Whether the OOM killer ended the last run (in its cgroup).
    pub oom_killed: bool,
}
