//! The process side of an upgrade (`Upgrade`, SIGUSR2): the listeners an
//! agent hands to the next one, the next binary checked and started, and
//! the way back when it does not start.
//!
//! An upgrade, from the old agent's side (`agent/upgrade.rs` holds the
//! agent's part): the binary at the path this agent was started from is
//! checked (`--version`, `--check-config`; a binary that fails either is
//! refused and nothing changes); every instance is handed over (its
//! process left running, its output left in its named pipes, the journal
//! and the event history written); the new binary is started as a child
//! with the same arguments, given every listening socket (`RESIDENTD_INHERIT`:
//! `FD:KEY` lines, the key naming the address) and a pipe to say it serves
//! on (`RESIDENTD_UPGRADE_READY`). Connections that arrive meanwhile wait in
//! the sockets' backlogs, never refused. Once it says `ready VERSION`, the
//! old agent tells systemd the new main pid (`MAINPID=`), answers, and
//! exits without stopping anything. When it does not say so (it exited, or
//! 60 s went by), it is killed and the old agent executes its own image
//! afresh (`/proc/self/exe`) with the same listeners: it takes its
//! instances over again as after a crash, at the same pid.

use std::collections::HashMap;
use std::ffi::CString;
use std::os::fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Duration;

use nix::fcntl::{FcntlArg, FdFlag, fcntl};
use parking_lot::Mutex;
use tokio::io::AsyncBufReadExt as _;

/// Listening sockets inherited from the agent this one replaces.
pub const INHERIT_ENV: &str = "RESIDENTD_INHERIT";
/// The pipe an upgraded agent says `ready VERSION` on.
pub const READY_ENV: &str = "RESIDENTD_UPGRADE_READY";
/// How long the new binary may take to serve.
const READY_BOUND: Duration = Duration::from_secs(60);
/// How long each check of the new binary may take.
const CHECK_BOUND: Duration = Duration::from_secs(30);

/// How this agent was started: its binary's path and its arguments.
#[derive(Debug, Clone)]
struct Invocation {
    binary: PathBuf,
    args: Vec<String>,
    config: Option<PathBuf>,
}

static INVOCATION: OnceLock<Invocation> = OnceLock::new();

/// Remembers the binary's path and the arguments, at start (before the
/// file at the path can be replaced); `config`: the file given, if any.
pub fn remember_invocation(config: Option<&Path>) {
    let binary = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("/proc/self/exe"));
    let _ = INVOCATION.set(Invocation {
        binary,
        args: std::env::args().skip(1).collect(),
        config: config.map(Path::to_path_buf),
    });
}

/// The key a listening socket is handed over under.
pub fn key_unix(path: &Path) -> String {
    format!("unix:{}", path.display())
}

/// As [`key_unix`], for a TCP address (`api` or `metrics`).
pub fn key_tcp(kind: &str, addr: &std::net::SocketAddr) -> String {
    format!("{kind}:{addr}")
}

/// The listening sockets this agent would hand over: copies of each, by
/// key (close-on-exec until a hand-over clears it).
fn handed() -> &'static Mutex<Vec<(String, OwnedFd)>> {
    static HANDED: OnceLock<Mutex<Vec<(String, OwnedFd)>>> = OnceLock::new();
    HANDED.get_or_init(|| Mutex::new(Vec::new()))
}

/// Keeps a copy of listening socket `fd` under `key`, for the next agent.
pub fn keep_listener(key: String, fd: BorrowedFd<'_>) -> std::io::Result<()> {
    let copy = fd.try_clone_to_owned()?;
    handed().lock().push((key, copy));
    Ok(())
}

/// The listening sockets inherited from the agent this one replaces, by
/// key (empty when this agent was started afresh).
#[derive(Debug, Default)]
pub struct Inherited(HashMap<String, OwnedFd>);

impl Inherited {
    /// What `RESIDENTD_INHERIT` names. Each descriptor is marked
    /// close-on-exec again, so no child of this agent gets it.
    pub fn from_env() -> Self {
        let Ok(text) = std::env::var(INHERIT_ENV) else {
            return Self::default();
        };
        let mut out = HashMap::new();
        for line in text.lines() {
            let Some((fd, key)) = line.split_once(':') else {
                continue;
            };
            let Ok(fd) = fd.parse::<RawFd>() else {
                continue;
            };
            // Only a descriptor that is open here is taken.
            // SAFETY: fcntl(F_GETFD) on an integer only reads its flags.
            if fd <= 2 || unsafe { nix::libc::fcntl(fd, nix::libc::F_GETFD) } < 0 {
                continue;
            }
            // SAFETY: the agent that started this one passed `fd` open for
            // this process to own; nothing else here refers to it.
            let owned = unsafe { OwnedFd::from_raw_fd(fd) };
            let _ = fcntl(&owned, FcntlArg::F_SETFD(FdFlag::FD_CLOEXEC));
            out.insert(key.to_string(), owned);
        }
        Self(out)
    }

