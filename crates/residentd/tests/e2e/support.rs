//! What every end-to-end test shares: the real `residentd` on a temporary
//! socket with the generated client (`Daemon`), config snippets, waiting
//! with one patience (`eventually`, `until`, `Daemon::wait_state`), and
//! `skip` for a test that cannot run on this machine.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use prost::Message as _;
use resident_api::pb;
use resident_api::pb::node_agent_client::NodeAgentClient;
use tonic::transport::Channel;

pub const RESIDENTD: &str = env!("CARGO_BIN_EXE_residentd");

/// How long any test waits for something that should happen soon. A wait
/// that runs out fails the test; passing tests never wait this long.
pub const PATIENCE: Duration = Duration::from_secs(30);

/// How often a wait looks again.
const POLL: Duration = Duration::from_millis(10);

pub type Client = NodeAgentClient<Channel>;

/// The workspace root, where `examples/`, `docs/`, `tests/` and `.venv` are.
pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Polls `check` until it gives a value, for at most `PATIENCE`; `None`
/// when it never did.
pub async fn until<T>(mut check: impl AsyncFnMut() -> Option<T>) -> Option<T> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Some(v) = check().await {
            return Some(v);
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(POLL).await;
    }
}

/// Polls `check` until it holds, for at most `PATIENCE`; whether it held.
pub async fn eventually(mut check: impl AsyncFnMut() -> bool) -> bool {
    until(async || check().await.then_some(())).await.is_some()
}

// The supervisor's tests report skips the same way: one file for both.
#[path = "../../../resident-supervisor/tests/supervisor/skip.rs"]
mod skip;
pub use skip::skip;

/// The workspace's `.venv` python (scripts/test creates it), or `None`
/// after saying the test is skipped; CI installs it, so there a missing
/// venv fails instead.
pub fn venv_python(for_what: &str) -> Option<PathBuf> {
    let python = workspace().join(".venv/bin/python");
    if python.exists() {
        return Some(python);
    }
    let why = format!("no .venv for {for_what}: run scripts/test, which creates it");
    assert!(std::env::var_os("CI").is_none(), "{why}");
    skip(&why);
    None
}

pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub child: Option<Child>,
    pub client: Client,
}

/// The `[node]` table for a daemon in `dir`, then `rest` (pools, workloads).
pub fn config_text(dir: &Path, rest: &str) -> String {
    format!(
        "[node]\nname = \"test-node\"\nlisten = \"unix://{}/agent.sock\"\nstate_dir = \"{}/state\"\nsample_every = \"200ms\"\n\n{rest}",
        dir.display(),
        dir.display()
    )
}

/// Writes `dir/residentd.toml`: the test `[node]` table, then `rest` (whose
/// leading keys, before any table, are more `[node]` keys).
pub fn write_config(dir: &Path, rest: &str) {
    let text = config_text(dir, rest);
    std::fs::write(dir.join("residentd.toml"), text).expect("write the config");
}

