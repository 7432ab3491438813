//! The router part: the same llama-cpp-python server reached directly and
//! through `residentd-router`, side by side, request by request in turn.
//!
//! - Time to the first SSE event of a streamed chat completion on a warm
//!   model (median): the router's added latency.
//! - Streamed events per second of a long completion, over the whole
//!   request (median).
//! - A swap: a request for model B while A is resident, through the router
//!   (evict A, start B, first event), against the same by hand: `Start{B,
//!   wait_ready, evict}` on the agent, then the request straight to B. The
//!   difference is what the router adds to B's own load time.
//!
//! The models are tiny random-weight GGUF files written by
//! tests/llama/make_model.py; the server is the python given with
//! `--venv-python` (scripts/bench passes the tests' `.venv`).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use resident_api::pb;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use crate::report::{Row, Table};
use crate::{Plan, Server, connect, measure, spawn_agent_text};

fn config(python: &Path, dir: &Path) -> String {
    let mut text = String::from(
        r#"[node]
name = "bench-router"
listen = "unix://@DIR@/agent.sock"
state_dir = "@DIR@/state"
on_full = "evict"

[[pool]]
name = "ram"
budget = "1500MB"
"#,
    );
    for name in ["a", "b"] {
        text += &format!(
            r#"
[[workload]]
name = "{name}"
command = ["{py}", "-m", "llama_cpp.server", "--model", "{model}", "--host", "127.0.0.1", "--port", "${{PORT}}", "--n_ctx", "512", "--use_mmap", "false", "--interrupt_requests", "false"]
stop_grace = "10s"
[workload.memory.ram]
weights = "1GB"
[workload.readiness]
http = "/v1/models"
timeout = "180s"
[workload.restart]
policy = "never"
"#,
            py = python.display(),
            model = dir.join(format!("{name}.gguf")).display(),
        );
    }
    text
}

/// One streamed chat completion: time to its first event, the events, and
/// the time from the first event to the end.
struct Streamed {
    first: Duration,
    events: usize,
    rest: Duration,
}

async fn stream(port: u16, model: &str, max_tokens: u32) -> anyhow::Result<Streamed> {
    // Token 2 is the models' end of sequence: suppressed, so a long
    // completion runs to max_tokens.
    let body = format!(
        r#"{{"model": "{model}", "stream": true, "max_tokens": {max_tokens}, "logit_bias": {{"2": -100}}, "messages": [{{"role": "user", "content": "hello"}}]}}"#
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
    let mut buf = vec![0u8; 16 << 10];
    let mut first = None;
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        seen.extend_from_slice(&buf[..n]);
        if first.is_none() && contains(&seen, b"data: ") {
            first = Some(began.elapsed());
        }
    }
    let total = began.elapsed();
    let text = String::from_utf8_lossy(&seen);
    if !text.starts_with("HTTP/1.1 200") {
        bail!(
            "{model} on port {port}: {}",
            text.lines().next().unwrap_or("no answer")
        );
    }
    let Some(first) = first else {
        bail!("{model} on port {port}: no event in {text}");
    };
    Ok(Streamed {
        first,
        events: text.matches("data: ").count(),
        rest: total - first,
    })
}

/// A GET of `path` until the whole answer is in.
async fn get_once(port: u16, path: &str) -> anyhow::Result<Duration> {
    let began = Instant::now();
    let mut s = TcpStream::connect(("127.0.0.1", port)).await?;
    s.set_nodelay(true)?;
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    s.write_all(request.as_bytes()).await?;
    let mut seen = Vec::new();
    s.read_to_end(&mut seen).await?;
    if !seen.starts_with(b"HTTP/1.1 200") {
        bail!(
            "GET {path} on port {port}: {}",
            String::from_utf8_lossy(&seen)
        );
    }
    Ok(began.elapsed())
}

fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