    /// The socket inherited under `key`, if any.
    pub fn take(&mut self, key: &str) -> Option<OwnedFd> {
        self.0.remove(key)
    }

    /// Whether nothing was inherited.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// In an agent started by an upgrade: says `ready VERSION` to the agent
/// it replaces, once it serves.
pub fn report_ready() {
    let Some(fd) = std::env::var(READY_ENV)
        .ok()
        .and_then(|v| v.parse::<RawFd>().ok())
    else {
        return;
    };
    // SAFETY: F_GETFD only reads the flags of the integer descriptor.
    if fd <= 2 || unsafe { nix::libc::fcntl(fd, nix::libc::F_GETFD) } < 0 {
        return;
    }
    // SAFETY: the old agent passed this pipe's write end for this process
    // to own; it is used once, here.
    let pipe = unsafe { OwnedFd::from_raw_fd(fd) };
    let line = format!("ready {}\n", env!("CARGO_PKG_VERSION"));
    let _ = nix::unistd::write(&pipe, line.as_bytes());
}

/// Checks the binary at this agent's path: it runs, says its version, and
/// accepts this agent's configuration file. Its version, or why not.
pub async fn check_next() -> Result<String, String> {
    let inv = INVOCATION
        .get()
        .ok_or("the agent's invocation is not known")?;
    let bin = &inv.binary;
    trusted_binary(bin)?;
    let run = |args: Vec<std::ffi::OsString>| async move {
        let out = tokio::process::Command::new(bin)
            .args(args)
            .stdin(std::process::Stdio::null())
            .kill_on_drop(true)
            .output();
        match tokio::time::timeout(CHECK_BOUND, out).await {
            Err(_) => Err(format!("did not answer within {CHECK_BOUND:?}")),
            Ok(Err(e)) => Err(e.to_string()),
            Ok(Ok(o)) if o.status.success() => Ok(String::from_utf8_lossy(&o.stdout).into_owned()),
            Ok(Ok(o)) => Err(format!(
                "{}: {}",
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            )),
        }
    };
    let version = run(vec!["--version".into()])
        .await
        .map_err(|e| format!("{} --version: {e}", bin.display()))?;
    // `residentd 0.1.0`
    let version = version
        .split_whitespace()
        .nth(1)
        .ok_or_else(|| format!("{} --version said {version:?}", bin.display()))?
        .to_string();
    if let Some(config) = &inv.config {
        run(vec!["--check-config".into(), config.clone().into()])
            .await
            .map_err(|e| format!("{} --check-config {}: {e}", bin.display(), config.display()))?;
    }
    Ok(version)
}

/// Whether the agent may execute `bin` as its next self: it must belong
/// to root or to the agent's own user, and neither its group nor others
/// may write it or its directory (unless that is sticky): a binary another
/// user can replace would run with everything the agent holds.
fn trusted_binary(bin: &std::path::Path) -> Result<(), String> {
    use std::os::unix::fs::MetadataExt as _;
    let euid = nix::unistd::geteuid().as_raw();
    let check = |path: &std::path::Path, what: &str, sticky_ok: bool| -> Result<(), String> {
        let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
        if meta.uid() != 0 && meta.uid() != euid {
            return Err(format!(
                "{what} {} belongs to uid {}, neither root nor the agent's uid {euid}: it is not run",
                path.display(),
                meta.uid()
            ));
        }
        let shared = meta.mode() & 0o022 != 0 && !(sticky_ok && meta.mode() & 0o1000 != 0);
        if shared {
            return Err(format!(
                "{what} {} can be written by its group or others (mode {:o}): it is not run",
                path.display(),
                meta.mode() & 0o7777
            ));
        }
        Ok(())
    };
    check(bin, "the new binary", false)?;
    match bin.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => check(dir, "its directory", true),
        _ => Ok(()),
    }
}

/// The `RESIDENTD_INHERIT` text naming every handed-over listener.
fn inherit_text() -> String {
    let handed = handed().lock();
    handed
        .iter()
        .map(|(key, fd)| format!("{}:{key}\n", fd.as_raw_fd()))
        .collect()
}

