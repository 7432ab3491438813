//! The measurements, each a function that runs one job and returns what it
//! took.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use resident_api::pb;
use resident_api::pb::node_agent_client::NodeAgentClient;
use tokio_stream::StreamExt as _;
use tonic::transport::Channel;

type Client = NodeAgentClient<Channel>;

/// The median of `v` (which must not be empty).
pub fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

/// Latency and rate of a batch of calls, and what they cost the server.
#[derive(Debug, Clone, Copy)]
pub struct Calls {
    pub p50: Duration,
    pub p99: Duration,
    /// The mean: with every client calling in a closed loop, the number
    /// of clients over the rate, however the server shares its time out
    /// among them (a server that serves a few clients first and lets the
    /// rest wait has a low median and the same mean).
    pub mean: Duration,
    pub per_sec: f64,
    /// The server's CPU time per call (`None` when it could not be read).
    pub server_cpu: Option<Duration>,
}

fn summarize(mut lat: Vec<Duration>, elapsed: Duration, server: Option<Duration>) -> Calls {
    lat.sort();
    let n = u32::try_from(lat.len().max(1)).unwrap_or(u32::MAX);
    Calls {
        p50: percentile(&lat, 0.5),
        p99: percentile(&lat, 0.99),
        mean: lat.iter().sum::<Duration>() / n,
        per_sec: lat.len() as f64 / elapsed.as_secs_f64(),
        server_cpu: server.map(|cpu| cpu / n),
    }
}

/// `clients` connections of their own to one server, calling Place in
/// closed loops, and what the counted calls took: their latencies, the
/// time they ran, and the server's CPU time over those runs (its pid's).
pub struct Placer {
    conns: Vec<Client>,
    server: i32,
    lat: Vec<Duration>,
    elapsed: Duration,
    /// `None` once a reading of the server's CPU failed.
    cpu: Option<Duration>,
}

impl Placer {
    pub async fn connect(socket: &Path, server: i32, clients: usize) -> anyhow::Result<Self> {
        let mut conns = Vec::new();
        for _ in 0..clients {
            conns.push(resident_api::connect_unix(socket).await?);
        }
        Ok(Self {
            conns,
            server,
            lat: Vec::new(),
            elapsed: Duration::ZERO,
            cpu: Some(Duration::ZERO),
        })
    }

    /// Every client calls for `secs`; counted unless it is a warm-up.
    pub async fn run(&mut self, secs: f64, counted: bool) -> anyhow::Result<()> {
        let req = pb::PlaceRequest {
            workload: "trivial".into(),
            on_full: 0,
            ..Default::default()
        };
        let cpu0 = process_cpu(self.server);
        let t0 = Instant::now();
        let end = t0 + Duration::from_secs_f64(secs);
        let tasks: Vec<_> = self
            .conns
            .iter()
            .cloned()
            .map(|mut c| {
                let req = req.clone();
                tokio::spawn(async move {
                    let mut lat = Vec::new();
                    while Instant::now() < end {
                        let t0 = Instant::now();
                        c.place(req.clone()).await?;
                        lat.push(t0.elapsed());
                    }
                    Ok::<_, tonic::Status>(lat)
                })
            })
            .collect();
        let mut all = Vec::new();
        for t in tasks {
            all.extend(t.await??);
        }
        let elapsed = t0.elapsed();
        let spent = process_cpu(self.server)
            .zip(cpu0)
            .map(|(after, before)| after.saturating_sub(before));
        if counted {
            self.lat.extend(all);
            self.elapsed += elapsed;
            self.cpu = self.cpu.zip(spent).map(|(sum, s)| sum + s);
        }
        Ok(())
    }

    pub fn calls(self) -> Calls {
        summarize(self.lat, self.elapsed, self.cpu)
    }
}