impl Daemon {
    /// Starts residentd with `rest` after a test `[node]` table; returns once
    /// it answers.
    pub async fn start(rest: &str) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        write_config(dir.path(), rest);
        Self::start_in(dir).await
    }

    /// Starts residentd again on the config and state of `dir`.
    pub async fn start_in(dir: tempfile::TempDir) -> Self {
        Self::start_in_with(dir, |_| {}).await
    }

    /// As `start_in`, letting the test adjust the command first.
    pub async fn start_in_with(dir: tempfile::TempDir, adjust: impl FnOnce(&mut Command)) -> Self {
        Self::start_program(Path::new(RESIDENTD), dir, adjust).await
    }

    /// As `start_in_with`, running the residentd binary at `program`.
    pub async fn start_program(
        program: &Path,
        dir: tempfile::TempDir,
        adjust: impl FnOnce(&mut Command),
    ) -> Self {
        let config = dir.path().join("residentd.toml");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.path().join("residentd.log"))
            .expect("log file");
        let mut cmd = Command::new(program);
        cmd.arg("--config")
            .arg(&config)
            .env("RUST_LOG", "info,residentd=debug")
            .stdout(Stdio::null())
            .stderr(log);
        adjust(&mut cmd);
        let child = cmd.spawn().expect("start residentd");
        let socket = dir.path().join("agent.sock");
        let client = connect(&socket).await;
        Self {
            dir,
            socket,
            child: Some(child),
            client,
        }
    }

    /// Starts `workload` as `id` and returns the instance (panics if refused).
    pub async fn started(&mut self, workload: &str, id: &str) -> pb::Instance {
        let r = self.client.start(start_req(workload, id)).await;
        r.expect("the start is admitted")
            .into_inner()
            .instance
            .expect("an instance")
    }

    /// Starts `workload` as `id` and waits until it is READY (or failed);
    /// returns the instance (panics on error).
    pub async fn ready(&mut self, workload: &str, id: &str) -> pb::Instance {
        let req = pb::StartRequest {
            wait_ready: true,
            ..start_req(workload, id)
        };
        let r = self.client.start(req).await;
        r.unwrap_or_else(|e| panic!("{workload} as {id} starts: {e:?}"))
            .into_inner()
            .instance
            .expect("an instance")
    }

    /// Stops `id` with its own grace; returns the instance (panics on error).
    pub async fn stopped(&mut self, id: &str) -> pb::Instance {
        let req = pb::StopRequest {
            instance_id: id.into(),
            grace_ms: 0,
        };
        let r = self.client.stop(req).await.expect("the stop");
        r.into_inner().instance.expect("an instance")
    }

    /// A Watch from `since_revision`.
    pub async fn watch(&mut self, since_revision: u64) -> tonic::Streaming<pb::Event> {
        let req = pb::WatchRequest { since_revision };
        self.client.watch(req).await.expect("watch").into_inner()
    }

    /// One instance now.
    pub async fn get(&mut self, id: &str) -> pb::Instance {
        let req = pb::GetRequest {
            instance_id: id.into(),
        };
        self.client.get(req).await.expect("get").into_inner()
    }

    /// The node now: its pools and instances.
    pub async fn node(&mut self) -> pb::NodeStatus {
        let node = self.client.node(pb::NodeRequest {}).await;
        node.expect("node").into_inner()
    }

    /// What the first pool holds now.
    pub async fn used(&mut self) -> u64 {
        self.node().await.pools[0].used_bytes
    }

    /// Every instance now, in id order.
    pub async fn list(&mut self) -> Vec<pb::Instance> {
        let list = self.client.list(pb::ListRequest {}).await;
        list.expect("list").into_inner().instances
    }

    /// The ids of every instance, in id order.
    pub async fn ids(&mut self) -> Vec<String> {
        ids_of(&mut self.client).await
    }

    /// Starts residentd again on this daemon's config and state, after a
    /// kill -9 of the agent where it still runs (its instances run on, for
    /// the new agent to take over).
    pub async fn restart(self) -> Self {
        let mut old = self;
        // kill -9 of the agent alone, as before a restart: its instances
        // run on for the next agent (dropping it would end them too).
        if old.child.is_some() {
            old.kill();
        }
        let dir = std::mem::replace(&mut old.dir, tempfile::tempdir().expect("tempdir"));
        drop(old);
        Self::start_in(dir).await
    }

    /// Waits (bounded) until instance `id` is in `state`; returns it.
    pub async fn wait_state(&mut self, id: &str, state: pb::State) -> pb::Instance {
        let mut last = None;
        let reached = until(async || {
            let i = self.get(id).await;
            let done = i.state == state as i32;
            last = Some(i.clone());
            done.then_some(i)
        })
        .await;
        reached.unwrap_or_else(|| panic!("{id} never reached {state:?}: {last:?}"))
    }

    /// Waits until `id` is asleep, its sleep settled: SLEEPING, and no
    /// longer falling asleep or waking (which show SLEEPING too, while
    /// the books still hold both demands).
    pub async fn asleep(&mut self, id: &str) -> pb::Instance {
        let mut last = None;
        let reached = until(async || {
            let i = self.get(id).await;
            let done =
                i.state == pb::State::Sleeping as i32 && i.message.starts_with("SLEEPING: asleep");
            last = Some(i.clone());
            done.then_some(i)
        })
        .await;
        reached.unwrap_or_else(|| panic!("{id} never fell asleep: {last:?}"))
    }

    /// kill -9 of the agent; returns once it is reaped. Its instances run
    /// on (`instances_outlive_agent`, the default) for the next agent to
    /// take over, or die with it when the config turns that off.
    pub fn kill(&mut self) {
        let mut agent = self.child.take().expect("running");
        let left = kill_9(&mut agent);
        remember(&self.dir.path().join("state"), left);
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).expect("running")
    }

    /// Sends `signal` to the agent.
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        let pid = nix::unistd::Pid::from_raw(self.pid());
        nix::sys::signal::kill(pid, signal).expect("signal residentd");
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("residentd.log")).unwrap_or_default()
    }

    /// What the agent's journal on disk holds now, read as the agent reads
    /// it (changing nothing).
    pub fn journaled(&self) -> Vec<residentd::journal::Entry> {
        journaled_in(&self.dir.path().join("state"))
    }

    /// SIGTERM, then waits (bounded, without blocking the runtime, so the
    /// client's connection can close) for the exit status.
    pub async fn terminate(&mut self) -> std::process::ExitStatus {
        self.signal(nix::sys::signal::Signal::SIGTERM);
        let mut child = self.child.take().expect("running");
        let status = until(async || child.try_wait().expect("wait on residentd")).await;
        status.expect("residentd did not exit after SIGTERM")
    }
}

