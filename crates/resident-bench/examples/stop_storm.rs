//! A driver for profiling the stop of 100 the bench measures, one storm at
//! a time, under `perf`: against a running agent (the bench's config:
//! workload `trivial`), each round starts 100 instances side by side, then
//! (with `perf` enabled through its control FIFO, if given) stops them side
//! by side, and prints the median stop. For example:
//!
//! ```text
//! mkfifo ctl ack
//! perf record -g --control fifo:ctl,ack -D -1 -p AGENT_PID &
//! cargo run --release -p resident-bench --example stop_storm -- SOCKET 20 ctl
//! ```
//!
//! `perf stat -e probe_libc:malloc` (after `perf probe -x LIBC malloc`)
//! counts the agent's allocations per stop the same way.

use std::io::Write as _;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use resident_api::pb;

/// Writes `command` to perf's control FIFO, if there is one.
fn perf(ctl: Option<&str>, command: &str) -> anyhow::Result<()> {
    if let Some(path) = ctl {
        let mut f = std::fs::OpenOptions::new().write(true).open(path)?;
        writeln!(f, "{command}")?;
    }
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let socket = args
        .get(1)
        .context("usage: stop_storm SOCKET [ROUNDS] [PERF_CTL_FIFO]")?;
    let rounds: usize = args.get(2).map_or(Ok(10), |r| r.parse())?;
    let ctl = args.get(3).map(String::as_str);
    let n = 100;
    let deadline = Instant::now() + Duration::from_secs(20);
    let c = loop {
        match resident_api::connect_unix(socket).await {
            Ok(c) => break c,
            Err(e) if Instant::now() > deadline => return Err(e.into()),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    };
    let mut stops = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let ids: Vec<String> = (0..n).map(|i| format!("storm{round}-{i}")).collect();
        let starts: Vec<_> = ids
            .iter()
            .map(|id| {
                let mut c = c.clone();
                let req = pb::StartRequest {
                    workload: "trivial".into(),
                    instance_id: id.clone(),
                    ..Default::default()
                };
                tokio::spawn(async move { c.start(req).await })
            })
            .collect();
        for s in starts {
            s.await??;
        }
        perf(ctl, "enable")?;
        let t = Instant::now();
        let ends: Vec<_> = ids
            .iter()
            .map(|id| {
                let mut c = c.clone();
                let req = pb::StopRequest {
                    instance_id: id.clone(),
                    grace_ms: 0,
                };
                tokio::spawn(async move { c.stop(req).await })
            })
            .collect();
        for s in ends {
            s.await??;
        }
        stops.push(t.elapsed());
        perf(ctl, "disable")?;
    }
    stops.sort();
    println!(
        "stop {n}: median {:?} over {rounds} rounds",
        stops[stops.len() / 2]
    );
    Ok(())
}
