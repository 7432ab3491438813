//! `resident-bench`: residentd side by side with its floors and its peer,
//! in one run on one machine, printed as one table of ratios.
//!
//! 1. Place latency (p50, p99) and throughput with 1, 16 and 64 clients,
//!    against a zero-work tonic service on the same transport, in short
//!    turns A B B A.
//! 2. Start of 100 instances until all run, and their stop, against a plain
//!    spawn loop / kill + wait and against supervisord (waiting on its
//!    pushed events, as on residentd's Watch).
//! 3. kill -9 of a child until a Watch client hears of it, against
//!    supervisord's pushed event (an event listener of its own).
//! 4. The agent's CPU and peak RSS with 200 idle children, against
//!    supervisord's.
//! 5. Admission under churn: random Start/Stop/Place from 16 clients, then
//!    a check that nothing was over-committed.
//! 6. Readiness lag: how long after a loading server starts answering 200
//!    a Watch client hears READY, for a server that logs when it is ready
//!    and for one that says nothing.
//! 7. residentd-router against the same llama-cpp-python server reached
//!    directly: first event, streamed events per second, and a swap
//!    against the same swap by hand.
//! 8. Fleet: the Python package's ranked Place fan-out over 100 and 1,000
//!    agents (each its own process), against its fleet view (a WatchNode
//!    stream per agent, Place on the best few) in the same run, each view
//!    decision checked against a fan-out; each agent's idle memory and the
//!    view's per node.
//! 9. Sleep (`sleep.rs`): a request for a model asleep against one
//!    stopped (the vLLM stand-in, and the real llama-server), and a swap
//!    A -> B -> A through the router with sleep against with eviction.
//!
//! Parts 7 and 8 run Python from the tests' `.venv` (`--venv-python`:
//! llama-cpp-python, the residentd package); without it they print a note.
//!
//! Run by `scripts/bench` (which builds the release binaries and the
//! supervisord venv); `--quick` is a smoke run of a few iterations.

mod comeback;
mod fleet;
mod floor;
mod measure;
mod readiness;
mod report;
mod router;
mod sleep;
mod takeover;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use resident_api::pb;
use resident_api::pb::node_agent_client::NodeAgentClient;
use tonic::transport::Channel;

use crate::report::{Row, Table};

/// Sizes of one run.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Seconds of Place calls to each server at each client count, in
    /// `place_rounds` rounds of turns A B B A.
    place_secs: f64,
    place_rounds: usize,
    place_clients: &'static [usize],
    children: usize,
    start_rounds: usize,
    crash_rounds: usize,
    idle_children: usize,
    idle_secs: f64,
    churn_calls: usize,
    /// How long the readiness part's servers load.
    loading_ms: u64,
    ready_instances: usize,
    ready_rounds: usize,
    router_requests: usize,
    router_streams: usize,
    router_swaps: usize,
    /// The two fleet sizes of the fleet part, and its fan-outs at each.
    fleet_sizes: (usize, usize),
    fleet_rounds: usize,
    /// Instances running when the agent is killed, and rounds.
    comeback_instances: usize,
    comeback_rounds: usize,
    /// Rounds of each row of the sleep part.
    sleep_rounds: usize,
}

const FULL: Plan = Plan {
    place_secs: 3.0,
    place_rounds: 3,
    place_clients: &[1, 16, 64],
    children: 100,
    start_rounds: 10,
    crash_rounds: 40,
    idle_children: 200,
    idle_secs: 30.0,
    churn_calls: 10_000,
    loading_ms: 1_500,
    ready_instances: 10,
    ready_rounds: 3,
    router_requests: 200,
    router_streams: 15,
    router_swaps: 5,
    fleet_sizes: (100, 1000),
    fleet_rounds: 50,
    comeback_instances: 200,
    comeback_rounds: 3,
    sleep_rounds: 5,
};

const QUICK: Plan = Plan {
    place_secs: 0.2,
    place_rounds: 1,
    place_clients: &[1, 16],
    children: 10,
    start_rounds: 1,
    crash_rounds: 3,
    idle_children: 10,
    idle_secs: 0.5,
    churn_calls: 400,
    loading_ms: 300,
    ready_instances: 4,
    ready_rounds: 1,
    router_requests: 3,
    router_streams: 1,
    router_swaps: 1,
    fleet_sizes: (5, 20),
    fleet_rounds: 3,
    comeback_instances: 10,
    comeback_rounds: 1,
    sleep_rounds: 1,
};

