//! The fleet part: many agents on this machine, each its own process on
//! its own socket with a small config (one pool of a budget of its own, so
//! that every ranking has one best node, and one 1 GB workload), and the
//! Python package over all of them (scripts/bench_fleet.py, with the tests'
//! `.venv`), in one process: the ranked `Place` fan-out, then the fleet
//! view (one `WatchNode` stream per agent, ranked from its pictures,
//! `Place` on the best few), each timed one decision at a time, at two
//! fleet sizes; every view decision checked against a fan-out made right
//! after it. Also the agents' idle resident memory, each, and the view's
//! memory per node.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::report::{Row, Table};
use crate::{Plan, Server, spawn_agent_text};

/// Agent `i`'s config: a budget of 40 to 100 GB, in MB, different for each
/// of the first 60,000 agents (7919 is prime to 60,000).
fn config(i: usize) -> String {
    let mb = 40_000 + (i * 7919) % 60_000;
    format!(
        r#"[node]
name = "bench-fleet-{i}"
listen = "unix://@DIR@/agent.sock"
state_dir = "@DIR@/state"

[[pool]]
name = "ram"
budget = "{mb}MB"

[[workload]]
name = "m"
command = ["/bin/sleep", "3600"]
[workload.memory.ram]
weights = "1GB"
"#
    )
}

