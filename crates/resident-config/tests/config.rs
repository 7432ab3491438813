//! The brief's config parses into what the brief says; bad input is
//! refused with file, line and key.

#![allow(clippy::disallowed_methods)] // clippy.toml is for src/validate/ only

use std::path::Path;
use std::time::Duration;

use resident_config::{Host, Listen, UNRESOLVED_ID, parse, parse_with};
use resident_core::{GB, Policy};
use resident_supervisor::{Readiness, RestartMode};

const BRIEF: &str = include_str!("../../../examples/brief.toml");

#[test]
fn the_brief_example_parses() {
    let c = parse(Path::new("brief.toml"), BRIEF).expect("the brief's config is valid");
    assert_eq!(c.node.name, "node-a");
    assert_eq!(
        c.node.listen,
        [Listen::Unix("/run/residentd/residentd.sock".into())]
    );
    assert_eq!(c.node.on_full, Policy::Refuse);
    // The connection defaults docs/config.md states.
    assert_eq!(
        (c.node.max_connections, c.node.max_connections_per_peer),
        (512, 64)
    );
    assert_eq!(
        (c.node.keepalive_interval, c.node.keepalive_timeout),
        (Duration::from_secs(30), Duration::from_secs(20))
    );
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
    let line = line_of(BRIEF, from);
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
        "max_connections = 0",
        "node.max_connections: must be at least 1",
    );
    check(
        "on_full = \"refuse\"",
        "max_connections_per_peer = 0",
        "node.max_connections_per_peer: must be at least 1",
    );
    check(
        "on_full = \"refuse\"",
        "keepalive_timeout = \"10ms\"",
        "node.keepalive_timeout: must be at least 100ms",
    );
    check(
        "on_full = \"refuse\"",
        "keepalive_interval = \"soon\"",
        "node.keepalive_interval",
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
    let spec = c.workloads["coder-daily"].launch("i", 1, &c.node, &[]);
    assert_eq!(spec.memory_limit, Some(59 * GB + 512_000_000));
    let default = parse(Path::new("brief.toml"), BRIEF).expect("valid");
    let spec = default.workloads["coder-daily"].launch("i", 1, &default.node, &[]);
    assert_eq!(spec.memory_limit, Some(60 * GB), "1 GB of slack by default");
}

/// The line (from 1) of the first `needle` in `text`.
fn line_of(text: &str, needle: &str) -> usize {
    let offset = text.find(needle).expect("the needle is in the text");
    text[..offset].matches('\n').count() + 1
}

/// Every name and file of `to` contains this, and exists on no machine.
const ABSENT: &str = "absent-here";

/// Replaces `from` by `to` in the brief: on this machine the result is
/// refused at the line of the first `ABSENT` name, one of its errors
/// starting with `want` (`key: message`; every error is reported, and this
/// machine lacks the brief's programs too); with the host look-ups off it
/// is valid.
fn check_host(from: &str, to: &str, want: &str) {
    assert!(BRIEF.contains(from), "the brief holds {from:?}");
    let text = BRIEF.replacen(from, to, 1);
    let file = Path::new("/etc/residentd.toml");
    let err = parse_with(file, &text, Host::Local)
        .expect_err(want)
        .to_string();
    let line = line_of(&text, ABSENT);
    let at = format!("/etc/residentd.toml:{line}: {want}");
    assert!(
        err.lines().any(|l| l.starts_with(&at)),
        "{err:?} should have a line starting with {at:?}"
    );
    if let Err(e) = parse_with(file, &text, Host::Elsewhere) {
        panic!("with the host look-ups off, {to:?} is valid: {e}");
    }
}

