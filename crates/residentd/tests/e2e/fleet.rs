//! The Python package (`python/`, installed into `.venv` by scripts/test)
//! against real agents: its unit tests, then tests/fleet/check.py on three
//! agents of different sizes and an endpoint where no agent is.

use std::process::Command;

use crate::support::*;

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

#[test]
fn the_packages_unit_tests_pass() {
    let Some(python) = python() else {
        return;
    };
    let tests = workspace().join("python/tests");
    let out = Command::new(python)
        .args(["-m", "unittest", "discover", "-v", "-s"])
        .arg(&tests)
        .arg("-t")
        .arg(&tests)
        .output()
        .expect("run unittest");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(
        said.contains("Ran ") && !said.contains("Ran 0 tests"),
        "{said}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_and_fleet_placement_against_three_agents() {
    let Some(python) = python() else {
        return;
    };
    let mut agents = Vec::new();
    for (name, gb) in [("n1", 10), ("n2", 20), ("n3", 30)] {
        let dir = tempfile::tempdir().expect("tempdir");
        let text = format!("name = \"{name}\"\n") + &pool("ram", &format!("{gb}GB")) + &workloads();
        // The node's name comes first in [node]; config_text writes its own.
        let text = config_text(dir.path(), &text).replacen("name = \"test-node\"\n", "", 1);
        std::fs::write(dir.path().join("residentd.toml"), text).expect("write");
        agents.push((name, Daemon::start_in(dir).await));
    }
    let nowhere = tempfile::tempdir().expect("tempdir");
    let setup = serde_json::json!({
        "agents": agents
            .iter()
            .map(|(name, d)| (name.to_string(), d.socket.display().to_string().into()))
            .collect::<serde_json::Map<_, _>>(),
        "dead": nowhere.path().join("agent.sock").display().to_string(),
        "stop_pid": agents[1].1.pid(),
        "stopped": "n2",
    });
    let out = tokio::process::Command::new(python)
        .arg(workspace().join("tests/fleet/check.py"))
        .arg(setup.to_string())
        .output()
        .await
        .expect("run check.py");
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{said}");
    assert!(said.contains("fleet checks passed"), "{said}");
}