impl Drop for Daemon {
    /// A test that did not stop the agent itself: the agent and every
    /// instance it left (`end_agent`); else what its journal lists and
    /// what agents killed -9 before it left.
    fn drop(&mut self) {
        let state = self.dir.path().join("state");
        match self.child.take() {
            Some(mut child) => end_agent(&mut child, &state),
            None => {
                kill_journaled(&state);
                kill_remembered(&state);
            }
        }
    }
}

/// A process an agent left: pid, process group, start time (clock ticks).
type Left = (i32, i32, u64);

/// What agents killed -9 by a test (`Daemon::kill`, `restart`) left
/// running, by state directory: their children at that moment. The next
/// agent takes over those its journal lists; a run spawned but not
/// journaled yet is nobody's. Killed when the test's last Daemon on that
/// state is dropped (`kill_remembered`), never before: what the test
/// checks after a kill -9 is the agents' doing.
static LEFT: parking_lot::Mutex<Vec<(PathBuf, Vec<Left>)>> = parking_lot::Mutex::new(Vec::new());

fn remember(state: &Path, left: Vec<Left>) {
    let mut all = LEFT.lock();
    all.push((state.to_path_buf(), left));
}

/// SIGKILLs what `remember` kept for `state` that still runs (the same
/// process, by its start time): its process group where it leads one.
fn kill_remembered(state: &Path) {
    let left: Vec<Left> = {
        let mut all = LEFT.lock();
        let (mine, rest): (Vec<_>, Vec<_>) = all.drain(..).partition(|(s, _)| s == state);
        *all = rest;
        mine.into_iter().flat_map(|(_, left)| left).collect()
    };
    kill_left(&left);
}

/// SIGKILLs each of `left` that still runs: its group, when it leads one
/// other than the test's, else itself.
fn kill_left(left: &[Left]) {
    use nix::sys::signal::{Signal, kill, killpg};
    use nix::unistd::{Pid, getpgrp};
    let ours = getpgrp().as_raw();
    for &(pid, group, start) in left {
        let same =
            |p: i32| resident_supervisor::procfs::stat(p).is_some_and(|s| s.start_ticks == start);
        if group == pid && group > 1 && group != ours && same(group) {
            let _ = killpg(Pid::from_raw(group), Signal::SIGKILL);
        } else if same(pid) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        }
    }
}

/// SIGKILLs the process groups the journal in `state` lists (an agent's
/// instances, which outlive it by default).
fn kill_journaled(state: &Path) {
    if let Ok(journal) = residentd::journal::Journal::open(state) {
        residentd::journal::kill_leftovers(&journal.peek().entries);
    }
}