#[test]
fn names_and_files_missing_here_are_refused_here_only() {
    check_host(
        "on_full = \"refuse\"",
        "run_as = \"absent-here\"",
        "node.run_as: no user \"absent-here\" on this machine",
    );
    check_host(
        "priority = 0",
        "run_as = \"absent-here\"",
        "workload[coder-daily].run_as: no user \"absent-here\" on this machine",
    );
    check_host(
        "on_full = \"refuse\"",
        "socket_group = \"absent-here\"",
        "node.socket_group: no group \"absent-here\" on this machine",
    );
    check_host(
        "[\"/usr/bin/llama-server\", \"-m\", \"/models/coder.gguf\"",
        "[\"absent-here-server\", \"-m\", \"/models/coder.gguf\"",
        "workload[coder-daily].command: program \"absent-here-server\" is not on PATH",
    );
    check_host(
        "weights = \"55GB\"\nkv = \"4GB\"",
        "from_gguf = \"/absent-here/coder.gguf\"",
        "workload[coder-daily].memory.unified.from_gguf: /absent-here/coder.gguf: cannot open",
    );
    check_host(
        "on_full = \"refuse\"",
        "on_full = \"refuse\"\n[node.tls]\ncert = \"/absent-here/cert.pem\"\n\
         key = \"/absent-here/key.pem\"\nclient_ca = \"/absent-here/ca.pem\"",
        "node.tls.cert: cannot read \"/absent-here/cert.pem\"",
    );
}

#[test]
fn elsewhere_names_stay_unresolved_and_files_unread() {
    let text = BRIEF
        .replacen(
            "on_full = \"refuse\"",
            "run_as = \"absent-here\"\nsocket_group = \"absent-here\"\n[node.tls]\n\
             cert = \"/absent-here/cert.pem\"\nkey = \"/absent-here/key.pem\"\n\
             client_ca = \"/absent-here/ca.pem\"",
            1,
        )
        .replacen(
            "weights = \"55GB\"\nkv = \"4GB\"",
            "from_gguf = \"/absent-here/coder.gguf\"\nkv = \"4GB\"",
            1,
        );
    let c = parse_with(Path::new("c.toml"), &text, Host::Elsewhere).expect("valid elsewhere");
    let user = c.node.run_as.as_ref().expect("run_as");
    assert_eq!(
        (user.name.as_str(), user.uid, user.gid),
        ("absent-here", UNRESOLVED_ID, UNRESOLVED_ID)
    );
    assert_eq!(
        c.node.socket_group,
        Some(("absent-here".to_string(), UNRESOLVED_ID))
    );
    let tls = c.node.tls.as_ref().expect("tls");
    assert!(tls.cert.is_empty() && tls.key.is_empty() && tls.client_ca.is_empty());
    let d = c.workloads["coder-daily"].spec.demand["unified"];
    assert_eq!((d.weights, d.kv), (0, 4 * GB), "weights 0, kv as given");
    assert!(c.warnings.is_empty(), "{:?}", c.warnings);
}

#[test]
fn elsewhere_still_checks_the_document() {
    // (from, to, want): refused with the host look-ups off too.
    let rows = [
        (
            "weights = \"55GB\"\nkv = \"4GB\"",
            "from_gguf = \"/absent-here/coder.gguf\"\nkv_type = \"f8\"",
            "workload[coder-daily].memory.unified.kv_type: \"f8\" is not a KV cache type",
        ),
        (
            "on_full = \"refuse\"",
            "run_as = \"absent-here\"\non_full = \"panic\"",
            "node.on_full: \"panic\" is not a policy",
        ),
        (
            "members = [\"coder-daily\", \"coder-small\"]",
            "members = [\"coder-daily\", \"absent-here\"]",
            "group[coders].members: no workload \"absent-here\"",
        ),
    ];
    for (from, to, want) in rows {
        let text = BRIEF.replacen(from, to, 1);
        let err = parse_with(Path::new("c.toml"), &text, Host::Elsewhere)
            .expect_err(want)
            .to_string();
        assert!(err.contains(want), "{err:?} should contain {want:?}");
    }
}

#[test]
fn load_with_switches_the_host_look_ups() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("residentd.toml");
    let text = BRIEF.replacen("on_full = \"refuse\"", "run_as = \"absent-here\"", 1);
    std::fs::write(&path, text).expect("write");
    let err = resident_config::load(&path).expect_err("no such user here");
    assert!(
        err.to_string().contains(":7: node.run_as: no user"),
        "{err}"
    );
    let local = resident_config::load_with(&path, Host::Local).expect_err("the same");
    assert_eq!(local, err, "load is load_with(Host::Local)");
    let c = resident_config::load_with(&path, Host::Elsewhere).expect("valid elsewhere");
    assert_eq!(c.source, path);
}

