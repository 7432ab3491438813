//! Interoperability with a gRPC client we did not write: Python grpcio
//! from PyPI (installed into `.venv` at the workspace root by
//! `scripts/test` and CI), using only reflection, health and rich errors.

mod support;

use std::path::PathBuf;
use std::process::Command;

use support::*;

fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

#[tokio::test]
async fn python_grpcio_finds_the_service_checks_health_and_decodes_refusals() {
    let python = workspace().join(".venv/bin/python");
    if !python.exists() {
        let msg = "no .venv with grpcio: run scripts/test (it creates the venv) to include the Python interop test";
        assert!(std::env::var_os("CI").is_none(), "{msg}");
        eprintln!("SKIPPED: {msg}");
        return;
    }
    let mut config = String::from("[[pool]]\nname = \"unified\"\nbudget = \"96GB\"\n\n");
    config += &sleeper("coder-daily", "unified", 55, "");
    config += &sleeper("coder-small", "unified", 9, "");
    config += &sleeper("planner", "unified", 55, "");
    let d = Daemon::start(&config).await;
    let socket = d.socket.clone();
    let script = workspace().join("tests/interop/grpc_client.py");
    let out =
        tokio::task::spawn_blocking(move || Command::new(python).arg(script).arg(socket).output())
            .await
            .expect("joined")
            .expect("run python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the Python client failed:\n{stdout}");
    assert!(stdout.contains("ok   health of 'resident.v1.NodeAgent' is SERVING"));
    assert!(stdout.contains("ok   ErrorInfo OVER_BUDGET"));
    assert!(stdout.trim_end().ends_with("interop ok"));
}
