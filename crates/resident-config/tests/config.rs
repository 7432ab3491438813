//! The brief's config parses into what the brief says; bad input is
//! refused with file, line and key.

use std::path::Path;
use std::time::Duration;

use resident_config::{Listen, parse};
use resident_core::{GB, Policy};
use resident_supervisor::{Readiness, RestartMode};

const BRIEF: &str = include_str!("../../../examples/brief.toml");

#[test]
fn the_brief_example_parses() {
    let c = parse(Path::new("brief.toml"), BRIEF).expect("the brief's config is valid");
    assert_eq!(c.node.name, "node-a");
    assert_eq!(
        c.node.listen,
        Listen::Unix("/run/residentd/residentd.sock".into())
    );
    assert_eq!(c.node.on_full, Policy::Refuse);
    assert_eq!(c.pools.len(), 1);
    assert_eq!(c.pools[0].pool.budget, Some(96 * GB));
    assert_eq!(c.pools[0].pool.reserve, 2 * GB);
    assert!(!c.pools[0].pool.live);
    let w = &c.workloads["coder-daily"];
    assert_eq!(w.spec.footprint("unified"), 59 * GB);
    assert_eq!(w.spec.excludes, ["role:planner"]);
    assert_eq!(w.argv[4], "${PORT}");
    assert_eq!(w.env["LLAMA_ARG_THREADS"], "8");
    assert_eq!(
        w.readiness,
        Readiness::Http {
            path: "/health".into()
        }
    );
    assert_eq!(w.readiness_timeout, Duration::from_secs(120));
    assert_eq!(
        (w.restart.mode, w.restart.max_restarts),
        (RestartMode::OnFailure, 5)
    );
    assert_eq!(w.idle_ttl, None, "0s means never");
    assert_eq!(
        c.groups.of("coder-small").map(|(g, _)| g.as_str()),
        Some("coders")
    );
    assert_eq!(
        c.workloads["planner"].spec.role.as_str(),
        "planner",
        "role defaults to the name"
    );
}

/// Replaces `from` by `to` in the brief and expects an error naming the
/// line of `to` (1-based) and containing `want`.
fn check(from: &str, to: &str, want: &str) {
    assert!(BRIEF.contains(from), "the brief holds {from:?}");
    let text = BRIEF.replacen(from, to, 1);
    let err = parse(Path::new("/etc/residentd.toml"), &text)
        .expect_err(want)
        .to_string();
    let offset = BRIEF.find(from).expect("checked above");
    let line = BRIEF[..offset].matches('\n').count() + 1;
    let at = format!("/etc/residentd.toml:{line}");
    assert!(err.starts_with(&at), "{err:?} should start with {at:?}");
    assert!(err.contains(want), "{err:?} should contain {want:?}");
}

#[test]
fn bad_input_names_file_line_and_key() {
    check(
        "budget = \"96GB\"",
        "budget = \"96XB\"",
        "pool[unified].budget: unknown unit \"XB\"",
    );
    check(
        "budget = \"96GB\"",
        "budget = \"-1GB\"",
        "negative byte quantity",
    );
    check(
        "weights = \"9GB\"",
        "weights = \"nine\"",
        "workload[coder-small].memory.unified.weights",
    );
    check(
        "[workload.memory.unified]\nweights = \"9GB\"",
        "[workload.memory.gpu7]\nweights = \"9GB\"",
        "no pool \"gpu7\"",
    );
    check(
        "on_full = \"refuse\"",
        "on_full = \"panic\"",
        "node.on_full: \"panic\" is not a policy",
    );
    check(
        "on_full = \"refuse\"",
        "cgroups = \"v3\"",
        "node.cgroups: \"v3\" is not a cgroup mode",
    );
    check(
        "on_full = \"refuse\"",
        "memory_slack = \"1 bucket\"",
        "node.memory_slack",
    );
    check(
        "listen = \"unix:///run/residentd/residentd.sock\"",
        "listen = \"tcp://127.0.0.1:7070\"",
        "TCP needs TLS",
    );
    check(
        "listen = \"unix:///run/residentd/residentd.sock\"",
        "listen = \"http://x\"",
        "expected unix:///PATH",
    );
    check(
        "stop_grace = \"10s\"",
        "stop_grace = \"10\"",
        "workload[coder-daily].stop_grace: \"10\" has no unit",
    );
    check(
        "policy = \"on-failure\"",
        "policy = \"sometimes\"",
        "workload[coder-daily].restart.policy",
    );
    let readiness = "[workload.readiness]\nhttp = \"/health\"";
    check(
        readiness,
        "[workload.readiness]\nhttp = \"/health\"\ntcp = true",
        "set exactly one of",
    );
    check(
        "\"--port\", \"${PORT}\"]\nenv",
        "\"--port\", \"${PORTS}\"]\nenv",
        "unknown macro ${PORTS}",
    );
    check(
        "members = [\"coder-daily\", \"coder-small\"]",
        "members = [\"coder-daily\", \"nobody\"]",
        "no workload \"nobody\"",
    );
    check(
        "excludes = [\"role:planner\"]",
        "excludes = [\"role:plan ner\"]",
        "workload[coder-daily].excludes",
    );
    check(
        "role = \"coder-daily\"",
        "role = \"coder daily\"",
        "workload[coder-daily].role",
    );
    check(
        "name = \"coder-small\"",
        "name = \"coder-daily\"",
        "workload[coder-daily].name: declared twice",
    );
    check(
        "priority = 0",
        "priority = \"high\"",
        "workload[coder-daily].priority: invalid type",
    );
    check(
        "idle_ttl = \"0s\"",
        "colour = \"red\"",
        "workload[coder-daily].colour: unknown field `colour`",
    );
}