/// Place against two servers side by side, `secs` of calls to each after a
/// warm-up, in short turns A B B A repeated `rounds` times, so that a drift
/// of the machine (another build starting, the CPU's clock) hits both
/// alike and neither is always first.
pub async fn place_abba(
    mut a: Placer,
    mut b: Placer,
    secs: f64,
    rounds: usize,
) -> anyhow::Result<(Calls, Calls)> {
    a.run(secs / 5.0, false).await?;
    b.run(secs / 5.0, false).await?;
    let turn = secs / (2 * rounds.max(1)) as f64;
    for _ in 0..rounds.max(1) {
        a.run(turn, true).await?;
        b.run(turn, true).await?;
        b.run(turn, true).await?;
        a.run(turn, true).await?;
    }
    Ok((a.calls(), b.calls()))
}

/// The CPU time of process `pid`, user and system, of every thread it has
/// had (a thread's time stays counted after it ends, unlike its
/// `schedstat`), in clock ticks (10 ms here: over a few seconds of calls,
/// a fraction of a per cent).
fn process_cpu(pid: i32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command name, which may hold spaces: state is
    // the first, utime and stime the 12th and 13th.
    let rest = &stat[stat.rfind(')')? + 1..];
    let mut fields = rest.split_whitespace().skip(11);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    let tick = Duration::from_secs(1) / clock_ticks_per_sec();
    Some(tick * u32::try_from(utime + stime).ok()?)
}

/// CPU time spent during a phase: by the whole machine (every core,
/// every process, the kernel's own threads) and by this bench process
/// (the client of the agent, or the floor's own loop).
#[derive(Debug, Clone, Copy)]
pub struct PhaseCpu {
    pub machine: Duration,
    pub bench: Duration,
}

/// A reading of the machine's busy time and this process's CPU time; the
/// difference of two is a [`PhaseCpu`]. The machine's comes from
/// `/proc/stat` in clock ticks (10 ms here), so one phase is coarse;
/// summed over rounds it is not.
#[derive(Debug, Clone, Copy)]
pub struct CpuMark {
    machine_ticks: u64,
    bench: Duration,
}

impl CpuMark {
    pub fn now() -> Self {
        Self {
            machine_ticks: machine_busy_ticks(),
            bench: own_cpu(),
        }
    }

    /// What was spent since `self`.
    pub fn spent(&self) -> PhaseCpu {
        let later = Self::now();
        let tick = Duration::from_secs(1) / clock_ticks_per_sec();
        let ticks = later.machine_ticks.saturating_sub(self.machine_ticks);
        PhaseCpu {
            machine: tick * u32::try_from(ticks).unwrap_or(u32::MAX),
            bench: later.bench.saturating_sub(self.bench),
        }
    }
}

/// Busy clock ticks of all cores since boot: everything but idle, I/O
/// wait and time stolen by a hypervisor.
fn machine_busy_ticks() -> u64 {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return 0;
    };
    let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return 0;
    };
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal (guest time is
    // already counted in user).
    let field = |i: usize| f.get(i).copied().unwrap_or(0);
    field(0) + field(1) + field(2) + field(5) + field(6)
}

fn clock_ticks_per_sec() -> u32 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .and_then(|t| u32::try_from(t).ok())
        .filter(|t| *t > 0)
        .unwrap_or(100)
}

/// This process's CPU time, user and system, all threads.
fn own_cpu() -> Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    let Ok(usage) = getrusage(UsageWho::RUSAGE_SELF) else {
        return Duration::ZERO;
    };
    let time = |t: nix::sys::time::TimeVal| {
        Duration::from_secs(t.tv_sec().max(0) as u64)
            + Duration::from_micros(t.tv_usec().max(0) as u64)
    };
    time(usage.user_time()) + time(usage.system_time())
}

/// The floor of start and stop: a plain loop of tokio spawn of
/// `/bin/sleep` in its own process group, then SIGTERM and wait for each.
pub async fn floor_spawn(n: usize) -> anyhow::Result<(Duration, Duration, PhaseCpu)> {
    let t0 = Instant::now();
    let mut children = Vec::with_capacity(n);
    for _ in 0..n {
        let mut cmd = tokio::process::Command::new("/bin/sleep");
        cmd.arg("3600").process_group(0);
        children.push(cmd.spawn()?);
    }
    let started = t0.elapsed();
    let mark = CpuMark::now();
    let t1 = Instant::now();
    for c in &children {
        if let Some(pid) = c.id() {
            kill(Pid::from_raw(pid as i32), Signal::SIGTERM)?;
        }
    }
    for c in &mut children {
        c.wait().await?;
    }
    let stopped = t1.elapsed();
    Ok((started, stopped, mark.spent()))
}

