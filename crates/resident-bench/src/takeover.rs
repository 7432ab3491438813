//! The takeover: N instances running (`instances_outlive_agent`, the
//! default), the agent killed with kill -9 and started again on the same
//! state, or upgraded in place (the `Upgrade` RPC). How long until the
//! agent serves again and until every instance is READY, how many
//! instances were restarted (their pid changed, or `restarts` grew), and
//! for the upgrade the longest pause a client calling `Node` in a loop
//! saw. Beside an agent started on an empty journal, to its first answer.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use resident_api::pb;

use crate::report::{Row, Table};
use crate::{Plan, all_ready, connect, measure, spawn_agent, start};

/// How many of `after` are not the run `before` had (another pid, or more
/// restarts).
/// Waits (bounded) until the journal of the agent serving `socket` names
/// each of `runs` with its process group.
async fn journaled(
    socket: &std::path::Path,
    runs: &BTreeMap<String, (u32, u32)>,
) -> anyhow::Result<()> {
    let state = socket.with_file_name("state");
    let journal = residentd::journal::Journal::open(&state)
        .with_context(|| format!("the journal in {}", state.display()))?;
    let began = Instant::now();
    loop {
        let entries = journal.peek().entries;
        let named = |id: &String| entries.iter().any(|e| &e.instance == id && e.pgid > 0);
        if runs.keys().all(named) {
            return Ok(());
        }
        anyhow::ensure!(
            began.elapsed() < Duration::from_secs(30),
            "the journal did not name every run within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

fn restarted(before: &BTreeMap<String, (u32, u32)>, after: &[pb::Instance]) -> usize {
    after
        .iter()
        .filter(|i| before.get(&i.instance_id) != Some(&(i.pid, i.restarts)))
        .count()
}

pub async fn rows(plan: &Plan, residentd: &Path, table: &mut Table) -> anyhow::Result<()> {
    let n = plan.comeback_instances;
    let (mut fresh, mut serving, mut ready, mut killed_restarts) =
        (Vec::new(), Vec::new(), Vec::new(), 0);
    let (mut answered, mut upgraded_ready, mut pauses, mut upgrade_restarts) =
        (Vec::new(), Vec::new(), Vec::new(), 0);
    for _ in 0..plan.comeback_rounds {
        let t = Instant::now();
        let empty = spawn_agent(residentd)?;
        connect(&empty.socket)
            .await?
            .node(pb::NodeRequest {})
            .await?;
        fresh.push(t.elapsed());
        drop(empty);

        let mut agent = spawn_agent(residentd)?;
        let mut c = connect(&agent.socket).await?;
        let mut starts = tokio::task::JoinSet::new();
        for i in 0..n {
            let mut c = c.clone();
            starts.spawn(async move { c.start(start("trivial", &format!("t{i}"))).await });
        }
        while let Some(done) = starts.join_next().await {
            done.context("a start task")??;
        }
        let runs = |list: &[pb::Instance]| -> BTreeMap<String, (u32, u32)> {
            list.iter()
                .map(|i| (i.instance_id.clone(), (i.pid, i.restarts)))
                .collect()
        };
        let (_, list) = all_ready(&mut c, n, Instant::now()).await?;
        let before = runs(&list);
        // The kill -9 comes once the journal names every run's process
        // (what the next agent takes over), not after a guess.
        journaled(&agent.socket, &before).await?;

        let t = agent.kill_and_respawn(residentd)?;
        let mut c = connect(&agent.socket).await?;
        c.node(pb::NodeRequest {}).await?;
        serving.push(t.elapsed());
        let (took, list) = all_ready(&mut c, n, t).await?;
        ready.push(took);
        killed_restarts += restarted(&before, &list);

        // An upgrade in place, while a client calls Node in a loop (a new
        // channel whenever one fails, as a client would reconnect).
        let before = runs(&list);
        let socket = agent.socket.clone();
        let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
        let caller = tokio::spawn(async move {
            let mut longest = Duration::ZERO;
            let mut last = Instant::now();
            let mut c = connect(&socket).await?;
            loop {
                if stopped.try_recv().is_ok() {
                    return Ok::<_, anyhow::Error>(longest);
                }
                match c.node(pb::NodeRequest {}).await {
                    Ok(_) => {
                        longest = longest.max(last.elapsed());
                        last = Instant::now();
                    }
                    Err(_) => c = connect(&socket).await?,
                }
            }
        });
        let t = Instant::now();
        let up = c.upgrade(pb::UpgradeRequest {}).await?.into_inner();
        answered.push(t.elapsed());
        let mut c = connect(&agent.socket).await?;
        let (took, list) = all_ready(&mut c, n, t).await?;
        upgraded_ready.push(took);
        upgrade_restarts += restarted(&before, &list);
        let _ = stop.send(());
        pauses.push(caller.await.context("the calling client")??);
        // The agent the upgrade started is not our child: its SIGTERM
        // stops its instances, and it is waited for here.
        let new = c.node(pb::NodeRequest {}).await?.into_inner().agent_pid as i32;
        anyhow::ensure!(
            new != agent.pid() && up.new_version == env!("CARGO_PKG_VERSION"),
            "the upgrade left the same agent: {up:?}"
        );
        let _ = agent.child.wait();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(new),
            nix::sys::signal::Signal::SIGTERM,
        )?;
        let gone = Instant::now();
        while nix::sys::signal::kill(nix::unistd::Pid::from_raw(new), None).is_ok() {
            anyhow::ensure!(
                gone.elapsed() < Duration::from_secs(60),
                "the upgraded agent did not stop"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    let fresh = measure::median(fresh);
    let rounds = plan.comeback_rounds;
    // No floor does the same work (an empty agent's start-up takes over
    // nothing): the rows stand alone, and the empty agent is a note.
    table.push(Row::note(
        "takeover: an empty agent serving after its start (for scale, not a floor)".into(),
        crate::report::duration(fresh),
    ));
    table.push(Row::peer_latency(
        &format!("takeover: serving after kill -9 with {n} running"),
        measure::median(serving),
        None,
        "<= 100 ms",
    ));
    table.push(Row::peer_latency(
        &format!("takeover: all {n} READY again after kill -9"),
        measure::median(ready),
        None,
        "<= 1 s",
    ));
    table.push(Row::must_be_zero(
        format!("takeover: instances restarted by kill -9 ({rounds} rounds of {n})"),
        killed_restarts as u64,
    ));
    table.push(Row::peer_latency(
        &format!("takeover: Upgrade answered (the new agent serving) with {n} running"),
        measure::median(answered),
        None,
        "<= 1 s",
    ));
    table.push(Row::peer_latency(
        &format!("takeover: all {n} READY under the upgraded agent, from the call"),
        measure::median(upgraded_ready),
        None,
        "<= 1 s",
    ));
    table.push(Row::peer_latency(
        "takeover: longest pause a client calling Node saw across the upgrade",
        measure::median(pauses),
        None,
        "<= 1 s",
    ));
    table.push(Row::must_be_zero(
        format!("takeover: instances restarted by the upgrade ({rounds} rounds of {n})"),
        upgrade_restarts as u64,
    ));
    Ok(())
}
