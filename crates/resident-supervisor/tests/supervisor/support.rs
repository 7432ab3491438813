//! Shared helpers for the supervisor's integration tests: a supervisor
//! with an event log, the test child, and waiting with a bound.

use std::future::Future;
use std::time::Duration;

use resident_supervisor::{
    LaunchSpec, RestartMode, RestartPolicy, State, Status, Supervisor, SupervisorConfig,
};
use tokio::sync::mpsc;
use tokio::time::{Instant, timeout};

pub const TESTCHILD: &str = env!("CARGO_BIN_EXE_resident-testchild");

/// Patience for anything that should happen "at once".
pub const PATIENCE: Duration = Duration::from_secs(10);

pub struct Harness {
    pub sup: Supervisor,
    pub events: mpsc::UnboundedReceiver<Status>,
    /// Every event received, with when it arrived.
    pub seen: Vec<(Instant, Status)>,
    /// Per instance, where in `seen` the next `until` starts looking.
    cursors: std::collections::HashMap<String, usize>,
}

impl Harness {
    pub fn new() -> Self {
        Self::with(SupervisorConfig::default())
    }

    pub fn with(config: SupervisorConfig) -> Self {
        let (tx, events) = mpsc::unbounded_channel();
        let cursors = Default::default();
        Self {
            sup: Supervisor::new(config, tx),
            events,
            seen: Vec::new(),
            cursors,
        }
    }

    /// The last `n` lines of `id`'s log, oldest first.
    pub fn lines(&self, id: &str, n: usize) -> Vec<String> {
        let logs = self.sup.logs(id).expect("a log");
        logs.tail(n).into_iter().map(|l| l.line).collect()
    }

    /// Waits (bounded) for the next event of `id` in `state` after the one
    /// the last `until` for `id` returned; returns it.
    pub async fn until(&mut self, id: &str, state: State) -> Status {
        let from = self.cursors.get(id).copied().unwrap_or(0);
        let wanted = |s: &Status| &*s.instance == id && s.state == state;
        if let Some(i) = self.seen[from..].iter().position(|(_, s)| wanted(s)) {
            self.cursors.insert(id.to_string(), from + i + 1);
            return self.seen[from + i].1.clone();
        }
        let wait = async {
            while let Some(s) = self.events.recv().await {
                self.seen.push((Instant::now(), s.clone()));
                if wanted(&s) {
                    self.cursors.insert(id.to_string(), self.seen.len());
                    return s;
                }
            }
            panic!("event channel closed before {id} reached {state}");
        };
        match timeout(PATIENCE, wait).await {
            Ok(s) => s,
            Err(_) => panic!(
                "{id} did not reach {state} within {PATIENCE:?}; saw {:?}",
                self.states(id)
            ),
        }
    }

    /// Waits for the first of several states: a test that expects EXITED
    /// sees the reason at once when it ends FAILED instead.
    pub async fn until_any(&mut self, id: &str, states: &[State]) -> Status {
        let wait = async {
            loop {
                if let Some((_, s)) = self
                    .seen
                    .iter()
                    .find(|(_, s)| &*s.instance == id && states.contains(&s.state))
                {
                    return s.clone();
                }
                match self.events.recv().await {
                    Some(s) => self.seen.push((Instant::now(), s)),
                    None => panic!("event channel closed before {id} reached {states:?}"),
                }
            }
        };
        match timeout(PATIENCE, wait).await {
            Ok(s) => s,
            Err(_) => panic!(
                "{id} did not reach {states:?} within {PATIENCE:?}; saw {:?}",
                self.states(id)
            ),
        }
    }

    /// The states `id` went through so far, in order.
    pub fn states(&self, id: &str) -> Vec<State> {
        self.seen
            .iter()
            .filter(|(_, s)| &*s.instance == id)
            .map(|(_, s)| s.state)
            .collect()
    }
}

/// A spec running the test child with `steps`, never restarted.
pub fn child(id: &str, steps: &[&str]) -> LaunchSpec {
    let mut argv = vec![TESTCHILD.to_string()];
    argv.extend(steps.iter().map(|s| s.to_string()));
    let mut spec = LaunchSpec::new(id, argv);
    spec.restart = RestartPolicy {
        mode: RestartMode::Never,
        ..RestartPolicy::default()
    };
    spec.stop_grace = Duration::from_secs(5);
    spec
}