/// The floor again, paying what a client of the agent pays besides the
/// agent's own work: each child's start and its stop are one zero-work
/// RPC (`floor`, the tonic floor's Place) each, all side by side.
pub async fn floor_spawn_rpc(
    n: usize,
    floor: &Client,
) -> anyhow::Result<(Duration, Duration, PhaseCpu)> {
    let call = |c: &Client| {
        let mut c = c.clone();
        async move {
            let req = pb::PlaceRequest {
                workload: "trivial".into(),
                on_full: 0,
                ..Default::default()
            };
            c.place(req).await.map(|_| ())
        }
    };
    let t0 = Instant::now();
    let starts: Vec<_> = (0..n)
        .map(|_| {
            let rpc = call(floor);
            tokio::spawn(async move {
                rpc.await?;
                let mut cmd = tokio::process::Command::new("/bin/sleep");
                cmd.arg("3600").process_group(0);
                anyhow::Ok(cmd.spawn()?)
            })
        })
        .collect();
    let mut children = Vec::with_capacity(n);
    for s in starts {
        children.push(s.await??);
    }
    let started = t0.elapsed();
    let mark = CpuMark::now();
    let t1 = Instant::now();
    let stops: Vec<_> = children
        .into_iter()
        .map(|mut child| {
            let rpc = call(floor);
            tokio::spawn(async move {
                rpc.await?;
                if let Some(pid) = child.id() {
                    kill(Pid::from_raw(pid as i32), Signal::SIGTERM)?;
                }
                child.wait().await?;
                anyhow::Ok(())
            })
        })
        .collect();
    for s in stops {
        s.await??;
    }
    let stopped = t1.elapsed();
    Ok((started, stopped, mark.spent()))
}

/// One round of [`agent_startstop`]: how long the starts and the stops
/// took, and the agent's CPU time in each (`None` when one of its threads
/// ended during the phase, so its time is lost).
#[derive(Debug, Clone, Copy)]
pub struct StartStop {
    /// Until every start answered READY.
    pub start: Duration,
    /// Until every stop answered.
    pub stop: Duration,
    /// The agent's CPU time while starting.
    pub start_cpu: Option<Duration>,
    /// The agent's CPU time while stopping.
    pub stop_cpu: Option<Duration>,
    /// The machine's and the client's CPU time while stopping.
    pub stop_machine: PhaseCpu,
}

/// Start `n` instances side by side until every one runs (readiness none,
/// so READY), then stop them all side by side; `agent` is the agent's pid,
/// whose CPU time each phase is measured.
pub async fn agent_startstop(
    c: &mut Client,
    agent: i32,
    n: usize,
    round: usize,
) -> anyhow::Result<StartStop> {
    let cpu = |before: &std::collections::HashMap<i32, u64>| {
        cpu_between(before, &thread_cpu_ns(agent))
            .ok()
            .map(Duration::from_nanos)
    };
    let ids: Vec<String> = (0..n).map(|i| format!("r{round}-{i}")).collect();
    let cpu0 = thread_cpu_ns(agent);
    let t0 = Instant::now();
    start_all(c, &ids).await?;
    let start = t0.elapsed();
    let start_cpu = cpu(&cpu0);
    let cpu1 = thread_cpu_ns(agent);
    let mark = CpuMark::now();
    let t1 = Instant::now();
    stop_all(c, &ids).await?;
    let stop = t1.elapsed();
    let stop_machine = mark.spent();
    Ok(StartStop {
        start,
        stop,
        start_cpu,
        stop_cpu: cpu(&cpu1),
        stop_machine,
    })
}

/// Makes each of `requests` with `call` on a clone of `c`, all side by
/// side; their answers, in order.
async fn side_by_side<Q, A, Fut>(
    c: &Client,
    requests: impl IntoIterator<Item = Q>,
    call: impl Fn(Client, Q) -> Fut,
) -> anyhow::Result<Vec<A>>
where
    Fut: std::future::Future<Output = Result<tonic::Response<A>, tonic::Status>> + Send + 'static,
    A: Send + 'static,
{
    let calls: Vec<_> = requests
        .into_iter()
        .map(|q| tokio::spawn(call(c.clone(), q)))
        .collect();
    let mut answers = Vec::with_capacity(calls.len());
    for call in calls {
        answers.push(call.await??.into_inner());
    }
    Ok(answers)
}

