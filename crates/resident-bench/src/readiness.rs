//! The readiness-lag part: servers that load for a while (503, then 200,
//! like a model server) started through the agent, and the time from the
//! moment each could first answer 200 to the READY event a Watch client
//! receives. Two kinds of server: one that logs a line when it is ready
//! (as llama-server and uvicorn do) and one that says nothing, so the
//! steady probe interval is measured on its own.
//!
//! The servers are this binary re-executed (`--serve-loading MS`); each
//! writes the wall-clock instant it turns ready into a file before it
//! gets there, and the harness compares it with the wall clock when the
//! event arrives (both on this machine's clock).

use std::io::{Read as _, Write as _};
use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context as _;
use resident_api::pb;
use tokio_stream::StreamExt as _;

use crate::report::{Row, Table};
use crate::{Plan, connect, spawn_agent_text};

const NODE: &str = r#"[node]
name = "bench-readiness"
listen = "unix://@DIR@/agent.sock"
state_dir = "@DIR@/state"

[[pool]]
name = "ram"
budget = "1000GB"
"#;

/// A workload of this binary's loading server; `announce` is 0 or 1.
fn workload(name: &str, announce: u8) -> String {
    format!(
        r#"
[[workload]]
name = "{name}"
command = ["@BENCH@", "--serve-loading", "@MS@"]
env = {{ PORT = "${{PORT}}", READY_AT = "@DIR@/ready-${{INSTANCE}}", ANNOUNCE = "{announce}" }}
[workload.memory.ram]
weights = "1GB"
[workload.readiness]
http = "/health"
timeout = "60s"
[workload.restart]
policy = "never"
"#
    )
}

/// The child: serves `GET /health` on `$PORT`, 503 for `loading_ms`, then
/// 200; writes the instant it turns ready (Unix ns) to `$READY_AT` first,
/// and with `ANNOUNCE=1` prints a line at that instant.
pub fn serve_loading(loading_ms: u64) -> anyhow::Result<()> {
    let port: u16 = std::env::var("PORT")?.parse()?;
    let listener = TcpListener::bind(("127.0.0.1", port))?;
    let ready_at = SystemTime::now() + Duration::from_millis(loading_ms);
    let ns = ready_at.duration_since(UNIX_EPOCH)?.as_nanos();
    std::fs::write(std::env::var("READY_AT")?, ns.to_string())?;
    if std::env::var("ANNOUNCE").as_deref() == Ok("1") {
        std::thread::spawn(move || {
            if let Ok(wait) = ready_at.duration_since(SystemTime::now()) {
                std::thread::sleep(wait);
            }
            println!("model loaded, serving on 127.0.0.1:{port}");
        });
    }
    for conn in listener.incoming() {
        let Ok(mut conn) = conn else { continue };
        let mut buf = [0u8; 1024];
        let _ = conn.read(&mut buf);
        let status = if SystemTime::now() >= ready_at {
            "200 OK"
        } else {
            "503 Service Unavailable"
        };
        let _ = write!(
            conn,
            "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
    }
    Ok(())
}

/// One row per kind of server: the median lag over every instance.
pub async fn rows(plan: &Plan, residentd: &Path, table: &mut Table) -> anyhow::Result<()> {
    let bench = std::env::current_exe()?;
    let config = format!(
        "{NODE}{}{}",
        workload("loading-silent", 0),
        workload("loading-announced", 1)
    )
    .replace("@BENCH@", &bench.display().to_string())
    .replace("@MS@", &plan.loading_ms.to_string());
    let agent = spawn_agent_text(residentd, &config)?;
    let dir = agent.socket.parent().context("the agent's directory")?;
    for (workload, label) in [
        ("loading-announced", "server logs when ready"),
        ("loading-silent", "silent server"),
    ] {
        let mut lags = Vec::new();
        for round in 0..plan.ready_rounds {
            lags.extend(round_lags(plan, &agent.socket, dir, workload, round).await?);
        }
        let (median, worst) = (crate::measure::median(lags.clone()), lags.iter().max());
        table.push(Row::peer_latency(
            &format!(
                "READY after loading {} ms, {label} (median of {}, max {})",
                plan.loading_ms,
                lags.len(),
                crate::report::duration(worst.copied().unwrap_or_default()),
            ),
            median,
            None,
            "<= 30 ms",
        ));
    }
    Ok(())
}

/// Starts `plan.ready_instances` servers side by side and returns, for
/// each, the time from its ready instant to the READY event.
async fn round_lags(
    plan: &Plan,
    socket: &Path,
    dir: &Path,
    workload: &str,
    round: usize,
) -> anyhow::Result<Vec<Duration>> {
    let mut c = connect(socket).await?;
    let mut events = c
        .watch(pb::WatchRequest { since_revision: 0 })
        .await?
        .into_inner();
    let ids: Vec<String> = (0..plan.ready_instances)
        .map(|i| format!("{workload}-{round}-{i}"))
        .collect();
    // Events are stamped as they arrive, by a task of their own.
    let wanted = ids.clone();
    let listener = tokio::spawn(async move {
        let mut heard = std::collections::HashMap::new();
        while heard.len() < wanted.len() {
            let e = tokio::time::timeout(Duration::from_secs(60), events.next())
                .await
                .context("no READY within 60 s")?
                .context("the watch ended")??;
            let at = SystemTime::now();
            if let Some(i) = e.instance.filter(|i| wanted.contains(&i.instance_id))
                && i.state == pb::State::Ready as i32
            {
                heard.entry(i.instance_id).or_insert(at);
            }
        }
        Ok::<_, anyhow::Error>(heard)
    });
    for id in &ids {
        let mut req = crate::start(workload, id);
        req.wait_ready = false;
        c.start(req).await?;
    }
    let heard = listener.await??;
    let mut lags = Vec::new();
    for id in &ids {
        let text = std::fs::read_to_string(dir.join(format!("ready-{id}")))?;
        let ready_at = UNIX_EPOCH + Duration::from_nanos(text.trim().parse()?);
        // A READY before the ready instant would be a probe bug.
        let lag = heard[id]
            .duration_since(ready_at)
            .with_context(|| format!("{id} was reported READY before it was ready"))?;
        lags.push(lag);
        c.stop(pb::StopRequest {
            instance_id: id.clone(),
            grace_ms: 0,
        })
        .await?;
    }
    Ok(lags)
}
