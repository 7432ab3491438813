//! The sleep part (`[workload.sleep]`), through `residentd-router`, side
//! by side in one run:
//!
//! - A request (answered in full) for a model that is asleep, against the
//!   same request for the model stopped (a cold start of the same server):
//!   for the vLLM stand-in (tests/sleep/standin.py, which really frees its
//!   memory asleep and takes it again at the wake) and, when
//!   scripts/llama-server has built it, for the real llama-server (which
//!   sleeps by itself after its idle time).
//! - A swap A -> B -> A on a pool that holds one awake model: with sleep
//!   (the planner puts the other to sleep), against the same with
//!   eviction (workloads without `[workload.sleep]`).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use resident_api::pb;
use resident_api::pb::node_agent_client::NodeAgentClient;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tonic::transport::Channel;

use crate::report::{Row, Table};
use crate::router::{free_port, spawn_router, wait_http};
use crate::{Plan, Server, connect, measure, spawn_agent_text};

/// Megabytes the stand-in holds awake (really allocated and touched).
const STANDIN_MB: u32 = 400;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// An agent config with pools `gpu` (holds one awake model) and `ram`,
/// and the stand-in as workloads `a` and `b`, sleeping or not.
fn standin_config(sleeps: bool) -> String {
    let script = workspace().join("tests/sleep/standin.py");
    let mut text = String::from(
        "[node]\nname = \"bench-sleep\"\nlisten = \"unix://@DIR@/agent.sock\"\nstate_dir = \"@DIR@/state\"\non_full = \"evict\"\n\n[[pool]]\nname = \"gpu\"\nbudget = \"2GB\"\n\n[[pool]]\nname = \"ram\"\nbudget = \"8GB\"\n",
    );
    for name in ["a", "b"] {
        text += &format!(
            "\n[[workload]]\nname = \"{name}\"\ncommand = [\"python3\", \"-u\", \"{}\", \"${{PORT}}\", \"{STANDIN_MB}\"]\nstop_grace = \"5s\"\n[workload.memory.gpu]\nweights = \"1.5GB\"\n[workload.readiness]\nhttp = \"/health\"\ntimeout = \"60s\"\n[workload.restart]\npolicy = \"never\"\n",
            script.display()
        );
        if sleeps {
            text += "[workload.sleep]\nsleep = \"POST /sleep?level=1\"\nwake = \"POST /wake_up\"\n[workload.sleep.memory.gpu]\noverhead = \"0.1GB\"\n[workload.sleep.memory.ram]\nweights = \"1.5GB\"\n";
        }
    }
    text
}

/// An agent config with one llama-server workload `l` on `model`, asleep
/// after 1 s idle.
fn llama_config(server: &Path, model: &Path) -> String {
    format!(
        "[node]\nname = \"bench-sleep\"\nlisten = \"unix://@DIR@/agent.sock\"\nstate_dir = \"@DIR@/state\"\n\n[[pool]]\nname = \"ram\"\nbudget = \"8GB\"\n\n[[workload]]\nname = \"l\"\nflavor = \"llama-server\"\nprogram = \"{}\"\nmodel = \"{}\"\nctx = 512\nparallel = 1\n[workload.sleep]\nidle = \"1s\"\n",
        server.display(),
        model.display()
    )
}

/// One chat completion of `model` through the router on `port`, read to
/// its end; how long it took.
async fn ask(port: u16, model: &str) -> anyhow::Result<Duration> {
    let body = format!(
        r#"{{"model": "{model}", "max_tokens": 1, "messages": [{{"role": "user", "content": "hello"}}]}}"#
    );
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    let began = Instant::now();
    let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
    s.set_nodelay(true)?;
    s.write_all(request.as_bytes()).await?;
    let mut seen = Vec::new();
    s.read_to_end(&mut seen).await?;
    let status = String::from_utf8_lossy(&seen[..seen.len().min(16)]).into_owned();
    if status.split_whitespace().nth(1) != Some("200") {
        bail!(
            "{model}: {}",
            String::from_utf8_lossy(&seen)
                .lines()
                .next()
                .unwrap_or("no answer")
        );
    }
    Ok(began.elapsed())
}

/// `"METHOD /path"` straight to a server on `port`; Err unless 2xx.
async fn call(port: u16, what: &str) -> anyhow::Result<()> {
    let (method, path) = what.split_once(' ').context("METHOD /path")?;
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
    s.write_all(request.as_bytes()).await?;
    let mut seen = Vec::new();
    s.read_to_end(&mut seen).await?;
    let status = String::from_utf8_lossy(&seen[..seen.len().min(16)]).into_owned();
    if !status
        .split_whitespace()
        .nth(1)
        .is_some_and(|c| c.starts_with('2'))
    {
        bail!("{what} on {port}: {status}");
    }
    Ok(())
}

async fn state(c: &mut NodeAgentClient<Channel>, id: &str) -> Option<pb::State> {
    let i = c
        .get(pb::GetRequest {
            instance_id: id.into(),
        })
        .await
        .ok()?
        .into_inner();
    pb::State::try_from(i.state).ok()
}