/// kill -9 of a running `agent`, frozen first (SIGSTOP: it spawns nothing
/// more) so that its children can be noted; returns them. Reaps it.
fn kill_9(agent: &mut Child) -> Vec<Left> {
    use nix::sys::signal::{Signal, kill};
    use nix::unistd::Pid;
    // One that exited (and was reaped: its pid may name another process
    // now) has no children to note.
    if !matches!(agent.try_wait(), Ok(None)) {
        return Vec::new();
    }
    let pid = i32::try_from(agent.id()).expect("a pid");
    let _ = kill(Pid::from_raw(pid), Signal::SIGSTOP);
    let children = resident_supervisor::procfs::scan()
        .into_iter()
        .filter(|p| p.ppid == pid)
        .map(|p| (p.pid, p.pgrp, p.start_ticks))
        .collect();
    agent.kill().expect("kill -9");
    agent.wait().expect("reaped");
    children
}

/// Ends an agent the test started and every instance it leaves running
/// (instances outlive their agent by default): its children when it is
/// killed (frozen first, `kill_9`; a run spawned but not journaled yet
/// is among them), the runs its journal in `state` lists, and what agents
/// killed -9 on that state before it left (`kill_remembered`).
pub fn end_agent(agent: &mut Child, state: &Path) {
    let children = kill_9(agent);
    kill_left(&children);
    kill_journaled(state);
    kill_remembered(state);
}

/// A process the test started, SIGKILLed and reaped when the test ends,
/// passed or failed: with its whole process group when it leads one.
pub struct Killed(pub Child);

impl std::ops::Deref for Killed {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Killed {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let pid = i32::try_from(self.0.id()).expect("a pid");
        let leads = resident_supervisor::procfs::stat(pid).is_some_and(|s| s.pgrp == pid);
        if leads && self.0.try_wait().ok().flatten().is_none() {
            let group = nix::unistd::Pid::from_raw(pid);
            let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Connects to `socket`, retrying until the agent answers (bounded).
pub async fn connect(socket: &Path) -> Client {
    let client = until(async || {
        let mut c = resident_api::connect_unix(socket).await.ok()?;
        c.node(pb::NodeRequest {}).await.ok()?;
        Some(c)
    })
    .await;
    client.unwrap_or_else(|| panic!("residentd did not answer on {}", socket.display()))
}

/// A free TCP port on 127.0.0.1 (free when asked; a test binds it soon).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

pub fn start_req(workload: &str, id: &str) -> pb::StartRequest {
    pb::StartRequest {
        workload: workload.into(),
        instance_id: id.into(),
        ..Default::default()
    }
}

/// The ids of every instance `client`'s agent lists, in id order.
pub async fn ids_of(client: &mut Client) -> Vec<String> {
    let list = client.list(pb::ListRequest {}).await.expect("list");
    let instances = list.into_inner().instances;
    instances.into_iter().map(|i| i.instance_id).collect()
}

/// A Start request of `workload` as `id` with an owner's lease of `lease_ms`.
pub fn leased(workload: &str, id: &str, lease_ms: u64) -> pb::StartRequest {
    pb::StartRequest {
        lease_ms,
        ..start_req(workload, id)
    }
}

/// The ErrorInfo and Placement in a refused start's details.
pub fn refusal_details(status: &tonic::Status) -> (tonic_types::pb::ErrorInfo, pb::Placement) {
    let rpc = tonic_types::pb::Status::decode(status.details()).expect("google.rpc.Status details");
    let mut info = None;
    let mut placement = None;
    for any in rpc.details {
        match any.type_url.as_str() {
            "type.googleapis.com/google.rpc.ErrorInfo" => {
                info = Some(
                    tonic_types::pb::ErrorInfo::decode(any.value.as_slice()).expect("ErrorInfo"),
                );
            }
            "type.googleapis.com/resident.v1.Placement" => {
                placement = Some(pb::Placement::decode(any.value.as_slice()).expect("Placement"));
            }
            _ => {}
        }
    }
    (info.expect("an ErrorInfo"), placement.expect("a Placement"))
}

/// Whether a live (not zombie) process `pid` exists.
pub fn alive(pid: i32) -> bool {
    resident_supervisor::procfs::stat(pid).is_some_and(|s| s.state != 'Z' && s.state != 'X')
}

/// A pool `name` with `budget` ("10GB"), as a config snippet.
pub fn pool(name: &str, budget: &str) -> String {
    format!("[[pool]]\nname = \"{name}\"\nbudget = \"{budget}\"\n\n")
}

/// A workload that sleeps (exits on SIGTERM), holding `gb` of `pool`.
pub fn sleeper(name: &str, pool: &str, gb: u64, extra: &str) -> String {
    format!(
        "[[workload]]\nname = \"{name}\"\ncommand = [\"/bin/sleep\", \"3600\"]\nstop_grace = \"2s\"\n{extra}\n[workload.memory.{pool}]\nweights = \"{gb}GB\"\n"
    )
}

/// A workload running `sh -c SCRIPT`, holding 4 GB of pool `ram`, with
/// `restart` lines.
pub fn shell(name: &str, script: &str, restart: &str) -> String {
    format!(
        "[[workload]]\nname = \"{name}\"\ncommand = [\"/bin/sh\", \"-c\", \"{script}\"]\nstop_grace = \"2s\"\n[workload.memory.ram]\nweights = \"4GB\"\n[workload.restart]\n{restart}\n"
    )
}

/// What the journal in `state_dir` holds now, read as the agent reads it
/// (changing nothing).
pub fn journaled_in(state_dir: &Path) -> Vec<residentd::journal::Entry> {
    residentd::journal::Journal::open(state_dir)
        .expect("the state directory")
        .peek()
        .entries
}

/// residentctl with `args` against the agent on `socket`, run as uid and
/// gid 65534 (nobody, nogroup) with `groups` as its supplementary groups:
/// another user, as an operator would see them (root only: made with
/// setuid).
pub fn as_nobody_on(socket: &Path, groups: &[u32], args: &[&str]) -> std::process::Output {
    let groups: Vec<String> = groups.iter().map(u32::to_string).collect();
    let drop = format!(
        "import os, sys\nos.setgroups([{}])\nos.setgid(65534)\nos.setuid(65534)\nos.execv(sys.argv[1], sys.argv[1:])\n",
        groups.join(", ")
    );
    Command::new("python3")
        .args(["-c", &drop, env!("CARGO_BIN_EXE_residentctl"), "--socket"])
        .arg(socket)
        .args(args)
        .output()
        .expect("python3 runs")
}

/// The pid of the agent serving on `socket` (as it says: the socket's
/// peer credentials name whoever listened first).
pub async fn agent_pid(socket: &Path) -> i32 {
    let mut c = connect(socket).await;
    let node = c.node(pb::NodeRequest {}).await.expect("node");
    node.into_inner().agent_pid as i32
}

/// Kills an agent a test started by an upgrade (the `Daemon` knows only
/// the one it spawned).
pub struct Upgraded(pub i32);

impl Drop for Upgraded {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.0),
            nix::sys::signal::SIGKILL,
        );
    }
}