/// The size of process `pid`'s descriptor table (`FDSize` in its
/// status).
pub fn fd_table_size(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("a status");
    let line = status.lines().find_map(|l| l.strip_prefix("FDSize:"));
    line.and_then(|n| n.trim().parse().ok()).expect("FDSize")
}

/// Polls `check` until it holds or `bound` passes; returns whether it held.
pub async fn eventually<F, Fut>(bound: Duration, mut check: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + bound;
    let mut pause = Duration::from_millis(2);
    loop {
        if check().await {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 2).min(Duration::from_millis(50));
    }
}

/// A process the test started, SIGKILLed (with its process group, when
/// it leads one and runs) and reaped when the test ends, passed or failed.
pub struct Killed(pub std::process::Child);

impl std::ops::Deref for Killed {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for Killed {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let pid = i32::try_from(self.0.id()).expect("a pid");
        let running = matches!(self.0.try_wait(), Ok(None));
        let leads = resident_supervisor::procfs::stat(pid).is_some_and(|s| s.pgrp == pid);
        if running && leads {
            let group = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `resident-supervise` (an agent the test can kill -9) on
/// `command`; returns it (killed when dropped) and its child's pid once
/// the child runs.
pub fn supervise(command: &[&str]) -> (Killed, i32) {
    use std::io::BufRead as _;
    let agent = std::process::Command::new(env!("CARGO_BIN_EXE_resident-supervise"))
        .arg("--")
        .args(command)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the agent");
    let mut agent = Killed(agent);
    let mut line = String::new();
    std::io::BufReader::new(agent.stdout.take().expect("piped"))
        .read_line(&mut line)
        .expect("the agent reports its child");
    let pid = line
        .trim()
        .strip_prefix("pid=")
        .and_then(|p| p.parse().ok())
        .expect(&line);
    (agent, pid)
}

/// Whether a live (not zombie) process `pid` exists.
pub fn alive(pid: i32) -> bool {
    resident_supervisor::procfs::stat(pid).is_some_and(|s| s.state != 'Z' && s.state != 'X')
}

/// Waits (bounded) until instance `id` logs exactly `line`.
pub async fn logged_line(sup: &Supervisor, id: &str, line: &str) {
    let logs = sup.logs(id).expect("a log");
    let seen = eventually(PATIENCE, || {
        std::future::ready(logs.tail(50).iter().any(|l| l.line == line))
    })
    .await;
    assert!(seen, "{id} never logged {line:?}");
}

/// Waits (bounded) until instance `id` logs a line `KEY=N`; returns N.
pub async fn logged_number(sup: &Supervisor, id: &str, key: &str) -> i32 {
    let logs = sup.logs(id).expect("a log");
    let prefix = format!("{key}=");
    let mut found = None;
    let seen = eventually(PATIENCE, || {
        found = logs
            .tail(50)
            .iter()
            .find_map(|l| l.line.strip_prefix(&prefix)?.parse::<i32>().ok());
        std::future::ready(found.is_some())
    })
    .await;
    assert!(seen, "{id} never logged {key}=N");
    found.expect("found above")
}

/// Whether this test process can make cgroups (root, a writable
/// hierarchy). Where it cannot, says the calling test is skipped: a plain
/// user on a laptop still runs the rest of the suite.
pub fn cgroups_usable() -> bool {
    let h = resident_supervisor::cgroup::Hierarchies::of_self();
    let writable = |d: &Option<std::path::PathBuf>| {
        d.as_ref().is_some_and(|d| {
            nix::unistd::access(d.as_path(), nix::unistd::AccessFlags::W_OK).is_ok()
        })
    };
    let usable = writable(&h.v2) || writable(&h.v1_memory);
    if !usable {
        skip("no writable cgroup hierarchy here (needs root or a delegated cgroup)");
    }
    usable
}

// `skip` is shared with residentd's e2e tests: one file, included by both.
#[path = "skip.rs"]
mod skip;
pub use skip::skip;
