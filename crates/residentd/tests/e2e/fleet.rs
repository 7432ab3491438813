//! The Python package (`python/`, installed into `.venv` by scripts/test)
//! against real agents: its unit tests, tests/fleet/check.py on three
//! agents of different sizes and an endpoint where no agent is, and
//! tests/fleet/ray_check.py: the same three agents under a real Ray
//! cluster of three nodes on loopback (Ray from PyPI);
//! tests/fleet/serve_check.py: examples/ray-serve-resident.py under Ray
//! Serve on such a cluster; tests/fleet/tls_check.py: an agent served
//! only over mutual TLS beside one on a Unix socket; and
//! tests/fleet/view_check.py: the fleet view (`residentd.fleet.View`)
//! against the fan-out on the three agents, one of which this test kills
//! and restarts when the script asks.

use std::process::Command;

use crate::support::*;
use crate::tls::{ca, connect_tls, leaf, tls_agent_serving, write};

/// The venv's python when it can import the package; else `None`, after
/// saying the test is skipped (CI installs it, so there it fails instead).
fn python() -> Option<std::path::PathBuf> {
    let python = venv_python("the Python package")?;
    let ok = Command::new(&python)
        .args(["-c", "import residentd.fleet"])
        .output()
        .is_ok_and(|o| o.status.success());
    if ok {
        return Some(python);
    }
    let why = "the residentd package is not installed in .venv: run scripts/test, which installs ./python";
    assert!(std::env::var_os("CI").is_none(), "{why}");
    skip(why);
    None
}

fn workloads() -> String {
    [1, 2, 3, 4, 8, 15, 20, 25]
        .iter()
        .map(|gb| sleeper(&format!("m{gb}"), "ram", *gb, ""))
        .collect()
}

/// Runs python/tests with unittest (verbose, on stderr), then prints on
/// stdout, as JSON, how many ran, whether they passed and each skipped
/// test with unittest's reason.
const UNITTEST: &str = r#"
import json, sys, unittest
tests = unittest.defaultTestLoader.discover(sys.argv[1], top_level_dir=sys.argv[1])
result = unittest.TextTestRunner(verbosity=2).run(tests)
skipped = [[test.id(), why] for test, why in result.skipped]
print(json.dumps({"ran": result.testsRun, "ok": result.wasSuccessful(), "skipped": skipped}))
"#;

