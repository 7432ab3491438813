//! The fleet part: many agents on this machine, each its own process on
//! its own socket with a small config, and the Python package's ranked
//! `Place` fan-out over all of them (scripts/bench_fleet.py, with the
//! tests' `.venv`), timed one whole fan-out at a time, at two fleet sizes.
//! Also the agents' idle resident memory, each.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};

use crate::report::{Row, Table};
use crate::{Plan, Server, spawn_agent_text};

const CONFIG: &str = r#"[node]
name = "bench-fleet"
listen = "unix://@DIR@/agent.sock"
state_dir = "@DIR@/state"

[[pool]]
name = "ram"
budget = "100GB"

[[workload]]
name = "m"
command = ["/bin/sleep", "3600"]
[workload.memory.ram]
weights = "1GB"
"#;

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

struct FanOut {
    median: Duration,
    client_cpu: Duration,
    p99: Duration,
    first: Duration,
    rss_median: u64,
}

fn fan_out(residentd: &Path, python: &Path, n: usize, rounds: usize) -> anyhow::Result<FanOut> {
    let agents: Vec<Server> = (0..n)
        .map(|_| spawn_agent_text(residentd, CONFIG))
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
    let secs = |k: &str| Duration::from_secs_f64(v[k].as_f64().unwrap_or(0.0));
    Ok(FanOut {
        median: secs("median_s"),
        client_cpu: secs("client_cpu_s"),
        p99: secs("p99_s"),
        first: secs("first_s"),
        rss_median: rss_each[rss_each.len() / 2],
    })
}

/// The rows; a note instead when there is no python with the package.
pub fn rows(
    plan: &Plan,
    residentd: &Path,
    python: Option<&Path>,
    table: &mut Table,
) -> anyhow::Result<()> {
    let Some(python) = crate::python_with(python, "residentd.fleet", "fleet", table) else {
        return Ok(());
    };
    let (small, large) = plan.fleet_sizes;
    let a = fan_out(residentd, python, small, plan.fleet_rounds)?;
    let b = fan_out(residentd, python, large, plan.fleet_rounds)?;
    for (n, f) in [(small, &a), (large, &b)] {
        table.push(Row::note(
            format!("fleet: ranked Place fan-out over {n} agents"),
            format!(
                "median {} (the client's own CPU: {}), p99 {} (first, connecting: {}); agent idle RSS {:.1} MB each (median)",
                crate::report::duration(f.median),
                crate::report::duration(f.client_cpu),
                crate::report::duration(f.p99),
                crate::report::duration(f.first),
                f.rss_median as f64 / 1e6
            ),
        ));
    }
    table.push(Row::latency(
        format!("fleet: fan-out median, {large} vs {small} agents"),
        b.median,
        a.median,
        None,
        &format!("<= 12x for {}x the agents", large / small.max(1)),
    ));
    table.push(Row::peer_latency(
        &format!("fleet: fan-out p99 over {large} agents"),
        b.p99,
        None,
        "<= 1 s",
    ));
    Ok(())
}
