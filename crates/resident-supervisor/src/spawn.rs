//! Starting a child: the command prepared from a `LaunchSpec` (argv,
//! cleared environment, macros), cloned from a few long-lived threads (see
//! `child.rs` for the clone itself: own process group, parent-death
//! signal), and the signals that stop its group.
//!
//! Why threads of our own: `PR_SET_PDEATHSIG` fires when the *thread* that
//! created the child exits, not the process. Spawning from a tokio blocking
//! thread (which the pool prunes when idle) would kill healthy children. The
//! spawner threads (a few, so that spawns overlap) live as long as the
//! agent, so the signal fires exactly when the agent dies.

use std::collections::HashSet;
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::os::fd::OwnedFd;
use std::sync::{Arc, OnceLock, mpsc};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use parking_lot::Mutex;
use tokio::sync::oneshot;

use crate::child::{Child, Prepared, clone_exec};
use crate::spec::{LaunchSpec, Macros};

/// Variables of the agent's environment every child keeps.
const ALWAYS_PASSED: [&str; 3] = ["PATH", "HOME", "LANG"];

type Job = Box<dyn FnOnce() + Send>;

/// How many spawner threads share the spawns. A spawn holds its thread
/// from the clone until the child has exec'd, most of it waiting for the
/// child to be scheduled and for the exec: with several, one child's wait
/// does not hold up the next spawn (a storm of starts on a busy machine).
const SPAWNERS: usize = 4;

fn spawner() -> &'static Mutex<mpsc::Sender<Job>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        // The threads end only with the process (the sender is static).
        for n in 0..SPAWNERS {
            let rx = rx.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("resident-spawn{n}"))
                .spawn(move || {
                    // Low descriptor numbers for its children, while the
                    // table is small (a failure is tried again at a spawn).
                    if let Err(e) = crate::child::reserve_slots() {
                        tracing::warn!(error = %e, "a spawner thread has no spawn slots yet");
                    }
                    loop {
                        // One thread waits on the queue at a time; the lock
                        // is let go before the job runs.
                        let job = rx.lock().recv();
                        match job {
                            Ok(job) => job(),
                            Err(_) => return,
                        }
                    }
                });
            if let Err(e) = spawned {
                tracing::error!(error = %e, "cannot start a spawner thread");
            }
        }
        Mutex::new(tx)
    })
}

/// Prepares the command for `spec` with `macros` applied: argv, and an
/// environment of PATH, HOME, LANG and `pass_env` from the agent's, then
/// the workload's own; its stdout and stderr go to `output`.
pub fn command(
    spec: &LaunchSpec,
    macros: &Macros<'_>,
    output: [Arc<OwnedFd>; 2],
) -> io::Result<Prepared> {
    let argv: Vec<String> = spec.argv.iter().map(|a| macros.expand(a)).collect();
    let mut env: Vec<(String, String)> = Vec::new();
    for name in ALWAYS_PASSED
        .iter()
        .copied()
        .chain(spec.pass_env.iter().map(String::as_str))
    {
        if let Ok(value) = std::env::var(name) {
            env.push((name.to_string(), value));
        }
    }
    for (k, v) in &spec.env {
        env.retain(|(name, _)| name != k);
        env.push((k.clone(), macros.expand(v)));
    }
    Prepared::new(&argv, &env, spec.cwd.as_deref(), spec.user, output)
        .map(|p| p.with_groups(&spec.groups))
}

/// Starts the spawner threads now, while the agent's descriptor table is
/// small (each takes low slots for its children's descriptors as it
/// starts); the first spawn would start them otherwise.
pub fn start_spawners() {
    spawner();
}

/// Spawns on a spawner thread (which the parent-death signal is tied
/// to) and wraps the child for the current runtime.
pub async fn spawn(prepared: Prepared) -> io::Result<Child> {
    let (tx, rx) = oneshot::channel();
    let job: Job = Box::new(move || {
        let _ = tx.send(clone_exec(&prepared));
    });
    spawner()
        .lock()
        .send(job)
        .map_err(|_| io::Error::other("the spawner thread is gone"))?;
    let spawned = rx
        .await
        .map_err(|_| io::Error::other("the spawner thread dropped a spawn"))??;
    Child::new(spawned)
}

/// Sends `signal` to process group `pgid`. A group that is already gone is
/// not an error.
pub fn signal_group(pgid: i32, signal: Signal) -> io::Result<()> {
    match killpg(Pid::from_raw(pgid), signal) {
        Ok(()) | Err(nix::errno::Errno::ESRCH) => Ok(()),
        Err(e) => Err(io::Error::from(e)),
    }
}

/// Hands out loopback ports that are free now and not held by another live
/// instance of this agent.
#[derive(Debug, Default)]
pub struct Ports {
    held: Mutex<HashSet<u16>>,
}

impl Ports {
    /// A free port, marked held until `release`.
    pub fn take(&self) -> io::Result<u16> {
        for _ in 0..64 {
            let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
                .local_addr()?
                .port();
            if self.held.lock().insert(port) {
                return Ok(port);
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "no free loopback port found",
        ))
    }

    /// Marks `port` held (a process taken over already has it).
    pub fn hold(&self, port: u16) {
        self.held.lock().insert(port);
    }

    /// Marks `port` free again.
    pub fn release(&self, port: u16) {
        self.held.lock().remove(&port);
    }
}
