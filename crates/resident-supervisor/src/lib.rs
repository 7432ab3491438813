//! The process supervisor of residentd: runs each instance as a child
//! process in its own process group, probes readiness, restarts with
//! backoff, captures logs into a bounded ring, samples the group's resident
//! memory, and stops the whole group (SIGTERM, grace, SIGKILL). It also
//! watches adopted processes that it did not start (`adopted.rs`): exit
//! through a pidfd, readiness, memory; signalled only when managed.
//!
//! Architecture invariant: the supervisor knows nothing of budgets or
//! placement; it runs what it is told and reports every transition. Each
//! child is reaped through its own pidfd by the `Child` that spawned it
//! (no `waitpid(-1)` loop; tokio never sees these children), and every
//! child is cloned from one long-lived thread so that its parent-death
//! signal fires only when the agent dies.

mod adopted;
pub mod cgroup;
mod child;
mod instance;
mod leftovers;
mod logs;
mod pidfd;
pub mod procfs;
pub mod reach;
mod readiness;
mod sampler;
mod spawn;
mod spec;
mod status;
mod supervisor;

pub use adopted::Adoption;
pub use cgroup::CgroupMode;
pub use child::resolve as find_program;
pub use leftovers::{Leftover, kill_leftovers};
pub use logs::{LogLimits, LogLine, LogRing, Stream};
pub use spec::{LaunchSpec, MACROS, Macros, Readiness, RestartMode, RestartPolicy};
pub use status::{Exit, State, Status};
pub use supervisor::{
    RunProcess, Stopping, Supervisor, SupervisorConfig, SupervisorError, TakeOver,
};