/// Starts `ids` (workload `trivial`) side by side; each must answer READY.
pub async fn start_all(c: &Client, ids: &[String]) -> anyhow::Result<()> {
    let requests = ids.iter().map(|id| crate::start("trivial", id));
    let answers = side_by_side(c, requests, |mut c, q| async move { c.start(q).await }).await?;
    for r in answers {
        let state = r.instance.map(|i| i.state);
        if state != Some(pb::State::Ready as i32) {
            bail!("a start did not end READY: {state:?}");
        }
    }
    Ok(())
}

/// Stops `ids` side by side.
pub async fn stop_all(c: &Client, ids: &[String]) -> anyhow::Result<()> {
    let requests = ids.iter().map(|id| pb::StopRequest {
        instance_id: id.clone(),
        grace_ms: 0,
    });
    side_by_side(c, requests, |mut c, q| async move { c.stop(q).await }).await?;
    Ok(())
}

/// Places `trivial` `n` times side by side: the agent's cost of an RPC
/// answered from its books alone (no process, no journal), with every
/// pool's figures in its Placement.
async fn place_all(c: &Client, n: usize) -> anyhow::Result<()> {
    let requests = (0..n).map(|_| pb::PlaceRequest {
        workload: "trivial".into(),
        on_full: 0,
        ..Default::default()
    });
    let answers = side_by_side(c, requests, |mut c, q| async move { c.place(q).await }).await?;
    if answers.iter().any(|p| !p.admitted) {
        bail!("a Place of `trivial` was not admitted");
    }
    Ok(())
}

/// Which phase of a storm is measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Storm {
    /// The start of 100.
    Start,
    /// 100 Place calls while the 100 run: an RPC with no process or
    /// journal behind it, for comparison.
    Place,
    /// The stop of 100.
    Stop,
}

impl Storm {
    /// The phase a command-line flag names (`--start-storm`,
    /// `--place-storm`, `--stop-storm`).
    pub fn from_flag(flag: &str) -> Option<Self> {
        match flag {
            "--start-storm" => Some(Self::Start),
            "--place-storm" => Some(Self::Place),
            "--stop-storm" => Some(Self::Stop),
            _ => None,
        }
    }
}

/// `resident-bench --stop-storm SOCKET ROUNDS [PERF_CTL_FIFO]` (or
/// `--start-storm`, `--place-storm`): the stop (or start) of 100 of the
/// start/stop rows (or 100 Place calls between them, no process or
/// journal behind them),
/// against an agent already running on `socket` (the bench's config:
/// workload `trivial`), for profiling. Each round starts 100 side by side,
/// then stops them side by side, with perf enabled through its control
/// FIFO (`perf record --control fifo:CTL,ACK -D -1 -p AGENT_PID`) during
/// the measured phase only; prints that phase's median. `perf stat -e
/// probe_libc:malloc` (after `perf probe -x LIBC malloc`) counts the
/// agent's allocations per stop the same way.
pub async fn storm(
    socket: &Path,
    phase: Storm,
    rounds: usize,
    ctl: Option<&Path>,
) -> anyhow::Result<()> {
    let perf = |command: &str| -> anyhow::Result<()> {
        if let Some(path) = ctl {
            use std::io::Write as _;
            let mut f = std::fs::OpenOptions::new().write(true).open(path)?;
            writeln!(f, "{command}")?;
        }
        Ok(())
    };
    let c = crate::connect(socket).await?;
    let mut took = Vec::with_capacity(rounds);
    let mut client_cpu = Duration::ZERO;
    for round in 0..rounds {
        let ids: Vec<String> = (0..100).map(|i| format!("storm{round}-{i}")).collect();
        for what in [Storm::Start, Storm::Place, Storm::Stop] {
            let measured = what == phase;
            if measured {
                perf("enable")?;
            }
            let (t, cpu) = (Instant::now(), own_cpu());
            match what {
                Storm::Start => start_all(&c, &ids).await?,
                Storm::Place => place_all(&c, ids.len()).await?,
                Storm::Stop => stop_all(&c, &ids).await?,
            }
            if measured {
                took.push(t.elapsed());
                client_cpu += own_cpu().saturating_sub(cpu);
                perf("disable")?;
            }
        }
    }
    let what = match phase {
        Storm::Start => "start",
        Storm::Place => "place",
        Storm::Stop => "stop",
    };
    println!(
        "{what} 100: median {:?} over {rounds} rounds; this client's CPU {:?} per round",
        median(took),
        client_cpu / u32::try_from(rounds.max(1)).unwrap_or(u32::MAX)
    );
    Ok(())
}

