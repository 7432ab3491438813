//! The Prometheus endpoint, parsed by the reference Python parser, and
//! its documentation (docs/operations.md) listing exactly what it serves.

use std::collections::BTreeSet;
use std::io::{Read as _, Write as _};
use std::process::{Command, Stdio};

use crate::support::*;
use resident_api::pb;
use serde_json::Value;
use tokio::io::AsyncReadExt as _;

pub fn scrape(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .expect("request");
    let mut response = String::new();
    s.read_to_string(&mut response).expect("response");
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(
        head.starts_with("HTTP/1.0 200") || head.starts_with("HTTP/1.1 200"),
        "{head}"
    );
    assert!(
        head.to_lowercase()
            .contains("content-type: application/openmetrics-text"),
        "{head}"
    );
    body.to_string()
}

/// The samples of `body` as the reference Python parser reads them, one
/// JSON object each; `None` where there is no `.venv` (skipped, saying so).
fn samples(body: &str) -> Option<Vec<Value>> {
    let python = venv_python("the reference Python parser half")?;
    let script = workspace().join("tests/interop/parse_metrics.py");
    let mut child = Command::new(python)
        .arg(script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("python");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(body.as_bytes())
        .expect("feed");
    let out = child.wait_with_output().expect("parse");
    assert!(
        out.status.success(),
        "the parser refused the text:\n{}\n{body}",
        String::from_utf8_lossy(&out.stderr)
    );
    let samples: Vec<Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("json"))
        .collect();
    assert!(!samples.is_empty(), "the parser read no sample of:\n{body}");
    Some(samples)
}