/// A process of ours that is killed when dropped.
struct Server {
    child: Child,
    socket: PathBuf,
    _dir: tempfile::TempDir,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.child.id() as i32),
            nix::sys::signal::Signal::SIGTERM,
        );
        let _ = self.child.wait();
    }
}

impl Server {
    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// kill -9 of this agent, then the same binary started again on the
    /// same config and state; the instant of that start.
    fn kill_and_respawn(&mut self, residentd: &Path) -> anyhow::Result<Instant> {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid()),
            nix::sys::signal::Signal::SIGKILL,
        )?;
        self.child.wait()?;
        let t = Instant::now();
        self.child = Command::new(residentd)
            .arg("--config")
            .arg(self._dir.path().join("residentd.toml"))
            .env("RUST_LOG", "warn")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        Ok(t)
    }
}

/// Every instance once all `n` are READY (bounded to a minute from
/// `since`), and how long that took from `since`.
async fn all_ready(
    c: &mut NodeAgentClient<Channel>,
    n: usize,
    since: Instant,
) -> anyhow::Result<(Duration, Vec<pb::Instance>)> {
    loop {
        let list = c.list(pb::ListRequest {}).await?.into_inner().instances;
        let up = list
            .iter()
            .filter(|i| i.state == pb::State::Ready as i32)
            .count();
        if up == n {
            return Ok((since.elapsed(), list));
        }
        anyhow::ensure!(
            since.elapsed() < Duration::from_secs(60),
            "only {up} of {n} instances READY after a minute"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

const AGENT_CONFIG: &str = r#"[node]
name = "bench"
listen = "unix://@DIR@/agent.sock"
state_dir = "@DIR@/state"
max_instances = 1000
@NODE@

[[pool]]
name = "ram"
budget = "1000GB"

[[pool]]
name = "small"
budget = "40GB"

[[workload]]
name = "trivial"
command = ["/bin/sleep", "3600"]
stop_grace = "10s"
[workload.memory.ram]
weights = "1GB"
[workload.restart]
policy = "never"

[[workload]]
name = "churn"
command = ["/bin/sleep", "3600"]
stop_grace = "10s"
[workload.memory.small]
weights = "4GB"
[workload.restart]
policy = "never"
"#;

fn spawn_agent(residentd: &Path) -> anyhow::Result<Server> {
    spawn_agent_with(residentd, "")
}

/// An agent with `node` added to its `[node]` table.
fn spawn_agent_with(residentd: &Path, node: &str) -> anyhow::Result<Server> {
    spawn_agent_text(residentd, &AGENT_CONFIG.replace("@NODE@", node))
}

/// An agent on `config`, whose `@DIR@` is replaced by the agent's own
/// temporary directory.
fn spawn_agent_text(residentd: &Path, config: &str) -> anyhow::Result<Server> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("residentd.toml");
    std::fs::write(
        &path,
        config.replace("@DIR@", &dir.path().display().to_string()),
    )?;
    let child = Command::new(residentd)
        .arg("--config")
        .arg(&path)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", residentd.display()))?;
    Ok(Server {
        child,
        socket: dir.path().join("agent.sock"),
        _dir: dir,
    })
}

fn spawn_floor() -> anyhow::Result<Server> {
    let dir = tempfile::tempdir()?;
    let socket = dir.path().join("floor.sock");
    let child = Command::new(std::env::current_exe()?)
        .arg("--serve-floor")
        .arg(&socket)
        .spawn()?;
    Ok(Server {
        child,
        socket,
        _dir: dir,
    })
}

async fn connect(socket: &Path) -> anyhow::Result<NodeAgentClient<Channel>> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if socket.exists()
            && let Ok(c) = resident_api::connect_unix(socket).await
        {
            return Ok(c);
        }
        if Instant::now() > deadline {
            bail!("nothing answers on {}", socket.display());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn sibling_binary(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.with_file_name(name);
    if !path.exists() {
        bail!(
            "{} not found beside {} (build it: cargo build --release -p residentd -p residentd-router)",
            name,
            exe.display()
        );
    }
    Ok(path)
}

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if let [flag, socket] = args.as_slice()
        && flag == "--serve-floor"
    {
        return floor::serve(Path::new(socket));
    }
    if let [flag, loading_ms] = args.as_slice()
        && flag == "--serve-loading"
    {
        return readiness::serve_loading(loading_ms.parse()?);
    }
    if let [flag, socket, rounds, ctl @ ..] = args.as_slice()
        && let Some(phase) = measure::Storm::from_flag(flag)
    {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        let ctl = ctl.first().map(Path::new);
        return rt.block_on(measure::storm(
            Path::new(socket),
            phase,
            rounds.parse()?,
            ctl,
        ));
    }
    let quick = args.iter().any(|a| a == "--quick");
    let supervisord = args
        .iter()
        .position(|a| a == "--supervisord-python")
        .and_then(|i| args.get(i + 1))
        .map(PathBuf::from);
    let plan = if quick { QUICK } else { FULL };
    let venv_python = args
        .iter()
        .position(|a| a == "--venv-python")
        .and_then(|i| args.get(i + 1))
        .map(PathBuf::from);
    // `--only place|startstop|crash|idle|churn|readiness|router|sleep|fleet|comeback|takeover`
    // runs one part, for working on it.
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .cloned();
    let runs = |part: &str| only.as_deref().is_none_or(|o| o == part);
    let residentd = sibling_binary("residentd")?;
    let script =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench_supervisord.py");
    let peer = supervisord.map(|python| measure::Peer { python, script });
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut table = Table::default();
    rt.block_on(async {
        if runs("place") {
            place_rows(&plan, &residentd, &mut table).await?;
        }
        if runs("startstop") {
            startstop_rows(&plan, &residentd, peer.as_ref(), &mut table).await?;
        }
        if runs("crash") {
            crash_row(&plan, &residentd, peer.as_ref(), &mut table).await?;
        }
        if runs("idle") {
            idle_rows(&plan, &residentd, peer.as_ref(), &mut table).await?;
        }
        if runs("churn") {
            churn_row(&plan, &residentd, &mut table).await?;
        }
        if runs("comeback") {
            comeback::rows(&plan, &residentd, &mut table).await?;
        }
        if runs("takeover") {
            takeover::rows(&plan, &residentd, &mut table).await?;
        }
        if runs("readiness") {
            readiness::rows(&plan, &residentd, &mut table).await?;
        }
        if runs("router") {
            let router = sibling_binary("residentd-router")?;
            router::rows(
                &plan,
                &residentd,
                &router,
                venv_python.as_deref(),
                &mut table,
            )
            .await?;
            router::llama_server_rows(
                &plan,
                &residentd,
                &router,
                venv_python.as_deref(),
                &mut table,
            )
            .await?;
        }
        if runs("sleep") {
            let router = sibling_binary("residentd-router")?;
            sleep::rows(
                &plan,
                &residentd,
                &router,
                venv_python.as_deref(),
                &mut table,
            )
            .await?;
        }
        if runs("fleet") {
            fleet::rows(&plan, &residentd, venv_python.as_deref(), &mut table)?;
        }
        Ok::<_, anyhow::Error>(())
    })?;
    table.print(quick, nproc());
    let missed = table.missed();
    anyhow::ensure!(
        missed.is_empty(),
        "hard targets missed (the rest of the table stands): {}",
        missed.join("; ")
    );
    Ok(())
}

/// The real llama-server (built by scripts/llama-server) and a test model
/// of `embd` and `layers` written by tests/llama/make_model.py into a
/// temporary directory: (the server's path, the directory, the model).
/// `None` when there is no python with `gguf` or no llama-server built,
/// after a note in the table that `part` was not measured.
fn llama_server_and_model(
    python: Option<&Path>,
    part: &str,
    embd: u32,
    layers: u32,
    table: &mut Table,
) -> anyhow::Result<Option<(PathBuf, tempfile::TempDir, PathBuf)>> {
    let Some(python) = python_with(python, "gguf", part, table) else {
        return Ok(None);
    };
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let built = Command::new(root.join("scripts/llama-server"))
        .arg("--cached")
        .output()?;
    if !built.status.success() {
        table.push(Row::note(
            part.into(),
            "not measured: no llama-server built (scripts/llama-server)".into(),
        ));
        return Ok(None);
    }
    let server = PathBuf::from(String::from_utf8_lossy(&built.stdout).trim()).join("llama-server");
    let models = tempfile::tempdir()?;
    let model = models.path().join("model.gguf");
    let status = Command::new(python)
        .arg(root.join("tests/llama/make_model.py"))
        .arg(&model)
        .args(["--embd", &embd.to_string(), "--layers", &layers.to_string()])
        .status()?;
    if !status.success() {
        bail!("make_model.py {} failed", model.display());
    }
    Ok(Some((server, models, model)))
}

/// `python` when it can import `modules`; else `None`, after a note in the
/// table that `part` was not measured.
fn python_with<'a>(
    python: Option<&'a Path>,
    modules: &str,
    part: &str,
    table: &mut Table,
) -> Option<&'a Path> {
    let usable = python.filter(|p| {
        Command::new(p)
            .args(["-c", &format!("import {modules}")])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if usable.is_none() {
        table.push(Row::note(
            part.into(),
            format!("not measured: no python that imports {modules} (scripts/test sets up .venv; scripts/bench passes it as --venv-python)"),
        ));
    }
    usable
}

fn nproc() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

async fn place_rows(plan: &Plan, residentd: &Path, table: &mut Table) -> anyhow::Result<()> {
    let agent = spawn_agent(residentd)?;
    let floor = spawn_floor()?;
    let mut c = connect(&agent.socket).await?;
    connect(&floor.socket).await?;
    // Ten residents, so a plan has a ledger to look at.
    for i in 0..10 {
        c.start(start("trivial", &format!("resident-{i}"))).await?;
    }
    for &clients in plan.place_clients {
        let (ours, base) = measure::place_abba(
            measure::Placer::connect(&agent.socket, agent.pid(), clients).await?,
            measure::Placer::connect(&floor.socket, floor.pid(), clients).await?,
            plan.place_secs,
            plan.place_rounds,
        )
        .await?;
        table.push(Row::latency(
            format!("Place p50, {clients} clients"),
            ours.p50,
            base.p50,
            None,
            "<= 1.3x floor",
        ));
        table.push(Row::latency(
            format!("Place p99, {clients} clients"),
            ours.p99,
            base.p99,
            None,
            "",
        ));
        table.push(Row::rate(
            format!("Place calls/s, {clients} clients"),
            ours.per_sec,
            base.per_sec,
            ">= 0.7x floor",
        ));
        // Beside the median: the mean (the clients over the rate, in a
        // closed loop), which does not depend on how evenly a server
        // shares its time among its clients, and what a call costs each
        // server in CPU.
        table.push(Row::latency(
            format!("Place mean, {clients} clients"),
            ours.mean,
            base.mean,
            None,
            "",
        ));
        if let (Some(ours), Some(base)) = (ours.server_cpu, base.server_cpu) {
            table.push(Row::latency(
                format!("Place: the server's CPU per call, {clients} clients"),
                ours,
                base,
                None,
                "",
            ));
        }
    }
    Ok(())
}

/// Where the CPU of a stop of `n` went, as means over the rounds (the
/// machine's time comes in 10 ms ticks, so a single round is coarse): the
/// whole machine's, and of it this bench's own (the floor's loop, or the
/// agent's client), the agent's, and the rest (the children's exits, the
/// kernel's threads). On a machine whose cores are busy through the phase
/// its wall time follows the sum, so this says where a stop's time goes.
fn stop_cpu_rows(
    n: usize,
    phases: &[Vec<measure::PhaseCpu>; 4],
    agent: [&[Duration]; 2],
    table: &mut Table,
) {
    fn mean(v: impl Iterator<Item = Duration>) -> Option<Duration> {
        let (sum, count) = v.fold((Duration::ZERO, 0u32), |(s, c), d| (s + d, c + 1));
        (count > 0).then(|| sum / count)
    }
    let names = [
        "plain floor",
        "floor with an RPC per child",
        "cgroups",
        "process groups",
    ];
    for (k, (what, runs)) in names.iter().zip(phases).enumerate() {
        let (Some(machine), Some(bench)) = (
            mean(runs.iter().map(|p| p.machine)),
            mean(runs.iter().map(|p| p.bench)),
        ) else {
            continue;
        };
        let own = if k < 2 {
            "the floor's loop"
        } else {
            "the client"
        };
        let agent = k
            .checked_sub(2)
            .and_then(|i| mean(agent[i].iter().copied()));
        let rest = machine
            .saturating_sub(bench)
            .saturating_sub(agent.unwrap_or_default());
        table.push(Row::peer_latency(
            &format!("stop {n}: CPU of the whole machine ({what})"),
            machine,
            None,
            "",
        ));
        table.push(Row::peer_latency(
            &format!("stop {n} ({what}): of it, {own}"),
            bench,
            None,
            "",
        ));
        if let Some(agent) = agent {
            table.push(Row::peer_latency(
                &format!("stop {n} ({what}): of it, the agent"),
                agent,
                None,
                "",
            ));
        }
        let rest_is = if k == 1 {
            "the RPC server, the children's exits and the kernel's threads"
        } else {
            "the children's exits and the kernel's threads"
        };
        table.push(Row::peer_latency(
            &format!("stop {n} ({what}): of it, {rest_is}"),
            rest,
            None,
            "",
        ));
    }
}

/// Start and stop of many children: the agent as deployed (a cgroup per
/// run where the machine allows) and with process groups only, beside the
/// spawn-loop floor and supervisord.
async fn startstop_rows(
    plan: &Plan,
    residentd: &Path,
    peer: Option<&measure::Peer>,
    table: &mut Table,
) -> anyhow::Result<()> {
    let with_cgroups = spawn_agent(residentd)?;
    let without = spawn_agent_with(residentd, "cgroups = \"off\"")?;
    let prompt = spawn_agent_with(residentd, "durable_answers = false")?;
    let floor = spawn_floor()?;
    let mut a = connect(&with_cgroups.socket).await?;
    let mut b = connect(&without.socket).await?;
    let mut p = connect(&prompt.socket).await?;
    let f = connect(&floor.socket).await?;
    // Another build of residentd (`RESIDENT_BENCH_BASELINE=PATH`, as
    // deployed: cgroups on), run in the same rounds: a change to the agent
    // measured against the code before it, side by side.
    let baseline = match std::env::var_os("RESIDENT_BENCH_BASELINE") {
        Some(path) => Some(spawn_agent(Path::new(&path))?),
        None => None,
    };
    let mut base = match &baseline {
        Some(server) => Some(connect(&server.socket).await?),
        None => None,
    };
    let mut samples: [Vec<Duration>; 10] = Default::default();
    let mut base_samples: [Vec<Duration>; 2] = Default::default();
    // The agent's CPU time per phase: cgroups start, stop; process groups
    // start, stop.
    let mut cpu_samples: [Vec<Duration>; 4] = Default::default();
    // Where the CPU of each stop phase went: the whole machine and this
    // bench (the floor's loop, or the agent's client); plain floor, RPC
    // floor, cgroups, process groups. With the agent's own CPU beside
    // them, the rest is the children's exits and the kernel's threads.
    let mut stop_phase: [Vec<measure::PhaseCpu>; 4] = Default::default();
    for round in 0..plan.start_rounds {
        let n = plan.children;
        let (floor_start, floor_stop, floor_cpu) = measure::floor_spawn(n).await?;
        let (rpc_start, rpc_stop, rpc_cpu) = measure::floor_spawn_rpc(n, &f).await?;
        let cg = measure::agent_startstop(&mut a, with_cgroups.pid(), n, round).await?;
        let pg = measure::agent_startstop(&mut b, without.pid(), n, round).await?;
        let prompt_run = measure::agent_startstop(&mut p, prompt.pid(), n, round).await?;
        for (k, phase) in [floor_cpu, rpc_cpu, cg.stop_machine, pg.stop_machine]
            .into_iter()
            .enumerate()
        {
            stop_phase[k].push(phase);
        }
        let runs = [
            (floor_start, floor_stop),
            (rpc_start, rpc_stop),
            (cg.start, cg.stop),
            (pg.start, pg.stop),
            (prompt_run.start, prompt_run.stop),
        ];
        for (k, (start, stop)) in runs.into_iter().enumerate() {
            samples[2 * k].push(start);
            samples[2 * k + 1].push(stop);
        }
        for (k, cpu) in [cg.start_cpu, cg.stop_cpu, pg.start_cpu, pg.stop_cpu]
            .into_iter()
            .enumerate()
        {
            cpu_samples[k].extend(cpu);
        }
        if let Some((server, c)) = baseline.as_ref().zip(base.as_mut()) {
            let run = measure::agent_startstop(c, server.pid(), n, round).await?;
            base_samples[0].push(run.start);
            base_samples[1].push(run.stop);
        }
    }
    // How a start scales with what the agent already holds: the same
    // start with five times as many instances resident (each holds its
    // pidfd, output pipes and cgroup files open), on this build and, side
    // by side, on the baseline.
    let crowd: Vec<String> = (0..5 * plan.children)
        .map(|i| format!("crowd-{i}"))
        .collect();
    let mut crowded: [Vec<Duration>; 2] = Default::default();
    let agents = [
        Some((&with_cgroups, &mut a)),
        baseline.as_ref().zip(base.as_mut()),
    ];
    for (k, (server, c)) in agents.into_iter().flatten().enumerate() {
        measure::start_all(c, &crowd).await?;
        for round in 0..plan.start_rounds {
            let run =
                measure::agent_startstop(c, server.pid(), plan.children, 10_000 + round).await?;
            crowded[k].push(run.start);
        }
        measure::stop_all(c, &crowd).await?;
    }
    let [
        floor_start,
        floor_stop,
        rpc_start,
        rpc_stop,
        cg_start,
        cg_stop,
        pg_start,
        pg_stop,
        prompt_start,
        prompt_stop,
    ] = samples.map(measure::median);
    let theirs = match peer {
        Some(p) => Some(p.startstop(plan.children, plan.start_rounds)?),
        None => None,
    };
    let n = plan.children;
    for (what, start, stop) in [
        ("cgroups", cg_start, cg_stop),
        ("process groups", pg_start, pg_stop),
    ] {
        table.push(Row::latency(
            format!("start {n} until all run ({what})"),
            start,
            floor_start,
            theirs.map(|t| t.0),
            "<= 1.5x floor, < supervisord",
        ));
        table.push(Row::latency(
            format!("stop {n} until all gone ({what})"),
            stop,
            floor_stop,
            theirs.map(|t| t.1),
            "<= 2x floor, < supervisord",
        ));
    }
    let [crowded, base_crowded] = crowded;
    let crowded_start = measure::median(crowded);
    let many = 5 * n;
    table.push(Row::latency(
        format!("start {n} with {many} resident vs with none (cgroups)"),
        crowded_start,
        cg_start,
        None,
        "<= 1.5x",
    ));
    if baseline.is_some() {
        table.push(Row::latency(
            format!("start {n} with {many} resident (cgroups) vs the baseline build"),
            crowded_start,
            measure::median(base_crowded),
            None,
            "",
        ));
        let [base_start, base_stop] = base_samples.map(measure::median);
        for (what, ours, theirs) in [
            ("start", cg_start, base_start),
            ("stop", cg_stop, base_stop),
        ] {
            table.push(Row::latency(
                format!("{what} {n} (cgroups) vs the baseline build"),
                ours,
                theirs,
                None,
                "",
            ));
        }
    }
    // What durable answers cost: the deployed agent beside the same agent
    // answering before the journal is on disk.
    table.push(Row::latency(
        format!("start {n}, durable answers vs not (cgroups)"),
        cg_start,
        prompt_start,
        None,
        "<= 1.15x",
    ));
    table.push(Row::latency(
        format!("stop {n}, durable answers vs not (cgroups)"),
        cg_stop,
        prompt_stop,
        None,
        "",
    ));
    // The agent's own CPU time in each phase (all its threads; the
    // children's exits are the kernel's, charged to them): what a storm
    // costs the agent, beside the wall time it takes.
    let [cg_start_cpu, cg_stop_cpu, pg_start_cpu, pg_stop_cpu] = &cpu_samples;
    for (what, how, cpu) in [
        ("start", "cgroups", cg_start_cpu),
        ("stop", "cgroups", cg_stop_cpu),
        ("start", "process groups", pg_start_cpu),
        ("stop", "process groups", pg_stop_cpu),
    ] {
        if !cpu.is_empty() {
            let name = format!("{what} {n}: the agent's CPU time ({how})");
            table.push(Row::peer_latency(
                &name,
                measure::median(cpu.clone()),
                None,
                "",
            ));
        }
    }
    stop_cpu_rows(n, &stop_phase, [cg_stop_cpu, pg_stop_cpu], table);
    // The floor with one zero-work RPC per child: the transport's share of
    // a start and a stop, so the agent's own share shows.
    for (what, ours, plain, with_rpc) in [
        ("start", cg_start, floor_start, rpc_start),
        ("stop", cg_stop, floor_stop, rpc_stop),
    ] {
        table.push(Row::latency(
            format!("{what} {n}: floor with an RPC per child, vs plain floor"),
            with_rpc,
            plain,
            None,
            "",
        ));
        table.push(Row::latency(
            format!("{what} {n} (cgroups) vs floor with an RPC per child"),
            ours,
            with_rpc,
            None,
            "",
        ));
    }
    Ok(())
}

async fn crash_row(
    plan: &Plan,
    residentd: &Path,
    peer: Option<&measure::Peer>,
    table: &mut Table,
) -> anyhow::Result<()> {
    let agent = spawn_agent(residentd)?;
    let mut c = connect(&agent.socket).await?;
    let ours = measure::crash_detection(&mut c, plan.crash_rounds).await?;
    let theirs = match peer {
        Some(p) => Some(p.crash(plan.crash_rounds)?),
        None => None,
    };
    table.push(Row::peer_latency(
        "kill -9 to the pushed exit event (median)",
        ours,
        theirs,
        "<= 1 ms, <= supervisord",
    ));
    Ok(())
}

async fn idle_rows(
    plan: &Plan,
    residentd: &Path,
    peer: Option<&measure::Peer>,
    table: &mut Table,
) -> anyhow::Result<()> {
    let agent = spawn_agent(residentd)?;
    let mut c = connect(&agent.socket).await?;
    let (cpu, rss) = measure::idle(&mut c, agent.pid(), plan.idle_children, plan.idle_secs).await?;
    let theirs = match peer {
        Some(p) => Some(p.idle(plan.idle_children, plan.idle_secs)?),
        None => None,
    };
    let n = plan.idle_children;
    table.push(Row::fraction(
        format!("CPU with {n} idle children"),
        cpu,
        theirs.map(|t| t.0),
        "<= 0.1% of a core, < supervisord",
    ));
    table.push(Row::bytes(
        format!("peak RSS with {n} idle children"),
        rss,
        theirs.map(|t| t.1),
        "<= 15 MB, < supervisord",
    ));
    Ok(())
}

async fn churn_row(plan: &Plan, residentd: &Path, table: &mut Table) -> anyhow::Result<()> {
    let agent = spawn_agent(residentd)?;
    let mut c = connect(&agent.socket).await?;
    let churn = measure::churn(&agent.socket, plan.churn_calls, 16).await?;
    measure::check_books(&mut c, "small", 40_000_000_000).await?;
    table.push(Row::note(
        format!("churn: {} calls from 16 clients", plan.churn_calls),
        format!(
            "{:.0} calls/s, p99 {}, {} admitted, {} refused; books checked",
            churn.per_sec,
            report::duration(churn.p99),
            churn.admitted,
            churn.refused
        ),
    ));
    Ok(())
}

fn start(workload: &str, id: &str) -> pb::StartRequest {
    pb::StartRequest {
        workload: workload.into(),
        instance_id: id.into(),
        on_full: 0,
        wait_ready: true,
        lease_ms: 0,
    }
}