#[test]
fn the_packages_unit_tests_pass() {
    let Some(python) = python() else {
        return;
    };
    let tests = workspace().join("python/tests");
    let out = Command::new(&python)
        .args(["-c", UNITTEST])
        .arg(&tests)
        .output()
        .expect("run unittest");
    let said = String::from_utf8_lossy(&out.stderr);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let summary: serde_json::Value = stdout
        .lines()
        .last()
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no summary from unittest: {stdout}\n{said}"));
    assert!(out.status.success() && summary["ok"] == true, "{said}");
    assert!(summary["ran"].as_u64().is_some_and(|n| n > 0), "{said}");
    // A test unittest skipped (the Ray labels without Ray, the group test
    // without root) passes in its count: each says so here.
    let skipped = summary["skipped"].as_array().expect("skipped");
    for one in skipped {
        let (test, why) = (
            one[0].as_str().unwrap_or("?"),
            one[1].as_str().unwrap_or("?"),
        );
        skip(&format!("python/tests {test}: {why}"));
    }
    // The Ray Serve example compiles (serve_check.py runs it).
    let example = workspace().join("examples/ray-serve-resident.py");
    let out = Command::new(&python)
        .args(["-m", "py_compile"])
        .arg(&example)
        .output()
        .expect("py_compile");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Three agents, n1 10 GB, n2 20 GB and n3 30 GB, each with the same
/// workloads m1 to m25 (N GB each).
async fn three_agents() -> Vec<(&'static str, Daemon)> {
    three_agents_with(|_| String::new(), |_| workloads()).await
}

/// Agents n1 10 GB, n2 20 GB and n3 30 GB, each with `node(name)` as more
/// `[node]` keys and `workloads(name)`.
async fn three_agents_with(
    node: impl Fn(&str) -> String,
    workloads: impl Fn(&str) -> String,
) -> Vec<(&'static str, Daemon)> {
    let mut agents = Vec::new();
    for (name, gb) in [("n1", 10), ("n2", 20), ("n3", 30)] {
        let dir = tempfile::tempdir().expect("tempdir");
        let text = format!("name = \"{name}\"\n")
            + &node(name)
            + &pool("ram", &format!("{gb}GB"))
            + &workloads(name);
        // The node's name comes first in [node]; config_text writes its own.
        let text = config_text(dir.path(), &text).replacen("name = \"test-node\"\n", "", 1);
        std::fs::write(dir.path().join("residentd.toml"), text).expect("write");
        agents.push((name, Daemon::start_in(dir).await));
    }
    agents
}

fn sockets(agents: &[(&str, Daemon)]) -> serde_json::Value {
    agents
        .iter()
        .map(|(name, d)| (name.to_string(), d.socket.display().to_string().into()))
        .collect::<serde_json::Map<_, _>>()
        .into()
}

/// Runs `script` with the JSON `setup`; asserts it passed, printing `passed`.
async fn check(python: &std::path::Path, script: &str, setup: serde_json::Value, passed: &str) {
    let out = tokio::process::Command::new(python)
        .arg(workspace().join(script))
        .arg(setup.to_string())
        .output()
        .await
        .expect("run the check");
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains(passed), "{said}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_and_fleet_placement_against_three_agents() {
    let Some(python) = python() else {
        return;
    };
    // n1 also has `talker`, whose known lines check.py reads with Logs.
    let talker = "[[workload]]\nname = \"talker\"\ncommand = [\"/bin/sh\", \"-c\", \"echo out one; echo err one >&2; echo out two; echo err two >&2; exec sleep 3600\"]\nstop_grace = \"2s\"\n[workload.memory.ram]\nweights = \"1GB\"\n";
    let agents = three_agents_with(
        |_| String::new(),
        |name| match name {
            "n1" => workloads() + talker,
            _ => workloads(),
        },
    )
    .await;
    let nowhere = tempfile::tempdir().expect("tempdir");
    let setup = serde_json::json!({
        "agents": sockets(&agents),
        "dead": nowhere.path().join("agent.sock").display().to_string(),
        "stop_pid": agents[1].1.pid(),
        "stopped": "n2",
    });
    check(
        &python,
        "tests/fleet/check.py",
        setup,
        "fleet checks passed",
    )
    .await;
}

/// One Ray cluster at a time: two on 2 cores would slow each other's
/// nodes past their start-up bounds.
static ONE_RAY_CLUSTER: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Whether the venv's python imports `modules` (`ray, residentd.ray`);
/// if not, says the test is skipped (CI installs them, so there it fails).
fn imports(python: &std::path::Path, modules: &str) -> bool {
    let ok = Command::new(python)
        .args(["-c", &format!("import {modules}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !ok {
        let why = format!("no {modules} in .venv: run scripts/test, which installs them");
        assert!(std::env::var_os("CI").is_none(), "{why}");
        skip(&why);
    }
    ok
}

/// The JSON setup of a Ray check: the agents' sockets and pids, a
/// temporary directory.
fn ray_setup(agents: &[(&str, Daemon)], tmp: &tempfile::TempDir) -> serde_json::Value {
    let pids: serde_json::Map<_, _> = agents
        .iter()
        .map(|(name, d)| (name.to_string(), d.pid().into()))
        .collect();
    serde_json::json!({
        "agents": sockets(agents),
        "pids": pids,
        "tmp": tmp.path().display().to_string(),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_placed_under_a_real_ray_cluster_of_three_nodes() {
    let Some(python) = python() else {
        return;
    };
    if !imports(&python, "ray, residentd.ray") {
        return;
    }
    let _one = ONE_RAY_CLUSTER.lock().await;
    let agents = three_agents().await;
    let tmp = tempfile::tempdir().expect("tempdir");
    check(
        &python,
        "tests/fleet/ray_check.py",
        ray_setup(&agents, &tmp),
        "ray checks passed",
    )
    .await;
}

/// examples/ray-serve-resident.py under real Ray Serve, on three Ray nodes
/// on loopback: each agent holds `chat` (8 GB), a server that answers with
/// its node's name; n3 takes one instance at most (`max_instances = 1`,
/// which Start checks and Place does not: a node that refuses after Place
/// ranked it first). tests/fleet/serve_check.py runs the documented
/// `serve run`, then scales, kills and deletes through Serve's Python API.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ray_serve_example_places_scales_and_moves_resident_models() {
    let Some(python) = python() else {
        return;
    };
    if !imports(&python, "ray.serve, residentd.ray") {
        return;
    }
    let _one = ONE_RAY_CLUSTER.lock().await;
    let server = workspace().join("tests/fleet/echo_model.py");
    let chat = |name: &str| {
        format!(
            "[[workload]]\nname = \"chat\"\ncommand = [\"{py}\", \"{server}\", \"${{PORT}}\", \"{name}\"]\nstop_grace = \"2s\"\n[workload.memory.ram]\nweights = \"8GB\"\n[workload.readiness]\nhttp = \"/health\"\ntimeout = \"30s\"\n",
            py = python.display(),
            server = server.display(),
        )
    };
    let cap = |name: &str| match name {
        "n3" => "max_instances = 1\n".to_string(),
        _ => String::new(),
    };
    let agents = three_agents_with(cap, chat).await;
    let tmp = tempfile::tempdir().expect("tempdir");
    check(
        &python,
        "tests/fleet/serve_check.py",
        ray_setup(&agents, &tmp),
        "serve checks passed",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_places_and_starts_through_an_agent_served_only_over_mutual_tls() {
    let Some(python) = python() else {
        return;
    };
    // `big` (8 GB) fits only on the TLS agent (10 GB); `small` (1 GB) on both.
    let workloads = sleeper("big", "ram", 8, "") + &sleeper("small", "ram", 1, "");
    let access = "[node.access]\noperators = [\"cert-dns:fleet\"]";
    let a = tls_agent_serving(access, false, &(pool("ram", "10GB") + &workloads));
    let plain = Daemon::start(&(pool("ram", "4GB") + &workloads)).await;
    let (cert, key) = leaf(&a.client_ca, &["fleet"]);
    let (foreign_cert, foreign_key) = leaf(&ca(), &["fleet"]);
    connect_tls(&a, &cert, &key).await; // bounded: until it listens
    let dir = a.dir.path();
    let setup = serde_json::json!({
        "tls": format!("localhost:{}", a.port),
        "ip": format!("127.0.0.1:{}", a.port),
        "socket": plain.socket.display().to_string(),
        "ca": write(dir, "fleet-ca.pem", &a.server_ca),
        "cert": write(dir, "fleet.pem", &cert),
        "key": write(dir, "fleet.key", &key),
        "client_ca": write(dir, "fleet-client-ca.pem", &a.client_ca.cert.pem()),
        "foreign_cert": write(dir, "foreign.pem", &foreign_cert),
        "foreign_key": write(dir, "foreign.key", &foreign_key),
    });
    check(
        &python,
        "tests/fleet/tls_check.py",
        setup,
        "tls fleet checks passed",
    )
    .await;
}

/// tests/fleet/view_check.py against the three agents (and `loner`, 2 GB,
/// which excludes m4) and an endpoint where no agent is. The script asks
/// for an agent to be killed (kill -9), restarted, stopped (SIGSTOP) or
/// continued by a line `@@ kill NAME`, `@@ restart NAME`, `@@ stop NAME`
/// or `@@ cont NAME` on its output; each is answered `done` on its input
/// once carried out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_view_places_as_the_fan_out_does_and_follows_each_agent() {
    use tokio::io::{AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};
    let Some(python) = python() else {
        return;
    };
    let loner = sleeper("loner", "ram", 2, "excludes = [\"role:m4\"]");
    let mut agents = three_agents_with(|_| String::new(), |_| workloads() + &loner).await;
    let nowhere = tempfile::tempdir().expect("tempdir");
    let setup = serde_json::json!({
        "agents": sockets(&agents),
        "dead": nowhere.path().join("agent.sock").display().to_string(),
    });
    let mut child = tokio::process::Command::new(&python)
        .arg(workspace().join("tests/fleet/view_check.py"))
        .arg(setup.to_string())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("run view_check.py");
    let mut stdin = child.stdin.take().expect("stdin");
    let mut lines = tokio::io::BufReader::new(child.stdout.take().expect("stdout")).lines();
    let mut stderr = child.stderr.take().expect("stderr");
    let errors = tokio::spawn(async move {
        let mut text = String::new();
        let _ = stderr.read_to_string(&mut text).await;
        text
    });
    let mut said = String::new();
    let run = async {
        while let Some(line) = lines.next_line().await.expect("its output") {
            let Some(asked) = line.strip_prefix("@@ ") else {
                said += &line;
                said.push('\n');
                continue;
            };
            let (verb, name) = asked.split_once(' ').expect("VERB NAME");
            let i = agents
                .iter()
                .position(|(n, _)| *n == name)
                .expect("an agent");
            match verb {
                "kill" => agents[i].1.kill(),
                "stop" => agents[i].1.signal(nix::sys::signal::Signal::SIGSTOP),
                "cont" => agents[i].1.signal(nix::sys::signal::Signal::SIGCONT),
                "restart" => {
                    let (n, d) = agents.remove(i);
                    agents.insert(i, (n, d.restart().await));
                }
                other => panic!("no such request: {other}"),
            }
            stdin.write_all(b"done\n").await.expect("answer");
            stdin.flush().await.expect("answer");
        }
        child.wait().await.expect("view_check.py ends")
    };
    let status = tokio::time::timeout(PATIENCE * 10, run)
        .await
        .expect("view_check.py ends within its bounds");
    let said = said + &errors.await.expect("its errors");
    assert!(status.success(), "{said}");
    assert!(said.contains("view checks passed"), "{said}");
}
