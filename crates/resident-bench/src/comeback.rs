//! The comeback: an agent whose instances die with it
//! (`instances_outlive_agent = false`) killed (kill -9) with N instances
//! running, then started again on the same state. How long until it serves
//! again (its first answer), and until every journaled instance is READY
//! again (spawned anew); beside an agent started on an empty journal, side
//! by side. `takeover.rs` has the default, instances that outlive it.

use std::path::Path;
use std::time::Instant;

use anyhow::Context as _;
use resident_api::pb;

use crate::report::{Row, Table};
use crate::{Plan, all_ready, connect, measure, spawn_agent, spawn_agent_with, start};

pub async fn rows(plan: &Plan, residentd: &Path, table: &mut Table) -> anyhow::Result<()> {
    let n = plan.comeback_instances;
    let (mut fresh, mut serving, mut ready) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..plan.comeback_rounds {
        // The floor: an agent with nothing to restore, to its first answer.
        let t = Instant::now();
        let empty = spawn_agent(residentd)?;
        connect(&empty.socket)
            .await?
            .node(pb::NodeRequest {})
            .await?;
        fresh.push(t.elapsed());
        drop(empty);

        let mut agent = spawn_agent_with(residentd, "instances_outlive_agent = false")?;
        let c = connect(&agent.socket).await?;
        let mut starts = tokio::task::JoinSet::new();
        for i in 0..n {
            let mut c = c.clone();
            starts.spawn(async move { c.start(start("trivial", &format!("c{i}"))).await });
        }
        while let Some(done) = starts.join_next().await {
            done.context("a start task")??;
        }
        let t = agent.kill_and_respawn(residentd)?;
        let mut c = connect(&agent.socket).await?;
        c.node(pb::NodeRequest {}).await?;
        serving.push(t.elapsed());
        ready.push(all_ready(&mut c, n, t).await?.0);
    }
    let fresh = measure::median(fresh);
    table.push(Row::latency(
        format!("comeback: serving after kill -9 with {n} journaled, vs an empty agent"),
        measure::median(serving),
        fresh,
        None,
        "<= 1 s",
    ));
    table.push(Row::latency(
        format!("comeback: all {n} READY again after kill -9, vs an empty agent serving"),
        measure::median(ready),
        fresh,
        None,
        "<= 2 s",
    ));
    Ok(())
}