#[test]
fn aliases_and_concurrency_limits() {
    let text = BRIEF.replacen(
        "priority = 0\n",
        "priority = 0\naliases = [\"coder\", \"qwen-coder\"]\nconcurrency_limit = 4\n",
        1,
    );
    let c = parse(Path::new("brief.toml"), &text).expect("valid");
    let w = &c.workloads["coder-daily"];
    assert_eq!(w.aliases, ["coder", "qwen-coder"]);
    assert_eq!(w.concurrency_limit, Some(4));
    assert_eq!(c.workloads["planner"].concurrency_limit, None);
    // An alias names one workload only, and is a name like any other.
    check(
        "idle_ttl = \"0s\"",
        "aliases = [\"planner\"]",
        "workload[coder-daily].aliases[0]: is the name of workload 'planner'",
    );
    check(
        "idle_ttl = \"0s\"",
        "aliases = [\"a b\"]",
        "workload[coder-daily].aliases[0]",
    );
    check(
        "idle_ttl = \"0s\"",
        "concurrency_limit = 0",
        "workload[coder-daily].concurrency_limit: must be at least 1",
    );
    let twice = text.replacen(
        "name = \"coder-small\"\n",
        "name = \"coder-small\"\naliases = [\"coder\"]\n",
        1,
    );
    let err = parse(Path::new("/etc/residentd.toml"), &twice)
        .expect_err("an alias used twice")
        .to_string();
    assert!(
        err.contains(
            "workload[coder-small].aliases[0]: is already an alias of workload 'coder-daily'"
        ),
        "{err}"
    );
}

#[test]
fn every_example_is_valid_for_the_machine_it_is_written_for() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).expect("examples/") {
        let path = entry.expect("an entry").path();
        if path.extension().is_none_or(|e| e != "toml") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read");
        // Elsewhere: the models, programs and users named are on that
        // machine, not this one; everything else must hold.
        if let Err(e) = parse_with(&path, &text, Host::Elsewhere) {
            panic!("{e}");
        }
        seen += 1;
    }
    assert!(seen >= 4, "only {seen} examples found in {}", dir.display());
}

#[test]
fn every_error_of_a_file_is_reported_in_one_run() {
    // Four mistakes in four places: the node, a pool, two workloads.
    let text = r#"[node]
name = "n"
listen = "unix:///tmp/residentd-unused/x.sock"
state_dir = "/tmp/x"
sample_every = "soon"

[[pool]]
name = "ram"
budget = "lots"

[[pool]]
name = "gpu"
budget = "8GB"

[[workload]]
name = "a"
command = ["/bin/true"]
[workload.memory.nowhere]
weights = "1GB"

[[workload]]
name = "b"
command = ["/bin/true"]
[workload.memory.gpu]
weights = "1GB"
[workload.restart]
policy = "sometimes"
"#;
    let e = parse_with(Path::new("four.toml"), text, Host::Elsewhere).expect_err("four errors");
    let text_of = e.to_string();
    let lines: Vec<&str> = text_of.lines().collect();
    assert_eq!(lines.len(), 4, "{text_of}");
    for (line, key) in [
        (lines[0], "node.sample_every"),
        (lines[1], "pool[ram].budget"),
        (lines[2], "workload[a].memory"),
        (lines[3], "workload[b].restart.policy"),
    ] {
        assert!(
            line.starts_with("four.toml:") && line.contains(key),
            "{key}: {text_of}"
        );
    }
    assert_eq!(e.also.len(), 3);
    let numbers: Vec<Option<usize>> = std::iter::once(e.line)
        .chain(e.also.iter().map(|a| a.line))
        .collect();
    assert!(
        numbers.windows(2).all(|w| w[0] <= w[1]),
        "by line: {numbers:?}"
    );
}

