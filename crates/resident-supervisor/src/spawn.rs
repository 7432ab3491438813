//! Starting a child: the command built from a `LaunchSpec` (argv, cleared
//! environment, own process group, parent-death signal), forked from one
//! long-lived thread, and the signals that stop its group.
//!
//! Why a thread of our own: `PR_SET_PDEATHSIG` fires when the *thread* that
//! forked the child exits, not the process. Forking from a tokio blocking
//! thread (which the pool prunes when idle) would kill healthy children. The
//! spawner thread lives as long as the agent, so the signal fires exactly
//! when the agent dies.

use std::collections::HashSet;
use std::io;
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::process::CommandExt as _;
use std::process::Stdio;
use std::sync::{Mutex, OnceLock, mpsc};

use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;
use tokio::process::{Child, Command};
use tokio::runtime::Handle;
use tokio::sync::oneshot;

use crate::spec::{LaunchSpec, Macros};

/// Variables of the agent's environment every child keeps.
const ALWAYS_PASSED: [&str; 3] = ["PATH", "HOME", "LANG"];

type Job = Box<dyn FnOnce() + Send>;

fn spawner() -> &'static Mutex<mpsc::Sender<Job>> {
    static SPAWNER: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    SPAWNER.get_or_init(|| {
        let (tx, rx) = mpsc::channel::<Job>();
        // The thread ends only with the process (the sender is static).
        let spawned = std::thread::Builder::new()
            .name("resident-spawner".into())
            .spawn(move || rx.iter().for_each(|job| job()));
        if let Err(e) = spawned {
            tracing::error!(error = %e, "cannot start the spawner thread; spawns will fail");
        }
        Mutex::new(tx)
    })
}

/// Builds the command for `spec` with `macros` applied.
pub fn command(spec: &LaunchSpec, macros: &Macros<'_>) -> io::Result<Command> {
    let Some((program, args)) = spec.argv.split_first() else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "empty command line",
        ));
    };
    let mut std_cmd = std::process::Command::new(macros.expand(program));
    std_cmd.args(args.iter().map(|a| macros.expand(a)));
    std_cmd.env_clear();
    for name in ALWAYS_PASSED
        .iter()
        .copied()
        .chain(spec.pass_env.iter().map(String::as_str))
    {
        if let Some(value) = std::env::var_os(name) {
            std_cmd.env(name, value);
        }
    }
    for (k, v) in &spec.env {
        std_cmd.env(k, macros.expand(v));
    }
    if let Some(dir) = &spec.cwd {
        std_cmd.current_dir(dir);
    }
    if let Some((uid, gid)) = spec.user {
        // std drops supplementary groups when it changes the uid.
        std_cmd.uid(uid).gid(gid);
    }
    std_cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let agent = nix::unistd::getpid();
    // SAFETY: the closure runs between fork and exec and calls only
    // async-signal-safe functions (prctl, getppid); it allocates nothing.
    unsafe {
        std_cmd.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL)?;
            // The agent may have died before prctl took effect.
            if nix::unistd::getppid() != agent {
                return Err(io::Error::other("the agent exited during spawn"));
            }
            Ok(())
        });
    }
    let mut cmd = Command::from(std_cmd);
    cmd.kill_on_drop(false);
    Ok(cmd)
}

/// Spawns `cmd` on the spawner thread, registered with the current runtime
/// (whose reaper then owns the child's exit status).
pub async fn spawn(mut cmd: Command) -> io::Result<Child> {
    let handle = Handle::current();
    let (tx, rx) = oneshot::channel();
    let job: Job = Box::new(move || {
        let _runtime = handle.enter();
        let _ = tx.send(cmd.spawn());
    });
    spawner()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .send(job)
        .map_err(|_| io::Error::other("the spawner thread is gone"))?;
    rx.await
        .map_err(|_| io::Error::other("the spawner thread dropped a spawn"))?
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
            if self
                .held
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .insert(port)
            {
                return Ok(port);
            }
        }
        Err(io::Error::new(
            io::ErrorKind::AddrInUse,
            "no free loopback port found",
        ))
    }

    /// Marks `port` free again.
    pub fn release(&self, port: u16) {
        self.held
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&port);
    }
}