fn value(samples: &[Value], name: &str, label: (&str, &str)) -> Option<f64> {
    samples
        .iter()
        .find(|s| s["name"] == name && s["labels"][label.0] == label.1)
        .and_then(|s| s["value"].as_f64())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_endpoint_counts_what_happened_and_parses() {
    let port = free_port();
    let mut config = format!("metrics_listen = \"127.0.0.1:{port}\"\n") + &pool("unified", "10GB");
    config += &sleeper("big", "unified", 6, "");
    config += &sleeper("small", "unified", 2, "");
    let mut d = Daemon::start(&config).await;
    d.started("big", "b1").await;
    d.started("small", "s1").await;
    d.client
        .start(start_req("big", "b2"))
        .await
        .expect_err("refused: no room");
    let mut evict = start_req("big", "b3");
    evict.on_full = resident_api::pb::Policy::Evict as i32;
    d.client.start(evict).await.expect("evicts b1");
    let body = tokio::task::spawn_blocking(move || scrape(port))
        .await
        .expect("joined");
    assert!(
        body.trim_end().ends_with("# EOF"),
        "OpenMetrics ends with # EOF"
    );
    assert!(
        body.contains("residentd_pool_used_bytes{pool=\"unified\"} 8000000000"),
        "{body}"
    );
    assert!(
        body.contains("residentd_refusals_total{reason=\"OVER_BUDGET\"} 1"),
        "{body}"
    );
    assert!(
        body.contains("residentd_evictions_total{evicting=\"big\",evicted=\"big\"} 1"),
        "{body}"
    );
    let Some(parsed) = samples(&body) else {
        return;
    };
    assert_eq!(
        value(&parsed, "residentd_pool_budget_bytes", ("pool", "unified")),
        Some(10e9)
    );
    assert_eq!(
        value(&parsed, "residentd_admissions_total", ("workload", "big")),
        Some(2.0)
    );
    assert_eq!(
        value(
            &parsed,
            "residentd_instance_declared_bytes",
            ("instance", "s1")
        ),
        Some(2e9)
    );
    let state = parsed
        .iter()
        .find(|s| s["name"] == "residentd_instance_state" && s["labels"]["instance"] == "b1");
    assert_eq!(
        state.map(|s| s["labels"]["state"].clone()),
        Some(Value::from("EXITED"))
    );
    let count = value(
        &parsed,
        "residentd_rpc_duration_seconds_count",
        ("rpc", "Start"),
    );
    assert_eq!(count, Some(4.0), "every Start was timed");
}

/// The metric names in the table of docs/operations.md's Metrics section.
fn documented() -> BTreeSet<String> {
    let path = workspace().join("docs/operations.md");
    let doc = std::fs::read_to_string(path).expect("docs/operations.md");
    let (_, section) = doc.split_once("\n## Metrics\n").expect("a Metrics section");
    let section = section.split("\n## ").next().unwrap_or_default();
    section
        .lines()
        .filter_map(|l| l.strip_prefix("| `")?.split_once('`'))
        .map(|(name, _)| name.to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_served_is_documented_and_every_documented_one_served() {
    let port = free_port();
    // A run that makes every family show a series: an admission, an
    // eviction, a refusal, a restart, an exposed server, RPCs, a probe
    // that gives no reading, a connection over its peer's share, an
    // overrun (a server holding more than it declared in a host pool).
    let reading = tempfile::NamedTempFile::new().expect("a reading file");
    std::fs::write(reading.path(), "not a number\n").expect("write");
    // A denied call needs a caller of another uid (root and the agent's
    // own are always admins): made with setuid, so only as root.
    let root = nix::unistd::geteuid().is_root();
    let socket_group = if root {
        "socket_group = \"nogroup\"\n"
    } else {
        ""
    };
    let mut config = format!("metrics_listen = \"127.0.0.1:{port}\"\nmax_connections = 1\n")
        + socket_group
        + &pool("ram", "10GB");
    config += &format!(
        "[[pool]]\nname = \"gpu0\"\nbudget = \"8GB\"\ndevice = \"file:{}\"\n\n",
        reading.path().display()
    );
    config += "[[pool]]\nname = \"host\"\nbudget = \"2GB\"\nhost = true\n\n";
    config += &crate::footprint::fat("fat", "host", 20, "");
    config += &sleeper("big", "ram", 6, "");
    config += &format!(
        "[[workload]]\nname = \"dozy\"\ncommand = [\"python3\", \"-u\", \"{}\", \"${{PORT}}\", \"10\"]\n[workload.memory.ram]\nweights = \"1GB\"\n[workload.readiness]\nhttp = \"/health\"\n[workload.sleep]\nsleep = \"POST /sleep\"\nwake = \"POST /wake_up\"\n",
        workspace().join("tests/sleep/standin.py").display()
    );
    config += "[[workload]]\nname = \"open\"\ncommand = [\"python3\", \"-m\", \"http.server\", \"${PORT}\", \"--bind\", \"0.0.0.0\"]\nexpose = \"loopback\"\n[workload.memory.ram]\nweights = \"1GB\"\n[workload.readiness]\ntcp = true\n[workload.restart]\npolicy = \"never\"\n";
    config += &shell(
        "crasher",
        "exit 1",
        "policy = \"on-failure\"\nmax_restarts = 1\nbackoff = \"50ms\"",
    );
    let mut d = Daemon::start(&config).await;
    // The client holds the node's one connection; a second is closed.
    let mut second = tokio::net::UnixStream::connect(&d.socket)
        .await
        .expect("connect");
    let mut byte = [0u8; 1];
    let read = tokio::time::timeout(PATIENCE, second.read(&mut byte)).await;
    assert!(matches!(read, Ok(Ok(0) | Err(_))), "{read:?}");
    d.started("open", "o").await;
    d.wait_state("o", pb::State::Exited).await;
    d.started("crasher", "c").await;
    let c = d.wait_state("c", pb::State::Failed).await;
    assert_eq!(c.restarts, 1);
    d.started("big", "b1").await;
    d.client
        .start(start_req("big", "b2"))
        .await
        .expect_err("refused: no room");
    let mut evict = start_req("big", "b3");
    evict.on_full = pb::Policy::Evict as i32;
    d.client.start(evict).await.expect("evicts b1");
    d.started("fat", "f").await;
    let over = until(async || (d.get("f").await.overrun_bytes > 0).then_some(()));
    assert!(over.await.is_some(), "the overrun is seen");
    // A sleep and a wake.
    let mut dozy = start_req("dozy", "z");
    dozy.wait_ready = true;
    d.client.start(dozy.clone()).await.expect("dozy starts");
    let asleep = pb::SleepRequest {
        instance_id: "z".into(),
    };
    d.client.sleep(asleep).await.expect("dozy sleeps");
    d.client.start(dozy).await.expect("dozy wakes");
    // A call refused for want of a role: another user, left out of the
    // allowlist by a reload, over the node's one connection (the test's
    // client lets go of it).
    let mut expected = documented();
    if root {
        let text = config_text(d.dir.path(), &format!("allow_uids = [4242]\n{config}"));
        std::fs::write(d.dir.path().join("residentd.toml"), text).expect("rewrite the config");
        d.signal(nix::sys::signal::Signal::SIGHUP);
        let idle = tonic::transport::Channel::from_static("http://127.0.0.1:9").connect_lazy();
        d.client = resident_api::pb::node_agent_client::NodeAgentClient::new(idle);
        use std::os::unix::fs::PermissionsExt as _;
        let open = std::fs::Permissions::from_mode(0o755);
        std::fs::set_permissions(d.dir.path(), open).expect("chmod");
        let socket = d.socket.clone();
        let denied = until(async || {
            let o =
                tokio::task::block_in_place(|| as_nobody_on(&socket, &[65534], &["stop", "zz"]));
            String::from_utf8_lossy(&o.stderr)
                .contains("PERMISSION_DENIED")
                .then_some(())
        });
        assert!(denied.await.is_some(), "the reload left uid 65534 a viewer");
    } else {
        skip(
            "metrics: residentd_access_denied_total is not shown: a denied caller needs another uid, made with setuid as root",
        );
        expected.remove("residentd_access_denied_total");
    }
    let body = tokio::task::spawn_blocking(move || scrape(port))
        .await
        .expect("joined");
    // OpenMetrics names a counter's family without its `_total`.
    let served: BTreeSet<String> = body
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, kind)| match kind {
            "counter" => format!("{name}_total"),
            _ => name.to_string(),
        })
        .collect();
    assert_eq!(
        served, expected,
        "docs/operations.md's Metrics table lists what the agent serves:\n{body}"
    );
}
