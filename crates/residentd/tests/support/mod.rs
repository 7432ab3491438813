//! Runs the real `residentd` binary on a temporary socket and talks to it
//! with the generated client.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use prost::Message as _;
use resident_api::pb;
use resident_api::pb::node_agent_client::NodeAgentClient;
use tonic::transport::Channel;

pub const RESIDENTD: &str = env!("CARGO_BIN_EXE_residentd");
pub const PATIENCE: Duration = Duration::from_secs(15);

pub struct Daemon {
    pub dir: tempfile::TempDir,
    pub socket: PathBuf,
    pub child: Option<Child>,
    pub client: NodeAgentClient<Channel>,
}

/// The `[node]` table for a daemon in `dir`, then `rest` (pools, workloads).
pub fn config_text(dir: &Path, rest: &str) -> String {
    format!(
        "[node]\nname = \"test-node\"\nlisten = \"unix://{}/agent.sock\"\nstate_dir = \"{}/state\"\nsample_every = \"200ms\"\n\n{rest}",
        dir.display(),
        dir.display()
    )
}

impl Daemon {
    /// Starts residentd with `rest` after a test `[node]` table; returns once
    /// it answers.
    pub async fn start(rest: &str) -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let config = dir.path().join("residentd.toml");
        std::fs::write(&config, config_text(dir.path(), rest)).expect("write the config");
        Self::start_in(dir).await
    }

    /// Starts residentd again on the config and state of `dir`.
    pub async fn start_in(dir: tempfile::TempDir) -> Self {
        Self::start_in_with(dir, |_| {}).await
    }

    /// As `start_in`, letting the test adjust the command first.
    pub async fn start_in_with(dir: tempfile::TempDir, adjust: impl FnOnce(&mut Command)) -> Self {
        let config = dir.path().join("residentd.toml");
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(dir.path().join("residentd.log"))
            .expect("log file");
        let mut cmd = Command::new(RESIDENTD);
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

    /// The ids of every instance, in id order.
    pub async fn ids(&mut self) -> Vec<String> {
        let list = self
            .client
            .list(pb::ListRequest {})
            .await
            .expect("list")
            .into_inner();
        list.instances.into_iter().map(|i| i.instance_id).collect()
    }

    /// Starts residentd again on this daemon's config and state (the
    /// previous process must have ended).
    pub async fn restart(self) -> Self {
        let mut old = self;
        let dir = std::mem::replace(&mut old.dir, tempfile::tempdir().expect("tempdir"));
        drop(old);
        Self::start_in(dir).await
    }

    /// Waits (bounded) until instance `id` is in `state`; returns it.
    pub async fn wait_state(&mut self, id: &str, state: pb::State) -> pb::Instance {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            let i = self.get(id).await;
            if i.state == state as i32 {
                return i;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{id} never reached {state:?}: {i:?}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.as_ref().map(|c| c.id() as i32).expect("running")
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("residentd.log")).unwrap_or_default()
    }

    /// SIGTERM, then waits (bounded, without blocking the runtime, so the
    /// client's connection can close) for the exit status.
    pub async fn terminate(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        let pid = nix::unistd::Pid::from_raw(child.id() as i32);
        nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("signal residentd");
        let deadline = tokio::time::Instant::now() + PATIENCE;
        loop {
            if let Some(status) = child.try_wait().expect("wait on residentd") {
                return status;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "residentd did not exit after SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Daemon {
    /// A test that did not stop the agent itself: SIGKILL (its children die
    /// with it, by their parent-death signal).
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Connects to `socket`, retrying until the agent answers (bounded).
pub async fn connect(socket: &Path) -> NodeAgentClient<Channel> {
    let deadline = tokio::time::Instant::now() + PATIENCE;
    loop {
        if let Ok(mut c) = resident_api::connect_unix(socket).await
            && c.node(pb::NodeRequest {}).await.is_ok()
        {
            return c;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "residentd did not answer on {}",
            socket.display()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

pub fn start_req(workload: &str, id: &str) -> pb::StartRequest {
    pb::StartRequest {
        workload: workload.into(),
        instance_id: id.into(),
        ..Default::default()
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

/// Polls `check` until it holds or `bound` passes.
pub async fn eventually(bound: Duration, mut check: impl FnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + bound;
    loop {
        if check() {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
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
