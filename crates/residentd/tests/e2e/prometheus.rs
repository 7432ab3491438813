//! The alerting and recording rules (prometheus/residentd-rules.yml) pass
//! promtool's check and their unit tests; every query of the rules and of
//! the dashboard (prometheus/residentd-dashboard.json) reads a metric the
//! agent or the router registers, or one the rules record; and a real
//! Prometheus (the Debian package) scrapes a running agent and router,
//! loads the rules, and sees a refusal, its recording rules and alerts.

mod names;
mod server;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::support::*;
use names::*;
use server::{Killed, Prometheus, get, http};

/// Whether `program` (promtool, prometheus) is installed; when not, says
/// the test is skipped. CI installs them (.ci/run), so there a missing one
/// fails instead.
fn installed(program: &str) -> bool {
    let run = Command::new(program).arg("--version").output();
    if run.is_ok_and(|o| o.status.success()) {
        return true;
    }
    let why = format!("{program} is not installed (apt-get install prometheus)");
    assert!(std::env::var_os("CI").is_none(), "{why}");
    skip(&why);
    false
}

fn promtool(args: &[&str]) {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(workspace())
        .output()
        .expect("promtool runs");
    assert!(
        out.status.success(),
        "promtool {args:?}:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn the_rules_pass_promtool_check_and_their_unit_tests() {
    if !installed("promtool") {
        return;
    }
    promtool(&["check", "rules", RULES]);
    promtool(&["test", "rules", RULE_TESTS]);
}

#[test]
fn every_query_of_the_dashboard_and_the_rules_reads_a_real_metric() {
    assert_eq!(
        registered(),
        documented(),
        "what the metrics.rs files register is what the Metrics tables of docs/operations.md and docs/router.md list"
    );
    let known = known();
    let dashboard = dashboard_exprs();
    assert!(
        dashboard.len() > 20,
        "the dashboard's queries: {dashboard:?}"
    );
    let mut read = BTreeSet::new();
    for expr in dashboard.iter().chain(&rule_exprs()) {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "no metric read by {expr}");
        let unknown: Vec<&String> = names.difference(&known).collect();
        assert!(
            unknown.is_empty(),
            "{unknown:?} in {expr}: neither registered by the agent or the router, nor recorded by the rules"
        );
        read.extend(names);
    }
    let unread: Vec<String> = recorded().difference(&read).cloned().collect();
    assert!(unread.is_empty(), "recorded, read by nothing: {unread:?}");
}

/// The residentd-router binary beside residentd (`cargo test --workspace`
/// builds it); `None` after saying the test is skipped.
fn router_binary() -> Option<PathBuf> {
    let path = Path::new(RESIDENTD).with_file_name("residentd-router");
    if path.exists() {
        return Some(path);
    }
    let why = "no residentd-router beside residentd: cargo build -p residentd-router (cargo test --workspace builds it)";
    assert!(std::env::var_os("CI").is_none(), "{why}");
    skip(why);
    None
}

/// The router binary serving on a free loopback port in front of the
/// agent on `socket`, once it reaches the agent; killed when dropped.
async fn start_router(binary: &Path, socket: &Path) -> (Killed, u16) {
    let listen = free_port();
    let router = Command::new(binary)
        .arg("--agent")
        .arg(socket)
        .arg(format!("--listen=127.0.0.1:{listen}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start the router");
    let router = Killed(router);
    let healthy = eventually(async || {
        let answer = http(listen, &get("/health")).await;
        answer.is_some_and(|(status, _)| status == 200)
    });
    assert!(healthy.await, "the router never reached the agent");
    (router, listen)
}

/// A chat completion request for `model`, as an HTTP request.
fn chat(model: &str) -> String {
    let body =
        format!(r#"{{"model": "{model}", "messages": [{{"role": "user", "content": "hi"}}]}}"#);
    format!(
        "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_real_prometheus_scrapes_the_agent_and_the_router_and_sees_a_refusal() {
    if !installed("prometheus") {
        return;
    }
    let Some(router) = router_binary() else {
        return;
    };
    let metrics = free_port();
    let mut config = format!("metrics_listen = \"127.0.0.1:{metrics}\"\n") + &pool("ram", "10GB");
    config += &sleeper("small", "ram", 2, "");
    config += &sleeper("huge", "ram", 20, "");
    let mut d = Daemon::start(&config).await;
    d.started("small", "s1").await;
    let (_router, listen) = start_router(&router, &d.socket).await;
    let p = Prometheus::start(metrics, listen);
    p.sees("count(up == 1)", |v| v == 2.0).await;

    // Every rule loaded and evaluated without error on the real series.
    p.rules_evaluate().await;

    // A Start that cannot fit, refused at the agent, shows in a query.
    let refused = d.client.start(start_req("huge", "h1")).await;
    refused.expect_err("20 GB do not fit in 10");
    let refusals = r#"residentd_refusals_total{job="residentd", reason="OVER_BUDGET"}"#;
    p.sees(refusals, |v| v == 1.0).await;
    // The agent's own `instance` label (the instance id) arrives as
    // `exported_instance`, as the rules' annotations read it.
    let s1 = r#"residentd_instance_declared_bytes{job="residentd", exported_instance="s1"}"#;
    p.sees(s1, |v| v == 2e9).await;

    // The same start asked of the router: 503 unplaceable, twice (a rate
    // needs two samples), a 5xx ratio of 1 and its alert pending.
    let post = chat("huge");
    let first = http(listen, &post).await.expect("the router answers");
    assert_eq!(first.0, 503, "{}", first.1);
    let answered =
        r#"residentd_router_requests_total{job="residentd-router", model="huge", status="503"}"#;
    p.sees(answered, |v| v == 1.0).await;
    let second = http(listen, &post).await.expect("the router answers");
    assert_eq!(second.0, 503, "{}", second.1);
    p.sees(
        r#"model:residentd_router_requests_5xx:ratio_rate5m{model="huge"}"#,
        |v| v == 1.0,
    )
    .await;
    p.sees(
        r#"ALERTS{alertname="ResidentdRouter5xx", alertstate="pending", model="huge"}"#,
        |v| v == 1.0,
    )
    .await;

    // Refusals rising: more than 3 in the window since the first.
    for id in ["h2", "h3", "h4"] {
        let refused = d.client.start(start_req("huge", id)).await;
        refused.expect_err("20 GB do not fit in 10");
    }
    p.sees(refusals, |v| v == 6.0).await;
    p.sees(
        r#"reason:residentd_refusals:rate5m{reason="OVER_BUDGET"}"#,
        |v| v > 0.0,
    )
    .await;
    let rising =
        r#"ALERTS{alertname="ResidentdRefusalsRising", alertstate="firing", reason="OVER_BUDGET"}"#;
    p.sees(rising, |v| v == 1.0).await;

    p.scraped_only_registered_names().await;
    p.dashboard_queries_evaluate().await;
}