/// Waits until every agent's socket takes connections.
fn wait_all(agents: &[Server]) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(300);
    for a in agents {
        while std::os::unix::net::UnixStream::connect(&a.socket).is_err() {
            if Instant::now() > deadline {
                bail!("{} never served", a.socket.display());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    Ok(())
}

/// Resident bytes of `pid` (VmRSS).
fn rss(pid: i32) -> anyhow::Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .context("no VmRSS")?;
    Ok(kb * 1024)
}

/// One way's decisions, as bench_fleet.py reports them.
#[derive(Debug, Clone, Copy)]
struct Decisions {
    median: Duration,
    p99: Duration,
    client_cpu: Duration,
}

/// The view's decisions, and what they asked.
#[derive(Debug, Clone, Copy)]
struct ViewDecisions {
    d: Decisions,
    calls_mean: f64,
    calls_max: u64,
    agree: u64,
    decisions: u64,
}

struct Fleet {
    fan_out: Decisions,
    first: Duration,
    view: ViewDecisions,
    changing: ViewDecisions,
    ready: Duration,
    view_first: Duration,
    view_bytes_per_node: f64,
    rss_median: u64,
}

/// The number at `key` of `v`: a figure bench_fleet.py did not give is an
/// error, never a zero.
fn number(v: &serde_json::Value, key: &str) -> anyhow::Result<f64> {
    v[key]
        .as_f64()
        .with_context(|| format!("bench_fleet.py gave no number for {key:?} in {v}"))
}

fn seconds(v: &serde_json::Value, key: &str) -> anyhow::Result<Duration> {
    Ok(Duration::from_secs_f64(number(v, key)?))
}

fn decisions(v: &serde_json::Value) -> anyhow::Result<Decisions> {
    Ok(Decisions {
        median: seconds(v, "median_s")?,
        p99: seconds(v, "p99_s")?,
        client_cpu: seconds(v, "client_cpu_s")?,
    })
}

fn view_decisions(v: &serde_json::Value) -> anyhow::Result<ViewDecisions> {
    Ok(ViewDecisions {
        d: decisions(v)?,
        calls_mean: number(v, "place_calls_mean")?,
        calls_max: number(v, "place_calls_max")? as u64,
        agree: number(v, "agree")? as u64,
        decisions: number(v, "decisions")? as u64,
    })
}

fn measure(residentd: &Path, python: &Path, n: usize, rounds: usize) -> anyhow::Result<Fleet> {
    let agents: Vec<Server> = (0..n)
        .map(|i| spawn_agent_text(residentd, &config(i)))
        .collect::<anyhow::Result<_>>()?;
    wait_all(&agents)?;
    let mut rss_each: Vec<u64> = agents
        .iter()
        .map(|a| rss(a.pid()))
        .collect::<anyhow::Result<_>>()?;
    rss_each.sort_unstable();
    let list = tempfile::NamedTempFile::new()?;
    let sockets: Vec<String> = agents
        .iter()
        .map(|a| a.socket.display().to_string())
        .collect();
    std::fs::write(list.path(), sockets.join("\n"))?;
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/bench_fleet.py");
    let out = Command::new(python)
        .arg(script)
        .arg(list.path())
        .arg(rounds.to_string())
        .stderr(Stdio::inherit())
        .output()?;
    if !out.status.success() {
        bail!("bench_fleet.py over {n} agents failed");
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
    Ok(Fleet {
        fan_out: decisions(&v["fan_out"])?,
        first: seconds(&v["fan_out"], "first_s")?,
        view: view_decisions(&v["view"])?,
        changing: view_decisions(&v["view_changing"])?,
        ready: seconds(&v["view"], "ready_s")?,
        view_first: seconds(&v["view"], "first_s")?,
        view_bytes_per_node: number(&v["view"], "rss_per_node_bytes")?,
        rss_median: rss_each[rss_each.len() / 2],
    })
}

/// The view's figures in words.
fn said(v: &ViewDecisions) -> String {
    use crate::report::duration;
    format!(
        "median {}, p99 {} (the client's CPU: {}); Place calls per decision {:.2} (at most {}); same first choice as a fan-out right after: {} of {}",
        duration(v.d.median),
        duration(v.d.p99),
        duration(v.d.client_cpu),
        v.calls_mean,
        v.calls_max,
        v.agree,
        v.decisions
    )
}

/// The rows; a note instead when there is no python with the package.
pub fn rows(
    plan: &Plan,
    residentd: &Path,
    python: Option<&Path>,
    table: &mut Table,
) -> anyhow::Result<()> {
    use crate::report::duration;
    let Some(python) = crate::python_with(python, "residentd.fleet", "fleet", table) else {
        return Ok(());
    };
    let (small, large) = plan.fleet_sizes;
    let a = measure(residentd, python, small, plan.fleet_rounds)?;
    let b = measure(residentd, python, large, plan.fleet_rounds)?;
    for (n, f) in [(small, &a), (large, &b)] {
        table.push(Row::note(
            format!("fleet: ranked Place fan-out over {n} agents"),
            format!(
                "median {} (the client's own CPU: {}), p99 {} (first, connecting: {}); agent idle RSS {:.1} MB each (median)",
                duration(f.fan_out.median),
                duration(f.fan_out.client_cpu),
                duration(f.fan_out.p99),
                duration(f.first),
                f.rss_median as f64 / 1e6
            ),
        ));
        table.push(Row::note(
            format!("fleet: view over {n} agents, nothing changing"),
            format!(
                "{}; every picture in {}, the first decision (every node estimated) {}, {:.1} KB of the client's memory per node",
                said(&f.view),
                duration(f.ready),
                duration(f.view_first),
                f.view_bytes_per_node / 1e3
            ),
        ));
        table.push(Row::note(
            format!("fleet: view over {n} agents, another scheduler's start between decisions"),
            said(&f.changing),
        ));
        table.push(Row::latency(
            format!("fleet: view vs fan-out, p99 per decision, {n} agents"),
            f.view.d.p99,
            f.fan_out.p99,
            None,
            "",
        ));
    }
    table.push(Row::latency(
        format!("fleet: fan-out median, {large} vs {small} agents"),
        b.fan_out.median,
        a.fan_out.median,
        None,
        &format!("<= 12x for {}x the agents", large / small.max(1)),
    ));
    table.push(Row::latency(
        format!("fleet: view median, {large} vs {small} agents"),
        b.view.d.median,
        a.view.d.median,
        None,
        "",
    ));
    table.push(Row::peer_latency(
        &format!("fleet: fan-out p99 over {large} agents"),
        b.fan_out.p99,
        None,
        "<= 1 s",
    ));
    table.push(Row::peer_latency(
        &format!("fleet: view p99 over {large} agents"),
        b.view.d.p99,
        None,
        "<= 10 ms, <= 3 Place calls",
    ));
    Ok(())
}