/// residentctl with `args` against the agent on `socket`.
pub fn residentctl(socket: &Path, args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_residentctl"))
        .arg("--socket")
        .arg(socket)
        .args(args)
        .output()
        .expect("residentctl runs")
}

/// residentd-router served in this process (its library) until dropped.
pub struct Router {
    pub base: String,
    pub port: u16,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Router {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

/// A router of the agent at `agent` (a socket, `http://` or `https://`
/// with `tls`), its console's actions on with `console_token`.
pub async fn serve_router(
    agent: &str,
    tls: Option<residentd_router::AgentTls>,
    queue_timeout: Duration,
    console_token: Option<&str>,
) -> Router {
    serve_router_with(agent, |o| {
        o.tls = tls;
        o.queue_timeout = queue_timeout;
        o.console_token = console_token.map(str::to_string);
    })
    .await
}

/// A router of the agent at `agent` with the tests' options (1 MiB
/// bodies sent within 2 s, holds of 30 s, the defaults otherwise) as
/// `adjust` leaves them.
pub async fn serve_router_with(
    agent: &str,
    adjust: impl FnOnce(&mut residentd_router::Options),
) -> Router {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let listen = listener.local_addr().expect("address");
    let mut options = residentd_router::Options::new(agent, listen);
    options.max_body = 1 << 20;
    options.body_timeout = Duration::from_secs(2);
    options.hold = Duration::from_secs(30);
    adjust(&mut options);
    let app = residentd_router::App::new(options).expect("router");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(app.serve(listener, async move {
        let _ = stopped.await;
    }));
    Router {
        base: format!("http://{listen}"),
        port: listen.port(),
        stop: Some(stop),
    }
}