/// kill -9 of a running child until a subscribed Watch client receives
/// the instance's exit; the median over `rounds`.
pub async fn crash_detection(c: &mut Client, rounds: usize) -> anyhow::Result<Duration> {
    let mut stream = c
        .watch(pb::WatchRequest { since_revision: 0 })
        .await?
        .into_inner();
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let reader = tokio::spawn(async move {
        while let Some(Ok(e)) = stream.next().await {
            if tx.send((Instant::now(), e)).is_err() {
                return;
            }
        }
    });
    let ended = [pb::State::Exited as i32, pb::State::Failed as i32];
    let mut took = Vec::new();
    for round in 0..rounds {
        let id = format!("crash-{round}");
        let i = c
            .start(crate::start("trivial", &id))
            .await?
            .into_inner()
            .instance
            .context("an instance")?;
        while rx.try_recv().is_ok() {}
        let t0 = Instant::now();
        kill(Pid::from_raw(i.pid as i32), Signal::SIGKILL)?;
        let arrived = loop {
            let (at, e) = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .context("no event within 10 s")?
                .context("the watch ended")?;
            if e.instance
                .as_ref()
                .is_some_and(|x| x.instance_id == id && ended.contains(&x.state))
            {
                break at;
            }
        };
        took.push(arrived - t0);
    }
    reader.abort();
    Ok(median(took))
}

/// CPU time of each live thread of `pid`, in nanoseconds, by thread id.
pub fn thread_cpu_ns(pid: i32) -> std::collections::HashMap<i32, u64> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Default::default();
    };
    tasks
        .flatten()
        .filter_map(|t| {
            let tid = t.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
            Some((tid, stat.split_whitespace().next()?.parse().ok()?))
        })
        .collect()
}

/// The CPU `pid` used between two readings of `thread_cpu_ns`; an error
/// when a thread ended in between (its time would be lost).
pub fn cpu_between(
    before: &std::collections::HashMap<i32, u64>,
    after: &std::collections::HashMap<i32, u64>,
) -> anyhow::Result<u64> {
    if let Some(gone) = before.keys().find(|t| !after.contains_key(t)) {
        bail!("thread {gone} ended during the window; its CPU time is lost");
    }
    Ok(after
        .iter()
        .map(|(tid, ns)| ns.saturating_sub(before.get(tid).copied().unwrap_or(0)))
        .sum())
}