#[test]
fn keys_serde_refuses_are_named_by_their_path() {
    // Unknown keys at every depth, and in an entry without a name.
    check(
        "on_full = \"refuse\"",
        "listn = \"x\"",
        "node.listn: unknown field `listn`",
    );
    check(
        "budget = \"96GB\"",
        "budgett = \"96GB\"",
        "pool[unified].budgett: unknown field `budgett`",
    );
    check(
        "swap = false",
        "swapp = false",
        "group[coders].swapp: unknown field `swapp`",
    );
    check(
        "http = \"/health\"",
        "htpp = \"/health\"",
        "workload[coder-daily].readiness.htpp: unknown field `htpp`",
    );
    check(
        "weights = \"9GB\"",
        "weight = \"9GB\"",
        "workload[coder-small].memory.unified.weight: unknown field `weight`",
    );
    check(
        "backoff_max = \"60s\"",
        "backof_max = \"60s\"",
        "workload[coder-daily].restart.backof_max: unknown field `backof_max`",
    );
    check(
        "name = \"planner\"\n",
        "nam = \"planner\"\n",
        "workload[2].nam: unknown field `nam`",
    );
    // Wrong types and a top-level table nobody knows.
    check(
        "max_restarts = 5",
        "max_restarts = \"five\"",
        "workload[coder-daily].restart.max_restarts: invalid type",
    );
    check(
        "env = { LLAMA_ARG_THREADS = \"8\" }",
        "env = { LLAMA_ARG_THREADS = 8 }",
        "workload[coder-daily].env.LLAMA_ARG_THREADS: invalid type",
    );
    check(
        "\"--port\", \"${PORT}\"]\nenv",
        "\"--port\", 7]\nenv",
        "workload[coder-daily].command[4]: invalid type",
    );
    check("[node]", "[nodes]", "nodes: unknown field `nodes`");
}

#[test]
fn a_workload_in_two_groups_is_refused() {
    let text = format!("{BRIEF}\n[[group]]\nname = \"second\"\nmembers = [\"coder-small\"]\n");
    let err = parse(Path::new("c.toml"), &text)
        .expect_err("two groups")
        .to_string();
    assert!(
        err.contains(
            "group[second].members: workload \"coder-small\" is already a member of group 'coders'"
        ),
        "{err}"
    );
}

#[test]
fn an_unreadable_file_names_it() {
    let err = resident_config::load(Path::new("/nonexistent/residentd.toml")).expect_err("missing");
    assert!(
        err.to_string()
            .starts_with("/nonexistent/residentd.toml: cannot read"),
        "{err}"
    );
}

#[test]
fn cgroup_memory_limits_are_the_host_footprint_plus_the_slack() {
    let text = BRIEF.replacen("on_full = \"refuse\"", "memory_slack = \"512MB\"", 1);
    let c = parse(Path::new("brief.toml"), &text).expect("valid");
    assert_eq!(c.node.cgroups, resident_supervisor::CgroupMode::Auto);
    let spec = c.workloads["coder-daily"].launch("i", 1, &c.node);
    assert_eq!(spec.memory_limit, Some(59 * GB + 512_000_000));
    let default = parse(Path::new("brief.toml"), BRIEF).expect("valid");
    let spec = default.workloads["coder-daily"].launch("i", 1, &default.node);
    assert_eq!(spec.memory_limit, Some(60 * GB), "1 GB of slack by default");
}