/// A program named by a relative path is made absolute once, against the
/// directory it runs in (its `cwd`, else the agent's): the file checked at
/// load is the file spawned, wherever the agent is when it spawns. One on
/// PATH, or already absolute, is left as written.
#[test]
fn a_relative_program_is_resolved_once_against_where_it_runs() {
    let with = |command: &str, cwd: &str| {
        let text = format!(
            "[node]\nname = \"n\"\nlisten = \"unix:///tmp/residentd-unused/r.sock\"\n[[pool]]\nname = \"ram\"\nbudget = \"1GB\"\n[[workload]]\nname = \"w\"\ncommand = [{command:?}, \"x\"]\n{cwd}[workload.memory.ram]\nweights = \"1MB\"\n"
        );
        let c = resident_config::parse(std::path::Path::new("r.toml"), &text)
            .unwrap_or_else(|e| panic!("{e}"));
        c.workloads["w"].argv[0].clone()
    };
    assert_eq!(
        with("bin/server", "cwd = \"/opt/m\"\n"),
        "/opt/m/bin/server"
    );
    let here = std::env::current_dir().expect("cwd");
    assert_eq!(
        with("./server", ""),
        here.join("./server").display().to_string()
    );
    assert_eq!(
        with("bin/server", "cwd = \"models\"\n"),
        here.join("models").join("bin/server").display().to_string()
    );
    assert_eq!(with("server", ""), "server", "looked up on PATH");
    assert_eq!(with("/usr/bin/server", ""), "/usr/bin/server");
}

/// A program its `run_as` user cannot reach (a `python3` that resolves
/// into a directory only root may enter, as /root/.pyenv/shims) is
/// refused at load, naming the program, the user and the directory in the
/// way: it was valid before, and its start then failed with a bare
/// `Permission denied (os error 13)`. As the node's `run_as` and as the
/// workload's own; the agent's own user (root here, which owns the
/// directory) still runs it.
#[test]
fn a_program_the_run_as_user_cannot_reach_is_refused_naming_both() {
    use std::os::unix::fs::PermissionsExt as _;
    if !nix::unistd::geteuid().is_root() {
        println!("skipped: running children as another user needs root");
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    // The temporary directory itself (0700) lets anyone through: only
    // pyenv/ is root's alone.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let root_only = dir.path().join("pyenv");
    let shims = root_only.join("shims");
    std::fs::create_dir_all(&shims).expect("mkdir");
    std::fs::set_permissions(&root_only, std::fs::Permissions::from_mode(0o700)).expect("chmod");
    let program = shims.join("python3");
    std::fs::copy("/bin/true", &program).expect("a program");
    let text = |node: &str, workload: &str| {
        format!(
            "[node]\nname = \"n\"\nlisten = \"unix:///tmp/residentd-unused/r.sock\"\n{node}[[pool]]\nname = \"ram\"\nbudget = \"1GB\"\n[[workload]]\nname = \"w\"\ncommand = [\"python3\", \"-m\", \"http.server\"]\nenv = {{ PATH = \"{}\" }}\n{workload}[workload.memory.ram]\nweights = \"1MB\"\n",
            shims.display()
        )
    };
    let file = Path::new("r.toml");
    for (node, workload) in [("run_as = \"nobody\"\n", ""), ("", "run_as = \"nobody\"\n")] {
        let err = parse_with(file, &text(node, workload), Host::Local)
            .expect_err("nobody cannot search a 0700 directory of root's")
            .to_string();
        let nobody = nix::unistd::User::from_name("nobody")
            .expect("look up")
            .expect("a user nobody");
        assert!(
            err.contains("workload[w].command: ")
                && err.contains(&format!(
                    "program {} cannot be run by user \"nobody\" (uid {}",
                    program.display(),
                    nobody.uid
                ))
                && err.contains(&format!("{} (mode 0700, owner uid 0", root_only.display()))
                && err.contains("is not searchable for it"),
            "{err}"
        );
    }
    parse_with(file, &text("", ""), Host::Local).expect("root, its owner, runs it");
    std::fs::set_permissions(&root_only, std::fs::Permissions::from_mode(0o711)).expect("chmod");
    parse_with(file, &text("run_as = \"nobody\"\n", ""), Host::Local)
        .expect("anyone may search 0711");
}
