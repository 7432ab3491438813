//! residentctl against a real residentd: tables, JSON, exit codes.

mod support;

use std::process::{Command, Output};

use support::*;

const CTL: &str = env!("CARGO_BIN_EXE_residentctl");

fn ctl(d: &Daemon, args: &[&str]) -> Output {
    Command::new(CTL)
        .arg("--socket")
        .arg(&d.socket)
        .args(args)
        .output()
        .expect("run residentctl")
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_subcommand_against_a_live_agent() {
    let mut config = String::from("[[pool]]\nname = \"unified\"\nbudget = \"96GB\"\n\n");
    config += &sleeper("coder-daily", "unified", 55, "");
    config += &sleeper("coder-small", "unified", 9, "");
    config += &sleeper("planner", "unified", 55, "");
    let d = Daemon::start(&config).await;
    let run = |args: &[&str]| ctl(&d, args);
    let o = tokio::task::block_in_place(|| run(&["start", "coder-daily", "--id", "a", "--wait"]));
    assert!(o.status.success(), "{:?}", text(&o));
    let (out, _) = text(&o);
    assert!(out.starts_with("INSTANCE"), "{out}");
    assert!(
        out.lines()
            .next()
            .is_some_and(|h| h.contains("RESTARTS  AGE")),
        "{out}"
    );
    let row: Vec<&str> = out
        .lines()
        .nth(1)
        .expect("a row")
        .split_whitespace()
        .collect();
    assert!(
        row[10].ends_with('s'),
        "a fresh instance is seconds old: {row:?}"
    );
    assert!(
        out.contains("a ") && out.contains("READY") && out.contains("55.0 GB"),
        "{out}"
    );
    let o = tokio::task::block_in_place(|| run(&["start", "coder-small", "--id", "b"]));
    assert!(o.status.success());
    // A refusal: exit 3, the reasons with their holders.
    let o = tokio::task::block_in_place(|| run(&["start", "planner", "--id", "c"]));
    assert_eq!(o.status.code(), Some(3));
    let (_, err) = text(&o);
    assert!(
        err.contains("unplaceable: 'planner' needs 55.0 GB but only 32.0 GB"),
        "{err}"
    );
    let holder = |id: &str, role: &str, gb: &str| {
        err.lines().any(|l| {
            let cells: Vec<&str> = l.split_whitespace().collect();
            cells == [id, role, gb, "GB"]
        })
    };
    assert!(
        holder("a", "coder-daily", "55.0") && holder("b", "coder-small", "9.0"),
        "{err}"
    );
    // The same as JSON, for scripts.
    let o = tokio::task::block_in_place(|| run(&["--json", "start", "planner", "--id", "c"]));
    assert_eq!(o.status.code(), Some(3));
    let v: serde_json::Value = serde_json::from_str(&text(&o).0).expect("JSON");
    assert_eq!(v["refusals"][0]["reason"], "OVER_BUDGET");
    assert_eq!(v["refusals"][0]["detail"]["holders"][1]["instance_id"], "b");
    // Place: exit 3 when it does not fit, 0 when it does (under evict).
    let o = tokio::task::block_in_place(|| run(&["place", "planner"]));
    assert_eq!(o.status.code(), Some(3));
    let o = tokio::task::block_in_place(|| run(&["place", "planner", "--policy", "evict"]));
    assert!(o.status.success());
    assert_eq!(text(&o).0.trim(), "fits after evicting a");
    // ls, get, touch, node, as JSON.
    let o = tokio::task::block_in_place(|| run(&["--json", "ls"]));
    let v: serde_json::Value = serde_json::from_str(&text(&o).0).expect("JSON");
    assert_eq!(v.as_array().map(Vec::len), Some(2));
    assert_eq!(v[0]["state"], "READY");
    let o = tokio::task::block_in_place(|| run(&["touch", "b", "--hold", "1m"]));
    assert!(o.status.success(), "{:?}", text(&o));
    let o = tokio::task::block_in_place(|| run(&["--json", "node"]));
    let v: serde_json::Value = serde_json::from_str(&text(&o).0).expect("JSON");
    assert_eq!(v["pools"][0]["used_bytes"], 64_000_000_000u64);
    let o = tokio::task::block_in_place(|| run(&["node"]));
    assert!(text(&o).0.contains("unified  96.0 GB"), "{}", text(&o).0);
    // top: one frame after the snapshot, bars of held and free.
    let o = tokio::task::block_in_place(|| run(&["top", "--frames", "1"]));
    assert!(o.status.success(), "{:?}", text(&o));
    let frame = text(&o).0;
    let bar: String = "#".repeat(26) + &".".repeat(14);
    assert!(
        frame.contains(&format!("unified    [{bar}] 64.0 GB used of 96.0 GB")),
        "{frame}"
    );
    // stop, then get shows EXITED; logs of it answer (empty).
    let o = tokio::task::block_in_place(|| run(&["stop", "a", "--grace", "2s"]));
    assert!(o.status.success());
    assert!(text(&o).0.contains("EXITED"));
    let o = tokio::task::block_in_place(|| run(&["logs", "a"]));
    assert!(o.status.success());
    // Errors and bad usage.
    let o = tokio::task::block_in_place(|| run(&["get", "ghost"]));
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o).1.contains("NOTFOUND: no instance 'ghost'"),
        "{:?}",
        text(&o)
    );
    let o = tokio::task::block_in_place(|| run(&["stop", "b", "--grace", "soon"]));
    assert_eq!(o.status.code(), Some(2));
    let o = tokio::task::block_in_place(|| run(&["frobnicate"]));
    assert_eq!(o.status.code(), Some(2));
    let o = Command::new(CTL)
        .args(["--socket", "/nonexistent/x.sock", "ls"])
        .output()
        .expect("run");
    assert_eq!(o.status.code(), Some(1));
    assert!(
        text(&o)
            .1
            .contains("cannot reach residentd at /nonexistent/x.sock")
    );
}