/// The peak resident set of `pid` (VmHWM), in bytes.
pub fn peak_rss(pid: i32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmHWM:"))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// With `n` idle children: the agent's CPU (fraction of one core) over
/// `secs`, and its peak RSS over the same window. The window starts once
/// the threads that served the starts have retired (tokio keeps an idle
/// blocking thread 10 s), and the peak is reset at its start
/// (`clear_refs` 5), so the start-up storm is not what is measured.
pub async fn idle(c: &mut Client, pid: i32, n: usize, secs: f64) -> anyhow::Result<(f64, u64)> {
    for i in 0..n {
        c.start(crate::start("trivial", &format!("idle-{i}")))
            .await?;
    }
    tokio::time::sleep(Duration::from_secs(11)).await;
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").context("resetting the peak RSS")?;
    let before = thread_cpu_ns(pid);
    tokio::time::sleep(Duration::from_secs_f64(secs)).await;
    let used = cpu_between(&before, &thread_cpu_ns(pid))?;
    let rss = peak_rss(pid);
    Ok((used as f64 / (secs * 1e9), rss))
}

/// What the churn did.
#[derive(Debug)]
pub struct Churn {
    pub per_sec: f64,
    pub p99: Duration,
    pub admitted: usize,
    pub refused: usize,
}

/// A churn call's answer, or an error naming the call once it has waited
/// [`CHURN_CALL_BOUND`]: a call the agent never answers fails the row
/// instead of hanging the harness, and for a call on an instance (`id`)
/// says how the agent (asked on a new connection) sees it then.
async fn answered<T>(
    socket: &Path,
    what: &str,
    id: Option<&str>,
    call: impl std::future::Future<Output = T>,
) -> anyhow::Result<T> {
    match tokio::time::timeout(CHURN_CALL_BOUND, call).await {
        Ok(answer) => Ok(answer),
        Err(_) => match id {
            Some(id) => {
                let seen = seen_as(socket, id).await;
                bail!(
                    "churn: {what} of '{id}' not answered within {CHURN_CALL_BOUND:?}; the agent sees it as {seen}"
                )
            }
            None => bail!("churn: a {what} not answered within {CHURN_CALL_BOUND:?}"),
        },
    }
}

/// How the agent sees instance `id` now (for the report of a call it never
/// answered).
async fn seen_as(socket: &Path, id: &str) -> String {
    let asked = async {
        let mut c = resident_api::connect_unix(socket).await?;
        let req = pb::GetRequest {
            instance_id: id.to_string(),
        };
        let i = c.get(req).await?.into_inner();
        anyhow::Ok(format!(
            "{} (pid {}, {:?})",
            pb::State::try_from(i.state).map_or("?", |s| s.as_str_name()),
            i.pid,
            i.message
        ))
    };
    match tokio::time::timeout(Duration::from_secs(5), asked).await {
        Ok(Ok(seen)) => seen,
        Ok(Err(e)) => format!("unknown ({e})"),
        Err(_) => "unknown (Get not answered either)".into(),
    }
}

/// How long one churn call may take (they take milliseconds).
const CHURN_CALL_BOUND: Duration = Duration::from_secs(30);

/// `calls` random Start / Stop / Place calls from `clients` connections.
pub async fn churn(socket: &Path, calls: usize, clients: usize) -> anyhow::Result<Churn> {
    let t0 = Instant::now();
    let mut tasks = Vec::new();
    for k in 0..clients {
        let mut c = resident_api::connect_unix(socket).await?;
        let mut rng = 0x9E37_79B9_7F4A_7C15u64 ^ (k as u64 + 1);
        let socket = socket.to_path_buf();
        tasks.push(tokio::spawn(async move {
            let mut next = move || {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                rng
            };
            let (mut lat, mut admitted, mut refused) = (Vec::new(), 0, 0);
            for _ in 0..calls / clients {
                let id = format!("c{}", next() % 64);
                let policy = (next() % 2 + 1) as i32;
                let t = Instant::now();
                match next() % 3 {
                    0 => {
                        let req = pb::StartRequest {
                            workload: "churn".into(),
                            instance_id: id.clone(),
                            on_full: policy,
                            wait_ready: false,
                            lease_ms: 0,
                        };
                        match answered(&socket, "start", Some(&id), c.start(req)).await? {
                            Ok(r) if r.get_ref().created => admitted += 1,
                            Ok(_) => {}
                            Err(s) if s.code() == tonic::Code::ResourceExhausted => refused += 1,
                            // Stopped before it was spawned, or being evicted.
                            Err(s)
                                if matches!(
                                    s.code(),
                                    tonic::Code::Aborted | tonic::Code::Unavailable
                                ) => {}
                            Err(s) => return Err(anyhow::anyhow!("start: {s}")),
                        }
                    }
                    1 => {
                        let req = pb::StopRequest {
                            instance_id: id.clone(),
                            grace_ms: 0,
                        };
                        match answered(&socket, "stop", Some(&id), c.stop(req)).await? {
                            Ok(_) => {}
                            Err(s) if s.code() == tonic::Code::NotFound => {}
                            Err(s) => return Err(anyhow::anyhow!("stop: {s}")),
                        }
                    }
                    _ => {
                        let req = pb::PlaceRequest {
                            workload: "churn".into(),
                            on_full: policy,
                            ..Default::default()
                        };
                        answered(&socket, "Place call", None, c.place(req)).await??;
                    }
                }
                lat.push(t.elapsed());
            }
            Ok((lat, admitted, refused))
        }));
    }
    let (mut lat, mut admitted, mut refused) = (Vec::new(), 0, 0);
    for t in tasks {
        let (l, a, r) = t.await??;
        lat.extend(l);
        admitted += a;
        refused += r;
    }
    let s = summarize(lat, t0.elapsed(), None);
    Ok(Churn {
        per_sec: s.per_sec,
        p99: s.p99,
        admitted,
        refused,
    })
}

/// After the churn: the pool never holds more than its budget, and holds
/// exactly the footprints of the instances that hold memory.
pub async fn check_books(c: &mut Client, pool: &str, budget: u64) -> anyhow::Result<()> {
    // Starts still spawning settle first.
    let deadline = Instant::now() + Duration::from_secs(30);
    let settled = [pb::State::Ready, pb::State::Exited, pb::State::Failed].map(|s| s as i32);
    let list = loop {
        let list = c.list(pb::ListRequest {}).await?.into_inner().instances;
        if list.iter().all(|i| settled.contains(&i.state)) {
            break list;
        }
        if Instant::now() > deadline {
            bail!("the churn never settled");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let held: u64 = list
        .iter()
        .filter(|i| i.state == pb::State::Ready as i32)
        .flat_map(|i| &i.demand)
        .filter(|d| d.pool == pool)
        .map(|d| d.weights_bytes + d.kv_budget_bytes)
        .sum();
    let node = c.node(pb::NodeRequest {}).await?.into_inner();
    let used = node
        .pools
        .iter()
        .find(|p| p.name == pool)
        .map(|p| p.used_bytes)
        .context("the pool")?;
    if used != held || used > budget {
        bail!(
            "books off after the churn: pool {pool} uses {used}, instances hold {held}, budget {budget}"
        );
    }
    Ok(())
}

/// supervisord, driven by `scripts/bench_supervisord.py` in its venv; its
/// waits for states are pushed, by an event listener of supervisord's own.
#[derive(Debug)]
pub struct Peer {
    pub python: PathBuf,
    pub script: PathBuf,
}

impl Peer {
    fn run(&self, args: &[String]) -> anyhow::Result<serde_json::Value> {
        let out = std::process::Command::new(&self.python)
            .arg(&self.script)
            .args(args)
            .output()
            .with_context(|| format!("running {}", self.script.display()))?;
        if !out.status.success() {
            bail!(
                "supervisord {args:?} failed: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    fn secs(v: &serde_json::Value, key: &str) -> anyhow::Result<Duration> {
        let s = v[key].as_f64().with_context(|| format!("{key} in {v}"))?;
        Ok(Duration::from_secs_f64(s))
    }

    /// Median start and stop of `n` programs.
    pub fn startstop(&self, n: usize, rounds: usize) -> anyhow::Result<(Duration, Duration)> {
        let v = self.run(&["startstop".into(), n.to_string(), rounds.to_string()])?;
        Ok((Self::secs(&v, "start_s")?, Self::secs(&v, "stop_s")?))
    }

    /// Median kill -9 to the pushed EXITED event.
    pub fn crash(&self, rounds: usize) -> anyhow::Result<Duration> {
        let v = self.run(&["crash".into(), rounds.to_string()])?;
        Self::secs(&v, "median_s")
    }

    /// CPU fraction and peak RSS with `n` idle programs.
    pub fn idle(&self, n: usize, secs: f64) -> anyhow::Result<(f64, u64)> {
        let v = self.run(&["idle".into(), n.to_string(), secs.to_string()])?;
        let cpu = v["cpu_fraction"].as_f64().context("cpu_fraction")?;
        let rss = v["peak_rss_bytes"].as_u64().context("peak_rss_bytes")?;
        Ok((cpu, rss))
    }
}