/// The router binary on `port`, in front of `socket`.
pub(crate) fn spawn_router(router: &Path, socket: &Path, port: u16) -> anyhow::Result<Server> {
    let child = Command::new(router)
        .arg("--agent")
        .arg(socket)
        .args(["--listen", &format!("127.0.0.1:{port}")])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .with_context(|| format!("starting {}", router.display()))?;
    Ok(Server {
        child,
        socket: socket.to_path_buf(),
        _dir: tempfile::tempdir()?,
    })
}

pub(crate) async fn wait_http(port: u16) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while TcpStream::connect(("127.0.0.1", port)).await.is_err() {
        if Instant::now() > deadline {
            bail!("nothing serves on port {port}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The rows; a note instead when there is no llama-cpp-python to run.
pub async fn rows(
    plan: &Plan,
    residentd: &Path,
    router: &Path,
    python: Option<&Path>,
    table: &mut Table,
) -> anyhow::Result<()> {
    let Some(python) = crate::python_with(python, "llama_cpp.server, gguf", "router", table) else {
        return Ok(());
    };
    let models = tempfile::tempdir()?;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/llama/make_model.py");
    for name in ["a", "b"] {
        let out = models.path().join(format!("{name}.gguf"));
        let status = Command::new(python)
            .arg(&script)
            .arg(&out)
            .args(["--embd", "64", "--layers", "2"])
            .status()?;
        if !status.success() {
            bail!("make_model.py {} failed", out.display());
        }
    }
    let agent = spawn_agent_text(residentd, &config(python, models.path()))?;
    let mut c = connect(&agent.socket).await?;
    let port = free_port()?;
    let _router = spawn_router(router, &agent.socket, port)?;
    wait_http(port).await?;

    // Warm A through the router; its own port for the direct requests.
    stream(port, "a", 1).await?;
    let direct_port = |i: pb::Instance| u16::try_from(i.port).unwrap_or(0);
    let get = pb::GetRequest {
        instance_id: "a".into(),
    };
    let a = direct_port(c.get(get).await?.into_inner());

    // The path alone: a small GET the server answers without the model.
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _ in 0..plan.router_requests {
        ours.push(get_once(port, "/upstream/a/v1/models").await?);
        theirs.push(get_once(a, "/v1/models").await?);
    }
    let (ours, theirs) = (measure::median(ours), measure::median(theirs));
    table.push(Row::latency(
        "router: GET /upstream/a/v1/models vs the server's own (median)".into(),
        ours,
        theirs,
        None,
        "",
    ));

    let (ours, theirs) = first_events(plan, port, a).await?;
    table.push(Row::latency(
        "router: first event, warm model (median)".into(),
        ours,
        theirs,
        None,
        "<= direct + 1 ms",
    ));
    table.push(Row::note(
        "router: added to the first event (median)".into(),
        signed_ms(ours, theirs),
    ));

    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    // Over the whole request: llama-cpp-python writes its events in bursts
    // (its generation thread and its event loop share the GIL), so a rate
    // from the first event on measures its bursts, not the path.
    let rate = |s: Streamed| s.events as f64 / (s.first + s.rest).as_secs_f64().max(1e-9);
    for _ in 0..plan.router_streams {
        ours.push(rate(stream(port, "a", 100).await?));
        theirs.push(rate(stream(a, "a", 100).await?));
    }
    table.push(Row::rate(
        "router: streamed events/s, 100 tokens (median)".into(),
        median_f64(ours),
        median_f64(theirs),
        ">= 0.98x direct",
    ));

    // Swaps: through the router (A resident, ask for B), then by hand
    // back (Start A evicting B, then the request straight to A).
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _ in 0..plan.router_swaps {
        ours.push(stream(port, "b", 1).await?.first);
        // The router ends its hold on B just after the answer: wait for
        // that before timing the swap back.
        let deadline = Instant::now() + Duration::from_secs(20);
        while !placeable(&mut c, "a").await? {
            if Instant::now() > deadline {
                bail!("the router's hold on b never ended");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let began = Instant::now();
        let started = c
            .start(pb::StartRequest {
                workload: "a".into(),
                instance_id: "a".into(),
                on_full: pb::Policy::Evict as i32,
                wait_ready: true,
                lease_ms: 0,
            })
            .await?
            .into_inner();
        let a = direct_port(started.instance.context("an instance")?);
        stream(a, "a", 1).await?;
        theirs.push(began.elapsed());
    }
    let (ours, theirs) = (measure::median(ours), measure::median(theirs));
    table.push(Row::latency(
        "router: swap to a model (evict, start, first event) vs by hand".into(),
        ours,
        theirs,
        None,
        "<= by hand + 50 ms",
    ));
    table.push(Row::note(
        "router: added to a swap (median)".into(),
        signed_ms(ours, theirs),
    ));
    Ok(())
}

/// Time to the first event of a one-token stream of `a` through the
/// router on `port` and straight to its server on `direct`, in turn, a new
/// connection each (medians).
async fn first_events(plan: &Plan, port: u16, direct: u16) -> anyhow::Result<(Duration, Duration)> {
    let (mut ours, mut theirs) = (Vec::new(), Vec::new());
    for _ in 0..plan.router_requests {
        ours.push(stream(port, "a", 1).await?.first);
        theirs.push(stream(direct, "a", 1).await?.first);
    }
    Ok((measure::median(ours), measure::median(theirs)))
}

/// The same first-event rows in front of the real llama-server (built by
/// scripts/llama-server), when it is built.
pub async fn llama_server_rows(
    plan: &Plan,
    residentd: &Path,
    router: &Path,
    python: Option<&Path>,
    table: &mut Table,
) -> anyhow::Result<()> {
    let Some((server, _models, model)) =
        crate::llama_server_and_model(python, "router (llama-server)", 64, 2, table)?
    else {
        return Ok(());
    };
    let config = format!(
        "[node]\nname = \"bench-router\"\nlisten = \"unix://@DIR@/agent.sock\"\nstate_dir = \"@DIR@/state\"\n\n[[pool]]\nname = \"ram\"\nbudget = \"2GB\"\n\n[[workload]]\nname = \"a\"\nflavor = \"llama-server\"\nprogram = \"{}\"\nmodel = \"{}\"\nctx = 512\nparallel = 1\n",
        server.display(),
        model.display()
    );
    let agent = spawn_agent_text(residentd, &config)?;
    let mut c = connect(&agent.socket).await?;
    let port = free_port()?;
    let _router = spawn_router(router, &agent.socket, port)?;
    wait_http(port).await?;
    stream(port, "a", 1).await?;
    let get = pb::GetRequest {
        instance_id: "a".into(),
    };
    let direct = u16::try_from(c.get(get).await?.into_inner().port).unwrap_or(0);
    let (ours, theirs) = first_events(plan, port, direct).await?;
    table.push(Row::latency(
        "router: first event, warm llama-server (median)".into(),
        ours,
        theirs,
        None,
        "<= direct + 1 ms",
    ));
    table.push(Row::note(
        "router: added to llama-server's first event (median)".into(),
        signed_ms(ours, theirs),
    ));
    Ok(())
}

/// Whether a Start of `workload` evicting others would be admitted now.
async fn placeable(
    c: &mut resident_api::pb::node_agent_client::NodeAgentClient<tonic::transport::Channel>,
    workload: &str,
) -> anyhow::Result<bool> {
    let p = c
        .place(pb::PlaceRequest {
            workload: workload.into(),
            on_full: pb::Policy::Evict as i32,
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(p.admitted)
}

fn signed_ms(ours: Duration, theirs: Duration) -> String {
    let d = ours.as_secs_f64() - theirs.as_secs_f64();
    format!("{:+.2} ms", d * 1e3)
}

fn median_f64(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}