/// The raw numbers of the handed-over listeners.
fn handed_fds() -> Vec<RawFd> {
    let handed = handed().lock();
    handed.iter().map(|(_, fd)| fd.as_raw_fd()).collect()
}

/// A started next agent that said it serves.
#[derive(Debug)]
pub struct Next {
    /// Its pid.
    pub pid: u32,
    /// Its version.
    pub version: String,
}

/// Starts the binary at this agent's path with the same arguments, the
/// listeners and a ready pipe; returns once it says it serves, or why it
/// did not (it was killed then).
pub async fn start_next() -> Result<Next, String> {
    let inv = INVOCATION
        .get()
        .ok_or("the agent's invocation is not known")?;
    let (ready_r, ready_w) =
        nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| e.to_string())?;
    let mut keep = handed_fds();
    keep.push(ready_w.as_raw_fd());
    let mut cmd = tokio::process::Command::new(&inv.binary);
    cmd.args(&inv.args)
        .env(INHERIT_ENV, inherit_text())
        .env(READY_ENV, ready_w.as_raw_fd().to_string())
        .stdin(std::process::Stdio::null());
    // SAFETY: between fork and exec the closure only calls fcntl, which is
    // async-signal-safe, on descriptor numbers copied beforehand.
    unsafe {
        cmd.pre_exec(move || {
            for fd in &keep {
                if nix::libc::fcntl(*fd, nix::libc::F_SETFD, 0) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
    let mut child = cmd
        .spawn()
        .map_err(|e| format!("{}: {e}", inv.binary.display()))?;
    drop(ready_w);
    let pid = child.id().unwrap_or(0);
    let ready = async {
        let pipe = tokio::net::unix::pipe::Receiver::from_owned_fd(ready_r).map_err(|_| ())?;
        let mut line = String::new();
        tokio::io::BufReader::new(pipe)
            .read_line(&mut line)
            .await
            .map_err(|_| ())?;
        match line.trim().strip_prefix("ready ") {
            Some(v) => Ok(v.to_string()),
            None => Err(()),
        }
    };
    let exited = |status: std::io::Result<std::process::ExitStatus>| match status {
        Ok(s) => format!("it exited ({s}) before it served"),
        Err(e) => format!("cannot wait for it: {e}"),
    };
    let outcome = tokio::select! {
        said = tokio::time::timeout(READY_BOUND, ready) => match said {
            Ok(Ok(version)) => return Ok(Next { pid, version }),
            // Its end of the pipe closed: it exited, most likely.
            Ok(Err(())) => match tokio::time::timeout(Duration::from_secs(2), child.wait()).await {
                Ok(status) => exited(status),
                Err(_) => "it closed its ready pipe without saying it serves".to_string(),
            },
            Err(_) => format!("it did not serve within {READY_BOUND:?}"),
        },
        status = child.wait() => exited(status),
    };
    let _ = child.kill().await;
    Err(format!("{} (pid {pid}): {outcome}", inv.binary.display()))
}

/// Executes this agent's own image afresh (`/proc/self/exe`: the binary it
/// was started from, even if the file at its path was replaced), with the
/// same arguments and the listeners; returns only when that fails.
pub fn reexec_self() -> std::io::Error {
    let Some(inv) = INVOCATION.get() else {
        return std::io::Error::other("the agent's invocation is not known");
    };
    for fd in handed_fds() {
        // SAFETY: clears the flags of a descriptor this process owns.
        unsafe { nix::libc::fcntl(fd, nix::libc::F_SETFD, 0) };
    }
    let c = |s: &str| CString::new(s).unwrap_or_default();
    let mut argv = vec![c(&inv.binary.to_string_lossy())];
    argv.extend(inv.args.iter().map(|a| c(a)));
    let mut env: Vec<CString> = std::env::vars()
        .filter(|(k, _)| k != INHERIT_ENV && k != READY_ENV)
        .map(|(k, v)| c(&format!("{k}={v}")))
        .collect();
    env.push(c(&format!("{INHERIT_ENV}={}", inherit_text())));
    match nix::unistd::execve(&c("/proc/self/exe"), &argv, &env) {
        Err(e) => std::io::Error::from(e),
        Ok(never) => match never {},
    }
}

/// Tells systemd (when it runs this agent) that `pid` is the service's
/// main process from now on.
pub fn hand_main_pid(pid: u32) {
    if std::env::var_os("NOTIFY_SOCKET").is_some() {
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::MainPid(pid)]);
    }
}