/// Waits (bounded) until `id` is in `want`.
async fn wait_state(
    c: &mut NodeAgentClient<Channel>,
    id: &str,
    want: pb::State,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    while state(c, id).await != Some(want) {
        if Instant::now() > deadline {
            bail!("{id} never became {want:?}");
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Waits (bounded) until a Start of `workload` would be admitted as
/// things stand (the router's hold on the last model has ended).
async fn placeable(c: &mut NodeAgentClient<Channel>, workload: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let p = c
            .place(pb::PlaceRequest {
                workload: workload.into(),
                on_full: pb::Policy::Evict as i32,
                ..Default::default()
            })
            .await?
            .into_inner();
        if p.admitted {
            return Ok(());
        }
        if Instant::now() > deadline {
            bail!("{workload} never became placeable");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

async fn stop(c: &mut NodeAgentClient<Channel>, id: &str) -> anyhow::Result<()> {
    c.stop(pb::StopRequest {
        instance_id: id.into(),
        grace_ms: 0,
    })
    .await?;
    Ok(())
}

/// An agent on `config` and a router in front of it: (agent, router, the
/// router's port, a client of the agent).
async fn agent_and_router(
    residentd: &Path,
    router: &Path,
    config: &str,
) -> anyhow::Result<(Server, Server, u16, NodeAgentClient<Channel>)> {
    let agent = spawn_agent_text(residentd, config)?;
    let c = connect(&agent.socket).await?;
    let port = free_port()?;
    let routed = spawn_router(router, &agent.socket, port)?;
    wait_http(port).await?;
    Ok((agent, routed, port, c))
}

pub async fn rows(
    plan: &Plan,
    residentd: &Path,
    router: &Path,
    python: Option<&Path>,
    table: &mut Table,
) -> anyhow::Result<()> {
    let rounds = plan.sleep_rounds;
    // The stand-in: asleep against stopped.
    let (_agent, _router, port, mut c) =
        agent_and_router(residentd, router, &standin_config(true)).await?;
    let (mut woken, mut cold) = (Vec::new(), Vec::new());
    ask(port, "a").await?;
    for _ in 0..rounds {
        placeable(&mut c, "a").await?;
        c.sleep(pb::SleepRequest {
            instance_id: "a".into(),
        })
        .await?;
        woken.push(ask(port, "a").await?);
        placeable(&mut c, "a").await?;
        stop(&mut c, "a").await?;
        cold.push(ask(port, "a").await?);
    }
    // What residentd adds to a wake: the server's own calls, straight to
    // its port (behind the agent's back: the books still say awake),
    // then the same request straight to it.
    let mut own = Vec::new();
    for _ in 0..rounds {
        placeable(&mut c, "a").await?;
        ask(port, "a").await?;
        let i = c
            .get(pb::GetRequest {
                instance_id: "a".into(),
            })
            .await?
            .into_inner();
        let direct = u16::try_from(i.port).unwrap_or(0);
        call(direct, "POST /sleep?level=1").await?;
        let began = Instant::now();
        call(direct, "POST /wake_up").await?;
        ask(direct, "a").await?;
        own.push(began.elapsed());
    }
    let woken = measure::median(woken);
    table.push(Row::latency(
        format!("sleep: vLLM stand-in ({STANDIN_MB} MB), a request asleep (wake) vs stopped (cold start)"),
        woken,
        measure::median(cold),
        None,
        "<= 0.2x",
    ));
    table.push(Row::latency(
        "sleep: the same wake through the router, vs the server's own wake call and the request straight to it".into(),
        woken,
        measure::median(own),
        None,
        "reported",
    ));

    // A -> B -> A: with sleep, against with eviction.
    let swap = |sleeps: bool| async move {
        let (_agent, _router, port, mut c) =
            agent_and_router(residentd, router, &standin_config(sleeps)).await?;
        ask(port, "a").await?;
        let mut took = Vec::new();
        for _ in 0..rounds {
            placeable(&mut c, "b").await?;
            let began = Instant::now();
            ask(port, "b").await?;
            placeable(&mut c, "a").await?;
            ask(port, "a").await?;
            took.push(began.elapsed());
        }
        Ok::<_, anyhow::Error>(measure::median(took))
    };
    let with_sleep = swap(true).await?;
    let with_eviction = swap(false).await?;
    table.push(Row::latency(
        "sleep: swap a -> b -> a through the router, with sleep vs with eviction".into(),
        with_sleep,
        with_eviction,
        None,
        "< 1x",
    ));

    // The real llama-server, when built, and a python to write its model.
    let Some((server, _models, model)) =
        crate::llama_server_and_model(python, "sleep (llama-server)", 1024, 8, table)?
    else {
        return Ok(());
    };
    let (_agent, _router, port, mut c) =
        agent_and_router(residentd, router, &llama_config(&server, &model)).await?;
    let (mut woken, mut cold) = (Vec::new(), Vec::new());
    ask(port, "l").await?;
    for _ in 0..rounds {
        wait_state(&mut c, "l", pb::State::Sleeping).await?;
        woken.push(ask(port, "l").await?);
        placeable(&mut c, "l").await?;
        stop(&mut c, "l").await?;
        cold.push(ask(port, "l").await?);
    }
    table.push(Row::latency(
        "sleep: llama-server (8-layer model), a request asleep (wakes by itself) vs stopped (cold start)".into(),
        measure::median(woken),
        measure::median(cold),
        None,
        "reported",
    ));
    Ok(())
}
